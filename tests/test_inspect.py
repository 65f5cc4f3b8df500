"""The checkpoint inspector: reads configs, headers and scale scalars only; reports what is stored.

Checkpoints are tiny (2 layers, hidden 64, 16 experts) dummy-weight ones in the layouts of the
hand-written configs under tests/fixtures/configs; every expectation is recomputed here from the
stored tensors (safetensors ``load_file``) or from hand-set scale values.
"""

import json
import shutil
import statistics
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mxlib import formats
from mxlib.checkpoints import (
    dummy_checkpoint_from_config,
    inspect_checkpoint,
    read_quant_config,
    write_quantized_checkpoint,
)
from mxlib.checkpoints import inspect as I
from mxlib.checkpoints.files import headers, safetensors_io
from mxlib.cli import main as cli_main
from mxlib.formats import FP8_E4M3_PER_TENSOR, NVFP4
from mxlib.models.calibration import calibrate
from mxlib.models.qwen3 import MODEL_PRESETS, dummy_qwen3_moe, qwen3_30b_a3b_config
from mxlib.moe import SCALE_STRATEGIES
from mxlib.workbook import explorers as explore

CONFIGS = Path(__file__).parent / "fixtures" / "configs"
E = 16  # experts of the tiny preset
SHARD = "model-00001-of-00001.safetensors"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("inspect")
    out = {}
    for key, name in (
        ("nvfp4", "modelopt-nvfp4-qwen3-30b-a3b"),
        ("mxfp4", "quark-w_mxfp4_a_mxfp4-qwen3-30b-a3b"),
        ("fp8", "quark-w_mxfp4_a_fp8-qwen3-30b-a3b"),
    ):
        out[key] = dummy_checkpoint_from_config(
            CONFIGS / name, root / key, num_hidden_layers=2, seed=3, model_preset="tiny", expert_spread=1.0
        )
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(path: Path, edit) -> None:
    """Rewrite the single shard (and the index) of a copied checkpoint with ``edit(state)``."""
    state = load_file(str(path / SHARD))
    edit(state)
    save_file(state, str(path / SHARD), metadata={"format": "pt"})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: SHARD for k in state}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def _input_scales(state, layer):
    """(a1 [E], a2 [E]) decode scales straight from the stored tensors: a1 = max(gate, up)."""
    pre = f"model.layers.{layer}.mlp.experts"
    a1 = [
        max(float(state[f"{pre}.{e}.gate_proj.input_scale"]), float(state[f"{pre}.{e}.up_proj.input_scale"]))
        for e in range(E)
    ]
    a2 = [float(state[f"{pre}.{e}.down_proj.input_scale"]) for e in range(E)]
    return a1, a2


# ----------------------------------------------------------------------------- what is read


class _Recorder:
    """Wraps ``headers.open_regular`` (every file the header reader opens): records the byte range of every ``read``."""

    reads: list = []

    def __init__(self, path, mode="r", *args, **kwargs):
        assert mode == "rb", mode
        self.path = Path(path)
        self._f = open(path, mode, *args, **kwargs)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()

    def close(self):
        self._f.close()

    def seek(self, pos, whence=0):
        return self._f.seek(pos, whence)

    def fileno(self):
        return self._f.fileno()

    def read(self, n=-1):
        pos = self._f.tell()
        data = self._f.read(n)
        _Recorder.reads.append((self.path.name, pos, len(data)))
        return data


def _spans(path: Path) -> dict:
    """{name: (file, begin, end)} of every tensor's data, parsed here from the safetensors header."""
    out = {}
    for f in path.glob("*.safetensors"):
        raw = f.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8 : 8 + n])
        header.pop("__metadata__", None)
        out.update({k: (f.name, 8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1]) for k, v in header.items()})
    return out


