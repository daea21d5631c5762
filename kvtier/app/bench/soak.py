"""``kvtier bench service --soak N``: the node service under crashes, every output compared with recompute.

Two ``kvtier serve`` services (``--verify-sample 1``: every hit verified; ``--keep-region``: a SIGTERM
leaves its region too) -- one for a full-attention model, one for a hybrid model (a service serves one page
format) -- and five clients of them, each a process of its own:

* two engines (:class:`~kvtier.app.engine.ReferenceEngine` over :class:`~kvtier.app.model.ReferenceModel`, an
  MLA+DSA model, the same model in both so that they share pages) serving a multi-turn chat workload with a
  device pool smaller than a conversation, so turns come back as host hits from the service -- each
  request's logits compared bit for bit with the same request recomputed with nothing cached;
* two hybrid engines (:class:`~kvtier.app.engine.HybridEngine` over the hybrid reference model: MLA+DSA,
  sliding-window and linear-attention layers) doing the same on the hybrid service, whose region keeps their
  window pages and state snapshots beside the pages (object pools);
* a raw writer (:class:`~kvtier.service.client.ServiceClient`) that writes pages layer by layer, slowly
  (a copy in flight), publishes them, and reads back what it published before, each byte checked.

Each cycle, after a random time (``min_gap_s`` to ``max_gap_s``), one of them -- an engine, a service or
the writer (killed mid-copy, where it spends most of its time) -- gets SIGKILL or SIGTERM at random, and is
started again. Reported: cycles, kills, requests, wrong outputs (logits that differ from recompute) and wrong
writer pages (must be 0), stuck leases (pages still leased, held or parked once every client has exited and
a restart's grace -- :data:`~kvtier.service.records.QUARANTINE_S` -- has passed: 0), restarts that failed (a process that did
not come back within the bound, or died unasked, or a restarted service whose clients did not all attach
again within it: 0), the host
pages kept across service restarts (pages the restarted service adopted against pages it held just before
the kill), and the restart TTFT: a restarted engine on a restarted service (one of its own, of ``kvtier run``'s
reference model, a 1,024-token prompt), its prompt a host hit from the adopted region, against an engine with
its own host tier hitting the same prompt on host (each engine serves an unrelated prompt first; medians of
``ttft_trials`` trials, alternating; the issue's target <= 1.2x).

Every process is forked from a fork server that imported kvtier once (``multiprocessing``'s forkserver),
so a restart costs milliseconds, not an interpreter's start; each client logs one JSON line per request
(one ``write`` each, so a kill never leaves half a line) to a file the bench reads at the end.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import random
import shutil
import signal
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import xxhash

from kvtier.app.engine import HybridEngine, ReferenceEngine
from kvtier.app.model import ModelConfig, ReferenceModel
from kvtier.app.model.hybrid import FULL, HybridConfig, HybridReferenceModel
from kvtier.build import build_cache, build_hybrid_cache
from kvtier.config import TierConfig
from kvtier.core import NullCache
from kvtier.errors import ServiceError
from kvtier.layout import DEFAULT_HOST_LAYOUT
from kvtier.pools import DevicePool, HostPool
from kvtier.service.client import ServiceClient, query_status
from kvtier.service.region import RegionFormat

#: a small MLA+DSA reference model: a request costs milliseconds, so a cycle is mostly kills and restarts
SOAK_MODEL = ModelConfig(vocab_size=512, hidden=64, num_layers=2, num_heads=2, qk_nope_dim=16, qk_rope_dim=16, v_head_dim=16,
                         kv_lora_rank=32, index_heads=2, index_head_dim=32, quant_block_size=32, index_topk=64, mlp_hidden=128,
                         page_size=16)
#: the chat workload: conversations of a shared system prompt and turns of user text
CONVERSATIONS, TURNS, SYSTEM_TOKENS, TURN_TOKENS = 8, 4, 64, 48
#: each engine's device pool (pages): less than one conversation's last turn and the recompute's, so turns leave it
DEVICE_PAGES = 24
#: each engine's share of the service's region, and the region (pages)
HOST_SHARE_PAGES, REGION_PAGES = 96, 320
#: the writer's pages per batch, and batches it cycles through (so its lookups find what it published before)
WRITER_PAGES, WRITER_BATCHES = 4, 16
#: the restart TTFT's model and prompt: kvtier run's reference model (its default), a 32-page (1,024-token) prompt --
#: a request's work, so that what is timed is a restart's cost against a request's, not against a toy's few ms
TTFT_MODEL, TTFT_PAGES, TTFT_DEVICE_PAGES, TTFT_REGION_PAGES = ModelConfig(), 32, 96, 1024
#: how long a restarted process may take to come back (s): generous, for a loaded machine
RESTART_BOUND_S = 60.0
#: how long the clients may take to exit cleanly at the end, the service to end their sessions, and a restart's
#: grace to pass (s: past :data:`~kvtier.service.records.QUARANTINE_S`)
EXIT_BOUND_S = 90.0
#: the hybrid engines' model: the soak model's full layers, with sliding-window (two pages) and linear-attention layers
SOAK_HYBRID = HybridConfig(base=SOAK_MODEL, window=32, swa_heads=2, swa_head_dim=16, state_heads=2, state_dim=8, state_every=2)
#: the engines of each service, the services, and every process a cycle may kill
ENGINES = {"service": ("engine-a", "engine-b"), "hybrid-service": ("hybrid-a", "hybrid-b")}
SERVICES = tuple(ENGINES)
VICTIMS = ("engine-a", "engine-b", "hybrid-a", "hybrid-b", "service", "hybrid-service", "writer")
#: every client: the engines and the writer (of the full-attention service)
CLIENTS = (*ENGINES["service"], *ENGINES["hybrid-service"], "writer")
SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGTERM": signal.SIGTERM}


@dataclass(frozen=True)
class SoakConfig:
    cycles: int
    seed: int = 0
    min_gap_s: float = 0.1
    max_gap_s: float = 0.5
    ttft_trials: int = 9


@dataclass
class SoakReport:
    cycles: int
    kills: dict[str, int]
    signals: dict[str, int]
    requests: int  # every engine's, the hybrid ones' among them
    host_hit_requests: int  # engine requests that took at least one page from the service
    hybrid_requests: int
    hybrid_host_hit_requests: int
    wrong_outputs: int  # requests whose logits differ from recompute (must be 0)
    writer_pages_checked: int
    writer_wrong_pages: int  # pages the writer read back that were not what it wrote under that key (must be 0)
    stuck_leases: int  # pages leased, held or parked once every client exited and a restart's grace passed (must be 0)
    failed_restarts: int  # processes that did not come back within the bound (must be 0)
    crashed: int  # processes that died without being killed, or exited uncleanly at the end (must be 0)
    service_restarts: int  # of both services
    host_pages_before_kills: int  # pages (and objects) a service held just before each of its kills (summed)
    host_pages_adopted: int  # of them, pages the restarted service offered again (verified)
    host_pages_kept: float  # adopted / before
    corrupt_pages: int  # pages a verified hit found changed (the last service's count)
    restart_ttft: dict = field(default_factory=dict)
    seconds: float = 0.0


# ---- the processes (forked from the fork server: module-level functions) ----------------------------
def _log_line(path: str, record: dict) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())  # (one write: a kill leaves the line whole or absent)
    finally:
        os.close(fd)


def _quiet(workdir: str, name: str) -> None:
    logging.basicConfig(filename=os.path.join(workdir, f"{name}.log"), level=logging.WARNING, force=True)


def _orphaned(parent: int) -> bool:
    """Whether the fork server this process came from is gone (the bench was killed): then it ends too."""
    return os.getppid() != parent


def _service_main(sock: str, workdir: str, host_gb: float, name: str = "service") -> None:
    from kvtier.service.server import NodeService, ServeConfig

    _quiet(workdir, name)
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    service = NodeService(ServeConfig(host_gb=host_gb, socket=sock, verify_sample=1.0, keep_region=True))
    parent = os.getppid()
    try:
        service.serve(lambda: bool(stop) or _orphaned(parent), tick_s=0.05)
    finally:
        service.close()
        if _orphaned(parent) and service.region is not None:  # (the bench is gone: nobody will adopt or remove it)
            shutil.rmtree(os.path.dirname(service.region.path), ignore_errors=True)


def conversation_tokens(conv: int, turn: int) -> list[int]:
    """The prompt of conversation ``conv`` at turn ``turn`` (0-based): the shared system prompt, then its turns."""
    system = random.Random(-1).choices(range(SOAK_MODEL.vocab_size), k=SYSTEM_TOKENS)
    turns = random.Random(conv).choices(range(SOAK_MODEL.vocab_size), k=TURN_TOKENS * TURNS)
    return system + turns[: TURN_TOKENS * (turn + 1)]


def _engine_main(sock: str, workdir: str, name: str, seed: int) -> None:
    _quiet(workdir, name)
    torch.set_num_threads(1)
    out, stop = os.path.join(workdir, f"{name}.jsonl"), os.path.join(workdir, "stop")
    model = ReferenceModel(SOAK_MODEL)
    spec = SOAK_MODEL.kv_spec()
    cache = build_cache(spec, TierConfig(device_pages=DEVICE_PAGES, host_pages=HOST_SHARE_PAGES, service=sock))
    engine = ReferenceEngine(model, cache)
    pages = -(-(SYSTEM_TOKENS + TURN_TOKENS * TURNS) // spec.page_size) + 1
    baseline = ReferenceEngine(model, NullCache(DevicePool(spec, pages)))
    _serve_chat(out, stop, seed, engine, baseline, cache)


def _hybrid_engine_main(sock: str, workdir: str, name: str, seed: int) -> None:
    """:func:`_engine_main` with the hybrid reference model on the hybrid service."""
    _quiet(workdir, name)
    torch.set_num_threads(1)
    out, stop = os.path.join(workdir, f"{name}.jsonl"), os.path.join(workdir, "stop")
    model, spec = HybridReferenceModel(SOAK_HYBRID), SOAK_HYBRID.model_spec()
    cache = build_hybrid_cache(spec, TierConfig(device_pages=DEVICE_PAGES, host_pages=HOST_SHARE_PAGES, service=sock),
                               state_every=SOAK_HYBRID.state_every)
    groups = {n: d for n, (d, _h) in cache.group_pools.items()}
    engine = HybridEngine(model, cache, {FULL: cache.device, **groups})
    pages = -(-(SYSTEM_TOKENS + TURN_TOKENS * TURNS) // SOAK_MODEL.page_size) + 1
    base_groups = {n: DevicePool(d.spec, pages) for n, d in groups.items()}
    null = NullCache(DevicePool(spec.group(FULL).attention, pages), base_groups)
    baseline = HybridEngine(model, null, {FULL: null.device, **base_groups})
    _serve_chat(out, stop, seed, engine, baseline, cache)


def _serve_chat(out: str, stop: str, seed: int, engine, baseline, cache) -> None:
    """An engine's loop: random turns of the chat until told to stop, each output against recompute, one line each."""
    _log_line(out, {"ready": os.getpid()})
    rng = random.Random(seed * 7919 + os.getpid())
    parent = os.getppid()
    while not os.path.exists(stop) and not _orphaned(parent):
        toks = conversation_tokens(rng.randrange(CONVERSATIONS), rng.randrange(TURNS))
        got, want = engine.prefill(toks), baseline.prefill(toks)
        _log_line(out, {"wrong": not torch.equal(got.logits, want.logits), "host": got.host_hit_tokens})
    try:
        cache.wait_idle()
        cache.check_integrity(idle=True)
        cache.close()
        _log_line(out, {"exit": "ok"})
    except Exception as e:  # (counted by the bench: a book that does not add up is a failure of the run)
        _log_line(out, {"exit": f"{type(e).__name__}: {e}"})


