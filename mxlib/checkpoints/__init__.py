"""Quantized MoE checkpoints of every registered family in the on-disk layouts: writer, loader, inspector.

One module per layout, each a ``layout.CheckpointLayout`` owning its config writing, its config
reading (into a typed ``CheckpointDescription``) and its tensor names: ``modelopt_nvfp4`` (NVIDIA
ModelOpt NVFP4), ``quark_ocp_mx`` (AMD Quark OCP MX) and ``compressed_tensors_nvfp4``
(llm-compressor's ``nvfp4-pack-quantized``, encode global scales used as stored) and
``compressed_tensors_mxfp4`` (its ``mxfp4-pack-quantized``) and ``modelopt_mxfp8`` (ModelOpt's MXFP8) and
``gpt_oss_mxfp4`` (gpt-oss's native MXFP4 experts, whole layers with biases). They are
registered below, in the order ``LAYOUTS`` lists them; ``DEFAULT_LAYOUT`` names the one a scheme
is written in when the caller names none.

* ``writer``: ``write_quantized_checkpoint`` (a bf16 model's experts, and optionally attention,
  quantized and streamed into shards; an atomic folder write);
* ``loader``: ``read_quant_config`` and ``load_quantized_moe`` (any registered family; under Qwen3-MoE's
  name ``load_quantized_qwen3_moe``) (emulation experts, and
  ``mxlib.moe.linear.EmulatedLinear`` for quantized linear layers outside the experts);
* ``saving``: ``attach_checkpoint_layout`` and ``save_quantized_checkpoint``: a model's
  ``state_dict``, ``load_state_dict`` and ``save_pretrained`` in its checkpoint layout;
* ``pretrained``: ``from_pretrained``, the loader under transformers' keyword names (``dtype``, ``device_map``),
  returning the model with its description as ``model.mxlib_info``;
* ``inspect``: ``inspect_checkpoint`` from the configs, the safetensors headers and the scale
  scalars only (``inspect_tables``, ``inspect_loss``: its tables and its predicted losses);
* ``dummy``: ``dummy_checkpoint_from_config``, dummy weights in the layout of a real config;
* ``streaming``: ``quantize_checkpoint``, a bf16 checkpoint folder quantized one decoder layer at a time
  (``mxlib quantize``);
* ``safetensors_io``: shards written and read (``TensorReader``, ``HeaderTensorReader``); ``headers``: the
  checked index and safetensors headers, regular files only (``mxlib.models.untrusted``); ``bounds``: a
  config's sizes against the headers before anything is allocated; the atomic folder write is
  ``mxlib.models.atomic_write``;
  ``layout``: the base class, the registry and exclude-list matching; ``scalars``: scalar scales.
"""

from . import (
    compressed_tensors_mxfp4,
    compressed_tensors_mxfp8,
    compressed_tensors_nvfp4,
    gpt_oss_mxfp4,
    modelopt_mxfp8,
    modelopt_nvfp4,
    quark_ocp_mx,
)
from .dummy import dummy_checkpoint_from_config
from .inspect import InspectReport, inspect_checkpoint
from .layout import (
    DEFAULT_LAYOUT,
    LAYOUTS,
    PROJS,
    CheckpointDescription,
    CheckpointError,
    CheckpointLayout,
    check_exclude_patterns,
    layout_for_method,
    layout_for_scheme,
    matches,
    register_layout,
)
from .loader import load_quantized_moe, load_quantized_qwen3_moe, read_quant_config
from .pretrained import from_pretrained
from .safetensors_io import SHARD_BYTES, ShardWriter, TensorReader, atomic_folder, checkpoint_size_bytes, read_json
from .saving import CheckpointSource, attach_checkpoint_layout, save_quantized_checkpoint
from .writer import ATTENTION_PROJS, write_quantized_checkpoint

__all__ = [
    "CheckpointError",
    "CheckpointDescription",
    "CheckpointLayout",
    "write_quantized_checkpoint",
    "load_quantized_moe",
    "load_quantized_qwen3_moe",
    "from_pretrained",
    "read_quant_config",
    "attach_checkpoint_layout",
    "save_quantized_checkpoint",
    "CheckpointSource",
    "inspect_checkpoint",
    "InspectReport",
    "dummy_checkpoint_from_config",
    "checkpoint_size_bytes",
    "LAYOUTS",
    "DEFAULT_LAYOUT",
    "register_layout",
    "layout_for_scheme",
    "layout_for_method",
    "ATTENTION_PROJS",
    "PROJS",
    "SHARD_BYTES",
    "ShardWriter",
    "TensorReader",
    "atomic_folder",
    "read_json",
    "matches",
    "check_exclude_patterns",
    "compressed_tensors_mxfp4",
    "compressed_tensors_mxfp8",
    "compressed_tensors_nvfp4",
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
):
    register_layout(_layout)
del _layout
