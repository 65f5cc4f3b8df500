"""What wins FP4 accuracy back: notebook 07's studies, every recovery technique side by side.

A recovery technique (``mxlib.recovery``) chooses other scales and codes in the same format (4/6
block scaling, an MSE scale search, GPTQ) or changes the basis the weights are stored in (a block
Hadamard rotation, undone online on the activations). This module runs every technique named in
the notebook's parameters through the same path a user would take and measures it:

1. ``check_recovery_parameters``: the parameters checked; technique names resolved against
   ``mxlib.recovery.TECHNIQUES`` (``"+"`` joins a composition, ``"gptq+hadamard"``) before anything runs.
2. ``trained_study``: on the trained model of ``mxlib.studies.accuracy`` each (scheme, technique)
   checkpoint is written by ``write_quantized_checkpoint(..., technique=...)`` into a temporary
   folder, read back by ``load_quantized_qwen3_moe`` and evaluated: exact match and NLL per task
   with bootstrap intervals, each technique against round-to-nearest (``rtn``) with a paired
   interval (``accuracy.result_rows``' ``vs_*`` columns), the noise floor of ``accuracy.noise_floor_study``.
3. ``dummy_study``: on a few layers of the dummy Qwen3-30B-A3B layer shape, the weight MSE of each
   technique (in the basis it stores) and every decoder layer's SQNR against bf16, on calibration
   and on held-out token ids; the quantization time; the MoE block's forward time.
4. Run-time cost: a technique whose checkpoint config is empty changes only scales and codes, so
   its loaded experts must run RTN's kernel path (``kernel_path``: the experts' class, backend,
   numerics, FP4-kernel eligibility and buffers); a rotation stores its config and its forward is
   timed against RTN's.

Techniques that need calibration Hessians (their factory takes ``hessians``: GPTQ) get
``mxlib.models.hessians.collect_expert_hessians`` on training-split prompts, disjoint from the
held-out evaluation prompts by construction (``mxlib.models.tasks.split_of``).

``claims`` states a difference against RTN only where its paired interval excludes 0 and its size
exceeds the task's noise floor. Two controls run beside the techniques: ``ScaleStepUp`` (every
block's scale steps up: E8M0 exponent + n, NVFP4's global scale times 2^n), worse by construction,
and ``SwappedNibbles`` (RTN with each packed byte's nibbles swapped), broken, which the intervals
must separate from RTN.
"""

from __future__ import annotations

import inspect
import json
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoints import load_quantized_qwen3_moe, write_quantized_checkpoint
from ..models import evaluation as ev
from ..models.calibration import Calibration, calibrate
from ..models.qwen3 import MODEL_PRESETS, moe_layers
from ..moe.schemes import MoEQuantScheme
from ..recovery import TECHNIQUES, get_technique
from .accuracy import AccuracyParameters, check_accuracy_parameters, result_rows
from .recovery_measures import MeasuredTechnique, ScaleStepUp, SwappedNibbles, block_changes, kernel_path
from .steps import check_parameters, check_positive_int, compare_runs, run_model

__all__ = [
    "DEFAULT_TECHNIQUES",
    "COMBINATIONS",
    "BASELINE",
    "technique_names",
    "needs_hessians",
    "build_technique",
    "RecoveryParameters",
    "check_recovery_parameters",
    "ScaleStepUp",
    "SwappedNibbles",
    "calibration_hessians",
    "trained_study",
    "dummy_study",
    "claims",
    "side_by_side",
    "recorded_rotation_benchmarks",
]

# The techniques the notebook runs by default: their registry names (mxlib.recovery.TECHNIQUES); four_over_six_mse
# (in "all") chose the same scales as mse on the dummy weights at twice its CPU time.
DEFAULT_TECHNIQUES = "rtn,four_over_six,mse,gptq,hadamard,gptq+hadamard"
# Compositions that "all" adds where every part is registered (GPTQ on rotated weights: MR-GPTQ).
COMBINATIONS = ("gptq+hadamard",)
# The technique every other one is compared with.
BASELINE = "rtn"