def writer_bytes(spec, key: bytes) -> dict[str, torch.Tensor]:
    """What the writer writes under ``key``: per buffer, ``[layers, page_bytes]`` of bytes seeded by the key."""
    g = torch.Generator().manual_seed(xxhash.xxh3_64_intdigest(key) >> 1)  # (every key its own bytes)
    return {b.name: torch.randint(0, 256, (spec.num_layers, b.page_bytes), dtype=torch.uint8, generator=g) for b in spec.buffers}


def _writer_main(sock: str, workdir: str) -> None:
    _quiet(workdir, "writer")
    torch.set_num_threads(1)
    out, stop = os.path.join(workdir, "writer.jsonl"), os.path.join(workdir, "stop")
    spec = SOAK_MODEL.kv_spec()
    fmt = RegionFormat.of(spec, DEFAULT_HOST_LAYOUT)
    client, pool, batch = None, None, 0
    parent = os.getppid()
    while not os.path.exists(stop) and not _orphaned(parent):
        try:
            if client is None:
                client = ServiceClient(sock, "soak-writer", fmt, deadline_s=2.0)
                pool = HostPool(spec, client.num_pages, DEFAULT_HOST_LAYOUT, memory=client.map_region(pin=False))
            keys = [f"writer-{batch}-{j}".encode().ljust(16, b".") for j in range(WRITER_PAGES)]
            got = client.lookup(keys)
            wrong = 0
            for page, key in zip(got, keys):
                want = writer_bytes(spec, key)
                wrong += any(not torch.equal(pool.layout.page_layers(pool.buffers[n], page), want[n]) for n in want)
            client.release(got)
            pages = client.reserve(WRITER_PAGES)
            for page, key in zip(pages, keys):
                for n, rows in writer_bytes(spec, key).items():
                    for layer in range(spec.num_layers):  # (slowly: a copy in flight, which the kills land in)
                        pool.layout.page_layers(pool.buffers[n], page)[layer].copy_(rows[layer])
                        time.sleep(0.002)
            client.publish(pages, keys[: len(pages)])
            client.release(pages)
            _log_line(out, {"checked": len(got), "wrong": wrong})
            batch = (batch + 1) % WRITER_BATCHES
        except ServiceError:
            client = None  # (the service is gone or restarting: attach again)
            time.sleep(0.05)
    if client is not None:
        client.close()
    _log_line(out, {"exit": "ok"})


