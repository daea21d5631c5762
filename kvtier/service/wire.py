"""The node service's wire: length-prefixed JSON frames over a Unix stream socket.

A frame is a 4-byte big-endian length, then that many bytes of UTF-8 JSON holding one object. No
pickle crosses the socket: a peer's bytes are data, never code. The length is checked before a byte
of the body is buffered (:data:`MAX_FRAME`), so a hostile length cannot make the service allocate.
What a frame holds is :mod:`kvtier.service.messages`' business.

Two limits: a request (what the service reads) is at most :data:`MAX_FRAME` -- small, so that decoding
one costs the service's single loop thread a bounded slice of time, however many a client sends (a
client splits a long call into several: :mod:`kvtier.service.client`) -- and an answer (what a client
reads) at most :data:`MAX_ANSWER`.
"""

from __future__ import annotations

import json
import socket
import struct
import time

from kvtier.errors import ServiceProtocolError, ServiceUnavailableError

#: the largest request frame the service reads (~30k page keys in hex: decoded and applied in ~20 ms)
MAX_FRAME = 1 << 20
#: the largest answer frame a client reads (a status of many namespaces)
MAX_ANSWER = 16 << 20
HEADER = struct.Struct(">I")


def encode(obj: dict, limit: int = MAX_FRAME) -> bytes:
    body = json.dumps(obj, separators=(",", ":")).encode()
    if len(body) > limit:
        raise ServiceProtocolError(f"a message of {len(body)} bytes is over the {limit}-byte frame limit; send fewer pages per call")
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


def check_length(n: int, limit: int = MAX_FRAME) -> None:
    if not 0 < n <= limit:
        raise ServiceProtocolError(f"a frame announces {n} bytes; a frame holds 1 to {limit} bytes")


class FrameReader:
    """Frames out of a byte stream that arrives in pieces (the service's non-blocking side). Bodies are
    handed out one at a time, undecoded (:meth:`next`): the service decodes a frame when it applies it,
    so what it buffers costs it nothing until its turn."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> None:
        """Buffer ``data``; a bad length at the head raises :class:`ServiceProtocolError` (the lengths of the
        frames behind it are checked as each comes to the head: :meth:`next`)."""
        self._buf += data
        n = self._length()
        if n is not None:
            check_length(n)

    def next(self) -> bytes | None:
        """The body of the next whole frame, taken off the buffer (None: none has arrived whole); a bad length
        at the head raises :class:`ServiceProtocolError`."""
        n = self._length()
        if n is None:
            return None
        check_length(n)
        if len(self._buf) < HEADER.size + n:
            return None
        body = bytes(self._buf[HEADER.size : HEADER.size + n])
        del self._buf[: HEADER.size + n]
        return body

    def _length(self) -> int | None:
        """The length the head frame announces, unchecked (None: its header is not in yet)."""
        return HEADER.unpack_from(self._buf)[0] if len(self._buf) >= HEADER.size else None

    @property
    def buffered(self) -> int:
        """Bytes held: whole frames not taken yet, and the start of the next."""
        return len(self._buf)

    @property
    def whole(self) -> bool:
        """:meth:`next` has something to say now: a whole frame is at the head (or a bad length, which it refuses)."""
        n = self._length()
        return n is not None and (not 0 < n <= MAX_FRAME or len(self._buf) >= HEADER.size + n)

    @property
    def pending(self) -> bool:
        """Part of a frame has arrived and the rest has not (no whole frame is at the head)."""
        return bool(self._buf) and not self.whole


def send_frame(sock: socket.socket, obj: dict, deadline: float) -> None:
    """Send one frame before ``deadline`` (a ``time.monotonic()`` value); a blocking socket."""
    data = encode(obj)
    sock.settimeout(max(deadline - time.monotonic(), 1e-3))
    try:
        sock.sendall(data)
    except TimeoutError:
        raise ServiceUnavailableError("the node service did not take a message before its deadline (it is not reading)") from None
    except OSError as e:
        raise ServiceUnavailableError(f"the node service's connection is gone ({e})") from None


def recv_frame(sock: socket.socket, deadline: float, limit: int = MAX_ANSWER) -> dict:
    """Read one frame (at most ``limit`` bytes: an answer) before ``deadline``; a blocking socket."""
    (n,) = HEADER.unpack(_recv_exactly(sock, HEADER.size, deadline))
    check_length(n, limit)
    return decode(_recv_exactly(sock, n, deadline))


def _recv_exactly(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        sock.settimeout(max(deadline - time.monotonic(), 1e-3))
        try:
            chunk = sock.recv(n - len(buf))
        except TimeoutError:
            raise ServiceUnavailableError("the node service did not answer within the call's deadline") from None
        except OSError as e:
            raise ServiceUnavailableError(f"the node service's connection is gone ({e})") from None
        if not chunk:
            raise ServiceUnavailableError("the node service closed the connection")
        buf += chunk
    return bytes(buf)
