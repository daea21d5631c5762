"""``kv_connector_extra_config`` keys for the kvtier connector: the library's own configs, composed.

Keys are flat, as vLLM passes them: ``host_pages`` / ``host_gb`` / ``host_layout``
set the :class:`~kvtier.config.TierConfig` (host side: vLLM owns the device
blocks; default 1 GB of host), and so do ``service`` (a ``kvtier serve`` socket,
``unix:///path`` or a plain path: the host tier is the node service's region,
``host_pages`` / ``host_gb`` then the engine's share of it, all ranks' shards
together), ``service_timeout_s``, ``service_lookup_timeout_s``, ``service_uid`` (the uid the service runs
as, when not the engine's own) and ``service_required`` (fail to start when the service does not answer;
default: start without it and attach when it answers), ``service_lookups`` (``step``: the service is
asked once per scheduler step about all that step's requests; ``request``: once per request); ``hash_algo`` / ``io_backend`` the
:class:`~kvtier.config.CacheConfig`, every :class:`~kvtier.config.StorageConfig`
field prefixed with ``storage_`` (``storage_url``, ``storage_prefetch_policy``,
...) the L3 tier; ``model_name`` and ``salt`` name the L3 namespace; ``load_retry_s``
is how long a page that failed to load is not offered again. An unknown
key is a :class:`~kvtier.errors.ConfigError` that lists the valid ones; a bad
value is the owning config's own typed error.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from kvtier.config import CacheConfig, StorageConfig, TierConfig, _help, check_number
from kvtier.errors import ConfigError
from kvtier.service.peer import service_socket_path

#: flat keys -> (section, field); the device side of TierConfig is vLLM's, not ours
_TIER_KEYS = ("host_pages", "host_gb", "host_layout", "service", "service_timeout_s", "service_lookup_timeout_s", "service_uid",
              "service_required")
_CACHE_KEYS = ("hash_algo", "io_backend", "min_hit_tokens", "tenant_host_pages", "tenant_max_host_pages", "tenant_ttl_s",
               "tenant_accounting")
#: the host size when neither host_pages nor host_gb is given
DEFAULT_HOST_GB = 1.0
#: how the scheduler asks the node service: once per step for all the step's requests, or once per request
SERVICE_LOOKUPS = ("step", "request")


@dataclass(frozen=True)
class ConnectorOptions:
    model_name: str | None = _help("model name in L3 keys (default: the model path's last component)", None)
    salt: str = _help("extra namespace salt (e.g. a weights revision)", "")
    load_retry_s: float = _help("after a page failed to load, it is not offered again for this long (no lookup -> load -> fail loop)", 10.0)
    rank_timeout_s: float = _help("a plan some rank has not reported this long after it went out counts as failed on that rank: "
                                  "a miss for loads; for copies out of vLLM's blocks, each worker gives the blocks back after as "
                                  "long (the copy's host pages are held until it answers)", 10.0)
    service_lookups: str = _help("with service: 'step' asks the service once per scheduler step about every request the step "
                                 "asked about (a request the engine does not hold whole waits one step for its answer); "
                                 "'request' asks as vLLM asks, a round trip for each request", "step")
    shared_prefixes: tuple[tuple[int, ...], ...] = _help(
        "token ids of prefixes (system prompts) declared shareable across cache_salts: a request of any salt that starts with "
        "one shares its full pages in kvtier's tiers, and keeps what follows its own (docs/tenants.md)", ())
    tiers: TierConfig = field(default_factory=lambda: TierConfig(host_gb=DEFAULT_HOST_GB))
    #: with ``service`` and neither ``host_pages`` nor ``host_gb``: this engine's share is the whole region (the
    #: service's --host-gb sizes the host tier; the service evicts among the pages no engine holds)
    service_share_from_region: bool = False
    cache: CacheConfig = field(default_factory=CacheConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)

    def __post_init__(self) -> None:
        check_number(self, "load_retry_s", at_least=0)
        check_number(self, "rank_timeout_s", above=0)
        prefixes = self.shared_prefixes
        if not isinstance(prefixes, (list, tuple)) or not all(
                isinstance(p, (list, tuple)) and all(type(t) is int for t in p) for p in prefixes):
            raise ConfigError("kvtier connector: shared_prefixes must be a list of token-id lists (each a system prompt's "
                              f"tokens, as the model's tokenizer gives them); got {str(prefixes)[:80]}")
        object.__setattr__(self, "shared_prefixes", tuple(tuple(p) for p in prefixes))
        if self.service_lookups not in SERVICE_LOOKUPS:
            raise ConfigError(f"kvtier connector: service_lookups must be one of {', '.join(SERVICE_LOOKUPS)}, "
                              f"got {self.service_lookups!r}")

    @classmethod
    def valid_keys(cls) -> list[str]:
        return sorted(
            {"model_name", "salt", "load_retry_s", "rank_timeout_s", "service_lookups", "shared_prefixes", *_TIER_KEYS, *_CACHE_KEYS}
            | {f"storage_{f.name}" for f in fields(StorageConfig)}
        )

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> ConnectorOptions:
        unknown = sorted(set(extra) - set(cls.valid_keys()))
        if unknown:
            raise ConfigError(
                f"kvtier connector: unknown kv_connector_extra_config key(s) {', '.join(unknown)}; valid: {', '.join(cls.valid_keys())}"
            )
        tier = {k: extra[k] for k in _TIER_KEYS if k in extra}
        if "service" in tier:
            tier["service"] = service_socket_path(tier["service"], "kvtier connector: service")
            if extra.get("storage_url"):
                raise ConfigError("kvtier connector: service and storage_url cannot both be set: an engine attached to the node service "
                                  "has no L3 of its own (the service keeps the tiers below the engine); drop storage_url, or service")
        share_from_region = "service" in tier and "host_pages" not in tier and "host_gb" not in tier
        if "host_pages" not in tier:
            tier.setdefault("host_gb", DEFAULT_HOST_GB)
        return cls(
            service_share_from_region=share_from_region,
            model_name=extra.get("model_name"),
            salt=extra.get("salt", ""),
            **{k: extra[k] for k in ("load_retry_s", "rank_timeout_s", "service_lookups", "shared_prefixes") if k in extra},
            tiers=TierConfig(**tier),
            cache=CacheConfig(**{k: extra[k] for k in _CACHE_KEYS if k in extra}),
            storage=StorageConfig(**{f.name: extra[f"storage_{f.name}"] for f in fields(StorageConfig) if f"storage_{f.name}" in extra}),
        )
