"""The vLLM connector's scheduler side and one worker of a hybrid model -- a sliding-window group beside a full one --
driven the way vLLM drives them, with no engine (tests/test_vllm_hybrid_service.py; :mod:`support.vllm_split` is the
full-attention version). Block ids come in per group, as vLLM's hybrid KV cache manager hands them out."""

from __future__ import annotations

import pickle
import time
from types import SimpleNamespace

import torch

from kvtier.integrations.vllm.groups import VllmGroup
from kvtier.integrations.vllm.layout import ModelShape
from kvtier.integrations.vllm.options import ConnectorOptions
from kvtier.integrations.vllm.scheduler import ConnectorScheduler
from kvtier.integrations.vllm.worker import ConnectorWorker
from support.vllm_split import request

BS, HEADS, HEAD, BLOCKS = 4, 1, 8, 64
SHAPE = ModelShape("tiny", BS, HEADS, HEAD)
WINDOW_LAYER, FULL_LAYER = "model.layers.0.attn", "model.layers.1.attn"
LAYERS = (WINDOW_LAYER, FULL_LAYER)
#: a sliding window of 8 tokens (vLLM reads the 7 before a boundary) beside full attention
GROUPS = [VllmGroup(0, "window", "sliding_window", (WINDOW_LAYER,), BS, window=7, spec_kind="sliding_window", sliding_window=8),
          VllmGroup(1, "full", "full", (FULL_LAYER,), BS, spec_kind="full_attention")]


class HybridEngine:
    """One engine of ``ranks`` tensor-parallel ranks on the node service at ``socket``: the scheduler side and a worker per
    rank, vLLM's step protocol in between; the KV of each layer random (``seed``), each rank's its own (its heads)."""

    def __init__(self, socket: str, seed: int, host_pages: int = 32, ranks: int = 1, **options):
        self.options = ConnectorOptions.from_extra_config({"host_pages": host_pages, "service": socket, **options})
        g = torch.Generator().manual_seed(seed)
        self.kvs = [{n: torch.randn(BLOCKS, HEADS, BS, 2 * HEAD, generator=g).to(torch.bfloat16) for n in LAYERS} for _ in range(ranks)]
        self.kv = self.kvs[0]
        self.workers = [ConnectorWorker(self.options, SHAPE, "tiny", r, GROUPS, tp_size=ranks) for r in range(ranks)]
        self.worker = self.workers[0]
        # (a handshake crosses a process boundary in vLLM)
        shakes = {r: pickle.loads(pickle.dumps(w.register(self.kvs[r]))) for r, w in enumerate(self.workers)}
        self.scheduler = ConnectorScheduler(self.options, BS, ranks, "tiny", GROUPS)
        self.scheduler.handshake(shakes)
        self.received: set[str] = set()
        self._received: list[set[str]] = [set() for _ in self.workers]
        self.failed: set[str] = set()
        self.sending: list[set[str]] = []

    def step(self, new=(), cached=(), forward=None):
        """One step: ``new`` / ``cached`` = [(request, (window blocks, full blocks) of this step, tokens scheduled)]; per
        layer its load waited for, ``forward(layer)`` (the layer writes its KV), then its copy out released."""
        def blocks(b):
            return None if b is None else tuple(list(x) for x in b)

        out = SimpleNamespace(
            num_scheduled_tokens={r.request_id: n for r, _b, n in [*new, *cached]},
            scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id, block_ids=blocks(b), num_computed_tokens=r.num_computed_tokens)
                                for r, b, _n in new],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[r.request_id for r, _b, _n in cached],
                                                  new_block_ids=[blocks(b) for _r, b, _n in cached], resumed_req_ids=set(),
                                                  num_computed_tokens=[r.num_computed_tokens for r, _b, _n in cached]),
            preempted_req_ids=set())
        meta = pickle.loads(pickle.dumps(self.scheduler.build_meta(out)))
        agg, sending, failed = None, set(), set()
        for r, w in enumerate(self.workers):
            w.wait_copies(meta.preempted_copies)
            w.begin_step(meta)
            for layer in LAYERS:
                w.wait_layer(layer)
                if forward is not None:
                    forward(layer)
                w.save_layer(layer)
            w.finish_step()
            sending |= w.finished_sending()
            done, bad = w.finished_recving()
            self._received[r] |= done
            failed |= bad
            w.take_load_errors()
            m = w.take_results()
            m = pickle.loads(pickle.dumps(m)) if m is not None else None
            agg = m if agg is None else (agg.aggregate(m) if m is not None else agg)  # (vLLM's KVOutputAggregator)
        self.sending.append(sending)
        self.received = set.intersection(*self._received)  # (vLLM: a load is finished once every rank said so)
        self.failed |= failed
        self.scheduler.update_connector_output(agg)
        for r, _b, n in [*new, *cached]:
            r.num_computed_tokens += n

    def settle(self, bound_s: float = 30.0) -> None:
        """Steps until no plan is in flight (bounded)."""
        deadline = time.monotonic() + bound_s
        while True:
            for w in self.workers:
                w.drained_stats()
            self.step()
            if not self.scheduler.core.plans_in_flight:
                return
            assert time.monotonic() < deadline, "plans still in flight"
            time.sleep(0.01)

    def serve(self, rid: str, tokens: list[int], window_blocks, full_blocks) -> tuple[int, bool]:
        """A request as vLLM runs it: asked about (again after a step while the connector answers "not yet"), its blocks
        allocated, its asynchronous load waited for, its prefill in one step, finished. (external tokens, load failed)."""
        req = request(rid, tokens)
        external, load = self.scheduler.get_num_new_matched_tokens(req, 0)
        if external is None:
            self.step()
            external, load = self.scheduler.get_num_new_matched_tokens(req, 0)
        blocks = (list(window_blocks), list(full_blocks))
        self.scheduler.update_state_after_alloc(req, external, blocks)
        failed = False
        if load:
            deadline = time.monotonic() + 30
            while rid not in self.received:
                assert time.monotonic() < deadline, "the load never finished"
                for w in self.workers:
                    w.drained_stats()
                self.step()
            failed = rid in self.failed
            external = 0 if failed else external
        req.num_computed_tokens = external
        self.step(new=[(req, blocks, len(tokens) - external)])
        keep, _params = self.scheduler.request_finished(req)
        if keep:
            self.settle()
        return external, failed

    def block(self, layer: str, block: int, rank: int = 0) -> bytes:
        return self.kvs[rank][layer][block].view(torch.uint8).numpy().tobytes()

    def close(self) -> None:
        for w in self.workers:
            w.close()
        self.scheduler.shutdown()
