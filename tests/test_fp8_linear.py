"""FP8 linear layers beside FP4 experts: the "FP8 attention + NVFP4 / MXFP4 MLP" form of mixed checkpoints.

The arithmetic (``mxlib.reference``: ``quantize_fp8_weight``, ``dequantize_fp8_weight``,
``quant_dequant_fp8_per_token``; ``EmulatedLinear``'s FP8 forward) is checked bit for bit against an independent
oracle: ml_dtypes' e4m3 and bf16 casts on float64 / numpy arithmetic. The mixed fixtures are written from the
producers' documented on-disk forms (``mxlib/checkpoints/layouts/fp8_linear.py`` names the source of each), one
per producer: FP8 attention (static per-tensor activations, per-tensor weight scales) and an FP8 ``lm_head``
(per-token activations, per-channel weight scales) beside NVFP4 (ModelOpt, compressed-tensors) or MXFP4 (Quark)
experts. Each loads with every module in its own scheme, runs what the file says (weights and input QDQ against
the oracle from the raw file tensors), inspects, reports what ran, and is written back byte for byte, also with
bf16-stored scales (as amd-quark writes them). Bad tensors are refused naming the tensor.
"""

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from mxlib import checkpoints as C
from mxlib import reference as R
from mxlib.models.calibration import calibrate
from mxlib.models.qwen3 import dummy_qwen3_moe, qwen3_30b_a3b_config
from mxlib.models.what_ran import assert_runs_as
from mxlib.moe.emulation import QuantizedExperts
from mxlib.moe.factory import make_emulated_linear, make_emulation_experts, quantize_expert_weights
from mxlib.moe.linear import EmulatedLinear, LinearWeights, linear_input_amax
from mxlib.moe.quant_config import FusedMoEQuantConfig
from mxlib.moe.schemes import FP8_LINEAR_SCHEMES, MOE_SCHEMES, get_moe_scheme

from _util import TINY_QWEN3, assert_bits_equal

E4M3 = ml_dtypes.float8_e4m3fn
LAYERS = 2
ATTN = [f"model.layers.{layer}.self_attn.{p}" for layer in range(LAYERS) for p in C.ATTENTION_PROJS]
Q = "model.layers.0.self_attn.q_proj"


# ----------------------------------------------------------------------------- the oracle (numpy, ml_dtypes)


def _to_torch(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """An fp32 numpy array in ``dtype``, cast by ml_dtypes (bf16: round to nearest even), not by torch."""
    a32 = np.asarray(a, dtype=np.float32)
    if dtype == torch.bfloat16:
        return torch.from_numpy(a32.astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.int16)).view(torch.bfloat16)
    if dtype == torch.float16:
        return torch.from_numpy(a32.astype(np.float16))
    return torch.from_numpy(a32)


def _e4m3(codes: torch.Tensor) -> np.ndarray:
    return codes.contiguous().view(torch.uint8).numpy().view(E4M3).astype(np.float64)


