"""io backends: a function table keyed by name.

A backend copies whole page rows between ``[pages, row]`` views in two steps:
``plan(src_pages, dst_pages)`` once per transfer (index analysis, done once for
every layer and buffer), then ``copy(plan, src_rows, dst_rows)`` per buffer and
layer. ``direct`` is plain torch and runs everywhere; a CUDA/Triton ``kernel``
backend plugs in with :func:`register_io_backend` without touching pools or
transfer code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.errors import UnknownNameError


@dataclass(frozen=True)
class IOBackend:
    name: str
    #: plan(src_pages, dst_pages) -> opaque plan, reusable for every buffer and layer of one transfer.
    plan: Callable[[torch.Tensor, torch.Tensor], Any]
    #: copy(plan, src_rows, dst_rows): dst_rows[dst_pages[i]] = src_rows[src_pages[i]].
    copy: Callable[[Any, torch.Tensor, torch.Tensor], None]
    #: backup_whole_pages(host, device, host_pages, device_pages): every layer of device pages
    #: into a page_first host pool in whole pages (its pages are one run across layers), used
    #: for all-layer backups to a GPU's page_first host pool; None: per layer through ``copy``
    backup_whole_pages: Callable[[Any, Any, torch.Tensor, torch.Tensor], None] | None = None

    def copy_pages(self, src_rows: torch.Tensor, src_pages: torch.Tensor, dst_rows: torch.Tensor, dst_pages: torch.Tensor) -> None:
        self.copy(self.plan(src_pages, dst_pages), src_rows, dst_rows)


_REGISTRY: dict[str, IOBackend] = {}


def register_io_backend(backend: IOBackend) -> None:
    _REGISTRY[backend.name] = backend


def get_io_backend(name: str | IOBackend) -> IOBackend:
    if isinstance(name, IOBackend):
        return name
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownNameError("io_backend", name, _REGISTRY) from None


def io_backends() -> list[str]:
    return sorted(_REGISTRY)


def _register_builtin() -> None:
    from kvtier.transfer import direct

    register_io_backend(IOBackend("direct", direct.plan, direct.copy, direct.backup_whole_pages))


_register_builtin()
