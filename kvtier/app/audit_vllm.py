"""The timing audit (:mod:`kvtier.app.audit`) on vLLM's engine with kvtier's connector: ``kvtier audit timing --engine vllm``.

vLLM's CPU engine (its engine core and worker in processes of their own, ``LLM``), kvtier's connector below it, a
request's tenant its ``cache_salt``. Each tier runs in a fresh engine process (``python -m kvtier.app.audit_vllm
JOB.json``), the same rounds as ``kvtier run``'s engine -- the victim (tenant A) sends a prompt, then the probe
(tenant B, the same prompt), the miss (tenant B, a fresh prompt) and the control (tenant A again) in each of their six
orders in turn -- with the victim's pages pushed down to the tier before each request:

* ``device``: nothing moves; vLLM's own prefix cache holds them (vLLM scopes its block hashes by the salt);
* ``host``: vLLM's prefix cache is emptied, so a hit can come only from kvtier's host tier;
* ``service``: the same, the host tier being a ``kvtier serve`` the audit starts;
* ``file`` / ``redis``: vLLM's prefix cache emptied and kvtier's host tier, one prompt large, filled by an unrelated
  prompt (a third tenant's), so a hit can come only from L3 (write-through).

A request's time to first token is its ``generate`` call with one output token; its hit tokens are vLLM's
``num_cached_tokens`` (its own prefix cache and what kvtier loaded). The parent process tests the times as the
reference engine's (two-sample Kolmogorov-Smirnov, Gu et al.).
"""

from __future__ import annotations

import json
import sys
import time

from kvtier.app.audit_rounds import KINDS, round_order

#: what marks the job's result line on stdout (vLLM logs to it too)
MARKER = "KVTIER_AUDIT "
#: the block size vLLM runs with here (kvtier's page)
BLOCK = 32


def _job_engine(job: dict):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from kvtier.integrations.vllm.session import _model_args

    extra = {"host_pages": job["host_pages"], **job.get("extra", {})}
    transfer = KVTransferConfig(kv_connector="KVTierConnector", kv_connector_module_path="kvtier.integrations.vllm.connector",
                                kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    return LLM(**_model_args(job["model"], 1), dtype="float32", max_model_len=4096, block_size=BLOCK, enforce_eager=True,
               kv_transfer_config=transfer, seed=0)


def run_job(job: dict) -> dict:
    """The rounds of one tier (``job``: tier, model, samples, prompt_tokens, host_pages, extra): per kind, the times (ms)
    and the tokens each request hit."""
    import random

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtier.integrations.vllm.session import reset_prefix_cache

    llm = _job_engine(job)
    tier, n = job["tier"], job["prompt_tokens"]
    rng = random.Random(0)
    first = SamplingParams(temperature=0.0, max_tokens=1)

    def prompt() -> list[int]:
        return [rng.randrange(100, 49_000) for _ in range(n)]

    def send(tokens: list[int], salt: str) -> tuple[float, int]:
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=tokens, cache_salt=salt)], first, use_tqdm=False)[0]
        return (time.perf_counter() - t) * 1e3, int(out.num_cached_tokens or 0)

    def push_down() -> None:
        if tier == "device":
            return
        reset_prefix_cache(llm)
        if tier in ("file", "redis"):  # kvtier's host holds one prompt: another's pushes the victim's out (to L3 only)
            send(prompt(), "filler")
            reset_prefix_cache(llm)

    send(prompt(), "warmup")  # (first-call costs belong to no kind)
    push_down()
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    hits = dict.fromkeys(KINDS, 0)
    for i in range(job["samples"]):
        victim, fresh = prompt(), prompt()
        send(victim, "tenant-a")
        push_down()
        requests = {"probe": (victim, "tenant-b"), "miss": (fresh, "tenant-b"), "control": (victim, "tenant-a")}
        for kind in round_order(i):
            ms, hit = send(*requests[kind])
            times[kind].append(ms)
            hits[kind] += hit
            push_down()
    llm.llm_engine.engine_core.shutdown()
    return {"times": times, "hits": hits}


def audit_vllm_tier(tier: str, samples: int, prompt_tokens: int, workdir, *, model: str = "tiny-llama", timeout_s: float = 3600.0) -> dict:
    """One tier's rounds in a fresh engine process: ``{"times": {kind: [ms]}, "hits": {kind: tokens}}``."""
    import os
    import subprocess
    from pathlib import Path

    from kvtier.app.devservers import NodeServiceProcess, RedisServer

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    pages = -(-prompt_tokens // BLOCK)
    job = {"tier": tier, "model": model, "samples": samples, "prompt_tokens": prompt_tokens, "host_pages": 16 * pages, "extra": {}}
    stop = []
    try:
        if tier == "service":
            svc = NodeServiceProcess(workdir / "service", host_gb=0.25).start()
            stop.append(svc.stop)
            job["extra"] = {"service": f"unix://{svc.socket}", "service_required": True}
        elif tier in ("file", "redis"):
            job["host_pages"] = pages + 1  # (one prompt: the filler pushes the victim's pages out)
            if tier == "file":
                url = f"file://{workdir / 'l3'}"
            else:
                server = RedisServer(workdir / "redis").start()
                stop.append(server.stop)
                url = server.url
            job["extra"] = {"storage_url": url, "storage_write_policy": "write_through", "storage_prefetch_policy": "wait_complete"}
        path = workdir / "job.json"
        path.write_text(json.dumps(job))
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), "HF_HUB_OFFLINE": "1"}
        out = subprocess.run([sys.executable, "-m", "kvtier.app.audit_vllm", str(path)], capture_output=True, text=True,
                             timeout=timeout_s, env=env)
        lines = [line for line in out.stdout.splitlines() if line.startswith(MARKER)]
        if out.returncode != 0 or not lines:
            raise RuntimeError(f"the vLLM audit's engine for tier {tier} failed (exit {out.returncode}): {out.stderr[-2000:]}")
        return json.loads(lines[-1][len(MARKER):])
    finally:
        for f in reversed(stop):
            f()


def main() -> None:
    job = json.loads(open(sys.argv[1]).read())
    print(MARKER + json.dumps(run_job(job)), flush=True)


if __name__ == "__main__":
    main()