def oracle_dequant(codes: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
    s = scale.double().numpy().reshape(-1, 1)
    return _to_torch((_e4m3(codes) * s).astype(np.float32), dtype)  # exact product, one rounding to fp32


def oracle_quantize(w: torch.Tensor, per_channel: bool):
    w64 = w.double().numpy()
    amax = np.abs(w64).max(axis=1) if per_channel else np.abs(w64).max()
    scale = np.where(amax > 0, np.float32(amax / 448.0), np.float32(1.0)).astype(np.float32)
    q = np.float32(w64 / (scale.astype(np.float64).reshape(-1, 1) if per_channel else np.float64(scale)))
    codes = np.clip(q, -448, 448).astype(E4M3).view(np.uint8)
    return torch.from_numpy(codes.copy()), torch.from_numpy(np.asarray(scale, dtype=np.float32))


def oracle_per_token(x: torch.Tensor, dtype) -> torch.Tensor:
    x64 = x.double().numpy()
    amax = np.abs(x64).max(axis=-1, keepdims=True)
    s = np.maximum(np.float32(amax / 448.0), np.float32(1.0 / (448 * 512))).astype(np.float64)
    q = np.clip(np.float32(x64 / s), -448, 448).astype(E4M3).astype(np.float64)
    return _to_torch(np.float32(q * s), dtype)


def oracle_per_tensor(x: torch.Tensor, input_scale: float, dtype) -> torch.Tensor:
    inv = np.float64(np.float32(1.0 / np.float64(np.float32(input_scale))))  # fp32 reciprocal, as vLLM's rule
    q = np.clip(np.float32(x.double().numpy() * inv), -448, 448).astype(E4M3).astype(np.float64)
    return _to_torch(np.float32(q * np.float64(np.float32(input_scale))), dtype)


# ----------------------------------------------------------------------------- the arithmetic


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantize_every_code_per_tensor_and_per_channel(dtype):
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].reshape(2, 127)  # every finite e4m3 code (0x7F / 0xFF are NaN)
    for scale in (torch.tensor(0.01234567, dtype=torch.float32), torch.tensor([3.7e-3, 1.9], dtype=torch.float32)):
        got = R.dequantize_fp8_weight(codes, scale, dtype)
        assert_bits_equal(got, oracle_dequant(codes, scale, dtype), f"dequantize {dtype} scale {scale.tolist()}")


@pytest.mark.parametrize("per_channel", [False, True])
def test_quantize_weight_against_ml_dtypes(per_channel):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(6, 96, generator=g) * torch.tensor([1e-3, 0.1, 1.0, 10.0, 300.0, 1.0]).reshape(6, 1)).bfloat16()
    w[5] = 0.0  # an all-zero row: scale 1 per channel
    codes, scale = R.quantize_fp8_weight(w, per_channel=per_channel)
    want_codes, want_scale = oracle_quantize(w, per_channel)
    assert codes.dtype == torch.uint8 and scale.dtype == torch.float32
    assert_bits_equal(scale, want_scale.reshape(scale.shape), "weight_scale")
    assert_bits_equal(codes, want_codes, "codes")


def test_quantize_ties_go_to_even():
    # amax 448 gives scale 1: the midpoints between neighbouring e4m3 values round to the even code
    vals = np.array([v for v in np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float64) if np.isfinite(v)])
    vals = np.unique(vals[vals >= 0])
    mids = (vals[:-1] + vals[1:]) / 2
    w = torch.tensor(np.concatenate([[448.0], mids]), dtype=torch.float32).reshape(1, -1)
    codes, scale = R.quantize_fp8_weight(w)
    assert scale.item() == 1.0
    want = np.clip(mids, -448, 448).astype(E4M3).view(np.uint8)  # ml_dtypes: ties to even
    assert np.array_equal(codes[0, 1:].numpy(), want)
    assert (codes[0, 1:].numpy() & 1 == 0).all()  # every tie went to an even mantissa


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_per_token_qdq_against_ml_dtypes(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 64, generator=g) * torch.tensor([1.0, 1e-3, 50.0, 0.0, 1e-9, 7.0]).reshape(6, 1)
    x = x.to(dtype)  # row 3 is zero, row 4 below the smallest per-token scale (1 / (448 * 512))
    assert_bits_equal(R.quant_dequant_fp8_per_token(x), oracle_per_token(x, dtype), "per-token QDQ")


