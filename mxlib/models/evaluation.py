"""Task accuracy of a model under a quantization scheme, with bootstrap confidence intervals.

``evaluate(model, datasets)`` scores a model on the held-out prompts of ``mxlib.models.tasks``:
per task, **exact match** (greedy decoding of ``answer_len`` tokens, every one equal to the answer,
``<eos>`` included) and the **per-token NLL** of the answer under teacher forcing (nats; the sum
over the task's answer tokens divided by their count). Both come from one teacher-forced forward
pass of prompt and answer: greedy decoding reproduces the answer exactly when, at every answer
position, the argmax of the teacher-forced logits is the answer's token (by induction: the first
generated token is the argmax after the prompt; while the generated prefix equals the answer's,
the next argmax is read from the same causal prefix). ``evaluate(..., decode="greedy")`` runs the
token-by-token decoding instead (``answer_len`` more forward passes); the tests check that both
give the same outcome on every prompt. Each comes with a percentile bootstrap
interval: prompts resampled with replacement ``resamples`` times (1000) from a seeded generator,
the 2.5th and 97.5th percentiles of the statistic (95 %). ``compare(a, b)`` gives ``b - a`` per
task and metric with a **paired** bootstrap interval (the same resampled prompts for both
models) and whether it excludes 0.

``noise_floor(model, datasets)`` measures how far the same bf16 model's metrics move under things
that should not matter: another batch size and order, left padding (with the attention mask and
position ids that keep every real token where it was), transformers' ``eager`` experts in place of
its default implementation, and mxlib's ``TritonExperts`` (``backend="torch"``, the pure-PyTorch
MoE) on the same bf16 weights. A scheme's loss counts when its paired interval excludes 0 and
its size is beyond that noise floor.

``emulated_experts(model, scheme, calibration)`` swaps every layer's experts for the scheme's
emulation experts (``mxlib.moe.quantize_expert_weights`` then ``make_emulation_experts``,
``backend="torch"``) and restores them on exit; ``calibrate_tasks`` records the per-expert amax of
the expert inputs (``mxlib.models.calibration``) on training-split prompts, for the static NVFP4
input scales (unified to the max over experts, as vLLM does). ``expert_counts`` (per prompt) and
``expert_usage`` (per task) measure the learned routing.

Measured on the model mxlib ships for the ``default`` recipe (``training.load_shipped("default")``), 2000 held-out
prompts per task drawn with seed 0, the emulation experts of ``emulated_experts`` (NVFP4's static scales calibrated
on 256 training prompts of each task), every difference against bf16 decided together by ``mxlib.stats`` (32
comparisons: four schemes, four tasks, two metrics; Holm at 0.05; each task's ``noise_floor`` as the smallest
difference worth reporting). On ``add``, with paired 95 % bootstrap intervals against bf16:

=========================  =======================  ============================  =========  ======================
add                        exact match              minus bf16 (paired)           NLL/token  NLL minus bf16, 1e-3
=========================  =======================  ============================  =========  ======================
bf16                       0.9675 [0.9605, 0.9745]                                0.01542
nvfp4                      0.9615 [0.9535, 0.9695]  -0.0060 [-0.0110, -0.0010]    0.01948    +4.06 [+2.79, +5.29] *
w_mxfp4_a_mxfp4            0.9520 [0.9430, 0.9615]  -0.0155 [-0.0215, -0.0095] *  0.02342    +8.00 [+6.49, +9.42] *
w_mxfp4                    0.9650 [0.9575, 0.9720]  -0.0025 [-0.0060, +0.0010]    0.01751    +2.09 [+1.40, +2.84] *
w_mxfp6_e2m3_a_mxfp6_e2m3  0.9670 [0.9595, 0.9740]  -0.0005 [-0.0035, +0.0020]    0.01602    +0.61 [+0.05, +1.20]
=========================  =======================  ============================  =========  ======================

``*``: decided (``"bf16 better"``). Addition is where the 4-bit schemes' loss is resolved: NVFP4's NLL rises
(its exact-match loss, 12 of 2000 prompts, cannot be told apart from none), W4A4 MXFP4 loses in both (31 prompts),
weight-only MXFP4's NLL rises (its exact match cannot be told apart), and W6A6 MXFP6 cannot be told apart from
bf16. On the other tasks only W4A4 MXFP4's NLL on ``sort`` is decided (+0.0007 nats/token); no exact-match
difference is. The noise floor on ``add``: no net exact-match change (two prompts flip, one each way) and 1.5e-4
nats/token.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass, field

import torch

from ..moe import TritonExperts, input_scales_from_amax, make_emulation_experts, quantize_expert_weights
from ..moe.schemes import get_moe_scheme
from .calibration import Calibration, LayerCalibration, calibrate
from .families import check_supported_model, family_of
from .qwen3 import expert_weights, moe_layers, swap_experts
from .tasks import TOKENIZER, Dataset

__all__ = [
    "Interval",
    "TaskResult",
    "Results",
    "Difference",
    "bootstrap_interval",
    "paired_bootstrap_interval",
    "DECODES",
    "greedy_decode",
    "evaluate",
    "compare",
    "noise_floor",
    "swapped_experts",
    "emulated_experts",
    "calibrate_tasks",
    "expert_counts",
    "expert_usage",
    "kl_from_uniform",
]

RESAMPLES = 1000
CONFIDENCE = 0.95


# ----------------------------------------------------------------------------- bootstrap


@dataclass(frozen=True)
class Interval:
    """A statistic and its bootstrap interval ``[low, high]``."""

    estimate: float
    low: float
    high: float

    def __str__(self) -> str:
        return f"{self.estimate:.4f} [{self.low:.4f}, {self.high:.4f}]"


def _check_bootstrap(n: int, resamples: int, confidence: float) -> None:
    if n <= 0:
        raise ValueError("values: expected at least one value, got an empty tensor")
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples <= 0:
        raise ValueError(f"resamples: expected a positive int, got {resamples!r}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence: expected a value in (0, 1), got {confidence}")


def _resample_stats(values: list[torch.Tensor], weights: torch.Tensor | None, resamples: int, seed: int):
    n = values[0].shape[0]
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, n, (resamples, n), generator=gen)
    den = weights.double()[idx].sum(1) if weights is not None else float(n)
    return [v.double()[idx].sum(1) / den for v in values]


def _percentiles(stats: torch.Tensor, confidence: float) -> tuple[float, float]:
    q = torch.tensor([(1 - confidence) / 2, (1 + confidence) / 2], dtype=torch.float64)
    low, high = torch.quantile(stats, q).tolist()
    return low, high


def bootstrap_interval(
    values: torch.Tensor,
    weights: torch.Tensor | None = None,
    resamples: int = RESAMPLES,
    confidence: float = CONFIDENCE,
    seed: int = 0,
) -> Interval:
    """Percentile bootstrap interval of ``sum(values) / sum(weights)`` (the mean without weights).

    Args:
        values: ``[n]`` per-prompt values (bool or float); weights: ``[n]`` (e.g. tokens per prompt) or None.
        resamples: bootstrap resamples of the ``n`` prompts, with replacement; confidence: in (0, 1).
        seed: the resampling generator's random seed.

    Raises:
        ValueError: empty ``values``, ``weights`` of another shape, bad ``resamples`` or ``confidence``.
    """
    values = torch.as_tensor(values).reshape(-1)
    _check_bootstrap(values.numel(), resamples, confidence)
    if weights is not None and weights.shape != values.shape:
        raise ValueError(f"weights: expected shape {list(values.shape)}, got {list(weights.shape)}")
    den = weights.double().sum() if weights is not None else values.numel()
    estimate = float(values.double().sum() / den)
    (stats,) = _resample_stats([values], weights, resamples, seed)
    return Interval(estimate, *_percentiles(stats, confidence))


def paired_bootstrap_interval(
    a: torch.Tensor,
    b: torch.Tensor,
    weights: torch.Tensor | None = None,
    resamples: int = RESAMPLES,
    confidence: float = CONFIDENCE,
    seed: int = 0,
) -> Interval:
    """Paired percentile bootstrap interval of ``mean(b) - mean(a)`` (weighted as in
    ``bootstrap_interval``): each resample draws the same prompts for ``a`` and ``b``.

    Raises:
        ValueError: ``a`` and ``b`` of different shapes, or as ``bootstrap_interval``.
    """
    a, b = torch.as_tensor(a).reshape(-1), torch.as_tensor(b).reshape(-1)
    if a.shape != b.shape:
        raise ValueError(f"a, b: expected one value per prompt for both, got {list(a.shape)} and {list(b.shape)}")
    _check_bootstrap(a.numel(), resamples, confidence)
    diff = b.double() - a.double()
    den = weights.double().sum() if weights is not None else a.numel()
    (stats,) = _resample_stats([diff], weights, resamples, seed)
    return Interval(float(diff.sum() / den), *_percentiles(stats, confidence))


# ----------------------------------------------------------------------------- evaluation


@dataclass
class TaskResult:
    """One task's per-prompt outcomes and their summaries.

    ``correct``: bool ``[n]`` (greedy exact match, module docstring); ``nll``: fp64 ``[n]`` summed NLL of each answer
    (nats); ``tokens``: int64 ``[n]`` answer tokens per prompt; ``prompts_sha256``: fingerprint of
    the prompts and answers, so ``compare`` pairs only the same prompts.
    """

    task: str
    correct: torch.Tensor
    nll: torch.Tensor
    tokens: torch.Tensor
    prompts_sha256: str
    exact_match: Interval
    nll_per_token: Interval

    @property
    def n(self) -> int:
        return self.correct.numel()


@dataclass
class Results:
    """``evaluate``'s output: ``tasks[name] -> TaskResult`` and the bootstrap settings."""

    tasks: dict[str, TaskResult] = field(default_factory=dict)
    resamples: int = RESAMPLES
    confidence: float = CONFIDENCE
    seed: int = 0

    def exact_match(self) -> dict[str, float]:
        return {t: r.exact_match.estimate for t, r in self.tasks.items()}


