"""The GPU copy methods, checked on the CPU: address lists, batched-DMA descriptors, the Triton kernel.

Every method is compared bit-exact with the ``direct`` backend on twin pools
(same random bytes), over MHA, MLA and MLA+DSA, both host layouts, host pages
in one run and shuffled, per-layer loads and all-layer backups. Comparing whole
pools also proves that pages outside the transfer are untouched.

* address lists run through ``ctypes.memmove`` (the reference executor);
* the DMA descriptor builder runs through a stand-in with the driver call's
  signature that performs each copy with ``ctypes.memmove``;
* the Triton kernel runs under ``TRITON_INTERPRET=1`` on tiny grids (fewer
  programs than rows: the capped grid's stride loop), and compiles ahead of
  time for sm_90 with Triton's own ptxas.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from support.pools import fill_random, tiny_specs
from kvtier.core.plans import Tier
from kvtier.errors import ConfigError, TransferError
from kvtier.pools.device import DevicePool
from kvtier.pools.host import HostPool
from kvtier.transfer.address_list import AddressPlan, CopyList, coalesce, run_with_memmove
from kvtier.transfer.backends import get_io_backend
from kvtier.transfer.batched_dma import BATCH_MEMCPY, build_batch, memmove_driver, submit
from kvtier.transfer.engine import TransferEngine
from kvtier.transfer.gpu_methods import CopyMethodThresholds
from kvtier.transfer.ops import backup_pages_all_layers, load_pages_one_layer

#: Triton's interpreter reads a 1-element array as an index (NumPy deprecates it): not kvtier's to fix
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

HOST_PAGES, DEVICE_PAGES, MOVED = 12, 10, 6
CASES = [(kind, layout, order) for kind in ("mha", "mla", "dsa") for layout in ("layer_first", "page_first")
         for order in ("run", "shuffled")]


def twin_pools(kind: str, layout: str, seed: int):
    """Two identical (host, device) pairs of random bytes: one for the method, one for ``direct``."""
    spec = tiny_specs(page_size=4, num_layers=3)[kind]
    pairs = []
    for _ in range(2):
        host, dev = HostPool(spec, HOST_PAGES, layout), DevicePool(spec, DEVICE_PAGES)
        fill_random(host, seed)
        fill_random(dev, seed + 1)
        pairs.append((host, dev))
    return spec, pairs


def pages_for(order: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    if order == "run":
        return torch.arange(3, 3 + MOVED), torch.arange(2, 2 + MOVED)
    rnd = random.Random(seed)
    return torch.tensor(rnd.sample(range(HOST_PAGES), MOVED)), torch.tensor(rnd.sample(range(DEVICE_PAGES), MOVED))


def snapshot(host: HostPool, dev: DevicePool) -> tuple[list[bytes], list[bytes]]:
    return [host.page_bytes(p) for p in range(HOST_PAGES)], [dev.page_bytes(p) for p in range(DEVICE_PAGES)]


def run_case(kind: str, layout: str, order: str, method) -> None:
    """``method(host, dev, host_pages, dev_pages, direction, layer)`` moves the bytes; the twin moves them with
    ``direct``; both pools must end equal, and the pages outside the transfer as they were."""
    seed = CASES.index((kind, layout, order))
    spec, ((host, dev), (h_ref, d_ref)) = twin_pools(kind, layout, seed)
    host_pages, dev_pages = pages_for(order, seed)
    before = snapshot(host, dev)
    direct = get_io_backend("direct")
    for layer in range(spec.num_layers):  # per-layer loads
        method(host, dev, host_pages, dev_pages, "load", layer)
        load_pages_one_layer(h_ref, d_ref, host_pages, dev_pages, layer, direct)
    after_load = snapshot(host, dev)
    assert after_load == snapshot(h_ref, d_ref)
    moved = set(dev_pages.tolist())
    assert [b for p, b in enumerate(after_load[1]) if p not in moved] == [b for p, b in enumerate(before[1]) if p not in moved]
    assert [after_load[1][d] for d in dev_pages.tolist()] == [before[0][h] for h in host_pages.tolist()]
    fill_random(dev, seed + 7)  # new device bytes, then an all-layer backup of them
    fill_random(d_ref, seed + 7)
    method(host, dev, host_pages, dev_pages, "backup", None)
    backup_pages_all_layers(h_ref, d_ref, host_pages, dev_pages, direct)
    final = snapshot(host, dev)
    assert final == snapshot(h_ref, d_ref)
    kept = set(host_pages.tolist())
    assert [b for p, b in enumerate(final[0]) if p not in kept] == [b for p, b in enumerate(before[0]) if p not in kept]
    assert [final[0][h] for h in host_pages.tolist()] == [final[1][d] for d in dev_pages.tolist()]


def address_list(host, dev, host_pages, dev_pages, direction, layer) -> CopyList:
    if direction == "load":
        return AddressPlan(host, dev, host_pages, dev_pages).layer(layer)
    return AddressPlan(dev, host, dev_pages, host_pages).all_layers()


# ---- address lists ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,layout,order", CASES)
def test_address_lists_move_every_buffer_bit_exact(kind, layout, order):
    run_case(kind, layout, order, lambda *a: run_with_memmove(address_list(*a)))


def test_a_run_of_pages_is_one_row_per_buffer_and_a_shuffle_one_per_page():
    spec, ((host, dev), _) = twin_pools("dsa", "layer_first", 3)
    run = AddressPlan(host, dev, torch.arange(3, 9), torch.arange(2, 8)).layer(1)
    assert len(run) == len(spec.buffers) and run.nbytes == 6 * spec.page_bytes // spec.num_layers
    shuffled = AddressPlan(host, dev, torch.tensor([5, 1, 9]), torch.tensor([0, 7, 3])).layer(1)
    assert len(shuffled) == 3 * len(spec.buffers)
    # a page_first host: one page's layers are one run on the host side only, so a backup stays per row
    _, ((pf_host, pf_dev), _) = twin_pools("mla", "page_first", 3)
    assert len(AddressPlan(pf_dev, pf_host, torch.arange(2), torch.arange(2)).all_layers()) == 2 * 3


def test_coalesce_merges_only_where_both_sides_continue():
    src, dst, size = np.array([0, 8, 16, 40]), np.array([100, 108, 200, 208]), np.array([8, 8, 8, 8])
    merged = coalesce(src, dst, size)
    assert (merged.src.tolist(), merged.dst.tolist(), merged.size.tolist()) == ([0, 16, 40], [100, 200, 208], [16, 8, 8])
    assert CopyList(np.array([16]), np.array([40]), np.array([12])).alignment == 4


# ---- batched DMA: the descriptors, run by a memmove stand-in for the driver ---------------------------
def dma_by_memmove(host, dev, host_pages, dev_pages, direction, layer) -> None:
    rows = address_list(host, dev, host_pages, dev_pages, direction, layer)
    batch = build_batch(rows, src_on_device=direction == "backup", dst_on_device=direction == "load")
    assert batch.count == len(rows) and batch.dsts.dtype == np.uint64
    submit(batch, stream=0x1234, call=memmove_driver)
    assert batch.fail_idx.value == len(rows)  # the stand-in read every descriptor


@pytest.mark.parametrize("kind,layout,order", CASES)
def test_batched_dma_descriptors_bit_exact(kind, layout, order):
    run_case(kind, layout, order, dma_by_memmove)


def test_batched_dma_refuses_the_legacy_stream_and_reports_a_failed_copy():
    _, ((host, dev), _) = twin_pools("mha", "layer_first", 1)
    rows = AddressPlan(host, dev, torch.arange(2), torch.arange(2)).layer(0)
    before = snapshot(host, dev)
    for legacy in (0, 1):
        with pytest.raises(ConfigError, match="legacy default stream"):
            submit(build_batch(rows, False, True), stream=legacy, call=memmove_driver)
    assert snapshot(host, dev) == before  # refused before any byte moved

    def failing(*args):
        import ctypes

        ctypes.cast(args[7], ctypes.POINTER(ctypes.c_size_t))[0] = 1
        return 1

    with pytest.raises(TransferError, match=f"CUresult 1 at copy 1 of {len(rows)}"):
        submit(build_batch(rows, False, True), stream=0x1234, call=BATCH_MEMCPY(failing))


# ---- the Triton kernel, under the interpreter (the gpu extra, which ./run.sh test installs) ------------

@pytest.fixture
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("kind,layout,order", CASES)
def test_triton_kernel_bit_exact_under_the_interpreter(kind, layout, order, interpreter, monkeypatch):
    monkeypatch.setenv("KVTIER_KERNEL_PROGRAMS", "2")  # fewer programs than rows: each walks several
    backend = get_io_backend("triton")

    def kernel(host, dev, host_pages, dev_pages, direction, layer):
        if direction == "load":
            load_pages_one_layer(host, dev, host_pages, dev_pages, layer, backend)
        else:
            backup_pages_all_layers(host, dev, host_pages, dev_pages, backend)

    run_case(kind, layout, order, kernel)


def test_triton_kernel_through_the_transfer_engine(interpreter):
    spec, ((host, dev), (h_ref, d_ref)) = twin_pools("dsa", "page_first", 5)
    host_pages, dev_pages = pages_for("shuffled", 5)
    engine = TransferEngine(host, dev, "triton")
    try:
        job = engine.submit(Tier.HOST, Tier.DEVICE, host_pages, dev_pages)
        job.wait()
    finally:
        engine.close()
    for layer in range(spec.num_layers):
        load_pages_one_layer(h_ref, d_ref, host_pages, dev_pages, layer, get_io_backend("direct"))
    assert snapshot(host, dev) == snapshot(h_ref, d_ref)


def test_gpu_methods_refuse_a_cpu_device_pool_in_one_line(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _, ((host, dev), _) = twin_pools("mha", "layer_first", 1)
    for name, why in (("dma", "device pool is on the CPU"), ("triton", "TRITON_INTERPRET=1"), ("auto", "device pool is on the CPU")):
        with pytest.raises(ConfigError, match=f"io_backend {name!r}: .*{why}"):
            TransferEngine(host, dev, name)


def test_the_kernel_compiles_ahead_of_time_for_sm90():
    from kvtier.transfer.triton_copy import compile_ahead

    kernels = compile_ahead(90)
    assert sorted(kernels) == [1, 2, 4, 8]
    for k in kernels.values():
        assert k.asm["cubin"] and ".target sm_90" in k.asm["ptx"]

def test_concurrent_kernel_launches_under_the_interpreter_each_copy_every_row(interpreter):
    """A hybrid model's transfer engines (one thread per KV group) launch the kernel at once. Triton's
    interpreter keeps a launch's grid, program id and patched language in globals, so unserialized
    launches fail (``x >= grid_dim[0]``) or return with rows not copied; each launch must copy every row."""
    import sys
    import threading

    from kvtier.transfer.triton_copy import copy_list

    threads, launches, rows, row_bytes = 4, 8, 12, 32
    failures: list[str] = []
    start = threading.Barrier(threads)

    def launch_many(t: int) -> None:
        g = torch.Generator().manual_seed(t)
        src = torch.randint(0, 256, (rows, row_bytes), dtype=torch.uint8, generator=g)
        dst = torch.zeros_like(src)
        offsets = np.arange(rows, dtype=np.int64) * row_bytes
        copy = CopyList(src.data_ptr() + offsets, dst.data_ptr() + offsets, np.full(rows, row_bytes, np.int64))
        start.wait()
        for i in range(launches):
            dst.zero_()
            try:
                copy_list(copy, torch.device("cpu"), programs=3)
            except Exception as e:  # noqa: BLE001 -- every failure is the finding
                failures.append(f"thread {t} launch {i}: {e!r}")
                continue
            missing = (dst != src).any(dim=1).nonzero().flatten().tolist()
            if missing:
                failures.append(f"thread {t} launch {i}: rows {missing} not copied")

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often: interleaved launches, were they not serialized
    try:
        workers = [threading.Thread(target=launch_many, args=(t,)) for t in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        sys.setswitchinterval(interval)
    assert not failures, f"{len(failures)} of {threads * launches} launches failed:\n" + "\n".join(failures)


# ---- choosing the method --------------------------------------------------------------------------------
def test_auto_picks_the_kernel_for_many_small_rows_and_dma_otherwise(monkeypatch):
    t = CopyMethodThresholds()
    small = CopyList(np.zeros(16, np.int64), np.zeros(16, np.int64), np.full(16, 8 << 10, np.int64))
    assert t.method_for(small) == "kernel"
    assert t.method_for(CopyList(small.src[:4], small.dst[:4], small.size[:4])) == "dma"  # too few rows
    assert t.method_for(CopyList(small.src, small.dst, np.full(16, 64 << 10, np.int64))) == "dma"  # rows too large
    monkeypatch.setenv("KVTIER_KERNEL_MAX_ROW_BYTES", str(4 << 10))
    assert CopyMethodThresholds.from_env().method_for(small) == "dma"
    monkeypatch.setenv("KVTIER_KERNEL_PROGRAMS", "many")
    with pytest.raises(ConfigError, match="KVTIER_KERNEL_PROGRAMS='many': .*kernel_programs must be an integer >= 1, <= 4096"):
        CopyMethodThresholds.from_env()
    with pytest.raises(ConfigError, match="kernel_programs must be an integer >= 1"):
        CopyMethodThresholds(kernel_programs=0)


@pytest.mark.parametrize("value", ["0", "-2", "4097", "1000000", "many", "2.5", ""])
def test_a_bad_kernel_program_count_is_refused_when_the_engine_is_built(value, interpreter, monkeypatch):
    """Not at the first copy (a failed job, the run going on): the variable, its range and the fix, at once."""
    _, ((host, dev), _) = twin_pools("mha", "layer_first", 1)
    monkeypatch.setenv("KVTIER_KERNEL_PROGRAMS", value)
    for name in ("triton", "auto"):
        with pytest.raises(ConfigError, match=rf"KVTIER_KERNEL_PROGRAMS={value!r}: .*kernel_programs must be an integer >= 1, <= 4096; "
                                              r"got .*; set KVTIER_KERNEL_PROGRAMS within that range, or unset it for the default 16"):
            TransferEngine(host, dev, name)
    TransferEngine(host, dev, "direct").close()  # (a method without the setting does not read it)


def test_the_engine_reads_the_kernel_settings_once_when_built(interpreter, monkeypatch):
    spec, ((host, dev), (h_ref, d_ref)) = twin_pools("mla", "page_first", 3)
    host_pages, dev_pages = pages_for("shuffled", 3)
    monkeypatch.setenv("KVTIER_KERNEL_PROGRAMS", "4096")  # the bound itself is accepted
    engine = TransferEngine(host, dev, "triton")
    try:
        monkeypatch.setenv("KVTIER_KERNEL_PROGRAMS", "0")  # a change after the build leaves the engine alone
        engine.submit(Tier.HOST, Tier.DEVICE, host_pages, dev_pages).wait()
    finally:
        engine.close()
    for layer in range(spec.num_layers):
        load_pages_one_layer(h_ref, d_ref, host_pages, dev_pages, layer, get_io_backend("direct"))
    assert snapshot(host, dev) == snapshot(h_ref, d_ref)


def test_kvtier_run_refuses_a_bad_kernel_program_count_in_one_line():
    import os
    import subprocess
    import sys

    from support.cli import SMALL

    env = {**os.environ, "TRITON_INTERPRET": "1", "KVTIER_KERNEL_PROGRAMS": "0"}
    r = subprocess.run([sys.executable, "-m", "kvtier.app.cli", "run", "--no-progress", "--model", "hybrid", "--cache-io-backend", "triton",
                        *SMALL], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stdout == "", r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "KVTIER_KERNEL_PROGRAMS='0'" in r.stderr and "unset it" in r.stderr


# ---- a hybrid model's object pools move the same way ------------------------------------------------------
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_state_and_window_object_pools_move_bit_exact_by_address_list(layout, interpreter):
    from support.hybrid_models import hybrid_model

    model, _ = hybrid_model(window=8, state=True)
    for group in (g for g in model.groups if g.kind != "full"):
        spec = group.object_spec()
        pools = []
        for _ in range(2):
            host, dev = HostPool(spec, 6, layout), DevicePool(spec, 5)
            fill_random(host, 4)
            fill_random(dev, 5)
            pools.append((host, dev))
        (host, dev), (h_ref, d_ref) = pools
        host_pages, dev_pages = torch.tensor([4, 0, 2]), torch.tensor([1, 3, 0])
        for layer in range(spec.num_layers):
            load_pages_one_layer(host, dev, host_pages, dev_pages, layer, get_io_backend("triton"))
            load_pages_one_layer(h_ref, d_ref, host_pages, dev_pages, layer, get_io_backend("direct"))
        run_with_memmove(AddressPlan(dev, host, dev_pages, torch.tensor([5, 3, 1])).all_layers())
        backup_pages_all_layers(h_ref, d_ref, torch.tensor([5, 3, 1]), dev_pages, get_io_backend("direct"))
        assert [host.page_bytes(p) for p in range(6)] == [h_ref.page_bytes(p) for p in range(6)], group.name
        assert [dev.page_bytes(p) for p in range(5)] == [d_ref.page_bytes(p) for p in range(5)], group.name


# ---- the whole stack: the reference model served through the kernel ---------------------------------------
def test_kvtier_run_through_the_copy_kernel_is_bit_exact_with_recompute(tmp_path):
    """``kvtier run`` with every host<->device copy made by the Triton kernel (under its interpreter): logits
    bit-exact against recompute and the DSA indexer's top-k equal, with hits from device, host and L3."""
    import json
    import os
    import subprocess
    import sys

    from support.cli import SMALL

    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    r = subprocess.run([sys.executable, "-m", "kvtier.app.cli", "run", "--no-progress", "--json", "-", "--cache-io-backend", "triton",
                        "--storage-url", f"file://{tmp_path}/l3", *SMALL], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)
    assert all(report["hit_ratio"][tier] > 0 for tier in ("device", "host", "storage")), report["hit_ratio"]
    assert report["bytes_moved"]["host_to_device"] > 0 and report["bytes_moved"]["device_to_host"] > 0
    assert report["logits_bit_exact"] is True and report["indexer_topk_equal"] is True
