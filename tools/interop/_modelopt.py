"""nvidia-modelopt fixtures: NVFP4 (the experts-only and the default config, attention too), weight-only
NVFP4 (``W4A16_NVFP4``), MXFP8, and two mixed-precision exports (``quant_algo: MIXED_PRECISION``): NVFP4
experts with FP8 per-tensor attention and an NVFP4 ``lm_head``, and NVFP4 experts with MXFP8 attention."""

from __future__ import annotations

import json
import traceback
from pathlib import Path

import _common as C
import torch
from safetensors import safe_open

SCHEMES = {
    "nvfp4_experts": "NVFP4_EXPERTS_ONLY_CFG",
    "nvfp4_default": "NVFP4_DEFAULT_CFG",
    # these two with the attention quantizers disabled (experts only). NVFP4_MLP_WEIGHT_ONLY_CFG is not
    # used: it quantizes in blocks of 32 (exported as W4A16_NVFP4 with group_size 32)
    "w4a16_nvfp4": "W4A16_NVFP4_CFG",
    "mxfp8": "MXFP8_DEFAULT_CFG",
    # mixed precision: one quant_cfg list built from the quantizer attributes of the tool's own presets
    # (_mixed_cfg); ModelOpt's export infers MIXED_PRECISION from the layers' differing formats
    "mixed_fp8_nvfp4": "mixed: experts NVFP4_DEFAULT_CFG, self_attn FP8_DEFAULT_CFG, lm_head NVFP4_DEFAULT_CFG",
    "mixed_mxfp8_nvfp4": "mixed: experts NVFP4_DEFAULT_CFG, self_attn MXFP8_DEFAULT_CFG, lm_head bf16",
}
_MX = ("mxfp8",)
_EXPERTS_ONLY = ("w4a16_nvfp4", "mxfp8")
# mixed scheme -> (attention preset, lm_head quantized in NVFP4)
_MIXED = {"mixed_fp8_nvfp4": ("FP8_DEFAULT_CFG", True), "mixed_mxfp8_nvfp4": ("MXFP8_DEFAULT_CFG", False)}
ATTN_PROJS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _dequant(tensors, name, dtype):
    """ModelOpt's own ``NVFP4QTensor.dequantize`` of one exported weight."""
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    packed = tensors.get_tensor(f"{name}.weight")
    scale = tensors.get_tensor(f"{name}.weight_scale")
    scale_2 = tensors.get_tensor(f"{name}.weight_scale_2")
    shape = torch.Size([packed.shape[0], packed.shape[1] * 2])
    q = NVFP4QTensor(shape, torch.bfloat16, packed)
    return q.dequantize(dtype=dtype, scale=scale, double_scale=scale_2, block_sizes={-1: 16})


def _dequant_mxfp8(tensors, name, dtype):
    """ModelOpt's own ``MXFP8QTensor.dequantize`` of one exported weight."""
    from modelopt.torch.quantization.qtensor import MXFP8QTensor

    data = tensors.get_tensor(f"{name}.weight")
    scale = tensors.get_tensor(f"{name}.weight_scale")
    return MXFP8QTensor(data.shape, torch.bfloat16, data).dequantize(dtype=dtype, scale=scale)


def _preset_attrs(mtq, preset: str, quantizer: str) -> dict:
    """The quantizer attributes a preset of the tool gives ``*weight_quantizer`` / ``*input_quantizer``."""
    import copy

    for entry in getattr(mtq, preset)["quant_cfg"]:
        if entry.get("quantizer_name") == quantizer and "cfg" in entry:
            return copy.deepcopy(entry["cfg"])
    raise KeyError(f"{preset} has no cfg for {quantizer}")


def _mixed_cfg(mtq, scheme: str) -> dict:
    """``mtq.quantize``'s config of a mixed scheme: everything off, then the routed experts (``*.experts.*``)
    NVFP4, the attention projections (``*self_attn*``) FP8 per tensor or MXFP8, ``lm_head`` NVFP4 where the
    scheme quantizes it. The routers (transformers 5's ``TopKRouter``, not a Linear) get no quantizer."""
    attn, lm_head = _MIXED[scheme]
    cfg = [{"quantizer_name": "*", "enable": False}]
    parts = [("*.experts.*", "NVFP4_DEFAULT_CFG"), ("*self_attn*", attn)]
    if lm_head:
        parts.append(("*lm_head*", "NVFP4_DEFAULT_CFG"))
    for pattern, preset in parts:
        for q in ("weight_quantizer", "input_quantizer"):
            cfg.append({"quantizer_name": f"{pattern}{q}", "cfg": _preset_attrs(mtq, preset, f"*{q}")})
    return {"quant_cfg": cfg, "algorithm": "max"}


