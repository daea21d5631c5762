"""Page math and the page-alignment check: the one place PageAlignmentError is raised.

Transfer APIs take token slot indices (as engines do) and convert them to page
indices once, here. A valid slot tensor is a concatenation of whole pages: its
length is a multiple of ``page_size``, and every group of ``page_size`` slots is
``[p*page_size, ..., p*page_size + page_size - 1]`` for some page ``p``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvtier.errors import IndexTypeError, PageAlignmentError, PageIndexError

_ALL_INTS = object()
_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def is_ordered_sequence(x: object) -> bool:
    """A list, tuple, range, array or tensor: sized, indexable, ordered (not a set, dict, str, None or generator)."""
    return (x is not None and not isinstance(x, (set, frozenset, dict, str, bytes)) and hasattr(x, "__len__")
            and hasattr(x, "__getitem__"))


def as_index_tensor(indices: torch.Tensor | np.ndarray | list[int] | range, *, what: str = "indices") -> torch.Tensor:
    """A flat int64 CPU tensor of ``indices``, or :class:`IndexTypeError` (a ``TypeError``) for
    anything that is not a flat sequence of integers: floats would be truncated, 2-D would be
    flattened, and ``None`` or strings are a caller's bug. Values too large for int64 are a
    :class:`PageIndexError`."""
    if isinstance(indices, range):
        return torch.arange(indices.start, indices.stop, indices.step, dtype=torch.int64)
    if isinstance(indices, (str, bytes)) or indices is None:
        raise IndexTypeError(f"{what} must be a 1-D integer tensor or a list of ints, got {type(indices).__name__}")
    if isinstance(indices, np.ndarray):
        indices = torch.from_numpy(np.ascontiguousarray(indices)) if indices.dtype.kind in "iu" and indices.dtype != np.uint64 else indices
    if not isinstance(indices, torch.Tensor):
        try:
            arr = np.asarray(indices if isinstance(indices, (list, tuple)) else list(indices))
        except (TypeError, ValueError):  # not iterable, or ragged nesting
            raise IndexTypeError(f"{what} must be a 1-D integer tensor or a list of ints, got {type(indices).__name__}") from None
        except OverflowError:
            raise PageIndexError(f"{what}: a value does not fit in int64; indices are slots of a pool") from None
        if arr.size == 0:
            return torch.zeros(0, dtype=torch.int64)
        if arr.dtype.kind in "iu" and bool in set(map(type, indices)):  # numpy made bools ints
            raise IndexTypeError(f"{what} must be integers; got a bool; pass whole slot numbers")
        if arr.dtype.kind not in "iu" or arr.dtype == np.uint64:  # the slow path: only to name what is wrong
            items = list(indices) if arr.ndim == 1 else []
            bad = next((x for x in items if isinstance(x, bool) or not isinstance(x, (int, np.integer))), _ALL_INTS)
            if arr.ndim == 1 and bad is _ALL_INTS:
                raise PageIndexError(f"{what}: a value does not fit in int64 (max {max(items)}); indices are slots of a pool")
            if arr.ndim != 1:
                raise IndexTypeError(f"{what} must be 1-D, got shape {tuple(arr.shape)}; pass one flat run of slots")
            raise IndexTypeError(f"{what} must be integers; got {bad!r} ({type(bad).__name__}); pass whole slot numbers")
        indices = torch.from_numpy(arr.astype(np.int64, copy=False))
    if indices.dtype not in _INT_DTYPES:
        raise IndexTypeError(f"{what} must have an integer dtype, got {indices.dtype}; floats would be truncated")
    if indices.dim() != 1:
        raise IndexTypeError(f"{what} must be 1-D, got shape {tuple(indices.shape)}; pass one flat run of slots")
    return indices.to(device="cpu", dtype=torch.int64)


def check_pages_in_range(pages: torch.Tensor, num_pages: int, *, pool: str, side: str) -> None:
    if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= num_pages):
        bad = pages[(pages < 0) | (pages >= num_pages)][0]
        raise PageIndexError(f"{side} pages for {pool}: page {int(bad)} is outside the pool's {num_pages} pages")


def checked_pages(pages, num_pages: int, *, pool: str, side: str) -> torch.Tensor:
    """Page ids as a flat int64 tensor, each in ``[0, num_pages)``, checked before anything moves."""
    t = as_index_tensor(pages, what=f"{side} pages for {pool}")
    check_pages_in_range(t, num_pages, pool=pool, side=side)
    return t


def checked_page_list(pages, num_pages: int, *, pool: str, side: str) -> list[int]:
    """:func:`checked_pages` as a list of ints, with a fast path for the usual input (a list of
    plain ints): this runs on every request's commit."""
    if isinstance(pages, list) and all(type(p) is int for p in pages):
        if pages and (min(pages) < 0 or max(pages) >= num_pages):
            bad = next(p for p in pages if not 0 <= p < num_pages)
            raise PageIndexError(f"{side} pages for {pool}: page {bad} is outside the pool's {num_pages} pages")
        return list(pages)
    return checked_pages(pages, num_pages, pool=pool, side=side).tolist()


