"""A small deterministic MLA + DSA transformer that keeps its KV only in kvtier's pools."""

from kvtier.app.model.reference import ModelConfig, ReferenceModel

__all__ = ["ModelConfig", "ReferenceModel"]
