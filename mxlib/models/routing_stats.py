"""Per-layer routing statistics of a transformers MoE model (any registered family) on a token batch.

``routing_statistics`` runs the model once on token ids with a forward hook on every
router (``layer.mlp.gate``, the family's ``router_attr``), reads which experts each token was sent to, and summarizes
each layer: how many experts received any token, the largest and smallest expert's share
of the ``T * k`` assignments, the entropy of the expert-load distribution, and the tokens
per expert. The model is not changed (hooks are removed afterwards), whichever experts
implementation it runs (transformers' own or mxlib's ``TransformersExperts``).

A perfectly balanced layer has every share equal to ``1 / E`` and normalized entropy 1;
a layer that sends every token to the same ``k`` experts has entropy ``log k``.
``routing_figure`` draws the per-layer numbers with plotly.
"""

from __future__ import annotations

import math

import torch

from .families import check_supported_model, family_of
from .moe_models import moe_blocks

__all__ = ["routing_statistics", "summarize_counts", "routing_rows", "routing_figure"]


def _topk_ids(router, output, top_k: int) -> torch.Tensor:
    """``topk_ids [T, k]`` from a router's forward output.

    transformers 5 routers return ``(router_logits, topk_weights, topk_ids)``; a plain
    ``nn.Linear`` gate (older transformers) returns the logits, routed here as Qwen3 does:
    fp32 softmax, then top-k.
    """
    if isinstance(output, (tuple, list)):
        if len(output) >= 3:
            return output[2]
        output = output[0]
    probs = torch.softmax(output.float(), dim=-1)
    return torch.topk(probs, top_k, dim=-1).indices


