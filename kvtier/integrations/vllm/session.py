"""One vLLM engine instance on the CPU, with or without kvtier: the unit the tests, the
example and the TTFT benchmark are built from (each engine in its own process, as a
restart would be).

``python -m kvtier.integrations.vllm.session --storage-url file:///tmp/kv --prompt-tokens 2048 --repeat 2``
prints one JSON object: per prompt the generated token ids and text, time to first
token, and what the kvtier connector offered (external hit tokens, host/L3 pages).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field

import typer

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # scheduler and worker in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@dataclass
class PromptResult:
    prompt_tokens: int
    output_token_ids: list[int]
    text: str
    ttft_s: float
    external_hit_tokens: int = 0
    host_hit_pages: int = 0
    storage_hit_pages: int = 0


@dataclass
class SessionReport:
    kvtier: bool
    storage_url: str | None
    block_size: int
    results: list[PromptResult] = field(default_factory=list)
    cache_stats: dict[str, int] = field(default_factory=dict)
    startup_s: float = 0.0


def prompt_ids(n: int, seed: int = 0, vocab: int = 49152) -> list[int]:
    """Deterministic token ids (no tokenizer involved), avoiding the first 100 special ids."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(100, vocab) for _ in range(n)]


def run_session(prompts: list[list[int]], *, kvtier: bool = True, storage_url: str | None = None, block_size: int = 32,
                max_tokens: int = 8, host_gb: float = 0.25, extra: dict | None = None, warmup: bool = False) -> SessionReport:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from kvtier.integrations.vllm.model import ensure_model

    t0 = time.perf_counter()
    transfer = None
    if kvtier:
        cfg = {"host_gb": host_gb, **({"storage_url": storage_url} if storage_url else {}), **(extra or {})}
        transfer = KVTransferConfig(kv_connector="KVTierConnector", kv_connector_module_path="kvtier.integrations.vllm.connector",
                                    kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=cfg)
    llm = LLM(model=str(ensure_model()), dtype="bfloat16", max_model_len=4096, block_size=block_size, enforce_eager=True,
              kv_transfer_config=transfer, seed=0)
    report = SessionReport(kvtier, storage_url, block_size, startup_s=time.perf_counter() - t0)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    first = SamplingParams(temperature=0.0, max_tokens=1)
    scheduler = _scheduler_connector(llm) if kvtier else None
    if warmup:  # first-call costs (allocator, kernels) belong to neither side of a comparison
        llm.generate([TokensPrompt(prompt_token_ids=prompt_ids(64, seed=10_000))], first, use_tqdm=False)
        llm.reset_prefix_cache()
    for ids in prompts:
        if scheduler:
            scheduler.hits.clear()
        t = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=ids)], first, use_tqdm=False)  # TTFT: prefill + first token
        ttft = time.perf_counter() - t
        hit = scheduler.hits[0] if scheduler and scheduler.hits else None
        llm.reset_prefix_cache()  # the full run below must not be served by vLLM's own cache of the TTFT run
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0].outputs[0]
        llm.reset_prefix_cache()  # so the next prompt's hits can only come from kvtier
        report.results.append(PromptResult(len(ids), list(out.token_ids), out.text, ttft,
                                           hit.external_tokens if hit else 0, hit.host_pages if hit else 0, hit.storage_pages if hit else 0))
    if kvtier:
        from kvtier.integrations.vllm.connector import live_caches

        caches = list(live_caches().values())
        report.cache_stats = caches[-1].stats.as_dict() if caches else {}
    llm.llm_engine.engine_core.shutdown()  # the worker connector drains its L3 writes here
    return report


MARKER = "KVTIER_SESSION "


def run_in_subprocess(*args: str, timeout: float | None = None) -> dict:
    """Run ``python -m kvtier.integrations.vllm.session *args`` (a fresh engine process) and return its report."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "kvtier.integrations.vllm.session", *args], capture_output=True, text=True, timeout=timeout, env=os.environ.copy())
    if out.returncode != 0:
        raise RuntimeError(f"engine session {' '.join(args)} exited {out.returncode}:\n{out.stderr[-4000:]}")
    return json.loads(next(line for line in out.stdout.splitlines() if line.startswith(MARKER))[len(MARKER):])


def _scheduler_connector(llm):
    core = llm.llm_engine.engine_core.engine_core
    return core.scheduler.connector


def main(
    storage_url: str = typer.Option(None, help="kvtier L3 URL (file:///dir, redis://127.0.0.1:6379/0)"),
    prompt_tokens: list[int] = typer.Option([200], help="prompt length(s) in tokens"),
    repeat: int = typer.Option(1, help="send each prompt this many times"),
    seed: int = typer.Option(0, help="prompt token seed"),
    no_kvtier: bool = typer.Option(False, "--no-kvtier", help="run vLLM without the connector (recompute baseline)"),
    max_tokens: int = typer.Option(8, help="tokens to generate (greedy)"),
    warmup: bool = typer.Option(False, help="run one unrelated short prompt first (for timing)"),
) -> None:
    prompts = [prompt_ids(n, seed + i) for i, n in enumerate(prompt_tokens) for _ in range(repeat)]
    report = run_session(prompts, kvtier=not no_kvtier, storage_url=storage_url, max_tokens=max_tokens, warmup=warmup)
    print(MARKER + json.dumps(asdict(report)))


if __name__ == "__main__":
    typer.run(main)