# ----------------------------------------------------------------------------- technique names


def technique_names(techniques="all") -> tuple[str, ...]:
    """The technique names of a notebook parameter, ``rtn`` first.

    ``techniques``: ``"all"`` (every name of ``TECHNIQUES``, then each of ``COMBINATIONS`` whose
    parts are registered), a comma-separated string or a list of names; a name joins registered
    techniques with ``"+"`` (a composition ``get_technique`` builds). ``rtn`` is added first when absent.

    Raises:
        ValueError: an empty list, or a name (or part of one) not registered; the message lists
            ``TECHNIQUES``.
    """
    if techniques == "all":
        names = [*TECHNIQUES, *(c for c in COMBINATIONS if all(p in TECHNIQUES for p in c.split("+")))]
    elif isinstance(techniques, str):
        names = [t.strip() for t in techniques.split(",") if t.strip()]
    else:
        names = list(techniques)
    if not names or not all(isinstance(n, str) for n in names):
        raise ValueError(f"techniques: expected 'all' or names of {sorted(TECHNIQUES)}, got {techniques!r}")
    missing = sorted({p for n in names for p in n.split("+") if p not in TECHNIQUES})
    if missing:
        raise ValueError(
            f"techniques: {missing} not registered in mxlib.recovery.TECHNIQUES; expected names (or '+' "
            f"compositions) of {sorted(TECHNIQUES)}"
        )
    return tuple(dict.fromkeys([BASELINE, *names]))


def needs_hessians(name: str) -> bool:
    """Whether a technique name (or a part of a composition) is built from calibration Hessians:
    its factory in ``TECHNIQUES`` takes a ``hessians`` argument."""
    for part in name.split("+"):
        try:
            params = inspect.signature(TECHNIQUES[part]).parameters
        except (TypeError, ValueError):  # a factory without a signature takes no options
            continue
        if "hessians" in params:
            return True
    return False


def build_technique(name: str, hessians=None):
    """``get_technique(name)``, with ``hessians=`` for a technique that needs them (``needs_hessians``).

    Raises:
        ValueError: ``name`` needs Hessians and ``hessians`` is None; what ``get_technique`` raises.
    """
    if needs_hessians(name):
        if hessians is None:
            raise ValueError(f"hessians: technique {name!r} needs calibration Hessians (collect_expert_hessians)")
        return get_technique(name, hessians=hessians)
    return get_technique(name)


# ----------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class RecoveryParameters:
    """Notebook 07's parameters, checked (``check_recovery_parameters``).

    ``accuracy``: the trained-model parameters (``accuracy.AccuracyParameters``: recipe, tasks,
    schemes, prompts, resamples, seed, experts backend); ``techniques``: names, ``rtn`` first;
    ``dummy_*``: the dummy model's size preset (``mxlib.models.qwen3.MODEL_PRESETS``), decoder
    layers, experts, top-k and token ids (held-out and calibration).
    """

    accuracy: AccuracyParameters
    techniques: tuple[str, ...]
    dummy_preset: str
    dummy_layers: int
    dummy_experts: int
    dummy_top_k: int
    dummy_tokens: int
    dummy_calib_tokens: int

    @property
    def schemes(self) -> tuple[MoEQuantScheme, ...]:
        return self.accuracy.schemes


