"""`python -m experiments train_tiny [--out=checkpoints/tiny] [--steps=N] ...`

Trains the bundled demo checkpoint from scratch on this machine, with no download:

1. a byte-level BPE tokenizer (`tokenizers`; Qwen3.5's pre-tokenizer regex + ByteLevel, NFC, no
   unk; `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` added after the BPE ids, as in Qwen) on
   the training split of the Python standard library's source (experiments/corpus.py);
2. a small Qwen3.5-architecture model (hybrid Gated DeltaNet + gated full attention, the same
   code path as 27B) *and* its MTP head, jointly, with AdamW (warmup + cosine) on

       CE(target logits at p, token p+1) + mtp_weight * [(1 - a) * CE(MTP logits at p, token p+2)
                                                         + a * CE(MTP logits at p, sg(target probs at p+1))]

   where a = --mtp_distill. The MTP at p sees (target hidden h_p, token p+1), exactly what the
   target at p+1 has seen, so the soft term (self-distillation, stop-gradient on the target)
   trains the MTP towards the target's own next-token choice, which is what the speculative
   acceptance measures; a = 0 is the plain hard-label MTP loss;
3. saves an HF-layout checkpoint (BF16 safetensors, A_log F32, `mtp.*`, tied embeddings) with
   tokenizer.json and generation_config.json, reloads it with `mtpjax.load_checkpoint` and
   evaluates the reloaded model on held-out files: target next-token accuracy, MTP t+2 accuracy,
   the greedy acceptance proxy (MTP argmax at p == target argmax at p+1, teacher-forced on true
   text) and the first-draft acceptance under real greedy generation (prefill + step decode with
   the engine's cache). Metrics, the command and the training time go to TRAINING.md and
   train_metrics.json in --out.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
import sys
import time
from functools import partial

from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "checkpoints/tiny", "output checkpoint folder")
flags.DEFINE_integer("steps", 300, "optimizer steps")
flags.DEFINE_integer("batch", 8, "sequences per step")
flags.DEFINE_integer("seq_len", 256, "tokens per training sequence")
flags.DEFINE_integer("vocab_size", 4096, "vocab size (BPE ids + the 3 special tokens, padded)")
flags.DEFINE_float("lr", 3e-3, "peak learning rate")
flags.DEFINE_float("min_lr_ratio", 0.1, "final lr as a fraction of the peak")
flags.DEFINE_float("warmup_frac", 0.05, "fraction of the steps spent warming up")
flags.DEFINE_float("weight_decay", 0.05, "AdamW weight decay (matrices only)")
flags.DEFINE_float("clip", 1.0, "global gradient-norm clip")
flags.DEFINE_integer("seed", 0, "seed for init and data order")
flags.DEFINE_enum("compute_dtype", "float32", ["float32", "bfloat16"],
                  "dtype of the forward/backward (float32 master weights and optimizer)")
flags.DEFINE_float("mtp_weight", 1.0, "weight of the MTP loss")
flags.DEFINE_float("mtp_distill", 0.5, "fraction of the MTP loss that is self-distillation "
                   "towards the target's (stop-gradient) next-token distribution")
# model size
flags.DEFINE_integer("hidden_size", 256, "hidden size")
flags.DEFINE_integer("intermediate_size", 768, "MLP intermediate size")
flags.DEFINE_integer("num_layers", 8, "decoder layers (pattern [linear, linear, linear, full])")
flags.DEFINE_integer("full_attention_interval", 4, "every n-th layer is full attention")
flags.DEFINE_integer("num_attention_heads", 4, "query heads")
flags.DEFINE_integer("num_key_value_heads", 2, "KV heads")
flags.DEFINE_integer("head_dim", 64, "attention head dim")
flags.DEFINE_integer("linear_num_key_heads", 2, "GDN key heads")
flags.DEFINE_integer("linear_num_value_heads", 4, "GDN value heads")
flags.DEFINE_integer("linear_head_dim", 64, "GDN key/value head dim")
flags.DEFINE_float("rope_theta", 10000.0, "RoPE base")
flags.DEFINE_integer("max_position_embeddings", 8192, "max positions recorded in config.json")
flags.DEFINE_boolean("tie_word_embeddings", True, "tie lm_head to the embedding")
# data / tokenizer / eval
flags.DEFINE_integer("tokenizer_train_mb", 8, "MB of training text the BPE is trained on")
flags.DEFINE_string("tokenizer", None, "reuse this tokenizer.json instead of training one")
flags.DEFINE_integer("max_train_files", 0, "use only the first n train files (0: all; smoke tests)")
flags.DEFINE_integer("heldout_percent", 5, "percent of files held out (by path hash)")
flags.DEFINE_integer("eval_windows", 48, "held-out windows of --eval_len tokens to evaluate")
flags.DEFINE_integer("eval_len", 512, "tokens per held-out window")
flags.DEFINE_integer("gen_prompts", 8, "held-out prompts for the greedy-generation acceptance")
flags.DEFINE_integer("gen_prompt_len", 64, "prompt tokens")
flags.DEFINE_integer("gen_new", 128, "greedily generated tokens per prompt")
flags.DEFINE_integer("log_every", 25, "print the loss every n steps")
flags.DEFINE_boolean("eval_only", False, "skip training; evaluate the checkpoint in --out")

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen3.5's pre-tokenizer regex (spec §7).
QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"
                r" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------

def train_tokenizer(texts, vocab_size: int):
    """Byte-level BPE with Qwen3.5's pre-tokenization; the specials get the last ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIALS), min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens(list(SPECIALS))
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"tokenizer has {tok.get_vocab_size()} ids > vocab_size {vocab_size}")
    return tok


