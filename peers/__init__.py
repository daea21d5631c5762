"""Harnesses that run a peer's own code beside kvtier's, for the tests and the comparison benchmarks.

SGLang pins a CUDA torch, so its wheel is never installed: :mod:`peers.sglang_wheel`
imports the sources kvtier compares against (radix trees, host pools, the HiCache
controller's storage path) from the wheel, with light stand-ins for the packages they
import but never call on those paths. That means an import hook and stand-in modules
in the process, which a library has no business installing into its users' programs:
so this folder lives beside the ``kvtier`` package, in the repository, and is not part
of the installed package (``tests/test_wheel.py`` checks the built wheel). The tests
import it from the clone; ``kvtier bench cache`` and ``kvtier bench sglang`` find it
there (:func:`kvtier.app.bench.peers.peer_module`).
"""
