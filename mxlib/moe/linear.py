"""Emulated quantized linear layers: any ``nn.Linear`` a checkpoint quantized (attention first).

vLLM runs checkpoints whose attention projections are quantized (ModelOpt's default NVFP4
export, llm-compressor's NVFP4 scheme, Quark with attention not excluded) by emulating those
linear layers the way it emulates the experts: every forward the weight is dequantized to the
activation dtype, the input is quantize-dequantized (QDQ) in the scheme's activation format with
the checkpoint's activation scale, and one matmul in the activation dtype follows:

* NVFP4: ``dequantize_to_dtype`` of the weight (decode ``weight_scale_2``, or compressed-tensors'
  encode ``weight_global_scale`` as a divisor); input ``ref_nvfp4_quant_dequant`` with the encode
  global scale ``1 / input_scale`` (ModelOpt) or ``input_global_scale`` as stored (compressed-tensors);
* OCP MX: ``dequantize_mx`` of the weight; input dynamic MX QDQ (the E8M0 rule of the config);
* static per-tensor FP8 activations (``_a_fp8``): ``quant_dequant_fp8_per_tensor`` with ``input_scale``;
* FP8 weights (``w_fp8_a_fp8``, ``w_fp8_a_fp8_per_token``: ``mxlib.moe.schemes.FP8_LINEAR_SCHEMES``):
  ``fp32(e4m3) * fp32(weight_scale)`` with one scale per tensor or per output channel, one cast to the
  activation dtype (``mxlib.reference.dequantize_fp8_weight``; a bf16-stored scale is widened exactly, so the
  product equals compressed-tensors' ``dequantize``, which multiplies in the scale's dtype); the input QDQ'd with
  the static ``input_scale`` as above, or per token (``quant_dequant_fp8_per_token``, vLLM's dynamic per-token
  rule). Both run the reference arithmetic on every backend.

The QDQ and dequantize functions are ``mxlib.reference`` or their Triton twins
(``ops_for_backend``), same bits. The NVFP4 input QDQ is vLLM's fp32 rule for every layout, as vLLM
serves them; compressed-tensors' own fake quantization rounds the block amax / 6 to bf16 first
(``mxlib.reference.compressed_tensors_nvfp4_quant_dequant``), which on llm-compressor's tiny
all-Linear fixture moves the logits from 18.2 to 22.0 dB of the tool's own forward. Build one with
``mxlib.moe.factory.make_emulated_linear``.

Shapes: ``x [..., in_features] -> [..., out_features]``; ``weight`` packed ``[out, in * bits / 8]``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .. import reference as _ref
from .._checks import check_global_scale
from ..formats import NVFP4_VARIANTS, BlockScheme, PerTensorScheme, get_scale_mode
from .base import keep_dtype_on_cast, ops_for_backend, resolve_backend
from .schemes import MoEQuantScheme

__all__ = ["LinearWeights", "EmulatedLinear", "linear_input_amax"]


@dataclass
class LinearWeights:
    """One linear layer's quantized weight.

    ``weight`` uint8 packed ``[out, in * bits / 8]``; ``weight_scale`` ``[out, in / block_size]``
    (uint8 E8M0 bytes, or float8_e4m3fn for NVFP4), or for FP8 weights (``scheme`` the per-tensor ``fp8_e4m3``)
    fp32 with one value (per tensor) or ``out`` values (per output channel); ``weight_scale_2`` fp32 one-element global
    scale (NVFP4 only) of kind ``global_scale_kind`` (``"decode"``: ModelOpt's ``weight_scale_2``;
    ``"encode"``: compressed-tensors' ``weight_global_scale``).
    """

    scheme: BlockScheme
    weight: torch.Tensor
    weight_scale: torch.Tensor
    weight_scale_2: torch.Tensor | None = None
    global_scale_kind: str = "decode"

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1] * 8 // self.scheme.element.nbits

    def to(self, device) -> LinearWeights:
        """The same weight with its tensors on ``device``."""
        g = self.weight_scale_2
        return replace(
            self,
            weight=self.weight.to(device),
            weight_scale=self.weight_scale.to(device),
            weight_scale_2=None if g is None else g.to(device),
        )


class EmulatedLinear(torch.nn.Module):
    """A quantized ``nn.Linear`` emulated with dequantized weights and QDQ'd inputs.

    Args:
        scheme: the ``MoEQuantScheme`` (weight format + activation format) of the checkpoint.
        weights: ``LinearWeights`` in ``scheme.weight``.
        input_scale: the static activation scale, fp32, one element: NVFP4 decode
            ``amax / 2688`` (ModelOpt) or encode ``2688 / amax`` (compressed-tensors, when
            ``weights.global_scale_kind == "encode"``); FP8 decode ``amax / 448``. None for
            dynamic MX activations or weight-only schemes.
        bias: ``[out]`` or None (Qwen3 projections have none).
        backend: ``auto`` / ``torch`` / ``triton`` / ``fused`` (``fused`` uses the Triton twins).
        activation_scale_mode: E8M0 rule of dynamic MX activations.
        activation_dtype: bf16 (default), fp16 or fp32: the dtype of the dequantized weight, the
            QDQ output and the matmul.

    Raises:
        ValueError / TypeError: weights of another format, wrong shapes or dtypes, a missing or
            invalid static input scale; the message names the argument.
    """

    def __init__(
        self,
        scheme: MoEQuantScheme,
        weights: LinearWeights,
        input_scale: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        backend: str = "auto",
        activation_scale_mode: str = "even",
        activation_dtype: torch.dtype = torch.bfloat16,
    ):
        super().__init__()
        if not isinstance(scheme, MoEQuantScheme):
            raise TypeError(
                f"scheme: expected a MoEQuantScheme (make_emulated_linear resolves a name), got {type(scheme).__name__}"
            )
        self.scheme = scheme
        if weights.scheme != self.scheme.weight:
            raise ValueError(
                f"weights: quantized as {weights.scheme.name}, scheme {self.scheme.name} stores "
                f"{self.scheme.weight.name}"
            )
        if activation_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(f"activation_dtype: expected bfloat16, float16 or float32, got {activation_dtype}")
        fmt = self.scheme.weight
        if fmt.name in NVFP4_VARIANTS:
            raise ValueError(
                f"scheme: {self.scheme.name} is an NVFP4 variant ahead of hardware; mxlib emulates it in MoE experts "
                f"only (mxlib.moe.nvfp4_variants), not in linear layers"
            )
        out, k = weights.out_features, weights.in_features
        if isinstance(fmt, PerTensorScheme):  # FP8: e4m3 bytes, fp32 scale per tensor [] or per output channel [out]
            _check_fp8_weights(weights, out)
        else:
            scale_dtype = torch.float8_e4m3fn if fmt.has_global_scale else torch.uint8
            for name, t, shape, dtype in (
                ("weight", weights.weight, (out, fmt.element.packed_size(k)), torch.uint8),
                ("weight_scale", weights.weight_scale, (out, k // fmt.block_size), scale_dtype),
            ):
                if t.dtype != dtype or tuple(t.shape) != shape:
                    raise ValueError(f"{name}: expected {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}")
        self.in_features, self.out_features = k, out
        self.backend = backend
        self.activation_dtype = activation_dtype
        self.global_scale_kind = weights.global_scale_kind
        self.activation_format = self.scheme.activation
        self.activation_scale_mode = get_scale_mode(activation_scale_mode)
        self.register_buffer("weight", weights.weight, persistent=False)
        self.register_buffer("weight_scale", weights.weight_scale, persistent=False)
        if fmt.has_global_scale:
            g = weights.weight_scale_2
            if not isinstance(g, torch.Tensor) or g.dtype != torch.float32 or g.numel() != 1:
                raise ValueError(f"weight_scale_2: expected one fp32 global scale, got {g!r}")
            check_global_scale(g, "weight_scale_2")
            self.register_buffer("weight_scale_2", g.reshape(1), persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        act = self.activation_format
        if act is not None and act.static_scale:
            if (
                not isinstance(input_scale, torch.Tensor)
                or input_scale.dtype != torch.float32
                or input_scale.numel() != 1
            ):
                raise ValueError(
                    f"input_scale: {self.scheme.name} needs one fp32 static input scale, got {input_scale!r}"
                )
            check_global_scale(input_scale, "input_scale")
            s = input_scale.reshape(1)
            # NVFP4's QDQ takes the encode scale; FP8's the decode scale
            if isinstance(act, BlockScheme) and self.global_scale_kind == "decode":
                s = 1.0 / s
            self.register_buffer("input_qdq_scale", s, persistent=False)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.name}, "
            f"activation_dtype={str(self.activation_dtype).replace('torch.', '')}, backend={self.backend}"
        )

    def _apply(self, fn, recurse=True):
        """Casts change the activation dtype only; the quantized weight, its scales, the input scale and the bias
        keep their dtypes and bytes (``mxlib.moe.base.keep_dtype_on_cast``; the bias is cast in the forward)."""
        return keep_dtype_on_cast(self, fn, recurse, (), lambda: super(EmulatedLinear, self))

    def _ops(self, device):
        backend = resolve_backend(self.backend, device)
        return ops_for_backend("torch" if backend == "torch" else "triton")

    def dequantized_weight(self, ops=None) -> torch.Tensor:
        """The weight ``[out, in]`` in the activation dtype."""
        ops = ops or self._ops(self.weight.device)
        fmt = self.scheme.weight
        if isinstance(fmt, PerTensorScheme):  # the same torch arithmetic on every backend
            return _ref.dequantize_fp8_weight(self.weight, self.weight_scale, self.activation_dtype)
        if fmt.has_global_scale:
            return ops.dequantize_to_dtype(
                self.weight,
                self.weight_scale,
                self.weight_scale_2,
                self.activation_dtype,
                block_size=fmt.block_size,
                check_scale=False,
                global_scale_kind=self.global_scale_kind,
            )
        return ops.dequantize_mx(
            self.weight, self.weight_scale, fmt.element.name, fmt.block_size, self.activation_dtype
        )

    def quantize_input(self, x2: torch.Tensor, ops=None) -> torch.Tensor:
        """QDQ of the input rows ``[n, in]`` in the activation format (identity for weight-only)."""
        ops = ops or self._ops(x2.device)
        act = self.activation_format
        if act is None:
            return x2
        if isinstance(act, PerTensorScheme) and act.per_token:  # the same torch arithmetic on every backend
            return _ref.quant_dequant_fp8_per_token(x2)
        if isinstance(act, PerTensorScheme):
            return ops.quant_dequant_fp8_per_tensor(x2, self.input_qdq_scale, check_scale=False)
        if act.has_global_scale:
            return ops.ref_nvfp4_quant_dequant(x2, self.input_qdq_scale, block_size=act.block_size, check_scale=False)
        return ops.quant_dequant_mx(x2, act.element.name, act.block_size, self.activation_scale_mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x: expected [..., {self.in_features}], got {list(x.shape)}")
        if x.dtype != self.activation_dtype:
            raise TypeError(f"x: expected dtype {self.activation_dtype}, got {x.dtype}")
        ops = self._ops(x.device)
        xq = self.quantize_input(x.reshape(-1, self.in_features), ops)
        bias = None if self.bias is None else self.bias.to(self.activation_dtype)
        out = torch.nn.functional.linear(xq, self.dequantized_weight(ops), bias)
        return out.reshape(*x.shape[:-1], self.out_features)


def _check_fp8_weights(weights: LinearWeights, out: int) -> None:
    """FP8 ``LinearWeights``: ``weight`` uint8 ``[out, in]`` (e4m3 bytes), ``weight_scale`` fp32 with one value (per
    tensor) or ``out`` values (per output channel), each positive and finite; ``weight_scale_2`` None."""
    w, s = weights.weight, weights.weight_scale
    if w.dtype != torch.uint8 or w.ndim != 2:
        raise ValueError(f"weight: expected uint8 [out, in] (e4m3 bytes), got {w.dtype} {list(w.shape)}")
    if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or s.numel() not in (1, out):
        got = f"{s.dtype} {list(s.shape)}" if isinstance(s, torch.Tensor) else repr(s)
        raise ValueError(f"weight_scale: expected fp32 with 1 (per tensor) or {out} (per channel) values, got {got}")
    if weights.weight_scale_2 is not None:
        raise ValueError("weight_scale_2: FP8 weights have no global scale, got one")
    check_global_scale(s, "weight_scale")


@torch.no_grad()
def linear_input_amax(model, token_ids: torch.Tensor, names: list[str], batch_size: int = 8) -> dict[str, torch.Tensor]:
    """Calibration of linear layers: the largest ``|input|`` each named ``nn.Linear`` sees.

    Runs ``model`` on ``token_ids [B, T]`` with forward pre-hooks on the named modules.

    Returns:
        ``{name: fp32 scalar amax}`` (0 for a module that saw no input).
    """
    amax = {n: torch.zeros((), dtype=torch.float32) for n in names}
    modules = dict(model.named_modules())
    missing = [n for n in names if n not in modules]
    if missing:
        raise ValueError(f"names: no such modules in the model: {missing[:4]}")

    def hook(name):
        def record(module, args):
            amax[name] = torch.maximum(amax[name], args[0].detach().abs().amax().float().cpu())

        return record

    handles = [modules[n].register_forward_pre_hook(hook(n)) for n in names]
    try:
        dev = next(model.parameters()).device
        for b in range(0, token_ids.shape[0], batch_size):
            model(input_ids=token_ids[b : b + batch_size].to(dev), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return amax