def special_ids(tok) -> dict[str, int]:
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    missing = [s for s, i in ids.items() if i is None]
    if missing:
        raise ValueError(f"tokenizer lacks special tokens {missing}")
    return ids


# --------------------------------------------------------------------------------------------
# A fast exact unit-lower-triangular solve for the chunked delta rule on XLA:CPU
# --------------------------------------------------------------------------------------------
#
# The reference chunked GDN (pallas_kernels.chunk_gated_delta_reference) solves one 64x64 unit
# lower-triangular system per (batch, head, chunk) with jax.scipy.linalg.solve_triangular. On
# XLA:CPU that op is ~100x slower than its arithmetic (about 180 ms for 8 systems of 64x64 with
# 128 right-hand sides, vs 2 ms below) and dominated the training step. `fast_triangular_solve`
# swaps in, for this process only, the same solve computed by recursive block inversion
# ([[A, 0], [C, B]]^-1 = [[A^-1, 0], [-B^-1 C A^-1, B^-1]], 6 doubling levels of batched
# matmuls: as stable as substitution, differentiable, no loops). Same math, so the trained
# weights are those of the stock model; main() checks both give the same logits.

def unit_lower_inverse(m):
    """Inverse of unit-lower-triangular m [..., n, n] (n a power of two; the upper part is ignored)."""
    import jax
    import jax.numpy as jnp
    n = m.shape[-1]
    if n & (n - 1):
        raise ValueError(f"size {n} is not a power of two")
    batch = m.shape[:-2]
    hi = jax.lax.Precision.HIGHEST
    d = jnp.ones(batch + (n, 1, 1), m.dtype)            # inverse diagonal blocks of size s
    s = 1
    while s < n:
        nb = n // (2 * s)
        blk = jnp.diagonal(m.reshape(batch + (nb, 2 * s, nb, 2 * s)), axis1=-4, axis2=-2)
        c = jnp.moveaxis(blk, -1, -3)[..., s:, :s]      # [..., nb, s, s] lower-left blocks
        ai, bi = d[..., 0::2, :, :], d[..., 1::2, :, :]
        low = -jnp.einsum("...ij,...jk,...kl->...il", bi, c, ai, precision=hi)
        d = jnp.concatenate([jnp.concatenate([ai, jnp.zeros_like(ai)], -1),
                             jnp.concatenate([low, bi], -1)], -2)
        s *= 2
    return d[..., 0, :, :]


def _fast_solve_triangular(a, b, lower=False, unit_diagonal=False, **kw):
    import jax
    import jax.numpy as jnp
    n = a.shape[-1]
    if not (lower and unit_diagonal) or kw or n & (n - 1):
        return _STOCK_SOLVE[0](a, b, lower=lower, unit_diagonal=unit_diagonal, **kw)
    return jnp.einsum("...ij,...jk->...ik", unit_lower_inverse(a), b,
                      precision=jax.lax.Precision.HIGHEST)


_STOCK_SOLVE = []


class fast_triangular_solve:
    """Context manager: the chunked GDN reference uses `_fast_solve_triangular` inside it.

    Functions must be traced (jit-compiled) inside the context for it to take effect.
    """

    def __enter__(self):
        import jax
        import pallas_kernels.gated_delta as gd
        self._gd = gd
        jax.clear_caches()  # the reference functions are jitted: drop traces made without us
        self._old = getattr(gd, "solve_triangular", None)
        if self._old is not None:
            if not _STOCK_SOLVE:
                _STOCK_SOLVE.append(self._old)
            gd.solve_triangular = _fast_solve_triangular
        return self

    def __exit__(self, *exc):
        import jax
        if self._old is not None:
            self._gd.solve_triangular = self._old
        jax.clear_caches()
        return False


