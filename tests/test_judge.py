"""The judge: its arithmetic on known inputs, an end-to-end run, and a broken candidate failing."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtpjax
from experiments import judge, judge_gate as gate
from judge_fixtures import write_judge_checkpoint
from mtpjax import quant, sampling

# Two busy lanes sharing a 3-page pool: page granularity and preemption hold the steady-state
# page use near 0.7 here (the default workload, 16 lanes, measures 0.93-0.94), so the busy
# validity floor of this tiny configuration is lower than the default 0.9.
SMALL_LIMITS = gate.Limits(busy_page_use_floor=0.5)
# K = 1 (not the default 4) keeps the decode programs the warm-up compiles to 2 per lane bucket
# (deeper K: test_acceptance_detail_and_depth_sums_on_known_counts).
# fidelity_lanes = 2 (not the default 16) fits the 2 lane slots, so the fidelity check runs on
# the judge's engine shape (judge.fidelity) and reuses its prefill programs, as the default
# judge does (16 lanes, 16 slots), instead of compiling those of two 16-lane engines of its own.
SMALL = dict(passes=1, solo_requests=2, team_lanes=2, team_requests=4, busy_lanes=2, prompt_tokens=16,
             busy_requests=6, max_new_tokens=12, gate_prompts=8, fidelity_tokens=8,
             fidelity_lanes=2, progress=False, limits=SMALL_LIMITS, k=1)
# The smallest judge run (one workload): for checks that need an engine run, not the ratios.
TINY = dict(SMALL, workloads=("solo",), solo_requests=1, gate_prompts=2, max_new_tokens=6,
            fidelity_tokens=2, lane_buckets=(1, 2))
# TINY with SMALL's reply and fidelity lengths: with SMALL's lane buckets (so its 2 lane slots)
# its engines have the shapes of the end-to-end run's engines (judge.EngineShape), so the runs
# that follow it in this module reuse its compiled programs.
SOLO = dict(TINY, max_new_tokens=SMALL["max_new_tokens"], fidelity_tokens=SMALL["fidelity_tokens"])


def test_interval_rule():
    assert not gate.interval_outside(0.0, 0.0, 0.05)
    assert not gate.interval_outside(0.06, 0.01, 0.05)      # interval touches the band
    assert gate.interval_outside(0.2, 0.01, 0.05)
    assert gate.interval_outside(-0.2, 0.01, 0.05)


def test_agreements_and_lengths():
    assert gate.greedy_agreement([[1, 2, 3, 4]], [[1, 2, 9, 9]]) == 0.5
    assert gate.sampled_agreement([[1, 2, 3]], [[1, 5, 3, 4]]) == 0.5
    same = gate.length_ratio([10, 12, 8], [10, 12, 8])
    assert same == {"ratio": 1.0, "low": 1.0, "high": 1.0}
    long = gate.length_ratio([20, 24, 16, 22], [10, 12, 8, 11])
    assert long["low"] > 1.5
    assert gate.geomean([1.0, 4.0]) == pytest.approx(2.0)
    g, se = gate.paired_gap([1.0, 2.0, 3.0], [0.0, 1.0, 2.0])
    assert g == pytest.approx(1.0) and se == pytest.approx(0.0)


def _measured(**over):
    m = {"memory": {"candidate_mib": 10.0, "stock_mib": 9.0}, "fidelity": 1e-6,
         "likelihood": {"gap": 0.0, "se": 0.01}, "argmax": {"gap": 0.0, "se": 0.001},
         "greedy_agreement": 1.0, "sampled_agreement": 1.0,
         "lengths": {"solo": {"ratio": 1.0, "low": 0.98, "high": 1.02}},
         "ratios": {"solo": {"passes": [1.2], "ratio": 1.2}, "team": {"passes": [1.1], "ratio": 1.1}}}
    m.update(over)
    return m


@pytest.mark.parametrize("over,reason", [
    ({}, None),
    ({"memory": {"candidate_mib": 5000.0, "stock_mib": 9.0}}, "memory"),
    ({"fidelity": 0.5}, "fidelity"),
    ({"likelihood": {"gap": -0.3, "se": 0.01}}, "likelihood"),
    ({"argmax": {"gap": 0.2, "se": 0.01}}, "argmax"),
    ({"lengths": {"solo": {"ratio": 1.5, "low": 1.3, "high": 1.7}}}, "lengths"),
])
def test_gate_reason_names_the_first_failed_check(over, reason):
    v = gate.evaluate(_measured(**over), gate.Limits())
    assert v["reason"] == reason
    assert (v["score"] == 0.0) == (reason is not None)
    assert v["specscore"] == pytest.approx(np.sqrt(1.2 * 1.1))


def test_busy_page_use_below_the_floor_invalidates_the_run():
    """The busy workload must keep >= 90% of the pages in use (both engines) while requests
    wait; below that its ratio means nothing and the gate names busy_page_use first."""
    ok = {"busy": {"stock": 0.93, "candidate": 0.91}}
    assert gate.evaluate(_measured(page_use=ok), gate.Limits())["reason"] is None
    low = {"busy": {"stock": 0.93, "candidate": 0.85}}
    v = gate.evaluate(_measured(page_use=low, fidelity=0.5), gate.Limits())
    assert v["reason"] == "busy_page_use" and v["score"] == 0.0
    assert v["page_use"]["busy"] == {"least": 0.85, "floor": 0.9, "ok": False}
    never = {"busy": {"stock": None, "candidate": 0.95}}   # no request ever waited
    assert gate.evaluate(_measured(page_use=never), gate.Limits())["reason"] == "busy_page_use"
    # no busy workload: nothing to check
    assert "busy_page_use" not in gate.evaluate(_measured(page_use={}), gate.Limits())["checks"]


def test_greedy_floor_is_optional():
    m = _measured(greedy_agreement=0.5)
    assert gate.evaluate(m, gate.Limits())["reason"] is None
    assert gate.evaluate(m, gate.Limits(greedy_agreement_floor=0.9))["reason"] == "greedy_agreement"


@pytest.fixture(scope="module")
def peaky_ckpt(tmp_path_factory):
    return write_judge_checkpoint(str(tmp_path_factory.mktemp("judge_ckpt")), peaky=40.0)


def test_judge_end_to_end_card(peaky_ckpt, tmp_path):
    jc = judge.JudgeConfig(checkpoint=peaky_ckpt, out_dir=str(tmp_path), **SMALL)
    card = judge.run_judge(jc)
    on_disk = json.load(open(tmp_path / "card.json"))
    for key in ("ratios", "specscore", "greedy_agreement", "likelihood", "argmax", "fidelity",
                "lengths", "memory", "acceptance", "limits", "reason", "score",
                "sampled_agreement", "throughput", "step_time_ms", "settings"):
        assert key in on_disk, key
    assert set(on_disk["ratios"]) == {"solo", "team", "busy"}
    assert card["reason"] is None, card["checks"]
    assert card["sampled_agreement"] == 1.0 and card["greedy_agreement"] == 1.0
    assert card["fidelity"] < 1e-3
    for w in ("solo", "team", "busy"):
        # None: the policy never verified (this checkpoint's MTP head is random)
        assert card["acceptance"][w] is None or 1.0 <= card["acceptance"][w] <= 2.0
    assert (tmp_path / "card.md").exists() and (tmp_path / "throughput.png").exists()
    assert (tmp_path / "acceptance.png").exists()
    busy = on_disk["page_use"]["busy"]
    assert on_disk["checks"]["busy_page_use"] is True and busy["ok"] is True
    assert busy["least"] == min(busy["stock"], busy["candidate"]) >= 0.5
    assert on_disk["limits"]["busy_page_use_floor"] == 0.5
    # float32: the gate enforces greedy agreement 1.0 by default, and the card says so
    assert on_disk["limits"]["greedy_agreement_floor"] == 1.0
    assert on_disk["checks"]["greedy_agreement"] is True
    md = (tmp_path / "card.md").read_text()
    assert "| busy_page_use (workload validity) |" in md
    assert on_disk["memory"]["workload"] == "team" and "own phase" in on_disk["memory"]["how"]
    # dense weights: no FP8 section, nothing extra measured
    assert on_disk["fp8"] is None and "FP8" not in md
    assert on_disk["settings"]["weights"] == on_disk["settings"]["mtp_weights"] == "auto"
    _check_depths_and_acceptance(on_disk, K=1)
    st = on_disk["settings"]
    assert st["adaptive"] is True and st["policy"] == "AdaptiveDepth"
    assert st["mtp_head"] == "trained" and st["num_speculative_tokens"] == 1
    # the warm-up ran every depth of every lane bucket (solo 1; team, busy 1 and 2), every
    # depth with a prefill chunk riding (one program per depth, over the 2 lane slots), the
    # 2 prefill chunk buckets (16, 64) and, with more than one lane, the lane move, and
    # packed prefill's (2 lanes: 2 rows) riding programs per depth and its one prefill ...
    assert st["warmup"]["solo/k=1"]["programs"] == 2 + 2 + 2
    assert st["warmup"]["team/k=1"]["programs"] == 4 + 2 + 2 + 1 + 2 + 1
    assert st["warmup"]["team/k=0"]["programs"] == 2 + 1 + 2 + 1 + 1 + 1
    # ... on one shape (2 lane slots for every workload), so that team's and busy's programs
    # are one set, and solo's are among them
    assert st["lane_slots"] == 2 and st["lane_buckets"] == [1, 2]
    progs = st["compiled_programs"]
    assert progs["busy/k=1"] == progs["team/k=1"] == 12 and progs["busy/k=0"] == 8
    assert st["memory_mappings"]["peak"] >= st["memory_mappings"]["after_warmup"] > 0
    for w in ("solo", "team", "busy"):
        r = on_disk["policy"][w]["replicas"][0]
        assert on_disk["policy"][w]["name"] == "AdaptiveDepth"
        assert r["costs_ms"] and all(ms > 0 for v in r["costs_ms"].values() for ms in v.values())
        assert sum(r["chosen"].values()) > 0 and len(r["pooled_acceptance"]) == 1
    assert "draft depth" in md and "conditional" in md and "Adaptive policy" in md
    assert (tmp_path / "depth.png").exists()


def _check_depths_and_acceptance(card, K):
    """depth_hist counts the candidate's decode steps of the timed passes (the engine's own
    count), and acceptance by position agrees with its counts: conditional = accepted / tried,
    a draft is tried only after the one before it was accepted, the accepted drafts add up to
    the tokens per verify step."""
    for w, h in card["depth_hist"].items():
        assert len(h) == K + 1 and all(x >= 0 for x in h), h
        assert sum(h) == card["decode_steps"][w]["candidate"] > 0, (w, h, card["decode_steps"])
        a = card["acceptance_by_position"][w]
        acc, tried = a["accepted"], a["tried"]
        assert len(acc) == len(tried) == K
        for j in range(K):
            assert 0 <= acc[j] <= tried[j]
            if tried[j]:
                assert a["conditional"][j] == pytest.approx(acc[j] / tried[j])
                assert 0.0 <= a["conditional"][j] <= 1.0
            else:
                assert a["conditional"][j] is None
            if j:
                assert tried[j] <= acc[j - 1], (w, a)
        if a["verify_steps"]:
            assert a["per_verify_step"][j] == pytest.approx(acc[j] / a["verify_steps"])
            assert a["tokens_per_verify_step"] == pytest.approx(1 + sum(acc) / a["verify_steps"])
            assert 1.0 <= a["tokens_per_lane_step"] <= a["tokens_per_verify_step"]
        else:
            assert a["tokens_per_verify_step"] is None and a["tokens_per_lane_step"] == 1.0
        assert card["acceptance"][w] == a["tokens_per_verify_step"]
    # one lane: every step is one lane-step, so the request stats and the histogram must agree
    solo, h = card["acceptance_by_position"]["solo"], card["depth_hist"]["solo"]
    # (plus each request's first step, whose draft slots held nothing real)
    assert solo["first_token_steps"] > 0
    assert (solo["verify_steps"] + solo["plain_lane_steps"] + solo["first_token_steps"]
            == sum(h)), (solo, h)
    assert solo["plain_lane_steps"] <= h[0] <= solo["plain_lane_steps"] + solo["first_token_steps"]


def test_judge_fixed_depth_runs_depth_k_only(peaky_ckpt, tmp_path):
    """--adaptive=false: the candidate runs depth K at every step its pages allow (here
    always: the solo pool holds every lane at full context), even with a head whose drafts
    are never accepted, which the adaptive run turns down. Reuses the end-to-end test's
    programs (same K, lanes and shapes)."""
    jc = judge.JudgeConfig(checkpoint=peaky_ckpt, out_dir=str(tmp_path),
                           **{**SOLO, "adaptive": False})
    card = judge.run_judge(jc)
    h = card["depth_hist"]["solo"]
    assert h[0] == 0 and h[1] == card["decode_steps"]["solo"]["candidate"] > 0, h
    assert card["settings"]["adaptive"] is False and card["policy"]["solo"] is None
    assert card["settings"]["policy"] == "SpeculationPolicy"
    _check_depths_and_acceptance(card, K=1)
    assert "k = 1 fixed" in (tmp_path / "card.md").read_text()


class _Out:
    def __init__(self, **stats):
        self.stats = mtpjax.RequestStats(**stats)


def test_acceptance_detail_and_depth_sums_on_known_counts():
    """K = 3, two requests whose counts are known: the card's rates are the pooled counts."""
    outs = [_Out(verify_steps=4, accepted_tokens=5, plain_steps=2,
                 accepted_per_position=[3, 2, 0], tried_per_position=[4, 3, 1]),
            _Out(verify_steps=2, accepted_tokens=1, plain_steps=0,
                 accepted_per_position=[1, 0, 0], tried_per_position=[2, 1, 0])]
    a = judge.acceptance_detail(outs, 3)
    assert a["accepted"] == [4, 2, 0] and a["tried"] == [6, 4, 1]
    assert a["conditional"] == pytest.approx([4 / 6, 2 / 4, 0.0])
    assert a["per_verify_step"] == pytest.approx([4 / 6, 2 / 6, 0.0])
    assert a["tokens_per_verify_step"] == pytest.approx((6 + 6) / 6)
    assert a["tokens_per_lane_step"] == pytest.approx((6 + 2 + 6) / 8)
    assert judge.acceptance(outs, 3)[0] == a["tokens_per_verify_step"]
    never = judge.acceptance_detail([_Out(plain_steps=5, accepted_per_position=[0, 0],
                                          tried_per_position=[0, 0])], 2)
    assert never["tokens_per_verify_step"] is None and never["conditional"] == [None, None]
    runs = [{"depth_steps": [1, 0, 4, 2]}, {"depth_steps": [0, 3, 1, 0]}]
    assert judge.sum_depths(runs) == [1, 3, 5, 2]


