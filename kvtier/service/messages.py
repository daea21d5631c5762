"""What crosses the node service's socket, as typed messages: one definition per message, which the
service's parsing, the client's frames and the service's dispatch all read.

A message is a frozen dataclass registered under its wire name (:func:`message`); each field names its
:class:`Codec` -- how a peer's JSON value is checked into the typed value, and how the typed value is
written. :func:`parse_op` checks every field a peer sends before the service acts on it (a bad one is a
:class:`~kvtier.errors.ServiceProtocolError` naming it); ``Message.wire()`` is the op a client sends. The
service dispatches each message to its ``_on_<name>`` handler, and checks at import that every message
has one (:func:`check_handlers`).

A request frame is ``{"seq": n, "ops": [op, ...]}``: a batch, answered by one frame
``{"seq": n, "results": [one per op]}`` (one round trip for a scheduler step's lookups, reservations
and releases). ``"note": true`` marks a batch that wants no answer (publish, release: nothing waits on
them). A refused batch is answered ``{"seq": n, "error": {"type": ..., "message": ...}}`` and the
connection is closed. The first op of a connection is ``hello`` (its answer names the connection's
session) or ``join`` (the connection's process writes into another connection's session's pages: a
vLLM worker of that scheduler's engine); ``bye`` detaches quiesced. Page keys travel as hex.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import ClassVar

from kvtier.errors import ServiceProtocolError
from kvtier.hashing import name_key
from kvtier.service.tenants import WORDS, owner_id, owner_label

#: the protocol's version (a hello of another is refused)
VERSION = 1
#: bounds on what one op may name (checked before anything is built from it)
MAX_OPS = 4096
#: the most pages one batch may name or ask for, over all its ops (keys, page ids, a reservation's n): what
#: applying a frame costs the service's loop is bounded with its bytes (a client splits a longer call)
MAX_PAGES = 1 << 15
MAX_KEY_BYTES = 64
#: the longest name of a page's L3 object an engine may give (characters; SGLang's page hashes are 64)
MAX_OBJECT_NAME = 512
MAX_NAMESPACE = 1024
MAX_SESSION = 64
#: the largest share of the region a hello may name (pages; far beyond any host's memory)
MAX_SHARE = 1 << 40
#: the longest a lookup may ask the service to wait for pages it fetches from its L3 tier (seconds)
MAX_WAIT_S = 10.0


class Invalid(Exception):
    """A field's value is not one its codec takes; ``str(self)``, when given, replaces the generic words."""


@dataclass(frozen=True, slots=True)
class Codec:
    """How one field crosses the wire. ``parse`` takes what a peer sent and returns the typed value, or
    raises :class:`Invalid`; ``encode`` writes the typed value; ``expected`` says what the field must be."""

    expected: str
    parse: Callable[[object], object]
    encode: Callable[[object], object] = staticmethod(lambda v: v)
    #: how many pages the typed value names or asks for (counted against a batch's :data:`MAX_PAGES`)
    pages: Callable[[object], int] = staticmethod(lambda v: 0)


def wire(codec: Codec, default: object = dataclasses.MISSING) -> dataclasses.Field:
    """A message field carried by ``codec`` (``default``: the value when a peer leaves it out)."""
    return field(default=default, metadata={"codec": codec})


#: every message by its wire name
MESSAGES: dict[str, type[Message]] = {}


class Message:
    """One op of a batch. Subclasses are frozen, keyword-only dataclasses made by :func:`message`."""

    __slots__ = ()
    #: the op's wire name (``{"op": NAME, ...}``)
    NAME: ClassVar[str]
    #: whether the connection must have said hello first (its handler works in the caller's namespace)
    ATTACHED: ClassVar[bool]

    def wire(self) -> dict:
        """The op as a client sends it."""
        op = {"op": self.NAME}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                op[f.name] = f.metadata["codec"].encode(value)
        return op

    def check(self) -> None:
        """What no single field can say (several fields together); raises :class:`ServiceProtocolError`."""

    def page_count(self) -> int:
        """The pages the op names or asks for: its largest field's count (a publish's pages and keys are one set)."""
        return max((f.metadata["codec"].pages(getattr(self, f.name)) for f in dataclasses.fields(self)), default=0)


