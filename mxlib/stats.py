"""One rule for "beyond the noise": paired comparisons, decided together, against a smallest difference.

A claim such as "NVFP4 keeps more SQNR than MXFP4" is a comparison of two runs, A and B, measured on the same
material. This module turns a notebook's comparisons into verdicts, each one of three: ``"A better"``,
``"B better"`` or ``"cannot be told apart"``. A verdict is never a bare p-value, nor a point estimate held
against a mark.

The rule, in four parts:

1. **Paired.** A and B are measured on the same units (prompts, tokens) and the same draws of what a reader
   would vary (the evaluation token set, the calibration draw, the rotation seed, the training seed). The
   statistic is the mean of the differences ``A - B`` (a ratio ``sum(A - B) / sum(weights)`` with per-unit
   weights, e.g. answer tokens per prompt).
2. **The unit of replication is the draw.** ``over="draws"``: one value (or one set of per-unit values) per
   draw; per draw ``d_j = mean_j(A) - mean_j(B)``, and the test is Student's t on ``d_1 .. d_k`` with ``k - 1``
   degrees of freedom (the cluster-summary analysis: ``d_j`` already carries both the unit-to-unit and the
   draw-to-draw variation, so nothing about their correlation is assumed). A design that varies several sources
   varies them together: each draw takes a fresh token set *and* a fresh seed. ``over="units"``: the units of
   one draw are the replicates (paired t on the per-unit differences; the ratio-estimator standard error
   ``sqrt(n / (n - 1) * sum((d_i - R w_i)^2)) / sum(w)`` with weights). Such a verdict speaks of that draw only:
   it says nothing of another token set or seed.
3. **A smallest difference worth reporting** ``smallest`` (>= 0, in the metric's unit), which the caller
   measures: the same model twice on another backend, the same scheme under two seeds. Comparison ``i`` tests
   the null hypothesis ``|Delta_i| <= smallest_i`` with ``p_i = min(1, 2 P(T_df >= (|mean| - smallest_i) /
   se_i))`` (scipy's Student t). With ``smallest = 0`` this is the ordinary two-sided paired t test.
4. **The family.** A ``ComparisonFamily`` collects every comparison a notebook (or study) makes and decides
   them together with **Holm's step-down procedure** at level ``alpha`` (0.05): the probability that the family
   states one or more false orderings (calling A better where the true difference is within ``smallest``, or in
   B's favour) is at most ``alpha``, whatever the dependence between the comparisons' tests. The family-wise
   error rate (FWER), not the false discovery rate, because a course's every stated ordering is meant to hold.
   A decided comparison's direction is the sign of its mean difference and the metric's ``higher_is_better``.

Each verdict carries a **simultaneous interval** for ``Delta = mean(A) - mean(B)``: Student-t at level
``1 - alpha / m`` (Bonferroni, ``m`` the family's size). An interval that lies wholly outside
``[-smallest, smallest]`` always comes with a decided verdict; Holm decides a few more than the intervals clear.

Assumptions and limits: the t test over draws assumes the per-draw differences are roughly normal (with 3 draws
only a difference several times their spread is decided: two draws give 1 degree of freedom, a critical t of
12.7 at 0.05); the test over units is the large-sample paired t (tens of units or more). Exact-match outcomes
(0/1) go through the same test on their per-prompt differences. Measured in ``tests/test_stats.py``: under
no difference the rate of families stating any ordering stays within ``alpha``; planted differences are found
at the power that Student's noncentral t predicts.

Shapes: ``a``, ``b`` (and ``weights``) are ``[n]`` per-unit values, ``[k]`` per-draw values, or ``[k, n]`` /
a list of ``k`` ``[n_j]`` arrays (per-unit values of each draw); numpy arrays, torch tensors (CPU) or lists of
numbers, read as float64. Nothing passed in is changed.

Source: Holm, "A simple sequentially rejective multiple test procedure", Scand. J. Statist. 6 (1979);
the cluster-summary t test: any survey-sampling text (Cochran, "Sampling Techniques", ch. 9, for the ratio
estimator's variance); p-values and quantiles from ``scipy.stats.t``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy import stats as _st

__all__ = [
    "ALPHA",
    "OVER",
    "TIED",
    "Estimate",
    "Verdict",
    "Decisions",
    "ComparisonFamily",
    "paired_units",
    "paired_draws",
    "largest_difference",
]

ALPHA = 0.05
OVER = ("units", "draws")
TIED = "cannot be told apart"


# ----------------------------------------------------------------------------- estimates


@dataclass(frozen=True)
class Estimate:
    """The mean paired difference ``A - B``, its standard error and degrees of freedom.

    ``n``: the replicates (units, or draws); ``over``: ``"units"`` or ``"draws"``.
    """

    mean: float
    se: float
    df: int
    n: int
    over: str

    @classmethod
    def from_interval(
        cls, estimate: float, low: float, high: float, n: int, level: float = 0.95, over: str = "units"
    ) -> Estimate:
        """An ``Estimate`` read from a paired interval ``[low, high]`` at ``level`` over ``n`` units (a paired
        bootstrap interval, e.g. ``mxlib.models.evaluation.compare``'s): ``se = (high - low) / (2 t)``, ``t`` the
        Student quantile at ``(1 + level) / 2`` with ``n - 1`` degrees of freedom. An approximation: the interval is
        read as a symmetric normal one, which a percentile bootstrap interval over hundreds of prompts nearly is.

        Raises:
            ValueError: ``low > high``, ``n < 2``, ``level`` outside (0, 1), or a non-finite bound.
        """
        if not all(math.isfinite(v) for v in (estimate, low, high)):
            raise ValueError(f"low, high: expected finite bounds, got [{low}, {high}] around {estimate}")
        if low > high:
            raise ValueError(f"low, high: expected low <= high, got [{low}, {high}]")
        if n < 2:
            raise ValueError(f"n: expected at least 2 units, got {n}")
        if not 0.0 < level < 1.0:
            raise ValueError(f"level: expected a value in (0, 1), got {level}")
        t = float(_st.t.ppf((1.0 + level) / 2.0, n - 1))
        return cls(mean=float(estimate), se=(high - low) / (2.0 * t), df=n - 1, n=n, over=over)

    def p_value(self, smallest: float = 0.0) -> float:
        """Two-sided p-value of the null hypothesis ``|Delta| <= smallest`` (see the module docstring)."""
        excess = abs(self.mean) - smallest
        if self.se == 0.0:
            return 0.0 if excess > 0 else 1.0
        return float(min(1.0, 2.0 * _st.t.sf(excess / self.se, self.df)))

    def interval(self, level: float) -> tuple[float, float]:
        """The Student-t interval ``mean -/+ t_{(1 + level) / 2, df} * se``."""
        half = 0.0 if self.se == 0.0 else float(_st.t.ppf((1.0 + level) / 2.0, self.df)) * self.se
        return self.mean - half, self.mean + half


def _array(x, name: str) -> np.ndarray:
    try:
        arr = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name}: expected numbers (an array, a tensor or a list), got {type(x).__name__}") from e
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name}: expected finite values, got {int((~np.isfinite(arr)).sum())} NaN or Inf")
    return arr


def _pair(a, b, weights, names=("a", "b")) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    va, vb = _array(a, names[0]), _array(b, names[1])
    if va.ndim != 1 or va.shape != vb.shape:
        raise ValueError(
            f"{names[0]}, {names[1]}: expected paired 1-D series of one length, got shapes "
            f"{list(va.shape)} and {list(vb.shape)}"
        )
    w = None
    if weights is not None:
        w = _array(weights, "weights")
        if w.shape != va.shape:
            raise ValueError(f"weights: expected shape {list(va.shape)} (as a), got {list(w.shape)}")
        if np.any(w <= 0):
            raise ValueError(f"weights: expected positive values, got a minimum of {w.min()}")
    return va, vb, w


def _mean_difference(va, vb, w) -> float:
    d = va - vb
    return float(d.mean()) if w is None else float(d.sum() / w.sum())


def paired_units(a, b, weights=None) -> Estimate:
    """Paired difference over the units (prompts, tokens) of one draw: ``mean(a - b)``, or with ``weights``
    the ratio ``sum(a - b) / sum(weights)`` (``a``, ``b`` per-unit sums, e.g. NLL over a prompt's answer
    tokens, ``weights`` the token counts), with its large-sample standard error.

    Args:
        a, b: ``[n]`` per-unit values of the two runs on the same units, ``n >= 2``.
        weights: ``[n]`` positive per-unit weights, or None.

    Returns:
        ``Estimate`` with ``df = n - 1``, ``over = "units"``.

    Raises:
        ValueError: shapes that differ or are not 1-D, fewer than 2 units, non-finite values, weights <= 0.
        TypeError: ``a`` or ``b`` not numbers.
    """
    va, vb, w = _pair(a, b, weights)
    n = va.shape[0]
    if n < 2:
        raise ValueError(f"a: expected at least 2 paired units, got {n}")
    d = va - vb
    mean = _mean_difference(va, vb, w)
    if w is None:
        se = float(d.std(ddof=1) / math.sqrt(n))
    else:
        resid = d - mean * w
        se = float(math.sqrt(n / (n - 1) * float((resid**2).sum())) / w.sum())
    return Estimate(mean=mean, se=se, df=n - 1, n=n, over="units")


def _draws(x, name: str) -> list[np.ndarray]:
    if isinstance(x, (list, tuple)) and x and not np.isscalar(x[0]) and np.ndim(x[0]) > 0:
        return [_array(v, f"{name}[{j}]") for j, v in enumerate(x)]
    arr = _array(x, name)
    if arr.ndim == 1:
        return [arr[j : j + 1] for j in range(arr.shape[0])]
    if arr.ndim == 2:
        return list(arr)
    raise ValueError(f"{name}: expected [k] per-draw values, [k, n] or a list of k per-unit arrays, got {arr.ndim}-D")


def paired_draws(a, b, weights=None) -> Estimate:
    """Paired difference over draws: the draw is the unit of replication.

    Per draw ``j``, ``d_j`` is the (weighted) mean of ``a_j - b_j`` over its units; the estimate is
    ``mean(d_j)`` with standard error ``std(d_j) / sqrt(k)`` and ``k - 1`` degrees of freedom.

    Args:
        a, b: ``[k]`` one value per draw (e.g. a token set's SQNR), or ``[k, n]`` / a list of ``k`` ``[n_j]``
            arrays (each draw's per-unit values); ``a`` and ``b`` paired draw by draw and unit by unit.
        weights: the same layout as ``a`` (per-unit weights), or None.

    Returns:
        ``Estimate`` with ``df = k - 1``, ``over = "draws"``.

    Raises:
        ValueError: fewer than 2 draws, a draw of ``a`` not shaped as ``b``'s, non-finite values, weights <= 0.
    """
    da, db = _draws(a, "a"), _draws(b, "b")
    dw = _draws(weights, "weights") if weights is not None else [None] * len(da)
    if len(da) != len(db) or len(dw) != len(da):
        raise ValueError(f"a, b: expected the same number of draws, got {len(da)} and {len(db)}")
    if len(da) < 2:
        raise ValueError(
            f"a: expected at least 2 draws, got {len(da)} (one draw says nothing about another: compare its units "
            "with paired_units, or draw again)"
        )
    d = np.array(
        [_mean_difference(*_pair(x, y, w, (f"a[{j}]", f"b[{j}]"))) for j, (x, y, w) in enumerate(zip(da, db, dw))]
    )
    k = d.shape[0]
    return Estimate(mean=float(d.mean()), se=float(d.std(ddof=1) / math.sqrt(k)), df=k - 1, n=k, over="draws")


def largest_difference(*pairs) -> float:
    """A measured noise level: the largest ``|mean(x - y)|`` over pairs ``(x, y)`` of runs that should agree
    (the same model twice on another backend, another batch size, the same scheme under another seed), each a
    pair of equal-length 1-D series of one metric. Pass it as ``smallest``.

    Raises:
        ValueError: no pair, or a pair as ``paired_units`` refuses.
    """
    if not pairs:
        raise ValueError("pairs: expected at least one (x, y) pair of runs that should agree, got none")
    out = 0.0
    for i, p in enumerate(pairs):
        if len(p) != 2:
            raise ValueError(f"pairs[{i}]: expected an (x, y) pair, got {len(p)} items")
        x, y, _ = _pair(p[0], p[1], None, (f"pairs[{i}][0]", f"pairs[{i}][1]"))
        out = max(out, abs(float((x - y).mean())))
    return out


# ----------------------------------------------------------------------------- verdicts


@dataclass(frozen=True)
class Verdict:
    """One decided comparison of ``a`` against ``b`` on ``metric``.

    ``verdict``: ``f"{a} better"``, ``f"{b} better"`` or ``"cannot be told apart"``; ``winner``: the better
    name, or None (``decided``). ``difference``: ``mean(A) - mean(B)`` in the metric's unit, ``low``/``high`` its
    simultaneous interval (level ``1 - alpha / m``); ``smallest``: the smallest difference worth reporting;
    ``p``, ``p_holm``: the comparison's p-value of ``|Delta| <= smallest`` and its Holm-adjusted value (the
    verdict is decided when ``p_holm <= alpha``); ``n``, ``over``: the replicates and what they are
    (``"draws"``, ``"units"`` or the ``unit_name`` given to ``ComparisonFamily.add``).
    """

    key: str
    a: str
    b: str
    metric: str
    verdict: str
    winner: str | None
    difference: float
    low: float
    high: float
    smallest: float
    p: float
    p_holm: float
    n: int
    over: str
    higher_is_better: bool

    @property
    def decided(self) -> bool:
        """True for ``"A better"`` / ``"B better"``."""
        return self.winner is not None

    def __str__(self) -> str:
        return (
            f"{self.verdict}: {self.metric} {self.a} - {self.b} = {self.difference:+.3g} "
            f"[{self.low:+.3g}, {self.high:+.3g}] over {self.n} {self.over}"
            + (f", smallest worth reporting {self.smallest:.3g}" if self.smallest else "")
        )


class Decisions(Mapping):
    """A decided family: ``key -> Verdict`` in the order the comparisons were added, with the family's
    ``alpha``, ``method`` (``"holm"``) and size ``m``."""

    def __init__(self, name: str, alpha: float, verdicts: dict[str, Verdict]):
        self.name, self.alpha, self.method, self._v = name, alpha, "holm", verdicts

    def __getitem__(self, key: str) -> Verdict:
        if key not in self._v:
            raise KeyError(f"key: no comparison {key!r} in family {self.name!r} (its keys: {list(self._v)})")
        return self._v[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._v)

    def __len__(self) -> int:
        return len(self._v)

    @property
    def m(self) -> int:
        return len(self._v)

    def rows(self) -> list[dict]:
        """One dict per comparison (for a table): key, a, b, metric, verdict, difference, low, high, smallest,
        n, over."""
        keys = ("key", "a", "b", "metric", "verdict", "difference", "low", "high", "smallest", "n", "over")
        return [{k: getattr(v, k) for k in keys} for v in self._v.values()]

    def not_beaten(self, names: Sequence[str], metric: str) -> list[str]:
        """Of ``names``, those that no other name of ``names`` is decided better than on ``metric``: the
        ones that cannot be told from the best (with all pairs in the family, the true best is among them
        with probability at least ``1 - alpha``)."""
        beaten = {
            (v.b if v.winner == v.a else v.a)
            for v in self._v.values()
            if v.metric == metric and v.decided and v.a in names and v.b in names
        }
        return [n for n in names if n not in beaten]

    def summary(self) -> str:
        """One line: the family's size, its error control and how many comparisons were decided."""
        decided = sum(v.decided for v in self._v.values())
        return (
            f"{self.name}: {self.m} comparisons decided together (Holm, family-wise error rate {self.alpha:g}); "
            f"{decided} ordered, {self.m - decided} cannot be told apart"
        )

    def __str__(self) -> str:
        return "\n".join([self.summary(), *(f"  {v}" for v in self._v.values())])


@dataclass
class _Pending:
    a: str
    b: str
    metric: str
    estimate: Estimate
    higher_is_better: bool
    smallest: float
    unit_name: str


@dataclass
class ComparisonFamily:
    """Every comparison a notebook or study makes, decided together (Holm, family-wise error rate ``alpha``).

    Add the comparisons (``add``, ``add_pairs``), then call ``decide()`` once; a family that has been
    decided takes no more comparisons (its error control covers exactly what it holds).

    Args:
        name: what the family covers (e.g. ``"notebook 03: schemes by SQNR"``), shown in its summary.
        alpha: the family-wise error rate, in (0, 1).

    Raises:
        ValueError: ``alpha`` outside (0, 1).
    """

    name: str = "comparisons"
    alpha: float = ALPHA
    _pending: dict[str, _Pending] = field(default_factory=dict, repr=False)
    _decisions: Decisions | None = field(default=None, repr=False)

    def __post_init__(self):
        if not 0.0 < self.alpha < 1.0:
            raise ValueError(f"alpha: expected a value in (0, 1), got {self.alpha}")

    def __len__(self) -> int:
        return len(self._pending)

    def add(
        self,
        a: str,
        b: str,
        values_a,
        values_b,
        *,
        metric: str,
        higher_is_better: bool,
        over: str = "draws",
        smallest: float = 0.0,
        weights=None,
        unit_name: str | None = None,
        key: str | None = None,
    ) -> str:
        """Add the comparison of run ``a`` against run ``b`` and return its key.

        Args:
            a, b: the two runs' names (e.g. scheme names); they name the verdict.
            values_a, values_b: their paired values (``paired_draws`` or ``paired_units`` shapes, by ``over``).
            metric: what is compared (e.g. ``"SQNR (dB)"``); higher_is_better: the metric's direction.
            over: ``"draws"`` (the unit of replication is the draw) or ``"units"`` (the units of one draw).
            smallest: the smallest difference worth reporting, >= 0, in the metric's unit (a measured noise
                level: ``largest_difference``).
            weights: per-unit weights for a ratio mean (see ``paired_units``), or None.
            unit_name: what a replicate is, for the verdict's text (``"token sets"``, ``"prompts"``); default
                ``over``.
            key: the comparison's key; default ``f"{a} vs {b} ({metric})"``.

        Raises:
            RuntimeError: the family was already decided.
            TypeError: ``higher_is_better`` not a bool.
            ValueError: an unknown ``over``, a negative or non-finite ``smallest``, a key already used, or
                values as ``paired_draws`` / ``paired_units`` refuse.
        """
        if over not in OVER:
            raise ValueError(f"over: expected one of {OVER}, got {over!r}")
        self._check_open()
        est = (paired_draws if over == "draws" else paired_units)(values_a, values_b, weights)
        return self.add_estimate(
            a, b, est, metric=metric, higher_is_better=higher_is_better, smallest=smallest, unit_name=unit_name, key=key
        )

    def add_estimate(
        self,
        a: str,
        b: str,
        estimate: Estimate,
        *,
        metric: str,
        higher_is_better: bool,
        smallest: float = 0.0,
        unit_name: str | None = None,
        key: str | None = None,
    ) -> str:
        """Add a comparison whose ``Estimate`` (of ``mean(A) - mean(B)``) was made elsewhere
        (``paired_units``, ``paired_draws``); the other arguments as ``add``.

        Raises:
            RuntimeError, ValueError, TypeError: as ``add``; TypeError also for an ``estimate`` that is not an
                ``Estimate``.
        """
        self._check_open()
        if not isinstance(estimate, Estimate):
            raise TypeError(f"estimate: expected an Estimate, got {type(estimate).__name__}")
        if not (isinstance(smallest, (int, float)) and math.isfinite(smallest) and smallest >= 0):
            raise ValueError(f"smallest: expected a finite number >= 0, got {smallest!r}")
        if not isinstance(higher_is_better, bool):
            raise TypeError(f"higher_is_better: expected a bool, got {type(higher_is_better).__name__}")
        key = key if key is not None else f"{a} vs {b} ({metric})"
        if key in self._pending:
            raise ValueError(f"key: {key!r} is already in family {self.name!r}")
        self._pending[key] = _Pending(
            a, b, metric, estimate, higher_is_better, float(smallest), unit_name or estimate.over
        )
        return key

    def _check_open(self) -> None:
        if self._decisions is not None:
            raise RuntimeError(f"family {self.name!r} was already decided; its comparisons are fixed")

    def add_pairs(self, values: Mapping[str, object], **kwargs) -> list[str]:
        """Add every pair of ``values`` (``name -> paired values``, each pair in the mapping's order) with the
        keyword arguments of ``add``; returns the keys. With every pair in the family, ``Decisions.not_beaten``
        gives the names that cannot be told from the best."""
        names = list(values)
        keys = []
        for i, x in enumerate(names):
            for y in names[i + 1 :]:
                keys.append(self.add(x, y, values[x], values[y], **kwargs))
        return keys

    def decide(self) -> Decisions:
        """Decide every comparison together (Holm's step-down at ``alpha``) and fix the family.

        Raises:
            ValueError: the family is empty.
        """
        if self._decisions is not None:
            return self._decisions
        if not self._pending:
            raise ValueError(f"family {self.name!r}: expected at least one comparison, got none")
        keys = list(self._pending)
        m = len(keys)
        p = np.array([self._pending[k].estimate.p_value(self._pending[k].smallest) for k in keys])
        order = np.argsort(p, kind="stable")
        adjusted = np.empty(m)
        running = 0.0
        for rank, i in enumerate(order):
            running = max(running, min(1.0, (m - rank) * p[i]))
            adjusted[i] = running
        verdicts = {}
        for i, k in enumerate(keys):
            c = self._pending[k]
            low, high = c.estimate.interval(1.0 - self.alpha / m)
            winner = None
            if adjusted[i] <= self.alpha:
                a_ahead = (c.estimate.mean > 0) == c.higher_is_better
                winner = c.a if a_ahead else c.b
            verdicts[k] = Verdict(
                key=k,
                a=c.a,
                b=c.b,
                metric=c.metric,
                verdict=f"{winner} better" if winner is not None else TIED,
                winner=winner,
                difference=c.estimate.mean,
                low=low,
                high=high,
                smallest=c.smallest,
                p=float(p[i]),
                p_holm=float(adjusted[i]),
                n=c.estimate.n,
                over=c.unit_name,
                higher_is_better=c.higher_is_better,
            )
        self._decisions = Decisions(self.name, self.alpha, verdicts)
        return self._decisions
