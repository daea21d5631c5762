"""The L3 backend interface and the URL registry.

Contract of a :class:`StorageBackend` (every method is batched):

* keys are ``str`` (``namespace/page-hash-hex``); values are whole page objects
  of one size per namespace (see :mod:`kvtier.l3.page`).
* ``exists(keys)`` -> number of leading keys present (the longest stored prefix).
* ``get(keys, outs)`` reads each value into the caller's buffer ``outs[i]``
  (a writable memoryview of exactly the object size; zero-copy where the
  backend allows) and returns a :class:`KeyStatus` per key.
* ``set(keys, values)`` stores each value (a readable memoryview) and returns
  a status per key; a value must never be visible half-written.
* ``delete(keys)`` removes keys (missing ones are fine).
* Misses and per-key failures are results, never exceptions; an exception
  escapes only for a broken configuration. Client exceptions are mapped to
  results in one place (:func:`map_storage_errors`).
* Every network call has a timeout. Methods are called from one storage worker
  thread at a time; ``close()`` releases connections and child processes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol
from urllib.parse import urlparse

from kvtier.errors import StorageError, UnknownNameError

log = logging.getLogger(__name__)


class KeyStatus(str, Enum):
    OK = "ok"
    MISS = "miss"
    ERROR = "error"


@dataclass
class BackendStats:
    gets: int = 0
    get_hits: int = 0
    sets: int = 0
    errors: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    last_error: str = ""


class StorageBackend(Protocol):
    name: str
    stats: BackendStats

    def exists(self, keys: Sequence[str]) -> int: ...
    def get(self, keys: Sequence[str], outs: Sequence[memoryview]) -> list[KeyStatus]: ...
    # Optional: ``get_scattered(keys, outs: Sequence[Sequence[memoryview]])`` reads each object
    # into several buffers in order (header, then each buffer of a host page), so the tier
    # can skip its staging copy. Backends without it are read through staging.
    # Optional: ``set_scattered(keys, parts: Sequence[Sequence[memoryview]])`` stores each object
    # given as buffers back to back (header, then a host page's buffers): no staging copy.
    # Optional: ``preferred_batch_bytes`` (int), bytes per scattered call (default: the tier's
    # ``batch_pages``), and ``preferred_io_threads`` (int), the tier's I/O threads when
    # ``StorageConfig.io_threads`` is unset (default 2). The tier may run several calls at
    # once, one per I/O thread, so both scattered methods must be thread-safe.
    def set(self, keys: Sequence[str], values: Sequence[memoryview]) -> list[KeyStatus]: ...
    def delete(self, keys: Sequence[str]) -> None: ...
    def close(self) -> None: ...


@contextmanager
def map_storage_errors(stats: BackendStats, what: str, on_error: Callable[[BaseException], None]):
    """The one place backend client exceptions become per-call failures (logged, counted)."""
    try:
        yield
    except Exception as e:  # OSError, TimeoutError and each client's own hierarchy (redis.RedisError, ...)
        stats.errors += 1
        stats.last_error = f"{what}: {type(e).__name__}: {e}"
        log.warning("L3 %s failed: %s", what, e)
        on_error(e)


@dataclass(frozen=True)
class StorageURL:
    scheme: str
    url: str
    host: str | None
    port: int | None
    path: str
    query: dict[str, str] = field(default_factory=dict)


def redact_url(url: str | None) -> str | None:
    """``url`` with any password replaced by ``***``: the form for reports, logs and errors."""
    if not url or "@" not in url:
        return url
    try:
        u = urlparse(url)
    except ValueError:
        return "<unparseable storage URL>"
    if u.password is None:
        return url
    user = u.username or ""
    host = u.netloc.rsplit("@", 1)[1]
    return u._replace(netloc=f"{user}:***@{host}").geturl()


def parse_url(url: str) -> StorageURL:
    shown = redact_url(url)
    try:
        u = urlparse(url)
        port = u.port
    except ValueError as e:
        raise StorageError(f"storage URL {shown!r} is malformed ({e}); e.g. redis://127.0.0.1:6379/0") from None
    if not u.scheme:
        raise StorageError(f"storage URL {shown!r} has no scheme; use one of {', '.join(sorted(_OPENERS))} (e.g. file:///var/cache/kvtier)")
    query = dict(p.split("=", 1) if "=" in p else (p, "1") for p in u.query.split("&") if p)
    return StorageURL(u.scheme, url, u.hostname, port, u.path, query)


def query_number(u: StorageURL, name: str, default: float, *, integer: bool = False, minimum: float = 0.0) -> float:
    """A numeric URL option (``?timeout=2``), or a :class:`StorageError` naming it and the fix."""
    raw = u.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        value = None
    if value is None or value != value or value in (float("inf"), float("-inf")) or value < minimum:
        kind = "an integer" if integer else "a number"
        raise StorageError(f"storage URL option {name}={raw!r} must be {kind} >= {minimum:g} (in {redact_url(u.url)!r})")
    return value


def _open_file(u: StorageURL) -> StorageBackend:
    from kvtier.l3.file import FileBackend

    return FileBackend.from_url(u)


def _open_memory(u: StorageURL) -> StorageBackend:
    from kvtier.l3.memory import MemoryBackend

    return MemoryBackend.from_url(u)


def _open_redis(u: StorageURL) -> StorageBackend:
    from kvtier.l3.redis import RedisBackend

    return RedisBackend.from_url(u)


def _open_mooncake(u: StorageURL) -> StorageBackend:
    from kvtier.l3.mooncake import MooncakeBackend

    return MooncakeBackend.from_url(u)


#: scheme -> opener; heavy clients are imported only when their scheme is used.
_OPENERS: dict[str, Callable[[StorageURL], StorageBackend]] = {
    "file": _open_file,
    "memory": _open_memory,
    "redis": _open_redis,
    "rediss": _open_redis,
    "redis+cluster": _open_redis,
    "mooncake": _open_mooncake,
}


def open_backend(url: str) -> StorageBackend:
    u = parse_url(url)
    try:
        opener = _OPENERS[u.scheme]
    except KeyError:
        raise UnknownNameError("storage scheme", u.scheme, _OPENERS) from None
    return opener(u)


def scatter_into(value, parts: Sequence[memoryview]) -> bool:
    """Copy ``value`` into ``parts`` back to back; False (nothing meaningful written) when sizes differ."""
    if len(value) != sum(len(p) for p in parts):
        return False
    src = memoryview(value)
    off = 0
    for p in parts:
        p[:] = src[off : off + len(p)]
        off += len(p)
    return True
