"""The L3 page object: one page, every buffer and layer of the spec, with a header and a checksum.

Layout (little-endian)::

    offset  size  field
    0       4     magic b"KVTP"
    4       2     format version (1)
    6       2     header size (72)
    8       4     valid token count (== page_size for shared pages)
    12      4     owner tag: whose page it is, for the store's per-tenant bounds (:func:`~kvtier.hashing.owner_tag`; 0 the
                  namespace's own, the value every object written before tags has)
    16      16    spec fingerprint (ASCII hex, binds dims, dtypes, page size, layout version)
    32      16    page key (the chained page hash the object is stored under)
    48      8     payload size
    56      16    xxh3_128 of header bytes 0..55 and the payload
    72      ...   payload: for each buffer in spec order, its ``[num_layers, page_bytes]``
                  (page_first bytes: one contiguous run per buffer)

An engine that keeps its own host pool (SGLang's HiCache backend,
:mod:`kvtier.integrations.sglang`) stores the same header in front of that
pool's own page bytes; its fingerprint then binds the pool's kind, layout and
geometry instead of a kvtier spec, so the two formats never share a key.

The owner tag never decides what a reader gets: a tenant's pages are its own by their keys (the tenant is
in the root of the key chain). It only says whose bytes an object holds, so a store that evicts on its own
(the file store) can bound each tenant's share; 32 bits of the tenant's digest, so two tenants of a store
share a tag (and their bounds) with odds of about ``n**2 / 2**33`` for ``n`` tenants.

A reader rejects an object whose magic, version, fingerprint, key, size,
valid token count (shared pages are whole: ``page_size``) or checksum does not
match; the tier treats it as a miss, counts it, and deletes the object so the
next save of that key writes it again.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import xxhash

from kvtier.hashing import NAMESPACE_TAG, PageHash
from kvtier.spec import KVSpec

MAGIC = b"KVTP"
FORMAT_VERSION = 1
_HEAD = struct.Struct("<4sHHII16s16sQ")
HEADER_BYTES = _HEAD.size + 16  # 72

def tag_of(head: bytes | memoryview) -> int:
    """The owner tag in an object's first 16 bytes (not checked: only the reader's full check trusts a header)."""
    return int.from_bytes(bytes(head[12:16]), "little")


def tag_of_parts(parts: Sequence[memoryview]) -> int:
    """The owner tag of an object held by ``parts`` back to back (a writer's header and payload buffers); 0 (the
    namespace's) where they hold fewer than 16 bytes."""
    head = b""
    for p in parts:
        head += bytes(memoryview(p).cast("B")[: 16 - len(head)])
        if len(head) >= 16:
            break
    return tag_of(head)


Verdict = Literal["ok", "magic", "version", "fingerprint", "key", "size", "valid_tokens", "checksum"]


@dataclass(frozen=True)
class PageCodec:
    """Encodes and checks page objects of one format: what the fingerprint binds, the payload size,
    and the tokens in a page. :meth:`for_spec` gives a kvtier spec's; an engine's own pool (SGLang's
    host pools) brings its own fingerprint and payload size."""

    fingerprint: str
    payload_bytes: int
    page_size: int

    @classmethod
    def for_spec(cls, spec: KVSpec) -> PageCodec:
        return cls(spec.fingerprint(), spec.page_bytes, spec.page_size)

    @functools.cached_property
    def object_bytes(self) -> int:
        return HEADER_BYTES + self.payload_bytes

    @functools.cached_property
    def _fingerprint(self) -> bytes:
        fp = self.fingerprint.encode()
        if len(fp) != 16:
            raise ValueError(f"a page fingerprint is 16 ASCII characters, got {self.fingerprint!r}")
        return fp

    def header(self, key: PageHash, payload: memoryview, valid_tokens: int | None = None, owner: int = NAMESPACE_TAG) -> bytes:
        return self.header_for_parts(key, (payload,), valid_tokens, owner)

    def header_for_parts(self, key: PageHash, payload: Sequence[memoryview], valid_tokens: int | None = None,
                         owner: int = NAMESPACE_TAG) -> bytes:
        """The header of an object whose payload is ``payload``'s buffers back to back (e.g. a host page's);
        ``owner``: its owner tag (:func:`~kvtier.hashing.owner_tag`)."""
        head = _HEAD.pack(MAGIC, FORMAT_VERSION, HEADER_BYTES, self.page_size if valid_tokens is None else valid_tokens, owner,
                          self._fingerprint, bytes(key), sum(len(p) for p in payload))
        h = xxhash.xxh3_128()
        h.update(head)
        for part in payload:
            h.update(part)
        return head + h.digest()

    def check(self, obj: memoryview, key: PageHash) -> Verdict:
        if len(obj) != self.object_bytes:
            return "size"
        return self.check_parts(obj[:HEADER_BYTES], (obj[HEADER_BYTES:],), key)

    def check_parts(self, head: memoryview, payload: Sequence[memoryview], key: PageHash) -> Verdict:
        """Check an object read scattered: its header, then its payload in pieces (e.g. straight into host pages)."""
        if len(head) != HEADER_BYTES or sum(len(p) for p in payload) != self.payload_bytes:
            return "size"
        magic, version, hsize, valid, _owner, fp, k, size = _HEAD.unpack_from(head, 0)
        if magic != MAGIC:
            return "magic"
        if version != FORMAT_VERSION or hsize != HEADER_BYTES:
            return "version"
        if fp != self._fingerprint:
            return "fingerprint"
        if k != bytes(key):
            return "key"
        if size != self.payload_bytes:
            return "size"
        if valid != self.page_size:  # only whole pages are shared; a partial one is never stored
            return "valid_tokens"
        h = xxhash.xxh3_128()
        h.update(head[: _HEAD.size])
        for part in payload:
            h.update(part)
        return "ok" if h.digest() == bytes(head[_HEAD.size : HEADER_BYTES]) else "checksum"
