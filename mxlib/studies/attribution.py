"""Error attribution: where a scheme's loss comes from (weights or activations, w13 or w2, which layer).

A scheme's emulation changes four things in every MoE layer, the **error sources**: the ``w13`` and
``w2`` weights (dequantized from the scheme's format), the ``a1`` QDQ (the layer input, before
GEMM1) and the ``a2`` QDQ (the SiLU-and-mul output, before GEMM2). ``AttributedExperts`` switches
each on or off on its own: bf16 ``TritonExperts`` whose weights are the emulation experts'
dequantized ones where a weight source is on (bf16 otherwise), and whose activation hooks call the
emulation experts' own QDQ where an activation source is on (identity otherwise). With every source
on they compute what the scheme's emulation experts compute, bit for bit (vLLM's numerics); with
none on, bf16 ``TritonExperts``. The experts' classes are not changed: this module composes them.

A **configuration** is the set of ``(layer, source)`` pairs switched on; every configuration is
measured against the one with none on (``"bf16"``: the same experts code with nothing quantized, so
that a source switched off changes no bit). For one metric ``v`` (a configuration's delta from bf16):

* **waterfall**: the sources enabled one after another in a fixed ``order`` (default
  ``w13, w2, a1, a2``), each in every layer; increment ``i`` is ``v(first i) - v(first i - 1)``.
  The increments sum to the total ``v(all)`` by construction; an increment depends on the order.
* **one at a time**: ``v({s})`` for each source alone, and the **interaction** ``v(all) - sum``;
  zero when the sources' effects add (uncorrelated errors add in noise power, not in dB).
* **weights vs activations**: ``v(w13 + w2)``, ``v(a1 + a2)`` and their interaction.
* **one layer at a time**: ``v(every source of layer l)``, and the layers' interaction.

Every value is held exactly: exact match as a count of prompts (an int), NLL per token, noise-to-
signal ratios and KL on a grid of ``QUANTUM`` = 2^-36 (``on_grid``; a value must stay below
``LIMIT`` = 2^8 in magnitude), so that each difference and each sum above is exact in float64 and
the tests compare the sums with ``==``. The grid is 1e-11: far below the noise floor of any metric.

Studies: ``attribute_trained`` (task exact match and NLL of the project's trained model,
``mxlib.models.evaluation``, with paired bootstrap intervals and the noise floor) and
``attribute_layers`` (the dummy Qwen3-30B-A3B-shaped model of ``steps.dummy_model``: the noise-to-
signal ratio of every decoder layer's output and of the logits, SQNR in dB beside it). Both return
plain dicts for a results JSON; ``attribution_figures.attribution_rows`` flattens either into a table.

Scope: the ``vllm`` numerics. In the ``hardware`` numerics the NVFP4 per-tensor scales of the
weights and of the activations multiply the same GEMM output, so the sources are not separable.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import torch

from ..formats import Numerics
from ..models.evaluation import Difference, compare, evaluate, paired_bootstrap_interval, swapped_experts
from ..models.qwen3 import expert_weights, moe_layers
from ..moe.base import QuantizedA1, TritonExperts
from ..moe.emulation import QuantizedExperts
from ..moe.factory import input_scales_from_amax, quantize_expert_weights
from ..moe.schemes import MoEQuantScheme, get_moe_scheme
from .scheme_study import emulation_experts
from .steps import run_model

__all__ = [
    "SOURCES",
    "WEIGHT_SOURCES",
    "ACTIVATION_SOURCES",
    "QUANTUM",
    "LIMIT",
    "on_grid",
    "scheme_sources",
    "AttributedExperts",
    "Plan",
    "make_plan",
    "Decomposition",
    "decompose",
    "layer_emulations",
    "attributed_experts",
    "attribute_trained",
    "attribute_layers",
    "task_values",
    "residuals",
    "sum_failures",
]

SOURCES = ("w13", "w2", "a1", "a2")
WEIGHT_SOURCES = ("w13", "w2")
ACTIVATION_SOURCES = ("a1", "a2")
QUANTUM = 2.0**-36
LIMIT = 2.0**8
BASELINE = "bf16"


def on_grid(x: float, name: str = "value") -> float:
    """``x`` rounded to the nearest multiple of ``QUANTUM`` (2^-36): sums and differences of up to 2^8
    such values below ``LIMIT`` (2^8) in magnitude are exact in float64.

    Raises:
        ValueError: ``x`` not finite or not below ``LIMIT`` in magnitude (naming ``name``).
    """
    x = float(x)
    if not math.isfinite(x) or abs(x) >= LIMIT:
        raise ValueError(f"{name}: expected a finite value of magnitude below {LIMIT:g}, got {x}")
    return round(x / QUANTUM) * QUANTUM


def scheme_sources(scheme: MoEQuantScheme | str) -> tuple[str, ...]:
    """The error sources a scheme has: ``w13, w2`` always, ``a1, a2`` when it quantizes activations."""
    s = get_moe_scheme(scheme)
    return SOURCES if s.activation is not None else WEIGHT_SOURCES


def _check_sources(sources: Iterable[str], allowed: tuple[str, ...], name: str) -> tuple[str, ...]:
    sources = tuple(sources)
    bad = [s for s in sources if s not in allowed]
    if bad:
        raise ValueError(f"{name}: expected sources from {list(allowed)}, got {bad}")
    if len(set(sources)) != len(sources):
        raise ValueError(f"{name}: expected each source once, got {list(sources)}")
    return sources


class AttributedExperts(TritonExperts):
    """bf16 experts with each of a scheme's error sources switched on or off.

    Args:
        w13: ``[E, 2I, H]``, w2: ``[E, H, I]``: the layer's bf16 weights (the sources switched off).
        emulation: the scheme's emulation experts of the same layer (``make_emulation_experts``,
            ``numerics="vllm"``), built from ``w13`` and ``w2``: their dequantized weights
            (``dequantized_expert`` / ``dequantized_weights``) and their QDQ hooks
            (``quantize_input``, ``quantize_intermediate``) serve the sources switched on.
        sources: the sources switched on, a subset of ``SOURCES`` (``w13``, ``w2``, ``a1``, ``a2``).
        backend: ``torch`` (default) / ``triton`` / ``auto`` / ``fused`` (the triton path), as
            ``TritonExperts``; the QDQ runs with the same backend's functions.

    Raises:
        TypeError: ``emulation`` not an emulation experts object.
        ValueError: ``hardware`` numerics; shapes or activation dtype unlike the weights'; unknown sources.
    """

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, emulation, sources: Iterable[str] = (), backend="torch"):
        super().__init__(w13, w2, backend=backend)
        if not isinstance(emulation, QuantizedExperts):
            raise TypeError(
                f"emulation: expected emulation experts (make_emulation_experts), got {type(emulation).__name__}"
            )
        if emulation.numerics is not Numerics.VLLM:
            raise ValueError(
                f"emulation: expected numerics 'vllm' (the sources separate there), got {emulation.numerics.value!r}"
            )
        dims = (emulation.num_experts, emulation.hidden_size, emulation.intermediate_size)
        if dims != self._dims:
            raise ValueError(f"emulation: expected experts of [E, H, I] = {list(self._dims)}, got {list(dims)}")
        if emulation.activation_dtype != w13.dtype:
            raise ValueError(f"emulation: expected activation dtype {w13.dtype}, got {emulation.activation_dtype}")
        self.emulation = emulation
        self.sources = frozenset(_check_sources(sources, SOURCES, "sources"))

    def dequantized_expert(self, e: int):
        w13, w2 = self.w13[e], self.w2[e]
        if self.sources & set(WEIGHT_SOURCES):
            d13, d2 = self.emulation.dequantized_expert(e)
            w13 = d13 if "w13" in self.sources else w13
            w2 = d2 if "w2" in self.sources else w2
        return w13, w2

    def dequantized_weights(self):
        w13, w2 = self.w13, self.w2
        if self.sources & set(WEIGHT_SOURCES):
            d13, d2 = self.emulation.dequantized_weights()
            w13 = d13 if "w13" in self.sources else w13
            w2 = d2 if "w2" in self.sources else w2
        return w13, w2

    def quantize_input(self, a1, topk_ids, backend):
        if "a1" in self.sources:
            return self.emulation.quantize_input(a1, topk_ids, backend)
        return QuantizedA1(a1)

    def quantize_intermediate(self, a2, row_experts, backend):
        if "a2" in self.sources:
            return self.emulation.quantize_intermediate(a2, row_experts, backend)
        return a2


# ----------------------------------------------------------------------------- the plan of configurations


@dataclass(frozen=True)
class Plan:
    """The configurations one attribution measures: ``configs[name]`` is a frozenset of ``(layer,
    source)`` pairs switched on. ``order``: the waterfall's sources; ``steps[i]``: the configuration
    name after the first ``i + 1`` of them; ``num_layers``: the model's MoE layers."""

    sources: tuple[str, ...]
    order: tuple[str, ...]
    num_layers: int
    configs: dict[str, frozenset]
    steps: tuple[str, ...]
    layer_sources: bool


