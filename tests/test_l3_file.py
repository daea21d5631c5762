"""L3 file backend: the embedded default, real files in a temp directory."""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvtier.l3.page import MAGIC

from kvtier.l3 import open_backend
from kvtier.l3.base import KeyStatus
from kvtier.errors import StorageError, UnknownNameError
from support import l3_scenarios as sc
from support.cache_helpers import MODES


def flip_file_byte(backend, key, offset):
    path = Path(backend._path(key))
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("spec_name", ["deepseek-v3.2", "llama-3.1-8b"])
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("mode", MODES)
def test_round_trip_bit_exact(tmp_path, spec_name, layout, mode):
    sc.round_trip(f"file://{tmp_path}", sc.real_specs()[spec_name], layout, mode)


@pytest.mark.parametrize("mode", MODES)
def test_namespace_isolation(tmp_path, mode):
    sc.namespace_isolation(f"file://{tmp_path}", mode)


@pytest.mark.parametrize("mode", MODES)
def test_corrupted_page_is_a_miss(tmp_path, mode):
    sc.corrupted_page_is_a_miss(f"file://{tmp_path}", flip_file_byte, mode)


@pytest.mark.parametrize("mode", MODES)
def test_wrong_header_is_a_miss(tmp_path, mode):
    sc.wrong_header_is_a_miss(f"file://{tmp_path}", flip_file_byte, mode)


@pytest.mark.parametrize("mode", MODES)
def test_write_back_saves_on_host_eviction(tmp_path, mode):
    sc.write_back_saves_on_host_eviction(f"file://{tmp_path}", mode)


def test_backend_contract_and_size_cap(tmp_path):
    b = open_backend(f"file://{tmp_path}?max_bytes=1000")
    vals = [memoryview(MAGIC + bytes([i]) * 296) for i in range(5)]  # page objects (the cap touches only those)
    keys = [f"ns/{i:032x}" for i in range(5)]
    assert b.set(keys[:3], vals[:3]) == [KeyStatus.OK] * 3
    assert b.exists(keys) == 3
    out = [memoryview(bytearray(300)) for _ in range(2)]
    assert b.get([keys[1], keys[4]], out) == [KeyStatus.OK, KeyStatus.MISS]
    assert bytes(out[0]) == MAGIC + bytes([1]) * 296
    wrong = memoryview(bytearray(10))
    assert b.get([keys[0]], [wrong]) == [KeyStatus.WRONG_SIZE]  # size mismatch is reported, not raised
    b.set(keys[3:], vals[3:])  # 1500 bytes > cap: LRU files are deleted down to 90% of the cap
    assert b.usage_bytes() <= 900 and b.exists([keys[4]]) == 1
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.rglob("*"))
    b.delete(keys)
    assert b.exists(keys) == 0


def test_size_cap_scan_removes_stale_temp_files_and_keeps_fresh_ones(tmp_path):
    """A writer that died between create and rename leaves a temp file; the cap's scan deletes it
    once it is older than ``stale_temp_s``, never one a live writer may still be filling."""
    b = open_backend(f"file://{tmp_path}?max_bytes=1000")
    keys = [f"ns/{i:032x}" for i in range(4)]
    b.set(keys[:1], [memoryview(MAGIC + bytes(296))])
    shard = Path(b._path(keys[0])).parent
    stale, fresh = shard / ".tmp-999999-1-0", shard / ".tmp-999999-1-1"
    stale.write_bytes(MAGIC + bytes(4996))
    fresh.write_bytes(MAGIC + bytes(4996))
    hour_ago = time.time() - 3600
    os.utime(stale, (hour_ago, hour_ago))
    b.set(keys[1:], [memoryview(MAGIC + bytes(296))] * 3)  # 1200 bytes > cap: the scan runs
    assert not stale.exists() and fresh.exists() and b.stale_temps_removed == 1
    assert b.usage_bytes() <= 900  # temp files are not counted as stored pages


