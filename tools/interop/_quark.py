"""amd-quark OCP MX fixtures (LLMTemplate ``qwen3_moe`` schemes), plus one export made without
Quark's MoE preprocessing step."""

from __future__ import annotations

import traceback
from pathlib import Path

import _common as C
import torch

# fixture scheme name -> (LLMTemplate scheme, run preprocess_for_quantization, quantize attention).
# The qwen3_moe template excludes only lm_head and the routers (``*.gate``), so it quantizes
# q/k/v/o_proj too; the experts-only fixtures add ``*self_attn*`` to its exclude list.
SCHEMES = {
    "w_mxfp4_a_mxfp4": ("mxfp4", True, False),
    "w_mxfp6_e2m3_a_mxfp6_e2m3": ("mxfp6_e2m3", True, False),
    "w_mxfp4_a_fp8": ("mxfp4_fp8", True, False),
    "w_mxfp4_a_mxfp4_attn": ("mxfp4", True, True),
    "w_mxfp4_a_mxfp4_nopreprocess": ("mxfp4", False, False),
    "w_mxfp8_a_mxfp8": ("mxfp8", True, False),
    "w_mxfp4_a_mxfp8": ("mxfp4_mxfp8", True, False),
}
# schemes Quark 0.13's LLMTemplate does not list, registered from Quark's own OCP MX specs:
# template scheme -> (weight spec, activation spec) class names in quark.torch.quantization.config.config
CUSTOM_SCHEMES = {
    "mxfp8": ("OCP_MXFP8E4M3Spec", "OCP_MXFP8E4M3Spec"),
    "mxfp4_mxfp8": ("OCP_MXFP4Spec", "OCP_MXFP8E4M3Spec"),
}


def _register_custom(template_scheme: str) -> str | None:
    """Register a ``CUSTOM_SCHEMES`` scheme with ``LLMTemplate.register_scheme`` as Quark's built-in MX
    schemes are made (static weight spec, dynamic activation spec, ``ch_axis=-1``); returns a note."""
    if template_scheme not in CUSTOM_SCHEMES:
        return None
    from quark.torch import LLMTemplate
    from quark.torch.quantization.config import config as qcfg

    w_cls, a_cls = (getattr(qcfg, n) for n in CUSTOM_SCHEMES[template_scheme])
    layer = qcfg.QLayerConfig(
        weight=w_cls(ch_axis=-1, is_dynamic=False).to_quantization_spec(),
        input_tensors=a_cls(ch_axis=-1, is_dynamic=True).to_quantization_spec(),
    )
    LLMTemplate.register_scheme(template_scheme, config=layer)
    w_name, a_name = CUSTOM_SCHEMES[template_scheme]
    return (
        f"scheme {template_scheme!r} registered with LLMTemplate.register_scheme: QLayerConfig(weight="
        f"{w_name}(ch_axis=-1, is_dynamic=False), input_tensors={a_name}(ch_axis=-1, is_dynamic=True))"
    )


TEMPLATE_EXCLUDE = ["lm_head", "*.gate"]  # LLMTemplate.get("qwen3_moe")'s own list


def _find(model, suffix):
    for name, mod in model.named_modules():
        if name.endswith(suffix):
            return name, mod
    return None, None


