"""Edge cases of the numerics, reference and Triton twin alike.

* Global scales outside the valid range are refused with one message from both twins.
* A per-tensor scale derived from a tensor holding Inf/NaN comes from its finite values.
* Block sizes: powers of two from 2 to 1024, the same answer (or the same error) from both twins.
* Empty inputs: empty outputs of the right shapes and dtypes from every public function.
* fp16 output near fp16's top: the dequantized value is cast once, IEEE, so 65536 becomes Inf.

Oracles are hand-computed values, ml_dtypes-free arithmetic in fp64 and the independent vLLM
re-implementation in ``tests/oracles.py``. Kernels run in the Triton interpreter on the CPU.
"""

import math

import pytest
import torch

from mxlib import _checks
from mxlib import kernels as _kernels
from mxlib import reference as R

from _util import OnKernelDevice, assert_bits_equal, nvfp4_experts
from oracles import vllm_nvfp4_qdq

K = OnKernelDevice(_kernels)  # the twins on cuda when there is one, results back on the CPU

TWINS = [R, K]
TWIN_IDS = ["reference", "triton"]

# ----------------------------------------------------------------------------- case 5: global scales

SMALLEST_NORMAL = 2.0**-126
BAD_SCALES = [
    0.0,
    -0.0,
    -100.0,
    math.inf,
    -math.inf,
    math.nan,
    1e-40,  # fp32 subnormal: 1/gs overflows fp32
    2.0**-127,  # subnormal, 1/gs = 2**127 finite but gs itself is not normal
    SMALLEST_NORMAL - 2.0**-149,  # the largest fp32 subnormal
    1e-50,  # rounds to 0 in fp32
    2.0**127,  # 1/gs = 2**-127 is subnormal
    3e38,
]
GOOD_EDGE_SCALES = [SMALLEST_NORMAL, 2.0**126, 1.0]


def _err(fn) -> str:
    with pytest.raises(ValueError) as info:
        fn()
    return str(info.value)


@pytest.mark.parametrize("bad", BAD_SCALES, ids=repr)
def test_nvfp4_qdq_rejects_bad_global_scale(bad, device):
    x = torch.randn(4, 64, device=device)
    gs = torch.tensor(bad, dtype=torch.float32)
    msgs = [_err(lambda: m.ref_nvfp4_quant_dequant(x, gs.to(device))) for m in TWINS]
    assert msgs[0] == msgs[1]
    assert msgs[0].startswith("global_scale: expected"), msgs[0]
    assert "2**-126" in msgs[0] and "2**126" in msgs[0]
    # a Python float gets the same check
    assert _err(lambda: R.ref_nvfp4_quant_dequant(x, bad)).startswith("global_scale: expected")
    assert _err(lambda: K.ref_nvfp4_quant_dequant(x, bad)).startswith("global_scale: expected")
    assert _err(lambda: R.ref_nvfp4_quant(x, gs)).startswith("global_scale: expected")
    assert _err(lambda: R.nvfp4_block_stats(x, gs)).startswith("global_scale: expected")
    assert _err(lambda: R.quant_dequant(x, "nvfp4", global_scale=gs)).startswith("global_scale: expected")


@pytest.mark.parametrize("good", GOOD_EDGE_SCALES, ids=repr)
def test_nvfp4_qdq_accepts_range_edges(good, device):
    x = torch.randn(4, 32, device=device) * 1e-3
    gs = torch.tensor(good, dtype=torch.float32, device=device)
    ref = R.ref_nvfp4_quant_dequant(x, gs)
    assert_bits_equal(K.ref_nvfp4_quant_dequant(x, gs), ref)
    assert_bits_equal(ref.cpu(), vllm_nvfp4_qdq(x.cpu(), gs.cpu().reshape(1)))


def test_global_scale_checked_elementwise(device):
    x = torch.randn(3, 4, 32, device=device)
    gs = torch.tensor([1.0, -2.0, 3.0], device=device)
    msgs = [_err(lambda: m.ref_nvfp4_quant_dequant(x, gs)) for m in TWINS]
    assert msgs[0] == msgs[1]
    assert "-2.0 at index [1]" in msgs[0] and "1 of 3" in msgs[0], msgs[0]


