"""What crosses the node service's socket, as typed messages: every field a peer sends is checked here,
before the service acts on it, and a bad one is a :class:`~kvtier.errors.ServiceProtocolError` naming it.

A request frame is ``{"seq": n, "ops": [op, ...]}``: a batch, answered by one frame
``{"seq": n, "results": [one per op]}`` (one round trip for a scheduler step's lookups, reservations
and releases). ``"note": true`` marks a batch that wants no answer (publish, release: nothing waits on
them). A refused batch is answered ``{"seq": n, "error": {"type": ..., "message": ...}}`` and the
connection is closed. The first op of a connection is ``hello`` (its answer names the connection's
session) or ``join`` (the connection's process writes into another connection's session's pages: a
vLLM worker of that scheduler's engine); ``bye`` detaches quiesced. Page keys travel as hex.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.errors import ServiceProtocolError

#: the protocol's version (a hello of another is refused)
VERSION = 1
#: bounds on what one op may name (checked before anything is built from it)
MAX_OPS = 4096
MAX_PAGES = 1 << 20
MAX_KEY_BYTES = 64
MAX_NAMESPACE = 1024
MAX_SESSION = 64
#: the longest a lookup may ask the service to wait for pages it fetches from its L3 tier (seconds)
MAX_WAIT_S = 10.0


@dataclass(frozen=True, slots=True)
class Hello:
    """Attach in ``namespace`` for pages of ``format``. ``previous``: a session of this process the service
    dropped, now quiesced -- its pages are out of this process's tree and no copy touches them -- so the
    service may free them (:mod:`kvtier.service.server`'s orphaned sessions)."""

    namespace: str
    format: dict
    previous: str | None = None


@dataclass(frozen=True, slots=True)
class Join:
    """This connection's process copies into the pages of ``session`` (another process's attachment: a
    vLLM worker of that scheduler's engine). While it is connected, what ``session`` holds stays out of
    circulation even after ``session``'s own connection ended and its process exited: a copy of this
    process may still be writing into those pages. Its ``bye`` or its end (the kernel closes a dead
    process's socket) says it no longer writes."""

    session: str


@dataclass(frozen=True, slots=True)
class Lookup:
    """The leading run of ``keys`` the service holds in the caller's namespace: their pages, now held for it.
    ``wait_s``: how long a service with an L3 tier may hold the answer back while it fetches the keys after
    the run from L3 (0: answer at once; what it fetches is found by the next lookup)."""

    keys: list[bytes]
    wait_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Reserve:
    """Up to ``n`` pages for the caller to write (leased: nobody else is offered them)."""

    n: int


@dataclass(frozen=True, slots=True)
class Publish:
    """The caller's writes into ``pages`` are complete: each holds page ``keys[i]`` now."""

    pages: list[int]
    keys: list[bytes]


@dataclass(frozen=True, slots=True)
class Release:
    """The caller is done with ``pages`` (held or leased for writing)."""

    pages: list[int]


@dataclass(frozen=True, slots=True)
class Status:
    pass


@dataclass(frozen=True, slots=True)
class Bye:
    """The caller detaches quiesced (nothing in flight touches its pages): free its leases and holds now."""


Op = Hello | Join | Lookup | Reserve | Publish | Release | Status | Bye


@dataclass(frozen=True, slots=True)
class Batch:
    seq: int
    ops: list[Op]
    note: bool


def parse_batch(frame: dict) -> Batch:
    seq = frame.get("seq")
    ops = frame.get("ops")
    note = frame.get("note", False)
    if type(seq) is not int or not 0 <= seq < 1 << 53:
        raise ServiceProtocolError(f"a frame's seq must be an integer >= 0, got {_show(seq)}")
    if type(ops) is not list or not 0 < len(ops) <= MAX_OPS:
        raise ServiceProtocolError(f"a frame's ops must be a list of 1 to {MAX_OPS} ops, got {_show(ops)}")
    if type(note) is not bool:
        raise ServiceProtocolError(f"a frame's note must be true or false, got {_show(note)}")
    return Batch(seq, [parse_op(op) for op in ops], note)


def parse_op(op: object) -> Op:
    if type(op) is not dict:
        raise ServiceProtocolError(f"an op must be a JSON object, got {_show(op)}")
    kind = op.get("op")
    if kind == "hello":
        if op.get("version") != VERSION:
            raise ServiceProtocolError(f"hello speaks protocol version {_show(op.get('version'))}; this service speaks {VERSION}")
        namespace, fmt = op.get("namespace"), op.get("format")
        if type(namespace) is not str or not 0 < len(namespace) <= MAX_NAMESPACE:
            raise ServiceProtocolError(f"hello's namespace must be a string of 1 to {MAX_NAMESPACE} characters, got {_show(namespace)}")
        if type(fmt) is not dict:
            raise ServiceProtocolError(f"hello's format must be an object, got {_show(fmt)}")
        previous = op.get("previous")
        if previous is not None and (type(previous) is not str or not 0 < len(previous) <= MAX_SESSION):
            raise ServiceProtocolError(f"hello's previous must be a session id (a string of 1 to {MAX_SESSION} characters), got "
                                       f"{_show(previous)}")
        return Hello(namespace, fmt, previous)
    if kind == "join":
        session = op.get("session")
        if type(session) is not str or not 0 < len(session) <= MAX_SESSION:
            raise ServiceProtocolError(f"join's session must be a session id (a string of 1 to {MAX_SESSION} characters), got "
                                       f"{_show(session)}")
        return Join(session)
    if kind == "lookup":
        wait_s = op.get("wait_s", 0.0)
        if type(wait_s) not in (int, float) or not 0 <= wait_s <= MAX_WAIT_S:
            raise ServiceProtocolError(f"lookup's wait_s must be a number of seconds from 0 to {MAX_WAIT_S:g}, got {_show(wait_s)}")
        return Lookup(_keys(op, "keys"), float(wait_s))
    if kind == "reserve":
        n = op.get("n")
        if type(n) is not int or not 0 <= n <= MAX_PAGES:
            raise ServiceProtocolError(f"reserve's n must be an integer from 0 to {MAX_PAGES}, got {_show(n)}")
        return Reserve(n)
    if kind == "publish":
        pages, keys = _pages(op, "pages"), _keys(op, "keys")
        if len(pages) != len(keys):
            raise ServiceProtocolError(f"publish names {len(pages)} pages and {len(keys)} keys; give one key per page")
        return Publish(pages, keys)
    if kind == "release":
        return Release(_pages(op, "pages"))
    if kind == "status":
        return Status()
    if kind == "bye":
        return Bye()
    raise ServiceProtocolError(f"unknown message type {_show(kind)}; known: hello, join, lookup, reserve, publish, release, status, bye")


def _pages(op: dict, name: str) -> list[int]:
    pages = op.get(name)
    if type(pages) is not list or len(pages) > MAX_PAGES or any(type(p) is not int for p in pages):
        raise ServiceProtocolError(f"{op['op']}'s {name} must be a list of at most {MAX_PAGES} integer page ids, got {_show(pages)}")
    return pages


def _keys(op: dict, name: str) -> list[bytes]:
    keys = op.get(name)
    if type(keys) is not list or len(keys) > MAX_PAGES:
        raise ServiceProtocolError(f"{op['op']}'s {name} must be a list of at most {MAX_PAGES} hex page keys, got {_show(keys)}")
    out = []
    for k in keys:
        try:
            key = bytes.fromhex(k) if type(k) is str and len(k) <= 2 * MAX_KEY_BYTES else None
        except ValueError:
            key = None
        if not key:
            raise ServiceProtocolError(f"{op['op']}'s {name}: {_show(k)} is not a page key (1 to {MAX_KEY_BYTES} bytes in hex)")
        out.append(key)
    return out


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---- the client's side: ops as the frames carry them ----------------------------------------------
def hello_op(namespace: str, fmt: dict, previous: str | None = None) -> dict:
    op = {"op": "hello", "version": VERSION, "namespace": namespace, "format": fmt}
    if previous is not None:
        op["previous"] = previous
    return op


def join_op(session: str) -> dict:
    return {"op": "join", "session": session}


def lookup_op(keys: list[bytes], wait_s: float = 0.0) -> dict:
    return {"op": "lookup", "keys": [k.hex() for k in keys], "wait_s": wait_s}


def reserve_op(n: int) -> dict:
    return {"op": "reserve", "n": n}


def publish_op(pages: list[int], keys: list[bytes]) -> dict:
    return {"op": "publish", "pages": list(pages), "keys": [k.hex() for k in keys]}


def release_op(pages: list[int]) -> dict:
    return {"op": "release", "pages": list(pages)}


STATUS_OP = {"op": "status"}
BYE_OP = {"op": "bye"}
