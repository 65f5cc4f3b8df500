"""Notebook 06's routing consistency: does each scheme's router pick the bf16 model's experts, beyond the noise floor?

On the trained model, the same held-out prompts that the accuracy is measured on (teacher forcing: prompt and
answer tokens, the answer's ``<eos>`` left out, as ``mxlib.models.evaluation.evaluate`` runs them) are routed by

* the bf16 model (the **reference**: transformers' own experts implementation, the batches ``evaluate`` runs);
* the same bf16 model on another experts implementation (``NOISE_FLOOR_VARIANTS``: transformers' ``eager`` loop, and
  mxlib's ``TritonExperts`` on the bf16 weights, ``backend="torch"``, the experts module every quantized run goes
  through): the **noise floor**, per MoE layer the largest share of tokens one of them routes to another expert set;
* each scheme's checkpoint loaded back (``accuracy.scheme_study`` records its routing during its evaluation, with no
  forward pass of its own).

Per scheme and MoE layer, ``mxlib.models.routing_consistency`` gives the mean Jaccard index of each token's expert
set against the reference's and the share of tokens whose set changed. ``add_comparisons`` puts one comparison per
scheme and layer into the notebook's ``mxlib.stats.ComparisonFamily``: the scheme's per-prompt changed tokens
against bf16's own (the reference against itself: none), paired over the prompts, token-weighted (the ratio mean is
the share over all tokens), with the layer's noise floor as the smallest difference worth reporting. A decided verdict
(``"bf16 better"``) says the scheme changes routing in that layer beyond what another experts implementation does.
The prompts of the notebook's one draw (its ``seed``) are the replicates (``over="units"``), as in the notebook's
accuracy comparisons: a verdict speaks of that prompt set.

The first MoE layer's router reads the embeddings and the first attention block only, which every checkpoint keeps in
bf16: its routing cannot change, and the notebook checks that it does not (which also checks that the records pair
the same tokens).

``scheme_routing_study`` is the same measurement on any bf16 model and token ids (the dummy Qwen3-30B-A3B-shaped
model: ``mxlib routing --schemes``): the sequences are the units, every MoE layer's experts quantized in each scheme in
memory, the comparisons decided in one family of their own; ``routing_table`` prints its rows.
"""

from __future__ import annotations

import torch

from ..models import evaluation as ev
from ..models.qwen3 import expert_weights
from ..models.routing_consistency import RoutedTokens, RoutingConsistency, record_routing, routing_consistency
from ..models.tasks import Dataset
from ..moe import TritonExperts
from ..stats import ALPHA, ComparisonFamily, Decisions, paired_units

__all__ = [
    "NOISE_FLOOR_VARIANTS",
    "EVAL_BATCH_SIZE",
    "ROUTING_NOISE_FLOOR_BOUND",
    "REFERENCE",
    "routing_tokens",
    "reference_and_noise_floor",
    "consistency_study",
    "metric",
    "comparison_key",
    "add_comparisons",
    "verdict_rows",
    "scheme_routing_study",
    "routing_table",
]

NOISE_FLOOR_VARIANTS = ("eager_experts", "triton_experts_torch")
# evaluate's default batch size: the reference routes the prompts in the batches the schemes' evaluations run
EVAL_BATCH_SIZE = 250
# The noise floor's stated bound: the largest share of tokens another experts implementation of the same bf16 model may
# route to another expert set in any layer. Measured on the shipped models: the default recipe (1600 held-out
# prompts, 23600 tokens) 0 in layer 0 (both variants), 0 (eager) and 0.0042 (TritonExperts, 98 tokens) in layer 1;
# the test recipe (300 prompts, 4050 tokens) 0, 0 and 0.0025 (10 tokens).
ROUTING_NOISE_FLOOR_BOUND = 0.01
REFERENCE = "bf16"


def routing_tokens(sets: list[Dataset]) -> list[torch.Tensor]:
    """The token ids ``evaluate`` runs on each dataset: int64 ``[n, prompt + answer - 1]`` (the answer's last token,
    ``<eos>``, is never an input)."""
    return [torch.cat([d.prompts, d.answers[:, :-1]], 1) for d in sets]


def _interval(values: torch.Tensor, tokens: torch.Tensor, level: float = 0.95) -> tuple[float, float, float]:
    """The token-weighted mean of per-unit sums ``values`` and its Student-t interval over units (``paired_units``
    against zero: the ratio estimator ``sum(values) / sum(tokens)``)."""
    est = paired_units(values.double(), torch.zeros(values.shape, dtype=torch.float64), weights=tokens.double())
    low, high = est.interval(level)
    return est.mean, low, high


