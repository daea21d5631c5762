"""Page keys: one 128-bit hash per full page, chained over the previous page's key.

``key[i] = H(key[i-1] || tokens[i*page_size:(i+1)*page_size] as little-endian int32)``
(int64 for a page holding an id outside int32: ids are hashed at full width, never wrapped)
with ``key[-1]`` the namespace root. Equal keys therefore mean equal prefixes
in the same namespace (model, spec fingerprint, TP rank, salt). The partial
tail page of a request never gets a key. Hashes are computed once per request
here, never inside pools or the tree.

The xxh3_128 chain runs in C (``kvtier._chainkeys``, one call per request) when
that extension was built at install; otherwise, and for blake3, in Python. Both
give the same bytes (tests check it); :data:`NATIVE_KEYS` says which one runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, NewType

from urllib.parse import quote, unquote

import numpy as np
import xxhash

from kvtier.errors import ConfigError, IndexTypeError, UnknownNameError

try:
    from kvtier._chainkeys import chain_xxh3_128 as _native_chain
except ImportError:  # built without a C compiler or xxhash.h: the Python loop below, same keys
    _native_chain = None

#: whether xxh3_128 keys are chained in C (the extension built at install) or in Python
NATIVE_KEYS = _native_chain is not None

PageHash = NewType("PageHash", bytes)
HashAlgo = Literal["xxh3_128", "blake3"]

KEY_BYTES = 16


def _blake3_16(data: bytes) -> bytes:
    import blake3

    return blake3.blake3(data).digest(KEY_BYTES)


_HASHERS: dict[str, Callable[[bytes], bytes]] = {
    "xxh3_128": xxhash.xxh3_128_digest,
    "blake3": _blake3_16,
}


def hasher(algo: str) -> Callable[[bytes], bytes]:
    try:
        return _HASHERS[algo]
    except KeyError:
        raise UnknownNameError("hash algorithm", algo, _HASHERS) from None


#: bytes of UTF-8 a namespace field may take (a file store keeps the whole namespace in one name)
MAX_FIELD_BYTES = 200


def _check_field(what: str, value: object) -> None:
    if not isinstance(value, str):
        raise ConfigError(f"namespace {what} must be a string, got {type(value).__name__}")
    try:
        raw = value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(f"namespace {what} {value!r} is not valid Unicode ({e.reason} at {e.start}); pass a plain text name") from None
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ConfigError(f"namespace {what} {value!r} contains a control character (NUL, newline, ...); pass a plain text name")
    if len(raw) > MAX_FIELD_BYTES:
        raise ConfigError(f"namespace {what} is {len(raw)} bytes of UTF-8; at most {MAX_FIELD_BYTES} are allowed (shorten it)")


def _escape(field: str) -> str:
    """Percent-encode everything but ``[A-Za-z0-9_.~]``: ``-`` (the separator), ``/`` and ``%`` included."""
    return quote(field, safe="").replace("-", "%2D")


def split_fingerprint(fingerprint: str, tp_size: int) -> str:
    """A rank's spec fingerprint with the tensor-parallel split it is a shard of: where TP exceeds the KV heads,
    ranks hold copies of a head, so one rank spec is a different head at another split (TP=4 rank 1 holds
    head 0 of 2, TP=2 rank 1 head 1): a rank's objects must name the split. Unchanged at TP=1."""
    return fingerprint if tp_size == 1 else f"{fingerprint}-tp{tp_size}"


@dataclass(frozen=True, slots=True)
class Namespace:
    """What must match for two pages to share bytes. Part of every page key and L3 key.

    ``str()`` is an unambiguous encoding: each text field is percent-encoded (``-``,
    ``/`` and ``%`` included) before the fields are joined with ``-``, so no choice of
    model name and salt can produce another namespace's string. It is still only a
    key prefix: backends that map it to a path encode it again (see :mod:`kvtier.l3.file`)."""

    model: str
    spec_fingerprint: str
    tp_rank: int = 0
    salt: str = ""

    def __post_init__(self) -> None:
        _check_field("model name", self.model)
        _check_field("spec fingerprint", self.spec_fingerprint)
        _check_field("salt", self.salt)
        if isinstance(self.tp_rank, bool) or not isinstance(self.tp_rank, int) or self.tp_rank < 0:
            raise ConfigError(f"namespace tp_rank must be an integer >= 0, got {self.tp_rank!r}")

    def __str__(self) -> str:
        tail = f"-{_escape(self.salt)}" if self.salt else ""
        return f"{_escape(self.model)}-{_escape(self.spec_fingerprint)}-tp{self.tp_rank}{tail}"

    def root(self, algo: str = "xxh3_128") -> PageHash:
        return PageHash(hasher(algo)(b"kvtier/v1|" + str(self).encode()))

    @classmethod
    def parse(cls, text: str) -> Namespace:
        """The namespace whose ``str()`` is ``text`` (which names it in one way only), or a :class:`ConfigError`."""
        parts = text.split("-") if isinstance(text, str) else []
        rank = parts[2][2:] if len(parts) in (3, 4) and parts[2].startswith("tp") else ""
        try:
            ns = cls(unquote(parts[0]), unquote(parts[1]), int(rank), unquote(parts[3]) if len(parts) == 4 else "") \
                if rank.isascii() and rank.isdigit() else None
        except ConfigError:
            ns = None
        if ns is None or str(ns) != text:
            raise ConfigError(f"{str(text)[:120]!r} is not a kvtier namespace (model-fingerprint-tpRANK[-salt], each field "
                              "percent-encoded)")
        return ns