def _on(layers: Iterable[int], sources: Iterable[str]) -> frozenset:
    return frozenset((li, s) for li in layers for s in sources)


def make_plan(scheme, num_layers: int, order: Iterable[str] | None = None, layer_sources: bool = False) -> Plan:
    """The configurations of an attribution of ``scheme`` on a model of ``num_layers`` MoE layers.

    Names: ``bf16`` (none on), ``all``; ``only <s>`` per source; ``weights`` and ``activations`` (every
    weight or activation source the scheme has: none, for a weight-only scheme's activations); the
    waterfall's cumulative steps ``<s1>+<s2>+...``; ``layer <l>`` (every source of layer ``l``); with
    ``layer_sources``, ``layer <l> <s>`` for each pair as well.
    Configurations with the same pairs share one measurement.

    Raises:
        ValueError: ``order`` not a permutation of the scheme's sources; ``num_layers`` < 1.
    """
    sources = scheme_sources(scheme)
    order = sources if order is None else _check_sources(order, sources, "order")
    if sorted(order) != sorted(sources):
        raise ValueError(f"order: expected a permutation of the scheme's sources {list(sources)}, got {list(order)}")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers: expected a positive int, got {num_layers!r}")
    layers = range(num_layers)
    configs = {BASELINE: frozenset(), "all": _on(layers, sources)}
    for s in sources:
        configs[f"only {s}"] = _on(layers, (s,))
    # a weight-only scheme's activations configuration is bf16 itself (nothing to switch on)
    configs["weights"] = _on(layers, [s for s in WEIGHT_SOURCES if s in sources])
    configs["activations"] = _on(layers, [s for s in ACTIVATION_SOURCES if s in sources])
    steps = []
    for i in range(1, len(order) + 1):
        name = "+".join(order[:i])
        configs.setdefault(name, _on(layers, order[:i]))
        steps.append(name)
    for li in layers:
        configs[f"layer {li}"] = _on((li,), sources)
        if layer_sources:
            for s in sources:
                configs[f"layer {li} {s}"] = _on((li,), (s,))
    return Plan(sources, tuple(order), num_layers, configs, tuple(steps), layer_sources)


