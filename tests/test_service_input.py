"""What a peer or an operator hands ``kvtier serve`` (issue 53, item 5): a namespace that is not text, JSON
nested past the parser's stack, a second hello on one connection, a salted namespace in ``--status``,
socket paths the kernel cannot bind, and the region file removed or truncated under a running service.
Each gets a typed error (one line and exit 2 on the command line) and the service serves on. Every wait
is bounded."""

from __future__ import annotations

import os
import re
import urllib.request

import pytest
from support.service import closed_by_peer, raw_connection, raw_frame, read_answer, running_service, wait_until
from support.service_peer import SPEC

from kvtier.errors import ServiceError
from kvtier.service.client import ServiceClient, query_status
from kvtier.service.region import RegionFormat
from kvtier.service.wire import encode

pytestmark = pytest.mark.timeout(300)

FMT = RegionFormat.of(SPEC, "page_first")


def _ops(s, seq: int, *ops: dict) -> dict:
    s.sendall(encode({"seq": seq, "ops": list(ops)}))
    return read_answer(s)


def _hello(namespace: str) -> dict:
    """A hello as a peer writes it by hand (raw JSON: what any process on the node may send)."""
    return {"op": "hello", "version": 1, "namespace": namespace, "format": FMT.as_wire()}


def test_a_namespace_that_is_not_text_is_refused_at_hello_and_metrics_keep_answering(tmp_path):
    with running_service(tmp_path, 0.01, "--metrics-port", "0") as svc:
        url = re.search(r"metrics on (http://\S+)", svc.banner).group(1)
        s = raw_connection(svc.socket)
        try:
            # a lone surrogate: valid JSON ("\ud800"), but no UTF-8 text (a label, a log line) can hold it
            answer = _ops(s, 1, _hello("model-fp-tp0-\ud800"))
            assert answer["error"]["type"] == "ServiceProtocolError" and "not valid UTF-8 text" in answer["error"]["message"]
            assert closed_by_peer(s)
        finally:
            s.close()
        with urllib.request.urlopen(url, timeout=10) as r:  # (before: every scrape answered HTTP 500 from then on)
            assert r.status == 200 and b"kvtier_service_clients" in r.read()


def test_json_nested_past_the_parsers_stack_gets_a_typed_error_frame(tmp_path):
    with running_service(tmp_path) as svc:
        s = raw_connection(svc.socket)
        try:
            s.sendall(raw_frame(b"[" * 200_000 + b"]" * 200_000))
            answer = read_answer(s)
            assert answer is not None and answer["error"]["type"] == "ServiceProtocolError", answer
            assert "nests too deep" in answer["error"]["message"]
        finally:
            s.close()
        assert query_status(svc.socket)["protocol_errors"] == 1  # and it serves on
    # the service's log says when, and how bad: a timestamped line, not the bare message of Python's last resort
    log = svc.proc.stderr.read()
    stamp = r"^WARNING \d\d-\d\d \d\d:\d\d:\d\d\.\d{3} \[kvtier\.service\.connections\] "
    assert re.search(stamp + r"client \d+: ServiceProtocolError: a frame's JSON nests too deep", log, re.M), log


def test_a_connection_attaches_once_a_hello_after_hello_or_bye_is_refused(tmp_path):
    with running_service(tmp_path) as svc:
        for first in ([_hello("a")], [_hello("a"), {"op": "bye"}]):
            s = raw_connection(svc.socket)
            try:
                assert "results" in _ops(s, 1, *first)
                answer = _ops(s, 2, _hello("b"), {"op": "reserve", "n": 1})
                assert answer["error"]["type"] == "ServiceProtocolError" and "a connection attaches once" in answer["error"]["message"]
                assert closed_by_peer(s)
            finally:
                s.close()
        st = query_status(svc.socket)
        assert st["clients"] == 0 and "b" not in st["pages_per_namespace"]


def test_status_shows_namespaces_decoded_a_salt_as_a_digest_and_its_page_counts_add_up(tmp_path):
    with running_service(tmp_path) as svc:
        # a Namespace's string: fields percent-encoded ("-" inside the model's name is %2D), the salt last
        client = ServiceClient(svc.socket, "smollm2%2D135m-abcd1234-tp0-hunter2", FMT)
        other = ServiceClient(svc.socket, "smollm2%2D135m-abcd1234-tp0-hunter2", FMT)
        try:
            pages = client.reserve(1)
            client.publish(pages, [b"\x05" * 16])
            again = other.reserve(1)  # the same page written again by another engine: held by it, offered to nobody
            other.publish(again, [b"\x05" * 16])
            st, _ = wait_until(lambda: (s := client.status())["ready"] == 2 and s, 10)
            (label,) = st["pages_per_namespace"]
            assert "hunter2" not in label and re.fullmatch(r"smollm2-135m-abcd1234-tp0-#[0-9a-f]{8}", label), label
            assert st["pages_per_namespace"][label] == 1 and st["duplicates"] == 1  # ready == published + duplicates
        finally:
            client.close()
            other.close()


def test_socket_paths_the_kernel_cannot_bind_are_one_line_and_exit_2(tmp_path):
    from support.cli import kvtier

    too_long = str(tmp_path / ("d" * 60) / ("s" * 60 + ".sock"))
    for argv, text in [
        (["serve", "--host-gb", "0.01", "--socket", too_long], "a Unix socket's path holds at most 107 bytes"),
        (["serve", "--host-gb", "0.01", "--socket", ""], "--socket) must be a path; got ''"),
    ]:
        r = kvtier(*argv, timeout=120)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and text in lines[0] and "Traceback" not in r.stderr, (argv, r.stderr)


@pytest.mark.parametrize("damage", ["removed", "truncated"])
def test_a_region_removed_or_truncated_under_the_service_is_noticed_and_new_engines_get_a_typed_error(tmp_path, damage):
    with running_service(tmp_path) as svc:
        first = ServiceClient(svc.socket, "a", FMT)
        try:
            if damage == "removed":
                os.unlink(first.region)
            else:
                os.truncate(first.region, first.region_size // 2)
            st, _ = wait_until(lambda: (s := first.status()).get("region_problem") and s, 10)
            assert ("removed" if damage == "removed" else "truncated") in st["region_problem"]
            said = "was removed" if damage == "removed" else "is .* bytes"
            with pytest.raises(ServiceError, match=f"region .* {said}.*restart kvtier serve"):
                ServiceClient(svc.socket, "a", FMT)
            assert first.status()["clients"] == 1  # the service serves on (its attached engine keeps its mapping)
        finally:
            first.close()
