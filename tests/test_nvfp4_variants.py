"""The NVFP4 variants ahead of hardware: UE5M3 block scales and 32-element NVFP4 blocks.

The UE5M3 grid is enumerated by hand from the bit fields in float64 (``oracles.ue5m3_grid``; ml_dtypes has no
e5m3) and rounding is checked against a search of that list; e2m1 and ue4m3 go through ml_dtypes casts.
"""

import math

import numpy as np
import pytest
import torch

from mxlib import reference as R
from mxlib.formats import (
    BLOCK_SCHEMES,
    NVFP4_B32,
    NVFP4_UE5M3,
    NVFP4_VARIANTS,
    SCALE_FORMATS,
    UE5M3,
    get_activation_format,
    get_block_scheme,
)

import oracles


def test_ue5m3_derived_numbers_match_the_sources():
    # PTX ISA / AutoRound: bias 15, max 0xFE = 1.75 * 2**16 = 114688 (AutoRound's FLOAT8_UE5M3_MAX), smallest
    # normal 2**-14, smallest subnormal 2**-17, 0xFF the only NaN, no sign bit
    f = UE5M3
    assert (f.nbits, f.bias, f.emax, f.max, f.min_normal, f.min_subnormal) == (8, 15, 16, 114688.0, 2.0**-14, 2.0**-17)
    assert (f.signed, f.has_nan_code, f.has_inf, f.nan_code, f.num_codes) == (False, True, False, 0xFF, 256)
    assert SCALE_FORMATS["ue5m3"].element is f


def test_ue5m3_every_code_value_matches_the_hand_grid():
    got, want = np.array(UE5M3.values()), np.array(oracles.ue5m3_grid())
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.isnan(want).sum() == 1
    ok = ~np.isnan(want)
    assert np.array_equal(got[ok], want[ok])
    assert np.all(np.diff(want[ok]) > 0)  # codes ascend with value: no sign bit, no duplicate zero


def _probe_values() -> np.ndarray:
    grid = np.array(oracles.ue5m3_grid()[:255])
    mids = (grid[:-1] + grid[1:]) / 2  # every tie
    g = torch.Generator().manual_seed(0)
    rand = np.exp2(torch.empty(4000).uniform_(-22, 19, generator=g).double().numpy())
    edge = [
        0.0,
        -0.0,
        -1.0,
        -math.inf,
        math.inf,
        math.nan,
        114688.0,
        122880.0,
        122881.0,
        1e30,
        2.0**-18,
        2.0**-18 * 1.0000001,
        3 * 2.0**-18,
        2.0**-14 - 2.0**-18,
    ]
    vals = np.concatenate([grid, mids, np.nextafter(mids, 0), np.nextafter(mids, np.inf), rand, edge])
    return vals.astype(np.float32).astype(np.float64)  # values fp32 can hold: what the reference takes


def test_ue5m3_round_and_encode_are_rne_against_the_hand_grid():
    x = _probe_values()
    codes, values = oracles.ue5m3_round(x)
    t = torch.tensor(x, dtype=torch.float32)
    got = R.round_to_element(t, UE5M3).double().numpy()
    assert np.array_equal(np.isnan(got), np.isnan(values))
    ok = ~np.isnan(values)
    assert np.array_equal(got[ok], values[ok])
    assert not np.signbit(got[ok]).any()  # unsigned: -0 and negatives come out +0
    assert np.array_equal(R.encode_element(t, UE5M3).numpy(), codes)
    assert np.array_equal(R.decode_element(R.encode_element(t, UE5M3), UE5M3).double().numpy()[ok], values[ok])


def test_variants_in_the_table():
    assert NVFP4_UE5M3.scale.name == "ue5m3" and NVFP4_UE5M3.block_size == 16 and not NVFP4_UE5M3.has_global_scale
    assert NVFP4_B32.scale.name == "ue4m3" and NVFP4_B32.block_size == 32 and NVFP4_B32.has_global_scale
    assert NVFP4_B32.scale_divisor == 6 * 448 and NVFP4_UE5M3.scale_divisor is None
    assert (NVFP4_UE5M3.bits_per_element, NVFP4_B32.bits_per_element) == (4.5, 4.25)
    assert not set(NVFP4_VARIANTS) & set(BLOCK_SCHEMES)
    for name, s in NVFP4_VARIANTS.items():
        assert get_block_scheme(name) is s and get_activation_format(name) is s and not s.scale_is_power_of_two


