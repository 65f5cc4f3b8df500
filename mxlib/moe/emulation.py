"""The quantization-emulation experts (vLLM's design) and the quantized weights they hold.

``Nvfp4QuantizationEmulationTritonExperts`` and ``OCP_MXQuantizationEmulationTritonExperts``
follow vLLM's classes of those names: every forward they dequantize the experts' weights to
the activation dtype, quantize-dequantize (QDQ) the layer input ``a1`` and the intermediate
activation ``a2`` in the scheme's activation format, and run ``TritonExperts``' bf16 path.
``expects_unquantized_inputs`` is true: they take bf16 hidden states and do the activation
QDQ themselves. Build them with ``mxlib.moe.factory.make_emulation_experts``.

Numerics (``numerics=``):

* ``"vllm"`` (default): vLLM's emulation bit for bit: weights dequantized to
  ``bf16(e2m1 * (block_scale * global_scale))``, activations QDQ'd to ``bf16(e2m1 * (s / gs))``,
  bf16 GEMMs with fp32 accumulation.
* ``"hardware"``: what an FP4 tensor-core GEMM computes: operands ``element * block_scale``
  (exact in bf16 for e2m1 x ue4m3 and for every MX element with an in-range E8M0 scale), fp32
  accumulation, and the per-tensor scales (NVFP4 weight ``global_scale``, activation ``1 / gs``)
  multiplying the fp32 GEMM output before its rounding. For OCP MX schemes the operands are the
  same in both modes (E8M0 scales are exact; static per-tensor FP8 activations keep vLLM's
  ``bf16(e4m3 * scale)`` operand in both), so the modes differ for NVFP4 only. Runs on the
  ``torch`` backend (pure PyTorch, ``reference_moe.torch_moe`` with ``output_scales``) and on the
  ``fused`` backend's FP4 kernel; the dequantize-then-GEMM ``triton`` path computes vLLM's numerics only.

Per-token activation scales (NVFP4 ``scale_strategy="per_token"``, vLLM's ``nvfp4_per_token``): each
row's amax sets its global scale in the forward (``mxlib.reference.nvfp4_per_token_scales``), a1 per
token, a2 per (token, expert) row; no input scale is read. ``hardware`` numerics multiply each GEMM
output row by its ``per_token_scale``, then by the weight's global scale (FlashInfer's per-token MoE).
``fused`` runs it on the FP4 kernel (a2 QDQ'd in a per-row pass: an epilogue tile never sees a whole
row), else on the ``triton`` path (the generic fused kernel QDQs a2 tile by tile).

FP4 weights on the ``fused`` backend (bf16 activations, H and I multiples of 128, or zero-padded to them where
``FP4_PAD_MAX_FRACTION`` allows: exact, ``fp4_operands``) are held in the FP4 kernel's layout
(``mxlib.kernels.fp4_layout.prepare_fp4_weights``), prepared once (at construction when the backend resolves to
``fused``, else at the first fused forward); only that copy stays on the device. ``w13_weight`` / ``w2_weight`` (and
the other backends) then get the checkpoint layout back by ``unprepare_fp4_packed`` (and ``unpad_fp4_halves``), a
temporary copy. MXFP6 weights (H and I multiples of 256) run in the same kernel in ``fp6_layout``'s layout, held
and unprepared the same way, when the backend is ``fused``; whether ``auto`` picks it is ``FP6_AUTO_FUSED``.
"""

from __future__ import annotations

import torch
from torch.nn.functional import pad as _pad

from .. import reference as _ref
from .._checks import check_block_scales, check_global_scale
from ..formats import NVFP4, BlockScheme, Numerics, PerTensorScheme, get_numerics, get_scale_mode
from ..kernels import fp4_layout as F4
from ..kernels.fp4_layout import K_TILE, FP4Weights, fp4_one_multiply, unprepare_fp4_packed
from ..kernels.fp6_layout import SUPER_TILE, FP6Weights, unprepare_fp6_packed
from ..kernels.fused_dequant_moe import ActivationQDQ, PackedWeights
from ..kernels.fused_fp4_moe import prepare_packed_weights
from .activation_rules import block_rule_global_scale, check_activation_block_rule, nvfp4_activation_qdq, nvfp4_hw_qdq
from .activations import SILU, MoEActivation
from .base import TritonExperts, ops_for_backend, resolve_backend
from .expert_weights import ExpertWeights, _check
from .kept_weights import KeptDequantized
from .reference_moe import torch_moe
from .scales import (
    ACTIVATION_SCALE_STRATEGIES,
    PER_TOKEN,
    _unify_encode_scales,
    _warn_once,
    max_input_scale,
    unify_input_scales,
)
from .schemes import MoEQuantScheme, get_moe_scheme

__all__ = [
    "ExpertWeights",
    "KeptDequantized",
    "QuantizedExperts",
    "Nvfp4QuantizationEmulationTritonExperts",
    "OCP_MXQuantizationEmulationTritonExperts",
]