# ----------------------------------------------------------------------------- the decomposition


@dataclass
class Decomposition:
    """One metric's attribution, every entry a delta from ``bf16`` (exact: ints or ``on_grid`` floats).

    ``total``: all sources on. ``waterfall``: ``[(source, increment)]`` in the plan's order, summing to
    ``total``. ``singles[s]``: source ``s`` alone; ``interaction = total - sum(singles)``.
    ``weights``, ``activations`` (0 for a weight-only scheme) and ``interaction_wa = total - weights -
    activations``. ``layers[l]``: layer ``l``'s sources alone; ``interaction_layers = total -
    sum(layers)``. ``layer_sources[l][s]``: one pair alone (with ``Plan.layer_sources``).
    ``baseline``: the metric's own value with none on.
    """

    metric: str
    baseline: float
    total: float
    waterfall: list = field(default_factory=list)
    singles: dict = field(default_factory=dict)
    interaction: float = 0.0
    weights: float = 0.0
    activations: float = 0.0
    interaction_wa: float = 0.0
    layers: dict = field(default_factory=dict)
    interaction_layers: float = 0.0
    layer_sources: dict = field(default_factory=dict)


def _differences_and_waterfall(configs, values, baseline: str, order, steps) -> tuple[float, dict, list]:
    """``(base, d, waterfall)``: ``base = values[baseline]``, ``d[name] = values[name] - base`` for every name of
    ``configs``, and ``waterfall`` the ``(source, increment)`` of each cumulative step (``steps[i]`` switches on
    ``order[:i + 1]``). Shared by ``decompose`` and ``group_attribution.decompose_groups``.

    Raises:
        KeyError: a name of ``configs`` missing from ``values``.
    """
    missing = [n for n in configs if n not in values]
    if missing:
        raise KeyError(f"values: no value for the configurations {missing}")
    base = values[baseline]
    d = {n: values[n] - base for n in configs}
    prev, waterfall = 0, []
    for source, name in zip(order, steps):
        waterfall.append((source, d[name] - prev))
        prev = d[name]
    return base, d, waterfall


