"""SGLang's storage backend on a node service with an L3 tier (``kvtier serve --storage-url``), driven by SGLang
0.5.23's own classes on CPU (its backend factory, host pools and controller storage methods) against a real
``kvtier serve`` subprocess: the service stores and finds the very objects the backend's own L3 writes
(``namespace/<SGLang's page hash>``, the pool's header and bytes), both ways, per rank of a tensor-parallel
MHA model and once for an MLA model's latent with its DSA indexer.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal

import pytest

from support.service import query_status_of, raw_connection, read_answer, running_service, start_service, stop, store_files, wait_until
from support.sglang_helpers import (
    PoolName,
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
from kvtier.errors import ServiceError
from kvtier.hashing import Namespace, name_key
from kvtier.service.client import ServiceClient
from kvtier.service.messages import MAX_OBJECT_NAME
from kvtier.service.region import ObjectPool, RegionFormat, RowObject
from kvtier.service.wire import encode

pytestmark = pytest.mark.timeout(300)

P = 4  # tokens per page in every pool below
TOKENS = list(range(48))
PAGES = len(TOKENS) // P
KEYS = page_keys(TOKENS, P)


def _ranks(kind: str) -> list[dict]:
    """Each rank's pools (filled: the ranks' bytes differ for MHA, where each holds its own heads; MLA's latent and
    indexer are the same on every rank) and its storage options."""
    ranks = []
    for r in range(2):
        if kind == "mha":
            pool, sidecars, opts = mha_pool(), (), {}
            fill(pool, seed=10 + r)
        else:
            pool = mla_pool()
            sidecars, opts = ((PoolName.INDEXER, dsa_indexer_pool(pool)),), {"mla": True}
            fill(pool, seed=10)
            fill(sidecars[0][1], seed=11)
        ranks.append({"pool": pool, "sidecars": sidecars, "opts": {"tp_rank": r, "tp_size": 2, **opts}, "idx": pool.alloc(len(TOKENS))})
    return ranks


def _back_up(url: str | None, rank: dict, **options) -> int:
    """Rank ``rank``'s pages backed up, as SGLang's controller does, to a backend of ``url`` (None: the service
    ``options`` name); the pages it backed up."""
    backend = attach(storage_config(url, **rank["opts"], **options), rank["pool"], *rank["sidecars"])
    try:
        return backup(controller(backend, rank["pool"]), KEYS, rank["idx"], sidecars=[n for n, _ in rank["sidecars"]]) // P
    finally:
        backend.close()


def _read_back(url: str | None, rank: dict, fresh: dict, **options) -> int:
    """Pages brought into ``fresh``'s pools (a rank's new pools) from a backend of ``url`` (or the service), checked bit-exact
    against ``rank``'s: how many came."""
    pool, sidecars = fresh["pool"], fresh["sidecars"]
    backend = attach(storage_config(url, **rank["opts"], **options), pool, *sidecars)
    try:
        pool.alloc(8)  # other slots than the writer's
        idx = pool.alloc(len(TOKENS))
        got = prefetch(controller(backend, pool), KEYS, idx, sidecars=[n for n, _ in sidecars])
        for (_n, src), (_m, dst) in zip(((None, rank["pool"]), *rank["sidecars"]), ((None, pool), *sidecars)):
            assert [page_bytes(dst, i) for i in idx[::P][:got].tolist()] == [page_bytes(src, i) for i in rank["idx"][::P][:got].tolist()]
        return got
    finally:
        backend.close()


