"""Calibration: per layer and expert, the amax of the w13 input (a1) and w2 input (a2).

ModelOpt and Quark calibrate static activation scales from the largest absolute
value each Linear sees over a calibration set; in a MoE, each expert's gate/up
projections see only the tokens routed to that expert (a1), and its down
projection sees their SiLU-and-mul output (a2). ``calibrate`` runs the bf16 model
on token ids with every experts module replaced by a recording twin that runs
the reference MoE, and returns those maxima (and, if asked, the activations).

Decode scales derived from them (``Calibration.input_scales``):
NVFP4 ``amax / (6 * 448)``; static FP8 ``amax / 448``. An expert that received no
calibration token has amax 0 and input scale 0 ("never calibrated").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from ..formats import BlockScheme, PerTensorScheme, get_activation_format
from ..moe.activations import SILU
from ..moe.reference_moe import torch_moe
from .families import check_supported_model, family_of
from .moe_models import expert_activation, expert_biases, expert_weights, moe_blocks

__all__ = ["LayerCalibration", "Calibration", "calibrate", "recording_experts"]

logger = logging.getLogger(__name__)


@dataclass
class LayerCalibration:
    """One layer's statistics. ``a1_amax``, ``a2_amax``, ``tokens``: fp32/int64 ``[E]``.

    With ``keep_activations``: ``a1 [T, H]`` (layer input), ``topk_ids`` / ``topk_weights``
    ``[T, k]``, ``a2 [T * k, I]`` (row ``t * k + j`` is the SiLU-and-mul output of token ``t``
    in its ``j``-th expert).
    """

    a1_amax: torch.Tensor
    a2_amax: torch.Tensor
    tokens: torch.Tensor
    a1: torch.Tensor | None = None
    a2: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    topk_weights: torch.Tensor | None = None


@dataclass
class Calibration:
    """Per MoE layer statistics (``layers``, in layer order) over ``num_tokens`` calibration tokens.

    ``layer_indices``: the decoder layer of each entry of ``layers`` (a family with dense MLP layers,
    DeepSeek-V3's first ``first_k_dense_replace``, has fewer MoE layers than decoder layers); None
    means ``layers[i]`` is decoder layer ``i`` (every layer an MoE layer).
    """

    layers: list[LayerCalibration] = field(default_factory=list)
    num_tokens: int = 0
    layer_indices: list[int] | None = None

    def layer(self, layer: int) -> LayerCalibration:
        """The statistics of decoder layer ``layer``.

        Raises:
            ValueError: ``layer`` is not a calibrated MoE layer.
        """
        if self.layer_indices is None:
            if not 0 <= layer < len(self.layers):
                raise ValueError(f"layer: expected a calibrated layer in [0, {len(self.layers)}), got {layer!r}")
            return self.layers[layer]
        if layer not in self.layer_indices:
            raise ValueError(f"layer: expected a calibrated MoE layer of {self.layer_indices}, got {layer!r}")
        return self.layers[self.layer_indices.index(layer)]

    def input_scales(
        self, layer: int, activation: BlockScheme | PerTensorScheme | str = "nvfp4"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w13_input_scale [E], w2_input_scale [E])`` decode scales of decoder layer ``layer`` for an
        activation format with a static scale: NVFP4 (``amax / 2688``) or per-tensor FP8 (``amax / 448``;
        name ``fp8``)."""
        fmt = get_activation_format(activation)
        if fmt is None or not fmt.static_scale:
            raise ValueError(f"activation: {fmt} has no static input scale")
        lc = self.layer(layer) if self.layer_indices is not None else self.layers[layer]
        return lc.a1_amax / fmt.scale_divisor, lc.a2_amax / fmt.scale_divisor


class _RecordingExperts(torch.nn.Module):
    def __init__(self, w13, w2, num_experts, keep, bar=None, activation=SILU, biases=None):
        super().__init__()
        self.w13, self.w2, self.keep, self.bar = w13, w2, keep, bar
        self.activation, (self.w13_bias, self.w2_bias) = activation, biases or (None, None)
        self.a1_amax = torch.zeros(num_experts)
        self.a2_amax = torch.zeros(num_experts)
        self.tokens = torch.zeros(num_experts, dtype=torch.int64)
        self.kept: dict[str, list] = {"a1": [], "a2": [], "topk_ids": [], "topk_weights": []}

    def forward(self, hidden_states, top_k_index, top_k_weights):
        k = top_k_index.shape[1]
        flat = top_k_index.reshape(-1).long().cpu()
        row_amax = hidden_states.detach().abs().amax(-1).float().cpu().repeat_interleave(k)
        self.a1_amax.scatter_reduce_(0, flat, row_amax, reduce="amax")
        self.tokens.scatter_add_(0, flat, torch.ones_like(flat))
        a2_rows = torch.empty(flat.numel(), self.w2.shape[-1], dtype=hidden_states.dtype)

        def record(act, row_experts):
            amax = act.detach().abs().amax(-1).float().cpu()
            self.a2_amax.scatter_reduce_(0, row_experts.long().cpu(), amax, reduce="amax")
            if self.keep:
                # act rows are this expert's pairs in ascending flat order
                pairs = (flat == int(row_experts[0])).nonzero().squeeze(1)
                a2_rows[pairs] = act.detach().cpu()
            return act

        out = torch_moe(
            hidden_states,
            self.w13,
            self.w2,
            top_k_weights.float(),
            top_k_index,
            record,
            activation=self.activation,
            w13_bias=self.w13_bias,
            w2_bias=self.w2_bias,
        )
        if self.keep:
            self.kept["a1"].append(hidden_states.detach().cpu())
            self.kept["a2"].append(a2_rows)
            self.kept["topk_ids"].append(top_k_index.detach().cpu().to(torch.int32))
            self.kept["topk_weights"].append(top_k_weights.detach().float().cpu())
        if self.bar is not None:
            self.bar.update()
        return out

    def statistics(self) -> LayerCalibration:
        """What this twin recorded, as ``calibrate`` returns it for its layer."""
        kept = {k: (torch.cat(v) if v else None) for k, v in self.kept.items()}
        return LayerCalibration(self.a1_amax, self.a2_amax, self.tokens, **kept)


def recording_experts(model, layer: int, keep_activations: bool = False, bar=None) -> torch.nn.Module:
    """The recording twin ``calibrate`` swaps in for decoder layer ``layer``'s experts: it runs the reference
    MoE on the layer's bf16 experts (``expert_weights``, with the family's activation and expert biases) and
    records per-expert a1 / a2 amax and token counts; ``.statistics()`` gives its ``LayerCalibration``.
    Swapping it in and out is the caller's (``setattr(block, family.experts_attr, twin)``); the streaming
    quantizer (``mxlib.models.checkpoints.streaming``) calibrates one loaded layer at a time with it.

    Raises:
        ValueError: ``layer`` is not an MoE layer.
        UnsupportedModelError: a model of a family mxlib does not quantize.
    """
    family = family_of(model, "recording_experts")
    w13, w2 = expert_weights(model, layer)
    act, biases = expert_activation(model), expert_biases(model, layer)  # gpt-oss: SWIGLUOAI and biases
    return _RecordingExperts(w13, w2, family.num_experts(model.config), keep_activations, bar, act, biases)


@torch.no_grad()
def calibrate(
    model, token_ids: torch.Tensor, keep_activations: bool = False, batch_size: int = 8, progress: bool = False
) -> Calibration:
    """Record per-expert amax of a1 and a2 in every MoE layer over ``token_ids [B, T]``.

    The model (any registered family, ``mxlib.models.families``) must hold its bf16 experts
    (transformers' ``Qwen3MoeExperts``, ``MixtralExperts``, ...); they are
    swapped for recording twins during the run and restored afterwards. ``progress``: a tqdm bar
    on stderr, one step per MoE layer of each batch of ``batch_size`` sequences.

    Raises:
        UnsupportedModelError: a model of a class mxlib does not quantize (``mxlib.models.families``).
        ValueError: ``token_ids`` not ``[batch, seq]``.
    """
    check_supported_model(model, "calibrate")
    if token_ids.ndim != 2:
        raise ValueError(f"token_ids: expected [batch, seq], got shape {list(token_ids.shape)}")
    family = family_of(model, "calibrate")
    blocks = moe_blocks(model, "calibrate")
    layers = [mlp for _, mlp in blocks]
    attr = family.experts_attr
    originals = [getattr(mlp, attr) for mlp in layers]
    batches = range(0, token_ids.shape[0], batch_size)
    logger.info("calibrating %d MoE layers on %d token ids %s", len(layers), token_ids.numel(), list(token_ids.shape))
    bar = tqdm(total=len(batches) * len(layers), desc="calibrating", unit="layer", disable=not progress)
    recorders = []
    for i, mlp in blocks:
        rec = recording_experts(model, i, keep_activations, bar)
        recorders.append(rec)
        setattr(mlp, attr, rec)
    try:
        dev = next(model.parameters()).device
        for b in batches:
            model(input_ids=token_ids[b : b + batch_size].to(dev), use_cache=False)
    finally:
        bar.close()
        for mlp, orig in zip(layers, originals):
            setattr(mlp, attr, orig)
    indices = [i for i, _ in blocks]
    out = Calibration(
        num_tokens=token_ids.numel(), layer_indices=None if indices == list(range(len(indices))) else indices
    )
    out.layers.extend(rec.statistics() for rec in recorders)
    return out
