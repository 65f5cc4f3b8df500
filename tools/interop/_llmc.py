"""llm-compressor fixtures: compressed-tensors ``nvfp4-pack-quantized``, ``mxfp4-pack-quantized`` and
``mxfp8-quantized`` (the ``NVFP4``, ``MXFP4``, ``MXFP4A16``, ``MXFP8`` and ``MXFP8A16`` presets)."""

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
# preset -> (compressor class path, the tensors its decompress reads)
_COMPRESSOR = {
    "NVFP4": (
        "compressed_tensors.compressors.nvfp4.base.NVFP4PackedCompressor",
        ("weight_packed", "weight_scale", "weight_global_scale"),
    ),
    "MXFP4": ("compressed_tensors.compressors.mxfp4.base.MXFP4PackedCompressor", ("weight_packed", "weight_scale")),
    "MXFP8": ("compressed_tensors.compressors.mxfp8.base.MXFP8QuantizationCompressor", ("weight", "weight_scale")),
}


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


def make_all(outdir: Path, only=None) -> list[Path]:
    return [make_one(outdir, s) for s in SCHEMES if not only or s in only]
