"""pytest's hooks for the suite (none: shared helpers live in tests/support/)."""

# test_plan_checks.py still imports fill_random from here; this line goes once it imports support.pools
from support.pools import fill_random  # noqa: F401
