"""Hybrid models as KV groups: which layers keep what, per token or per sequence.

A model is a set of KV groups (DESIGN.md, "Hybrid models: KV groups"), as the
engines model it (vLLM's KV cache groups, SGLang's FULL / SWA / MAMBA tree
components):

* ``full``: attention over every token (MHA/GQA, MLA, MLA+DSA): every page of a
  prefix is needed. Its buffers are a :class:`~kvtier.spec.KVSpec` over the
  group's layers.
* ``sliding_window``: attention over the last ``window`` tokens: a prefix of ``n``
  tokens needs only the pages that cover tokens ``[n - window, n)``.
* ``state``: a fixed-size state per sequence (Mamba's SSM and conv states, linear
  attention's recurrent state): a prefix is usable only where a snapshot of the
  state was kept, at a whole-page boundary. A snapshot is one object per prefix.

Today's specs are one full group: :meth:`ModelSpec.of` wraps a ``KVSpec``, with
its fingerprint unchanged, so a store written before hybrid groups existed
still hits. This module is the spec layer of hybrid support; the policy core's
per-group residency builds on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from kvtier.errors import ConfigError, SpecError, UnknownNameError
from kvtier.spec import KVSpec, dtype_of

GroupKind = Literal["full", "sliding_window", "state"]

#: each kind of KV group and what one of its objects is: ``"attention"`` (a page of the group's attention
#: buffers) or ``"state"`` (a snapshot). The rules of each kind live in :mod:`kvtier.core.group_kinds`,
#: whose ``register`` adds a kind of one's own here.
GROUP_KINDS: dict[str, str] = {"full": "attention", "sliding_window": "attention", "state": "state"}


def window_pages(window: int, pages: int, page_size: int) -> range:
    """The pages of a ``pages``-page prefix a sliding window of ``window`` tokens reads to continue from it:
    those covering tokens ``[pages * page_size - window, pages * page_size)``."""
    return range(max(0, pages * page_size - window) // page_size, pages)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_group_name(name: object) -> None:
    """A group name ends up in L3 keys and metric labels: a non-empty str that UTF-8 can encode."""
    if not isinstance(name, str) or not name:
        raise SpecError(f"KV group name must be a non-empty str, got {name!r}")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as e:
        raise SpecError(f"KV group name {name!r} cannot be encoded as UTF-8 ({e.reason} at {e.start}): it names L3 keys; "
                        "use printable characters") from None


@dataclass(frozen=True)
class StateTensor:
    """One tensor of a state group's per-sequence state, per layer (e.g. ``conv`` ``[8192, 3]`` bf16)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        dtype_of(self.dtype)
        if not isinstance(self.shape, tuple) or not self.shape or any(not _is_int(d) or d <= 0 for d in self.shape):
            raise SpecError(f"state tensor {self.name!r}: shape must be positive ints, got {self.shape!r}")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_of(self.dtype).itemsize


