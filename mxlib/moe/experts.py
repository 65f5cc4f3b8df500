"""Fused-MoE experts and their quantization-emulation subclasses (vLLM's design).

Shapes: ``M`` tokens, ``H`` hidden size, ``I`` expert intermediate size, ``E``
experts, ``k`` experts per token. ``w13 [E, 2I, H]`` holds each expert's gate
rows then up rows; ``w2 [E, H, I]``.

``TritonExperts`` runs the MoE function

    out[t] = sum_j  w_tj * w2[e_tj] @ (silu(gate) * up),   [gate; up] = w13[e_tj] @ a1[t]

as two grouped GEMMs (``mxlib.kernels.fused_moe``), fp32 accumulation, with the
GEMM outputs rounded to the activation dtype, SiLU-and-mul in fp32, and the router
weight applied in fp32 inside the second GEMM. The emulation subclasses follow
vLLM's ``Nvfp4QuantizationEmulationTritonExperts`` and
``OCP_MXQuantizationEmulationTritonExperts``: every forward they dequantize the
experts' weights to the activation dtype, quantize-dequantize (QDQ) the layer
input ``a1`` and the intermediate activation ``a2`` in the scheme's activation
format, and run the same bf16 path. ``expects_unquantized_inputs`` is true:
they take bf16 hidden states and do the activation QDQ themselves.

Backends: ``"triton"`` (Triton kernels, the seed's design: dequantize all experts,
then bf16 GEMMs; on the CPU only under ``TRITON_INTERPRET=1``), ``"fused"`` (the emulation
subclasses only: packed weights dequantized tile by tile inside the GEMM, a2 QDQ in its
epilogue, ``mxlib.kernels.fused_dequant_moe``), ``"torch"`` (the pure-PyTorch reference MoE below, which
dequantizes only the experts that received tokens: it serves full-size CPU runs),
``"auto"`` (triton for CUDA tensors, torch otherwise). Both give the same QDQ bits;
the GEMMs agree within fp32-accumulation tolerance.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from .. import reference as _ref
from .routing import moe_align_block_size
from .schemes import FP8_PER_TENSOR, MoEQuantScheme, get_moe_scheme

__all__ = [
    "TritonExperts",
    "Nvfp4QuantizationEmulationTritonExperts",
    "OCP_MXQuantizationEmulationTritonExperts",
    "TransformersExperts",
    "silu_and_mul",
    "torch_moe",
    "unify_input_scales",
    "max_input_scale",
    "SCALE_STRATEGIES",
]

SCALE_STRATEGIES = ("max", "per_expert", "mean", "median", "p90", "p75", "p50")
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


BACKENDS = ("auto", "triton", "fused", "torch")


def _resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {list(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return backend


def _ops(backend: str):
    """The quantization functions of a backend: the reference or its Triton twins
    (``triton`` and ``fused`` both QDQ the layer input with the standalone kernels)."""
    if backend == "torch":
        return _ref
    from .. import kernels

    return kernels


def ops_for_device(device) -> object:
    """The quantization functions to use for tensors on ``device``: the Triton twins on CUDA,
    the reference on the CPU (same bits either way)."""
    return _ops("triton" if torch.device(device).type == "cuda" else "torch")


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` computed in fp32, one rounding to ``x.dtype`` (vLLM's op)."""
    d = x.shape[-1] // 2
    xf = x.float()
    return (F.silu(xf[..., :d]) * xf[..., d:]).to(x.dtype)


def max_input_scale(input_scales: torch.Tensor, name: str = "input_scale") -> torch.Tensor:
    """The largest calibrated per-expert input scale, as a one-element fp32 tensor.

    Raises:
        ValueError: a negative or non-finite scale, or every scale 0 (no expert calibrated:
            the global scale 1/0 would be Inf); the message names the tensor.
    """
    s = input_scales.detach().float().reshape(-1)
    if not torch.isfinite(s).all() or (s < 0).any():
        raise ValueError(f"{name}: expected finite, non-negative input scales, got {s.tolist()[:8]}")
    if not (s > 0).any():
        raise ValueError(
            f"{name}: every expert's input_scale is 0 (never calibrated); a global scale of 1/0 "
            f"would be Inf. Calibrate the checkpoint or pass explicit scales."
        )
    return s.max().reshape(1)


