"""Saving an MoE model (any registered family) that holds mxlib's quantized experts: ``state_dict``,
``load_state_dict`` and ``save_pretrained`` in a checkpoint layout (ModelOpt NVFP4, Quark OCP MX,
compressed-tensors NVFP4).

mxlib's experts keep their packed weights and scales in non-persistent buffers, and transformers'
``save_pretrained`` writes ``state_dict()`` and ``config.json`` only: on its own it would write a
model without experts and without ``quantization_config``. ``attach_checkpoint_layout`` (called by
``load_quantized_qwen3_moe`` on every model it returns) makes the model carry its checkpoint:

* every ``TransformersExperts`` (and every ``EmulatedLinear``) gets a state-dict hook that adds its
  tensors under the checkpoint's own names, made by the layout's ``expert_tensors`` /
  ``linear_tensors`` (``model.layers.L.mlp.experts.E.gate_proj.weight``, ``...weight_scale``,
  ``...weight_scale_2`` / ``weight_global_scale``, ``...input_scale`` / ``input_global_scale``;
  bf16 ``...E.gate_proj.weight`` for a layer the config excludes), so ``model.state_dict()`` holds
  the whole checkpoint: the bf16 tensors outside the experts under transformers' names, the experts
  as stored. The experts' entries are CPU tensors (views of the experts' buffers, or copies where
  the held layout differs from the checkpoint's, e.g. the FP4 kernel's);
* a load-state-dict pre-hook reads those names back through the layout's ``read_experts`` /
  ``read_linear`` (the loader's checks and messages) and rebuilds the experts with the settings
  they had (backend, scale strategy, activation dtype and scale rule, numerics); a layer whose
  tensors are missing is reported as missing keys (``strict=True`` raises naming them), a tensor
  of a wrong shape, dtype or value raises ``CheckpointError`` naming it;
* ``model.save_pretrained(path)`` is ``save_quantized_checkpoint``: ``state_dict()`` written as
  safetensors shards with the index, ``config.json`` with the ``quantization_config`` (for a
  loaded model the source's ``config.json`` as read, ``num_hidden_layers`` the model's) and the
  layout's other config files (ModelOpt's ``hf_quant_config.json``, and
  ``generation_config.json``, copied from the source), all through
  ``safetensors_io.atomic_folder``: written under a temporary name and renamed into place, so a
  failed write leaves no destination folder (or the old checkpoint as it was).

What comes back. Loading the saved folder with ``load_quantized_qwen3_moe`` gives the same experts
bit for bit, so the same logits. The stored tensors are the source's, byte for byte, with the
dtypes and shapes the source stored (a bf16 ``input_scale`` of an amd-quark export stays bf16;
every value is checked to convert exactly, or the save raises), except that gate and up are given
the one input scale the emulation uses for both (the larger amax, as ModelOpt and mxlib's writer
store anyway) and compressed-tensors' non-positive or non-finite ``input_global_scale`` (an
expert never calibrated) is stored as 0. A loaded model whose source holds tensors mxlib does not
load (a kv-cache scale, say) refuses to save, naming them: the saved folder would lack them.

A model whose experts were swapped in by hand (``mxlib.models.qwen3.swap_experts``) refuses
transformers' ``save_pretrained`` (naming why) until ``attach_checkpoint_layout(model)`` gives it a
layout: the one ``layout.DEFAULT_LAYOUT`` names for the experts' scheme, the layout storing
encode global scales for compressed-tensors-quantized weights, or the one named; its config files
are the layout's ``config_files`` (attention quantized when every attention projection is an
``EmulatedLinear``).

Shapes: ``E`` experts, ``H`` hidden, ``I`` expert intermediate (``mxlib.models.qwen3``).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..formats import BlockScheme
from ..models.families import QWEN3_MOE, MoEFamily, check_supported_model, family_of
from ..models.moe_models import BoundToModel, tied_parameter_names
from ..moe.base import TransformersExperts, TritonExperts
from ..moe.emulation import ExpertWeights, QuantizedExperts
from ..moe.factory import make_emulated_linear, make_emulation_experts
from ..moe.linear import EmulatedLinear, LinearWeights
from ..moe.schemes import MoEQuantScheme
from .files.folder import CheckpointFolder
from .files.safetensors_io import (
    SAFETENSORS_DTYPES,
    SHARD_BYTES,
    SafetensorsHeaders,
    ShardWriter,
    TensorReader,
    atomic_folder,
)
from .layout import PROJS, CheckpointDescription, CheckpointError, CheckpointLayout, matches
from .layouts import DEFAULT_LAYOUT, LAYOUTS  # the registry with mxlib's layouts registered
from .writer import _config_dict, attention_linears, unquantized_modules

__all__ = [
    "CheckpointSource",
    "attach_checkpoint_layout",
    "save_quantized_checkpoint",
    "read_checkpoint_source",
    "parse_shard_size",
]

# config files besides config.json that a loaded model's save copies from its source, as read
_COPIED_FILES = ("generation_config.json",)
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


@dataclass
class CheckpointSource:
    """What a model's ``save_pretrained`` writes besides ``state_dict()``, and what its source stored.

    ``description``: the ``CheckpointDescription`` (layout name, scheme, exclude list, activation
    scale rule) the hooks write and read with; ``quantization_config``: ``config.json``'s, as read
    (None when the source kept it in a legacy file only); ``files``: ``{file name: text}`` of other
    config files written as they are; ``tensors``: ``{name: (dtype, shape)}`` of every tensor the
    source stored and ``config``: the source's ``config.json`` as read (both None for a model not
    loaded from a checkpoint: its config is the model's).
    """

    description: CheckpointDescription
    quantization_config: dict | None
    files: dict[str, str]
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]] | None = None
    config: dict | None = None
    # a mixed-precision checkpoint's {module name: CheckpointDescription} (``model.layers.L.mlp.experts``,
    # quantized linear layers), each module written and read back in its own scheme and layout; None:
    # every module has ``description``
    module_descriptions: dict[str, CheckpointDescription] | None = None


def read_checkpoint_source(
    folder: str | os.PathLike, description: CheckpointDescription, headers: SafetensorsHeaders | None = None
) -> CheckpointSource:
    """The ``CheckpointSource`` of a checkpoint folder: its ``quantization_config`` as stored, the
    layout's legacy config files and ``generation_config.json`` (text, regular files of at most
    ``MAX_JSON_BYTES``), every tensor's dtype and shape from the safetensors headers (``headers``, read
    when not given; no data read). ``folder`` may be a ``files.folder.CheckpointFolder``, whose files are then
    not read again."""
    folder = CheckpointFolder.of(folder)
    cfg = folder.config()
    layout = LAYOUTS[description.format]
    files = {}
    for n in (*layout.legacy_files, *_COPIED_FILES):
        if (folder / n).exists():
            files[n] = folder.text(n)  # a regular file, bounded, a JSON object, kept as its text
    if headers is None:
        headers = SafetensorsHeaders(folder)
        headers.close()  # the headers are all that is read here
    tensors = {n: (SAFETENSORS_DTYPES.get(d), headers.shape[n]) for n, d in headers.dtype.items()}
    return CheckpointSource(description, cfg.get("quantization_config"), files, tensors, cfg)


# ----------------------------------------------------------------------------- the experts' tensors


class _StateDictTensors(TensorReader):
    """A ``TensorReader`` over a dict of tensors: a layout's ``read_experts`` / ``read_linear`` read a
    state dict with the loader's checks and messages (the "file" is ``state_dict``)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.folder = "state_dict"
        self.weight_map = {n: "state_dict" for n in tensors}
        self._tensors = tensors
        self._name = None

    def _check(self, name: str, shape, dtype) -> None:
        if name not in self._tensors:
            raise CheckpointError(f"state_dict is missing tensor {name!r}")

    def _read(self, name: str) -> torch.Tensor:
        return self._tensors[name]


