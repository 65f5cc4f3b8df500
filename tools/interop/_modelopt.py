"""nvidia-modelopt NVFP4 fixtures: the experts-only config and the default config (attention too)."""

from __future__ import annotations

import traceback
from pathlib import Path

import _common as C
import torch
from safetensors import safe_open

SCHEMES = {
    "nvfp4_experts": "NVFP4_EXPERTS_ONLY_CFG",
    "nvfp4_default": "NVFP4_DEFAULT_CFG",
}


def _dequant(tensors, name, dtype):
    """ModelOpt's own ``NVFP4QTensor.dequantize`` of one exported weight."""
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    packed = tensors.get_tensor(f"{name}.weight")
    scale = tensors.get_tensor(f"{name}.weight_scale")
    scale_2 = tensors.get_tensor(f"{name}.weight_scale_2")
    shape = torch.Size([packed.shape[0], packed.shape[1] * 2])
    q = NVFP4QTensor(shape, torch.bfloat16, packed)
    return q.dequantize(dtype=dtype, scale=scale, double_scale=scale_2, block_sizes={-1: 16})


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
        for name in dequant_names:
            results[f"dequant.{name}"] = _dequant(f, name, torch.bfloat16)
            if name.startswith("model.layers.0.mlp.experts.0."):
                results[f"dequant_fp32.{name}"] = _dequant(f, name, torch.float32)
        in_scale = f.get_tensor("model.layers.0.mlp.experts.0.gate_proj.input_scale")

    # ModelOpt's own NVFP4 quantize -> dequantize of an activation tensor with the checkpoint's
    # input_scale as its per-tensor (decode) scale: the arithmetic ModelOpt uses for real quantization.
    x = C.qdq_input(torch.bfloat16)
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
                function="modelopt.torch.quantization.qtensor.NVFP4QTensor.dequantize(dtype, scale=weight_scale, "
                "double_scale=weight_scale_2, block_sizes={-1: 16})",
                names=dequant_names,
            ),
            qdq=dict(
                kind="nvfp4",
                function="NVFP4QTensor.quantize(x, 16, weights_scaling_factor_2=input_scale) then "
                ".dequantize(bfloat16)",
                input_scale_of="model.layers.0.mlp.experts.0.gate_proj.input_scale",
            ),
            removed_from_export=removed,
            notes=notes,
        ),
    )
    return fixture


def make_all(outdir: Path, only=None) -> list[Path]:
    return [make_one(outdir, s) for s in SCHEMES if not only or s in only]