def test_bad_urls():
    with pytest.raises(UnknownNameError, match="file, memory, mooncake, redis"):
        open_backend("s3://bucket/x")
    with pytest.raises(StorageError, match="no scheme"):
        open_backend("/just/a/path")


def test_two_processes_share_one_file_store(tmp_path):
    """Process 1 computes a prefix and exits; process 2 gets L3 hits for it."""
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from support.cache_helpers import make_tiered_cache, serve, serve_tiered
        from support import l3_scenarios as sc
        c = make_tiered_cache(sc.tiny(), 8, 8, "file://{tmp_path}", model="two-processes")
        toks = list(range(20))
        if sys.argv[1] == "first":
            s = serve(c, toks); c.wait_idle(); print(s.computed, c.stats.storage_saved_pages)
        else:
            print(*serve_tiered(c, toks))
        c.close()
        """
    )
    first = subprocess.run([sys.executable, "-c", script, "first"], capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    assert first.stdout.split() == ["5", "5"]
    second = subprocess.run([sys.executable, "-c", script, "second"], capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr
    device, host, storage, computed = map(int, second.stdout.split())
    assert (storage, computed) == (5, 0)


def test_eviction_backups_are_written_through_to_l3(tmp_path):
    """Host copies made by a device eviction (write_back on device) still reach L3 under L3 write_through."""
    from support.cache_helpers import make_tiered_cache, serve

    c = make_tiered_cache(sc.tiny(), 4, 8, f"file://{tmp_path}", model="evict-wt", write_policy="write_back")
    serve(c, list(range(16)))
    c.wait_idle()
    assert c.stats.storage_saved_pages == 0
    assert c.evict_device(4).backed_up == 4
    c.wait_idle()
    assert c.stats.storage_saved_pages == 4
    c.check_integrity()
    c.close()


def test_file_get_scattered_reads_into_pieces_and_rejects_wrong_sizes(tmp_path):
    from kvtier.l3.base import KeyStatus
    from kvtier.l3.file import FileBackend

    be = FileBackend(tmp_path / "store")
    data = bytes(range(10))
    assert be.set(["k"], [memoryview(data)]) == [KeyStatus.OK]
    a, b = bytearray(4), bytearray(6)
    assert be.get_scattered(["k"], [[memoryview(a), memoryview(b)]]) == [KeyStatus.OK]
    assert bytes(a + b) == data
    short = [memoryview(bytearray(4)), memoryview(bytearray(4))]
    assert be.get_scattered(["k", "absent"], [short, [memoryview(bytearray(10))]]) == [KeyStatus.WRONG_SIZE, KeyStatus.MISS]


def test_file_set_from_two_threads_remakes_a_removed_directory_and_leaves_no_temp_files(tmp_path):
    import shutil
    import threading

    from kvtier.l3.base import KeyStatus
    from kvtier.l3.file import FileBackend

    be = FileBackend(tmp_path / "store")
    keys = [[f"ns/{t:02x}{i:030x}" for i in range(40)] for t in range(2)]  # thread t writes under directory ns/0t
    values = {k: memoryview(os.urandom(64 + i)) for t in range(2) for i, k in enumerate(keys[t])}
    results: list[list[KeyStatus]] = []

    def write(t: int) -> None:
        results.append(be.set_scattered(keys[t], [[values[k][:10], values[k][10:]] for k in keys[t]]))

    threads = [threading.Thread(target=write, args=(t,)) for t in range(2)]
    [th.start() for th in threads]
    [th.join() for th in threads]
    assert results == [[KeyStatus.OK] * 40] * 2
    for k, v in values.items():
        out = memoryview(bytearray(len(v)))
        assert be.get([k], [out]) == [KeyStatus.OK] and bytes(out) == bytes(v)
    # another process (or an operator) removed a directory this backend has written to before
    shutil.rmtree(os.path.dirname(be._path(keys[0][0])))
    assert be.set([keys[0][0]], [values[keys[0][0]]]) == [KeyStatus.OK]
    assert be.exists([keys[0][0]]) == 1
    assert not any(p.name.startswith(".tmp-") for p in (tmp_path / "store").rglob("*"))