def _data(seed, shape=(24, 128)):
    g = torch.Generator().manual_seed(seed)
    rows = torch.exp2(torch.randint(-12, 8, (*shape[:-1], 1), generator=g).float())
    x = torch.randn(shape, generator=g) * rows
    x2 = x.reshape(-1, shape[-1])
    x2[0, :16] = 0.0  # an all-zero block
    x2[1, 3] = -0.0
    x2[2, :32] *= 1e4  # a block far above the rest
    return x


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(
    "scheme,global_scale",
    [
        ("nvfp4_ue5m3", None),
        ("nvfp4_ue5m3", "derived"),
        ("nvfp4_ue5m3", 2.0**-20),
        ("nvfp4_b32", "derived"),
        ("nvfp4_b32", 0.37),
        ("nvfp4", "derived"),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_variant_qdq_bit_exact_against_the_oracle(scheme, global_scale, dtype, seed):
    s = get_block_scheme(scheme)
    x = _data(seed).to(dtype)
    if global_scale == "derived":  # the two-level rule with the scheme's scale max: amax / (6 * scale.max)
        global_scale = float(np.float32(x.float().abs().max().item()) / np.float32(6 * s.scale.element.max))
    expected = oracles.nvfp4_variant_qdq(x.float().numpy(), s.block_size, s.scale.name, global_scale)
    got = R.quant_dequant_nvfp4_variant(x, scheme, global_scale, dtype=torch.float32)
    assert np.array_equal(got.numpy(), expected)
    assert not np.signbit(got.numpy()[1, 3])
    # quantize -> dequantize gives the same bits, and the codes decode to what the oracle rounded to
    packed, scale, used = R.quantize_nvfp4_variant(x, scheme, global_scale)
    assert scale.dtype == torch.uint8 and scale.shape == (x.shape[0], x.shape[1] // s.block_size)
    dq = R.dequantize_nvfp4_variant(packed, scale, scheme, used, torch.float32)
    assert torch.equal(dq, got)
    if scheme in NVFP4_VARIANTS:  # quant_dequant's nvfp4 is vLLM's activation QDQ (an encode scale), not this
        assert torch.equal(R.quant_dequant(x, scheme, global_scale, dtype=torch.float32), got)


def test_variant_qdq_of_nvfp4_is_modelopts_weight_arithmetic():
    x = _data(3, (2, 8, 64))
    packed, scale, g = R.quantize_nvfp4(x, zero_block_scale="zero")
    p2, s2, g2 = R.quantize_nvfp4_variant(x, "nvfp4")
    assert torch.equal(p2, packed) and torch.equal(s2, scale.view(torch.uint8)) and torch.equal(g2, g)


def test_variant_specials():
    x = torch.ones(2, 32)
    x[0, 5] = math.nan
    x[1, 7] = math.inf
    for scheme in ("nvfp4_ue5m3", "nvfp4_b32"):
        s = get_block_scheme(scheme)
        q = R.quant_dequant_nvfp4_variant(x, scheme, 1.0)
        assert torch.isnan(q[0, : s.block_size]).all() and not torch.isnan(q[0, s.block_size :]).any()
        assert torch.isfinite(q[1]).all() and q[1, 7] == 6.0 * s.scale.element.max  # scale saturates, element 6
        _, codes, _ = R.quantize_nvfp4_variant(x, scheme, 1.0)
        assert codes[0, 0].item() == s.scale.element.nan_code


def test_ue5m3_needs_no_global_scale_where_ue4m3_does():
    # a tensor with amax 1e-4: ue4m3 without a global scale flushes it (amax / 6 under e4m3's 2**-10 half-step),
    # ue5m3 keeps it (its normal range starts at 2**-14)
    x = _data(4) * 1e-4 / _data(4).abs().max()
    flushed = R.quant_dequant_nvfp4_variant(x, "nvfp4", 1.0)
    kept = R.quant_dequant_nvfp4_variant(x, "nvfp4_ue5m3")
    assert flushed.abs().max() == 0 and kept.abs().max() > 0


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: R.quant_dequant_nvfp4_variant(torch.ones(2, 24), "nvfp4_b32"), "multiple of"),
        (lambda: R.quant_dequant_nvfp4_variant(torch.ones(2, 32), "mxfp4"), "float block scale"),
        (lambda: R.quant_dequant_nvfp4_variant(torch.ones(2, 32), "nvfp4_b32", -1.0), "global_scale"),
        (
            lambda: R.dequantize_nvfp4_variant(
                torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8), "nvfp4_b32"
            ),
            "block_scale",
        ),
        (lambda: get_block_scheme("nvfp4_e5m3"), "nvfp4_ue5m3"),
    ],
)
def test_bad_input_is_refused(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


# ----------------------------------------------------------------------------- the MoE schemes


def _moe_case(seed=0, e=4, h=64, i=64, m=6, k=2):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * i, h, generator=g) * 0.05
    w2 = torch.randn(e, h, i, generator=g) * 0.05
    x = torch.randn(m, h, generator=g).bfloat16()
    topk_weights, topk_ids = torch.softmax(torch.randn(m, e, generator=g), -1).topk(k)
    return w13, w2, x, topk_weights.float(), topk_ids


