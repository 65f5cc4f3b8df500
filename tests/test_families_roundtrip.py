"""Every registered MoE family through mxlib: routing, calibrate -> write -> load -> inspect.

Each family is transformers' own class (Mixtral, OLMoE, Qwen2-MoE, DeepSeek-V3) at a tiny seeded
size. The oracles are independent of the code under test: transformers' own router modules for the
routing functions (bit for bit, ties included); transformers' own bf16 model for the loaded
model's routing ids and, within a stated bound, its logits; transformers' ``from_pretrained`` for
a bf16 save; the checkpoint files read back with ``safetensors`` for the on-disk names. The loaded
model's logits equal mxlib's own in-memory emulation (the same quantized experts swapped into the
bf16 model) bit for bit.
"""

import json
import time

import pytest
import torch
import transformers
from safetensors import safe_open

from mxlib.checkpoints import inspect_checkpoint, load_quantized_moe, write_quantized_checkpoint
from mxlib.models import families
from mxlib.models.calibration import calibrate
from mxlib.models.moe_models import dummy_moe_model, expert_weights, moe_layer_indices, moe_layers, swap_experts
from mxlib.moe import input_scales_from_amax, make_emulation_experts, quantize_expert_weights
from mxlib.moe import routing as R

_COMMON = dict(
    num_hidden_layers=2,
    hidden_size=64,
    num_attention_heads=2,
    num_key_value_heads=1,
    vocab_size=128,
    max_position_embeddings=64,
)

# tiny configs: hidden 64, expert intermediate 32 (two 16-blocks, one 32-block), every family's own extras
CONFIGS = {
    "MixtralForCausalLM": ("MixtralConfig", dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)),
    "OlmoeForCausalLM": ("OlmoeConfig", dict(intermediate_size=32, num_experts=4, num_experts_per_tok=2)),
    "Qwen2MoeForCausalLM": (
        "Qwen2MoeConfig",
        dict(
            intermediate_size=64,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            num_experts=4,
            num_experts_per_tok=2,
            num_hidden_layers=3,
            mlp_only_layers=[1],  # layers 0 and 2 MoE, layer 1 a dense MLP
        ),
    ),
    "DeepseekV3ForCausalLM": (
        "DeepseekV3Config",
        dict(
            intermediate_size=64,
            moe_intermediate_size=32,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,  # layer 0 a dense MLP
            num_hidden_layers=3,
            routed_scaling_factor=2.5,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_rope_head_dim=16,
            qk_nope_head_dim=16,
            v_head_dim=32,
            head_dim=16,
            rope_scaling=None,
        ),
    ),
}
NAMES = list(CONFIGS)
MOE_LAYERS = {"MixtralForCausalLM": [0, 1], "OlmoeForCausalLM": [0, 1], "Qwen2MoeForCausalLM": [0, 2]}
MOE_LAYERS["DeepseekV3ForCausalLM"] = [1, 2]
# one NVFP4 and one OCP MX layout per family (ModelOpt NVFP4, Quark MXFP4 / compressed-tensors)
WRITES = [("nvfp4", "modelopt"), ("w_mxfp4_a_mxfp4", "quark"), ("nvfp4", "compressed-tensors")]


def _config(cls_name: str):
    config_cls, kw = CONFIGS[cls_name]
    return getattr(transformers, config_cls)(**{**_COMMON, **kw})


@pytest.fixture(scope="module")
def built():
    """``{class name: (bf16 dummy model, calibration, token ids)}``."""
    out = {}
    for n in NAMES:
        t0 = time.perf_counter()
        model = dummy_moe_model(_config(n), seed=0, expert_spread=0.3)
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
        out[n] = (model, calibrate(model, ids), ids, time.perf_counter() - t0)
    return out


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.float()


def _emulated(model, scheme, cal):
    """mxlib's in-memory emulation: the bf16 model's experts quantized and swapped in (no checkpoint)."""

    def make(i):
        w13, w2 = expert_weights(model, i)
        lc = cal.layer(i)
        s13, s2 = input_scales_from_amax(scheme, lc.a1_amax, lc.a2_amax)
        return make_emulation_experts(scheme, quantize_expert_weights(w13, w2, scheme), s13, s2, backend="torch")

    saved = [m.experts for m in moe_layers(model)]
    swap_experts(model, make)
    return saved


