"""Models and configs of families mxlib does not quantize are refused at every public entry.

Each foreign class is transformers' own (the dense Qwen3 and Llama, and JetMoE, an MoE family mxlib
does not register) built at a tiny size; every entry that takes a model, a config or a checkpoint
folder must refuse it in under a second, the message naming the entry, the class (or the config's
``architectures``) and the supported classes (``Qwen3MoeForCausalLM`` and the other registered
families: Mixtral, OLMoE, Qwen2-MoE, DeepSeek-V3). A Qwen3-MoE model still goes through calibrate ->
write -> load -> inspect, stored under its own class name.
"""

import io
import json
import shutil
import time
from contextlib import redirect_stderr
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file

from mxlib.checkpoints import (
    CheckpointError,
    attach_checkpoint_layout,
    dummy_checkpoint_from_config,
    inspect_checkpoint,
    load_quantized_moe,
    load_quantized_qwen3_moe,
    save_quantized_checkpoint,
    write_quantized_checkpoint,
)
from mxlib.checkpoints.dummy import dummy_quantization
from mxlib.checkpoints.files import untrusted
from mxlib.models import calibration, evaluation, families, hessians, moe_models, qwen3, routing_stats
from mxlib.models.tasks import Dataset

FIXTURES = Path(__file__).parent / "fixtures"
QUANTIZED_CONFIG = FIXTURES / "configs" / "quark-w_mxfp4_a_mxfp4-qwen3-30b-a3b" / "config.json"
LIMIT_S = 1.0  # a refusal answers before any work: well under a second even on a loaded CPU

_COMMON = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, vocab_size=128)

# transformers' own classes mxlib does not quantize, at tiny sizes: a dense model of a supported MoE
# family's line, a dense Llama, and an MoE family with its own expert layout (JetMoE's mixture of
# attention heads and its fused input_linear / output_linear experts)
FOREIGN = {
    "Qwen3ForCausalLM": ("Qwen3Config", dict(intermediate_size=64, head_dim=32)),
    "LlamaForCausalLM": ("LlamaConfig", dict(intermediate_size=64)),
    "JetMoeForCausalLM": (
        "JetMoeConfig",
        dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, kv_channels=32),
    ),
}
# the supported families besides Qwen3-MoE: every entry takes them (tests/test_families_roundtrip.py)
SUPPORTED_OTHERS = ("MixtralForCausalLM", "OlmoeForCausalLM", "Qwen2MoeForCausalLM", "DeepseekV3ForCausalLM")
NAMES = sorted(FOREIGN)


def _config(cls_name: str):
    config_cls, kw = FOREIGN[cls_name]
    return getattr(transformers, config_cls)(**_COMMON, **kw)


@pytest.fixture(scope="module")
def foreign_models():
    torch.manual_seed(0)
    return {n: getattr(transformers, n)(_config(n)).eval() for n in NAMES}


def _config_folder(tmp_path: Path, cls_name: str, quantized: bool) -> Path:
    """A checkpoint folder whose config.json is the foreign family's own (``to_dict`` plus its
    ``architectures``, as ``save_pretrained`` writes it), with a valid mxlib quantization config."""
    folder = tmp_path / cls_name
    folder.mkdir()
    cfg = dict(_config(cls_name).to_dict(), architectures=[cls_name])
    if quantized:
        cfg["quantization_config"] = json.loads(QUANTIZED_CONFIG.read_text())["quantization_config"]
    (folder / "config.json").write_text(json.dumps(cfg, default=str))
    return folder


def _refused(call, error, *names):
    t0 = time.perf_counter()
    with pytest.raises(error) as info:
        call()
    elapsed = time.perf_counter() - t0
    assert elapsed < LIMIT_S, f"refusal took {elapsed:.3f} s"
    for n in (*names, "Qwen3MoeForCausalLM", *SUPPORTED_OTHERS):
        assert n in str(info.value), (n, str(info.value))
    return info.value


