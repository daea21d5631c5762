"""Adapters that plug kvtier into serving engines (optional dependencies)."""
