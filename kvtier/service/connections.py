"""The node service's transport: its connections on the selector, and the bytes that cross them.

:class:`Connections` accepts peers on the listening socket (their uid or group checked through
:mod:`kvtier.service.peer`, their process pinned by a pidfd, their number bounded), reads what they send,
applies it in fair turns, sends the answers and drops a connection that breaks the rules. What a frame
means is the service's business: ``apply_frame(conn, body)`` decodes, applies and answers one frame (or
holds its answer back in ``conn.deferred``); ``closed(conn)`` is told of every dropped connection, to
release what it held.

Each turn of the loop reads what the ready connections sent, then gives every connection a bounded share
of the turn (:data:`TURN_BYTES`, :data:`TURN_PAGES`: at least one frame, more while they stay under them),
round robin; frames are decoded only when applied. What one peer can hold here is bounded: the bytes read
ahead of what was applied (:data:`READ_AHEAD`: past it the connection is not read, and its sends wait in
the kernel), its unread answers (past :data:`OUT_HIGH` its frames wait; left unread ``send_deadline_s``,
it is dropped), an unfinished frame (whole within ``send_deadline_s`` of its first byte, or dropped) and
its connections (:data:`MAX_CONNECTIONS_PER_PROCESS`, :data:`MAX_CONNECTIONS` in all). Out of file
descriptors, the service stops accepting a while (:data:`ACCEPT_PAUSE_S`, doubled while it lasts) and
serves its attached clients meanwhile. A peer that breaks the protocol gets a typed error frame and its
connection closed.
"""

from __future__ import annotations

import errno
import logging
import os
import selectors
import socket
import time
from collections.abc import Callable

from kvtier.errors import KVTierError, ServiceAccessError, ServiceProtocolError
from kvtier.service.peer import check_peer, peer_credentials
from kvtier.service.sessions import UnwatchedType, exited, open_pidfd
from kvtier.service.wire import HEADER, MAX_ANSWER, MAX_FRAME, FrameReader, encode

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
#: how long the service stops accepting after the kernel refused it a file descriptor (doubled while it
#: goes on refusing, at most ACCEPT_PAUSE_MAX_S): its attached clients are served meanwhile
ACCEPT_PAUSE_S = 0.05
ACCEPT_PAUSE_MAX_S = 1.0
#: accept's errors that say the process (or the system) is out of file descriptors or socket memory
_OUT_OF_FDS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class Connection:
    """One accepted connection: its socket and buffers, and what the service's sessions keep of it
    (:class:`kvtier.service.sessions.Peer`)."""

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
        #: an answer the service held back (for L3 loads): the frames after it wait in ``reader`` (answers go out in order)
        self.deferred: object | None = None
        #: the session this connection's process writes into (``join``), if it joined one
        self.joined: str | None = None
        #: what the selector watches the socket for (0: not registered; ``accept`` registers it for reading)
        self.events = selectors.EVENT_READ
        #: the peer closed its end: what it sent whole is applied, then the connection is dropped
        self.eof = False
        #: when the frame at the head of ``reader`` started to arrive and is not whole yet (None: none is)
        self.partial_since: float | None = None

    @property
    def ready(self) -> bool:
        """A frame of it can be applied now."""
        return self.deferred is None and len(self.out) < OUT_HIGH and self.reader.whole


