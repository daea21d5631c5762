"""The node service's host region: one file in shared memory, laid out exactly as a
:class:`~kvtier.pools.host.HostPool` (:func:`~kvtier.pools.host.region_offsets`), so every page format
holds in it byte for byte and an engine's copies read and write it where it is mapped.

Why a file under ``/dev/shm`` rather than :mod:`multiprocessing.shared_memory`: on Python 3.11 every
process that attaches a ``SharedMemory`` registers it with its own resource tracker, which unlinks the
segment when that process exits -- an engine that stops would take the service's region with it (the
tracker can be told otherwise only from 3.13). A file is named by the service alone, lives in a fresh
directory of mode 0700 (nobody else can even look it up) with mode 0600 itself, is on tmpfs (memory,
never written back to a disk), and is removed by the service on SIGTERM.
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
from dataclasses import dataclass

import torch

from kvtier.errors import ServiceError, ServiceProtocolError
from kvtier.layout import LAYOUTS
from kvtier.pools.host import region_offsets
from kvtier.spec import KVSpec

#: where regions are made: tmpfs, memory that is never written back to a disk
SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class RegionFormat:
    """What fixes the region's bytes: the spec (by fingerprint), its buffers' page sizes and the host layout.
    Every engine attached to one service shares it (this slice serves one page format per service)."""

    fingerprint: str
    layout: str
    num_layers: int
    buffer_page_bytes: tuple[int, ...]

    @classmethod
    def of(cls, spec: KVSpec, layout: str) -> RegionFormat:
        return cls(spec.fingerprint(), layout, spec.num_layers, tuple(b.page_bytes for b in spec.buffers))

    @classmethod
    def of_shards(cls, spec: KVSpec, layout: str, tp_size: int) -> RegionFormat:
        """A page of ``tp_size`` tensor-parallel ranks whose shards each make ``spec``: one region page holds
        every rank's shard of it, rank ``r``'s buffers after those of ranks ``0..r-1`` (so each rank's shards
        of every page are one contiguous slice of the region, :meth:`shard`, laid out as a host pool of
        ``spec`` alone). The fingerprint names the tensor-parallel size: another split never shares pages."""
        if tp_size == 1:
            return cls.of(spec, layout)
        return cls(f"{spec.fingerprint()}-tp{tp_size}", layout, spec.num_layers, tuple(b.page_bytes for b in spec.buffers) * tp_size)

    def shard(self, num_pages: int, rank: int, tp_size: int) -> tuple[int, int]:
        """(offset, size) of rank ``rank``'s slice of a region of ``num_pages`` pages (:meth:`of_shards`)."""
        offsets, end = region_offsets(self.buffer_page_bytes, self.num_layers, num_pages)
        per = len(self.buffer_page_bytes) // tp_size
        start = offsets[rank * per]
        stop = offsets[(rank + 1) * per] if rank + 1 < tp_size else end
        return start, stop - start

    @property
    def page_bytes(self) -> int:
        return self.num_layers * sum(self.buffer_page_bytes)

    def size(self, num_pages: int) -> int:
        return region_offsets(self.buffer_page_bytes, self.num_layers, num_pages)[1]

    def as_wire(self) -> dict:
        return {"fingerprint": self.fingerprint, "layout": self.layout, "num_layers": self.num_layers,
                "buffer_page_bytes": list(self.buffer_page_bytes)}

    @classmethod
    def from_wire(cls, d: dict) -> RegionFormat:
        fp, layout, layers, sizes = d.get("fingerprint"), d.get("layout"), d.get("num_layers"), d.get("buffer_page_bytes")
        ok = (type(fp) is str and 0 < len(fp) <= 128 and layout in LAYOUTS and type(layers) is int and 0 < layers <= 1 << 12
              and type(sizes) is list and 0 < len(sizes) <= 16 and all(type(s) is int and 0 < s <= 1 << 30 for s in sizes))
        if not ok:
            raise ServiceProtocolError(f"hello's format is not a page format: {str(d)[:120]}")
        return cls(fp, layout, layers, tuple(sizes))


@dataclass(frozen=True)
class Region:
    """A region file: ``path`` holds ``num_pages`` pages of ``format`` in ``size`` bytes."""

    path: str
    format: RegionFormat
    num_pages: int
    size: int


def create_region(fmt: RegionFormat, host_bytes: int, parent: str = SHM_DIR) -> Region:
    """A fresh zeroed region of as many whole pages of ``fmt`` as ``host_bytes`` holds, in a new 0700
    directory under ``parent``, itself 0600; its memory is allocated now (a full tmpfs fails here,
    not at a client's first write)."""
    num_pages = host_bytes // fmt.page_bytes
    if num_pages < 1:
        raise ServiceError(f"the service's {host_bytes} host bytes hold no {fmt.page_bytes}-byte page of this format; raise --host-gb")
    size = fmt.size(num_pages)
    folder = tempfile.mkdtemp(prefix="kvtier-region-", dir=parent)  # mode 0700
    path = os.path.join(folder, "region")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)
    except OSError as e:
        shutil.rmtree(folder, ignore_errors=True)
        raise ServiceError(f"cannot make a {size}-byte region in {parent} ({e}); lower --host-gb or grow {parent}") from None
    return Region(path, fmt, num_pages, size)


def remove_region(region: Region) -> None:
    shutil.rmtree(os.path.dirname(region.path), ignore_errors=True)


def map_region(path: str, size: int) -> torch.Tensor:
    """The region as a flat uint8 tensor over a shared mapping: writes are the service's and every other
    client's to see. The mapping lives as long as the tensor (and its views). A normal tensor even when
    mapped under ``torch.inference_mode`` (vLLM's step): kvtier's transfer thread writes into it."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError as e:
        raise ServiceError(f"cannot open the node service's region {path} ({e})") from None
    try:
        if os.fstat(fd).st_size != size:
            raise ServiceError(f"the node service's region {path} is {os.fstat(fd).st_size} bytes, not the {size} it announced")
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    with torch.inference_mode(False):
        return torch.frombuffer(mapping, dtype=torch.uint8)
