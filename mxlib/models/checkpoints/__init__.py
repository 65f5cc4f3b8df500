"""Quantized Qwen3-MoE checkpoints in the real on-disk layouts, and the loader for them.

One module per layout, each owning its config writing, its config reading (into a typed
``CheckpointDescription``) and its tensor names: ``modelopt_nvfp4`` (NVIDIA ModelOpt NVFP4),
``quark_ocp_mx`` (AMD Quark OCP MX) and ``compressed_tensors_nvfp4`` (llm-compressor's
``nvfp4-pack-quantized``, encode global scales used as stored). ``safetensors_io`` holds what they share (shards, the
index, the atomic folder write, tensor reading); ``layout`` the registry both functions here
dispatch on. Adding a layout is adding one module that calls ``register_layout`` and importing
it below.

Everything the emulation does not quantize (embeddings, norms, the router ``mlp.gate``,
``lm_head``, and attention unless ``quantize_attention``) is bf16 under its usual transformers
name and listed in the ignore / exclude list. Quantized ``nn.Linear`` modules outside the experts
(the attention projections of ModelOpt's default NVFP4 export, of llm-compressor's NVFP4 scheme,
of Quark with attention not excluded) are emulated by ``mxlib.moe.linear.EmulatedLinear``.
Writes go to a temporary folder renamed into place at the end, so a failed write leaves no
half-written checkpoint.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import torch
from transformers import Qwen3MoeConfig

from ...moe.base import BACKENDS, TritonExperts
from ...moe.factory import make_emulated_linear, make_emulation_experts, quantize_expert_weights, quantize_linear_weight
from ...moe.schemes import MoEQuantScheme, get_moe_scheme
from ..calibration import Calibration
from ...moe.linear import LinearWeights
from ..qwen3 import empty_qwen3_moe, expert_weights, swap_experts
# registers the layouts, in this order
from . import modelopt_nvfp4, quark_ocp_mx, compressed_tensors_nvfp4  # noqa: F401,I001
from .layout import (
    LAYOUTS,
    PROJS,
    CheckpointDescription,
    CheckpointError,
    check_exclude_patterns,
    layout_for_method,
    layout_for_scheme,
    matches,
    register_layout,
)
from .safetensors_io import (
    SHARD_BYTES,
    ShardWriter,
    TensorReader,
    atomic_folder,
    checkpoint_size_bytes,
    read_json,
)

__all__ = [
    "CheckpointError",
    "CheckpointDescription",
    "write_quantized_checkpoint",
    "load_quantized_qwen3_moe",
    "read_quant_config",
    "checkpoint_size_bytes",
    "LAYOUTS",
    "register_layout",
]

_SHARD_BYTES = SHARD_BYTES


# ----------------------------------------------------------------------------- writing


def _config_dict(model, num_hidden_layers: int) -> dict:
    cfg = model.config.to_dict()
    cfg["num_hidden_layers"] = num_hidden_layers
    cfg["architectures"] = ["Qwen3MoeForCausalLM"]
    cfg["torch_dtype"] = "bfloat16"
    cfg.pop("quantization_config", None)
    return cfg


ATTENTION_PROJS = ("q_proj", "k_proj", "v_proj", "o_proj")


def write_quantized_checkpoint(
    model,
    scheme: str | MoEQuantScheme,
    path: str | os.PathLike,
    calibration: Calibration | None = None,
    shard_bytes: int = SHARD_BYTES,
    layout: str | None = None,
    quantize_attention: bool = False,
    linear_input_amax: dict[str, torch.Tensor] | None = None,
    overwrite: bool = False,
) -> Path:
    """Quantize a bf16 Qwen3-MoE model's experts (and optionally attention) and write the checkpoint.

    Experts are quantized one at a time and streamed into shards (``ShardWriter``), so the
    writer holds at most one shard of quantized tensors besides the model.

    Args:
        model: transformers ``Qwen3MoeForCausalLM`` holding bf16 experts.
        scheme: ``nvfp4`` (ModelOpt layout) or a Quark OCP MX scheme (Quark layout); the layout is
            the first registered one that stores the scheme.
        path: the checkpoint folder: absent, empty, or an earlier mxlib checkpoint (replaced
            atomically); anything else needs ``overwrite=True``.
        calibration: per-expert activation amax (``mxlib.models.calibration.calibrate``);
            needed by schemes with static activation scales (``nvfp4``, ``_a_fp8``).
        shard_bytes: safetensors shard size (also the most quantized bytes held in memory).
        layout: a registered layout name (``modelopt``, ``quark``, ``compressed-tensors``); None
            takes the first that stores the scheme (``nvfp4`` -> ``modelopt``).
        quantize_attention: also quantize ``self_attn.{q,k,v,o}_proj`` (as ModelOpt's default NVFP4
            config and llm-compressor's NVFP4 scheme do) instead of leaving them bf16 and ignored.
        linear_input_amax: ``{module name: amax}`` of those projections' inputs
            (``mxlib.moe.linear.linear_input_amax``), needed with ``quantize_attention`` by schemes
            with static activation scales.
        overwrite: replace whatever is at ``path`` (a file, a user's folder).

    Returns:
        The folder's path. On any error nothing is left at ``path`` (or the old checkpoint stays).

    Raises:
        ValueError: a static-activation-scale scheme without ``calibration`` (or without
            ``linear_input_amax`` for quantized attention); a layout that does not store the scheme.
        FileExistsError: ``path`` is not absent, empty or an mxlib checkpoint, without ``overwrite``.
        PermissionError: the old checkpoint at ``path`` cannot be removed (it stays as it was).
    """
    scheme = get_moe_scheme(scheme)
    if layout is None:
        layout = layout_for_scheme(scheme)
    else:
        if layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {list(LAYOUTS)}, got {layout!r}")
        layout = LAYOUTS[layout]
        if not layout.handles(scheme):
            raise ValueError(f"layout: {layout.name} does not store scheme {scheme.name}")
    if scheme.static_activation_scale and calibration is None:
        raise ValueError(f"{scheme.name} checkpoints need activation input scales: pass a Calibration")
    attn = [f"model.layers.{layer}.self_attn.{p}" for layer in range(len(model.model.layers))
            for p in ATTENTION_PROJS] if quantize_attention else []
    if attn and scheme.static_activation_scale:
        missing = [n for n in attn if linear_input_amax is None or n not in linear_input_amax]
        if missing:
            raise ValueError(f"quantize_attention with {scheme.name} needs linear_input_amax for every projection "
                             f"(mxlib.moe.linear.linear_input_amax); missing {missing[:2]}")
    # a layout's own expert quantization (``quantize_experts``, e.g. compressed-tensors' encode
    # scales) is called once per layer; the default quantizes expert by expert
    layout_quantize = getattr(layout, "quantize_experts", None)
    quantize_linear = getattr(layout, "quantize_linear", None) or quantize_linear_weight
    with atomic_folder(path, overwrite=overwrite) as tmp:
        num_layers = len(model.model.layers)
        shards = ShardWriter(tmp, shard_bytes)
        for name, t in model.state_dict().items():
            if ".mlp.experts." in name or name.rsplit(".", 1)[0] in attn:
                continue
            shards.add(name, t.detach().to(torch.bfloat16))
        modules = dict(model.named_modules())
        for name in attn:  # quantized attention projections, one at a time
            w = modules[name].weight.detach()
            ins = None
            if scheme.static_activation_scale:
                ins = linear_input_amax[name].float().reshape(()) / scheme.activation.scale_divisor
            for n, t in layout.linear_tensors(scheme, quantize_linear(w, scheme), ins, name).items():
                shards.add(n, t, copy=True)
        for layer in range(num_layers):
            w13, w2 = expert_weights(model, layer)
            layer_weights = None if layout_quantize is None else layout_quantize(w13, w2, scheme)
            in13 = in2 = None
            if scheme.static_activation_scale:
                in13, in2 = calibration.input_scales(layer, scheme.activation)
            prefix = f"model.layers.{layer}.mlp.experts"
            for x in range(w13.shape[0]):  # expert by expert: temporaries of one expert only
                if layer_weights is None:
                    weights = quantize_expert_weights(w13[x : x + 1], w2[x : x + 1], scheme)
                else:  # expert x of the layout's whole-layer quantization
                    weights = replace(layer_weights, **{k: v[x : x + 1] for k, v in layer_weights.tensors().items()})
                one = layout.expert_tensors(scheme, weights, None if in13 is None else in13[x : x + 1],
                                            None if in2 is None else in2[x : x + 1], prefix)
                for name, t in one.items():  # the layout names the single expert 0
                    shards.add(f"{prefix}.{x}." + name[len(prefix) + 3:], t, copy=True)
                del weights, one
            del layer_weights
        shards.close()
        cfg = _config_dict(model, num_layers)
        qc, extra = layout.config_files(scheme, quantize_attention)
        cfg["quantization_config"] = qc
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
        for fname, content in extra.items():
            (tmp / fname).write_text(json.dumps(content, indent=2))
    return Path(path)


# ----------------------------------------------------------------------------- reading


def read_quant_config(folder: str | os.PathLike) -> CheckpointDescription:
    """Parse and validate a checkpoint's quantization config.

    Reads ``config.json``'s ``quantization_config`` (or, without one, a layout's legacy file such
    as ModelOpt's ``hf_quant_config.json``) and hands it to the layout of its ``quant_method``.

    Returns:
        ``CheckpointDescription`` (``format``, ``scheme``, ``exclude``, ``activation_scale_mode``;
        also readable as ``info["scheme"]``).

    Raises:
        CheckpointError: a missing or unreadable config file (named), unknown method, or a config
            the emulation cannot honour; the message names the file, the field, the value found
            and what is supported.
    """
    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{folder}: config.json not found")
    qc = read_json(cfg_path, "a transformers model config").get("quantization_config")
    source = cfg_path
    if qc is None:
        for lay in LAYOUTS.values():
            try:
                qc = lay.read_legacy(folder)
            except CheckpointError:
                raise
            except (ValueError, OSError, AttributeError, TypeError) as err:
                raise CheckpointError(f"{folder}: legacy quantization config of layout {lay.name} cannot be read "
                                      f"({type(err).__name__}: {err})") from None
            if qc is not None:
                source = folder
                break
    if qc is None:
        raise CheckpointError(f"{folder}: no quantization_config in config.json and no legacy quantization config file")
    if not isinstance(qc, dict):
        raise CheckpointError(f"{cfg_path}: quantization_config: expected an object, found {type(qc).__name__} "
                              f"{str(qc)[:80]!r}")
    try:
        info = layout_for_method(qc.get("quant_method")).read_config(qc)
    except CheckpointError as err:
        raise CheckpointError(f"{source}: {err}") from None
    except (AttributeError, TypeError, KeyError, ValueError) as err:  # a field of the wrong JSON type
        raise CheckpointError(f"{source}: quantization_config is malformed ({type(err).__name__}: {err})") from None
    check_exclude_patterns(info.exclude, f"{source}: quantization_config exclude/ignore list")
    return info


# config.json fields the loader needs, all positive ints
# (transformers 5 writes num_experts as num_local_experts)
_CONFIG_INTS = ("hidden_size", "num_hidden_layers", ("num_experts", "num_local_experts"), "num_experts_per_tok",
                "moe_intermediate_size", "vocab_size", "num_attention_heads", "num_key_value_heads")


def _read_model_config(cfg_path: Path) -> dict:
    cfg = read_json(cfg_path, "a transformers model config")
    for keys in _CONFIG_INTS:
        keys = (keys,) if isinstance(keys, str) else keys
        key = next((k for k in keys if k in cfg), keys[0])
        v = cfg.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise CheckpointError(f"{cfg_path}: {key}: expected a positive integer, found {v!r}")
    return cfg


def _experts_excluded(exclude: list[str], layer: int) -> bool:
    names = [f"model.layers.{layer}.mlp.experts.0.{p}" for p in PROJS]
    return all(matches(n, exclude) for n in names)


@torch.no_grad()
def load_quantized_qwen3_moe(
    path: str | os.PathLike,
    num_hidden_layers: int | None = None,
    device: str | torch.device = "cpu",
    backend: str = "auto",
    scale_strategy: str = "max",
    activation_dtype: torch.dtype = torch.bfloat16,
):
    """Load a quantized Qwen3-MoE checkpoint (any registered layout) with emulation experts.

    Reads ``config.json`` (and legacy config files), validates the quantization config,
    builds transformers' ``Qwen3MoeForCausalLM`` (``num_hidden_layers`` overrides the
    checkpoint's, as vLLM's ``hf_overrides`` does), loads every bf16 tensor, and gives each
    layer the scheme's emulation experts (``mxlib.moe.factory.make_emulation_experts``) built
    from the per-expert tensors the layout reads.

    Returns:
        ``(model, info)`` where ``info`` is the ``CheckpointDescription``.

    Quantized ``nn.Linear`` modules outside the experts (attention projections carrying the
    layout's quantized tensors and not in the ignore list) become ``EmulatedLinear``
    (``mxlib.moe.factory.make_emulated_linear``): dequantized weight, QDQ'd input with the
    checkpoint's activation scale.

    Raises:
        CheckpointError: missing tensors, wrong shapes or dtypes, invalid scale values, unreadable
            files, unsupported configs, quantized modules that are not linear layers, fused
            unquantized experts (a Quark export made without ``preprocess_for_quantization``); the
            message names the file and the tensor or field.
        ValueError: an unknown ``backend`` or a ``num_hidden_layers`` that is not a positive
            integer (checked before anything is read).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {list(BACKENDS)}, got {backend!r}")
    if num_hidden_layers is not None and (not isinstance(num_hidden_layers, int) or isinstance(num_hidden_layers, bool)
                                          or num_hidden_layers < 1):
        raise ValueError(f"num_hidden_layers: expected a positive integer or None, got {num_hidden_layers!r}")
    folder = Path(path)
    info = read_quant_config(folder)
    layout = LAYOUTS[info.format]
    cfg_path = folder / "config.json"
    cfg_dict = _read_model_config(cfg_path)
    cfg_dict.pop("quantization_config", None)
    ckpt_layers = cfg_dict["num_hidden_layers"]
    if num_hidden_layers is not None:
        if num_hidden_layers > ckpt_layers:
            raise CheckpointError(f"num_hidden_layers={num_hidden_layers} exceeds the checkpoint's {ckpt_layers}")
        cfg_dict["num_hidden_layers"] = num_hidden_layers
    try:
        config = Qwen3MoeConfig(**{k: v for k, v in cfg_dict.items()
                                   if k not in ("architectures", "transformers_version")})
    except Exception as err:  # noqa: BLE001  transformers validates fields with various error types
        raise CheckpointError(f"{cfg_path}: not a valid Qwen3-MoE config ({type(err).__name__}: {err})") from None
    device = torch.device(device)
    # Parameters are allocated but never written (no pages touched) until loaded below;
    # the experts' fused bf16 parameters are replaced without ever being paged in.
    model = empty_qwen3_moe(config, torch.bfloat16, "cpu")
    tensors = TensorReader(folder)
    exclude = info.exclude

    modules = dict(model.named_modules())
    quantized_linears = []
    for name, p in model.named_parameters():
        if ".mlp.experts." in name:
            continue
        module = name.rsplit(".", 1)[0]
        if f"{module}.weight_scale" in tensors and not matches(module, exclude):
            if not isinstance(modules[module], torch.nn.Linear) or not hasattr(layout, "read_linear"):
                raise CheckpointError(
                    f"{module} is quantized in this checkpoint; mxlib emulates quantized experts and linear layers "
                    f"only, so it must be bf16 and listed in the ignore/exclude list"
                )
            if name.endswith(".weight"):
                quantized_linears.append(module)
                continue
        p.data = tensors.get(name, tuple(p.shape), torch.bfloat16).to(device)

    e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size

    def make(layer: int):
        prefix = f"model.layers.{layer}.mlp.experts"
        _refuse_fused_unquantized(tensors, prefix)
        if _experts_excluded(exclude, layer):
            return _bf16_experts(tensors, prefix, e, h, i, device, backend)
        weights, in13, in2 = layout.read_experts(tensors, prefix, e, h, i, info)
        to = (lambda t: None if t is None else t.to(device))  # noqa: E731
        return make_emulation_experts(info.scheme, weights.to(device), to(in13), to(in2), backend=backend,
                                      scale_strategy=scale_strategy,
                                      activation_scale_mode=info.activation_scale_mode or "even",
                                      activation_dtype=activation_dtype)

    swap_experts(model, make)
    for module in quantized_linears:
        lin = modules[module]
        weights, ins = layout.read_linear(tensors, module, lin.out_features, lin.in_features, info)
        bias = None
        if lin.bias is not None:
            bias = tensors.get(f"{module}.bias", tuple(lin.bias.shape), torch.bfloat16).to(activation_dtype).to(device)
        em = make_emulated_linear(
            info.scheme, LinearWeights(weights.scheme, weights.weight.to(device), weights.weight_scale.to(device),
                                       None if weights.weight_scale_2 is None else weights.weight_scale_2.to(device),
                                       weights.global_scale_kind),
            None if ins is None else ins.to(device), bias=bias, backend=backend,
            activation_scale_mode=info.activation_scale_mode or "even", activation_dtype=activation_dtype)
        parent, _, child = module.rpartition(".")
        setattr(modules[parent], child, em)
    tensors.close()
    return model.to(device).eval(), info


def _refuse_fused_unquantized(tensors: TensorReader, prefix: str) -> None:
    """A checkpoint with transformers' fused bf16 expert parameters under a quantization config."""
    for fused in ("gate_up_proj", "down_proj"):
        for name in (f"{prefix}.{fused}", f"{prefix}.{fused}.weight"):
            if name in tensors:
                raise CheckpointError(
                    f"tensor {name!r}: the experts of this checkpoint are fused and unquantized (transformers' "
                    f"{fused} parameter in bf16, no per-expert quantized tensors) although its config says they are "
                    f"quantized. amd-quark writes this when run without "
                    f"quark.torch.utils.llm.preprocess_for_quantization(model) before quantizing (it quantizes "
                    f"nothing and still reports success); re-export with that preprocessing step"
                )


def _bf16_experts(tensors: TensorReader, prefix, e, h, i, device, backend):
    def stack(proj, shape):
        return tensors.stack([f"{prefix}.{x}.{proj}.weight" for x in range(e)], shape, torch.bfloat16)

    gate, up, down = stack("gate_proj", (i, h)), stack("up_proj", (i, h)), stack("down_proj", (h, i))
    return TritonExperts(torch.cat([gate, up], 1).to(device), down.to(device), backend=backend)


# the inspector and the dummy-from-config builder use the functions above
from .dummy import dummy_checkpoint_from_config  # noqa: E402
from .inspect import InspectReport, inspect_checkpoint  # noqa: E402

__all__ += ["inspect_checkpoint", "InspectReport", "dummy_checkpoint_from_config"]
