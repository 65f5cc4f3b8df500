"""compressed-tensors NVFP4 layout (llm-compressor's ``nvfp4-pack-quantized``).

What llmcompressor 0.14.0.1 / compressed-tensors 0.19.0 write for scheme NVFP4: for every
quantized ``nn.Linear`` ``M`` (each expert's ``gate_proj``, ``up_proj``, ``down_proj``, and the
attention projections unless ignored)::

    M.weight_packed        uint8          [out, in/2]   two e2m1 codes a byte, even element low
    M.weight_scale         float8_e4m3fn  [out, in/16]  block scales
    M.weight_global_scale  float32        [1]           ENCODE scale 6 * 448 / amax (a bf16 value)
    M.input_global_scale   float32        [1]           ENCODE activation scale 6 * 448 / amax

with ``config.json``'s ``quantization_config``: ``quant_method: compressed-tensors``,
``format: nvfp4-pack-quantized``, ``config_groups.group_N`` (``targets: [Linear]``, ``weights``
and ``input_activations`` of ``num_bits 4, type float, strategy tensor_group, group_size 16``;
activations ``dynamic: "local"``: per-block scales at run time under the static global one),
``ignore`` (module names or ``re:`` patterns).

The global scales are the reciprocals of ModelOpt's decode ``weight_scale_2`` / ``input_scale``,
and they are used as stored: compressed-tensors dequantizes ``e2m1 * (fp32(weight_scale) /
weight_global_scale)`` (its ``_dequantize`` computes ``scale / global_scale``, then one cast to
bf16), and its activation QDQ takes ``input_global_scale`` as the encode scale. Converting to a
decode scale and back is not exact (3039.9998 instead of 3040), so ``ExpertWeights`` and
``LinearWeights`` carry ``global_scale_kind="encode"``. Gate and up share one
``input_global_scale`` per expert (the same input); the writer also gives them one
``weight_global_scale`` (from the larger amax), as llm-compressor does for fused layers.

The writer quantizes with compressed-tensors' arithmetic: ``gs = bf16(2688 / amax)``, block
scale ``s = e4m3(gs * (amax_block / 6))`` (clamped to 448) with ``amax_block / 6`` computed in the
weight's dtype (bf16 for a bf16 weight: compressed-tensors' ``calculate_qparams`` divides the observed
amax, which keeps the weight's dtype, before the fp32 product with ``gs``), codes ``e2m1(x / (s / gs))``
in fp32 (an all-zero block, ``s = 0``, stores zero codes). From the same bf16 weights this gives
llm-compressor 0.14.0.1's bytes exactly (``tests/test_interop_mixed_llmc.py``); dividing in fp32
instead changes about 3 % of the block scales.

``mxfp4-pack-quantized`` configs (the same ``quant_method``) are read by ``compressed_tensors_mxfp4``,
``mxfp8-quantized`` ones by ``compressed_tensors_mxfp8``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ... import reference as _ref
from ...formats import NVFP4
from ...moe.emulation import ExpertWeights
from ...moe.linear import LinearWeights
from ...moe.schemes import MoEQuantScheme, get_moe_scheme
from .. import precision
from ..layout import (
    PROJS,
    CheckpointDescription,
    CheckpointError,
    CheckpointLayout,
    block_scale_check,
    expert_parts,
    global_scale_check,
    read_block_experts,
)
from ..scalars import read_scalar_scales
from . import compressed_tensors_mxfp4, compressed_tensors_mxfp8, fp8_linear

__all__ = ["LAYOUT", "quantize_nvfp4_encode"]

_FORMAT = "nvfp4-pack-quantized"
_GROUP = {
    "num_bits": NVFP4.element.nbits,
    "type": "float",
    "strategy": "tensor_group",
    "group_size": NVFP4.block_size,
    "symmetric": True,
}


def _encode_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """``6 * 448 / amax`` rounded to a bf16 value, fp32 (an all-zero tensor gets 1)."""
    a = amax.float()
    gs = torch.where(a > 0, NVFP4.scale_divisor / torch.where(a > 0, a, 1.0), torch.ones_like(a))
    return gs.to(torch.bfloat16).float()


def quantize_nvfp4_encode(x: torch.Tensor, global_scale: torch.Tensor | None = None):
    """Quantize ``[n, k]`` weights the way compressed-tensors does (module docstring; the block amax / 6 in
    ``x``'s dtype, so a bf16 weight gives the tool's bytes and an fp32 one its fp32 arithmetic).

    Returns:
        ``(packed uint8 [n, k/2], block scale float8_e4m3fn [n, k/16], encode global scale fp32 [])``.
    """
    if x.ndim != 2:
        raise ValueError(f"x: expected [n, k], got shape {list(x.shape)}")
    bs = NVFP4.block_size
    gs = _encode_global_scale(x.abs().amax()) if global_scale is None else global_scale.float().reshape(())
    native = x if x.is_floating_point() else x.float()
    amax = native.reshape(x.shape[0], -1, bs).abs().amax(-1)
    # amax / 6 in the weight's own dtype (compressed-tensors' calculate_qparams), then fp32
    s = _ref.round_to_element(torch.clamp(gs * (amax / 6.0).float(), max=448.0), "e4m3")
    xb = x.float().reshape(x.shape[0], -1, bs)
    step = (s / gs).unsqueeze(-1)
    scaled = torch.where(step == 0, 0.0, xb / torch.where(step == 0, 1.0, step))
    scaled = torch.clamp(scaled, -6.0, 6.0)
    codes = _ref.encode_e2m1_sign_magnitude(scaled)
    packed = _ref.pack_codes(codes.reshape(x.shape), "e2m1")
    return packed, s.to(torch.float8_e4m3fn), gs.clone()


class CompressedTensorsNvfp4Layout(CheckpointLayout):
    name = "compressed-tensors"
    quant_method = "compressed-tensors"
    supports_linear = True
    global_scale_kind = "encode"

    def handles(self, scheme: MoEQuantScheme) -> bool:
        return scheme.weight == NVFP4 and scheme.activation == NVFP4

    # ----------------------------------------------------------------------------- config

    def config_files(self, scheme: MoEQuantScheme, quantize_attention: bool = False) -> tuple[dict, dict[str, dict]]:
        group = {
            "targets": ["Linear"],
            "format": _FORMAT,
            "weights": {**_GROUP, "dynamic": False, "observer": "memoryless_minmax"},
            "input_activations": {**_GROUP, "dynamic": "local", "observer": "static_minmax"},
            "output_activations": None,
        }
        return compressed_tensors_mxfp4.quantization_config(self.quant_method, _FORMAT, group, quantize_attention), {}

    def read_legacy(self, folder: Path) -> dict | None:
        return None

    def read_config(self, qc: dict) -> CheckpointDescription:
        if precision.is_mixed(qc):  # several config groups in different schemes (mxlib.checkpoints.precision)
            return precision.mixed_description(self.name, qc, self.read_config)
        fmt = qc.get("format")
        if fmt == compressed_tensors_mxfp4.FORMAT:  # the same quant_method, the MXFP4 layout's config
            return compressed_tensors_mxfp4.LAYOUT.read_config(qc)
        if fmt == compressed_tensors_mxfp8.FORMAT:  # and the MXFP8 layout's
            return compressed_tensors_mxfp8.LAYOUT.read_config(qc)
        if fmt == fp8_linear.CT_FORMAT:  # and the FP8 linear layers'
            return fp8_linear.COMPRESSED_TENSORS.read_config(qc)
        if fmt != _FORMAT:
            raise CheckpointError(
                f"quantization_config.format: the compressed-tensors layout supports {_FORMAT!r}, found {fmt!r}"
            )
        groups = qc.get("config_groups") or {}
        if not groups:
            raise CheckpointError("quantization_config.config_groups: missing")
        for gname, group in groups.items():
            where = f"quantization_config.config_groups.{gname}"
            if group.get("format", _FORMAT) != _FORMAT:
                raise CheckpointError(f"{where}.format: expected {_FORMAT!r}, found {group.get('format')!r}")
            for part in ("weights", "input_activations"):
                g = group.get(part)
                if not g:
                    raise CheckpointError(f"{where}.{part}: NVFP4 (W4A4) needs it, found {g!r}")
                for key, want in _GROUP.items():
                    if key != "symmetric" and g.get(key) != want:
                        raise CheckpointError(f"{where}.{part}.{key}: NVFP4 uses {want!r}, found {g.get(key)!r}")
            dyn = group["input_activations"].get("dynamic")
            if dyn != "local":
                raise CheckpointError(
                    f"{where}.input_activations.dynamic: NVFP4 activations use 'local' (dynamic "
                    f"block scales under a static global scale), found {dyn!r}"
                )
            if group["weights"].get("dynamic"):
                raise CheckpointError(f"{where}.weights.dynamic: expected false, found {group['weights']['dynamic']!r}")
        status = qc.get("quantization_status", "compressed")
        if status != "compressed":
            raise CheckpointError(f"quantization_config.quantization_status: expected 'compressed', found {status!r}")
        return CheckpointDescription(self.name, get_moe_scheme(NVFP4.name), list(qc.get("ignore") or []), None)

    # ----------------------------------------------------------------------------- tensors

    def quantize_experts(self, w13: torch.Tensor, w2: torch.Tensor, scheme) -> ExpertWeights:
        """One layer's experts in compressed-tensors' arithmetic (gate and up share a global scale)."""
        e, two_i, h = w13.shape
        p13, s13, p2, s2 = [], [], [], []
        g13 = torch.empty(e, dtype=torch.float32)
        g2 = torch.empty(e, dtype=torch.float32)
        for x in range(e):
            g13[x] = _encode_global_scale(w13[x].abs().amax())
            p, s, _ = quantize_nvfp4_encode(w13[x], g13[x])
            p13.append(p)
            s13.append(s)
            p, s, g2[x] = quantize_nvfp4_encode(w2[x])
            p2.append(p)
            s2.append(s)
        return ExpertWeights(
            NVFP4,
            torch.stack(p13),
            torch.stack(s13),
            torch.stack(p2),
            torch.stack(s2),
            g13,
            g2,
            global_scale_kind="encode",
        )

    def quantize_linear(self, weight: torch.Tensor, scheme) -> LinearWeights:
        p, s, g = quantize_nvfp4_encode(weight)
        return LinearWeights(NVFP4, p, s, g, global_scale_kind="encode")

    @staticmethod
    def input_global_scale(decode_scale: torch.Tensor) -> torch.Tensor:
        """Encode activation scale from a decode one (``amax / 2688``), rounded to bf16 like
        llm-compressor's; 0 (never calibrated) stays 0."""
        d = decode_scale.float()
        return torch.where(d > 0, (1.0 / torch.where(d > 0, d, 1.0)).to(torch.bfloat16).float(), 0.0)

    def stored_input_scale(self, decode_scale: torch.Tensor) -> torch.Tensor:
        """``input_global_scale``: the stored encode scale of a calibrated decode one."""
        return self.input_global_scale(decode_scale)

    def expert_tensors(self, scheme, weights: ExpertWeights, w13_input_scale, w2_input_scale, prefix: str) -> dict:
        if weights.global_scale_kind != "encode":
            raise ValueError(
                "weights: the compressed-tensors layout stores encode global scales; quantize with quantize_experts"
            )
        out: dict[str, torch.Tensor] = {}
        # input scales: encode scales as stored (stored_input_scale)
        for x, proj, p, s, g, ins in expert_parts(weights, w13_input_scale, w2_input_scale):
            base = f"{prefix}.{x}.{proj}"
            out[f"{base}.weight_packed"] = p
            out[f"{base}.weight_scale"] = s
            out[f"{base}.weight_global_scale"] = g.reshape(1).float().cpu().clone()
            out[f"{base}.input_global_scale"] = ins.reshape(1).float().cpu().clone()
        return out

    def read_experts(self, tensors, prefix: str, e: int, h: int, i: int, description: CheckpointDescription):
        # the stored encode scales get the range check of decode ones: block scales no
        # NaN or negative e4m3, weight_global_scale in [2**-126, 2**126], input_global_scale also 0
        gs = global_scale_check(what="weight_global_scale")
        ins_ok = global_scale_check(True, "input_global_scale")

        def scalars(names, check=gs):
            return read_scalar_scales(tensors, names, (1,), check).reshape(e)

        parts = read_block_experts(
            tensors, prefix, e, h, i, NVFP4, "weight_packed", global_scale="weight_global_scale", read_scalars=scalars
        )
        weights = ExpertWeights(NVFP4, *parts, global_scale_kind="encode")
        ins = {p: scalars([f"{prefix}.{x}.{p}.input_global_scale" for x in range(e)], ins_ok) for p in PROJS}

        def calibrated(t):  # an encode scale that is not positive and finite marks an uncalibrated expert
            return torch.where(torch.isfinite(t) & (t > 0), t, 0.0)

        # gate and up see the same input: the smaller encode scale (the larger amax) covers both
        return weights, calibrated(torch.minimum(ins["gate_proj"], ins["up_proj"])), calibrated(ins["down_proj"])

    def linear_tensors(self, scheme, weights: LinearWeights, input_scale, name: str) -> dict:
        return {
            f"{name}.weight_packed": weights.weight.contiguous().cpu(),
            f"{name}.weight_scale": weights.weight_scale.contiguous().cpu(),
            f"{name}.weight_global_scale": weights.weight_scale_2.reshape(1).float().cpu().clone(),
            f"{name}.input_global_scale": input_scale.reshape(1).float().cpu().clone(),
        }

    def read_linear(self, tensors, name: str, out_features: int, in_features: int, description: CheckpointDescription):
        """``(LinearWeights with encode global scale, input_global_scale fp32 [1])``."""
        bs = NVFP4.block_size
        w = tensors.get(f"{name}.weight_packed", (out_features, in_features // 2), torch.uint8)
        s = tensors.stack(
            [f"{name}.weight_scale"],
            (out_features, in_features // bs),
            torch.float8_e4m3fn,
            block_scale_check(e4m3=True),
        )[0]
        g = read_scalar_scales(
            tensors, [f"{name}.weight_global_scale"], (1,), global_scale_check(what="weight_global_scale")
        )
        ins = read_scalar_scales(
            tensors, [f"{name}.input_global_scale"], (1,), global_scale_check(True, "input_global_scale")
        )
        return LinearWeights(NVFP4, w, s, g.reshape(()), global_scale_kind="encode"), ins.reshape(1)


LAYOUT = CompressedTensorsNvfp4Layout()  # registered by the package's __init__
