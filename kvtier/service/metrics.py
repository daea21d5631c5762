"""``kvtier serve --metrics-port``: the node service's Prometheus metrics, served over HTTP.

Nothing is counted per page for them: a scrape takes a :class:`ServiceSnapshot` of the service under its
lock -- the index's counters and one pass over its pages per namespace -- and turns it into metric
families (a custom collector, as :class:`kvtier.metrics.PrometheusCollector` is for a cache). Names
follow the cache's (``kvtier_<what>_total`` counters), under ``kvtier_service_``.

A namespace's salt is a secret its engines share (it keeps others from probing their prefixes) and the
metrics' port is open to every local user: a label shows a salt as a digest (:func:`namespace_label`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from urllib.parse import quote, unquote
from typing import Any

from kvtier.errors import ConfigError
from kvtier.service.index import NamespacePages

#: a :class:`~kvtier.service.server.NodeService` (not imported: the server imports this module)
NodeService = Any

PREFIX = "kvtier_service"
#: the page states per namespace (:class:`NamespacePages`' fields), a label of ``kvtier_service_pages`` and ``_bytes``
STATES = ("published", "held", "leased")


@dataclass(frozen=True)
class ServiceSnapshot:
    """What a scrape reports, read at one instant (no region yet: page counts are 0)."""

    #: bytes per page id (a hybrid model's region: per id of any pool, on average -- a page and its objects are one
    #: region page, each an id of its own pool)
    page_bytes: int
    num_pages: int
    free_pages: int
    namespaces: dict[str, NamespacePages]
    hit_pages: dict[str, int]
    miss_pages: dict[str, int]
    counters: dict[str, int]
    clients: int
    orphaned: int
    writers: int
    #: the service's L3 tier (``ServiceStorage.status()``), if it has one
    l3: dict | None = field(default=None)
    #: the per-engine view (``NodeService.engines()``)
    engines: list[dict] = field(default_factory=list)
    #: the per-tenant rows (:meth:`RegionTenants.usage <kvtier.service.tenants.RegionTenants.usage>`), where tenants are counted
    tenants: list[dict] = field(default_factory=list)

    @classmethod
    def of(cls, service: NodeService) -> ServiceSnapshot:
        with service.lock:
            index, region = service.index, service.region
            counters = {"refused_peers": service.refused, "protocol_errors": service.protocol_errors, "unread_drops": service.unread_drops}
            clients, orphaned, writers = service.attached_clients, service.orphaned_clients, service.joined_writers
            l3 = service.storage.status() if service.storage is not None else None
            if index is None:  # no engine attached yet: no region
                return cls(0, 0, 0, {}, {}, {}, counters | dict.fromkeys(_INDEX_COUNTERS, 0), clients, orphaned, writers, l3)
            counters |= {name: getattr(index, name) for name in _INDEX_COUNTERS}
            return cls(region.format.page_bytes // region.format.pools, index.alloc.num_pages, index.alloc.num_free,
                       index.pages_by_namespace(),
                       dict(index.hit_pages_of), dict(index.miss_pages_of), counters, clients, orphaned, writers, l3, service.engines(),
                       [] if index.tenants is None else service.tenant_usage()[0])


#: the index's counters exported as ``kvtier_service_<name>_total``
_INDEX_COUNTERS = ("lookups", "published_pages", "evicted_pages", "expired_pages", "dropped_writes", "expired_leases", "corrupt_pages")

_HELP = {
    "refused_peers": "peers refused when they connected (another uid, not of --allow-group)",
    "protocol_errors": "connections closed for a message that broke the protocol",
    "unread_drops": "clients dropped for leaving their answers unread past the send deadline",
    "lookups": "lookup ops answered",
    "published_pages": "pages published (written and offered to lookups of their namespace)",
    "evicted_pages": "pages nobody held evicted to make room",
    "expired_pages": "pages nobody held for --tenant-ttl-s, evicted",
    "dropped_writes": "pages reserved and never published, freed when their writer detached",
    "expired_leases": "of dropped_writes: pages whose writer's process died (its lease expired)",
    "corrupt_pages": "published pages whose bytes failed their checksum when a lookup verified them (dropped: misses)",
}


def _decoded(field: str) -> str:
    """A percent-encoded field decoded where that gives printable text; else encoded (``%0A`` stays ``%0A``, a bidi
    override shows as ``%E2%80%AE``): a label, a log line or ``--status`` never shows a control character a client sent."""
    text = unquote(field)
    return text if text.isprintable() else quote(text, safe="")


def namespace_label(namespace: str) -> str:
    """``namespace`` as a person reads it in a label or ``--status``: a :class:`~kvtier.hashing.Namespace`'s string is
    ``model-fingerprint-tpN`` and, if salted, ``-salt``, each field percent-encoded (so ``-`` only joins them);
    the first three are shown decoded (``smollm2-135m-instruct``, not ``smollm2%2D135m%2Dinstruct``), and what
    follows the third ``-`` as ``#`` and 8 hex digits of its BLAKE2b digest, never as it is."""
    head = namespace.split("-", 3)
    shown = "-".join(_decoded(field) for field in head[:3])
    if len(head) < 4:
        return shown
    return shown + "-#" + hashlib.blake2b(head[3].encode(), digest_size=4).hexdigest()


