"""A hybrid reference model: MLA + DSA layers beside sliding-window attention and a linear-attention
state layer, every byte of its KV and state in kvtier's pools.

Layer kinds (``HybridConfig.kinds``), as the models people deploy mix them:

* ``full``: the MLA + DSA layer of :class:`~kvtier.app.model.reference.ReferenceModel`, its
  latent KV and FP8 indexer keys in the full group's pages;
* ``sliding``: multi-head attention over the last ``window`` tokens, K and V (bf16) in the
  sliding-window group's pages; a query reads only pages its window covers;
* ``state``: linear attention with decay, ``S <- decay * S + k^T v`` and ``o = q S`` per head, token
  by token; ``S`` (fp32) is the layer's per-sequence state, kept as snapshots at page
  boundaries in the state group's slots.

Prefill runs one page per chunk, the state layer one token at a time, so a run that starts from
a cached prefix -- its window pages and the state snapshot at its boundary -- executes exactly
the operations a full recompute runs for the pages it computes: logits come out bit-identical.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvtier.app.model.reference import ModelConfig, ReferenceModel, _rmsnorm, _rope
from kvtier.groups import KVGroup, ModelSpec, StateTensor
from kvtier.spec import KVSpec

#: the group names of :meth:`HybridConfig.model_spec`
FULL, SLIDING, STATE = "full", "sliding", "linear"


@dataclass(frozen=True)
class HybridConfig:
    #: the MLA + DSA dimensions (of the full layers), vocabulary, hidden size, page size and seed
    base: ModelConfig = field(default_factory=ModelConfig)
    kinds: tuple[str, ...] = ("full", "sliding", "state", "full", "sliding", "state")
    #: tokens a sliding-window query attends back over (itself included)
    window: int = 48
    swa_heads: int = 4
    swa_head_dim: int = 32
    state_heads: int = 4
    #: per head: the key and value width of the linear-attention state (``[heads, dim, dim]`` fp32)
    state_dim: int = 32
    decay: float = 0.95
    #: the cache keeps the state every this many pages (and at each prompt's last full page)
    state_every: int = 2

    def layers(self, kind: str) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.kinds) if k == kind)

    def model_spec(self) -> ModelSpec:
        b = self.base
        full = self.layers("full")
        groups = [KVGroup(FULL, "full", full, attention=KVSpec.dsa("reference-hybrid-dsa", len(full), b.kv_lora_rank, b.qk_rope_dim,
                                                                      b.index_head_dim, b.quant_block_size, b.page_size))]
        if self.layers("sliding"):
            groups.append(KVGroup(SLIDING, "sliding_window", self.layers("sliding"), window=self.window, attention=KVSpec.mha(
                "reference-hybrid-swa", len(self.layers("sliding")), self.swa_heads, self.swa_head_dim, b.page_size)))
        if self.layers("state"):
            groups.append(KVGroup(STATE, "state", self.layers("state"),
                                  state=(StateTensor("S", (self.state_heads, self.state_dim, self.state_dim), "float32"),)))
        return ModelSpec("reference-hybrid", len(self.kinds), tuple(groups))

    def full_attention_twin(self) -> KVSpec:
        """A full-attention model of the same size: every layer an MLA + DSA layer (what a hit would
        move per page if the model had no other groups)."""
        b = self.base
        return KVSpec.dsa("reference-dsa", len(self.kinds), b.kv_lora_rank, b.qk_rope_dim, b.index_head_dim, b.quant_block_size,
                          b.page_size)


class HybridReferenceModel:
    def __init__(self, cfg: HybridConfig = HybridConfig()):
        if not cfg.layers("full") or set(cfg.kinds) - {"full", "sliding", "state"}:
            raise ValueError(f"hybrid reference model: kinds must be full, sliding or state, with a full layer; got {cfg.kinds}")
        self.cfg = cfg
        self.full = ReferenceModel(dataclasses.replace(cfg.base, num_layers=len(cfg.layers("full"))))
        c, b = cfg, cfg.base
        g = torch.Generator().manual_seed(b.seed + 1)

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g) / math.sqrt(shape[-2] if len(shape) > 1 else 1)

        self.embed, self.lm_head = self.full.embed, self.full.lm_head
        self.mixers: list[dict] = []
        full_layers = iter(self.full.layers)
        for kind in c.kinds:
            if kind == "full":
                self.mixers.append(next(full_layers))
                continue
            heads, dim = (c.swa_heads, c.swa_head_dim) if kind == "sliding" else (c.state_heads, c.state_dim)
            self.mixers.append({"q": w(b.hidden, heads * dim), "k": w(b.hidden, heads * dim), "v": w(b.hidden, heads * dim),
                                "o": w(heads * dim, b.hidden), "up": w(b.hidden, b.mlp_hidden), "down": w(b.mlp_hidden, b.hidden)})

    def prefill_page(self, pools: dict, tokens: torch.Tensor, start: int, tables: dict[str, torch.Tensor], state: torch.Tensor,
                     wait_layer: Callable[[int], None] = lambda i: None, want_logits: bool = False
                     ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """Compute tokens ``[start, start + len(tokens))`` (within one page).

        ``pools``: each group's device pool; ``tables``: each attention group's page table up to and
        including this page (a sliding window's entries before its window may be -1: never read);
        ``state``: ``[state layers, heads, dim, dim]`` at ``start``, advanced in place to the page's
        end. Returns (last-token logits if asked, the full layers' top-k selections)."""
        c = self.cfg
        pos = torch.arange(start, start + tokens.numel())
        x = self.embed[tokens]
        selections = []
        ordinal = {"full": 0, "sliding": 0, "state": 0}
        for kind, L in zip(c.kinds, self.mixers):
            i = ordinal[kind]
            ordinal[kind] += 1
            if kind == "full":
                x, sel = self.full.mla_dsa_layer(L, pools[FULL], i, x, pos, tables[FULL], wait_layer)
                selections.append(sel)
                continue
            h = _rmsnorm(x)
            if kind == "sliding":
                o = self._sliding(L, pools[SLIDING], i, h, pos, tables[SLIDING])
            else:
                o = self._linear(L, h, state[i])
            x = x + o @ L["o"]
            x = x + torch.relu(_rmsnorm(x) @ L["up"]) @ L["down"]
        logits = (_rmsnorm(x[-1:]) @ self.lm_head)[0] if want_logits else None
        return logits, selections

    def _sliding(self, L: dict, pool, layer: int, h: torch.Tensor, pos: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        c, ps = self.cfg, self.cfg.base.page_size
        n, heads, dim = pos.numel(), c.swa_heads, c.swa_head_dim
        q = _rope((h @ L["q"]).view(n, heads, dim), pos)
        k = _rope((h @ L["k"]).view(n, heads, dim), pos)
        kbuf, vbuf = pool.buffer("k", layer), pool.buffer("v", layer)
        slots = table[pos // ps] * ps + pos % ps
        kbuf[slots] = k.to(kbuf.dtype)
        vbuf[slots] = (h @ L["v"]).view(n, heads, dim).to(vbuf.dtype)
        # the window of the page's first query back to its last: read from the pool, as a paged engine would
        first = max(0, int(pos[0]) - c.window + 1)
        span = torch.arange(first, int(pos[-1]) + 1)
        span_slots = table[span // ps] * ps + span % ps
        keys, values = kbuf[span_slots].float(), vbuf[span_slots].float()
        score = torch.einsum("nhd,mhd->nhm", q, keys) / math.sqrt(dim)
        seen = (span[None, :] <= pos[:, None]) & (span[None, :] > pos[:, None] - c.window)
        att = score.masked_fill(~seen[:, None, :], float("-inf")).softmax(-1)
        return torch.einsum("nhm,mhd->nhd", att, values).reshape(n, -1)

    def _linear(self, L: dict, h: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
        """Linear attention with decay, one token at a time; ``S`` ``[heads, dim, dim]`` advances in place."""
        c = self.cfg
        n, heads, dim = h.shape[0], c.state_heads, c.state_dim
        q = (h @ L["q"]).view(n, heads, dim)
        k = (h @ L["k"]).view(n, heads, dim) / math.sqrt(dim)
        v = (h @ L["v"]).view(n, heads, dim)
        out = torch.empty(n, heads, dim)
        for t in range(n):
            S.mul_(c.decay).add_(torch.einsum("hd,he->hde", k[t], v[t]))
            out[t] = torch.einsum("hd,hde->he", q[t], S)
        return out.reshape(n, -1)
