"""Notebook 06's studies (``mxlib.studies.accuracy``): parameters, rows, claims, routing statistics and figures.

The studies on the trained model run in tests/test_notebooks.py (the notebook at the ``test`` recipe); here
the pieces are checked on hand-made results, where the right answer is known without the code under test.
"""

import math

import pytest
import torch

from mxlib.models import evaluation as ev
from mxlib.moe.scales import SCALE_STRATEGIES
from mxlib.studies import accuracy as A
from mxlib.workbook import accuracy_figures


def _results(correct, nll, task="add", tokens=4) -> ev.Results:
    correct = torch.as_tensor(correct, dtype=torch.bool)
    nll = torch.as_tensor(nll, dtype=torch.float64)
    t = torch.full(correct.shape, tokens)
    r = ev.TaskResult(
        task, correct, nll, t, "same prompts", ev.bootstrap_interval(correct), ev.bootstrap_interval(nll, t)
    )
    return ev.Results(tasks={task: r})


FLOOR = {"add": {"exact_match": 0.002, "nll_per_token": 0.001, "flips": 1}}


def test_parameters_resolve_and_refuse():
    p = A.check_accuracy_parameters("test", "all", "nvfp4,w_mxfp4", ["max", "p90", "max"])
    assert p.tasks == ("reverse", "count") and [s.name for s in p.schemes] == ["nvfp4", "w_mxfp4"]
    assert p.strategies == ("max", "p90")  # repeated names once
    from mxlib.moe import MOE_SCHEMES

    assert len(A.check_accuracy_parameters("default").schemes) == len(MOE_SCHEMES)  # "all": every MoE scheme
    bad = [
        (dict(recipe="huge"), "recipe: expected one of"),
        (dict(recipe="test", tasks=["add"]), "tasks: .* not trained by recipe"),
        (dict(tasks="add"), "tasks: expected 'all' or a non-empty list"),
        (dict(schemes="int3"), "schemes: 'int3' is not a scheme"),
        (dict(strategies=["max", "p33x"]), "strategies: .* unknown"),
        (dict(strategies="max"), "strategies: expected a non-empty list"),
        (dict(eval_prompts=0), "eval_prompts: expected an integer from 1 to 100000 prompts; 0 is below the lower"),
        (dict(resamples=2.5), "resamples: expected an integer from 1 to 100000 bootstrap resamples, got 2.5"),
        (dict(seed="0"), r"seed: expected an integer from 0 to 4294967295 \(a random seed\), got '0'"),
        (dict(experts_backend="cuda"), "experts_backend: expected one of"),
    ]
    for kwargs, match in bad:
        with pytest.raises(ValueError, match=match):
            A.check_accuracy_parameters(**kwargs)
    # every strategy mxlib.moe.scales knows is accepted, so a strategy added there needs no change here
    assert A.check_accuracy_parameters(strategies=list(SCALE_STRATEGIES)).strategies == SCALE_STRATEGIES


def test_rows_mark_a_loss_only_beyond_the_floor_and_the_interval():
    n = 1000
    ref = _results(torch.ones(n), torch.full((n,), 0.4))
    worse = torch.ones(n)
    worse[:30] = 0  # 30 of 1000 prompts lost: -0.03, far outside any resampled 0
    loser = _results(worse, torch.full((n,), 0.8))
    (row,) = A.result_rows({"scheme": "x"}, loser, ref, FLOOR)
    assert row["scheme"] == "x" and row["task"] == "add" and row["flips"] == 30
    assert row["delta_exact_match"] == pytest.approx(-0.03) and row["delta_high"] < 0
    assert row["loses"] and not row["gains"] and row["nll_rises"]
    assert row["delta_nll"] == pytest.approx(0.4 / 4)
    text = A.claims([row], "scheme", FLOOR)
    assert len(text) == 2 and text[0].startswith("x loses exact match on add: -0.030 [")
    # the same loss under a noise floor larger than it is not a claim; nor is a run equal to bf16
    wide = {"add": {"exact_match": 0.05, "nll_per_token": 1.0, "flips": 50}}
    (row,) = A.result_rows({"scheme": "x"}, loser, ref, wide)
    assert not row["loses"] and not row["nll_rises"] and A.claims([row], "scheme", wide) == []
    (same,) = A.result_rows({"scheme": "bf16"}, ref, ref, FLOOR)
    assert (same["delta_exact_match"], same["delta_low"], same["delta_high"], same["flips"]) == (0.0, 0.0, 0.0, 0)
    assert A.claims([same], "scheme", FLOOR) == []


def test_one_flip_is_never_a_claim():
    # one prompt of 1000: its paired interval includes 0 (most resamples miss or halve it)
    n = 1000
    ref = _results(torch.ones(n), torch.ones(n))
    one = torch.ones(n)
    one[7] = 0
    (row,) = A.result_rows(
        {"strategy": "mean"}, _results(one, torch.ones(n)), ref, {"add": dict(FLOOR["add"], exact_match=0.0)}
    )
    assert row["delta_low"] <= 0 <= row["delta_high"] and not row["loses"]


def test_rows_against_another_run():
    n = 500
    ref = _results(torch.ones(n), torch.ones(n))
    base = torch.ones(n)
    base[:40] = 0
    better = torch.ones(n)
    better[:5] = 0
    (row,) = A.result_rows(
        {"strategy": "per_expert"}, _results(better, torch.ones(n)), ref, FLOOR, _results(base, torch.ones(n))
    )
    assert row["vs_exact_match"] == pytest.approx(35 / n) and row["vs_low"] > 0 and row["vs_beyond"]
    assert any("differs from max in exact match" in c for c in A.claims([row], "strategy", FLOOR))


def test_kl_rows_match_the_definition():
    counts = torch.tensor([[10, 10, 10, 10], [40, 0, 0, 0], [20, 10, 5, 5]])
    got = A._kl_rows(counts)
    want = [sum(c / 40 * math.log(c / 40 * 4) for c in row if c) for row in counts.tolist()]
    assert got.tolist() == pytest.approx(want, abs=1e-12)
    assert got[0] == 0 and got[1] == pytest.approx(math.log(4))


def test_figures_draw_every_row():
    n = 200
    ref = _results(torch.ones(n), torch.ones(n))
    rows = A.result_rows({"scheme": "a"}, ref, ref, FLOOR) + A.result_rows({"scheme": "b"}, ref, ref, FLOOR)
    fig = accuracy_figures.interval_figure(rows, "scheme", "t")
    assert len(fig.data) == 2 and list(fig.data[0].x) == ["a", "b"]
    usage = {"add": [[0.5, 0.5, 0.0, 0.0], [0.25] * 4]}
    heat = accuracy_figures.usage_figure(usage)
    assert list(heat.data[0].z[0]) == [2.0, 2.0, 0.0, 0.0] and list(heat.data[0].y) == ["add L0", "add L1"]
    amax_rows = [
        dict(point=p, scale_ratio=r, db_lost_max=0.1, layer=0, expert=e, amax=1.0)
        for e, (p, r) in enumerate([("a1", 1.0), ("a2", 1e-5)])
    ]
    fig = accuracy_figures.amax_figure(amax_rows)
    assert [t.name for t in fig.data[:2]] == ["a1", "a2"] and len(fig.data) == 4  # and the two threshold lines
