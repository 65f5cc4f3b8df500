"""4/6 block scaling and the MSE scale search against hand-computed blocks and float64 brute forces.

The oracles share no code with mxlib.recovery: hand-computed bytes, ml_dtypes casts for the e2m1 /
e2m3 / e3m2 / e4m3 roundings, float64 errors, the candidate sets written out here.
"""

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mxlib import reference as R
from mxlib.recovery.four_over_six import four_over_six_global_scale, quantize_nvfp4_four_over_six
from mxlib.recovery.scale_search import nvfp4_scale_candidates, search_mx_scales, search_nvfp4_scales

from _util import KERNEL_DEVICE, OnKernelDevice, assert_bits_equal

# ----------------------------------------------------------------------------- 4/6 by hand

# One [1, 80] matrix of five 16-element blocks; its amax 1536 = 6 * 256 makes 4/6's decode global
# scale exactly 1.0, so every block scale below is the block's own number.
_HALF6 = [6.0, 4.0, 3.0, 2.0, 1.5, 1.0, 0.5, 0.0]
HAND_BLOCKS = [
    [1536.0] + [0.0] * 15,  # the tensor amax: 6 -> s 256 (0x78), 4 -> s 384, both exact: a tie keeps 6
    _HALF6 + [-v for v in _HALF6],  # on the 6-grid at s 1 (0x38): error 0; at s 1.5: 0.875 -> 6
    [6.0, 4.5] * 8,  # s 1: 4.5 -> 4 (error 0.25 each); s 1.5 (0x3C): 4 and 3, exact -> 4
    [5.0] * 8 + [-5.0] * 8,  # saturating: s e4m3(5/6) = 0.8125 (0x35), 5/0.8125 = 6.15 -> 6; s 1.25 (0x3A) exact -> 4
    [0.0] * 16,  # all zero: scale 1.0 (0x38, ModelOpt's), codes 0, keeps 6
]
HAND_FOUR = [False, False, True, True, False]
HAND_SCALE_BYTES = [0x78, 0x38, 0x3C, 0x3A, 0x38]
# two e2m1 codes a byte, the even element in the low nibble; codes 0, 0.5, 1, 1.5, 2, 3, 4, 6 -> 0..7, sign 8
HAND_PACKED = [
    [0x07] + [0x00] * 7,
    [0x67, 0x45, 0x23, 0x01, 0xEF, 0xCD, 0xAB, 0x09],
    [0x56] * 8,
    [0x66] * 4 + [0xEE] * 4,
    [0x00] * 8,
]


# A sixth block on which the metrics disagree: [6, 5, 5, 1 x 13].
# 6 (s 1): 6 exact, 5 -> 4 (a tie, to the even code), errors 1, 1; 1 exact: sse 2, sae 2.
# 4 (s 1.5): 6/1.5 = 4 exact, 5/1.5 = 3.33 -> 3 (4.5: errors 0.5), 1/1.5 = 0.67 -> 0.5 (0.75: errors 0.25):
# sse 2 * 0.25 + 13 * 0.0625 = 1.3125 < 2 -> mse keeps 4; sae 1 + 13 * 0.25 = 4.25 > 2 -> mae keeps 6.
DISAGREE = [6.0, 5.0, 5.0] + [1.0] * 13
DISAGREE_BYTES = {  # (use_four, scale byte, packed)
    "mse": (True, 0x3C, [0x56, 0x15] + [0x11] * 6),
    "mae": (False, 0x38, [0x67, 0x26] + [0x22] * 6),
}


@pytest.mark.parametrize("metric", ["mse", "mae"])
def test_four_over_six_hand_blocks(metric):
    x = torch.tensor(sum(HAND_BLOCKS, []) + DISAGREE, dtype=torch.float32).reshape(1, 96)
    assert four_over_six_global_scale(x.unsqueeze(0)).item() == 1.0
    packed, scale, g, four = quantize_nvfp4_four_over_six(x, metric=metric)
    four6, byte6, packed6 = DISAGREE_BYTES[metric]
    assert g.item() == 1.0
    assert four.tolist() == [HAND_FOUR + [four6]]
    assert scale.view(torch.uint8).tolist() == [HAND_SCALE_BYTES + [byte6]]
    assert packed.tolist() == [sum(HAND_PACKED, []) + packed6]


def _np_e2m1(v):
    return np.clip(v, -6, 6).astype(np.float32).astype(ml_dtypes.float4_e2m1fn).astype(np.float64)


