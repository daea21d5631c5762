"""What an io backend is: a named set of copy functions (the table of them is :mod:`kvtier.transfer.backends`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvtier.errors import ConfigError


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
    #: copy_list(rows, src_device, dst_device): an address list (every buffer of a layer, or of every
    #: layer) on the current stream of the GPU side; a backend with it takes :meth:`transfer_plan`'s
    #: address plans instead of ``plan`` / ``copy``
    copy_list: Callable[[Any, torch.device, torch.device], None] | None = None
    #: unavailable(device): why it cannot move pages to and from a pool on ``device`` (None: it can)
    unavailable: Callable[[torch.device], str | None] | None = None
    #: configure(): ``copy_list`` bound to the backend's settings, read now (environment overrides; a bad
    #: one is a ConfigError); see :meth:`configured`. None: it has no settings
    configure: Callable[[], Callable[[Any, torch.device, torch.device], None]] | None = None

    def configured(self) -> IOBackend:
        """This backend with its settings read once, as a transfer engine copies with it: a bad setting
        fails when the engine is built, not at its first copy, and a change later leaves it alone."""
        if self.configure is None:
            return self
        return replace(self, copy_list=self.configure(), configure=None)

    def transfer_plan(self, src_pool, dst_pool, src_pages: torch.Tensor, dst_pages: torch.Tensor) -> Any:
        """The plan of one transfer, reused for every layer and buffer: an address plan for a
        backend that copies address lists, else ``plan``'s."""
        if self.copy_list is not None:
            from kvtier.transfer.address_list import AddressPlan

            return AddressPlan(src_pool, dst_pool, src_pages, dst_pages)
        return self.plan(src_pages, dst_pages)

    def check_runs_on(self, device: torch.device) -> None:
        reason = self.unavailable(device) if self.unavailable is not None else None
        if reason is not None:
            raise ConfigError(f"io_backend {self.name!r}: {reason}")
