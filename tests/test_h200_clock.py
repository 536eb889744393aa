"""The H200 clock (`--clock=h200`, `Engine(clock=...)`): the engine runs here and every program
it launches advances a cost_model.VirtualClock by the modelled price of that program, plus the
host time measured here. Checked: the clock changes time only (tokens equal the clock-less
engine's); the modelled device time is exactly the cost model's prices of the programs the
engine launched (counted by key against the engine's own counters, priced again by a fresh
model); host time is measured, excludes the caller's callbacks, and is reported; TTFT is on
the clock; the judge's card with --clock=h200.
"""

import collections
import json
import time

import pytest

import mtpjax
from experiments import card as card_lib
from experiments import judge, judge_gate as gate
from judge_fixtures import write_judge_checkpoint
from mtpjax.cost_model import CostModel, VirtualClock

from tiny_models import TP_CFG as CFG, TP_ENGINE_KW, TP_PARAMS as PARAMS, TP_PROMPTS, \
    TP_SAMPLING

K = 2
PROMPTS = TP_PROMPTS + [[2, 4, 6, 8, 10, 12, 1, 3, 5, 7, 9, 11, 0, 2, 4, 6, 8, 10]]  # 2 chunks
SAMPLING = TP_SAMPLING + [TP_SAMPLING[1]]


class RecordingClock(VirtualClock):
    """A VirtualClock that also keeps every launch's arguments and price."""

    def __init__(self, model):
        super().__init__(model)
        self.calls = []

    def launch(self, key, contexts=(), start=0, is_last=True, wait=True):
        s = super().launch(key, contexts, start, is_last, wait)
        start = int(start) if isinstance(start, int) else tuple(map(int, start))
        self.calls.append((tuple(key), tuple(contexts), start, bool(is_last), s))
        return s


def _engine(clock=None):
    return mtpjax.Engine(CFG, PARAMS, num_speculative_tokens=K, clock=clock, **TP_ENGINE_KW)


@pytest.fixture(scope="module")
def runs():
    """The same requests on an engine without a clock and on one with a recording clock."""
    plain = _engine().generate(PROMPTS, SAMPLING)
    clock = RecordingClock(CostModel(K=K, page_size=16))
    e = _engine(clock)
    outs = e.generate(PROMPTS, SAMPLING)
    return plain, outs, e, clock, dict(e.timing), e.stats()


def test_the_clock_changes_time_only(runs):
    plain, outs, *_ = runs
    for a, b in zip(plain, outs):
        assert b.error is None and b.token_ids == a.token_ids and b.finish_reason == a.finish_reason


def test_device_time_is_the_cost_models_price_of_every_launched_program(runs):
    _, outs, e, clock, timing, _ = runs
    fresh = CostModel(K=K, page_size=16)
    prices = [fresh.program(key, ctx, start, last).seconds for key, ctx, start, last, _ in clock.calls]
    assert clock.device_s == pytest.approx(sum(prices), rel=1e-12)
    assert [c[-1] for c in clock.calls] == pytest.approx(prices, rel=1e-12)
    # every program the engine ran is on the clock, counted by key
    kinds = collections.Counter(key[0] for key, *_ in clock.calls)
    assert dict(clock.launches) == dict(kinds)
    assert kinds["decode"] + kinds["mixed"] == timing["steps"] == sum(e.depth_steps) > 0
    assert kinds["mixed"] == timing["mixed_steps"]
    # a packed launch carries several chunks (one start each)
    chunks = sum(len(start) if isinstance(start, tuple) else 1
                 for key, _, start, _, _ in clock.calls if key[0] in ("prefill", "mixed"))
    assert chunks == timing["prefill_chunks"] > len(PROMPTS)
    assert timing["packed_steps"] == sum(len(key) == (5 if key[0] == "mixed" else 3)
                                         for key, *_ in clock.calls
                                         if key[0] in ("prefill", "mixed"))
    assert kinds["move_lane"] == timing["lane_moves"]
    assert set(kinds) <= {"decode", "mixed", "prefill", "move_lane", "snapshot", "snapshot_restore"}
    # step_s / prefill_s hold modelled seconds
    dec = sum(c[-1] for c in clock.calls if c[0][0] in ("decode", "mixed"))
    assert timing["step_s"] == pytest.approx(dec, rel=1e-12)
    assert timing["prefill_s"] == pytest.approx(
        sum(c[-1] for c in clock.calls if c[0][0] in ("prefill", "snapshot")), rel=1e-12)
    # decode contexts are the tokens each busy lane has cached: at least its prompt, fewer
    # than prompt + reply; a prompt's chunks start where the previous one ended
    shortest, longest = min(map(len, PROMPTS)) - 1, max(len(p) + 14 for p in PROMPTS)
    for key, ctx, *_ in clock.calls:
        if key[0] in ("decode", "mixed"):
            assert 1 <= len(ctx) <= key[2] and all(shortest <= c < longest for c in ctx), (key, ctx)
    starts = [x for key, _, start, _, _ in clock.calls if key[0] in ("prefill", "mixed")
              for x in (start if isinstance(start, tuple) else (start,))]
    assert 16 in starts and 0 in starts


