"""The node service's host-tier policy (:class:`~kvtier.service.index.HostIndex`), step by step with exact
page ids: a page is offered only once published and only in its namespace, a dropped client's writes
are freed unpublished and its holds released, eviction takes unheld pages deepest first, and a key
published twice keeps its first page. ``check_integrity`` after every step."""

from __future__ import annotations

import pytest

from kvtier.errors import ServiceProtocolError
from kvtier.service.index import HostIndex

A, B, C = 1, 2, 3
K = [bytes([i]) * 16 for i in range(8)]


def index(pages: int = 4) -> HostIndex:
    ix = HostIndex(pages)
    ix.attach(A, "model-x")
    ix.attach(B, "model-x")
    ix.attach(C, "model-y")
    return ix


def test_a_page_is_offered_only_once_published_and_only_in_its_namespace():
    ix = index()
    pages = ix.reserve(A, 2)  # A writes two pages: nobody is offered them yet
    assert pages == [0, 1]
    assert ix.lookup(B, K[:2]) == []
    ix.publish(A, pages, K[:2])  # A's writes completed
    ix.check_integrity()
    assert ix.lookup(C, K[:2]) == []  # another namespace: never
    assert ix.lookup(B, K[:2]) == [0, 1]  # held by A and B now
    ix.check_integrity()
    assert ix.status().held == 2 and ix.status().hit_pages == 2


def test_a_dropped_client_frees_what_it_was_writing_and_releases_what_it_held():
    ix = index()
    ix.publish(A, ix.reserve(A, 1), K[:1])
    writing = ix.reserve(A, 2)
    assert writing == [1, 2]
    ix.detach(A)  # its connection dropped mid-write
    ix.check_integrity()
    st = ix.status()
    assert (st.free, st.writing, st.ready, st.held, st.dropped_writes) == (3, 0, 1, 0, 2)
    assert ix.lookup(B, K[:1]) == [0]  # the page it finished stays, offered


def test_eviction_takes_unheld_pages_deepest_first_and_never_a_held_one():
    ix = index(pages=4)
    ix.publish(A, ix.reserve(A, 3), K[:3])  # a 3-page prefix on pages 0, 1, 2
    ix.release(A, [2, 1, 0])  # released deepest first, as a core evicts its host leaves
    assert sorted(ix.reserve(C, 2)) == [2, 3]  # the free page, then the prefix's deepest page
    ix.check_integrity()
    assert ix.lookup(A, K[:3]) == [0, 1]  # the prefix shortened from its end; A holds what is left
    assert ix.reserve(C, 1) == []  # everything else is held
    ix.release(A, [1, 0])
    ix.lookup(B, K[:1])  # B holds the first page only
    assert ix.reserve(C, 2) == [1]  # the unheld one goes; the held one never
    ix.check_integrity()
    assert ix.status().evicted_pages == 2


def test_a_key_published_twice_keeps_its_first_page_and_the_second_is_freed_when_released():
    ix = index()
    ix.publish(A, ix.reserve(A, 1), K[:1])
    ix.publish(B, ix.reserve(B, 1), K[:1])  # B computed the same page meanwhile
    ix.check_integrity()
    assert ix.lookup(C, K[:1]) == [] and ix.status().ready == 2
    ix.release(B, [1])
    ix.check_integrity()
    assert ix.status().free == 3 and ix.lookup(B, K[:1]) == [0]


@pytest.mark.parametrize("what, pages, message", [
    ("outside", [9], "page 9 is outside the region"),
    ("another client's", [0], "page 0 is not this client's"),
    ("twice", [1, 1], "page 1 is listed twice"),
])
def test_a_page_that_is_not_the_clients_is_refused_with_nothing_changed(what, pages, message):
    ix = index()
    ix.reserve(A, 1)  # page 0 is A's
    ix.reserve(B, 1)  # page 1 is B's
    before = ix.status()
    with pytest.raises(ServiceProtocolError, match=message):
        ix.release(B, pages)
    with pytest.raises(ServiceProtocolError, match=message):
        ix.publish(B, pages, K[: len(pages)])
    assert ix.status() == before
    ix.check_integrity()


