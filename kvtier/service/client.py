"""An engine's connection to the node service: one socket, batched calls, a deadline on every one.

A call sends one frame (a batch of ops) and reads its one answer before the deadline. Notes (publish,
release) are batches the service does not answer: they leave at once, nothing waits on them, and if
the service refused one the refusal is what the next call reads. Any failure -- no answer in time, a
closed connection, a refusal -- is a :class:`~kvtier.errors.ServiceError` (typed as the service sent
it), and the client is broken from then on: an answer that arrives late must never be read as the
answer to a later call, nor a frame follow one half sent.

**What the client trusts.** Nothing it reads is booked unchecked (the service's side of the socket is
another process, possibly another user's). Before it sends a byte, the socket's directory and the
listener's uid are checked (:func:`~kvtier.service.peer.check_socket_dir`,
:func:`~kvtier.service.peer.check_listener`: the service's uid is this process's, or ``service_uid``);
the hello's answer is a :class:`HelloAnswer` only once its fields are checked and the region file it
names is a regular file of that uid, of its announced size, mode 0600 (0660 of the group the socket's
directory lets in); every lookup's and reservation's pages are checked ints, in the region, unique,
no more than asked (:func:`check_pages`). A bad answer is a :class:`~kvtier.errors.ServiceProtocolError`
and breaks the client like any other failure; a refused service, a
:class:`~kvtier.errors.ServiceAccessError` naming the path, the owner found and the fix.

Two deadlines, each for a whole call: ``deadline_s`` for attaching and ``status``, and the short
``lookup_deadline_s`` for what an engine's thread waits on while it serves requests -- a lookup, a
reservation, a note's send (a service that stopped reading fills the socket's buffer, and a send
then waits), and attaching again (:meth:`ServiceClient.again`). A stalled service (stopped, or its
loop hung) costs an engine at most that, once: the engine then treats it as lost.

A call longer than the service takes in one frame (:data:`~kvtier.service.wire.MAX_FRAME` bytes,
:data:`~kvtier.service.messages.MAX_PAGES` pages) goes as several, within the one call's deadline: a lookup
chunk by chunk (page keys are chained, so the next chunk is asked only when this one's run was whole), a
reservation until the service gives fewer than asked, publish and release as several notes.
"""

from __future__ import annotations

import json
import os
import select
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvtier.errors import ServiceAccessError, ServiceError, ServiceProtocolError, ServiceUnavailableError
from kvtier.service.messages import (MAX_OPS, MAX_PAGES, MAX_SESSION, MAX_WAIT_S, Bye, Find, Hello, Join, Lookup, Message, Publish, Release,
                                     Reserve, Status)
from kvtier.service.peer import ServiceTrust, check_listener, check_socket_dir
from kvtier.service.region import RegionFormat, map_region, open_region
from kvtier.service.wire import MAX_FRAME, recv_frame, send_frame

#: the error types the service sends, by name (anything else is a plain ServiceError)
_ERRORS = {cls.__name__: cls for cls in (ServiceError, ServiceProtocolError, ServiceAccessError)}

#: a call's deadline unless told (``deadline_s``): attaching, status
DEFAULT_DEADLINE_S = 10.0
#: the deadline of a call an engine's thread waits on unless told (``lookup_deadline_s``; never longer than
#: ``deadline_s``): a service that has not answered a lookup in this long is better treated as lost (misses)
DEFAULT_LOOKUP_DEADLINE_S = 0.25
#: the share of a lookup's deadline the service may spend fetching pages from its L3 tier before it answers
#: (the rest is the answer's way back, and the service's other work on a loaded node)
LOOKUP_WAIT_SHARE = 0.5
#: the most pages a hello may announce (far beyond any host's memory: the region file's size is what bounds it)
MAX_REGION_PAGES = 1 << 48
#: the longest region path a hello may name (Linux's PATH_MAX)
MAX_PATH = 4096


def lookup_deadline(deadline_s: float, lookup_deadline_s: float | None) -> float:
    """The deadline of a call an engine's thread waits on: ``lookup_deadline_s``, or (None) the smaller of
    :data:`DEFAULT_LOOKUP_DEADLINE_S` and the call deadline ``deadline_s``."""
    return min(DEFAULT_LOOKUP_DEADLINE_S, deadline_s) if lookup_deadline_s is None else lookup_deadline_s


