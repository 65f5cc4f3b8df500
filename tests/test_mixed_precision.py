"""Mixed-precision checkpoints of the three producers: read, run, written back byte for byte, inspected.

The fixtures are written from the producers' documented on-disk forms (their tools need their own
environments): each precision group's tensors come from a single-scheme checkpoint mxlib writes in that
producer's layout (the layouts' tensors are checked against the real tools' in ``tests/test_interop*.py``),
and the config is the producer's mixed form:

* ModelOpt ``quant_algo: "MIXED_PRECISION"``: ``hf_quant_config.json``'s ``quantization.quantized_layers``
  (module name -> ``{"quant_algo", "group_size"}``; NVIDIA/Model-Optimizer
  ``modelopt/torch/export/quant_utils.py``, ``process_layer_quant_config``) and ``config.json``'s
  ``quantization_config`` with one ``config_groups`` entry per distinct layer config, the layer names as
  ``targets``, and ``quantized_layers`` kept (``modelopt/torch/export/convert_hf_config.py``,
  ``convert_hf_quant_config_format``);
* Quark: ``layer_quant_config`` (fnmatch name pattern -> config) and ``layer_type_quant_config`` (class name ->
  config) beside ``global_quant_config`` (amd/Quark ``quark/torch/quantization/model_transformation.py``;
  vLLM ``vllm/model_executor/layers/quantization/quark/quark.py``, ``_find_matched_config``);
* compressed-tensors: ``format: "mixed-precision"`` with a ``format`` per ``config_groups`` entry, whose
  ``targets`` are exact names, ``re:`` regexes (``re.match``) or class names
  (vllm-project/compressed-tensors ``src/compressed_tensors/utils/match.py``).

Each mixed checkpoint loads with every module in its own scheme; its logits equal, bit for bit, those of
the per-module reference: the single-scheme checkpoints loaded by the existing loader, their modules put
together by hand. It is saved back byte for byte (save -> load -> save gives identical files, and the
saved tensors are the fixture's, bit for bit); unsupported groups are refused naming the module.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mxlib import checkpoints as C
from mxlib.checkpoints.layouts import LAYOUTS
from mxlib.checkpoints.precision import PrecisionMap, is_mixed
from mxlib.checkpoints.saving import _scheme_of, _StateDictTensors
from mxlib.moe.base import TransformersExperts
from mxlib.moe.emulation import QuantizedExperts
from mxlib.moe.factory import make_emulated_linear
from mxlib.moe.linear import EmulatedLinear, linear_input_amax
from mxlib.moe.schemes import get_moe_scheme

from _util import assert_bits_equal, stored_tensors, tiny_calibrated

LAYERS = 2
ATTN = [f"model.layers.{layer}.self_attn.{p}" for layer in range(LAYERS) for p in C.ATTENTION_PROJS]
EXPERTS = [f"model.layers.{layer}.mlp.experts.{x}.{p}" for layer in range(LAYERS) for x in range(4) for p in C.PROJS]


@pytest.fixture(scope="module")
def tiny():
    model, cal, ids = tiny_calibrated(5, tokens=16, layers=LAYERS, ids_seed=1)
    return model, cal, linear_input_amax(model, ids, [*ATTN, "lm_head"]), ids


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return stored_tensors(path)


def _single(tiny, tmp_path, scheme, layout, name, attention=False):
    model, cal, amax, _ = tiny
    return C.write_quantized_checkpoint(
        model, scheme, tmp_path / name, cal, layout=layout, quantize_attention=attention, linear_input_amax=amax
    )


def _lm_head(tiny, scheme_name, layout_name):
    """``lm_head``'s tensors quantized by a layout (its input scale from the calibrated amax)."""
    model, _, amax, _ = tiny
    scheme, layout = get_moe_scheme(scheme_name), LAYOUTS[layout_name]
    ins = None
    if scheme.static_activation_scale:
        ins = layout.stored_input_scale(amax["lm_head"].float().reshape(()) / scheme.activation.scale_divisor)
    weights = layout.quantize_linear(model.lm_head.weight.detach(), scheme)
    return layout.linear_tensors(scheme, weights, ins, "lm_head")


