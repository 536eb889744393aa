"""The engine's step programs as abstract (shape-only) calls, compiled without a device.

`build_programs` is the ONE place that knows the step programs' signatures (which arguments,
their shapes, which are weights / caches, which are static): when `mtpjax.steps` changes,
adapt that function and nothing else. Shapes come from the code itself
(`mtpjax.params.abstract_params`, `jax.eval_shape(model.init_paged_cache ...)`), so a change of
layout (per-layer tuples instead of stacked arrays) flows through.

`compile_program` lowers one Program for a target (the H200 through a deviceless topology, or
the host CPU) and returns its optimized HLO, memory analysis, donation and the traffic audit
of `experiments.hlo_audit`. No flags here (experiments/aot.py owns those), so tests can import
this module next to any other sub-command.
"""

from __future__ import annotations

import dataclasses
import os
import time
from functools import partial
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from experiments import hlo_audit
from mtpjax import model, quant, sampling, steps, tensor_parallel
from mtpjax.engine import snapshots
from mtpjax.config import Config
from mtpjax.engine.kv_pool import pages_for
from mtpjax.draft_vocab import abstract_head
from mtpjax.params import (abstract_params, fp8_paths, get_path, hf_tensor_map, leaf_dtype,
                           leaf_shapes)

TARGET_CONFIG = os.path.join(os.path.dirname(__file__), "data", "h200_target_config.txtpb")
WEIGHT, CACHE, OTHER = "weight", "cache", "other"


@dataclasses.dataclass(frozen=True)
class Reads:
    """What a program must read from HBM at least (its roofline floor), in model terms.

    target_passes: target-model forwards (each reads every target weight once, lm_head
        included); mtp_passes: MTP-layer passes (each re-reads the MTP weights: chained drafts
        are sequential); lm_head_extra: lm_head reads beyond the target's (one per draft
        made); lanes x context: KV tokens read (target layers per target pass, the MTP layer
        per MTP pass); gdn_lanes: lanes whose GDN state (recurrent state, conv window,
        pending buffers) is read and written once. A prefill chunk alone samples nothing: its
        target pass reads no lm_head (target_lm_head False).
    kv_token_bytes (K and V of one token in one layer) and gdn_lane_bytes (one lane's GDN
    slot, all layers) price them; they depend on the cache layout, so build_programs sets them.
    """
    target_passes: int
    mtp_passes: int
    lm_head_extra: int
    lanes: int
    context: int
    gdn_lanes: int
    kv_token_bytes: int
    gdn_lane_bytes: int
    target_lm_head: bool = True


