"""Local servers on 127.0.0.1 for tests and benchmarks (redis-server, a Redis Cluster, mooncake_master + a storage node).

Each launcher starts real processes bound to loopback, waits with bounded loops, and stops them.
Nothing here is used by the cache itself."""

from __future__ import annotations

import os
import shutil
import sys
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path


def venv_script(name: str) -> str | None:
    """A console script on PATH, or installed beside this interpreter (a venv that is not activated)."""
    return shutil.which(name) or shutil.which(name, path=os.path.dirname(sys.executable))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_cluster_port() -> int:
    """A free port whose cluster-bus port (port + 10000) is free and valid too."""
    import random

    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 30000)
        if _bindable(port) and _bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair for a redis cluster node in 20000-40000")


def wait_until(pred, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def stop_process(proc: subprocess.Popen | None) -> None:
    """Kill a server this module started (by its pid) and reap it; returns None for the caller's handle."""
    if proc is not None:
        proc.kill()
        proc.wait(timeout=10)
    return None


@dataclass
class RedisServer:
    """One redis-server process on 127.0.0.1 (no persistence)."""

    workdir: Path
    port: int = field(default_factory=free_port)
    extra: tuple[str, ...] = ()
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0?timeout=1"

    def start(self) -> RedisServer:
        exe = shutil.which("redis-server") or shutil.which("valkey-server")
        assert exe, "redis-server not installed: run ./run.sh test (it apt-get installs redis-server)"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(self.workdir),
             "--protected-mode", "no", *self.extra],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_until(lambda: port_open(self.port), what=f"redis on port {self.port}")
        return self

    def kill(self) -> None:
        self.proc = stop_process(self.proc)

    def stop(self) -> None:
        self.kill()


def start_redis_cluster(workdir: Path, nodes: int = 3, require_full_coverage: bool = True) -> list[RedisServer]:
    """``nodes`` primaries, no replicas. ``require_full_coverage=False``: while one node is down the
    others keep serving their own slots (Redis's default answers CLUSTERDOWN for every key)."""
    coverage = () if require_full_coverage else ("--cluster-require-full-coverage", "no")
    servers = [
        RedisServer(
            workdir / f"n{i}",
            port=free_cluster_port(),
            extra=("--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{i}.conf", "--cluster-node-timeout", "2000", *coverage),
        ).start()
        for i in range(nodes)
    ]
    cli = shutil.which("redis-cli") or shutil.which("valkey-cli")
    assert cli, "redis-cli not installed (Debian redis-tools)"
    subprocess.run(
        [cli, "--cluster", "create", *(f"127.0.0.1:{s.port}" for s in servers), "--cluster-replicas", "0", "--cluster-yes"],
        check=True,
        capture_output=True,
        timeout=60,
    )

    def ok() -> bool:  # every node, not just the first: until gossip converges, the others still say "down"
        return all(
            "cluster_state:ok"
            in subprocess.run([cli, "-p", str(s.port), "cluster", "info"], capture_output=True, text=True, timeout=10).stdout
            for s in servers
        )

    wait_until(ok, timeout=30, what="redis cluster_state:ok on every node")
    return servers


@dataclass
class MooncakeMaster:
    """``mooncake_master`` on 127.0.0.1 with its HTTP metadata server (the wheel ships the binary)."""

    rpc_port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    node_port: int = field(default_factory=free_port)
    node_segment: str = "512MB"
    proc: subprocess.Popen | None = None
    node: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        # kvtier's clients contribute no memory: the storage node below holds the pages,
        # so they outlive any one engine instance (as in a real deployment)
        return (
            f"mooncake://127.0.0.1:{self.rpc_port}?metadata=http://127.0.0.1:{self.http_port}/metadata"
            f"&local=127.0.0.1&protocol=tcp&segment_mb=0&buffer_mb=64"
        )

    def start_node(self) -> None:
        """A ``mooncake_client`` process that mounts ``node_segment`` of memory into the store."""
        exe = venv_script("mooncake_client")
        assert exe, "mooncake_client not found: pip install 'kvtier[mooncake]'"
        self.node = subprocess.Popen(
            [
                exe,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.node_port),
                "--global_segment_size",
                self.node_segment,
                "--protocol",
                "tcp",
                "--master_server_address",
                f"127.0.0.1:{self.rpc_port}",
                "--metadata_server",
                f"http://127.0.0.1:{self.http_port}/metadata",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_until(lambda: port_open(self.node_port), what="mooncake storage node")

    def start(self) -> MooncakeMaster:
        exe = venv_script("mooncake_master")
        assert exe, "mooncake_master not found: pip install 'kvtier[mooncake]'"
        self.proc = subprocess.Popen(
            [
                exe,
                "--rpc_port",
                str(self.rpc_port),
                "--rpc_address",
                "127.0.0.1",
                "--enable_http_metadata_server=true",
                "--http_metadata_server_port",
                str(self.http_port),
                "--metrics_port",
                str(self.metrics_port),
                "--default_kv_lease_ttl",
                "200",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_until(lambda: port_open(self.rpc_port) and port_open(self.http_port), what="mooncake_master")
        if self.node is None:
            self.start_node()
        return self

    def kill(self) -> None:
        """Kill the master only (the fault the tests inject); the storage node stays."""
        self.proc = stop_process(self.proc)

    def stop(self) -> None:
        self.kill()
        self.node = stop_process(self.node)


@dataclass
class NodeServiceProcess:
    """``kvtier serve`` on a socket under ``workdir`` (this interpreter's kvtier), stopped by its pid with
    SIGTERM (it removes its socket and region), SIGKILL if it does not exit within 30 s."""

    workdir: Path
    host_gb: float
    proc: subprocess.Popen | None = None

    @property
    def socket(self) -> str:
        return str(self.workdir / "run" / "node.sock")

    def start(self, timeout_s: float = 120.0) -> NodeServiceProcess:
        import selectors

        self.workdir.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "kvtier.app.cli", "serve", "--host-gb", str(self.host_gb), "--socket", self.socket]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=(self.workdir / "serve.log").open("w"), text=True)
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            banner = self.proc.stdout.readline() if sel.select(timeout_s) else ""
        if "listening on unix://" not in banner:
            error = (self.workdir / "serve.log").read_text() if self.proc.poll() is not None else ""
            self.stop()
            raise RuntimeError(f"kvtier serve did not start within {timeout_s:g} s: {(banner + error).strip()!r}")
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None
