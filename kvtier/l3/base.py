"""The L3 backend interface and the URL registry.

Contract of a :class:`StorageBackend` (every method is batched):

* keys are ``str`` (``namespace/page-hash-hex``); values are whole page objects
  of one size per namespace (see :mod:`kvtier.l3.page`).
* ``exists(keys)`` -> number of leading keys present (the longest stored prefix).
* ``get(keys, outs)`` reads each value into the caller's buffer ``outs[i]``
  (a writable memoryview of exactly the object size; zero-copy where the
  backend allows) and returns a :class:`KeyStatus` per key: ``OK`` (the value
  is in the buffer), ``MISS`` (no such key), ``WRONG_SIZE`` (the key holds a
  value, but not one of the buffer's size: truncated, extended or empty; the
  buffer holds no meaning), ``ERROR`` (the store failed for the key). A value
  of the wrong size is never a store fault: the reader deletes it like an
  object that fails its check (:mod:`kvtier.l3.mover`), so its key heals.
* ``set(keys, values)`` stores each value (a readable memoryview) and returns
  a status per key; a value must never be visible half-written.
* ``delete(keys)`` removes keys (missing ones are fine).
* ``delete_namespace(namespace)`` removes every key ``namespace/...`` and
  returns how many went (an operator's "clear this model's pages"; other
  namespaces in the same store are untouched).
* Misses and per-key failures are results, never exceptions; an exception
  escapes only for a broken configuration. Client exceptions are mapped to
  results in one place (:func:`map_storage_errors`).
* Every network call has a deadline for the whole call. ``close()`` releases
  connections and child processes.
* What a backend can do beyond that is declared, not probed: its
  :class:`Capabilities` (``backend.capabilities``). With ``scattered``, it has
  ``get_scattered`` / ``set_scattered`` (each object read into, or written from,
  several buffers back to back: header, then each buffer of a host page), and the
  tier may run several such calls at once, one per I/O thread, so they must be
  thread-safe. With ``registers_buffers``, memory must be registered with
  ``register_buffer(memoryview)`` before those calls move it without a copy.
  With ``nodes`` (a Redis Cluster), keys live on nodes that fail apart:
  ``node_of(key)`` names the node serving a key, a fault is counted against
  the nodes it came from (``stats.node_errors``; :data:`STORE` for one no node
  owns), and ``probe_node(name)`` says whether that node answers (see
  :mod:`kvtier.l3.breaker`).

URLs are parsed and dispatched to backends in :mod:`kvtier.l3.registry`; this
module imports no backend.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol
from urllib.parse import urlparse

from kvtier.errors import StorageError

log = logging.getLogger(__name__)


#: the node name of a store's own faults: a store without nodes is this one node
STORE = "store"


class KeyStatus(str, Enum):
    OK = "ok"
    MISS = "miss"
    ERROR = "error"
    #: ``get``: present, but not an object of the size asked for (see the module docstring)
    WRONG_SIZE = "wrong_size"


@dataclass
class BackendStats:
    gets: int = 0
    get_hits: int = 0
    sets: int = 0
    errors: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    last_error: str = ""
    #: faults per node, for a store with several (``Capabilities.nodes``); ``errors`` counts them all
    node_errors: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Capabilities:
    """What a backend offers beyond the batched get/set/exists/delete contract."""

    #: ``get_scattered`` / ``set_scattered``: page objects straight to and from host pages (no staging copy)
    scattered: bool = False
    #: ``register_buffer(memoryview)``: memory is registered before scattered calls move it (Mooncake)
    registers_buffers: bool = False
    #: bytes per scattered call the backend moves best (None: the tier's ``batch_pages``)
    batch_bytes: int | None = None
    #: the tier's I/O threads when ``StorageConfig.io_threads`` is unset
    io_threads: int = 2
    #: keys live on nodes that fail apart: ``node_of(key)``, ``probe_node(name)``, faults per node in ``stats.node_errors``
    nodes: bool = False


class StorageBackend(Protocol):
    name: str
    stats: BackendStats
    capabilities: Capabilities

    def exists(self, keys: Sequence[str]) -> int: ...
    def get(self, keys: Sequence[str], outs: Sequence[memoryview]) -> list[KeyStatus]: ...
    def set(self, keys: Sequence[str], values: Sequence[memoryview]) -> list[KeyStatus]: ...
    def delete(self, keys: Sequence[str]) -> None: ...
    def delete_namespace(self, namespace: str) -> int: ...
    def close(self) -> None: ...


@contextmanager
def map_storage_errors(stats: BackendStats, what: str, on_error: Callable[[BaseException], None], nodes: Sequence[str] = ()):
    """The one place backend client exceptions become per-call failures (logged, counted; against
    ``nodes`` too, the nodes the call went to, for a store with several)."""
    try:
        yield
    except Exception as e:  # OSError, TimeoutError and each client's own hierarchy (redis.RedisError, ...)
        count_fault(stats, what, e, nodes)
        on_error(e)


def count_fault(stats: BackendStats, what: str, e: BaseException, nodes: Sequence[str] = ()) -> None:
    """Count, log and remember a fault (a backend that handles the exception itself calls this)."""
    for name in nodes:  # before ``errors``: a breaker that sees ``errors`` move finds the node's count moved too
        stats.node_errors[name] = stats.node_errors.get(name, 0) + 1
    stats.errors += 1
    stats.last_error = f"{what}: {type(e).__name__}: {e}"
    log.warning("L3 %s failed: %s", what, e)


@dataclass(frozen=True)
class StorageURL:
    scheme: str
    url: str
    host: str | None
    port: int | None
    path: str
    query: dict[str, str] = field(default_factory=dict)


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


def positive_option(query: Mapping[str, str], name: str, store: str, example: str, scale: float = 1) -> float:
    """URL option ``name`` times ``scale`` (e.g. GiB to bytes): a finite number > 0, or a :class:`StorageError` naming the
    option and an ``example``."""
    try:
        value = float(query[name]) * scale
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise StorageError(f"{store} URL option {name}={query[name]!r} must be a number > 0 (e.g. {example})")
    return value
