"""Weight-only NVFP4 MoE emulation (``w4a16_nvfp4``): NVFP4 weights, activations left in bf16.

What vLLM's NVFP4 MoE backends for GPUs without FP4 tensor cores compute (Marlin, Humming: W4A16):
the experts' NVFP4 weights are dequantized and multiplied with the unquantized activations; neither
the layer input a1 nor the intermediate activation a2 is quantized, so no activation scale is read
and a checkpoint's ``input_scale`` (if any) is ignored. Beside the W4A4 ``nvfp4`` experts it shows
what activation quantization costs.

Numerics (``numerics=``), as for ``Nvfp4QuantizationEmulationTritonExperts``:

* ``"vllm"``: weights dequantized to ``bf16(e2m1 * (fp32(ue4m3) * weight_scale_2))`` (vLLM's
  ``dequantize_to_dtype``), bf16 GEMMs with fp32 accumulation;
* ``"hardware"``: operands ``e2m1 * ue4m3`` (exact in bf16), the per-expert ``weight_scale_2``
  multiplying the fp32 GEMM output (the structure of Marlin's NVFP4 kernel, which applies the
  global scale after its dequantize-GEMM).

Marlin's and Humming's own bf16 roundings (Humming folds ``weight_scale_2`` into bf16 block scales)
are not reproduced bit for bit; the two numerics above bracket them.
"""

from __future__ import annotations

import torch

from ..kernels.fused_dequant_moe import ActivationQDQ
from .base import QuantizedA1
from .emulation import ExpertWeights, Nvfp4QuantizationEmulationTritonExperts
from .quant_config import FusedMoEQuantConfig
from .schemes import W4A16_NVFP4, MoEQuantScheme

__all__ = ["Nvfp4WeightOnlyEmulationTritonExperts"]


class Nvfp4WeightOnlyEmulationTritonExperts(Nvfp4QuantizationEmulationTritonExperts):
    """NVFP4 weights dequantized, bf16 activations (W4A16), bf16 GEMMs.

    Args:
        weights: ``ExpertWeights`` in ``nvfp4`` (``Nvfp4QuantizationEmulationTritonExperts``' shapes
            and dtypes; ``w13_weight_scale_2`` ``[E]`` or ``[E, 2]``).
        config: a ``FusedMoEQuantConfig`` of scheme ``w4a16_nvfp4``: ``numerics`` ``"vllm"`` or ``"hardware"``
            (module docstring), ``rotation``, ``activation`` (its ``scale_strategy`` is shown, nothing reads it).
        activation_dtype: bf16 (default), fp16 or fp32;
        backend: ``auto`` / ``triton`` / ``fused`` / ``torch`` (``fused``: the FP4 kernel with no
            activation QDQ, for bf16 activations and H, I multiples of 128 or padded to them);
        w13_bias, w2_bias: the expert biases (``TritonExperts``).

    Raises:
        TypeError / ValueError: as ``Nvfp4QuantizationEmulationTritonExperts`` for the weights and the config.
    """

    quant_dtype = None

    def __init__(
        self,
        weights: ExpertWeights,
        config: FusedMoEQuantConfig,
        *,
        activation_dtype: torch.dtype = torch.bfloat16,
        backend: str = "auto",
        w13_bias: torch.Tensor | None = None,
        w2_bias: torch.Tensor | None = None,
    ):
        super().__init__(
            weights,
            config,
            None,
            None,
            activation_dtype=activation_dtype,
            backend=backend,
            w13_bias=w13_bias,
            w2_bias=w2_bias,
        )

    @staticmethod
    def _runs(scheme: MoEQuantScheme) -> bool:
        """Whether this class runs ``scheme`` (``w4a16_nvfp4``)."""
        return scheme is W4A16_NVFP4

    def _set_activation_scales(self) -> None:
        """No activation scales: the strategy is kept for display only, nothing is read."""
        self._a13_uniform = self._a2_uniform = True
        self.register_buffer("a13_gscale", None, persistent=False)
        self.register_buffer("a2_gscale", None, persistent=False)

    @property
    def per_token(self) -> bool:
        return False

    def a1_qdq(self) -> ActivationQDQ:
        return ActivationQDQ()

    def a2_qdq(self) -> ActivationQDQ:
        return ActivationQDQ()

    def output_scales(self, e: int):
        if not self._hardware():
            return None
        g13 = self.w13_weight_scale_2[e]
        if g13.ndim == 1:  # [2]: gate and up columns each their own
            g13 = g13.repeat_interleave(self.intermediate_size)
        return [g13], [self.w2_weight_scale_2[e]]

    def quantize_input(self, a1, topk_ids, backend):
        return QuantizedA1(a1)

    def quantize_intermediate(self, a2, row_experts, backend):
        return a2
