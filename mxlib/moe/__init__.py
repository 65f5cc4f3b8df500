"""Routing, the fused-MoE experts, their emulation subclasses, the factory and the reference MoE.

``schemes`` (weight + activation format of each MoE scheme), ``routing`` (Qwen3 top-k),
``activations`` (the gated activations: SiLU, gpt-oss's SwiGLU-OAI), ``reference_moe`` (the pure-PyTorch
MoE), ``scales`` (activation-scale strategies), ``base``
(``TritonExperts`` and backends), ``emulation`` (the NVFP4 and OCP MX emulation experts), ``kept_weights``
(``KeptDequantized``: dequantized expert weights kept across forwards, ``QuantizedExperts.keep_dequantized``),
``quant_config`` (``FusedMoEQuantConfig``: the experts' quantization modes in one frozen object, checked once),
``factory`` (quantize experts and build emulation experts: the one way to make them), ``linear``
(``EmulatedLinear``: a quantized ``nn.Linear`` such as an attention projection, built by the factory),
``nvfp4_variants`` (``Nvfp4VariantEmulationExperts``: the NVFP4 variants ahead of hardware, ``nvfp4_ue5m3`` and
``nvfp4_b32``, on the ``torch`` backend), ``expert_weights`` (``ExpertWeights``: one layer's experts quantized
in one block scheme), ``activation_rules`` (the NVFP4 activation block rules, ``activation_block_rule=``),
``weight_only`` (the weight-only NVFP4 experts, ``w4a16_nvfp4``), and ``experts`` (the experts classes under the
import path of vLLM's emulation design).
"""

from .activations import ACTIVATIONS, SILU, SWIGLUOAI, MoEActivation, activation_and_mul, get_activation  # noqa: F401
from .base import BACKENDS, QuantizedA1, TransformersExperts, TritonExperts, ops_for_device  # noqa: F401
from .emulation import (  # noqa: F401
    ExpertWeights,
    Nvfp4QuantizationEmulationTritonExperts,
    OCP_MXQuantizationEmulationTritonExperts,
)
from .factory import (  # noqa: F401
    input_scales_from_amax,
    make_emulated_linear,
    make_emulation_experts,
    make_experts,
    quantize_expert_weights,
    quantize_linear_weight,
)
from .linear import EmulatedLinear, LinearWeights, linear_input_amax  # noqa: F401
from .quant_config import FusedMoEQuantConfig  # noqa: F401
from .reference_moe import silu_and_mul, torch_moe  # noqa: F401
from .routing import fused_topk, moe_align_block_size  # noqa: F401
from .scales import (  # noqa: F401
    ACTIVATION_SCALE_STRATEGIES,
    PER_TOKEN,
    SCALE_STRATEGIES,
    max_input_scale,
    unify_input_scales,
)
from .schemes import (  # noqa: F401
    FP8_PER_TENSOR,
    MOE_SCHEMES,
    NVFP4_MOE,
    OCP_MX_SCHEMES,
    W4A16_NVFP4,
    MoEQuantScheme,
    get_moe_scheme,
)