@dataclasses.dataclass(frozen=True)
class Program:
    """One step program as an abstract call: fn(*args, **kwargs).

    args: positional arguments; static ones (cfg) as values, dynamic ones as pytrees of
    jax.ShapeDtypeStruct (no sharding yet). arg_kinds: per positional argument, "weight",
    "cache", "other", or None for a static one. reads: what its floor counts.
    """
    name: str
    fn: Callable
    args: tuple
    kwargs: dict
    arg_kinds: tuple
    reads: Reads
    dtype: str          # the weights' dtype (prices the floor's weight bytes)
    mesh: Any = None    # a tensor-parallel mesh: args carry their shardings, floors are per device
    key: tuple = ()     # the engine's program key (Engine.warmup_plan), e.g. ("decode", d, B)
    start: int | tuple = 0   # prefill: the chunk's position in its lane (packed: each chunk's;
                              # what the cost model prices)


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def build_programs(cfg: Config, *, lanes: int, max_seq_len: int, K: int, kernels: str,
                   dtype: str = "bfloat16", page_size: int = 16,
                   prefill_chunk: int = 64, mesh=None, weights: str = "dense",
                   mtp_weights: str = "dense", depths=None, snapshot_slots: int = 4,
                   mixed_depths=(), draft_vocab: int | None = None,
                   packed_rows: int = 1) -> list[Program]:
    """The engine's programs for an engine of `lanes` lanes drafting K tokens.

    decode_k{d}: steps.decode_step of depth d (d drafts verified, d made; depth 0 on a K > 0
    engine drafts nothing and writes the MTP KV only, whose fc + KV-projection read the floor
    leaves out), for d in `depths` (default 0 and K: one program when K = 0);
    mixed_k{d}_t{T}: the same step carrying one prefill chunk of T = prefill_chunk tokens
    (steps.decode_step(chunk=...), key ("mixed", d, lanes, T)), for d in `mixed_depths`
    (default none): an iteration with a prefill in flight, which must read the weights once;
    prefill_t{T}: steps.prefill_chunk over one chunk of T tokens alone (no sampling, no
    drafts: what an iteration runs when no lane decodes); packed_rows = R > 1 adds packed
    prefill's mixed_k{d}_t{T}x{R} (each mixed depth) and prefill_t{T}x{R}: R lanes' chunks in
    one program (keys ("mixed", d, lanes, T, R), ("prefill", T, R)); draft: one chained MTP step
    (steps.draft_chain with k = 2), the unit of the draft path (K >= 1 only); move_lane
    (steps.move_lane: lane compaction), snapshot_save and snapshot_restore
    (mtpjax/engine/snapshots.py, the prefix cache's GDN snapshots, `snapshot_slots` slots): with
    those, every program the engine launches. The KV pool holds every lane at full context,
    as the engine's default. A prefill chunk (alone or riding) sits at the end of a
    max_seq_len context (start = max_seq_len - T), the pages its table addresses.
    mesh: a tensor-parallel mesh (of topology devices): weights and caches in their
    tensor-parallel layout and shardings, everything else replicated; the programs run under
    shard_map and their floors count one device's share.
    weights / mtp_weights: "fp8" makes the linears (the MTP head's) FP8 leaves with 128 x 128
    block scales (mtpjax/quant.py), read by the FP8 matmul of `kernels`.
    draft_vocab: N (< V) gives the params an N-row draft head (mtpjax/draft_vocab.py, in the
    weights' dtype like lm_head, rows split over tp): every draft's argmax reads it instead
    of the lm_head; the floor's lm_head_extra follows.
    """
    B, P = lanes, K + 1
    pages_per_lane = pages_for(max_seq_len + 2 * K, page_size)      # as Engine.__init__
    num_pages = B * pages_per_lane
    local = tensor_parallel.shard_config(cfg, tensor_parallel.mesh_tp(mesh))
    local_cache = jax.eval_shape(partial(model.init_paged_cache, local, B, num_pages, page_size,
                                         P, dtype))
    fp8 = fp8_paths(cfg, weights, mtp_weights)
    if fp8 and mesh is not None:
        raise tensor_parallel.ShardingError("FP8 weights under tensor parallelism (tp > 1) "
                                            "are not supported yet")
    if mesh is None:
        params = quant.set_impl(abstract_params(cfg, dtype, fp8), kernels)
        cache = local_cache
    else:
        params = tensor_parallel.sharded_abstract_params(cfg, mesh, dtype)
        cache = _sharded(jax.eval_shape(partial(tensor_parallel.init_paged_cache, cfg, mesh, B,
                                                num_pages, page_size, P, dtype)),
                         tensor_parallel.cache_specs(local_cache), mesh)
    if draft_vocab is not None and draft_vocab != cfg.vocab_size:
        if not 1 <= draft_vocab <= cfg.vocab_size:
            raise ValueError(f"draft_vocab must lie in 1..{cfg.vocab_size}, got {draft_vocab}")
        params = dataclasses.replace(params, draft=abstract_head(
            draft_vocab, cfg.hidden_size, dtype, tensor_parallel.mesh_tp(mesh), mesh))
    state = jax.eval_shape(partial(steps.LaneState.empty, B, K))
    i32, f32 = jnp.int32, jnp.float32
    lane_sampling = sampling.LaneSampling(temperature=_sds((B,), f32), top_k=_sds((B,), i32),
                                          top_p=_sds((B,), f32), seed=_sds((B,), jnp.uint32))
    active = _sds((B,), jnp.bool_)
    table = _sds((B, pages_per_lane), i32)
    join = steps.Join(_sds((B,), jnp.bool_), _sds((B,), i32), _sds((B,), i32))
    T = prefill_chunk
    chunk = steps.Chunk(lane=_sds((), i32), tokens=_sds((1, T), i32),
                        next_tokens=_sds((1, T), i32), start=_sds((), i32),
                        n_valid=_sds((), i32), page_table=_sds((1, pages_per_lane), i32))
    R = int(packed_rows)
    packed = steps.Chunk(lane=_sds((R,), i32), tokens=_sds((R, T), i32),
                         next_tokens=_sds((R, T), i32), start=_sds((R,), i32),
                         n_valid=_sds((R,), i32), page_table=_sds((R, pages_per_lane), i32))
    kw = dict(kernels=kernels)
    scalar = lambda dt: _sds((), dt)
    if mesh is not None:
        kw["mesh"] = mesh
        rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        state, lane_sampling, active, table, join, chunk, packed = _place(
            (state, lane_sampling, active, table, join, chunk, packed), rep)
        scalar = lambda dt: _place(_sds((), dt), rep)
    price = dict(kv_token_bytes=2 * local.num_key_value_heads * cfg.head_dim
                 * jnp.dtype(local_cache.kv[0].k.dtype).itemsize,
                 gdn_lane_bytes=_nbytes(local_cache.gdn) // B)     # one device's share
    start = max(max_seq_len - T, 0)
    progs = []
    depths = sorted({0, K} if depths is None else set(map(int, depths)))
    mixed_depths = sorted(set(map(int, mixed_depths)))
    for ds in (depths, mixed_depths):
        if ds and (ds[0] < 0 or ds[-1] > K):
            raise ValueError(f"depths must lie in 0..K={K}, got {ds}")
    step_args = (cfg, params, cache, state, lane_sampling, active, table, join)
    step_kinds = (None, WEIGHT, CACHE, OTHER, OTHER, OTHER, OTHER, OTHER)
    def masks(k):   # what every engine decode step takes: the grammar masks (all -1: none)
        # and the per-lane extras (logprobs wanted, logit_bias, penalties with the lanes'
        # token history as Engine.history_len, masked drafts; all off: none)
        m = _sds((B, k + 1, (cfg.vocab_size + 31) // 32), i32)
        x = steps.Extras(_sds((B,), jnp.bool_), _sds((B, steps.LOGIT_BIAS_MAX), i32),
                         _sds((B, steps.LOGIT_BIAS_MAX), f32),
                         _sds((B, pages_per_lane * page_size), i32), _sds((B,), i32),
                         _sds((B,), f32), _sds((B,), f32), _sds((B,), f32),
                         _sds((B,), jnp.bool_), _sds((B,), i32))
        return (m, x) if mesh is None else _place((m, x), rep)
    for k in depths:      # k MTP passes: the re-run over the accepted pairs + k - 1 chained
        progs.append(Program(
            f"decode_k{k}", steps.decode_step, step_args + (None, *masks(k)), dict(k=k, **kw),
            step_kinds + (OTHER, OTHER, OTHER),
            Reads(1, k, k, B, max_seq_len, B, **price), dtype, mesh, ("decode", k, B)))
    for k in mixed_depths:   # the step's floor plus the chunk's lane: one more GDN slot
        progs.append(Program(
            f"mixed_k{k}_t{T}", steps.decode_step, step_args + (chunk, *masks(k)),
            dict(k=k, **kw), step_kinds + (OTHER, OTHER, OTHER),
            Reads(1, k, k, B, max_seq_len, B + 1, **price), dtype,
            mesh, ("mixed", k, B, T), start))
    progs.append(Program(
        f"prefill_t{T}", steps.prefill_chunk, (cfg, params, cache, chunk), dict(k=K, **kw),
        (None, WEIGHT, CACHE, OTHER), Reads(1, 0, 0, 1, max_seq_len, 1, **price,
                                            target_lm_head=False), dtype, mesh,
        ("prefill", T), start))
    if R > 1:              # packed prefill: R lanes' chunks, R GDN slots more
        for k in mixed_depths:
            progs.append(Program(
                f"mixed_k{k}_t{T}x{R}", steps.decode_step, step_args + (packed, *masks(k)),
                dict(k=k, **kw), step_kinds + (OTHER, OTHER, OTHER),
                Reads(1, k, k, B, max_seq_len, B + R, **price), dtype,
                mesh, ("mixed", k, B, T, R), (start,) * R))
        progs.append(Program(
            f"prefill_t{T}x{R}", steps.prefill_chunk, (cfg, params, cache, packed),
            dict(k=K, **kw), (None, WEIGHT, CACHE, OTHER),
            Reads(1, 0, 0, R, max_seq_len, R, **price, target_lm_head=False), dtype, mesh,
            ("prefill", T, R), (start,) * R))
    if K > 0 and mesh is None:   # the draft chain alone: one-device programs only
        progs.append(Program(
            "draft", _draft_chain,
            (cfg, params, cache, _sds((B, cfg.hidden_size), dtype), _sds((B,), i32),
             _sds((B,), i32), active, table),
            dict(k=2, **kw),
            (None, WEIGHT, CACHE, OTHER, OTHER, OTHER, OTHER, OTHER),
            Reads(0, 1, 1, B, max_seq_len, 0, **price), dtype, key=("draft", B)))
    progs += _copy_programs(cfg, local, params, cache, state, mesh, snapshot_slots, dtype,
                            price, scalar, K, kernels)
    return progs


def _copy_programs(cfg: Config, local: Config, params, cache, state, mesh, slots: int,
                   dtype: str, price: dict, scalar, K: int, kernels: str) -> list[Program]:
    """The engine's copy programs: move_lane (one lane's GDN slot, pending count and LaneState
    row to another slot) and the snapshot save / restore (a lane's recurrent state and conv
    tail to / from a slot of the store; with K > 0 the restore also copies a KV page and may
    rewrite one MTP KV row, snapshots.Rewrite). Their floor: one lane's GDN slot (move_lane) or one
    snapshot (save / restore) read and written, as `gdn_lanes` = 1 of that size."""
    store = jax.eval_shape(partial(snapshots.init_snapshots, local, None, slots, dtype))
    if mesh is not None:
        store = _sharded(store, snapshots._specs(store), mesh)
    snap = snapshots.snapshot_bytes(local, dtype)          # one device's share
    kw = {} if mesh is None else {"mesh": mesh}
    i32 = jnp.int32
    one = dict(price, gdn_lane_bytes=snap)
    return [
        Program("move_lane", steps.move_lane, (cache, state, scalar(i32), scalar(i32)), kw,
                (CACHE, OTHER, OTHER, OTHER), Reads(0, 0, 0, 0, 0, 1, **price), dtype, mesh,
                ("move_lane",)),
        Program("snapshot_save", snapshots.save, (cache, store, scalar(i32), scalar(i32)), kw,
                (CACHE, CACHE, OTHER, OTHER), Reads(0, 0, 0, 0, 0, 1, **one), dtype, mesh,
                ("snapshot",)),
        Program("snapshot_restore", snapshots.restore,
                (cfg, params, cache, store, scalar(i32), scalar(i32),
                 snapshots.Rewrite(*(scalar(i32) for _ in range(5)))),
                dict(kw, rewrite=local.has_mtp and K > 0, kernels=kernels),
                (None, WEIGHT, CACHE, CACHE, OTHER, OTHER, OTHER),
                Reads(0, 0, 0, 0, 0, 1, **one), dtype, mesh, ("snapshot_restore",)),
    ]


def kernel_count_programs(cfg: Config, *, K: int, lanes: Sequence[int],
                          prefill_chunks: Sequence[int], max_seq_len: int = 1024,
                          page_size: int = 16, weights: str = "dense",
                          kernels: str = "pallas", wide_depths: Sequence[int] | None = None,
                          mixed_depths: Sequence[int] = (), mixed_chunks: Sequence[int] = ()
                          ) -> list[Program]:
    """Every program key the engine launches, once each, for the kernel-count table
    (mtpjax/h200_kernel_counts.py): decode at each depth 0..K and lane bucket, prefill at
    each chunk bucket (one lane slot), the draft at each lane bucket, move_lane and the
    snapshot save / restore (max(lanes, 2) slots: with one slot a lane move is a no-op XLA
    drops), and the decode step carrying a chunk ("mixed") at each of `mixed_depths`, lane
    bucket and chunk of `mixed_chunks` (none by default). wide_depths: the decode depths
    compiled at the lane buckets after the first (default every depth). Keys are unique;
    names carry the bucket."""
    out, seen = [], set()
    copies = {"move_lane", "snapshot_save", "snapshot_restore"}

    def add(progs, i):
        for p in progs:
            if p.key in seen or (p.name in copies and lanes[i] != max(max(lanes), 2)):
                continue
            seen.add(p.key)
            name = p.name + (f"_b{p.key[2] if p.key[0] == 'mixed' else p.key[-1]}"
                             if p.key[0] in ("decode", "draft", "mixed") else "")
            out.append(dataclasses.replace(p, name=name))

    common = dict(max_seq_len=max_seq_len, K=K, kernels=kernels, page_size=page_size,
                  weights=weights)
    for i, B in enumerate(lanes):
        for T in (prefill_chunks if i == 0 else prefill_chunks[:1]) or [64]:
            add(build_programs(cfg, lanes=B, prefill_chunk=T,
                               depths=range(K + 1) if i == 0 or wide_depths is None
                               else wide_depths, **common), i)
        for T in mixed_chunks if mixed_depths else ():
            add([p for p in build_programs(cfg, lanes=B, prefill_chunk=T, depths=[],
                                           mixed_depths=mixed_depths, **common)
                 if p.key[0] == "mixed"], i)
    return out


# The draft path is a function inside the step programs; compiled alone it needs its own jit
# (cache donated like the steps').
_draft_chain = jax.jit(steps.draft_chain, static_argnames=("cfg", "k", "kernels"),
                       donate_argnames=("cache",))


# ---------------------------------------------------------------------------------------------
# Floors
# ---------------------------------------------------------------------------------------------

def _sharded(tree, specs, mesh):
    """ShapeDtypeStructs of `tree` with NamedShardings from a matching tree of specs."""
    return jax.tree.map(
        lambda a, sp: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                           sharding=jax.sharding.NamedSharding(mesh, sp)),
        tree, specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))


def _nbytes(tree) -> int:
    return int(sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(tree)))


