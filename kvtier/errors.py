"""kvtier's typed errors.

Every error kvtier raises at its boundary derives from :class:`KVTierError`, and
also from the builtin it refines, so ``except ValueError`` keeps working for
callers that do not know kvtier. Messages say what was wrong and how to fix it.
"Not enough space" is an expected outcome and is returned as a result, never
raised; these exceptions are for misuse and for environments that cannot work.
"""

from __future__ import annotations

from collections.abc import Iterable


class KVTierError(Exception):
    """Base of every error raised by kvtier."""


class SpecError(KVTierError, ValueError):
    """A KVSpec (or a preset name) is invalid. The message names the field."""


class PageAlignmentError(KVTierError, ValueError):
    """Token slots handed to a transfer or allocator are not whole pages.

    Raised before any byte moves. The message names the count, the page size,
    the pool and which side (host/device) is wrong. Fix: pass whole pages only
    (the partial tail page of a request stays on device, or is padded).
    """


class UnknownNameError(KVTierError, ValueError):
    """A name (preset, layout, io backend, storage scheme, policy) is unknown."""

    def __init__(self, what: str, name: object, valid: Iterable[str]):
        self.what, self.name, self.valid = what, name, sorted(valid)
        super().__init__(f"unknown {what} {name!r}; valid: {', '.join(self.valid)}")


class DoubleFreeError(KVTierError, ValueError):
    """A page was freed that is not currently allocated (freed twice or never owned)."""


class MemoryBudgetError(KVTierError, MemoryError):
    """A pool would not fit in the memory where it lives (minus the reserve). Raised before any
    allocation, the allocator's bookkeeping included."""

    def __init__(self, requested_bytes: int, available_bytes: int, reserve_bytes: int, max_pages: int, *,
                 pool: str = "host pool", hint: str = "(e.g. --host-gb), or lower the reserve"):
        self.requested_bytes = requested_bytes
        self.available_bytes = available_bytes
        self.reserve_bytes = reserve_bytes
        self.max_pages = max_pages
        gb = 1 << 30
        super().__init__(
            f"{pool} needs {requested_bytes / gb:.2f} GB but only "
            f"{max(available_bytes - reserve_bytes, 0) / gb:.2f} GB is available "
            f"({available_bytes / gb:.2f} GB free minus a {reserve_bytes / gb:.2f} GB reserve); "
            f"shrink the {pool} to at most {max_pages} pages {hint}"
        )


class HostMemoryBudgetError(MemoryBudgetError):
    """A host pool would not fit in available host memory (minus the reserve)."""


class DeviceMemoryBudgetError(MemoryBudgetError):
    """A device pool would not fit in the device's free memory (host memory for a CPU device pool)."""


class ConfigError(KVTierError, ValueError):
    """A configuration value is invalid; the message names the field."""


class StorageError(KVTierError, OSError):
    """An L3 backend could not be reached or used.

    Per-key misses and per-key failures are results, not exceptions; this is
    raised only where an operation cannot proceed at all (bad URL, missing
    optional dependency). Backend client exceptions are mapped in one place
    (:func:`kvtier.l3.base.map_storage_errors`).
    """


class ExecutorError(KVTierError, RuntimeError):
    """An executor in another process cannot be reached: it exited, closed its pipe, or did not
    answer a query within its deadline. Its plans in flight are lost; the core's view of them is
    not trusted after this (close it and start again)."""


class TransferError(KVTierError, RuntimeError):
    """A GPU copy method could not run: its driver entry point is missing, or the driver refused a
    call (the message gives the CUresult and which copy). The executor reports the transfer failed."""


class InvalidStateError(KVTierError, RuntimeError):
    """An operation was called in a state that does not allow it (e.g. unlocking an unlocked node)."""


class PageIndexError(KVTierError, IndexError):
    """A page or slot index is outside its pool, or a layer index outside the model."""


class PageOwnershipError(KVTierError, ValueError):
    """Pages handed to the cache are not the caller's to give: held by the cache, never allocated,
    or listed twice. Raised before anything changes."""


class IndexTypeError(KVTierError, TypeError):
    """Indices handed to a transfer are not a flat sequence of integers (floats, 2-D, None, strings).

    Raised before any byte moves: a float index would otherwise be truncated and move a page."""


class ServiceError(KVTierError, RuntimeError):
    """A ``kvtier serve`` node service cannot be used: it is not listening, it did not answer within
    the call's deadline, it closed the connection, or it refused a request. The message says which;
    the connection is not used again after it (attach a new client)."""


class ServiceUnavailableError(ServiceError):
    """No node service answers at the socket: nothing listens there (or its directory does not exist), it
    did not answer within the call's deadline, or it closed the connection without a reason. Unlike a
    refusal, this may pass: an engine starts without the service and attaches when it answers (unless
    ``service_required``)."""


class ServiceProtocolError(ServiceError):
    """A message to or from the node service broke its protocol: a frame of a bad length, not a JSON
    object, an unknown message type, a malformed field, or a page id that is not the sender's (outside
    the region, or another client's or namespace's). The service answers with this error, typed, and
    closes the connection; it keeps serving its other clients."""


class ServiceAccessError(ServiceError, PermissionError):
    """The node service refused a peer: its uid is not the service's (``SO_PEERCRED``)."""
