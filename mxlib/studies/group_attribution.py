"""Loss attributed per precision group of a mixed-precision checkpoint, and each group switched on its own.

A mixed-precision checkpoint (``mxlib.checkpoints.precision``) puts its quantized modules in **precision
groups**: the routed experts in NVFP4 beside MXFP8 attention projections and an NVFP4 ``lm_head``, each group
named as its producer's config names it (ModelOpt: ``NVFP4 g16``, ``MXFP8 g32``; Quark: the ``layer_quant_config``
key or ``global_quant_config``; compressed-tensors: the ``config_groups`` key). ``precision_groups`` lists a
loaded model's groups and their modules.

**The switch.** ``switched_groups(model, reference, {group: target})`` puts, inside the block, every module of
each named group in another precision, taken from ``reference`` (the bf16 model the checkpoint was quantized
from; same architecture and module names):

* ``"bf16"``: the reference's own module (its ``nn.Linear``, its experts module), the very object: a module
  switched to bf16 computes what the reference's module computes on the same input, bit for bit;
* a scheme (a ``MoEQuantScheme`` or its name): the reference's bf16 weights quantized in that scheme
  (``quantize_expert_weights`` / ``quantize_linear_weight``) and emulated (``make_emulation_experts`` /
  ``make_emulated_linear``, vLLM's numerics), static activation scales the decode scales ``amax / divisor`` in
  fp32 from ``calibration`` (experts) and ``linear_input_amax`` (linear layers), as ModelOpt's layout stores them
  (a compressed-tensors checkpoint stores encode scales rounded to bf16 values, which can differ in the last bit).
  The switch is producer-neutral: FP8 weights by ``reference.quantize_fp8_weight`` (fp32 arithmetic), where the
  producers' per-tensor FP8 writers round in the weight's dtype (``mxlib.checkpoints.layouts.fp8_linear``), so a
  group switched to ``w_fp8_a_fp8`` can differ from a producer's file of it in a few codes.

Groups not named keep the checkpoint's modules. Every other module (embeddings, norms, routers, bf16 experts)
is the checkpoint's: ``write_mixed_checkpoint`` stores them unchanged, so with every group switched to bf16 the
model computes the reference's logits bit for bit (``attribute_groups`` reports whether it does:
``bf16_matches_reference``).

**Configurations** (``make_group_plan``; each a ``{group: target}`` switch, groups not named as stored):

* ``bf16``: every group bf16, the reference; ``all``: the checkpoint as stored;
* ``only <g>``: group ``g`` as stored, every other group bf16: what ``g`` costs alone;
* ``without <g>``: group ``g`` back to bf16, every other as stored: what switching ``g`` back saves;
* the waterfall ``waterfall <g1>+<g2>+...``: the groups as stored one after another in ``order`` (the prefix
  keeps a step apart from ``bf16`` and ``all`` whatever the groups are named);
* ``<g> as <scheme>`` for each ``targets`` entry: group ``g`` in another precision, every other as stored.

**The decomposition** (``decompose_groups``, the attribution machinery's rules: ``mxlib.studies.attribution``)
of one metric ``v`` (a configuration's value minus ``bf16``'s): ``total = v(all)``; the waterfall's increments,
summing to ``total``; ``singles[g] = v(only g)`` and ``interaction = total - sum(singles)`` (0 when the groups'
losses add); ``switches[g] = v(all) - v(without g)``, the loss switching ``g`` back to bf16 removes; and
``targets["<g> as <s>"] = v(<g> as <s>) - v(all)``. Values are held on ``attribution.on_grid``'s grid
(2^-36), so every sum is exact in float64 and ``group_residuals`` are 0.

**The decisions** (``mxlib.stats``, docs/statistics.md): one ``ComparisonFamily`` per study, decided by Holm at
``alpha``: per metric, each ``only <g>`` against ``bf16`` (the group's cost alone), ``all`` against ``without
<g>`` (its cost within the checkpoint), every pair of ``only`` configurations (which group costs more), and each
``<g> as <s>`` against ``all`` (what the other precision costs or saves). Paired over the units of one token set
or prompt set (``over="units"``: a statement about that set), or over draws where ``attribute_groups`` is given
several token sets (``over="draws"``: a statement about token sets), with a measured noise level as the smallest
difference worth reporting: the reference with mxlib's bf16 ``TritonExperts`` in place of its experts (another
implementation of the same bf16 arithmetic) against the reference itself.

Studies: ``attribute_groups`` (token ids through the model, the dummy models: the noise-to-signal ratio of the
logits per token, its mean the NSR ``||x - ref||^2 / ||ref||^2``, and the KL from the reference, nats per token)
and ``attribute_groups_trained`` (the project's trained model on its task datasets: exact match per prompt and
answer NLL per token, ``mxlib.models.evaluation.evaluate``).
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field

import torch

from ..checkpoints.layout import PROJS
from ..checkpoints.precision import EXPERT_CLASSES, module_classes
from ..models.evaluation import evaluate, swapped_experts
from ..models.families import family_of
from ..models.moe_models import expert_weights
from ..moe.base import TransformersExperts, TritonExperts
from ..moe.factory import make_emulated_linear, make_emulation_experts, quantize_expert_weights, quantize_linear_weight
from ..moe.linear import EmulatedLinear
from ..moe.schemes import MoEQuantScheme, get_moe_scheme
from ..stats import ALPHA, ComparisonFamily
from ..text_table import text_table
from .attribution import ALL_TASKS, _differences_and_waterfall, on_grid, task_values
from .scheme_study import emulation_experts

__all__ = [
    "BF16",
    "precision_groups",
    "switched_groups",
    "GroupPlan",
    "make_group_plan",
    "GroupDecomposition",
    "decompose_groups",
    "group_residuals",
    "attribute_groups",
    "attribute_groups_trained",
    "group_table",
]

BF16 = "bf16"
ALL = "all"


# ----------------------------------------------------------------------------- the groups of a loaded model


def _precision_map(model):
    info = getattr(model, "mxlib_info", None)
    if info is None or getattr(info, "precision", None) is None:
        got = "no checkpoint description" if info is None else f"a single-scheme checkpoint ({info.scheme.name})"
        raise ValueError(
            "model: expected a model loaded from a mixed-precision checkpoint (load_quantized_moe; "
            f"model.mxlib_info.precision set), got {got}"
        )
    return info.precision


def precision_groups(model) -> dict[str, list[str]]:
    """The precision groups of a model loaded from a mixed-precision checkpoint, and their modules.

    Args:
        model: ``load_quantized_moe(path)[0]`` of a mixed-precision checkpoint (``model.mxlib_info.precision``).

    Returns:
        ``{group name: [module name, ...]}`` in the checkpoint config's group order, groups with at least one
        quantized module only; module names are the model's: an experts module
        (``model.layers.L.mlp.experts``, all of a layer's experts) or a linear layer (``...self_attn.q_proj``,
        ``lm_head``). Modules the checkpoint stores bf16 are in no group.

    Raises:
        ValueError: ``model`` not loaded from a mixed-precision checkpoint.
    """
    pm = _precision_map(model)
    family = family_of(model, "precision_groups")
    linear_classes = module_classes(torch.nn.Linear(1, 1, bias=False))
    found: dict[str, list[str]] = {}
    for name, m in model.named_modules():
        if isinstance(m, TransformersExperts):
            g = pm.group_of(family.disk_name(f"{name}.0.{PROJS[0]}"), EXPERT_CLASSES)
        elif isinstance(m, EmulatedLinear):
            g = pm.group_of(family.disk_name(name), linear_classes)
        else:
            continue
        if g is not None:
            found.setdefault(g, []).append(name)
    return {g: found[g] for g in pm.groups if g in found}


def _check_groups(names: Iterable[str], groups: Mapping[str, list], param: str) -> list[str]:
    names = list(names)
    bad = [n for n in names if n not in groups]
    if bad:
        raise ValueError(f"{param}: expected precision groups of this checkpoint from {list(groups)}, got {bad}")
    return names


def _target(value, param: str):
    """``"bf16"`` or a ``MoEQuantScheme``."""
    if value == BF16:
        return BF16
    if isinstance(value, MoEQuantScheme):
        return value
    try:
        return get_moe_scheme(value)
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{param}: expected {BF16!r} or a MoE scheme name, got {value!r}") from None


def _target_name(t) -> str:
    return t if t == BF16 else t.name


def _experts_layer(name: str, family, config) -> int:
    for layer in family.moe_layer_indices(config):
        if family.experts_prefix(layer) == name:
            return layer
    raise ValueError(f"{name}: not the experts module of an MoE layer")


def _check_reference(model, reference, groups: Mapping[str, list]) -> None:
    if reference is model:
        raise ValueError("reference: expected the bf16 model the checkpoint was quantized from, got the model itself")
    ref_modules = dict(reference.named_modules())
    for g, names in groups.items():
        for n in names:
            ref = ref_modules.get(n)
            own = model.get_submodule(n)
            if isinstance(own, EmulatedLinear):
                ok = isinstance(ref, torch.nn.Linear) and tuple(ref.weight.shape) == (own.out_features, own.in_features)
                want = f"nn.Linear [{own.out_features}, {own.in_features}]"
            else:
                ok = ref is not None and not isinstance(ref, TransformersExperts)
                want = "the model's own bf16 experts module"
            if not ok:
                got = "no such module" if ref is None else type(ref).__name__
                if isinstance(ref, torch.nn.Linear):
                    got += f" {list(ref.weight.shape)}"
                raise ValueError(f"reference: expected {n!r} (group {g!r}) to be {want}, got {got}")


def _producer_layout(model, target):
    """The layout ``model``'s producer stores ``target`` in (``write_mixed_checkpoint``'s), with the description a
    load reads it with; ``(None, None)`` where the producer does not store that scheme."""
    from ..checkpoints.mixed import PRODUCER_LAYOUTS, producer_layout

    producer = _precision_map(model).producer
    if producer not in PRODUCER_LAYOUTS:
        return None, None
    try:
        layout = producer_layout(producer, target, "switch")
    except ValueError:
        return None, None
    return layout, layout.read_config(layout.config_files(target, True)[0])


def _build(model, reference, name: str, target, calibration, linear_input_amax, scale_strategy, backend, group):
    """The module that replaces ``name`` for ``target``: where the checkpoint's producer stores ``target``, the
    reference's weights written by that producer's layout and read back as a load reads them (the module docstring's
    switch); else mxlib's reference arithmetic."""
    from ..checkpoints.saving import _StateDictTensors

    ref = reference.get_submodule(name)
    if target == BF16:
        return ref
    own = model.get_submodule(name)
    where = f"switch[{group!r}]"
    layout, description = _producer_layout(model, target)
    if isinstance(own, EmulatedLinear):
        ins = None
        if target.static_activation_scale:
            if linear_input_amax is None or name not in linear_input_amax:
                raise ValueError(
                    f"linear_input_amax: {where} = {target.name} has static activation scales and needs the amax "
                    f"of {name!r} (mxlib.moe.linear.linear_input_amax), got none"
                )
            ins = linear_input_amax[name].float().reshape(()) / target.activation.scale_divisor
        bias = None if ref.bias is None else ref.bias.detach()
        if layout is None or not hasattr(layout, "quantize_linear"):
            w = quantize_linear_weight(ref.weight.detach(), target)
            return make_emulated_linear(target, w, ins, bias=bias, backend=backend)
        w = layout.quantize_linear(ref.weight.detach(), target)
        stored = None if ins is None else layout.stored_input_scale(ins)
        tensors = layout.linear_tensors(target, w, stored, name)
        w, ins = layout.read_linear(_StateDictTensors(tensors), name, own.out_features, own.in_features, description)
        device = ref.weight.device
        return make_emulated_linear(
            target,
            w.to(device),
            None if ins is None else ins.to(device),
            bias=bias,
            backend=backend,
            activation_scale_mode=description.activation_scale_mode or "even",
        )
    family = family_of(reference, "switched_groups")
    if family.expert_biases:
        raise ValueError(f"{family.architecture}'s experts have biases, which a re-quantized group would drop")
    layer = _experts_layer(name, family, reference.config)
    w13, w2 = expert_weights(reference, layer)
    in13 = in2 = None
    if target.static_activation_scale:
        if calibration is None:
            raise ValueError(
                f"calibration: {where} = {target.name} has static activation scales for the experts; pass the "
                "reference's Calibration (mxlib.models.calibration.calibrate), got None"
            )
        in13, in2 = calibration.input_scales(layer, target.activation)
    if layout is None:
        q = quantize_expert_weights(w13, w2, target)
        return TransformersExperts(emulation_experts(target, q, in13, in2, backend, scale_strategy))
    q = layout.quantize_experts(w13, w2, target)
    if q is None:
        q = quantize_expert_weights(w13, w2, target)
    if in13 is not None:
        in13, in2 = layout.stored_input_scale(in13), layout.stored_input_scale(in2)
    prefix = family.experts_prefix(layer)
    config = reference.config
    e, h, i = family.num_experts(config), config.hidden_size, family.intermediate_size(config)
    tensors = layout.expert_tensors(target, q, in13, in2, prefix)
    q, in13, in2 = layout.read_experts(_StateDictTensors(tensors), prefix, e, h, i, description)
    with warnings.catch_warnings():  # the unification warning: the studies measure it
        warnings.simplefilter("ignore")
        experts = make_emulation_experts(
            target,
            q.to(w13.device),
            in13,
            in2,
            backend=backend,
            scale_strategy=scale_strategy,
            activation_scale_mode=description.activation_scale_mode or "even",
        )
    return TransformersExperts(experts)


