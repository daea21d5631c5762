"""L1 device pool: per-layer KV buffers in the engine's own shapes, on ``cpu`` or ``cuda``.

Buffers follow DESIGN.md exactly (``k``/``v`` ``[num_slots, kv_heads, head_dim]``,
``latent`` ``[num_slots, 1, rank + rope]``, ``indexer`` uint8 ``[num_pages, page_bytes]``).
The DSA indexer has no allocator of its own: it rides on the same page indices
as the latent buffer, so one allocation covers every buffer of the spec.
:meth:`DevicePool.wrap` adopts memory an
engine already owns (vLLM's KV tensors): the engine allocates its blocks, kvtier
only moves whole pages in and out of them.
"""

from __future__ import annotations

import torch

from kvtier.alloc import PageAllocator
from kvtier.errors import ConfigError, DeviceMemoryBudgetError, SpecError
from kvtier.pools.memory import DEFAULT_RESERVE_BYTES, host_memory_available
from kvtier.spec import KVSpec
from kvtier.transfer.rows import as_wide_rows


def _checked_device(device: str | torch.device) -> torch.device:
    """``cpu`` or an available ``cuda`` device; anything else is a :class:`ConfigError` with the fix."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"unknown device {device!r}; use cpu or cuda") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {device!r} is not supported; use cpu or cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} asked for, but CUDA is not available on this machine; use cpu")
    return dev


def _device_memory_available(device: torch.device) -> tuple[int, int]:
    """(free bytes where the pool lives, reserve to leave): the GPU's free memory, or host memory."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free, 256 << 20

    return host_memory_available(), DEFAULT_RESERVE_BYTES


def _padded_rows(t: torch.Tensor, page_bytes: int) -> bool:
    """``t`` is ``[pages, ...]`` of one contiguous ``page_bytes`` row per page, rows further apart than that."""
    return (not t.is_contiguous() and t.dim() >= 2 and t[0].is_contiguous() and t[0].numel() * t.element_size() == page_bytes
            and t.stride(0) * t.element_size() > page_bytes)


def _page_rows(t: torch.Tensor, num_pages: int, page_bytes: int) -> torch.Tensor:
    if _padded_rows(t, page_bytes):
        inner = t[0].numel()
        rows = torch.as_strided(t, (num_pages, inner), (t.stride(0), 1))
        byte_rows = rows.view(torch.uint8)
        try:
            return as_wide_rows(byte_rows)
        except RuntimeError:  # rows not aligned for a wider dtype: bytes then
            return byte_rows
    return as_wide_rows(t.view(-1).view(torch.uint8).view(num_pages, page_bytes))


class DevicePool:
    def __init__(
        self,
        spec: KVSpec,
        num_pages: int,
        device: str | torch.device = "cpu",
        *,
        reserve_padding_page: bool = False,
        name: str = "device pool",
        _buffers: bool = True,
    ):
        self.spec = spec
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
            raise ConfigError(f"{name}: num_pages must be an integer >= 1, got {num_pages!r}")
        self.num_pages = num_pages
        self.device = _checked_device(device)
        self.name = name
        if _buffers:  # before the allocator: its free list alone could exhaust memory
            requested = num_pages * spec.page_bytes
            available, reserve = _device_memory_available(self.device)
            if requested > available - reserve:
                raise DeviceMemoryBudgetError(requested, available, reserve, max(available - reserve, 0) // spec.page_bytes,
                                              pool=name, hint="(e.g. --tiers-device-pages)")
        self.allocator = PageAllocator(num_pages, name, reserve_padding_page)
        self.buffers: dict[str, list[torch.Tensor]] = {}
        self._rows: dict[str, list[torch.Tensor]] = {}
        if not _buffers:  # (wrap: the engine's tensors are the buffers)
            return
        for b in spec.buffers:
            shape = b.device_shape(num_pages, spec.page_size)
            layers = [torch.zeros(shape, dtype=b.torch_dtype, device=self.device) for _ in range(spec.num_layers)]
            self.buffers[b.name] = layers
            self._rows[b.name] = [_page_rows(t, num_pages, b.page_bytes) for t in layers]

    @classmethod
    def wrap(cls, spec: KVSpec, buffers: dict[str, list[torch.Tensor]], *, name: str = "engine device pool") -> DevicePool:
        """A pool over engine-owned tensors: ``buffers[name][layer]`` per spec buffer.

        Every tensor must be contiguous and hold exactly ``num_pages * page_bytes``
        bytes with page ``p`` at byte offset ``p * page_bytes`` (the layout the spec
        describes) -- or be ``[num_pages, ...]`` rows of ``page_bytes`` contiguous bytes
        each, further apart (an engine that pads its rows: vLLM's Mamba state blocks).
        The allocator is unused: the engine decides which pages hold what.
        """
        names = [b.name for b in spec.buffers]
        if sorted(buffers) != sorted(names):
            raise SpecError(f"{name}: spec {spec.name!r} has buffers {names}, got tensors for {sorted(buffers)}")
        first = buffers[names[0]][0]
        if _padded_rows(first, spec.buffers[0].page_bytes):
            num_pages = first.shape[0]
        else:
            num_pages = first.numel() * first.element_size() // spec.buffers[0].page_bytes
        pool = cls(spec, num_pages, first.device, name=name, _buffers=False)
        for b in spec.buffers:
            layers = buffers[b.name]
            if len(layers) != spec.num_layers:
                raise SpecError(
                    f"{name}: buffer {b.name!r} has {len(layers)} layer tensors; spec {spec.name!r} has {spec.num_layers} layers"
                )
            for i, t in enumerate(layers):
                nbytes = t.numel() * t.element_size()
                if _padded_rows(t, b.page_bytes) and t.shape[0] == num_pages:
                    continue
                if not t.is_contiguous() or nbytes != num_pages * b.page_bytes:
                    raise SpecError(
                        f"{name}: buffer {b.name!r} layer {i} is {tuple(t.shape)} {t.dtype} "
                        f"({'contiguous' if t.is_contiguous() else 'strided'}, {nbytes} bytes); expected a contiguous "
                        f"{num_pages} x {b.page_bytes}-byte page array for spec {spec.name!r}"
                    )
            pool.buffers[b.name] = list(layers)
            pool._rows[b.name] = [_page_rows(t, num_pages, b.page_bytes) for t in layers]
        return pool

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.spec.page_bytes

    def buffer(self, name: str, layer: int) -> torch.Tensor:
        """The engine-shaped tensor of one buffer in one layer."""
        return self.buffers[name][layer]

    def rows(self, name: str, layer: int) -> torch.Tensor:
        """``[num_pages, page_bytes]`` view (widest dtype) of one buffer in one layer."""
        return self._rows[name][layer]

    def page_bytes(self, page: int) -> bytes:
        """All layers and buffers of one page, concatenated (for tests and debugging)."""
        parts = [
            self._rows[b.name][layer][page].view(torch.uint8).cpu() for layer in range(self.spec.num_layers) for b in self.spec.buffers
        ]
        return torch.cat(parts).numpy().tobytes()

    def __repr__(self) -> str:
        return f"DevicePool({self.spec.name}, pages={self.num_pages}, device={self.device}, free={self.allocator.num_free})"