def test_supported_names_are_transformers_own():
    # the oracle: transformers' classes and configs, not mxlib's constants
    want = [
        (transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig),
        (transformers.MixtralForCausalLM, transformers.MixtralConfig),
        (transformers.OlmoeForCausalLM, transformers.OlmoeConfig),
        (transformers.Qwen2MoeForCausalLM, transformers.Qwen2MoeConfig),
        (transformers.DeepseekV3ForCausalLM, transformers.DeepseekV3Config),
    ]
    assert families.SUPPORTED_ARCHITECTURES[0] == "Qwen3MoeForCausalLM"  # the default, first
    for model_cls, config_cls in want:
        assert model_cls.__name__ in families.SUPPORTED_ARCHITECTURES
        assert config_cls.model_type in families.SUPPORTED_MODEL_TYPES
        fam = families.FAMILIES[model_cls.__name__]
        assert (fam.model_type, fam.config_class) == (config_cls.model_type, config_cls.__name__)
        assert fam.load_class() is model_cls and fam.load_config_class() is config_cls
    assert len(families.SUPPORTED_ARCHITECTURES) == len(families.SUPPORTED_MODEL_TYPES)
    assert issubclass(families.UnsupportedModelError, TypeError)


def _model_entries(tmp_path):
    ids = torch.zeros(1, 4, dtype=torch.long)
    d = Dataset("copy", "test", 0, torch.ones(2, 3, dtype=torch.long), torch.ones(2, 2, dtype=torch.long))
    return {
        "write_quantized_checkpoint": lambda m: write_quantized_checkpoint(m, "w_mxfp4_a_mxfp4", tmp_path / "out"),
        "calibrate": lambda m: calibration.calibrate(m, ids),
        "swap_experts": lambda m: qwen3.swap_experts(m, lambda i: None),
        "moe_layers": lambda m: qwen3.moe_layers(m),
        "moe_layer_indices": lambda m: moe_models.moe_layer_indices(m),
        "expert_weights": lambda m: moe_models.expert_weights(m, 0),
        "collect_expert_hessians": lambda m: hessians.collect_expert_hessians(m, ids),
        "routing_statistics": lambda m: routing_stats.routing_statistics(m, ids),
        "evaluate": lambda m: evaluation.evaluate(m, d),
        "greedy_decode": lambda m: evaluation.greedy_decode(m, ids, 1),
        "expert_counts": lambda m: evaluation.expert_counts(m, d),
        "calibrate_tasks": lambda m: evaluation.calibrate_tasks(m, d),
        "emulated_experts": lambda m: evaluation.emulated_experts(m, "w_mxfp4_a_mxfp4").__enter__(),
        "swapped_experts": lambda m: evaluation.swapped_experts(m, lambda i: None).__enter__(),
        "attach_checkpoint_layout": lambda m: attach_checkpoint_layout(m),
        "save_quantized_checkpoint": lambda m: save_quantized_checkpoint(m, tmp_path / "out"),
    }


@pytest.mark.parametrize("cls_name", NAMES)
def test_model_entries_refuse_foreign_models(cls_name, foreign_models, tmp_path):
    model = foreign_models[cls_name]
    before = {n: p.clone() for n, p in model.state_dict().items()}
    for where, call in _model_entries(tmp_path).items():
        _refused(lambda: call(model), families.UnsupportedModelError, where, cls_name)
    assert not (tmp_path / "out").exists()  # nothing written
    after = model.state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)  # nothing changed
    assert not isinstance(model.save_pretrained, qwen3.BoundToModel)  # swap_experts touched nothing


@pytest.mark.parametrize("cls_name", NAMES)
def test_config_field_checks_name_the_family_first(cls_name):
    # the torch-free config rules the command line and the loader share
    cfg = dict(_config(cls_name).to_dict(), architectures=[cls_name])
    _refused(lambda: untrusted.check_model_fields(cfg, "x/config.json"), ValueError, "x/config.json", cls_name)


