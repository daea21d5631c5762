"""The node service's sessions: which connection holds what in the index, and until when.

A session is one ``hello``'s attachment; its pages (held for reading, leased for writing) live in the
:class:`~kvtier.service.index.HostIndex` under the connection's id. Its lifecycle::

    hello ──► attached ──── bye (quiesced), or its process is gone ─────────────► ended
                 │                                                               ▲
                 └─ connection closed while its process lives, or while a ──► orphan
                    process that joined it as a writer is connected            │
                                                                               ├─ its process exited and its last writer left
                                                                               └─ its process reattaches naming it (quiesced)

*ended*: its leases dropped unpublished (``died``: expired) and its holds released. *orphan*: its holds
and leases stay out of circulation -- its process may still read those pages from its tree, or a copy
(its own, or a joined writer's) may still be writing into them.

A process is watched through a pidfd taken when it connected (a reused pid cannot pass for it), polled
(:func:`exited`: ``poll``, not ``select``, so a pidfd past 1,023 works). Where no pidfd can be had
because the service is out of file descriptors, the process is *unwatched*: it is taken to live (so what
it holds stays out of circulation, the safe side), and :meth:`Sessions.watch_unwatched` tries again on
each of the loop's turns.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvtier.errors import ServiceAccessError, ServiceError, ServiceProtocolError
from kvtier.service.index import HostIndex

log = logging.getLogger(__name__)

#: orphaned sessions one process may have before its next hello is refused (each keeps pages out of
#: circulation until the process exits or reattaches naming it)
MAX_ORPHANS_PER_PROCESS = 16


class UnwatchedType:
    """The pidfd of a process that lives but could not be watched (no file descriptor was left)."""

    def __repr__(self) -> str:
        return "UNWATCHED"


UNWATCHED = UnwatchedType()


def open_pidfd(pid: int) -> int | None | UnwatchedType:
    """A pidfd pinning process ``pid``: None if it is gone already, :data:`UNWATCHED` if the service is
    out of file descriptors (it lives, as far as anyone can tell)."""
    try:
        return os.pidfd_open(pid)
    except OSError as e:
        if e.errno == errno.ESRCH:
            return None
        log.warning("cannot watch process %d (%s): it is taken to live until it can be watched", pid, e.strerror)
        return UNWATCHED


def exited(pidfd: int) -> bool:
    """Process ``pidfd`` has exited (its pidfd is readable); ``poll``, which takes any fd number."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


class Peer(Protocol):
    """What the sessions read and set of a connection (the server's)."""

    id: int
    pid: int
    pidfd: int | None | UnwatchedType
    session: str
    namespace: str
    attached: bool
    joined: str | None


@dataclass(eq=False)
class Orphan:
    """A closed connection's session kept while its process lives (``pidfd``: watched; None once it exited;
    :data:`UNWATCHED`: not yet watchable) or while writers that joined it are connected."""

    cid: int
    pid: int
    pidfd: int | None | UnwatchedType
    session: str