class ServiceCollector:
    """A Prometheus collector over a :class:`NodeService`, read at each scrape."""

    def __init__(self, service: NodeService):
        self.service = service

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snap = ServiceSnapshot.of(self.service)
        yield GaugeMetricFamily(f"{PREFIX}_region_pages", "pages the shared region holds", value=snap.num_pages)
        yield GaugeMetricFamily(f"{PREFIX}_region_bytes", "bytes of the region's pages", value=snap.num_pages * snap.page_bytes)
        yield GaugeMetricFamily(f"{PREFIX}_free_pages", "region pages neither written nor published", value=snap.free_pages)
        pages = GaugeMetricFamily(f"{PREFIX}_pages", "pages per namespace: published (offered to its lookups), held by a client, "
                                  "leased (being written)", labels=["namespace", "state"])
        nbytes = GaugeMetricFamily(f"{PREFIX}_bytes", "bytes of kvtier_service_pages", labels=["namespace", "state"])
        for ns, counts in sorted(snap.namespaces.items()):
            for state in STATES:
                pages.add_metric([namespace_label(ns), state], getattr(counts, state))
                nbytes.add_metric([namespace_label(ns), state], getattr(counts, state) * snap.page_bytes)
        yield pages
        yield nbytes
        for what, per_ns, verb in (("hit", snap.hit_pages, "offered"), ("miss", snap.miss_pages, "not offered")):
            fam = CounterMetricFamily(f"{PREFIX}_lookup_{what}_pages", f"pages a namespace's lookups were {verb}", labels=["namespace"])
            for ns, n in sorted(per_ns.items()):
                fam.add_metric([namespace_label(ns)], n)
            yield fam
        clients = GaugeMetricFamily(f"{PREFIX}_clients", "engines attached, dropped sessions kept while their process (or a writer "
                                    "that joined them) lives, and processes joined to a session as its writers", labels=["state"])
        clients.add_metric(["attached"], snap.clients)
        clients.add_metric(["orphaned"], snap.orphaned)
        clients.add_metric(["writers"], snap.writers)
        yield clients
        for name, value in snap.counters.items():
            yield CounterMetricFamily(f"{PREFIX}_{name}", _HELP[name], value=value)
        if snap.l3 is not None:
            yield from _l3_families(snap.l3)
        yield from _engine_families(snap.engines)
        if snap.tenants:
            yield from _tenant_families(snap.tenants)


#: the L3 tier's counters (``StorageCounters``) as ``kvtier_service_l3_<name>_total``
_L3_COUNTERS = {
    "saved_pages": "pages written through to the L3 store",
    "save_failed_pages": "pages whose save to the L3 store failed (kept in the region only)",
    "found_pages": "pages a lookup's L3 probe found in the store",
    "fetched_pages": "pages loaded from the L3 store into the region (verified before offered)",
    "fetch_failed_pages": "pages whose load from the L3 store failed (a miss)",
    "corrupt_pages": "pages the L3 store gave back that failed their checksum (a miss; deleted so the next save rewrites them)",
}
#: what a store that evicts by itself (the file store) deleted, by bound, and refused (kvtier.l3.tenant_bounds)
_STORE_COUNTERS = {
    "evicted_objects": "objects the L3 store's cap deleted (least recently used, never a tenant's below its guarantee)",
    "expired_objects": "tenants' objects the L3 store deleted, unused past tenant_ttl_s",
    "capped_objects": "tenants' objects the L3 store deleted past tenant_max_gb (the tenant's least recently used)",
    "refused_full": "objects the L3 store refused: only tenants' guaranteed bytes were left above its cap",
}