def reference_and_noise_floor(model, sets: list[Dataset]) -> dict:
    """The bf16 ``model``'s routing of ``sets`` (the reference) and the noise floor.

    Returns:
        ``{"reference": RoutedTokens, "variants": {name: RoutingConsistency against the reference} for each of
        ``NOISE_FLOOR_VARIANTS``, "noise_floor": {decoder layer: largest share changed over the variants}, "rows": one
        row per variant and layer (variant, layer, tokens, prompts, jaccard, share_changed)}``. The model is unchanged
        afterwards (its experts implementation and experts modules restored).
    """
    return _reference_and_noise_floor(model, routing_tokens(sets), EVAL_BATCH_SIZE, "prompts")


def _reference_and_noise_floor(model, ids, batch_size: int | None, unit_name: str) -> dict:
    """``reference_and_noise_floor`` on token ids ``ids`` (``record_routing``'s), each row one unit."""
    reference = record_routing(model, ids, batch_size)
    variants: dict[str, RoutingConsistency] = {}
    previous = model.config._experts_implementation
    try:
        model.set_experts_implementation("eager")
        variants["eager_experts"] = routing_consistency(reference, record_routing(model, ids, batch_size))
    finally:
        model.set_experts_implementation(previous)

    def bf16_experts(i):
        w13, w2 = expert_weights(model, i)
        return TritonExperts(w13, w2, backend="torch")

    with ev.swapped_experts(model, bf16_experts):
        variants["triton_experts_torch"] = routing_consistency(reference, record_routing(model, ids, batch_size))
    noise_floor = {
        layer: max(v.share_changed[i] for v in variants.values()) for i, layer in enumerate(reference.layers)
    }
    rows = [
        {
            "variant": name,
            "layer": r["layer"],
            "tokens": r["tokens"],
            unit_name: r["units"],
            "jaccard": r["jaccard"],
            "share_changed": r["share_changed"],
        }
        for name, v in variants.items()
        for r in v.rows()
    ]
    return dict(reference=reference, variants=variants, noise_floor=noise_floor, rows=rows)


def consistency_study(reference_noise_floor: dict, routed: dict[str, RoutedTokens], unit_name: str = "prompts") -> dict:
    """Each scheme's routing against the reference (``reference_and_noise_floor``'s).

    Args:
        reference_noise_floor: ``reference_and_noise_floor``'s result.
        routed: ``{scheme name: RoutedTokens}`` recorded on the same prompts (``accuracy.scheme_study``'s
            ``"routed"``).
        unit_name: what a unit (a row of the token ids) is, the rows' key of their count.

    Returns:
        ``{"schemes": {name: RoutingConsistency}, "self": the reference against itself, "noise_floor": the layers'
        noise floor, "rows": one row per scheme and layer}``; a row holds ``scheme``, ``layer``, ``tokens``,
        ``prompts``, ``jaccard`` with ``jaccard_low`` / ``jaccard_high`` and ``share_changed`` with ``share_low`` /
        ``share_high`` (95 % Student-t intervals over prompts, token-weighted), ``noise_floor`` (the layer's noise
        floor of the share changed) and ``beyond_noise_floor`` (the share's interval lies above the noise floor: a
        column, a looser test than the notebook's family, which decides what is stated).

    Raises:
        ValueError: a record of other tokens or layers than the reference (``routing_consistency``).
    """
    reference, noise_floor = reference_noise_floor["reference"], reference_noise_floor["noise_floor"]
    schemes = {name: routing_consistency(reference, r) for name, r in routed.items()}
    rows = []
    for name, c in schemes.items():
        for i, layer in enumerate(c.layers):
            j, j_low, j_high = _interval(c.jaccard_sum[i], c.tokens)
            s, s_low, s_high = _interval(c.changed[i], c.tokens)
            rows.append(
                dict(
                    scheme=name,
                    layer=layer,
                    tokens=int(c.tokens.sum()),
                    **{unit_name: c.tokens.numel()},
                    jaccard=j,
                    jaccard_low=j_low,
                    jaccard_high=j_high,
                    share_changed=s,
                    share_low=s_low,
                    share_high=s_high,
                    noise_floor=noise_floor[layer],
                    beyond_noise_floor=s_low > noise_floor[layer],
                )
            )
    return dict(schemes=schemes, self=routing_consistency(reference, reference), noise_floor=noise_floor, rows=rows)