def _excluded(prefix: str, description: CheckpointDescription, family: MoEFamily = QWEN3_MOE) -> bool:
    """Whether the config leaves the experts under ``prefix`` (``model.layers.L.mlp.experts.``) bf16
    (the exclude list names on-disk modules: ``MoEFamily.disk_name``)."""
    return all(matches(family.disk_name(f"{prefix}0.{p}"), description.exclude) for p in PROJS)


def _scheme_of(ex: QuantizedExperts) -> MoEQuantScheme:
    return ex.scheme


def _check_experts(ex, prefix: str, description: CheckpointDescription, family: MoEFamily = QWEN3_MOE) -> None:
    """Raise when experts cannot be stored as the description says (naming the layer and why)."""
    where = f"{prefix[:-1]} ({type(ex).__name__})"
    quantized = isinstance(ex, QuantizedExperts)
    if _excluded(prefix, description, family) == quantized:
        said = "leaves them bf16 (excluded)" if quantized else "quantizes them"
        raise CheckpointError(
            f"{where}: the {description.format} quantization config {said}; the experts held are "
            f"{'quantized' if quantized else 'unquantized'}, so the saved checkpoint would not load back as they are"
        )
    if not quantized:
        return
    scheme, layout = _scheme_of(ex), LAYOUTS[description.format]
    if scheme != description.scheme:
        raise CheckpointError(
            f"{where}: experts of scheme {scheme.name}; the checkpoint stores {description.scheme.name}"
        )
    kind = getattr(ex, "global_scale_kind", "decode")
    if scheme.weight.has_global_scale and kind != layout.global_scale_kind:
        raise CheckpointError(
            f"{where}: {kind} global scales; the {layout.name} layout stores {layout.global_scale_kind} ones"
        )
    mode = getattr(ex, "activation_scale_mode", None)
    if mode is not None and ex.activation_format is not None and not ex.activation_format.static_scale:
        want = description.activation_scale_mode or "even"
        if mode != want:
            raise CheckpointError(
                f"{where}: activation_scale_mode {mode!r}; the quantization config says {want!r}, so the "
                f"saved checkpoint would load back with other activation QDQ bits"
            )


