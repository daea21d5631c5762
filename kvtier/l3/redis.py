"""``redis://`` backend: Redis or Valkey, single node or Redis Cluster, over redis-py.

Every batch is one pipelined round trip (non-transactional; in cluster mode
redis-py splits it by slot). Values are sent from the caller's memoryview
without copying; reads copy the reply into the caller's buffer (redis-py
returns bytes). Every call has a socket timeout; after a fault the client
reconnects on the next call, so a restarted server resumes the tier.

URLs::

    redis://[:password@]host:port/db?timeout=2        plain TCP
    rediss://host:port/0?ssl_ca_certs=/path/ca.pem     TLS
    redis+cluster://host:port?timeout=2                Redis Cluster (any node as seed)
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.errors import StorageError
from kvtier.l3.base import BackendStats, KeyStatus, StorageURL, map_storage_errors, scatter_into


class RedisBackend:
    name = "redis"

    def __init__(self, client, *, cluster: bool = False):
        self.client = client
        self.cluster = cluster
        self.stats = BackendStats()

    @classmethod
    def from_url(cls, u: StorageURL) -> RedisBackend:
        try:
            import redis
            from redis.cluster import RedisCluster
        except ImportError:
            raise StorageError("the redis backend needs redis-py: pip install 'kvtier[redis]'") from None
        from redis.backoff import ConstantBackoff
        from redis.retry import Retry

        timeout = float(u.query.get("timeout", 2.0))
        # one quick retry, not redis-py's default exponential backoff (seconds per failed call):
        # a dead store must turn into fast misses, the tier's circuit breaker does the rest
        retry = Retry(ConstantBackoff(0.01), int(u.query.get("retries", 1)))
        common = dict(socket_timeout=timeout, socket_connect_timeout=timeout, retry=retry)
        from urllib.parse import urlparse

        parsed = urlparse(u.url)
        if parsed.password:
            common["password"] = parsed.password
        if parsed.username:
            common["username"] = parsed.username
        if u.scheme == "rediss" or u.query.get("ssl") == "1":
            common["ssl"] = True
            if "ssl_ca_certs" in u.query:
                common["ssl_ca_certs"] = u.query["ssl_ca_certs"]
        if u.scheme == "redis+cluster":
            client = RedisCluster(host=u.host or "127.0.0.1", port=u.port or 6379, **common)
            return cls(client, cluster=True)
        db = int(u.path.strip("/") or 0)
        return cls(redis.Redis(host=u.host or "127.0.0.1", port=u.port or 6379, db=db, **common))

    def _pipeline(self):
        return self.client.pipeline(transaction=False) if not self.cluster else self.client.pipeline()

    def exists(self, keys: Sequence[str]) -> int:
        found = [0]

        def failed(_e: BaseException) -> None:
            found[0] = 0

        with map_storage_errors(self.stats, "redis exists", failed):
            pipe = self._pipeline()
            for k in keys:
                pipe.exists(k)
            n = 0
            for present in pipe.execute():
                if not present:
                    break
                n += 1
            found[0] = n
        return found[0]

    def get(self, keys: Sequence[str], outs: Sequence[memoryview]) -> list[KeyStatus]:
        return self.get_scattered(keys, [(o,) for o in outs])

    def get_scattered(self, keys: Sequence[str], outs: Sequence[Sequence[memoryview]]) -> list[KeyStatus]:
        """Like :meth:`get`, each value copied once, straight into its list of buffers."""
        statuses = [KeyStatus.ERROR] * len(keys)

        def failed(_e: BaseException) -> None:
            pass

        self.stats.gets += len(keys)
        with map_storage_errors(self.stats, "redis get", failed):
            pipe = self._pipeline()
            for k in keys:
                pipe.get(k)
            for i, (value, parts) in enumerate(zip(pipe.execute(), outs)):
                if value is None:
                    statuses[i] = KeyStatus.MISS
                elif scatter_into(value, parts):
                    statuses[i] = KeyStatus.OK
                    self.stats.get_hits += 1
                    self.stats.bytes_read += len(value)
        return statuses

    def set(self, keys: Sequence[str], values: Sequence[memoryview]) -> list[KeyStatus]:
        statuses = [KeyStatus.ERROR] * len(keys)

        def failed(_e: BaseException) -> None:
            pass

        self.stats.sets += len(keys)
        with map_storage_errors(self.stats, "redis set", failed):
            pipe = self._pipeline()
            for k, v in zip(keys, values):
                pipe.set(k, v)
            for i, ok in enumerate(pipe.execute()):
                statuses[i] = KeyStatus.OK if ok else KeyStatus.ERROR
            self.stats.bytes_written += sum(len(v) for v in values)
        return statuses

    def delete(self, keys: Sequence[str]) -> None:
        with map_storage_errors(self.stats, "redis delete", lambda _e: None):
            pipe = self._pipeline()
            for k in keys:
                pipe.delete(k)
            pipe.execute()

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:
            pass