def check_recovery_parameters(
    recipe: str = "default",
    tasks="all",
    schemes=("nvfp4", "w_mxfp4_a_mxfp4"),
    techniques=DEFAULT_TECHNIQUES,
    eval_prompts: int = 400,
    calib_prompts: int = 64,
    resamples: int = 1000,
    seed: int = 0,
    experts_backend: str = "auto",
    dummy_preset: str = "qwen3-30b-a3b",
    dummy_layers: int = 2,
    dummy_experts: int = 4,
    dummy_top_k: int = 2,
    dummy_tokens: int = 128,
    dummy_calib_tokens: int = 256,
) -> RecoveryParameters:
    """Every parameter checked and every name resolved once, before anything runs.

    ``recipe`` .. ``experts_backend``: as ``accuracy.check_accuracy_parameters``; ``techniques``: as
    ``technique_names``; ``dummy_preset`` a key of ``MODEL_PRESETS``; the other ``dummy_*`` sizes within
    the bounds of ``mxlib.models.parameters.PARAMETER_BOUNDS`` (``PARAMETER_ALIASES``: layers, tokens,
    calibration tokens and experts, the first and the last up to the preset's model), ``dummy_top_k`` from 1 to
    ``dummy_experts``.

    Raises:
        ValueError: naming the parameter (an unknown recipe, task, scheme, technique or backend; a size).
    """
    acc = check_accuracy_parameters(
        recipe, tasks, schemes, ("max",), eval_prompts, calib_prompts, resamples, seed, experts_backend
    )
    names = technique_names(techniques)
    if dummy_preset not in MODEL_PRESETS:
        raise ValueError(f"dummy_preset: expected one of {list(MODEL_PRESETS)}, got {dummy_preset!r}")
    sizes = dict(
        dummy_layers=dummy_layers,
        dummy_experts=dummy_experts,
        dummy_top_k=dummy_top_k,
        dummy_tokens=dummy_tokens,
        dummy_calib_tokens=dummy_calib_tokens,
    )
    check_positive_int(dummy_top_k, "dummy_top_k")
    # each a quantity of PARAMETER_BOUNDS (PARAMETER_ALIASES), bounded by the preset's model
    check_parameters(dummy_preset, **{k: v for k, v in sizes.items() if k != "dummy_top_k"})
    if dummy_top_k > dummy_experts:
        raise ValueError(f"dummy_top_k: expected at most dummy_experts={dummy_experts}, got {dummy_top_k}")
    return RecoveryParameters(acc, names, dummy_preset, **sizes)


def calibration_hessians(model, datasets, batch_size: int = 64):
    """``collect_expert_hessians`` on the prompt-and-answer sequences of ``datasets`` (one call per
    sequence length), summed: the per-expert sums of x xᵀ and the token counts add."""
    from ..models.hessians import ExpertHessians, LayerHessians, collect_expert_hessians

    by_length: dict[int, list] = {}
    for d in datasets:
        seq = torch.cat([d.prompts, d.answers], 1)
        by_length.setdefault(seq.shape[1], []).append(seq)
    parts = [collect_expert_hessians(model, torch.cat(v), batch_size=batch_size) for v in by_length.values()]
    out = ExpertHessians(num_tokens=sum(h.num_tokens for h in parts))
    for layer in parts[0].layers:
        ls = [h.layers[layer] for h in parts]
        out.layers[layer] = LayerHessians(
            *(torch.stack([getattr(x, k) for x in ls]).sum(0) for k in ("h13", "h2", "tokens"))
        )
    return out


def _write(model, scheme, path, calibration, measured, name, skipped: list):
    """``write_quantized_checkpoint`` through ``measured``; a technique that refuses the scheme (a
    ``ValueError``: 4/6 stores NVFP4 weights only) is recorded in ``skipped`` with its message and None returned."""
    try:
        return write_quantized_checkpoint(model, scheme, path, calibration, technique=measured, overwrite=True)
    except ValueError as err:
        if name == BASELINE:
            raise
        skipped.append(dict(scheme=scheme.name, technique=name, reason=str(err)))
        return None


def _safe(name: str) -> str:
    return name.replace("+", "_plus_")


def _load(path, backend: str):
    with warnings.catch_warnings():  # the unification warning is notebook 06's subject
        warnings.simplefilter("ignore")
        model, _ = load_quantized_qwen3_moe(path, backend=backend)
    return model


def _label(scheme, name, measured: MeasuredTechnique, path, rtn_path_of) -> dict:
    errs = measured.errors.values()
    n = len(measured.errors)
    return dict(
        scheme=scheme.name,
        technique=name,
        quantize_seconds=sum(measured.seconds.values()),
        weight_mse=sum(e["mse"] for e in errs) / n,
        weight_sqnr_db=sum(e["sqnr_db"] for e in errs) / n,
        energy_ratio=max(e["energy_ratio"] for e in errs),
        layers=n,
        online=bool(measured.config()),
        same_kernel_path=rtn_path_of(scheme) == path if rtn_path_of(scheme) is not None else True,
    )


