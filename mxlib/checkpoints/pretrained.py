"""``from_pretrained``: a quantized MoE checkpoint loaded under transformers' keyword names.

``from_pretrained(path, dtype=..., device_map=...)`` is ``loader.load_quantized_moe`` with the arguments a
transformers user writes (``dtype``, its older name ``torch_dtype``, ``device_map``), returning the model alone; the
checkpoint's description (``CheckpointDescription``: layout, scheme, exclude list) is ``model.mxlib_info``. Every
registered layout and family loads through it (ModelOpt, Quark, compressed-tensors, gpt-oss; Qwen3-MoE, Mixtral,
OLMoE, Qwen2-MoE, DeepSeek-V3, gpt-oss). The non-quantized modules take ``dtype``; the experts and the emulated
linear layers run their activations in it and keep their codes and scales as stored
(``mxlib.moe.base.keep_dtype_on_cast``).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .._checks import check_device
from ..moe.base import ACTIVATION_DTYPES
from .loader import load_quantized_moe

__all__ = ["from_pretrained", "resolve_dtype", "resolve_device_map"]

# transformers' from_pretrained keywords that mean nothing for a local, safetensors-only, one-device load and are
# accepted as long as they keep their default (a value that asks for something is refused, naming why)
_INERT = {
    "low_cpu_mem_usage": (None, True, False),  # mxlib never materializes a second copy: either is honoured
    "use_safetensors": (None, True),
    "local_files_only": (False, True),
    "trust_remote_code": (False, None),
    "revision": (None, "main"),
}


def resolve_dtype(dtype) -> torch.dtype:
    """transformers' ``dtype`` argument as a torch dtype: ``"auto"`` or None -> bf16 (what every layout stores its
    unquantized tensors in), a ``torch.dtype`` or its name (``"float16"``, ``"torch.float32"``, ``"bf16"``).

    Raises:
        TypeError: a dtype other than bfloat16, float16 or float32 (or a name of none), naming it.
    """
    if dtype is None or dtype == "auto":
        return torch.bfloat16
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        name = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}.get(
            name, name
        )
        dtype = getattr(torch, name, None)
    if dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"dtype: expected 'auto', torch.bfloat16, torch.float16 or torch.float32, got {dtype!r}")
    return dtype


def resolve_device_map(device_map) -> torch.device:
    """transformers' ``device_map`` for a model placed whole on one device: None or ``"cpu"``, ``"cuda"``,
    ``"cuda:N"``, a CUDA index, a ``torch.device``, ``{"": device}``, or ``"auto"`` (the first CUDA device when torch
    has one, else the CPU).

    Raises:
        ValueError: a map that splits the model across devices (``"balanced"``, a dict of several modules), or a
            device this torch cannot use (``mxlib._checks.check_device``: CUDA on a CPU-only torch).
    """
    if device_map is None:
        return torch.device("cpu")
    if isinstance(device_map, dict):
        if set(device_map) != {""}:
            raise ValueError(
                f"device_map: mxlib places the whole model on one device; expected {{'': device}}, got a map of "
                f"{len(device_map)} modules"
            )
        device_map = device_map[""]
    if device_map == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if isinstance(device_map, str) and device_map in ("balanced", "balanced_low_0", "sequential"):
        raise ValueError(f"device_map: {device_map!r} splits the model across devices; mxlib places it on one")
    return check_device(device_map, "device_map")


def from_pretrained(
    pretrained_model_name_or_path: str | os.PathLike,
    *,
    dtype: torch.dtype | str | None = "auto",
    device_map=None,
    num_hidden_layers: int | None = None,
    backend: str = "auto",
    scale_strategy: str = "max",
    gate_up_scale: str = "per_half",
    progress: bool = False,
    **kwargs,
):
    """Load a quantized MoE checkpoint folder (any registered layout and family) as transformers' model class with
    mxlib's emulation experts, under transformers' keyword names.

    Args:
        pretrained_model_name_or_path: a local checkpoint folder (``config.json`` and safetensors shards). A Hub id
            is not fetched: download it first (``huggingface_hub.snapshot_download(repo_id)`` returns the folder).
        dtype: the model's dtype: ``"auto"`` (default) or None gives bf16, what the layouts store; bf16, fp16 or
            fp32 (a ``torch.dtype`` or its name). The experts run their activations in it (bf16: vLLM's numerics,
            bit for bit; ``docs/numerics.md`` for the others); quantized codes and scales stay as stored.
            ``torch_dtype`` (transformers' older name) is taken too.
        device_map: the one device the whole model goes to (``resolve_device_map``): None (the CPU), ``"cpu"``,
            ``"cuda"``, ``"cuda:N"``, an index, ``{"": device}`` or ``"auto"``.
        num_hidden_layers: load the first layers only (vLLM's ``hf_overrides``); None: every layer.
        backend, scale_strategy, gate_up_scale, progress: as ``load_quantized_moe``'s.
        **kwargs: transformers' ``low_cpu_mem_usage``, ``use_safetensors``, ``local_files_only``,
            ``trust_remote_code``, ``revision`` at values that ask for nothing more (see ``_INERT``).

    Returns:
        The model, in eval mode. ``model.mxlib_info`` is the checkpoint's ``CheckpointDescription`` (``format``: the
        layout's name, ``scheme``, ``exclude``, ``activation_scale_mode``); ``model.save_pretrained(folder)`` writes
        the checkpoint again in its layout.

    Raises:
        FileNotFoundError: the path is not a local folder.
        TypeError: an unknown keyword argument (named), or a dtype other than bf16, fp16 and fp32.
        ValueError: a keyword argument at a value mxlib cannot honour (named, with why); a device map that splits
            the model, or a device this torch cannot use.
        CheckpointError: as ``load_quantized_moe`` (the file and the tensor or field named).
    """
    if "torch_dtype" in kwargs:
        torch_dtype = kwargs.pop("torch_dtype")
        both = dtype not in ("auto", None) and torch_dtype is not None
        if both and resolve_dtype(torch_dtype) != resolve_dtype(dtype):
            raise ValueError(f"dtype={dtype!r} and torch_dtype={torch_dtype!r} disagree; give dtype only")
        dtype = torch_dtype if dtype in ("auto", None) else dtype
    for name, value in kwargs.items():
        if name not in _INERT:
            raise TypeError(
                f"from_pretrained: unexpected keyword argument {name!r} (accepted besides mxlib's own: dtype, "
                f"torch_dtype, device_map, {', '.join(_INERT)})"
            )
        if value not in _INERT[name]:
            raise ValueError(
                f"from_pretrained: {name}={value!r} cannot be honoured: mxlib loads a local folder of safetensors "
                f"shards with its own code (accepted values: {list(_INERT[name])})"
            )
    dtype = resolve_dtype(dtype)
    device = resolve_device_map(device_map)
    folder = Path(pretrained_model_name_or_path)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"pretrained_model_name_or_path: {str(pretrained_model_name_or_path)!r} is not a local folder; mxlib "
            f"loads local checkpoints (download a Hub checkpoint with huggingface_hub.snapshot_download first)"
        )
    model, _ = load_quantized_moe(
        folder,
        num_hidden_layers=num_hidden_layers,
        device=device,
        backend=backend,
        scale_strategy=scale_strategy,
        activation_dtype=dtype,
        progress=progress,
        gate_up_scale=gate_up_scale,
        where="from_pretrained",
    )
    if dtype != torch.bfloat16:
        model.to(dtype)  # the unquantized modules; the quantized ones keep their codes and scales
    return model