def _experts_tensors(module: TransformersExperts, prefix: str) -> dict[str, torch.Tensor]:
    """``{checkpoint name: tensor}`` of one layer's experts (module docstring)."""
    description = module.checkpoint_description
    ex = module.experts
    _check_experts(ex, prefix, description, getattr(module, "checkpoint_family", QWEN3_MOE))
    if not isinstance(ex, QuantizedExperts):  # bf16 experts of an excluded layer, per-expert names
        i = ex.intermediate_size
        out = {}
        for x in range(ex.num_experts):
            for proj, w in (("gate_proj", ex.w13[x, :i]), ("up_proj", ex.w13[x, i:]), ("down_proj", ex.w2[x])):
                out[f"{prefix}{x}.{proj}.weight"] = w.contiguous().cpu()
        return out
    weights = ExpertWeights(
        ex.weight_scheme,
        ex.w13_weight,
        ex.w13_weight_scale,
        ex.w2_weight,
        ex.w2_weight_scale,
        getattr(ex, "w13_weight_scale_2", None),
        getattr(ex, "w2_weight_scale_2", None),
        global_scale_kind=getattr(ex, "global_scale_kind", "decode"),
    )
    in13, in2 = getattr(ex, "w13_input_scale", None), getattr(ex, "w2_input_scale", None)
    layout = LAYOUTS[description.format]
    if getattr(layout, "stores_expert_biases", False):  # gpt-oss: the biases beside the experts
        biases = {"w13_bias": getattr(ex, "w13_bias", None), "w2_bias": getattr(ex, "w2_bias", None)}
        return layout.expert_tensors(description.scheme, weights, in13, in2, prefix[:-1], **biases)
    return layout.expert_tensors(description.scheme, weights, in13, in2, prefix[:-1])


