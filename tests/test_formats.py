"""The format table against the literal values of OCP MX v1.0 (tables 1-3) and ml_dtypes."""

import math

import ml_dtypes
import numpy as np
import pytest

from mxlib.formats import (
    BLOCK_SCHEMES,
    ELEMENT_FORMATS,
    get_block_scheme,
    get_element_format,
    get_scale_mode,
)

# name: (bits, bias, emax, max, min normal, min subnormal), typed in from the spec
SPEC = {
    "e2m1": (4, 1, 2, 6.0, 1.0, 0.5),
    "e2m3": (6, 1, 2, 7.5, 1.0, 0.125),
    "e3m2": (6, 3, 4, 28.0, 0.25, 0.0625),
    "e4m3": (8, 7, 8, 448.0, 2.0**-6, 2.0**-9),
    "e5m2": (8, 15, 15, 57344.0, 2.0**-14, 2.0**-16),
}


@pytest.mark.parametrize("name", list(SPEC))
def test_derived_numbers_match_spec(name):
    f = ELEMENT_FORMATS[name]
    assert (f.nbits, f.bias, f.emax, f.max, f.min_normal, f.min_subnormal) == SPEC[name]


@pytest.mark.parametrize("name", list(SPEC))
def test_every_code_value_matches_ml_dtypes(name):
    f = ELEMENT_FORMATS[name]
    mld = getattr(ml_dtypes, f.ml_dtypes_name)
    expected = np.arange(f.num_codes, dtype=np.uint8).view(mld).astype(np.float64)
    got = np.array(f.values())
    assert np.array_equal(np.isnan(got), np.isnan(expected))
    ok = ~np.isnan(got)
    assert np.array_equal(got[ok], expected[ok])
    assert np.array_equal(np.signbit(got[ok]), np.signbit(expected[ok]))


def test_special_codes():
    assert math.isnan(ELEMENT_FORMATS["e4m3"].code_value(0x7F))
    assert math.isnan(ELEMENT_FORMATS["e4m3"].code_value(0xFF))
    assert ELEMENT_FORMATS["e5m2"].code_value(0x7C) == math.inf
    assert math.isnan(ELEMENT_FORMATS["e5m2"].code_value(0x7E))
    assert ELEMENT_FORMATS["e2m1"].code_value(8) == 0.0 and math.copysign(1, ELEMENT_FORMATS["e2m1"].code_value(8)) < 0


@pytest.mark.parametrize("name", list(SPEC))
def test_special_code_properties_match_the_code_values(name):
    # has_nan_code / has_inf / nan_code (what the reference branches on) against the decoded
    # code space and against ml_dtypes' own encoding of NaN
    f = ELEMENT_FORMATS[name]
    values = np.array(f.values())
    assert f.has_nan_code == bool(np.isnan(values).any())
    assert f.has_inf == bool(np.isinf(values).any())
    if f.has_nan_code:
        mld = getattr(ml_dtypes, f.ml_dtypes_name)
        assert f.nan_code == int(np.array([np.nan], dtype=np.float32).astype(mld).view(np.uint8)[0])
        assert math.isnan(f.code_value(f.nan_code))
    else:
        assert f.nan_code is None
    assert {"e4m3": 0x7F, "e5m2": 0x7E}.get(name) == f.nan_code


def test_schemes():
    assert list(BLOCK_SCHEMES) == ["mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3", "mxfp8_e5m2", "nvfp4"]
    assert get_block_scheme("nvfp4").block_size == 16 and get_block_scheme("mxfp4").block_size == 32
    assert get_block_scheme("mxfp4").bits_per_element == 4.25
    assert get_block_scheme("nvfp4").bits_per_element == 4.5
    assert get_block_scheme("mxfp6_e3m2").bits_per_element == 6.25


def test_aliases_and_packing():
    assert get_element_format("fp4") is ELEMENT_FORMATS["e2m1"]
    assert get_element_format("fp6_e3m2") is ELEMENT_FORMATS["e3m2"]
    assert ELEMENT_FORMATS["e2m3"].packed_size(32) == 24
    assert ELEMENT_FORMATS["e2m1"].packed_size(32) == 16
    with pytest.raises(ValueError, match="k=6 elements do not fill whole bytes; k must be a multiple of 4"):
        ELEMENT_FORMATS["e3m2"].packed_size(6)


