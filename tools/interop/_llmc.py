"""llm-compressor fixtures: compressed-tensors ``nvfp4-pack-quantized``, ``mxfp4-pack-quantized`` and
``mxfp8-quantized`` (the ``NVFP4``, ``MXFP4``, ``MXFP4A16``, ``MXFP8`` and ``MXFP8A16`` presets), and
mixed-precision exports from one ``oneshot`` whose ``QuantizationModifier`` has several ``config_groups``
(``MIXED``: routed experts in one preset, attention projections in another, ``lm_head`` in one of them)."""

from __future__ import annotations

import traceback
from pathlib import Path

import _common as C
import torch
from safetensors import safe_open

# fixture scheme -> (the recipe's preset, its ignore list). llm-compressor's usual MoE recipe ignores
# only lm_head and the routers, so attention is quantized too; the other fixtures leave it bf16.
_EXPERTS_ONLY = ["lm_head", "re:.*mlp.gate$", "re:.*self_attn.*"]
SCHEMES = {
    "nvfp4": ("NVFP4", ["lm_head", "re:.*mlp.gate$"]),
    "nvfp4_experts": ("NVFP4", _EXPERTS_ONLY),
    "mxfp4": ("MXFP4", _EXPERTS_ONLY),
    "mxfp4a16": ("MXFP4A16", _EXPERTS_ONLY),
    "mxfp8": ("MXFP8", _EXPERTS_ONLY),
    "mxfp8a16": ("MXFP8A16", _EXPERTS_ONLY),
}
# mixed fixture scheme -> the QuantizationModifier's config_groups as (preset, targets), in order. Every
# other Linear (the routers) matches no target and stays bf16; the export's ignore list names them.
_EXPERTS = r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"
_ATTENTION = r"re:.*self_attn\.(q|k|v|o)_proj$"
MIXED = {
    # FP8 attention (static per-tensor weights and activations) + NVFP4 experts + NVFP4 lm_head
    "mixed_fp8_nvfp4": (("NVFP4", [_EXPERTS, "lm_head"]), ("FP8", [_ATTENTION])),
    # MXFP8 attention and lm_head + MXFP4 experts
    "mixed_mxfp8_mxfp4": (("MXFP4", [_EXPERTS]), ("MXFP8", [_ATTENTION, "lm_head"])),
    # FP8_DYNAMIC attention and lm_head (per-channel weights, dynamic per-token activations) + NVFP4 experts
    "mixed_fp8dyn_nvfp4": (("NVFP4", [_EXPERTS]), ("FP8_DYNAMIC", [_ATTENTION, "lm_head"])),
}
SCHEMES.update({name: ("mixed", None) for name in MIXED})
# preset -> (compressor class path, the tensors its decompress reads)
_COMPRESSOR = {
    "NVFP4": (
        "compressed_tensors.compressors.nvfp4.base.NVFP4PackedCompressor",
        ("weight_packed", "weight_scale", "weight_global_scale"),
    ),
    "MXFP4": ("compressed_tensors.compressors.mxfp4.base.MXFP4PackedCompressor", ("weight_packed", "weight_scale")),
    "MXFP8": ("compressed_tensors.compressors.mxfp8.base.MXFP8QuantizationCompressor", ("weight", "weight_scale")),
    "FP8": (
        "compressed_tensors.compressors.naive_quantized.base.FloatQuantizationCompressor",
        ("weight", "weight_scale"),
    ),
}
_COMPRESSOR["FP8_DYNAMIC"] = _COMPRESSOR["FP8"]


def _compressor(preset):
    import importlib

    path, keys = _COMPRESSOR[preset.removesuffix("A16")]
    mod, cls = path.rsplit(".", 1)
    return getattr(importlib.import_module(mod), cls), keys, path


def _dequant(f, name, scheme, preset):
    """compressed-tensors' own compressor ``decompress`` of one exported weight."""
    cls, keys, _ = _compressor(preset)
    sd = {k: f.get_tensor(f"{name}.{k}") for k in keys}
    return cls.decompress(sd, scheme)["weight"]