def metric(layer: int) -> str:
    """The family's metric name of a layer's routing comparison."""
    return f"tokens routed to other experts, layer {layer}"


def comparison_key(scheme: str, layer: int) -> str:
    """The family key of scheme ``scheme``'s routing comparison in decoder layer ``layer``."""
    return f"{scheme} vs {REFERENCE} ({metric(layer)})"


def add_comparisons(family: ComparisonFamily, study: dict, unit_name: str = "prompts") -> list[str]:
    """Add one comparison per scheme and MoE layer of ``study`` (``consistency_study``'s) to ``family``: the
    scheme's changed tokens per prompt against the reference's own (``study["self"]``: none), over the prompts
    (``over="units"``, token counts as weights), lower is better, the layer's noise floor as ``smallest``. Returns the
    keys (``comparison_key``).

    Raises:
        RuntimeError, ValueError: as ``ComparisonFamily.add`` (a decided family, a key already used).
    """
    own = study["self"]
    keys = []
    for name, c in study["schemes"].items():
        for i, layer in enumerate(c.layers):
            keys.append(
                family.add(
                    name,
                    REFERENCE,
                    c.changed[i],
                    own.changed[i],
                    metric=metric(layer),
                    higher_is_better=False,
                    over="units",
                    weights=c.tokens,
                    smallest=float(study["noise_floor"][layer]),
                    unit_name=unit_name,
                    key=comparison_key(name, layer),
                )
            )
    return keys


def verdict_rows(study: dict, decisions: Decisions) -> list[dict]:
    """``study["rows"]`` as the notebook's routing table: scheme, layer, jaccard, share_changed, noise_floor and the
    family's verdict (new dicts; the study's rows are not changed).

    Raises:
        KeyError: a row whose comparison is not in ``decisions`` (``add_comparisons`` was not called).
    """
    keys = ("scheme", "layer", "jaccard", "share_changed", "noise_floor")
    return [
        {k: r[k] for k in keys} | {"verdict": decisions[comparison_key(r["scheme"], r["layer"])].verdict}
        for r in study["rows"]
    ]