def _scope_field(tag: bytes, kind: bytes, raw: bytes) -> bytes:
    """One field of a request's scope: tagged, its kind, length-prefixed (no two fields' bytes run into each other)."""
    return tag + kind + len(raw).to_bytes(8, "little") + raw


def request_scope(salt: object, lora: object = None) -> bytes:
    """What a request's tenant -- its salt (vLLM's ``cache_salt``; a library request's text ``tenant``, :func:`tenant_scope`)
    -- and LoRA adapter add to its keys' root: each field tagged and length-prefixed (a salt ``"a|b"`` and a
    salt ``"a"`` with adapter ``"b"`` never share a root); empty with neither. A salt is the client's text: any string
    (lone surrogates included: ``surrogatepass``, distinct from every valid string's bytes) or any other value (its type
    and repr) scopes the request, and never raises on an engine's thread."""
    out = b""
    for tag, value in ((b"salt", salt), (b"lora", lora)):
        if value is None or value == "":
            continue
        raw = value.encode("utf-8", "surrogatepass") if isinstance(value, str) else f"{type(value).__name__}:{value!r}".encode(
            "utf-8", "backslashreplace")
        out += _scope_field(tag, b"s" if isinstance(value, str) else b"o", raw)
    return out


#: what a scoped root's digest starts with: no page key's input does (a page's input starts with its parent key, a digest),
#: so no prompt can spell a tenant's root as one of its own pages and walk on into that tenant's chain
_SCOPE_DOMAIN = b"kvtier/tenant/v1|"


def scoped_root(root: PageHash, scope: bytes, hash_fn: Callable[[bytes], bytes]) -> PageHash:
    """The root of a request's page keys: the namespace's ``root``, or -- with a :func:`request_scope` -- a digest of the
    scope under it (``hash_fn``: the namespace's chain hash), domain-separated from the page chain's inputs, so two
    tenants' keys of one prompt never meet, in any tier, short of a collision of the hash."""
    return PageHash(hash_fn(_SCOPE_DOMAIN + root + scope)) if scope else root