def test_each_launch_is_priced_at_the_three_constant_sets(runs):
    """One run, three prices: the clock's mid total is its device time; the fast and slow
    totals are exactly the fast / slow prices of the same launches (priced again here), and
    every launch costs less at fast and more at slow than at mid."""
    from mtpjax.cost_model import H200, H200_FAST, H200_SLOW, price
    *_, clock, _, _ = runs
    model = CostModel(K=K, page_size=16)
    assert clock.device_range["mid"] == pytest.approx(clock.device_s, rel=1e-12)
    for n, hw in (("fast", H200_FAST), ("slow", H200_SLOW)):
        want = sum(price(model.program(key, ctx, start, last), hw)
                   for key, ctx, start, last, _ in clock.calls)
        assert clock.device_range[n] == pytest.approx(want, rel=1e-9), n
    for key, ctx, start, last, s in clock.calls:
        c = model.program(key, ctx, start, last)
        assert s == pytest.approx(price(c, H200), rel=1e-12)
        assert price(c, H200_FAST) < s < price(c, H200_SLOW)
    rep = clock.report()
    assert set(rep["device_range_s"]) == {"fast", "mid", "slow"}
    assert set(rep["range_hardware"]) == {"fast", "slow"}


def test_range_constants_bracket_the_mid_set_and_cite_a_source():
    """Each bound sits on the right side of the mid constant (4.03 TB/s, 2.5 us a kernel, 20
    us a program, unchanged) and says where it comes from: a URL or the word assumption."""
    from mtpjax.cost_model import H200, H200_FAST, H200_SLOW
    assert (H200.hbm_bytes_per_s, H200.launch_s, H200.program_s) == (4.03e12, 2.5e-6, 20e-6)
    assert H200_FAST.hbm_bytes_per_s > H200.hbm_bytes_per_s > H200_SLOW.hbm_bytes_per_s
    assert H200_FAST.launch_s < H200.launch_s < H200_SLOW.launch_s
    assert H200_FAST.program_s < H200.program_s < H200_SLOW.program_s
    for hw in (H200_FAST, H200_SLOW):
        for f in ("hbm_bytes_per_s", "launch_s", "program_s"):
            src = hw.sources[f]
            assert "https://" in src or "assumption" in src, (hw.name, f)


def test_a_long_context_is_priced_not_run():
    """VirtualClock(context_offset=N): decode steps at each lane's context + N; a request's
    first chunk (start 0) pays the prefill of the N tokens, in 2,048-token chunks, then its
    own chunk at start N; a later chunk only its own; the range moves with it."""
    from mtpjax.cost_model import H200_SLOW, price
    model = CostModel(K=K, page_size=16)
    clock = VirtualClock(model, context_offset=8192)
    assert clock.launch(("decode", 1, 2), [40, 7]) == pytest.approx(
        model.decode(1, 2, [8232, 8199]).seconds)
    long = [model.prefill(2048, s) for s in range(0, 8192, 2048)]
    first = clock.launch(("prefill", 16), [], 0)
    assert first == pytest.approx(sum(c.seconds for c in long)
                                  + model.prefill(16, 8192).seconds)
    assert clock.launch(("prefill", 16), [], 16) == pytest.approx(
        model.prefill(16, 8208).seconds)
    assert clock.launch(("mixed", 1, 2, 16), [5], 0) == pytest.approx(
        sum(c.seconds for c in long) + model.mixed(1, 2, 16, [8197], 8192).seconds)
    assert clock.device_range["slow"] > clock.device_range["mid"] == pytest.approx(clock.device_s)
    assert clock.report()["context_offset"] == 8192
    assert price(long[0], H200_SLOW) > long[0].seconds
    with pytest.raises(ValueError):
        VirtualClock(model, context_offset=-1)


