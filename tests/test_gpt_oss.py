"""gpt-oss's native MXFP4 layout (``mxlib.checkpoints.layouts.gpt_oss_mxfp4``) against transformers' own reading of it.

Oracles: transformers' ``integrations.mxfp4.convert_moe_packed_tensors`` (the dequantization its
``Mxfp4Config(dequantize=True)`` loading runs) of the blocks and scales mxlib writes, and
``GptOssForCausalLM.from_pretrained(..., quantization_config=Mxfp4Config(dequantize=True))`` of a
checkpoint in the layout: its bf16 experts equal mxlib's dequantization bit for bit. transformers'
``Mxfp4HfQuantizer`` cannot quantize on this CPU (it needs the ``kernels`` package and the Hub kernel
``kernels-community/gpt-oss-triton-kernels``), so the checkpoints here are mxlib's.
"""

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import GptOssConfig, GptOssForCausalLM, Mxfp4Config
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from mxlib import checkpoints as C
from mxlib import reference as ref
from mxlib.checkpoints.files.safetensors_io import TensorReader
from mxlib.checkpoints.layouts.gpt_oss_mxfp4 import (
    LAYOUT,
    MODULES_TO_NOT_CONVERT,
    deinterleave_gate_up,
    interleave_gate_up,
)
from mxlib.formats import BLOCK_SCHEMES
from mxlib.moe.emulation import ExpertWeights
from mxlib.moe.factory import quantize_expert_weights
from mxlib.moe.quant_config import FusedMoEQuantConfig
from mxlib.moe.schemes import MOE_SCHEMES

from _util import assert_bits_equal, stored_tensors

PREFIX = "model.layers.0.mlp.experts"
W_MXFP4 = MOE_SCHEMES["w_mxfp4"]


def _experts(e, h, i, seed):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(e, h, i, generator=g) * 0.05).to(torch.bfloat16)
    b13 = (torch.randn(e, 2 * i, generator=g) * 0.01).to(torch.bfloat16)
    b2 = (torch.randn(e, h, generator=g) * 0.01).to(torch.bfloat16)
    return w13, w2, b13, b2