def test_policy_report_groups_costs_by_cell():
    class FakePolicy:
        def report(self):
            return {"chosen": {0: 3, 2: 5}, "pooled_acceptance": [0.5, 0.25],
                    "costs_ms": {"d0/b2/c64": 1.0, "d2/b2/c64": 2.0, "d1/b16/c128": 3.0,
                                 "d0/b4/c64": 4.0},
                    "mixed_costs_ms": {"d1/b8/t64": 5.0, "d0/b8/t64": 6.0}}

    class FakeEngine:
        policy = FakePolicy()

    r = judge.policy_report(FakeEngine())["replicas"][0]
    assert r["costs_ms"] == {"b2/c64": {0: 1.0, 2: 2.0}, "b4/c64": {0: 4.0},
                             "b16/c128": {1: 3.0}}
    assert list(r["costs_ms"]) == ["b2/c64", "b4/c64", "b16/c128"]
    assert r["mixed_costs_ms"] == {"b8/t64": {0: 6.0, 1: 5.0}}
    assert r["chosen"] == {0: 3, 2: 5}
    FakeEngine.policy = mtpjax.engine.SpeculationPolicy()
    assert judge.policy_report(FakeEngine()) is None


@pytest.mark.parametrize("over,match", [({"k": 0}, "must be >= 1"), ({"k": -1}, "must be >= 1"),
                                        ({"mtp_head": "broken"}, "mtp_head"),
                                        ({"passes": 0}, "passes")])