@pytest.mark.parametrize("bad", BAD_SCALES, ids=repr)
def test_nvfp4_weights_reject_bad_weight_scale_2(bad, device):
    w = torch.randn(2, 8, 32, device=device)
    ws2 = torch.tensor([1e-3, bad], dtype=torch.float32, device=device)
    msgs = [_err(lambda: m.quantize_nvfp4(w, ws2)) for m in TWINS]
    assert msgs[0] == msgs[1]
    assert msgs[0].startswith("weight_scale_2: expected") and "at index [1]" in msgs[0], msgs[0]
    p, s, g = R.quantize_nvfp4(w)
    msgs = [_err(lambda: m.dequantize_to_dtype(p, s, ws2, torch.float32)) for m in TWINS]
    assert msgs[0] == msgs[1]
    assert msgs[0].startswith("global_scale: expected") and "at index [1]" in msgs[0], msgs[0]
    scalar = torch.tensor(bad, dtype=torch.float32)
    msgs = [_err(lambda: m.dequantize_to_dtype(p[0], s[0], scalar, torch.float32)) for m in TWINS]
    assert msgs[0] == msgs[1] and msgs[0].startswith("global_scale: expected")


@pytest.mark.parametrize("which", ["w13_weight_scale_2", "w2_weight_scale_2", "w13_input_scale", "w2_input_scale"])
@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf, 1e-40])
def test_nvfp4_experts_reject_bad_scales(which, bad):
    from test_moe import make_inputs, nvfp4_experts_inputs

    x, w13, w2, _, _ = make_inputs()
    t = list(nvfp4_experts_inputs(x, w13, w2))
    pos = {"w13_weight_scale_2": 2, "w2_weight_scale_2": 5, "w13_input_scale": 6, "w2_input_scale": 7}[which]
    if bad == 0.0 and which.endswith("input_scale"):
        pytest.skip("input_scale 0 marks an uncalibrated expert: allowed (unify_input_scales)")
    t[pos] = t[pos].clone()
    t[pos][3] = bad
    with pytest.raises(ValueError, match=rf"^{which}: expected .* at index \[3\]"):
        nvfp4_experts(*t, backend="torch")


def test_global_scale_check_skipped_under_graph_capture(monkeypatch):
    """Reading a device tensor's values needs a host sync, which CUDA-graph capture forbids:
    the value check is skipped while the current stream captures (shape/dtype checks stay)."""
    x = torch.randn(2, 32)
    monkeypatch.setattr(_checks, "capturing", lambda: True)
    R.ref_nvfp4_quant_dequant(x, torch.tensor(0.0))  # no error while capturing
    monkeypatch.setattr(_checks, "capturing", lambda: False)
    with pytest.raises(ValueError, match="global_scale: expected"):
        R.ref_nvfp4_quant_dequant(x, torch.tensor(0.0))


def test_global_scale_check_can_be_turned_off():
    """``check_scale=False`` skips the value check (callers that validated once, like the experts)."""
    x = torch.randn(2, 32)
    for m in TWINS:
        out = m.ref_nvfp4_quant_dequant(x, torch.tensor(math.inf), check_scale=False)
        assert out.shape == x.shape


# ----------------------------------------------------------------------------- case 6: derived scales


def test_derived_nvfp4_scale_ignores_inf():
    x = torch.linspace(-3.0, 5.0, 64).reshape(2, 32)
    x[0, 3] = math.inf
    out = R.quant_dequant(x, "nvfp4")
    gs = torch.tensor(6.0 * 448.0 / 5.0, dtype=torch.float32)  # amax of the finite values is 5
    assert_bits_equal(out, vllm_nvfp4_qdq(x, gs.reshape(1)))
    # the Inf block follows vLLM's Inf rule: scale 448, the Inf becomes 6 * 448 / gs
    assert out[0, 3].item() == pytest.approx(6 * 448 / gs.item(), rel=1e-6)
    assert torch.isfinite(out).all()
    # blocks without the Inf are those of the same tensor with the Inf replaced by a finite value
    y = x.clone()
    y[0, 3] = 0.0
    same = R.ref_nvfp4_quant_dequant(y, gs)
    assert_bits_equal(out.reshape(4, 16)[1:], same.reshape(4, 16)[1:])


