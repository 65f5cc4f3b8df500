"""NVFP4 activation block rules of the emulation experts (``activation_block_rule=``).

``amax`` (default): vLLM's QDQ, each block's amax mapped to e2m1's 6. ``four_over_six``: Four Over Six
(Cook et al., arXiv 2512.02010; mit-han-lab/fouroversix's activation quantizer): each block also QDQ'd
with its amax mapped to 4 and the candidate with the smaller squared error kept
(``mxlib.reference.ref_nvfp4_quant_dequant``'s ``block_rule``, its Triton twin in ``mxlib.kernels.quant``).
The published global scale normalizes the tensor amax to a block scale of 256 instead of 448 (a
4-block's scale is up to 1.5 times a 6-block's): the experts' encode global scales, calibrated as
``2688 / amax``, are multiplied by ``256 / 448`` in fp32 (``1536 / amax``).

4/6 runs with static activation scales and vLLM numerics, on every backend: ``torch`` and ``triton``
(``mxlib.kernels.quant``), and ``fused``'s FP4 kernel (``fused_fp4_moe``: the A-tile load and GEMM1's
epilogue); the dequantize-GEMM fused kernel (``fused_dequant_moe``, ``backend="fused"`` where the FP4
kernel does not apply) refuses it.
"""

from __future__ import annotations

import torch

from .. import reference as _ref
from ..formats import NVFP4

__all__ = [
    "ACTIVATION_BLOCK_RULES",
    "check_activation_block_rule",
    "block_rule_global_scale",
    "nvfp4_activation_qdq",
    "nvfp4_hw_qdq",
]

ACTIVATION_BLOCK_RULES = _ref.NVFP4_BLOCK_RULES
# 256 / 448 in fp32: 4/6's encode global scale over one calibrated for a block scale of 448
_FOUR_OVER_SIX_GS = torch.tensor(256.0 / NVFP4.scale.element.max, dtype=torch.float32).item()


def check_activation_block_rule(rule: str, per_token: bool = False, hardware: bool = False) -> str:
    """``rule`` if the experts can run it, else a ValueError naming ``activation_block_rule``."""
    if rule not in ACTIVATION_BLOCK_RULES:
        raise ValueError(f"activation_block_rule: expected one of {list(ACTIVATION_BLOCK_RULES)}, got {rule!r}")
    if rule != "amax" and (per_token or hardware):
        raise ValueError(
            f"activation_block_rule: {rule!r} runs with static activation scales and numerics 'vllm'; got "
            f"{'scale_strategy per_token' if per_token else 'numerics hardware'}"
        )
    return rule


def block_rule_global_scale(gs: torch.Tensor | None, rule: str) -> torch.Tensor | None:
    """The encode global scales ``gs`` (``2688 / amax``) the activation QDQ takes under ``rule``."""
    return gs if gs is None or rule == "amax" else gs * _FOUR_OVER_SIX_GS


def nvfp4_activation_qdq(ops, rule: str):
    """``(x, gs) -> QDQ'd x``: ``ops.ref_nvfp4_quant_dequant`` (vLLM's arithmetic) by ``rule``, scales checked once."""
    return lambda x, gs: ops.ref_nvfp4_quant_dequant(x, gs, check_scale=False, block_rule=rule)


def nvfp4_hw_qdq(x: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """NVFP4 QDQ in hardware form (amax rule): ``e2m1 * block_scale`` (exact in bf16), ``1 / gs`` left out."""
    el, s = _ref.ref_nvfp4_quant(x, gs)
    return (el * s.repeat_interleave(NVFP4.block_size, dim=-1)).to(x.dtype)
