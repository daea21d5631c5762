"""Workloads: the Mooncake trace format and a seeded synthetic multi-turn chat generator."""

from kvtier.app.workloads.mooncake import MOONCAKE_BLOCK_TOKENS, TraceRequest, load_mooncake_trace, trace_tokens

__all__ = ["MOONCAKE_BLOCK_TOKENS", "TraceRequest", "load_mooncake_trace", "trace_tokens"]
