"""vLLM's CPU engine with kvtier's connector, serving a trace slice at its arrival times, or measuring
itself for a profile: the vLLM side of ``kvtier plan --validate vllm`` and ``--calibrate --engine vllm``.

The engine runs as a server does -- :class:`vllm.v1.engine.async_llm.AsyncLLM`, its engine core
and workers in processes of their own -- in a fresh process (``python -m
kvtier.app.plan.engine_vllm JOB.json``), every request ``max_tokens=1`` and sent at its arrival
time, so requests that overlap are batched as vLLM batches them. vLLM's own prefix cache is the
device tier (``num_gpu_blocks_override``: the device pages asked for, plus vLLM's null block);
kvtier's connector holds the host pages and writes through to a file L3. Per request it reports
the time to its first token from its arrival, vLLM's ``num_cached_tokens`` and what kvtier offered
(``kv_transfer_params["kvtier"]``); per worker what it moved.

``calibrate``: prefills after a prefix vLLM's own cache holds (a grid of prompt and prefix lengths),
after a prefix only kvtier's host holds (vLLM's cache reset between), and after one only its L3
holds (host pushed out by other prompts), each alone on the engine; requests after idle gaps; and a
load probe, prompts sharing nothing sent at a given arrival rate, as a validation sends them.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import tempfile
import threading
import time

from kvtier.integrations.vllm.session import reset_prefix_cache  # noqa: F401  (sets vLLM's CPU defaults on import)

MARKER = "KVTIER_REPLAY "
#: a prompt shorter than a block: vLLM caches nothing of it, kvtier's connector offloads nothing
WARMUP_TOKENS = 16


def _engine(job: dict):
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from kvtier.integrations.vllm.session import _model_args

    extra = {"host_pages": job["host_pages"], "storage_url": job["storage_url"]}
    transfer = KVTransferConfig(kv_connector="KVTierConnector", kv_connector_module_path="kvtier.integrations.vllm.connector",
                                kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    args = AsyncEngineArgs(**_model_args(job["model"], 1), dtype="float32", max_model_len=job["max_model_len"],
                           block_size=job["block_size"], enforce_eager=True, kv_transfer_config=transfer, seed=0,
                           enable_prefix_caching=True, num_gpu_blocks_override=job["device_pages"] + 1,
                           worker_extension_cls="kvtier.integrations.vllm.session.KVTierWorkerExtension", disable_log_stats=True)
    return AsyncLLM.from_engine_args(args)


async def _first_token(engine, ids: list[int], request_id: str) -> tuple[float, object]:
    """(seconds to the first token, the final output) of one request sent now."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    first = None
    final = None
    async for out in engine.generate(TokensPrompt(prompt_token_ids=ids), SamplingParams(max_tokens=1, temperature=0.0), request_id):
        if first is None:
            first = time.perf_counter() - t0
        final = out
    return first, final


def _hit(out) -> dict:
    """What served a finished request: vLLM's cached tokens, and kvtier's offer (HitRecord)."""
    offer = (out.kv_transfer_params or {}).get("kvtier") or {}
    return {"cached_tokens": out.num_cached_tokens or 0, **{k: offer.get(k, 0) for k in ("local_tokens", "external_tokens", "host_pages",
                                                                                          "storage_pages")}}


