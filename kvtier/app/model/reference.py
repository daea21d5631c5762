"""Reference model for correctness and end-to-end runs: MLA attention with a DSA indexer.

Per layer it writes the latent KV (``[slot, 1, kv_lora_rank + qk_rope_dim]``,
bf16) and the indexer keys (FP8 + fp32 scales, the exact DESIGN.md page format)
into the device pool, then reads them back from the pool for the indexer's
top-k selection and for attention over the selected tokens. Nothing is kept
outside the pool, so a page restored from host or storage must be bit-exact
for the outputs to match a recompute.

Prefill runs one page per chunk. A run with a cached prefix therefore executes
exactly the same tensor shapes for the pages it computes as a full recompute
does, and its logits come out bit-identical, not merely close.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvtier.app.model.dsa import dequantize, quantize, read_pages, write_tokens
from kvtier.spec import KVSpec


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 2048
    hidden: int = 256
    num_layers: int = 4
    num_heads: int = 4
    qk_nope_dim: int = 64
    qk_rope_dim: int = 32
    v_head_dim: int = 64
    kv_lora_rank: int = 128
    index_heads: int = 4
    index_head_dim: int = 64
    quant_block_size: int = 32
    index_topk: int = 256
    mlp_hidden: int = 1024
    page_size: int = 32
    seed: int = 0

    def kv_spec(self) -> KVSpec:
        return KVSpec.dsa(
            "reference-dsa",
            self.num_layers,
            self.kv_lora_rank,
            self.qk_rope_dim,
            self.index_head_dim,
            self.quant_block_size,
            self.page_size,
        )


def _rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on the last dim of ``x`` ``[n, ..., d]`` at positions ``pos`` ``[n]``."""
    d = x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = pos.float()[:, None] * inv[None, :]
    shape = [x.shape[0]] + [1] * (x.dim() - 2) + [d // 2]
    cos, sin = ang.cos().view(shape), ang.sin().view(shape)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


def _rmsnorm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class ReferenceModel:
    def __init__(self, cfg: ModelConfig = ModelConfig()):
        self.cfg = cfg
        g = torch.Generator().manual_seed(cfg.seed)

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g) / math.sqrt(shape[-2] if len(shape) > 1 else 1)

        c = cfg
        self.embed = torch.randn(c.vocab_size, c.hidden, generator=g)
        self.lm_head = w(c.hidden, c.vocab_size)
        self.layers = []
        for _ in range(c.num_layers):
            self.layers.append(
                {
                    "dkv": w(c.hidden, c.kv_lora_rank + c.qk_rope_dim),
                    "q": w(c.hidden, c.num_heads * (c.qk_nope_dim + c.qk_rope_dim)),
                    "uk": w(c.num_heads, c.qk_nope_dim, c.kv_lora_rank),
                    "uv": w(c.num_heads, c.kv_lora_rank, c.v_head_dim),
                    "o": w(c.num_heads * c.v_head_dim, c.hidden),
                    "iq": w(c.hidden, c.index_heads * c.index_head_dim),
                    "ik": w(c.hidden, c.index_head_dim),
                    "iw": w(c.hidden, c.index_heads),
                    "up": w(c.hidden, c.mlp_hidden),
                    "down": w(c.mlp_hidden, c.hidden),
                }
            )

    def prefill_page(
        self,
        device_pool,
        tokens: torch.Tensor,
        start: int,
        pages: torch.Tensor,
        wait_layer: Callable[[int], None] = lambda i: None,
        want_logits: bool = False,
    ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """Compute tokens ``[start, start + len(tokens))`` (within one page), writing their KV into ``pages``.

        ``pages`` is the request's page table up to and including this page.
        Returns (last-token logits if asked, per-layer top-k selections).
        """
        pos = torch.arange(start, start + tokens.numel())
        x = self.embed[tokens]
        selections = []
        for i, L in enumerate(self.layers):
            x, sel = self.mla_dsa_layer(L, device_pool, i, x, pos, pages, wait_layer)
            selections.append(sel)
        logits = (_rmsnorm(x[-1:]) @ self.lm_head)[0] if want_logits else None
        return logits, selections

    def mla_dsa_layer(self, L: dict, device_pool, layer: int, x: torch.Tensor, pos: torch.Tensor, pages: torch.Tensor,
                      wait_layer: Callable[[int], None]) -> tuple[torch.Tensor, torch.Tensor]:
        """One MLA + DSA layer over tokens at ``pos`` (within one page), its KV in ``device_pool``'s layer
        ``layer`` through the page table ``pages``. Returns (the residual stream, the indexer's top-k)."""
        c = self.cfg
        ps = c.page_size
        n = pos.numel()
        total = int(pos[-1]) + 1
        slot_pages = pages[pos // ps]
        offsets = pos % ps
        slots = slot_pages * ps + offsets
        all_pos = torch.arange(total)
        all_slots = pages[all_pos // ps] * ps + all_pos % ps
        h = _rmsnorm(x)
        ckv = h @ L["dkv"]
        ckv = torch.cat((ckv[:, : c.kv_lora_rank], _rope(ckv[:, c.kv_lora_rank :], pos)), dim=-1)
        kI, scales = quantize(h @ L["ik"], c.quant_block_size)
        wait_layer(layer)  # restored pages of this layer must have landed before we read them
        latent_buf = device_pool.buffer("latent", layer)
        latent_buf[slots, 0] = ckv.to(latent_buf.dtype)
        index_buf = device_pool.buffer("indexer", layer)
        write_tokens(index_buf, slot_pages, offsets, kI, scales, ps)
        # read everything back from the pool, as a paged engine would
        latent = latent_buf[all_slots, 0].float()  # [T, rank + rope]
        kq, ks = read_pages(index_buf, pages[: (total + ps - 1) // ps], ps, c.index_head_dim, c.quant_block_size)
        keys_idx = dequantize(kq[:total], ks[:total], c.quant_block_size)  # [T, d]
        # DSA indexer: sum_h w_h * relu(q_h . k), causal, then top-k
        qI = (h @ L["iq"]).view(n, c.index_heads, c.index_head_dim)
        wI = h @ L["iw"]
        score = (torch.einsum("nhd,td->nht", qI, keys_idx).relu() * wI[..., None]).sum(1)
        causal = all_pos[None, :] <= pos[:, None]
        score = score.masked_fill(~causal, float("-inf"))
        k = min(c.index_topk, total)
        top = score.topk(k, dim=-1)
        sel_idx, sel_ok = top.indices, torch.isfinite(top.values)
        selection = sel_idx.masked_fill(~sel_ok, -1)
        # MLA (absorbed) attention over the selected tokens
        q = (h @ L["q"]).view(n, c.num_heads, c.qk_nope_dim + c.qk_rope_dim)
        q_nope, q_rope = q[..., : c.qk_nope_dim], _rope(q[..., c.qk_nope_dim :], pos)
        q_lat = torch.einsum("nhd,hdr->nhr", q_nope, L["uk"])
        sel = latent[sel_idx]  # [n, k, rank + rope]
        att = torch.einsum("nhr,nkr->nhk", q_lat, sel[..., : c.kv_lora_rank]) + torch.einsum(
            "nhe,nke->nhk", q_rope, sel[..., c.kv_lora_rank :]
        )
        att = (att / math.sqrt(c.qk_nope_dim + c.qk_rope_dim)).masked_fill(~sel_ok[:, None, :], float("-inf")).softmax(-1)
        o_lat = torch.einsum("nhk,nkr->nhr", att, sel[..., : c.kv_lora_rank])
        o = torch.einsum("nhr,hrv->nhv", o_lat, L["uv"]).reshape(n, -1)
        x = x + o @ L["o"]
        x = x + torch.relu(_rmsnorm(x) @ L["up"]) @ L["down"]
        return x, selection