@pytest.mark.parametrize("key", ["nvfp4", "fp8", "mxfp4"])
def test_reads_only_the_scale_scalars(ckpts, monkeypatch, key):
    path = ckpts[key]
    _Recorder.reads = []
    monkeypatch.setattr(headers, "open_regular", lambda p: _Recorder(p, "rb"))

    def no_open(*a, **k):
        raise AssertionError("the layout check opened a safetensors file")

    monkeypatch.setattr(safetensors_io, "safe_open", no_open)  # the loader's TensorReader must not read
    report = inspect_checkpoint(path)
    spans = _spans(path)
    scale = {k: v for k, v in spans.items() if k.endswith(("input_scale", "weight_scale_2", "global_scale"))}
    by_range = {v: k for k, v in spans.items()}
    data_reads = []
    for fname, pos, size in _Recorder.reads:
        if not fname.endswith(".safetensors"):
            continue
        header_len = struct.unpack("<Q", (path / fname).read_bytes()[:8])[0]
        if (pos, size) in ((0, 8), (8, header_len)):  # the header
            continue
        data_reads.append(by_range[(fname, pos, pos + size)])  # else exactly one tensor's data
    assert sorted(data_reads) == sorted(scale)
    assert not any(n.endswith((".weight", ".weight_scale", ".weight_packed")) for n in data_reads)
    assert report.tensors_read == len(scale) and report.bytes_read == 4 * len(scale)
    assert report.tensors_total == len(spans)
    expected = {"nvfp4": 2 * E * 3 * 2, "fp8": 2 * E * 3, "mxfp4": 0}[key]  # input_scale (+ weight_scale_2)
    assert len(scale) == expected
    assert report.layout_ok and report.problems == []


# ----------------------------------------------------------------------------- what is reported


def test_nvfp4_report_matches_the_stored_tensors(ckpts):
    path = ckpts["nvfp4"]
    r = inspect_checkpoint(path)
    state = load_file(str(path / SHARD))
    info = read_quant_config(path)
    assert (r.format, r.scheme, r.activation) == (info.format, "nvfp4", "nvfp4") == ("modelopt", "nvfp4", "nvfp4")
    assert r.producer == "modelopt 0.47.0" and r.exclude == info.exclude
    assert (r.num_hidden_layers, r.num_experts, r.hidden_size, r.moe_intermediate_size) == (2, E, 64, 32)
    assert [(q["pattern"], q["modules"]) for q in r.quantized["experts"]] == [
        ("model.layers.*.mlp.experts.*.{down_proj,gate_proj,up_proj}", 2 * E * 3)
    ]
    assert r.quantized["experts"][0]["tensors"] == ["input_scale", "weight", "weight_scale", "weight_scale_2"]
    assert r.quantized["attention"] == [] and r.quantized["other"] == []
    plain = {q["pattern"]: q["modules"] for q in r.unquantized}
    assert plain == {
        "lm_head": 1,
        "model.embed_tokens": 1,
        "model.layers.*.mlp.gate": 2,
        "model.layers.*.self_attn.{k_proj,o_proj,q_proj,v_proj}": 8,
    }
    rows = {(x["layer"], x["point"]): x for x in r.activation_scales}
    assert sorted(rows) == [(0, "a1"), (0, "a2"), (1, "a1"), (1, "a2")]
    for layer in range(2):
        a1, a2 = _input_scales(state, layer)
        for point, vals in (("a1", a1), ("a2", a2)):
            row = rows[(layer, point)]
            cal = [v for v in vals if v > 0]
            assert (row["min"], row["max"]) == (min(cal), max(cal))  # fp32 values, exact
            assert row["ratio"] == max(cal) / min(cal) and row["uncalibrated"] == [e for e in range(E) if vals[e] == 0]
            assert row["shared"] is False
    ws2 = [float(v) for k, v in state.items() if k.endswith("weight_scale_2")]
    assert r.weight_global_scales == dict(count=len(ws2), min=min(ws2), max=max(ws2), gate_up_differ=0)
    strat = {(x["point"], x["strategy"]): x for x in r.strategies}
    assert sorted(strat) == sorted((p, s) for p in ("a1", "a2") for s in SCALE_STRATEGIES)
    for p in ("a1", "a2"):
        assert strat[(p, "per_expert")]["mean_db_lost"] == 0 and strat[(p, "per_expert")]["clipped"] == 0
        assert strat[(p, "max")]["clipped"] == 0
    # clipped under median: experts above their layer's (lower) median, counted from the tensors
    for p, idx in (("a1", 0), ("a2", 1)):
        clipped = 0
        for layer in range(2):
            vals = [v for v in _input_scales(state, layer)[idx] if v > 0]
            med = statistics.median_low(vals)
            clipped += sum(v > med for v in vals)
        assert strat[(p, "median")]["clipped"] == clipped