# ---- the bench ------------------------------------------------------------------------------------
class _Soak:
    """The soak's processes: ``sock`` (default: in ``workdir``) is the full-attention service's; the hybrid service's is
    beside it, its region as many pages of the hybrid format (``hybrid``: whether there is one)."""

    def __init__(self, workdir: str, rng: random.Random, sock: str | None = None, model: ModelConfig = SOAK_MODEL,
                 region_pages: int = REGION_PAGES, hybrid: bool = True):
        self.workdir, self.rng = workdir, rng
        self.sock = sock or os.path.join(workdir, "run", "node.sock")
        self.socks = {"service": self.sock}
        self.host_gb = {"service": region_pages * model.kv_spec().page_bytes / (1 << 30)}
        if hybrid:
            self.socks["hybrid-service"] = os.path.join(os.path.dirname(self.sock), "hybrid.sock")
            spec = SOAK_HYBRID.model_spec()
            others = [g.object_spec().page_bytes for g in spec.groups if g.kind != "full"]
            self.host_gb["hybrid-service"] = region_pages * (spec.group(FULL).attention.page_bytes + sum(others)) / (1 << 30)
        self.ctx = multiprocessing.get_context("forkserver")
        self.ctx.set_forkserver_preload([__name__])
        self.procs: dict[str, multiprocessing.Process] = {}
        self.failed_restarts = self.crashed = 0

    def start(self, name: str) -> bool:
        """Start ``name`` and wait until it is up; False if it did not come up within the bound."""
        if name in SERVICES:
            target, args = _service_main, (self.socks[name], self.workdir, self.host_gb[name], name)
        elif name == "writer":
            target, args = _writer_main, (self.sock, self.workdir)
        elif name in ENGINES["hybrid-service"]:
            target, args = _hybrid_engine_main, (self.socks["hybrid-service"], self.workdir, name, self.rng.randrange(1 << 30))
        else:
            target, args = _engine_main, (self.sock, self.workdir, name, self.rng.randrange(1 << 30))
        proc = self.procs[name] = self.ctx.Process(target=target, args=args, name=f"kvtier-soak-{name}", daemon=True)
        proc.start()
        if name in SERVICES:
            return self._wait(lambda: self._status(name) is not None)
        if name.startswith("engine"):
            return self._wait(lambda: any(r.get("ready") == proc.pid for r in self.records(name)))
        return True

    def _wait(self, check) -> bool:
        deadline = time.monotonic() + RESTART_BOUND_S
        while time.monotonic() < deadline:
            if check():
                return True
            time.sleep(0.02)
        return False

    def _status(self, service: str = "service") -> dict | None:
        try:
            return query_status(self.socks[service], deadline_s=2.0)
        except ServiceError:
            return None

    def records(self, name: str) -> list[dict]:
        try:
            text = Path(self.workdir, f"{name}.jsonl").read_text()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in text.splitlines() if line]

    def kill(self, name: str, sig: int) -> None:
        proc = self.procs[name]
        if proc.is_alive():
            os.kill(proc.pid, sig)
        proc.join(RESTART_BOUND_S)
        if proc.is_alive():  # (a SIGTERMed service that does not close in time: counted, then killed)
            self.failed_restarts += 1
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(RESTART_BOUND_S)

    def stop_service(self) -> None:
        """SIGTERM the services and remove the regions they keep (``--keep-region``)."""
        for name in self.socks:
            if name not in self.procs:
                continue
            region = (self._status(name) or {}).get("region")
            self.kill(name, signal.SIGTERM)
            if region is not None:
                shutil.rmtree(os.path.dirname(region), ignore_errors=True)

    def revive_crashed(self) -> None:
        """Start again any process that died without being killed (counted)."""
        for name, proc in list(self.procs.items()):
            if not proc.is_alive():
                self.crashed += 1
                if not self.start(name):
                    self.failed_restarts += 1