def decompose(plan: Plan, values: dict[str, float], metric: str) -> Decomposition:
    """The decomposition of ``values[name]`` (the metric in each configuration of ``plan``, exact: ints
    or ``on_grid`` floats) into the parts ``Decomposition`` names.

    Raises:
        KeyError: a configuration of ``plan`` missing from ``values``.
    """
    base, d, waterfall = _differences_and_waterfall(plan.configs, values, BASELINE, plan.order, plan.steps)
    total = d["all"]
    singles = {s: d[f"only {s}"] for s in plan.sources}
    out = Decomposition(metric, base, total, waterfall, singles, total - sum(singles.values()))
    out.weights, out.activations = d["weights"], d["activations"]
    out.interaction_wa = total - out.weights - out.activations
    out.layers = {li: d[f"layer {li}"] for li in range(plan.num_layers)}
    out.interaction_layers = total - sum(out.layers.values())
    if plan.layer_sources:
        out.layer_sources = {li: {s: d[f"layer {li} {s}"] for s in plan.sources} for li in range(plan.num_layers)}
    return out


def residuals(d: Decomposition | dict) -> dict:
    """What each sum of a decomposition misses (a ``Decomposition`` or its dict): ``waterfall``
    (increments - total), ``sources`` (singles + interaction - total), ``weights_activations`` and
    ``layers``; every one is exactly 0 when the values are exact (ints or ``on_grid`` floats)."""
    d = asdict(d) if isinstance(d, Decomposition) else d
    total = d["total"]
    return dict(
        waterfall=sum(v for _, v in d["waterfall"]) - total,
        sources=sum(d["singles"].values()) + d["interaction"] - total,
        weights_activations=d["weights"] + d["activations"] + d["interaction_wa"] - total,
        layers=sum(d["layers"].values()) + d["interaction_layers"] - total,
    )


def sum_failures(result: dict) -> list[str]:
    """Every decomposition of an ``attribute_trained`` or ``attribute_layers`` result whose ``residuals`` are
    not all 0, as ``"<task> <metric>: {residuals}"`` (empty when every sum holds)."""
    decs = result["decompositions"]
    flat = {m: d for m, d in decs.items() if "total" in d} or {
        f"{t} {m}": d for t, per in decs.items() for m, d in per.items()
    }
    found = {name: residuals(d) for name, d in flat.items()}
    return [f"{name}: {r}" for name, r in found.items() if any(v != 0 for v in r.values())]


# ----------------------------------------------------------------------------- experts per configuration


def layer_emulations(model, scheme, calibration=None, scale_strategy: str = "max") -> tuple[list, list]:
    """Each MoE layer's bf16 weights ``(w13, w2)`` and the scheme's emulation experts built from them
    (``quantize_expert_weights``, ``make_emulation_experts(..., backend="torch")``; static activation
    scales from ``calibration``'s per-expert amax, ``input_scales_from_amax``).

    Raises:
        ValueError: a static-scale scheme without ``calibration``, or one of another number of layers.
    """
    s = get_moe_scheme(scheme)
    n = len(moe_layers(model))
    if s.static_activation_scale:
        if calibration is None:
            raise ValueError(f"calibration: scheme {s.name} has static activation scales; pass a Calibration")
        if len(calibration.layers) != n:
            raise ValueError(f"calibration: expected {n} layers, got {len(calibration.layers)}")
    weights, emulations = [], []
    for li in range(n):
        w13, w2 = expert_weights(model, li)
        in13 = in2 = None
        if s.static_activation_scale:
            lc = calibration.layers[li]
            in13, in2 = (t.to(w13.device) for t in input_scales_from_amax(s, lc.a1_amax, lc.a2_amax))
        weights.append((w13, w2))
        emulations.append(emulation_experts(s, quantize_expert_weights(w13, w2, s), in13, in2, "torch", scale_strategy))
    return weights, emulations


