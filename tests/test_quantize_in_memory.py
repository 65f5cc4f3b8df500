"""``mxlib.quantize_`` (the in-memory door), its calibration forms, and the GPTQ entries of the writer and the CLI.

The independent side of each check: ``write_quantized_checkpoint`` + ``load_quantized_moe`` (the writer's own
path, through files) for ``quantize_``'s experts and saved tensors; calibration on the unpadded token ids for
the padded, masked batches; a hand-built ``Calibration`` for the list / data-loader forms.
"""

import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import mxlib
from mxlib.checkpoints import load_quantized_moe, write_quantized_checkpoint
from mxlib.models.calibration import calibrate
from mxlib.models.hessians import collect_expert_hessians
from mxlib.models.qwen3 import dummy_qwen3_moe, qwen3_30b_a3b_config

from _util import TINY_QWEN3, assert_bits_equal

CFG = qwen3_30b_a3b_config(num_hidden_layers=2, **TINY_QWEN3)
IDS = torch.randint(2, 128, (4, 12), generator=torch.Generator().manual_seed(0))


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


def _model():
    return dummy_qwen3_moe(CFG, seed=1, expert_spread=0.5)


def _stored(path):
    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({n: h.get_tensor(n) for n in h.keys()})
    return out


@pytest.mark.parametrize(
    "scheme,layout,technique",
    [
        ("nvfp4", None, None),
        pytest.param("NVFP4", "compressed-tensors", None, marks=pytest.mark.slow),
        pytest.param("w_mxfp4_a_fp8", None, "gptq", marks=pytest.mark.slow),
        pytest.param("NVFP4A16", None, "four_over_six", marks=pytest.mark.slow),
    ],
)
@torch.no_grad()
def test_quantize_equals_the_writer_then_the_loader(tmp_path, scheme, layout, technique):
    writer_path = write_quantized_checkpoint(
        _model(), scheme, tmp_path / "written", calibration=IDS, layout=layout, technique=technique
    )
    loaded, info = load_quantized_moe(writer_path)
    model = mxlib.quantize_(_model(), scheme, calibration=IDS, layout=layout, technique=technique, progress=False)
    assert model.mxlib_info == info
    assert_bits_equal(model(input_ids=IDS).logits, loaded(input_ids=IDS).logits)
    model.save_pretrained(tmp_path / "saved")
    a, b = _stored(writer_path), _stored(tmp_path / "saved")
    assert sorted(a) == sorted(b)
    for n in a:
        assert a[n].dtype == b[n].dtype and torch.equal(
            a[n].reshape(-1).view(torch.uint8), b[n].reshape(-1).view(torch.uint8)
        ), n
    again = mxlib.from_pretrained(tmp_path / "saved")
    assert_bits_equal(again(input_ids=IDS).logits, model(input_ids=IDS).logits)


@torch.no_grad()
def test_padded_tokens_take_no_part_in_amax_or_hessians():
    real = IDS[:, :8]
    padded = torch.cat([real, torch.full((4, 4), 127)], 1)
    mask = torch.cat([torch.ones(4, 8, dtype=torch.long), torch.zeros(4, 4, dtype=torch.long)], 1)
    model = _model()
    want = calibrate(model, real)
    got = calibrate(model, [{"input_ids": padded, "attention_mask": mask}])
    assert got.num_tokens == want.num_tokens == real.numel()
    for a, b in zip(got.layers, want.layers):
        assert torch.equal(a.tokens, b.tokens)
        torch.testing.assert_close(a.a1_amax, b.a1_amax, rtol=1e-2, atol=0)
        torch.testing.assert_close(a.a2_amax, b.a2_amax, rtol=2e-2, atol=0)
    unmasked = calibrate(model, padded)
    assert unmasked.num_tokens == padded.numel() and not all(
        torch.equal(a.tokens, b.tokens) for a, b in zip(unmasked.layers, want.layers)
    )
    hw = collect_expert_hessians(model, real)
    hg = collect_expert_hessians(model, {"input_ids": padded, "attention_mask": mask})
    assert hg.num_tokens == hw.num_tokens
    for layer in hw.layers:
        assert torch.equal(hg.tokens(layer), hw.tokens(layer))
        torch.testing.assert_close(hg.w13(layer), hw.w13(layer), rtol=3e-2, atol=1e-4)


@torch.no_grad()
def test_calibration_forms_agree():
    model = _model()
    want = calibrate(model, IDS, batch_size=2)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(IDS), batch_size=2)
    forms = [
        [IDS[:2], IDS[2:]],
        [{"input_ids": IDS[:2]}, {"input_ids": IDS[2:], "attention_mask": torch.ones_like(IDS[2:])}],
        (batch[0] for batch in loader),
        {"input_ids": IDS, "attention_mask": torch.ones_like(IDS)},
    ]
    for form in forms:
        got = calibrate(model, form, batch_size=2)
        assert got.num_tokens == want.num_tokens
        for a, b in zip(got.layers, want.layers):
            assert torch.equal(a.tokens, b.tokens) and torch.equal(a.a1_amax, b.a1_amax)
            assert torch.equal(a.a2_amax, b.a2_amax)


