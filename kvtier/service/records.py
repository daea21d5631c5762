"""The node service's page records: for each region page, the key it holds and a checksum of its bytes,
kept beside the region so that a service restarted on it offers again only what verifies.

Files in the region's directory (the service's alone, 0600; engines never map them)::

    pages        a record of RECORD_BYTES per page id (num_pages per pool: a hybrid model's object pools after the
                 pages), record i for id i:
                 0   u32  state: 0 empty, WRITING (handed to a writer), WRITTEN (its key's bytes are in)
                 4   u32  namespace id (the line of ``namespaces`` that names it)
                 8   u64  xxh3_64 of the page's bytes (each buffer in the spec's order, each layer in order)
                 16  u8   key length, then the key (at most 64 bytes), then zeros
                 88  i32, i64, u64  a WRITING record's writer: its pid, start time and session's digest (0: not known)
                 88  u64  a WRITTEN record's owner (:func:`kvtier.service.tenants.owner_id`; 0: the namespace's own)
                 120 u64  xxh3_64 of bytes 0..119 (a record torn by a kill mid-write fails it)
    namespaces   one JSON string per line, appended as namespaces first publish (a torn last line is ignored)

Who writes what: the service, on its one selector thread. A page handed to a writer (``reserve``) is
recorded WRITING, with the writer's process (pid and start time), before the writer gets its id; once the
writer says its write is complete (``publish``, or the service's own L3 load) the service reads the page's
bytes, and records WRITTEN with their checksum. So the checksum is of the bytes as the completed write
left them, taken by the one process that outlives every writer, never a claim sent by one.

What reads them:

* :meth:`PageRecords.offered`: a hit is verified before the service offers it, on a sample
  (``--verify-sample``: the fraction of hits, 1.0 in tests) -- a page whose bytes changed after their
  checksum (a stray write, a bit flip) is found in bounded time and dropped, a miss;
* :meth:`PageRecords.adopt`: a restarted service verifies every WRITTEN page of the region it adopts
  before it indexes it. A page WRITING at the crash, or whose record is torn, may still be written by an
  engine whose copy was in flight: it is held out of circulation (its record left as it is, so a second
  crash parks it again) for a grace period (:data:`QUARANTINE_S`), and after it for as long as its writer's
  process lives -- unless that process attaches again naming the session as quiesced (its copies done).

A record that cannot be written (the namespaces file's disk full) leaves the page WRITING -- never
adopted -- and is logged; it never fails the index's step.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import random
import struct
from dataclasses import dataclass

import numpy as np
import xxhash

from kvtier.layout import HostLayout
from kvtier.pools.host import region_offsets
from kvtier.service.region import Owner, Region, RegionFormat

log = logging.getLogger(__name__)

RECORDS_FILE = "pages"
NAMESPACES_FILE = "namespaces"
RECORD_BYTES = 128
EMPTY, WRITING, WRITTEN = 0, 0x6B767477, 0x6B767472  # ('kvtw', 'kvtr')
_HEAD = struct.Struct("<IIQB")  # state, namespace id, checksum, key length
_WRITER = struct.Struct("<iqQ")  # a WRITING record's writer: pid, start time, its session's digest (at byte 88)
_WRITER_AT = 88
_OWNER = struct.Struct("<Q")  # a WRITTEN record's owner (at byte 88)


@dataclass(frozen=True)
class Writer:
    """Who was writing a page: its process, and a digest of its session (:func:`session_digest`)."""

    process: Owner
    session: int


def session_digest(session: str) -> int:
    return xxhash.xxh3_64_intdigest(session.encode())
_BODY_BYTES = 120
_MAX_KEY = 64
#: how long a page that was being written when the service died stays out of circulation after a restart: an
#: engine whose copy into it was in flight then may still complete it (seconds)
QUARANTINE_S = 30.0


@dataclass(frozen=True)
class Adopted:
    """What a restarted service takes over from a region: ``pages`` (page, namespace, key, owner) whose bytes verify
    (one page per key), ``quarantined`` pages (being written at the crash, or with a torn record) and ``dropped``: recorded pages
    whose bytes no longer match their checksum (or whose namespace is unknown)."""

    pages: list[tuple[int, str, bytes, int]]
    quarantined: dict[int, Writer | None]  # page -> who was writing it (None: not known)
    dropped: int


class PageRecords:
    """The records of ``region`` (see the module docstring); ``memory``: the region's bytes (the service's own
    mapping); ``verify_sample``: the fraction of hits :meth:`offered` verifies. ``fresh``: the files are made
    empty (a new region); else they are the ones a killed service left (:meth:`adopt` reads them)."""

    def __init__(self, region: Region, memory: np.ndarray, *, verify_sample: float, fresh: bool, seed: int | None = None,
                 keep: object = None, writer_of=lambda client: None, zero_freed: bool = False):
        self.region = region
        #: the writer behind an index client: (its process's pid, its session), or None (the service's own)
        self.writer_of = writer_of
        self.memory = memory
        self._keep = keep  # (what keeps ``memory`` mapped, where that is not ``memory`` itself)
        self.verify_sample = verify_sample
        self._rng = random.Random(seed)
        folder = os.path.dirname(region.path)
        #: one record per page of every pool (a hybrid model's object pools after the pages: ids region-wide)
        self.num_records = region.num_pages * region.format.pools
        size = self.num_records * RECORD_BYTES
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CREAT | (os.O_TRUNC if fresh else 0)
        fd = os.open(os.path.join(folder, RECORDS_FILE), flags, 0o600)
        try:
            if not fresh and os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)  # (a record file missing or cut short: what is missing reads as empty records)
            os.posix_fallocate(fd, 0, size)  # (allocated now: a write into the mapping never meets a full tmpfs)
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._ns_fd = os.open(os.path.join(folder, NAMESPACES_FILE), os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
                              | (os.O_TRUNC if fresh else 0), 0o600)
        self._ns_ids: dict[str, int] = {}
        self._namespaces: list[str] = [] if fresh else self._read_namespaces()
        self._ns_ids = {ns: i for i, ns in enumerate(self._namespaces)}
        self._spans = _page_spans(region)
        #: hits verified (sampled), and of them the pages whose bytes did not match (dropped: misses)
        self.verified_pages = self.verify_failed_pages = 0
        #: zero a page's bytes when it is evicted or freed (``kvtier serve --zero-evicted-pages``), and how many were
        self.zero_freed = zero_freed
        self.zeroed_pages = 0

    # ---- what the index tells (kvtier.service.index.PageWatcher) --------------------------------
    def reserved(self, pages: list[int], client: int) -> None:
        """``pages`` go to index client ``client``'s writer: WRITING, with its process, before it gets their ids."""
        who = self.writer_of(client)
        owner = Owner.of(who[0]) if who is not None else None
        rec = _record(WRITING, 0, 0, b"", None if owner is None else Writer(owner, session_digest(who[1])))
        for page in pages:
            self._map[page * RECORD_BYTES : (page + 1) * RECORD_BYTES] = rec

    def indexed(self, page: int, namespace: str, key: bytes, owner: int = 0) -> None:
        """``page``'s write is complete and it holds ``key`` of ``namespace``, ``owner``'s (a tenant's, for its bounds
        after a restart): WRITTEN, with its bytes' checksum.
        (A namespace that cannot be written down leaves the record WRITING: logged, the page never adopted.)"""
        try:
            ns_id = self._namespace_id(namespace)
        except OSError as e:
            log.warning("page %d's record not written (the namespaces file: %s): a restarted service will not adopt it", page, e)
            return
        self._map[page * RECORD_BYTES : (page + 1) * RECORD_BYTES] = _record(WRITTEN, ns_id, self.checksum(page), key, owner=owner)

    def offered(self, page: int) -> bool:
        """Whether ``page`` may be offered to a lookup: always, unless it is sampled for verification
        (``verify_sample``) and its bytes do not match its record -- then its record is cleared, and the
        caller drops it."""
        if self.verify_sample <= 0 or (self.verify_sample < 1 and self._rng.random() >= self.verify_sample):
            return True
        self.verified_pages += 1
        if self.verify(page):
            return True
        self.verify_failed_pages += 1
        self.cleared(page)
        log.warning("region page %d failed verification: its bytes changed after its write completed (dropped: a miss)", page)
        return False

    def cleared(self, page: int) -> None:
        self._map[page * RECORD_BYTES : (page + 1) * RECORD_BYTES] = bytes(RECORD_BYTES)

    def vacated(self, pages: list[int]) -> None:
        """``pages`` left the index (evicted, or their write dropped): with ``zero_freed``, their bytes are zeroed now, so
        the next engine to reserve one -- another tenant's, perhaps -- never reads what it held."""
        if not self.zero_freed:
            return
        memory = self.memory
        for page in pages:
            for start, length in self._spans(page):
                memory[start : start + length] = 0
        self.zeroed_pages += len(pages)

    # ---- bytes ---------------------------------------------------------------------------------
    def checksum(self, page: int) -> int:
        """xxh3_64 of ``page``'s bytes in the region (each buffer in the spec's order, each layer in order)."""
        h = xxhash.xxh3_64()
        for start, length in self._spans(page):
            h.update(self.memory[start : start + length])
        return h.intdigest()

    def verify(self, page: int) -> bool:
        """Whether ``page``'s record is WRITTEN, whole, and its checksum is of the bytes the page holds now."""
        rec = self._read(page)
        return rec is not None and rec[0] == WRITTEN and rec[2] == self.checksum(page)

    # ---- adopting --------------------------------------------------------------------------------
    def adopt(self) -> Adopted:
        """Read every record of a region a killed service left (see :class:`Adopted`), verifying each WRITTEN
        page's bytes; the records of what is not adopted are cleared."""
        pages, quarantined, dropped, seen = [], {}, 0, set()
        for page in range(self.num_records):
            raw = self._map[page * RECORD_BYTES : (page + 1) * RECORD_BYTES]
            if raw == bytes(RECORD_BYTES):
                continue
            rec = _parse(raw)
            if rec is None or rec[0] == WRITING:  # (its record left as it is: parked again if this service dies too)
                quarantined[page] = _writer(raw) if rec is not None else None
                continue
            _state, ns_id, checksum, key = rec
            if ns_id < len(self._namespaces) and checksum == self.checksum(page):
                if (ns_id, key) in seen:  # (a key published again after its first page was evicted, both pages left: one is kept)
                    self.cleared(page)
                    continue
                seen.add((ns_id, key))
                pages.append((page, self._namespaces[ns_id], key, _OWNER.unpack_from(bytes(raw), _WRITER_AT)[0]))
            else:
                dropped += 1
                self.cleared(page)
        return Adopted(pages, quarantined, dropped)

    def close(self) -> None:
        self._map.close()
        os.close(self._ns_fd)

    # ---- internals ------------------------------------------------------------------------------
    def _read(self, page: int) -> tuple[int, int, int, bytes] | None:
        return _parse(self._map[page * RECORD_BYTES : (page + 1) * RECORD_BYTES])

    def _namespace_id(self, namespace: str) -> int:
        ns_id = self._ns_ids.get(namespace)
        if ns_id is None:
            # (one write of the whole line: a kill leaves it whole or absent, and a torn line is ignored on reading)
            os.write(self._ns_fd, (json.dumps(namespace) + "\n").encode())
            ns_id = self._ns_ids[namespace] = len(self._namespaces)
            self._namespaces.append(namespace)
        return ns_id

    def _read_namespaces(self) -> list[str]:
        os.lseek(self._ns_fd, 0, os.SEEK_SET)
        text = b""
        while chunk := os.read(self._ns_fd, 1 << 20):
            text += chunk
        out, whole = [], 0
        for line in text.split(b"\n")[:-1]:  # (what follows the last newline is a torn line)
            try:
                ns = json.loads(line)
            except ValueError:
                break
            if type(ns) is not str:
                break
            out.append(ns)
            whole += len(line) + 1
        os.ftruncate(self._ns_fd, whole)  # (a torn line cut off: the next namespace starts a line of its own)
        return out


