"""Whole-page transfers between a host pool and a device pool, over every buffer of the spec.

These take page indices that are already validated (the pools' engine-facing
methods and the cache manager validate once). Every buffer of the spec moves
together — KV and the DSA indexer — so no path can restore one without the
other. The copy plan is computed once per transfer and reused for every
buffer and layer.
"""

from __future__ import annotations

from typing import Any

import torch

from kvtier.transfer.backends import IOBackend

_HOST = torch.device("cpu")


def load_pages_one_layer(
    host, device, host_pages: torch.Tensor, device_pages: torch.Tensor, layer: int, backend: IOBackend, plan: Any = None
) -> None:
    """``plan``: the transfer's (:meth:`IOBackend.transfer_plan`, host to device), made here if None."""
    plan = backend.transfer_plan(host, device, host_pages, device_pages) if plan is None else plan
    if backend.copy_list is not None:  # every buffer of the layer in one address list
        backend.copy_list(plan.layer(layer), _HOST, device.device)
        return
    for b in host.spec.buffers:
        backend.copy(plan, host.rows(b.name, layer), device.rows(b.name, layer))


def backup_pages_one_layer(
    host, device, host_pages: torch.Tensor, device_pages: torch.Tensor, layer: int, backend: IOBackend, plan: Any = None
) -> None:
    """``plan``: the transfer's (:meth:`IOBackend.transfer_plan`, device to host), made here if None."""
    plan = backend.transfer_plan(device, host, device_pages, host_pages) if plan is None else plan
    if backend.copy_list is not None:
        backend.copy_list(plan.layer(layer), device.device, _HOST)
        return
    for b in host.spec.buffers:
        backend.copy(plan, device.rows(b.name, layer), host.rows(b.name, layer))


def backup_pages_all_layers(host, device, host_pages: torch.Tensor, device_pages: torch.Tensor, backend: IOBackend) -> None:
    if backend.copy_list is not None:  # every buffer of every layer in one address list
        backend.copy_list(backend.transfer_plan(device, host, device_pages, host_pages).all_layers(), device.device, _HOST)
        return
    if backend.backup_whole_pages is not None and host.layout.kind == "page_first" and device.device.type == "cuda":
        backend.backup_whole_pages(host, device, host_pages, device_pages)  # one DMA per run of whole pages
        return
    plan = backend.plan(device_pages, host_pages)
    for layer in range(host.spec.num_layers):
        backup_pages_one_layer(host, device, host_pages, device_pages, layer, backend, plan)
