"""``kvtier plan --validate ENGINE``: a trace slice through the planner and through a real engine, side by side.

Both sides get the same requests (:mod:`~kvtier.app.plan.engine_slice`: one trace block per engine
page, token ids that share exactly what the trace's blocks share), the same tier sizes in pages,
the same write policy, an unbounded L3 and the same arrivals, slowed to this machine by
``time_scale`` (chosen, unless given, so the planner expects the engine busy ``target_load`` of the
time: loaded, not saturated). The planner replays the slice through the policy core with the
engine's own model and handover (:class:`~kvtier.app.plan.replay_cache.NodeShape`) and times it
with the engine's measured profile (:class:`~kvtier.app.plan.timing.ProfiledCosts`); the engine
serves it on real tiers (:mod:`~kvtier.app.plan.engine_run`, or vLLM's CPU engine with kvtier's
connector, :mod:`kvtier.app.plan.engine_vllm`).

Each configuration is served ``trials`` times, in alternation within the process (base, what-if,
base, what-if, ...), after ``warmup`` runs of the base configuration whose measurements are
discarded. Reported per configuration: hit ratio per tier, bytes each link moved, TTFT p50/p90/p99
of every trial's requests pooled, and the median absolute percentage error of each request's TTFT;
each TTFT statistic with its trial range, a bootstrap interval and the prediction judged against
them (:mod:`~kvtier.app.plan.trials`); the error split by cause, service model, queue model and end
to end (:mod:`~kvtier.app.plan.split`); with a what-if (half the host, or another write policy), the
change the planner predicts against the change measured, trial by trial.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

import numpy as np

from kvtier.app.plan.config import MAX_BLOCKS, Capacity, PlanConfig
from kvtier.app.plan.engine_run import MeasuredRun
from kvtier.app.plan.engine_slice import EngineSlice, make_slice
from kvtier.app.plan.engines import Engine, engine_model
from kvtier.app.plan.profile import Profile
from kvtier.app.plan.replay_cache import NodeShape, replay_cache
from kvtier.app.plan.split import split_error
from kvtier.app.plan.timing import ProfiledCosts, Timing, simulate
from kvtier.app.plan.trials import STATISTICS, spreads, statistic
from kvtier.app.plan.validation_report import ConfigResult, ValidationReport, change, compare, side_of
from kvtier.app.workloads.mooncake import TraceRequest
from kvtier.config import CacheConfig
from kvtier.errors import ConfigError

#: what-ifs a validation can check: a name -> what it changes
WHAT_IFS = {"half-host": "half the host pages", "write-back": "write_back instead of the write policy given",
            "write-through": "write_through instead of the write policy given"}


@dataclass(frozen=True)
class Setup:
    """One configuration both sides run."""

    name: str
    device_pages: int
    host_pages: int
    cache: CacheConfig

    def describe(self) -> dict:
        return {"name": self.name, "device_pages": self.device_pages, "host_pages": self.host_pages,
                "write_policy": self.cache.write_policy, "storage": "file L3, unbounded"}


def what_if(base: Setup, name: str) -> Setup:
    """The configuration ``name`` (:data:`WHAT_IFS`) makes of ``base``."""
    if name == "half-host":
        return replace(base, name="half host", host_pages=max(1, base.host_pages // 2))
    if name in ("write-back", "write-through"):
        policy = name.replace("-", "_")
        if policy == base.cache.write_policy:
            raise ConfigError(f"--what-if {name}: the base configuration is {policy} already; choose another --what-if or "
                              f"--cache-write-policy")
        return replace(base, name=policy, cache=replace(base.cache, write_policy=policy))
    from kvtier.errors import UnknownNameError

    raise UnknownNameError("what-if", name, WHAT_IFS)


def check_setup(eng: Engine, cache: CacheConfig, what: str | None) -> None:
    """Refuse a configuration ``eng`` cannot run, before anything does: vLLM's connector copies every block it
    computes out to host, which is write_through and nothing else."""
    if what is not None and what not in WHAT_IFS:
        from kvtier.errors import UnknownNameError

        raise UnknownNameError("--what-if", what, WHAT_IFS)
    if eng.vllm_model is None:
        return
    policies = [cache.write_policy] + ([what.replace("-", "_")] if what in ("write-back", "write-through") else [])
    for policy in policies:
        if policy != "write_through":
            raise ConfigError(f"vLLM's connector copies every block vLLM computes out to host: write_through only, not {policy}; "
                              f"validate {policy} on kvtier run's engine (--validate run), or give vLLM --what-if half-host")


def node_shape(eng: Engine) -> NodeShape:
    """The engine's model and pools as its cache builds them, and its handover (the hybrid reference
    engine's own allocation, :class:`~kvtier.app.engine.HybridObjects`)."""
    model = engine_model(eng.model)
    spec = model.group("full").attention
    if not model.is_hybrid:
        return NodeShape(spec)
    shared = tuple(g.name for g in model.groups if g.kind == "sliding_window" and g.object_spec() == spec)  # build_hybrid_cache's rule
    own = tuple(g.name for g in model.groups if g.kind != "full" and g.name not in shared)
    if eng.vllm_model is not None:  # vLLM's own allocator hands over: the planner's engine stands in for it
        return NodeShape(spec, model, shared, own, 1)
    from kvtier.app.model.hybrid import HybridConfig

    return NodeShape(spec, model, shared, own, HybridConfig().state_every, _reference_hybrid_handover)