@contextlib.contextmanager
def switched_groups(
    model,
    reference,
    switch: Mapping[str, str | MoEQuantScheme],
    calibration=None,
    linear_input_amax: Mapping[str, torch.Tensor] | None = None,
    scale_strategy: str = "max",
    backend: str = "torch",
):
    """``model`` with the modules of the named precision groups in another precision inside the block; the
    checkpoint's modules are put back on exit (module docstring).

    Args:
        model: a model loaded from a mixed-precision checkpoint (``precision_groups``).
        reference: the bf16 model the checkpoint was quantized from (same family, module names and shapes), on
            the same device; it is not changed.
        switch: ``{group name: "bf16" | scheme}``: the groups to switch and their precision; a scheme is a
            ``MoEQuantScheme`` or its name (``mxlib.moe.schemes``).
        calibration: the reference's ``Calibration`` (per-expert activation amax), for experts switched to a
            scheme with static activation scales (NVFP4).
        linear_input_amax: ``{module name: amax}`` of the reference (``mxlib.moe.linear.linear_input_amax``), for
            linear layers switched to a scheme with static activation scales.
        scale_strategy: NVFP4's per-expert activation scale rule (``mxlib.moe.scales``); backend: the switched
            modules' backend (``torch`` by default).

    Raises:
        ValueError: a model not loaded from a mixed-precision checkpoint; a ``switch`` key that is not a group
            of its checkpoint (naming the groups there) or a value that is neither ``"bf16"`` nor a scheme; a
            ``reference`` without a module of the same name and shape; a static-scale target without
            ``calibration`` / ``linear_input_amax``; a scheme that cannot quantize the group's modules; experts
            with biases (gpt-oss) switched to a scheme (bf16 is allowed).
    """
    groups = precision_groups(model)
    if not isinstance(switch, Mapping):
        raise ValueError(f"switch: expected a mapping of group name -> 'bf16' or scheme, got {type(switch).__name__}")
    _check_groups(switch, groups, "switch")
    targets = {g: _target(v, f"switch[{g!r}]") for g, v in switch.items()}
    _check_reference(model, reference, {g: groups[g] for g in targets})
    built = {}
    for g, t in targets.items():
        for n in groups[g]:
            try:
                built[n] = _build(model, reference, n, t, calibration, linear_input_amax, scale_strategy, backend, g)
            except ValueError as err:
                if str(err).startswith(("calibration:", "linear_input_amax:")):
                    raise
                raise ValueError(f"switch[{g!r}]: {_target_name(t)} cannot be applied to {n!r}: {err}") from None
    originals = {}
    try:
        for n, m in built.items():
            parent, _, child = n.rpartition(".")
            holder = model.get_submodule(parent) if parent else model
            originals[n] = (holder, child, getattr(holder, child))
            # a plain attribute set: nn.Module.__setattr__ registers it as the child (the reference keeps its own)
            setattr(holder, child, m)
        yield model
    finally:
        for holder, child, orig in originals.values():
            setattr(holder, child, orig)


