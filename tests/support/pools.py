"""Tiny specs, and what tests write into pools or make their copies do. Every test builds its own pools: no global state."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from kvtier import DevicePool, HostPool, KVSpec
from kvtier.core.plans import Tier


def tiny_specs(page_size: int = 4, num_layers: int = 3) -> dict[str, KVSpec]:
    return {
        "mha": KVSpec.mha("tiny-mha", num_layers, kv_heads=2, head_dim=8, page_size=page_size),
        "mla": KVSpec.mla("tiny-mla", num_layers, kv_lora_rank=16, qk_rope_dim=8, page_size=page_size),
        "dsa": KVSpec.dsa(
            "tiny-dsa", num_layers, kv_lora_rank=16, qk_rope_dim=8, index_head_dim=32, quant_block_size=16, page_size=page_size
        ),
    }


def fill_random(pool: DevicePool | HostPool, seed: int = 0) -> None:
    """Random bytes in every buffer of every layer (both pool kinds)."""
    gen = torch.Generator().manual_seed(seed)
    if isinstance(pool, HostPool):
        for t in pool.buffers.values():
            t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=gen))
        return
    for layers in pool.buffers.values():
        for t in layers:
            raw = t.view(-1).view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def device_page(pool: DevicePool, page: int) -> bytes:
    return pool.page_bytes(page)


def slots(pages: list[int], page_size: int) -> torch.Tensor:
    return torch.tensor([p * page_size + i for p in pages for i in range(page_size)], dtype=torch.int64)


def fill_pool(pool: DevicePool, value: int) -> None:
    """Every byte of every buffer of every layer set to ``value`` (what a failed copy leaves: not the page)."""
    for layer in range(pool.spec.num_layers):
        for b in pool.spec.buffers:
            pool.rows(b.name, layer).view(torch.uint8).fill_(value)


@contextmanager
def loads_refused(cache):
    """While open, every host->device copy of ``cache``'s transfer engine fails at submission."""
    real = cache.engine.submit

    def refuse_loads(src, dst, *args, **kwargs):
        if (src, dst) == (Tier.HOST, Tier.DEVICE):
            raise RuntimeError("injected: the copy engine failed")
        return real(src, dst, *args, **kwargs)

    cache.engine.submit = refuse_loads
    try:
        yield
    finally:
        cache.engine.submit = real
