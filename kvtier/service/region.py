"""The node service's host region: one file in shared memory, laid out exactly as a
:class:`~kvtier.pools.host.HostPool` (:func:`~kvtier.pools.host.region_offsets`), so every page format
holds in it byte for byte and an engine's copies read and write it where it is mapped.

Why a file under ``/dev/shm`` rather than :mod:`multiprocessing.shared_memory`: on Python 3.11 every
process that attaches a ``SharedMemory`` registers it with its own resource tracker, which unlinks the
segment when that process exits -- an engine that stops would take the service's region with it (the
tracker can be told otherwise only from 3.13). A file is named by the service alone, lives in a fresh
directory of mode 0700 (nobody else can even look it up) with mode 0600 itself, is on tmpfs (memory,
never written back to a disk), and is removed by the service on SIGTERM. With ``--allow-group`` the
directory is 0750 and the file 0660 of that group: its engines map the region read-write (their
backups write pages into it).

A SIGKILLed service cannot remove its region. Each region's directory names its owner (``owner``: the
service's pid and that process's start time, which a reused pid does not share), and a starting service
removes the regions of its own user whose owner is gone (:func:`remove_stale_regions`) -- never another
user's, never a live service's, never one that names no owner. Before that, a service started on the
socket a killed one listened on adopts that one's region (:func:`find_adoptable`, :func:`claim_region`):
the region's directory also holds ``format.json`` (:data:`REGION_VERSION`, the page format, the page
count and the socket) and the service's page records (:mod:`kvtier.service.records`), by which the new
service offers again only the pages whose bytes verify.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import logging
import mmap
import os
import shutil
import stat
import tempfile
import threading
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch
import xxhash

from kvtier.errors import ConfigError, KVTierError, ServiceAccessError, ServiceError, ServiceProtocolError
from kvtier.hashing import PageHash, group_object_key, name_key, split_fingerprint
from kvtier.layout import LAYOUTS
from kvtier.pools.host import ALIGN_BYTES, region_offsets
from kvtier.service.peer import ServiceTrust
from kvtier.spec import KVSpec

log = logging.getLogger(__name__)

#: where regions are made: tmpfs, memory that is never written back to a disk
SHM_DIR = "/dev/shm"
REGION_PREFIX = "kvtier-region-"
#: in a region's directory: the owning service's pid and start time (JSON)
OWNER_FILE = "owner"
#: in a region's directory: what a restarted service needs to adopt it (JSON: :func:`write_format`)
FORMAT_FILE = "format.json"
#: the version of a region's directory (its files and their layouts); a service adopts only its own version's
REGION_VERSION = 1


#: attention whose KV every tensor-parallel rank holds whole (MLA's latent, DSA's latent and indexer)
REPLICATED_ATTENTION = frozenset({"mla", "dsa"})


@dataclass(frozen=True)
class RowObject:
    """How an engine whose page is not a kvtier spec (SGLang's pools) frames one row of it as an L3 page object:
    the pool's ``fingerprint`` (16 hex characters: the object header's, and the pool's namespace's, beside the
    model, rank and salt of the engine's) and its page size in tokens (the header's valid token count)."""

    fingerprint: str
    page_size: int


@dataclass(frozen=True)
class ObjectPool:
    """A pool of a hybrid model's other KV group in the region beside the pages (:meth:`RegionFormat.with_objects`):
    one object per region page, laid out after the pages, named by the group's ``name``. Either of ``spec`` (the
    group's :meth:`~kvtier.groups.KVGroup.object_spec`: a window page, a state snapshot), laid out as a host pool of
    it; or, beside an engine's own pools (:meth:`RegionFormat.of_rows`: SGLang's SWA and Mamba host pools), one
    ``row_bytes`` row of a pool framed as an L3 object by ``row`` (:meth:`of_row`)."""

    name: str
    spec: KVSpec | None = None
    row: RowObject | None = None
    row_bytes: int = 0
    #: tensor-parallel ranks whose shards of an object each make ``spec``, one after another as the page's
    #: (:meth:`RegionFormat.of_shards`): set by :meth:`RegionFormat.with_objects` to the page's
    shards: int = 1

    @classmethod
    def of_row(cls, name: str, row: RowObject, row_bytes: int) -> ObjectPool:
        return cls(name, row=row, row_bytes=row_bytes)

    def part(self) -> tuple[int, tuple[int, ...]]:
        """(layers, buffer page bytes) of one object: a host pool's of its spec, or one row."""
        if self.spec is None:
            return 1, (self.row_bytes,)
        return self.spec.num_layers, tuple(b.page_bytes for b in self.spec.buffers) * self.shards

    def identity(self) -> list:
        if self.spec is None:
            return [self.name, "row", self.row.fingerprint, self.row.page_size, self.row_bytes]
        return [self.name, self.spec.fingerprint()] + ([self.shards] if self.shards > 1 else [])


