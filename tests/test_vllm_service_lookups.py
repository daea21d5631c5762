"""vLLM's scheduler asks the node service once per step (``service_lookups``, default ``step``).

vLLM asks the connector about waiting requests one at a time. Attached to the service, a request whose
pages the engine does not hold whole is answered "not yet" (None); at the step's end the service is asked
about all of them in one round trip (:meth:`ServiceClient.lookup_many`), and the next step answers them
from the tree. These tests drive the scheduler side and its workers as vLLM does (:mod:`support.vllm_split`)
against a real ``kvtier serve``, and count the round trips on the real client.
"""

from __future__ import annotations

import pytest

from support.service import running_service, stop
from support.vllm_split import BS, Engine, finish, request, serve

from kvtier.service import client as client_mod
from kvtier.service.client import ServiceClient

pytestmark = pytest.mark.timeout(300)

#: prompts of three full blocks and a partial tail (13 tokens: the last prompt token is always computed)
PROMPTS = [list(range(1000 * i, 1000 * i + 13)) for i in range(1, 6)]
#: shares the first two blocks of PROMPTS[0], then diverges
FORK = PROMPTS[0][:8] + list(range(9000, 9005))
MISSES = [list(range(7000, 7013)), list(range(8000, 8013))]
P0, P1 = list(range(1000, 1013)), list(range(2000, 2013))
#: vLLM's blocks engine ``a`` computed each prompt in (distinct, so a page served under another key is seen); 15 is the tails'
BLOCKS = [[3 * i, 3 * i + 1, 3 * i + 2, 15] for i in range(len(PROMPTS))]


@pytest.fixture
def lookup_calls(monkeypatch):
    """The round trips that carry lookups, counted on the real client (each one frame)."""
    calls = []
    real = ServiceClient._call

    def counted(self, ops, deadline):
        if any(op.get("op") == "lookup" for op in ops):
            calls.append(sum(op.get("op") == "lookup" for op in ops))
        return real(self, ops, deadline)

    monkeypatch.setattr(ServiceClient, "_call", counted)
    return calls


def _publish(a: Engine) -> list[list[list[bytes]]]:
    """Engine ``a`` computes every prompt; each prompt's pages as its ranks' bytes."""
    pages = []
    for i, (tokens, blocks) in enumerate(zip(PROMPTS, BLOCKS)):
        _req, external, hit = serve(a, f"a{i}", tokens, blocks)
        assert external == 0 and hit["offloaded_pages"] == 3
        pages.append([[a.page(r, b) for b in blocks[:3]] for r in range(2)])
    return pages


@pytest.mark.parametrize("mode", ["step", "request"])
def test_a_steps_waiting_requests_reach_the_service_in_one_round_trip_and_load_bit_exact(tmp_path, lookup_calls, mode):
    """Eight waiting requests (five of another engine's prompts, one that forks from the first after two
    pages, two misses). ``step``: each is answered "not yet", the step's end asks the service about all of
    them in one round trip, and the next step answers every one from the tree with no round trip. ``request``:
    each is answered at once, a round trip each. Either way the answers are the same, and every page loads
    into the engine's blocks bit-exact, each rank its own shard."""
    with running_service(tmp_path) as svc:
        a = Engine(None, seed=1, service=svc.socket)
        b = Engine(None, seed=2, service=svc.socket, service_lookups=mode)
        try:
            originals = _publish(a)
            lookup_calls.clear()
            reqs = [request(f"b{i}", t) for i, t in enumerate(PROMPTS + [FORK] + MISSES)]
            first = [b.scheduler.get_num_new_matched_tokens(r, 0) for r in reqs]
            if mode == "step":
                assert first == [(None, False)] * len(reqs) and lookup_calls == []  # vLLM skips them this step
                b.step()  # nothing scheduled; the step's end asks the service
                assert lookup_calls == [len(reqs)]  # one frame, a lookup op per request
                assert (b.scheduler.lookup_batches, b.scheduler.batched_requests) == (1, len(reqs))
                answers = [b.scheduler.get_num_new_matched_tokens(r, 0) for r in reqs]
                assert lookup_calls == [len(reqs)]  # answered from the tree
            else:
                answers = first
                assert len(lookup_calls) == len(reqs) and b.scheduler.lookup_batches == 0
            assert answers == [(3 * BS, False)] * 5 + [(2 * BS, False)] + [(0, False)] * 2
            # a request the engine holds whole is answered at once, in either mode
            assert b.scheduler.get_num_new_matched_tokens(request("again", PROMPTS[2]), 0) == (3 * BS, False)
            for i, (tokens, expected) in enumerate(zip(PROMPTS, originals)):
                _req, external, hit = serve(b, f"c{i}", tokens, [0, 1, 2, 4])
                assert external == 3 * BS and hit["host_pages"] == 3
                assert [[b.page(r, blk) for blk in (0, 1, 2)] for r in range(2)] == expected
                assert b.load_errors[-1] == set()
            b.scheduler.core.check_integrity()
        finally:
            b.close()
            a.close()


