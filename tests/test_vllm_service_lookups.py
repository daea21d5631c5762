"""vLLM's scheduler asks the node service once per step (``service_lookups``, default ``step``).

vLLM asks the connector about waiting requests one at a time. Attached to the service, a request whose
pages the engine does not hold whole is answered "not yet" (None); at the step's end the service is asked
about all of them in one round trip (:meth:`ServiceClient.lookup_many`), and the next step answers them
from the tree. These tests drive the scheduler side and its workers as vLLM does (:mod:`support.vllm_split`)
against a real ``kvtier serve``, and count the round trips on the real client.
"""

from __future__ import annotations

import pytest

from support.service import running_service
from support.vllm_split import BS, Engine, finish, request, serve

from kvtier.service import client as client_mod
from kvtier.service.client import ServiceClient

pytestmark = pytest.mark.timeout(300)

#: prompts of three full blocks and a partial tail (13 tokens: the last prompt token is always computed)
PROMPTS = [list(range(1000 * i, 1000 * i + 13)) for i in range(1, 6)]
#: shares the first two blocks of PROMPTS[0], then diverges
FORK = PROMPTS[0][:8] + list(range(9000, 9005))
MISSES = [list(range(7000, 7013)), list(range(8000, 8013))]
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