# ----------------------------------------------------------------------------- the plan and its decomposition


@dataclass(frozen=True)
class GroupPlan:
    """The configurations one group attribution measures (module docstring): ``configs[name]`` is a
    ``{group: "bf16" | scheme name}`` switch (groups not named as stored); ``order``: the waterfall's groups;
    ``steps[i]``: the configuration after the first ``i + 1`` of them; ``targets``: ``{"<g> as <s>": (g, s)}``."""

    groups: tuple[str, ...]
    order: tuple[str, ...]
    configs: dict[str, dict[str, str]]
    steps: tuple[str, ...]
    targets: dict[str, tuple[str, str]] = field(default_factory=dict)


def make_group_plan(
    groups: Iterable[str], order: Iterable[str] | None = None, targets: Mapping[str, object] | None = None
) -> GroupPlan:
    """The configurations of a group attribution (module docstring).

    Args:
        groups: the precision groups (``precision_groups(model)``'s keys), at least one.
        order: the waterfall's order, a permutation of ``groups`` (default: ``groups``' order).
        targets: ``{group: scheme or "bf16", ...}`` or ``{group: [scheme, ...]}``: other precisions to try a
            group in (each a configuration ``<g> as <s>``), or None.

    Raises:
        ValueError: no groups, a group twice, ``order`` not a permutation of ``groups``, a ``targets`` key that
            is not a group, a target that is neither ``"bf16"`` nor a scheme name.
    """
    groups = tuple(groups)
    if not groups:
        raise ValueError("groups: expected at least one precision group, got none")
    if len(set(groups)) != len(groups):
        raise ValueError(f"groups: expected each group once, got {list(groups)}")
    order = groups if order is None else tuple(order)
    if sorted(order) != sorted(groups):
        raise ValueError(f"order: expected a permutation of the groups {list(groups)}, got {list(order)}")
    configs: dict[str, dict[str, str]] = {BF16: {g: BF16 for g in groups}, ALL: {}}
    for g in groups:
        configs[f"only {g}"] = {h: BF16 for h in groups if h != g}
        configs[f"without {g}"] = {g: BF16}
    steps = []
    for i in range(1, len(order) + 1):
        name = "waterfall " + "+".join(order[:i])
        configs.setdefault(name, {h: BF16 for h in order[i:]})
        steps.append(name)
    named = {}
    for g, ts in (targets or {}).items():
        _check_groups([g], dict.fromkeys(groups), "targets")
        for t in [ts] if isinstance(ts, (str, MoEQuantScheme)) else list(ts):
            tn = _target_name(_target(t, f"targets[{g!r}]"))
            name = f"{g} as {tn}"
            configs[name] = {g: tn}
            named[name] = (g, tn)
    return GroupPlan(groups, order, configs, tuple(steps), named)