def _by_role(cfg: Config, sized) -> dict[str, int]:
    """Sum (leaf path, bytes) pairs into roles: target (every text weight but the embedding
    table; lm_head included, the embedding when tied), mtp (the MTP head), lm_head."""
    out = {"target": 0, "mtp": 0, "lm_head": 0}
    for path, n in sized:
        if path[0] == "mtp":
            out["mtp"] += n
        elif path == ("embed",):
            if cfg.tie_word_embeddings:
                out["target"] += n
                out["lm_head"] += n
        else:
            out["target"] += n
            if path == ("lm_head",):
                out["lm_head"] += n
    return out


def weight_bytes(cfg: Config, dtype: str, tp: int = 1) -> dict[str, int]:
    """Checkpoint tensor bytes by role (_by_role), from the HF tensor map (independent of how
    Params lays them out). tp > 1: one device's bytes under the tensor-parallel layout (a
    sharded leaf's share, padding and replicated heads included; a replicated leaf whole)."""
    if tp > 1:
        return _weight_bytes_per_device(cfg, dtype, tp)
    return _by_role(cfg, ((s.path, int(np.prod(s.shape)) * leaf_dtype(s.path, dtype).itemsize)
                          for s in hf_tensor_map(cfg)))


def tree_weight_bytes(cfg: Config, params) -> dict[str, int]:
    """weight_bytes' roles, priced from the leaves of a (one-device) Params tree as it is: an
    FP8 leaf is its float8 weight plus its float32 block scales."""
    paths = leaf_shapes(cfg, split_ba=quant.has_fp8(params))
    return _by_role(cfg, ((p, _nbytes(get_path(params, p))) for p in paths))


