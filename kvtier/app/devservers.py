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
    #: more of ``kvtier serve``'s options (``--keep-region``, ``--verify-sample 1``, ...)
    args: tuple[str, ...] = ()
    proc: subprocess.Popen | None = None

    @property
    def socket(self) -> str:
        return str(self.workdir / "run" / "node.sock")

    def start(self, timeout_s: float = 120.0) -> NodeServiceProcess:
        import selectors

        self.workdir.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "kvtier.app.cli", "serve", "--host-gb", str(self.host_gb), "--socket", self.socket, *self.args]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=(self.workdir / "serve.log").open("a"), text=True)
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            banner = self.proc.stdout.readline() if sel.select(timeout_s) else ""
        if "listening on unix://" not in banner:
            error = (self.workdir / "serve.log").read_text() if self.proc.poll() is not None else ""
            self.stop()
            raise RuntimeError(f"kvtier serve did not start within {timeout_s:g} s: {(banner + error).strip()!r}")
        return self

    def kill(self, sig: int, grace_s: float = 30.0) -> None:
        """Send ``sig`` and wait for the service to exit (SIGKILL after ``grace_s``)."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(sig)
                try:
                    self.proc.wait(grace_s)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(10)
            self.proc.stdout.close()
        self.proc = None

    def stop(self) -> None:
        import signal

        self.kill(signal.SIGTERM)


@dataclass
class VllmServer:
    """``vllm serve`` (vLLM's OpenAI-compatible server, its default multi-process engine) on 127.0.0.1, in a
    process group of its own (its engine core and workers with it).

    ``kv_transfer`` is the ``--kv-transfer-config`` object (None: no connector); ``env``: more of its environment.
    :meth:`stop` asks the server to shut down (SIGTERM: the engine and its workers close, the connector drains its
    L3 writes), and kills the group if it has not exited within ``grace_s``; :meth:`kill` sends the whole group
    a signal (a crash, or an operator's stop) and waits for the server to exit."""

    model: str
    workdir: Path
    kv_transfer: dict | None = None
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    _log: object = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 300.0) -> VllmServer:
        import json
        import signal
        import urllib.request

        self.workdir.mkdir(parents=True, exist_ok=True)
        # vLLM's own ``vllm serve`` (kvtier.app.vllm_cli: the CPU wheel's command needs its version answered)
        cmd = [sys.executable, "-m", "kvtier.app.vllm_cli", "serve", self.model, "--host", "127.0.0.1", "--port", str(self.port),
               *self.args]
        if self.kv_transfer is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_transfer)]
        self._log = open(self.workdir / f"vllm-{self.port}.log", "ab")
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), "HF_HUB_OFFLINE": "1",
               **self.env}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

        def healthy() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited {self.proc.returncode} at startup; log: {self.workdir}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        try:
            wait_until(healthy, timeout=timeout_s, what=f"vllm serve on port {self.port}")
        except BaseException:
            self.kill(signal.SIGKILL)
            raise
        return self

    def post(self, path: str, body: dict | None = None, timeout_s: float = 300.0) -> dict:
        import json
        import urllib.request

        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(f"{self.url}{path}", data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            text = r.read()
        return json.loads(text) if text.strip() else {}

    def get_text(self, path: str, timeout_s: float = 30.0) -> str:
        import urllib.request

        with urllib.request.urlopen(f"{self.url}{path}", timeout=timeout_s) as r:
            return r.read().decode()

    def kill(self, sig: int, grace_s: float = 60.0) -> None:
        """Send ``sig`` to the server's process group and wait for it to exit (SIGKILL after ``grace_s``)."""
        import signal

        if self.proc is not None:
            if self.proc.poll() is None:
                try:
                    os.killpg(self.proc.pid, sig)
                    self.proc.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(timeout=10)
            try:  # (what is left of the group: an engine core or worker the signal found between two steps)
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def stop(self, grace_s: float = 60.0) -> None:
        import signal

        self.kill(signal.SIGTERM, grace_s)
