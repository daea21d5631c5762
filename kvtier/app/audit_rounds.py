"""The timing audit's rounds: the three requests of a round after the victim's, and their order in each round
(:mod:`kvtier.app.audit` on ``kvtier run``'s engine, :mod:`kvtier.app.audit_vllm` on vLLM's)."""

from __future__ import annotations

import itertools

#: the three requests of a round
KINDS = ("probe", "miss", "control")
#: the rounds' orders of the three: every permutation in turn (a first-order carry-over design; a rotation alone put
#: the control's short hit before the probe in two rounds of three and never before the miss, and the probes timed
#: faster than the misses on that alone)
ORDERS = tuple(itertools.permutations(KINDS))


def round_order(i: int) -> tuple[str, ...]:
    """The order of round ``i``'s three requests."""
    return ORDERS[i % len(ORDERS)]