def _np_e4m3(v):
    return np.asarray(v, np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)


def _oracle_four_over_six(x, metric):
    """float64 4/6 of a [n, k] numpy matrix (its own decode global scale amax / 1536)."""
    amax = np.float32(np.abs(x).max())
    g = np.float32(amax / np.float32(1536.0))
    blocks = x.reshape(-1, 16)
    out = []
    for b in blocks:
        bamax = np.float32(np.abs(b).max())
        errs, cands = [], []
        for m in (6.0, 4.0):
            raw = np.float32(bamax / np.float32(np.float32(m) * g))
            s = _np_e4m3(1.0 if raw == 0 else raw)
            step = np.float32(s * g)
            e = _np_e2m1((b / step).astype(np.float32)) if step != 0 else np.zeros(16)
            d = e * np.float64(step) - b.astype(np.float64)
            errs.append(float((d * d).sum() if metric == "mse" else np.abs(d).sum()))
            cands.append(s)
        out.append((errs[1] < errs[0], cands[1] if errs[1] < errs[0] else cands[0]))
    return out


@pytest.mark.parametrize("metric", ["mse", "mae"])
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), spread=st.floats(0.1, 4.0))
def test_four_over_six_matches_a_float64_oracle(metric, seed, spread):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(4, 64, generator=g) * torch.exp(spread * torch.randn(4, 1, generator=g))).to(torch.bfloat16)
    _, scale, _, four = quantize_nvfp4_four_over_six(x, metric=metric)
    want = _oracle_four_over_six(x.float().numpy(), metric)
    assert four.reshape(-1).tolist() == [w[0] for w in want]
    assert scale.float().reshape(-1).tolist() == [float(w[1]) for w in want]