def test_the_depth_policy_keys_costs_by_the_priced_context():
    """AdaptiveDepth(context_offset=N) files a step's cost under the context the clock priced
    (the lanes' + N), so a long-context run's depths follow long-context costs."""
    from mtpjax.engine.depth import AdaptiveDepth, context_bucket
    from mtpjax.engine.scheduler import LaneView, RequestStats, StepView
    view = StepView(2, 2, (LaneView(0, 40, 2, RequestStats.for_depth(2)),), 1, 0)
    for off, want in ((0, 256), (32768, context_bucket(32768 + 40, 256))):
        pol = AdaptiveDepth(context_offset=off)
        pol.observe(view, 1, 0.02, [1], False)
        assert pol.costs.count(1, 1, want) == 1, off
    assert want == 65536
    with pytest.raises(ValueError):
        AdaptiveDepth(context_offset=-1)


def test_long_context_workloads_need_the_clock():
    with pytest.raises(ValueError, match="clock=h200"):
        judge.check_config(judge.JudgeConfig(workloads=("solo_8k",), clock="wall"))
    with pytest.raises(ValueError, match="unknown workload"):
        judge.long_context("busy_8k")
    assert judge.long_context("team_32k") == ("team", 32768)
    assert judge.long_context("team") == ("team", 0)


def test_host_time_is_measured_reported_and_leaves_callbacks_out(runs):
    _, outs, e, clock, timing, stats = runs
    # host_work_s: the host's own time; host_s: what the modelled device waited for it
    # (the overlapped loop hides host work behind a launched step, never more than it)
    assert clock.host_s > 0 and timing["host_work_s"] == pytest.approx(clock.host_s)
    assert timing["host_s"] == pytest.approx(clock.idle_s)
    assert 0 <= clock.idle_s <= clock.host_s + 1e-12
    assert stats["clock"]["host_s"] == clock.host_s and stats["clock"]["device_s"] == clock.device_s
    assert stats["clock"]["now"] == pytest.approx(clock.device_s + clock.idle_s)
    # TTFT on the clock: one first token per request, each after at least its own prefill
    assert timing["first_tokens"] == len(PROMPTS)
    least = min(c[-1] for c in clock.calls if c[0][0] in ("prefill", "mixed"))
    assert timing["ttft_s"] >= len(PROMPTS) * least
    # the caller's on_token time is the caller's, not the engine's host time
    slept = []

    def slow(i, ids):
        time.sleep(0.01)
        slept.append(0.01)

    host0, dev0 = clock.host_s, clock.device_s
    again = e.generate(PROMPTS[:2], SAMPLING[:2], on_token=slow)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs[:2]]
    assert len(slept) >= 10 and clock.device_s > dev0
    assert clock.host_s - host0 < 0.5 * sum(slept), (clock.host_s - host0, sum(slept))


def test_clock_must_price_this_engines_shapes():
    with pytest.raises(ValueError, match="K = 3"):
        _engine(VirtualClock(CostModel(K=3, page_size=16)))
    with pytest.raises(ValueError, match="page_size = 8"):
        _engine(VirtualClock(CostModel(K=K, page_size=8)))
    assert card_lib.make_clock("wall", K) is None
    with pytest.raises(ValueError, match="--clock must be one of"):
        card_lib.make_clock("h100", K)
    c = card_lib.make_clock("h200", K, weights="fp8", page_size=16)
    assert (c.model.K, c.model.weights, c.model.page_size, c.now) == (K, "fp8", 16, 0.0)
    assert "not timed" in card_lib.predicted_words() and "one H200" in card_lib.predicted_words()