def _compose(folder: Path, base: Path, parts: dict, qc: dict, extra: dict | None = None) -> Path:
    """A checkpoint folder: ``base``'s tensors and config.json, with ``quantization_config`` ``qc``; every tensor
    of a module in ``parts`` (``{module name: tensors dict}``) replaced by the given ones."""
    folder.mkdir()
    tensors = _tensors(base)
    for module, given in parts.items():
        tensors = {k: v for k, v in tensors.items() if k.rsplit(".", 1)[0] != module}
        tensors.update({k: v.contiguous() for k, v in given.items()})
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((base / "config.json").read_text())
    cfg["quantization_config"] = qc
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    for name, content in (extra or {}).items():
        (folder / name).write_text(json.dumps(content, indent=2))
    return folder


def _module_tensors(path: Path, modules: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    t = _tensors(path)
    return {m: {k: v for k, v in t.items() if k.rsplit(".", 1)[0] == m} for m in modules}


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _reference(experts_ckpt: Path, linear_ckpt: Path | None, lm_head=None):
    """The per-module reference: the experts checkpoint loaded alone, its attention projections replaced by
    those of the linear checkpoint loaded alone, ``lm_head`` by an ``EmulatedLinear`` built from its tensors
    (``(scheme, layout name, tensors)``) with the layout's own reader."""
    model, _ = C.load_quantized_moe(experts_ckpt)
    if linear_ckpt is not None:
        other, _ = C.load_quantized_moe(linear_ckpt)
        mods = dict(other.named_modules())
        for name in ATTN:
            parent, _, child = name.rpartition(".")
            assert isinstance(mods[name], EmulatedLinear)
            setattr(model.get_submodule(parent), child, mods[name])
    if lm_head is not None:
        desc, tensors = lm_head  # the description of the single-scheme checkpoint of lm_head's scheme
        layout = LAYOUTS[desc.format]
        lin = model.lm_head
        weights, ins = layout.read_linear(
            _StateDictTensors(tensors), "lm_head", lin.out_features, lin.in_features, desc
        )
        model.lm_head = make_emulated_linear(
            desc.scheme, weights, ins, activation_scale_mode=desc.activation_scale_mode or "even"
        )
    return model


def _schemes(model) -> dict[str, str]:
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, TransformersExperts):
            out[name] = _scheme_of(m.experts).name if isinstance(m.experts, QuantizedExperts) else "bf16"
        elif isinstance(m, EmulatedLinear):
            out[name] = m.scheme.name
    return out


def _round_trip(model, tmp_path: Path, source: Path):
    """save -> load -> save: identical files; the saved tensors are the source's, bit for bit."""
    model.save_pretrained(tmp_path / "first")
    again, _ = C.load_quantized_moe(tmp_path / "first")
    again.save_pretrained(tmp_path / "second")
    first = sorted(p.name for p in (tmp_path / "first").iterdir())
    assert first == sorted(p.name for p in (tmp_path / "second").iterdir())
    for name in first:
        assert (tmp_path / "first" / name).read_bytes() == (tmp_path / "second" / name).read_bytes(), name
    src, saved = _tensors(source), _tensors(tmp_path / "first")
    assert sorted(src) == sorted(saved)
    for k in src:
        assert src[k].dtype == saved[k].dtype and src[k].shape == saved[k].shape, k
        assert_bits_equal(saved[k], src[k], k)
    return again


# ----------------------------------------------------------------------------- ModelOpt MIXED_PRECISION


