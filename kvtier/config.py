"""One frozen config dataclass per component, composed at the top (:class:`KVTierConfig`).

Each field carries its help text in ``metadata["help"]``; the CLI derives its
flags from these fields (``kvtier.cli_options``), so defaults live in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

from kvtier.errors import ConfigError

WritePolicy = Literal["write_through", "write_through_selective", "write_back"]
DeviceEvictAction = Literal["backup", "drop"]
PrefetchPolicy = Literal["best_effort", "wait_complete", "timeout"]


def _help(text: str, default, **kw):
    return field(default=default, metadata={"help": text}, **kw)


def _choice(obj, name: str, choices: tuple[str, ...]) -> None:
    if getattr(obj, name) not in choices:
        raise ConfigError(f"{type(obj).__name__}.{name} must be one of {', '.join(choices)}; got {getattr(obj, name)!r}")


@dataclass(frozen=True)
class CacheConfig:
    """Policy of the device/host prefix cache."""

    write_policy: WritePolicy = _help("when device pages are backed up to host: write_through (at insert), write_through_selective (after N hits), write_back (on eviction)", "write_through")
    write_through_threshold: int = _help("hits before a page is backed up under write_through_selective", 2)
    on_device_evict: DeviceEvictAction = _help("a device-only page being evicted is backed up to host first (backup) or dropped (drop)", "backup")
    hash_algo: Literal["xxh3_128", "blake3"] = _help("page key hash (128-bit, chained)", "xxh3_128")
    io_backend: str = _help("page copy backend (see kvtier.transfer.backends)", "direct")

    def __post_init__(self) -> None:
        _choice(self, "write_policy", ("write_through", "write_through_selective", "write_back"))
        _choice(self, "on_device_evict", ("backup", "drop"))
        _choice(self, "hash_algo", ("xxh3_128", "blake3"))
        if self.write_through_threshold < 1:
            raise ConfigError(f"CacheConfig.write_through_threshold must be >= 1; got {self.write_through_threshold}")


def field_help(cls) -> dict[str, str]:
    return {f.name: f.metadata.get("help", "") for f in fields(cls)}
