"""`python -m experiments [judge]`: SpecScore on solo / team / busy, and the lossless gate.

Contract: ../shared/spec/judge.md. Two engines that differ only in speculation (stock: k = 0;
candidate: MTP with K draft slots) run the same prompts, sampling parameters, kernels, lanes and
page pool. The candidate's depth policy (--adaptive, default on) picks each step's draft depth
in 0..K from measured step cost and acceptance (mtpjax.engine.depth.AdaptiveDepth); --adaptive=false
runs the fixed depth K whenever the pages allow. Order of work:

  0. engine warm-up: `Engine.warmup()` compiles every program a run can launch (every depth
     0..K at every lane bucket, prefill chunks, lane move, snapshots), so that nothing compiles
     inside a timed pass. Every engine has one shape (EngineShape: lane slots, context, pool,
     lane buckets at the workloads' lane counts), so all workloads share one program set
     (32 by default; each XLA:CPU program holds ~500 of the process's 65,530 memory mappings,
     which the card reports). Progress lines on stderr name each program, n of m.
  1. warm-up: every engine/workload pair runs once untimed (compiles the prefill shapes; the
     adaptive policy measures its first step costs here)
  2. passes: per workload, `--passes` passes alternating stock-first / candidate-first;
     ratio of a pass = candidate tokens/s / stock tokens/s; workload ratio = median
  3. gate: memory (each engine's own peak, measured in its own phase), fidelity (teacher-forced
     through the engines' paged programs: the verify path vs the decode path), likelihood and
     argmax of sampled replies scored by the stock model, sampled/greedy agreement, reply
     lengths, and the busy workload's validity (page use >= 0.9 while requests wait)
  4. card: card.md, card.json and plots in --out_dir; the card is printed at the end

--clock=h200: every engine gets its own cost_model.VirtualClock (experiments/card.py
make_clock), so tokens/s, ratios, SpecScore, TTFT and step times are those the cost model
predicts for Qwen3.5-27B on an H200 running this exact schedule (the engines still run here:
the tokens, hence acceptance, depths chosen and every gate check, are real); the host time
measured here is added to each clock and reported on its own line. card.json gets "clock":
"h200" (else "wall") and an "h200" section (each clock's device and host seconds, launches,
the cost model's constants, and `range`: SpecScore, ratios and ms per token at [low, mid, high]
over the clock's fast / mid / slow constant sets, one run repriced).
--clock_calibration=PATH (with --clock=h200): the clock's constants from the calibration file a
lent GPU's `gpu_check` wrote (mtpjax/cost_model.py load_calibration): the measured bandwidth,
kernel and program cost replace the mid set, the range is built around them, and the card
says "calibrated from PATH: device, date" where it otherwise says "published figures and
assumptions". A missing or malformed file fails before anything loads, naming the key.
Long-context workloads (--clock=h200 only): solo_8k, team_8k, solo_32k, team_32k run the
solo / team prompts while the clock prices every program 8,192 / 32,768 tokens longer (their
prefill included); reported beside SpecScore, which stays solo / team / busy.
--simulate_acceptance=NAME|PATH: the candidate's acceptance is drawn from a published profile
(mtpjax/simulated_acceptance.py), for timing only: the card says so and the lossless gate is
"not applicable".

With FP8 weights (`--weights=fp8` quantizes a dense checkpoint at load; stock and candidate both
run the same FP8 params, so the gate compares like with like), the card adds an `fp8` section,
measured before step 1: the FP8 target against the dense one on the fixed texts
(`fidelity_vs_dense`), and the gate workload's candidate with the MTP head dense vs FP8
(`mtp_acceptance`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

import mtpjax
from experiments import card as card_lib
from experiments import chat_workload
from experiments import judge_gate as gate
from experiments import mesh_flags, weight_flags
from experiments.progress import Progress, map_limit, mappings, program_name
from mtpjax import model, quant, steps
from mtpjax.sampling import LaneSampling, SamplingParams

FLAGS = flags.FLAGS
HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CKPT = os.path.join(os.path.dirname(HERE), "checkpoints", "tiny")
TEXTS = os.path.join(HERE, "data", "judge_texts.json")

mesh_flags.define()
weight_flags.define()   # --weights / --mtp_weights: stock and candidate alike; FP8 adds a card section
flags.DEFINE_string("checkpoint", DEFAULT_CKPT, "checkpoint folder (HF layout or converted)")
flags.DEFINE_string("out_dir", "runs/judge", "where card.md, card.json and plots go")
flags.DEFINE_integer("passes", 3, "timed passes per workload")
flags.DEFINE_list("workloads", ["solo", "team", "busy"], "workloads to run")
flags.DEFINE_integer("num_speculative_tokens", 4, "K: the candidate's draft slots (its deepest "
                     "draft depth; >= 1)")
flags.DEFINE_bool("adaptive", True, "candidate depth policy: adaptive over depths 0..K "
                  "(mtpjax.engine.depth.AdaptiveDepth); --adaptive=false: the fixed depth K")
flags.DEFINE_enum("mtp_head", "trained", ["trained", "random"], "the MTP head both engines run: "
                  "trained = the checkpoint's; random = Gaussian noise of the same shapes, dtype "
                  "and per-tensor mean/std (seeded by --seed), a control whose drafts are almost "
                  "never accepted")
flags.DEFINE_integer("max_new_tokens", 48, "reply length cap for the workloads")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "model dtype")
flags.DEFINE_string("kernels", None, "reference | pallas | interpret (default: by backend)")
flags.DEFINE_integer("solo_requests", 4, "requests in the solo workload (served one by one)")
flags.DEFINE_integer("team_lanes", 8, "lanes of the team workload")
flags.DEFINE_integer("team_requests", 16, "requests in the team workload")
flags.DEFINE_integer("busy_lanes", 16, "lanes of the busy workload")
flags.DEFINE_integer("busy_requests", 32, "requests in the busy workload")
flags.DEFINE_float("busy_fill", 0.6, "busy pool size as a fraction of the pages all lanes would "
                   "want (0.6 keeps 0.94 stock / 0.93 candidate of the pages in use while "
                   "requests wait, on checkpoints/tiny; the gate needs >= 0.9)")
flags.DEFINE_integer("page_size", 16, "KV page size (tokens)")
flags.DEFINE_integer("prompt_tokens", 48, "prompt length cap (tokens)")
flags.DEFINE_float("temperature", 0.0, "sampling temperature of the throughput workloads")
flags.DEFINE_float("sample_temperature", 1.0, "temperature of the likelihood/argmax replies")
flags.DEFINE_integer("gate_prompts", 24, "prompts for the sampled-reply checks")
flags.DEFINE_integer("fidelity_tokens", 32, "teacher-forced tokens per fixed text")
flags.DEFINE_float("likelihood_bound", 0.05, "gate limit")
flags.DEFINE_float("argmax_bound", 0.01, "gate limit")
flags.DEFINE_float("fidelity_ceiling", 0.02, "gate limit")
flags.DEFINE_float("length_margin", 0.05, "gate limit")
flags.DEFINE_float("memory_slack_mib", 4096, "gate limit")
flags.DEFINE_float("busy_page_use_floor", 0.9, "busy workload validity: least page use while "
                   "requests wait, for both engines")
flags.DEFINE_integer("fidelity_lanes", 16, "lanes of the fidelity engines (texts per batch)")
flags.DEFINE_float("greedy_agreement_floor", None, "optional gate floor")
flags.DEFINE_integer("seed", 0, "base seed of sampled requests")
flags.DEFINE_bool("progress", True, "progress lines on stderr (loading, compiling n of m, "
                  "passes); --progress=false is quiet")
flags.DEFINE_list("prefill_buckets", ["16", "64"], "padded prefill chunk lengths, one program "
                  "each per K (the largest is the chunk length)")
flags.DEFINE_list("lane_buckets", None, "lane counts the decode steps are compiled for "
                  "(default: the workloads' lane counts, e.g. 1,8,16); every engine shares "
                  "one set of programs")
flags.DEFINE_float("draft_vocab", 0.0, "the candidate drafts over a draft vocabulary "
                   "(mtpjax/draft_vocab.py, the list beside --checkpoint): a share of the "
                   "vocabulary (< 1) or a size (>= 1); 0: the whole vocabulary")
flags.DEFINE_integer("clock_draft_vocab", 0, "--clock=h200: the 27B's draft vocabulary rows "
                     "the clock prices (0: the same share of its 248,320 ids as --draft_vocab, "
                     "the whole vocabulary without one)")
flags.DEFINE_bool("prefix_cache", True, "the chat workload's engines (stock and candidate) reuse "
                  "cached prompt prefixes; each timed pass starts from an empty cache (solo, team "
                  "and busy run without the cache, as the reference card)")
flags.DEFINE_bool("chat", True, "also run the chat workload (multi-turn conversations on a "
                  "shared system prompt; reported beside SpecScore)")
flags.DEFINE_integer("chat_conversations", 8, "conversations of the chat workload")
flags.DEFINE_integer("chat_turns", 3, "turns per conversation")
flags.DEFINE_integer("chat_system_tokens", 64, "shared system prompt length (tokens)")
card_lib.define_clock_flag()
card_lib.define_simulate_flag()


@dataclasses.dataclass
class JudgeConfig:
    checkpoint: str = DEFAULT_CKPT
    out_dir: str = "runs/judge"
    passes: int = 3
    workloads: tuple = ("solo", "team", "busy")
    k: int = 4                  # K: the candidate's draft slots (deepest depth)
    adaptive: bool = True       # candidate policy: adaptive over 0..K, else fixed K
    mtp_head: str = "trained"   # trained | random (the useless-head control)
    max_new_tokens: int = 48
    dtype: str = "float32"
    weights: str = "auto"       # mtpjax.load_checkpoint(weights=...): auto | fp8 | dense
    mtp_weights: str = "auto"   # ... (mtp_weights=...)
    kernels: str | None = None
    solo_requests: int = 4
    team_lanes: int = 8
    team_requests: int = 16
    busy_lanes: int = 16
    busy_requests: int = 32
    busy_fill: float = 0.6
    page_size: int = 16
    prompt_tokens: int = 48
    temperature: float = 0.0
    sample_temperature: float = 1.0
    gate_prompts: int = 24
    fidelity_tokens: int = 32
    fidelity_lanes: int = 16
    seed: int = 0
    progress: bool = True
    limits: gate.Limits = gate.Limits()
    tp: int = 1                 # stock and candidate on the same tp x dp devices
    dp: int = 1
    prefix_cache: bool = True   # the chat engines (both); each timed pass starts empty
    chat: chat_workload.ChatSpec | None = None   # the chat workload (None: not run)
    lane_buckets: tuple | None = None   # decode lane buckets (None: the workloads' lanes)
    prefill_buckets: tuple = (16, 64)   # prefill chunk buckets; the largest is the chunk
    clock: str = "wall"         # wall | h200 (card_lib.make_clock: modelled 27B on an H200)
    clock_calibration: str | None = None   # h200: constants from a gpu_check calibration file
    draft_vocab: float = 0.0    # candidate's draft vocabulary: share (< 1) or size; 0 none
    clock_draft_vocab: int = 0  # the h200 clock's 27B draft rows (0: draft_vocab's share)
    simulate_acceptance: str | None = None   # profile: the candidate's acceptance drawn
                                             # from it (timing only; gate not applicable)


def _from_flags() -> JudgeConfig:
    f = FLAGS
    return JudgeConfig(
        checkpoint=f.checkpoint, out_dir=f.out_dir, passes=f.passes, workloads=tuple(f.workloads),
        k=f.num_speculative_tokens, adaptive=f.adaptive, mtp_head=f.mtp_head,
        max_new_tokens=f.max_new_tokens, dtype=f.dtype,
        weights=f.weights, mtp_weights=f.mtp_weights,
        kernels=f.kernels, solo_requests=f.solo_requests, team_lanes=f.team_lanes,
        team_requests=f.team_requests, busy_lanes=f.busy_lanes, busy_requests=f.busy_requests,
        busy_fill=f.busy_fill, page_size=f.page_size, prompt_tokens=f.prompt_tokens,
        temperature=f.temperature, sample_temperature=f.sample_temperature,
        gate_prompts=f.gate_prompts, fidelity_tokens=f.fidelity_tokens,
        fidelity_lanes=f.fidelity_lanes, seed=f.seed, progress=f.progress, tp=f.tp, dp=f.dp,
        prefix_cache=f.prefix_cache, clock=f.clock, clock_calibration=f.clock_calibration,
        draft_vocab=f.draft_vocab,
        clock_draft_vocab=f.clock_draft_vocab, simulate_acceptance=f.simulate_acceptance,
        lane_buckets=tuple(int(b) for b in f.lane_buckets) if f.lane_buckets else None,
        prefill_buckets=tuple(int(b) for b in f.prefill_buckets),
        chat=(chat_workload.ChatSpec(f.chat_conversations, f.chat_turns, f.chat_system_tokens)
              if f.chat else None),
        limits=gate.Limits(f.greedy_agreement_floor, f.likelihood_bound, f.argmax_bound,
                           f.fidelity_ceiling, f.length_margin, f.memory_slack_mib,
                           f.busy_page_use_floor))


# ------------------------------------------------------------------------------- inputs

def load_texts(tokenizer, jc: JudgeConfig):
    """(prompt ids, continuation ids) per committed fixed text."""
    with open(TEXTS) as f:
        texts = json.load(f)["texts"]
    out = []
    for t in texts:
        p = tokenizer.encode(t["prompt"]).ids[-jc.prompt_tokens:]
        c = tokenizer.encode(t["continuation"]).ids
        out.append((p, c))
    return out


def _tokenizer(path):
    from tokenizers import Tokenizer
    tok = os.path.join(path, "tokenizer.json")
    if not os.path.exists(tok):
        raise FileNotFoundError(f"{tok} not found: the judge needs the checkpoint's tokenizer")
    return Tokenizer.from_file(tok)


# ------------------------------------------------------------------------------- engines

def check_config(jc: JudgeConfig, cfg=None) -> None:
    """Bad settings fail before anything loads or compiles, with the flag to change.

    K = 0 is refused rather than run as stock against stock: the judge measures speculation,
    and a candidate without draft slots would report a meaningless ratio of 1."""
    if jc.k < 1:
        raise ValueError(f"--num_speculative_tokens (K) must be >= 1, got {jc.k}: the candidate "
                         "speculates with up to K drafts (K = 0 would be stock against stock)")
    if jc.mtp_head not in ("trained", "random"):
        raise ValueError(f"--mtp_head must be 'trained' or 'random', got {jc.mtp_head!r}")
    if jc.passes < 1:
        raise ValueError(f"--passes must be >= 1, got {jc.passes}")
    # an unknown clock, a calibration without --clock=h200 or a bad calibration file
    card_lib.check_clock_flags(jc.clock, jc.clock_calibration)
    card_lib.simulator(jc.simulate_acceptance)      # an unknown profile fails here
    for w in jc.workloads:
        if long_context(w)[1] and jc.clock != "h200":
            raise ValueError(f"workload {w!r} is a long context priced by the H200 clock: run it "
                             "with --clock=h200")
    if jc.clock != "wall" and jc.dp > 1:
        raise ValueError("--clock=h200 models one engine per clock; dp replicas would each need "
                         "their own and a rule to merge them: run with --dp=1")
    if cfg is not None and not cfg.has_mtp:
        raise ValueError(f"{jc.checkpoint} has no MTP head: the candidate cannot draft")


def candidate_policy(jc: JudgeConfig, k: int, context_offset: int = 0):
    """The Engine's speculation_policy: "adaptive" (each engine, each dp replica, builds its
    own AdaptiveDepth, so what one workload learned never leaks into another's run) or None
    (fixed depth K whenever the pages allow). Stock (k = 0) has one depth only. A
    long-context workload's policy keys its costs by the context the clock prices."""
    if not (k and jc.adaptive):
        return None
    if context_offset:
        from mtpjax.engine.depth import AdaptiveDepth
        return AdaptiveDepth(context_offset=context_offset)
    return "adaptive"