def objects_fingerprint(page_fingerprint: str, objects: tuple[ObjectPool, ...]) -> str:
    """The fingerprint of a region page with object pools: the page's and every pool's name and spec (or row), bound."""
    return xxhash.xxh3_64_hexdigest(json.dumps(["objects", page_fingerprint, *[o.identity() for o in objects]]).encode())


#: the most object pools a format may name (a hybrid model's groups beside full attention)
MAX_OBJECT_POOLS = 8
MAX_POOL_NAME = 64


def rows_fingerprint(fingerprints: list[str]) -> str:
    """The fingerprint of a region page whose rows are pools of these fingerprints (SGLang's KV pool first, then
    the pools on its page ids): the format's identity, which binds every row's fingerprint (:meth:`RegionFormat.of_rows`)."""
    return xxhash.xxh3_64_hexdigest(json.dumps(["sglang", *fingerprints]).encode())


@dataclass(frozen=True)
class RegionFormat:
    """What fixes the region's bytes: the spec (by fingerprint), its buffers' page sizes and the host layout.
    Every engine attached to one service shares it (this slice serves one page format per service).
    ``spec``: the spec itself -- of each of the page's ``shards`` (a tensor-parallel rank's, :meth:`of_shards`)
    -- which a service with an L3 tier needs to write the page objects an engine's own L3 writes (not part of
    the format's identity: the fingerprint is, and it names the shards). ``rows``: where the page is not a
    kvtier spec but an engine's own pools, one per buffer row (:meth:`of_rows`), how each row is an L3 object.
    ``objects``: a hybrid model's other groups (:meth:`with_objects`), each a pool of as many objects as the
    region has pages, after the pages (part of the identity: the fingerprint binds them too)."""

    fingerprint: str
    layout: str
    num_layers: int
    buffer_page_bytes: tuple[int, ...]
    spec: KVSpec | None = field(default=None, compare=False)
    shards: int = field(default=1, compare=False)
    rows: tuple[RowObject, ...] | None = field(default=None, compare=False)
    objects: tuple[ObjectPool, ...] = ()

    @classmethod
    def of(cls, spec: KVSpec, layout: str) -> RegionFormat:
        return cls(spec.fingerprint(), layout, spec.num_layers, tuple(b.page_bytes for b in spec.buffers), spec)

    @classmethod
    def of_shards(cls, spec: KVSpec, layout: str, tp_size: int) -> RegionFormat:
        """A page of ``tp_size`` tensor-parallel ranks whose shards each make ``spec``: one region page holds
        every rank's shard of it, rank ``r``'s buffers after those of ranks ``0..r-1`` (so each rank's shards
        of every page are one contiguous slice of the region, :meth:`shard`, laid out as a host pool of
        ``spec`` alone). The fingerprint names the tensor-parallel size: another split never shares pages."""
        if tp_size == 1:
            return cls.of(spec, layout)
        sizes = tuple(b.page_bytes for b in spec.buffers) * tp_size
        return cls(split_fingerprint(spec.fingerprint(), tp_size), layout, spec.num_layers, sizes, spec, tp_size)

    @classmethod
    def of_ranks(cls, spec: KVSpec, layout: str, tp_size: int) -> tuple[RegionFormat, int]:
        """The region page of ``tp_size`` ranks whose shards each make ``spec``, and how many shards it holds:
        one where every rank holds the same bytes (:data:`REPLICATED_ATTENTION`: rank 0 writes it, every rank
        reads it -- the latent stored once per node), else one per rank (:meth:`of_shards`)."""
        shards = 1 if spec.attention in REPLICATED_ATTENTION else tp_size
        return cls.of_shards(spec, layout, shards), shards

    @classmethod
    def of_rows(cls, rows: list[RowObject], payload_bytes: list[int]) -> RegionFormat:
        """A page of an engine's own pools (SGLang's KV pool and the pools on its page ids), row ``i`` pool
        ``rows[i]``'s page of ``payload_bytes[i]`` bytes: one row after another per buffer, one "layer" per row
        (page_first), each row the payload of that pool's L3 page object. The fingerprint binds the rows' fingerprints
        (an SGLang pool's binds its page size: a service still refuses an engine whose rows differ from its region's)."""
        return cls(rows_fingerprint([r.fingerprint for r in rows]), "page_first", 1, tuple(payload_bytes), rows=tuple(rows))

    def with_objects(self, objects: list[ObjectPool]) -> RegionFormat:
        """This format with a pool per other KV group of a hybrid model: region page ``p``'s objects of group ``g`` are
        object ``p`` of pool ``g`` (pools 1, 2, ...: ``objects``' order), each pool after the pages (:meth:`part`). Pools
        of a spec go beside a page of a kvtier spec -- each object the page's shards' (a tensor-parallel rank's slice of the
        pool: :meth:`object_shard`) --, pools of rows beside an engine's own rows."""
        if not objects:
            return self
        of_rows = self.rows is not None
        if len(objects) > MAX_OBJECT_POOLS:
            raise ConfigError(f"a region holds at most {MAX_OBJECT_POOLS} object pools beside its pages; {len(objects)} were asked "
                              f"({', '.join(o.name for o in objects)}): serve this model without the node service")
        if self.objects or any((o.spec is None) != of_rows for o in objects) or (not of_rows and self.spec is None):
            raise ServiceError("object pools beside a region's pages are for a page of a kvtier spec with pools of a spec, or for "
                               "an engine's own rows with pools of rows")
        objects = tuple(o if of_rows else dataclasses.replace(o, shards=self.shards) for o in objects)
        return dataclasses.replace(self, fingerprint=objects_fingerprint(self.fingerprint, objects), objects=objects)

    @property
    def pools(self) -> int:
        """How many pools the region holds: its pages (pool 0) and each object pool."""
        return 1 + len(self.objects)

    def parts(self) -> list[tuple[int, tuple[int, ...]]]:
        """Each pool's (layers, buffer page bytes): the pages', then each object pool's."""
        return [(self.num_layers, self.buffer_page_bytes)] + [o.part() for o in self.objects]

    def part(self, pool: int, num_pages: int) -> tuple[int, int]:
        """(offset, size) of pool ``pool``'s bytes in a region of ``num_pages`` pages: the pools one after another, each
        laid out as a host pool (:func:`~kvtier.pools.host.region_offsets`), so each is mapped as a host pool of its own."""
        start = 0
        for k, (layers, sizes) in enumerate(self.parts()):
            size = region_offsets(sizes, layers, num_pages)[1]
            if k == pool:
                return start, size
            start += size
        raise IndexError(f"pool {pool} of a region of {self.pools} pools")

    def key_of(self, pool: int, name: str) -> PageHash:
        """The key in the service's index of what an engine names ``name`` (SGLang's page hash) in pool ``pool``: the name's
        digest for a page (its L3 object's header key), that digest's group key of the pool's name for an object pool's row
        (a page and its objects are indexed apart, as a kvtier group's: :func:`~kvtier.hashing.group_object_key`)."""
        return name_key(name) if pool == 0 else group_object_key(name_key(name), self.objects[pool - 1].name)

    @property
    def stores_objects(self) -> bool:
        """Whether a service with an L3 tier can write this page's objects (it knows their spec, or its rows')."""
        return self.spec is not None or self.rows is not None

    def shard(self, num_pages: int, rank: int, tp_size: int) -> tuple[int, int]:
        """(offset, size) of rank ``rank``'s slice of a region of ``num_pages`` pages (:meth:`of_shards`)."""
        offsets, end = region_offsets(self.buffer_page_bytes, self.num_layers, num_pages)
        per = len(self.buffer_page_bytes) // tp_size
        start = offsets[rank * per]
        stop = offsets[(rank + 1) * per] if rank + 1 < tp_size else end
        return start, stop - start

    def object_shard(self, pool: int, num_pages: int, rank: int) -> tuple[int, int]:
        """(offset, size) of rank ``rank``'s slice of object pool ``pool`` in a region of ``num_pages`` pages: laid out as a
        host pool of the pool's spec alone, as :meth:`shard` is of the page's."""
        start, _size = self.part(pool, num_pages)
        layers, sizes = self.parts()[pool]
        offsets, end = region_offsets(sizes, layers, num_pages)
        per = len(sizes) // self.shards
        stop = offsets[(rank + 1) * per] if rank + 1 < self.shards else end
        return start + offsets[rank * per], stop - offsets[rank * per]

    @property
    def page_bytes(self) -> int:
        """Bytes one region page takes: its page's and, with object pools, one object of each."""
        return sum(layers * sum(sizes) for layers, sizes in self.parts())

    def size(self, num_pages: int) -> int:
        return sum(region_offsets(sizes, layers, num_pages)[1] for layers, sizes in self.parts())

    def as_wire(self) -> dict:
        wire = {"fingerprint": self.fingerprint, "layout": self.layout, "num_layers": self.num_layers,
                "buffer_page_bytes": list(self.buffer_page_bytes)}
        if self.spec is not None and self.shards > 1:  # (under keys a service before them ignores: it took such pages spec-less)
            wire["shard_spec"], wire["shards"] = dataclasses.asdict(self.spec), self.shards
        elif self.spec is not None:
            wire["spec"] = dataclasses.asdict(self.spec)
        if self.rows is not None:
            wire["row_objects"] = [[r.fingerprint, r.page_size] for r in self.rows]
        if self.objects:  # (a service before them ignores the key, and its region's size refuses the engine: ServiceClient)
            wire["object_pools"] = [[o.name, dataclasses.asdict(o.spec)] if o.spec is not None else
                                    [o.name, [o.row.fingerprint, o.row.page_size], o.row_bytes] for o in self.objects]
        return wire

    @classmethod
    def from_wire(cls, d: dict) -> RegionFormat:
        fp, layout, layers, sizes = d.get("fingerprint"), d.get("layout"), d.get("num_layers"), d.get("buffer_page_bytes")
        ok = (type(fp) is str and 0 < len(fp) <= 128 and layout in LAYOUTS and type(layers) is int and 0 < layers <= 1 << 12
              and type(sizes) is list and 0 < len(sizes) <= 16 and all(type(s) is int and 0 < s <= 1 << 30 for s in sizes))
        if not ok:
            raise ServiceProtocolError(f"hello's format is not a page format: {str(d)[:120]}")
        fmt = cls(fp, layout, layers, tuple(sizes))
        named = [k for k in ("spec", "shard_spec", "row_objects") if d.get(k) is not None]
        if len(named) > 1:
            raise ServiceProtocolError(f"hello's format names {' and '.join(named)}; a page is a spec, its shards', or rows of an "
                                       "engine's own pools")
        if d.get("object_pools") is not None:
            return _with_pools(d, fmt)
        if d.get("row_objects") is not None:
            return dataclasses.replace(fmt, rows=_rows_of(d["row_objects"], fmt))
        if d.get("shard_spec") is not None:
            shards = d.get("shards")
            if type(shards) is not int or not 2 <= shards <= len(sizes):
                raise ServiceProtocolError(f"hello's format names {str(shards)[:20]} shards, not 2 to its {len(sizes)} buffers")
            return dataclasses.replace(fmt, spec=_spec_of(d["shard_spec"], fmt, shards), shards=shards)
        return fmt if d.get("spec") is None else dataclasses.replace(fmt, spec=_spec_of(d["spec"], fmt, 1))


