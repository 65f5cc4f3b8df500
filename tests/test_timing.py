"""``mxlib.studies.timing``: the recorded timing spread, its pooled noise by hand, and "faster" decided against it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from mxlib.stats import ComparisonFamily
from mxlib.studies import timing as TM

ROOT = Path(__file__).resolve().parents[1]


def _recording(path: Path, external: dict, mxlib: dict) -> Path:
    rows = [dict(path=p, M=m, graph_ms=t) for (p, m), t in mxlib.items()]
    arows = [dict(path=p, M=m, graph_ms=t) for (p, m), t in external.items()]
    arows.append(dict(path="floor_mxfp4", M=1, floor_ms=0.001))  # computed, no time: left out
    path.write_text(json.dumps(dict(rows=rows, external=dict(rows=arows))))
    return path


def test_spread_and_noise_by_hand(tmp_path):
    a = _recording(tmp_path / "a.json", {("vllm_bf16", 1): 1.00, ("tk_bf16", 1): 2.0}, {("mine", 1): 0.5})
    b = _recording(tmp_path / "b.json", {("vllm_bf16", 1): 1.02, ("tk_bf16", 1): 2.0}, {("mine", 1): 0.6})
    c = _recording(tmp_path / "c.json", {("vllm_bf16", 1): 0.99}, {})
    assert TM.recorded_times(a) == {("mine", 1): 0.5, ("vllm_bf16", 1): 1.0, ("tk_bf16", 1): 2.0}
    spread = {r["row"]: r for r in TM.timing_spread([a, b, c])}
    assert spread["vllm_bf16"]["recordings"] == 3 and spread["vllm_bf16"]["spread"] == pytest.approx(1.02 / 0.99 - 1)
    assert "mine" not in spread  # not a reference row
    noise = TM.log_time_noise([a, b, c])[1]
    logs = [math.log(x) for x in (1.0, 1.02, 0.99)]
    mean = sum(logs) / 3
    ss = sum((x - mean) ** 2 for x in logs)  # tk_bf16 adds 0 with one degree of freedom
    assert noise["df"] == 2 + 1 and noise["sd"] == pytest.approx(math.sqrt(ss / 3))
    pooled = TM.pooled_noise({1: dict(sd=0.1, df=2, rows=1), 4: dict(sd=0.2, df=2, rows=1)})
    assert pooled["df"] == 4 and pooled["sd"] == pytest.approx(math.sqrt((0.01 * 2 + 0.04 * 2) / 4))


def test_faster_is_decided_against_the_noise():
    noise = {1: dict(sd=0.01, df=20, rows=5), 4: dict(sd=0.01, df=20, rows=5)}
    times = {("A", 1): 1.0, ("B", 1): 2.0, ("A", 4): 1.0, ("B", 4): 1.005}
    fam = ComparisonFamily()
    keys = TM.add_faster_pairs(fam, times, [("A", "B")], noise)
    assert keys == ["A vs B at M=1", "A vs B at M=4"]
    rows = {r["M"]: r for r in TM.faster_rows(fam.decide())}
    assert rows[1]["verdict"] == "A faster" and rows[1]["time_ratio"] == pytest.approx(0.5)
    assert rows[4]["verdict"] == "cannot be told apart"  # 0.5 % against a noise of 1 % a recording
    assert rows[4]["ratio_low"] < 1 < rows[4]["ratio_high"]


def test_bad_input_is_named(tmp_path):
    fam = ComparisonFamily()
    with pytest.raises(ValueError, match="ms_a: expected a positive time"):
        TM.add_faster(fam, "A", "B", 0.0, 1.0, dict(sd=0.01, df=3), M=1)
    with pytest.raises(ValueError, match="noise: expected a log_time_noise entry"):
        TM.add_faster(fam, "A", "B", 1.0, 1.0, {}, M=1)
    with pytest.raises(ValueError, match="pairs: 'A' and 'C' are timed at no common M"):
        TM.add_faster_pairs(fam, {("A", 1): 1.0, ("C", 4): 1.0}, [("A", "C")], dict(sd=0.01, df=3))
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps(dict(rows=[])))
    with pytest.raises(ValueError, match="holds no timed row"):
        TM.recorded_times(empty)


def test_the_recorded_noise_is_small_and_well_founded():
    recordings = [ROOT / "benchmarks" / p for p in TM.EXTERNAL_RECORDINGS]
    noise = TM.log_time_noise(recordings)
    assert sorted(noise) == [1, 4, 16, 64, 256, 1024, 4096]
    assert all(v["rows"] == len(TM.REFERENCE_ROWS) and v["df"] >= 20 for v in noise.values()), noise
    assert all(v["sd"] < 0.005 for m, v in noise.items() if m <= 1024) and noise[4096]["sd"] < 0.02, noise
