"""Does a quantized model's router still pick the bf16 model's experts? Per MoE layer, on the same tokens.

Every MoE layer's router picks, for each token, a set of ``k`` experts (``topk_ids``). Quantizing the experts does
not touch the routers (they stay bf16 in every layout mxlib reads), but a layer's router reads the hidden state that
the earlier layers' experts wrote, so a quantized model can send a token to other experts from the second MoE layer
on. This module measures how often, against a reference run (the bf16 model) on the same tokens:

* **Jaccard index** of the two expert sets of a token, ``|A & B| / |A | B|``: 1 when the sets are equal, 0 when
  they share no expert; with ``k`` experts each and ``c`` in common, ``c / (2k - c)`` (top-2: 1, 1/3, 0);
* **changed**: whether the set differs at all (any member), the order of the ``k`` slots ignored.

Both are per token and per layer; a run's numbers are their means over the tokens. They are kept as sums per
*unit* (a sequence: one prompt of the trained model's tasks, one row of a token batch), with the unit's token
count, because tokens of one prompt are not independent: the statistics (``mxlib.stats``) replicate over units,
with the token counts as weights (``paired_units``' ratio mean, which equals the mean over tokens).

The pieces:

* ``record_routing(model, token_ids)``: run the model on token batches and keep every router's ``topk_ids``
  (``RoutedTokens``);
* ``recording_routing(model)``: the same record taken from whatever forward passes run inside a ``with`` block
  (for example ``mxlib.models.evaluation.evaluate``'s), with no forward pass of its own;
* ``routing_consistency(reference, other)``: the per-layer comparison of two records of the same tokens
  (``RoutingConsistency``); ``topk_overlap`` the per-token arithmetic on bare ``topk_ids`` tensors.

A noise floor for these numbers is the same bf16 model on another experts implementation (transformers' ``eager``
loop, or mxlib's ``TritonExperts`` on the bf16 weights): the expert outputs then differ by bf16 rounding, which can
move a near-tie between two experts in a later layer's router. ``mxlib.studies.routing_agreement``
measures it on the trained model beside every scheme.

Hooks are forward hooks on each MoE layer's router (the family's ``router_attr``, ``topk_ids`` read as
``mxlib.models.routing_stats`` does) and a forward pre-hook on ``model.model`` for the token ids; they are removed on
exit, and the model is not changed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .families import check_supported_model, family_of
from .moe_models import moe_blocks
from .routing_stats import _topk_ids

__all__ = [
    "RoutedTokens",
    "RoutingRecorder",
    "RoutingConsistency",
    "recording_routing",
    "record_routing",
    "topk_overlap",
    "routing_consistency",
]


# ----------------------------------------------------------------------------- records


@dataclass(frozen=True)
class RoutedTokens:
    """What one run's routers picked, token by token.

    ``T`` tokens (every position of every sequence run, in the order run), ``U`` units (the sequences), ``L`` MoE
    layers, ``k`` experts per token.

    Attributes:
        token_ids: int64 ``[T]``, the token id at each position (so that two records can be checked to hold the
            same tokens).
        unit: int64 ``[T]``, the unit (sequence) of each token, ``0 .. U-1``, non-decreasing.
        topk_ids: int64 ``[L, T, k]``, the expert ids each layer's router picked for each token (CPU).
        layers: the decoder layer index of each of the ``L`` MoE layers.
    """

    token_ids: torch.Tensor
    unit: torch.Tensor
    topk_ids: torch.Tensor
    layers: tuple[int, ...]

    @property
    def num_units(self) -> int:
        """``U``, the number of units (sequences)."""
        return int(self.unit[-1]) + 1 if self.unit.numel() else 0

    @property
    def top_k(self) -> int:
        """``k``, the experts per token."""
        return self.topk_ids.shape[-1]


class RoutingRecorder:
    """The forward hooks of ``recording_routing``; ``routed()`` gives what they recorded (``RoutedTokens``)."""

    def __init__(self, model) -> None:
        check_supported_model(model, "recording_routing")
        family = family_of(model, "recording_routing")
        blocks = moe_blocks(model, "recording_routing")
        if not blocks:
            raise ValueError("model: expected at least one MoE layer, got none")
        self.layers = tuple(i for i, _ in blocks)
        self._top_k = family.top_k(model.config)
        self._routers = [getattr(block, family.router_attr) for _, block in blocks]
        self._base = model.model
        self._calls: list[tuple[torch.Tensor, list[torch.Tensor | None]]] = []
        self._handles: list = []

    def _start(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            raise ValueError(
                "recording_routing: expected every forward pass to take input_ids (token ids), got one without "
                "(inputs_embeds cannot be matched token by token)"
            )
        self._calls.append((ids.detach().long().cpu(), [None] * len(self._routers)))

    def _router_hook(self, i: int):
        def hook(module, args, output) -> None:
            if not self._calls:
                raise RuntimeError(f"recording_routing: the router of layer {self.layers[i]} ran outside model.model")
            ids, per_layer = self._calls[-1]
            if per_layer[i] is not None:
                raise RuntimeError(
                    f"recording_routing: the router of layer {self.layers[i]} ran twice in one forward pass"
                )
            per_layer[i] = _topk_ids(module, output, self._top_k).detach().reshape(ids.numel(), -1).long().cpu()

        return hook

    def __enter__(self) -> RoutingRecorder:
        self._handles.append(self._base.register_forward_pre_hook(self._start, with_kwargs=True))
        self._handles += [r.register_forward_hook(self._router_hook(i)) for i, r in enumerate(self._routers)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def routed(self) -> RoutedTokens:
        """Every forward pass recorded so far, in the order run: each row of each batch one unit.

        Raises:
            ValueError: nothing was recorded, or a forward pass in which a router did not run (a pass stopped
                early).
        """
        if not self._calls:
            raise ValueError("recording_routing: expected at least one forward pass inside the block, got none")
        token_ids, unit, topk = [], [], []
        first_unit = 0
        for c, (ids, per_layer) in enumerate(self._calls):
            missing = [self.layers[i] for i, t in enumerate(per_layer) if t is None]
            if missing:
                raise ValueError(f"recording_routing: forward pass {c} ran no router in layers {missing}")
            rows = ids.reshape(ids.shape[0], -1) if ids.dim() > 1 else ids[None]
            token_ids.append(rows.reshape(-1))
            unit.append(torch.arange(rows.shape[0]).repeat_interleave(rows.shape[1]) + first_unit)
            first_unit += rows.shape[0]
            topk.append(torch.stack(per_layer))
        return RoutedTokens(torch.cat(token_ids), torch.cat(unit), torch.cat(topk, 1), self.layers)


@contextlib.contextmanager
def recording_routing(model) -> Iterator[RoutingRecorder]:
    """``with recording_routing(model) as rec: ...`` records every router's ``topk_ids`` in the forward passes run
    inside the block; ``rec.routed()`` returns them (``RoutedTokens``, every row of every batch one unit). Runs no
    forward pass of its own: wrapped around ``mxlib.models.evaluation.evaluate`` it records the evaluation's
    teacher-forced passes at no extra cost.

    Raises:
        ValueError: a model with no MoE layer; inside the block, a forward pass without ``input_ids``.
        RuntimeError: a router that runs twice in one forward pass, or outside ``model.model``.
        UnsupportedModelError: a model of a class mxlib does not quantize (``mxlib.models.families``).
    """
    rec = RoutingRecorder(model)
    with rec:
        yield rec


def _token_batches(token_ids) -> list[torch.Tensor]:
    items = list(token_ids) if isinstance(token_ids, (list, tuple)) else [token_ids]
    if not items:
        raise ValueError("token_ids: expected an integer tensor [batch, seq] or a list of them, got an empty list")
    out = []
    for j, t in enumerate(items):
        name = "token_ids" if not isinstance(token_ids, (list, tuple)) else f"token_ids[{j}]"
        if not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            got = f"{t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: expected an integer tensor [batch, seq] or [seq], got {got}")
        if t.dim() not in (1, 2) or t.numel() == 0:
            raise ValueError(f"{name}: expected a non-empty tensor [batch, seq] or [seq], got shape {list(t.shape)}")
        out.append(t[None] if t.dim() == 1 else t)
    return out


@torch.no_grad()
def record_routing(model, token_ids, batch_size: int | None = None) -> RoutedTokens:
    """Run ``model`` on ``token_ids`` and return every MoE layer's ``topk_ids`` (``RoutedTokens``).

    Args:
        model: a transformers MoE model of a registered family (``mxlib.models.families``), any experts swapped in.
        token_ids: int ``[batch, seq]`` (or ``[seq]``), or a list of such tensors (sequences of different lengths,
            e.g. one per task); each row is one unit. Moved to the model's device; not changed.
        batch_size: rows per forward pass (None: each tensor in one pass). The same batches as another run's keep
            batch composition out of a comparison.

    Returns:
        ``RoutedTokens`` with the rows in the order given.

    Raises:
        ValueError: ``token_ids`` not integer tensors of 1 or 2 dimensions (or empty), ``batch_size`` not a positive
            int, a model with no MoE layer.
        UnsupportedModelError: a model of a class mxlib does not quantize.
    """
    batches = _token_batches(token_ids)
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0):
        raise ValueError(f"batch_size: expected a positive int or None, got {batch_size!r}")
    device = next(model.parameters()).device
    with recording_routing(model) as rec:
        for t in batches:
            step = batch_size or t.shape[0]
            for start in range(0, t.shape[0], step):
                model.model(input_ids=t[start : start + step].to(device), use_cache=False)
    return rec.routed()


# ----------------------------------------------------------------------------- comparison


def _check_topk(x, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        got = f"{x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name}: expected an integer topk_ids tensor [L, T, k], got {got}")
    if x.dim() != 3 or x.shape[-1] < 1:
        raise ValueError(f"{name}: expected topk_ids of shape [L, T, k] (layers, tokens, experts), got {list(x.shape)}")
    return x.detach().long().cpu()


def _check_sets(x: torch.Tensor, name: str) -> None:
    if x.numel() and int(x.min()) < 0:
        raise ValueError(f"{name}: expected expert ids >= 0, got a minimum of {int(x.min())}")
    s = x.sort(-1).values
    dup = (s[..., 1:] == s[..., :-1]).any(-1)
    if bool(dup.any()):
        layer, token = (int(v) for v in dup.nonzero()[0])
        raise ValueError(
            f"{name}: expected k distinct expert ids per token, got {x[layer, token].tolist()} at layer {layer}, "
            f"token {token}"
        )


def topk_overlap(reference: torch.Tensor, other: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per layer and token, the Jaccard index of the two expert sets and whether the set changed.

    Args:
        reference, other: integer ``topk_ids`` ``[L, T, k]`` (layers, tokens, experts per token) of the same tokens;
            each token's ``k`` ids distinct and >= 0 (the order of the ``k`` slots does not matter). Not changed.

    Returns:
        ``(jaccard, changed)``: float64 ``[L, T]``, ``c / (2k - c)`` with ``c`` the experts in common (exact: a
        ratio of small integers, correctly rounded), and bool ``[L, T]``, ``c < k``.

    Raises:
        ValueError: either argument not an integer ``[L, T, k]`` tensor, a negative or repeated id in a token's set,
            or ``other`` of another number of layers, tokens or experts per token than ``reference`` (the message
            names which, with both values).
    """
    ref = _check_topk(reference, "reference")
    oth = _check_topk(other, "other")
    for axis, what in ((0, "MoE layers"), (1, "tokens"), (2, "experts per token (k)")):
        if oth.shape[axis] != ref.shape[axis]:
            raise ValueError(
                f"other: expected {ref.shape[axis]} {what} (as reference), got {oth.shape[axis]} "
                f"(shapes {list(oth.shape)} and {list(ref.shape)})"
            )
    _check_sets(ref, "reference")
    _check_sets(oth, "other")
    k = ref.shape[-1]
    common = (ref[..., :, None] == oth[..., None, :]).sum((-1, -2))  # distinct ids: |A & B|
    jaccard = common.double() / (2 * k - common).double()
    return jaccard, common < k


