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

Weight-only NVFP4 (``w4a16_nvfp4``: ModelOpt's ``QUANTIZATION_W4A16_NVFP4`` format, ``quant_algo:
W4A16_NVFP4``, its input quantizers disabled) stores the same tensors without ``input_scale``; a stray
``input_scale`` in such a checkpoint is not read (no activation is quantized).

ModelOpt's default NVFP4 config also quantizes the attention projections
(``model.layers.L.self_attn.{q,k,v,o}_proj``, the same four tensors each); its experts-only
config leaves them bf16 and ignored. Scalar scales stored as bf16 or fp16 are widened exactly.

``quant_algo: MXFP8`` configs (the same ``quant_method``) are read by ``modelopt_mxfp8``, ``FP8`` and
``FP8_PER_CHANNEL_PER_TOKEN`` ones (FP8 linear layers) by ``fp8_linear``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...formats import NVFP4
from ...moe.emulation import ExpertWeights
from ...moe.linear import LinearWeights
from ...moe.schemes import NVFP4_MOE, W4A16_NVFP4, MoEQuantScheme
from .. import precision
from ..files.folder import CheckpointFolder
from ..layout import (
    CheckpointDescription,
    CheckpointError,
    CheckpointLayout,
    block_scale_check,
    expert_parts,
    global_scale_check,
    read_block_experts,
)
from ..scalars import read_scalar_scales, read_static_input_scales
from . import fp8_linear, modelopt_mxfp8

__all__ = ["LAYOUT"]

_ALGO = "NVFP4"
# ModelOpt's quant_algo of each scheme the layout stores
_ALGOS = {NVFP4_MOE: _ALGO, W4A16_NVFP4: "W4A16_NVFP4"}
_FROM_ALGO = {v: k for k, v in _ALGOS.items()}
_EXCLUDE = ["lm_head", "model.layers.*.mlp.gate", "model.layers.*.self_attn*"]
_EXCLUDE_ATTENTION_QUANTIZED = ["lm_head", "model.embed_tokens", "model.layers.*.mlp.gate"]
_LEGACY_FILE = "hf_quant_config.json"


