"""The writer's technique hook and the registry: rtn writes the layout's own bytes, every technique round-trips."""

import json
from pathlib import Path

import pytest
import torch

from mxlib import checkpoints as C
from mxlib import reference as R
from mxlib.models.calibration import calibrate
from mxlib.models.qwen3 import MODEL_PRESETS, dummy_qwen3_moe, expert_weights, qwen3_30b_a3b_config
from mxlib.moe.emulation import ExpertWeights
from mxlib.moe.schemes import get_moe_scheme
from mxlib.recovery import RECOVERY_CONFIG_KEY, TECHNIQUES, FourOverSix, RoundToNearest, get_technique

from _util import TINY_QWEN3, assert_bits_equal


@pytest.fixture(scope="module")
def tiny():
    model = dummy_qwen3_moe(qwen3_30b_a3b_config(num_hidden_layers=2, **TINY_QWEN3), seed=1, expert_spread=0.5)
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    return model, calibrate(model, tokens)


def _files(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.mark.parametrize("scheme", ["nvfp4", "w_mxfp4_a_mxfp4", "w_mxfp6_e3m2_a_mxfp6_e3m2"])
def test_rtn_technique_writes_the_default_bytes(tiny, tmp_path, scheme):
    model, cal = tiny
    a = C.write_quantized_checkpoint(model, scheme, tmp_path / "a", cal)
    b = C.write_quantized_checkpoint(model, scheme, tmp_path / "b", cal, technique="rtn")
    assert _files(a) == _files(b)


def test_get_technique_names_the_choices():
    assert isinstance(get_technique("rtn"), RoundToNearest)
    t = RoundToNearest()
    assert get_technique(t) is t
    with pytest.raises(ValueError, match=r"technique: expected one of .*'rtn'.*got 'nope'"):
        get_technique("nope")
    with pytest.raises(ValueError, match="already built"):
        get_technique(t, x=1)
    assert "rtn" in TECHNIQUES


# ----------------------------------------------------------------------------- composition


class _Rotation:
    """A test-local stand-in for the rotation technique: records what it wraps."""

    name = "hadamard"

    def __init__(self, inner=None, block_size=None, signs=None, seed=0):
        self.inner, self.block_size, self.signs, self.seed = inner, block_size, signs, seed

    def quantize_experts(self, w13, w2, scheme, *, layer):
        return self.inner.quantize_experts(w13, w2, scheme, layer=layer)

    def config(self):
        return {"block_size": self.block_size}


def test_get_technique_composes_the_rotation_outermost(monkeypatch):
    monkeypatch.setitem(TECHNIQUES, "hadamard", _Rotation)
    t = get_technique("four_over_six+hadamard", metric="mae", block_size=16, signs="random")
    assert isinstance(t, _Rotation) and t.block_size == 16 and t.signs == "random"
    assert isinstance(t.inner, FourOverSix) and t.inner.metric == "mae"
    assert isinstance(get_technique("rtn+hadamard").inner, RoundToNearest)
    assert isinstance(get_technique("hadamard"), _Rotation)
    for bad in ("hadamard+mse", "mse+rtn", "mse+hadamard+hadamard", "+hadamard", "hadamard+hadamard"):
        with pytest.raises(ValueError, match=r"a composition is 'X\+R' .* last \(outermost\), got"):
            get_technique(bad)
    with pytest.raises(ValueError, match=r"technique: expected one of .*got 'nope'"):
        get_technique("nope+hadamard")


def test_get_technique_without_the_rotation_registered(monkeypatch):
    monkeypatch.delitem(TECHNIQUES, "hadamard", raising=False)
    with pytest.raises(ValueError, match="rotation 'hadamard' of 'mse\\+hadamard' is not registered"):
        get_technique("mse+hadamard")


def test_technique_options_are_checked():
    with pytest.raises(ValueError, match=r"metric: expected one of \['mse', 'mae'\], got 'x'"):
        get_technique("four_over_six", metric="x")
    with pytest.raises(ValueError, match="importance: expected None or an object with .diagonal"):
        get_technique("mse", importance=3)
    with pytest.raises(TypeError):
        get_technique("mse", nope=1)


# ----------------------------------------------------------------------------- checkpoints


def _dequantized(w, proj):
    """fp32 dequantized w13 or w2 of ExpertWeights, per the weights' own global-scale kind."""
    p, s = getattr(w, f"{proj}_weight"), getattr(w, f"{proj}_weight_scale")
    if not w.scheme.has_global_scale:
        return R.dequantize_mx(p, s, w.scheme.element.name, w.scheme.block_size, torch.float32)
    g = getattr(w, f"{proj}_weight_scale_2")
    out = []
    for x in range(p.shape[0]):
        gx = g[x] if g[x].ndim == 0 else g[x, 0]
        out.append(R.dequantize_to_dtype(p[x], s[x], gx, torch.float32, global_scale_kind=w.global_scale_kind))
    return torch.stack(out)


CASES = [
    ("four_over_six", "nvfp4", "modelopt"),
    ("four_over_six", "nvfp4", "compressed-tensors"),
    ("mse", "nvfp4", "modelopt"),
    ("mse", "nvfp4", "compressed-tensors"),
    ("mse", "w_mxfp4_a_mxfp4", "quark"),
    ("mse", "w_mxfp6_e3m2_a_mxfp6_e3m2", "quark"),
    ("four_over_six_mse", "nvfp4", "modelopt"),
    ("four_over_six_mse", "nvfp4", "compressed-tensors"),
]


@pytest.mark.parametrize("name,scheme,layout", CASES)
def test_technique_checkpoint_round_trip(tiny, tmp_path, name, scheme, layout):
    model, cal = tiny
    technique = get_technique(name)
    path = C.write_quantized_checkpoint(model, scheme, tmp_path / "t", cal, layout=layout, technique=technique)
    rtn = C.write_quantized_checkpoint(model, scheme, tmp_path / "r", cal, layout=layout)
    loaded, info = C.load_quantized_qwen3_moe(path, backend="torch")
    base, _ = C.load_quantized_qwen3_moe(rtn, backend="torch")
    assert info.format == layout
    changed = 0
    kind = "encode" if layout == "compressed-tensors" else "decode"
    for layer in range(2):
        w13, w2 = expert_weights(model, layer)
        kw = {"global_scale_kind": kind} if scheme == "nvfp4" else {}
        want = technique.quantize_experts(w13, w2, get_moe_scheme(scheme), layer=layer, **kw)
        ex, ex_rtn = loaded.model.layers[layer].mlp.experts.experts, base.model.layers[layer].mlp.experts.experts
        got = ExpertWeights(
            want.scheme,
            *(getattr(ex, n) for n in ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")),
            getattr(ex, "w13_weight_scale_2", None),
            getattr(ex, "w2_weight_scale_2", None),
            global_scale_kind=getattr(ex, "global_scale_kind", "decode"),
        )
        for proj in ("w13", "w2"):
            assert_bits_equal(_dequantized(got, proj), _dequantized(want, proj), f"layer {layer} {proj}")
        # only the scales and codes differ from round-to-nearest's checkpoint: the same experts, the same path
        assert type(ex) is type(ex_rtn) and ex.resolved_backend(ex._device()) == ex_rtn.resolved_backend(ex._device())
        assert ex.fp4_kernel_applies() == ex_rtn.fp4_kernel_applies()
        changed += int((ex.w13_weight_scale.view(torch.uint8) != ex_rtn.w13_weight_scale.view(torch.uint8)).sum())
    print(f"{name} {scheme} {layout}: {changed} w13 block scales differ from round-to-nearest's")
    assert changed > 0 or scheme.startswith("w_mxfp6")  # the e3m2 grid: round-to-nearest's scale is kept here
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    assert RECOVERY_CONFIG_KEY not in qc  # a scale-only technique leaves the forward unchanged


def test_decode_only_technique_refused_by_an_encode_layout(tiny, tmp_path):
    model, cal = tiny
    with pytest.raises(ValueError, match=r"technique: rtn produces NVFP4 global scales of kind \['decode'\]"):
        C.write_quantized_checkpoint(model, "nvfp4", tmp_path / "c", cal, layout="compressed-tensors", technique="rtn")
    assert not (tmp_path / "c").exists()


def test_cli_writes_a_technique_checkpoint(tmp_path, capsys):
    from mxlib.cli import main as cli_main

    configs = Path(__file__).resolve().parent / "fixtures" / "configs" / "qwen3-30b-a3b"
    out = tmp_path / "r.json"
    argv = ["dummy-from-config", str(configs), str(tmp_path / "ckpt"), "--scheme", "nvfp4", "--layers", "1"]
    argv += ["--technique", "four_over_six", "--preset", "tiny", "--device", "cpu", "--backend", "torch"]
    assert cli_main([*argv, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["technique"] == "four_over_six" and result["logits_finite"]
    assert "technique four_over_six" in capsys.readouterr().out
    # the stored experts are the technique's
    model = dummy_qwen3_moe(
        qwen3_30b_a3b_config(num_hidden_layers=1, **MODEL_PRESETS["tiny"]), seed=0, expert_spread=0.0
    )
    w13, w2 = expert_weights(model, 0)
    want = FourOverSix().quantize_experts(w13, w2, get_moe_scheme("nvfp4"), layer=0)
    loaded, _ = C.load_quantized_qwen3_moe(tmp_path / "ckpt", backend="torch")
    ex = loaded.model.layers[0].mlp.experts.experts
    assert torch.equal(ex.w13_weight_scale.view(torch.uint8), want.w13_weight_scale.view(torch.uint8))
    assert torch.equal(ex.w2_weight, want.w2_weight) and torch.equal(ex.w2_weight_scale_2, want.w2_weight_scale_2)