def test_derived_nvfp4_scale_ignores_nan():
    x = torch.linspace(-3.0, 5.0, 64).reshape(2, 32)
    x[1, 20] = math.nan
    out = R.quant_dequant(x, "nvfp4")
    gs = torch.tensor(6.0 * 448.0 / 5.0, dtype=torch.float32)
    assert_bits_equal(out, vllm_nvfp4_qdq(x, gs.reshape(1)))
    assert torch.isnan(out[1, 16:]).all() and not torch.isnan(out[1, :16]).any() and not torch.isnan(out[0]).any()


def test_derived_nvfp4_scale_all_nonfinite():
    """No finite value: the global scale is 1 (as for an all-zero tensor); Inf blocks come out
    +-6 * 448 = +-2688, NaN blocks NaN."""
    x = torch.tensor([[math.inf] * 16 + [math.nan] * 16 + [-math.inf] * 16])
    out = R.quant_dequant(x, "nvfp4")
    expected = torch.tensor([[2688.0] * 16 + [math.nan] * 16 + [-2688.0] * 16])
    assert_bits_equal(out, expected)


def test_derived_nvfp4_scale_stays_in_range():
    """A tiny amax would give 2688 / amax = Inf: the derived scale is clamped to 2**126."""
    x = torch.full((1, 16), 1e-40)
    out = R.quant_dequant(x, "nvfp4")
    assert_bits_equal(out, R.ref_nvfp4_quant_dequant(x, torch.tensor(2.0**126)))
    w = torch.full((4, 16), 1e-40)
    _, _, ws2 = R.quantize_nvfp4(w)
    assert ws2.item() == SMALLEST_NORMAL
    assert_bits_equal(K.quantize_nvfp4(w)[2], ws2)


# ----------------------------------------------------------------------------- case 10: block sizes


MX_CALLS = {
    "quant_dequant_mx": lambda m, x, bs: m.quant_dequant_mx(x, "e4m3", bs),
    "quantize_mx": lambda m, x, bs: m.quantize_mx(x, "e2m1", bs),
}
NV_CALLS = {
    "ref_nvfp4_quant_dequant": lambda m, x, bs: m.ref_nvfp4_quant_dequant(x, torch.tensor(100.0), bs),
    "quantize_nvfp4": lambda m, x, bs: m.quantize_nvfp4(x, None, bs),
}


@pytest.mark.parametrize("bs", [7, 3, 0, -32, 1, 48, 2048, 32.0, True])
@pytest.mark.parametrize("name", list(MX_CALLS) + list(NV_CALLS))
def test_bad_block_sizes_same_error(name, bs):
    call = {**MX_CALLS, **NV_CALLS}[name]
    x = torch.randn(2, 1344)  # 1344 = 2**6 * 3 * 7: a whole number of blocks of 1, 3, 7 and 48
    msgs = [_err(lambda: call(m, x, bs)) for m in TWINS]
    assert msgs[0] == msgs[1]
    assert msgs[0].startswith("block_size: expected a power of two from 2 to 1024"), msgs[0]


def test_bad_block_size_dequantize_same_error():
    p = torch.zeros(2, 21, dtype=torch.uint8)
    s = torch.zeros(2, 6, dtype=torch.uint8)
    msgs = [_err(lambda: m.dequantize_mx(p, s, "e2m1", 7)) for m in TWINS]
    assert msgs[0] == msgs[1] and msgs[0].startswith("block_size: expected")
    p = torch.zeros(2, 24, dtype=torch.uint8)
    s = torch.zeros(2, 16, dtype=torch.float8_e4m3fn)
    msgs = [_err(lambda: m.dequantize_to_dtype(p, s, torch.tensor(1.0), torch.float32, 3)) for m in TWINS]
    assert msgs[0] == msgs[1] and msgs[0].startswith("block_size: expected")


