"""Fused-MoE grouped GEMM (Triton): the bf16 path every emulation runs on.

``fused_moe_kernel`` computes, for each block of expert-sorted (token, k) pairs,
``C[pair] = A[row(pair)] @ B[expert]^T`` with fp32 accumulation, optionally plus the
expert's bias and times the pair's router weight (in fp32, in that order, before the one
rounding to the output dtype).
It follows vLLM's ``fused_moe_kernel``; pairs come from
``mxlib.kernels.align.moe_align_block_size``.

Under ``TRITON_INTERPRET=1`` the operands are widened to fp32 before ``tl.dot``
(the interpreter's bf16 dot is wrong); compiled, the dot runs on bf16/fp16 tensor
cores with fp32 accumulation.
"""

from __future__ import annotations

import torch

from . import _numerics as nm
from ._bridge import TL_DTYPE as _TL_DTYPE
from ._bridge import interpreting
from ._triton import tl, triton
from .moe_epilogue import bias_args, load_bias
from .tiles import TileConfig, pick_tiles

__all__ = ["BF16_CONFIGS", "get_moe_config", "invoke_fused_moe_kernel", "interpreting"]


# (max pairs per expert, tiles): the winners of CUDA-graph replay timings on the H200 at the
# Qwen3-30B-A3B layer (E 128, top-8; M = 1, 4, 16, 64, 256, 1024, 4096 are 1/16 .. 256 pairs per
# expert; limits halfway on a log scale), Triton alignment (benchmarks/h200_fused_fp4.md).
# TileConfig(block_m, block_n, block_k, group_m, num_warps, num_stages)
BF16_CONFIGS: list[tuple[float, TileConfig]] = [
    (0.125, TileConfig(16, 64, 64, 1, 4, 5)),  # M = 1
    (0.5, TileConfig(16, 128, 128, 1, 4, 3)),  # M = 4
    (2.0, TileConfig(16, 128, 128, 1, 4, 4)),  # M = 16
    (8.0, TileConfig(16, 64, 128, 1, 4, 3)),  # M = 64
    (32.0, TileConfig(32, 256, 128, 16, 4, 2)),  # M = 256
    (float("inf"), TileConfig(128, 256, 64, 16, 8, 4)),  # M = 1024, 4096
]


def get_moe_config(num_tokens: int, num_experts: int, top_k: int, n: int, k: int) -> TileConfig:
    """Tiles by the average number of pairs per expert (``BF16_CONFIGS``; small batches want small
    ``block_m``); one small tile under the interpreter. ``n``, ``k``: the GEMM's, not read (one
    table serves both GEMMs)."""
    if interpreting():
        return TileConfig(16, 32, 32, 1, 4, 1)
    return pick_tiles(BF16_CONFIGS, num_tokens, num_experts, top_k)


@triton.jit
def fused_moe_kernel(
    # pointers
    a_ptr,
    b_ptr,
    c_ptr,
    topk_weights_ptr,
    sorted_token_ids_ptr,
    expert_ids_ptr,
    num_tokens_post_padded_ptr,
    bias_ptr,
    # dimensions
    N,
    K,
    EM,
    num_valid_tokens,
    # strides
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    stride_bias_e,
    # meta-parameters
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    top_k: tl.constexpr,
    UPCAST: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    NAIVE: tl.constexpr = False,
    HAS_BIAS: tl.constexpr = False,
):
    """Grouped GEMM over expert-sorted pairs.

    A: [rows, K] (rows = M with top_k = k, or M * k with top_k = 1), B: [E, N, K],
    C: [M * k, N] (a view of [M, k, N]), topk_weights: [M * k] fp32,
    sorted_token_ids: [EM], expert_ids: [EM / BLOCK_SIZE_M], num_tokens_post_padded: [1],
    bias: [E, N] (HAS_BIAS: added to the fp32 accumulator before the router weight).
    NAIVE (tiny batches, no alignment): block ``pid_m`` is the single pair ``pid_m`` (row 0 of the
    block live), ``expert_ids`` the flat topk_ids, EM = pairs * BLOCK_SIZE_M; the sorted ids and
    the padded count are not read.
    """
    pid_m, pid_n = nm.grouped_pid(tl.program_id(axis=0), EM, N, BLOCK_SIZE_M, BLOCK_SIZE_N, GROUP_SIZE_M)

    if NAIVE:
        offs_token = tl.where(tl.arange(0, BLOCK_SIZE_M) == 0, pid_m, num_valid_tokens).to(tl.int64)
    else:
        num_tokens_post_padded = tl.load(num_tokens_post_padded_ptr)
        if pid_m * BLOCK_SIZE_M >= num_tokens_post_padded:
            return
        offs_token_id = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
        offs_token = tl.load(sorted_token_ids_ptr + offs_token_id).to(tl.int64)
    token_mask = offs_token < num_valid_tokens
    off_expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)

    offs_bn = (pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)) % N
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    a_ptrs = a_ptr + (offs_token[:, None] // top_k * stride_am + offs_k[None, :] * stride_ak)
    b_ptrs = b_ptr + off_expert * stride_be + (offs_k[:, None] * stride_bk + offs_bn[None, :] * stride_bn)

    accumulator = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for kk in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
        k_mask = offs_k < K - kk * BLOCK_SIZE_K
        a = tl.load(a_ptrs, mask=token_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None], other=0.0)
        if UPCAST:
            accumulator += tl.dot(nm.to_fp32(a), nm.to_fp32(b))
        else:
            accumulator = tl.dot(a, b, acc=accumulator)
        a_ptrs += BLOCK_SIZE_K * stride_ak
        b_ptrs += BLOCK_SIZE_K * stride_bk

    if HAS_BIAS:
        accumulator = accumulator + load_bias(bias_ptr, off_expert, stride_bias_e, offs_bn, offs_bn < N)[None, :]
    if MUL_ROUTED_WEIGHT:
        moe_weight = tl.load(topk_weights_ptr + offs_token, mask=token_mask, other=0)
        accumulator = accumulator * moe_weight[:, None]
    c = nm.cast_out(accumulator, OUT_DTYPE)
    offs_cn = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    c_ptrs = c_ptr + stride_cm * offs_token[:, None] + stride_cn * offs_cn[None, :]
    tl.store(c_ptrs, c, mask=token_mask[:, None] & (offs_cn[None, :] < N))