def _record(state: int, ns_id: int, checksum: int, key: bytes, writer: Writer | None = None, owner: int = 0) -> bytes:
    assert len(key) <= _MAX_KEY, len(key)
    body = bytearray((_HEAD.pack(state, ns_id, checksum, len(key)) + key).ljust(_BODY_BYTES, b"\0"))
    if writer is not None:
        _WRITER.pack_into(body, _WRITER_AT, writer.process.pid, writer.process.start, writer.session)
    elif owner:
        _OWNER.pack_into(body, _WRITER_AT, owner)
    return bytes(body) + xxhash.xxh3_64_intdigest(bytes(body)).to_bytes(8, "little")


def _writer(raw: bytes) -> Writer | None:
    pid, start, session = _WRITER.unpack_from(bytes(raw), _WRITER_AT)
    return Writer(Owner(pid, start), session) if pid > 0 else None


def _parse(raw: bytes) -> tuple[int, int, int, bytes] | None:
    """(state, namespace id, checksum, key) of a whole record; None for a torn or foreign one."""
    body = bytes(raw[:_BODY_BYTES])
    if xxhash.xxh3_64_intdigest(body).to_bytes(8, "little") != bytes(raw[_BODY_BYTES:RECORD_BYTES]):
        return None
    state, ns_id, checksum, key_len = _HEAD.unpack_from(body)
    if state not in (WRITING, WRITTEN) or key_len > _MAX_KEY:
        return None
    return state, ns_id, checksum, body[_HEAD.size : _HEAD.size + key_len]


def _page_spans(region: Region):
    """A function of a page id (region-wide: pool ``id // num_pages``'s page ``id % num_pages``): the (start, length)
    byte ranges of that page in the region, in checksum order."""
    fmt, n = region.format, region.num_pages
    pools = [_pool_spans(fmt, k, n) for k in range(fmt.pools)]
    if len(pools) == 1:
        return pools[0]
    return lambda page: pools[page // n](page % n)


def _pool_spans(fmt: RegionFormat, pool: int, n: int):
    start, _size = fmt.part(pool, n)
    layers, sizes = fmt.parts()[pool]
    offsets = [start + off for off in region_offsets(sizes, layers, n)[0]]
    if HostLayout(fmt.layout, layers, n).kind == "page_first":  # (each buffer's page is one run of its layers)
        return lambda page: [(off + page * layers * pb, layers * pb) for off, pb in zip(offsets, sizes)]
    return lambda page: [(off + (layer * n + page) * pb, pb) for off, pb in zip(offsets, sizes) for layer in range(layers)]
