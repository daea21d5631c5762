"""vLLM's per-layer KV tensors -> a kvtier :class:`KVSpec` and a wrapped device pool.

Pure tensor-shape logic (no vLLM import), so it is tested on synthetic tensors.
Supported per-layer shapes:

* CPU_ATTN ``[blocks, kv_heads, block_size, 2 * head_size]`` (K rows then V rows per
  head): spec ``kv_layout="hnd_paired"``, one ``kv`` page buffer; pages move raw.
* FLASH_ATTN-style ``[2, blocks, block_size, kv_heads, head_size]``: DESIGN.md's
  ``k``/``v`` buffers (``kv_layout="nhd"``).
* MLA ``[blocks, block_size, kv_lora_rank + rope_dim]``: the ``latent`` buffer.
* Mamba / linear-attention state (:func:`map_state_caches`): each layer's
  ``[blocks, ...]`` bytes of one block's state (vLLM pads a state block to its
  attention page: the rows are strided), one snapshot per block.

Anything else, or a shape that disagrees with the model config, is a
:class:`~kvtier.errors.ConfigError` at startup, before any request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.errors import ConfigError, SpecError, UnknownNameError
from kvtier.pools import DevicePool
from kvtier.spec import KVSpec, dtype_name


@dataclass(frozen=True)
class ModelShape:
    """What the model config says one layer's KV looks like (cross-checked against the tensors)."""

    name: str
    block_size: int
    kv_heads: int
    head_size: int
    use_mla: bool = False
    kv_lora_rank: int = 0
    qk_rope_dim: int = 0


def _dtype_name(t: torch.Tensor) -> str:
    try:
        return dtype_name(t.dtype)
    except UnknownNameError as e:
        raise ConfigError(f"kvtier connector: KV cache dtype not supported ({e})") from None


def map_kv_caches(kv_caches: dict[str, torch.Tensor], model: ModelShape) -> tuple[KVSpec, DevicePool, dict[str, int]]:
    """Spec, device pool over the engine's tensors, and layer name -> layer index."""
    if not kv_caches:
        raise ConfigError("kvtier connector: vLLM registered no KV cache tensors")
    names = list(kv_caches)
    tensors = [kv_caches[n] for n in names]
    shape, dtype = tuple(tensors[0].shape), tensors[0].dtype
    for n, t in zip(names, tensors):
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ConfigError(
                f"kvtier connector: layer {n} KV is {tuple(t.shape)} {t.dtype}, layer {names[0]} is {shape} {dtype}; "
                "kvtier needs one shape for all layers"
            )
    bs, dt = model.block_size, _dtype_name(tensors[0])

    def mismatch(what: str) -> ConfigError:
        return ConfigError(
            f"kvtier connector: vLLM KV cache shape {shape} does not match the model config ({what}); "
            "check block_size and the attention backend"
        )

    try:
        if model.use_mla:
            if len(shape) != 3 or shape[1] != bs:
                raise mismatch(f"MLA expects [blocks, {bs}, rank + rope]")
            if shape[2] != model.kv_lora_rank + model.qk_rope_dim:
                raise mismatch(f"latent width {model.kv_lora_rank} + {model.qk_rope_dim}")
            spec = KVSpec.mla(model.name, len(names), model.kv_lora_rank, model.qk_rope_dim, bs, dt)
            buffers = {"latent": tensors}
        elif len(shape) == 4:
            if shape[1] != model.kv_heads or shape[2] != bs or shape[3] != 2 * model.head_size:
                raise mismatch(f"CPU layout expects [blocks, {model.kv_heads}, {bs}, {2 * model.head_size}]")
            spec = KVSpec(model.name, "mha", len(names), bs, dt, kv_heads=model.kv_heads, head_dim=model.head_size, kv_layout="hnd_paired")
            buffers = {"kv": tensors}
        elif len(shape) == 5 and shape[0] == 2:
            if shape[2] != bs or shape[3] != model.kv_heads or shape[4] != model.head_size:
                raise mismatch(f"NHD layout expects [2, blocks, {bs}, {model.kv_heads}, {model.head_size}]")
            spec = KVSpec.mha(model.name, len(names), model.kv_heads, model.head_size, bs, dt)
            buffers = {"k": [t[0] for t in tensors], "v": [t[1] for t in tensors]}
        else:
            raise ConfigError(
                f"kvtier connector: unsupported vLLM KV cache shape {shape}; kvtier maps CPU_ATTN [blocks, heads, block, 2*head], "
                "NHD [2, blocks, block, heads, head] and MLA [blocks, block, width] caches"
            )
        pool = DevicePool.wrap(spec, buffers, name="vLLM KV cache")
    except SpecError as e:
        raise ConfigError(f"kvtier connector: {e}") from e
    return spec, pool, {n: i for i, n in enumerate(names)}


def map_state_caches(kv_caches: dict[str, torch.Tensor], name: str) -> tuple[KVSpec, DevicePool, dict[str, int]]:
    """A state group's layers (vLLM's Mamba / linear-attention cache: per layer ``[blocks, ...]``, one
    block's state in each row, rows possibly padded) -> a state spec of one snapshot per block, a pool
    over the engine's tensors, and layer name -> layer index in the group."""
    names = list(kv_caches)
    tensors = [kv_caches[n] for n in names]
    first = tensors[0]
    row_bytes = first[0].numel() * first.element_size()
    for n, t in zip(names, tensors):
        if t.shape != first.shape or t.dtype != first.dtype or not t[0].is_contiguous():
            raise ConfigError(f"kvtier connector: state layer {n} is {tuple(t.shape)} {t.dtype}, layer {names[0]} is "
                              f"{tuple(first.shape)} {first.dtype}; kvtier needs one contiguous state row per block, alike in every "
                              "layer")
    try:
        spec = KVSpec.state(f"{name}-state", len(names), row_bytes)
        pool = DevicePool.wrap(spec, {"state": tensors}, name="vLLM state cache")
    except SpecError as e:
        raise ConfigError(f"kvtier connector: {e}") from e
    return spec, pool, {n: i for i, n in enumerate(names)}
