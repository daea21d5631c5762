"""SGLang's own code on a CPU machine, imported from its wheel without installing it.

SGLang pins a CUDA build of torch, so it is never installed: its wheel
(``pip download --no-deps sglang==0.5.23``, which ``./run.sh test`` puts in
``.kvtier/wheels``) is opened, the sources kvtier's tests and benchmarks use
(``sglang/srt``'s top-level modules, ``mem_cache`` -- the radix cache, the
HiCache storage interface and backend factory, the host pools -- ``utils``,
``managers``, the session and Rust-extension helpers the unified radix cache
imports, the Rust tree core's compiled extension, and the few packages they
import at module level) are unpacked into the kvtier cache directory once, and
imported from there. Packages they import at module level but never call on
these paths -- GPU kernels, model configs, the scheduler, observability,
disaggregation, server args, speculative decoding, other hardware backends,
and the ``orjson`` client -- are replaced by light stand-ins (:class:`_StandIn`):
attribute access gives an inert placeholder. (``torchvision`` is not stood in:
SGLang imports it only inside functions these paths never call, and a fake one
would make transformers, imported by vLLM in the same test process, think it
is installed.)
Everything that runs -- the radix trees (``RadixCache``, ``UnifiedRadixCache``
with its Rust and Python tree cores), ``HiCacheStorage``,
``StorageBackendFactory``, ``HiCacheFile``, the MHA/MLA/DSA host pools -- is
SGLang's own.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import types
import zipfile
from pathlib import Path

from kvtier.errors import ConfigError

SGLANG_VERSION = "0.5.23"

#: sglang packages imported at module level by the radix cache's imports but never used by this replay
_STAND_IN_PACKAGES = (
    "sglang.srt.configs", "sglang.srt.layers", "sglang.kernels", "sglang.jit_kernel", "sglang.srt.disaggregation",
    "sglang.srt.managers", "sglang.srt.model_executor", "sglang.srt.distributed", "sglang.srt.observability",
    "sglang.srt.server_args", "sglang.srt.speculative", "sglang.srt.hardware_backend", "orjson",
)
#: what is unpacked from the wheel: sglang/srt's top-level modules and these packages and files
_UNPACKED = ("sglang/srt/mem_cache/", "sglang/srt/utils/", "sglang/srt/arg_groups/", "sglang/srt/platforms/", "sglang/srt/plugins/",
             "sglang/srt/managers/cache_controller.py", "sglang/srt/observability/", "sglang/srt/session/",
             "sglang/srt/rust_extensions/", "sglang/srt/layers/dcp/layout.py", "sglang/srt/configs/mamba_utils.py",
             "sglang/srt/hardware_backend/mlx/runtime.py")
#: native code unpacked too: the unified radix cache's Rust tree core (built), and the C++ source of the
#: HiCache storage-key hash that SGLang compiles on first use (torch's cpp_extension: g++, ninja, OpenSSL)
_NATIVE = ("sglang/srt/mem_cache/rust_tree_core/mem_cache.cpython-311-x86_64-linux-gnu.so",
           "sglang/srt/mem_cache/cpp_utils/hash_binding.cpp")
#: real modules inside a stand-in package: the HiCache controller, whose storage calls the tests replay, the
#: storage-metrics collector SGLang feeds a storage backend's get_stats() to, and the DCP index helper the MLA
#: pools' transfers call (without DCP it returns the indices as they are)
_REAL_MODULES = ("sglang.srt.managers.cache_controller", "sglang.srt.observability.metrics_collector", "sglang.srt.observability.utils",
                 "sglang.srt.observability.scheduler_stage_metrics", "sglang.srt.layers.dcp.layout",
                 "sglang.srt.configs.mamba_utils", "sglang.srt.hardware_backend.mlx.runtime")
#: bumped when _UNPACKED grows, so an older unpacked tree is not reused
_UNPACK_VERSION = 5


class _StandIn(types.ModuleType):
    """A module whose every attribute is an inert placeholder class (never called by the replay)."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if f"{self.__name__}.{name}" in _REAL_MODULES:
            return importlib.import_module(f"{self.__name__}.{name}")
        placeholder = _placeholder(name)
        setattr(self, name, placeholder)
        return placeholder


