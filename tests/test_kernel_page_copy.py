"""pallas_kernels.copy_page: one KV page copied onto another in every pool, one kernel.

* interpreted == its jnp reference bit for bit, over several pools with NaN-poisoned pages
  (a NaN page copied stays NaN; every page but dst is untouched), src == dst included;
* the prefix-cache restore of a speculative engine (snapshots.restore with an MTP KV
  rewrite) on the "interpret" path == the reference path, every leaf of the cache;
* it lowers for CUDA at the 27B's restore (34 pools of [4, pages, 16, 256] bf16: one Triton
  custom call);
* it rejects pools of different shapes, non-scalar page ids and, compiled, a page_size or
  HD that is not a power of two.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtpjax.engine import Engine, snapshots
from pallas_kernels import copy_page, copy_page_reference

from tiny_models import VOCAB11_CFG as CFG, VOCAB11_PARAMS as PARAMS


def _pools(n=6, nkv=2, pages=7, ps=4, hd=8, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        a = rng.standard_normal((nkv, pages, ps, hd)).astype(np.float32)
        a[:, (i + 3) % pages] = np.nan          # poisoned pages, one per pool
        out.append(jnp.asarray(a))
    return out


@pytest.mark.parametrize("src,dst", [(1, 5), (3, 0), (2, 2), (6, 3)])
def test_interpreted_copy_matches_reference_bit_for_bit(src, dst):
    pools = _pools()
    before = [np.asarray(p) for p in pools]
    got = copy_page(pools, jnp.int32(src), jnp.int32(dst), interpret=True)
    want = copy_page_reference(pools, jnp.int32(src), jnp.int32(dst))
    assert len(got) == len(pools)
    for g, w, b in zip(got, want, before):
        g, w = np.asarray(g), np.asarray(w)
        np.testing.assert_array_equal(g, w)           # NaN where NaN, bit for bit otherwise
        np.testing.assert_array_equal(g[:, dst], b[:, src])
        keep = [p for p in range(b.shape[1]) if p != dst]
        np.testing.assert_array_equal(g[:, keep], b[:, keep])


def test_restore_with_a_rewrite_on_the_interpret_path_equals_the_reference_path():
    """The copy on write of a speculative engine's restore (page src to dst in the 16 + 1
    pools of each layer, then the MTP KV row at L-1): the kernel path changes no leaf."""
    e = Engine(CFG, PARAMS, num_speculative_tokens=2, max_lanes=2, max_seq_len=32,
               prefill_chunk=8, page_size=4, kernels="reference")
    rng = np.random.default_rng(3)

    def noise(x):
        return jnp.asarray(rng.standard_normal(x.shape).astype(np.float32)).astype(x.dtype) \
            if jnp.issubdtype(x.dtype, jnp.floating) else x
    cache, snaps = jax.tree.map(noise, (e.cache, e.snaps))
    n_pages = e.cache.mtp.k.shape[1]
    fix = snapshots.Rewrite.make((2, n_pages - 1, 5, 9))      # src, dst, token L, pos L-1
    outs = {}
    for kernels in ("reference", "interpret"):
        c, s = jax.tree.map(jnp.copy, (cache, snaps))
        outs[kernels] = snapshots.restore(CFG, e.params, c, s, jnp.int32(1), jnp.int32(0), fix,
                                          rewrite=True, kernels=kernels)
    ref, got = (jax.tree.leaves(outs[k]) for k in ("reference", "interpret"))
    assert len(ref) == len(got)
    for r, g in zip(ref, got):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(r))
    # the copy happened: the MTP pool's page dst is page src there but the rewritten row
    k = np.asarray(outs["interpret"][0].mtp.k)
    np.testing.assert_array_equal(np.delete(k[:, n_pages - 1], 9 % 4, axis=1),
                                  np.delete(np.asarray(cache.mtp.k)[:, 2], 9 % 4, axis=1))


def test_lowers_for_cuda_at_the_27b_restore():
    sds = jax.ShapeDtypeStruct
    pools = [sds((4, 1040, 16, 256), jnp.bfloat16)] * 34
    i32 = sds((), jnp.int32)
    text = jax.jit(copy_page, donate_argnums=(0,)).trace(pools, i32, i32).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text and "copy_page_x34" in text
    assert text.count("__gpu$xla.gpu.triton") == 1


def test_rejects():
    pools = _pools(n=2)
    with pytest.raises(ValueError, match="every pool must be"):
        copy_page([pools[0], pools[1][:, :3]], jnp.int32(0), jnp.int32(1), interpret=True)
    with pytest.raises(ValueError, match="int32 scalar"):
        copy_page(pools, jnp.zeros((2,), jnp.int32), jnp.int32(1), interpret=True)
    with pytest.raises(ValueError, match="at least one pool"):
        copy_page([], jnp.int32(0), jnp.int32(1), interpret=True)
    odd = [jnp.zeros((2, 4, 3, 8), jnp.float32)]
    with pytest.raises(ValueError, match="power-of-two page_size and HD"):
        copy_page(odd, jnp.int32(0), jnp.int32(1))
