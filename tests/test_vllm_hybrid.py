"""kvtier under vLLM's hybrid KV cache manager (``SupportsHMA``): a model of sliding-window layers beside
full-attention ones, on vLLM's CPU build, in its default multi-process engine.

The model is a 4-layer Gemma 3 text config (``ensure_tiny_gemma3``: window 128 tokens, seeded random
weights, SmolLM2's tokenizer), float32 so greedy outputs do not depend on how vLLM splits a prefill.
vLLM makes two KV cache groups of it; kvtier keeps the full group's pages in its tree and the window
group's pages beside them, and a load brings only the window its boundary reads.

Kinds kvtier does not serve under vLLM (Mamba / linear-attention state, two full groups, mixed block
sizes, other attention kinds) are refused at start-up: tested on vLLM's own spec classes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.groups import VllmGroup, groups_of, model_spec
from kvtier.spec import KVSpec

BS = 32
WINDOW = 128
#: 300 tokens: 9 full pages offered; 200: 6
LENGTHS = [300, 200]


def _cfg(*groups):
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    return SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec(list(names), spec) for names, spec in groups])


def _attn(cls, **kw):
    return cls(block_size=kw.pop("block_size", BS), num_kv_heads=2, head_size=64, dtype=torch.float32, **kw)


# ---- vLLM's groups -> kvtier's (no engine) ----------------------------------------------------
def test_gemma_like_groups_map_to_a_full_and_a_window_group():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    sliding = ["model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"]
    full = ["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"]
    groups = groups_of(_cfg((sliding, _attn(SlidingWindowSpec, sliding_window=WINDOW)), (full, _attn(FullAttentionSpec))))
    assert groups == [VllmGroup(0, "window", "sliding_window", tuple(sliding), BS, WINDOW - 1),
                      VllmGroup(1, "full", "full", tuple(full), BS, 0)]
    spec = KVSpec.mha("t", 2, 2, 64, BS, "float32")
    model = model_spec("t", groups, {"full": spec, "window": spec})
    assert [g.layers for g in model.groups] == [(0, 2), (1, 3)] and model.group("window").window == WINDOW - 1
    assert model.is_hybrid and model.fingerprint() != spec.fingerprint()
    # vLLM keeps extra_retained_tokens more behind the window: so does kvtier
    kept = groups_of(_cfg((sliding, _attn(SlidingWindowSpec, sliding_window=WINDOW, extra_retained_tokens=3)),
                          (full, _attn(FullAttentionSpec))))
    assert kept[0].window == WINDOW + 2


@pytest.mark.parametrize("case, match", [
    ("mamba", "group 1 \\(MambaSpec.*Mamba / linear-attention state"),
    ("chunked", "group 0 \\(ChunkedLocalAttentionSpec.*full-attention and sliding-window groups only"),
    ("two full", "2 full-attention KV cache groups"),
    ("window only", "0 full-attention KV cache groups"),
    ("block sizes", "block sizes \\[16, 32\\]"),
])
def test_what_kvtier_cannot_serve_is_refused_at_start_up_naming_the_group(case, match):
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, MambaSpec, SlidingWindowSpec

    full = (["model.layers.1.attn"], _attn(FullAttentionSpec))
    window = (["model.layers.0.attn"], _attn(SlidingWindowSpec, sliding_window=WINDOW))
    groups = {
        "mamba": [full, (["model.layers.0.mixer"], MambaSpec(block_size=BS, shapes=((4, 8),), dtypes=(torch.float32,)))],
        "chunked": [(["model.layers.0.attn"], _attn(ChunkedLocalAttentionSpec, attention_chunk_size=64)), full],
        "two full": [full, (["model.layers.2.attn"], _attn(FullAttentionSpec))],
        "window only": [window],
        "block sizes": [full, (["model.layers.0.attn"], _attn(SlidingWindowSpec, sliding_window=WINDOW, block_size=16))],
    }[case]
    with pytest.raises(ConfigError, match=match):
        groups_of(_cfg(*groups))


# ---- the real engine -----------------------------------------------------------------------
def outputs(report):
    return [r["output_token_ids"] for r in report["results"]]


def run_engine(*args, timeout=900):
    from kvtier.integrations.vllm.session import run_in_subprocess

    return run_in_subprocess("--model", "tiny-gemma3", "--dtype", "float32", *args, timeout=timeout)


def prompt_args():
    return ["--max-tokens", "8", *[f"--prompt-tokens={n}" for n in LENGTHS]]


@pytest.fixture(scope="module")
def baseline():
    """vLLM without kvtier (its hybrid KV cache manager on)."""
    return run_engine(*prompt_args(), "--no-kvtier")


def window_pages(tokens: int) -> int:
    """Pages of the window vLLM reads at the end of a prompt's offered full pages."""
    pages = (tokens - 1) // BS
    return pages - (pages * BS - (WINDOW - 1)) // BS


