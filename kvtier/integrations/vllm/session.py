"""One vLLM engine instance on the CPU, with or without kvtier: the unit the tests, the
example and the TTFT benchmark are built from (each engine in its own process, as a
restart would be). vLLM runs as it does by default: its engine core (scheduler) in a
process of its own, its workers in theirs; what kvtier offered each request comes back
in the request's ``kv_transfer_params``, and what each worker moved from the workers
(``LLM.collective_rpc``).

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
    #: of the host hit, the pages the lookup took from the node service (``service`` in the extra config)
    shared_host_pages: int = 0


@dataclass
class SessionReport:
    kvtier: bool
    storage_url: str | None
    #: the block size vLLM's workers run with: the one asked for, unless vLLM chose another (a hybrid
    #: model's attention block is aligned to its Mamba state's page, which depends on the machine)
    block_size: int
    #: the block size asked for (``--block-size``)
    requested_block_size: int = 0
    results: list[PromptResult] = field(default_factory=list)
    #: what each worker (tensor-parallel rank) moved, rank order (kvtier.integrations.vllm.worker.WorkerStats)
    worker_stats: list[dict[str, int]] = field(default_factory=list)
    startup_s: float = 0.0
    #: ``chat_turns``: the conversation's total time (every turn's generate call)
    chat_s: float = 0.0
    #: each rank's L3 namespace (Namespace fields), with kvtier
    namespaces: list[dict] = field(default_factory=list)
    #: attached to the node service: each rank's slice of its region (path, offset, size; None before a step mapped it)
    regions: list[dict | None] = field(default_factory=list)


def prompt_ids(n: int, seed: int = 0, vocab: int = 49152) -> list[int]:
    """Deterministic token ids (no tokenizer involved), avoiding the first 100 special ids."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(100, vocab) for _ in range(n)]


#: ``--model`` choices: SmolLM2-135M (the default; tensor parallel runs take the tiny Llama, whose heads split),
#: a tiny Llama with dummy weights (the same on every rank) or seeded random ones, Gemma 3 configs of sliding-window
#: and full-attention layers (tiny: the tests'; small: the benchmark's), a tiny Qwen3-Next of linear-attention and
#: full-attention layers (bf16 only)
MODELS = ("smollm2", "tiny-llama", "tiny-llama-seeded", "tiny-gemma3", "small-gemma3", "tiny-qwen3-next")


def _model_args(model: str, tp: int) -> dict:
    from kvtier.integrations.vllm.model import (
        ensure_model,
        ensure_small_gemma3,
        ensure_tiny_gemma3,
        ensure_tiny_llama,
        ensure_tiny_qwen3_next,
    )

    if model == "smollm2" and tp > 1:
        model = "tiny-llama"  # SmolLM2's 9 query / 3 KV heads do not split
    if model == "smollm2":
        return dict(model=str(ensure_model()))
    if model == "tiny-llama":
        return dict(model=str(ensure_tiny_llama()), load_format="dummy", tensor_parallel_size=tp)
    if model == "tiny-llama-seeded":
        return dict(model=str(ensure_tiny_llama(weights=True)), tensor_parallel_size=tp)
    if model == "tiny-gemma3":
        return dict(model=str(ensure_tiny_gemma3()), tensor_parallel_size=tp)
    if model == "small-gemma3":
        return dict(model=str(ensure_small_gemma3()), tensor_parallel_size=tp)
    if model == "tiny-qwen3-next":
        return dict(model=str(ensure_tiny_qwen3_next()), tensor_parallel_size=tp)
    from kvtier.errors import ConfigError

    raise ConfigError(f"unknown model {model!r}; choose one of {', '.join(MODELS)}")