@dataclass(frozen=True)
class RoutingConsistency:
    """The per-layer routing agreement of one run with a reference run on the same tokens (``routing_consistency``).

    Attributes:
        layers: the decoder layer index of each of the ``L`` MoE layers.
        top_k: ``k``, experts per token.
        tokens: int64 ``[U]``, the tokens of each unit (sequence).
        jaccard_sum: float64 ``[L, U]``, per layer and unit the sum of the tokens' Jaccard indices.
        changed: int64 ``[L, U]``, per layer and unit the tokens whose expert set changed.
    """

    layers: tuple[int, ...]
    top_k: int
    tokens: torch.Tensor
    jaccard_sum: torch.Tensor
    changed: torch.Tensor

    @property
    def jaccard(self) -> list[float]:
        """Per layer, the mean Jaccard index over all tokens (1: the same experts everywhere)."""
        return (self.jaccard_sum.sum(1) / self.tokens.sum()).tolist()

    @property
    def share_changed(self) -> list[float]:
        """Per layer, the share of tokens whose expert set changed (0: none)."""
        return (self.changed.sum(1).double() / self.tokens.sum()).tolist()

    def rows(self) -> list[dict]:
        """One dict per layer: ``layer``, ``tokens``, ``units``, ``jaccard``, ``share_changed``."""
        total, units = int(self.tokens.sum()), self.tokens.numel()
        return [
            dict(layer=layer, tokens=total, units=units, jaccard=j, share_changed=s)
            for layer, j, s in zip(self.layers, self.jaccard, self.share_changed)
        ]