@pytest.mark.parametrize("bs", [2, 4, 8, 64, 128])
@pytest.mark.parametrize("name", list(MX_CALLS) + list(NV_CALLS))
def test_other_block_sizes_agree(name, bs):
    call = {**MX_CALLS, **NV_CALLS}[name]
    g = torch.Generator().manual_seed(bs)
    x = torch.randn(3, 256, generator=g) * torch.exp(torch.randn(3, 256, generator=g))
    a, b = call(R, x, bs), call(K, x, bs)
    for u, v in zip(a, b) if isinstance(a, tuple) else [(a, b)]:
        assert_bits_equal(v, u, f"{name} bs={bs}")


# ----------------------------------------------------------------------------- case 10: empty inputs

F32, U8, E4M3 = torch.float32, torch.uint8, torch.float8_e4m3fn
E8 = torch.float8_e8m0fnu


def _z(*shape, dtype=F32):
    return torch.zeros(shape, dtype=dtype)


# name -> list of (call(module), expected [(shape, dtype), ...]); every public function of
# mxlib.reference except element_value_table, which takes no tensor.
EMPTY_CASES = {
    "round_to_element": [(lambda m: m.round_to_element(_z(0, 4), "e2m1"), [((0, 4), F32)])],
    "encode_element": [(lambda m: m.encode_element(_z(3, 0), "e4m3"), [((3, 0), U8)])],
    "decode_element": [(lambda m: m.decode_element(_z(0, dtype=U8), "e2m3"), [((0,), F32)])],
    "e8m0_scale": [(lambda m: m.e8m0_scale(_z(0, 2), "e2m1", "rceil"), [((0, 2), U8)])],
    "decode_e8m0": [(lambda m: m.decode_e8m0(_z(2, 0, dtype=U8)), [((2, 0), F32)])],
    "pack_codes": [
        (lambda m: m.pack_codes(_z(0, 8, dtype=U8), "e2m1"), [((0, 4), U8)]),
        (lambda m: m.pack_codes(_z(3, 0, dtype=U8), "e3m2"), [((3, 0), U8)]),
    ],
    "unpack_codes": [
        (lambda m: m.unpack_codes(_z(0, 3, dtype=U8), "e2m3"), [((0, 4), U8)]),
        (lambda m: m.unpack_codes(_z(3, 0, dtype=U8), "e2m1"), [((3, 0), U8)]),
    ],
    "quantize_mx": [
        (lambda m: m.quantize_mx(_z(0, 64), "e2m1"), [((0, 32), U8), ((0, 2), U8)]),
        (lambda m: m.quantize_mx(_z(3, 0), "e3m2"), [((3, 0), U8), ((3, 0), U8)]),
        (lambda m: m.quantize_mx(_z(0, 0), "e4m3"), [((0, 0), U8), ((0, 0), U8)]),
        (lambda m: m.quantize_mx(_z(2, 0, 32), "e2m3"), [((2, 0, 24), U8), ((2, 0, 1), U8)]),
    ],
    "dequantize_mx": [
        (lambda m: m.dequantize_mx(_z(0, 16, dtype=U8), _z(0, 1, dtype=U8), "e2m1"), [((0, 32), torch.bfloat16)]),
        (lambda m: m.dequantize_mx(_z(3, 0, dtype=U8), _z(3, 0, dtype=U8), "e4m3", dtype=F32), [((3, 0), F32)]),
        (
            lambda m: m.dequantize_mx(_z(2, 0, 24, dtype=U8), _z(2, 0, 1, dtype=E8), "e3m2", dtype=torch.float16),
            [((2, 0, 32), torch.float16)],
        ),
    ],
    "quant_dequant_mx": [
        (lambda m: m.quant_dequant_mx(_z(0, 32, dtype=torch.bfloat16)), [((0, 32), torch.bfloat16)]),
        (lambda m: m.quant_dequant_mx(_z(3, 0), "e5m2"), [((3, 0), F32)]),
        (lambda m: m.quant_dequant_mx(_z(0, 0), "e5m2", dtype=torch.float16), [((0, 0), torch.float16)]),
    ],
    "ref_nvfp4_quant": [
        (lambda m: m.ref_nvfp4_quant(_z(0, 32), 1.0), [((0, 32), F32), ((0, 2), F32)]),
        (lambda m: m.ref_nvfp4_quant(_z(3, 0), 1.0), [((3, 0), F32), ((3, 0), F32)]),
    ],
    "compressed_tensors_nvfp4_quant_dequant": [
        (
            lambda m: m.compressed_tensors_nvfp4_quant_dequant(_z(0, 32, dtype=torch.bfloat16), 1.0),
            [((0, 32), torch.bfloat16)],
        ),
        (lambda m: m.compressed_tensors_nvfp4_quant_dequant(_z(3, 0), 1.0), [((3, 0), F32)]),
    ],
    "ref_nvfp4_quant_dequant": [
        (lambda m: m.ref_nvfp4_quant_dequant(_z(0, 32, dtype=torch.float16), 1.0), [((0, 32), torch.float16)]),
        (lambda m: m.ref_nvfp4_quant_dequant(_z(3, 0), 1.0), [((3, 0), F32)]),
        (lambda m: m.ref_nvfp4_quant_dequant(_z(0, 0), 1.0), [((0, 0), F32)]),
        (lambda m: m.ref_nvfp4_quant_dequant(_z(2, 0, 16), torch.ones(2)), [((2, 0, 16), F32)]),
    ],
    "quantize_nvfp4": [
        (lambda m: m.quantize_nvfp4(_z(0, 32)), [((0, 16), U8), ((0, 2), E4M3), ((), F32)]),
        (lambda m: m.quantize_nvfp4(_z(3, 0)), [((3, 0), U8), ((3, 0), E4M3), ((), F32)]),
        (lambda m: m.quantize_nvfp4(_z(2, 0, 32)), [((2, 0, 16), U8), ((2, 0, 2), E4M3), ((2,), F32)]),
        (lambda m: m.quantize_nvfp4(_z(0, 4, 32)), [((0, 4, 16), U8), ((0, 4, 2), E4M3), ((0,), F32)]),
        (lambda m: m.quantize_nvfp4(_z(3, 0), torch.tensor(2.0)), [((3, 0), U8), ((3, 0), E4M3), ((), F32)]),
    ],
    "nvfp4_weight_scale_2": [
        (lambda m: m.nvfp4_weight_scale_2(_z(2, 0, 32)), [((2,), F32)]),
        (lambda m: m.nvfp4_weight_scale_2(_z(0, 4, 32)), [((0,), F32)]),
    ],
    "nvfp4_block_stats": [
        (
            lambda m: tuple(m.nvfp4_block_stats(_z(0, 32), 1.0).values()),
            [((0, 2), U8), ((0, 2), torch.bool), ((0, 2), torch.bool), ((0, 32), torch.bool)],
        ),
    ],
    "dequantize_to_dtype": [
        (
            lambda m: m.dequantize_to_dtype(_z(0, 16, dtype=U8), _z(0, 2, dtype=E4M3), 1.0, torch.bfloat16),
            [((0, 32), torch.bfloat16)],
        ),
        (lambda m: m.dequantize_to_dtype(_z(3, 0, dtype=U8), _z(3, 0, dtype=E4M3), 1.0, F32), [((3, 0), F32)]),
        (
            lambda m: m.dequantize_to_dtype(_z(2, 0, 8, dtype=U8), _z(2, 0, 1, dtype=U8), torch.ones(2), F32),
            [((2, 0, 16), F32)],
        ),
    ],
    "nvfp4_swizzle_scales": [(lambda m: m.nvfp4_swizzle_scales(_z(0, 2, dtype=E4M3)), [((0, 4), E4M3)])],
    "nvfp4_unswizzle_scales": [(lambda m: m.nvfp4_unswizzle_scales(_z(0, 4, dtype=E4M3), 0, 32), [((0, 2), E4M3)])],
    "nvfp4_per_token_scales": [
        (lambda m: m.nvfp4_per_token_scales(_z(0, 32)), [((0,), F32), ((0,), F32)]),
        (lambda m: m.nvfp4_per_token_scales(_z(3, 0)), [((3,), F32), ((3,), F32)]),
        (lambda m: m.nvfp4_per_token_scales(_z(2, 0, 32)), [((2, 0), F32), ((2, 0), F32)]),
    ],
    "nvfp4_per_token_quant_dequant": [
        (lambda m: m.nvfp4_per_token_quant_dequant(_z(0, 32)), [((0, 32), F32), ((0,), F32)]),
        (lambda m: m.nvfp4_per_token_quant_dequant(_z(3, 0)), [((3, 0), F32), ((3,), F32)]),
        (
            lambda m: m.nvfp4_per_token_quant_dequant(_z(0, 32, dtype=torch.bfloat16)),
            [((0, 32), torch.bfloat16), ((0,), F32)],
        ),
    ],
    "quant_dequant_fp8_per_tensor": [
        (lambda m: m.quant_dequant_fp8_per_tensor(_z(0, 8), 1.0), [((0, 8), F32)]),
        (lambda m: m.quant_dequant_fp8_per_tensor(_z(3, 0, dtype=torch.bfloat16), 1.0), [((3, 0), torch.bfloat16)]),
    ],
    "quant_dequant_fp8_per_token": [
        (lambda m: m.quant_dequant_fp8_per_token(_z(0, 8)), [((0, 8), F32)]),
        (lambda m: m.quant_dequant_fp8_per_token(_z(3, 0, dtype=torch.bfloat16)), [((3, 0), torch.bfloat16)]),
    ],
    "quantize_fp8_weight": [
        (lambda m: m.quantize_fp8_weight(_z(0, 8)), [((0, 8), U8), ((), F32)]),
        (lambda m: m.quantize_fp8_weight(_z(0, 8), per_channel=True), [((0, 8), U8), ((0,), F32)]),
        (lambda m: m.quantize_fp8_weight(_z(3, 0), per_channel=True), [((3, 0), U8), ((3,), F32)]),
    ],
    "dequantize_fp8_weight": [
        (lambda m: m.dequantize_fp8_weight(torch.zeros(0, 8, dtype=U8), torch.ones(()), F32), [((0, 8), F32)]),
        (
            lambda m: m.dequantize_fp8_weight(torch.zeros(3, 0, dtype=U8), torch.ones(3), torch.bfloat16),
            [((3, 0), torch.bfloat16)],
        ),
    ],
    "quantize_nvfp4_variant": [
        (lambda m: m.quantize_nvfp4_variant(_z(0, 32), "nvfp4_b32"), [((0, 16), U8), ((0, 1), U8), ((), F32)]),
        (lambda m: m.quantize_nvfp4_variant(_z(3, 0), "nvfp4_b32"), [((3, 0), U8), ((3, 0), U8), ((), F32)]),
    ],
    "dequantize_nvfp4_variant": [
        (
            lambda m: m.dequantize_nvfp4_variant(
                torch.zeros(0, 16, dtype=U8), torch.zeros(0, 2, dtype=U8), "nvfp4_ue5m3", dtype=F32
            ),
            [((0, 32), F32)],
        ),
    ],
    "quant_dequant_nvfp4_variant": [
        (lambda m: m.quant_dequant_nvfp4_variant(_z(0, 32), "nvfp4_ue5m3"), [((0, 32), F32)]),
        (lambda m: m.quant_dequant_nvfp4_variant(_z(3, 0), "nvfp4_b32"), [((3, 0), F32)]),
    ],
    "nvfp4_variant_global_scale": [
        (lambda m: m.nvfp4_variant_global_scale(_z(0, 32), "nvfp4_b32"), [((), F32)]),
    ],
    "quant_dequant": [
        (lambda m: m.quant_dequant(_z(0, 32), "nvfp4"), [((0, 32), F32)]),
        (lambda m: m.quant_dequant(_z(3, 0), "nvfp4"), [((3, 0), F32)]),
        (lambda m: m.quant_dequant(_z(0, 32), "mxfp6_e2m3"), [((0, 32), F32)]),
    ],
}


