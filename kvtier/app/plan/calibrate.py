"""``kvtier plan --calibrate OUT.json``: measure what the planner needs from this machine and engine.

* **Prefill** -- the engine itself, on the paths a request takes: a prompt of ``n`` tokens after a
  cached prefix of ``c`` (the prefix is computed first, untimed, so it is on device), for ``n`` on a
  geometric grid up to ``max_tokens`` and ``c`` at fixed fractions of it, up to all of it but the
  last page; each point's median of
  ``reps`` runs, fitted by :func:`~kvtier.app.plan.profile.fit_prefill` (overhead, per token,
  attention, per page).
* **Links** -- the benches' paths (:mod:`kvtier.app.bench.transfer`, :mod:`kvtier.app.bench.storage`):
  a :class:`~kvtier.transfer.engine.TransferEngine` on the configured io backend between a device and
  a host pool of the model's pages (load, backup), and a :class:`~kvtier.l3.tier.StorageTier` on
  the L3 URL (put, get), each op timed at several page counts and fitted to ``latency + bytes /
  bandwidth`` (:func:`~kvtier.app.plan.profile.fit_link`).
* **After a request** -- ``kvtier run``'s engine commits it and drains its backups and L3 saves before
  the next (:mod:`~kvtier.app.plan.engine_run`): the time from its first token until that is done,
  against the bytes moved (:func:`~kvtier.app.plan.profile.fit_after`).
* **Idle** -- a request that finds the engine idle is slower than one right after another (on a
  shared VM, tens of milliseconds, more for a longer request): a short and a long prompt timed
  after gaps of 2 ms to 1 s (:func:`measure_idle`).
* **Scheduling** -- ``kvtier run``'s engine serves one request at a time; vLLM's traits come from its
  own calibration run (:mod:`kvtier.app.plan.engine_vllm`).
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

from kvtier.app.plan.engines import Engine, engine_model
from kvtier.app.plan.profile import (LINKS, EngineTraits, IdleFit, LinkFit, PrefillFit, Profile, fit_after, fit_link, fit_prefill,
                                     median_abs_pct_error)
from kvtier.app.workloads.mooncake import TraceRequest
from kvtier.config import CacheConfig, TierConfig
from kvtier.errors import ConfigError
from kvtier.spec import KVSpec


@dataclass(frozen=True)
class CalibrationPlan:
    #: the longest prompt measured (the fit is trusted up to here: give the workload's longest)
    max_tokens: int = 4096
    #: prompt lengths on a geometric grid from two pages to ``max_tokens``
    lengths: int = 6
    #: cached prefix as fractions of the prompt; 1.0: every full page but the last a prompt may use (its last page
    #: computed alone after a long prefix: a follow-up turn, most of a trace's requests)
    cached: tuple[float, ...] = (0.0, 0.5, 0.875, 1.0)
    #: runs per point (their median is the point)
    reps: int = 3
    #: page counts per link operation
    link_pages: tuple[int, ...] = (1, 4, 16, 64)
    link_reps: int = 5
    #: idle gaps (seconds) a request is timed after, against none
    idle_gaps: tuple[float, ...] = (0.002, 0.02, 0.2, 1.0)
    #: torch intra-op threads (validation runs with the profile's)
    threads: int = 1

    def __post_init__(self) -> None:
        for name in ("max_tokens", "lengths", "reps", "link_reps", "threads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"calibration {name} must be an integer >= 1; got {v!r}")

    def prompt_lengths(self, page_tokens: int) -> list[int]:
        low = 2 * page_tokens
        if self.max_tokens <= low:
            raise ConfigError(f"--calibrate-max-tokens {self.max_tokens} leaves no room for a grid: give more than {low} "
                              f"(two {page_tokens}-token pages)")
        steps = max(self.lengths - 1, 1)
        grid = {round(low * (self.max_tokens / low) ** (i / steps)) for i in range(self.lengths)}
        return sorted(grid)


def machine() -> dict:
    """What the profile was measured on: CPUs, CPU model, load average."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu": model or platform.processor(), "load_average": list(os.getloadavg())}


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(100, vocab) for _ in range(n)]


