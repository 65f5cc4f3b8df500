"""The fused-MoE experts base class (``TritonExperts``), backend selection and the transformers adapter.

Shapes: ``M`` tokens, ``H`` hidden size, ``I`` expert intermediate size, ``E`` experts,
``k`` experts per token. ``w13 [E, 2I, H]`` holds each expert's gate rows then up rows;
``w2 [E, H, I]``.

``TritonExperts`` runs the MoE function

    out[t] = sum_j  w_tj * (w2[e_tj] @ act(gate, up) + b2[e_tj]),   [gate; up] = w13[e_tj] @ a1[t] + b13[e_tj]

as two grouped GEMMs (``mxlib.kernels.fused_moe``), fp32 accumulation, with the
GEMM outputs (plus the optional expert biases ``w13_bias [E, 2I]``, ``w2_bias [E, H]``, added in
fp32 before the rounding) rounded to the activation dtype, the gated activation ``act`` in fp32
(``activation``: ``SILU``, ``silu(gate) * up``, by default; ``SWIGLUOAI`` for gpt-oss;
``mxlib.moe.activations``), and the router weight applied in fp32 inside the second GEMM, after
its bias. The experts take their weights, one ``FusedMoEQuantConfig`` (``mxlib.moe.quant_config``: the
scheme and every mode, checked once) and a backend.

Subclasses (``mxlib.moe.emulation``, ``weight_only``, ``nvfp4_variants``) override these hooks and no other
method (``SUBCLASS_HOOKS``, tested):

* the quantized operands: ``dequantized_weights`` / ``dequantized_expert`` (weights in the activation dtype),
  ``quantize_input`` (a1, a ``QuantizedA1``) and ``quantize_intermediate`` (a2);
* the fused kernels' operands (subclasses holding packed weights, which set ``supports_fused``):
  ``packed_weights`` (the dequantize-GEMM kernel's), ``fp4_weights`` and ``fp4_operands`` (the FP4 kernel's
  weights, hidden states and GEMM1 bias), ``a1_qdq`` and ``a2_qdq`` (the activation QDQ the kernels fuse);
* the arithmetic and the backend: ``output_scales`` (hardware numerics' per-tensor scales on the GEMM
  outputs), ``prefers_fused`` (``auto``'s choice on CUDA), ``resolved_backend`` (what ``auto`` runs) and
  ``check_backend`` (what the numerics cannot run).

The base class never asks which subclass it is.

Rotation (``rotation``, a ``mxlib.kernels.hadamard.BlockHadamard`` or None, the default): experts whose
weights were rotated offline along K (``mxlib.recovery.hadamard``) rotate their activations online the
same way before each QDQ: a1 along H before ``quantize_input`` (and before GEMM1), a2 along I after
SiLU-and-mul, before ``quantize_intermediate`` (and GEMM2). The ``torch`` backend rotates with
``ref_block_hadamard``, ``triton`` with its Triton twin (same bits), the FP4 kernel rotates a1 in a
pass before it and a2 in GEMM1's epilogue; the generic dequantize-GEMM kernel has no rotation, so
rotated experts on ``fused`` without the FP4 kernel run the ``triton`` path.

Backends: ``"triton"`` (Triton kernels, vLLM's emulation design: dequantize all experts,
then bf16 GEMMs; on the CPU only under ``TRITON_INTERPRET=1``), ``"fused"`` (subclasses with
``supports_fused``: packed weights dequantized tile by tile inside the GEMM, a2 QDQ in its
epilogue: FP4 weights (``mxfp4``, ``nvfp4``) with bf16 activations and H, I multiples of 128 (or
zero-padded to them, ``mxlib.moe.emulation.FP4_PAD_MAX_FRACTION``: gpt-oss-20b's 2880) run
``mxlib.kernels.fused_fp4_moe`` on weights prepared once into its layout, with the a1 QDQ fused
too; other weights run ``mxlib.kernels.fused_dequant_moe``), ``"torch"`` (the pure-PyTorch
reference MoE, ``mxlib.moe.reference_moe``, which dequantizes only the experts that received
tokens: it serves full-size CPU runs), ``"auto"`` (on CUDA: ``fused`` for experts whose
``prefers_fused()`` says so, the FP4-weight emulations, faster there at every batch size on the
H200, and the MX FP8-weight ones, faster at every batch size on an H100; ``triton`` otherwise; ``torch``
on the CPU). All give the same QDQ bits; the GEMMs agree
within fp32-accumulation tolerance.

Routing plan: each forward picks the tiles of the GEMM path that runs (``TileConfig`` from
``get_moe_config`` (bf16 GEMMs), ``get_fused_config`` (dequantize-GEMM) or ``get_fp4_configs`` (FP4
kernel), all chosen from CUDA-graph replay timings on the H200, or the ``gemm_config`` /
``fused_config`` / ``fp4_config`` overrides), then makes one ``RoutingPlan``
(``mxlib.kernels.align.plan_routing``) and hands it to that path: no alignment at all for tiny
batches (``M * k * 4 <= E``, vLLM's rule: each pair its own block) where the path's kernels have a
naive mode (bf16, FP4), else ``moe_align_block_size`` for each ``block_m`` the GEMMs use (the
Triton version on CUDA, one or two launches; the PyTorch version elsewhere).
"""

