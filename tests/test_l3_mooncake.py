"""L3 over a real Mooncake Store: a mooncake_master started on 127.0.0.1, clients pinned to loopback over TCP."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from cache_helpers import make_tiered_cache, serve, serve_tiered
from kvtier.devservers import MooncakeMaster, wait_until
import l3_scenarios as sc

pytestmark = pytest.mark.integration


@pytest.fixture
def master():
    m = MooncakeMaster().start()
    yield m
    m.stop()


def overwrite_mooncake_byte(backend, key, offset):
    """Read the object, flip a byte, write it back (upsert) through the same client."""
    size = backend.store.get_size(key)
    buf = memoryview(bytearray(size))
    assert backend.get([key], [buf])[0].value == "ok"
    buf[offset] ^= 0xFF
    backend.store.remove(key, True)
    arr = np.frombuffer(buf, dtype=np.uint8).copy()
    assert backend.store.put(key, arr.tobytes()) == 0


@pytest.mark.parametrize("spec_name", ["deepseek-v3.2", "llama-3.1-8b"])
def test_round_trip_bit_exact(master, spec_name):
    sc.round_trip(master.url, sc.real_specs()[spec_name])


def test_namespace_isolation(master):
    sc.namespace_isolation(master.url)


def test_corrupted_page_is_a_miss(master):
    sc.corrupted_page_is_a_miss(master.url, overwrite_mooncake_byte)


def test_wrong_header_is_a_miss(master):
    sc.wrong_header_is_a_miss(master.url, overwrite_mooncake_byte)


def test_master_killed_mid_run_then_restarted(master):
    spec = sc.tiny()
    cache = make_tiered_cache(spec, 6, 16, master.url, model="fault")
    before = [list(range(i * 100, i * 100 + 16)) for i in range(3)]
    for toks in before:
        serve(cache, toks)
    cache.wait_idle()
    assert cache.stats.storage_saved_pages == 12
    master.kill()
    for toks in [list(range(i * 100, i * 100 + 16)) for i in range(3, 9)]:
        serve(cache, toks)
    for toks in before:
        d, h, s, c = serve_tiered(cache, toks)
        assert s == 0
    cache.wait_idle()
    assert cache.stats.storage_failures > 0
    cache.check_integrity()
    master.start()  # same ports: the client re-mounts its segment and the tier resumes
    fresh = list(range(5000, 5016))

    def saved_again() -> bool:
        cache.evict_device(6)
        cache.evict_host(16)
        serve(cache, fresh)
        cache.wait_idle()
        m = cache.match(fresh)
        return m.num_device_pages == 4 and cache.stats.storage_saved_pages > 12

    wait_until(saved_again, timeout=20, what="Mooncake saves to resume after the master restart")
    cache.evict_device(6)
    cache.evict_host(16)
    d, h, s, c = serve_tiered(cache, fresh)
    assert (s, c) == (4, 0), (d, h, s, c)
    cache.wait_idle()
    cache.check_integrity()
    cache.close()
