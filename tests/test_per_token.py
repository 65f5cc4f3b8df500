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
    rows, bf16-subnormal values (the 2**-126 lower bound), huge values, ties."""
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
    special[5] = torch.randn(k, generator=g) * 2.0**-118  # amax * (1/2688) below 2**-126: the lower bound
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
    z = 10  # the all-zero row: the lower bound, zeros out, no NaN
    assert ts[z] == 2.0**-126 and gs[z] == 2.0**126 and (dq[z] == 0).all() and (dq[z + 1] == 0).all()
    assert not torch.signbit(dq[z + 1]).any()  # -0.0 in, +0.0 out (vLLM's sign rule)
    for r in (z + 2, z + 3, z + 4):  # NaN / +Inf / -Inf: that token all NaN, its scales NaN
        assert dq[r].isnan().all() and ts[r].isnan() and gs[r].isnan()
    others = torch.ones(len(x), dtype=torch.bool)
    others[z + 2 : z + 5] = False
    others[z + 6] = False
    assert not dq[others].isnan().any()  # NaN stays in its token
    assert ts[z + 5] == 2.0**-126 and (dq[z + 5] != 0).any()  # the lower bound: still quantized, not flushed
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


# ----------------------------------------------------------------------------- Triton twins


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("numerics", ["vllm", "hardware"])
def test_triton_twin_matches_reference(dtype, numerics):
    x = cases(dtype)
    want, want_ts = R.nvfp4_per_token_quant_dequant(x, numerics=numerics)
    got, ts = KT.nvfp4_per_token_quant_dequant(x, numerics=numerics)
    assert_bits_equal(got, want, "dq")
    assert_bits_equal(ts, want_ts, "per_token_scale")
    for a, b, name in zip(KT.nvfp4_per_token_scales(x), R.nvfp4_per_token_scales(x), ("global_scale", "per_token")):
        assert_bits_equal(a, b, name)


def test_triton_twin_rows_longer_than_a_tile_and_3d():
    """K = 2048 + 768 (several BLOCK_K steps, a masked tail), rows of one 3D tensor, an fp32 output."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(2, 3, 2816, generator=g) * torch.exp2(torch.randn(2, 3, 1, generator=g) * 8)).to(torch.bfloat16)
    x[1, 2, 2815] = 300.0  # the row's amax in its last, masked step
    for numerics in ("vllm", "hardware"):
        want = R.nvfp4_per_token_quant_dequant(x, dtype=torch.float32, numerics=numerics)
        got = KT.nvfp4_per_token_quant_dequant(x, dtype=torch.float32, numerics=numerics)
        for a, b in zip(got, want):
            assert_bits_equal(a, b, numerics)
    e, ets = KT.nvfp4_per_token_quant_dequant(torch.zeros(0, 32, dtype=torch.bfloat16))
    assert e.shape == (0, 32) and ets.shape == (0,)
    with pytest.raises(ValueError, match="x: K=40 is not a multiple of block_size=16"):
        KT.nvfp4_per_token_quant_dequant(torch.zeros(2, 40))


# ----------------------------------------------------------------------------- the experts


E, H, I, TOPK, M = 4, 256, 128, 2, 6  # H, I multiples of the FP4 kernel's 128-element K tile


