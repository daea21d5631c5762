"""kvtier's SGLang storage backend attached to the node service (``"service": ...`` in its extra config),
driven by SGLang 0.5.23's own classes on CPU (its backend factory, host pools and controller storage
methods, as in tests/test_sglang_storage.py) against a real ``kvtier serve`` subprocess on a temp socket.

Two backends attached to one service are two SGLang servers on one node: what one backs up, the other
prefetches, bit-exact, from the service's shared region. The whole stacks (SGLang's cache, its
controller threads) attached to a service run in tests/test_sglang_stack.py.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from support.service import query_status_of, running_service, start_service, stop, wait_until
from support.sglang_helpers import (
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    StorageBackendFactory,
    _mamba_pool,
    attach,
    backup,
    controller,
    dsa_indexer_pool,
    fill,
    mha_pool,
    mla_pool,
    page_bytes,
    page_keys,
    prefetch,
    storage_config,
)
from kvtier.errors import ConfigError, PageAlignmentError
from kvtier.integrations.sglang.backend import KvtierStorage

pytestmark = pytest.mark.timeout(300)

P = 4  # tokens per page in every pool below


def same_pages(src, src_idx, dst, dst_idx) -> bool:
    return all(page_bytes(src, i) == page_bytes(dst, j) for i, j in zip(src_idx[::P].tolist(), dst_idx[::P].tolist()))


def service_config(sock: str, **kw):
    return storage_config(None, service=f"unix://{sock}", **kw)


@pytest.fixture
def service(tmp_path):
    with running_service(tmp_path) as svc:
        yield svc


# ---- two servers share pages -------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_what_one_server_backs_up_another_prefetches_bit_exact(service, layout):
    src, dst = mha_pool(layout), mha_pool(layout)
    fill(src, seed=1)
    keys = page_keys(list(range(48)), P)
    src_idx = src.alloc(48)
    writer = attach(service_config(service.socket), src)
    assert backup(controller(writer, src), keys, src_idx) == 48
    reader = attach(service_config(service.socket), dst)
    dst.alloc(8)  # other slots than the writer's
    dst_idx = dst.alloc(48)
    assert prefetch(controller(reader, dst), keys, dst_idx) == 12
    assert same_pages(src, src_idx, dst, dst_idx)
    status = query_status_of(service.socket)()
    assert list(status["pages_per_namespace"].values()) == [12] and status["published_pages"] == 12
    assert status["held"] == 0 and status["writing"] == 0  # nothing held once the calls returned
    stats = reader.get_stats()
    assert (stats.pages_read, stats.faults) == (12, 0) and writer.get_stats().pages_written == 12
    # a second backup of the same pages writes nothing: the service has them
    assert writer.batch_set_v1(keys, src_idx) == [True] * 12 and writer.get_stats().pages_already_stored == 12
    assert query_status_of(service.socket)()["published_pages"] == 12


def test_dsa_page_and_its_indexer_are_one_region_page(service):
    """The indexer rides on the KV pool's page ids: the region page holds both, so the indexer comes back with
    its latent page bit-exact, and the backup SGLang makes in two calls (indexer, then KV) publishes each page once."""
    src = mla_pool()
    src_ix = dsa_indexer_pool(src)
    fill(src, seed=5)
    fill(src_ix, seed=6)
    keys = page_keys(list(range(40)), P)
    idx = src.alloc(40)
    writer = attach(service_config(service.socket, mla=True), src, (PoolName.INDEXER, src_ix))
    assert backup(controller(writer, src), keys, idx, sidecars=[PoolName.INDEXER]) == 40
    assert query_status_of(service.socket)()["published_pages"] == 10
    dst = mla_pool()
    dst_ix = dsa_indexer_pool(dst)
    reader = attach(service_config(service.socket, mla=True), dst, (PoolName.INDEXER, dst_ix))
    dst.alloc(8)
    didx = dst.alloc(40)
    assert prefetch(controller(reader, dst), keys, didx, sidecars=[PoolName.INDEXER]) == 10
    assert same_pages(src, idx, dst, didx) and same_pages(src_ix, idx, dst_ix, didx)
    hit = reader.batch_exists_v2(keys, [PoolTransfer(name=PoolName.INDEXER, keys=keys)])
    assert hit.kv_hit_pages == 10 and hit.extra_pool_hit_pages == {PoolName.KV: 10, PoolName.INDEXER: 10}
    # a server without the indexer pool has another region page: it needs a service of its own (a miss, no exception)
    assert attach(service_config(service.socket, mla=True), mla_pool()).batch_exists(keys) == 0


def test_mha_ranks_keep_their_own_shards_and_mla_is_stored_once(service):
    mha_src = mha_pool()
    fill(mha_src, seed=2)
    keys = page_keys(list(range(16)), P)
    idx = mha_src.alloc(16)
    rank0 = attach(service_config(service.socket, tp_rank=0, tp_size=2), mha_src)
    assert rank0.batch_set_v1(keys, idx) == [True] * 4
    rank1 = attach(service_config(service.socket, tp_rank=1, tp_size=2), mha_pool())
    assert rank1.batch_exists(keys) == 0  # rank 1's heads are not rank 0's
    other_model = attach(service_config(service.socket, tp_rank=0, tp_size=2, model="other"), mha_pool())
    assert other_model.batch_exists(keys) == 0
    assert rank0.batch_exists(keys) == 4
    assert query_status_of(service.socket)()["held"] == 0  # an existence query holds nothing once it returned


def test_mla_only_the_storage_writer_writes_and_every_rank_reads(tmp_path):
    with running_service(tmp_path) as svc:
        src = mla_pool()
        fill(src, seed=3)
        keys = page_keys(list(range(16)), P)
        idx = src.alloc(16)
        rank1 = attach(service_config(svc.socket, mla=True, tp_rank=1, tp_size=2), src)
        assert not rank1.writer
        assert rank1.batch_set_v1(keys, idx) == [False] * 4  # not the writer: reports what is stored (nothing)
        assert query_status_of(svc.socket)()["published_pages"] == 0
        rank0 = attach(service_config(svc.socket, mla=True, tp_rank=0, tp_size=2), src)
        assert rank0.batch_set_v1(keys, idx) == [True] * 4
        assert rank1.batch_set_v1(keys, idx) == [True] * 4 and rank1.batch_exists(keys) == 4
        status = query_status_of(svc.socket)()
        assert status["published_pages"] == 4 and len(status["pages_per_namespace"]) == 1  # one copy for both ranks


# ---- bad input ---------------------------------------------------------------------------------
def test_bad_service_options_are_config_errors_naming_the_fix(tmp_path):
    sock = str(tmp_path / "node.sock")
    with pytest.raises(ConfigError) as e:
        StorageBackendFactory.create_backend("dynamic", service_config(sock, servcie_timeout_s=1), mha_pool())
    assert "servcie_timeout_s" in str(e.value) and "service" in str(e.value) and "service_lookup_timeout_s" in str(e.value)
    for bad, match in [(dict(storage_url="file:///tmp/x"), "storage_url"), (dict(service="redis://h:1"), "socket"),
                       (dict(service=""), "socket"), (dict(service_lookup_timeout_s=20.0), "service_lookup_timeout_s"),
                       (dict(service_timeout_s=0), "service_timeout_s")]:
        cfg = service_config(sock)
        cfg.extra_config = cfg.extra_config | bad
        with pytest.raises(ConfigError, match=match):
            StorageBackendFactory.create_backend("dynamic", cfg, mha_pool())
    cfg = service_config(sock)
    del cfg.extra_config["interface_v1"]
    with pytest.raises(ConfigError, match="interface_v1"):
        StorageBackendFactory.create_backend("dynamic", cfg, mha_pool())


def test_swa_window_pages_are_an_object_pool_shared_bit_exact_and_a_prefix_hits_only_with_its_window(service):
    """SGLang's SWA host pool has page ids of its own: its pages are the region's object pool ``swa``, each under its
    page hash's key in that pool. A second server sees a prefix restorable only where its trailing window pages are
    in the service (SGLang's trailing-pages policy, as with an L3 store), and reads them back bit-exact."""
    kv, swa = mha_pool(), mha_pool(heads=1)
    fill(kv, seed=18)
    fill(swa, seed=19)
    keys = page_keys(list(range(24)), P)
    idx = kv.alloc(24)
    widx = swa.alloc(24)
    writer = attach(service_config(service.socket), kv, (PoolName.SWA, swa))
    assert writer.batch_set_v1(keys, idx) == [True] * 6
    # the window's pages only for pages 1..3: windows of two end at page 3 (prefix 3) or page 4 (prefix 4)
    assert writer.batch_set_v2([PoolTransfer(name=PoolName.SWA, host_indices=widx[P: 4 * P], keys=keys[1:4])]) == {"swa": [True] * 3}
    status = query_status_of(service.socket)()
    assert status["object_pools"] == ["swa"] and status["published_pages"] == 6 + 3 and status["held"] == 0
    kv2, swa2 = mha_pool(), mha_pool(heads=1)
    reader = attach(service_config(service.socket), kv2, (PoolName.SWA, swa2))
    window = PoolTransfer(name=PoolName.SWA, keys=keys[:2], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    hit = reader.batch_exists_v2(keys, [window])
    assert hit.restorable_prefix_pages == [3, 4] and hit.kv_hit_pages == 4 and hit.extra_pool_hit_pages["swa"] == 4
    swa2.alloc(8)  # other slots than the writer's
    into = swa2.alloc(2 * P)
    got = reader.batch_get_v2([PoolTransfer(name=PoolName.SWA, host_indices=into, keys=keys[2:4])])
    assert got == {"swa": [True, True]} and same_pages(swa, widx[2 * P: 4 * P], swa2, into)
    # a window page the service does not have ends the read there; nothing is written into its slot
    more = swa2.alloc(2 * P)
    assert reader.batch_get_v2([PoolTransfer(name=PoolName.SWA, host_indices=more, keys=[keys[3], keys[4]])]) == {"swa": [True, False]}
    assert not swa2.get_data_page(more[P].item()).any()
    # a second backup writes nothing: the service has every page asked
    assert writer.batch_set_v2([PoolTransfer(name=PoolName.SWA, host_indices=widx[P: 4 * P], keys=keys[1:4])]) == {"swa": [True] * 3}
    assert writer.get_stats().pages_already_stored >= 3 and query_status_of(service.socket)()["published_pages"] == 9
    assert query_status_of(service.socket)()["held"] == 0


def test_mamba_state_pages_are_an_object_pool_read_back_bit_exact_into_the_requests_slot(service):
    """SGLang's Mamba host pool (its pages are copies: kvtier copies them in and out whole) on the service: a state saved
    by one server comes back bit-exact into another's slot, and nothing else of that pool is written."""
    kv_src, mamba_src = mha_pool(), _mamba_pool(seed=41)
    fill(kv_src, seed=40)
    keys = page_keys(list(range(12)), P)
    writer = attach(service_config(service.socket), kv_src, (PoolName.MAMBA, mamba_src))
    assert writer.batch_set_v1(keys, kv_src.alloc(12)) == [True] * 3
    slots = torch.tensor([3, 7, 11])
    assert writer.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=slots, keys=keys)]) == {"mamba": [True] * 3}
    mamba_dst = _mamba_pool()
    reader = attach(service_config(service.socket), mha_pool(), (PoolName.MAMBA, mamba_dst))
    last = PoolTransfer(name=PoolName.MAMBA, keys=keys[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    assert reader.batch_exists_v2(keys, [last]).restorable_prefix_pages == [1, 2, 3]
    into = torch.tensor([0, 5, 16])
    assert reader.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=into, keys=keys)]) == {"mamba": [True] * 3}
    for s, d in zip(slots.tolist(), into.tolist()):
        assert torch.equal(mamba_dst.get_data_page(d), mamba_src.get_data_page(s)), f"state slot {s} -> {d} differs"
    assert all(not mamba_dst.get_data_page(i).any() for i in range(mamba_dst.size) if i not in into.tolist())
    status = query_status_of(service.socket)()
    assert status["object_pools"] == ["mamba"] and (status["held"], status["writing"]) == (0, 0)