@contextlib.contextmanager
def attributed_experts(model, weights: list, emulations: list, config: frozenset, backend: str = "torch"):
    """The model with every layer's experts replaced by ``AttributedExperts`` switched on where
    ``config`` (``(layer, source)`` pairs) says, inside the block; restored on exit."""

    def make(li):
        on = [s for s in SOURCES if (li, s) in config]
        return AttributedExperts(*weights[li], emulations[li], on, backend=backend)

    with swapped_experts(model, make):
        yield model


def _measure_all(plan: Plan, measure) -> tuple[dict, dict]:
    """``measure(config)`` once per distinct configuration; ``(by name, seconds by name)``."""
    by_pairs, seconds, out = {}, {}, {}
    for name, cfg in plan.configs.items():
        if cfg not in by_pairs:
            t0 = time.perf_counter()
            by_pairs[cfg] = measure(cfg)
            seconds[name] = time.perf_counter() - t0
        out[name] = by_pairs[cfg]
    return out, seconds


def _plan_dict(plan: Plan) -> dict:
    return dict(
        sources=list(plan.sources),
        order=list(plan.order),
        num_layers=plan.num_layers,
        steps=list(plan.steps),
        configs={n: sorted([li, s] for li, s in c) for n, c in plan.configs.items()},
    )


def _decomposition_dict(d: Decomposition) -> dict:
    out = asdict(d)
    out["waterfall"] = [[s, v] for s, v in d.waterfall]
    return out


# ----------------------------------------------------------------------------- the trained model


ALL_TASKS = "all"


def task_values(results) -> dict:
    """An ``evaluate`` result's exact values: per task and pooled over tasks (``all``), correct prompts
    (``exact_match``, an int) and NLL per answer token (``nll_per_token``, ``on_grid``): what
    ``attribute_trained`` records per configuration."""
    out, correct, nll, tokens = {}, 0, 0.0, 0
    for t, r in results.tasks.items():
        c, s, k = int(r.correct.sum()), float(r.nll.sum()), int(r.tokens.sum())
        out[t] = dict(exact_match=c, nll_per_token=on_grid(s / k, f"{t} nll_per_token"))
        correct, nll, tokens = correct + c, nll + s, tokens + k
    out[ALL_TASKS] = dict(exact_match=correct, nll_per_token=on_grid(nll / tokens, "nll_per_token"))
    return out


def _pooled_difference(a, b) -> dict:
    """``compare``'s two differences with every task's prompts pooled (one paired bootstrap over all)."""
    cat = lambda r, key: torch.cat([getattr(r.tasks[t], key) for t in a.tasks])  # noqa: E731
    kw = dict(resamples=a.resamples, confidence=a.confidence, seed=a.seed)
    em = paired_bootstrap_interval(cat(a, "correct"), cat(b, "correct"), **kw)
    nll = paired_bootstrap_interval(cat(a, "nll"), cat(b, "nll"), cat(a, "tokens"), **kw)
    flips = int((cat(a, "correct") != cat(b, "correct")).sum())
    return {
        "exact_match": Difference("exact_match", em.estimate, em.low, em.high, not em.low <= 0 <= em.high, flips),
        "nll_per_token": Difference("nll_per_token", nll.estimate, nll.low, nll.high, not nll.low <= 0 <= nll.high),
    }


