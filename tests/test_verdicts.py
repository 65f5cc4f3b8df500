"""``mxlib.studies.verdicts``: the trained-model rows' paired intervals decided together, against the noise level."""

from __future__ import annotations

from mxlib.stats import ComparisonFamily
from mxlib.studies.verdicts import add_rows, verdict_sentences

FLOOR = {"add": {"exact_match": 0.002, "nll_per_token": 0.001}}


def _row(name, em, em_lo, em_hi, nll, nll_lo, nll_hi, **vs):
    return dict(
        scheme=name,
        task="add",
        delta_exact_match=em,
        delta_low=em_lo,
        delta_high=em_hi,
        delta_nll=nll,
        delta_nll_low=nll_lo,
        delta_nll_high=nll_hi,
        **vs,
    )


def test_rows_are_decided_against_the_noise_level():
    rows = [
        _row("bf16", 0, 0, 0, 0, 0, 0),  # the reference itself: skipped
        _row("loser", -0.05, -0.06, -0.04, 0.02, 0.015, 0.025),  # far beyond the interval and the level
        _row("tiny", -0.001, -0.0015, -0.0005, 0.0005, 0.0003, 0.0007),  # excludes 0, within the level
        _row(
            "nvfp4",
            0.0,
            -0.01,
            0.01,
            0.003,
            0.002,
            0.004,
            vs_exact_match=0.01,
            vs_low=-0.01,
            vs_high=0.03,
            vs_nll=-0.01,
            vs_nll_low=-0.012,
            vs_nll_high=-0.008,
        ),
    ]
    fam = ComparisonFamily("test")
    keys = add_rows(fam, rows, "scheme", {"add": 2000}, FLOOR, vs="max")
    assert len(keys) == 3 * 2 + 2  # three runs x two metrics against bf16, and nvfp4's two against max
    dec = fam.decide()
    got = {(v.a, v.b, v.metric): v.verdict for v in dec.values()}
    assert got[("loser", "bf16", "exact match on add")] == "bf16 better"
    assert got[("loser", "bf16", "NLL per token on add")] == "bf16 better"  # a higher NLL is worse
    assert got[("tiny", "bf16", "exact match on add")] == "cannot be told apart"  # within the noise level
    assert got[("nvfp4", "max", "NLL per token on add")] == "nvfp4 better"
    assert got[("nvfp4", "max", "exact match on add")] == "cannot be told apart"
    sentences = verdict_sentences(dec)
    assert len(sentences) == sum(v.decided for v in dec.values()) and sentences[0].startswith("bf16 better than loser")
