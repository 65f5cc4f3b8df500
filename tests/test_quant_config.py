"""``FusedMoEQuantConfig``: each field checked once, with the field, the expected and the actual value; the experts
built from it; the subclass hooks the base class names are the methods the subclasses override."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mxlib.formats import Numerics
from mxlib.kernels.hadamard import BlockHadamard
from mxlib.moe import (
    NVFP4_MOE,
    SWIGLUOAI,
    W4A16_NVFP4,
    FusedMoEQuantConfig,
    Nvfp4QuantizationEmulationTritonExperts,
    OCP_MXQuantizationEmulationTritonExperts,
    TritonExperts,
    get_moe_scheme,
    make_emulation_experts,
    make_experts,
    quantize_expert_weights,
)
from mxlib.moe.base import SUBCLASS_HOOKS
from mxlib.moe.emulation import QuantizedExperts
from mxlib.moe.nvfp4_variants import Nvfp4VariantEmulationExperts
from mxlib.moe.weight_only import Nvfp4WeightOnlyEmulationTritonExperts

E, H, I = 4, 64, 32


def _weights(scheme="nvfp4"):
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g) * 0.05).to(torch.bfloat16)
    return w13, w2, quantize_expert_weights(w13, w2, scheme)


def test_defaults_and_names_resolved():
    c = FusedMoEQuantConfig(NVFP4_MOE, numerics="hardware", activation="swigluoai")
    assert c.numerics is Numerics.HARDWARE and c.activation is SWIGLUOAI
    assert FusedMoEQuantConfig().scheme is None and FusedMoEQuantConfig().numerics is Numerics.VLLM
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.numerics = Numerics.VLLM  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(scheme="nvfp4"), TypeError, r"scheme: expected a MoEQuantScheme or None .*got str 'nvfp4'"),
        (dict(numerics="exact"), ValueError, r"numerics: expected one of \['vllm', 'hardware'\], got 'exact'"),
        (dict(scale_strategy="p99"), ValueError, r"scale_strategy: expected one of .*got 'p99'"),
        (dict(activation_block_rule="x"), ValueError, r"activation_block_rule: expected one of .*got 'x'"),
        (dict(activation_scale_mode="ceil"), ValueError, r"unknown scale_mode 'ceil'"),
        (dict(global_scale_kind="inverse"), ValueError, r"global_scale_kind: expected one of .*got 'inverse'"),
        (dict(activation="relu"), ValueError, r"activation"),
        (dict(rotation=16), TypeError, r"rotation: expected a BlockHadamard or None, got int"),
        (dict(activation_global_scale=1), TypeError, r"activation_global_scale: expected a bool, got int"),
    ],
)
def test_each_field_is_checked(kwargs, error, match):
    with pytest.raises(error, match=match):
        FusedMoEQuantConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(scheme=get_moe_scheme("w_mxfp4_a_mxfp4"), activation_block_rule="four_over_six"), "applies to NVFP4"),
        (dict(scheme=NVFP4_MOE, activation_block_rule="four_over_six", scale_strategy="per_token"), "per_token"),
        (dict(scheme=NVFP4_MOE, activation_block_rule="four_over_six", numerics="hardware"), "numerics hardware"),
        (dict(scheme=NVFP4_MOE, numerics="hardware", global_scale_kind="encode"), "needs decode global scales"),
        (dict(scheme=get_moe_scheme("nvfp4_b32"), numerics="hardware"), "dequantized operands only"),
        (dict(scheme=NVFP4_MOE, activation_global_scale=True), "nvfp4_ue5m3 activations only"),
    ],
)
def test_combinations_that_cannot_run_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FusedMoEQuantConfig(**kwargs)


def test_replace_checks_again():
    c = FusedMoEQuantConfig(NVFP4_MOE, activation_block_rule="four_over_six")
    with pytest.raises(ValueError, match="activation_block_rule"):
        c.replace(numerics="hardware")
    assert c.replace(numerics="vllm").numerics is Numerics.VLLM


def test_experts_take_weights_config_and_backend():
    _, _, q = _weights("nvfp4")
    ones = torch.ones(E)
    config = FusedMoEQuantConfig(NVFP4_MOE, scale_strategy="per_expert")
    ex = Nvfp4QuantizationEmulationTritonExperts(q, config, ones, ones, backend="torch")
    assert ex.config is config and ex.scheme is NVFP4_MOE and ex.scale_strategy == "per_expert"
    assert type(make_experts(q, config, ones, ones, backend="torch")) is Nvfp4QuantizationEmulationTritonExperts
    # the class refuses a config of a scheme it does not run, and weights of another global-scale kind
    with pytest.raises(ValueError, match="does not run scheme w4a16_nvfp4"):
        Nvfp4QuantizationEmulationTritonExperts(q, FusedMoEQuantConfig(W4A16_NVFP4), ones, ones)
    with pytest.raises(ValueError, match="does not run scheme nvfp4"):
        OCP_MXQuantizationEmulationTritonExperts(q, config)
    with pytest.raises(ValueError, match="global_scale_kind 'decode', the config says 'encode'"):
        encode = FusedMoEQuantConfig(NVFP4_MOE, global_scale_kind="encode")
        Nvfp4QuantizationEmulationTritonExperts(q, encode, ones, ones)
    with pytest.raises(TypeError, match="config: expected a FusedMoEQuantConfig, got str"):
        Nvfp4QuantizationEmulationTritonExperts(q, "nvfp4", ones, ones)


def test_setting_numerics_or_rotation_replaces_the_config():
    w13, w2, q = _weights("nvfp4")
    ex = make_emulation_experts("nvfp4", q, torch.ones(E), torch.ones(E), backend="torch")
    before = ex.config
    ex.numerics = "hardware"
    assert ex.numerics is Numerics.HARDWARE and ex.config is not before and before.numerics is Numerics.VLLM
    ex.rotation = BlockHadamard(16)
    assert ex.config.rotation is not None and ex.rotation.block_size == 16
    ex.rotation = None
    assert ex.config.rotation is None and ex.rotation is None
    enc = dataclasses.replace(q, global_scale_kind="encode")
    ex = make_emulation_experts("nvfp4", enc, torch.ones(E), torch.ones(E), backend="torch")
    with pytest.raises(ValueError, match="needs decode global scales"):
        ex.numerics = "hardware"
    assert ex.numerics is Numerics.VLLM  # refused: the config is the one it was


def test_unquantized_experts_refuse_a_scheme():
    w13, w2, _ = _weights()
    assert TritonExperts(w13, w2, FusedMoEQuantConfig(activation="swigluoai")).activation is SWIGLUOAI
    with pytest.raises(ValueError, match="config: TritonExperts runs unquantized weights, got scheme nvfp4"):
        TritonExperts(w13, w2, FusedMoEQuantConfig(NVFP4_MOE))


def test_the_overridden_methods_are_the_named_hooks():
    import mxlib.moe.base as B

    classes = (
        QuantizedExperts,
        Nvfp4QuantizationEmulationTritonExperts,
        OCP_MXQuantizationEmulationTritonExperts,
        Nvfp4WeightOnlyEmulationTritonExperts,
        Nvfp4VariantEmulationExperts,
    )
    base = {n for n, v in vars(TritonExperts).items() if callable(v) and not n.startswith("__")}
    overridden = {n for c in classes for n in vars(c) if n in base}
    assert overridden == set(SUBCLASS_HOOKS), sorted(overridden ^ set(SUBCLASS_HOOKS))
    for hook in SUBCLASS_HOOKS:
        assert f"``{hook}``" in B.__doc__, hook