# Long-context workloads on the H200 clock: "<solo|team>_<8k|32k>" (see long_context).
LONG_CONTEXTS = {"8k": 8192, "32k": 32768}
BASE_WORKLOADS = ("solo", "team", "busy")


def long_context(name: str) -> tuple[str, int]:
    """(base workload, tokens the clock adds before every prompt): "solo_32k" -> ("solo",
    32768), "team" -> ("team", 0). The engines run the checkpoint's short prompts (the tiny's
    context is small, and a 32k prefill on this CPU would take the run); the clock prices
    the 27B as if each lane held that many more tokens (cost_model.VirtualClock
    context_offset), its prefill included."""
    base, _, size = name.partition("_")
    if not size:
        return name, 0
    if base not in ("solo", "team") or size not in LONG_CONTEXTS:
        raise ValueError(f"unknown workload {name!r}: long-context workloads are solo or team "
                         f"with a suffix of {', '.join(LONG_CONTEXTS)} (e.g. solo_8k)")
    return base, LONG_CONTEXTS[size]


@dataclasses.dataclass(frozen=True)
class EngineShape:
    """What every judge engine shares, so that all of them run one set of compiled programs
    per k (programs are keyed by shapes; Engine.shape_key): lane slots (the most lanes of any
    workload), context, the device pool (every slot at full context) and the decode lane
    buckets (the workloads' lane counts). A workload's own lanes and page budget are engine
    settings that change no shape (Engine max_lanes, num_pages). Without this the default
    judge compiled ~160 programs and ran out of memory mappings (issue 22)."""
    lane_slots: int
    max_seq_len: int
    lane_buckets: tuple


def engine_shape(jc: JudgeConfig, lanes: list[int], max_seq_len: int) -> EngineShape:
    buckets = jc.lane_buckets or tuple(sorted(set(lanes)))
    return EngineShape(max(max(lanes), max(buckets)), max_seq_len, tuple(buckets))