def test_four_over_six_six_blocks_are_round_to_nearest():
    """Under round-to-nearest's global scale, every block that keeps 6 has quantize_nvfp4's bytes."""
    x = torch.randn(3, 16, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    x[0, 0, :7] = -0.0
    x[1, 2, :16] = 0.0
    ws2 = R.nvfp4_weight_scale_2(x)
    p, s, g, four = quantize_nvfp4_four_over_six(x, ws2)
    rp, rs, rg = R.quantize_nvfp4(x, ws2)
    assert torch.equal(g, rg) and 0 < int(four.sum()) < four.numel()
    codes, rcodes = (R.unpack_codes(t, "e2m1").reshape(3, 16, 4, 16) for t in (p, rp))
    assert torch.equal(codes[~four], rcodes[~four])
    assert torch.equal(s.view(torch.uint8)[~four], rs.view(torch.uint8)[~four])


def test_four_over_six_bad_input():
    with pytest.raises(ValueError, match=r"metric: expected one of \['mse', 'mae'\], got 'l2'"):
        quantize_nvfp4_four_over_six(torch.ones(2, 16), metric="l2")
    with pytest.raises(ValueError, match="k=24 is not a multiple of block_size=16"):
        quantize_nvfp4_four_over_six(torch.ones(2, 24))
    with pytest.raises(ValueError, match="finite"):
        quantize_nvfp4_four_over_six(torch.full((2, 16), float("inf")))
    with pytest.raises(ValueError, match=r"global_scale_kind: expected one of \['decode', 'encode'\]"):
        quantize_nvfp4_four_over_six(torch.ones(2, 16), global_scale_kind="x")


# ----------------------------------------------------------------------------- MSE search, brute force

E4M3_ALL = np.arange(0, 256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
E4M3_CANDIDATES = np.sort(E4M3_ALL[np.isfinite(E4M3_ALL) & (E4M3_ALL > 0)])  # 126 values, 2**-9 .. 448


def test_nvfp4_candidates_are_every_finite_positive_e4m3():
    assert len(E4M3_CANDIDATES) == 126 and E4M3_CANDIDATES[0] == 2.0**-9 and E4M3_CANDIDATES[-1] == 448.0
    assert nvfp4_scale_candidates().numpy().tolist() == E4M3_CANDIDATES.tolist()


def _brute_nvfp4(x, g, kind, weight=None):
    """Every e4m3 candidate (round-to-nearest's first) of every block, float64 error, first minimum."""
    blocks = x.reshape(-1, 16).astype(np.float32)
    wts = None if weight is None else np.broadcast_to(weight, x.shape).reshape(-1, 16).astype(np.float64)
    g = np.float32(g)
    scales, codes = [], []
    for bi, b in enumerate(blocks):
        bamax = np.float32(np.abs(b).max())
        raw = (
            np.float32(bamax / np.float32(np.float32(6.0) * g))
            if kind == "decode"
            else np.float32(g * np.float32(bamax / np.float32(6.0)))
        )
        rtn = _np_e4m3(1.0 if raw == 0 else raw)
        best = None
        for s in [rtn, *E4M3_CANDIDATES]:
            step = np.float32(s * g) if kind == "decode" else np.float32(s / g)
            e = _np_e2m1((b / step).astype(np.float32)) if step != 0 else np.zeros(16)
            d = e * np.float64(step) - b.astype(np.float64)
            err = float(((d * d) * (1.0 if wts is None else wts[bi])).sum())
            if best is None or err < best[0]:
                best = (err, s, e)
        scales.append(best[1])
        codes.append(best[2])
    return np.array(scales, np.float32), np.stack(codes)


@pytest.mark.parametrize("kind", ["decode", "encode"])
@pytest.mark.parametrize("normalization", [448.0, 256.0])
@pytest.mark.parametrize("weighted", [False, True])
def test_nvfp4_search_equals_brute_force(kind, normalization, weighted):
    gen = torch.Generator().manual_seed(int(normalization) + weighted + (kind == "encode"))
    x = (torch.randn(2, 4, 64, generator=gen) * torch.exp(torch.randn(2, 4, 1, generator=gen))).to(torch.bfloat16)
    x[1, 3, :16] = 0.0
    weight = torch.rand(2, 1, 64, generator=gen) * 4 if weighted else None
    p, s, g, _ = search_nvfp4_scales(x, normalization=normalization, global_scale_kind=kind, weight=weight)
    for ex in range(2):
        amax = np.float32(x[ex].float().abs().max())
        div = np.float32(6.0 * normalization)
        g_want = np.float32(amax / div) if kind == "decode" else np.float32(div / amax)
        assert g[ex].item() == float(g_want)
        want_s, want_e = _brute_nvfp4(
            x[ex].float().numpy(), g_want, kind, None if weight is None else weight[ex].numpy()
        )
        assert s[ex].float().reshape(-1).numpy().tolist() == want_s.tolist()
        got_e = R.decode_element(R.unpack_codes(p[ex], "e2m1"), "e2m1").double().reshape(-1, 16).numpy()
        assert np.array_equal(np.abs(got_e), np.abs(want_e)) and np.array_equal(got_e[want_e != 0], want_e[want_e != 0])


_NP_ELEMENT = {"e2m1": ml_dtypes.float4_e2m1fn, "e2m3": ml_dtypes.float6_e2m3fn, "e3m2": ml_dtypes.float6_e3m2fn}
_SPEC = {"e2m1": (1, 2, 6.0), "e2m3": (3, 2, 7.5), "e3m2": (2, 4, 28.0)}  # mbits, emax, max (OCP MX v1.0 tables)


def _even_byte(amax, element):
    """Quark's ``even`` E8M0 byte, from the spec: amax's mantissa rounded half up to mbits, then floor(log2) - emax."""
    mbits, emax, _ = _SPEC[element]
    if amax == 0:
        return 0
    m, e = math.frexp(float(amax))  # amax = m * 2**e, m in [0.5, 1)
    m, e = 2 * m, e - 1  # m in [1, 2)
    if m >= 2 - 2.0 ** -(mbits + 1):
        e += 1
    return min(max(e - emax + 127, 0), 254)


@pytest.mark.parametrize("element,scheme", [("e2m1", "mxfp4"), ("e2m3", "mxfp6_e2m3"), ("e3m2", "mxfp6_e3m2")])
@pytest.mark.parametrize("weighted", [False, True])
def test_mx_search_equals_brute_force(element, scheme, weighted):
    gen = torch.Generator().manual_seed(len(scheme) + weighted)
    x = (torch.randn(3, 64, generator=gen) * torch.exp(torch.randn(3, 1, generator=gen))).to(torch.bfloat16)
    x[2, :32] = 0.0
    weight = torch.rand(1, 64, generator=gen) * 4 if weighted else None
    p, s, _ = search_mx_scales(x, scheme, weight=weight)
    _, _, mx = _SPEC[element]
    wts = None if weight is None else weight.expand(3, 64).double().numpy().reshape(-1, 32)
    blocks = x.float().numpy().reshape(-1, 32)
    want_b, want_v = [], []
    for bi, b in enumerate(blocks):
        b0 = _even_byte(np.abs(b).max(), element)
        best = None
        for d in (0, -1, 1, -2, 2):
            byte = min(max(b0 + d, 0), 254)
            sc = 2.0 ** (byte - 127)
            v = np.clip(b / np.float32(sc), -mx, mx).astype(np.float32).astype(_NP_ELEMENT[element]).astype(np.float64)
            diff = v * sc - b.astype(np.float64)
            err = float(((diff * diff) * (1.0 if wts is None else wts[bi])).sum())
            if best is None or err < best[0]:
                best = (err, byte, v)
        want_b.append(best[1])
        want_v.append(best[2])
    assert s.reshape(-1).tolist() == want_b
    got = R.decode_element(R.unpack_codes(p, element), element).double().numpy().reshape(-1, 32)
    assert np.array_equal(got, np.stack(want_v))


# ----------------------------------------------------------------------------- never worse than RTN


def _nvfp4_block_sse(packed, scale, g, x):
    v = R.decode_element(R.unpack_codes(packed, "e2m1"), "e2m1").double()
    step = (scale.float() * g.float()).double()  # the fp32 step, as the dequantization computes it
    d = v.reshape(*scale.shape, 16) * step.unsqueeze(-1) - x.double().reshape(*scale.shape, 16)
    return (d * d).sum(-1)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), spread=st.floats(0.0, 6.0), rows=st.integers(1, 4))
