"""``python -m mxlib.bench model`` end to end on the CPU at the tiny preset (eager, torch backend, no graph),
and its figure. The CUDA-graph path runs on the GPU only (the coordinator's device run)."""

import json
import math

import pytest
import torch

from mxlib import bench
from mxlib.bench import model as bm

SCHEMES = ("nvfp4", "w_mxfp4", "w_mxfp4_a_mxfp4")
TOKENS = (1, 8)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_model")
    js, md = out / "model.json", out / "model.md"
    rc = bench.main(
        [
            "model",
            "--device",
            "cpu",
            "--preset",
            "tiny",
            "--layers",
            "2",
            "--tokens",
            "1,8",
            "--schemes",
            ",".join(SCHEMES),
            "--calib-tokens",
            "256",
            "--rep-ms",
            "1",
            "--json",
            str(js),
            "--markdown",
            str(md),
        ]
    )
    return rc, json.loads(js.read_text()), md.read_text()


@pytest.mark.slow
def test_cli_writes_json_with_every_path_and_token_count(result):
    rc, res, _ = result
    assert rc == 0 and res["failures"] == []
    assert {"device", "torch", "triton", "transformers", "date"} <= set(res["env"])
    assert res["env"]["device"].startswith("cpu")
    cfg = res["config"]
    assert (cfg["layers"], cfg["preset"], cfg["tokens"], cfg["num_experts"]) == (2, "tiny", list(TOKENS), 16)
    paths = ["bf16"] + [f"{s}@torch" for s in SCHEMES]
    assert [(r["path"], r["M"]) for r in res["rows"]] == [(p, m) for p in paths for m in TOKENS]
    assert set(res["no_moe"]) == {str(m) for m in TOKENS}


def test_rows_times_ratios_and_sqnr(result):
    _, res, _ = result
    for r in res["rows"]:
        assert r["backend"] == "torch"
        assert r["eager_ms"] > 0 and r["ms"] == r["eager_ms"]
        assert r["ratio_to_bf16"] > 0 and r["eager_ratio_to_bf16"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["M"] / (r["ms"] * 1e-3))
        assert r["moe_share"] == pytest.approx((r["ms"] - r["no_moe_ms"]) / r["ms"])
        if r["path"] == "bf16":
            assert r["ratio_to_bf16"] == 1.0 and r["sqnr_db_vs_bf16"] is None
        else:  # a 4-bit emulation: close to bf16, but not equal
            assert 5.0 < r["sqnr_db_vs_bf16"] < 60.0, r


def test_graph_is_skipped_on_the_cpu_with_a_reason(result):
    _, res, md = result
    for r in res["rows"]:
        assert r["graph_ms"] is None and r["graph_mode"] is None and "graph_bit_exact" not in r
        assert "CUDA" in r["graph_skipped"]
    assert "Graphs skipped: CUDA graphs need a CUDA device" in md
    assert "| w_mxfp4_a_mxfp4@torch |" in md and "| path | M = 1 | M = 8 |" in md


def test_figure_reads_the_json(result, tmp_path):
    pytest.importorskip("plotly")
    from mxlib.workbook import figures

    _, res, _ = result
    path = tmp_path / "r.json"
    path.write_text(json.dumps(res))
    fig = figures.model_forward_figure(str(path))
    assert [t.name for t in fig.data] == ["bf16"] + [f"{s}@torch" for s in SCHEMES]
    assert list(fig.data[1].x) == list(TOKENS)
    assert list(fig.data[1].y) == [r["ms"] for r in res["rows"] if r["path"] == "nvfp4@torch"]
    assert fig.layout.yaxis.type == "log"
    with pytest.raises(ValueError, match="rows"):
        figures.model_forward_figure({"rows": []})


def test_check_fails_a_path_far_from_bf16():
    # the emulation-vs-bf16 and graph-vs-eager checks can fail
    failures = []
    row = dict(path="nvfp4@fused", M=1, eager_ms=1.0, graph_ms=1.0, ms=1.0, sqnr_db_vs_bf16=-3.0, graph_sqnr_db=20.0)
    bm._check_row(row, bm.PathSpec("nvfp4"), 1.0, 60.0, failures)
    assert len(failures) == 2 and "eager" in failures[0] and "from bf16" in failures[1]
    failures = []
    bm._check_row(
        dict(row, sqnr_db_vs_bf16=math.nan, graph_sqnr_db=None, ms=0.0), bm.PathSpec("nvfp4"), 1.0, 60.0, failures
    )
    assert len(failures) == 2 and "ms = 0.0" in failures[0]