def make_engine(cfg, params, jc: JudgeConfig, k: int, lanes: int, num_pages: int | None,
                shape: EngineShape, placed=None, prefix_cache: bool = False,
                context_offset: int = 0):
    """Stock (k = 0) and candidate engines differ only in speculation (k and its depth policy):
    same lanes, pool, kernels and devices (jc.tp x jc.dp; `placed`: the params already laid
    out there, shared). `lanes` and `num_pages` (None: every lane at full context) are the
    workload's; the shapes are `shape`'s, common to every workload. The prefix cache is on
    only for the chat workload: solo, team and busy measure speculation as the reference
    card does (busy's page-use validity counts cached pages as free, and repeated prompts
    would turn its prefills into hits). With jc.clock = "h200" the engine gets its own
    VirtualClock (card_lib.make_clock). The device pool is the Engine's default for the
    shape's lane_slots (every slot at full context)."""
    clock = card_lib.make_clock(jc.clock, k, weights=card_lib.clock_weights(params), tp=jc.tp,
                                page_size=jc.page_size, draft_vocab=clock_draft_rows(jc, cfg),
                                context_offset=context_offset,
                                calibration=jc.clock_calibration)
    return mtpjax.make_engine(cfg, params, tp=jc.tp, dp=jc.dp, placed=placed, clock=clock,
                              draft_vocab=draft_ids(jc, cfg) if k > 0 else None,
                              num_speculative_tokens=k,
                              speculation_policy=candidate_policy(jc, k, context_offset),
                              simulate_acceptance=(card_lib.simulator(jc.simulate_acceptance,
                                                                      jc.seed) if k else None),
                              max_lanes=lanes,
                              max_seq_len=shape.max_seq_len, kernels=jc.kernels,
                              page_size=jc.page_size,
                              num_pages=num_pages,
                              lane_slots=shape.lane_slots,
                              lane_buckets=[b for b in shape.lane_buckets if b <= shape.lane_slots],
                              prefill_chunk=max(jc.prefill_buckets),
                              prefill_buckets=jc.prefill_buckets, prefix_cache=prefix_cache,
                              # one ride bucket: the judge's prompts are short, and a second
                              # set of mixed programs per k would cost the main job ~3,500
                              # memory mappings (tests/test_main_job.py's budget)
                              ride_buckets=[max(jc.prefill_buckets)])


def draft_ids(jc: JudgeConfig, cfg):
    """The candidate's draft vocabulary ids (None: the whole vocabulary): jc.draft_vocab as a
    share (< 1) or a size, from the list beside the checkpoint."""
    from mtpjax import draft_vocab as dv
    if not jc.draft_vocab:
        return None
    spec = jc.draft_vocab if jc.draft_vocab < 1 else int(jc.draft_vocab)
    return dv.resolve(spec, cfg.vocab_size, jc.checkpoint)


def clock_draft_rows(jc: JudgeConfig, cfg) -> int | None:
    """The 27B draft rows the h200 clock prices: jc.clock_draft_vocab, else the candidate's
    share of the 27B vocabulary (None: the whole vocabulary)."""
    from mtpjax.config import qwen3_5_27b
    if jc.clock_draft_vocab:
        return jc.clock_draft_vocab
    ids = draft_ids(jc, cfg)
    if ids is None:
        return None
    return round(len(ids) / cfg.vocab_size * qwen3_5_27b().vocab_size)


MEMORY_HOW = ("each engine's own phase: peak bytes of the live device arrays its run holds "
              "(params, caches, lane state, step inputs and outputs), sampled after every "
              "committed token; other engines' buffers excluded; XLA temporaries inside a "
              "step are not included")


def generate_measuring_memory(engine, prompts, params):
    """engine.generate in its own memory phase: (outputs, peak bytes of the run).

    Every device array alive when the phase starts that is not the engine's own (its params,
    cache and lane state) belongs to someone else and is left out; everything else alive at a
    sample point is charged to this engine's run. The process-wide `peak_bytes_in_use` of a
    GPU cannot do this (it never resets and covers every engine), so it is only reported
    beside (`process_peak_mib`).
    """
    own = {id(x) for e in getattr(engine, "replicas", [engine])
           for x in jax.tree.leaves((e.params, e.cache, e.state))}
    others = {id(x) for x in jax.live_arrays()} - own
    peak = 0

    def sample(*_):
        nonlocal peak
        live = {id(x): x for x in jax.live_arrays() if id(x) not in others}
        peak = max(peak, sum(x.nbytes for x in live.values()))

    sample()
    outs = engine.generate(prompts, params, on_token=sample)
    sample()
    return outs, peak


def process_peak_mib() -> float | None:
    """The device's process-wide peak (GPU), for the card only: it is shared by all engines."""
    dev = jax.devices()[0]
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    if stats and "peak_bytes_in_use" in stats:
        return stats["peak_bytes_in_use"] / 2 ** 20
    return None


# ------------------------------------------------------------------------------- workloads

def workload_plan(name: str, jc: JudgeConfig, prompts):
    name = long_context(name)[0]
    if name == "solo":
        return 1, prompts[:jc.solo_requests]
    if name == "team":
        return jc.team_lanes, prompts[:jc.team_requests]
    if name == "busy":
        reqs = [prompts[i % len(prompts)] for i in range(jc.busy_requests)]
        return jc.busy_lanes, reqs
    raise ValueError(f"unknown workload {name!r}")


def busy_pages(jc: JudgeConfig, prompts) -> int:
    """Pool size: busy_fill x the pages every busy lane would hold at its mid-reply length,
    counting the 2K - 1 positions past a lane's last token that a depth-K step writes
    (kv_pool.tokens_touched_decode), so the candidate's deepest step is affordable in the
    steady state while the pool stays full; stock runs the same pool.

    At most busy_lanes x the pages of the shortest prompt: then busy_lanes fresh requests
    already fill the pool, so the pool, never the lane count, limits admission ("as many
    lanes as the page pool admits"). With a larger pool, a wave of requests ending together
    refilled the lanes with fresh, short sequences, all lanes ran and pages stayed free (use
    0.65 for several steps); the candidate, whose lanes end in fewer, larger steps, fell
    below the 0.9 floor in about half its runs (RESULTS.md, "The busy pool")."""
    mean_len = np.mean([len(p) for p in prompts]) + jc.max_new_tokens / 2 + 2 * jc.k + 1
    per_lane = int(np.ceil(mean_len / jc.page_size))
    fresh = int(np.ceil(min(len(p) for p in prompts) / jc.page_size))
    pages = min(int(jc.busy_lanes * per_lane * jc.busy_fill), jc.busy_lanes * fresh)
    return max(pages, per_lane + 1)


def workload_params(jc: JudgeConfig, n: int):
    return [SamplingParams(temperature=jc.temperature, max_new_tokens=jc.max_new_tokens,
                           seed=jc.seed + i) for i in range(n)]


def timed_generate(engine, prompts, params):
    """One timed pass, on the engine's time (card_lib.now: its clock's, else wall). page_util:
    mean page use over the pass, sampled at every committed token; page_use_waiting: the
    time-weighted page use over the steady state of a loaded server, from the time every lane
    has emitted (the ramp-up, when lanes wait for their prefill, is left out) to the time the
    last request starts (the drain is left out): the pool as each decode step ran (sampled at
    its first token, before a lane that finishes in it frees its pages), weighted by the time
    until the next step's. Per-token samples would weigh the moments after a request ends by
    how few tokens a step emits, so a speculative engine, which emits several per step, would
    look emptier than it is. None if there is no such window (as many lanes as requests). The
    busy workload must keep it >= 0.9 (the judge spec: "at least 90% of KV pages in use in
    steady state"). ttft_s: mean over requests of the time
    from the pass's start (every request is submitted then) to its first token. clock: what
    the engine's clock added in the pass (device_s modelled, host_s measured), or None."""
    util, waiting, started = [], [], set()       # waiting: (page use, seconds it held)
    full = min(engine.max_lanes, len(prompts))
    first: dict[int, float] = {}
    last = {"step": None, "t": 0.0, "use": None}   # the current step's sample

    alloc = getattr(engine, "alloc", None)     # a single engine: read its pages directly

    def pages() -> tuple[int, int] | None:
        """(free, total) pages, cheaply: this runs for every lane's tokens of every step,
        inside the timed pass (Engine.stats() builds the whole report: ~0.2 ms a call here,
        several ms a step at 16 lanes, which would dilute every ratio toward 1)."""
        if alloc is not None:
            return engine.alloc.available, engine.num_pages
        s = engine.stats()
        return (s["free_pages"], s["total_pages"]) if "free_pages" in s else None

    def on_token(i, ids):
        now = card_lib.now(engine)
        first.setdefault(i, now)
        started.add(i)
        p = pages()
        if p is None or not p[1]:
            return
        use = 1 - p[0] / p[1]
        util.append(use)
        step = engine.timing.get("steps")
        if step != last["step"]:                   # the first token of a step
            if last["use"] is not None:
                waiting.append((last["use"], now - last["t"]))
            steady = full <= len(started) < len(prompts)
            last.update(step=step, t=now, use=use if steady else None)

    clear = getattr(engine, "clear_prefix_cache", None)
    if clear is not None:      # a pass's prompts never hit what an earlier pass cached
        clear()
    engine.reset_timing(("prefill_s", "step_s", "host_s", "steps"))
    depth_before = list(engine.depth_steps)
    clock0 = _clock_totals(engine)
    t0 = card_lib.now(engine)
    outs = engine.generate(prompts, params, on_token=on_token)
    wall = card_lib.now(engine) - t0
    depth_steps = [a - b for a, b in zip(engine.depth_steps, depth_before)]
    errors = [o.error for o in outs if o.finish_reason == "error"]
    if errors:
        raise RuntimeError(f"judge request failed: {errors[0]}")
    tokens = sum(len(o.token_ids) for o in outs)
    return {"outs": outs, "wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
            "timing": dict(engine.timing), "depth_steps": depth_steps,
            "ttft_s": float(np.mean([t - t0 for t in first.values()])) if first else None,
            "clock": _clock_delta(engine, clock0),
            "page_util": float(np.mean(util)) if util else None,
            "page_use_waiting": _weighted_mean(waiting)}


