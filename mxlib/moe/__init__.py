"""Routing, the fused-MoE experts, their emulation subclasses and the reference MoE."""

from .experts import (  # noqa: F401
    SCALE_STRATEGIES,
    Nvfp4QuantizationEmulationTritonExperts,
    OCP_MXQuantizationEmulationTritonExperts,
    TransformersExperts,
    TritonExperts,
    max_input_scale,
    silu_and_mul,
    torch_moe,
    unify_input_scales,
)
from .routing import fused_topk, moe_align_block_size  # noqa: F401
from .schemes import MOE_SCHEMES, OCP_MX_SCHEMES, MoEQuantScheme, get_moe_scheme  # noqa: F401