def fp8_weight_shapes(params) -> list[tuple[int, ...]]:
    """[O, I] of every FP8 leaf (what a dequantized copy would look like)."""
    return [tuple(w.q.shape) for w in jax.tree.leaves(params, is_leaf=quant.is_fp8)
            if quant.is_fp8(w)]


def _weight_bytes_per_device(cfg: Config, dtype: str, tp: int) -> dict[str, int]:
    def sized():
        for path, shape in leaf_shapes(cfg).items():
            lay = tensor_parallel.layout_index(cfg, tp, path)
            n = int(np.prod(shape)) * leaf_dtype(path, dtype).itemsize
            yield path, (n if lay is None else n * len(lay[1]) // shape[lay[0]] // tp)
    return _by_role(cfg, sized())


def program_weight_bytes(prog: Program) -> dict[str, int]:
    """weight_bytes of the program's params (one device's share under tp; FP8 leaves priced
    as stored); zeros for a program without weights (the copy programs)."""
    if WEIGHT not in prog.arg_kinds:
        return {"target": 0, "mtp": 0, "lm_head": 0, "draft": 0}
    cfg, params = prog.args[0], prog.args[1]
    tp = tensor_parallel.mesh_tp(prog.mesh)
    out = (tree_weight_bytes(cfg, dataclasses.replace(params, draft=None))
           if quant.has_fp8(params) else weight_bytes(cfg, prog.dtype, tp))
    # what a draft's argmax reads: the lm_head, or the draft vocabulary's head (one shard's)
    out["draft"] = out["lm_head"] if params.draft is None else _nbytes(params.draft.weight) // tp
    return out


def floor_terms(prog: Program) -> dict[str, float]:
    """Bytes a program must move at least: its `Reads`, priced.

    weights: target weights per target pass (less the lm_head where the pass samples
    nothing: a prefill chunk alone) + MTP head weights per MTP pass; kv_read: lanes x
    context tokens of the target layers' K and V per target pass and of the MTP layer's per MTP
    pass; gdn_state_rw: one read and one write of each counted lane's GDN slot; lm_head_extra:
    lm_head bytes per extra read (the draft head's with a draft vocabulary).
    """
    r = prog.reads
    w = program_weight_bytes(prog)
    full_layers = 0
    if r.target_passes:
        cfg = prog.args[0]
        full_layers = tensor_parallel.shard_config(cfg, tensor_parallel.mesh_tp(prog.mesh)
                                                   ).num_full_layers
    return {
        "weights": float(r.target_passes * (w["target"] - (0 if r.target_lm_head
                                                           else w["lm_head"]))
                         + r.mtp_passes * w["mtp"]),
        "kv_read": float(r.lanes * r.context * r.kv_token_bytes
                         * (r.target_passes * full_layers + r.mtp_passes)),
        "gdn_state_rw": float(2 * r.gdn_lanes * r.gdn_lane_bytes),
        "lm_head_extra": float(r.lm_head_extra * w["draft"]),
    }


# ---------------------------------------------------------------------------------------------
# Compiling
# ---------------------------------------------------------------------------------------------

def target_device(target: str, target_config: str = TARGET_CONFIG):
    """A device to compile for: the H200 as a deviceless topology device, or the host CPU."""
    return target_devices(target, 1, target_config)[0]


def target_devices(target: str, n: int, target_config: str = TARGET_CONFIG) -> list:
    """n devices to compile for: n H200s of one host ("1x1xn" deviceless topology from the
    target config) or n host CPU devices."""
    if target == "cpu":
        devs = jax.devices("cpu")
        if len(devs) < n:
            raise ValueError(f"{n} CPU devices needed, JAX sees {len(devs)}")
        return devs[:n]
    if target != "h200":
        raise ValueError(f"unknown target {target!r} (h200 or cpu)")
    from jax.experimental import topologies
    with open(target_config) as f:
        spec = f.read()
    topo = topologies.get_topology_desc("h200", "cuda", target_config=spec,
                                        topology=f"1x1x{n}")
    return list(topo.devices)[:n]


def target_mesh(target: str, tp: int, target_config: str = TARGET_CONFIG):
    """A tensor-parallel mesh over tp target devices (None for tp = 1)."""
    if tp == 1:
        return None
    return jax.sharding.Mesh(np.array(target_devices(target, tp, target_config)),
                             (tensor_parallel.TP_AXIS,))


def _place(tree, sharding):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                        tree)