def test_bad_options_name_the_option():
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="--schemes.*needs CUDA"):
        bm.parse_paths("nvfp4@triton", cpu)
    with pytest.raises(ValueError, match="--schemes.*backend"):
        bm.parse_paths("nvfp4@cuda", cpu)
    with pytest.raises(ValueError, match="--schemes.*'nvfp5'"):
        bm.parse_paths("nvfp5", cpu)
    with pytest.raises(ValueError, match="--tokens"):
        bm._parse_tokens("1,0")
    with pytest.raises(ValueError, match="--layers"):
        bm.build_model("tiny", 0, "cpu")
    paths = bm.parse_paths("bf16,w_fp4_a_fp4,w_mxfp4_a_mxfp4", cpu)  # vLLM's older name resolves, duplicates drop
    assert paths == [bm.PathSpec(None), bm.PathSpec("w_mxfp4_a_mxfp4")]
    assert bm.parse_paths(None, torch.device("cuda"))[-1] == bm.PathSpec("nvfp4", "triton")


class _FakeGraph:
    """A stand-in for ``torch.cuda.CUDAGraph`` on the CPU: replay reruns the function into the same output."""

    def __init__(self, fn, out):
        self.fn, self.out = fn, out

    def replay(self):
        self.out.copy_(self.fn())


@pytest.mark.parametrize("whole_fails", [False, True])
def test_graph_modes_flow_on_the_cpu(monkeypatch, whole_fails):
    # the graph bookkeeping (whole forward, or per-MoE-block after a failed capture) with a fake capture
    calls = []

    def fake_capture(fn, pool=None):
        calls.append(pool)
        if whole_fails and len(calls) == 1:
            raise RuntimeError("operation not permitted when stream is capturing")
        out = fn()
        return _FakeGraph(fn, out), out

    monkeypatch.setattr(bm, "capture", fake_capture)
    model = bm.build_model("tiny", 2, "cpu")
    blocks = [layer.mlp for layer in model.model.layers]
    ids = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        r = bm._time_forward(model, ids, torch.device("cpu"), 1.0, graphs=True)
    assert r["graph_ms"] > 0 and r["eager_ms"] > 0 and r["graph_bit_exact"] and r["graph_sqnr_db"] is None
    if whole_fails:
        assert r["graph_mode"] == "per_moe_block" and "stream is capturing" in r["graph_error"]
        assert len(calls) == 1 + len(blocks)
    else:
        assert r["graph_mode"] == "whole" and "graph_error" not in r and len(calls) == 1
    assert [layer.mlp for layer in model.model.layers] == blocks  # the blocks are put back


def test_a_path_named_twice_runs_once():
    # on the CPU "nvfp4" (auto) and "nvfp4@torch" are the same path
    logs = []
    res = bm.bench_model(
        "tiny", 1, (1,), "nvfp4,nvfp4@torch", "cpu", calib_tokens=64, rep_ms=1.0, log=lambda *a, **k: logs.append(a[0])
    )
    assert [r["path"] for r in res["rows"]] == ["bf16", "nvfp4@torch"] and res["failures"] == []
    assert any("already measured" in line for line in logs)


def test_no_graph_at_all_keeps_the_eager_time(monkeypatch):
    def failing_capture(fn, pool=None):
        raise RuntimeError("capture failed")

    monkeypatch.setattr(bm, "capture", failing_capture)
    model = bm.build_model("tiny", 1, "cpu")
    blocks = [layer.mlp for layer in model.model.layers]
    with torch.no_grad():
        r = bm._time_forward(model, torch.zeros(1, 4, dtype=torch.long), torch.device("cpu"), 1.0, graphs=True)
    assert r["graph_ms"] is None and r["graph_mode"] is None and r["eager_ms"] > 0
    assert r["graph_error"].count("capture failed") == 2 and "per-block" in r["graph_error"]
    assert [layer.mlp for layer in model.model.layers] == blocks