def check_layer(layer: object, num_layers: int, *, pool: str) -> int:
    """A layer index in ``[0, num_layers)``: ``-1`` is not "the last layer" here."""
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
        raise IndexTypeError(f"layer_id for {pool} must be an int, got {layer!r}")
    if not 0 <= layer < num_layers:
        raise PageIndexError(f"layer_id {layer} is outside {pool}'s {num_layers} layers (0..{num_layers - 1})")
    return int(layer)


def slots_to_pages(slots: torch.Tensor | list[int], page_size: int, *, pool: str, side: str) -> torch.Tensor:
    """Validate token slots as whole pages and return their page indices (int64, CPU)."""
    where = f"{side} indices for {pool}"
    slots = as_index_tensor(slots, what=where)
    n = slots.numel()
    if n % page_size:
        raise PageAlignmentError(
            f"{where}: {n} token slots is not a multiple of page_size {page_size} "
            f"({n // page_size} whole pages + {n % page_size} slots); pass whole pages only"
        )
    if n == 0:
        return slots
    grid = slots.view(-1, page_size)
    first = grid[:, 0]
    bad_start = torch.nonzero(first % page_size).flatten()
    if bad_start.numel():
        i = int(bad_start[0])
        raise PageAlignmentError(
            f"{where}: page {i} of the transfer starts at slot {int(first[i])}, which is not on a "
            f"page boundary (page_size {page_size}); each run of {page_size} slots must start at a multiple of {page_size}"
        )
    expected = first[:, None] + torch.arange(page_size)
    bad = torch.nonzero((grid != expected).any(dim=1)).flatten()
    if bad.numel():
        i = int(bad[0])
        raise PageAlignmentError(
            f"{where}: slots of page {i} of the transfer are not consecutive "
            f"({grid[i].tolist()}); a page's {page_size} slots must be consecutive"
        )
    return first // page_size


def pages_to_slots(pages: torch.Tensor | list[int], page_size: int) -> torch.Tensor:
    pages = as_index_tensor(pages)
    return (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)


def check_page_count(num_tokens: int, page_size: int, *, what: str) -> int:
    """Whole pages in ``num_tokens``; raises if it is not page-aligned."""
    if num_tokens < 0 or num_tokens % page_size:
        raise PageAlignmentError(
            f"{what} must be page-aligned: asked for {num_tokens} tokens with page_size {page_size}; "
            f"round to a multiple of {page_size} (e.g. {num_tokens // page_size * page_size} or "
            f"{-(-num_tokens // page_size) * page_size})"
        )
    return num_tokens // page_size


def _index_array(pages: torch.Tensor | Sequence[int]) -> np.ndarray:
    return pages.numpy() if isinstance(pages, torch.Tensor) else np.asarray(pages, dtype=np.int64)


def _run_bounds(*arrays: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start positions and lengths of the maximal runs along which every array counts up by one."""
    n = arrays[0].size
    breaks = np.zeros(max(n - 1, 0), dtype=bool)
    for a in arrays:
        breaks |= np.diff(a) != 1
    starts = np.concatenate(([0], np.flatnonzero(breaks) + 1))
    return starts, np.diff(np.concatenate((starts, [n])))


def runs_of(pages: torch.Tensor) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive page numbers: ``(position, first_page, length)``.

    numpy, not torch: this runs once per transfer on a few hundred indices, where
    torch's per-op overhead would cost more than the copy of a small page.
    """
    arr = _index_array(pages)
    if arr.size == 0:
        return []
    starts, lengths = _run_bounds(arr)
    return list(zip(starts.tolist(), arr[starts].tolist(), lengths.tolist()))


def paired_runs(src: torch.Tensor, dst: torch.Tensor) -> list[tuple[int, int, int]]:
    """Maximal runs along which both page lists count up by one: ``(first src page, first dst
    page, length)``. Each is one slice-to-slice copy (one DMA between host and GPU)."""
    a, b = _index_array(src), _index_array(dst)
    if a.size == 0:
        return []
    starts, lengths = _run_bounds(a, b)
    return list(zip(a[starts].tolist(), b[starts].tolist(), lengths.tolist()))


def first_duplicate(pages: Sequence[int]) -> int | None:
    """The first page listed a second time in ``pages`` (None if all differ)."""
    seen: set[int] = set()
    return next((p for p in pages if p in seen or seen.add(p)), None)


def at_own_place(pages: np.ndarray, given: Sequence[int]) -> np.ndarray:
    """Mask of ``pages[i] == given[i]`` (False past the end of ``given``): pages a caller hands back
    exactly where it was given them."""
    mask = np.zeros(pages.size, dtype=bool)
    n = min(pages.size, len(given))
    if n:
        mask[:n] = pages[:n] == np.asarray(given[:n], dtype=np.int64)
    return mask
