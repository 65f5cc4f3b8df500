"""mxlib.reference against independent oracles (tests/oracles.py), bit for bit."""

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mxlib import reference as R
from mxlib.formats import ELEMENT_FORMATS

from _util import assert_bits_equal
from oracles import (
    FORMATS,
    modelopt_nvfp4_quantize,
    mx_qdq,
    mx_scale_exponent,
    round_elements,
    vllm_dequantize_to_dtype,
    vllm_nvfp4_qdq,
)

ELEMENTS = list(FORMATS)
MODES = ["floor", "even", "rceil"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def heavy_tailed(shape, seed, dtype=torch.float32):
    """Gaussian bodies with per-row log-normal scales, Laplace tails and a few outliers."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(2.0 * torch.randn(*shape[:-1], 1, generator=g))
    lap = torch.distributions.Laplace(0.0, 1.0).sample(shape) if seed % 2 else 0.0
    x = x + lap
    out = torch.rand(shape, generator=g) < 0.01
    x = torch.where(out, x * 1000.0, x)
    return x.to(dtype)


# ----------------------------------------------------------------------------- elements


def _grid_probe_values(element):
    """Every finite grid value, every midpoint, and their fp32 neighbours, both signs."""
    f = ELEMENT_FORMATS[element]
    fin = sorted({abs(v) for v in f.values() if math.isfinite(v)})
    mids = [(a + b) / 2 for a, b in zip(fin[:-1], fin[1:])]
    pts = np.array(fin + mids + [f.max * 1.01, f.max * 4, 1e30, f.min_subnormal / 2, f.min_subnormal / 4], np.float32)
    nudged = np.concatenate([pts, np.nextafter(pts, np.float32(np.inf)), np.nextafter(pts, np.float32(0))])
    return np.concatenate([nudged, -nudged]).astype(np.float32)


@pytest.mark.parametrize("element", ELEMENTS)
def test_round_to_element_grid_midpoints_and_neighbours(element):
    x = _grid_probe_values(element)
    got = R.round_to_element(torch.from_numpy(x), element)
    assert_bits_equal(got, torch.from_numpy(round_elements(x, element)))


@pytest.mark.parametrize("element", ELEMENTS)
def test_round_to_element_random_full_range(element):
    g = np.random.default_rng(1)
    x = (g.standard_normal(200_000) * np.exp2(g.uniform(-40, 40, 200_000))).astype(np.float32)
    x = np.concatenate([x, np.array([0.0, -0.0, 1e-45, -1e-40, 3e38, -3e38], np.float32)])
    got = R.round_to_element(torch.from_numpy(x), element)
    assert_bits_equal(got, torch.from_numpy(round_elements(x, element)))


@pytest.mark.parametrize("element", ELEMENTS)
def test_round_to_element_specials(element):
    f = ELEMENT_FORMATS[element]
    got = R.round_to_element(torch.tensor([math.inf, -math.inf, math.nan]), element)
    assert got[0] == f.max and got[1] == -f.max and math.isnan(got[2])


@pytest.mark.parametrize("element", ELEMENTS)
def test_encode_decode_every_code(element):
    f = ELEMENT_FORMATS[element]
    mld = FORMATS[element][0]
    codes = torch.arange(f.num_codes, dtype=torch.uint8)
    values = R.decode_element(codes, element)
    expected = torch.from_numpy(np.arange(f.num_codes, dtype=np.uint8).view(mld).astype(np.float32))
    assert_bits_equal(values, expected)
    finite = torch.isfinite(values)
    assert torch.equal(R.encode_element(values[finite], element), codes[finite])
    # ml_dtypes is an independent encoder for in-range values
    x = np.clip(values[finite].numpy(), -f.max, f.max)
    assert torch.equal(R.encode_element(torch.from_numpy(x), element), torch.from_numpy(x.astype(mld).view(np.uint8)))


def _encode_probes(element: str) -> np.ndarray:
    """Random values over fp32's range, every code's value, every midpoint between neighbouring values and the
    fp32 numbers just either side of it, zeros of both signs, subnormal fp32, huge values and the specials."""
    f = ELEMENT_FORMATS[element]
    g = np.random.default_rng(7)
    x = (g.standard_normal(100_000) * np.exp2(g.uniform(-40, 40, 100_000))).astype(np.float32)
    values = np.unique(R.decode_element(torch.arange(f.num_codes, dtype=torch.uint8), element).numpy())
    values = values[np.isfinite(values)]
    mids = ((values[:-1].astype(np.float64) + values[1:]) / 2).astype(np.float32)  # exact: few significant bits
    edges = np.concatenate([mids, values])
    specials = np.array([0.0, -0.0, 1e-45, -1e-45, 1e-40, 3e38, -3e38, np.inf, -np.inf, np.nan, -np.nan], np.float32)
    return np.concatenate(
        [x, edges, np.nextafter(edges, np.float32(np.inf)), np.nextafter(edges, np.float32(-np.inf)), specials]
    )


@pytest.mark.parametrize("element", ELEMENTS)
def test_encode_element_against_ml_dtypes_and_boundary_count(element):
    """Both methods of ``encode_element`` (FP8/FP6 by PyTorch's FP8 conversion, FP4 by counting boundaries) give
    ml_dtypes' codes for every finite value (clipped to +-max first: saturation), and the same codes as counting
    rounding boundaries for everything, NaN and Inf included."""
    f = ELEMENT_FORMATS[element]
    x = _encode_probes(element)
    got = R.encode_element(torch.from_numpy(x), element)
    finite = np.isfinite(x)
    mld = FORMATS[element][0]
    expected = np.clip(x[finite], -f.max, f.max).astype(mld).view(np.uint8)
    assert np.array_equal(got.numpy()[finite], expected)
    assert torch.equal(got, R._encode_by_boundaries(torch.from_numpy(x), f))


def test_encode_e2m1_sign_magnitude():
    """NVFP4's packer codes: ml_dtypes' e2m1 code of |x| with the sign bit only where x < 0 (-0 and NaN: +0)."""
    x = _encode_probes("e2m1")
    got = R.encode_e2m1_sign_magnitude(torch.from_numpy(x))
    mag = np.clip(np.nan_to_num(np.abs(x), nan=0.0), 0.0, 6.0).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    expected = mag | np.where(x < 0, 8, 0).astype(np.uint8)
    assert np.array_equal(got.numpy(), expected)
    zero_like = torch.tensor([-0.0, math.nan, -math.nan, 0.0])
    assert R.encode_e2m1_sign_magnitude(zero_like).tolist() == [0, 0, 0, 0]


def test_encode_nan():
    nan = torch.tensor([math.nan])
    assert R.encode_element(nan, "e4m3").item() & 0x7F == 0x7F
    assert math.isnan(R.decode_element(R.encode_element(nan, "e5m2"), "e5m2").item())
    assert R.encode_element(nan, "e2m1").item() == 0


# ----------------------------------------------------------------------------- E8M0


def _amax_probes():
    pts = [0.0, 1e-45, 1e-40, 2.0**-127, 2.0**-126, 1.0, 6.0, 7.0, 7.5, 28.0, 448.0, 960.0, 57344.0, 3.4e38]
    for base in (1.0, 2.0**-100, 2.0**50):
        for mant in (1.5, 1.75, 1.875, 1.9375, 1.96875, 1.99):
            pts.append(base * mant)
    g = np.random.default_rng(0)
    pts += list((np.abs(g.standard_normal(3000)) * np.exp2(g.uniform(-140, 127, 3000))).astype(np.float32))
    arr = np.array(pts, np.float32)
    return np.concatenate([arr, np.nextafter(arr, np.float32(np.inf)), np.nextafter(arr, np.float32(0))])


@pytest.mark.parametrize("element", ELEMENTS)
@pytest.mark.parametrize("mode", MODES)
def test_e8m0_rules_against_frexp_formula(element, mode):
    amax = np.concatenate([_amax_probes(), np.array([np.nan, np.inf], np.float32)])
    got = R.e8m0_scale(torch.from_numpy(amax), element, mode)
    expected = [mx_scale_exponent(float(a), element, mode) for a in amax]
    expected = torch.tensor([255 if e is None else e + 127 for e in expected], dtype=torch.uint8)
    assert torch.equal(got, expected)


def test_e8m0_decode():
    b = torch.arange(256, dtype=torch.uint8)
    v = R.decode_e8m0(b)
    expected = torch.tensor([math.ldexp(1.0, i - 127) for i in range(255)] + [math.nan])
    assert_bits_equal(v, expected)
    assert v[0].item() == 2.0**-127 and v[0].item() != 0.0
    if hasattr(torch, "float8_e8m0fnu"):
        assert_bits_equal(R.decode_e8m0(b.view(torch.float8_e8m0fnu)), expected)


# ----------------------------------------------------------------------------- packing


def test_pack_layouts_by_hand():
    assert R.pack_codes(torch.tensor([[1, 2]], dtype=torch.uint8), "e2m1").tolist() == [[0x21]]
    # 1 | 2 << 6 | 3 << 12 | 4 << 18 = 0x103081, little-endian
    assert R.pack_codes(torch.tensor([1, 2, 3, 4], dtype=torch.uint8), "e3m2").tolist() == [0x81, 0x30, 0x10]
    assert R.pack_codes(torch.tensor([7, 9], dtype=torch.uint8), "e4m3").tolist() == [7, 9]


@pytest.mark.parametrize("element", ELEMENTS)
def test_pack_roundtrip_every_code(element):
    f = ELEMENT_FORMATS[element]
    codes = torch.arange(f.num_codes, dtype=torch.uint8).repeat(4).reshape(2, -1)
    packed = R.pack_codes(codes, element)
    assert packed.shape[-1] == f.packed_size(codes.shape[-1])
    assert torch.equal(R.unpack_codes(packed, element), codes)


def test_pack_errors():
    with pytest.raises(ValueError, match="k=3 elements do not fill whole bytes"):
        R.pack_codes(torch.zeros(3, dtype=torch.uint8), "e2m1")
    with pytest.raises(ValueError, match="divisible by 3, got 4"):
        R.unpack_codes(torch.zeros(4, dtype=torch.uint8), "e2m3")


# ----------------------------------------------------------------------------- MX QDQ


@pytest.mark.parametrize("element", ELEMENTS)
@pytest.mark.parametrize("mode", MODES)
def test_mx_qdq_against_ml_dtypes_oracle(element, mode):
    x = heavy_tailed((64, 256), seed=hash((element, mode)) % 1000)
    x[0, :32] = 0.0
    x[1, 5] = 1e-41
    got = R.quant_dequant_mx(x, element, 32, mode)
    assert_bits_equal(got, torch.from_numpy(mx_qdq(x.numpy(), element, 32, mode)))


@pytest.mark.parametrize("element", ELEMENTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_dequantize_equals_qdq_2d_3d(element, dtype):
    for shape in [(8, 64), (3, 5, 96)]:
        x = heavy_tailed(shape, seed=7, dtype=dtype)
        packed, scale = R.quantize_mx(x, element)
        assert packed.dtype == torch.uint8 and scale.dtype == torch.uint8
        assert packed.shape == (*shape[:-1], ELEMENT_FORMATS[element].packed_size(shape[-1]))
        assert scale.shape == (*shape[:-1], shape[-1] // 32)
        for out_dtype in DTYPES:
            deq = R.dequantize_mx(packed, scale, element, dtype=out_dtype)
            assert_bits_equal(deq, R.quant_dequant_mx(x, element, dtype=out_dtype))


@pytest.mark.parametrize("element", ELEMENTS)
def test_single_rounding_to_output_dtype(element):
    x = heavy_tailed((16, 128), seed=3, dtype=torch.bfloat16)
    exact = R.quant_dequant_mx(x, element, dtype=torch.float32)
    for dt in (torch.bfloat16, torch.float16):
        assert_bits_equal(R.quant_dequant_mx(x, element, dtype=dt), exact.to(dt))
        assert_bits_equal(R.quant_dequant_mx(x.float(), element, dtype=dt), exact.to(dt))


def test_mx_nan_inf_blocks():
    x = torch.ones(2, 64)
    x[0, 3] = math.nan
    x[1, 40] = -math.inf
    packed, scale = R.quantize_mx(x, "e2m1")
    assert scale.tolist() == [[255, 125], [125, 255]]  # amax 1: floor(log2 1) - emax 2 = -2
    deq = R.dequantize_mx(packed, scale, "e2m1", dtype=torch.float32)
    assert torch.isnan(deq[0, :32]).all() and torch.isnan(deq[1, 32:]).all()
    assert (deq[0, 32:] == 1).all() and (deq[1, :32] == 1).all()
    assert (R.unpack_codes(packed, "e2m1")[0, :32] == 0).all()


@pytest.mark.parametrize("element", ELEMENTS)
def test_mx_nan_inf_blocks_store_code_zero_in_every_format(element):
    x = heavy_tailed((3, 96), seed=11)
    x[0, 3] = math.nan
    x[1, 40] = -math.inf
    x[2, 70] = -math.nan  # a NaN with its sign bit set
    packed, scale = R.quantize_mx(x, element)
    codes = R.unpack_codes(packed, element)
    for row, block in ((0, 0), (1, 1), (2, 2)):
        assert scale[row, block] == 255
        assert (codes[row, 32 * block : 32 * block + 32] == 0).all()
    deq = R.dequantize_mx(packed, scale, element, dtype=torch.float32)
    assert torch.isnan(deq[0, :32]).all() and torch.isnan(deq[1, 32:64]).all() and torch.isnan(deq[2, 64:]).all()
    assert_bits_equal(deq[0, 32:], R.quant_dequant_mx(x[0, 32:], element, dtype=torch.float32))


block_values = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.floats(min_value=-(2.0**-126), max_value=2.0**-126, width=32),
    st.sampled_from([0.0, -0.0, 0.25, -0.75, 2.5, 3.5, 5.0, 448.0, 480.0, 57344.0, 61440.0, 1e-45]),
    st.floats(min_value=-1e6, max_value=1e6, width=32).map(lambda v: v * 1e-3),
)
block_with_specials = st.one_of(block_values, st.sampled_from([math.nan, math.inf, -math.inf]))


@settings(max_examples=150, deadline=None)
@given(
    block=st.lists(st.one_of(block_values, block_values, block_values, block_with_specials), min_size=32, max_size=32),
    element=st.sampled_from(ELEMENTS),
    mode=st.sampled_from(MODES),
)
def test_mx_qdq_property(block, element, mode):
    x = np.array(block, np.float32).reshape(1, 32)
    got = R.quant_dequant_mx(torch.from_numpy(x), element, 32, mode)
    assert_bits_equal(got, torch.from_numpy(mx_qdq(x, element, 32, mode)))
    packed, scale = R.quantize_mx(torch.from_numpy(x), element, 32, mode)
    assert_bits_equal(R.dequantize_mx(packed, scale, element, 32, torch.float32), got)


# ----------------------------------------------------------------------------- NVFP4


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_nvfp4_qdq_against_vllm_transcription(dtype, seed):
    x = heavy_tailed((32, 256), seed=seed, dtype=dtype)
    x[0, :16] = 0.0
    x[1, :16] = -0.0
    x[2, 3] = -0.0
    gs = torch.tensor([2688.0 / float(x.float().abs().amax()) * (0.3, 1.0, 7.0)[seed]])
    got = R.ref_nvfp4_quant_dequant(x, gs, 16)
    assert_bits_equal(got, vllm_nvfp4_qdq(x, gs, 16))


def test_nvfp4_qdq_ties_and_thresholds():
    # Values that land exactly on e2m1 midpoints and e4m3 scale thresholds after scaling.
    gs = torch.tensor([1.0])
    rows = []
    for amax in (6.0, 12.0, 0.75, 448.0 * 6, 1e-3):
        for frac in (0.25 / 6, 0.75 / 6, 1.25 / 6, 1.75 / 6, 2.5 / 6, 3.5 / 6, 5.0 / 6):
            rows.append([amax] + [amax * frac] * 15)
    x = torch.tensor(rows, dtype=torch.float32)
    x = torch.cat([x, -x, torch.nextafter(x, torch.full_like(x, math.inf))])
    assert_bits_equal(R.ref_nvfp4_quant_dequant(x, gs, 16), vllm_nvfp4_qdq(x, gs, 16))


def test_nvfp4_qdq_3d_per_expert_scale_is_a_loop_of_2d():
    x = heavy_tailed((4, 8, 64), seed=5, dtype=torch.bfloat16)
    gs = torch.tensor([10.0, 200.0, 3000.0, 0.5])
    got = R.ref_nvfp4_quant_dequant(x, gs, 16)
    for e in range(4):
        assert_bits_equal(got[e], vllm_nvfp4_qdq(x[e], gs[e : e + 1], 16))


def test_nvfp4_nan_and_inf_blocks():
    x = torch.zeros(2, 32)
    x[0, 0] = math.nan
    x[0, 16:] = 1.0
    x[1, 0] = math.inf
    x[1, 1] = 3.0
    got = R.ref_nvfp4_quant_dequant(x, torch.tensor([2688.0]), 16)
    assert torch.isnan(got[0, :16]).all() and not torch.isnan(got[0, 16:]).any()
    assert not torch.isnan(got[1]).any() and torch.isfinite(got[1]).all()
    assert_bits_equal(got, vllm_nvfp4_qdq(x, torch.tensor([2688.0]), 16))


def test_nvfp4_divide_multiplier_differs_only_at_thresholds():
    x = heavy_tailed((256, 256), seed=11)
    gs = torch.tensor([2688.0 / float(x.abs().amax())])
    a = R.ref_nvfp4_quant_dequant(x, gs, multiplier="reciprocal")
    b = R.ref_nvfp4_quant_dequant(x, gs, multiplier="divide")
    differ = (a != b).float().mean().item()
    assert differ < 0.01  # rare threshold cases only
    assert torch.allclose(a, b, rtol=0.5, atol=0)  # one e2m1 step at most


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_to_dtype_against_vllm_transcription(dtype):
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (3, 16, 32), dtype=torch.uint8, generator=g)
    scale = R.round_to_element(torch.rand(3, 16, 4, generator=g) * 448, "e4m3").to(torch.float8_e4m3fn)
    gs = torch.tensor([1e-3, 0.37, 5.0])
    assert_bits_equal(
        R.dequantize_to_dtype(packed, scale, gs, dtype), vllm_dequantize_to_dtype(packed, scale, gs, dtype)
    )
    assert_bits_equal(
        R.dequantize_to_dtype(packed[1], scale[1], gs[1], dtype),
        vllm_dequantize_to_dtype(packed[1], scale[1], gs[1], dtype),
    )


def test_quantize_nvfp4_against_modelopt_transcription():
    w = heavy_tailed((64, 128), seed=4, dtype=torch.bfloat16)
    w[3, :16] = 0
    packed, scale, ws2 = R.quantize_nvfp4(w)
    p_ref, s_ref, ws2_ref = modelopt_nvfp4_quantize(w)
    assert torch.equal(ws2, ws2_ref)
    assert torch.equal(scale.view(torch.uint8), s_ref.view(torch.uint8))
    # Where a block scale underflows to e4m3 zero, ModelOpt divides by zero and stores
    # +-6 codes; mxlib stores zero codes. Both dequantize to zero; elsewhere codes agree.
    underflow = (s_ref.float() == 0).repeat_interleave(8, dim=-1)
    assert underflow.any()
    assert torch.equal(packed[~underflow], p_ref[~underflow])
    assert (packed[underflow] == 0).all()
    deq = R.dequantize_to_dtype(packed, scale, ws2, torch.float32)
    assert torch.equal(deq, vllm_dequantize_to_dtype(p_ref, s_ref, ws2_ref, torch.float32))
    # 3D: each expert is its own 2D quantization
    w3 = heavy_tailed((3, 32, 64), seed=6, dtype=torch.bfloat16)
    p3, s3, g3 = R.quantize_nvfp4(w3)
    for e in range(3):
        p, s, g = modelopt_nvfp4_quantize(w3[e])
        ok = (s.float() != 0).repeat_interleave(8, dim=-1)
        assert (
            torch.equal(p3[e][ok], p[ok]) and torch.equal(s3[e].view(torch.uint8), s.view(torch.uint8)) and g3[e] == g
        )


def test_quantize_nvfp4_zero_expert_and_zero_block_option():
    w = torch.zeros(2, 4, 32)
    w[1] = torch.randn(4, 32)
    packed, scale, ws2 = R.quantize_nvfp4(w)
    assert ws2[0] == 1.0 and torch.isfinite(ws2).all()
    assert (scale[0].float() == 1.0).all()
    _, scale0, _ = R.quantize_nvfp4(w, zero_block_scale="zero")
    assert (scale0[0].float() == 0.0).all()
    deq = R.dequantize_to_dtype(packed, scale, ws2, torch.float32)
    assert (deq[0] == 0).all() and torch.isfinite(deq).all()


def test_nvfp4_swizzle_matches_cublas_formula():
    m, kb = 200, 12
    s = torch.arange(m * kb, dtype=torch.int32).reshape(m, kb)
    sw = R.nvfp4_swizzle_scales(s).reshape(-1)
    kt = -(-kb // 4)
    for r in range(m):
        for c in range(kb):
            off = ((r // 128) * kt + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
            assert sw[off] == s[r, c]
    assert torch.equal(R.nvfp4_unswizzle_scales(sw, m, kb * 16), s)


def test_dequantize_to_dtype_swizzled():
    g = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (130, 40), dtype=torch.uint8, generator=g)
    scale = R.round_to_element(torch.rand(130, 5, generator=g) * 448, "e4m3").to(torch.float8_e4m3fn)
    lin = R.dequantize_to_dtype(packed, scale, 0.5, torch.float32)
    swz = R.dequantize_to_dtype(packed, R.nvfp4_swizzle_scales(scale), 0.5, torch.float32, swizzle=True)
    assert_bits_equal(swz, lin)


# ----------------------------------------------------------------------------- FP8 per tensor


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_per_tensor_against_torch_cast(dtype):
    x = heavy_tailed((32, 64), seed=9, dtype=dtype)
    scale = torch.tensor(float(x.float().abs().amax()) / 448.0 * 0.5)  # half the range: some clipping
    inv = 1.0 / scale
    q = torch.clamp(x.float() * inv, -448, 448).to(torch.float8_e4m3fn).float()
    assert_bits_equal(R.quant_dequant_fp8_per_tensor(x, scale), (q * scale).to(dtype))


# ----------------------------------------------------------------------------- errors


def test_errors_name_the_argument():
    with pytest.raises(
        TypeError, match="x: expected a floating tensor of dtype float32, bfloat16 or float16, got torch.int32"
    ):
        R.quant_dequant_mx(torch.zeros(2, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="x: K=48 is not a multiple of block_size=32"):
        R.quantize_mx(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="unknown element format 'e9m9'"):
        R.quantize_mx(torch.zeros(2, 32), "e9m9")
    with pytest.raises(ValueError, match="unknown scale_mode 'ceil'"):
        R.quant_dequant_mx(torch.zeros(2, 32), "e2m1", scale_mode="ceil")
    with pytest.raises(ValueError, match=r"scale: expected shape \[2, 1\] for packed \[2, 16\]"):
        R.dequantize_mx(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="divisible by 3"):
        R.dequantize_mx(torch.zeros(2, 25, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8), "e2m3")
    with pytest.raises(TypeError, match="packed: expected dtype uint8"):
        R.dequantize_mx(torch.zeros(2, 16), torch.zeros(2, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"global_scale: expected one element or a shape that is a prefix"):
        R.ref_nvfp4_quant_dequant(torch.zeros(4, 2, 16), torch.ones(3))
    with pytest.raises(TypeError, match="global_scale: expected a float32 tensor, got torch.float64"):
        R.ref_nvfp4_quant_dequant(torch.zeros(4, 16), torch.ones(1, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"tensor_sf: expected shape \[4, 2\], got \[4, 3\]"):
        R.dequantize_to_dtype(
            torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 3, dtype=torch.uint8), 1.0, torch.bfloat16
        )
    with pytest.raises(ValueError, match="x: NVFP4 weight quantization needs finite values"):
        R.quantize_nvfp4(torch.tensor([[math.nan] * 16]))
    with pytest.raises(ValueError, match="scale: expected a positive finite input_scale, got 0.0"):
        R.quant_dequant_fp8_per_tensor(torch.zeros(4), 0.0)
    with pytest.raises(ValueError, match="unknown scheme 'int4'"):
        R.quant_dequant(torch.zeros(2, 32), "int4")
    with pytest.raises(TypeError, match="dtype: expected float32, bfloat16 or float16, got torch.float64"):
        R.quant_dequant_mx(torch.zeros(2, 32), dtype=torch.float64)


# ----------------------------------------------------------------------------- torch storage dtypes


def _mx_input(k=256, rows=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, k, generator=g) * torch.logspace(-4, 4, k)).to(torch.bfloat16)


@pytest.mark.parametrize("element, dtype_name", [("e4m3", "float8_e4m3fn"), ("e5m2", "float8_e5m2")])
def test_fp8_packed_dtype_holds_the_codes_ml_dtypes_reads(element, dtype_name):
    x = _mx_input()
    packed, scale = R.quantize_mx(x, element, packed_dtype=getattr(torch, dtype_name))
    assert packed.dtype == getattr(torch, dtype_name) and scale.dtype == torch.uint8
    codes = R.quantize_mx(x, element)[0]
    assert torch.equal(packed.view(torch.uint8), codes)  # a view of the same bytes
    # the values torch reads from the dtype are the ones ml_dtypes reads from the bytes
    want = codes.numpy().view(getattr(ml_dtypes, dtype_name)).astype(np.float32)
    np.testing.assert_array_equal(packed.float().numpy(), want)
    # dequantize_mx takes the dtype as is
    assert_bits_equal(R.dequantize_mx(packed, scale, element), R.dequantize_mx(codes, scale, element))


@pytest.mark.skipif(not hasattr(torch, "float8_e8m0fnu"), reason="this torch has no float8_e8m0fnu")
def test_e8m0fnu_scale_dtype_decodes_to_the_hand_computed_powers_of_two():
    x = _mx_input()
    _, scale = R.quantize_mx(x, "e2m1", scale_dtype=torch.float8_e8m0fnu)
    assert scale.dtype == torch.float8_e8m0fnu
    b = scale.view(torch.uint8).to(torch.int64)
    hand = torch.tensor([2.0 ** (int(v) - 127) for v in b.reshape(-1)]).reshape(b.shape)
    assert_bits_equal(scale.float(), hand.float())  # torch's own decode of the dtype
    assert_bits_equal(R.decode_e8m0(scale), hand.float())
    want = b.to(torch.uint8).numpy().view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    np.testing.assert_array_equal(scale.float().numpy(), want)


@pytest.mark.skipif(not hasattr(torch, "float4_e2m1fn_x2"), reason="this torch has no float4_e2m1fn_x2")
def test_fp4x2_packed_dtype_in_and_out():
    x = _mx_input()
    packed, scale = R.quantize_mx(x, torch.float4_e2m1fn_x2, packed_dtype=torch.float4_e2m1fn_x2)
    codes, scale_u8 = R.quantize_mx(x, "e2m1")
    assert packed.dtype == torch.float4_e2m1fn_x2 and torch.equal(packed.view(torch.uint8), codes)
    assert torch.equal(scale, scale_u8)
    # the low nibble is the even element: by hand on the first byte, against ml_dtypes' e2m1 values
    lo, hi = int(codes[0, 0]) & 0xF, int(codes[0, 0]) >> 4
    e2m1 = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    s = float(R.decode_e8m0(scale_u8[0, 0]))
    dq = R.dequantize_mx(packed, scale, "e2m1", dtype=torch.float32)
    assert (float(dq[0, 0]), float(dq[0, 1])) == (e2m1[lo] * s, e2m1[hi] * s)
    assert_bits_equal(dq, R.dequantize_mx(codes, scale_u8, "e2m1", dtype=torch.float32))
    p13, s13, g13 = R.quantize_nvfp4(x.float().reshape(1, 8, 256))
    assert_bits_equal(
        R.dequantize_to_dtype(p13.view(torch.float4_e2m1fn_x2), s13, g13, torch.float32),
        R.dequantize_to_dtype(p13, s13, g13, torch.float32),
    )


@pytest.mark.parametrize(
    "element, kwargs, match",
    [
        ("e3m2", dict(packed_dtype=torch.float8_e4m3fn), "packed_dtype: expected torch.uint8 or one of \\[\\]"),
        ("e4m3", dict(packed_dtype=torch.float8_e5m2), "packed_dtype: expected .*float8_e4m3fn.*got torch.float8_e5m2"),
        ("e2m1", dict(scale_dtype=torch.float32), "scale_dtype: expected torch.uint8 .*got torch.float32"),
    ],
)
def test_storage_dtypes_that_do_not_hold_the_format_are_refused(element, kwargs, match):
    with pytest.raises(TypeError, match=match):
        R.quantize_mx(_mx_input(), element, **kwargs)
