"""``kvtier bench service``: the node service (``kvtier serve``) against a host tier of the engine's own, in one run.

* ``lookup`` -- the scheduler side of a request (``begin``: match, lock, plan the host->device loads;
  the loads themselves run after the clock stops) for prompts of ``prompt_tokens``, per request,
  p50 and p99 in microseconds. ``host_hit``: every page of the prompt is on host -- in the engine's
  own host tier, or published to the service by another engine, which costs one lookup round trip
  and the adoption of its pages. ``miss``: nobody has the prompt -- the service is still asked
  (one round trip that finds nothing), the in-process tier is not. A tiny page format (bytes do not
  enter a lookup). The two sides take turns, prompt by prompt.
* ``bandwidth`` -- host->device copies of the same pages (kvtier's direct backend, scattered source
  pages into a run of device pages, a model's page format) from the service's region, mapped by
  this process, against from a host pool of this process's own; GB/s, best round of several taken in
  turns, and their ratio.
* ``flood`` -- one engine's lookups (a ServiceClient's, the default 0.25 s deadline, a prompt's pages
  that hit, released after each, :data:`FLOOD_STEP_S` apart as an engine's scheduler steps are) alone,
  then beside one client flooding the service with the largest lookups it takes, back to back
  (:mod:`kvtier.app.bench.flood`, another process): p50 and p99 in microseconds, their ratios (beside
  / alone), and the engine's lookups that missed their deadline.
* ``vllm`` (``--vllm``) -- vLLM's CPU build in its default multi-process engine, one engine process
  after another (``kvtier.integrations.vllm.session``): the median TTFT of ``vllm_prompts`` prompts of
  ``vllm_prompt_tokens`` whose prefixes a previous engine process left in a running service (the engine restarted), against
  the same prompts' prefixes from this engine's own host tier (sent twice, vLLM's prefix cache reset
  between: not restarted), from a file L3 tier (restarted), and recomputed without kvtier. Each
  session runs an unrelated warm-up prompt first. The issue's target: the restarted engine's TTFT from
  the service within 1.2x of the in-process host hit.
* ``checksum`` -- what the service's page records cost (:mod:`kvtier.service.records`): the checksum the
  service takes of a page when its write completes, per host layout, over ``checksum_pages`` pages of a
  model's page format in a region, against a plain copy of the same pages' bytes (what the engine's own
  backup of them moved), GB/s, best round of several taken in turns, and their ratio; and a restarted
  service's adoption of that region (every record read, every page verified), GB/s.
* ``mla_once`` -- what storing an MLA (and DSA) model's latent once per node saves: a region page's bytes at
  tensor-parallel sizes 2, 4 and 8 as the service stores it, against every rank's identical copy kept.
* ``scheduler_steps`` -- vLLM's scheduler side asking about 1, 64 and 512 waiting requests
  (``--scheduler-waiting``) whose prefixes are on host: its own host tier, the service asked per request,
  and the service asked once per step (:mod:`kvtier.app.bench.vllm_lookups`).
* ``sharing`` -- two engines run the same workload (requests of the Mooncake trace) one after the
  other: once each with a host tier of its own, once both attached to one service. Host bytes held
  at the end (two private tiers against the service's region pages) and the second engine's hit
  ratio (tokens served from cache over input tokens).

The service is a real ``kvtier serve`` process on a socket in a temporary directory, stopped by its
pid at the end. Nothing here is a timed assertion: figures and ratios, as JSON.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvtier.app.percentiles import percentiles
from kvtier.app.bench.timing import interleaved_times
from kvtier.app.devservers import NodeServiceProcess
from kvtier.app.bench.vllm_lookups import BLOCK as STEP_BLOCK, PAGE_BYTES as STEP_PAGE_BYTES, SchedulerStepRow, scheduler_step_rows
from kvtier.app.workloads import load_mooncake_trace, trace_tokens
from kvtier.app.workloads.mooncake import default_trace_path
from kvtier.build import build_cache
from kvtier.cache import HierarchicalCache
from kvtier.config import TierConfig
from kvtier.pools import DevicePool, HostPool
from kvtier.errors import ServiceError
from kvtier.service.client import ServiceClient, query_status
from kvtier.service.records import PageRecords
from kvtier.service.region import RegionFormat, create_region, map_region, remove_region
from kvtier.spec import KVSpec
from kvtier.transfer.backends import get_io_backend

#: a page format whose bytes are small: a lookup's cost does not depend on them
LOOKUP_SPEC = KVSpec.mha("bench-lookup", 1, kv_heads=1, head_dim=64)
#: a model's page format for the copies (llama-3.1-8b's, two layers: the per-layer cost is depth-independent)
COPY_SPEC = KVSpec.preset("llama-3.1-8b", num_layers=2)
#: the page records' checksum row: a model's whole page (llama-3.1-8b's, every layer: 2 MiB)
CHECKSUM_SPEC = KVSpec.preset("llama-3.1-8b")
#: the trace's requests run through the sharing engines: tiny pages, many of them
SHARING_SPEC = LOOKUP_SPEC
#: the flood row's engine looks up once per step of this long (the flood meets its lookups at any point of its frames)
FLOOD_STEP_S = 0.01


@dataclass(frozen=True)
class LookupRow:
    case: str  # host_hit | miss
    pages: int  # pages per request
    requests: int
    in_process_p50_us: float
    in_process_p99_us: float
    service_p50_us: float
    service_p99_us: float
    p50_ratio: float  # service / in-process


@dataclass(frozen=True)
class BandwidthRow:
    spec: str
    pages: int
    page_bytes: int
    private_gbps: float
    region_gbps: float
    ratio: float  # region / private (the issue's target: >= 0.95)


@dataclass(frozen=True)
class SharingRow:
    requests: int  # per engine
    input_tokens: int  # per engine
    in_process_host_bytes: int  # both engines' own host tiers at the end
    service_host_bytes: int  # the service's region pages held at the end
    bytes_ratio: float  # service / in-process
    in_process_second_hit_ratio: float
    service_second_hit_ratio: float
    service_second_host_hit_pages: int


@dataclass(frozen=True)
class FloodRow:
    pages: int  # pages per lookup (all hits)
    lookups: int  # per side
    flood_frame_bytes: int  # each of the flooding client's frames
    flood_frames: int  # the flooding client's frames answered while it ran
    alone_p50_us: float
    alone_p99_us: float
    flooded_p50_us: float
    flooded_p99_us: float
    p50_ratio: float  # beside the flood / alone
    p99_ratio: float
    missed_deadlines: int  # of the engine's lookups beside the flood (each would make an engine drop the service)


@dataclass(frozen=True)
class VllmRestartRow:
    model: str
    prompt_tokens: int
    prompts: int  # per session; each TTFT is the median over them
    hit_pages: int  # the prefix's pages, each side served all of them from its tier (checked)
    service_restarted_ttft_ms: float
    in_process_host_ttft_ms: float
    file_l3_restarted_ttft_ms: float
    recompute_ttft_ms: float
    service_over_in_process: float  # the target: <= 1.2
    service_over_recompute: float


@dataclass(frozen=True)
class ChecksumRow:
    spec: str
    layout: str
    pages: int
    page_bytes: int
    checksum_gbps: float  # the service's checksum of each page, as at publish
    copy_gbps: float  # a plain copy of the same pages' bytes
    speed_over_copy: float  # checksum GB/s / copy GB/s (> 1: the checksum costs less than the backup's copy of the page)
    adopt_gbps: float  # a restarted service's adoption: every record read, every page verified


@dataclass(frozen=True)
class MlaOnceRow:
    spec: str
    tp_size: int
    region_page_bytes: int  # one region page as the service stores it (the latent once: RegionFormat.of_ranks)
    per_rank_page_bytes: int  # the same page were every rank's identical shard kept (RegionFormat.of_shards)
    saved_fraction: float  # 1 - region / per-rank
    pages_per_gib: int  # region pages one GiB of the region holds, stored once


@dataclass(frozen=True)
class ServiceBench:
    lookup: list[LookupRow]
    bandwidth: BandwidthRow
    sharing: SharingRow
    flood: FloodRow
    checksum: list[ChecksumRow]
    mla_once: list[MlaOnceRow]
    scheduler_steps: list[SchedulerStepRow]
    vllm: VllmRestartRow | None = None


#: the scheduler_steps rows' prompt length (16 pages of the bench's vLLM block)
STEP_PROMPT_TOKENS = 256


def _prompt(seed: int, tokens: int) -> list[int]:
    return [(seed * 1_000_003 + i) % 50_000 + 1 for i in range(tokens)]


def _serve(cache: HierarchicalCache, tokens: list[int]) -> tuple[int, int]:
    """One request as an engine runs it (loads waited for, the rest computed -- bytes not written --
    and committed, so it is backed up to host); (pages served from cache, of them from host)."""
    req = cache.begin(tokens)
    cached = req.wait()
    new = req.alloc(len(tokens) // cache.spec.page_size - cached)
    req.commit(req.cached_pages + new.pages)
    return cached, req.host_hit


def _percentile_us(xs: list[float], q: int) -> float:
    return round(percentiles(xs, (q,))[f"p{q}"] * 1e6, 1)


def _lookup_rows(socket: str, prompt_tokens: int, requests: int) -> list[LookupRow]:
    pages = prompt_tokens // LOOKUP_SPEC.page_size
    host_pages = pages * (requests + 4)  # every prompt and the fillers, none evicted
    own = build_cache(LOOKUP_SPEC, TierConfig(device_pages=pages * 2, host_pages=host_pages))
    publisher, attached = (build_cache(LOOKUP_SPEC, TierConfig(device_pages=pages * 2, host_pages=host_pages, service=socket))
                           for _ in range(2))
    try:
        hits = [_prompt(seed, prompt_tokens) for seed in range(requests + 1)]
        for toks in hits:  # on host: in the own tier by its own earlier run, in the service by another engine
            _serve(own, toks)
            _serve(publisher, toks)
        for seed in (-1, -2):  # the own tier's device holds two prompts: fillers push the last ones to host only
            _serve(own, _prompt(seed, prompt_tokens))
        own.wait_idle()
        publisher.wait_idle()
        misses = [_prompt(10_000 + seed, prompt_tokens) for seed in range(requests + 1)]
        sides = {"own": own, "service": attached}
        return [_lookup_row(case, prompts, sides, requests) for case, prompts in (("host_hit", hits), ("miss", misses))]
    finally:
        for c in (own, publisher, attached):
            c.close()


def _lookup_row(case: str, prompts: list[list[int]], sides: dict[str, HierarchicalCache], requests: int) -> LookupRow:
    """Each side begins every prompt once, in the same order, the sides taking turns; only ``begin`` is timed."""
    pages = len(prompts[0]) // LOOKUP_SPEC.page_size
    begun = []

    def timed(cache: HierarchicalCache):
        order = iter(prompts)

        def run(_i: int) -> None:
            begun.append(cache.begin(next(order)))
        return run

    def finish(name: str, _i: int) -> None:  # untimed: the loads, then the request ends (a hit kept, a miss dropped)
        req = begun.pop()
        served = req.wait()
        if served != (pages if case == "host_hit" else 0) or req.device_hit:
            raise RuntimeError(f"bench service: a {case} request of the {name} side was served {served} of {pages} pages "
                               f"({req.device_hit} from device): the row would measure something else")
        if served:
            req.commit(req.cached_pages)
        else:
            req.abort()

    t = interleaved_times({name: timed(cache) for name, cache in sides.items()}, requests, after=finish)
    own_p50, svc_p50 = _percentile_us(t["own"], 50), _percentile_us(t["service"], 50)
    return LookupRow(case, pages, requests, own_p50, _percentile_us(t["own"], 99), svc_p50, _percentile_us(t["service"], 99),
                     round(svc_p50 / own_p50, 3))


def _bandwidth_row(socket: str, pages: int, rounds: int) -> BandwidthRow:
    spec = COPY_SPEC
    client = ServiceClient(socket, "bench-bandwidth", RegionFormat.of(spec, "page_first"))
    try:
        region = HostPool(spec, client.num_pages, "page_first", memory=client.map_region())
        own = HostPool(spec, client.num_pages, "page_first")
        device = DevicePool(spec, pages * 2, "cpu")
        for pool in (region, own):  # touched: neither side pays first-touch page faults in the clock
            for t in pool.buffers.values():
                t.fill_(1)
        backend = get_io_backend("direct")
        gen = torch.Generator().manual_seed(0)
        srcs = [torch.randperm(client.num_pages, generator=gen)[:pages] for _ in range(rounds + 1)]
        dst = torch.arange(pages)

        def copy(pool: HostPool):
            def run(i: int) -> None:
                plan = backend.plan(srcs[i], dst)
                for b in spec.buffers:
                    for layer in range(spec.num_layers):
                        backend.copy(plan, pool.rows(b.name, layer), device.rows(b.name, layer))
            return run

        t = interleaved_times({"own": copy(own), "region": copy(region)}, rounds)
        nbytes = pages * spec.page_bytes
        own_gbps, region_gbps = nbytes / min(t["own"]) / 1e9, nbytes / min(t["region"]) / 1e9
        return BandwidthRow(spec.name, pages, spec.page_bytes, round(own_gbps, 3), round(region_gbps, 3), round(region_gbps / own_gbps, 3))
    finally:
        client.close()


def _checksum_rows(pages: int, rounds: int) -> list[ChecksumRow]:
    return [_checksum_row(layout, pages, rounds) for layout in ("page_first", "layer_first")]


def _checksum_row(layout: str, pages: int, rounds: int) -> ChecksumRow:
    spec = CHECKSUM_SPEC
    region = create_region(RegionFormat.of(spec, layout), pages * spec.page_bytes)
    try:
        memory = map_region(region.path, region.size, pin=False)
        memory.copy_(torch.randint(0, 256, (region.size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))
        pool = HostPool(spec, region.num_pages, layout, memory=memory)
        staging = HostPool(spec, region.num_pages, layout)
        records = PageRecords(region, memory.numpy(), verify_sample=0.0, fresh=True, keep=memory)

        def checksum(_i: int) -> None:  # (as at each page's publish)
            for page in range(region.num_pages):
                records.indexed(page, "bench-checksum", page.to_bytes(8, "little"))

        def copy(_i: int) -> None:
            for page in range(region.num_pages):
                for name, t in pool.buffers.items():
                    pool.layout.page_layers(staging.buffers[name], page).copy_(pool.layout.page_layers(t, page))

        t = interleaved_times({"checksum": checksum, "copy": copy}, rounds)
        started = time.perf_counter()
        adopted = records.adopt()
        adopt_s = time.perf_counter() - started
        assert len(adopted.pages) == region.num_pages, "a page recorded as written did not verify"
        records.close()
        nbytes = region.num_pages * spec.page_bytes
        sum_gbps, copy_gbps = nbytes / min(t["checksum"]) / 1e9, nbytes / min(t["copy"]) / 1e9
        return ChecksumRow(spec.name, layout, region.num_pages, spec.page_bytes, round(sum_gbps, 3), round(copy_gbps, 3),
                           round(sum_gbps / copy_gbps, 3), round(nbytes / adopt_s / 1e9, 3))
    finally:
        remove_region(region)


def _mla_once_rows() -> list[MlaOnceRow]:
    """The bytes a region page of an MLA (and DSA) model takes at each tensor-parallel size, stored once per node
    as the service stores it, against every rank's identical latent kept (what the formats say, not a timing)."""
    rows = []
    for name in ("deepseek-v3", "deepseek-v3.2"):
        spec = KVSpec.preset(name)
        for tp in (2, 4, 8):
            once = RegionFormat.of_ranks(spec, "page_first", tp)[0].page_bytes
            per_rank = RegionFormat.of_shards(spec, "page_first", tp).page_bytes
            rows.append(MlaOnceRow(name, tp, once, per_rank, round(1 - once / per_rank, 3), (1 << 30) // once))
    return rows


def _held_host_bytes(cache: HierarchicalCache) -> int:
    return cache.host.allocator.num_used * cache.spec.page_bytes


def _run_pair(first: HierarchicalCache, second: HierarchicalCache, workload: list[list[int]]) -> tuple[float, int]:
    for toks in workload:
        _serve(first, toks)
    first.wait_idle()
    served = host = 0
    for toks in workload:
        cached, from_host = _serve(second, toks)
        served += cached
        host += from_host
    second.wait_idle()
    tokens = sum(len(t) for t in workload)
    return served * SHARING_SPEC.page_size / tokens, host


def _sharing_row(socket: str, limit: int) -> SharingRow:
    ps = SHARING_SPEC.page_size
    trace = load_mooncake_trace(default_trace_path(), limit)
    workload = [toks[: len(toks) // ps * ps] for toks in (trace_tokens(r).tolist() for r in trace)]
    pages = sum(len(t) for t in workload) // ps
    device = max(len(t) for t in workload) // ps * 2
    own = [build_cache(SHARING_SPEC, TierConfig(device_pages=device, host_pages=pages)) for _ in range(2)]
    try:
        own_hit, _ = _run_pair(*own, workload)
        own_bytes = sum(_held_host_bytes(c) for c in own)
    finally:
        for c in own:
            c.close()
    shared = [build_cache(SHARING_SPEC, TierConfig(device_pages=device, host_pages=pages, service=socket)) for _ in range(2)]
    try:
        svc_hit, svc_host = _run_pair(*shared, workload)
        svc_bytes = query_status(socket)["ready"] * SHARING_SPEC.page_bytes
    finally:
        for c in shared:
            c.close()
    return SharingRow(len(workload), sum(len(t) for t in workload), own_bytes, svc_bytes, round(svc_bytes / own_bytes, 3),
                      round(own_hit, 4), round(svc_hit, 4), svc_host)


def _timed_lookups(client: ServiceClient, keys: list[bytes], n: int) -> tuple[list[float], int, ServiceClient]:
    """``n`` lookups of ``keys`` (each released after, untimed); their times, the misses of the deadline (the
    client attached again after each, naming its old session), and the client at the end."""
    times, missed = [], 0
    for _ in range(n):
        t = time.perf_counter()
        try:
            held = client.lookup(keys)
        except ServiceError:
            times.append(time.perf_counter() - t)
            missed += 1
            client = ServiceClient(client.socket_path, client.namespace, client.fmt, previous=client.session)
            continue
        times.append(time.perf_counter() - t)
        if len(held) != len(keys):
            raise RuntimeError(f"bench service: a flood row lookup found {len(held)} of {len(keys)} pages: the row would measure "
                               "something else")
        client.release(held)
        time.sleep(FLOOD_STEP_S)
    return times, missed, client


def _flood_row(socket: str, pages: int, lookups: int) -> FloodRow:
    fmt = RegionFormat.of(LOOKUP_SPEC, "page_first")
    owner = ServiceClient(socket, "bench-flood", fmt)
    engine = ServiceClient(socket, "bench-flood", fmt)
    flood = None
    try:
        keys = [(1 << 64 | i).to_bytes(16, "big") for i in range(pages)]
        got = owner.reserve(pages)
        owner.publish(got, keys)
        owner.release(got)
        alone, _missed, engine = _timed_lookups(engine, keys, lookups)
        argv = [sys.executable, "-m", "kvtier.app.bench.flood", socket, "bench-flooder", json.dumps(fmt.as_wire()), "600"]
        flood = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if json.loads(flood.stdout.readline() or "{}") != {"flooding": True}:
            raise RuntimeError("bench service: the flooding client did not start")
        flooded, missed, engine = _timed_lookups(engine, keys, lookups)
        flood.stdin.write("stop\n")
        flood.stdin.flush()
        report = json.loads(flood.stdout.readline())
        if report["error"] is not None:
            raise RuntimeError(f"bench service: the flooding client was stopped: {report['error']}")
    finally:
        if flood is not None and flood.poll() is None:
            flood.kill()
            flood.wait(30)
        engine.close()
        owner.close()
    a50, a99, f50, f99 = (_percentile_us(t, q) for t in (alone, flooded) for q in (50, 99))
    return FloodRow(pages, lookups, report["frame_bytes"], report["answered"], a50, a99, f50, f99, round(f50 / a50, 3),
                    round(f99 / a99, 3), missed)


def _vllm_session(*args: str) -> dict:
    from kvtier.integrations.vllm.session import run_in_subprocess

    return run_in_subprocess("--warmup", "--max-tokens", "1", *args, timeout=900)


def _served_ms(session: dict, indices: range, field: str, pages: int, what: str) -> float:
    """The median TTFT (ms) of results ``indices``, each checked to have been served ``pages`` pages by ``field``."""
    times = []
    for i in indices:
        r = session["results"][i]
        if r[field] < pages:
            raise RuntimeError(f"bench service: the {what} run was served {r[field]} of {pages} pages ({field}) on prompt {i}: the "
                               "row would measure something else")
        times.append(r["ttft_s"] * 1e3)
    return statistics.median(times)


def _vllm_row(workdir: Path, prompt_tokens: int, prompts: int, model: str) -> VllmRestartRow:
    """``prompts`` distinct prompts of ``prompt_tokens`` per session, each side's TTFT their median."""
    common = [*(f"--prompt-tokens={prompt_tokens}" for _ in range(prompts)), "--seed=7", f"--model={model}"]
    if model != "smollm2":
        common.append("--dtype=float32")
    svc = NodeServiceProcess(workdir / "vllm-service", host_gb=0.25 + prompts * 0.1).start()
    try:
        service = ["--storage-options", json.dumps({"service": f"unix://{svc.socket}"})]
        first = _vllm_session(*service, *common)  # computes the prefixes into the service, then exits
        pages = (prompt_tokens - 1) // first["block_size"]  # (the last prompt token is always computed)
        restarted = _vllm_session(*service, *common)
    finally:
        svc.stop()
    url = f"file://{workdir / 'vllm-l3'}"
    own = _vllm_session(f"--storage-url={url}", "--repeat=2", *common)  # each prompt's second send: a hit on its own host tier
    l3 = _vllm_session(f"--storage-url={url}", *common)  # restarted: its host tier empty, the store has the prefixes
    base = _vllm_session("--no-kvtier", *common)
    svc_ms = _served_ms(restarted, range(prompts), "shared_host_pages", pages, "restarted engine's (service)")
    own_ms = _served_ms(own, range(1, 2 * prompts, 2), "host_hit_pages", pages, "in-process host")
    l3_ms = _served_ms(l3, range(prompts), "storage_hit_pages", pages, "file L3")
    base_ms = statistics.median(r["ttft_s"] * 1e3 for r in base["results"])
    return VllmRestartRow(model, prompt_tokens, prompts, pages, round(svc_ms, 2), round(own_ms, 2), round(l3_ms, 2), round(base_ms, 2),
                          round(svc_ms / own_ms, 3), round(svc_ms / base_ms, 3))


def run_service_bench(prompt_tokens: int = 2048, requests: int = 200, copy_pages: int = 256, rounds: int = 9,
                      trace_limit: int = 60, vllm: bool = False, vllm_prompt_tokens: int = 2048, vllm_prompts: int = 3,
                      vllm_model: str = "smollm2", checksum_pages: int = 64,
                      scheduler_waiting: tuple[int, ...] = (1, 64, 512)) -> ServiceBench:
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-service-") as tmp:
        region_gb = (prompt_tokens // LOOKUP_SPEC.page_size * (2 * requests + 4) * LOOKUP_SPEC.page_bytes) / 1e9
        lookup_svc = NodeServiceProcess(Path(tmp) / "lookup", host_gb=max(region_gb * 2, 0.01)).start()
        try:
            lookup = _lookup_rows(lookup_svc.socket, prompt_tokens, requests)
        finally:
            lookup_svc.stop()
        copy_svc = NodeServiceProcess(Path(tmp) / "copy", host_gb=copy_pages * 4 * COPY_SPEC.page_bytes / 1e9).start()
        try:
            bandwidth = _bandwidth_row(copy_svc.socket, copy_pages, rounds)
        finally:
            copy_svc.stop()
        share_svc = NodeServiceProcess(Path(tmp) / "share", host_gb=1.0).start()
        try:
            sharing = _sharing_row(share_svc.socket, trace_limit)
        finally:
            share_svc.stop()
        pages = prompt_tokens // LOOKUP_SPEC.page_size
        flood_svc = NodeServiceProcess(Path(tmp) / "flood", host_gb=max(pages * 4 * LOOKUP_SPEC.page_bytes / 1e9, 0.01)).start()
        try:
            flood = _flood_row(flood_svc.socket, pages, requests)
        finally:
            flood_svc.stop()
        checksum = _checksum_rows(checksum_pages, rounds)
        steps_pages = max(scheduler_waiting) * (STEP_PROMPT_TOKENS // STEP_BLOCK) * 3 + 64
        steps_svc = NodeServiceProcess(Path(tmp) / "steps", host_gb=max(steps_pages * STEP_PAGE_BYTES / 1e9, 0.01)).start()
        try:
            steps = scheduler_step_rows(steps_svc.socket, scheduler_waiting, STEP_PROMPT_TOKENS, min(rounds, 5))
        finally:
            steps_svc.stop()
        restart = _vllm_row(Path(tmp), vllm_prompt_tokens, vllm_prompts, vllm_model) if vllm else None
    return ServiceBench(lookup, bandwidth, sharing, flood, checksum, _mla_once_rows(), steps, restart)


def as_json(bench: ServiceBench) -> dict:
    return {"date": time.strftime("%Y-%m-%d"), **asdict(bench)}