@pytest.mark.parametrize("cls_name", NAMES)
def test_config_entries_refuse_foreign_configs(cls_name):
    config = _config(cls_name)
    for where, call in {
        "empty_qwen3_moe": lambda: qwen3.empty_qwen3_moe(config),
        "dummy_qwen3_moe": lambda: qwen3.dummy_qwen3_moe(config),
        "empty_moe_model": lambda: moe_models.empty_moe_model(config),
        "dummy_moe_model": lambda: moe_models.dummy_moe_model(config),
        "family_of": lambda: families.family_of(config),
    }.items():
        _refused(call, families.UnsupportedModelError, where, type(config).__name__, repr(config.model_type))


@pytest.mark.parametrize("cls_name", NAMES)
@pytest.mark.parametrize("quantized", [True, False])
def test_checkpoint_readers_refuse_foreign_config_json(cls_name, quantized, foreign_models, tmp_path):
    folder = _config_folder(tmp_path, cls_name, quantized)
    # the family's own weights, as its save_pretrained stores them (bf16)
    state = {n: t.to(torch.bfloat16).contiguous() for n, t in foreign_models[cls_name].state_dict().items()}
    save_file({n: t for n, t in state.items() if n != "lm_head.weight"}, str(folder / "model.safetensors"))
    out = tmp_path / "out"
    entries = {
        "dummy_quantization": lambda: dummy_quantization(folder, "w_mxfp4_a_mxfp4"),
        "dummy_checkpoint_from_config": lambda: dummy_checkpoint_from_config(folder, out, scheme="w_mxfp4_a_mxfp4"),
    }
    if quantized:  # the loader reads quantized checkpoints only
        entries["load_quantized_qwen3_moe"] = lambda: load_quantized_qwen3_moe(folder)
        entries["load_quantized_moe"] = lambda: load_quantized_moe(folder)
    for where, call in entries.items():
        err = _refused(call, CheckpointError, where, cls_name, str(folder / "config.json"))
        assert "moe_intermediate_size" not in str(err)
    assert not out.exists()
    if quantized:  # the inspector reports what the loader refuses, as a problem, and checks no layout
        t0 = time.perf_counter()
        report = inspect_checkpoint(folder)
        assert time.perf_counter() - t0 < 5.0
        assert not report.layout_ok
        first = report.problems[0]
        assert first.startswith("config: inspect_checkpoint: ") and cls_name in first and "Qwen3MoeForCausalLM" in first


def test_cli_refuses_foreign_config_json(tmp_path):
    from mxlib.cli import main

    folder = _config_folder(tmp_path, "JetMoeForCausalLM", quantized=False)
    err = io.StringIO()
    with redirect_stderr(err), pytest.raises(SystemExit) as info:
        main(["dummy-from-config", str(folder), str(tmp_path / "out"), "--scheme", "w_mxfp4_a_mxfp4"])
    assert info.value.code == 2
    text = err.getvalue()
    assert "JetMoeForCausalLM" in text and "Qwen3MoeForCausalLM" in text and "moe_intermediate_size" not in text, text
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "cfg, found",
    [
        ({"architectures": ["LlamaForCausalLM"]}, "LlamaForCausalLM"),
        ({"model_type": "jetmoe"}, "'jetmoe'"),
        ({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "llama"}, "'llama'"),
        ({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "mixtral"}, "'mixtral' of another family"),
        ({"architectures": ["Qwen3MoeForCausalLM", "Qwen3ForCausalLM"]}, "Qwen3ForCausalLM"),
        ({"architectures": "Qwen3MoeForCausalLM"}, "expected a list of class names"),
    ],
)
def test_config_dict_names_checked(cfg, found):
    _refused(lambda: families.check_supported_model(cfg, "f", name="cfg"), families.UnsupportedModelError, found)
    with pytest.raises(ValueError, match="^f: cfg: "):  # the caller's error class
        families.check_supported_model(cfg, "f", name="cfg", error=ValueError)


def test_supported_configs_pass():
    for cfg in ({}, {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}, {"model_type": "qwen3_moe"}):
        assert families.check_supported_model(cfg, "f") is cfg
    config = qwen3.qwen3_30b_a3b_config(2, **qwen3.model_preset_overrides("tiny"))
    assert families.check_supported_model(config, "f") is config
    for path in sorted(FIXTURES.rglob("config.json")):  # every real checkpoint config of the fixtures
        families.check_supported_checkpoint(path.parent, "f", lambda p: json.loads(p.read_text()))