def _row_object(item: object) -> RowObject | None:
    """A row object on the wire, ``[16 hex digits, page size]``; None if it is not one."""
    if type(item) is not list or len(item) != 2:
        return None
    fp, page_size = item
    ok = (type(fp) is str and len(fp) == 16 and all(c in "0123456789abcdef" for c in fp) and type(page_size) is int
          and 0 < page_size <= 1 << 24)
    return RowObject(fp, page_size) if ok else None


def region_format_of(spec: KVSpec, layout: str, tp_size: int, *, hybrid: bool) -> tuple[RegionFormat, int]:
    """The region page of an engine of ``tp_size`` ranks whose shards each make ``spec``, and how many shards it holds
    (:meth:`RegionFormat.of_ranks`) -- but a hybrid model's page holds every rank's shard even of MLA's latent: its other
    groups' objects are each rank's own (a state, a window of its heads), and a page is published with its objects once
    every rank wrote them, so the latent goes beside them a copy per rank, as each rank's own L3 keeps it."""
    if hybrid:
        return RegionFormat.of_shards(spec, layout, tp_size), tp_size
    return RegionFormat.of_ranks(spec, layout, tp_size)


def _rows_of(wire: object, fmt: RegionFormat) -> tuple[RowObject, ...]:
    """The row objects a hello's format names, checked: one per buffer of a one-layer page_first format, each a
    16-hex-digit fingerprint and a page size, together the format's fingerprint (:func:`rows_fingerprint`)."""
    rows = [_row_object(item) for item in wire] if type(wire) is list and len(wire) == len(fmt.buffer_page_bytes) else [None]
    if None in rows or fmt.layout != "page_first" or fmt.num_layers != 1:
        raise ServiceProtocolError(f"hello's format names row objects that are not one [16 hex digits, page size] per "
                                   f"buffer of a one-layer page_first page: {str(wire)[:120]}")
    if len({r.fingerprint for r in rows}) != len(rows):
        raise ServiceProtocolError(f"hello's format names a row object twice (each row is a pool of its own): {str(wire)[:120]}")
    if rows_fingerprint([r.fingerprint for r in rows]) != fmt.fingerprint:
        raise ServiceProtocolError(f"hello's format names row objects that are not the format's ({fmt.fingerprint}): "
                                   f"{str(wire)[:120]}")
    return tuple(rows)


