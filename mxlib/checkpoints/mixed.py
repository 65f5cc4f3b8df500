"""Writing a mixed-precision checkpoint from a bf16 model, in a producer's own mixed form.

``write_mixed_checkpoint(model, producer, experts=..., attention=..., lm_head=..., path=...)`` quantizes the
routed experts, the attention projections and ``lm_head`` each in its own scheme and writes them with the
tensor names of the producer's single-scheme layout of that scheme (``layouts/``), under the producer's mixed
config (the forms ``mxlib.checkpoints.precision`` reads):

* ``"modelopt"``: ``quant_algo: "MIXED_PRECISION"``, as nvidia-modelopt 0.47.0 exports it (checked against its
  own export in ``tests/test_interop_mixed_modelopt.py``): ``hf_quant_config.json``'s
  ``quantization.quantized_layers`` names every quantized module in the model's order with its ``{"quant_algo",
  "group_size"}`` (``group_size`` for the block formats NVFP4, W4A16_NVFP4 and MXFP8, as ModelOpt's
  ``process_layer_quant_config`` writes it): each attention projection, ``lm_head``, and each layer's experts
  module (``model.layers.L.mlp.experts``, the module holding the fused experts' quantizers; the tensors beneath it
  are per expert). ``config.json``'s ``quantization_config`` has one ``config_groups`` entry per distinct layer
  config (in order of first appearance) with the module names as ``targets``, plus ``quantized_layers``
  (``convert_hf_quant_config_format``). No exclude list: a module not named is unquantized. Layouts: ``modelopt``
  (NVFP4, W4A16_NVFP4), ``modelopt-mxfp8``, ``modelopt-fp8`` (``FP8``, ``FP8_PER_CHANNEL_PER_TOKEN``).
* ``"quark"``: the experts' scheme is ``global_quant_config``; attention and ``lm_head`` in other schemes are
  ``layer_quant_config`` entries (``*.self_attn.*``, ``lm_head``). Layouts ``quark``, ``quark-fp8`` (FP8 per
  tensor or per channel).
* ``"compressed-tensors"``: one ``config_groups`` entry per scheme, each with its own ``format``, ``targets`` the
  ``re:`` patterns of its parts (``re:.*mlp\\.experts\\.``, ``re:.*self_attn\\.``, ``lm_head``); the top-level
  ``format`` is ``mixed-precision`` where the groups' formats differ. Layouts: ``compressed-tensors`` (NVFP4),
  ``compressed-tensors-mxfp4``, ``compressed-tensors-mxfp8``, ``compressed-tensors-fp8`` (``float-quantized``).

Every other module is bf16 and, for Quark and compressed-tensors, named in the producer's exclude list
(``exclude`` / ``ignore``). The folder is written atomically (``safetensors_io.atomic_folder``): a failed write leaves
nothing. ``load_quantized_moe`` reads it back with each module in its own scheme, and ``save_pretrained`` writes it
again with the same tensors, bit for bit.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from ..models.calibration import Calibration
from ..models.families import check_supported_model, family_of
from ..models.moe_models import expert_weights
from ..moe.schemes import MoEQuantScheme, get_moe_scheme
from .files.safetensors_io import SHARD_BYTES, ShardWriter, atomic_folder
from .layout import CheckpointLayout
from .layouts import LAYOUTS
from .precision import CT_MIXED_FORMAT, MODELOPT_MIXED
from .writer import _config_dict, _stored_exactly, attention_linears, unquantized_modules, write_layer_experts

__all__ = ["write_mixed_checkpoint", "producer_layout", "PRODUCER_LAYOUTS"]

# the registered layout each producer stores a scheme in, by the scheme's name
PRODUCER_LAYOUTS: dict[str, dict[str, str]] = {
    "modelopt": {
        "nvfp4": "modelopt",
        "w4a16_nvfp4": "modelopt",
        "w_mxfp8_a_mxfp8": "modelopt-mxfp8",
        "w_fp8_a_fp8": "modelopt-fp8",
        "w_fp8_a_fp8_per_token": "modelopt-fp8",
    },
    # every OCP MX scheme: "quark" (``_layout``)
    "quark": {"w_fp8_a_fp8": "quark-fp8", "w_fp8_a_fp8_per_token": "quark-fp8"},
    "compressed-tensors": {
        "w_fp8_a_fp8": "compressed-tensors-fp8",
        "w_fp8_a_fp8_per_token": "compressed-tensors-fp8",
        "nvfp4": "compressed-tensors",
        "w_mxfp4": "compressed-tensors-mxfp4",
        "w_mxfp4_a_mxfp4": "compressed-tensors-mxfp4",
        "w_mxfp8": "compressed-tensors-mxfp8",
        "w_mxfp8_a_mxfp8": "compressed-tensors-mxfp8",
    },
}
# compressed-tensors targets and Quark name patterns of each part
# ModelOpt quant_algos whose quantized_layers entries carry group_size (the block size)
_MODELOPT_BLOCK_ALGOS = ("NVFP4", "W4A16_NVFP4", "MXFP8")
_CT_TARGETS = {"experts": r"re:.*mlp\.experts\.", "attention": r"re:.*self_attn\.", "lm_head": "lm_head"}
_QUARK_PATTERNS = {"attention": "*.self_attn.*", "lm_head": "lm_head"}


def producer_layout(producer: str, scheme: MoEQuantScheme, part: str) -> CheckpointLayout:
    """The registered layout ``producer``'s mixed checkpoints store ``scheme`` in (``PRODUCER_LAYOUTS``; Quark:
    every OCP MX scheme in ``quark``).

    Raises:
        ValueError: an unknown producer, or a scheme it does not store (the message begins with ``part``).
    """
    if producer not in PRODUCER_LAYOUTS:
        raise ValueError(f"producer: expected one of {list(PRODUCER_LAYOUTS)}, got {producer!r}")
    name = PRODUCER_LAYOUTS[producer].get(scheme.name, "quark" if producer == "quark" else None)
    if name is None or not LAYOUTS[name].handles(scheme):
        stores = sorted(PRODUCER_LAYOUTS[producer])
        if producer == "quark":
            stores = ["every OCP MX scheme", *stores]
        raise ValueError(f"{part}: {producer} mixed checkpoints store {stores}, got {scheme.name}")
    return LAYOUTS[name]


def _input_scale(layout, scheme, amax: dict | None, name: str, part: str):
    if not scheme.static_activation_scale:
        return None
    if amax is None or name not in amax:
        raise ValueError(
            f"{part}: {scheme.name} needs linear_input_amax for {name!r} (mxlib.moe.linear.linear_input_amax)"
        )
    a = amax[name]
    if not isinstance(a, torch.Tensor) or a.numel() != 1:
        got = f"shape {list(a.shape)}" if isinstance(a, torch.Tensor) else type(a).__name__
        raise ValueError(f"linear_input_amax[{name!r}]: expected a one-element tensor (the input's amax), got {got}")
    value = float(a)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"linear_input_amax[{name!r}]: expected a positive finite amax ({part} is {scheme.name}, a static input "
            f"scale amax / {scheme.activation.scale_divisor:g} that a load requires positive), got {value}"
        )
    return layout.stored_input_scale(a.float().reshape(()) / scheme.activation.scale_divisor)


def write_mixed_checkpoint(
    model,
    producer: str,
    path: str | os.PathLike,
    experts: str | MoEQuantScheme,
    attention: str | MoEQuantScheme | None = None,
    lm_head: str | MoEQuantScheme | None = None,
    calibration: Calibration | None = None,
    linear_input_amax: dict[str, torch.Tensor] | None = None,
    shard_bytes: int = SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Quantize a bf16 MoE model's experts, attention and ``lm_head`` each in its own scheme; write the
    producer's mixed-precision checkpoint (module docstring).

    Args:
        model: a transformers model of a registered family holding bf16 experts (no expert biases).
        producer: ``"modelopt"``, ``"quark"`` or ``"compressed-tensors"``.
        path: the checkpoint folder (absent, empty or an earlier mxlib checkpoint; else ``overwrite``).
        experts: the routed experts' scheme (every MoE layer).
        attention: the scheme of every ``self_attn`` linear layer, or None (bf16, excluded).
        lm_head: ``lm_head``'s scheme, or None (bf16, excluded). Tied embeddings cannot be quantized apart.
        calibration: per-expert activation amax (``mxlib.models.calibration.calibrate``), needed where the
            experts' scheme has static activation scales (NVFP4).
        linear_input_amax: ``{module name: amax}`` (``mxlib.moe.linear.linear_input_amax``), needed for the
            attention projections and ``lm_head`` where their scheme has static activation scales.
        shard_bytes, overwrite: as for ``write_quantized_checkpoint``.

    Returns:
        The folder's path; on any error nothing is left at ``path`` (or the old checkpoint stays).

    Raises:
        ValueError: an unknown producer, a scheme the producer does not store (naming the part and what it
            stores), a missing calibration or amax, a quantized ``lm_head`` of tied embeddings, a family whose
            experts have biases.
        FileExistsError: ``path`` holds something else, without ``overwrite``.
    """
    check_supported_model(model, "write_mixed_checkpoint")
    family = family_of(model, "write_mixed_checkpoint")
    if experts is None:
        raise ValueError("experts: expected the routed experts' scheme (a mixed checkpoint quantizes them), got None")
    if family.expert_biases:
        raise ValueError(f"model: {family.architecture}'s experts have biases, which mixed checkpoints do not store")
    plan = {"experts": experts, "attention": attention, "lm_head": lm_head}
    schemes = {}
    for part, name in plan.items():
        if name is not None:
            try:
                schemes[part] = get_moe_scheme(name)
            except ValueError as err:
                raise ValueError(f"{part}: {err}") from None
    layouts = {part: producer_layout(producer, s, part) for part, s in schemes.items()}
    if schemes["experts"].linear_only:
        raise ValueError(
            f"experts: {schemes['experts'].name} is a linear-layer scheme; the experts take the block-scaled schemes"
        )
    if "lm_head" in schemes and model.config.get_text_config().tie_word_embeddings:
        raise ValueError("lm_head: the model ties lm_head to the input embedding; it cannot be quantized apart")
    if schemes["experts"].static_activation_scale and calibration is None:
        raise ValueError(f"experts: {schemes['experts'].name} needs activation input scales: pass a Calibration")
    linears = {
        **{n: "attention" for n in (attention_linears(model) if "attention" in schemes else [])},
        **({"lm_head": "lm_head"} if "lm_head" in schemes else {}),
    }
    ins = {n: _input_scale(layouts[p], schemes[p], linear_input_amax, n, p) for n, p in linears.items()}
    with atomic_folder(path, overwrite=overwrite) as tmp:
        shards = ShardWriter(tmp, shard_bytes)
        experts_part = f".{family.block_attr}.{family.experts_attr}."
        for name, t in model.state_dict().items():
            if experts_part in name or name.rsplit(".", 1)[0] in linears:
                continue
            dtype = torch.float32 if family.keeps_fp32(name) else torch.bfloat16
            shards.add(family.disk_name(name), _stored_exactly(name, t.detach(), dtype))
        modules = dict(model.named_modules())
        for name, part in linears.items():
            layout, scheme = layouts[part], schemes[part]
            w = layout.quantize_linear(modules[name].weight.detach(), scheme)
            for n, t in layout.linear_tensors(scheme, w, ins[name], name).items():
                shards.add(family.disk_name(n), t, copy=True)
        scheme, layout = schemes["experts"], layouts["experts"]
        experts_modules = []
        for layer in family.moe_layer_indices(model.config):
            w13, w2 = expert_weights(model, layer)
            in13 = in2 = None
            if scheme.static_activation_scale:
                in13, in2 = calibration.input_scales(layer, scheme.activation)
            write_layer_experts(shards, family, layout, scheme, layer, w13, w2, None, in13, in2)
            experts_modules.append(family.experts_prefix(layer))
        shards.close()
        unquantized = unquantized_modules(model, family, list(linears))
        # every quantized module in the model's order (the order nvidia-modelopt lists them in)
        parts = {**{n: "experts" for n in experts_modules}, **linears}
        quantized = {family.disk_name(n): parts[n] for n, _ in model.named_modules() if n in parts}
        qc, extra = _configs(producer, schemes, layouts, quantized, family, unquantized)
        cfg = {**_config_dict(model, len(model.model.layers)), "quantization_config": qc}
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
        for fname, content in extra.items():
            (tmp / fname).write_text(json.dumps(content, indent=2))
    return Path(path)


