"""io backends: a function table keyed by name.

A backend copies whole page rows between ``[pages, row]`` views in two steps:
``plan(src_pages, dst_pages)`` once per transfer (index analysis, done once for
every layer and buffer), then ``copy(plan, src_rows, dst_rows)`` per buffer and
layer. Or, declaring ``copy_list``, it takes the transfer as address lists
(:mod:`kvtier.transfer.address_list`): one list per layer for a load, one for
every layer for a backup, every buffer in it.

=========  ======================================================  ==============
name       how                                                     runs on
=========  ======================================================  ==============
direct     torch slice / index copies per buffer and layer          CPU and CUDA
dma        one ``cuMemcpyBatchAsync`` per list                      CUDA >= 12.8
triton     a copy kernel over the list, grid capped                 CUDA (CPU: the
                                                                   interpreter)
auto       per list: the kernel for many small rows, else DMA       CUDA
=========  ======================================================  ==============

``auto``'s thresholds and ``triton``'s program count are
:class:`~kvtier.transfer.gpu_methods.CopyMethodThresholds` (environment overrides, read
once per transfer engine: :meth:`IOBackend.configured`; ``python -m kvtier.app.bench.gpu_check``
prints measured ones).
"""

from __future__ import annotations

from kvtier.errors import UnknownNameError
from kvtier.transfer.io_backend import IOBackend

__all__ = ["IOBackend", "get_io_backend", "register_io_backend"]

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


def _register_builtin() -> None:
    from kvtier.transfer import direct, gpu_methods

    register_io_backend(IOBackend("direct", direct.plan, direct.copy, direct.backup_whole_pages))
    for backend in gpu_methods.backends():
        register_io_backend(backend)


_register_builtin()