def test_searches_never_worse_than_round_to_nearest(seed, spread, rows):
    gen = torch.Generator().manual_seed(seed)
    x = (
        torch.randn(rows, 64, generator=gen)
        * torch.exp(spread * torch.randn(rows, 4, 1, generator=gen))
        .reshape(rows, 1, 4)
        .repeat_interleave(16, -1)
        .reshape(rows, 64)
    ).to(torch.bfloat16)
    rp, rs, rg = R.quantize_nvfp4(x)
    rtn = _nvfp4_block_sse(rp, rs, rg, x)
    p, s, g, err = search_nvfp4_scales(x)
    assert g.item() == rg.item()
    got = _nvfp4_block_sse(p, s, g, x)
    assert torch.equal(got, err) and bool((got <= rtn).all())
    # 4/6 + MSE never worse than 4/6 (the same global scale, amax / 1536)
    fp, fs, fg, _ = quantize_nvfp4_four_over_six(x)
    p46, s46, g46, _ = search_nvfp4_scales(x, normalization=256.0)
    assert g46.item() == fg.item()
    assert bool((_nvfp4_block_sse(p46, s46, g46, x) <= _nvfp4_block_sse(fp, fs, fg, x)).all())
    for element, scheme in (("e2m1", "mxfp4"), ("e3m2", "mxfp6_e3m2")):
        mp, ms = R.quantize_mx(x, element, 32, "even")
        qp, qs, _ = search_mx_scales(x, scheme)

        def sse(pk, sc):
            d = R.dequantize_mx(pk, sc, element, 32, torch.float32).double() - x.double()
            return (d * d).reshape(rows, 2, 32).sum(-1)

        assert bool((sse(qp, qs) <= sse(mp, ms)).all())


def test_mx_search_radius_zero_is_round_to_nearest():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    x[0, :3] = -0.0
    for element, scheme in (("e2m1", "mxfp4"), ("e2m3", "mxfp6_e2m3")):
        p, s, _ = search_mx_scales(x, scheme, radius=0)
        rp, rs = R.quantize_mx(x, element, 32, "even")
        assert torch.equal(p, rp) and torch.equal(s, rs)


def test_search_bad_input():
    with pytest.raises(ValueError, match="expected an OCP MX format, got nvfp4"):
        search_mx_scales(torch.ones(2, 32), "nvfp4")
    with pytest.raises(ValueError, match="radius: expected a non-negative int, got -1"):
        search_mx_scales(torch.ones(2, 32), "mxfp4", radius=-1)
    with pytest.raises(ValueError, match="global_scale: expected 2 values"):
        search_nvfp4_scales(torch.ones(2, 4, 16), torch.ones(3))


# ----------------------------------------------------------------------------- 4/6 activations