from __future__ import annotations

import itertools
import weakref
from typing import NamedTuple

import torch

from .. import kernels as _kernels
from .. import reference as _ref
from .._checks import capturing
from ..formats import Numerics
from ..kernels.align import plan_routing
from ..kernels.fp4_activations import is_per_token
from ..kernels.fp4_layout import FP4Weights
from ..kernels.fp6_layout import FP6Weights
from ..kernels.fused_dequant_moe import ActivationQDQ, PackedWeights, get_fused_config, invoke_fused_dequant_moe
from ..kernels.fused_fp4_moe import fused_fp4_moe_impl, get_fp4_configs
from ..kernels.fused_moe import get_moe_config, invoke_fused_moe_kernel
from ..kernels.hadamard import BlockHadamard
from .activations import MoEActivation, activation_and_mul
from .quant_config import FusedMoEQuantConfig
from .reference_moe import torch_moe

__all__ = [
    "BACKENDS",
    "SUBCLASS_HOOKS",
    "ACTIVATION_DTYPES",
    "keep_dtype_on_cast",
    "TritonExperts",
    "QuantizedA1",
    "check_topk_ids",
    "TransformersExperts",
    "resolve_backend",
    "ops_for_backend",
    "ops_for_device",
]

BACKENDS = ("auto", "triton", "fused", "torch")
# The methods of ``TritonExperts`` a subclass may override (module docstring); ``forward`` and ``apply`` are not
# among them: the path a forward takes, its input checks and its routing plan are the base class's.
SUBCLASS_HOOKS = (
    "dequantized_weights",
    "dequantized_expert",
    "quantize_input",
    "quantize_intermediate",
    "packed_weights",
    "fp4_weights",
    "fp4_operands",
    "a1_qdq",
    "a2_qdq",
    "output_scales",
    "prefers_fused",
    "resolved_backend",
    "check_backend",
)
# The activation dtypes every experts class runs (a cast to another is refused).
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def resolve_backend(backend: str, device: torch.device) -> str:
    """``auto`` -> ``triton`` for CUDA tensors, ``torch`` otherwise; other names are checked."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {list(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return backend


def ops_for_backend(backend: str):
    """The quantization functions of a backend: the reference or its Triton twins
    (``triton`` and ``fused`` both QDQ the layer input with the standalone kernels)."""
    return _ref if backend == "torch" else _kernels


def ops_for_device(device) -> object:
    """The quantization functions to use for tensors on ``device``: the Triton twins on CUDA,
    the reference on the CPU (same bits either way)."""
    return ops_for_backend("triton" if torch.device(device).type == "cuda" else "torch")


def check_topk_ids(topk_ids: torch.Tensor, num_experts: int) -> None:
    """``topk_ids`` must be an integer tensor with every value in ``[0, num_experts)``.

    An id out of range would otherwise pick a wrong expert silently (-1 is the last one under
    Python indexing) or fail deep inside a kernel. The dtype check always runs; the value check
    reads the tensor (one host sync for a CUDA tensor), so it is skipped while a CUDA graph is
    being captured (``mxlib._checks.capturing``): a captured forward must be given valid ids.

    Raises:
        TypeError: a floating or bool ``topk_ids``.
        ValueError: naming ``topk_ids``, the first bad value, its index and the valid range.
    """
    if topk_ids.dtype.is_floating_point or topk_ids.dtype.is_complex or topk_ids.dtype == torch.bool:
        raise TypeError(f"topk_ids: expected an integer tensor (int32 or int64), got {topk_ids.dtype}")
    if topk_ids.numel() == 0 or capturing():
        return
    bad = (topk_ids < 0) | (topk_ids >= num_experts)
    if bool(bad.any()):
        where = bad.nonzero()[0].tolist()
        value = int(topk_ids[tuple(where)])
        raise ValueError(
            f"topk_ids: expected expert ids in [0, {num_experts}) (0 <= id < num_experts = {num_experts}), got "
            f"{value} at index {where} ({int(bad.sum())} of {topk_ids.numel()} ids out of range)"
        )


class QuantizedA1(NamedTuple):
    """What ``quantize_input`` gives the GEMMs: the QDQ'd layer input ``a1`` (``[M, H]`` once per token, or
    ``[M*k, H]`` per (token, expert) pair when ``per_pair``), and, for per-token NVFP4 scales in hardware
    numerics, ``row_scale``: each row's ``per_token_scale`` ``[rows, 1]`` fp32, which multiplies GEMM1's output
    rows (else None)."""

    a1: torch.Tensor
    per_pair: bool = False
    row_scale: torch.Tensor | None = None


class TritonExperts(torch.nn.Module):
    """Fused-MoE experts on unquantized weights (the bf16 path and the ceiling).

    Args:
        w13: ``[E, 2I, H]`` gate-then-up weights; w2: ``[E, H, I]``; same dtype (bf16/fp16/fp32).
        config: a ``FusedMoEQuantConfig`` (``mxlib.moe.quant_config``) without a scheme: the gated ``activation``
            (SiLU by default; SwiGLU-OAI: gpt-oss's alpha 1.702, limit 7.0) and the ``rotation``; None: the default.
        backend: ``auto`` / ``triton`` / ``torch`` (module docstring).
        w13_bias: ``[E, 2I]`` expert biases of GEMM1 (gate columns, then up columns, as w13's rows), fp32, bf16
            or fp16 (read as fp32), on the weights' device; or None. w2_bias: ``[E, H]`` likewise for GEMM2.

    Every subclass takes a config, a backend, ``w13_bias`` and ``w2_bias`` too; ``config`` returns the config,
    ``activation`` and ``numerics`` its fields, ``w13_bias`` / ``w2_bias`` the biases (as given, None without).

    Raises:
        TypeError: a config that is not a ``FusedMoEQuantConfig``; a bias that is not a tensor, or of another dtype.
        ValueError: a config with a scheme (quantized experts: ``make_emulation_experts``); a bias of another
            shape; a bias on another device; a rotation that does not fit H and I.

    ``forward(hidden_states [M, H], topk_weights [M, k], topk_ids [M, k]) -> [M, H]``.
    """

    quant_dtype: str | None = None
    expects_unquantized_inputs = False
    # Whether the ``fused`` backend applies (subclasses holding packed weights set it and
    # implement ``packed_weights`` and ``a2_qdq``); otherwise ``fused`` runs the triton path.
    supports_fused = False
    # Tile overrides (``mxlib.kernels.tiles.TileConfig``) of the bf16 GEMMs, the dequantize-GEMM and
    # (a (GEMM1, GEMM2) pair) the FP4 kernel; None picks by batch size.
    gemm_config = None
    fused_config = None
    fp4_config = None
    # The rotation's block size (``rotation``; its signs are buffers), None without a rotation.
    _rotation_block_size: int | None = None
    # Buffers a dtype cast of the module converts (``_apply``): the unquantized weights; every other buffer
    # (codes, scales, biases, rotation signs) keeps its dtype.
    cast_with_activations: tuple[str, ...] = ("w13", "w2")

    def __init__(
        self,
        w13: torch.Tensor | None = None,
        w2: torch.Tensor | None = None,
        config: FusedMoEQuantConfig | None = None,
        *,
        backend: str = "auto",
        w13_bias: torch.Tensor | None = None,
        w2_bias: torch.Tensor | None = None,
    ):
        super().__init__()
        if backend not in BACKENDS:  # refused here, not at the first forward
            raise ValueError(f"backend: expected one of {list(BACKENDS)}, got {backend!r}")
        config = FusedMoEQuantConfig() if config is None else config
        if not isinstance(config, FusedMoEQuantConfig):
            raise TypeError(f"config: expected a FusedMoEQuantConfig or None, got {type(config).__name__}")
        self.backend = backend
        self._handle = _register_experts(self)
        self._config = config
        self.register_buffer("w13_bias", None, persistent=False)
        self.register_buffer("w2_bias", None, persistent=False)
        if w13 is not None:
            if w13.ndim != 3 or w2.ndim != 3:
                raise ValueError(
                    f"w13/w2: expected [E, 2I, H] and [E, H, I], got {list(w13.shape)} and {list(w2.shape)}"
                )
            e, two_i, h = w13.shape
            if tuple(w2.shape) != (e, h, two_i // 2):
                raise ValueError(
                    f"w2: expected shape {[e, h, two_i // 2]} for w13 {list(w13.shape)}, got {list(w2.shape)}"
                )
            self.register_buffer("w13", w13, persistent=False)
            self.register_buffer("w2", w2, persistent=False)
            self._dims = (e, h, two_i // 2)
            self.activation_dtype = w13.dtype
            if config.scheme is not None:
                raise ValueError(
                    f"config: TritonExperts runs unquantized weights, got scheme {config.scheme.name} "
                    f"(quantized experts: mxlib.moe.make_emulation_experts)"
                )
            self._set_biases(w13_bias, w2_bias)
            self.rotation = config.rotation
        elif w13_bias is not None or w2_bias is not None:
            raise ValueError("w13_bias/w2_bias: given without w13 and w2 (a subclass passes them to _set_biases)")

    @property
    def config(self) -> FusedMoEQuantConfig:
        """The experts' ``FusedMoEQuantConfig`` (frozen; ``numerics`` and ``rotation`` set a changed copy)."""
        return self._config

    @property
    def activation(self) -> MoEActivation:
        """The gated activation between the GEMMs (``mxlib.moe.activations``)."""
        return self._config.activation

    @property
    def numerics(self) -> Numerics:
        """The numerics of the emulation (``mxlib.moe.emulation``): ``Numerics.VLLM`` or ``Numerics.HARDWARE``.
        Setting it (a member or its name) replaces the config by a copy, checked again (``FusedMoEQuantConfig``)."""
        return self._config.numerics

    @numerics.setter
    def numerics(self, numerics: Numerics | str) -> None:
        self._config = self._config.replace(numerics=numerics)

    def _set_biases(self, w13_bias: torch.Tensor | None, w2_bias: torch.Tensor | None) -> None:
        """Check and hold the expert biases (class docstring); call once the sizes, the activation dtype and
        the weights (their device) are set."""
        e, h, i = self._dims
        device = self._device()
        for name, t, shape, what in (
            ("w13_bias", w13_bias, (e, 2 * i), "[E, 2I]"),
            ("w2_bias", w2_bias, (e, h), "[E, H]"),
        ):
            if t is None:
                continue
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: expected a tensor {what} or None, got {type(t).__name__}")
            if tuple(t.shape) != shape:
                raise ValueError(f"{name}: expected shape {list(shape)} ({what}), got {list(t.shape)}")
            if t.dtype not in ACTIVATION_DTYPES:  # read as fp32 by every GEMM path; kept as given through casts
                raise TypeError(f"{name}: expected dtype float32, bfloat16 or float16, got {t.dtype}")
            if t.device != device:
                raise ValueError(f"{name}: expected a tensor on the weights' device {device}, got {t.device}")
            self.register_buffer(name, t.contiguous(), persistent=False)

    def moe_arithmetic(self) -> dict:
        """``torch_moe``'s ``activation``, ``w13_bias``, ``w2_bias`` arguments of these experts."""
        return dict(activation=self.activation, w13_bias=self.w13_bias, w2_bias=self.w2_bias)

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        self._handle = _register_experts(self)  # a copy (deepcopy, pickle) is its own experts

    def _apply(self, fn, recurse=True):
        """``module.to(...)``, ``.half()``, ``.float()``, ``.cuda()`` and the like (``keep_dtype_on_cast``): a device
        move applies to every buffer; a dtype cast changes the activation dtype (and the unquantized ``w13`` /
        ``w2`` of bf16 experts) and leaves every other buffer in its own dtype, so quantized codes, block and global
        scales, input scales, biases and rotation signs keep their bytes.

        Raises:
            TypeError: a cast to a dtype other than bfloat16, float16 or float32, naming it (nothing changed).
        """
        if not hasattr(self, "_dims"):
            return super()._apply(fn, recurse)
        return keep_dtype_on_cast(self, fn, recurse, self.cast_with_activations, lambda: super(TritonExperts, self))

    def extra_repr(self) -> str:
        """``print(experts)``: sizes, scheme, activation dtype, numerics and backend."""
        e, h, i = self._dims if hasattr(self, "_dims") else (None, None, None)
        scheme = getattr(getattr(self, "scheme", None), "name", None) or (
            getattr(getattr(self, "weight_scheme", None), "name", None) or "unquantized"
        )
        device = self._device() if self._buffers else None
        parts = [
            f"num_experts={e}, hidden_size={h}, intermediate_size={i}",
            f"scheme={scheme}",
            f"activation={self.activation.name}",
            f"activation_dtype={str(getattr(self, 'activation_dtype', None)).replace('torch.', '')}",
            f"numerics={self.numerics.value if hasattr(self.numerics, 'value') else self.numerics}",
            f"backend={self.backend}" + (f" (runs {self.resolved_backend(device)})" if device is not None else ""),
        ]
        if getattr(self, "scale_strategy", None) is not None:
            parts.append(f"scale_strategy={self.scale_strategy}")
        if self.rotation is not None:
            parts.append(f"rotation=hadamard({self._rotation_block_size})")
        return ", ".join(parts)

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

    @property
    def rotation(self) -> BlockHadamard | None:
        """The online block Hadamard rotation of the activations (module docstring), or None."""
        if self._rotation_block_size is None:
            return None
        signs = (getattr(self, "rotation_signs_h", None), getattr(self, "rotation_signs_i", None))
        return BlockHadamard(self._rotation_block_size, *signs)

    @rotation.setter
    def rotation(self, rotation: BlockHadamard | None) -> None:
        """Set (or, with None, remove) the rotation; its signs become buffers on the experts' device.

        Raises:
            TypeError: not a ``BlockHadamard`` or None.
            ValueError: a block size not dividing H and I, or signs of the wrong length (``BlockHadamard.check``).
        """
        if rotation is not None and not isinstance(rotation, BlockHadamard):
            raise TypeError(f"rotation: expected a BlockHadamard or None, got {type(rotation).__name__}")
        if rotation is not None:
            rotation.check(self.hidden_size, self.intermediate_size)
        device = self._device()
        for name in ("signs_h", "signs_i"):
            s = None if rotation is None else getattr(rotation, name)
            self.register_buffer("rotation_" + name, None if s is None else s.to(device), persistent=False)
        self._rotation_block_size = None if rotation is None else rotation.block_size
        if rotation is not self._config.rotation:
            self._config = self._config.replace(rotation=rotation)

    def intermediate_qdq(self, backend: str):
        """``(a2 [n, I], row_experts [n]) -> quantize_intermediate(a2 rotated along I, ...)`` on ``backend``."""
        rotation = self.rotation

        def qi(x, row_experts):
            if rotation is not None:
                x = rotation.rotate_i(x, triton=backend != "torch")
            return self.quantize_intermediate(x, row_experts, backend)

        return qi

    # hooks the emulation subclasses override
    def dequantized_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All experts' ``(w13, w2)`` in the activation dtype."""
        return self.w13, self.w2

    def expert_weight_getters(self):
        """``(w13_of, w2_of)``: ``e -> w13[e]`` and ``e -> w2[e]`` for ``torch_moe``'s loop over the experts,
        which asks for an expert's w13 and then its w2: each expert is dequantized once per forward (the last
        one asked for is held until the next), not once per weight."""
        last: list = [None, None]

        def both(e: int):
            if last[0] != e:
                last[0], last[1] = e, self.dequantized_expert(e)
            return last[1]

        return (lambda e: both(e)[0]), (lambda e: both(e)[1])

    def dequantized_expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One expert's ``(w13[e], w2[e])`` in the activation dtype."""
        return self.w13[e], self.w2[e]

    def quantize_input(self, a1: torch.Tensor, topk_ids: torch.Tensor, backend: str) -> QuantizedA1:
        """QDQ of the layer input: ``QuantizedA1([M, H], False)`` once per token, or ``([M*k, H], True)`` per
        pair, with the rows' per-token scales where hardware numerics multiply GEMM1's output by them."""
        return QuantizedA1(a1)

    def quantize_intermediate(self, a2: torch.Tensor, row_experts: torch.Tensor, backend: str) -> torch.Tensor:
        """QDQ of the SiLU-and-mul output ``[n, I]``; ``row_experts [n]`` is each row's expert."""
        return a2

    def packed_weights(self) -> tuple[PackedWeights, PackedWeights]:
        """``(w13, w2)`` as ``PackedWeights`` for the fused kernel (``supports_fused`` subclasses)."""
        raise NotImplementedError(f"{type(self).__name__} holds no packed weights")

    def a2_qdq(self) -> ActivationQDQ:
        """The a2 QDQ the fused kernel applies in GEMM1's epilogue."""
        return ActivationQDQ()

    def a1_qdq(self) -> ActivationQDQ:
        """The a1 QDQ the FP4 kernel applies as it loads the activation tile."""
        return ActivationQDQ()

    def fp4_weights(self) -> tuple[FP4Weights, FP4Weights] | tuple[FP6Weights, FP6Weights] | None:
        """``(w13, w2)`` in the FP4 kernel's layout, or None where that kernel does not apply."""
        return None

    def fp4_operands(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The FP4 kernel's ``(hidden_states, w13_bias)``: as they are, unless the kernel's weight copy is
        padded (``mxlib.moe.emulation``)."""
        return hidden_states, self.w13_bias

    def prefers_fused(self) -> bool:
        """Whether ``auto`` picks the ``fused`` backend on CUDA."""
        return False

    def output_scales(self, e: int):
        """Multipliers of expert ``e``'s fp32 GEMM outputs, ``([GEMM1 ...], [GEMM2 ...])`` applied in
        order before the rounding (hardware numerics: per-tensor scales), or None."""
        return None

    def check_backend(self, backend: str, fp4: bool) -> None:
        """Raise if this experts' numerics cannot run on ``backend`` (``fp4``: the FP4 kernel applies)."""

    def resolved_backend(self, device: torch.device) -> str:
        """The backend a forward on ``device`` runs (``auto`` resolved, module docstring)."""
        backend = resolve_backend(self.backend, device)
        if self.backend == "auto" and device.type == "cuda" and self.supports_fused and self.prefers_fused():
            return "fused"
        return backend

    def forward(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """The MoE layer's expert computation for ``M`` tokens routed to ``k`` experts each.

        Args:
            hidden_states: ``[M, H]`` in the experts' activation dtype (bf16 by default; fp16 or
                fp32 where the experts were built so); the emulation subclasses QDQ it themselves.
            topk_weights: ``[M, k]`` router weights (fp32, as ``fused_topk`` returns them; applied
                in fp32 inside the second GEMM).
            topk_ids: ``[M, k]`` int32 / int64 expert ids, each in ``[0, E)``.

        Returns:
            ``[M, H]`` in the activation dtype: ``sum_j topk_weights[t, j] * (w2[e] @ act(w13[e] @ a1[t] + b13[e])
            + b2[e])`` with ``e = topk_ids[t, j]``, GEMM outputs rounded to the activation dtype (module docstring).

        Raises:
            ValueError: shapes that do not match ``[M, H]`` / ``[M, k]``; an expert id out of range
                (checked in eager mode only: a host read); a numerics the backend cannot run.
            TypeError: ``hidden_states`` of another dtype; floating ``topk_ids``.

        The ``torch`` backend traces under ``torch.compile(fullgraph=True)``: the activation QDQ is
        traced, the loop over the experts that received tokens (data-dependent) runs as one opaque
        op (``mxlib::torch_experts_apply``), and the outputs are the eager bits.
        """
        if hidden_states.ndim != 2 or hidden_states.shape[1] != self.hidden_size:
            raise ValueError(f"hidden_states: expected [M, {self.hidden_size}], got {list(hidden_states.shape)}")
        if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != hidden_states.shape[0]:
            raise ValueError(
                f"topk_ids {list(topk_ids.shape)} and topk_weights {list(topk_weights.shape)} must both be "
                f"[M, k] with M = {hidden_states.shape[0]}"
            )
        if hidden_states.dtype != self.activation_dtype:
            raise TypeError(f"hidden_states: expected dtype {self.activation_dtype}, got {hidden_states.dtype}")
        check_topk_ids(topk_ids, self.num_experts)
        backend = self.resolved_backend(hidden_states.device)
        fp4 = self.fp4_weights() if (backend == "fused" and self.supports_fused) else None
        self.check_backend(backend, fp4 is not None)
        if fp4 is not None:  # a1 QDQ fused in the A-tile load, a2 QDQ in GEMM1's epilogue
            m, k = topk_ids.shape
            tiles = self.fp4_config or get_fp4_configs(m, self.num_experts, k, fp4[0].nvfp4, fp4[0].nbits)
            plan = plan_routing(topk_ids, self.num_experts, (tiles[0].block_m, tiles[1].block_m))
            a1, w13_bias = self.fp4_operands(hidden_states)
            return fused_fp4_moe_impl(  # the inputs were checked above, the operands made from the checked config
                a1,
                fp4[0],
                fp4[1],
                topk_weights,
                topk_ids,
                a1_qdq=self.a1_qdq(),
                a2_qdq=self.a2_qdq(),
                numerics=self.numerics,
                configs=tiles,
                plan=plan,
                rotation=self.rotation,
                activation=self.activation,
                w13_bias=w13_bias,
                w2_bias=self.w2_bias,
            )
        if self.rotation is not None:
            hidden_states = self.rotation.rotate_h(hidden_states, triton=backend != "torch")
        return self.apply(self.quantize_input(hidden_states, topk_ids, backend), topk_weights, topk_ids, backend)

    def apply(self, qa1: QuantizedA1, topk_weights, topk_ids, backend: str) -> torch.Tensor:
        """GEMM1, the gated activation, the a2 QDQ and GEMM2 on the QDQ'd layer input (``quantize_input``), on
        ``backend`` (``forward`` has checked the inputs); the path's routing plan is made here, once."""
        a1, a1_per_pair = qa1.a1, qa1.per_pair
        qi = self.intermediate_qdq(backend)
        m, k = topk_ids.shape
        # the dequantize-GEMM kernel QDQs a2 tile by tile: a per-token QDQ (whole rows) and a rotation run the triton
        # path instead
        if backend == "fused" and self.supports_fused and self.rotation is None and not is_per_token(self.a2_qdq()):
            w13p, w2p = self.packed_weights()
            tiles = self.fused_config or get_fused_config(m, self.num_experts, k, w13p.nbits)
            plan = plan_routing(topk_ids, self.num_experts, (tiles.block_m,), naive_ok=False)
            return invoke_fused_dequant_moe(
                a1, w13p, w2p, topk_weights, topk_ids, self.a2_qdq(), a1_per_pair, tiles, plan, **self.moe_arithmetic()
            )
        if backend == "torch" and torch.compiler.is_compiling():
            return _torch_experts_apply(a1, topk_weights, topk_ids, a1_per_pair, qa1.row_scale, self._handle)
        if backend == "torch":
            w13_of, w2_of = self.expert_weight_getters()
            return torch_moe(
                a1,
                w13_of,
                w2_of,
                topk_weights,
                topk_ids,
                qi,
                a1_per_pair,
                output_scales=self.output_scales,
                a1_row_scale=qa1.row_scale,
                **self.moe_arithmetic(),
            )
        w13, w2 = self.dequantized_weights()
        num_experts, two_i, h = w13.shape
        config = self.gemm_config or get_moe_config(m, num_experts, k, two_i, h)
        config2 = self.gemm_config or get_moe_config(m, num_experts, k, h, two_i // 2)
        plan = plan_routing(topk_ids, num_experts, (config.block_m, config2.block_m))
        cache1 = torch.empty(m * k, two_i, dtype=a1.dtype, device=a1.device)
        invoke_fused_moe_kernel(
            a1,
            w13,
            cache1,
            topk_weights,
            *plan.blocks(config.block_m),
            False,
            1 if a1_per_pair else k,
            config,
            plan.naive,
            bias=self.w13_bias,
        )
        cache2 = qi(activation_and_mul(cache1, self.activation), topk_ids.reshape(-1))
        cache3 = torch.empty(m * k, h, dtype=a1.dtype, device=a1.device)
        invoke_fused_moe_kernel(
            cache2,
            w2,
            cache3,
            topk_weights,
            *plan.blocks(config2.block_m),
            True,
            1,
            config2,
            plan.naive,
            bias=self.w2_bias,
        )
        return cache3.view(m, k, h).float().sum(dim=1).to(a1.dtype)


def keep_dtype_on_cast(module: torch.nn.Module, fn, recurse: bool, cast: tuple[str, ...], parent) -> torch.nn.Module:
    """``Module._apply`` for a module holding quantized tensors and an ``activation_dtype``.

    ``fn`` (what ``.to``, ``.half()``, ``.float()``, ``.cuda()`` pass to ``_apply``) is first applied to an empty
    probe of the activation dtype on the module's device: the probe's dtype is the new activation dtype. Then
    ``parent()._apply(fn, recurse)`` runs, and every buffer not named in ``cast`` whose dtype ``fn`` changed is put
    back: the original tensor, moved to the new device only. Codes and scales (uint8, float8_e4m3fn, fp32
    global and input scales) therefore keep their bytes through any cast, and ``save_pretrained`` after a cast
    writes them as loaded.

    Raises:
        TypeError: the new activation dtype is not bfloat16, float16 or float32 (checked before anything changes).
    """
    buffers = [b for b in module._buffers.values() if b is not None]
    device = buffers[0].device if buffers else torch.device("cpu")
    probe = fn(torch.empty(0, dtype=module.activation_dtype, device=device))
    if probe.dtype != module.activation_dtype and probe.dtype not in ACTIVATION_DTYPES:
        raise TypeError(
            f"{type(module).__name__}: cannot run with {probe.dtype} activations (expected one of "
            f"{[str(d) for d in ACTIVATION_DTYPES]}); the module is left as it was"
        )
    kept = {n: b for n, b in module._buffers.items() if b is not None and n not in cast}
    out = parent()._apply(fn, recurse)
    for name, old in kept.items():
        new = module._buffers[name]
        if new is not None and new.dtype != old.dtype:
            module._buffers[name] = old.to(device=new.device)
    module.activation_dtype = probe.dtype
    return out


# Experts by handle, for the ``torch`` backend's opaque op under torch.compile (a custom op takes
# tensors and numbers only; the handle names the module whose eager loop it runs).
_EXPERTS: weakref.WeakValueDictionary[int, TritonExperts] = weakref.WeakValueDictionary()
_HANDLES = itertools.count()


def _register_experts(experts: TritonExperts) -> int:
    handle = next(_HANDLES)
    _EXPERTS[handle] = experts
    return handle


@torch.library.custom_op("mxlib::torch_experts_apply", mutates_args=())
def _torch_experts_apply(
    a1: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    a1_per_pair: bool,
    a1_row_scale: torch.Tensor | None,
    handle: int,
) -> torch.Tensor:
    """The ``torch`` backend's expert loop (``torch_moe``, data-dependent: which experts got tokens) of
    experts ``handle``, run eagerly inside a compiled graph."""
    return _EXPERTS[handle].apply(QuantizedA1(a1, a1_per_pair, a1_row_scale), topk_weights, topk_ids, "torch")


@_torch_experts_apply.register_fake
def _(a1, topk_weights, topk_ids, a1_per_pair, a1_row_scale, handle):
    return a1.new_empty((topk_ids.shape[0], a1.shape[-1]))


class TransformersExperts(torch.nn.Module):
    """Adapter: an mxlib experts object in the place of transformers' ``Qwen3MoeExperts``.

    transformers calls ``experts(hidden_states [M, H], top_k_index [M, k], top_k_weights [M, k])``;
    the router weights arrive in the model dtype and are widened to fp32 (exactly).
    """

    def __init__(self, experts: TritonExperts):
        super().__init__()
        self.experts = experts

    def forward(self, hidden_states, top_k_index, top_k_weights):
        """``experts(hidden_states [M, H], top_k_weights fp32 [M, k], top_k_index int32 [M, k]) -> [M, H]``."""
        return self.experts(hidden_states, top_k_weights.float(), top_k_index.to(torch.int32))
