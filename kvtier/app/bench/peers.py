"""The comparison harnesses of a kvtier clone (its ``peers/`` folder): what the SGLang comparisons import."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

from kvtier.errors import ConfigError


def peer_module(name: str) -> ModuleType:
    """``peers.<name>`` from the repository this kvtier runs from (an editable install of a clone). The
    folder is not part of the installed package: run the comparison from a clone of kvtier."""
    try:
        return importlib.import_module(f"peers.{name}")
    except ModuleNotFoundError as e:
        if e.name not in ("peers", f"peers.{name}"):
            raise
    root = Path(__file__).resolve().parents[3]
    if not (root / "peers" / "__init__.py").is_file():
        raise ConfigError("the SGLang comparison runs SGLang's own code through the harnesses in a kvtier clone's peers/ folder, "
                          "which the installed package does not ship: run it from a clone (pip install -e .)") from None
    sys.path.insert(0, str(root))
    return importlib.import_module(f"peers.{name}")