def test_bad_settings_fail_before_anything_runs(tmp_path, over, match):
    jc = judge.JudgeConfig(checkpoint=str(tmp_path / "nowhere"), **over)
    with pytest.raises(ValueError, match=match):
        judge.run_judge(jc)


def test_random_mtp_head_keeps_shapes_and_the_target(peaky_ckpt):
    """The useless-head control: same shapes, dtypes and per-tensor scale, other values,
    seeded; the target is the very same arrays."""
    cfg, params = mtpjax.load_checkpoint(peaky_ckpt, "float32")
    rnd = judge.randomize_mtp_head(params, 0)
    assert rnd.layers is params.layers and rnd.embed is params.embed
    old, new = jax.tree.leaves(params.mtp), jax.tree.leaves(rnd.mtp)
    assert len(old) == len(new)
    for a, b in zip(old, new):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert not np.array_equal(np.asarray(a), np.asarray(b))
        if a.size > 256:
            assert np.std(np.asarray(b)) == pytest.approx(np.std(np.asarray(a)), rel=0.2)
    again = judge.randomize_mtp_head(params, 0)
    assert all(np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(new, jax.tree.leaves(again.mtp)))


# ------------------------------------------------------------------------------- memory

class _FakeGpu:
    """The real device, but reporting a process-wide peak as a GPU does: the same number
    whichever engine asks (what the memory check used to compare)."""

    def __init__(self, dev):
        self._dev = dev

    def __getattr__(self, name):
        return getattr(self._dev, name)

    def memory_stats(self):
        return {"peak_bytes_in_use": 1 << 30, "bytes_in_use": 1 << 29}


