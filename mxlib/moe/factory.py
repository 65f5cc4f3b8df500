"""The one factory for MoE emulation: quantize experts for a scheme, build the emulation experts.

``quantize_expert_weights(w13, w2, scheme)`` quantizes one layer's bf16 experts in a scheme's
weight format (NVFP4 with ModelOpt's arithmetic, gate and up sharing one ``weight_scale_2``;
OCP MX with the E8M0 ``even`` rule, as Quark exports) and returns ``ExpertWeights``.
``make_emulation_experts(scheme, weights, w13_input_scale, w2_input_scale, backend=...,
scale_strategy=...)`` builds the scheme's emulation experts from quantized weights, wherever
they came from (this module, or a checkpoint). ``quantize_linear_weight`` and
``make_emulated_linear`` do the same for one quantized ``nn.Linear`` (``mxlib.moe.linear``).
``input_scales_from_amax`` turns calibrated activation maxima into the static decode scales a
scheme's activation format needs.

The checkpoint loader, the studies, the benchmarks and the tests all build experts here.
"""

from __future__ import annotations

import torch

from .. import reference as _ref
from ..formats import NVFP4_VARIANTS, BlockScheme, PerTensorScheme
from ..kernels.hadamard import BlockHadamard
from .activations import SILU, MoEActivation
from .base import ops_for_device
from .emulation import (
    ExpertWeights,
    Nvfp4QuantizationEmulationTritonExperts,
    OCP_MXQuantizationEmulationTritonExperts,
    QuantizedExperts,
)
from .linear import EmulatedLinear, LinearWeights
from .nvfp4_variants import Nvfp4VariantEmulationExperts
from .quant_config import FusedMoEQuantConfig
from .scales import PER_TOKEN
from .schemes import MoEQuantScheme, checkpoint_weight_format, get_moe_scheme, get_weight_format
from .weight_only import Nvfp4WeightOnlyEmulationTritonExperts

__all__ = [
    "ExpertWeights",
    "quantize_expert_weights",
    "make_emulation_experts",
    "make_experts",
    "input_scales_from_amax",
    "LinearWeights",
    "quantize_linear_weight",
    "make_emulated_linear",
]

# The E8M0 rule OCP MX weights are exported with (Quark's ``scale_calculation_mode``).
WEIGHT_SCALE_MODE = "even"


def quantize_expert_weights(
    w13: torch.Tensor, w2: torch.Tensor, scheme: MoEQuantScheme | BlockScheme | str, ops=None
) -> ExpertWeights:
    """Quantize one layer's experts in a scheme's weight format.

    Args:
        w13: ``[E, 2I, H]`` gate-then-up weights; w2: ``[E, H, I]`` (bf16 / fp16 / fp32).
        scheme: a ``MoEQuantScheme`` (its weight format is used), a ``BlockScheme`` or a name
            of either (``nvfp4``, ``w_mxfp6_e2m3``, ``mxfp4``, ...).
        ops: ``mxlib.reference`` or ``mxlib.kernels`` (same bits); default by the device of ``w13``.

    Returns:
        ``ExpertWeights`` on ``w13``'s device. NVFP4: one ``weight_scale_2`` per expert for gate
        and up together (ModelOpt), one for down.
    """
    fmt = get_weight_format(scheme)
    ops = ops or ops_for_device(w13.device)
    if fmt.name in NVFP4_VARIANTS:  # the reference arithmetic (no kernel reads these formats)
        p13, s13, g13 = _ref.quantize_nvfp4_variant(w13, fmt)
        p2, s2, g2 = _ref.quantize_nvfp4_variant(w2, fmt)
        return ExpertWeights(fmt, p13, s13, p2, s2, g13, g2)
    if fmt.has_global_scale:
        p13, s13, g13 = ops.quantize_nvfp4(w13, block_size=fmt.block_size)
        p2, s2, g2 = ops.quantize_nvfp4(w2, block_size=fmt.block_size)
        return ExpertWeights(fmt, p13, s13, p2, s2, g13, g2)
    p13, s13 = ops.quantize_mx(w13, fmt.element, fmt.block_size, WEIGHT_SCALE_MODE)
    p2, s2 = ops.quantize_mx(w2, fmt.element, fmt.block_size, WEIGHT_SCALE_MODE)
    return ExpertWeights(fmt, p13, s13, p2, s2)


