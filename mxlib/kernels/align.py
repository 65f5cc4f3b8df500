"""Block alignment of (token, k) pairs for the grouped MoE GEMMs (vLLM's ``moe_align_block_size``).

Pure PyTorch (no host synchronization, capturable in a CUDA graph); it lives beside the
kernels that consume its output. ``mxlib.moe`` re-exports it.
"""

from __future__ import annotations

import torch

__all__ = ["moe_align_block_size"]


def moe_align_block_size(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the flat (token, k) pairs by expert and pad each group to a multiple of ``block_m``.

    The flat index of pair ``(t, j)`` is ``t * k + j``. Pairs are listed by ascending
    expert id (by flat index within an expert); each expert's list is padded with the
    sentinel ``M * k`` up to a multiple of ``block_m``. Experts with no pairs take no
    blocks. Every output has a size fixed by the input shapes (no host synchronization,
    so the call can be captured in a CUDA graph).

    Args:
        topk_ids: ``[M, k]`` integer expert ids in ``[0, num_experts)``.
        block_m: rows per GEMM block.
        num_experts: ``E``.

    Returns:
        ``sorted_token_ids`` int32 ``[M*k + E*(block_m-1)]`` (tail filled with the sentinel),
        ``expert_ids`` int32 ``[len(sorted_token_ids) // block_m]`` (the expert of each block;
        blocks past the end repeat the last expert and are never computed) and
        ``num_tokens_post_padded`` int32 ``[1]``.
    """
    if topk_ids.ndim != 2:
        raise ValueError(f"topk_ids: expected [M, k], got shape {list(topk_ids.shape)}")
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    numel = flat.numel()
    max_padded = numel + num_experts * (block_m - 1)
    max_padded = -(-max_padded // block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    count_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    experts_sorted = flat[order]
    rank = torch.arange(numel, device=device) - count_start[experts_sorted]
    sorted_token_ids = torch.full((max_padded,), numel, dtype=torch.int32, device=device)
    sorted_token_ids[padded_start[experts_sorted] + rank] = order.to(torch.int32)
    block_starts = torch.arange(max_padded // block_m, device=device) * block_m
    expert_ids = torch.searchsorted(padded_end, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_token_ids, expert_ids.to(torch.int32), padded_end[-1:].to(torch.int32)