def _with_pools(d: dict, fmt: RegionFormat) -> RegionFormat:
    """The format a hello names with object pools, checked: a page of one spec or of an engine's rows (the format's
    fields are its page's), at most :data:`MAX_OBJECT_POOLS` pools, each a distinct name and a spec (beside a spec) or a
    row object and its bytes (beside rows), all bound by the format's fingerprint."""
    wire = d.get("object_pools")
    of_rows = d.get("row_objects") is not None
    of_spec = d.get("spec") is not None or d.get("shard_spec") is not None
    if of_spec == of_rows or type(wire) is not list or not 0 < len(wire) <= MAX_OBJECT_POOLS:
        raise ServiceProtocolError(f"hello's format names object pools that are not 1 to {MAX_OBJECT_POOLS} pools beside a page of one "
                                   f"spec or of rows: {str(wire)[:120]}")
    try:
        page = _page_of(d, fmt, of_rows)
        pools = [_object_pool(item, of_rows) for item in wire]
        named = page.with_objects(pools) if page is not None and len({p.name for p in pools}) == len(pools) else None
    except (TypeError, ValueError, OverflowError, KVTierError):
        named = None
    # (the fields are the page's; the fingerprint binds all)
    if named is None or dataclasses.replace(named, objects=(), rows=None) != fmt:
        raise ServiceProtocolError(f"hello's format names object pools that are not the format's ({fmt.fingerprint}): {str(wire)[:120]}")
    return named


