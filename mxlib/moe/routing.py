"""Routing: Qwen3-MoE's top-k (``fused_topk``, vLLM's tie rule) and each supported family's
router as a function of its logits, with the family's own arithmetic (``softmax_topk``: Mixtral,
OLMoE, Qwen2-MoE, Qwen3-MoE; ``grouped_topk``: DeepSeek-V3; ``topk_softmax``: gpt-oss). The block
alignment the grouped GEMMs need, and the routing plan a forward hands them, live beside the
kernels (``mxlib.kernels.align``); vLLM's ``moe_align_block_size`` is re-exported here.

Shapes: ``M`` tokens, ``E`` experts, ``k`` = top_k experts per token.
"""

from __future__ import annotations

import torch

from ..kernels.align import moe_align_block_size

__all__ = ["fused_topk", "softmax_topk", "grouped_topk", "topk_softmax", "moe_align_block_size"]


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


def _check_logits(router_logits: torch.Tensor, top_k: int) -> int:
    if not isinstance(router_logits, torch.Tensor) or router_logits.ndim != 2:
        got = list(router_logits.shape) if isinstance(router_logits, torch.Tensor) else type(router_logits).__name__
        raise ValueError(f"router_logits: expected a [M, E] tensor, got {got}")
    num_experts = router_logits.shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k: expected an integer 1 <= top_k <= num_experts={num_experts}, got {top_k!r}")
    return num_experts


def softmax_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, weights_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing as transformers' routers compute it: fp32 softmax over the E experts,
    ``torch.topk`` (its order and its choice among equal probabilities), then with ``renormalize``
    the k weights divided by their sum.

    Mixtral (``MixtralTopKRouter``): ``renormalize=True``, ``weights_dtype=None`` (fp32 weights).
    OLMoE, Qwen2-MoE, Qwen3-MoE (``OlmoeTopKRouter``, ...): ``renormalize=config.norm_topk_prob``
    (OLMoE's default False), ``weights_dtype=router_logits.dtype`` (the weights rounded back to the
    logits' dtype, as those routers do).

    Args:
        router_logits: ``[M, E]`` router outputs (any float dtype).
        top_k: experts per token, ``1 <= top_k <= E``.
        renormalize: divide the k weights by their sum.
        weights_dtype: the returned weights' dtype (None: fp32).

    Returns:
        ``(topk_weights [M, k], topk_ids [M, k] int32)``, in ``torch.topk``'s order (descending).

    Raises:
        ValueError: logits not 2D, ``top_k`` outside ``[1, E]``.
    """
    _check_logits(router_logits, top_k)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if weights_dtype is not None:
        weights = weights.to(weights_dtype)
    return weights, ids.to(torch.int32)


def grouped_topk(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    num_expert_group: int,
    topk_group: int,
    e_score_correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    scoring_func: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's grouped top-k (vLLM's ``grouped_topk``; transformers' ``DeepseekV3TopkRouter``).

    In fp32: scores ``sigmoid(logits)`` (``scoring_func="softmax"``: a softmax over E); choice
    scores ``scores + e_score_correction_bias``; the E experts split into ``num_expert_group``
    groups of ``E / num_expert_group``, each group scored by the sum of its two largest choice
    scores; the ``topk_group`` best groups kept (the other experts' choice scores set to -inf);
    the ``top_k`` experts of the largest choice scores chosen (``torch.topk(sorted=False)``, as
    transformers calls it); their weights the *uncorrected* scores, with ``renormalize`` divided by
    ``sum + 1e-20``, then multiplied by ``routed_scaling_factor``. The correction bias only
    chooses experts; it never weighs them.

    Args:
        router_logits: ``[M, E]`` router outputs; computed in fp32 (DeepSeek-V3's router is fp32).
        top_k: experts per token.
        renormalize: ``norm_topk_prob``.
        num_expert_group: ``n_group``, dividing E.
        topk_group: groups kept per token, ``1 <= topk_group <= num_expert_group``, with
            ``topk_group * E / num_expert_group >= top_k``.
        e_score_correction_bias: fp32 ``[E]`` or None (zero).
        routed_scaling_factor: multiplies the weights (DeepSeek-V3: 2.5).
        scoring_func: ``"sigmoid"`` (DeepSeek-V3) or ``"softmax"`` (DeepSeek-V2).

    Returns:
        ``(topk_weights [M, k] fp32, topk_ids [M, k] int32)`` in ``torch.topk(sorted=False)``'s order.

    Raises:
        ValueError: any argument outside the ranges above, naming it.
    """
    num_experts = _check_logits(router_logits, top_k)
    if scoring_func not in ("sigmoid", "softmax"):
        raise ValueError(f"scoring_func: expected 'sigmoid' or 'softmax', got {scoring_func!r}")
    if not isinstance(num_expert_group, int) or num_expert_group < 1 or num_experts % num_expert_group:
        raise ValueError(f"num_expert_group: expected a positive divisor of E={num_experts}, got {num_expert_group!r}")
    per_group = num_experts // num_expert_group
    if not isinstance(topk_group, int) or not 1 <= topk_group <= num_expert_group or topk_group * per_group < top_k:
        raise ValueError(
            f"topk_group: expected an integer in [1, {num_expert_group}] keeping at least top_k={top_k} experts "
            f"({per_group} per group), got {topk_group!r}"
        )
    if per_group < 2:
        raise ValueError(f"num_expert_group: groups of {per_group} expert; a group is scored by its two largest")
    if e_score_correction_bias is not None and tuple(e_score_correction_bias.shape) != (num_experts,):
        raise ValueError(
            f"e_score_correction_bias: expected shape [{num_experts}], got {list(e_score_correction_bias.shape)}"
        )
    logits = router_logits.float()
    scores = logits.sigmoid() if scoring_func == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
    group_scores = choice.view(-1, num_expert_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, num_expert_group, per_group).reshape(-1, num_experts)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * routed_scaling_factor
    return weights, ids.to(torch.int32)


def topk_softmax(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's routing (transformers' ``GptOssTopKRouter``): ``torch.topk`` of the logits (the
    router's linear layer has a bias, already in ``router_logits``), then a softmax over the k
    chosen logits, in the logits' dtype.

    Mathematically the renormalized softmax top-k; in floating point a different rounding (the
    softmax runs over k values only, in the logits' dtype).

    Returns:
        ``(topk_weights [M, k] router_logits.dtype, topk_ids [M, k] int32)``, descending.

    Raises:
        ValueError: logits not 2D, ``top_k`` outside ``[1, E]``.
    """
    _check_logits(router_logits, top_k)
    values, ids = torch.topk(router_logits, top_k, dim=-1)
    return torch.softmax(values, dim=1, dtype=values.dtype), ids.to(torch.int32)
