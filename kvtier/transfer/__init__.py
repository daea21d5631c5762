"""Moving page bytes between tiers: io backends (how rows are copied) and the async engine (when)."""