def _oracle_qdq(t, s, g):
    return torch.from_numpy(oracles.nvfp4_variant_qdq(t.float().numpy(), s.block_size, s.scale.name, g)).to(t.dtype)


@pytest.mark.parametrize("name", ["nvfp4_ue5m3", "nvfp4_b32", "NVFP4_E5M3"])
def test_variant_experts_match_the_oracle_bit_for_bit(name):
    from mxlib.moe import factory as F
    from mxlib.moe.reference_moe import torch_moe
    from mxlib.moe.schemes import NVFP4_VARIANT_SCHEMES, get_moe_scheme

    scheme = get_moe_scheme(name)
    assert scheme in NVFP4_VARIANT_SCHEMES.values() and not scheme.is_ocp_mx and scheme.precision == "W4A4"
    s = scheme.weight
    w13, w2, x, tw, ti = _moe_case()
    weights = F.quantize_expert_weights(w13, w2, scheme)
    a1_scale, a2_scale = F.input_scales_from_amax(scheme, torch.tensor([3.0, 4.0, 2.0, 1.0]), torch.full((4,), 0.5))
    assert (a1_scale is None) == (not s.has_global_scale)
    experts = F.make_emulation_experts(scheme, weights, a1_scale, a2_scale)
    got = experts(x, tw, ti)
    # oracle: weights and activations QDQ'd by numpy + ml_dtypes / the hand UE5M3 grid, the same fp32 GEMMs
    g13 = g2 = None
    if s.has_global_scale:
        g13 = [float(np.float32(w13[j].abs().max()) / np.float32(2688.0)) for j in range(4)]
        g2 = [float(np.float32(w2[j].abs().max()) / np.float32(2688.0)) for j in range(4)]
    dq13 = torch.stack([_oracle_qdq(w13[j], s, g13 and g13[j]).bfloat16() for j in range(4)])
    dq2 = torch.stack([_oracle_qdq(w2[j], s, g2 and g2[j]).bfloat16() for j in range(4)])
    ga1 = float(a1_scale.max()) if s.has_global_scale else None
    ga2 = float(a2_scale.max()) if s.has_global_scale else None
    want = torch_moe(_oracle_qdq(x, s, ga1), dq13, dq2, tw, ti, lambda a2, _: _oracle_qdq(a2, s, ga2), False)
    assert torch.equal(got, want)


def test_variant_experts_two_level_option_and_refusals():
    from mxlib.moe import NVFP4_MOE, FusedMoEQuantConfig, get_moe_scheme
    from mxlib.moe import factory as F
    from mxlib.moe.nvfp4_variants import Nvfp4VariantEmulationExperts

    w13, w2, x, tw, ti = _moe_case(1)
    w = F.quantize_expert_weights(w13, w2, "nvfp4_ue5m3")
    ue5m3 = get_moe_scheme("nvfp4_ue5m3")
    one = Nvfp4VariantEmulationExperts(w, FusedMoEQuantConfig(ue5m3))
    two = Nvfp4VariantEmulationExperts(w, FusedMoEQuantConfig(ue5m3, activation_global_scale=True))
    assert one.scale_strategy == "none" and two.scale_strategy == "per_tensor"
    assert torch.isfinite(two(x, tw, ti).float()).all()
    for backend in ("triton", "fused"):
        with pytest.raises(ValueError, match="'torch' backend only"):
            F.make_emulation_experts("nvfp4_ue5m3", w, backend=backend)
        with pytest.raises(ValueError, match="'torch' backend only"):
            Nvfp4VariantEmulationExperts(w, FusedMoEQuantConfig(ue5m3), backend=backend)(x, tw, ti)
    with pytest.raises(ValueError, match="need w13_input_scale"):
        F.make_emulation_experts("nvfp4_b32", F.quantize_expert_weights(w13, w2, "nvfp4_b32"))
    with pytest.raises(ValueError, match="numerics"):
        FusedMoEQuantConfig(ue5m3, numerics="hardware")
    with pytest.raises(ValueError, match="activation_global_scale: nvfp4_b32 has static activation scales"):
        FusedMoEQuantConfig(get_moe_scheme("nvfp4_b32"), activation_global_scale=True)
    with pytest.raises(ValueError, match="quantized as nvfp4_ue5m3"):
        F.make_emulation_experts("nvfp4_b32", w, torch.ones(4), torch.ones(4))
    with pytest.raises(ValueError, match="does not run scheme nvfp4"):
        Nvfp4VariantEmulationExperts(F.quantize_expert_weights(w13, w2, "nvfp4"), FusedMoEQuantConfig(NVFP4_MOE))


