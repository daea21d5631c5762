"""What the tenant tests share: a small MLA+DSA reference model, its spec and page size, seeded prompts, and the check
that a request's logits equal a recompute's."""

from __future__ import annotations

import torch

from kvtier.app.engine import ReferenceEngine
from kvtier.app.model import ModelConfig, ReferenceModel

CFG = ModelConfig(hidden=64, num_layers=2, num_heads=2, qk_nope_dim=16, qk_rope_dim=8, v_head_dim=16, kv_lora_rank=32,
                  index_heads=2, index_head_dim=32, quant_block_size=16, index_topk=24, mlp_hidden=128, page_size=8)
MODEL = ReferenceModel(CFG)
SPEC = CFG.kv_spec()
PS = CFG.page_size


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist()


def same_as_recompute(base: ReferenceEngine, tokens: list[int], got) -> None:
    want = base.prefill(tokens)
    assert torch.equal(want.logits, got.logits)
