"""GDN snapshots on the device: the prefix cache's saved recurrent state, and the programs
that save a lane's state into a slot and restore a slot into a lane.

A snapshot is what a Gated DeltaNet layer carries past a prefix: its recurrent state
[NV, DK, DV] (float32) and its conv tail, the last KC-1 raw pre-conv inputs [KC-1, CONV].
It is taken right after a prefill chunk that ends at a cache boundary: then no token is
pending (a prefill chunk commits everything, model.gdn_block "chunk"), so the conv tail is
rows [0, KC-1) of the lane's conv buffer. Restoring writes them back and sets the lane's
pending count to 0: the next prefill chunk, starting at the boundary, continues exactly as
if the lane had prefilled the prefix itself.

An MTP model's snapshot also keeps h(L-1), the target's post-norm hidden state at the
boundary's last position (`Cache.mtp_h`, kept by the prefill chunk). The MTP KV at L-1 is made
from h(L-1) and the embedding of token L (spec §5.3), so a cached prefix [0, L) serves a
request whose token L differs from the one its entry was prefilled with only after that one
position is rewritten: the restore then copies the entry's last page into the lane's own page
(copy on write: the cached page stays as it is for the requests it serves) and writes the MTP
KV at L-1 there from h(L-1) and the request's token L (`Rewrite`).

Both programs are jitted with the cache and the store donated: they read and write one lane
and one slot in place (at 27B: 48 layers x 48 heads x 128 x 128 x 4 B = 151 MB per snapshot,
plus 48 x 3 x 10240 conv entries). Under tensor parallelism the store is sharded like the
GDN state (by value head, conv by channel), so each device copies only its shard.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from mtpjax import model
from mtpjax import tensor_parallel as tp
from mtpjax.config import FULL, Config
from pallas_kernels import page_copy


@partial(jax.tree_util.register_dataclass, data_fields=["conv", "state", "h"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Snapshots:
    """S snapshot slots for every GDN layer (model order), and the MTP's hidden state."""
    conv: tuple     # per GDN layer: [S, KC-1, CONV] (cache dtype)
    state: tuple    # per GDN layer: [S, NV, DK, DV] float32
    h: jax.Array | None = None   # [S, H] (cache dtype): h(L-1), MTP models only

    @property
    def num_slots(self) -> int:
        return self.state[0].shape[0] if self.state else 0