def _weighted_mean(samples: list[tuple[float, float]]) -> float | None:
    """sum(value x weight) / sum(weight); None without weight."""
    w = sum(t for _, t in samples)
    return float(sum(u * t for u, t in samples) / w) if w > 0 else None


def _clock_totals(engine) -> dict | None:
    clock = getattr(engine, "clock", None)
    if clock is None:
        return None
    return {"device_s": clock.device_s, "host_s": clock.host_s, "idle_s": clock.idle_s,
            "launches": dict(clock.launches),
            "device_range_s": dict(clock.device_range),
            "offset_prefill_s": clock.offset_prefill_s}


def _clock_delta(engine, before: dict | None) -> dict | None:
    """What the engine's clock added since `before` (_clock_totals): modelled device seconds,
    measured host seconds, programs launched by kind."""
    after = _clock_totals(engine)
    if after is None:
        return None
    return {"device_s": after["device_s"] - before["device_s"],
            "host_s": after["host_s"] - before["host_s"],
            "idle_s": after["idle_s"] - before["idle_s"],
            "device_range_s": {n: v - before["device_range_s"][n]
                               for n, v in after["device_range_s"].items()},
            "offset_prefill_s": after["offset_prefill_s"] - before["offset_prefill_s"],
            "launches": {key: n - before["launches"].get(key, 0)
                         for key, n in after["launches"].items()
                         if n - before["launches"].get(key, 0)}}


class _ClockedChat:
    """An engine as chat_workload.run_pass uses it (generate, clear_prefix_cache, stats) that
    also records, per generate call (a turn), the mean time from the call to each request's
    first token on the engine's clock: run_pass itself times with perf_counter."""

    def __init__(self, engine):
        self.engine, self.ttft_s = engine, []

    def generate(self, prompts, params, on_token=None):
        t0, first = card_lib.now(self.engine), {}

        def stamp(i, ids):
            first.setdefault(i, card_lib.now(self.engine))
            if on_token is not None:
                on_token(i, ids)

        outs = self.engine.generate(prompts, params, on_token=stamp)
        self.ttft_s.append(float(np.mean([t - t0 for t in first.values()])) if first else 0.0)
        return outs

    def __getattr__(self, name):
        return getattr(self.engine, name)


def chat_pass(engine, system, users, params) -> dict:
    """chat_workload.run_pass on the engine's time: with a clock, tokens/s and the time to
    first token per turn are the clock's (run_pass's own are wall)."""
    if getattr(engine, "clock", None) is None:
        return chat_workload.run_pass(engine, system, users, params)
    proxy = _ClockedChat(engine)
    clock0, t0, steps0 = _clock_totals(engine), card_lib.now(engine), engine.timing["steps"]
    r = chat_workload.run_pass(proxy, system, users, params)
    r["wall_s"] = card_lib.now(engine) - t0
    r["tok_s"] = r["tokens"] / r["wall_s"]
    r["ttft_ms_per_turn"] = [1e3 * x for x in proxy.ttft_s]
    r["clock"] = _clock_delta(engine, clock0)
    r["timing"] = {"steps": engine.timing["steps"] - steps0}     # decode steps of the pass
    return r


def acceptance(outs, k: int) -> tuple[float, list[float]]:
    """(tokens per verify step, share of verify steps accepting draft j) over `outs`."""
    steps = sum(o.stats.verify_steps for o in outs)
    acc = sum(o.stats.accepted_tokens for o in outs)
    per = [sum(o.stats.accepted_per_position[j] for o in outs) / max(steps, 1) for j in range(k)]
    return (steps + acc) / max(steps, 1), per


def acceptance_detail(outs, k: int) -> dict:
    """Acceptance by draft position over `outs` (any number of passes' outputs).

    conditional[j]: accepted / tried of position j+1, the steps that verified a real draft j+1
    with drafts 1..j accepted (what the adaptive policy estimates); per_verify_step[j]: the
    share of verify steps (depth > 0) accepting draft j+1, whatever their depth (with an
    adaptive depth, a shallow step cannot accept a deep draft, so this mixes depths). The
    counts are kept so the rates can be checked and pooled. tokens_per_lane_step counts the
    depth-0 steps too (1 token each); tokens_per_verify_step is None when the policy never
    verified (a useless head: every step at depth 0). first_token_steps: the steps a prompt's
    last token joined (its first token; no real drafts), in neither count, as the prefill's
    last step is in other engines'."""
    verify = sum(o.stats.verify_steps for o in outs)
    plain = sum(o.stats.plain_steps for o in outs)
    acc_tokens = sum(o.stats.accepted_tokens for o in outs)
    accepted = [int(sum(o.stats.accepted_per_position[j] for o in outs)) for j in range(k)]
    tried = [int(sum(o.stats.tried_per_position[j] for o in outs)) for j in range(k)]
    return {"conditional": [a / t if t else None for a, t in zip(accepted, tried)],
            "per_verify_step": [a / max(verify, 1) for a in accepted],
            "accepted": accepted, "tried": tried, "verify_steps": int(verify),
            "plain_lane_steps": int(plain),
            "first_token_steps": int(sum(o.stats.first_steps for o in outs)),
            "tokens_per_verify_step": (verify + acc_tokens) / verify if verify else None,
            "tokens_per_lane_step": (verify + plain + acc_tokens) / max(verify + plain, 1)}


def sum_depths(runs) -> list[int]:
    """Decode steps per depth, summed over timed passes (engine.depth_steps differences)."""
    return [int(sum(col)) for col in zip(*(r["depth_steps"] for r in runs))]


def policy_report(engine) -> dict | None:
    """The adaptive policy's own account, per dp replica (None for a fixed depth): depths it
    chose (cumulative: the untimed pass included), pooled conditional acceptance, and its
    measured step costs as {"b<lanes>/c<context>": {depth: median ms}} (and those of steps
    carrying a prefill chunk, mixed_costs_ms, per "b<lanes>/t<chunk bucket>")."""
    reps = [e.policy for e in getattr(engine, "replicas", [engine])]
    if not all(hasattr(p, "report") for p in reps):
        return None
    out = []
    for p in reps:
        r = p.report()

        def by_cell(costs: dict) -> dict:
            cells: dict = {}
            for key, ms in costs.items():
                d, cell = key.split("/", 1)
                cells.setdefault(cell, {})[int(d[1:])] = ms
            order = sorted(cells, key=lambda cell: tuple(int(x[1:]) for x in cell.split("/")))
            return {c: dict(sorted(cells[c].items())) for c in order}
        out.append({"chosen": {int(d): int(n) for d, n in r["chosen"].items()},
                    "pooled_acceptance": [float(x) for x in r["pooled_acceptance"]],
                    "costs_ms": by_cell(r["costs_ms"]),
                    # steps carrying a prefill chunk: {"b<lanes>/t<chunk bucket>": {depth: ms}}
                    "mixed_costs_ms": by_cell(r.get("mixed_costs_ms", {}))})
    return {"name": type(reps[0]).__name__, "replicas": out}


def warm_engines(engines: dict, log: Progress | None = None) -> dict:
    """Engine.warmup() on every engine before any timed work: {engine: {programs, seconds}}.

    Engines of one shape key run the same programs (EngineShape), compiled once: the first
    engine to run one compiles it (or loads it from the persistent compilation cache), the
    others find it compiled. `log` gets a line per program: n of m (distinct programs),
    what it is, seconds."""
    plans = {name: e.warmup_plan() for name, e in engines.items()}
    keyed = lambda e, key: (e.shape_key(key), key)
    distinct = {keyed(engines[name], key) for name, plan in plans.items() for key in plan}
    seen, out = set(), {}
    for (w, kk), e in engines.items():
        def progress(key, seconds, e=e, w=w, kk=kk):
            pk = keyed(e, key)
            if pk not in seen and log is not None:
                seen.add(pk)
                log(f"compiling {len(seen)}/{len(distinct)}: {program_name(key)} "
                    f"({'stock' if kk == 0 else f'K = {kk}'}) {seconds:.1f} s")
        t0 = time.perf_counter()
        n = e.warmup(progress=progress)
        out[f"{w}/k={kk}"] = {"programs": int(n), "seconds": time.perf_counter() - t0}
    return out


def randomize_mtp_head(params, seed: int):
    """params with the MTP head replaced by noise: each tensor Gaussian with its own mean and
    std, same shape and dtype, seeded. The target (and the embedding and lm_head the head
    shares with it) is untouched, so stock is unchanged and the candidate's drafts are
    almost never accepted: the control for "a useless head costs about nothing"."""
    if params.mtp is None:
        raise ValueError("--mtp_head=random: the checkpoint has no MTP head")
    if quant.has_fp8(params.mtp):
        raise ValueError("--mtp_head=random needs a dense MTP head (not --mtp_weights=fp8)")
    leaves, tree = jax.tree.flatten(params.mtp)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    new = []
    for key, x in zip(keys, leaves):
        x32 = jnp.asarray(x, jnp.float32)
        noise = jax.random.normal(key, x.shape, jnp.float32)
        new.append((x32.mean() + x32.std() * noise).astype(x.dtype))
    return dataclasses.replace(params, mtp=jax.tree.unflatten(tree, new))


