"""Path equivalences through the cache (float32): full forward == prefill n + k one-token steps
== prefill n + one (k+1)-token step; ragged lanes (right padding) equal their unpadded runs."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtpjax import model
from mtpjax.config import Config
from mtpjax.params import init_params

CFG = Config(vocab_size=61, hidden_size=32, intermediate_size=40,
             layer_types=("linear_attention", "linear_attention", "full_attention") * 2,
             num_attention_heads=4, num_key_value_heads=1, head_dim=16, rope_theta=10000.0,
             partial_rotary_factor=0.5, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
             tie_word_embeddings=True, mtp_num_hidden_layers=1)
PARAMS = init_params(CFG, jax.random.key(0), "float32", scale=0.1)


def close(a, b):
    """float32 agreement, relative to the logit scale (paths differ in summation order only)."""
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4,
                               atol=1e-4 * float(np.abs(np.asarray(b)).max()))


@partial(jax.jit, static_argnames=("mode",))
def run(cache, tokens, start, n_valid, mode):
    h, cache = model.forward(CFG, PARAMS, cache, tokens, model.Segment(start, n_valid), mode)
    return model.lm_head(PARAMS, h), cache


def full_logits(tokens):
    B, T = tokens.shape
    cache = model.init_cache(CFG, B, T, 1)
    return run(cache, tokens, jnp.zeros(B, jnp.int32), jnp.full(B, T, jnp.int32), "chunk")[0]


@pytest.mark.parametrize("n,k", [(5, 1), (66, 3), (64, 2)])
def test_prefill_then_steps_equals_full_forward(n, k):
    B = 2
    tokens = jnp.asarray(np.random.default_rng(n).integers(0, CFG.vocab_size, (B, n + k + 1)))
    more = jnp.asarray(np.random.default_rng(9).integers(0, CFG.vocab_size, (B, 1)))
    L = n + k + 1
    # one full forward over the L tokens and the one after them: its first L positions are
    # the reference of the L tokens (causal), its last the reference of the token after
    full = full_logits(jnp.concatenate([tokens, more], 1))
    ref, ref2 = full[:, :L], full[:, L:]
    z = jnp.zeros(B, jnp.int32)

    # prefill n, then k+1 one-token steps
    cache = model.init_cache(CFG, B, L + 1, num_pending=k + 1)
    logits, cache = run(cache, tokens[:, :n], z, jnp.full(B, n, jnp.int32), "chunk")
    outs = [logits]
    for i in range(k + 1):
        lg, cache = run(cache, tokens[:, n + i:n + i + 1], z + n + i, z + 1, "step")
        outs.append(lg)
    stepped = jnp.concatenate(outs, axis=1)
    close(stepped, ref)

    # prefill n, then one (k+1)-token verify-shaped step
    cache = model.init_cache(CFG, B, L + 1, num_pending=k + 1)
    logits, cache = run(cache, tokens[:, :n], z, jnp.full(B, n, jnp.int32), "chunk")
    lg, cache = run(cache, tokens[:, n:], z + n, z + k + 1, "step")
    close(jnp.concatenate([logits, lg], 1), ref)
    # and one more token after it (the pending block is replayed in full)
    lg2, _ = run(cache, more, z + L, z + 1, "step")
    close(lg2, ref2)


def test_ragged_lanes_match_unpadded_runs():
    """Right-padded lanes of different lengths give each lane's own logits; padding is inert."""
    rng = np.random.default_rng(5)
    lens = [3, 70, 17]
    T = 72
    tokens = rng.integers(0, CFG.vocab_size, (3, T))
    cache = model.init_cache(CFG, 3, T + 4, num_pending=2)
    z = jnp.zeros(3, jnp.int32)
    logits, cache = run(cache, jnp.asarray(tokens), z, jnp.asarray(lens, jnp.int32), "chunk")
    nxt = rng.integers(0, CFG.vocab_size, (3, 2))
    lg2, _ = run(cache, jnp.asarray(nxt), jnp.asarray(lens, jnp.int32), z + 2, "step")
    for b, n in enumerate(lens):
        seq = np.concatenate([tokens[b, :n], nxt[b]])[None]
        ref = full_logits(jnp.asarray(seq))
        close(logits[b, :n], ref[0, :n])
        close(lg2[b], ref[0, n:])


def test_rollback_after_rejection_equals_plain_decoding():
    """Verify 3 tokens, accept only the first (n_pend = 1); continuing equals plain decoding of
    the accepted tokens only: the rejected ones leave no trace in GDN or KV state."""
    B, n = 2, 9
    rng = np.random.default_rng(11)
    prompt = jnp.asarray(rng.integers(0, CFG.vocab_size, (B, n)))
    block = jnp.asarray(rng.integers(0, CFG.vocab_size, (B, 3)))
    nxt = jnp.asarray(rng.integers(0, CFG.vocab_size, (B, 1)))
    z = jnp.zeros(B, jnp.int32)
    cache = model.init_cache(CFG, B, n + 8, num_pending=3)
    _, cache = run(cache, prompt, z, z + n, "chunk")
    _, cache = run(cache, block, z + n, z + 3, "step")
    import dataclasses
    cache = dataclasses.replace(cache, n_pend=jnp.asarray([1, 2], jnp.int32))  # lane 0 keeps 1, lane 1 keeps 2
    lg, _ = run(cache, nxt, jnp.asarray([n + 1, n + 2], jnp.int32), z + 1, "step")
    for b, keep in enumerate([1, 2]):
        seq = jnp.concatenate([prompt[b], block[b, :keep], nxt[b]])[None]
        ref = full_logits(seq)[0, -1]
        close(lg[b, 0], ref)
