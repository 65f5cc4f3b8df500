"""Triton kernels: quantize / dequantize / QDQ twins of ``mxlib.reference`` and the fused MoE GEMMs.

Modules: ``quant`` (the twins), ``fused_moe`` (the bf16 grouped GEMM), ``fused_dequant_moe``
(the fused dequantize-GEMM), ``fused_fp4_moe`` (the fused FP4-weight MoE) with its weight layouts
``fp4_layout`` and ``fp6_layout``, ``tiles`` (``TileConfig``, the GEMMs' tile type), ``align``
(``moe_align_block_size`` in PyTorch and Triton, the routing plan of a forward), ``_numerics``
(the rounding code every kernel shares), ``_bridge`` (formats -> launch constexprs, the
elementwise kernels' tiles, the interpreter choice) and ``_triton`` (triton itself, or, where the optional package
is not installed, stand-ins that let the modules import and name the ``triton`` extra when a kernel is launched).
The fused kernels' parts: ``fp4_prepare`` (the FP4 kernel's weight layouts from ``PackedWeights``), ``fp4_tiles``
(its tile tables), ``fp4_activations`` (its activation QDQ, in the A-tile load or as one pass before GEMM1),
``dequant_tiles`` (the dequantize-GEMM's weight-tile decodes), ``moe_epilogue`` (what the grouped GEMMs' epilogues
share: the gated activation, the expert biases, the sum over k); ``hadamard`` (the block Hadamard rotation, its
PyTorch arithmetic and its Triton twin).

Interpreter or compiler: one choice per process. What a caller can rely on:

* It is made here, when ``mxlib.kernels`` is first imported, before this package imports
  triton: ``TRITON_INTERPRET`` as the caller set it, else the interpreter exactly when no CUDA
  device is present (the only way Triton kernels run on a CPU). Callers need not set the
  variable and may import mxlib in any order; changing it after that import has no effect.
* Only when the caller left ``TRITON_INTERPRET`` unset and there is no CUDA device does this
  set ``TRITON_INTERPRET=1`` in ``os.environ``, for the rest of the process (child processes
  inherit it; ``tests/test_kernels_compile.py`` removes it for the sm_90 compile check).
* Launch sites read the choice through ``_bridge.interpreting()`` (``_bridge.INTERPRET``, read
  once with Triton's own parsing of the variable), never from the environment again.

Why once per process, and why in the environment (checked against Triton 3.9's source):

* ``triton.jit`` makes a function a compiled ``JITFunction`` or an interpreted
  ``InterpretedFunction`` when it is *decorated*, reading ``triton.knobs.runtime.interpret``
  (that is, ``TRITON_INTERPRET``) then. A kernel and the ``@triton.jit`` functions it calls must
  be of one kind: the compiler inlines only ``JITFunction`` callees, and the interpreter runs a
  kernel as Python, where calling a ``JITFunction`` raises "Cannot call @triton.jit'd outside
  of the scope of a kernel".
* Triton's own language library (``tl.max``, ``tl.sum``, ... in ``triton.language.standard``)
  is decorated the same way when ``triton`` is first imported, so the choice has to be in the
  environment before that import. Setting it only while mxlib's kernel modules load was tried:
  with triton imported first, an interpreted mxlib kernel failed in ``tl.max`` (a compiled-kind
  library function); with triton imported inside that window too, every ``@triton.jit``
  function defined later in the process (a Triton module imported lazily, a caller's kernel
  built on ``_numerics``) would be of the other kind than Triton's library and mxlib's
  helpers. A per-launch dispatcher would need a second copy of Triton's library as well as of
  every mxlib kernel and helper.
* Triton's public way to set the choice, ``triton.knobs.runtime.interpret = True``, itself
  writes ``TRITON_INTERPRET`` into ``os.environ``; setting the variable directly, before
  triton is imported, is the same effect at the only time it works.
"""

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from .align import moe_align_block_size  # noqa: E402,F401
from .quant import (  # noqa: E402,F401
    dequantize_mx,
    dequantize_to_dtype,
    nvfp4_per_token_quant_dequant,
    nvfp4_per_token_scales,
    nvfp4_quant_dequant,
    quant_dequant_fp8_per_tensor,
    quant_dequant_mx,
    quantize_mx,
    quantize_nvfp4,
    ref_nvfp4_quant_dequant,
)