def test_empty_cases_cover_every_public_function():
    constants = {"NVFP4_BLOCK_RULES", "FP8_MIN_TOKEN_SCALE"}
    assert set(EMPTY_CASES) | {"element_value_table"} | constants == set(R.__all__)


@pytest.mark.parametrize("name", sorted(EMPTY_CASES))
def test_empty_in_empty_out(name):
    impls = [R] + ([K] if hasattr(K, name) else [])
    for call, expected in EMPTY_CASES[name]:
        for m in impls:
            out = call(m)
            out = out if isinstance(out, tuple) else (out,)
            got = [(tuple(t.shape), t.dtype) for t in out]
            assert got == expected, f"{m.__name__}.{name}: {got} != {expected}"


def test_every_twin_has_empty_cases():
    twins = {n for n in K.quant.__all__ if n != "nvfp4_quant_dequant"}
    assert twins <= set(EMPTY_CASES)


# ----------------------------------------------------------------------------- case 12: fp16 overflow

# 65504 (fp16 max) in a block of e2m1 / e4m3 elements: hand-computed.
# floor: 65504 = 1.999 * 2**15, scale 2**(15 - emax); 65504 / scale saturates to max.
#   e2m1: 2**13, 7.996 -> 6, 6 * 8192 = 49152.   e4m3: 2**7, 511.75 -> 448, 448 * 128 = 57344.
# even: amax rounds up to 2**16 at the element's mantissa width, scale 2**(16 - emax).
#   e2m1: 2**14, 3.998 -> 4, 65536.   e4m3: 2**8, 255.875 -> 256, 65536.
# rceil: 2**ceil(log2(65504 / max)): e2m1 2**14 -> 65536; e4m3 2**8 -> 65536.
FP16_TOP = [
    ("e2m1", "floor", 49152.0),
    ("e2m1", "even", 65536.0),
    ("e2m1", "rceil", 65536.0),
    ("e4m3", "floor", 57344.0),
    ("e4m3", "even", 65536.0),
    ("e4m3", "rceil", 65536.0),
]