def _run_solo(ckpt, tmp_path, **over):
    jc = judge.JudgeConfig(checkpoint=ckpt, out_dir=str(tmp_path), **{**SOLO, **over})
    return judge.run_judge(jc)


def test_memory_check_fails_a_candidate_with_a_much_bigger_pool_on_a_gpu(peaky_ckpt, tmp_path,
                                                                       monkeypatch):
    """The candidate holds ~32 MiB more KV pool than stock: its own peak must show it, even on
    a device whose memory_stats() reports one process-wide peak."""
    real_devices, real_make = jax.devices, judge.make_engine
    monkeypatch.setattr(jax, "devices", lambda *a: [_FakeGpu(d) for d in real_devices(*a)])

    def make_engine(cfg, params, jc, k, lanes, num_pages, shape, placed=None, **kw):
        # the workload's candidate (adaptive; the fidelity check's engines run the fixed
        # depth) gets a 4096-page pool; everything else keeps the judge's shapes, so only the
        # big pool's programs compile (the rest are the earlier runs' in this module)
        if k and jc.adaptive:
            num_pages = 4096
        return real_make(cfg, params, jc, k, lanes, num_pages, shape, placed=placed, **kw)

    monkeypatch.setattr(judge, "make_engine", make_engine)
    card = _run_solo(peaky_ckpt, tmp_path, limits=gate.Limits(memory_slack_mib=8.0))
    m = card["memory"]
    assert card["checks"]["memory"] is False and card["reason"] == "memory", m
    assert m["peak_mib"] > m["stock_peak_mib"] + 24, m
    assert m["process_peak_mib"] == 1024.0     # reported beside, not compared


