"""``kvtier serve``'s process: one listening Unix socket, one region, one :class:`~kvtier.service.index.HostIndex`.

A single thread runs a selector over the listening socket and every connection; each frame is one
batch of ops, applied to the index in order and answered in one frame. A peer that breaks the
protocol gets a typed error frame and its connection closed; so does a peer whose answers it does not
read within ``send_deadline_s``, or whose frame does not arrive whole within it.

Each turn of the loop reads what the ready connections sent, then gives every connection a bounded share
of the turn (:data:`TURN_BYTES`, :data:`TURN_PAGES`: at least one frame, more while they stay under them),
round robin; frames are decoded only when applied. What one peer can hold is bounded: the bytes read
ahead of what was applied (:data:`READ_AHEAD`: past it the connection is not read, and its sends wait in
the kernel), its unread answers (past :data:`OUT_HIGH` its frames wait), its connections
(:data:`MAX_CONNECTIONS_PER_PROCESS`, :data:`MAX_CONNECTIONS` in all), its orphans
(:mod:`kvtier.service.sessions`), and the L3 tier's threads (a fixed few, whatever the namespaces:
:mod:`kvtier.service.storage`). So a client that floods the service with the largest legal frames delays
another's lookup by about one of them (~20 ms), not by its whole backlog.

The service makes the region, names its pages, and removes it on close; it touches the region's bytes
only with an L3 tier (:mod:`kvtier.service.storage`: published pages saved, pages fetched from the
store), on that tier's worker threads, never on the selector thread. A lookup's answer may then wait,
at most the ``wait_s`` it names, for the pages after its run to come in from the store; the
connection's next frames wait behind it (answers go out in order), the other connections do not.

What a closed connection held -- released, or kept as an orphan while its process lives or a writer of
it is connected -- is :mod:`kvtier.service.sessions`' business; each message's handler is the
``_on_<name>`` method its definition in :mod:`kvtier.service.messages` names (checked at import).
"""

from __future__ import annotations

import errno
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.config import check_number
from kvtier.errors import ConfigError, KVTierError, ServiceAccessError, ServiceError, ServiceProtocolError
from kvtier.pools.memory import DEFAULT_RESERVE_BYTES, host_memory_available
from kvtier.service.index import HostIndex
from kvtier.service.metrics import namespace_label
from kvtier.service.messages import MAX_WAIT_S, Hello, Join, Lookup, Message, Publish, Release, Reserve, check_handlers, parse_batch
from kvtier.service.peer import check_peer, claim_socket_path, group_id, peer_credentials, private_socket_dir, share_with_group
from kvtier.service.region import Region, RegionFormat, create_region, remove_region, remove_stale_regions
from kvtier.service.sessions import Orphan, Sessions, UnwatchedType, exited, open_pidfd
from kvtier.service.storage import Load, ServiceStorage
from kvtier.service.wire import HEADER, MAX_ANSWER, MAX_FRAME, FrameReader, decode, encode

log = logging.getLogger(__name__)

#: bytes read from a connection ahead of what was applied (past it the connection is not read: its sends wait in the kernel)
READ_AHEAD = HEADER.size + MAX_FRAME
#: bytes one recv takes
RECV_BYTES = 256 << 10
#: a connection's share of a loop turn: frames are applied while their bytes, and the pages they name, stay under these
#: (at least one frame a turn: one of MAX_FRAME bytes costs the loop ~20 ms)
TURN_BYTES = 64 << 10
TURN_PAGES = 4096
#: unread answer bytes past which a connection's frames wait (it reads its answers, or is dropped at send_deadline_s)
OUT_HIGH = 1 << 20
#: connections one peer process may have open, and all peers together (each may hold READ_AHEAD + OUT_HIGH bytes)
MAX_CONNECTIONS_PER_PROCESS = 32
MAX_CONNECTIONS = 512
#: the longest path a Unix socket address holds (sun_path's 108 bytes, less the terminating NUL)
MAX_SOCKET_PATH = 107
#: how often the loop checks that its region file is still there, whole (seconds)
REGION_CHECK_S = 1.0
#: how long the service stops accepting after the kernel refused it a file descriptor (doubled while it
#: goes on refusing, at most ACCEPT_PAUSE_MAX_S): its attached clients are served meanwhile
ACCEPT_PAUSE_S = 0.05
ACCEPT_PAUSE_MAX_S = 1.0
#: accept's errors that say the process (or the system) is out of file descriptors or socket memory
_OUT_OF_FDS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


