"""Triton kernels: quantize / dequantize / QDQ twins of ``mxlib.reference`` and the fused MoE GEMMs.

Modules: ``quant`` (the twins), ``fused_moe`` (the bf16 grouped GEMM), ``fused_dequant_moe``
(the fused dequantize-GEMM), ``align`` (``moe_align_block_size``), ``_numerics`` (the rounding
code every kernel shares) and ``_bridge`` (formats -> launch constexprs, tiles).

Interpreter or compiler: Triton decides when a kernel is defined (``triton.jit`` reads
``TRITON_INTERPRET`` then), so this package decides once, here, before its kernel modules
load: ``TRITON_INTERPRET`` as set by the caller, else the interpreter when no CUDA device is
present (the only way Triton kernels run on a CPU). Callers need not set it, and may import
mxlib in any order.
"""

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from .align import moe_align_block_size  # noqa: E402,F401
from .quant import (  # noqa: E402,F401
    dequantize_mx,
    dequantize_to_dtype,
    nvfp4_quant_dequant,
    quant_dequant_fp8_per_tensor,
    quant_dequant_mx,
    quantize_mx,
    quantize_nvfp4,
    ref_nvfp4_quant_dequant,
)
