"""Checkpoints: write in the ModelOpt / Quark layouts, read back, compare every tensor; bad checkpoints.

A tiny Qwen3-MoE (hidden 64, 4 experts) keeps this fast; the layout code is the one full-size runs use.
"""

import builtins
import collections
import io
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from mxlib import checkpoints as C
from mxlib import reference as R
from mxlib.checkpoints.files import safetensors_io
from mxlib.models.qwen3 import expert_weights
from mxlib.moe import Nvfp4QuantizationEmulationTritonExperts, OCP_MXQuantizationEmulationTritonExperts

from _util import TINY_QWEN3, tiny_calibrated

TINY = TINY_QWEN3


@pytest.fixture(scope="module")
def tiny():
    return tiny_calibrated(1)


def _read_all(path):
    idx = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for fname in sorted(set(idx.values())):
        out.update(load_file(str(path / fname)))
    assert set(out) == set(idx)
    return out


@pytest.mark.parametrize("scheme", ["nvfp4", "w_mxfp4_a_mxfp4", "w_mxfp6_e3m2_a_fp8", "w_mxfp6_e2m3"])
def test_roundtrip_every_tensor(tiny, tmp_path, scheme):
    model, cal, ids = tiny
    path = C.write_quantized_checkpoint(model, scheme, tmp_path / "ckpt", cal, shard_bytes=20_000)
    files = sorted(p.name for p in path.glob("*.safetensors"))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    stored = _read_all(path)
    cfg = json.loads((path / "config.json").read_text())
    qc = cfg["quantization_config"]
    # every bf16 tensor outside the experts, unchanged
    for name, p in model.state_dict().items():
        if ".mlp.experts." not in name:
            assert stored[name].dtype == torch.bfloat16 and torch.equal(stored[name], p), name
    # every expert tensor equals an independent quantization of the bf16 weights
    for layer in range(2):
        w13, w2 = expert_weights(model, layer)
        i = w2.shape[2]
        gate, up = w13[:, :i], w13[:, i:]
        for e in range(4):
            pre = f"model.layers.{layer}.mlp.experts.{e}"
            if scheme == "nvfp4":
                assert qc["quant_method"] == "modelopt" and (path / "hf_quant_config.json").exists()
                ws2 = torch.maximum(gate[e].abs().amax(), up[e].abs().amax()).float() / torch.tensor(2688.0)
                for proj, w, g in (("gate_proj", gate[e], ws2), ("up_proj", up[e], ws2), ("down_proj", w2[e], None)):
                    p, s, g2 = R.quantize_nvfp4(w, g)
                    assert torch.equal(stored[f"{pre}.{proj}.weight"], p)
                    assert torch.equal(stored[f"{pre}.{proj}.weight_scale"].view(torch.uint8), s.view(torch.uint8))
                    assert (
                        stored[f"{pre}.{proj}.weight_scale_2"].shape == ()
                        and stored[f"{pre}.{proj}.weight_scale_2"] == g2
                    )
                in13, in2 = cal.input_scales(layer, "nvfp4")
                assert (
                    stored[f"{pre}.gate_proj.input_scale"] == in13[e]
                    and stored[f"{pre}.down_proj.input_scale"] == in2[e]
                )
            else:
                assert qc["quant_method"] == "quark"
                el = {"w_mxfp4_a_mxfp4": "e2m1", "w_mxfp6_e3m2_a_fp8": "e3m2", "w_mxfp6_e2m3": "e2m3"}[scheme]
                for proj, w in (("gate_proj", gate[e]), ("up_proj", up[e]), ("down_proj", w2[e])):
                    p, s = R.quantize_mx(w, el)
                    assert (
                        torch.equal(stored[f"{pre}.{proj}.weight"], p)
                        and stored[f"{pre}.{proj}.weight"].dtype == torch.uint8
                    )
                    assert torch.equal(stored[f"{pre}.{proj}.weight_scale"], s)
                assert (f"{pre}.gate_proj.input_scale" in stored) == scheme.endswith("_a_fp8")
    # load back: the experts hold exactly the stored tensors, and the model runs
    loaded, info = C.load_quantized_qwen3_moe(path, backend="torch")
    ex = loaded.model.layers[1].mlp.experts.experts
    cls = Nvfp4QuantizationEmulationTritonExperts if scheme == "nvfp4" else OCP_MXQuantizationEmulationTritonExperts
    assert isinstance(ex, cls) and info["scheme"].name == scheme
    assert torch.equal(ex.w2_weight[3], stored["model.layers.1.mlp.experts.3.down_proj.weight"])
    assert torch.equal(ex.w13_weight[2, 32:], stored["model.layers.1.mlp.experts.2.up_proj.weight"])
    for name, p in loaded.state_dict().items():
        if ".mlp.experts." not in name and name in stored:
            assert torch.equal(p, stored[name]), name
    with torch.no_grad():
        out = loaded(input_ids=ids[:1]).logits
    assert torch.isfinite(out).all()


