"""What a peer's prefix cache (vLLM's, SGLang's) measured on the same trace replay as kvtier's."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PeerReplayResult:
    version: str
    hit_ratio: float
    hash_seconds: float
    tree_seconds: float
    pages_per_s: float
    tree_pages_per_s: float
    #: modules replaced by inert stand-ins to import the peer's code without its dependencies
    stand_ins: tuple[str, ...] = ()
    #: which of the peer's trees ran (SGLang: unified-rust, unified-python, radix) and the class that did the tree work
    tree: str = ""
    tree_core: str = ""
