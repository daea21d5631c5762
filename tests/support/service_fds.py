"""``kvtier serve`` holding many file descriptors before it starts: ``python -m support.service_fds HOLD serve ARGS...``
opens HOLD descriptors (raising its open-files limit to fit them), then runs the command line as ``kvtier`` would,
so every fd the service takes after -- its clients' sockets and pidfds -- is numbered past HOLD (past 1,023 for
HOLD >= 1,024: where ``select()`` cannot watch a descriptor)."""

from __future__ import annotations

import os
import resource
import sys


def main() -> None:
    hold = int(sys.argv[1])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hold + 1024
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(hold)]
    from kvtier.app.cli import main as cli

    sys.argv = ["kvtier", *sys.argv[2:]]
    try:
        cli()
    finally:
        for fd in held:
            os.close(fd)


if __name__ == "__main__":
    main()
