"""Activation dtypes and dtype casts of loaded models, on a checkpoint of every layout.

One checkpoint per registered layout: the producers' fixtures (llm-compressor, ModelOpt, Quark; ``tests/fixtures/
interop``) and a tiny gpt-oss written by mxlib in gpt-oss's native layout. For each:

* ``model.half()`` / ``.float()`` / ``.to(torch.bfloat16)`` leave every quantized code and scale of the model's
  ``state_dict()`` byte-equal to the loaded ones (the independent side: the tensors as loaded, compared as bytes);
* fp16 and fp32 forwards run end to end, in that dtype, with finite logits;
* ``.float()`` then ``.to(torch.bfloat16)`` gives the logits of the model cast to bf16 directly, bit for bit
  (bf16 -> fp32 -> bf16 is exact), and ``save_pretrained`` after ``.float()`` writes the same tensors, byte for
  byte, as the save of the model as loaded, its scales the source's own bytes.
"""

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import mxlib
from mxlib.checkpoints import write_quantized_checkpoint

from _util import assert_bits_equal

INTEROP = Path(__file__).parent / "fixtures" / "interop"
FIXTURES = {  # layout -> producer fixture
    "modelopt": "modelopt_nvfp4_default",  # NVFP4 experts and attention
    "quark": "quark_w_mxfp4_a_fp8",  # static FP8 activations, bf16 input_scale
    "compressed-tensors": "llmc_nvfp4",
    "compressed-tensors-mxfp4": "llmc_mxfp4",
    "modelopt-mxfp8": "modelopt_mxfp8",
    "compressed-tensors-mxfp8": "llmc_mxfp8",
}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the emulation's scale-unification notes
        yield


@pytest.fixture(scope="module")
def gpt_oss_checkpoint(tmp_path_factory):
    from mxlib.models.gpt_oss import dummy_gpt_oss, gpt_oss_20b_config, gpt_oss_preset_overrides

    cfg = gpt_oss_20b_config(num_hidden_layers=2, **gpt_oss_preset_overrides("gpt-oss-tiny"))
    model = dummy_gpt_oss(cfg, seed=0)
    return write_quantized_checkpoint(model, "w_mxfp4", tmp_path_factory.mktemp("gptoss") / "ckpt")


def _path(layout, gpt_oss_checkpoint):
    return gpt_oss_checkpoint if layout == "gpt-oss-mxfp4" else INTEROP / FIXTURES[layout] / "checkpoint"


def _stored(path):
    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for name in h.keys():
                out[name] = h.get_tensor(name)
    return out


def _bytes(t):
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _quantized_entries(model):
    """The state-dict entries of the quantized modules (experts and emulated linear layers): codes and scales."""
    sd = model.state_dict()
    kinds = (mxlib.TransformersExperts, mxlib.EmulatedLinear)
    quantized = {n for n, m in model.named_modules() if isinstance(m, kinds)}
    return {k: v.clone() for k, v in sd.items() if any(k.startswith(q + ".") for q in quantized) or "scale" in k}


# two layouts run in the quick stage, the others under the ``slow`` mark (about 5 s each on one core)
LAYOUTS = [
    lay if lay in ("modelopt", "compressed-tensors") else pytest.param(lay, marks=pytest.mark.slow)
    for lay in [*FIXTURES, "gpt-oss-mxfp4"]
]


@pytest.mark.parametrize("layout", LAYOUTS)
@torch.no_grad()
def test_casts_keep_codes_and_scales_and_run(layout, gpt_oss_checkpoint):
    model = mxlib.from_pretrained(_path(layout, gpt_oss_checkpoint))
    assert model.mxlib_info.format == layout
    ids = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    before = _quantized_entries(model)
    assert before, "no quantized entries found"
    for cast, dtype in ((lambda m: m.half(), torch.float16), (lambda m: m.float(), torch.float32)):
        cast(model)
        after = _quantized_entries(model)
        assert sorted(after) == sorted(before)
        for k in before:
            assert after[k].dtype == before[k].dtype, (k, after[k].dtype, before[k].dtype)
            assert torch.equal(_bytes(after[k]), _bytes(before[k])), k
        out = model(input_ids=ids).logits
        assert out.dtype == dtype and bool(torch.isfinite(out).all())
    model.to(torch.bfloat16)
    assert model(input_ids=ids).logits.dtype == torch.bfloat16


