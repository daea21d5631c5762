"""The same trace replay through SGLang's own prefix cache (``RadixCache``), for ``kvtier bench cache``.

SGLang pins a CUDA build of torch, so it is never installed: its wheel
(``pip download --no-deps sglang==0.5.23``) is opened, the sources the radix
cache needs (``sglang/srt``'s top-level modules, ``mem_cache``, ``utils`` and
the few packages they import at module level) are unpacked into the kvtier
cache directory once, and ``sglang.srt.mem_cache.radix_cache`` is imported from
there. Modules it imports but this replay never calls -- GPU kernels, model
configs, the scheduler, observability, disaggregation, server args -- and two
third-party imports (``orjson``, ``torchvision``) are replaced by light
stand-ins (:class:`_StandIn`): attribute access gives an inert placeholder.
The tree code that runs -- ``RadixKey``, ``match_prefix``, ``insert``,
``inc_lock_ref``/``dec_lock_ref``, node splitting, LRU bookkeeping -- is
SGLang's own.

One request at a time, as in kvtier's replay: ``match_prefix`` ->
``inc_lock_ref`` -> ``insert`` (the page-aligned prompt, with slot values for
the new pages) -> ``dec_lock_ref``. SGLang compares token arrays and hashes
nothing, so ``hash_seconds`` is 0 and every second is tree work. Building each
request's ``array('q')`` of token ids is the workload's cost and is not timed
(kvtier's replay does not time building its token array either).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import time
import types
import zipfile
from pathlib import Path

from kvtier.app.bench.peer_result import PeerReplayResult
from kvtier.errors import ConfigError
from kvtier.app.workloads import trace_tokens

SGLANG_VERSION = "0.5.23"

#: sglang packages imported at module level by the radix cache's imports but never used by this replay
_STAND_IN_PACKAGES = (
    "sglang.srt.configs", "sglang.srt.layers", "sglang.kernels", "sglang.jit_kernel", "sglang.srt.disaggregation",
    "sglang.srt.managers", "sglang.srt.model_executor", "sglang.srt.distributed", "sglang.srt.observability",
    "sglang.srt.server_args", "orjson", "torchvision",
)
#: what is unpacked from the wheel: sglang/srt's top-level modules and these packages
_UNPACKED = ("sglang/srt/mem_cache/", "sglang/srt/utils/", "sglang/srt/arg_groups/", "sglang/srt/platforms/", "sglang/srt/plugins/")


class _StandIn(types.ModuleType):
    """A module whose every attribute is an inert placeholder class (never called by the replay)."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        placeholder = type(name, (), {"__init__": lambda self, *a, **k: None, "__call__": lambda self, *a, **k: None,
                                      "__getattr__": lambda self, n: None})
        setattr(self, name, placeholder)
        return placeholder


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, packages: tuple[str, ...]):
        self.packages = packages

    def find_spec(self, name, path, target=None):
        if any(name == p or name.startswith(p + ".") for p in self.packages):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandIn(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass


def find_sglang_wheel(explicit: str | None = None) -> Path | None:
    """``explicit``, else ``$KVTIER_SGLANG_WHEEL``, else ``.kvtier/wheels/sglang-<version>-*.whl`` under the
    current directory (where ``./run.sh test`` downloads it); None when there is none."""
    if explicit or os.environ.get("KVTIER_SGLANG_WHEEL"):
        path = Path(explicit or os.environ["KVTIER_SGLANG_WHEEL"])
        if not path.is_file():
            raise ConfigError(f"SGLang wheel {str(path)!r} not found; get it with `pip download --no-deps sglang=={SGLANG_VERSION}`")
        return path
    found = sorted(Path(".kvtier", "wheels").glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    return found[-1] if found else None


def _unpack(wheel: Path) -> Path:
    from kvtier.integrations.vllm.model import default_cache_dir

    out = default_cache_dir() / f"sglang-{SGLANG_VERSION}-src"
    if (out / "sglang" / "srt" / "mem_cache" / "radix_cache.py").exists():
        return out
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            top_level_srt = name.startswith("sglang/srt/") and name.count("/") == 2 and name.endswith(".py")
            if top_level_srt or (name.endswith(".py") and name.startswith(_UNPACKED)):
                z.extract(name, tmp)
    try:
        os.rename(tmp, out)
    except OSError:  # another process unpacked it first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_radix_cache(wheel: Path):
    """SGLang's ``RadixCache`` module and its params classes, imported from the wheel's sources."""
    src = _unpack(wheel)
    if "sglang" not in sys.modules or getattr(sys.modules["sglang"], "__path__", [None])[0] != str(src / "sglang"):
        pkg = types.ModuleType("sglang")  # the real sglang/__init__ imports the whole runtime
        pkg.__path__ = [str(src / "sglang")]
        sys.modules["sglang"] = pkg
        sys.meta_path.insert(0, _StandInFinder(_STAND_IN_PACKAGES))
    from sglang.srt.mem_cache import base_prefix_cache, radix_cache

    return radix_cache, base_prefix_cache


def replay_sglang(requests, page_size: int, wheel: Path) -> PeerReplayResult:
    from array import array

    import torch

    radix_cache, base = load_radix_cache(wheel)
    tree = radix_cache.RadixCache.create_simulated(page_size=page_size)
    t_tree = 0.0
    hit_tokens = next_slot = 0
    for r in requests:
        toks = array("q", trace_tokens(r).tobytes())  # not timed: the workload's token array
        full = len(toks) // page_size * page_size
        t0 = time.perf_counter()
        key = radix_cache.RadixKey(toks)
        m = tree.match_prefix(base.MatchPrefixParams(key=key))
        tree.inc_lock_ref(m.last_device_node)
        have = m.device_prefix_len
        value = torch.arange(next_slot - have, next_slot - have + full, dtype=torch.int64)  # new pages' slots after the hit
        tree.insert(base.InsertParams(key=radix_cache.RadixKey(toks[:full]), value=value))
        tree.dec_lock_ref(m.last_device_node)
        t_tree += time.perf_counter() - t0
        next_slot += full - have
        hit_tokens += have
    pages = sum(r.input_length // page_size for r in requests)
    return PeerReplayResult(
        version=SGLANG_VERSION, hit_ratio=round(hit_tokens / sum(r.input_length for r in requests), 4),
        hash_seconds=0.0, tree_seconds=round(t_tree, 3), pages_per_s=round(pages / t_tree), tree_pages_per_s=round(pages / t_tree),
        stand_ins=_STAND_IN_PACKAGES,
    )
