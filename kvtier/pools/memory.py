"""How much host memory there is: the budget both pools are checked against before they allocate."""

from __future__ import annotations

import os

#: memory left to everything else when a pool is sized against what is available
DEFAULT_RESERVE_BYTES = 1 << 30


def host_memory_available() -> int:
    """Bytes the kernel says can be allocated without swapping (MemAvailable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
