"""Backend-independent L3 scenarios; each backend's test module runs them against a real server or directory.

``mode`` (see :data:`support.cache_helpers.MODES`): the executor -- pools, transfer engine, L3 tier -- in this
process or in a spawned one behind a pipe."""

from __future__ import annotations


from kvtier import KVSpec
from kvtier.l3.page import HEADER_BYTES
from support.cache_helpers import device_bytes, expected_page, make_tiered_cache, serve, serve_tiered
from kvtier.l3 import open_backend


def stored_object(cache, url: str, key):
    """(a backend client of the cache's store, the object name of page ``key``) -- opened here,
    wherever the cache's own L3 tier runs."""
    backend = cache.storage.backend if getattr(cache, "storage", None) is not None else open_backend(url)
    return backend, f"{cache.namespace}/{key.hex()}"

REQ = list(range(3 * 64 + 10))  # 3 full pages of 64 + a tail


def real_specs() -> dict[str, KVSpec]:
    return {"deepseek-v3.2": KVSpec.preset("deepseek-v3.2"), "llama-3.1-8b": KVSpec.preset("llama-3.1-8b")}


def round_trip(url: str, spec: KVSpec, layout: str = "page_first", mode: str = "one process") -> None:
    # instance A computes the request; write_through puts it on host, then in L3
    a = make_tiered_cache(spec, 4, 4, url, layout=layout, mode=mode)
    serve(a, REQ)
    a.wait_idle()
    assert a.stats.storage_saved_pages == 3, a.stats
    a.close()
    # instance B (fresh pools, same store): storage hits, prefetched, loaded, bytes equal what A computed
    b = make_tiered_cache(spec, 4, 4, url, layout="layer_first" if layout == "page_first" else "page_first", mode=mode)
    m = b.match(REQ)
    assert (m.num_device_pages, m.num_host_pages, m.num_storage_pages) == (0, 0, 3)
    b.lock(m.last_node)
    h = b.prefetch(m)
    assert b.resolve_prefetch(h) == 3
    b.unlock(m.last_node)
    m = b.match(REQ)
    assert m.num_host_pages == 3
    b.lock(m.last_node)
    ld = b.load_back(m)
    ld.wait()
    assert device_bytes(b, ld.device_pages) == [expected_page(b, REQ, i) for i in range(3)]
    b.unlock(m.last_node)
    b.wait_idle()
    b.check_integrity()
    assert b.stats.storage_prefetched_pages == 3 and b.stats.storage_corrupt_pages == 0
    b.close()


def tiny() -> KVSpec:
    return KVSpec.dsa("tiny", 2, kv_lora_rank=16, qk_rope_dim=8, index_head_dim=32, quant_block_size=16, page_size=4)


def namespace_isolation(url: str, mode: str = "one process") -> None:
    spec = tiny()
    toks = list(range(16))
    a = make_tiered_cache(spec, 8, 8, url, model="model-a", mode=mode)
    serve(a, toks)
    a.wait_idle()
    a.close()
    # another model, same spec: nothing shared
    other_model = make_tiered_cache(spec, 8, 8, url, model="model-b", mode=mode)
    assert other_model.match(toks).num_storage_pages == 0
    other_model.close()
    # same model name, another page size: nothing shared
    other_ps = make_tiered_cache(spec.with_(page_size=8), 8, 8, url, model="model-a", mode=mode)
    assert other_ps.match(toks).num_storage_pages == 0
    other_ps.close()
    same = make_tiered_cache(spec, 8, 8, url, model="model-a", mode=mode)
    assert same.match(toks).num_storage_pages == 4
    same.close()


def corrupted_page_is_a_miss(url: str, corrupt, mode: str = "one process") -> None:
    """``corrupt(backend, key, offset)`` flips one byte of a stored object at ``offset``."""
    spec = tiny()
    toks = list(range(16))
    a = make_tiered_cache(spec, 8, 8, url, model="corrupt", mode=mode)
    serve(a, toks)
    a.wait_idle()
    keys = a.page_keys(toks)
    corrupt(*stored_object(a, url, keys[2]), HEADER_BYTES + 5)  # payload byte of page 2
    a.close()
    b = make_tiered_cache(spec, 8, 8, url, model="corrupt", mode=mode)
    d, h, s, c = serve_tiered(b, toks)
    # pages 0-1 come from L3; page 2 fails its checksum (a miss), so pages 2-3 are recomputed
    assert (s, c) == (2, 2), (d, h, s, c)
    assert b.stats.storage_corrupt_pages == 1
    b.wait_idle()
    b.check_integrity()
    b.close()


def wrong_header_is_a_miss(url: str, corrupt, mode: str = "one process") -> None:
    spec = tiny()
    toks = list(range(16))
    a = make_tiered_cache(spec, 8, 8, url, model="header", mode=mode)
    serve(a, toks)
    a.wait_idle()
    keys = a.page_keys(toks)
    corrupt(*stored_object(a, url, keys[0]), 17)  # inside the spec fingerprint
    a.close()
    b = make_tiered_cache(spec, 8, 8, url, model="header", mode=mode)
    d, h, s, c = serve_tiered(b, toks)
    assert (s, c) == (0, 4) and b.stats.storage_corrupt_pages == 1
    b.wait_idle()
    b.check_integrity()
    b.close()


def write_back_saves_on_host_eviction(url: str, mode: str = "one process") -> None:
    spec = tiny()
    toks = list(range(16))
    a = make_tiered_cache(spec, 4, 4, url, model="wb", storage_cfg={"write_policy": "write_back"}, write_policy="write_back", mode=mode)
    serve(a, toks)
    a.evict_device(4)
    a.wait_idle()
    assert a.stats.storage_saved_pages == 0
    assert a.evict_host(4).evicted == 4 and a.stats.storage_saved_pages == 4
    a.check_integrity()
    m = a.match(toks)
    assert m.num_storage_pages == 4
    a.close()