# --------------------------------------------------------------------------------------------
# Model init and training step
# --------------------------------------------------------------------------------------------

def make_config(eos_ids=()):
    from mtpjax.config import FULL, LINEAR, Config
    n, every = FLAGS.num_layers, FLAGS.full_attention_interval
    return Config(
        vocab_size=FLAGS.vocab_size, hidden_size=FLAGS.hidden_size,
        intermediate_size=FLAGS.intermediate_size,
        layer_types=tuple(FULL if (i + 1) % every == 0 else LINEAR for i in range(n)),
        num_attention_heads=FLAGS.num_attention_heads,
        num_key_value_heads=FLAGS.num_key_value_heads, head_dim=FLAGS.head_dim,
        rope_theta=FLAGS.rope_theta, partial_rotary_factor=0.25,
        linear_num_key_heads=FLAGS.linear_num_key_heads,
        linear_num_value_heads=FLAGS.linear_num_value_heads,
        linear_key_head_dim=FLAGS.linear_head_dim, linear_value_head_dim=FLAGS.linear_head_dim,
        linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
        tie_word_embeddings=FLAGS.tie_word_embeddings, mtp_num_hidden_layers=1,
        max_position_embeddings=FLAGS.max_position_embeddings, eos_token_ids=tuple(eos_ids))


def init_train_params(cfg, seed: int):
    """init_params, with norms at their HF init and residual-output matrices scaled down."""
    import jax
    import jax.numpy as jnp
    from mtpjax.params import init_params
    params = init_params(cfg, jax.random.key(seed), "float32", scale=0.02)
    out_scale = 1.0 / math.sqrt(2 * cfg.num_layers)

    def fix(path, x):
        names = [getattr(k, "name", "") for k in path]
        name = names[-1]
        if name == "norm" and "gdn" in names:
            return jnp.ones_like(x)                      # plain-weight gated norm
        if x.ndim == 1 and name not in (
                "A_log", "dt_bias"):
            return jnp.zeros_like(x)                     # 1+w norms
        if name == "dt_bias":
            return jnp.ones_like(x)
        if name in ("o_proj", "down_proj", "out_proj"):
            return x * out_scale
        return x
    return jax.tree_util.tree_map_with_path(fix, params)


def _ce(logits, labels):
    import jax
    import jax.numpy as jnp
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return jnp.mean(lse - picked)


def make_loss(cfg, mtp_weight: float, distill: float, compute_dtype: str = "float32"):
    """Joint loss over tok [B, L+2]; params are float32 masters, cast to compute_dtype inside
    (A_log stays float32), logits and losses in float32."""
    import jax
    import jax.numpy as jnp
    from mtpjax import model
    from mtpjax.api import cast_params

    def loss_fn(params, tok):
        B, L2 = tok.shape
        L = L2 - 2
        if compute_dtype != "float32":
            params = cast_params(params, compute_dtype)
        x, y1, y2 = tok[:, :L], tok[:, 1:L + 1], tok[:, 2:]
        seg = model.Segment.full(B, L)
        cache = model.init_cache(cfg, B, L, 1, params.embed.dtype)
        h, cache = model.forward(cfg, params, cache, x, seg, mode="chunk")
        logits = model.lm_head(params, h)
        ce_t = _ce(logits, y1)
        hm, _ = model.mtp_forward(cfg, params, cache, h, y1, seg)
        mlog = model.lm_head(params, hm)
        ce_m = _ce(mlog, y2)
        # soft targets: the target's distribution at p+1 (it predicts token p+2 too)
        teacher = jax.nn.softmax(jax.lax.stop_gradient(logits[:, 1:]), axis=-1)
        soft = -jnp.mean(jnp.sum(teacher * jax.nn.log_softmax(mlog[:, :-1], axis=-1), axis=-1))
        loss = ce_t + mtp_weight * ((1.0 - distill) * ce_m + distill * soft)
        acc_t = jnp.mean(jnp.argmax(logits, -1) == y1)
        acc_m = jnp.mean(jnp.argmax(mlog, -1) == y2)
        agree = jnp.mean(jnp.argmax(mlog[:, :-1], -1) == jnp.argmax(logits[:, 1:], -1))
        return loss, dict(loss=loss, ce_t=ce_t, ce_m=ce_m, soft=soft, acc_t=acc_t, acc_m=acc_m,
                          agree=agree)
    return loss_fn