def _page_of(d: dict, fmt: RegionFormat, of_rows: bool) -> RegionFormat | None:
    """The page format under a hello's object pools: of its spec, or of its rows (checked as :func:`_rows_of`)."""
    if not of_rows:
        if d.get("shard_spec") is not None:
            shards = d.get("shards")
            if type(d["shard_spec"]) is not dict or type(shards) is not int or not 2 <= shards <= len(fmt.buffer_page_bytes):
                return None
            return RegionFormat.of_shards(KVSpec(**d["shard_spec"]), fmt.layout, shards)
        return RegionFormat.of(KVSpec(**d["spec"]), fmt.layout) if type(d["spec"]) is dict else None
    wire = d["row_objects"]
    rows = [_row_object(item) for item in wire] if type(wire) is list else [None]
    if None in rows:
        return None
    page = dataclasses.replace(fmt, fingerprint=rows_fingerprint([r.fingerprint for r in rows]))
    return dataclasses.replace(page, rows=_rows_of(wire, page))


def _object_pool(item: object, of_rows: bool) -> ObjectPool:
    """One object pool on the wire: ``[name, spec]`` beside a spec, ``[name, [fingerprint, page size], row bytes]`` beside rows."""
    if type(item) is not list or len(item) != (3 if of_rows else 2) or type(item[0]) is not str:
        raise ValueError(item)
    name = item[0]
    if not 0 < len(name) <= MAX_POOL_NAME or "/" in name:
        raise ValueError(item)
    if not of_rows:
        if type(item[1]) is not dict:
            raise ValueError(item)
        return ObjectPool(name, KVSpec(**item[1]))
    row, row_bytes = _row_object(item[1]), item[2]
    if row is None or type(row_bytes) is not int or not 0 < row_bytes <= 1 << 30:
        raise ValueError(item)
    return ObjectPool.of_row(name, row, row_bytes)


def _spec_of(wire: object, fmt: RegionFormat, shards: int) -> KVSpec:
    """The spec a hello's format names, checked: it must be a spec, and the one the format's fields say (each of
    ``shards``)."""
    try:
        spec = KVSpec(**wire) if type(wire) is dict else None
        same = spec is not None and RegionFormat.of_shards(spec, fmt.layout, shards) == fmt
    except (TypeError, ValueError, OverflowError, KVTierError):
        same = False
    if not same:
        raise ServiceProtocolError(f"hello's format names a spec that is not the format's: {str(wire)[:120]}")
    return spec


@dataclass(frozen=True)
class Region:
    """A region file: ``path`` holds ``num_pages`` pages of ``format`` in ``size`` bytes. ``lock``: the service's
    ``flock`` on the region's directory, held while it serves the region (None: an engine's view of it)."""

    path: str
    format: RegionFormat
    num_pages: int
    size: int
    lock: int | None = field(default=None, compare=False)


def lock_region_dir(folder: str) -> int | None:
    """An exclusive ``flock`` on the region directory ``folder``, held by the returned descriptor until it is
    closed (or this process ends); None if another process holds it (a service serving it, or adopting it, or
    removing it right now) or the directory is gone."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def create_region(fmt: RegionFormat, host_bytes: int, parent: str = SHM_DIR, gid: int | None = None, socket: str | None = None) -> Region:
    """A fresh zeroed region of as many whole pages of ``fmt`` as ``host_bytes`` holds, in a new 0700
    directory under ``parent`` that names this process as its owner, itself 0600 (``gid``: 0750 and
    0660 of that group); its memory is allocated now (a full tmpfs fails here, not at a client's first write).
    ``socket``: the service's, written to its ``format.json`` (a service restarted on it adopts the region)."""
    num_pages = host_bytes // fmt.page_bytes
    if num_pages < 1:
        raise ServiceError(f"the service's {host_bytes} host bytes hold no {fmt.page_bytes}-byte page of this format; raise --host-gb")
    size = fmt.size(num_pages)
    folder = tempfile.mkdtemp(prefix=REGION_PREFIX, dir=parent)  # mode 0700
    path = os.path.join(folder, "region")
    lock = lock_region_dir(folder)  # (a fresh directory: nobody else has it)
    try:
        _write_owner(folder)  # (before the region: a directory that names no owner is never removed by another service)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            if gid is not None:
                os.fchown(fd, -1, gid)
                os.fchmod(fd, 0o660)
                os.chown(folder, -1, gid)
                os.chmod(folder, 0o750)
            os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)
        region = Region(path, fmt, num_pages, size, lock)
        write_format(region, socket, gid)
    except OSError as e:
        shutil.rmtree(folder, ignore_errors=True)
        if lock is not None:
            os.close(lock)
        raise ServiceError(f"cannot make a {size}-byte region in {parent} ({e}); lower --host-gb or grow {parent}") from None
    return region