def test_memory_check_counts_what_the_candidates_run_allocates(peaky_ckpt, tmp_path,
                                                               monkeypatch):
    """A candidate whose run holds a 32 MiB scratch buffer (not in its params or caches) fails;
    the bytes of the engine's own buffers could not see it."""
    class Hoarder(mtpjax.Engine):
        def generate(self, *a, **kw):
            scratch = jnp.zeros((8 << 20,), jnp.float32)
            try:
                return super().generate(*a, **kw)
            finally:
                del scratch

    real_make = judge.make_engine

    def make_engine(*a, **kw):
        # the judge's own engine (its shapes: the earlier runs' programs), made a Hoarder
        e = real_make(*a, **kw)
        if e.k:
            e.__class__ = Hoarder
        return e

    monkeypatch.setattr(judge, "make_engine", make_engine)
    card = _run_solo(peaky_ckpt, tmp_path, limits=gate.Limits(memory_slack_mib=8.0))
    m = card["memory"]
    assert card["reason"] == "memory", m
    assert 31 < m["peak_mib"] - m["stock_peak_mib"] < 40, m


# ------------------------------------------------------------------------------- fidelity

def _no_causal_mask_in_the_block(real):
    """A verify-path bug: every query row of a multi-token block sees the whole block (as if
    it were its last token). One-token decode steps are unaffected."""
    def attend(q, k_pages, v_pages, page_tables, kv_lens, q_lens, *, sm_scale, **kw):
        rows = [real(q[:, t:t + 1], k_pages, v_pages, page_tables, kv_lens,
                     (q_lens > t).astype(jnp.int32), sm_scale=sm_scale)
                for t in range(q.shape[1])]
        return jnp.concatenate(rows, axis=1)
    return attend