@dataclass(frozen=True)
class ServeConfig:
    """``kvtier serve``'s settings."""

    host_gb: float = field(metadata={"help": "host tier size in GB: the shared region every attached engine maps"})
    socket: str = field(metadata={"help": "Unix socket path; its directory is made with mode 0700 (or must be so)"})
    send_deadline_s: float = field(default=5.0, metadata={"help": "a client that leaves answers unread this long is dropped"})
    allow_group: str | None = field(default=None, metadata={
        "help": "a group (name or gid) whose members of other uids may attach: the socket's directory 0750 and the region 0660 "
                "of that group; they can read and write every page of the region"})
    metrics_port: int | None = field(default=None, metadata={
        "help": "serve Prometheus metrics over HTTP on this port (0: a free one, named in the banner)"})
    metrics_host: str = field(default="127.0.0.1", metadata={"help": "the address the metrics are served on"})
    storage_url: str | None = field(default=None, metadata={"help": "the L3 tier below the region (any kvtier storage URL); None: none"})
    drain_timeout_s: float = field(default=30.0, metadata={"help": "on SIGTERM, how long pending L3 saves may take before the "
                                                                   "service stops without them"})

    def __post_init__(self) -> None:
        check_number(self, "host_gb", above=0)
        check_number(self, "send_deadline_s", above=0)
        check_number(self, "metrics_port", at_least=0, at_most=65535, integer=True)
        check_number(self, "drain_timeout_s", at_least=0)
        if not isinstance(self.socket, str) or not self.socket:
            raise ConfigError(f"ServeConfig.socket (--socket) must be a path; got {self.socket!r}")
        if len(os.fsencode(self.socket)) > MAX_SOCKET_PATH:
            raise ConfigError(f"--socket {self.socket[:60]}...: a Unix socket's path holds at most {MAX_SOCKET_PATH} bytes, this one "
                              f"{len(os.fsencode(self.socket))}; choose a shorter path (e.g. /run/kvtier/node.sock)")
        if not isinstance(self.metrics_host, str) or not self.metrics_host:
            raise ConfigError(f"ServeConfig.metrics_host must be an address; got {self.metrics_host!r}")
        if self.allow_group is not None and (not isinstance(self.allow_group, str) or not self.allow_group):
            raise ConfigError(f"ServeConfig.allow_group must be a group name or gid; got {self.allow_group!r}")
        if self.storage_url is not None and (not isinstance(self.storage_url, str) or not self.storage_url):
            raise ConfigError(f"ServeConfig.storage_url must be a storage URL (e.g. file:///var/cache/kvtier); got {self.storage_url!r}")

    @property
    def host_bytes(self) -> int:
        return int(self.host_gb * (1 << 30))


class _Conn:
    __slots__ = ("id", "sock", "reader", "out", "unread_since", "attached", "pid", "pidfd", "session", "namespace", "deferred",
                 "joined", "events", "eof", "partial_since", "share")

    def __init__(self, cid: int, sock: socket.socket, pid: int = 0):
        self.id = cid
        self.sock = sock
        #: the pages its engine means to hold at once (its hello's share; None: the region)
        self.share: int | None = None
        self.reader = FrameReader()
        self.out = bytearray()
        self.unread_since: float | None = None
        self.attached = False
        self.pid = pid
        #: the peer process, pinned when it connected (None: gone already, so nothing of it is kept;
        #: UNWATCHED: no fd was left to pin it, so it is taken to live)
        self.pidfd: int | None | UnwatchedType = None
        self.session = ""
        self.namespace = ""
        #: an answer held back for L3 loads: the frames after it wait in ``reader`` (answers go out in order)
        self.deferred: _Deferred | None = None
        #: the session this connection's process writes into (``join``), if it joined one
        self.joined: str | None = None
        #: what the selector watches the socket for (0: not registered; ``_accept`` registers it for reading)
        self.events = selectors.EVENT_READ
        #: the peer closed its end: what it sent whole is applied, then the connection is dropped
        self.eof = False
        #: when the frame at the head of ``reader`` started to arrive and is not whole yet (None: none is)
        self.partial_since: float | None = None

    @property
    def ready(self) -> bool:
        """A frame of it can be applied now."""
        return self.deferred is None and len(self.out) < OUT_HIGH and self.reader.whole