def write_format(region: Region, socket: str | None, gid: int | None, kept: bool = False) -> None:
    """The region's ``format.json``: its version, page format (with its spec, where it has one), page count,
    size, the socket of the service that made it and its ``--allow-group`` gid, and ``kept`` (left on purpose
    by ``--keep-region``: another socket's service leaves it alone), written whole (a new file renamed into place)."""
    folder = os.path.dirname(region.path)
    doc = {"version": REGION_VERSION, "format": region.format.as_wire(), "num_pages": region.num_pages, "size": region.size,
           "socket": socket, "gid": gid, "kept": kept}
    _replace_file(folder, FORMAT_FILE, json.dumps(doc))


def _replace_file(folder: str, name: str, text: str) -> None:
    tmp = os.path.join(folder, f".{name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(folder, name))


#: the largest format.json read (a spec's fields and a socket path: a few KB)
_MAX_FORMAT_BYTES = 1 << 16


def read_format(folder: str) -> dict | None:
    """The region directory's ``format.json`` as written (None: absent, unreadable, not a JSON object)."""
    try:
        fd = os.open(os.path.join(folder, FORMAT_FILE), os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd) as f:
            doc = json.loads(f.read(_MAX_FORMAT_BYTES))
    except (OSError, ValueError, RecursionError):
        return None
    return doc if type(doc) is dict else None


def adoptable_region(folder: str, doc: dict, host_bytes: int, gid: int | None, lock: int) -> Region:
    """The region ``folder``'s ``format.json`` (``doc``) describes, checked for a service of ``host_bytes`` and
    ``--allow-group`` ``gid``: its own version, a page format, the page count those bytes hold, the same group,
    a regular file of this uid of its size. ``lock``: the directory's, which the region holds from now on. A
    :class:`~kvtier.errors.ServiceError` says why not (the caller removes it: it is never misread)."""
    if doc.get("version") != REGION_VERSION:
        raise ServiceError(f"it is of region version {str(doc.get('version'))[:20]}, not this kvtier's {REGION_VERSION}")
    fmt = RegionFormat.from_wire(doc.get("format")) if type(doc.get("format")) is dict else None
    if fmt is None:
        raise ServiceError("its format.json names no page format")
    num_pages, size = doc.get("num_pages"), doc.get("size")
    if num_pages != host_bytes // fmt.page_bytes or size != fmt.size(num_pages):
        raise ServiceError(f"it holds {str(num_pages)[:20]} pages, and this service's --host-gb {host_bytes // fmt.page_bytes} of its "
                           "format (start it with the --host-gb the region was made with to keep it)")
    if doc.get("gid") != gid:
        raise ServiceError(f"it was shared with group {doc.get('gid')}, and this service's --allow-group is {gid}")
    path = os.path.join(folder, "region")
    os.close(open_region(path, size, None if gid is None else ServiceTrust(os.getuid(), gid)))  # (a file of this uid, no link, its size)
    return Region(path, fmt, num_pages, size, lock)


def _dead_regions(parent: str, uid: int):
    """(folder, its format.json or None) of each region directory of ``uid`` under ``parent`` whose owning
    service is gone (in this pid namespace)."""
    for name in sorted(os.listdir(parent)):
        folder = os.path.join(parent, name)
        try:
            st = os.lstat(folder)
        except FileNotFoundError:
            continue
        if not name.startswith(REGION_PREFIX) or not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
            continue
        owner = _read_owner(folder)
        if owner is not None and not owner.alive():
            yield folder, owner, read_format(folder)


def find_adoptable(socket: str, parent: str = SHM_DIR) -> tuple[str, dict, int] | None:
    """The region a killed (or ``--keep-region``) service left that listened on ``socket``: its directory, its
    ``format.json`` and the directory's lock, now held (the newest such region this uid has, its owner gone;
    one another process holds locked is passed over). None if there is none."""
    found = [(os.lstat(folder).st_mtime, folder, doc) for folder, _owner, doc in _dead_regions(parent, os.getuid())
             if doc is not None and doc.get("socket") == socket]
    for _mtime, folder, doc in sorted(found, key=lambda f: f[0], reverse=True):
        lock = lock_region_dir(folder)
        if lock is not None:
            return folder, doc, lock
    return None


def claim_region(folder: str) -> None:
    """Name this process as the owner of the region directory ``folder`` (a killed service's it adopts): from
    now on no other service takes it for stale."""
    _replace_file(folder, OWNER_FILE, _this_owner())


def remove_region(region: Region) -> None:
    shutil.rmtree(os.path.dirname(region.path), ignore_errors=True)
    release_region(region)


def release_region(region: Region) -> None:
    """Let the region's directory lock go (the region itself is left as it is)."""
    if region.lock is not None:
        os.close(region.lock)


@dataclass(frozen=True)
class Owner:
    """A process, told apart from a later one that reuses its pid by its start time (clock ticks after boot)."""

    pid: int
    start: int

    @classmethod
    def of(cls, pid: int) -> Owner | None:
        """Process ``pid`` as it is now; None if there is none."""
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat_line = f.read()
        except OSError:
            return None
        # field 22, counted after the command name's closing parenthesis (the name may hold spaces and parentheses)
        return cls(pid, int(stat_line[stat_line.rindex(")") + 2:].split()[19]))

    def alive(self) -> bool:
        return Owner.of(self.pid) == self


def _pid_namespace() -> int:
    """This process's pid namespace (the inode of ``/proc/self/ns/pid``): a pid means a process only in it."""
    return os.stat("/proc/self/ns/pid").st_ino


def _this_owner() -> str:
    """The ``owner`` file's text naming this process (read back by :func:`_read_owner`)."""
    me = Owner.of(os.getpid())
    return json.dumps({"pid": me.pid, "start": me.start, "pidns": _pid_namespace()})


def _write_owner(folder: str) -> None:
    with open(os.path.join(folder, OWNER_FILE), "x") as f:
        f.write(_this_owner())


def _read_owner(folder: str) -> Owner | None:
    try:
        fd = os.open(os.path.join(folder, OWNER_FILE), os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd) as f:
            d = json.loads(f.read(256))
        if d.get("pidns", _pid_namespace()) != _pid_namespace():
            return None  # a service in another pid namespace (a container sharing /dev/shm): its pid is not ours to read
        return Owner(d["pid"], d["start"]) if type(d["pid"]) is int and type(d["start"]) is int else None
    except (OSError, ValueError, TypeError, KeyError):
        return None


def remove_stale_regions(parent: str = SHM_DIR, uid: int | None = None, socket: str | None = None) -> list[str]:
    """Remove the region directories under ``parent`` of user ``uid`` (default: this process's) whose owning
    service is gone -- a SIGKILLed service's; the paths removed. Another user's directory, one whose owner
    lives, one that names no owner (being made, or made by an older kvtier), one whose owner ran in
    another pid namespace (a container sharing ``/dev/shm``: whether it lives cannot be told from here) and
    one another process holds locked (being adopted) are left alone; so is one that waits for its own
    service to come back and adopt it -- left on purpose (``--keep-region``), or a killed service's whose
    socket file is still there (a crashed unit about to be restarted) -- unless it names ``socket``, the
    caller's own (whose service, the caller, did not adopt it)."""
    uid = os.getuid() if uid is None else uid
    removed = []
    for folder, owner, doc in _dead_regions(parent, uid):
        if doc is not None and doc.get("socket") != socket and (doc.get("kept") is True or _is_socket(doc.get("socket"))):
            continue
        lock = lock_region_dir(folder)
        if lock is None:  # (another service is adopting it, or removing it)
            continue
        try:
            shutil.rmtree(folder, ignore_errors=True)
        finally:
            os.close(lock)
        log.warning("removed %s: the region of service process %d, which is gone (killed before it could remove it)", folder, owner.pid)
        removed.append(folder)
    return removed


def _is_socket(path: object) -> bool:
    try:
        return type(path) is str and stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:
        return False


def open_region(path: str, size: int, trust: ServiceTrust | None) -> int:
    """A read-write descriptor of the region at ``path``, once it is checked to be one the service of
    ``trust`` made (:func:`check_region_fd`); ``trust`` None: a region of this process's own uid (this
    process's, or the service's own). Opened without following a link, and never a FIFO or a device:
    a :class:`~kvtier.errors.ServiceAccessError` naming the path, what it is and the fix."""
    try:
        st = os.lstat(path)  # (no open at all of what is not a regular file: opening a device may do something)
        if not stat.S_ISLNK(st.st_mode) and not stat.S_ISREG(st.st_mode):
            raise ServiceAccessError(_not_a_region(path, st, trust, "not a regular file"))
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)
    except ServiceError:
        raise
    except OSError as e:
        if e.errno == errno.ELOOP:  # (a link, made then or since)
            raise ServiceAccessError(f"the node service's region {path} is a symbolic link; an engine maps only the file itself: "
                                     f"{_REGION_FIX}") from None
        raise ServiceError(f"cannot open the node service's region {path} ({e.strerror or e})") from None
    try:
        check_region_fd(fd, path, size, trust)
    except BaseException:
        os.close(fd)
        raise
    return fd


