"""``kv_connector_extra_config`` keys for the kvtier connector, as one frozen dataclass.

Keys are flat: ``host_pages`` / ``host_gb`` / ``host_layout`` / ``io_backend`` /
``hash_algo`` / ``model_name`` / ``salt``, and every :class:`~kvtier.config.StorageConfig`
field prefixed with ``storage_`` (``storage_url``, ``storage_prefetch_policy``, ...).
An unknown key is a :class:`~kvtier.errors.ConfigError` that lists the valid ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from kvtier.config import StorageConfig, _help
from kvtier.errors import ConfigError


@dataclass(frozen=True)
class ConnectorOptions:
    host_pages: int | None = _help("host (L2) pool size in pages; overrides host_gb", None)
    host_gb: float = _help("host (L2) pool size in GB, checked against available memory", 1.0)
    host_layout: str = _help("host layout: page_first (one run per page: cheap L3 I/O) or layer_first", "page_first")
    io_backend: str = _help("page copy backend (see kvtier.transfer.backends)", "direct")
    hash_algo: str = _help("page key hash: xxh3_128 or blake3", "xxh3_128")
    model_name: str | None = _help("model name in L3 keys (default: the model path's last component)", None)
    salt: str = _help("extra namespace salt (e.g. a weights revision)", "")
    storage: StorageConfig = field(default_factory=StorageConfig)

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> ConnectorOptions:
        own = {f.name for f in fields(cls)} - {"storage"}
        storage_keys = {f"storage_{f.name}": f.name for f in fields(StorageConfig)}
        unknown = sorted(set(extra) - own - set(storage_keys))
        if unknown:
            raise ConfigError(
                f"kvtier connector: unknown kv_connector_extra_config key(s) {', '.join(unknown)}; "
                f"valid: {', '.join(sorted(own | set(storage_keys)))}"
            )
        storage = StorageConfig(**{storage_keys[k]: v for k, v in extra.items() if k in storage_keys})
        return cls(storage=storage, **{k: v for k, v in extra.items() if k in own})

    def host_pages_for(self, page_bytes: int) -> int:
        if self.host_pages is not None:
            if self.host_pages < 1:
                raise ConfigError(f"kvtier connector: host_pages must be >= 1; got {self.host_pages}")
            return self.host_pages
        pages = int(self.host_gb * (1 << 30)) // page_bytes
        if pages < 1:
            raise ConfigError(f"kvtier connector: host_gb={self.host_gb} holds no {page_bytes}-byte page; raise host_gb")
        return pages
