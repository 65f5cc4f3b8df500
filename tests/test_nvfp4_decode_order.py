"""The rounding order of NVFP4's weight decode in vLLM's numerics, exhaustively (every e4m3 block-scale byte x every
e2m1 code x representative global scales), against ``mxlib.reference.dequantize_to_dtype``.

vLLM's ``dequantize_to_dtype`` computes ``e2m1 * (fp32(block_scale) * global_scale)`` in fp32, then one cast to
bf16. The FP4 kernel (``fp4_layout``, ``W_NVFP4_VLLM``) forms the per-block fp32 multiplier ``B = fp32(s) * g``
once a block (one PTX block a scale word) and multiplies each element by it in fp32 before one conversion to bf16.
These tests show which orders give the reference's bits:

* per-block ``B``, then ``fp32(e2m1 * B)``, then bf16 (the kernel's order): equal everywhere, NaN included;
* the same in float64 arithmetic, rounded to fp32 where the reference rounds: equal (each fp32 product is the
  correctly rounded exact product);
* ``2**k * bf16(fp32(m * B))`` with ``e2m1 = 2**k * m``, ``m`` in {1, 1.5}: equal wherever the results are
  normal, so one bf16 multiplier per block and mantissa class would do;
* one bf16 multiplier per block, ``bf16(e2m1 * bf16(B))`` (MXFP4's one bf16 multiply a pair): NOT equal (about
  one value in ten differs).

The split order needs a per-element choice between two multipliers (a selector built from the code's bits, a byte
permute, and the e2m1 subnormal 0.5 kept apart): more instructions than the fp32 multiply it would replace. So the
per-element fp32 multiply and rounding stay what vLLM's bits cost on Hopper (it has no f32x2 multiply): the work
that separates the NVFP4 vLLM decode from MXFP4's one bf16x2 multiply a pair.
"""

import ml_dtypes
import numpy as np
import pytest
import torch

from mxlib import reference as R

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


def _global_scales() -> np.ndarray:
    """Powers of two, ModelOpt-like ``amax / 2688`` values, and 48 seeded fp32 values with full mantissas."""
    rng = np.random.default_rng(0)
    fixed = [2.0**-20, 2.0**-10, 2.0**-3, 1.0, 1.0 / 2688, 0.25 / 2688, 3.7 / 2688, 1e-4, 7.3e-6, 0.011]
    rand = (10.0 ** rng.uniform(-7, -1, 48)).astype(np.float32)
    return np.concatenate([np.array(fixed, dtype=np.float32), rand]).astype(np.float32)


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 (round to nearest even, ml_dtypes) as uint16 bits; every NaN as one pattern."""
    b = x.astype(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), b)


def _reference_bits(g: float) -> np.ndarray:
    """``dequantize_to_dtype`` of every (scale byte, code): ``[256, 16]`` bf16 bits."""
    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes[0::2] | (codes[1::2] << 4)).repeat(256, 1)  # [256, 8]: codes 0..15, one block a row
    sf = torch.arange(256, dtype=torch.uint8).view(256, 1).view(torch.float8_e4m3fn)
    out = R.dequantize_to_dtype(packed, sf, torch.tensor([g], dtype=torch.float32), torch.bfloat16)
    out = out.float().numpy()
    return np.where(np.isnan(out), np.uint16(0x7FC0), out.astype(ml_dtypes.bfloat16).view(np.uint16))


def _scales() -> np.ndarray:
    """fp32 values of the 256 e4m3fn bytes (ml_dtypes): ``[256, 1]``."""
    return np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)[:, None]


@pytest.mark.parametrize("g", _global_scales().tolist())
def test_per_block_multiplier_is_the_reference_order(g):
    g32 = np.float32(g)
    s = _scales()
    with np.errstate(invalid="ignore", over="ignore"):
        block = s * g32  # fp32, once a block
        kernel = _bf16_bits(E2M1[None, :] * block)  # fp32 product, one conversion
        # float64: exact products, rounded to fp32 where the reference rounds
        b64 = (s.astype(np.float64) * np.float64(g32)).astype(np.float32)
        wide = _bf16_bits((E2M1[None, :].astype(np.float64) * b64.astype(np.float64)).astype(np.float32))
    ref = _reference_bits(float(g32))
    np.testing.assert_array_equal(kernel, ref)
    np.testing.assert_array_equal(wide, ref)


@pytest.mark.parametrize("g", _global_scales().tolist())
def test_power_of_two_split_is_exact_where_normal(g):
    """``e2m1 = 2**k * m`` (m in {1, 1.5}): the bf16 of ``m * B`` scaled by ``2**k`` is the reference's bits
    wherever ``B / 2`` and ``6 * B`` are normal, finite bf16 values (every block here)."""
    g32 = np.float32(g)
    s = _scales()
    mag = np.abs(E2M1)
    m = np.where((mag == 1.5) | (mag == 3) | (mag == 6), np.float32(1.5), np.float32(1.0))
    p = np.copysign(mag / m, E2M1).astype(np.float32)  # +-2**k, or +-0
    with np.errstate(invalid="ignore", over="ignore"):
        block = s * g32
        classes = (m[None, :] * block).astype(ml_dtypes.bfloat16).astype(np.float32)  # bf16(fp32(m * B))
        split = _bf16_bits(p[None, :] * classes)  # a power of two times a bf16: exact
    ref = _reference_bits(float(g32))
    finite = np.isfinite(block[:, 0])
    normal = finite & ((np.abs(block[:, 0]) >= 2.0**-125) | (block[:, 0] == 0)) & (np.abs(block[:, 0]) < 2.0**120)
    np.testing.assert_array_equal(split[normal], ref[normal])
    assert normal.sum() >= 250, normal.sum()  # the NaN bytes (0x7F, 0xFF) and nothing else fall out here


def test_one_bf16_multiplier_a_block_is_not_the_reference():
    """One bf16 multiplier per block (MXFP4's decode cost) differs from the reference for some (scale byte, code,
    g): it cannot serve vLLM's bits."""
    s = _scales()
    diff = total = 0
    for g in _global_scales():
        g32 = np.float32(g)
        with np.errstate(invalid="ignore", over="ignore"):
            one_bf16 = _bf16_bits(E2M1[None, :] * (s * g32).astype(ml_dtypes.bfloat16).astype(np.float32))
        ref = _reference_bits(float(g32))
        diff += int((one_bf16 != ref).sum())
        total += ref.size
    assert diff > total // 20, (diff, total)