def _datasets(datasets) -> list[Dataset]:
    if isinstance(datasets, Dataset):
        datasets = [datasets]
    elif isinstance(datasets, dict):
        datasets = list(datasets.values())
    datasets = list(datasets)
    if not datasets:
        raise ValueError("datasets: expected at least one Dataset, got none")
    seen = set()
    for d in datasets:
        if not isinstance(d, Dataset):
            raise TypeError(f"datasets: expected mxlib.models.tasks.Dataset items, got {type(d).__name__}")
        if len(d) == 0:
            raise ValueError(f"datasets: the {d.task!r} dataset is empty")
        if d.task in seen:
            raise ValueError(f"datasets: two datasets of task {d.task!r}")
        seen.add(d.task)
    return datasets


def _fingerprint(d: Dataset) -> str:
    h = hashlib.sha256(d.task.encode())
    h.update(d.prompts.contiguous().numpy().tobytes())
    h.update(d.answers.contiguous().numpy().tobytes())
    return h.hexdigest()


def _forward(model, ids: torch.Tensor, left_pad: int, logits_to_keep: int = 0) -> torch.Tensor:
    """Logits ``[B, T, vocab]`` (fp32; the last ``logits_to_keep`` positions if not 0) of ``ids [B, T]``,
    the batch left-padded by ``left_pad`` ``<pad>`` tokens with the attention mask and position ids
    that leave the real tokens' positions unchanged (the pad positions' logits are dropped)."""
    dev = next(model.parameters()).device
    if left_pad:
        b, t = ids.shape
        ids = torch.cat([torch.full((b, left_pad), TOKENIZER.pad_id, dtype=ids.dtype), ids], 1)
        mask = torch.cat([torch.zeros(b, left_pad, dtype=torch.long), torch.ones(b, t, dtype=torch.long)], 1)
        pos = (torch.arange(left_pad + t) - left_pad).clamp_min(0).expand(b, -1)
        out = model(
            input_ids=ids.to(dev),
            attention_mask=mask.to(dev),
            position_ids=pos.to(dev),
            use_cache=False,
            logits_to_keep=logits_to_keep,
        )
        logits = out.logits if logits_to_keep else out.logits[:, left_pad:]
        return logits.float().cpu()
    out = model(input_ids=ids.to(dev), use_cache=False, logits_to_keep=logits_to_keep)
    return out.logits.float().cpu()


