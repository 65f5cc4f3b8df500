"""Block Hadamard rotation: the transform against a dense Sylvester matrix, the Triton twin bit for bit,
the rotated forward against the unrotated one, every backend's bits, the checkpoint round trip and the
loader's refusals."""

import json
import math

import pytest
import torch

from mxlib import checkpoints as C
from mxlib.kernels.hadamard import BlockHadamard, block_hadamard, ref_block_hadamard
from mxlib.models.calibration import calibrate
from mxlib.models.qwen3 import dummy_qwen3_moe, expert_weights, qwen3_30b_a3b_config, swap_experts
from mxlib.moe.base import TritonExperts
from mxlib.moe.factory import make_emulation_experts, quantize_expert_weights
from mxlib.moe.routing import fused_topk
from mxlib.moe.schemes import get_moe_scheme
from mxlib.recovery import RECOVERY_CONFIG_KEY, TECHNIQUES, get_technique
from mxlib.recovery.hadamard import (
    HadamardRotation,
    decode_signs,
    encode_signs,
    random_signs,
    rotate_second_moments,
    rotation_from_config,
)

from _util import TINY_QWEN3, assert_bits_equal


def sylvester(b: int) -> torch.Tensor:
    """The dense Sylvester Hadamard matrix H_b in float64, built from its definition."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def dense_rotation(x: torch.Tensor, b: int, signs=None) -> torch.Tensor:
    """``(x * signs) @ blockdiag(H_b) / sqrt(b)`` in float64 with the dense matrix."""
    x = x.double() * (1 if signs is None else signs.double())
    k = x.shape[-1]
    q = torch.block_diag(*[sylvester(b)] * (k // b)) / math.sqrt(b)
    return x @ q


def _signs(n, seed=3):
    return random_signs(n, seed)


# ----------------------------------------------------------------------------- the transform


@pytest.mark.parametrize("b", [2, 4, 8, 16, 32, 64, 128])
@pytest.mark.parametrize("with_signs", [False, True])
def test_transform_is_the_dense_sylvester_matrix(b, with_signs):
    x = torch.randn(3, 5, 4 * b, dtype=torch.float64, generator=torch.Generator().manual_seed(b))
    s = _signs(4 * b) if with_signs else None
    got = ref_block_hadamard(x, b, s)
    # float64 butterflies against a float64 dense product: a few ulps of the largest partial sum
    torch.testing.assert_close(got, dense_rotation(x, b, s), rtol=0, atol=1e-13)


@pytest.mark.parametrize("b", [4, 16, 64])
def test_transform_exact_on_integers(b):
    # integers and a power-of-four block: every sum and the 1/sqrt(b) = 2**-k multiply are exact in fp32
    x = torch.randint(-50, 50, (6, 2 * b), generator=torch.Generator().manual_seed(0)).float()
    assert_bits_equal(ref_block_hadamard(x, b), dense_rotation(x, b).float())


def test_transform_in_fp32_close_to_float64():
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(1))
    for b in (16, 32, 128):
        ref = dense_rotation(x, b)
        got = ref_block_hadamard(x, b).double()
        # fp32 butterflies: log2(b) roundings of 2**-24 relative, plus the scale's
        assert ((got - ref).abs() / ref.abs().clamp_min(1e-3)).median() < 1e-6


@pytest.mark.parametrize("b", [2, 16, 32, 128])
def test_transform_is_its_own_inverse(b):
    x = torch.randn(4, 2 * b, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(ref_block_hadamard(ref_block_hadamard(x, b), b), x, rtol=0, atol=1e-14)
    s = _signs(2 * b)
    back = ref_block_hadamard(ref_block_hadamard(x, b, s), b) * s.double()  # the signs' inverse comes last
    torch.testing.assert_close(back, x, rtol=0, atol=1e-14)
    # unnormalized: H_b H_b = b I, exactly on integers
    xi = torch.randint(-9, 9, (4, 2 * b), generator=torch.Generator().manual_seed(3)).double()
    twice = ref_block_hadamard(ref_block_hadamard(xi, b), b) * b
    h = torch.block_diag(*[sylvester(b)] * 2)
    assert torch.equal(xi @ h @ h, xi * b)
    torch.testing.assert_close(twice, xi * b, rtol=0, atol=1e-12)


def test_transform_refuses_bad_arguments():
    x = torch.randn(2, 48)
    with pytest.raises(ValueError, match="block_size: expected a power of two, got 24"):
        ref_block_hadamard(x, 24)
    with pytest.raises(ValueError, match="last dimension 48 is not a multiple of block_size=32"):
        block_hadamard(x, 32)
    with pytest.raises(ValueError, match=r"signs: expected a float32 tensor of shape \(48,\)"):
        ref_block_hadamard(x, 16, torch.ones(32))
    with pytest.raises(TypeError, match="x: expected a floating tensor"):
        ref_block_hadamard(torch.ones(2, 16, dtype=torch.int32), 16)
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        block_hadamard(x.double(), 16)


# ----------------------------------------------------------------------------- the Triton twin


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("b,shape", [(16, (5, 64)), (32, (3, 2, 96)), (128, (4, 256)), (2, (7, 6))])
@pytest.mark.parametrize("with_signs", [False, True])
def test_triton_twin_bit_for_bit(dtype, b, shape, with_signs):
    g = torch.Generator().manual_seed(b)
    x = (torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[-1])).to(dtype)
    x.view(-1)[:3] = torch.tensor([0.0, -0.0, 1e-30]).to(dtype)  # zeros and a tiny value
    s = _signs(shape[-1]) if with_signs else None
    assert_bits_equal(block_hadamard(x, b, s), ref_block_hadamard(x, b, s))
    assert_bits_equal(block_hadamard(x, b, s, out_dtype=torch.float32), ref_block_hadamard(x, b, s, torch.float32))


def test_triton_twin_empty_and_strided():
    assert block_hadamard(torch.empty(0, 32), 16).shape == (0, 32)
    x = torch.randn(6, 64).to(torch.bfloat16)[::2]
    assert_bits_equal(block_hadamard(x, 16), ref_block_hadamard(x.contiguous(), 16))


# ----------------------------------------------------------------------------- the experts

E, H, I, M, K = 4, 128, 128, 6, 2


@pytest.fixture(scope="module")
def layer():
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.05).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) * 0.05).bfloat16()
    x = torch.randn(M, H, generator=g).bfloat16()
    x[:, ::32] *= 20  # outlier channels
    tw, ti = fused_topk(torch.randn(M, E, generator=g), K)
    return w13, w2, x, tw, ti


def _rotation(b, h=H, i=I):
    return BlockHadamard(b, random_signs(h, 5), random_signs(i, 6))


def _float64_moe(w13, w2, x, tw, ti):
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ti.shape[1]):
            e = int(ti[t, j])
            h = w13[e].double() @ x[t].double()
            a = torch.nn.functional.silu(h[:I]) * h[I:]
            out[t] += float(tw[t, j]) * (w2[e].double() @ a)
    return out


@pytest.fixture(scope="module")
def unrotated(layer):
    """``unrotated(backend)``: the bf16 experts' output on ``layer`` without a rotation, computed once a backend
    (it does not depend on the block size the rotated side is parametrized over)."""
    outs = {}

    def get(backend):
        if backend not in outs:
            w13, w2, x, tw, ti = layer
            outs[backend] = TritonExperts(w13, w2, backend=backend)(x, tw, ti).double()
        return outs[backend]

    return get


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
@pytest.mark.parametrize("b", [16, 32, 128])
def test_rotated_forward_equals_unrotated_without_quantization(layer, unrotated, backend, b):
    w13, w2, x, tw, ti = layer
    r = _rotation(b)
    w13r = ref_block_hadamard(w13.float(), b, r.signs_h).bfloat16()
    w2r = ref_block_hadamard(w2.float(), b, r.signs_i).bfloat16()
    plain = unrotated(backend)
    rotated_experts = TritonExperts(w13r, w2r, backend=backend)
    rotated_experts.rotation = r
    rotated = rotated_experts(x, tw, ti).double()
    exact = _float64_moe(w13, w2, x, tw, ti)
    rms = exact.pow(2).mean().sqrt()
    # Tolerance: the rotated path adds four bf16 roundings (w13, w2, a1 and a2 in the rotated basis, each
    # <= 2**-9 relative per element) to the plain path's (GEMM outputs, SiLU-and-mul, the output); both
    # land within a few bf16 half-ulps of the float64 MoE: RMS error <= 2**-7 of the output RMS, and so
    # within 2 * 2**-7 of each other. The plain path's own error sets the scale of what is allowed.
    err_plain = (plain - exact).pow(2).mean().sqrt() / rms
    err_rot = (rotated - exact).pow(2).mean().sqrt() / rms
    assert err_plain < 2**-7 and err_rot < 2**-7, (err_plain, err_rot)
    assert (rotated - plain).pow(2).mean().sqrt() / rms < 2**-6
    assert (rotated - plain).abs().max() / rms < 2**-3  # no single output far off


SCHEMES = ["nvfp4", "w_mxfp4_a_mxfp4", "w_mxfp4"]


def _rotated_experts(layer, scheme, backend, numerics="vllm", scale_strategy="max", signs="random"):
    w13, w2, x, tw, ti = layer
    s = get_moe_scheme(scheme)
    tech = HadamardRotation(signs=signs, seed=7)
    q = tech.quantize_experts(w13, w2, s, layer=0)
    r = tech.rotation_for(H, I, s)
    scales = (None, None)
    if s.static_activation_scale:
        a1 = r.rotate_h(x)
        scales = (torch.full((E,), float(a1.abs().amax()) / 2688), torch.full((E,), 0.4 / 2688))
    return make_emulation_experts(
        s, q, *scales, backend=backend, numerics=numerics, scale_strategy=scale_strategy, rotation=r
    )


@pytest.mark.slow
@pytest.mark.parametrize("scheme", SCHEMES)
def test_rotated_backends_same_bits(layer, scheme):
    w13, w2, x, tw, ti = layer
    outs = {be: _rotated_experts(layer, scheme, be)(x, tw, ti) for be in ("torch", "triton", "fused")}
    assert_bits_equal(outs["triton"], outs["torch"], "triton")
    assert_bits_equal(outs["fused"], outs["torch"], "fused (FP4 kernel, a2 rotated in its epilogue)")
    plain = make_emulation_experts(
        scheme,
        quantize_expert_weights(w13, w2, get_moe_scheme(scheme)),
        *((torch.full((E,), float(x.abs().amax()) / 2688), torch.full((E,), 0.4 / 2688)) if scheme == "nvfp4" else ()),
        backend="torch",
    )(x, tw, ti)
    assert not torch.equal(plain, outs["torch"])  # the rotation is not a no-op


@pytest.mark.slow
@pytest.mark.parametrize("numerics,strategy", [("hardware", "max"), ("vllm", "per_token"), ("hardware", "per_token")])
def test_rotated_nvfp4_numerics_and_per_token_same_bits(layer, numerics, strategy):
    w13, w2, x, tw, ti = layer
    torch_out = _rotated_experts(layer, "nvfp4", "torch", numerics, strategy)(x, tw, ti)
    fused_out = _rotated_experts(layer, "nvfp4", "fused", numerics, strategy)(x, tw, ti)
    assert_bits_equal(fused_out, torch_out)


def test_rotated_experts_compile_into_one_graph(layer):
    w13, w2, x, tw, ti = layer
    ex = _rotated_experts(layer, "w_mxfp4_a_mxfp4", "torch")
    torch._dynamo.reset()
    compiled = torch.compile(ex, fullgraph=True, backend="aot_eager")
    assert_bits_equal(compiled(x, tw, ti), ex(x, tw, ti))


def test_rotation_attribute_default_and_removal(layer):
    w13, w2, x, tw, ti = layer
    s = get_moe_scheme("w_mxfp4_a_mxfp4")
    q = quantize_expert_weights(w13, w2, s)
    ex = make_emulation_experts(s, q, backend="torch")
    assert ex.rotation is None and TritonExperts(w13, w2).rotation is None
    before = ex(x, tw, ti)
    ex.rotation = _rotation(32)
    assert ex.rotation.block_size == 32 and torch.equal(ex.rotation.signs_h, random_signs(H, 5))
    ex.rotation = None
    assert ex.rotation is None and "rotation_signs_h" not in dict(ex.named_buffers())
    assert_bits_equal(ex(x, tw, ti), before)
    with pytest.raises(ValueError, match="hidden_size 128 is not a multiple of block_size=256"):
        ex.rotation = BlockHadamard(256)
    with pytest.raises(ValueError, match=r"signs_h: expected a float32 tensor of shape \(128,\)"):
        ex.rotation = BlockHadamard(16, torch.ones(64))
    with pytest.raises(ValueError, match="signs_i: expected \\+1 / -1 values only"):
        ex.rotation = BlockHadamard(16, None, torch.full((I,), 0.5))
    with pytest.raises(TypeError, match="rotation: expected a BlockHadamard or None"):
        ex.rotation = 16


# ----------------------------------------------------------------------------- the technique


def test_technique_registered_and_configured():
    assert TECHNIQUES["hadamard"] is HadamardRotation
    t = get_technique("hadamard", signs="random", seed=3)
    with pytest.raises(RuntimeError, match="fixed by the first quantize_experts"):
        t.config()
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(2, 64, 64, generator=g), torch.randn(2, 64, 32, generator=g)
    q = t.quantize_experts(w13, w2, get_moe_scheme("nvfp4"), layer=0)
    cfg = t.config()
    assert cfg["kind"] == "block_hadamard" and cfg["block_size"] == 16 and cfg["signs"] == "random"
    assert cfg["seed"] == 3 and cfg["inner"] == "rtn" and json.loads(json.dumps(cfg)) == cfg
    r = rotation_from_config(cfg, 64, 32)
    assert torch.equal(r.signs_h, random_signs(64, 3)) and torch.equal(r.signs_i, random_signs(32, 4))
    # the weights the inner technique saw: the rotated ones, bit for bit
    rot13 = ref_block_hadamard(w13, 16, r.signs_h)
    ref = quantize_expert_weights(rot13, ref_block_hadamard(w2, 16, r.signs_i), get_moe_scheme("nvfp4"))
    for k, v in ref.tensors().items():
        assert_bits_equal(q.tensors()[k], v, k)
    mx = HadamardRotation()
    mx.quantize_experts(w13, w2, get_moe_scheme("w_mxfp4_a_mxfp4"), layer=0)
    assert mx.config() == {"kind": "block_hadamard", "block_size": 32, "signs": "none", "inner": "rtn"}
    with pytest.raises(ValueError, match="one rotation serves layers of one size"):
        mx.quantize_experts(w13[:, :32], w2[:, :, :16], get_moe_scheme("w_mxfp4_a_mxfp4"), layer=1)
    with pytest.raises(ValueError, match="signs: expected None or 'random', got 'rademacher'"):
        HadamardRotation(signs="rademacher")
    with pytest.raises(ValueError, match="block_size: expected a power of two, got 12"):
        HadamardRotation(block_size=12)
    with pytest.raises(TypeError, match="inner: expected a WeightTechnique"):
        HadamardRotation(inner="rtn")


def test_signs_hex_round_trip():
    for n in (1, 7, 8, 9, 768, 2048):
        s = random_signs(n, n)
        text = encode_signs(s)
        assert len(text) == 2 * ((n + 7) // 8)
        assert torch.equal(decode_signs(text, n, "f"), s)
    # bit j % 8 of byte j // 8 is set where sign j is -1 (the documented layout, by hand)
    assert encode_signs(torch.tensor([-1.0, 1, 1, 1, 1, 1, 1, 1, 1, -1])) == "0102"
    with pytest.raises(ValueError, match="f: expected a hex string of 4 characters"):
        decode_signs("01", 10, "f")
    with pytest.raises(ValueError, match="f: not a hex string"):
        decode_signs("zz02", 10, "f")


def test_rotate_second_moments_is_the_rotated_activations():
    x = torch.randn(50, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    s = random_signs(32, 1)
    xr = dense_rotation(x, 16, s)
    torch.testing.assert_close(rotate_second_moments(x.T @ x, 16, s), xr.T @ xr, rtol=0, atol=1e-11)


# ----------------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def tiny():
    model = dummy_qwen3_moe(qwen3_30b_a3b_config(num_hidden_layers=2, **TINY_QWEN3), seed=1, expert_spread=0.5)
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    return model, calibrate(model, tokens), tokens


@pytest.mark.parametrize("scheme,layout", [("nvfp4", "modelopt"), ("w_mxfp4_a_mxfp4", "quark"), ("w_mxfp4", "quark")])
@pytest.mark.parametrize("signs", [None, "random"])
def test_checkpoint_round_trip(tiny, tmp_path, scheme, layout, signs):
    import copy

    model, cal, tokens = tiny
    tech = HadamardRotation(signs=signs, seed=11)
    path = C.write_quantized_checkpoint(model, scheme, tmp_path / "ckpt", cal, layout=layout, technique=tech)
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    assert qc[RECOVERY_CONFIG_KEY] == {"technique": "hadamard", **tech.config()}
    loaded, info = C.load_quantized_qwen3_moe(path, backend="torch")
    s = get_moe_scheme(scheme)
    r = tech.rotation_for(model.config.hidden_size, model.config.moe_intermediate_size, s)

    reference = copy.deepcopy(model)

    def make(layer):
        w13, w2 = expert_weights(model, layer)
        scales = cal.input_scales(layer, s.activation) if s.static_activation_scale else (None, None)
        q = tech.quantize_experts(w13, w2, s, layer=layer)
        return make_emulation_experts(s, q, *scales, backend="torch", rotation=r)

    swap_experts(reference, make)
    for layer in range(2):
        got = loaded.model.layers[layer].mlp.experts.experts
        want = reference.model.layers[layer].mlp.experts.experts
        assert got.rotation.block_size == want.rotation.block_size == s.weight.block_size
        for name in ("signs_h", "signs_i"):
            a, b = getattr(got.rotation, name), getattr(want.rotation, name)
            assert (a is None and b is None) if signs is None else torch.equal(a, b)
        for a, b in zip(got.dequantized_weights(), want.dequantized_weights()):
            assert_bits_equal(a, b, "dequantized weights")
    with torch.no_grad():
        assert_bits_equal(loaded(tokens).logits, reference(tokens).logits, "logits")


@pytest.fixture(scope="module")
def rotated_folder(tiny, tmp_path_factory):
    model, cal, _ = tiny
    return C.write_quantized_checkpoint(
        model,
        "w_mxfp4_a_mxfp4",
        tmp_path_factory.mktemp("rot") / "ckpt",
        cal,
        technique=HadamardRotation(signs="random"),
    )


def _with_recovery(folder, tmp_path, edit):
    import shutil

    dst = tmp_path / "edited"
    shutil.copytree(folder, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg["quantization_config"][RECOVERY_CONFIG_KEY])
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda c: c.update(kind="givens"), "mxlib_recovery.kind: mxlib runs rotations of kind 'block_hadamard'"),
        (lambda c: c.pop("kind"), "mxlib_recovery.kind: missing"),
        (lambda c: c.update(block_size=64), "mxlib_recovery.block_size: intermediate_size 32 is not a multiple"),
        (lambda c: c.update(block_size=24), "mxlib_recovery.block_size: block_size: expected a power of two"),
        (lambda c: c.pop("signs_h"), "mxlib_recovery.signs_h: missing"),
        (lambda c: c.update(signs_i="00"), "mxlib_recovery.signs_i: expected a hex string of 8 characters"),
        (lambda c: c.update(signs="gaussian"), "mxlib_recovery.signs: expected 'none' or 'random'"),
    ],
)
def test_loader_refuses_rotations_it_cannot_run(rotated_folder, tmp_path, edit, match):
    folder = _with_recovery(rotated_folder, tmp_path, edit)
    with pytest.raises(C.CheckpointError, match="config.json: quantization_config." + match):
        C.load_quantized_qwen3_moe(folder, backend="torch")


def test_checkpoint_without_rotation_loads_unrotated(tiny, tmp_path):
    model, cal, _ = tiny
    path = C.write_quantized_checkpoint(model, "w_mxfp4_a_mxfp4", tmp_path / "rtn", cal, technique="rtn")
    assert RECOVERY_CONFIG_KEY not in json.loads((path / "config.json").read_text())["quantization_config"]
    loaded, _ = C.load_quantized_qwen3_moe(path, backend="torch")
    assert all(layer.mlp.experts.experts.rotation is None for layer in loaded.model.layers)
    # an entry without ``kind`` (a technique that changes only codes and scales) loads unrotated
    folder = _with_recovery(
        C.write_quantized_checkpoint(
            model, "w_mxfp4_a_mxfp4", tmp_path / "r2", cal, technique=HadamardRotation(signs="random")
        ),
        tmp_path,
        lambda c: (c.clear(), c.update(technique="mse")),
    )
    loaded, _ = C.load_quantized_qwen3_moe(folder, backend="torch")
    assert all(layer.mlp.experts.experts.rotation is None for layer in loaded.model.layers)


# ----------------------------------------------------------------------------- the benchmark's CPU parts


def test_bench_layer_paths_on_the_cpu(layer):
    from mxlib.bench.rotation import layer_paths

    w13, w2, x, tw, ti = layer
    paths = layer_paths(w13, w2, x, backend="torch")
    assert sorted(paths) == sorted(
        ["fused_nvfp4", "fused_nvfp4_hadamard", "fused_w_mxfp4_a_mxfp4", "fused_w_mxfp4_a_mxfp4_hadamard"]
    )
    assert paths["fused_nvfp4"].rotation is None and paths["fused_nvfp4_hadamard"].rotation.block_size == 16
    assert paths["fused_w_mxfp4_a_mxfp4_hadamard"].rotation.block_size == 32
    # NVFP4's static scales are the rotated activations' amax / 2688 (a1: the calibration batch itself)
    r = paths["fused_nvfp4_hadamard"].rotation
    assert float(paths["fused_nvfp4_hadamard"].w13_input_scale[0]) == float(r.rotate_h(x).abs().amax()) / 2688
    exact = _float64_moe(w13, w2, x, tw, ti)
    err = {name: _rel_l2(ex(x, tw, ti), exact) for name, ex in paths.items()}
    assert all(e < 0.5 for e in err.values()), err  # every path a working MoE: within FP4's error of float64
    # outlier channels every 32: the rotation spreads them; MXFP4 W4A4 gains (measured 0.42 -> 0.27)
    assert err["fused_w_mxfp4_a_mxfp4_hadamard"] < err["fused_w_mxfp4_a_mxfp4"] - 0.05, err


def _rel_l2(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.slow
def test_bench_metric_trap(tmp_path):
    from mxlib.bench.rotation import main, metric_trap, outlier_activations

    rows = {(r["format"], r["rotation"]): r for r in metric_trap(outlier_activations(rows=64, k=512))}
    assert set(rows) == {(f, b) for f in ("nvfp4", "mxfp4") for b in (0, 16, 128)}
    # outlier channels: rotation lowers NVFP4's energy-weighted SQNR and raises MXFP4's
    for b in (16, 128):
        assert rows["nvfp4", b]["sqnr_db"] < rows["nvfp4", 0]["sqnr_db"] - 1
        assert rows["mxfp4", b]["sqnr_db"] > rows["mxfp4", 0]["sqnr_db"] + 1
    out = tmp_path / "trap.json"
    assert main(["--metric-trap", "--json", str(out)]) == 0
    assert len(json.loads(out.read_text())["metric_trap"]) == 6


def test_rotated_checkpoint_saved_again_keeps_its_rotation(rotated_folder, tiny, tmp_path):
    _, _, tokens = tiny
    loaded, _ = C.load_quantized_qwen3_moe(rotated_folder, backend="torch")
    loaded.save_pretrained(tmp_path / "again")
    a = json.loads((rotated_folder / "config.json").read_text())["quantization_config"]
    b = json.loads((tmp_path / "again" / "config.json").read_text())["quantization_config"]
    assert a[RECOVERY_CONFIG_KEY] == b[RECOVERY_CONFIG_KEY]
    again, _ = C.load_quantized_qwen3_moe(tmp_path / "again", backend="torch")
    with torch.no_grad():
        assert_bits_equal(again(tokens).logits, loaded(tokens).logits)


class _Moments:
    """Fixed per-expert second moments (the HessianSource protocol GPTQ reads)."""

    def __init__(self, h13, h2):
        self.h13, self.h2 = h13, h2

    def w13(self, layer):
        return self.h13

    def w2(self, layer):
        return self.h2

    def tokens(self, layer):
        return torch.full((self.h13.shape[0],), 64, dtype=torch.int64)


def test_gptq_under_rotation_reads_rotated_hessians():
    """``gptq+hadamard`` quantizes the rotated weights with ``Qᵀ H Q`` (Q built densely here, float64), not with
    the unrotated H: the same codes as GPTQ handed the rotated weights and that rotated Hessian directly."""
    from mxlib.recovery import get_technique
    from mxlib.recovery.gptq import GPTQ

    g = torch.Generator().manual_seed(3)
    e, h, i, b = 2, 32, 32, 16
    w13 = (torch.randn(e, 2 * i, h, generator=g) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(e, h, i, generator=g) * 0.05).to(torch.bfloat16)
    mix = torch.randn(h, h, generator=g, dtype=torch.float64)
    x = torch.randn(e, 96, h, generator=g, dtype=torch.float64) @ mix  # correlated inputs
    h13 = x.transpose(1, 2) @ x
    h2 = h13[:, :i, :i].clone()
    rot = get_technique("gptq+hadamard", hessians=_Moments(h13, h2), signs="random", seed=5)
    got = rot.quantize_experts(w13, w2, get_moe_scheme("nvfp4"), layer=0)

    r = rot.rotation_for(h, i, get_moe_scheme("nvfp4"))
    q = torch.diag(r.signs_h.double()) @ torch.block_diag(*[sylvester(b) / math.sqrt(b)] * (h // b))
    qi = torch.diag(r.signs_i.double()) @ torch.block_diag(*[sylvester(b) / math.sqrt(b)] * (i // b))
    w13r = ref_block_hadamard(w13, b, r.signs_h, out_dtype=torch.float32)
    w2r = ref_block_hadamard(w2, b, r.signs_i, out_dtype=torch.float32)
    want = GPTQ(_Moments(q.T @ h13 @ q, qi.T @ h2 @ qi)).quantize_experts(w13r, w2r, get_moe_scheme("nvfp4"), layer=0)
    plain = GPTQ(_Moments(h13, h2)).quantize_experts(w13r, w2r, get_moe_scheme("nvfp4"), layer=0)
    assert torch.equal(got.w13_weight, want.w13_weight) and torch.equal(got.w2_weight, want.w2_weight)
    assert not torch.equal(got.w13_weight, plain.w13_weight)  # the unrotated Hessian would choose other codes
