"""Whole-step programs: each engine step is ONE jitted pure function, caches donated.

This is JAX's analogue of CUDA graphs: the host launches one XLA program per step and reads
back only the emitted tokens. Nothing inside a step waits for the host.

`prefill_chunk` (one lane, one chunk of its prompt):
  target forward over the chunk (chunked GDN) -> MTP over the chunk's aligned pairs, which
  fills the MTP KV cache at every prompt position (spec §5.3) -> on the last chunk: sample the
  first token at position N, then draft d_1..d_k with the MTP.

`decode_step` (every lane; k drafts, k = 0 is the stock engine; an engine that drafts K can
run a step with k = 0 drafts verified, see "per-step speculation depth" below):
  1. target forward over [t_P, d_1..d_k] at positions P..P+k (GDN: replay the previous step's
     accepted tokens, run the block; KV: write k+1 entries)
  2. sampling.verify: the target token at every position, drawn with the key of
     (seed, position), accepted while it equals the draft -> a accepted, token c at P+a+1
  3. rollback: n_pend = a + 1 (GDN replays only the accepted prefix next step; KV entries past
     P+a are dead and get overwritten)
  4. MTP re-run over the accepted positions P..P+a with the TRUE target hidden states
     (overwriting the MTP KV written while drafting), then k-1 chained MTP steps -> next drafts

KV lives in the paged pool (model.PagedKV); every program takes the page table of the lanes it
runs (i32[B, pages_per_lane], the same for all layers and the MTP) and the host must have
allocated the pages of every position it writes (kv_pool.tokens_touched_*). GDN state stays in
per-lane slots of the cache.

Per-step speculation depth. The cache and LaneState are sized for the engine's K drafts
(P = K + 1 pending slots, drafts [B, K]); a step may verify k = K or k = 0 of them. With k = 0
and K > 0 the step still runs the MTP over the accepted pair at P (so the MTP KV stays filled
with true hidden states for every committed position: the invariant that makes switching back
to k = K safe) and makes d_1 from it; d_2..d_K are left 0 and the chain is skipped, which only
costs acceptance on the first K-step after a switch. Output is lossless either way: sampling
keys depend on (seed, position) only.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from mtpjax import model, sampling
from mtpjax.config import Config
from mtpjax.model import Cache, Segment
from mtpjax.params import Params


@partial(jax.tree_util.register_dataclass, data_fields=["last_token", "pos", "drafts"],
         meta_fields=[])
@dataclasses.dataclass(frozen=True)
class LaneState:
    """What each lane carries between steps (device arrays, B = lanes)."""
    last_token: jax.Array  # i32[B]  t_P: committed (emitted) but not yet fed to the target
    pos: jax.Array         # i32[B]  P, the absolute position of last_token
    drafts: jax.Array      # i32[B, k]  MTP drafts for positions P+1..P+k

    @staticmethod
    def empty(lanes: int, k: int) -> "LaneState":
        z = lambda *shape: jnp.zeros(shape, jnp.int32)  # distinct buffers: all are donated
        return LaneState(z(lanes), z(lanes), z(lanes, k))


# ---- lane slicing: the per-lane GDN slots move, the shared KV pool does not ----

def lane_take(cache: Cache, lane) -> Cache:
    """One lane's view of the cache: its GDN slot and n_pend; the (paged) KV pool whole."""
    if not isinstance(cache.full, model.PagedKV):
        raise TypeError("engine programs expect a paged KV pool (model.init_paged_cache)")
    take = lambda a, axis: lax.dynamic_slice_in_dim(a, lane, 1, axis=axis)
    return dataclasses.replace(cache, linear=jax.tree.map(lambda a: take(a, 1), cache.linear),
                               n_pend=take(cache.n_pend, 0))


def lane_put(cache: Cache, lane, sub: Cache) -> Cache:
    put = lambda a, s, axis: lax.dynamic_update_slice_in_dim(a, s, lane, axis=axis)
    return dataclasses.replace(
        sub, linear=jax.tree.map(lambda a, s: put(a, s, 1), cache.linear, sub.linear),
        n_pend=put(cache.n_pend, sub.n_pend, 0))


def _reset_recurrent(c: Cache) -> Cache:
    """A fresh sequence: zero GDN state, conv history and pending buffer (KV is masked)."""
    lin = jax.tree.map(jnp.zeros_like, c.linear)
    return dataclasses.replace(c, linear=lin, n_pend=jnp.zeros_like(c.n_pend))


def _argmax_tokens(params, h):
    return jnp.argmax(model.lm_head(params, h), axis=-1).astype(jnp.int32)


def draft_chain(cfg: Config, params: Params, cache: Cache, h_mtp, d1, pos, live, table,
                k: int, kernels: str):
    """Drafts d_1..d_k: d_1 given, then k-1 chained MTP steps (spec §5.4).

    h_mtp [B, H]: the MTP output of the pair at `pos` (which predicted d_1 at pos + 2).
    Each chained step feeds the MTP its own output and the previous draft, one position on.
    live: bool[B]; idle lanes write nothing. table: the lanes' page table.
    """
    drafts = [d1]
    h, tok = h_mtp, d1
    ones = live.astype(jnp.int32)
    for s in range(1, k):
        h3, cache = model.mtp_forward(cfg, params, cache, h[:, None], tok[:, None],
                                      Segment(pos + s, ones, table), kernels)
        h = h3[:, 0]
        tok = _argmax_tokens(params, h)
        drafts.append(tok)
    return jnp.stack(drafts, axis=1), cache


