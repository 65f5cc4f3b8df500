"""GPTQ for microscaled FP4 / FP6 weights (NVFP4, MXFP4, MXFP6): codes chosen column by column with error feedback.

Algorithm (Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers", ICLR 2023, Algorithm 1), for one weight ``W [N, K]`` (rows independent, columns ``K``
the reduction axis) and the Hessian ``H = sum x xᵀ [K, K]`` of its calibration inputs:

1. ``H`` is divided by ``m``, the mean of its live diagonal (channels with ``H[j, j] > 0``); dead inputs
   (``H[j, j] == 0``: no calibration token has a nonzero value in channel ``j``) then get ``H[j, j] = 1``
   (the mean live diagonal); then damping ``H += damp * mean(diag H) * I`` (``damp`` 0.01, the paper's 1%).
   Every constant is relative to the Hessian's own scale, so the codes depend on ``H`` only through
   ``H / m`` (the scale of ``H`` is arbitrary: a sum or a mean over tokens, any units).
2. ``U = cholesky(H⁻¹)ᵀ``, the upper Cholesky factor of the inverse (``cholesky``,
   ``cholesky_inverse``, ``cholesky(upper=True)``, as the paper's section 3 "Cholesky reformulation").
3. Columns in order, in lazy batches of ``lazy_block`` (``B = 128``): column ``j`` is quantized,
   ``e = (w_j - q_j) / U[j, j]``, the batch's remaining columns get ``w_l -= e * U[j, l]``; after a
   batch, all later columns get ``W[:, later] -= E · U[batch, later]`` at once.

The sweep runs in float64; each column is rounded to fp32 and quantized with round-to-nearest's own
fp32 arithmetic (``mxlib.reference.quantize_nvfp4`` / ``quantize_mx``), and its fp32 dequantized value
(``e2m1 * (fp32(block_scale) * weight_scale_2)``, ``element * 2**s``) is the ``q_j`` fed back.
Columns go in their natural order (no activation ordering).

**Scales fixed before the sweep.** Every block scale (NVFP4: the ue4m3 block scale and the per-expert
``weight_scale_2``; MX: the E8M0 exponent, ``even`` rule) is round-to-nearest's, computed from the bf16
weights before any column is quantized, and held fixed; GPTQ chooses the codes only. This is what
MR-GPTQ does (IST-DASLab/FP-Quant ``src/quantization/gptq.py`` @50c8d4ab, ``GPTQ.step``: the quantizer's
scales are taken from the whole weight before the column loop). The integer-GPTQ lineage (AutoGPTQ's
``static_groups=False``) instead refits a group's scale when the sweep reaches its first column, from
the error-updated weights. Fixed scales are chosen because (1) error feedback grows a block's amax,
and a refit E8M0 scale then doubles the step of the whole block (a power of two cannot move by less),
the error the feedback was meant to spread; (2) the checkpoint's scales are exactly round-to-nearest's
(ModelOpt's ``weight_scale_2``, Quark's E8M0 bytes), so only the codes differ and a scale-choosing
technique can be composed underneath; (3) with ``H = I`` the sweep feeds back nothing and the codes
are round-to-nearest's bit for bit (tested).

An expert whose Cholesky factorization fails even after damping, or (technique) that received no
calibration token, keeps its round-to-nearest codes, with a warning naming the layer and the experts.

**What holds under a rescaled Hessian.** ``H`` and ``c * H`` (``c > 0``) give the same codes bit for bit
when ``c`` is a power of two (without overflow or underflow every float64 operation of the normalisation
scales exactly, so ``H / m`` is the same matrix). For any other ``c`` the normalised matrices differ by the
rounding of ``c * H`` (and of its division by ``m``): at most a few units in the last place of the dtype
``c * H`` was formed in; codes can then differ only where a feedback-corrected weight lies that close to a
rounding threshold of the element grid (none in the tests' cases at ``c`` = 1e-6 and 1e6, with and
without dead channels).

Shapes: ``E`` experts, ``N`` output rows, ``K`` input columns; w13 ``[E, 2I, H]`` uses the w13
Hessian ``[E, H, H]``, w2 ``[E, H, I]`` the w2 Hessian ``[E, I, I]``.
"""

from __future__ import annotations

import math
import warnings
from typing import Protocol

import torch

