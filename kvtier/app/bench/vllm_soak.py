"""``kvtier bench service --vllm-soak N``: ``vllm serve`` on the node service under crashes, its text compared with vLLM alone.

The vLLM version of :mod:`kvtier.app.bench.soak`, with fewer cycles (a ``vllm serve`` start costs tens of seconds on a
CPU). One ``kvtier serve`` (``--verify-sample 1``: every hit verified; ``--keep-region``: a SIGTERM leaves its region
for the next service) and one ``vllm serve`` with kvtier's connector attached to it, its default multi-process engine
(API server, engine core, worker). First the same ``vllm serve`` without kvtier answers every prompt of a multi-turn
workload (conversations sharing a system prompt, each turn the history plus new text; greedy): that text is what every
later answer must equal. Then, each cycle:

1. a client runs the workload against the server (each answer compared);
2. after a random time (``min_gap_s`` to ``max_gap_s``: mid-request), ``vllm serve`` (its whole process group: API
   server, engine core, worker) or the service gets SIGKILL or SIGTERM, and is started again -- a request cut by
   the server's own kill is counted as interrupted; every other request must be answered, and answered right, while
   the service is down and after it comes back;
3. once the engine is attached to the service again, vLLM's own prefix cache is emptied and the workload runs once
   more: each answer compared, and the tokens loaded from the service's host tier counted (vLLM's ``/metrics``) --
   after a service restart they come from the region the new service adopted and verified.

At the end the server stops (SIGTERM) and the service must hold nothing for anyone: no page leased, held or parked
(stuck leases: 0). Reported: cycles, kills per victim and signal, requests, wrong answers (must be 0), requests
that failed though the server was up (must be 0), interrupted ones, restarts that failed (0), stuck leases (0), the
host tokens the check passes loaded after each kind of restart, and the seconds a restart took to serve again.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvtier.app.bench.soak import stuck_leases
from kvtier.app.devservers import NodeServiceProcess, VllmServer
from kvtier.errors import ServiceError
from kvtier.service.client import query_status

#: the models this soak runs, by name -> the function that writes (or finds) the model's directory
MODEL_NAMES = ("tiny-gemma3-5to1", "smollm2")
#: the workload: conversations, turns each, a shared system prompt and each turn's new tokens; answers of
#: ``MAX_TOKENS`` tokens, greedy
CONVERSATIONS, TURNS, SYSTEM_TOKENS, TURN_TOKENS, MAX_TOKENS = 2, 3, 160, 72, 8
#: vLLM's block size here (a multiple of kvtier's page), float32 (greedy text is then the same whatever the batch)
BLOCK_SIZE = 32
VICTIMS = ("vllm", "service")
SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGTERM": signal.SIGTERM}
#: how long a restarted process may take to serve again, and the engine to attach to a restarted service (s)
RESTART_BOUND_S, ATTACH_BOUND_S = 300.0, 60.0
#: how long the service may take to end the stopped engine's sessions at the end (s: past a restart's grace)
EXIT_BOUND_S = 90.0


@dataclass(frozen=True)
class VllmSoakConfig:
    cycles: int
    seed: int = 0
    model: str = "tiny-gemma3-5to1"
    min_gap_s: float = 0.2
    max_gap_s: float = 3.0

    def __post_init__(self):
        if self.model not in MODEL_NAMES:
            from kvtier.errors import ConfigError

            raise ConfigError(f"--vllm-soak-model {self.model!r}: choose one of {', '.join(MODEL_NAMES)}")


@dataclass
class VllmSoakReport:
    cycles: int
    model: str
    kills: dict[str, int]
    signals: dict[str, int]
    requests: int  # answered ones, compared with vLLM alone
    wrong_answers: int  # must be 0
    failed_requests: int  # requests that failed while vllm serve was up (the service down is not a reason): must be 0
    interrupted_requests: int  # cut by a kill of vllm serve itself
    failed_restarts: int  # must be 0
    stuck_leases: int  # pages leased, held or parked once the server stopped (must be 0)
    #: host tokens the check pass after each kind of restart loaded from the service (summed), and the passes that loaded any
    host_tokens_after: dict[str, int] = field(default_factory=dict)
    host_hit_passes: dict[str, int] = field(default_factory=dict)
    #: median seconds from a kill to serving again (vllm: healthy; service: the engine attached to the new one)
    restart_s: dict[str, float] = field(default_factory=dict)
    #: the region's object pools (a hybrid model's window groups) and the objects lookups found in them (the last service's)
    object_pools: list[str] = field(default_factory=list)
    found_objects: int = 0
    corrupt_pages: int = 0  # pages a verified hit found changed (the last service's count)
    seconds: float = 0.0


def _model_dir(name: str) -> str:
    from kvtier.integrations.vllm.model import ensure_model, ensure_tiny_gemma3_5to1

    return str(ensure_tiny_gemma3_5to1() if name == "tiny-gemma3-5to1" else ensure_model())


def workload(seed: int) -> list[list[int]]:
    """The prompts, in the order one pass sends them: turn by turn, the conversations interleaved."""
    from kvtier.integrations.vllm.session import prompt_ids

    system = prompt_ids(SYSTEM_TOKENS, seed=seed)
    turns = [[prompt_ids(TURN_TOKENS, seed=seed * 1_000 + 10 * c + t + 1) for t in range(TURNS)] for c in range(CONVERSATIONS)]
    return [system + sum(turns[c][: t + 1], []) for t in range(TURNS) for c in range(CONVERSATIONS)]


def host_loaded(metrics: str) -> int:
    """The tokens kvtier's connector loaded from the host tier (the service), as vLLM's ``/metrics`` counts them."""
    for line in metrics.splitlines():
        if line.startswith("vllm:kvtier_tokens_total{") and 'tier="host"' in line and 'direction="load"' in line:
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


class _Soak:
    def __init__(self, config: VllmSoakConfig, workdir: Path):
        self.config, self.workdir = config, workdir
        self.model = _model_dir(config.model)
        self.prompts = workload(config.seed)
        self.args = ("--dtype", "float32", "--block-size", str(BLOCK_SIZE), "--max-model-len", "4096", "--enforce-eager",
                     "--seed", "0")
        self.service = NodeServiceProcess(workdir / "service", host_gb=0.25, args=("--keep-region", "--verify-sample", "1"))
        self.server: VllmServer | None = None
        self.want: list[str] = []
        self.requests = self.wrong = self.failed = self.interrupted = self.failed_restarts = 0
        self.lock = threading.Lock()

    # ---- the two processes ------------------------------------------------------------------------
    def start_vllm(self, kvtier: bool = True) -> bool:
        kv = None
        if kvtier:
            kv = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm.connector",
                  "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                  "kv_connector_extra_config": {"host_gb": 0.25, "service": f"unix://{self.service.socket}",
                                                "service_lookup_timeout_s": 10.0}}
        # (/reset_prefix_cache: the check passes empty vLLM's own prefix cache, so their hits come from the service)
        self.server = VllmServer(self.model, self.workdir / "vllm", kv, self.args, env={"VLLM_SERVER_DEV_MODE": "1"})
        try:
            self.server.start(RESTART_BOUND_S)
        except (RuntimeError, TimeoutError):
            return False
        return True

    def status(self) -> dict | None:
        try:
            return query_status(self.service.socket, deadline_s=2.0)
        except ServiceError:
            return None

    def attached(self) -> bool:
        """Poke the engine (an unrelated one-token request: its lookup is when it tries the service again) until the
        service counts it as a client."""
        deadline = time.monotonic() + ATTACH_BOUND_S
        while time.monotonic() < deadline:
            if (self.status() or {}).get("clients", 0) >= 1:
                return True
            try:
                self.server.post("/v1/completions", {"model": self.model, "prompt": [101, 102, 103], "max_tokens": 1}, 60.0)
            except OSError:
                pass
            time.sleep(0.2)
        return False

    # ---- requests ---------------------------------------------------------------------------------
    def ask(self, i: int) -> str:
        body = {"model": self.model, "prompt": self.prompts[i], "max_tokens": MAX_TOKENS, "temperature": 0.0}
        return self.server.post("/v1/completions", body, 120.0)["choices"][0]["text"]

    def check(self, i: int, vllm_killed: threading.Event | None = None) -> bool:
        """One request, its answer compared; False where it failed (counted as interrupted when vllm serve was being killed)."""
        try:
            text = self.ask(i)
        except OSError:
            with self.lock:
                if vllm_killed is not None and vllm_killed.is_set():
                    self.interrupted += 1
                else:
                    self.failed += 1
            return False
        with self.lock:
            self.requests += 1
            self.wrong += text != self.want[i]
        return True

    def check_pass(self) -> int:
        """The workload once, vLLM's prefix cache emptied first: the host tokens it loaded."""
        deadline = time.monotonic() + ATTACH_BOUND_S  # (it fails while a copy out still holds blocks: asked again)
        while not self.server.post("/reset_prefix_cache").get("success") and time.monotonic() < deadline:
            time.sleep(0.2)
        before = host_loaded(self.server.get_text("/metrics"))
        for i in range(len(self.prompts)):
            self.check(i)
        return host_loaded(self.server.get_text("/metrics")) - before