# ------------------------------------------------------------------------------- gate pieces

@partial(jax.jit, static_argnames=("cfg", "kernels"), donate_argnames=("cache",))
def _teacher_forced_step(cfg, params, cache, tokens, start, page_table, *, kernels):
    """Step 1 of `steps.decode_step` (the target forward over a [B, T] block through the paged
    pool), teacher-forced: every fed token is kept (n_pend = T). Returns log-probs [B, T, V]."""
    B, T = tokens.shape
    seg = model.Segment(start, jnp.full((B,), T, jnp.int32), page_table)
    h, cache = model.forward(cfg, params, cache, tokens, seg, "step", kernels)
    return jax.nn.log_softmax(model.lm_head(params, h), -1), cache


def paged_path_logprobs(engine, prompt, cont, T: int):
    """Teacher-forced log-probs of cont[:, 1:] after `prompt`, through an engine's paged path.

    engine: an Engine with max_lanes == B (its page pool, allocator and kernels are used).
    prompt i32[B, P]: prefilled with `steps.prefill_chunk`, the engine's own program, one lane
    at a time; cont i32[B, n+1] with n a multiple of T is then fed T tokens per step through
    the same pool (T = 1: stock's decode path; T = k+1: the candidate's verify path). Pages
    are reserved a page at a time, lane after lane, so the page tables interleave.
    Returns float32 [B, n] log-probs of the actual next tokens.
    """
    prompt, cont = np.asarray(prompt, np.int32), np.asarray(cont, np.int32)
    (B, P), n = prompt.shape, cont.shape[1] - 1
    if engine.max_lanes != B:
        raise ValueError(f"the engine has {engine.max_lanes} lanes, the batch {B} rows")
    cfg, params, alloc = engine.cfg, engine.params, engine.alloc
    for b in range(B):
        alloc.free(b)
    total = P + n + 2 * engine.k
    for end in range(alloc.page_size, total + alloc.page_size, alloc.page_size):
        for b in range(B):
            alloc.reserve(b, min(end, total))
    table = alloc.table
    nxt = np.concatenate([prompt[:, 1:], cont[:, :1]], axis=1)
    # the prompt right-padded to the engine's chunk bucket: its own prefill program
    Tp = next((c for c in engine.chunk_buckets if c >= P), P)
    pad = lambda a: np.pad(a, ((0, 0), (0, Tp - P)))
    prompt_p, nxt_p = pad(prompt), pad(nxt)
    cache, state = engine.cache, engine.state
    for b in range(B):
        cache = steps.prefill_chunk(
            cfg, params, cache, steps.Chunk(jnp.int32(b), jnp.asarray(prompt_p[b:b + 1]),
                                            jnp.asarray(nxt_p[b:b + 1]), jnp.int32(0),
                                            jnp.int32(P), jnp.asarray(table[b:b + 1])),
            k=engine.k, kernels=engine.kernels)
    got = []
    for s in range(0, n, T):
        lp, cache = _teacher_forced_step(cfg, params, cache, jnp.asarray(cont[:, s:s + T]),
                                         jnp.full((B,), P + s, jnp.int32), jnp.asarray(table),
                                         kernels=engine.kernels)
        got.append(np.take_along_axis(np.asarray(lp), cont[:, s + 1:s + T + 1, None], -1)[..., 0])
    engine.cache, engine.state = cache, state
    for b in range(B):
        alloc.free(b)
    return np.concatenate(got, axis=1)


def fidelity(cfg, params, texts, jc: JudgeConfig, kernels: str,
             shape: EngineShape | None = None) -> float:
    """Mean |log p_verify - log p_decode| of the true next tokens over the fixed texts.

    Two engines as the judge runs them (page pool, page size, kernels), stock (k = 0) and
    candidate (k): both prefill the same prompt with the engine's prefill program; then stock
    feeds the continuation one token per step (decode path), candidate k+1 tokens per step
    (verify path), teacher-forced, through their paged KV pools. Texts go in batches of
    `fidelity_lanes` lanes (the last batch padded with copies of its first row).
    """
    k = jc.k
    n = (jc.fidelity_tokens // (k + 1)) * (k + 1)
    P = min(len(p) for p, _ in texts)
    rows = [(p[-P:], c[:n + 1]) for p, c in texts if len(c) > n]
    prompt = np.asarray([r[0] for r in rows], np.int32)
    cont = np.asarray([r[1] for r in rows], np.int32)                   # [R, n+1]
    B = min(jc.fidelity_lanes, len(rows))
    if shape is not None and B <= shape.lane_slots and P + n + 2 <= shape.max_seq_len:
        # the judge's shapes: its prefill programs serve the fidelity prefill too
        fixed = dataclasses.replace(jc, adaptive=False, kernels=kernels, tp=1, dp=1)
        engines = {T: make_engine(cfg, params, fixed, T - 1, B, None, shape)
                   for T in (1, k + 1)}
    else:
        engines = {T: mtpjax.Engine(cfg, params, num_speculative_tokens=T - 1, max_lanes=B,
                                    max_seq_len=P + n + 2, kernels=kernels,
                                    page_size=jc.page_size)
                   for T in (1, k + 1)}
    diffs = []
    for i in range(0, len(rows), B):
        real = np.arange(i, i + B) < len(rows)
        idx = np.where(real, np.arange(i, i + B), i)
        lp = {T: paged_path_logprobs(e, prompt[idx], cont[idx], T) for T, e in engines.items()}
        diffs.append(np.abs(lp[k + 1] - lp[1])[real])
    return float(np.concatenate(diffs).mean())


SCORE_ROWS = 8   # replies scored per forward_logits call


def score_replies(cfg, params, prompts, replies, length: int | None = None):
    """Per reply: mean log-prob of its tokens and share equal to the argmax, under stock.

    Every prompt + reply is right-padded to one length (`length`, default the longest) and
    scored SCORE_ROWS at a time (the last batch padded with copies), so the whole gate
    compiles one forward_logits program instead of one per sequence length. The model is
    causal, so padding after a sequence changes none of its logits."""
    rows = [(p, r) for p, r in zip(prompts, replies) if r]
    if not rows:
        return [], []
    T = max(len(p) + len(r) for p, r in rows) if length is None else length
    seqs = np.zeros((len(rows), T), np.int32)
    for i, (p, r) in enumerate(rows):
        seqs[i, :len(p) + len(r)] = p + r
    lp_means, am_shares = [], []
    for i in range(0, len(rows), SCORE_ROWS):
        idx = np.minimum(np.arange(i, i + SCORE_ROWS), len(rows) - 1)
        logits = np.asarray(mtpjax.forward_logits(cfg, params, seqs[idx])).astype(np.float64)
        for j, (p, r) in enumerate(rows[i:i + SCORE_ROWS]):
            lg = logits[j]
            top = lg.max(-1, keepdims=True)
            lp = lg - top - np.log(np.exp(lg - top).sum(-1, keepdims=True))
            pos = np.arange(len(p) - 1, len(p) + len(r) - 1)
            toks = np.asarray(r)
            lp_means.append(float(lp[pos, toks].mean()))
            am_shares.append(float((lg[pos].argmax(-1) == toks).mean()))
    return lp_means, am_shares


def _median_ms(fn, iters: int = 5) -> float:
    jax.block_until_ready(fn())
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(ts))


def step_split(cfg, params, lanes: int, k: int, kernels: str, ctx: int = 64) -> dict:
    """Times the parts the fused step program is made of, at `lanes` lanes: the target forward
    over 1 token (decode) and over k+1 tokens (verify), and one MTP draft (MTP layer + lm_head)."""
    B = lanes
    cache = model.init_cache(cfg, B, ctx + 2 * k + 2, k + 1, params.embed.dtype)
    start = jnp.full((B,), ctx, jnp.int32)

    @partial(jax.jit, static_argnames=("T",))
    def target(cache, T):
        tok = jnp.zeros((B, T), jnp.int32)
        h, _ = model.forward(cfg, params, cache, tok, model.Segment(start, jnp.full((B,), T, jnp.int32)),
                             "step", kernels)
        return model.lm_head(params, h)

    @jax.jit
    def draft(cache):
        h = jnp.zeros((B, 1, cfg.hidden_size), params.embed.dtype)
        hm, _ = model.mtp_forward(cfg, params, cache, h, jnp.zeros((B, 1), jnp.int32),
                                  model.Segment(start, jnp.ones((B,), jnp.int32)))
        return jnp.argmax(model.lm_head(params, hm), -1)

    out = {"batch": B, "decode_ms": _median_ms(lambda: target(cache, 1)),
           "verify_ms": _median_ms(lambda: target(cache, k + 1))}
    out["draft_ms"] = _median_ms(lambda: draft(cache)) if cfg.has_mtp else 0.0
    return out


# ------------------------------------------------------------------------------- FP8