def run_session(prompts: list[list[int]], *, kvtier: bool = True, storage_url: str | None = None, block_size: int = 32,
                max_tokens: int = 8, host_gb: float = 0.25, extra: dict | None = None, warmup: bool = False, tp: int = 1,
                dtype: str = "bfloat16", chat_turns: int = 0, between_prompts=None, model: str = "smollm2",
                own_hit: bool = False) -> SessionReport:
    """``own_hit``: the full run of each prompt is served by vLLM's own prefix cache from its TTFT run (no
    reset in between): the reference for a prefill after a hit, same split."""
    """``between_prompts(i)``: called after prompt ``i`` is done (a test injects a fault there)."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    transfer = None
    if kvtier:
        cfg = {"host_gb": host_gb, **({"storage_url": storage_url} if storage_url else {}), **(extra or {})}
        transfer = KVTransferConfig(kv_connector="KVTierConnector", kv_connector_module_path="kvtier.integrations.vllm.connector",
                                    kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=cfg)
    llm = LLM(
        **_model_args(model, tp),
        dtype=dtype,
        max_model_len=4096,
        block_size=block_size,
        enforce_eager=True,
        kv_transfer_config=transfer,
        seed=0,
        worker_extension_cls="kvtier.integrations.vllm.session.KVTierWorkerExtension",
    )
    engine_block = llm.collective_rpc("engine_block_size")[0]
    report = SessionReport(kvtier, storage_url, engine_block, block_size, startup_s=time.perf_counter() - t0)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    first = SamplingParams(temperature=0.0, max_tokens=1)
    if warmup:  # first-call costs (allocator, kernels) belong to neither side of a comparison
        llm.generate([TokensPrompt(prompt_token_ids=prompt_ids(64, seed=10_000))], first, use_tqdm=False)
        reset_prefix_cache(llm)
    chat_params = SamplingParams(temperature=0.0, max_tokens=32)
    history: list[int] = []
    for i, ids in enumerate(prompts if not chat_turns else ()):
        if i and between_prompts is not None:
            between_prompts(i - 1)
        t = time.perf_counter()
        ttft_out = llm.generate([TokensPrompt(prompt_token_ids=ids)], first, use_tqdm=False)[0]  # TTFT: prefill + first token
        ttft = time.perf_counter() - t
        hit = (ttft_out.kv_transfer_params or {}).get("kvtier") or {}
        if not own_hit:
            reset_prefix_cache(llm)  # the full run below must not be served by vLLM's own cache of the TTFT run
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0].outputs[0]
        reset_prefix_cache(llm)  # so the next prompt's hits can only come from kvtier
        report.results.append(
            PromptResult(
                len(ids),
                list(out.token_ids),
                out.text,
                ttft,
                hit.get("external_tokens", 0),
                hit.get("host_pages", 0),
                hit.get("storage_pages", 0),
                hit.get("shared_host_pages", 0),
            )
        )
    for turn in range(chat_turns):  # one conversation: each prompt is the history plus a new question
        history = (history if turn else list(prompts[0] if prompts else [])) + prompt_ids(64, seed=50_000 + turn)
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=history)], chat_params, use_tqdm=False)[0]
        report.chat_s += time.perf_counter() - t
        hit = (out.kv_transfer_params or {}).get("kvtier") or {}
        report.results.append(
            PromptResult(
                len(history),
                list(out.outputs[0].token_ids),
                out.outputs[0].text,
                0.0,
                hit.get("external_tokens", 0),
                hit.get("host_pages", 0),
                hit.get("storage_pages", 0),
                hit.get("shared_host_pages", 0),
            )
        )
        history = history + list(out.outputs[0].token_ids)
        reset_prefix_cache(llm)  # a busy server's device cache has moved on: the history is not on device
    if kvtier:
        report.worker_stats = llm.collective_rpc("kvtier_stats")
        report.namespaces = llm.collective_rpc("kvtier_namespace")
        report.regions = llm.collective_rpc("kvtier_region")
    llm.llm_engine.engine_core.shutdown()  # the worker connectors drain their L3 writes here
    return report


def reset_prefix_cache(llm, timeout_s: float = 60.0) -> None:
    """Empty vLLM's own prefix cache. vLLM refuses while any block is held -- a finished request's
    blocks are, until kvtier's copies out of them completed (``get_finished``) -- so retry until then."""
    deadline = time.monotonic() + timeout_s
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            raise RuntimeError(f"vLLM's prefix cache could not be reset within {timeout_s:.0f} s: blocks are still held")
        time.sleep(0.01)