class ModelOptNvfp4Layout(CheckpointLayout):
    name = "modelopt"
    quant_method = "modelopt"
    supports_linear = True
    legacy_files = (_LEGACY_FILE,)

    def handles(self, scheme: MoEQuantScheme) -> bool:
        return scheme in _ALGOS

    # ----------------------------------------------------------------------------- config

    def config_files(self, scheme: MoEQuantScheme, quantize_attention: bool = False) -> tuple[dict, dict[str, dict]]:
        exclude = _EXCLUDE_ATTENTION_QUANTIZED if quantize_attention else _EXCLUDE
        bs = NVFP4.block_size
        bits = NVFP4.element.nbits
        group = {"type": "float", "num_bits": bits, "group_size": bs, "dynamic": False}
        algo = _ALGOS[scheme]
        group_0 = {"targets": ["Linear"], "weights": dict(group)}
        if not scheme.weight_only:
            group_0["input_activations"] = dict(group)
        qc = {
            "quant_method": self.quant_method,
            "quant_algo": algo,
            "producer": {"name": "modelopt", "version": "mxlib-dummy"},
            "ignore": list(exclude),
            "config_groups": {"group_0": group_0},
            "kv_cache_scheme": None,
        }
        legacy = {
            "producer": {"name": "modelopt", "version": "mxlib-dummy"},
            "quantization": {
                "quant_algo": algo,
                "group_size": bs,
                "kv_cache_quant_algo": None,
                "exclude_modules": list(exclude),
            },
        }
        return qc, {_LEGACY_FILE: legacy}

    def read_legacy(self, folder: Path | CheckpointFolder) -> dict | None:
        folder = CheckpointFolder.of(folder)  # a load's folder: its hf_quant_config.json read once
        path = folder / _LEGACY_FILE
        if not path.exists():
            return None
        q = folder.json(_LEGACY_FILE).get("quantization") or {}
        if not isinstance(q, dict):
            raise CheckpointError(f"{path}: quantization: expected an object, found {type(q).__name__}")
        qc = {
            "quant_method": self.quant_method,
            "quant_algo": q.get("quant_algo"),
            "group_size": q.get("group_size"),
            "ignore": q.get("exclude_modules", []),
        }
        if "quantized_layers" in q:  # MIXED_PRECISION: each quantized module's own quant_algo
            qc["quantized_layers"] = q["quantized_layers"]
        return qc

    def read_config(self, qc: dict) -> CheckpointDescription:
        algo = qc.get("quant_algo")
        if algo == precision.MODELOPT_MIXED:  # per-module quant_algo (mxlib.checkpoints.precision)
            return precision.mixed_description(self.name, qc, self.read_config)
        if algo == modelopt_mxfp8.ALGO:  # the same quant_method, the MXFP8 layout's config
            return modelopt_mxfp8.LAYOUT.read_config(qc)
        if algo in fp8_linear.MODELOPT_ALGOS:  # and the FP8 linear layers'
            return fp8_linear.MODELOPT.read_config(qc)
        if algo not in _FROM_ALGO:
            supported = sorted([*_FROM_ALGO, modelopt_mxfp8.ALGO, *fp8_linear.MODELOPT_ALGOS])
            raise CheckpointError(f"quantization_config.quant_algo: supported {supported}, found {algo!r}")
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
                        f"quantization_config.config_groups.{gname}.{part}.num_bits: expected {bits}, "
                        f"found {g['num_bits']}"
                    )
        if group_size not in (None, bs):
            raise CheckpointError(f"quantization_config.group_size: NVFP4 uses {bs}, found {group_size}")
        exclude = list(qc.get("ignore") or qc.get("exclude_modules") or [])
        return CheckpointDescription(self.name, _FROM_ALGO[algo], exclude, None)

    # ----------------------------------------------------------------------------- tensors

    def expert_tensors(self, scheme, weights: ExpertWeights, w13_input_scale, w2_input_scale, prefix: str) -> dict:
        out: dict[str, torch.Tensor] = {}
        # w13_weight_scale_2: [E] (gate and up share one) or [E, 2] (each its own)
        for x, proj, p, s, g, ins in expert_parts(weights, w13_input_scale, w2_input_scale):
            base = f"{prefix}.{x}.{proj}"
            out[f"{base}.weight"] = p
            out[f"{base}.weight_scale"] = s
            out[f"{base}.weight_scale_2"] = g.reshape(()).float().cpu().clone()
            if not scheme.weight_only:
                out[f"{base}.input_scale"] = ins.reshape(()).float().cpu().clone()
        return out

    def read_experts(self, tensors, prefix: str, e: int, h: int, i: int, description: CheckpointDescription):
        # every value that could silently spoil the emulation is checked here, naming the tensor:
        # block scales (NaN, negative), weight_scale_2 (finite, positive), input_scale (also 0);
        # scalar scales: fp32, bf16 or fp16 as stored, widened to fp32 exactly (scalars.py)
        gs = global_scale_check()

        def scalars(names):
            return read_scalar_scales(tensors, names, (), gs)

        parts = read_block_experts(tensors, prefix, e, h, i, NVFP4, global_scale="weight_scale_2", read_scalars=scalars)
        weights = ExpertWeights(NVFP4, *parts)
        if description.scheme.weight_only:  # W4A16_NVFP4: no activation scale
            return weights, None, None
        return (weights, *read_static_input_scales(tensors, prefix, e))

    def linear_tensors(self, scheme, weights: LinearWeights, input_scale, name: str) -> dict:
        out = {
            f"{name}.weight": weights.weight.contiguous().cpu(),
            f"{name}.weight_scale": weights.weight_scale.contiguous().cpu(),
            f"{name}.weight_scale_2": weights.weight_scale_2.reshape(()).float().cpu().clone(),
        }
        if not scheme.weight_only:
            out[f"{name}.input_scale"] = input_scale.reshape(()).float().cpu().clone()
        return out

    def read_linear(self, tensors, name: str, out_features: int, in_features: int, description: CheckpointDescription):
        """``(LinearWeights, input_scale fp32 [1])`` of a quantized linear layer ``name``."""
        bs = NVFP4.block_size
        w = tensors.get(f"{name}.weight", (out_features, NVFP4.element.packed_size(in_features)), torch.uint8)
        s = tensors.stack(
            [f"{name}.weight_scale"],
            (out_features, in_features // bs),
            torch.float8_e4m3fn,
            block_scale_check(e4m3=True),
        )[0]
        g = read_scalar_scales(tensors, [f"{name}.weight_scale_2"], (), global_scale_check())
        if description.scheme.weight_only:
            return LinearWeights(NVFP4, w, s, g.reshape(())), None
        ins = read_scalar_scales(tensors, [f"{name}.input_scale"], (), global_scale_check(True, "input_scale"))
        return LinearWeights(NVFP4, w, s, g.reshape(())), ins


LAYOUT = ModelOptNvfp4Layout()  # registered by the package's __init__