def _page_keys(namespace: dict, tokens: list[int]) -> list[bytes]:
    from kvtier.hashing import Namespace, page_keys

    root = Namespace(namespace["model"], namespace["spec_fingerprint"], 0, namespace["salt"]).root()
    return page_keys(tokens[: (len(tokens) - 1) // BS * BS], BS, root)


def _delete_from_store(url: str, namespace: dict, keys: list[bytes]) -> int:
    """Delete these L3 keys of one rank's namespace from the store at ``url``; returns how many were there."""
    from kvtier.hashing import Namespace
    from kvtier.l3 import open_backend
    from kvtier.l3.tier import StorageTier
    from kvtier.pools import HostPool

    backend = open_backend(url)
    tier = StorageTier(backend, HostPool(KVSpec.mha("x", 1, 1, 8, BS, "float32"), 1), Namespace(**namespace))
    names = [tier.key(k) for k in keys]
    there = backend.exists(names)
    backend.delete(names)
    tier.close()
    return there


@pytest.mark.integration
@pytest.mark.timeout(2400)
def test_sliding_window_model_restart_hits_l3_loads_only_the_window_and_answers_as_vllm(tmp_path, baseline):
    from kvtier.hashing import group_object_key
    from kvtier.integrations.vllm.session import prompt_ids

    url = f"file://{tmp_path / 'store'}"
    first = run_engine(*prompt_args(), f"--storage-url={url}")
    assert outputs(first) == outputs(baseline)
    (w,) = first["worker_stats"]
    offered = sum((n - 1) // BS for n in LENGTHS)
    # every page went out with its window page (the prompt is prefilled in one step: none left the window yet)
    assert w["offloaded_pages"] == w["saved_pages"] == w["window_pages_offloaded"] == offered

    second = run_engine(*prompt_args(), f"--storage-url={url}")  # restarted: empty host memory, the same store
    assert outputs(second) == outputs(baseline)
    assert [r["external_hit_tokens"] for r in second["results"]] == [(n - 1) // BS * BS for n in LENGTHS]
    (w,) = second["worker_stats"]
    # each prompt runs twice (its TTFT run, then the full run after vLLM's own cache was reset): two loads each
    assert w["fetched_pages"] == offered and w["loaded_pages"] == 2 * offered and w["load_failed_pages"] == 0
    # the window group loaded its window only: 4 of 9 and 4 of 6 pages, against every page for the full group
    assert w["window_pages_loaded"] == 2 * sum(window_pages(n) for n in LENGTHS) < w["loaded_pages"]

    # the window page at the end of the first prompt lost from the store: the hit is one page shorter
    # (the boundary before it reads pages the store still has), not an error, and the answer is the same
    ns = second["namespaces"][0]
    keys = _page_keys(ns, prompt_ids(LENGTHS[0], seed=0))
    assert _delete_from_store(url, ns, [group_object_key(keys[-1], "window")]) == 1
    third = run_engine(*prompt_args(), f"--storage-url={url}")
    assert outputs(third) == outputs(baseline)
    assert third["results"][0]["external_hit_tokens"] == ((LENGTHS[0] - 1) // BS - 1) * BS
    assert third["results"][1]["external_hit_tokens"] == (LENGTHS[1] - 1) // BS * BS


@pytest.mark.integration
@pytest.mark.timeout(2400)
def test_sliding_window_model_tensor_parallel_two_ranks_hit_on_both(tmp_path):
    """TP=2 (each rank one of the 2 KV heads of both groups): both ranks store their shard of every
    group, a restarted engine loads them, and outputs equal TP=2 without kvtier."""
    url = f"file://{tmp_path / 'store'}"
    args = ["--tp", "2", *prompt_args()]
    want = outputs(run_engine(*args, "--no-kvtier"))
    first = run_engine(*args, f"--storage-url={url}")
    assert outputs(first) == want
    second = run_engine(*args, f"--storage-url={url}")
    assert outputs(second) == want
    assert [r["external_hit_tokens"] for r in second["results"]] == [(n - 1) // BS * BS for n in LENGTHS]
    offered = sum((n - 1) // BS for n in LENGTHS)
    for w in second["worker_stats"]:
        assert w["fetched_pages"] == offered and w["window_pages_loaded"] == 2 * sum(window_pages(n) for n in LENGTHS)
