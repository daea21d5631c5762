"""The hybrid models the tests build: tiny ones for the policy core (:func:`hybrid_model`, pages of
``PAGE`` tokens), and for the bytes (pages of ``P`` tokens) ``MODEL`` -- full, sliding-window and state
groups, each in its own pools -- and ``GPT_LIKE``, whose window page is a full page's size, so its
window group can share the full pages' pools."""

from __future__ import annotations

from kvtier.groups import KVGroup, ModelSpec, StateTensor
from kvtier.spec import KVSpec
from support.pools import tiny_specs

PAGE = 4


def hybrid_model(window: int | None, state: bool) -> tuple[ModelSpec, object]:
    full = tiny_specs(page_size=PAGE, num_layers=1)["mla"]
    groups = [KVGroup("full", "full", (0,), attention=full)]
    if window is not None:
        groups.append(KVGroup("swa", "sliding_window", (len(groups),), attention=full, window=window))
    if state:
        groups.append(KVGroup("ssm", "state", (len(groups),), state=(StateTensor("h", (8,), "float32"),)))
    return ModelSpec("hybrid-test", len(groups), tuple(groups)), full


P = 4
FULL = KVSpec.mla("hy-full", 2, kv_lora_rank=16, qk_rope_dim=8, page_size=P)
SWA = KVSpec.mha("hy-swa", 2, kv_heads=2, head_dim=8, page_size=P)
MODEL = ModelSpec("hy", 5, (
    KVGroup("full", "full", (0, 3), attention=FULL),
    KVGroup("swa", "sliding_window", (1, 4), attention=SWA, window=6),
    KVGroup("ssm", "state", (2,), state=(StateTensor("conv", (6, 3), "float32"), StateTensor("h", (2, 4, 4), "bfloat16"))),
))

SPEC = KVSpec.mha("gpt-like", 2, kv_heads=2, head_dim=8, page_size=P)
GPT_LIKE = ModelSpec("gpt-like", 5, (
    KVGroup("full", "full", (1, 3), attention=SPEC),
    KVGroup("swa", "sliding_window", (0, 2), attention=SPEC, window=6),
    KVGroup("ssm", "state", (4,), state=(StateTensor("h", (2, 4), "float32"),)),
))
