"""L2 host pool: the spec's buffers in host memory, ``layer_first`` or ``page_first``.

Memory is pinned when CUDA is present (so copies to the device are async DMA),
allocated once and touched once (fresh pages fault on first write and would
make the first transfers several times slower). Before allocating, the pool
checks the bytes it needs against available host memory minus a reserve and
raises :class:`HostMemoryBudgetError` with the numbers and the fix.

The allocator hands out whole pages only; token-unit requests must be
page-aligned. Transfers in engine terms (token slot indices) are
:meth:`load_to_device_per_layer` and :meth:`backup_from_device_all_layer`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvtier.alloc import PageAllocator
from kvtier.errors import HostMemoryBudgetError, PageAlignmentError, SpecError
from kvtier.layout import DEFAULT_HOST_LAYOUT, HostLayout, LayoutKind, check_layout
from kvtier.pages import check_layer, check_page_count, check_pages_in_range, pages_to_slots, slots_to_pages
from kvtier.pools.device import DevicePool
from kvtier.pools.memory import DEFAULT_RESERVE_BYTES, host_memory_available
from kvtier.transfer.rows import as_wide_rows
from kvtier.spec import KVSpec

#: host buffers start on a 4 KiB boundary (see :func:`page_aligned_empty`)
ALIGN_BYTES = 4096


def page_aligned_empty(nbytes: int, *, pin_memory: bool = False) -> torch.Tensor:
    """A flat uint8 tensor of ``nbytes`` whose first byte is 4 KiB-aligned.

    The kernel copies page objects between the page cache and host pages at the
    same offset within a 4 KiB page as the object's file offset. torch's
    allocator returns 64-byte-aligned memory (an address 64 past a 4 KiB
    boundary here); against the 72-byte page header that put every write's
    destination 8 bytes ahead of its source modulo 4 KiB, and the copy loop's
    loads stalled on the stores just made to the same low address bits (4K
    aliasing): parallel L3 file writes ran at 0.6x their aligned speed.
    Page-aligned buffers also suit pinning and DMA registration."""
    raw = torch.empty(nbytes + ALIGN_BYTES - 1, dtype=torch.uint8, pin_memory=pin_memory)
    start = -raw.data_ptr() % ALIGN_BYTES
    return raw[start : start + nbytes]


def region_offsets(buffer_page_bytes: Sequence[int], num_layers: int, num_pages: int) -> tuple[list[int], int]:
    """Where each buffer of a host pool starts inside one shared region, and the region's size: the
    buffers in the spec's order, each in its host layout and on a 4 KiB boundary (the node service's
    region, :mod:`kvtier.service.region`, is laid out by this, and :class:`HostPool` reads it by this)."""
    offsets, end = [], 0
    for page_bytes in buffer_page_bytes:
        offsets.append(end)
        end += -(-num_layers * num_pages * page_bytes // ALIGN_BYTES) * ALIGN_BYTES
    return offsets, end


class HostPool:
    """The spec's buffers in host memory (see the module docstring).

    ``memory``: a flat uint8 tensor of at least :func:`region_offsets`' size to lay the buffers out in
    (a shared region another process made and zeroed: nothing is allocated, zeroed or checked against
    the budget here); ``allocator``: who hands out its page ids (default: a :class:`PageAllocator` of
    its own; a region's page ids belong to the service that made it)."""

    def __init__(
        self,
        spec: KVSpec,
        num_pages: int,
        layout: LayoutKind | str = DEFAULT_HOST_LAYOUT,
        *,
        pin_memory: bool | None = None,
        reserve_bytes: int = DEFAULT_RESERVE_BYTES,
        available_bytes: int | None = None,
        name: str = "host pool",
        memory: torch.Tensor | None = None,
        allocator: PageAllocator | None = None,
    ):
        self.spec = spec
        self.num_pages = num_pages
        self.layout = HostLayout(check_layout(layout), spec.num_layers, num_pages)
        self.name = name
        requested = num_pages * spec.page_bytes  # checked before anything is allocated, the allocator's bookkeeping included
        if memory is None:
            available = host_memory_available() if available_bytes is None else available_bytes
            if requested > available - reserve_bytes:
                raise HostMemoryBudgetError(requested, available, reserve_bytes, max(available - reserve_bytes, 0) // spec.page_bytes)
        self.allocator = allocator if allocator is not None else PageAllocator(num_pages, name)
        self.buffers: dict[str, torch.Tensor] = {}
        self._rows: dict[str, list[torch.Tensor]] = {}
        # (a region is pinned only where its mapper registered it with CUDA and says so)
        self.pinned = bool(pin_memory) if memory is not None else torch.cuda.is_available() if pin_memory is None else pin_memory
        self._lay_out(memory)

    def _lay_out(self, memory: torch.Tensor | None) -> None:
        """The buffers (and their per-layer row views): fresh memory of their own, or views of ``memory``
        -- normal tensors even when laid out under ``torch.inference_mode`` (a region mapped anew in an
        engine's step), which kvtier's transfer thread could not write into."""
        with torch.inference_mode(False):
            self._lay_out_buffers(memory)

    def _lay_out_buffers(self, memory: torch.Tensor | None) -> None:
        spec, name = self.spec, self.name
        offsets, size = region_offsets([b.page_bytes for b in spec.buffers], spec.num_layers, self.num_pages)
        if memory is not None and memory.numel() < size:
            raise SpecError(f"{name}: a region of {memory.numel()} bytes cannot hold {self.num_pages} pages of {spec.name!r} "
                            f"({size} bytes)")
        for b, offset in zip(spec.buffers, offsets):
            shape = self.layout.shape(b.page_bytes)
            if memory is None:
                t = page_aligned_empty(math.prod(shape), pin_memory=self.pinned).view(shape)
                t.zero_()
            else:
                t = memory[offset : offset + math.prod(shape)].view(shape)
            self.buffers[b.name] = t
            self._rows[b.name] = [as_wide_rows(self.layout.layer_rows(t, layer)) for layer in range(spec.num_layers)]

    def remap(self, memory: torch.Tensor, num_pages: int | None = None) -> None:
        """Lay the buffers out in ``memory`` from now on, ``num_pages`` of them (None: as many as now) -- a
        node service's region mapped anew when its engine attaches again, maybe a restarted service's of
        another size; the old views go, and with the last of them the old mapping. Only while no copy is in
        flight and no page of the old mapping is in use: a copy reads the views when it starts."""
        if num_pages is not None and num_pages != self.num_pages:
            self.num_pages = num_pages
            self.layout = HostLayout(self.layout.kind, self.spec.num_layers, num_pages)
        self.pinned = memory.is_pinned()
        self._lay_out(memory)

    # ---- space ---------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return self.num_pages * self.spec.page_bytes

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Token slots for ``num_tokens`` (page-aligned) or ``None`` when the pool is full."""
        n = check_page_count(num_tokens, self.spec.page_size, what="host pool allocation")
        got = self.allocator.alloc(n)
        return pages_to_slots(got.pages, self.spec.page_size) if got.ok else None

    def free(self, slots: torch.Tensor) -> None:
        self.allocator.free(slots_to_pages(slots, self.spec.page_size, pool=self.name, side="host").tolist())

    # ---- views ---------------------------------------------------------------
    def rows(self, name: str, layer: int) -> torch.Tensor:
        """``[num_pages, page_bytes]`` view (widest dtype; strided for page_first)."""
        return self._rows[name][layer]

    def page_bytes(self, page: int) -> bytes:
        """All layers and buffers of one page, layer-major then buffer (same order as DevicePool)."""
        parts = [self._rows[b.name][layer][page].view(torch.uint8) for layer in range(self.spec.num_layers) for b in self.spec.buffers]
        return torch.cat(parts).numpy().tobytes()

    # ---- transfers in engine terms -----------------------------------------
    def _pages(self, device_pool: DevicePool, host_indices, device_indices) -> tuple[torch.Tensor, torch.Tensor]:
        if device_pool.spec != self.spec:
            raise SpecError(
                f"{self.name} holds {self.spec.name!r} but the device pool holds {device_pool.spec.name!r}; build both from one KVSpec"
            )
        ps = self.spec.page_size
        host_pages = slots_to_pages(host_indices, ps, pool=self.name, side="host")
        device_pages = slots_to_pages(device_indices, ps, pool=device_pool.name, side="device")
        if host_pages.numel() != device_pages.numel():
            raise PageAlignmentError(
                f"host and device indices differ in length: {host_pages.numel() * ps} host slots vs "
                f"{device_pages.numel() * ps} device slots (page_size {ps}); pass one device slot per host slot"
            )
        check_pages_in_range(host_pages, self.num_pages, pool=self.name, side="host")
        check_pages_in_range(device_pages, device_pool.num_pages, pool=device_pool.name, side="device")
        return host_pages, device_pages

    def load_to_device_per_layer(
        self, device_pool: DevicePool, host_indices, device_indices, layer_id: int, io_backend: str = "direct"
    ) -> None:
        """Copy one layer of every buffer (KV and DSA indexer) host -> device for whole pages."""
        from kvtier.transfer.ops import load_pages_one_layer
        from kvtier.transfer.backends import get_io_backend

        backend = get_io_backend(io_backend)
        host_pages, device_pages = self._pages(device_pool, host_indices, device_indices)
        layer_id = check_layer(layer_id, self.spec.num_layers, pool=self.name)
        load_pages_one_layer(self, device_pool, host_pages, device_pages, layer_id, backend)

    def backup_from_device_all_layer(self, device_pool: DevicePool, host_indices, device_indices, io_backend: str = "direct") -> None:
        """Copy all layers of every buffer device -> host for whole pages."""
        from kvtier.transfer.ops import backup_pages_all_layers
        from kvtier.transfer.backends import get_io_backend

        backend = get_io_backend(io_backend)
        host_pages, device_pages = self._pages(device_pool, host_indices, device_indices)
        backup_pages_all_layers(self, device_pool, host_pages, device_pages, backend)

    def __repr__(self) -> str:
        return f"HostPool({self.spec.name}, pages={self.num_pages}, layout={self.layout.kind}, free={self.allocator.num_free})"
