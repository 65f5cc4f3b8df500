"""MXFP6 weights in the fused FP4 kernel (``mxlib.kernels.fp6_layout``, ``fused_fp4_moe`` with ``W_BITS=6``).

Oracles: ``mxlib.reference.dequantize_mx`` (and ml_dtypes' e2m3 / e3m2 values) for the decoded
weight tile, bit for bit; the float64 MoE of ``tests/test_fused_fp4.py`` for the whole layer.
Interpreter on small shapes (K a multiple of the 256-element super tile: H = I = 256).
"""

import ml_dtypes
import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from mxlib import reference as R
from mxlib.formats import BLOCK_SCHEMES
from mxlib.kernels import fp6_layout as F6
from mxlib.kernels import fused_fp4_moe as P
from mxlib.kernels.fused_dequant_moe import ActivationQDQ, PackedWeights

from _util import assert_bits_equal
from test_fused_fp4 import oracle_fp64, rel_err

ELEMENTS = ["e2m3", "e3m2"]
E, H, I, TOPK = 4, 256, 256, 2


@triton.jit
def _decode_kernel(w_ptr, s_ptr, out_ptr, K, stride_wn, stride_sn, stride_on, EBITS: tl.constexpr,
                   BLOCK_N: tl.constexpr, NUM_WARPS: tl.constexpr):
    """Every weight of rows ``pid * BLOCK_N ..`` as the kernel decodes them, stored in row order."""
    n0 = tl.program_id(0) * BLOCK_N
    load_n = n0 + P._load_rows(BLOCK_N, NUM_WARPS)
    n_mask = load_n >= 0
    w_rows = w_ptr + load_n * stride_wn
    s_rows = s_ptr + load_n * stride_sn
    out_rows = out_ptr + (n0 + tl.arange(0, BLOCK_N))[:, None] * stride_on
    for st in range(0, K // 256):
        a, b, p = F6.load_fp6_planes(w_rows, n_mask, st)
        t0 = F6.decode_fp6_tile(a, p, s_rows, n_mask, st, 0, EBITS, BLOCK_N, NUM_WARPS)
        t1 = F6.decode_fp6_tile(b, p, s_rows, n_mask, st, 1, EBITS, BLOCK_N, NUM_WARPS)
        tl.store(out_rows + st * 256 + tl.arange(0, 128)[None, :], t0.to(tl.float32))
        tl.store(out_rows + st * 256 + 128 + tl.arange(0, 128)[None, :], t1.to(tl.float32))


def decoded_weights(w: F6.FP6Weights, block_n: int = 32, num_warps: int = 2) -> torch.Tensor:
    """``[rows, K]`` fp32: the weights of expert 0 as the kernel's decode gives them."""
    rows, k = w.packed.shape[1], w.k
    out = torch.empty(rows, k, dtype=torch.float32)
    wp, ws = w.packed[0].view(torch.int32), w.scales[0].view(torch.int32)
    _decode_kernel[(rows // block_n,)](wp, ws, out, k, wp.stride(0), ws.stride(0), out.stride(0),
                                       EBITS=w.element.ebits, BLOCK_N=block_n, NUM_WARPS=num_warps)
    return out


def every_code_layer(element, rows=64, k=512):
    """Packed ``[1, rows, 3k/4]`` cycling through the 64 codes (shifted per row) and scale bytes
    cycling through 0, 127, 254, 255 and a spread of others."""
    g = torch.Generator().manual_seed(3)
    codes = (torch.arange(k).view(1, k) + 7 * torch.arange(rows).view(rows, 1)).remainder(64).to(torch.uint8)
    packed = R.pack_codes(codes, element).view(1, rows, 3 * k // 4)
    special = torch.tensor([0, 127, 254, 255, 1, 126, 128, 200], dtype=torch.uint8)
    scales = torch.where(torch.rand(rows, k // 32, generator=g) < 0.5,
                         special[torch.randint(0, 8, (rows, k // 32), generator=g)],
                         torch.randint(0, 256, (rows, k // 32), generator=g, dtype=torch.uint8))
    return packed, scales.view(1, rows, k // 32)


# ----------------------------------------------------------------------------- layout


@pytest.mark.parametrize("element", ELEMENTS)
def test_prepare_round_trip_and_size(element):
    packed, scales = every_code_layer(element)
    g = torch.Generator().manual_seed(5)
    packed = torch.cat([packed, torch.randint(0, 256, packed.shape, generator=g, dtype=torch.uint8)])
    scales = torch.cat([scales, scales])
    w = F6.prepare_fp6_weights(packed, scales, element)
    assert w.packed.shape == packed.shape and w.packed.dtype == torch.uint8  # no extra memory
    assert w.k == 512 and not torch.equal(w.packed, packed)
    assert_bits_equal(F6.unprepare_fp6_weights(w), packed)
    assert_bits_equal(F6.unprepare_fp6_packed(w.packed, element), packed)


@pytest.mark.parametrize("element", ELEMENTS)
def test_layout_planes_hold_the_fp4_words_elements(element):
    """Plane t word 4c + j holds code bits 1..4 of exactly the elements of the FP4 layout's word
    4c + j of K tile t; plane 2 word 4c + j holds bits 0 and 5 of those of both tiles."""
    eb = BLOCK_SCHEMES[f"mxfp6_{element}"].element.ebits
    table = F6.layout_table(eb)  # [256, 6] -> word * 32 + bit
    word = table // 32
    for t in range(2):
        for p in range(128):
            q = p % 64
            fp4_word = 4 * ((q // 2) % 4) + q // 16  # byte c*16 + j*4 + .. of the FP4 layout: word 4c + j
            assert word[128 * t + p, 1:5].tolist() == [16 * t + fp4_word] * 4
            assert word[128 * t + p, [0, 5]].tolist() == [32 + fp4_word] * 2


@pytest.mark.parametrize("element", ELEMENTS)
def test_bf16_placement_rule(element):
    """The PTX decode's arithmetic, checked on the CPU: a code's sign at bf16 bit 15 and its five
    exponent-mantissa bits at ``7 - mbits`` is ``value * 2**(bias - 127)`` in bf16, and one
    multiply by ``2**(127 - bias)`` gives ml_dtypes' value of the code exactly."""
    el = BLOCK_SCHEMES[f"mxfp6_{element}"].element
    codes = torch.arange(64, dtype=torch.int32)
    bits = ((codes >> 5) << 15) | ((codes & 31) << (7 - el.mbits))
    v = bits.to(torch.int16).view(torch.bfloat16)
    got = (v * torch.tensor(2.0 ** (127 - el.bias), dtype=torch.bfloat16)).float()
    want = torch.from_numpy(np.arange(64, dtype=np.uint8).view(getattr(ml_dtypes, f"float6_{element}fn")).astype(np.float32))
    assert_bits_equal(got, want)


@pytest.mark.parametrize("element", ELEMENTS)
def test_decoded_tile_matches_reference(element):
    """Every code under E8M0 scales 0, 127, 254, 255 and others: the kernel's decoded weights equal
    ``dequantize_mx`` to bf16, bit for bit (NaN blocks for scale 255, Inf where the product overflows)."""
    packed, scales = every_code_layer(element)
    want = R.dequantize_mx(packed, scales, element, 32, torch.bfloat16)[0].float()
    w = F6.prepare_fp6_weights(packed, scales, element)
    got = decoded_weights(w)
    assert_bits_equal(got, want)
    assert torch.isnan(want).any() and torch.isinf(want).any() and (want == 0).any()


def test_prepare_rejects_bad_input():
    z = torch.zeros
    with pytest.raises(ValueError, match="K=128 is not a multiple of the FP6 layout's super tile 256"):
        F6.prepare_fp6_weights(z(1, 2, 96, dtype=torch.uint8), z(1, 2, 4, dtype=torch.uint8), "e2m3")
    with pytest.raises(ValueError, match=r"packed: expected uint8 \[E, rows, 3K/4\], got torch.int32"):
        F6.prepare_fp6_weights(z(1, 2, 192, dtype=torch.int32), z(1, 2, 8, dtype=torch.uint8), "e2m3")
    with pytest.raises(ValueError, match=r"packed: expected uint8 \[E, rows, 3K/4\], got torch.uint8 \[2, 192\]"):
        F6.prepare_fp6_weights(z(2, 192, dtype=torch.uint8), z(1, 2, 8, dtype=torch.uint8), "e2m3")
    with pytest.raises(ValueError, match=r"scales: expected shape \[1, 2, 8\], got \[1, 2, 4\]"):
        F6.prepare_fp6_weights(z(1, 2, 192, dtype=torch.uint8), z(1, 2, 4, dtype=torch.uint8), "e3m2")
    with pytest.raises(ValueError, match="element: expected an FP6 element"):
        F6.prepare_fp6_weights(z(1, 2, 192, dtype=torch.uint8), z(1, 2, 8, dtype=torch.uint8), "e2m1")
    with pytest.raises(ValueError, match="block_size: the FP6 layout takes OCP MX blocks of 32"):
        F6.prepare_fp6_weights(z(1, 2, 192, dtype=torch.uint8), z(1, 2, 16, dtype=torch.uint8), "e3m2", 16)
    # through PackedWeights: FP6 accepted, K not a multiple of 256 refused with the same message
    pw = PackedWeights(z(1, 2, 96, dtype=torch.uint8), z(1, 2, 4, dtype=torch.uint8), BLOCK_SCHEMES["mxfp6_e3m2"])
    with pytest.raises(ValueError, match="K=128 is not a multiple"):
        P.prepare_packed_weights(pw)
    pw8 = PackedWeights(z(1, 2, 256, dtype=torch.uint8), z(1, 2, 8, dtype=torch.uint8), BLOCK_SCHEMES["mxfp8_e4m3"])
    with pytest.raises(ValueError, match="4- or 6-bit elements"):
        P.prepare_packed_weights(pw8)


# ----------------------------------------------------------------------------- the MoE


def make_fp6_layer(element, act, m=7, e=E, h=H, i=I, k=TOPK, seed=0):
    """An MXFP6 layer (weights ``element``) with activation QDQ ``act`` (None, or an MX block scheme
    name) in the form of ``test_fused_fp4.make_layer`` (MX operands are the same in both modes)."""
    from mxlib.moe import fused_topk

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, h, generator=g).to(torch.bfloat16)
    w13 = torch.randn(e, 2 * i, h, generator=g) * 0.05 * torch.exp(torch.randn(e, 1, 1, generator=g))
    w2 = torch.randn(e, h, i, generator=g) * 0.05
    tw, ti = fused_topk(torch.randn(m, e, generator=g), k)
    p13, s13 = R.quantize_mx(w13.to(torch.bfloat16), element)
    p2, s2 = R.quantize_mx(w2.to(torch.bfloat16), element)
    d13, d2 = R.dequantize_mx(p13, s13, element), R.dequantize_mx(p2, s2, element)
    scheme = BLOCK_SCHEMES[f"mxfp6_{element}"]
    pw13 = P.prepare_packed_weights(PackedWeights(p13, s13, scheme))
    pw2 = P.prepare_packed_weights(PackedWeights(p2, s2, scheme))
    if act is None:
        q = None
        a = lambda v, mode: v  # noqa: E731
    else:
        q = ActivationQDQ(BLOCK_SCHEMES[act])
        el = BLOCK_SCHEMES[act].element.name
        a = lambda v, mode: R.quant_dequant_mx(v, el, 32, "even")  # noqa: E731
    return dict(x=x, tw=tw, ti=ti, pw13=pw13, pw2=pw2, q1=q, q2=q, dq13={"seed": d13, "hardware": d13},
                dq2={"seed": d2, "hardware": d2}, a1=a, a2=a, raw13=p13)


@pytest.mark.parametrize("element", ELEMENTS)
@pytest.mark.parametrize("act", [None, "mxfp6_e2m3", "mxfp4"])
def test_fused_fp6_against_fp64(element, act):
    L = make_fp6_layer(element, act)
    assert isinstance(L["pw13"], F6.FP6Weights)
    out = P.fused_fp4_moe(L["x"], L["pw13"], L["pw2"], L["tw"], L["ti"], L["q1"], L["q2"])
    err = rel_err(out, oracle_fp64(L, "seed"))
    assert err < 5e-3, err  # bf16 GEMM outputs: ~1e-3 (test_fused_fp4's tolerance)


def test_fused_fp6_naive_blocks_and_tiles():
    """M = 1 (each pair its own block, no alignment) and explicit tiles with a standalone a1 QDQ."""
    L = make_fp6_layer("e3m2", "mxfp4", m=9)
    want = oracle_fp64(L, "seed")
    one = P.fused_fp4_moe(L["x"][:1], L["pw13"], L["pw2"], L["tw"][:1], L["ti"][:1], L["q1"], L["q2"])
    assert rel_err(one, want[:1]) < 5e-3
    cfg = (P.FP4Config(32, 32, 2, 4, 1, A1_FUSED=False), P.FP4Config(16, 64, 1, 4, 1))
    out = P.fused_fp4_moe(L["x"], L["pw13"], L["pw2"], L["tw"], L["ti"], L["q1"], L["q2"], configs=cfg)
    assert rel_err(out, want) < 5e-3


def test_fused_fp6_rejects_mixed_elements():
    a, b = make_fp6_layer("e2m3", None, m=2), make_fp6_layer("e3m2", None, m=2)
    with pytest.raises(ValueError, match="w13 and w2 must have one element format"):
        P.fused_fp4_moe(a["x"], a["pw13"], b["pw2"], a["tw"], a["ti"])
