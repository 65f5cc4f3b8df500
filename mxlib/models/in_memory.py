"""``quantize_``: one call that quantizes a bf16 MoE model's experts in memory and leaves it ready to run and save.

``quantize_(model, scheme, calibration=..., technique=...)`` is the writer's arithmetic without the files: per MoE
layer it reads the experts (``moe_models.expert_weights``), quantizes them as the layout would store them (the
layout's own whole-layer quantization where it has one, else ``mxlib.moe.factory.quantize_expert_weights``, or the
technique's codes), derives static input scales from the calibration (``Calibration.input_scales``, in the layout's
stored convention), passes the layer's tensors through the layout's ``expert_tensors`` / ``read_experts`` (so the
experts hold exactly what ``save_pretrained`` writes and a load reads back), builds the scheme's emulation experts
(``mxlib.moe.factory.make_emulation_experts``) and swaps them in (``moe_models.swap_experts``). The model then
carries its checkpoint layout (``checkpoints.saving.attach_checkpoint_layout``): ``model.save_pretrained(folder)``
writes it, and ``mxlib.from_pretrained(folder)`` gives the same experts bit for bit.

Calibration (``mxlib.models.calibration.calibration_batches``): a token-id tensor, a dict with ``input_ids`` and
``attention_mask``, or an iterable of such batches (a list, a ``DataLoader``); padded tokens take no part in the
amax or the Hessians. Calibration runs on the bf16 model before any layer is swapped, as ModelOpt's and
llm-compressor's do.
"""

from __future__ import annotations

import logging

import torch
from tqdm import tqdm

from ..checkpoints.layouts import LAYOUTS, layout_for_scheme  # the registry with mxlib's layouts registered
from ..checkpoints.saving import _StateDictTensors, attach_checkpoint_layout, save_pretrained
from ..moe.base import TransformersExperts
from ..moe.factory import make_emulation_experts, quantize_expert_weights
from ..moe.schemes import MoEQuantScheme, get_moe_scheme
from ..recovery import RECOVERY_CONFIG_KEY, WeightTechnique
from ..recovery.base import technique_global_scale_kw
from ..recovery.hadamard import rotation_from_config
from .calibration import Calibration, calibrate
from .families import check_supported_model, family_of
from .hessians import technique_from_calibration, technique_needs_hessians
from .moe_models import BoundToModel, expert_activation, expert_biases, expert_weights, moe_blocks, swap_experts

__all__ = ["quantize_"]

logger = logging.getLogger(__name__)


def _pick_layout(model, family, scheme: MoEQuantScheme, layout: str | None):
    own = LAYOUTS.get(family.checkpoint_layout) if family.checkpoint_layout else None
    if layout is None:
        return own if own is not None and own.handles(scheme) else layout_for_scheme(scheme)
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {list(LAYOUTS)}, got {layout!r}")
    if not LAYOUTS[layout].handles(scheme):
        fits = [n for n, lay in LAYOUTS.items() if lay.handles(scheme)]
        raise ValueError(f"layout: {layout} does not store scheme {scheme.name}; layouts that do: {fits}")
    return LAYOUTS[layout]


