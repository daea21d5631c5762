"""``kvtier bench transfer``: host<->device page transfers vs a contiguous copy of the same bytes.

For each spec x host layout x direction x buffer, it times the direct backend on
the page pattern kvtier produces (scattered source pages, destination pages
allocated as a run by kvtier's allocator) and on a fully scattered pattern
(both sides random: the worst case an engine can hand in), and, right before,
a plain ``copy_`` of the same number of bytes between two preallocated, touched
buffers larger than the last-level cache. Pools are larger than the cache too,
so neither side is measured from cache.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from kvtier.app.bench.timing import median_seconds
from kvtier.layout import LAYOUTS
from kvtier.pools import DevicePool, HostPool
from kvtier.spec import KVSpec
from kvtier.transfer.backends import get_io_backend


@dataclass(frozen=True)
class TransferCase:
    spec: str
    layout: str
    direction: str
    buffer: str
    pattern: str
    page_bytes: int
    pages: int
    gbps: float
    memcpy_gbps: float
    ratio: float


def _memcpy_seconds(nbytes: int, scratch: tuple[torch.Tensor, torch.Tensor], reps: int) -> float:
    src, dst = scratch
    span = src.numel() - nbytes
    offsets = [(i * 7919 * 4096) % max(span, 1) // 64 * 64 for i in range(reps + 2)]

    def run(i: int) -> None:
        o, p = offsets[i], offsets[i + 1]
        dst[p : p + nbytes].copy_(src[o : o + nbytes])

    return median_seconds(run, reps)


def run_transfer_bench(
    specs: tuple[str, ...] = ("deepseek-v3.2", "llama-3.1-8b"),
    pages_per_transfer: int = 256,
    layers: int = 4,
    pool_pages: int = 1024,
    reps: int = 12,
    seed: int = 0,
    device: str = "cpu",
) -> list[TransferCase]:
    """Cases as :class:`TransferCase`; ``layers`` trims the model's depth (per-layer cost is depth-independent)."""
    gen = torch.Generator().manual_seed(seed)
    backend = get_io_backend("direct")
    cases: list[TransferCase] = []
    scratch_bytes = 512 << 20
    scratch = (torch.ones(scratch_bytes, dtype=torch.uint8), torch.ones(scratch_bytes, dtype=torch.uint8))
    n = pages_per_transfer
    for spec_name in specs:
        spec = KVSpec.preset(spec_name, num_layers=layers)
        dev = DevicePool(spec, pool_pages, device)
        for layout in LAYOUTS:
            host = HostPool(spec, pool_pages, layout)
            rand = [torch.randperm(pool_pages, generator=gen)[:n] for _ in range(reps + 2)]
            runs = [torch.arange(s, s + n) for s in (torch.randint(0, pool_pages - n, (reps + 2,), generator=gen).tolist())]
            for b in spec.buffers:
                for direction in ("load_per_layer", "backup_all_layers"):
                    for pattern in ("kvtier", "scattered"):
                        if direction == "load_per_layer":
                            # source: host pages (scattered); destination: device pages
                            dst_pages = runs if pattern == "kvtier" else rand[1:] + rand[:1]

                            def op(i: int, b=b, dst_pages=dst_pages, host=host, rand=rand, dev=dev) -> None:
                                plan = backend.plan(rand[i], dst_pages[i])
                                backend.copy(plan, host.rows(b.name, i % layers), dev.rows(b.name, i % layers))

                            moved = n * b.page_bytes
                        else:
                            # source: device pages written by the engine (scattered); destination: host pages
                            dst_pages = runs if pattern == "kvtier" else rand[1:] + rand[:1]

                            def op(i: int, b=b, dst_pages=dst_pages, host=host, rand=rand, dev=dev) -> None:
                                plan = backend.plan(rand[i], dst_pages[i])
                                for layer in range(layers):
                                    backend.copy(plan, dev.rows(b.name, layer), host.rows(b.name, layer))

                            moved = n * b.page_bytes * layers
                        base = _memcpy_seconds(moved, scratch, reps)
                        t = median_seconds(op, reps)
                        gbps, mgbps = moved / t / 1e9, moved / base / 1e9
                        cases.append(
                            TransferCase(
                                spec_name,
                                layout,
                                direction,
                                b.name,
                                pattern,
                                b.page_bytes,
                                n,
                                round(gbps, 3),
                                round(mgbps, 3),
                                round(gbps / mgbps, 3),
                            )
                        )
            del host
    return cases


def as_json_rows(cases: list[TransferCase]) -> list[dict]:
    return [asdict(c) for c in cases]