def test_code_for_stored_formats_refuses_the_variants_by_name(tmp_path):
    from mxlib import checkpoints as C
    from mxlib.models.qwen3 import dummy_qwen3_moe, qwen3_30b_a3b_config
    from mxlib.moe import factory as F
    from mxlib.moe.linear import EmulatedLinear, LinearWeights
    from mxlib.moe.schemes import get_moe_scheme
    from mxlib.recovery.gptq import gptq_quantize

    from _util import TINY_QWEN3

    for name in NVFP4_VARIANTS:
        with pytest.raises(ValueError, match=f"{name} is an NVFP4 variant ahead of hardware; quantize_linear_weight"):
            F.quantize_linear_weight(torch.ones(4, 32), name)
        with pytest.raises(ValueError, match="not in linear layers"):
            w = LinearWeights(get_block_scheme(name), torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 1))
            EmulatedLinear(get_moe_scheme(name), w, torch.ones(1))
        with pytest.raises(ValueError, match="ahead of hardware; gptq"):
            gptq_quantize(torch.ones(1, 4, 32), torch.eye(32).expand(1, 32, 32), name)
    model = dummy_qwen3_moe(qwen3_30b_a3b_config(num_hidden_layers=1, **TINY_QWEN3), seed=3)
    with pytest.raises(ValueError, match="no checkpoint layout stores scheme nvfp4_ue5m3"):
        C.write_quantized_checkpoint(model, "nvfp4_ue5m3", tmp_path / "x")


def test_what_the_global_scale_buys_on_a_models_tensors():
    from mxlib.models.qwen3 import dummy_qwen3_moe, qwen3_30b_a3b_config
    from mxlib.studies import variant_lessons as V

    from _util import TINY_QWEN3

    model = dummy_qwen3_moe(qwen3_30b_a3b_config(num_hidden_layers=2, **TINY_QWEN3), seed=3)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    tensors = V.model_tensors(model, ids)
    k = model.config.num_experts_per_tok
    assert tensors["L1.w13"].shape == (4, 64, 64) and tensors["L0.a1"].shape == (16, 64)
    assert tensors["L0.a2"].shape == (16 * k, 32)
    rows = {r["tensor"]: r for r in V.global_scale_on_tensors(tensors)}
    assert set(rows) == {f"L{i}.{t}" for i in range(2) for t in ("w13", "w2", "a1", "a2")}
    for r in rows.values():  # two-level UE5M3 scales are NVFP4's times 2**8 while no UE4M3 scale is subnormal
        assert math.isfinite(r["ue5m3"]) and r["gs_buys_db"] == r["ue5m3_gs"] - r["ue5m3"]
    assert rows["L0.w13"]["ue5m3_gs"] == rows["L0.w13"]["nvfp4"]


def test_variant_orderings_join_a_notebooks_family():
    """With ``family``, the variants' pairs are decided in one Holm family with the notebook's other comparisons:
    the same verdict rows as a family of their own where the extra comparison is decided anyway, a larger family
    size, and a decided family refused."""
    from mxlib.stats import ComparisonFamily
    from mxlib.studies import variant_lessons as V

    draws = {"gaussian": V.variant_draws("gaussian", (4, 256), range(3))}
    pairs = [("nvfp4", "nvfp4_b32"), ("mxfp4", "nvfp4_ue5m3")]
    alone = V.variant_orderings(draws, pairs)
    family = ComparisonFamily("notebook")
    family.add("x", "y", [3.0, 3.1, 2.9], [0.0, 0.1, -0.1], metric="other", higher_is_better=True)
    joined = V.variant_orderings(draws, pairs, family=family)
    decisions = family.decide()
    assert decisions.m == 3 and "x vs y (other)" in decisions
    assert [(r["a"], r["b"], r["b_minus_a_db"]) for r in joined] == [(r["a"], r["b"], r["b_minus_a_db"]) for r in alone]
    assert all(j["low"] <= a["low"] and j["high"] >= a["high"] for j, a in zip(joined, alone))  # wider: m = 3, not 2
    with pytest.raises(RuntimeError, match="already decided"):
        V.variant_orderings(draws, pairs, family=family)
