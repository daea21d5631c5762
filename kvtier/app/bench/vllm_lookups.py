"""``kvtier bench service``'s ``scheduler_steps`` rows: vLLM's scheduler side asking about waiting requests.

vLLM asks its connector about each waiting request in turn. For ``waiting`` requests whose prefixes are on
host, this times the connector's scheduler side over the steps it takes to answer them all
(``get_num_new_matched_tokens`` for each, then ``build_connector_meta``), three ways, in one run:

* ``in_process`` -- a host tier of the engine's own that holds every prefix: one step, no round trip;
* ``per_request`` -- attached to the node service, ``service_lookups="request"``: one step, a round trip
  for each request (the pages another engine published, adopted as they come);
* ``per_step`` -- attached to the node service, ``service_lookups="step"`` (the default): the first step
  answers "not yet" and asks the service about all of them in one round trip at its end, the second
  answers them from the tree. ``first_step_ms`` + ``second_step_ms`` = ``per_step_ms``.

The engines are the connector's real scheduler and worker (:class:`ConnectorScheduler`,
:class:`ConnectorWorker`) driven with vLLM's step protocol, no model: a tiny page format (bytes do not
enter a lookup); another engine computed the prompts first and published them. Each figure is the
median of ``rounds`` rounds taken in turns, each service round with an engine attached anew (its tree
empty). Nothing is asserted: figures and their ratios.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from kvtier.integrations.vllm.layout import ModelShape
from kvtier.integrations.vllm.options import ConnectorOptions
from kvtier.integrations.vllm.scheduler import ConnectorScheduler
from kvtier.integrations.vllm.worker import ConnectorWorker

BLOCK = 16
SHAPE = ModelShape("bench-lookups", BLOCK, 1, 8)
LAYERS = 2
#: a page's bytes in the service's region (every layer's K and V of one block, bf16)
PAGE_BYTES = LAYERS * BLOCK * 16 * 2


@dataclass
class SchedulerStepRow:
    waiting: int
    prompt_tokens: int
    in_process_ms: float
    per_request_ms: float
    per_step_ms: float
    first_step_ms: float
    second_step_ms: float
    #: lookup round trips to the service
    per_request_round_trips: int
    per_step_round_trips: int
    #: per_request_ms / per_step_ms, and per_step_ms / in_process_ms
    per_request_over_per_step: float
    per_step_over_in_process: float


class _Engine:
    """One engine of one rank: the connector's scheduler side and its worker, vLLM's step protocol between."""

    def __init__(self, extra: dict, blocks: int):
        options = ConnectorOptions.from_extra_config(extra)
        kv = {f"layer{i}": torch.zeros(blocks, 1, BLOCK, 16, dtype=torch.bfloat16) for i in range(LAYERS)}
        self.worker = ConnectorWorker(options, SHAPE, "bench-lookups", 0, tp_size=1)
        self.scheduler = ConnectorScheduler(options, BLOCK, 1, "bench-lookups")
        self.scheduler.handshake({0: self.worker.register(kv)})
        self.finished: set[str] = set()

    def meta(self, new=()):
        """The scheduler's half of a step (what vLLM's ``build_connector_meta`` runs)."""
        return self.scheduler.build_meta(SimpleNamespace(
            num_scheduled_tokens={r.request_id: n for r, _b, n in new},
            scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id, block_ids=(list(b),), num_computed_tokens=r.num_computed_tokens)
                                for r, b, _n in new],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]),
            preempted_req_ids=set(),
        ))

    def step(self, new=()) -> None:
        meta, w = self.meta(new), self.worker
        w.begin_step(meta)
        for layer in range(LAYERS):
            w.wait_layer(f"layer{layer}")
            w.save_layer(f"layer{layer}")
        w.finish_step()
        self.finished |= w.finished_sending()
        w.take_load_errors()
        self.scheduler.update_connector_output(w.take_results())
        for r, _b, n in new:
            r.num_computed_tokens += n

    def compute(self, rid: str, tokens: list[int]) -> None:
        """Prefill ``tokens`` into blocks 0.. and finish: its full blocks copied out (and published)."""
        req = _request(rid, tokens)
        self.scheduler.get_num_new_matched_tokens(req, 0)
        self.scheduler.update_state_after_alloc(req, 0)
        self.step([(req, range(-(-len(tokens) // BLOCK)), len(tokens))])
        keep, _ = self.scheduler.request_finished(req)
        for _ in range(2000 if keep else 0):  # bounded: its copy out lands within a few steps
            if rid in self.finished:
                break
            self.worker.drained_stats()
            self.step()

    def close(self) -> None:
        self.worker.close()
        self.scheduler.shutdown()


def _request(rid: str, tokens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, num_prompt_tokens=len(tokens), prompt_token_ids=tokens, all_token_ids=list(tokens),
                           mm_features=None, prompt_embeds=None, cache_salt=None, lora_request=None, num_computed_tokens=0)


def _asked(engine: _Engine, prompts: list[list[int]], tag: str) -> tuple[list[float], list]:
    """The connector's time in each step until every prompt (as new requests) is answered, and the answers."""
    reqs = [_request(f"{tag}-{i}", p) for i, p in enumerate(prompts)]
    times, answers = [], [None] * len(reqs)
    for _ in range(4):
        t = time.perf_counter()
        for i, r in enumerate(reqs):
            if answers[i] is None:
                answers[i] = engine.scheduler.get_num_new_matched_tokens(r, 0)[0]
        engine.meta()
        times.append(time.perf_counter() - t)
        if all(a is not None for a in answers):
            break
    for r in reqs:
        engine.scheduler.request_finished(r)
    return times, answers