def test_a_calibration_file_prices_the_clock_and_every_report_names_it(tmp_path):
    """--clock_calibration=PATH: make_clock prices at the file's mid set and keeps its range;
    the report words say "calibrated from PATH: device, jax, date" (else "published figures
    and assumptions"), from the path or from a card's clock report; clock_check takes it
    too; a calibration without --clock=h200, or a bad file, fails in the
    judge's config check, before anything loads."""
    import copy
    from calibration_fixtures import DOC, write
    from experiments import clock_check
    from mtpjax.cost_model import H200_FAST, H200_SLOW, CalibrationError, load_calibration
    path = write(tmp_path / "cal.json")
    cs = load_calibration(path)
    c = card_lib.make_clock("h200", K, page_size=16, calibration=path)
    plain = card_lib.make_clock("h200", K, page_size=16)
    assert c.model.hw == cs.mid and c.range_hw == cs.by_name()
    assert (plain.range_hw["fast"], plain.range_hw["slow"]) == (H200_FAST, H200_SLOW)
    s = c.launch(("decode", 0, 1), [100])
    assert s == CostModel(K=K, page_size=16, hw=cs.mid).decode(0, 1, [100]).seconds
    assert s != plain.launch(("decode", 0, 1), [100])
    words = card_lib.predicted_words(calibration=path)
    assert (f"calibrated from {path}: NVIDIA H200, jax 0.11.2, 2026-12-07" in words
            and "4.2 TB/s, 2 us a kernel, 15 us a program" in words), words
    assert "published figures and assumptions" in card_lib.predicted_words()
    assert card_lib.predicted_words(hardware=c.report()["hardware"]) == words
    rng = {"h200": {"range": {"specscore": [1.0, 1.1, 1.2], "workloads": {}},
                    "model": {"hardware": c.report()["hardware"]}}}
    assert "mid calibrated" in card_lib.render_range_md(rng)[0]
    assert clock_check.check(calibration=path)["constants"] == cs.origin
    assert (clock_check.check(calibration=path)["rows"][1]["tpot_ms"]
            != clock_check.check()["rows"][1]["tpot_ms"])
    with pytest.raises(ValueError, match="--clock=h200"):
        card_lib.make_clock("wall", K, calibration=path)
    with pytest.raises(ValueError, match="--clock=h200"):
        judge.check_config(judge.JudgeConfig(clock="wall", clock_calibration=path))
    judge.check_config(judge.JudgeConfig(clock="h200", clock_calibration=path))
    bad = copy.deepcopy(DOC)
    del bad["constants"]["hbm_bytes_per_s"]
    with pytest.raises(CalibrationError, match="constants.hbm_bytes_per_s is missing"):
        judge.check_config(judge.JudgeConfig(clock="h200",
                                             clock_calibration=write(tmp_path / "b.json", bad)))


@pytest.fixture(scope="module")
def judge_ckpt(tmp_path_factory):
    return write_judge_checkpoint(str(tmp_path_factory.mktemp("clock_judge")), peaky=40.0)