async def _reset(engine, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await engine.reset_prefix_cache():
        if time.monotonic() > deadline:
            raise RuntimeError("vLLM's prefix cache could not be reset: blocks are still held")
        await asyncio.sleep(0.01)


async def _start(engine, job: dict) -> dict:
    """Warm the engine up (a prompt under a block: nothing cached) and check its block size."""
    block = (await engine.collective_rpc("engine_block_size"))[0]
    if block != job["block_size"]:
        raise RuntimeError(f"vLLM runs with {block}-token blocks, not the {job['block_size']} the slice was cut for")
    await _first_token(engine, list(range(100, 100 + WARMUP_TOKENS)), "warmup")
    return {"block_size": block, "max_num_batched_tokens": engine.vllm_config.scheduler_config.max_num_batched_tokens}


async def _serve(engine, prompts: list[list[int]], arrivals_s: list[float], tag: str = "") -> tuple[list[dict], float]:
    """Every prompt sent at its arrival (seconds from now), as a server receives them: (per request its seconds
    from arrival to first token and what served it, the wall time)."""
    loop_t0 = time.perf_counter() + 0.05
    rows: list[dict] = [{} for _ in prompts]

    async def one(i: int, ids: list[int], arrival: float) -> None:
        delay = loop_t0 + arrival - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        late = time.perf_counter() - (loop_t0 + arrival)  # the event loop's lateness counts as waiting
        ttft, out = await _first_token(engine, ids, f"{tag}{i}")
        rows[i] = {"ttft_s": ttft + max(late, 0.0), **_hit(out)}

    await asyncio.gather(*(one(i, p, a) for i, (p, a) in enumerate(zip(prompts, arrivals_s))))
    return rows, time.perf_counter() - loop_t0


async def _replay(job: dict) -> dict:
    engine = _engine(job)
    try:
        facts = await _start(engine, job)
        rows, wall = await _serve(engine, job["prompts"], job["arrivals_s"])
        stats = await engine.collective_rpc("kvtier_stats")
    finally:
        engine.shutdown()
    return {"requests": rows, "worker_stats": stats, "wall_s": wall, **facts}


async def _warm(engine, job: dict, tag: str) -> None:
    """Let the copies out and L3 writes of the requests before finish, then run a prompt under a block (nothing
    cached, nothing copied) right before the timed one: it is timed as one that follows another, as in a queue
    (what a request that finds the engine idle pays more is measured apart)."""
    await asyncio.sleep(job["settle_s"])
    await _first_token(engine, list(range(100, 100 + WARMUP_TOKENS)), f"warm-{tag}")


async def _calibrate(job: dict) -> dict:
    engine = _engine(job)
    samples: dict = {"device": [], "host": [], "storage": [], "idle": {n: {g: [] for g in (0.0, *job["idle_gaps"])}
                                                                       for n in job["idle_tokens"]}}
    seq = iter(range(1 << 30))
    try:
        facts = await _start(engine, job)
        for n, cached in job["grid"]:  # a prefix vLLM's own cache holds
            for rep in range(job["reps"]):
                ids = job["prompt_of"](n, next(seq))
                if cached:
                    await _first_token(engine, ids[:cached], f"p{n}-{rep}")
                await _warm(engine, job, f"c{n}-{rep}")
                t, out = await _first_token(engine, ids, f"c{n}-{rep}")
                samples["device"].append([n, out.num_cached_tokens or 0, t])
                await _reset(engine)
        for n in job["load_lengths"]:  # a prefix only kvtier's host holds, then one only its L3 holds
            for rep in range(job["reps"]):
                ids = job["prompt_of"](n, next(seq))
                await _first_token(engine, ids, f"h{n}-{rep}")
                await _reset(engine)
                await _warm(engine, job, f"H{n}-{rep}")
                t, out = await _first_token(engine, ids, f"H{n}-{rep}")
                samples["host"].append([n, _hit(out), t])
                for k in range(job["flush_prompts"]):  # other prompts push it out of host memory
                    await _first_token(engine, job["prompt_of"](job["flush_tokens"], next(seq)), f"f{n}-{rep}-{k}")
                await _reset(engine)
                await _warm(engine, job, f"S{n}-{rep}")
                t, out = await _first_token(engine, ids, f"S{n}-{rep}")
                samples["storage"].append([n, _hit(out), t])
                await _reset(engine)
        for rep in range(2 * job["reps"] + 1):  # a request that finds the engine idle, against one right after another
            for n, by_gap in samples["idle"].items():
                for gap, times in by_gap.items():
                    if not gap:
                        await _warm(engine, job, f"i{n}-{rep}")
                    woke = time.perf_counter() + gap
                    await asyncio.sleep(gap)
                    late = max(0.0, time.perf_counter() - woke)  # waking up late is part of what an idle engine costs
                    t, _ = await _first_token(engine, job["prompt_of"](n, next(seq)), f"i{n}-{gap}-{rep}")
                    times.append(late + t)
        await _reset(engine)
        await asyncio.sleep(job["settle_s"])
        samples["probe"] = await _probe(engine, job, samples["device"], seq)
    finally:
        engine.shutdown()
    return {"samples": samples, **facts}


async def _probe(engine, job: dict, device: list, seq) -> dict:
    """The load probe: prompts sharing nothing at Poisson arrivals that keep the engine busy ``probe_load`` of the
    time, as each prompt's length took alone (its grid point with nothing cached)."""
    from statistics import median

    from kvtier.app.plan.engine_slice import probe_arrivals

    lengths = job["probe_lengths"]
    alone = {n: median(t for m, c, t in device if m == n and c == 0) for n in set(lengths)}
    arrivals = probe_arrivals([alone[n] for n in lengths], job["probe_load"])
    rows, _ = await _serve(engine, [job["prompt_of"](n, next(seq)) for n in lengths], arrivals, "probe")
    return {"lengths": lengths, "arrivals_s": arrivals, "rows": rows}


def _prompt_of(vocab: int):
    import random

    def prompt(n: int, seed: int) -> list[int]:
        rng = random.Random(seed * 7919 + 17)
        return [rng.randrange(100, vocab) for _ in range(n)]

    return prompt


def exit_with_parent(poll_s: float = 0.5) -> None:
    """End this process's whole group -- it, vLLM's engine core and workers (:func:`run_job` starts it in a session
    of its own) -- when its parent is gone, whatever ended the parent (a SIGKILL runs no cleanup there)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="kvtier-exit-with-parent", daemon=True).start()


def main(path: str) -> None:
    exit_with_parent()
    with open(path) as f:
        job = json.load(f)
    # a trace's longest prompt may pass the tiny models' position limit (SmolLM2's config: 8192); their weights are
    # random or dummy, so positions past it cost what any others do
    os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    if job["mode"] == "calibrate":
        job["prompt_of"] = _prompt_of(job["vocab"])
        result = asyncio.run(_calibrate(job))
    else:
        result = asyncio.run(_replay(job))
    print(MARKER + json.dumps(result), flush=True)


# ---- the caller's side ---------------------------------------------------------------------------


def run_job(job: dict, timeout_s: float | None = None) -> dict:
    """``job`` in a fresh engine process; its result. A file L3 in a temporary directory unless the job names one."""
    import subprocess

    with tempfile.TemporaryDirectory(prefix="kvtier-vllm-replay-") as tmp:
        job = {"storage_url": f"file://{tmp}/store", **job}
        path = os.path.join(tmp, "job.json")
        with open(path, "w") as f:
            json.dump(job, f)
        # a session of its own: when the job ends, however it ends, its group goes -- vLLM's engine core and workers too
        proc = subprocess.Popen([sys.executable, "-m", "kvtier.app.plan.engine_vllm", path], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=os.environ.copy(), start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        finally:
            _kill_group(proc)
    if proc.returncode != 0:
        raise RuntimeError(f"vLLM replay exited {proc.returncode}:\n{stderr[-4000:]}")
    return json.loads(next(line for line in stdout.splitlines() if line.startswith(MARKER))[len(MARKER):])


def _kill_group(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the group is gone already
    proc.wait()


def served_pages(row: dict, block: int) -> tuple[int, int, int]:
    """A request's (device, host, storage) pages: vLLM's own prefix hit, then what kvtier loaded from there --
    its leading host pages past the device's, the rest from L3 (a request kvtier was not asked about:
    vLLM's hit alone)."""
    if not (row["local_tokens"] or row["external_tokens"] or row["host_pages"] or row["storage_pages"]):
        return row["cached_tokens"] // block, 0, 0
    local = row["local_tokens"] // block
    external = max(0, min(row["external_tokens"], row["cached_tokens"] - row["local_tokens"])) // block
    host = max(0, min(row["host_pages"], local + external) - local)
    return local, host, external - host


def replay_on_vllm(eng, work, device_pages: int, host_pages: int):
    """``work`` (an :class:`~kvtier.app.plan.engine_slice.EngineSlice`) on vLLM with the connector, vLLM's
    prefix cache of ``device_pages`` blocks, kvtier's host of ``host_pages``: a
    :class:`~kvtier.app.plan.engine_run.MeasuredRun`."""
    from kvtier.app.plan.engine_run import MeasuredRun

    longest = max(len(p) for p in work.prompts)
    result = run_job({"mode": "replay", "model": eng.vllm_model, "block_size": eng.page_tokens, "device_pages": device_pages,
                      "host_pages": host_pages, "max_model_len": longest + eng.page_tokens, "prompts": work.prompts,
                      "arrivals_s": work.arrivals_s})
    rows = result["requests"]
    block = result["block_size"]
    stats = result["worker_stats"][0]
    page_bytes = stats["loaded_bytes"] // stats["loaded_pages"] if stats["loaded_pages"] else 0
    moved = {"host_to_device": stats["loaded_bytes"], "device_to_host": stats["offloaded_pages"] * page_bytes,
             "host_to_storage": stats["saved_pages"] * page_bytes, "storage_to_host": stats["fetched_pages"] * page_bytes}
    served = [served_pages(r, block) for r in rows]
    ttft = [r["ttft_s"] for r in rows]
    return MeasuredRun(eng.name, served, ttft, [], moved, result["wall_s"],
                       {"vllm_device_blocks": device_pages + 1, "max_num_batched_tokens": result["max_num_batched_tokens"],
                        "worker_stats": stats})


if __name__ == "__main__":
    main(sys.argv[1])