def test_an_object_pools_name_that_is_not_its_keys_is_a_protocol_error(service):
    """An object pool's key is its name's group key: a publish or find naming another object than its key is refused
    (the connection), before anything is indexed."""
    from kvtier.errors import ServiceError
    from kvtier.hashing import name_key

    swa = mha_pool(heads=1)
    backend = attach(service_config(service.socket), mha_pool(), (PoolName.SWA, swa))
    pages = backend._service()
    client = pages._session().client
    fmt = pages.format
    got = client.reserve(1, 1)
    with pytest.raises(ServiceError, match="is not the one its key"):
        client.publish_and_release(got, [name_key("a")], ["a"])  # (the page's key, not the object pool's)
        client.lookup([name_key("a")])  # (a publish is not answered: the refusal comes with the next call)
    client = pages._session().client
    with pytest.raises(ServiceError, match="is not the one its key"):
        client.find([fmt.key_of(1, "a")], 1, ["b"])
    assert query_status_of(service.socket)()["published_pages"] == 0


def test_a_pool_registered_after_the_region_page_was_fixed_is_refused(service):
    late = attach(service_config(service.socket), mha_pool())
    with pytest.raises(ConfigError, match="registered after"):
        late.register_mem_host_pool_v2(_mamba_pool(), PoolName.MAMBA)