def test_uncalibrated_shared_and_threshold_experts(ckpts, tmp_path):
    path = _copy(ckpts["nvfp4"], tmp_path / "edited")
    sub, flush = I.NVFP4_SUBNORMAL_RATIO, I.NVFP4_FLUSH_RATIO
    top = 1e-3

    def edit(state):
        pre0, pre1 = "model.layers.0.mlp.experts", "model.layers.1.mlp.experts"
        # layer 0, a2: expert 0 the max, 1 subnormal, 2 flushed, 3 never calibrated, the rest at half the max
        for e in range(E):
            v = {0: top, 1: top * sub * 0.9, 2: top * flush * 0.9, 3: 0.0}.get(e, top / 2)
            state[f"{pre0}.{e}.down_proj.input_scale"] = torch.tensor(v, dtype=torch.float32)
        # layer 1, a1: one shared scale for every expert (ModelOpt 0.47)
        for e in range(E):
            for proj in ("gate_proj", "up_proj"):
                state[f"{pre1}.{e}.{proj}.input_scale"] = torch.tensor(2e-3, dtype=torch.float32)

    _edit_tensors(path, edit)
    r = inspect_checkpoint(path)
    rows = {(x["layer"], x["point"]): x for x in r.activation_scales}
    assert rows[(0, "a2")]["uncalibrated"] == [3] and rows[(0, "a2")]["calibrated"] == E - 1
    assert rows[(1, "a1")]["shared"] is True and rows[(1, "a1")]["ratio"] == 1.0
    assert rows[(0, "a1")]["shared"] is False
    assert any("same input scale" in n for n in r.notes) and any("never calibrated" in n for n in r.notes)
    mx = next(x for x in r.strategies if x["point"] == "a2" and x["strategy"] == "max")
    state = load_file(str(path / SHARD))
    calibrated = sum(v > 0 for layer in range(2) for v in _input_scales(state, layer)[1])
    assert mx["experts"] == calibrated <= 2 * E - 1  # uncalibrated experts are left out
    assert (mx["subnormal"], mx["flushed"], mx["clipped"]) == (2, 1, 0)
    assert mx["worst"] == (0, 2) and mx["worst_db_lost"] == pytest.approx(I.predicted_db_lost(flush * 0.9, NVFP4))
    assert mx["worst_db_lost"] > 15.0  # the flushed expert loses everything
    pe = next(x for x in r.strategies if x["point"] == "a2" and x["strategy"] == "per_expert")
    assert (pe["subnormal"], pe["flushed"], pe["worst_db_lost"], pe["worst"]) == (0, 0, 0.0, None)
    assert "uncal" in r.table() and "(0, 2)" in r.table()


def test_encode_global_scales_read_as_reciprocals(ckpts, tmp_path):
    """compressed-tensors' ``*_global_scale`` tensors are encode scales: the report inverts them."""
    path = _copy(ckpts["nvfp4"], tmp_path / "ct")

    def edit(state):
        for name in [n for n in state if n.endswith(("input_scale", "weight_scale_2"))]:
            base, _, suffix = name.rpartition(".")
            new = "input_global_scale" if suffix == "input_scale" else "weight_global_scale"
            state[f"{base}.{new}"] = (1.0 / state.pop(name).double()).float().reshape(1)

    _edit_tensors(path, edit)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "not-a-layout"}
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "hf_quant_config.json").unlink()
    ref = {(x["layer"], x["point"]): x for x in inspect_checkpoint(ckpts["nvfp4"]).activation_scales}
    r = inspect_checkpoint(path)
    assert r.format is None and not r.layout_ok and any("quant_method" in p for p in r.problems)
    assert r.strategies == []  # no scheme known: no model to predict with
    for row in r.activation_scales:
        want = ref[(row["layer"], row["point"])]
        for k in ("min", "max", "ratio"):
            assert row[k] == pytest.approx(want[k], rel=1e-6)