class KVTierWorkerExtension:
    """Mixed into vLLM's workers (``worker_extension_cls``): ``LLM.collective_rpc("kvtier_stats")``
    returns what each rank's kvtier connector moved, once its L3 writes in flight finished."""

    def engine_block_size(self) -> int:
        """The block size this worker's KV cache runs with (vLLM may choose another than asked)."""
        return self.vllm_config.cache_config.block_size

    def kvtier_stats(self) -> dict[str, int]:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return get_kv_transfer_group().worker.drained_stats().as_dict()

    def kvtier_namespace(self) -> dict:
        """This rank's L3 namespace (the fields of :class:`~kvtier.hashing.Namespace`): what names its pages."""
        from dataclasses import asdict

        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return asdict(get_kv_transfer_group().worker.namespace)

    def kvtier_region(self) -> dict | None:
        """Attached to the node service: this rank's slice of the region its host pool maps."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        worker = get_kv_transfer_group().worker
        region = worker.region
        if region is None:
            return None
        offset, size = region.format.shard(region.num_pages, worker.tp_rank, worker.tp_size)
        return {"path": region.path, "offset": offset, "size": size, "num_pages": region.num_pages}


MARKER = "KVTIER_SESSION "
#: ``--pause-between-prompts``: printed after each prompt; the session goes on once a line arrives on stdin
PAUSE_MARKER = "KVTIER_PROMPT_DONE "


def _pause(i: int) -> None:
    import sys

    print(f"{PAUSE_MARKER}{i}", flush=True)
    sys.stdin.readline()


def run_in_subprocess(*args: str, timeout: float | None = None, between_prompts=None) -> dict:
    """Run ``python -m kvtier.integrations.vllm.session *args`` (a fresh engine process) and return its report.

    ``between_prompts(i)`` runs here, in the caller's process, after the engine finished prompt ``i``
    and before it starts the next one (the engine waits for it): a test kills a server there."""
    import subprocess
    import sys
    import tempfile
    import threading

    cmd = [sys.executable, "-m", "kvtier.integrations.vllm.session", *args]
    if between_prompts is None:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=os.environ.copy())
        stdout, stderr, rc = out.stdout, out.stderr, out.returncode
    else:
        with tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen(
                [*cmd, "--pause-between-prompts"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=os.environ.copy(),
            )
            timer = threading.Timer(timeout, proc.kill) if timeout else None  # the whole run's deadline
            if timer is not None:
                timer.start()
            try:
                lines = []
                for line in proc.stdout:
                    lines.append(line)
                    if line.startswith(PAUSE_MARKER):
                        between_prompts(int(line[len(PAUSE_MARKER) :]))
                        proc.stdin.write("\n")
                        proc.stdin.flush()
                rc = proc.wait()
            finally:
                if timer is not None:
                    timer.cancel()
                proc.kill()
            err.seek(0)
            stdout, stderr = "".join(lines), err.read()
    if rc != 0:
        raise RuntimeError(f"engine session {' '.join(args)} exited {rc}:\n{stderr[-4000:]}")
    return json.loads(next(line for line in stdout.splitlines() if line.startswith(MARKER))[len(MARKER) :])


def main(
    storage_url: str = typer.Option(None, help="kvtier L3 URL (file:///dir, redis://127.0.0.1:6379/0)"),
    prompt_tokens: list[int] = typer.Option([200], help="prompt length(s) in tokens"),
    repeat: int = typer.Option(1, help="send each prompt this many times"),
    seed: int = typer.Option(0, help="prompt token seed"),
    no_kvtier: bool = typer.Option(False, "--no-kvtier", help="run vLLM without the connector (recompute baseline)"),
    max_tokens: int = typer.Option(8, help="tokens to generate (greedy)"),
    warmup: bool = typer.Option(False, help="run one unrelated short prompt first (for timing)"),
    tp: int = typer.Option(1, help="tensor parallel size (above 1: a tiny Llama with dummy weights; CPU threads bound one per rank)"),
    dtype: str = typer.Option(
        "bfloat16",
        help="model and KV dtype; float32 makes greedy outputs independent of how vLLM splits the "
        "prefill (bf16 rounding differs between a full prefill and one after a prefix hit)",
    ),
    storage_options: str = typer.Option("{}", help="extra kv_connector_extra_config keys as JSON"),
    model: str = typer.Option("smollm2", help=f"the model: {', '.join(MODELS)} (tiny-gemma3: sliding-window layers beside full ones)"),
    block_size: int = typer.Option(32, min=1, help="vLLM's --block-size (a hybrid model of Mamba-style layers may get another: "
                                   "the report's block_size is the one the engine ran with)"),
    own_hit: bool = typer.Option(False, help="serve each prompt's full run from vLLM's own prefix cache of its TTFT run"),
    prompt_json: str = typer.Option(None, help="explicit prompts as a JSON list of token-id lists (instead of --prompt-tokens)"),
    chat_turns: int = typer.Option(
        0,
        help="instead: one conversation of this many turns (the first prompt, then each turn adds "
        "the answer and a 64-token question; 32 tokens generated per turn)",
    ),
    pause_between_prompts: bool = typer.Option(
        False,
        help=f"after each prompt print {PAUSE_MARKER.strip()} N and wait for a line on stdin (a test injects a fault between prompts)",
    ),
) -> None:
    if tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        # vLLM's automatic binding wants a NUMA node per worker; give each rank its own core(s)
        cpus = sorted(os.sched_getaffinity(0))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(cpus[r % len(cpus)]) for r in range(tp))
    if prompt_json:
        prompts = [list(map(int, p)) for p in json.loads(prompt_json) for _ in range(repeat)]
    else:
        prompts = [prompt_ids(n, seed + i) for i, n in enumerate(prompt_tokens) for _ in range(repeat)]
    report = run_session(
        prompts,
        kvtier=not no_kvtier,
        storage_url=storage_url,
        max_tokens=max_tokens,
        warmup=warmup,
        tp=tp,
        dtype=dtype,
        extra=json.loads(storage_options),
        chat_turns=chat_turns,
        between_prompts=_pause if pause_between_prompts else None,
        model=model,
        own_hit=own_hit,
        block_size=block_size,
    )
    print(MARKER + json.dumps(asdict(report)))


if __name__ == "__main__":
    typer.run(main)