@pytest.mark.parametrize("layout", LAYOUTS)
@torch.no_grad()
def test_float_round_trip_and_save_after_cast(layout, gpt_oss_checkpoint, tmp_path):
    path = _path(layout, gpt_oss_checkpoint)
    model = mxlib.from_pretrained(path)
    # transformers' .to(bfloat16) also casts RoPE's fp32 inv_freq (every transformers model does): the reference
    # takes that cast too, so that only what mxlib holds is compared
    model.to(torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1))
    ref = model(input_ids=ids).logits
    model.save_pretrained(tmp_path / "as_loaded")
    model.float()
    model.save_pretrained(tmp_path / "after_float")
    a, b = _stored(tmp_path / "as_loaded"), _stored(tmp_path / "after_float")
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(_bytes(a[name]), _bytes(b[name])), name
    # the checkpoint's own scale bytes: every scale the save writes is the source's, where the source stored it
    source = _stored(path)
    for name, t in b.items():
        if "scale" in name and name in source and source[name].dtype == t.dtype and source[name].numel() == t.numel():
            if "input" not in name:  # input scales: gate and up share one (saving.py's documented exception)
                assert torch.equal(_bytes(source[name]), _bytes(t)), name
    cfg = json.loads((tmp_path / "after_float" / "config.json").read_text())
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"
    model.to(torch.bfloat16)
    assert_bits_equal(model(input_ids=ids).logits, ref)


def test_cast_to_an_unsupported_dtype_is_refused_and_changes_nothing():
    model = mxlib.from_pretrained(INTEROP / FIXTURES["modelopt"] / "checkpoint")
    ex = model.model.layers[0].mlp.experts.experts
    before = {n: b.clone() for n, b in ex.named_buffers()}
    with pytest.raises(TypeError, match="float64"):
        ex.double()
    assert ex.activation_dtype == torch.bfloat16
    for n, b in ex.named_buffers():
        assert b.dtype == before[n].dtype and torch.equal(_bytes(b), _bytes(before[n])), n


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_from_pretrained_dtype(dtype):
    model = mxlib.from_pretrained(INTEROP / FIXTURES["compressed-tensors"] / "checkpoint", dtype=dtype)
    assert model.dtype == dtype
    ex = model.model.layers[0].mlp.experts.experts
    assert ex.activation_dtype == dtype and ex.w13_weight_scale.dtype == torch.float8_e4m3fn
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert model(input_ids=ids).logits.dtype == dtype


def test_from_pretrained_keywords():
    from mxlib.checkpoints.pretrained import resolve_device_map, resolve_dtype

    path = INTEROP / FIXTURES["modelopt"] / "checkpoint"
    assert resolve_dtype("auto") == torch.bfloat16 and resolve_dtype("float16") == torch.float16
    assert resolve_dtype("torch.float32") == torch.float32 and resolve_dtype(torch.bfloat16) == torch.bfloat16
    with pytest.raises(TypeError, match="dtype"):
        resolve_dtype(torch.float64)
    assert resolve_device_map({"": "cpu"}) == torch.device("cpu") and resolve_device_map(None).type == "cpu"
    with pytest.raises(ValueError, match="one device"):
        resolve_device_map({"model.embed_tokens": 0, "lm_head": 1})
    with pytest.raises(ValueError, match="splits"):
        resolve_device_map("balanced")
    with pytest.raises(TypeError, match="unexpected keyword argument 'quantization_config'"):
        mxlib.from_pretrained(path, quantization_config={})
    with pytest.raises(ValueError, match="trust_remote_code=True cannot be honoured"):
        mxlib.from_pretrained(path, trust_remote_code=True)
    with pytest.raises(FileNotFoundError, match="snapshot_download"):
        mxlib.from_pretrained("nvidia/Qwen3-30B-A3B-NVFP4")
    model = mxlib.from_pretrained(path, torch_dtype=torch.float32, device_map={"": "cpu"})
    assert model.dtype == torch.float32


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only refusal")
def test_cuda_on_a_cpu_only_torch_is_named():
    path = INTEROP / FIXTURES["modelopt"] / "checkpoint"
    for call in (
        lambda: mxlib.from_pretrained(path, device_map="cuda"),
        lambda: mxlib.load_quantized_moe(path, device="cuda"),
    ):
        with pytest.raises(ValueError, match="'cuda' asked for, but this torch"):
            call()