@partial(jax.jit, static_argnames=("cfg", "k", "kernels"), donate_argnames=("cache", "state"))
def prefill_chunk(cfg: Config, params: Params, cache: Cache, state: LaneState,
                  lanes: sampling.LaneSampling, lane, tokens, next_tokens, start, n_valid,
                  is_last, page_table, *, k: int, kernels: str):
    """Prefill one chunk of one lane's prompt.

    tokens, next_tokens: i32[1, Tc] (next_tokens[t] = prompt[start + t + 1]; its entry at
    n_valid-1 is replaced by the sampled first token on the last chunk). start, n_valid,
    lane: i32 scalars; is_last: bool scalar; page_table: i32[1, pages_per_lane], this lane's.
    Pages must cover positions [0, start + n_valid + (k - 1 on the last chunk)).
    Returns (cache, state, first_token i32[]), first_token meaningful on the last chunk.
    """
    sub = lane_take(cache, lane)
    sub = lax.cond(start == 0, _reset_recurrent, lambda c: c, sub)
    seg = Segment(start[None], n_valid[None], page_table)
    h, sub = model.forward(cfg, params, sub, tokens, seg, "chunk", kernels)
    last = n_valid - 1
    h_last = lax.dynamic_index_in_dim(h, last, axis=1, keepdims=False)     # [1, H]
    lane_s = jax.tree.map(lambda a: lax.dynamic_slice_in_dim(a, lane, 1), lanes)
    first = sampling.sample(model.lm_head(params, h_last), lane_s, (start + n_valid)[None])

    if k > 0:
        nt = jnp.where(is_last & (jnp.arange(tokens.shape[1]) == last)[None], first[:, None],
                       next_tokens)
        h_mtp, sub = model.mtp_forward(cfg, params, sub, h, nt, seg, kernels)
        hm_last = lax.dynamic_index_in_dim(h_mtp, last, axis=1, keepdims=False)
        d1 = _argmax_tokens(params, hm_last)
        drafts, sub = draft_chain(cfg, params, sub, hm_last, d1, start[None] + last,
                                  jnp.ones((1,), bool), page_table, k, kernels)
    else:
        drafts = jnp.zeros((1, 0), jnp.int32)

    cache = lane_put(cache, lane, sub)
    new = LaneState(first, (start + n_valid)[None], drafts)
    state = jax.tree.map(
        lambda a, b: jnp.where(is_last, lax.dynamic_update_slice_in_dim(a, b, lane, 0), a),
        state, new)
    return cache, state, first[0]


@partial(jax.jit, static_argnames=("cfg", "k", "kernels"), donate_argnames=("cache", "state"))
def decode_step(cfg: Config, params: Params, cache: Cache, state: LaneState,
                lanes: sampling.LaneSampling, active, page_table, *, k: int, kernels: str):
    """One decode (k = 0) or draft-verify-accept-rollback-redraft step for every lane.

    k: drafts verified this step, K (= state.drafts.shape[1], what the cache is sized for) or 0.
    active: bool[B]; idle lanes run as padding (n_valid 0) and keep their state.
    page_table: i32[B, pages_per_lane]; an active lane at position P needs pages for positions
    [0, kv_pool.tokens_touched_decode(P, k, K)).
    Returns (cache, state, tokens i32[B, k+1] (-1 past the emitted ones), n_accepted i32[B]).
    """
    B, K = state.drafts.shape
    if k not in (0, K):
        raise ValueError(f"a step verifies 0 or all {K} drafts, got k={k}")
    if K + 1 > cache.num_pending_slots:
        raise ValueError(f"{K} drafts need {K + 1} pending slots, cache has "
                         f"{cache.num_pending_slots}")
    drafts_in = state.drafts[:, :k]
    tokens = jnp.concatenate([state.last_token[:, None], drafts_in], axis=1)     # [B, k+1]
    n_in = jnp.where(active, k + 1, 0).astype(jnp.int32)
    h, cache = model.forward(cfg, params, cache, tokens, Segment(state.pos, n_in, page_table),
                             "step", kernels)
    logits = model.lm_head(params, h)                                            # [B, k+1, V]
    n_acc, out = sampling.verify(logits, drafts_in, lanes, state.pos + 1)
    n_acc = jnp.where(active, n_acc, 0)
    cache = dataclasses.replace(cache, n_pend=jnp.where(active, n_acc + 1, 0))
    rows = jnp.arange(B)
    new_last = jnp.where(active, out[rows, n_acc], state.last_token)
    new_pos = jnp.where(active, state.pos + n_acc + 1, state.pos)

    if K > 0:
        nt = jnp.maximum(out, 0)
        h_mtp, cache = model.mtp_forward(
            cfg, params, cache, h, nt,
            Segment(state.pos, jnp.where(active, n_acc + 1, 0), page_table), kernels)
        hm_last = h_mtp[rows, n_acc]
        d1 = _argmax_tokens(params, hm_last)
        if k > 0:
            drafts, cache = draft_chain(cfg, params, cache, hm_last, d1, state.pos + n_acc,
                                        active, page_table, K, kernels)
        else:  # MTP kept warm; d_2..d_K are re-made by the next K-step
            drafts = jnp.zeros((B, K), jnp.int32).at[:, 0].set(d1)
        drafts = jnp.where(active[:, None], drafts, state.drafts)
    else:
        drafts = state.drafts
    out = jnp.where(active[:, None], out, -1)
    return cache, LaneState(new_last, new_pos, drafts), out, n_acc
