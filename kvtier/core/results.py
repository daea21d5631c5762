"""What the core's calls return: where a prefix is cached, a load in flight, an insert, an eviction.

Read-only by convention, not ``frozen``: a frozen dataclass pays ~0.2 us per field to build,
and several of these are built per request on the scheduler's hot path."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Protocol

from kvtier.hashing import PageHash
from kvtier.radix import PageNode


class Waiter(Protocol):
    """What a load in flight waits through: the core that planned it (its plans' per-layer waits)."""

    def wait_layer(self, op: int, layer: int) -> None: ...

    def wait_for(self, ops: Collection[int]) -> int: ...

    def in_flight(self, op: int) -> bool: ...


@dataclass(slots=True)
class MatchResult:
    """Where a request's full-page prefix is cached.

    ``nodes`` are the matched prefix: first the nodes of ``device_pages``, usable now (after
    waiting on ``pending``, the ops of loads other requests started), then the host nodes
    that follow them and need :meth:`CacheCore.load_back`.
    """

    keys: list[PageHash]
    device_pages: list[int]
    nodes: list[PageNode]
    pending: tuple[int, ...] = ()
    #: pages after the host run that the L3 store holds (prefetch them with :meth:`CacheCore.prefetch`)
    num_storage_pages: int = 0
    #: a hybrid model: the KV group whose objects were missing where the full pages ran on (None: the
    #: full pages themselves are the limit); see :mod:`kvtier.core.group_kinds`
    limited_by: str | None = None
    #: a hybrid model: the prefix counts objects of device pages that only a host copy holds (the load
    #: back brings them: :meth:`CacheCore.load_back`'s fills)
    fills: bool = False
    #: the prefix found was shorter than ``min_hit_tokens``: this match is a miss because of it
    below_minimum: bool = False
    #: the matching request's tenant in the cache's ledger (:mod:`kvtier.core.tenants`): whose pages a prefetch of it makes
    owner: int = 0

    @property
    def host_nodes(self) -> list[PageNode]:
        return self.nodes[len(self.device_pages) :]

    @property
    def last_node(self) -> PageNode | None:
        """The deepest matched node: what a lock on the whole match is taken on."""
        return self.nodes[-1] if self.nodes else None

    @property
    def num_device_pages(self) -> int:
        return len(self.device_pages)

    @property
    def num_host_pages(self) -> int:
        return len(self.nodes) - len(self.device_pages)

    @property
    def num_pages(self) -> int:
        return len(self.keys)


@dataclass(slots=True)
class LoadResult:
    """Result of :meth:`CacheCore.load_back`; ``loaded < requested`` when the device was full.

    ``op`` is this load's plan, ``pending`` the loads of other requests its device prefix waits on."""

    op: int | None
    device_pages: list[int]
    loaded: int
    requested: int
    pending: tuple[int, ...] = ()
    waiter: Waiter | None = field(default=None, compare=False, repr=False)

    @property
    def ops(self) -> tuple[int, ...]:
        return self.pending + ((self.op,) if self.op is not None else ())

    def wait_layer(self, layer: int) -> None:
        """Layer ``layer`` of every page of the prefix is in place (the executor's per-layer wait)."""
        if self.waiter is not None:
            waiter = self.waiter
            for op in self.ops:
                waiter.wait_layer(op, layer)

    def wait(self) -> None:
        """Every load the prefix needs has finished (and its completion is applied)."""
        waiter = self.waiter
        if waiter is not None and any(map(waiter.in_flight, self.ops)):  # (already applied: nothing to wait for)
            waiter.wait_for(self.ops)


@dataclass(slots=True)
class InsertResult:
    """``device_pages`` are the cache's pages for the inserted keys (use them from now on);
    ``freed`` are caller pages released because the key was already on device."""

    device_pages: list[int]
    new_pages: int
    freed: list[int]
    last_node: PageNode | None


@dataclass(slots=True)
class EvictResult:
    requested: int
    evicted: int
    backed_up: int = 0
    dropped: int = 0
