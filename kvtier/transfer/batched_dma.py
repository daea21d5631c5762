"""Batched DMA: one ``cuMemcpyBatchAsync`` per address list, on kvtier's copy stream.

The driver call takes arrays of destination and source addresses and sizes, and
attributes (here one set for every copy: sources read in stream order). It is
resolved with ``cuGetProcAddress_v2(..., 12080)``, the CUDA 12.8 ABI: CUDA 13
dropped the ``failIdx`` argument from the symbol's newest version, so asking for
the 12.8 one keeps one signature whichever driver is installed.

:func:`build_batch` lays out the descriptors (the part that can be wrong without
a GPU, so it is tested with :func:`memmove_driver`, a stand-in with the driver's
signature that performs each copy with ``ctypes.memmove``); :func:`submit` makes
the call. The legacy default stream is refused: the batch call rejects it, and
a copy there would serialise with the engine's forward anyway.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from kvtier.errors import ConfigError, TransferError
from kvtier.transfer.address_list import CopyList

#: cuGetProcAddress's ABI version for the batch call: CUDA 12.8 (with failIdx)
BATCH_ABI_VERSION = 12080
#: CUmemcpySrcAccessOrder: sources are read in stream order (a load's source may have been written
#: by an earlier copy on the same stream)
SRC_ACCESS_ORDER_STREAM = 1
#: CUmemLocationType
LOCATION_DEVICE, LOCATION_HOST = 1, 2
#: CU_STREAM_LEGACY and the NULL stream: both the legacy default stream
_LEGACY_STREAMS = (0, 1)


class MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_uint), ("srcLocHint", MemLocation), ("dstLocHint", MemLocation), ("flags", ctypes.c_uint)]


#: CUresult cuMemcpyBatchAsync(CUdeviceptr* dsts, CUdeviceptr* srcs, size_t* sizes, size_t count,
#:     CUmemcpyAttributes* attrs, size_t* attrsIdxs, size_t numAttrs, size_t* failIdx, CUstream stream)
BATCH_MEMCPY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                                ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p)


@dataclass(slots=True)
class DmaBatch:
    """The descriptors of one batch call; the arrays stay alive as long as the batch does."""

    dsts: np.ndarray
    srcs: np.ndarray
    sizes: np.ndarray
    attrs: MemcpyAttributes
    attr_idxs: np.ndarray
    fail_idx: ctypes.c_size_t

    @property
    def count(self) -> int:
        return len(self.sizes)

    def args(self, stream: int) -> tuple:
        ptr = ctypes.c_void_p
        return (ptr(self.dsts.ctypes.data), ptr(self.srcs.ctypes.data), ptr(self.sizes.ctypes.data), self.count,
                ctypes.cast(ctypes.pointer(self.attrs), ptr), ptr(self.attr_idxs.ctypes.data), 1,
                ctypes.cast(ctypes.pointer(self.fail_idx), ptr), ptr(stream))


def build_batch(rows: CopyList, src_on_device: bool, dst_on_device: bool, device_index: int = 0) -> DmaBatch:
    """The descriptors for ``rows``: addresses and sizes as the driver reads them (uint64 / size_t),
    one attribute set for all (stream-ordered sources, where each side lives as a hint)."""
    def where(on_device: bool) -> MemLocation:
        return MemLocation(LOCATION_DEVICE, device_index) if on_device else MemLocation(LOCATION_HOST, 0)

    attrs = MemcpyAttributes(SRC_ACCESS_ORDER_STREAM, where(src_on_device), where(dst_on_device), 0)
    return DmaBatch(np.ascontiguousarray(rows.dst, dtype=np.uint64), np.ascontiguousarray(rows.src, dtype=np.uint64),
                    np.ascontiguousarray(rows.size, dtype=np.uint64), attrs, np.zeros(1, dtype=np.uint64), ctypes.c_size_t(0))


def submit(batch: DmaBatch, stream: int, call=None) -> None:
    """One batch call on ``stream`` (a CUstream handle). ``call``: the resolved driver entry point
    (default: :func:`batch_memcpy`); tests pass :func:`memmove_driver`."""
    if stream in _LEGACY_STREAMS:
        raise ConfigError("batched DMA runs on kvtier's copy stream, not the legacy default stream: "
                          "call it inside torch.cuda.stream(copy_stream)")
    if not batch.count:
        return
    fn = call if call is not None else batch_memcpy()
    err = fn(*batch.args(stream))
    if err != 0:
        raise TransferError(f"cuMemcpyBatchAsync failed with CUresult {err} at copy {batch.fail_idx.value} of {batch.count}")


@dataclass(frozen=True)
class BatchSupport:
    """Whether this machine's driver has the batch call (``reason`` says why not)."""

    available: bool
    reason: str


@lru_cache(maxsize=1)
def batch_support() -> BatchSupport:
    try:
        _resolve()
    except (OSError, TransferError) as e:
        return BatchSupport(False, str(e))
    return BatchSupport(True, f"cuMemcpyBatchAsync resolved through cuGetProcAddress_v2 at ABI {BATCH_ABI_VERSION}")


def batch_memcpy():
    """The driver's ``cuMemcpyBatchAsync`` (12.8 ABI) as a ctypes function."""
    return _resolve()


@lru_cache(maxsize=1)
def _resolve():
    driver = ctypes.CDLL("libcuda.so.1")
    get = driver.cuGetProcAddress_v2
    get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64, ctypes.POINTER(ctypes.c_int)]
    get.restype = ctypes.c_int
    fn, status = ctypes.c_void_p(), ctypes.c_int(0)
    err = get(b"cuMemcpyBatchAsync", ctypes.byref(fn), BATCH_ABI_VERSION, 0, ctypes.byref(status))
    if err != 0 or not fn.value:
        raise TransferError(f"cuGetProcAddress_v2(cuMemcpyBatchAsync, {BATCH_ABI_VERSION}) gave CUresult {err}, "
                            f"symbol status {status.value}: the driver predates CUDA 12.8")
    return BATCH_MEMCPY(fn.value)


def _memmove_driver(dsts, srcs, sizes, count, attrs, attr_idxs, num_attrs, fail_idx, stream) -> int:
    """:data:`BATCH_MEMCPY`'s signature on the CPU: reads the descriptors as the driver would and
    performs each copy with ``ctypes.memmove`` (the descriptor builder's test)."""
    u64 = ctypes.POINTER(ctypes.c_uint64)
    d, s, n = (ctypes.cast(p, u64) for p in (dsts, srcs, sizes))
    a = ctypes.cast(attrs, ctypes.POINTER(MemcpyAttributes)).contents
    if num_attrs != 1 or a.srcAccessOrder != SRC_ACCESS_ORDER_STREAM or ctypes.cast(attr_idxs, u64)[0] != 0:
        return 1  # CUDA_ERROR_INVALID_VALUE
    for i in range(count):
        ctypes.memmove(d[i], s[i], n[i])
    ctypes.cast(fail_idx, ctypes.POINTER(ctypes.c_size_t))[0] = count
    return 0


#: the CPU stand-in, typed like the driver's entry point
memmove_driver = BATCH_MEMCPY(_memmove_driver)
