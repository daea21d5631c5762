"""A client that floods the node service with the largest lookups it takes, back to back (``kvtier bench
service``'s ``flood`` row, and the fairness tests): ``python -m kvtier.app.bench.flood SOCKET NAMESPACE
FORMAT_JSON SECONDS``.

It attaches in NAMESPACE (FORMAT_JSON: a :class:`~kvtier.service.region.RegionFormat`'s wire form), then
sends lookup frames as large as the wire allows (:data:`~kvtier.service.wire.MAX_FRAME` bytes of 16-byte
keys, within a batch's :data:`~kvtier.service.messages.MAX_PAGES`) -- valid, each answered -- as fast as the
service takes them, reading the answers on a thread of its own. It prints ``{"flooding": true}`` once the
first answer came back, and stops after SECONDS or when a line arrives on stdin; then it prints what it
sent: frames, their bytes, answers read, and the error that ended it, if any.
"""

from __future__ import annotations

import json
import os
import select
import socket
import sys
import threading
import time

from kvtier.service.messages import MAX_PAGES, Hello, Lookup
from kvtier.service.wire import HEADER, MAX_FRAME, encode, recv_frame

#: a key's bytes in a lookup frame: 32 hex digits, two quotes, a comma
_KEY_BYTES = 35


def lookup_frame() -> bytes:
    """The largest valid lookup frame: as many 16-byte keys (misses) as fit in one frame and one batch."""
    n = min(MAX_PAGES, (MAX_FRAME - 256) // _KEY_BYTES)
    keys = [os.urandom(16) for _ in range(n)]
    frame = encode({"seq": 2, "ops": [Lookup(keys=keys).wire()]})
    assert len(frame) <= HEADER.size + MAX_FRAME
    return frame


def flood(socket_path: str, namespace: str, fmt: dict, seconds: float, stop=lambda: False, started=lambda: None) -> dict:
    """Flood for ``seconds`` or until ``stop()``; call ``started()`` once the first answer came back."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30.0)
    sock.connect(socket_path)
    sock.sendall(encode({"seq": 1, "ops": [Hello(namespace=namespace, format=fmt).wire()]}))
    hello = recv_frame(sock, time.monotonic() + 30.0)
    if "error" in hello:
        raise RuntimeError(f"flood: hello refused: {hello['error']}")
    data = lookup_frame()
    sent = answered = 0
    error: list[str] = []
    first = threading.Event()

    def read() -> None:
        nonlocal answered
        try:
            while True:
                answer = recv_frame(sock, time.monotonic() + 60.0)
                if "error" in answer:
                    error.append(str(answer["error"]))
                    return
                answered += 1
                first.set()
        except Exception as e:  # (the connection closed once the sender is done: the end of the flood)
            if not error and sent > answered:
                error.append(str(e))
            first.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    start = time.monotonic()
    try:
        sock.sendall(data)
        sent += 1
        first.wait(30.0)
        started()
        while not stop() and time.monotonic() - start < seconds and not error:
            sock.sendall(data)
            sent += 1
        deadline = time.monotonic() + 30.0
        while answered < sent and not error and time.monotonic() < deadline:
            time.sleep(0.01)
    except OSError as e:
        error.append(str(e))
    finally:
        sock.close()
        reader.join(5.0)
    return {"frames": sent, "frame_bytes": len(data), "answered": answered, "seconds": round(time.monotonic() - start, 3),
            "error": error[0] if error else None}


def main(argv: list[str]) -> None:
    socket_path, namespace, fmt, seconds = argv

    def line_arrived() -> bool:
        return bool(select.select([sys.stdin], [], [], 0)[0])

    report = flood(socket_path, namespace, json.loads(fmt), float(seconds), stop=line_arrived,
                   started=lambda: print(json.dumps({"flooding": True}), flush=True))
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
