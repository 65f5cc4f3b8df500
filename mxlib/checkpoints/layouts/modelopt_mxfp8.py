"""NVIDIA ModelOpt MXFP8 layout (``quant_algo: MXFP8``, ModelOpt's ``QUANTIZATION_MXFP8`` format).

For every expert ``e`` of layer ``L`` and projection ``p`` in ``gate_proj, up_proj, down_proj``::

    model.layers.L.mlp.experts.e.p.weight        float8_e4m3fn  [out, in]     one e4m3 code a byte
    model.layers.L.mlp.experts.e.p.weight_scale  uint8          [out, in/32]  E8M0 block scales, 2**(byte - 127)

No global scale and no ``input_scale``: ModelOpt's MXFP8 quantizes activations dynamically, per block of
32. ModelOpt's ``MXFP8QTensor`` chooses block scales by the ``rceil`` rule, ``2**ceil(log2(amax / 448))``
(``mxlib.formats.SCALE_MODES``), for weights and activations alike; the writer quantizes the weights so
(``quantize_experts``) and the loaded experts QDQ activations with it. The scheme is ``w_mxfp8_a_mxfp8``
(W8A8); vLLM's ``Mxfp8EmulationTritonExperts`` runs such a checkpoint as ``w_mxfp8`` (W8A16,
``mxlib.moe.schemes.vllm_emulated_scheme``).

``quantization_config`` in ``config.json`` (``quant_method: modelopt``, ``quant_algo: MXFP8``,
``config_groups`` with 8-bit float weights and dynamic 8-bit float activations in groups of 32,
``ignore``) and ``hf_quant_config.json`` (``quantization.quant_algo``, ``exclude_modules``); the reader
needs ``quant_algo`` and checks ``group_size`` and ``num_bits`` where given (ModelOpt 0.47.0's own export
writes no ``config_groups`` for MXFP8: ``quant_method``, ``quant_algo``, ``producer``, ``ignore``; its
tensors and block scales read bit-equal, ``tests/test_interop_formats.py``). The ModelOpt NVFP4 layout
(``modelopt_nvfp4``) shares the ``quant_method`` and hands ``MXFP8`` configs to this layout.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ... import reference as _ref
from ...formats import BLOCK_SCHEMES
from ...moe.emulation import ExpertWeights
from ...moe.linear import LinearWeights
from ...moe.schemes import MOE_SCHEMES, MoEQuantScheme
from ..layout import (
    CheckpointDescription,
    CheckpointError,
    CheckpointLayout,
    block_scale_check,
    expert_parts,
    read_block_experts,
)

__all__ = ["LAYOUT", "ALGO"]

ALGO = "MXFP8"
_MXFP8 = BLOCK_SCHEMES["mxfp8_e4m3"]
_SCHEME = MOE_SCHEMES["w_mxfp8_a_mxfp8"]
_SCALE_MODE = "rceil"  # ModelOpt's MXFP8QTensor: 2**ceil(log2(amax / 448))
_STORED = getattr(torch, _MXFP8.element.ml_dtypes_name)  # float8_e4m3fn
_EXCLUDE = ["lm_head", "model.layers.*.mlp.gate", "model.layers.*.self_attn*"]
_EXCLUDE_ATTENTION_QUANTIZED = ["lm_head", "model.embed_tokens", "model.layers.*.mlp.gate"]


class ModelOptMxfp8Layout(CheckpointLayout):
    name = "modelopt-mxfp8"
    quant_method = "modelopt"
    supports_linear = True

    def handles(self, scheme: MoEQuantScheme) -> bool:
        return scheme is _SCHEME

    # ----------------------------------------------------------------------------- config

    def config_files(self, scheme: MoEQuantScheme, quantize_attention: bool = False) -> tuple[dict, dict[str, dict]]:
        exclude = _EXCLUDE_ATTENTION_QUANTIZED if quantize_attention else _EXCLUDE
        group = {"type": "float", "num_bits": _MXFP8.element.nbits, "group_size": _MXFP8.block_size}
        qc = {
            "quant_method": self.quant_method,
            "quant_algo": ALGO,
            "producer": {"name": "modelopt", "version": "mxlib-dummy"},
            "ignore": list(exclude),
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {**group, "dynamic": False},
                    "input_activations": {**group, "dynamic": True},
                }
            },
            "kv_cache_scheme": None,
        }
        legacy = {
            "producer": {"name": "modelopt", "version": "mxlib-dummy"},
            "quantization": {
                "quant_algo": ALGO,
                "group_size": _MXFP8.block_size,
                "kv_cache_quant_algo": None,
                "exclude_modules": list(exclude),
            },
        }
        return qc, {"hf_quant_config.json": legacy}

    def read_legacy(self, folder: Path) -> dict | None:
        return None  # the NVFP4 ModelOpt layout reads hf_quant_config.json for both

    def read_config(self, qc: dict) -> CheckpointDescription:
        if qc.get("quant_algo") != ALGO:
            raise CheckpointError(
                f"quantization_config.quant_algo: this layout reads {ALGO!r}, found {qc.get('quant_algo')!r}"
            )
        want = {"group_size": _MXFP8.block_size, "num_bits": _MXFP8.element.nbits}
        if qc.get("group_size") not in (None, want["group_size"]):
            raise CheckpointError(f"quantization_config.group_size: MXFP8 uses 32, found {qc['group_size']!r}")
        for gname, group in (qc.get("config_groups") or {}).items():
            for part in ("weights", "input_activations"):
                g = group.get(part) or {}
                for key, value in want.items():
                    if g.get(key) not in (None, value):
                        raise CheckpointError(
                            f"quantization_config.config_groups.{gname}.{part}.{key}: MXFP8 uses {value}, "
                            f"found {g[key]!r}"
                        )
        exclude = list(qc.get("ignore") or qc.get("exclude_modules") or [])
        return CheckpointDescription(self.name, _SCHEME, exclude, _SCALE_MODE)

    # ----------------------------------------------------------------------------- tensors

    def quantize_experts(self, w13: torch.Tensor, w2: torch.Tensor, scheme) -> ExpertWeights:
        """One layer's experts with ModelOpt's ``rceil`` E8M0 rule."""
        p13, s13 = _ref.quantize_mx(w13, _MXFP8.element, _MXFP8.block_size, _SCALE_MODE)
        p2, s2 = _ref.quantize_mx(w2, _MXFP8.element, _MXFP8.block_size, _SCALE_MODE)
        return ExpertWeights(_MXFP8, p13, s13, p2, s2)

    def quantize_linear(self, weight: torch.Tensor, scheme) -> LinearWeights:
        p, s = _ref.quantize_mx(weight, _MXFP8.element, _MXFP8.block_size, _SCALE_MODE)
        return LinearWeights(_MXFP8, p, s)

    def expert_tensors(self, scheme, weights: ExpertWeights, w13_input_scale, w2_input_scale, prefix: str) -> dict:
        out: dict[str, torch.Tensor] = {}
        for x, proj, p, s, _, _ in expert_parts(weights):
            base = f"{prefix}.{x}.{proj}"
            out[f"{base}.weight"] = p.view(_STORED)
            out[f"{base}.weight_scale"] = s
        return out

    def read_experts(self, tensors, prefix: str, e: int, h: int, i: int, description: CheckpointDescription):
        parts = read_block_experts(tensors, prefix, e, h, i, _MXFP8, stored_dtype=_STORED)
        return ExpertWeights(_MXFP8, *parts), None, None

    def linear_tensors(self, scheme, weights: LinearWeights, input_scale, name: str) -> dict:
        return {
            f"{name}.weight": weights.weight.contiguous().cpu().view(_STORED),
            f"{name}.weight_scale": weights.weight_scale.contiguous().cpu(),
        }

    def read_linear(self, tensors, name: str, out_features: int, in_features: int, description: CheckpointDescription):
        """``(LinearWeights, None)`` of a quantized linear layer ``name`` (dynamic activations)."""
        w = tensors.get(f"{name}.weight", (out_features, in_features), _STORED).view(torch.uint8)
        s = tensors.stack(
            [f"{name}.weight_scale"],
            (out_features, in_features // _MXFP8.block_size),
            torch.uint8,
            block_scale_check(e4m3=False),
        )[0]
        return LinearWeights(_MXFP8, w, s), None


LAYOUT = ModelOptMxfp8Layout()  # registered by the package's __init__