def test_judge_card_on_the_h200_clock(judge_ckpt, tmp_path):
    """The smallest judge run (solo, one request, K = 1) with --clock=h200: card.json keeps its
    keys and says "clock": "h200"; tokens/s are the modelled 27B's (about one decode price per
    token at one lane, plus host time), not this CPU's; card.md says so near the top. With a
    long-context workload beside it (solo_32k: the same prompts, priced 32,768 tokens longer):
    SpecScore stays solo's, solo_32k's tokens cost more, its first token pays the long
    prefill, and the card says how it was made. The clock runs on a calibration file's
    constants (--clock_calibration): every price is at its mid set, and the card names it."""
    from calibration_fixtures import write
    from mtpjax.cost_model import load_calibration
    cal = write(tmp_path / "cal.json")
    hw = load_calibration(cal).mid
    jc = judge.JudgeConfig(
        checkpoint=judge_ckpt, out_dir=str(tmp_path), passes=1, workloads=("solo", "solo_32k"),
        solo_requests=1, team_lanes=2, team_requests=2, busy_lanes=2, busy_requests=2,
        prompt_tokens=16, max_new_tokens=6, gate_prompts=2, fidelity_tokens=2,
        progress=False, limits=gate.Limits(busy_page_use_floor=0.5), k=1,
        prefill_buckets=(16,), fidelity_lanes=1, clock="h200", clock_calibration=cal)
    card = judge.run_judge(jc)
    on_disk = json.load(open(tmp_path / "card.json"))
    for key in ("ratios", "specscore", "greedy_agreement", "likelihood", "argmax", "fidelity",
                "lengths", "memory", "acceptance", "limits", "reason", "score",
                "sampled_agreement", "throughput", "step_time_ms", "settings", "depth_hist",
                "ttft_ms", "h200"):
        assert key in on_disk, key
    assert on_disk["clock"] == "h200" and card["reason"] is None, card["checks"]
    solo = on_disk["h200"]["workloads"]["solo"]
    for name, kk in (("stock", 0), ("candidate", 1)):
        model = CostModel(K=kk, hw=hw)
        d0 = model.decode(0, 1, [16]).seconds
        v = solo[name]
        assert v["device_s"] > 0 and v["host_s"] > 0 and 0 < v["host_share"] < 1
        assert v["launches"]["decode"] + v["launches"].get("mixed", 0) == on_disk["decode_steps"]["solo"][name]
        ms_per_token = 1e3 / on_disk["throughput"]["solo"][f"{name}_tok_s"][0]
        assert ms_per_token > 1e3 * d0 * 0.9 and ms_per_token < 1e3 * d0 * 2 + 50, ms_per_token
        # the first token comes after the prompt's prefill: at least its price
        assert on_disk["ttft_ms"]["solo"][name] >= 1e3 * model.prefill(16).seconds
    assert on_disk["h200"]["model"]["model"]["weights"] == "bf16"
    assert on_disk["draft_verify_ms"] is None          # this CPU's split: not on the clock
    # the range: [low, mid, high] with the mid set the card's own numbers, the fast set
    # faster and the slow set slower per token (the same tokens, host time the same)
    rg = on_disk["h200"]["range"]
    lo, mid, hi = rg["specscore"]
    assert lo <= mid <= hi and mid == pytest.approx(on_disk["specscore"], rel=1e-6)
    assert rg["workloads"]["solo"]["ratio"][1] == pytest.approx(on_disk["ratios"]["solo"]["ratio"],
                                                                rel=1e-6)
    for name in ("stock", "candidate"):
        ms = rg["workloads"]["solo"]["ms_per_token"][name]
        assert ms[0] < ms[1] < ms[2], ms
        assert ms[1] == pytest.approx(1e3 / on_disk["throughput"]["solo"][f"{name}_tok_s"][0],
                                      rel=1e-6)
    # the long context: beside SpecScore, dearer per token, its TTFT holds a 32k prefill
    assert on_disk["specscore"] == pytest.approx(on_disk["ratios"]["solo"]["ratio"])
    assert on_disk["settings"]["long_context"] == {"solo": 0, "solo_32k": 32768}
    long_ms = rg["workloads"]["solo_32k"]["ms_per_token"]
    for name in ("stock", "candidate"):
        assert long_ms[name][1] > rg["workloads"]["solo"]["ms_per_token"][name][1], name
        assert on_disk["ttft_ms"]["solo_32k"][name] > 1e3 * sum(
            CostModel(K=0, hw=hw).prefill(2048, s).seconds for s in range(0, 32768, 2048))
        # the 32k prefill left out: well under the all-in ms per token
        dec = rg["workloads"]["solo_32k"]["ms_per_token_without_long_prefill_mid"][name]
        assert 0 < dec < 0.5 * long_ms[name][1], (dec, long_ms[name])
    pol = on_disk["policy"]["solo_32k"]["replicas"][0]["costs_ms"]
    assert pol and all(cell.endswith("/c65536") for cell in pol), pol   # the priced context
    md = (tmp_path / "card.md").read_text()
    assert "Long-context workloads (solo_32k: 32,768 tokens)" in md
    assert "Range over the clock's constants" in md and "SpecScore [" in md
    assert "predicted for Qwen3.5-27B on one H200 by the cost model, not timed" in md[:400]
    assert f"calibrated from {cal}: NVIDIA H200" in md[:900], md[:900]
    assert "mid calibrated, fast / slow the calibration's extremes" in md
    assert on_disk["h200"]["range"]["constants"] == hw.origin
    assert on_disk["h200"]["model"]["hardware"]["launch_s"] == hw.launch_s
    assert "Host time on the clock" in md and "TTFT ms" in md and "clock h200" in md


