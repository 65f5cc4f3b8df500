"""FP8 linear layers of the three producers: the "FP8 attention" beside FP4 experts of mixed checkpoints.

One layout per producer, each for linear layers only (``supports_linear``; experts in FP8 are refused, naming the
layer's tensors). Per quantized linear layer ``name`` (``model.layers.L.self_attn.q_proj``, ``lm_head``)::

    name.weight        float8_e4m3fn  [out, in]          one e4m3 code a byte
    name.weight_scale  float          per tensor or per output channel (shapes below), decode: w = e4m3 * scale
    name.input_scale   float          one value, static activations only (decode: amax / 448)

===========================  ===========================  ============================  ===============
producer (layout)            config                       weight_scale                  input_scale
===========================  ===========================  ============================  ===============
ModelOpt (``modelopt-fp8``)  ``quant_algo: FP8``;         ``[]`` (FP8), ``[out]``        ``[]`` (FP8)
                             ``FP8_PER_CHANNEL_PER_TOKEN``  (per channel per token)
Quark (``quark-fp8``)        ``dtype: fp8_e4m3``,         ``[]`` (``per_tensor``),       ``[]`` (static)
                             ``qscheme`` per_tensor /     ``[out]`` (``per_channel``)
                             per_channel
compressed-tensors           ``format: float-quantized``, bf16 ``[1]`` (``strategy:        bf16 ``[1]``
(``compressed-tensors-fp8``)  8-bit ``type: float``        tensor``), ``[out, 1]``        (static)
                                                          (``channel``)
===========================  ===========================  ============================  ===============

Sources (the producers' own code): NVIDIA/Model-Optimizer ``modelopt/torch/export/quant_utils.py``
(``to_quantized_weight``: ``(weight / weights_scaling_factor).to(torch.float8_e4m3fn)``, the quotient of a bf16
weight and a 0-d fp32 scale rounded to bf16 before e4m3; ``get_scaling_factor``:
``amax.float() / maxbound``, fp32; ``process_layer_quant_config``: ``{"quant_algo": "FP8"}`` and
``{"quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"}`` per layer) and ``modelopt/torch/export/convert_hf_config.py``
(``_quant_algo_to_group_config``: 8-bit float weights and static 8-bit float activations, ``strategy: channel``
for the per-channel form); amd/Quark ``quark/torch/quantization/config/config.py`` (``FP8E4M3PerTensorSpec``,
``FP8E4M3PerChannelSpec``: ``dtype`` ``fp8_e4m3``, ``qscheme`` ``per_tensor`` / ``per_channel``, round half even)
as vLLM reads their export (vllm-project/vllm
``vllm/model_executor/layers/quantization/quark/schemes/quark_w8a8_fp8.py``: weight ``qscheme`` ``per_tensor`` or
``per_channel`` with an ``[out]`` scale, static ``per_tensor`` or dynamic ``per_channel`` (per-token) input);
vllm-project/compressed-tensors ``src/compressed_tensors/compressors/naive_quantized/base.py``
(``FloatQuantizationCompressor``, format ``float-quantized``: ``weight`` in the 8-bit float dtype, ``weight_scale``
beside it, ``dequantize``) with vLLM's ``compressed_tensors_w8a8_fp8.py`` (``strategy`` ``tensor`` or ``channel``,
``[out, 1]`` channel scales; static ``input_scale`` or dynamic ``token`` activations).

Scales stored as bf16 or fp16 (amd-quark writes its scales in the model's dtype, llm-compressor may too) are
widened to fp32 exactly (``scalars.widen_scale``) and a saved model writes them back in the dtype and shape the
source stored (``saving._conform``), so a checkpoint round-trips byte for byte. The scheme is ``w_fp8_a_fp8``
(static per-tensor activations) or ``w_fp8_a_fp8_per_token`` (dynamic per-token activations; no ``input_scale``);
which weight-scale granularity a layer has is read from its tensor (one value or ``out`` values), and checked to
be one the producer writes. mxlib's writer (``quantize_linear``) writes per-tensor weight scales for
``w_fp8_a_fp8`` and per-channel ones for ``w_fp8_a_fp8_per_token``, as the producers' presets pair them (ModelOpt
``FP8`` / ``FP8_PER_CHANNEL_PER_TOKEN``; llm-compressor ``FP8`` / ``FP8_DYNAMIC``).

The compressed-tensors and Quark writers follow llm-compressor 0.14.0.1 / compressed-tensors 0.19.0
(``scale_dtype: null``: the scale in the weight's dtype; ``calculate_qparams``, ``_quantize``) and amd-quark 0.13's
export (``real_quantize_fp8_e4m3_per_tensor_with_scale``: the bf16 weight divided by the bf16 scale in bf16), which
for a bf16 weight is ``scale = bf16(amax / 448)``, codes ``e4m3(clamp(bf16(w / scale), -448, 448))`` (the division
rounded to bf16 before the e4m3 rounding; a zero ``amax`` gives the dtype's eps as scale), ``weight_scale`` and the
static ``input_scale`` (``bf16(amax / 448)``) stored bf16: from the same bf16 weights this is each tool's export
byte for byte (``tests/test_interop_mixed_llmc.py``, ``tests/test_interop_mixed_quark.py``), where the fp32
arithmetic of ``quantize_fp8_weight`` changes the scale and a few percent of the codes. A scale that is not a bf16
value (a checkpoint written otherwise) is written as fp32.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ... import reference as _ref
from ...formats import FP8_E4M3_PER_TENSOR
from ...moe.linear import LinearWeights
from ...moe.schemes import W_FP8_A_FP8, W_FP8_A_FP8_PER_TOKEN, MoEQuantScheme
from ..layout import CheckpointDescription, CheckpointError, CheckpointLayout, global_scale_check
from ..scalars import widen_scale

__all__ = [
    "quantize_fp8_in_weight_dtype",
    "ModelOptFp8Layout",
    "QuarkFp8Layout",
    "CompressedTensorsFp8Layout",
    "MODELOPT",
    "QUARK",
    "COMPRESSED_TENSORS",
]

_FP8 = FP8_E4M3_PER_TENSOR
_STORED = torch.float8_e4m3fn
_SCHEMES = (W_FP8_A_FP8, W_FP8_A_FP8_PER_TOKEN)
_PRODUCER = {"name": "modelopt", "version": "mxlib-dummy"}


class _Fp8LinearLayout(CheckpointLayout):
    """What the three producers' FP8 linear layers share: the tensors, their checks, the refusal of FP8 experts.
    Subclasses give ``name``, ``quant_method`` and the config; the stored scale shapes are ModelOpt's and Quark's
    (``[]`` per tensor, ``[out]`` per channel, ``[]`` input scale) unless a subclass overrides them."""

    supports_linear = True

    def handles(self, scheme: MoEQuantScheme) -> bool:
        return scheme in _SCHEMES

    def read_legacy(self, folder: Path) -> dict | None:
        return None  # the producer's main layout reads the config files

    def _scale_shape(self, out: int, per_channel: bool) -> tuple[int, ...]:
        return (out,) if per_channel else ()

    def _input_scale_shape(self) -> tuple[int, ...]:
        return ()

    # ----------------------------------------------------------------------------- experts: refused

    def expert_tensors(self, scheme, weights, w13_input_scale, w2_input_scale, prefix: str) -> dict:
        raise CheckpointError(f"{prefix}: {self.name} stores FP8 linear layers only; the experts take block formats")

    def read_experts(self, tensors, prefix: str, e: int, h: int, i: int, description: CheckpointDescription):
        raise CheckpointError(
            f"{prefix}: the checkpoint stores these experts in FP8 with a per-tensor or per-channel scale "
            f"({description.scheme.name}); the emulation runs FP8 in linear layers only, experts in the block "
            f"formats of mxlib.moe.schemes.MOE_SCHEMES"
        )

    # ----------------------------------------------------------------------------- linear layers

    def quantize_linear(self, weight: torch.Tensor, scheme: MoEQuantScheme) -> LinearWeights:
        """Per-tensor weight scales for ``w_fp8_a_fp8``, per-channel ones for ``w_fp8_a_fp8_per_token``."""
        codes, scale = _ref.quantize_fp8_weight(weight, per_channel=scheme is W_FP8_A_FP8_PER_TOKEN)
        return LinearWeights(_FP8, codes, scale)

    def linear_tensors(self, scheme, weights: LinearWeights, input_scale, name: str) -> dict:
        out = weights.out_features
        s = weights.weight_scale
        per_channel = s.numel() == out and out > 1
        tensors = {
            f"{name}.weight": weights.weight.contiguous().cpu().view(_STORED),
            f"{name}.weight_scale": s.float().reshape(self._scale_shape(out, per_channel)).cpu().clone(),
        }
        if scheme.static_activation_scale:
            tensors[f"{name}.input_scale"] = input_scale.float().reshape(self._input_scale_shape()).cpu().clone()
        return tensors

    def read_linear(self, tensors, name: str, out_features: int, in_features: int, description: CheckpointDescription):
        """``(LinearWeights, input_scale fp32 [] or None)`` of an FP8 linear layer ``name``.

        Raises:
            CheckpointError: ``weight`` not float8_e4m3fn ``[out, in]``; ``weight_scale`` or ``input_scale`` of
                another shape than the producer writes, of a dtype that does not widen to fp32 exactly, or not
                positive and finite; ``input_scale`` missing where the scheme's activations are static. Each
                message names the tensor.
        """
        w = tensors.get(f"{name}.weight", (out_features, in_features), _STORED).view(torch.uint8)
        sname = f"{name}.weight_scale"
        raw = tensors.get(sname, None, None)
        shapes = {self._scale_shape(out_features, False), self._scale_shape(out_features, True)}
        if tuple(raw.shape) not in shapes:
            raise CheckpointError(
                f"tensor {sname!r}: expected shape {' or '.join(str(list(s)) for s in sorted(shapes, key=len))} "
                f"(per tensor or per output channel, {self.name}), found {list(raw.shape)}"
            )
        scale = widen_scale(raw, sname).reshape(-1)
        _check_values(scale, sname, global_scale_check(False, "weight_scale"))
        scale = scale.reshape(()) if scale.numel() == 1 else scale
        ins = None
        if description.scheme.static_activation_scale:
            iname = f"{name}.input_scale"
            if iname not in tensors:
                raise CheckpointError(
                    f"checkpoint is missing tensor {iname!r}: {description.scheme.name} quantizes {name}'s input "
                    f"with a static per-tensor scale"
                )
            raw_in = tensors.get(iname, None, None)
            if raw_in.numel() != 1 or tuple(raw_in.shape) != self._input_scale_shape():
                raise CheckpointError(
                    f"tensor {iname!r}: expected shape {list(self._input_scale_shape())} (one static scale), "
                    f"found {list(raw_in.shape)}"
                )
            ins = widen_scale(raw_in, iname).reshape(())
            _check_values(ins, iname, global_scale_check(False, "input_scale"))
        return LinearWeights(_FP8, w, scale), ins


def _check_values(t: torch.Tensor, name: str, check) -> None:
    if t.is_meta:  # the inspector reads headers only
        return
    ok, what = check(t)
    if not ok:
        raise CheckpointError(f"tensor {name!r}: {what}")


# ----------------------------------------------------------------------------- ModelOpt

MODELOPT_ALGOS = {"FP8": W_FP8_A_FP8, "FP8_PER_CHANNEL_PER_TOKEN": W_FP8_A_FP8_PER_TOKEN}


class ModelOptFp8Layout(_Fp8LinearLayout):
    name = "modelopt-fp8"
    quant_method = "modelopt"

    def quantize_linear(self, weight: torch.Tensor, scheme: MoEQuantScheme) -> LinearWeights:
        """As the base class, but per tensor the quotient ``w / weight_scale`` is rounded to the weight's dtype
        before e4m3, as nvidia-modelopt's export forms it (``reference.quantize_fp8_weight``'s
        ``quotient_dtype``); per channel it divides in fp32, as ModelOpt does there."""
        if scheme is W_FP8_A_FP8_PER_TOKEN or weight.dtype not in (torch.bfloat16, torch.float16):
            return super().quantize_linear(weight, scheme)
        codes, scale = _ref.quantize_fp8_weight(weight, quotient_dtype=weight.dtype)
        return LinearWeights(_FP8, codes, scale)

    def config_files(self, scheme: MoEQuantScheme, quantize_attention: bool = False) -> tuple[dict, dict[str, dict]]:
        algo = next(a for a, s in MODELOPT_ALGOS.items() if s is scheme)
        weights = {"dynamic": False, "num_bits": 8, "type": "float"}
        if scheme is W_FP8_A_FP8_PER_TOKEN:
            weights["strategy"] = "channel"
        group = {"targets": ["Linear"], "weights": weights}
        group["input_activations"] = {"dynamic": False, "num_bits": 8, "type": "float"}
        qc = {
            "quant_method": self.quant_method,
            "quant_algo": algo,
            "producer": dict(_PRODUCER),
            "ignore": [],
            "config_groups": {"group_0": group},
            "kv_cache_scheme": None,
        }
        legacy = {"producer": dict(_PRODUCER), "quantization": {"quant_algo": algo, "exclude_modules": []}}
        return qc, {"hf_quant_config.json": legacy}

    def read_config(self, qc: dict) -> CheckpointDescription:
        algo = qc.get("quant_algo")
        if algo not in MODELOPT_ALGOS:
            raise CheckpointError(
                f"quantization_config.quant_algo: this layout reads {list(MODELOPT_ALGOS)}, found {algo!r}"
            )
        for gname, group in (qc.get("config_groups") or {}).items():
            for part in ("weights", "input_activations"):
                g = group.get(part) or {}
                if g.get("num_bits") not in (None, 8) or g.get("type") not in (None, "float"):
                    raise CheckpointError(
                        f"quantization_config.config_groups.{gname}.{part}: {algo} is 8-bit float, found "
                        f"num_bits={g.get('num_bits')!r} type={g.get('type')!r}"
                    )
        exclude = list(qc.get("ignore") or qc.get("exclude_modules") or [])
        return CheckpointDescription(self.name, MODELOPT_ALGOS[algo], exclude, None)


# ----------------------------------------------------------------------------- Quark

QUARK_DTYPE = "fp8_e4m3"
QUARK_QSCHEMES = ("per_tensor", "per_channel")  # the weight qschemes of FP8 linear layers (per_group: MXFP8)


def _quark_spec(qscheme: str, dynamic: bool) -> dict:
    return {
        "dtype": QUARK_DTYPE,
        "qscheme": qscheme,
        "ch_axis": 0 if qscheme == "per_channel" else None,
        "group_size": None,
        "is_dynamic": dynamic,
        "symmetric": True,
        "round_method": "half_even",
        "scale_type": "float",
        "observer_cls": "PerChannelMinMaxObserver" if qscheme == "per_channel" else "PerTensorMinMaxObserver",
    }


class _InWeightDtypeFp8Layout(_Fp8LinearLayout):
    """The writer of the producers that compute the FP8 scale and quotient in the weight's dtype and store the scales
    in it (``quantize_fp8_in_weight_dtype``; module docstring): compressed-tensors and Quark."""

    def quantize_linear(self, weight: torch.Tensor, scheme: MoEQuantScheme) -> LinearWeights:
        """Per tensor for ``w_fp8_a_fp8``, per output channel for ``w_fp8_a_fp8_per_token``, in the weight's
        dtype (``quantize_fp8_in_weight_dtype``)."""
        codes, scale = quantize_fp8_in_weight_dtype(weight, per_channel=scheme is W_FP8_A_FP8_PER_TOKEN)
        return LinearWeights(_FP8, codes, scale)

    def stored_input_scale(self, decode_scale: torch.Tensor) -> torch.Tensor:
        """``input_scale``: the calibrated decode scale ``amax / 448`` rounded to bf16 (computed in the activations'
        dtype), held in fp32."""
        return decode_scale.float().to(torch.bfloat16).float()

    def linear_tensors(self, scheme, weights: LinearWeights, input_scale, name: str) -> dict:
        """As the base class, the scales stored bf16 where they are bf16 values (module docstring)."""
        out = super().linear_tensors(scheme, weights, input_scale, name)
        for key in (f"{name}.weight_scale", f"{name}.input_scale"):
            if key in out:
                out[key] = _bf16_if_exact(out[key])
        return out


class QuarkFp8Layout(_InWeightDtypeFp8Layout):
    name = "quark-fp8"
    quant_method = "quark"

    def config_files(self, scheme: MoEQuantScheme, quantize_attention: bool = False) -> tuple[dict, dict[str, dict]]:
        per_token = scheme is W_FP8_A_FP8_PER_TOKEN
        g = {
            "weight": _quark_spec("per_channel" if per_token else "per_tensor", False),
            "input_tensors": _quark_spec("per_channel" if per_token else "per_tensor", per_token),
            "output_tensors": None,
            "bias": None,
        }
        if per_token:
            g["input_tensors"]["ch_axis"] = -1
        qc = {
            "quant_method": self.quant_method,
            "global_quant_config": g,
            "exclude": [],
            "export": {"weight_format": "real_quantized", "pack_method": "reorder"},
        }
        return qc, {}

    def read_config(self, qc: dict) -> CheckpointDescription:
        where = "quantization_config.global_quant_config"
        g = qc.get("global_quant_config") or {}
        w, a = g.get("weight") or {}, g.get("input_tensors")
        if w.get("dtype") != QUARK_DTYPE or w.get("qscheme") not in QUARK_QSCHEMES:
            raise CheckpointError(
                f"{where}.weight: this layout reads dtype {QUARK_DTYPE!r} per_tensor or per_channel, found "
                f"dtype={w.get('dtype')!r} qscheme={w.get('qscheme')!r}"
            )
        if w.get("is_dynamic"):
            raise CheckpointError(f"{where}.weight.is_dynamic: expected false, found {w.get('is_dynamic')!r}")
        if not a or a.get("dtype") != QUARK_DTYPE:
            raise CheckpointError(
                f"{where}.input_tensors: FP8 weights are emulated with FP8 activations (dtype {QUARK_DTYPE!r}), "
                f"found {None if not a else a.get('dtype')!r}"
            )
        if a.get("qscheme") == "per_tensor" and not a.get("is_dynamic"):
            scheme = W_FP8_A_FP8
        elif a.get("qscheme") == "per_channel" and a.get("is_dynamic"):
            scheme = W_FP8_A_FP8_PER_TOKEN
        else:
            raise CheckpointError(
                f"{where}.input_tensors: FP8 activations are read static per_tensor or dynamic per_channel (per "
                f"token), found qscheme={a.get('qscheme')!r} is_dynamic={a.get('is_dynamic')!r}"
            )
        return CheckpointDescription(self.name, scheme, list(qc.get("exclude") or []), None)


# ----------------------------------------------------------------------------- compressed-tensors

CT_FORMAT = "float-quantized"


def quantize_fp8_in_weight_dtype(weight: torch.Tensor, per_channel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """An ``[out, in]`` weight in FP8 e4m3 as compressed-tensors 0.19 and amd-quark 0.13's export quantize it
    (module docstring): the scale ``amax / 448`` and the quotient ``w / scale`` each rounded to the weight's dtype,
    then e4m3 (RNE).

    Returns:
        ``(codes uint8 [out, in] (e4m3 bytes), weight_scale fp32 [] or [out], a value of the weight's dtype)``.

    Raises:
        ValueError: ``weight`` not 2-D; TypeError: not a float dtype.
    """
    if weight.ndim != 2:
        raise ValueError(f"weight: expected [out, in], got shape {list(weight.shape)}")
    if not weight.is_floating_point():
        raise TypeError(f"weight: expected a float dtype, got {weight.dtype}")
    if weight.numel() == 0:  # an empty weight: as quantize_fp8_weight (scale 1)
        return _ref.quantize_fp8_weight(weight, per_channel)
    w = weight.detach()
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax()
    e4m3 = _FP8.element
    scale = amax / torch.tensor(e4m3.max, dtype=w.dtype, device=w.device)  # in the weight's dtype
    scale = torch.where(scale == 0, torch.finfo(w.dtype).eps, scale)
    q = torch.clamp(w / scale, -e4m3.max, e4m3.max)  # one rounding to the weight's dtype, then e4m3
    codes = _ref.round_to_element(q.float(), e4m3).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes, scale.float().reshape(-1) if per_channel else scale.float().reshape(())


def _bf16_if_exact(t: torch.Tensor) -> torch.Tensor:
    """``t`` as bf16 where every value is a bf16 value (what compressed-tensors stores), else as fp32."""
    b = t.to(torch.bfloat16)
    return b if torch.equal(b.float(), t.float()) else t.float()


class CompressedTensorsFp8Layout(_InWeightDtypeFp8Layout):
    name = "compressed-tensors-fp8"
    quant_method = "compressed-tensors"

    def _scale_shape(self, out: int, per_channel: bool) -> tuple[int, ...]:
        return (out, 1) if per_channel else (1,)

    def _input_scale_shape(self) -> tuple[int, ...]:
        return (1,)

    def config_files(self, scheme: MoEQuantScheme, quantize_attention: bool = False) -> tuple[dict, dict[str, dict]]:
        per_token = scheme is W_FP8_A_FP8_PER_TOKEN
        base = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "block_structure": None}
        group = {
            "targets": ["Linear"],
            "weights": {
                **base,
                "strategy": "channel" if per_token else "tensor",
                "dynamic": False,
                "observer": "minmax",
            },
            "input_activations": {
                **base,
                "strategy": "token" if per_token else "tensor",
                "dynamic": per_token,
                "observer": None if per_token else "minmax",
            },
            "output_activations": None,
            "format": CT_FORMAT,
        }
        qc = {
            "quant_method": self.quant_method,
            "format": CT_FORMAT,
            "quantization_status": "compressed",
            "config_groups": {"group_0": group},
            "ignore": [],
            "kv_cache_scheme": None,
        }
        return qc, {}

    def read_config(self, qc: dict) -> CheckpointDescription:
        groups = qc.get("config_groups") or {}
        if qc.get("format") != CT_FORMAT or not groups:
            raise CheckpointError(
                f"quantization_config.format: this layout reads {CT_FORMAT!r} with config_groups, found "
                f"{qc.get('format')!r}"
            )
        schemes = set()
        for gname, group in groups.items():
            where = f"quantization_config.config_groups.{gname}"
            w, a = group.get("weights") or {}, group.get("input_activations")
            if w.get("num_bits") != 8 or w.get("type") != "float" or w.get("strategy") not in ("tensor", "channel"):
                raise CheckpointError(
                    f"{where}.weights: {CT_FORMAT} is read for 8-bit float weights with strategy tensor or channel, "
                    f"found num_bits={w.get('num_bits')!r} type={w.get('type')!r} strategy={w.get('strategy')!r}"
                )
            if not a or a.get("num_bits") != 8 or a.get("type") != "float":
                raise CheckpointError(
                    f"{where}.input_activations: FP8 weights are emulated with 8-bit float activations, found {a!r}"
                )
            if a.get("strategy") == "tensor" and not a.get("dynamic"):
                schemes.add(W_FP8_A_FP8)
            elif a.get("strategy") == "token" and a.get("dynamic") is True:
                schemes.add(W_FP8_A_FP8_PER_TOKEN)
            else:
                raise CheckpointError(
                    f"{where}.input_activations: read static strategy tensor or dynamic strategy token, found "
                    f"strategy={a.get('strategy')!r} dynamic={a.get('dynamic')!r}"
                )
        if len(schemes) != 1:
            raise CheckpointError(
                "quantization_config.config_groups: FP8 groups of one scheme expected, found "
                f"{sorted(map(str, schemes))}"
            )
        status = qc.get("quantization_status", "compressed")
        if status != "compressed":
            raise CheckpointError(f"quantization_config.quantization_status: expected 'compressed', found {status!r}")
        return CheckpointDescription(self.name, schemes.pop(), list(qc.get("ignore") or []), None)


MODELOPT = ModelOptFp8Layout()  # registered by the package's __init__
QUARK = QuarkFp8Layout()
COMPRESSED_TENSORS = CompressedTensorsFp8Layout()