@dataclass
class GroupDecomposition:
    """One metric's attribution over precision groups, every entry exact (``on_grid`` floats or ints).

    ``baseline``: the metric in ``bf16``; ``total``: ``all`` minus ``bf16``; ``waterfall``: ``[(group,
    increment)]`` in the plan's order, summing to ``total``; ``singles[g]``: ``only g`` minus ``bf16``;
    ``interaction = total - sum(singles)``; ``switches[g]``: ``all`` minus ``without g`` (the loss switching
    ``g`` back to bf16 removes); ``targets[name]``: ``<g> as <s>`` minus ``all``.
    """

    metric: str
    baseline: float
    total: float
    waterfall: list = field(default_factory=list)
    singles: dict = field(default_factory=dict)
    interaction: float = 0.0
    switches: dict = field(default_factory=dict)
    targets: dict = field(default_factory=dict)


def decompose_groups(plan: GroupPlan, values: Mapping[str, float], metric: str) -> GroupDecomposition:
    """The decomposition of ``values[name]`` (the metric in each configuration of ``plan``) into the parts
    ``GroupDecomposition`` names.

    Raises:
        KeyError: a configuration of ``plan`` missing from ``values``.
    """
    base, d, waterfall = _differences_and_waterfall(plan.configs, values, BF16, plan.order, plan.steps)
    total = d[ALL]
    singles = {g: d[f"only {g}"] for g in plan.groups}
    return GroupDecomposition(
        metric,
        base,
        total,
        waterfall,
        singles,
        total - sum(singles.values()),
        {g: total - d[f"without {g}"] for g in plan.groups},
        {n: d[n] - total for n in plan.targets},
    )


