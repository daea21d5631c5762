"""``redis://`` backend: Redis or Valkey, single node or Redis Cluster, over redis-py.

Every batch is one pipelined round trip (non-transactional), per node in
cluster mode. Values are sent from the caller's memoryview
without copying. Reads skip redis-py's reply parser: the pipelined GETs go out
on one of its pooled connections and each bulk reply is received straight into
the caller's buffers (:class:`_BulkReader`), with no ``bytes`` object and no
copy -- redis-py parses a 5 MB value in 64 KB feeds and then returns a copy.
SETs are framed here and sent from the caller's buffers. In cluster mode the
keys are grouped by the node redis-py's slot map names, each group going the
same direct way on that node's pool; keys a node redirects (MOVED, ASK,
TRYAGAIN, CLUSTERDOWN) and groups whose node fails at once (refused, reset) are
retried through redis-py's cluster pipeline, which follows the redirect,
refreshes the slot map and reports a node that is really gone. A node that
takes its whole deadline (stalled) fails its keys there and then: a retry would
wait as long again. Faults are counted per node (``stats.node_errors``), so the
circuit breaker (:mod:`kvtier.l3.breaker`) marks only that node down and
probes it (:meth:`RedisBackend.probe_node`).

Each direct call and each such pipeline runs under one deadline of the URL's
``timeout`` (a pipeline on a helper thread, abandoned at its deadline); a lookup
(``exists``, which the engine's thread waits on) under the shorter
``lookup_timeout``. After a fault the connection is dropped and the next call
reconnects, so a restarted server resumes the tier.

URLs::

    redis://[:password@]host:port/db?timeout=2        plain TCP
    rediss://host:port/0?ssl_ca_certs=/path/ca.pem     TLS
    redis+cluster://host:port?timeout=2                Redis Cluster (any node as seed)

    timeout=2           seconds each whole call may take (a read or write of a batch)
    lookup_timeout=0.25 seconds a lookup may take (default: the smaller of 0.25 and ``timeout``)
    tenant_ttl_s=3600   a tenant's objects (by the owner tag in their header, :mod:`kvtier.l3.page`) are
                        SET with this expiry, and each read moves it on (``PEXPIRE ... XX``, in the
                        GET's round trip: only keys that have an expiry, so never the namespace's or a
                        shared prefix's): Redis deletes what no tenant used for that long. Redis before
                        7.0 refuses ``XX``, and a tenant's object then lives that long from its write.
                        Redis evicts by its own ``maxmemory-policy``: a tenant's share or cap needs a
                        store kvtier evicts itself (file://), and this URL refuses them.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager

from kvtier.errors import StorageError
from kvtier.l3.base import (
    STORE,
    BackendStats,
    Capabilities,
    KeyStatus,
    StorageURL,
    count_fault,
    map_storage_errors,
    query_number,
    redact_url,
    scatter_into,
)
from kvtier.l3.page import tag_of_parts
from kvtier.l3.tenant_bounds import is_tenant, refuse_unkept

log = logging.getLogger(__name__)


#: a lookup's deadline unless the URL says (``lookup_timeout``): the engine's thread waits on lookups,
#: and a node that has not answered EXISTS in this long is better treated as down (a miss)
DEFAULT_LOOKUP_TIMEOUT_S = 0.25

#: error replies by which a cluster node says "not here" or "not now"; redis-py's cluster client
#: knows what to do with each (follow, refresh its slot map, retry)
_REDIRECTS = (b"-MOVED ", b"-ASK ", b"-TRYAGAIN", b"-CLUSTERDOWN")


def _key_commands(cmd: bytes, keys: Sequence[str]) -> list[bytes]:
    """``cmd key`` for each key, framed in RESP and joined: one send for the whole batch."""
    return [b"".join(b"*2\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (len(cmd), cmd, len(kb), kb) for kb in (k.encode() for k in keys))]


def _get_and_refresh(key: str, ttl_ms: int) -> bytes:
    """``GET key`` then ``PEXPIRE key ttl_ms XX``, framed in RESP."""
    kb, tb = key.encode(), b"%d" % ttl_ms
    return (b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n*4\r\n$7\r\nPEXPIRE\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n$2\r\nXX\r\n"
            % (len(kb), kb, len(kb), kb, len(tb), tb))


def _settimeout_left(sock, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("redis call passed its deadline (the URL's timeout bounds each whole call)")
    sock.settimeout(left)


class _BulkReader:
    """Reads RESP replies to GET from a socket, each value straight into the caller's buffers.

    Only what the reply header promises is received into a buffer, so the stream
    never runs ahead into the next reply's bytes."""

    def __init__(self, sock, deadline: float):
        self.sock = sock
        self.deadline = deadline
        self.buf = bytearray()
        self.scratch = memoryview(bytearray(1 << 16))

    def _recv_into(self, out: memoryview) -> int:
        """One receive, bounded by what is left of the call's deadline (not a fresh timeout each time:
        a server that drips a byte at a time must still fail the call on time)."""
        _settimeout_left(self.sock, self.deadline)
        return self.sock.recv_into(out)

    def _fill(self) -> None:
        n = self._recv_into(self.scratch)
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
                n = self._recv_into(part[off:])
                if n == 0:
                    raise ConnectionError("redis closed the connection mid-reply")
                off += n
        if self.line() != b"":
            raise ConnectionError("redis reply framing lost after a bulk value")

    def skip(self, n: int) -> None:
        while len(self.buf) < n:
            self._fill()
        del self.buf[:n]

    def get_into(self, parts: Sequence[memoryview]) -> KeyStatus | None:
        """One GET reply: OK (value in ``parts``), MISS (nil), WRONG_SIZE (a value of another size: skipped),
        ERROR (error reply), or None when a cluster node redirects the key (another node, or not now, must serve it)."""
        head = self.line()
        kind = head[:1]
        if kind == b"$":
            size = int(head[1:])
            if size < 0:
                return KeyStatus.MISS
            if size != sum(len(p) for p in parts):
                self.skip(size + 2)  # keep the stream in step; the value is not ours to use
                return KeyStatus.WRONG_SIZE
            self.read_into(parts)
            return KeyStatus.OK
        if kind == b"_":  # RESP3 null
            return KeyStatus.MISS
        if kind == b"-":  # error reply (e.g. WRONGTYPE), or a cluster redirect
            return None if head.startswith(_REDIRECTS) else KeyStatus.ERROR
        raise ConnectionError(f"unexpected redis reply to GET: {head[:40]!r}")

    def integer(self) -> int | None:
        """One integer reply (EXISTS, DEL); None for a cluster redirect."""
        head = self.line()
        if head[:1] == b":":
            return int(head[1:])
        if head.startswith(_REDIRECTS):
            return None
        raise ConnectionError(f"unexpected redis reply: {head[:40]!r}")


