"""nvidia-modelopt fixtures: NVFP4 (the experts-only and the default config, attention too), weight-only
NVFP4 (``W4A16_NVFP4``) and MXFP8."""

from __future__ import annotations

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
}
_MX = ("mxfp8",)
_EXPERTS_ONLY = ("w4a16_nvfp4", "mxfp8")


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


def make_one(outdir: Path, scheme: str) -> Path:
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
