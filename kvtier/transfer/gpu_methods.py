"""The GPU copy methods behind :class:`~kvtier.transfer.backends.IOBackend`: ``dma``, ``triton``, ``auto``.

Each takes a transfer as address lists (:mod:`kvtier.transfer.address_list`) and
runs on the current stream of the GPU side (the transfer engine's copy stream):

* ``dma``: one ``cuMemcpyBatchAsync`` per list (:mod:`kvtier.transfer.batched_dma`);
* ``triton``: the copy kernel over the list, its grid capped to
  ``kernel_programs`` programs (:mod:`kvtier.transfer.triton_copy`);
* ``auto``: per list, the kernel when its rows are many and small, else DMA
  (:class:`CopyMethodThresholds`).

The thresholds' defaults are vLLM 0.32's tuning on an H100 (its Triton swap
kernel for copies of at most 28 KiB, at least 16 of them; batched DMA above);
``python -m kvtier.app.bench.gpu_check`` measures and prints kvtier's own, and
``KVTIER_KERNEL_MAX_ROW_BYTES``, ``KVTIER_KERNEL_MIN_ROWS`` and
``KVTIER_KERNEL_PROGRAMS`` override them. A transfer engine reads the overrides
once, when it is built (:meth:`IOBackend.configured`): a bad one fails there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial

import torch

from kvtier.config import check_number
from kvtier.errors import ConfigError
from kvtier.transfer import direct
from kvtier.transfer.address_list import CopyList
from kvtier.transfer.io_backend import IOBackend


#: the most programs a kernel copy may run on: past what a GPU keeps resident at once (an H100/H200:
#: 132 SMs x 32 CTAs = 4,224) more programs only queue, and the cap exists to leave SMs to the forward
MAX_KERNEL_PROGRAMS = 4096

#: the environment variable that overrides each threshold
_ENV = {"kernel_max_row_bytes": "KVTIER_KERNEL_MAX_ROW_BYTES", "kernel_min_rows": "KVTIER_KERNEL_MIN_ROWS",
        "kernel_programs": "KVTIER_KERNEL_PROGRAMS"}


@dataclass(frozen=True)
class CopyMethodThresholds:
    """When ``auto`` runs the kernel: a list of at least ``kernel_min_rows`` rows averaging at most
    ``kernel_max_row_bytes``; the kernel runs on at most ``kernel_programs`` programs."""

    kernel_max_row_bytes: int = 28 << 10
    kernel_min_rows: int = 16
    #: programs (CTAs) a kernel copy runs on at most: a few SMs of an H100/H200's 132
    kernel_programs: int = 16

    def __post_init__(self) -> None:
        check_number(self, "kernel_max_row_bytes", at_least=0, integer=True)
        check_number(self, "kernel_min_rows", at_least=0, integer=True)
        check_number(self, "kernel_programs", at_least=1, at_most=MAX_KERNEL_PROGRAMS, integer=True)

    @classmethod
    def from_env(cls) -> CopyMethodThresholds:
        """The defaults with the environment's overrides; a bad one is a :class:`ConfigError` naming the
        variable, its range and the default."""
        values = {}
        for field, var in _ENV.items():
            raw = os.environ.get(var)
            if raw is None:
                continue
            try:
                values[field] = int(raw)
            except ValueError:
                values[field] = raw  # (not a whole number: refused just below, with the range)
            try:
                cls(**{field: values[field]})
            except ConfigError as e:
                raise ConfigError(f"{var}={raw!r}: {e}; set {var} within that range, or unset it for the default "
                                  f"{getattr(cls, field)}") from None
        return cls(**values)

    def method_for(self, rows: CopyList) -> str:
        """"kernel" or "dma" for this list."""
        if len(rows) >= self.kernel_min_rows and rows.nbytes <= self.kernel_max_row_bytes * len(rows):
            return "kernel"
        return "dma"


def _gpu(src: torch.device, dst: torch.device) -> torch.device:
    return dst if dst.type == "cuda" else src


def dma_copy_list(rows: CopyList, src: torch.device, dst: torch.device) -> None:
    from kvtier.transfer.batched_dma import build_batch, submit

    gpu = _gpu(src, dst)
    batch = build_batch(rows, src.type == "cuda", dst.type == "cuda", gpu.index or 0)
    submit(batch, torch.cuda.current_stream(gpu).cuda_stream)


def kernel_copy_list(rows: CopyList, src: torch.device, dst: torch.device, thresholds: CopyMethodThresholds | None = None) -> None:
    """``thresholds``: read from the environment now when None (a caller copying without a transfer engine)."""
    from kvtier.transfer.triton_copy import copy_list

    copy_list(rows, _gpu(src, dst), (thresholds or CopyMethodThresholds.from_env()).kernel_programs)


def auto_copy_list(rows: CopyList, src: torch.device, dst: torch.device, thresholds: CopyMethodThresholds | None = None) -> None:
    thresholds = thresholds or CopyMethodThresholds.from_env()
    if thresholds.method_for(rows) == "kernel":
        kernel_copy_list(rows, src, dst, thresholds)
    else:
        dma_copy_list(rows, src, dst)


def _reading_thresholds(copy_list):
    """``configure`` of a method with thresholds: ``copy_list`` bound to the environment's, read once."""
    return lambda: partial(copy_list, thresholds=CopyMethodThresholds.from_env())


def _dma_unavailable(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "batched DMA copies between pinned host memory and a GPU; the device pool is on the CPU (use 'direct')"
    from kvtier.transfer.batched_dma import batch_support

    support = batch_support()
    return None if support.available else support.reason


def _kernel_unavailable(device: torch.device) -> str | None:
    from kvtier.transfer.triton_copy import interpreting, unavailable

    reason = unavailable()
    if reason is None and device.type != "cuda" and not interpreting():
        reason = "the copy kernel runs on a GPU (on CPU pools only under TRITON_INTERPRET=1); use 'direct'"
    return reason


def _auto_unavailable(device: torch.device) -> str | None:
    return _dma_unavailable(device) or _kernel_unavailable(device)


def backends() -> list[IOBackend]:
    """The three GPU methods as io backends (``plan`` / ``copy``: direct's, for a caller copying rows itself)."""
    return [IOBackend(name, direct.plan, direct.copy, None, fn, why, configure) for name, fn, why, configure in (
        ("dma", dma_copy_list, _dma_unavailable, None),
        ("triton", kernel_copy_list, _kernel_unavailable, _reading_thresholds(kernel_copy_list)),
        ("auto", auto_copy_list, _auto_unavailable, _reading_thresholds(auto_copy_list)))]