def scheme_routing_study(
    model,
    token_ids: torch.Tensor,
    schemes,
    calibration=None,
    *,
    batch_size: int | None = None,
    backend: str = "torch",
    scale_strategy: str = "max",
    alpha: float = ALPHA,
) -> dict:
    """Does a bf16 model still route as bf16 with its experts quantized in each scheme? (The dummy model's table.)

    The same measurement as notebook 06's on any bf16 model of a registered family, on token ids instead of a task's
    prompts: ``reference_and_noise_floor``'s reference and noise floor (the model on transformers' ``eager`` experts
    and on mxlib's bf16 ``TritonExperts``), then every MoE layer's experts quantized round-to-nearest in each scheme
    (``mxlib.moe.factory.quantize_expert_weights``, emulated by the scheme's experts, static input scales from
    ``calibration``), the routing recorded on the same sequences, ``consistency_study`` and ``add_comparisons`` in one
    ``mxlib.stats`` family (Holm at ``alpha``), the sequences as the units: a verdict speaks of sequences drawn as
    these were.

    Args:
        model: a bf16 transformers MoE model of a registered family, holding its own experts (not changed: every
            experts module is restored).
        token_ids: int ``[U, T]``, one sequence per unit (at least 2 units), run ``batch_size`` rows at a time.
        schemes: MoE scheme names or ``MoEQuantScheme`` objects (``mxlib.moe.schemes.get_moe_scheme``), at least one.
        calibration: the model's ``Calibration`` (``mxlib.models.calibration.calibrate``), needed by schemes with
            static input scales (``nvfp4``, ``_a_fp8``).
        batch_size: rows per forward pass (None: all at once).
        backend, scale_strategy: the emulation experts' (``make_emulation_experts``).
        alpha: the family-wise error rate.

    Returns:
        ``{"rows": consistency_study's rows with "sequences" and the family's "verdict", "noise_floor_rows": the noise
        floor's variants per layer, "noise_floor": {layer: share}, "decisions": {key: Decision}, "units", "tokens",
        "seconds": {scheme: wall seconds of quantizing and running it}}``.

    Raises:
        ValueError: ``token_ids`` not an integer ``[U, T]`` tensor with ``U >= 2``, no scheme, an unknown scheme (with
            the nearest names), a linear-layer scheme (``w_fp8_a_fp8``), a scheme with static input scales and no
            ``calibration``, a ``calibration`` of other MoE layers or experts than the model's.
    """
    import time

    from ..moe.factory import quantize_expert_weights
    from ..moe.schemes import get_moe_scheme
    from .scheme_study import emulation_experts

    if not isinstance(token_ids, torch.Tensor) or token_ids.dim() != 2 or token_ids.dtype.is_floating_point:
        got = f"{token_ids.dtype} {list(token_ids.shape)}" if isinstance(token_ids, torch.Tensor) else type(token_ids)
        raise ValueError(f"token_ids: expected an integer tensor [sequences, tokens], got {got}")
    if token_ids.shape[0] < 2 or token_ids.shape[1] == 0:
        raise ValueError(f"token_ids: expected at least 2 sequences of at least 1 token, got {list(token_ids.shape)}")
    names = [schemes] if isinstance(schemes, str) else list(schemes)
    if not names:
        raise ValueError("schemes: expected at least one MoE scheme, got none")
    resolved = {}
    for n in names:
        sc = get_moe_scheme(n)
        if sc.linear_only:
            raise ValueError(f"schemes: {sc.name} is a linear-layer scheme; the experts take the block-scaled schemes")
        resolved.setdefault(sc.name, sc)  # an alias and its scheme run once, under the scheme's name
    static = [n for n, sc in resolved.items() if sc.static_activation_scale]
    if static and calibration is None:
        raise ValueError(
            f"calibration: schemes {static} have static input scales; pass the model's Calibration "
            "(mxlib.models.calibration.calibrate), got None"
        )
    if static:
        _check_calibration(model, calibration)
    unit = "sequences"
    base = _reference_and_noise_floor(model, token_ids, batch_size, unit)
    routed, seconds = {}, {}
    for name, sc in resolved.items():
        t0 = time.perf_counter()

        def make(layer, sc=sc):
            w13, w2 = expert_weights(model, layer)
            in13, in2 = calibration.input_scales(layer, sc.activation) if sc.static_activation_scale else (None, None)
            q = quantize_expert_weights(w13, w2, sc)
            return emulation_experts(sc, q, in13, in2, backend, scale_strategy)

        with ev.swapped_experts(model, make):
            routed[name] = record_routing(model, token_ids, batch_size)
        seconds[name] = time.perf_counter() - t0
    study = consistency_study(base, routed, unit)
    family = ComparisonFamily("routing consistency of the schemes", alpha)
    add_comparisons(family, study, unit)
    decisions = family.decide()
    rows = [r | {"verdict": decisions[comparison_key(r["scheme"], r["layer"])].verdict} for r in study["rows"]]
    return dict(
        rows=rows,
        noise_floor_rows=base["rows"],
        noise_floor=base["noise_floor"],
        decisions=decisions,
        units=int(token_ids.shape[0]),
        tokens=int(token_ids.numel()),
        seconds=seconds,
    )


def _check_calibration(model, calibration) -> None:
    """``calibration`` records the model's MoE layers and experts."""
    from ..models.families import family_of

    family = family_of(model, "scheme_routing_study")
    layers = list(family.moe_layer_indices(model.config))
    experts = family.num_experts(model.config)
    got = [lc.a1_amax.numel() for lc in calibration.layers]
    if len(got) != len(layers) or any(n != experts for n in got):
        raise ValueError(
            f"calibration: expected the model's {len(layers)} MoE layers of {experts} experts each, got "
            f"{len(got)} layers of {sorted(set(got))} experts"
        )


def routing_table(rows: list[dict]) -> str:
    """``scheme_routing_study``'s rows as a text table: scheme, layer, Jaccard, share of tokens whose top-k set
    changed with its 95 % Student-t interval over the units (shown clipped to [0, 100] %, where a share lies), the
    layer's noise floor and the family's verdict."""
    from ..text_table import text_table

    cells = [
        [
            r["scheme"],
            str(r["layer"]),
            f"{r['jaccard']:.4f}",
            f"{100 * r['share_changed']:.2f} %",
            f"[{100 * max(r['share_low'], 0.0):.2f}, {100 * min(r['share_high'], 1.0):.2f}]",
            f"{100 * r['noise_floor']:.2f} %",
            r["verdict"],
        ]
        for r in rows
    ]
    header = ["scheme", "layer", "jaccard", "changed", "95 % interval", "noise floor", "verdict"]
    return "\n".join(text_table(header, cells, align="<>>>>><", sep="  ", rstrip=True))