def tenant_scope(tenant: object) -> bytes:
    """A library request's tenant as a :func:`request_scope` (text: the same scope as vLLM's ``cache_salt`` of that text;
    bytes and integers: canonical bytes, tagged apart from text); ``None`` or ``""``: the namespace's own scope (empty).
    Anything else is an :class:`~kvtier.errors.IndexTypeError`: a value scoped by its ``repr`` (an object's memory
    address, a tensor's elided middle) would let two tenants meet or one tenant miss its own pages."""
    if tenant is None or type(tenant) is str and tenant == "":
        return b""
    if isinstance(tenant, str):
        return request_scope(tenant)
    if isinstance(tenant, (bytes, bytearray, memoryview)):
        raw, kind = bytes(tenant), b"b"
    elif isinstance(tenant, int) and not isinstance(tenant, bool):
        raw, kind = int(tenant).to_bytes(tenant.bit_length() // 8 + 1, "little", signed=True), b"i"
    else:
        raise IndexTypeError(f"a tenant is a str, bytes or int (or None: the cache's own scope); got {type(tenant).__name__}: "
                             "give a stable id of the tenant, not an object")
    return _scope_field(b"salt", kind, raw)


#: owner tags of pages no tenant owns alone: the namespace's own (no tenant), a declared shared prefix's, and the
#: pages of tenants past a ledger's table (``kvtier.core.tenants.MAX_TENANTS``); a tenant's tag is above them
NAMESPACE_TAG, SHARED_TAG, OVERFLOW_TAG = 0, 1, 2
_WORD_TAGS = {"namespace": NAMESPACE_TAG, "shared": SHARED_TAG, "overflow": OVERFLOW_TAG}
_TAG_SPAN = (1 << 32) - (OVERFLOW_TAG + 1)


def owner_tag(label: str) -> int:
    """The 32-bit owner tag an L3 page object carries (:mod:`kvtier.l3.page`) for a tenants' ledger label
    (:attr:`kvtier.core.tenants.TenantLedger.labels`): its word's, or a tenant's digest (16 lowercase hex digits)
    reduced to the tags above the words'."""
    got = _WORD_TAGS.get(label)
    if got is not None:
        return got
    return OVERFLOW_TAG + 1 + int(label, 16) % _TAG_SPAN


def name_key(name: str) -> PageHash:
    """The 16-byte key of a page an engine names by a string of its own (SGLang's page hashes): its xxh3-128 -- the key in
    the page's L3 object header and in the node service's index."""
    return PageHash(xxhash.xxh3_128_digest(name.encode()))


_I32 = np.iinfo(np.int32)


def group_object_key(key: PageHash, group: str) -> PageHash:
    """The L3 key of KV group ``group``'s object for page ``key`` (a hybrid model's sliding-window
    page or state snapshot): 16 bytes, like a page key, distinct per group."""
    return xxhash.xxh3_128_digest(key + b"\x00group\x00" + group.encode())


def token_array(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a flat int64 array, or :class:`ConfigError` for anything else: floats (which
    would be truncated), nested lists, strings, or ids that do not fit in int64."""
    if isinstance(token_ids, np.ndarray):
        arr = token_ids
    else:
        try:
            arr = np.asarray(token_ids)
        except (ValueError, TypeError, OverflowError) as e:
            raise ConfigError(f"token ids must be a flat sequence of integers: {e}") from None
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1:
        raise ConfigError(f"token ids must be one flat sequence, got an array of shape {tuple(arr.shape)}")
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and int(arr.max()) > np.iinfo(np.int64).max:
        raise ConfigError(f"token id {int(arr.max())} does not fit in int64")
    if arr.dtype.kind not in "iu":
        if arr.dtype.kind == "O" and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in arr.tolist()):
            raise ConfigError(f"token ids must fit in int64; got {max(arr.tolist(), key=abs)}")
        raise ConfigError(f"token ids must be integers, got {arr.dtype} values (e.g. {arr.reshape(-1)[0]!r})")
    return arr.astype(np.int64, copy=False)


def page_keys(token_ids: Sequence[int] | np.ndarray, page_size: int, root: PageHash, algo: str = "xxh3_128") -> list[PageHash]:
    """Chained keys of the full pages of ``token_ids`` (the tail page is left out).

    A page is hashed as int32 little-endian when every id in it fits (the key format for real
    vocabularies), else as int64: every id at its full width, so ``2**32 + 1`` never aliases
    ``1``, and the two widths differ in length, so they never alias each other either."""
    arr = token_array(token_ids)
    if _native_chain is not None and algo == "xxh3_128":
        return _native_chain(root, np.ascontiguousarray(arr), page_size)
    return _python_page_keys(arr, page_size, root, hasher(algo))


def _python_page_keys(arr: np.ndarray, page_size: int, root: PageHash, h: Callable[[bytes], bytes]) -> list[PageHash]:
    """:func:`page_keys` in Python: the reference for the C chain, and the path for blake3."""
    full = len(arr) // page_size
    pages = arr[: full * page_size]
    keys: list[PageHash] = []
    prev = root
    if not full:
        return keys
    if pages.max() <= _I32.max and pages.min() >= _I32.min:  # one check for the whole request: the common case
        b4, s4 = pages.astype("<i4").tobytes(), page_size * 4
        # a comprehension with the chain carried in ``prev``: no per-page method calls
        return [prev := h(prev + b4[o : o + s4]) for o in range(0, full * s4, s4)]  # type: ignore[return-value]
    rows = pages.reshape(full, page_size)
    wide = ((rows.max(axis=1) > _I32.max) | (rows.min(axis=1) < _I32.min)).tolist()
    b8, s8 = rows.astype("<i8").tobytes(), page_size * 8
    b4, s4 = rows.astype("<i4").tobytes(), page_size * 4  # only narrow rows are read from it
    for i, w in enumerate(wide):
        prev = h(prev + (b8[i * s8 : (i + 1) * s8] if w else b4[i * s4 : (i + 1) * s4]))
        keys.append(prev)
    return keys  # type: ignore[return-value]
