"""Storage URLs: parsing, redaction, and the scheme -> backend table.

Backends are imported only when their scheme is used, so the Redis and Mooncake
clients are needed only by those who choose them. An unknown scheme is an error
listing the supported ones.
"""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import urlparse

from kvtier.errors import StorageError, UnknownNameError
from kvtier.l3.base import StorageBackend, StorageURL, redact_url


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