from .. import reference as _ref
from .._checks import all_finite
from ..formats import BlockScheme
from ..moe.emulation import ExpertWeights
from ..moe.factory import WEIGHT_SCALE_MODE
from ..moe.schemes import MoEQuantScheme, checkpoint_weight_format

__all__ = ["DAMP", "LAZY_BLOCK", "HessianSource", "gptq_quantize", "GPTQ"]

DAMP = 0.01  # damping: this fraction of the mean Hessian diagonal is added to the diagonal (GPTQ's 1%)
LAZY_BLOCK = 128  # columns per lazy batch (GPTQ's B)
_CHUNK_BYTES = 1 << 30  # float64 working set of one batch of experts in the sweep


class HessianSource(Protocol):
    """What the technique reads per layer (``mxlib.models.hessians.ExpertHessians`` is one)."""

    def w13(self, layer: int) -> torch.Tensor: ...  # [E, H, H]

    def w2(self, layer: int) -> torch.Tensor: ...  # [E, I, I]

    def tokens(self, layer: int) -> torch.Tensor: ...  # [E] int64


def _fixed_scales(w: torch.Tensor, fmt: BlockScheme):
    """Round-to-nearest of ``w [E, N, K]``: ``(packed, block_scale, global_scale | None, step [E, N, K/bs] fp32)``."""
    if fmt.has_global_scale:
        packed, bs, gs = _ref.quantize_nvfp4(w, block_size=fmt.block_size)
        step = bs.float() * gs[:, None, None]  # dequantize_to_dtype's fp32(block_scale) * weight_scale_2
        return packed, bs, gs, step
    packed, bs = _ref.quantize_mx(w, fmt.element, fmt.block_size, WEIGHT_SCALE_MODE)
    return packed, bs, None, _ref.decode_e8m0(bs)


def _quantize_column(x: torch.Tensor, step: torch.Tensor, fmt: BlockScheme, table: torch.Tensor):
    """Codes (uint8) and fp32 dequantized values of fp32 ``x`` under the fixed fp32 ``step``, with
    round-to-nearest's arithmetic (``reference.quantize_nvfp4`` / ``quantize_mx``)."""
    el = fmt.element
    if fmt.has_global_scale:
        scaled = torch.where(step == 0, 0.0, x / torch.where(step == 0, 1.0, step))
        codes = _ref.encode_element(scaled.abs(), el) | (scaled < 0).to(torch.uint8) << (el.nbits - 1)
    else:
        codes = _ref.encode_element(x / step, el)
    return codes, table[codes.to(torch.int32)] * step


