"""Per-expert Hessians of the layer-wise reconstruction loss: the sums of ``x xᵀ`` over the routed tokens.

GPTQ (Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers", ICLR 2023, section 3) chooses each linear layer's codes to minimize
``||X Wᵀ - X Ŵᵀ||²`` over a calibration set; the Hessian of that loss in one weight row is
``2 X Xᵀ``, the same for every row. In a MoE each expert is its own pair of linear layers and sees
only the tokens routed to it, so the Hessians are per expert:

* w13 (gate and up, ``[2I, H]``): ``sum_t x_t x_tᵀ`` ``[H, H]`` over the tokens ``t`` routed to the
  expert, ``x_t`` the hidden states entering the MoE block (bf16, widened exactly to fp32);
* w2 (down, ``[H, I]``): ``sum_t a_t a_tᵀ`` ``[I, I]``, ``a_t = silu(gate x_t) * (up x_t)`` computed
  from the bf16 weights at the bf16 model's rounding points (``mxlib.moe.reference_moe.torch_moe``:
  GEMM1 rounded to bf16, SiLU-and-mul in fp32 rounded to bf16).

The factor 2 is left out (GPTQ's rounding does not depend on the Hessian's scale). Sums are fp32,
accumulated batch by batch (``X_bᵀ X_b`` of each batch's routed rows added in fp32); memory is
``E * (H² + I²) * 4`` bytes per layer (Qwen3-30B-A3B: 2.3 GiB a layer), so ``layers`` can restrict
the collection.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from ..moe.base import TransformersExperts
from ..moe.reference_moe import torch_moe
from .calibration import calibration_batches, num_calibration_batches, run_calibration_forward
from .families import family_of
from .moe_models import expert_weights, moe_blocks

__all__ = [
    "LayerHessians",
    "ExpertHessians",
    "collect_expert_hessians",
    "technique_needs_hessians",
    "technique_from_calibration",
]

logger = logging.getLogger(__name__)


@dataclass
class LayerHessians:
    """One layer's sums: ``h13`` fp32 ``[E, H, H]``, ``h2`` fp32 ``[E, I, I]``, ``tokens`` int64 ``[E]``."""

    h13: torch.Tensor
    h2: torch.Tensor
    tokens: torch.Tensor


