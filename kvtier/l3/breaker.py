"""The L3 circuit breaker: after a fault, treat the node it came from as down, and find out off the
engine's thread when it is back.

A store is one node (a file store, a single Redis server: :data:`~kvtier.l3.base.STORE`) or several
that fail apart (a Redis Cluster's primaries: the backend declares ``capabilities.nodes``, names each
key's node and counts faults per node). Each node has a breaker of its own, so a dead or stalled
node costs one deadline, not one per request, and the other nodes keep serving::

    CLOSED --a call to it faults--> OPEN (back-off: cooldown_s x 2^(faults-1), capped at max_cooldown_s, +-20% jitter)
    OPEN --back-off elapsed--> PROBING: one probe on a helper thread asks that node; callers still see "down"
    PROBING --probe ok--> CLOSED        PROBING --probe faults--> OPEN (the next, longer back-off)

A call goes to the leading keys whose nodes are not marked down (:meth:`CircuitBreaker.reachable`):
a lookup is a longest-prefix count, and a chained read or save is useless past a missing page, so
from the first key on a node marked down the keys are absent (lookups) or failed (reads, writes) at
once, and the thread that asks (the engine's) never waits on that node. While the store's own node
is open (a store without nodes, or a fault no node owns) :attr:`~CircuitBreaker.available` is False
and nothing is called. A cluster node's probe asks that node (``backend.probe_node``); the store's
is an ``exists`` of a fixed key. Both run under the backend's lookup deadline (Redis:
``lookup_timeout``).

The back-off parameters have one home, :class:`~kvtier.config.StorageConfig` (``cooldown_s``,
``max_cooldown_s``); SGLang's extra config takes the same fields.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.l3.base import STORE, StorageBackend, map_storage_errors

_JITTER = 0.2


@dataclass(eq=False)
class NodeBreaker:
    """One node's breaker (changed under its table's lock)."""

    name: str
    closed: bool = True
    #: while open: when its back-off ends and a probe may ask
    down_until: float = 0.0
    #: consecutive faults: the back-off doubles with each
    faults: int = 0
    probing: bool = False
    #: times it opened (from closed) and probes it ran: observability and tests
    opened: int = 0
    probes: int = 0


class CircuitBreaker:
    """The breakers of one store's nodes (see the module's docstring). ``probe_key``: the key the
    store's own probe asks ``exists`` of (absent is fine)."""

    def __init__(self, backend: StorageBackend, cooldown_s: float, max_cooldown_s: float, probe_key: str):
        self.backend = backend
        self.stats = backend.stats
        self.cooldown_s = cooldown_s
        self.max_cooldown_s = max(max_cooldown_s, cooldown_s)
        self.probe_key = probe_key
        self._node_of: Callable[[str], str] | None = backend.node_of if backend.capabilities.nodes else None
        #: the store's own node, and each node that faulted since (one that never did is closed)
        self.nodes: dict[str, NodeBreaker] = {STORE: NodeBreaker(STORE)}
        self._lock = threading.Lock()
        self._rng = random.Random()
        self._all_closed = True  # the hot path: one attribute read
        #: the fault counts last looked at: each fault opens its node once, whichever thread sees it first
        self._errors_seen = self.stats.errors
        self._faults_seen = self._fault_counts()

    # ---- what callers ask --------------------------------------------------------------
    @property
    def available(self) -> bool:
        """False while the store's own node is open: nothing is called then."""
        return self._all_closed or self._usable(self.nodes[STORE])

    @property
    def opened(self) -> int:
        """Times a node's breaker opened, over all nodes."""
        return sum(node.opened for node in list(self.nodes.values()))

    @property
    def probes(self) -> int:
        return sum(node.probes for node in list(self.nodes.values()))

    def reachable(self, names: Sequence[str]) -> int:
        """How many leading ``names`` live on nodes not marked down (a node whose back-off is over
        gets its probe started)."""
        if self._all_closed:
            return len(names)
        if not self._usable(self.nodes[STORE]):
            return 0
        if self._node_of is not None and len(self.nodes) > 1:
            for i, name in enumerate(names):
                node = self.nodes.get(self._node_of(name))
                if node is not None and not self._usable(node):
                    return i
        return len(names)

    def call(self, fn: Callable, names: Sequence[str], *per_name: Sequence):
        """``fn`` on the :meth:`reachable` leading ``names`` and the same leading part of each
        ``per_name`` list; its result covers those names only (None, and nothing called, when there
        are none). Each node the call faulted on opens."""
        n = self.reachable(names)
        if n == 0:
            return None
        result = fn(names[:n], *(p[:n] for p in per_name))
        self._open_faulted()
        return result

    def trip(self) -> None:
        """A fault seen outside :meth:`call` (an exception the backend did not map): open the store's own node."""
        self._open(self.nodes[STORE])

    # ---- state -------------------------------------------------------------------------
    def _node(self, name: str) -> NodeBreaker:
        node = self.nodes.get(name)
        if node is None:
            with self._lock:
                node = self.nodes.setdefault(name, NodeBreaker(name))
        return node

    def _usable(self, node: NodeBreaker) -> bool:
        if node.closed:
            return True
        if time.monotonic() >= node.down_until:
            self._start_probe(node)
        return False

    def _open(self, node: NodeBreaker) -> None:
        """Open ``node`` for its next back-off (re-armed, when it is open already: a probe failed)."""
        with self._lock:
            wait = min(self.max_cooldown_s, self.cooldown_s * 2 ** node.faults) * self._rng.uniform(1 - _JITTER, 1 + _JITTER)
            node.faults = min(node.faults + 1, 64)
            node.down_until = time.monotonic() + wait
            if node.closed:
                node.closed = False
                node.opened += 1
            self._all_closed = False

    def _close(self, node: NodeBreaker) -> None:
        with self._lock:
            node.closed = True
            node.faults = 0
            # faults of calls still in flight while it was down are not news
            self._faults_seen[node.name] = self._fault_count(node.name)
            self._all_closed = all(n.closed for n in self.nodes.values())

    def _fault_counts(self) -> dict[str, int]:
        return dict(self.stats.node_errors) if self._node_of is not None else {STORE: self.stats.errors}

    def _fault_count(self, name: str) -> int:
        return self.stats.node_errors.get(name, 0) if self._node_of is not None else self.stats.errors

    def _open_faulted(self) -> None:
        """Open each closed node whose fault count moved since the last look."""
        if self.stats.errors == self._errors_seen:
            return
        with self._lock:
            self._errors_seen = self.stats.errors
            counts = self._fault_counts()
            moved = [name for name, count in counts.items() if count != self._faults_seen.get(name, 0)]
            self._faults_seen = counts
        for name in moved:
            node = self._node(name)
            if node.closed:  # an open node's new faults are its probe's, or calls in flight when it opened
                self._open(node)

    # ---- probes ------------------------------------------------------------------------
    def _start_probe(self, node: NodeBreaker) -> None:
        with self._lock:
            if node.probing or node.closed:
                return
            node.probing = True
        threading.Thread(target=self._probe_once, args=(node,), name="kvtier-l3-probe", daemon=True).start()

    def _probe_once(self, node: NodeBreaker) -> None:
        node.probes += 1
        try:
            try:
                ok = self._answers(node)
            except Exception:  # the probe's own deadline, a refused connection: still down
                ok = False
            (self._close if ok else self._open)(node)
        finally:
            node.probing = False

    def _answers(self, node: NodeBreaker) -> bool:
        """Whether ``node`` answers its probe: a cluster node its own ``probe_node``, the store an
        ``exists`` of the probe key without a fault."""
        if node.name != STORE:
            return self.backend.probe_node(node.name)
        faults = self._fault_count(STORE)
        failed: list[BaseException] = []
        with map_storage_errors(self.stats, "probe", failed.append):
            self.backend.exists([self.probe_key])
        return not failed and self._fault_count(STORE) == faults
