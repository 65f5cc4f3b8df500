"""Routing (Qwen3 top-k). The block alignment the grouped GEMMs need, and the routing plan a
forward hands them, live beside the kernels (``mxlib.kernels.align``); vLLM's
``moe_align_block_size`` is re-exported here.

Shapes: ``M`` tokens, ``E`` experts, ``k`` = top_k experts per token.
"""

from __future__ import annotations

import torch

from ..kernels.align import moe_align_block_size

__all__ = ["fused_topk", "moe_align_block_size"]


def fused_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE routing: fp32 softmax over experts, top-k, optional renormalization.

    Args:
        router_logits: ``[M, E]`` router outputs (any float dtype).
        top_k: experts per token (Qwen3-30B-A3B: 8).
        renormalize: divide the k weights by their sum (``norm_topk_prob``).

    Returns:
        ``(topk_weights [M, k] fp32, topk_ids [M, k] int32)``, weights in descending order;
        equal probabilities go to the lower expert id (a stable sort), as vLLM's kernel does.

    Raises:
        ValueError: ``top_k`` outside ``[1, E]`` or logits that are not 2D.
    """
    if router_logits.ndim != 2:
        raise ValueError(f"router_logits: expected [M, E], got shape {list(router_logits.shape)}")
    num_experts = router_logits.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k: expected 1 <= top_k <= num_experts={num_experts}, got {top_k}")
    probs = torch.softmax(router_logits.float(), dim=-1)
    values, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    topk_weights, topk_ids = values[:, :top_k], ids[:, :top_k]
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights.contiguous(), topk_ids.to(torch.int32).contiguous()
