"""The engines ``kvtier plan`` calibrates against and validates with, and their models as the planner sees them.

* ``run`` / ``run-hybrid``: ``kvtier run``'s engine (:mod:`kvtier.app.engine`) in this process, its
  reference MLA + DSA model or the hybrid variant, on kvtier's real tiers (device and host pools on
  the CPU, a file L3);
* ``vllm`` / ``vllm-hybrid``: vLLM's CPU engine with kvtier's connector in a process of its own
  (:mod:`kvtier.app.plan.engine_vllm`), a tiny Llama or a tiny Gemma 3 (sliding-window layers
  beside full ones), float32; vLLM's own prefix cache is the device tier.

Each engine's model is also a plan spec (``--plan-spec reference-dsa`` ...), so a profile measured
on an engine plans a trace at that model's real object sizes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvtier.errors import UnknownNameError
from kvtier.groups import KVGroup, ModelSpec
from kvtier.spec import KVSpec


@dataclass(frozen=True)
class Engine:
    name: str
    #: the plan spec name of its model
    model: str
    #: tokens per page (vLLM: its block size)
    page_tokens: int
    #: token ids prompts are drawn from
    vocab: int
    #: vLLM's model (``kvtier.integrations.vllm.session.MODELS``); None for kvtier run's engine
    vllm_model: str | None = None
    hybrid: bool = False


ENGINES = {
    "run": Engine("run", "reference-dsa", 32, 2048),
    "run-hybrid": Engine("run-hybrid", "reference-hybrid", 32, 2048, hybrid=True),
    "vllm": Engine("vllm", "vllm-tiny-llama", 32, 49152, vllm_model="tiny-llama"),
    "vllm-hybrid": Engine("vllm-hybrid", "vllm-tiny-gemma3", 32, 49152, vllm_model="tiny-gemma3", hybrid=True),
}


def engine(name: str) -> Engine:
    if name not in ENGINES:
        raise UnknownNameError("engine", name, ENGINES)
    return ENGINES[name]


def _reference_dsa() -> ModelSpec:
    from kvtier.app.model import ModelConfig

    return ModelSpec.of(ModelConfig().kv_spec())


def _reference_hybrid() -> ModelSpec:
    from kvtier.app.model.hybrid import HybridConfig

    return HybridConfig().model_spec()


def _tiny_llama() -> ModelSpec:
    """vLLM's view of ``ensure_tiny_llama`` in float32: 2 layers of 2 KV heads of 64."""
    return ModelSpec.of(KVSpec.mha("vllm-tiny-llama", 2, 2, 64, 32, "float32"))


def _tiny_gemma3() -> ModelSpec:
    """``ensure_tiny_gemma3`` in float32: sliding-window (128 tokens) and full layers alternating, 2 KV heads of 64."""
    from kvtier.integrations.vllm.model import TINY_GEMMA3_WINDOW

    layers = KVSpec.mha("vllm-tiny-gemma3", 2, 2, 64, 32, "float32")  # a window page is a full page: vLLM's one block pool holds both
    return ModelSpec("vllm-tiny-gemma3", 4, (KVGroup("full", "full", (1, 3), attention=layers),
                                             KVGroup("sliding", "sliding_window", (0, 2), window=TINY_GEMMA3_WINDOW, attention=layers)))


#: an engine's model by its plan spec name, at the engine's page size
ENGINE_MODELS = {"reference-dsa": _reference_dsa, "reference-hybrid": _reference_hybrid, "vllm-tiny-llama": _tiny_llama,
                 "vllm-tiny-gemma3": _tiny_gemma3}


def engine_model(name: str, page_tokens: int | None = None) -> ModelSpec | None:
    """The engine model ``name`` (every attention group at ``page_tokens`` if given), or None if it is none."""
    make = ENGINE_MODELS.get(name)
    if make is None:
        return None
    model = make()
    if page_tokens is None:
        return model
    groups = tuple(dataclasses.replace(g, attention=g.attention.with_(page_size=page_tokens)) if g.attention is not None else g
                   for g in model.groups)
    return ModelSpec(model.name, model.num_layers, groups)
