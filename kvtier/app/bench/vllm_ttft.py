"""vLLM with kvtier vs without, in vLLM's default multi-process engine, in one run. Prints JSON.

* **TTFT with the prefix in L3**: three engine processes, one after another: (1)
  kvtier on, stores the prompt's blocks in a file store; (2) a new engine with
  kvtier on the same store: its TTFT includes L3 -> host -> vLLM block loads;
  (3) vLLM without kvtier. Each engine runs one unrelated warm-up prompt first.
* **A multi-turn chat** (``--chat-turns``, 16): one conversation, each turn the
  history plus a 64-token question, 32 tokens generated, vLLM's own prefix cache
  reset between turns (a busy server's device cache has moved on), once with
  kvtier (the history comes back from host memory) and once without (recomputed):
  the conversation's total time each way, and their ratio.

``--model tiny-gemma3`` / ``small-gemma3`` (sliding-window layers beside full ones) and ``tiny-qwen3-next``
(linear attention beside full ones, bf16) run hybrid models and report the objects and bytes each KV group
loaded per hit: a window group's window only, a state group's one snapshot.

``python -m kvtier.app.bench.vllm_ttft --prompt-tokens 2048``
"""

from __future__ import annotations

import json
import tempfile

import typer

from kvtier.integrations.vllm.session import MODELS, run_in_subprocess
from kvtier.l3.base import redact_url


def _session(*args: str) -> dict:
    return run_in_subprocess("--warmup", "--max-tokens", "1", *args)


def main(prompt_tokens: int = typer.Option(2048, help="prompt length in tokens"),
         storage_url: str = typer.Option(None, help="L3 URL (default: a fresh temporary file store)"),
         chat_turns: int = typer.Option(16, help="turns of the multi-turn chat comparison (0: skip it)"),
         model: str = typer.Option("smollm2", help=f"the model: {', '.join(MODELS)} (tiny-gemma3: a hybrid, sliding window "
                                   "beside full attention; float32)")) -> None:
    if model not in MODELS:
        raise typer.BadParameter(f"unknown model {model!r}; choose one of {', '.join(MODELS)}", param_hint="--model")
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as tmp:
        url = storage_url or f"file://{tmp}/store"
        common = [f"--prompt-tokens={prompt_tokens}", "--seed=7", f"--model={model}"]
        if model in ("tiny-llama", "tiny-gemma3", "small-gemma3"):
            common.append("--dtype=float32")  # (Qwen3-Next's linear attention runs in bf16 only on a CPU)
        _session(f"--storage-url={url}", *common)
        hit_run = _session(f"--storage-url={url}", *common)
        hit = hit_run["results"][0]
        # the hit run loads twice (its TTFT run, then its output run): per hit, the bytes each group loaded
        (w,) = hit_run["worker_stats"]
        per_group = {"full": w["loaded_bytes"] // 2, **{g: n // 2 for g, n in w["group_bytes_loaded"].items()}}
        pages = {"full": w["loaded_pages"] // 2, **{g: n // 2 for g, n in w["group_objects_loaded"].items()}}
        base = _session("--no-kvtier", *common)["results"][0]
        chat = {}
        if chat_turns:
            turns = [f"--chat-turns={chat_turns}", "--prompt-tokens=512", "--seed=9", *common[2:]]
            with_kv = _session(f"--storage-url={url}", *turns)
            without = _session("--no-kvtier", *turns)
            chat = {
                "chat_turns": chat_turns,
                "chat_kvtier_s": round(with_kv["chat_s"], 3),
                "chat_recompute_s": round(without["chat_s"], 3),
                "chat_ratio": round(with_kv["chat_s"] / without["chat_s"], 4),
                "chat_hit_tokens": sum(r["external_hit_tokens"] for r in with_kv["results"]),
                "chat_prompt_tokens": sum(r["prompt_tokens"] for r in with_kv["results"]),
                "chat_same_outputs": [r["output_token_ids"] for r in with_kv["results"]]
                == [r["output_token_ids"] for r in without["results"]],
            }
    print(
        json.dumps(
            {
                "model": model,
                "prompt_tokens": prompt_tokens,
                "storage_url": "file (temporary)" if storage_url is None else redact_url(storage_url),
                "external_hit_tokens": hit["external_hit_tokens"],
                "storage_hit_pages": hit["storage_hit_pages"],
                "ttft_kvtier_s": round(hit["ttft_s"], 4),
                "ttft_recompute_s": round(base["ttft_s"], 4),
                "ttft_ratio": round(hit["ttft_s"] / base["ttft_s"], 4),
                "same_first_token": hit["output_token_ids"] == base["output_token_ids"],
                "bytes_loaded_per_hit": per_group,
                "pages_loaded_per_hit": pages,
                **chat,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    typer.run(main)