def test_partial_pages_are_refused_before_anything_reaches_the_service(service):
    src = mha_pool()
    fill(src, seed=4)
    backend = attach(service_config(service.socket), src)
    idx = src.alloc(16)
    with pytest.raises(PageAlignmentError):
        backend.batch_set_v1(page_keys(list(range(16)), P), idx[:14])
    with pytest.raises(PageAlignmentError):
        backend.batch_get_v1(page_keys(list(range(16)), P), idx[1:13])
    with pytest.raises(ConfigError, match="interface_v1"):
        backend.batch_set(page_keys(list(range(4)), P), [src.get_data_page(0, flat=True)])
    status = query_status_of(service.socket)()
    assert status["published_pages"] == 0 and status["writing"] == 0 and status["held"] == 0


# ---- faults are misses -------------------------------------------------------------------------
def test_a_killed_service_gives_misses_and_a_restarted_one_is_attached_again(tmp_path):
    sock = str(tmp_path / "run" / "node.sock")
    src = mha_pool()
    fill(src, seed=8)
    keys = page_keys(list(range(32)), P)
    idx = src.alloc(32)
    svc = start_service(sock)
    try:
        backend = attach(service_config(sock), src)
        assert backend.batch_set_v1(keys[:4], idx[:16]) == [True] * 4
        os.kill(svc.proc.pid, signal.SIGKILL)
        svc.proc.wait(30)
        start = time.monotonic()
        assert backend.batch_exists(keys) == 0
        assert backend.batch_get_v1(keys[:4], idx[16:32]) == [False] * 4
        assert backend.batch_set_v1(keys[4:], idx[16:]) == [False] * 4
        assert time.monotonic() - start < 5.0  # misses at once: nothing waits on a dead service
        assert backend.get_stats().faults >= 1
        svc = start_service(sock)  # (it adopts the killed one's region)
        stored, _took = wait_until(lambda: (lambda r: r if r[0] else None)(backend.batch_set_v1(keys[4:], idx[16:])), 30)
        assert stored == [True] * 4 and backend.service.reattaches >= 1
        dst = mha_pool()
        dst_idx = dst.alloc(16)
        reader = attach(service_config(sock), dst)
        assert reader.batch_get_v1(keys[4:], dst_idx) == [True] * 4
        assert same_pages(src, idx[16:], dst, dst_idx)
    finally:
        stop(svc.proc)