@torch.no_grad()
def greedy_decode(model, prompts: torch.Tensor, num_tokens: int, left_pad: int = 0) -> torch.Tensor:
    """Greedy decoding: ``num_tokens`` argmax tokens after each prompt (the whole sequence is run again
    at every step; no KV cache). ``prompts``: int64 ``[B, P]``; returns int64 ``[B, num_tokens]``.
    ``UnsupportedModelError`` for a model of a class mxlib does not quantize (``mxlib.models.families``)."""
    check_supported_model(model, "greedy_decode")
    seq = prompts
    for _ in range(num_tokens):
        nxt = _forward(model, seq, left_pad, logits_to_keep=1)[:, -1].argmax(-1)
        seq = torch.cat([seq, nxt[:, None]], 1)
    return seq[:, prompts.shape[1] :]


DECODES = ("teacher_forcing", "greedy")


@torch.no_grad()
def _score(model, d: Dataset, batch_size: int, left_pad: int, order: torch.Tensor, decode: str = DECODES[0]):
    n, p = d.prompts.shape
    a = d.answers.shape[1]
    correct = torch.zeros(n, dtype=torch.bool)
    nll = torch.zeros(n, dtype=torch.float64)
    for start in range(0, n, batch_size):
        rows = order[start : start + batch_size]
        prompts, answers = d.prompts[rows], d.answers[rows]
        logits = _forward(model, torch.cat([prompts, answers[:, :-1]], 1), left_pad)[:, p - 1 :]
        if decode == "greedy":
            correct[rows] = (greedy_decode(model, prompts, a, left_pad) == answers).all(1)
        else:
            correct[rows] = (logits.argmax(-1) == answers).all(1)
        logp = torch.log_softmax(logits.double(), -1).gather(-1, answers[..., None]).squeeze(-1)
        nll[rows] = -logp.sum(1)
    return correct, nll