@pytest.mark.parametrize("kind", ["mha", "dsa"])
def test_the_service_stores_and_finds_the_objects_sglangs_own_l3_writes(tmp_path, kind):
    """Rank 0 and 1 of a TP=2 server attached to a service with file L3 back up their pages; the service saves them
    (SIGTERM drains the saves) as exactly the files the backend's own file L3 writes of the same pages -- one object
    per rank and page for MHA, one per page and pool (latent, indexer) for MLA+DSA, written by SGLang's storage writer
    only. Then each way round: the backend's own L3 reads what the service saved, and a service over what the
    backend's own L3 saved brings it into its region for an attached server: every page, bit-exact."""
    sock = str(tmp_path / "run" / "node.sock")
    via_service, own = tmp_path / "l3-service", tmp_path / "l3-own"
    service = {"service": f"unix://{sock}", "service_lookup_timeout_s": 4.0}  # (a lookup may wait up to 2 s for L3)
    ranks = _ranks(kind)
    svc = start_service(sock, 0.01, "--storage-url", f"file://{via_service}", "--drain-timeout-s", "30")
    try:
        backed_up = [_back_up(None, rank, **service) for rank in ranks]
        status = query_status_of(sock)()
    finally:
        assert stop(svc.proc) == 0  # SIGTERM: its saves drain first
    # (MLA: rank 1 is not SGLang's storage writer: it finds rank 0's pages stored, and writes none)
    assert backed_up == [PAGES, PAGES] and status["published_pages"] == (2 if kind == "mha" else 1) * PAGES
    assert status["l3"]["save_failed_pages"] == 0
    for rank in ranks:
        _back_up(f"file://{own}", rank)
    written = store_files(own)
    assert len(written) == 2 * PAGES  # MHA: a page per rank; MLA+DSA: a latent page and an indexer page
    assert store_files(via_service) == written
    for r, rank in enumerate(ranks):  # the service's objects, read by the backend's own L3
        assert _read_back(f"file://{via_service}", rank, _ranks(kind)[r]) == PAGES
    svc = start_service(sock, 0.01, "--storage-url", f"file://{own}")  # the backend's own objects, through a service
    try:
        for r, rank in enumerate(ranks):
            assert _read_back(None, rank, _ranks(kind)[r], **service) == PAGES
        status = query_status_of(sock)()
        assert status["l3"]["fetched_pages"] == (2 if kind == "mha" else 1) * PAGES and status["l3"]["corrupt_pages"] == 0
    finally:
        assert stop(svc.proc) == 0


@pytest.mark.parametrize("odd", ["too long", "a slash"])
def test_a_page_whose_hash_the_service_cannot_name_stays_in_the_region_and_out_of_l3(tmp_path, odd):
    """SGLang's keys are strings of any content; one the service does not take as an object name (longer than it takes,
    or with a "/", which a store would split off as a namespace) is backed up into the region (a hit there) and
    neither saved to L3 nor asked of it -- never a refused connection."""
    sock = str(tmp_path / "run" / "node.sock")
    store = tmp_path / "l3"
    long_keys = ["k" * (MAX_OBJECT_NAME + 1) + key if odd == "too long" else f"ns/{key}" for key in KEYS]
    pool = mha_pool()
    fill(pool, seed=3)
    svc = start_service(sock, 0.01, "--storage-url", f"file://{store}", "--drain-timeout-s", "30")
    try:
        backend = attach(storage_config(None, service=f"unix://{sock}"), pool)
        idx = pool.alloc(len(TOKENS))
        op_tokens = backup(controller(backend, pool), long_keys, idx)
        assert op_tokens == len(TOKENS) and backend.batch_exists(long_keys) == PAGES
        assert backend.get_stats().faults == 0 and backend.service.losses == 0
        backend.close()
    finally:
        assert stop(svc.proc) == 0
    assert store_files(store) == {}


