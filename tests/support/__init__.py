"""Helpers the test files share (no test file imports another)."""