@dataclass(frozen=True)
class KVGroup:
    """One group: its kind, the model layers it covers, and what each of them keeps."""

    name: str
    kind: GroupKind
    layers: tuple[int, ...]
    #: full and sliding_window: the per-layer buffers (a KVSpec whose ``num_layers`` is ``len(layers)``)
    attention: KVSpec | None = None
    #: sliding_window: tokens each query attends back over
    window: int = 0
    #: state: the tensors of one layer's per-sequence state
    state: tuple[StateTensor, ...] = ()

    def __post_init__(self) -> None:
        check_group_name(self.name)

        def need(cond: bool, field: str, msg: str) -> None:
            if not cond:
                raise SpecError(f"KV group {self.name!r} ({self.kind!r}): {field} {msg}")

        need(self.kind in GROUP_KINDS, "kind", f"must be one of {', '.join(GROUP_KINDS)}, got {self.kind!r}")
        layers = self.layers
        need(isinstance(layers, tuple) and all(_is_int(i) and i >= 0 for i in layers),
             "layers", f"must be a tuple of layer indices (ints >= 0), got {layers!r}")
        need(len(layers) > 0 and len(set(layers)) == len(layers), "layers", f"must be distinct and at least one, got {layers!r}")
        window = self.window
        need(_is_int(window), "window", f"must be a whole number of tokens (an int), got {window!r}")
        if self.keeps == "state":
            need(self.attention is None, "attention", "must be None: a state group keeps state tensors, not attention buffers")
            need(isinstance(self.state, tuple) and len(self.state) > 0 and all(isinstance(t, StateTensor) for t in self.state),
                 "state", f"must be a non-empty tuple of StateTensor, got {self.state!r}")
        else:
            need(isinstance(self.attention, KVSpec), "attention", f"must be a KVSpec for an attention group, got {self.attention!r}")
            need(not self.state, "state", "is for state groups only; an attention group keeps its attention buffers")
            need(self.attention.num_layers == len(layers),
                 "attention", f"spec has {self.attention.num_layers} layers for {len(layers)} group layers")
        if self.kind == "sliding_window":
            need(window > 0, "window", f"must be > 0 tokens for a sliding_window group, got {window!r}")
        else:
            need(window == 0, "window", f"is for sliding_window groups only (leave it 0), got {window!r}")

    @property
    def keeps(self) -> str:
        """What one of this group's objects is: ``"attention"`` (a page of its buffers) or ``"state"`` (a snapshot)."""
        return GROUP_KINDS[self.kind]

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token costs in this group (all its layers); 0 for a state group."""
        return self.attention.bytes_per_token if self.attention is not None else 0

    @property
    def state_bytes(self) -> int:
        """Bytes of one state snapshot (all the group's layers); 0 for attention groups."""
        return sum(t.nbytes for t in self.state) * len(self.layers)

    def object_spec(self) -> KVSpec:
        """What one of this group's objects is, as a spec pools and stores take: a sliding-window
        page is a page of its attention spec; a state snapshot is a one-slot page of a state spec
        (every tensor of one layer's state, packed, per layer). Full groups: their attention spec."""
        if self.keeps != "state":
            return self.attention
        return KVSpec.state(f"{self.name}-state", len(self.layers), sum(t.nbytes for t in self.state))

    def pages_needed(self, num_tokens: int, page_size: int) -> range:
        """The pages of a ``num_tokens`` prefix (whole pages) this group reads to continue from it:
        all of them (full), those covering the last ``window`` tokens (sliding_window), none (state:
        its snapshot at the boundary instead)."""
        if num_tokens % page_size:
            raise SpecError(f"a prefix of {num_tokens} tokens is not whole pages of {page_size}: groups are matched on page boundaries")
        pages = num_tokens // page_size
        if self.kind == "full":
            return range(pages)
        if self.kind == "state":
            return range(pages, pages)
        return window_pages(self.window, pages, page_size)


@dataclass(frozen=True)
class ModelSpec:
    """A model's KV groups over its ``num_layers`` layers, each layer in exactly one group."""

    name: str
    num_layers: int
    groups: tuple[KVGroup, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise SpecError(f"ModelSpec name must be a str, got {self.name!r}")
        if not _is_int(self.num_layers) or self.num_layers <= 0:
            raise SpecError(f"ModelSpec {self.name!r}: num_layers must be an int > 0, got {self.num_layers!r}")
        if not isinstance(self.groups, tuple) or not self.groups or not all(isinstance(g, KVGroup) for g in self.groups):
            raise SpecError(f"ModelSpec {self.name!r}: groups must be a non-empty tuple of KVGroup, got {self.groups!r}")
        if all(g.attention is None for g in self.groups):
            raise SpecError(f"ModelSpec {self.name!r}: no attention group (full or sliding_window); a model's pages are its attention "
                            "groups' pages, so at least one is needed")
        covered = sorted(layer for g in self.groups for layer in g.layers)
        if covered != list(range(self.num_layers)):
            raise SpecError(f"ModelSpec {self.name!r}: every one of its {self.num_layers} layers must be in exactly one group")
        sizes = {g.attention.page_size for g in self.groups if g.attention is not None}
        if len(sizes) > 1:
            raise SpecError(f"ModelSpec {self.name!r}: its attention groups use page sizes {sorted(sizes)}; one page size for all")
        if len({g.name for g in self.groups}) != len(self.groups):
            raise SpecError(f"ModelSpec {self.name!r}: group names must be distinct")

    @classmethod
    def of(cls, spec: KVSpec) -> ModelSpec:
        """Today's spec as one full group (same bytes, same fingerprint, same L3 keys)."""
        return cls(spec.name, spec.num_layers, (KVGroup("full", "full", tuple(range(spec.num_layers)), attention=spec),))

    @property
    def is_hybrid(self) -> bool:
        return len(self.groups) > 1 or self.groups[0].kind != "full"

    @property
    def page_size(self) -> int:
        return next(g.attention.page_size for g in self.groups if g.attention is not None)

    def full_group(self) -> KVGroup:
        """The one full-attention group, whose pages a cache's tree keeps (a :class:`ConfigError` for none or several)."""
        fulls = [g for g in self.groups if g.kind == "full"]
        if len(fulls) != 1:
            fix = "merge the full-attention layers into one group" if fulls else "a cache serves models with full attention"
            raise ConfigError(f"model {self.name!r}: the cache keeps one full-attention group's pages, it has {len(fulls)}; {fix}")
        return fulls[0]

    def group(self, name: str) -> KVGroup:
        for g in self.groups:
            if g.name == name:
                return g
        raise UnknownNameError("KV group", name, [g.name for g in self.groups])

    def fingerprint(self) -> str:
        """One full group: its KVSpec's fingerprint, unchanged (stores written before groups still hit).
        Hybrid: a digest of every group's kind, layers, window, buffers and state."""
        if not self.is_hybrid:
            return self.groups[0].attention.fingerprint()
        import blake3

        parts = [(g.kind, g.layers, g.window, g.attention.fingerprint() if g.attention else "",
                  [(t.name, t.shape, t.dtype) for t in g.state]) for g in self.groups]
        return blake3.blake3(repr(parts).encode()).hexdigest()[:16]

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "num_layers": self.num_layers, "fingerprint": self.fingerprint(), "groups": [
            {"name": g.name, "kind": g.kind, "layers": len(g.layers), "window": g.window or None,
             "bytes_per_token": g.bytes_per_token, "state_bytes": g.state_bytes,
             "page_bytes": g.attention.page_bytes if g.attention is not None else None} for g in self.groups]}

    def kv_bytes(self, num_tokens: int) -> dict[str, int]:
        """What each group holds for one sequence of ``num_tokens`` tokens (whole pages): its pages'
        bytes (a sliding window's pages only) or its one state snapshot."""
        ps = self.page_size
        whole = num_tokens // ps * ps
        out = {}
        for g in self.groups:
            if g.kind == "state":
                out[g.name] = g.state_bytes
            else:
                out[g.name] = len(g.pages_needed(whole, ps)) * g.attention.page_bytes
        return out


def _alternating(name: str, num_layers: int, full_every: int, full_offset: int, window: int, attention: KVSpec) -> ModelSpec:
    """Sliding-window layers with a full-attention layer every ``full_every`` (at ``i % full_every ==
    full_offset``), both with the same per-layer buffers."""
    full = tuple(i for i in range(num_layers) if i % full_every == full_offset)
    slide = tuple(i for i in range(num_layers) if i % full_every != full_offset)
    return ModelSpec(name, num_layers, (KVGroup("full", "full", full, attention=attention.with_(num_layers=len(full))),
                                        KVGroup("sliding", "sliding_window", slide, attention=attention.with_(num_layers=len(slide)),
                                                window=window)))


def _linear_attention(name: str, num_layers: int, full_every: int, attention: KVSpec, state: tuple[StateTensor, ...]) -> ModelSpec:
    """Linear-attention layers with a full-attention layer every ``full_every`` (the last of each run)."""
    full = tuple(i for i in range(num_layers) if (i + 1) % full_every == 0)
    linear = tuple(i for i in range(num_layers) if (i + 1) % full_every)
    return ModelSpec(name, num_layers, (KVGroup("full", "full", full, attention=attention.with_(num_layers=len(full))),
                                        KVGroup("linear", "state", linear, state=state)))


#: Real hybrids at their published sizes (the configs' fields are written out in tests/test_groups.py).
HYBRID_PRESETS: dict[str, ModelSpec] = {
    # gpt-oss-120b: 36 layers alternating sliding (window 128) and full attention, 8 KV heads x 64, bf16
    "gpt-oss-120b": _alternating("gpt-oss-120b", 36, 2, 1, 128, KVSpec.mha("gpt-oss-120b", 1, kv_heads=8, head_dim=64)),
    # Gemma 3 27B: 62 layers, five local (window 1024) to one global, 16 KV heads x 128, bf16
    "gemma-3-27b": _alternating("gemma-3-27b", 62, 6, 5, 1024, KVSpec.mha("gemma-3-27b", 1, kv_heads=16, head_dim=128)),
    # Qwen3-Next-80B-A3B: 48 layers, full attention every 4th (2 KV heads x 256); the others gated
    # DeltaNet: conv state [2 x 16 x 128 + 32 x 128 channels, kernel 4 - 1], recurrent state
    # [32 value heads, 128, 128], bf16
    "qwen3-next-80b-a3b": _linear_attention(
        "qwen3-next-80b-a3b", 48, 4, KVSpec.mha("qwen3-next-80b-a3b", 1, kv_heads=2, head_dim=256),
        (StateTensor("conv", (2 * 16 * 128 + 32 * 128, 3), "bfloat16"), StateTensor("recurrent", (32, 128, 128), "bfloat16"))),
}


def model_spec(name: str) -> ModelSpec:
    """A hybrid preset, or one of :data:`kvtier.spec.PRESETS` as a single full group."""
    if name in HYBRID_PRESETS:
        return HYBRID_PRESETS[name]
    from kvtier.spec import PRESETS

    if name in PRESETS:
        return ModelSpec.of(PRESETS[name])
    raise UnknownNameError("model preset", name, [*PRESETS, *HYBRID_PRESETS])