def scheduler_step_rows(socket: str, waiting: tuple[int, ...], prompt_tokens: int = 256, rounds: int = 5) -> list[SchedulerStepRow]:
    """The rows for each count in ``waiting``, the prompts published to the service at ``socket`` first."""
    most = max(waiting)
    pages = prompt_tokens // BLOCK
    tokens = pages * BLOCK + 1  # (the last prompt token is always computed)
    prompts = [[1 + j + 100_000 * i for j in range(tokens)] for i in range(most)]
    share = {"host_pages": most * pages + 16}
    blocks = pages + 2
    writer = _Engine({"service": socket, **share}, blocks)
    own = _Engine(share, blocks)
    try:
        for i, p in enumerate(prompts):
            writer.compute(f"w{i}", p)
            own.compute(f"o{i}", p)
        rows = []
        for n in waiting:
            samples: dict[str, list] = {"own": [], "request": [], "step": []}
            trips = {}
            for r in range(rounds):
                samples["own"].append(_asked(own, prompts[:n], f"own{n}-{r}")[0])
                for mode in ("request", "step"):
                    engine = _Engine({"service": socket, "service_lookups": mode, **share}, blocks)
                    try:
                        client = engine.scheduler.leased.client
                        before = client.lookup_round_trips
                        times, answers = _asked(engine, prompts[:n], f"{mode}{n}-{r}")
                        if any(a != pages * BLOCK for a in answers):  # (the figures would be of something else)
                            raise RuntimeError(f"bench: {mode} lookups of {n} published prompts were not all whole host hits: "
                                               f"{answers[:4]}")
                        samples[mode].append(times)
                        trips[mode] = client.lookup_round_trips - before
                    finally:
                        engine.close()
            med = {k: [statistics.median(t[i] for t in v) * 1e3 for i in range(len(v[0]))] for k, v in samples.items()}
            own_ms, req_ms, step_ms = sum(med["own"]), sum(med["request"]), sum(med["step"])
            rows.append(SchedulerStepRow(n, pages * BLOCK, round(own_ms, 3), round(req_ms, 3), round(step_ms, 3), round(med["step"][0], 3),
                                         round(sum(med["step"][1:]), 3), trips["request"], trips["step"],
                                         round(req_ms / step_ms, 2), round(step_ms / own_ms, 2)))
        return rows
    finally:
        writer.close()
        own.close()

