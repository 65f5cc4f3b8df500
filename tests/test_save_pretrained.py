"""save_pretrained / state_dict of quantized models: load -> save_pretrained -> load gives the same bits.

For each layout (ModelOpt NVFP4, Quark OCP MX with dynamic MX and static FP8 activations,
compressed-tensors NVFP4) a tiny Qwen3-MoE checkpoint is written by ``write_quantized_checkpoint``,
loaded, saved with transformers' ``save_pretrained`` entry point and loaded again. The independent
side reads both folders with ``safetensors`` directly (every file, not through the index): every
stored tensor byte-equal, the same config files; the reloaded model's logits bit-equal.
"""

import json
import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mxlib import checkpoints as C
from mxlib.checkpoints.files import safetensors_io
from mxlib.models.calibration import calibrate
from mxlib.models.qwen3 import dummy_qwen3_moe, expert_weights, qwen3_30b_a3b_config, swap_experts
from mxlib.moe import make_emulation_experts, quantize_expert_weights

from _util import TINY_QWEN3, assert_bits_equal, tiny_calibrated

CASES = [  # (scheme, layout)
    ("nvfp4", "modelopt"),
    ("w_mxfp4_a_mxfp4", "quark"),
    ("w_mxfp6_e3m2_a_fp8", "quark"),
    ("nvfp4", "compressed-tensors"),
]


@pytest.fixture(scope="module")
def tiny():
    return tiny_calibrated(1)


@pytest.fixture(scope="module")
def loaded(tiny, tmp_path_factory):
    """A ModelOpt NVFP4 checkpoint and the model loaded from it (left unchanged by the tests using it)."""
    model, cal, _ = tiny
    first = C.write_quantized_checkpoint(model, "nvfp4", tmp_path_factory.mktemp("loaded") / "first", cal)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return first, C.load_quantized_qwen3_moe(first, backend="torch")[0]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the emulation's scale-unification notes
        yield


def _stored(path):
    """Every tensor of every safetensors file in ``path``, read by safetensors (name -> tensor)."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for name in h.keys():
                assert name not in out, name
                out[name] = h.get_tensor(name)
    return out


def _assert_same_tensors(a, b):
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))[:5]
    for name in a:
        x, y = a[name], b[name]
        assert x.dtype == y.dtype and x.shape == y.shape, (name, x.dtype, y.dtype, x.shape, y.shape)
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), name


def _rewrite(folder, change):
    """Rewrite a checkpoint's tensors as ``change(tensors)`` returns them (shards and index anew)."""
    tensors = _stored(folder)
    for f in [*folder.glob("*.safetensors"), folder / safetensors_io.INDEX_NAME]:
        f.unlink()
    safetensors_io.write_shards(change(tensors), folder, 20_000)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _first(tiny, tmp_path, scheme, layout, **kw):
    model, cal, _ = tiny
    return C.write_quantized_checkpoint(model, scheme, tmp_path / "first", cal, shard_bytes=20_000, layout=layout, **kw)


@pytest.mark.parametrize("scheme,layout", CASES)
def test_load_save_load_bit_for_bit(tiny, tmp_path, scheme, layout):
    ids = tiny[2]
    first = _first(tiny, tmp_path, scheme, layout)
    m1, info1 = C.load_quantized_qwen3_moe(first, backend="torch")
    m1.save_pretrained(tmp_path / "second", max_shard_size="30KB")
    second = tmp_path / "second"
    assert len(list(second.glob("*.safetensors"))) > 1  # max_shard_size honoured
    _assert_same_tensors(_stored(first), _stored(second))
    cfg1, cfg2 = (json.loads((p / "config.json").read_text()) for p in (first, second))
    assert cfg2["quantization_config"] == cfg1["quantization_config"]
    assert cfg2 == cfg1  # the model config as well
    assert (first / "hf_quant_config.json").exists() == (layout == "modelopt")
    if layout == "modelopt":
        assert (second / "hf_quant_config.json").read_text() == (first / "hf_quant_config.json").read_text()
    info2 = C.read_quant_config(second)
    assert (
        (info2.format, info2.scheme, info2.exclude)
        == (info1.format, info1.scheme, info1.exclude)
        == (
            layout,
            info1.scheme,
            info1.exclude,
        )
    )
    assert info1.scheme.name == scheme
    m2, _ = C.load_quantized_qwen3_moe(second, backend="torch")
    assert_bits_equal(_logits(m2, ids), _logits(m1, ids), f"{layout} logits")
    # and once more from the reloaded model: the same folder contents again
    m2.save_pretrained(tmp_path / "third")
    _assert_same_tensors(_stored(first), _stored(tmp_path / "third"))


