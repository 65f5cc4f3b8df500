"""llm-compressor NVFP4 fixture (compressed-tensors ``nvfp4-pack-quantized``)."""

from __future__ import annotations

import traceback
from pathlib import Path

import _common as C
import torch
from safetensors import safe_open

# fixture scheme -> the recipe's ignore list. llm-compressor's usual MoE recipe ignores only
# lm_head and the routers, so attention is quantized too; nvfp4_experts leaves it bf16.
SCHEMES = {
    "nvfp4": ["lm_head", "re:.*mlp.gate$"],
    "nvfp4_experts": ["lm_head", "re:.*mlp.gate$", "re:.*self_attn.*"],
}


def _dequant(f, name, scheme):
    """compressed-tensors' own ``NVFP4PackedCompressor.decompress`` of one exported weight."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor

    sd = {k: f.get_tensor(f"{name}.{k}") for k in ("weight_packed", "weight_scale", "weight_global_scale")}
    return NVFP4PackedCompressor.decompress(sd, scheme)["weight"]


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
    recipe = QuantizationModifier(targets="Linear", scheme="NVFP4", ignore=SCHEMES[scheme])
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
    qdq_module_name = None
    for name, mod in model.named_modules():
        if name.endswith("mlp.experts.0.gate_proj") and hasattr(mod, "input_global_scale"):
            qdq_module_name, qdq_module = name, mod
            break
    if qdq_module_name is None:
        for name, mod in model.named_modules():
            if hasattr(mod, "input_global_scale") and ".experts." in name:
                qdq_module_name, qdq_module = name, mod
                break
    x = C.qdq_input(torch.bfloat16)
    with torch.no_grad():
        y = forward_quantize(qdq_module, x, "input", qdq_module.quantization_scheme.input_activations)
    results["qdq.x"] = x
    results["qdq.y"] = y
    results["qdq.input_global_scale"] = qdq_module.input_global_scale.detach().float().reshape(())

    model.save_pretrained(str(ckpt), save_compressed=True)
    removed = C.clean_checkpoint(ckpt)
    import shutil

    shutil.rmtree(src)

    wscheme = preset_name_to_scheme("NVFP4", ["Linear"])
    dequant_names = [f"model.layers.{L}.mlp.experts.{e}.{p}" for L, e in C.DEQUANT_EXPERTS for p in C.PROJS]
    files = sorted(ckpt.glob("*.safetensors"))
    for path in files:
        with safe_open(str(path), "pt") as f:
            keys = set(f.keys())
            for name in dequant_names:
                if f"{name}.weight_packed" in keys:
                    results[f"dequant.{name}"] = _dequant(f, name, wscheme)
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
            recipe=f"QuantizationModifier(targets='Linear', scheme='NVFP4', ignore={SCHEMES[scheme]!r})",
            dequant=dict(
                function="compressed_tensors.compressors.nvfp4.base.NVFP4PackedCompressor.decompress("
                "{weight_packed, weight_scale, weight_global_scale}, preset NVFP4)",
                names=dequant_names,
            ),
            qdq=dict(
                kind="nvfp4",
                function="compressed_tensors.quantization.lifecycle.forward.forward_quantize(module, x, "
                "'input', args) (dynamic local block scales, input_global_scale as stored)",
                module=qdq_module_name,
            ),
            removed_from_export=removed,
            notes=notes,
        ),
    )
    return fixture


def make_all(outdir: Path, only=None) -> list[Path]:
    return [make_one(outdir, s) for s in SCHEMES if not only or s in only]