def test_layer_override_and_legacy_config(tiny, tmp_path):
    model, cal, ids = tiny
    path = C.write_quantized_checkpoint(model, "nvfp4", tmp_path / "ckpt", cal)
    one, _ = C.load_quantized_qwen3_moe(path, num_hidden_layers=1)
    assert len(one.model.layers) == 1
    cfg = json.loads((path / "config.json").read_text())
    del cfg["quantization_config"]  # only hf_quant_config.json left, as older ModelOpt exports
    (path / "config.json").write_text(json.dumps(cfg))
    loaded, info = C.load_quantized_qwen3_moe(path)
    assert info["format"] == "modelopt" and "model.layers.*.mlp.gate" in info["exclude"]
    with pytest.raises(C.CheckpointError, match="num_hidden_layers=5 exceeds the checkpoint's 2"):
        C.load_quantized_qwen3_moe(path, num_hidden_layers=5)


def _rewrite(path, edit):
    """Apply ``edit(name, tensor) -> tensor | None`` to every stored tensor (None drops it)."""
    for f in path.glob("*.safetensors"):
        tensors = load_file(str(f))
        new = {}
        for k, v in tensors.items():
            r = edit(k, v)
            if r is not None:
                new[k] = r
        save_file(new, str(f), metadata={"format": "pt"})


def test_bad_checkpoints_name_the_tensor(tiny, tmp_path):
    model, cal, ids = tiny
    good = C.write_quantized_checkpoint(model, "w_mxfp4_a_mxfp4", tmp_path / "good", cal)
    name = "model.layers.1.mlp.experts.2.down_proj.weight_scale"

    def variant(tag, edit):
        p = tmp_path / tag
        shutil.copytree(good, p)
        _rewrite(p, edit)
        return p

    missing = variant("missing", lambda k, v: None if k == name else v)
    with pytest.raises(C.CheckpointError, match=f"missing tensor '{name}'"):
        C.load_quantized_qwen3_moe(missing)
    wrong_shape = variant("shape", lambda k, v: v[:-1].contiguous() if k == name else v)
    with pytest.raises(C.CheckpointError, match=rf"tensor '{name}': expected shape \[64, 1\], found \[63, 1\]"):
        C.load_quantized_qwen3_moe(wrong_shape)
    wrong_dtype = variant("dtype", lambda k, v: v.float() if k == name else v)
    with pytest.raises(C.CheckpointError, match=f"tensor '{name}': expected dtype torch.uint8, found torch.float32"):
        C.load_quantized_qwen3_moe(wrong_dtype)
    bf16_name = "model.layers.0.self_attn.q_proj.weight"
    wrong_bf16 = variant("bf16", lambda k, v: v.float() if k == bf16_name else v)
    with pytest.raises(
        C.CheckpointError, match=f"tensor '{bf16_name}': expected dtype torch.bfloat16, found torch.float32"
    ):
        C.load_quantized_qwen3_moe(wrong_bf16)


@pytest.mark.parametrize(
    "edit,message",
    [
        (
            lambda q: q["global_quant_config"]["weight"].update(group_size=64),
            "weight.group_size: the emulation supports 32, found 64",
        ),
        (
            lambda q: q["global_quant_config"]["weight"].update(scale_format="e4m3"),
            "weight.scale_format: the emulation supports 'e8m0'",
        ),
        (lambda q: q["global_quant_config"]["weight"].update(dtype="int4"), "weight.dtype: supported"),
        (
            lambda q: q.update(layer_quant_config={"model.layers.0.mlp.experts.*": {"weight": {"dtype": "fp6_e2m3"}}}),
            r"module 'model.layers.0.mlp.experts.0.gate_proj' is in precision group 'model.layers.0.mlp.experts.\*' "
            r".*layer_quant_config\['model.layers.0.mlp.experts.\*'\].weight.qscheme: the emulation supports "
            r"'per_group', found None",
        ),
        (
            lambda q: q.update(quant_method="awq"),
            "quant_method: expected 'modelopt' or 'quark' or 'compressed-tensors' or 'mxfp4', found 'awq'",
        ),
        (
            lambda q: q["global_quant_config"]["input_tensors"].update(is_dynamic=False),
            "MX activations must be dynamic",
        ),
    ],
)
def test_unsupported_quark_configs_are_rejected(tiny, tmp_path, edit, message):
    model, cal, _ = tiny
    path = C.write_quantized_checkpoint(model, "w_mxfp4_a_mxfp4", tmp_path / "ckpt", cal)
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg["quantization_config"])
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(C.CheckpointError, match=message):
        C.load_quantized_qwen3_moe(path)


