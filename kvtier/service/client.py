"""An engine's connection to the node service: one socket, batched calls, a deadline on every one.

A call sends one frame (a batch of ops) and reads its one answer before the deadline. Notes (publish,
release) are batches the service does not answer: they leave at once, nothing waits on them, and if
the service refused one the refusal is what the next call reads. Any failure -- no answer in time, a
closed connection, a refusal -- is a :class:`~kvtier.errors.ServiceError` (typed as the service sent
it), and the client is broken from then on: an answer that arrives late must never be read as the
answer to a later call.
"""

from __future__ import annotations

import socket
import time

from kvtier.errors import ServiceAccessError, ServiceError, ServiceProtocolError
from kvtier.service.messages import BYE_OP, STATUS_OP, hello_op, lookup_op, publish_op, release_op, reserve_op
from kvtier.service.region import RegionFormat
from kvtier.service.wire import recv_frame, send_frame

#: the error types the service sends, by name (anything else is a plain ServiceError)
_ERRORS = {cls.__name__: cls for cls in (ServiceError, ServiceProtocolError, ServiceAccessError)}


class ServiceClient:
    """Attached to the service at ``socket_path`` in ``namespace`` (a :class:`~kvtier.hashing.Namespace`'s
    string), for pages of ``fmt``. ``region``, ``region_size`` and ``num_pages`` say what to map;
    ``session`` names this attachment. ``previous``: a session of this process that is quiesced (nothing
    in flight touches its pages, none is in its tree any more): the service frees what it kept of it."""

    def __init__(self, socket_path: str, namespace: str, fmt: RegionFormat, *, deadline_s: float = 10.0, previous: str | None = None):
        self.socket_path = socket_path
        self.namespace = namespace
        self.fmt = fmt
        self.deadline_s = deadline_s
        self._seq = 0
        self._broken: str | None = None
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(deadline_s)
        try:
            self._sock.connect(socket_path)
        except OSError as e:
            self._sock.close()
            raise ServiceError(f"no node service listens on {socket_path} ({e.strerror or e}); start one with kvtier serve") from None
        (hello,) = self.call([hello_op(namespace, fmt.as_wire(), previous)])
        self.region: str = hello["region"]
        self.region_size: int = hello["size"]
        self.num_pages: int = hello["num_pages"]
        self.session: str = hello["session"]

    # ---- the wire --------------------------------------------------------------------------------
    def call(self, ops: list[dict]) -> list:
        """One round trip: ``ops`` in one frame, their results in order."""
        self._check()
        self._seq += 1
        deadline = time.monotonic() + self.deadline_s
        try:
            send_frame(self._sock, {"seq": self._seq, "ops": ops}, deadline)
        except ServiceError as e:  # closed on us: a refusal it sent first is the reason
            answer = self._last_words()
            if answer is None:
                raise self._break(e) from None
        else:
            try:
                answer = recv_frame(self._sock, deadline)
            except ServiceError as e:
                raise self._break(e) from None
        if "error" in answer:
            raise self._break(_refusal(answer)) from None
        results = answer.get("results")
        if answer.get("seq") != self._seq or type(results) is not list or len(results) != len(ops):
            raise self._break(ServiceProtocolError(f"the node service answered call {self._seq} out of protocol: {str(answer)[:80]}"))
        return results

    def note(self, ops: list[dict]) -> None:
        """``ops`` in one frame the service does not answer."""
        self._check()
        self._seq += 1
        try:
            send_frame(self._sock, {"seq": self._seq, "ops": ops, "note": True}, time.monotonic() + self.deadline_s)
        except ServiceError as e:
            answer = self._last_words()
            raise self._break(_refusal(answer) if answer is not None and "error" in answer else e) from None

    def _last_words(self) -> dict | None:
        """The frame a service that closed the connection sent before closing it (a refusal), if any."""
        try:
            return recv_frame(self._sock, time.monotonic() + 1.0)
        except ServiceError:
            return None

    def _check(self) -> None:
        if self._broken is not None:
            raise ServiceError(f"the connection to the node service is unusable ({self._broken}); attach a new client")

    def _break(self, error: ServiceError) -> ServiceError:
        self._broken = str(error)
        self._sock.close()
        return error

    # ---- the ops ---------------------------------------------------------------------------------
    def lookup(self, keys: list[bytes]) -> list[int]:
        return self.call([lookup_op(keys)])[0]

    def reserve(self, n: int) -> list[int]:
        return self.call([reserve_op(n)])[0]

    def publish(self, pages: list[int], keys: list[bytes]) -> None:
        self.note([publish_op(pages, keys)])

    def release(self, pages: list[int]) -> None:
        self.note([release_op(pages)])

    def status(self) -> dict:
        return self.call([STATUS_OP])[0]

    def close(self, *, quiesced: bool = True) -> None:
        """Detach. ``quiesced`` (nothing in flight touches this client's pages, and nothing will read
        them): the service releases what it holds and drops what it was writing now; otherwise it keeps
        them out of circulation until this process exits or reattaches naming :attr:`session`."""
        if self._broken is None:
            if quiesced:
                try:
                    self.note([BYE_OP])
                except ServiceError:
                    pass
            self._broken = "closed"
            self._sock.close()


def _refusal(answer: dict) -> ServiceError:
    """The typed error of the service's refusal frame."""
    err = answer["error"] if type(answer["error"]) is dict else {}
    return _ERRORS.get(err.get("type"), ServiceError)(f"the node service refused: {err.get('message', answer['error'])}")


def query_status(socket_path: str, deadline_s: float = 10.0) -> dict:
    """The service's status, asked without attaching (no namespace, no region)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(deadline_s)
    try:
        sock.connect(socket_path)
        deadline = time.monotonic() + deadline_s
        send_frame(sock, {"seq": 1, "ops": [STATUS_OP]}, deadline)
        answer = recv_frame(sock, deadline)
    except OSError as e:
        raise ServiceError(f"no node service listens on {socket_path} ({e.strerror or e})") from None
    finally:
        sock.close()
    if "error" in answer:
        raise ServiceError(f"the node service refused: {answer['error']}")
    return answer["results"][0]