@dataclass
class ExpertHessians:
    """Per layer and expert, the sums of ``x xᵀ`` over the calibration tokens routed to the expert.

    ``layers`` maps a decoder layer index to its ``LayerHessians``; ``num_tokens`` is the number of
    calibration token ids the model ran. The accessors raise ``ValueError`` naming the collected
    layers for a layer that was not collected.
    """

    layers: dict[int, LayerHessians] = field(default_factory=dict)
    num_tokens: int = 0

    def _layer(self, layer: int) -> LayerHessians:
        if layer not in self.layers:
            raise ValueError(f"layer: no Hessians collected for layer {layer}; collected layers {sorted(self.layers)}")
        return self.layers[layer]

    def w13(self, layer: int) -> torch.Tensor:
        """fp32 ``[E, H, H]``: ``sum x xᵀ`` of the hidden states routed to each expert (w13's input)."""
        return self._layer(layer).h13

    def w2(self, layer: int) -> torch.Tensor:
        """fp32 ``[E, I, I]``: ``sum a aᵀ`` of each expert's SiLU-and-mul outputs (w2's input)."""
        return self._layer(layer).h2

    def tokens(self, layer: int) -> torch.Tensor:
        """int64 ``[E]``: calibration tokens routed to each expert (0: the expert's Hessians are zero)."""
        return self._layer(layer).tokens

    def diagonal(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(a1 [E, H], a2 [E, I])`` fp32: the Hessians' diagonals, ``sum x_h²`` per input channel
        (sums over the expert's tokens, not means: divide by ``tokens(layer)`` for the mean second moment)."""
        lh = self._layer(layer)
        return torch.diagonal(lh.h13, dim1=-2, dim2=-1).clone(), torch.diagonal(lh.h2, dim1=-2, dim2=-1).clone()


class _HessianExperts(torch.nn.Module):
    """Runs the bf16 reference MoE in place of transformers' experts; with ``collect``, adds each
    expert's ``x xᵀ`` (every layer runs the reference MoE, so a layer's input does not depend on
    which layers are collected)."""

    def __init__(self, w13, w2, num_experts, collect: bool, bar=None):
        super().__init__()
        self.w13, self.w2, self.collect, self.bar = w13, w2, collect, bar
        _, two_i, h = w13.shape
        n = num_experts if collect else 0
        self.h13 = torch.zeros(n, h, h, dtype=torch.float32, device=w13.device)
        self.h2 = torch.zeros(n, two_i // 2, two_i // 2, dtype=torch.float32, device=w13.device)
        self.tokens = torch.zeros(n, dtype=torch.int64)
        self.row_mask = None  # bool [M]: the rows that are real tokens (padding excluded), None: all

    def forward(self, hidden_states, top_k_index, top_k_weights):
        if not self.collect:
            return torch_moe(hidden_states, self.w13, self.w2, top_k_weights.float(), top_k_index)
        k = top_k_index.shape[1]
        flat = top_k_index.reshape(-1).long()
        real = None if self.row_mask is None else self.row_mask.to(flat.device).repeat_interleave(k)
        counted = flat if real is None else flat[real]
        self.tokens += torch.bincount(counted.cpu(), minlength=self.tokens.numel())
        for e in torch.unique(counted).tolist():
            pairs = (flat == e).nonzero().squeeze(1)
            if real is not None:
                pairs = pairs[real[pairs]]
            x = hidden_states[pairs // k].float()
            self.h13[e].addmm_(x.T, x)

        def record(act, row_experts):
            a = act.float()
            if real is not None:  # act rows are this expert's pairs in ascending flat order
                a = a[real[(flat == int(row_experts[0])).nonzero().squeeze(1)]]
            self.h2[int(row_experts[0])].addmm_(a.T, a)
            return act

        out = torch_moe(hidden_states, self.w13, self.w2, top_k_weights.float(), top_k_index, record)
        if self.bar is not None:
            self.bar.update()
        return out


@torch.no_grad()
def collect_expert_hessians(
    model,
    token_ids: torch.Tensor,
    batch_size: int = 8,
    layers: Sequence[int] | None = None,
    progress: bool = False,
    *,
    name: str = "token_ids",
) -> ExpertHessians:
    """Run the bf16 model on ``token_ids`` and sum, per MoE layer and expert, ``x xᵀ`` of w13's and w2's inputs.

    Every layer's experts are swapped for a twin that runs the bf16 reference MoE (``torch_moe``, as
    ``mxlib.models.calibration.calibrate`` does; the collected layers' twins record) and restored
    afterwards; the routing is the model's own (its router's ``top_k_index``).

    Args:
        model: a transformers model of a registered family (``mxlib.models.families``) holding its bf16
            experts (``Qwen3MoeExperts``, ``MixtralExperts``, ...).
        token_ids: int ``[B, T]`` calibration token ids, a dict with ``input_ids`` / ``attention_mask``, or an
            iterable of batches (``mxlib.models.calibration.calibration_batches``); padded tokens (mask 0) are left
            out of the sums and the counts.
        batch_size: sequences per forward.
        layers: decoder layer indices of MoE layers to collect (default: every MoE layer).
        progress: a tqdm bar on stderr, one step per collected layer of each batch.
        name: the argument an error names (``quantize_`` passes ``calibration``).

    Returns:
        ``ExpertHessians`` with fp32 sums on the model's device and int64 token counts on the CPU.

    Raises:
        ValueError: ``token_ids`` not a 2D integer tensor; ``batch_size`` not a positive integer; a
            layer index out of range; a model whose experts are already quantized (emulation experts).
    """
    if isinstance(token_ids, torch.Tensor) and (token_ids.ndim != 2 or token_ids.is_floating_point()):
        raise ValueError(f"{name}: expected an integer tensor [batch, seq], got {list(token_ids.shape)}")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size: expected a positive integer, got {batch_size!r}")
    family = family_of(model, "collect_expert_hessians")
    attr = family.experts_attr
    blocks = dict(moe_blocks(model, "collect_expert_hessians"))  # decoder layer index -> MoE block
    chosen = list(blocks) if layers is None else list(layers)
    bad = [i for i in chosen if isinstance(i, bool) or not isinstance(i, int) or i not in blocks]
    if bad:
        if list(blocks) == list(range(len(blocks))):
            raise ValueError(f"layers: expected indices in [0, {len(blocks)}), got {bad}")
        raise ValueError(f"layers: expected MoE layer indices of {list(blocks)}, got {bad}")
    quantized = [i for i, mlp in blocks.items() if isinstance(getattr(mlp, attr), TransformersExperts)]
    if quantized:
        raise ValueError(
            f"model: layers {quantized} hold emulation (quantized) experts; collect Hessians on the bf16 model"
        )
    num_experts = family.num_experts(model.config)
    count = num_calibration_batches(token_ids, batch_size)
    logger.info("collecting expert Hessians of %d layers", len(chosen))
    total = None if count is None else count * len(chosen)
    bar = tqdm(total=total, desc="expert Hessians", unit="layer", disable=not progress)
    originals = {i: getattr(mlp, attr) for i, mlp in blocks.items()}
    recorders = {}
    for i, mlp in blocks.items():
        w13, w2 = expert_weights(model, i)
        recorders[i] = _HessianExperts(w13, w2, num_experts, i in chosen, bar if i in chosen else None)
        setattr(mlp, attr, recorders[i])
    num_tokens = 0
    try:
        for ids, mask in calibration_batches(token_ids, batch_size, name):
            num_tokens += run_calibration_forward(model, ids, mask, list(recorders.values()))
    finally:
        bar.close()
        for i, orig in originals.items():
            setattr(blocks[i], attr, orig)
    out = ExpertHessians(num_tokens=num_tokens)
    for i in chosen:
        rec = recorders[i]
        out.layers[i] = LayerHessians(rec.h13, rec.h2, rec.tokens)
    return out


def technique_needs_hessians(technique) -> bool:
    """Whether a technique name asks for per-expert Hessians (GPTQ, alone or inside a rotation: ``gptq+hadamard``)."""
    return isinstance(technique, str) and technique.split("+")[0] == "gptq"


def technique_from_calibration(
    model, technique, calibration=None, batch_size: int = 8, progress: bool = False, where: str = "technique"
):
    """The ``WeightTechnique`` a name (or a built one) stands for, with GPTQ's Hessians collected from calibration.

    ``technique``: None (round-to-nearest: None is returned), a name of ``mxlib.recovery.TECHNIQUES`` or a
    composition (``"gptq+hadamard"``), or a built technique (returned as it is). A name that needs Hessians
    (``technique_needs_hessians``) gets them from ``collect_expert_hessians(model, calibration)``: ``calibration``
    is then token ids, a dict with ``input_ids`` / ``attention_mask`` or an iterable of batches.

    Raises:
        ValueError: naming ``where``: GPTQ without calibration batches (None, or a ``Calibration`` of amax only, which
            holds no Hessians), with what to pass instead; an unknown technique name (``get_technique``).
    """
    from ..recovery import get_technique

    if technique is None:
        return None
    if not technique_needs_hessians(technique):
        return get_technique(technique)
    if calibration is None or hasattr(calibration, "layers") and hasattr(calibration, "input_scales"):
        got = "none" if calibration is None else "a Calibration (per-expert amax, no Hessians)"
        raise ValueError(
            f"{where}: {technique!r} chooses codes from per-expert Hessians of calibration tokens; got {got}. Pass "
            f"calibration token ids / batches, or a built technique: "
            f"get_technique('gptq', hessians=collect_expert_hessians(model, token_ids))"
        )
    hessians = collect_expert_hessians(model, calibration, batch_size=batch_size, progress=progress, name="calibration")
    return get_technique(technique, hessians=hessians)