def test_fidelity_goes_through_the_engines_paged_verify_path(peaky_ckpt, monkeypatch):
    import pallas_kernels
    cfg, params = mtpjax.load_checkpoint(peaky_ckpt, "float32")
    jc = judge.JudgeConfig(checkpoint=peaky_ckpt, **SMALL)
    texts = judge.load_texts(judge._tokenizer(peaky_ckpt), jc)
    assert judge.fidelity(cfg, params, texts, jc, "reference") < 1e-3
    monkeypatch.setattr(pallas_kernels, "paged_attention_reference",
                        _no_causal_mask_in_the_block(pallas_kernels.paged_attention_reference))
    jax.clear_caches()   # the programs must be traced again with the broken attention
    try:
        broken = judge.fidelity(cfg, params, texts, jc, "reference")
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert broken > jc.limits.fidelity_ceiling, broken


def _always_accept(real_verify):
    """The classic broken sampler: every draft is accepted without checking it."""
    def verify(target_logits, drafts, lanes, first_position):
        K = drafts.shape[1]
        last = sampling.sample(target_logits[:, K], lanes, first_position + K)
        tokens = jnp.concatenate([drafts, last[:, None]], axis=1)
        return jnp.full((drafts.shape[0],), K, jnp.int32), tokens
    return verify


def test_judge_fails_a_candidate_whose_sampler_always_accepts(peaky_ckpt, tmp_path, monkeypatch):
    """The gate workload (team) alone: the sampled replies the likelihood check scores come
    from it (the same engines, prompts and seeds as in a full run). The candidate runs the
    fixed depth K, so every step goes through the broken sampler whatever step costs the
    adaptive policy would measure, and the greedy replies must differ too. Runs after the
    tests that share the end-to-end run's programs (it must drop them all)."""
    monkeypatch.setattr(sampling, "verify", _always_accept(sampling.verify))
    jax.clear_caches()   # the step programs must be traced again with the broken sampler
    try:
        jc = judge.JudgeConfig(checkpoint=peaky_ckpt, out_dir=str(tmp_path),
                               **{**SMALL, "workloads": ("team",), "adaptive": False})
        card = judge.run_judge(jc)
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert card["reason"] == "likelihood", (card["reason"], card["likelihood"], card["argmax"])
    assert card["score"] == 0.0
    assert card["sampled_agreement"] < 0.9 and card["greedy_agreement"] < 1.0


# ------------------------------------------------------------------------------- FP8

TINY_CKPT = os.path.join(os.path.dirname(__file__), "..", "checkpoints", "tiny")


def test_fidelity_vs_dense_is_exact_for_the_same_params_and_ignores_padding(peaky_ckpt):
    """Texts of different lengths share a right-padded batch: the padded positions are left
    out and the real ones are what each text alone gives."""
    cfg, params = mtpjax.load_checkpoint(peaky_ckpt, "float32")
    jc = judge.JudgeConfig(checkpoint=peaky_ckpt,
                           **{**SMALL, "fidelity_tokens": 1000, "fidelity_lanes": 16})
    texts = judge.load_texts(judge._tokenizer(peaky_ckpt), jc)[:3]   # whole continuations
    f = judge.fidelity_vs_dense(cfg, params, params, texts, jc)
    lens = [len(p) + min(len(c), jc.fidelity_tokens) for p, c in texts]
    assert len(set(lens)) > 1 and f["positions"] == sum(n - 1 for n in lens)
    assert f["mean_abs_logprob_diff"] == 0.0 and f["top1_agreement"] == 1.0
    assert abs(f["mean_kl"]) < 1e-6
    lps = []
    for p, c in texts:
        seq = np.asarray([p + c[:jc.fidelity_tokens]], np.int32)
        lp = jax.nn.log_softmax(mtpjax.forward_logits(cfg, params, seq)[0, :-1], -1)
        lps.append(np.take_along_axis(np.asarray(lp), seq[0, 1:, None], -1)[:, 0])
    assert f["mean_logprob"]["dense"] == pytest.approx(np.concatenate(lps).mean(), rel=1e-6)


