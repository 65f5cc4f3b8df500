"""Dummy weights from a real checkpoint's config files: the layout the config names, loaded and run.

The configs under tests/fixtures/configs are hand-written from the documented layouts of
nvidia/Qwen3-30B-A3B-NVFP4 (ModelOpt) and Quark OCP MX exports of Qwen3-30B-A3B; every build here
is cut to 1-2 layers and the ``tiny`` preset (hidden 64, 16 experts), never full size.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from mxlib.checkpoints import (
    LAYOUTS,
    CheckpointDescription,
    CheckpointError,
    CheckpointLayout,
    dummy_checkpoint_from_config,
    inspect_checkpoint,
    load_quantized_qwen3_moe,
)
from mxlib.checkpoints.dummy import dummy_quantization
from mxlib.cli import main as cli_main
from mxlib.models.qwen3 import MODEL_PRESETS, dummy_qwen3_moe, expert_weights, qwen3_30b_a3b_config
from mxlib.moe.emulation import ExpertWeights
from mxlib.moe.factory import quantize_expert_weights
from mxlib.moe.schemes import get_moe_scheme

CONFIGS = Path(__file__).parent / "fixtures" / "configs"
TINY = MODEL_PRESETS["tiny"]
H, I, E = TINY["hidden_size"], TINY["moe_intermediate_size"], TINY["num_experts"]


# per fixture: layout, scheme, and the per-expert tensors as (suffix, safetensors dtype, shape of [out, in])
# written from the documented layouts (REFERENCE section 4), not from mxlib's writers
def NVFP4_TENSORS(o, i):
    return {
        "weight": ("U8", [o, i // 2]),
        "weight_scale": ("F8_E4M3", [o, i // 16]),
        "weight_scale_2": ("F32", []),
        "input_scale": ("F32", []),
    }


MXFP4_TENSORS = lambda o, i: {"weight": ("U8", [o, i // 2]), "weight_scale": ("U8", [o, i // 32])}  # noqa: E731
CASES = {
    "modelopt-nvfp4-qwen3-30b-a3b": ("modelopt", "nvfp4", NVFP4_TENSORS),
    "quark-w_mxfp4_a_mxfp4-qwen3-30b-a3b": ("quark", "w_mxfp4_a_mxfp4", MXFP4_TENSORS),
    "quark-w_mxfp4_a_fp8-qwen3-30b-a3b": (
        "quark",
        "w_mxfp4_a_fp8",
        lambda o, i: {**MXFP4_TENSORS(o, i), "input_scale": ("F32", [])},
    ),
}


def _headers(path: Path) -> dict:
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for fname in sorted(set(index.values())):
        with safe_open(str(path / fname), "pt") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                out[k] = (sl.get_dtype(), list(sl.get_shape()))
    assert set(out) == set(index)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_layout_of_the_config_loaded_and_run(tmp_path, name):
    fmt, scheme, tensors = CASES[name]
    src = CONFIGS / name
    path = dummy_checkpoint_from_config(src, tmp_path / "ckpt", num_hidden_layers=2, seed=5, model_preset="tiny")
    # the config files: the source's, with only the layer count and the shrunk sizes changed
    source, written = json.loads((src / "config.json").read_text()), json.loads((path / "config.json").read_text())
    assert written["quantization_config"] == source["quantization_config"]
    changed = {k for k in set(source) | set(written) if source.get(k) != written.get(k)}
    assert changed <= {"num_hidden_layers", *TINY} and written["num_hidden_layers"] == 2
    assert all(written[k] == v for k, v in TINY.items())
    for extra in src.glob("*.json"):
        if extra.name != "config.json":
            assert (path / extra.name).read_bytes() == extra.read_bytes()
    # every expert tensor of the documented layout, with its dtype and shape; nothing else quantized
    stored = _headers(path)
    for layer in range(2):
        for e in range(E):
            for proj, (o, i) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                base = f"model.layers.{layer}.mlp.experts.{e}.{proj}"
                got = {k[len(base) + 1 :]: v for k, v in stored.items() if k.startswith(base + ".")}
                assert got == {k: (d, s) for k, (d, s) in tensors(o, i).items()}, base
    others = {k: v for k, v in stored.items() if ".mlp.experts." not in k}
    assert all(d == "BF16" for d, _ in others.values()) and "model.layers.0.self_attn.q_proj.weight" in others
    # loads with the layout and scheme the config names, runs, and holds the seeded dummy weights
    model, info = load_quantized_qwen3_moe(path, backend="torch")
    assert (info.format, info.scheme.name) == (fmt, scheme)
    ids = torch.randint(0, TINY["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, 12, TINY["vocab_size"]) and torch.isfinite(logits).all()
    overrides = {k: v for k, v in TINY.items()}
    ref = dummy_qwen3_moe(qwen3_30b_a3b_config(num_hidden_layers=2, **overrides), seed=5)
    for layer in range(2):
        for got, want in zip(expert_weights(model, layer), expert_weights(ref, layer)):
            err = (got.double() - want.double()).pow(2).sum() / want.double().pow(2).sum()
            assert err < 0.02, (layer, float(err))  # 4-bit weights: ~1% relative power, not another seed's (200%)


def test_legacy_config_only(tmp_path):
    """A ModelOpt checkpoint whose config.json has no quantization_config: hf_quant_config.json decides."""
    src = tmp_path / "src"
    shutil.copytree(CONFIGS / "modelopt-nvfp4-qwen3-30b-a3b", src)
    cfg = json.loads((src / "config.json").read_text())
    del cfg["quantization_config"]
    (src / "config.json").write_text(json.dumps(cfg))
    path = dummy_checkpoint_from_config(src, tmp_path / "ckpt", num_hidden_layers=1, model_preset="tiny")
    assert "quantization_config" not in json.loads((path / "config.json").read_text())
    model, info = load_quantized_qwen3_moe(path, backend="torch")
    assert (info.format, info.scheme.name) == ("modelopt", "nvfp4")


def _default_modelopt_config(tmp_path) -> Path:
    """ModelOpt's default NVFP4 config: attention quantized too (its ignore list keeps only the routers,
    lm_head and the embeddings)."""
    src = tmp_path / "src"
    shutil.copytree(CONFIGS / "modelopt-nvfp4-qwen3-30b-a3b", src)
    for fname, key in (
        ("config.json", ("quantization_config", "ignore")),
        ("hf_quant_config.json", ("quantization", "exclude_modules")),
    ):
        cfg = json.loads((src / fname).read_text())
        cfg[key[0]][key[1]] = [p for p in cfg[key[0]][key[1]] if "self_attn" not in p]
        (src / fname).write_text(json.dumps(cfg))
    return src


WRITES_LINEARS = LAYOUTS["modelopt"].supports_linear


@pytest.mark.skipif(WRITES_LINEARS, reason="the ModelOpt layout writes quantized linear layers")
def test_config_quantizing_attention_is_refused(tmp_path):
    src = _default_modelopt_config(tmp_path)
    with pytest.raises(CheckpointError, match=r"outside the MoE experts .*e\.g\. model\.layers\.0\.self_attn\.q_proj"):
        dummy_checkpoint_from_config(src, tmp_path / "ckpt", num_hidden_layers=1, model_preset="tiny")
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.skipif(not WRITES_LINEARS, reason="no layout writes quantized linear layers in this mxlib")
def test_config_quantizing_attention(tmp_path):
    src = _default_modelopt_config(tmp_path)
    path = dummy_checkpoint_from_config(src, tmp_path / "ckpt", num_hidden_layers=2, model_preset="tiny")
    stored = _headers(path)
    h, heads, kv, d = TINY["hidden_size"], TINY["num_attention_heads"], TINY["num_key_value_heads"], TINY["head_dim"]
    for proj, (o, i) in (
        ("q_proj", (heads * d, h)),
        ("k_proj", (kv * d, h)),
        ("v_proj", (kv * d, h)),
        ("o_proj", (h, heads * d)),
    ):
        base = f"model.layers.1.self_attn.{proj}"
        got = {k[len(base) + 1 :]: v for k, v in stored.items() if k.startswith(base + ".")}
        assert got == NVFP4_TENSORS(o, i), base
        assert stored[f"{base}.input_scale"][0] == "F32"
    model, info = load_quantized_qwen3_moe(path, backend="torch")
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.arange(8)[None]).logits).all()
    report = inspect_checkpoint(path)
    assert report.layout_ok and [r["pattern"] for r in report.quantized["attention"]] == [
        "model.layers.*.self_attn.{k_proj,o_proj,q_proj,v_proj}"
    ]


def test_bad_inputs(tmp_path):
    src = CONFIGS / "quark-w_mxfp4_a_mxfp4-qwen3-30b-a3b"
    with pytest.raises(CheckpointError, match="config_dir"):
        dummy_checkpoint_from_config(tmp_path, tmp_path / "out")
    for layers in (0, 49, 1.5):
        with pytest.raises(ValueError, match="num_hidden_layers"):
            dummy_checkpoint_from_config(src, tmp_path / "out", num_hidden_layers=layers, model_preset="tiny")
    with pytest.raises(ValueError, match="model_preset"):
        dummy_checkpoint_from_config(src, tmp_path / "out", num_hidden_layers=1, model_preset="huge")
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"]["global_quant_config"]["weight"]["dtype"] = "int4"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"global_quant_config\.weight\.dtype.*'int4'"):
        dummy_checkpoint_from_config(bad, tmp_path / "out", num_hidden_layers=1, model_preset="tiny")
    assert not (tmp_path / "out").exists()


def test_overrides_win_over_the_preset(tmp_path):
    path = dummy_checkpoint_from_config(
        CONFIGS / "quark-w_mxfp4_a_mxfp4-qwen3-30b-a3b",
        tmp_path / "ckpt",
        num_hidden_layers=1,
        model_preset="tiny",
        overrides={"num_experts": 4},
    )
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["num_experts"] == 4 and cfg["hidden_size"] == H
    assert not any(".experts.4." in k for k in _headers(path))


def test_cli_dummy_from_config(tmp_path, capsys):
    out = tmp_path / "result.json"
    rc = cli_main(
        [
            "dummy-from-config",
            str(CONFIGS / "modelopt-nvfp4-qwen3-30b-a3b"),
            str(tmp_path / "ckpt"),
            "--layers",
            "1",
            "--preset",
            "tiny",
            "--device",
            "cpu",
            "--backend",
            "torch",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    assert "layout modelopt, scheme nvfp4" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["logits_finite"] is True and data["layers"] == 1 and data["num_experts"] == E


# ----------------------------------------------------------------------------- an unquantized config

UNQUANTIZED = CONFIGS / "qwen3-30b-a3b"
# Qwen3-30B-A3B's config.json values (REFERENCE section 5)
QWEN3_30B_A3B = dict(
    hidden_size=2048,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    vocab_size=151936,
    num_hidden_layers=48,
)
CT_TENSORS = lambda o, i: {  # noqa: E731  compressed-tensors nvfp4-pack-quantized (REFERENCE section 4)
    "weight_packed": ("U8", [o, i // 2]),
    "weight_scale": ("F8_E4M3", [o, i // 16]),
    "weight_global_scale": ("F32", [1]),
    "input_global_scale": ("F32", [1]),
}
# scheme, layout asked for (None: the scheme's default), layout written, per-expert tensors, extra config files
UNQUANTIZED_CASES = [
    ("nvfp4", None, "modelopt", NVFP4_TENSORS, {"hf_quant_config.json"}),
    ("w_mxfp4_a_mxfp4", None, "quark", MXFP4_TENSORS, set()),
    ("w_mxfp4_a_fp8", None, "quark", lambda o, i: {**MXFP4_TENSORS(o, i), "input_scale": ("F32", [])}, set()),
    ("nvfp4", "compressed-tensors", "compressed-tensors", CT_TENSORS, set()),
]


def test_the_unquantized_fixture_is_qwen3_30b_a3b():
    cfg = json.loads((UNQUANTIZED / "config.json").read_text())
    assert {k: cfg[k] for k in QWEN3_30B_A3B} == QWEN3_30B_A3B
    assert "quantization_config" not in cfg and [p.name for p in UNQUANTIZED.iterdir()] == ["config.json"]


@pytest.mark.parametrize(
    "scheme,layout,fmt,tensors,extra", UNQUANTIZED_CASES, ids=lambda v: v if isinstance(v, str) else None
)
def test_unquantized_config_with_a_scheme(tmp_path, scheme, layout, fmt, tensors, extra):
    path = dummy_checkpoint_from_config(
        UNQUANTIZED, tmp_path / "ckpt", num_hidden_layers=1, seed=3, model_preset="tiny", scheme=scheme, layout=layout
    )
    source, written = (
        json.loads((UNQUANTIZED / "config.json").read_text()),
        json.loads((path / "config.json").read_text()),
    )
    # the source's config with the sizes changed, and a quantization config added
    changed = {k for k in set(source) | set(written) if source.get(k) != written.get(k)}
    assert changed <= {"num_hidden_layers", "quantization_config", *TINY} and "quantization_config" in changed
    assert written["quantization_config"]["quant_method"] == fmt
    assert {p.name for p in path.glob("*.json")} == {
        "config.json",
        "model.safetensors.index.json",
        "mxlib_checkpoint.json",
        *extra,
    }
    stored = _headers(path)
    for proj, (o, i) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
        base = f"model.layers.0.mlp.experts.{E - 1}.{proj}"
        got = {k[len(base) + 1 :]: v for k, v in stored.items() if k.startswith(base + ".")}
        assert got == tensors(o, i), base
    others = {k: v for k, v in stored.items() if ".mlp.experts." not in k}
    assert all(d == "BF16" for d, _ in others.values()) and "model.layers.0.self_attn.q_proj.weight" in others
    model, info = load_quantized_qwen3_moe(path, backend="torch")
    assert (info.format, info.scheme.name) == (fmt, scheme)
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.arange(8)[None]).logits).all()


def test_unquantized_config_without_a_scheme_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match=r"unquantized config .* names no scheme; choose one .*'nvfp4'"):
        dummy_checkpoint_from_config(UNQUANTIZED, tmp_path / "ckpt", num_hidden_layers=1, model_preset="tiny")
    assert not (tmp_path / "ckpt").exists()


def test_scheme_and_layout_are_checked_against_the_config():
    modelopt = CONFIGS / "modelopt-nvfp4-qwen3-30b-a3b"
    info, files = dummy_quantization(modelopt, "nvfp4")  # the config's own scheme: accepted, nothing added
    assert (info.format, info.scheme.name, files) == ("modelopt", "nvfp4", None)
    with pytest.raises(ValueError, match=r"scheme: .* is quantized as nvfp4 \(modelopt layout\).*got 'w_mxfp4'"):
        dummy_quantization(modelopt, "w_mxfp4")
    with pytest.raises(ValueError, match=r"layout: .* is in the modelopt layout.*got 'quark'"):
        dummy_quantization(modelopt, layout="quark")
    with pytest.raises(ValueError, match="layout: quark does not store scheme nvfp4"):
        dummy_quantization(UNQUANTIZED, "nvfp4", "quark")
    every = r"layout: expected one of \['modelopt', 'quark', 'compressed-tensors', .*\], got 'gguf'"
    with pytest.raises(ValueError, match=every):
        dummy_quantization(UNQUANTIZED, "nvfp4", "gguf")
    with pytest.raises(ValueError, match="unknown MoE scheme 'int4'"):
        dummy_quantization(UNQUANTIZED, "int4")


def test_cli_unquantized_config_with_a_scheme(tmp_path, capsys):
    out = tmp_path / "result.json"
    argv = ["dummy-from-config", str(UNQUANTIZED), str(tmp_path / "ckpt"), "--scheme", "w_mxfp4", "--layers", "1"]
    assert cli_main([*argv, "--preset", "tiny", "--device", "cpu", "--backend", "torch", "--json", str(out)]) == 0
    assert "layout quark, scheme w_mxfp4" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert (data["format"], data["scheme"], data["preset"], data["logits_finite"]) == ("quark", "w_mxfp4", "tiny", True)


def test_cli_unquantized_config_without_a_scheme(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["dummy-from-config", str(UNQUANTIZED), str(tmp_path / "ckpt"), "--preset", "tiny"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "mxlib dummy-from-config: error: " in err and "--scheme" in err, err
    assert "Traceback" not in err and not (tmp_path / "ckpt").exists()


class _EncodeLayout(CheckpointLayout):
    """A layout registered only for this test: other tensor names, encode global scales of shape
    [1] (as compressed-tensors stores them) and its own quantize_experts, so that the builder and
    the inspector are seen to dispatch through the registry, not on the two layouts they know."""

    name = quant_method = "test-encode-layout"
    calls = 0

    def handles(self, scheme):
        return False

    def config_files(self, scheme, quantize_attention=False):
        raise NotImplementedError("this test layout is only read, and written from a config")

    def read_legacy(self, folder):
        return None

    def read_config(self, qc):
        return CheckpointDescription(self.name, get_moe_scheme("nvfp4"), list(qc.get("ignore") or []), None)

    def quantize_experts(self, w13, w2, scheme):
        _EncodeLayout.calls += 1
        return quantize_expert_weights(w13, w2, scheme)

    def expert_tensors(self, scheme, w, in13, in2, prefix):
        out = {}
        i = w.w13_weight.shape[1] // 2
        for x in range(w.w13_weight.shape[0]):
            for proj, rows, p, s, g, ins in (
                ("gate_proj", slice(0, i), w.w13_weight, w.w13_weight_scale, w.w13_weight_scale_2, in13),
                ("up_proj", slice(i, None), w.w13_weight, w.w13_weight_scale, w.w13_weight_scale_2, in13),
                ("down_proj", slice(None), w.w2_weight, w.w2_weight_scale, w.w2_weight_scale_2, in2),
            ):
                base = f"{prefix}.{x}.{proj}"
                out[f"{base}.weight_packed"] = p[x, rows].contiguous()
                out[f"{base}.weight_scale"] = s[x, rows].contiguous()
                out[f"{base}.weight_global_scale"] = (1.0 / g[x].reshape(1).double()).float()
                out[f"{base}.input_global_scale"] = (1.0 / ins[x].reshape(1).double()).float()
        return out

    def read_experts(self, tensors, prefix, e, h, i, description):
        def stack(proj, what, shape, dtype):
            return tensors.stack([f"{prefix}.{x}.{proj}.{what}" for x in range(e)], shape, dtype)

        rows = {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
        w = {p: stack(p, "weight_packed", (rows[p][0], rows[p][1] // 2), torch.uint8) for p in rows}
        s = {p: stack(p, "weight_scale", (rows[p][0], rows[p][1] // 16), torch.float8_e4m3fn) for p in rows}
        g = {p: 1.0 / stack(p, "weight_global_scale", (1,), torch.float32).reshape(e) for p in rows}
        ins = {p: 1.0 / stack(p, "input_global_scale", (1,), torch.float32).reshape(e) for p in rows}
        weights = ExpertWeights(
            get_moe_scheme("nvfp4").weight,
            torch.cat([w["gate_proj"], w["up_proj"]], 1),
            torch.cat([s["gate_proj"], s["up_proj"]], 1),
            w["down_proj"],
            s["down_proj"],
            torch.stack([g["gate_proj"], g["up_proj"]], 1),
            g["down_proj"],
        )
        return weights, torch.maximum(ins["gate_proj"], ins["up_proj"]), ins["down_proj"]


def test_any_registered_layout(tmp_path, monkeypatch):
    layout = _EncodeLayout()
    monkeypatch.setitem(LAYOUTS, layout.name, layout)
    src = tmp_path / "src"
    shutil.copytree(CONFIGS / "modelopt-nvfp4-qwen3-30b-a3b", src)
    (src / "hf_quant_config.json").unlink()
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": layout.quant_method, "ignore": cfg["quantization_config"]["ignore"]}
    (src / "config.json").write_text(json.dumps(cfg))
    _EncodeLayout.calls = 0
    path = dummy_checkpoint_from_config(src, tmp_path / "ckpt", num_hidden_layers=2, model_preset="tiny")
    assert _EncodeLayout.calls == 2  # the layout's own quantization, once per layer
    stored = _headers(path)
    assert stored["model.layers.1.mlp.experts.3.up_proj.input_global_scale"] == ("F32", [1])
    model, info = load_quantized_qwen3_moe(path, backend="torch")
    assert info.format == layout.name
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.arange(8)[None]).logits).all()
    # the inspector: same registry, encode scales reported as decode ones
    report = inspect_checkpoint(path)
    assert report.layout_ok and report.format == layout.name and report.problems == []
    a2 = next(r for r in report.activation_scales if (r["layer"], r["point"]) == (0, "a2"))
    enc = [
        float(
            load_file(str(path / "model-00001-of-00001.safetensors"))[
                f"model.layers.0.mlp.experts.{x}.down_proj.input_global_scale"
            ]
        )
        for x in range(E)
    ]
    dec = [1.0 / v for v in enc if v > 0 and v != float("inf")]
    assert a2["max"] == max(dec) and a2["min"] == min(dec)