def _modelopt_configs(quantized_layers: dict) -> tuple[dict, dict]:
    """``config.json``'s ``quantization_config`` and ``hf_quant_config.json`` of a ModelOpt mixed export."""
    producer = {"name": "modelopt", "version": "0.47.0"}
    by_cfg: dict[tuple, list[str]] = {}
    for name, cfg in quantized_layers.items():
        by_cfg.setdefault(tuple(sorted(cfg.items())), []).append(name)
    bits = {"NVFP4": 4, "MXFP8": 8}
    groups = {}
    for n, (key, names) in enumerate(by_cfg.items()):
        cfg = dict(key)
        algo, gs = cfg["quant_algo"], cfg.get("group_size") or (16 if cfg["quant_algo"] == "NVFP4" else 32)
        part = {"dynamic": False, "num_bits": bits.get(algo, 8), "type": "float", "group_size": gs}
        groups[f"group_{n}"] = {"input_activations": dict(part), "weights": dict(part), "targets": sorted(names)}
    qc = {
        "config_groups": groups,
        "quantized_layers": quantized_layers,
        "ignore": [],
        "quant_algo": "MIXED_PRECISION",
        "producer": producer,
        "quant_method": "modelopt",
    }
    legacy = {
        "producer": producer,
        "quantization": {
            "quant_algo": "MIXED_PRECISION",
            "kv_cache_quant_algo": None,
            "quantized_layers": quantized_layers,
        },
    }
    return qc, legacy


@pytest.fixture(scope="module")
def modelopt(tiny, tmp_path_factory):
    """NVFP4 experts, MXFP8 attention and an NVFP4 ``lm_head`` under ModelOpt's ``MIXED_PRECISION``."""
    tmp = tmp_path_factory.mktemp("modelopt")
    experts = _single(tiny, tmp, "nvfp4", "modelopt", "experts")
    linear = _single(tiny, tmp, "w_mxfp8_a_mxfp8", "modelopt-mxfp8", "linear", attention=True)
    lm_head = _lm_head(tiny, "nvfp4", "modelopt")
    layers = {n: {"quant_algo": "NVFP4", "group_size": 16} for n in EXPERTS}
    layers.update({n: {"quant_algo": "MXFP8"} for n in ATTN})
    layers["lm_head"] = {"quant_algo": "NVFP4", "group_size": 16}
    qc, legacy = _modelopt_configs(layers)
    parts = {**_module_tensors(linear, ATTN), "lm_head": lm_head}
    folder = _compose(tmp / "mixed", experts, parts, qc, {"hf_quant_config.json": legacy})
    return folder, experts, linear, lm_head, layers


def test_modelopt_mixed_precision_map(modelopt):
    folder = modelopt[0]
    info = C.read_quant_config(folder)
    pm = info.precision
    assert isinstance(pm, PrecisionMap) and info.format == "modelopt" and info.scheme.name == "nvfp4"
    assert sorted(pm.groups) == ["MXFP8", "NVFP4 g16"]
    assert pm.group_of("model.layers.1.mlp.experts.3.down_proj") == "NVFP4 g16"
    assert pm.description("model.layers.0.self_attn.k_proj").scheme.name == "w_mxfp8_a_mxfp8"
    assert pm.description("model.layers.0.self_attn.k_proj").format == "modelopt-mxfp8"
    assert pm.description("lm_head").scheme.name == "nvfp4"
    # not in quantized_layers: unquantized (the routers, the embedding)
    assert pm.description("model.layers.0.mlp.gate") is None and pm.group_of("model.embed_tokens") is None


def _logits_match_reference(model, ids, experts, linear, lm_head=None):
    """The mixed model's logits: finite and bit-equal to the per-module reference built from the single-scheme
    checkpoints (``lm_head``: ``(description, folder)`` where the checkpoint quantizes it)."""
    out = _logits(model, ids)
    assert torch.isfinite(out).all()
    ref = _reference(experts, linear, lm_head)
    assert_bits_equal(out, _logits(ref, ids), "mixed vs per-module reference logits")
    return out


