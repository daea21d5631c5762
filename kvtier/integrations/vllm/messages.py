"""What passes between the connector's scheduler side and its workers: nothing but these.

* :class:`KVTierHandshake` -- each worker, once, after registering its KV caches
  (vLLM's ``get_handshake_metadata`` -> ``set_xfer_handshake_metadata``): the
  spec its tensors make, its host pages and its L3 namespace.
* :class:`KVTierConnectorMetadata` -- scheduler -> every worker, each step: the
  core's plans (:class:`~kvtier.core.plans.Transfer`, page ids and page keys),
  the node service's region their host page ids are of (attached to a service),
  and which copies out of vLLM's blocks hold blocks vLLM must keep (finished
  requests whose blocks wait for them, preempted requests' blocks).
* :class:`KVTierWorkerMeta` -- each worker -> scheduler, each step
  (``build_connector_worker_meta``; vLLM aggregates the ranks' with
  :meth:`KVTierWorkerMeta.aggregate`): the completions of plans it ran, joined
  over ranks: a plan counts as done only when every rank has it done, and a
  page that failed on any rank failed for all.

All of them are plain dataclasses of ints, bytes, strings and enums: they
pickle across vLLM's process boundaries as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvtier.core.plans import Completion, CutShort, Done, Failed, Transfer, completed_pages
from kvtier.service.region import Region
from kvtier.spec import KVSpec


@dataclass
class KVTierHandshake(KVConnectorHandshakeMetadata):
    tp_rank: int
    spec: KVSpec
    #: this rank's host pages (0 attached to the node service: the scheduler's share of its region)
    host_pages: int
    #: the L3 key prefix of this rank's pages (``Namespace`` string), None without L3
    storage_prefix: str | None
    #: a hybrid model: each sliding-window group's spec (its layers' tensors) and host objects
    group_pages: dict[str, tuple[KVSpec, int]] = field(default_factory=dict)


@dataclass
class KVTierConnectorMetadata(KVConnectorMetadata):
    plans: list[Transfer] = field(default_factory=list)
    #: blocks vLLM was promised but kvtier could not plan a load for (the pages went meanwhile):
    #: every worker reports them as load errors, so vLLM recomputes them
    unavailable_blocks: list[int] = field(default_factory=list)
    #: finished requests whose blocks vLLM keeps (request_finished said so) until these copies out of
    #: them completed: each worker reports the request in ``get_finished`` once its own copies are done
    delayed: dict[str, list[int]] = field(default_factory=dict)
    #: copies out of blocks the step may overwrite -- preempted requests' blocks, a hybrid model's window
    #: blocks vLLM freed and allocated again: ``handle_preemptions`` waits for them before the forward
    preempted_copies: list[int] = field(default_factory=list)
    #: a hybrid model's asynchronous loads among ``plans``: op -> (request, whether it brings all that was
    #: offered); every worker reports the request finished (and failed, unless the load was whole and
    #: completed) once the load ended on it
    async_loads: dict[int, tuple[str, bool]] = field(default_factory=dict)
    #: requests whose asynchronous load could not be planned: reported finished and failed at once
    async_failed: list[str] = field(default_factory=list)
    #: attached to the node service: the region every host page id of ``plans`` is of (each worker maps its
    #: shard of it, and maps it anew when it changes: the scheduler attached to a restarted service)
    region: Region | None = None
    #: the scheduler's session on the node service: each worker joins it as a process that writes into its
    #: pages before it runs the step's plans (so the service keeps them out of circulation while a worker
    #: of a dead scheduler may still be copying)
    service_session: str | None = None


@dataclass
class RankResult:
    """One plan's completion joined over the ranks that reported it so far: the ranks are a set, so
    a rank whose report arrives twice still counts once (``duplicates`` counts the extra reports)."""

    completion: Completion
    ranks: frozenset[int] = frozenset({0})
    duplicates: int = 0

    def merged(self, other: RankResult) -> RankResult:
        """Both reports joined; a report only from ranks already counted is ignored (and counted)."""
        dup = int(bool(self.ranks & other.ranks)) + self.duplicates + other.duplicates
        if other.ranks <= self.ranks:
            return RankResult(self.completion, self.ranks, dup)
        return RankResult(join(self.completion, other.completion), self.ranks | other.ranks, dup)


def join(a: Completion, b: Completion) -> Completion:
    """Two ranks' completions of one plan: the leading pages both completed."""
    if type(a) is Failed:
        return a
    if type(b) is Failed:
        return b
    if type(a) is Done and type(b) is Done:
        return a if a.existing <= b.existing else b
    big = 1 << 62  # Done covers every page of the plan
    pa, pb = completed_pages(a, big), completed_pages(b, big)
    short = a if pa <= pb else b
    existing = min(a.existing, b.existing)
    return CutShort(a.op, min(pa, pb), short.reason, max(a.corrupt, b.corrupt), existing)


@dataclass
class KVTierWorkerMeta(KVConnectorWorkerMetadata):
    results: dict[int, RankResult] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVTierWorkerMeta:
        merged = dict(self.results)
        for op, r in getattr(other, "results", {}).items():
            mine = merged.get(op)
            merged[op] = r if mine is None else mine.merged(r)
        return KVTierWorkerMeta(merged)
