"""What FP4 costs a trained MoE: notebook 06's studies, on the model the project trains itself.

The other notebooks measure the emulation on random weights against their own bf16 run (SQNR,
KL), which proves it exact but has no task. Here the model is ``mxlib.models.training``'s small
Qwen3-MoE trained on the tasks of ``mxlib.models.tasks``, and the measure is what a user asks:
does the quantized model still answer (exact match per task) and how sure is it (per-token NLL),
each with a bootstrap interval (``mxlib.models.evaluation``).

The steps, in the notebook's order:

1. ``check_accuracy_parameters``: the notebook's parameters checked and resolved (recipe preset,
   tasks, schemes, strategies, sizes) before anything runs.
2. ``trained_model``: the model mxlib ships for the recipe, or (``retrain``) trained, or read from the cache
   (``default_cache_dir()/trained``).
3. ``noise_floor_study``: the same bf16 model on other batch compositions and another experts
   backend (``evaluation.noise_floor``); a quantization delta counts only beyond it.
4. ``scheme_study``: every scheme written as a checkpoint in its real layout (ModelOpt for NVFP4,
   Quark for OCP MX; ``steps.prepare_checkpoint``, cached), loaded back through
   ``load_quantized_qwen3_moe`` and evaluated; per task the delta against bf16 with a paired interval. Each
   evaluation's routing is recorded as it runs (``mxlib.studies.routing_agreement`` compares it with bf16's).
5. ``strategy_study``: the NVFP4 checkpoint loaded under each activation-scale strategy of
   ``mxlib.moe.scales`` (the only scheme whose per-expert static scales are unified by a strategy:
   the ``_a_fp8`` schemes take the max of their per-tensor FP8 scales, as vLLM does).
6. ``amax_study``: notebook 04's mechanism on the trained model's real per-expert amax:
   each expert's scale ratio ``r`` to its layer's largest, against ``NVFP4_SUBNORMAL_RATIO`` and
   ``NVFP4_FLUSH_RATIO`` (``studies.unification_study`` on the calibration activations).
7. ``routing_study``: per task and layer, how far the learned routing is from uniform (KL with a
   bootstrap interval over prompts, against uniform routing's own sampling spread).
8. ``negative_control``: the NVFP4 checkpoint broken on purpose (``NEGATIVE_CONTROLS``: every packed
   weight byte's nibbles swapped, as notebook 01 does; every weight global scale read as its
   reciprocal): accuracy must fall, or the evaluation cannot see a broken emulation.

``claims`` states a difference only where its paired interval excludes 0 and its size exceeds the
noise floor of the same task and metric. The figures live in ``mxlib.workbook.accuracy_figures``.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoints import load_quantized_qwen3_moe
from ..checkpoints.files.safetensors_io import checkpoint_size_bytes
from ..formats import NVFP4_FLUSH_RATIO, NVFP4_SUBNORMAL_RATIO
from ..models import evaluation as ev
from ..models.calibration import Calibration
from ..models.routing_consistency import recording_routing
from ..models.tasks import Dataset, make_dataset
from ..models.training import RECIPES, TrainRecipe, get_recipe, train
from ..moe.scales import ACTIVATION_SCALE_STRATEGIES
from ..moe.schemes import NVFP4_MOE, MoEQuantScheme
from .probes import swapped_nibbles
from .steps import check_backend, check_parameters, check_schemes, default_cache_dir, prepare_checkpoint
from .unification import unification_study

__all__ = [
    "BF16_BAR",
    "NOISE_FLOOR_BOUND",
    "COLLAPSE_BAR",
    "ROUTING_NULL_QUANTILE",
    "AccuracyParameters",
    "check_accuracy_parameters",
    "trained_model",
    "choose_tasks",
    "HARDEST_TASK",
    "evaluation_sets",
    "calibration_sets",
    "calibrate_on_training_mix",
    "result_rows",
    "noise_floor_study",
    "scheme_study",
    "strategy_study",
    "NEGATIVE_CONTROLS",
    "reciprocal_global_scales",
    "negative_control",
    "routing_study",
    "amax_study",
    "claims",
    "training_summary",
]

# The low end of the bf16 exact-match interval every task must reach on its held-out prompts (the trained model's
# bar). Measured on the shipped default model, 400 prompts a task: lows 0.9525 (add) to 1.0 (reverse); the bar
# leaves 0.05 (20 prompts) below the lowest.
BF16_BAR = 0.9
# The noise floor's stated bound: the largest |delta| a change that should not matter may cause,
# per task (exact match: fraction of prompts; NLL: nats per answer token).
NOISE_FLOOR_BOUND = {"exact_match": 0.01, "nll_per_token": 0.005}
# The reciprocal-global-scale control collapses when the high end of every task's exact-match interval falls below
# this. Measured on the shipped default model (100 prompts a task): highs 0.0 (add, sort, reverse) and 0.17 (count).
COLLAPSE_BAR = 0.5
# routing differs from uniform when its KL interval's low end exceeds this quantile of uniform routing's KL
ROUTING_NULL_QUANTILE = 0.999


# ----------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class AccuracyParameters:
    """Notebook 06's parameters, checked (``check_accuracy_parameters``).

    ``recipe``: the ``TrainRecipe`` of the preset ``recipe_name``; ``tasks``: the tasks evaluated (a
    subset of the recipe's); ``schemes``: ``MoEQuantScheme`` objects; ``strategies``: names of
    ``ACTIVATION_SCALE_STRATEGIES`` (the static ones and ``per_token``); ``eval_prompts`` /
    ``calib_prompts``: held-out / training-split prompts per task; ``resamples``: bootstrap
    resamples; ``seed``: the random seed of the prompts drawn and of the bootstrap;
    ``experts_backend``: the emulation experts' backend.
    """

    recipe_name: str
    recipe: TrainRecipe
    tasks: tuple[str, ...]
    schemes: tuple[MoEQuantScheme, ...]
    strategies: tuple[str, ...]
    eval_prompts: int
    calib_prompts: int
    resamples: int
    seed: int
    experts_backend: str


def check_accuracy_parameters(
    recipe: str = "default",
    tasks="all",
    schemes="all",
    strategies=("max", "per_expert"),
    eval_prompts: int = 400,
    calib_prompts: int = 64,
    resamples: int = 1000,
    seed: int = 0,
    experts_backend: str = "auto",
) -> AccuracyParameters:
    """Every parameter checked, and names resolved once (schemes to objects), before anything runs.

    ``tasks``: ``"all"`` (the recipe's) or a list of the recipe's task names; ``schemes``: as
    ``steps.check_schemes``; ``strategies``: a list of ``mxlib.moe.scales.ACTIVATION_SCALE_STRATEGIES`` names.

    Raises:
        ValueError: an unknown recipe preset, task, scheme or strategy; a task the recipe does not
            train; a prompt count, ``resamples`` or ``seed`` outside its bounds (``steps.check_parameters``:
            ``mxlib.models.parameters.PARAMETER_BOUNDS``); an unknown backend. The message names the parameter.
    """
    if recipe not in RECIPES:
        raise ValueError(f"recipe: expected one of {list(RECIPES)}, got {recipe!r}")
    r = get_recipe(recipe)
    if tasks == "all":
        tasks = r.tasks
    if isinstance(tasks, str) or not tasks:
        raise ValueError(f"tasks: expected 'all' or a non-empty list of {list(r.tasks)}, got {tasks!r}")
    bad = [t for t in tasks if t not in r.tasks]
    if bad:
        raise ValueError(f"tasks: {bad} not trained by recipe {recipe!r}; expected a subset of {list(r.tasks)}")
    if isinstance(strategies, str) or not strategies:
        raise ValueError(
            f"strategies: expected a non-empty list of {list(ACTIVATION_SCALE_STRATEGIES)}, got {strategies!r}"
        )
    bad = [s for s in strategies if s not in ACTIVATION_SCALE_STRATEGIES]
    if bad:
        raise ValueError(f"strategies: {bad} unknown; expected names of {list(ACTIVATION_SCALE_STRATEGIES)}")
    check_parameters(eval_prompts=eval_prompts, calib_prompts=calib_prompts, resamples=resamples, seed=seed)
    return AccuracyParameters(
        recipe,
        r,
        tuple(tasks),
        tuple(check_schemes(schemes)),
        tuple(dict.fromkeys(strategies)),
        eval_prompts,
        calib_prompts,
        resamples,
        seed,
        check_backend(experts_backend, "experts_backend"),
    )


# ----------------------------------------------------------------------------- model and data


# The task the studies single out when a parameter says "auto": addition, when the recipe trains it, else the
# recipe's first task. On the shipped default model addition is where the 4-bit schemes' loss is resolved (NVFP4's
# NLL; W4A4 MXFP4's NLL and exact match), as measured in mxlib.models.evaluation's docstring.
HARDEST_TASK = "add"


def choose_tasks(value, tasks, param: str) -> list[str]:
    """Tasks a notebook parameter names among ``tasks`` (the recipe's): ``"auto"`` gives ``[HARDEST_TASK]``
    where the recipe trains it, else the recipe's first task (so the ``test`` recipe's quick run works on
    every default); a name or a list of names is checked against ``tasks``.

    Raises:
        ValueError: naming ``param``, the allowed tasks and the value.
    """
    tasks = list(tasks)
    if value == "auto":
        return [HARDEST_TASK] if HARDEST_TASK in tasks else tasks[:1]
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not names or any(n not in tasks for n in names):
        raise ValueError(f'{param}: expected "auto" or task names among {tasks}, got {value!r}')
    return list(names)


def trained_model(p: AccuracyParameters, cache_dir=None, log=print, log_every: int = 500, retrain: bool = False):
    """The bf16 model of ``p.recipe`` (``mxlib.models.training.train``): the model mxlib ships for it (the
    same on every machine), or with ``retrain`` (or a recipe nothing is shipped for) from the cache under
    ``cache_dir`` (default ``default_cache_dir() / "trained"``), else trained there first, its progress
    passed to ``log`` every ``log_every`` steps. The model carries ``mxlib_training``."""
    if not isinstance(retrain, bool):
        raise ValueError(f"retrain: expected True or False, got {retrain!r}")
    cache = Path(cache_dir) if cache_dir else default_cache_dir() / "trained"

    def progress(r: dict) -> None:
        if r["step"] % log_every == 0 or r["step"] == p.recipe.steps - 1:
            log(f"[train] step {r['step']}: loss {r['loss']:.4f}, {r['seconds']:.0f} s")

    model = train(p.recipe, cache, log=progress if log else None, retrain=retrain)
    info = model.mxlib_training
    if log:
        how = "shipped" if info.get("shipped") else ("cached" if info["cache_hit"] else "trained")
        log(f"[train] {how} {info['key']} (trained in {info['train_seconds']:.0f} s with torch {info['torch']})")
    return model


def evaluation_sets(p: AccuracyParameters) -> list[Dataset]:
    """``p.eval_prompts`` held-out prompts of each task of ``p``, drawn with ``p.seed``."""
    return [make_dataset(t, p.eval_prompts, p.seed, "heldout") for t in p.tasks]


def calibration_sets(p: AccuracyParameters) -> list[Dataset]:
    """``p.calib_prompts`` training-split prompts of every task the recipe trains on (its training mix)."""
    return [make_dataset(t, p.calib_prompts, p.seed, "train") for t in p.recipe.tasks]


def calibrate_on_training_mix(model, p: AccuracyParameters) -> Calibration:
    """Per-expert a1 / a2 amax on ``calibration_sets(p)`` with the activations kept (``amax_study``)."""
    return ev.calibrate_tasks(model, calibration_sets(p), keep_activations=True)


# ----------------------------------------------------------------------------- rows


def result_rows(
    label: dict, results: ev.Results, reference: ev.Results, noise_floor: dict, other: ev.Results | None = None
) -> list[dict]:
    """One row per task: ``label``'s items, exact match and NLL per token with their intervals, the
    paired difference against ``reference`` (``delta_*``, ``flips``) and, with ``other``, against it
    (``vs_*``). ``loses`` / ``gains``: the exact-match difference against ``reference`` excludes 0
    and exceeds ``noise_floor`` (``noise_floor_study``'s) on that task; ``nll_rises`` likewise for NLL."""
    diffs = ev.compare(reference, results)
    vs = ev.compare(other, results) if other is not None else {}
    rows = []
    for t, r in results.tasks.items():
        d_em, d_nll = diffs[t]["exact_match"], diffs[t]["nll_per_token"]
        em_counts = d_em.beyond(noise_floor[t]["exact_match"])
        row = dict(
            label,
            task=t,
            exact_match=r.exact_match.estimate,
            exact_match_low=r.exact_match.low,
            exact_match_high=r.exact_match.high,
            nll_per_token=r.nll_per_token.estimate,
            nll_low=r.nll_per_token.low,
            nll_high=r.nll_per_token.high,
            delta_exact_match=d_em.estimate,
            delta_low=d_em.low,
            delta_high=d_em.high,
            flips=d_em.flips,
            delta_nll=d_nll.estimate,
            delta_nll_low=d_nll.low,
            delta_nll_high=d_nll.high,
            loses=em_counts and d_em.estimate < 0,
            gains=em_counts and d_em.estimate > 0,
            nll_rises=d_nll.beyond(noise_floor[t]["nll_per_token"]) and d_nll.estimate > 0,
        )
        if t in vs:
            v_em, v_nll = vs[t]["exact_match"], vs[t]["nll_per_token"]
            row.update(
                vs_exact_match=v_em.estimate,
                vs_low=v_em.low,
                vs_high=v_em.high,
                vs_beyond=v_em.beyond(noise_floor[t]["exact_match"]),
                vs_nll=v_nll.estimate,
                vs_nll_low=v_nll.low,
                vs_nll_high=v_nll.high,
                vs_nll_beyond=v_nll.beyond(noise_floor[t]["nll_per_token"]),
            )
        rows.append(row)
    return rows


def _kw(p: AccuracyParameters) -> dict:
    return dict(resamples=p.resamples, seed=p.seed)


# ----------------------------------------------------------------------------- studies


def noise_floor_study(model, sets: list[Dataset], p: AccuracyParameters) -> dict:
    """``evaluation.noise_floor`` of the bf16 model: ``{"reference": Results, "noise_floor": {task: {...}},
    "rows": one row per (variant, task) with the paired differences and flips}``."""
    nf = ev.noise_floor(model, sets, **_kw(p))
    rows = []
    for variant, diffs in nf["differences"].items():
        for t, d in diffs.items():
            em, nll = d["exact_match"], d["nll_per_token"]
            rows.append(
                dict(
                    variant=variant,
                    task=t,
                    delta_exact_match=em.estimate,
                    delta_low=em.low,
                    delta_high=em.high,
                    flips=em.flips,
                    delta_nll=nll.estimate,
                    delta_nll_low=nll.low,
                    delta_nll_high=nll.high,
                )
            )
    return dict(reference=nf["reference"], noise_floor=nf["noise_floor"], rows=rows)


def _load(path, p: AccuracyParameters, scale_strategy: str = "max"):
    with warnings.catch_warnings():  # the unification warning is what strategy_study measures
        warnings.simplefilter("ignore")
        model, _ = load_quantized_qwen3_moe(path, backend=p.experts_backend, scale_strategy=scale_strategy)
    return model


def scheme_study(
    model,
    sets,
    calibration: Calibration,
    reference: ev.Results,
    noise_floor: dict,
    p: AccuracyParameters,
    cache_dir=None,
    log=print,
) -> dict:
    """Every scheme of ``p``: a checkpoint in its real layout (``prepare_checkpoint``, cached in
    ``cache_dir``), loaded back (``load_quantized_qwen3_moe``), evaluated on ``sets``.

    Returns ``{"rows": result_rows per scheme (plus bits_per_weight, checkpoint_bytes, seconds),
    "results": {scheme: Results}, "paths": {scheme: checkpoint folder}, "routed": {scheme: RoutedTokens}}``; bf16's
    own rows first. ``routed``: every router's ``topk_ids`` in the scheme's evaluation, recorded during it
    (``mxlib.models.routing_consistency.recording_routing``; ``mxlib.studies.routing_agreement`` compares them with
    bf16's).
    """
    bf16_bytes = sum(t.numel() * 2 for t in model.state_dict().values())
    rows = result_rows(
        dict(scheme="bf16", bits_per_weight=16.0, checkpoint_bytes=bf16_bytes), reference, reference, noise_floor
    )
    results, paths, routed = {}, {}, {}
    for s in p.schemes:
        t0 = time.perf_counter()
        path = prepare_checkpoint(s, model, calibration=calibration, cache_dir=cache_dir)
        q = _load(path, p)
        with recording_routing(q) as rec:  # the evaluation's own forward passes: no pass of its own
            results[s.name] = r = ev.evaluate(q, sets, **_kw(p))
        routed[s.name] = rec.routed()
        del q
        paths[s.name] = path
        label = dict(
            scheme=s.name, bits_per_weight=s.weight.bits_per_element, checkpoint_bytes=checkpoint_size_bytes(path)
        )
        new = result_rows(label, r, reference, noise_floor)
        for row in new:
            row["seconds"] = time.perf_counter() - t0
        rows += new
        if log:
            log(f"[schemes] {s.name}: " + ", ".join(f"{t} {x.exact_match.estimate:.3f}" for t, x in r.tasks.items()))
    return dict(rows=rows, results=results, paths=paths, routed=routed)


def strategy_study(
    model,
    sets,
    calibration: Calibration,
    reference: ev.Results,
    noise_floor: dict,
    p: AccuracyParameters,
    cache_dir=None,
    log=print,
) -> dict:
    """The NVFP4 checkpoint under each strategy of ``p.strategies`` (the loader's ``scale_strategy``).

    Returns ``{"rows": result_rows per strategy, against bf16 and (``vs_*``) against ``max`` when
    ``max`` is among the strategies, "results": {strategy: Results}, "path"}``.
    """
    path = prepare_checkpoint(NVFP4_MOE, model, calibration=calibration, cache_dir=cache_dir)
    order = sorted(p.strategies, key=lambda s: s != "max")  # max first: the others are compared with it
    results = {}
    for s in order:
        q = _load(path, p, s)
        results[s] = ev.evaluate(q, sets, **_kw(p))
        del q
        if log:
            log(
                f"[strategies] {s}: "
                + ", ".join(f"{t} {x.exact_match.estimate:.3f}" for t, x in results[s].tasks.items())
            )
    base = results.get("max")
    rows = []
    for s in p.strategies:
        rows += result_rows(dict(strategy=s), results[s], reference, noise_floor, base if s != "max" else None)
    return dict(rows=rows, results=results, path=path)


class reciprocal_global_scales:
    """``with reciprocal_global_scales(model): ...`` runs ``model`` with every NVFP4 weight global scale
    (``w13_weight_scale_2``, ``w2_weight_scale_2``) replaced by its reciprocal, then restores the
    stored values bit for bit: the encode / decode confusion between compressed-tensors' and
    ModelOpt's global scale conventions. Yields the number of tensors changed.

    Raises:
        ValueError: ``model`` holds no such tensor (the control would prove nothing).
    """

    def __init__(self, model) -> None:
        self.tensors = [
            t
            for m in model.modules()
            for t in (getattr(m, "w13_weight_scale_2", None), getattr(m, "w2_weight_scale_2", None))
            if isinstance(t, torch.Tensor)
        ]
        if not self.tensors:
            raise ValueError("model: no w13_weight_scale_2 / w2_weight_scale_2 tensors (no NVFP4 experts)")
        self.saved: list[torch.Tensor] = []

    def __enter__(self) -> int:
        self.saved = [t.clone() for t in self.tensors]
        for t in self.tensors:
            t.reciprocal_()
        return len(self.tensors)

    def __exit__(self, *exc) -> None:
        for t, v in zip(self.tensors, self.saved):
            t.copy_(v)


# the negative controls: a name and a context manager that breaks a loaded NVFP4 model's experts
NEGATIVE_CONTROLS = {"swapped nibbles": swapped_nibbles, "reciprocal global scale": reciprocal_global_scales}


def negative_control(model, path, sets, noise_floor: dict, p: AccuracyParameters, prompts: int = 100) -> list[dict]:
    """The checkpoint at ``path`` (NVFP4) broken by each of ``NEGATIVE_CONTROLS`` in turn and evaluated on the
    first ``prompts`` prompts of each set, against the bf16 ``model`` on the same prompts:
    ``result_rows`` labelled ``control=<name>``.

    * ``swapped nibbles`` (``probes.swapped_nibbles``, notebook 01's control): each packed byte's two
      e2m1 codes swapped, a packing bug that neither shapes nor scales reveal; it permutes adjacent
      input columns of every expert weight, so it moves every answer the experts decide;
    * ``reciprocal global scale`` (``reciprocal_global_scales``): each weight global scale read in the
      other convention; the expert outputs are off by orders of magnitude and accuracy collapses.
    """
    subsets = [Dataset(d.task, d.split, d.seed, d.prompts[:prompts], d.answers[:prompts]) for d in sets]
    ref = ev.evaluate(model, subsets, **_kw(p))
    q = _load(path, p)
    rows = []
    for name, control in NEGATIVE_CONTROLS.items():
        with control(q):
            r = ev.evaluate(q, subsets, **_kw(p))
        rows += result_rows(dict(control=name), r, ref, noise_floor)
    return rows


def _kl_rows(counts: torch.Tensor) -> torch.Tensor:
    """KL(usage || uniform) per row of counts ``[..., E]`` (nats)."""
    p = counts.double() / counts.double().sum(-1, keepdim=True)
    e = p.shape[-1]
    return torch.where(p > 0, p * torch.log(p * e), torch.zeros_like(p)).sum(-1)


def routing_study(model, sets, resamples: int = 1000, seed: int = 0) -> dict:
    """Per task and layer, the learned routing against uniform.

    ``kl``: KL(usage || uniform) of the task's routed (token, expert) pairs
    (``evaluation.expert_counts``), with a percentile bootstrap interval over prompts
    (``kl_low``, ``kl_high``; 95 %); ``null_kl``: the ``ROUTING_NULL_QUANTILE`` quantile of the KL
    that uniform routing of the same number of pairs shows by chance (``resamples`` seeded draws,
    experts drawn with replacement, which spreads more than top-k without replacement);
    ``differs``: ``kl_low > null_kl``. ``max_share``: the largest expert's share over the uniform share.

    Returns ``{"rows": [...], "usage": {task: [L][E] fractions}}``.
    """
    gen = torch.Generator().manual_seed(seed)
    rows, usage = [], {}
    for d in sets:
        counts = ev.expert_counts(model, d)  # [n, L, E]
        n, num_layers, e = counts.shape
        total = counts.sum(0)
        usage[d.task] = (total.double() / total.sum(-1, keepdim=True)).tolist()
        idx = torch.randint(0, n, (resamples, n), generator=gen)
        weights = torch.zeros(resamples, n, dtype=torch.float64).scatter_add_(1, idx, torch.ones(resamples, n).double())
        boot = _kl_rows((weights @ counts.reshape(n, -1).double()).reshape(resamples, num_layers, e))
        pairs = int(total[0].sum())
        null = torch.stack(
            [
                _kl_rows(torch.bincount(torch.randint(0, e, (pairs,), generator=gen), minlength=e))
                for _ in range(resamples)
            ]
        )
        null_q = float(torch.quantile(null, ROUTING_NULL_QUANTILE))
        kl = _kl_rows(total)
        for layer in range(num_layers):
            low, high = torch.quantile(boot[:, layer], torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
            rows.append(
                dict(
                    task=d.task,
                    layer=layer,
                    pairs=pairs,
                    kl=float(kl[layer]),
                    kl_low=low,
                    kl_high=high,
                    null_kl=null_q,
                    differs=low > null_q,
                    max_share=float(total[layer].max() / total[layer].sum() * e),
                )
            )
    return dict(rows=rows, usage=usage)


def amax_study(calibration: Calibration) -> dict:
    """Notebook 04's mechanism on the trained model: per layer, expert and activation point (a1, a2)
    the calibrated amax, the scale ratio ``r`` to the layer's largest, and what ``max`` does to the
    expert's own calibration activations against ``per_expert`` (SQNR, dB lost, subnormal and flushed
    e4m3 block scales; ``studies.unification_study``).

    Returns ``{"experts": rows, "summary": one row per point (smallest ratio, experts below
    NVFP4_SUBNORMAL_RATIO / NVFP4_FLUSH_RATIO, largest subnormal-block fraction, mean and worst dB lost)}``.
    """
    study = unification_study(calibration, ("max", "per_expert"))
    amax = {"a1": [lc.a1_amax for lc in calibration.layers], "a2": [lc.a2_amax for lc in calibration.layers]}
    rows = []
    for r in study["experts"]:
        rows.append(dict(r, amax=float(amax[r["point"]][r["layer"]][r["expert"]])))
    summary = []
    for point in ("a1", "a2"):
        pr = [r for r in rows if r["point"] == point]
        summary.append(
            dict(
                point=point,
                experts=len(pr),
                min_ratio=min(r["scale_ratio"] for r in pr),
                below_subnormal_ratio=sum(r["scale_ratio"] < NVFP4_SUBNORMAL_RATIO for r in pr),
                below_flush_ratio=sum(r["scale_ratio"] < NVFP4_FLUSH_RATIO for r in pr),
                max_subnormal_blocks_max=max(r["subnormal_max"] for r in pr),
                max_subnormal_blocks_per_expert=max(r["subnormal_per_expert"] for r in pr),
                mean_db_lost_max=sum(r["db_lost_max"] for r in pr) / len(pr),
                worst_db_lost_max=max(r["db_lost_max"] for r in pr),
            )
        )
    return dict(experts=rows, summary=summary)


# ----------------------------------------------------------------------------- claims


def _iv(est: float, low: float, high: float, fmt: str = "+.3f") -> str:
    return f"{est:{fmt}} [{low:{fmt}}, {high:{fmt}}]"


def claims(rows: list[dict], key: str, noise_floor: dict) -> list[str]:
    """Sentences for the rows whose difference counts (``result_rows``' ``loses`` / ``gains`` /
    ``nll_rises`` against bf16; ``vs_beyond`` / ``vs_nll_beyond`` against the ``vs`` run), each
    with its paired interval and the task's noise floor; nothing is said of the other rows."""
    out = []
    for r in rows:
        name, t, fl = r[key], r["task"], noise_floor[r["task"]]
        if r["loses"] or r["gains"]:
            verb = "loses" if r["loses"] else "gains"
            out.append(
                f"{name} {verb} exact match on {t}: {_iv(r['delta_exact_match'], r['delta_low'], r['delta_high'])} "
                f"against bf16 (noise floor {fl['exact_match']:.4f})"
            )
        if r["nll_rises"]:
            out.append(
                f"{name} raises the NLL on {t}: {_iv(r['delta_nll'], r['delta_nll_low'], r['delta_nll_high'], '+.2g')} "
                f"nats/token against bf16 (noise floor {fl['nll_per_token']:.2g})"
            )
        if r.get("vs_beyond"):
            out.append(
                f"{name} differs from max in exact match on {t}: {_iv(r['vs_exact_match'], r['vs_low'], r['vs_high'])}"
            )
        if r.get("vs_nll_beyond"):
            out.append(
                f"{name} differs from max in NLL on {t}: "
                f"{_iv(r['vs_nll'], r['vs_nll_low'], r['vs_nll_high'], '+.2g')} nats/token"
            )
    return out


def training_summary(model) -> dict:
    """The trained model's manifest fields the results JSON records; ``shipped``: the model mxlib ships."""
    info = model.mxlib_training
    keys = ("key", "sha256", "train_seconds", "cache_hit", "torch", "transformers")
    return {k: info[k] for k in keys} | {"shipped": bool(info.get("shipped", False))}
