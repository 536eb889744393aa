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
   acceptance measures; a = 0 is the plain hard-label MTP loss.
   --mtp_chain=N (default 4; 1 = the loss above, which is how the original checkpoint was
   trained) adds draft steps 2..N as the engine chains them (mtpjax/steps.py draft_chain):
   step s from root p is fed the MTP's own post-norm output of step s-1 and the true token
   p+s, sits at position p+s-1 (rope), attends the step-1 KV of positions <= p plus its own
   round's chained KV, and predicts token p+s+1 (hard) / the target's distribution at p+s
   (soft), weighted --mtp_chain_decay^(s-1). `mtp_chain` unrolls all roots at once;
   `check_chain_matches_engine` compares it with the engine's own mtp_forward calls.
   --init_from=CKPT continues from a saved checkpoint (same architecture, its tokenizer);
3. saves an HF-layout checkpoint (BF16 safetensors, A_log F32, `mtp.*`, tied embeddings) with
   tokenizer.json and generation_config.json, reloads it with `mtpjax.load_checkpoint` and
   evaluates the reloaded model on held-out files: target next-token accuracy, MTP t+2 accuracy,
   the greedy acceptance proxy (MTP argmax at p == target argmax at p+1, teacher-forced on true
   text), the same per chained draft step, the first-draft acceptance under real greedy
   generation (prefill + step decode with the engine's cache), the distinct-4-gram fraction of
   the greedy continuations, and, through the real engine with fixed depth K (--engine_k), the
   acceptance by draft position and the tokens per verify step. Metrics, the command(s) and the
   training time go to TRAINING.md and train_metrics.json in --out (--baseline adds a column
   with another checkpoint's metrics, e.g. the stage-1 checkpoint evaluated with --eval_only).
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
# chained drafting (issue 13): train / evaluate the MTP as the engine chains it
flags.DEFINE_integer("mtp_chain", 4, "draft steps the MTP loss unrolls (1 = the original "
                     "single-step loss; the engine's draft s > 1 is fed the MTP's own output)")
flags.DEFINE_float("mtp_chain_decay", 0.8, "loss weight of draft step s is decay^(s-1)")
flags.DEFINE_string("init_from", None, "continue training from this checkpoint (same "
                    "architecture; its tokenizer.json is reused unless --tokenizer is given)")
flags.DEFINE_integer("eval_chain", 4, "draft steps evaluated teacher-forced on held-out text")
flags.DEFINE_list("engine_k", ["1", "2", "3", "4"], "fixed draft depths K run through the real "
                  "engine for per-position acceptance (empty: skip)")
flags.DEFINE_string("baseline", None, "train_metrics.json of a checkpoint to compare against "
                    "in TRAINING.md (evaluate it first with --eval_only)")

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


def _masked_mean(x, mask):
    """Mean of x over the entries where mask (broadcast to x's shape) is 1."""
    import jax.numpy as jnp
    mask = jnp.broadcast_to(mask, x.shape)
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _ce_rows(logits, labels):
    """Per-position CE [B, T] (logits [B, T, V], labels [B, T])."""
    import jax
    import jax.numpy as jnp
    lse = jax.nn.logsumexp(logits, axis=-1)
    return lse - jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]


def _ce(logits, labels):
    import jax.numpy as jnp
    return jnp.mean(_ce_rows(logits, labels))


def chain_attend(q, k1, v1, extra, sm_scale: float):
    """The MTP attention of a chained draft step, with the engine's KV contents, per root p.

    q [B, L, NQ, HD]: the step's queries, row p = the chain rooted at p (position p + s - 1).
    k1, v1 [B, L, NKV, HD]: step-1 entries (pairs (target h_p', token p'+1) at position p'),
    which is what the engine's MTP cache holds at every position <= the root p.
    extra: [(k, v)] of chained steps 2..s for the same root (each [B, L, NKV, HD], row p =
    that step's entry of root p, written by the engine at p + i - 1), the step's own last.
    Returns o [B, L, NQ, HD]. Row p attends k1 at positions <= p plus its own chain entries:
    exactly the engine's MTP cache during chained step s from root p (draft_chain).
    """
    import jax
    import jax.numpy as jnp
    B, L, NQ, HD = q.shape
    NKV = k1.shape[2]
    G = NQ // NKV
    qg = q.reshape(B, L, NKV, G, HD)
    s = jnp.einsum("btngd,bsnd->bngts", qg, k1,
                   preferred_element_type=jnp.float32) * sm_scale             # [B,NKV,G,L,L]
    causal = jnp.arange(L)[None, :] <= jnp.arange(L)[:, None]                # [L(t), L(s)]
    s = jnp.where(causal, s, -jnp.inf)
    se = [jnp.einsum("btngd,btnd->bngt", qg, k, preferred_element_type=jnp.float32)[..., None]
          * sm_scale for k, _ in extra]                                       # [B,NKV,G,L,1]
    p = jax.nn.softmax(jnp.concatenate([s] + se, axis=-1), axis=-1).astype(q.dtype)
    o = jnp.einsum("bngts,bsnd->btngd", p[..., :L], v1.astype(q.dtype),
                   preferred_element_type=jnp.float32)
    for i, (_, v) in enumerate(extra):
        o = o + jnp.einsum("bngt,btnd->btngd", p[..., L + i], v.astype(q.dtype),
                           preferred_element_type=jnp.float32)
    return o.astype(q.dtype).reshape(B, L, NQ, HD)


def _mtp_qkv(cfg, params, h_prev, next_tokens, offset: int):
    """The MTP layer's residual input x [B, L, H] and its attention's q [B, L, NQ, HD],
    gate [B, L, NQ*HD], k, v [B, L, NKV, HD] for pairs at positions offset + t.

    A copy of model.mtp_forward's input and attention_block's projection (public pieces
    only), so the training unroll does not depend on the engine's private helpers."""
    import jax.numpy as jnp
    from mtpjax import model
    B, L = next_tokens.shape
    m, eps = params.mtp, cfg.rms_norm_eps
    e = model.rmsnorm_1p(model.embed_tokens(cfg, params, next_tokens), m.pre_fc_norm_embedding, eps)
    hh = model.rmsnorm_1p(h_prev.astype(e.dtype), m.pre_fc_norm_hidden, eps)
    x = model.dense(jnp.concatenate([e, hh], axis=-1), m.fc)
    positions = offset + jnp.broadcast_to(jnp.arange(L)[None, :], (B, L))
    cos, sin = model.rope_cos_sin(cfg, positions, x.dtype)
    p = m.layer.attn
    nq, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    qkv = model.dense(model.rmsnorm_1p(x, m.layer.input_layernorm, eps), p.qkv)
    qg = qkv[..., :2 * nq * hd].reshape(B, L, nq, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:]
    k = qkv[..., 2 * nq * hd:(2 * nq + nkv) * hd].reshape(B, L, nkv, hd)
    v = qkv[..., (2 * nq + nkv) * hd:].reshape(B, L, nkv, hd)
    q = model.apply_rope(model.rmsnorm_1p(q, p.q_norm, eps), cos, sin, cfg.rotary_dim)
    k = model.apply_rope(model.rmsnorm_1p(k, p.k_norm, eps), cos, sin, cfg.rotary_dim)
    return x, q, gate.reshape(B, L, nq * hd), k, v


def mtp_step(cfg, params, h_prev, next_tokens, offset: int, kv1=None, extra=()):
    """One MTP pass over L roots at positions offset + p; the math of model.mtp_forward.

    h_prev [B, L, H] (target post-norm hidden for step 1, the MTP's own post-norm output of
    the previous step for chained steps), next_tokens [B, L]. kv1=None: step 1 (causal
    attention over its own entries, = mtp_forward with an empty cache); else the step-1
    (k, v) and the earlier chained steps' (k, v) in `extra` (see chain_attend).
    Returns (MTP post-norm hidden [B, L, H], this step's (k, v)).
    """
    import jax
    from mtpjax import model
    B, L = next_tokens.shape
    m, eps = params.mtp, cfg.rms_norm_eps
    x, q, gate, k, v = _mtp_qkv(cfg, params, h_prev, next_tokens, offset)
    if kv1 is None:
        o = chain_attend(q, k, v, [], cfg.head_dim ** -0.5)
    else:
        o = chain_attend(q, kv1[0], kv1[1], list(extra) + [(k, v)], cfg.head_dim ** -0.5)
    o = o.reshape(B, L, gate.shape[-1]) * jax.nn.sigmoid(gate)
    x = x + model.row_parallel(cfg, o, m.layer.attn.o_proj)
    x = x + model.mlp_block(cfg, m.layer.mlp,
                            model.rmsnorm_1p(x, m.layer.post_attention_layernorm, eps))
    return model.rmsnorm_1p(x, m.norm, eps), (k, v)


def mtp_chain(cfg, params, h, tok, n_steps: int):
    """Teacher-forced unroll of the engine's draft chain from every root p.

    h [B, L, H]: target post-norm hidden; tok [B, L + n_steps + 1] the true tokens (t_0...).
    Step s (1-based) at root p sits at position p + s - 1, is fed (step 1) the target's h_p or
    (s > 1) the MTP's own output of step s - 1 for root p, plus the true token p + s, and
    predicts token p + s + 1 (= the engine's draft s). Returns a list of n_steps MTP hidden
    [B, L, H], row p of entry s-1 predicting token p + s + 1.
    """
    L = h.shape[1]
    hm, kv1 = mtp_step(cfg, params, h, tok[:, 1:L + 1], 0)
    outs, extra = [hm], []
    for s in range(2, n_steps + 1):
        hm, kv = mtp_step(cfg, params, hm, tok[:, s:s + L], s - 1, kv1, extra)
        extra.append(kv)
        outs.append(hm)
    return outs


def chain_weights(n_steps: int, decay: float):
    """Loss weight of draft step s: decay^(s-1). A draft s only counts if drafts 1..s-1 were
    accepted, so its value is discounted by the chance of reaching it (~0.6-0.9 per step)."""
    return [decay ** (s - 1) for s in range(1, n_steps + 1)]


def make_loss(cfg, mtp_weight: float, distill: float, compute_dtype: str = "float32",
              chain: int = 1, chain_decay: float = 1.0):
    """Joint loss over tok [B, L+2]; params are float32 masters, cast to compute_dtype inside
    (A_log stays float32), logits and losses in float32.

    MTP term: mtp_weight x sum over draft steps s = 1..chain of w_s [(1 - a) CE(step s,
    token p+s+1) + a CE(step s, sg(target probs at p+s))], w_1 = 1 (see chain_weights), so
    step 1 keeps exactly its old weight and chain = 1 is the original single-step loss (the
    step-1 computation is the same math as model.mtp_forward).
    Roots whose label falls past the window are masked, so later steps see L - s + 1 roots.
    """
    import jax
    import jax.numpy as jnp
    from mtpjax import model
    from mtpjax.api import cast_params
    weights = chain_weights(chain, chain_decay)

    def loss_fn(params, tok):
        B, L2 = tok.shape
        L = L2 - 2
        if compute_dtype != "float32":
            params = cast_params(params, compute_dtype)
        x, y1 = tok[:, :L], tok[:, 1:L + 1]
        seg = model.Segment.full(B, L)
        cache = model.init_cache(cfg, B, L, 1, params.embed.dtype)
        h, cache = model.forward(cfg, params, cache, x, seg, mode="chunk")
        logits = model.lm_head(params, h)                                    # [B, L, V]
        ce_t = _ce(logits, y1)
        teacher = jax.nn.softmax(jax.lax.stop_gradient(logits), axis=-1)    # target at p
        tokp = jnp.concatenate([tok, jnp.zeros((B, chain), tok.dtype)], axis=1)
        rows = jnp.arange(L)
        aux = {}
        mtp_loss = 0.0
        for s, hm in enumerate(mtp_chain(cfg, params, h, tokp, chain), start=1):
            mlog = model.lm_head(params, hm)                                 # [B, L, V]
            label = tokp[:, s + 1:s + 1 + L]                                 # token p+s+1
            hard_mask = (rows <= L - s).astype(jnp.float32)[None]           # label in window
            soft_mask = (rows <= L - 1 - s).astype(jnp.float32)[None]       # target at p+s
            ce = _masked_mean(_ce_rows(mlog, label), hard_mask)
            tch = jnp.pad(teacher[:, s:], ((0, 0), (0, s), (0, 0)))
            soft = _masked_mean(-jnp.sum(tch * jax.nn.log_softmax(mlog, -1), -1), soft_mask)
            mtp_loss = mtp_loss + weights[s - 1] * ((1.0 - distill) * ce + distill * soft)
            am = jnp.argmax(mlog, -1)
            aux[f"ce_m{s}"] = ce
            aux[f"acc_m{s}"] = _masked_mean((am == label).astype(jnp.float32), hard_mask)
            aux[f"agree{s}"] = _masked_mean(
                (am == jnp.pad(jnp.argmax(logits, -1)[:, s:], ((0, 0), (0, s))))
                .astype(jnp.float32), soft_mask)
            if s == 1:
                aux.update(ce_m=ce, soft=soft, acc_m=aux["acc_m1"], agree=aux["agree1"])
        loss = ce_t + mtp_weight * mtp_loss
        acc_t = jnp.mean(jnp.argmax(logits, -1) == y1)
        return loss, dict(loss=loss, ce_t=ce_t, acc_t=acc_t, **aux)
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


def make_eval(cfg, chain: int):
    import jax
    import jax.numpy as jnp
    from mtpjax import model

    @jax.jit
    def ev(params, tok):
        """tok [B, L]: per-row counts of target hits (p -> p+1) and, per draft step s, MTP hits
        (teacher-forced chain from root p -> p+s+1) and agreement with the target's argmax at
        p+s (the teacher-forced greedy acceptance proxy). Roots p <= L-s-2 count for step s."""
        B, L = tok.shape
        h = _hidden(cfg, params, tok)
        tgt = jnp.argmax(model.lm_head(params, h), -1)                     # [B, L] -> p+1
        tokp = jnp.concatenate([tok, jnp.zeros((B, chain + 1), tok.dtype)], axis=1)
        tgtp = jnp.concatenate([tgt, jnp.zeros((B, chain + 1), tgt.dtype)], axis=1)
        rows = jnp.arange(L)[None]
        hit_m, agree = [], []
        for s, hm in enumerate(mtp_chain(cfg, params, h, tokp, chain), start=1):
            mtp = jnp.argmax(model.lm_head(params, hm), -1)                # [B, L] -> p+s+1
            ok = rows <= L - s - 2
            hit_m.append(jnp.sum((mtp == tokp[:, s + 1:s + 1 + L]) & ok, axis=1))
            agree.append(jnp.sum((mtp == tgtp[:, s:s + L]) & ok, axis=1))
        hit_t = jnp.sum(tgt[:, :-1] == tok[:, 1:], axis=1)
        return hit_t, jnp.stack(hit_m, 1), jnp.stack(agree, 1)             # [B], [B, n], [B, n]
    return ev


def heldout_eval(cfg, params, tokens, windows: int, length: int, batch: int = 8,
                 chain: int = 4):
    """Teacher-forced held-out metrics; mtp_acc / accept_proxy are step 1's (as before), the
    *_by_step lists give every chained draft step."""
    import numpy as np
    ev = make_eval(cfg, chain)
    n = min(windows, len(tokens) // length)
    data = tokens[:n * length].reshape(n, length)
    ht, hm, ag = 0, np.zeros(chain, np.int64), np.zeros(chain, np.int64)
    for i in range(0, n, batch):
        rows = data[i:i + batch]
        k = len(rows)
        if k < batch:  # keep one compiled shape; padded rows are not counted
            rows = np.concatenate([rows, np.repeat(rows[:1], batch - k, 0)])
        a, b, c = (np.asarray(x)[:k].sum(0) for x in ev(params, rows))
        ht, hm, ag = ht + int(a), hm + b, ag + c
    denom = [n * (length - s - 1) for s in range(1, chain + 1)]
    mtp_by = [float(x) / d for x, d in zip(hm, denom)]
    agree_by = [float(x) / d for x, d in zip(ag, denom)]
    return dict(heldout_tokens=int(n * length),
                target_acc=ht / (n * (length - 1)),
                mtp_acc=mtp_by[0], accept_proxy=agree_by[0],
                mtp_acc_by_step=mtp_by, accept_proxy_by_step=agree_by)


def distinct_ngram_fraction(rows, n: int = 4) -> float:
    """Mean over rows of (distinct n-grams / n-grams): 1.0 = no repeated n-gram, a model stuck
    in a loop scores near 0. rows: int [B, T] greedy continuations."""
    fr = []
    for r in rows:
        grams = [tuple(r[i:i + n]) for i in range(len(r) - n + 1)]
        if grams:
            fr.append(len(set(grams)) / len(grams))
    return sum(fr) / max(len(fr), 1)


def engine_acceptance(path: str, prompts, n_new: int, ks):
    """Greedy speculative decoding with the real engine (fixed depth K) on held-out prompts.

    For each K: per draft position j the conditional acceptance accepted_j / tried_j (tried_j:
    verify steps that had a real draft j with drafts 1..j-1 accepted), and tokens per verify
    step ((accepted + verify steps) / verify steps). The greedy outputs of every K are compared
    with K's first (speculation must not change greedy text). Returns {K: dict}.
    """
    from mtpjax.engine import Engine
    from mtpjax.sampling import SamplingParams
    res, ref = {}, None
    for k in ks:
        t0 = time.time()
        eng = Engine.from_checkpoint(path, num_speculative_tokens=k)
        outs = eng.generate([[int(t) for t in p] for p in prompts],
                            SamplingParams(temperature=0.0, max_new_tokens=n_new))
        errs = [o.error for o in outs if o.error]
        if errs:
            raise RuntimeError(f"engine K={k}: {errs[0]}")
        acc = [sum(o.stats.accepted_per_position[j] for o in outs) for j in range(k)]
        tried = [sum(o.stats.tried_per_position[j] for o in outs) for j in range(k)]
        vs = sum(o.stats.verify_steps for o in outs)
        acc_tok = sum(o.stats.accepted_tokens for o in outs)
        toks = [list(o.token_ids) for o in outs]
        ref = toks if ref is None else ref
        res[k] = dict(accepted_per_position=acc, tried_per_position=tried,
                      rate_per_position=[a / max(t, 1) for a, t in zip(acc, tried)],
                      verify_steps=vs, accepted_tokens=acc_tok,
                      tokens_per_step=(acc_tok + vs) / max(vs, 1),
                      generated=sum(len(t) for t in toks), same_text_as_first_k=toks == ref,
                      seconds=time.time() - t0)
        print(f"engine K={k}: per-position acceptance "
              f"{[round(r, 3) for r in res[k]['rate_per_position']]} (tried {tried}), "
              f"{res[k]['tokens_per_step']:.3f} tokens/verify step, "
              f"same text as K={ks[0]}: {toks == ref} ({res[k]['seconds']:.0f} s)", flush=True)
    return res


def check_chain_matches_engine(cfg, params, tok, root: int, n_steps: int):
    """Max |difference| between the training unroll (mtp_chain) and the engine's own calls.

    The engine path: model.mtp_forward over the true pairs at positions 0..root into a KV
    cache (what the cache holds after verifying up to root), then n_steps-1 single-position
    mtp_forward calls at root+1, root+2, ... fed the previous MTP output and the true next
    token, as draft_chain does (teacher-forced). tok [1, L + n_steps + 1]."""
    import jax.numpy as jnp
    import numpy as np
    from mtpjax import model
    L = tok.shape[1] - n_steps - 1
    h = _hidden(cfg, params, tok[:, :L])
    outs = mtp_chain(cfg, params, h, tok, n_steps)
    cache = model.init_cache(cfg, 1, L + n_steps, 1, params.embed.dtype)
    hm, cache = model.mtp_forward(cfg, params, cache, h[:, :root + 1], tok[:, 1:root + 2],
                                  model.Segment.full(1, root + 1))
    hm = hm[:, -1:]
    diffs = [float(jnp.max(jnp.abs(hm[:, 0] - outs[0][:, root])))]
    for s in range(2, n_steps + 1):
        seg = model.Segment(jnp.full((1,), root + s - 1, jnp.int32), jnp.ones((1,), jnp.int32))
        hm, cache = model.mtp_forward(cfg, params, cache, hm, tok[:, root + s:root + s + 1], seg)
        diffs.append(float(jnp.max(jnp.abs(hm[:, 0] - outs[s - 1][:, root]))))
    return float(np.max(diffs))


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


def _reproduce(stage1_command: str) -> list[str]:
    """The from-scratch command pair: stage 1 as it was run (into /tmp/tiny_stage1, with
    --mtp_chain=1 since it predates the flag) and this run with --init_from/--out pointed at
    /tmp/tiny_stage1 and checkpoints/tiny (--baseline dropped: it only adds a report column)."""
    def with_paths(cmd: str, **paths) -> str:
        parts = [p for p in shlex.split(cmd)
                 if not any(p.startswith(f"--{k}=") for k in (*paths, "baseline"))]
        return " ".join(shlex.quote(p) for p in parts) + "".join(
            f" --{k}={v}" for k, v in paths.items())
    s1 = with_paths(stage1_command, out="/tmp/tiny_stage1")
    if "--mtp_chain" not in s1:
        s1 += " --mtp_chain=1"
    return [s1, with_paths(_command(), init_from="/tmp/tiny_stage1", out="checkpoints/tiny")]


def _dir_mb(path: str) -> float:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
               if os.path.isfile(os.path.join(path, f))) / 1e6


def _train_lines(m: dict) -> list[str]:
    """Markdown bullets for one training run's train_metrics entry."""
    t = m["train"]
    chain, decay = t.get("mtp_chain", 1), t.get("mtp_chain_decay", 1.0)
    a = t["mtp_distill"]
    mtp = (f"{t['mtp_weight']:g} x [(1 - {a:g}) CE(MTP, t+2) + {a:g} CE(MTP, stop-grad target"
           f" probs at p+1)]")
    if chain > 1:
        mtp = (f"{t['mtp_weight']:g} x sum_(s=1..{chain}) {decay:g}^(s-1) x [(1 - {a:g})"
               f" CE(draft step s, t+s+1) + {a:g} CE(draft step s, stop-grad target probs at p+s)]"
               f" (chained, teacher-forced unroll of the engine's draft chain, see below)")
    lines = [
        f"- command: `{m['command']}`",
        f"- {'continued from ' + t['init_from'] + '; ' if t.get('init_from') else 'from scratch; '}"
        f"{t['steps']} steps x {t['batch']} x {t['seq_len']} tokens = {t['tokens']:,} tokens"
        f" (data seed {t['seed']}); AdamW (b2 0.95, wd {t['weight_decay']}, fresh optimizer"
        f" state), peak lr {t['lr']:g}, warmup {t['warmup_frac']:g} + cosine to"
        f" {t['min_lr_ratio']:g}x, clip {t['clip']:g}",
        f"- loss: CE(target, t+1) + {mtp}",
        f"- training time: {t['seconds']:.0f} s wall ({t['tokens_per_s']:.0f} tokens/s) on"
        f" {m['machine']}{' (' + t['note'] + ')' if t.get('note') else ''}",
    ]
    if t.get("final"):
        f = t["final"]
        lines.append(f"- final train loss {f['loss']:.3f} (target CE {f['ce_t']:.3f}, MTP step-1"
                     f" CE {f['ce_m']:.3f})")
    return lines


def _loss_table(hist: list[dict]) -> list[str]:
    if not hist:
        return []
    chain = max((int(k[5:]) for k in hist[0] if k.startswith("agree") and k[5:].isdigit()),
                default=1)
    head = "| step | loss | target CE | MTP CE | " + " | ".join(
        f"agree s{s}" for s in range(1, chain + 1)) if chain > 1 else \
        "| step | loss | target CE | MTP CE | MTP/target agree"
    lines = [head + " |", "|" + "---|" * (4 + chain)]
    rows = hist[:: max(1, len(hist) // 20)]
    if rows[-1] is not hist[-1]:
        rows.append(hist[-1])
    for r in rows:
        ag = [r.get(f"agree{s}", r["agree"]) for s in range(1, chain + 1)]
        lines.append(f"| {r['step']} | {r['loss']:.3f} | {r['ce_t']:.3f} | {r['ce_m']:.3f} | "
                     + " | ".join(f"{a:.3f}" for a in ag) + " |")
    return lines


def _eval_rows(m: dict) -> list[tuple[str, object]]:
    """(label, value) rows of the held-out and engine evaluation of one checkpoint."""
    ev, g = m["heldout"], m["generation"]
    rows = [("target next-token accuracy (argmax at p == token p+1)", ev["target_acc"]),
            ("MTP t+2 accuracy (step-1 argmax at p == token p+2)", ev["mtp_acc"]),
            ("greedy acceptance proxy, step 1 (MTP argmax at p == target argmax at p+1)",
             ev["accept_proxy"])]
    for s, (a, p) in enumerate(zip(ev.get("mtp_acc_by_step", [])[1:],
                                   ev.get("accept_proxy_by_step", [])[1:]), start=2):
        rows.append((f"teacher-forced draft step {s}: accuracy (== token p+{s + 1}) / agreement"
                     f" with target argmax at p+{s}", f"{a:.3f} / {p:.3f}"))
    rows.append(("first-draft acceptance, target decoding greedily (step-by-step cache)",
                 g["accept"]))
    if "distinct4" in g:
        rows.append((f"distinct 4-gram fraction of the greedy continuations (1 = no repeats)",
                     g["distinct4"]))
    for k, e in sorted(m.get("engine", {}).items(), key=lambda kv: int(kv[0])):
        rates = " / ".join(f"{r:.3f}" for r in e["rate_per_position"])
        rows.append((f"engine K={k}: acceptance by draft position 1..{k} (accepted/tried)",
                     rates))
        rows.append((f"engine K={k}: tokens per verify step", e["tokens_per_step"]))
    return rows


def _fmt(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def write_report(out: str, metrics: dict, baseline: dict | None = None):
    """train_metrics.json + TRAINING.md; baseline (another checkpoint's metrics, evaluated
    the same way) adds a comparison column."""
    with open(os.path.join(out, "train_metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
        f.write("\n")
    m, c = metrics, metrics["config"]
    ev = m["heldout"]
    stage1 = m.get("stage1")
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
    ]
    if stage1:
        lines += ["### Stage 1 (from scratch)", ""] + _train_lines(stage1) + [
            "", "### Stage 2 (continuation, chained MTP loss)", ""] + _train_lines(m)
        lines += ["", "Reproduce from scratch (the tokenizer is trained in stage 1 and reused by"
                  " stage 2 through --init_from; stage 1 predates --mtp_chain, whose default is"
                  " now 4, hence `--mtp_chain=1`):", "", "```"]
        lines += [m["reproduce"][0], m["reproduce"][1], "```"]
    else:
        lines += _train_lines(m)
    lines += [
        "",
        "Chained drafts: the engine (mtpjax/steps.py `draft_chain`) drafts d_1 from the pair"
        " (target h_P, token P+1) at position P, then each step s > 1 feeds the MTP its own"
        " post-norm output of step s-1 and the previous draft at position P+s-1, writing its"
        " KV there and attending the MTP KV of positions <= P (true pairs) plus the chained"
        " entries of this draft round. `mtp_chain` in train_tiny.py unrolls exactly this for"
        " every root P at once (row P of step s sits at position P+s-1; its attention sees the"
        " step-1 KV at positions <= P plus its own round's chained K/V), with one difference:"
        " teacher forcing, i.e. step s is fed the true token P+s instead of the previous draft"
        " (identical whenever drafts 1..s-1 are accepted, the only case in which draft s counts)."
        f" Check: training unroll vs the engine's own mtp_forward calls on a cache, max |diff| of"
        f" the MTP hidden {m.get('chain_check', float('nan')):.1e}.",
        "",
        "## Evaluation (the saved BF16 checkpoint, reloaded as float32)",
        "",
        f"Teacher-forced rows: over {ev['heldout_tokens']:,} held-out tokens ({m['eval']['windows']}"
        f" windows of {m['eval']['len']}). Generation rows: {m['generation']['prompts']} held-out"
        f" prompts of {m['generation']['prompt_len']} tokens (document starts), greedy, up to"
        f" {m['generation']['new_tokens']} new tokens; engine rows use"
        " `Engine.from_checkpoint(path, num_speculative_tokens=K)` (fixed depth K), acceptance of"
        " position j = verify steps that accepted draft j / steps that verified a real draft j"
        " with drafts 1..j-1 accepted; tokens per verify step = (accepted + steps) / steps.",
        "",
    ]
    rows = _eval_rows(m)
    if baseline is not None:
        old = dict(_eval_rows(baseline))
        before = "stage 1 only (previous checkpoint)" if stage1 else baseline.get("label", "baseline")
        lines += [f"| metric | {before} | this checkpoint |",
                  "|---|---|---|"]
        lines += [f"| {k} | {_fmt(old.get(k, '-'))} | {_fmt(v)} |" for k, v in rows]
    else:
        lines += ["| metric | value |", "|---|---|"] + [f"| {k} | {_fmt(v)} |" for k, v in rows]
    lines += [
        "",
        f"Check: the stock library path (jax.scipy `solve_triangular` in the chunked GDN) and the",
        f"fast exact solve used for training/eval (see experiments/train_tiny.py) give logits within"
        f" {m['solve_check']['max_abs_logit_diff']:.1e} of each other on a held-out window"
        f" (argmax agreement {m['solve_check']['argmax_agree']:.3f}).",
    ]
    if m["generation"].get("sample"):
        lines += ["", "## Greedy sample (held-out prompt, then the model's greedy continuation)",
                  "", "```python", m["generation"]["sample"].rstrip(), "```"]
        if baseline is not None and baseline["generation"].get("sample"):
            lines += ["", "Before, same prompt:", "", "```python",
                      baseline["generation"]["sample"].rstrip(), "```"]
    lines += ["", "Reproduce: run the command(s) above (about the same time on the same CPU); the",
              "result is deterministic given the seed up to floating-point reduction order."]
    if stage1 and stage1.get("loss_history"):
        lines += ["", "## Loss curve, stage 1", ""] + _loss_table(stage1["loss_history"])
    if m.get("loss_history"):
        lines += ["", f"## Loss curve{', stage 2' if stage1 else ''} (every log step)", ""]
        lines += _loss_table(m["loss_history"])
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
    elif FLAGS.tokenizer or FLAGS.init_from:
        tok = Tokenizer.from_file(FLAGS.tokenizer or os.path.join(FLAGS.init_from, "tokenizer.json"))
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
        if FLAGS.init_from:
            cfg, params = mtpjax.load_checkpoint(FLAGS.init_from)   # float32 masters
            if set(cfg.eos_token_ids) != set(eos):
                raise ValueError(f"{FLAGS.init_from} stops on {cfg.eos_token_ids}, the "
                                 f"tokenizer's specials are {eos}")
            print(f"continuing from {FLAGS.init_from}", flush=True)
        else:
            params = init_train_params(cfg, FLAGS.seed)
        n_params = count_params(params)
        print(f"model: {n_params:,} params, layers {cfg.layer_types[:cfg.layer_period]} x "
              f"{cfg.num_layers // cfg.layer_period}", flush=True)
        opt, sched = make_optimizer(FLAGS.steps)
        opt_state = opt.init(params)
        loss_fn = make_loss(cfg, FLAGS.mtp_weight, FLAGS.mtp_distill, FLAGS.compute_dtype,
                            FLAGS.mtp_chain, FLAGS.mtp_chain_decay)

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
                      f"acc_m {avg['acc_m']:.3f} agree " + "/".join(
                          f"{avg[f'agree{s}']:.3f}" for s in range(1, FLAGS.mtp_chain + 1)) +
                      f" "
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
            mtp_chain=FLAGS.mtp_chain, mtp_chain_decay=FLAGS.mtp_chain_decay,
            init_from=FLAGS.init_from,
            tokens_per_s=(FLAGS.steps - 1) * FLAGS.batch * FLAGS.seq_len
            / max(time.time() - t_first, 1e-9),
            final=history[-1] if history else {})

        gen_cfg = {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": list(eos),
                   "pad_token_id": ids["<|endoftext|>"], "max_new_tokens": 256,
                   # the recommended sampling (servers and `generate` default to it; see
                   # mtpjax/generation_config.py): greedy decoding of this small model loops
                   "do_sample": True, "temperature": 0.8, "top_p": 0.95, "top_k": 40,
                   "repetition_penalty": 1.05}
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
    n_chk = max(FLAGS.eval_chain, 2)
    chain_check = check_chain_matches_engine(
        cfg2, params, jnp.asarray(held_tok[None, :64 + n_chk + 1]), 40, n_chk)
    print(f"training chain unroll vs engine mtp_forward calls: max |diff| {chain_check:.2e}",
          flush=True)
    ev = heldout_eval(cfg2, params, held_tok, FLAGS.eval_windows, FLAGS.eval_len,
                      chain=FLAGS.eval_chain)
    print(f"held-out: target acc {ev['target_acc']:.3f}, MTP acc by step "
          f"{[round(x, 3) for x in ev['mtp_acc_by_step']]}, acceptance proxy by step "
          f"{[round(x, 3) for x in ev['accept_proxy_by_step']]} ({time.time() - t0:.1f} s)",
          flush=True)
    # prompts: starts of held-out documents (after an <|endoftext|>), skipping the eval windows
    eot = ids["<|endoftext|>"]
    starts = [i for i in np.nonzero(held_tok == eot)[0]
              if i + FLAGS.gen_prompt_len < len(held_tok)]
    step_ = max(1, len(starts) // max(FLAGS.gen_prompts, 1))
    starts = starts[::step_][:FLAGS.gen_prompts]
    prompts = np.stack([held_tok[s:s + FLAGS.gen_prompt_len] for s in starts])
    t0 = time.time()
    gen_acc, gen = greedy_generation_accept(cfg2, params, prompts, FLAGS.gen_new)
    distinct4 = distinct_ngram_fraction(gen.tolist(), 4)
    sample = tok.decode(list(prompts[0]) + list(gen[0]), skip_special_tokens=False)
    print(f"greedy generation: first-draft acceptance {gen_acc:.3f}, distinct 4-grams "
          f"{distinct4:.3f} ({len(prompts)} x {FLAGS.gen_new} tokens, {time.time() - t0:.1f} s)\n"
          f"--- sample ---\n{sample}\n--------------", flush=True)
    ks = [int(k) for k in FLAGS.engine_k]
    engine = {str(k): v for k, v in engine_acceptance(out, prompts, FLAGS.gen_new, ks).items()}
    fast_ctx.__exit__(None, None, None)

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
        if FLAGS.init_from:
            s1 = json.load(open(os.path.join(FLAGS.init_from, "train_metrics.json")))
            metrics["stage1"] = {k: s1[k] for k in ("command", "machine", "train", "loss_history")
                                 if k in s1}
            metrics["reproduce"] = _reproduce(s1["command"])
    metrics["heldout"] = ev
    metrics["solve_check"] = solve_check
    metrics["eval"] = dict(windows=FLAGS.eval_windows, len=FLAGS.eval_len)
    metrics["generation"] = dict(prompts=len(prompts), prompt_len=FLAGS.gen_prompt_len,
                                 new_tokens=FLAGS.gen_new, accept=gen_acc, distinct4=distinct4,
                                 sample=sample)
    metrics["engine"] = engine
    metrics["chain_check"] = chain_check
    metrics["label"] = os.path.normpath(out)
    baseline = json.load(open(FLAGS.baseline)) if FLAGS.baseline else None
    metrics["disk_mb"] = _dir_mb(out) + 0.01  # + the report files themselves (small)
    write_report(out, metrics, baseline)
    metrics["disk_mb"] = _dir_mb(out)
    write_report(out, metrics, baseline)
    print(f"wrote {out}/TRAINING.md and train_metrics.json; total {time.time() - t_start:.0f} s",
          flush=True)