def layer(seed=0, m=M):
    """NVFP4 experts' weights and tokens whose magnitudes span 2**-12 .. 2**4 (one all-zero token)."""
    from mxlib.moe import fused_topk, quantize_expert_weights

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, H, generator=g) * torch.exp2(torch.linspace(-12, 4, m))[:, None]
    x[m // 2] = 0.0
    w13 = torch.randn(E, 2 * I, H, generator=g) * 0.05
    w2 = torch.randn(E, H, I, generator=g) * 0.05
    tw, ti = fused_topk(torch.randn(m, E, generator=g), TOPK)
    q = quantize_expert_weights(w13.to(torch.bfloat16), w2.to(torch.bfloat16), "nvfp4", ops=R)
    return q, x.to(torch.bfloat16), tw, ti


def experts(q, backend, numerics="vllm", device="cpu", **kw):
    from mxlib.moe import make_emulation_experts

    return make_emulation_experts(
        "nvfp4", q.to(device), backend=backend, numerics=numerics, scale_strategy="per_token", **kw
    )


def oracle_moe(q, x, tw, ti, numerics):
    """float64 MoE from the reference's operands: ``vllm``: bf16 weights and per-token QDQ'd
    activations; ``hardware``: fp32 weights ``e2m1 * block_scale * global_scale`` and activations
    ``(e2m1 * s) * per_token_scale`` (no bf16 rounding of the product). GEMM1 and SiLU-and-mul rounded
    to bf16 between the GEMMs, as every path does."""
    from oracles import moe_fp64

    dt = torch.bfloat16 if numerics == "vllm" else torch.float32
    w13 = R.dequantize_to_dtype(q.w13_weight, q.w13_weight_scale, q.w13_weight_scale_2, dt)
    w2 = R.dequantize_to_dtype(q.w2_weight, q.w2_weight_scale, q.w2_weight_scale_2, dt)

    def qdq(v):
        dq, ts = R.nvfp4_per_token_quant_dequant(v, numerics=numerics, dtype=torch.float32)
        return dq.double() * ts.double()[:, None] if numerics == "hardware" else dq.to(torch.bfloat16)

    return moe_fp64(qdq(x), w13, w2, tw, ti, store_dtype=torch.bfloat16, a2_fn=lambda act, e: qdq(act))


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("numerics", ["vllm", "hardware"])
def test_experts_quantize_activations_per_token_bits(backend, numerics, device):
    """The experts' a1 and a2 hooks give the reference's per-token QDQ bit for bit, on both backends."""
    q, x, tw, ti = layer()
    d = "cpu" if backend == "torch" else device
    ex = experts(q, backend, numerics, device=d)
    a1, per_pair, _ = ex.quantize_input(x.to(d), ti.to(d), backend)
    assert not per_pair  # once per token
    assert_bits_equal(a1.cpu(), R.nvfp4_per_token_quant_dequant(x, numerics=numerics)[0], "a1")
    act = torch.randn(5, I, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16) * 3
    a2 = ex.quantize_intermediate(act.to(d), torch.zeros(5, dtype=torch.int32, device=d), backend)
    want, ts = R.nvfp4_per_token_quant_dequant(act, numerics=numerics)
    if numerics == "hardware":  # with the rows' per_token_scale, for GEMM2's output
        assert_bits_equal(a2[0].cpu(), want, "a2")
        assert_bits_equal(a2[1].cpu(), ts, "a2 per_token_scale")
    else:
        assert_bits_equal(a2.cpu(), want, "a2")
    assert ex.a13_gscale is None and ex.a2_gscale is None and ex.per_token


@pytest.mark.slow
@pytest.mark.parametrize("numerics", ["vllm", "hardware"])
def test_experts_per_token_against_fp64(numerics, device):
    """torch, triton (vLLM numerics) and fused (the FP4 kernel) backends against the float64 MoE."""
    q, x, tw, ti = layer()
    want = oracle_moe(q, x, tw, ti, numerics)
    backends = ["torch", "fused"] + (["triton"] if numerics == "vllm" else [])
    outs = {}
    for backend in backends:
        ex = experts(q, backend, numerics, device=device if backend != "torch" else "cpu")
        d = device if backend != "torch" else "cpu"
        outs[backend] = ex(x.to(d), tw.to(d), ti.to(d)).cpu()
        assert rel_err(outs[backend], want) < 5e-3, (backend, rel_err(outs[backend], want))
    assert (outs["torch"][M // 2] == 0).all()  # the all-zero token: zeros, no NaN
    for backend in backends[1:]:
        assert rel_err(outs[backend], outs["torch"]) < 5e-3, backend
    if numerics == "hardware":  # the modes differ measurably
        assert rel_err(outs["torch"], oracle_moe(q, x, tw, ti, "vllm")) > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("numerics", ["vllm", "hardware"])
def test_fused_per_token_a1_prepass_and_standalone_same_bits(numerics, device):
    """The FP4 kernel's a1 per token: a scales pre-pass then the A-load QDQ (``a1_fused``), or one
    standalone QDQ pass: the same bits; aligned and naive (tiny batch) plans alike."""
    from mxlib.kernels.tiles import TileConfig

    q, x, tw, ti = layer()
    ex = experts(q, "fused", numerics, device=device)
    args = (x.to(device), tw.to(device), ti.to(device))
    # GEMM1 (N = I = 128) and GEMM2 (N = H = 256) in two column blocks each, both loading (and, fused, QDQ'ing) the
    # same A tile (narrower columns, 32 and 64, repeat the case in twice the interpreter's programs)
    c2 = TileConfig(16, 128, None, 1, 4, 1)
    ex.fp4_config = (TileConfig(16, 64, None, 1, 4, 1, a1_fused=False), c2)
    standalone = ex(*args).cpu()
    ex.fp4_config = (TileConfig(16, 64, None, 1, 4, 1, a1_fused=True), c2)
    assert_bits_equal(ex(*args).cpu(), standalone)
    ex.fp4_config = None
    one = ex(*(a[:1] for a in args)).cpu()  # M * k * 4 <= E: naive blocks
    assert rel_err(one, oracle_moe(q, x[:1], tw[:1], ti[:1], numerics)) < 5e-3


@pytest.mark.slow
def test_nan_token_stays_in_its_token(device):
    q, x, tw, ti = layer()
    x[1, 7] = math.nan
    for backend in ("torch", "fused"):
        d = device if backend == "fused" else "cpu"
        out = experts(q, backend, device=d)(x.to(d), tw.to(d), ti.to(d)).cpu()
        assert out[1].isnan().all(), backend
        others = torch.ones(M, dtype=torch.bool)
        others[1] = False
        assert not out[others].isnan().any(), backend


def test_per_token_beats_one_static_scale_on_spread_tokens():
    """Tokens 2**16 apart in magnitude: one static (max) scale pushes the small tokens' block scales into
    e4m3's subnormal range or to zero; per-token scales keep every token's relative error small."""
    from mxlib.moe import make_emulation_experts

    q, x, tw, ti = layer()
    bf16 = oracle_moe(q, x, tw, ti, "vllm")  # only for the weights' rounding: compare the activations here
    amax = float(x.float().abs().amax())
    static = make_emulation_experts(
        "nvfp4", q, torch.full((E,), amax / 2688), torch.full((E,), 0.05 * amax / 2688), backend="torch"
    )
    per_token = experts(q, "torch")
    live = x.float().abs().amax(1) > 0

    def token_err(out):
        return ((out.double() - bf16).norm(dim=1)[live] / bf16.norm(dim=1)[live]).max().item()

    assert token_err(per_token(x, tw, ti)) < 0.05
    assert token_err(static(x, tw, ti)) > 0.5


def test_per_token_construction_and_errors():
    from mxlib.moe import (
        ACTIVATION_SCALE_STRATEGIES,
        PER_TOKEN,
        SCALE_STRATEGIES,
        make_emulation_experts,
        unify_input_scales,
    )

    assert PER_TOKEN == "per_token" and PER_TOKEN not in SCALE_STRATEGIES
    assert ACTIVATION_SCALE_STRATEGIES == (*SCALE_STRATEGIES, PER_TOKEN)
    q, x, tw, ti = layer()
    ex = make_emulation_experts("nvfp4", q, scale_strategy="per_token", backend="torch")  # no input scales
    with pytest.raises(ValueError, match="scale_strategy 'max' needs w13_input_scale and w2_input_scale"):
        ex.set_scale_strategy("max")
    with pytest.raises(ValueError, match=r"scale_strategy: expected one of \[.*'per_token'\], got 'p99x'"):
        ex.set_scale_strategy("p99x")
    with pytest.raises(ValueError, match="'per_token' is dynamic"):
        unify_input_scales(torch.ones(E), "per_token")
    with pytest.raises(ValueError, match="nvfp4: activations with a static scale need w13_input_scale"):
        make_emulation_experts("nvfp4", q)
    # given input scales are checked but not used: static <-> per_token switch back and forth
    s = torch.full((E,), 1.0 / 2688)
    both = make_emulation_experts("nvfp4", q, s, s, backend="torch")
    static_out = both(x, tw, ti)
    both.set_scale_strategy("per_token")
    assert_bits_equal(both(x, tw, ti), ex(x, tw, ti))
    both.set_scale_strategy("max")
    assert_bits_equal(both(x, tw, ti), static_out)