def _configs(producer, schemes, layouts, quantized, family, unquantized) -> tuple[dict, dict]:
    """``(quantization_config, {extra file: content})`` in the producer's mixed form (``quantized``: on-disk
    module name -> part, in the model's order; the experts by their layer's experts module)."""
    single = {part: layouts[part].config_files(schemes[part], True) for part in schemes}
    if producer == "modelopt":
        per_part = {}
        for part, (qc, _) in single.items():
            algo = qc["quant_algo"]
            blocks = algo in _MODELOPT_BLOCK_ALGOS
            per_part[part] = {"quant_algo": algo, **({"group_size": schemes[part].weight.block_size} if blocks else {})}
        layers = {n: dict(per_part[p]) for n, p in quantized.items()}
        groups, by_cfg = {}, {}
        for name, cfg in layers.items():
            by_cfg.setdefault(json.dumps(cfg, sort_keys=True), (cfg, []))[1].append(name)
        for n, (cfg, names) in enumerate(by_cfg.values()):
            part = next(p for p in per_part if per_part[p] == cfg)
            group = {k: dict(v) for k, v in single[part][0]["config_groups"]["group_0"].items() if k != "targets"}
            if cfg["quant_algo"] == "MXFP8":  # nvidia-modelopt's mixed export writes its activations dynamic: false
                group["input_activations"]["dynamic"] = False
            groups[f"group_{n}"] = {**group, "targets": sorted(names)}
        producer_info = single["experts"][0]["producer"]
        qc = {
            "config_groups": groups,
            "quantized_layers": layers,
            "ignore": [],
            "quant_algo": MODELOPT_MIXED,
            "producer": producer_info,
            "quant_method": "modelopt",
        }
        legacy = {
            "producer": producer_info,
            "quantization": {"quant_algo": MODELOPT_MIXED, "kv_cache_quant_algo": None, "quantized_layers": layers},
        }
        return qc, {"hf_quant_config.json": legacy}
    if producer == "quark":
        qc = single["experts"][0]
        qc["layer_quant_config"] = {
            _QUARK_PATTERNS[p]: single[p][0]["global_quant_config"]
            for p in ("attention", "lm_head")
            if p in schemes and schemes[p] != schemes["experts"]
        }
        qc["exclude"] = list(unquantized)
        return qc, {}
    groups, formats = {}, {}
    for part in schemes:
        qc_part = single[part][0]
        key = schemes[part].name
        if key not in groups:
            group = dict(qc_part["config_groups"]["group_0"])
            formats[key] = qc_part["format"]
            groups[key] = {**group, "format": qc_part["format"], "targets": []}
        groups[key]["targets"].append(_CT_TARGETS[part])
    qc = dict(single["experts"][0])
    qc["config_groups"] = {f"group_{n}": g for n, g in enumerate(groups.values())}
    qc["format"] = next(iter(formats.values())) if len(set(formats.values())) == 1 else CT_MIXED_FORMAT
    qc["ignore"] = list(unquantized)
    return qc, {}
