"""``redis://`` backend: Redis or Valkey, single node or Redis Cluster, over redis-py.

Every batch is one pipelined round trip (non-transactional; in cluster mode
redis-py splits it by slot). Values are sent from the caller's memoryview
without copying. On a single node, reads skip redis-py's reply parser: the
pipelined GETs go out on one of its pooled connections and each bulk reply is
received straight into the caller's buffers (:class:`_BulkReader`), with no
``bytes`` object and no copy -- redis-py parses a 5 MB value in 64 KB feeds and
then returns a copy. Cluster mode reads through redis-py and copies once.
Every call has a socket timeout; after a fault the connection is dropped and
the next call reconnects, so a restarted server resumes the tier.

URLs::

    redis://[:password@]host:port/db?timeout=2        plain TCP
    rediss://host:port/0?ssl_ca_certs=/path/ca.pem     TLS
    redis+cluster://host:port?timeout=2                Redis Cluster (any node as seed)
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager

from kvtier.errors import StorageError
from kvtier.l3.base import BackendStats, KeyStatus, StorageURL, map_storage_errors, scatter_into


class _BulkReader:
    """Reads RESP replies to GET from a socket, each value straight into the caller's buffers.

    Only what the reply header promises is received into a buffer, so the stream
    never runs ahead into the next reply's bytes."""

    def __init__(self, sock):
        self.sock = sock
        self.buf = bytearray()
        self.scratch = memoryview(bytearray(1 << 16))

    def _fill(self) -> None:
        n = self.sock.recv_into(self.scratch)
        if n == 0:
            raise ConnectionError("redis closed the connection mid-reply")
        self.buf += self.scratch[:n]

    def line(self) -> bytes:
        while (end := self.buf.find(b"\r\n")) < 0:
            self._fill()
        out = bytes(self.buf[:end])
        del self.buf[: end + 2]
        return out

    def read_into(self, parts: Sequence[memoryview]) -> None:
        """Exactly ``sum(len(parts))`` bytes of payload, in order, then the reply's trailing CRLF."""
        for part in parts:
            have = min(len(self.buf), len(part))
            part[:have] = self.buf[:have]
            del self.buf[:have]
            off = have
            while off < len(part):
                n = self.sock.recv_into(part[off:])
                if n == 0:
                    raise ConnectionError("redis closed the connection mid-reply")
                off += n
        if self.line() != b"":
            raise ConnectionError("redis reply framing lost after a bulk value")

    def skip(self, n: int) -> None:
        while len(self.buf) < n:
            self._fill()
        del self.buf[:n]

    def get_into(self, parts: Sequence[memoryview]) -> KeyStatus:
        """One GET reply: OK (value in ``parts``), MISS (nil), or ERROR (error reply, wrong size)."""
        head = self.line()
        kind = head[:1]
        if kind == b"$":
            size = int(head[1:])
            if size < 0:
                return KeyStatus.MISS
            if size != sum(len(p) for p in parts):
                self.skip(size + 2)  # keep the stream in step; the value is not ours to use
                return KeyStatus.ERROR
            self.read_into(parts)
            return KeyStatus.OK
        if kind == b"_":  # RESP3 null
            return KeyStatus.MISS
        if kind == b"-":  # error reply (e.g. WRONGTYPE)
            return KeyStatus.ERROR
        raise ConnectionError(f"unexpected redis reply to GET: {head[:40]!r}")


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
        """Like :meth:`get`, each value landing in its list of buffers: received there directly (one node) or copied once (cluster)."""
        statuses = [KeyStatus.ERROR] * len(keys)

        def failed(_e: BaseException) -> None:
            pass

        self.stats.gets += len(keys)
        if not self.cluster:
            with map_storage_errors(self.stats, "redis get", failed):
                statuses = self._get_direct(keys, outs)
            return statuses
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

    @contextmanager
    def _direct(self, pack):
        """Send ``pack(connection)`` on a pooled connection and yield a reader of its replies.

        The caller reads every reply inside the block; on any error the connection is
        dropped, since a half-read reply must never meet the next command."""
        pool = self.client.connection_pool
        conn = pool.get_connection()
        try:
            conn.send_packed_command(pack(conn))
            yield _BulkReader(conn._sock)
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)

    def _get_direct(self, keys: Sequence[str], outs: Sequence[Sequence[memoryview]]) -> list[KeyStatus]:
        with self._direct(lambda conn: conn.pack_commands([("GET", k) for k in keys])) as reader:
            statuses = [reader.get_into(parts) for parts in outs]
        for st, parts in zip(statuses, outs):
            if st is KeyStatus.OK:
                self.stats.get_hits += 1
                self.stats.bytes_read += sum(len(p) for p in parts)
        return statuses

    def set_scattered(self, keys: Sequence[str], parts: Sequence[Sequence[memoryview]]) -> list[KeyStatus]:
        """Store each object given as buffers back to back; on one node they are sent as they are."""
        if self.cluster:
            return self.set(keys, [memoryview(b"".join(p)) for p in parts])
        statuses = [KeyStatus.ERROR] * len(keys)
        self.stats.sets += len(keys)
        with map_storage_errors(self.stats, "redis set", lambda _e: None):
            statuses = self._set_direct(keys, parts)
        return statuses

    def _set_direct(self, keys: Sequence[str], parts: Sequence[Sequence[memoryview]]) -> list[KeyStatus]:
        chunks: list = []
        for k, ps in zip(keys, parts):
            kb = k.encode()
            chunks.append(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(kb), kb, sum(len(p) for p in ps)))
            chunks.extend(ps)
            chunks.append(b"\r\n")
        with self._direct(lambda _conn: chunks) as reader:  # framed here: redis-py would copy each value
            replies = [reader.line() for _ in keys]
            for reply in replies:
                if reply[:1] not in (b"+", b"-"):
                    raise ConnectionError(f"unexpected redis reply to SET: {reply[:40]!r}")
        self.stats.bytes_written += sum(len(p) for ps, r in zip(parts, replies) if r == b"+OK" for p in ps)
        return [KeyStatus.OK if r == b"+OK" else KeyStatus.ERROR for r in replies]

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