_PACKED = ("w13_weight", "w2_weight")
_PREPARED = "_fp4"  # suffix of the buffers that hold the FP4 kernel's layout (FP4 or FP6 elements)
# Whether ``backend="auto"`` runs MXFP6 weights on the FP4 kernel (``fp6_layout``) on CUDA. Measured on
# the H200 (benchmarks/h200_fp4_anchors.md, Qwen3-30B-A3B layer, M = 1..4096): 0.05-0.62x the
# dequantize-then-GEMM path's time at every M and 0.55-0.57x bf16 TritonExperts' at M = 16, 64.
FP6_AUTO_FUSED = True
# Whether ``backend="auto"`` runs MX FP8 weights (``w_mxfp8``, ``w_mxfp8_a_mxfp8``) on the dequantize-GEMM kernel on
# CUDA. Measured on an H100 (benchmarks/h100_mxfp8_auto.json, Qwen3-30B-A3B layer, M = 1..4096): 0.08-0.65x the
# dequantize-then-GEMM path's time at every M, with the same output bits.
FP8_AUTO_FUSED = True
# FP4 weights whose H or I is no multiple of the kernel's K tile (gpt-oss-20b: 2880) run the FP4 kernel on a copy
# zero-padded to it (``pad_fp4_halves``: exact) when the padding adds at most this fraction to each extent
# (2880 -> 2944: 2.2%); smaller shapes stay on the dequantize-GEMM kernel (a bound, not an H200 measurement).
FP4_PAD_MAX_FRACTION = 1 / 16