def _experts_state_dict_hook(module, state_dict, prefix, local_metadata) -> None:
    state_dict.update(_experts_tensors(module, prefix))


def _take(state_dict, expected, missing_keys) -> dict | None:
    """Pop the expected names out of ``state_dict``; None (and the absent names added to
    ``missing_keys``) unless every one is there."""
    absent = [n for n in expected if n not in state_dict]
    given = {n: state_dict.pop(n) for n in expected if n in state_dict}
    if absent:
        missing_keys.extend(absent)
        return None
    return given


def _experts_load_hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors):
    description = module.checkpoint_description
    ex = module.experts
    given = _take(state_dict, _experts_tensors(module, prefix), missing_keys)
    if given is None:
        return
    tensors = _StateDictTensors(given)
    e, h, i = ex.num_experts, ex.hidden_size, ex.intermediate_size
    device = ex._device()
    if not isinstance(ex, QuantizedExperts):

        def stack(proj, shape):
            return tensors.stack([f"{prefix}{x}.{proj}.weight" for x in range(e)], shape, ex.w13.dtype)

        w13 = torch.cat([stack("gate_proj", (i, h)), stack("up_proj", (i, h))], 1)
        new = TritonExperts(w13.to(device), stack("down_proj", (h, i)).to(device), backend=ex.backend)
    else:
        layout = LAYOUTS[description.format]
        weights, in13, in2 = layout.read_experts(tensors, prefix[:-1], e, h, i, description)
        to = lambda t: None if t is None else t.to(device)  # noqa: E731
        new = make_emulation_experts(
            description.scheme,
            weights.to(device),
            to(in13),
            to(in2),
            backend=ex.backend,
            scale_strategy=getattr(ex, "scale_strategy", "max"),
            activation_scale_mode=getattr(ex, "activation_scale_mode", None) or "even",
            activation_dtype=ex.activation_dtype,
            numerics=ex.numerics,
        )
    module.experts = new


def _linear_input_scale(module: EmulatedLinear) -> torch.Tensor | None:
    """A quantized linear layer's static input scale in the stored convention: the checkpoint's
    (kept by the loader as ``input_scale``), else recovered from its QDQ scale where exact."""
    stored = getattr(module, "input_scale", None)
    if stored is not None or "input_qdq_scale" not in module._buffers:
        return stored
    q = module.input_qdq_scale
    if not (isinstance(module.activation_format, BlockScheme) and module.global_scale_kind == "decode"):
        return q.reshape(())  # the QDQ holds the stored scale itself (FP8 decode, compressed-tensors encode)
    # ModelOpt stores the decode scale and the QDQ holds its reciprocal: a decode scale whose fp32
    # reciprocal is that QDQ scale (1 / q, or a neighbour: fp32 reciprocals are not an involution)
    s = 1.0 / q
    for cand in (s, torch.nextafter(s, s.new_full((), float("inf"))), torch.nextafter(s, s.new_zeros(()))):
        if torch.equal(1.0 / cand, q):
            return cand.reshape(())
    raise CheckpointError(
        f"EmulatedLinear ({module.extra_repr()}): its encode input scale {q.item()!r} is the reciprocal of no "
        f"fp32 decode scale; a ModelOpt checkpoint cannot store it exactly"
    )


def _linear_tensors(module: EmulatedLinear, prefix: str) -> dict[str, torch.Tensor]:
    description = module.checkpoint_description
    layout = LAYOUTS[description.format]
    if module.scheme != description.scheme or (
        module.scheme.weight.has_global_scale and module.global_scale_kind != layout.global_scale_kind
    ):
        raise CheckpointError(
            f"{prefix[:-1]}: an EmulatedLinear of scheme {module.scheme.name} ({module.global_scale_kind} global "
            f"scale); the {layout.name} checkpoint stores {description.scheme.name} ({layout.global_scale_kind})"
        )
    g = getattr(module, "weight_scale_2", None)
    w = LinearWeights(
        module.scheme.weight, module.weight, module.weight_scale, g, global_scale_kind=module.global_scale_kind
    )
    out = layout.linear_tensors(description.scheme, w, _linear_input_scale(module), prefix[:-1])
    if module.bias is not None:
        out[f"{prefix}bias"] = module.bias.detach().cpu()
    return out