def make_optimizer(steps: int):
    import jax
    import optax
    warm = max(1, int(FLAGS.warmup_frac * steps))
    sched = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=FLAGS.lr, warmup_steps=warm, decay_steps=max(steps, warm + 1),
        end_value=FLAGS.lr * FLAGS.min_lr_ratio)

    def mask(params):  # decay matrices only, not norms or biases
        return jax.tree.map(lambda x: x.ndim >= 2, params)
    return optax.chain(
        optax.clip_by_global_norm(FLAGS.clip),
        optax.adamw(sched, b1=0.9, b2=0.95, eps=1e-8, weight_decay=FLAGS.weight_decay, mask=mask),
    ), sched


# --------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------

def _hidden(cfg, params, tok):
    from mtpjax import model
    B, L = tok.shape
    cache = model.init_cache(cfg, B, L, 1, params.embed.dtype)
    h, _ = model.forward(cfg, params, cache, tok, model.Segment.full(B, L), mode="chunk")
    return h


def make_eval(cfg):
    import jax
    import jax.numpy as jnp
    from mtpjax import model

    @jax.jit
    def ev(params, tok):
        """tok [B, L]: per-row counts of target hits (p -> p+1), MTP hits (p -> p+2), agreement."""
        B, L = tok.shape
        seg = model.Segment.full(B, L)
        cache = model.init_cache(cfg, B, L, 1, params.embed.dtype)
        h, cache = model.forward(cfg, params, cache, tok, seg, mode="chunk")
        tgt = jnp.argmax(model.lm_head(params, h), -1)                     # [B, L] -> p+1
        hm, _ = model.mtp_forward(cfg, params, cache, h[:, :-1], tok[:, 1:],
                                  model.Segment.full(B, L - 1))
        mtp = jnp.argmax(model.lm_head(params, hm), -1)                    # [B, L-1] -> p+2
        hit_t = jnp.sum(tgt[:, :-1] == tok[:, 1:], axis=1)
        hit_m = jnp.sum(mtp[:, :-1] == tok[:, 2:], axis=1)
        agree = jnp.sum(mtp[:, :-1] == tgt[:, 1:-1], axis=1)
        return hit_t, hit_m, agree
    return ev


