"""MoE emulation of the NVFP4 variants ahead of hardware: ``nvfp4_ue5m3`` and ``nvfp4_b32``.

``Nvfp4VariantEmulationExperts`` holds experts quantized in one of ``mxlib.formats.NVFP4_VARIANTS`` and runs
them the way the emulation experts run NVFP4 (``mxlib.moe.emulation``): every forward the weights of the
experts that received tokens are dequantized to the activation dtype, the layer input ``a1`` is QDQ'd once per
token and the gated activation's output ``a2`` once per (token, expert) row, in the scheme's own format, and the
GEMMs run in bf16 with fp32 accumulation (``mxlib.moe.reference_moe.torch_moe``).

Arithmetic: ``mxlib.reference.quant_dequant_nvfp4_variant`` (ModelOpt's decode-scale form for weights and
activations alike): ``s = scale_format(amax_block / (6 * g))``, ``e = e2m1(x / (s * g))``, ``dq = e * (s * g)``.

* ``nvfp4_ue5m3``: one level (``g = 1``): the ue5m3 block scales cover the range of weights and activations
  without a per-tensor scale, so activations are quantized dynamically and nothing is calibrated (no
  ``input_scale``, no unification across experts). ``activation_global_scale=True`` selects the two-level form
  instead: a per-tensor decode scale ``amax / (6 * 114688)`` of each QDQ'd tensor (dynamic, computed in the forward).
* ``nvfp4_b32``: ue4m3 scales per 32 elements with NVFP4's per-tensor decode scales: ``weight_scale_2`` per
  expert, and static activation scales ``input_scale = amax / 2688`` per expert, unified to their max across
  experts as vLLM does for NVFP4 (``mxlib.moe.scales.max_input_scale``).

Backends: ``torch`` only (``auto`` resolves to it on every device). The Triton kernels take NVFP4 as e4m3 block
scales of 16 elements and E8M0 MX blocks; neither kernel reads a ue5m3 scale or a 32-element ue4m3 block, so
``triton`` and ``fused`` are refused with an error rather than run as something else.
"""

from __future__ import annotations

import torch

from .. import reference as _ref
from ..formats import NVFP4_VARIANTS
from .base import QuantizedA1
from .emulation import QuantizedExperts
from .expert_weights import ExpertWeights, _check
from .quant_config import FusedMoEQuantConfig
from .scales import max_input_scale
from .schemes import MoEQuantScheme

__all__ = ["Nvfp4VariantEmulationExperts"]


