"""What one token costs in each KV buffer of a model: :class:`KVSpec`.

A spec lists its buffers (:class:`BufferSpec`); every pool, transfer and storage
page iterates over that list, so MHA/GQA, MLA and MLA+DSA need no subclasses.
Each buffer is addressed in whole pages: page ``p`` of a buffer in one layer is a
contiguous row of ``page_bytes`` bytes (slots of a page are consecutive).

Byte formats (see DESIGN.md):

* MHA/GQA: per layer ``k`` and ``v`` of shape ``[num_slots, kv_heads, head_dim]``.
* MLA: per layer ``latent`` of shape ``[num_slots, 1, kv_lora_rank + qk_rope_dim]``.
* DSA indexer: per layer ``indexer`` uint8 ``[num_pages, page_size * (d + d // qb * 4)]``;
  in each page first ``page_size * d`` FP8 keys, then ``page_size * d // qb`` fp32 scales.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from typing import Literal

import torch

from kvtier.errors import SpecError, UnknownNameError

#: ``state``: not attention but a hybrid model's per-sequence state (Mamba, linear attention) as the
#: objects kvtier moves: one-token "pages" (snapshots) of one opaque ``state`` buffer per layer.
AttentionKind = Literal["mha", "mla", "dsa", "state"]
BufferGranularity = Literal["token", "page"]
#: How an MHA/GQA page is laid out in memory. ``nhd``: DESIGN.md's ``k`` and ``v`` buffers,
#: token-major ``[slots, kv_heads, head_dim]`` (vLLM's GPU flash layout). ``hnd_paired``: one
#: ``kv`` page buffer per layer holding ``[kv_heads, 2 (K then V), page_size, head_dim]``
#: (vLLM's CPU backend block), moved as raw whole pages with no re-layout.
KVLayout = Literal["nhd", "hnd_paired"]
KV_LAYOUTS: tuple[KVLayout, ...] = ("nhd", "hnd_paired")

#: Bumped whenever a byte format changes; part of every spec fingerprint (and so every L3 key).
LAYOUT_VERSION = 1

_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "uint8": torch.uint8,
}


def dtype_of(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise UnknownNameError("dtype", name, _DTYPES) from None


def dtype_name(dtype: torch.dtype) -> str:
    """The spec name of a torch dtype (inverse of :func:`dtype_of`)."""
    for name, dt in _DTYPES.items():
        if dt == dtype:
            return name
    raise UnknownNameError("dtype", str(dtype), _DTYPES)


@dataclass(frozen=True, slots=True)
class BufferSpec:
    """One per-layer buffer of a spec.

    ``granularity="token"`` buffers are shaped ``[num_slots, *token_shape]`` in
    ``dtype``; ``"page"`` buffers (the DSA indexer) are uint8 ``[num_pages, page_bytes]``.
    """

    name: str
    granularity: BufferGranularity
    dtype: str
    token_shape: tuple[int, ...]
    bytes_per_token: int
    page_bytes: int

    def device_shape(self, num_pages: int, page_size: int) -> tuple[int, ...]:
        if self.granularity == "token":
            return (num_pages * page_size, *self.token_shape)
        return (num_pages, self.page_bytes)

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_of(self.dtype)


#: :class:`KVSpec`'s fields that hold whole numbers
_INT_FIELDS = ("num_layers", "page_size", "kv_heads", "head_dim", "kv_lora_rank", "qk_rope_dim", "index_head_dim", "quant_block_size",
               "state_bytes")


@dataclass(frozen=True)
class KVSpec:
    """Per-token KV cost of a model, per layer and buffer. Immutable; validated on creation.

    Build one with :meth:`preset`, :meth:`mha`, :meth:`mla` or :meth:`dsa`, or
    directly with the fields below.
    """

    name: str
    attention: AttentionKind
    num_layers: int
    page_size: int = 64
    dtype: str = "bfloat16"
    #: MHA/GQA: KV heads and head dimension.
    kv_heads: int = 0
    head_dim: int = 0
    #: MLA/DSA: latent rank and rope dimension (latent row = kv_lora_rank + qk_rope_dim).
    kv_lora_rank: int = 0
    qk_rope_dim: int = 0
    #: DSA: indexer key dimension and FP8 quantisation block (one fp32 scale per block).
    index_head_dim: int = 0
    quant_block_size: int = 0
    #: MHA/GQA page layout (see :data:`KVLayout`); part of the fingerprint when not ``nhd``.
    kv_layout: KVLayout = "nhd"
    #: state: bytes of one snapshot per layer; part of the fingerprint when set.
    state_bytes: int = 0

    def __post_init__(self) -> None:
        def need(cond: bool, field: str, msg: str) -> None:
            if not cond:
                raise SpecError(f"KVSpec {self.name!r}: {field} {msg}")

        for f in _INT_FIELDS:  # (a float or a bool that equals a whole number would pass every check below, then size memory)
            v = getattr(self, f)
            need(type(v) is int, f, f"must be a whole number (an int), got {v!r} of type {type(v).__name__}")
        need(self.attention in ("mha", "mla", "dsa", "state"), "attention", f"must be mha, mla, dsa or state, got {self.attention!r}")
        need((self.attention == "state") == (self.state_bytes > 0), "state_bytes", "is set for (and only for) a state spec, positive")
        need(self.num_layers > 0, "num_layers", f"must be positive, got {self.num_layers}")
        ps = self.page_size
        need(isinstance(ps, int) and not isinstance(ps, bool) and ps > 0, "page_size", f"must be a whole number of tokens > 0, got {ps!r}")
        dtype_of(self.dtype)
        if self.attention == "state":
            need(ps == 1 and self.dtype == "uint8", "page_size", "of a state spec is 1 (a snapshot is one slot) and its dtype uint8")
        elif self.attention == "mha":
            need(self.kv_heads > 0, "kv_heads", f"must be positive for mha, got {self.kv_heads}")
            need(self.head_dim > 0, "head_dim", f"must be positive for mha, got {self.head_dim}")
            need(self.kv_layout in KV_LAYOUTS, "kv_layout", f"must be one of {', '.join(KV_LAYOUTS)}, got {self.kv_layout!r}")
        else:
            need(self.kv_layout == "nhd", "kv_layout", f"applies to mha only; {self.attention} specs use 'nhd', got {self.kv_layout!r}")
            need(self.kv_lora_rank > 0, "kv_lora_rank", f"must be positive for {self.attention}, got {self.kv_lora_rank}")
            need(self.qk_rope_dim >= 0, "qk_rope_dim", f"must be >= 0, got {self.qk_rope_dim}")
        if self.attention == "dsa":
            need(self.index_head_dim > 0, "index_head_dim", f"must be positive for dsa, got {self.index_head_dim}")
            need(self.quant_block_size > 0, "quant_block_size", f"must be positive for dsa, got {self.quant_block_size}")
            need(
                self.index_head_dim % self.quant_block_size == 0,
                "index_head_dim",
                f"({self.index_head_dim}) must be a multiple of quant_block_size ({self.quant_block_size})",
            )

    # ---- buffers -----------------------------------------------------------------
    @functools.cached_property  # specs are immutable; the L3 path asks per page
    def buffers(self) -> tuple[BufferSpec, ...]:
        item = dtype_of(self.dtype).itemsize
        ps = self.page_size
        if self.attention == "state":
            return (BufferSpec("state", "page", "uint8", (self.state_bytes,), self.state_bytes, self.state_bytes),)
        if self.attention == "mha":
            shape = (self.kv_heads, self.head_dim)
            bpt = self.kv_heads * self.head_dim * item
            if self.kv_layout == "hnd_paired":
                return (BufferSpec("kv", "page", "uint8", (2 * bpt,), 2 * bpt, 2 * bpt * ps),)
            return (
                BufferSpec("k", "token", self.dtype, shape, bpt, bpt * ps),
                BufferSpec("v", "token", self.dtype, shape, bpt, bpt * ps),
            )
        width = self.kv_lora_rank + self.qk_rope_dim
        bufs = [BufferSpec("latent", "token", self.dtype, (1, width), width * item, width * item * ps)]
        if self.attention == "dsa":
            bpt = self.indexer_bytes_per_token
            bufs.append(BufferSpec("indexer", "page", "uint8", (bpt,), bpt, bpt * ps))
        return tuple(bufs)

    @property
    def indexer_bytes_per_token(self) -> int:
        """FP8 key bytes plus fp32 scale bytes per token (DSA); 0 otherwise."""
        if self.attention != "dsa":
            return 0
        return self.index_head_dim + self.index_head_dim // self.quant_block_size * 4

    @property
    def bytes_per_token_per_layer(self) -> int:
        return sum(b.bytes_per_token for b in self.buffers)

    @property
    def page_bytes_per_layer(self) -> int:
        return sum(b.page_bytes for b in self.buffers)

    @property
    def bytes_per_token(self) -> int:
        """All layers, all buffers."""
        return self.bytes_per_token_per_layer * self.num_layers

    @property
    def page_bytes(self) -> int:
        """One page, all layers, all buffers: the size of one L3 page payload."""
        return self.page_bytes_per_layer * self.num_layers

    def buffer(self, name: str) -> BufferSpec:
        for b in self.buffers:
            if b.name == name:
                return b
        raise UnknownNameError("buffer", name, [b.name for b in self.buffers])

    # ---- identity ----------------------------------------------------------------
    def fingerprint(self) -> str:
        """Stable hex digest of every field that changes bytes (not the display name).

        Computed once per spec (specs are immutable; L3 header checks call this per page).
        The default ``kv_layout`` is left out so fingerprints from before the field existed hold.
        """
        cached = self.__dict__.get("_fingerprint")
        if cached is not None:
            return cached
        import blake3

        fields = dataclasses.asdict(self)
        fields.pop("name")
        if fields["kv_layout"] == "nhd":
            fields.pop("kv_layout")
        if not fields["state_bytes"]:  # (specs from before state specs existed keep their fingerprint)
            fields.pop("state_bytes")
        fields["layout_version"] = LAYOUT_VERSION
        fp = blake3.blake3(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
        object.__setattr__(self, "_fingerprint", fp)
        return fp

    def with_(self, **changes: object) -> KVSpec:
        return dataclasses.replace(self, **changes)

    def describe(self) -> dict[str, object]:
        return {
            **dataclasses.asdict(self),
            "buffers": {b.name: {"bytes_per_token": b.bytes_per_token, "page_bytes": b.page_bytes} for b in self.buffers},
            "bytes_per_token_per_layer": self.bytes_per_token_per_layer,
            "page_bytes_per_layer": self.page_bytes_per_layer,
            "bytes_per_token": self.bytes_per_token,
            "page_bytes": self.page_bytes,
        }

    # ---- constructors ------------------------------------------------------------
    @classmethod
    def mha(cls, name: str, num_layers: int, kv_heads: int, head_dim: int, page_size: int = 64, dtype: str = "bfloat16") -> KVSpec:
        return cls(name, "mha", num_layers, page_size, dtype, kv_heads=kv_heads, head_dim=head_dim)

    @classmethod
    def mla(cls, name: str, num_layers: int, kv_lora_rank: int = 512, qk_rope_dim: int = 64, page_size: int = 64,
            dtype: str = "bfloat16") -> KVSpec:
        return cls(name, "mla", num_layers, page_size, dtype, kv_lora_rank=kv_lora_rank, qk_rope_dim=qk_rope_dim)

    @classmethod
    def dsa(
        cls,
        name: str,
        num_layers: int,
        kv_lora_rank: int = 512,
        qk_rope_dim: int = 64,
        index_head_dim: int = 128,
        quant_block_size: int = 128,
        page_size: int = 64,
        dtype: str = "bfloat16",
    ) -> KVSpec:
        return cls(
            name,
            "dsa",
            num_layers,
            page_size,
            dtype,
            kv_lora_rank=kv_lora_rank,
            qk_rope_dim=qk_rope_dim,
            index_head_dim=index_head_dim,
            quant_block_size=quant_block_size,
        )

    @classmethod
    def state(cls, name: str, num_layers: int, state_bytes: int) -> KVSpec:
        """Snapshots of a per-sequence state: one slot holds ``state_bytes`` per layer."""
        return cls(name, "state", num_layers, 1, "uint8", state_bytes=state_bytes)

    @classmethod
    def preset(cls, name: str, **overrides: object) -> KVSpec:
        """A named model spec; ``overrides`` replace fields (e.g. ``page_size=32``)."""
        try:
            spec = PRESETS[name]
        except KeyError:
            raise UnknownNameError("preset", name, PRESETS) from None
        return spec.with_(**overrides) if overrides else spec


PRESETS: dict[str, KVSpec] = {
    "deepseek-v3": KVSpec.mla("deepseek-v3", 61),
    "deepseek-v3.2": KVSpec.dsa("deepseek-v3.2", 61),
    "llama-3.1-8b": KVSpec.mha("llama-3.1-8b", 32, kv_heads=8, head_dim=128),
    "llama-3.1-70b": KVSpec.mha("llama-3.1-70b", 80, kv_heads=8, head_dim=128),
    "qwen3-32b": KVSpec.mha("qwen3-32b", 64, kv_heads=8, head_dim=128),
}