def message(name: str, *, attached: bool = True) -> Callable[[type], type]:
    """Register a message class under ``name`` as a frozen, keyword-only dataclass whose every field has a codec."""

    def register(cls: type) -> type:
        cls = dataclass(frozen=True, slots=True, kw_only=True)(cls)
        for f in dataclasses.fields(cls):
            if "codec" not in f.metadata:
                raise TypeError(f"message {name}'s field {f.name} names no codec (use wire(...))")
        cls.NAME, cls.ATTACHED = name, attached
        if name in MESSAGES:
            raise TypeError(f"two messages named {name}")
        MESSAGES[name] = cls
        return cls

    return register


# ---- the codecs ----------------------------------------------------------------------------------
def _text(limit: int) -> Codec:
    def parse(v: object) -> str:
        if type(v) is not str or not 0 < len(v) <= limit:
            raise Invalid
        try:
            v.encode()
        except UnicodeEncodeError:  # (a lone surrogate: valid JSON, not text anything downstream can write)
            raise Invalid(f"{_show(v)} is not valid UTF-8 text (a lone surrogate)") from None
        return v

    return Codec(f"a string of 1 to {limit} characters", parse)


def _optional(codec: Codec) -> Codec:
    return Codec(f"{codec.expected}, or absent", lambda v: None if v is None else codec.parse(v), codec.encode)


def _count(limit: int, pages: bool = False) -> Codec:
    def parse(v: object) -> int:
        if type(v) is not int or not 0 <= v <= limit:
            raise Invalid
        return v

    return Codec(f"an integer from 0 to {limit}", parse, pages=(lambda v: v) if pages else (lambda v: 0))


def _seconds(limit: float) -> Codec:
    def parse(v: object) -> float:
        if type(v) not in (int, float) or not 0 <= v <= limit:
            raise Invalid
        return float(v)

    return Codec(f"a number of seconds from 0 to {limit:g}", parse)


def _object(v: object) -> dict:
    if type(v) is not dict:
        raise Invalid
    return v


def _version(v: object) -> int:
    if v != VERSION:
        raise ServiceProtocolError(f"hello speaks protocol version {_show(v)}; this service speaks {VERSION}")
    return v


def _page_ids(v: object) -> list[int]:
    if type(v) is not list or len(v) > MAX_PAGES or any(type(p) is not int for p in v):
        raise Invalid
    return v


def _page_keys(v: object) -> list[bytes]:
    if type(v) is not list or len(v) > MAX_PAGES:
        raise Invalid
    out = []
    for k in v:
        try:
            key = bytes.fromhex(k) if type(k) is str and len(k) <= 2 * MAX_KEY_BYTES else None
        except ValueError:
            key = None
        if not key:
            raise Invalid(f"{_show(k)} is not a page key (1 to {MAX_KEY_BYTES} bytes in hex)")
        out.append(key)
    return out


def _object_names(v: object) -> list[str]:
    if type(v) is not list or len(v) > MAX_PAGES:
        raise Invalid
    parse = _text(MAX_OBJECT_NAME).parse
    for name in v:
        try:
            parse(name)
            if "/" in name:  # (a store splits a name at its last "/": the part before would be a namespace of the engine's making)
                raise Invalid
        except Invalid:
            raise Invalid(f"{_show(name)} is not an object name (a string of 1 to {MAX_OBJECT_NAME} characters of UTF-8 text, "
                          "no '/')") from None
    return v


def _owners(v: object) -> list[int]:
    if type(v) is not list or len(v) > MAX_PAGES:
        raise Invalid
    out = []
    for label in v:
        try:
            out.append(owner_id(label))
        except ValueError:
            raise Invalid(f"{_show(label)} is not an owner label (16 lowercase hex digits, or one of {', '.join(WORDS)})") from None
    return out


def check_object_names(names: list[str] | None, keys: list[bytes], op: str,
                       key_of: Callable[[int, str], bytes] | None = lambda _i, name: name_key(name)) -> None:
    """An op's object names, where it gives them: one per key, each the name its key is the digest of (an engine
    names its L3 objects itself -- SGLang by its page hashes -- and its page keys are their xxh3-128 digests;
    ``key_of(i, name)``: the ``i``-th key's where it is not that, as in an object pool; None: the count alone, the
    keys checked where the pools are known)."""
    if names is None:
        return
    if len(names) != len(keys):
        raise ServiceProtocolError(f"{op} names {len(keys)} keys and {len(names)} objects; give one object name per key, or none")
    for i, (name, key) in enumerate(zip(names, keys)) if key_of is not None else ():
        if key_of(i, name) != key:
            raise ServiceProtocolError(f"{op}'s object name {_show(name)} is not the one its key {key.hex()} is the digest of")