def make_one(outdir: Path, scheme: str) -> Path:
    from quark.torch import LLMTemplate, ModelQuantizer, export_safetensors
    from quark.torch.utils.llm.model_preparation import preprocess_for_quantization
    from torch.utils.data import DataLoader

    template_scheme, preprocess, attention = SCHEMES[scheme]
    fixture = C.fresh_dir(outdir / f"quark_{scheme}")
    ckpt = fixture / "checkpoint"
    # without preprocessing the experts stay bf16: one layer keeps the file under 2 MB
    model = C.build_model(num_hidden_layers=None if preprocess else 1)
    ids_cal, ids_eval = C.calib_tokens(), C.eval_tokens()
    results = {"tokens.eval": ids_eval, "logits.bf16": C.logits(model, ids_eval)}
    notes = []

    if preprocess:
        preprocess_for_quantization(model)
    else:
        notes.append(
            "made WITHOUT quark.torch.utils.llm.model_preparation.preprocess_for_quantization: "
            "transformers' fused experts stay unquantized"
        )
    note = _register_custom(template_scheme)
    if note:
        notes.append(note)
    exclude = TEMPLATE_EXCLUDE if attention else [*TEMPLATE_EXCLUDE, "*self_attn*"]
    qconfig = LLMTemplate.get("qwen3_moe").get_config(scheme=template_scheme, exclude_layers=exclude)
    quantizer = ModelQuantizer(qconfig)
    model = quantizer.quantize_model(model, DataLoader(ids_cal, batch_size=ids_cal.shape[0]))

    # Quark's MX fake quantization of bf16/fp16 tensors calls a CUDA/HIP-only kernel (qdq_mxfp4);
    # for fp32 tensors it takes its pure-PyTorch path, which runs on the CPU: so the tool's
    # fake-quantized forward is recorded with the quantized model cast to fp32.
    try:
        import copy

        results["logits.tool"] = C.logits(copy.deepcopy(model).float(), ids_eval)
        notes.append(
            "logits.tool: Quark's fake-quantized forward (ModelQuantizer.quantize_model result) on the CPU, "
            "model cast to float32 (Quark's bf16 MX fake quant is CUDA/HIP only)"
        )
    except Exception as err:  # noqa: BLE001  a tool's own forward may fail on the CPU: recorded
        notes.append(f"logits.tool: not recorded: {type(err).__name__}: {str(err).splitlines()[0][:300]}")
        traceback.print_exc()

    # the tool's own activation QDQ: the input quantizer of layer 0 expert 0's gate_proj
    qdq_name, qdq_mod = _find(model, "layers.0.mlp.experts.0.gate_proj")
    if qdq_mod is None or getattr(qdq_mod, "input_quantizer", None) is None:
        qdq_name, qdq_mod = _find(model, "layers.0.self_attn.q_proj")
    x = C.qdq_input(torch.bfloat16)
    qdq_meta = {"module": qdq_name}
    if qdq_mod is not None and getattr(qdq_mod, "input_quantizer", None) is not None:
        with torch.no_grad():
            results["qdq.y"] = qdq_mod.input_quantizer(x.float())  # fp32: Quark's CPU path
        results["qdq.x"] = x
        iq = qdq_mod.input_quantizer
        qdq_meta["function"] = f"{qdq_name}.input_quantizer(x) ({type(iq).__name__})"
        sc = getattr(iq, "scale", None)
        if sc is not None and sc.numel() == 1:
            results["qdq.scale"] = sc.detach().reshape(())
    else:
        notes.append("qdq: no quantized expert or attention module with an input quantizer")

    # the tool's dequantized expert weights: each expert Linear's weight quantizer applied to its weight
    # (Quark's fake-quantize path, the values its real_quantized export encodes)
    dequant_names = [f"model.layers.{L}.mlp.experts.{e}.{p}" for L, e in C.DEQUANT_EXPERTS for p in C.PROJS]
    with torch.no_grad():
        for name in dequant_names:
            _, mod = _find(model, name)
            if mod is not None and getattr(mod, "weight_quantizer", None) is not None:
                results[f"dequant.{name}"] = mod.weight_quantizer(mod.weight.detach().float())
                if template_scheme in CUSTOM_SCHEMES and name.startswith("model.layers.0.mlp.experts.0."):
                    # the bf16 weight the tool quantized, for a writer comparison from the same input
                    results[f"weight.{name}"] = mod.weight.detach().clone()

    model = quantizer.freeze(model)
    export_safetensors(model, str(ckpt))
    removed = C.clean_checkpoint(ckpt)

    # and Quark's own reader: import the export and read back each dequantized weight
    try:
        from quark.torch import import_model_from_safetensors

        back = import_model_from_safetensors(None, str(ckpt), device="cpu")
        with torch.no_grad():
            for name in dequant_names[:3]:  # layer 0 expert 0 (kept small; dequant.* covers the rest)
                _, mod = _find(back, name)
                if mod is None:
                    continue
                w = _imported_dequant(mod)
                if w is not None:
                    results[f"dequant_import.{name}"] = w
            try:
                results["logits.tool_import"] = C.logits(back, ids_eval)
            except Exception as err:  # noqa: BLE001  a tool's own forward may fail on the CPU: recorded
                notes.append(f"logits.tool_import: {type(err).__name__}: {str(err).splitlines()[0][:200]}")
    except Exception as err:  # noqa: BLE001  a tool's own forward may fail on the CPU: recorded
        notes.append(
            f"dequant_import: Quark's import_model_from_safetensors failed: {type(err).__name__}: "
            f"{str(err).splitlines()[0][:300]}"
        )
        traceback.print_exc()

    C.write_results(
        fixture,
        results,
        dict(
            tool="amd-quark",
            scheme=scheme,
            template_scheme=template_scheme,
            preprocess=preprocess,
            format="quark",
            exclude_layers=exclude,
            versions=C.versions(["amd-quark"]),
            dequant=dict(
                function="QuantLinear.weight_quantizer(weight) after ModelQuantizer.quantize_model "
                "(dequant.*); QParamsLinear after import_model_from_safetensors (dequant_import.*)",
                names=dequant_names,
            ),
            qdq=qdq_meta,
            removed_from_export=removed,
            notes=notes,
        ),
    )
    return fixture


def _imported_dequant(mod):
    """The dequantized weight of a module that Quark's importer rebuilt from the packed export."""
    # QParamsLinear holds the packed uint8 weight; its weight quantizer (a StaticScaledRealQuantizer)
    # unpacks and dequantizes it, as QParamsLinear._get_qweight does in its forward
    wq = getattr(mod, "weight_quantizer", None)
    if wq is None or mod.weight.dtype != torch.uint8:
        return None
    return wq(mod.weight.data)


def make_all(outdir: Path, only=None) -> list[Path]:
    return [make_one(outdir, s) for s in SCHEMES if not only or s in only]
