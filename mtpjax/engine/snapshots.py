"""GDN snapshots on the device: the prefix cache's saved recurrent state, and the programs
that save a lane's state into a slot and restore a slot into a lane.

A snapshot is what a Gated DeltaNet layer carries past a prefix: its recurrent state
[NV, DK, DV] (float32) and its conv tail, the last KC-1 raw pre-conv inputs [KC-1, CONV].
It is taken right after a prefill chunk that ends at a cache boundary: then no token is
pending (a prefill chunk commits everything, model.gdn_block "chunk"), so the conv tail is
rows [0, KC-1) of the lane's conv buffer. Restoring writes them back and sets the lane's
pending count to 0: the next prefill chunk, starting at the boundary, continues exactly as
if the lane had prefilled the prefix itself.

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


@partial(jax.tree_util.register_dataclass, data_fields=["conv", "state"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Snapshots:
    """S snapshot slots for every GDN layer (model order)."""
    conv: tuple     # per GDN layer: [S, KC-1, CONV] (cache dtype)
    state: tuple    # per GDN layer: [S, NV, DK, DV] float32

    @property
    def num_slots(self) -> int:
        return self.state[0].shape[0] if self.state else 0


def _specs(snaps: Snapshots) -> Snapshots:
    return Snapshots(conv=tuple(P(None, None, tp.TP_AXIS) for _ in snaps.conv),
                     state=tuple(P(None, tp.TP_AXIS) for _ in snaps.state))


def init_snapshots(cfg: Config, mesh, num_slots: int, dtype) -> Snapshots:
    """An empty store of num_slots snapshots, created shard by shard on the mesh."""
    def make(c: Config) -> Snapshots:
        n = sum(1 for t in c.layer_types if t != FULL)
        kc = c.linear_conv_kernel_dim - 1
        return Snapshots(
            conv=tuple(jnp.zeros((num_slots, kc, c.conv_dim), dtype) for _ in range(n)),
            state=tuple(jnp.zeros((num_slots, c.linear_num_value_heads, c.linear_key_head_dim,
                                   c.linear_value_head_dim), jnp.float32) for _ in range(n)))
    if mesh is None:
        return make(cfg)
    local = tp.shard_config(cfg, tp.mesh_tp(mesh))
    fn = lambda: make(local)
    return jax.jit(tp.spmd(fn, mesh, (), _specs(jax.eval_shape(fn))))()


def snapshot_bytes(cfg: Config, dtype) -> int:
    """Bytes of one snapshot (all GDN layers, all shards)."""
    n = sum(1 for t in cfg.layer_types if t != FULL)
    kc = cfg.linear_conv_kernel_dim - 1
    state = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    return n * (state + kc * cfg.conv_dim * jnp.dtype(dtype).itemsize)


def _on_mesh(body, mesh, cache, snaps, *rest):
    if mesh is None:
        return body(cache, snaps, *rest)
    cs, ss = tp.cache_specs(cache), _specs(snaps)
    return tp.spmd(body, mesh, (cs, ss) + (P(),) * len(rest), (cs, ss))(cache, snaps, *rest)


@partial(jax.jit, static_argnames=("mesh",), donate_argnames=("cache", "snaps"))
def save(cache: model.Cache, snaps: Snapshots, lane, slot, *, mesh=None):
    """Copy lane's GDN state and conv tail into snapshot slot `slot` (i32 scalars). The lane
    must have no pending tokens (it has just run a prefill chunk)."""
    def body(cache, snaps, lane, slot):
        kc = snaps.conv[0].shape[1] if snaps.conv else 0
        conv, state = [], []
        for c, sc, ss in zip(cache.gdn, snaps.conv, snaps.state):
            tail = lax.dynamic_slice_in_dim(c.conv, lane, 1)[:, :kc]
            conv.append(lax.dynamic_update_slice_in_dim(sc, tail, slot, 0))
            state.append(lax.dynamic_update_slice_in_dim(
                ss, lax.dynamic_slice_in_dim(c.state, lane, 1), slot, 0))
        return cache, Snapshots(tuple(conv), tuple(state))
    return _on_mesh(body, mesh, cache, snaps, lane, slot)


@partial(jax.jit, static_argnames=("mesh",), donate_argnames=("cache", "snaps"))
def restore(cache: model.Cache, snaps: Snapshots, lane, slot, *, mesh=None):
    """Write snapshot `slot` into lane's GDN state and conv tail, with nothing pending: the
    lane continues as if it had prefilled the snapshot's prefix itself."""
    def body(cache, snaps, lane, slot):
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
        return dataclasses.replace(cache, layers=tuple(layers), n_pend=n_pend), snaps
    return _on_mesh(body, mesh, cache, snaps, lane, slot)