def _printable(codec: Codec) -> Codec:
    """``codec``'s text with no control character (a namespace goes into the service's logs, ``--status`` and labels:
    a newline or a terminal escape there would forge an operator's view; kvtier's own namespaces are percent-encoded)."""

    def parse(v: object) -> str:
        text = codec.parse(v)
        bad = next((c for c in text if ord(c) < 32 or 127 <= ord(c) < 160), None)
        if bad is not None:
            raise Invalid(f"{_show(text)} holds a control character ({ord(bad):#04x}); percent-encode it, as kvtier's namespaces are")
        return text

    return Codec(f"{codec.expected}, without control characters", parse)


NAMESPACE = _printable(_text(MAX_NAMESPACE))
SESSION = Codec(f"a session id (a string of 1 to {MAX_SESSION} characters)", _text(MAX_SESSION).parse)
PAGE_IDS = Codec(f"a list of at most {MAX_PAGES} integer page ids", _page_ids, list, len)
PAGE_KEYS = Codec(f"a list of at most {MAX_PAGES} hex page keys", _page_keys, lambda keys: [k.hex() for k in keys], len)
OBJECT_NAMES = Codec(f"a list of at most {MAX_PAGES} object names, or absent", lambda v: None if v is None else _object_names(v))
OWNERS = Codec(f"a list of at most {MAX_PAGES} owner labels (16 hex digits, or {', '.join(WORDS)}), or absent",
               lambda v: None if v is None else _owners(v), lambda owners: [owner_label(o) for o in owners])


# ---- the messages --------------------------------------------------------------------------------
@message("hello", attached=False)
class Hello(Message):
    """Attach in ``namespace`` for pages of ``format`` (a :class:`~kvtier.service.region.RegionFormat`'s
    wire form). ``previous``: a session of this process the service dropped, now quiesced -- its pages
    are out of this process's tree and no copy touches them -- so the service may free them
    (:mod:`kvtier.service.sessions`' orphans). ``share``: how many of the region's pages the engine means to
    hold at once (its host tier's size; absent: as many as the region has), for the operator's per-engine view."""

    version: int = wire(Codec(f"protocol version {VERSION}", _version), VERSION)
    namespace: str = wire(NAMESPACE)
    format: dict = wire(Codec("an object", _object))
    previous: str | None = wire(_optional(SESSION), None)
    share: int | None = wire(_optional(_count(MAX_SHARE)), None)


@message("join", attached=False)
class Join(Message):
    """This connection's process copies into the pages of ``session`` (another process's attachment: a
    vLLM worker of that scheduler's engine). While it is connected, what ``session`` holds stays out of
    circulation even after ``session``'s own connection ended and its process exited: a copy of this
    process may still be writing into those pages. Its ``bye`` or its end (the kernel closes a dead
    process's socket) says it no longer writes."""

    session: str = wire(SESSION)


@message("lookup")
class Lookup(Message):
    """The leading run of ``keys`` the service holds in the caller's namespace: their pages, now held for it.
    ``wait_s``: how long a service with an L3 tier may hold the answer back while it fetches the keys after
    the run from L3 (0: answer at once; what it fetches is found by the next lookup). ``names``: the keys' L3
    object names, from an engine that names its objects itself (SGLang's page hashes; each key their digest): a
    service with L3 fetches pages of such an engine only where they are given."""

    keys: list[bytes] = wire(PAGE_KEYS)
    wait_s: float = wire(_seconds(MAX_WAIT_S), 0.0)
    names: list[str] | None = wire(OBJECT_NAMES, None)

    def check(self) -> None:
        check_object_names(self.names, self.keys, "lookup")


#: the most pools a region holds (its pages, and a hybrid model's object pools: :mod:`kvtier.service.region`)
MAX_POOLS = 9


@message("reserve")
class Reserve(Message):
    """Up to ``n`` pages for the caller to write (leased: nobody else is offered them), of pool ``pool`` (0: the
    region's pages; k: its k-th object pool, a hybrid model's group: :meth:`RegionFormat.with_objects
    <kvtier.service.region.RegionFormat.with_objects>`). Every pool's ids are region-wide: pool ``k``'s are
    ``k * num_pages`` to ``(k + 1) * num_pages - 1``, so the other ops name a page alone."""

    n: int = wire(_count(MAX_PAGES, pages=True))
    pool: int = wire(_count(MAX_POOLS - 1), 0)


