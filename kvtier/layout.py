"""Host memory layouts as data: :class:`HostLayout`.

A host pool holds one uint8 tensor per spec buffer. ``layer_first`` shapes it
``[layers, pages, page_bytes]`` (a layer's pages are one contiguous block: cheap
per-layer loads); ``page_first`` shapes it ``[pages, layers, page_bytes]`` (a
page's layers are one contiguous run: cheap storage I/O and all-layer backup).
Both expose the same two views, so transfer code never branches on the layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from kvtier.errors import UnknownNameError

LayoutKind = Literal["layer_first", "page_first"]
LAYOUTS: tuple[LayoutKind, ...] = ("layer_first", "page_first")
#: The one default host layout (TierConfig, HostPool, WorkerSpec and the engine integrations read
#: it): page_first, where a page's layers are one run per buffer, so an L3 save or load moves one
#: run per page. The GPU copy methods that read an address list (kvtier.transfer.address_list)
#: move either layout as one list of rows; the H200 figures that would settle it for GPU
#: transfers are owed (README, Known gaps).
DEFAULT_HOST_LAYOUT: LayoutKind = "page_first"


def check_layout(kind: str) -> LayoutKind:
    if kind not in LAYOUTS:
        raise UnknownNameError("host layout", kind, LAYOUTS)
    return kind  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class HostLayout:
    kind: LayoutKind
    num_layers: int
    num_pages: int

    def __post_init__(self) -> None:
        check_layout(self.kind)

    def shape(self, page_bytes: int) -> tuple[int, int, int]:
        if self.kind == "layer_first":
            return (self.num_layers, self.num_pages, page_bytes)
        return (self.num_pages, self.num_layers, page_bytes)

    def layer_rows(self, buf: torch.Tensor, layer: int) -> torch.Tensor:
        """``[pages, page_bytes]`` view of one layer (strided for page_first)."""
        return buf[layer] if self.kind == "layer_first" else buf[:, layer]

    def page_layers(self, buf: torch.Tensor, page: int) -> torch.Tensor:
        """``[layers, page_bytes]`` view of one page (strided for layer_first)."""
        return buf[:, page] if self.kind == "layer_first" else buf[page]