@dataclass
class EngineTimings:
    """What :func:`measure_engine` timed: prefills (prompt tokens, cached tokens, seconds), what held the engine
    after each (bytes its tiers moved, seconds), and requests after idle gaps (gap, seconds over none)."""

    prefill: list[tuple[int, int, float]]
    after: list[tuple[float, float]]
    idle: IdleFit
    #: prefills whose prefix only host ("host") or only L3 ("storage") held: (prompt tokens, what was served, seconds)
    loads: dict[str, list[tuple[int, dict, float]]] = field(default_factory=dict)


def measure_engine(eng: Engine, plan: CalibrationPlan, progress: Callable[[str], None] | None = None) -> EngineTimings:
    """``kvtier run``'s engine ``eng`` on a cache of real tiers: the prefill grid (each point the median of
    ``plan.reps`` runs, back to back), the time each run held the engine after its first token, and
    requests that find it idle (:func:`measure_idle`)."""
    from kvtier.app.plan.engine_run import build_run_engine, run_storage, torch_threads

    ps = eng.page_tokens
    lengths = plan.prompt_lengths(ps)
    pages = 2 * (-(-max(lengths) // ps)) + 2
    storage, tmp = run_storage(None)
    engine, cache, warm = build_run_engine(eng, TierConfig(device_pages=pages, host_pages=2 * pages), CacheConfig(preallocate_nodes=False),
                                           storage)
    page_bytes = cache.spec.page_bytes
    prefill, after = [], []
    seeds = iter(range(1, 1 << 30))
    try:
        with torch_threads(plan.threads):
            warm.prefill(_prompt(2 * ps, 0, eng.vocab))
            for n in lengths:
                for frac in plan.cached:
                    cached = min(int(n * frac) // ps, (n - 1) // ps) * ps
                    runs = []
                    for _ in range(plan.reps):
                        tokens = _prompt(n, next(seeds), eng.vocab)
                        if cached:
                            engine.prefill(tokens[:cached])  # the prefix, now on device
                        # another request between: the timed one follows a request, as a queued one does, while its
                        # prefix is as cold in the CPU's caches as a prefix computed long ago
                        engine.prefill(_prompt(2 * ps, next(seeds), eng.vocab))
                        cache.wait_idle()
                        t0 = time.perf_counter()
                        r = engine.prefill(tokens)
                        cache.wait_idle()  # its commit, backups and L3 saves: what holds the engine after its first token
                        held = time.perf_counter() - t0 - r.ttft_s
                        got = r.hit_tokens
                        runs.append((got, r.ttft_s))
                        after.append((2 * (n // ps - got // ps) * page_bytes, held))  # each new full page backed up and saved
                    prefill.append((n, statistics.median_low([g for g, _ in runs]), statistics.median(t for _, t in runs)))
                    if progress is not None:
                        progress(f"prefill {n} tokens, {prefill[-1][1]} cached: {prefill[-1][2] * 1e3:.1f} ms")
            loads = {where: [sample for n in load_lengths(lengths) for sample in
                             _timed_loads(engine, cache, where, n, plan.reps, seeds, eng.vocab, progress)] for where in LOADS}
            idle = measure_idle(lambda n: engine.prefill(_prompt(n, next(seeds), eng.vocab)).ttft_s, cache.wait_idle,
                                idle_sizes(lengths), plan, progress)
    finally:
        cache.close()
        if tmp is not None:
            tmp.cleanup()
    return EngineTimings(prefill, after, idle, loads)


#: where a timed load's prefix is pushed to before the prefill that loads it
LOADS = ("host", "storage")


def load_lengths(lengths: list[int]) -> list[int]:
    """The prompt lengths loads are timed at: the grid's upper two thirds (a load of a page or two is lost in the noise)."""
    return lengths[len(lengths) // 3:]


def _timed_loads(engine, cache, where: str, n: int, reps: int, seeds, vocab: int, progress) -> list[tuple[int, dict, float]]:
    """``reps`` prefills of ``n`` tokens whose prefix (every full page but the last) only ``where`` holds: the prefix
    computed, backed up and saved (write_through), then pushed off the device (and, for ``storage``, off the host
    too), so the timed prefill loads it on the engine's own path -- per layer, through its executors."""
    ps = cache.spec.page_size
    cached = (n - 1) // ps * ps
    out = []
    for _ in range(reps):
        tokens = _prompt(n, next(seeds), vocab)
        engine.prefill(tokens[:cached])
        cache.wait_idle()
        cache.evict_device(cache.device.num_pages)
        if where == "storage":
            cache.evict_host(cache.host.num_pages)
        engine.prefill(_prompt(2 * ps, next(seeds), vocab))  # as on the grid: the timed request follows another
        cache.wait_idle()
        r = engine.prefill(tokens)
        cache.wait_idle()
        served = {"cached_tokens": r.hit_tokens,
                  "host_pages": r.host_hit_tokens // ps, "storage_pages": r.storage_hit_tokens // ps}
        out.append((n, served, r.ttft_s))
    if progress is not None:
        progress(f"{n} tokens with {cached} from {where}: {statistics.median(t for _, _, t in out) * 1e3:.1f} ms")
    return out


def load_links(fit: PrefillFit, links: dict[str, LinkFit], loads: dict[str, list[tuple[int, dict, float]]], page_bytes: int,
               device_points: Sequence[tuple[int, int, float]] = ()) -> dict[str, LinkFit]:
    """``links`` with ``host_to_device`` and ``storage_get`` as what a load adds to the engine's prefill over the same
    prefill with its prefix on the device: a host hit's excess, then an L3 hit's beyond a host hit's. The reference is the
    measured ``device_points`` (prompt, cached, seconds) of the same prompt and prefix where the grid has them (their
    median: a fit's error at one point is as large as a small load), else the ``fit``."""
    by_point: dict[tuple[int, int], list[float]] = {}
    for n, c, t in device_points:
        by_point.setdefault((n, c), []).append(t)

    def on_device(n: int, cached: int) -> float:
        measured = by_point.get((n, cached))
        return statistics.median(measured) if measured else fit.seconds(n, cached)

    host = [(row["host_pages"] * page_bytes, t - on_device(n, row["cached_tokens"])) for n, row, t in loads["host"]]
    to_device = fit_link([b for b, _ in host], [max(x, 1e-6) for _, x in host])
    storage = [(row["storage_pages"] * page_bytes,
                t - on_device(n, row["cached_tokens"]) - to_device.seconds(row["storage_pages"] * page_bytes))
               for n, row, t in loads["storage"]]
    return {**links, "host_to_device": to_device, "storage_get": fit_link([b for b, _ in storage], [max(x, 1e-6) for _, x in storage])}


def idle_sizes(lengths: list[int]) -> tuple[int, int]:
    """The short and the long prompt idle costs are measured at: the grid's shortest, and its middle."""
    return lengths[0], lengths[len(lengths) // 2]


def measure_idle(request: Callable[[int], float], settle: Callable[[], None], sizes: tuple[int, int], plan: CalibrationPlan,
                 progress: Callable[[str], None] | None = None) -> IdleFit:
    """What ``request(n)`` (a fresh prompt of ``n`` tokens, its seconds to the first token) costs after each of
    ``plan.idle_gaps`` of idleness over right after another one, at a short and a long prompt (``sizes``), every
    gap and size interleaved so that a drift of the machine lands on all alike; ``2 * plan.reps + 1`` runs each."""
    runs: dict[int, dict[float, list[float]]] = {n: {g: [] for g in (0.0, *plan.idle_gaps)} for n in sizes}
    for _ in range(2 * plan.reps + 1):
        for n, by_gap in runs.items():
            for gap, times in by_gap.items():
                settle()
                woke = time.perf_counter() + gap
                if gap:
                    time.sleep(gap)
                    settle()  # (as the validation's engine does on waking: nothing left to drain, one poll)
                late = time.perf_counter() - woke  # waking up late is part of what an idle engine costs
                times.append(late + request(n))
    return idle_fit(*runs.values(), progress=progress)


def idle_fit(short: dict[float, list[float]], long: dict[float, list[float]], progress: Callable[[str], None] | None = None) -> IdleFit:
    """:class:`IdleFit` of a short and a long prompt timed after each idle gap (``[gap]``; ``[0.0]``: right after
    another): the extra time ``fixed + share * service`` through both (medians), neither part below 0, and
    neither falling as the gap grows (the machine's noise says otherwise now and then)."""
    gaps = sorted(g for g in short if g > 0)
    t_short, t_long = statistics.median(short[0.0]), statistics.median(long[0.0])
    fixed, share = [], []
    for g in gaps:
        d_short, d_long = statistics.median(short[g]) - t_short, statistics.median(long[g]) - t_long
        b = max(0.0, (d_long - d_short) / (t_long - t_short)) if t_long > t_short else 0.0
        a = d_short - b * t_short
        if a < 0:  # all of it in proportion
            a, b = 0.0, max(0.0, d_long / t_long)
        fixed.append(a)
        share.append(b)
    fixed = [max(fixed[: i + 1]) for i in range(len(fixed))]
    share = [max(share[: i + 1]) for i in range(len(share))]
    if progress is not None:
        progress("after idle " + ", ".join(f"{g * 1e3:g} ms: +{a * 1e3:.1f} ms +{b:.0%}" for g, a, b in zip(gaps, fixed, share)))
    return IdleFit(gaps, fixed, share)


def measure_links(spec: KVSpec, io_backend: str, storage_url: str | None, plan: CalibrationPlan,
                  progress: Callable[[str], None] | None = None) -> dict[str, LinkFit]:
    """Each link's :class:`LinkFit`, timed on the benches' paths (see the module docstring)."""
    from kvtier.app.plan.engine_run import run_storage
    from kvtier.hashing import Namespace, PageHash
    from kvtier.l3 import open_backend
    from kvtier.l3.tier import StorageTier
    from kvtier.pools import DevicePool, HostPool
    from kvtier.transfer.engine import TransferEngine

    most = max(plan.link_pages)
    device, host = DevicePool(spec, 2 * most), HostPool(spec, 2 * most, "page_first")
    storage, tmp = run_storage(storage_url)
    transfers = TransferEngine(host, device, io_backend)
    tier = StorageTier(open_backend(storage.url), host, Namespace("kvtier-calibrate", spec.fingerprint()), batch_pages=storage.batch_pages,
                       io_threads=storage.io_threads)
    timings: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in LINKS}
    try:
        for k in plan.link_pages:
            src, dst = list(range(k)), list(range(most, most + k))
            ops = {
                "host_to_device": lambda k=k, src=src, dst=dst: transfers.load(src, dst).wait(),
                "device_to_host": lambda k=k, src=src, dst=dst: transfers.backup(src, dst).wait(),
            }
            for rep in range(plan.link_reps + 1):
                keys = [PageHash(os.urandom(16)) for _ in range(k)]
                ops["storage_put"] = lambda keys=keys, src=src: tier.submit("save", keys, src).wait()
                ops["storage_get"] = lambda keys=keys, dst=dst: tier.submit("prefetch", keys, dst).wait()
                for name in ("host_to_device", "device_to_host", "storage_put", "storage_get"):  # (a get reads the put's keys)
                    t0 = time.perf_counter()
                    ops[name]()
                    if rep:  # the first round is a warm-up
                        timings[name][0].append(k * spec.page_bytes)
                        timings[name][1].append(time.perf_counter() - t0)
            if progress is not None:
                progress(f"links at {k} pages")
    finally:
        tier.close()
        transfers.close()
        if tmp is not None:
            tmp.cleanup()
    return {name: fit_link(*timings[name]) for name in LINKS}


def calibrate_run_engine(eng: Engine, plan: CalibrationPlan = CalibrationPlan(), *, io_backend: str = "direct",
                         storage_url: str | None = None, progress: Callable[[str], None] | None = None) -> Profile:
    """The profile of ``kvtier run``'s engine ``eng`` (``run`` or ``run-hybrid``) on this machine."""
    model = engine_model(eng.model)
    spec = model.group("full").attention
    before = machine()
    timed = measure_engine(eng, plan, progress)
    links = measure_links(spec, io_backend, storage_url, plan, progress)
    samples = timed.prefill
    fit = fit_prefill([n for n, _, _ in samples], [c for _, c, _ in samples], [t for _, _, t in samples], eng.page_tokens)
    held, drain = fit_after(*zip(*timed.after))
    links = load_links(fit, links, timed.loads, spec.page_bytes, samples)
    after = machine()
    profile = Profile(
        engine=eng.name,
        model=eng.model,
        model_fingerprint=model.fingerprint(),
        page_tokens=eng.page_tokens,
        page_bytes=spec.page_bytes,
        prefill=fit,
        links=links,
        after_request=drain,
        after_request_overhead_s=held,
        idle=timed.idle,
        # a load is timed as what it adds to the prefill (what the compute did not hide): it adds to the compute
        traits=EngineTraits(scheduling="serial", load_overlaps_compute=False, settle="serial", threads=plan.threads),
        io_backend=io_backend,
        storage=(storage_url or "file://").split(":", 1)[0],
        measured_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        machine={**after, "load_average_before": before["load_average"]},
        notes={"prefill_points": [list(s) for s in samples], "after_request_points": [list(a) for a in timed.after], "plan": asdict(plan),
               "host_loads": timed.loads["host"], "storage_loads": timed.loads["storage"]},
    )
    return probe_run_engine(eng, profile, plan, progress)


def probe_run_engine(eng: Engine, profile: Profile, plan: CalibrationPlan, progress: Callable[[str], None] | None = None) -> Profile:
    """``profile`` with its :attr:`~Profile.load_scale` from the load probe on ``kvtier run``'s engine
    (:mod:`~kvtier.app.plan.engine_run`, as a validation serves a slice)."""
    from kvtier.app.plan.engine_run import replay_on_run_engine
    from kvtier.app.plan.engine_slice import EngineSlice, probe_arrivals, prompt_tokens
    from kvtier.app.plan.timing import ProfiledCosts

    ps = eng.page_tokens
    lengths = probe_lengths(plan.prompt_lengths(ps))
    moves = [(0, n // ps, n // ps) for n in lengths]  # every full page backed up and saved (write_through)
    costs = ProfiledCosts(profile, ps, profile.page_bytes)
    arrivals = probe_arrivals([sum(costs.request(n, (0, 0, 0), m)) for n, m in zip(lengths, moves)], PROBE_LOAD)
    requests = probe_requests(lengths, arrivals, ps)
    work = EngineSlice(requests, [prompt_tokens(r, ps, eng.vocab, seed=7) for r in requests], arrivals, 1.0)
    pages = sum(-(-n // ps) for n in lengths) + 1
    real = replay_on_run_engine(eng, work, TierConfig(device_pages=pages, host_pages=pages), CacheConfig(), threads=plan.threads)
    scale = fit_load_scale(profile, requests, moves, real.ttft_s, progress)
    profile.notes["load_probe"] = {"lengths": lengths, "arrivals_s": arrivals, "ttft_s": real.ttft_s}
    return replace(profile, load_scale=scale)


#: vLLM calibration: the pause before each timed request, for the copies out and L3 writes of the ones before to finish
SETTLE_S = 0.1

#: the load probe: requests, and the share of the time they should keep the engine busy
PROBE_REQUESTS = 60
PROBE_LOAD = 0.5


def probe_lengths(lengths: list[int], count: int = PROBE_REQUESTS) -> list[int]:
    """The load probe's prompt lengths: the grid's short and middle ones, in turn."""
    return [idle_sizes(lengths)[i % 2] for i in range(count)]


def probe_requests(lengths: list[int], arrivals: list[float], page_tokens: int) -> list[TraceRequest]:
    """The probe as the planner sees it: requests sharing no block, at ``arrivals``."""
    first = 1 << 40  # (block ids of their own)
    return [TraceRequest(a * 1000.0, n, 1, tuple(range(first * (i + 1), first * (i + 1) + -(-n // page_tokens))))
            for i, (n, a) in enumerate(zip(lengths, arrivals))]


def fit_load_scale(profile: Profile, requests: list[TraceRequest], moves: list[tuple[int, int, int]], measured: list[float],
                   progress: Callable[[str], None] | None = None) -> float:
    """The service factor under which the planner's queue model (:func:`~kvtier.app.plan.timing.simulate`) best
    matches the probe's measured TTFTs (the smallest median absolute percentage error, factors 0.5 to 3)."""
    from kvtier.app.plan.config import PlanConfig
    from kvtier.app.plan.timing import ProfiledCosts, simulate

    best = None
    for scale in (round(0.5 + 0.01 * i, 2) for i in range(251)):
        costs = ProfiledCosts(replace(profile, load_scale=scale), profile.page_tokens, profile.page_bytes)
        ttft = simulate(requests, [0] * len(requests), [(0, 0, 0)] * len(requests), PlanConfig(), costs, moves).per_request_ttft_s
        err = median_abs_pct_error(ttft, measured)
        if best is None or err < best[1] - 1e-9:
            best = (scale, err)
    if progress is not None:
        progress(f"load probe: service x {best[0]:.2f} under load (per-request TTFT error {best[1]:.1f}% with it)")
    return best[0]


def calibrate_vllm(eng: Engine, plan: CalibrationPlan = CalibrationPlan(), *, io_backend: str = "direct",
                   progress: Callable[[str], None] | None = None) -> Profile:
    """The profile of vLLM's CPU engine with kvtier's connector (``vllm`` or ``vllm-hybrid``), measured in one
    engine process (:mod:`kvtier.app.plan.engine_vllm`): its prefill fit from prefixes vLLM's own cache
    held; the connector's load (host -> vLLM's blocks) and L3 read from prefixes only kvtier held, as the
    time they add over that fit. Its copies out and L3 writes run beside the next steps (settle:
    background); the profile still records their links, timed on the benches' paths."""
    from kvtier.app.plan.engine_vllm import run_job

    model = engine_model(eng.model)
    spec = model.group("full").attention
    ps = eng.page_tokens
    lengths = plan.prompt_lengths(ps)
    grid = [(n, min(int(n * f) // ps, (n - 1) // ps) * ps) for n in lengths for f in plan.cached]
    loads = load_lengths(lengths)
    host_pages = 2 * (-(-max(loads) // ps)) + 8
    flush_tokens = max(lengths)
    before = machine()
    if progress is not None:
        progress(f"vLLM {eng.vllm_model}: {len(grid)} prefill points, {len(loads)} host and L3 loads, {plan.reps} runs each")
    result = run_job({"mode": "calibrate", "idle_gaps": list(plan.idle_gaps), "idle_tokens": list(idle_sizes(lengths)),
                      "model": eng.vllm_model, "block_size": ps, "device_pages": 4 * (-(-max(lengths) // ps)) + 8,
                      "host_pages": host_pages, "max_model_len": max(lengths) + ps, "vocab": eng.vocab, "grid": grid, "reps": plan.reps,
                      "load_lengths": loads, "flush_tokens": flush_tokens, "flush_prompts": -(-2 * host_pages * ps // flush_tokens),
                      "settle_s": SETTLE_S, "probe_lengths": probe_lengths(lengths), "probe_load": PROBE_LOAD})
    samples = result["samples"]
    fit = fit_prefill(*zip(*samples["device"]), ps)
    links = measure_links(spec, io_backend, None, plan, progress)
    page_bytes = spec.page_bytes
    # what a load adds over computing the rest: the connector's path into vLLM's blocks, then an L3 read before it
    links = load_links(fit, links, samples, page_bytes, samples["device"])
    profile = Profile(
        engine=eng.name,
        model=eng.model,
        model_fingerprint=model.fingerprint(),
        page_tokens=ps,
        page_bytes=page_bytes,
        prefill=fit,
        links=links,
        idle=idle_fit(*({float(g): t for g, t in samples["idle"][str(n)].items()} for n in idle_sizes(lengths)), progress=progress),
        traits=EngineTraits(scheduling="chunked", max_batched_tokens=int(result["max_num_batched_tokens"]), load_overlaps_compute=False,
                            settle="background", threads=plan.threads),
        io_backend=io_backend,
        storage="file",
        measured_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        machine={**machine(), "load_average_before": before["load_average"]},
        notes={"prefill_points": samples["device"], "host_loads": samples["host"], "storage_loads": samples["storage"],
               "plan": asdict(plan), "vllm_model": eng.vllm_model, "load_probe": samples["probe"]},
    )
    probe = samples["probe"]
    requests = probe_requests(probe["lengths"], probe["arrivals_s"], ps)
    measured = [row["ttft_s"] for row in probe["rows"]]
    return replace(profile, load_scale=fit_load_scale(profile, requests, [(0, 0, 0)] * len(requests), measured, progress))
