"""The node service's wire: length-prefixed JSON frames over a Unix stream socket.

A frame is a 4-byte big-endian length, then that many bytes of UTF-8 JSON holding one object. No
pickle crosses the socket: a peer's bytes are data, never code. The length is checked before a byte
of the body is buffered (:data:`MAX_FRAME`), so a hostile length cannot make the service allocate.
What a frame holds is :mod:`kvtier.service.messages`' business.
"""

from __future__ import annotations

import json
import socket
import struct
import time

from kvtier.errors import ServiceError, ServiceProtocolError

#: the largest frame either side accepts (a step's lookups for ~100k pages fit, in hex)
MAX_FRAME = 16 << 20
HEADER = struct.Struct(">I")


def encode(obj: dict) -> bytes:
    body = json.dumps(obj, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME:
        raise ServiceProtocolError(f"a message of {len(body)} bytes is over the {MAX_FRAME}-byte frame limit; send fewer pages per call")
    return HEADER.pack(len(body)) + body


def decode(body: bytes) -> dict:
    try:
        obj = json.loads(body)
    except (UnicodeDecodeError, ValueError):
        raise ServiceProtocolError("a frame is not UTF-8 JSON") from None
    except RecursionError:  # (arrays in arrays in ...: deeper than the parser's stack, which no message needs)
        raise ServiceProtocolError("a frame's JSON nests too deep; no message nests more than a few levels") from None
    if type(obj) is not dict:
        raise ServiceProtocolError(f"a frame holds a JSON {type(obj).__name__}, not an object")
    return obj


def check_length(n: int) -> None:
    if not 0 < n <= MAX_FRAME:
        raise ServiceProtocolError(f"a frame announces {n} bytes; a frame holds 1 to {MAX_FRAME} bytes")


class FrameReader:
    """Frames out of a byte stream that arrives in pieces (the service's non-blocking side)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[dict]:
        """The whole frames ``data`` completes; a bad length or body raises :class:`ServiceProtocolError`."""
        self._buf += data
        frames = []
        while len(self._buf) >= HEADER.size:
            (n,) = HEADER.unpack_from(self._buf)
            check_length(n)
            if len(self._buf) < HEADER.size + n:
                break
            frames.append(decode(bytes(self._buf[HEADER.size : HEADER.size + n])))
            del self._buf[: HEADER.size + n]
        return frames

    @property
    def pending(self) -> bool:
        """Part of a frame has arrived and the rest has not."""
        return bool(self._buf)


def send_frame(sock: socket.socket, obj: dict, deadline: float) -> None:
    """Send one frame before ``deadline`` (a ``time.monotonic()`` value); a blocking socket."""
    data = encode(obj)
    sock.settimeout(max(deadline - time.monotonic(), 1e-3))
    try:
        sock.sendall(data)
    except TimeoutError:
        raise ServiceError("the node service did not take a message before its deadline (it is not reading)") from None
    except OSError as e:
        raise ServiceError(f"the node service's connection is gone ({e})") from None


def recv_frame(sock: socket.socket, deadline: float) -> dict:
    """Read one frame before ``deadline``; a blocking socket."""
    (n,) = HEADER.unpack(_recv_exactly(sock, HEADER.size, deadline))
    check_length(n)
    return decode(_recv_exactly(sock, n, deadline))


def _recv_exactly(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        sock.settimeout(max(deadline - time.monotonic(), 1e-3))
        try:
            chunk = sock.recv(n - len(buf))
        except TimeoutError:
            raise ServiceError("the node service did not answer within the call's deadline") from None
        except OSError as e:
            raise ServiceError(f"the node service's connection is gone ({e})") from None
        if not chunk:
            raise ServiceError("the node service closed the connection")
        buf += chunk
    return bytes(buf)
