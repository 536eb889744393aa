"""`python -m experiments [judge]`: SpecScore on solo / team / busy, and the lossless gate.

Contract: ../shared/spec/judge.md. Two engines that differ only in speculation (stock: k = 0;
candidate: MTP with k drafts) run the same prompts, sampling parameters, kernels, lanes and page
pool. Order of work:

  1. warm-up: every engine/workload pair runs once untimed (compiles every shape)
  2. passes: per workload, `--passes` passes alternating stock-first / candidate-first;
     ratio of a pass = candidate tokens/s / stock tokens/s; workload ratio = median
  3. gate: memory, fidelity (teacher-forced verify path vs decode path), likelihood and argmax
     of sampled replies scored by the stock model, sampled/greedy agreement, reply lengths
  4. card: card.md, card.json and plots in --out_dir; the card is printed at the end
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

import mtpjax
from experiments import card as card_lib
from experiments import judge_gate as gate
from mtpjax import model
from mtpjax.sampling import SamplingParams

FLAGS = flags.FLAGS
HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CKPT = os.path.join(os.path.dirname(HERE), "checkpoints", "tiny")
TEXTS = os.path.join(HERE, "data", "judge_texts.json")

flags.DEFINE_string("checkpoint", DEFAULT_CKPT, "checkpoint folder (HF layout or converted)")
flags.DEFINE_string("out_dir", "runs/judge", "where card.md, card.json and plots go")
flags.DEFINE_integer("passes", 3, "timed passes per workload")
flags.DEFINE_list("workloads", ["solo", "team", "busy"], "workloads to run")
flags.DEFINE_integer("num_speculative_tokens", 1, "k of the candidate engine")
flags.DEFINE_integer("max_new_tokens", 48, "reply length cap for the workloads")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "model dtype")
flags.DEFINE_string("kernels", None, "reference | pallas | interpret (default: by backend)")
flags.DEFINE_integer("solo_requests", 4, "requests in the solo workload (served one by one)")
flags.DEFINE_integer("team_lanes", 8, "lanes of the team workload")
flags.DEFINE_integer("team_requests", 16, "requests in the team workload")
flags.DEFINE_integer("busy_lanes", 16, "lanes of the busy workload")
flags.DEFINE_integer("busy_requests", 32, "requests in the busy workload")
flags.DEFINE_float("busy_fill", 0.8, "busy pool size as a fraction of the pages all lanes would want")
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
flags.DEFINE_float("greedy_agreement_floor", None, "optional gate floor")
flags.DEFINE_integer("seed", 0, "base seed of sampled requests")
flags.DEFINE_bool("progress", True, "show a progress bar")


@dataclasses.dataclass
class JudgeConfig:
    checkpoint: str = DEFAULT_CKPT
    out_dir: str = "runs/judge"
    passes: int = 3
    workloads: tuple = ("solo", "team", "busy")
    k: int = 1
    max_new_tokens: int = 48
    dtype: str = "float32"
    kernels: str | None = None
    solo_requests: int = 4
    team_lanes: int = 8
    team_requests: int = 16
    busy_lanes: int = 16
    busy_requests: int = 32
    busy_fill: float = 0.8
    page_size: int = 16
    prompt_tokens: int = 48
    temperature: float = 0.0
    sample_temperature: float = 1.0
    gate_prompts: int = 24
    fidelity_tokens: int = 32
    seed: int = 0
    progress: bool = True
    limits: gate.Limits = gate.Limits()


def _from_flags() -> JudgeConfig:
    f = FLAGS
    return JudgeConfig(
        checkpoint=f.checkpoint, out_dir=f.out_dir, passes=f.passes, workloads=tuple(f.workloads),
        k=f.num_speculative_tokens, max_new_tokens=f.max_new_tokens, dtype=f.dtype,
        kernels=f.kernels, solo_requests=f.solo_requests, team_lanes=f.team_lanes,
        team_requests=f.team_requests, busy_lanes=f.busy_lanes, busy_requests=f.busy_requests,
        busy_fill=f.busy_fill, page_size=f.page_size, prompt_tokens=f.prompt_tokens,
        temperature=f.temperature, sample_temperature=f.sample_temperature,
        gate_prompts=f.gate_prompts, fidelity_tokens=f.fidelity_tokens, seed=f.seed,
        progress=f.progress,
        limits=gate.Limits(f.greedy_agreement_floor, f.likelihood_bound, f.argmax_bound,
                           f.fidelity_ceiling, f.length_margin, f.memory_slack_mib))


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

def make_engine(cfg, params, jc: JudgeConfig, k: int, lanes: int, num_pages: int | None,
                max_seq_len: int):
    """Stock (k = 0) and candidate engines differ only in k: same lanes, pool and kernels."""
    return mtpjax.Engine(cfg, params, num_speculative_tokens=k, max_lanes=lanes,
                         max_seq_len=max_seq_len, kernels=jc.kernels, page_size=jc.page_size,
                         num_pages=num_pages)


def engine_bytes(engine) -> int:
    """Bytes of the device buffers an engine holds (params + caches + lane state)."""
    trees = [engine.params, engine.cache, engine.state]
    return int(sum(x.nbytes for t in trees for x in jax.tree.leaves(t)))


def peak_device_mib(engine) -> tuple[float, str]:
    dev = jax.devices()[0]
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    if stats and "peak_bytes_in_use" in stats:
        return stats["peak_bytes_in_use"] / 2 ** 20, "device peak_bytes_in_use"
    return engine_bytes(engine) / 2 ** 20, "cpu: bytes of the engine's device buffers"


# ------------------------------------------------------------------------------- workloads

def workload_plan(name: str, jc: JudgeConfig, prompts):
    if name == "solo":
        return 1, prompts[:jc.solo_requests]
    if name == "team":
        return jc.team_lanes, prompts[:jc.team_requests]
    if name == "busy":
        reqs = [prompts[i % len(prompts)] for i in range(jc.busy_requests)]
        return jc.busy_lanes, reqs
    raise ValueError(f"unknown workload {name!r}")


def busy_pages(jc: JudgeConfig, prompts) -> int:
    """Pool size: busy_fill x the pages every busy lane would hold at its mid-reply length."""
    mean_len = np.mean([len(p) for p in prompts]) + jc.max_new_tokens / 2 + 2 * jc.k + 1
    per_lane = int(np.ceil(mean_len / jc.page_size))
    return max(int(jc.busy_lanes * per_lane * jc.busy_fill), per_lane + 1)


def workload_params(jc: JudgeConfig, n: int):
    return [SamplingParams(temperature=jc.temperature, max_new_tokens=jc.max_new_tokens,
                           seed=jc.seed + i) for i in range(n)]


def timed_generate(engine, prompts, params):
    util = []

    def on_token(i, ids):
        s = engine.stats()
        if "free_pages" in s and s.get("total_pages"):
            util.append(1 - s["free_pages"] / s["total_pages"])

    for key in ("prefill_s", "step_s", "host_s", "steps"):
        engine.timing[key] = 0
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params, on_token=on_token)
    wall = time.perf_counter() - t0
    errors = [o.error for o in outs if o.finish_reason == "error"]
    if errors:
        raise RuntimeError(f"judge request failed: {errors[0]}")
    tokens = sum(len(o.token_ids) for o in outs)
    return {"outs": outs, "wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
            "timing": dict(engine.timing), "page_util": float(np.mean(util)) if util else None}


def acceptance(outs, k: int) -> tuple[float, list[float]]:
    steps = sum(o.stats.verify_steps for o in outs)
    acc = sum(o.stats.accepted_tokens for o in outs)
    per = [sum(o.stats.accepted_per_position[j] for o in outs) / max(steps, 1) for j in range(k)]
    return (steps + acc) / max(steps, 1), per


# ------------------------------------------------------------------------------- gate pieces

@partial(jax.jit, static_argnames=("cfg", "T", "kernels"))
def _step_logprobs(cfg, params, cache, tokens, start, *, T, kernels):
    B = tokens.shape[0]
    h, cache = model.forward(cfg, params, cache, tokens, model.Segment(start, jnp.full((B,), T, jnp.int32)),
                             "step", kernels)
    return jax.nn.log_softmax(model.lm_head(params, h), -1), cache


@partial(jax.jit, static_argnames=("cfg", "kernels"))
def _prefill_lp(cfg, params, cache, tokens, kernels):
    B, T = tokens.shape
    h, cache = model.forward(cfg, params, cache, tokens, model.Segment.full(B, T), "chunk", kernels)
    return jax.nn.log_softmax(model.lm_head(params, h[:, -1]), -1), cache


def path_logprobs(cfg, params, prompt, cont, T: int, kernels: str = "reference"):
    """Teacher-forced log-probs of cont[:, 1:] after prefilling `prompt`, fed T tokens per step.

    prompt i32[B, P]; cont i32[B, n+1] with n a multiple of T. T = 1 is the stock decode path,
    T = k+1 the candidate's verify path. Returns float32 [B, n, V] log-probs.
    """
    prompt, cont = jnp.asarray(prompt, jnp.int32), jnp.asarray(cont, jnp.int32)
    (B, P), n = prompt.shape, cont.shape[1] - 1
    cache = model.init_cache(cfg, B, P + n + 2, T, params.embed.dtype)
    _, cache = _prefill_lp(cfg, params, cache, prompt, kernels)
    got = []
    for s in range(0, n, T):
        lp, cache = _step_logprobs(cfg, params, cache, cont[:, s:s + T],
                                   jnp.full((B,), P + s, jnp.int32), T=T, kernels=kernels)
        got.append(np.asarray(lp))
    return np.concatenate(got, axis=1)


def fidelity(cfg, params, texts, jc: JudgeConfig, kernels: str) -> float:
    """Mean |log p_verify - log p_decode| of the true next tokens over the fixed texts.

    Both paths prefill the same prompt; then stock feeds the continuation one token per step
    (decode path), candidate k+1 tokens per step (verify path), teacher-forced.
    """
    k = jc.k
    n = (jc.fidelity_tokens // (k + 1)) * (k + 1)
    P = min(len(p) for p, _ in texts)
    rows = [(p[-P:], c[:n + 1]) for p, c in texts if len(c) > n]
    prompt = np.asarray([r[0] for r in rows], np.int32)
    cont = np.asarray([r[1] for r in rows], np.int32)                   # [B, n+1]
    idx = cont[:, 1:, None]
    lp = {T: np.take_along_axis(path_logprobs(cfg, params, prompt, cont, T, kernels), idx, -1)
          for T in (1, k + 1)}
    return float(np.abs(lp[k + 1] - lp[1]).mean())


def score_replies(cfg, params, prompts, replies):
    """Per reply: mean log-prob of its tokens and share equal to the argmax, under stock."""
    lp_means, am_shares = [], []
    for p, r in zip(prompts, replies):
        if not r:
            continue
        seq = np.asarray([p + r], np.int32)
        logits = np.asarray(mtpjax.forward_logits(cfg, params, seq))[0].astype(np.float64)
        top = logits.max(-1, keepdims=True)
        lp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        pos = np.arange(len(p) - 1, len(p) + len(r) - 1)
        toks = np.asarray(r)
        lp_means.append(float(lp[pos, toks].mean()))
        am_shares.append(float((logits[pos].argmax(-1) == toks).mean()))
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


# ------------------------------------------------------------------------------- main

def run_judge(jc: JudgeConfig, candidate_k: int | None = None) -> dict:
    from tqdm import tqdm
    t_start = time.perf_counter()
    k = jc.k if candidate_k is None else candidate_k
    jc = dataclasses.replace(jc, k=k)
    cfg, params = mtpjax.load_checkpoint(jc.checkpoint, jc.dtype)
    tokenizer = _tokenizer(jc.checkpoint)
    texts = load_texts(tokenizer, jc)
    prompts = [p for p, _ in texts]
    max_seq_len = max(len(p) for p in prompts) + jc.max_new_tokens + 8

    plans = {w: workload_plan(w, jc, prompts) for w in jc.workloads}
    pool = {w: (busy_pages(jc, plans[w][1]) if w == "busy" else None) for w in jc.workloads}
    engines = {}
    for w, (lanes, _) in plans.items():
        for kk in (0, k):
            engines[(w, kk)] = make_engine(cfg, params, jc, kk, lanes, pool[w], max_seq_len)
    kernels = engines[(jc.workloads[0], 0)].kernels

    total = len(plans) * 2 * (1 + jc.passes) + 3
    bar = tqdm(total=total, desc="judge", disable=not jc.progress, leave=False)
    results = {w: {"stock": [], "candidate": []} for w in plans}
    warm = {}
    for w, (lanes, reqs) in plans.items():
        params_w = workload_params(jc, len(reqs))
        for kk in (0, k):
            warm[(w, kk)] = timed_generate(engines[(w, kk)], reqs, params_w)
            bar.update(1)
        for p in range(jc.passes):
            order = (0, k) if p % 2 == 0 else (k, 0)
            for kk in order:
                r = timed_generate(engines[(w, kk)], reqs, params_w)
                results[w]["stock" if kk == 0 else "candidate"].append(r)
                bar.update(1)

    # ---- gate: sampled replies (likelihood, argmax, sampled agreement) on the team engines
    gate_w = "team" if "team" in plans else jc.workloads[0]
    gp = prompts[:jc.gate_prompts]
    sp = [SamplingParams(temperature=jc.sample_temperature, max_new_tokens=jc.max_new_tokens,
                         seed=10_000 + jc.seed + i) for i in range(len(gp))]
    rep = {}
    for kk in (0, k):
        rep[kk] = [o.token_ids for o in engines[(gate_w, kk)].generate(gp, sp)]
        bar.update(1)
    lp_c, am_c = score_replies(cfg, params, gp, rep[k])
    lp_s, am_s = score_replies(cfg, params, gp, rep[0])
    fid = fidelity(cfg, params, texts, jc, kernels)
    bar.update(1)
    bar.close()

    # greedy agreement from the throughput workloads when greedy, else from a greedy run
    if jc.temperature == 0.0:
        g_c = [o.token_ids for w in plans for o in results[w]["candidate"][0]["outs"]]
        g_s = [o.token_ids for w in plans for o in results[w]["stock"][0]["outs"]]
    else:
        gsp = SamplingParams(max_new_tokens=jc.max_new_tokens)
        g_c = [o.token_ids for o in engines[(gate_w, k)].generate(gp, gsp)]
        g_s = [o.token_ids for o in engines[(gate_w, 0)].generate(gp, gsp)]

    mem_c, how = peak_device_mib(engines[(gate_w, k)])
    mem_s, _ = peak_device_mib(engines[(gate_w, 0)])
    ratios, lengths, acc, acc_pos, thr, split, util = {}, {}, {}, {}, {}, {}, {}
    for w in plans:
        st, ca = results[w]["stock"], results[w]["candidate"]
        passes = [c["tok_s"] / s["tok_s"] for s, c in zip(st, ca)]
        ratios[w] = {"passes": passes, "ratio": statistics.median(passes)}
        lengths[w] = gate.length_ratio([len(o.token_ids) for o in ca[0]["outs"]],
                                       [len(o.token_ids) for o in st[0]["outs"]])
        acc[w], acc_pos[w] = acceptance(ca[0]["outs"], k)
        thr[w] = {"stock_tok_s": [s["tok_s"] for s in st], "candidate_tok_s": [c["tok_s"] for c in ca]}
        split[w] = {name: {key: float(np.median([r["timing"][key] / max(r["timing"]["steps"], 1) * 1e3
                                                  for r in rs])) for key in ("step_s", "host_s")}
                    for name, rs in (("stock", st), ("candidate", ca))}
        for name, rs in (("stock", st), ("candidate", ca)):
            split[w][name]["prefill_ms_per_request"] = float(np.median(
                [r["timing"]["prefill_s"] / len(plans[w][1]) * 1e3 for r in rs]))
        util[w] = ca[0]["page_util"]

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
        "ratios": ratios,
    }
    verdict = gate.evaluate(measured, jc.limits)
    split_at = plans[gate_w][0]
    draft_verify = step_split(cfg, params, split_at, k, kernels) if k else None
    card = {
        "ratios": ratios,
        "specscore": verdict["specscore"],
        "greedy_agreement": measured["greedy_agreement"],
        "sampled_agreement": measured["sampled_agreement"],
        "likelihood": measured["likelihood"],
        "argmax": measured["argmax"],
        "fidelity": fid,
        "lengths": lengths,
        "memory": {**verdict["memory"], "how": how},
        "acceptance": acc,
        "acceptance_by_position": acc_pos,
        "limits": dataclasses.asdict(jc.limits),
        "checks": verdict["checks"],
        "reason": verdict["reason"],
        "score": verdict["score"],
        "throughput": thr,
        "step_time_ms": split,
        "draft_verify_ms": draft_verify,
        "page_utilization": util,
        "settings": {
            "checkpoint": os.path.abspath(jc.checkpoint), "dtype": jc.dtype, "k": k,
            "kernels": kernels, "passes": jc.passes, "max_new_tokens": jc.max_new_tokens,
            "temperature": jc.temperature, "sample_temperature": jc.sample_temperature,
            "lanes": {w: plans[w][0] for w in plans}, "requests": {w: len(plans[w][1]) for w in plans},
            "page_size": jc.page_size, "busy_pages": pool.get("busy"),
            "device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
            "versions": {"jax": jax.__version__, "python": platform.python_version()},
            "compiled_programs": {f"{w}/k={kk}": e.stats().get("compiled_programs")
                                  for (w, kk), e in engines.items()},
            "wall_s": time.perf_counter() - t_start,
        },
    }
    card_lib.write(card, jc.out_dir)
    return card


def main(argv):
    del argv
    jc = _from_flags()
    card = run_judge(jc)
    print(card_lib.render_md(card))
    print(f"card written to {os.path.abspath(jc.out_dir)}")