def _kept_params(lowered, n_leaves: int) -> list[int]:
    """Flat dynamic-argument leaf index of each HLO entry parameter (jit drops unused ones)."""
    kept = getattr(getattr(lowered, "_lowering", None), "compile_args", {}).get("kept_var_idx")
    return sorted(kept) if kept is not None else list(range(n_leaves))


def compile_traffic(prog: Program, device) -> dict[str, Any]:
    """Lower and compile one one-device Program for `device` and count its kernels' HBM
    traffic (hlo_audit.traffic(...).summary(), reads split by the operands' kind: weight /
    cache / other) and nothing else: what the cost model's test needs, without
    compile_program's audit, floors and donation report (parsing the HLO once, not five
    times)."""
    sh = jax.sharding.SingleDeviceSharding(device)
    args = tuple(a if kind is None else _place(a, sh) for a, kind in zip(prog.args,
                                                                          prog.arg_kinds))
    lowered = prog.fn.lower(*args, **prog.kwargs)
    param_kinds, _, _ = _entry_params(prog, lowered)
    return hlo_audit.traffic(lowered.compile().as_text(), param_kinds).summary()


def _entry_params(prog: Program, lowered):
    """(HLO entry parameter number -> kind: weight / cache / other; the dynamic leaves'
    donation info; the flat leaf index of each entry parameter: jit drops unused ones)."""
    leaf_kinds = []
    for a, kind in zip(prog.args, prog.arg_kinds):
        if kind is not None:
            leaf_kinds += [kind] * len(jax.tree.leaves(a))
    info = [x for x in jax.tree.leaves(lowered.args_info[0]) if hasattr(x, "donated")]
    if len(info) != len(leaf_kinds):
        raise RuntimeError(f"{prog.name}: {len(info)} dynamic leaves in args_info, "
                           f"{len(leaf_kinds)} in the Program's args")
    kept = _kept_params(lowered, len(leaf_kinds))
    return {n: leaf_kinds[i] for n, i in enumerate(kept)}, info, kept