class _Inert(type):
    """The type of a placeholder: its class attributes are placeholders too (``KVLayout.V4`` in a class body)."""

    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        inner = _placeholder(name)
        setattr(cls, name, inner)
        return inner


def _placeholder(name: str) -> type:
    """An inert class: calling it, or an instance, does nothing; its instances' attributes are None."""
    return _Inert(name, (), {"__init__": lambda self, *a, **k: None, "__call__": lambda self, *a, **k: None,
                             "__getattr__": lambda self, n: None})


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, packages: tuple[str, ...], src: Path):
        self.packages = packages
        self.src = src

    def find_spec(self, name, path, target=None):
        if name in _REAL_MODULES:
            return None  # the ordinary finder loads it from the stand-in package's real directory
        if any(name == p or name.startswith(p + ".") for p in self.packages):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandIn(spec.name)
        real_dir = self.src.joinpath(*spec.name.split("."))
        hosts_real = any(m.startswith(spec.name + ".") for m in _REAL_MODULES)
        module.__path__ = [str(real_dir)] if hosts_real else []
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

    out = default_cache_dir() / f"sglang-{SGLANG_VERSION}-src-{_UNPACK_VERSION}"
    if (out / "sglang" / "srt" / "mem_cache" / "radix_cache.py").exists():
        return out
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            top_level_srt = name.startswith("sglang/srt/") and name.count("/") == 2 and name.endswith(".py")
            if top_level_srt or name in _NATIVE or (name.endswith(".py") and name.startswith(_UNPACKED)):  # startswith takes a tuple
                z.extract(name, tmp)
    try:
        os.rename(tmp, out)
    except OSError:  # another process unpacked it first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


#: what SGLang's cache factory reads from a server's published config (LMCache, FlexKV, an external linker,
#: PD retraction to host), at SGLang's defaults: all off
FACTORY_DEFAULTS = {
    "memory": {"enable_lmcache": False, "enable_unified_cache_external_linker": False, "enable_flexkv": False,
               "radix_cache_backend": None},
    "disagg": {"disaggregation_decode_retraction_backup": None},
}


def publish_config(namespaces: dict[str, dict]) -> None:
    """Publish config namespaces into SGLang's runtime context, as a server does before it builds its cache
    (SGLang's own config bags; a nested dict is a sub-namespace, e.g. ``exec.mamba``). Call after
    :func:`import_sglang`."""
    from sglang.srt import runtime_context

    def bag(path: str, values: dict):
        out = runtime_context._ConfigBag(path)
        for name, value in values.items():
            if isinstance(value, dict):
                out._set_sub(name, bag(f"{path}.{name}", value))
            else:
                out._set(name, value)
        return out

    ctx = runtime_context._CONTEXT
    ctx._config_bags = {**(ctx._config_bags or {}), **{ns: bag(ns, values) for ns, values in namespaces.items()}}


def import_sglang(wheel: Path | None = None) -> Path:
    """Make ``sglang.srt.mem_cache`` importable from the wheel's sources (unpacked once); returns
    the unpacked tree. ``wheel`` None: :func:`find_sglang_wheel`'s, or a :class:`ConfigError` saying
    how to get it."""
    wheel = wheel or find_sglang_wheel()
    if wheel is None:
        raise ConfigError(f"SGLang's wheel is needed: pip download --no-deps sglang=={SGLANG_VERSION} -d .kvtier/wheels "
                          "(or set KVTIER_SGLANG_WHEEL)")
    src = _unpack(wheel)
    if "sglang" not in sys.modules or getattr(sys.modules["sglang"], "__path__", [None])[0] != str(src / "sglang"):
        pkg = types.ModuleType("sglang")  # the real sglang/__init__ imports the whole runtime
        pkg.__path__ = [str(src / "sglang")]
        sys.modules["sglang"] = pkg
        sys.meta_path.insert(0, _StandInFinder(_STAND_IN_PACKAGES, src))
    return src