def test_a_service_killed_and_started_again_adopts_sglangs_region_and_saves_what_comes_after_as_its_own_l3_would(tmp_path):
    """The region's format.json keeps how each row is an object: a service SIGKILLed and started again on the socket
    with the same L3 adopts the region of SGLang's pages (a hit there for a new server), and the pages backed up after
    the restart are saved under the names SGLang's own L3 gives them, the same bytes."""
    sock = str(tmp_path / "run" / "node.sock")
    store, own = tmp_path / "l3-service", tmp_path / "l3-own"
    service = {"service": f"unix://{sock}", "service_lookup_timeout_s": 4.0}
    rank = _ranks("mha")[0]
    half = dict(rank, idx=rank["idx"][: len(TOKENS) // 2])
    svc = start_service(sock, 0.01, "--storage-url", f"file://{store}")
    region = None
    try:
        backend = attach(storage_config(None, **rank["opts"], **service), rank["pool"])
        assert backup(controller(backend, rank["pool"]), KEYS[: PAGES // 2], half["idx"]) // P == PAGES // 2
        region = query_status_of(sock)()["region"]
        backend.close()
        os.kill(svc.proc.pid, signal.SIGKILL)
        svc.proc.wait(30)
        svc = start_service(sock, 0.01, "--storage-url", f"file://{store}")
        adopted = query_status_of(sock)()["adopted"]
        assert adopted["region"] == region and adopted["pages"] == PAGES // 2
        reader = attach(storage_config(None, **rank["opts"], **service), mha_pool())
        assert reader.batch_exists(KEYS) == PAGES // 2  # the adopted pages (the rest is in no tier yet)
        reader.close()
        # (its lookup asked the service's L3 for the rest: that load, a miss, is over before the rest is backed up)
        wait_until(lambda: query_status_of(sock)()["l3"]["fetching_pages"] == 0, 30.0)
        assert _back_up(None, rank, **service) == PAGES
    finally:
        assert stop(svc.proc) == 0  # SIGTERM: its saves drain first
        if region is not None:
            shutil.rmtree(os.path.dirname(region), ignore_errors=True)
    _back_up(f"file://{own}", rank)
    # (a save the SIGKILL cut short may leave its temp file: the store's, never an object, removed by its next scan)
    saved = {path: data for path, data in store_files(store).items() if not path.rsplit("/", 1)[-1].startswith(".tmp-")}
    written = store_files(own)
    after = {path for path in written if path.rsplit("/", 1)[-1] in KEYS[PAGES // 2:]}
    assert len(after) == PAGES // 2 and after <= set(saved)  # every page backed up after the restart, saved
    assert all(written[path] == data for path, data in saved.items())  # and each object the service saved, SGLang's own


def test_an_engine_whose_rows_are_framed_otherwise_than_the_regions_is_refused(tmp_path):
    """The rows' page sizes are not in the format's fingerprint: an engine whose rows name another page size than the
    region's first engine did is refused at hello (its objects would be saved framed as the region's), a typed error."""
    sock = str(tmp_path / "run" / "node.sock")
    rows = [RowObject("0123456789abcdef", 4), RowObject("fedcba9876543210", 4)]
    fmt = RegionFormat.of_rows(rows, [64, 16])
    namespace = str(Namespace("tiny", fmt.fingerprint, 0))
    svc = start_service(sock, 0.01, "--storage-url", f"file://{tmp_path / 'l3'}")
    try:
        first = ServiceClient(sock, namespace, fmt)
        other = dataclasses.replace(fmt, rows=(rows[0], RowObject(rows[1].fingerprint, 1)))
        with pytest.raises(ServiceError, match="holds pages of another format.*needs a service of its own"):
            ServiceClient(sock, namespace, other)
        ServiceClient(sock, namespace, fmt).close()  # the same rows attach
        first.close()
    finally:
        assert stop(svc.proc) == 0


def _own_pool_stack(kind: str) -> tuple:
    """A server's KV pool and its pool with page ids of its own (SGLang's SWA host pool, or its Mamba state pool whose
    pages are copies), filled; the pool's name, its slots for ``KEYS`` (a window page per KV page, or a state per page)."""
    from support.sglang_helpers import _mamba_pool

    kv = mha_pool()
    fill(kv, seed=30)
    kv.idx = kv.alloc(len(TOKENS))  # (the KV pages' slots, the same in every backup)
    if kind == "swa":
        own = mha_pool(heads=1)
        fill(own, seed=31)
        return kv, PoolName.SWA, own, own.alloc(len(TOKENS))[::P].tolist()
    return kv, PoolName.MAMBA, _mamba_pool(seed=32), list(range(1, 1 + PAGES))


def _write_pools(backend, kv, name, slots) -> dict:
    from support.sglang_helpers import PoolTransfer

    assert backend.batch_set_v1(KEYS, kv.idx) == [True] * PAGES
    pages = backend._pool(name).pages
    return backend.batch_set_v2([PoolTransfer(name=name, host_indices=pages_slots(pages, slots), keys=KEYS)])


def pages_slots(pages, slots):
    """Host indices of pool pages ``slots`` (first slots of each page, as SGLang passes them): a page's token slots."""
    import torch

    first = torch.as_tensor([int(s) for s in slots], dtype=torch.int64)
    return (first[:, None] + torch.arange(pages.page_size)).flatten()


@pytest.mark.parametrize("kind", ["swa", "mamba"])
def test_a_pool_with_page_ids_of_its_own_is_saved_and_found_as_sglangs_own_l3_objects(tmp_path, kind):
    """SGLang's SWA and Mamba host pools on a service with file L3: the service saves their pages (the region's object
    pool) as exactly the files the backend's own L3 writes (the pool's namespace, its page hash, header and bytes), and a
    service over what the backend's own L3 saved brings a window page / state into its object pool when a server asks
    for it: bit-exact into the server's slot."""
    from support.sglang_helpers import PoolTransfer

    sock = str(tmp_path / "run" / "node.sock")
    via_service, own = tmp_path / "l3-service", tmp_path / "l3-own"
    service = {"service": f"unix://{sock}", "service_lookup_timeout_s": 4.0}
    kv, name, pool, slots = _own_pool_stack(kind)
    svc = start_service(sock, 0.01, "--storage-url", f"file://{via_service}", "--drain-timeout-s", "30")
    try:
        backend = attach(storage_config(None, **service), kv, (name, pool))
        assert _write_pools(backend, kv, name, slots) == {str(name): [True] * PAGES}
        backend.close()
        status = query_status_of(sock)()
    finally:
        assert stop(svc.proc) == 0  # SIGTERM: its saves drain first
    assert status["published_pages"] == 2 * PAGES and status["l3"]["save_failed_pages"] == 0
    backend = attach(storage_config(f"file://{own}"), kv, (name, pool))
    _write_pools(backend, kv, name, slots)
    backend.close()
    written = store_files(own)
    assert len(written) == 2 * PAGES and store_files(via_service) == written  # a KV page and a pool page per key
    svc = start_service(sock, 0.01, "--storage-url", f"file://{own}")  # the backend's own objects, through a service
    try:
        _, _, fresh, _ = _own_pool_stack(kind)
        reader = attach(storage_config(None, **service), mha_pool(), (name, fresh))
        into = slots[::-1]  # other slots than the writer's, for each key
        got = reader.batch_get_v2([PoolTransfer(name=name, host_indices=pages_slots(reader._pool(name).pages, into), keys=KEYS)])
        assert got == {str(name): [True] * PAGES}
        for s, d in zip(slots, into):
            assert page_bytes(pool, int(s)) == page_bytes(fresh, int(d)), (s, d)
        status = query_status_of(sock)()
        assert status["l3"]["fetched_pages"] == PAGES and status["l3"]["corrupt_pages"] == 0 and status["held"] == 0
        reader.close()
    finally:
        assert stop(svc.proc) == 0


# ---- a hostile client's names and pools, against a service of SGLang's rows ----------------------------------------
ROWS = RegionFormat.of_rows([RowObject("0123456789abcdef", 4)], [256])
WITH_POOL = ROWS.with_objects([ObjectPool.of_row("swa", RowObject("00112233445566aa", 4), 128)])


def _ops(s, seq: int, *ops: dict) -> dict | None:
    s.sendall(encode({"seq": seq, "ops": list(ops)}))
    return read_answer(s)


def _hello(fmt: RegionFormat, namespace: str = "m-ns-tp0") -> dict:
    return {"op": "hello", "version": 1, "namespace": namespace, "format": fmt.as_wire()}


@pytest.mark.parametrize("fmt", [ROWS, WITH_POOL], ids=["rows", "rows+swa"])
def test_a_publish_of_a_negative_page_with_names_is_a_typed_protocol_error(tmp_path, fmt):
    """Before this commit Publish.check compared each name with its key and the index refused page -1 typed; now the
    server's key check computes the page's pool as ``min(-1 // n, pools - 1)`` = -1 and ``key_of(-1, name)`` indexes
    ``objects[-2]``: IndexError, the connection faulted as a service bug (no answer)."""
    with running_service(tmp_path) as svc:
        s = raw_connection(svc.socket)
        try:
            assert "results" in _ops(s, 1, _hello(fmt))
            answer = _ops(s, 2, {"op": "publish", "pages": [-1], "keys": [name_key("a").hex()], "names": ["a"]},
                          {"op": "lookup", "keys": [name_key("a").hex()]})
            assert answer is not None, "the service closed the connection without an answer (an internal error)"
            assert answer["error"]["type"] == "ServiceProtocolError", answer
        finally:
            s.close()
    log = svc.proc.stderr.read()
    assert "an internal error serving it" not in log, log[-2000:]


@pytest.mark.parametrize("fmt", [ROWS, WITH_POOL], ids=["rows", "rows+swa"])
def test_a_find_of_pool_0_with_names_on_an_l3_service_is_answered_or_refused_typed(tmp_path, fmt):
    """``Find`` takes pool 0 and (new) ``names``; the server's ``_objects_after`` hands pool 0 to
    ``ServiceStorage.load_objects``, whose ``_names_object(0)`` reads ``objects[-1]`` (IndexError with no object pool)
    and then ``self._tiers.objects[0]`` (KeyError): the connection is faulted as a service bug."""
    sock = str(tmp_path / "run" / "node.sock")
    svc = start_service(sock, 0.01, "--storage-url", f"file://{tmp_path / 'l3'}")
    try:
        s = raw_connection(sock)
        try:
            ns = str(Namespace("m", fmt.fingerprint, 0))
            assert "results" in _ops(s, 1, _hello(fmt, ns)), "hello refused"
            answer = _ops(s, 2, {"op": "find", "keys": [name_key("a").hex()], "pool": 0, "names": ["a"]})
            assert answer is not None, "the service closed the connection without an answer (an internal error)"
            assert "results" in answer or answer["error"]["type"] == "ServiceProtocolError", answer
        finally:
            s.close()
    finally:
        assert stop(svc.proc) == 0
    log = svc.proc.stderr.read()
    assert "an internal error serving it" not in log, log[-2000:]


def test_mamba_state_beside_mla_at_tp2_is_saved_by_the_service_as_each_ranks_own_l3_saves_it(tmp_path):
    """MLA's latent once (SGLang's storage writer), each rank's Mamba state under that rank's namespace: the files a
    service with L3 saves are the ones each rank's own L3 writes of the same pages."""
    import torch

    from support.sglang_helpers import PoolHitPolicy, PoolTransfer, _mamba_pool

    sock = str(tmp_path / "run" / "node.sock")
    via_service, own = tmp_path / "l3-service", tmp_path / "l3-own"
    latent = mla_pool()
    fill(latent, seed=52)
    idx = latent.alloc(len(TOKENS))
    states = [_mamba_pool(seed=60 + r) for r in range(2)]

    def back_up(url: str | None = None, **service) -> None:
        for r in range(2):
            backend = attach(storage_config(url, tp_rank=r, tp_size=2, mla=True, **service), latent, (PoolName.MAMBA, states[r]))
            backend.batch_set_v1(KEYS, idx)
            assert backend.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([3]), keys=KEYS[-1:])]) == \
                {"mamba": [True]}
            backend.close()

    svc = start_service(sock, 0.01, "--storage-url", f"file://{via_service}", "--drain-timeout-s", "30")
    try:
        back_up(service=f"unix://{sock}")
    finally:
        assert stop(svc.proc) == 0  # SIGTERM: its saves drain first
    back_up(url=f"file://{own}")
    written = store_files(own)
    assert len(written) == PAGES + 2 and store_files(via_service) == written  # the latent once, a state per rank
    svc = start_service(sock, 0.01, "--storage-url", f"file://{own}")  # each rank's own state, through a service
    try:
        for r in range(2):
            back = _mamba_pool()
            reader = attach(storage_config(None, service=f"unix://{sock}", service_lookup_timeout_s=4.0, tp_rank=r, tp_size=2, mla=True),
                            mla_pool(), (PoolName.MAMBA, back))
            last = PoolTransfer(name=PoolName.MAMBA, keys=KEYS[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES)
            assert reader.batch_exists_v2(KEYS, [last]).restorable_prefix_pages == [PAGES]
            assert reader.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([5]), keys=KEYS[-1:])]) == \
                {"mamba": [True]}
            assert torch.equal(back.get_data_page(5), states[r].get_data_page(3)), r
            reader.close()
    finally:
        assert stop(svc.proc) == 0
