"""What the policy core sends out (plans) and what comes back (completions).

The core decides; an executor, in whatever process holds the bytes, moves
them. A plan is one run of whole pages from one tier to another, named by page
ids (device, host) or page keys (storage); its ``op`` is the core's handle for
the answer. A completion is one typed event per plan: :class:`Done`,
:class:`CutShort` (the leading ``pages`` completed, the rest did not) or
:class:`Failed` (none did). All of them are frozen, slotted dataclasses of
ints, bytes and enums: they pickle across a pipe as they are.

Page alignment holds here too: a plan carries page ids, never token slots,
so no partial page can be expressed.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import ClassVar

import numpy as np

from kvtier.errors import PageAlignmentError


class Tier(IntEnum):
    DEVICE = 0
    HOST = 1
    STORAGE = 2


#: the tiers as module globals, for the per-request paths: Python 3.11 specializes a global's lookup,
#: not an enum member's (``Tier.HOST`` costs about six times ``HOST`` there)
DEVICE, HOST, STORAGE = Tier.DEVICE, Tier.HOST, Tier.STORAGE


@dataclass(frozen=True, slots=True)
class GroupRun:
    """A hybrid model's other KV group riding on a plan: its objects (sliding-window pages or state
    snapshots, ids of that group's pools) for some of the plan's pages. ``at[i]`` is the place, in
    the plan's page run, of the page object ``i`` belongs to: it moves with that page, and is done
    when that page is (a plan cut short after ``k`` pages completed the objects of places ``< k``).
    A plan of no pages moves objects alone (their pages are in place already): ``at`` is empty."""

    group: str
    at: tuple[int, ...]
    src_pages: tuple[int, ...]
    dst_pages: tuple[int, ...]
    #: a save or a fetch: the objects' L3 keys (:func:`~kvtier.hashing.group_object_key`); the storage
    #: side's ids are empty, as a plan's are
    keys: tuple[bytes, ...] = ()


@dataclass(frozen=True, slots=True)
class Transfer:
    """Move whole pages ``src_pages`` of ``src`` to ``dst_pages`` of ``dst``, in order.

    Device and host pages are page ids; the storage side is named by ``keys``
    (one page key per page), and its page-id tuple is empty."""

    op: int
    src: Tier
    dst: Tier
    src_pages: tuple[int, ...] = ()
    dst_pages: tuple[int, ...] = ()
    keys: tuple[bytes, ...] = ()
    #: the plan this one follows (0: none): it starts when that one finished, see
    #: :mod:`kvtier.executors.chain` (a copy out of fetched pages copies what arrived)
    after: int = 0
    #: hybrid models: the other groups' objects that move with these pages (:class:`GroupRun`)
    groups: tuple[GroupRun, ...] = ()
    #: a save's owner tags, one per key (:func:`~kvtier.l3.page.owner_tag`): whose each page is, for a store's
    #: per-tenant bounds; empty: every page the namespace's own. A group's objects carry their page's tag
    owners: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        src, dst, storage = self.src, self.dst, Tier.STORAGE
        if src is storage or dst is storage:  # a save or a fetch: one key per page
            n = len(self.keys)
            whole = len(self.src_pages if src is not storage else self.dst_pages) == n
        else:
            n = len(self.src_pages)
            whole = len(self.dst_pages) == n
        if not whole:
            for pages, tier in (self.src_pages, src), (self.dst_pages, dst):
                if tier is not storage and len(pages) != n:
                    raise PageAlignmentError(f"plan {self.op}: {src.name}->{dst.name} names {len(pages)} {tier.name.lower()} pages "
                                             f"for {n} pages; every side of a plan names whole pages, one per page")

    @property
    def num_pages(self) -> int:
        return len(self.keys) if Tier.STORAGE in (self.src, self.dst) else len(self.src_pages)

    @property
    def host_pages(self) -> tuple[int, ...]:
        return self.src_pages if self.src is Tier.HOST else self.dst_pages


def copy_plan(op: int, src: Tier, src_pages, dst: Tier, dst_pages, after: int = 0, groups: tuple[GroupRun, ...] = ()) -> Transfer:
    return Transfer(op, src, dst, tuple(src_pages), tuple(dst_pages), after=after, groups=groups)


def save_plan(op: int, keys, host_pages, after: int = 0, groups: tuple[GroupRun, ...] = (), owners=()) -> Transfer:
    return Transfer(op, HOST, STORAGE, tuple(host_pages), (), tuple(keys), after, groups, tuple(owners))


def fetch_plan(op: int, keys, host_pages, groups: tuple[GroupRun, ...] = ()) -> Transfer:
    return Transfer(op, Tier.STORAGE, Tier.HOST, (), tuple(host_pages), tuple(keys), 0, groups)


class Reason(Enum):
    """Why a plan did not complete in full."""

    MISS = "miss"                # storage: a key was not there
    ERROR = "error"              # the backend or the copy raised; a store marked down
    CORRUPT = "corrupt"          # storage: an object failed its checks (deleted on read)
    CANCELLED = "cancelled"      # a prefetch's budget ran out and the rest was cancelled
    SKIPPED = "skipped"          # never started: the executor's queue was full
    INVALID = "invalid"          # refused before any byte moved: the plan names pages or keys it cannot (see plan_error)
    TIMEOUT = "timeout"          # not every rank reported it within the bound; it may still run (its host pages are held)


# Every completion answers the same questions -- ``op``, ``reason`` (None when done), ``existing`` (saves: pages
# the store already held) and ``corrupt`` (fetches: objects that failed their checks) -- so a reader never probes.


@dataclass(frozen=True, slots=True)
class Done:
    op: int
    #: saves: pages the store already held (not written again)
    existing: int = 0
    reason: ClassVar[None] = None
    corrupt: ClassVar[int] = 0


@dataclass(frozen=True, slots=True)
class CutShort:
    """The leading ``pages`` pages completed; the rest did not, for ``reason``."""

    op: int
    pages: int
    reason: Reason
    corrupt: int = 0
    existing: int = 0


@dataclass(frozen=True, slots=True)
class Failed:
    op: int
    reason: Reason
    detail: str = ""
    existing: ClassVar[int] = 0
    corrupt: ClassVar[int] = 0


Completion = Done | CutShort | Failed


def completed_pages(c: Completion, num_pages: int) -> int:
    """Leading pages of the plan that completed."""
    if type(c) is Done:
        return num_pages
    return c.pages if type(c) is CutShort else 0


#: the element types a checked plan's tuples may hold (checked in C: ``set(map(type, xs)) <= ...``)
_INT, _BYTES, _GROUP_RUN = frozenset({int}), frozenset({bytes}), frozenset({GroupRun})


def plan_shape_error(plan: object) -> str | None:
    """Why ``plan`` is no plan at all, or None: not a :class:`Transfer`, an op or ``after`` that is
    not a plan op, or a tier pair no executor runs. (What an executor in front of another one, the
    chain, can check without knowing the pools.)"""
    if type(plan) is not Transfer:
        return f"not a plan: {type(plan).__name__}"
    op = plan.op
    if type(op) is not int:
        return f"plan op {op!r} is not an int"
    src, dst = plan.src, plan.dst
    if type(src) is not Tier or type(dst) is not Tier or src is dst or Tier.STORAGE in (src, dst) and Tier.DEVICE in (src, dst):
        return f"plan {op}: no executor moves {src!r} -> {dst!r}"
    if type(plan.after) is not int or plan.after < 0:
        return f"plan {op}: after={plan.after!r} is not a plan op"
    if type(plan.groups) is not tuple or not set(map(type, plan.groups)) <= _GROUP_RUN:
        return f"plan {op}: groups must be a tuple of GroupRun"
    return None


def plan_error(plan: object, device_pages: int, host_pages: int, group_pages: dict[str, tuple[int, int]] | None = None,
               group_storage: Collection[str] = (), group_pools: dict[str, tuple[str | None, str | None]] | None = None) -> str | None:
    """Why an executor must refuse ``plan`` before any byte moves, or None: its shape
    (:func:`plan_shape_error`), a page id that is not an integer in ``[0, pages)`` of its pool, a
    destination written twice in one pool (across the page run and every group run: see
    :func:`_written_twice`), keys that are not bytes, sides of different lengths, or objects of a
    KV group the executor has no pools for (``group_pages``: each group's (device, host) pool
    sizes; ``group_storage``: the groups it can save and fetch; ``group_pools``: the pools a group's
    objects are written to, :func:`pools_written`), named the same way. A plan that crossed a pipe
    was unpickled without ``__post_init__``, so nothing about it is taken on trust."""
    why = plan_shape_error(plan)
    if why is not None:
        return why
    for run in plan.groups:
        why = _group_run_error(plan, run, group_pages or {}, group_storage)
        if why is not None:
            return why
    op, src, dst = plan.op, plan.src, plan.dst
    sizes = {Tier.DEVICE: device_pages, Tier.HOST: host_pages}
    n = None
    for side, pages, tier in (("source", plan.src_pages, src), ("destination", plan.dst_pages, dst)):
        if type(pages) is not tuple:
            return f"plan {op}: {side} pages are a {type(pages).__name__}, not a tuple of page ids"
        if tier is Tier.STORAGE:
            if pages:
                return f"plan {op}: the storage side is named by keys, yet it lists {len(pages)} page ids"
            continue
        arr = np.asarray(pages) if pages else np.zeros(0, dtype=np.int64)
        if arr.ndim != 1 or arr.dtype.kind not in "iu" or bool in set(map(type, pages)):
            return f"plan {op}: {tier.name.lower()} pages {pages[:8]!r} are not page ids (integers)"
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= sizes[tier]):
            bad = int(arr.min()) if int(arr.min()) < 0 else int(arr.max())
            return f"plan {op}: {tier.name.lower()} page {bad} is outside its pool of {sizes[tier]} pages"
        if side == "destination" and np.unique(arr).size != arr.size:
            return f"plan {op}: {tier.name.lower()} destination pages repeat a page: two pages would land in one"
        if n is not None and arr.size != n:
            return f"plan {op}: {n} source pages for {arr.size} destination pages"
        n = arr.size
    keys = plan.keys
    if type(keys) is not tuple or not set(map(type, keys)) <= _BYTES:
        return f"plan {op}: keys must be a tuple of bytes"
    if Tier.STORAGE in (src, dst):
        if len(keys) != n:
            return f"plan {op}: {len(keys)} keys for {n} host pages"
    elif keys:
        return f"plan {op}: a device<->host copy names {len(keys)} storage keys"
    owners = plan.owners
    if type(owners) is not tuple or owners and (dst is not Tier.STORAGE or len(owners) != len(keys)
                                                or not set(map(type, owners)) <= _INT or min(owners) < 0 or max(owners) >= 1 << 32):
        return (f"plan {op}: owners must be empty or, on a save, one owner tag (an int in [0, 2**32)) per key; "
                f"got {type(owners).__name__}{f' of {len(owners)}' if type(owners) is tuple else ''} for {len(keys)} keys")
    return _written_twice(plan, group_pools or {}) if plan.groups else None


def pools_written(full: tuple[object, object], groups: dict[str, tuple[object, object]]) -> dict[str, tuple[str | None, str | None]]:
    """Each group's (device, host) pools as :func:`plan_error` names them: None where they are the full
    pages' own (``full``: a group that shares them, one budget per tier), else the name of the first
    group over them. Pools are told apart by identity: a shared pool is the same object."""
    owner = {id(full[0]): None, id(full[1]): None}
    return {name: (owner.setdefault(id(dev), name), owner.setdefault(id(host), name)) for name, (dev, host) in groups.items()}


def _written_twice(plan: Transfer, group_pools: dict[str, tuple[str | None, str | None]]) -> str | None:
    """A destination id two of ``plan``'s runs would write in one pool -- its pages and a group's objects
    in the pools they share, or two runs of one group -- or one run writes twice. Each group's copies
    run on their own engine thread, so which landed last would be a race. (The page run alone is
    checked where its ids are.)"""
    if plan.dst is Tier.STORAGE:
        return None
    tier = plan.dst.name.lower()
    side = 0 if plan.dst is Tier.DEVICE else 1
    writers: dict[str | None, dict[int, str]] = {}
    for k, run in enumerate(plan.groups):
        pool = group_pools.get(run.group, (run.group, run.group))[side]
        if pool not in writers:
            writers[pool] = dict.fromkeys(plan.dst_pages, "the plan's pages") if pool is None else {}
        written, by = writers[pool], f"KV group {run.group!r} (run {k})"
        for i in run.dst_pages:
            if i in written:
                where = "the full pages'" if pool is None else f"KV group {pool!r}'s"
                return (f"plan {plan.op}: {tier} id {i} of {where} {tier} pool is written twice, by {written[i]} and by {by}: which "
                        "lands last would be a race; a plan writes each destination once")
            written[i] = by
    return None


def _group_run_error(plan: Transfer, run: GroupRun, group_pages: dict[str, tuple[int, int]], group_storage: Collection[str]) -> str | None:
    op = plan.op
    if run.group not in group_pages:
        return (f"plan {op}: moves objects of KV group {run.group!r}, and this executor has no pools for it: a hybrid model's other "
                "groups need their own pools (groups= of the executor)")
    storage = Tier.STORAGE in (plan.src, plan.dst)
    if storage and run.group not in group_storage:
        return f"plan {op}: KV group {run.group!r}: this executor has no L3 tier for the group's objects"
    dev, host = group_pages[run.group]
    sizes = {Tier.DEVICE: dev, Tier.HOST: host}
    n = plan.num_pages
    for name, pages in (("at", run.at), ("source", run.src_pages), ("destination", run.dst_pages)):
        if type(pages) is not tuple or not set(map(type, pages)) <= _INT:
            return f"plan {op}: KV group {run.group!r}: {name} ids must be a tuple of ints"
    if type(run.keys) is not tuple or not set(map(type, run.keys)) <= _BYTES:
        return f"plan {op}: KV group {run.group!r}: keys must be a tuple of bytes"
    sides = [(run.src_pages, plan.src), (run.dst_pages, plan.dst)]
    named = [len(ids) if tier is not Tier.STORAGE else len(run.keys) for ids, tier in sides]
    places = len(run.at) if n else named[0]  # (a plan of no pages: objects alone, no places)
    if n == 0 and run.at or not places == named[0] == named[1] or (not storage and run.keys) or (
            run.src_pages and plan.src is Tier.STORAGE) or (run.dst_pages and plan.dst is Tier.STORAGE):
        return (f"plan {op}: KV group {run.group!r}: {len(run.at)} places, {len(run.src_pages)} source ids, {len(run.dst_pages)} "
                f"destination ids and {len(run.keys)} keys do not name one object each")
    if run.at and (min(run.at) < 0 or max(run.at) >= n):
        return f"plan {op}: KV group {run.group!r}: a place outside the plan's {n} pages"
    for pages, tier in sides:
        if tier is not Tier.STORAGE and pages and (min(pages) < 0 or max(pages) >= sizes[tier]):
            return f"plan {op}: KV group {run.group!r}: a {tier.name.lower()} id outside its pool of {sizes[tier]}"
    return None


def refused(plan: object, why: str) -> Failed:
    """The completion of a plan an executor refuses (``why``: :func:`plan_error`); op -1 when it has none."""
    return Failed(plan.op if type(getattr(plan, "op", None)) is int else -1, Reason.INVALID, why)
