"""Any page transfer as an address list: (source address, destination address, bytes) per row.

A page's slice of one layer of one buffer is one contiguous row in every pool
kvtier and the engines keep (``pool.rows(name, layer)`` is ``[pages, row]`` with
contiguous rows: layer_first or page_first host pools, per-layer device tensors,
an engine's padded blocks). So any host layout and any page order, for every
buffer of the spec (K/V, the MLA latent, the DSA indexer, a hybrid group's
object pools: whatever exposes ``rows``), is one list of rows to copy -- what a
batched DMA call (:mod:`kvtier.transfer.batched_dma`) and a copy kernel
(:mod:`kvtier.transfer.triton_copy`) take.

:class:`AddressPlan` is built once per transfer: per buffer, each side's page
offsets (a vector: page id times the side's page stride) and each side's layer
base addresses. A layer's list is then one vector add per buffer
(:meth:`AddressPlan.layer`), every layer's one broadcast add
(:meth:`AddressPlan.all_layers`). Rows whose source and destination both
continue the previous row are merged (:func:`coalesce`): pages in one run of a
layer_first pool on both sides become one entry.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvtier.errors import SpecError


@dataclass(frozen=True, slots=True)
class CopyList:
    """Rows to copy: ``size[i]`` bytes from address ``src[i]`` to ``dst[i]`` (int64 arrays)."""

    src: np.ndarray
    dst: np.ndarray
    size: np.ndarray

    def __len__(self) -> int:
        return len(self.size)

    @property
    def nbytes(self) -> int:
        return int(self.size.sum())

    @property
    def alignment(self) -> int:
        """The largest power of two (up to 16) dividing every address and size: a kernel's word."""
        if not len(self):
            return 16
        bits = int(np.bitwise_or.reduce(self.src | self.dst | self.size)) | 16
        return bits & -bits


def coalesce(src: np.ndarray, dst: np.ndarray, size: np.ndarray) -> CopyList:
    """Merge each row into the previous one where both its source and its destination continue it."""
    if len(size) <= 1:
        return CopyList(src, dst, size)
    ends = size[:-1]
    continues = (src[1:] == src[:-1] + ends) & (dst[1:] == dst[:-1] + ends)
    if not continues.any():
        return CopyList(src, dst, size)
    starts = np.flatnonzero(np.concatenate(([True], ~continues)))
    return CopyList(src[starts], dst[starts], np.add.reduceat(size, starts))


@dataclass(frozen=True, slots=True)
class _Side:
    """One buffer on one side: layer ``l``'s row of page ``p`` starts at ``layer_base[l] + p * page_stride``."""

    layer_base: np.ndarray
    page_stride: int
    row_bytes: int


def _side(pool, name: str, layers: range) -> _Side:
    bases, stride, row = [], None, None
    for layer in layers:
        rows = pool.rows(name, layer)
        if rows.dim() != 2 or rows.stride(1) != 1:
            raise SpecError(f"buffer {name!r}, layer {layer}: rows must be [pages, row] with contiguous rows for an address list; "
                            f"got shape {tuple(rows.shape)}, strides {rows.stride()}")
        item = rows.element_size()
        if stride is None:
            stride, row = rows.stride(0) * item, rows.shape[1] * item
        elif (rows.stride(0) * item, rows.shape[1] * item) != (stride, row):
            raise SpecError(f"buffer {name!r}: layer {layer}'s rows differ from layer {layers[0]}'s in size or spacing")
        bases.append(rows.data_ptr())
    return _Side(np.asarray(bases, dtype=np.int64), int(stride), int(row))


def _as_int64(pages: torch.Tensor | np.ndarray | list[int]) -> np.ndarray:
    if isinstance(pages, torch.Tensor):
        pages = pages.cpu().numpy()
    return np.asarray(pages, dtype=np.int64)


class AddressPlan:
    """The address lists of one transfer of whole pages, ``src_pages[i]`` of ``src`` into
    ``dst_pages[i]`` of ``dst``, over every buffer and layer of the source's spec. Page ids are
    validated by the callers (the pools' and the cache's checks)."""

    def __init__(self, src, dst, src_pages, dst_pages):
        src_pages, dst_pages = _as_int64(src_pages), _as_int64(dst_pages)
        if src_pages.shape != dst_pages.shape:
            raise SpecError(f"an address list pairs pages one to one: {src_pages.size} source pages, {dst_pages.size} destination pages")
        self.num_layers = src.spec.num_layers
        layers = range(self.num_layers)
        #: per buffer: (source page offsets, destination page offsets, source side, destination side)
        self._parts = []
        for name in (b.name for b in src.spec.buffers):
            s, d = _side(src, name, layers), _side(dst, name, layers)
            if s.row_bytes != d.row_bytes:
                raise SpecError(f"buffer {name!r}: a page row is {s.row_bytes} bytes at the source and {d.row_bytes} at the "
                                "destination; build both pools from one spec")
            self._parts.append((src_pages * s.page_stride, dst_pages * d.page_stride, s, d))
        self.pages = int(src_pages.size)

    def layer(self, layer: int) -> CopyList:
        """Every buffer's rows of one layer (a per-layer load)."""
        srcs, dsts, sizes = [], [], []
        for s_off, d_off, s, d in self._parts:
            srcs.append(s_off + s.layer_base[layer])
            dsts.append(d_off + d.layer_base[layer])
            sizes.append(np.full(self.pages, s.row_bytes, dtype=np.int64))
        return coalesce(*_joined(srcs, dsts, sizes))

    def all_layers(self) -> CopyList:
        """Every buffer's rows of every layer (an all-layer backup), layer by layer."""
        srcs, dsts, sizes = [], [], []
        for s_off, d_off, s, d in self._parts:
            srcs.append((s.layer_base[:, None] + s_off[None, :]).ravel())
            dsts.append((d.layer_base[:, None] + d_off[None, :]).ravel())
            sizes.append(np.full(self.pages * self.num_layers, s.row_bytes, dtype=np.int64))
        return coalesce(*_joined(srcs, dsts, sizes))


def _joined(srcs: list[np.ndarray], dsts: list[np.ndarray], sizes: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if len(srcs) == 1:
        return srcs[0], dsts[0], sizes[0]
    return np.concatenate(srcs), np.concatenate(dsts), np.concatenate(sizes)


def run_with_memmove(rows: CopyList) -> None:
    """Copy an address list on the CPU, row by row (``ctypes.memmove``): the reference the GPU
    methods are checked against, and what their tests run the lists through."""
    import ctypes

    for s, d, n in zip(rows.src.tolist(), rows.dst.tolist(), rows.size.tolist()):
        ctypes.memmove(d, s, n)