def run_soak(config: SoakConfig) -> SoakReport:
    rng = random.Random(config.seed)
    started = time.monotonic()
    kills = dict.fromkeys(VICTIMS, 0)
    signals = dict.fromkeys(SIGNALS, 0)
    before = adopted = 0
    with tempfile.TemporaryDirectory(prefix="kvtier-soak-") as workdir:
        soak = _Soak(workdir, rng)
        regions: dict[str, str | None] = dict.fromkeys(SERVICES)
        try:
            for name in (*SERVICES, *CLIENTS):
                if not soak.start(name):
                    raise RuntimeError(f"the soak's {name} did not start within {RESTART_BOUND_S:g} s; see {workdir}/{name}.log")
            regions = {name: soak._status(name)["region"] for name in SERVICES}
            for _cycle in range(config.cycles):
                time.sleep(rng.uniform(config.min_gap_s, config.max_gap_s))
                soak.revive_crashed()
                victim, sig = rng.choice(VICTIMS), rng.choice(list(SIGNALS))
                kills[victim] += 1
                signals[sig] += 1
                held = soak._status(victim) if victim in SERVICES else None
                soak.kill(victim, SIGNALS[sig])
                if not soak.start(victim):
                    soak.failed_restarts += 1
                    continue
                if victim in SERVICES:
                    st = soak._status(victim) or {}
                    before += (held or {}).get("ready", 0)
                    adopted += st.get("adopted", {}).get("pages", 0)
                    regions[victim] = st.get("region") or regions[victim]
                    # (back means its clients are back: its engines (and the writer) attached again on their own)
                    clients = len(ENGINES[victim]) + (victim == "service")
                    if not soak._wait(lambda v=victim, n=clients: (soak._status(v) or {}).get("clients", 0) >= n):
                        soak.failed_restarts += 1
            report = _finish(soak, config, kills, signals, before, adopted)
        finally:
            Path(workdir, "stop").touch()
            for name, proc in soak.procs.items():
                if name in SERVICES and proc.is_alive():
                    regions[name] = (soak._status(name) or {}).get("region") or regions[name]
                    os.kill(proc.pid, signal.SIGTERM)
                proc.join(EXIT_BOUND_S)
                if proc.is_alive():
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.join(10)
            for region in regions.values():  # (the services keep their regions on SIGTERM here: removed with their directories)
                if region is not None:
                    shutil.rmtree(os.path.dirname(region), ignore_errors=True)
    report.seconds = round(time.monotonic() - started, 1)
    return report


