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

from dataclasses import dataclass
from enum import Enum, IntEnum

from kvtier.errors import PageAlignmentError


class Tier(IntEnum):
    DEVICE = 0
    HOST = 1
    STORAGE = 2


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

    def __post_init__(self) -> None:
        n = self.num_pages
        sides = (self.src_pages, self.src), (self.dst_pages, self.dst)
        for pages, tier in sides:
            if len(pages if tier is not Tier.STORAGE else self.keys) != n:
                raise PageAlignmentError(f"plan {self.op}: {self.src.name}->{self.dst.name} names {len(pages)} {tier.name.lower()} pages "
                                         f"for {n} pages; every side of a plan names whole pages, one per page")

    @property
    def num_pages(self) -> int:
        return len(self.keys) if Tier.STORAGE in (self.src, self.dst) else len(self.src_pages)

    @property
    def host_pages(self) -> tuple[int, ...]:
        return self.src_pages if self.src is Tier.HOST else self.dst_pages


def copy_plan(op: int, src: Tier, src_pages, dst: Tier, dst_pages, after: int = 0) -> Transfer:
    return Transfer(op, src, dst, tuple(src_pages), tuple(dst_pages), after=after)


def save_plan(op: int, keys, host_pages, after: int = 0) -> Transfer:
    return Transfer(op, Tier.HOST, Tier.STORAGE, tuple(host_pages), (), tuple(keys), after)


def fetch_plan(op: int, keys, host_pages) -> Transfer:
    return Transfer(op, Tier.STORAGE, Tier.HOST, (), tuple(host_pages), tuple(keys))


class Reason(Enum):
    """Why a plan did not complete in full."""

    MISS = "miss"                # storage: a key was not there
    ERROR = "error"              # the backend or the copy raised; a store marked down
    CORRUPT = "corrupt"          # storage: an object failed its checks (deleted on read)
    CANCELLED = "cancelled"      # a prefetch's budget ran out and the rest was cancelled
    SKIPPED = "skipped"          # never started: the executor's queue was full


@dataclass(frozen=True, slots=True)
class Done:
    op: int
    #: saves: pages the store already held (not written again)
    existing: int = 0


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


Completion = Done | CutShort | Failed


def completed_pages(c: Completion, num_pages: int) -> int:
    """Leading pages of the plan that completed."""
    if type(c) is Done:
        return num_pages
    return c.pages if type(c) is CutShort else 0