# vLLM's QDQ at encode global scale gs = 1: s = e4m3(amax * fp32(1/6)), q = 1 / s, dq = e2m1(x * q) * s;
# 4/6 also s4 = e4m3(amax / 4), q4 = fp32(1 / s4), keeping 4 where its squared error is smaller.
ACT_BLOCKS = [
    # 6 and 4.5: s 1 gives 6, 4 (error 8 * 0.25); s4 1.5, q4 fp32(2/3): 4.0000002 -> 4, 3.0000002 -> 3, exact -> 4
    ([6.0, 4.5] * 8, [6.0, 4.0] * 8, [6.0, 4.5] * 8),
    # on 6's grid at s 1: exact (4 would give 6, 4.5, 3, 2.25, ...) -> 6
    (_HALF6 + [-v for v in _HALF6], _HALF6 + [-v for v in _HALF6], _HALF6 + [-v for v in _HALF6]),
    # saturating: s e4m3(0.8333334) = 0.8125, 5 * fp32(1/0.8125) = 6.15 -> 6 -> 4.875; s4 1.25, 5 * 0.8 = 4 -> 5
    ([5.0] * 8 + [-5.0] * 8, [4.875] * 8 + [-4.875] * 8, [5.0] * 8 + [-5.0] * 8),
    ([0.0] * 16, [0.0] * 16, [0.0] * 16),
]


@pytest.mark.parametrize("ops", ["reference", "kernels"])
def test_activation_four_over_six_hand_blocks(ops):
    from mxlib.kernels import quant as Q

    qdq = R.ref_nvfp4_quant_dequant if ops == "reference" else OnKernelDevice(Q).ref_nvfp4_quant_dequant
    x = torch.tensor([b[0] for b in ACT_BLOCKS], dtype=torch.float32).reshape(1, -1)
    gs = torch.ones(1)
    assert qdq(x, gs).tolist() == [sum((b[1] for b in ACT_BLOCKS), [])]
    assert qdq(x, gs, block_rule="four_over_six").tolist() == [sum((b[2] for b in ACT_BLOCKS), [])]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("per_row", [False, True])
def test_activation_four_over_six_kernel_equals_reference(dtype, per_row):
    from mxlib.kernels import quant as Q

    kq = OnKernelDevice(Q)
    gen = torch.Generator().manual_seed(7 + per_row)
    x = (torch.randn(12, 128, generator=gen) * torch.exp(2 * torch.randn(12, 1, generator=gen))).to(dtype)
    x[0, 3], x[1, 20], x[2, 40], x[3, :16] = float("nan"), float("inf"), -float("inf"), 0.0
    x[4, :16] = 1e-30
    gs = torch.rand(12 if per_row else 1, generator=gen) * 1e3 + 1
    for rule in ("amax", "four_over_six"):
        want = R.ref_nvfp4_quant_dequant(x, gs, block_rule=rule)
        assert_bits_equal(kq.ref_nvfp4_quant_dequant(x, gs, block_rule=rule), want, rule)
    four = R.ref_nvfp4_quant_dequant(x, gs, block_rule="four_over_six")
    six = R.ref_nvfp4_quant_dequant(x, gs)
    assert bool((four != six).any())  # the rule changes some blocks here


def test_activation_block_rule_bad_input():
    from mxlib.kernels import quant as Q

    for qdq in (R.ref_nvfp4_quant_dequant, Q.ref_nvfp4_quant_dequant):
        with pytest.raises(ValueError, match=r"block_rule: expected one of \['amax', 'four_over_six'\], got 'x'"):
            qdq(torch.ones(1, 16), torch.ones(1), block_rule="x")