@message("find")
class Find(Message):
    """Each of ``keys`` the service holds in the caller's namespace in pool ``pool`` (a hybrid model's objects: a window
    page, a state snapshot, under their :func:`~kvtier.hashing.group_object_key`): its page, now held for the caller,
    or -1 -- every key on its own, not a leading run (a boundary reads some objects of a prefix, not all)."""

    keys: list[bytes] = wire(PAGE_KEYS)
    pool: int = wire(_count(MAX_POOLS - 1), 0)
    #: how long a service with an L3 tier may hold the answer back while it fetches the keys it misses (:class:`Lookup`'s)
    wait_s: float = wire(_seconds(MAX_WAIT_S), 0.0)
    #: the keys' L3 object names, from an engine that names its objects (:class:`Lookup`'s; an object pool's key is its
    #: name's group key: :meth:`RegionFormat.key_of <kvtier.service.region.RegionFormat.key_of>`, checked by the service)
    names: list[str] | None = wire(OBJECT_NAMES, None)

    def check(self) -> None:
        check_object_names(self.names, self.keys, "find", None)


@message("publish")
class Publish(Message):
    """The caller's writes into ``pages`` are complete: each holds page ``keys[i]`` now. ``names``: their L3 object
    names (:class:`Lookup`'s): a service with L3 saves pages of an engine that names its objects only where given."""

    pages: list[int] = wire(PAGE_IDS)
    keys: list[bytes] = wire(PAGE_KEYS)
    names: list[str] | None = wire(OBJECT_NAMES, None)
    #: each page's tenant (its engine's label for it: :mod:`kvtier.service.tenants`), where the engine accounts tenants
    owners: list[int] | None = wire(OWNERS, None)

    def check(self) -> None:
        if len(self.pages) != len(self.keys):
            raise ServiceProtocolError(f"publish names {len(self.pages)} pages and {len(self.keys)} keys; give one key per page")
        if self.owners is not None and len(self.owners) != len(self.pages):
            raise ServiceProtocolError(f"publish names {len(self.pages)} pages and {len(self.owners)} owners; give one owner per "
                                       "page, or none")
        check_object_names(self.names, self.keys, "publish", None)  # (the keys against their pools' by the service)


@message("release")
class Release(Message):
    """The caller is done with ``pages`` (held or leased for writing)."""

    pages: list[int] = wire(PAGE_IDS)


@message("status", attached=False)
class Status(Message):
    """The service's state (what ``kvtier serve --status`` prints); asked with or without attaching."""


@message("bye", attached=False)
class Bye(Message):
    """The caller detaches quiesced (nothing in flight touches its pages): free its leases and holds now."""


@dataclass(frozen=True, slots=True)
class Batch:
    seq: int
    ops: list[Message]
    note: bool
    #: the pages its ops name or ask for, together (at most :data:`MAX_PAGES`)
    pages: int


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
    parsed = [parse_op(op) for op in ops]
    pages = sum(op.page_count() for op in parsed)
    if pages > MAX_PAGES:
        raise ServiceProtocolError(f"a batch names {pages} pages; at most {MAX_PAGES} a batch (split the call: a kvtier client does)")
    return Batch(seq, parsed, note, pages)


def parse_op(op: object) -> Message:
    """The typed message of one op a peer sent, every field checked by its codec."""
    if type(op) is not dict:
        raise ServiceProtocolError(f"an op must be a JSON object, got {_show(op)}")
    cls = MESSAGES.get(op.get("op"))  # type: ignore[arg-type]
    if cls is None:
        raise ServiceProtocolError(f"unknown message type {_show(op.get('op'))}; known: {', '.join(MESSAGES)}")
    values = {}
    for f in dataclasses.fields(cls):
        codec: Codec = f.metadata["codec"]
        value = op.get(f.name, dataclasses.MISSING)
        if value is dataclasses.MISSING and f.default is not dataclasses.MISSING:
            values[f.name] = f.default
            continue
        value = None if value is dataclasses.MISSING else value
        try:
            values[f.name] = codec.parse(value)
        except Invalid as e:
            what = f": {e}" if str(e) else f" must be {codec.expected}, got {_show(value)}"
            raise ServiceProtocolError(f"{cls.NAME}'s {f.name}{what}") from None
    msg = cls(**values)
    msg.check()
    return msg


def check_handlers(owner: type, prefix: str = "_on_", names: Iterable[str] | None = None) -> None:
    """Every message has a handler ``owner.<prefix><name>`` (checked when the owner's module is imported):
    a message added here without one fails at import, not on a peer's first use of it."""
    missing = [n for n in (MESSAGES if names is None else names) if not callable(getattr(owner, prefix + n, None))]
    if missing:
        raise TypeError(f"{owner.__name__} handles no {', '.join(missing)} (define {', '.join(prefix + n for n in missing)})")


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