def test_a_stopped_service_costs_a_call_at_most_its_deadline_then_misses(service):
    src = mha_pool()
    fill(src, seed=9)
    keys = page_keys(list(range(16)), P)
    idx = src.alloc(16)
    backend = attach(service_config(service.socket), src)  # the default lookup deadline: 0.25 s
    assert backend.batch_set_v1(keys, idx) == [True] * 4
    os.kill(service.proc.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        assert backend.batch_get_v1(keys, idx) == [False] * 4
        assert backend.batch_exists(keys) == 0 and backend.batch_set_v1(keys, idx) == [False] * 4
        time.sleep(0.3)  # past the first backoff step: the next call tries to attach again, within the lookup deadline
        assert backend.batch_exists(keys) == 0 and backend.batch_get_v1(keys, idx) == [False] * 4
        assert time.monotonic() - start < 2.0
    finally:
        os.kill(service.proc.pid, signal.SIGCONT)
    hits, _took = wait_until(lambda: backend.batch_exists(keys), 30)
    assert hits == 4  # the same service: its pages are still there
    again = src.alloc(16)  # read back into other slots of the same pool
    assert backend.batch_get_v1(keys, again) == [True] * 4 and same_pages(src, idx, src, again)
    # the dropped session's holds ended when it attached again: nothing is held now
    wait_until(lambda: query_status_of(service.socket)()["orphaned"] == 0, 10)
    assert query_status_of(service.socket)()["held"] == 0


def test_no_service_listening_at_start_is_misses_not_an_error(tmp_path):
    src = mha_pool()
    backend = attach(service_config(str(tmp_path / "none.sock")), src)
    keys = page_keys(list(range(8)), P)
    assert backend.batch_exists(keys) == 0 and backend.batch_set_v1(keys, src.alloc(8)) == [False] * 2
    assert isinstance(backend, KvtierStorage) and torch.is_tensor(src.kv_buffer)


# ---- found by a review: object pools beside SGLang's rows --------------------------------------------------------
def test_swa_and_mamba_beside_kv_two_object_pools_of_other_row_sizes_read_back_bit_exact(tmp_path):
    from support.sglang_helpers import PoolName, PoolTransfer, _mamba_pool, attach, fill, mha_pool, page_bytes, page_keys, storage_config

    P = 4
    with running_service(tmp_path) as svc:
        def cfg():
            return storage_config(None, service=f"unix://{svc.socket}")
        kv, swa, mamba = mha_pool(), mha_pool(heads=1, head_dim=4), _mamba_pool(seed=7)
        fill(kv, seed=5)
        fill(swa, seed=6)
        keys = page_keys(list(range(12)), P)
        writer = attach(cfg(), kv, (PoolName.SWA, swa), (PoolName.MAMBA, mamba))
        assert writer._service().format.objects[0].row_bytes != writer._service().format.objects[1].row_bytes
        assert writer.batch_set_v1(keys, kv.alloc(12)) == [True] * 3
        widx = swa.alloc(12)
        slots = torch.tensor([2, 4, 6])
        assert writer.batch_set_v2([PoolTransfer(name=PoolName.SWA, host_indices=widx, keys=keys),
                                    PoolTransfer(name=PoolName.MAMBA, host_indices=slots, keys=keys)]) == \
            {"swa": [True] * 3, "mamba": [True] * 3}
        kv2, swa2, mamba2 = mha_pool(), mha_pool(heads=1, head_dim=4), _mamba_pool()
        reader = attach(cfg(), kv2, (PoolName.SWA, swa2), (PoolName.MAMBA, mamba2))
        swa2.alloc(8)
        into_swa, into_m = swa2.alloc(12), torch.tensor([1, 3, 5])
        got = reader.batch_get_v2([PoolTransfer(name=PoolName.SWA, host_indices=into_swa, keys=keys),
                                   PoolTransfer(name=PoolName.MAMBA, host_indices=into_m, keys=keys)])
        assert got == {"swa": [True] * 3, "mamba": [True] * 3}
        assert all(page_bytes(swa, i) == page_bytes(swa2, j) for i, j in zip(widx[::P].tolist(), into_swa[::P].tolist()))
        assert all(torch.equal(mamba.get_data_page(s), mamba2.get_data_page(d)) for s, d in zip(slots.tolist(), into_m.tolist()))
        # a find whose keys are absent (-1s), and one of a pool's names never written: nothing held after
        assert reader.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([7]),
                                                 keys=page_keys(list(range(100, 104)), P))]) == {"mamba": [False]}
        st = query_status_of(svc.socket)()
        assert (st["held"], st["writing"]) == (0, 0) and st["object_pools"] == ["swa", "mamba"]