def test_quantized_non_linear_is_rejected(tiny, tmp_path):
    # quantized attention is emulated (tests/test_layouts.py); a quantized norm is not
    model, cal, _ = tiny
    path = C.write_quantized_checkpoint(model, "nvfp4", tmp_path / "ckpt", cal)
    extra = {"model.layers.0.input_layernorm.weight_scale": torch.zeros(4, dtype=torch.float8_e4m3fn)}
    save_file(extra, str(path / "extra.safetensors"))
    idx = json.loads((path / "model.safetensors.index.json").read_text())
    idx["weight_map"].update({k: "extra.safetensors" for k in extra})
    (path / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(
        C.CheckpointError,
        match="input_layernorm is quantized in this checkpoint; mxlib emulates "
        "quantized experts and linear layers only",
    ):
        C.load_quantized_qwen3_moe(path)


def test_failed_write_leaves_nothing(tiny, tmp_path, monkeypatch):
    model, cal, _ = tiny

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors_io, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        C.write_quantized_checkpoint(model, "nvfp4", tmp_path / "ckpt", cal)
    assert list(tmp_path.iterdir()) == []


def test_nvfp4_needs_calibration(tiny, tmp_path):
    model, _, _ = tiny
    with pytest.raises(ValueError, match="nvfp4 checkpoints need activation input scales"):
        C.write_quantized_checkpoint(model, "nvfp4", tmp_path / "ckpt", None)
    assert not (tmp_path / "ckpt").exists()


def test_checkpoint_tensor_bytes_matches_files(tiny, tmp_path):
    from mxlib.studies.unification import checkpoint_tensor_bytes

    model, cal, _ = tiny
    for scheme in ("nvfp4", "w_mxfp6_e3m2_a_fp8"):
        path = C.write_quantized_checkpoint(model, scheme, tmp_path / scheme, cal)
        idx = json.loads((path / "model.safetensors.index.json").read_text())
        assert checkpoint_tensor_bytes(model, scheme) == idx["metadata"]["total_size"]


def test_layout_registry_dispatch(tiny, tmp_path):
    from mxlib.checkpoints import LAYOUTS
    from mxlib.checkpoints.layouts import layout_for_scheme, modelopt_nvfp4, quark_ocp_mx
    from mxlib.moe import MOE_SCHEMES

    assert list(LAYOUTS) == [
        "modelopt",
        "quark",
        "compressed-tensors",
        "compressed-tensors-mxfp4",
        "modelopt-mxfp8",
        "compressed-tensors-mxfp8",
        "gpt-oss-mxfp4",
        "modelopt-fp8",
        "quark-fp8",
        "compressed-tensors-fp8",
    ]
    for name, s in MOE_SCHEMES.items():
        expected = modelopt_nvfp4.LAYOUT if s.weight.has_global_scale else quark_ocp_mx.LAYOUT
        assert layout_for_scheme(s) is expected, name
    model, cal, _ = tiny
    path = C.write_quantized_checkpoint(model, "w_mxfp4", tmp_path / "ckpt", cal)
    info = C.read_quant_config(path)
    assert isinstance(info, C.CheckpointDescription) and info.scheme is MOE_SCHEMES["w_mxfp4"]
    assert info["format"] == "quark" and info.activation_scale_mode == "even"


def test_shard_writer_streams_shards(tmp_path):
    """``ShardWriter`` writes a shard as soon as the next tensor would overflow it (holding at most one
    shard's tensors), gives the shards their final ``-of-n`` names and indexes every tensor."""
    from safetensors.torch import load_file

    from mxlib.checkpoints.files.safetensors_io import INDEX_NAME, ShardWriter

    w = ShardWriter(tmp_path, shard_bytes=1000)
    tensors = {f"t{j}": torch.full((100,), float(j)) for j in range(5)}  # 400 bytes each: two per shard
    for j, (name, t) in enumerate(tensors.items()):
        w.add(name, t)
        assert len(list(tmp_path.glob("*.safetensors"))) == j // 2  # written when the third would overflow
        assert sum(v.numel() * v.element_size() for v in w._pending.values()) <= 1000
    weight_map = w.close()
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert files == [f"model-{k:05d}-of-00003.safetensors" for k in (1, 2, 3)]
    assert json.loads((tmp_path / INDEX_NAME).read_text())["weight_map"] == weight_map
    for name, t in tensors.items():
        assert torch.equal(load_file(str(tmp_path / weight_map[name]))[name], t)
    with pytest.raises(ValueError, match="shard_bytes"):
        ShardWriter(tmp_path, shard_bytes=0)


# ----------------------------------------------------------------------------- each config file read once


def _count_opens(monkeypatch) -> collections.Counter:
    """Every open of a file by name, whichever way it is opened (``os.open``, the one ``open_regular``
    uses, and ``open``, the one ``Path.read_text`` and ``safetensors`` use)."""
    opened = collections.Counter()
    real_os_open, real_io_open = os.open, io.open

    def os_open(path, *a, **k):
        opened[os.path.basename(os.fspath(path))] += 1
        return real_os_open(path, *a, **k)

    def io_open(file, *a, **k):
        if isinstance(file, (str, os.PathLike)):
            opened[os.path.basename(os.fspath(file))] += 1
        return real_io_open(file, *a, **k)

    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(builtins, "open", io_open)
    monkeypatch.setattr(io, "open", io_open)
    return opened


@pytest.mark.parametrize("scheme", ["nvfp4", "w_mxfp4_a_mxfp4"])
def test_a_load_opens_each_config_file_once(tiny, tmp_path, monkeypatch, scheme):
    """A load, an inspection and ``from_pretrained`` each open ``config.json``, the legacy
    ``hf_quant_config.json`` and the index once (``files.folder.CheckpointFolder``), and what they hand on is
    what the files say: the description ``read_quant_config`` reads alone, the model's config fields, the
    legacy file's text that ``save_pretrained`` writes back byte for byte."""
    model, cal, ids = tiny
    path = C.write_quantized_checkpoint(model, scheme, tmp_path / "ckpt", cal)
    legacy = (path / "hf_quant_config.json").exists()
    assert legacy == (scheme == "nvfp4")
    want_info = C.read_quant_config(path)
    want_cfg = json.loads((path / "config.json").read_text())
    opened = _count_opens(monkeypatch)
    loaded, info = C.load_quantized_moe(path)
    once = {"config.json": 1, "model.safetensors.index.json": 1, **({"hf_quant_config.json": 1} if legacy else {})}
    assert {n: c for n, c in opened.items() if n.endswith(".json")} == once
    for read in (lambda: C.inspect_checkpoint(path), lambda: C.from_pretrained(path)):
        opened.clear()
        read()
        assert {n: c for n, c in opened.items() if n.endswith(".json")} == once
    monkeypatch.undo()
    assert info == want_info and repr(info) == repr(want_info)
    for field in ("hidden_size", "num_hidden_layers", "moe_intermediate_size", "vocab_size"):
        assert getattr(loaded.config, field) == want_cfg[field], field
    loaded.save_pretrained(tmp_path / "saved")
    if legacy:
        assert (tmp_path / "saved" / "hf_quant_config.json").read_bytes() == (
            path / "hf_quant_config.json"
        ).read_bytes()
    assert json.loads((tmp_path / "saved" / "config.json").read_text()) == want_cfg


def test_checkpoint_folder_hands_out_copies_and_keeps_no_failure(tmp_path):
    """``CheckpointFolder.json`` gives a fresh copy at each call (a step editing its dict changes nothing the
    next step reads); a file that fails to read is refused naming it, and read again at the next call."""
    from mxlib.checkpoints.files.folder import CheckpointFolder

    (tmp_path / "config.json").write_text(json.dumps({"a": {"b": [1, 2]}}))
    (tmp_path / "bad.json").write_text("[1, 2]")
    folder = CheckpointFolder(tmp_path)
    first = folder.config()
    first["a"]["b"].append(3)
    first.pop("a")
    assert folder.config() == {"a": {"b": [1, 2]}} and folder.reads == {"config.json": 1}
    assert folder.read_json(tmp_path / "config.json") == {"a": {"b": [1, 2]}} and folder.reads["config.json"] == 1
    assert os.fspath(folder) == str(tmp_path) and str(folder) == str(tmp_path) and folder / "x" == tmp_path / "x"
    assert CheckpointFolder.of(folder) is folder
    for _ in range(2):
        with pytest.raises(C.CheckpointError, match=r"bad\.json: expected a JSON object \(a list\), found list"):
            folder.json("bad.json", "a list")
    assert folder.reads.get("bad.json") is None
    with pytest.raises(C.CheckpointError, match=r"missing\.json: not found"):
        folder.json("missing.json")