def compile_program(prog: Program, device, *, min_bytes: int = hlo_audit.MB,
                    bytes_per_s: float = hlo_audit.H200_BYTES_PER_S) -> dict[str, Any]:
    """Lower and compile one program for `device`; audit its optimized HLO.

    Returns a JSON-ready dict (see experiments/aot.py for the fields) plus "hlo" (the text).
    """
    if prog.mesh is None:
        sh = jax.sharding.SingleDeviceSharding(device)
        args = tuple(a if kind is None else _place(a, sh) for a, kind in zip(prog.args,
                                                                              prog.arg_kinds))
    else:
        args = prog.args         # placed on the mesh by build_programs
    t0 = time.perf_counter()
    lowered = prog.fn.lower(*args, **prog.kwargs)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    hlo = compiled.as_text()

    # entry parameter number -> kind / name / donated, from the dynamic arguments' leaves
    param_kinds, info, kept = _entry_params(prog, lowered)
    module = hlo_audit.parse_module(hlo)
    param_names = {n: hlo_audit.param_label(p) for n, p in module.entry_params().items()}
    donated = [n for n, i in enumerate(kept) if info[i].donated]

    audit = hlo_audit.audit(hlo, param_kinds, min_bytes)
    traffic = hlo_audit.traffic(hlo, param_kinds).summary()
    mem = compiled.memory_analysis()
    terms = floor_terms(prog)
    roof = hlo_audit.roofline(**terms, data_movement=audit.total, bytes_per_s=bytes_per_s)
    weight_bytes = terms["weights"]
    return {
        "program": prog.name,
        "static": {k: v for k, v in prog.kwargs.items() if k != "mesh"},
        "reads": dataclasses.asdict(prog.reads),
        "lower_s": t1 - t0, "compile_s": t2 - t1,
        "memory": {f: getattr(mem, f + "_size_in_bytes") for f in
                   ("argument", "output", "alias", "temp")} if mem is not None else None,
        "donation": hlo_audit.alias_report(module.aliases, donated, param_names),
        "audit": audit.summary(param_names=param_names),
        "key": list(prog.key), "start": prog.start,
        "traffic": traffic,
        "tp": tensor_parallel.mesh_tp(prog.mesh),
        "collectives": hlo_audit.collectives(hlo),
        "weight_copy_bytes": audit.by_kind.get("weight", 0),
        "weight_bytes_by_role": program_weight_bytes(prog),
        "dequantized_weight_buffers": hlo_audit.weight_sized_float_buffers(
            hlo, fp8_weight_shapes(prog.args[1]) if WEIGHT in prog.arg_kinds else []),
        "data_movement_over_weights": audit.total / weight_bytes if weight_bytes else None,
        "roofline": roof,
        "hlo": hlo,
    }
