"""Services an engine must not trust, for tests/test_service_trust.py: a listener that speaks the node
service's wire format and answers what a test scripts (:class:`FakeService`), and a proxy in front of a
real service that corrupts its answers at random (:class:`CorruptingProxy`). Each runs on threads of
its own with real Unix sockets; ``close()`` ends them (bounded)."""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Callable

from support.service import OtherUser

from kvtier.errors import ServiceError
from kvtier.service.wire import HEADER, MAX_FRAME, encode, recv_frame, send_frame

#: how long one of these waits on a socket before it gives the connection up (a test's whole run is shorter)
_WAIT_S = 120.0


def _deadline() -> float:
    return time.monotonic() + _WAIT_S


class FakeService:
    """Listens on ``listener`` (bound and listening, or a path to bind) and answers each request frame's
    ops with ``answer(op)`` -- anything JSON can carry -- in one frame (a note batch is not answered).
    ``received`` lists every op it read, in order."""

    def __init__(self, listener: socket.socket | str, answer: Callable[[dict], object]):
        if isinstance(listener, str):
            path, listener = listener, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(path)
            listener.listen(16)
        self.listener = listener
        self.answer = answer
        self.received: list[dict] = []
        self._conns: list[socket.socket] = []
        self._closed = False
        listener.settimeout(0.05)  # (its thread sees a close within a turn)
        self._thread = threading.Thread(target=self._accept, name="fake-service", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                frame = recv_frame(conn, _deadline())
                ops = frame.get("ops", [])
                self.received.extend(ops)
                results = [self.answer(op) for op in ops]
                if not frame.get("note"):
                    send_frame(conn, {"seq": frame.get("seq"), "results": results}, _deadline())
        except (ServiceError, OSError):  # (the engine hung up, or close() closed the connection)
            conn.close()

    def close(self) -> None:
        self._closed = True
        self.listener.close()
        for c in self._conns:
            c.close()
        self._thread.join(10)


class ForkedFake:
    """A :class:`FakeService` in a child forked from this process that became ``user`` (the tests run as
    root): ``setup()`` runs as that user and returns the listening socket (it may make the directory, the
    socket and a region file itself; or listen on a socket bound before the fork, so that the listener's
    ``SO_PEERCRED`` is the user's). :meth:`ops` names the ops it read so far; :meth:`stop` kills it by its pid."""

    def __init__(self, user: OtherUser, setup: Callable[[], socket.socket], answer: Callable[[dict], object], timeout_s: float = 30.0):
        import selectors

        read_end, write_end = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child
            try:
                os.close(read_end)
                user.become()
                listener = setup()

                def recorded(op: dict) -> object:
                    os.write(write_end, (json.dumps(op.get("op")) + "\n").encode())
                    return answer(op)

                FakeService(listener, recorded)
                os.write(write_end, b"ready\n")
                time.sleep(600)
            finally:
                os._exit(0)
        os.close(write_end)
        self._read = read_end
        self._lines: list[str] = []
        sel = selectors.DefaultSelector()
        sel.register(read_end, selectors.EVENT_READ)
        try:
            while "ready" not in self._lines:
                if not sel.select(timeout_s):
                    self.stop()
                    raise AssertionError(f"the fake service as uid {user.uid} did not start in {timeout_s:g} s")
                self._take()
        finally:
            sel.close()

    def _take(self) -> None:
        chunk = os.read(self._read, 1 << 16)
        if not chunk:
            raise AssertionError("the fake service exited before it was ready")
        self._lines += chunk.decode().split()

    def ops(self) -> list[str]:
        """The ops it has read (its pipe drained without waiting)."""
        import select

        while select.select([self._read], [], [], 0)[0]:
            chunk = os.read(self._read, 1 << 16)
            if not chunk:
                break
            self._lines += chunk.decode().split()
        return [json.loads(line) for line in self._lines if line != "ready"]

    def stop(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass


# ---- answers out of protocol ---------------------------------------------------------------------
def bad_pages(rng: random.Random, pages: object, asked: int, num_pages: int) -> object:
    """``pages`` (a lookup's or a reservation's answer, of at most ``asked`` ids) made wrong in a way the
    protocol forbids: a negative id, one past the region, a repeat, more than asked, a bool, a float, a
    string, None, or not a list at all."""
    ids = list(pages) if type(pages) is list else []
    kind = rng.randrange(9)
    if kind == 0:
        return ids + [-rng.randint(1, 3)]
    if kind == 1:
        return ids + [num_pages + rng.randrange(3)]
    if kind == 2:
        return ids + [ids[0]] if ids else [0, 0]
    if kind == 3:  # (distinct ids of the region, one more than asked)
        given = set(ids)
        more = ids + list(itertools.islice((p for p in range(num_pages) if p not in given), asked + 1 - len(ids)))
        return more if len(more) > asked else more + [-1]
    if kind == 4:
        return ids + [True]
    if kind == 5:
        return ids + [float(ids[0] if ids else 0)]
    if kind == 6:
        return ids + [str(ids[0] if ids else 0)]
    if kind == 7:
        return ids + [None]
    return rng.choice([{"pages": ids}, len(ids), "0,1", None, True])


def bad_hello(rng: random.Random, hello: dict, fake_paths: list[str]) -> object:
    """A hello answer made wrong: pages 0, negative, 10**13, a bool or a string; a size that is not the
    pages' (or not an int); a region that is relative, not a string, or a file the service did not make
    (``fake_paths``: another user's, world-readable, a symlink, a FIFO, a device); a session that is not one."""
    h = dict(hello)
    kind = rng.randrange(5)
    if kind == 0:
        h["num_pages"] = rng.choice([0, -1, -h["num_pages"], 10**13, True, str(h["num_pages"]), None, h["num_pages"] + 1,
                                     h["num_pages"] - 1, float(h["num_pages"])])
    elif kind == 1:
        h["size"] = rng.choice([h["size"] + 1, h["size"] - 1, -1, 0, str(h["size"]), float(h["size"]), None])
    elif kind == 2:
        h["region"] = rng.choice(["region", "./" + h["region"], 5, None, "", h["region"] + "\0", *fake_paths])
    elif kind == 3:
        h["session"] = rng.choice([None, "", 7, "s" * 65, ["x"]])
    else:
        return rng.choice([None, [h], "hello", 1])
    return h


def bad_frame(rng: random.Random, seq: int, results: list) -> bytes:
    """An answer frame wrong as a whole: another seq, results that are not a list or not one per op, a
    refusal of no known type, not JSON, a JSON array, or a length the wire forbids."""
    kind = rng.randrange(8)
    if kind == 0:
        return encode({"seq": seq + rng.choice([1, -1, 1000]), "results": results})
    if kind == 1:
        return encode({"seq": seq, "results": {"0": results}})
    if kind == 2:
        return encode({"seq": seq, "results": results + [[]]})
    if kind == 3:
        return encode({"seq": seq, "error": rng.choice([5, "no", {"type": "KeyError", "message": 3}])})
    if kind == 4:
        body = b"{not json"
        return HEADER.pack(len(body)) + body
    if kind == 5:
        body = json.dumps([seq, results]).encode()
        return HEADER.pack(len(body)) + body
    if kind == 6:
        return HEADER.pack(rng.choice([0, MAX_FRAME + 1]))
    return encode({"seq": str(seq), "results": results})


class CorruptingProxy:
    """Listens on ``path`` and passes each connection's frames to the service at ``upstream`` and its
    answers back, but answers a share ``rate`` of them (a hello's, a lookup's, a reservation's or the
    frame as a whole) out of protocol (:func:`bad_hello`, :func:`bad_pages`, :func:`bad_frame`), then
    closes that connection as a broken service would (the engine must not read it again anyway). An
    honest answer is the real service's, so its pages hold what was published under their keys: every
    lie here is one the protocol lets an engine see. ``corrupted`` counts the lies told; a hello is
    honest while ``honest_hellos`` is set (an engine's first attach, at build). ``num_pages``: the real
    region's (ids past it are out of range)."""

    def __init__(self, path: str, upstream: str, seed: int, rate: float, fake_paths: list[str], num_pages: int):
        self.num_pages = num_pages
        self.upstream = upstream
        self.rng = random.Random(seed)
        self.rate = rate
        self.fake_paths = fake_paths
        self.honest_hellos = True
        self.corrupted = 0
        self._closed = False
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(16)
        self.listener.settimeout(0.05)  # (its thread sees a close within a turn)
        self._thread = threading.Thread(target=self._accept, name="corrupting-proxy", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            up.connect(self.upstream)
            with self._lock:
                self._socks += [conn, up]
            threading.Thread(target=self._relay, args=(conn, up), daemon=True).start()

    def _relay(self, conn: socket.socket, up: socket.socket) -> None:
        try:
            while True:
                frame = recv_frame(conn, _deadline())
                send_frame(up, frame, _deadline())
                if frame.get("note"):
                    continue
                answer = recv_frame(up, _deadline())
                lie = self._lie(frame, answer)
                if lie is None:
                    send_frame(conn, answer, _deadline())
                    continue
                conn.sendall(lie)
                break  # (a service that lied once is done with this connection; the engine is too)
        except (ServiceError, OSError):
            pass
        conn.close()
        up.close()

    def _lie(self, frame: dict, answer: dict) -> bytes | None:
        """The bytes of a wrong answer to ``frame`` (whose right answer is ``answer``), or None: honest."""
        with self._lock:
            rng = self.rng
            ops, results = frame.get("ops", []), answer.get("results")
            hello = ops and ops[0].get("op") == "hello"
            if "error" in answer or type(results) is not list or (hello and self.honest_hellos) or rng.random() >= self.rate:
                return None
            self.corrupted += 1
            if rng.random() < 0.2:
                return bad_frame(rng, frame["seq"], results)
            results = list(results)
            for i, op in enumerate(ops):
                if op.get("op") == "hello":
                    results[i] = bad_hello(rng, results[i], self.fake_paths)
                elif op.get("op") in ("lookup", "reserve"):
                    asked = len(op["keys"]) if op["op"] == "lookup" else op["n"]
                    results[i] = bad_pages(rng, results[i], asked, self.num_pages)
            return encode({"seq": frame["seq"], "results": results})

    def close(self) -> None:
        self._closed = True
        self.listener.close()
        with self._lock:
            for s in self._socks:
                s.close()
        self._thread.join(10)