def _restore(model, saved):
    for m, ex in zip(moe_layers(model), saved):
        m.experts = ex
    del model.save_pretrained  # swap_experts' refusal


def _router_ids(model, ids) -> dict[int, torch.Tensor]:
    """Each MoE layer's top-k ids as the family's own router computes them (a forward hook)."""
    got = {}
    hooks = [
        m.gate.register_forward_hook(lambda mod, a, out, i=i: got.__setitem__(i, out[2].clone()))
        for i, m in zip(moe_layer_indices(model), moe_layers(model))
    ]
    try:
        _logits(model, ids)
    finally:
        for h in hooks:
            h.remove()
    return got


# ----------------------------------------------------------------------------- registry


@pytest.mark.parametrize("cls_name", NAMES)
def test_registry_reads_transformers_own_config(cls_name):
    config = _config(cls_name)
    fam = families.family_of(config)
    assert fam.architecture == cls_name and fam.model_type == config.model_type
    assert cls_name in families.SUPPORTED_ARCHITECTURES
    model = getattr(transformers, cls_name)(config)
    experts = model.model.layers[MOE_LAYERS[cls_name][0]].mlp.experts
    # the oracle: transformers' own experts module's shapes
    e, two_i, h = experts.gate_up_proj.shape
    assert (fam.num_experts(config), 2 * fam.intermediate_size(config), config.hidden_size) == (e, two_i, h)
    assert fam.top_k(config) == config.num_experts_per_tok
    d = config.to_dict()
    assert (fam.num_experts(d), fam.intermediate_size(d)) == (e, two_i // 2)
    moe = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    assert fam.moe_layer_indices(config) == moe == MOE_LAYERS[cls_name]
    assert families.family_of(model) is fam


# ----------------------------------------------------------------------------- routing functions


def _with_ties(x: torch.Tensor) -> torch.Tensor:
    """Logits with exact ties: every row's values rounded to a coarse grid, some rows constant."""
    x = (x * 4).round() / 4
    x[::5] = 0.5
    return x


def test_softmax_topk_is_mixtral_olmoe_qwen2_routers_bit_for_bit():
    torch.manual_seed(0)
    h = 32
    for cls_name, renorm, keep_dtype in [
        ("MixtralForCausalLM", True, False),
        ("OlmoeForCausalLM", False, True),
        ("Qwen2MoeForCausalLM", False, True),
        ("Qwen2MoeForCausalLM", True, True),
    ]:
        kw = dict(CONFIGS[cls_name][1], hidden_size=h, num_experts_per_tok=3)
        if cls_name != "MixtralForCausalLM":
            kw["norm_topk_prob"] = renorm
        config = getattr(transformers, CONFIGS[cls_name][0])(**{**_COMMON, **kw})
        block = getattr(transformers, cls_name)(config).model.layers[0].mlp
        router = block.gate
        router.weight.data = _with_ties(torch.randn_like(router.weight)) / 8
        for dtype in (torch.float32, torch.bfloat16):
            router.to(dtype)
            x = _with_ties(torch.randn(40, h)).to(dtype)
            logits, want_w, want_ids = router(x)
            got_w, got_ids = R.softmax_topk(logits, 3, renorm, weights_dtype=logits.dtype if keep_dtype else None)
            assert got_w.dtype == want_w.dtype and got_ids.dtype == torch.int32
            assert torch.equal(got_ids.long(), want_ids), (cls_name, dtype)
            assert torch.equal(got_w, want_w), (cls_name, dtype)


def test_grouped_topk_is_deepseek_v3_router_bit_for_bit():
    torch.manual_seed(0)
    for n_group, topk_group, k, renorm in [(2, 1, 2, True), (4, 2, 3, True), (4, 2, 3, False), (1, 1, 4, True)]:
        kw = dict(CONFIGS["DeepseekV3ForCausalLM"][1], n_group=n_group, topk_group=topk_group)
        kw.update(num_experts_per_tok=k, norm_topk_prob=renorm, n_routed_experts=16)
        config = transformers.DeepseekV3Config(**{**_COMMON, **kw})
        router = transformers.DeepseekV3ForCausalLM(config).model.layers[1].mlp.gate
        router.weight.data = _with_ties(torch.randn_like(router.weight)) / 8
        router.e_score_correction_bias.data = _with_ties(torch.randn(16)) / 16
        x = _with_ties(torch.randn(50, 64))
        logits, want_w, want_ids = router(x)
        got_w, got_ids = R.grouped_topk(
            logits, k, renorm, n_group, topk_group, router.e_score_correction_bias, config.routed_scaling_factor
        )
        assert torch.equal(got_ids.long(), want_ids), (n_group, topk_group, k)
        assert torch.equal(got_w, want_w), (n_group, topk_group, k)


def test_topk_softmax_is_gpt_oss_router_bit_for_bit():
    torch.manual_seed(0)
    config = transformers.GptOssConfig(**{**_COMMON, "num_local_experts": 8, "num_experts_per_tok": 3, "head_dim": 32})
    router = transformers.GptOssForCausalLM(config).model.layers[0].mlp.router
    router.weight.data = _with_ties(torch.randn_like(router.weight)) / 8
    router.bias.data = _with_ties(torch.randn(8)) / 4
    for dtype in (torch.float32, torch.bfloat16):
        router.to(dtype)
        x = _with_ties(torch.randn(40, 64)).to(dtype)
        logits, want_w, want_ids = router(x)
        got_w, got_ids = R.topk_softmax(logits, 3)
        assert torch.equal(got_ids.long(), want_ids) and torch.equal(got_w, want_w), dtype


def test_routing_functions_refuse_bad_arguments():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"top_k: expected an integer 1 <= top_k <= num_experts=8, got 9"):
        R.softmax_topk(x, 9, True)
    with pytest.raises(ValueError, match=r"router_logits: expected a \[M, E\] tensor, got \[8\]"):
        R.topk_softmax(x[0], 2)
    with pytest.raises(ValueError, match="num_expert_group: expected a positive divisor of E=8, got 3"):
        R.grouped_topk(x, 2, True, 3, 1)
    with pytest.raises(ValueError, match=r"topk_group: expected an integer in \[1, 4\]"):
        R.grouped_topk(x, 2, True, 4, 5)
    with pytest.raises(ValueError, match=r"e_score_correction_bias: expected shape \[8\], got \[4\]"):
        R.grouped_topk(x, 2, True, 4, 2, torch.zeros(4))
    with pytest.raises(ValueError, match="scoring_func: expected 'sigmoid' or 'softmax', got 'relu'"):
        R.grouped_topk(x, 2, True, 4, 2, scoring_func="relu")


