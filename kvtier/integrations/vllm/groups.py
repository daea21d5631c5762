"""vLLM's KV cache groups (its hybrid KV cache manager) -> kvtier's KV groups.

vLLM 0.32 gives a hybrid model one KV cache group per kind of layer (and splits
a kind into groups of equal layer count): full attention, sliding window,
Mamba / linear attention. Block ids come from one pool shared by every group
(a freed sliding-window block may next hold a full-attention page), and each
request has one block list per group. kvtier keeps the full group's pages in
its tree and every other group's objects beside them
(:mod:`kvtier.core.group_residency`): a sliding-window group's pages, and a
Mamba / linear-attention group's state snapshots. With prefix caching on, vLLM
keeps that state in ``align`` mode: a prefill is cut at block boundaries, and
the state block at a request's block index ``i`` holds the state after block
``i`` once the forward passed it (vLLM's null block where it kept none) -- so
it is the snapshot of the page that block ends.

What kvtier cannot serve is refused here, at start-up, with the group and the
reason (:class:`~kvtier.errors.ConfigError`), never answered wrongly later:

* Mamba / linear-attention state kept other than block-aligned
  (``mamba_cache_mode`` ``none``: prefix caching off; ``all``);
* more than one full-attention group (kvtier's tree holds one);
* groups of different block sizes (kvtier matches on one page size);
* any other kind of group (chunked local attention, cross attention, ...).

The sliding window kvtier keeps per boundary is what vLLM reads there:
``sliding_window - 1 + extra_retained_tokens`` tokens before it
(``SlidingWindowManager.get_num_skipped_tokens``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from kvtier.errors import ConfigError
from kvtier.groups import KVGroup, ModelSpec, StateTensor
from kvtier.spec import KVSpec

_LAYER_NUMBER = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True)
class VllmGroup:
    """One of vLLM's KV cache groups, as kvtier serves it."""

    #: vLLM's group index (the position of this group's block list in a request's block ids)
    index: int
    #: kvtier's name for it: ``full``, or ``window`` (``window1``, ... when there are several)
    name: str
    kind: Literal["full", "sliding_window", "state"]
    layer_names: tuple[str, ...]
    block_size: int
    #: sliding_window: tokens before a boundary vLLM reads from there
    window: int = 0
    #: how vLLM's own KV events name this group's spec (``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``)
    spec_kind: str | None = None
    sliding_window: int | None = None


def _what(spec: Any) -> str:
    return type(spec).__name__


def groups_of(kv_cache_config: Any) -> list[VllmGroup]:
    """kvtier's view of vLLM's ``KVCacheConfig.kv_cache_groups``, or a ConfigError naming the group
    kvtier cannot serve and why."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
        get_kv_cache_spec_kind,
        get_kv_cache_spec_sliding_window,
    )

    raw = list(kv_cache_config.kv_cache_groups)
    out: list[VllmGroup] = []
    windows = sum(type(g.kv_cache_spec) is SlidingWindowSpec for g in raw)
    for i, g in enumerate(raw):
        spec, layers = g.kv_cache_spec, tuple(g.layer_names)
        if not layers:
            raise ConfigError(f"kvtier connector: vLLM KV cache group {i} ({_what(spec)}) names no layers: every group kvtier serves "
                              "covers at least one attention or state layer")
        where = f"kvtier connector: vLLM KV cache group {i} ({_what(spec)}, layers {layers[0]} ...)"
        if isinstance(spec, MambaSpec):
            if spec.mamba_cache_mode != "align":
                raise ConfigError(f"{where} keeps its state in mamba_cache_mode {spec.mamba_cache_mode!r}: kvtier serves state kept "
                                  "at block boundaries (\"align\", vLLM's mode with prefix caching on): enable prefix caching")
            states = sum(isinstance(o.kv_cache_spec, MambaSpec) for o in raw)
            name = "state" if states == 1 else f"state{sum(o.kind == 'state' for o in out)}"
            out.append(VllmGroup(i, name, "state", layers, spec.block_size, 0, get_kv_cache_spec_kind(spec).value, None))
            continue
        if type(spec) in (FullAttentionSpec, MLAAttentionSpec):
            kind, name, window = "full", "full", 0
        elif type(spec) is SlidingWindowSpec:
            kind, window = "sliding_window", spec.sliding_window - 1 + getattr(spec, "extra_retained_tokens", 0)
            name = "window" if windows == 1 else f"window{sum(o.kind == 'sliding_window' for o in out)}"
        else:
            raise ConfigError(f"{where}: kvtier serves full-attention and sliding-window groups only")
        out.append(VllmGroup(i, name, kind, layers, spec.block_size, window, get_kv_cache_spec_kind(spec).value,
                             get_kv_cache_spec_sliding_window(spec)))
    fulls = [g for g in out if g.kind == "full"]
    if len(fulls) != 1:
        raise ConfigError(f"kvtier connector: the model has {len(fulls)} full-attention KV cache groups; kvtier keeps one "
                          "full-attention group's pages (a model of sliding-window layers only is not served)")
    sizes = {g.block_size for g in out}
    if len(sizes) > 1:
        raise ConfigError(f"kvtier connector: vLLM's KV cache groups use block sizes {sorted(sizes)}; kvtier matches every group on "
                          "one page size: give vLLM one --block-size for every group")
    return out


def layer_number(name: str, fallback: int) -> int:
    """The model layer a vLLM layer name belongs to (``model.layers.7.self_attn.attn`` -> 7)."""
    m = _LAYER_NUMBER.search(name)
    return int(m.group(1)) if m else fallback


def model_spec(name: str, groups: list[VllmGroup], specs: dict[str, KVSpec]) -> ModelSpec:
    """The kvtier model of vLLM's groups, ``specs`` being each group's spec as a worker's tensors make it."""
    all_names = [n for g in groups for n in g.layer_names]
    numbers = {n: layer_number(n, i) for i, n in enumerate(all_names)}
    if len(set(numbers.values())) != len(all_names):  # names without distinct numbers: their order is the layer order
        numbers = {n: i for i, n in enumerate(all_names)}
    order = {n: i for i, n in enumerate(sorted(all_names, key=numbers.__getitem__))}
    kv = tuple(KVGroup(g.name, g.kind, tuple(order[n] for n in g.layer_names), state=(StateTensor("state", (specs[g.name].state_bytes,),
                                                                                                  "uint8"),))
               if g.kind == "state" else
               KVGroup(g.name, g.kind, tuple(order[n] for n in g.layer_names), attention=specs[g.name], window=g.window)
               for g in groups)
    return ModelSpec(name, len(all_names), kv)


def hybrid_fingerprint(spec: KVSpec, objects: list[tuple[str, KVSpec]], layout: str, tp_size: int) -> str:
    """A hybrid model's identity under vLLM: its node-service region format's fingerprint (the full group's page ``spec``
    split over ``tp_size`` ranks, and an object pool per other group, ``objects`` in vLLM's group order). It roots the
    model's page keys and names every rank's L3 objects, so an engine's own L3 and a service's L3 over one store hold one
    set of objects."""
    from kvtier.service.region import ObjectPool, region_format_of

    fmt, _shards = region_format_of(spec, layout, tp_size, hybrid=True)
    return fmt.with_objects([ObjectPool(name, ospec) for name, ospec in objects]).fingerprint
