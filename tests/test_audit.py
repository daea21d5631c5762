"""``kvtier audit timing``, the short version: Gu et al.'s timing audit through every tier on ``kvtier run``'s engine
(a small reference model). Another tenant's probe of a victim's prompt is never a hit and is not told apart from a
fresh miss; the victim's own repeat (the control) is a hit the same test detects. A cache that ignored tenants would
fail it: the audit is shown to catch that too.

The suite's cross-tenant threshold is alpha = 1e-4 rather than the published run's 0.01: under the null hypothesis
the p-value is uniform, so a test at 0.01 would fail one run in a hundred per tier by chance alone."""

from __future__ import annotations

import json

import pytest

from support.cli import kvtier
from kvtier.app import audit as audit_mod
from kvtier.app import audit_rounds
from kvtier.app.audit import KsResult, run_timing_audit, verdict
from kvtier.app.engine import ReferenceEngine
from kvtier.app.model import ModelConfig

pytestmark = pytest.mark.timeout(900)

CFG = ModelConfig(hidden=64, num_layers=2, num_heads=2, qk_nope_dim=16, qk_rope_dim=8, v_head_dim=16, kv_lora_rank=32,
                  index_heads=2, index_head_dim=32, quant_block_size=16, index_topk=24, mlp_hidden=128, page_size=8)
SAMPLES = 42  # (seven rounds of each order)
TOKENS = 6 * CFG.page_size + 3  # (the hit: the 6 full pages)


def test_no_tier_lets_another_tenant_tell_a_victims_prompt_from_a_fresh_one_and_every_tier_shows_the_victim_its_hit():
    audit = run_timing_audit(audit_mod.TIERS, SAMPLES, TOKENS, alpha=1e-4, model_cfg=CFG)
    assert [t.tier for t in audit.tiers] == list(audit_mod.TIERS)
    for t in audit.tiers:
        assert t.hit_tokens["probe"] == 0 and t.hit_tokens["miss"] == 0, t  # another tenant's prefix is never a hit
        assert t.hit_tokens["control"] == SAMPLES * 6 * CFG.page_size, t  # the victim's is, from that tier
        assert t.control_vs_miss.pvalue < 1e-3, t  # the test sees a hit where there is one
        assert t.probe_vs_miss.pvalue >= 1e-4 and t.verdict == "pass", t
    assert audit.passed and audit.as_dict()["passed"]


def test_each_kind_follows_each_other_and_the_victim_equally_often():
    """A request's time depends on the one before it; an order that put the control's hit before the probe more often
    than before the miss made the probes time faster on that alone."""
    follows = {(kind, before): 0 for kind in audit_rounds.KINDS for before in audit_rounds.KINDS + ("victim",) if kind != before}
    orders = [audit_rounds.round_order(i) for i in range(len(audit_rounds.ORDERS))]
    for order in orders:
        for before, kind in zip(("victim",) + order, order):
            follows[kind, before] += 1
    assert len(set(orders)) == 6 and set(follows.values()) == {2}, follows


def test_the_audit_catches_a_cache_that_ignores_tenants(monkeypatch):
    """The engine made to drop the tenant (every request in the cache's own scope): the probes hit the victim's pages,
    their times are those of hits, and the tier fails."""
    prefill = ReferenceEngine.prefill
    monkeypatch.setattr(ReferenceEngine, "prefill", lambda self, tokens, tenant=None: prefill(self, tokens, None))
    audit = run_timing_audit(["device", "host"], SAMPLES, TOKENS, alpha=1e-4, model_cfg=CFG)
    for t in audit.tiers:
        assert t.hit_tokens["probe"] == SAMPLES * 6 * CFG.page_size and t.probe_vs_miss.pvalue < 1e-3 and t.verdict == "fail", t
    assert not audit.passed


@pytest.mark.parametrize("probe_hits, probe_p, control_p, control_hits, want", [
    (0, 0.5, 1e-9, 10, "pass"),
    (0, 0.005, 1e-9, 10, "fail"),  # probes told apart from misses
    (8, 0.5, 1e-9, 10, "fail"),  # a probe hit, however it timed
    (0, 0.5, 0.01, 10, "void"),  # the control not detected: the audit could not have seen a hit
    (0, 0.5, 1e-9, 0, "void"),  # no control hit at all
])
def test_the_verdict(probe_hits, probe_p, control_p, control_hits, want):
    hits = {"probe": probe_hits, "miss": 0, "control": control_hits}
    assert verdict(hits, KsResult(0.1, probe_p), KsResult(0.9, control_p), 0.01, 0.001) == want


def test_the_command_prints_its_verdicts_as_json_and_exits_1_unless_every_tier_passes():
    out = kvtier("audit", "timing", "--tiers", "device,file", "--samples", "8", "--prompt-tokens", "160", "--no-progress", "--json")
    got = json.loads(out.stdout)
    assert [t["tier"] for t in got["tiers"]] == ["device", "file"]
    assert out.returncode == (0 if got["passed"] else 1), out.stderr
    assert got["passed"] == all(t["verdict"] == "pass" for t in got["tiers"])
    assert all(t["hit_tokens"]["probe"] == 0 and t["hit_tokens"]["control"] == 8 * 4 * 32 for t in got["tiers"])
    assert {"date", "machine", "alpha", "control_alpha", "model", "engine", "samples", "prompt_tokens"} <= set(got)


@pytest.mark.integration
@pytest.mark.timeout(1200)
def test_vllms_engine_with_the_connector_passes_the_audit_through_kvtiers_host_tier():
    """``kvtier audit timing --engine vllm``: vLLM's CPU engine (a tiny Llama), a tenant its ``cache_salt``, the victim's
    pages in kvtier's host tier (vLLM's own prefix cache emptied before each request). Another tenant's probe is never a
    hit and not told from a miss; the victim's repeat is a hit from host the test sees."""
    samples, tokens = 30, 512
    out = kvtier("audit", "timing", "--engine", "vllm", "--tiers", "host", "--samples", str(samples), "--prompt-tokens", str(tokens),
                 "--alpha", "1e-4", "--no-progress", "--json", timeout=1100)
    got = json.loads(out.stdout)
    assert out.returncode == (0 if got["passed"] else 1), out.stderr[-2000:]
    (t,) = got["tiers"]
    assert got["engine"].startswith("vLLM") and t["tier"] == "host"
    assert t["hit_tokens"]["probe"] == 0 and t["hit_tokens"]["miss"] == 0, t
    assert t["hit_tokens"]["control"] == samples * (tokens - 32), t  # (every full block but the last: vLLM computes that one)
    assert t["control_vs_miss"]["pvalue"] < 1e-3 and t["verdict"] == "pass", t