# ----------------------------------------------------------------------------- round trips

# NVFP4 / MXFP4 experts at these tiny sizes move the logits by a few tenths at most; bf16 logits of
# this dummy model are O(1) (0.02-std weights, 128-token vocabulary). Measured: max |diff| < 0.12.
LOGITS_BOUND = 0.5


@pytest.mark.parametrize("cls_name", NAMES)
@pytest.mark.parametrize("scheme, layout", WRITES)
def test_round_trip(cls_name, scheme, layout, built, tmp_path):
    model, cal, ids, _ = built[cls_name]
    ref = _logits(model, ids)
    want_ids = _router_ids(model, ids)
    t0 = time.perf_counter()
    path = write_quantized_checkpoint(model, scheme, tmp_path / "ckpt", cal, layout=layout)
    loaded, info = load_quantized_moe(path, backend="torch")
    elapsed = time.perf_counter() - t0
    assert info.format == layout and info.scheme.name == scheme
    assert type(loaded).__name__ == cls_name
    stored = json.loads((path / "config.json").read_text())
    assert stored["architectures"] == [cls_name] and stored["model_type"] == model.config.model_type
    got = _logits(loaded, ids)
    diff = (got - ref).abs().max().item()
    assert diff < LOGITS_BOUND, diff
    # the family's own routing in the loaded model (its router, not mxlib's)
    got_ids = _router_ids(loaded, ids)
    first = min(want_ids)
    assert torch.equal(got_ids[first], want_ids[first])  # the first MoE layer sees the same bf16 input
    # bit for bit with mxlib's in-memory emulation of the same scheme (compressed-tensors stores encode
    # global scales, chosen by its own arithmetic: other bits, checked against bf16 only)
    if layout != "compressed-tensors":
        saved = _emulated(model, scheme, cal)
        try:
            emu = _logits(model, ids)
        finally:
            _restore(model, saved)
        assert torch.equal(got, emu), (got - emu).abs().max()
        assert not torch.equal(emu, ref)  # the experts are quantized
    print(f"{cls_name} {scheme} {layout}: write+load {elapsed:.2f} s, max |logits - bf16| {diff:.4f}")