def test_mamba_state_beside_mla_at_tp2_is_each_ranks_own_in_one_region_beside_the_latent_stored_once(tmp_path):
    """MLA's latent is the same on both ranks (SGLang's storage writer, rank 0, writes it once); each rank's Mamba state is
    its own, published in that rank's namespace: each rank reads back its own state bit-exact, never the other's."""
    P = 4
    keys = page_keys(list(range(16)), P)
    with running_service(tmp_path) as svc:
        latent = mla_pool()
        fill(latent, seed=52)
        idx = latent.alloc(16)
        states = [_mamba_pool(seed=50 + r) for r in range(2)]
        ranks = [attach(service_config(svc.socket, tp_rank=r, tp_size=2, mla=True), latent, (PoolName.MAMBA, states[r])) for r in range(2)]
        assert [sorted(b.own_services) for b in ranks] == [[], [1]]  # (rank 0's state is in the KV pool's namespace)
        assert [b.batch_set_v1(keys, idx) for b in ranks] == [[True] * 4] * 2  # (rank 1 finds rank 0's latent stored)
        for b in ranks:
            assert b.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([2]), keys=keys[-1:])]) == {"mamba": [True]}
        status = query_status_of(svc.socket)()
        assert sorted(status["pages_per_namespace"].values()) == [1, 4 + 1]  # the latent once; a state per rank
        for r in range(2):
            back = _mamba_pool()
            reader = attach(service_config(svc.socket, tp_rank=r, tp_size=2, mla=True), mla_pool(), (PoolName.MAMBA, back))
            last = PoolTransfer(name=PoolName.MAMBA, keys=keys[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES)
            assert reader.batch_exists_v2(keys, [last]).restorable_prefix_pages == [4]
            assert reader.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([4]), keys=keys[-1:])]) == \
                {"mamba": [True]}
            assert torch.equal(back.get_data_page(4), states[r].get_data_page(2)), f"rank {r} read another rank's state"
            assert not torch.equal(back.get_data_page(4), states[1 - r].get_data_page(2))
            reader.close()
        assert query_status_of(svc.socket)()["held"] == 0