def test_a_step_asks_about_shared_prefixes_once_and_the_answer_names_what_each_request_took(tmp_path, lookup_calls):
    """Three requests of one prompt and one that forks from it: the batch asks each key once (a page is
    never asked twice in one frame), hangs the fork's own pages below the shared ones, and each request's
    record counts the pages it took from the service."""
    with running_service(tmp_path) as svc:
        a = Engine(None, seed=1, service=svc.socket)
        b = Engine(None, seed=2, service=svc.socket)
        try:
            _publish(a)
            serve(a, "fork", FORK, [0, 1, 2, 4])  # the fork's third page: a's too now
            lookup_calls.clear()
            reqs = [request(f"b{i}", t) for i, t in enumerate([PROMPTS[0], PROMPTS[0], FORK, PROMPTS[0]])]
            assert [b.scheduler.get_num_new_matched_tokens(r, 0)[0] for r in reqs] == [None] * 4
            b.step()
            # one frame: PROMPTS[0]'s three keys once, and the fork's own third key
            assert lookup_calls == [2]
            assert [b.scheduler.get_num_new_matched_tokens(r, 0) for r in reqs] == [(3 * BS, False)] * 4
            assert lookup_calls == [2]
            assert b.scheduler.core.stats.shared_host_pages == 4
            assert [h.shared_host_pages for h in list(b.scheduler.hits)[-4:]] == [3, 0, 1, 0]
            b.scheduler.core.check_integrity()
        finally:
            b.close()
            a.close()


def test_a_request_whose_adopted_pages_were_evicted_before_vllm_came_back_is_asked_about_once_more(tmp_path, lookup_calls):
    """An engine whose share of the region is one prompt's pages: a step's batch adopts two prompts, the
    second's pages evicting the first's. vLLM's next ask about the first finds the tree short of what the
    batch left, so it is asked about in the next step's batch again (never answered with a miss the
    service could serve), and then loads bit-exact."""
    with running_service(tmp_path) as svc:
        a = Engine(None, seed=1, service=svc.socket)
        b = Engine(None, seed=2, service=svc.socket, host_pages=3)
        try:
            originals = _publish(a)
            lookup_calls.clear()
            r0, r1 = request("r0", PROMPTS[0]), request("r1", PROMPTS[1])
            assert [b.scheduler.get_num_new_matched_tokens(r, 0)[0] for r in (r0, r1)] == [None, None]
            b.step()
            assert lookup_calls == [2]
            # r1's pages made room for themselves out of r0's: r0 is asked about again, r1 is answered
            assert [b.scheduler.get_num_new_matched_tokens(r, 0) for r in (r0, r1)] == [(None, False), (3 * BS, False)]
            b.scheduler.request_finished(r1)  # (aborted before it was scheduled)
            b.step()
            assert lookup_calls == [2, 1]
            assert b.scheduler.get_num_new_matched_tokens(r0, 0) == (3 * BS, False)
            b.scheduler.update_state_after_alloc(r0, 3 * BS)
            r0.num_computed_tokens = 3 * BS
            b.step(new=[(r0, [0, 1, 2, 4], len(PROMPTS[0]) - 3 * BS)])
            assert [[b.page(r, blk) for blk in (0, 1, 2)] for r in range(2)] == originals[0] and b.load_errors[-1] == set()
            finish(b, r0)
            b.scheduler.core.check_integrity()
        finally:
            b.close()
            a.close()