def stuck_leases(status_of, bound_s: float) -> tuple[int, dict]:
    """Once a service's clients are gone: the pages it still has leased, held or parked (stuck; -1 for a service that never
    answered), and its last status. ``status_of()`` is its status (None: no answer); waited for, up to ``bound_s``, until
    it has no client, no orphaned session, nothing parked and no adoption held back."""
    status = None
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        status = status_of()
        if status is not None and status["clients"] == status["orphaned"] == status.get("parked_pages", 0) == 0 and not (
                status.get("adoption_held")):
            break
        time.sleep(0.05)
    status = status or {}
    return status.get("writing", -1) + status.get("held", 0) + status.get("parked_pages", 0), status


def _finish(soak: _Soak, config: SoakConfig, kills, signals, before: int, adopted: int) -> SoakReport:
    """Stop the clients cleanly, count what they logged and what the services still hold, then time restarts."""
    Path(soak.workdir, "stop").touch()
    for name in CLIENTS:
        proc = soak.procs[name]
        proc.join(EXIT_BOUND_S)
        last = (soak.records(name) or [{}])[-1]
        if proc.is_alive() or last.get("exit") != "ok":
            soak.crashed += 1
    # (every client gone, and whatever a restart parked or held back: a page still leased, held or parked then is stuck)
    stuck = corrupt = 0
    for service in SERVICES:
        held, status = stuck_leases(lambda s=service: soak._status(s), EXIT_BOUND_S)
        stuck += held
        corrupt += status.get("corrupt_pages", 0)
    engine = [r for name in CLIENTS[:-1] for r in soak.records(name) if "wrong" in r]
    hybrid = [r for name in ENGINES["hybrid-service"] for r in soak.records(name) if "wrong" in r]
    writer = [r for r in soak.records("writer") if "checked" in r]
    # (on a service of its own: the soaked one's region is full of pages its last restart holds for a while)
    timing = _Soak(soak.workdir, soak.rng, os.path.join(soak.workdir, "ttft", "node.sock"), TTFT_MODEL, TTFT_REGION_PAGES, hybrid=False)
    try:
        ttft = _restart_ttft(timing, config.ttft_trials) if timing.start("service") else {"trials": 0, "all_host_hits": False}
    finally:
        timing.stop_service()
        soak.failed_restarts += timing.failed_restarts
    return SoakReport(
        cycles=config.cycles, kills=kills, signals=signals, requests=len(engine), host_hit_requests=sum(r["host"] > 0 for r in engine),
        hybrid_requests=len(hybrid), hybrid_host_hit_requests=sum(r["host"] > 0 for r in hybrid),
        wrong_outputs=sum(r["wrong"] for r in engine), writer_pages_checked=sum(r["checked"] for r in writer),
        writer_wrong_pages=sum(r["wrong"] for r in writer), stuck_leases=stuck, failed_restarts=soak.failed_restarts,
        crashed=soak.crashed, service_restarts=kills["service"] + kills["hybrid-service"], host_pages_before_kills=before,
        host_pages_adopted=adopted, host_pages_kept=round(adopted / before, 3) if before else 0.0, corrupt_pages=corrupt,
        restart_ttft=ttft)


