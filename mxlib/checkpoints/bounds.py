"""A checkpoint's ``config.json`` sizes checked against its safetensors headers, before anything is
allocated or built: the loader and the inspector both call ``check_model_config``.

A config is untrusted input like the files: it can name a million layers in a two-layer checkpoint, or a
hidden size whose parameters would take terabytes. So, in this order, each step bounded by what is on
disk:

1. the model fields (``MODEL_INT_FIELDS``) positive integers, ``num_experts_per_tok <= num_experts``,
   ``num_attention_heads`` a multiple of ``num_key_value_heads``;
2. ``num_hidden_layers`` at most the layers the tensor names hold (``model.layers.L.``), and each of those
   layers present;
3. the sizes against the tensors that state them: ``model.embed_tokens.weight`` ``[vocab_size,
   hidden_size]`` and layer 0's router ``mlp.gate.weight`` ``[num_experts, hidden_size]``;
4. the model built on PyTorch's ``meta`` device (no memory) and every non-expert parameter's shape compared
   with its header (quantized linear layers are the layout's to check);
5. the experts: the rows of expert 0's ``gate_proj`` / ``down_proj`` weights (packed or not) against
   ``moe_intermediate_size`` / ``hidden_size``, then the layout's own ``read_experts`` on headers
   (``HeaderTensorReader``: dtype, shape and scalar-scale value checks, no weights read) for the first
   quantized layer, and with ``every_layer`` for every other one too (the loader's own checks, each layer's
   allocation bounded by the sizes checked before).

Every failure is a ``CheckpointError`` naming ``config.json`` and the field, or the tensor and its shard.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ..models.families import QWEN3_MOE, MoEFamily
from ..moe.scales import ACTIVATION_SCALE_STRATEGIES
from .files import untrusted
from .files.safetensors_io import HeaderTensorReader, SafetensorsHeaders
from .files.untrusted import MODEL_INT_FIELDS
from .layout import CheckpointDescription, CheckpointError
from .layouts import LAYOUTS  # the registry with mxlib's layouts registered
from .precision import experts_description, module_classes, module_description

__all__ = [
    "MODEL_INT_FIELDS",
    "check_model_fields",
    "layers_on_disk",
    "check_model_config",
    "model_config",
    "check_scale_strategy",
]

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_NOT_CONFIG_KEYS = ("architectures", "transformers_version", "quantization_config")


def check_model_fields(cfg: dict, source) -> dict[str, int]:
    """Rule 1 of the module docstring (``files.untrusted.check_model_fields``) as ``CheckpointError``."""
    return untrusted.check_model_fields(cfg, source, CheckpointError)


def model_config(cfg: dict, source, family: MoEFamily = QWEN3_MOE):
    """The family's transformers config (``Qwen3MoeConfig``, ``MixtralConfig``, ...) from a checked config
    dict; its own validation errors as ``CheckpointError``."""
    try:
        return family.load_config_class()(**{k: v for k, v in cfg.items() if k not in _NOT_CONFIG_KEYS})
    except Exception as err:  # noqa: BLE001  transformers validates fields with various error types
        raise CheckpointError(
            f"{source}: not a valid {family.config_class} ({family.architecture}) config ({type(err).__name__}: {err})"
        ) from None


def layers_on_disk(headers: SafetensorsHeaders) -> set[int]:
    """The layer numbers ``L`` of every ``model.layers.L.`` tensor name."""
    return {int(m[1]) for n in headers.where if (m := _LAYER.match(n))}


def _shape_of(headers: SafetensorsHeaders, name: str, source, fields: str, want: tuple[int, ...]) -> None:
    if name not in headers.where:
        raise CheckpointError(f"checkpoint {headers.folder} is missing tensor {name!r}")
    headers.mark_used(name)
    got = headers.shape[name]
    if got != want:
        raise CheckpointError(
            f"{source}: {fields} = {list(want)}, but tensor {name!r} has shape {list(got)} (in {headers.where[name]})"
        )


def check_model_config(
    cfg: dict,
    cfg_path: Path,
    headers: SafetensorsHeaders,
    info: CheckpointDescription | None,
    every_layer: bool = True,
    family: MoEFamily = QWEN3_MOE,
):
    """The module docstring's rules on ``cfg`` (``config.json``'s dict, ``num_hidden_layers`` possibly cut)
    against ``headers`` (under state-dict names: ``SafetensorsHeaders.as_module_names`` of the family's
    ``module_name``); the checked config of ``family`` (``Qwen3MoeConfig``, ...). With ``info`` None (a
    config the layouts refuse) step 5 is skipped; ``every_layer=False`` checks the first quantized layer
    only (the loader, whose own per-layer reads check the others with their own messages, each before it
    allocates).

    Raises:
        CheckpointError: the first rule broken, naming the file and field or the tensor.
    """
    f = check_model_fields(cfg, cfg_path)
    layers = f["num_hidden_layers"]
    on_disk = layers_on_disk(headers)
    if layers > len(on_disk) or not all(layer in on_disk for layer in range(layers)):
        held = f"{len(on_disk)} layers" + (f" ({min(on_disk)} to {max(on_disk)})" if on_disk else "")
        raise CheckpointError(
            f"{cfg_path}: num_hidden_layers: {layers}, but the checkpoint's tensors hold {held}; "
            f"missing e.g. model.layers.{next(x for x in range(layers) if x not in on_disk)}"
        )
    h, e = f["hidden_size"], f["num_experts"]
    _shape_of(headers, "model.embed_tokens.weight", cfg_path, "[vocab_size, hidden_size]", (f["vocab_size"], h))
    routers = [f"model.layers.{x}.{family.block_attr}.{family.router_attr}.weight" for x in range(layers)]
    router = next((n for n in routers if n in headers.where), None)
    if router is not None:
        _shape_of(headers, router, cfg_path, "[num_experts, hidden_size]", (e, h))
    config = model_config(cfg, cfg_path, family)
    with torch.device("meta"):
        meta = family.load_class()(config)
    experts_part = f".{family.block_attr}.{family.experts_attr}."
    modules = dict(meta.named_modules())
    quantized_linears = []
    for name, p in meta.named_parameters():
        module = name.rsplit(".", 1)[0]
        if experts_part in name:
            continue
        if f"{module}.weight_scale" in headers.where:
            if name.endswith(".weight") and isinstance(modules[module], torch.nn.Linear):
                quantized_linears.append(module)
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        _shape_of(headers, name, cfg_path, f"{name}'s shape", tuple(p.shape))
    for name, b in meta.named_buffers():  # persistent buffers a checkpoint stores (DeepSeek-V3's router bias)
        if name in headers.where and experts_part not in name:
            _shape_of(headers, name, cfg_path, f"{name}'s shape", tuple(b.shape))
    if every_layer and info is not None:  # the loader's reads of quantized linear layers, on headers
        _check_linears(headers, info, family, quantized_linears, modules)
    del meta, modules
    if info is not None:
        moe = family.moe_layer_indices(config)
        _check_experts(headers, info, cfg_path, moe, e, h, f["moe_intermediate_size"], every_layer, family)
    return config


def _check_linears(headers, info, family: MoEFamily, names: list[str], modules: dict) -> None:
    """The layout's ``read_linear`` (and the bias) of every quantized linear layer the loader would read, on
    headers: the same checks, and every tensor it reads marked used."""
    reader = HeaderTensorReader(headers)
    for module in names:
        desc = module_description(info, family.disk_name(module), module_classes(modules[module]))
        if desc is None or not LAYOUTS[desc.format].supports_linear:
            continue  # the loader refuses these with its own message
        lin = modules[module]
        LAYOUTS[desc.format].read_linear(reader, module, lin.out_features, lin.in_features, desc)
        if lin.bias is not None:
            reader.get(f"{module}.bias", tuple(lin.bias.shape), torch.bfloat16)


def _check_experts(
    headers, info, cfg_path, moe: list[int], e: int, h: int, i: int, every_layer: bool, family: MoEFamily
) -> None:
    described = {layer: experts_description(info, family.disk_name, family.experts_prefix(layer), e) for layer in moe}
    quantized = [layer for layer in moe if described[layer] is not None]
    reader = HeaderTensorReader(headers)
    for layer in sorted(set(moe) - set(quantized)):
        prefix = family.experts_prefix(layer)
        for proj, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            reader.stack([f"{prefix}.{x}.{proj}.weight" for x in range(e)], shape, torch.bfloat16)
    if not quantized:
        return
    prefix = family.experts_prefix(quantized[0])
    if not every_layer and any(f"{prefix}.{p}" in reader for p in ("gate_up_proj", "down_proj")):
        return  # the loader refuses these with its own message
    layout = LAYOUTS[described[quantized[0]].format]
    # the rows of expert 0's weights (packed or not) are the sizes a layout allocates with: bounded first
    # (a layout of whole-layer tensors, gpt-oss's, checks every header before it allocates)
    sized = () if getattr(layout, "stacked_experts", False) else (("gate_proj", i), ("down_proj", h))
    for proj, rows in sized:
        field = "moe_intermediate_size" if proj == "gate_proj" else "hidden_size"
        name = next((n for n in (f"{prefix}.0.{proj}.{w}" for w in ("weight", "weight_packed")) if n in reader), None)
        if name is None:
            raise CheckpointError(f"checkpoint {headers.folder} is missing tensor '{prefix}.0.{proj}.weight'")
        if headers.shape[name][:1] != (rows,):
            raise CheckpointError(
                f"{cfg_path}: {field} = {rows}, but tensor {name!r} has shape {list(headers.shape[name])} "
                f"(in {headers.where[name]})"
            )
    for layer in quantized if every_layer else quantized[:1]:
        try:
            lay = LAYOUTS[described[layer].format]
            lay.read_experts(reader, family.experts_prefix(layer), e, h, i, described[layer])
            if every_layer and family.expert_biases and getattr(lay, "stores_expert_biases", False):
                lay.read_expert_biases(reader, family.experts_prefix(layer), e, h, i)
        except RuntimeError as err:  # the allocator, for sizes the headers contradict
            raise CheckpointError(f"{cfg_path}: the experts of layer {layer} cannot be allocated ({err})") from None


def check_scale_strategy(scale_strategy: str, scheme=None) -> None:
    """``scale_strategy`` must be a name of ``ACTIVATION_SCALE_STRATEGIES``, and one the scheme's experts apply.

    Only NVFP4 experts unify per-expert activation scales by a strategy (``mxlib.moe.scales``). The OCP MX
    experts with static FP8 activations (Quark's ``_a_fp8``) take one scale per layer, the largest of the
    per-expert ``input_scale`` values, as vLLM's Quark FP8 MoE path does (``w13_input_scale.max()``); their
    kernels have no per-expert activation scale to unify otherwise, and the schemes with dynamic or no
    activation quantization have no static scale at all. So for those schemes a strategy other than ``max``
    is refused instead of being ignored.

    Raises:
        ValueError: an unknown name, or one other than ``max`` for a scheme whose experts cannot apply it.
    """
    if scale_strategy not in ACTIVATION_SCALE_STRATEGIES:
        raise ValueError(f"scale_strategy: expected one of {list(ACTIVATION_SCALE_STRATEGIES)}, got {scale_strategy!r}")
    if scheme is not None and not scheme.weight.has_global_scale and scale_strategy != "max":
        what = (
            "takes one static FP8 input scale per layer, the max over the experts (vLLM's Quark FP8 MoE)"
            if scheme.static_activation_scale
            else "has no static activation scale to unify"
        )
        raise ValueError(
            f"scale_strategy: {scale_strategy!r} cannot be applied to {scheme.name} checkpoints: the scheme {what}; "
            f"expected 'max'"
        )
