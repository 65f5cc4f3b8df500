"""Triton quantize / dequantize / QDQ kernels against mxlib.reference, bit for bit.

Runs in the Triton interpreter on the CPU (conftest sets TRITON_INTERPRET=1) and
compiled on a GPU. Shapes stay small for the interpreter.
"""

import math

import pytest
import torch

from mxlib import kernels as K
from mxlib import reference as R
from mxlib.formats import ELEMENT_FORMATS

from _util import assert_bits_equal
from test_reference import heavy_tailed

ELEMENTS = ["e2m1", "e2m3", "e3m2", "e4m3", "e5m2"]
MODES = ["floor", "even", "rceil"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def adversarial(shape, dtype, seed=0, block=32):
    """Heavy-tailed data plus zero blocks, -0.0, NaN, +-Inf, subnormals and huge values."""
    x = heavy_tailed(shape, seed=seed).float()
    flat = x.reshape(-1, shape[-1])
    flat[0, :block] = 0.0
    flat[1, 2] = -0.0
    flat[2, 1] = math.nan
    flat[3, block + 1] = math.inf
    flat[4 % flat.shape[0], 0] = -math.inf
    flat[5 % flat.shape[0], :block] = 1e-39
    flat[6 % flat.shape[0], 3] = 3e38 if dtype == torch.float32 else 6e4
    return x.to(dtype)


def grid_rows(element):
    """Rows of [max, then 31 probes]: under the floor rule the scale is exactly 1, so the
    kernel's element rounding is tested on every code value and midpoint."""
    f = ELEMENT_FORMATS[element]
    fin = sorted({abs(v) for v in f.values() if math.isfinite(v)})
    mids = [(a + b) / 2 for a, b in zip(fin[:-1], fin[1:])]
    probes = torch.tensor(fin + mids + [f.max * 1.01], dtype=torch.float32)
    probes = torch.cat([probes, torch.nextafter(probes, torch.zeros_like(probes)), -probes])
    probes = torch.cat([probes, torch.zeros((-len(probes)) % 31)])
    body = probes.reshape(-1, 31)
    return torch.cat([torch.full((body.shape[0], 1), f.max), body], dim=1)


@pytest.mark.parametrize("element", ELEMENTS)
def test_element_rounding_every_code_and_midpoint(element, device):
    x = grid_rows(element).to(device)
    assert_bits_equal(K.quant_dequant_mx(x, element, 32, "floor"), R.quant_dequant_mx(x.cpu(), element, 32, "floor"))


@pytest.mark.parametrize("element", ELEMENTS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_mx_qdq(element, mode, dtype, device):
    x = adversarial((8, 96), dtype, seed=ELEMENTS.index(element))
    got = K.quant_dequant_mx(x.to(device), element, 32, mode)
    assert_bits_equal(got, R.quant_dequant_mx(x, element, 32, mode))


@pytest.mark.parametrize("element", ELEMENTS)
@pytest.mark.parametrize("mode", MODES)
def test_mx_quantize_and_dequantize_3d(element, mode, device):
    x = adversarial((3, 4, 128), torch.bfloat16, seed=3)
    p_ref, s_ref = R.quantize_mx(x, element, 32, mode)
    p, s = K.quantize_mx(x.to(device), element, 32, mode)
    assert_bits_equal(p, p_ref)
    assert_bits_equal(s, s_ref)
    for dtype in DTYPES:
        got = K.dequantize_mx(p_ref.to(device), s_ref.to(device), element, 32, dtype)
        assert_bits_equal(got, R.dequantize_mx(p_ref, s_ref, element, 32, dtype))


@pytest.mark.parametrize("element", ["e2m1", "e3m2", "e4m3"])
def test_mx_random_codes_dequantize(element, device):
    f = ELEMENT_FORMATS[element]
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(0, f.num_codes, (16, 64), dtype=torch.uint8, generator=g)
    packed = R.pack_codes(codes, element)
    scale = torch.randint(0, 256, (16, 2), dtype=torch.uint8, generator=g)
    got = K.dequantize_mx(packed.to(device), scale.to(device), element, 32, torch.float32)
    assert_bits_equal(got, R.dequantize_mx(packed, scale, element, 32, torch.float32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("multiplier", ["reciprocal", "divide"])
def test_nvfp4_qdq(dtype, multiplier, device):
    x = adversarial((4, 6, 64), dtype, seed=5, block=16)
    for gs in (torch.tensor([37.5]), torch.tensor([0.01, 2688.0, 1e6, 7.0])):
        got = K.ref_nvfp4_quant_dequant(x.to(device), gs.to(device), 16, multiplier)
        assert_bits_equal(got, R.ref_nvfp4_quant_dequant(x, gs, 16, multiplier))
    gs_rows = torch.rand(4, 6) * 100 + 1
    got = K.ref_nvfp4_quant_dequant(x.to(device), gs_rows.to(device), 16, multiplier)
    assert_bits_equal(got, R.ref_nvfp4_quant_dequant(x, gs_rows, 16, multiplier))


@pytest.mark.parametrize("zero_block_scale", ["one", "zero"])
def test_nvfp4_quantize_weights(zero_block_scale, device):
    w = heavy_tailed((3, 16, 64), seed=8, dtype=torch.bfloat16)
    w[1] = 0
    w[2, 0, :16] = 0
    ref = R.quantize_nvfp4(w, zero_block_scale=zero_block_scale)
    got = K.quantize_nvfp4(w.to(device), zero_block_scale=zero_block_scale)
    for a, b in zip(got, ref):
        assert_bits_equal(a, b)
    got2 = K.quantize_nvfp4(w[0].to(device), weight_scale_2=torch.tensor(0.01, device=device))
    for a, b in zip(got2, R.quantize_nvfp4(w[0], weight_scale_2=torch.tensor(0.01))):
        assert_bits_equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_dequantize(dtype, device):
    g = torch.Generator().manual_seed(3)
    packed = torch.randint(0, 256, (3, 8, 32), dtype=torch.uint8, generator=g)
    scale = torch.randint(0, 256, (3, 8, 4), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    gs = torch.tensor([1e-3, 0.37, 5.0])
    got = K.dequantize_to_dtype(packed.to(device), scale.to(device), gs.to(device), dtype)
    assert_bits_equal(got, R.dequantize_to_dtype(packed, scale, gs, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_per_tensor(dtype, device):
    x = adversarial((8, 64), dtype, seed=6)
    for scale in (0.013, 1e-30, 5.0):
        got = K.quant_dequant_fp8_per_tensor(x.to(device), torch.tensor(scale, device=device))
        assert_bits_equal(got, R.quant_dequant_fp8_per_tensor(x, torch.tensor(scale)))


def test_non_contiguous_input_is_handled(device):
    x = heavy_tailed((64, 96), seed=1, dtype=torch.bfloat16)
    xt = x.to(device).t()  # [96, 64], not contiguous
    assert not xt.is_contiguous()
    assert_bits_equal(K.quant_dequant_mx(xt, "e2m1"), R.quant_dequant_mx(x.t().contiguous(), "e2m1"))


def test_kernels_raise_the_reference_errors(device):
    cases = [
        (lambda m: m.quant_dequant_mx(torch.zeros(2, 32, dtype=torch.int32)), TypeError),
        (lambda m: m.quantize_mx(torch.zeros(2, 48)), ValueError),
        (lambda m: m.quant_dequant_mx(torch.zeros(2, 32), "e9m9"), ValueError),
        (
            lambda m: m.dequantize_mx(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8)),
            ValueError,
        ),
        (lambda m: m.ref_nvfp4_quant_dequant(torch.zeros(4, 2, 16), torch.ones(3)), ValueError),
        (
            lambda m: m.dequantize_to_dtype(
                torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 3, dtype=torch.uint8), 1.0, torch.bfloat16
            ),
            ValueError,
        ),
        (lambda m: m.quant_dequant_fp8_per_tensor(torch.zeros(4), 0.0), ValueError),
        (lambda m: m.quantize_nvfp4(torch.tensor([[math.nan] * 16])), ValueError),
    ]
    for fn, exc in cases:
        with pytest.raises(exc) as ref_err:
            fn(R)
        with pytest.raises(exc) as k_err:
            fn(K)
        assert str(k_err.value) == str(ref_err.value)
