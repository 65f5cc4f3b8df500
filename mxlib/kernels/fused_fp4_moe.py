"""Fused FP4-weight MoE for Hopper: packed e2m1 weights decoded in registers, a1 QDQ in the A load.

Formats: MXFP4 (e2m1 + E8M0 per 32) and NVFP4 (e2m1 + ue4m3 per 16, per-expert fp32 decode
``global_scale``) in ``fp4_layout``'s prepared layout; MXFP6 (e2m3 / e3m2 + E8M0 per 32) in
``fp6_layout``'s layout, which keeps that layout's properties, through the K loop's ``W_BITS=6``
branch (256-element steps). What differs from ``fused_dequant_moe`` (the generic MX/NVFP4/FP6 kernel):

* **Weights prepared once and decoded in registers** (``fp4_layout``: ``prepare_fp4_weights``, the
  PTX decode): a thread's 16-byte load is exactly its part of Hopper's warpgroup-MMA register
  operand, so the decoded tile reaches ``tl.dot`` without a shared-memory round trip.
  ``prepare_packed_weights`` prepares a ``PackedWeights`` for this kernel (FP4 or FP6 layout).
* **a1 QDQ** as one standalone pass (vLLM and hardware forms: ``TileConfig.a1_fused=False``, the
  default tiles) or in the A-tile load (per-expert NVFP4 scales, or ``a1_fused=True``: an A tile
  stored from registers makes Triton wait for every MMA); **a2 QDQ in GEMM1's epilogue**.
* **Block assignment** from the forward's ``RoutingPlan`` (``align.plan_routing``): tiny batches
  (``M * k * 4 <= E``, vLLM's rule) give each pair its own block of 16 rows and skip the alignment;
  otherwise the pairs are aligned to each GEMM's ``block_m``.
* **Tiles per batch size and per GEMM** (``FP4_CONFIGS``, ``NVFP4_CONFIGS``, ``FP6_CONFIGS``) from
  CUDA-graph replay sweeps on the H200 (``benchmarks/h200_fp4_sweep*.json``;
  ``python -m mxlib.bench fused`` times them beside the external-kernel harness).

Numerics (``numerics``, ``mxlib.formats.Numerics``):

* ``"vllm"``: the bf16 operands are vLLM's, bit for bit (``mxlib.reference``): MX weights
  ``e2m1 * 2**(s - 127)`` (exact in bf16 for in-range scales), NVFP4 weights
  ``bf16(e2m1 * (fp32(ue4m3) * global_scale))`` (fp32 product, one rounding); activations
  QDQ'd to ``bf16(e2m1 * (s / gs))`` as vLLM's ``ref_nvfp4_quant_dequant``.
* ``"hardware"``: what an FP4 tensor-core GEMM computes: operands ``element * block_scale``
  (exact in bf16 for e2m1 x ue4m3 and for in-range E8M0), fp32 accumulation, the per-tensor
  scales (NVFP4 weight ``global_scale`` and activation ``1 / gs``) applied to the fp32
  accumulator. MX schemes give the same operands in both.

Shapes: ``M`` tokens, ``k`` top_k, ``E`` experts, ``H`` hidden, ``I`` intermediate;
``w13 [E, 2I, H]`` (gate rows then up rows), ``w2 [E, H, I]``.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..formats import Numerics, get_numerics
from . import _numerics as nm
from . import fp4_layout as F4
from . import fp6_layout as F6
from . import hadamard as HD
from ._bridge import select
from ._triton import tl, triton
from .align import RoutingPlan, plan_routing
from .fp4_activations import _a_tile, _act_qdq, _standalone_a1_qdq, is_per_token
from .fp4_layout import FP4Weights
from .fp4_prepare import prepare_packed_weights
from .fp4_tiles import FP4_CONFIGS, FP6_CONFIGS, NVFP4_CONFIGS, get_fp4_configs
from .fp6_layout import fp6_tile as _fp6_tile
from .fused_dequant_moe import A2_NONE, A2_NVFP4, ActivationQDQ
from .fused_dequant_moe import qdq_consts as _qdq_consts
from .fused_dequant_moe import qdq_scale_arg as _scale_arg
from .moe_epilogue import activation_args, bias_args, gated_activation, load_bias
from .moe_epilogue import sum_k_kernel as _sum_k_kernel
from .quant import per_token_rows
from .tiles import TileConfig

__all__ = [
    "prepare_packed_weights",
    "fused_fp4_moe",
    "fused_fp4_moe_impl",
    "get_fp4_configs",
    "FP4_CONFIGS",
    "NVFP4_CONFIGS",
    "FP6_CONFIGS",
]

_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


# ----------------------------------------------------------------------------- kernel


@triton.jit
def fused_fp4_moe_kernel(
    # pointers
    a_ptr,
    w_ptr,
    ws_ptr,
    wg_ptr,
    c_ptr,
    topk_weights_ptr,
    sorted_token_ids_ptr,
    expert_ids_ptr,
    num_tokens_post_padded_ptr,
    a_scale_ptr,
    c_scale_ptr,
    rot_signs_ptr,
    rot_scale,
    bias_ptr,
    # dimensions
    N,
    K,
    EM,
    num_valid_tokens,
    # strides (elements; packed weights and scales in bytes)
    stride_am,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_cm,
    wg_stride_e,
    wg_stride_half,
    a_scale_stride_e,
    a_scale_stride_row,
    c_scale_stride_e,
    stride_bias_e,
    # weight format: KIND 0 MX, 1 NVFP4 vLLM, 2 NVFP4 hardware (``fp4_layout.W_*``); BS 32 or 16; ONE the
    # one-multiply decode (``fp4_one_multiply``); BITS 4 (``fp4_layout``) or 6 (MXFP6 in ``fp6_layout``'s
    # layout, element exponent bits EBITS); MODE the numerics (``Numerics.kernel_id``: 0 vLLM, 1 hardware)
    W_KIND: tl.constexpr,
    W_BS: tl.constexpr,
    MODE: tl.constexpr,
    W_ONE: tl.constexpr,
    W_BITS: tl.constexpr,
    W_EBITS: tl.constexpr,
    # A-load QDQ (a1 in GEMM1, none in GEMM2)
    A_KIND: tl.constexpr,
    A_EBITS: tl.constexpr,
    A_MBITS: tl.constexpr,
    A_EMAX: tl.constexpr,
    A_MAX: tl.constexpr,
    A_SCALE_MODE: tl.constexpr,
    A_BS: tl.constexpr,
    A_FOUR_OVER_SIX: tl.constexpr,
    # epilogue (a2 in GEMM1)
    GATED: tl.constexpr,
    C_KIND: tl.constexpr,
    C_EBITS: tl.constexpr,
    C_MBITS: tl.constexpr,
    C_EMAX: tl.constexpr,
    C_MAX: tl.constexpr,
    C_SCALE_MODE: tl.constexpr,
    C_BS: tl.constexpr,
    C_FOUR_OVER_SIX: tl.constexpr,
    W_GLOBAL_OUT: tl.constexpr,
    A_INV_OUT: tl.constexpr,
    A_PER_TOKEN: tl.constexpr,
    ROT_BS: tl.constexpr,  # a2 rotated along N by block Hadamard ROT_BS (0: none) before its QDQ (``hadamard``)
    ROT_SIGNS: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    top_k: tl.constexpr,
    NAIVE: tl.constexpr,
    # expert biases and the gated activation (``moe_epilogue``)
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    ACT_ALPHA: tl.constexpr,
    ACT_CLAMP: tl.constexpr,
    ACT_LIMIT: tl.constexpr,
    # tiles
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    NUM_WARPS: tl.constexpr,
):
    """C[pair, n] for one block of pairs and BLOCK_N output columns.

    A: [rows, K] (row ``pair // top_k``); W: prepared FP4 [E, rows_w, K / 2], scales
    [E, rows_w, K / W_BS] (W_BITS 6: prepared MXFP6 [E, rows_w, 3K / 4], ``fp6_layout``);
    GATED: rows_w = 2N (gate, up), C = a2 [M * k, N] (the gated activation ACT, then
    the C_KIND QDQ); else rows_w = N, C = A @ W[e]^T (x router weight). HAS_BIAS: bias [E, rows_w]
    on the fp32 accumulator after its scales (below). NAIVE: block ``pid_m`` is the single pair
    ``pid_m`` (no alignment; ``expert_ids_ptr`` is the flat topk_ids).
    Hardware numerics: A_INV_OUT multiplies the fp32 accumulator by ``1 / a_scale`` (NVFP4 activation
    encode scale), W_GLOBAL_OUT by the weight's global scale, before the epilogue.
    A_PER_TOKEN: per-token NVFP4 activation scales, ``a_scale_ptr`` rows of ``(gs, per_token_scale)``
    (stride ``a_scale_stride_row``) for A's rows: the A-load QDQ uses each row's gs, A_INV_OUT
    multiplies each output row by its ``per_token_scale``.
    """
    pid_m, pid_n = nm.grouped_pid(tl.program_id(axis=0), EM, N, BLOCK_M, BLOCK_N, GROUP_SIZE_M)
    if NAIVE:
        rows_m = tl.arange(0, BLOCK_M)
        offs_token = tl.where(rows_m == 0, pid_m, num_valid_tokens).to(tl.int64)
        expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    else:
        if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
            return
        offs_token = tl.load(sorted_token_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    token_mask = offs_token < num_valid_tokens
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    load_n = pid_n * BLOCK_N + F4.load_rows(BLOCK_N, NUM_WARPS)  # weight rows in load order
    n_mask = load_n < N
    w_rows = w_ptr + expert * stride_we + load_n.to(tl.int64) * stride_wn
    s_rows = ws_ptr + expert * stride_se + load_n.to(tl.int64) * stride_sn
    if W_KIND != 0:
        g = tl.load(wg_ptr + expert * wg_stride_e)
        g_up = tl.load(wg_ptr + expert * wg_stride_e + wg_stride_half)
        if W_KIND == 1 and W_ONE and not nm.INTERPRETING:  # vLLM's one-multiply decode: g * 2**126 (exact)
            # (a g outside [2**-117, 4), a stale ``one_multiply``, gives NaN or Inf weights, never plausible ones)
            g = tl.where(g >= 2.0**-117, g * 8.507059173023462e37, float("nan"))
            g_up = tl.where(g_up >= 2.0**-117, g_up * 8.507059173023462e37, float("nan"))
    else:
        g = 1.0
        g_up = 1.0
    a_row_scale_ptrs = a_scale_ptr + (offs_token // top_k) * a_scale_stride_row
    if A_PER_TOKEN:  # the rows' encode scales gs [BLOCK_M, 1]
        a_scale = tl.load(a_row_scale_ptrs, mask=token_mask, other=1.0)[:, None]
    elif A_KIND != 0 or A_INV_OUT:
        a_scale = tl.load(a_scale_ptr + expert * a_scale_stride_e)
    else:
        a_scale = 1.0
    a_rows = a_ptr + (offs_token // top_k) * stride_am
    DOT_DTYPE: tl.constexpr = OUT_DTYPE

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if W_BITS == 6:  # MXFP6: 256-element super tiles, two K tiles (two dots per matrix) a step
        for st in range(0, K // 256):
            a0 = _a_tile(
                a_rows,
                token_mask,
                st * 256,
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
                DOT_DTYPE,
                A_FOUR_OVER_SIX,
            )
            a1 = _a_tile(
                a_rows,
                token_mask,
                st * 256 + 128,
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
                DOT_DTYPE,
                A_FOUR_OVER_SIX,
            )
            n0, n1, p = F6.load_fp6_planes(w_rows, n_mask, st)
            acc = tl.dot(_fp6_tile(n0, p, s_rows, n_mask, st, 0, W_EBITS, BLOCK_N, NUM_WARPS), a0, acc)
            acc = tl.dot(_fp6_tile(n1, p, s_rows, n_mask, st, 1, W_EBITS, BLOCK_N, NUM_WARPS), a1, acc)
            if GATED:
                u0, u1, pu = F6.load_fp6_planes(w_rows + N * stride_wn, n_mask, st)
                su_rows = s_rows + N * stride_sn
                acc_up = tl.dot(_fp6_tile(u0, pu, su_rows, n_mask, st, 0, W_EBITS, BLOCK_N, NUM_WARPS), a0, acc_up)
                acc_up = tl.dot(_fp6_tile(u1, pu, su_rows, n_mask, st, 1, W_EBITS, BLOCK_N, NUM_WARPS), a1, acc_up)
    for kt in range(0, K // 128 if W_BITS == 4 else 0):  # FP4: 128-element K tiles (FP6 ran above)
        a = _a_tile(
            a_rows,
            token_mask,
            kt * 128,
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
            DOT_DTYPE,
            A_FOUR_OVER_SIX,
        )
        acc = tl.dot(
            F4.decode_fp4_words(w_rows, s_rows, n_mask, g, kt, W_KIND, W_BS, BLOCK_N, NUM_WARPS, W_ONE), a, acc
        )
        if GATED:
            acc_up = tl.dot(
                F4.decode_fp4_words(
                    w_rows + N * stride_wn,
                    s_rows + N * stride_sn,
                    n_mask,
                    g_up,
                    kt,
                    W_KIND,
                    W_BS,
                    BLOCK_N,
                    NUM_WARPS,
                    W_ONE,
                ),
                a,
                acc_up,
            )

    if A_INV_OUT and A_PER_TOKEN:  # each row (a column of the transposed accumulator) its per_token_scale
        ts = tl.load(a_row_scale_ptrs + 1, mask=token_mask, other=1.0)[None, :]
        acc = acc * ts
        acc_up = acc_up * ts
    elif A_INV_OUT:
        inv_a = tl.math.div_rn(a_scale * 0.0 + 1.0, a_scale)
        acc = acc * inv_a
        acc_up = acc_up * inv_a
    if W_GLOBAL_OUT:  # the operands were e2m1 * ue4m3 / 2**9 (exact): 2**9 back, then the global scale
        acc = acc * 512.0 * g
        acc_up = acc_up * 512.0 * g_up
    res = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    res_up = tl.trans(acc_up)
    if HAS_BIAS:
        res = res + load_bias(bias_ptr, expert, stride_bias_e, offs_n, offs_n < N)[None, :]
        if GATED:
            res_up = res_up + load_bias(bias_ptr, expert, stride_bias_e, N + offs_n, offs_n < N)[None, :]
    if GATED:
        gate = nm.to_fp32(nm.cast_out(res, OUT_DTYPE))
        up = nm.to_fp32(nm.cast_out(res_up, OUT_DTYPE))
        act = nm.to_fp32(nm.cast_out(gated_activation(gate, up, ACT, ACT_ALPHA, ACT_CLAMP, ACT_LIMIT), OUT_DTYPE))
        if ROT_BS != 0:  # rounded to OUT_DTYPE as ``block_hadamard``'s pass rounds it
            rot = HD.rotate_tile(act, rot_signs_ptr, offs_n, offs_n < N, rot_scale, ROT_BS, ROT_SIGNS, BLOCK_M, BLOCK_N)
            act = nm.to_fp32(nm.cast_out(rot, OUT_DTYPE))
        if C_KIND != 0:
            c_scale = tl.load(c_scale_ptr + expert * c_scale_stride_e)
        else:
            c_scale = 1.0
        act = _act_qdq(
            act,
            c_scale,
            C_KIND,
            MODE,
            C_EBITS,
            C_MBITS,
            C_EMAX,
            C_MAX,
            C_SCALE_MODE,
            C_BS,
            BLOCK_M,
            BLOCK_N,
            C_FOUR_OVER_SIX,
        )
        out = nm.cast_out(act, OUT_DTYPE)
    else:
        if MUL_ROUTED_WEIGHT:
            res = res * tl.load(topk_weights_ptr + offs_token, mask=token_mask, other=0)[:, None]
        out = nm.cast_out(res, OUT_DTYPE)
    c_ptrs = c_ptr + offs_token[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, out, mask=token_mask[:, None] & (offs_n < N)[None, :])  # offs_n: the logical columns


# ----------------------------------------------------------------------------- wrapper


def _launch(
    *,
    a: torch.Tensor,
    w: FP4Weights | F6.FP6Weights,
    c: torch.Tensor,
    topk_weights: torch.Tensor,
    plan: RoutingPlan,
    n: int,
    gated: bool,
    a_qdq: ActivationQDQ | None,
    a_inv: ActivationQDQ | None,
    c_qdq: ActivationQDQ | None,
    numerics: Numerics,
    mul_routed_weight: bool,
    top_k: int,
    tiles: TileConfig,
    a_rows: torch.Tensor | None = None,
    rotation: HD.BlockHadamard | None = None,
    bias: torch.Tensor | None = None,
    activation=None,
):
    """One GEMM: ``c = a @ w[e]^T`` over the plan's blocks of ``tiles.block_m`` pairs, ``n`` output
    columns (``gated``: the SiLU-and-mul of the gate and up halves, then the ``c_qdq`` QDQ; else times
    the router weight with ``mul_routed_weight``). ``top_k``: rows of ``a`` are pairs // top_k.

    a_qdq: QDQ in the A load (or None); a_inv: NVFP4 activation encode scales whose reciprocal
    multiplies the accumulator (hardware numerics), or None; a_rows: per-token scales ``[rows of a, 2]``
    (``quant.per_token_rows``), which then replace ``a_qdq``'s and ``a_inv``'s scales row by row;
    rotation: ``gated`` only, the epilogue rotates the activation's output by it (its ``signs_i``);
    bias: ``[E, rows of w]`` added to the scaled fp32 accumulator, or None; activation: ``gated`` only
    (``moe_epilogue.activation_args``)."""
    sorted_ids, expert_ids, num_post = plan.blocks(tiles.block_m)
    e = w.packed.shape[0]
    # pointer arguments the kernel does not read (no scale of that kind): any fp32 tensor, no new
    # allocation (a fill kernel per launch otherwise)
    unread = topk_weights
    if w.global_scale is not None:
        gsc = w.global_scale
        wg_stride_e, wg_stride_half = (2, 1) if gsc.ndim == 2 else (1, 0)
    else:
        gsc, wg_stride_e, wg_stride_half = unread, 0, 0
    scale_src = a_qdq if a_qdq is not None else a_inv
    a_scale, a_stride = _scale_arg(scale_src, e, unread)
    if a_rows is not None:
        a_scale, a_stride = a_rows, 0
    c_scale, c_stride = _scale_arg(c_qdq, e, unread)
    bias_t, stride_bias_e = bias_args(bias, unread, e, w.packed.shape[1], "w13_bias" if gated else "w2_bias")
    w_kind = F4.W_MX if not w.nvfp4 else (F4.W_NVFP4_VLLM if numerics is Numerics.VLLM else F4.W_NVFP4_HW)
    fp6 = isinstance(w, F6.FP6Weights)
    wp = w.packed.view(torch.int32)  # rows of K/8 words (K/2 bytes; FP6: 3K/16 words)
    ws = w.scales.view(torch.int32)  # K/BS bytes a row: a multiple of 4
    if plan.naive:  # one block per pair; the sorted ids and the padded count are not read (any int32 tensor)
        em = expert_ids.numel() * tiles.block_m
        sorted_ids = num_post = wp
    else:
        em = sorted_ids.shape[0]
    # the row order of the weight loads (``fp4_layout.load_rows``) needs 16 rows a warp
    num_warps = max(1, min(tiles.num_warps, tiles.block_n // 16))
    grid = (triton.cdiv(em, tiles.block_m) * triton.cdiv(n, tiles.block_n),)
    fused_fp4_moe_kernel[grid](
        a,
        wp,
        ws,
        gsc,
        c,
        topk_weights,
        sorted_ids,
        expert_ids,
        num_post,
        a_scale,
        c_scale,
        unread if rotation is None or rotation.signs_i is None else rotation.signs_i,
        1.0 if rotation is None else HD.hadamard_scale(rotation.block_size),
        bias_t,
        n,
        w.k,
        em,
        c.shape[0],
        a.stride(0),
        wp.stride(0),
        wp.stride(1),
        ws.stride(0),
        ws.stride(1),
        c.stride(0),
        wg_stride_e,
        wg_stride_half,
        a_stride,
        0 if a_rows is None else a_rows.stride(0),
        c_stride,
        stride_bias_e,
        W_KIND=w_kind,
        W_BS=w.block_size,
        MODE=numerics.kernel_id,
        W_ONE=getattr(w, "one_multiply", False),
        W_BITS=6 if fp6 else 4,
        W_EBITS=w.element.ebits if fp6 else 2,
        **select(fused_fp4_moe_kernel, {**_qdq_consts(a_qdq, "A"), **_qdq_consts(c_qdq, "C")}),
        GATED=gated,
        W_GLOBAL_OUT=w_kind == F4.W_NVFP4_HW,
        A_INV_OUT=a_inv is not None,
        A_PER_TOKEN=a_rows is not None,
        ROT_BS=0 if rotation is None else rotation.block_size,
        ROT_SIGNS=rotation is not None and rotation.signs_i is not None,
        MUL_ROUTED_WEIGHT=mul_routed_weight,
        top_k=top_k,
        NAIVE=plan.naive,
        HAS_BIAS=bias is not None,
        **activation_args(activation),
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        GROUP_SIZE_M=tiles.group_m,
        OUT_DTYPE=_TL_DTYPE[c.dtype],
        NUM_WARPS=num_warps,
        num_warps=num_warps,
        num_stages=tiles.num_stages,
        enable_fp_fusion=False,
    )


def fused_fp4_moe(
    hidden_states: torch.Tensor,
    w13: FP4Weights | F6.FP6Weights,
    w2: FP4Weights | F6.FP6Weights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    a1_qdq: ActivationQDQ | None = None,
    a2_qdq: ActivationQDQ | None = None,
    numerics: Numerics | str = Numerics.VLLM,
    configs: tuple[TileConfig, TileConfig] | None = None,
    plan: RoutingPlan | None = None,
    rotation: HD.BlockHadamard | None = None,
    activation=None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The whole MoE expert computation on prepared FP4 weights, activation QDQ fused.

    Args:
        hidden_states: ``[M, H]`` bf16, NOT yet quantized (a1's QDQ happens here).
        w13: ``prepare_fp4_weights`` of ``[E, 2I, H/2]`` (gate rows, then up rows);
            w2: of ``[E, H, I/2]``. Both MXFP4 or both NVFP4 (or both ``FP6Weights`` of one element).
        topk_weights: ``[M, k]`` router weights (fp32); topk_ids: ``[M, k]`` int expert ids.
        a1_qdq, a2_qdq: the activation QDQs (``ActivationQDQ(fmt, scale_mode, scale)``: an OCP MX
            block scheme; NVFP4 with ``scale`` the encode global scale gs, ``[1]`` or per expert
            ``[E]``, or without a scale: per-token dynamic scales, each row's amax sets its gs
            (``mxlib.reference.nvfp4_per_token_scales``; a1: a scales pre-pass over ``[M, H]`` then
            the A-load QDQ, or one standalone QDQ pass; a2: GEMM1 stores it unquantized, one pass
            QDQs it in place); per-tensor FP8 with ``scale`` the decode scale ``[1]``); None (or
            ``ActivationQDQ()``) for weight-only schemes.
        numerics: ``Numerics.VLLM`` / ``"vllm"`` (bf16 operands bit-identical to vLLM's dequant and
            QDQ) or ``Numerics.HARDWARE`` / ``"hardware"`` (exact ``element * block_scale`` operands,
            per-tensor scales on the fp32 accumulator); see the module docstring.
        configs: (GEMM1, GEMM2) tiles; None picks from ``FP4_CONFIGS`` by batch size.
        plan: the forward's ``RoutingPlan`` (``align.plan_routing`` for both GEMMs' ``block_m``);
            None plans here. A naive plan runs both GEMMs with 16-row blocks.
        rotation: the block Hadamard rotation of a rotated checkpoint (``hadamard.BlockHadamard``) or
            None: a1 rotated along H in one pass (``block_hadamard``) before its QDQ, a2 along I in
            GEMM1's epilogue before its QDQ (GEMM1's ``block_n`` raised to the block size if smaller).
        activation: GEMM1's gated activation (a ``mxlib.moe.activations.MoEActivation``; None: SiLU).
        w13_bias, w2_bias: ``[E, 2I]`` / ``[E, H]`` expert biases (fp32 or bf16) added to the fp32 accumulator
            after its scales (hardware numerics), before its rounding and GEMM2's router weight; or None.

    Returns:
        ``[M, H]`` in ``hidden_states.dtype``, H = w2's rows (weights zero-padded along K,
        ``fp4_layout.pad_fp4_halves``, take hidden states zero-padded alike). No host synchronization; capturable in
        a CUDA graph.

    Raises:
        ValueError: unknown numerics, mismatched shapes or formats (experts, H, I, element format),
            a plan not aligned for the tiles' ``block_m``; a QDQ with ``block_rule="four_over_six"`` with
            hardware numerics or per-token scales.
        TypeError: ``hidden_states`` not bf16, weights not prepared, ``topk_ids`` not integer.

    ``topk_ids`` values must lie in ``[0, E)``: reading them would synchronize, so they are not
    checked here (the experts classes check them before calling, ``check_topk_ids``).
    """
    numerics = get_numerics(numerics)
    for name, w in (("w13", w13), ("w2", w2)):
        if not isinstance(w, (FP4Weights, F6.FP6Weights)):
            raise TypeError(
                f"{name}: expected FP4Weights or FP6Weights (prepare_packed_weights), got {type(w).__name__}"
            )
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise TypeError(f"topk_ids: expected an integer tensor (int32 or int64), got {topk_ids.dtype}")
    if hidden_states.ndim != 2 or hidden_states.shape[1] != w13.k:
        raise ValueError(f"hidden_states: expected [M, {w13.k}], got {list(hidden_states.shape)}")
    if hidden_states.dtype != torch.bfloat16:
        raise TypeError(
            f"hidden_states: expected dtype torch.bfloat16 (the decode emits bf16), got {hidden_states.dtype}"
        )
    if w13.nvfp4 != w2.nvfp4:
        raise ValueError("w13 and w2 must both be NVFP4 or both MXFP4")
    for name, q in (("a1_qdq", a1_qdq), ("a2_qdq", a2_qdq)):  # 4/6: static NVFP4 scales, vLLM numerics
        if q is not None and q.block_rule != "amax" and (numerics is Numerics.HARDWARE or is_per_token(q)):
            raise ValueError(f"{name}: block_rule {q.block_rule!r} runs with a static scale and numerics 'vllm'")
    el13, el2 = getattr(w13, "element", None), getattr(w2, "element", None)  # FP6Weights: e2m3 or e3m2
    if el13 != el2:
        raise ValueError(f"w13 and w2 must have one element format, got {el13 or 'e2m1'} and {el2 or 'e2m1'}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != hidden_states.shape[0]:
        raise ValueError(f"topk_ids {list(topk_ids.shape)} and topk_weights {list(topk_weights.shape)} must be [M, k]")
    e, two_i = w13.packed.shape[:2]
    h = w2.packed.shape[1]
    i = two_i // 2
    if w2.k != i:
        raise ValueError(f"w2: expected K = I = {i}, got {w2.k}")
    if w2.packed.shape[0] != e or hidden_states.shape[1] not in (h, F4.padded_to_k_tile(h)):  # K: H or padded H
        raise ValueError(
            f"w2: expected [E={e}, H={hidden_states.shape[1]}, ...] as w13 and hidden_states, got "
            f"{list(w2.packed.shape)}"
        )
    return fused_fp4_moe_impl(
        hidden_states,
        w13,
        w2,
        topk_weights,
        topk_ids,
        a1_qdq,
        a2_qdq,
        numerics,
        configs,
        plan,
        rotation,
        activation,
        w13_bias,
        w2_bias,
    )


def fused_fp4_moe_impl(
    hidden_states: torch.Tensor,
    w13: FP4Weights | F6.FP6Weights,
    w2: FP4Weights | F6.FP6Weights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    a1_qdq: ActivationQDQ | None,
    a2_qdq: ActivationQDQ | None,
    numerics: Numerics,
    configs: tuple[TileConfig, TileConfig] | None,
    plan: RoutingPlan | None,
    rotation: HD.BlockHadamard | None,
    activation,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
) -> torch.Tensor:
    """``fused_fp4_moe`` on inputs already checked (vLLM's ``fused_experts_impl`` split): what the experts classes
    call, having checked ``hidden_states``, ``topk_weights`` and ``topk_ids`` once in their forward and built the
    weights, the QDQs and the numerics from one checked config (``mxlib.moe.base``). Same arguments, all given."""
    m, k = topk_ids.shape
    e, two_i = w13.packed.shape[:2]
    h = w2.packed.shape[1]
    i = two_i // 2
    hidden_states = hidden_states.contiguous()  # the kernels read rows with a unit column stride
    c1, c2 = configs or get_fp4_configs(m, e, k, w13.nvfp4, w13.nbits)
    if rotation is not None:
        rotation.check(h, i, values=False)  # no host read: capturable
        hidden_states = HD.block_hadamard(hidden_states, rotation.block_size, rotation.signs_h)
        c1 = replace(c1, block_n=max(c1.block_n, rotation.block_size))
    plan = plan or plan_routing(topk_ids, e, (c1.block_m, c2.block_m))
    if plan.naive:  # each pair its own block of 16 rows (row 0 live)
        c1 = replace(c1, block_m=16, group_m=1)
        c2 = replace(c2, block_m=16, group_m=1)
    dev = hidden_states.device
    weights = topk_weights.reshape(-1).float().contiguous()
    a1 = hidden_states
    a1q = a1_qdq if (a1_qdq is not None and a1_qdq.kind != A2_NONE) else None
    a1_per_expert = a1q is not None and a1q.kind == A2_NVFP4 and a1q.scale is not None and a1q.scale.numel() > 1
    hardware = numerics is Numerics.HARDWARE
    # hardware numerics: GEMM1's A holds e2m1 * s (NVFP4); its 1 / gs (per token: per_token_scale) goes on
    # the accumulator
    a1_inv = a1q if (hardware and a1q is not None and a1q.kind == A2_NVFP4) else None
    a1_rows = None
    if is_per_token(a1q):  # the rows' amax over all of H first: a scales pre-pass, or the whole QDQ
        a1, a1_rows = per_token_rows(hidden_states, qdq=not c1.a1_fused, hardware=hardware)
        a1 = hidden_states if c1.a1_fused else a1
        a1q = a1q if c1.a1_fused else None
    elif a1q is not None and not c1.a1_fused and not a1_per_expert:
        a1 = _standalone_a1_qdq(hidden_states, a1q, numerics)
        a1q = None
    a2_per_token = is_per_token(a2_qdq)
    a2 = torch.empty(m * k, i, dtype=hidden_states.dtype, device=dev)
    _launch(
        a=a1,
        w=w13,
        c=a2,
        topk_weights=weights,
        plan=plan,
        n=i,
        gated=True,
        a_qdq=a1q,
        a_inv=a1_inv,
        c_qdq=None if a2_per_token else a2_qdq,
        numerics=numerics,
        mul_routed_weight=False,
        top_k=k,
        tiles=c1,
        a_rows=a1_rows if (a1q is not None or a1_inv is not None) else None,  # read in the A load or the output
        rotation=rotation,
        bias=w13_bias,
        activation=activation,
    )
    a2_rows = None
    if a2_per_token:  # a2's rows QDQ'd in place, each with its own scale (an epilogue tile sees part of a row)
        a2, a2_rows = per_token_rows(a2, hardware=hardware, out=a2)
    out_pairs = torch.empty(m * k, h, dtype=hidden_states.dtype, device=dev)
    # hardware numerics: a2 holds e2m1 * s; its 1 / gs goes on GEMM2's accumulator
    a2_inv = a2_qdq if (hardware and a2_qdq is not None and a2_qdq.kind == A2_NVFP4) else None
    _launch(
        a=a2,
        w=w2,
        c=out_pairs,
        topk_weights=weights,
        plan=plan,
        n=h,
        gated=False,
        a_qdq=None,
        a_inv=a2_inv,
        c_qdq=None,
        numerics=numerics,
        mul_routed_weight=True,
        top_k=1,
        tiles=c2,
        a_rows=a2_rows if hardware else None,  # vLLM numerics: a2 holds its dequantized values
        bias=w2_bias,
    )
    out = torch.empty(m, h, dtype=hidden_states.dtype, device=dev)
    block = 1024
    _sum_k_kernel[(m, triton.cdiv(h, block))](
        out_pairs, out, h, top_k=k, BLOCK=block, OUT_DTYPE=_TL_DTYPE[hidden_states.dtype]
    )
    return out