def _engine_families(engines: list[dict]):
    """The per-engine view, labelled by the engine's connection, process and namespace (a session's series goes when it
    detaches; two engines of one process are two connections)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    labels = ["client", "pid", "namespace"]
    pages = GaugeMetricFamily(f"{PREFIX}_engine_pages", "pages an attached engine holds (read) or leases (writes)",
                              labels=[*labels, "state"])
    share = GaugeMetricFamily(f"{PREFIX}_engine_share_pages", "pages an attached engine means to hold at once (its host tier's size)",
                              labels=labels)
    short = GaugeMetricFamily(f"{PREFIX}_engine_share_short_pages", "of an engine's share, the pages the region does not have (a "
                              "share larger than the region: it keeps fewer pages of each prompt than it was sized for)", labels=labels)
    hits = CounterMetricFamily(f"{PREFIX}_engine_hit_pages", "pages an attached engine's lookups were offered", labels=labels)
    for e in engines:
        who = [str(e["client"]), str(e["pid"]), e["namespace"]]
        pages.add_metric([*who, "held"], e["held"])
        pages.add_metric([*who, "leased"], e["leased"])
        share.add_metric(who, e["share_pages"])
        short.add_metric(who, e["share_short_pages"])
        hits.add_metric(who, e["hit_pages"])
    yield from (pages, share, short, hits)


#: the per-tenant counters, as ``kvtier_service_tenant_<name>_total``
_TENANT_COUNTERS = {
    "hit_pages": "pages of a tenant's a lookup was offered",
    "evicted_pages": "pages of a tenant's evicted to make room (a reservation's, above its guarantee, or its own at its cap)",
    "expired_pages": "pages of a tenant's nobody held for --tenant-ttl-s, evicted",
    "capped_pages": "pages a tenant published at its cap with none of its own to evict (not offered)",
}


def _tenant_families(rows: list[dict]):
    """The per-tenant view (kvtier serve --tenant-*), labelled by the namespace (as every label shows it) and the tenant's
    digest (the engine's label: never a tenant's name)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    labels = ["namespace", "tenant"]
    pages = GaugeMetricFamily(f"{PREFIX}_tenant_pages", "region pages a tenant's requests wrote, offered to lookups", labels=labels)
    counters = {name: CounterMetricFamily(f"{PREFIX}_tenant_{name}", text, labels=labels) for name, text in _TENANT_COUNTERS.items()}
    l3 = GaugeMetricFamily(f"{PREFIX}_tenant_l3_bytes", "bytes of a tenant's objects in the service's L3 store (a file store with "
                           "tenant bounds: at its last sweep, plus what the service wrote since)", labels=labels)
    for row in rows:
        who = [row["namespace"], row["tenant"]]
        pages.add_metric(who, row["pages"])
        for name, fam in counters.items():
            fam.add_metric(who, row[name])
        if "l3_bytes" in row:
            l3.add_metric(who, row["l3_bytes"])
    yield pages
    yield from counters.values()
    if l3.samples:
        yield l3


def _l3_families(l3: dict):
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    for name, help_text in _L3_COUNTERS.items():
        yield CounterMetricFamily(f"{PREFIX}_l3_{name}", help_text, value=l3[name])
    for name, help_text in _STORE_COUNTERS.items():
        if name in l3:  # (a store that keeps them)
            yield CounterMetricFamily(f"{PREFIX}_l3_store_{name}", help_text, value=l3[name])
    queue = GaugeMetricFamily(f"{PREFIX}_l3_queue_pages", "pages waiting for or in an L3 save, or an L3 load", labels=["op"])
    queue.add_metric(["save"], l3["saving_pages"])
    queue.add_metric(["load"], l3["fetching_pages"])
    yield queue
    # (1 once a call to the store succeeded, 0 once one failed; absent until one ran)
    if l3["available"] is not None:
        yield GaugeMetricFamily(f"{PREFIX}_l3_available", "whether the L3 store answered its last call", value=int(l3["available"]))


class MetricsServer:
    """The HTTP server a service's metrics are scraped from (``/metrics``), on its own thread."""

    def __init__(self, httpd, thread):
        self._httpd, self._thread = httpd, thread
        self.host, self.port = httpd.server_address[:2]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(10)


def serve_metrics(service: NodeService, host: str, port: int) -> MetricsServer:
    """Serve ``service``'s metrics on ``host``:``port`` (0: a free port; :attr:`MetricsServer.port` says which)."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    registry.register(ServiceCollector(service))
    try:
        httpd, thread = start_http_server(port, host, registry)
    except OSError as e:
        raise ConfigError(f"--metrics-port {port} on --metrics-host {host}: cannot serve metrics there ({e.strerror or e}); "
                          "choose another port or address") from None
    return MetricsServer(httpd, thread)
