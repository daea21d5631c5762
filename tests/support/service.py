"""The node service for tests: ``kvtier serve`` started as a subprocess on a temp socket and stopped by
its pid, engine processes attached to it (:mod:`support.service_peer`), and raw frames for the
protocol tests. Every wait here is bounded."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvtier.service.wire import HEADER, encode

ROOT = Path(__file__).resolve().parents[2]
#: subprocesses import this worktree's kvtier and the tests' support package, wherever they run
ENV = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
START_TIMEOUT_S = 120.0


@dataclass
class RunningService:
    proc: subprocess.Popen
    socket: str
    banner: str


@contextmanager
def running_service(tmp_path: Path, host_gb: float = 0.01, *args: str, hold_fds: int = 0):
    """``kvtier serve`` on ``tmp_path/run/node.sock`` (``args``: more of its options) until the block ends
    (then SIGTERM, then SIGKILL); ``hold_fds``: :func:`start_service`'s."""
    svc = start_service(str(tmp_path / "run" / "node.sock"), host_gb, *args, hold_fds=hold_fds)
    try:
        yield svc
    finally:
        stop(svc.proc)


def start_service(sock: str, host_gb: float = 0.01, *args: str, hold_fds: int = 0) -> RunningService:
    """``kvtier serve`` on ``sock`` (``args``: more of its options), once it listens (the caller stops it).
    ``hold_fds``: descriptors it opens before it starts (:mod:`support.service_fds`: its own are numbered past them)."""
    program = ["-m", "support.service_fds", str(hold_fds)] if hold_fds else ["-m", "kvtier.app.cli"]
    proc = subprocess.Popen([sys.executable, *program, "serve", "--host-gb", str(host_gb), "--socket", sock, *args],
                            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        banner = read_line(proc, START_TIMEOUT_S)
        assert "listening on unix://" + sock in banner, (banner, proc.stderr.read() if proc.poll() is not None else "")
    except BaseException:
        stop(proc)
        raise
    return RunningService(proc, sock, banner)


def store_files(root: Path) -> dict[str, bytes]:
    """A file store's objects: path under the store -> bytes (a service's L3 and an engine's own compared whole)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def remove_regions(regions: list[str]) -> None:
    """The regions of services a test SIGKILLed (a killed service cannot remove its own; the next one its user
    starts would)."""
    for region in regions:
        shutil.rmtree(os.path.dirname(region), ignore_errors=True)


def tell(proc: subprocess.Popen, line: str) -> None:
    """One line to a peer's stdin."""
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def stop(proc: subprocess.Popen, timeout_s: float = 30.0) -> int:
    """SIGTERM ``proc`` by its pid, SIGKILL it if it does not exit in time; its exit code."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
    return proc.wait(timeout_s)


def read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    """The next line ``proc`` prints, waited for at most ``timeout_s``."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        if not sel.select(timeout_s):
            raise TimeoutError(f"process {proc.pid} printed nothing in {timeout_s:g} s")
        return proc.stdout.readline()
    finally:
        sel.close()


def start_peer(role: str, sock: str, *args: str) -> subprocess.Popen:
    """An engine process (:mod:`support.service_peer`) attached to the service at ``sock``."""
    return subprocess.Popen([sys.executable, "-m", "support.service_peer", role, sock, *args], cwd=ROOT, env=ENV,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def peer_report(proc: subprocess.Popen, timeout_s: float = START_TIMEOUT_S) -> dict:
    """The JSON line a peer prints when it has done its part."""
    line = read_line(proc, timeout_s)
    if not line:
        proc.wait(10)
        raise AssertionError(f"peer exited {proc.returncode}: {proc.stderr.read()[-3000:]}")
    return json.loads(line)


def scrape_metrics(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample a Prometheus endpoint at ``url`` serves: (name, sorted labels) -> value."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def start_flood(sock: str, namespace: str, fmt: dict, seconds: float) -> subprocess.Popen:
    """A process flooding the service at ``sock`` with the largest lookups it takes (:mod:`kvtier.app.bench.flood`),
    once it printed that it floods (then it stops at its next line on stdin, or after ``seconds``)."""
    proc = subprocess.Popen([sys.executable, "-m", "kvtier.app.bench.flood", sock, namespace, json.dumps(fmt), str(seconds)], cwd=ROOT,
                            env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert peer_report(proc) == {"flooding": True}
    except BaseException:
        proc.kill()
        proc.wait(30)
        raise
    return proc


def proc_status(pid: int, field: str) -> int:
    """A number ``/proc/PID/status`` gives for ``field`` (``Threads``; ``VmRSS`` in kB)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def wait_until(check, timeout_s: float, every_s: float = 0.05):
    """Poll ``check()`` until it returns something true; (its value, seconds it took). Fails past the bound."""
    start = time.monotonic()
    while True:
        value = check()
        if value:
            return value, time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"not within {timeout_s:g} s")
        time.sleep(every_s)


# ---- raw frames: what a careless or hostile peer sends --------------------------------------------
def raw_connection(sock_path: str, timeout_s: float = 10.0) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout_s)
    s.connect(sock_path)
    return s


def frame(obj: dict) -> bytes:
    return encode(obj)


def raw_frame(body: bytes, length: int | None = None) -> bytes:
    """``body`` behind a length header that may lie."""
    return HEADER.pack(len(body) if length is None else length) + body


def read_answer(s: socket.socket) -> dict | None:
    """The next frame the service sends, or None when it closed the connection."""
    head = _read(s, HEADER.size)
    if head is None:
        return None
    (n,) = HEADER.unpack(head)
    return json.loads(_read(s, n))


def closed_by_peer(s: socket.socket) -> bool:
    """The service closed the connection: reading gives end-of-file (or a reset)."""
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def _read(s: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        try:
            chunk = s.recv(n - len(buf))
        except ConnectionResetError:
            return None
        if not chunk:
            return None
        buf += chunk
    return buf


def query_status_of(sock: str):
    """A function that asks the service at ``sock`` for its status."""
    from kvtier.service.client import query_status

    return lambda: query_status(sock)


# ---- a process of another user ------------------------------------------------------------------
@dataclass(frozen=True)
class OtherUser:
    """Credentials a forked child takes before it runs (the tests run as root): ``uid`` as real, effective
    and saved uid unless ``saved_uid``; ``gid``; supplementary ``groups``; and, where a test needs a process
    that reaches a path its credentials would not (the directory gate passed, the service's own check
    left), a filesystem ``fsuid`` / ``fsgid`` of its own."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()
    fsgid: int | None = None
    saved_uid: int | None = None
    fsuid: int | None = None

    def become(self) -> None:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        os.setgroups(list(self.groups))
        os.setgid(self.gid)
        if self.fsgid is not None:
            libc.setfsgid(self.fsgid)
        os.setresuid(self.uid, self.uid, self.uid if self.saved_uid is None else self.saved_uid)
        if self.fsuid is not None:
            libc.setfsuid(self.fsuid)


def as_other_user(user: OtherUser, fn, timeout_s: float = 60.0) -> dict:
    """``fn()`` (a JSON-able dict) in a child forked from this process that became ``user``; an exception it
    raises comes back as ``{"error": type name, "message": ...}``. The child runs only code imported
    already (another user cannot read this interpreter's files) and exits with ``os._exit``."""
    import selectors

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read_end)
        try:
            user.become()
            out = fn()
        except BaseException as e:  # noqa: BLE001 -- every failure is the child's answer
            out = {"error": type(e).__name__, "message": str(e)}
        os.write(write_end, json.dumps(out).encode())
        os._exit(0)
    os.close(write_end)
    sel = selectors.DefaultSelector()
    sel.register(read_end, selectors.EVENT_READ)
    chunks, deadline = [], time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and sel.select(deadline - time.monotonic()):
            chunk = os.read(read_end, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
        else:
            os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"the child as uid {user.uid} did not answer in {timeout_s:g} s")
    finally:
        sel.close()
        os.close(read_end)
        os.waitpid(pid, 0)
    return json.loads(b"".join(chunks))