# ----------------------------------------------------------------------------- the trained model


def trained_study(
    model,
    sets,
    calibration: Calibration,
    calib_sets,
    reference: ev.Results,
    noise_floor: dict,
    p: RecoveryParameters,
    folder=None,
    extra_techniques: dict | None = None,
    log=print,
) -> dict:
    """Every (scheme, technique) of ``p`` on the trained ``model``: a checkpoint written through
    ``write_quantized_checkpoint(model, scheme, path, calibration, technique=...)`` under ``folder``
    (a temporary folder, removed after, when None), loaded (``load_quantized_qwen3_moe``) and
    evaluated on ``sets``; Hessians (``calibration_hessians`` on ``calib_sets``) for the techniques
    that need them, collected once. ``extra_techniques``: ``{name: WeightTechnique}`` run after
    the named ones (the negative control).

    Returns ``{"rows": accuracy.result_rows per (scheme, technique, task) against bf16 and (``vs_*``)
    against RTN, with quantize_seconds, weight_mse, weight_sqnr_db, online (the checkpoint stores a
    recovery config) and same_kernel_path (its loaded experts' ``kernel_path`` equals RTN's);
    "results": {(scheme, technique): Results}, "kernel_paths": {(scheme, technique): kernel_path},
    "skipped": [{scheme, technique, reason}] for the techniques that refuse a scheme, "hessian_seconds"}``.
    """
    acc = p.accuracy
    kw = dict(resamples=acc.resamples, seed=acc.seed)
    hessians, hessian_seconds = None, 0.0
    if any(needs_hessians(n) for n in p.techniques):
        t0 = time.perf_counter()
        hessians = calibration_hessians(model, calib_sets)
        hessian_seconds = time.perf_counter() - t0
    todo = [(n, None) for n in p.techniques] + list((extra_techniques or {}).items())
    rows, results, paths, skipped = [], {}, {}, []
    with tempfile.TemporaryDirectory(prefix="mxlib-recovery-") as tmp:
        root = Path(folder) if folder else Path(tmp)
        for s in acc.schemes:
            for name, tech in todo:
                measured = MeasuredTechnique(build_technique(name, hessians) if tech is None else tech)
                path = _write(model, s, root / f"{s.name}-{_safe(name)}", calibration, measured, name, skipped)
                if path is None:
                    continue
                q = _load(path, acc.experts_backend)
                paths[(s.name, name)] = kp = kernel_path(q)
                results[(s.name, name)] = r = ev.evaluate(q, sets, **kw)
                del q
                base = results.get((s.name, BASELINE)) if name != BASELINE else None
                label = _label(s, name, measured, kp, lambda sc: paths.get((sc.name, BASELINE)))
                rows += result_rows(label, r, reference, noise_floor, base)
                if log:
                    log(
                        f"[{s.name}] {name}: "
                        + ", ".join(f"{t} {x.exact_match.estimate:.3f}" for t, x in r.tasks.items())
                    )
    return dict(rows=rows, results=results, kernel_paths=paths, skipped=skipped, hessian_seconds=hessian_seconds)


# ----------------------------------------------------------------------------- the dummy model