def _tiny_tokenizer():
    """A word-level tokenizer over the tiny vocabulary (``t0`` .. ``t511``): llm-compressor wants a
    processor whenever a dataset is given, even a pre-tokenized one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(C.TINY_CONFIG["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t0", eos_token="t1", pad_token="t2")


def make_one(outdir: Path, scheme: str) -> Path:
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    preset, ignore = SCHEMES[scheme]
    if preset == "mixed":
        return make_mixed(outdir, scheme)
    fixture = C.fresh_dir(outdir / f"llmc_{scheme}")
    ckpt = fixture / "checkpoint"
    model = C.build_model()
    ids_cal, ids_eval = C.calib_tokens(), C.eval_tokens()
    results = {"tokens.eval": ids_eval, "logits.bf16": C.logits(model, ids_eval)}
    notes = []

    # oneshot re-reads the model's config from model.config.name_or_path: give it a folder
    src = fixture / "_bf16_source"
    model.save_pretrained(str(src))
    model.config._name_or_path = str(src)
    model.config.dtype = torch.bfloat16  # llm-compressor's linearized experts read it as a torch.dtype
    ds = Dataset.from_dict({"input_ids": ids_cal.tolist(), "attention_mask": torch.ones_like(ids_cal).tolist()})
    recipe = QuantizationModifier(targets="Linear", scheme=preset, ignore=ignore)
    oneshot(
        model=model,
        dataset=ds,
        recipe=recipe,
        processor=_tiny_tokenizer(),
        num_calibration_samples=ids_cal.shape[0],
        max_seq_length=ids_cal.shape[1],
        shuffle_calibration_samples=False,
    )

    try:
        results["logits.tool"] = C.logits(model, ids_eval)
        notes.append("logits.tool: the model after oneshot (compressed-tensors fake quantization in forward), CPU")
    except Exception as err:  # noqa: BLE001  a tool's own forward may fail on the CPU: recorded
        notes.append(f"logits.tool: not recorded: {type(err).__name__}: {str(err).splitlines()[0][:300]}")
        traceback.print_exc()

    # the tool's own activation QDQ: forward_quantize on the input of layer 0 expert 0's gate_proj
    # (NVFP4: with its calibrated input_global_scale; MX: dynamic E8M0 block scales)
    qdq_module_name = qdq_module = None
    for name, mod in model.named_modules():
        qs = getattr(mod, "quantization_scheme", None)
        if name.endswith("mlp.experts.0.gate_proj") and qs is not None and qs.input_activations is not None:
            qdq_module_name, qdq_module = name, mod
            break
    if qdq_module is not None:
        x = C.qdq_input(torch.bfloat16)
        with torch.no_grad():
            y = forward_quantize(qdq_module, x, "input", qdq_module.quantization_scheme.input_activations)
        results["qdq.x"] = x
        results["qdq.y"] = y
        if hasattr(qdq_module, "input_global_scale"):
            results["qdq.input_global_scale"] = qdq_module.input_global_scale.detach().float().reshape(())
    else:
        notes.append("qdq: weight-only preset, no activation quantization")

    # the bf16 weights the tool quantized (layer 0 expert 0), for a writer comparison from the same input
    if preset != "NVFP4":
        for name, mod in model.named_modules():
            if name.startswith("model.layers.0.mlp.experts.0.") and name.rsplit(".", 1)[-1] in C.PROJS:
                results[f"weight.{name}"] = mod.weight.detach().clone()

    model.save_pretrained(str(ckpt), save_compressed=True)
    removed = C.clean_checkpoint(ckpt)
    import shutil

    shutil.rmtree(src)

    wscheme = preset_name_to_scheme(preset, ["Linear"])
    first_key = _compressor(preset)[1][0]
    dequant_names = [f"model.layers.{L}.mlp.experts.{e}.{p}" for L, e in C.DEQUANT_EXPERTS for p in C.PROJS]
    files = sorted(ckpt.glob("*.safetensors"))
    for path in files:
        with safe_open(str(path), "pt") as f:
            keys = set(f.keys())
            for name in dequant_names:
                if f"{name}.{first_key}" in keys:
                    results[f"dequant.{name}"] = _dequant(f, name, wscheme, preset)
    missing = [n for n in dequant_names if f"dequant.{n}" not in results]
    if missing:
        notes.append(f"dequant: not found in the export: {missing}")

    C.write_results(
        fixture,
        results,
        dict(
            tool="llmcompressor",
            scheme=scheme,
            format="compressed-tensors",
            versions=C.versions(["llmcompressor", "compressed-tensors", "datasets"]),
            recipe=f"QuantizationModifier(targets='Linear', scheme={preset!r}, ignore={ignore!r})",
            dequant=dict(
                function=f"{_compressor(preset)[2]}.decompress({{{', '.join(_compressor(preset)[1])}}}, "
                f"preset {preset})",
                names=dequant_names,
            ),
            qdq=dict(
                kind=preset.lower(),
                function="compressed_tensors.quantization.lifecycle.forward.forward_quantize(module, x, "
                "'input', args) (dynamic local block scales, input_global_scale as stored where NVFP4)",
                module=qdq_module_name,
            ),
            removed_from_export=removed,
            notes=notes,
        ),
    )
    return fixture


def _oneshot(model, fixture, recipe):
    """Calibrate and quantize ``model`` with ``recipe`` on the fixed batch (as ``make_one``)."""
    from datasets import Dataset
    from llmcompressor import oneshot

    ids_cal = C.calib_tokens()
    # oneshot re-reads the model's config from model.config.name_or_path: give it a folder
    src = fixture / "_bf16_source"
    model.save_pretrained(str(src))
    model.config._name_or_path = str(src)
    model.config.dtype = torch.bfloat16  # llm-compressor's linearized experts read it as a torch.dtype
    ds = Dataset.from_dict({"input_ids": ids_cal.tolist(), "attention_mask": torch.ones_like(ids_cal).tolist()})
    oneshot(
        model=model,
        dataset=ds,
        recipe=recipe,
        processor=_tiny_tokenizer(),
        num_calibration_samples=ids_cal.shape[0],
        max_seq_length=ids_cal.shape[1],
        shuffle_calibration_samples=False,
    )
    return src


def make_mixed(outdir: Path, scheme: str) -> Path:
    """One ``oneshot`` whose ``QuantizationModifier`` has one config group per ``MIXED[scheme]`` entry
    (``preset_name_to_scheme(preset, targets)``); records the tool's own dequantization of modules of every
    group (experts of ``C.DEQUANT_EXPERTS``, layer 0's q/k/v/o_proj, ``lm_head``), its activation QDQ of each
    group's first module (``forward_quantize`` with the module's calibrated scales), its fake-quantized logits
    and the bf16 ones, and the bf16 weights of layer 0 expert 0, layer 0's q_proj and ``lm_head``."""
    import shutil

    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize
    from llmcompressor.modifiers.quantization import QuantizationModifier

    groups = MIXED[scheme]
    fixture = C.fresh_dir(outdir / f"llmc_{scheme}")
    ckpt = fixture / "checkpoint"
    model = C.build_model()
    ids_eval = C.eval_tokens()
    results = {"tokens.eval": ids_eval, "logits.bf16": C.logits(model, ids_eval)}
    notes = []

    attention = [f"model.layers.0.self_attn.{p}_proj" for p in "qkvo"]
    experts = [f"model.layers.{L}.mlp.experts.{e}.{p}" for L, e in C.DEQUANT_EXPERTS for p in C.PROJS]
    kept = {"model.layers.0.mlp.experts.0.gate_proj", "model.layers.0.mlp.experts.0.up_proj"}
    kept |= {"model.layers.0.mlp.experts.0.down_proj", "model.layers.0.self_attn.q_proj", "lm_head"}

    config_groups = {f"group_{n}": preset_name_to_scheme(p, list(t)) for n, (p, t) in enumerate(groups)}
    recipe = QuantizationModifier(config_groups=config_groups)
    src = _oneshot(model, fixture, recipe)

    try:
        results["logits.tool"] = C.logits(model, ids_eval)
        notes.append("logits.tool: the model after oneshot (compressed-tensors fake quantization in forward), CPU")
    except Exception as err:  # noqa: BLE001  a tool's own forward may fail on the CPU: recorded
        notes.append(f"logits.tool: not recorded: {type(err).__name__}: {str(err).splitlines()[0][:300]}")
        traceback.print_exc()

    # per module: the preset of the config group the tool attached to it (the scheme carries its group's targets)
    modules = dict(model.named_modules())
    presets = {}
    for name, mod in modules.items():
        qs = getattr(mod, "quantization_scheme", None)
        if qs is not None:
            presets[name] = next(p for p, t in groups if list(t) == list(qs.targets))
    # the tool's own activation QDQ: forward_quantize on the input of each group's first recorded module
    qdq = {}
    for name in ("model.layers.0.mlp.experts.0.gate_proj", "model.layers.0.self_attn.q_proj", "lm_head"):
        mod = modules[name]
        args = mod.quantization_scheme.input_activations
        if args is None:
            continue
        # the module's own width (the same values' first columns), shaped [1, rows, in] as the model's [batch,
        # seq, hidden] activations: compressed-tensors' dynamic TOKEN strategy reduces over the dims past the
        # first two, so a 2-D input would get one scale for the whole tensor
        x = C.qdq_input(torch.bfloat16)[:, : mod.in_features].contiguous()[None]
        with torch.no_grad():
            y = forward_quantize(mod, x, "input", args)
        results[f"qdq.x.{name}"] = x
        results[f"qdq.y.{name}"] = y
        for s in ("input_global_scale", "input_scale"):
            if hasattr(mod, s):
                results[f"qdq.{s}.{name}"] = getattr(mod, s).detach().float().clone()
        qdq[name] = presets[name]
    for name, mod in modules.items():
        if name in kept:
            results[f"weight.{name}"] = mod.weight.detach().clone()

    model.save_pretrained(str(ckpt), save_compressed=True)
    removed = C.clean_checkpoint(ckpt)
    shutil.rmtree(src)

    dequant = {}
    for path in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            keys = set(f.keys())
            for name in [*experts, *attention, "lm_head"]:
                preset = presets[name]
                cls, tkeys, cpath = _compressor(preset)
                if f"{name}.{tkeys[0]}" in keys:
                    sd = {k: f.get_tensor(f"{name}.{k}") for k in tkeys}
                    results[f"dequant.{name}"] = cls.decompress(sd, preset_name_to_scheme(preset, ["Linear"]))["weight"]
                    dequant[name] = f"{cpath}.decompress({{{', '.join(tkeys)}}}, preset {preset})"
    missing = [n for n in [*experts, *attention, "lm_head"] if f"dequant.{n}" not in results]
    if missing:
        notes.append(f"dequant: not found in the export: {missing}")

    groups_txt = ", ".join(f"'group_{n}': preset_name_to_scheme({p!r}, {list(t)!r})" for n, (p, t) in enumerate(groups))
    C.write_results(
        fixture,
        results,
        dict(
            tool="llmcompressor",
            scheme=scheme,
            format="compressed-tensors",
            versions=C.versions(["llmcompressor", "compressed-tensors", "datasets"]),
            recipe=f"QuantizationModifier(config_groups={{{groups_txt}}})",
            presets=presets,
            dequant=dict(functions=dequant),
            qdq=dict(
                function="compressed_tensors.quantization.lifecycle.forward.forward_quantize(module, x, 'input', "
                "args) with the module's calibrated input_global_scale / input_scale, dynamic scales otherwise; "
                "x is qdq_input's first in_features columns as [1, 4, in_features]",
                modules=qdq,
            ),
            removed_from_export=removed,
            notes=notes,
        ),
    )
    return fixture


def make_all(outdir: Path, only=None) -> list[Path]:
    return [make_one(outdir, s) for s in SCHEMES if not only or s in only]
