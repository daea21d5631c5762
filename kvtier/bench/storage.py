"""``kvtier bench storage``: L3 put/get throughput per backend vs the backend's plain client, same run.

kvtier's path is the storage tier end to end: host pages -> page objects
(header + xxh3 checksum) -> ``set``, and ``get`` -> integrity check -> host
pages. The baseline is the same server driven by its own client with
equal-sized byte strings and the same batch size: redis-py pipelined SET/GET,
Mooncake ``put``/``get``, plain file ``write``/``read``. The two take turns
within each repetition, and the best time of each is reported. Servers are
started on 127.0.0.1 for the run and stopped after.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass

import numpy as np

from kvtier.hashing import Namespace, PageHash
from kvtier.l3 import open_backend
from kvtier.l3.tier import StorageTier
from kvtier.pools import HostPool
from kvtier.spec import KVSpec


@dataclass(frozen=True)
class StorageCase:
    backend: str
    op: str
    object_bytes: int
    pages: int
    gbps: float
    raw_gbps: float
    ratio: float


def _best_interleaved(fns: dict[str, object], reps: int) -> dict[str, float]:
    """Best time of each ``fn(i)`` over ``reps`` rounds, the functions taking turns within a round.

    Taking turns puts kvtier's path and the plain client under the same machine
    conditions (on 2 shared cores the server, page cache and CPU clock drift
    within seconds); separate blocks of repetitions turned drift into ratio noise."""
    best = {name: float("inf") for name in fns}
    for i in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn(i)  # type: ignore[operator]
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def _raw_ops(kind: str, target, keys: list[str], blobs: list[bytes], batch: int):
    if kind == "file":
        root = target

        def put(i: int) -> None:
            for k, b in zip(keys, blobs):
                with open(os.path.join(root, f"{i}-{k}"), "wb") as f:
                    f.write(b)

        dests = [memoryview(bytearray(len(b))) for b in blobs]  # distinct destinations, as host pages are

        def get(i: int) -> None:
            for k, d in zip(keys, dests):
                with open(os.path.join(root, f"0-{k}"), "rb") as f:
                    f.readinto(d)

        return put, get
    if kind == "redis":
        client = target

        def put(i: int) -> None:
            for s in range(0, len(keys), batch):
                pipe = client.pipeline(transaction=False)
                for k, b in zip(keys[s : s + batch], blobs[s : s + batch]):
                    pipe.set(f"raw{i}-{k}", b)
                pipe.execute()

        def get(i: int) -> None:
            for s in range(0, len(keys), batch):
                pipe = client.pipeline(transaction=False)
                for k in keys[s : s + batch]:
                    pipe.get(f"raw0-{k}")
                pipe.execute()

        return put, get
    store = target

    def put(i: int) -> None:
        for k, b in zip(keys, blobs):
            store.put(f"raw{i}-{k}", b)

    def get(i: int) -> None:
        for k in keys:
            store.get(f"raw0-{k}")

    return put, get


def run_storage_bench(backends: tuple[str, ...] = ("file", "redis", "mooncake"), pages: int = 24, reps: int = 5) -> list[StorageCase]:
    from kvtier import devservers

    spec = KVSpec.preset("deepseek-v3.2")
    host = HostPool(spec, pages, "page_first")
    for t in host.buffers.values():
        t.copy_(torch_randint(t.shape))
    cases: list[StorageCase] = []
    for name in backends:
        tmp = tempfile.mkdtemp(prefix="kvtier-bench-")
        server = None
        try:
            if name == "file":
                url, raw_target = f"file://{tmp}/kvtier", os.path.join(tmp, "raw")
                os.makedirs(raw_target)
            elif name == "redis":
                if not shutil.which("redis-server"):
                    continue
                server = devservers.RedisServer(__import__("pathlib").Path(tmp) / "redis", extra=("--maxmemory", "0")).start()
                url = server.url.replace("timeout=1", "timeout=10")
                import redis

                raw_target = redis.Redis(port=server.port, socket_timeout=10)
            else:
                if not shutil.which("mooncake_master"):
                    continue
                server = devservers.MooncakeMaster(node_segment="2GB").start()
                url = server.url.replace("buffer_mb=64", "buffer_mb=256")
                raw_target = None
            backend = open_backend(url)
            if name == "mooncake":
                raw_target = backend.store
            tier = StorageTier(backend, host, Namespace("bench", spec.fingerprint()), batch_pages=8)
            obj = tier.codec.object_bytes
            nbytes = obj * pages
            keysets = [[PageHash(os.urandom(16)) for _ in range(pages)] for _ in range(reps)]

            def put(i: int) -> None:
                tier.submit("save", keysets[i], list(range(pages))).wait()

            def get(i: int) -> None:
                job = tier.submit("prefetch", keysets[0], list(range(pages)))
                job.wait()
                assert job.arrived == pages, f"{name}: only {job.arrived}/{pages} pages came back"

            blobs = [os.urandom(obj) for _ in range(pages)]
            raw_put, raw_get = _raw_ops(name, raw_target, [k.hex() for k in keysets[0]], blobs, 8)
            puts = _best_interleaved({"kvtier": put, "raw": raw_put}, reps)  # also stores what the gets read
            gets = _best_interleaved({"kvtier": get, "raw": raw_get}, 2 * reps)  # gets add no data: twice the rounds
            for op, t, r in (("put", puts["kvtier"], puts["raw"]), ("get", gets["kvtier"], gets["raw"])):
                g, rg = nbytes / t / 1e9, nbytes / r / 1e9
                cases.append(StorageCase(name, op, obj, pages, round(g, 3), round(rg, 3), round(g / rg, 3)))
            tier.close()
        finally:
            if server is not None:
                server.stop()
            shutil.rmtree(tmp, ignore_errors=True)
    return cases


def torch_randint(shape):
    import torch

    return torch.randint(0, 256, shape, dtype=torch.uint8)


def as_json_rows(cases: list[StorageCase]) -> list[dict]:
    return [asdict(c) for c in cases]