def test_serve_bench_closed_loop_on_the_clock(runs):
    """serve_bench --clock=h200's level: two clients, the first with two requests in a row
    (the second goes in when the first ends), on the clocked engine: the requests' tokens are
    the engine's usual ones, and every time is the clock's."""
    from experiments import serve_bench
    plain, _, e, clock, *_ = runs
    reqs = [[(PROMPTS[0], SAMPLING[0]), (PROMPTS[1], SAMPLING[1])], [(PROMPTS[2], SAMPLING[2])]]
    now0 = clock.now
    row = serve_bench.run_level_clocked(e, reqs)
    assert row["requests"] == 3 and row["clients"] == 2
    assert row["completion_tokens"] == sum(len(plain[i].token_ids) for i in range(3))
    assert row["wall_s"] == pytest.approx(clock.now - now0)
    assert row["wall_s"] == pytest.approx(row["device_s"] + row["host_s"])
    assert 0 < row["mean_ttft_s"] < row["mean_latency_s"] <= row["wall_s"]
    assert row["engine_iterations"] > 0 and not e.has_work()



def test_judge_with_simulated_acceptance(judge_ckpt, tmp_path):
    """--simulate_acceptance on the judge: the candidate's acceptance is the profile's (one
    that accepts nothing: exactly 1 token per verify step, whatever the checkpoint's drafts
    would earn), the card's header says "simulated acceptance", and the lossless gate reports
    "not applicable" (no score, no failed check)."""
    never = tmp_path / "never.json"
    never.write_text(json.dumps({"name": "never", "tokens_per_verify_step": [1.0, 1.0],
                                 "source": "a test profile"}))
    jc = judge.JudgeConfig(
        checkpoint=judge_ckpt, out_dir=str(tmp_path / "card"), passes=1, workloads=("solo",),
        solo_requests=1, team_lanes=2, team_requests=2, busy_lanes=2, busy_requests=2,
        prompt_tokens=16, max_new_tokens=8, gate_prompts=2, fidelity_tokens=8,
        progress=False, limits=gate.Limits(busy_page_use_floor=0.5), k=2, adaptive=False,
        prefill_buckets=(16,), fidelity_lanes=1, clock="h200", chat=None,
        simulate_acceptance=str(never))
    judge.run_judge(jc)
    c = json.load(open(tmp_path / "card" / "card.json"))
    assert c["simulated_acceptance"]["profile"] == "never"
    assert c["gate"] == "not applicable" and c["reason"] is None and c["score"] is None
    assert c["acceptance"]["solo"] == pytest.approx(1.0)
    assert c["acceptance_by_position"]["solo"]["verify_steps"] > 0
    md = (tmp_path / "card" / "card.md").read_text()
    assert md.startswith("# mtpjax judge card — simulated acceptance")
    assert "Lossless gate: **not applicable**" in md and "| fidelity |" not in md
    with pytest.raises(ValueError, match="unknown acceptance profile"):
        judge.check_config(judge.JudgeConfig(simulate_acceptance="no-such-profile"))


class _FlatModel:
    """Every program costs 10 ms on the modelled device."""
    K, page_size = 0, 16

    def program(self, key, contexts=(), start=0, is_last=True):
        import types
        return types.SimpleNamespace(seconds=0.010)


def test_the_clock_hides_host_time_only_behind_a_running_launch():
    """The overlapped loop on the clock: host work done while a launched program runs is
    hidden up to that program's price, never more; the serial loop (wait=True) hides none."""
    c = VirtualClock(_FlatModel())
    c.add_host(0.002)                      # planning the first step: the device is idle
    c.launch(("decode", 0, 1), wait=False)
    end = c.device_free
    c.add_host(0.004)                      # planning the next step while it runs: hidden
    c.launch(("decode", 0, 1), wait=False)
    c.wait(end)                            # reading the first step's tokens
    assert c.now == pytest.approx(0.012) and c.idle_s == pytest.approx(0.002)
    assert c.hidden_s == pytest.approx(0.004)
    c.add_host(0.015)                      # longer than the 10 ms step behind it: 5 ms show
    c.wait()
    assert c.now == pytest.approx(0.027) and c.idle_s == pytest.approx(0.007)
    assert c.hidden_s == pytest.approx(0.014)
    s = VirtualClock(_FlatModel())         # serial: every launch waited for
    for _ in range(2):
        s.add_host(0.004)
        s.launch(("decode", 0, 1))
    assert s.now == pytest.approx(0.028) and s.idle_s == pytest.approx(0.008) and not s.hidden_s
