"""The CLI as a user runs it, for the tests: ``python -m kvtier.app.cli`` in a subprocess, and a small workload."""

import subprocess
import sys

# Device 16 < host 20 pages: with write_through the host holds a copy of every device page, so only
# a host larger than the device leaves room to demote to L3 and prefetch back.
SMALL = ["--workload-sessions", "4", "--workload-turns", "3", "--workload-system-tokens", "128", "--workload-user-tokens", "40",
         "--workload-reply-tokens", "24", "--tiers-device-pages", "16", "--tiers-host-pages", "20"]


def kvtier(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "kvtier.app.cli", *args], capture_output=True, text=True, timeout=timeout)