def evaluate(
    model,
    datasets,
    batch_size: int = 250,
    resamples: int = RESAMPLES,
    confidence: float = CONFIDENCE,
    seed: int = 0,
    left_pad: int = 0,
    order_seed: int | None = None,
    decode: str = "teacher_forcing",
) -> Results:
    """Exact match and per-token answer NLL of ``model`` on each dataset, with bootstrap intervals.

    Args:
        model: a ``Qwen3MoeForCausalLM`` (any experts swapped in), in eval mode.
        datasets: a ``Dataset``, a list of them or a dict of them (one per task).
        batch_size: prompts per forward pass.
        resamples, confidence, seed: the bootstrap's (``bootstrap_interval``).
        left_pad: ``<pad>`` tokens prepended to every prompt, masked out (for ``noise_floor``).
        order_seed: None keeps the dataset's order; an int permutes the prompts (seeded) before
            batching (results are reported in the dataset's order either way).
        decode: ``"teacher_forcing"`` (exact match read from the NLL pass's argmax, module
            docstring) or ``"greedy"`` (token-by-token decoding; the same outcomes, slower).

    Raises:
        ValueError: no datasets, an empty dataset, two datasets of one task, ``batch_size`` or
            ``left_pad`` out of range, an unknown ``decode``, or as ``bootstrap_interval``.
        TypeError: an item of ``datasets`` that is not a ``Dataset``.
        UnsupportedModelError: a model of a class mxlib does not quantize (``mxlib.models.families``).
    """
    check_supported_model(model, "evaluate")
    datasets = _datasets(datasets)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batch_size: expected a positive int, got {batch_size!r}")
    if isinstance(left_pad, bool) or not isinstance(left_pad, int) or left_pad < 0:
        raise ValueError(f"left_pad: expected an int >= 0, got {left_pad!r}")
    if decode not in DECODES:
        raise ValueError(f"decode: expected one of {list(DECODES)}, got {decode!r}")
    _check_bootstrap(1, resamples, confidence)
    out = Results(resamples=resamples, confidence=confidence, seed=seed)
    for d in datasets:
        n = len(d)
        order = (
            torch.arange(n)
            if order_seed is None
            else torch.randperm(n, generator=torch.Generator().manual_seed(order_seed))
        )
        correct, nll = _score(model, d, batch_size, left_pad, order, decode)
        tokens = torch.full((n,), d.answers.shape[1], dtype=torch.int64)
        out.tasks[d.task] = TaskResult(
            d.task,
            correct,
            nll,
            tokens,
            _fingerprint(d),
            bootstrap_interval(correct, None, resamples, confidence, seed),
            bootstrap_interval(nll, tokens, resamples, confidence, seed),
        )
    return out