def _linear_state_dict_hook(module, state_dict, prefix, local_metadata) -> None:
    state_dict.update(_linear_tensors(module, prefix))


def _linear_load_hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors):
    description = module.checkpoint_description
    given = _take(state_dict, _linear_tensors(module, prefix), missing_keys)
    if given is None:
        return
    layout = LAYOUTS[description.format]
    weights, ins = layout.read_linear(
        _StateDictTensors(given), prefix[:-1], module.out_features, module.in_features, description
    )
    device = module.weight.device
    bias = given.get(f"{prefix}bias")
    new = make_emulated_linear(
        description.scheme,
        weights.to(device),
        None if ins is None else ins.to(device),
        bias=None if bias is None else bias.to(module.activation_dtype).to(device),
        backend=module.backend,
        activation_scale_mode=module.activation_scale_mode,
        activation_dtype=module.activation_dtype,
    )
    module._buffers.update(new._buffers)  # same names, the values read
    module.global_scale_kind = new.global_scale_kind
    if ins is not None:
        module.register_buffer("input_scale", ins.to(device), persistent=False)


# ----------------------------------------------------------------------------- attaching


def _attach(model, source: CheckpointSource) -> None:
    """Hooks on every experts and emulated linear module, the source record and ``save_pretrained``."""
    family = family_of(model, "attach_checkpoint_layout")
    own = source.module_descriptions or {}
    for name, module in model.named_modules():
        if isinstance(module, (TransformersExperts, EmulatedLinear)):
            module.checkpoint_description = own.get(name, source.description)
            module.checkpoint_family = family
            if not getattr(module, "_checkpoint_hooks", False):
                experts = isinstance(module, TransformersExperts)
                module.register_state_dict_post_hook(_experts_state_dict_hook if experts else _linear_state_dict_hook)
                module.register_load_state_dict_pre_hook(_experts_load_hook if experts else _linear_load_hook)
                module._checkpoint_hooks = True
    model.checkpoint_source = source
    model.save_pretrained = BoundToModel(save_pretrained, model)


def _pick_layout(scheme: MoEQuantScheme, kind: str, layout: str | None) -> CheckpointLayout:
    if layout is not None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {list(LAYOUTS)}, got {layout!r}")
        chosen = LAYOUTS[layout]
        if not chosen.handles(scheme):
            raise ValueError(f"layout: {layout} does not store scheme {scheme.name}")
        if scheme.weight.has_global_scale and chosen.global_scale_kind != kind:
            raise ValueError(
                f"layout: {layout} stores {chosen.global_scale_kind} global scales, the experts hold {kind} ones"
            )
        return chosen
    fits = [
        lay
        for lay in LAYOUTS.values()
        if lay.handles(scheme) and (not scheme.weight.has_global_scale or lay.global_scale_kind == kind)
    ]
    if not fits:
        raise ValueError(f"no registered layout stores scheme {scheme.name} with {kind} global scales")
    default = DEFAULT_LAYOUT.get(scheme.weight)
    return next((lay for lay in fits if lay.name == default), fits[0])


