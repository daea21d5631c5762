"""Every config of the library, here and only here: one frozen dataclass per component.

:class:`TierConfig` (pool sizes), :class:`CacheConfig` (the policy core),
:class:`StorageConfig` (L3). Applications and integrations compose them
(``kvtier run``'s ``RunConfig``, the vLLM connector's ``ConnectorOptions``)
rather than re-declare their fields. Each field carries its help text in
``metadata["help"]``; the CLI derives its flags from these fields
(``kvtier.app.cli_options``), so names, types and defaults live in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kvtier.errors import ConfigError
from kvtier.layout import DEFAULT_HOST_LAYOUT, LAYOUTS

WritePolicy = Literal["write_through", "write_through_selective", "write_back"]
DeviceEvictAction = Literal["backup", "drop"]
PrefetchPolicy = Literal["best_effort", "wait_complete", "timeout"]


def _help(text: str, default, **kw):
    return field(default=default, metadata={"help": text}, **kw)


def check_number(obj, name: str, *, at_least: float | None = None, above: float | None = None, at_most: float | None = None,
                 integer: bool = False) -> None:
    """``obj.name`` is a finite number (an int if ``integer``) in range, or None for optional fields;
    else a :class:`ConfigError` naming the field, the value and the allowed range. ``at_most`` bounds
    what would be allocated from the value (threads, pages per call), checked before anything is."""
    v = getattr(obj, name)
    if v is None:
        return
    kind = "an integer" if integer else "a number"
    ok = not isinstance(v, bool) and isinstance(v, int if integer else (int, float)) and v == v and v not in (float("inf"), float("-inf"))
    if ok and at_least is not None and v < at_least:
        ok = False
    if ok and above is not None and v <= above:
        ok = False
    if ok and at_most is not None and v > at_most:
        ok = False
    if not ok:
        bound = f" >= {at_least:g}" if at_least is not None else f" > {above:g}" if above is not None else ""
        if at_most is not None:
            bound += f"{',' if bound else ''} <= {at_most:g}"
        raise ConfigError(f"{type(obj).__name__}.{name} must be {kind}{bound}; got {v!r}")


#: the L3 circuit breaker's back-off (see kvtier.l3.breaker): StorageConfig's and SGLang's extra config's defaults
DEFAULT_COOLDOWN_S = 0.5
DEFAULT_MAX_COOLDOWN_S = 30.0

#: bounds on values that size what is allocated: pages moved per backend call, I/O threads
MAX_BATCH_PAGES = 4096
MAX_IO_THREADS = 64


def _choice(obj, name: str, choices: tuple[str, ...]) -> None:
    if getattr(obj, name) not in choices:
        raise ConfigError(f"{type(obj).__name__}.{name} must be one of {', '.join(choices)}; got {getattr(obj, name)!r}")


HostLayoutKind = Literal["page_first", "layer_first"]


@dataclass(frozen=True)
class TierConfig:
    """Sizes and placement of the device (L1) and host (L2) pools."""

    device_pages: int = _help("device (L1) pool size in pages", 64)
    host_pages: int = _help("host (L2) pool size in pages (ignored when host_gb is set)", 96)
    host_gb: float | None = _help("host (L2) pool size in GB; checked against available memory", None)
    host_layout: HostLayoutKind = _help("host layout: page_first (one run per page: cheap L3 I/O) or layer_first", DEFAULT_HOST_LAYOUT)
    device: str = _help("where the device pool lives: cpu or cuda", "cpu")
    service: str | None = _help(
        "a kvtier serve socket path: the host tier is the node service's shared region, shared with every engine attached to it "
        "(host_pages / host_gb: how much of it this engine holds at once); None: a host tier of this process's own", None
    )
    service_timeout_s: float = _help("the node service: seconds a call may take (attaching, status)", 10.0)
    service_lookup_timeout_s: float | None = _help(
        "the node service: seconds a call the engine's thread waits on may take (a lookup, a reservation, a note's send, attaching "
        "again); past it the service is lost until it answers again (host misses). None: the smaller of 0.25 and service_timeout_s",
        None,
    )

    service_required: bool = _help(
        "the node service: fail to start when it does not answer. False: start without it (one warning line, host misses) "
        "and attach when it answers", False,
    )
    service_uid: int | None = _help(
        "the node service: the uid it runs as, when not this process's (a member of its --allow-group attaching to another "
        "user's service); the engine refuses a socket directory, a listener or a region of any other uid. None: this process's",
        None,
    )

    def __post_init__(self) -> None:
        check_number(self, "service_uid", at_least=0, at_most=(1 << 32) - 2, integer=True)
        if not isinstance(self.service_required, bool):
            raise ConfigError(f"TierConfig.service_required must be true or false; got {self.service_required!r}")
        if self.service is not None and (not isinstance(self.service, str) or not self.service):
            raise ConfigError(f"TierConfig.service must be a socket path (kvtier serve --socket) or None; got {self.service!r}")
        check_number(self, "service_timeout_s", above=0)
        check_number(self, "service_lookup_timeout_s", above=0)
        if self.service_lookup_timeout_s is not None and self.service_lookup_timeout_s > self.service_timeout_s:
            raise ConfigError(f"TierConfig.service_lookup_timeout_s={self.service_lookup_timeout_s:g} is longer than service_timeout_s="
                              f"{self.service_timeout_s:g} (a call's whole deadline); lower it, or raise service_timeout_s")
        check_number(self, "device_pages", at_least=1, integer=True)
        check_number(self, "host_pages", at_least=1, integer=True)
        check_number(self, "host_gb", above=0)
        _choice(self, "host_layout", LAYOUTS)
        if self.device not in ("cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ConfigError(f"TierConfig.device must be cpu or cuda; got {self.device!r}")

    def host_pages_for(self, page_bytes: int) -> int:
        """Host pool pages: ``host_pages``, or as many whole pages as ``host_gb`` holds."""
        if self.host_gb is None:
            return self.host_pages
        pages = int(self.host_gb * (1 << 30)) // page_bytes
        if pages < 1:
            raise ConfigError(f"TierConfig.host_gb={self.host_gb} holds no {page_bytes}-byte page; raise host_gb or set host_pages")
        return pages


@dataclass(frozen=True)
class CacheConfig:
    """Policy of the device/host prefix cache."""

    write_policy: WritePolicy = _help(
        "when device pages are backed up to host: write_through (at insert), write_through_selective (after N hits), "
        "write_back (on eviction)",
        "write_through",
    )
    write_through_threshold: int = _help("hits before a page is backed up under write_through_selective", 2)
    on_device_evict: DeviceEvictAction = _help(
        "a device-only page being evicted is backed up to host first (backup) or dropped (drop)", "backup"
    )
    hash_algo: Literal["xxh3_128", "blake3"] = _help("page key hash (128-bit, chained)", "xxh3_128")
    io_backend: str = _help("page copy backend (see kvtier.transfer.backends)", "direct")
    preallocate_nodes: bool = _help("build one tree node per device+host page at startup, so serving creates no GC-tracked objects", True)
    min_hit_tokens: int = _help(
        "a request's cached prefix counts only from this many tokens: a shorter one is served as a miss and recomputed, so a "
        "probe of a short guess learns nothing by its time (the Early Bird mitigation; docs/tenants.md); 0: every hit counts", 0)
    tenant_host_pages: int = _help(
        "each tenant's guaranteed host pages: another tenant's writes never evict its host pages below this (docs/tenants.md)", 0)
    tenant_max_host_pages: int | None = _help(
        "each tenant's cap on host pages: at it, a tenant's new host copies replace its own least recently used ones; None: no cap",
        None)
    tenant_ttl_s: float | None = _help(
        "seconds a tenant's host page may go unused before it leaves the host tier (not written back to L3); None: no lifetime", None)
    tenant_accounting: bool = _help(
        "count host pages, hits, evictions and expiries per tenant (a digest, never its name); on whenever a tenant_* bound is set",
        False)

    def __post_init__(self) -> None:
        _choice(self, "write_policy", ("write_through", "write_through_selective", "write_back"))
        _choice(self, "on_device_evict", ("backup", "drop"))
        _choice(self, "hash_algo", ("xxh3_128", "blake3"))
        check_number(self, "write_through_threshold", at_least=1, integer=True)
        check_number(self, "min_hit_tokens", at_least=0, integer=True)
        check_number(self, "tenant_host_pages", at_least=0, integer=True)
        check_number(self, "tenant_max_host_pages", at_least=0, integer=True)
        check_number(self, "tenant_ttl_s", above=0)
        if not isinstance(self.tenant_accounting, bool):
            raise ConfigError(f"CacheConfig.tenant_accounting must be true or false; got {self.tenant_accounting!r}")
        if self.tenant_max_host_pages is not None and self.tenant_host_pages > self.tenant_max_host_pages:
            raise ConfigError(f"CacheConfig.tenant_host_pages={self.tenant_host_pages} is above tenant_max_host_pages="
                              f"{self.tenant_max_host_pages}: a tenant cannot be guaranteed more than it may hold")

    @property
    def accounts_tenants(self) -> bool:
        """Whether the cache keeps a ledger per tenant (:mod:`kvtier.core.tenants`)."""
        return (self.tenant_accounting or self.tenant_host_pages > 0 or self.tenant_max_host_pages is not None
                or self.tenant_ttl_s is not None)


@dataclass(frozen=True)
class StorageConfig:
    """The L3 tier: where pages go when they leave host memory, and how they come back."""

    url: str | None = _help(
        "L3 backend URL: file:///dir, redis://host:port/db, redis+cluster://host:port, mooncake://host:port; None disables L3", None
    )
    write_policy: Literal["write_through", "write_back"] = _help(
        "save host pages to L3 as soon as they are on host (write_through) or only when host evicts them (write_back)", "write_through"
    )
    prefetch_policy: PrefetchPolicy = _help(
        "when a request is scheduled: use what arrived (best_effort), wait for all (wait_complete), or wait up to a budget (timeout)",
        "wait_complete",
    )
    prefetch_timeout_base_s: float = _help("timeout policy: fixed part of the budget", 0.05)
    prefetch_timeout_per_page_s: float = _help("timeout policy: budget added per page to prefetch", 0.005)
    min_prefetch_pages: int = _help("skip prefetch for fewer stored pages than this (recompute is cheaper)", 1)
    batch_pages: int = _help("pages per backend call", 8)
    io_threads: int | None = _help(
        "batches moved to or from the store at once, each read and checked (or hashed and written) by its own thread; "
        "unset: the backend's choice (file and Redis Cluster 2, one Redis node and Mooncake 1)",
        None,
    )
    queue_depth: int = _help("storage jobs queued before saves apply back-pressure", 64)
    cooldown_s: float = _help(
        "after a storage fault, answer misses without calling the store for this long; it doubles (with "
        "jitter) while the fault persists, and a probe off the engine's thread finds the store back",
        DEFAULT_COOLDOWN_S,
    )
    max_cooldown_s: float = _help("the longest the back-off after a storage fault grows to", DEFAULT_MAX_COOLDOWN_S)

    def __post_init__(self) -> None:
        _choice(self, "write_policy", ("write_through", "write_back"))
        _choice(self, "prefetch_policy", ("best_effort", "wait_complete", "timeout"))
        for name in ("min_prefetch_pages", "queue_depth"):
            check_number(self, name, at_least=1, integer=True)
        check_number(self, "batch_pages", at_least=1, at_most=MAX_BATCH_PAGES, integer=True)
        check_number(self, "io_threads", at_least=1, at_most=MAX_IO_THREADS, integer=True)
        for name in ("prefetch_timeout_base_s", "prefetch_timeout_per_page_s", "cooldown_s", "max_cooldown_s"):
            check_number(self, name, at_least=0)
        if self.url is not None and not isinstance(self.url, str):
            raise ConfigError(f"StorageConfig.url must be a URL string, got {type(self.url).__name__}")

    def prefetch_budget_s(self, pages: int) -> float:
        return self.prefetch_timeout_base_s + self.prefetch_timeout_per_page_s * pages

    @property
    def bounds_tenants(self) -> bool:
        """Whether the URL bounds tenants in the store (a ``tenant_*`` option, :mod:`kvtier.l3.tenant_bounds`): the core
        then keeps a tenants' ledger, by which it tags each page object it saves with its owner."""
        query = self.url.partition("?")[2] if self.url else ""
        return any(part.startswith("tenant_") for part in query.split("&"))
