"""``kvtier serve`` at the file-descriptor limit and past fd 1,023 (issue 53, item 3): the service is a
subprocess whose open-files limit the test sets from outside (``prlimit``), as an operator's ``ulimit -n``
would. Out of fds, it pauses accepting and serves the clients it has; a client whose process it could not
pin keeps its pages as an orphan (the safe side); with more than 1,024 fds it still notices closed clients
and still removes its region on SIGTERM. Every wait is bounded."""

from __future__ import annotations

import os
import resource
import socket
import time

import pytest
from support.service import running_service, stop, wait_until
from support.service_peer import NAMESPACE, SPEC

from kvtier.service.client import ServiceClient, query_status
from kvtier.service.region import RegionFormat

pytestmark = pytest.mark.timeout(300)

FMT = RegionFormat.of(SPEC, "page_first")


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _limit_fds(pid: int, soft: int) -> None:
    """The service's open-files limit, set from outside as ``prlimit --nofile`` does."""
    _, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft > hard:
        pytest.skip(f"the hard open-files limit ({hard}) is below the {soft} this test needs")
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))


def _connect(path: str) -> socket.socket:
    """A connection the kernel queues whether or not the service accepts it (a full backlog: tried again,
    bounded)."""
    for _ in range(400):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
            return s
        except BlockingIOError:  # (EAGAIN: the listen backlog is full until the service accepts)
            s.close()
            time.sleep(0.025)
    raise AssertionError(f"could not connect to {path} in 10 s")


def test_out_of_fds_the_service_serves_its_clients_and_accepts_again_once_fds_free(tmp_path):
    with running_service(tmp_path) as svc:
        pid = svc.proc.pid
        engine = ServiceClient(svc.socket, NAMESPACE, FMT, lookup_deadline_s=5.0)
        try:
            mine = engine.reserve(2)
            engine.publish(mine, [b"\x01" * 16, b"\x02" * 16])
            engine.release(mine)  # (a publisher holds what it published until it lets go)
            wait_until(lambda: engine.status()["ready"] == 2, 10)
            # room for a few connections more, then more connections than that knock on the door
            _limit_fds(pid, _open_fds(pid) + 6)
            knocking = [_connect(svc.socket) for _ in range(20)]
            wait_until(lambda: svc.proc.poll() is not None or engine.status().get("fd_limit_hits", 0) > 0, 30)
            assert svc.proc.poll() is None, f"the service died at the fd limit: {svc.proc.stderr.read()[-800:]}"
            # the attached engine is served throughout, and the service lives
            for _ in range(5):
                assert engine.lookup([b"\x01" * 16, b"\x02" * 16]) == mine
                engine.release(mine)
            assert svc.proc.poll() is None
            # the knockers go; a new engine attaches (accepting resumed), and sees the first engine's pages
            for s in knocking:
                s.close()
            _limit_fds(pid, _open_fds(pid) + 64)
            other = ServiceClient(svc.socket, NAMESPACE, FMT, lookup_deadline_s=5.0)
            try:
                assert other.lookup([b"\x01" * 16, b"\x02" * 16]) == mine
            finally:
                other.close()
        finally:
            engine.close()
        assert svc.proc.poll() is None
    assert svc.proc.returncode == 0


def test_a_client_whose_process_could_not_be_pinned_keeps_its_pages_as_an_orphan(tmp_path):
    with running_service(tmp_path) as svc:
        pid = svc.proc.pid
        first = ServiceClient(svc.socket, NAMESPACE, FMT)  # (the region exists: attaching makes no more fds than its own)
        try:
            # one fd left: the service accepts the next client, but has none for the pidfd that would watch its process
            _limit_fds(pid, _open_fds(pid) + 1)
            victim = ServiceClient(svc.socket, NAMESPACE, FMT, lookup_deadline_s=5.0)
            leased = victim.reserve(3)
            assert len(leased) == 3
            # the victim's connection ends while its process (this one) lives: a copy of it may still write into
            # those pages, so they must stay out of circulation (not freed as if it had died)
            victim.close(quiesced=False)
            st, _ = wait_until(lambda: (s := first.status())["clients"] == 1 and s, 10)
            assert st["orphaned"] == 1 and st["writing"] == 3, st
            # fds free again: the orphan's process is watched now, and it still lives, so it stays
            _limit_fds(pid, _open_fds(pid) + 64)
            st = first.status()
            assert st["orphaned"] == 1 and st["writing"] == 3, st
        finally:
            first.close()


def test_past_fd_1023_closed_clients_are_noticed_and_sigterm_removes_the_region(tmp_path):
    # the service holds 1,100 descriptors before it starts: every fd it takes for a client is past 1,023 (select()
    # cannot watch those; before, a closed client was never detached and SIGTERM died leaving the region)
    with running_service(tmp_path, hold_fds=1100) as svc:
        engine = ServiceClient(svc.socket, NAMESPACE, FMT, lookup_deadline_s=5.0)
        region = engine.region
        leased = engine.reserve(2)
        assert len(leased) == 2
        assert min(int(fd) for fd in os.listdir(f"/proc/{svc.proc.pid}/fd") if os.readlink(f"/proc/{svc.proc.pid}/fd/{fd}")
                   .startswith("socket:") and int(fd) > 2) > 1023
        engine.close(quiesced=False)  # (its process lives: an orphan, not a leak, not a crash)
        st, _ = wait_until(lambda: (s := query_status(svc.socket))["clients"] == 0 and s, 30)
        assert st["orphaned"] == 1 and st["writing"] == 2, st
        quiet = ServiceClient(svc.socket, NAMESPACE, FMT, lookup_deadline_s=5.0)
        quiet.close()  # (a bye: detached at once)
        wait_until(lambda: query_status(svc.socket)["clients"] == 0, 30)
        assert stop(svc.proc) == 0, svc.proc.stderr.read()[-2000:]
        assert not os.path.exists(region) and not os.path.exists(svc.socket)