@pytest.mark.parametrize("scheme", list(FP8_LINEAR_SCHEMES))
@pytest.mark.parametrize("per_channel", [False, True])
def test_emulated_linear_forward(scheme, per_channel):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(24, 64, generator=g).bfloat16()
    x = (torch.randn(3, 5, 64, generator=g) * 4).bfloat16()
    codes, scale = R.quantize_fp8_weight(w, per_channel=per_channel)
    s = get_moe_scheme(scheme)
    ins = torch.tensor(float(x.abs().max()) / 448 * 0.75, dtype=torch.float32)  # some inputs clip
    lin = make_emulated_linear(s, LinearWeights(s.weight, codes, scale), ins if s.static_activation_scale else None)
    x2 = x.reshape(-1, 64)
    xq = (
        oracle_per_tensor(x2, ins.item(), torch.bfloat16)
        if s.static_activation_scale
        else oracle_per_token(x2, torch.bfloat16)
    )
    want = torch.nn.functional.linear(xq, oracle_dequant(codes, scale, torch.bfloat16)).reshape(3, 5, 24)
    with torch.no_grad():
        assert_bits_equal(lin(x), want, f"{scheme} forward")
    assert lin.scheme.precision == "W8A8"


def test_emulated_linear_refuses_bad_weights():
    s = get_moe_scheme("w_fp8_a_fp8")
    codes, scale = R.quantize_fp8_weight(torch.randn(8, 32))
    ins = torch.tensor(0.01)
    with pytest.raises(
        ValueError, match=r"weight_scale: expected fp32 with 1 \(per tensor\) or 8 .* got torch.float16"
    ):
        make_emulated_linear(s, LinearWeights(s.weight, codes, scale.half()), ins)
    with pytest.raises(ValueError, match=r"weight_scale: expected fp32 .* got torch.float32 \[3\]"):
        make_emulated_linear(s, LinearWeights(s.weight, codes, torch.ones(3)), ins)
    with pytest.raises(ValueError, match="weight: expected uint8"):
        make_emulated_linear(s, LinearWeights(s.weight, codes.view(torch.int8), scale), ins)
    with pytest.raises(ValueError, match="weight_scale"):
        make_emulated_linear(s, LinearWeights(s.weight, codes, torch.tensor(0.0)), ins)
    with pytest.raises(ValueError, match="w_fp8_a_fp8: activations with a static scale need input_scale"):
        make_emulated_linear(s, LinearWeights(s.weight, codes, scale), None)


def test_experts_refuse_fp8_schemes(tiny_model):
    model, cal, amax, _ = tiny_model
    assert not set(FP8_LINEAR_SCHEMES) & set(MOE_SCHEMES)
    with pytest.raises(ValueError, match="scheme: w_fp8_a_fp8 is a linear-layer scheme"):
        FusedMoEQuantConfig(scheme=get_moe_scheme("w_fp8_a_fp8"))
    w = quantize_expert_weights(torch.randn(2, 64, 32), torch.randn(2, 32, 32), "nvfp4")
    with pytest.raises(ValueError, match="weights: quantized as nvfp4, scheme w_fp8_a_fp8 stores fp8_e4m3"):
        make_emulation_experts("w_fp8_a_fp8", w)
    with pytest.raises(ValueError, match="experts: w_fp8_a_fp8_per_token is a linear-layer scheme"):
        C.write_mixed_checkpoint(model, "modelopt", Path("/nonexistent/never"), "w_fp8_a_fp8_per_token")


# ----------------------------------------------------------------------------- the mixed fixtures


@pytest.fixture(scope="module")
def tiny_model():
    cfg = qwen3_30b_a3b_config(num_hidden_layers=LAYERS, **TINY_QWEN3)
    model = dummy_qwen3_moe(cfg, seed=5, expert_spread=0.5)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    return model, calibrate(model, ids), linear_input_amax(model, ids, [*ATTN, "lm_head"]), ids


PRODUCERS = {"modelopt": "nvfp4", "quark": "w_mxfp4_a_mxfp4", "compressed-tensors": "nvfp4"}
# the documented on-disk form of each producer: (weight_scale shape per tensor, per channel, input_scale shape)
FORMS = {
    "modelopt": ((), (-1,), ()),
    "quark": ((), (-1,), ()),
    "compressed-tensors": ((1,), (-1, 1), (1,)),
}