class QuantizedExperts(TritonExperts):
    """Shared plumbing of the emulation subclasses: weights stored quantized as buffers.

    A subclass sets ``weight_scheme`` (a ``BlockScheme``) and implements ``_dequantize(ops, sel)``
    (reading packed bytes through ``checkpoint_packed``), ``quantize_input``,
    ``quantize_intermediate``, ``a1_qdq`` and ``a2_qdq``.
    """

    expects_unquantized_inputs = True
    supports_fused = True
    weight_scheme: BlockScheme

    def _set_numerics(self, numerics: str | Numerics) -> None:
        """``numerics``: a ``Numerics`` or its name (``"vllm"``, ``"hardware"``); a ValueError names
        the allowed values otherwise (``formats.get_numerics``)."""
        self.numerics = get_numerics(numerics)

    def fp4_kernel_applies(self) -> bool:
        """Whether the FP4 kernel can run these experts: bf16 activations and either 4-bit weight
        elements (``mxfp4``, ``nvfp4``) with H and I multiples of its 128-element K tile (or zero-padded to it:
        ``FP4_PAD_MAX_FRACTION``, no rotation), or MXFP6 weights (``mxfp6_e2m3``, ``mxfp6_e3m2``) with H and I
        multiples of the 256-element super tile."""
        s = self.weight_scheme
        if self.activation_dtype != torch.bfloat16:
            return False
        h, i = self.hidden_size, self.intermediate_size
        if s.element.nbits == 4:
            hp, ip = self._fp4_dims()
            pad_ok = hp - h <= FP4_PAD_MAX_FRACTION * h and ip - i <= FP4_PAD_MAX_FRACTION * i
            return (hp, ip) == (h, i) or (pad_ok and self.rotation is None)
        if s.element.nbits == 6 and not s.has_global_scale:
            return h % SUPER_TILE == 0 and i % SUPER_TILE == 0
        return False

    def _fp4_dims(self) -> tuple[int, int]:
        """(H, I) of the FP4 kernel's copy of 4-bit weights: each a multiple of the K tile (zero-padded)."""
        return F4.padded_to_k_tile(self.hidden_size), F4.padded_to_k_tile(self.intermediate_size)

    def _fp4_padded(self) -> bool:
        return self.weight_scheme.element.nbits == 4 and self._fp4_dims() != (self.hidden_size, self.intermediate_size)

    def fp4_operands(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The FP4 kernel's hidden states and GEMM1 bias, zero-padded to the padded H and I where the weights
        are (``_fp4_padded``): padded a1 columns meet zero weight columns, padded gate / up columns give
        ``act(0 + 0, 0 + 0) = 0`` (SiLU and SwiGLU-OAI) and meet zero w2 columns."""
        if not self._fp4_padded():
            return hidden_states, self.w13_bias
        (hp, ip), (e, h, i) = self._fp4_dims(), self._dims
        b = None if self.w13_bias is None else _pad(self.w13_bias.view(e, 2, i), (0, ip - i)).view(e, 2 * ip)
        return _pad(hidden_states, (0, hp - h)), b

    def prefers_fused(self) -> bool:
        # H200 (benchmarks/h200_fp4_anchors.md): the FP4 kernel beats the dequantize-then-GEMM path at every
        # batch size, for FP4 and (FP6_AUTO_FUSED) MXFP6 weights; H100 (FP8_AUTO_FUSED): so does the
        # dequantize-GEMM kernel for MX FP8 weights with bf16 activations
        s = self.weight_scheme
        if s.element.nbits == 8 and not s.has_global_scale:
            return FP8_AUTO_FUSED and self.activation_dtype == torch.bfloat16
        return self.fp4_kernel_applies() and (s.element.nbits == 4 or FP6_AUTO_FUSED)

    def _prepare_if_fused(self) -> None:
        """Prepare the FP4 layout now when the forward will use it (construction time; an unknown backend
        name is left for the forward to refuse)."""
        if (
            self.backend in ("fused", "auto")
            and self.fp4_kernel_applies()
            and self.resolved_backend(self._device()) == "fused"
        ):
            self.fp4_weights()

    def fp4_weights(self) -> tuple[FP4Weights, FP4Weights] | tuple[FP6Weights, FP6Weights] | None:
        if not self.fp4_kernel_applies():
            return None
        if "w13_weight" + _PREPARED not in self._buffers:
            hp, ip = self._fp4_dims()
            for name, pw in zip(_PACKED, QuantizedExperts.packed_weights(self)):
                if self._fp4_padded():  # (halves, rows, K) of the padded copy; its scales held beside it
                    halves, rows, k = (2, ip, hp) if name == "w13_weight" else (1, self.hidden_size, ip)
                    pw.packed, pw.scales = F4.pad_fp4_halves(
                        pw.packed, pw.scales, pw.scheme.block_size, halves, rows, k
                    )
                    self.register_buffer(name + "_scale" + _PREPARED, pw.scales, persistent=False)
                prepared = prepare_packed_weights(pw).packed
                del self._buffers[name]  # keep only the prepared copy
                self.register_buffer(name + _PREPARED, prepared, persistent=False)
        s = self.weight_scheme
        if s.element.nbits == 6:
            return (
                FP6Weights(self.w13_weight_fp4, self.w13_weight_scale.view(torch.uint8), s.element, s.block_size),
                FP6Weights(self.w2_weight_fp4, self.w2_weight_scale.view(torch.uint8), s.element, s.block_size),
            )
        g13, g2 = getattr(self, "w13_weight_scale_2", None), getattr(self, "w2_weight_scale_2", None)
        s13, s2 = self.w13_weight_scale.view(torch.uint8), self.w2_weight_scale.view(torch.uint8)
        one13, one2 = self._one_multiply("w13", s13, g13), self._one_multiply("w2", s2, g2)  # pad bytes 0 agree
        s13 = self._buffers.get("w13_weight_scale" + _PREPARED, s13)
        s2 = self._buffers.get("w2_weight_scale" + _PREPARED, s2)
        return (
            FP4Weights(self.w13_weight_fp4, s13, s.block_size, s.has_global_scale, g13, one13),
            FP4Weights(self.w2_weight_fp4, s2, s.block_size, s.has_global_scale, g2, one2),
        )

    def _one_multiply(self, name: str, scales: torch.Tensor, g: torch.Tensor | None) -> bool:
        """``fp4_one_multiply`` of weight ``name``'s scales, read once (a host synchronization) and
        again only after they change (a new storage, or an in-place write: it bumps ``_version``)."""
        key = tuple((t.data_ptr(), t._version) for t in (scales, g) if t is not None)
        cache = self.__dict__.setdefault("_one_multiply_cache", {})
        if name not in cache or cache[name][0] != key:
            if scales.is_cuda and torch.cuda.is_current_stream_capturing():
                return False  # no host read inside a CUDA-graph capture: the two-multiply decode fits any scale
            cache[name] = (key, fp4_one_multiply(scales, self.weight_scheme.block_size, g))
        return cache[name][1]

    def checkpoint_packed(self, name: str, sel=slice(None)) -> torch.Tensor:
        """Packed bytes ``name`` (``w13_weight`` / ``w2_weight``) of experts ``sel`` in the checkpoint
        layout, unpreparing only those experts when the FP4 kernel's copy is the one held."""
        prepared = self._buffers.get(name + _PREPARED)
        if prepared is None:
            return self._buffers[name][sel]
        return self._unprepare(prepared[sel], name)

    def _unprepare(self, prepared: torch.Tensor, name: str) -> torch.Tensor:
        """Checkpoint layout of weight ``name``'s bytes in the FP4 kernel's layout (FP4 or FP6 elements)."""
        el = self.weight_scheme.element
        if el.nbits == 6:
            return unprepare_fp6_packed(prepared, el)
        out = unprepare_fp4_packed(prepared)
        if self._fp4_padded():
            e, h, i = self._dims
            out = F4.unpad_fp4_halves(out, *((2, i, h) if name == "w13_weight" else (1, h, i)))
        return out

    def __getattr__(self, name: str):
        if name in _PACKED:
            buffers = self.__dict__.get("_buffers", {})
            if name not in buffers and name + _PREPARED in buffers:
                return self._unprepare(buffers[name + _PREPARED], name)
        return super().__getattr__(name)

    def _set_dims(self, e: int, h: int, i: int, activation_dtype: torch.dtype) -> None:
        self._dims = (e, h, i)
        if activation_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(f"activation_dtype: expected bfloat16, float16 or float32, got {activation_dtype}")
        self.activation_dtype = activation_dtype

    _check = staticmethod(_check)

    def _register(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            self.register_buffer(name, t, persistent=False)

    def dequantized_weights(self):
        backend = resolve_backend(self.backend, self._device())
        return self._dequantize(ops_for_backend("torch" if backend == "torch" else "triton"), slice(None))

    keep_dequantized = False  # the class default: a library user's experts dequantize at each forward
    kept_dequantized: KeptDequantized | None = None  # where kept weights go (made at the first use)

    def dequantized_expert(self, e: int):
        """Expert ``e``'s ``(w13 [2I, H], w2 [H, I])`` in the activation dtype, dequantized by the
        reference (``mxlib.reference``) in the experts' numerics.

        With ``keep_dequantized`` set (``experts.keep_dequantized = True``; off by default: it holds the
        dequantized weights, 4.8 GB for the 4-layer Qwen3-30B-A3B dummy's experts, beside the packed ones), the
        result is kept in ``kept_dequantized`` (a ``KeptDequantized``; experts made from the same quantized
        tensors may share one) and handed out again while it is valid (``KeptDequantized.get``); otherwise it
        is dequantized anew. A kept result is always the one dequantizing now would give, bit for bit. The CPU
        studies of the workbook set it: their forwards run the same weights many times.
        """
        if not self.keep_dequantized:
            self.kept_dequantized = None  # turned off: what was kept is let go
            w13, w2 = self._dequantize(_ref, slice(e, e + 1))
            return w13[0], w2[0]
        if self.kept_dequantized is None:
            self.kept_dequantized = KeptDequantized()
        return self.kept_dequantized.get(self, e)

    def packed_weights(self) -> tuple[PackedWeights, PackedWeights]:
        """(w13, w2) as ``PackedWeights`` (checkpoint layout) for the generic fused kernel."""
        s = self.weight_scheme
        return (
            PackedWeights(
                self.w13_weight, self.w13_weight_scale.view(torch.uint8), s, getattr(self, "w13_weight_scale_2", None)
            ),
            PackedWeights(
                self.w2_weight, self.w2_weight_scale.view(torch.uint8), s, getattr(self, "w2_weight_scale_2", None)
            ),
        )


class Nvfp4QuantizationEmulationTritonExperts(QuantizedExperts):
    """NVFP4 MoE emulation: NVFP4 weights dequantized, activations NVFP4-QDQ'd, bf16 GEMMs.

    Args:
        weights: ``ExpertWeights`` in ``nvfp4`` (ModelOpt tensors stacked over experts):
            ``w13_weight`` uint8 ``[E, 2I, H/2]``; ``w13_weight_scale`` float8_e4m3fn
            ``[E, 2I, H/16]``; ``w13_weight_scale_2`` fp32 ``[E]``, or ``[E, 2]`` when gate and
            up have different scales (each half is dequantized with its own; vLLM would use the
            gate's for both); ``w2_weight``, ``w2_weight_scale``, ``w2_weight_scale_2``:
            ``[E, H, I/2]``, ``[E, H, I/16]``, ``[E]``.
        w13_input_scale, w2_input_scale: fp32 ``[E]`` decode scales ``amax / (6 * 448)``
            (0 for an expert never calibrated), or None with ``scale_strategy="per_token"``; when
            ``weights.global_scale_kind`` is ``"encode"`` (compressed-tensors) they are encode scales
            ``6 * 448 / amax`` as stored, used without a reciprocal (``max`` picks the smallest encode
            scale; the fused backend then runs the triton path);
        scale_strategy: how per-expert activation scales become global ones
            (``unify_input_scales``); ``max`` is vLLM's and warns when it costs an expert precision; ``per_token``:
            each token's amax sets its own (module docstring), the input scales are not read;
        activation_dtype: bf16 (default) or fp16;
        backend: ``auto`` / ``triton`` / ``fused`` / ``torch`` (``mxlib.moe.base``);
        numerics: ``"vllm"`` (default) or ``"hardware"``, or a ``mxlib.formats.Numerics`` (module docstring).
        activation_block_rule: a1 / a2 QDQ's ``"amax"`` (default, vLLM's) or ``"four_over_six"`` (``activation_rules``).
        activation, w13_bias, w2_bias: the gated activation and the expert biases (``TritonExperts``).

    Source: vLLM ``Nvfp4QuantizationEmulationTritonExperts`` (``dequantize_to_dtype`` for the
    weights, ``ref_nvfp4_quant_dequant`` for a1 and a2 with ``a13_gscale = 1 / max(w13 input
    scales)`` and ``a2_gscale = 1 / max(w2 input scales)``); ``per_token``: vLLM's ``nvfp4_per_token``
    (FlashInfer's per-token activation quantizer, ``mxlib.reference.nvfp4_per_token_scales``).
    """

    quant_dtype = NVFP4.name
    weight_scheme = NVFP4

    def __init__(
        self,
        weights: ExpertWeights,
        w13_input_scale: torch.Tensor | None = None,
        w2_input_scale: torch.Tensor | None = None,
        *,
        scale_strategy: str = "max",
        activation_dtype: torch.dtype = torch.bfloat16,
        backend: str = "auto",
        numerics: str | Numerics = Numerics.VLLM,
        activation_block_rule: str = "amax",
        activation: MoEActivation | str = SILU,
        w13_bias: torch.Tensor | None = None,
        w2_bias: torch.Tensor | None = None,
    ):
        super().__init__(backend=backend, activation=activation)
        self.activation_block_rule = check_activation_block_rule(activation_block_rule)
        if not isinstance(weights, ExpertWeights) or weights.scheme != NVFP4:
            got = weights.scheme.name if isinstance(weights, ExpertWeights) else type(weights).__name__
            raise TypeError(
                f"weights: expected an ExpertWeights in nvfp4 (mxlib.moe.quantize_expert_weights), got {got}"
            )
        w = weights
        bs = NVFP4.block_size
        e, two_i, h_half = w.w13_weight.shape
        h, i = h_half * 2, two_i // 2
        self._set_dims(e, h, i, activation_dtype)
        u8, f8, f32 = (torch.uint8,), (torch.float8_e4m3fn,), (torch.float32,)
        g13 = w.w13_weight_scale_2
        _check(w.w13_weight, "w13_weight", (e, 2 * i, h // 2), u8)
        _check(w.w13_weight_scale, "w13_weight_scale", (e, 2 * i, h // bs), f8)
        if not isinstance(g13, torch.Tensor) or g13.shape not in ((e,), (e, 2)):
            shape = list(g13.shape) if isinstance(g13, torch.Tensor) else g13
            raise ValueError(f"w13_weight_scale_2: expected shape [{e}] or [{e}, 2], got {shape}")
        _check(g13, "w13_weight_scale_2", g13.shape, f32)
        _check(w.w2_weight, "w2_weight", (e, h, i // 2), u8)
        _check(w.w2_weight_scale, "w2_weight_scale", (e, h, i // bs), f8)
        _check(w.w2_weight_scale_2, "w2_weight_scale_2", (e,), f32)
        for name, t in [("w13_input_scale", w13_input_scale), ("w2_input_scale", w2_input_scale)]:
            if t is not None:
                _check(t, name, (e,), f32)
        # global scales in [2**-126, 2**126]; input scales may be 0 (uncalibrated). Checked once
        # here, so that the forward's QDQ and dequantize calls skip it (check_scale=False).
        for name, t, zero_ok in [
            ("w13_weight_scale_2", g13, False),
            ("w2_weight_scale_2", w.w2_weight_scale_2, False),
            ("w13_input_scale", w13_input_scale, True),
            ("w2_input_scale", w2_input_scale, True),
        ]:
            if t is not None:
                check_global_scale(t, name, allow_zero=zero_ok)
        check_block_scales(w.w13_weight_scale, "w13_weight_scale", e4m3=True)
        check_block_scales(w.w2_weight_scale, "w2_weight_scale", e4m3=True)
        self.global_scale_kind = w.global_scale_kind
        if self.global_scale_kind == "encode":
            self.supports_fused = False  # the fused kernel multiplies by decode global scales
        if g13.ndim == 2 and not torch.equal(g13[:, 0], g13[:, 1]):
            _warn_once(
                "w13_weight_scale_2",
                "w13_weight_scale_2: gate and up scales differ; each half is "
                "dequantized with its own (vLLM would use the gate's for both)",
            )
        elif g13.ndim == 2:
            g13 = g13[:, 0].contiguous()
        self._register(
            {
                **w.tensors(),
                "w13_weight_scale_2": g13,
                "w13_input_scale": w13_input_scale,
                "w2_input_scale": w2_input_scale,
            }
        )
        self._set_biases(w13_bias, w2_bias)
        self.set_scale_strategy(scale_strategy)
        self._set_numerics(numerics)
        check_activation_block_rule(activation_block_rule, hardware=self._hardware())
        if self._hardware() and self.global_scale_kind == "encode":
            raise ValueError(
                "numerics='hardware' needs decode global scales (ModelOpt's weight_scale_2); these "
                "weights carry encode scales (compressed-tensors): use numerics='vllm'"
            )
        self._prepare_if_fused()

    def set_scale_strategy(self, strategy: str) -> None:
        """Recompute the activation global scales (``unify_input_scales``) for a strategy; ``per_token``
        leaves ``a13_gscale`` / ``a2_gscale`` None (the scales are made in the forward).

        Raises:
            ValueError: a strategy not in ``ACTIVATION_SCALE_STRATEGIES``; a static strategy when the
                experts were built without input scales.
        """
        if strategy not in ACTIVATION_SCALE_STRATEGIES:
            raise ValueError(f"scale_strategy: expected one of {list(ACTIVATION_SCALE_STRATEGIES)}, got {strategy!r}")
        if strategy != PER_TOKEN and (self.w13_input_scale is None or self.w2_input_scale is None):
            raise ValueError(
                f"scale_strategy {strategy!r} needs w13_input_scale and w2_input_scale (static scales); these "
                f"experts were built without them: use scale_strategy={PER_TOKEN!r}"
            )
        check_activation_block_rule(self.activation_block_rule, per_token=strategy == PER_TOKEN)
        self.scale_strategy = strategy
        a13 = a2 = None  # per_token: the scales are made in the forward
        self._a13_uniform = self._a2_uniform = True
        if strategy != PER_TOKEN:
            unify = _unify_encode_scales if self.global_scale_kind == "encode" else unify_input_scales
            a13, self._a13_uniform = unify(self.w13_input_scale, strategy, "w13_input_scale")
            a2, self._a2_uniform = unify(self.w2_input_scale, strategy, "w2_input_scale")
        rule = self.activation_block_rule
        self.register_buffer("a13_gscale", block_rule_global_scale(a13, rule), persistent=False)
        self.register_buffer("a2_gscale", block_rule_global_scale(a2, rule), persistent=False)

    @property
    def per_token(self) -> bool:
        """Whether the activation scales are per token (``scale_strategy="per_token"``)."""
        return self.scale_strategy == PER_TOKEN

    # NVFP4 with ``scale=None`` is the per-token QDQ for the FP4 kernel (``fp4_activations.is_per_token``)
    def a1_qdq(self) -> ActivationQDQ:
        g, rule = self.a13_gscale, self.activation_block_rule
        return ActivationQDQ(NVFP4, scale=None if g is None else (g[:1] if self._a13_uniform else g), block_rule=rule)

    def a2_qdq(self) -> ActivationQDQ:
        g, rule = self.a2_gscale, self.activation_block_rule
        return ActivationQDQ(NVFP4, scale=None if g is None else (g[:1] if self._a2_uniform else g), block_rule=rule)

    # hardware numerics (module docstring): operands e2m1 * block scale, per-tensor scales on the output
    def _hardware(self) -> bool:
        return self.numerics is Numerics.HARDWARE

    def check_backend(self, backend: str, fp4: bool) -> None:
        if self._hardware() and backend != "torch" and not fp4:
            raise ValueError(
                f"numerics='hardware' runs on the 'torch' backend or on the 'fused' backend's FP4 kernel (bf16 "
                f"activations, H and I multiples of {K_TILE}); got backend {backend!r} with H={self.hidden_size}, "
                f"I={self.intermediate_size}, activation dtype {self.activation_dtype}"
            )

    def output_scales(self, e: int):
        if not self._hardware():
            return None
        g13 = self.w13_weight_scale_2[e]
        if g13.ndim == 1:  # [2]: gate and up columns each their own
            g13 = g13.repeat_interleave(self.intermediate_size)
        if self.per_token:  # the per-token scales multiply the rows first (``apply``)
            return [g13], [self.w2_weight_scale_2[e]]
        inv1 = 1.0 / self.a13_gscale[0 if self._a13_uniform else e]
        inv2 = 1.0 / self.a2_gscale[0 if self._a2_uniform else e]
        return [inv1, g13], [inv2, self.w2_weight_scale_2[e]]

    _hw_qdq = staticmethod(nvfp4_hw_qdq)

    def _dequantize(self, ops, sel):
        dt = self.activation_dtype
        g13 = self.w13_weight_scale_2[sel]
        g2 = self.w2_weight_scale_2[sel]
        if self._hardware():  # element x block scale only: the global scales go on the GEMM outputs
            g13, g2 = torch.ones_like(g13), torch.ones_like(g2)
        w13_packed = self.checkpoint_packed("w13_weight", sel)
        if g13.ndim == 2:  # gate and up halves with their own scales
            i = self.intermediate_size
            halves = [
                ops.dequantize_to_dtype(
                    w13_packed[:, j * i : (j + 1) * i].contiguous(),
                    self.w13_weight_scale[sel][:, j * i : (j + 1) * i].contiguous(),
                    g13[:, j].contiguous(),
                    dt,
                    check_scale=False,
                    global_scale_kind=self.global_scale_kind,
                )
                for j in range(2)
            ]
            w13 = torch.cat(halves, dim=1)
        else:
            w13 = ops.dequantize_to_dtype(
                w13_packed,
                self.w13_weight_scale[sel],
                g13,
                dt,
                check_scale=False,
                global_scale_kind=self.global_scale_kind,
            )
        w2 = ops.dequantize_to_dtype(
            self.checkpoint_packed("w2_weight", sel),
            self.w2_weight_scale[sel],
            g2,
            dt,
            check_scale=False,
            global_scale_kind=self.global_scale_kind,
        )
        return w13, w2

    def quantize_input(self, a1, topk_ids, backend):
        ops = ops_for_backend(backend)
        if self.per_token:  # once per token; hardware: the rows' per_token_scale goes to GEMM1's output
            q, ts = ops.nvfp4_per_token_quant_dequant(a1, numerics=self.numerics)
            self.__dict__["_a1_row_scale"] = (q, ts) if self._hardware() else None
            return q, False
        qdq = self._hw_qdq if self._hardware() else nvfp4_activation_qdq(ops, self.activation_block_rule)
        if self._a13_uniform:
            return qdq(a1, self.a13_gscale[:1]), False
        k = topk_ids.shape[1]
        pairs = a1.repeat_interleave(k, dim=0)  # [M*k, H], row t*k + j
        return qdq(pairs, self.a13_gscale[topk_ids.reshape(-1).long()]), True

    def quantize_intermediate(self, a2, row_experts, backend):
        ops = ops_for_backend(backend)
        if self.per_token:  # once per (token, expert) row; hardware: with the rows' scales (``torch_moe``)
            q, ts = ops.nvfp4_per_token_quant_dequant(a2, numerics=self.numerics)
            return (q, ts) if self._hardware() else q
        qdq = self._hw_qdq if self._hardware() else nvfp4_activation_qdq(ops, self.activation_block_rule)
        if self._a2_uniform:
            return qdq(a2, self.a2_gscale[:1])
        return qdq(a2, self.a2_gscale[row_experts.long()])

    def apply(self, a1, topk_weights, topk_ids, a1_per_pair: bool, backend: str) -> torch.Tensor:
        if not self.per_token:
            return super().apply(a1, topk_weights, topk_ids, a1_per_pair, backend)
        if backend == "fused":  # the generic fused kernel QDQs a2 tile by tile: no whole rows there
            backend = "triton"
        if backend == "torch" and self._hardware():  # the per-token scales multiply GEMM outputs row by row
            made = self.__dict__.pop("_a1_row_scale", None)
            if made is None or made[0] is not a1:
                raise RuntimeError("a1: per-token hardware numerics take the a1 that quantize_input made")
            w13_of, w2_of = self.expert_weight_getters()
            return torch_moe(
                a1,
                w13_of,
                w2_of,
                topk_weights,
                topk_ids,
                self.intermediate_qdq(backend),
                a1_per_pair,
                output_scales=self.output_scales,
                a1_row_scale=made[1],
                **self.moe_arithmetic(),
            )
        return super().apply(a1, topk_weights, topk_ids, a1_per_pair, backend)


class OCP_MXQuantizationEmulationTritonExperts(QuantizedExperts):
    """OCP MX MoE emulation for every Quark scheme (``mxlib.moe.schemes``).

    Args:
        scheme: a ``MoEQuantScheme`` or Quark scheme name (``w_mxfp4_a_mxfp4``, ``w_mxfp6_e3m2_a_fp8``,
            ... or ``mxfp4``).
        weights: an ``ExpertWeights`` in the scheme's weight format: ``w13_weight`` uint8 packed
            ``[E, 2I, H * bits / 8]`` (FP4: H/2, FP6: 3H/4), ``w13_weight_scale`` uint8 E8M0
            ``[E, 2I, H/32]``, ``w2_weight`` and ``w2_weight_scale`` likewise for ``[E, H, I]``;
        w13_input_scale, w2_input_scale: fp32 ``[E]`` static FP8 scales (``amax / 448``), only
            for ``_a_fp8`` schemes (one scale for all experts, the max, as for NVFP4);
        activation_scale_mode: E8M0 rule for the dynamic MX activation QDQ (Quark: ``even``);
        activation_dtype: bf16 (default) or fp16;
        backend: ``auto`` / ``triton`` / ``fused`` / ``torch`` (``mxlib.moe.base``);
        numerics: ``"vllm"`` (default) or ``"hardware"``, or a ``mxlib.formats.Numerics``: the same operands
            for OCP MX (module docstring).
        activation, w13_bias, w2_bias: the gated activation and the expert biases (``TritonExperts``).

    Both activation points are quantized whenever the scheme names an activation format: the
    layer input a1 once per token, and the gated activation's output a2 once per (token, expert) pair.

    Source: vLLM ``OCP_MXQuantizationEmulationTritonExperts`` and ``QuarkOCP_MX_MoEMethod``.
    """

    def __init__(
        self,
        scheme: str | MoEQuantScheme,
        weights: ExpertWeights,
        w13_input_scale: torch.Tensor | None = None,
        w2_input_scale: torch.Tensor | None = None,
        *,
        activation_scale_mode: str = "even",
        activation_dtype: torch.dtype = torch.bfloat16,
        backend: str = "auto",
        numerics: str | Numerics = Numerics.VLLM,
        activation: MoEActivation | str = SILU,
        w13_bias: torch.Tensor | None = None,
        w2_bias: torch.Tensor | None = None,
    ):
        super().__init__(backend=backend, activation=activation)
        self._set_numerics(numerics)
        self.scheme = get_moe_scheme(scheme)
        if not self.scheme.is_ocp_mx:
            raise ValueError(
                f"scheme: {self.scheme.name} is not an OCP MX scheme; use Nvfp4QuantizationEmulationTritonExperts"
            )
        self.weight_scheme = self.scheme.weight
        self.activation_format = self.scheme.activation
        self.quant_dtype = None if self.activation_format is None else self.activation_format.name
        if not isinstance(weights, ExpertWeights):
            raise TypeError(
                f"weights: expected an ExpertWeights (mxlib.moe.quantize_expert_weights), got {type(weights).__name__}"
            )
        w = weights
        if w.scheme != self.weight_scheme:
            raise ValueError(
                f"weights: quantized as {w.scheme.name}, the scheme {self.scheme.name} stores {self.weight_scheme.name}"
            )
        wfmt = self.weight_scheme.element
        bs = self.weight_scheme.block_size
        e, two_i, packed_h = w.w13_weight.shape
        h = packed_h * 8 // wfmt.nbits
        i = two_i // 2
        self._set_dims(e, h, i, activation_dtype)
        u8 = (torch.uint8,)
        _check(w.w13_weight, "w13_weight", (e, 2 * i, wfmt.packed_size(h)), u8)
        _check(w.w13_weight_scale, "w13_weight_scale", (e, 2 * i, h // bs), u8)
        _check(w.w2_weight, "w2_weight", (e, h, wfmt.packed_size(i)), u8)
        _check(w.w2_weight_scale, "w2_weight_scale", (e, h, i // bs), u8)
        check_block_scales(w.w13_weight_scale, "w13_weight_scale", e4m3=False)
        check_block_scales(w.w2_weight_scale, "w2_weight_scale", e4m3=False)
        self._register(w.tensors())
        self._set_biases(w13_bias, w2_bias)
        self.activation_scale_mode = get_scale_mode(activation_scale_mode)
        if isinstance(self.activation_format, PerTensorScheme):
            if w13_input_scale is None or w2_input_scale is None:
                raise ValueError(f"{self.scheme.name}: static FP8 activations need w13_input_scale and w2_input_scale")
            _check(w13_input_scale, "w13_input_scale", (e,), (torch.float32,))
            _check(w2_input_scale, "w2_input_scale", (e,), (torch.float32,))
            # the per-expert scales as given (what a checkpoint stores), and
            # one scale across experts, the max, as vLLM does for static per-tensor FP8
            self._register({"w13_input_scale": w13_input_scale, "w2_input_scale": w2_input_scale})
            self.register_buffer("a13_scale", max_input_scale(w13_input_scale, "w13_input_scale"), persistent=False)
            self.register_buffer("a2_scale", max_input_scale(w2_input_scale, "w2_input_scale"), persistent=False)
        self._prepare_if_fused()

    def _act_qdq(self, scale_name: str) -> ActivationQDQ:
        scale = getattr(self, scale_name) if isinstance(self.activation_format, PerTensorScheme) else None
        return ActivationQDQ(self.activation_format, self.activation_scale_mode, scale)

    def a1_qdq(self) -> ActivationQDQ:
        return self._act_qdq("a13_scale")

    def a2_qdq(self) -> ActivationQDQ:
        return self._act_qdq("a2_scale")

    def _dequantize(self, ops, sel):
        dt = self.activation_dtype
        el, bs = self.weight_scheme.element.name, self.weight_scheme.block_size
        w13 = ops.dequantize_mx(self.checkpoint_packed("w13_weight", sel), self.w13_weight_scale[sel], el, bs, dt)
        w2 = ops.dequantize_mx(self.checkpoint_packed("w2_weight", sel), self.w2_weight_scale[sel], el, bs, dt)
        return w13, w2

    def _qdq(self, x, ops, scale_name):
        act = self.activation_format
        if act is None:
            return x
        if isinstance(act, PerTensorScheme):
            return ops.quant_dequant_fp8_per_tensor(x, getattr(self, scale_name), check_scale=False)
        return ops.quant_dequant_mx(x, act.element.name, act.block_size, self.activation_scale_mode)

    def quantize_input(self, a1, topk_ids, backend):
        return self._qdq(a1, ops_for_backend(backend), "a13_scale"), False

    def quantize_intermediate(self, a2, row_experts, backend):
        return self._qdq(a2, ops_for_backend(backend), "a2_scale")
