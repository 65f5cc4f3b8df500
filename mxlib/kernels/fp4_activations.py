"""The activation QDQ of the fused FP4 kernel (``fused_fp4_moe``): in the A-tile load, and as one
standalone pass over ``[M, H]`` before GEMM1.

``_act_qdq`` QDQs an fp32 tile by the kind the launch names (none, MX, NVFP4 in vLLM's or the
hardware form, FP8 per tensor); ``_a_tile`` loads, QDQs and transposes one activation K tile;
``_standalone_a1_qdq`` gives the same bits as the fused load in one pass (the Triton twins of
``mxlib.kernels.quant``, and ``_nvfp4_hw_qdq_kernel`` for NVFP4 in hardware numerics).
"""

from __future__ import annotations

import torch

from ..formats import Numerics
from . import _numerics as nm
from . import fp4_layout as F4
from . import quant as Q
from ._triton import tl, triton
from .fused_dequant_moe import A2_FP8, A2_MX, A2_NVFP4, ActivationQDQ


def is_per_token(q: ActivationQDQ | None) -> bool:
    """Whether ``q`` is the per-token NVFP4 QDQ: NVFP4 without a static scale (each row's amax sets
    its global scale, ``mxlib.reference.nvfp4_per_token_scales``)."""
    return q is not None and q.kind == A2_NVFP4 and q.scale is None


@triton.jit
def _act_qdq(
    x,
    scale,
    KIND: tl.constexpr,
    MODE: tl.constexpr,
    EBITS: tl.constexpr,
    MBITS: tl.constexpr,
    EMAX: tl.constexpr,
    MAX: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FOUR_OVER_SIX: tl.constexpr = False,
):
    """QDQ of an fp32 tile [BLOCK_R, BLOCK_K] (blocks along the last axis): KIND 0 none, 1 MX,
    2 NVFP4 (``scale`` the encode scale gs, or the rows' gs [BLOCK_R, 1]; MODE 1 leaves out the
    ``1 / gs``; FOUR_OVER_SIX: 4/6's block rule, vLLM form only), 3 FP8 per tensor."""
    if KIND == 1:
        return nm.mx_qdq_values(x, EBITS, MBITS, EMAX, MAX, SCALE_MODE, BS, BLOCK_R, BLOCK_K)
    elif KIND == 2:
        if MODE == 1:
            return nm.nvfp4_qdq_hw_values(x, scale, BS, BLOCK_R, BLOCK_K)
        return nm.nvfp4_qdq_values(x, scale, False, BS, BLOCK_R, BLOCK_K, FOUR_OVER_SIX)
    elif KIND == 3:
        return nm.fp8_qdq_values(x, scale)
    else:
        return x


@triton.jit
def _a_tile(
    a_rows,
    token_mask,
    col0,
    a_scale,
    A_KIND: tl.constexpr,
    MODE: tl.constexpr,
    A_EBITS: tl.constexpr,
    A_MBITS: tl.constexpr,
    A_EMAX: tl.constexpr,
    A_MAX: tl.constexpr,
    A_SCALE_MODE: tl.constexpr,
    A_BS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    A_FOUR_OVER_SIX: tl.constexpr = False,
):
    """Activation K tile, columns ``col0 .. col0+127``, QDQ'd, transposed: [128, BLOCK_M]."""
    cols = col0 + tl.arange(0, 128)
    a = tl.load(a_rows[:, None] + cols[None, :], mask=token_mask[:, None], other=0.0)
    if A_KIND != 0:
        a = nm.cast_out(
            _act_qdq(
                nm.to_fp32(a),
                a_scale,
                A_KIND,
                MODE,
                A_EBITS,
                A_MBITS,
                A_EMAX,
                A_MAX,
                A_SCALE_MODE,
                A_BS,
                BLOCK_M,
                128,
                A_FOUR_OVER_SIX,
            ),
            DOT_DTYPE,
        )
    if nm.INTERPRETING:
        a = nm.to_fp32(a)
    return tl.trans(a)


@triton.jit
def _nvfp4_hw_qdq_kernel(x_ptr, out_ptr, gs_ptr, H, BLOCK_K: tl.constexpr):
    """NVFP4 QDQ of ``BLOCK_K`` columns of one row in hardware form: ``e2m1 * s`` (exact in bf16), the
    ``1 / gs`` left to GEMM1's accumulator; the bits of the A-tile load's QDQ (``nm.nvfp4_qdq_hw_values``)."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    x = nm.to_fp32(tl.load(x_ptr + r * H + cols))
    q = nm.nvfp4_qdq_hw_values(tl.reshape(x, (1, BLOCK_K)), tl.load(gs_ptr), 16, 1, BLOCK_K)
    tl.store(out_ptr + r * H + cols, nm.cast_out(tl.reshape(q, (BLOCK_K,)), tl.bfloat16))


def _standalone_a1_qdq(x: torch.Tensor, q: ActivationQDQ, numerics: Numerics) -> torch.Tensor:
    """a1 QDQ by the standalone kernels (one pass over ``[M, H]``), the same bits as the fused load
    (NVFP4 in hardware numerics: ``e2m1 * s``, the ``1 / gs`` still to apply)."""
    if q.kind == A2_NVFP4 and numerics is Numerics.HARDWARE:
        m, h = x.shape
        out = torch.empty_like(x)
        block = 512 if h % 512 == 0 else F4.K_TILE  # H is a multiple of the K tile
        if m:
            _nvfp4_hw_qdq_kernel[(m, h // block)](x, out, q.scale.reshape(-1)[:1].float(), h, BLOCK_K=block)
        return out
    if q.kind == A2_MX:
        return Q.quant_dequant_mx(x, q.fmt.element.name, q.fmt.block_size, q.scale_mode)
    if q.kind == A2_NVFP4:
        return Q.ref_nvfp4_quant_dequant(x, q.scale.reshape(-1)[:1].float(), check_scale=False, block_rule=q.block_rule)
    if q.kind == A2_FP8:
        return Q.quant_dequant_fp8_per_tensor(x, q.scale, check_scale=False)
    return x