def test_experts_four_over_six_activations():
    """The experts QDQ a1 and a2 by 4/6 under 256/448 times the calibrated global scales: the torch backend
    equals an assembly of mxlib.reference calls, the triton backend equals the torch one bit for bit."""
    from mxlib.moe.factory import make_emulation_experts, quantize_expert_weights
    from mxlib.moe.reference_moe import torch_moe

    gen = torch.Generator().manual_seed(11)
    e, h, i, m, k = 4, 64, 32, 6, 2
    w13 = (torch.randn(e, 2 * i, h, generator=gen) * 0.1).to(torch.bfloat16)
    w2 = (torch.randn(e, h, i, generator=gen) * 0.1).to(torch.bfloat16)
    x = torch.randn(m, h, generator=gen).to(torch.bfloat16)
    tw = torch.rand(m, k, generator=gen)
    ti = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(m)]).to(torch.int32)
    weights = quantize_expert_weights(w13, w2, "nvfp4", ops=R)
    in13 = torch.full((e,), float(x.float().abs().amax()) / 2688.0)
    in2 = torch.full((e,), 0.02 / 2688.0)
    dev = {"torch": "cpu", "triton": KERNEL_DEVICE}
    ex = {
        b: make_emulation_experts(
            "nvfp4",
            weights.to(dev[b]),
            in13.to(dev[b]),
            in2.to(dev[b]),
            backend=b,
            activation_block_rule="four_over_six",
        )
        for b in ("torch", "triton")
    }
    fp32_ratio = torch.tensor(256.0 / 448.0, dtype=torch.float32)
    gs1, gs2 = (1.0 / in13[:1]) * fp32_ratio, (1.0 / in2[:1]) * fp32_ratio
    assert_bits_equal(ex["torch"].a13_gscale[:1], gs1)

    def deq(p, s, g):
        return torch.stack([R.dequantize_to_dtype(p[j], s[j], g[j], torch.bfloat16) for j in range(e)])

    w13d = deq(weights.w13_weight, weights.w13_weight_scale, weights.w13_weight_scale_2)
    w2d = deq(weights.w2_weight, weights.w2_weight_scale, weights.w2_weight_scale_2)
    a1 = R.ref_nvfp4_quant_dequant(x, gs1, block_rule="four_over_six")
    want = torch_moe(
        a1, w13d, w2d, tw, ti, lambda v, rows: R.ref_nvfp4_quant_dequant(v, gs2, block_rule="four_over_six")
    )
    with torch.no_grad():
        got = ex["torch"](x, tw, ti)
        assert_bits_equal(got, want, "torch")
        on = (t.to(KERNEL_DEVICE) for t in (x, tw, ti))
        assert_bits_equal(ex["triton"](*on).cpu(), got, "triton")
        amax = make_emulation_experts("nvfp4", weights, in13, in2, backend="torch")(x, tw, ti)
    assert not torch.equal(amax, got)


def test_experts_four_over_six_refusals():
    from mxlib.moe.factory import make_emulation_experts, quantize_expert_weights

    w13, w2 = torch.randn(2, 64, 32).to(torch.bfloat16), torch.randn(2, 32, 32).to(torch.bfloat16)
    nv = quantize_expert_weights(w13, w2, "nvfp4", ops=R)
    ins = torch.full((2,), 0.01)
    with pytest.raises(ValueError, match="activation_block_rule: expected one of"):
        make_emulation_experts("nvfp4", nv, ins, ins, activation_block_rule="x")
    with pytest.raises(ValueError, match="runs with static activation scales .* per_token"):
        make_emulation_experts("nvfp4", nv, scale_strategy="per_token", activation_block_rule="four_over_six")
    with pytest.raises(ValueError, match="numerics hardware"):
        make_emulation_experts("nvfp4", nv, ins, ins, numerics="hardware", activation_block_rule="four_over_six")
    ex = make_emulation_experts("nvfp4", nv, ins, ins, activation_block_rule="four_over_six")
    with pytest.raises(ValueError, match="per_token"):
        ex.set_scale_strategy("per_token")
    mx = quantize_expert_weights(w13, w2, "mxfp4", ops=R)
    with pytest.raises(ValueError, match="applies to NVFP4 activations; w_mxfp4_a_mxfp4 has none"):
        make_emulation_experts("w_mxfp4_a_mxfp4", mx, activation_block_rule="four_over_six")


