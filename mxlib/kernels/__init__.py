"""Triton kernels: quantize / dequantize / QDQ twins of ``mxlib.reference`` and the fused MoE GEMMs.

Importing this package imports Triton. Set ``TRITON_INTERPRET=1`` *before* the
import to run the kernels on the CPU through Triton's interpreter.
"""

from .quant import (  # noqa: F401
    dequantize_mx,
    dequantize_to_dtype,
    nvfp4_quant_dequant,
    quant_dequant_fp8_per_tensor,
    quant_dequant_mx,
    quantize_mx,
    quantize_nvfp4,
    ref_nvfp4_quant_dequant,
)