@dataclass(frozen=True)
class HelloAnswer:
    """The service's answer to ``hello``, checked (:meth:`check`): the region to map -- an absolute path
    to a file of ``size`` bytes holding ``num_pages`` pages of the client's format -- and this
    connection's ``session``."""

    region: str
    size: int
    num_pages: int
    session: str

    @classmethod
    def check(cls, result: object, fmt: RegionFormat, trust: ServiceTrust) -> HelloAnswer:
        """``result`` as a :class:`HelloAnswer` once every field is of its type and in range, ``size`` is
        what ``num_pages`` pages of ``fmt`` take, and the region is a file the service of ``trust`` made of
        that size (:func:`~kvtier.service.region.open_region`: so ``num_pages`` is no more than exists);
        a :class:`~kvtier.errors.ServiceProtocolError` (or, for the file, a
        :class:`~kvtier.errors.ServiceAccessError`) naming the field otherwise."""
        if type(result) is not dict:
            raise ServiceProtocolError(f"the node service answered hello with {_show(result)}, not an object")
        region, size, num_pages, session = (result.get(k) for k in ("region", "size", "num_pages", "session"))
        if type(region) is not str or not region.startswith("/") or len(region) > MAX_PATH or "\0" in region:
            raise ServiceProtocolError(f"the node service's hello names the region {_show(region)}, not an absolute path")
        if type(num_pages) is not int or not 1 <= num_pages <= MAX_REGION_PAGES:
            raise ServiceProtocolError(f"the node service's hello announces {_show(num_pages)} pages, not 1 to {MAX_REGION_PAGES}")
        if type(size) is not int or size != fmt.size(num_pages):
            raise ServiceProtocolError(f"the node service's hello announces a region of {_show(size)} bytes; {num_pages} pages of this "
                                       f"format take {fmt.size(num_pages)}")
        if type(session) is not str or not 0 < len(session) <= MAX_SESSION:
            raise ServiceProtocolError(f"the node service's hello names the session {_show(session)}, not a session id")
        os.close(open_region(region, size, trust))
        return cls(region, size, num_pages, session)


def check_pages(pages: object, at_most: int, num_pages: int, what: str, first: int = 0, absent: bool = False) -> list[int]:
    """The page ids of an answer (``what``: a lookup's, a reservation's) as a list of distinct ints in the
    region (``first <= id < first + num_pages``: pool ``first // num_pages``'s), at most ``at_most`` of them
    (``absent``: exactly that many, each such an id or -1, a find's); a :class:`~kvtier.errors.ServiceProtocolError`
    naming what is wrong otherwise (a negative id would read the region's last page; one past it,
    another process's memory, or another pool's object read as this one's; a repeat would be booked twice)."""
    if type(pages) is not list:
        raise ServiceProtocolError(f"the node service answered a {what} with {_show(pages)}, not a list of page ids")
    if len(pages) > at_most or absent and len(pages) != at_most:
        raise ServiceProtocolError(f"the node service answered a {what} of {at_most} pages with {len(pages)}")
    for page in pages:
        if type(page) is not int or not first <= page < first + num_pages and not (absent and page == -1):
            raise ServiceProtocolError(f"the node service's {what} named page {_show(page)}, not one of its region's {num_pages}"
                                       + (f" of pool {first // num_pages}" if first else ""))
    if absent:
        pages = [p for p in pages if p >= 0]
    if len(set(pages)) != len(pages):
        raise ServiceProtocolError(f"the node service's {what} named a page twice: {_show(pages)}")
    return pages


def check_found(found: object, keys: int, num_pages: int, pool: int) -> list[int]:
    """A find's answer for ``keys`` keys in pool ``pool``: one entry per key, a page of the pool or -1, no page twice."""
    check_pages(found, keys, num_pages, "find", pool * num_pages, absent=True)
    return found  # (checked: the -1s kept in place)


#: the bytes of page keys and ids one frame of a split call carries (the rest of MAX_FRAME: seq, op names, separators)
SPLIT_BYTES = MAX_FRAME - (16 << 10)