def _reference_hybrid_handover(core, req, usable: int, total: int) -> dict[str, list[int | None]]:
    from kvtier.app.engine import HybridObjects
    from kvtier.app.model.hybrid import SLIDING, STATE

    names = {c.name for c in core.components}
    objects = HybridObjects.alloc(req, usable, total, SLIDING if SLIDING in names else None, STATE if STATE in names else None)
    return objects.handover(usable, len(req.keys)) if objects is not None else {}


@dataclass
class Prediction:
    served: list[tuple[int, int, int]]
    moves: list[tuple[int, int, int]]
    #: each request's (service, time the node stays busy after it), seconds, alone on the machine
    costs: list[tuple[float, float]]
    bytes_moved: dict[str, int]


def predict(eng: Engine, work: EngineSlice, setup: Setup) -> Prediction:
    """The planner's replay of ``work`` on ``setup`` (hits and moves; times come from :func:`predicted_times`)."""
    shape = node_shape(eng)
    host = setup.host_pages
    if eng.vllm_model is not None:
        # vLLM's one block pool holds a window page as a full page (shared on device), while kvtier's connector keeps a
        # window group's host objects in a pool of their own as large as the pages' one; the core takes a group sharing
        # both tiers' pools or neither, so the planner's host holds both pools' slots in one
        host *= 1 + len(shape.shared)
    counts = replay_cache(work.requests, shape, setup.cache, Capacity(setup.device_pages, host, MAX_BLOCKS), [0] * len(work.requests), 1,
                          moves=True)
    page = shape.spec.page_bytes
    hits = counts.hit_blocks
    moved = {"host_to_device": (hits["host"] + hits["storage"]) * page, "device_to_host": counts.backed_up_blocks * page,
             "host_to_storage": counts.storage_saved_blocks * page, "storage_to_host": hits["storage"] * page}
    return Prediction(list(counts.per_request), list(counts.moves), [], moved)


def predicted_timing(work: EngineSlice, pred: Prediction, costs: ProfiledCosts) -> Timing:
    """The planner's queue model at ``work``'s arrivals: each request's TTFT, queueing, service and drain."""
    requests = work.requests
    cfg = PlanConfig(arrival_speedup=1.0 / work.time_scale)
    return simulate(requests, [0] * len(requests), pred.served, cfg, costs, pred.moves)


def time_scale_for(requests: Sequence[TraceRequest], pred: Prediction, costs: ProfiledCosts, target_load: float) -> float:
    """Machine seconds per trace second that keep the engine busy ``target_load`` of the slice's span."""
    busy = sum(sum(costs.request(r.input_length, s, m)) for r, s, m in zip(requests, pred.served, pred.moves))
    span = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000.0 if len(requests) > 1 else 0.0
    if span <= 0:
        raise ConfigError("the slice's requests all arrive at once: there is no arrival rate to scale; give a longer --limit")
    return busy / (target_load * span)


def _median(values: Sequence[Sequence[float]]) -> list[float]:
    return [float(v) for v in np.median(np.asarray(values, dtype=float), axis=0)] if values and values[0] else []


