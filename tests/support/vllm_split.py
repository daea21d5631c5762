"""The vLLM connector's scheduler side and its workers driven the way vLLM drives them, with no engine
(tests/test_vllm_split.py, tests/test_vllm_service.py)."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import torch

from kvtier.integrations.vllm.layout import ModelShape
from kvtier.integrations.vllm.options import ConnectorOptions
from kvtier.integrations.vllm.scheduler import ConnectorScheduler
from kvtier.integrations.vllm.worker import ConnectorWorker

BS, HEADS, HEAD, LAYERS, BLOCKS = 4, 1, 8, 2, 16
SHAPE = ModelShape("tiny", BS, HEADS, HEAD)
#: an MLA model's latent: every rank holds the same (vLLM replicates it across tensor-parallel ranks)
MLA_SHAPE = ModelShape("tiny-mla", BS, 1, 0, use_mla=True, kv_lora_rank=12, qk_rope_dim=4)


class Engine:
    """One engine: a scheduler side and ``ranks`` workers, with vLLM's step protocol in between (``mla``: an
    MLA model, every rank's latent the same)."""

    def __init__(self, url: str | None, ranks: int = 2, seed: int = 0, host_pages: int = 32, mla: bool = False, shared_latent: bool = True,
                 **options):
        extra = {"host_pages": host_pages, **({"storage_url": url} if url else {}), **options}
        self.options = ConnectorOptions.from_extra_config(extra)
        g = torch.Generator().manual_seed(seed)
        if mla:
            latent = {f"layer{i}": torch.randn(BLOCKS, BS, 16, generator=g).to(torch.bfloat16) for i in range(LAYERS)}
            self.kv = [{n: t.clone() for n, t in latent.items()} for _ in range(ranks)]
        else:
            self.kv = [{f"layer{i}": torch.randn(BLOCKS, HEADS, BS, 2 * HEAD, generator=g).to(torch.bfloat16) for i in range(LAYERS)}
                       for _ in range(ranks)]
        shape, name = (MLA_SHAPE, "tiny-mla") if mla else (SHAPE, "tiny")
        self.workers = [ConnectorWorker(self.options, shape, name, r, tp_size=ranks, shared_latent=shared_latent) for r in range(ranks)]
        shakes = {r: pickle.loads(pickle.dumps(w.register(self.kv[r]))) for r, w in enumerate(self.workers)}
        self.scheduler = ConnectorScheduler(self.options, BS, ranks, name)
        self.scheduler.handshake(shakes)
        self.load_errors: list[set[int]] = []
        #: per step, what each rank reported in get_finished (finished sending)
        self.finished_sending: list[list[set[str]]] = []
        #: every step's connector metadata, in order
        self.metas: list = []

    def step(self, new=(), cached=(), forward=None, announce_layers=True, preempted=()):
        """One vLLM step: ``new`` = [(request, block_ids, scheduled_tokens)], ``cached`` likewise.

        Per layer, as vLLM's attention wrapper: wait for its load, ``forward(rank, layer)`` (the
        layer writes its KV), then ``save_kv_layer`` -- unless ``announce_layers`` is False."""
        out = SimpleNamespace(
            num_scheduled_tokens={r.request_id: n for r, _b, n in [*new, *cached]},
            scheduled_new_reqs=[
                SimpleNamespace(req_id=r.request_id, block_ids=(list(b),), num_computed_tokens=r.num_computed_tokens) for r, b, _n in new
            ],
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=[r.request_id for r, _b, _n in cached],
                new_block_ids=[None for _ in cached],
                resumed_req_ids=set(),
                num_computed_tokens=[r.num_computed_tokens for r, _b, _n in cached],
            ),
            preempted_req_ids=set(preempted),
        )
        meta = pickle.loads(pickle.dumps(self.scheduler.build_meta(out)))  # it crosses a process boundary in vLLM
        metas, errors, sending = [], set(), []
        for w in self.workers:
            w.wait_copies(meta.preempted_copies)  # handle_preemptions, before the forward
            w.begin_step(meta)  # (the connector's _begin_step)
            for layer in range(LAYERS):
                w.wait_layer(f"layer{layer}")
                if forward is not None:
                    forward(w.tp_rank, layer)
                if announce_layers:
                    w.save_layer(f"layer{layer}")
            w.finish_step()
            sending.append(w.finished_sending())  # get_finished
            errors |= w.take_load_errors()
            m = w.take_results()
            metas.append(pickle.loads(pickle.dumps(m)) if m is not None else None)
        agg = None
        for m in metas:  # vLLM's KVOutputAggregator: the first rank's meta aggregates the others
            agg = m if agg is None else (agg.aggregate(m) if m is not None else agg)
        self.load_errors.append(errors)
        self.finished_sending.append(sending)
        self.metas.append(meta)
        self.scheduler.update_connector_output(agg)
        for r, _b, n in [*new, *cached]:
            r.num_computed_tokens += n
        return meta

    def settle(self):
        """Let the L3 writes in flight finish and their completions reach the scheduler."""
        for w in self.workers:
            w.drained_stats()
        self.step()

    def page(self, rank: int, block: int) -> list[bytes]:
        return [self.kv[rank][f"layer{i}"][block].view(torch.uint8).numpy().tobytes() for i in range(LAYERS)]

    def close(self):
        for w in self.workers:
            w.close()
        self.scheduler.shutdown()