def test_layout_problems_are_reported_not_raised(ckpts, tmp_path):
    path = _copy(ckpts["nvfp4"], tmp_path / "broken")
    bad = "model.layers.1.mlp.experts.2.up_proj.weight_scale"

    def edit(state):
        state[bad] = state[bad].view(torch.uint8)  # wrong dtype
        state["model.layers.0.self_attn.q_proj.weight_scale"] = torch.zeros(4, 4, dtype=torch.float8_e4m3fn)

    _edit_tensors(path, edit)
    r = inspect_checkpoint(path)
    assert not r.layout_ok and any(bad in p and "dtype" in p for p in r.problems)
    assert [q["pattern"] for q in r.quantized["attention"]] == ["model.layers.*.self_attn.q_proj"]
    assert any("named by the exclude list" in p for p in r.problems)  # its ignore list has self_attn*
    assert "FAILED" in r.table()


def test_checkpoint_written_by_mxlib(tmp_path):
    """write_quantized_checkpoint's config (transformers 5 names num_experts num_local_experts)."""
    cfg = qwen3_30b_a3b_config(num_hidden_layers=1, **{**MODEL_PRESETS["tiny"], "num_experts": 4})
    model = dummy_qwen3_moe(cfg, seed=0)
    cal = calibrate(model, torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0)))
    path = write_quantized_checkpoint(model, "nvfp4", tmp_path / "ckpt", cal)
    r = inspect_checkpoint(path)
    assert r.layout_ok and r.problems == [] and (r.num_experts, r.num_hidden_layers) == (4, 1)
    assert r.producer == "modelopt mxlib-dummy" and r.scheme == "nvfp4"


