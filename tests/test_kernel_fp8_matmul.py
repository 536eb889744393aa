"""Weight-only FP8 matmul: Pallas kernel == jnp reference == float64 numpy, and its GPU programs.

The kernel runs in interpret mode on CPU (``INTERPRET = True``); on a GPU backend a subclass that
flips ``INTERPRET`` is defined as well (on CPU it is not defined at all, so nothing is skipped).
Both the kernel and ``fp8_matmul_reference`` are checked against ``x @ (q * scale).T`` computed
in float64 from the same fp8 values, so the reference itself is tested. The last tests lower the
kernel for CUDA and compile it for the H200 without a GPU (../shared/notes/h200_aot.md), and
check from the optimized HLO that no dequantized weight-sized buffer exists.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import (
    Fp8MatmulTuning,
    fp8_matmul,
    fp8_matmul_reference,
    get_fp8_matmul_tuning,
)

F32_TOL = 1e-5   # relative to the output's scale (max |y|)
BF16_TOL = 1e-2  # bf16 x; one bf16 rounding of y (2^-8) plus summation order


def make_case(seed, out, inn, block, lead, dtype=jnp.float32):
    """Random x [*lead, I], q float8_e4m3fn [O, I] and per-block scales, as numpy + jnp."""
    rng = np.random.default_rng(seed)
    bo, bi = block
    scale = rng.uniform(0.01, 0.05, (-(-out // bo), -(-inn // bi))).astype(np.float32)
    s_full = np.repeat(np.repeat(scale, bo, 0), bi, 1)[:out, :inn]
    w = np.clip(rng.standard_normal((out, inn)), -4.0, 4.0).astype(np.float32)
    q = (w / s_full).astype(ml_dtypes.float8_e4m3fn)      # |w / s| <= 400 < 448: no NaN
    assert np.isfinite(q.astype(np.float32)).all()
    x = jnp.asarray(rng.standard_normal((*lead, inn)).astype(np.float32), dtype)
    return x, jnp.asarray(q), jnp.asarray(scale)


def exact(x, q, scale, block):
    """float64 x @ (q * scale).T from the very values the kernel sees."""
    bo, bi = block
    out, inn = q.shape
    s_full = np.repeat(np.repeat(np.asarray(scale, np.float64), bo, 0), bi, 1)[:out, :inn]
    w = np.asarray(q).astype(np.float64) * s_full
    return np.asarray(x, np.float64) @ w.T


# (O, I, block, lead): ragged O / I, partial edge blocks, one or several input blocks.
CASES = [
    (200, 72, (128, 128), (3,)),        # one partial block each way, nbi == 1
    (256, 384, (128, 128), (1,)),       # three full input blocks, decode row
    (200, 200, (128, 128), (2, 3)),     # partial tails in O and I, nbi == 2, leading dims
    (96, 130, (1, 128), (5,)),          # per-row scale, partial second input block
    (64, 100, (1, 100), (17,)),         # per-output-channel (1, I), T = 17 -> 32 rows
    (50, 64, (3, 32), (4,)),            # bo not a multiple of the output tile: per-row gather
    (40, 48, (1, 48), ()),              # 1-D x
]
IDS = ["128x128-small", "128x128-3blocks", "128x128-ragged-lead", "1x128", "1xI",
       "3x32", "x1d"]


class TestFp8Matmul:
    INTERPRET = True

    def run(self, x, q, scale, block, tuning=None):
        return fp8_matmul(x, q, scale, block, interpret=self.INTERPRET, tuning=tuning)

    def check(self, x, q, scale, block, tol, tuning=None):
        y = np.asarray(self.run(x, q, scale, block, tuning), np.float64)
        ref = np.asarray(fp8_matmul_reference(x, q, scale, block), np.float64)
        ex = exact(x, q, scale, block)
        assert y.shape == ref.shape == ex.shape == (*x.shape[:-1], q.shape[0])
        assert np.isfinite(y).all(), "NaN/inf in the kernel output (a masked read leaked)"
        atol = tol * np.abs(ex).max()
        np.testing.assert_allclose(ref, ex, rtol=tol, atol=atol, err_msg="reference vs f64")
        np.testing.assert_allclose(y, ex, rtol=tol, atol=atol, err_msg="kernel vs f64")
        np.testing.assert_allclose(y, ref, rtol=tol, atol=atol, err_msg="kernel vs reference")

    @pytest.mark.parametrize("out,inn,block,lead", CASES, ids=IDS)
    def test_f32_matches_reference_and_f64(self, out, inn, block, lead):
        x, q, scale = make_case(out + inn, out, inn, block, lead)
        self.check(x, q, scale, block, F32_TOL)

    @pytest.mark.parametrize("out,inn,block,lead", CASES[:5], ids=IDS[:5])
    def test_bf16(self, out, inn, block, lead):
        x, q, scale = make_case(7 + out, out, inn, block, lead, jnp.bfloat16)
        y = self.run(x, q, scale, block)
        assert y.dtype == jnp.bfloat16
        self.check(x, q, scale, block, BF16_TOL)

    @pytest.mark.parametrize("out,inn,block,t,tuning", [
        # several token tiles (T = 40 > block_t = 16, ragged), output tiles and k-steps
        (96, 256, (32, 64), 40, Fp8MatmulTuning(block_o=32, block_k=64, block_t=16)),
        # block_k cut to bi = 32; bo = 16 < block_o = 32: per-row scale gather
        (80, 96, (16, 32), 20, Fp8MatmulTuning(block_o=32, block_k=128, block_t=16)),
        # one input block, I = 200 walked in masked steps of 64
        (48, 200, (1, 200), 3, Fp8MatmulTuning(block_o=16, block_k=64, block_t=16)),
        # two k-steps per input block (block_k 64 < bi 128), partial last block; scalar scale
        (64, 320, (32, 128), 5, Fp8MatmulTuning(block_o=32, block_k=64, block_t=16)),
    ], ids=["tiles-tokens", "bk-cut-rowgather", "per-channel-ksteps", "2-steps-per-block"])
    def test_tilings(self, out, inn, block, t, tuning):
        x, q, scale = make_case(t, out, inn, block, (t,))
        self.check(x, q, scale, block, F32_TOL, tuning)

    def test_fp8_specials_and_zero_scale(self):
        """Subnormal, max-magnitude and zero fp8 codes; a zero scale block."""
        out, inn, block = 32, 64, (16, 32)
        x, q, scale = make_case(1, out, inn, block, (2,))
        qn = np.asarray(q).copy()
        qn[0, :4] = np.array([448.0, -448.0, 2.0 ** -9, -(2.0 ** -9)], np.float32).astype(
            ml_dtypes.float8_e4m3fn)
        qn[1, :] = 0
        sn = np.asarray(scale).copy()
        sn[1, 1] = 0.0
        self.check(x, jnp.asarray(qn), jnp.asarray(sn), block, F32_TOL)

    def test_e5m2_weight_f16_x_and_empty_x(self):
        out, inn, block = 48, 96, (16, 32)
        x, q, scale = make_case(3, out, inn, block, (5,))
        q = jnp.asarray(np.asarray(q).astype(np.float32).astype(ml_dtypes.float8_e5m2))
        self.check(x, q, scale, block, F32_TOL)
        self.check(x.astype(jnp.float16), q, scale, block, BF16_TOL)
        y = self.run(x[:0], q, scale, block)
        assert y.shape == (0, out) and y.dtype == x.dtype


if jax.default_backend() == "gpu":

    class TestFp8MatmulCompiled(TestFp8Matmul):
        INTERPRET = False


# ---------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------

def _args(out=64, inn=96, block=(32, 32), t=2):
    return make_case(0, out, inn, block, (t,))


@pytest.mark.parametrize("fn", [fp8_matmul, fp8_matmul_reference], ids=["kernel", "reference"])
def test_shape_mismatches_raise(fn):
    x, q, scale = _args()
    with pytest.raises(ValueError, match="scale shape"):
        fn(x, q, scale[:, :2], (32, 32))
    with pytest.raises(ValueError, match="scale shape"):
        fn(x, q, scale, (16, 32))          # block disagrees with the scale grid
    with pytest.raises(ValueError, match="features"):
        fn(x[:, :80], q, scale, (32, 32))
    with pytest.raises(ValueError, match="2-D"):
        fn(x, q[None], scale, (32, 32))
    with pytest.raises(ValueError, match="positive"):
        fn(x, q, scale, (0, 32))


def test_unsupported_block_raises_naming_it():
    # bi = 24 with several input blocks: its largest power-of-two divisor (8) is below 16
    x, q, scale = make_case(0, 32, 72, (32, 24), (2,))
    with pytest.raises(ValueError, match=r"unsupported block \(32, 24\)"):
        fp8_matmul(x, q, scale, (32, 24), interpret=True)
    with pytest.raises(ValueError, match=r"unsupported block \(32, 24\)"):
        jax.jit(functools.partial(fp8_matmul, block=(32, 24))).trace(x, q, scale)
    # the same bi as one input block (bi >= I) is fine
    x, q, scale = make_case(0, 32, 24, (32, 24), (2,))
    fp8_matmul(x, q, scale, (32, 24), interpret=True)


def test_dtype_and_tuning_checks():
    x, q, scale = _args()
    with pytest.raises(ValueError, match="float8"):
        fp8_matmul(x, q.astype(jnp.bfloat16), scale, (32, 32), interpret=True)
    with pytest.raises(ValueError, match="x must be"):
        fp8_matmul(x.astype(jnp.int32), q, scale, (32, 32), interpret=True)
    with pytest.raises(ValueError, match="block must be"):
        fp8_matmul(x, q, scale, (32, 32, 1), interpret=True)
    with pytest.raises(ValueError, match="Fp8MatmulTuning"):
        fp8_matmul(x, q, scale, (32, 32), interpret=True, tuning=(64, 128))
    for bad in (dict(block_o=8), dict(block_k=96), dict(block_t=0), dict(num_warps=3),
                dict(num_stages=0)):
        with pytest.raises(ValueError):
            Fp8MatmulTuning(**bad)


def test_tuning_lookup():
    assert get_fp8_matmul_tuning(4, 34816, 5120).block_o == 64
    assert get_fp8_matmul_tuning(4, 5120, 17408).block_o < 64      # keep >= ~264 programs
    assert get_fp8_matmul_tuning(4, 5120, 17408).block_o >= 16
    assert get_fp8_matmul_tuning(2048, 5120, 5120).block_o == 128


# ---------------------------------------------------------------------------
# CUDA lowering and the deviceless H200 compile (no GPU needed)
# ---------------------------------------------------------------------------

H, O_QKV = 5120, 34816  # 27B shapes: [34816, 5120] weight, (128, 128) blocks -> scale [272, 40]


@pytest.mark.parametrize("block,dtype", [((128, 128), jnp.bfloat16), ((1, H), jnp.bfloat16),
                                         ((1, 128), jnp.float32)],
                         ids=["128x128-bf16", "per-channel-bf16", "1x128-f32"])
def test_lowers_for_cuda_with_triton(block, dtype):
    sds = jax.ShapeDtypeStruct
    bo, bi = block
    args = (sds((4, H), dtype), sds((O_QKV, H), jnp.float8_e4m3fn),
            sds((-(-O_QKV // bo), -(-H // bi)), jnp.float32))
    text = jax.jit(functools.partial(fp8_matmul, block=block)).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text
    assert "fp8_matmul_" in text


_ARRAY = re.compile(r"\b(bf16|f32)\[([0-9,]*)\]")


def _largest_float_array(hlo: str) -> tuple[int, str]:
    """Largest element count of any bf16/f32 array shape named in the optimized HLO."""
    best = (0, "")
    for m in _ARRAY.finditer(hlo):
        n = int(np.prod([int(d) for d in m.group(2).split(",") if d] or [1]))
        best = max(best, (n, m.group(0)))
    return best


@pytest.fixture(scope="module")
def h200():
    from experiments import aot_programs
    return jax.sharding.SingleDeviceSharding(aot_programs.target_device("h200"))


@pytest.mark.parametrize("t,block,dtype", [
    (4, (128, 128), jnp.bfloat16), (4, (1, H), jnp.bfloat16), (300, (128, 128), jnp.bfloat16),
    (4, (1, 128), jnp.float32)],
    ids=["decode-128x128", "decode-per-channel", "prefill-128x128", "decode-1x128-f32"])
def test_h200_compile_has_no_dequantized_weight(h200, t, block, dtype):
    """The Triton kernel compiles to PTX for sm_90a; nothing weight-sized in bf16/f32."""
    bo, bi = block
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=h200)
    args = (sds((t, H), dtype), sds((O_QKV, H), jnp.float8_e4m3fn),
            sds((-(-O_QKV // bo), -(-H // bi)), jnp.float32))
    with jax.default_matmul_precision(None):   # compile as the engine runs
        compiled = jax.jit(functools.partial(fp8_matmul, block=block)).lower(*args).compile()
    hlo = compiled.as_text()
    assert "__gpu$xla.gpu.triton" in hlo
    n, shape = _largest_float_array(hlo)
    assert n < O_QKV * H // 4, f"weight-sized float buffer {shape} in the optimized HLO"
    # the largest float arrays are the kernel's own operands: y, x or the scales
    assert n == max(t * O_QKV, t * H, -(-O_QKV // bo) * -(-H // bi)), (n, shape)
    mem = compiled.memory_analysis()
    assert mem.temp_size_in_bytes < 16 * 2 ** 20, mem
