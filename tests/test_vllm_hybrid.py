"""kvtier under vLLM's hybrid KV cache manager (``SupportsHMA``), on vLLM's CPU build, in its default
multi-process engine, with two hybrid models (seeded random weights, SmolLM2's tokenizer):

* a 4-layer Gemma 3 text config (``ensure_tiny_gemma3``): sliding-window layers (128 tokens) beside
  full attention, float32 so greedy outputs do not depend on how vLLM splits a prefill. kvtier keeps the
  full group's pages in its tree and the window group's pages beside them; a load brings only the
  window its boundary reads;
* a 4-layer Qwen3-Next config (``ensure_tiny_qwen3_next``): gated DeltaNet layers beside full
  attention, bf16. vLLM keeps the linear layers' state block-aligned; kvtier keeps each state it kept
  as a snapshot beside its page, and a load brings the one snapshot its boundary reads.

Kinds kvtier does not serve under vLLM (state kept other than block-aligned, two full groups, mixed block
sizes, other attention kinds) are refused at start-up: tested on vLLM's own spec classes."""

from __future__ import annotations

import json
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
    assert groups == [VllmGroup(0, "window", "sliding_window", tuple(sliding), BS, WINDOW - 1, "sliding_window", WINDOW),
                      VllmGroup(1, "full", "full", tuple(full), BS, 0, "full_attention", None)]
    spec = KVSpec.mha("t", 2, 2, 64, BS, "float32")
    model = model_spec("t", groups, {"full": spec, "window": spec})
    assert [g.layers for g in model.groups] == [(0, 2), (1, 3)] and model.group("window").window == WINDOW - 1
    assert model.is_hybrid and model.fingerprint() != spec.fingerprint()
    # vLLM keeps extra_retained_tokens more behind the window: so does kvtier
    kept = groups_of(_cfg((sliding, _attn(SlidingWindowSpec, sliding_window=WINDOW, extra_retained_tokens=3)),
                          (full, _attn(FullAttentionSpec))))
    assert kept[0].window == WINDOW + 2


