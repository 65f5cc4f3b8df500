"""AMD Quark OCP MX layout.

Per expert ``e`` of layer ``L`` and projection ``p``: ``...e.p.weight`` uint8 packed (FP4
``[out, in/2]``, FP6 ``[out, 3*in/4]``; MXFP8: float8_e4m3fn ``[out, in]``, one code a byte, read as
uint8 too), ``...e.p.weight_scale`` uint8 E8M0 ``[out, in/32]``, and
``...e.p.input_scale`` ``[]`` for static FP8 activations only (amd-quark 0.13 stores it as bf16:
read widened to fp32 exactly; the writer writes fp32), with
``quantization_config.quant_method: quark`` (``global_quant_config`` weight / input_tensors,
``exclude``, ``export``). Real exports carry many more keys; the reader tolerates them and rejects
what the emulation cannot honour, naming the field. FP8 weights (``dtype: fp8_e4m3``, ``per_tensor`` or
``per_channel``: FP8 linear layers of mixed checkpoints) are read by ``fp8_linear``.

``exclude``: the reader takes exact module names, fnmatch globs and ``re:<regex>`` patterns
(``layout.matches``; vLLM's ``should_ignore_layer`` takes names and ``re:``). The writer lists every
module it stores unquantized by its exact name, in the model's module order (per decoder layer the bf16
``self_attn.{q,k,v,o}_proj``, the router, any shared expert or dense MLP; ``lm_head`` last), as Quark's own
export does: amd-quark's importer (``import_model_from_safetensors``, 0.13) matches entries as names or
fnmatch globs only, so a ``re:`` entry excludes nothing there and it takes the bf16 modules for quantized ones.

MXFP8 is Quark's ``OCP_MXFP8E4M3Spec``: ``dtype: fp8_e4m3`` with ``qscheme: per_group``,
``group_size: 32``, ``scale_format: e8m0`` (the same dtype with ``qscheme: per_tensor`` is the static
per-tensor FP8 activation of the ``_a_fp8`` schemes): weights for ``w_mxfp8`` / ``w_mxfp8_a_mxfp8``,
dynamic activations for ``w_mxfp8_a_mxfp8`` and ``w_mxfp4_a_mxfp8``.

With attention not excluded, ``self_attn.{q,k,v,o}_proj`` carry the same tensors as an expert's
projection (emulated by ``mxlib.moe.linear.EmulatedLinear``).

Quantized outputs are refused, naming the field: an FP8 KV cache (``kv_cache_quant_config``, Quark's
``kv_cache_scheme="fp8"``, which amd-quark 0.13 exports as ``k_proj.output_scale`` / ``v_proj.output_scale`` beside
``layer_quant_config`` entries ``*k_proj`` / ``*v_proj`` with ``output_tensors``), a quantized attention softmax
(``softmax_quant_spec``) and ``output_tensors`` in any layer config. The emulation runs layer outputs, the KV cache
and attention in the activation dtype; loading such a checkpoint would drop their quantization silently.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...formats import BLOCK_SCHEMES, FP8_E4M3_PER_TENSOR, SCALE_MODES, BlockScheme
from ...moe.emulation import ExpertWeights
from ...moe.linear import LinearWeights
from ...moe.schemes import MOE_SCHEMES, MoEQuantScheme
from .. import precision
from ..layout import (
    PROJS,
    CheckpointDescription,
    CheckpointError,
    CheckpointLayout,
    block_scale_check,
    expert_parts,
    global_scale_check,
)
from ..scalars import read_scalar_scales, read_static_input_scales
from . import fp8_linear

__all__ = ["LAYOUT"]

# Quark's dtype names of the block schemes it stores (and of the per-tensor FP8 activation)
_DTYPE = {
    BLOCK_SCHEMES["mxfp4"]: "fp4",
    BLOCK_SCHEMES["mxfp6_e2m3"]: "fp6_e2m3",
    BLOCK_SCHEMES["mxfp6_e3m2"]: "fp6_e3m2",
    BLOCK_SCHEMES["mxfp8_e4m3"]: "fp8_e4m3",
}
_FROM_DTYPE = {v: k for k, v in _DTYPE.items()}
_FP8_DTYPE = "fp8_e4m3"  # per_group: MXFP8 (in _FROM_DTYPE); per_tensor: static FP8 activations
_WEIGHT_SCALE_MODE = "even"


def _tensor_config(fmt, scale_mode: str) -> dict | None:
    if fmt is None:
        return None
    if fmt == FP8_E4M3_PER_TENSOR:
        return {
            "dtype": _FP8_DTYPE,
            "qscheme": "per_tensor",
            "ch_axis": None,
            "group_size": None,
            "is_dynamic": False,
            "symmetric": True,
            "round_method": "half_even",
            "scale_type": "float",
            "scale_format": None,
            "scale_calculation_mode": None,
            "mx_element_dtype": None,
            "observer_cls": "PerTensorMinMaxObserver",
            "is_scale_quant": False,
            "block_size": None,
        }
    return {
        "dtype": _DTYPE[fmt],
        "qscheme": "per_group",
        "ch_axis": -1,
        "group_size": fmt.block_size,
        "is_dynamic": True,
        "symmetric": None,
        "round_method": "half_even",
        "scale_type": "float",
        "scale_format": fmt.scale.name,
        "scale_calculation_mode": scale_mode,
        "mx_element_dtype": None,
        "observer_cls": "PerBlockMXObserver",
        "is_scale_quant": False,
        "block_size": None,
    }


def _stored_dtype(fmt: BlockScheme) -> torch.dtype:
    """The dtype weights are stored in: uint8 packed bytes, or the element's own torch dtype for
    one-byte elements (MXFP8: float8_e4m3fn)."""
    return getattr(torch, fmt.element.ml_dtypes_name) if fmt.element.nbits == 8 else torch.uint8


def _read_weight(tensors, names: list[str], shape, fmt: BlockScheme, out=None) -> torch.Tensor:
    """Weights as uint8 bytes (the emulation's form); MXFP8 stored as float8_e4m3fn or as uint8."""
    dtype = _stored_dtype(fmt)
    if dtype != torch.uint8 and tensors.get(names[0]).dtype == torch.uint8:
        dtype = torch.uint8  # the same bytes, stored as uint8
    buf = None if out is None else out.view(dtype)
    return tensors.stack(names, shape, dtype, out=buf).view(torch.uint8)


def _spec_summary(spec) -> str:
    if not isinstance(spec, dict):
        return repr(spec)[:80]
    return f"dtype={spec.get('dtype')!r} qscheme={spec.get('qscheme')!r} is_dynamic={spec.get('is_dynamic')!r}"


def _refuse_output_quantization(qc: dict) -> None:
    """Refuse what quantizes outputs rather than weights and inputs: an FP8 KV cache (``kv_cache_quant_config``,
    whose scales amd-quark 0.13 stores as ``k_proj.output_scale`` / ``v_proj.output_scale``), a quantized attention
    softmax (``softmax_quant_spec``), or ``output_tensors`` in any layer config. The emulation runs layer outputs, the
    KV cache and attention in the activation dtype, so loading such a checkpoint would drop them silently.

    Raises:
        CheckpointError: naming the field, the patterns it covers and what it asks.
    """
    kv = qc.get("kv_cache_quant_config") or {}
    if kv:
        asked = {p: _spec_summary((c or {}).get("output_tensors")) for p, c in kv.items()}
        raise CheckpointError(
            f"quantization_config.kv_cache_quant_config: the checkpoint quantizes the KV cache (the outputs of "
            f"{sorted(asked)}: {'; '.join(f'{p} {a}' for p, a in asked.items())}; scales stored as "
            f"<module>.output_scale); the emulation runs the KV cache in the activation dtype, so it refuses this "
            f"checkpoint rather than drop the KV-cache quantization"
        )
    if qc.get("softmax_quant_spec"):
        raise CheckpointError(
            f"quantization_config.softmax_quant_spec: the checkpoint quantizes the attention softmax "
            f"({_spec_summary(qc['softmax_quant_spec'])}); the emulation runs attention in the activation dtype"
        )
    groups = [("global_quant_config", qc.get("global_quant_config"))]
    for where in ("layer_quant_config", "layer_type_quant_config"):
        groups += [(f"{where}[{k!r}]", v) for k, v in (qc.get(where) or {}).items()]
    for where, cfg in groups:
        out = cfg.get("output_tensors") if isinstance(cfg, dict) else None
        if out:
            raise CheckpointError(
                f"quantization_config.{where}.output_tensors: the checkpoint quantizes layer outputs "
                f"({_spec_summary(out)}); the emulation quantizes weights and inputs only"
            )


class QuarkOcpMxLayout(CheckpointLayout):
    name = "quark"
    quant_method = "quark"
    supports_linear = True

    def handles(self, scheme: MoEQuantScheme) -> bool:
        return scheme.weight in _DTYPE

    # ----------------------------------------------------------------------------- config

    def config_files(self, scheme: MoEQuantScheme, quantize_attention: bool = False) -> tuple[dict, dict[str, dict]]:
        weight = _tensor_config(scheme.weight, _WEIGHT_SCALE_MODE)
        weight["is_dynamic"] = False
        qc = {
            "quant_method": self.quant_method,
            "global_quant_config": {
                "weight": weight,
                "input_tensors": _tensor_config(scheme.activation, _WEIGHT_SCALE_MODE),
                "output_tensors": None,
                "bias": None,
                "target_device": None,
            },
            # exact names only, filled by add_excluded with every module the checkpoint stores bf16
            "exclude": [],
            "layer_quant_config": {},
            "layer_type_quant_config": {},
            "kv_cache_quant_config": {},
            "algo_config": None,
            "quant_mode": "eager_mode",
            "export": {
                "weight_format": "real_quantized",
                "pack_method": "reorder",
                "kv_cache_group": [],
                "min_kv_scale": 0.0,
                "weight_merge_groups": None,
            },
            "version": "mxlib-dummy",
        }
        return qc, {}

    def read_legacy(self, folder: Path) -> dict | None:
        return None

    @staticmethod
    def _check_group(cfg: dict, where: str, fmt: BlockScheme) -> None:
        for field, want in (("qscheme", "per_group"), ("group_size", fmt.block_size), ("scale_format", fmt.scale.name)):
            if cfg.get(field) != want:
                raise CheckpointError(
                    f"quantization_config.global_quant_config.{where}.{field}: the emulation supports {want!r}, "
                    f"found {cfg.get(field)!r}"
                )

    def read_config(self, qc: dict) -> CheckpointDescription:
        _refuse_output_quantization(qc)
        if precision.is_mixed(qc):  # per-layer / per-type configs that differ (mxlib.checkpoints.precision)
            return precision.mixed_description(self.name, qc, self.read_config)
        g = qc.get("global_quant_config") or {}
        w = g.get("weight")
        if not w:
            raise CheckpointError("quantization_config.global_quant_config.weight: missing")
        wdtype = w.get("dtype")
        if wdtype == fp8_linear.QUARK_DTYPE and w.get("qscheme") in fp8_linear.QUARK_QSCHEMES:  # FP8 linear
            return fp8_linear.QUARK.read_config(qc)
        if wdtype not in _FROM_DTYPE:
            raise CheckpointError(
                f"quantization_config.global_quant_config.weight.dtype: supported {sorted(_FROM_DTYPE)}, "
                f"found {wdtype!r}"
            )
        weight = _FROM_DTYPE[wdtype]
        self._check_group(w, "weight", weight)
        if w.get("ch_axis", -1) not in (-1, 1):
            raise CheckpointError(
                f"quantization_config.global_quant_config.weight.ch_axis: expected -1, found {w.get('ch_axis')!r}"
            )
        a = g.get("input_tensors")
        act = None
        mode = _WEIGHT_SCALE_MODE
        if a:
            adtype = a.get("dtype")
            if adtype == _FP8_DTYPE and a.get("qscheme") != "per_group":
                if a.get("qscheme") != "per_tensor" or a.get("is_dynamic"):
                    raise CheckpointError(
                        f"quantization_config.global_quant_config.input_tensors: {_FP8_DTYPE} is supported as static "
                        f"per_tensor only, found qscheme={a.get('qscheme')!r} is_dynamic={a.get('is_dynamic')!r}"
                    )
                act = FP8_E4M3_PER_TENSOR
            elif adtype in _FROM_DTYPE:
                act = _FROM_DTYPE[adtype]
                self._check_group(a, "input_tensors", act)
                if not a.get("is_dynamic", True):
                    raise CheckpointError(
                        "quantization_config.global_quant_config.input_tensors.is_dynamic: MX "
                        "activations must be dynamic (true), found false"
                    )
                mode = a.get("scale_calculation_mode") or _WEIGHT_SCALE_MODE
                if mode not in SCALE_MODES:
                    raise CheckpointError(
                        f"quantization_config.global_quant_config.input_tensors.scale_calculation_mode: supported "
                        f"{list(SCALE_MODES)}, found {mode!r}"
                    )
            else:
                raise CheckpointError(
                    f"quantization_config.global_quant_config.input_tensors.dtype: supported "
                    f"{sorted(_FROM_DTYPE) + [_FP8_DTYPE]}, found {adtype!r}"
                )
        scheme = next((s for s in MOE_SCHEMES.values() if s.weight == weight and s.activation == act), None)
        if scheme is None:
            raise CheckpointError(
                f"quantization_config.global_quant_config: weight {wdtype!r} with input_tensors "
                f"{a.get('dtype') if a else None!r} is not a supported Quark MoE scheme (supported: w_mxfp4*, "
                f"w_mxfp6_e3m2*, w_mxfp6_e2m3*, w_mxfp8* as listed in mxlib.moe.schemes)"
            )
        exp = qc.get("export") or {}
        if exp.get("weight_format", "real_quantized") != "real_quantized":
            raise CheckpointError(
                f"quantization_config.export.weight_format: expected 'real_quantized', "
                f"found {exp.get('weight_format')!r}"
            )
        return CheckpointDescription(self.name, scheme, list(qc.get("exclude") or []), mode)

    # ----------------------------------------------------------------------------- tensors

    def expert_tensors(self, scheme, weights: ExpertWeights, w13_input_scale, w2_input_scale, prefix: str) -> dict:
        static = scheme.static_activation_scale
        stored = _stored_dtype(weights.scheme)
        out: dict[str, torch.Tensor] = {}
        for x, proj, p, s, _, ins in expert_parts(weights, w13_input_scale, w2_input_scale):
            base = f"{prefix}.{x}.{proj}"
            out[f"{base}.weight"] = p.view(stored)
            out[f"{base}.weight_scale"] = s
            if static:
                out[f"{base}.input_scale"] = ins.reshape(()).float().cpu().clone()
        return out

    def read_experts(self, tensors, prefix: str, e: int, h: int, i: int, description: CheckpointDescription):
        scheme = description.scheme
        fmt = scheme.weight
        bs = fmt.block_size
        rows = {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}

        def stack(proj, what, shape, dtype, check=None, out=None):
            return tensors.stack([f"{prefix}.{x}.{proj}.{what}" for x in range(e)], shape, dtype, check, out)

        # block scales (E8M0 0xFF is NaN) and static input scales are checked here, naming the tensor
        u8, blocks = torch.uint8, block_scale_check(e4m3=False)
        packed = {p: (rows[p][0], fmt.element.packed_size(rows[p][1])) for p in PROJS}
        sshape = {p: (rows[p][0], rows[p][1] // bs) for p in PROJS}
        w13 = torch.empty(e, 2 * i, packed["gate_proj"][1], dtype=u8)  # gate and up read into place
        s13 = torch.empty(e, 2 * i, sshape["gate_proj"][1], dtype=u8)

        def names(proj, what):
            return [f"{prefix}.{x}.{proj}.{what}" for x in range(e)]

        for j, p in enumerate(("gate_proj", "up_proj")):
            _read_weight(tensors, names(p, "weight"), packed[p], fmt, out=w13[:, j * i : (j + 1) * i])
            stack(p, "weight_scale", sshape[p], u8, blocks, out=s13[:, j * i : (j + 1) * i])
        weights = ExpertWeights(
            fmt,
            w13,
            s13,
            _read_weight(tensors, names("down_proj", "weight"), packed["down_proj"], fmt),
            stack("down_proj", "weight_scale", sshape["down_proj"], u8, blocks),
        )
        if not scheme.static_activation_scale:
            return weights, None, None
        return (weights, *read_static_input_scales(tensors, prefix, e))

    def linear_tensors(self, scheme, weights: LinearWeights, input_scale, name: str) -> dict:
        out = {
            f"{name}.weight": weights.weight.contiguous().cpu().view(_stored_dtype(weights.scheme)),
            f"{name}.weight_scale": weights.weight_scale.contiguous().cpu(),
        }
        if scheme.static_activation_scale:
            out[f"{name}.input_scale"] = input_scale.reshape(()).float().cpu().clone()
        return out

    def read_linear(self, tensors, name: str, out_features: int, in_features: int, description: CheckpointDescription):
        """``(LinearWeights, input_scale fp32 [1] or None)`` of a quantized linear layer ``name``."""
        scheme = description.scheme
        fmt = scheme.weight
        w = _read_weight(tensors, [f"{name}.weight"], (out_features, fmt.element.packed_size(in_features)), fmt)[0]
        s = tensors.stack(
            [f"{name}.weight_scale"],
            (out_features, in_features // fmt.block_size),
            torch.uint8,
            block_scale_check(e4m3=False),
        )[0]
        ins = None
        if scheme.static_activation_scale:
            ins = read_scalar_scales(tensors, [f"{name}.input_scale"], (), global_scale_check(True, "input_scale"))
        return LinearWeights(fmt, w, s), ins


LAYOUT = QuarkOcpMxLayout()  # registered by the package's __init__
