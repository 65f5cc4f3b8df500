"""The producer layouts: one module per on-disk layout, each a ``mxlib.checkpoints.layout.CheckpointLayout`` that
owns its config writing, its config reading (into a typed ``CheckpointDescription``) and its tensor names.

=============================  ===================================================================================
module                         the layout
=============================  ===================================================================================
``modelopt_nvfp4``             NVIDIA ModelOpt NVFP4 (``quant_algo: NVFP4``, e.g. ``nvidia/Qwen3-30B-A3B-NVFP4``)
``modelopt_mxfp8``             NVIDIA ModelOpt MXFP8 (``quant_algo: MXFP8``)
``quark_ocp_mx``               AMD Quark OCP MX (MXFP4, MXFP6, MXFP8 weights and activations)
``compressed_tensors_nvfp4``   llm-compressor's ``nvfp4-pack-quantized`` (encode global scales used as stored)
``compressed_tensors_mxfp4``   llm-compressor's ``mxfp4-pack-quantized``
``compressed_tensors_mxfp8``   llm-compressor's ``mxfp8-quantized``
``gpt_oss_mxfp4``              gpt-oss's native MXFP4 experts (whole layers with biases)
``fp8_linear``                 FP8 linear layers of ModelOpt, Quark and compressed-tensors (mixed checkpoints'
                               FP8 attention; three layouts, linear layers only)
=============================  ===================================================================================

Importing this package registers them in ``LAYOUTS`` (``mxlib.checkpoints.layout``), in the order it lists them
(and error messages name them), and re-exports the registry: the writer, the loader, the inspector and the models
that read layouts import ``LAYOUTS`` from here, so that it holds mxlib's layouts whatever was imported first.
"""

from ..layout import DEFAULT_LAYOUT, LAYOUTS, layout_for_method, layout_for_scheme, register_layout
from . import (
    compressed_tensors_mxfp4,
    compressed_tensors_mxfp8,
    compressed_tensors_nvfp4,
    fp8_linear,
    gpt_oss_mxfp4,
    modelopt_mxfp8,
    modelopt_nvfp4,
    quark_ocp_mx,
)

__all__ = [
    "LAYOUTS",
    "DEFAULT_LAYOUT",
    "register_layout",
    "layout_for_scheme",
    "layout_for_method",
    "compressed_tensors_mxfp4",
    "compressed_tensors_mxfp8",
    "compressed_tensors_nvfp4",
    "fp8_linear",
    "gpt_oss_mxfp4",
    "modelopt_mxfp8",
    "modelopt_nvfp4",
    "quark_ocp_mx",
]

# mxlib's layouts, in the order LAYOUTS lists them (and error messages name them)
for _layout in (
    modelopt_nvfp4.LAYOUT,
    quark_ocp_mx.LAYOUT,
    compressed_tensors_nvfp4.LAYOUT,
    compressed_tensors_mxfp4.LAYOUT,
    modelopt_mxfp8.LAYOUT,
    compressed_tensors_mxfp8.LAYOUT,
    gpt_oss_mxfp4.LAYOUT,
    fp8_linear.MODELOPT,
    fp8_linear.QUARK,
    fp8_linear.COMPRESSED_TENSORS,
):
    register_layout(_layout)
del _layout
