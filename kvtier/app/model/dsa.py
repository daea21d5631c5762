"""The DSA indexer cache format: FP8 keys + fp32 scales packed per page (DESIGN.md).

One page row of the indexer buffer is ``page_size * (d + d // qb * 4)`` bytes:
first the ``page_size * d`` FP8 (e4m3) key bytes, token-major, then the
``page_size * d // qb`` fp32 scales, token-major (one scale per ``qb`` dims).
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize(keys: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n, d]`` float -> (FP8 ``[n, d]``, fp32 scales ``[n, d // block]``) with per-block amax scaling."""
    n, d = keys.shape
    blocks = keys.float().view(n, d // block, block)
    scales = (blocks.abs().amax(dim=-1) / FP8_MAX).clamp_min(1e-12)
    q = (blocks / scales[..., None]).to(torch.float8_e4m3fn).view(n, d)
    return q, scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    n, d = q.shape
    return (q.float().view(n, d // block, block) * scales[..., None]).view(n, d)


def write_tokens(
    index_buf: torch.Tensor, pages: torch.Tensor, offsets: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, page_size: int
) -> None:
    """Write token ``i``'s key/scales at page ``pages[i]``, slot ``offsets[i]`` of the indexer buffer (in place)."""
    d = q.shape[1]
    nsc = scales.shape[1]
    num_pages = index_buf.shape[0]
    key_region = index_buf[:, : page_size * d].view(num_pages, page_size, d)
    scale_region = index_buf[:, page_size * d :].view(num_pages, page_size, nsc * 4)
    key_region[pages, offsets] = q.view(torch.uint8)
    scale_region[pages, offsets] = scales.contiguous().view(torch.uint8).view(-1, nsc * 4)


def read_pages(index_buf: torch.Tensor, pages: torch.Tensor, page_size: int, d: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All tokens of ``pages`` in order: (FP8 keys ``[P*page_size, d]``, fp32 scales ``[P*page_size, d // block]``)."""
    rows = index_buf[pages]
    keys = rows[:, : page_size * d].reshape(-1, d).view(torch.float8_e4m3fn)
    scales = rows[:, page_size * d :].reshape(-1, (d // block) * 4).view(torch.float32)
    return keys, scales