def schedule(config: VllmSoakConfig) -> list[tuple[str, str, float]]:
    """Each cycle's victim, signal and seconds from the client's start to the kill (drawn from the seed)."""
    rng = random.Random(config.seed)
    return [(rng.choice(VICTIMS), rng.choice(tuple(SIGNALS)), rng.uniform(config.min_gap_s, config.max_gap_s))
            for _ in range(config.cycles)]


def run_vllm_soak(config: VllmSoakConfig) -> VllmSoakReport:
    started = time.monotonic()
    kills = dict.fromkeys(VICTIMS, 0)
    signals = dict.fromkeys(SIGNALS, 0)
    host_after = dict.fromkeys(VICTIMS, 0)
    hit_passes = dict.fromkeys(VICTIMS, 0)
    restart_s: dict[str, list[float]] = {v: [] for v in VICTIMS}
    with tempfile.TemporaryDirectory(prefix="kvtier-vllm-soak-") as tmp:
        soak = _Soak(config, Path(tmp))
        region = None
        try:
            if not soak.start_vllm(kvtier=False):
                raise RuntimeError(f"vllm serve without kvtier did not start; see {soak.workdir / 'vllm'}")
            soak.want = [soak.ask(i) for i in range(len(soak.prompts))]
            soak.server.stop()
            soak.service.start()
            region = (soak.status() or {}).get("region")
            if not soak.start_vllm() or not soak.attached():
                raise RuntimeError(f"vllm serve on the service did not start and attach; see {soak.workdir}")
            for victim, sig, gap_s in schedule(config):
                kills[victim] += 1
                signals[sig] += 1
                vllm_killed, stop = threading.Event(), threading.Event()

                def client(stop=stop, vllm_killed=vllm_killed) -> None:
                    i = 0
                    while not stop.is_set():
                        if not soak.check(i % len(soak.prompts), vllm_killed) and vllm_killed.is_set():
                            return  # (the server is gone: this cycle's client ends)
                        i += 1

                thread = threading.Thread(target=client, name="kvtier-vllm-soak-client", daemon=True)
                thread.start()
                time.sleep(gap_s)
                t0 = time.monotonic()
                if victim == "vllm":
                    vllm_killed.set()
                    soak.server.kill(SIGNALS[sig])
                    thread.join(RESTART_BOUND_S)
                    ok = soak.start_vllm() and soak.attached()
                else:
                    soak.service.kill(SIGNALS[sig])
                    soak.service.start()  # (the same socket: it adopts the region the killed one left, verifying it)
                    region = (soak.status() or {}).get("region") or region
                    ok = soak.attached()
                    stop.set()
                    thread.join(RESTART_BOUND_S)
                if not ok:
                    soak.failed_restarts += 1
                    continue
                restart_s[victim].append(time.monotonic() - t0)
                loaded = soak.check_pass()
                host_after[victim] += loaded
                hit_passes[victim] += loaded > 0
            pools = (soak.status() or {}).get("object_pools", [])
            soak.server.stop()
            stuck, status = stuck_leases(soak.status, EXIT_BOUND_S)
        finally:
            if soak.server is not None:
                soak.server.stop()
            soak.service.stop()
            if region is not None:  # (--keep-region: a stopped service leaves it for the next)
                shutil.rmtree(os.path.dirname(region), ignore_errors=True)
    return VllmSoakReport(
        cycles=config.cycles, model=config.model, kills=kills, signals=signals, requests=soak.requests, wrong_answers=soak.wrong,
        failed_requests=soak.failed, interrupted_requests=soak.interrupted, failed_restarts=soak.failed_restarts,
        stuck_leases=stuck, host_tokens_after=host_after, host_hit_passes=hit_passes,
        restart_s={v: round(statistics.median(s), 2) for v, s in restart_s.items() if s}, object_pools=pools,
        found_objects=status.get("found_objects", 0), corrupt_pages=status.get("corrupt_pages", 0),
        seconds=round(time.monotonic() - started, 1))


def as_json(report: VllmSoakReport) -> dict:
    return {"date": time.strftime("%Y-%m-%d"), "vllm_soak": asdict(report)}