def attach_checkpoint_layout(model, layout: str | None = None) -> CheckpointDescription:
    """Give an MoE model (any registered family) holding mxlib's quantized experts a checkpoint layout, so that its
    ``state_dict()`` carries the experts under the layout's tensor names, ``load_state_dict``
    restores them and ``save_pretrained`` writes the checkpoint (module docstring).

    ``load_quantized_qwen3_moe`` calls it with the checkpoint's own description; call it on a model
    whose experts you swapped in (``mxlib.models.qwen3.swap_experts``), and again after swapping
    experts anew.

    Args:
        model: a transformers model of a registered family whose every MoE layer holds
            ``TransformersExperts`` of one quantized scheme (``mxlib.moe.factory.make_emulation_experts``);
            quantized attention, if any, as ``EmulatedLinear`` in every ``nn.Linear`` of ``self_attn``.
            The exclude list names the family's bf16 routers, shared experts and dense MLPs
            (``writer.unquantized_modules``).
        layout: a registered layout name; None picks the one ``DEFAULT_LAYOUT`` names for the
            scheme's weight format among the layouts storing the experts' kind of global scale
            (compressed-tensors' encode scales: ``compressed-tensors``).

    Returns:
        The ``CheckpointDescription`` the model now saves with.

    Raises:
        ValueError: no quantized experts, experts of several schemes or of unquantized weights,
            a layout that does not store them, emulated linear layers other than all attention
            projections (naming them).
        UnsupportedModelError: a model of a class mxlib does not quantize (``mxlib.models.families``).
    """
    check_supported_model(model, "attach_checkpoint_layout")
    family = family_of(model, "attach_checkpoint_layout")
    experts = {n: m.experts for n, m in model.named_modules() if isinstance(m, TransformersExperts)}
    quantized = {n: ex for n, ex in experts.items() if isinstance(ex, QuantizedExperts)}
    if not quantized or len(quantized) != len(family.moe_layer_indices(model.config)):
        bf16 = sorted(set(experts) - set(quantized)) or ["(no mxlib experts at all)"]
        raise ValueError(
            f"model: every layer must hold quantized mxlib experts (swap_experts with make_emulation_experts); "
            f"not quantized: {bf16[:3]}"
        )
    schemes = {_scheme_of(ex) for ex in quantized.values()}
    kinds = {getattr(ex, "global_scale_kind", "decode") for ex in quantized.values()}
    if len(schemes) > 1 or len(kinds) > 1:
        raise ValueError(f"model: experts of several schemes {sorted(s.name for s in schemes)} or scale kinds {kinds}")
    scheme, kind = schemes.pop(), kinds.pop()
    chosen = _pick_layout(scheme, kind, layout)
    linears = sorted(n for n, m in model.named_modules() if isinstance(m, EmulatedLinear))
    attention = attention_linears(model)
    if linears and linears != sorted(attention):
        odd = sorted(set(linears) ^ set(attention))
        raise ValueError(
            f"model: emulated linear layers must be every attention projection or none (the layout's config "
            f"quantizes all or none); differs at {odd[:3]}"
        )
    if linears and not chosen.supports_linear:
        raise ValueError(f"layout: {chosen.name} stores no quantized linear layers; the model has {len(linears)}")
    qc, extra = chosen.config_files(scheme, bool(linears))
    chosen.add_excluded(qc, extra, unquantized_modules(model, family, linears))
    description = chosen.read_config(qc)
    _attach(model, CheckpointSource(description, qc, {n: json.dumps(c, indent=2) for n, c in extra.items()}))
    return description


# ----------------------------------------------------------------------------- writing