@dataclass(frozen=True)
class Difference:
    """``b - a`` of one metric on one task, with its paired bootstrap interval; ``significant``: the
    interval excludes 0. ``flips``: prompts whose exact-match outcome differs (exact match only)."""

    metric: str
    estimate: float
    low: float
    high: float
    significant: bool
    flips: int | None = None

    def beyond(self, noise_floor: float) -> bool:
        """Whether the difference counts: its interval excludes 0 and ``|estimate|`` exceeds ``noise_floor``
        (a ``noise_floor`` value of the same task and metric)."""
        return self.significant and abs(self.estimate) > noise_floor

    def __str__(self) -> str:
        mark = " *" if self.significant else ""
        return f"{self.estimate:+.4f} [{self.low:+.4f}, {self.high:+.4f}]{mark}"


def compare(
    results_a: Results,
    results_b: Results,
    resamples: int | None = None,
    confidence: float | None = None,
    seed: int | None = None,
) -> dict[str, dict[str, Difference]]:
    """Per task, ``b - a`` of exact match and of per-token NLL, each with a paired bootstrap interval
    (defaults: ``results_a``'s settings). A negative exact-match difference means ``b`` loses.

    Raises:
        ValueError: the two results share no task, or a shared task was scored on other prompts.
    """
    resamples = results_a.resamples if resamples is None else resamples
    confidence = results_a.confidence if confidence is None else confidence
    seed = results_a.seed if seed is None else seed
    shared = [t for t in results_a.tasks if t in results_b.tasks]
    if not shared:
        raise ValueError(
            f"results_b: no task in common with results_a ({list(results_a.tasks)} vs {list(results_b.tasks)})"
        )
    out = {}
    for t in shared:
        ra, rb = results_a.tasks[t], results_b.tasks[t]
        if ra.prompts_sha256 != rb.prompts_sha256:
            raise ValueError(
                f"results_b: task {t!r} was scored on other prompts than results_a (a paired "
                "comparison needs the same prompts)"
            )
        em = paired_bootstrap_interval(ra.correct, rb.correct, None, resamples, confidence, seed)
        nll = paired_bootstrap_interval(ra.nll, rb.nll, ra.tokens, resamples, confidence, seed)
        out[t] = {
            "exact_match": Difference(
                "exact_match",
                em.estimate,
                em.low,
                em.high,
                not em.low <= 0 <= em.high,
                int((ra.correct != rb.correct).sum()),
            ),
            "nll_per_token": Difference("nll_per_token", nll.estimate, nll.low, nll.high, not nll.low <= 0 <= nll.high),
        }
    return out


# ----------------------------------------------------------------------------- experts swapped in


@contextlib.contextmanager
def swapped_experts(model, make_experts):
    """``mxlib.models.qwen3.swap_experts(model, make_experts)`` inside the block; the model's own
    experts modules are put back on exit. ``UnsupportedModelError``: as ``swap_experts``."""
    check_supported_model(model, "swapped_experts")
    originals = [mlp.experts for mlp in moe_layers(model)]
    try:
        swap_experts(model, make_experts)
        yield model
    finally:
        for mlp, orig in zip(moe_layers(model), originals):
            mlp.experts = orig