def _random_bytes(e, h, i, seed):
    """ExpertWeights of uniformly random bytes: every nibble pair, every finite E8M0 scale (0..254)."""
    g = torch.Generator().manual_seed(seed)
    u8 = torch.uint8

    def rnd(*shape, high=256):
        return torch.randint(0, high, shape, generator=g, dtype=torch.int32).to(u8)

    return ExpertWeights(
        BLOCK_SCHEMES["mxfp4"],
        rnd(e, 2 * i, h // 2),
        rnd(e, 2 * i, h // 32, high=255),
        rnd(e, h, i // 2),
        rnd(e, h, i // 32, high=255),
    )


def _mxlib_dequant(weights: ExpertWeights):
    """mxlib's dequantization in transformers' orientation: ``gate_up [E, H, 2I]`` interleaved, ``down [E, I, H]``."""
    w13 = ref.dequantize_mx(weights.w13_weight, weights.w13_weight_scale, dtype=torch.bfloat16)
    w2 = ref.dequantize_mx(weights.w2_weight, weights.w2_weight_scale, dtype=torch.bfloat16)
    return interleave_gate_up(w13, 1).transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()


# ----------------------------------------------------------------------------- interleave


def test_interleave_order_and_round_trip():
    # rows 0..3 gate, 4..7 up: interleaved 2j is gate j, 2j+1 is up j
    t = torch.arange(2 * 8 * 3).reshape(2, 8, 3)
    inter = interleave_gate_up(t, 1)
    assert inter[:, 0::2].equal(t[:, :4]) and inter[:, 1::2].equal(t[:, 4:])
    assert deinterleave_gate_up(inter, 1).equal(t)
    b = torch.arange(10).reshape(1, 10)
    assert interleave_gate_up(b, -1).tolist() == [[0, 5, 1, 6, 2, 7, 3, 8, 4, 9]]
    with pytest.raises(ValueError, match="even size"):
        interleave_gate_up(torch.zeros(2, 3), 1)


# ----------------------------------------------------------------------------- transformers' dequantization


@pytest.mark.parametrize(
    "e, h, i, source",
    [(3, 64, 32, "quantized"), (2, 96, 64, "random_bytes"), (1, 2880, 2880, "quantized")],
    ids=["tiny", "tiny-every-byte", "gpt-oss-20b-expert"],
)
def test_blocks_match_transformers_dequantization(e, h, i, source):
    """The blocks and scales mxlib writes, dequantized by transformers, equal mxlib's dequantization
    bit for bit (rtol=0, atol=0); 2880 is gpt-oss-20b's hidden and expert intermediate size."""
    if source == "quantized":
        w13, w2, _, _ = _experts(e, h, i, seed=e + h)
        weights = quantize_expert_weights(w13, w2, "w_mxfp4", ops=ref)
    else:
        weights = _random_bytes(e, h, i, seed=7)
    t = LAYOUT.expert_tensors(W_MXFP4, weights, None, None, PREFIX)
    assert t[f"{PREFIX}.gate_up_proj_blocks"].shape == (e, 2 * i, h // 32, 16)
    assert t[f"{PREFIX}.gate_up_proj_scales"].shape == (e, 2 * i, h // 32)
    assert t[f"{PREFIX}.down_proj_blocks"].shape == (e, h, i // 32, 16)
    assert t[f"{PREFIX}.down_proj_scales"].shape == (e, h, i // 32)
    hf13 = convert_moe_packed_tensors(t[f"{PREFIX}.gate_up_proj_blocks"], t[f"{PREFIX}.gate_up_proj_scales"])
    hf2 = convert_moe_packed_tensors(t[f"{PREFIX}.down_proj_blocks"], t[f"{PREFIX}.down_proj_scales"])
    mx13, mx2 = _mxlib_dequant(weights)
    assert_bits_equal(hf13, mx13, "gate_up_proj")
    assert_bits_equal(hf2, mx2, "down_proj")


# ----------------------------------------------------------------------------- round trip and bad input


def _save_layer(tmp_path, tensors, name="model.safetensors"):
    tmp_path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp_path / name))
    return TensorReader(tmp_path)


def test_write_read_round_trip_with_biases(tmp_path):
    e, h, i = 4, 64, 32
    w13, w2, b13, b2 = _experts(e, h, i, seed=1)
    weights = quantize_expert_weights(w13, w2, W_MXFP4, ops=ref)
    t = LAYOUT.expert_tensors(W_MXFP4, weights, None, None, PREFIX, w13_bias=b13, w2_bias=b2)
    # the biases on disk are interleaved like the rows: transformers' GptOssExperts bias [E, 2I]
    assert t[f"{PREFIX}.gate_up_proj_bias"].dtype == torch.bfloat16
    assert t[f"{PREFIX}.gate_up_proj_bias"][:, 0::2].equal(b13[:, :i])
    assert t[f"{PREFIX}.gate_up_proj_bias"][:, 1::2].equal(b13[:, i:])
    assert t[f"{PREFIX}.gate_up_proj_scales"][:, 1::2].equal(weights.w13_weight_scale[:, i:])
    reader = _save_layer(tmp_path, t)
    back, in13, in2 = LAYOUT.read_experts(reader, PREFIX, e, h, i, LAYOUT.read_config(LAYOUT.config_files(W_MXFP4)[0]))
    assert in13 is None and in2 is None
    for name, want in weights.tensors().items():
        assert_bits_equal(getattr(back, name), want, name)
    rb13, rb2 = LAYOUT.read_expert_biases(reader, PREFIX, e, h, i)
    assert_bits_equal(rb13, b13, "w13_bias")
    assert_bits_equal(rb2, b2, "w2_bias")
    # what was read, written again, is the stored bytes
    again = LAYOUT.expert_tensors(W_MXFP4, back, None, None, PREFIX, w13_bias=rb13, w2_bias=rb2)
    for name, want in t.items():
        assert_bits_equal(again[name], want, name)


def test_config_is_gpt_oss_20bs():
    qc, extra = LAYOUT.config_files(W_MXFP4)
    # openai/gpt-oss-20b config.json
    assert qc == {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    assert extra == {} and qc["modules_to_not_convert"] == MODULES_TO_NOT_CONVERT
    desc = LAYOUT.read_config(qc)
    assert desc.format == "gpt-oss-mxfp4" and desc.scheme == W_MXFP4 and desc.activation_scale_mode is None
    assert C.layout_for_method("mxfp4") is LAYOUT and C.LAYOUTS["gpt-oss-mxfp4"] is LAYOUT
    assert C.matches("model.layers.3.mlp.router", desc.exclude) and not C.matches(PREFIX, desc.exclude)
    assert LAYOUT.handles(W_MXFP4) and not LAYOUT.handles(MOE_SCHEMES["w_mxfp4_a_mxfp4"])


def test_bad_config_named():
    with pytest.raises(C.CheckpointError, match=r"quant_method: this layout reads 'mxfp4', found 'quark'"):
        LAYOUT.read_config({"quant_method": "quark"})
    with pytest.raises(C.CheckpointError, match=r"modules_to_not_convert: expected strings, found 3"):
        LAYOUT.read_config({"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head", 3]})
    with pytest.raises(C.CheckpointError, match=r"dequantize: .* found True"):
        LAYOUT.read_config({"quant_method": "mxfp4", "dequantize": True})
    with pytest.raises(ValueError, match="quantize_attention: layout gpt-oss-mxfp4 keeps attention bf16"):
        LAYOUT.config_files(W_MXFP4, quantize_attention=True)
    with pytest.raises(ValueError, match="stores w_mxfp4 only, got w_mxfp4_a_mxfp4"):
        LAYOUT.config_files(MOE_SCHEMES["w_mxfp4_a_mxfp4"])


@pytest.mark.parametrize(
    "name, bad, match",
    [
        ("gate_up_proj_blocks", None, r"missing tensor 'model.layers.0.mlp.experts.gate_up_proj_blocks'"),
        (
            "gate_up_proj_blocks",
            lambda t: t.reshape(t.shape[0], t.shape[1], -1),
            r"'model.layers.0.mlp.experts.gate_up_proj_blocks': expected shape \[2, 64, 2, 16\], found \[2, 64, 32\]",
        ),
        (
            "down_proj_scales",
            lambda t: t.to(torch.int8),
            r"'model.layers.0.mlp.experts.down_proj_scales': expected dtype torch.uint8, found torch.int8",
        ),
        (
            "gate_up_proj_scales",
            lambda t: t.index_fill(2, torch.tensor([1]), 255),
            r"'model.layers.0.mlp.experts.gate_up_proj_scales': invalid E8M0 block scale \(0xFF is NaN\)",
        ),
        (
            "down_proj_bias",
            lambda t: t.float(),
            r"'model.layers.0.mlp.experts.down_proj_bias': expected dtype torch.bfloat16, found torch.float32",
        ),
        ("gate_up_proj_bias", None, r"missing tensor 'model.layers.0.mlp.experts.gate_up_proj_bias'"),
    ],
)
def test_bad_tensors_named(tmp_path, name, bad, match):
    e, h, i = 2, 64, 32
    w13, w2, b13, b2 = _experts(e, h, i, seed=2)
    t = LAYOUT.expert_tensors(W_MXFP4, quantize_expert_weights(w13, w2, W_MXFP4, ops=ref), None, None, PREFIX, b13, b2)
    key = f"{PREFIX}.{name}"
    if bad is None:
        del t[key]
    else:
        t[key] = bad(t[key]).contiguous()
    reader = _save_layer(tmp_path, t)
    desc = LAYOUT.read_config(LAYOUT.config_files(W_MXFP4)[0])
    with pytest.raises(C.CheckpointError, match=match):
        LAYOUT.read_experts(reader, PREFIX, e, h, i, desc)
        LAYOUT.read_expert_biases(reader, PREFIX, e, h, i)


def test_bad_writer_arguments():
    w13, w2, b13, b2 = _experts(2, 64, 32, seed=3)
    weights = quantize_expert_weights(w13, w2, W_MXFP4, ops=ref)
    with pytest.raises(ValueError, match=r"w13_bias: expected shape \[2, 64\] \(from w13_weight\), got \[2, 32\]"):
        LAYOUT.expert_tensors(W_MXFP4, weights, None, None, PREFIX, w13_bias=b13[:, :32])
    with pytest.raises(ValueError, match="stores none"):
        LAYOUT.expert_tensors(W_MXFP4, weights, torch.ones(2), None, PREFIX)
    nv = quantize_expert_weights(w13, w2, "nvfp4", ops=ref)
    with pytest.raises(ValueError, match="stores w_mxfp4 only"):
        LAYOUT.expert_tensors(MOE_SCHEMES["nvfp4"], nv, None, None, PREFIX)
    with pytest.raises(C.CheckpointError, match="hidden_size: MXFP4 blocks of 32 need a multiple of 32, found 48"):
        LAYOUT.read_experts(None, PREFIX, 2, 48, 32, None)


# ----------------------------------------------------------------------------- transformers' from_pretrained

TINY_GPT_OSS = dict(
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    vocab_size=128,
    sliding_window=8,
)


def _transformers_experts(model, layer):
    """``(w13 [E, 2I, H] gate then up, w2 [E, H, I], w13_bias, w2_bias)`` of a transformers GptOssExperts."""
    ex = model.model.layers[layer].mlp.experts
    w13 = deinterleave_gate_up(ex.gate_up_proj.detach().transpose(1, 2), 1).contiguous()
    return (
        w13,
        ex.down_proj.detach().transpose(1, 2).contiguous(),
        deinterleave_gate_up(ex.gate_up_proj_bias.detach(), 1),
        ex.down_proj_bias.detach(),
    )


def _write_native(model, path):
    """A gpt-oss checkpoint of ``model`` in the layout: experts MXFP4 (mxlib), the rest bf16 by name."""
    path.mkdir()
    sd = {
        k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items() if ".mlp.experts." not in k
    }
    weights = []
    for layer in range(model.config.num_hidden_layers):
        w13, w2, b13, b2 = _transformers_experts(model, layer)
        w = quantize_expert_weights(w13, w2, W_MXFP4, ops=ref)
        weights.append(w)
        sd.update(LAYOUT.expert_tensors(W_MXFP4, w, None, None, f"model.layers.{layer}.mlp.experts", b13, b2))
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg["quantization_config"] = LAYOUT.config_files(W_MXFP4)[0]
    cfg["architectures"] = ["GptOssForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg, default=str))
    return weights


@torch.no_grad()
def test_transformers_from_pretrained_dequantize_equals_mxlib(tmp_path):
    """transformers' ``from_pretrained`` with ``Mxfp4Config(dequantize=True)`` of a checkpoint in the
    layout: its bf16 experts equal mxlib's dequantization bit for bit, its biases the stored ones."""
    torch.manual_seed(0)
    cfg = GptOssConfig(**TINY_GPT_OSS)
    model = GptOssForCausalLM(cfg).to(torch.bfloat16).eval()
    for layer in model.model.layers:  # transformers initializes the expert tensors at 0.02
        layer.mlp.experts.gate_up_proj_bias.normal_(0, 0.01)
        layer.mlp.experts.down_proj_bias.normal_(0, 0.01)
    weights = _write_native(model, tmp_path / "ckpt")
    loaded = GptOssForCausalLM.from_pretrained(
        tmp_path / "ckpt", quantization_config=Mxfp4Config(dequantize=True), dtype=torch.bfloat16
    )
    for layer, w in enumerate(weights):
        ex, src = loaded.model.layers[layer].mlp.experts, model.model.layers[layer].mlp.experts
        mx13, mx2 = _mxlib_dequant(w)
        assert_bits_equal(ex.gate_up_proj.detach(), mx13, f"layer {layer} gate_up_proj")
        assert_bits_equal(ex.down_proj.detach(), mx2, f"layer {layer} down_proj")
        assert_bits_equal(ex.gate_up_proj_bias.detach(), src.gate_up_proj_bias.detach(), "gate_up_proj_bias")
        assert_bits_equal(ex.down_proj_bias.detach(), src.down_proj_bias.detach(), "down_proj_bias")
    # and the rest of the model as stored
    assert_bits_equal(loaded.model.layers[1].mlp.router.bias.detach(), model.model.layers[1].mlp.router.bias.detach())


# ----------------------------------------------------------------------------- config values


def test_gpt_oss_20b_config_values():
    from mxlib.models.gpt_oss import gpt_oss_20b_config, swiglu_activation
    from mxlib.models.presets import GPT_OSS_PRESETS, preset_context, preset_layers, preset_model_type
    from mxlib.moe.activations import SWIGLUOAI

    cfg = gpt_oss_20b_config()  # openai/gpt-oss-20b config.json, cut to 4 layers
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts, cfg.num_experts_per_tok) == (
        2880,
        2880,
        32,
        4,
    )
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (64, 8, 64, 201088)
    assert cfg.num_hidden_layers == 4 and cfg.layer_types == ["sliding_attention", "full_attention"] * 2
    assert cfg.sliding_window == 128 and cfg.swiglu_limit == 7.0 and cfg.attention_bias is True
    assert cfg.rope_parameters["rope_type"] == "yarn" and cfg.rope_parameters["factor"] == 32.0
    assert (
        cfg.rope_parameters["rope_theta"] == 150000.0
        and cfg.rope_parameters["original_max_position_embeddings"] == 4096
    )
    assert cfg.architectures == ["GptOssForCausalLM"] and cfg.model_type == "gpt_oss"
    assert swiglu_activation(cfg) is SWIGLUOAI
    assert swiglu_activation(gpt_oss_20b_config(swiglu_limit=5.0)).limit == 5.0
    assert preset_layers("gpt-oss-20b") == 24 and preset_context("gpt-oss-20b") == 131072
    assert preset_model_type("gpt-oss-tiny") == "gpt_oss" and preset_model_type("tiny") == "qwen3_moe"
    tiny = gpt_oss_20b_config(2, **GPT_OSS_PRESETS["gpt-oss-tiny"])
    assert tiny.hidden_size % 32 == 0 and tiny.intermediate_size % 32 == 0 and tiny.layer_types[1] == "full_attention"
    with pytest.raises(ValueError, match=r"layer_types: expected 3 entries \(num_hidden_layers\), got 2"):
        gpt_oss_20b_config(3, layer_types=["full_attention"] * 2)
    with pytest.raises(ValueError, match="model_preset: expected one of"):
        preset_layers("gpt-oss-200b")


# ----------------------------------------------------------------------------- experts against transformers'


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@torch.no_grad()
def test_reference_experts_match_transformers_gpt_oss_experts():
    """mxlib's reference MoE (``torch_moe`` with SWIGLUOAI and the biases, on the de-interleaved weights) against
    transformers' ``GptOssExperts`` on the same bf16 weights and routing. transformers rounds each GEMM, the bias
    sum and the activation to bf16 where mxlib keeps fp32 until one rounding, so the two agree to bf16's
    resolution, not bit for bit: relative error under 1e-2 between them, and mxlib's at most transformers' own
    against a float64 evaluation of the same formula."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssTopKRouter

    from mxlib.moe.activations import SWIGLUOAI
    from mxlib.moe.reference_moe import torch_moe

    cfg = GptOssConfig(**TINY_GPT_OSS)
    g = torch.Generator().manual_seed(5)
    ex, router = GptOssExperts(cfg).to(torch.bfloat16), GptOssTopKRouter(cfg).to(torch.bfloat16)
    for p in (*ex.parameters(), *router.parameters()):
        p.copy_((torch.randn(p.shape, generator=g) * 0.2).to(p.dtype))
    x = (torch.randn(48, cfg.hidden_size, generator=g) * 3).to(torch.bfloat16)
    _, scores, ids = router(x)
    hf = ex(x, ids, scores)
    w13 = deinterleave_gate_up(ex.gate_up_proj.transpose(1, 2), 1)
    w2 = ex.down_proj.transpose(1, 2)
    b13, b2 = deinterleave_gate_up(ex.gate_up_proj_bias, 1), ex.down_proj_bias
    mx = torch_moe(x, w13, w2, scores.float(), ids.to(torch.int32), activation=SWIGLUOAI, w13_bias=b13, w2_bias=b2)
    # float64: the formula of transformers' _apply_gate on the interleaved columns
    gu = torch.einsum("mh,ehn->men", x.double(), ex.gate_up_proj.double()) + ex.gate_up_proj_bias.double()
    gate, up = gu[..., ::2].clamp(max=7.0), gu[..., 1::2].clamp(-7.0, 7.0)
    act = (up + 1) * gate * torch.sigmoid(1.702 * gate)
    out = torch.einsum("mei,eih->meh", act, ex.down_proj.double()) + ex.down_proj_bias.double()
    f64 = (out.gather(1, ids[..., None].expand(-1, -1, cfg.hidden_size)) * scores.double()[..., None]).sum(1)
    assert mx.dtype == hf.dtype == torch.bfloat16
    assert _rel(mx, hf) < 1e-2, _rel(mx, hf)
    assert _rel(mx, f64) <= _rel(hf, f64), (_rel(mx, f64), _rel(hf, f64))
    assert (gu[..., ::2] > 7).any() and (gu[..., 1::2].abs() > 7).any()  # the clamps took part


def test_scheme_support_names_why_a_scheme_is_skipped():
    from mxlib.models.gpt_oss import gpt_oss_layout_for, scheme_support

    rows = scheme_support()
    assert [r["scheme"] for r in rows] == list(MOE_SCHEMES)
    assert [r["scheme"] for r in rows if r["runs"]] == ["w_mxfp4"]
    assert gpt_oss_layout_for("w_mxfp4") == ("gpt-oss-mxfp4", "")
    layout, why = gpt_oss_layout_for("nvfp4")
    assert layout is None and "expert biases in nvfp4's format" in why and "['w_mxfp4']" in why
    assert all(r["skipped_because"] for r in rows if not r["runs"])


def test_projection_is_the_expert_rows_as_stored():
    e, h, i = 3, 64, 32
    w13, w2, _, _ = _experts(e, h, i, seed=4)
    weights = quantize_expert_weights(w13, w2, W_MXFP4, ops=ref)
    t = LAYOUT.expert_tensors(W_MXFP4, weights, None, None, PREFIX)
    for proj, rows in (("gate_proj", slice(0, i)), ("up_proj", slice(i, 2 * i))):
        name, packed, scales = LAYOUT.projection(t.__getitem__, PREFIX, 1, proj)
        assert name == f"{PREFIX}.gate_up_proj_blocks"
        assert_bits_equal(packed, weights.w13_weight[1, rows])
        assert_bits_equal(scales, weights.w13_weight_scale[1, rows])
    _, packed, scales = LAYOUT.projection(t.__getitem__, PREFIX, 2, "down_proj")
    assert_bits_equal(packed, weights.w2_weight[2])
    assert_bits_equal(scales, weights.w2_weight_scale[2])
    with pytest.raises(ValueError, match="proj: expected gate_proj, up_proj or down_proj, got 'w1'"):
        LAYOUT.projection(t.__getitem__, PREFIX, 0, "w1")


# ----------------------------------------------------------------------------- the family round trip


@pytest.fixture(scope="module")
def tiny_gpt_oss():
    from mxlib.models.gpt_oss import dummy_gpt_oss, gpt_oss_20b_config
    from mxlib.models.presets import GPT_OSS_PRESETS

    cfg = gpt_oss_20b_config(2, **GPT_OSS_PRESETS["gpt-oss-tiny"])
    model = dummy_gpt_oss(cfg, seed=0)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    return model, ids


@torch.no_grad()
def _w_mxfp4_in_memory(model):
    """The model with mxlib's W_MXFP4 emulation experts swapped in, quantized in memory (no checkpoint)."""
    import copy

    from mxlib.models.moe_models import expert_activation, expert_biases, expert_weights, swap_experts
    from mxlib.moe.factory import make_emulation_experts

    m = copy.deepcopy(model)

    def make(i):
        w13, w2 = expert_weights(model, i)
        b13, b2 = expert_biases(model, i)
        weights = quantize_expert_weights(w13, w2, W_MXFP4)
        return make_emulation_experts(
            W_MXFP4, weights, activation=expert_activation(model), w13_bias=b13, w2_bias=b2, backend="torch"
        )

    swap_experts(m, make)
    return m


def test_gpt_oss_family_registered():
    from mxlib.models.families import GPT_OSS, family_of
    from mxlib.models.gpt_oss import gpt_oss_20b_config

    cfg = gpt_oss_20b_config()
    assert family_of(cfg) is GPT_OSS and GPT_OSS.architecture == "GptOssForCausalLM"
    assert (GPT_OSS.num_experts(cfg), GPT_OSS.intermediate_size(cfg), GPT_OSS.top_k(cfg)) == (32, 2880, 4)
    assert GPT_OSS.moe_layer_indices(cfg) == [0, 1, 2, 3] and GPT_OSS.router_attr == "router"
    assert GPT_OSS.experts_orientation == "interleaved_columns" and GPT_OSS.expert_biases
    assert GPT_OSS.activation == "swigluoai" and GPT_OSS.checkpoint_layout == "gpt-oss-mxfp4"


@torch.no_grad()
def test_swapped_bf16_experts_match_transformers(tiny_gpt_oss):
    """mxlib's experts holding the bf16 weights (no quantization), SWIGLUOAI and the biases, in the place of
    transformers' GptOssExperts: every MoE block (router + experts) on the block input the bf16 model gives it
    agrees with transformers' own block within bf16's resolution (SQNR > 40 dB; measured 44 dB) and is at least
    as close to the block in float32 (measured 48 dB against transformers' 45: mxlib rounds once where
    transformers rounds each GEMM and the bias sum). Compared block by block: through the whole model one
    near-tied router logit (a gap of 2**-11) is enough to send a token to another expert in a later layer."""
    import copy

    from mxlib import analysis as A
    from mxlib.models.moe_models import expert_activation, expert_biases, expert_weights, swap_experts
    from mxlib.moe.base import TritonExperts

    model, ids = tiny_gpt_oss
    m, f32 = copy.deepcopy(model), copy.deepcopy(model).float()

    def make(i):
        w13, w2 = expert_weights(model, i)
        b13, b2 = expert_biases(model, i)
        config = FusedMoEQuantConfig(activation=expert_activation(model))
        return TritonExperts(w13.clone(), w2.clone(), config, backend="torch", w13_bias=b13, w2_bias=b2)

    swap_experts(m, make)
    for li, layer in enumerate(model.model.layers):
        seen = []
        handle = layer.mlp.register_forward_pre_hook(lambda mod, args: seen.append(args[0].clone()))
        model(input_ids=ids)
        handle.remove()
        x = seen[0]
        hf, mx = layer.mlp(x)[0].float(), m.model.layers[li].mlp(x)[0].float()
        ref32 = f32.model.layers[li].mlp(x.float())[0]
        assert A.sqnr_db(mx, hf) > 40.0, (li, A.sqnr_db(mx, hf))
        assert A.sqnr_db(mx, ref32) >= A.sqnr_db(hf, ref32), (li, A.sqnr_db(mx, ref32), A.sqnr_db(hf, ref32))


@torch.no_grad()
def test_family_round_trip_native_mxfp4(tiny_gpt_oss, tmp_path):
    """calibrate, write gpt-oss's native MXFP4 (the family's own layout, by default), load: the same logits as
    the in-memory W_MXFP4 model bit for bit; transformers' from_pretrained (Mxfp4Config(dequantize=True)) of the
    same checkpoint: its experts are the same dequantized bf16 weights, run by transformers' own (bf16-rounding)
    GptOssExperts, so its logits agree within bf16's resolution (SQNR > 35 dB)."""
    from mxlib import analysis as A
    from mxlib.checkpoints import inspect_checkpoint, load_quantized_qwen3_moe, write_quantized_checkpoint
    from mxlib.models.calibration import calibrate

    model, ids = tiny_gpt_oss
    cal = calibrate(model, ids)
    assert all(int(lc.tokens.sum()) == ids.numel() * model.config.num_experts_per_tok for lc in cal.layers)
    path = write_quantized_checkpoint(model, "w_mxfp4", tmp_path / "ckpt", cal)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["quantization_config"] == LAYOUT.config_files(W_MXFP4)[0] and cfg["architectures"] == [
        "GptOssForCausalLM"
    ]
    report = inspect_checkpoint(path)
    assert report.layout_ok and report.scheme == "w_mxfp4", report.problems
    assert [r["pattern"] for r in report.quantized["experts"]] == [
        "model.layers.*.mlp.experts.down_proj",
        "model.layers.*.mlp.experts.gate_up_proj",
    ]
    loaded, info = load_quantized_qwen3_moe(path, backend="torch")
    assert info["format"] == "gpt-oss-mxfp4" and type(loaded).__name__ == "GptOssForCausalLM"
    mem = _w_mxfp4_in_memory(model)
    got, want = loaded(input_ids=ids).logits, mem(input_ids=ids).logits
    assert_bits_equal(got, want, "logits")
    hf = GptOssForCausalLM.from_pretrained(path, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.bfloat16)
    hf_logits = hf(input_ids=ids).logits.float()
    sqnr = A.sqnr_db(hf_logits, got.float())
    assert sqnr > 35.0, sqnr
    # the negative control: the bf16 model is further from the loaded one than transformers' reading is
    assert A.sqnr_db(model(input_ids=ids).logits.float(), got.float()) < sqnr


def test_writer_refuses_a_layout_without_expert_biases(tiny_gpt_oss, tmp_path):
    from mxlib.checkpoints import write_quantized_checkpoint

    model, _ = tiny_gpt_oss
    with pytest.raises(ValueError, match=r"layout: quark stores no expert biases, which GptOssForCausalLM's experts"):
        write_quantized_checkpoint(model, "w_mxfp4_a_mxfp4", tmp_path / "x")
    with pytest.raises(ValueError, match=r"layout: modelopt stores no expert biases"):
        write_quantized_checkpoint(model, "nvfp4", tmp_path / "y", layout="modelopt")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_e2e_parameters_refuse_a_skipped_scheme_for_gpt_oss():
    from mxlib.studies.steps import check_e2e_parameters

    p = check_e2e_parameters(scheme="w_mxfp4", model_preset="gpt-oss-tiny")
    assert p.model_preset == "gpt-oss-tiny" and p.scheme == W_MXFP4
    with pytest.raises(ValueError, match=r"scheme: nvfp4 is skipped for gpt-oss: no checkpoint layout stores"):
        check_e2e_parameters(scheme="nvfp4", model_preset="gpt-oss-20b")
    with pytest.raises(ValueError, match=r"model_preset: expected one of \[.*'gpt-oss-20b', 'gpt-oss-tiny'\]"):
        check_e2e_parameters(scheme="w_mxfp4", model_preset="gpt-oss-120b")


@torch.no_grad()
def test_loader_names_a_missing_bias(tiny_gpt_oss, tmp_path):
    from safetensors.torch import load_file

    from mxlib.checkpoints import load_quantized_qwen3_moe, write_quantized_checkpoint

    model, _ = tiny_gpt_oss
    path = write_quantized_checkpoint(model, "w_mxfp4", tmp_path / "ckpt")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    name = "model.layers.1.mlp.experts.down_proj_bias"
    shard = path / index["weight_map"].pop(name)
    tensors = load_file(str(shard))
    del tensors[name]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(C.CheckpointError, match=r"missing tensor 'model.layers.1.mlp.experts.down_proj_bias'"):
        load_quantized_qwen3_moe(path, backend="torch")


@torch.no_grad()
def test_loaded_model_saves_in_the_native_layout(tiny_gpt_oss, tmp_path):
    """save_pretrained of a loaded gpt-oss model writes the checkpoint it was loaded from, tensor for tensor
    (the biases included), and that loads to the same logits."""

    from mxlib.checkpoints import load_quantized_qwen3_moe, write_quantized_checkpoint

    model, ids = tiny_gpt_oss
    path = write_quantized_checkpoint(model, "w_mxfp4", tmp_path / "ckpt")
    loaded, _ = load_quantized_qwen3_moe(path, backend="torch")
    loaded.save_pretrained(tmp_path / "saved")

    a, b = stored_tensors(path), stored_tensors(tmp_path / "saved")
    assert sorted(a) == sorted(b)
    for name in a:
        assert_bits_equal(b[name], a[name], name)
    again, _ = load_quantized_qwen3_moe(tmp_path / "saved", backend="torch")
    assert_bits_equal(again(input_ids=ids).logits, loaded(input_ids=ids).logits, "logits")
