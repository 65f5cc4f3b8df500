"""NVIDIA ModelOpt NVFP4 layout (e.g. ``nvidia/Qwen3-30B-A3B-NVFP4``).

For every expert ``e`` of layer ``L`` and projection ``p`` in ``gate_proj, up_proj, down_proj``::

    model.layers.L.mlp.experts.e.p.weight          uint8          [out, in/2]   two e2m1 codes a byte
    model.layers.L.mlp.experts.e.p.weight_scale    float8_e4m3fn  [out, in/16]  block scales
    model.layers.L.mlp.experts.e.p.weight_scale_2  float32        []            amax / (6 * 448)
    model.layers.L.mlp.experts.e.p.input_scale     float32        []            calibrated amax / (6 * 448)

with ``quantization_config`` in ``config.json`` (``quant_method: modelopt``, ``quant_algo: NVFP4``,
``config_groups``, ``ignore``) and the older ``hf_quant_config.json``
(``quantization.exclude_modules``); the reader accepts either. ModelOpt gives gate and up one
shared ``weight_scale_2`` (from the larger amax) so that they can be fused; the writer does the same.

ModelOpt's default NVFP4 config also quantizes the attention projections
(``model.layers.L.self_attn.{q,k,v,o}_proj``, the same four tensors each); its experts-only
config leaves them bf16 and ignored. Scalar scales stored as bf16 or fp16 are widened exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ...formats import NVFP4
from ...moe.emulation import ExpertWeights
from ...moe.linear import LinearWeights
from ...moe.schemes import MoEQuantScheme, get_moe_scheme
from .layout import PROJS, CheckpointDescription, CheckpointError, register_layout
from .scalars import read_scalar_scales

__all__ = ["LAYOUT"]

_ALGO = "NVFP4"
_EXCLUDE = ["lm_head", "model.layers.*.mlp.gate", "model.layers.*.self_attn*"]
_EXCLUDE_ATTENTION_QUANTIZED = ["lm_head", "model.embed_tokens", "model.layers.*.mlp.gate"]
_LEGACY_FILE = "hf_quant_config.json"


class ModelOptNvfp4Layout:
    name = "modelopt"
    quant_method = "modelopt"

    def handles(self, scheme: MoEQuantScheme) -> bool:
        return scheme.weight == NVFP4 and scheme.activation == NVFP4

    # ----------------------------------------------------------------------------- config

    def config_files(self, scheme: MoEQuantScheme, quantize_attention: bool = False) -> tuple[dict, dict[str, dict]]:
        exclude = _EXCLUDE_ATTENTION_QUANTIZED if quantize_attention else _EXCLUDE
        bs = NVFP4.block_size
        bits = NVFP4.element.nbits
        group = {"type": "float", "num_bits": bits, "group_size": bs, "dynamic": False}
        qc = {
            "quant_method": self.quant_method,
            "quant_algo": _ALGO,
            "producer": {"name": "modelopt", "version": "mxlib-dummy"},
            "ignore": list(exclude),
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": dict(group),
                                          "input_activations": dict(group)}},
            "kv_cache_scheme": None,
        }
        legacy = {
            "producer": {"name": "modelopt", "version": "mxlib-dummy"},
            "quantization": {"quant_algo": _ALGO, "group_size": bs, "kv_cache_quant_algo": None,
                             "exclude_modules": list(exclude)},
        }
        return qc, {_LEGACY_FILE: legacy}

    def read_legacy(self, folder: Path) -> dict | None:
        path = folder / _LEGACY_FILE
        if not path.exists():
            return None
        q = json.loads(path.read_text()).get("quantization", {})
        return {"quant_method": self.quant_method, "quant_algo": q.get("quant_algo"), "group_size": q.get("group_size"),
                "ignore": q.get("exclude_modules", [])}

    def read_config(self, qc: dict) -> CheckpointDescription:
        algo = qc.get("quant_algo")
        if algo != _ALGO:
            raise CheckpointError(f"quantization_config.quant_algo: only {_ALGO!r} is supported, found {algo!r}")
        bs, bits = NVFP4.block_size, NVFP4.element.nbits
        group_size = qc.get("group_size")
        for gname, group in (qc.get("config_groups") or {}).items():
            for part in ("weights", "input_activations"):
                g = group.get(part) or {}
                if g.get("group_size") is not None:
                    group_size = g["group_size"]
                    if g["group_size"] != bs:
                        raise CheckpointError(
                            f"quantization_config.config_groups.{gname}.{part}.group_size: NVFP4 uses {bs}, "
                            f"found {g['group_size']}"
                        )
                if g.get("num_bits") not in (None, bits):
                    raise CheckpointError(
                        f"quantization_config.config_groups.{gname}.{part}.num_bits: expected {bits}, found {g['num_bits']}")
        if group_size not in (None, bs):
            raise CheckpointError(f"quantization_config.group_size: NVFP4 uses {bs}, found {group_size}")
        exclude = list(qc.get("ignore") or qc.get("exclude_modules") or [])
        return CheckpointDescription(self.name, get_moe_scheme(NVFP4.name), exclude, None)

    # ----------------------------------------------------------------------------- tensors

    def expert_tensors(self, scheme, weights: ExpertWeights, w13_input_scale, w2_input_scale, prefix: str) -> dict:
        e, two_i = weights.w13_weight.shape[:2]
        i = two_i // 2
        w = weights
        out: dict[str, torch.Tensor] = {}
        for x in range(e):
            for proj, rows, p, s, g, ins in (
                ("gate_proj", slice(0, i), w.w13_weight, w.w13_weight_scale, w.w13_weight_scale_2, w13_input_scale),
                ("up_proj", slice(i, 2 * i), w.w13_weight, w.w13_weight_scale, w.w13_weight_scale_2, w13_input_scale),
                ("down_proj", slice(None), w.w2_weight, w.w2_weight_scale, w.w2_weight_scale_2, w2_input_scale),
            ):
                base = f"{prefix}.{x}.{proj}"
                out[f"{base}.weight"] = p[x, rows].contiguous().cpu()
                out[f"{base}.weight_scale"] = s[x, rows].contiguous().cpu()
                out[f"{base}.weight_scale_2"] = g[x].reshape(()).float().cpu().clone()
                out[f"{base}.input_scale"] = ins[x].reshape(()).float().cpu().clone()
        return out

    def read_experts(self, tensors, prefix: str, e: int, h: int, i: int, description: CheckpointDescription):
        bs = NVFP4.block_size
        f8, u8 = torch.float8_e4m3fn, torch.uint8
        rows = {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}

        def stack(proj, what, shape, dtype):
            return tensors.stack([f"{prefix}.{x}.{proj}.{what}" for x in range(e)], shape, dtype)

        w = {p: stack(p, "weight", (rows[p][0], NVFP4.element.packed_size(rows[p][1])), u8) for p in PROJS}
        s = {p: stack(p, "weight_scale", (rows[p][0], rows[p][1] // bs), f8) for p in PROJS}
        g = {p: read_scalar_scales(tensors, [f"{prefix}.{x}.{p}.weight_scale_2" for x in range(e)]) for p in PROJS}
        ins = {p: read_scalar_scales(tensors, [f"{prefix}.{x}.{p}.input_scale" for x in range(e)]) for p in PROJS}
        weights = ExpertWeights(
            NVFP4,
            torch.cat([w["gate_proj"], w["up_proj"]], 1), torch.cat([s["gate_proj"], s["up_proj"]], 1),
            w["down_proj"], s["down_proj"],
            torch.stack([g["gate_proj"], g["up_proj"]], 1), g["down_proj"],
        )
        return weights, torch.maximum(ins["gate_proj"], ins["up_proj"]), ins["down_proj"]

    def linear_tensors(self, scheme, weights: LinearWeights, input_scale, name: str) -> dict:
        return {f"{name}.weight": weights.weight.contiguous().cpu(),
                f"{name}.weight_scale": weights.weight_scale.contiguous().cpu(),
                f"{name}.weight_scale_2": weights.weight_scale_2.reshape(()).float().cpu().clone(),
                f"{name}.input_scale": input_scale.reshape(()).float().cpu().clone()}

    def read_linear(self, tensors, name: str, out_features: int, in_features: int,
                    description: CheckpointDescription):
        """``(LinearWeights, input_scale fp32 [1])`` of a quantized linear layer ``name``."""
        bs = NVFP4.block_size
        w = tensors.get(f"{name}.weight", (out_features, NVFP4.element.packed_size(in_features)), torch.uint8)
        s = tensors.get(f"{name}.weight_scale", (out_features, in_features // bs), torch.float8_e4m3fn)
        g = read_scalar_scales(tensors, [f"{name}.weight_scale_2"])
        ins = read_scalar_scales(tensors, [f"{name}.input_scale"])
        return LinearWeights(NVFP4, w, s, g.reshape(())), ins


LAYOUT = register_layout(ModelOptNvfp4Layout())
