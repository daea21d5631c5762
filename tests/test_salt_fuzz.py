"""Hostile salts against every store's save, exists and load, and against the node service's hello and lookup (issue 56,
item 5). A salt is text a client sends (vLLM's connector ``salt``, SGLang's ``salt``, a namespace a hello carries): it
is either refused as a typed error that names the field (a control character, more than 200 bytes of UTF-8, a lone
surrogate), or it scopes its own objects -- found under that salt alone, never under another, stored under the
store's root -- and a service keeps serving every other client whatever namespace one hello carries."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.app.devservers import RedisServer
from kvtier.errors import ConfigError, ServiceError
from kvtier.hashing import MAX_FIELD_BYTES, Namespace, page_keys
from kvtier.l3 import open_backend
from kvtier.l3.base import KeyStatus
from kvtier.l3.tier import StorageTier
from kvtier.pools import HostPool
from kvtier.spec import KVSpec
from support.service import running_service

SPEC = KVSpec.mha("fuzz", num_layers=2, kv_heads=1, head_dim=8, page_size=4, dtype="float32")
#: salts a hostile client would try: paths, separators of the namespace's encoding, percent escapes, Unicode look-alikes,
#: control characters, lone surrogates, the byte limit's edges
HOSTILE = ["", "-", "--", "/", "../..", "..", "%2D", "%", "a-b", "a%2Db", "tp0", "-tp0", "\x00", "a\nb", "\x7f", "\ud800",
           "é", "e\u0301", "ＡＢ", "a/../b", "~", " ", "x" * MAX_FIELD_BYTES, "x" * (MAX_FIELD_BYTES + 1), "é" * 100, "é" * 101]
SALTS = st.one_of(st.sampled_from(HOSTILE), st.text(max_size=40), st.text(min_size=95, max_size=110))
_EXAMPLES = itertools.count(1)
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _namespace(salt: str) -> Namespace | None:
    """The namespace of ``salt``, or None where it is refused -- refused only for what the rules say, naming the salt."""
    try:
        return Namespace("fuzz-model", SPEC.fingerprint(), 0, salt)
    except ConfigError as e:
        raw = salt.encode("utf-8", "surrogatepass")
        bad = any(ord(c) < 32 or ord(c) == 127 for c in salt) or len(raw) > MAX_FIELD_BYTES or any(0xD800 <= ord(c) < 0xE000 for c in salt)
        assert bad and "salt" in str(e), (salt, e)
        return None


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server.url
    server.stop()


def _store_url(kind: str, tmp: Path, request) -> str:
    return f"file://{tmp / 'store'}" if kind == "file" else request.getfixturevalue("redis_url")


@pytest.mark.parametrize("kind", ["file", pytest.param("redis", marks=pytest.mark.integration)])
@SETTINGS
@given(a=SALTS, b=SALTS)
def test_a_salt_scopes_its_objects_in_every_store_or_is_a_typed_error(kind, a, b, request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("salts")
    url = _store_url(kind, tmp, request)
    ns_a, ns_b = _namespace(a), _namespace(b)
    if ns_a is None or ns_b is None:
        return
    assert (ns_a == ns_b) == (a == b) and (str(ns_a) == str(ns_b)) == (a == b)
    host = HostPool(SPEC, 4, "page_first")
    g = torch.Generator().manual_seed(len(a) * 31 + len(b))
    for t in host.buffers.values():
        t.view(torch.uint8).copy_(torch.randint(0, 255, t.view(torch.uint8).shape, dtype=torch.uint8, generator=g))
    want = [host.page_bytes(0), host.page_bytes(1)]
    tier_a, tier_b = StorageTier(open_backend(url), host, ns_a), StorageTier(open_backend(url), host, ns_b)
    try:
        first = next(_EXAMPLES) * 1000  # (new keys per example: a store that outlives an example holds the ones before)
        keys = page_keys(list(range(first, first + 2 * SPEC.page_size)), SPEC.page_size, ns_a.root())  # (asked under both salts)
        job = tier_a.submit("save", keys, [0, 1])
        assert job is not None and job.wait(30) and job.statuses == [KeyStatus.OK] * 2, job
        assert tier_a.stored_prefix(keys) == 2
        assert tier_b.stored_prefix(keys) == (2 if a == b else 0), (a, b)  # another salt never finds them
        load = tier_a.submit("prefetch", keys, [2, 3])
        assert load is not None and load.wait(30) and load.statuses == [KeyStatus.OK] * 2, load
        assert [host.page_bytes(2), host.page_bytes(3)] == want  # (bit-exact, under its own salt)
        if kind == "file":  # every object under the store's root, nothing beside it
            root = tmp / "store"
            assert all(p == root or root in p.parents for p in tmp.rglob("*")), sorted(map(str, tmp.rglob("*")))
            assert all(Path(os.path.realpath(p)).is_relative_to(root) for p in root.rglob("*"))
    finally:
        tier_a.close()
        tier_b.close()


@SETTINGS
@given(salt=SALTS)
def test_a_services_hello_with_any_salt_attaches_under_it_or_is_refused_and_the_service_serves_on(salt, service):
    """A hello's namespace with the salt as a client would send it (encoded as kvtier encodes it, or raw where kvtier
    would have refused it): attached under it, its lookups a miss in an empty region, or refused as a typed error --
    and the service answers the next client."""
    from kvtier.service.client import ServiceClient, query_status
    from kvtier.service.region import RegionFormat

    fmt = RegionFormat.of(SPEC, "page_first")
    ns = _namespace(salt)
    text = str(ns) if ns is not None else f"fuzz%2Dmodel-{SPEC.fingerprint()}-tp0-{salt}"
    control = any(ord(c) < 32 or 127 <= ord(c) < 160 for c in text)
    try:
        client = ServiceClient(service, text, fmt, deadline_s=5.0)
    except (ServiceError, ConfigError) as e:
        assert ns is None, (salt, e)  # (a namespace kvtier makes is never refused)
        assert not control or "control character" in str(e), (salt, e)
    else:
        try:
            # (to the service a namespace is opaque, bounded text: only control characters and lone surrogates are refused)
            assert not control, salt
            keys = page_keys(list(range(3 * SPEC.page_size)), SPEC.page_size, (ns or Namespace("x", "y")).root())
            assert client.lookup(keys) == []
        finally:
            client.close()
    status = query_status(service, deadline_s=5.0)  # (still answering, and what it shows of a namespace is printable)
    assert all(label.isprintable() for label in status.get("pages_per_namespace", {}))


def test_a_namespace_label_never_shows_a_control_character_a_client_encoded():
    from kvtier.service.metrics import namespace_label

    assert namespace_label("m%0Aforged%20line-fp-tp0-salt") == "m%0Aforged%20line-fp-tp0-#" + namespace_label("a-b-c-salt")[-8:]
    assert namespace_label("%E2%80%AEevil-fp-tp0") == "%E2%80%AEevil-fp-tp0"  # (a bidi override: shown encoded)
    assert namespace_label("smollm2%2D135m-fp-tp1") == "smollm2-135m-fp-tp1"  # (printable: decoded, as before)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    with running_service(tmp_path_factory.mktemp("svc")) as svc:
        yield svc.socket