@torch.no_grad()
def _block_seconds(model, token_ids: torch.Tensor, reps: int = 3) -> float:
    """The median time of layer 0's MoE block (router, experts and any online transform) on the
    hidden states ``token_ids`` bring to it."""
    mlp = moe_layers(model)[0]
    seen = {}
    handle = mlp.register_forward_pre_hook(lambda m, args: seen.setdefault("x", args[0].detach().clone()))
    try:
        model(input_ids=token_ids, use_cache=False)
    finally:
        handle.remove()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mlp(seen["x"])
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def dummy_study(
    dummy, calib_ids: torch.Tensor, eval_ids: torch.Tensor, p: RecoveryParameters, folder=None, extra_techniques=None
) -> dict:
    """Every (scheme, technique) of ``p`` on the dummy model: checkpoints written and loaded as in
    ``trained_study`` (static activation scales and Hessians from ``calib_ids [B, T]``), each run on
    ``calib_ids`` and ``eval_ids [1, T]`` beside the bf16 model.

    Returns ``{"rows": one per (scheme, technique) with quantize_seconds, weight_mse /
    weight_sqnr_db (per layer averaged; ``MeasuredTechnique``), layer_sqnr_db (held-out ids, per
    decoder layer), calib_layer_sqnr_db, logits_sqnr_db, block_seconds (layer 0's MoE block, median
    of 3) and block_seconds_over_rtn, online, same_kernel_path; "layer0": {(scheme, technique):
    block_changes against RTN's layer 0}, "skipped" (as ``trained_study``'s), "hessian_seconds"}``.
    """
    calibration = calibrate(dummy, calib_ids)
    ref_eval, ref_calib = run_model(dummy, eval_ids), run_model(dummy, calib_ids[:1])
    hessians, hessian_seconds = None, 0.0
    if any(needs_hessians(n) for n in p.techniques):
        from ..models.hessians import collect_expert_hessians

        t0 = time.perf_counter()
        hessians = collect_expert_hessians(dummy, calib_ids)
        hessian_seconds = time.perf_counter() - t0
    todo = [(n, None) for n in p.techniques] + list((extra_techniques or {}).items())
    rows, paths, layer0, rtn_weights, skipped = [], {}, {}, {}, []
    with tempfile.TemporaryDirectory(prefix="mxlib-recovery-") as tmp:
        root = Path(folder) if folder else Path(tmp)
        for s in p.schemes:
            for name, tech in todo:
                measured = MeasuredTechnique(build_technique(name, hessians) if tech is None else tech, keep=(0,))
                path = _write(dummy, s, root / f"{s.name}-{_safe(name)}", calibration, measured, name, skipped)
                if path is None:
                    continue
                q = _load(path, p.accuracy.experts_backend)
                paths[(s.name, name)] = kp = kernel_path(q)
                ev_run, cal_run = (
                    compare_runs(run_model(q, eval_ids), ref_eval),
                    compare_runs(run_model(q, calib_ids[:1]), ref_calib),
                )
                seconds = _block_seconds(q, eval_ids)
                del q
                if name == BASELINE:
                    rtn_weights[s.name] = measured.weights[0]
                layer0[(s.name, name)] = block_changes(measured.weights[0], rtn_weights[s.name])
                label = _label(s, name, measured, kp, lambda sc: paths.get((sc.name, BASELINE)))
                rtn_row = next((r for r in rows if r["scheme"] == s.name and r["technique"] == BASELINE), None)
                rows.append(
                    dict(
                        label,
                        layer_sqnr_db=[r["sqnr_db"] for r in ev_run["layers"]],
                        calib_layer_sqnr_db=[r["sqnr_db"] for r in cal_run["layers"]],
                        logits_sqnr_db=ev_run["logits"]["sqnr_db"],
                        block_seconds=seconds,
                        block_seconds_over_rtn=seconds / rtn_row["block_seconds"] if rtn_row else 1.0,
                    )
                )
    return dict(rows=rows, layer0=layer0, kernel_paths=paths, skipped=skipped, hessian_seconds=hessian_seconds)


# ----------------------------------------------------------------------------- claims and the table


def _iv(est: float, low: float, high: float, fmt: str = "+.3f") -> str:
    return f"{est:{fmt}} [{low:{fmt}}, {high:{fmt}}]"