def calibrate_tasks(model, datasets, keep_activations: bool = False) -> Calibration:
    """Per layer and expert, the amax of the w13 input (a1) and the w2 input (a2) over every dataset's
    prompt-and-answer sequences (teacher forcing): ``mxlib.models.calibration.calibrate`` run per
    dataset (each has one sequence length), the maxima and token counts combined.

    ``keep_activations``: also keep ``a1``, ``a2``, ``topk_ids`` and ``topk_weights`` per layer
    (``LayerCalibration``), the datasets' rows one after another, for the unification study.
    ``UnsupportedModelError``: a model of a class mxlib does not quantize (``mxlib.models.families``).
    """
    check_supported_model(model, "calibrate_tasks")
    datasets = _datasets(datasets)
    cals = [calibrate(model, torch.cat([d.prompts, d.answers], 1), keep_activations) for d in datasets]
    out = Calibration(num_tokens=sum(c.num_tokens for c in cals), layer_indices=cals[0].layer_indices if cals else None)
    for layer in zip(*(c.layers for c in cals)):
        kept = {}
        if keep_activations:
            kept = {k: torch.cat([getattr(lc, k) for lc in layer]) for k in ("a1", "a2", "topk_ids", "topk_weights")}
        out.layers.append(
            LayerCalibration(
                a1_amax=torch.stack([lc.a1_amax for lc in layer]).amax(0),
                a2_amax=torch.stack([lc.a2_amax for lc in layer]).amax(0),
                tokens=torch.stack([lc.tokens for lc in layer]).sum(0),
                **kept,
            )
        )
    return out


@contextlib.contextmanager
def emulated_experts(model, scheme, calibration: Calibration | None = None, backend: str = "torch", **kwargs):
    """The model with every layer's experts replaced by ``scheme``'s emulation experts inside the block.

    Each layer's bf16 experts (``expert_weights``) are quantized (``quantize_expert_weights``) and
    built into emulation experts (``make_emulation_experts(scheme, weights, w13_input_scale,
    w2_input_scale, backend=backend, **kwargs)``); a scheme with static activation scales
    (``nvfp4``) takes them from ``calibration`` (``input_scales_from_amax``).

    Raises:
        ValueError: an unknown scheme; a static-scale scheme without ``calibration``, or a
            calibration of another number of layers.
        UnsupportedModelError: a model of a class mxlib does not quantize (``mxlib.models.families``).
    """
    check_supported_model(model, "emulated_experts")
    s = get_moe_scheme(scheme)
    layers = moe_layers(model)
    if s.static_activation_scale:
        if calibration is None:
            raise ValueError(f"calibration: scheme {s.name} has static activation scales; pass calibrate_tasks(...)")
        if len(calibration.layers) != len(layers):
            raise ValueError(f"calibration: expected {len(layers)} layers, got {len(calibration.layers)}")

    def make(i):
        w13, w2 = expert_weights(model, i)
        weights = quantize_expert_weights(w13, w2, s)
        s13 = s2 = None
        if calibration is not None:
            lc = calibration.layer(i)  # decoder layer i (a family with dense layers: not the i-th entry)
            s13, s2 = (
                None if t is None else t.to(w13.device) for t in input_scales_from_amax(s, lc.a1_amax, lc.a2_amax)
            )
        return make_emulation_experts(s, weights, s13, s2, backend=backend, **kwargs)

    with swapped_experts(model, make):
        yield model


# ----------------------------------------------------------------------------- noise floor