def test_judge_with_fp8_weights_on_the_tiny_checkpoint(tmp_path):
    """--weights=fp8: stock and candidate both run the FP8 params (quantized at load) and the
    gate passes; the card's fp8 section compares them with the dense model and measures MTP
    acceptance with the head dense and FP8."""
    # one prefill chunk bucket (16: TINY's prompts are at most 16 tokens, so the 64-token
    # bucket would only be compiled, once per k, for this 8-layer model, never run)
    jc = judge.JudgeConfig(checkpoint=TINY_CKPT, out_dir=str(tmp_path), weights="fp8",
                           **{**TINY, "prefill_buckets": (16,)})
    card = judge.run_judge(jc)
    assert card["reason"] is None, card["checks"]
    assert card["settings"]["weights"] == "fp8" and card["settings"]["mtp_weights"] == "auto"
    on_disk = json.load(open(tmp_path / "card.json"))
    f = on_disk["fp8"]
    assert f["target"] == "fp8" and f["mtp_head"] == "dense"
    fd = f["fidelity_vs_dense"]
    for key in ("mean_abs_logprob_diff", "top1_agreement", "mean_kl", "how", "texts",
                "positions"):
        assert key in fd, key
    assert 0.0 < fd["top1_agreement"] <= 1.0
    assert fd["mean_abs_logprob_diff"] > 0.0 and fd["mean_kl"] > 0.0   # FP8 is not dense
    assert fd["mean_abs_logprob_diff"] < 0.1 and fd["top1_agreement"] > 0.9
    ma = f["mtp_acceptance"]
    assert ma["prompts"] == TINY["gate_prompts"] and ma["k"] == 1 and ma["how"]
    for head in ("dense_head", "fp8_head"):
        v = ma[head]
        assert 1.0 <= v["tokens_per_verify_step"] <= ma["k"] + 1, v
        assert len(v["acceptance_by_position"]) == ma["k"] and v["verify_steps"] > 0
    md = (tmp_path / "card.md").read_text()
    assert "## FP8 weights" in md and "top-1 agreement" in md and "MTP head" in md


def test_fp8_head_variants_share_the_target():
    """The MTP-head variant the judge builds keeps the target's FP8 weights bit for bit."""
    jc = judge.JudgeConfig(checkpoint=TINY_CKPT, weights="fp8")
    cfg, params, dense = judge.load_weights(jc)
    assert quant.has_fp8(params.layers) and judge.head_weights(params) == "dense"
    assert not quant.has_fp8(dense)
    other, tree = judge.other_head(jc, cfg, params, dense)
    assert other == "fp8" and judge.head_weights(tree) == "fp8"
    same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a, np.float32),
                                                         np.asarray(b, np.float32))),
                        params.layers, tree.layers)
    assert all(jax.tree.leaves(same))
    jc_dense = judge.JudgeConfig(checkpoint=TINY_CKPT)
    assert not quant.has_fp8(judge.load_weights(jc_dense)[1])
    assert judge.load_weights(jc_dense)[2] is None