def test_lookup_many_splits_runs_over_frames_and_equals_a_lookup_of_each(tmp_path, monkeypatch):
    """Runs longer than a frame's bytes go on in the next frame while their chunk was whole; a run that
    stopped is not asked further; the pages equal one lookup per run (another client's)."""
    from support.service_peer import NAMESPACE, SPEC

    from kvtier.service.region import RegionFormat

    fmt = RegionFormat.of(SPEC, "page_first")
    keys = [bytes([i]) * 16 for i in range(1, 41)]
    with running_service(tmp_path) as svc:
        writer = ServiceClient(svc.socket, NAMESPACE, fmt)
        reader = ServiceClient(svc.socket, NAMESPACE, fmt)
        other = ServiceClient(svc.socket, NAMESPACE, fmt)
        try:
            pages = writer.reserve(30)
            writer.publish(pages, keys[:30])  # keys 30..39 were never written
            writer.status()  # (a note: ordered before what follows on this connection)
            runs = [keys[:12], keys[12:35], [keys[39]], keys[35:39], keys[20:25]]
            expected = [other.lookup(r) for r in runs[:4]]
            frames = []
            real = ServiceClient._call

            def counted(self, ops, deadline):
                frames.append(len(ops))
                return real(self, ops, deadline)

            monkeypatch.setattr(ServiceClient, "_call", counted)
            monkeypatch.setattr(client_mod, "SPLIT_BYTES", 10 * (2 * 16 + 3) + client_mod._OP_BYTES)  # ten keys a frame
            found = reader.lookup_many(runs)
            assert found[:4] == expected and [len(p) for p in found] == [12, 18, 0, 0, 0]
            # ... and the last run's keys were held by the second already: a run stops at a page the client holds
            assert frames == [1, 2, 1, 2, 2]  # 12 | 2+8 | 10 | 5 (none written: the run stops)+1 | 4+4
        finally:
            for c in (writer, reader, other):
                c.close()


# ---- what a review found (each failed on the first version) ----------------------------------------


def _ask(b, req):
    ext, _ = b.scheduler.get_num_new_matched_tokens(req, req.num_computed_tokens)
    if ext is None:
        b.step()
        ext, _ = b.scheduler.get_num_new_matched_tokens(req, req.num_computed_tokens)
    return ext


@pytest.mark.parametrize("mode", ["request", "step"])
def test_a_preempted_request_comes_back_to_pages_the_service_holds(tmp_path, mode):
    """b computes r0 itself (the service had nothing when r0 was first asked about), publishes it; another
    request's pages evict r0's from b's small tree; r0 is preempted and vLLM asks about it again: the service
    still holds its three pages."""
    with running_service(tmp_path) as svc:
        a = Engine(None, seed=1, service=svc.socket)
        b = Engine(None, seed=2, service=svc.socket, host_pages=3, service_lookups=mode)
        try:
            serve(a, "a1", P1, [0, 1, 2, 15])  # another engine's prompt P1 on the service
            r0 = request("r0", P0)
            assert _ask(b, r0) == 0  # nothing anywhere yet
            b.scheduler.update_state_after_alloc(r0, 0)
            b.step(new=[(r0, [0, 1, 2, 4], len(P0))])  # prefill; its pages go out to the service
            for _ in range(5):
                b.settle()
            # another waiting request adopts P1 from the service: b's LRU makes room out of r0's pages
            r1 = request("r1", P1)
            assert _ask(b, r1) == 3 * BS
            b.scheduler.request_finished(r1)
            # r0 preempted: vLLM frees its blocks, resets num_computed_tokens, and asks again
            b.step(preempted=["r0"])
            r0.num_computed_tokens = 0
            assert _ask(b, r0) == 3 * BS, f"{mode}: the service holds r0's pages, the answer is a miss"
            b.scheduler.core.check_integrity()
        finally:
            b.close()
            a.close()


@pytest.mark.parametrize("mode", ["request", "step"])
def test_pages_of_a_lost_service_are_not_offered_to_a_request_asked_again(tmp_path, mode):
    """b adopted P0 for r0 (answered a host hit, not scheduled: vLLM could not allocate, or preempted it);
    the service is lost before vLLM asks about r0 again: the lost region's pages must not be offered."""
    with running_service(tmp_path) as svc:
        a = Engine(None, seed=1, service=svc.socket)
        b = Engine(None, seed=2, service=svc.socket, service_lookups=mode)
        try:
            serve(a, "a0", P0, [0, 1, 2, 15])
            r0 = request("r0", P0)
            assert _ask(b, r0) == 3 * BS
            a.close()
            stop(svc.proc)
            r1 = request("r1", P1)  # another waiting request: its lookup (or its step's batch) finds the service gone
            assert _ask(b, r1) == 0
            assert b.scheduler.leased.lost
            ext = _ask(b, r0)
            assert ext == 0, f"{mode}: offered {ext} tokens of a lost service's region"
        finally:
            b.close()