def noise_floor(
    model, datasets, batch_size: int = 250, resamples: int = RESAMPLES, confidence: float = CONFIDENCE, seed: int = 0
) -> dict:
    """How far the same bf16 model's metrics move under changes that should not matter.

    Variants, each evaluated and compared (``compare``) with the reference ``evaluate(model,
    datasets, batch_size)``:

    * ``batch``: batch size ``batch_size // 3 + 1`` and the prompts in a seeded random order;
    * ``left_pad``: 3 ``<pad>`` tokens before every prompt, masked, positions kept;
    * ``eager_experts``: transformers' ``eager`` experts loop in place of its default (``grouped_mm``
      where torch has it);
    * ``triton_experts_torch``: mxlib's ``TritonExperts`` on the same bf16 weights, ``backend="torch"``.

    Returns:
        ``{"reference": Results, "variants": {name: Results}, "differences": {name: compare(...)},
        "noise_floor": {task: {"exact_match" / "nll_per_token": largest |difference estimate| over the
        variants, "flips": most exact-match outcomes changed by one variant}}}``.
    """
    datasets = _datasets(datasets)
    kw = dict(resamples=resamples, confidence=confidence, seed=seed)
    ref = evaluate(model, datasets, batch_size, **kw)
    variants = {
        "batch": evaluate(model, datasets, batch_size // 3 + 1, order_seed=seed + 1, **kw),
        "left_pad": evaluate(model, datasets, batch_size, left_pad=3, **kw),
    }
    previous = model.config._experts_implementation  # grouped_mm where torch has it
    try:
        model.set_experts_implementation("eager")
        variants["eager_experts"] = evaluate(model, datasets, batch_size, **kw)
    finally:
        model.set_experts_implementation(previous)

    def bf16_experts(i):
        w13, w2 = expert_weights(model, i)
        return TritonExperts(w13, w2, backend="torch")

    with swapped_experts(model, bf16_experts):
        variants["triton_experts_torch"] = evaluate(model, datasets, batch_size, **kw)
    diffs = {name: compare(ref, r) for name, r in variants.items()}
    largest = {
        t: {m: max(abs(diffs[v][t][m].estimate) for v in diffs) for m in ("exact_match", "nll_per_token")}
        for t in ref.tasks
    }
    for t in ref.tasks:
        largest[t]["flips"] = max(diffs[v][t]["exact_match"].flips for v in diffs)
    return dict(reference=ref, variants=variants, differences=diffs, noise_floor=largest)


# ----------------------------------------------------------------------------- routing


@torch.no_grad()
def expert_counts(model, dataset: Dataset, batch_size: int = 250) -> torch.Tensor:
    """Routed (token, expert) pairs per prompt, layer and expert over the dataset's prompt-and-answer
    tokens (teacher forcing, the answer's ``<eos>`` excluded): int64 ``[n, L, E]``; each prompt's row
    of a layer sums to ``tokens * top_k``. Read from each router's ``topk_ids`` (a forward hook).
    ``UnsupportedModelError``: a model of a class mxlib does not quantize (``mxlib.models.families``)."""
    check_supported_model(model, "expert_counts")
    (dataset,) = _datasets(dataset)
    ids = torch.cat([dataset.prompts, dataset.answers[:, :-1]], 1)
    num_layers, e = len(moe_layers(model)), family_of(model, "expert_counts").num_experts(model.config)
    counts = torch.zeros(ids.shape[0], num_layers, e, dtype=torch.int64)
    rows = slice(0, 0)

    def hook(i):
        def record(module, args, out):
            topk_ids = out[2].reshape(rows.stop - rows.start, -1).long().cpu()
            counts[rows, i] += torch.zeros(topk_ids.shape[0], e, dtype=torch.int64).scatter_add_(
                1, topk_ids, torch.ones_like(topk_ids)
            )

        return record

    handles = [mlp.gate.register_forward_hook(hook(i)) for i, mlp in enumerate(moe_layers(model))]
    try:
        for start in range(0, ids.shape[0], batch_size):
            rows = slice(start, min(start + batch_size, ids.shape[0]))
            _forward(model, ids[rows], 0)
    finally:
        for h in handles:
            h.remove()
    return counts


def expert_usage(model, dataset: Dataset) -> torch.Tensor:
    """Fraction of routed (token, expert) pairs per expert, per layer, over the dataset's
    prompt-and-answer tokens (teacher forcing): fp64 ``[L, E]``, each row summing to 1
    (``expert_counts`` summed over the prompts)."""
    counts = expert_counts(model, dataset).sum(0).double()
    return counts / counts.sum(1, keepdim=True)


def kl_from_uniform(usage: torch.Tensor) -> torch.Tensor:
    """``KL(usage || uniform)`` per layer, nats: ``sum_e p_e log(p_e E)`` (0 for uniform routing,
    ``log E`` when one expert takes everything). ``usage``: ``[L, E]`` rows summing to 1."""
    p = usage.double()
    e = p.shape[-1]
    return torch.where(p > 0, p * torch.log(p * e), torch.zeros_like(p)).sum(-1)