def unify_input_scales(
    input_scales: torch.Tensor, strategy: str = "max", name: str = "input_scale"
) -> tuple[torch.Tensor, bool]:
    """Encode global scales (``1 / input_scale``) for the experts' activation QDQ.

    Args:
        input_scales: ``[E]`` fp32 decode scales (``amax / (6 * 448)``) from the checkpoint,
            one per expert; 0 marks an expert never calibrated.
        strategy: ``max`` (the seed and FlashInfer: one scale, the max, so nothing clips),
            ``per_expert`` (each expert its own scale), ``mean`` / ``median`` / ``p90`` /
            ``p75`` / ``p50`` (one scale from that statistic of the calibrated experts'
            scales: finer resolution for most experts, clipping for the largest).
        name: the tensor's name, for messages.

    Returns:
        ``(global_scale [E] fp32, uniform)``: the encode scale of every expert (uncalibrated
        experts get the unified/max one) and whether all are equal.

    Raises:
        ValueError: unknown strategy; no expert calibrated (every scale 0: ``1 / 0`` would be Inf);
            a negative or non-finite scale.
    """
    if strategy not in SCALE_STRATEGIES:
        raise ValueError(f"strategy: expected one of {list(SCALE_STRATEGIES)}, got {strategy!r}")
    s = input_scales.detach().float().reshape(-1)
    smax = max_input_scale(s, name).reshape(())
    calibrated = s > 0
    vals = s[calibrated]
    one = torch.ones((), dtype=torch.float32, device=s.device)
    if strategy == "per_expert":
        per = torch.where(calibrated, s, smax)
        return one / per, bool((per == per[0]).all())
    if strategy == "max" or bool((vals == smax).all()):
        unified = smax  # any statistic of identical scales is that scale, bit for bit
    elif strategy == "mean":
        unified = vals.mean()
    elif strategy == "median":
        unified = vals.median()
    else:
        unified = torch.quantile(vals, int(strategy[1:]) / 100.0)
    if strategy == "max" and bool((vals != smax).any()):
        _warn_once(
            name,
            f"{name}: the activation global scales differ across experts (min {vals.min().item():.4g}, "
            f"max {smax.item():.4g}); using max for all experts, as vLLM and FlashInfer do. Experts with "
            f"smaller activations lose block-scale precision (see the scale-unification notebook).",
        )
    return (one / unified).expand(s.numel()).contiguous(), True


# ----------------------------------------------------------------------------- reference MoE


def torch_moe(
    a1: torch.Tensor,
    w13,
    w2,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    quantize_intermediate=None,
    a1_per_pair: bool = False,
) -> torch.Tensor:
    """Pure-PyTorch reference MoE: a loop over the experts that received tokens.

    Computes what the Triton path computes, at the same rounding points: GEMM1 in fp32
    rounded to the activation dtype, SiLU-and-mul, the optional a2 QDQ, GEMM2 in fp32
    times the router weight rounded to the activation dtype, and the sum over k in fp32.

    Args:
        a1: ``[M, H]`` (or ``[M * k, H]`` with ``a1_per_pair``), already QDQ'd if the scheme says so.
        w13, w2: ``[E, 2I, H]`` / ``[E, H, I]`` tensors, or callables ``e -> weight`` (to
            dequantize one expert at a time).
        topk_weights, topk_ids: ``[M, k]``.
        quantize_intermediate: ``(a2 [n, I], row_experts [n]) -> a2`` or None.

    Returns:
        ``[M, H]`` in ``a1.dtype``.
    """
    m, k = topk_ids.shape
    dtype = a1.dtype
    get13 = w13 if callable(w13) else (lambda e: w13[e])
    get2 = w2 if callable(w2) else (lambda e: w2[e])
    flat_ids = topk_ids.reshape(-1).long()
    flat_w = topk_weights.reshape(-1).float()
    hidden = None
    for e in torch.unique(flat_ids).tolist():
        pairs = (flat_ids == e).nonzero().squeeze(1)
        rows = pairs if a1_per_pair else pairs // k
        h = (a1[rows].float() @ get13(e).float().T).to(dtype)
        act = silu_and_mul(h)
        if quantize_intermediate is not None:
            act = quantize_intermediate(act, flat_ids[pairs])
        w2e = get2(e)
        y = ((act.float() @ w2e.float().T) * flat_w[pairs, None]).to(dtype)
        if hidden is None:
            hidden = torch.zeros(m * k, w2e.shape[0], dtype=dtype, device=a1.device)
        hidden[pairs] = y
    if hidden is None:
        return torch.zeros(m, a1.shape[-1], dtype=dtype, device=a1.device)
    return hidden.view(m, k, -1).float().sum(dim=1).to(dtype)


