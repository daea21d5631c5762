"""Page math and the page-alignment check: the one place PageAlignmentError is raised.

Transfer APIs take token slot indices (as engines do) and convert them to page
indices once, here. A valid slot tensor is a concatenation of whole pages: its
length is a multiple of ``page_size``, and every group of ``page_size`` slots is
``[p*page_size, ..., p*page_size + page_size - 1]`` for some page ``p``.
"""

from __future__ import annotations

import numpy as np
import torch

from kvtier.errors import PageAlignmentError


def as_index_tensor(indices: torch.Tensor | list[int] | range) -> torch.Tensor:
    if isinstance(indices, torch.Tensor):
        return indices.reshape(-1).to(device="cpu", dtype=torch.int64)
    return torch.as_tensor(list(indices), dtype=torch.int64)


def slots_to_pages(slots: torch.Tensor | list[int], page_size: int, *, pool: str, side: str) -> torch.Tensor:
    """Validate token slots as whole pages and return their page indices (int64, CPU)."""
    slots = as_index_tensor(slots)
    n = slots.numel()
    where = f"{side} indices for {pool}"
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


def runs_of(pages: torch.Tensor) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive page numbers: ``(position, first_page, length)``.

    numpy, not torch: this runs once per transfer on a few hundred indices, where
    torch's per-op overhead would cost more than the copy of a small page.
    """
    arr = pages.numpy() if isinstance(pages, torch.Tensor) else np.asarray(pages, dtype=np.int64)
    n = arr.size
    if n == 0:
        return []
    starts = np.flatnonzero(np.diff(arr) != 1) + 1
    starts = np.concatenate(([0], starts))
    lengths = np.diff(np.concatenate((starts, [n])))
    return list(zip(starts.tolist(), arr[starts].tolist(), lengths.tolist()))
