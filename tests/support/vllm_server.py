"""``vllm serve`` on loopback for the tests: one server process per instance, stopped by pid."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from kvtier.app.devservers import free_port, wait_until


@dataclass
class VllmServer:
    """``vllm serve`` (vLLM's OpenAI-compatible server, its default multi-process engine) on 127.0.0.1.

    ``kv_transfer`` is the ``--kv-transfer-config`` object (None: no connector). :meth:`stop` asks the
    server to shut down (SIGTERM: the engine and its workers close, the connector drains its L3
    writes), and kills it by pid if it has not exited within ``grace_s``."""

    model: str
    workdir: Path
    kv_transfer: dict | None = None
    args: tuple[str, ...] = ()
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    _log: BinaryIO | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 300.0) -> VllmServer:
        import json
        import urllib.request

        self.workdir.mkdir(parents=True, exist_ok=True)
        # vLLM's own ``vllm serve`` (kvtier.app.vllm_cli: the CPU wheel's command needs its version answered)
        cmd = [
            sys.executable,
            "-m",
            "kvtier.app.vllm_cli",
            "serve",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *self.args,
        ]
        if self.kv_transfer is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_transfer)]
        self._log = open(self.workdir / f"vllm-{self.port}.log", "wb")
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), "HF_HUB_OFFLINE": "1"}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

        def healthy() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited {self.proc.returncode} at startup; log: {self.workdir}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_until(healthy, timeout=timeout_s, what=f"vllm serve on port {self.port}")
        return self

    def post(self, path: str, body: dict, timeout_s: float = 300.0) -> dict:
        import json
        import urllib.request

        req = urllib.request.Request(f"{self.url}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read())

    def get_text(self, path: str, timeout_s: float = 30.0) -> str:
        import urllib.request

        with urllib.request.urlopen(f"{self.url}{path}", timeout=timeout_s) as r:
            return r.read().decode()

    def stop(self, grace_s: float = 60.0) -> None:
        import signal

        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None