def claims(rows: list[dict], noise_floor: dict) -> list[str]:
    """Sentences for the technique rows whose paired difference against RTN excludes 0 and exceeds
    the task's noise floor (``vs_beyond`` for exact match, ``vs_nll_beyond`` for NLL); nothing is
    said of the others."""
    out = []
    for r in rows:
        if r["technique"] == BASELINE:
            continue
        who, t, fl = f"{r['technique']} ({r['scheme']})", r["task"], noise_floor[r["task"]]
        if r.get("vs_beyond"):
            verb = "wins back" if r["vs_exact_match"] > 0 else "loses"
            out.append(
                f"{who} {verb} exact match on {t} against rtn: {_iv(r['vs_exact_match'], r['vs_low'], r['vs_high'])} "
                f"(noise floor {fl['exact_match']:.4f})"
            )
        if r.get("vs_nll_beyond"):
            verb = "lowers" if r["vs_nll"] < 0 else "raises"
            out.append(
                f"{who} {verb} the NLL on {t} against rtn: "
                f"{_iv(r['vs_nll'], r['vs_nll_low'], r['vs_nll_high'], '+.2g')} nats/token "
                f"(noise floor {fl['nll_per_token']:.2g})"
            )
    return out


def side_by_side(trained_rows: list[dict], dummy_rows: list[dict], task: str) -> list[dict]:
    """One row per (scheme, technique): the trained model's exact match and NLL on ``task`` with
    the paired difference against RTN ([95 % interval]; ``*`` where it exceeds the noise floor),
    the dummy model's weight MSE and last decoder layer's SQNR, the quantization time and the run
    time cost (``same kernels`` or the MoE block's time over RTN's)."""
    dummy = {(r["scheme"], r["technique"]): r for r in dummy_rows}
    out = []
    for r in trained_rows:
        if r["task"] != task or "technique" not in r:
            continue
        d = dummy.get((r["scheme"], r["technique"]))
        vs_em = vs_nll = "(baseline)"
        if "vs_exact_match" in r:
            vs_em = _iv(r["vs_exact_match"], r["vs_low"], r["vs_high"]) + (" *" if r["vs_beyond"] else "")
            vs_nll = _iv(r["vs_nll"], r["vs_nll_low"], r["vs_nll_high"], "+.4f") + (" *" if r["vs_nll_beyond"] else "")
        cost = "same kernels" if r["same_kernel_path"] and not r["online"] else "online transform"
        if d is not None and cost != "same kernels":
            cost += f" ({d['block_seconds_over_rtn']:.2f}x rtn's MoE block)"
        out.append(
            dict(
                scheme=r["scheme"],
                technique=r["technique"],
                exact_match=round(r["exact_match"], 4),
                vs_rtn=vs_em,
                nll_per_token=round(r["nll_per_token"], 5),
                nll_vs_rtn=vs_nll,
                dummy_weight_mse=None if d is None else float(f"{d['weight_mse']:.4g}"),
                dummy_last_layer_sqnr_db=None if d is None else round(d["layer_sqnr_db"][-1], 2),
                quantize_seconds=round(r["quantize_seconds"], 3),
                dummy_quantize_seconds_per_layer=None if d is None else round(d["quantize_seconds"] / d["layers"], 2),
                run_time=cost,
            )
        )
    return out


def recorded_rotation_benchmarks(folder=None) -> list[dict]:
    """The recorded H200 measurements of the online rotation: every JSON file under ``folder``
    (default: the ``benchmarks/`` folder of the source checkout mxlib runs from) whose name holds
    ``hadamard`` or ``rotation``, as ``{"file", "rows"}`` (its ``rows`` list, or the file's top-level
    entries as one row each). Empty when there are none (an installed mxlib has no ``benchmarks/``)."""
    folder = Path(folder) if folder else Path(__file__).resolve().parents[2] / "benchmarks"
    out = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        if "hadamard" not in path.name and "rotation" not in path.name:
            continue
        data = json.loads(path.read_text())
        rows = data.get("rows") if isinstance(data, dict) else data
        if not isinstance(rows, list):
            rows = [dict(key=k, value=json.dumps(v)[:200]) for k, v in data.items()]
        out.append(dict(file=path.name, rows=[r if isinstance(r, dict) else dict(value=r) for r in rows]))
    return out