def test_fp4_kernel_four_over_six_activations():
    """The FP4 kernel's activation QDQ by 4/6 (A-tile load and GEMM1's epilogue): a1 fused in the load
    or in its own pass give the same bits; the output follows the torch backend's 4/6, not the amax rule."""
    from mxlib.kernels.tiles import TileConfig
    from mxlib.moe.factory import make_emulation_experts, quantize_expert_weights

    gen = torch.Generator().manual_seed(12)
    e, h, i, m, k = 2, 128, 128, 4, 2
    w13 = (torch.randn(e, 2 * i, h, generator=gen) * 0.1).to(torch.bfloat16)
    w2 = (torch.randn(e, h, i, generator=gen) * 0.1).to(torch.bfloat16)
    x = torch.randn(m, h, generator=gen) * torch.exp(torch.randn(m, h // 16, generator=gen)).repeat_interleave(16, 1)
    x = x.to(torch.bfloat16)
    tw = torch.rand(m, k, generator=gen)
    ti = torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0]], dtype=torch.int32)
    weights = quantize_expert_weights(w13, w2, "nvfp4", ops=R)
    in13 = torch.full((e,), float(x.float().abs().amax()) / 2688.0)
    in2 = torch.full((e,), 0.05 / 2688.0)

    def experts(backend, rule, dev="cpu"):
        w, a, b = weights.to(dev), in13.to(dev), in2.to(dev)
        return make_emulation_experts("nvfp4", w, a, b, backend=backend, activation_block_rule=rule)

    with torch.no_grad():
        ref46, ref6 = experts("torch", "four_over_six")(x, tw, ti), experts("torch", "amax")(x, tw, ti)
        fused = experts("fused", "four_over_six", KERNEL_DEVICE)
        assert fused.fp4_weights() is not None  # the FP4 kernel runs these experts
        on = [t.to(KERNEL_DEVICE) for t in (x, tw, ti)]
        out = fused(*on).cpu()
        cfg = (TileConfig(32, 32, None, 2, 4, 1, a1_fused=False), TileConfig(16, 64, None, 1, 4, 1))
        fused.fp4_config = cfg
        standalone = fused(*on)
        fused.fp4_config = (TileConfig(32, 32, None, 2, 4, 1, a1_fused=True), cfg[1])
        assert_bits_equal(fused(*on), standalone, "a1 in the A-tile load vs its own pass")

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm())

    assert rel(out, ref46) < 5e-3 < rel(ref6, ref46)


class _Diagonal:
    """A test-local importance: ``.diagonal(layer) -> (a1 [E, H], a2 [E, I])``."""

    def __init__(self, a1, a2):
        self.a1, self.a2, self.layers = a1, a2, []

    def diagonal(self, layer):
        self.layers.append(layer)
        return self.a1, self.a2


@pytest.mark.parametrize("scheme", ["nvfp4", "w_mxfp4_a_mxfp4"])
def test_mse_technique_weights_by_the_importance(scheme):
    from mxlib.moe.schemes import get_moe_scheme
    from mxlib.recovery import get_technique

    gen = torch.Generator().manual_seed(13)
    e, h, i = 2, 64, 32
    w13 = torch.randn(e, 2 * i, h, generator=gen).to(torch.bfloat16)
    w2 = torch.randn(e, h, i, generator=gen).to(torch.bfloat16)
    imp = _Diagonal(torch.rand(e, h, generator=gen) * 10, torch.rand(e, i, generator=gen) * 10)
    got = get_technique("mse", importance=imp).quantize_experts(w13, w2, get_moe_scheme(scheme), layer=3)
    assert imp.layers == [3]
    if scheme == "nvfp4":
        p13, s13, g13, _ = search_nvfp4_scales(w13, weight=imp.a1.unsqueeze(1))
        p2, s2, g2, _ = search_nvfp4_scales(w2, weight=imp.a2.unsqueeze(1))
        assert torch.equal(got.w13_weight_scale_2, g13) and torch.equal(got.w2_weight_scale_2, g2)
    else:
        p13, s13, _ = search_mx_scales(w13, "mxfp4", weight=imp.a1.unsqueeze(1))
        p2, s2, _ = search_mx_scales(w2, "mxfp4", weight=imp.a2.unsqueeze(1))
    for a, b in ((got.w13_weight, p13), (got.w13_weight_scale, s13), (got.w2_weight, p2), (got.w2_weight_scale, s2)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    plain = get_technique("mse").quantize_experts(w13, w2, get_moe_scheme(scheme), layer=3)
    assert not torch.equal(plain.w13_weight_scale.view(torch.uint8), got.w13_weight_scale.view(torch.uint8))
    bad = _Diagonal(torch.rand(e, h + 1), imp.a2)
    with pytest.raises(ValueError, match=r"importance.diagonal\(3\): a1 expected shape \[2, 64\], got \[2, 65\]"):
        get_technique("mse", importance=bad).quantize_experts(w13, w2, get_moe_scheme(scheme), layer=3)
    with pytest.raises(ValueError, match="four_over_six quantizes NVFP4 weights only, got mxfp4"):
        get_technique("four_over_six").quantize_experts(w13, w2, get_moe_scheme("w_mxfp4"), layer=0)