@pytest.mark.parametrize("cls_name", NAMES)
def test_on_disk_names_are_the_familys(cls_name, built, tmp_path):
    model, cal, ids, _ = built[cls_name]
    path = write_quantized_checkpoint(model, "nvfp4", tmp_path / "ckpt", cal)
    names = set()
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            names |= set(h.keys())
    layer = MOE_LAYERS[cls_name][0]
    block = "block_sparse_moe" if cls_name == "MixtralForCausalLM" else "mlp"
    projs = ("w1", "w3", "w2") if cls_name == "MixtralForCausalLM" else ("gate_proj", "up_proj", "down_proj")
    for p in projs:
        assert f"model.layers.{layer}.{block}.experts.3.{p}.weight" in names
        assert f"model.layers.{layer}.{block}.experts.3.{p}.weight_scale" in names
    assert f"model.layers.{layer}.{block}.gate.weight" in names
    assert not any(".mlp." in n for n in names) or block == "mlp"
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    hf = json.loads((path / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
    for ignore in (qc["ignore"], hf):
        assert f"model.layers.{layer}.{block}.gate" in ignore or "model.layers.*.mlp.gate" in ignore
    if cls_name == "Qwen2MoeForCausalLM":
        for n in ("shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj", "shared_expert_gate"):
            assert f"model.layers.0.mlp.{n}" in qc["ignore"] and f"model.layers.0.mlp.{n}.weight" in names
        assert "model.layers.1.mlp.gate_proj" in qc["ignore"]  # the dense MLP layer, bf16
    if cls_name == "DeepseekV3ForCausalLM":
        assert "model.layers.1.mlp.shared_experts.down_proj" in qc["ignore"]
        assert "model.layers.0.mlp.down_proj" in qc["ignore"]  # first_k_dense_replace
        with safe_open(str(next(path.glob("*.safetensors"))), "pt") as h:
            if "model.layers.1.mlp.gate.e_score_correction_bias" in h.keys():
                assert h.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias").dtype == torch.float32
    report = inspect_checkpoint(path)
    assert report.layout_ok, report.problems
    fam = families.family_of(model)
    assert (report.num_experts, report.moe_intermediate_size) == (
        fam.num_experts(model.config),
        fam.intermediate_size(model.config),
    )
    assert sorted({r["layer"] for r in report.activation_scales}) == MOE_LAYERS[cls_name]  # per-expert input scales


@pytest.mark.parametrize("cls_name", NAMES)
def test_bf16_save_loads_in_transformers(cls_name, built, tmp_path):
    """transformers' own save / from_pretrained of the bf16 dummy (its conversion mapping), untouched by mxlib."""
    model, _, ids, _ = built[cls_name]
    model.save_pretrained(tmp_path / "bf16")
    back = getattr(transformers, cls_name).from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    assert torch.equal(_logits(back.eval(), ids), _logits(model, ids))


def test_round_trip_times(built):
    """The tiny builds stay tiny (dummy model + calibration per family, seconds on a shared CPU)."""
    for n, (*_, seconds) in built.items():
        print(f"{n}: dummy + calibrate {seconds:.2f} s")
        assert seconds < 30, (n, seconds)


@pytest.mark.parametrize("cls_name", NAMES)
def test_dummy_from_config_and_cli(cls_name, tmp_path):
    """A family's own unquantized config.json (as its save_pretrained writes it) -> dummy checkpoint -> load."""
    from mxlib.checkpoints import dummy_checkpoint_from_config
    from mxlib.cli import main as cli_main

    folder = tmp_path / "cfg"
    folder.mkdir()
    cfg = dict(_config(cls_name).to_dict(), architectures=[cls_name])
    (folder / "config.json").write_text(json.dumps(cfg, default=str))
    path = dummy_checkpoint_from_config(folder, tmp_path / "ckpt", scheme="w_mxfp4_a_mxfp4", calib_tokens=16)
    stored = json.loads((path / "config.json").read_text())
    assert stored["architectures"] == [cls_name] and stored["quantization_config"]["quant_method"] == "quark"
    # Quark's importer takes names and globs, not re:: every bf16 2-D module of the shards, by exact name
    headers = {}
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            headers.update({k: h.get_slice(k).get_shape() for k in h.keys()})
    bf16 = {
        k[: -len(".weight")]
        for k, shape in headers.items()
        if k.endswith(".weight") and len(shape) == 2 and f"{k}_scale" not in headers and "embed_tokens" not in k
    }
    exclude = stored["quantization_config"]["exclude"]
    assert sorted(exclude) == sorted(bf16) and len(exclude) == len(set(exclude)) and exclude[-1] == "lm_head"
    loaded, _ = load_quantized_moe(path, backend="torch")
    assert type(loaded).__name__ == cls_name
    assert torch.isfinite(_logits(loaded, torch.arange(8)[None])).all()
    assert inspect_checkpoint(path).layout_ok
    out = tmp_path / "cli.json"
    argv = ["dummy-from-config", str(folder), str(tmp_path / "ckpt2"), "--scheme", "nvfp4", "--tokens", "8"]
    assert cli_main([*argv, "--device", "cpu", "--backend", "torch", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    result = result.get("result", result)
    assert result["architecture"] == cls_name and result["logits_finite"]


@pytest.mark.parametrize("cls_name", ["DeepseekV3ForCausalLM", "Qwen2MoeForCausalLM"])
def test_statistics_and_hessians_name_decoder_layers(cls_name, built):
    """With dense MLP layers the MoE layers are not 0..n-1: every per-layer result names its decoder layer."""
    from mxlib.models.hessians import collect_expert_hessians
    from mxlib.models.routing_stats import routing_statistics

    model, cal, ids, _ = built[cls_name]
    assert cal.layer_indices == MOE_LAYERS[cls_name] and len(cal.layers) == len(MOE_LAYERS[cls_name])
    stats = routing_statistics(model, ids)
    assert [s["layer"] for s in stats] == MOE_LAYERS[cls_name]
    want = _router_ids(model, ids)  # the oracle: transformers' routers' own ids
    for s in stats:
        counts = torch.bincount(want[s["layer"]].reshape(-1), minlength=s["num_experts"])
        assert torch.equal(s["tokens_per_expert"], counts)
        assert torch.equal(cal.layer(s["layer"]).tokens, counts)  # calibration saw the same routing
    hess = collect_expert_hessians(model, ids)
    assert sorted(hess.layers) == MOE_LAYERS[cls_name]
    with pytest.raises(ValueError, match=r"layers: expected MoE layer indices of \[\d, \d\], got \[\d\]"):
        collect_expert_hessians(model, ids, layers=[1 if cls_name == "Qwen2MoeForCausalLM" else 0])
    with pytest.raises(ValueError, match="layer: expected a calibrated MoE layer"):
        cal.layer(1 if cls_name == "Qwen2MoeForCausalLM" else 0)


def _tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({n: h.get_tensor(n) for n in h.keys()})
    return out


@pytest.mark.parametrize("cls_name", NAMES)
def test_loaded_model_saves_its_checkpoint_back(cls_name, built, tmp_path):
    """``save_pretrained`` of a loaded model writes the checkpoint it was loaded from: the same names
    (the family's own on disk), dtypes and bytes, and the same config."""
    model, cal, ids, _ = built[cls_name]
    path = write_quantized_checkpoint(model, "nvfp4", tmp_path / "ckpt", cal)
    loaded, _ = load_quantized_moe(path, backend="torch")
    loaded.save_pretrained(tmp_path / "again")
    first, again = _tensors(path), _tensors(tmp_path / "again")
    assert sorted(first) == sorted(again)
    for n, t in first.items():
        assert t.dtype == again[n].dtype and torch.equal(
            t.reshape(-1).view(torch.uint8), again[n].reshape(-1).view(torch.uint8)
        ), n
    cfg = json.loads((path / "config.json").read_text())
    assert json.loads((tmp_path / "again" / "config.json").read_text()) == cfg
    back, _ = load_quantized_moe(tmp_path / "again", backend="torch")
    assert torch.equal(_logits(back, ids), _logits(loaded, ids))
