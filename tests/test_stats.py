"""``mxlib.stats``: the estimates against scipy's own tests, Holm by hand, bad input, and the rule's error rate
and power measured over many repetitions.

* **Oracles.** ``paired_units`` / ``paired_draws`` with ``smallest = 0`` give the p-value and interval of
  ``scipy.stats.ttest_1samp`` on the differences; the weighted ratio's standard error with unit weights is the
  unweighted one, and against a large bootstrap of the ratio it agrees to a few per cent. Holm's adjusted
  p-values of a hand-worked example.
* **Under the null** (nothing differs), over ``REPEATS`` repetitions, the rate of families that state any
  ordering is at most ``alpha``: asserted by the binomial test ``count <= binom.ppf(0.999, REPEATS, alpha)``
  (a true rate of ``alpha`` fails it one time in a thousand). Each null test also runs a rule that should fail
  it (no correction over the family; the units of three draws pooled as if independent) and asserts that it
  does: the assertion can tell a wrong rule from a right one. Data: synthetic families with no difference;
  three draws whose per-draw difference varies from draw to draw but is 0 on average (two seeds of one
  setting); and mxlib's own NVFP4 QDQ after a random-sign block Hadamard rotation under two seeds of one
  setting (the same rule, two rotation seeds).
* **Power** on planted differences: the measured rate of finding the planted direction agrees with the power
  that Student's noncentral t predicts (within binomial bounds), and is stated: 0.85 for a mean per-unit
  difference of 0.3 of its standard deviation over 100 units; 0.75 for a difference of 3 draw-to-draw
  standard deviations over 3 draws, 0.99 over 5; with a smallest difference worth reporting, the boundary
  ``Delta = smallest`` is decided at most ``alpha`` of the time.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import linalg, stats

from mxlib import reference as R
from mxlib.stats import (
    TIED,
    ComparisonFamily,
    Estimate,
    largest_difference,
    paired_draws,
    paired_units,
)

REPEATS = 1000
ALPHA = 0.05


def binomial_bound(repeats: int, rate: float) -> int:
    """The largest count of ``repeats`` Bernoulli(``rate``) trials that passes at the 0.999 level."""
    return int(stats.binom.ppf(0.999, repeats, rate))


def family_states_any(decisions) -> bool:
    return any(v.decided for v in decisions.values())


# ----------------------------------------------------------------------------- against scipy's own tests


@pytest.mark.parametrize("n", [2, 7, 200])
def test_paired_units_is_scipys_paired_t(n):
    rng = np.random.default_rng(n)
    a, b = rng.normal(size=n), rng.normal(0.2, 1, size=n)
    est = paired_units(a, b)
    ref = stats.ttest_1samp(a - b, 0.0)
    assert est.df == n - 1 and est.n == n and est.over == "units"
    assert est.p_value() == pytest.approx(ref.pvalue, rel=1e-12)
    lo, hi = ref.confidence_interval(0.9)
    assert est.interval(0.9) == pytest.approx((lo, hi), rel=1e-12)


def test_paired_draws_is_the_t_test_on_per_draw_differences():
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=(4, 30)), rng.normal(size=(4, 30))
    est = paired_draws(a, b)
    ref = stats.ttest_1samp(a.mean(1) - b.mean(1), 0.0)
    assert (est.df, est.n, est.over) == (3, 4, "draws")
    assert est.p_value() == pytest.approx(ref.pvalue, rel=1e-12)
    # one value per draw, and a list of per-unit arrays of unequal lengths (torch tensors), say the same
    summary = paired_draws(a.mean(1), b.mean(1))
    assert (summary.mean, summary.se, summary.df) == pytest.approx((est.mean, est.se, est.df), rel=1e-12)
    ragged = [torch.tensor(a[0]), torch.tensor(a[1, :10]), torch.tensor(a[2]), torch.tensor(a[3])]
    ragged_b = [torch.tensor(b[0]), torch.tensor(b[1, :10]), torch.tensor(b[2]), torch.tensor(b[3])]
    d = np.array([(x - y).mean().item() for x, y in zip(ragged, ragged_b)])
    assert paired_draws(ragged, ragged_b).mean == pytest.approx(d.mean(), rel=1e-12)


def test_weighted_ratio_estimate():
    rng = np.random.default_rng(2)
    n = 400
    w = rng.integers(1, 9, size=n).astype(float)  # answer tokens per prompt
    a = rng.normal(1.0, 0.5, size=n) * w  # per-prompt NLL sums
    b = rng.normal(0.9, 0.5, size=n) * w
    est = paired_units(a, b, w)
    assert est.mean == pytest.approx((a - b).sum() / w.sum(), rel=1e-12)
    # unit weights: the unweighted estimate
    assert paired_units(a, b, np.ones(n)).se == pytest.approx(paired_units(a, b).se, rel=1e-12)
    # the ratio's standard error against a bootstrap of the ratio (20000 resamples of the prompts)
    idx = rng.integers(0, n, size=(20000, n))
    boot = (a - b)[idx].sum(1) / w[idx].sum(1)
    assert est.se == pytest.approx(boot.std(), rel=0.05)


def test_holm_by_hand():
    # p = 0.01, 0.04, 0.03, 0.005: ordered 0.005 (x4 = 0.02), 0.01 (x3 = 0.03), 0.03 (x2 = 0.06), 0.04 (x1 -> 0.06)
    fam = ComparisonFamily("hand", alpha=0.05)
    df = 10**6  # Student's t of a large df: p = 2 sf(mean / se)
    for name, p in zip("wxyz", [0.01, 0.04, 0.03, 0.005]):
        est = Estimate(mean=float(stats.t.isf(p / 2, df)), se=1.0, df=df, n=df + 1, over="units")
        fam.add_estimate(name, "ref", est, metric="m", higher_is_better=True)
    dec = fam.decide()
    got = {v.a: (round(v.p, 6), round(v.p_holm, 6), v.verdict) for v in dec.values()}
    assert got == {
        "w": (0.01, 0.03, "w better"),
        "x": (0.04, 0.06, TIED),
        "y": (0.03, 0.06, TIED),
        "z": (0.005, 0.02, "z better"),
    }
    assert dec.m == 4 and dec.method == "holm" and "Holm" in dec.summary()


def test_direction_and_smallest():
    a = np.array([10.0, 11.0, 12.0, 10.5])
    b = a - 2.0 + np.array([0.1, -0.1, 0.05, -0.05])
    fam = ComparisonFamily()
    k_high = fam.add("A", "B", a, b, metric="SQNR (dB)", higher_is_better=True, unit_name="token sets")
    k_low = fam.add("A", "B", a, b, metric="NLL", higher_is_better=False)
    k_small = fam.add("A", "B", a, b, metric="SQNR again", higher_is_better=True, smallest=2.5)
    dec = fam.decide()
    assert dec[k_high].verdict == "A better" and dec[k_high].over == "token sets"
    assert dec[k_low].verdict == "B better"
    assert dec[k_small].verdict == TIED and not dec[k_small].decided  # 2 dB is within the 2.5 dB worth reporting
    assert "A better: SQNR (dB) A - B = +2" in str(dec[k_high])
    # the interval is simultaneous: level 1 - alpha / 3
    lo, hi = paired_draws(a, b).interval(1 - 0.05 / 3)
    assert (dec[k_high].low, dec[k_high].high) == pytest.approx((lo, hi))


def test_identical_runs_and_exact_shifts():
    x = np.linspace(0, 1, 50)
    fam = ComparisonFamily()
    same = fam.add("A", "A again", x, x.copy(), metric="m", higher_is_better=True, over="units")
    shift = fam.add("A", "A + 1", x, x + 1, metric="m", higher_is_better=True, over="units")
    dec = fam.decide()
    assert dec[same].verdict == TIED and dec[same].p == 1.0
    assert dec[shift].verdict == "A + 1 better"


def test_not_beaten_over_all_pairs():
    rng = np.random.default_rng(3)
    base = rng.normal(size=(5, 1))  # the draws' shared level
    values = {
        "best": base + 3 + 0.05 * rng.normal(size=(5, 1)),
        "close": base + 2.98 + 0.05 * rng.normal(size=(5, 1)),
        "worst": base + 0 + 0.05 * rng.normal(size=(5, 1)),
    }
    fam = ComparisonFamily()
    keys = fam.add_pairs({k: v[:, 0] for k, v in values.items()}, metric="SQNR", higher_is_better=True)
    assert len(keys) == 3
    dec = fam.decide()
    assert dec.not_beaten(list(values), "SQNR") == ["best", "close"]


def test_estimate_from_interval_inverts_the_t_interval():
    rng = np.random.default_rng(4)
    d = rng.normal(0.1, 1.0, size=300)
    est = paired_units(d, np.zeros(300))
    lo, hi = est.interval(0.95)
    back = Estimate.from_interval(est.mean, lo, hi, n=300, level=0.95)
    assert (back.se, back.df) == pytest.approx((est.se, est.df))
    with pytest.raises(ValueError, match="expected low <= high"):
        Estimate.from_interval(0.0, 1.0, -1.0, n=10)
    with pytest.raises(ValueError, match="n: expected at least 2"):
        Estimate.from_interval(0.0, -1.0, 1.0, n=1)


def test_largest_difference():
    x = np.array([1.0, 2.0, 3.0])
    assert largest_difference((x, x + 0.1), (x, x - 0.3)) == pytest.approx(0.3)


def test_bad_input_names_the_argument():
    fam = ComparisonFamily()
    with pytest.raises(ValueError, match=r"a, b: expected paired 1-D series of one length, got shapes \[3\] and \[2\]"):
        paired_units([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="a: expected at least 2 paired units, got 1"):
        paired_units([1.0], [2.0])
    with pytest.raises(ValueError, match="a: expected at least 2 draws, got 1"):
        paired_draws([[1.0, 2.0]], [[1.0, 2.0]])
    with pytest.raises(ValueError, match="a: expected finite values, got 1 NaN or Inf"):
        paired_units([1.0, float("nan")], [1.0, 2.0])
    with pytest.raises(ValueError, match="weights: expected positive values"):
        paired_units([1.0, 2.0], [1.0, 2.0], [1.0, 0.0])
    with pytest.raises(ValueError, match=r"over: expected one of \('units', 'draws'\), got 'tokens'"):
        fam.add("A", "B", [1, 2], [1, 2], metric="m", higher_is_better=True, over="tokens")
    with pytest.raises(ValueError, match="smallest: expected a finite number >= 0, got -1"):
        fam.add("A", "B", [1, 2], [1, 2], metric="m", higher_is_better=True, smallest=-1)
    with pytest.raises(TypeError, match="higher_is_better: expected a bool, got str"):
        fam.add("A", "B", [1, 2], [1, 2], metric="m", higher_is_better="yes")
    with pytest.raises(ValueError, match="alpha: expected a value in"):
        ComparisonFamily(alpha=1.5)
    with pytest.raises(ValueError, match="expected at least one comparison, got none"):
        ComparisonFamily("empty").decide()
    fam.add("A", "B", [1, 2], [1, 3], metric="m", higher_is_better=True)
    with pytest.raises(ValueError, match="is already in family"):
        fam.add("A", "B", [1, 2], [1, 3], metric="m", higher_is_better=True)
    fam.decide()
    with pytest.raises(RuntimeError, match="already decided"):
        fam.add("C", "D", [1, 2], [1, 3], metric="m", higher_is_better=True)
    x = np.array([1.0, 2.0, 3.0])
    x0 = x.copy()
    paired_units(x, x + 1)
    np.testing.assert_array_equal(x, x0)  # nothing passed in comes back changed


# ----------------------------------------------------------------------------- under the null


def _null_family_rates(rng, m: int, n: int) -> tuple[int, int]:
    """Families of ``m`` comparisons of ``n`` units with no difference: (Holm families stating any ordering,
    uncorrected families stating any)."""
    holm = uncorrected = 0
    for _ in range(REPEATS):
        a, b = rng.normal(size=(m, n)), rng.normal(size=(m, n))
        fam = ComparisonFamily()
        for i in range(m):
            fam.add(f"A{i}", f"B{i}", a[i], b[i], metric="m", higher_is_better=True, over="units")
        dec = fam.decide()
        holm += family_states_any(dec)
        uncorrected += any(v.p <= ALPHA for v in dec.values())
    return holm, uncorrected


def test_null_family_error_rate_is_at_most_alpha():
    rng = np.random.default_rng(10)
    holm, uncorrected = _null_family_rates(rng, m=5, n=60)
    bound = binomial_bound(REPEATS, ALPHA)
    assert holm <= bound, f"{holm} of {REPEATS} null families stated an ordering (bound {bound})"
    # the same data decided one comparison at a time state an ordering in 1 - 0.95^5 = 23 % of families
    assert uncorrected > bound, f"the uncorrected rule passed the null test ({uncorrected} <= {bound})"


def _draws_null(rng, k: int, n: int, tau: float) -> tuple[np.ndarray, np.ndarray]:
    """Two seeds of one setting over ``k`` draws: per draw a difference ``u_j ~ N(0, tau)`` (one seed happens
    to suit that draw) plus unit noise; zero on average."""
    u = rng.normal(0.0, tau, size=(k, 1))
    a = rng.normal(size=(k, n)) + u
    b = rng.normal(size=(k, n))
    return a, b


def test_null_over_draws_is_at_most_alpha_and_pooling_units_is_not():
    rng = np.random.default_rng(11)
    over_draws = pooled = 0
    for _ in range(REPEATS):
        a, b = _draws_null(rng, k=3, n=50, tau=0.5)
        fam = ComparisonFamily()
        key = fam.add("seed 0", "seed 1", a, b, metric="m", higher_is_better=True, over="draws")
        over_draws += fam.decide()[key].decided
        wrong = ComparisonFamily()
        key = wrong.add("seed 0", "seed 1", a.ravel(), b.ravel(), metric="m", higher_is_better=True, over="units")
        pooled += wrong.decide()[key].decided
    bound = binomial_bound(REPEATS, ALPHA)
    assert over_draws <= bound, f"{over_draws} of {REPEATS} (bound {bound})"
    assert pooled > bound, f"pooling the draws' units passed the null test ({pooled} <= {bound})"


def test_null_two_rotation_seeds_of_nvfp4():
    """mxlib's NVFP4 QDQ after a random-sign block Hadamard rotation: two seeds of one setting, compared over
    draws (each draw a fresh token set and a fresh pair of seeds). The SQNR of each is measured in the rotated
    space (the rotation is orthogonal); the ordering of the two seeds must be tied at the stated rate. One
    QDQ call holds every token set (one fixed encode scale, 2688 over the largest amax)."""
    repeats, k, alpha = 400, 3, 0.2  # alpha 0.2 makes 400 repeats a sharp test (expected 80, bound 107)
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(repeats, k, 1, 16, 256, generator=gen)
    x[..., 7] *= 30.0  # an outlier channel, fixed as real activations have them
    signs = torch.randint(0, 2, (repeats, k, 2, 1, 256), generator=gen).float() * 2 - 1  # seeds A and B per draw
    h = torch.tensor(linalg.hadamard(16), dtype=torch.float32) / 4.0
    y = ((x * signs).reshape(repeats, k, 2, 16, 16, 16) @ h).reshape(repeats, k, 2, 16, 256)
    q = R.quant_dequant(y, "nvfp4", global_scale=torch.tensor(2688.0) / y.abs().amax())
    sqnr = 10 * torch.log10(y.double().pow(2).sum((-1, -2)) / (q - y).double().pow(2).sum((-1, -2)))
    decided = 0
    for r in range(repeats):
        fam = ComparisonFamily(alpha=alpha)
        key = fam.add("seed A", "seed B", sqnr[r, :, 0], sqnr[r, :, 1], metric="SQNR (dB)", higher_is_better=True)
        decided += fam.decide()[key].decided
    # the seeds do change the SQNR of a draw: the test is not on identical numbers
    assert (sqnr[..., 0] - sqnr[..., 1]).abs().max() > 0.05
    bound = binomial_bound(repeats, alpha)
    assert decided <= bound, f"{decided} of {repeats} seed pairs ordered (bound {bound})"


# ----------------------------------------------------------------------------- power on planted differences


def _power(df: int, ncp: float, level: float) -> float:
    """Two-sided power of Student's t at ``level`` for noncentrality ``ncp`` (scipy's noncentral t)."""
    crit = stats.t.isf(level / 2, df)
    return float(stats.nct.sf(crit, df, ncp) + stats.nct.cdf(-crit, df, ncp))


def _assert_rate(found: int, repeats: int, expected: float):
    lo, hi = stats.binom.ppf([0.0005, 0.9995], repeats, expected)
    assert lo <= found <= hi, f"found {found} of {repeats}, expected about {expected * repeats:.0f} ({lo}..{hi})"


def test_power_over_units():
    rng = np.random.default_rng(20)
    n, delta = 100, 0.3  # per-unit differences of mean 0.3 and standard deviation 1: noncentrality 3
    found = 0
    for _ in range(REPEATS):
        b = rng.normal(0, 1, n)
        fam = ComparisonFamily()
        key = fam.add("A", "B", b + rng.normal(delta, 1, n), b, metric="m", higher_is_better=True, over="units")
        found += fam.decide()[key].winner == "A"
    expected = _power(n - 1, delta * n**0.5, ALPHA)
    assert expected == pytest.approx(0.85, abs=0.01)  # the power the docs state
    _assert_rate(found, REPEATS, expected)


@pytest.mark.parametrize("k, stated", [(3, 0.75), (5, 0.99)])
def test_power_over_draws(k, stated):
    """A difference of 3 draw-to-draw standard deviations (``tau``), each draw's unit noise small beside it."""
    rng = np.random.default_rng(21 + k)
    tau, delta = 1.0, 3.0
    found = 0
    for _ in range(REPEATS):
        d = rng.normal(delta, tau, size=k)
        fam = ComparisonFamily()
        key = fam.add("A", "B", d, np.zeros(k), metric="m", higher_is_better=True)
        found += fam.decide()[key].winner == "A"
    expected = _power(k - 1, delta / tau * k**0.5, ALPHA)
    assert expected == pytest.approx(stated, abs=0.01)
    _assert_rate(found, REPEATS, expected)


def test_smallest_difference_boundary_and_beyond():
    rng = np.random.default_rng(22)
    n, smallest = 100, 0.2
    at_boundary = beyond = 0
    for _ in range(REPEATS):
        fam = ComparisonFamily()
        k0 = fam.add(
            "A",
            "B",
            rng.normal(smallest, 1, n),
            np.zeros(n),
            metric="m",
            higher_is_better=True,
            over="units",
            smallest=smallest,
        )
        k1 = fam.add(
            "C",
            "D",
            rng.normal(smallest + 0.4, 1, n),
            np.zeros(n),
            metric="m",
            higher_is_better=True,
            over="units",
            smallest=smallest,
        )
        dec = fam.decide()
        at_boundary += dec[k0].decided
        beyond += dec[k1].winner == "C"
    assert at_boundary <= binomial_bound(REPEATS, ALPHA)
    # 0.4 beyond the smallest over 100 units of unit variance: noncentrality 4, one-sided at alpha / 2 after Holm
    assert beyond >= 0.9 * REPEATS, beyond