def test_bad_calibration_named():
    model = _model()
    with pytest.raises(TypeError, match="calibration"):
        mxlib.quantize_(model, "nvfp4", calibration=["not a batch"], progress=False)
    with pytest.raises(ValueError, match="attention_mask"):
        mxlib.quantize_(model, "nvfp4", calibration={"input_ids": IDS, "attention_mask": IDS[:, :3]}, progress=False)
    with pytest.raises(ValueError, match="calibration: nvfp4 has static activation scales"):
        mxlib.quantize_(model, "nvfp4", progress=False)
    with pytest.raises(ValueError, match="calibration: GPTQ needs Hessians"):
        mxlib.quantize_(model, "w_mxfp4_a_mxfp4", technique="gptq", progress=False)
    with pytest.raises(ValueError, match="did you mean"):
        mxlib.quantize_(model, "nvfp5", calibration=IDS, progress=False)
    assert not any(isinstance(m, mxlib.TransformersExperts) for m in model.modules())


def test_failed_quantize_leaves_the_model_as_it_was(monkeypatch):
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    import mxlib.models.in_memory as M

    real, calls = M.make_emulation_experts, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom at the second layer")
        return real(*args, **kwargs)

    monkeypatch.setattr(M, "make_emulation_experts", failing)
    with pytest.raises(RuntimeError, match="boom"):
        mxlib.quantize_(model, "w_mxfp4_a_mxfp4", progress=False)
    assert not any(isinstance(m, mxlib.TransformersExperts) for m in model.modules())
    after = model.state_dict()
    assert sorted(after) == sorted(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert "save_pretrained" not in model.__dict__  # transformers' own save_pretrained again


def test_quantized_model_refuses_a_second_quantize():
    model = mxlib.quantize_(_model(), "w_mxfp4", progress=False)
    with pytest.raises(ValueError, match="already mxlib experts"):
        mxlib.quantize_(model, "w_mxfp4", progress=False)


def test_save_pretrained_layout_argument(tmp_path):
    model = mxlib.quantize_(_model(), "MXFP4", progress=False)
    assert model.mxlib_info.format == "quark"
    model.save_pretrained(tmp_path / "ct", layout="compressed-tensors-mxfp4")
    assert mxlib.from_pretrained(tmp_path / "ct").mxlib_info.format == "compressed-tensors-mxfp4"
    nv = mxlib.quantize_(_model(), "nvfp4", calibration=IDS, progress=False)
    with pytest.raises(ValueError, match="encode global scales"):
        nv.save_pretrained(tmp_path / "x", layout="compressed-tensors")
    assert not (tmp_path / "x").exists()


def test_writer_gptq_entry(tmp_path):
    model = _model()
    path = write_quantized_checkpoint(model, "w_mxfp4_a_mxfp4", tmp_path / "g", calibration=IDS, technique="gptq")
    assert load_quantized_moe(path)[1].scheme.name == "w_mxfp4_a_mxfp4"
    cal = calibrate(model, IDS)
    with pytest.raises(ValueError, match="Hessians"):
        write_quantized_checkpoint(model, "nvfp4", tmp_path / "h", calibration=cal, technique="gptq")
    assert not (tmp_path / "h").exists()


def test_writer_refuses_a_silent_cast_and_states_its_dtype(tmp_path):
    import json

    model = _model().float()  # bf16 values held in fp32: exact
    path = write_quantized_checkpoint(model, "w_mxfp4", tmp_path / "exact")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16"
    with torch.no_grad():
        model.model.embed_tokens.weight[0, 0] += 1e-4  # not a bf16 value any more
    with pytest.raises(ValueError, match="embed_tokens.*float32.*bfloat16"):
        write_quantized_checkpoint(model, "w_mxfp4", tmp_path / "inexact")
    assert not (tmp_path / "inexact").exists()


def test_cli_dummy_from_config_gptq_entry(tmp_path):
    import json

    from mxlib.cli import main as cli_main

    configs = Path(__file__).parent / "fixtures" / "configs"
    out = tmp_path / "result.json"
    argv = ["dummy-from-config", str(configs / "modelopt-nvfp4-qwen3-30b-a3b"), str(tmp_path / "ckpt")]
    argv += ["--layers", "1", "--preset", "tiny", "--device", "cpu", "--backend", "torch", "--technique", "gptq"]
    assert cli_main([*argv, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["technique"] == "gptq" and result["logits_finite"]
    assert load_quantized_moe(tmp_path / "ckpt")[1].scheme.name == "nvfp4"  # GPTQ stores no config of its own


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt_oss", "mixtral"])
@torch.no_grad()
def test_other_families_equal_the_writer_then_the_loader(tmp_path, family):
    from transformers import MixtralConfig

    from mxlib.models.gpt_oss import dummy_gpt_oss, gpt_oss_20b_config, gpt_oss_preset_overrides
    from mxlib.models.moe_models import dummy_moe_model

    if family == "gpt_oss":  # its own layout, expert biases, SwiGLU-OAI
        cfg = gpt_oss_20b_config(num_hidden_layers=2, **gpt_oss_preset_overrides("gpt-oss-tiny"))
        build, scheme, calibration = (lambda: dummy_gpt_oss(cfg, seed=0)), "w_mxfp4", None
    else:
        cfg = MixtralConfig(
            hidden_size=64,
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=128,
            head_dim=16,
        )
        build, scheme, calibration = (lambda: dummy_moe_model(cfg, seed=0)), "nvfp4", IDS
    ref = load_quantized_moe(write_quantized_checkpoint(build(), scheme, tmp_path / "w", calibration=calibration))[0]
    model = mxlib.quantize_(build(), scheme, calibration=calibration, progress=False)
    assert_bits_equal(model(input_ids=IDS).logits, ref(input_ids=IDS).logits)
    model.save_pretrained(tmp_path / "s")
    assert_bits_equal(mxlib.from_pretrained(tmp_path / "s")(input_ids=IDS).logits, ref(input_ids=IDS).logits)