def test_a_request_vllm_holds_on_device_whole_is_not_made_to_wait_a_step(tmp_path):
    """vLLM's own prefix cache holds all three pages kvtier could offer (num_computed_tokens=12): whatever the
    service holds, the answer is 0 -- answering 'not yet' only costs the request a step (and the batch adopts
    pages no one asked for)."""
    with running_service(tmp_path) as svc:
        b = Engine(None, seed=2, service=svc.socket)
        try:
            r0 = request("r0", P0)
            assert b.scheduler.get_num_new_matched_tokens(r0, 3 * BS) == (0, False)
        finally:
            b.close()


def test_hit_records_count_pages_taken_from_the_service_once(tmp_path):
    """r0's adopted pages are counted in its first answer's record; asked again (vLLM could not allocate its
    blocks this step), nothing more was taken from the service: the records together say 3, as
    core.stats.shared_host_pages does (service_lookups='request' says 3 + 0)."""
    with running_service(tmp_path) as svc:
        a = Engine(None, seed=1, service=svc.socket)
        b = Engine(None, seed=2, service=svc.socket)
        try:
            serve(a, "a0", P0, [0, 1, 2, 15])
            r0 = request("r0", P0)
            assert _ask(b, r0) == 3 * BS
            assert _ask(b, r0) == 3 * BS  # the next step: asked again
            records = [h.shared_host_pages for h in b.scheduler.hits if h.req_id == "r0"]
            assert b.scheduler.core.stats.shared_host_pages == 3
            assert sum(records) == 3, records
        finally:
            b.close()
            a.close()


def _held(b):
    """What the service counts held and leased for ``b``, the one engine attached."""
    (me,) = b.scheduler.leased.client.status()["engines"]
    return me["held"] + me["leased"]


@pytest.mark.parametrize("share", [2, 32])
def test_a_steps_batch_leaves_the_service_holding_only_what_the_engine_books(tmp_path, share):
    """Batches of forks, duplicates and prompts over a small share: every page a lookup held for b is adopted
    (in b's books) or released."""
    FORK = P0[:8] + list(range(9000, 9005))
    with running_service(tmp_path) as svc:
        a = Engine(None, seed=1, service=svc.socket)
        b = Engine(None, seed=2, service=svc.socket, host_pages=share)
        try:
            for i, t in enumerate([P0, P1, FORK]):
                serve(a, f"a{i}", t, [0, 1, 2, 15])
            a.close()
            reqs = [request(f"r{i}", t) for i, t in enumerate([FORK, P0, P1, P0, FORK])]
            for _ in range(4):
                for r in reqs:
                    b.scheduler.get_num_new_matched_tokens(r, 0)
                b.step()
                b.scheduler.core.check_integrity()
                assert _held(b) == b.scheduler.leased.num_used, (_held(b), b.scheduler.leased.num_used)
        finally:
            b.close()


def test_a_page_the_service_holds_is_never_a_miss_because_the_tree_evicted_it(tmp_path):
    """Four waiting prompts over a share of one prompt: each batch keeps only its last request's pages. A
    request whose batches ran out is asked about alone (one round trip), never answered a miss the service
    could serve."""
    prompts = [list(range(1000 * i, 1000 * i + 13)) for i in range(1, 5)]
    with running_service(tmp_path) as svc:
        a = Engine(None, seed=1, service=svc.socket)
        b = Engine(None, seed=2, service=svc.socket, host_pages=3)
        try:
            for i, t in enumerate(prompts):
                serve(a, f"a{i}", t, [0, 1, 2, 15])
            waiting = [request(f"r{i}", t) for i, t in enumerate(prompts)]
            answers = {}
            for _ in range(6):
                for r in list(waiting):
                    ext, _ = b.scheduler.get_num_new_matched_tokens(r, 0)
                    if ext is not None:
                        answers[r.request_id] = ext
                        waiting.remove(r)
                        b.scheduler.request_finished(r)  # (scheduled: out of the waiting queue)
                b.step()
            assert answers == {f"r{i}": 3 * BS for i in range(4)}, answers
        finally:
            b.close()
            a.close()
