"""The seed's ``mxlib.moe.experts`` names, kept for code that imports them from here.

The code lives in modules by subject: ``mxlib.moe.reference_moe`` (the reference MoE),
``mxlib.moe.scales`` (activation-scale strategies), ``mxlib.moe.base`` (``TritonExperts``,
backend selection, the transformers adapter), ``mxlib.moe.emulation`` (the emulation
subclasses) and ``mxlib.moe.factory`` (quantize experts, build emulation experts).
"""

from __future__ import annotations

from .base import BACKENDS, TransformersExperts, TritonExperts, ops_for_backend, ops_for_device, resolve_backend
from .emulation import (
    ExpertWeights,
    Nvfp4QuantizationEmulationTritonExperts,
    OCP_MXQuantizationEmulationTritonExperts,
    QuantizedExperts,
)
from .reference_moe import silu_and_mul, torch_moe
from .scales import SCALE_STRATEGIES, max_input_scale, unify_input_scales

__all__ = [
    "TritonExperts",
    "Nvfp4QuantizationEmulationTritonExperts",
    "OCP_MXQuantizationEmulationTritonExperts",
    "TransformersExperts",
    "silu_and_mul",
    "torch_moe",
    "unify_input_scales",
    "max_input_scale",
    "SCALE_STRATEGIES",
    "BACKENDS",
    "ExpertWeights",
    "QuantizedExperts",
    "ops_for_device",
    "ops_for_backend",
    "resolve_backend",
]

# seed-era private names
_QuantizedExperts = QuantizedExperts
_resolve_backend = resolve_backend
_ops = ops_for_backend