@pytest.fixture(scope="module")
def fixtures(tiny_model, tmp_path_factory):
    model, cal, amax, _ = tiny_model
    root = tmp_path_factory.mktemp("fp8")
    return {
        p: C.write_mixed_checkpoint(
            model, p, root / p, e, "w_fp8_a_fp8", "w_fp8_a_fp8_per_token", cal, linear_input_amax=amax
        )
        for p, e in PRODUCERS.items()
    }


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _shape(form, out):
    return tuple(out if d == -1 else d for d in form)


@pytest.mark.parametrize("producer", list(PRODUCERS))
def test_on_disk_form(producer, fixtures):
    path = fixtures[producer]
    t = _tensors(path)
    per_tensor, per_channel, ins = FORMS[producer]
    out_q, out_head = t[f"{Q}.weight"].shape[0], t["lm_head.weight"].shape[0]
    assert t[f"{Q}.weight"].dtype == torch.float8_e4m3fn and t["lm_head.weight"].dtype == torch.float8_e4m3fn
    assert tuple(t[f"{Q}.weight_scale"].shape) == _shape(per_tensor, out_q)
    assert tuple(t["lm_head.weight_scale"].shape) == _shape(per_channel, out_head)
    assert tuple(t[f"{Q}.input_scale"].shape) == ins and "lm_head.input_scale" not in t
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    if producer == "modelopt":
        assert qc["quant_algo"] == "MIXED_PRECISION"
        assert qc["quantized_layers"][Q] == {"quant_algo": "FP8"}
        assert qc["quantized_layers"]["lm_head"] == {"quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"}
        legacy = json.loads((path / "hf_quant_config.json").read_text())["quantization"]
        assert legacy["quantized_layers"] == qc["quantized_layers"]
    elif producer == "quark":
        attn = qc["layer_quant_config"]["*.self_attn.*"]
        assert (attn["weight"]["dtype"], attn["weight"]["qscheme"]) == ("fp8_e4m3", "per_tensor")
        assert (attn["input_tensors"]["qscheme"], attn["input_tensors"]["is_dynamic"]) == ("per_tensor", False)
        head = qc["layer_quant_config"]["lm_head"]
        assert (head["weight"]["qscheme"], head["input_tensors"]["is_dynamic"]) == ("per_channel", True)
        assert qc["global_quant_config"]["weight"]["dtype"] == "fp4"
    else:
        fp8 = [g for g in qc["config_groups"].values() if g["format"] == "float-quantized"]
        strategies = sorted((g["weights"]["strategy"], g["input_activations"]["strategy"]) for g in fp8)
        assert strategies == [("channel", "token"), ("tensor", "tensor")]
        assert qc["format"] == "mixed-precision"


def _loaded(path):
    return C.load_quantized_moe(path, backend="torch")


def _check_runs_the_file(model, path, ids):
    """Every FP8 module's weight and input QDQ are the oracle's from the file's own tensors."""
    t = _tensors(path)
    g = torch.Generator().manual_seed(3)
    for name in [*ATTN, "lm_head"]:
        lin = model.get_submodule(name)
        assert isinstance(lin, EmulatedLinear)
        w, s = t[f"{name}.weight"], t[f"{name}.weight_scale"].float()
        assert_bits_equal(lin.dequantized_weight(), oracle_dequant(w, s, torch.bfloat16), f"{name} weight")
        x = (torch.randn(5, lin.in_features, generator=g) * 3).bfloat16()
        if name == "lm_head":
            want = oracle_per_token(x, torch.bfloat16)
        else:
            want = oracle_per_tensor(x, t[f"{name}.input_scale"].float().item(), torch.bfloat16)
        assert_bits_equal(lin.quantize_input(x), want, f"{name} input QDQ")


def _round_trip(model, path: Path, tmp: Path):
    out = model.save_pretrained(tmp)
    out = Path(tmp) if out is None else Path(out)
    a, b = _tensors(path), _tensors(out)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert_bits_equal(b[k], a[k], k)
    for f in ("config.json", "hf_quant_config.json"):
        if (path / f).exists():
            qa = json.loads((path / f).read_text()).get("quantization_config", json.loads((path / f).read_text()))
            qb = json.loads((out / f).read_text()).get("quantization_config", json.loads((out / f).read_text()))
            assert qa == qb, f
    return out