@torch.no_grad()
def routing_statistics(model, token_ids: torch.Tensor) -> list[dict]:
    """Run ``model`` on ``token_ids`` and summarize each MoE layer's routing.

    Args:
        model: a transformers model of a registered family (``mxlib.models.families``), its
            MoE layers' ``model.model.layers[i].mlp.gate`` routers hooked.
        token_ids: int64 ``[batch, seq]`` or ``[seq]`` token ids (moved to the model's device).

    Returns:
        One dict per MoE layer, in layer order, with keys:
        ``layer`` (int, the decoder layer); ``num_experts`` E; ``top_k`` k; ``assignments`` ``T * k`` (int);
        ``experts_hit`` (experts that received at least one token); ``max_share`` and
        ``min_share`` (largest and smallest expert's fraction of the assignments);
        ``uniform_share`` ``1 / E``; ``max_over_uniform`` ``max_share * E``;
        ``entropy`` (nats, of the expert-load distribution); ``normalized_entropy``
        (``entropy / log E``, 1 when perfectly balanced); ``tokens_per_expert``
        (int64 ``[E]``, CPU).

    Raises:
        ValueError: ``token_ids`` is not an integer tensor of 1 or 2 dimensions, or the
            model has no MoE layers.
        UnsupportedModelError: a model of a class mxlib does not quantize (``mxlib.models.families``).
    """
    check_supported_model(model, "routing_statistics")
    if not isinstance(token_ids, torch.Tensor):
        raise ValueError(f"token_ids must be an integer tensor [batch, seq] or [seq], got {type(token_ids).__name__}")
    if token_ids.dtype.is_floating_point or token_ids.dtype.is_complex or token_ids.dim() not in (1, 2):
        raise ValueError(
            "token_ids must be an integer tensor [batch, seq] or [seq], "
            f"got {token_ids.dtype} of shape {list(token_ids.shape)}"
        )
    if token_ids.dim() == 1:
        token_ids = token_ids[None]
    family = family_of(model, "routing_statistics")
    blocks = moe_blocks(model, "routing_statistics")
    layers = [mlp for _, mlp in blocks]
    if not layers:
        raise ValueError("model has no MoE layers (model.model.layers is empty)")
    num_experts = family.num_experts(model.config)
    top_k = family.top_k(model.config)
    counts: dict[int, torch.Tensor] = {}

    def hook_for(i):
        def hook(module, args, output):
            ids = _topk_ids(module, output, top_k).reshape(-1).long().cpu()
            c = torch.bincount(ids, minlength=num_experts)
            counts[i] = counts[i] + c if i in counts else c

        return hook

    handles = [getattr(mlp, family.router_attr).register_forward_hook(hook_for(i)) for i, mlp in enumerate(layers)]
    try:
        device = next(model.parameters()).device
        model.model(input_ids=token_ids.to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()

    stats = summarize_counts([counts[i] for i in range(len(layers))], top_k)
    for row, (index, _) in zip(stats, blocks):
        row["layer"] = index
    return stats


def summarize_counts(tokens_per_expert: list[torch.Tensor], top_k: int) -> list[dict]:
    """The statistics of ``routing_statistics`` from per-layer expert counts.

    ``tokens_per_expert``: one integer ``[E]`` tensor per layer, the number of (token, slot)
    assignments each expert received, for example ``[lc.tokens for lc in calibration.layers]``
    of a ``mxlib.models.calibration.Calibration`` (no second forward pass needed).

    Raises:
        ValueError: a layer's counts are not a 1-D integer tensor with a positive sum.
    """
    stats = []
    for i, c in enumerate(tokens_per_expert):
        if c.dim() != 1 or c.dtype.is_floating_point or int(c.sum()) <= 0:
            raise ValueError(
                f"tokens_per_expert[{i}] must be a 1-D integer tensor with a positive sum, "
                f"got {c.dtype} of shape {list(c.shape)}"
            )
        c = c.detach().long().cpu()
        num_experts = c.numel()
        total = int(c.sum())
        share = c.double() / total
        nz = share[share > 0]
        entropy = float(-(nz * nz.log()).sum())
        stats.append(
            dict(
                layer=i,
                num_experts=num_experts,
                top_k=top_k,
                assignments=total,
                experts_hit=int((c > 0).sum()),
                max_share=float(share.max()),
                min_share=float(share.min()),
                uniform_share=1.0 / num_experts,
                max_over_uniform=float(share.max()) * num_experts,
                entropy=entropy,
                normalized_entropy=entropy / math.log(num_experts),
                tokens_per_expert=c,
            )
        )
    return stats


def routing_rows(stats: list[dict]) -> list[dict]:
    """``routing_statistics`` output as flat table rows (no ``tokens_per_expert``; shares
    rounded to 4 significant digits), for ``mxlib.workbook.figures.table`` or a DataFrame."""
    keys = ("layer", "experts_hit", "max_share", "min_share", "max_over_uniform", "normalized_entropy")
    return [{k: (float(f"{s[k]:.4g}") if isinstance(s[k], float) else s[k]) for k in keys} for s in stats]


def routing_figure(stats: list[dict], title: str = "Routing per layer"):
    """A plotly figure of ``routing_statistics`` output: tokens per expert (layer x expert
    heatmap, left) and, per layer, the fraction of experts hit, the normalized entropy and the
    largest share over the uniform share (right)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    layers = [s["layer"] for s in stats]
    fig = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.6, 0.4],
        subplot_titles=("tokens per expert", "balance per layer"),
    )
    z = torch.stack([s["tokens_per_expert"] for s in stats]).numpy()
    fig.add_trace(
        go.Heatmap(
            z=z, x=list(range(z.shape[1])), y=layers, colorscale="Viridis", colorbar=dict(x=0.55, title="tokens")
        ),
        row=1,
        col=1,
    )
    series = {
        "experts hit / E": [s["experts_hit"] / s["num_experts"] for s in stats],
        "normalized entropy": [s["normalized_entropy"] for s in stats],
        "max share / uniform": [s["max_over_uniform"] for s in stats],
    }
    for name, ys in series.items():
        fig.add_trace(go.Scatter(x=layers, y=ys, mode="lines+markers", name=name), row=1, col=2)
    fig.update_xaxes(title_text="expert", row=1, col=1)
    fig.update_yaxes(title_text="layer", row=1, col=1)
    fig.update_xaxes(title_text="layer", row=1, col=2)
    fig.update_layout(title=title, height=380)
    return fig
