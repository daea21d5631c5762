"""The RESP bulk reader behind zero-copy Redis gets, over a real socket pair (no server needed)."""

import os
import socket
import threading
import time

import pytest

from kvtier.l3.base import KeyStatus
from kvtier.l3.redis import _BulkReader


def feed(chunks: list[bytes]):
    """A connected socket whose peer sends ``chunks`` one by one (so replies split anywhere), then closes."""
    a, b = socket.socketpair()
    a.settimeout(5)

    def send():
        for c in chunks:
            b.sendall(c)
        b.close()

    t = threading.Thread(target=send, daemon=True)
    t.start()
    return a, t


def bulk(v: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(v), v)


def test_values_land_in_parts_across_arbitrary_splits():
    vals = [os.urandom(70_000), os.urandom(5), os.urandom(131_072)]
    stream = b"".join(bulk(v) for v in vals) + b"$-1\r\n_\r\n-WRONGTYPE no\r\n"
    chunks = [stream[i : i + 997] for i in range(0, len(stream), 997)]  # splits headers, bodies and CRLFs
    sock, t = feed(chunks)
    r = _BulkReader(sock, time.monotonic() + 30)
    for v in vals:
        parts = [memoryview(bytearray(len(v) // 3)), memoryview(bytearray(len(v) - len(v) // 3))]
        assert r.get_into(parts) is KeyStatus.OK
        assert b"".join(bytes(p) for p in parts) == v
    assert [r.get_into([memoryview(bytearray(1))]) for _ in range(3)] == [KeyStatus.MISS, KeyStatus.MISS, KeyStatus.ERROR]
    t.join()
    sock.close()


def test_wrong_size_is_reported_and_skipped_whole():
    sock, t = feed([bulk(b"0123456789"), bulk(b"ok")])
    r = _BulkReader(sock, time.monotonic() + 30)
    assert r.get_into([memoryview(bytearray(4))]) is KeyStatus.WRONG_SIZE
    out = memoryview(bytearray(2))
    assert r.get_into([out]) is KeyStatus.OK and bytes(out) == b"ok"
    t.join()
    sock.close()


@pytest.mark.parametrize("stream", [b"$10\r\n01234", b"$3\r\nabcXY", b"+OK\r\n"])
def test_truncated_or_foreign_reply_raises(stream):
    sock, t = feed([stream])
    with pytest.raises(ConnectionError):
        _BulkReader(sock, time.monotonic() + 30).get_into([memoryview(bytearray(10 if stream.startswith(b"$10") else 3))])
    t.join()
    sock.close()
