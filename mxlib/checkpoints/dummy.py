"""A dummy-weight checkpoint in exactly the layout a real checkpoint's config files describe.

vLLM tested its emulation of this feature by loading the real model's repository with dummy
weights: the real ``config.json`` (and ``hf_quant_config.json``), random tensors. Here the same:
``dummy_checkpoint_from_config(config_dir, out_dir)`` reads only the config files, builds mxlib's
seeded dummy model of the config's family at its sizes (``mxlib.models.moe_models.dummy_moe_model``;
Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE, DeepSeek-V3: ``mxlib.models.families``), calibrates
it when the scheme has static activation scales, quantizes its experts and writes them with the
tensors of the layout the config names (looked up in the layout registry by ``quant_method``, so
every registered layout works, the ones added later included). Linear layers the config quantizes
(attention projections not in its ignore list) are written with the layout's ``linear_tensors``
where the layout has ``supports_linear``, their static input scales from the same calibration
forward. The config files are written back unchanged except for the sizes you override: the same
``quantization_config``, the same ignore / exclude lists, the same producer, the same
``hf_quant_config.json``.

An unquantized checkpoint's config (the model repository's own ``config.json``) names no scheme:
``scheme`` chooses one, written in ``layout`` (default: the scheme's, ``layout.DEFAULT_LAYOUT``), and the
written ``config.json`` gains that layout's ``quantization_config`` (and its extra files);
``dummy_quantization`` says what a folder of configs would be written as, before anything is built.

``num_hidden_layers`` cuts the model as vLLM's ``hf_overrides`` does; ``model_preset`` (a key of
``mxlib.models.qwen3.MODEL_PRESETS``: ``small``, ``tiny``) and ``overrides`` shrink hidden size,
experts and vocabulary so that tests never build a full-size model.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from tqdm import tqdm

from ..models.calibration import calibrate
from ..models.families import MoEFamily, check_supported_checkpoint
from ..models.hessians import technique_from_calibration, technique_needs_hessians
from ..models.moe_models import dummy_moe_model, expert_weights, tied_parameter_names
from ..moe.factory import quantize_expert_weights
from ..moe.schemes import MOE_SCHEMES, MoEQuantScheme, get_moe_scheme
from ..recovery import RECOVERY_CONFIG_KEY, WeightTechnique, get_technique
from ..recovery.base import technique_global_scale_kw
from .bounds import model_config
from .files import untrusted
from .files.folder import CheckpointFolder
from .files.headers import open_regular
from .files.safetensors_io import SHARD_BYTES, atomic_folder, write_shards
from .files.untrusted import MAX_DUMMY_LAYERS, model_bytes
from .inspect import config_description
from .layout import PROJS, CheckpointDescription, CheckpointError, matches
from .layouts import LAYOUTS, layout_for_scheme  # the registry with mxlib's layouts registered
from .writer import unquantized_modules

__all__ = [
    "dummy_checkpoint_from_config",
    "dummy_quantization",
    "dummy_config",
    "COPIED_FILES",
    "copy_model_files",
    "MAX_DUMMY_LAYERS",
    "model_bytes",
]

logger = logging.getLogger(__name__)

# what is copied from the config folder besides config.json (and the layouts' legacy config files): the
# files of a model repository that describe it, each a regular file of at most MAX_COPIED_BYTES
COPIED_FILES = (
    "generation_config.json",
    "tokenizer_config.json",
    "tokenizer.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.txt",
)
MAX_COPIED_BYTES = 64 * 2**20


def copy_model_files(src: Path, dst: Path, names: tuple[str, ...] | None = None) -> list[str]:
    """Copy ``names`` (default ``COPIED_FILES`` and the layouts' legacy config files) that ``src`` holds and
    ``dst`` does not, unchanged; returns the names copied.

    Raises:
        CheckpointError: one of them is not a regular file or is larger than ``MAX_COPIED_BYTES`` (naming it).
    """
    if names is None:
        names = (*COPIED_FILES, *(f for lay in LAYOUTS.values() for f in lay.legacy_files))
    copied = []
    for name in names:
        f = Path(src) / name
        if (f.exists() or f.is_symlink()) and not (Path(dst) / name).exists():
            with open_regular(f) as fh:  # a regular file only, of at most MAX_COPIED_BYTES
                data = fh.read(MAX_COPIED_BYTES + 1)
            if len(data) > MAX_COPIED_BYTES:
                raise CheckpointError(f"{f}: larger than {MAX_COPIED_BYTES} bytes; not copied")
            (Path(dst) / name).write_bytes(data)
            copied.append(name)
    return copied


def dummy_config(
    config_dir: str | os.PathLike,
    num_hidden_layers: int | None = None,
    model_preset: str | None = None,
    overrides: dict | None = None,
    source: dict | None = None,
) -> tuple[Path, dict, dict, dict]:
    """``mxlib.checkpoints.files.untrusted.dummy_config`` with ``CheckpointError`` for a refused file or field
    (``source``: ``config.json``'s dict when the caller has read it, as there)."""
    return untrusted.dummy_config(config_dir, num_hidden_layers, model_preset, overrides, CheckpointError, source)


def _linear_modules(model, family: MoEFamily) -> list[str]:
    """Non-expert modules stored as 2-D ``.weight`` (attention projections, routers, shared experts, dense
    MLPs, ``lm_head`` unless it is the tied embedding)."""
    tied = tied_parameter_names(model)
    experts_part = f".{family.block_attr}.{family.experts_attr}."
    return [
        n[: -len(".weight")]
        for n, p in model.state_dict().items()
        if n.endswith(".weight") and p.ndim == 2 and experts_part not in n and "embed_tokens" not in n and n not in tied
    ]


def _record_amax(amax: dict, name: str):
    def hook(module, args):
        amax[name] = torch.maximum(amax[name], args[0].detach().abs().amax().float().cpu())

    return hook


def dummy_quantization(
    config_dir: str | os.PathLike, scheme: str | MoEQuantScheme | None = None, layout: str | None = None
) -> tuple[CheckpointDescription, tuple[dict, dict[str, dict]] | None]:
    """What ``dummy_checkpoint_from_config`` writes for the configs in ``config_dir``, read from the
    config files only (no model is built).

    Args:
        config_dir: a folder with a ``config.json``, quantized (``quantization_config`` or a legacy
            file such as ``hf_quant_config.json``) or not.
        scheme: for an unquantized config, the scheme to write (a ``MOE_SCHEMES`` name or object);
            for a quantized one, None or the config's own scheme.
        layout: for an unquantized config, a ``LAYOUTS`` name (None: the scheme's default layout);
            for a quantized one, None or the config's own layout.

    Returns:
        ``(description, files)``: the ``CheckpointDescription`` of the checkpoint to write, and
        ``files``: None when the config carries its quantization, else ``(quantization_config,
        {extra file name: JSON object})`` of ``scheme`` in ``layout``, which the written folder gains.

    Raises:
        CheckpointError: no ``config.json``; a ``config.json`` of a family mxlib does not quantize
            (``mxlib.models.families``); an unquantized config and no ``scheme``; a quantization
            config that no registered layout reads or the emulation does not support.
        ValueError: an unknown ``scheme`` or ``layout``; a layout that does not store the scheme; a
            ``scheme`` or ``layout`` other than the quantized config's own.
    """
    config_dir = CheckpointFolder.of(config_dir)  # each config file read once
    check_supported_checkpoint(config_dir, "dummy_quantization", config_dir.read_json, CheckpointError)
    cfg_path = config_dir / "config.json"
    if not (cfg_path.exists() or cfg_path.is_symlink()):
        raise CheckpointError(f"config_dir: {config_dir} has no config.json")
    quantized = config_dir.config().get("quantization_config") is not None or any(
        lay.read_legacy(config_dir) is not None for lay in LAYOUTS.values()
    )
    if quantized:
        info = config_description(config_dir)
        if scheme is not None and get_moe_scheme(scheme) != info.scheme:
            raise ValueError(
                f"scheme: {cfg_path} is quantized as {info.scheme.name} ({info.format} layout); expected None "
                f"or {info.scheme.name!r}, got {getattr(scheme, 'name', scheme)!r}"
            )
        if layout is not None and layout != info.format:
            raise ValueError(f"layout: {cfg_path} is in the {info.format} layout; expected None or it, got {layout!r}")
        return info, None
    if scheme is None:
        raise CheckpointError(
            f"{cfg_path}: an unquantized config (no quantization_config, no legacy quantization config file) "
            f"names no scheme; choose one with scheme= (mxlib dummy-from-config --scheme): {list(MOE_SCHEMES)}"
        )
    s = get_moe_scheme(scheme)
    if layout is None:
        lay = layout_for_scheme(s)
    elif layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {list(LAYOUTS)}, got {layout!r}")
    else:
        lay = LAYOUTS[layout]
        if not lay.handles(s):
            raise ValueError(f"layout: {lay.name} does not store scheme {s.name}")
    qc, extra = lay.config_files(s)
    return lay.read_config(qc), (qc, extra)


def dummy_checkpoint_from_config(
    config_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    num_hidden_layers: int | None = None,
    seed: int = 0,
    model_preset: str | None = None,
    overrides: dict | None = None,
    calib_tokens: int = 64,
    expert_spread: float = 0.0,
    shard_bytes: int = SHARD_BYTES,
    scheme: str | MoEQuantScheme | None = None,
    layout: str | None = None,
    progress: bool = False,
    technique: str | WeightTechnique | None = None,
) -> Path:
    """Write a dummy-weight checkpoint in the layout of the config files in ``config_dir``.

    Args:
        config_dir: a folder with a real checkpoint's ``config.json`` (with or without
            ``quantization_config``) and any legacy quantization file (``hf_quant_config.json``);
            no weights are needed.
        out_dir: the checkpoint folder to write (replaced if it exists).
        num_hidden_layers: keep this many layers (default: the config's).
        seed: seeds the weights and the calibration token ids.
        model_preset: shrink the model to a ``MODEL_PRESETS`` size (``"small"``, ``"tiny"``) for tests.
        overrides: further config fields to replace (e.g. ``{"num_experts": 8}``); win over the preset.
        calib_tokens: token ids that calibrate static activation scales (NVFP4, ``_a_fp8``) and give GPTQ its
            per-expert Hessians (``technique="gptq"``).
        expert_spread: ``dummy_moe_model``'s per-expert scale spread.
        shard_bytes: safetensors shard size.
        scheme, layout: the scheme (and layout) of an unquantized config (``dummy_quantization``).
        progress: tqdm bars on stderr for calibrating and quantizing the experts.
        technique: how the experts' scales and codes are chosen (``mxlib.recovery``, as
            ``write_quantized_checkpoint``'s); None is the layout's round-to-nearest.

    Returns:
        ``out_dir`` as a ``Path``, loadable with ``load_quantized_moe``. Its ``config.json``
        is the source's with ``num_hidden_layers`` and the overrides applied; of the other files of
        ``config_dir`` only the layouts' legacy config files and ``COPIED_FILES`` are copied, unchanged
        (regular files of at most 64 MiB; anything else there is left out), and for an unquantized
        config ``scheme``'s ``quantization_config`` and the layout's extra files are added. With
        ``tie_word_embeddings`` the head is the embedding and ``lm_head.weight`` is not stored.

    Raises:
        CheckpointError: no ``config.json``; a ``config.json`` of a family mxlib does not quantize
            (``mxlib.models.families``); an unquantized config without ``scheme``; a quantization
            config no registered layout reads or the emulation does not support (the message names
            the field); a config that quantizes modules other than the MoE experts when the layout
            writes no quantized linear layers (``supports_linear`` false), or quantizes modules that
            are not ``nn.Linear`` (the routers).
        CheckpointError: a config ``untrusted.dummy_config`` refuses (the loader's field rules, a layer count
            above ``MAX_DUMMY_LAYERS``, a model larger than this machine's memory), checked before
            anything is built; a copied file that is not a regular file.
        ValueError: ``num_hidden_layers`` not in ``1..config's``; an unknown ``model_preset``; a
            ``scheme`` or ``layout`` ``dummy_quantization`` refuses.
    """
    config_dir = CheckpointFolder(config_dir)  # each config file read once, whatever the steps reading it
    family = check_supported_checkpoint(
        config_dir, "dummy_checkpoint_from_config", config_dir.read_json, CheckpointError
    )
    info, files = dummy_quantization(config_dir, scheme, layout)
    layout = LAYOUTS[info.format]
    scheme = info.scheme
    # GPTQ reads per-expert Hessians of the calibration tokens, which exist once the model does
    needs_hessians = technique_needs_hessians(technique)
    named = technique
    technique = None if technique is None or needs_hessians else get_technique(technique)
    cfg_path, source, changes, cfg_dict = dummy_config(
        config_dir, num_hidden_layers, model_preset, overrides, source=config_dir.config()
    )
    config = model_config(cfg_dict, cfg_path, family)

    model = dummy_moe_model(config, seed=seed, expert_spread=expert_spread, where="dummy_checkpoint_from_config")
    if files is not None:  # the chosen layout's config (attention bf16): every bf16 module in its exclude list
        layout.add_excluded(files[0], files[1], unquantized_modules(model, family, []))
        info = layout.read_config(files[0])
    ids = torch.randint(0, config.vocab_size, (1, calib_tokens), generator=torch.Generator().manual_seed(seed + 1))
    if needs_hessians:
        technique = technique_from_calibration(model, named, ids, progress=progress, where="technique")
    technique_kw = {} if technique is None else technique_global_scale_kw(technique, scheme, layout.global_scale_kind)
    modules = dict(model.named_modules())
    quantized_linears = [m for m in _linear_modules(model, family) if not matches(family.disk_name(m), info.exclude)]
    # a layout that stores quantized linear layers (attention) has supports_linear; their weights are
    # quantized by the layout's quantize_linear (default: the factory's quantize_linear_weight)
    not_linear = [m for m in quantized_linears if not isinstance(modules.get(m), torch.nn.Linear)]
    if quantized_linears and (not_linear or not layout.supports_linear):
        what = (
            f"{', '.join(not_linear[:4])}, which are not nn.Linear layers"
            if not_linear
            else f"e.g. {', '.join(quantized_linears[:4])}; this mxlib's {layout.name} layout writes quantized "
            f"experts only"
        )
        raise CheckpointError(
            f"{cfg_path}: the quantization config quantizes {len(quantized_linears)} modules outside the MoE experts "
            f"(not in its ignore/exclude list: {what})"
        )
    moe = family.moe_layer_indices(config)
    excluded_layers = [
        layer
        for layer in moe
        if all(matches(family.disk_name(f"{family.experts_prefix(layer)}.0.{p}"), info.exclude) for p in PROJS)
    ]
    calibration = None
    linear_amax = {m: torch.zeros((), dtype=torch.float32) for m in quantized_linears}
    if scheme.static_activation_scale:
        hooks = [modules[m].register_forward_pre_hook(_record_amax(linear_amax, m)) for m in quantized_linears]
        try:
            calibration = calibrate(
                model, ids, progress=progress
            )  # the same forward also records the linear layers' input amax
        finally:
            for hook in hooks:
                hook.remove()

    tied = tied_parameter_names(model)  # lm_head.weight of tied embeddings: stored once, as transformers does
    with atomic_folder(out_dir) as tmp:
        experts_part = f".{family.block_attr}.{family.experts_attr}."
        state = {  # under the state dict's names here, the family's on-disk names when written
            n: t.detach().to(torch.float32 if family.keeps_fp32(n) else torch.bfloat16).contiguous()
            for n, t in model.state_dict().items()
            if experts_part not in n and n.rsplit(".", 1)[0] not in linear_amax and n not in tied
        }
        for m in quantized_linears:
            ins = None
            if scheme.static_activation_scale:
                ins = layout.stored_input_scale(linear_amax[m] / scheme.activation.scale_divisor)
            state.update(
                layout.linear_tensors(scheme, layout.quantize_linear(modules[m].weight.detach(), scheme), ins, m)
            )
        logger.info("writing dummy %s checkpoint (%s layout) to %s", scheme.name, layout.name, out_dir)
        for layer in tqdm(moe, desc="quantizing experts", unit="layer", disable=not progress):
            w13, w2 = expert_weights(model, layer)
            prefix = family.experts_prefix(layer)
            if layer in excluded_layers:  # bf16 experts under their per-expert names
                i = w2.shape[2]
                for x in range(w13.shape[0]):
                    for proj, w in (("gate_proj", w13[x, :i]), ("up_proj", w13[x, i:]), ("down_proj", w2[x])):
                        state[f"{prefix}.{x}.{proj}.weight"] = w.to(torch.bfloat16).contiguous()
                continue
            # a layout with its own arithmetic (compressed-tensors' encode scales) quantizes its experts itself
            if technique is not None:
                weights = technique.quantize_experts(w13, w2, scheme, layer=layer, **technique_kw)
            else:
                weights = layout.quantize_experts(w13, w2, scheme)
            if weights is None:
                weights = quantize_expert_weights(w13, w2, scheme)
            in13 = in2 = None
            if calibration is not None:
                in13, in2 = (layout.stored_input_scale(t) for t in calibration.input_scales(layer, scheme.activation))
            state.update(layout.expert_tensors(scheme, weights, in13, in2, prefix))
        write_shards({family.disk_name(n): t for n, t in state.items()}, tmp, shard_bytes)
        out_cfg = dict(source)
        out_cfg["num_hidden_layers"] = config.num_hidden_layers
        out_cfg.update(changes)
        extra = {}
        if files is not None:  # an unquantized config: the chosen scheme's quantization config (family excludes added)
            out_cfg["quantization_config"], extra = files
        if technique is not None and technique.config():
            out_cfg["quantization_config"] = {
                **out_cfg["quantization_config"],
                RECOVERY_CONFIG_KEY: {"technique": technique.name, **technique.config()},
            }
        (tmp / "config.json").write_text(json.dumps(out_cfg, indent=2))
        names = (*COPIED_FILES, *(f for lay in LAYOUTS.values() for f in lay.legacy_files))
        copy_model_files(config_dir, tmp, tuple(n for n in names if n not in extra))
        for fname, content in extra.items():
            (tmp / fname).write_text(json.dumps(content, indent=2))
    return Path(out_dir)