FP8_FIDELITY_HOW = ("teacher-forced target log-probs (mtpjax.forward_logits, no cache) of each "
                    "fixed text (its prompt + the first fidelity_tokens tokens of its "
                    "continuation), FP8 model vs the dense model it was quantized from, same "
                    "dtype; over every next-token position: mean |log p_fp8 - log p_dense| of "
                    "the actual next token, share of positions whose argmax agrees, mean "
                    "KL(dense || fp8) in nats")
FP8_MTP_HOW = ("the candidate's engine at the fixed depth K (the gate workload's lanes and "
               "pool) generating greedily (temperature 0, max_new_tokens) from the gate prompts, the target as "
               "the judge runs it, once with the MTP head dense and once FP8; tokens per "
               "verify step = (verify steps + accepted drafts) / verify steps, acceptance of "
               "draft j = share of verify steps accepting it; greedy_agreement: the two runs' "
               "replies")


def _stores_fp8(path: str) -> bool:
    from checkpoints import is_orbax_checkpoint
    from checkpoints.hf_loader import read_config
    if is_orbax_checkpoint(path):
        return False                    # converted folders hold dense params
    return quant.scheme_from_config(read_config(path)) is not None


def load_weights(jc: JudgeConfig):
    """(cfg, params, dense): params as stock and candidate run them (jc.weights /
    jc.mtp_weights); dense: the in-memory dense params they were quantized from when a dense
    checkpoint is made FP8 here (its files are read once), else None."""
    if "fp8" not in (jc.weights, jc.mtp_weights) or _stores_fp8(jc.checkpoint):
        cfg, params = mtpjax.load_checkpoint(jc.checkpoint, jc.dtype, weights=jc.weights,
                                             mtp_weights=jc.mtp_weights)
        return cfg, params, None
    from checkpoints.hf_loader import quantize_params
    cfg, dense = mtpjax.load_checkpoint(jc.checkpoint, jc.dtype, weights="dense",
                                        mtp_weights="dense")
    return cfg, quantize_params(cfg, dense, jc.weights, jc.mtp_weights), dense


def head_weights(params) -> str:
    return "fp8" if quant.has_fp8(params.mtp) else "dense"


def other_head(jc: JudgeConfig, cfg, params, dense):
    """params with the other MTP head ("dense" <-> "fp8"), the target unchanged: from the
    in-memory dense params, else (a checkpoint stored FP8) from the files again."""
    other = "dense" if head_weights(params) == "fp8" else "fp8"
    if dense is not None:
        from checkpoints.hf_loader import quantize_params
        return other, quantize_params(cfg, dense, jc.weights, other)
    return other, mtpjax.load_checkpoint(jc.checkpoint, jc.dtype, weights=jc.weights,
                                         mtp_weights=other)[1]


@jax.jit
def _compare_logits(dense_logits, fp8_logits, nxt):
    """Per position: |delta log p| of the next token, argmax agreement, KL(dense || fp8)."""
    ld = jax.nn.log_softmax(dense_logits.astype(jnp.float32), -1)
    lf = jax.nn.log_softmax(fp8_logits.astype(jnp.float32), -1)
    pick = lambda lp: jnp.take_along_axis(lp, nxt[..., None], -1)[..., 0]
    kl = jnp.sum(jnp.exp(ld) * (ld - lf), -1)
    agree = jnp.argmax(ld, -1) == jnp.argmax(lf, -1)
    return pick(ld), pick(lf), agree, kl


def fidelity_vs_dense(cfg, dense, params, texts, jc: JudgeConfig) -> dict:
    """FP8 params vs the dense ones on the fixed texts (FP8_FIDELITY_HOW). Texts go in batches
    of `fidelity_lanes` rows right-padded to the longest (the model is causal, so padding
    after a position never changes it; padded positions are left out), the last batch filled
    with copies of its first row, so each model compiles one shape."""
    seqs = [list(p) + list(c[:jc.fidelity_tokens]) for p, c in texts]
    T = max(len(s) for s in seqs)
    tokens = np.zeros((len(seqs), T), np.int32)
    valid = np.zeros((len(seqs), T - 1), bool)
    for i, s in enumerate(seqs):
        tokens[i, :len(s)] = s
        valid[i, :len(s) - 1] = True
    B = min(jc.fidelity_lanes, len(seqs))
    got = {key: [] for key in ("lp_dense", "lp_fp8", "agree", "kl")}
    for i in range(0, len(seqs), B):
        real = np.arange(i, i + B) < len(seqs)
        idx = np.where(real, np.arange(i, i + B), i)
        tok = jnp.asarray(tokens[idx])
        ld = mtpjax.forward_logits(cfg, dense, tok)[:, :-1]
        lf = mtpjax.forward_logits(cfg, params, tok)[:, :-1]
        out = _compare_logits(ld, lf, tok[:, 1:])
        mask = valid[idx] & real[:, None]
        for key, x in zip(got, out):
            got[key].append(np.asarray(x, np.float64)[mask])
    got = {key: np.concatenate(v) for key, v in got.items()}
    diff = np.abs(got["lp_fp8"] - got["lp_dense"])
    return {"texts": len(seqs), "positions": int(diff.size),
            "mean_abs_logprob_diff": float(diff.mean()),
            "max_abs_logprob_diff": float(diff.max()),
            "top1_agreement": float(got["agree"].mean()),
            "mean_kl": float(got["kl"].mean()),
            "mean_logprob": {"dense": float(got["lp_dense"].mean()),
                             "fp8": float(got["lp_fp8"].mean())},
            "how": FP8_FIDELITY_HOW}


def mtp_head_acceptance(engines: dict, prompts, jc: JudgeConfig) -> dict:
    """engines: {"dense": engine, "fp8": engine} (MTP head weights) -> FP8_MTP_HOW."""
    sp = SamplingParams(temperature=0.0, max_new_tokens=jc.max_new_tokens)
    out, replies = {}, {}
    for head, engine in engines.items():
        outs = engine.generate(prompts, sp)
        errors = [o.error for o in outs if o.finish_reason == "error"]
        if errors:
            raise RuntimeError(f"judge request failed (MTP head {head}): {errors[0]}")
        tps, per = acceptance(outs, jc.k)
        replies[head] = [o.token_ids for o in outs]
        out[f"{head}_head"] = {"tokens_per_verify_step": tps, "acceptance_by_position": per,
                               "verify_steps": int(sum(o.stats.verify_steps for o in outs)),
                               "tokens": int(sum(len(r) for r in replies[head]))}
    return {"prompts": len(prompts), "k": jc.k, **out,
            "greedy_agreement": gate.greedy_agreement(replies["fp8"], replies["dense"]),
            "how": FP8_MTP_HOW}


# ------------------------------------------------------------------------------- main