_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_shard_size(size: int | str) -> int:
    """Bytes of a shard size: a positive int, or digits and a unit as transformers takes them
    (``"5GB"`` = 5 * 10**9, ``"500MiB"`` = 500 * 2**20; ``KB MB GB TB`` and ``KiB MiB GiB TiB``).

    Raises:
        ValueError: naming ``max_shard_size`` and the accepted forms.
    """
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B)\s*", str(size).upper()) if isinstance(size, str) else None
    if m is None or float(m.group(1)) <= 0:
        raise ValueError(f"max_shard_size: expected a positive int or a size such as '5GB' or '500MiB', got {size!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def _conform(name: str, t: torch.Tensor, want, plain: bool) -> torch.Tensor:
    """``t`` in the dtype and shape the source stored (``want``: ``(dtype, shape)`` or None), or
    bf16 for a plain (non-quantized) float tensor without a source; exact or raises."""
    t = t.detach()
    dtype, shape = want if want is not None else (torch.bfloat16 if plain and t.is_floating_point() else t.dtype, None)
    if shape is not None and tuple(t.shape) != tuple(shape):
        if t.numel() != torch.Size(shape).numel():
            raise CheckpointError(f"tensor {name!r}: shape {list(t.shape)}; the source stored {list(shape)}")
        t = t.reshape(shape)
    if dtype is not None and t.dtype != dtype:
        cast = t.to(dtype)
        back = cast.to(t.dtype)
        same = (back == t) | (torch.isnan(back) & torch.isnan(t)) if t.is_floating_point() else back == t
        if not bool(same.all()):
            raise CheckpointError(
                f"tensor {name!r}: dtype {t.dtype} holds values {dtype} cannot store exactly (the "
                f"{'source stored' if want is not None else 'layout stores'} {dtype}); convert the model first"
            )
        t = cast
    return t


def save_quantized_checkpoint(
    model,
    path: str | os.PathLike,
    shard_bytes: int = SHARD_BYTES,
    overwrite: bool = False,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write a model with an attached layout (``attach_checkpoint_layout``; every model
    ``load_quantized_qwen3_moe`` returns) as a checkpoint of that layout (module docstring).

    Args:
        model: the model; path: the checkpoint folder (absent, empty or an earlier mxlib
            checkpoint; ``safetensors_io.atomic_folder``); shard_bytes: safetensors shard size;
        overwrite: replace anything else at ``path``;
        state_dict: tensors to write instead of ``model.state_dict()``: the same names, dtypes and
            shapes (transformers' ``state_dict`` argument).

    Returns:
        ``path`` as a ``Path``, loadable with ``load_quantized_qwen3_moe``.

    Raises:
        ValueError: a model without an attached layout (naming ``attach_checkpoint_layout``);
            experts swapped in after it was attached.
        CheckpointError: experts that the layout cannot store as they are (another scheme or kind
            of global scale, quantized experts in a layer the config excludes); a tensor whose
            values the stored dtype cannot hold exactly; tensors of the source that the model does
            not hold (named); a ``state_dict`` with other names, dtypes or shapes (named).
        FileExistsError, PermissionError: as ``atomic_folder``. On any error nothing is left at ``path``.
        UnsupportedModelError: a model of a class mxlib does not quantize (``mxlib.models.families``).
    """
    check_supported_model(model, "save_quantized_checkpoint")
    family = family_of(model, "save_quantized_checkpoint")
    source = getattr(model, "checkpoint_source", None)
    if not isinstance(source, CheckpointSource):
        raise ValueError(
            "model: no checkpoint layout attached; call mxlib.checkpoints.attach_checkpoint_layout(model) first"
        )
    bare = [
        n
        for n, m in model.named_modules()
        if isinstance(m, (TransformersExperts, EmulatedLinear)) and not getattr(m, "_checkpoint_hooks", False)
    ]
    if bare:
        raise ValueError(
            f"model: {bare[0]} was swapped in after the checkpoint layout was attached; call attach_checkpoint_layout "
            f"again"
        )
    own = model.state_dict()
    if state_dict is not None:
        for n in sorted(set(own) ^ set(state_dict)):
            raise CheckpointError(f"state_dict: {'missing' if n in own else 'unexpected'} key {n!r}")
        for n, t in state_dict.items():
            if t.dtype != own[n].dtype or t.shape != own[n].shape:
                raise CheckpointError(
                    f"state_dict[{n!r}]: expected {own[n].dtype} {list(own[n].shape)}, got {t.dtype} {list(t.shape)}"
                )
        own = state_dict
    plain = {n for n, _ in model.named_parameters() if not family.keeps_fp32(n)}
    recorded = source.tensors or {}
    tied = tied_parameter_names(model)  # stored once, under the embedding's name (transformers' save_pretrained)
    state = {n: _conform(n, t, recorded.get(n), n in plain) for n, t in own.items() if n not in tied}
    num_layers = len(model.model.layers)
    if source.tensors is not None:
        kept = [
            n
            for n in source.tensors
            if not ((m := _LAYER.match(n)) and int(m.group(1)) >= num_layers) and n not in state and n not in tied
        ]
        if kept:
            raise CheckpointError(
                f"model: its source checkpoint stores {len(kept)} tensors the model does not hold (e.g. {kept[:3]}); "
                f"the saved checkpoint would lack them"
            )
    with atomic_folder(path, overwrite=overwrite) as tmp:
        shards = ShardWriter(tmp, shard_bytes)
        for n, t in state.items():  # under the family's on-disk names (Mixtral's block_sparse_moe.*)
            shards.add(family.disk_name(n), t)
        shards.close()
        if source.config is not None:  # the source's config.json, cut to the layers the model holds
            cfg = dict(source.config, num_hidden_layers=num_layers)
        else:
            cfg = _config_dict(model, num_layers)
            cfg["quantization_config"] = source.quantization_config
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
        for fname, text in source.files.items():
            (tmp / fname).write_text(text)
    return Path(path)


def save_pretrained(
    self,
    save_directory: str | os.PathLike,
    is_main_process: bool = True,
    state_dict: dict | None = None,
    push_to_hub: bool = False,
    max_shard_size: int | str = "50GB",
    variant: str | None = None,
    token: str | bool | None = None,
    save_peft_format: bool = True,
    save_original_format: bool = True,
    distributed_checkpoint: bool = False,
    safe_serialization: bool = True,
    overwrite: bool = False,
    **kwargs,
) -> None:
    """transformers' ``save_pretrained`` for a model with an attached checkpoint layout: writes the
    quantized checkpoint in that layout (``save_quantized_checkpoint``, atomic), not transformers'
    bf16 state dict.

    Honoured: ``save_directory``, ``is_main_process`` (False writes nothing), ``state_dict``,
    ``max_shard_size`` (``parse_shard_size``), ``save_peft_format`` (no adapters: nothing to
    rename), ``overwrite`` (mxlib's: replace a folder that is not an mxlib checkpoint).

    Raises:
        ValueError: an argument this writer cannot honour, naming it: ``push_to_hub=True`` (push
            the folder with ``huggingface_hub.upload_folder``), ``token``, ``variant`` (the shards
            have the layout's own names), ``safe_serialization=False`` (the layouts are
            safetensors), ``save_original_format=False`` (the checkpoint layout is the original
            format), ``distributed_checkpoint=True``.
        TypeError: any other keyword argument, named.
        As ``save_quantized_checkpoint`` otherwise.
    """
    refused = {
        "push_to_hub": (push_to_hub, False, "push the written folder with huggingface_hub.upload_folder"),
        "token": (token, None, "it is used to push to the Hub, which this writer does not do"),
        "variant": (variant, None, "the shards carry the checkpoint layout's own file names"),
        "safe_serialization": (safe_serialization, True, "the checkpoint layouts are safetensors only"),
        "save_original_format": (save_original_format, True, "the checkpoint layout is the original format"),
        "distributed_checkpoint": (distributed_checkpoint, False, "the quantized experts are written whole"),
    }
    for arg, (value, allowed, why) in refused.items():
        if value != allowed:
            raise ValueError(
                f"save_pretrained: {arg}={value!r} cannot be honoured for a quantized mxlib model "
                f"(only {allowed!r}): {why}"
            )
    if kwargs:
        raise TypeError(f"save_pretrained: unexpected keyword arguments {sorted(kwargs)} for a quantized mxlib model")
    shard_bytes = parse_shard_size(max_shard_size)
    if not is_main_process:
        return None
    save_quantized_checkpoint(self, save_directory, shard_bytes, overwrite=overwrite, state_dict=state_dict)
    return None