@pytest.mark.parametrize("producer", list(PRODUCERS))
def test_mixed_loads_runs_inspects_and_round_trips(producer, fixtures, tiny_model, tmp_path):
    path, ids = fixtures[producer], tiny_model[3]
    model, info = _loaded(path)
    assert model.get_submodule(Q).scheme.name == "w_fp8_a_fp8"
    assert model.get_submodule("lm_head").scheme.name == "w_fp8_a_fp8_per_token"
    experts = model.model.layers[1].mlp.experts.experts
    assert isinstance(experts, QuantizedExperts) and experts.scheme.name == PRODUCERS[producer]
    assert info.scheme.name == PRODUCERS[producer]  # the checkpoint's scheme is its experts'
    _check_runs_the_file(model, path, ids)

    report = assert_runs_as(model, info, ids)
    rows = {r.module: r for r in report}
    assert (rows[Q].precision, rows[Q].a1_passes, rows[Q].scale_strategy) == ("W8A8", 1.0, "static")
    head = rows["lm_head"]
    assert (head.activation_format, head.a1_passes, head.scale_strategy) == (
        "fp8_e4m3_per_token",
        1.0,
        "dynamic per token",
    )

    inspected = C.inspect_checkpoint(path)
    assert inspected.layout_ok and not inspected.problems, inspected.problems
    groups = {r["scheme"]: r for r in inspected.precision_groups}
    t = _tensors(path)
    attn_bytes = sum(v.numel() * v.element_size() for k, v in t.items() if ".self_attn." in k and "norm" not in k)
    assert groups["w_fp8_a_fp8"]["modules"] == len(ATTN) and groups["w_fp8_a_fp8"]["bytes"] == attn_bytes
    assert groups["w_fp8_a_fp8_per_token"]["modules"] == 1

    saved = _round_trip(model, path, tmp_path / "saved")
    again, _ = _loaded(saved)
    with torch.no_grad():
        assert_bits_equal(again(input_ids=ids).logits, model(input_ids=ids).logits, "logits after the round trip")


@pytest.mark.parametrize("producer", ["quark", "compressed-tensors"])
def test_bf16_stored_scales_round_trip(producer, fixtures, tmp_path):
    """Scales stored in bf16 (amd-quark writes its scales in the model's dtype) are widened exactly, run as
    stored and written back in bf16, byte for byte."""
    src = tmp_path / "bf16"
    shutil.copytree(fixtures[producer], src)
    t = _tensors(src)
    for k in list(t):
        if (
            k.endswith(("weight_scale", "input_scale"))
            and t[k].dtype == torch.float32
            and (".self_attn." in k or k.startswith("lm_head"))
        ):
            t[k] = t[k].bfloat16()
    _rewrite(src, t)
    model, _ = _loaded(src)
    _check_runs_the_file(model, src, None)
    _round_trip(model, src, tmp_path / "saved")
    assert _tensors(tmp_path / "saved")[f"{Q}.weight_scale"].dtype == torch.bfloat16


def _rewrite(folder: Path, tensors: dict) -> None:
    """The folder's tensors replaced by ``tensors``, in one ``model.safetensors`` (no index)."""
    for f in list(folder.glob("*.safetensors")) + list(folder.glob("*.safetensors.index.json")):
        f.unlink()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


# ----------------------------------------------------------------------------- bad input


def _broken(fixtures, tmp_path, producer, change):
    src = tmp_path / "broken"
    shutil.copytree(fixtures[producer], src)
    t = _tensors(src)
    change(t)
    _rewrite(src, t)
    return src