def run_judge(jc: JudgeConfig, candidate_k: int | None = None) -> dict:
    t_start = time.perf_counter()
    k = jc.k if candidate_k is None else candidate_k
    jc = dataclasses.replace(jc, k=k)
    log = Progress("judge", jc.progress)
    check_config(jc)
    log(f"loading {jc.checkpoint} ({jc.dtype})")
    cfg, params, dense = load_weights(jc)
    maps_loaded = mappings()
    check_config(jc, cfg)
    if jc.mtp_head == "random":
        if quant.has_fp8(params):
            raise ValueError("--mtp_head=random runs with dense weights only")
        params = randomize_mtp_head(params, jc.seed)
    tokenizer = _tokenizer(jc.checkpoint)
    texts = load_texts(tokenizer, jc)
    fp8 = other = None
    if quant.has_fp8(params):   # measured first, so the extra trees are gone before the runs
        t_fp8 = time.perf_counter()
        if dense is None:       # a checkpoint stored FP8: its dequantized weights
            dense_ref = mtpjax.load_checkpoint(jc.checkpoint, jc.dtype, weights="dense",
                                               mtp_weights="dense")[1]
        else:
            dense_ref = dense
        fp8 = {"weights": jc.weights, "mtp_weights": jc.mtp_weights,
               "target": "fp8" if quant.has_fp8(params.layers) else "dense",
               "mtp_head": head_weights(params) if params.mtp is not None else None,
               "dense_reference": ("the dense checkpoint" if dense is not None else
                                   "the checkpoint's FP8 weights dequantized") + f", {jc.dtype}",
               "fidelity_vs_dense": fidelity_vs_dense(cfg, dense_ref, params, texts, jc),
               "mtp_acceptance": None}
        del dense_ref
        other = other_head(jc, cfg, params, dense) if cfg.has_mtp and k else None
        del dense
        fp8["wall_s"] = time.perf_counter() - t_fp8
    prompts = [p for p, _ in texts]
    max_seq_len = max(len(p) for p in prompts) + jc.max_new_tokens + 8

    plans = {w: workload_plan(w, jc, prompts) for w in jc.workloads}
    pool = {w: (busy_pages(jc, plans[w][1]) if w == "busy" else None) for w in jc.workloads}
    lanes_used = [lanes for lanes, _ in plans.values()]
    if jc.chat is not None:
        chat_system, chat_users = chat_workload.build(texts, jc.chat)
        lanes_used.append(jc.team_lanes)
        max_seq_len = max(max_seq_len, chat_workload.max_seq_len(jc.chat, jc.max_new_tokens))
    shape = engine_shape(jc, lanes_used, max_seq_len)
    engines = {}
    placed = None
    if jc.tp * jc.dp > 1:   # lay the weights out once; every engine shares them
        from mtpjax import tensor_parallel
        placed = [tensor_parallel.place_params(cfg, params, m)
                  for m in tensor_parallel.make_meshes(jc.tp, jc.dp)]
    for w, (lanes, _) in plans.items():
        for kk in (0, k):
            engines[(w, kk)] = make_engine(cfg, params, jc, kk, lanes, pool[w], shape,
                                           placed=placed, context_offset=long_context(w)[1])
    if jc.chat is not None:
        for kk in (0, k):
            engines[("chat", kk)] = make_engine(cfg, params, jc, kk, jc.team_lanes, None, shape,
                                                placed=placed, prefix_cache=jc.prefix_cache)
    warmup = warm_engines(engines, log)   # before any pass: nothing compiles while timed
    maps_warm = mappings()
    kernels = engines[(jc.workloads[0], 0)].kernels
    gate_w = "team" if "team" in plans else jc.workloads[0]
    gp = prompts[:jc.gate_prompts]
    if fp8 is not None and other is not None:   # the gate workload's candidate, either head
        t_fp8 = time.perf_counter()
        lanes = plans[gate_w][0]
        # both heads at the fixed depth K: an adaptive depth would differ between the heads
        # and blur what is compared (the programs are the candidate's, already compiled)
        fixed = dataclasses.replace(jc, adaptive=False)
        heads = {head: make_engine(cfg, tree, fixed, k, lanes, pool[gate_w], shape)
                 for head, tree in ((head_weights(params), params), other)}
        fp8["mtp_acceptance"] = {"workload": gate_w, "lanes": lanes,
                                 **mtp_head_acceptance(heads, gp, jc)}
        del heads, other
        fp8["wall_s"] += time.perf_counter() - t_fp8

    results = {w: {"stock": [], "candidate": []} for w in plans}
    policy = {}
    name = lambda kk: "stock" if kk == 0 else "candidate"
    for w, (lanes, reqs) in plans.items():
        params_w = workload_params(jc, len(reqs))
        log(f"{w}: untimed pass ({len(reqs)} requests, {lanes} lane{'s' * (lanes > 1)})")
        for kk in (0, k):
            timed_generate(engines[(w, kk)], reqs, params_w)
        for p in range(jc.passes):
            order = (0, k) if p % 2 == 0 else (k, 0)
            got = {}
            for kk in order:
                r = timed_generate(engines[(w, kk)], reqs, params_w)
                results[w][name(kk)].append(r)
                got[kk] = r["tok_s"]
            log(f"{w}: pass {p + 1}/{jc.passes}: stock {got[0]:.0f} tok/s, candidate "
                f"{got[k]:.0f} tok/s, ratio {got[k] / got[0]:.3f}")
        policy[w] = policy_report(engines[(w, k)])   # before the gate runs add to it
    chat = None
    if jc.chat is not None:
        chat_params = workload_params(jc, jc.chat.conversations)
        chat_runs = {0: [], k: []}
        log(f"chat: untimed pass ({jc.chat.conversations} conversations x {jc.chat.turns} turns)")
        for kk in (0, k):                                  # untimed: depth costs, caches
            chat_pass(engines[("chat", kk)], chat_system, chat_users, chat_params)
        for p in range(jc.passes):
            for kk in ((0, k) if p % 2 == 0 else (k, 0)):
                chat_runs[kk].append(chat_pass(
                    engines[("chat", kk)], chat_system, chat_users, chat_params))
            log(f"chat: pass {p + 1}/{jc.passes}")
        chat = chat_workload.summarize(chat_runs[0], chat_runs[k], jc.chat, jc.team_lanes)
        chat["greedy_agreement"] = (gate.greedy_agreement(
            [o.token_ids for o in chat_runs[k][0]["outs"]],
            [o.token_ids for o in chat_runs[0][0]["outs"]]) if jc.temperature == 0.0 else None)
    log(f"gate: sampled replies ({len(gp)} prompts), scoring, fidelity")

    # ---- gate: sampled replies (likelihood, argmax, sampled agreement) on the team engines
    sp = [SamplingParams(temperature=jc.sample_temperature, max_new_tokens=jc.max_new_tokens,
                         seed=10_000 + jc.seed + i) for i in range(len(gp))]
    rep, peak = {}, {}
    for kk in (0, k):   # each engine in its own memory phase
        outs, peak[kk] = generate_measuring_memory(engines[(gate_w, kk)], gp, sp)
        rep[kk] = [o.token_ids for o in outs]
    score_len = max(len(p) for p in gp) + jc.max_new_tokens    # one scoring program
    lp_c, am_c = score_replies(cfg, params, gp, rep[k], score_len)
    lp_s, am_s = score_replies(cfg, params, gp, rep[0], score_len)
    fid = fidelity(cfg, params, texts, jc, kernels, shape if jc.tp * jc.dp == 1 else None)
    log("fidelity done; writing the card")

    # greedy agreement from the throughput workloads when greedy, else from a greedy run
    if jc.temperature == 0.0:
        g_c = [o.token_ids for w in plans for o in results[w]["candidate"][0]["outs"]]
        g_s = [o.token_ids for w in plans for o in results[w]["stock"][0]["outs"]]
    else:
        gsp = SamplingParams(max_new_tokens=jc.max_new_tokens)
        g_c = [o.token_ids for o in engines[(gate_w, k)].generate(gp, gsp)]
        g_s = [o.token_ids for o in engines[(gate_w, 0)].generate(gp, gsp)]

    mem_c, mem_s = peak[k] / 2 ** 20, peak[0] / 2 ** 20
    ratios, lengths, acc, acc_pos, thr, split, util = {}, {}, {}, {}, {}, {}, {}
    page_use, depth_hist, decode_steps, ttft = {}, {}, {}, {}
    for w in plans:
        st, ca = results[w]["stock"], results[w]["candidate"]
        passes = [c["tok_s"] / s["tok_s"] for s, c in zip(st, ca)]
        ratios[w] = {"passes": passes, "ratio": statistics.median(passes)}
        lengths[w] = gate.length_ratio([len(o.token_ids) for o in ca[0]["outs"]],
                                       [len(o.token_ids) for o in st[0]["outs"]])
        acc_pos[w] = acceptance_detail([o for c in ca for o in c["outs"]], k)
        acc[w] = acc_pos[w]["tokens_per_verify_step"]
        depth_hist[w] = sum_depths(ca)
        decode_steps[w] = {name: int(sum(r["timing"]["steps"] for r in rs))
                           for name, rs in (("stock", st), ("candidate", ca))}
        thr[w] = {"stock_tok_s": [s["tok_s"] for s in st], "candidate_tok_s": [c["tok_s"] for c in ca]}
        # per decode step, ms: the step program; host_ms: the device waiting for the host
        # (the gap between one launch finishing and the next being launched: what the
        # overlapped loop hides); host_work_ms: the host's own work, hidden or not
        split[w] = {name: {out: float(np.median([r["timing"].get(key, 0.0)
                                                 / max(r["timing"]["steps"], 1) * 1e3
                                                 for r in rs]))
                           for out, key in (("step_ms", "step_s"), ("host_ms", "host_s"),
                                            ("host_work_ms", "host_work_s"))}
                    for name, rs in (("stock", st), ("candidate", ca))}
        for name, rs in (("stock", st), ("candidate", ca)):
            split[w][name]["prefill_ms_per_request"] = float(np.median(
                [r["timing"]["prefill_s"] / len(plans[w][1]) * 1e3 for r in rs]))
        util[w] = ca[0]["page_util"]
        ttft[w] = {name: _median([r["ttft_s"] for r in rs], 1e3)
                   for name, rs in (("stock", st), ("candidate", ca))}
        waiting = lambda rs: (None if any(r["page_use_waiting"] is None for r in rs)
                              else float(np.median([r["page_use_waiting"] for r in rs])))
        page_use[w] = {"stock": waiting(st), "candidate": waiting(ca),
                       "pages": pool[w] if pool[w] is not None else engines[(w, 0)].num_pages}

    measured = {
        "memory": {"candidate_mib": mem_c, "stock_mib": mem_s},
        "fidelity": fid,
        "likelihood": dict(zip(("gap", "se"), gate.paired_gap(lp_c, lp_s)),
                           candidate=float(np.mean(lp_c)), stock=float(np.mean(lp_s))),
        "argmax": dict(zip(("gap", "se"), gate.paired_gap(am_c, am_s)),
                       candidate=float(np.mean(am_c)), stock=float(np.mean(am_s))),
        "greedy_agreement": gate.greedy_agreement(g_c, g_s),
        "sampled_agreement": gate.sampled_agreement(rep[k], rep[0]),
        "lengths": lengths,
        # SpecScore: solo / team / busy (the long-context workloads are reported beside it)
        "ratios": ({w: v for w, v in ratios.items() if w in BASE_WORKLOADS}
                   if any(w in BASE_WORKLOADS for w in ratios) else ratios),
        "page_use": page_use,
    }
    verdict = gate.evaluate(measured, jc.limits, dtype=jc.dtype)
    split_at = plans[gate_w][0]
    split_params = quant.set_impl(params, kernels) if quant.has_fp8(params) else params
    # the split times this machine's programs: nothing the H200 clock could say (None there)
    draft_verify = (step_split(cfg, split_params, split_at, k, kernels)
                    if k and jc.clock == "wall" else None)
    sim = engines[(jc.workloads[0], k)].simulated
    if sim is not None:         # timing only: the candidate's tokens are not the model's
        verdict = {**verdict, "reason": None, "score": None, "gate": "not applicable",
                   "checks": {name: None for name in verdict["checks"]}}
    card = {
        "simulated_acceptance": None if sim is None else sim.report(),
        "gate": verdict.get("gate", "applied"),
        "ratios": ratios,
        "specscore": verdict["specscore"],
        "greedy_agreement": measured["greedy_agreement"],
        "sampled_agreement": measured["sampled_agreement"],
        "likelihood": measured["likelihood"],
        "argmax": measured["argmax"],
        "fidelity": fid,
        "lengths": lengths,
        "memory": {**verdict["memory"], "how": MEMORY_HOW, "workload": gate_w,
                   "process_peak_mib": process_peak_mib()},
        "page_use": {w: {**v, **verdict["page_use"].get(w, {})} for w, v in page_use.items()},
        "acceptance": acc,
        "acceptance_by_position": acc_pos,
        "depth_hist": depth_hist,
        "decode_steps": decode_steps,
        "policy": policy,
        "limits": verdict["limits"],         # with the floor the gate applied (dtype default)
        "checks": verdict["checks"],
        "reason": verdict["reason"],
        "score": verdict["score"],
        "throughput": thr,
        "step_time_ms": split,
        "draft_verify_ms": draft_verify,
        "page_utilization": util,
        "fp8": fp8,
        "chat": chat,
        "ttft_ms": ttft,
        "clock": jc.clock,
        "h200": (clock_section(results, chat_runs if jc.chat is not None else None, engines, k)
                 if jc.clock == "h200" else None),
        "settings": {
            "checkpoint": os.path.abspath(jc.checkpoint), "dtype": jc.dtype, "k": k,
            "num_speculative_tokens": k, "adaptive": jc.adaptive,
            "draft_vocab": (None if draft_ids(jc, cfg) is None
                            else len(draft_ids(jc, cfg))),
            "clock_draft_vocab": clock_draft_rows(jc, cfg) if jc.clock == "h200" else None,
            "policy": engines[(jc.workloads[0], k)].stats().get("policy"),
            "mtp_head": jc.mtp_head, "warmup": warmup,
            "lane_slots": shape.lane_slots, "lane_buckets": list(shape.lane_buckets),
            "max_seq_len": shape.max_seq_len,
            "memory_mappings": {"after_load": maps_loaded, "after_warmup": maps_warm,
                                "peak": max(log.peak_mappings, mappings() or 0),
                                "limit": map_limit(),
                                "how": "lines of /proc/self/maps, sampled at every progress "
                                       "line and at the end"},
            "weights": jc.weights, "mtp_weights": jc.mtp_weights,
            "kernels": kernels, "passes": jc.passes, "max_new_tokens": jc.max_new_tokens,
            "temperature": jc.temperature, "sample_temperature": jc.sample_temperature,
            "lanes": {w: plans[w][0] for w in plans}, "requests": {w: len(plans[w][1]) for w in plans},
            "page_size": jc.page_size, "busy_pages": pool.get("busy"),
            "tp": jc.tp, "dp": jc.dp, "prefix_cache": jc.prefix_cache,
            "long_context": {w: long_context(w)[1] for w in plans},
            "device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
            "versions": {"jax": jax.__version__, "python": platform.python_version()},
            "compiled_programs": {f"{w}/k={kk}": e.stats().get("compiled_programs")
                                  for (w, kk), e in engines.items()},
            "wall_s": time.perf_counter() - t_start,
        },
    }
    card_lib.write(card, jc.out_dir)
    return card