def routing_consistency(reference: RoutedTokens, other: RoutedTokens) -> RoutingConsistency:
    """How far ``other``'s routing agrees with ``reference``'s, per MoE layer, on the same tokens.

    Args:
        reference, other: ``RoutedTokens`` of the same token ids, units and MoE layers (``record_routing`` or
            ``recording_routing`` on the same batches), e.g. the bf16 model and a quantized one. Not changed.

    Returns:
        ``RoutingConsistency``: per layer and unit the Jaccard sums and changed-token counts (``topk_overlap``).

    Raises:
        TypeError: an argument that is not ``RoutedTokens``.
        ValueError: ``other`` with another number of MoE layers (or other layer indices), tokens, experts per token
            or units than ``reference``, or other token ids (the first differing position is named), or ids as
            ``topk_overlap`` refuses.
    """
    for name, r in (("reference", reference), ("other", other)):
        if not isinstance(r, RoutedTokens):
            raise TypeError(
                f"{name}: expected RoutedTokens (record_routing, recording_routing), got {type(r).__name__}"
            )
    if len(other.layers) != len(reference.layers) or other.layers != reference.layers:
        raise ValueError(
            f"other: expected the MoE layers {list(reference.layers)} (as reference), got {list(other.layers)}"
        )
    if other.token_ids.numel() != reference.token_ids.numel():
        raise ValueError(
            f"other: expected {reference.token_ids.numel()} tokens (as reference), got {other.token_ids.numel()}"
        )
    if other.top_k != reference.top_k:
        raise ValueError(f"other: expected k = {reference.top_k} experts per token (as reference), got {other.top_k}")
    if not torch.equal(other.token_ids, reference.token_ids):
        i = int((other.token_ids != reference.token_ids).nonzero()[0])
        raise ValueError(
            f"other: expected the same token ids as reference, got id {int(other.token_ids[i])} at position {i} "
            f"where reference has {int(reference.token_ids[i])}"
        )
    if not torch.equal(other.unit, reference.unit):
        raise ValueError(
            f"other: expected the same units (sequences) as reference: {reference.num_units} units, got "
            f"{other.num_units} (the same tokens cut into other sequences)"
        )
    jaccard, changed = topk_overlap(reference.topk_ids, other.topk_ids)
    units = reference.num_units
    unit = reference.unit
    tokens = torch.bincount(unit, minlength=units)
    num_layers = jaccard.shape[0]
    jac = torch.zeros(num_layers, units, dtype=torch.float64).index_add_(1, unit, jaccard)
    chg = torch.zeros(num_layers, units, dtype=torch.int64).index_add_(1, unit, changed.long())
    return RoutingConsistency(reference.layers, reference.top_k, tokens, jac, chg)