BAD = [
    (
        "weight_scale int32",
        lambda t: t.update({f"{Q}.weight_scale": t[f"{Q}.weight_scale"].int()}),
        rf"tensor '{Q}.weight_scale': expected a float scale of dtype float32, bfloat16 or float16",
    ),
    (
        "weight_scale [out, 2]",
        lambda t: t.update({f"{Q}.weight_scale": torch.ones(64, 2)}),
        rf"tensor '{Q}.weight_scale': expected shape .* found \[64, 2\]",
    ),
    (
        "weight_scale zero",
        lambda t: t.update({f"{Q}.weight_scale": t[f"{Q}.weight_scale"] * 0}),
        rf"tensor '{Q}.weight_scale': expected a positive finite weight_scale",
    ),
    (
        "input_scale missing",
        lambda t: t.pop(f"{Q}.input_scale"),
        rf"missing tensor '{Q}.input_scale': w_fp8_a_fp8 quantizes {Q}'s input with a static per-tensor scale",
    ),
    (
        "input_scale two values",
        lambda t: t.update({f"{Q}.input_scale": torch.ones(2)}),
        rf"tensor '{Q}.input_scale': expected shape .* \(one static scale\), found \[2\]",
    ),
    (
        "weight not fp8",
        lambda t: t.update({f"{Q}.weight": t[f"{Q}.weight"].view(torch.uint8)}),
        rf"tensor '{Q}.weight': expected dtype torch.float8_e4m3fn, found torch.uint8",
    ),
]


@pytest.mark.parametrize("producer", list(PRODUCERS))
@pytest.mark.parametrize("what,change,message", BAD, ids=[b[0] for b in BAD])
def test_bad_tensors_are_refused_naming_the_tensor(producer, what, change, message, fixtures, tmp_path):
    src = _broken(fixtures, tmp_path, producer, change)
    with pytest.raises(C.CheckpointError, match=message):
        _loaded(src)


def test_fp8_experts_are_refused(fixtures, tmp_path):
    """A ModelOpt mixed config that puts the experts in FP8 is refused, naming the layer and why."""
    src = tmp_path / "experts"
    shutil.copytree(fixtures["modelopt"], src)
    for f, key in (("config.json", "quantization_config"), ("hf_quant_config.json", "quantization")):
        cfg = json.loads((src / f).read_text())
        layers = cfg[key]["quantized_layers"]
        for name in layers:
            if name.endswith(".mlp.experts"):  # nvidia-modelopt names each layer's experts module
                layers[name] = {"quant_algo": "FP8"}
        (src / f).write_text(json.dumps(cfg))
    with pytest.raises(
        C.CheckpointError, match=r"experts: the checkpoint stores these experts in FP8 .* linear layers"
    ):
        _loaded(src)


def test_group_switched_to_fp8_is_that_checkpoint(tiny_model, tmp_path):
    """Group attribution takes the FP8 schemes as targets: MXFP8 attention switched to ``w_fp8_a_fp8_per_token``
    computes the checkpoint written with that FP8 attention by ModelOpt's layout, bit for bit (its per-channel
    writer rounds once, as ``reference.quantize_fp8_weight`` does; the producers' per-tensor writers round in the
    weight's dtype, which the switch, producer-neutral, does not)."""
    from mxlib.studies import group_attribution as G

    model, cal, amax, ids = tiny_model
    write = C.write_mixed_checkpoint
    mx = write(model, "modelopt", tmp_path / "mx", "nvfp4", "w_mxfp8_a_mxfp8", None, cal, linear_input_amax=amax)
    fp8 = write(model, "modelopt", tmp_path / "fp8", "nvfp4", "w_fp8_a_fp8_per_token", None, cal)
    mixed, other = _loaded(mx)[0], _loaded(fp8)[0]
    (group,) = [g for g, mods in G.precision_groups(mixed).items() if any(".self_attn." in m for m in mods)]
    with torch.no_grad(), G.switched_groups(mixed, model, {group: "w_fp8_a_fp8_per_token"}) as m:
        assert_bits_equal(m(input_ids=ids).logits, other(input_ids=ids).logits, "attention switched to FP8")