def _dequant_fp8(tensors, name, dtype):
    """ModelOpt's own ``FP8QTensor.dequantize`` of one exported FP8 (per-tensor) weight."""
    from modelopt.torch.quantization.qtensor import FP8QTensor

    data = tensors.get_tensor(f"{name}.weight")
    scale = tensors.get_tensor(f"{name}.weight_scale")
    return FP8QTensor(data.shape, torch.bfloat16, data).dequantize(dtype=dtype, scale=scale)


def _nvfp4_qdq(x, input_scale):
    """ModelOpt's NVFP4 quantize -> dequantize of an activation with a checkpoint ``input_scale`` as the
    per-tensor (decode) scale: the arithmetic of its real quantization."""
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    q, s, s2 = NVFP4QTensor.quantize(x, 16, weights_scaling_factor_2=input_scale.float())
    return q.dequantize(dtype=torch.bfloat16, scale=s, double_scale=s2, block_sizes={-1: 16}), s2.float().reshape(())


def make_mixed(outdir: Path, scheme: str) -> Path:
    """A ``MIXED_PRECISION`` export (``_mixed_cfg``) and the tool's own numbers for each precision group."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from modelopt.torch.quantization.qtensor import FP8QTensor, MXFP8QTensor

    attn_preset, lm_head = _MIXED[scheme]
    attn_mx = attn_preset.startswith("MXFP8")
    fixture = C.fresh_dir(outdir / f"modelopt_{scheme}")
    ckpt = fixture / "checkpoint"
    model = C.build_model()
    ids_cal, ids_eval = C.calib_tokens(), C.eval_tokens()
    results = {"tokens.eval": ids_eval, "logits.bf16": C.logits(model, ids_eval)}
    notes = [f"config: {SCHEMES[scheme]}"]
    q0 = "model.layers.0.self_attn.q_proj"
    # the bf16 weights the tool quantizes, for a writer comparison from the same input
    for p, w in C.expert_weights(model, 0, 0).items():
        results[f"weight.model.layers.0.mlp.experts.0.{p}"] = w
    results[f"weight.{q0}"] = model.get_submodule(q0).weight.detach().clone()

    cfg = _mixed_cfg(mtq, scheme)

    def forward_loop(m):
        with torch.no_grad():
            m(input_ids=ids_cal)

    mtq.quantize(model, cfg, forward_loop)
    try:
        results["logits.tool"] = C.logits(model, ids_eval)
        notes.append("logits.tool: ModelOpt's fake-quantized forward on the CPU")
    except Exception as err:  # noqa: BLE001  ModelOpt's NVFP4 / MX fake quant kernels are CUDA only
        notes.append(
            f"logits.tool: not recorded, ModelOpt's fake-quantized forward failed on the CPU: "
            f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
        )
        traceback.print_exc()

    x = C.qdq_input(torch.bfloat16)
    results["qdq.x"] = x
    if not attn_mx:
        # the tool's fake quantization of q_proj's input as calibrated (FP8 per tensor runs on the CPU:
        # modelopt.torch.quantization.tensor_quant.fp8_eager, x * (448 / amax) then * (amax / 448))
        with torch.no_grad():
            results["qdq_attn.y_fake"] = model.get_submodule(q0).input_quantizer(x.clone())
        notes.append(f"qdq_attn.y_fake: {q0}.input_quantizer(qdq.x) after calibration (ModelOpt's fake quant)")

    export_hf_checkpoint(model, export_dir=str(ckpt))
    removed = C.clean_checkpoint(ckpt)

    experts = [f"model.layers.{L}.mlp.experts.{e}.{p}" for L, e in C.DEQUANT_EXPERTS for p in C.PROJS]
    attention = [f"model.layers.0.self_attn.{p}" for p in ATTN_PROJS]
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        for name in experts + (["lm_head"] if lm_head else []):
            results[f"dequant.{name}"] = _dequant(f, name, torch.bfloat16)
            if name.startswith("model.layers.0.mlp.experts.0."):
                results[f"dequant_fp32.{name}"] = _dequant(f, name, torch.float32)
        for name in attention:
            dq = _dequant_mxfp8 if attn_mx else _dequant_fp8
            results[f"dequant.{name}"] = dq(f, name, torch.bfloat16)
            # FP8QTensor.dequantize multiplies in the requested dtype (the scale rounded to bf16 first): fp32 too
            results[f"dequant_fp32.{name}"] = dq(f, name, torch.float32)
        # activation QDQ with the tool's real-quantization arithmetic, one per precision group
        results["qdq.y"], results["qdq.scale_2"] = _nvfp4_qdq(
            x, f.get_tensor("model.layers.0.mlp.experts.0.gate_proj.input_scale")
        )
        if lm_head:
            lm_in = f.get_tensor("lm_head.input_scale")
            results["qdq_lm_head.y"], results["qdq_lm_head.scale_2"] = _nvfp4_qdq(x, lm_in)
        if attn_mx:
            q, s = MXFP8QTensor.quantize(x)
            results["qdq_attn.y"] = q.dequantize(dtype=torch.bfloat16, scale=s)
        else:
            in_scale = f.get_tensor(f"{q0}.input_scale").float()
            q, s = FP8QTensor.quantize(x, scales=in_scale)
            results["qdq_attn.y"] = q.dequantize(dtype=torch.bfloat16, scale=s)
            results["qdq_attn.scale"] = in_scale.reshape(())

    nvfp4_dq = (
        "modelopt.torch.quantization.qtensor.NVFP4QTensor.dequantize(dtype, scale=weight_scale, "
        "double_scale=weight_scale_2, block_sizes={-1: 16})"
    )
    C.write_results(
        fixture,
        results,
        dict(
            tool="nvidia-modelopt",
            scheme=scheme,
            config=SCHEMES[scheme],
            quant_cfg=json.loads(json.dumps(cfg, default=str)),
            format="modelopt",
            versions=C.versions(["nvidia-modelopt"]),
            dequant=dict(
                experts=nvfp4_dq,
                lm_head=nvfp4_dq if lm_head else None,
                attention="modelopt.torch.quantization.qtensor.MXFP8QTensor.dequantize(dtype, scale=weight_scale)"
                if attn_mx
                else "modelopt.torch.quantization.qtensor.FP8QTensor.dequantize(dtype, scale=weight_scale)",
                names=experts + (["lm_head"] if lm_head else []) + attention,
            ),
            qdq=dict(
                experts="NVFP4QTensor.quantize(x, 16, weights_scaling_factor_2=input_scale) then "
                ".dequantize(bfloat16); input_scale of model.layers.0.mlp.experts.0.gate_proj",
                lm_head="the same with lm_head.input_scale" if lm_head else None,
                attention="MXFP8QTensor.quantize(x) then .dequantize(bfloat16)"
                if attn_mx
                else f"FP8QTensor.quantize(x, scales=input_scale) then .dequantize(bfloat16, scale=input_scale); "
                f"input_scale of {q0}",
            ),
            removed_from_export=removed,
            notes=notes,
        ),
    )
    return fixture


def make_one(outdir: Path, scheme: str) -> Path:
    if scheme in _MIXED:
        return make_mixed(outdir, scheme)
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    fixture = C.fresh_dir(outdir / f"modelopt_{scheme}")
    ckpt = fixture / "checkpoint"
    model = C.build_model()
    ids_cal, ids_eval = C.calib_tokens(), C.eval_tokens()
    results = {"tokens.eval": ids_eval, "logits.bf16": C.logits(model, ids_eval)}
    notes = []

    cfg = getattr(mtq, SCHEMES[scheme])
    if scheme in _EXPERTS_ONLY:
        import copy

        cfg = copy.deepcopy(cfg)
        cfg["quant_cfg"].append({"quantizer_name": "*self_attn*", "enable": False})
        notes.append(f"config: {SCHEMES[scheme]} plus {{'quantizer_name': '*self_attn*', 'enable': False}}")
        # the bf16 weights the tool quantizes (layer 0 expert 0), for a writer comparison from the same input
        for p, w in C.expert_weights(model, 0, 0).items():
            results[f"weight.model.layers.0.mlp.experts.0.{p}"] = w

    def forward_loop(m):
        with torch.no_grad():
            m(input_ids=ids_cal)

    mtq.quantize(model, cfg, forward_loop)
    try:
        results["logits.tool"] = C.logits(model, ids_eval)
        notes.append("logits.tool: ModelOpt's fake-quantized forward on the CPU")
    except Exception as err:  # noqa: BLE001  ModelOpt's NVFP4 fake quant kernels are CUDA/Triton only
        notes.append(
            f"logits.tool: not recorded, ModelOpt's fake-quantized forward failed on the CPU: "
            f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
        )
        traceback.print_exc()

    export_hf_checkpoint(model, export_dir=str(ckpt))
    removed = C.clean_checkpoint(ckpt)

    dequant_names = [f"model.layers.{L}.mlp.experts.{e}.{p}" for L, e in C.DEQUANT_EXPERTS for p in C.PROJS]
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        if "model.layers.0.self_attn.q_proj.weight_scale" in keys:
            dequant_names += [f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
        dq = _dequant_mxfp8 if scheme in _MX else _dequant
        for name in dequant_names:
            results[f"dequant.{name}"] = dq(f, name, torch.bfloat16)
            if name.startswith("model.layers.0.mlp.experts.0."):
                results[f"dequant_fp32.{name}"] = dq(f, name, torch.float32)
        in_key = "model.layers.0.mlp.experts.0.gate_proj.input_scale"
        in_scale = f.get_tensor(in_key) if in_key in keys else None
        if in_scale is None and scheme not in _MX:
            notes.append("qdq: weight-only, no input_scale exported")

    x = C.qdq_input(torch.bfloat16)
    if scheme in _MX:
        # ModelOpt's own MXFP8 quantize -> dequantize of an activation tensor (dynamic E8M0 block scales)
        from modelopt.torch.quantization.qtensor import MXFP8QTensor

        q, s = MXFP8QTensor.quantize(x)
        results["qdq.x"] = x
        results["qdq.y"] = q.dequantize(dtype=torch.bfloat16, scale=s)
    elif in_scale is not None:
        # ModelOpt's own NVFP4 quantize -> dequantize of an activation tensor with the checkpoint's
        # input_scale as its per-tensor (decode) scale: the arithmetic ModelOpt uses for real quantization.
        q, s, s2 = NVFP4QTensor.quantize(x, 16, weights_scaling_factor_2=in_scale.float())
        results["qdq.x"] = x
        results["qdq.y"] = q.dequantize(dtype=torch.bfloat16, scale=s, double_scale=s2, block_sizes={-1: 16})
        results["qdq.scale_2"] = s2.float().reshape(())

    C.write_results(
        fixture,
        results,
        dict(
            tool="nvidia-modelopt",
            scheme=scheme,
            config=SCHEMES[scheme],
            format="modelopt",
            versions=C.versions(["nvidia-modelopt"]),
            dequant=dict(
                function="modelopt.torch.quantization.qtensor.MXFP8QTensor.dequantize(dtype, scale=weight_scale)"
                if scheme in _MX
                else "modelopt.torch.quantization.qtensor.NVFP4QTensor.dequantize(dtype, scale=weight_scale, "
                "double_scale=weight_scale_2, block_sizes={-1: 16})",
                names=dequant_names,
            ),
            qdq=dict(kind="mxfp8", function="MXFP8QTensor.quantize(x) then .dequantize(bfloat16)")
            if scheme in _MX
            else dict(
                kind="nvfp4",
                function="NVFP4QTensor.quantize(x, 16, weights_scaling_factor_2=input_scale) then "
                ".dequantize(bfloat16)",
                input_scale_of="model.layers.0.mlp.experts.0.gate_proj.input_scale",
            )
            if in_scale is not None
            else None,
            removed_from_export=removed,
            notes=notes,
        ),
    )
    return fixture


def make_all(outdir: Path, only=None) -> list[Path]:
    return [make_one(outdir, s) for s in SCHEMES if not only or s in only]