def run_config(eng: Engine, work: EngineSlice, setup: Setup, pred: Prediction, costs: ProfiledCosts,
               reals: Sequence[MeasuredRun]) -> ConfigResult:
    """One configuration: the planner's prediction against the engine's runs of it (one per trial)."""
    timing = predicted_timing(work, pred, costs)
    pred_ttft, pred_queue = timing.per_request_ttft_s, timing.per_request_queue_s
    first = reals[0]
    pooled_ttft = np.concatenate([np.asarray(r.ttft_s, dtype=float) for r in reals])
    pooled_queue = np.concatenate([np.asarray(r.queue_s, dtype=float) for r in reals])
    predicted = side_of(pred.served, pred_ttft, pred_queue, pred.bytes_moved, work.requests, eng.page_tokens)
    measured = side_of(first.served, pooled_ttft, pooled_queue, first.bytes_moved, work.requests, eng.page_tokens)
    ttft_t, queue_t, service_t, drain_t = ([list(getattr(r, a)) for r in reals] for a in ("ttft_s", "queue_s", "service_s", "drain_s"))
    medians = {k: _median(v) for k, v in (("ttft", ttft_t), ("queue", queue_t), ("service", service_t), ("drain", drain_t))}
    rows = []
    for i, (p, m) in enumerate(zip(pred.served, first.served)):
        row = {"pages_predicted": list(p), "pages_measured": list(m), "ttft_predicted_s": round(float(pred_ttft[i]), 5),
               "ttft_measured_s": round(medians["ttft"][i], 5), "queue_predicted_s": round(float(pred_queue[i]), 5),
               "service_predicted_s": round(float(timing.per_request_service_s[i]), 5),
               "drain_predicted_s": round(float(timing.per_request_after_s[i]), 5),
               "ttft_measured_trials_s": [round(t[i], 5) for t in ttft_t]}
        for k in ("queue", "service", "drain"):
            if medians[k]:
                row[f"{k}_measured_s"] = round(medians[k][i], 5)
        rows.append(row)
    measured["wall_s"] = round(sum(r.wall_s for r in reals), 3)
    measured.update(first.extra)
    error = compare(predicted, measured, np.tile(pred_ttft, len(reals)), pooled_ttft, pred.served, first.served)
    trials = []
    for k, r in enumerate(reals):
        side = side_of(r.served, r.ttft_s, r.queue_s, r.bytes_moved, work.requests, eng.page_tokens)
        alike = sum(tuple(a) == tuple(b) for a, b in zip(pred.served, r.served))
        trials.append({"trial": k + 1, "hit_pages": side["hit_pages"], "requests_served_alike": alike, "ttft_s": side["ttft_s"],
                       "wall_s": round(r.wall_s, 3)})
    error["requests_served_alike"] = min(t["requests_served_alike"] for t in trials)
    error["hit_pages_equal"] = all(t["hit_pages"] == predicted["hit_pages"] for t in trials)
    exact = {k: float(statistic(pred_ttft, k)) for k in STATISTICS}
    spread_of = {k: asdict(v) for k, v in spreads(exact, np.asarray(ttft_t, dtype=float)).items()}
    split = split_error(work.requests, work.time_scale, timing, ttft_t, service_t, drain_t)
    return ConfigResult(setup.describe(), predicted, measured, error, rows, trials, spread_of, asdict(split))


def validate(eng: Engine, requests: list[TraceRequest], setup: Setup, profile: Profile, profile_path: str, *, workload: str, start: int = 0,
             time_scale: float | None = None, target_load: float = 0.5, what: str | None = None,
             measure: Callable[[EngineSlice, Setup], MeasuredRun] | None = None, trials: int = 3, warmup: int = 1) -> ValidationReport:
    """The slice ``requests`` on ``eng`` under ``setup`` (and ``what``, a :data:`WHAT_IFS` name), planner against engine,
    each configuration served ``trials`` times, in alternation, after ``warmup`` discarded runs of ``setup``."""
    if trials < 1:
        raise ConfigError(f"--trials is how many times each configuration is served, 1 or more; got {trials}")
    if warmup < 0:
        raise ConfigError(f"--validate-warmup is how many discarded runs of the base configuration come first, 0 or more; got {warmup}")
    check_setup(eng, setup.cache, what)
    model = engine_model(eng.model)
    profile.check_model(eng.model, model.fingerprint(), profile_path, engine=eng.name)
    other = what_if(setup, what) if what else None
    costs = ProfiledCosts(profile, eng.page_tokens, profile.page_bytes, profile_path)
    work = make_slice(requests, eng.page_tokens, eng.vocab, 1.0)
    pred = predict(eng, work, setup)
    if time_scale is None:
        time_scale = time_scale_for(work.requests, pred, costs, target_load)
    else:
        target_load = None
    work = make_slice(requests, eng.page_tokens, eng.vocab, time_scale)
    measure = measure or default_measure(eng, profile)
    setups = [(setup, pred)] + ([(other, predict(eng, work, other))] if other is not None else [])
    reals: list[list[MeasuredRun]] = [[] for _ in setups]
    runs = []
    for _ in range(warmup):  # the process's first run measures slow (caches, allocator, first calls): served, then discarded
        runs.append({"trial": 0, "configuration": setup.name, "wall_s": round(measure(work, setup).wall_s, 3), "discarded": True})
    for trial in range(1, trials + 1):  # base, what-if, base, what-if, ...: a drift of the machine falls on both alike
        for (s, _), got in zip(setups, reals):
            got.append(measure(work, s))
            runs.append({"trial": trial, "configuration": s.name, "wall_s": round(got[-1].wall_s, 3), "discarded": False})
    results = [run_config(eng, work, s, p, costs, got) for (s, p), got in zip(setups, reals)]
    return ValidationReport(eng.name, workload, len(requests), start, eng.page_tokens, round(time_scale, 6), target_load,
                            costs.describe(), results, change(*results) if other is not None else None, trials=trials, runs=runs)


def default_measure(eng: Engine, profile: Profile) -> Callable[[EngineSlice, Setup], MeasuredRun]:
    """How ``eng`` serves a slice: ``kvtier run``'s engine here, or vLLM's CPU engine in a process of its own."""
    if eng.vllm_model is not None:
        from kvtier.app.plan.engine_vllm import replay_on_vllm

        return lambda work, setup: replay_on_vllm(eng, work, setup.device_pages, setup.host_pages)
    from kvtier.app.plan.engine_run import replay_on_run_engine
    from kvtier.config import TierConfig

    return lambda work, setup: replay_on_run_engine(eng, work, TierConfig(device_pages=setup.device_pages, host_pages=setup.host_pages),
                                                    setup.cache, threads=profile.traits.threads)
