"""Quantized MoE checkpoints of every registered family in the on-disk layouts: writer, loader, inspector.

The face of the package, one subject a module:

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
  scalars only; ``inspect_tables``: its module and scale tables; ``inspect_loss``: its predicted losses;
* ``dummy``: ``dummy_checkpoint_from_config``, dummy weights in the layout of a real config;
* ``streaming``: ``quantize_checkpoint``, a bf16 checkpoint folder quantized one decoder layer at a time
  (``mxlib quantize``);
* ``bounds``: a config's sizes against the headers before anything is allocated;
* ``layout``: the ``CheckpointLayout`` base class, the registry (``LAYOUTS``, ``DEFAULT_LAYOUT``: the layout a
  scheme is written in when the caller names none) and exclude-list matching;
* ``scalars``: scalar scales widened exactly;
* ``mixed``: ``write_mixed_checkpoint``, a bf16 model's experts, attention and ``lm_head`` each in its own scheme,
  in a producer's mixed-precision form;
* ``precision``: mixed-precision checkpoints (``PrecisionMap``: which scheme each module is stored in, from
  ModelOpt's ``MIXED_PRECISION``, Quark's per-layer and per-type configs, compressed-tensors' config groups).

``layouts/`` holds one module per producer layout (``mxlib.checkpoints.layouts``: ``modelopt_nvfp4``,
``modelopt_mxfp8``, ``quark_ocp_mx``, ``compressed_tensors_nvfp4``, ``compressed_tensors_mxfp4``,
``compressed_tensors_mxfp8``, ``gpt_oss_mxfp4``), registered in ``LAYOUTS`` when that package is imported.
``files/`` holds the file handling (``mxlib.checkpoints.files``: ``untrusted``, ``headers``, ``folder``,
``safetensors_io``, ``atomic_write``).

The public names below load on first use (PEP 562), so that importing ``mxlib.checkpoints.files.untrusted`` (the
command line's checks before torch is imported) imports no torch.
"""

import importlib as _importlib

# public name -> the module of this package that defines it (imported on first attribute access)
_LAZY: dict[str, str] = {
    "CheckpointError": "layout",
    "CheckpointDescription": "layout",
    "CheckpointLayout": "layout",
    "write_quantized_checkpoint": "writer",
    "write_mixed_checkpoint": "mixed",
    "PrecisionMap": "precision",
    "load_quantized_moe": "loader",
    "load_quantized_qwen3_moe": "loader",
    "from_pretrained": "pretrained",
    "read_quant_config": "loader",
    "attach_checkpoint_layout": "saving",
    "save_quantized_checkpoint": "saving",
    "CheckpointSource": "saving",
    "inspect_checkpoint": "inspect",
    "InspectReport": "inspect",
    "dummy_checkpoint_from_config": "dummy",
    "checkpoint_size_bytes": "files.safetensors_io",
    "LAYOUTS": "layouts",
    "DEFAULT_LAYOUT": "layouts",
    "register_layout": "layouts",
    "layout_for_scheme": "layouts",
    "layout_for_method": "layouts",
    "ATTENTION_PROJS": "writer",
    "PROJS": "layout",
    "SHARD_BYTES": "files.safetensors_io",
    "ShardWriter": "files.safetensors_io",
    "TensorReader": "files.safetensors_io",
    "atomic_folder": "files.safetensors_io",
    "read_json": "files.safetensors_io",
    "matches": "layout",
    "check_exclude_patterns": "layout",
    "compressed_tensors_mxfp4": "layouts",
    "compressed_tensors_mxfp8": "layouts",
    "compressed_tensors_nvfp4": "layouts",
    "gpt_oss_mxfp4": "layouts",
    "modelopt_mxfp8": "layouts",
    "modelopt_nvfp4": "layouts",
    "quark_ocp_mx": "layouts",
}

__all__ = [
    "CheckpointError",
    "CheckpointDescription",
    "CheckpointLayout",
    "write_quantized_checkpoint",
    "write_mixed_checkpoint",
    "PrecisionMap",
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


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(__all__) | {n for n in globals() if n.startswith("__")})
