"""Writing a quantized MoE checkpoint (any registered family) from a bf16 model, in any registered layout.

``write_quantized_checkpoint(model, scheme, path, calibration)`` quantizes the experts (and, with
``quantize_attention``, the attention projections) and writes them with the tensor names and
config files of the layout (``layout.CheckpointLayout``): the one ``DEFAULT_LAYOUT`` names for
the scheme's weight format, or the one the caller names. Everything the emulation does not
quantize is bf16 under the family's on-disk name (``MoEFamily.disk_name``: transformers' names, or
Mixtral's ``block_sparse_moe.*``) and listed in the ignore / exclude list: the routers, and the
shared experts (Qwen2-MoE's ``mlp.shared_expert`` and ``mlp.shared_expert_gate``, DeepSeek-V3's
``mlp.shared_experts``) and dense MLP layers (DeepSeek-V3's first ``first_k_dense_replace``,
Qwen2-MoE's ``mlp_only_layers``), which are stored as the layouts store every other unquantized
linear layer: bf16 (``float32`` where the family keeps them so: DeepSeek-V3's router weight and
``e_score_correction_bias``), named one by one in the exclude list where the layout's own patterns
do not cover them. ``config.json`` is the model's own (its ``architectures`` and ``model_type``).
Experts are quantized one at a time and streamed into shards (``safetensors_io.ShardWriter``);
the folder is written under a temporary name and renamed into place at the end
(``safetensors_io.atomic_folder``), so a failed write leaves no half-written checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from ..models.calibration import Calibration, calibrate
from ..models.families import MoEFamily, check_supported_model, family_of
from ..models.hessians import technique_from_calibration
from ..models.moe_models import expert_biases, expert_weights, tied_parameter_names
from ..moe.factory import quantize_expert_weights
from ..moe.linear import EmulatedLinear
from ..moe.schemes import MoEQuantScheme, get_moe_scheme
from ..recovery import RECOVERY_CONFIG_KEY, WeightTechnique
from ..recovery.base import technique_global_scale_kw
from .files.safetensors_io import SHARD_BYTES, ShardWriter, atomic_folder
from .layout import CheckpointLayout
from .layouts import LAYOUTS, layout_for_scheme  # the registry with mxlib's layouts registered

__all__ = [
    "write_quantized_checkpoint",
    "ATTENTION_PROJS",
    "resolve_layout",
    "write_layer_experts",
    "write_config_files",
    "stored_config",
]

logger = logging.getLogger(__name__)


def stored_config(cfg: dict, family: MoEFamily, num_hidden_layers: int) -> dict:
    """The ``config.json`` of a quantized checkpoint from a model's config dict: its own fields, the family's
    class in ``architectures``, ``dtype`` and ``torch_dtype`` bfloat16 (the unquantized tensors' dtype), no
    ``quantization_config`` (``write_config_files`` adds the layout's)."""
    cfg = dict(cfg)
    cfg["num_hidden_layers"] = num_hidden_layers
    cfg["architectures"] = [family.architecture]
    # the dtype every unquantized tensor is stored in (transformers 5 reads ``dtype``, older releases ``torch_dtype``)
    cfg["dtype"] = cfg["torch_dtype"] = "bfloat16"
    cfg.pop("quantization_config", None)
    return cfg


def _config_dict(model, num_hidden_layers: int) -> dict:
    return stored_config(model.config.to_dict(), family_of(model, "config"), num_hidden_layers)


ATTENTION_PROJS = ("q_proj", "k_proj", "v_proj", "o_proj")


def attention_linears(model) -> list[str]:
    """Module names of every ``nn.Linear`` (or ``EmulatedLinear`` in its place) under a decoder layer's
    ``self_attn``, in layer and module order (Qwen3-MoE's ``q_proj, k_proj, v_proj, o_proj``;
    DeepSeek-V3's low-rank ``q_a_proj``, ...)."""
    return [
        f"model.layers.{i}.self_attn.{n}"
        for i, layer in enumerate(model.model.layers)
        for n, m in layer.self_attn.named_modules()
        if isinstance(m, (torch.nn.Linear, EmulatedLinear))
    ]


def unquantized_modules(model, family: MoEFamily, quantized: list[str]) -> list[str]:
    """On-disk names of the modules a checkpoint stores bf16 besides the experts: every router and every
    ``nn.Linear`` not in ``quantized`` (shared experts, dense MLPs, unquantized attention, ``lm_head``)."""
    experts_part = f".{family.block_attr}.{family.experts_attr}"
    skip = set(quantized)
    names = []
    for n, m in model.named_modules():
        if experts_part in n or n in skip:
            continue
        is_router = n.endswith(f".{family.block_attr}.{family.router_attr}")
        if is_router or isinstance(m, torch.nn.Linear):
            names.append(family.disk_name(n))
    return names


def _stored_exactly(name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in the stored ``dtype``; a floating tensor of another dtype only where every value converts exactly.

    Raises:
        ValueError: naming the tensor, the model's dtype and the stored one, and the cast that makes it exact.
    """
    if t.dtype == dtype or not t.is_floating_point():
        return t.to(dtype) if t.is_floating_point() else t
    cast = t.to(dtype)
    back = cast.to(t.dtype)
    if not bool(((back == t) | (torch.isnan(back) & torch.isnan(t))).all()):
        raise ValueError(
            f"model: tensor {name!r} is {t.dtype} and its values do not convert to the stored {dtype} exactly (the "
            f"layouts store unquantized tensors in bf16, as ModelOpt, Quark and llm-compressor exports do); write a "
            f"model whose values bf16 holds, for example after model.to(torch.bfloat16), a cast you choose"
        )
    return cast


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
    progress: bool = False,
    technique: str | WeightTechnique | None = None,
) -> Path:
    """Quantize a bf16 Qwen3-MoE model's experts (and optionally attention) and write the checkpoint.

    Experts are quantized one at a time and streamed into shards (``ShardWriter``), so the
    writer holds at most one shard of quantized tensors besides the model.

    Args:
        model: a transformers model of a registered family (``mxlib.models.families``: Qwen3-MoE,
            Mixtral, OLMoE, Qwen2-MoE, DeepSeek-V3) holding bf16 experts.
        scheme: ``nvfp4`` (ModelOpt layout) or a Quark OCP MX scheme (Quark layout); the layout is
            the one ``layout.DEFAULT_LAYOUT`` names for the scheme's weight format.
        path: the checkpoint folder: absent, empty, or an earlier mxlib checkpoint (replaced
            atomically); anything else needs ``overwrite=True``.
        calibration: per-expert activation amax (a ``Calibration``: ``mxlib.models.calibration.calibrate``), or the
            calibration batches themselves (token ids ``[N, T]``, a dict with ``input_ids`` / ``attention_mask``, an
            iterable of batches: ``calibration_batches``), from which the amax, and GPTQ's Hessians, are computed;
            needed by schemes with static activation scales (``nvfp4``, ``_a_fp8``) and by ``technique="gptq"``.
        shard_bytes: safetensors shard size (also the most quantized bytes held in memory).
        layout: a registered layout name (``modelopt``, ``quark``, ``compressed-tensors``); None
            takes the family's own layout where it stores the scheme (``MoEFamily.checkpoint_layout``:
            gpt-oss's ``gpt-oss-mxfp4`` for ``w_mxfp4``), else the scheme's default (``DEFAULT_LAYOUT``:
            ``nvfp4`` -> ``modelopt``, OCP MX -> ``quark``). A family with expert biases (gpt-oss) needs a
            layout that stores them (``stores_expert_biases``); a layout of whole-layer tensors
            (``stacked_experts``) gets each layer's experts and biases in one call.
        quantize_attention: also quantize every ``nn.Linear`` of ``self_attn`` (``{q,k,v,o}_proj``; as
            ModelOpt's default NVFP4 config and llm-compressor's NVFP4 scheme do) instead of leaving
            them bf16 and ignored.
        linear_input_amax: ``{module name: amax}`` of those projections' inputs
            (``mxlib.moe.linear.linear_input_amax``), needed with ``quantize_attention`` by schemes
            with static activation scales.
        overwrite: replace whatever is at ``path`` (a file, a user's folder).
        progress: a tqdm bar on stderr, one step per layer of experts quantized and written.
        technique: how the experts' scales and codes are chosen (``mxlib.recovery``): a name of
            ``TECHNIQUES`` or a built ``WeightTechnique``; None is round-to-nearest through the
            layout's own arithmetic. ``"gptq"`` collects its Hessians from ``calibration`` batches
            (``mxlib.models.hessians.technique_from_calibration``). Its ``config()``, when not empty, is stored in
            ``quantization_config[RECOVERY_CONFIG_KEY]``. A layout storing encode NVFP4 global
            scales (compressed-tensors) asks the technique for codes chosen under an encode scale
            (``mxlib.recovery.base.technique_global_scale_kw``).

    Returns:
        The folder's path. On any error nothing is left at ``path`` (or the old checkpoint stays).

    Raises:
        ValueError: a layout without expert biases for a family that has them; ``technique="gptq"`` without
            calibration batches; a static-activation-scale scheme without ``calibration`` (or without
            ``linear_input_amax`` for quantized attention); a layout that does not store the scheme;
            a technique that cannot produce the layout's kind of NVFP4 global scale; an fp16 / fp32 model
            tensor whose values bf16 (the stored dtype, ``config.json``'s ``dtype``) cannot hold exactly: the
            writer never rounds a model silently.
        FileExistsError: ``path`` is not absent, empty or an mxlib checkpoint, without ``overwrite``.
        PermissionError: the old checkpoint at ``path`` cannot be removed (it stays as it was).
        UnsupportedModelError: a model of a class mxlib does not quantize (``mxlib.models.families``).
    """
    check_supported_model(model, "write_quantized_checkpoint")
    family = family_of(model, "write_quantized_checkpoint")
    scheme = get_moe_scheme(scheme)
    batches = None if calibration is None or isinstance(calibration, Calibration) else calibration
    technique = technique_from_calibration(model, technique, batches if batches is not None else calibration)
    layout = resolve_layout(family, scheme, layout)
    if scheme.static_activation_scale and calibration is None:
        raise ValueError(f"{scheme.name} checkpoints need activation input scales: pass a Calibration")
    if scheme.static_activation_scale and batches is not None:
        calibration = calibrate(model, batches, progress=progress, name="calibration")
    attn = attention_linears(model) if quantize_attention else []
    if attn and scheme.static_activation_scale:
        missing = [n for n in attn if linear_input_amax is None or n not in linear_input_amax]
        if missing:
            raise ValueError(
                f"quantize_attention with {scheme.name} needs linear_input_amax for every projection "
                f"(mxlib.moe.linear.linear_input_amax); missing {missing[:2]}"
            )
    if technique is not None:  # refuses a technique that cannot give the layout's global scales, before any write
        technique_global_scale_kw(technique, scheme, layout.global_scale_kind)
    logger.info("writing %s checkpoint (%s layout) to %s", scheme.name, layout.name, path)
    with atomic_folder(path, overwrite=overwrite) as tmp:
        num_layers = len(model.model.layers)
        shards = ShardWriter(tmp, shard_bytes)
        tied = tied_parameter_names(model)  # lm_head.weight of tied embeddings: stored once, as embed_tokens
        experts_part = f".{family.block_attr}.{family.experts_attr}."
        for name, t in model.state_dict().items():
            if experts_part in name or name.rsplit(".", 1)[0] in attn or name in tied:
                continue
            dtype = torch.float32 if family.keeps_fp32(name) else torch.bfloat16
            shards.add(family.disk_name(name), _stored_exactly(name, t.detach(), dtype))
        modules = dict(model.named_modules())
        for name in attn:  # quantized attention projections, one at a time
            w = modules[name].weight.detach()
            ins = None
            if scheme.static_activation_scale:
                ins = layout.stored_input_scale(
                    linear_input_amax[name].float().reshape(()) / scheme.activation.scale_divisor
                )
            for n, t in layout.linear_tensors(scheme, layout.quantize_linear(w, scheme), ins, name).items():
                shards.add(family.disk_name(n), t, copy=True)
        moe = family.moe_layer_indices(model.config)
        for layer in tqdm(moe, desc="quantizing experts", unit="layer", disable=not progress):
            w13, w2 = expert_weights(model, layer)
            in13 = in2 = None
            if scheme.static_activation_scale:
                in13, in2 = calibration.input_scales(layer, scheme.activation)
            write_layer_experts(
                shards, family, layout, scheme, layer, w13, w2, expert_biases(model, layer), in13, in2, technique
            )
        shards.close()
        cfg = _config_dict(model, num_layers)
        write_config_files(
            tmp, cfg, layout, scheme, unquantized_modules(model, family, attn), technique, quantize_attention
        )
    return Path(path)


def resolve_layout(family: MoEFamily, scheme: MoEQuantScheme, layout: str | None) -> CheckpointLayout:
    """The layout a checkpoint of ``scheme`` is written in: ``layout`` by name, or (None) the family's own
    where it stores the scheme (``MoEFamily.checkpoint_layout``), else the scheme's default
    (``layout.DEFAULT_LAYOUT``).

    Raises:
        ValueError: an unknown layout name (naming the registered ones); a layout that does not store
            ``scheme``; a layout without expert biases for a family whose experts have them.
    """
    own = LAYOUTS.get(family.checkpoint_layout) if family.checkpoint_layout else None
    if layout is None:
        chosen = own if own is not None and own.handles(scheme) else layout_for_scheme(scheme)
    else:
        if layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {list(LAYOUTS)}, got {layout!r}")
        chosen = LAYOUTS[layout]
        if not chosen.handles(scheme):
            stores = [n for n, lay in LAYOUTS.items() if lay.handles(scheme)]
            raise ValueError(f"layout: {chosen.name} does not store scheme {scheme.name} (layouts that do: {stores})")
    if family.expert_biases and not getattr(chosen, "stores_expert_biases", False):
        raise ValueError(
            f"layout: {chosen.name} stores no expert biases, which {family.architecture}'s experts have "
            f"(gate_up_proj_bias, down_proj_bias); layouts that store them: "
            f"{[n for n, lay in LAYOUTS.items() if getattr(lay, 'stores_expert_biases', False)]}"
        )
    return chosen


def write_layer_experts(
    shards: ShardWriter,
    family: MoEFamily,
    layout: CheckpointLayout,
    scheme: MoEQuantScheme,
    layer: int,
    w13: torch.Tensor,
    w2: torch.Tensor,
    biases: tuple[torch.Tensor, torch.Tensor] | None = None,
    w13_input_scale: torch.Tensor | None = None,
    w2_input_scale: torch.Tensor | None = None,
    technique: WeightTechnique | None = None,
) -> None:
    """Quantize one MoE layer's experts and add their tensors to ``shards`` under the family's on-disk
    names: what ``write_quantized_checkpoint`` does for each layer, and ``mxlib.checkpoints.streaming``
    for each layer it reads.

    Args:
        shards: the open ``ShardWriter`` (tensors are copied into its shard buffer).
        family, layout, scheme: the model's family, the resolved layout (``resolve_layout``), the scheme.
        layer: the decoder layer index (``model.layers.L``; a technique's per-layer state).
        w13, w2: bf16 ``[E, 2I, H]`` (gate rows, then up rows) and ``[E, H, I]`` (``expert_weights``).
        biases: ``(w13_bias [E, 2I], w2_bias [E, H])`` of a family with expert biases, else None.
        w13_input_scale, w2_input_scale: fp32 ``[E]`` decode activation scales (``amax / scale_divisor``:
            ``Calibration.input_scales``) of a scheme with static activation scales, else None.
        technique: a built ``WeightTechnique`` or None (round-to-nearest through the layout's arithmetic).
    """
    technique_kw = {} if technique is None else technique_global_scale_kw(technique, scheme, layout.global_scale_kind)
    # a layout's own expert quantization (compressed-tensors' encode scales) runs once per
    # layer; without one (None) the experts are quantized one at a time below
    if technique is None:
        layer_weights = layout.quantize_experts(w13, w2, scheme)
    else:
        layer_weights = technique.quantize_experts(w13, w2, scheme, layer=layer, **technique_kw)
    in13 = in2 = None
    if scheme.static_activation_scale:
        in13, in2 = (layout.stored_input_scale(t) for t in (w13_input_scale, w2_input_scale))
    prefix = family.experts_prefix(layer)
    if getattr(layout, "stacked_experts", False):  # one tensor per layer (gpt-oss), its biases beside
        weights = layer_weights if layer_weights is not None else quantize_expert_weights(w13, w2, scheme)
        for name, t in layout.expert_tensors(scheme, weights, in13, in2, prefix, *(biases or (None, None))).items():
            shards.add(family.disk_name(name), t, copy=True)
        return
    for x in range(w13.shape[0]):  # expert by expert: temporaries of one expert only
        if layer_weights is None:
            weights = quantize_expert_weights(w13[x : x + 1], w2[x : x + 1], scheme)
        else:  # expert x of the layout's whole-layer quantization
            weights = replace(layer_weights, **{k: v[x : x + 1] for k, v in layer_weights.tensors().items()})
        one = layout.expert_tensors(
            scheme,
            weights,
            None if in13 is None else in13[x : x + 1],
            None if in2 is None else in2[x : x + 1],
            prefix,
        )
        for name, t in one.items():  # the layout names the single expert 0
            shards.add(family.disk_name(f"{prefix}.{x}." + name[len(prefix) + 3 :]), t, copy=True)
        del weights, one


def write_config_files(
    folder: Path,
    cfg: dict,
    layout: CheckpointLayout,
    scheme: MoEQuantScheme,
    unquantized: list[str],
    technique: WeightTechnique | None = None,
    quantize_attention: bool = False,
) -> None:
    """Write ``config.json`` (``cfg`` with the layout's ``quantization_config``, its exclude lists naming
    ``unquantized``, the on-disk names of the bf16 modules) and the layout's extra config files into ``folder``."""
    qc, extra = layout.config_files(scheme, quantize_attention)
    layout.add_excluded(qc, extra, unquantized)
    if technique is not None and technique.config():
        qc = {**qc, RECOVERY_CONFIG_KEY: {"technique": technique.name, **technique.config()}}
    cfg = {**cfg, "quantization_config": qc}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
    for fname, content in extra.items():
        (folder / fname).write_text(json.dumps(content, indent=2))