#: what to do about a region an engine refuses to map
_REGION_FIX = ("the service's regions are 0600 files of its own uid (0660 of its --allow-group group): restart kvtier serve as the "
               "user it should run as, in a socket directory only that user can write into")


def check_region_fd(fd: int, path: str, size: int, trust: ServiceTrust | None) -> None:
    """The file open at ``fd`` (``path``) is a region the engine may map: a regular file of the service's
    uid (``trust.uid``; ``trust`` None: this process's uid) with no permission bits beyond 0600 -- 0660
    when its group is the one the service's socket directory lets in (``trust.group``: ``--allow-group``;
    any group for ``trust`` None, the process's own region) -- of ``size`` bytes. A file another user
    made (or could read) is a :class:`~kvtier.errors.ServiceAccessError`; one of another size, a
    :class:`~kvtier.errors.ServiceProtocolError` (the service's hello announced something else)."""
    st = os.fstat(fd)
    uid = os.getuid() if trust is None else trust.uid
    group_ok = trust is None or (trust.group is not None and st.st_gid == trust.group)
    allowed = 0o660 if group_ok else 0o600
    if not stat.S_ISREG(st.st_mode) or st.st_uid != uid or stat.S_IMODE(st.st_mode) & ~allowed:
        what = ("not a regular file" if not stat.S_ISREG(st.st_mode) else f"not uid {uid}'s" if st.st_uid != uid else
                f"permission bits beyond {allowed:o}")
        raise ServiceAccessError(_not_a_region(path, st, trust, what))
    if st.st_size != size:
        raise ServiceProtocolError(f"the node service's region {path} is {st.st_size} bytes, not the {size} it announced")


