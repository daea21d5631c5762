"""KV groups (hybrid models) in the spec: every preset's bytes per group against the arithmetic of its
published config, today's specs unchanged as one full group (same fingerprint, so same L3 keys), and
what a prefix needs from each kind of group."""

import pytest

from kvtier.errors import SpecError, UnknownNameError
from kvtier.groups import HYBRID_PRESETS, KVGroup, ModelSpec, StateTensor, model_spec
from kvtier.spec import PRESETS, KVSpec

BF16 = 2
#: the fields of the published configs (Hugging Face config.json) the arithmetic below uses
GPT_OSS_120B = {"num_hidden_layers": 36, "num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128,
                "layer_types": ["sliding_attention", "full_attention"] * 18}
GEMMA_3_27B = {"num_hidden_layers": 62, "num_key_value_heads": 16, "head_dim": 128, "sliding_window": 1024, "sliding_window_pattern": 6}
QWEN3_NEXT_80B_A3B = {"num_hidden_layers": 48, "full_attention_interval": 4, "num_key_value_heads": 2, "head_dim": 256,
                      "linear_conv_kernel_dim": 4, "linear_num_key_heads": 16, "linear_key_head_dim": 128,
                      "linear_num_value_heads": 32, "linear_value_head_dim": 128}


def kv_per_token(cfg, layers: int) -> int:
    return layers * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * BF16


def test_gpt_oss_120b_groups_match_its_config():
    cfg, spec = GPT_OSS_120B, HYBRID_PRESETS["gpt-oss-120b"]
    full = [i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention"]
    sliding = [i for i, t in enumerate(cfg["layer_types"]) if t == "sliding_attention"]
    assert list(spec.group("full").layers) == full and list(spec.group("sliding").layers) == sliding
    assert spec.group("full").bytes_per_token == kv_per_token(cfg, len(full)) == 36_864
    assert spec.group("sliding").bytes_per_token == kv_per_token(cfg, len(sliding))
    assert spec.group("sliding").window == cfg["sliding_window"]


def test_gemma_3_27b_groups_match_its_config():
    cfg, spec = GEMMA_3_27B, HYBRID_PRESETS["gemma-3-27b"]
    glob = [i for i in range(cfg["num_hidden_layers"]) if (i + 1) % cfg["sliding_window_pattern"] == 0]
    assert list(spec.group("full").layers) == glob and len(glob) == 10
    assert spec.group("full").bytes_per_token == kv_per_token(cfg, 10) == 81_920
    assert spec.group("sliding").bytes_per_token == kv_per_token(cfg, 52) == 425_984
    assert spec.group("sliding").window == cfg["sliding_window"]


def test_qwen3_next_groups_and_state_snapshot_match_its_config():
    cfg, spec = QWEN3_NEXT_80B_A3B, HYBRID_PRESETS["qwen3-next-80b-a3b"]
    n, every = cfg["num_hidden_layers"], cfg["full_attention_interval"]
    assert list(spec.group("full").layers) == [i for i in range(n) if (i + 1) % every == 0]
    assert spec.group("full").bytes_per_token == kv_per_token(cfg, 12) == 24_576
    key_dim = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    value_dim = cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
    conv = (2 * key_dim + value_dim) * (cfg["linear_conv_kernel_dim"] - 1) * BF16
    recurrent = cfg["linear_num_value_heads"] * cfg["linear_key_head_dim"] * cfg["linear_value_head_dim"] * BF16
    linear = spec.group("linear")
    assert linear.kind == "state" and linear.bytes_per_token == 0
    assert linear.state_bytes == 36 * (conv + recurrent) == 39_518_208  # one snapshot, ~39.5 MB per sequence


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_todays_specs_are_one_full_group_with_their_fingerprint(name):
    spec = PRESETS[name]
    one = model_spec(name)
    assert not one.is_hybrid and one.fingerprint() == spec.fingerprint()  # a store written before groups still hits
    assert one.kv_bytes(5 * spec.page_size + 3) == {"full": 5 * spec.page_bytes}


def test_hybrid_fingerprints_differ_from_each_other_and_from_a_full_model():
    prints = {name: s.fingerprint() for name, s in HYBRID_PRESETS.items()}
    assert len(set(prints.values())) == len(prints)
    narrower = HYBRID_PRESETS["gpt-oss-120b"].groups
    moved = ModelSpec("x", 36, (narrower[0], KVGroup("sliding", "sliding_window", narrower[1].layers, narrower[1].attention, window=64)))
    assert moved.fingerprint() != prints["gpt-oss-120b"]  # the window is part of what the bytes mean


@pytest.mark.parametrize("window, tokens, pages", [(128, 64 * 10, range(8, 10)),   # window of 2 pages
                                                   (100, 64 * 10, range(8, 10)),   # not page-aligned: the page it starts in too
                                                   (4096, 64 * 10, range(0, 10)),  # larger than the prefix: every page
                                                   (64, 64 * 10, range(9, 10))])
def test_a_sliding_window_needs_only_the_pages_covering_its_window(window, tokens, pages):
    g = KVGroup("w", "sliding_window", (0,), KVSpec.mha("m", 1, kv_heads=1, head_dim=8), window=window)
    assert g.pages_needed(tokens, 64) == pages
    assert KVGroup("f", "full", (0,), KVSpec.mha("m", 1, kv_heads=1, head_dim=8)).pages_needed(tokens, 64) == range(0, 10)
    with pytest.raises(SpecError, match="whole pages"):
        g.pages_needed(tokens + 1, 64)


def test_kv_bytes_per_group_shrink_with_the_window_and_cost_a_snapshot_for_state():
    oss = HYBRID_PRESETS["gpt-oss-120b"]
    ps = oss.page_size
    held = oss.kv_bytes(32_768)
    assert held["full"] == 32_768 // ps * oss.group("full").attention.page_bytes
    assert held["sliding"] == 128 // ps * oss.group("sliding").attention.page_bytes  # the window's pages only
    qwen = HYBRID_PRESETS["qwen3-next-80b-a3b"]
    assert qwen.kv_bytes(32_768)["linear"] == qwen.group("linear").state_bytes  # one snapshot, whatever the length


def test_bad_groups_are_spec_errors_naming_the_group():
    attn = KVSpec.mha("m", 2, kv_heads=1, head_dim=8)
    with pytest.raises(SpecError, match="'w'.*window"):
        KVGroup("w", "sliding_window", (0, 1), attn)
    with pytest.raises(SpecError, match="3 group layers"):
        KVGroup("f", "full", (0, 1, 2), attn)
    with pytest.raises(SpecError, match="state tensors"):
        KVGroup("s", "state", (0,), attn)
    with pytest.raises(SpecError, match="shape"):
        StateTensor("conv", (0, 3), "bfloat16")
    with pytest.raises(SpecError, match="exactly one group"):
        ModelSpec("m", 3, (KVGroup("f", "full", (0, 1), attn),))
    with pytest.raises(UnknownNameError, match="gpt-oss-120b"):
        model_spec("gpt-oss")


def test_kvtier_spec_shows_a_hybrid_preset_per_group():
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "kvtier.app.cli", "spec", "qwen3-next-80b-a3b"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    groups = {g["name"]: g for g in json.loads(r.stdout)["groups"]}
    assert groups["full"]["bytes_per_token"] == 24_576 and groups["linear"]["state_bytes"] == 39_518_208