@pytest.mark.parametrize("element,mode,value", FP16_TOP)
@pytest.mark.parametrize("impl", TWINS, ids=TWIN_IDS)
def test_fp16_top_overflows_like_upstream(impl, element, mode, value):
    """Decision: the dequantized fp32 value is cast once to the output dtype (IEEE, round to
    nearest), as torchao's ``to_dtype`` and vLLM's emulation do: 65536 does not fit fp16 and
    becomes Inf. Ask for ``dtype=torch.float32`` (or bf16) to keep it finite."""
    x = torch.tensor([[65504.0, -65504.0] * 16], dtype=torch.float16)
    sign = torch.tensor([1.0, -1.0] * 16)
    out = impl.quant_dequant_mx(x, element, 32, mode)
    expected = (sign * value).to(torch.float16)  # 65536 -> +-Inf, the IEEE cast
    assert_bits_equal(out, expected.reshape(1, 32))
    assert torch.isinf(out).all() == (value > 65504.0)
    wide = impl.quant_dequant_mx(x, element, 32, mode, dtype=torch.float32)
    assert_bits_equal(wide, (sign * value).reshape(1, 32))
    packed, scale = impl.quantize_mx(x, element, 32, mode)
    assert_bits_equal(impl.dequantize_mx(packed, scale, element, 32, torch.float16), expected.reshape(1, 32))


@pytest.mark.parametrize("bad", BAD_SCALES, ids=repr)
def test_fp8_per_tensor_rejects_bad_scale(bad, device):
    """The static FP8 ``input_scale`` is a per-tensor scale too: ``1 / scale`` must be finite."""
    x = torch.randn(4, 32, device=device)
    msgs = [_err(lambda: m.quant_dequant_fp8_per_tensor(x, torch.tensor(bad))) for m in TWINS]
    assert msgs[0] == msgs[1]
    assert msgs[0].startswith("scale: expected a positive finite input_scale"), msgs[0]
