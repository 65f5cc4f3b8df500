"""Per-token dynamic NVFP4 activation scales: the reference, the Triton twins, the experts, the FP4 kernel.

Oracle: a row-by-row transcription written here with numpy float32 arithmetic and ml_dtypes casts
(e4m3 block scales, e2m1 elements, the bf16 output), sharing no code with mxlib:

    per_token_scale = max(amax_row * f32(1/2688), 2**-126), NaN for a row holding NaN or Inf
    gs = f32(1) / per_token_scale
    s  = e4m3(min(gs * (amax_block * f32(1/6)), 448));  q = recip(s * recip(gs))
    e  = sign * e2m1(min(|x * q|, 6));  dq = e * (s / gs)   (hardware: e * s)

The experts and the fused kernel are compared with the reference QDQ bit for bit where the arithmetic
is defined (the a1 / a2 activations) and with a float64 MoE within a stated tolerance (the GEMMs).
"""

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from mxlib import kernels as K
from mxlib import reference as R

from _util import OnKernelDevice, assert_bits_equal

KT = OnKernelDevice(K)
F32 = np.float32


def _recip(v):
    with np.errstate(over="ignore", divide="ignore"):
        return F32(1.0) / F32(v + (F32(1e8) if v == 0 else F32(0.0)))


def oracle_row(row: np.ndarray, hardware: bool = False):
    """(dq float32 [k] before the output cast, per_token_scale) of one row of float32 values."""
    if not np.isfinite(row).all():
        return np.full(row.shape, np.nan, dtype=F32), F32(np.nan)
    amax = F32(np.max(np.abs(row))) if row.size else F32(0.0)
    ts = max(F32(amax * F32(1.0 / 2688.0)), F32(2.0**-126))
    gs = F32(1.0) / ts
    out = np.empty(row.shape, dtype=F32)
    for b in range(row.size // 16):
        blk = row[16 * b : 16 * b + 16]
        s = F32(gs * F32(F32(np.max(np.abs(blk))) * F32(1.0 / 6.0)))
        s = F32(np.array(min(s, F32(448.0)), dtype=F32).astype(ml_dtypes.float8_e4m3fn).astype(F32))
        q = _recip(F32(s * _recip(gs)))
        for j, v in enumerate(blk):
            with np.errstate(invalid="ignore"):
                sv = F32(v * q)
            if np.isnan(sv):  # 0 * Inf: vLLM's multiplier overflows for blocks below ~2**-125; NaN stays
                out[16 * b + j] = np.nan
                continue
            mag = F32(np.array(min(abs(sv), F32(6.0)), dtype=F32).astype(ml_dtypes.float4_e2m1fn).astype(F32))
            e = -mag if sv < 0 else mag
            out[16 * b + j] = F32(e * s) if hardware else F32(e * F32(s / gs))
    return out, ts


def oracle(x: torch.Tensor, dtype=None, hardware=False):
    """The oracle on every row of ``x`` (any leading shape), cast once to ``dtype`` (default x's)."""
    dtype = dtype or x.dtype
    rows = x.float().reshape(-1, x.shape[-1]).numpy()
    dq, ts = zip(*(oracle_row(r, hardware) for r in rows)) if len(rows) else ((), ())
    dq = np.stack(dq) if dq else np.zeros((0, x.shape[-1]), F32)
    to = {torch.bfloat16: ml_dtypes.bfloat16, torch.float16: np.float16, torch.float32: F32}[dtype]
    out = torch.from_numpy(dq.astype(to).astype(F32)).to(dtype).reshape(x.shape)
    return out, torch.tensor(np.array(ts, dtype=F32)).reshape(x.shape[:-1])


def cases(dtype=torch.bfloat16) -> torch.Tensor:
    """Rows that exercise each rule: ordinary rows, rows whose blocks span 2**-20 .. 1 of the row amax
    (subnormal and flushed e4m3 block scales), an all-zero row, a -0.0 row, a NaN row, +Inf and -Inf
    rows, bf16-subnormal values (the 2**-126 floor), huge values, ties."""
    g = torch.Generator().manual_seed(0)
    k = 64
    rows = [torch.randn(6, k, generator=g) * torch.exp2(torch.randint(-30, 30, (6, 1), generator=g).float())]
    # block scale s_b = 448 * amax_b / amax_row: normal, e4m3-subnormal (< 2**-6), flushed (< 2**-10)
    spread = torch.randn(4, k, generator=g) * torch.exp2(torch.tensor([0.0, -8, -16, -24]).repeat_interleave(16))
    rows.append(spread)
    special = torch.zeros(9, k)
    special[1] = -0.0
    special[2] = torch.randn(k, generator=g)
    special[2, 5] = math.nan
    special[3] = torch.randn(k, generator=g)
    special[3, 40] = math.inf
    special[4] = torch.randn(k, generator=g)
    special[4, 0] = -math.inf
    special[5] = torch.randn(k, generator=g) * 2.0**-118  # amax * (1/2688) below 2**-126: the floor
    special[6] = torch.randn(k, generator=g) * 2.0**-130  # bf16 subnormals (and zeros): vLLM's recip overflows
    special[7] = torch.randn(k, generator=g).clamp(-3, 3) * 1e38  # up to bf16's largest values
    special[8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 8) * 7.0  # e2m1 ties after scaling
    rows.append(special)
    return torch.cat(rows).to(dtype)


# ----------------------------------------------------------------------------- reference


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("numerics", ["vllm", "hardware"])
def test_reference_matches_oracle(dtype, numerics):
    x = cases(dtype if dtype != torch.float16 else torch.float32)
    if dtype == torch.float16:  # fp16 cannot hold the huge and subnormal rows: the ordinary ones
        x = x[:10].to(torch.float32).clamp(-6e4, 6e4).to(torch.float16)
    dq, ts = R.nvfp4_per_token_quant_dequant(x, numerics=numerics)
    want, want_ts = oracle(x, hardware=numerics == "hardware")
    assert_bits_equal(dq, want, "dq")
    assert_bits_equal(ts, want_ts, "per_token_scale")


def test_reference_rules():
    x = cases()
    gs, ts = R.nvfp4_per_token_scales(x)
    dq, _ = R.nvfp4_per_token_quant_dequant(x)
    z = 10  # the all-zero row: the floor, zeros out, no NaN
    assert ts[z] == 2.0**-126 and gs[z] == 2.0**126 and (dq[z] == 0).all() and (dq[z + 1] == 0).all()
    assert not torch.signbit(dq[z + 1]).any()  # -0.0 in, +0.0 out (vLLM's sign rule)
    for r in (z + 2, z + 3, z + 4):  # NaN / +Inf / -Inf: that token all NaN, its scales NaN
        assert dq[r].isnan().all() and ts[r].isnan() and gs[r].isnan()
    others = torch.ones(len(x), dtype=torch.bool)
    others[z + 2 : z + 5] = False
    others[z + 6] = False
    assert not dq[others].isnan().any()  # NaN stays in its token
    assert ts[z + 5] == 2.0**-126 and (dq[z + 5] != 0).any()  # the floor: still quantized, not flushed
    # blocks of fp32-subnormal size: recip(s * recip(gs)) overflows to Inf (vLLM's arithmetic, static
    # scales alike), so exact zeros there become NaN and the rest saturate
    sub = x[z + 6] != 0
    assert ts[z + 6] == 2.0**-126 and not dq[z + 6][sub].isnan().any() and dq[z + 6][~sub].isnan().all()
    # the spread rows: later blocks' scales are e4m3 subnormals (or flushed) against the row's amax
    stats = R.nvfp4_block_stats(x[6:10], gs[6:10])
    assert stats["subnormal"].any() and stats["flushed"].any()
    # one row's result does not depend on the other rows (a per-row scale, not a per-tensor one)
    assert_bits_equal(R.nvfp4_per_token_quant_dequant(x[2:3])[0], dq[2:3])
    # the same bits as the static QDQ given the row's encode scale
    ok = others.clone()
    assert_bits_equal(dq[ok], R.ref_nvfp4_quant_dequant(x[ok], gs[ok], check_scale=False))


def test_reference_shapes_and_errors():
    x = cases()[:6].reshape(2, 3, 64)  # 3D [E, m, k]: rows along the last axis
    dq, ts = R.nvfp4_per_token_quant_dequant(x)
    assert ts.shape == (2, 3)
    assert_bits_equal(dq, R.nvfp4_per_token_quant_dequant(x.reshape(6, 64))[0].reshape(2, 3, 64))
    e, ets = R.nvfp4_per_token_quant_dequant(torch.zeros(0, 32, dtype=torch.bfloat16))
    assert e.shape == (0, 32) and ets.shape == (0,)
    with pytest.raises(ValueError, match="x: K=40 is not a multiple of block_size=16"):
        R.nvfp4_per_token_quant_dequant(torch.zeros(2, 40))
    with pytest.raises(ValueError, match=r"numerics: expected one of \['vllm', 'hardware'\], got 'fast'"):
        R.nvfp4_per_token_quant_dequant(torch.zeros(2, 32), numerics="fast")
    with pytest.raises(TypeError, match="x: expected"):
        R.nvfp4_per_token_scales(torch.zeros(2, 32, dtype=torch.int32))