# ----------------------------------------------------------------------------- experts


class TritonExperts(torch.nn.Module):
    """Fused-MoE experts on unquantized weights (the bf16 path and the ceiling).

    Args:
        w13: ``[E, 2I, H]`` gate-then-up weights; w2: ``[E, H, I]``; same dtype (bf16/fp16/fp32).
        backend: ``auto`` / ``triton`` / ``torch`` (module docstring).

    ``forward(hidden_states [M, H], topk_weights [M, k], topk_ids [M, k]) -> [M, H]``.
    """

    quant_dtype: str | None = None
    expects_unquantized_inputs = False
    # Tile configuration overrides (``MoEGemmConfig`` / ``FusedConfig``); None picks by batch size.
    gemm_config = None
    fused_config = None

    def __init__(self, w13: torch.Tensor | None = None, w2: torch.Tensor | None = None, backend: str = "auto"):
        super().__init__()
        self.backend = backend
        if w13 is not None:
            if w13.ndim != 3 or w2.ndim != 3:
                raise ValueError(f"w13/w2: expected [E, 2I, H] and [E, H, I], got {list(w13.shape)} and {list(w2.shape)}")
            e, two_i, h = w13.shape
            if tuple(w2.shape) != (e, h, two_i // 2):
                raise ValueError(f"w2: expected shape {[e, h, two_i // 2]} for w13 {list(w13.shape)}, got {list(w2.shape)}")
            self.register_buffer("w13", w13, persistent=False)
            self.register_buffer("w2", w2, persistent=False)
            self._dims = (e, h, two_i // 2)
            self.activation_dtype = w13.dtype

    # sizes
    @property
    def num_experts(self) -> int:
        return self._dims[0]

    @property
    def hidden_size(self) -> int:
        return self._dims[1]

    @property
    def intermediate_size(self) -> int:
        return self._dims[2]

    def _device(self) -> torch.device:
        return next(iter(self.buffers())).device

    # hooks the emulation subclasses override
    def dequantized_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All experts' ``(w13, w2)`` in the activation dtype."""
        return self.w13, self.w2

    def dequantized_expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One expert's ``(w13[e], w2[e])`` in the activation dtype."""
        return self.w13[e], self.w2[e]

    def quantize_input(self, a1: torch.Tensor, topk_ids: torch.Tensor, backend: str) -> tuple[torch.Tensor, bool]:
        """QDQ of the layer input: ``([M, H], False)`` once per token, or ``([M*k, H], True)`` per pair."""
        return a1, False

    def quantize_intermediate(self, a2: torch.Tensor, row_experts: torch.Tensor, backend: str) -> torch.Tensor:
        """QDQ of the SiLU-and-mul output ``[n, I]``; ``row_experts [n]`` is each row's expert."""
        return a2

    def forward(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if hidden_states.ndim != 2 or hidden_states.shape[1] != self.hidden_size:
            raise ValueError(f"hidden_states: expected [M, {self.hidden_size}], got {list(hidden_states.shape)}")
        if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != hidden_states.shape[0]:
            raise ValueError(
                f"topk_ids {list(topk_ids.shape)} and topk_weights {list(topk_weights.shape)} must both be "
                f"[M, k] with M = {hidden_states.shape[0]}"
            )
        if hidden_states.dtype != self.activation_dtype:
            raise TypeError(f"hidden_states: expected dtype {self.activation_dtype}, got {hidden_states.dtype}")
        backend = _resolve_backend(self.backend, hidden_states.device)
        a1, per_pair = self.quantize_input(hidden_states, topk_ids, backend)
        return self.apply(a1, topk_weights, topk_ids, per_pair, backend)

    def apply(self, a1, topk_weights, topk_ids, a1_per_pair: bool, backend: str) -> torch.Tensor:
        def qi(x, row_experts):
            return self.quantize_intermediate(x, row_experts, backend)

        if backend == "fused" and isinstance(self, _QuantizedExperts):
            from ..kernels.fused_dequant_moe import invoke_fused_dequant_moe

            w13p, w2p = self._packed()
            return invoke_fused_dequant_moe(a1, w13p, w2p, topk_weights, topk_ids, self._a2_qdq(), a1_per_pair,
                                            self.fused_config)
        if backend == "torch":
            return torch_moe(
                a1,
                lambda e: self.dequantized_expert(e)[0],
                lambda e: self.dequantized_expert(e)[1],
                topk_weights, topk_ids, qi, a1_per_pair,
            )
        from ..kernels.fused_moe import get_moe_config, invoke_fused_moe_kernel

        w13, w2 = self.dequantized_weights()
        m, k = topk_ids.shape
        num_experts, two_i, h = w13.shape
        config = self.gemm_config or get_moe_config(m, num_experts, k, two_i, h)
        sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, config.BLOCK_SIZE_M, num_experts)
        cache1 = torch.empty(m * k, two_i, dtype=a1.dtype, device=a1.device)
        invoke_fused_moe_kernel(a1, w13, cache1, topk_weights, sorted_ids, expert_ids, num_post,
                                False, 1 if a1_per_pair else k, config)
        cache2 = qi(silu_and_mul(cache1), topk_ids.reshape(-1))
        cache3 = torch.empty(m * k, h, dtype=a1.dtype, device=a1.device)
        config2 = self.gemm_config or get_moe_config(m, num_experts, k, h, two_i // 2)
        if config2.BLOCK_SIZE_M != config.BLOCK_SIZE_M:
            sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, config2.BLOCK_SIZE_M, num_experts)
        invoke_fused_moe_kernel(cache2, w2, cache3, topk_weights, sorted_ids, expert_ids, num_post, True, 1, config2)
        return cache3.view(m, k, h).float().sum(dim=1).to(a1.dtype)


class _QuantizedExperts(TritonExperts):
    """Shared plumbing of the emulation subclasses: weights stored quantized as buffers."""

    expects_unquantized_inputs = True

    def _set_dims(self, e: int, h: int, i: int, activation_dtype: torch.dtype) -> None:
        self._dims = (e, h, i)
        if activation_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(f"activation_dtype: expected bfloat16, float16 or float32, got {activation_dtype}")
        self.activation_dtype = activation_dtype

    @staticmethod
    def _check(t: torch.Tensor, name: str, shape, dtypes) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{name}: expected shape {list(shape)}, got {list(t.shape)}")
        if t.dtype not in dtypes:
            raise TypeError(f"{name}: expected dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
        return t

    def dequantized_weights(self):
        backend = _resolve_backend(self.backend, self._device())
        return self._dequantize(_ops("torch" if backend == "torch" else "triton"), slice(None))

    def _packed(self):
        """(w13, w2) as ``PackedWeights`` for the fused kernel."""
        from ..kernels.fused_dequant_moe import PackedWeights

        fmt = self._weight_format()
        nv = fmt.name == "e2m1" and isinstance(self, Nvfp4QuantizationEmulationTritonExperts)
        spec = {"none": 0, "fn": 1, "ieee": 2}[fmt.specials]
        bs = 16 if nv else 32

        def pack(w, sc, g):
            return PackedWeights(w, sc.view(torch.uint8), fmt.ebits, fmt.mbits, spec, bs, nv, g if nv else None)

        return (pack(self.w13_weight, self.w13_weight_scale, getattr(self, "w13_weight_scale_2", None)),
                pack(self.w2_weight, self.w2_weight_scale, getattr(self, "w2_weight_scale_2", None)))

    def dequantized_expert(self, e: int):
        w13, w2 = self._dequantize(_ref, slice(e, e + 1))
        return w13[0], w2[0]


class Nvfp4QuantizationEmulationTritonExperts(_QuantizedExperts):
    """NVFP4 MoE emulation: NVFP4 weights dequantized, activations NVFP4-QDQ'd, bf16 GEMMs.

    Args (ModelOpt tensors stacked over experts):
        w13_weight: uint8 ``[E, 2I, H/2]``; w13_weight_scale: float8_e4m3fn ``[E, 2I, H/16]``;
        w13_weight_scale_2: fp32 ``[E]``, or ``[E, 2]`` when gate and up have different
            scales (each half is dequantized with its own; vLLM would use the gate's for both);
        w2_weight, w2_weight_scale, w2_weight_scale_2: ``[E, H, I/2]``, ``[E, H, I/16]``, ``[E]``;
        w13_input_scale, w2_input_scale: fp32 ``[E]`` decode scales ``amax / (6 * 448)``
            (0 for an expert never calibrated);
        scale_strategy: how per-expert activation scales become global ones
            (``unify_input_scales``); ``max`` is the seed's and warns when scales differ;
        activation_dtype: bf16 (default) or fp16.

    Source: vLLM ``Nvfp4QuantizationEmulationTritonExperts`` (``dequantize_to_dtype`` for the
    weights, ``ref_nvfp4_quant_dequant`` for a1 and a2 with ``a13_gscale = 1 / max(w13 input
    scales)`` and ``a2_gscale = 1 / max(w2 input scales)``).
    """

    quant_dtype = "nvfp4"

    def __init__(
        self,
        w13_weight, w13_weight_scale, w13_weight_scale_2,
        w2_weight, w2_weight_scale, w2_weight_scale_2,
        w13_input_scale, w2_input_scale,
        scale_strategy: str = "max",
        activation_dtype: torch.dtype = torch.bfloat16,
        backend: str = "auto",
    ):
        from .._checks import check_global_scale  # global scales in [2**-126, 2**126]; input scales may be 0

        for name, t, zero_ok in [("w13_weight_scale_2", w13_weight_scale_2, False),
                                 ("w2_weight_scale_2", w2_weight_scale_2, False),
                                 ("w13_input_scale", w13_input_scale, True), ("w2_input_scale", w2_input_scale, True)]:
            check_global_scale(t, name, allow_zero=zero_ok)
        super().__init__(backend=backend)
        e, two_i, h_half = w13_weight.shape
        h, i = h_half * 2, two_i // 2
        self._set_dims(e, h, i, activation_dtype)
        u8, f8, f32 = (torch.uint8,), (torch.float8_e4m3fn,), (torch.float32,)
        self._check(w13_weight, "w13_weight", (e, 2 * i, h // 2), u8)
        self._check(w13_weight_scale, "w13_weight_scale", (e, 2 * i, h // 16), f8)
        if w13_weight_scale_2.shape not in ((e,), (e, 2)):
            raise ValueError(f"w13_weight_scale_2: expected shape [{e}] or [{e}, 2], got {list(w13_weight_scale_2.shape)}")
        self._check(w13_weight_scale_2, "w13_weight_scale_2", w13_weight_scale_2.shape, f32)
        self._check(w2_weight, "w2_weight", (e, h, i // 2), u8)
        self._check(w2_weight_scale, "w2_weight_scale", (e, h, i // 16), f8)
        self._check(w2_weight_scale_2, "w2_weight_scale_2", (e,), f32)
        self._check(w13_input_scale, "w13_input_scale", (e,), f32)
        self._check(w2_input_scale, "w2_input_scale", (e,), f32)
        if w13_weight_scale_2.ndim == 2 and not torch.equal(w13_weight_scale_2[:, 0], w13_weight_scale_2[:, 1]):
            _warn_once("w13_weight_scale_2", "w13_weight_scale_2: gate and up scales differ; each half is "
                       "dequantized with its own (vLLM would use the gate's for both)")
        elif w13_weight_scale_2.ndim == 2:
            w13_weight_scale_2 = w13_weight_scale_2[:, 0].contiguous()
        for name, t in [("w13_weight", w13_weight), ("w13_weight_scale", w13_weight_scale),
                        ("w13_weight_scale_2", w13_weight_scale_2), ("w2_weight", w2_weight),
                        ("w2_weight_scale", w2_weight_scale), ("w2_weight_scale_2", w2_weight_scale_2),
                        ("w13_input_scale", w13_input_scale), ("w2_input_scale", w2_input_scale)]:
            self.register_buffer(name, t, persistent=False)
        self.set_scale_strategy(scale_strategy)

    def set_scale_strategy(self, strategy: str) -> None:
        """Recompute the activation global scales (``unify_input_scales``) for a strategy."""
        self.scale_strategy = strategy
        a13, self._a13_uniform = unify_input_scales(self.w13_input_scale, strategy, "w13_input_scale")
        a2, self._a2_uniform = unify_input_scales(self.w2_input_scale, strategy, "w2_input_scale")
        self.register_buffer("a13_gscale", a13, persistent=False)
        self.register_buffer("a2_gscale", a2, persistent=False)

    def _weight_format(self):
        return _ref.get_element_format("e2m1")

    def _a2_qdq(self):
        from ..kernels.fused_dequant_moe import ActivationQDQ

        return ActivationQDQ(kind=2, block_size=16, scale=self.a2_gscale)

    def _dequantize(self, ops, sel):
        dt = self.activation_dtype
        g13 = self.w13_weight_scale_2[sel]
        if g13.ndim == 2:  # gate and up halves with their own scales
            i = self.intermediate_size
            halves = [
                ops.dequantize_to_dtype(self.w13_weight[sel][:, j * i:(j + 1) * i].contiguous(),
                                        self.w13_weight_scale[sel][:, j * i:(j + 1) * i].contiguous(),
                                        g13[:, j].contiguous(), dt)
                for j in range(2)
            ]
            w13 = torch.cat(halves, dim=1)
        else:
            w13 = ops.dequantize_to_dtype(self.w13_weight[sel], self.w13_weight_scale[sel], g13, dt)
        w2 = ops.dequantize_to_dtype(self.w2_weight[sel], self.w2_weight_scale[sel], self.w2_weight_scale_2[sel], dt)
        return w13, w2

    def quantize_input(self, a1, topk_ids, backend):
        ops = _ops(backend)
        if self._a13_uniform:
            return ops.ref_nvfp4_quant_dequant(a1, self.a13_gscale[:1]), False
        k = topk_ids.shape[1]
        pairs = a1.repeat_interleave(k, dim=0)  # [M*k, H], row t*k + j
        gs = self.a13_gscale[topk_ids.reshape(-1).long()]
        return ops.ref_nvfp4_quant_dequant(pairs, gs), True

    def quantize_intermediate(self, a2, row_experts, backend):
        ops = _ops(backend)
        if self._a2_uniform:
            return ops.ref_nvfp4_quant_dequant(a2, self.a2_gscale[:1])
        return ops.ref_nvfp4_quant_dequant(a2, self.a2_gscale[row_experts.long()])


class OCP_MXQuantizationEmulationTritonExperts(_QuantizedExperts):
    """OCP MX MoE emulation for every Quark scheme (``mxlib.moe.schemes``).

    Args:
        scheme: a Quark scheme name (``w_mxfp4_a_mxfp4``, ``w_mxfp6_e3m2_a_fp8``, ...) or ``mxfp4``.
        w13_weight: uint8 packed ``[E, 2I, H * bits / 8]`` (FP4: H/2, FP6: 3H/4);
        w13_weight_scale: uint8 E8M0 ``[E, 2I, H/32]``; w2_weight / w2_weight_scale likewise
            for ``[E, H, I]``;
        w13_input_scale, w2_input_scale: fp32 ``[E]`` static FP8 scales (``amax / 448``), only
            for ``_a_fp8`` schemes (one scale for all experts, the max, as for NVFP4);
        activation_scale_mode: E8M0 rule for the dynamic MX activation QDQ (Quark: ``even``);
        activation_dtype: bf16 (default) or fp16.

    Both activation points are quantized whenever the scheme names an activation format: the
    layer input a1 once per token, and the SiLU-and-mul output a2 once per (token, expert) pair.

    Source: vLLM ``OCP_MXQuantizationEmulationTritonExperts`` and ``QuarkOCP_MX_MoEMethod``.
    """

    def __init__(
        self,
        scheme: str | MoEQuantScheme,
        w13_weight, w13_weight_scale, w2_weight, w2_weight_scale,
        w13_input_scale=None, w2_input_scale=None,
        activation_scale_mode: str = "even",
        activation_dtype: torch.dtype = torch.bfloat16,
        backend: str = "auto",
    ):
        super().__init__(backend=backend)
        self.scheme = get_moe_scheme(scheme)
        if not self.scheme.is_ocp_mx:
            raise ValueError(f"scheme: {self.scheme.name} is not an OCP MX scheme; use Nvfp4QuantizationEmulationTritonExperts")
        self.quant_dtype = self.scheme.activation
        wfmt = self.scheme.weight_scheme.element
        self._element = wfmt.name
        e, two_i, packed_h = w13_weight.shape
        h = packed_h * 8 // wfmt.nbits
        i = two_i // 2
        self._set_dims(e, h, i, activation_dtype)
        u8 = (torch.uint8,)
        self._check(w13_weight, "w13_weight", (e, 2 * i, wfmt.packed_size(h)), u8)
        self._check(w13_weight_scale, "w13_weight_scale", (e, 2 * i, h // 32), u8)
        self._check(w2_weight, "w2_weight", (e, h, wfmt.packed_size(i)), u8)
        self._check(w2_weight_scale, "w2_weight_scale", (e, h, i // 32), u8)
        for name, t in [("w13_weight", w13_weight), ("w13_weight_scale", w13_weight_scale),
                        ("w2_weight", w2_weight), ("w2_weight_scale", w2_weight_scale)]:
            self.register_buffer(name, t, persistent=False)
        _ref.get_scale_mode(activation_scale_mode)
        self.activation_scale_mode = activation_scale_mode
        self._act_element = None
        if self.scheme.activation == FP8_PER_TENSOR:
            if w13_input_scale is None or w2_input_scale is None:
                raise ValueError(f"{self.scheme.name}: static FP8 activations need w13_input_scale and w2_input_scale")
            self._check(w13_input_scale, "w13_input_scale", (e,), (torch.float32,))
            self._check(w2_input_scale, "w2_input_scale", (e,), (torch.float32,))
            # one scale across experts, the max, as vLLM does for static per-tensor FP8
            self.register_buffer("a13_scale", max_input_scale(w13_input_scale, "w13_input_scale"), persistent=False)
            self.register_buffer("a2_scale", max_input_scale(w2_input_scale, "w2_input_scale"), persistent=False)
        elif self.scheme.activation is not None:
            self._act_element = _ref.get_element_format(
                {"mxfp4": "e2m1", "mxfp6_e3m2": "e3m2", "mxfp6_e2m3": "e2m3"}[self.scheme.activation]).name

    def _weight_format(self):
        return _ref.get_element_format(self._element)

    def _a2_qdq(self):
        from ..kernels.fused_dequant_moe import ActivationQDQ

        if self.scheme.activation is None:
            return ActivationQDQ()
        if self.scheme.activation == FP8_PER_TENSOR:
            return ActivationQDQ(kind=3, scale=self.a2_scale)
        f = _ref.get_element_format(self._act_element)
        return ActivationQDQ(kind=1, ebits=f.ebits, mbits=f.mbits, emax=f.emax, max=f.max,
                             scale_mode={"floor": 0, "even": 1, "rceil": 2}[self.activation_scale_mode], block_size=32)

    def _dequantize(self, ops, sel):
        dt = self.activation_dtype
        w13 = ops.dequantize_mx(self.w13_weight[sel], self.w13_weight_scale[sel], self._element, 32, dt)
        w2 = ops.dequantize_mx(self.w2_weight[sel], self.w2_weight_scale[sel], self._element, 32, dt)
        return w13, w2

    def _qdq(self, x, ops, scale_name):
        if self.scheme.activation is None:
            return x
        if self.scheme.activation == FP8_PER_TENSOR:
            return ops.quant_dequant_fp8_per_tensor(x, getattr(self, scale_name), check_scale=False)
        return ops.quant_dequant_mx(x, self._act_element, 32, self.activation_scale_mode)

    def quantize_input(self, a1, topk_ids, backend):
        return self._qdq(a1, _ops(backend), "a13_scale"), False

    def quantize_intermediate(self, a2, row_experts, backend):
        return self._qdq(a2, _ops(backend), "a2_scale")


class TransformersExperts(torch.nn.Module):
    """Adapter: an mxlib experts object in the place of transformers' ``Qwen3MoeExperts``.

    transformers calls ``experts(hidden_states [M, H], top_k_index [M, k], top_k_weights [M, k])``;
    the router weights arrive in the model dtype and are widened to fp32 (exactly).
    """

    def __init__(self, experts: TritonExperts):
        super().__init__()
        self.experts = experts

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return self.experts(hidden_states, top_k_weights.float(), top_k_index.to(torch.int32))
