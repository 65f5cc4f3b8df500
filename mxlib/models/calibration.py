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
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from ..formats import BlockScheme, PerTensorScheme, get_activation_format
from ..moe.activations import SILU
from ..moe.reference_moe import torch_moe
from .families import check_supported_model, family_of
from .moe_models import expert_activation, expert_biases, expert_weights, moe_blocks

__all__ = [
    "LayerCalibration",
    "Calibration",
    "calibrate",
    "calibration_batches",
    "num_calibration_batches",
    "recording_experts",
]

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


Batch = tuple[torch.Tensor, "torch.Tensor | None"]


def _one_batch(batch, where: str) -> Batch:
    if isinstance(batch, torch.Tensor):
        ids, mask = batch, None
    elif isinstance(batch, Mapping):
        if "input_ids" not in batch:
            raise ValueError(
                f"{where}: a batch dict needs 'input_ids' (and optionally 'attention_mask'), got {list(batch)}"
            )
        ids, mask = batch["input_ids"], batch.get("attention_mask")
    else:
        raise TypeError(
            f"{where}: expected a token-id tensor [batch, seq], a dict with input_ids / attention_mask, or an iterable "
            f"of them (a list, a DataLoader), got a batch of type {type(batch).__name__}"
        )
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.is_floating_point() or ids.dtype == torch.bool:
        got = f"{ids.dtype} {list(ids.shape)}" if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"{where}: input_ids: expected an integer tensor [batch, seq], got {got}")
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(ids.shape):
            got = list(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(f"{where}: attention_mask: expected the shape of input_ids {list(ids.shape)}, got {got}")
        if mask.is_floating_point() and not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError(f"{where}: attention_mask: expected 0 / 1 values (1 = a real token)")
    return ids, mask


def calibration_batches(calibration, batch_size: int = 8, where: str = "calibration") -> Iterator[Batch]:
    """``(input_ids [B, T], attention_mask [B, T] or None)`` batches of a calibration set given as a token-id tensor
    ``[N, T]`` (cut into ``batch_size`` rows), a dict with ``input_ids`` / ``attention_mask`` (cut likewise), or an
    iterable of tensors or such dicts (a list, a ``torch.utils.data.DataLoader``; each item one batch as given).

    Raises:
        ValueError / TypeError: naming ``where``: a batch that is neither; ids that are not an integer ``[batch,
        seq]`` tensor; a mask of another shape or with values other than 0 and 1.
    """
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size: expected a positive integer, got {batch_size!r}")
    if isinstance(calibration, (torch.Tensor, Mapping)):
        ids, mask = _one_batch(calibration, where)
        for b in range(0, ids.shape[0], batch_size):
            yield ids[b : b + batch_size], None if mask is None else mask[b : b + batch_size]
        return
    if isinstance(calibration, (str, bytes)) or not isinstance(calibration, Iterable):
        raise TypeError(
            f"{where}: expected a token-id tensor, a dict with input_ids / attention_mask or an iterable of batches, "
            f"got {type(calibration).__name__}"
        )
    for batch in calibration:
        yield _one_batch(batch, where)


def num_calibration_batches(calibration, batch_size: int = 8) -> int | None:
    """How many batches ``calibration_batches`` yields, where that is known without iterating (None otherwise)."""
    if isinstance(calibration, torch.Tensor):
        return -(-calibration.shape[0] // batch_size) if calibration.ndim == 2 else None
    if isinstance(calibration, Mapping):
        ids = calibration.get("input_ids")
        return -(-ids.shape[0] // batch_size) if isinstance(ids, torch.Tensor) and ids.ndim == 2 else None
    try:
        return len(calibration)
    except TypeError:
        return None


def run_calibration_forward(model, ids: torch.Tensor, mask: torch.Tensor | None, recorders) -> int:
    """One calibration forward of ``model`` on a batch; each recorder's ``row_mask`` is the flattened mask (the
    rows transformers' MoE blocks see, batch-major) during it. Returns the number of real tokens."""
    dev = next(model.parameters()).device
    flat = None if mask is None else mask.reshape(-1).bool()
    for rec in recorders:
        rec.row_mask = flat
    try:
        kw = {} if mask is None else {"attention_mask": mask.to(dev)}
        model(input_ids=ids.to(dev), use_cache=False, **kw)
    finally:
        for rec in recorders:
            rec.row_mask = None
    return ids.numel() if flat is None else int(flat.sum())


class _RecordingExperts(torch.nn.Module):
    def __init__(self, w13, w2, num_experts, keep, bar=None, activation=SILU, biases=None):
        super().__init__()
        self.w13, self.w2, self.keep, self.bar = w13, w2, keep, bar
        self.row_mask = None  # bool [M]: the rows that are real tokens (run_calibration_forward), None: all
        self.activation, (self.w13_bias, self.w2_bias) = activation, biases or (None, None)
        self.a1_amax = torch.zeros(num_experts)
        self.a2_amax = torch.zeros(num_experts)
        self.tokens = torch.zeros(num_experts, dtype=torch.int64)
        self.kept: dict[str, list] = {"a1": [], "a2": [], "topk_ids": [], "topk_weights": []}

    def forward(self, hidden_states, top_k_index, top_k_weights):
        k = top_k_index.shape[1]
        flat = top_k_index.reshape(-1).long().cpu()
        real = None if self.row_mask is None else self.row_mask.cpu().repeat_interleave(k)  # per (token, expert) pair
        row_amax = hidden_states.detach().abs().amax(-1).float().cpu().repeat_interleave(k)
        if real is None:
            self.a1_amax.scatter_reduce_(0, flat, row_amax, reduce="amax")
            self.tokens.scatter_add_(0, flat, torch.ones_like(flat))
        else:  # padded tokens take no part in the statistics
            self.a1_amax.scatter_reduce_(0, flat[real], row_amax[real], reduce="amax")
            self.tokens.scatter_add_(0, flat[real], torch.ones_like(flat[real]))
        a2_rows = torch.empty(flat.numel(), self.w2.shape[-1], dtype=hidden_states.dtype)

        def record(act, row_experts):
            amax = act.detach().abs().amax(-1).float().cpu()
            # act rows are this expert's pairs in ascending flat order
            pairs = (flat == int(row_experts[0])).nonzero().squeeze(1)
            keep = slice(None) if real is None else real[pairs]
            self.a2_amax.scatter_reduce_(0, row_experts.long().cpu()[keep], amax[keep], reduce="amax")
            if self.keep:
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
            tok = slice(None) if self.row_mask is None else self.row_mask.cpu()
            pair = slice(None) if real is None else real
            self.kept["a1"].append(hidden_states.detach().cpu()[tok])
            self.kept["a2"].append(a2_rows[pair])
            self.kept["topk_ids"].append(top_k_index.detach().cpu().to(torch.int32)[tok])
            self.kept["topk_weights"].append(top_k_weights.detach().float().cpu()[tok])
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
    quantizer (``mxlib.checkpoints.streaming``) calibrates one loaded layer at a time with it.

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
    model,
    token_ids,
    keep_activations: bool = False,
    batch_size: int = 8,
    progress: bool = False,
    *,
    name: str = "token_ids",
) -> Calibration:
    """Record per-expert amax of a1 and a2 in every MoE layer over a calibration set.

    ``token_ids``: an integer tensor ``[B, T]`` (run ``batch_size`` sequences at a time), a dict with
    ``input_ids`` and ``attention_mask`` (cut likewise), or an iterable of either (a list of batches, a
    ``torch.utils.data.DataLoader``: each item one forward, ``calibration_batches``). Where an ``attention_mask``
    is given, the model runs with it and its padded tokens (mask 0) take no part in the amax, the token counts or
    the kept activations.

    The model (any registered family, ``mxlib.models.families``) must hold its bf16 experts
    (transformers' ``Qwen3MoeExperts``, ``MixtralExperts``, ...); they are
    swapped for recording twins during the run and restored afterwards. ``progress``: a tqdm bar
    on stderr, one step per MoE layer of each batch. ``name``: the argument an error names (``quantize_`` passes
    ``calibration``).

    Returns:
        The ``Calibration``: per MoE layer, fp32 ``a1_amax`` / ``a2_amax`` ``[E]`` and int64 ``tokens`` ``[E]``;
        ``num_tokens`` counts the real (unmasked) tokens.

    Raises:
        UnsupportedModelError: a model of a class mxlib does not quantize (``mxlib.models.families``).
        ValueError, TypeError: a batch that is not ``[batch, seq]`` integer ids, or a mask of another shape
            (``calibration_batches``).
    """
    check_supported_model(model, "calibrate")
    if isinstance(token_ids, torch.Tensor) and token_ids.ndim != 2:
        raise ValueError(f"{name}: expected [batch, seq], got shape {list(token_ids.shape)}")
    family = family_of(model, "calibrate")
    blocks = moe_blocks(model, "calibrate")
    layers = [mlp for _, mlp in blocks]
    attr = family.experts_attr
    originals = [getattr(mlp, attr) for mlp in layers]
    count = num_calibration_batches(token_ids, batch_size)
    if isinstance(token_ids, torch.Tensor):
        logger.info("calibrating %d MoE layers on %d token ids", len(layers), token_ids.numel())
    else:
        logger.info("calibrating %d MoE layers on %s batches", len(layers), count if count is not None else "the")
    total = None if count is None else count * len(layers)
    bar = tqdm(total=total, desc="calibrating", unit="layer", disable=not progress)
    recorders = []
    for i, mlp in blocks:
        rec = recording_experts(model, i, keep_activations, bar)
        recorders.append(rec)
        setattr(mlp, attr, rec)
    num_tokens = 0
    try:
        for ids, mask in calibration_batches(token_ids, batch_size, name):
            num_tokens += run_calibration_forward(model, ids, mask, recorders)
    finally:
        bar.close()
        for mlp, orig in zip(layers, originals):
            setattr(mlp, attr, orig)
    indices = [i for i, _ in blocks]
    out = Calibration(num_tokens=num_tokens, layer_indices=None if indices == list(range(len(indices))) else indices)
    out.layers.extend(rec.statistics() for rec in recorders)
    return out