def test_modelopt_mixed_loads_runs_and_round_trips(modelopt, tiny, tmp_path):
    folder, experts, linear, lm_head, _ = modelopt
    model, info = C.load_quantized_moe(folder)
    schemes = _schemes(model)
    assert schemes["model.layers.0.mlp.experts"] == "nvfp4" and schemes["model.layers.1.self_attn.o_proj"] == (
        "w_mxfp8_a_mxfp8"
    )
    assert schemes["lm_head"] == "nvfp4"
    ids = tiny[3]
    out = _logits_match_reference(model, ids, experts, linear, (C.read_quant_config(experts), lm_head))
    again = _round_trip(model, tmp_path, folder)
    assert_bits_equal(_logits(again, ids), out, "logits after save and load")
    # the legacy file alone (no quantization_config in config.json) reads the same map
    cfg = json.loads((tmp_path / "first" / "config.json").read_text())
    del cfg["quantization_config"]
    (tmp_path / "first" / "config.json").write_text(json.dumps(cfg))
    legacy_only, _ = C.load_quantized_moe(tmp_path / "first")
    assert_bits_equal(_logits(legacy_only, ids), out, "logits from hf_quant_config.json alone")


def test_modelopt_unsupported_module_is_refused(modelopt, tmp_path):
    folder, *_, layers = modelopt
    bad = {**layers, **{n: {"quant_algo": "W4A16_AWQ", "group_size": 128} for n in ATTN}}
    qc, legacy = _modelopt_configs(bad)
    path = _compose(tmp_path / "awq", folder, {}, qc, {"hf_quant_config.json": legacy})
    with pytest.raises(
        C.CheckpointError,
        match=r"module 'model.layers.0.self_attn.q_proj' is in precision group 'W4A16_AWQ g128' .*quant_algo: "
        r"supported \['FP8', 'FP8_PER_CHANNEL_PER_TOKEN', 'MXFP8', 'NVFP4', 'W4A16_NVFP4'\], found 'W4A16_AWQ'",
    ):
        C.load_quantized_moe(path)
    # experts of one layer in two groups
    split = {**layers, "model.layers.1.mlp.experts.2.up_proj": {"quant_algo": "MXFP8"}}
    qc, legacy = _modelopt_configs(split)
    path = _compose(tmp_path / "split", folder, {}, qc, {"hf_quant_config.json": legacy})
    with pytest.raises(C.CheckpointError, match=r"experts.2.up_proj' is in precision group 'MXFP8' but .* one group"):
        C.load_quantized_moe(path)
    with pytest.raises(C.CheckpointError, match="quantized_layers: quant_algo 'MIXED_PRECISION' needs an object"):
        C.read_quant_config(
            _compose(tmp_path / "empty", folder, {}, {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION"})
        )


# ----------------------------------------------------------------------------- Quark per-layer / per-type configs


def _quark_config(tiny, tmp_path, name, scheme) -> dict:
    """The ``global_quant_config`` of a Quark checkpoint of ``scheme`` (as the Quark layout writes it)."""
    return json.loads((_single(tiny, tmp_path, scheme, "quark", name) / "config.json").read_text())[
        "quantization_config"
    ]["global_quant_config"]


@pytest.fixture(scope="module")
def quark(tiny, tmp_path_factory):
    """MXFP4 experts by a ``layer_quant_config`` name pattern, MXFP8 attention by the ``Linear`` entry of
    ``layer_type_quant_config``, an MXFP6 global config nothing falls through to, ``lm_head`` and the routers
    excluded by name (as Quark's export lists them)."""
    tmp = tmp_path_factory.mktemp("quark")
    experts = _single(tiny, tmp, "w_mxfp4_a_mxfp4", "quark", "experts")
    linear = _single(tiny, tmp, "w_mxfp8_a_mxfp8", "quark", "linear", attention=True)
    qc = json.loads((experts / "config.json").read_text())["quantization_config"]
    mx4 = qc["global_quant_config"]
    mx8 = json.loads((linear / "config.json").read_text())["quantization_config"]["global_quant_config"]
    qc["global_quant_config"] = _quark_config(tiny, tmp, "mx6", "w_mxfp6_e2m3_a_mxfp6_e2m3")
    qc["layer_quant_config"] = {"*.mlp.experts.*": mx4}
    qc["layer_type_quant_config"] = {"Linear": mx8}
    qc["exclude"] = [n for n in qc["exclude"] if "self_attn" not in n]
    folder = _compose(tmp / "mixed", experts, _module_tensors(linear, ATTN), qc)
    return folder, experts, linear, qc


def test_quark_mixed_precision_map(quark):
    folder, *_ = quark
    info = C.read_quant_config(folder)
    pm = info.precision
    assert info.format == "quark" and pm.producer == "quark"
    assert list(pm.groups) == ["*.mlp.experts.*", "Linear", "global_quant_config"]
    assert pm.group_of("model.layers.1.mlp.experts.0.down_proj", ("Linear",)) == "*.mlp.experts.*"
    assert pm.description("model.layers.1.self_attn.v_proj", ("Linear", "Module")).scheme.name == "w_mxfp8_a_mxfp8"
    # a module of no listed class falls through to the global config; excluded ones are unquantized
    assert pm.group_of("model.layers.0.self_attn.q_proj", ("Conv1d",)) == "global_quant_config"
    assert pm.group_of("lm_head", ("Linear",)) is None and pm.group_of("model.layers.0.mlp.gate") is None


def test_quark_mixed_loads_runs_and_round_trips(quark, tiny, tmp_path):
    folder, experts, linear, _ = quark
    model, _ = C.load_quantized_moe(folder)
    schemes = _schemes(model)
    assert schemes["model.layers.1.mlp.experts"] == "w_mxfp4_a_mxfp4"
    assert schemes["model.layers.0.self_attn.q_proj"] == "w_mxfp8_a_mxfp8"
    assert "lm_head" not in schemes
    ids = tiny[3]
    _logits_match_reference(model, ids, experts, linear)
    _round_trip(model, tmp_path, folder)


def test_quark_unsupported_layer_config_is_refused(quark, tmp_path):
    folder, _, _, qc = quark
    # a per-layer MXFP8 spec with 32x32 blocks (per_block), which the emulation does not run
    mx8 = qc["layer_type_quant_config"]["Linear"]
    blocks = {**mx8, "weight": {**mx8["weight"], "qscheme": "per_block", "block_size": [32, 32]}}
    bad = {**qc, "layer_quant_config": {"*.self_attn.o_proj": blocks, **qc["layer_quant_config"]}}
    path = _compose(tmp_path / "blocks", folder, {}, bad)
    with pytest.raises(
        C.CheckpointError,
        match=r"module 'model.layers.0.self_attn.o_proj' is in precision group '\*.self_attn.o_proj' .*"
        r"layer_quant_config\['\*.self_attn.o_proj'\].weight.qscheme: the emulation supports 'per_group', "
        r"found 'per_block'",
    ):
        C.load_quantized_moe(path)


# ----------------------------------------------------------------------------- compressed-tensors config groups


@pytest.fixture(scope="module")
def compressed(tiny, tmp_path_factory):
    """NVFP4 experts by a ``re:`` target, MXFP8 attention and ``lm_head`` by the class target ``Linear``, under
    ``format: "mixed-precision"``; the routers ignored."""
    tmp = tmp_path_factory.mktemp("ct")
    experts = _single(tiny, tmp, "nvfp4", "compressed-tensors", "experts")
    linear = _single(tiny, tmp, "w_mxfp8_a_mxfp8", "compressed-tensors-mxfp8", "linear", attention=True)
    qc = json.loads((experts / "config.json").read_text())["quantization_config"]
    g4 = {**qc["config_groups"]["group_0"], "format": qc["format"], "targets": [r"re:.*mlp\.experts\."]}
    qc8 = json.loads((linear / "config.json").read_text())["quantization_config"]
    g8 = {**qc8["config_groups"]["group_0"], "format": qc8["format"], "targets": ["Linear"]}
    qc = {**qc, "format": "mixed-precision", "config_groups": {"group_0": g4, "group_1": g8}}
    qc["ignore"] = [r"re:.*mlp.gate$"]
    lm_head = _lm_head(tiny, "w_mxfp8_a_mxfp8", "compressed-tensors-mxfp8")
    folder = _compose(tmp / "mixed", experts, {**_module_tensors(linear, ATTN), "lm_head": lm_head}, qc)
    return folder, experts, linear, lm_head, qc


def test_compressed_tensors_mixed_precision_map(compressed):
    folder, *_ = compressed
    pm = C.read_quant_config(folder).precision
    assert pm.producer == "compressed-tensors" and list(pm.groups) == ["group_0", "group_1"]
    # the regex (re.match: anchored at the start only) beats the class name for the experts
    assert pm.group_of("model.layers.0.mlp.experts.1.up_proj", ("Linear",)) == "group_0"
    assert pm.group_of("model.layers.0.self_attn.q_proj", ("Linear", "Module")) == "group_1"
    assert pm.description("lm_head").format == "compressed-tensors-mxfp8"
    assert pm.group_of("model.layers.0.mlp.gate") is None  # ignored
    assert pm.group_of("model.norm", ("Qwen3MoeRMSNorm", "Module")) is None  # no target matches


def test_compressed_tensors_mixed_loads_runs_and_round_trips(compressed, tiny, tmp_path):
    folder, experts, linear, lm_head, _ = compressed
    model, _ = C.load_quantized_moe(folder)
    schemes = _schemes(model)
    assert schemes["model.layers.0.mlp.experts"] == "nvfp4" and schemes["lm_head"] == "w_mxfp8_a_mxfp8"
    assert schemes["model.layers.1.self_attn.k_proj"] == "w_mxfp8_a_mxfp8"
    ids = tiny[3]
    _logits_match_reference(model, ids, experts, linear, (C.read_quant_config(linear), lm_head))
    _round_trip(model, tmp_path, folder)


def test_compressed_tensors_bad_groups_are_refused(compressed, tmp_path):
    folder, *_, qc = compressed
    g0, g1 = qc["config_groups"]["group_0"], qc["config_groups"]["group_1"]
    # two groups matching the experts equally specifically (both by regex)
    both = {**qc, "config_groups": {"group_0": g0, "group_1": {**g1, "targets": [r"re:model\.layers"]}}}
    with pytest.raises(C.CheckpointError, match=r"matched by the targets of config_groups \['group_0', 'group_1'\]"):
        C.load_quantized_moe(_compose(tmp_path / "ambiguous", folder, {}, both))
    # an int8 group for the attention: its module is refused naming the group and the field
    int8 = {**g1, "format": "int-quantized", "targets": ["re:.*self_attn"]}
    bad = {**qc, "config_groups": {"group_0": g0, "group_1": g1, "group_2": int8}}
    with pytest.raises(
        C.CheckpointError,
        match=r"module 'model.layers.0.self_attn.q_proj' is in precision group 'group_2' .*format: the "
        r"compressed-tensors layout supports 'nvfp4-pack-quantized', found 'int-quantized'",
    ):
        C.load_quantized_moe(_compose(tmp_path / "int8", folder, {}, bad))
    # a group without a format under format "mixed-precision"
    nofmt = {k: v for k, v in g1.items() if k != "format"}
    with pytest.raises(C.CheckpointError, match=r"config_groups.group_1.format: missing"):
        C.load_quantized_moe(
            _compose(tmp_path / "nofmt", folder, {}, {**qc, "config_groups": {"group_0": g0, "group_1": nofmt}})
        )


def test_single_scheme_configs_are_not_mixed(quark):
    _, _, _, qc = quark
    same = {**qc, "layer_quant_config": {"*": qc["global_quant_config"]}, "layer_type_quant_config": {}}
    assert is_mixed(qc) and not is_mixed(same)
    assert not is_mixed({"quant_method": "modelopt", "quant_algo": "NVFP4"})
    one = {"targets": ["Linear"], "weights": {"num_bits": 4}}
    assert not is_mixed({"quant_method": "compressed-tensors", "config_groups": {"a": one, "b": dict(one)}})


# ----------------------------------------------------------------------------- the inspector


def _expected_groups(folder: Path, group_of) -> dict[str, tuple[int, int]]:
    """``{group: (modules, bytes)}`` counted here from the files themselves (safetensors' own reader): a module
    is quantized when it stores a non-float tensor or an fp8 one; ``group_of(module)`` names its group."""
    out: dict[str, list[int]] = {}
    for module, ts in _by_module(_tensors(folder)).items():
        quantized = any(t.dtype in (torch.uint8, torch.float8_e4m3fn) for t in ts.values())
        key = group_of(module) if quantized else "unquantized"
        row = out.setdefault(key, [0, 0])
        row[0] += quantized
        row[1] += sum(t.numel() * t.element_size() for t in ts.values())
    return {k: tuple(v) for k, v in out.items()}


def _by_module(tensors: dict) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for k, v in tensors.items():
        out.setdefault(k.rsplit(".", 1)[0], {})[k] = v
    return out


@pytest.mark.parametrize("which", ["modelopt", "quark", "compressed"])
def test_inspector_lists_the_precision_groups(which, request):
    folder = request.getfixturevalue(which)[0]
    report = C.inspect_checkpoint(folder)
    assert report.layout_ok, report.problems
    got = {r["group"]: (r["modules"], r["bytes"]) for r in report.precision_groups}

    experts_group = {"modelopt": "NVFP4 g16", "quark": "*.mlp.experts.*", "compressed": "group_0"}[which]
    linear_group = {"modelopt": "MXFP8", "quark": "Linear", "compressed": "group_1"}[which]

    def group_of(module):  # the fixtures' plan (lm_head: NVFP4 under ModelOpt, by class under compressed-tensors)
        if ".mlp.experts." in module or (which == "modelopt" and module == "lm_head"):
            return experts_group
        return linear_group

    want = _expected_groups(folder, group_of)
    assert got == want
    assert sum(r["share"] for r in report.precision_groups) == pytest.approx(1.0, abs=1e-12)
    total = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    assert sum(r["bytes"] for r in report.precision_groups) < total  # the data, not the headers
    text = report.table()
    assert "precision groups (share of the checkpoint's bytes)" in text
    for r in report.precision_groups:
        assert r["group"] in text and f"{100 * r['share']:.2f}%" in text


def test_what_ran_checks_each_module_against_its_own_group(modelopt, tiny):
    from mxlib.models.what_ran import RanMismatch, assert_runs_as

    model, info = C.load_quantized_moe(modelopt[0])
    report = assert_runs_as(model, info, tiny[3])
    ran = {r.module: r.scheme for r in report}
    assert ran["model.layers.0.mlp.experts"] == "nvfp4" and ran["model.layers.0.self_attn.q_proj"] == "w_mxfp8_a_mxfp8"
    # asked as one scheme, the MXFP8 attention is named as a mismatch
    with pytest.raises(RanMismatch, match=r"self_attn.q_proj: ran w_mxfp8_a_mxfp8 \(W8A8\), the checkpoint asks nvfp4"):
        assert_runs_as(model, "nvfp4", report=report)


# ----------------------------------------------------------------------------- the writer


@pytest.mark.parametrize(
    "producer,fixture,schemes",
    [
        ("modelopt", "modelopt", ("nvfp4", "w_mxfp8_a_mxfp8", "nvfp4")),
        ("quark", "quark", ("w_mxfp4_a_mxfp4", "w_mxfp8_a_mxfp8", None)),
        ("compressed-tensors", "compressed", ("nvfp4", "w_mxfp8_a_mxfp8", "w_mxfp8_a_mxfp8")),
    ],
)
def test_write_mixed_checkpoint(producer, fixture, schemes, tiny, tmp_path, request):
    """The writer's tensors are the fixture's (each part quantized by its single-scheme layout), bit for bit; the
    written checkpoint loads with each module in its scheme, runs as the fixture does, and round-trips."""
    model, cal, amax, ids = tiny
    experts, attention, lm_head = schemes
    path = C.write_mixed_checkpoint(
        model, producer, tmp_path / "written", experts, attention, lm_head, cal, linear_input_amax=amax
    )
    source = request.getfixturevalue(fixture)[0]
    written, want = _tensors(path), _tensors(source)
    assert sorted(written) == sorted(want)
    for k in want:
        assert written[k].dtype == want[k].dtype, k
        assert_bits_equal(written[k], want[k], k)
    info = C.read_quant_config(path)
    assert info.precision is not None and info.precision.producer == producer
    loaded, _ = C.load_quantized_moe(path)
    schemes_ran = _schemes(loaded)
    assert schemes_ran["model.layers.1.mlp.experts"] == experts
    assert schemes_ran["model.layers.0.self_attn.v_proj"] == attention
    assert schemes_ran.get("lm_head") == lm_head
    reference, _ = C.load_quantized_moe(source)
    assert_bits_equal(_logits(loaded, ids), _logits(reference, ids), "written vs fixture logits")
    _round_trip(loaded, tmp_path, path)


def test_write_mixed_checkpoint_refuses(tiny, tmp_path):
    model, cal, amax, _ = tiny
    with pytest.raises(ValueError, match=r"attention: modelopt mixed checkpoints store .* got w_mxfp4_a_mxfp4"):
        C.write_mixed_checkpoint(model, "modelopt", tmp_path / "a", "nvfp4", "w_mxfp4_a_mxfp4", calibration=cal)
    with pytest.raises(ValueError, match="producer: expected one of"):
        C.write_mixed_checkpoint(model, "awq", tmp_path / "b", "nvfp4")
    with pytest.raises(ValueError, match=r"lm_head: nvfp4 needs linear_input_amax for 'lm_head'"):
        C.write_mixed_checkpoint(model, "modelopt", tmp_path / "c", "nvfp4", None, "nvfp4", calibration=cal)
    with pytest.raises(ValueError, match="experts: nvfp4 needs activation input scales"):
        C.write_mixed_checkpoint(model, "compressed-tensors", tmp_path / "d", "nvfp4")
    assert not any(tmp_path.iterdir())  # nothing half-written


@pytest.mark.parametrize(
    "bad,message",
    [
        (torch.tensor(0.0), r"expected a positive finite amax .* got 0.0"),  # a module that saw no input
        (torch.tensor(float("nan")), r"expected a positive finite amax .* got nan"),
        (torch.tensor(-1.0), r"expected a positive finite amax .* got -1.0"),
        (torch.ones(3), r"expected a one-element tensor \(the input's amax\), got shape \[3\]"),
        (1.0, r"expected a one-element tensor \(the input's amax\), got float"),
    ],
)
def test_write_mixed_checkpoint_refuses_an_amax_a_load_would_refuse(tiny, tmp_path, bad, message):
    """A static input scale from a zero, NaN, negative or malformed amax would be written and then refused by the
    loader; the writer refuses it first, naming the entry, and leaves nothing behind."""
    model, cal, amax, _ = tiny
    given = {**amax, ATTN[0]: bad}
    with pytest.raises(ValueError, match=rf"linear_input_amax\['{ATTN[0]}'\]: " + message):
        C.write_mixed_checkpoint(model, "modelopt", tmp_path / "w", "nvfp4", "w_fp8_a_fp8", None, cal, given)
    assert not (tmp_path / "w").exists()


def test_write_mixed_checkpoint_names_the_part(tiny, tmp_path):
    model, cal, amax, _ = tiny
    with pytest.raises(ValueError, match=r"experts: expected the routed experts' scheme .* got None"):
        C.write_mixed_checkpoint(model, "quark", tmp_path / "a", None, "w_mxfp8_a_mxfp8")
    with pytest.raises(ValueError, match=r"^attention: .*unknown MoE scheme 'w_nope'"):
        C.write_mixed_checkpoint(model, "quark", tmp_path / "b", "w_mxfp4_a_mxfp4", "w_nope")
    with pytest.raises(ValueError, match=r"experts: quark mixed checkpoints store \['every OCP MX scheme'"):
        C.write_mixed_checkpoint(model, "quark", tmp_path / "c", "nvfp4", "w_mxfp8_a_mxfp8", calibration=cal)
    assert not any(tmp_path.iterdir())
