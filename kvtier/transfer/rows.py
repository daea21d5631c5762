"""Byte-row views shared by both pools.

Transfers see every buffer as ``[num_pages, page_bytes]`` rows. Rows are viewed
as the widest integer dtype that divides the page: torch's index kernels copy
int64 rows several times faster than uint8 rows of the same bytes.
"""

from __future__ import annotations

import torch

_WIDE = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def wide_dtype(page_bytes: int) -> torch.dtype:
    return next(dt for size, dt in _WIDE if page_bytes % size == 0)


def as_wide_rows(byte_rows: torch.Tensor) -> torch.Tensor:
    """``[pages, page_bytes]`` uint8 (last dim contiguous) -> same memory, widest dtype."""
    return byte_rows.view(wide_dtype(byte_rows.shape[-1]))