def test_unknown_names():
    with pytest.raises(ValueError, match=r"unknown element format 'e3m3'; expected one of"):
        get_element_format("e3m3")
    with pytest.raises(ValueError, match=r"unknown scheme 'mxfp5'"):
        get_block_scheme("mxfp5")
    with pytest.raises(ValueError, match=r"unknown scale_mode 'ceil'; expected one of \['floor', 'even', 'rceil'\]"):
        get_scale_mode("ceil")


def test_derived_constants_and_kernel_ids():
    from mxlib.formats import (
        FP8_E4M3_PER_TENSOR,
        FP8_SCALE_DIVISOR,
        NVFP4,
        NVFP4_SCALE_DIVISOR,
        SCALE_MODES,
        get_activation_format,
        scale_mode_id,
    )

    # ModelOpt: weight_scale_2 = amax / (6 * 448); static FP8: amax / 448 (spec maxima typed in)
    assert NVFP4_SCALE_DIVISOR == 6.0 * 448.0 == NVFP4.scale_divisor
    assert FP8_SCALE_DIVISOR == 448.0 == FP8_E4M3_PER_TENSOR.scale_divisor
    assert BLOCK_SCHEMES["mxfp4"].scale_divisor is None and not BLOCK_SCHEMES["mxfp4"].static_scale
    assert NVFP4.static_scale and FP8_E4M3_PER_TENSOR.static_scale
    # the integers the kernels decode (mxlib.kernels._numerics): specials none 0, fn 1, ieee 2;
    # rules floor 0, even 1, rceil 2
    assert [ELEMENT_FORMATS[n].specials_id for n in ("e2m1", "e4m3", "e5m2")] == [0, 1, 2]
    assert [scale_mode_id(m) for m in ("floor", "even", "rceil")] == [0, 1, 2] and len(SCALE_MODES) == 3
    assert get_activation_format("fp8") is FP8_E4M3_PER_TENSOR and get_activation_format(None) is None
    assert get_activation_format("nvfp4") is NVFP4 and str(NVFP4) == "nvfp4"
    with pytest.raises(ValueError, match="unknown activation format 'fp7'"):
        get_activation_format("fp7")


# torch dtype (by name) -> the element format it stores, typed in from torch's dtype docs
TORCH_DTYPE_FORMATS = {
    "float4_e2m1fn_x2": "e2m1",  # two e2m1 codes a byte
    "float8_e4m3fn": "e4m3",
    "float8_e5m2": "e5m2",
}


@pytest.mark.parametrize("dtype_name", sorted(TORCH_DTYPE_FORMATS))
def test_torch_dtypes_name_element_formats(dtype_name):
    torch = pytest.importorskip("torch")
    if not hasattr(torch, dtype_name):
        pytest.skip(f"this torch has no {dtype_name}")
    want = ELEMENT_FORMATS[TORCH_DTYPE_FORMATS[dtype_name]]
    assert get_element_format(getattr(torch, dtype_name)) is want
    assert get_element_format(dtype_name) is want  # the dtype's name as a string


@pytest.mark.parametrize("name", list(SPEC))
def test_ml_dtypes_types_name_their_format(name):
    f = ELEMENT_FORMATS[name]
    mld = getattr(ml_dtypes, f.ml_dtypes_name)
    assert get_element_format(mld) is f and get_element_format(np.dtype(mld)) is f
    assert get_element_format(f.ml_dtypes_name) is f


@pytest.mark.parametrize(
    "dtype_name, why",
    [
        ("float8_e8m0fnu", "scale format"),
        ("float8_e4m3fnuz", "fnuz"),
        ("float8_e5m2fnuz", "fnuz"),
        ("bfloat16", "microscaling element format;"),
        ("float32", "microscaling element format;"),
    ],
)
def test_dtypes_that_are_not_element_formats_are_refused(dtype_name, why):
    torch = pytest.importorskip("torch")
    if not hasattr(torch, dtype_name):
        pytest.skip(f"this torch has no {dtype_name}")
    with pytest.raises(ValueError, match=rf"element: dtype torch\.{dtype_name} is not .*{why}"):
        get_element_format(getattr(torch, dtype_name))


def test_unknown_names_still_list_the_known_ones():
    with pytest.raises(ValueError, match="unknown element format 'e3m4'.*e2m1.*float8_e4m3fn"):
        get_element_format("e3m4")


def test_a_dtype_is_not_a_block_scheme():
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match=r"scheme: dtype torch\.float4_e2m1fn_x2 names an element format.*'mxfp4'"):
        get_block_scheme(torch.float4_e2m1fn_x2)  # mxfp4 or nvfp4: the block size and scale say which
