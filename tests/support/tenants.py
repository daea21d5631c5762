"""What the tenant tests share: a small MLA+DSA reference model, its spec and page size, seeded prompts, the check
that a request's logits equal a recompute's, and a cache whose pages a test pushes down to one tier."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from kvtier.app.engine import ReferenceEngine
from kvtier.app.model import ModelConfig, ReferenceModel
from kvtier.build import TierConfig, build_cache
from kvtier.config import CacheConfig, StorageConfig
from support.service import running_service

CFG = ModelConfig(hidden=64, num_layers=2, num_heads=2, qk_nope_dim=16, qk_rope_dim=8, v_head_dim=16, kv_lora_rank=32,
                  index_heads=2, index_head_dim=32, quant_block_size=16, index_topk=24, mlp_hidden=128, page_size=8)
MODEL = ReferenceModel(CFG)
SPEC = CFG.kv_spec()
PS = CFG.page_size


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist()


def same_as_recompute(base: ReferenceEngine, tokens: list[int], got) -> None:
    want = base.prefill(tokens)
    assert torch.equal(want.logits, got.logits)


@contextmanager
def tier_cache(tmp_path: Path, tier: str, config: CacheConfig = CacheConfig()) -> Iterator[object]:
    """A cache for pages pushed down to ``tier`` (:func:`push_down`): device, host and ``storage`` (a file L3 under
    ``tmp_path``) in one cache, or ``service`` (the host tier a ``kvtier serve``'s region, shared with every engine of the
    namespace); closed after."""
    with running_service(tmp_path) if tier == "service" else nullcontext() as svc:
        if svc is not None:
            cache = build_cache(SPEC, TierConfig(device_pages=64, service=svc.socket), config)
        else:
            cache = build_cache(SPEC, TierConfig(device_pages=64, host_pages=64), config, StorageConfig(url=f"file://{tmp_path}"))
        try:
            yield cache
        finally:
            cache.close()


def push_down(cache, tier: str) -> None:
    """Every page of ``cache`` out of the tiers above ``tier`` (device: none; host and service: the device; storage:
    the device and host), once its copies are done."""
    cache.wait_idle()
    if tier != "device":
        cache.evict_device(cache.device.num_pages)
    if tier == "storage":
        cache.evict_host(cache.host.num_pages)


def tier_hit(result, tier: str) -> int:
    """The tokens ``result`` hit in ``tier`` (the node service's region is the host tier)."""
    return {"device": result.device_hit_tokens, "host": result.host_hit_tokens, "storage": result.storage_hit_tokens,
            "service": result.host_hit_tokens}[tier]
