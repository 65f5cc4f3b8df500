"""The quantization-emulation experts (vLLM's design) and the quantized weights they hold.

``Nvfp4QuantizationEmulationTritonExperts`` and ``OCP_MXQuantizationEmulationTritonExperts``
follow vLLM's classes of those names: every forward they dequantize the experts' weights to
the activation dtype, quantize-dequantize (QDQ) the layer input ``a1`` and the intermediate
activation ``a2`` in the scheme's activation format, and run ``TritonExperts``' bf16 path.
``expects_unquantized_inputs`` is true: they take bf16 hidden states and do the activation
QDQ themselves. Each takes ``(weights, config, input scales, *, activation_dtype, backend, biases)``; build them
with ``mxlib.moe.factory.make_emulation_experts`` (or ``make_experts`` from a config).

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
``FP4_PAD_MAX_FRACTION`` allows: exact, ``fp4_operands``) are held in the FP4 kernel's layout as a
``mxlib.kernels.fp4_prepare.PreparedExpertWeights`` (the ``prepared`` submodule), made once (at construction when
the backend resolves to ``fused``, else at the first fused forward) from the checkpoint-layout bytes, which it
replaces: only that copy stays on the device. ``w13_weight`` / ``w2_weight`` (``checkpoint_packed``, and the other
backends) then get the checkpoint layout back from it, a temporary copy. MXFP6 weights (H and I multiples of 256)
run in the same kernel in ``fp6_layout``'s layout, held the same way, when the backend is ``fused``; whether
``auto`` picks it is ``FP6_AUTO_FUSED``.

The modes (scheme, numerics, scale strategy, block rule, E8M0 rule, global-scale kind, rotation, activation) come
in one ``FusedMoEQuantConfig`` (``mxlib.moe.quant_config``), checked once; ``make_emulation_experts`` builds it
from keywords.
"""

from __future__ import annotations

import torch
from torch.nn.functional import pad as _pad

from .. import reference as _ref
from .._checks import check_block_scales, check_global_scale
from ..formats import NVFP4, BlockScheme, Numerics, PerTensorScheme
from ..kernels import fp4_layout as F4
from ..kernels.fp4_layout import K_TILE, FP4Weights
from ..kernels.fp4_prepare import PreparedExpertWeights
from ..kernels.fp6_layout import SUPER_TILE, FP6Weights
from ..kernels.fused_dequant_moe import ActivationQDQ, PackedWeights
from .activation_rules import block_rule_global_scale, nvfp4_activation_qdq, nvfp4_hw_qdq
from .base import QuantizedA1, TritonExperts, ops_for_backend, resolve_backend
from .expert_weights import ExpertWeights, _check
from .kept_weights import KeptDequantized
from .quant_config import FusedMoEQuantConfig
from .scales import (
    PER_TOKEN,
    _unify_encode_scales,
    _warn_once,
    max_input_scale,
    unify_input_scales,
)
from .schemes import MoEQuantScheme

__all__ = [
    "ExpertWeights",
    "KeptDequantized",
    "QuantizedExperts",
    "Nvfp4QuantizationEmulationTritonExperts",
    "OCP_MXQuantizationEmulationTritonExperts",
]