def attribute_trained(
    model,
    datasets,
    scheme,
    calibration=None,
    order: Iterable[str] | None = None,
    layer_sources: bool = False,
    noise_floor: dict | None = None,
    batch_size: int = 250,
    scale_strategy: str = "max",
    seed: int = 0,
) -> dict:
    """Where ``scheme`` costs the trained model accuracy: every configuration of ``make_plan`` evaluated
    (``mxlib.models.evaluation.evaluate``: greedy exact match and per-token answer NLL) and decomposed.

    Args:
        model: the trained ``Qwen3MoeForCausalLM`` (``mxlib.models.training.train``), its own experts in.
        datasets: held-out ``Dataset``s (a list or dict, one per task).
        scheme: a ``MoEQuantScheme`` or its name.
        calibration: ``evaluation.calibrate_tasks(model, train_datasets)``, for static-scale schemes.
        order: the waterfall's order (default ``w13, w2, a1, a2``); layer_sources: each (layer, source) alone too.
        noise_floor: ``evaluation.noise_floor(...)["noise_floor"]``, or None: marks each difference whose interval
            excludes 0 and that is beyond it; the pooled ``all`` rows use ``noise_floor["all"]`` when given, else
            the largest task noise floor (a bound: the pooled difference is a weighted mean of the tasks').
        batch_size, seed: ``evaluate``'s (the bootstrap's random seed); scale_strategy: NVFP4's.

    Returns:
        ``{"scheme", "plan", "n" {task: prompts}, "values" {config: {task: {metric: value}}},
        "decompositions" {task: {metric: Decomposition as a dict}}, "differences" {config: {task:
        {metric: {estimate, low, high, significant, beyond}}}}, "baseline_vs_model" (the bf16
        configuration against the model's own experts: ``compare``), "seconds" {config: s}}``;
        exact match in prompts (``exact_match``), NLL in nats per answer token, tasks and ``all``
        (pooled). ``differences`` (paired bootstrap, ``compare``; ``all``: every task's prompts pooled) covers
        the named configurations against bf16, ``increment_differences`` {step: ...} each waterfall step
        against the step before it; ``beyond`` is None where ``noise_floor`` has no entry.

    Raises:
        ValueError: as ``make_plan``, ``layer_emulations`` and ``evaluate``.
    """
    s = get_moe_scheme(scheme)
    plan = make_plan(s, len(moe_layers(model)), order, layer_sources)
    if noise_floor is not None and ALL_TASKS not in noise_floor:
        # the pooled difference is a token- or prompt-weighted mean of the tasks' ones: the largest task
        # noise floor bounds the pooled one
        metrics = ("exact_match", "nll_per_token")
        noise_floor = {**noise_floor, ALL_TASKS: {m: max(f[m] for f in noise_floor.values()) for m in metrics}}
    own = evaluate(model, datasets, batch_size, seed=seed)
    weights, emulations = layer_emulations(model, s, calibration, scale_strategy)
    results = {}

    def measure(cfg):
        with attributed_experts(model, weights, emulations, cfg):
            r = evaluate(model, datasets, batch_size, seed=seed)
        results[cfg] = r
        return task_values(r)

    values, seconds = _measure_all(plan, measure)
    base = results[plan.configs[BASELINE]]
    tasks = [*base.tasks, ALL_TASKS]
    decompositions = {
        t: {
            m: _decomposition_dict(decompose(plan, {n: v[t][m] for n, v in values.items()}, m))
            for m in values[BASELINE][t]
        }
        for t in tasks
    }

    def diffs(r, a=base):
        per_task = compare(a, r)
        per_task[ALL_TASKS] = _pooled_difference(a, r)
        out = {}
        for t, per in per_task.items():
            out[t] = {}
            for m, d in per.items():
                beyond = d.beyond(noise_floor[t][m]) if noise_floor is not None and t in noise_floor else None
                out[t][m] = dict(estimate=d.estimate, low=d.low, high=d.high, significant=d.significant, beyond=beyond)
        return out

    differences = {n: diffs(results[c]) for n, c in plan.configs.items() if n != BASELINE}
    # each waterfall increment against the step before it (paired, the same prompts)
    steps = [BASELINE, *plan.steps]
    increments = {b: diffs(results[plan.configs[b]], results[plan.configs[a]]) for a, b in zip(steps, steps[1:])}
    return dict(
        scheme=s.name,
        plan=_plan_dict(plan),
        n={t: r.n for t, r in base.tasks.items()} | {ALL_TASKS: sum(r.n for r in base.tasks.values())},
        values=values,
        decompositions=decompositions,
        differences=differences,
        increment_differences=increments,
        baseline_vs_model={t: {m: asdict(d) for m, d in per.items()} for t, per in compare(own, base).items()},
        seconds=seconds,
    )