def test_a_backup_of_more_window_pages_than_the_object_pool_holds_leaves_nothing_held(tmp_path):
    from support.sglang_helpers import PoolName, PoolTransfer, attach, fill, mha_pool, page_keys, storage_config

    P = 4
    with running_service(tmp_path, 0.00004) as svc:
        kv, swa = mha_pool(), mha_pool(heads=1, device_tokens=512)
        fill(kv, seed=1)
        fill(swa, seed=2)
        writer = attach(storage_config(None, service=f"unix://{svc.socket}"), kv, (PoolName.SWA, swa))
        n = writer._service()._session().client.num_pages
        pages = min(2 * n, swa.size // P - 1)
        assert pages > n, (pages, n)
        keys = page_keys(list(range(pages * P)), P)
        done = writer.batch_set_v2([PoolTransfer(name=PoolName.SWA, host_indices=swa.alloc(pages * P), keys=keys)])["swa"]
        assert sum(done) == n and done == [True] * n + [False] * (pages - n), (n, done)
        st = query_status_of(svc.socket)()
        assert (st["held"], st["writing"]) == (0, 0)


def test_more_own_pools_than_a_region_holds_are_a_config_error_at_registration(tmp_path):
    """A hello's format holds at most MAX_OBJECT_POOLS (8) object pools: an SGLang model with 9 pools of page ids of their
    own is a ConfigError naming the ninth when it registers (it attached before, then every hello was refused: misses)."""
    from kvtier.errors import ConfigError
    from support.sglang_helpers import PoolName, StorageBackendFactory, mha_pool, storage_config

    names = [PoolName.SWA, PoolName.MAMBA, PoolName.AUXILIARY_SWA, PoolName.DRAFT_SWA, PoolName.DEEPSEEK_V4_C4_STATE,
             PoolName.DEEPSEEK_V4_C128_STATE, PoolName.DEEPSEEK_V4_C4_INDEXER_STATE, PoolName.DEEPSEEK_V4_C128,
             PoolName.DEEPSEEK_V4_C4]
    with running_service(tmp_path) as svc:
        kv = mha_pool()
        backend = StorageBackendFactory.create_backend("dynamic", storage_config(None, service=f"unix://{svc.socket}"), kv)
        backend.register_mem_pool_host(kv)
        pools = {}
        try:
            for name in names:
                pools[name] = mha_pool(heads=1)
                backend.register_mem_host_pool_v2(pools[name], name)
            backend.on_host_pools_registered()
        except ConfigError as e:
            assert "deepseek_v4_c4" in str(e).lower() and "at most 8" in str(e), e  # the ninth, named
            assert list(pools) == names  # (every pool was offered; the ninth refused)
            return
        pytest.fail("9 own pools registered without a ConfigError")


def test_at_tp2_a_rank_never_reads_another_ranks_window_page(tmp_path):
    from support.sglang_helpers import PoolName, PoolTransfer, attach, fill, mha_pool, page_keys, storage_config

    with running_service(tmp_path) as svc:
        def cfg(r):
            return storage_config(None, service=f"unix://{svc.socket}", tp_rank=r, tp_size=2)
        kv0, swa0 = mha_pool(), mha_pool(heads=1)
        fill(kv0, seed=1)
        fill(swa0, seed=2)
        keys = page_keys(list(range(8)), 4)
        rank0 = attach(cfg(0), kv0, (PoolName.SWA, swa0))
        assert rank0.batch_set_v2([PoolTransfer(name=PoolName.SWA, host_indices=swa0.alloc(8), keys=keys)]) == {"swa": [True, True]}
        kv1, swa1 = mha_pool(), mha_pool(heads=1)
        rank1 = attach(cfg(1), kv1, (PoolName.SWA, swa1))
        into = swa1.alloc(8)
        assert rank1.batch_get_v2([PoolTransfer(name=PoolName.SWA, host_indices=into, keys=keys)]) == {"swa": [False, False]}
        assert not any(swa1.get_data_page(i).any() for i in into[::4].tolist())
        st = query_status_of(svc.socket)()
        assert (st["held"], st["writing"]) == (0, 0)
