"""A Triton kernel that copies an address list, reading or writing pinned host memory in place.

Each row of a :class:`~kvtier.transfer.address_list.CopyList` is a source and a
destination address and a size; the kernel casts the addresses to pointers, so
one launch moves rows between any pools and layouts -- pinned host rows are
reached through their device-visible (UVA) address, with no staging copy.
The grid is capped (``programs``: the io backends pass
:attr:`~kvtier.transfer.gpu_methods.CopyMethodThresholds.kernel_programs`): each
program walks rows ``pid, pid + programs, ...``, so a copy occupies that many
SMs and the forward keeps the rest. Rows move in the widest word that divides
every address and size (:attr:`CopyList.alignment`, at most 8 bytes).

The kernel is made on first use (``triton.jit`` reads ``TRITON_INTERPRET`` then):
under the interpreter it runs on CPU tensors, which is how the suite checks it
bit-exact. The interpreter keeps a launch's grid, its program ids and its patched
``triton.language`` in module globals, so under it launches run one at a time,
process-wide (a hybrid model's transfer engines, one thread per KV group, launch
at once); a GPU launch takes no lock. :func:`compile_ahead` compiles it for a
CUDA target without a GPU (Triton's own ptxas), so a kernel only the interpreter
accepts fails in CI.
Triton is an optional extra (``pip install 'kvtier[gpu]'``, pinned to the lent
GPU image's 3.6.0).
"""

import os
import threading
from contextlib import nullcontext
from functools import lru_cache

import numpy as np
import torch

from kvtier.errors import ConfigError
from kvtier.transfer.address_list import CopyList

#: words per program per step (a uint64 word: 8 KiB)
BLOCK = 1024

#: held around every launch under the interpreter (its launch state is global): one launch at a time in this process
_INTERPRETER_LAUNCH = threading.Lock()

try:
    import triton
    import triton.language as tl
except ImportError:  # the optional extra is not installed
    triton = tl = None


def unavailable() -> str | None:
    """Why the kernel cannot run here (None: it can)."""
    if triton is None:
        return "the Triton copy kernel needs Triton: pip install 'kvtier[gpu]'"
    return None


if tl is not None:  # (annotations evaluated: Triton reads tl.constexpr from them)

    def _copy_rows(src_addr, dst_addr, size, n, WORD: tl.constexpr, DTYPE: tl.constexpr, BLOCK: tl.constexpr):  # noqa: N803
        """Row ``r`` (of ``n``): ``size[r]`` bytes from ``src_addr[r]`` to ``dst_addr[r]``, in ``WORD``-byte
        words of ``DTYPE``; program ``p`` of ``P`` copies rows ``p, p + P, ...``."""
        pid = tl.program_id(0)
        step = tl.num_programs(0)
        for r in range(pid, n, step):
            src = tl.load(src_addr + r).to(tl.pointer_type(DTYPE))
            dst = tl.load(dst_addr + r).to(tl.pointer_type(DTYPE))
            words = tl.load(size + r) // WORD
            for start in range(0, words, BLOCK):
                idx = start + tl.arange(0, BLOCK)
                inside = idx < words
                tl.store(dst + idx, tl.load(src + idx, mask=inside), mask=inside)


def _word_type(word: int):
    return {1: tl.uint8, 2: tl.uint16, 4: tl.uint32, 8: tl.uint64}[word]


@lru_cache(maxsize=2)
def _kernel(interpret: bool):  # (keyed by the mode: triton.jit reads TRITON_INTERPRET when it wraps)
    return triton.jit(_copy_rows)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def copy_list(rows: CopyList, device: torch.device, programs: int) -> None:
    """Launch the kernel over ``rows`` on ``device``'s current stream (the caller's copy stream); on
    the CPU only under ``TRITON_INTERPRET=1``."""
    reason = unavailable()
    if reason is not None:
        raise ConfigError(reason)
    if type(programs) is not int or programs < 1:
        raise ConfigError(f"the copy kernel's programs must be a whole number >= 1, got {programs!r}")
    if not len(rows):
        return
    interpret = interpreting()
    if device.type != "cuda" and not interpret:
        raise ConfigError("the Triton copy kernel runs on a GPU (or on CPU tensors under TRITON_INTERPRET=1); use io_backend 'direct'")
    word = min(rows.alignment, 8)
    table = torch.from_numpy(np.stack([rows.src, rows.dst, rows.size]))
    if device.type == "cuda":  # pinned (torch's caching host allocator keeps it until the copy is done), then async
        table = table.pin_memory().to(device, non_blocking=True)
    grid = (min(programs, len(rows)),)
    with _INTERPRETER_LAUNCH if interpret else nullcontext():
        _kernel(interpret)[grid](table[0], table[1], table[2], len(rows), WORD=word, DTYPE=_word_type(word), BLOCK=BLOCK)


def compile_ahead(capability: int = 90, words: tuple[int, ...] = (1, 2, 4, 8)) -> dict[int, object]:
    """The kernel compiled for ``sm_<capability>`` for each word size, no GPU needed."""
    reason = unavailable()
    if reason is not None:
        raise ConfigError(reason)
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    fn = JITFunction(_copy_rows)  # compiled, whatever TRITON_INTERPRET says
    signature = {"src_addr": "*i64", "dst_addr": "*i64", "size": "*i64", "n": "i32", "WORD": "constexpr", "DTYPE": "constexpr",
                 "BLOCK": "constexpr"}
    out = {}
    for word in words:
        src = ASTSource(fn=fn, signature=signature, constexprs={"WORD": word, "DTYPE": _word_type(word), "BLOCK": BLOCK})
        out[word] = triton.compile(src, target=GPUTarget("cuda", capability, 32))
    return out