def _inverse_factor(hessian: torch.Tensor, damp: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(U [E, K, K] float64, failed [E] bool)``: the upper Cholesky factor of the damped inverse
    Hessian (module docstring, steps 1-2); a failed expert gets ``U = I`` (no feedback: its codes are
    round-to-nearest's)."""
    h = hessian.double().clone()
    diag = torch.diagonal(h, dim1=-2, dim2=-1)
    live, dead = diag > 0, diag == 0
    n_live = live.sum(dim=-1)
    m = torch.where(live, diag, 0.0).sum(dim=-1) / n_live.clamp(min=1)
    m = torch.where(n_live > 0, m, 1.0)  # an all-dead Hessian: nothing to normalise by
    h /= m[:, None, None]  # the Hessian's own scale: every constant below is relative to it
    diag = torch.diagonal(h, dim1=-2, dim2=-1)
    diag[dead] = 1.0  # dead input channels: the mean live diagonal
    diag += damp * diag.mean(dim=-1, keepdim=True)
    low, info = torch.linalg.cholesky_ex(h)
    u, info2 = torch.linalg.cholesky_ex(torch.cholesky_inverse(low), upper=True)
    failed = (info != 0) | (info2 != 0) | ~torch.isfinite(u).all(dim=-1).all(dim=-1)
    eye = torch.eye(h.shape[-1], dtype=h.dtype, device=h.device).expand_as(h)
    return torch.where(failed[:, None, None], eye, u), failed


def _sweep(w: torch.Tensor, u: torch.Tensor, step: torch.Tensor, fmt: BlockScheme, lazy_block: int) -> torch.Tensor:
    """Codes ``[E, N, K]`` uint8 of ``w`` by GPTQ's lazy-batch sweep (module docstring, step 3)."""
    e, n, k = w.shape
    bs = fmt.block_size
    table = _ref.element_value_table(fmt.element, w.device)
    work = w.double().clone()
    codes = torch.empty(e, n, k, dtype=torch.uint8, device=w.device)
    for c1 in range(0, k, lazy_block):
        c2 = min(c1 + lazy_block, k)
        blk = work[:, :, c1:c2].clone()
        errs = torch.zeros_like(blk)
        for j in range(c2 - c1):
            col = c1 + j
            x = blk[:, :, j]
            c, q = _quantize_column(x.float(), step[:, :, col // bs], fmt, table)
            codes[:, :, col] = c
            err = (x - q.double()) / u[:, col, col, None]
            blk[:, :, j:] -= err[:, :, None] * u[:, None, col, col:c2]
            errs[:, :, j] = err
        if c2 < k:
            work[:, :, c2:] -= errs @ u[:, c1:c2, c2:]
    return codes


def _check_options(damp: float, lazy_block: int) -> None:
    if not (isinstance(damp, (int, float)) and not isinstance(damp, bool) and math.isfinite(damp) and damp >= 0):
        raise ValueError(f"damp: expected a finite number >= 0, got {damp!r}")
    if not isinstance(lazy_block, int) or isinstance(lazy_block, bool) or lazy_block < 1:
        raise ValueError(f"lazy_block: expected a positive integer, got {lazy_block!r}")


def _check_args(w: torch.Tensor, hessian: torch.Tensor, name: str) -> None:
    if not isinstance(w, torch.Tensor) or w.ndim != 3 or not w.is_floating_point():
        got = list(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
        raise ValueError(f"{name}: expected a float tensor [E, N, K], got {got}")
    e, _, k = w.shape
    if not isinstance(hessian, torch.Tensor) or tuple(hessian.shape) != (e, k, k) or not hessian.is_floating_point():
        got = list(hessian.shape) if isinstance(hessian, torch.Tensor) else type(hessian).__name__
        raise ValueError(f"{name} Hessian: expected a float tensor [{e}, {k}, {k}], got {got}")
    if not all_finite(w):
        raise ValueError(f"{name}: holds non-finite values")
    if not all_finite(hessian):
        raise ValueError(f"{name} Hessian: holds non-finite values")


def _gptq(w, hessian, fmt, damp, lazy_block, experts=None):
    """RTN's tensors of ``w``, with GPTQ codes for ``experts`` (default all): ``(packed, bs, gs, failed)``."""
    packed, bs, gs, step = _fixed_scales(w, fmt)
    e, n, k = w.shape
    chosen = list(range(e)) if experts is None else list(experts)
    failed: list[int] = []
    per_expert = 8 * (3 * n * k + 3 * k * k)  # float64 weights, block copies, U and its temporaries
    chunk = max(1, _CHUNK_BYTES // per_expert)
    for i in range(0, len(chosen), chunk):
        sel = torch.tensor(chosen[i : i + chunk], device=w.device)
        u, bad = _inverse_factor(hessian[sel.to(hessian.device)].to(w.device), damp)
        codes = _sweep(w[sel], u, step[sel], fmt, lazy_block)
        packed[sel] = _ref.pack_codes(codes, fmt.element)
        failed += sel[bad].tolist()
    return packed, bs, gs, failed


def gptq_quantize(
    w: torch.Tensor,
    hessian: torch.Tensor,
    scheme: MoEQuantScheme | BlockScheme | str,
    *,
    damp: float = DAMP,
    lazy_block: int = LAZY_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """GPTQ codes of one stack of expert weights, under round-to-nearest's block scales (module docstring).

    Args:
        w: ``[E, N, K]`` bf16 / fp16 / fp32 weights (w13 ``[E, 2I, H]`` or w2 ``[E, H, I]``), finite.
        hessian: ``[E, K, K]`` float: ``sum x xᵀ`` of each expert's inputs, at any positive scale (the
            damping is relative to it; what holds bit for bit: module docstring, "rescaled Hessian").
        scheme: the weight format (``nvfp4``, ``mxfp4``, ``mxfp6_e2m3``, ``mxfp6_e3m2``), a ``BlockScheme``
            or a ``MoEQuantScheme`` (its weight format).
        damp: fraction of the mean (normalised) Hessian diagonal added to the diagonal (0.01).
        lazy_block: columns per lazy batch (128); the codes do not depend on it beyond float64 rounding.

    Returns:
        ``quantize_nvfp4``'s ``(packed uint8 [E, N, K/2], block_scale float8_e4m3fn [E, N, K/16],
        weight_scale_2 fp32 [E])`` for NVFP4, ``quantize_mx``'s ``(packed, scale uint8 E8M0, None)`` for
        OCP MX: the scales are round-to-nearest's, the codes GPTQ's. An expert whose factorization
        fails keeps round-to-nearest's codes (a warning names it).

    Raises:
        ValueError: wrong shapes, non-finite values, a negative ``damp``, a non-positive ``lazy_block``.
    """
    fmt = checkpoint_weight_format(scheme, "gptq")
    _check_options(damp, lazy_block)
    _check_args(w, hessian, "w")
    packed, bs, gs, failed = _gptq(w, hessian, fmt, damp, lazy_block)
    if failed:
        warnings.warn(
            f"gptq: experts {failed}: the damped Hessian is not positive definite; codes are RTN's", stacklevel=2
        )
    return packed, bs, gs


class GPTQ:
    """The ``"gptq"`` technique: each expert's w13 and w2 codes by GPTQ under its own Hessians (module docstring).

    Args:
        hessians: per-layer, per-expert Hessians and token counts (``HessianSource``:
            ``mxlib.models.hessians.collect_expert_hessians`` returns one).
        damp: fraction of the mean Hessian diagonal added to the diagonal (0.01).
        lazy_block: columns per lazy batch (128).

    ``quantize_experts`` returns ``ExpertWeights`` with round-to-nearest's scales (NVFP4: one
    ``weight_scale_2`` per expert for gate and up, ModelOpt's) and GPTQ's codes; an expert that
    received no calibration token keeps its round-to-nearest codes, and a warning names the layer and
    the experts. ``config()`` is empty: the forward is unchanged.

    Raises:
        ValueError: ``hessians`` without ``w13`` / ``w2`` / ``tokens``; a bad ``damp`` or ``lazy_block``;
            (``quantize_experts``) Hessians of the wrong shape or a layer that was not collected.
    """

    name = "gptq"

    def __init__(self, hessians: HessianSource, damp: float = DAMP, lazy_block: int = LAZY_BLOCK):
        missing = [m for m in ("w13", "w2", "tokens") if not callable(getattr(hessians, m, None))]
        if missing:
            raise ValueError(
                f"hessians: expected an object with w13(layer), w2(layer), tokens(layer) "
                f"(mxlib.models.hessians.collect_expert_hessians), got {type(hessians).__name__} without {missing}"
            )
        _check_options(damp, lazy_block)
        self.hessians, self.damp, self.lazy_block = hessians, damp, lazy_block

    def quantize_experts(
        self, w13: torch.Tensor, w2: torch.Tensor, scheme: MoEQuantScheme, *, layer: int
    ) -> ExpertWeights:
        fmt = checkpoint_weight_format(scheme, "gptq")
        h13, h2 = self.hessians.w13(layer), self.hessians.w2(layer)
        _check_args(w13, h13, "w13")
        _check_args(w2, h2, "w2")
        tokens = self.hessians.tokens(layer).reshape(-1).cpu()
        if tokens.numel() != w13.shape[0]:
            raise ValueError(f"hessians.tokens({layer}): expected {w13.shape[0]} counts, got {tokens.numel()}")
        active = (tokens > 0).nonzero().squeeze(1).tolist()
        idle = (tokens == 0).nonzero().squeeze(1).tolist()
        if idle:
            warnings.warn(
                f"gptq: layer {layer}: experts {idle} received no calibration tokens; they are quantized "
                f"round-to-nearest",
                stacklevel=2,
            )
        p13, s13, g13, bad13 = _gptq(w13, h13, fmt, self.damp, self.lazy_block, active)
        p2, s2, g2, bad2 = _gptq(w2, h2, fmt, self.damp, self.lazy_block, active)
        failed = sorted(set(bad13) | set(bad2))
        if failed:
            warnings.warn(
                f"gptq: layer {layer}: experts {failed}: the damped Hessian is not positive definite; their "
                f"codes are round-to-nearest's",
                stacklevel=2,
            )
        return ExpertWeights(fmt, p13, s13, p2, s2, g13, g2)

    def config(self) -> dict:
        return {}