def test_draft_vocabulary_settings_of_the_candidate_and_its_clock():
    """--draft_vocab: a share of the checkpoint's list (or a size) for the candidate; the
    h200 clock prices the same share of the 27B's 248,320 ids unless --clock_draft_vocab."""
    from mtpjax.config import Config
    jc = judge.JudgeConfig(draft_vocab=0.125, clock="h200")
    cfg = Config.from_pretrained(jc.checkpoint)
    ids = judge.draft_ids(jc, cfg)
    assert len(ids) == 512 and list(ids) == sorted(ids)
    assert judge.clock_draft_rows(jc, cfg) == 31040
    assert len(judge.draft_ids(judge.JudgeConfig(draft_vocab=100), cfg)) == 100
    assert judge.clock_draft_rows(judge.JudgeConfig(draft_vocab=0.5, clock_draft_vocab=65536),
                                  cfg) == 65536
    assert judge.draft_ids(judge.JudgeConfig(), cfg) is None
    assert judge.clock_draft_rows(judge.JudgeConfig(), cfg) is None


def test_busy_page_use_is_time_weighted_per_step():
    """page_use_waiting is the pool as each step ran (its first token, before a lane ending in
    it frees pages), weighted by the time until the next step: a speculative engine emitting
    several tokens per step is not charged for the moments after a request ends."""
    from types import SimpleNamespace as NS

    class Clock:                # a cost_model.VirtualClock's interface, nothing priced
        now, device_s, host_s, idle_s, launches = 0.0, 0.0, 0.0, 0.0, {}
        device_range, offset_prefill_s = {"fast": 0.0, "mid": 0.0, "slow": 0.0}, 0.0

    class Fake:
        max_lanes, depth_steps, clock = 2, [0], Clock()

        def __init__(self):
            self.timing, self.free = {"steps": 0}, 0

        def stats(self):
            return {"free_pages": self.free, "total_pages": 10}

        def reset_timing(self, keys):
            pass

        def generate(self, prompts, params, on_token):
            # (time, [(request, free pages when its token is emitted)]) per step
            script = [(0.0, [(0, 0), (1, 0)]),
                      (1.0, [(1, 0), (0, 5)]),   # request 1 ends in this step: 5 pages free
                      (3.0, [(0, 1)]), (4.0, [(2, 5), (0, 5)]), (5.0, [(2, 5)])]
            for t, toks in script:
                self.clock.now = t
                for rid, free in toks:
                    self.free = free
                    on_token(rid, [1])
                self.timing["steps"] += 1
            return [NS(finish_reason="length", token_ids=[1, 2], error=None)] * len(prompts)

    r = judge.timed_generate(Fake(), [[1], [2], [3]], None)
    # steady (2 of 3 started) from step 1 (use 1.0, held 2 s) through step 3 (use 0.9, 1 s);
    # per-token samples would count the 0.5 after request 1 ended: (1 + 0.5 + 0.9) / 3 = 0.8
    assert r["page_use_waiting"] == pytest.approx((1.0 * 2 + 0.9 * 1) / 3)
    assert judge._weighted_mean([]) is None


def test_busy_pool_is_filled_by_its_lanes_fresh_prompts():
    """The busy pool is at most what busy_lanes fresh requests hold at admission (the pages of
    their prompts, kv_pool.tokens_touched_decode at depth 0), so a wave of new, short
    sequences cannot leave pages free while every lane runs: the pool, not the lane count,
    limits admission. (The earlier pool, 0.6 x the mid-reply pages, was 57 pages for these
    prompts: 16 fresh lanes of 48 tokens held 48, and use fell to 0.65 after such waves.)"""
    from mtpjax.engine.kv_pool import tokens_touched_decode
    jc = judge.JudgeConfig()
    prompts = [[1] * 48, [2] * 60, [3] * 50]
    pages = judge.busy_pages(jc, prompts)
    fresh = -(-tokens_touched_decode(48 - 1, 0) // jc.page_size)   # the shortest prompt's
    assert jc.busy_lanes * fresh >= pages
    mean_len = np.mean([len(p) for p in prompts]) + jc.max_new_tokens / 2 + 2 * jc.k + 1
    assert pages <= int(jc.busy_lanes * np.ceil(mean_len / jc.page_size) * jc.busy_fill)
    # a pool the fill fraction already keeps below the fresh lanes' pages stays as it was
    small = judge.JudgeConfig(busy_fill=0.3)
    assert judge.busy_pages(small, prompts) == int(
        small.busy_lanes * np.ceil(mean_len / small.page_size) * 0.3)
