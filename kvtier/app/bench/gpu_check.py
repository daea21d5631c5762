"""The prepared device check: run it once wherever a GPU is lent (under 5 minutes on one GPU).

``python -m kvtier.app.bench.gpu_check`` prints one JSON object (``--device cpu`` runs the same code on the CPU
path -- worker thread and per-layer events -- which is how the test suite keeps it working).

Seven checks, through kvtier's own pools and transfer engine (pinned host memory, a
dedicated copy stream and per-layer CUDA events on a GPU):

1. **bit-exact round trips**: random bytes in device pages -> ``backup`` (all layers) into
   host pages -> ``load`` (per layer) into other device pages; every byte compared, for
   MLA+DSA (deepseek-v3.2: latent + FP8 indexer) and MHA (llama-3.1-8b), both host layouts.
2. **GB/s** of one 16k-token request (256 pages) moved per layer host -> device (a load) and
   all layers device -> host (a backup), as a ratio to a plain ``copy_`` of the same bytes
   between pinned host memory and the device in the same run (``transfers``): per host
   layout, with host pages in one run (how the allocator hands them out) and shuffled (the
   worst case). The headline ``load_gbps`` is the layer_first load of one run.
3. **per-layer overlap**: while layer ``i`` loads, "attention" of layer ``i - 1`` runs (a
   matmul per layer on the default stream, waiting only for its own layer). Reported:
   the overlapped wall time against load-then-compute run serially, in the same run.
5. **layered save** (what the vLLM connector's ``save_kv_layer`` does): a device->host job
   whose layer ``i`` is released right after "the forward" writes it (a matmul, then the
   layer's pages written on the default stream); the copy stream must wait for that write
   (a CUDA event recorded at the release). Host bytes compared with the device's.
4. **the cache through its executor**: the policy core with a local executor over device
   pools on the GPU (``HierarchicalCache``): a request computed and committed, evicted to
   host (write_back backup), begun again and loaded back layer by layer; bytes compared and
   the core's idle liveness check passed.

6. **the GPU copy methods** (``kvtier.transfer.backends``): ``direct`` (the current path),
   ``dma`` (one batched ``cuMemcpyBatchAsync`` per address list), ``kernel`` (the Triton copy
   kernel on as many programs as the GPU has SMs) and ``kernel_capped`` (its default, capped grid):
   every method x spec (deepseek-v3.2, llama-3.1-8b) x host layout x direction x page order
   against a plain ``copy_`` (``method_transfers``), round trips bit-exact per method, the
   per-layer overlap per method while a bf16 matmul runs on the default stream
   (``method_overlap``), and the row size up to which the kernel beats DMA (``thresholds``, what
   ``auto`` should use: ``KVTIER_KERNEL_MAX_ROW_BYTES``). Its first lines (``probes``) record
   whether ``cuGetProcAddress`` resolves the batch call and whether the kernel reads pinned host
   memory by its address. Methods this machine cannot run are listed in ``methods_skipped``.
7. **the node service's region** (``kvtier serve``): mapped as an engine maps it (registered with
   ``cudaHostRegister``), a round trip through it bit-exact and its load GB/s against a pinned host pool
   of the engine's own (``service_region``).

Prints one JSON object; exit 1 if a round trip is not bit-exact.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from functools import partial

import numpy as np
import torch
import typer

from kvtier.core.plans import Tier
from kvtier.pools import DevicePool, HostPool
from kvtier.spec import KVSpec
from kvtier.transfer import direct
from kvtier.transfer.address_list import CopyList
from kvtier.transfer.backends import IOBackend, get_io_backend
from kvtier.transfer.engine import TransferEngine


@dataclass
class GpuCheckReport:
    device: str
    device_name: str
    #: first: whether the batch call resolves and the kernel reads pinned host memory (and why not)
    probes: dict = field(default_factory=dict)
    methods: list[str] = field(default_factory=list)
    methods_skipped: dict = field(default_factory=dict)
    round_trips: list[dict] = field(default_factory=list)
    bit_exact: bool = True
    #: the headline: a per-layer load from layer_first host pages in one run (``transfers[0]``)
    load_gbps: float = 0.0
    copy_gbps: float = 0.0
    load_over_copy: float = 0.0
    #: loads (per layer) and backups (all layers) of the same pages per host layout, host pages in
    #: one run and shuffled, each against a plain copy_ in its direction
    transfers: list[dict] = field(default_factory=list)
    serial_ms: float = 0.0
    overlapped_ms: float = 0.0
    overlap_speedup: float = 0.0
    cache_round_trip: dict = field(default_factory=dict)
    layered_save: dict = field(default_factory=dict)
    #: the node service's region, registered with CUDA as an engine maps it: bit-exact, and loads from it
    #: against from a pinned pool of the engine's own
    service_region: dict = field(default_factory=dict)
    #: per method: round trips (bit-exact), transfers against copy_, overlap with a running matmul
    method_round_trips: list[dict] = field(default_factory=list)
    method_transfers: list[dict] = field(default_factory=list)
    method_overlap: list[dict] = field(default_factory=list)
    #: kernel vs DMA per row size, and the largest row size where the kernel was as fast
    thresholds: dict = field(default_factory=dict)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fill_random(dev: DevicePool, pages: list[int], seed: int) -> None:
    g = torch.Generator(device="cpu").manual_seed(seed)
    for b in dev.spec.buffers:
        for layer in range(dev.spec.num_layers):
            rows = dev.rows(b.name, layer).view(torch.uint8)
            rows[pages] = torch.randint(0, 256, (len(pages), rows.shape[1]), dtype=torch.uint8, generator=g).to(dev.device)


def round_trip(spec: KVSpec, layout: str, device: torch.device, pages: int, backend: str | IOBackend = "direct",
               host: HostPool | None = None) -> dict:
    """device pages [0, n) -> host pages (shuffled) -> device pages [n, 2n); bytes compared. ``host``: a pool
    of at least ``pages`` pages to go through (default: a pinned one of its own)."""
    dev = DevicePool(spec, 2 * pages, device)
    host = host or HostPool(spec, pages, layout)
    engine = TransferEngine(host, dev, backend)
    try:
        src = list(range(pages))
        dst = list(range(pages, 2 * pages))
        host_pages = torch.randperm(pages).tolist()
        _fill_random(dev, src, seed=pages)
        engine.backup(src, host_pages).wait()
        job = engine.load(host_pages, dst)
        for layer in range(spec.num_layers):
            job.wait_layer(layer)
        job.wait()
        equal = all(torch.equal(dev.rows(b.name, layer)[src], dev.rows(b.name, layer)[dst])
                    for b in spec.buffers for layer in range(spec.num_layers))
    finally:
        engine.close()
    return {"spec": spec.name, "layout": layout, "pages": pages, "buffers": [b.name for b in spec.buffers], "bit_exact": bool(equal)}


def cache_round_trip(spec: KVSpec, device: torch.device, pages: int) -> dict:
    """begin -> alloc -> compute (random bytes) -> commit; evict to host; begin again -> per-layer load."""
    from kvtier.cache import HierarchicalCache
    from kvtier.config import CacheConfig

    cache = HierarchicalCache(DevicePool(spec, pages + 1, device), HostPool(spec, pages), CacheConfig(write_policy="write_back"))
    try:
        tokens = list(range(pages * spec.page_size + 1))  # every page full, plus a one-token tail
        req = cache.begin(tokens)
        new = req.alloc(pages + 1)
        _fill_random(cache.device, new.pages[:pages], seed=7)
        computed = [cache.device.page_bytes(p) for p in new.pages[:pages]]
        req.commit(new.pages)
        evicted = cache.evict_device(pages)
        again = cache.begin(tokens)
        for layer in range(spec.num_layers):
            again.wait_layer(layer)
        _sync(device)
        equal = [cache.device.page_bytes(p) for p in again.cached_pages] == computed
        hit = (again.device_hit, again.host_hit)
        again.abort()
        cache.wait_idle()
        cache.check_integrity(idle=True)
    finally:
        cache.close()
    return {"spec": spec.name, "pages": pages, "evicted": evicted.evicted, "backed_up": evicted.backed_up, "hit_device_host": list(hit),
            "bit_exact": bool(equal and hit == (0, pages))}


def layered_save(spec: KVSpec, device: torch.device, pages: int, work: int) -> dict:
    """Per layer: busy the default stream, write the layer's pages on it, release the layer's copy."""
    dev = DevicePool(spec, pages, device)
    host = HostPool(spec, pages, "page_first")
    engine = TransferEngine(host, dev)
    busy = torch.randn(work, work, device=device) / work**0.5
    g = torch.Generator(device="cpu").manual_seed(11)
    try:
        job = engine.submit(Tier.DEVICE, Tier.HOST, list(range(pages)), list(range(pages)), layered=True)
        for layer in range(spec.num_layers):
            busy = torch.tanh(busy @ busy)  # a forward still running when the layer's write is queued
            for b in spec.buffers:
                rows = dev.rows(b.name, layer).view(torch.uint8)
                rows[:pages] = torch.randint(0, 256, (pages, rows.shape[1]), dtype=torch.uint8, generator=g).to(device)
            engine.release_layer(job, layer)
        job.wait()
        _sync(device)
        equal = all(host.page_bytes(p) == dev.page_bytes(p) for p in range(pages))
    finally:
        engine.close()
    return {"spec": spec.name, "pages": pages, "layers": spec.num_layers, "bit_exact": bool(equal)}


def bandwidth(spec: KVSpec, device: torch.device, pages: int, reps: int, *, direction: str = "load",
              shuffled: bool = False, layout: str = "layer_first", backend: str | IOBackend = "direct",
              host: HostPool | None = None) -> tuple[float, float]:
    """(kvtier GB/s, plain copy_ GB/s) of the same bytes, best of ``reps``: a per-layer ``load``
    (host -> device) or an all-layer ``backup`` (device -> host); host pages in one run, or
    ``shuffled``; the plain copy_ is one DMA between pinned host memory and the device. ``host``: the
    host pool (default: a pinned one of its own)."""
    dev = DevicePool(spec, pages, device)
    host = host or HostPool(spec, pages, layout)
    engine = TransferEngine(host, dev, backend)
    nbytes = pages * spec.page_bytes
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src, dst = (pinned, on_device) if direction == "load" else (on_device, pinned)
    best_move = best_copy = float("inf")
    try:
        order = list(range(pages))
        host_pages = torch.randperm(pages, generator=torch.Generator().manual_seed(3)).tolist() if shuffled else order
        for _ in range(reps):
            _sync(device)
            t0 = time.perf_counter()
            (engine.load(host_pages, order) if direction == "load" else engine.backup(order, host_pages)).wait()
            _sync(device)
            best_move = min(best_move, time.perf_counter() - t0)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            _sync(device)
            best_copy = min(best_copy, time.perf_counter() - t0)
    finally:
        engine.close()
    return nbytes / best_move / 1e9, nbytes / best_copy / 1e9


def overlap(spec: KVSpec, device: torch.device, pages: int, work: int, backend: str | IOBackend = "direct",
            layout: str = "layer_first", dtype: torch.dtype = torch.float32) -> tuple[float, float]:
    """(serial ms, overlapped ms): load all layers then compute each, vs compute layer i as soon as it lands."""
    dev = DevicePool(spec, pages, device)
    host = HostPool(spec, pages, layout)
    engine = TransferEngine(host, dev, backend)
    a = torch.randn(work, work, device=device).to(dtype)
    order = list(range(pages))

    def attend() -> None:
        a.matmul(a)

    try:
        attend()
        engine.load(order, order).wait()  # warm both paths
        _sync(device)
        t0 = time.perf_counter()
        engine.load(order, order).wait()
        for _ in range(spec.num_layers):
            attend()
        _sync(device)
        serial = time.perf_counter() - t0
        t0 = time.perf_counter()
        job = engine.load(order, order)
        for layer in range(spec.num_layers):
            job.wait_layer(layer)  # on CUDA: the compute stream waits for this layer's event only
            attend()
        job.wait()
        _sync(device)
        overlapped = time.perf_counter() - t0
    finally:
        engine.close()
    return serial * 1e3, overlapped * 1e3


def copy_methods(device: torch.device) -> tuple[dict[str, IOBackend], dict[str, str]]:
    """The methods to measure on ``device`` and the ones it cannot run (with why)."""
    from kvtier.transfer.gpu_methods import CopyMethodThresholds, kernel_copy_list

    programs = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    uncapped = CopyMethodThresholds(kernel_programs=programs)
    capped = get_io_backend("triton")
    candidates = {"direct": get_io_backend("direct"), "dma": get_io_backend("dma"),
                  "kernel": IOBackend("kernel", direct.plan, direct.copy, None, partial(kernel_copy_list, thresholds=uncapped),
                                      capped.unavailable),
                  "kernel_capped": capped}
    run, skipped = {}, {}
    for name, backend in candidates.items():
        reason = backend.unavailable(device) if backend.unavailable is not None else None
        if reason is None:
            run[name] = backend
        else:
            skipped[name] = reason
    return run, skipped


def probes(device: torch.device) -> dict:
    """Whether the driver resolves the batch call, and whether the kernel reads pinned host memory by its address."""
    from kvtier.transfer.batched_dma import batch_support
    from kvtier.transfer.triton_copy import unavailable

    support = batch_support()
    out = {"cuMemcpyBatchAsync": {"resolved": support.available, "detail": support.reason}}
    reason = unavailable() or (None if device.type == "cuda" else "no CUDA device")
    if reason is not None:
        out["triton_reads_pinned_host"] = {"ok": False, "detail": reason}
        return out
    from kvtier.transfer.gpu_methods import CopyMethodThresholds, kernel_copy_list

    try:
        host = torch.arange(4096, dtype=torch.int64).pin_memory()
        dst = torch.zeros(4096, dtype=torch.int64, device=device)
        rows = CopyList(np.array([host.data_ptr()]), np.array([dst.data_ptr()]), np.array([host.nbytes]))
        kernel_copy_list(rows, torch.device("cpu"), device, CopyMethodThresholds(kernel_programs=4))
        torch.cuda.synchronize(device)
        ok = bool(torch.equal(dst.cpu(), host))
        out["triton_reads_pinned_host"] = {"ok": ok, "detail": "read by its host address (UVA)" if ok else "bytes differ"}
    except Exception as e:  # the probe's answer, not the check's failure
        out["triton_reads_pinned_host"] = {"ok": False, "detail": f"{type(e).__name__}: {e}"[:300]}
    return out


def measure_thresholds(device: torch.device, methods: dict[str, IOBackend], reps: int, rows: int = 512) -> dict:
    """Kernel (capped) vs batched DMA on ``rows`` shuffled rows host -> device, per row size: the
    largest size where the kernel was at least as fast is ``auto``'s ``kernel_max_row_bytes``."""
    if "dma" not in methods or "kernel_capped" not in methods:
        return {"skipped": "needs both dma and kernel_capped"}
    cpu = torch.device("cpu")
    table = []
    best_size = 0
    stream = torch.cuda.Stream(device)  # both methods run on a copy stream, as in the transfer engine
    for size in (2 << 10, 4 << 10, 8 << 10, 16 << 10, 32 << 10, 64 << 10, 128 << 10):
        host = torch.empty(rows * size, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(rows * size, dtype=torch.uint8, device=device)
        order = np.random.default_rng(size).permutation(rows).astype(np.int64)
        lst = CopyList(host.data_ptr() + order * size, dev.data_ptr() + np.arange(rows, dtype=np.int64) * size,
                       np.full(rows, size, np.int64))
        times = {}
        for name in ("dma", "kernel_capped"):
            best = float("inf")
            for _ in range(reps + 1):  # the first is a warm-up (the kernel compiles)
                torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                with torch.cuda.stream(stream):
                    methods[name].copy_list(lst, cpu, device)
                torch.cuda.synchronize(device)
                best = min(best, time.perf_counter() - t0)
            times[name] = best
        table.append({"row_bytes": size, "dma_gbps": round(lst.nbytes / times["dma"] / 1e9, 3),
                      "kernel_capped_gbps": round(lst.nbytes / times["kernel_capped"] / 1e9, 3)})
        if times["kernel_capped"] <= times["dma"]:
            best_size = size
    return {"rows": rows, "per_row_size": table, "kernel_max_row_bytes": best_size}


def service_region(spec: KVSpec, device: torch.device, pages: int, reps: int) -> dict:
    """The node service's region as an engine maps it (:func:`~kvtier.service.region.map_region`, registered
    with CUDA): a round trip through it, bit-exact, and a load's GB/s from it against from a pinned pool of
    the engine's own, the same pages (issue 46's target: at least 0.95x)."""
    from kvtier.service.region import RegionFormat, create_region, map_region, remove_region

    layout = "page_first"
    region = create_region(RegionFormat.of(spec, layout), pages * spec.page_bytes)
    try:
        memory = map_region(region.path, region.size)
        host = HostPool(spec, region.num_pages, layout, memory=memory, pin_memory=memory.is_pinned())
        trip = round_trip(spec, layout, device, min(pages, region.num_pages), host=host)
        from_region, _ = bandwidth(spec, device, region.num_pages, reps, layout=layout, host=host)
        from_own, _ = bandwidth(spec, device, region.num_pages, reps, layout=layout)
        return {"spec": spec.name, "pages": region.num_pages, "registered": host.pinned, "bit_exact": trip["bit_exact"],
                "region_gbps": round(from_region, 3), "own_pool_gbps": round(from_own, 3),
                "region_over_own": round(from_region / from_own, 3)}
    finally:
        remove_region(region)


def run_gpu_check(device: str = "cuda", pages: int = 256, reps: int = 5, layers: int = 8, work: int = 2048,
                  budget_s: float = 240.0) -> GpuCheckReport:
    """``budget_s``: once the check has run this long, the copy methods not measured yet are skipped (listed
    in ``methods_skipped``), so that one run fits a lent GPU's few minutes."""
    started = time.perf_counter()
    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    report = GpuCheckReport(device=str(dev), device_name=name)
    report.probes = probes(dev)
    methods, report.methods_skipped = copy_methods(dev)
    report.methods = list(methods)
    specs = [KVSpec.preset("deepseek-v3.2").with_(num_layers=layers), KVSpec.preset("llama-3.1-8b").with_(num_layers=layers)]
    for spec in specs:
        for layout in ("layer_first", "page_first"):
            report.round_trips.append(round_trip(spec, layout, dev, min(pages, 64)))
    report.cache_round_trip = cache_round_trip(specs[0], dev, min(pages, 32))
    report.layered_save = layered_save(specs[1], dev, min(pages, 64), work)
    report.service_region = service_region(specs[1], dev, pages, reps)
    report.bit_exact = (all(r["bit_exact"] for r in report.round_trips) and report.cache_round_trip["bit_exact"]
                        and report.layered_save["bit_exact"] and report.service_region["bit_exact"])
    for layout in ("layer_first", "page_first"):
        for direction in ("load", "backup"):
            for shuffled in (False, True):
                moved, copy = bandwidth(specs[0], dev, pages, reps, direction=direction, shuffled=shuffled, layout=layout)
                report.transfers.append({"layout": layout, "direction": direction, "host_pages": "shuffled" if shuffled else "one run",
                                         "gbps": round(moved, 3), "copy_gbps": round(copy, 3), "over_copy": round(moved / copy, 3)})
    headline = report.transfers[0]  # layer_first, load, one run
    report.load_gbps, report.copy_gbps, report.load_over_copy = headline["gbps"], headline["copy_gbps"], headline["over_copy"]
    serial, overlapped = overlap(specs[0], dev, pages, work)
    report.serial_ms, report.overlapped_ms, report.overlap_speedup = round(serial, 2), round(overlapped, 2), round(serial / overlapped, 3)
    run_methods(report, methods, specs, dev, pages, reps, work, deadline=started + budget_s)
    if dev.type != "cuda":
        report.thresholds = {"skipped": "no CUDA device"}
    elif time.perf_counter() > started + budget_s:
        report.thresholds = {"skipped": "the check's time budget ran out before it (--budget-s)"}
    else:
        report.thresholds = measure_thresholds(dev, {n: b for n, b in methods.items() if n in report.methods}, reps)
    return report


def run_methods(report: GpuCheckReport, methods: dict[str, IOBackend], specs: list[KVSpec], dev: torch.device, pages: int, reps: int,
                work: int, deadline: float = float("inf")) -> None:
    """Every method: round trips, transfers against copy_ per spec x layout x direction x order, overlap
    (methods not begun by ``deadline``, a perf_counter time, are skipped)."""
    matmul = torch.bfloat16 if dev.type == "cuda" else torch.float32
    for name, backend in methods.items():
        if time.perf_counter() > deadline:
            report.methods_skipped[name] = "the check's time budget ran out before it (--budget-s)"
            report.methods.remove(name)
            continue
        for spec in specs:
            for layout in ("layer_first", "page_first"):
                trip = round_trip(spec, layout, dev, min(pages, 64), backend)
                report.method_round_trips.append({"method": name, **trip})
                report.bit_exact &= trip["bit_exact"]
                for direction in ("load", "backup"):
                    for shuffled in (False, True):
                        moved, copy = bandwidth(spec, dev, pages, reps, direction=direction, shuffled=shuffled, layout=layout,
                                                backend=backend)
                        report.method_transfers.append({"method": name, "spec": spec.name, "layout": layout, "direction": direction,
                                                        "host_pages": "shuffled" if shuffled else "one run", "gbps": round(moved, 3),
                                                        "over_copy": round(moved / copy, 3)})
        serial, overlapped = overlap(specs[0], dev, pages, work, backend, "page_first", matmul)
        report.method_overlap.append({"method": name, "layout": "page_first", "matmul": str(matmul).removeprefix("torch."),
                                      "serial_ms": round(serial, 2), "overlapped_ms": round(overlapped, 2),
                                      "speedup": round(serial / overlapped, 3)})


def main(device: str = typer.Option("cuda", help="cuda (the check) or cpu (the same code on the CPU path)"),
         pages: int = typer.Option(256, help="pages per load (256 x 64 tokens = a 16k-token request)"),
         layers: int = typer.Option(8, help="model layers kept"),
         work: int = typer.Option(2048, help="matmul size standing in for one layer's attention"),
         reps: int = typer.Option(5, help="timed repetitions of the bandwidth test (best reported)"),
         budget_s: float = typer.Option(240.0, help="seconds after which copy methods not yet measured are skipped")) -> None:
    if device.startswith("cuda") and not torch.cuda.is_available():
        typer.secho("kvtier gpu_check: error: no CUDA device here; run it where a GPU is lent, or pass --device cpu", err=True)
        raise SystemExit(2)
    report = run_gpu_check(device, pages, reps, layers, work, budget_s)
    json.dump(asdict(report), sys.stdout, indent=1)
    sys.stdout.write("\n")
    raise SystemExit(0 if report.bit_exact else 1)


if __name__ == "__main__":
    typer.run(main)