def heldout_eval(cfg, params, tokens, windows: int, length: int, batch: int = 8):
    import numpy as np
    ev = make_eval(cfg)
    n = min(windows, len(tokens) // length)
    data = tokens[:n * length].reshape(n, length)
    ht = hm = ag = 0
    for i in range(0, n, batch):
        rows = data[i:i + batch]
        k = len(rows)
        if k < batch:  # keep one compiled shape; padded rows are not counted
            rows = np.concatenate([rows, np.repeat(rows[:1], batch - k, 0)])
        a, b, c = (np.asarray(x)[:k].sum() for x in ev(params, rows))
        ht, hm, ag = ht + int(a), hm + int(b), ag + int(c)
    return dict(heldout_tokens=int(n * length),
                target_acc=ht / (n * (length - 1)),
                mtp_acc=hm / (n * (length - 2)),
                accept_proxy=ag / (n * (length - 2)))


def greedy_generation_accept(cfg, params, prompts, n_new: int):
    """First-draft acceptance when the target decodes greedily with the engine's cache.

    prompts int [B, P]. The target prefills the prompt (chunk mode), then decodes n_new tokens one
    step at a time (step mode). At every decoded position the MTP is run with the target's hidden
    state and the token just produced (exactly what a speculative engine drafts from) and its
    argmax is compared with the token the target then produces. Returns (acceptance, tokens).
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from mtpjax import model

    B, P = prompts.shape
    max_len = P + n_new + 2

    @jax.jit
    def prefill(params, tok):
        seg = model.Segment.full(B, P)
        cache = model.init_cache(cfg, B, max_len, 1, params.embed.dtype)
        h, cache = model.forward(cfg, params, cache, tok, seg, mode="chunk")
        nxt = jnp.argmax(model.lm_head(params, h[:, -1]), -1).astype(jnp.int32)
        # MTP over the prompt: pairs (h_i, t_{i+1}), the last one with the sampled token
        nxt_tokens = jnp.concatenate([tok[:, 1:], nxt[:, None]], axis=1)
        hm, cache = model.mtp_forward(cfg, params, cache, h, nxt_tokens, seg)
        draft = jnp.argmax(model.lm_head(params, hm[:, -1]), -1).astype(jnp.int32)
        return nxt, draft, cache

    @jax.jit
    def step(params, cache, tok, pos):
        seg = model.Segment(jnp.full((B,), pos, jnp.int32), jnp.ones((B,), jnp.int32))
        h, cache = model.forward(cfg, params, cache, tok[:, None], seg, mode="step")
        nxt = jnp.argmax(model.lm_head(params, h[:, 0]), -1).astype(jnp.int32)
        hm, cache = model.mtp_forward(cfg, params, cache, h, nxt[:, None], seg)
        draft = jnp.argmax(model.lm_head(params, hm[:, 0]), -1).astype(jnp.int32)
        return nxt, draft, cache

    tok = jnp.asarray(prompts, jnp.int32)
    cur, draft, cache = prefill(params, tok)
    hits, total, out = 0, 0, [np.asarray(cur)]
    for i in range(n_new - 1):
        nxt, new_draft, cache = step(params, cache, cur, P + i)
        hits += int(jnp.sum(draft == nxt))
        total += B
        cur, draft = nxt, new_draft
        out.append(np.asarray(cur))
    return hits / max(total, 1), np.stack(out, axis=1)


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------

def _command() -> str:
    args = sys.argv[1:]
    if args and args[0] == "train_tiny":
        args = args[1:]
    return "python -m experiments train_tiny " + " ".join(shlex.quote(a) for a in args)


def _dir_mb(path: str) -> float:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
               if os.path.isfile(os.path.join(path, f))) / 1e6


def write_report(out: str, metrics: dict):
    with open(os.path.join(out, "train_metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
        f.write("\n")
    m, c = metrics, metrics["config"]
    ev = m["heldout"]
    hist = m.get("loss_history", [])
    lines = [
        "# checkpoints/tiny — demo Qwen3.5-architecture model with a trained MTP head",
        "",
        "Trained from scratch on this machine's CPU by `python -m experiments train_tiny`",
        "(experiments/train_tiny.py); nothing is downloaded. Same architecture and code path as",
        "Qwen3.5-27B (hybrid Gated DeltaNet + gated full attention, partial RoPE, 1+w RMSNorm, one",
        "MTP layer), in the real HF layout (`Qwen3_5ForConditionalGeneration` wrapper config,",
        "text tensors under `model.language_model.*`, MTP under `mtp.*`), stored as BF16",
        "safetensors (A_log F32) and loaded as float32 by `mtpjax.load_checkpoint(\"checkpoints/tiny\")`.",
        "",
        "## Model",
        "",
        f"- layers: {c['num_layers']} = {c['layer_pattern']} x {c['num_layers'] // len(c['layer_pattern'])}",
        f"- hidden {c['hidden_size']}, MLP {c['intermediate_size']}, vocab {c['vocab_size']}"
        f" ({'tied' if c['tie_word_embeddings'] else 'untied'} embeddings)",
        f"- full attention: {c['num_attention_heads']} q heads / {c['num_key_value_heads']} kv heads,"
        f" head dim {c['head_dim']}, partial rotary 0.25, rope_theta {c['rope_theta']:g}",
        f"- Gated DeltaNet: {c['linear_num_key_heads']} key heads / {c['linear_num_value_heads']}"
        f" value heads, head dim {c['linear_head_dim']}, conv kernel 4",
        f"- MTP: 1 layer (full attention + MLP), shares embedding and lm_head",
        f"- parameters: {m['params']:,} (of which MTP {m['mtp_params']:,}, embedding"
        f" {m['embed_params']:,})",
        f"- files on disk: {m['disk_mb']:.1f} MB",
        "",
        "## Data and tokenizer",
        "",
        f"- corpus: the Python standard library's `*.py` files ({m['corpus']['root_note']}),"
        f" split by `sha256(relative path) % 100 < {m['corpus']['heldout_percent']}` into"
        f" {m['corpus']['train_files']} train / {m['corpus']['heldout_files']} held-out files"
        f" ({m['corpus']['train_tokens']:,} / {m['corpus']['heldout_tokens']:,} tokens)",
        f"- tokenizer: byte-level BPE trained on {m['tokenizer']['train_mb']} MB of the train split,"
        " Qwen3.5 pre-tokenizer regex + ByteLevel, NFC, no unk;"
        f" {m['tokenizer']['size']} ids, specials {m['tokenizer']['specials']}",
        "",
        "## Training",
        "",
        f"- command: `{m['command']}`",
        f"- {m['train']['steps']} steps x {m['train']['batch']} x {m['train']['seq_len']} tokens"
        f" = {m['train']['tokens']:,} tokens; AdamW (b2 0.95, wd {m['train']['weight_decay']}),"
        f" peak lr {m['train']['lr']:g}, warmup + cosine to {m['train']['min_lr_ratio']:g}x, clip"
        f" {m['train']['clip']:g}",
        f"- loss: CE(target, t+1) + {m['train']['mtp_weight']:g} x [(1 - {m['train']['mtp_distill']:g})"
        f" CE(MTP, t+2) + {m['train']['mtp_distill']:g} CE(MTP, stop-grad target probs at p+1)]",
        f"- training time: {m['train']['seconds']:.0f} s wall ({m['train']['tokens_per_s']:.0f}"
        f" tokens/s) on {m['machine']}",
        f"- final train loss {m['train']['final']['loss']:.3f} (target CE"
        f" {m['train']['final']['ce_t']:.3f}, MTP CE {m['train']['final']['ce_m']:.3f})",
        "",
        "## Held-out evaluation (the saved BF16 checkpoint, reloaded as float32)",
        "",
        f"Over {ev['heldout_tokens']:,} held-out tokens ({m['eval']['windows']} windows of"
        f" {m['eval']['len']}), teacher-forced on the true text:",
        "",
        "| metric | value |",
        "|---|---|",
        f"| target next-token accuracy (argmax at p == token p+1) | {ev['target_acc']:.3f} |",
        f"| MTP t+2 accuracy (MTP argmax at p == token p+2) | {ev['mtp_acc']:.3f} |",
        f"| greedy acceptance proxy (MTP argmax at p == target argmax at p+1) | {ev['accept_proxy']:.3f} |",
        f"| first-draft acceptance, target decoding greedily ({m['generation']['prompts']} held-out"
        f" prompts x {m['generation']['new_tokens']} tokens, engine cache) |"
        f" {m['generation']['accept']:.3f} |",
        "",
        f"Check: the stock library path (jax.scipy `solve_triangular` in the chunked GDN) and the",
        f"fast exact solve used for training/eval (see experiments/train_tiny.py) give logits within"
        f" {m['solve_check']['max_abs_logit_diff']:.1e} of each other on a held-out window"
        f" (argmax agreement {m['solve_check']['argmax_agree']:.3f}).",
        "",
        "Reproduce: run the command above (about the same time on a 2-core CPU); the result is",
        "deterministic given the seed up to floating-point reduction order.",
    ]
    if hist:
        lines += ["", "## Loss curve (every log step)", "", "| step | loss | target CE | MTP CE |"
                  " MTP/target agree |", "|---|---|---|---|---|"]
        rows = hist[:: max(1, len(hist) // 20)]
        if rows[-1] is not hist[-1]:
            rows.append(hist[-1])
        for r in rows:
            lines.append(f"| {r['step']} | {r['loss']:.3f} | {r['ce_t']:.3f} | {r['ce_m']:.3f} |"
                         f" {r['agree']:.3f} |")
    with open(os.path.join(out, "TRAINING.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from tokenizers import Tokenizer

    import mtpjax
    from checkpoints import save_hf_checkpoint
    from experiments import corpus
    from mtpjax.model import lm_head
    from mtpjax.params import count_params

    out = FLAGS.out
    os.makedirs(out, exist_ok=True)
    t_start = time.time()

    # ---- tokenizer ----
    tok_path = os.path.join(out, "tokenizer.json")
    if FLAGS.eval_only:
        tok = Tokenizer.from_file(tok_path)
    elif FLAGS.tokenizer:
        tok = Tokenizer.from_file(FLAGS.tokenizer)
    else:
        budget = FLAGS.tokenizer_train_mb * 1_000_000
        sample, used = [], 0
        files = corpus.split_files("train", FLAGS.heldout_percent)
        rng = np.random.default_rng(FLAGS.seed)
        for i in rng.permutation(len(files)):
            t = corpus.read_file(files[i])
            if not t:
                continue
            sample.append(t)
            used += len(t)
            if used >= budget:
                break
        t0 = time.time()
        tok = train_tokenizer(sample, FLAGS.vocab_size)
        print(f"tokenizer: {tok.get_vocab_size()} ids trained on {used / 1e6:.1f} MB "
              f"in {time.time() - t0:.1f} s", flush=True)
    ids = special_ids(tok)
    eos = (ids["<|im_end|>"], ids["<|endoftext|>"])

    t0 = time.time()
    train_tok = corpus.token_array(tok, "train", FLAGS.heldout_percent,
                                   max_files=FLAGS.max_train_files or None)
    held_tok = corpus.token_array(tok, "heldout", FLAGS.heldout_percent)
    print(f"corpus: {len(train_tok):,} train / {len(held_tok):,} held-out tokens "
          f"(encoded in {time.time() - t0:.1f} s)", flush=True)

    cfg = make_config(eos)
    history, train_info = [], {}
    if not FLAGS.eval_only:
        params = init_train_params(cfg, FLAGS.seed)
        n_params = count_params(params)
        print(f"model: {n_params:,} params, layers {cfg.layer_types[:cfg.layer_period]} x "
              f"{cfg.num_layers // cfg.layer_period}", flush=True)
        opt, sched = make_optimizer(FLAGS.steps)
        opt_state = opt.init(params)
        loss_fn = make_loss(cfg, FLAGS.mtp_weight, FLAGS.mtp_distill, FLAGS.compute_dtype)

        @partial(jax.jit, donate_argnums=(0, 1))
        def train_step(params, opt_state, tokens):
            (_, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens)
            updates, opt_state = opt.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            return params, opt_state, aux

        data = corpus.batches(train_tok, FLAGS.batch, FLAGS.seq_len, FLAGS.seed)
        train_ctx = fast_triangular_solve()
        train_ctx.__enter__()   # traced inside: the train step uses the fast exact solve
        t_train = time.time()
        acc, n_acc = None, 0
        for step in range(1, FLAGS.steps + 1):
            params, opt_state, aux = train_step(params, opt_state, jnp.asarray(next(data)))
            if step == 1:
                aux = jax.device_get(aux)
                print(f"step 1 (compiled in {time.time() - t_train:.1f} s): loss "
                      f"{float(aux['loss']):.3f}", flush=True)
                t_train = time.time()  # time steady-state steps from here
                t_first = t_train
                continue
            aux = jax.device_get(aux)
            acc = {k: acc[k] + float(v) for k, v in aux.items()} if acc else {
                k: float(v) for k, v in aux.items()}
            n_acc += 1
            if step % FLAGS.log_every == 0 or step == FLAGS.steps:
                avg = {k: v / n_acc for k, v in acc.items()}
                acc, n_acc = None, 0
                el = time.time() - t_first
                tps = (step - 1) * FLAGS.batch * FLAGS.seq_len / el
                eta = (FLAGS.steps - step) * el / (step - 1)
                history.append(dict(step=step, **avg))
                print(f"step {step}/{FLAGS.steps} loss {avg['loss']:.3f} ce_t {avg['ce_t']:.3f} "
                      f"ce_m {avg['ce_m']:.3f} soft {avg['soft']:.3f} acc_t {avg['acc_t']:.3f} "
                      f"acc_m {avg['acc_m']:.3f} agree {avg['agree']:.3f} "
                      f"lr {float(sched(step)):.2e} | {tps:.0f} tok/s, eta {eta / 60:.1f} min",
                      flush=True)
        train_ctx.__exit__(None, None, None)
        train_seconds = time.time() - t_start
        train_info = dict(
            steps=FLAGS.steps, batch=FLAGS.batch, seq_len=FLAGS.seq_len,
            tokens=FLAGS.steps * FLAGS.batch * FLAGS.seq_len, lr=FLAGS.lr,
            min_lr_ratio=FLAGS.min_lr_ratio, warmup_frac=FLAGS.warmup_frac,
            weight_decay=FLAGS.weight_decay, clip=FLAGS.clip, mtp_weight=FLAGS.mtp_weight,
            mtp_distill=FLAGS.mtp_distill, seed=FLAGS.seed, seconds=train_seconds,
            tokens_per_s=(FLAGS.steps - 1) * FLAGS.batch * FLAGS.seq_len
            / max(time.time() - t_first, 1e-9),
            final=history[-1] if history else {})

        gen_cfg = {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": list(eos),
                   "pad_token_id": ids["<|endoftext|>"], "do_sample": False,
                   "max_new_tokens": 256}
        save_hf_checkpoint(out, cfg, params, dtype="bfloat16", tokenizer_json=tok.to_str(),
                           generation_config=gen_cfg, layout="wrapper")
        with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
                       "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                       "unk_token": None, "add_bos_token": False,
                       "model_max_length": cfg.max_position_embeddings}, f, indent=2)
            f.write("\n")
        del params, opt_state
        print(f"saved {out} ({_dir_mb(out):.1f} MB)", flush=True)

    # ---- evaluate the saved checkpoint ----
    cfg2, params = mtpjax.load_checkpoint(out)
    # The stock library path (jax.scipy solve_triangular) and the fast solve agree:
    window = jnp.asarray(held_tok[None, :FLAGS.eval_len])
    stock = np.asarray(mtpjax.forward_logits(cfg2, params, window))
    with fast_triangular_solve():
        fast = np.asarray(jax.jit(lambda p, t: lm_head(p, _hidden(cfg2, p, t)))(params, window))
    solve_check = dict(max_abs_logit_diff=float(np.max(np.abs(stock - fast))),
                       argmax_agree=float(np.mean(stock.argmax(-1) == fast.argmax(-1))))
    print(f"stock vs fast triangular solve on one held-out window: {solve_check}", flush=True)
    fast_ctx = fast_triangular_solve()
    fast_ctx.__enter__()
    t0 = time.time()
    ev = heldout_eval(cfg2, params, held_tok, FLAGS.eval_windows, FLAGS.eval_len)
    print(f"held-out: target acc {ev['target_acc']:.3f}, MTP t+2 acc {ev['mtp_acc']:.3f}, "
          f"acceptance proxy {ev['accept_proxy']:.3f} ({time.time() - t0:.1f} s)", flush=True)
    # prompts: starts of held-out documents (after an <|endoftext|>), skipping the eval windows
    eot = ids["<|endoftext|>"]
    starts = [i for i in np.nonzero(held_tok == eot)[0]
              if i + FLAGS.gen_prompt_len < len(held_tok)]
    step_ = max(1, len(starts) // max(FLAGS.gen_prompts, 1))
    starts = starts[::step_][:FLAGS.gen_prompts]
    prompts = np.stack([held_tok[s:s + FLAGS.gen_prompt_len] for s in starts])
    t0 = time.time()
    gen_acc, gen = greedy_generation_accept(cfg2, params, prompts, FLAGS.gen_new)
    fast_ctx.__exit__(None, None, None)
    sample = tok.decode(list(prompts[0]) + list(gen[0]), skip_special_tokens=False)
    print(f"greedy generation: first-draft acceptance {gen_acc:.3f} "
          f"({len(prompts)} x {FLAGS.gen_new} tokens, {time.time() - t0:.1f} s)\n"
          f"--- sample ---\n{sample}\n--------------", flush=True)

    if FLAGS.eval_only:
        prev_path = os.path.join(out, "train_metrics.json")
        prev = json.load(open(prev_path)) if os.path.exists(prev_path) else None
        if prev is None:
            return
        metrics = prev
    else:
        from mtpjax.params import count_params as cp
        metrics = dict(
            command=_command(),
            machine=f"{platform.machine()} {os.cpu_count()} CPUs, jax {jax.__version__} "
                    f"({jax.default_backend()})",
            config=dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                        intermediate_size=cfg.intermediate_size, num_layers=cfg.num_layers,
                        layer_pattern=list(cfg.layer_types[:cfg.layer_period]),
                        num_attention_heads=cfg.num_attention_heads,
                        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                        linear_num_key_heads=cfg.linear_num_key_heads,
                        linear_num_value_heads=cfg.linear_num_value_heads,
                        linear_head_dim=cfg.linear_key_head_dim, rope_theta=cfg.rope_theta,
                        tie_word_embeddings=cfg.tie_word_embeddings),
            params=cp(params), mtp_params=cp(params.mtp), embed_params=int(params.embed.size),
            corpus=dict(root_note=f"Python {platform.python_version()}",
                        heldout_percent=FLAGS.heldout_percent,
                        train_files=len(corpus.split_files("train", FLAGS.heldout_percent)),
                        heldout_files=len(corpus.split_files("heldout", FLAGS.heldout_percent)),
                        train_tokens=int(len(train_tok)), heldout_tokens=int(len(held_tok))),
            tokenizer=dict(train_mb=FLAGS.tokenizer_train_mb, size=tok.get_vocab_size(),
                           specials=ids),
            train=train_info, loss_history=history)
    metrics["heldout"] = ev
    metrics["solve_check"] = solve_check
    metrics["eval"] = dict(windows=FLAGS.eval_windows, len=FLAGS.eval_len)
    metrics["generation"] = dict(prompts=len(prompts), prompt_len=FLAGS.gen_prompt_len,
                                 new_tokens=FLAGS.gen_new, accept=gen_acc)
    metrics["disk_mb"] = _dir_mb(out) + 0.01  # + the report files themselves (small)
    write_report(out, metrics)
    metrics["disk_mb"] = _dir_mb(out)
    write_report(out, metrics)
    print(f"wrote {out}/TRAINING.md and train_metrics.json; total {time.time() - t_start:.0f} s",
          flush=True)