def group_residuals(d: GroupDecomposition | dict) -> dict:
    """What each sum of a group decomposition misses: ``waterfall`` (increments - total) and ``groups``
    (singles + interaction - total); both exactly 0 when the values are exact."""
    d = asdict(d) if isinstance(d, GroupDecomposition) else d
    return dict(
        waterfall=sum(v for _, v in d["waterfall"]) - d["total"],
        groups=sum(d["singles"].values()) + d["interaction"] - d["total"],
    )


# ----------------------------------------------------------------------------- measuring


def _measure_all(plan: GroupPlan, measure) -> tuple[dict, dict]:
    """``measure(switch)`` once per distinct configuration: ``(by name, seconds by name)``."""
    seen, out, seconds = {}, {}, {}
    for name, sw in plan.configs.items():
        key = tuple(sorted(sw.items()))
        if key not in seen:
            t0 = time.perf_counter()
            seen[key] = measure(sw)
            seconds[name] = time.perf_counter() - t0
        out[name] = seen[key]
    return out, seconds


def _family(
    plan: GroupPlan, units: dict, metrics: dict, smallest: dict, name: str, alpha: float, unit_name: str, over="units"
):
    """The study's comparisons (module docstring), decided together. ``units[config][metric] = (values,
    weights)``; ``metrics[metric] = higher_is_better``."""
    fam = ComparisonFamily(name, alpha)
    pairs = [(f"only {g}", BF16) for g in plan.groups]
    pairs += [(ALL, f"without {g}") for g in plan.groups]
    singles = [f"only {g}" for g in plan.groups]
    pairs += [(a, b) for i, a in enumerate(singles) for b in singles[i + 1 :]]
    pairs += [(n, ALL) for n in plan.targets]
    for metric, higher in metrics.items():
        for a, b in pairs:
            (va, w), (vb, _) = units[a][metric], units[b][metric]
            fam.add(
                a,
                b,
                va,
                vb,
                metric=metric,
                higher_is_better=higher,
                over=over,
                smallest=float(smallest.get(metric, 0.0)),
                weights=w,
                unit_name=unit_name,
            )
    return fam.decide()


def _warn_unless_reference(matches: bool) -> None:
    if not matches:
        warnings.warn(
            "reference: with every group switched to bf16 the checkpoint does not compute the reference's outputs bit "
            "for bit (bf16_matches_reference is False): the reference is probably not the bf16 model this checkpoint "
            "was quantized from, and every difference below measures that mismatch too",
            stacklevel=3,
        )


def _decisions_dict(decisions) -> dict:
    return {k: {**asdict(v), "decided": v.decided} for k, v in decisions.items()}