@torch.no_grad()
def quantize_(
    model,
    scheme: str | MoEQuantScheme,
    *,
    calibration=None,
    technique: str | WeightTechnique | None = None,
    layout: str | None = None,
    backend: str = "auto",
    scale_strategy: str = "max",
    batch_size: int = 8,
    progress: bool = True,
):
    """Quantize a model's routed experts in place (torchao's ``quantize_`` shape) and return it.

    Args:
        model: a transformers model of a registered family (``mxlib.models.families``: Qwen3-MoE, Mixtral, OLMoE,
            Qwen2-MoE, DeepSeek-V3, gpt-oss) holding its unquantized experts (bf16; fp16 / fp32 models run their
            experts' activations in that dtype).
        scheme: a MoE scheme or any name ``get_moe_scheme`` takes (``"nvfp4"``, ``"w_mxfp4_a_mxfp4"``,
            llm-compressor's ``"NVFP4"``, ``"MXFP4"``, ...).
        calibration: calibration batches (module docstring): a ``[N, T]`` token-id tensor, a dict with
            ``input_ids`` / ``attention_mask``, an iterable of such batches, or a ``Calibration`` already computed
            (``mxlib.models.calibration.calibrate``). Needed by schemes with static activation scales (``nvfp4``,
            ``_a_fp8``) and by ``technique="gptq"``; not run otherwise.
        technique: how the experts' scales and codes are chosen (``mxlib.recovery``): a name of ``TECHNIQUES``
            (``"gptq"`` collects its Hessians from ``calibration``: ``mxlib.models.hessians``) or a built
            ``WeightTechnique``; None is round-to-nearest.
        layout: the checkpoint layout the experts are held (and ``save_pretrained`` writes) in: a registered name
            (``modelopt``, ``quark``, ``compressed-tensors``, ...); None: the family's own where it stores the
            scheme (gpt-oss), else the scheme's default (``DEFAULT_LAYOUT``). compressed-tensors holds NVFP4 with
            its encode global scales, so choose it here rather than at save time.
        backend, scale_strategy: the experts' (``make_emulation_experts``).
        batch_size: rows per forward when ``calibration`` is one tensor or dict.
        progress: tqdm bars on stderr: calibration, Hessians and one step per layer quantized.

    Returns:
        The same ``model`` object, its experts replaced by the scheme's emulation experts (``TransformersExperts``
        around ``Nvfp4QuantizationEmulationTritonExperts`` / ``OCP_MXQuantizationEmulationTritonExperts``), in eval
        mode. ``model.mxlib_info`` is the ``CheckpointDescription`` it saves with; ``model.save_pretrained(folder)``
        writes that checkpoint.

    Raises:
        ValueError: a scheme with static activation scales, or ``technique="gptq"``, without ``calibration``; a
            layout that does not store the scheme (or, for gpt-oss, its expert biases); experts already quantized;
            an unknown scheme (with the nearest names).
        TypeError, ValueError: calibration batches of the wrong kind or shape (``calibration_batches``).
        UnsupportedModelError: a model of a class mxlib does not quantize.

    Only the routed experts are quantized (the routers, shared experts, dense MLPs, attention and ``lm_head`` stay as
    they are); ``write_quantized_checkpoint(..., quantize_attention=True)`` also quantizes the attention projections.
    """
    check_supported_model(model, "quantize_")
    family = family_of(model, "quantize_")
    scheme = get_moe_scheme(scheme)
    blocks = moe_blocks(model, "quantize_")
    done = [i for i, mlp in blocks if isinstance(getattr(mlp, family.experts_attr), TransformersExperts)]
    if done:
        raise ValueError(f"model: the experts of layers {done} are already mxlib experts; quantize_ takes a bf16 model")
    chosen = _pick_layout(model, family, scheme, layout)
    if family.expert_biases and not getattr(chosen, "stores_expert_biases", False):
        raise ValueError(
            f"layout: {chosen.name} stores no expert biases, which {family.architecture}'s experts have; layouts that "
            f"do: {[n for n, lay in LAYOUTS.items() if getattr(lay, 'stores_expert_biases', False)]}"
        )
    gptq = technique_needs_hessians(technique)
    needs_calibration = scheme.static_activation_scale or gptq
    if needs_calibration and calibration is None:
        why = f"{scheme.name} has static activation scales" if scheme.static_activation_scale else "GPTQ needs Hessians"
        raise ValueError(f"calibration: {why}; pass calibration= token ids, batches or a data loader")
    technique = technique_from_calibration(model, technique, calibration, batch_size, progress, "technique")
    cal = None
    if scheme.static_activation_scale:
        cal = (
            calibration
            if isinstance(calibration, Calibration)
            else calibrate(model, calibration, batch_size=batch_size, progress=progress, name="calibration")
        )
    qc, _ = chosen.config_files(scheme, False)
    description = chosen.read_config(qc)
    recovery = None
    if technique is not None and technique.config():
        recovery = {"technique": technique.name, **technique.config()}
    config = model.config
    e, h, i = family.num_experts(config), config.hidden_size, family.intermediate_size(config)
    rotation = None if recovery is None else rotation_from_config(recovery, h, i)
    technique_kw = {} if technique is None else technique_global_scale_kw(technique, scheme, chosen.global_scale_kind)
    dtype = next(model.parameters()).dtype
    activation_dtype = dtype if dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16
    activation = expert_activation(model)
    layers = family.moe_layer_indices(config)
    bar = tqdm(total=len(layers), desc="quantizing experts", unit="layer", disable=not progress)

    def make(layer: int):  # called by swap_experts layer by layer: one layer's bf16 and quantized experts at a time
        w13, w2 = expert_weights(model, layer)
        if technique is None:
            weights = chosen.quantize_experts(w13, w2, scheme)
        else:
            weights = technique.quantize_experts(w13, w2, scheme, layer=layer, **technique_kw)
        if weights is None:
            weights = quantize_expert_weights(w13, w2, scheme)
        in13 = in2 = None
        if cal is not None:
            in13, in2 = (chosen.stored_input_scale(t) for t in cal.input_scales(layer, scheme.activation))
        prefix = family.experts_prefix(layer)
        # the tensors the layout stores, read back as a load reads them: the experts hold what save_pretrained writes
        if getattr(chosen, "stores_expert_biases", False):
            biases = expert_biases(model, layer) or (None, None)
            tensors = chosen.expert_tensors(scheme, weights, in13, in2, prefix, *biases)
        else:
            tensors = chosen.expert_tensors(scheme, weights, in13, in2, prefix)
        reader = _StateDictTensors(tensors)
        weights, in13, in2 = chosen.read_experts(reader, prefix, e, h, i, description)
        b13 = b2 = None
        if family.expert_biases:
            b13, b2 = chosen.read_expert_biases(reader, prefix, e, h, i)
        device = w13.device
        to = lambda t: None if t is None else t.to(device)  # noqa: E731
        experts = make_emulation_experts(
            scheme,
            weights.to(device),
            to(in13),
            to(in2),
            backend=backend,
            scale_strategy=scale_strategy,
            activation_scale_mode=description.activation_scale_mode or "even",
            activation_dtype=activation_dtype,
            rotation=rotation,
            activation=activation,
            w13_bias=to(b13),
            w2_bias=to(b2),
        )
        bar.update()
        return experts

    originals = {i: getattr(mlp, family.experts_attr) for i, mlp in blocks}
    had_save = "save_pretrained" in model.__dict__
    try:
        swap_experts(model, make, where="quantize_")
    except BaseException:  # the model comes back as it was given
        for i, mlp in blocks:
            setattr(mlp, family.experts_attr, originals[i])
        if not had_save:
            model.__dict__.pop("save_pretrained", None)
        raise
    finally:
        bar.close()
    info = attach_checkpoint_layout(model, chosen.name)
    if recovery is not None:  # the rotation / technique the experts were made with, saved beside the layout's config
        source = model.checkpoint_source
        source.quantization_config = {**source.quantization_config, RECOVERY_CONFIG_KEY: recovery}
    model.mxlib_info = info
    model.save_pretrained = BoundToModel(_save_pretrained, model)
    logger.info("quantized %d MoE layers of %s to %s (%s)", len(layers), family.architecture, scheme.name, chosen.name)
    return model.eval()


def _save_pretrained(model, save_directory, *args, layout: str | None = None, **kwargs) -> None:
    """transformers' ``save_pretrained`` of a ``quantize_``'d model (``checkpoints.saving.save_pretrained``), with
    ``layout``: a registered layout name to write instead of the one the experts are held in (the model keeps the
    new one). NVFP4 experts hold the global-scale kind of one family of layouts (decode for ModelOpt, encode for
    compressed-tensors): between those, pass ``layout=`` to ``quantize_``.

    Raises:
        ValueError: a layout that cannot store the experts as they are (``attach_checkpoint_layout``), naming why;
            nothing is written and the model keeps its layout. As ``save_pretrained`` otherwise.
    """
    source = model.checkpoint_source
    if layout is not None and layout != source.description.format:
        recovery = (source.quantization_config or {}).get(RECOVERY_CONFIG_KEY)
        attach_checkpoint_layout(model, layout)
        if recovery is not None:
            new = model.checkpoint_source
            new.quantization_config = {**new.quantization_config, RECOVERY_CONFIG_KEY: recovery}
        model.mxlib_info = model.checkpoint_source.description
        model.save_pretrained = BoundToModel(_save_pretrained, model)
    save_pretrained(model, save_directory, *args, **kwargs)
