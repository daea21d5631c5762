"""The prepared GPU check runs its whole path on the CPU (worker thread, per-layer events), so the
script a lent GPU machine runs is kept working by the suite; and its bit-exact check is not vacuous."""

import json
import os
import subprocess
import sys

import kvtier.app.bench.gpu_check as gpu_check
from kvtier.core.plans import Tier
from kvtier.spec import KVSpec
from kvtier.transfer.engine import TransferEngine


def test_gpu_check_on_cpu_round_trips_bit_exact_and_measures():
    r = subprocess.run([sys.executable, "-m", "kvtier.app.bench.gpu_check", "--device", "cpu", "--pages", "16", "--layers", "2",
                        "--work", "128", "--reps", "2"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)
    assert report["bit_exact"] is True and len(report["round_trips"]) == 4
    assert {(t["spec"], t["layout"]) for t in report["round_trips"]} == {
        (s, lay) for s in ("deepseek-v3.2", "llama-3.1-8b") for lay in ("layer_first", "page_first")
    }
    assert ["latent", "indexer"] in [t["buffers"] for t in report["round_trips"]]  # the DSA indexer travels too
    assert (
        report["load_gbps"] > 0
        and report["copy_gbps"] > 0
        and abs(report["load_over_copy"] - report["load_gbps"] / report["copy_gbps"]) < 0.01
    )
    assert [(t["layout"], t["direction"], t["host_pages"]) for t in report["transfers"]] == [
        (layout, direction, pages)
        for layout in ("layer_first", "page_first")
        for direction in ("load", "backup")
        for pages in ("one run", "shuffled")
    ]
    assert all(
        t["gbps"] > 0 and t["copy_gbps"] > 0 and abs(t["over_copy"] - t["gbps"] / t["copy_gbps"]) < 0.01 for t in report["transfers"]
    )
    assert report["load_gbps"] == report["transfers"][0]["gbps"]
    assert report["serial_ms"] > 0 and report["overlapped_ms"] > 0
    trip = report["cache_round_trip"]  # the policy core + local executor, evicted to host and loaded back
    assert trip["bit_exact"] is True and trip["evicted"] == trip["backed_up"] == trip["pages"] == 16 and trip["hit_device_host"] == [0, 16]
    assert report["layered_save"] == {"spec": "llama-3.1-8b", "pages": 16, "layers": 2, "bit_exact": True}
    region = report["service_region"]  # through a node service region mapped as an engine maps it (no CUDA here: not registered)
    assert region["bit_exact"] is True and region["registered"] is False and region["pages"] == 16
    assert region["region_gbps"] > 0 and abs(region["region_over_own"] - region["region_gbps"] / region["own_pool_gbps"]) < 0.01
    # the copy methods: its first lines say what the machine resolves; here no driver, no GPU
    assert list(report)[2] == "probes" and report["probes"]["cuMemcpyBatchAsync"]["resolved"] is False
    assert report["probes"]["triton_reads_pinned_host"] == {"ok": False, "detail": "no CUDA device"}
    assert report["methods"] == ["direct"] and sorted(report["methods_skipped"]) == ["dma", "kernel", "kernel_capped"]
    assert all("use 'direct'" in why for why in report["methods_skipped"].values())
    assert [(t["spec"], t["layout"], t["direction"], t["host_pages"]) for t in report["method_transfers"]] == [
        (spec, layout, direction, pages) for spec in ("deepseek-v3.2", "llama-3.1-8b") for layout in ("layer_first", "page_first")
        for direction in ("load", "backup") for pages in ("one run", "shuffled")]
    assert all(t["method"] == "direct" and t["gbps"] > 0 for t in report["method_transfers"])
    assert [o["method"] for o in report["method_overlap"]] == ["direct"] and report["method_overlap"][0]["serial_ms"] > 0
    assert report["thresholds"] == {"skipped": "no CUDA device"}


def test_gpu_check_runs_the_copy_kernel_under_the_interpreter():
    """The kernel methods through the check's whole path (engines, round trips, overlap) on CPU tensors."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    r = subprocess.run([sys.executable, "-m", "kvtier.app.bench.gpu_check", "--device", "cpu", "--pages", "4", "--layers", "1",
                        "--work", "32", "--reps", "1"], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)
    assert report["methods"] == ["direct", "kernel", "kernel_capped"] and list(report["methods_skipped"]) == ["dma"]
    trips = [(t["method"], t["spec"], t["layout"], t["bit_exact"]) for t in report["method_round_trips"]]
    assert trips == [(m, s, lay, True) for m in report["methods"] for s in ("deepseek-v3.2", "llama-3.1-8b")
                     for lay in ("layer_first", "page_first")]
    assert len(report["method_transfers"]) == 3 * 16 and report["bit_exact"] is True


def test_gpu_check_catches_a_layered_save_that_copies_before_the_layer_is_written(monkeypatch):
    class CopiesAtSubmit(TransferEngine):
        def release_layer(self, job, layer):
            pass  # the layers were all copied at submit, before the forward wrote them

        def submit(self, *a, **k):
            job = super().submit(*a, **k)
            if k.get("layered"):
                for layer in range(self.num_layers):  # copies every layer before the forward wrote it
                    TransferEngine.release_layer(self, job, layer)
                job.wait()
            return job

    monkeypatch.setattr(gpu_check, "TransferEngine", CopiesAtSubmit)
    spec = KVSpec.preset("llama-3.1-8b").with_(num_layers=2)
    assert gpu_check.layered_save(spec, gpu_check.torch.device("cpu"), 8, 64)["bit_exact"] is False


def test_gpu_check_catches_a_load_that_skips_a_layer(monkeypatch):
    class SkipsLayerZero(TransferEngine):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            real = self.handlers[(Tier.HOST, Tier.DEVICE)]

            def skip(engine, job, layer_done):
                real(engine, job, layer_done)
                # then undo layer 0 on the device side: the bytes of a load that "forgot" a layer
                for b in engine.device.spec.buffers:
                    engine.device.rows(b.name, 0)[job.dst_pages] = 0

            self.handlers[(Tier.HOST, Tier.DEVICE)] = skip

    monkeypatch.setattr(gpu_check, "TransferEngine", SkipsLayerZero)
    spec = KVSpec.preset("deepseek-v3.2").with_(num_layers=2)
    assert gpu_check.round_trip(spec, "page_first", gpu_check.torch.device("cpu"), 8)["bit_exact"] is False


def test_gpu_check_default_device():
    """Where CUDA is, the default run is the check itself; elsewhere one line and exit 2 saying what to do."""
    r = subprocess.run(
        [sys.executable, "-m", "kvtier.app.bench.gpu_check", "--pages", "16", "--layers", "2", "--work", "128", "--reps", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if gpu_check.torch.cuda.is_available():
        assert r.returncode == 0 and json.loads(r.stdout)["bit_exact"] is True, r.stderr[-2000:]
    else:
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--device cpu" in r.stderr


def test_gpu_check_skips_the_methods_its_time_budget_leaves_no_room_for():
    report = gpu_check.run_gpu_check("cpu", pages=4, reps=1, layers=1, work=16, budget_s=0.0)
    assert report.methods == [] and "time budget" in report.methods_skipped["direct"]
    assert report.method_transfers == [] and report.bit_exact is True and report.round_trips  # the other checks still ran