class Connections:
    """The connections of ``listener`` on the service's selector ``sel`` (the listener registered with data
    None, each connection with itself). ``uid``, ``gid``: who is admitted (:func:`check_peer`);
    ``apply_frame(conn, body)``: apply and answer one frame, returning the pages it named; ``closed(conn)``:
    ``conn`` was dropped."""

    def __init__(self, sel: selectors.BaseSelector, listener: socket.socket, *, uid: int, gid: int | None, send_deadline_s: float,
                 apply_frame: Callable[[Connection, bytes], int], closed: Callable[[Connection], None]):
        self._sel, self.listener = sel, listener
        self.uid, self.gid, self.send_deadline_s = uid, gid, send_deadline_s
        self._apply_frame, self._closed = apply_frame, closed
        self.conns: dict[int, Connection] = {}
        self._next_id = 1
        #: peers refused at the door; connections refused for a message that broke the protocol (or closed on an
        #: internal error); clients dropped for leaving their answers unread
        self.refused = self.protocol_errors = self.unread_drops = 0
        #: times accept found no file descriptor left (the service paused accepting, and served on)
        self.fd_limit_hits = 0
        #: accepting paused at the fd limit until this time (``time.monotonic()``; None: accepting)
        self._accept_resume_at: float | None = None
        self._accept_pause_s = ACCEPT_PAUSE_S
        #: connections with whole frames to apply, or whose peer closed, in the order they came to have them (a
        #: connection served its share goes to the back): across connections, frames are applied as they arrived
        self._ready: dict[Connection, None] = {}
        #: a connection in ``_ready`` can be served now (the selector then waits for nothing)
        self.busy = False
        self._sel.register(listener, selectors.EVENT_READ, None)

    def __contains__(self, conn: Connection) -> bool:
        """``conn`` is open (not dropped)."""
        return conn.id in self.conns

    def handle(self, conn: Connection, mask: int) -> None:
        """``conn``'s socket is readable or writable (``mask``, the selector's)."""
        try:
            if mask & selectors.EVENT_READ and conn.id in self.conns:
                self._read(conn)
            if mask & selectors.EVENT_WRITE and conn.id in self.conns:
                self._flush(conn)
        except Exception:  # a bug one connection's messages reach ends that connection, never the service
            self.fault(conn)

    def fault(self, conn: Connection) -> None:
        log.exception("client %d: an internal error serving it; its connection is closed, the others are served", conn.id)
        self.protocol_errors += 1
        self.drop(conn)

    # ---- accepting -----------------------------------------------------------------------------------
    def accept(self) -> None:
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
        conn = Connection(cid, sock)
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
            _send_error(conn, 0, e)
            sock.close()
            if type(pidfd) is int:
                os.close(pidfd)
            return
        conn.pid, conn.pidfd = peer.pid, pidfd
        sock.setblocking(False)
        self.conns[cid] = conn
        self._sel.register(sock, selectors.EVENT_READ, conn)

    def _pause_accepting(self, error: OSError) -> None:
        """Out of file descriptors: stop accepting a while (the listener stays readable, so the selector would
        spin on it), serve the attached clients, then try again (:meth:`resume_accepting`)."""
        self.fd_limit_hits += 1
        if self._accept_pause_s == ACCEPT_PAUSE_S:  # (once per episode)
            log.warning("accept: %s (%d connections open): new clients wait, attached ones are served; raise the open-files limit "
                        "(ulimit -n, LimitNOFILE=) if this persists", error.strerror, len(self.conns))
        self._sel.unregister(self.listener)
        self._accept_resume_at = time.monotonic() + self._accept_pause_s
        self._accept_pause_s = min(2 * self._accept_pause_s, ACCEPT_PAUSE_MAX_S)

    def resume_accepting(self) -> None:
        if self._accept_resume_at is not None and time.monotonic() >= self._accept_resume_at:
            self._accept_resume_at = None
            self._sel.register(self.listener, selectors.EVENT_READ, None)

    def _check_room(self, pid: int) -> None:
        """A new connection of process ``pid`` fits under :data:`MAX_CONNECTIONS_PER_PROCESS` and
        :data:`MAX_CONNECTIONS` (each connection may hold up to READ_AHEAD + OUT_HIGH bytes of the service's)."""
        if len(self.conns) >= MAX_CONNECTIONS:
            raise ServiceAccessError(f"the service has {len(self.conns)} connections open (at most {MAX_CONNECTIONS}); try again later")
        mine = sum(c.pid == pid for c in self.conns.values())
        if mine >= MAX_CONNECTIONS_PER_PROCESS:
            raise ServiceAccessError(f"process {pid} has {mine} connections open (at most {MAX_CONNECTIONS_PER_PROCESS}); close one "
                                     "before opening another")

    # ---- reading, and the turns ----------------------------------------------------------------------
    def _read(self, conn: Connection) -> None:
        """Take what ``conn`` sent, up to :data:`READ_AHEAD` bytes not yet applied (nothing is decoded here)."""
        while not conn.eof and (room := READ_AHEAD - conn.reader.buffered) > 0:
            try:
                data = conn.sock.recv(min(room, RECV_BYTES))
            except BlockingIOError:
                break
            except OSError:
                data = b""
            if not data:  # the peer closed (or died): what it sent whole is applied first (apply_turn)
                conn.eof = True
                break
            try:
                conn.reader.feed(data)
            except ServiceProtocolError as e:
                self.refuse(conn, 0, e)
                return
        if conn.eof or conn.reader.whole:
            self._ready.setdefault(conn)
        self._settle(conn)

    def _settle(self, conn: Connection) -> None:
        """After ``conn``'s buffer changed: time the frame at its head if it is unfinished, and read the
        socket only while there is room ahead (else its sends wait in the kernel: backpressure)."""
        if not conn.reader.pending:
            conn.partial_since = None
        elif conn.partial_since is None:
            conn.partial_since = time.monotonic()
        self._watch(conn)

    def _watch(self, conn: Connection) -> None:
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

    def apply_turn(self) -> None:
        """Every ready connection's share of this turn, in the order they came to be ready; one with frames
        left goes to the back. A connection whose peer closed is dropped once what it sent whole is applied
        (or waits behind a deferred answer: nobody reads that one)."""
        turn = list(self._ready)
        self._ready.clear()
        for conn in turn:
            if conn.id not in self.conns:
                continue
            try:
                self._apply_share(conn)
            except Exception:  # a bug one connection's messages reach ends that connection, never the service
                self.fault(conn)
                continue
            if conn.id not in self.conns:
                continue
            if conn.eof and (conn.deferred is not None or not conn.reader.whole):
                self.drop(conn)
            elif conn.reader.whole:
                self._ready[conn] = None
        self.busy = any(c.ready for c in self._ready)

    def _apply_share(self, conn: Connection) -> None:
        """Apply ``conn``'s frames in order while its share lasts (:data:`TURN_BYTES`, :data:`TURN_PAGES`; one
        frame at least), until one's answer is deferred (the rest wait for it) or its answers go unread."""
        spent_bytes = spent_pages = 0
        while spent_bytes < TURN_BYTES and spent_pages < TURN_PAGES and conn.id in self.conns and conn.ready:
            try:
                body = conn.reader.next()
            except ServiceProtocolError as e:  # (the length of the frame after it)
                self.refuse(conn, 0, e)
                return
            spent_bytes += len(body)
            spent_pages += self._apply_frame(conn, body)
        if conn.id in self.conns:
            self._settle(conn)

    def answered(self, conn: Connection) -> None:
        """``conn``'s deferred answer went out: its next frames (or its closing, if its peer closed) are the next turn's."""
        self.busy = self.busy or (conn in self._ready and (conn.ready or conn.eof))

    # ---- sending, and dropping -----------------------------------------------------------------------
    def send(self, conn: Connection, obj: dict) -> None:
        conn.out += encode(obj, MAX_ANSWER)
        if conn.unread_since is None:
            conn.unread_since = time.monotonic()
        self._flush(conn)

    def _flush(self, conn: Connection) -> None:
        try:
            sent = conn.sock.send(conn.out)
        except BlockingIOError:
            sent = 0
        except OSError:
            self.drop(conn)
            return
        del conn.out[:sent]
        if not conn.out:
            conn.unread_since = None
        self.busy = self.busy or (conn in self._ready and conn.ready)  # (its answers read: its frames go on)
        self._watch(conn)

    def drop_stalled_readers(self) -> None:
        now = time.monotonic()
        for conn in [c for c in self.conns.values() if c.unread_since is not None]:
            if now - conn.unread_since > self.send_deadline_s:
                log.warning("client %d left its answers unread for %.1f s: dropped", conn.id, now - conn.unread_since)
                self.unread_drops += 1
                self.drop(conn)

    def drop_unfinished_frames(self) -> None:
        """A frame must arrive whole within ``send_deadline_s`` of its first byte (the service reads a
        connection whenever a frame at its head is unfinished): else its bytes would be held forever."""
        now, limit = time.monotonic(), self.send_deadline_s
        for conn in [c for c in self.conns.values() if c.partial_since is not None and now - c.partial_since > limit]:
            self.refuse(conn, 0, ServiceProtocolError(f"a frame was not sent whole within {limit:g} s of its first byte "
                                                      f"({conn.reader.buffered} bytes of it came)"))

    def refuse(self, conn: Connection, seq: int, error: KVTierError) -> None:
        """Send ``conn`` ``error`` as a typed error frame (answering ``seq``), and drop it."""
        log.warning("client %d: %s: %s (connection closed)", conn.id, type(error).__name__, error)
        self.protocol_errors += isinstance(error, ServiceProtocolError)
        _send_error(conn, seq, error)
        self.drop(conn)

    def drop(self, conn: Connection) -> None:
        """Close ``conn`` (the service is told: ``closed``)."""
        if self.conns.pop(conn.id, None) is None:
            return
        self._ready.pop(conn, None)
        if conn.events:
            self._sel.unregister(conn.sock)
        conn.sock.close()
        self._closed(conn)

    def close(self) -> None:
        """Stop accepting, and drop every connection."""
        if self._accept_resume_at is None:
            self._sel.unregister(self.listener)
        self.listener.close()
        for conn in list(self.conns.values()):
            self.drop(conn)


def _send_error(conn: Connection, seq: int, error: KVTierError) -> None:
    """Best effort, after the answers still queued: the typed error goes out if the socket takes it now
    (the connection is closed right after, either way)."""
    try:
        conn.sock.setblocking(False)
        conn.sock.send(bytes(conn.out) + encode({"seq": seq, "error": {"type": type(error).__name__, "message": str(error)}}))
    except OSError:
        pass