def _not_a_region(path: str, st: os.stat_result, trust: ServiceTrust | None, what: str) -> str:
    uid = os.getuid() if trust is None else trust.uid
    group = "" if trust is None or trust.group is None else f" (0660 if of group {trust.group}, which the socket's directory lets in)"
    return (f"the node service's region {path} is of uid {st.st_uid}, gid {st.st_gid}, mode {stat.S_IMODE(st.st_mode):o} ({what}); an "
            f"engine maps only a regular file of uid {uid} with mode 0600{group}, so that nobody else reads or writes its pages: "
            f"{_REGION_FIX}")


def map_region(path: str, size: int, *, trust: ServiceTrust | None = None, offset: int = 0, length: int | None = None,
               pin: bool | None = None, pin_in_background: bool = False) -> torch.Tensor:
    """The region (or its bytes ``offset`` to ``offset + length``: a tensor-parallel rank's slice, on a
    4 KiB boundary) as a flat uint8 tensor over a shared mapping: writes are the service's and every other
    client's to see. The mapping lives as long as the tensor (and its views). A normal tensor even when
    mapped under ``torch.inference_mode`` (vLLM's step): kvtier's transfer thread writes into it.

    ``trust``: the service that named the region, as the engine checked it (:attr:`ServiceClient.trust
    <kvtier.service.client.ServiceClient.trust>`); the file is mapped only if it is one that service made
    (:func:`open_region`). None: a region of this process's own uid (the service's own mapping, a bench's).

    ``pin`` (default: when CUDA is available) registers the mapping with CUDA (:func:`register_with_cuda`),
    so copies between it and a GPU are asynchronous DMA as from a pinned host pool of the engine's own;
    ``tensor.is_pinned()`` says whether it is. The service itself maps with ``pin=False``.
    ``pin_in_background``: register on a thread of its own (page-locking tens of GB takes seconds; an
    engine mapping a restarted service's region from a request's path must not wait for it -- its copies
    are correct, synchronous, until then)."""
    length = size - offset if length is None else length
    if offset % ALIGN_BYTES or not 0 <= offset < offset + length <= size:
        raise ServiceError(f"bytes {offset} to {offset + length} are not a mappable slice of the {size}-byte region {path}")
    fd = open_region(path, size, trust)
    try:
        # (mapped from the kernel's allocation granularity below ``offset``: 64 KiB on some arm64 kernels)
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        try:
            mapping = mmap.mmap(fd, offset + length - start, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
        except OSError as e:  # (ENOMEM: too many mappings, an address-space limit)
            raise ServiceError(f"cannot map the node service's region {path} ({e})") from None
    finally:
        os.close(fd)
    # (through a numpy array: its weak references are cleared before it lets the mapping go, so the CUDA
    # registration below is undone while the memory is still mapped)
    array = np.frombuffer(mapping, dtype=np.uint8)[offset - start :]
    with torch.inference_mode(False):
        memory = torch.from_numpy(array)
    if torch.cuda.is_available() if pin is None else pin:
        if pin_in_background:
            threading.Thread(target=register_with_cuda, args=(array, memory), name="kvtier-region-pin", daemon=True).start()
        else:
            register_with_cuda(array, memory)
    return memory


def register_with_cuda(owner: object, memory: torch.Tensor) -> bool:
    """Page-lock ``memory`` for CUDA (``cudaHostRegister``) until ``owner`` -- the object that keeps it
    mapped -- is collected, then unregister it. False (a warning; copies stay correct, synchronous) when
    CUDA is not there or refuses."""
    if not torch.cuda.is_available():
        return False
    cudart = torch.cuda.cudart()
    ptr = memory.data_ptr()
    err = cudart.cudaHostRegister(ptr, memory.numel(), 0)
    if int(err) != 0:
        log.warning("the node service's region could not be registered with CUDA (cudaHostRegister error %d): copies from it are not "
                    "asynchronous DMA", int(err))
        return False
    weakref.finalize(owner, cudart.cudaHostUnregister, ptr)
    return True