# ----------------------------------------------------------------------------- the dummy model: layer SQNR


def _nsr(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Noise-to-signal ratio ``sum((x - ref)^2) / sum(ref^2)`` in float64 (``10 log10`` of it is -SQNR)."""
    x, ref = x.double(), ref.double()
    return float(((x - ref) ** 2).sum() / (ref**2).sum())


def _sqnr_db(nsr: float) -> float:
    return math.inf if nsr == 0 else -10.0 * math.log10(nsr)


def _kl(logits: torch.Tensor, ref_logits: torch.Tensor) -> float:
    lp, lq = torch.log_softmax(logits.double(), -1), torch.log_softmax(ref_logits.double(), -1)
    return float((lq.exp() * (lq - lp)).sum(-1).mean())


def _run_values(out, ref) -> tuple[dict, dict]:
    """Exact metrics (``on_grid``) of a run against the baseline run, and the SQNR in dB beside them."""
    values, sqnr = {}, {}
    for li, (a, b) in enumerate(zip(out.layer_outputs, ref.layer_outputs)):
        nsr = _nsr(a, b)
        values[f"layer {li} nsr"] = on_grid(nsr, f"layer {li} nsr")
        sqnr[f"layer {li}"] = _sqnr_db(nsr)
    nsr = _nsr(out.logits, ref.logits)
    values["logits nsr"] = on_grid(nsr, "logits nsr")
    values["logits kl"] = on_grid(_kl(out.logits, ref.logits), "logits kl")
    sqnr["logits"] = _sqnr_db(nsr)
    return values, sqnr


def attribute_layers(
    model,
    scheme,
    token_ids: torch.Tensor,
    calibration=None,
    order: Iterable[str] | None = None,
    layer_sources: bool = False,
    scale_strategy: str = "max",
) -> dict:
    """Where ``scheme`` costs the dummy model SQNR: every configuration of ``make_plan`` run on the same
    ``token_ids [1, T]`` (``steps.run_model``) and compared with the ``bf16`` configuration.

    Metrics (float64, ``on_grid``): ``layer <l> nsr`` (the noise-to-signal ratio ``||x - ref||^2 /
    ||ref||^2`` of decoder layer ``l``'s output: earlier layers' errors included), ``logits nsr`` and
    ``logits kl`` (mean ``KL(p_bf16 || p)``, nats). The decompositions are of these, linear in noise
    power; ``sqnr_db`` gives ``-10 log10(nsr)`` per configuration.

    Args:
        model: a bf16 ``Qwen3MoeForCausalLM`` (``steps.dummy_model``), its own experts in.
        scheme: a ``MoEQuantScheme`` or its name; calibration: ``steps.calibrate_model(model, ...)``,
            for static-scale schemes. order, layer_sources: as ``make_plan``.

    Returns:
        ``{"scheme", "plan", "values" {config: {metric: value}}, "sqnr_db" {config: {"layer <l>" |
        "logits": dB}}, "decompositions" {metric: Decomposition as a dict}, "baseline_vs_model"
        {"layer <l>" | "logits": SQNR dB of the bf16 configuration against the model's own experts},
        "seconds" {config: s}}``.
    """
    s = get_moe_scheme(scheme)
    plan = make_plan(s, len(moe_layers(model)), order, layer_sources)
    own = run_model(model, token_ids)
    weights, emulations = layer_emulations(model, s, calibration, scale_strategy)
    with attributed_experts(model, weights, emulations, plan.configs[BASELINE]):
        ref = run_model(model, token_ids)
    sqnr = {}

    def measure(cfg):
        with attributed_experts(model, weights, emulations, cfg):
            out = run_model(model, token_ids)
        values, sqnr[cfg] = _run_values(out, ref)
        return values

    values, seconds = _measure_all(plan, measure)
    metrics = list(values[BASELINE])
    decompositions = {m: _decomposition_dict(decompose(plan, {n: v[m] for n, v in values.items()}, m)) for m in metrics}
    return dict(
        scheme=s.name,
        plan=_plan_dict(plan),
        values=values,
        sqnr_db={n: sqnr[c] for n, c in plan.configs.items()},
        decompositions=decompositions,
        baseline_vs_model=_run_values(ref, own)[1],
        seconds=seconds,
    )