_PACKED = ("w13_weight", "w2_weight")
# Whether ``backend="auto"`` runs MXFP6 weights on the FP4 kernel (``fp6_layout``) on CUDA. Measured on
# the H200 (benchmarks/h200_fp4_external.md, Qwen3-30B-A3B layer, M = 1..4096): 0.05-0.62x the
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

    Built from ``(config, backend, activation_dtype)``; a subclass then checks its weights, registers them
    (``_register``: the packed bytes as ``w13_weight_packed`` / ``w2_weight_packed``, read back as ``w13_weight`` /
    ``w2_weight`` in the checkpoint layout), and calls ``_finish`` (biases, rotation, the FP4 layout when the
    ``fused`` backend will use it). It sets ``weight_scheme`` (a ``BlockScheme``) and implements
    ``_dequantize(ops, sel)`` (reading packed bytes through ``checkpoint_packed``), ``quantize_input``,
    ``quantize_intermediate``, ``a1_qdq`` and ``a2_qdq``.
    """

    expects_unquantized_inputs = True
    supports_fused = True
    weight_scheme: BlockScheme
    # the FP4 kernel's copy of the packed weights (``mxlib.kernels.fp4_prepare``), once prepared
    prepared: PreparedExpertWeights | None

    def __init__(self, config: FusedMoEQuantConfig, backend: str, activation_dtype: torch.dtype):
        if not isinstance(config, FusedMoEQuantConfig):
            raise TypeError(f"config: expected a FusedMoEQuantConfig, got {type(config).__name__}")
        super().__init__(config=config, backend=backend)
        self.prepared = None
        if activation_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(f"activation_dtype: expected bfloat16, float16 or float32, got {activation_dtype}")
        self.activation_dtype = activation_dtype

    @property
    def scheme(self) -> MoEQuantScheme:
        """The ``MoEQuantScheme`` these experts run (``config.scheme``)."""
        return self.config.scheme

    @property
    def activation_format(self):
        """The scheme's activation format (``config.scheme.activation``): a ``BlockScheme``, the per-tensor FP8
        scheme, or None (weight-only)."""
        return self.config.scheme.activation

    @property
    def activation_scale_mode(self) -> str:
        """The E8M0 rule of dynamic MX activations (``config.activation_scale_mode``)."""
        return self.config.activation_scale_mode

    @property
    def activation_block_rule(self) -> str:
        """NVFP4 activations' block rule (``config.activation_block_rule``)."""
        return self.config.activation_block_rule

    @property
    def global_scale_kind(self) -> str:
        """The convention of the NVFP4 global scales, ``decode`` or ``encode`` (``config.global_scale_kind``)."""
        return self.config.global_scale_kind

    def _check_config(self, weights: ExpertWeights, accepts) -> ExpertWeights:
        """Refuse a config whose scheme this class does not run (``accepts(scheme)`` false) and weights that are
        not an ``ExpertWeights`` in its weight format with the config's ``global_scale_kind``."""
        s = self.config.scheme
        if s is None or not accepts(s):
            raise ValueError(f"config: {type(self).__name__} does not run scheme {s}")
        if not isinstance(weights, ExpertWeights):
            raise TypeError(
                f"weights: expected an ExpertWeights (mxlib.moe.quantize_expert_weights), got {type(weights).__name__}"
            )
        if weights.scheme != s.weight:
            raise ValueError(f"weights: quantized as {weights.scheme.name}, the scheme {s.name} stores {s.weight.name}")
        if weights.global_scale_kind != self.config.global_scale_kind:
            raise ValueError(
                f"weights: global_scale_kind {weights.global_scale_kind!r}, the config says "
                f"{self.config.global_scale_kind!r} (FusedMoEQuantConfig.global_scale_kind)"
            )
        return weights

    def _finish(self, w13_bias: torch.Tensor | None, w2_bias: torch.Tensor | None) -> None:
        """The end of a subclass's construction: biases, the config's rotation, and the FP4 layout prepared now
        when the forward will use it (an unknown backend name is left for the forward to refuse)."""
        self._set_biases(w13_bias, w2_bias)
        if self.config.rotation is not None:
            self.rotation = self.config.rotation
        if (
            self.backend in ("fused", "auto")
            and self.fp4_kernel_applies()
            and self.resolved_backend(self._device()) == "fused"
        ):
            self.fp4_weights()

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
            hp, ip = F4.padded_to_k_tile(h), F4.padded_to_k_tile(i)
            pad_ok = hp - h <= FP4_PAD_MAX_FRACTION * h and ip - i <= FP4_PAD_MAX_FRACTION * i
            return (hp, ip) == (h, i) or (pad_ok and self.rotation is None)
        if s.element.nbits == 6 and not s.has_global_scale:
            return h % SUPER_TILE == 0 and i % SUPER_TILE == 0
        return False

    def fp4_operands(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The FP4 kernel's hidden states and GEMM1 bias, zero-padded to the padded H and I where the prepared
        weights are (``PreparedExpertWeights.padded``): padded a1 columns meet zero weight columns, padded gate /
        up columns give ``act(0 + 0, 0 + 0) = 0`` (SiLU and SwiGLU-OAI) and meet zero w2 columns."""
        if self.prepared is None or not self.prepared.padded:
            return hidden_states, self.w13_bias
        (hp, ip), (e, h, i) = self.prepared.padded_dims, self._dims
        b = None if self.w13_bias is None else _pad(self.w13_bias.view(e, 2, i), (0, ip - i)).view(e, 2 * ip)
        return _pad(hidden_states, (0, hp - h)), b

    def prefers_fused(self) -> bool:
        # H200 (benchmarks/h200_fp4_external.md): the FP4 kernel beats the dequantize-then-GEMM path at every
        # batch size, for FP4 and (FP6_AUTO_FUSED) MXFP6 weights; H100 (FP8_AUTO_FUSED): so does the
        # dequantize-GEMM kernel for MX FP8 weights with bf16 activations
        s = self.weight_scheme
        if s.element.nbits == 8 and not s.has_global_scale:
            return FP8_AUTO_FUSED and self.activation_dtype == torch.bfloat16
        return self.fp4_kernel_applies() and (s.element.nbits == 4 or FP6_AUTO_FUSED)

    def fp4_weights(self) -> tuple[FP4Weights, FP4Weights] | tuple[FP6Weights, FP6Weights] | None:
        """``(w13, w2)`` in the FP4 kernel's layout, or None where that kernel does not apply. The first call
        prepares ``prepared`` (a ``PreparedExpertWeights``) from the checkpoint-layout bytes, which it replaces."""
        if not self.fp4_kernel_applies():
            return None
        if self.prepared is None:
            w13, w2 = QuantizedExperts.packed_weights(self)
            self.prepared = PreparedExpertWeights(w13, w2, self.hidden_size, self.intermediate_size)
            for name in _PACKED:  # keep only the prepared copy
                del self._buffers[name + "_packed"]
        g13, g2 = getattr(self, "w13_weight_scale_2", None), getattr(self, "w2_weight_scale_2", None)
        return self.prepared.kernel_weights(
            self.w13_weight_scale.view(torch.uint8), self.w2_weight_scale.view(torch.uint8), g13, g2
        )

    def checkpoint_packed(self, name: str, sel=slice(None)) -> torch.Tensor:
        """Packed bytes ``name`` (``w13_weight`` / ``w2_weight``) of experts ``sel`` in the checkpoint
        layout: the held buffer's, or, once the FP4 kernel's copy is the one held, those experts unprepared
        (a new tensor)."""
        if name not in _PACKED:
            raise ValueError(f"name: expected one of {list(_PACKED)}, got {name!r}")
        if self.prepared is None:
            return self._buffers[name + "_packed"][sel]
        return self.prepared.checkpoint_packed(name.removesuffix("_weight"), sel)

    @property
    def w13_weight(self) -> torch.Tensor:
        """w13's packed bytes in the checkpoint layout: the buffer itself (an in-place write reaches the experts),
        or, while the FP4 kernel's layout is held, an unprepared copy (``checkpoint_packed``)."""
        held = self._buffers.get("w13_weight_packed")
        return self.checkpoint_packed("w13_weight") if held is None else held

    @property
    def w2_weight(self) -> torch.Tensor:
        """w2's packed bytes in the checkpoint layout (as ``w13_weight``)."""
        held = self._buffers.get("w2_weight_packed")
        return self.checkpoint_packed("w2_weight") if held is None else held

    def weight_tensors(self) -> list[torch.Tensor]:
        """Every tensor the weights' dequantization reads (packed bytes, prepared or not, block and global
        scales), in a fixed order: what ``KeptDequantized`` keys on."""
        held = [t for n, t in self._buffers.items() if t is not None and n.startswith(_PACKED)]
        if self.prepared is not None:
            held += [t for t in self.prepared.buffers() if t is not None]
        return held

    def _set_dims(self, e: int, h: int, i: int) -> None:
        self._dims = (e, h, i)

    _check = staticmethod(_check)

    def _register(self, tensors: dict[str, torch.Tensor | None]) -> None:
        """Hold ``tensors`` as buffers (not in the state dict); the packed bytes ``w13_weight`` / ``w2_weight``
        under ``w13_weight_packed`` / ``w2_weight_packed`` (read through ``checkpoint_packed``)."""
        for name, t in tensors.items():
            self.register_buffer(name + "_packed" if name in _PACKED else name, t, persistent=False)

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
        config: a ``FusedMoEQuantConfig`` of scheme ``nvfp4`` (``mxlib.moe.quant_config``): ``numerics``
            (module docstring), ``scale_strategy`` (how per-expert activation scales become global ones,
            ``unify_input_scales``; ``max`` is vLLM's and warns when it costs an expert precision; ``per_token``:
            each token's amax sets its own, module docstring, the input scales are not read),
            ``activation_block_rule`` (``amax``, vLLM's, or ``four_over_six``, ``activation_rules``),
            ``global_scale_kind`` (the weights' own), ``rotation``, ``activation``.
        w13_input_scale, w2_input_scale: fp32 ``[E]`` decode scales ``amax / (6 * 448)``
            (0 for an expert never calibrated), or None with ``scale_strategy="per_token"``; when
            ``global_scale_kind`` is ``"encode"`` (compressed-tensors) they are encode scales
            ``6 * 448 / amax`` as stored, used without a reciprocal (``max`` picks the smallest encode
            scale; the fused backend then runs the triton path);
        activation_dtype: bf16 (default) or fp16;
        backend: ``auto`` / ``triton`` / ``fused`` / ``torch`` (``mxlib.moe.base``);
        w13_bias, w2_bias: the expert biases (``TritonExperts``).

    Raises:
        TypeError: weights that are not an ``ExpertWeights`` in nvfp4; tensors of another dtype.
        ValueError: a config of another scheme or global-scale kind; shapes; a static strategy without input
            scales; global or block scales out of range.

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
        bs = NVFP4.block_size
        e, two_i, h_half = w.w13_weight.shape
        h, i = h_half * 2, two_i // 2
        self._set_dims(e, h, i)
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
        self._set_activation_scales()
        self._finish(w13_bias, w2_bias)

    @staticmethod
    def _runs(scheme: MoEQuantScheme) -> bool:
        """Whether this class runs ``scheme`` (NVFP4 weights and activations)."""
        return scheme.weight is NVFP4 and scheme.activation is NVFP4

    @property
    def scale_strategy(self) -> str:
        """How the activation global scales are made (``config.scale_strategy``; ``set_scale_strategy``)."""
        return self.config.scale_strategy

    def set_scale_strategy(self, strategy: str) -> None:
        """Recompute the activation global scales (``unify_input_scales``) for a strategy (the config is
        replaced by a copy with it, checked again); ``per_token`` leaves ``a13_gscale`` / ``a2_gscale`` None
        (the scales are made in the forward).

        Raises:
            ValueError: a strategy not in ``ACTIVATION_SCALE_STRATEGIES``; a static strategy when the
                experts were built without input scales; ``per_token`` with the ``four_over_six`` block rule.
        """
        previous = self.config
        self._config = previous.replace(scale_strategy=strategy)
        try:
            self._set_activation_scales()
        except ValueError:
            self._config = previous
            raise

    def _set_activation_scales(self) -> None:
        """The activation global scales of ``config.scale_strategy`` (``set_scale_strategy``)."""
        strategy = self.config.scale_strategy
        if strategy != PER_TOKEN and (self.w13_input_scale is None or self.w2_input_scale is None):
            raise ValueError(
                f"scale_strategy {strategy!r} needs w13_input_scale and w2_input_scale (static scales); these "
                f"experts were built without them: use scale_strategy={PER_TOKEN!r}"
            )
        a13 = a2 = None  # per_token: the scales are made in the forward
        self._a13_uniform = self._a2_uniform = True
        if strategy != PER_TOKEN:
            unify = _unify_encode_scales if self.global_scale_kind == "encode" else unify_input_scales
            a13, self._a13_uniform = unify(self.w13_input_scale, strategy, "w13_input_scale")
            a2, self._a2_uniform = unify(self.w2_input_scale, strategy, "w2_input_scale")
        rule = self.config.activation_block_rule
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
            return QuantizedA1(q, False, ts if self._hardware() else None)
        qdq = self._hw_qdq if self._hardware() else nvfp4_activation_qdq(ops, self.activation_block_rule)
        if self._a13_uniform:
            return QuantizedA1(qdq(a1, self.a13_gscale[:1]))
        k = topk_ids.shape[1]
        pairs = a1.repeat_interleave(k, dim=0)  # [M*k, H], row t*k + j
        return QuantizedA1(qdq(pairs, self.a13_gscale[topk_ids.reshape(-1).long()]), True)

    def quantize_intermediate(self, a2, row_experts, backend):
        ops = ops_for_backend(backend)
        if self.per_token:  # once per (token, expert) row; hardware: with the rows' scales (``torch_moe``)
            q, ts = ops.nvfp4_per_token_quant_dequant(a2, numerics=self.numerics)
            return (q, ts) if self._hardware() else q
        qdq = self._hw_qdq if self._hardware() else nvfp4_activation_qdq(ops, self.activation_block_rule)
        if self._a2_uniform:
            return qdq(a2, self.a2_gscale[:1])
        return qdq(a2, self.a2_gscale[row_experts.long()])


class OCP_MXQuantizationEmulationTritonExperts(QuantizedExperts):
    """OCP MX MoE emulation for every Quark scheme (``mxlib.moe.schemes``).

    Args:
        weights: an ``ExpertWeights`` in the scheme's weight format: ``w13_weight`` uint8 packed
            ``[E, 2I, H * bits / 8]`` (FP4: H/2, FP6: 3H/4), ``w13_weight_scale`` uint8 E8M0
            ``[E, 2I, H/32]``, ``w2_weight`` and ``w2_weight_scale`` likewise for ``[E, H, I]``;
        config: a ``FusedMoEQuantConfig`` of an OCP MX scheme (``w_mxfp4_a_mxfp4``, ``w_mxfp6_e3m2_a_fp8``, ...):
            ``activation_scale_mode`` (E8M0 rule of the dynamic MX activation QDQ; Quark: ``even``), ``numerics``
            (the same operands for OCP MX, module docstring), ``rotation``, ``activation``.
        w13_input_scale, w2_input_scale: fp32 ``[E]`` static FP8 scales (``amax / 448``), only
            for ``_a_fp8`` schemes (one scale for all experts, the max, as for NVFP4);
        activation_dtype: bf16 (default) or fp16;
        backend: ``auto`` / ``triton`` / ``fused`` / ``torch`` (``mxlib.moe.base``);
        w13_bias, w2_bias: the expert biases (``TritonExperts``).

    Both activation points are quantized whenever the scheme names an activation format: the
    layer input a1 once per token, and the gated activation's output a2 once per (token, expert) pair.

    Raises:
        TypeError: weights that are not an ``ExpertWeights``; tensors of another dtype.
        ValueError: a config of a scheme that is not OCP MX; weights in another format; shapes; an ``_a_fp8``
            scheme without input scales; E8M0 scales that are NaN.

    Source: vLLM ``OCP_MXQuantizationEmulationTritonExperts`` and ``QuarkOCP_MX_MoEMethod``.
    """

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
        self.weight_scheme = self.scheme.weight
        self.quant_dtype = None if self.activation_format is None else self.activation_format.name
        wfmt = self.weight_scheme.element
        bs = self.weight_scheme.block_size
        e, two_i, packed_h = w.w13_weight.shape
        h = packed_h * 8 // wfmt.nbits
        i = two_i // 2
        self._set_dims(e, h, i)
        u8 = (torch.uint8,)
        _check(w.w13_weight, "w13_weight", (e, 2 * i, wfmt.packed_size(h)), u8)
        _check(w.w13_weight_scale, "w13_weight_scale", (e, 2 * i, h // bs), u8)
        _check(w.w2_weight, "w2_weight", (e, h, wfmt.packed_size(i)), u8)
        _check(w.w2_weight_scale, "w2_weight_scale", (e, h, i // bs), u8)
        check_block_scales(w.w13_weight_scale, "w13_weight_scale", e4m3=False)
        check_block_scales(w.w2_weight_scale, "w2_weight_scale", e4m3=False)
        self._register(w.tensors())
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
        self._finish(w13_bias, w2_bias)

    @staticmethod
    def _runs(scheme: MoEQuantScheme) -> bool:
        """Whether this class runs ``scheme`` (OCP MX weights)."""
        return scheme.is_ocp_mx

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
        return QuantizedA1(self._qdq(a1, ops_for_backend(backend), "a13_scale"))

    def quantize_intermediate(self, a2, row_experts, backend):
        return self._qdq(a2, ops_for_backend(backend), "a2_scale")
