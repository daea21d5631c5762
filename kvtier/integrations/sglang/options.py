"""``--hicache-storage-backend-extra-config`` keys for kvtier's SGLang storage backend.

SGLang passes the whole JSON object to the backend; on its ``dynamic`` path it
also carries SGLang's own keys (``backend_name``, ``module_path``,
``class_name``, ``interface_v1``, and the controller's prefetch keys), which are
accepted here and left to SGLang; ``file_storage_path`` (SGLang adds it for
``--file-storage-path``) is the file store's root when ``storage_url`` is unset.
Any other unknown key is a :class:`~kvtier.errors.ConfigError` that lists the
valid ones, so a typo never silently falls back to a default store.

``service`` attaches the backend to the node service (``kvtier serve``) instead of an
L3 store: the pages go to the service's shared host region (see
:mod:`kvtier.integrations.sglang.service`). ``storage_url`` beside it is refused;
``file_storage_path`` is then not used. SGLang starts whether the service is there or not (it attaches
when the service appears) unless ``service_required`` asks for the service at start.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

from kvtier.config import DEFAULT_COOLDOWN_S, DEFAULT_MAX_COOLDOWN_S, MAX_BATCH_PAGES, MAX_IO_THREADS, _help, check_number
from kvtier.errors import ConfigError
from kvtier.service.peer import UNIX_SCHEME, service_socket_path
from kvtier.service.client import DEFAULT_DEADLINE_S, DEFAULT_LOOKUP_DEADLINE_S

#: keys SGLang itself reads from the same object (its dynamic-backend loader, and the cache controller's
#: prefetch policy, which the PD decode-offload path leaves in the JSON): accepted, left to SGLang
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "prefetch_threshold", "prefetch_timeout_base",
               "prefetch_timeout_per_ki_token", "hicache_storage_pass_prefix_keys")
#: SGLang adds ``--file-storage-path`` under this key (UnifiedRadixCache): kvtier's file store root when
#: ``storage_url`` is not given, as SGLang means it for its own file backend
SGLANG_FILE_PATH_KEY = "file_storage_path"
#: how ``service`` may name the node service's socket: ``unix:///path`` or the path itself


def default_storage_url() -> str:
    from kvtier.integrations.vllm.model import default_cache_dir

    return f"file://{default_cache_dir() / 'hicache'}"


@dataclass(frozen=True)
class SGLangStorageOptions:
    storage_url: str | None = _help("L3 URL: file:///dir, redis://host:port/db, redis+cluster://host:port, mooncake://host:port "
                                    "(default: file://$KVTIER_CACHE_DIR/hicache, ~/.cache/kvtier/hicache)", None)
    model_name: str | None = _help("model name in L3 keys (default: SGLang's model name)", None)
    salt: str = _help("extra namespace salt (e.g. a weights revision)", "")
    batch_pages: int | None = _help("pages per backend call (default: about the backend's preferred bytes per call)", None)
    io_threads: int | None = _help(
        "backend calls in flight per SGLang batch, each reading and checking its pages (default: the backend's choice)", None
    )
    cooldown_s: float = _help(
        "after a storage fault, answer misses without calling the store for this long (doubling while the "
        "fault persists; a probe off SGLang's threads finds the store back)",
        DEFAULT_COOLDOWN_S,
    )
    max_cooldown_s: float = _help("the longest the back-off after a storage fault grows to", DEFAULT_MAX_COOLDOWN_S)
    service: str | None = _help(
        "the node service's socket (kvtier serve --socket), unix:///path or the path: SGLang's host pool pages go to the "
        "service's shared host region, shared with every SGLang server attached to it, instead of an L3 store", None)
    service_required: bool = _help(
        "the node service: a service that cannot be attached at start fails SGLang's start (a ServiceError naming the socket and "
        "the reason). Default: SGLang starts without it (one warning line, misses) and attaches when it appears", False)
    service_timeout_s: float = _help("the node service: seconds attaching at start may take", DEFAULT_DEADLINE_S)
    service_lookup_timeout_s: float | None = _help(
        "the node service: seconds a call from SGLang's I/O threads may take (a lookup, a reservation, attaching again); past "
        f"it the service is lost until it answers again (misses). Default: the smaller of {DEFAULT_LOOKUP_DEADLINE_S:g} and "
        "service_timeout_s", None)
    service_uid: int | None = _help(
        "the node service: the uid it runs as, when not this process's (a member of its --allow-group); a socket directory, a "
        "listener or a region of any other uid is refused. Default: this process's uid", None)

    def __post_init__(self) -> None:
        check_number(self, "batch_pages", at_least=1, at_most=MAX_BATCH_PAGES, integer=True)
        check_number(self, "io_threads", at_least=1, at_most=MAX_IO_THREADS, integer=True)
        check_number(self, "cooldown_s", at_least=0)
        check_number(self, "max_cooldown_s", at_least=0)
        for name in ("storage_url", "model_name"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"extra_config {name} must be a string, got {type(value).__name__}")
        if not isinstance(self.salt, str):
            raise ConfigError(f"extra_config salt must be a string, got {type(self.salt).__name__}")
        self._check_service()

    def _check_service(self) -> None:
        check_number(self, "service_timeout_s", above=0)
        check_number(self, "service_lookup_timeout_s", above=0)
        check_number(self, "service_uid", at_least=0, at_most=(1 << 32) - 2, integer=True)
        if not isinstance(self.service_required, bool):
            raise ConfigError(f"extra_config service_required must be true or false, got {self.service_required!r}")
        if self.service is None:
            if self.service_required:
                raise ConfigError("extra_config service_required is set without service: name the node service's socket "
                                  f"(service: {UNIX_SCHEME}/path, kvtier serve --socket) or drop service_required")
            return
        if not isinstance(self.service, str) or not self.socket_path:
            raise ConfigError(f"extra_config service must be the node service's socket, {UNIX_SCHEME}/path or the path "
                              f"(kvtier serve --socket); got {self.service!r}")
        if self.storage_url is not None:
            raise ConfigError("extra_config service and storage_url are both set: pages go to the node service or to an L3 "
                              "store, not both; drop one")
        if self.service_lookup_timeout_s is not None and self.service_lookup_timeout_s > self.service_timeout_s:
            raise ConfigError(f"extra_config service_lookup_timeout_s={self.service_lookup_timeout_s:g} is longer than "
                              f"service_timeout_s={self.service_timeout_s:g}; lower it, or raise service_timeout_s")

    @property
    def socket_path(self) -> str | None:
        """The node service's socket path (``service`` without its ``unix://``), or None."""
        if self.service is None:
            return None
        return service_socket_path(self.service, "extra_config service")

    @property
    def url(self) -> str:
        return self.storage_url or default_storage_url()

    @classmethod
    def valid_keys(cls) -> list[str]:
        return sorted(f.name for f in fields(cls))

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> SGLangStorageOptions:
        if extra is None:
            extra = {}
        if not isinstance(extra, dict):
            raise ConfigError(f"extra_config must be a JSON object, got {type(extra).__name__}")
        ours = {k: v for k, v in extra.items() if k not in SGLANG_KEYS and k != SGLANG_FILE_PATH_KEY}
        unknown = sorted(set(ours) - set(cls.valid_keys()))
        if unknown:
            raise ConfigError(
                f"kvtier SGLang storage: unknown extra_config key(s) {', '.join(unknown)}; "
                f"valid: {', '.join(cls.valid_keys())} (and SGLang's own: {', '.join((*SGLANG_KEYS, SGLANG_FILE_PATH_KEY))})"
            )
        path = extra.get(SGLANG_FILE_PATH_KEY)
        if ours.get("service") is not None:
            if not extra.get("interface_v1"):
                raise ConfigError("kvtier SGLang storage: extra_config service needs SGLang's zero-copy page path; add "
                                  '"interface_v1": 1 (kvtier.integrations.sglang.extra_config does)')
        elif path is not None:
            if not isinstance(path, str) or not path:
                raise ConfigError(f"extra_config {SGLANG_FILE_PATH_KEY} must be a directory path, got {path!r}")
            ours.setdefault("storage_url", f"file://{os.path.abspath(path)}")  # an explicit storage_url wins
        return cls(**ours)