@pytest.mark.parametrize("case, match", [
    ("mamba", "group 1 \\(MambaSpec.*mamba_cache_mode 'none'.*enable prefix caching"),
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


def test_a_group_with_no_layer_names_is_refused_naming_it():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    with pytest.raises(ConfigError, match="group 1 \\(SlidingWindowSpec\\) names no layers"):
        groups_of(_cfg((["model.layers.1.attn"], _attn(FullAttentionSpec)), ([], _attn(SlidingWindowSpec, sliding_window=WINDOW))))


def test_linear_attention_state_kept_at_block_boundaries_maps_to_a_state_group():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    linear = ["model.layers.0.linear_attn", "model.layers.2.linear_attn"]
    full = ["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"]
    state = MambaSpec(block_size=288, shapes=((4, 8),), dtypes=(torch.float32,), mamba_cache_mode="align")
    groups = groups_of(_cfg((linear, state), (full, _attn(FullAttentionSpec, block_size=288))))
    assert [(g.index, g.name, g.kind, g.block_size, g.spec_kind) for g in groups] == [
        (0, "state", "state", 288, "mamba"), (1, "full", "full", 288, "full_attention")]
    model = model_spec("t", groups, {"full": KVSpec.mha("t", 2, 2, 128, 288, "bfloat16"), "state": KVSpec.state("state-state", 2, 640)})
    assert model.group("state").kind == "state" and model.group("state").state_bytes == 2 * 640
    assert model.group("state").object_spec() == KVSpec.state("state-state", 2, 640)  # what the worker's pools hold


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


@pytest.fixture(scope="module")
def tp2_baseline():
    """vLLM without kvtier at TP=2 (each rank one of the 2 KV heads of both groups)."""
    return outputs(run_engine("--tp", "2", *prompt_args(), "--no-kvtier"))


def window_pages(tokens: int, block: int) -> int:
    """Pages of the window vLLM reads at the end of a prompt's offered full pages."""
    pages = (tokens - 1) // block
    return pages - (pages * block - (WINDOW - 1)) // block


def _page_keys(namespace: dict, tokens: list[int], block: int = BS) -> list[bytes]:
    from kvtier.hashing import Namespace, page_keys

    root = Namespace(namespace["model"], namespace["spec_fingerprint"], 0, namespace["salt"]).root()
    return page_keys(tokens[: (len(tokens) - 1) // block * block], block, root)


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


def _corrupt_in_store(url: str, namespace: dict, key: bytes) -> None:
    """Flip the last byte of one page of one rank's namespace in the file store at ``url``."""
    from kvtier.hashing import Namespace
    from kvtier.l3 import open_backend
    from kvtier.l3.tier import StorageTier
    from kvtier.pools import HostPool

    backend = open_backend(url)
    tier = StorageTier(backend, HostPool(KVSpec.mha("x", 1, 1, 8, BS, "float32"), 1), Namespace(**namespace))
    path = backend._path(tier.key(key))
    tier.close()
    with open(path, "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 0xFF]))


@pytest.mark.integration
@pytest.mark.timeout(2400)
def test_sliding_window_model_restart_hits_l3_loads_only_the_window_and_answers_as_vllm(tmp_path, baseline):
    from kvtier.hashing import group_object_key
    from kvtier.integrations.vllm.session import prompt_ids

    url = f"file://{tmp_path / 'store'}"
    first = run_engine(*prompt_args(), f"--storage-url={url}")
    assert outputs(first) == outputs(baseline)
    bs = first["block_size"]  # asked for (32); read from the engine all the same
    (w,) = first["worker_stats"]
    offered = sum((n - 1) // bs for n in LENGTHS)
    # every page went out with its window page (the prompt is prefilled in one step: none left the window yet)
    assert w["offloaded_pages"] == w["saved_pages"] == w["group_objects_offloaded"]["window"] == offered

    second = run_engine(*prompt_args(), f"--storage-url={url}")  # restarted: empty host memory, the same store
    assert outputs(second) == outputs(baseline)
    assert [r["external_hit_tokens"] for r in second["results"]] == [(n - 1) // bs * bs for n in LENGTHS]
    (w,) = second["worker_stats"]
    # each prompt runs twice (its TTFT run, then the full run after vLLM's own cache was reset): two loads each
    assert w["fetched_pages"] == offered and w["loaded_pages"] == 2 * offered and w["load_failed_pages"] == 0
    # the window group loaded its window only: 4 of 9 and 4 of 6 pages, against every page for the full group
    assert w["group_objects_loaded"] == {"window": 2 * sum(window_pages(n, bs) for n in LENGTHS)}
    assert w["group_objects_loaded"]["window"] < w["loaded_pages"]

    # the window page at the end of the first prompt lost from the store: the hit is one page shorter
    # (the boundary before it reads pages the store still has), not an error, and the answer is the same
    ns = second["namespaces"][0]
    keys = _page_keys(ns, prompt_ids(LENGTHS[0], seed=0), bs)
    assert _delete_from_store(url, ns, [group_object_key(keys[-1], "window")]) == 1
    third = run_engine(*prompt_args(), f"--storage-url={url}")
    assert outputs(third) == outputs(baseline)
    assert third["results"][0]["external_hit_tokens"] == ((LENGTHS[0] - 1) // bs - 1) * bs
    assert third["results"][1]["external_hit_tokens"] == (LENGTHS[1] - 1) // bs * bs

    # a full page of the second prompt corrupt in the store: offered, then its load fails (the checksum), and
    # vLLM -- told through failed_recving, a hybrid model's only way -- recomputes the request
    keys = _page_keys(ns, prompt_ids(LENGTHS[1], seed=1), bs)
    _corrupt_in_store(url, ns, keys[2])
    fourth = run_engine(*prompt_args(), f"--storage-url={url}")
    assert outputs(fourth) == outputs(baseline)
    (w,) = fourth["worker_stats"]
    assert w["load_failed_pages"] >= 1


@pytest.mark.integration
@pytest.mark.timeout(2400)
def test_sliding_window_model_tensor_parallel_two_ranks_hit_on_both(tmp_path, tp2_baseline):
    """TP=2 (each rank one of the 2 KV heads of both groups): both ranks store their shard of every
    group, a restarted engine loads them, and outputs equal TP=2 without kvtier."""
    url = f"file://{tmp_path / 'store'}"
    args = ["--tp", "2", *prompt_args()]
    want = tp2_baseline
    first = run_engine(*args, f"--storage-url={url}")
    assert outputs(first) == want
    bs = first["block_size"]  # asked for (32); read from the engine all the same
    second = run_engine(*args, f"--storage-url={url}")
    assert outputs(second) == want
    assert [r["external_hit_tokens"] for r in second["results"]] == [(n - 1) // bs * bs for n in LENGTHS]
    offered = sum((n - 1) // bs for n in LENGTHS)
    for w in second["worker_stats"]:
        assert w["fetched_pages"] == offered and w["group_objects_loaded"] == {"window": 2 * sum(window_pages(n, bs) for n in LENGTHS)}


def test_hybrid_kv_events_carry_vllms_group_fields():
    """A hybrid model's blocks reach vLLM's KV event stream per group: the full group's for every block, a
    window group's for the blocks whose window page went out (one event per contiguous run), both with
    vLLM's group fields; a block leaving host memory takes its window page with it."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as external

    from kvtier.integrations.vllm.events import TierEvents
    from support.engine_device_hybrid import build, computed, keys_of
    from support.hybrid_models import P

    core = build("one process")
    window = VllmGroup(0, "swa", "sliding_window", ("model.layers.0.attn",), P, 5, "sliding_window", 6)
    full = VllmGroup(1, "full", "full", ("model.layers.1.attn",), P, 0, "full_attention", None)
    events = TierEvents(P, groups=[window, full])
    core.on_host_evicted = events.evicted
    keys = keys_of(core, 5)
    blocks, ids = computed(core, keys, 0, window_from=3)  # the engine still held window pages 3, 4
    ids["swa"][1] = 21  # and page 1's (a run of its own)
    r = core.offload(keys, blocks, wait=False, groups=ids)
    request = SimpleNamespace(block_hashes=[bytes([9, i]) * 8 for i in range(5)], all_token_ids=list(range(5 * P)))
    events.planned(request, 0, keys, r.copy_op, r.l3_save_op, {"swa": [b is not None for b in ids["swa"]]})
    core.wait_for([r.copy_op])
    events.update(core)
    got = events.take()
    h = [external(b) for b in request.block_hashes]
    assert [(type(e).__name__, e.medium, e.group_idx, e.block_hashes, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window)
            for e in got] == [("BlockStored", "CPU", 1, h, "full_attention", None),
                              ("BlockStored", "CPU", 0, [h[1]], "sliding_window", 6),
                              ("BlockStored", "CPU", 0, h[3:], "sliding_window", 6)]
    assert got[2].parent_block_hash == h[2] and got[2].token_ids == list(range(3 * P, 5 * P))
    core.evict_host(5)
    removed = events.take()
    assert all(isinstance(e, BlockRemoved) and e.medium == "CPU" for e in removed)
    assert sorted((e.group_idx, sorted(e.block_hashes)) for e in removed) == [(0, sorted([h[1], h[3], h[4]])), (1, sorted(h))]
    assert not any(isinstance(e, BlockStored) for e in removed)
    core.close()


@pytest.mark.integration
@pytest.mark.timeout(1500)
def test_vllm_serve_hybrid_model_restart_hits_and_metrics(tmp_path, baseline):
    """``vllm serve`` of the sliding-window model with the connector, over HTTP: a second server on the
    same store gets the prompt from L3, both answer as vLLM without kvtier (the module's baseline engine),
    and ``/metrics`` shows kvtier's per-tier counters."""
    from kvtier.app.devservers import VllmServer
    from kvtier.integrations.vllm.model import ensure_tiny_gemma3
    from kvtier.integrations.vllm.session import prompt_ids

    model = str(ensure_tiny_gemma3())
    args = ("--dtype", "float32", "--block-size", str(BS), "--max-model-len", "4096", "--enforce-eager", "--seed", "0")
    kv = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm.connector", "kv_role": "kv_both",
          "kv_load_failure_policy": "recompute",
          "kv_connector_extra_config": {"host_gb": 0.25, "storage_url": f"file://{tmp_path / 'store'}"}}
    body = {"model": model, "prompt": prompt_ids(LENGTHS[1], seed=1), "max_tokens": 8, "temperature": 0.0}

    def sample(metrics: str, name: str, **labels) -> float:
        for line in metrics.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    servers = []
    try:
        first = VllmServer(model, tmp_path / "first", kv, args).start()
        servers.append(first)
        text1 = first.post("/v1/completions", body)["choices"][0]["text"]
        metrics1 = first.get_text("/metrics")
        first.stop()  # SIGTERM: the workers drain their L3 writes before they exit
        second = VllmServer(model, tmp_path / "second", kv, args).start()
        servers.append(second)
        out = second.post("/v1/completions", body)
        metrics2 = second.get_text("/metrics")
        assert text1 == out["choices"][0]["text"] == baseline["results"][1]["text"]
        loaded = (LENGTHS[1] - 1) // BS * BS
        assert sample(metrics1, "vllm:kvtier_tokens_total", tier="host", direction="store") == LENGTHS[1] // BS * BS
        assert sample(metrics2, "vllm:kvtier_tokens_total", tier="storage", direction="load") == loaded
        assert sample(metrics2, "vllm:kvtier_tokens_total", tier="host", direction="load") == loaded
    finally:
        for s in servers:
            s.stop()


@pytest.mark.integration
@pytest.mark.timeout(1800)
def test_vllm_serve_of_gemma3s_five_to_one_layout_on_the_node_service_through_two_crashes_answers_as_vllm_alone():
    """The vLLM soak's short version (``kvtier bench service --vllm-soak 2 --soak-seed 3``): ``vllm serve`` of a tiny
    Gemma 3 with its own layout (five sliding-window layers to one full: a KV cache group per layer, five of them
    windows, each an object pool of the region) on one ``kvtier serve``. The server's whole process group is SIGKILLed
    mid-request and started again, then the service is SIGKILLed and started again on the region it left. Every answer
    -- while the service is down too -- equals ``vllm serve`` of the model without kvtier; the pass after each restart
    (vLLM's own prefix cache emptied) takes a prompt's whole prefix, pages and window pages, from the service's host
    tier, verified; nothing is left leased once the server stopped."""
    import subprocess
    import sys

    from kvtier.app.bench.vllm_soak import BLOCK_SIZE, SYSTEM_TOKENS, TURN_TOKENS, VllmSoakConfig, schedule, workload
    from support.service import ENV, ROOT

    config = VllmSoakConfig(2, seed=3)
    assert [(victim, sig) for victim, sig, _ in schedule(config)] == [("vllm", "SIGKILL"), ("service", "SIGKILL")]
    r = subprocess.run([sys.executable, "-m", "kvtier.app.cli", "bench", "service", "--vllm-soak", "2", "--soak-seed", "3", "--json"],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=1700)
    assert r.returncode == 0, r.stderr[-3000:]
    soak = json.loads(r.stdout)["vllm_soak"]
    assert soak["kills"] == {"vllm": 1, "service": 1} and soak["signals"] == {"SIGKILL": 2, "SIGTERM": 0}, soak
    assert (soak["wrong_answers"], soak["failed_requests"], soak["failed_restarts"], soak["stuck_leases"]) == (0, 0, 0, 0), soak
    assert soak["corrupt_pages"] == 0 and soak["requests"] >= 2 * len(workload(config.seed)), soak
    first_prefix = (SYSTEM_TOKENS + TURN_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE  # (the pass's first prompt: nothing on the device)
    assert soak["host_hit_passes"] == {"vllm": 1, "service": 1}, soak
    assert min(soak["host_tokens_after"].values()) >= first_prefix, soak
    # (a hybrid model's hit needs every group's objects at its boundary: the host tokens above came with window pages)
    assert soak["object_pools"] == [f"window{i}" for i in range(5)], soak


# ---- linear attention (Qwen3-Next) ----------------------------------------------------------
QWEN_LENGTHS = [300, 650]


def run_qwen(*args, timeout=900):
    from kvtier.integrations.vllm.session import run_in_subprocess

    return run_in_subprocess("--model", "tiny-qwen3-next", "--dtype", "bfloat16", "--max-tokens", "8",
                             *[f"--prompt-tokens={n}" for n in QWEN_LENGTHS], *args, timeout=timeout)


def state_hit(tokens: int, block: int) -> int:
    """Tokens a prompt of ``tokens`` can hit after it ran once, at vLLM block size ``block``: vLLM ends a
    prompt's first chunk at its last block boundary and keeps the state there (one snapshot), and a hit
    stops a token short of the prompt's end, so it is that boundary -- unless the prompt is whole
    blocks, where the last boundary is out of reach and no earlier one has a state."""
    return tokens // block * block if tokens % block else 0


@pytest.mark.integration
@pytest.mark.timeout(2400)
def test_linear_attention_model_restart_hits_l3_state_included_and_answers_as_vllms_own_hit(tmp_path):
    """A 4-layer Qwen3-Next (gated DeltaNet layers beside full attention, bf16: vLLM's CPU backend runs its
    linear attention in bf16 only). vLLM gives every group one block size, aligned to the linear layers'
    state page -- which depends on the machine (288 tokens on one, 160 on another), so every expectation
    here is derived from the block size the engine reports -- and keeps the linear layers' state
    block-aligned; kvtier keeps the state at each block boundary vLLM kept as a snapshot beside its page.

    The reference is vLLM's own prefix-cache hit on the same prompt, same engine settings (``--own-hit``: the
    prompt's second run is served from vLLM's cache of its first). In bf16 a prefill after a prefix hit
    rounds differently from a full prefill; a hit at the same block boundary -- vLLM's or kvtier's -- starts
    from the same KV and the same state and computes the same tail, so the outputs must be identical."""
    from kvtier.hashing import group_object_key
    from kvtier.integrations.vllm.session import prompt_ids

    url = f"file://{tmp_path / 'store'}"
    own_hit = run_qwen("--no-kvtier", "--own-hit")
    first = run_qwen(f"--storage-url={url}")
    block = first["block_size"]
    assert own_hit["block_size"] == block  # (the same machine and model: the same choice)
    hits = [state_hit(n, block) for n in QWEN_LENGTHS]
    assert any(hits), f"vLLM chose {block}-token blocks: no prompt of {QWEN_LENGTHS} reaches a kept state"
    (w,) = first["worker_stats"]
    # every full block went out; a state snapshot beside the one block each prompt kept its state after
    assert w["offloaded_pages"] == sum(n // block for n in QWEN_LENGTHS)
    assert w["group_objects_offloaded"] == {"state": sum(n >= block for n in QWEN_LENGTHS)}

    second = run_qwen(f"--storage-url={url}")  # restarted: empty host memory, the same store
    assert second["block_size"] == block
    assert [r["external_hit_tokens"] for r in second["results"]] == hits
    assert outputs(second) == outputs(own_hit)
    (w,) = second["worker_stats"]
    assert w["fetched_pages"] == sum(hits) // block and w["load_failed_pages"] == 0
    assert w["group_objects_loaded"] == {"state": 2 * sum(h > 0 for h in hits)}  # one snapshot per load (each prompt loads twice)

    # the longer prompt's snapshot lost from the store: no boundary of it has its state, so its first run is
    # a miss, recomputed in full, not an error (and stores the state again: its second run hits kvtier's host
    # memory at the same boundary as vLLM's own hit)
    assert hits[1], f"vLLM chose {block}-token blocks: the {QWEN_LENGTHS[1]}-token prompt reaches no kept state"
    ns = second["namespaces"][0]
    keys = _page_keys(ns, prompt_ids(QWEN_LENGTHS[1], seed=1), block)
    assert _delete_from_store(url, ns, [group_object_key(keys[hits[1] // block - 1], "state")]) == 1
    third = run_qwen(f"--storage-url={url}")
    assert [r["external_hit_tokens"] for r in third["results"]] == [hits[0], 0]
    assert outputs(third) == outputs(own_hit)
    (w,) = third["worker_stats"]
    assert w["load_failed_pages"] == 0 and w["group_objects_offloaded"] == {"state": 1}