def _token_sets(token_ids) -> list[torch.Tensor]:
    """``token_ids`` as a list of draws: one ``[B, T]`` integer tensor, or a list of two or more."""
    sets = list(token_ids) if isinstance(token_ids, (list, tuple)) else [token_ids]
    for j, t in enumerate(sets):
        if not (isinstance(t, torch.Tensor) and t.ndim == 2 and not t.is_floating_point()):
            got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            where = "token_ids" if not isinstance(token_ids, (list, tuple)) else f"token_ids[{j}]"
            raise ValueError(f"{where}: expected an integer tensor [B, T], got {got}")
    if isinstance(token_ids, (list, tuple)) and len(sets) < 2:
        raise ValueError(f"token_ids: expected one [B, T] tensor or a list of at least 2 (draws), got {len(sets)}")
    return sets


def _logits(model, token_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(token_ids).logits.float()


def _per_token(logits: torch.Tensor, ref: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token noise power over the reference's mean signal power (its mean is the NSR) and KL, float64."""
    x, r = logits.double().reshape(-1, logits.shape[-1]), ref.double().reshape(-1, ref.shape[-1])
    power = (r**2).sum(-1).mean()
    nsr = ((x - r) ** 2).sum(-1) / power
    lp, lq = torch.log_softmax(x, -1), torch.log_softmax(r, -1)
    kl = (lq.exp() * (lq - lp)).sum(-1)
    return {"logits nsr": nsr, "logits kl": kl}


def _bf16_triton(reference):
    def make(i):
        w13, w2 = expert_weights(reference, i)
        return TritonExperts(w13, w2, backend="torch")

    return swapped_experts(reference, make)


def _setup(model, reference, order, targets):
    groups = precision_groups(model)
    _check_reference(model, reference, groups)
    return groups, make_group_plan(groups, order, targets)


def attribute_groups(
    model,
    reference,
    token_ids: torch.Tensor,
    targets: Mapping[str, object] | None = None,
    order: Iterable[str] | None = None,
    calibration=None,
    linear_input_amax: Mapping[str, torch.Tensor] | None = None,
    alpha: float = ALPHA,
    scale_strategy: str = "max",
) -> dict:
    """Which precision group of a mixed-precision checkpoint costs what, on the logits of ``token_ids``.

    Every configuration of ``make_group_plan`` (module docstring) runs ``token_ids`` through ``model`` with
    its groups switched (``switched_groups``) and is compared with the ``bf16`` configuration's logits: per
    token ``t``, ``nsr_t = ||x_t - ref_t||^2 / mean_t ||ref_t||^2`` (its mean over tokens is the logits'
    noise-to-signal ratio ``||x - ref||^2 / ||ref||^2``) and ``kl_t = KL(p_ref,t || p_t)`` in nats, float64.

    Args:
        model: loaded from a mixed-precision checkpoint (``load_quantized_moe``), bf16 activations.
        reference: the bf16 model the checkpoint was quantized from (``write_mixed_checkpoint``'s ``model``).
        token_ids: int64 ``[B, T]`` token ids (one draw: the comparisons are over its ``B * T`` tokens, a
            statement about this token set), or a list of two or more such tensors (draws, e.g. token sets of
            different seeds: the comparisons are over the draws, ``mxlib.stats.paired_draws``; each value is the
            mean over the draws of each draw's value).
        targets: other precisions to try groups in (``make_group_plan``), e.g. ``{"MXFP8 g32": "w_mxfp4"}``.
        order: the waterfall's group order (default: the checkpoint config's).
        calibration, linear_input_amax: the reference's activation statistics, for targets with static
            activation scales (``switched_groups``).
        alpha: the family-wise error rate of the decisions; scale_strategy: NVFP4's (``switched_groups``).

    Returns:
        A plain dict: ``groups`` ({group: [module names]}), ``plan`` (``configs``, ``order``, ``steps``,
        ``targets``), ``values`` ({config: {"logits nsr", "logits kl": mean, ``on_grid``}}), ``sqnr_db``
        ({config: ``-10 log10`` of the NSR, ``inf`` for none}), ``decompositions`` ({metric:
        ``GroupDecomposition`` as a dict}), ``noise_floor`` ({metric: the mean of the reference with bf16
        ``TritonExperts`` against the reference: the smallest difference worth reporting}), ``decisions``
        ({key: ``mxlib.stats.Verdict`` as a dict, with ``decided``}), ``bf16_matches_reference`` (the ``bf16``
        configuration's logits equal the reference's, bit for bit, on every draw), ``n`` (tokens, all draws),
        ``draws``, ``seconds`` ({config: s}).

    Raises:
        ValueError: as ``switched_groups`` and ``make_group_plan``; ``token_ids`` (or one of its draws) not a 2-D
            integer tensor, a list of fewer than 2 draws.
    """
    sets = _token_sets(token_ids)
    groups, plan = _setup(model, reference, order, targets)
    kw = dict(calibration=calibration, linear_input_amax=linear_input_amax, scale_strategy=scale_strategy)
    ref_logits = [_logits(reference, t) for t in sets]
    with switched_groups(model, reference, plan.configs[BF16], **kw):
        base = [_logits(model, t) for t in sets]
    with _bf16_triton(reference):
        noise_floor_units = [_per_token(_logits(reference, t), r) for t, r in zip(sets, ref_logits)]

    def measure(sw):
        with switched_groups(model, reference, sw, **kw):
            return [_per_token(_logits(model, t), b) for t, b in zip(sets, base)]

    per_config, seconds = _measure_all(plan, measure)
    metrics = {"logits nsr": False, "logits kl": False}
    over = "units" if len(sets) == 1 else "draws"
    values, sqnr, units = {}, {}, {}
    for name, per in per_config.items():
        values[name] = {m: on_grid(sum(float(p[m].mean()) for p in per) / len(per), f"{name} {m}") for m in metrics}
        nsr = values[name]["logits nsr"]
        sqnr[name] = float("inf") if nsr == 0 else -10.0 * math.log10(nsr)
        if over == "units":
            units[name] = {m: (per[0][m].numpy(), None) for m in metrics}
        else:
            units[name] = {m: ([p[m].numpy() for p in per], None) for m in metrics}
    noise_floor = {m: sum(float(f[m].mean()) for f in noise_floor_units) / len(noise_floor_units) for m in metrics}
    unit_name = "tokens" if over == "units" else "token sets"
    decisions = _family(plan, units, metrics, noise_floor, "precision groups (logits)", alpha, unit_name, over)
    decompositions = {m: asdict(decompose_groups(plan, {n: v[m] for n, v in values.items()}, m)) for m in metrics}
    base_matches = all(torch.equal(b, r) for b, r in zip(base, ref_logits))
    _warn_unless_reference(base_matches)
    return dict(
        groups=groups,
        plan=asdict(plan),
        values=values,
        sqnr_db=sqnr,
        decompositions=decompositions,
        noise_floor=noise_floor,
        decisions=_decisions_dict(decisions),
        bf16_matches_reference=base_matches,
        n=sum(int(t.numel()) for t in sets),
        draws=len(sets),
        seconds=seconds,
    )


def attribute_groups_trained(
    model,
    reference,
    datasets,
    targets: Mapping[str, object] | None = None,
    order: Iterable[str] | None = None,
    calibration=None,
    linear_input_amax: Mapping[str, torch.Tensor] | None = None,
    noise_floor: Mapping[str, float] | None = None,
    alpha: float = ALPHA,
    batch_size: int = 250,
    scale_strategy: str = "max",
) -> dict:
    """Which precision group of a mixed-precision checkpoint of the trained model costs what, on its tasks.

    Every configuration of ``make_group_plan`` is evaluated (``mxlib.models.evaluation.evaluate``: greedy
    exact match per prompt, answer NLL in nats per answer token), every task's prompts pooled.

    Args:
        model: loaded from a mixed-precision checkpoint of the trained model (``write_mixed_checkpoint`` of
            ``mxlib.models.training.train``'s model, then ``load_quantized_moe``).
        reference: the trained bf16 model itself.
        datasets: held-out ``Dataset``s (a list or dict, one per task).
        noise_floor: ``{"exact_match": prompts share, "nll_per_token": nats}``, the smallest differences worth
            reporting (pooled), or None: measured here as the reference with bf16 ``TritonExperts`` against the
            reference (``evaluation.noise_floor``'s largest variant is a stricter choice; pass its pooled
            maximum).
        targets, order, calibration, linear_input_amax, alpha, scale_strategy: as ``attribute_groups``;
        batch_size: ``evaluate``'s.

    Returns:
        As ``attribute_groups``, with ``values`` ({config: {task or "all": {"exact_match": correct prompts
        (int), "nll_per_token": ``on_grid``}}}), ``decompositions`` ({task or "all": {metric: ...}}), ``noise_floor``
        (the pooled smallest differences used), ``decisions`` (pooled prompts: exact match as a share of
        prompts, higher better; NLL per answer token, lower better), ``n`` (prompts); no ``sqnr_db``.

    Raises:
        ValueError: as ``switched_groups``, ``make_group_plan`` and ``evaluate``.
    """
    groups, plan = _setup(model, reference, order, targets)
    kw = dict(calibration=calibration, linear_input_amax=linear_input_amax, scale_strategy=scale_strategy)
    results = {}

    def pooled(r):
        cat = lambda key: torch.cat([getattr(r.tasks[t], key) for t in r.tasks])  # noqa: E731
        return {
            "exact_match": (cat("correct").double().numpy(), None),
            "nll_per_token": (cat("nll").double().numpy(), cat("tokens").double().numpy()),
        }

    def measure(sw):
        with switched_groups(model, reference, sw, **kw):
            r = evaluate(model, datasets, batch_size)
        results[tuple(sorted(sw.items()))] = r
        return r

    per_config, seconds = _measure_all(plan, measure)
    ref = evaluate(reference, datasets, batch_size)
    if noise_floor is None:
        with _bf16_triton(reference):
            other = evaluate(reference, datasets, batch_size)
        a, b = pooled(other), pooled(ref)
        noise_floor = {
            "exact_match": abs(float((a["exact_match"][0] - b["exact_match"][0]).mean())),
            "nll_per_token": abs(
                float((a["nll_per_token"][0] - b["nll_per_token"][0]).sum() / b["nll_per_token"][1].sum())
            ),
        }
    values = {n: task_values(r) for n, r in per_config.items()}
    units = {n: pooled(r) for n, r in per_config.items()}
    metrics = {"exact_match": True, "nll_per_token": False}
    decisions = _family(plan, units, metrics, noise_floor, "precision groups (trained model)", alpha, "prompts")
    tasks = list(values[BF16])
    decompositions = {
        t: {m: asdict(decompose_groups(plan, {n: v[t][m] for n, v in values.items()}, m)) for m in metrics}
        for t in tasks
    }
    base = per_config[BF16]
    same = all(
        torch.equal(base.tasks[t].correct, ref.tasks[t].correct) and torch.equal(base.tasks[t].nll, ref.tasks[t].nll)
        for t in ref.tasks
    )
    _warn_unless_reference(same)
    return dict(
        groups=groups,
        plan=asdict(plan),
        values=values,
        decompositions=decompositions,
        noise_floor=dict(noise_floor),
        decisions=_decisions_dict(decisions),
        bf16_matches_reference=same,
        n=sum(r.n for r in base.tasks.values()),
        tasks=[*base.tasks, ALL_TASKS],
        seconds=seconds,
    )


# ----------------------------------------------------------------------------- the printed table


def _verdict(result: dict, a: str, b: str, metric: str) -> str:
    v = result["decisions"].get(f"{a} vs {b} ({metric})")
    return "-" if v is None else v["verdict"]


def group_table(result: dict, schemes: Mapping[str, str] | None = None, metric: str | None = None) -> str:
    """``attribute_groups``' result as text (``mxlib attribute-groups`` prints it): one row per precision group,
    then the checkpoint (``all``), the interaction and each ``<g> as <scheme>``. The numbers are the result's own.

    Columns: the group, its stored scheme (``schemes``: {group: name}, ``-`` where not given), its modules; for
    ``metric`` (``"logits nsr"`` by default, or the result's first metric) the group alone (``only <g>`` minus
    ``bf16``: ``singles``) and its decision against ``bf16``; what switching it back to bf16 saves (``all`` minus
    ``without <g>``: ``switches``) and its decision (``all`` against ``without <g>``); the SQNR of ``only <g>``
    in dB (``sqnr_db``). Rows ``<g> as <s>`` give that configuration minus ``all`` and its decision against
    ``all``.

    Raises:
        KeyError: ``metric`` not in the result's decompositions, naming the ones there.
    """
    decs = result["decompositions"]
    metric = metric or ("logits nsr" if "logits nsr" in decs else next(iter(decs)))
    if metric not in decs:
        raise KeyError(f"metric: expected one of {list(decs)}, got {metric!r}")
    d, schemes = decs[metric], schemes or {}
    sqnr = result.get("sqnr_db", {})

    def db(name):
        return f"{sqnr[name]:.2f}" if name in sqnr else "-"

    header = ["group", "scheme", "modules", f"alone ({metric})", "vs bf16", "switched back saves", "vs all", "SQNR dB"]
    rows = []
    for g, modules in result["groups"].items():
        rows.append(
            [
                g,
                str(schemes.get(g, "-")),
                str(len(modules)),
                f"{d['singles'][g]:.4e}",
                _verdict(result, f"only {g}", BF16, metric),
                f"{d['switches'][g]:.4e}",
                _verdict(result, ALL, f"without {g}", metric),
                db(f"only {g}"),
            ]
        )
    rows.append(
        [
            ALL,
            "as stored",
            str(sum(len(m) for m in result["groups"].values())),
            f"{d['total']:.4e}",
            "-",
            "-",
            "-",
            db(ALL),
        ]
    )
    rows.append(["interaction", "-", "-", f"{d['interaction']:.4e}", "-", "-", "-", "-"])
    for name, diff in d["targets"].items():
        rows.append([name, "-", "-", f"{diff:+.4e} vs all", _verdict(result, name, ALL, metric), "-", "-", db(name)])
    lines = text_table(header, rows, align="<<><<><>", sep="  ")
    unit = "tokens" if result.get("draws", 1) == 1 else "token sets"
    lines.append(
        f"{metric}: configuration minus bf16 (the reference); {result.get('n', '?')} tokens in "
        f"{result.get('draws', 1)} draw(s), decided over {unit} (mxlib.stats, Holm); bf16 = the reference bit for bit: "
        f"{result.get('bf16_matches_reference')}"
    )
    return "\n".join(lines)
