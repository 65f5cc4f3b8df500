"""The trained-model studies' paired differences (notebooks 06 and 07), decided together by ``mxlib.stats``.

The studies' rows (``mxlib.studies.accuracy.result_rows``, notebook 07's technique rows) carry each paired
difference as an estimate and its paired bootstrap interval (95 %, prompts resampled): ``delta_*`` against bf16, and
``vs_*`` against a second run (``max`` in notebook 06's strategies, round-to-nearest in notebook 07). ``add_rows``
reads each as a ``mxlib.stats.Estimate`` (``Estimate.from_interval``: the interval read as a normal one over the
task's prompts) and adds it to a ``ComparisonFamily`` with the task's measured noise level (``noise_floor_study``'s
largest difference under changes that should not matter) as the smallest difference worth reporting. The family then
decides every difference of the notebook together (Holm); ``verdict_sentences`` states the decided ones.
"""

from __future__ import annotations

from ..stats import ComparisonFamily, Decisions, Estimate

__all__ = ["METRICS", "add_rows", "verdict_sentences"]

# metric -> (row columns: estimate, low, high, for the difference against bf16 / against the vs run), higher is better
METRICS = {
    "exact match": (("delta_exact_match", "delta_low", "delta_high"), ("vs_exact_match", "vs_low", "vs_high"), True),
    "NLL per token": (("delta_nll", "delta_nll_low", "delta_nll_high"), ("vs_nll", "vs_nll_low", "vs_nll_high"), False),
}
_NOISE_FLOOR_KEY = {"exact match": "exact_match", "NLL per token": "nll_per_token"}


def add_rows(
    family: ComparisonFamily,
    rows: list[dict],
    key: str,
    prompts: dict[str, int],
    noise_floor: dict,
    reference: str | None = "bf16",
    vs: str | None = None,
    level: float = 0.95,
) -> list[str]:
    """Add every row's differences to ``family``: against ``reference`` (``delta_*``) and, where the row has them
    and ``vs`` names the run, against ``vs`` (``vs_*``); exact match and NLL per token, per task. Rows naming
    ``reference`` or ``vs`` themselves are skipped. Returns the keys.

    Args:
        rows: result rows with ``key`` (the run's name), ``task`` and the columns of ``METRICS``.
        prompts: prompts per task (the intervals' ``n``); noise_floor: ``{task: {"exact_match", "nll_per_token"}}``.

    Raises:
        KeyError: a row's task missing from ``prompts`` or ``noise_floor``; ValueError: as ``Estimate.from_interval``.
    """
    keys = []
    for r in rows:
        name, task = r[key], r["task"]
        for metric, (own, other, higher) in METRICS.items():
            smallest = float(noise_floor[task][_NOISE_FLOOR_KEY[metric]])
            for against, cols in ((reference, own), (vs, other)):
                if against is None or name in (reference, against) or cols[0] not in r:
                    continue
                est = Estimate.from_interval(*(r[c] for c in cols), n=prompts[task], level=level)
                keys.append(
                    family.add_estimate(
                        name,
                        against,
                        est,
                        metric=f"{metric} on {task}",
                        higher_is_better=higher,
                        smallest=smallest,
                        unit_name="prompts",
                    )
                )
    return keys


def verdict_sentences(decisions: Decisions, keys=None) -> list[str]:
    """One sentence per decided comparison (of ``keys`` only, when given): ``"<winner> better than <other> in
    <metric>: <difference> [<interval>] (smallest worth reporting ...)"``; nothing is said of the comparisons that
    cannot be told apart."""
    out = []
    wanted = None if keys is None else set(keys)
    for k, v in decisions.items():
        if not v.decided or (wanted is not None and k not in wanted):
            continue
        other = v.b if v.winner == v.a else v.a
        out.append(
            f"{v.winner} better than {other} in {v.metric}: {v.a} - {v.b} = {v.difference:+.3g} "
            f"[{v.low:+.3g}, {v.high:+.3g}] (smallest worth reporting {v.smallest:.2g})"
        )
    return out
