"""The ``direct`` io backend: page-row copies with plain torch ops.

Cost model (measured on the 2-core CI machine; see ``kvtier bench transfer``):
a gather into a contiguous destination (``index_select(out=)``) or a scatter
from a contiguous source (``index_copy_``) runs near memcpy speed; a Python loop
of per-page copies, or a gather into a fresh temporary, runs at a fraction of
it (the temporary page-faults). So: walk the side with fewer consecutive runs,
one op per run; when both sides are scattered, go through a small per-thread
scratch buffer that stays in cache. Where both sides run together (the
allocator hands out ascending runs, so most loads and backups look like this),
each run is one slice copy with no index op; between host and GPU that is one
DMA per run straight from or into the host pool's pinned rows (a load does so
from layer_first rows only: page_first rows are strided; measured on an H200 by
``python -m kvtier.app.bench.gpu_check``). An all-layer backup into page_first
moves whole pages instead (:func:`backup_whole_pages`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Literal

import torch

from kvtier.pages import paired_runs, runs_of
from kvtier.transfer.rows import as_wide_rows

#: Runs may be at most this fraction of pages before chunked gather+scatter is cheaper.
_MAX_RUN_FRACTION = 0.25
#: Bytes of scratch per chunk of a scattered->scattered copy (fits in L2/L3 cache).
_SCRATCH_BYTES = 2 << 20
#: Bytes of device staging per chunk of a whole-page backup (see :func:`backup_whole_pages`).
_STAGING_BYTES = 32 << 20


@dataclass(frozen=True, slots=True)
class DirectPlan:
    mode: Literal["gather_into_runs", "scatter_from_runs", "scratch"]
    src: torch.Tensor
    dst: torch.Tensor
    #: (position in the index tensors, first page of the run, run length)
    runs: list[tuple[int, int, int]]
    #: (first src page, first dst page, length) of the runs along which both sides count up
    #: together; None when there are more than ``_MAX_RUN_FRACTION`` of the pages
    pairs: list[tuple[int, int, int]] | None = None


def plan(src_pages: torch.Tensor, dst_pages: torch.Tensor) -> DirectPlan:
    n = src_pages.numel()
    limit = max(1, int(n * _MAX_RUN_FRACTION))
    pairs = paired_runs(src_pages, dst_pages)
    pairs = pairs if len(pairs) <= limit else None
    dst_runs = runs_of(dst_pages)
    if len(dst_runs) <= limit:
        src_runs = runs_of(src_pages) if len(dst_runs) > 1 else None
        if src_runs is None or len(dst_runs) <= len(src_runs):
            return DirectPlan("gather_into_runs", src_pages, dst_pages, dst_runs, pairs)
        return DirectPlan("scatter_from_runs", src_pages, dst_pages, src_runs, pairs)
    src_runs = runs_of(src_pages)
    if len(src_runs) <= limit:
        return DirectPlan("scatter_from_runs", src_pages, dst_pages, src_runs, pairs)
    return DirectPlan("scratch", src_pages, dst_pages, [])


_local = threading.local()


def _scratch(like: torch.Tensor, rows: int) -> torch.Tensor:
    key = (like.device, like.dtype, like.shape[-1])
    cache = _local.__dict__.setdefault("scratch", {})
    buf = cache.get(key)
    if buf is None or buf.shape[0] < rows:
        buf = torch.empty((rows, like.shape[-1]), dtype=like.dtype, device=like.device)
        buf.zero_()
        cache[key] = buf
    return buf


def copy(p: DirectPlan, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
    if p.src.numel() == 0:
        return
    if src_rows.device != dst_rows.device:
        _copy_across(p, src_rows, dst_rows)
        return
    if p.pairs is not None and len(p.pairs) <= len(p.runs):  # no more ops than the index ops below, and no indices
        for s, d, n in p.pairs:
            dst_rows[d : d + n].copy_(src_rows[s : s + n])
        return
    src_idx, dst_idx = p.src, p.dst
    if src_rows.device.type != "cpu":  # both on one GPU: the indices go there too
        src_idx, dst_idx = src_idx.to(src_rows.device, non_blocking=True), dst_idx.to(src_rows.device, non_blocking=True)
    if p.mode == "gather_into_runs":
        for pos, first, length in p.runs:
            torch.index_select(src_rows, 0, src_idx[pos : pos + length], out=dst_rows[first : first + length])
        return
    if p.mode == "scatter_from_runs":
        for pos, first, length in p.runs:
            dst_rows.index_copy_(0, dst_idx[pos : pos + length], src_rows[first : first + length])
        return
    # scattered -> scattered: chunk through cached scratch
    row_bytes = src_rows.shape[-1] * src_rows.element_size()
    chunk_rows = max(1, _SCRATCH_BYTES // row_bytes)
    scratch = _scratch(src_rows, min(chunk_rows, p.src.numel()))
    for s in range(0, p.src.numel(), chunk_rows):
        k = min(chunk_rows, p.src.numel() - s)
        part = scratch[:k]
        torch.index_select(src_rows, 0, src_idx[s : s + k], out=part)
        dst_rows.index_copy_(0, dst_idx[s : s + k], part)


def _copy_across(p: DirectPlan, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
    """Host <-> GPU, on the caller's (the engine's copy) stream. Runs that both sides share are one
    DMA each; otherwise pages are gathered or scattered on the GPU or through pinned staging. Every
    DMA touches pinned memory (the host pool's own rows, or a pinned staging tensor from torch's
    caching host allocator, which is not reused before the copies that read it are done), so each
    is asynchronous. A host-side read of bytes coming from the GPU waits for the stream first: a
    host op is not ordered on a stream. Otherwise the engine's end-of-job event is the only
    synchronisation."""
    # Both sides in runs: one DMA per run between the pool's pinned rows and the GPU. From host rows
    # that are strided (page_first), torch would copy each run into pageable memory behind a stream
    # sync, so a load from them gathers into pinned staging below instead.
    if p.pairs is not None and (dst_rows.device.type != "cuda" or src_rows.is_contiguous()):
        for s, d, n in p.pairs:
            dst_rows[d : d + n].copy_(src_rows[s : s + n], non_blocking=True)
        return
    gpu = dst_rows.device if dst_rows.device.type == "cuda" else src_rows.device
    if dst_rows.device.type == "cuda":  # host -> device
        if p.mode == "scatter_from_runs":  # host pages in runs: DMA each run, scatter on the GPU
            dst_idx = p.dst.to(gpu, non_blocking=True)
            for pos, first, length in p.runs:
                dst_rows.index_copy_(0, dst_idx[pos : pos + length], src_rows[first : first + length].to(gpu, non_blocking=True))
            return
        staged = torch.empty((p.src.numel(), src_rows.shape[-1]), dtype=src_rows.dtype, pin_memory=True)
        torch.index_select(src_rows, 0, p.src, out=staged)  # scattered host pages, gathered on the host
        if p.mode == "gather_into_runs":  # device pages in runs: one DMA per run
            for pos, first, length in p.runs:
                dst_rows[first : first + length].copy_(staged[pos : pos + length], non_blocking=True)
        else:
            dst_rows.index_copy_(0, p.dst.to(gpu, non_blocking=True), staged.to(gpu, non_blocking=True))
        return
    # device -> host: gather on the GPU (one contiguous tensor), then DMA
    if p.mode == "scatter_from_runs":
        gathered = torch.cat([src_rows[first : first + length] for _, first, length in p.runs])
    else:
        gathered = torch.index_select(src_rows, 0, p.src.to(gpu, non_blocking=True))
    if p.mode == "gather_into_runs":  # host pages in runs: DMA straight into them
        for pos, first, length in p.runs:
            dst_rows[first : first + length].copy_(gathered[pos : pos + length], non_blocking=True)
        return
    staged = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
    staged.copy_(gathered, non_blocking=True)
    torch.cuda.current_stream(gpu).synchronize()  # the host scatter below reads what the DMA writes
    dst_rows.index_copy_(0, p.dst, staged)


def backup_whole_pages(host, device, host_pages: torch.Tensor, device_pages: torch.Tensor) -> None:
    """Device -> a page_first host pool, every layer and buffer.

    A page_first host page holds all its layers of a buffer in one run, so a chunk of pages is
    assembled on the device first (one gather per layer into staging shaped like those host
    pages) and leaves in one DMA per run of host pages, straight into the pool's pinned rows:
    a shuffled page is still one DMA of all its layers. Layer by layer the same bytes are strided
    on the host, and torch copies a strided run through pageable memory behind a stream sync
    (H200: 0.12x a plain ``copy_``). Staging comes from the device's caching allocator on the
    copy stream, so it is not reused before the DMAs that read it are done."""
    dev_idx = device_pages.to(device.device, non_blocking=True)
    n, layers = host_pages.numel(), host.spec.num_layers
    for b in host.spec.buffers:
        pages = host.buffers[b.name]  # [pages, layers, page_bytes]
        chunk = max(1, _STAGING_BYTES // (layers * b.page_bytes))
        for start in range(0, n, chunk):
            k = min(chunk, n - start)
            staging = torch.empty((k, layers, b.page_bytes), dtype=pages.dtype, device=device.device)
            idx = dev_idx[start : start + k]
            for layer in range(layers):
                as_wide_rows(staging[:, layer]).copy_(device.rows(b.name, layer).index_select(0, idx))
            for pos, first, length in runs_of(host_pages[start : start + k]):
                pages[first : first + length].copy_(staging[pos : pos + length], non_blocking=True)
