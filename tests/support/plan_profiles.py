"""A profile with made-up but well-formed costs, for tests that check what a validation counts, not its times."""

from __future__ import annotations

from kvtier.app.plan.engines import ENGINES, engine_model
from kvtier.app.plan.profile import LINKS, LinkFit, PrefillFit, Profile

#: the prefill fit behind :func:`profile_of` (4 ms + 0.2 ms/token + attention + 1 ms/page)
PREFILL = PrefillFit(overhead_s=0.004, per_token_s=2e-4, per_context_s=3e-8, per_page_s=1e-3, page_tokens=32)


def profile_of(engine: str = "run", **changes) -> Profile:
    """A profile of ``engine``'s model (its real fingerprint), every field set; ``changes`` replace fields."""
    eng = ENGINES[engine]
    model = engine_model(eng.model)
    links = {name: LinkFit(100e-6 * (i + 1), 1e9 * (i + 1)) for i, name in enumerate(LINKS)}
    fields = dict(engine=engine, model=eng.model, model_fingerprint=model.fingerprint(), page_tokens=32,
                  page_bytes=model.group("full").attention.page_bytes, prefill=PREFILL, links=links, measured_at="2026-12-05T00:00:00")
    return Profile(**{**fields, **changes})