def request(rid: str, tokens: list[int]):
    return SimpleNamespace(
        request_id=rid,
        num_prompt_tokens=len(tokens),
        prompt_token_ids=tokens,
        all_token_ids=list(tokens),
        mm_features=None,
        prompt_embeds=None,
        cache_salt=None,
        lora_request=None,
        num_computed_tokens=0,
    )


def start(engine: Engine, rid: str, tokens: list[int], blocks: list[int]):
    """Schedule a request the way vLLM does: ask the connector, allocate, run its prefill in one step."""
    req = request(rid, tokens)
    external, async_load = ask(engine, req)
    assert async_load is False
    engine.scheduler.update_state_after_alloc(req, external)
    req.num_computed_tokens = external
    engine.step(new=[(req, blocks, len(tokens) - external)])
    return req, external


def ask(engine: Engine, req) -> tuple[int, bool]:
    """vLLM's lookup of a waiting request: asked again after a step while the connector answers "not yet"
    (None: on the node service, a step's requests are asked about together when it ends) -- once at most."""
    external, async_load = engine.scheduler.get_num_new_matched_tokens(req, 0)
    if external is None:
        engine.step()  # nothing scheduled: the step's end asks the service
        external, async_load = engine.scheduler.get_num_new_matched_tokens(req, 0)
        assert external is not None, "the connector answered 'not yet' twice"
    return external, async_load


def serve(engine: Engine, rid: str, tokens: list[int], blocks: list[int]):
    """A one-step request: prefill, then finished (what kvtier offered it comes back from request_finished)."""
    req, external = start(engine, rid, tokens, blocks)
    return req, external, finish(engine, req)[1]["kvtier"]


def finish(engine: Engine, req, max_steps: int = 50) -> tuple[bool, dict | None]:
    """vLLM finishes ``req``: when the connector asks to keep its blocks, vLLM steps on (as it does while
    a finished request awaits its connector) until every rank reported it in get_finished -- once each,
    and never a request whose blocks were not kept. Returns whether they were kept."""
    keep, params = engine.scheduler.request_finished(req)
    first = len(engine.finished_sending)
    for _ in range(max_steps if keep else 0):
        engine.settle()  # a step's worth of time: the copies in flight land (then one step)
        if all(any(req.request_id in r for r in ranks) for ranks in zip(*engine.finished_sending[first:])):
            break
    reported = [sum(req.request_id in step[rank] for step in engine.finished_sending[first:]) for rank in range(len(engine.workers))]
    assert reported == ([1] * len(engine.workers) if keep else [0] * len(engine.workers)), reported
    return keep, params


TOKENS = list(range(100, 114))  # 3 full blocks of 4 and a partial tail of 2


def gate_copies(monkeypatch):
    """Copies out of the engine's blocks wait until the test opens the returned gate (bounded: 10 s)."""
    import threading

    from kvtier.transfer import engine as engine_mod

    gate = threading.Event()
    real = engine_mod.backup_pages_one_layer

    def gated(*args, **kwargs):
        gate.wait(10)
        real(*args, **kwargs)

    monkeypatch.setattr(engine_mod, "backup_pages_one_layer", gated)
    return gate