def input_scales_from_amax(
    scheme: MoEQuantScheme | str, a1_amax: torch.Tensor, a2_amax: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
    """Static decode scales ``(w13_input_scale, w2_input_scale)`` from per-expert activation amax.

    NVFP4 activations: ``amax / 2688``; per-tensor FP8: ``amax / 448`` (the activation format's
    ``scale_divisor``). Schemes with dynamic (or no) activation scales give ``(None, None)``.
    """
    act = get_moe_scheme(scheme).activation
    if act is None or not act.static_scale:
        return None, None
    return a1_amax.float() / act.scale_divisor, a2_amax.float() / act.scale_divisor


def make_emulation_experts(
    scheme: MoEQuantScheme | str,
    weights: ExpertWeights,
    w13_input_scale: torch.Tensor | None = None,
    w2_input_scale: torch.Tensor | None = None,
    backend: str = "auto",
    scale_strategy: str = "max",
    activation_scale_mode: str = "even",
    activation_dtype: torch.dtype = torch.bfloat16,
    numerics: str = "vllm",
    activation_block_rule: str = "amax",
    rotation: BlockHadamard | None = None,
    activation: MoEActivation | str = SILU,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation_global_scale: bool = False,
) -> QuantizedExperts:
    """The emulation experts of ``scheme`` from quantized weights and static input scales.

    Args:
        scheme: a ``MoEQuantScheme`` (or its name).
        weights: ``ExpertWeights`` in the scheme's weight format (``quantize_expert_weights``, or
            stacked from a checkpoint).
        w13_input_scale, w2_input_scale: fp32 ``[E]`` decode scales, for schemes whose activation
            scale is static (``nvfp4``, ``_a_fp8``); ignored otherwise (``w4a16_nvfp4``: weight-only
            NVFP4, ``mxlib.moe.weight_only``).
        backend: ``auto`` / ``triton`` / ``fused`` / ``torch``.
        scale_strategy: NVFP4 activation-scale unification (``mxlib.moe.scales``).
        activation_scale_mode: E8M0 rule of dynamic MX activations.
        activation_dtype: bf16 (default), fp16 or fp32.
        numerics: ``vllm`` (vLLM's emulation, bit for bit) or ``hardware`` (operands
            ``element * block_scale``, per-tensor scales on the fp32 GEMM outputs; ``mxlib.moe.emulation``).
        activation_block_rule: NVFP4 activations' block rule, ``amax`` (default, vLLM's) or
            ``four_over_six`` (``Nvfp4QuantizationEmulationTritonExperts``); other schemes take ``amax`` only.
        rotation: the online block Hadamard rotation of weights rotated offline (``TritonExperts.rotation``,
            ``mxlib.recovery.hadamard``), or None.
        activation: the gated activation, a ``MoEActivation`` or its name (``"silu"``, the default, or
            ``"swigluoai"``, gpt-oss's; ``mxlib.moe.activations``).
        w13_bias, w2_bias: ``[E, 2I]`` (gate, then up) and ``[E, H]`` expert biases, fp32 or the activation
            dtype, added to the fp32 GEMM outputs before their rounding (``TritonExperts``); or None.
        activation_global_scale: ``nvfp4_ue5m3`` only: activations QDQ'd with a dynamic per-tensor decode scale
            (``mxlib.moe.nvfp4_variants``) instead of the one-level form.

    The modes become one ``FusedMoEQuantConfig`` (checked once, ``mxlib.moe.quant_config``; its
    ``global_scale_kind`` is the weights'), from which ``make_experts`` builds the scheme's experts class.

    Raises:
        ValueError: weights in another format than the scheme's; a static-scale scheme without
            input scales; a block rule other than ``amax`` for a scheme without NVFP4 activations;
            an unknown name of a mode (``FusedMoEQuantConfig``); a bias of another shape or device.
        TypeError: weights that are not an ``ExpertWeights``; a bias of another dtype.
    """
    s = get_moe_scheme(scheme)
    if not isinstance(weights, ExpertWeights):
        raise TypeError(
            f"weights: expected an ExpertWeights (mxlib.moe.quantize_expert_weights), got {type(weights).__name__}"
        )
    if weights.scheme != s.weight:
        raise ValueError(f"weights: quantized as {weights.scheme.name}, scheme {s.name} stores {s.weight.name}")
    config = FusedMoEQuantConfig(
        s,
        numerics=numerics,
        scale_strategy=scale_strategy,
        activation_block_rule=activation_block_rule,
        activation_scale_mode=activation_scale_mode,
        global_scale_kind=weights.global_scale_kind,
        rotation=rotation,
        activation=activation,
        activation_global_scale=activation_global_scale,
    )
    return make_experts(
        weights,
        config,
        w13_input_scale,
        w2_input_scale,
        backend=backend,
        activation_dtype=activation_dtype,
        w13_bias=w13_bias,
        w2_bias=w2_bias,
    )


def make_experts(
    weights: ExpertWeights,
    config: FusedMoEQuantConfig,
    w13_input_scale: torch.Tensor | None = None,
    w2_input_scale: torch.Tensor | None = None,
    *,
    backend: str = "auto",
    activation_dtype: torch.dtype = torch.bfloat16,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> QuantizedExperts:
    """The emulation experts of ``config.scheme`` (``make_emulation_experts``' class choice) from quantized weights,
    a checked ``FusedMoEQuantConfig`` and, for static activation scales, the per-expert input scales (held on the
    weights' device).

    ``nvfp4_ue5m3`` / ``nvfp4_b32``: ``Nvfp4VariantEmulationExperts``; ``w4a16_nvfp4``:
    ``Nvfp4WeightOnlyEmulationTritonExperts``; ``nvfp4``: ``Nvfp4QuantizationEmulationTritonExperts``; every OCP MX
    scheme: ``OCP_MXQuantizationEmulationTritonExperts`` (the input scales passed for ``_a_fp8`` schemes only).

    Raises:
        TypeError: a config that is not a ``FusedMoEQuantConfig``.
        ValueError: a config without a scheme; a static-scale scheme without input scales (unless
            ``scale_strategy`` is ``per_token``); an NVFP4 variant on a backend other than ``auto`` / ``torch``;
            the experts classes' errors.
    """
    if not isinstance(config, FusedMoEQuantConfig):
        raise TypeError(f"config: expected a FusedMoEQuantConfig, got {type(config).__name__}")
    s = config.scheme
    if s is None:
        raise ValueError("config: expected a scheme (unquantized experts: TritonExperts)")
    static = s.static_activation_scale
    if static and config.scale_strategy != PER_TOKEN and (w13_input_scale is None or w2_input_scale is None):
        raise ValueError(f"{s.name}: activations with a static scale need w13_input_scale and w2_input_scale")
    # the static input scales live where the weights do (a Calibration records its amax on the CPU)
    dev = weights.w13_weight.device
    w13_input_scale = None if w13_input_scale is None else w13_input_scale.to(dev)
    w2_input_scale = None if w2_input_scale is None else w2_input_scale.to(dev)
    kw = dict(activation_dtype=activation_dtype, backend=backend, w13_bias=w13_bias, w2_bias=w2_bias)
    if s.weight.name in NVFP4_VARIANTS:
        if backend not in ("auto", "torch"):
            raise ValueError(
                f"backend: {s.name} runs on the 'torch' backend only (no Triton kernel reads its block scales); "
                f"got {backend!r}"
            )
        return Nvfp4VariantEmulationExperts(weights, config, w13_input_scale, w2_input_scale, **kw)
    if s.weight.has_global_scale and s.weight_only:  # w4a16_nvfp4: no activation scale is read
        return Nvfp4WeightOnlyEmulationTritonExperts(weights, config, **kw)
    if s.weight.has_global_scale:
        return Nvfp4QuantizationEmulationTritonExperts(weights, config, w13_input_scale, w2_input_scale, **kw)
    if not isinstance(s.activation, PerTensorScheme):
        w13_input_scale = w2_input_scale = None
    return OCP_MXQuantizationEmulationTritonExperts(weights, config, w13_input_scale, w2_input_scale, **kw)


def quantize_linear_weight(weight: torch.Tensor, scheme: MoEQuantScheme | BlockScheme | str, ops=None) -> LinearWeights:
    """Quantize one ``[out, in]`` linear weight in a scheme's weight format, as
    ``quantize_expert_weights`` does for the experts (NVFP4: ModelOpt's arithmetic and decode
    ``weight_scale_2``; OCP MX: E8M0 ``even``; FP8: ``mxlib.reference.quantize_fp8_weight``, one scale per tensor,
    per output channel for ``w_fp8_a_fp8_per_token``, as every producer's preset pairs them and mxlib's FP8 layouts
    write them)."""
    fmt = checkpoint_weight_format(scheme, "quantize_linear_weight")
    if weight.ndim != 2:
        raise ValueError(f"weight: expected [out, in], got shape {list(weight.shape)}")
    if isinstance(fmt, PerTensorScheme):  # FP8 linear layers: one fp32 scale per tensor, or per output channel
        name = scheme.name if isinstance(scheme, MoEQuantScheme) else scheme
        codes, s = _ref.quantize_fp8_weight(weight, per_channel=name == "w_fp8_a_fp8_per_token")
        return LinearWeights(fmt, codes, s)
    ops = ops or ops_for_device(weight.device)
    if fmt.has_global_scale:
        p, s, g = ops.quantize_nvfp4(weight, block_size=fmt.block_size)
        return LinearWeights(fmt, p, s, g.reshape(()).float())
    p, s = ops.quantize_mx(weight, fmt.element, fmt.block_size, WEIGHT_SCALE_MODE)
    return LinearWeights(fmt, p, s)


def make_emulated_linear(
    scheme: MoEQuantScheme | str,
    weights: LinearWeights,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    backend: str = "auto",
    activation_scale_mode: str = "even",
    activation_dtype: torch.dtype = torch.bfloat16,
) -> EmulatedLinear:
    """The emulated linear layer of ``scheme`` (``mxlib.moe.linear.EmulatedLinear``) from a quantized
    weight and, for static activation scales, its one-element fp32 ``input_scale`` (in the
    convention of ``weights.global_scale_kind`` for NVFP4).

    Raises:
        ValueError: weights in another format than the scheme's; a static-scale scheme without
            ``input_scale``.
    """
    s = get_moe_scheme(scheme)
    if s.static_activation_scale and input_scale is None:
        raise ValueError(f"{s.name}: activations with a static scale need input_scale")
    return EmulatedLinear(
        s,
        weights,
        input_scale,
        bias=bias,
        backend=backend,
        activation_scale_mode=activation_scale_mode,
        activation_dtype=activation_dtype,
    )
