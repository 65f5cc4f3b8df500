"""mxlib.workbook.checks: the notebooks' tables, counted checks and exercise checkers, on hand-made rows."""

import pytest

from mxlib.studies.tables import SPEED_TARGETS, speed_targets_table, strategy_summary
from mxlib.workbook.checks import Checks


def test_checks_count_and_raise():
    check = Checks()
    check(True)
    check(1 + 1 == 2, "arithmetic")
    assert str(check) == "2 checks passed"
    with pytest.raises(AssertionError, match="the detail"):
        check(False, "the detail")
    assert check.passed == 2


def _bench_row(scheme, m, seed, fused, bf16):
    return dict(
        scheme=scheme,
        M=m,
        dequant_graph_ms=seed,
        fused_graph_ms=fused,
        bf16_graph_ms=bf16,
        fused_bound_frac_graph=0.5,
        fused_mem_mb=10.0,
        packed_weight_mb=40.0,
    )


def test_speed_targets_table():
    rows = [
        _bench_row("nvfp4", 1, 2.0, 0.1, 0.08),  # 20x the seed, 1.25x bf16: meets (10, 1.5)
        _bench_row("nvfp4", 1, 9.0, 9.0, 9.0),  # a second row of the same (scheme, M): the first wins
        _bench_row("nvfp4", 16, 1.0, 0.2, 0.1),  # 5x the dequantize-then-GEMM path (< 10): misses
        _bench_row("w_mxfp4_a_mxfp4", 4096, 1.0, 1.2, 1.0),  # no dequantize-then-GEMM target, 1.2x bf16 <= 1.25: meets
        _bench_row("w_mxfp4_a_mxfp4", 3, 1.0, 1.0, 1.0),  # not a target
    ]
    targets = speed_targets_table(rows)
    assert [(r["scheme"], r["M"], r["meets"]) for r in targets] == [
        ("nvfp4", 1, "yes"),
        ("nvfp4", 16, "no"),
        ("w_mxfp4_a_mxfp4", 4096, "yes"),
    ]
    assert targets[0]["fused_vs_dequant"] == 20.0 and targets[0]["fused_over_bf16"] == 0.1 / 0.08
    assert targets[0]["target_vs_dequant"] == 10 and targets[2]["target_vs_dequant"] == ""
    assert targets[0]["mem_frac_of_packed"] == 0.25
    assert len(SPEED_TARGETS) == 10


def test_strategy_summary():
    def row(point, lost_max, sqnr):
        return dict(
            point=point,
            sqnr_max=sqnr - lost_max,
            sqnr_per_expert=sqnr,
            db_lost_max=lost_max,
            db_lost_per_expert=0.0,
            subnormal_max=0.5,
            subnormal_per_expert=0.0,
            flushed_max=0.25,
            flushed_per_expert=0.0,
            clipped_max=0.0,
            clipped_per_expert=0.0,
            sqnr_mxfp4=18.0,
            sqnr_mxfp8_e4m3=30.0,
        )

    experts = [row("a1", 0.0, 20.0), row("a2", 1.0, 20.0), row("a2", 3.0, 22.0)]
    summary = strategy_summary(experts, ["max", "per_expert"])
    by = {(r["point"], r["strategy"]): r for r in summary}
    assert len(summary) == 8
    assert by[("a2", "max")]["mean_db_lost"] == 2.0 and by[("a2", "max")]["worst_db_lost"] == 3.0
    assert by[("a2", "max")]["mean_sqnr_db"] == 19.0 and by[("a2", "per_expert")]["mean_sqnr_db"] == 21.0
    assert by[("a2", "max")]["flushed_blocks"] == 0.25
    assert by[("a1", "OCP MXFP8 e4m3 (no global scale)")]["mean_sqnr_db"] == 30.0


@pytest.mark.parametrize("name", ["h200_fp4_external.json", "h200_fp4_humming.json"])
def test_external_kernel_tables_recompute_from_json(name):
    """external_kernel_tables on the recorded H200 JSON: ratios are quotients of its own timed rows (a ``min(a, b)``
    denominator: the fastest of those rows at that M)."""
    import json
    from pathlib import Path

    from mxlib.studies.tables import EXTERNAL_RATIOS, external_kernel_tables

    path = Path(__file__).resolve().parents[1] / "benchmarks" / name
    data = json.loads(path.read_text())
    t = external_kernel_tables(path)
    assert t["Ms"] == [1, 4, 16, 64, 256, 1024, 4096]
    assert t["env"][0]["device"] == "NVIDIA H200" and t["env"][0]["date"] == data["env"]["date"]
    ms = {r["row"]: r for r in t["ms"]}
    assert ms["vllm_bf16"]["source"] == "external" and ms["mxlib_bf16"]["source"] == "mxlib"
    assert set(ms) >= {"tk_mxfp4_unfused_silu", "floor_mxfp4", "mxlib_fused_nvfp4"}
    # the one recorded value, straight from the rows list
    m16 = next(r for r in data["rows"] if r["path"] == "mxlib_fused_nvfp4" and r["M"] == 16)
    assert ms["mxlib_fused_nvfp4"]["M=16"] == m16["graph_ms"]
    recorded = [n for n in data["ratios"]["1"] if any(data["ratios"][str(m)][n] is not None for m in t["Ms"])]
    assert [r["ratio"] for r in t["ratios"]] == recorded and set(recorded) <= set(EXTERNAL_RATIOS)
    for r in t["ratios"]:
        for m in t["Ms"]:
            den = r["denominator"]
            rows = den[4:-1].split(", ") if den.startswith("min(") else [den]
            q = ms[r["numerator"]][f"M={m}"] / min(ms[d][f"M={m}"] for d in rows)
            assert r[f"M={m}"] == pytest.approx(q, rel=1e-9), (r["ratio"], m)
    assert [f["holds"] for f in t["speed_targets"]] == ["yes" if f["holds"] else "no" for f in data["speed_targets"]]
    fr = {r["row"]: r for r in t["bound_fraction"]}
    for m in t["Ms"]:
        q = ms["floor_mxfp4"][f"M={m}"] / ms["tk_mxfp4"][f"M={m}"]
        assert fr["tk_mxfp4 (external)"][f"M={m}"] == pytest.approx(q, rel=1e-12)
        r = next(r for r in data["rows"] if r["path"] == "mxlib_fused_w_mxfp4" and r["M"] == m)
        assert fr["mxlib_fused_w_mxfp4"][f"M={m}"] == pytest.approx(r["bound_ms"] / r["graph_ms"], rel=1e-9)
    assert [c["rel"] for c in t["checks"]] == [0.0] * len(data["checks"])
    assert len(t["checks"]) == 7  # fused nvfp4 in vLLM numerics bit-equal to dequantize-then-GEMM at every M


def test_external_kernel_tables_unknown_ratio(tmp_path):
    import json
    from pathlib import Path

    from mxlib.studies.tables import external_kernel_tables

    src = Path(__file__).resolve().parents[1] / "benchmarks" / "h200_fp4_external_smem_decode.json"
    data = json.loads(src.read_text())
    data["ratios"]["1"]["made up / ratio"] = 1.0
    (tmp_path / "x.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="made up"):
        external_kernel_tables(tmp_path / "x.json")