@partial(jax.tree_util.register_dataclass, data_fields=["on", "src", "dst", "token", "pos"],
         meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Rewrite:
    """A restore's MTP KV rewrite (i32 scalars): when `on`, copy page src into page dst
    (every KV layer) and write the MTP KV at position pos (= L-1, in page dst) from the
    snapshot's h(L-1) and `token` (the request's token L). Off: nothing changes."""
    on: jax.Array
    src: jax.Array
    dst: jax.Array
    token: jax.Array
    pos: jax.Array

    @staticmethod
    def make(fix: tuple[int, int, int, int] | None) -> "Rewrite":
        """From the scheduler's (src, dst, token, pos), or None (off)."""
        on, (src, dst, token, pos) = (0, (0, 0, 0, 0)) if fix is None else (1, fix)
        return Rewrite(*(jnp.int32(x) for x in (on, src, dst, token, pos)))


def _specs(snaps: Snapshots) -> Snapshots:
    return Snapshots(conv=tuple(P(None, None, tp.TP_AXIS) for _ in snaps.conv),
                     state=tuple(P(None, tp.TP_AXIS) for _ in snaps.state),
                     h=None if snaps.h is None else P())


def init_snapshots(cfg: Config, mesh, num_slots: int, dtype) -> Snapshots:
    """An empty store of num_slots snapshots, created shard by shard on the mesh."""
    def make(c: Config) -> Snapshots:
        n = sum(1 for t in c.layer_types if t != FULL)
        kc = c.linear_conv_kernel_dim - 1
        return Snapshots(
            conv=tuple(jnp.zeros((num_slots, kc, c.conv_dim), dtype) for _ in range(n)),
            state=tuple(jnp.zeros((num_slots, c.linear_num_value_heads, c.linear_key_head_dim,
                                   c.linear_value_head_dim), jnp.float32) for _ in range(n)),
            h=jnp.zeros((num_slots, c.hidden_size), dtype) if c.has_mtp else None)
    if mesh is None:
        return make(cfg)
    local = tp.shard_config(cfg, tp.mesh_tp(mesh))
    fn = lambda: make(local)
    return jax.jit(tp.spmd(fn, mesh, (), _specs(jax.eval_shape(fn))))()


def snapshot_bytes(cfg: Config, dtype) -> int:
    """Bytes of one snapshot (all GDN layers, all shards; the MTP's hidden state)."""
    n = sum(1 for t in cfg.layer_types if t != FULL)
    kc = cfg.linear_conv_kernel_dim - 1
    state = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    item = jnp.dtype(dtype).itemsize
    return n * (state + kc * cfg.conv_dim * item) + (cfg.hidden_size * item if cfg.has_mtp
                                                     else 0)


def _on_mesh(body, mesh, cache, snaps, *rest):
    if mesh is None:
        return body(cache, snaps, *rest)
    cs, ss = tp.cache_specs(cache), _specs(snaps)
    return tp.spmd(body, mesh, (cs, ss) + (P(),) * len(rest), (cs, ss))(cache, snaps, *rest)


@partial(jax.jit, static_argnames=("mesh",), donate_argnames=("cache", "snaps"))
def save(cache: model.Cache, snaps: Snapshots, lane, slot, *, mesh=None):
    """Copy lane's GDN state and conv tail (and its kept hidden state) into snapshot slot
    `slot` (i32 scalars). The lane must have no pending tokens (it has just run a prefill
    chunk)."""
    def body(cache, snaps, lane, slot):
        kc = snaps.conv[0].shape[1] if snaps.conv else 0
        conv, state = [], []
        for c, sc, ss in zip(cache.gdn, snaps.conv, snaps.state):
            tail = lax.dynamic_slice_in_dim(c.conv, lane, 1)[:, :kc]
            conv.append(lax.dynamic_update_slice_in_dim(sc, tail, slot, 0))
            state.append(lax.dynamic_update_slice_in_dim(
                ss, lax.dynamic_slice_in_dim(c.state, lane, 1), slot, 0))
        h = snaps.h
        if h is not None and cache.mtp_h is not None:
            h = lax.dynamic_update_slice_in_dim(
                h, lax.dynamic_slice_in_dim(cache.mtp_h, lane, 1).astype(h.dtype), slot, 0)
        return cache, Snapshots(tuple(conv), tuple(state), h)
    return _on_mesh(body, mesh, cache, snaps, lane, slot)


@partial(jax.jit, static_argnames=("cfg", "rewrite", "mesh", "kernels"),
         donate_argnames=("cache", "snaps"))
def restore(cfg: Config, params, cache: model.Cache, snaps: Snapshots, lane, slot,
            fix: Rewrite, *, rewrite: bool = False, mesh=None, kernels: str = "reference"):
    """Write snapshot `slot` into lane's GDN state and conv tail, with nothing pending: the
    lane continues as if it had prefilled the snapshot's prefix itself. rewrite: the engine
    drafts (its prefix entries carry MTP KV); then, with `fix` on (a hit whose token L differs
    from its entry's), also the copy on write of the last cached page and the MTP KV
    rewrite at L-1 (module docstring). kernels: "pallas" / "interpret" copy the page in
    every KV pool with one kernel (pallas_kernels/page_copy.py), "reference" per pool."""
    def body(cfg, params, cache, snaps, lane, slot, fix):
        gdn = iter(zip(snaps.conv, snaps.state))
        layers = []
        for c in cache.layers:
            if isinstance(c, model.GdnCache):
                sc, ss = next(gdn)
                tail = lax.dynamic_slice_in_dim(sc, slot, 1)
                conv = lax.dynamic_update_slice(c.conv, tail.astype(c.conv.dtype),
                                                (lane, 0, 0))
                state = lax.dynamic_update_slice_in_dim(
                    c.state, lax.dynamic_slice_in_dim(ss, slot, 1), lane, 0)
                c = dataclasses.replace(c, conv=conv, state=state)
            layers.append(c)
        n_pend = lax.dynamic_update_slice_in_dim(cache.n_pend, jnp.zeros((1,), jnp.int32),
                                                 lane, 0)
        cache = dataclasses.replace(cache, layers=tuple(layers), n_pend=n_pend)
        if rewrite:
            cache = _rewrite_mtp_kv(cfg, params, cache, lax.dynamic_slice_in_dim(
                snaps.h, slot, 1), fix, kernels)
        return cache, snaps
    if mesh is None:
        return body(cfg, params, cache, snaps, lane, slot, fix)
    cs, ss = tp.cache_specs(cache), _specs(snaps)
    return tp.on_mesh(body, cfg, mesh, params, cache, snaps, lane, slot, fix, n_out=2,
                      rest_specs=(ss, P(), P(), P()), out_specs=(cs, ss))


def _rewrite_mtp_kv(cfg: Config, params, cache: model.Cache, h, fix: Rewrite,
                    kernels: str = "reference") -> model.Cache:
    """Copy page fix.src into fix.dst in every KV layer, then write the MTP KV of the pair
    (h [1, H] = h(L-1), fix.token) at fix.pos in page dst; off, both are identities on page
    0 (rewritten with itself) and the MTP projection is skipped (a branch over the two new
    rows only: its weights, ~250 MB at 27B, are read only by a rewrite). One program
    whatever the hit: no new key."""
    on = fix.on > 0
    src, dst = jnp.where(on, fix.src, 0), jnp.where(on, fix.dst, 0)
    pools = []                           # every KV layer's K and V, in map_kv's order
    model.map_kv(cache, lambda kv: pools.extend((kv.k, kv.v)) or kv)
    if kernels == "reference":
        pools = iter(page_copy.copy_page_reference(pools, src, dst))
    else:
        pools = iter(page_copy.copy_page(pools, src, dst, interpret=kernels == "interpret"))
    cache = model.map_kv(cache, lambda kv: dataclasses.replace(kv, k=next(pools),
                                                               v=next(pools)))
    seg = model.Segment(fix.pos[None], jnp.ones((1,), jnp.int32))
    kv = cache.mtp
    shape = (1, 1, kv.k.shape[0], kv.k.shape[3])
    k, v = lax.cond(on, lambda: model.mtp_kv(cfg, params, h[:, None], fix.token[None, None],
                                             seg),
                    lambda: (jnp.zeros(shape, h.dtype),) * 2)        # [1, 1, NKV, HD]
    ps = kv.page_size
    at = (0, dst, jnp.where(on, fix.pos % ps, 0), 0)       # kv leaves: [NKV, pages, ps, HD]

    def put(a, new):
        old = lax.dynamic_slice(a, at, (a.shape[0], 1, 1, a.shape[3]))
        row = jnp.where(on, new.astype(a.dtype).transpose(2, 0, 1, 3), old)
        return lax.dynamic_update_slice(a, row, at)
    mtp = dataclasses.replace(kv, k=put(kv.k, k), v=put(kv.v, v))
    return dataclasses.replace(cache, mtp=mtp)