class ServiceClient:
    """Attached to the service at ``socket_path`` in ``namespace`` (a :class:`~kvtier.hashing.Namespace`'s
    string), for pages of ``fmt``. ``region``, ``region_size`` and ``num_pages`` say what to map;
    ``session`` names this attachment. ``previous``: a session of this process that is quiesced (nothing
    in flight touches its pages, none is in its tree any more): the service frees what it kept of it.
    ``deadline_s`` and ``lookup_deadline_s`` (default: the smaller of :data:`DEFAULT_LOOKUP_DEADLINE_S`
    and ``deadline_s``): see the module's docstring; ``attach_deadline_s`` bounds the connect and the
    hello together (default ``deadline_s``). ``service_uid``: the uid the service runs as, where it is not
    this process's (a member of its ``--allow-group``; ``TierConfig.service_uid``): any other is refused.
    ``share``: the pages this engine means to hold at once, told to the service for its per-engine view."""

    def __init__(self, socket_path: str, namespace: str, fmt: RegionFormat, *, deadline_s: float = DEFAULT_DEADLINE_S,
                 lookup_deadline_s: float | None = None, previous: str | None = None, attach_deadline_s: float | None = None,
                 service_uid: int | None = None, share: int | None = None):
        self.socket_path = socket_path
        self.share = share
        self.namespace = namespace
        self.fmt = fmt
        self.deadline_s = deadline_s
        self.lookup_deadline_s = lookup_deadline(deadline_s, lookup_deadline_s)
        self.service_uid = service_uid
        self._seq = 0
        #: round trips that carried lookups (a scheduler's per-step batch is one, as a lookup that fits a frame is)
        self.lookup_round_trips = 0
        self._broken: str | None = None
        attach_s = deadline_s if attach_deadline_s is None else attach_deadline_s
        deadline = time.monotonic() + attach_s
        self._sock, self.trust = _connect(socket_path, attach_s, service_uid)
        (hello,) = self._call([Hello(namespace=namespace, format=fmt.as_wire(), previous=previous, share=share).wire()], deadline)
        try:
            self.hello = HelloAnswer.check(hello, fmt, self.trust)
        except ServiceError as e:
            raise self._break(e) from None
        self.region: str = self.hello.region
        self.region_size: int = self.hello.size
        self.num_pages: int = self.hello.num_pages
        self.session: str = self.hello.session

    @classmethod
    def reattach(cls, socket_path: str, namespace: str, fmt: RegionFormat, previous: str | None, *, deadline_s: float = DEFAULT_DEADLINE_S,
                 lookup_deadline_s: float | None = None, service_uid: int | None = None, share: int | None = None) -> ServiceClient:
        """Attached as an engine attaches again between requests (on its own thread, or its heartbeat's): connect and
        hello within the lookup deadline, naming ``previous`` (a quiesced session of this process, or None)."""
        quick = lookup_deadline(deadline_s, lookup_deadline_s)
        return cls(socket_path, namespace, fmt, deadline_s=deadline_s, lookup_deadline_s=quick, previous=previous,
                   attach_deadline_s=quick, service_uid=service_uid, share=share)

    def again(self, *, quiesced: bool = True) -> ServiceClient:
        """A new client attached as this one was (:meth:`reattach`), naming this one's session as quiesced unless
        ``quiesced`` is False (something may still touch its pages)."""
        return ServiceClient.reattach(self.socket_path, self.namespace, self.fmt, self.session if quiesced else None,
                                      deadline_s=self.deadline_s, lookup_deadline_s=self.lookup_deadline_s,
                                      service_uid=self.service_uid, share=self.share)

    def map_region(self, **kwargs) -> torch.Tensor:
        """The region this client's hello named, mapped once it is checked again to be the service's
        (:func:`~kvtier.service.region.map_region` with this client's :attr:`trust`; ``kwargs``: its options)."""
        return map_region(self.region, self.region_size, trust=self.trust, **kwargs)

    # ---- the wire --------------------------------------------------------------------------------
    def call(self, ops: list[dict]) -> list:
        """One round trip within the call deadline: ``ops`` in one frame, their results in order."""
        return self._call(ops, time.monotonic() + self.deadline_s)

    def _call(self, ops: list[dict], deadline: float) -> list:
        self._check()
        self._seq += 1
        try:
            send_frame(self._sock, {"seq": self._seq, "ops": ops}, deadline)
        except ServiceError as e:  # closed on us: a refusal it sent first is the reason
            answer = self._last_words(deadline)
            if answer is None:
                raise self._break(e) from None
        else:
            try:
                answer = recv_frame(self._sock, deadline)
            except ServiceError as e:
                raise self._break(e) from None
        if "error" in answer:
            raise self._break(_refusal(answer)) from None
        results = answer.get("results")
        if answer.get("seq") != self._seq or type(results) is not list or len(results) != len(ops):
            raise self._break(ServiceProtocolError(f"the node service answered call {self._seq} out of protocol: {str(answer)[:80]}"))
        return results

    def note(self, ops: list[dict], deadline: float | None = None) -> None:
        """``ops`` in one frame the service does not answer, sent within the lookup deadline (or ``deadline``)."""
        self._check()
        self._seq += 1
        deadline = time.monotonic() + self.lookup_deadline_s if deadline is None else deadline
        try:
            send_frame(self._sock, {"seq": self._seq, "ops": ops, "note": True}, deadline)
        except ServiceError as e:
            answer = self._last_words(deadline)
            raise self._break(_refusal(answer) if answer is not None and "error" in answer else e) from None

    def _last_words(self, deadline: float) -> dict | None:
        """The frame a service that closed the connection sent before closing it (a refusal), if any: it
        is in the socket already, so what is left of the call's deadline is enough (a send that timed
        out leaves none: nothing is waited for then)."""
        try:
            return recv_frame(self._sock, deadline)
        except ServiceError:
            return None

    def hung_up(self) -> bool:
        """Whether the service closed this connection (it exited, or dropped this engine), seen without reading
        or waiting: a heartbeat's check between calls. A broken or closed client is hung up."""
        if self._broken is not None:
            return True
        poller = select.poll()
        poller.register(self._sock, select.POLLRDHUP)
        return any(events & (select.POLLRDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL) for _fd, events in poller.poll(0))

    def _check(self) -> None:
        if self._broken is not None:
            raise ServiceError(f"the connection to the node service is unusable ({self._broken}); attach a new client")

    def _break(self, error: ServiceError) -> ServiceError:
        self._broken = str(error)
        self._sock.close()
        return error

    # ---- the ops ---------------------------------------------------------------------------------
    def lookup(self, keys: list[bytes], names: list[str] | None = None) -> list[int]:
        """The service's leading run of ``keys``; a service with an L3 tier may take up to half the lookup
        deadline to fetch the rest of the run from L3 into its region (:data:`LOOKUP_WAIT_SHARE`). ``names``: the
        keys' L3 object names, from an engine that names its objects (:class:`~kvtier.service.messages.Lookup`)."""
        return self._checked_pages(self._lookup_split(keys, names, time.monotonic() + self.lookup_deadline_s), len(keys), "lookup")

    def lookup_many(self, runs: list[list[bytes]]) -> list[list[int]]:
        """The service's leading run of each of ``runs``, as :meth:`lookup` each, all within one lookup
        deadline and in as few round trips as a frame's bounds allow: one for a scheduler step's requests
        of ordinary length. The runs are asked in order, so a key two runs share is found by the first
        only (the service stops a run at a page this client holds): give each key once. Pages are checked
        as a lookup's, and distinct across the runs."""
        deadline = time.monotonic() + self.lookup_deadline_s
        found: list[list[int]] = [[] for _ in runs]
        todo = [(i, 0) for i, run in enumerate(runs) if run]  # (run, where its next chunk starts)
        while todo:
            ops, chunks, later = [], [], []
            used, pages = 0, 0
            wait_s = min(max(deadline - time.monotonic(), 0.0) * LOOKUP_WAIT_SHARE, MAX_WAIT_S)
            for i, start in todo:
                n, size = _fitting(runs[i], start, SPLIT_BYTES - used - _OP_BYTES, MAX_PAGES - pages)
                if n == 0 or len(ops) == MAX_OPS:
                    later.append((i, start))  # no room left in this frame
                    continue
                chunk = runs[i][start : start + n]
                ops.append(Lookup(keys=chunk, wait_s=wait_s).wire())
                chunks.append((i, start, n))
                used += _OP_BYTES + size
                pages += n
            if not ops:  # (a key longer than a frame: none is)
                break
            self.lookup_round_trips += 1
            for (i, start, n), got in zip(chunks, self._call(ops, deadline)):
                got = self._checked_pages(got, n, "lookup")
                found[i] += got
                if len(got) == n and start + n < len(runs[i]):  # whole: the run goes on in the next frame
                    later.append((i, start + n))
            todo = sorted(later)  # (in the runs' order again)
        every = [p for pages in found for p in pages]
        if len(set(every)) != len(every):
            raise self._break(ServiceProtocolError("the node service named a page in two runs of one step's lookups"))
        return found

    def reserve(self, n: int, pool: int = 0) -> list[int]:
        """Up to ``n`` pages to write (leased to this client), of ``pool`` (0: the region's pages; k: its k-th object
        pool, whose ids are ``k * num_pages`` on)."""
        return self._checked_pages(self._reserve_split(n, pool, time.monotonic() + self.lookup_deadline_s), n, "reservation", pool)

    def find(self, keys: list[bytes], pool: int, names: list[str] | None = None) -> list[int]:
        """Each of ``keys`` the service holds in object pool ``pool``: its page (region-wide, now held for this client),
        or -1; in as many frames as ``keys`` need, within one lookup deadline. A service with an L3 tier may take up to
        half of it to fetch from L3 what its region misses (:data:`LOOKUP_WAIT_SHARE`). ``names``: the keys' L3 object
        names, from an engine that names its objects (:meth:`lookup`'s)."""
        deadline = time.monotonic() + self.lookup_deadline_s
        found: list[int] = []
        for part in _spans(_wire_sizes(keys, names)):
            chunk = keys[part]
            self.lookup_round_trips += 1
            wait_s = min(max(deadline - time.monotonic(), 0.0) * LOOKUP_WAIT_SHARE, MAX_WAIT_S)
            find = Find(keys=chunk, pool=pool, wait_s=wait_s, names=None if names is None else names[part])
            got = self._call([find.wire()], deadline)[0]
            try:
                found += check_found(got, len(chunk), self.num_pages, pool)
            except ServiceProtocolError as e:
                raise self._break(e) from None
        every = [p for p in found if p >= 0]
        if len(set(every)) != len(every):
            raise self._break(ServiceProtocolError("the node service's find named a page twice"))
        return found

    def _checked_pages(self, pages: object, at_most: int, what: str, pool: int = 0) -> list[int]:
        try:
            return check_pages(pages, at_most, self.num_pages, what, pool * self.num_pages)
        except ServiceProtocolError as e:
            raise self._break(e) from None

    def publish(self, pages: list[int], keys: list[bytes], names: list[str] | None = None, owners: list[int] | None = None) -> None:
        """``pages`` written under ``keys`` (their L3 objects ``names``, where the engine names them; ``owners``: each page's
        tenant, :func:`~kvtier.service.tenants.owner_id`, where the engine accounts tenants)."""
        self._notes_split(pages, keys, names, owners, lambda p, k, n, o: [Publish(pages=p, keys=k, names=n, owners=o)], 1)

    def release(self, pages: list[int]) -> None:
        self._notes_split(pages, None, None, None, lambda p, _k, _n, _o: [Release(pages=p)], 1)

    def publish_and_release(self, pages: list[int], keys: list[bytes], names: list[str] | None = None,
                            owners: list[int] | None = None) -> None:
        """:meth:`publish`, and ``pages`` no longer held by this client (the service may evict them)."""
        self._notes_split(pages, keys, names, owners, lambda p, k, n, o: [Publish(pages=p, keys=k, names=n, owners=o), Release(pages=p)], 2)

    # ---- calls longer than one frame (the service's bounds: wire.MAX_FRAME, messages.MAX_PAGES) --------------
    def _lookup_split(self, keys: list[bytes], names: list[str] | None, deadline: float) -> list[int]:
        """A lookup chunk by chunk within ``deadline``: the next chunk is asked only when this one's run was
        whole (the keys are chained: a run never resumes after a miss); each chunk's pages are held as any
        lookup's. Each chunk may wait for L3 a share of what is left of the deadline."""
        run: list[int] = []
        for part in _spans(_wire_sizes(keys, names)):
            wait_s = min(max(deadline - time.monotonic(), 0.0) * LOOKUP_WAIT_SHARE, MAX_WAIT_S)
            chunk = keys[part]
            self.lookup_round_trips += 1
            op = Lookup(keys=chunk, wait_s=wait_s, names=None if names is None else names[part])
            got = self._checked_pages(self._call([op.wire()], deadline)[0], len(chunk), "lookup")
            run += got
            if len(got) < len(chunk):
                break
        return run

    def _reserve_split(self, n: int, pool: int, deadline: float) -> list[int]:
        """Up to ``n`` pages in reservations of at most :data:`MAX_PAGES` each, until one gets fewer than it asked."""
        pages: list[int] = []
        while True:
            ask = min(n - len(pages), MAX_PAGES)
            got = self._checked_pages(self._call([Reserve(n=ask, pool=pool).wire()], deadline)[0], ask, "reservation", pool)
            pages += got
            if len(got) < ask or len(pages) >= n:
                return pages

    def _notes_split(self, pages: list[int], keys: list[bytes] | None, names: list[str] | None, owners: list[int] | None,
                     ops: Callable[[list[int], list[bytes] | None, list[str] | None, list[int] | None], list[Message]],
                     times: int) -> None:
        """Notes of ``ops(pages[span], keys[span], names[span], owners[span])`` (which name each page ``times`` times) over
        spans of ``pages`` that each fit a frame, all sent within one lookup deadline."""
        deadline = time.monotonic() + self.lookup_deadline_s
        named = [0] * len(pages) if keys is None else _wire_sizes(keys, names)
        owned = OWNER_WIRE_BYTES if owners is not None else 0
        sizes = [times * (len(str(p)) + 1) + named[i] + owned for i, p in enumerate(pages)]

        def span(values, part):
            return None if values is None else values[part]

        for part in _spans(sizes, MAX_PAGES // times):
            self.note([op.wire() for op in ops(pages[part], span(keys, part), span(names, part), span(owners, part))], deadline)

    def status(self) -> dict:
        (status,) = self.call([Status().wire()])
        if type(status) is not dict:
            raise self._break(ServiceProtocolError(f"the node service answered status with {_show(status)}, not an object"))
        return status

    def close(self, *, quiesced: bool = True) -> None:
        """Detach. ``quiesced`` (nothing in flight touches this client's pages, and nothing will read
        them): the service releases what it holds and drops what it was writing now; otherwise it keeps
        them out of circulation until this process exits or reattaches naming :attr:`session`."""
        if self._broken is None:
            if quiesced:
                try:
                    self.note([Bye().wire()])
                except ServiceError:
                    pass
            self._broken = "closed"
            self._sock.close()


class SessionWriter:
    """This process joined ``session`` (another process's attachment) as one that copies into its pages: a
    vLLM worker of the engine whose scheduler holds ``session``. While this connection is open the service
    keeps what ``session`` holds out of circulation, even once ``session``'s own process is gone; close it
    when no copy of this process touches those pages any more. Connect and join within ``deadline_s``
    (default: :data:`DEFAULT_LOOKUP_DEADLINE_S`, a vLLM worker joins on its step's path). The service is
    checked as :class:`ServiceClient` checks it (``service_uid``: the same); :attr:`trust` is what was found."""

    def __init__(self, socket_path: str, session: str, deadline_s: float | None = None, service_uid: int | None = None):
        deadline_s = DEFAULT_LOOKUP_DEADLINE_S if deadline_s is None else deadline_s
        self.session = session
        self._sock, self.trust = _connect(socket_path, deadline_s, service_uid)
        deadline = time.monotonic() + deadline_s
        try:
            send_frame(self._sock, {"seq": 1, "ops": [Join(session=session).wire()]}, deadline)
            answer = recv_frame(self._sock, deadline)
        except ServiceError:
            self._sock.close()
            raise
        if "error" in answer or answer.get("results") != [{"session": session}]:
            self._sock.close()
            raise _refusal(answer) if "error" in answer else ServiceProtocolError(f"the node service answered join out of protocol: "
                                                                                 f"{str(answer)[:80]}")

    def close(self) -> None:
        """No copy of this process writes into the session's pages any more (its end says so too)."""
        self._sock.close()


#: a lookup op's bytes on the wire besides its keys (its name, wait_s, separators)
_OP_BYTES = 64


def _fitting(keys: list[bytes], start: int, room: int, pages: int) -> tuple[int, int]:
    """How many of ``keys[start:]`` fit ``room`` bytes and ``pages`` pages of a frame, and their bytes on the wire."""
    n, used = 0, 0
    for k in keys[start : start + max(pages, 0)]:
        size = 2 * len(k) + 3
        if used + size > room:
            break
        n, used = n + 1, used + size
    return n, used


#: an owner label's bytes on the wire, at most (16 hex digits, quoted, and a comma)
OWNER_WIRE_BYTES = 16 + 3


def _wire_sizes(keys: list[bytes], names: list[str] | None) -> list[int]:
    """Each key's bytes on the wire, with its object name where given (as JSON writes it: escapes included)."""
    sizes = [2 * len(k) + 3 for k in keys]
    if names is not None:
        sizes = [size + len(json.dumps(name)) + 1 for size, name in zip(sizes, names)]
    return sizes


def _spans(sizes: list[int], items: int = MAX_PAGES) -> list[slice]:
    """``sizes`` (each item's bytes on the wire) cut into consecutive spans of at most :data:`SPLIT_BYTES` bytes
    and ``items`` items (one span, maybe empty, when all fit)."""
    spans, start, used = [], 0, 0
    for i, size in enumerate(sizes):
        if i > start and (used + size > SPLIT_BYTES or i - start >= items):
            spans.append(slice(start, i))
            start, used = i, 0
        used += size
    spans.append(slice(start, len(sizes)))
    return spans


def _connect(socket_path: str, timeout_s: float, service_uid: int | None = None) -> tuple[socket.socket, ServiceTrust]:
    """A connection to the service at ``socket_path``, made only through a socket directory of the service's
    uid that nobody else can write into, to a listener of that uid (:mod:`kvtier.service.peer`); with the
    :class:`~kvtier.service.peer.ServiceTrust` found."""
    trust = check_socket_dir(socket_path, service_uid)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)  # (a stalled service's full backlog makes a connect wait)
    try:
        sock.connect(socket_path)
        check_listener(sock, socket_path, trust)
    except ServiceError:
        sock.close()
        raise
    except PermissionError as e:
        sock.close()
        raise ServiceAccessError(f"the node service's socket {socket_path} is not open to this process ({e.strerror or e}): run the "
                                 "engine as the service's user, or as a member of the group kvtier serve --allow-group names") from None
    except OSError as e:
        sock.close()
        raise ServiceUnavailableError(f"no node service listens on {socket_path} ({e.strerror or e}); start one with kvtier serve"
                                      ) from None
    return sock, trust


def _refusal(answer: dict) -> ServiceError:
    """The typed error of the service's refusal frame."""
    err = answer["error"] if type(answer["error"]) is dict else {}
    return _ERRORS.get(err.get("type"), ServiceError)(f"the node service refused: {err.get('message', answer['error'])}")


def query_status(socket_path: str, deadline_s: float = DEFAULT_DEADLINE_S, service_uid: int | None = None) -> dict:
    """The service's status, asked without attaching (no namespace, no region); the service checked as
    :class:`ServiceClient` checks it (``service_uid``: the same)."""
    deadline = time.monotonic() + deadline_s
    sock, _trust = _connect(socket_path, deadline_s, service_uid)
    try:
        send_frame(sock, {"seq": 1, "ops": [Status().wire()]}, deadline)
        answer = recv_frame(sock, deadline)
    finally:
        sock.close()
    if "error" in answer:
        raise ServiceError(f"the node service refused: {_show(answer['error'])}")
    results = answer.get("results")
    if type(results) is not list or len(results) != 1 or type(results[0]) is not dict:
        raise ServiceProtocolError(f"the node service answered status out of protocol: {_show(answer)}")
    return results[0]


def _show(value: object) -> str:
    """A value from the service, short enough for a message."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
