"""What an engine costs on this machine, measured: the profile ``kvtier plan --calibrate`` writes and
``--profile`` / ``--validate`` read.

* :class:`PrefillFit` -- seconds to prefill a prompt of ``n`` tokens after a cached prefix of ``c``:
  ``overhead + per_token * (n - c) + per_context * (n^2 - c^2) / 2 + per_page * pages computed
  + per_context_power * (n^a - c^a) + per_cached_page * pages cached``. The quadratic term is
  attention (each computed token reads every token before it); the page term an engine's per-chunk
  or per-step work; the power term, its exponent ``a`` fitted in 1.1..1.9, an engine whose cost per
  token of context is not constant (``kvtier run``'s reference model: about ``n^1.5`` on this VM's
  caches); the last what reusing a prefix costs per page (matching, locking, touching it).
* :class:`LinkFit` -- one tier's move: ``latency + bytes / bandwidth`` per operation (host<->device
  through the io backend, each L3 store's get and put).
* ``after_request`` -- what holds the engine after a request's first token: ``kvtier run``'s commits
  the request and drains its backups and L3 saves before the next (:func:`fit_after`: a fixed part,
  and ``latency + bytes / rate`` when anything moves).
* :class:`IdleFit` -- what a request that finds the engine idle pays over one that follows another
  at once (on a shared VM: tens of milliseconds, more for a longer request), against the idle gap.
* ``load_scale`` -- what a request's service takes under load over what it takes alone: the
  calibration's load probe (prompts sharing nothing, at arrivals that should keep the engine half
  busy) is served, and the factor that makes the planner's queue model match its TTFTs kept.
* :class:`EngineTraits` -- how the engine schedules: one request at a time or chunked batches,
  whether a load overlaps the compute, whether the tiers settle before the next request.

Fits are non-negative least squares on relative residuals (:func:`fit_prefill`, :func:`fit_link`):
TTFT error is judged per request in percent, and a term that came out negative would predict
less time for more work. A profile names the model and engine it was measured on; using it for
another is refused (:meth:`Profile.check_model`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

from kvtier.errors import ConfigError

PROFILE_FORMAT = "kvtier-plan-profile"
PROFILE_VERSION = 1


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int = 100) -> np.ndarray:
    """``argmin ||a x - b||`` over ``x >= 0`` (Lawson and Hanson's active set), for the few columns a fit has."""
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    for _ in range(max_iter):
        grad = a.T @ (b - a @ x)
        free = ~passive & (grad > 1e-12 * max(1.0, float(np.abs(grad).max(initial=0.0))))
        if not free.any():
            break
        passive[np.argmax(np.where(free, grad, -np.inf))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            bad = passive & (z <= 0)
            step = np.min(x[bad] / (x[bad] - z[bad]))
            x = x + step * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
    return x


def _relative_fit(columns: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Non-negative coefficients minimising the squared *relative* error against ``seconds``."""
    w = 1.0 / seconds
    return nnls(columns * w[:, None], seconds * w)


def median_abs_pct_error(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Median over items of ``|predicted - measured| / measured``, in percent."""
    p, m = np.asarray(predicted, dtype=float), np.asarray(measured, dtype=float)
    return float(np.median(np.abs(p - m) / m) * 100) if m.size else 0.0


#: exponents tried for the context term beside the quadratic one (``fit_prefill`` keeps the one that fits best)
CONTEXT_POWERS = tuple(round(1.1 + 0.1 * i, 1) for i in range(9))


@dataclass(frozen=True)
class PrefillFit:
    overhead_s: float
    per_token_s: float
    #: seconds per (token x earlier token) of attention
    per_context_s: float
    per_page_s: float
    page_tokens: int
    #: calibration points, and the fit's median absolute error over them (percent)
    points: int = 0
    fit_error_pct: float = 0.0
    #: a context term that grows as ``n^context_power - c^context_power``: an engine whose cost per token of
    #: context falls as the context outgrows the CPU's caches, or that reads only part of it (DSA's top-k)
    per_context_power_s: float = 0.0
    context_power: float = 1.5
    #: per cached page: matching, locking and touching the prefix a request reuses
    per_cached_page_s: float = 0.0

    @staticmethod
    def columns(prompt: Sequence[int], cached: Sequence[int], page_tokens: int, power: float) -> np.ndarray:
        n, c = np.asarray(prompt, dtype=float), np.asarray(cached, dtype=float)
        pages = np.ceil(n / page_tokens) - np.floor(c / page_tokens)
        return np.stack([np.ones_like(n), n - c, (n * n - c * c) / 2, pages, n**power - c**power, np.floor(c / page_tokens)], axis=1)

    def seconds(self, prompt: int, cached: int) -> float:
        """Prefill of ``prompt`` tokens of which the first ``cached`` come from the cache."""
        pages = -(-prompt // self.page_tokens) - cached // self.page_tokens
        a = self.context_power
        return (self.overhead_s + self.per_token_s * (prompt - cached) + self.per_context_s * (prompt * prompt - cached * cached) / 2
                + self.per_page_s * pages + self.per_context_power_s * (prompt**a - cached**a)
                + self.per_cached_page_s * (cached // self.page_tokens))


def fit_prefill(prompt: Sequence[int], cached: Sequence[int], seconds: Sequence[float], page_tokens: int) -> PrefillFit:
    """:class:`PrefillFit` of measured prefills (``prompt[i]`` tokens, ``cached[i]`` of them cached, ``seconds[i]``):
    for each exponent of :data:`CONTEXT_POWERS`, the non-negative fit of relative error; the best of them."""
    t = np.asarray(seconds, dtype=float)
    if t.size < 5 or (t <= 0).any():
        raise ConfigError(f"a prefill fit needs 5 or more timings, all positive; got {t.size}")
    best = None
    for power in CONTEXT_POWERS:
        cols = PrefillFit.columns(prompt, cached, page_tokens, power)
        coef = _relative_fit(cols, t)
        rel = (cols @ coef - t) / t
        score = float(rel @ rel)
        if best is None or score < best[0] - 1e-12:
            best = (score, power, coef, median_abs_pct_error(cols @ coef, t))
    _, power, coef, err = best
    overhead, per_token, per_context, per_page, per_power, per_cached = (float(x) for x in coef)
    return PrefillFit(overhead, per_token, per_context, per_page, page_tokens, int(t.size), round(err, 2), per_power, power, per_cached)


@dataclass(frozen=True)
class LinkFit:
    latency_s: float
    bytes_per_s: float
    points: int = 0
    fit_error_pct: float = 0.0

    def seconds(self, nbytes: float) -> float:
        """One operation moving ``nbytes`` (none: no operation, no time)."""
        if nbytes <= 0:
            return 0.0
        return self.latency_s + (nbytes / self.bytes_per_s if self.bytes_per_s > 0 else 0.0)


def fit_link(nbytes: Sequence[float], seconds: Sequence[float]) -> LinkFit:
    """:class:`LinkFit` of timed operations (``nbytes[i]`` moved in ``seconds[i]``)."""
    t = np.asarray(seconds, dtype=float)
    b = np.asarray(nbytes, dtype=float)
    if t.size < 2 or (t <= 0).any() or len(set(b.tolist())) < 2:
        raise ConfigError(f"a link fit needs timings of 2 or more sizes, all positive; got {t.size} timings of "
                          f"{len(set(b.tolist()))} sizes")
    latency, per_byte = _relative_fit(np.stack([np.ones_like(b), b], axis=1), t)
    err = median_abs_pct_error(latency + per_byte * b, t)
    return LinkFit(float(latency), float(1.0 / per_byte) if per_byte > 0 else math.inf, int(t.size), round(err, 2))


@dataclass(frozen=True)
class IdleFit:
    """What a request that finds the engine idle pays over one that follows another at once (caches and the
    CPU cooled, other processes ran): after a gap of ``gaps_s[i]`` seconds, ``extra_s[i]`` plus
    ``extra_share[i]`` of its own service time. Between measured gaps the cost is read off on a log
    scale; below the shortest it falls to 0 at no gap; above the longest it stays."""

    gaps_s: list[float] = field(default_factory=list)
    extra_s: list[float] = field(default_factory=list)
    extra_share: list[float] = field(default_factory=list)

    def seconds(self, gap_s: float, service_s: float) -> float:
        if gap_s <= 0 or not self.gaps_s:
            return 0.0
        fixed, share = self.extra_s, self.extra_share
        first = self.gaps_s[0]
        if gap_s < first:
            scale = gap_s / first
            return scale * (fixed[0] + share[0] * service_s)
        x, at = math.log(gap_s), [math.log(g) for g in self.gaps_s]
        return float(np.interp(x, at, fixed) + np.interp(x, at, share) * service_s)


def fit_after(nbytes: Sequence[float], seconds: Sequence[float]) -> tuple[float, LinkFit]:
    """What holds an engine after each of its requests: a fixed part (``overhead``), and when its tiers move
    anything, a drain of ``latency + bytes / bandwidth`` (a :class:`LinkFit`, which costs nothing for no
    bytes): ``(overhead, drain)``, non-negative, fitted on relative error."""
    t = np.asarray(seconds, dtype=float)
    b = np.asarray(nbytes, dtype=float)
    if t.size < 3 or (t <= 0).any() or not (b > 0).any() or len(set(b[b > 0].tolist())) < 2:
        raise ConfigError(f"an after-request fit needs timings of 2 or more sizes that move bytes, all positive; got {t.size}")
    cols = np.stack([np.ones_like(b), (b > 0).astype(float), b], axis=1)
    overhead, latency, per_byte = _relative_fit(cols, t)
    err = median_abs_pct_error(cols @ np.array([overhead, latency, per_byte]), t)
    return float(overhead), LinkFit(float(latency), float(1.0 / per_byte) if per_byte > 0 else math.inf, int(t.size), round(err, 2))


#: the links a profile measures, and what each is
LINKS = {
    "host_to_device": "a load of cached pages from host into the device pool",
    "device_to_host": "a backup of device pages into host pages",
    "storage_get": "an L3 read of pages into host pages",
    "storage_put": "an L3 write of host pages",
}


@dataclass(frozen=True)
class EngineTraits:
    #: "serial": one request at a time, in arrival order; "chunked": vLLM's steps of up to ``max_batched_tokens``
    scheduling: str = "serial"
    max_batched_tokens: int = 0
    #: a host or L3 hit's load runs under the compute (layer by layer) rather than before it
    load_overlaps_compute: bool = True
    #: the engine drains a request's backups and L3 saves before starting the next ("serial"), or they run
    #: beside the next requests ("background")
    settle: str = "serial"
    #: torch intra-op threads the engine ran with (a validation runs with the same)
    threads: int = 1


@dataclass
class Profile:
    engine: str
    model: str
    #: identifies the model's KV layout: a profile of another layout is refused
    model_fingerprint: str
    page_tokens: int
    page_bytes: int
    prefill: PrefillFit
    links: dict[str, LinkFit]
    #: what keeps the engine busy after a request's first token: ``after_request_overhead_s`` always (its commit),
    #: and ``after_request`` when its tiers move bytes (draining its backups and L3 saves) -- ``kvtier run``'s
    #: engine; vLLM's run beside its next steps: none
    after_request: LinkFit = field(default_factory=lambda: LinkFit(0.0, math.inf))
    after_request_overhead_s: float = 0.0
    #: what a request's service takes under load over what it takes alone (the load probe's fit: batching and
    #: contention the engine's processes and threads add when requests come one after another)
    load_scale: float = 1.0
    idle: IdleFit = field(default_factory=IdleFit)
    traits: EngineTraits = field(default_factory=EngineTraits)
    io_backend: str = "direct"
    storage: str = "file"
    measured_at: str = ""
    #: cpus, cpu model, load average before and after
    machine: dict = field(default_factory=dict)
    #: what each calibration step measured (for the record)
    notes: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, **asdict(self)}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.as_dict(), indent=1) + "\n")

    def link(self, name: str) -> LinkFit:
        return self.links[name]

    def check_model(self, model: str, fingerprint: str, path: str | Path = "the profile", engine: str | None = None) -> None:
        """Refuse (one readable line) to use this profile for another model, or -- ``engine`` given -- another engine."""
        if (self.model, self.model_fingerprint) != (model, fingerprint):
            from kvtier.app.plan.engines import ENGINES

            engines = [e.name for e in ENGINES.values() if e.model == model]
            fix = (f"calibrate one for it: kvtier plan --calibrate OUT.json --engine {engines[0]}" if engines else
                   f"plan the profile's model: --plan-spec {self.model}")
            raise ConfigError(f"profile {path} was measured with model {self.model!r}, not {model!r} "
                              f"(layout {self.model_fingerprint[:12]} vs {fingerprint[:12]}): its times do not hold for it; {fix}")
        if engine is not None and self.engine != engine:
            raise ConfigError(f"profile {path} was measured on engine {self.engine!r}, not {engine!r}; calibrate one for it: "
                              f"kvtier plan --calibrate OUT.json --engine {engine}")


def _typed(cls, data: object, where: str):
    """``cls(**data)``, every field given and of its type (numbers finite and >= 0): a profile is user input."""
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be an object, got {type(data).__name__}")
    declared = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(declared))
    if unknown:
        raise ValueError(f"{where} has unknown keys {unknown}")
    for name, f in declared.items():
        if name not in data and f.default is MISSING and f.default_factory is MISSING:
            raise ValueError(f"{where} lacks {name!r}")
    for name, v in data.items():
        kind = declared[name].type
        if kind in ("float", "int"):
            number = not isinstance(v, bool) and isinstance(v, (int, float)) and (math.isfinite(v) or v == math.inf) and v >= 0
            if not number or (kind == "int" and not isinstance(v, int)):
                raise ValueError(f"{where}.{name} must be {'an integer' if kind == 'int' else 'a number'} >= 0, got {v!r}")
        elif kind in ("str", "bool", "dict") and not isinstance(v, {"str": str, "bool": bool, "dict": dict}[kind]):
            raise ValueError(f"{where}.{name} must be a {kind}, got {v!r}")
    return cls(**data)


def _idle(data: object) -> IdleFit:
    keys = ("gaps_s", "extra_s", "extra_share")
    if not isinstance(data, dict) or set(data) != set(keys):
        raise ValueError("idle must be an object of gaps_s, extra_s and extra_share")
    gaps, extra, share = (data[k] for k in keys)
    lists = all(isinstance(x, list) for x in (gaps, extra, share)) and len(gaps) == len(extra) == len(share)
    numbers = lists and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0
                            for x in [*gaps, *extra, *share])
    if not (numbers and gaps == sorted(set(gaps)) and all(g > 0 for g in gaps)):
        raise ValueError(f"idle.gaps_s must be increasing gaps > 0, idle.extra_s and idle.extra_share as many numbers >= 0; "
                         f"got {gaps!r}, {extra!r} and {share!r}")
    return IdleFit(gaps, extra, share)


def load_profile(path: str | Path) -> Profile:
    """The profile at ``path``, every field checked: a missing or corrupt file is one :class:`ConfigError` line."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"cannot read profile {path}: {e.strerror or e}; write one with kvtier plan --calibrate {path}") from None
    except ValueError as e:
        raise ConfigError(f"profile {path} is not JSON ({e}); write it again with kvtier plan --calibrate {path}") from None
    try:
        if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
            raise ValueError(f"no \"format\": \"{PROFILE_FORMAT}\" field")
        if data.get("version") != PROFILE_VERSION:
            raise ValueError(f"version {data.get('version')!r}, this kvtier reads version {PROFILE_VERSION}")
        body = {k: v for k, v in data.items() if k not in ("format", "version")}
        for key in ("prefill", "links"):
            if key not in body:
                raise ValueError(f"it lacks {key!r}")
        body["prefill"] = _typed(PrefillFit, body["prefill"], "prefill")
        links = body["links"]
        if not isinstance(links, dict) or set(links) != set(LINKS):
            raise ValueError(f"links must name {', '.join(LINKS)}")
        body["links"] = {k: _typed(LinkFit, v, f"links.{k}") for k, v in links.items()}
        body["traits"] = _typed(EngineTraits, body.get("traits", {}), "traits")
        if "after_request" in body:
            body["after_request"] = _typed(LinkFit, body["after_request"], "after_request")
        if "idle" in body:
            body["idle"] = _idle(body["idle"])
        profile = _typed(Profile, body, "profile")
        if profile.page_tokens < 1 or profile.prefill.page_tokens != profile.page_tokens:
            raise ValueError(f"page_tokens {profile.page_tokens} and the prefill fit's {profile.prefill.page_tokens} must agree")
    except (ValueError, TypeError) as e:
        raise ConfigError(f"profile {path} is not a kvtier plan profile: {e}; write it again with kvtier plan --calibrate {path}") from None
    return profile