@pytest.mark.parametrize("scheme,layout", CASES)
def test_state_dict_carries_the_checkpoint(tiny, tmp_path, scheme, layout):
    model, cal, ids = tiny
    first = _first(tiny, tmp_path, scheme, layout)
    m1, _ = C.load_quantized_qwen3_moe(first, backend="torch")
    sd = m1.state_dict()
    stored = _stored(first)
    # the state dict holds every stored tensor, under the stored name, with the stored bytes
    _assert_same_tensors({n: t.contiguous() for n, t in sd.items()}, stored)
    # into a model loaded from another checkpoint of the same shapes (other weights and scales)
    other_bf16 = dummy_qwen3_moe(model.config, seed=7, expert_spread=0.5)
    other = C.write_quantized_checkpoint(
        other_bf16, scheme, tmp_path / "other", calibrate(other_bf16, ids), layout=layout
    )
    m3, _ = C.load_quantized_qwen3_moe(other, backend="torch")
    assert not torch.equal(_logits(m3, ids), _logits(m1, ids))
    result = m3.load_state_dict(sd, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert_bits_equal(_logits(m3, ids), _logits(m1, ids), f"{layout} logits after load_state_dict")
    _assert_same_tensors({n: t.contiguous() for n, t in m3.state_dict().items()}, stored)


def test_pickled_and_copied_models_keep_their_save_pretrained(loaded, tmp_path):
    import copy
    import io

    first, m1 = loaded
    buf = io.BytesIO()
    torch.save(m1, buf)  # the whole model pickled
    buf.seek(0)
    for n, m in (("pickled", torch.load(buf, weights_only=False)), ("copied", copy.deepcopy(m1))):
        assert m.save_pretrained.model is m
        m.save_pretrained(tmp_path / n)
        _assert_same_tensors(_stored(first), _stored(tmp_path / n))


def test_load_state_dict_names_missing_and_extra_keys(loaded):
    m1 = loaded[1]
    sd = m1.state_dict()
    gone = "model.layers.1.mlp.experts.2.up_proj.weight_scale"
    short = {n: t for n, t in sd.items() if n != gone}
    with pytest.raises(RuntimeError, match=gone.replace(".", r"\.")):
        m1.load_state_dict(short)
    extra = dict(sd, **{"model.layers.0.mlp.experts.9.gate_proj.weight": sd[gone.replace("weight_scale", "weight")]})
    with pytest.raises(RuntimeError, match=r"Unexpected key.*experts\.9\.gate_proj\.weight"):
        m1.load_state_dict(extra)
    bad = dict(sd, **{gone: sd[gone].view(torch.uint8)})
    with pytest.raises(C.CheckpointError, match=gone.replace(".", r"\.") + ".*dtype"):
        m1.load_state_dict(bad)
    # strict=False reports the missing expert tensors and leaves that layer as it was
    again = m1.load_state_dict(short, strict=False)
    assert gone in again.missing_keys


def test_hand_built_model_refuses_then_saves_after_attach(tiny, tmp_path):
    """Experts swapped in by hand: transformers' save_pretrained is refused, naming why; with a layout
    attached, the saved folder equals what write_quantized_checkpoint writes for the same bf16 model."""
    model, cal, ids = tiny
    scheme = "w_mxfp6_e3m2_a_fp8"
    reference = C.write_quantized_checkpoint(model, scheme, tmp_path / "ref", cal)
    built = dummy_qwen3_moe(model.config, seed=1, expert_spread=0.5)

    def make(layer):
        w13, w2 = expert_weights(built, layer)
        in13, in2 = cal.input_scales(layer, "fp8")
        weights = quantize_expert_weights(w13, w2, scheme)
        return make_emulation_experts(scheme, weights, in13, in2, backend="torch")

    swap_experts(built, make)
    with pytest.raises(ValueError, match="attach_checkpoint_layout"):
        built.save_pretrained(tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    desc = C.attach_checkpoint_layout(built)
    assert desc.format == "quark" and desc.scheme.name == scheme
    built.save_pretrained(tmp_path / "built")
    _assert_same_tensors(_stored(reference), _stored(tmp_path / "built"))
    assert (
        json.loads((tmp_path / "built" / "config.json").read_text())["quantization_config"]
        == json.loads((reference / "config.json").read_text())["quantization_config"]
    )
    loaded, _ = C.load_quantized_qwen3_moe(tmp_path / "built", backend="torch")
    assert_bits_equal(_logits(loaded, ids), _logits(built, ids), "hand-built logits")


def test_hand_built_quantized_attention(tiny, tmp_path):
    """Hand-built NVFP4 experts and attention (EmulatedLinear, which holds the encode input scale
    1 / input_scale): saved with a decode input_scale whose reciprocal is that encode scale."""
    from mxlib.moe import make_emulated_linear, quantize_linear_weight
    from mxlib.moe.linear import linear_input_amax

    model, cal, ids = tiny
    names = [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in C.ATTENTION_PROJS]
    amax = linear_input_amax(model, ids, names)
    reference = C.write_quantized_checkpoint(
        model, "nvfp4", tmp_path / "ref", cal, quantize_attention=True, linear_input_amax=amax
    )
    built = dummy_qwen3_moe(model.config, seed=1, expert_spread=0.5)

    def make(layer):
        w13, w2 = expert_weights(built, layer)
        weights = quantize_expert_weights(w13, w2, "nvfp4")
        return make_emulation_experts("nvfp4", weights, *cal.input_scales(layer, "nvfp4"), backend="torch")

    swap_experts(built, make)
    modules = dict(built.named_modules())
    for n in names:
        w = quantize_linear_weight(modules[n].weight.detach(), "nvfp4")
        em = make_emulated_linear("nvfp4", w, (amax[n].float() / 2688.0).reshape(1), backend="torch")
        parent, _, child = n.rpartition(".")
        setattr(modules[parent], child, em)
    assert C.attach_checkpoint_layout(built).format == "modelopt"
    built.save_pretrained(tmp_path / "built")
    ref, got = _stored(reference), _stored(tmp_path / "built")
    scales = [f"{n}.input_scale" for n in names]
    _assert_same_tensors(
        {k: v for k, v in ref.items() if k not in scales}, {k: v for k, v in got.items() if k not in scales}
    )
    for k in scales:  # the encode scale the emulation uses, exactly
        assert torch.equal(1.0 / got[k], 1.0 / ref[k]) and got[k].dtype == torch.float32, k
    loaded, _ = C.load_quantized_qwen3_moe(tmp_path / "built", backend="torch")
    assert_bits_equal(_logits(loaded, ids), _logits(built, ids), "hand-built attention logits")


def test_hand_built_layout_refusals(tiny):
    model, cal, _ = tiny
    built = dummy_qwen3_moe(model.config, seed=1)

    def make(layer, scheme):
        w13, w2 = expert_weights(built, layer)
        in13, in2 = cal.input_scales(layer, "nvfp4")
        return make_emulation_experts(scheme, quantize_expert_weights(w13, w2, scheme), in13, in2, backend="torch")

    swap_experts(built, lambda layer: make(layer, "nvfp4"))
    with pytest.raises(ValueError, match="compressed-tensors stores encode global scales"):
        C.attach_checkpoint_layout(built, layout="compressed-tensors")
    with pytest.raises(ValueError, match="quark does not store scheme nvfp4"):
        C.attach_checkpoint_layout(built, layout="quark")
    swap_experts(built, lambda layer: make(layer, "nvfp4" if layer == 0 else "w_mxfp4_a_mxfp4"))
    with pytest.raises(ValueError, match="several schemes"):
        C.attach_checkpoint_layout(built)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(safe_serialization=False), "safe_serialization=False cannot be honoured"),
        (dict(push_to_hub=True), "push_to_hub=True cannot be honoured"),
        (dict(variant="fp4"), "variant='fp4' cannot be honoured"),
        (dict(token="hf_x"), "token='hf_x' cannot be honoured"),
        (dict(save_original_format=False), "save_original_format=False cannot be honoured"),
        (dict(distributed_checkpoint=True), "distributed_checkpoint=True cannot be honoured"),
        (dict(max_shard_size="lots"), "max_shard_size: expected a positive int"),
        (dict(save_function=print), r"unexpected keyword arguments \['save_function'\]"),
    ],
)
def test_save_pretrained_refuses_what_it_cannot_honour(loaded, tmp_path, kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        loaded[1].save_pretrained(tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


def test_save_pretrained_state_dict_argument(loaded, tmp_path):
    first, m1 = loaded
    sd = m1.state_dict()
    m1.save_pretrained(tmp_path / "out", state_dict=sd)
    _assert_same_tensors(_stored(first), _stored(tmp_path / "out"))
    name = "model.layers.0.mlp.experts.1.down_proj.weight_scale_2"
    with pytest.raises(C.CheckpointError, match=f"missing key {name!r}"):
        m1.save_pretrained(tmp_path / "short", state_dict={n: t for n, t in sd.items() if n != name})
    with pytest.raises(C.CheckpointError, match=rf"state_dict\[{name!r}\]: expected torch.float32"):
        m1.save_pretrained(tmp_path / "half", state_dict=dict(sd, **{name: sd[name].half()}))
    assert not (tmp_path / "short").exists() and not (tmp_path / "half").exists()


def test_bf16_experts_swapped_in_refuse_to_save(tiny, tmp_path):
    """transformers' save_pretrained would drop experts swapped in unquantized too."""
    from mxlib.moe import TritonExperts

    built = dummy_qwen3_moe(tiny[0].config, seed=1)
    swap_experts(built, lambda layer: TritonExperts(*expert_weights(built, layer), backend="torch"))
    with pytest.raises(ValueError, match="without them"):
        built.save_pretrained(tmp_path / "out")
    with pytest.raises(ValueError, match="every layer must hold quantized mxlib experts"):
        C.attach_checkpoint_layout(built)
    assert not (tmp_path / "out").exists()


def test_save_pretrained_destination_rules(tiny, tmp_path):
    first = _first(tiny, tmp_path, "w_mxfp4_a_mxfp4", "quark")
    m1, _ = C.load_quantized_qwen3_moe(first, backend="torch")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="not an mxlib checkpoint"):
        m1.save_pretrained(mine)
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    m1.save_pretrained(tmp_path / "out", is_main_process=False)
    assert not (tmp_path / "out").exists()
    m1.save_pretrained(first)  # over the checkpoint it was loaded from (an mxlib checkpoint): replaced whole
    assert C.read_quant_config(first).format == "quark"


def test_failed_write_leaves_no_folder(tiny, tmp_path, monkeypatch):
    first = _first(tiny, tmp_path, "nvfp4", "compressed-tensors")
    m1, _ = C.load_quantized_qwen3_moe(first, backend="torch")
    calls = []

    def failing_save_file(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            raise OSError(28, "No space left on device (injected)")
        save_file(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors_io, "save_file", failing_save_file)
    with pytest.raises(OSError, match="injected"):
        m1.save_pretrained(tmp_path / "out", max_shard_size=20_000)
    assert len(calls) == 2  # it failed mid-write, after one shard was on disk
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["first"]  # no temporary folder either


def test_source_tensors_not_held_refuse_the_save(tiny, tmp_path):
    """A source tensor the loader does not read (a kv-cache scale) would be dropped: the save raises."""
    first = _first(tiny, tmp_path, "nvfp4", "modelopt")
    _rewrite(first, lambda t: dict(t, **{"model.layers.0.self_attn.k_proj.k_scale": torch.tensor(0.5)}))
    m1, _ = C.load_quantized_qwen3_moe(first, backend="torch")
    with pytest.raises(C.CheckpointError, match=r"does not hold.*k_proj\.k_scale"):
        m1.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_source_dtypes_and_shapes_are_kept(tiny, tmp_path):
    """amd-quark 0.13 stores static FP8 input scales as bf16: saved again as bf16, byte for byte;
    a layer cut at load time (num_hidden_layers) saves that many layers."""
    ids = tiny[2]
    first = _first(tiny, tmp_path, "w_mxfp6_e3m2_a_fp8", "quark")
    _rewrite(first, lambda t: {n: x.to(torch.bfloat16) if n.endswith("input_scale") else x for n, x in t.items()})
    m1, _ = C.load_quantized_qwen3_moe(first, backend="torch")
    m1.save_pretrained(tmp_path / "second")
    stored = _stored(tmp_path / "second")
    assert stored["model.layers.0.mlp.experts.1.down_proj.input_scale"].dtype == torch.bfloat16
    _assert_same_tensors(_stored(first), stored)
    m2, _ = C.load_quantized_qwen3_moe(tmp_path / "second", backend="torch")
    assert_bits_equal(_logits(m2, ids), _logits(m1, ids), "bf16 input scales")
    one, _ = C.load_quantized_qwen3_moe(first, num_hidden_layers=1, backend="torch")
    one.save_pretrained(tmp_path / "one")
    assert json.loads((tmp_path / "one" / "config.json").read_text())["num_hidden_layers"] == 1
    kept = {n: t for n, t in _stored(first).items() if not n.startswith("model.layers.1.")}
    _assert_same_tensors(kept, _stored(tmp_path / "one"))


def test_quantized_attention_round_trip(tiny, tmp_path):
    """Quantized attention projections (EmulatedLinear) save in the layout too."""
    from mxlib.moe.linear import linear_input_amax

    model, cal, ids = tiny
    names = [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in C.ATTENTION_PROJS]
    amax = linear_input_amax(model, ids, names)
    first = _first(tiny, tmp_path, "nvfp4", "modelopt", quantize_attention=True, linear_input_amax=amax)
    m1, _ = C.load_quantized_qwen3_moe(first, backend="torch")
    assert type(m1.model.layers[0].self_attn.q_proj).__name__ == "EmulatedLinear"
    m1.save_pretrained(tmp_path / "second")
    _assert_same_tensors(_stored(first), _stored(tmp_path / "second"))
    m2, _ = C.load_quantized_qwen3_moe(tmp_path / "second", backend="torch")
    assert_bits_equal(_logits(m2, ids), _logits(m1, ids), "quantized attention logits")


def test_excluded_layer_keeps_bf16_experts(tiny, tmp_path):
    """A layer the config excludes holds bf16 experts: saved under the per-expert bf16 names."""
    ids = tiny[2]
    first = _first(tiny, tmp_path, "w_mxfp4_a_mxfp4", "quark")
    cfg = json.loads((first / "config.json").read_text())
    cfg["quantization_config"]["exclude"].append("re:model\\.layers\\.1\\.mlp\\.experts\\..*")
    (first / "config.json").write_text(json.dumps(cfg))
    # layer 1 holds the bf16 model's experts under the per-expert names the loader reads
    w13, w2 = expert_weights(tiny[0], 1)
    i = w2.shape[2]
    bf16 = {}
    for x in range(w13.shape[0]):
        for proj, w in (("gate_proj", w13[x, :i]), ("up_proj", w13[x, i:]), ("down_proj", w2[x])):
            bf16[f"model.layers.1.mlp.experts.{x}.{proj}.weight"] = w.contiguous()
    _rewrite(
        first, lambda t: {**{n: x for n, x in t.items() if not n.startswith("model.layers.1.mlp.experts.")}, **bf16}
    )
    m1, _ = C.load_quantized_qwen3_moe(first, backend="torch")
    m1.save_pretrained(tmp_path / "second")
    _assert_same_tensors(_stored(first), _stored(tmp_path / "second"))
    m2, _ = C.load_quantized_qwen3_moe(tmp_path / "second", backend="torch")
    assert_bits_equal(_logits(m2, ids), _logits(m1, ids), "excluded layer logits")


def test_fp4_kernel_layout_saves_the_checkpoint_layout(tmp_path):
    """Experts built for the fused backend hold only the FP4 kernel's weight layout (prepared at
    construction): the state dict and save_pretrained give back the checkpoint's bytes (CPU: no forward)."""
    cfg = qwen3_30b_a3b_config(num_hidden_layers=1, **dict(TINY_QWEN3, hidden_size=128, moe_intermediate_size=128))
    model = dummy_qwen3_moe(cfg, seed=3)
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(0))
    for scheme in ("nvfp4", "w_mxfp4_a_mxfp4"):
        first = C.write_quantized_checkpoint(model, scheme, tmp_path / scheme / "first", calibrate(model, ids))
        m1, _ = C.load_quantized_qwen3_moe(first, backend="fused")
        ex = m1.model.layers[0].mlp.experts.experts
        assert ex.prepared is not None and "w13_weight_packed" not in ex._buffers
        m1.save_pretrained(tmp_path / scheme / "second")
        _assert_same_tensors(_stored(first), _stored(tmp_path / scheme / "second"))
        m1.load_state_dict(m1.state_dict())
        assert m1.model.layers[0].mlp.experts.experts.prepared is not None
        _assert_same_tensors({n: t.contiguous() for n, t in m1.state_dict().items()}, _stored(first))


@pytest.mark.gpu
def test_fused_fp4_layout_on_cuda_saves_the_checkpoint_layout(tmp_path):
    """On CUDA with the fused backend the experts hold only the FP4 kernel's weight layout: the
    state dict and save_pretrained give back the checkpoint's bytes, and load_state_dict re-prepares."""
    cfg = qwen3_30b_a3b_config(num_hidden_layers=2, **dict(TINY_QWEN3, hidden_size=128, moe_intermediate_size=128))
    model = dummy_qwen3_moe(cfg, seed=3)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    for scheme in ("nvfp4", "w_mxfp4_a_mxfp4"):
        first = C.write_quantized_checkpoint(model, scheme, tmp_path / scheme / "first", calibrate(model, ids))
        m1, _ = C.load_quantized_qwen3_moe(first, device="cuda", backend="fused")
        ex = m1.model.layers[0].mlp.experts.experts
        assert ex.prepared is not None and "w13_weight_packed" not in ex._buffers
        m1.save_pretrained(tmp_path / scheme / "second")
        _assert_same_tensors(_stored(first), _stored(tmp_path / scheme / "second"))
        m2, _ = C.load_quantized_qwen3_moe(tmp_path / scheme / "second", device="cuda", backend="fused")
        assert_bits_equal(_logits(m2, ids.cuda()), _logits(m1, ids.cuda()), f"{scheme} fused logits")
        m2.load_state_dict(m1.state_dict())
        assert m2.model.layers[0].mlp.experts.experts.prepared is not None
        assert_bits_equal(_logits(m2, ids.cuda()), _logits(m1, ids.cuda()), f"{scheme} fused after load_state_dict")
