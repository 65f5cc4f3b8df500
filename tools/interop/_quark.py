"""amd-quark OCP MX fixtures (LLMTemplate ``qwen3_moe`` schemes), one export made without Quark's MoE
preprocessing step, and mixed-precision exports (Quark's per-layer ``layer_quant_config``)."""

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
    # mixed precision: the global scheme for the experts, LAYER_CONFIGS / LAYER_TYPE_CONFIGS for attention and
    # lm_head. The MXFP8 one quantizes but does not export, as w_mxfp8_a_mxfp8 (tools/interop/README.md)
    "mixed_w_mxfp4_a_mxfp4_fp8_attn": ("mxfp4", True, True),
    "mixed_w_mxfp4_a_mxfp4_mxfp8_attn": ("mxfp4", True, True),
    "mixed_w_mxfp4_a_mxfp4_fp8_linear_type": ("mxfp4", True, True),
    "mixed_w_mxfp4_a_mxfp4_fp8_attn_kv_fp8": ("mxfp4", True, True),
    "mixed_w_mxfp4_a_mxfp4_ptpc_fp8_attn": ("mxfp4", True, True),
}
# mixed fixtures: LLMTemplate.get_config(layer_config=...), name pattern -> template scheme. The routed experts
# keep the global scheme; the attention projections and lm_head take their own (Quark's
# QConfig.layer_quant_config, matched by fnmatch before the global config).
LAYER_CONFIGS = {
    "mixed_w_mxfp4_a_mxfp4_fp8_attn": {"*.self_attn.*": "fp8", "lm_head": "fp8"},
    "mixed_w_mxfp4_a_mxfp4_mxfp8_attn": {"*.self_attn.*": "mxfp8", "lm_head": "mxfp8"},
    "mixed_w_mxfp4_a_mxfp4_fp8_linear_type": {"*.mlp.experts.*": "mxfp4"},
    "mixed_w_mxfp4_a_mxfp4_fp8_attn_kv_fp8": {"*.self_attn.*": "fp8", "lm_head": "fp8"},
    # the template's PTPC FP8 (per-channel weights, dynamic per-token inputs), as Quark's MXFP4 + FP8-attention
    # model cards apply it (layer_config={"*self_attn*": "ptpc_fp8"})
    "mixed_w_mxfp4_a_mxfp4_ptpc_fp8_attn": {"*self_attn*": "ptpc_fp8", "lm_head": "ptpc_fp8"},
}
# and LLMTemplate.get_config(kv_cache_scheme=...): FP8 KV cache, the outputs of k_proj / v_proj quantized
KV_CACHE_SCHEMES = {"mixed_w_mxfp4_a_mxfp4_fp8_attn_kv_fp8": "fp8"}
# and LLMTemplate.get_config(layer_type_config=...), torch.nn class name -> template scheme (Quark's
# QConfig.layer_type_quant_config, below the name patterns and above the global config): every Linear that no
# name pattern claims (attention, lm_head) in FP8
LAYER_TYPE_CONFIGS = {"mixed_w_mxfp4_a_mxfp4_fp8_linear_type": {"Linear": "fp8"}}
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
MIXED_EXCLUDE = ["*.gate"]  # the routers only: lm_head is quantized by its layer_quant_config entry
# the attention projections and lm_head whose tool results a mixed fixture records (dequant.*), and the ones
# it also keeps the bf16 weight and the importer's dequantization of (weight.*, dequant_import.*: under 2 MB a file)
MIXED_LINEARS = [f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")] + ["lm_head"]
MIXED_IMPORTED = ["model.layers.0.self_attn.q_proj", "lm_head"]


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
    layer_config = LAYER_CONFIGS.get(scheme)
    type_config = LAYER_TYPE_CONFIGS.get(scheme)
    per_token = "ptpc_fp8" in (layer_config or {}).values()
    for s in dict.fromkeys([template_scheme, *(layer_config or {}).values(), *(type_config or {}).values()]):
        note = _register_custom(s)
        if note:
            notes.append(note)
    if layer_config:
        exclude = MIXED_EXCLUDE
    else:
        exclude = TEMPLATE_EXCLUDE if attention else [*TEMPLATE_EXCLUDE, "*self_attn*"]
    qconfig = LLMTemplate.get("qwen3_moe").get_config(
        scheme=template_scheme,
        exclude_layers=exclude,
        layer_config=layer_config,
        layer_type_config={getattr(torch.nn, k): v for k, v in type_config.items()} if type_config else None,
        kv_cache_scheme=KV_CACHE_SCHEMES.get(scheme),
    )
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
    if layer_config:
        if per_token:
            # Quark's PTPC input quantizer (per_channel, ch_axis 1) on a [batch, seq, hidden] input takes one scale per
            # position across the batch; one sequence at a time it is per token, as vLLM runs it
            results["logits.tool_export_codes_per_sequence"] = torch.cat(
                [_logits_with_export_codes(model, ids_eval[i : i + 1], layer_config, type_config) for i in range(2)]
            )
            notes.append(
                "logits.tool_export_codes_per_sequence: Quark's fp32 forward of the exported FP8 weights, one "
                "sequence at a time (its ptpc_fp8 input quantizer, per_channel with ch_axis 1, is per token only for "
                "a batch of one)"
            )
        else:
            results["logits.tool_export_codes"] = _logits_with_export_codes(model, ids_eval, layer_config, type_config)
            notes.append(
                "logits.tool_export_codes: the same fp32 fake-quantized forward with each per-tensor FP8 layer's "
                "weight set to the codes Quark's export writes (real_quantize_fp8_e4m3_per_tensor_with_scale on the "
                "bf16 weight and scale, which divides in bf16) times its scale: Quark's fake quantization of the fp32 "
                "weight divides in fp32 and rounds some weights to the neighbouring e4m3 code"
            )

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
    if layer_config:  # each per-layer group's own input quantizer, on the same input
        for name in (MIXED_LINEARS[0], MIXED_LINEARS[-1]):
            _, mod = _find(model, name)
            iq = getattr(mod, "input_quantizer", None)
            if iq is None:
                notes.append(f"qdq.{name}: no input quantizer")
                continue
            with torch.no_grad():
                results[f"qdq.{name}.y"] = iq(x.float())
                if per_token:  # the same rows as one sequence of a batch of one: ch_axis 1 is then the token axis
                    results[f"qdq.{name}.y_tokens"] = iq(x.float()[None])[0]
            sc = getattr(iq, "scale", None)
            if sc is not None and sc.numel() == 1:
                results[f"qdq.{name}.scale"] = sc.detach().reshape(())
            qdq_meta[name] = f"{name}.input_quantizer(x) ({type(iq).__name__})"

    # the tool's dequantized expert weights: each expert Linear's weight quantizer applied to its weight
    # (Quark's fake-quantize path, the values its real_quantized export encodes)
    dequant_names = [f"model.layers.{L}.mlp.experts.{e}.{p}" for L, e in C.DEQUANT_EXPERTS for p in C.PROJS]
    if layer_config:
        dequant_names += MIXED_LINEARS
    with torch.no_grad():
        for name in dequant_names:
            _, mod = _find(model, name)
            if mod is not None and getattr(mod, "weight_quantizer", None) is not None:
                results[f"dequant.{name}"] = mod.weight_quantizer(mod.weight.detach().float())
                if (template_scheme in CUSTOM_SCHEMES and name.startswith("model.layers.0.mlp.experts.0.")) or (
                    layer_config and name in MIXED_IMPORTED
                ):
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
            # layer 0 expert 0 (kept small; dequant.* covers the rest); a mixed fixture: its gate_proj and linear layers
            imported = [dequant_names[0], *MIXED_IMPORTED] if layer_config else dequant_names[:3]
            for name in imported:
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
            layer_config=layer_config,
            layer_type_config=type_config,
            kv_cache_scheme=KV_CACHE_SCHEMES.get(scheme),
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


def _template_scheme_of(name, module, layer_config, type_config):
    """The template scheme Quark gives a module: the first matching name pattern, else its class's entry
    (quark.torch.export.main_export.quant_config_parser.get_layer_quant_config's order)."""
    import fnmatch

    for pattern, scheme in (layer_config or {}).items():
        if fnmatch.fnmatch(name, pattern):
            return scheme
    for cls, scheme in (type_config or {}).items():
        if isinstance(module, getattr(torch.nn, cls)):
            return scheme
    return None


def _logits_with_export_codes(model, ids, layer_config, type_config=None):
    """Quark's fp32 fake-quantized forward (as ``logits.tool``) with the weight of every FP8 layer (by
    ``layer_config`` / ``type_config``) replaced by ``codes * scale``, the codes made by Quark's own export function
    from the bf16 weight and bf16 scale (its freeze path; the values the export holds). A weight on the e4m3 grid
    of its scale passes the fake quantizer unchanged, so the forward runs with the exported weights."""
    import copy

    from quark.torch.kernel.hw_emulation.hw_emulation_interface import (
        real_quantize_fp8_e4m3_per_channel_with_scale,
        real_quantize_fp8_e4m3_per_tensor_with_scale,
    )

    fq = copy.deepcopy(model).float()
    fq_modules = dict(fq.named_modules())
    with torch.no_grad():
        for name, mod in model.named_modules():  # the bf16 model, as the export quantizes it
            wq = getattr(mod, "weight_quantizer", None)
            scheme = _template_scheme_of(name, mod, layer_config, type_config)
            if wq is None or scheme not in ("fp8", "ptpc_fp8"):
                continue
            if scheme == "fp8":
                codes = real_quantize_fp8_e4m3_per_tensor_with_scale(mod.weight.detach(), wq.scale)
                scale = wq.scale.float()
            else:  # per output channel (ch_axis 0)
                codes = real_quantize_fp8_e4m3_per_channel_with_scale(mod.weight.detach(), wq.scale, 0)
                scale = wq.scale.float().reshape(-1, 1)
            fq_modules[name].weight.data = codes.float() * scale  # exact in fp32
    return C.logits(fq, ids)


def _imported_dequant(mod):
    """The dequantized weight of a module that Quark's importer rebuilt from the packed export."""
    # QParamsLinear holds the packed uint8 weight; its weight quantizer (a StaticScaledRealQuantizer)
    # unpacks and dequantizes it, as QParamsLinear._get_qweight does in its forward
    wq = getattr(mod, "weight_quantizer", None)
    if wq is None or mod.weight.dtype not in (torch.uint8, torch.float8_e4m3fn):
        return None
    return wq(mod.weight.data)


def make_all(outdir: Path, only=None) -> list[Path]:
    return [make_one(outdir, s) for s in SCHEMES if not only or s in only]
