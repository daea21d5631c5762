"""Stores that misbehave on purpose, in front of real ones: a TCP proxy before a real server on 127.0.0.1
(bounded loops, stopped by its owner), and a real backend wrapped with hooks that delay, fail or hold calls."""

from __future__ import annotations

import socket
import threading
from dataclasses import replace

from kvtier.app.devservers import free_port


class DripProxy:
    """A TCP proxy in front of a real redis-server; once ``drip`` is set, replies trickle one byte
    every ``interval`` seconds (requests still pass at full speed). ``small``: reply chunks of at
    most that many bytes (an EXISTS answer, a handshake) still pass at once -- a server slow
    only for pages."""

    def __init__(self, target_port: int, interval: float = 0.5, small: int = 0):
        self.target_port, self.interval, self.small = target_port, interval, small
        self.drip = threading.Event()
        self.stop = threading.Event()
        self.port = free_port()
        self.listener = socket.create_server(("127.0.0.1", self.port))
        self.listener.settimeout(0.2)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, replies: bool) -> None:
        src.settimeout(0.2)
        try:
            while not self.stop.is_set():
                try:
                    data = src.recv(1 << 16)
                except socket.timeout:
                    continue
                if not data:
                    return
                if replies and self.drip.is_set() and len(data) > self.small:
                    for i in range(len(data)):
                        if self.stop.wait(self.interval):
                            return
                        dst.sendall(data[i : i + 1])
                else:
                    dst.sendall(data)
        except OSError:
            return

    def close(self) -> None:
        self.stop.set()
        self.listener.close()


class Injecting:
    """A real backend with hooks: ``before_get(call_index)`` / ``before_set(call_index)`` run
    before the call is passed on and may sleep, block or raise. (A call index is the order the I/O
    threads reached the store, not a batch's place: a fault meant for one page keys on its name.)"""

    def __init__(self, inner, object_bytes: int):
        self.inner = inner
        self.name, self.stats = inner.name, inner.stats
        self.capabilities = replace(inner.capabilities, batch_bytes=object_bytes)  # one page per call
        self.before_get = self.before_set = lambda i: None
        self.finished: list[int] = []  # get calls in the order they returned
        self._calls = {"get": 0, "set": 0}
        self._lock = threading.Lock()

    def _next(self, op: str) -> int:
        with self._lock:
            self._calls[op] += 1
            return self._calls[op] - 1

    def calls(self, op: str) -> int:
        return self._calls[op]

    def exists(self, keys):
        return self.inner.exists(keys)

    def get(self, keys, outs):
        return self.inner.get(keys, outs)

    def set(self, keys, values):
        return self.inner.set(keys, values)

    def get_scattered(self, keys, outs):
        i = self._next("get")
        self.before_get(i)
        out = self.inner.get_scattered(keys, outs)
        with self._lock:
            self.finished.append(i)
        return out

    def set_scattered(self, keys, parts):
        i = self._next("set")
        self.before_set(i)
        return self.inner.set_scattered(keys, parts)

    def delete(self, keys):
        self.inner.delete(keys)

    def close(self):
        self.inner.close()