def _restart_ttft(soak: _Soak, trials: int) -> dict:
    """A restarted engine on a restarted service against an engine's own host tier, the same prompt a host hit on
    each side: TTFT medians (ms), their ratio and difference -- and, on a second prompt of each trial, the cache's
    own part of it (``begin``: the lookup and adopting the pages, then waiting for the loads; medians, ms), which is
    where the two sides differ: the model's compute is the same on both, and on this VM it varies by a third from
    one request to the next. Each trial's prompts are new (nobody has them yet)."""
    torch.set_num_threads(1)
    model, spec = ReferenceModel(TTFT_MODEL), TTFT_MODEL.kv_spec()
    tiers = {"device_pages": TTFT_DEVICE_PAGES, "host_pages": TTFT_REGION_PAGES // 2}
    ttft: dict[str, list[float]] = {"service": [], "own": []}
    path: dict[str, list[float]] = {"service": [], "own": []}
    hits = []

    def warmed(cache) -> ReferenceEngine:  # (an unrelated prompt first, on both sides, as the vLLM row's sessions do)
        engine = ReferenceEngine(model, cache)
        engine.prefill(random.Random().choices(range(TTFT_MODEL.vocab_size), k=spec.page_size * 4))
        return engine

    for trial in range(trials):
        gen = random.Random(10_000 + trial)
        toks, other = (gen.choices(range(TTFT_MODEL.vocab_size), k=spec.page_size * TTFT_PAGES) for _ in range(2))
        usable = (len(toks) - 1) // spec.page_size
        for side in ("service", "own") if trial % 2 == 0 else ("own", "service"):
            if side == "service":
                first = build_cache(spec, TierConfig(**tiers, service=soak.sock))
                for prompt in (toks, other):
                    ReferenceEngine(model, first).prefill(prompt)
                first.wait_idle()  # (its backups published)
                first.close()
                # (publishes are notes: once its bye -- sent after them -- is applied, they are, and the kill loses none)
                soak._wait(lambda: (soak._status() or {}).get("clients") == 0)
                soak.kill("service", signal.SIGKILL)
                if not soak.start("service"):
                    soak.failed_restarts += 1
                    continue
                cache = build_cache(spec, TierConfig(**tiers, service=soak.sock))
                engine = warmed(cache)
            else:
                cache = build_cache(spec, TierConfig(**tiers))
                engine = warmed(cache)
                for prompt in (toks, other):
                    engine.prefill(prompt)
                cache.wait_idle()
                cache.evict_device(TTFT_DEVICE_PAGES)  # (on host only now)
            result = engine.prefill(toks)
            ttft[side].append(result.ttft_s * 1e3)
            started = time.perf_counter()
            req = cache.begin(other, usable_pages=usable)
            loaded = req.wait()
            path[side].append((time.perf_counter() - started) * 1e3)
            req.abort()
            hits.append(result.host_hit_tokens == usable * spec.page_size and loaded >= usable)  # (an own tree has the last page too)
            cache.wait_idle()
            cache.close()
    if not ttft["service"] or not ttft["own"]:
        return {"trials": trials, "all_host_hits": False}
    s, o = statistics.median(ttft["service"]), statistics.median(ttft["own"])
    ps, po = statistics.median(path["service"]), statistics.median(path["own"])
    return {"trials": trials, "prompt_tokens": spec.page_size * TTFT_PAGES, "service_restarted_ms": round(s, 3),
            "in_process_host_ms": round(o, 3), "ratio": round(s / o, 3), "difference_ms": round(s - o, 3),
            "cache_path_service_ms": round(ps, 3), "cache_path_in_process_ms": round(po, 3), "cache_path_difference_ms": round(ps - po, 3),
            "all_host_hits": all(hits)}


def as_json(report: SoakReport) -> dict:
    return {"date": time.strftime("%Y-%m-%d"), "soak": asdict(report)}
