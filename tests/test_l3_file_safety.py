"""The file store keeps to what it owns: its objects stay under its root whatever the namespace's model
name or salt, a symlink planted for the namespace directory is refused, its size cap holds with several
writers and deletes only its own objects (a user's files in the same directory survive every cap
cycle), and a root removed under a running store is recreated. Each test failed on the code before its
fix (the hardening reviews)."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.hashing import Namespace, page_keys
from kvtier.l3 import open_backend
from kvtier.l3.base import KeyStatus
from kvtier.l3.file import FileBackend, dir_name
from kvtier.l3.tier import StorageTier
from kvtier.pools import HostPool
from support import l3_scenarios as sc


# ---- the file store writes only under its root ---------------------------------------------------
def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.mark.parametrize("model, salt", [("../../../escaped", ""), ("/tmp/absolute-escape", ""), ("m", "../../salted"), ("..", "..")])
def test_file_store_namespace_cannot_escape_the_root(tmp_path, model, salt):
    spec = sc.tiny()
    root = tmp_path / "a" / "b" / "store"
    outside_before = _tree(tmp_path)
    host = HostPool(spec, 4, "page_first")
    tier = StorageTier(open_backend(f"file://{root}"), host, Namespace(model, spec.fingerprint(), salt=salt))
    keys = page_keys(list(range(16)), spec.page_size, tier.namespace.root())
    job = tier.submit("save", keys, [0, 1, 2, 3])
    job.wait(10)
    assert job.statuses == [KeyStatus.OK] * 4
    tier.close()
    added = _tree(tmp_path) - outside_before
    assert added and all(p in ("a", "a/b") or p.startswith("a/b/store/") or p == "a/b/store" for p in added), sorted(added)
    # exactly one namespace directory, named by the encoding, holding every page
    assert [p.name for p in root.iterdir()] == [dir_name(str(tier.namespace))]
    assert not Path("/tmp/absolute-escape").exists()


def test_file_store_refuses_a_symlink_planted_for_the_namespace_directory(tmp_path):
    spec = sc.tiny()
    root, elsewhere = tmp_path / "store", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    ns = Namespace("victim", spec.fingerprint())
    (root / dir_name(str(ns))).symlink_to(elsewhere, target_is_directory=True)
    host = HostPool(spec, 4, "page_first")
    tier = StorageTier(open_backend(f"file://{root}"), host, ns)
    keys = page_keys(list(range(16)), spec.page_size, ns.root())
    job = tier.submit("save", keys, [0, 1, 2, 3])
    job.wait(10)
    assert KeyStatus.ERROR in job.statuses and tier.backend.stats.errors >= 1
    tier.backend.delete([tier.key(k) for k in keys])  # deletes go through the same guarded path
    tier.close()
    assert list(elsewhere.iterdir()) == []  # nothing written through the link


# ---- several writers keep a capped store within its stated bound ---------------------------------
WRITER = """
import os, sys
from kvtier.l3.file import FileBackend
be = FileBackend(sys.argv[1], max_bytes=int(sys.argv[2]))
for i in range(int(sys.argv[3])):
    be.set([f"ns/{sys.argv[4]}{i:030x}"], [memoryview(b"KVTP" + os.urandom(9_996))])
"""


def test_two_writers_keep_a_capped_store_within_its_bound(tmp_path):
    cap, obj, writers = 400_000, 10_000, 2
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(cap), "300", f"{w:02x}"]) for w in range(writers)]

    def stored_bytes() -> int:
        total = 0
        for f in tmp_path.rglob("*"):
            try:  # the writers evict files while this walks
                if f.is_file() and not f.name.startswith(".tmp-"):
                    total += f.stat().st_size
            except FileNotFoundError:
                pass
        return total

    peak = 0
    while any(p.poll() is None for p in procs):
        peak = max(peak, stored_bytes())
        time.sleep(0.02)
    assert all(p.wait(60) == 0 for p in procs)
    final = FileBackend(tmp_path).usage_bytes()
    bound = cap * (1 + FileBackend(tmp_path).rescan_fraction * writers) + writers * obj
    assert final <= bound and peak <= bound, (final, peak, bound)


# ---- the cap and the temp sweep delete only the store's own objects; a removed root is recreated ---
def test_capped_file_store_in_a_shared_directory_keeps_every_user_file(tmp_path):
    import os
    import time
    from pathlib import Path

    from kvtier.l3 import open_backend
    from kvtier.l3.base import KeyStatus
    from kvtier.l3.file import dir_name
    from kvtier.l3.page import MAGIC

    root = tmp_path / "with-user-files"
    ns_dir = dir_name("ns")
    # the user's files, all older than anything the store writes: at the root, in folders, named like a
    # temp file, and one laid out and named exactly like a page file but not a page object
    user = {root / "notes.txt": b"mine", root / "model" / "weights.bin": bytes(5000), root / ".tmp-1-2-3": bytes(4000),
            root / "ab" / "ab12": b"x" * 3000, root / ns_dir / "00" / "00aa": b"lookalike" * 400,
            root / ns_dir / "00" / ".tmp-7-7-7": b"user temp" * 400}
    for path, data in user.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        long_ago = time.time() - 30 * 24 * 3600
        os.utime(path, (long_ago, long_ago))
    store = open_backend(f"file://{root}?max_bytes=10000")
    keys = [f"ns/{i:032x}" for i in range(60)]
    for i in range(0, 60, 3):  # 60 objects of 1000 bytes through a 10,000-byte cap: many full cap cycles
        assert store.set(keys[i : i + 3], [memoryview(MAGIC + bytes([i]) * 996)] * 3) == [KeyStatus.OK] * 3
    assert store.usage_bytes() <= 10000 and store.exists(keys[-1:]) == 1  # the cap still holds its own objects
    assert store.exists(keys[:1]) == 0  # and evicted its oldest
    for path, data in user.items():
        assert path.read_bytes() == data, f"the store's cap deleted or changed the user's {path.relative_to(root)}"
    assert Path(store._path(keys[-1])).read_bytes()[:4] == MAGIC


def test_file_store_root_removed_under_a_running_store_is_recreated_and_writes_resume(tmp_path):
    import shutil

    from kvtier.l3 import open_backend
    from kvtier.l3.base import KeyStatus
    from kvtier.l3.page import MAGIC

    root = tmp_path / "store"
    store = open_backend(f"file://{root}")
    keys = [f"ns/{i:032x}" for i in range(4)]
    value = memoryview(MAGIC + bytes(60))
    assert store.set(keys[:2], [value] * 2) == [KeyStatus.OK] * 2
    shutil.rmtree(root)  # an operator wipes the store's directory while the engine runs
    assert store.exists(keys[:2]) == 0
    assert store.set(keys[2:], [value] * 2) == [KeyStatus.OK] * 2  # recreated, writes resume
    assert store.exists(keys[2:]) == 2 and root.is_dir() and store.roots_recreated == 1
    out = memoryview(bytearray(len(value)))
    assert store.get(keys[3:], [out]) == [KeyStatus.OK] and bytes(out) == bytes(value)