def test_not_a_model_named():
    _refused(lambda: calibration.calibrate("model", torch.zeros(1, 2)), families.UnsupportedModelError, "got str")


def test_qwen3_moe_round_trip_keeps_its_own_label(tmp_path):
    config = qwen3.qwen3_30b_a3b_config(2, **qwen3.model_preset_overrides("tiny"))

    class MyQwen3Moe(transformers.Qwen3MoeForCausalLM):  # a user's subclass is still a Qwen3-MoE
        pass

    assert families.check_supported_model(MyQwen3Moe(config), "f") is not None
    model = qwen3.dummy_qwen3_moe(config, seed=0)
    ids = torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    cal = calibration.calibrate(model, ids)
    stats = routing_stats.routing_statistics(model, ids)
    assert sum(int(s["tokens_per_expert"].sum()) for s in stats) == 2 * 8 * config.num_experts_per_tok * 2
    assert len(cal.layers) == 2
    path = write_quantized_checkpoint(model, "w_mxfp4_a_mxfp4", tmp_path / "ckpt")
    stored = json.loads((path / "config.json").read_text())
    assert stored["architectures"] == [type(model).__name__] == ["Qwen3MoeForCausalLM"]
    assert stored["model_type"] == transformers.Qwen3MoeConfig.model_type
    loaded, info = load_quantized_qwen3_moe(path, backend="torch")
    assert type(loaded) is transformers.Qwen3MoeForCausalLM and info.scheme.name == "w_mxfp4_a_mxfp4"
    assert inspect_checkpoint(path).layout_ok
    again = save_quantized_checkpoint(loaded, tmp_path / "again")
    assert json.loads((again / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]
    shutil.rmtree(tmp_path / "again")


def test_registry_describes_qwen3_moe():
    """The registry's Qwen3-MoE descriptor reads transformers' own config and names."""
    fam = families.family_of(transformers.Qwen3MoeConfig(num_hidden_layers=3, num_experts=8, moe_intermediate_size=16))
    assert fam is families.QWEN3_MOE and fam.architecture in families.SUPPORTED_ARCHITECTURES
    cfg = transformers.Qwen3MoeConfig(
        num_hidden_layers=4, num_experts=8, moe_intermediate_size=16, num_experts_per_tok=3
    )
    assert (fam.num_experts(cfg), fam.intermediate_size(cfg), fam.top_k(cfg)) == (8, 16, 3)
    d = cfg.to_dict()  # transformers 5 writes num_experts as num_local_experts
    assert (fam.num_experts(d), fam.intermediate_size(d), fam.top_k(d)) == (8, 16, 3)
    assert fam.moe_layer_indices(cfg) == [0, 1, 2, 3]
    sparse = transformers.Qwen3MoeConfig(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3])
    assert fam.moe_layer_indices(sparse) == [1]  # transformers' Qwen3MoeDecoderLayer rule
    assert (
        fam.disk_name("model.layers.0.mlp.experts.3.gate_proj.weight")
        == "model.layers.0.mlp.experts.3.gate_proj.weight"
    )
    assert families.family_of({"architectures": ["Qwen3MoeForCausalLM"]}) is fam
    assert families.family_of({"model_type": "qwen3_moe"}) is fam


def test_register_family_refuses_duplicates_and_bad_descriptors():
    with pytest.raises(ValueError, match="Qwen3MoeForCausalLM.*registered already"):
        families.register_family(families.QWEN3_MOE)
    with pytest.raises(TypeError, match="expected a MoEFamily, got dict"):
        families.register_family({"architecture": "X"})
    with pytest.raises(ValueError, match="experts_orientation: expected one of"):
        families.MoEFamily("X", "x", "XConfig", experts_orientation="columns")
    with pytest.raises(families.UnsupportedModelError, match="'LlamaForCausalLM' is not a registered family"):
        families.family_for_architecture("LlamaForCausalLM")
