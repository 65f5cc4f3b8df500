"""Every tensor of a checkpoint is used, or named: by the loader (an ``UnusedTensorsWarning``) and by the inspector
(a problem line, ``layout_ok`` False).

Each layout mxlib writes gets each kind of extra tensor the config does not account for: an expert index past
``num_experts`` (layouts that store one tensor per expert), a suffix the layout does not read (on an expert, on a
layer's router, on a stacked gpt-oss experts tensor), a layer past ``num_hidden_layers``, a tensor outside the
layers, and a tensor a shard stores that the index leaves out. The loaded model is the one without the extras, bit
for bit; the clean checkpoint loads with no warning and inspects with no problem. Layers cut off on purpose by a
``num_hidden_layers`` override are not named.
"""

import json
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from mxlib.checkpoints import inspect_checkpoint, load_quantized_moe, write_quantized_checkpoint
from mxlib.checkpoints.files.headers import UnusedTensorsWarning
from mxlib.models.calibration import calibrate
from mxlib.models.gpt_oss import dummy_gpt_oss, gpt_oss_20b_config
from mxlib.models.presets import GPT_OSS_PRESETS
from mxlib.models.qwen3 import dummy_qwen3_moe, qwen3_30b_a3b_config

from _util import TINY_QWEN3 as TINY

E = TINY["num_experts"]
LAYOUTS = [
    ("qwen3", "nvfp4", "modelopt"),
    ("qwen3", "w_mxfp4_a_mxfp4", "quark"),
    ("qwen3", "w_mxfp4_a_fp8", "quark"),
    ("qwen3", "nvfp4", "compressed-tensors"),
    ("qwen3", "w_mxfp4", "compressed-tensors-mxfp4"),
    ("qwen3", "w_mxfp8", "compressed-tensors-mxfp8"),
    ("qwen3", "w_mxfp8_a_mxfp8", "modelopt-mxfp8"),
    ("gpt-oss", "w_mxfp4", "gpt-oss-mxfp4"),
]
IDS = [f"{s}-{lay}" for _, s, lay in LAYOUTS]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """``written(key)``: the clean checkpoint folder of a layout id, written on first use."""
    root = tmp_path_factory.mktemp("unused")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    models, folders = {}, {}

    def get(key):
        if key not in folders:
            family, scheme, layout = LAYOUTS[IDS.index(key)]
            if family not in models:
                if family == "qwen3":
                    m = dummy_qwen3_moe(qwen3_30b_a3b_config(num_hidden_layers=2, **TINY), seed=1)
                    models[family] = (m, calibrate(m, ids))
                else:
                    cfg = gpt_oss_20b_config(2, **GPT_OSS_PRESETS["gpt-oss-tiny"])
                    models[family] = (dummy_gpt_oss(cfg, seed=1), None)
            model, cal = models[family]
            folders[key] = write_quantized_checkpoint(model, scheme, root / key, cal, layout=layout)
        return folders[key]

    return get


def _state(path, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, _ = load_quantized_moe(path, backend="torch", **kw)
    named = [w for w in caught if issubclass(w.category, UnusedTensorsWarning)]
    return {k: v.clone() for k, v in model.state_dict().items()}, named


def _extras(path, family) -> dict[str, str]:
    """``{kind: name of an extra tensor}`` for the checkpoint at ``path``, built from its own names."""
    names = set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"])
    out = {
        "extra layer": "model.layers.2.mlp.gate.weight",
        "outside the layers": "model.extra_norm.weight",
        "router suffix": "model.layers.0.mlp.gate.weight_scale_3",
    }
    if family == "qwen3":
        expert0 = sorted(n for n in names if n.startswith("model.layers.1.mlp.experts.0.down_proj."))
        out["expert index"] = expert0[0].replace(".experts.0.", f".experts.{E}.")
        out["expert suffix"] = "model.layers.1.mlp.experts.0.down_proj.weight_scale_3"
    else:
        out["experts suffix"] = "model.layers.1.mlp.experts.down_proj_extra"
    return out


def _add(src, dst, name, indexed=True):
    """A copy of the checkpoint ``src`` at ``dst`` with tensor ``name`` added to its first shard (and, when
    ``indexed``, to the index)."""
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    tensors = load_file(str(dst / shard))
    tensors[name] = torch.ones(4, dtype=torch.bfloat16)
    save_file(tensors, str(dst / shard), metadata={"format": "pt"})
    if indexed:
        index["weight_map"][name] = shard
        (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


# three layouts (per-expert NVFP4 and MX, stacked gpt-oss) in the quick run, the others under -m slow
QUICK = ("nvfp4-modelopt", "w_mxfp4_a_mxfp4-quark", "w_mxfp4-gpt-oss-mxfp4")
CASES = [pytest.param(*c, id=i, marks=() if i in QUICK else pytest.mark.slow) for c, i in zip(LAYOUTS, IDS)]


@pytest.mark.parametrize("family,scheme,layout", CASES)
def test_every_extra_tensor_is_named_by_the_loader_and_the_inspector(written, tmp_path, family, scheme, layout):
    key = f"{scheme}-{layout}"
    clean = written(key)
    want, named = _state(clean)
    assert named == []  # a clean checkpoint: nothing unused
    report = inspect_checkpoint(clean)
    assert report.layout_ok and report.problems == [], report.problems
    cases = [(kind, name, True) for kind, name in _extras(clean, family).items()]
    cases.append(("not in the index", "model.layers.0.mlp.gate.weight_unindexed", False))
    for n, (kind, name, indexed) in enumerate(cases):
        path = _add(clean, tmp_path / f"c{n}", name, indexed)
        got, named = _state(path)
        assert len(named) == 1 and name in str(named[0].message), (kind, [str(w.message) for w in named])
        assert "1 tensors of the checkpoint are not used by the model its config describes" in str(named[0].message)
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want), kind
        report = inspect_checkpoint(path)
        assert not report.layout_ok, kind
        assert [p for p in report.problems if p.startswith("tensors: 1 tensors are not used") and name in p], (
            kind,
            report.problems,
        )


def test_layers_cut_off_by_an_override_are_not_named(written):
    clean = written("nvfp4-modelopt")
    _, named = _state(clean, num_hidden_layers=1)
    assert named == []


def test_many_extra_tensors_are_counted_and_the_first_named(written, tmp_path):
    clean = written("nvfp4-modelopt")
    path = tmp_path / "many"
    shutil.copytree(clean, path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    tensors = load_file(str(path / shard))
    extra = [f"model.layers.0.mlp.experts.{E + x}.gate_proj.weight" for x in range(12)]
    for name in extra:
        tensors[name] = torch.zeros(2, dtype=torch.uint8)
        index["weight_map"][name] = shard
    save_file(tensors, str(path / shard), metadata={"format": "pt"})
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    _, named = _state(path)
    msg = str(named[0].message)
    assert "12 tensors of the checkpoint are not used" in msg and "(4 more)" in msg
    assert all(n in msg for n in sorted(extra)[:8])