def invoke_fused_moe_kernel(
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    topk_weights: torch.Tensor | None,
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor,
    mul_routed_weight: bool,
    top_k: int,
    config: TileConfig,
    naive: bool = False,
    bias: torch.Tensor | None = None,
) -> None:
    """Launch ``fused_moe_kernel``: ``C[M*k, N] = A @ B[e]^T`` for every (token, k) pair.

    Args:
        A: ``[rows, K]`` activations (bf16 / fp16 / fp32), row ``pair // top_k``.
        B: ``[E, N, K]`` expert weights, same dtype as ``A``.
        C: ``[M, k, N]`` or ``[M * k, N]`` output, contiguous.
        topk_weights: ``[M, k]`` router weights (cast to fp32) when ``mul_routed_weight``.
        sorted_token_ids, expert_ids, num_tokens_post_padded: from ``moe_align_block_size``
            with ``block_m == config.block_m``.
        top_k: ``k`` when ``A`` has one row per token, 1 when it has one row per pair.
        naive: no alignment (``naive_block_assignment``): ``expert_ids`` is the flat ``[M * k]``
            topk_ids, ``sorted_token_ids`` and ``num_tokens_post_padded`` are not read (the grid
            has one block per pair).
        bias: ``[E, N]`` expert biases (fp32 or ``C``'s dtype) added to the fp32 products before the
            router weight and the rounding, or None.
    """
    if A.dtype != B.dtype:
        raise TypeError(f"A and B must share a dtype, got A {A.dtype} and B {B.dtype}")
    if A.shape[-1] != B.shape[-1]:
        raise ValueError(f"A: K={A.shape[-1]} does not match B's K={B.shape[-1]} (B is [E, N, K])")
    c2 = C.view(-1, C.shape[-1])
    if naive:  # not read by the kernel
        sorted_token_ids = num_tokens_post_padded = expert_ids
    em = expert_ids.numel() * config.block_m if naive else sorted_token_ids.shape[0]
    num_valid = topk_weights.numel() if topk_weights is not None else c2.shape[0]
    weights = topk_weights.reshape(-1).float().contiguous() if mul_routed_weight else c2
    n, k = B.shape[1], B.shape[2]
    bias_t, stride_bias_e = bias_args(bias, c2, B.shape[0], n, "bias")
    grid = (triton.cdiv(em, config.block_m) * triton.cdiv(n, config.block_n),)
    fused_moe_kernel[grid](
        A,
        B,
        c2,
        weights,
        sorted_token_ids,
        expert_ids,
        num_tokens_post_padded,
        bias_t,
        n,
        k,
        em,
        num_valid,
        A.stride(0),
        A.stride(1),
        B.stride(0),
        B.stride(1),
        B.stride(2),
        c2.stride(0),
        c2.stride(1),
        stride_bias_e,
        BLOCK_SIZE_M=config.block_m,
        BLOCK_SIZE_N=config.block_n,
        BLOCK_SIZE_K=config.block_k,
        GROUP_SIZE_M=config.group_m,
        MUL_ROUTED_WEIGHT=mul_routed_weight,
        top_k=top_k,
        UPCAST=interpreting(),
        OUT_DTYPE=_TL_DTYPE[C.dtype],
        NAIVE=naive,
        HAS_BIAS=bias is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
