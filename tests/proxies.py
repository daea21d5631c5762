"""Servers that misbehave on purpose, in front of real ones, on 127.0.0.1 (bounded loops, stopped by
their owner)."""

from __future__ import annotations

import socket
import threading

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