class Nvfp4VariantEmulationExperts(QuantizedExperts):
    """Experts in an NVFP4 variant (``nvfp4_ue5m3``, ``nvfp4_b32``): weights dequantized, a1 and a2 QDQ'd in the
    same format, bf16 GEMMs (module docstring).

    Args:
        weights: ``ExpertWeights`` in the scheme's weight format: ``w13_weight`` uint8 ``[E, 2I, H/2]``,
            ``w13_weight_scale`` uint8 block-scale codes ``[E, 2I, H / block_size]`` (ue5m3 or e4m3 bytes),
            ``w2_weight`` / ``w2_weight_scale`` likewise for ``[E, H, I]``; ``w13_weight_scale_2`` /
            ``w2_weight_scale_2`` fp32 ``[E]`` decode global scales for ``nvfp4_b32`` (None for ``nvfp4_ue5m3``).
        config: a ``FusedMoEQuantConfig`` of scheme ``nvfp4_ue5m3`` or ``nvfp4_b32``: ``activation_global_scale``
            (``nvfp4_ue5m3`` only: QDQ activations with a per-tensor decode scale, ``amax / (6 * 114688)`` of each
            tensor, dynamic, instead of the one-level form), ``numerics`` (``"vllm"`` only: one arithmetic, the
            dequantized operands; no hardware exists to model), ``activation``.
        w13_input_scale, w2_input_scale: fp32 ``[E]`` static decode activation scales (``amax / 2688``),
            ``nvfp4_b32`` only.
        activation_dtype: bf16 (default), fp16 or fp32; backend: ``auto`` or ``torch``;
        w13_bias, w2_bias: as for ``TritonExperts``.

    Raises:
        ValueError: a config whose scheme is not an NVFP4 variant; weights in another format; shapes; missing input
            scales for ``nvfp4_b32``; a ``triton`` / ``fused`` backend (at the forward).
        TypeError: weights that are not an ``ExpertWeights``, wrong dtypes.
    """

    supports_fused = False

    def __init__(
        self,
        weights: ExpertWeights,
        config: FusedMoEQuantConfig,
        w13_input_scale: torch.Tensor | None = None,
        w2_input_scale: torch.Tensor | None = None,
        *,
        activation_dtype: torch.dtype = torch.bfloat16,
        backend: str = "auto",
        w13_bias: torch.Tensor | None = None,
        w2_bias: torch.Tensor | None = None,
    ):
        super().__init__(config, backend, activation_dtype)
        w = self._check_config(weights, self._runs)
        fmt = self.scheme.weight
        self.weight_scheme = fmt
        self.quant_dtype = fmt.name
        bs = fmt.block_size
        e, two_i, h_half = w.w13_weight.shape
        h, i = 2 * h_half, two_i // 2
        self._set_dims(e, h, i)
        u8, f32 = (torch.uint8,), (torch.float32,)
        _check(w.w13_weight, "w13_weight", (e, 2 * i, h // 2), u8)
        _check(w.w13_weight_scale, "w13_weight_scale", (e, 2 * i, h // bs), u8)
        _check(w.w2_weight, "w2_weight", (e, h, i // 2), u8)
        _check(w.w2_weight_scale, "w2_weight_scale", (e, h, i // bs), u8)
        tensors = w.tensors()
        if fmt.has_global_scale:
            for name in ("w13_weight_scale_2", "w2_weight_scale_2"):
                _check(getattr(w, name), name, (e,), f32)
            if w13_input_scale is None or w2_input_scale is None:
                raise ValueError(f"{fmt.name}: static activation scales need w13_input_scale and w2_input_scale")
            _check(w13_input_scale, "w13_input_scale", (e,), f32)
            _check(w2_input_scale, "w2_input_scale", (e,), f32)
            tensors.update(w13_input_scale=w13_input_scale, w2_input_scale=w2_input_scale)
            tensors.update(
                a13_scale=max_input_scale(w13_input_scale, "w13_input_scale"),
                a2_scale=max_input_scale(w2_input_scale, "w2_input_scale"),
            )
        elif w.w13_weight_scale_2 is not None or w.w2_weight_scale_2 is not None:
            raise ValueError(f"weights: {fmt.name} is one level; these weights carry global scales")
        self._register(tensors)
        self._finish(w13_bias, w2_bias)

    @staticmethod
    def _runs(scheme: MoEQuantScheme) -> bool:
        """Whether this class runs ``scheme`` (an NVFP4 variant, W4A4 in it)."""
        return scheme.weight.name in NVFP4_VARIANTS and scheme.activation is scheme.weight

    @property
    def activation_global_scale(self) -> bool:
        """``config.activation_global_scale``: ``nvfp4_ue5m3`` activations with a dynamic per-tensor scale."""
        return self.config.activation_global_scale

    @property
    def scale_strategy(self) -> str:
        """How the activations are scaled: ``max`` (``nvfp4_b32``: static, the max over experts), ``per_tensor``
        (``nvfp4_ue5m3`` with ``activation_global_scale``) or ``none`` (one level)."""
        if self.weight_scheme.has_global_scale:
            return "max"
        return "per_tensor" if self.activation_global_scale else "none"

    def resolved_backend(self, device: torch.device) -> str:
        return "torch" if self.backend == "auto" else self.backend

    def check_backend(self, backend: str, fp4: bool) -> None:
        if backend != "torch":
            raise ValueError(
                f"backend: {self.weight_scheme.name} runs on the 'torch' backend only (the Triton kernels read e4m3 "
                f"block scales of 16 elements or E8M0 MX blocks, not {self.weight_scheme.scale.name} blocks of "
                f"{self.weight_scheme.block_size}); got backend {backend!r}"
            )

    def _dequantize(self, ops, sel):
        s, dt = self.weight_scheme, self.activation_dtype
        g13 = self.w13_weight_scale_2[sel] if s.has_global_scale else None
        g2 = self.w2_weight_scale_2[sel] if s.has_global_scale else None
        w13 = _ref.dequantize_nvfp4_variant(self.w13_weight[sel], self.w13_weight_scale[sel], s, g13, dt)
        w2 = _ref.dequantize_nvfp4_variant(self.w2_weight[sel], self.w2_weight_scale[sel], s, g2, dt)
        return w13, w2

    def _qdq(self, x: torch.Tensor, scale_name: str) -> torch.Tensor:
        s = self.weight_scheme
        if s.has_global_scale:  # static, the max over experts
            g = getattr(self, scale_name)
        else:  # one level, or the two-level option: amax / (6 * 114688) of this tensor, in the forward
            g = _ref.nvfp4_variant_global_scale(x, s, two_level=True) if self.activation_global_scale else None
        return _ref.quant_dequant_nvfp4_variant(x, s, g)

    def quantize_input(self, a1, topk_ids, backend):
        return QuantizedA1(self._qdq(a1, "a13_scale"))

    def quantize_intermediate(self, a2, row_experts, backend):
        return self._qdq(a2, "a2_scale")