def test_publish_names_the_pages_it_indexed_and_a_hold_keeps_a_page_from_eviction():
    ix = index(pages=2)
    first = ix.reserve(A, 1)
    assert ix.publish(A, first, K[:1]) == first  # indexed: the service's L3 saves these
    dup = ix.reserve(B, 1)
    assert ix.publish(B, dup, K[:1]) == []  # a key published before: a duplicate, not indexed, nothing to save
    ix.release(B, dup)
    ix.attach(-1, "model-x")  # the service's own client (its L3 saves hold pages while they read them)
    ix.hold(-1, first)
    ix.release(A, first)
    ix.check_integrity()
    assert ix.reserve(C, 2) == dup  # the held page is not evicted to make room
    ix.release(-1, first)
    ix.check_integrity()
    assert ix.reserve(C, 1) == first and ix.status().evicted_pages == 1  # let go: evicted like any unheld page
    ix.check_integrity()


class Watcher:
    """A page watcher (the service's page records' part) that refuses the pages in ``bad`` and notes what it
    was told: pages handed to writers (``got``) and pages indexed (``recorded``)."""

    def __init__(self):
        self.bad: set[int] = set()
        self.got: list[int] = []
        self.recorded: list[tuple[int, str, bytes]] = []
        self.freed: list[int] = []
        self.vacated_pages: list[int] = []

    def reserved(self, pages, client):
        self.got += pages

    def indexed(self, page, namespace, key, owner=0):
        self.recorded.append((page, namespace, key))

    def offered(self, page):
        return page not in self.bad

    def cleared(self, page):
        self.freed.append(page)

    def vacated(self, pages):
        self.vacated_pages += pages


def watched(pages: int = 4) -> tuple[HostIndex, Watcher]:
    w = Watcher()
    ix = HostIndex(pages, w)
    ix.attach(A, "model-x")
    ix.attach(B, "model-x")
    return ix, w


def test_a_page_the_watcher_refuses_ends_the_run_is_never_offered_again_and_is_freed_once_released():
    ix, w = watched()
    pages = ix.reserve(A, 3)
    ix.publish(A, pages, K[:3])
    assert w.got == pages and w.recorded == [(p, "model-x", k) for p, k in zip(pages, K[:3])]
    w.bad.add(pages[1])  # its bytes changed after they were recorded
    assert ix.lookup(B, K[:3]) == pages[:1]  # the run ends before it
    assert ix.lookup(B, K[1:3]) == [] and ix.status().corrupt_pages == 1
    ix.check_integrity()
    free = ix.status().free
    ix.release(A, [pages[1]])  # its writer held it: freed now (unindexed), never put back for lookups
    assert ix.status().free == free + 1 and ix.status().evicted_pages == 0
    ix.check_integrity()
    ix.release(A, [pages[2]])  # unheld now; refused at the next lookup: freed at once
    w.bad.add(pages[2])
    assert ix.lookup(B, K[2:3]) == [] and ix.status().corrupt_pages == 2 and ix.status().free == free + 2
    ix.check_integrity()


def test_an_adopted_index_offers_what_verified_and_keeps_its_pages_and_the_parked_ones_out_of_reuse_until_released():
    ix = HostIndex(7)
    ix.adopt([(4, "model-x", K[0]), (1, "model-x", K[1]), (6, "model-y", K[0])], parked=[2, 5])
    ix.attach(A, "model-x")
    ix.check_integrity()
    assert ix.status().parked_pages == 2 and ix.status().free == 2
    assert ix.lookup(A, K[:3]) == [4, 1]  # offered at once
    ix.release(A, [4, 1])
    assert sorted(ix.reserve(A, 7)) == [0, 3]  # but neither evicted (the adoption holds them) nor parked pages handed out
    ix.check_integrity()
    assert ix.release_adopted() == 3
    ix.unpark([2])
    assert ix.status().parked_pages == 1
    assert sorted(ix.reserve(A, 7)) == [1, 2, 4, 6]  # unheld now: evicted for room; page 5 stays parked
    ix.check_integrity()
    assert ix.status().evicted_pages == 3


def test_a_page_freed_unwritten_is_cleared_for_the_watcher_so_no_restart_parks_it_but_an_evicted_one_keeps_its_record():
    ix, w = watched(6)
    a = ix.reserve(A, 3)
    ix.release(A, [a[0]])  # given up unwritten
    ix.publish(A, a[1:], K[:2])
    b = ix.reserve(B, 2)
    ix.publish(B, b[:1], K[:1])  # a duplicate of A's key: B's alone, freed when released
    ix.release(B, b[:1])
    ix.detach(B)  # b[1] was still being written
    assert sorted(w.freed) == sorted([a[0], b[0], b[1]])
    ix.release(A, a[1:])
    ix.reserve(A, 6)  # evicts A's two pages for room: their bytes are still their keys', their records kept
    assert sorted(w.freed) == sorted([a[0], b[0], b[1]])
    ix.check_integrity()
