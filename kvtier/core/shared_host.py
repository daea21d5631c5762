"""A host tier other engines share: what the core asks of it, and the null object for a host tier of its own.

With the node service (:mod:`kvtier.service`), the core's host pages are pages of a region every engine
on the node maps, and the service indexes them. The core stays the policy of its own view: its tree
holds the region pages it holds, its host LRU gives them back. Three calls join the views:

* ``lookup(keys)`` -- the region pages of the leading run of ``keys`` that other engines published
  (held for this engine from now on; one round trip), when the core's own tree ends before them;
* ``lookup_many(runs)`` -- ``lookup`` of many requests' keys in one round trip (vLLM's scheduler asks
  a step's requests together: :meth:`~kvtier.core.base.CoreBase.prefetch_shared`), and ``let_go(pages)``
  for those of its pages the core finds no place for;
* ``adopt(pages)`` -- book as many of them as the host allocator has room for (the rest are let go);
  the core adds them to its tree as readable host pages, so a match counts them as host hits;
* ``publish(keys, pages, owners)`` -- a backup into ``pages`` completed: other engines may have them now
  (never before: a page still being written is offered to nobody); ``owners``: each page's tenant label
  (a core on a shared host tier accounts tenants: the service bounds them, :mod:`kvtier.service.tenants`).

A tier that fails (its service died, or dropped this engine) says so with ``lost``: it finds nothing,
gives no pages and takes none back, and the core's next match forgets every host page it holds (they
are all the region's), after the copies in flight that touch them completed. The engine goes on with
misses; the tier attaches again on its own once nothing of the old attachment is left in the core.

The choice is made once, at construction (``shared_host`` of :class:`~kvtier.core.cache_core.CacheCore`
and of :class:`~kvtier.core.engine_device.EngineDeviceCore`, vLLM's scheduler; both run
:class:`~kvtier.core.base.CoreBase`'s code for it): :data:`NO_SHARED_HOST` (falsy) for a host tier of
the engine's own, so the per-request paths test one attribute and call nothing.
"""

from __future__ import annotations

from typing import Protocol

from kvtier.errors import ConfigError
from kvtier.hashing import PageHash


class SharedHost(Protocol):
    #: the tier is gone (its service died or dropped this engine): its pages must leave the core's tree
    #: (:meth:`~kvtier.core.cache_core.CacheCore._forget_shared_host`); until they have, it is not attached again
    lost: bool

    def lookup(self, keys: list[PageHash]) -> list[int]: ...

    def lookup_many(self, runs: list[list[PageHash]]) -> list[list[int]]: ...

    def let_go(self, pages: list[int]) -> None: ...

    def adopt(self, pages: list[int]) -> int: ...

    def publish(self, keys: list[PageHash], pages: list[int], owners: list[str] | None = None) -> None: ...


class NoSharedHost(tuple):
    """A host tier of the engine's own: nobody else's pages to find, nobody to tell. Falsy as an empty
    tuple, so the per-request paths' ``if self.shared_host`` is a C-level length test, not a Python call
    (the same trick as :class:`~kvtier.core.group_objects.NoGroups`)."""

    __slots__ = ()
    lost = False

    def lookup(self, keys: list[PageHash]) -> list[int]:
        return []

    def lookup_many(self, runs: list[list[PageHash]]) -> list[list[int]]:
        return [[] for _ in runs]

    def let_go(self, pages: list[int]) -> None:
        pass

    def adopt(self, pages: list[int]) -> int:
        return 0

    def publish(self, keys: list[PageHash], pages: list[int], owners: list[str] | None = None) -> None:
        pass


NO_SHARED_HOST = NoSharedHost()


def check_shared_host(shared_host: SharedHost, model, port, *, hybrid: bool = False) -> None:
    """A shared host tier serves a core with no L3 of its own (the service keeps the tiers below the engine), of a
    full-attention model -- or a hybrid one where the core keeps its groups' objects (``hybrid``: kvtier's own device;
    its groups' host objects are the service's too, :meth:`~kvtier.core.group_objects.Groups.check_shared`); a
    :class:`ConfigError` otherwise, before the core is built."""
    if shared_host and port.has_storage:
        raise ConfigError("a shared host tier (the node service) serves engines with no L3 of their own (the service keeps the tiers "
                          "below the engine): drop the storage URL, or the service")
    if shared_host and model is not None and model.is_hybrid and not hybrid:
        raise ConfigError("a shared host tier (the node service) serves this engine's models of full attention only (a hybrid model's "
                          "groups on the service are HierarchicalCache's so far): drop the service, or serve a full-attention model")
