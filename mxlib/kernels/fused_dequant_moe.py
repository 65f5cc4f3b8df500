"""Fused emulation MoE: packed weights dequantized tile by tile inside the grouped GEMM.

vLLM's emulation dequantizes all experts' weights to bf16 on every forward and
then runs the bf16 fused-MoE GEMM: at small batches it moves every expert's weights
in bf16 to use eight of them. Here the GEMM loads the *packed* weights and their
scales of only the experts that received tokens, decodes them in registers with the
same arithmetic as ``mxlib.reference`` (so the bf16 operands are bit-identical to the
vLLM's dequantized weights), and feeds bf16 tensor-core dots with fp32 accumulation.
No bf16 copy of the weights exists.

Layout ("swap AB"): a program computes ``acc[BLOCK_N, BLOCK_M] = W[e][n0:n0+BN, :] @ A^T``
for a block of expert-sorted (token, k) pairs, so the dequantized weight tile is the
left operand, held in registers (Hopper's wgmma takes A from registers), and the
token count rides on the MMA's small dimension, which keeps tiny batches efficient.

GEMM1 (``GATED``) computes the gate rows and the up rows of ``w13`` in two accumulators,
adds the expert's bias (``w13_bias``, optional), rounds both to the activation dtype, applies
the gated activation in fp32 (SiLU-and-mul or SwiGLU-OAI, ``moe_epilogue.gated_activation``),
rounds once more (as vLLM's separate ``silu_and_mul`` / ``swigluoai_and_mul`` op does) and then
quantize-dequantizes the result in the epilogue (a2: MX, NVFP4 or per-tensor FP8), writing ``a2``
once. GEMM2 adds its bias (``w2_bias``) and multiplies by the router weight in fp32 before its one
rounding. The layer
input a1 is quantize-dequantized by the standalone kernel before GEMM1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats import BLOCK_SCHEMES, BlockScheme, PerTensorScheme
from . import _numerics as nm
from ._bridge import TL_DTYPE as _TL_DTYPE
from ._bridge import interpreting, kernel_format_args, select
from ._triton import tl, triton
from .align import RoutingPlan, plan_routing
from .dequant_tiles import _a_part, _fp6_part, _fp6_words, _weight_tile, _weight_tile_split
from .moe_epilogue import activation_args, bias_args, gated_activation, load_bias
from .tiles import TileConfig, pick_tiles

__all__ = ["FUSED_CONFIGS", "get_fused_config", "invoke_fused_dequant_moe", "PackedWeights", "ActivationQDQ"]

# What GEMM1's epilogue does to a2 (the kernel's A2_KIND constexpr); ActivationQDQ.kind picks one.
A2_NONE = tl.constexpr(0)
A2_MX = tl.constexpr(1)
A2_NVFP4 = tl.constexpr(2)
A2_FP8 = tl.constexpr(3)


# Chosen by the tile sweep of ``python -m mxlib.bench moe --sweep`` on the H200 (Qwen3-30B-A3B
# layer shapes), keyed by packed weight bits, then by the average number of pairs per expert.
# TileConfig(block_m, block_n, block_k, group_m, num_warps, num_stages, split_nibbles)
FUSED_CONFIGS: dict[int, list[tuple[float, TileConfig]]] = {
    4: [
        (0.25, TileConfig(16, 128, 128, 1, 4, 3)),
        (4.0, TileConfig(16, 64, 128, 1, 4, 4)),
        (64.0, TileConfig(32, 64, 128, 1, 4, 3)),
        (float("inf"), TileConfig(128, 64, 64, 8, 4, 3)),
    ],
    # FP8 weights (MXFP8, the hardware FP8 conversion): the winners of a CUDA-graph replay sweep of 14 tiles on
    # an H100 (w_mxfp8, harness layer; benchmarks/h100_mxfp8_tile_sweep.json): 0.224 ms at M = 16 where the
    # 4-bit table's tile took 0.234, 0.569 at M = 1024 against 0.686
    8: [
        (8.0, TileConfig(16, 64, 128, 1, 4, 3)),
        (16.0, TileConfig(32, 64, 128, 1, 4, 3)),
        (float("inf"), TileConfig(128, 128, 128, 4, 8, 3)),
    ],
    6: [
        (0.25, TileConfig(16, 128, 128, 1, 4, 3, True)),
        (4.0, TileConfig(16, 64, 128, 1, 4, 3)),
        (64.0, TileConfig(32, 128, 128, 4, 8, 3)),
        (float("inf"), TileConfig(128, 64, 64, 8, 4, 3)),
    ],
}


def get_fused_config(num_tokens: int, num_experts: int, top_k: int, weight_bits: int = 4) -> TileConfig:
    """Tiles by packed weight bits and the average number of pairs per expert."""
    if interpreting():
        return TileConfig(16, 32, 32, 1, 4, 1)
    return pick_tiles(FUSED_CONFIGS.get(weight_bits, FUSED_CONFIGS[4]), num_tokens, num_experts, top_k)


@triton.jit
def fused_moe_dequant_kernel(
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
    act_scale_ptr,
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
    act_scale_stride_e,
    stride_bias_e,
    # weight format
    W_EBITS: tl.constexpr,
    W_MBITS: tl.constexpr,
    W_SPECIALS: tl.constexpr,
    W_BS: tl.constexpr,
    W_NVFP4: tl.constexpr,
    # epilogue
    GATED: tl.constexpr,
    A2_KIND: tl.constexpr,
    A2_EBITS: tl.constexpr,
    A2_MBITS: tl.constexpr,
    A2_EMAX: tl.constexpr,
    A2_MAX: tl.constexpr,
    A2_SCALE_MODE: tl.constexpr,
    A2_BS: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    top_k: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    ACT_ALPHA: tl.constexpr,
    ACT_CLAMP: tl.constexpr,
    ACT_LIMIT: tl.constexpr,
    # tiles
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    SPLIT_NIBBLES: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """C[pair, n] for the pairs of one expert block and BLOCK_N output columns.

    A: [rows, K] activations (row ``pair // top_k``); W: [E, rows_w, K * bits / 8] packed,
    scales [E, rows_w, K / W_BS]; with GATED, rows_w = 2N (gate rows, then up rows) and C is
    the QDQ'd gated activation (ACT: ``moe_epilogue``) [M * k, N]; otherwise rows_w = N and
    C = A @ W[e]^T (times the router weight with MUL_ROUTED_WEIGHT). HAS_BIAS: bias [E, rows_w]
    added to the fp32 accumulators (gate and up columns; GEMM2's before the router weight).
    A2_KIND: A2_NONE, A2_MX (OCP MX), A2_NVFP4 (encode scale act_scale[e]), A2_FP8 (per tensor,
    decode scale act_scale[0]).
    """
    pid_m, pid_n = nm.grouped_pid(tl.program_id(axis=0), EM, N, BLOCK_M, BLOCK_N, GROUP_SIZE_M)

    if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
        return
    offs_token = tl.load(sorted_token_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    token_mask = offs_token < num_valid_tokens
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_rows = w_ptr + expert * stride_we + offs_n.to(tl.int64) * stride_wn
    s_rows = ws_ptr + expert * stride_se + offs_n.to(tl.int64) * stride_sn
    if W_NVFP4:
        g = tl.load(wg_ptr + expert * wg_stride_e)
        g_up = tl.load(wg_ptr + expert * wg_stride_e + wg_stride_half)
    else:
        g = 1.0
        g_up = 1.0
    a_rows = a_ptr + (offs_token // top_k) * stride_am
    DOT_DTYPE: tl.constexpr = OUT_DTYPE

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    NBITS: tl.constexpr = 1 + W_EBITS + W_MBITS
    for k0 in range(0, K, BLOCK_K):
        if SPLIT_NIBBLES and NBITS == 6:
            a0 = _a_part(a_rows, token_mask, k0, K, 0, 4, BLOCK_K, UPCAST)
            a1 = _a_part(a_rows, token_mask, k0, K, 1, 4, BLOCK_K, UPCAST)
            a2 = _a_part(a_rows, token_mask, k0, K, 2, 4, BLOCK_K, UPCAST)
            a3 = _a_part(a_rows, token_mask, k0, K, 3, 4, BLOCK_K, UPCAST)
            word, block = _fp6_words(w_rows, s_rows, n_mask, k0, K, W_BS, BLOCK_N, BLOCK_K)
            acc = tl.dot(
                _fp6_part(word, block, 0, W_EBITS, W_MBITS, W_BS, BLOCK_N, BLOCK_K, DOT_DTYPE, UPCAST), a0, acc
            )
            acc = tl.dot(
                _fp6_part(word, block, 1, W_EBITS, W_MBITS, W_BS, BLOCK_N, BLOCK_K, DOT_DTYPE, UPCAST), a1, acc
            )
            acc = tl.dot(
                _fp6_part(word, block, 2, W_EBITS, W_MBITS, W_BS, BLOCK_N, BLOCK_K, DOT_DTYPE, UPCAST), a2, acc
            )
            acc = tl.dot(
                _fp6_part(word, block, 3, W_EBITS, W_MBITS, W_BS, BLOCK_N, BLOCK_K, DOT_DTYPE, UPCAST), a3, acc
            )
            if GATED:
                word, block = _fp6_words(
                    w_rows + N * stride_wn, s_rows + N * stride_sn, n_mask, k0, K, W_BS, BLOCK_N, BLOCK_K
                )
                acc_up = tl.dot(
                    _fp6_part(word, block, 0, W_EBITS, W_MBITS, W_BS, BLOCK_N, BLOCK_K, DOT_DTYPE, UPCAST), a0, acc_up
                )
                acc_up = tl.dot(
                    _fp6_part(word, block, 1, W_EBITS, W_MBITS, W_BS, BLOCK_N, BLOCK_K, DOT_DTYPE, UPCAST), a1, acc_up
                )
                acc_up = tl.dot(
                    _fp6_part(word, block, 2, W_EBITS, W_MBITS, W_BS, BLOCK_N, BLOCK_K, DOT_DTYPE, UPCAST), a2, acc_up
                )
                acc_up = tl.dot(
                    _fp6_part(word, block, 3, W_EBITS, W_MBITS, W_BS, BLOCK_N, BLOCK_K, DOT_DTYPE, UPCAST), a3, acc_up
                )
        elif SPLIT_NIBBLES and NBITS == 4:
            offs_k = k0 + 2 * tl.arange(0, BLOCK_K // 2)
            amask = token_mask[None, :] & (offs_k < K)[:, None]
            a_lo = tl.load(a_rows[None, :] + offs_k[:, None], mask=amask, other=0.0)
            a_hi = tl.load(a_rows[None, :] + offs_k[:, None] + 1, mask=amask, other=0.0)
            if UPCAST:
                a_lo = nm.to_fp32(a_lo)
                a_hi = nm.to_fp32(a_hi)
            w_lo, w_hi = _weight_tile_split(
                w_rows, s_rows, n_mask, g, k0, K, W_BS, W_NVFP4, BLOCK_N, BLOCK_K, DOT_DTYPE, UPCAST
            )
            acc = tl.dot(w_lo, a_lo, acc)
            acc = tl.dot(w_hi, a_hi, acc)
            if GATED:
                u_lo, u_hi = _weight_tile_split(
                    w_rows + N * stride_wn,
                    s_rows + N * stride_sn,
                    n_mask,
                    g_up,
                    k0,
                    K,
                    W_BS,
                    W_NVFP4,
                    BLOCK_N,
                    BLOCK_K,
                    DOT_DTYPE,
                    UPCAST,
                )
                acc_up = tl.dot(u_lo, a_lo, acc_up)
                acc_up = tl.dot(u_hi, a_hi, acc_up)
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(a_rows[None, :] + offs_k[:, None], mask=token_mask[None, :] & (offs_k < K)[:, None], other=0.0)
            if UPCAST:
                a = nm.to_fp32(a)
            w = _weight_tile(
                w_rows,
                s_rows,
                n_mask,
                g,
                k0,
                K,
                W_EBITS,
                W_MBITS,
                W_SPECIALS,
                W_BS,
                W_NVFP4,
                BLOCK_N,
                BLOCK_K,
                DOT_DTYPE,
                UPCAST,
            )
            acc = tl.dot(w, a, acc)
            if GATED:
                w_up = _weight_tile(
                    w_rows + N * stride_wn,
                    s_rows + N * stride_sn,
                    n_mask,
                    g_up,
                    k0,
                    K,
                    W_EBITS,
                    W_MBITS,
                    W_SPECIALS,
                    W_BS,
                    W_NVFP4,
                    BLOCK_N,
                    BLOCK_K,
                    DOT_DTYPE,
                    UPCAST,
                )
                acc_up = tl.dot(w_up, a, acc_up)

    res = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    res_up = tl.trans(acc_up)
    if HAS_BIAS:
        res = res + load_bias(bias_ptr, expert, stride_bias_e, offs_n, n_mask)[None, :]
        if GATED:
            res_up = res_up + load_bias(bias_ptr, expert, stride_bias_e, N + offs_n, n_mask)[None, :]
    if GATED:
        gate = nm.to_fp32(nm.cast_out(res, OUT_DTYPE))
        up = nm.to_fp32(nm.cast_out(res_up, OUT_DTYPE))
        act = nm.to_fp32(nm.cast_out(gated_activation(gate, up, ACT, ACT_ALPHA, ACT_CLAMP, ACT_LIMIT), OUT_DTYPE))
        if A2_KIND == A2_MX:
            act = nm.mx_qdq_values(act, A2_EBITS, A2_MBITS, A2_EMAX, A2_MAX, A2_SCALE_MODE, A2_BS, BLOCK_M, BLOCK_N)
        elif A2_KIND == A2_NVFP4:
            gs = tl.load(act_scale_ptr + expert * act_scale_stride_e)
            act = nm.nvfp4_qdq_values(act, gs, False, A2_BS, BLOCK_M, BLOCK_N)
        elif A2_KIND == A2_FP8:
            act = nm.fp8_qdq_values(act, tl.load(act_scale_ptr))
        out = nm.cast_out(act, OUT_DTYPE)
    else:
        if MUL_ROUTED_WEIGHT:
            res = res * tl.load(topk_weights_ptr + offs_token, mask=token_mask, other=0)[:, None]
        out = nm.cast_out(res, OUT_DTYPE)
    c_ptrs = c_ptr + offs_token[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, out, mask=token_mask[:, None] & n_mask[None, :])


@dataclass
class PackedWeights:
    """One expert stack's packed weights for the fused kernel.

    ``packed`` uint8 [E, rows, K * bits / 8]; ``scales`` uint8 [E, rows, K / block_size]
    (E8M0 bytes, or e4m3 bytes for NVFP4); ``scheme`` the ``BlockScheme`` they are stored in;
    ``global_scale`` fp32 [E] or [E, 2] (schemes with a global scale: NVFP4).
    """

    packed: torch.Tensor
    scales: torch.Tensor
    scheme: BlockScheme
    global_scale: torch.Tensor | None = None

    @property
    def nbits(self) -> int:
        return self.scheme.element.nbits


@dataclass
class ActivationQDQ:
    """The a2 QDQ done in GEMM1's epilogue.

    ``fmt``: None (no QDQ), an OCP MX ``BlockScheme`` (dynamic E8M0 scales by ``scale_mode``),
    NVFP4 (``scale``: encode global scales [E] or [1]) or the per-tensor FP8 scheme (``scale``:
    the decode scale [1]). ``block_rule``: NVFP4's block rule (``mxlib.reference.NVFP4_BLOCK_RULES``:
    ``amax``, or ``four_over_six``, which the FP4 kernel runs and this module's kernel refuses).
    """

    fmt: BlockScheme | PerTensorScheme | None = None
    scale_mode: str = "even"
    scale: torch.Tensor | None = None
    block_rule: str = "amax"

    @property
    def kind(self):
        if self.fmt is None:
            return A2_NONE
        if isinstance(self.fmt, PerTensorScheme):
            return A2_FP8
        return A2_NVFP4 if self.fmt.has_global_scale else A2_MX

    def kernel_args(self, prefix: str = "A2_") -> dict:
        """The ``A2_*`` constexprs, or ``{prefix}*`` (unused ones keep the values of mxfp4)."""
        args = kernel_format_args(BLOCK_SCHEMES["mxfp4"], prefix, scale_mode=self.scale_mode)
        if self.fmt is not None:
            args.update(kernel_format_args(self.fmt, prefix, scale_mode=self.scale_mode))
        args[prefix + "KIND"] = self.kind
        return args


def qdq_consts(q: ActivationQDQ | None, prefix: str) -> dict:
    """The ``{prefix}_KIND, _EBITS, ...`` constexprs of an activation QDQ (``ActivationQDQ.kernel_args``) and
    ``{prefix}_FOUR_OVER_SIX``: NVFP4's 4/6 block rule (``ActivationQDQ.block_rule``)."""
    q = q or ActivationQDQ()
    return {**q.kernel_args(prefix + "_"), f"{prefix}_FOUR_OVER_SIX": q.block_rule == "four_over_six"}


def qdq_scale_arg(q: ActivationQDQ | None, e: int, dummy: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(scale tensor, expert stride)`` of an activation QDQ's scale (``dummy``, 0 without one)."""
    if q is None or q.scale is None:
        return dummy, 0
    s = q.scale.float().reshape(-1)
    return s, (1 if (q.kind == A2_NVFP4 and s.numel() == e) else 0)


# packed widths with a split-element variant (FP4 nibbles, FP6 words)
SPLIT_NIBBLES_BITS = (4, 6)


def _launch(
    *,
    a: torch.Tensor,
    w: PackedWeights,
    c: torch.Tensor,
    topk_weights: torch.Tensor,
    plan: RoutingPlan,
    n: int,
    k: int,
    gated: bool,
    qdq: ActivationQDQ,
    mul_routed_weight: bool,
    top_k: int,
    cfg: TileConfig,
    bias: torch.Tensor | None = None,
    activation=None,
):
    """One GEMM: ``c = a @ w[e]^T`` over the plan's blocks of ``cfg.block_m`` pairs (``gated``: the
    gated ``activation`` of the gate and up halves, then ``qdq``), ``n`` output columns, ``k`` reduction;
    ``bias`` ``[E, rows of w]`` added to the fp32 products (or None)."""
    sorted_ids, expert_ids, num_post = plan.blocks(cfg.block_m)
    e = w.packed.shape[0]
    if w.global_scale is not None:
        gsc = w.global_scale
        wg_stride_e, wg_stride_half = (2, 1) if gsc.ndim == 2 else (1, 0)
    else:
        gsc, wg_stride_e, wg_stride_half = w.packed, 0, 0
    act_scale = qdq.scale if qdq.scale is not None else w.packed
    act_stride = 1 if (qdq.kind == A2_NVFP4 and qdq.scale.numel() == e) else 0
    em = sorted_ids.shape[0]
    grid = (triton.cdiv(em, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    weights = topk_weights if mul_routed_weight else c
    bias_t, stride_bias_e = bias_args(bias, c, e, w.packed.shape[1], "w13_bias" if gated else "w2_bias")
    act = activation_args(activation)
    kernel = fused_moe_dequant_kernel
    fmt_args = select(kernel, {**kernel_format_args(w.scheme, "W_"), **qdq.kernel_args()})
    kernel[grid](
        a,
        w.packed,
        w.scales,
        gsc,
        c,
        weights,
        sorted_ids,
        expert_ids,
        num_post,
        act_scale,
        bias_t,
        n,
        k,
        em,
        c.shape[0],
        a.stride(0),
        w.packed.stride(0),
        w.packed.stride(1),
        w.scales.stride(0),
        w.scales.stride(1),
        c.stride(0),
        wg_stride_e,
        wg_stride_half,
        act_stride,
        stride_bias_e,
        **fmt_args,
        **act,
        HAS_BIAS=bias is not None,
        GATED=gated,
        MUL_ROUTED_WEIGHT=mul_routed_weight,
        top_k=top_k,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_SIZE_M=cfg.group_m,
        SPLIT_NIBBLES=cfg.split_nibbles and w.nbits in SPLIT_NIBBLES_BITS,
        OUT_DTYPE=_TL_DTYPE[c.dtype],
        UPCAST=interpreting(),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        enable_fp_fusion=False,
    )


def invoke_fused_dequant_moe(
    a1: torch.Tensor,
    w13: PackedWeights,
    w2: PackedWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    a2_qdq: ActivationQDQ,
    a1_per_pair: bool = False,
    config: TileConfig | None = None,
    plan: RoutingPlan | None = None,
    activation=None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The whole expert computation with the fused kernel (a1 already QDQ'd).

    Args:
        a1: ``[M, H]`` (or ``[M * k, H]`` with ``a1_per_pair``), bf16 or fp16.
        w13: packed ``[E, 2I, ...]`` (gate rows, then up rows); w2: packed ``[E, H, ...]``.
        topk_weights, topk_ids: ``[M, k]``.
        a2_qdq: the intermediate activation's QDQ (done in GEMM1's epilogue).
        a1_per_pair: ``a1`` holds one row per (token, k) pair (per-expert a1 scales).
        config: the tiles of both GEMMs; None picks from ``FUSED_CONFIGS`` by batch size.
        plan: the forward's ``RoutingPlan`` (``align.plan_routing``, aligned for ``config.block_m``;
            this kernel has no naive mode); None plans here.
        activation: the gated activation (a ``mxlib.moe.activations.MoEActivation``; None: SiLU).
        w13_bias, w2_bias: ``[E, 2I]`` / ``[E, H]`` expert biases (fp32 or ``a1``'s dtype) added to the fp32
            GEMM products before their rounding (GEMM2's before the router weight), or None.

    Returns:
        ``[M, H]`` in ``a1.dtype``. No host synchronization: capturable in a CUDA graph.

    Raises:
        ValueError: a bias of another shape; a plan without alignment; a 4/6 block rule.
    """
    if a2_qdq.block_rule != "amax":
        raise ValueError(
            f"a2_qdq: this kernel QDQs by the amax block rule, got {a2_qdq.block_rule!r} (fused_fp4_moe runs it)"
        )
    m, k = topk_ids.shape
    e, two_i = w13.packed.shape[:2]
    h = w2.packed.shape[1]
    i = two_i // 2
    cfg = config or get_fused_config(m, e, k, w13.nbits)
    plan = plan or plan_routing(topk_ids, e, (cfg.block_m,), naive_ok=False)
    if plan.naive:
        raise ValueError("plan: the dequantize-GEMM kernel has no naive mode (plan_routing(..., naive_ok=False))")
    weights = topk_weights.reshape(-1).float().contiguous()
    cache2 = torch.empty(m * k, i, dtype=a1.dtype, device=a1.device)
    _launch(
        a=a1,
        w=w13,
        c=cache2,
        topk_weights=weights,
        plan=plan,
        n=i,
        k=h,
        gated=True,
        qdq=a2_qdq,
        mul_routed_weight=False,
        top_k=1 if a1_per_pair else k,
        cfg=cfg,
        bias=w13_bias,
        activation=activation,
    )
    cache3 = torch.empty(m * k, h, dtype=a1.dtype, device=a1.device)
    _launch(
        a=cache2,
        w=w2,
        c=cache3,
        topk_weights=weights,
        plan=plan,
        n=h,
        k=i,
        gated=False,
        qdq=ActivationQDQ(),
        mul_routed_weight=True,
        top_k=1,
        cfg=cfg,
        bias=w2_bias,
    )
    return torch.sum(cache3.view(m, k, h), dim=1, dtype=torch.float32).to(a1.dtype)
