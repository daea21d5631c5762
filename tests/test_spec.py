import pytest

from kvtier import KVSpec, SpecError, UnknownNameError


def test_deepseek_v32_sizes_match_design():
    s = KVSpec.preset("deepseek-v3.2")
    assert s.attention == "dsa" and s.num_layers == 61 and s.page_size == 64
    latent, indexer = s.buffers
    assert (latent.name, latent.bytes_per_token, latent.page_bytes) == ("latent", 1152, 1152 * 64)
    assert latent.device_shape(10, 64) == (640, 1, 576)
    assert (indexer.name, indexer.bytes_per_token, indexer.page_bytes) == ("indexer", 132, 8448)
    assert indexer.device_shape(10, 64) == (10, 8448) and indexer.dtype == "uint8"
    assert s.bytes_per_token_per_layer == 1284
    assert s.bytes_per_token == 1284 * 61
    assert s.page_bytes == (73728 + 8448) * 61


def test_presets():
    v3 = KVSpec.preset("deepseek-v3")
    assert v3.attention == "mla" and [b.name for b in v3.buffers] == ["latent"] and v3.bytes_per_token_per_layer == 1152
    llama = KVSpec.preset("llama-3.1-8b")
    assert [b.name for b in llama.buffers] == ["k", "v"]
    assert llama.bytes_per_token_per_layer == 2 * 8 * 128 * 2 and llama.num_layers == 32
    assert llama.buffers[0].device_shape(2, 64) == (128, 8, 128)
    assert KVSpec.preset("qwen3-32b").attention == "mha"
    assert KVSpec.preset("llama-3.1-8b", page_size=16).page_size == 16


def test_custom_spec():
    s = KVSpec.mha("mine", 2, kv_heads=4, head_dim=64, page_size=16, dtype="float16")
    assert s.bytes_per_token_per_layer == 2 * 4 * 64 * 2
    assert s.buffer("v").page_bytes == 4 * 64 * 2 * 16


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(page_size=0), "page_size"),
        (dict(page_size=0), "page_size"),
        (dict(index_head_dim=100), "index_head_dim"),
        (dict(num_layers=0), "num_layers"),
        (dict(quant_block_size=0), "quant_block_size"),
    ],
)
def test_invalid_spec_names_field(kwargs, field):
    with pytest.raises(SpecError, match=field):
        KVSpec.preset("deepseek-v3.2", **kwargs)


def test_invalid_mha_and_dtype():
    with pytest.raises(SpecError, match="kv_heads"):
        KVSpec.mha("x", 2, kv_heads=0, head_dim=8)
    with pytest.raises(UnknownNameError, match="bfloat16"):
        KVSpec.mha("x", 2, kv_heads=1, head_dim=8, dtype="fp12")


def test_unknown_preset_lists_valid_names():
    with pytest.raises(UnknownNameError) as e:
        KVSpec.preset("gpt-5")
    assert isinstance(e.value, ValueError)
    assert "deepseek-v3.2" in str(e.value) and "llama-3.1-8b" in str(e.value)


def test_fingerprint_binds_bytes_not_display_name():
    s = KVSpec.preset("deepseek-v3.2")
    assert s.fingerprint() == KVSpec.preset("deepseek-v3.2").fingerprint()
    assert s.fingerprint() == s.with_(name="renamed").fingerprint()
    assert s.fingerprint() != s.with_(page_size=32).fingerprint()
    assert s.fingerprint() != KVSpec.preset("deepseek-v3").fingerprint()
    assert s.fingerprint() != s.with_(dtype="float16").fingerprint()


@pytest.mark.parametrize("field, value", [("num_layers", 3.0), ("page_size", 64.0), ("kv_heads", True), ("head_dim", 8.5),
                                          ("state_bytes", "8")])
def test_a_whole_number_field_given_another_type_is_a_spec_error_naming_it(field, value):
    """A float or a bool equal to a whole number would pass every range check, then size memory with it (a hello's spec
    reaches here from another process): a SpecError naming the field and its type."""
    kw = dict(name="x", attention="mha", num_layers=2, page_size=64, kv_heads=2, head_dim=8)
    if field == "state_bytes":
        kw = dict(name="x", attention="state", num_layers=2, page_size=1, dtype="uint8", state_bytes=8)
    with pytest.raises(SpecError, match=f"{field} must be a whole number .*{type(value).__name__}"):
        KVSpec(**{**kw, field: value})