@dataclass(eq=False)
class _Deferred:
    """A batch's answer held back while its lookups' L3 loads run, until they are done or ``deadline``;
    ``waits``: (the op's index in the answer, its keys, the load)."""

    answer: dict
    waits: list[tuple[int, list[bytes], Load]]
    deadline: float

    def ready(self, now: float) -> bool:
        return now >= self.deadline or all(load.done for _i, _keys, load in self.waits)


class NodeService:
    """Binds ``config.socket`` (its directory private, a stale socket replaced), removes the regions its
    user's killed services left, and serves until :meth:`serve`'s ``stop`` says so; :meth:`close`
    removes the socket and the region. ``uid``: the one uid admitted (default: the service's own;
    ``config.allow_group`` admits that group's members too). ``lock`` is held while the loop acts on
    what it selected (a metrics scrape reads the service under it)."""

    def __init__(self, config: ServeConfig, *, uid: int | None = None):
        self.config = config
        self.uid = os.getuid() if uid is None else uid
        self.gid = None if config.allow_group is None else group_id(config.allow_group)
        available = host_memory_available()
        if config.host_bytes > available - DEFAULT_RESERVE_BYTES:
            raise ConfigError(f"--host-gb {config.host_gb:g} is more than the {max(available - DEFAULT_RESERVE_BYTES, 0) / (1 << 30):.2f} "
                              "GB of host memory available (minus a 1 GB reserve); lower --host-gb")
        self.region: Region | None = None
        self.index: HostIndex | None = None
        self._conns: dict[int, _Conn] = {}
        self.sessions = Sessions(watch=lambda fd, orphan: self._sel.register(fd, selectors.EVENT_READ, orphan),
                                 unwatch=lambda fd: self._sel.unregister(fd))
        self._next_id = 1
        self.lock = threading.Lock()
        #: peers refused at the door; connections refused for a message that broke the protocol; clients dropped
        #: for leaving their answers unread
        self.refused = self.protocol_errors = self.unread_drops = 0
        #: the L3 tier below the region and the metrics server (first: a bad URL, a busy port or a bad address
        #: fails before the socket is made, so before anyone attaches)
        self.storage = self.metrics = None
        try:
            self.storage = ServiceStorage(config.storage_url) if config.storage_url else None
            if config.metrics_port is not None:
                from kvtier.service.metrics import serve_metrics

                self.metrics = serve_metrics(self, config.metrics_host, config.metrics_port)
            self.listener = self._listen()
            remove_stale_regions()  # (what its user's killed services left)
        except BaseException:
            if self.metrics is not None:
                self.metrics.close()
            if self.storage is not None:
                self.storage.close(0.0)
            raise
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.listener, selectors.EVENT_READ, None)
        if self.storage is not None:
            self._sel.register(self.storage, selectors.EVENT_READ, self.storage)
        self._deferred: set[_Conn] = set()
        #: accepting paused at the fd limit until this time (``time.monotonic()``; None: accepting)
        self._accept_resume_at: float | None = None
        self._accept_pause_s = ACCEPT_PAUSE_S
        #: times accept found no file descriptor left (the service paused accepting, and served on)
        self.fd_limit_hits = 0
        #: what happened to the region file under the running service (removed, truncated, replaced), if anything
        self.region_problem: str | None = None
        self._region_id: tuple[int, int] | None = None
        self._region_checked_at = 0.0
        #: connections with whole frames to apply, or whose peer closed, in the order they came to have them (a
        #: connection served its share goes to the back): across connections, frames are applied as they arrived
        self._ready: dict[_Conn, None] = {}
        #: a connection in ``_ready`` can be served now (the selector then waits for nothing)
        self._busy = False

    def _listen(self) -> socket.socket:
        """The listening socket at ``config.socket``: its directory private (or the allowed group's), a stale
        socket replaced, the socket itself 0600 (0660 of the group)."""
        path = self.config.socket
        private_socket_dir(path, os.getuid(), self.gid)
        claim_socket_path(path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        if self.gid is None:
            os.chmod(path, 0o600)
        else:
            share_with_group(path, self.gid, 0o660, "the socket")
        listener.listen(64)
        listener.setblocking(False)
        return listener

    # ---- the loop --------------------------------------------------------------------------------
    def serve(self, stop: Callable[[], bool], tick_s: float = 0.1) -> None:
        while not stop():
            events = self._sel.select(self._wait_s(tick_s))
            with self.lock:
                self._handle(events)
                self._apply_turn()
                self._answer_deferred()
                self._drop_stalled_readers()
                self._resume_accepting()
                self.sessions.watch_unwatched()
                if time.monotonic() - self._region_checked_at >= REGION_CHECK_S:
                    self._check_region()
                self._drop_unfinished_frames()

    def _handle(self, events: list) -> None:
        for key, mask in events:
            if key.data is None:
                self._accept()
                continue
            if key.data is self.storage:  # an L3 worker finished something
                self.storage.poll()
                continue
            if type(key.data) is Orphan:  # its process exited
                self.sessions.orphan_exited(key.data)
                continue
            conn = key.data
            try:
                if mask & selectors.EVENT_READ and conn.id in self._conns:
                    self._read(conn)
                if mask & selectors.EVENT_WRITE and conn.id in self._conns:
                    self._flush(conn)
            except Exception:  # a bug one connection's messages reach ends that connection, never the service
                self._fault(conn)

    def _fault(self, conn: _Conn) -> None:
        log.exception("client %d: an internal error serving it; its connection is closed, the others are served", conn.id)
        self.protocol_errors += 1
        self._drop(conn)

    def _wait_s(self, tick_s: float) -> float:
        """The selector's wait: none while frames wait to be applied; else a tick, or less when a deferred
        answer's deadline comes sooner."""
        if self._busy:
            return 0.0
        if not self._deferred:
            return tick_s
        return max(0.0, min(tick_s, min(c.deferred.deadline for c in self._deferred) - time.monotonic()))

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except BlockingIOError:
            return
        except OSError as e:
            if e.errno in _OUT_OF_FDS:
                self._pause_accepting(e)
            elif e.errno not in (errno.ECONNABORTED, errno.EPROTO, errno.EINTR):  # (those: the peer gave up; accept the next)
                raise
            return
        self._accept_pause_s = ACCEPT_PAUSE_S
        cid, self._next_id = self._next_id, self._next_id + 1
        conn = _Conn(cid, sock)
        peer = peer_credentials(sock)
        pidfd = open_pidfd(peer.pid)  # (before its groups are read: alive after, they were that process's)
        try:
            check_peer(peer, self.uid, self.gid)
            self._check_room(peer.pid)
            if peer.uid != self.uid and (type(pidfd) is not int or exited(pidfd)):
                raise ServiceAccessError(f"process {peer.pid} exited, or could not be pinned, while its groups were checked")
        except KVTierError as e:
            self.refused += 1
            log.warning("refused a peer: %s", e)
            self._send_error(conn, 0, e)
            sock.close()
            if type(pidfd) is int:
                os.close(pidfd)
            return
        conn.pid, conn.pidfd = peer.pid, pidfd
        sock.setblocking(False)
        self._conns[cid] = conn
        self._sel.register(sock, selectors.EVENT_READ, conn)

    def _pause_accepting(self, error: OSError) -> None:
        """Out of file descriptors: stop accepting a while (the listener stays readable, so the selector would
        spin on it), serve the attached clients, then try again (:meth:`_resume_accepting`)."""
        self.fd_limit_hits += 1
        if self._accept_pause_s == ACCEPT_PAUSE_S:  # (once per episode)
            log.warning("accept: %s (%d connections open): new clients wait, attached ones are served; raise the open-files limit "
                        "(ulimit -n, LimitNOFILE=) if this persists", error.strerror, len(self._conns))
        self._sel.unregister(self.listener)
        self._accept_resume_at = time.monotonic() + self._accept_pause_s
        self._accept_pause_s = min(2 * self._accept_pause_s, ACCEPT_PAUSE_MAX_S)

    def _resume_accepting(self) -> None:
        if self._accept_resume_at is not None and time.monotonic() >= self._accept_resume_at:
            self._accept_resume_at = None
            self._sel.register(self.listener, selectors.EVENT_READ, None)

    def _check_room(self, pid: int) -> None:
        """A new connection of process ``pid`` fits under :data:`MAX_CONNECTIONS_PER_PROCESS` and
        :data:`MAX_CONNECTIONS` (each connection may hold up to READ_AHEAD + OUT_HIGH bytes of the service's)."""
        if len(self._conns) >= MAX_CONNECTIONS:
            raise ServiceAccessError(f"the service has {len(self._conns)} connections open (at most {MAX_CONNECTIONS}); try again later")
        mine = sum(c.pid == pid for c in self._conns.values())
        if mine >= MAX_CONNECTIONS_PER_PROCESS:
            raise ServiceAccessError(f"process {pid} has {mine} connections open (at most {MAX_CONNECTIONS_PER_PROCESS}); close one "
                                     "before opening another")

    def _read(self, conn: _Conn) -> None:
        """Take what ``conn`` sent, up to :data:`READ_AHEAD` bytes not yet applied (nothing is decoded here)."""
        while not conn.eof and (room := READ_AHEAD - conn.reader.buffered) > 0:
            try:
                data = conn.sock.recv(min(room, RECV_BYTES))
            except BlockingIOError:
                break
            except OSError:
                data = b""
            if not data:  # the peer closed (or died): what it sent whole is applied first (_apply_turn)
                conn.eof = True
                break
            try:
                conn.reader.feed(data)
            except ServiceProtocolError as e:
                self._refuse(conn, 0, e)
                return
        if conn.eof or conn.reader.whole:
            self._ready.setdefault(conn)
        self._settle(conn)

    def _settle(self, conn: _Conn) -> None:
        """After ``conn``'s buffer changed: time the frame at its head if it is unfinished, and read the
        socket only while there is room ahead (else its sends wait in the kernel: backpressure)."""
        if not conn.reader.pending:
            conn.partial_since = None
        elif conn.partial_since is None:
            conn.partial_since = time.monotonic()
        self._watch(conn)

    def _watch(self, conn: _Conn) -> None:
        """Register what the selector watches ``conn``'s socket for: reading while there is room ahead, writing
        while answers wait to go out."""
        want = (selectors.EVENT_READ if not conn.eof and conn.reader.buffered < READ_AHEAD else 0) | \
               (selectors.EVENT_WRITE if conn.out else 0)
        if want == conn.events:
            return
        if not conn.events:
            self._sel.register(conn.sock, want, conn)
        elif not want:
            self._sel.unregister(conn.sock)
        else:
            self._sel.modify(conn.sock, want, conn)
        conn.events = want

    def _apply_turn(self) -> None:
        """Every ready connection's share of this turn, in the order they came to be ready; one with frames
        left goes to the back. A connection whose peer closed is dropped once what it sent whole is applied
        (or waits behind a deferred answer: nobody reads that one)."""
        turn = list(self._ready)
        self._ready.clear()
        for conn in turn:
            if conn.id not in self._conns:
                continue
            try:
                self._apply_share(conn)
            except Exception:  # a bug one connection's messages reach ends that connection, never the service
                self._fault(conn)
                continue
            if conn.id not in self._conns:
                continue
            if conn.eof and (conn.deferred is not None or not conn.reader.whole):
                self._drop(conn)
            elif conn.reader.whole:
                self._ready[conn] = None
        self._busy = any(c.ready for c in self._ready)

    def _apply_share(self, conn: _Conn) -> None:
        """Apply ``conn``'s frames in order while its share lasts (:data:`TURN_BYTES`, :data:`TURN_PAGES`; one
        frame at least), until one's answer is deferred (the rest wait for it) or its answers go unread."""
        spent_bytes = spent_pages = 0
        while spent_bytes < TURN_BYTES and spent_pages < TURN_PAGES and conn.id in self._conns and conn.ready:
            try:
                body = conn.reader.next()
            except ServiceProtocolError as e:  # (the length of the frame after it)
                self._refuse(conn, 0, e)
                return
            spent_bytes += len(body)
            spent_pages += self._apply_frame(conn, body)
        if conn.id in self._conns:
            self._settle(conn)

    def _apply_frame(self, conn: _Conn, body: bytes) -> int:
        """Decode, check and apply one frame, and answer it (or defer its answer); the pages it named."""
        seq = 0
        waits: list[tuple[int, list[bytes], Load]] = []
        wait_s = MAX_WAIT_S
        try:
            frame = decode(body)
            seq = frame.get("seq") if type(frame.get("seq")) is int else 0
            batch = parse_batch(frame)
            results = []
            for op in batch.ops:
                results.append(self._apply(conn, op))
                load = self._load_after(conn, op, results[-1]) if type(op) is Lookup else None
                if load is not None and op.wait_s > 0:
                    waits.append((len(results) - 1, op.keys, load))
                    wait_s = min(wait_s, op.wait_s)
        except ServiceError as e:  # (a protocol error is one)
            self._refuse(conn, seq, e)
            return 0
        if batch.note:
            return batch.pages
        answer = {"seq": batch.seq, "results": results}
        if waits:
            conn.deferred = _Deferred(answer, waits, time.monotonic() + wait_s)
            self._deferred.add(conn)
        else:
            self._send(conn, answer)
        return batch.pages

    def _load_after(self, conn: _Conn, op: Lookup, pages: list[int]) -> Load | None:
        """The L3 load of the keys after a lookup's run in the region (None: no L3, the run is whole, or
        the store has nothing to add)."""
        if self.storage is None or len(pages) == len(op.keys):
            return None
        return self.storage.load(conn.namespace, op.keys[len(pages):])

    def _answer_deferred(self) -> None:
        """Send the deferred answers that are ready: each lookup's run extended by what its load brought
        into the region by now (held for the client as any lookup's pages)."""
        now = time.monotonic()
        for conn in [c for c in self._deferred if c.deferred.ready(now)]:
            self._deferred.discard(conn)
            deferred, conn.deferred = conn.deferred, None
            if conn.id not in self._conns:
                continue
            try:
                results = deferred.answer["results"]
                if conn.attached:  # (a bye later in the batch detached it: nothing more is held for it)
                    for i, keys, _load in deferred.waits:
                        results[i] = results[i] + self.index.extend(conn.id, keys[len(results[i]):])
                self._send(conn, deferred.answer)
            except Exception:
                self._fault(conn)
                continue
            self._busy = self._busy or (conn in self._ready and (conn.ready or conn.eof))  # (its next frames: the next turn)

    # ---- ops: one handler per message (messages.py's definitions; check_handlers below) --------------
    def _apply(self, conn: _Conn, op: Message) -> object:
        if op.ATTACHED and not conn.attached:
            raise ServiceProtocolError(f"{op.NAME} before hello (or after bye): a connection's first op is hello")
        return getattr(self, "_on_" + op.NAME)(conn, op)

    def _on_status(self, conn: _Conn, op: Message) -> dict:
        return self.status()

    def _on_hello(self, conn: _Conn, op: Hello) -> dict:
        if conn.attached or conn.joined is not None or conn.session:
            raise ServiceProtocolError("hello on a connection that said hello or join already: a connection attaches once")
        fmt = RegionFormat.from_wire(op.format)
        if self.storage is not None and fmt.spec is None:
            # (an engine whose region page is several kvtier specs -- vLLM's MHA/GQA shards at TP>1, SGLang's page -- names none)
            raise ServiceError("hello's format names no spec: this engine's page is not one kvtier spec (vLLM at tensor-parallel "
                               "size > 1 with MHA/GQA, or SGLang), and this service's L3 tier (--storage-url) stores single-spec pages "
                               "only so far; attach it to a service without --storage-url, or run it at tensor-parallel size 1")
        if self.region is None:
            self.region = create_region(fmt, self.config.host_bytes, gid=self.gid)
            self.index = HostIndex(self.region.num_pages)
            self.sessions.bind(self.index)
            if self.storage is not None:
                self.storage.bind(self.region, self.index)
            st = os.stat(self.region.path)
            self._region_id = (st.st_dev, st.st_ino)
            log.info("region %s: %d pages of %d bytes", self.region.path, self.region.num_pages, fmt.page_bytes)
        elif self._check_region():
            raise ServiceError(f"the node service's region {self.region.path} {self.region_problem}: it cannot give a new engine "
                               "its pages; restart kvtier serve (its engines keep what they mapped, and attach again)")
        elif fmt != self.region.format:
            raise ServiceError(f"this service's region holds pages of another format ({self.region.format}); an engine of "
                               f"{fmt} needs a service of its own (one page format per service)")
        stale = self.sessions.attach(conn, op.namespace, op.previous)
        conn.share = op.share
        if stale is not None:
            self._drop(stale)
        return {"region": self.region.path, "size": self.region.size, "num_pages": self.region.num_pages, "session": conn.session}

    def _on_join(self, conn: _Conn, op: Join) -> dict:
        if conn.attached or conn.joined is not None or conn.session:
            raise ServiceProtocolError("join on a connection that said hello or join already")
        self.sessions.join(conn, op.session)
        return {"session": op.session}

    def _on_bye(self, conn: _Conn, op: Message) -> None:
        if conn.joined is not None:
            self.sessions.leave(conn)
        elif not conn.attached:
            raise ServiceProtocolError("bye before hello (or after bye): a connection's first op is hello")
        else:
            self.sessions.detach(conn)

    def _on_lookup(self, conn: _Conn, op: Lookup) -> list[int]:
        return self.index.lookup(conn.id, op.keys)

    def _on_reserve(self, conn: _Conn, op: Reserve) -> list[int]:
        return self.index.reserve(conn.id, op.n)

    def _on_publish(self, conn: _Conn, op: Publish) -> None:
        indexed = self.index.publish(conn.id, op.pages, op.keys)
        if self.storage is not None:  # write-through: what it indexed now is saved
            key_of = dict(zip(op.pages, op.keys))
            self.storage.published(conn.namespace, indexed, [key_of[p] for p in indexed])

    def _on_release(self, conn: _Conn, op: Release) -> None:
        self.index.release(conn.id, op.pages)

    def _check_region(self) -> bool:
        """Whether the region file is gone or changed under the service (removed, truncated, replaced by another
        file); the first time, say so in the log, and in :meth:`status` from then on."""
        self._region_checked_at = time.monotonic()
        if self.region is None or self.region_problem is not None:
            return self.region_problem is not None
        try:
            st = os.lstat(self.region.path)
        except FileNotFoundError:
            problem = "was removed under the running service"
        else:
            problem = (None if (st.st_dev, st.st_ino) == self._region_id and st.st_size == self.region.size else
                       f"is {st.st_size} bytes, not the region's {self.region.size} (truncated under the running service)"
                       if (st.st_dev, st.st_ino) == self._region_id else "was replaced by another file under the running service")
        if problem is not None:
            self.region_problem = problem
            log.error("the region %s %s: new engines are refused; restart kvtier serve", self.region.path, problem)
        return problem is not None

    @property
    def attached_clients(self) -> int:
        return len(self.sessions.attached)

    @property
    def orphaned_clients(self) -> int:
        return len(self.sessions.orphans)

    @property
    def joined_writers(self) -> int:
        """Connections of processes that joined a session as its writers (``join``)."""
        return self.sessions.joined_writers

    def status(self) -> dict:
        out = {"socket": self.config.socket, "refused": self.refused, "region": self.region.path if self.region else None,
               "writers": self.joined_writers}
        if self.region_problem is not None:
            out["region_problem"] = self.region_problem
        if self.index is not None:
            out |= self.index.status().as_dict()
            # (a namespace names its salt, a secret of its engines: shown as a digest, as the metrics' labels do)
            out["pages_per_namespace"] = {namespace_label(ns): n for ns, n in out["pages_per_namespace"].items()}
            # (ready counts every written page; a page written again under a key published already is held by its
            # writer but offered to nobody: ready == sum(pages_per_namespace) + duplicates)
            out["duplicates"] = out["ready"] - sum(out["pages_per_namespace"].values())
            out["engines"] = self.engines()
        if self.storage is not None:
            out["l3"] = self.storage.status()
        # (the index counts an orphaned session as a client: here, the attached ones and the orphans apart)
        return out | {"clients": self.attached_clients, "orphaned": self.orphaned_clients, "protocol_errors": self.protocol_errors,
                      "unread_drops": self.unread_drops, "fd_limit_hits": self.fd_limit_hits}

    def engines(self) -> list[dict]:
        """The per-engine view: each attached session's process, namespace (as :func:`namespace_label` shows it),
        the share it asked for (None: the region) against the region, and the pages it holds, writes and was offered."""
        out = []
        for conn in self.sessions.attached.values():
            c = self.index.clients[conn.id]
            share = self.region.num_pages if conn.share is None else conn.share
            out.append({"client": conn.id, "pid": conn.pid, "namespace": namespace_label(conn.namespace), "share_pages": share,
                        "share_short_pages": max(0, share - self.region.num_pages), "held": len(c.held), "leased": len(c.writing),
                        "hit_pages": c.hit_pages})
        return out

    # ---- connections -------------------------------------------------------------------------------
    def _send(self, conn: _Conn, obj: dict) -> None:
        conn.out += encode(obj, MAX_ANSWER)
        if conn.unread_since is None:
            conn.unread_since = time.monotonic()
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        try:
            sent = conn.sock.send(conn.out)
        except BlockingIOError:
            sent = 0
        except OSError:
            self._drop(conn)
            return
        del conn.out[:sent]
        if not conn.out:
            conn.unread_since = None
        self._busy = self._busy or (conn in self._ready and conn.ready)  # (its answers read: its frames go on)
        self._watch(conn)

    def _drop_stalled_readers(self) -> None:
        now = time.monotonic()
        for conn in [c for c in self._conns.values() if c.unread_since is not None]:
            if now - conn.unread_since > self.config.send_deadline_s:
                log.warning("client %d left its answers unread for %.1f s: dropped", conn.id, now - conn.unread_since)
                self.unread_drops += 1
                self._drop(conn)

    def _drop_unfinished_frames(self) -> None:
        """A frame must arrive whole within ``send_deadline_s`` of its first byte (the service reads a
        connection whenever a frame at its head is unfinished): else its bytes would be held forever."""
        now, limit = time.monotonic(), self.config.send_deadline_s
        for conn in [c for c in self._conns.values() if c.partial_since is not None and now - c.partial_since > limit]:
            self._refuse(conn, 0, ServiceProtocolError(f"a frame was not sent whole within {limit:g} s of its first byte "
                                                       f"({conn.reader.buffered} bytes of it came)"))

    def _refuse(self, conn: _Conn, seq: int, error: KVTierError) -> None:
        log.warning("client %d: %s: %s (connection closed)", conn.id, type(error).__name__, error)
        self.protocol_errors += isinstance(error, ServiceProtocolError)
        self._send_error(conn, seq, error)
        self._drop(conn)

    @staticmethod
    def _send_error(conn: _Conn, seq: int, error: KVTierError) -> None:
        """Best effort, after the answers still queued: the typed error goes out if the socket takes it now
        (the connection is closed right after, either way)."""
        try:
            conn.sock.setblocking(False)
            conn.sock.send(bytes(conn.out) + encode({"seq": seq, "error": {"type": type(error).__name__, "message": str(error)}}))
        except OSError:
            pass

    def _drop(self, conn: _Conn) -> None:
        """Close ``conn``; what it held is released now, or kept as an orphan while its process lives."""
        if self._conns.pop(conn.id, None) is None:
            return
        self._deferred.discard(conn)
        self._ready.pop(conn, None)
        if conn.events:
            self._sel.unregister(conn.sock)
        conn.sock.close()
        self.sessions.closed(conn)

    def close(self) -> None:
        """Stop accepting (and serving metrics), close every connection, let the L3 saves under way finish (at
        most ``drain_timeout_s``), then remove the socket file and the region."""
        if self.metrics is not None:
            self.metrics.close()
        if self._accept_resume_at is None:
            self._sel.unregister(self.listener)
        self.listener.close()
        for conn in list(self._conns.values()):
            self._drop(conn)
        self.sessions.end_all()
        self._sel.close()
        if self.storage is not None:
            self._close_storage()
        try:
            os.unlink(self.config.socket)
        except FileNotFoundError:
            pass
        if self.region is not None:
            remove_region(self.region)

    def _close_storage(self) -> None:
        drained = self.storage.close(self.config.drain_timeout_s)
        c = self.storage.counters
        log.log(logging.INFO if drained else logging.WARNING, "L3 %s: %d pages saved, %d failed%s", self.storage.status()["url"],
                c.saved_pages, c.save_failed_pages, "" if drained else f"; saves still under way after {self.config.drain_timeout_s:g} s "
                "were dropped")


check_handlers(NodeService)