def _median(xs, scale: float = 1.0) -> float | None:
    xs = [x for x in xs if x is not None]
    return float(np.median(xs)) * scale if xs else None


def clock_section(results: dict, chat_runs: dict | None, engines: dict, k: int) -> dict:
    """The card's "h200" block: per workload and engine, what its clock added over the timed
    passes (device_s modelled, host_s measured on this machine, programs launched), host
    time per decode step and its share of the clock; the cost model's settings and
    constants (one engine's clock.report(), less its running totals)."""
    name = lambda kk: "stock" if kk == 0 else "candidate"

    def total(runs) -> dict:
        dev = sum(r["clock"]["device_s"] for r in runs)
        work = sum(r["clock"]["host_s"] for r in runs)
        host = sum(r["clock"]["idle_s"] for r in runs)     # the device waiting for the host
        launches: dict = {}
        for r in runs:
            for key, n in r["clock"]["launches"].items():
                launches[key] = launches.get(key, 0) + n
        steps = sum(r["timing"]["steps"] for r in runs if "timing" in r)
        return {"device_s": dev, "host_s": host, "host_work_s": work,
                "host_share": host / max(dev + host, 1e-12),
                "host_ms_per_step": 1e3 * host / steps if steps else None,
                "launches": launches}

    out = {w: {name(kk): total(runs[name(kk)]) for kk in (0, k)} for w, runs in results.items()}
    if chat_runs is not None:
        out["chat"] = {name(kk): total(chat_runs[kk]) for kk in (0, k)}
    report = next(iter(engines.values())).clock.report()
    model = {key: v for key, v in report.items()
             if key not in ("device_s", "host_s", "now", "launches", "device_range_s",
                            "idle_s", "hidden_s")}
    rng = range_section(results, k)
    rng["constants"] = (report.get("hardware") or {}).get("origin")
    return {"workloads": out, "model": model, "range": rng,
            "how": "each engine has its own clock: every program it launches adds the cost "
                   "model's price at the program's shapes (device_s); host_work_s is this "
                   "machine's measured time inside Engine.step outside the programs and the "
                   "caller's on_token callbacks (mtpjax/engine/runner.py); the modelled "
                   "device runs a launch while the host plans the next (the overlapped "
                   "loop), so host_s is only the time the device waited for the host; "
                   "tokens/s = tokens / (device_s + host_s) of the pass"}


def range_section(results: dict, k: int) -> dict:
    """The card's h200.range: SpecScore, each workload's ratio and ms per token (1000 / tokens
    per second, all lanes together) as [low, mid, high] over the clock's three constant sets
    (cost_model.H200_FAST, H200, H200_SLOW). Every pass was run once; each engine's clock
    priced its launches at all three sets, and the measured host time is the same in each.
    The depth policy chose its depths on the mid prices, so low and high are the mid run's
    schedule repriced (a policy on a faster or slower GPU could choose other depths)."""
    from mtpjax.cost_model import H200_RANGE_NAMES, range_of
    name = lambda kk: "stock" if kk == 0 else "candidate"
    # the device's wait for the host as the mid run measured it (a faster device would
    # hide less host work: low is, if anything, optimistic by that much)
    sec = lambda r, n: r["clock"]["device_range_s"][n] + r["clock"]["idle_s"]
    ratio, ms, out = {n: {} for n in H200_RANGE_NAMES}, {}, {}
    for w, runs in results.items():
        st, ca = runs["stock"], runs["candidate"]
        for n in H200_RANGE_NAMES:
            ratio[n][w] = statistics.median([(c["tokens"] / sec(c, n)) / (s["tokens"] / sec(s, n))
                                             for s, c in zip(st, ca)])
        ms = {name(kk): range_of({n: statistics.median([1e3 * sec(r, n) / r["tokens"]
                                                        for r in runs[name(kk)]])
                                  for n in H200_RANGE_NAMES}) for kk in (0, k)}
        # a long context's own prefill left out (mid): what the decoding costs per token
        tpot = {name(kk): statistics.median([1e3 * (sec(r, "mid") - r["clock"]["offset_prefill_s"])
                                             / r["tokens"] for r in runs[name(kk)]])
                for kk in (0, k)}
        out[w] = {"ratio": range_of({n: ratio[n][w] for n in H200_RANGE_NAMES}),
                  "ms_per_token": ms, "ms_per_token_without_long_prefill_mid": tpot}
    scored = [w for w in results if w in BASE_WORKLOADS] or list(results)   # as SpecScore
    spec = {n: float(np.exp(np.mean(np.log([ratio[n][w] for w in scored]))))
            for n in H200_RANGE_NAMES}
    return {"specscore": range_of(spec), "workloads": out,
            "by_constants": {"specscore": spec, "ratio": ratio},
            "how": "[low, mid, high] over three constant sets (fast, mid, slow: bandwidth, "
                   "launch cost per kernel, cost per program; mtpjax/cost_model.py H200_FAST, "
                   "H200, H200_SLOW with their sources, or with --clock_calibration the "
                   "calibration's sets, load_calibration: where from in h200.range.constants); "
                   "one run, every launch priced at the "
                   "three sets; host time measured once; the depth policy chose its depths "
                   "on the mid prices, so low and high reprice the mid run's schedule"}


def main(argv):
    del argv
    jc = _from_flags()
    card = run_judge(jc)
    print(card_lib.render_md(card))
    print(f"card written to {os.path.abspath(jc.out_dir)}")
    if card["reason"] is not None:
        # a failed gate is a failed run: scripts and CI see it in the exit status
        print(f"gate: FAIL ({card['reason']})", file=sys.stderr)
        return 1
    return 0