class Sessions:
    """The service's sessions over its index (made with the region, at the first hello: :meth:`bind`).
    ``watch(fd, orphan)`` and ``unwatch(fd)`` register an orphan's pidfd with the service's loop, which
    calls :meth:`orphan_exited` when it becomes readable."""

    def __init__(self, watch: Callable[[int, Orphan], None], unwatch: Callable[[int], None]):
        self.index: HostIndex | None = None
        self._watch, self._unwatch = watch, unwatch
        self.attached: dict[str, Peer] = {}
        self.orphans: dict[str, Orphan] = {}
        #: per session, the connections of processes that joined it as writers (``join``)
        self.writers: dict[str, set[Peer]] = {}

    def writer_of(self, client: int) -> tuple[int, str] | None:
        """(pid, session) of the attached session whose index client is ``client`` (None: none, e.g. the service's own)."""
        return next(((conn.pid, conn.session) for conn in self.attached.values() if conn.id == client), None)

    def bind(self, index: HostIndex) -> None:
        self.index = index

    @property
    def joined_writers(self) -> int:
        return sum(map(len, self.writers.values()))

    # ---- attaching ---------------------------------------------------------------------------------
    def attach(self, conn: Peer, namespace: str, previous: str | None) -> Peer | None:
        """``conn`` attaches in ``namespace`` under a new session (``conn.session``). ``previous``: a session
        of its process that is quiesced, ended now; if its connection is still open (its end not read yet),
        that connection is returned for the server to close."""
        stale = self._end_previous(conn, previous) if previous is not None else None
        mine = sum(o.pid == conn.pid for o in self.orphans.values())
        if mine >= MAX_ORPHANS_PER_PROCESS:
            raise ServiceAccessError(f"process {conn.pid} has {mine} orphaned sessions (at most {MAX_ORPHANS_PER_PROCESS}): each keeps "
                                     "pages out of circulation; reattach naming one as previous once it is quiesced, or exit")
        self.index.attach(conn.id, namespace)
        conn.attached, conn.namespace = True, namespace
        conn.session = secrets.token_hex(16)
        self.attached[conn.session] = conn
        return stale

    def join(self, conn: Peer, session: str) -> None:
        if session not in self.attached:
            raise ServiceError(f"join: no attached session {session[:8]}...; its engine detached or lost the service (it names "
                               "its new session in its next step)")
        conn.joined = session
        self.writers.setdefault(session, set()).add(conn)

    def leave(self, conn: Peer) -> None:
        """A writer's process no longer writes into its session's pages (it said bye, or it is gone): the
        session's orphan ends if its own process has exited and this was its last writer."""
        session, conn.joined = conn.joined, None
        writers = self.writers.get(session)
        if writers is None:
            return
        writers.discard(conn)
        if writers:
            return
        del self.writers[session]
        orphan = self.orphans.get(session)
        if orphan is not None and orphan.pidfd is None:
            self.end_orphan(orphan, "its process exited and its last writer has gone", died=True)

    def detach(self, conn: Peer, *, died: bool = False) -> None:
        """``conn``'s session ends: its writes dropped unpublished (``died``: its process is gone, its leases
        expired), its holds released."""
        if conn.attached:
            conn.attached = False
            del self.attached[conn.session]
            self._forget_writers(conn.session)
            self.index.detach(conn.id, died=died)

    def closed(self, conn: Peer) -> None:
        """``conn``'s connection is closed: its session ends, or is kept as an orphan while its process lives
        (or while writers of it are connected); its pidfd is closed or handed to the orphan."""
        if conn.joined is not None:
            self.leave(conn)
        pidfd = conn.pidfd
        died = pidfd is None or (pidfd is not UNWATCHED and exited(pidfd))
        if conn.attached and (not died or conn.session in self.writers) and self.index.holds_anything(conn.id):
            self._orphan(conn, died)
            return
        self.detach(conn, died=died)
        if type(pidfd) is int:
            os.close(pidfd)

    def _end_previous(self, conn: Peer, session: str) -> Peer | None:
        """The peer's process says its earlier ``session`` is quiesced: free what it held. A session the
        service does not know (a restarted service; ended already) is nothing to do."""
        orphan = self.orphans.get(session)
        old = self.attached.get(session)
        pid = orphan.pid if orphan is not None else old.pid if old is not None else conn.pid
        if pid != conn.pid:
            raise ServiceProtocolError(f"hello: session {session[:8]}... is process {pid}'s, not this one's ({conn.pid}); "
                                       "a process reattaches its own sessions only")
        if orphan is not None:
            self.end_orphan(orphan, "it reattached, quiesced")
        elif old is not None:  # its end not read yet: it is over all the same
            self.detach(old)
        return old

    def _forget_writers(self, session: str) -> None:
        """``session`` ended: the processes that joined it write into nothing of it any more (their
        connections stay open, counted nowhere)."""
        for writer in self.writers.pop(session, ()):
            writer.joined = None

    # ---- orphans -----------------------------------------------------------------------------------
    def _orphan(self, conn: Peer, died: bool) -> None:
        orphan = Orphan(conn.id, conn.pid, None if died else conn.pidfd, conn.session)
        del self.attached[conn.session]
        self.orphans[orphan.session] = orphan
        if died:
            if type(conn.pidfd) is int:
                os.close(conn.pidfd)
        elif type(orphan.pidfd) is int:
            self._watch(orphan.pidfd, orphan)
        c = self.index.clients[conn.id]
        writers = len(self.writers.get(conn.session, ()))
        # (info, not a warning: an engine that stops with copies in flight ends its connection so, and then exits)
        log.info("client %d (process %d) closed while %s: its %d held and %d leased pages stay out of circulation until %s", conn.id,
                    conn.pid, f"{writers} writer processes of it are connected" if died else "its process lives", len(c.held),
                    len(c.writing), "they are gone" if died else "it exits or reattaches")

    def orphan_exited(self, orphan: Orphan) -> None:
        """The orphan's process exited: it ends now, or once its last writer has gone."""
        if orphan.session not in self.orphans:
            return
        if type(orphan.pidfd) is int:
            self._unwatch(orphan.pidfd)
            os.close(orphan.pidfd)
        orphan.pidfd = None
        if orphan.session not in self.writers:
            self.end_orphan(orphan, "its process exited", died=True)

    def watch_unwatched(self) -> None:
        """Orphans whose process could not be watched (no fd was left): watch them now if an fd is free."""
        for orphan in [o for o in self.orphans.values() if o.pidfd is UNWATCHED]:
            pidfd = open_pidfd(orphan.pid)
            if pidfd is UNWATCHED:
                return  # (still none to spare)
            orphan.pidfd = pidfd
            if pidfd is None:  # it exited meanwhile
                self.orphan_exited(orphan)
            else:
                self._watch(pidfd, orphan)

    def end_orphan(self, orphan: Orphan, why: str, *, died: bool = False) -> None:
        del self.orphans[orphan.session]
        if type(orphan.pidfd) is int:
            self._unwatch(orphan.pidfd)
            os.close(orphan.pidfd)
        self._forget_writers(orphan.session)
        self.index.detach(orphan.cid, died=died)
        log.info("client %d's orphaned session ended: %s", orphan.cid, why)

    def end_all(self) -> None:
        """The service stops: every orphan ends (attached connections are closed by the server first)."""
        for orphan in list(self.orphans.values()):
            self.end_orphan(orphan, "the service stops")