def test_fused_unquantized_experts_are_named(ckpts, tmp_path):
    """What Quark writes without preprocess_for_quantization: transformers' fused bf16 experts."""
    path = _copy(ckpts["mxfp4"], tmp_path / "fused")

    def edit(state):
        for k in [k for k in state if ".mlp.experts." in k]:
            del state[k]
        for layer in range(2):
            state[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.zeros(E, 64, 64, dtype=torch.bfloat16)
            state[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.zeros(E, 64, 32, dtype=torch.bfloat16)

    _edit_tensors(path, edit)
    r = inspect_checkpoint(path)
    assert r.quantized["experts"] == [] and not r.layout_ok
    assert {
        "pattern": "model.layers.*.mlp.experts.{down_proj,gate_up_proj}",
        "modules": 4,
        "weight_dtype": "BF16",
    } in r.unquantized
    assert any("fused and unquantized" in n for n in r.notes)
    assert any("missing tensor 'model.layers.0.mlp.experts.0.gate_proj.weight'" in p for p in r.problems)


def test_mx_and_fp8_checkpoints(ckpts):
    mx = inspect_checkpoint(ckpts["mxfp4"])
    assert (mx.format, mx.scheme, mx.activation) == ("quark", "w_mxfp4_a_mxfp4", "mxfp4")
    assert mx.activation_scales == [] and mx.strategies == [] and mx.layout_ok
    assert mx.quantized["experts"][0]["tensors"] == ["weight", "weight_scale"]
    fp8 = inspect_checkpoint(ckpts["fp8"])
    assert (fp8.scheme, fp8.activation) == ("w_mxfp4_a_fp8", "fp8_e4m3")
    state = load_file(str(ckpts["fp8"] / SHARD))
    a1, a2 = _input_scales(state, 0)
    row = next(x for x in fp8.activation_scales if (x["layer"], x["point"]) == (0, "a2"))
    assert (row["min"], row["max"]) == (min(v for v in a2 if v > 0), max(a2))
    worst = next(x for x in fp8.strategies if (x["point"], x["strategy"]) == ("a2", "max"))
    r_min = min(v for v in a2 if v > 0) / max(a2)
    expected = max(
        I.predicted_db_lost(v / max(vals), FP8_E4M3_PER_TENSOR)
        for vals in (_input_scales(state, 0)[1], _input_scales(state, 1)[1])
        for v in vals
        if v > 0
    )
    assert worst["worst_db_lost"] == pytest.approx(expected, abs=1e-6) and r_min < 1


# ----------------------------------------------------------------------------- the loss model


def test_thresholds_are_notebook_04s():
    assert I.NVFP4_SUBNORMAL_RATIO == formats.NVFP4_SUBNORMAL_RATIO == 2.0**-6 / 448
    assert I.NVFP4_FLUSH_RATIO == formats.NVFP4_FLUSH_RATIO == 2.0**-10 / 448


def test_predicted_loss_follows_the_synthetic_experts():
    sub, flush = I.NVFP4_SUBNORMAL_RATIO, I.NVFP4_FLUSH_RATIO
    assert I.predicted_db_lost(1.0, NVFP4) == 0.0
    # the same kind of synthetic expert as notebook 04's explorer (different samples): close
    for r in (0.5, 1e-3, sub / 2, flush / 2):
        row = explore.expert_scale_ratio(r, num_experts=2, tokens=64, hidden=256)[-1]
        assert I.predicted_db_lost(r, NVFP4) == pytest.approx(
            row["sqnr_per_expert_db"] - row["sqnr_unified_db"], abs=0.5
        ), r
    # nothing systematic above 1e-3; several dB below the subnormal threshold; everything once flushed
    assert I.predicted_db_lost(1e-3, NVFP4) < 0.3
    assert I.predicted_db_lost(sub / 4, NVFP4) > 1.5
    assert I.predicted_db_lost(flush / 2, NVFP4) == I.predicted_db_lost(1e-12, NVFP4) > 15
    # clipping grows with r > 1
    clip = [I.predicted_db_lost(r, NVFP4) for r in (1.5, 2.0, 4.0, 16.0)]
    assert clip == sorted(clip) and clip[-1] > 10
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="ratio"):
            I.predicted_db_lost(bad, NVFP4)
    with pytest.raises(ValueError, match="activation"):
        I.predicted_db_lost(0.5, None)


# ----------------------------------------------------------------------------- command line and errors


def test_cli_inspect_prints_a_table_and_writes_json(ckpts, tmp_path, capsys):
    out = tmp_path / "report.json"
    assert cli_main(["inspect", str(ckpts["nvfp4"]), "--json", str(out), "--strategies", "max,per_expert"]) == 0
    text = capsys.readouterr().out
    assert "scheme nvfp4" in text and "layout check ok" in text and "per_expert" in text
    data = json.loads(out.read_text())
    assert data["scheme"] == "nvfp4" and data["layout_ok"] is True
    assert {x["strategy"] for x in data["strategies"]} == {"max", "per_expert"} and len(data["activation_scales"]) == 4


def test_bad_arguments(ckpts, tmp_path):
    with pytest.raises(ValueError, match="strategies"):
        inspect_checkpoint(ckpts["nvfp4"], strategies=["max", "p99"])
    # the checkpoint's faults are problems of the report, never raised (the inspector's contract)
    r = inspect_checkpoint(tmp_path)
    assert not r.layout_ok and len(r.problems) == 1 and "config.json: not found" in r.problems[0]
    (tmp_path / "config.json").write_text("{}")
    r = inspect_checkpoint(tmp_path)
    assert not r.layout_ok and any("model.safetensors" in p for p in r.problems), r.problems