class RedisBackend:
    name = "redis"

    def __init__(self, client, *, cluster: bool = False, timeout: float = 2.0, lookup_timeout: float | None = None,
                 tenant_ttl_s: float | None = None):
        self.client = client
        #: a tenant's objects expire this long after their last write or read (None: never); see the module docstring
        self.tenant_ttl_ms = None if tenant_ttl_s is None else max(1, round(tenant_ttl_s * 1000))
        self._told_no_refresh = False
        self._told_refused_set = False
        self.cluster = cluster
        #: seconds each whole call may take (connect, send and every reply): not per receive
        self.timeout = timeout
        #: the same for a lookup (``exists``) and a probe: the engine's thread waits on lookups
        self.lookup_timeout = min(timeout, DEFAULT_LOOKUP_TIMEOUT_S) if lookup_timeout is None else lookup_timeout
        self.stats = BackendStats()
        #: I/O threads: a single node runs one command at a time, so a second connection only takes
        #: turns with the first and, on a shared host, competes with it for CPU (loopback, 2 cores,
        #: 96 pages of 1.25 MB: gets 1.55 GB/s median on one thread vs 1.03 on two, puts 1.19 vs
        #: 1.23). A cluster's calls spread over its nodes. Batches: the tier's ``batch_pages``.
        self.capabilities = Capabilities(scattered=True, io_threads=2 if cluster else 1, nodes=cluster)
        #: (re)connects run here, so a call can stop waiting for one at its deadline
        self._connector = ThreadPoolExecutor(2, thread_name_prefix="kvtier-redis-connect")
        #: redis-py cluster pipelines (redirects, failed nodes) run here, for the same reason
        self._pipelines = ThreadPoolExecutor(2, thread_name_prefix="kvtier-redis-cluster")
        #: node probes run here: one that outlives its deadline holds up only the next probe
        self._probes = ThreadPoolExecutor(1, thread_name_prefix="kvtier-redis-probe")

    @classmethod
    def from_url(cls, u: StorageURL) -> RedisBackend:
        try:
            import redis
            from redis.cluster import RedisCluster
        except ImportError:
            raise StorageError("the redis backend needs redis-py: pip install 'kvtier[redis]'") from None
        from redis.backoff import ConstantBackoff
        from redis.retry import Retry

        tenant_ttl_s = refuse_unkept(u.query, "redis", keeps=("ttl_s",)).ttl_s
        timeout = query_number(u, "timeout", 2.0, minimum=0.001)
        lookup_timeout = query_number(u, "lookup_timeout", min(timeout, DEFAULT_LOOKUP_TIMEOUT_S), minimum=0.001)
        # one quick retry, not redis-py's default exponential backoff (seconds per failed call):
        # a dead store must turn into fast misses, the tier's circuit breaker does the rest
        retry = Retry(ConstantBackoff(0.01), int(query_number(u, "retries", 1, integer=True)))
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
        host, port = u.host or "127.0.0.1", u.port or 6379
        try:
            if u.scheme == "redis+cluster":
                backend = cls(RedisCluster(host=host, port=port, **common), cluster=True, timeout=timeout, lookup_timeout=lookup_timeout,
                              tenant_ttl_s=tenant_ttl_s)
            else:
                db_text = u.path.strip("/") or "0"
                if not db_text.isdigit():
                    raise StorageError(f"redis URL {redact_url(u.url)!r}: the database must be a number (redis://host:6379/0), "
                                       f"got {db_text!r}")
                backend = cls(redis.Redis(host=host, port=port, db=int(db_text), **common), timeout=timeout, lookup_timeout=lookup_timeout,
                              tenant_ttl_s=tenant_ttl_s)
            backend.client.ping()  # at start-up: a wrong password or a dead server is an error now, not silent misses
        except redis.AuthenticationError:
            if "password" not in common:
                raise StorageError(f"redis at {host}:{port} needs a password: redis://:PASSWORD@{host}:{port}/0") from None
            raise StorageError(
                f"redis at {host}:{port} refused the credentials in the storage URL (wrong password or user); fix the URL's user:password"
            ) from None
        except redis.ResponseError as e:
            if "NOAUTH" in str(e) or "WRONGPASS" in str(e):
                raise StorageError(f"redis at {host}:{port} needs a password: redis://:PASSWORD@{host}:{port}/0") from None
            raise StorageError(f"redis at {host}:{port} rejected the connection: {e}") from None
        except (redis.RedisError, OSError) as e:
            raise StorageError(f"cannot reach redis at {host}:{port} ({type(e).__name__}: {e}); start it or fix the storage URL") from None
        return backend

    def _cluster_pipeline(self, queue: Callable[[object], object], timeout: float | None = None, raise_on_error: bool = True) -> list:
        """The replies of a redis-py cluster pipeline that ``queue(pipe)`` filled, within ``timeout``
        (None: the URL's).

        redis-py follows redirects and retries a failed node with a timeout per receive, so left
        to itself a stalled node holds the call for several timeouts, refreshing its slot map in
        between. The pipeline runs on a helper thread and this call stops waiting at its
        deadline; replies that come later are dropped, never applied (a late GET never writes
        into buffers the caller has moved on from). Cluster mode only: a single node has no
        redirects and its failures are errors."""
        pipe = self.client.pipeline()
        queue(pipe)
        future = self._pipelines.submit(pipe.execute, raise_on_error)
        try:
            return future.result(timeout=self.timeout if timeout is None else timeout)
        except FutureTimeout:
            raise TimeoutError(
                "redis cluster call passed its deadline (a node stalled or kept redirecting); the URL's timeout bounds each whole call"
            ) from None

    def exists(self, keys: Sequence[str]) -> int:
        """Leading keys present: EXISTS pipelined on the node's connection under the lookup deadline."""
        if not keys:
            return 0

        def via_client(ks: Sequence[str], _b) -> list[KeyStatus]:
            replies = self._cluster_pipeline(lambda pipe: [pipe.exists(k) for k in ks], self.lookup_timeout)
            return [KeyStatus.OK if present else KeyStatus.MISS for present in replies]

        statuses = self._by_node(keys, [None] * len(keys), "exists", self._exists_direct, via_client)
        n = 0
        for st in statuses:
            if st is not KeyStatus.OK:
                break
            n += 1
        return n

    def _exists_direct(self, pool, keys: Sequence[str], _bufs) -> list[KeyStatus | None]:
        with self._direct(pool, _key_commands(b"EXISTS", keys), self.lookup_timeout) as reader:
            replies = [reader.integer() for _ in keys]
        return [None if r is None else KeyStatus.OK if r else KeyStatus.MISS for r in replies]

    def get(self, keys: Sequence[str], outs: Sequence[memoryview]) -> list[KeyStatus]:
        return self.get_scattered(keys, [(o,) for o in outs])

    def get_scattered(self, keys: Sequence[str], outs: Sequence[Sequence[memoryview]]) -> list[KeyStatus]:
        """Like :meth:`get`, each value received straight into its list of buffers."""
        self.stats.gets += len(keys)
        return self._by_node(keys, outs, "get", self._get_direct, self._get_via_client)

    def set_scattered(self, keys: Sequence[str], parts: Sequence[Sequence[memoryview]]) -> list[KeyStatus]:
        """Store each object given as buffers back to back, sent as they are."""
        self.stats.sets += len(keys)

        def via_client(ks: Sequence[str], ps: Sequence[Sequence[memoryview]]) -> list[KeyStatus]:
            return self._set_via_client(ks, [memoryview(b"".join(p)) for p in ps])  # redirects only: rare

        return self._by_node(keys, parts, "set", self._set_direct, via_client)

    def _by_node(self, keys: Sequence[str], bufs: Sequence, what: str, direct, via_client) -> list[KeyStatus]:
        """Run ``direct(pool, keys, bufs)`` per node's pool. In cluster mode, what a node redirected
        (None) or what failed on a node at once goes through ``via_client`` (redis-py's cluster
        pipeline); a node that took its whole deadline fails its keys now. Faults count per node."""
        statuses = [KeyStatus.ERROR] * len(keys)
        if not self.cluster:
            with map_storage_errors(self.stats, f"redis {what}", lambda _e: None):
                statuses = [KeyStatus.ERROR if st is None else st for st in direct(self.client.connection_pool, keys, bufs)]
            return statuses
        retry: list[int] = []
        retry_nodes: list[str] = []  # whose keys the retry serves: its fault is theirs
        try:
            groups = self._node_groups(keys)
        except Exception:  # no slot map (cluster down, slot uncovered): let redis-py find out
            groups, retry, retry_nodes = [], list(range(len(keys))), [STORE]
        for name, pool, idx in groups:
            try:
                got = direct(pool, [keys[i] for i in idx], [bufs[i] for i in idx])
            except TimeoutError as e:  # stalled: a retry would wait as long again (its probe finds it back)
                count_fault(self.stats, f"redis cluster {what} on {name}", e, (name,))
                continue
            except Exception as e:  # the node failed: redis-py reconnects, refreshes its map, or fails
                log.debug("redis cluster direct %s failed, retrying through redis-py: %s", what, e)
                retry += idx
                retry_nodes.append(name)
                continue
            for i, st in zip(idx, got):
                if st is None:
                    retry.append(i)
                else:
                    statuses[i] = st
            if None in got:
                retry_nodes.append(name)
        if retry:
            with map_storage_errors(self.stats, f"redis cluster {what}", lambda _e: None, retry_nodes):
                for i, st in zip(retry, via_client([keys[i] for i in retry], [bufs[i] for i in retry])):
                    statuses[i] = st
        return statuses

    def _node_groups(self, keys: Sequence[str]) -> list[tuple[str, object, list[int]]]:
        """Key indices grouped by the primary that redis-py's slot map says serves them: its name, its pool, the indices."""
        groups: dict[str, tuple[object, list[int]]] = {}
        for i, k in enumerate(keys):
            node = self.client.get_node_from_key(k)
            groups.setdefault(node.name, (node, []))[1].append(i)
        return [(name, self.client.get_redis_connection(node).connection_pool, idx) for name, (node, idx) in groups.items()]

    def node_of(self, key: str) -> str:
        """The cluster node (``host:port``) that redis-py's slot map names for ``key``; :data:`STORE`
        while there is none (no slot map yet, the slot uncovered: a call finds out, as the store's fault)."""
        try:
            return self.client.get_node_from_key(key).name
        except Exception:
            return STORE

    def probe_node(self, name: str) -> bool:
        """Whether cluster node ``name`` answers a PING within the lookup deadline (the breaker's probe
        of a node marked down). When it does not, redis-py re-reads its slot map, on the probe's
        thread: a cluster that failed the node over then has its slots served by the new primary."""
        node = self.client.get_node(node_name=name)
        if node is None:
            return True  # no longer in the slot map: no key goes to it, nothing waits on it
        future = self._probes.submit(self._ping_or_refresh, node)
        try:
            return future.result(timeout=self.lookup_timeout)
        except Exception as e:
            log.info("redis cluster node %s still down (probe: %s: %s)", name, type(e).__name__, e)
            return False

    def _ping_or_refresh(self, node) -> bool:
        try:
            return bool(self.client.get_redis_connection(node).ping())
        except Exception:
            try:
                self.client.nodes_manager.initialize()
            except Exception as e:  # every node unreachable: the next probe tries again
                log.debug("redis cluster slot map refresh failed: %s", e)
            raise

    def _get_via_client(self, keys: Sequence[str], outs: Sequence[Sequence[memoryview]]) -> list[KeyStatus]:
        """GETs through redis-py's pipeline, each value copied once into its buffers."""
        statuses = [KeyStatus.ERROR] * len(keys)
        ttl = self.tenant_ttl_ms
        if ttl is None:
            values = self._cluster_pipeline(lambda pipe: [pipe.get(k) for k in keys])
        else:  # each GET with its PEXPIRE XX, as on the direct path (a refused XX fails that PEXPIRE alone)
            replies = self._cluster_pipeline(lambda pipe: [c for k in keys for c in (pipe.get(k), pipe.pexpire(k, ttl, xx=True))],
                                             raise_on_error=False)
            values = replies[0::2]
            for value in values:
                if isinstance(value, Exception):
                    raise value  # (what the pipeline raises without raise_on_error)
            for reply in replies[1::2]:
                if isinstance(reply, Exception):
                    self._refreshed(b"-" + str(reply).encode(errors="replace"))
        for i, (value, parts) in enumerate(zip(values, outs)):
            if value is None:
                statuses[i] = KeyStatus.MISS
            elif scatter_into(value, parts):
                statuses[i] = KeyStatus.OK
                self.stats.get_hits += 1
                self.stats.bytes_read += len(value)
            else:
                statuses[i] = KeyStatus.WRONG_SIZE
        return statuses

    @contextmanager
    def _direct(self, pool, chunks: Sequence, timeout: float | None = None):
        """Send ``chunks`` (framed commands) on a connection of ``pool`` and yield a reader of its replies.

        The whole call -- connect, send, every reply -- runs under one deadline of ``timeout``
        seconds (None: the URL's). The caller reads every reply inside the block; on any error the
        connection is dropped, since a half-read reply must never meet the next command."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        conn = self._connection(pool, deadline)
        try:
            sock = conn._sock
            for chunk in chunks:
                _settimeout_left(sock, deadline)
                sock.sendall(chunk)  # the timeout bounds the whole sendall (Python >= 3.5)
            yield _BulkReader(sock, deadline)
            sock.settimeout(conn.socket_timeout)  # as redis-py expects it for the next user
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)

    def _connection(self, pool, deadline: float):
        """A connected connection of ``pool`` by ``deadline``.

        redis-py connects inside ``get_connection`` and its handshake reads with a per-receive
        timeout (and may retry), so a server that drips bytes could hold a reconnect for minutes.
        When the pool has no connected idle connection, the connect runs on a helper thread and
        this call stops waiting at the deadline; a connection that arrives late is dropped."""
        idle = getattr(pool, "_available_connections", None)  # redis-py's pool internals; absent: always guarded
        if idle and idle[-1]._sock is not None:  # the common case: a live connection, no connect
            return pool.get_connection()
        future = self._connector.submit(pool.get_connection)
        try:
            return future.result(timeout=max(deadline - time.monotonic(), 0.0))
        except FutureTimeout:

            def drop(f) -> None:
                if f.exception() is None:
                    conn = f.result()
                    conn.disconnect()
                    pool.release(conn)

            future.add_done_callback(drop)
            raise TimeoutError("redis connect passed the call's deadline") from None

    def _get_direct(self, pool, keys: Sequence[str], outs: Sequence[Sequence[memoryview]]) -> list[KeyStatus | None]:
        ttl = self.tenant_ttl_ms
        if ttl is None:
            with self._direct(pool, _key_commands(b"GET", keys)) as reader:
                statuses = [reader.get_into(parts) for parts in outs]
        else:  # each GET with a PEXPIRE XX: a tenant's object (the keys with an expiry) lives on from this use
            with self._direct(pool, [b"".join(_get_and_refresh(k, ttl) for k in keys)]) as reader:
                statuses = []
                for parts in outs:
                    statuses.append(reader.get_into(parts))
                    self._refreshed(reader.line())
        for st, parts in zip(statuses, outs):
            if st is KeyStatus.OK:
                self.stats.get_hits += 1
                self.stats.bytes_read += sum(len(p) for p in parts)
        return statuses

    def _set_direct(self, pool, keys: Sequence[str], parts: Sequence[Sequence[memoryview]]) -> list[KeyStatus | None]:
        chunks: list = []
        for k, ps in zip(keys, parts):
            kb = k.encode()
            ttl = self._ttl_of(ps)
            chunks.append(b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (3 if ttl is None else 5, len(kb), kb, sum(len(p) for p in ps)))
            chunks.extend(ps)
            chunks.append(b"\r\n" if ttl is None else b"\r\n$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(ttl), ttl))
        with self._direct(pool, chunks) as reader:  # framed here: redis-py would copy each value
            replies = [reader.line() for _ in keys]
            for reply in replies:
                if reply[:1] not in (b"+", b"-"):
                    raise ConnectionError(f"unexpected redis reply to SET: {reply[:40]!r}")
        self.stats.bytes_written += sum(len(p) for ps, r in zip(parts, replies) if r == b"+OK" for p in ps)
        refused = next((r for r in replies if r[:1] == b"-" and not r.startswith(_REDIRECTS)), None)
        if refused is not None and not self._told_refused_set:
            self._told_refused_set = True  # (each such page is a failed save, counted by the tier: said once here, with why)
            log.warning("redis refused a SET: %s", refused[:120].decode(errors="replace"))
        return [KeyStatus.OK if r == b"+OK" else None if r.startswith(_REDIRECTS) else KeyStatus.ERROR for r in replies]

    def set(self, keys: Sequence[str], values: Sequence[memoryview]) -> list[KeyStatus]:
        return self.set_scattered(keys, [(v,) for v in values])

    def _ttl_of(self, parts: Sequence[memoryview]) -> bytes | None:
        """The PX argument of an object's SET: the TTL in ms for a tenant's object, else None (no expiry)."""
        if self.tenant_ttl_ms is None:
            return None
        return b"%d" % self.tenant_ttl_ms if is_tenant(tag_of_parts(parts)) else None

    def _refreshed(self, reply: bytes) -> None:
        """A PEXPIRE XX's reply (``:1`` moved on, ``:0`` no expiry to move, a redirect as its GET's); Redis before 7.0
        refuses XX: said once, and its objects then expire a TTL after their write."""
        if reply[:1] == b"-" and not reply.startswith(_REDIRECTS) and not self._told_no_refresh:
            self._told_no_refresh = True
            log.warning("redis refused PEXPIRE ... XX (%s): a tenant's objects expire tenant_ttl_s after their write, "
                        "not after their last read (Redis 7.0 or later moves it on)", reply[:80].decode(errors="replace"))

    def _set_via_client(self, keys: Sequence[str], values: Sequence[memoryview]) -> list[KeyStatus]:
        """SETs through redis-py's pipeline (cluster redirects and failed nodes only); ``values`` are
        the caller's copies, so a SET that lands after the deadline still stores a whole object."""
        ttls = [self._ttl_of((v,)) for v in values]
        replies = self._cluster_pipeline(lambda pipe: [pipe.set(k, v, px=None if t is None else int(t))
                                                       for k, v, t in zip(keys, values, ttls)])
        statuses = [KeyStatus.OK if ok else KeyStatus.ERROR for ok in replies]
        self.stats.bytes_written += sum(len(v) for v, st in zip(values, statuses) if st is KeyStatus.OK)
        return statuses

    def delete(self, keys: Sequence[str]) -> None:
        if not keys:
            return

        def direct(pool, ks: Sequence[str], _b) -> list[KeyStatus | None]:
            with self._direct(pool, _key_commands(b"DEL", ks)) as reader:
                return [None if reader.integer() is None else KeyStatus.OK for _ in ks]

        def via_client(ks: Sequence[str], _b) -> list[KeyStatus]:
            self._cluster_pipeline(lambda pipe: [pipe.delete(k) for k in ks])
            return [KeyStatus.OK] * len(ks)

        self._by_node(keys, [None] * len(keys), "delete", direct, via_client)

    def delete_namespace(self, namespace: str, *, deadline_s: float = 30.0) -> int:
        """SCAN for ``namespace/*`` and UNLINK what it finds, in batches, for at most ``deadline_s``
        (a huge store is cleared by calling again; the count says how many went)."""
        pattern = re.sub(r"([*?\[\]\\])", r"\\\1", namespace) + "/*"
        removed = 0
        stop = time.monotonic() + deadline_s
        with map_storage_errors(self.stats, "delete namespace", lambda _e: None):
            batch: list = []
            for key in self.client.scan_iter(match=pattern, count=1000):
                batch.append(key)
                if len(batch) >= 1000:
                    removed += self.client.unlink(*batch) if not self.cluster else sum(self.client.unlink(k) for k in batch)
                    batch = []
                if time.monotonic() > stop:
                    break
            if batch:
                removed += self.client.unlink(*batch) if not self.cluster else sum(self.client.unlink(k) for k in batch)
        return removed

    def close(self) -> None:
        self._connector.shutdown(wait=False, cancel_futures=True)
        self._pipelines.shutdown(wait=False, cancel_futures=True)
        self._probes.shutdown(wait=False, cancel_futures=True)
        try:
            self.client.close()
        except Exception:
            pass
