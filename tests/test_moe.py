"""Routing, alignment, TritonExperts and the emulation experts.

The Triton path runs in the interpreter (E <= 16, small K/N). Oracles: a float64
dense MoE (no intermediate rounding) for the GEMMs, and a PyTorch reference MoE
assembled here from mxlib.reference's dequantize and QDQ functions, so the
emulation subclasses are checked against the design, not against themselves.
"""

import math
import warnings

import pytest
import torch

from mxlib import reference as R
from mxlib.moe import (
    OCP_MX_SCHEMES,
    TritonExperts,
    fused_topk,
    get_moe_scheme,
    make_emulation_experts,
    moe_align_block_size,
    quantize_expert_weights,
    torch_moe,
    unify_input_scales,
)

from _util import nvfp4_experts
from oracles import moe_fp64

E, H, I, M, TOPK = 8, 96, 64, 7, 2


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def dense_moe_fp64(a1, w13, w2, topk_weights, topk_ids, a2_fn=None):
    """float64 MoE, no rounding between the GEMMs: the GEMM oracle (``oracles.moe_fp64``)."""
    return moe_fp64(a1, w13, w2, topk_weights, topk_ids, a2_fn=a2_fn)


def make_inputs(dtype=torch.bfloat16, seed=0, e=E):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, H, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * I, H, generator=g) * 0.05 * torch.exp(torch.randn(e, 1, 1, generator=g))).to(dtype)
    w2 = (torch.randn(e, H, I, generator=g) * 0.05).to(dtype)
    logits = torch.randn(M, e, generator=g)
    topk_weights, topk_ids = fused_topk(logits, TOPK, True)
    return x, w13, w2, topk_weights, topk_ids


# ----------------------------------------------------------------------------- routing


def test_fused_topk_matches_qwen3_routing():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(32, 16, generator=g).to(torch.bfloat16)
    w, ids = fused_topk(logits, 4, renormalize=True)
    p = torch.softmax(logits.float(), -1)
    ref_w, ref_ids = torch.topk(p, 4)
    ref_w = ref_w / ref_w.sum(-1, keepdim=True)
    assert torch.equal(ids.long(), ref_ids) and torch.allclose(w, ref_w, rtol=0, atol=1e-7)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32


def test_fused_topk_ties_go_to_lower_expert():
    logits = torch.zeros(3, 8)
    logits[:, 5] = 1.0
    _, ids = fused_topk(logits, 3)
    assert ids.tolist() == [[5, 0, 1]] * 3
    with pytest.raises(ValueError, match="top_k: expected 1 <= top_k <= num_experts=8, got 9"):
        fused_topk(logits, 9)


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_moe_align_block_size(block_m):
    g = torch.Generator().manual_seed(block_m)
    topk_ids = torch.randint(0, 6, (9, 3), generator=g, dtype=torch.int32)
    topk_ids[0] = torch.tensor([5, 5, 5])
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, block_m, 8)
    numel = topk_ids.numel()
    flat = topk_ids.flatten().tolist()
    # expected, built with Python lists
    expected, experts = [], []
    for e in range(8):
        ids = [i for i, x in enumerate(flat) if x == e]
        if not ids:
            continue
        ids += [numel] * ((-len(ids)) % block_m)
        expected += ids
        experts += [e] * (len(ids) // block_m)
    n = int(num_post.item())
    assert n == len(expected)
    assert sorted_ids[:n].tolist() == expected
    assert (sorted_ids[n:] == numel).all()
    assert expert_ids[: n // block_m].tolist() == experts
    assert sorted_ids.shape[0] % block_m == 0 and sorted_ids.shape[0] >= numel + 8 * (block_m - 1)


# ----------------------------------------------------------------------------- TritonExperts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_experts_against_fp64_and_reference(dtype, device):
    x, w13, w2, tw, ti = make_inputs(dtype)
    oracle = dense_moe_fp64(x, w13, w2, tw, ti)
    out_triton = TritonExperts(w13.to(device), w2.to(device), backend="triton")(
        x.to(device), tw.to(device), ti.to(device)
    )
    out_torch = TritonExperts(w13, w2, backend="torch")(x, tw, ti)
    assert out_triton.dtype == dtype and out_triton.shape == (M, H)
    # bf16 rounding of the two GEMM outputs: a few 1e-3 relative (fp16: smaller)
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    assert rel_err(out_triton.cpu(), oracle) < tol
    assert rel_err(out_torch, oracle) < tol
    # same rounding points: only fp32 accumulation order differs
    assert rel_err(out_triton.cpu(), out_torch) < 2e-3


def test_triton_experts_edge_cases(device):
    x, w13, w2, tw, ti = make_inputs(seed=1, e=16)
    ti[:] = torch.tensor([3, 9], dtype=torch.int32)  # every token on experts 3 and 9; 14 experts idle
    ex = TritonExperts(w13.to(device), w2.to(device), backend="triton")
    out = ex(x.to(device), tw.to(device), ti.to(device))
    assert rel_err(out.cpu(), dense_moe_fp64(x, w13, w2, tw, ti)) < 1e-2
    one = ex(x[:1].to(device), tw[:1].to(device), ti[:1].to(device))  # M = 1
    assert rel_err(one.cpu(), dense_moe_fp64(x[:1], w13, w2, tw[:1], ti[:1])) < 1e-2


def test_torch_moe_matches_transformers_experts_loop():
    # transformers' own eager experts computes the same function (independent code)
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from mxlib.models.qwen3 import qwen3_30b_a3b_config

    cfg = qwen3_30b_a3b_config(num_hidden_layers=1, hidden_size=H, moe_intermediate_size=I, num_experts=E)
    hf = Qwen3MoeExperts(cfg)
    x, w13, w2, tw, ti = make_inputs(torch.float32)
    hf.gate_up_proj.data.copy_(w13)
    hf.down_proj.data.copy_(w2)
    expected = hf(x, ti.long(), tw)
    got = torch_moe(x, w13, w2, tw, ti)
    assert rel_err(got, expected) < 1e-5


# ----------------------------------------------------------------------------- emulation


def nvfp4_experts_inputs(x, w13, w2, scale_spread=False):
    p13, s13, g13 = R.quantize_nvfp4(w13)
    p2, s2, g2 = R.quantize_nvfp4(w2)
    in13 = torch.full((E,), float(x.float().abs().amax()) / 2688.0)
    in2 = torch.full((E,), 0.05 / 2688.0)
    if scale_spread:
        in13 = in13 * torch.linspace(0.05, 1.0, E)
        in2 = in2 * torch.linspace(1.0, 0.02, E)
    return (p13, s13, g13, p2, s2, g2, in13, in2)


def nvfp4_design_reference(x, t, tw, ti, a1_mode="once", a2_mode="once", strategy="max"):
    """vLLM's NVFP4 emulation assembled from mxlib.reference (no experts class involved)."""
    p13, s13, g13, p2, s2, g2, in13, in2 = t
    w13 = R.dequantize_to_dtype(p13, s13, g13, x.dtype)
    w2 = R.dequantize_to_dtype(p2, s2, g2, x.dtype)
    if strategy == "max":
        gs13 = (1.0 / in13.max()).reshape(1)
        gs2 = (1.0 / in2.max()).reshape(1)

        def q1(v, e):
            return R.ref_nvfp4_quant_dequant(v, gs13)

        def q2(v, e):
            return R.ref_nvfp4_quant_dequant(v, gs2)
    else:  # per expert

        def q1(v, e):
            return R.ref_nvfp4_quant_dequant(v, (1.0 / in13[e]).reshape(1))

        def q2(v, e):
            return R.ref_nvfp4_quant_dequant(v, (1.0 / in2[e]).reshape(1))

    reps = {"skip": 0, "once": 1, "twice": 2}
    out = torch.zeros(x.shape[0], H, dtype=torch.float32)
    k = ti.shape[1]
    for tok in range(x.shape[0]):
        for j in range(k):
            e = int(ti[tok, j])
            a = x[tok : tok + 1]
            for _ in range(reps[a1_mode]):
                a = q1(a, e)
            h = (a.float() @ w13[e].float().T).to(x.dtype)
            act = (torch.nn.functional.silu(h.float()[:, :I]) * h.float()[:, I:]).to(x.dtype)
            for _ in range(reps[a2_mode]):
                act = q2(act, e)
            y = ((act.float() @ w2[e].float().T) * tw[tok, j]).to(x.dtype)
            out[tok] += y[0].float()
    return out.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_nvfp4_emulation_matches_design(dtype, backend, device):
    x, w13, w2, tw, ti = make_inputs(dtype, seed=2)
    t = nvfp4_experts_inputs(x, w13, w2)
    dev = device if backend == "triton" else "cpu"
    ex = nvfp4_experts(*[v.to(dev) for v in t], activation_dtype=dtype, backend=backend)
    assert ex.quant_dtype == "nvfp4" and ex.expects_unquantized_inputs
    out = ex(x.to(dev), tw.to(dev), ti.to(dev)).cpu()
    ref = nvfp4_design_reference(x, t, tw, ti)
    assert rel_err(out, ref) < 3e-3
    # the test can fail: skipping or doubling a QDQ moves the result further than the tolerance
    for a1_mode, a2_mode in [("skip", "once"), ("once", "skip")]:
        assert rel_err(out, nvfp4_design_reference(x, t, tw, ti, a1_mode, a2_mode)) > 1e-2


@pytest.mark.slow
def test_nvfp4_per_expert_strategy(device):
    x, w13, w2, tw, ti = make_inputs(torch.bfloat16, seed=3)
    t = nvfp4_experts_inputs(x, w13, w2, scale_spread=True)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        ex = nvfp4_experts(*[v.to(device) for v in t], backend="triton")
    ex.set_scale_strategy("per_expert")
    out = ex(x.to(device), tw.to(device), ti.to(device)).cpu()
    assert rel_err(out, nvfp4_design_reference(x, t, tw, ti, strategy="per_expert")) < 3e-3
    ex.set_scale_strategy("max")
    out_max = ex(x.to(device), tw.to(device), ti.to(device)).cpu()
    assert rel_err(out_max, nvfp4_design_reference(x, t, tw, ti, strategy="max")) < 3e-3


class _CountingOps:
    """Wraps an ops module and records the shape of every activation QDQ call."""

    def __init__(self, ops):
        self.ops, self.calls = ops, []

    def __getattr__(self, name):
        fn = getattr(self.ops, name)
        if name in ("quant_dequant_mx", "ref_nvfp4_quant_dequant", "quant_dequant_fp8_per_tensor"):

            def wrapped(x, *a, **kw):
                self.calls.append(tuple(x.shape))
                return fn(x, *a, **kw)

            return wrapped
        return fn


@pytest.mark.parametrize("scheme", [s for s in OCP_MX_SCHEMES] + ["nvfp4"])
def test_each_activation_point_quantized_exactly_once(scheme, monkeypatch):
    import mxlib.moe.emulation as X

    x, w13, w2, tw, ti = make_inputs(torch.bfloat16, seed=4)
    ex = build_experts(scheme, x, w13, w2, backend="torch")
    counting = _CountingOps(R)
    monkeypatch.setattr(X, "ops_for_backend", lambda backend: counting)
    ex(x, tw, ti)
    s = get_moe_scheme(scheme)
    a1_calls = [c for c in counting.calls if c == (M, H)]
    a2_calls = [c for c in counting.calls if c[-1] == I]
    expected = 0 if s.activation is None else 1
    assert len(a1_calls) == expected
    # the torch backend QDQs a2 once per expert that has tokens, covering every pair once
    assert sum(c[0] for c in a2_calls) == (M * TOPK if s.activation is not None else 0)


def build_experts(scheme, x, w13, w2, backend, device="cpu"):
    s = get_moe_scheme(scheme)
    weights = quantize_expert_weights(w13, w2, s, ops=R).to(device)
    in13 = in2 = None
    if s.name == "nvfp4":
        in13, in2 = nvfp4_experts_inputs(x, w13, w2)[6:]
    elif s.static_activation_scale:  # static per-tensor FP8
        in13 = torch.full((E,), float(x.float().abs().amax()) / 448.0)
        in2 = torch.linspace(0.01, 0.05, E) / 448.0
    return make_emulation_experts(s, weights, *(t if t is None else t.to(device) for t in (in13, in2)), backend=backend)


def ocp_design_reference(scheme, x, w13, w2, tw, ti):
    """OCP MX emulation assembled from mxlib.reference: dequantized weights, QDQ'd a1 and a2."""
    s = get_moe_scheme(scheme)
    el = s.weight.element.name
    w13d = R.dequantize_mx(*R.quantize_mx(w13, el), el, dtype=x.dtype)
    w2d = R.dequantize_mx(*R.quantize_mx(w2, el), el, dtype=x.dtype)
    if s.activation is None:
        qdq1 = qdq2 = None
    elif s.activation.name == "fp8_e4m3":
        sc1 = torch.tensor(float(x.float().abs().amax()) / 448.0)
        sc2 = (torch.linspace(0.01, 0.05, E) / 448.0).max()
        qdq1 = lambda v, e: R.quant_dequant_fp8_per_tensor(v, sc1)  # noqa: E731
        qdq2 = lambda v, e: R.quant_dequant_fp8_per_tensor(v, sc2)  # noqa: E731
    else:
        ael = s.activation.element.name
        qdq1 = qdq2 = lambda v, e: R.quant_dequant_mx(v, ael, 32, "even")  # noqa: E731
    a1 = qdq1(x, None) if qdq1 else x
    return torch_moe(a1, w13d, w2d, tw, ti, qdq2)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", OCP_MX_SCHEMES)
def test_ocp_mx_emulation_matches_design(scheme, device):
    x, w13, w2, tw, ti = make_inputs(torch.bfloat16, seed=5)
    ex = build_experts(scheme, x, w13, w2, backend="triton", device=device)
    out = ex(x.to(device), tw.to(device), ti.to(device)).cpu()
    ref = ocp_design_reference(scheme, x, w13, w2, tw, ti)
    assert rel_err(out, ref) < 3e-3
    ex_t = build_experts(scheme, x, w13, w2, backend="torch")
    assert rel_err(ex_t(x, tw, ti), ref) < 1e-6


def test_unification_strategies():
    s = torch.tensor([0.0, 1.0, 2.0, 4.0])
    gs, uniform = unify_input_scales(s, "per_expert")
    assert not uniform and gs.tolist() == [0.25, 1.0, 0.5, 0.25]  # uncalibrated expert -> max
    assert unify_input_scales(s, "median")[0].tolist() == [0.5] * 4
    assert unify_input_scales(s, "mean")[0][0].item() == pytest.approx(3 / 7)
    with pytest.raises(ValueError, match="strategy: expected one of"):
        unify_input_scales(s, "min")
    with pytest.raises(ValueError, match="w2_input_scale: expected finite, non-negative"):
        unify_input_scales(torch.tensor([1.0, math.nan]), "max", "w2_input_scale")


def test_experts_bad_input():
    x, w13, w2, tw, ti = make_inputs()
    t = list(nvfp4_experts_inputs(x, w13, w2))
    bad = list(t)
    bad[1] = t[1][:, :, :-1]
    with pytest.raises(ValueError, match=r"w13_weight_scale: expected shape \[8, 128, 6\], got \[8, 128, 5\]"):
        nvfp4_experts(*bad)
    bad = list(t)
    bad[2] = t[2].double()
    with pytest.raises(TypeError, match="w13_weight_scale_2: expected dtype torch.float32, got torch.float64"):
        nvfp4_experts(*bad)
    with pytest.raises(ValueError, match="unknown MoE scheme 'w_mxfp5'"):
        get_moe_scheme("w_mxfp5")
    ex = TritonExperts(w13, w2, backend="torch")
    with pytest.raises(ValueError, match=r"hidden_states: expected \[M, 96\]"):
        ex(x[:, :64], tw, ti)
    with pytest.raises(TypeError, match="hidden_states: expected dtype torch.bfloat16, got torch.float32"):
        ex(x.float(), tw, ti)
    with pytest.raises(ValueError, match="backend: expected one of"):
        TritonExperts(w13, w2, backend="cuda")(x, tw, ti)


# ----------------------------------------------------------------------------- fused emulation


def fused_reference_fp64(ex, x, tw, ti):
    """float64 MoE from the experts' own dequantized weights and QDQ'd activations (the
    operands the fused kernel must reproduce); a2 is QDQ'd from the bf16-rounded activation."""
    w13, w2 = ex.dequantized_weights()
    a1, per_pair, _ = ex.quantize_input(x, ti, "torch")
    return moe_fp64(
        a1,
        w13,
        w2,
        tw,
        ti,
        per_pair=per_pair,
        store_dtype=x.dtype,
        a2_fn=lambda act, e: ex.quantize_intermediate(act, torch.full((act.shape[0],), e), "torch"),
    )


@pytest.mark.parametrize(
    "scheme", ["nvfp4", "w_mxfp4_a_mxfp4", "w_mxfp6_e3m2_a_fp8", "w_mxfp6_e2m3", "w_mxfp4_a_mxfp6_e2m3"]
)
@pytest.mark.slow
def test_fused_matches_dequant_gemm_and_fp64(scheme, device):
    x, w13, w2, tw, ti = make_inputs(torch.bfloat16, seed=6)
    ex = build_experts(scheme, x, w13, w2, backend="fused", device=device)
    fused = ex(x.to(device), tw.to(device), ti.to(device)).cpu()
    ex.backend = "triton"
    dequant_gemm = ex(x.to(device), tw.to(device), ti.to(device)).cpu()
    ex_cpu = build_experts(scheme, x, w13, w2, backend="torch")
    oracle = fused_reference_fp64(ex_cpu, x, tw, ti)
    # bf16 GEMM outputs and a2 rounding: both paths land ~1e-3 from the fp64 oracle
    assert rel_err(fused, oracle) < 5e-3
    assert rel_err(dequant_gemm, oracle) < 5e-3
    assert rel_err(fused, dequant_gemm) < 5e-3


def test_fused_edge_cases(device):
    x, w13, w2, tw, ti = make_inputs(torch.bfloat16, seed=7, e=16)
    ti[:] = 11  # every pair on one expert; 15 experts idle
    ti[:, 1] = 11
    t = nvfp4_experts_inputs(x, w13[:8], w2[:8])  # quantize 8 experts, then reuse them for 16
    x16 = [torch.cat([v, v]) if v.shape[0] == 8 else v for v in t]
    ex = nvfp4_experts(*[v.to(device) for v in x16], backend="fused")
    ex_ref = nvfp4_experts(*x16, backend="torch")
    out = ex(x.to(device), tw.to(device), ti.to(device)).cpu()
    assert rel_err(out, fused_reference_fp64(ex_ref, x, tw, ti)) < 5e-3
    one = ex(x[:1].to(device), tw[:1].to(device), ti[:1].to(device)).cpu()  # M = 1
    assert rel_err(one, fused_reference_fp64(ex_ref, x[:1], tw[:1], ti[:1])) < 5e-3


def test_fused_per_expert_scales(device):
    x, w13, w2, tw, ti = make_inputs(torch.bfloat16, seed=8)
    t = nvfp4_experts_inputs(x, w13, w2, scale_spread=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ex = nvfp4_experts(*[v.to(device) for v in t], scale_strategy="per_expert", backend="fused")
        ex_ref = nvfp4_experts(*t, scale_strategy="per_expert", backend="torch")
    out = ex(x.to(device), tw.to(device), ti.to(device)).cpu()
    assert rel_err(out, fused_reference_fp64(ex_ref, x, tw, ti)) < 5e-3


@pytest.mark.parametrize("scheme", ["nvfp4", "w_mxfp4_a_mxfp4", "w_mxfp6_e3m2_a_fp8", "w_mxfp6_e2m3_a_mxfp6_e2m3"])
def test_fused_split_nibbles_variant(scheme, device):
    from mxlib.kernels.tiles import TileConfig

    x, w13, w2, tw, ti = make_inputs(torch.bfloat16, seed=9)
    ex = build_experts(scheme, x, w13, w2, backend="fused", device=device)
    ex.fused_config = TileConfig(16, 32, 64, 1, 4, 2, split_nibbles=True)
    out = ex(x.to(device), tw.to(device), ti.to(device)).cpu()
    oracle = fused_reference_fp64(build_experts(scheme, x, w13, w2, backend="torch"), x, tw, ti)
    assert rel_err(out, oracle) < 5e-3


# ----------------------------------------------------------------------------- factory and typed schemes


def test_scheme_objects_are_the_format_table():
    from mxlib.formats import BLOCK_SCHEMES, FP8_E4M3_PER_TENSOR, NVFP4

    s = get_moe_scheme("nvfp4")
    assert s.weight is NVFP4 and s.activation is NVFP4 and s.static_activation_scale and not s.is_ocp_mx
    s = get_moe_scheme("w_mxfp6_e3m2_a_fp8")
    assert s.weight is BLOCK_SCHEMES["mxfp6_e3m2"] and s.activation is FP8_E4M3_PER_TENSOR
    assert get_moe_scheme("w_mxfp4").activation is None and get_moe_scheme("w_fp4_a_fp4").name == "w_mxfp4_a_mxfp4"


def test_nvfp4_experts_typed_and_vllm_call_forms_agree():
    from mxlib.moe import ExpertWeights

    x, w13, w2, tw, ti = make_inputs(torch.bfloat16, seed=10)
    t = nvfp4_experts_inputs(x, w13, w2)
    vllm_form = nvfp4_experts(*t, backend="torch")
    by_keyword = nvfp4_experts(
        w13_weight=t[0],
        w13_weight_scale=t[1],
        w13_weight_scale_2=t[2],
        w2_weight=t[3],
        w2_weight_scale=t[4],
        w2_weight_scale_2=t[5],
        w13_input_scale=t[6],
        w2_input_scale=t[7],
        backend="torch",
    )
    weights = quantize_expert_weights(w13, w2, "nvfp4", ops=R)
    assert isinstance(weights, ExpertWeights)
    typed = make_emulation_experts("nvfp4", weights, t[6], t[7], backend="torch")
    ref = vllm_form(x, tw, ti)
    for ex in (by_keyword, typed):
        assert torch.equal(ex(x, tw, ti), ref)
    with pytest.raises(ValueError, match="weights: quantized as nvfp4, scheme w_mxfp4 stores mxfp4"):
        make_emulation_experts("w_mxfp4", weights)
    with pytest.raises(ValueError, match="nvfp4: activations with a static scale need w13_input_scale"):
        make_emulation_experts("nvfp4", weights)


def test_base_experts_do_not_ask_for_their_subclass():
    import inspect

    import mxlib.moe.base as B

    assert "isinstance(self" not in inspect.getsource(B.TritonExperts)


# ----------------------------------------------------------------------------- FP4 kernel in the experts, numerics

H4, I4 = 256, 128  # the FP4 kernel needs H and I multiples of its 128-element K tile


def fp4_layer(scheme, numerics, backend, device, seed=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, H4, generator=g).to(torch.bfloat16)
    w13 = torch.randn(E, 2 * I4, H4, generator=g) * 0.05 * torch.exp(torch.randn(E, 1, 1, generator=g))
    w2 = torch.randn(E, H4, I4, generator=g) * 0.05
    tw, ti = fused_topk(torch.randn(M, E, generator=g), TOPK, True)
    s = get_moe_scheme(scheme)
    q = quantize_expert_weights(w13.to(torch.bfloat16), w2.to(torch.bfloat16), s, ops=R)
    in13 = in2 = None
    if s.static_activation_scale:
        in13 = torch.full((E,), float(x.float().abs().amax()) / 2688.0)
        in2 = torch.linspace(0.2, 0.5, E) / 2688.0
    ex = make_emulation_experts(
        s, q.to(device), *(t if t is None else t.to(device) for t in (in13, in2)), backend=backend, numerics=numerics
    )
    return ex, q, x, tw, ti


@pytest.fixture(scope="module")
def fp4_fused_run():
    """``fp4_fused_run(scheme, numerics, device)``: ``fp4_layer(scheme, numerics, "fused", device)`` and its
    experts' output on the layer's input, ``(ex, q, x, tw, ti, out)``, made once for the module and then only read
    (the interpreter's FP4 kernel takes tens of seconds a call)."""
    made = {}

    def get(scheme, numerics, device):
        if (scheme, numerics, device) not in made:
            ex, q, x, tw, ti = fp4_layer(scheme, numerics, "fused", device)
            made[scheme, numerics, device] = (ex, q, x, tw, ti, ex(x.to(device), tw.to(device), ti.to(device)).cpu())
        return made[scheme, numerics, device]

    return get


def fp4_oracle_fp64(ex, q, x, tw, ti, numerics):
    """float64 MoE from the scheme's operands, computed here from mxlib.reference: ``vllm``: the
    vLLM's bf16 weights and activations; ``hardware``: weights and NVFP4 activations without the
    bf16 rounding of ``element * scale * global`` (fp32). GEMM1 and SiLU-and-mul rounded to bf16."""
    dt = torch.bfloat16 if numerics == "vllm" else torch.float32
    if q.scheme.has_global_scale:
        w13 = R.dequantize_to_dtype(q.w13_weight, q.w13_weight_scale, q.w13_weight_scale_2, dt)
        w2 = R.dequantize_to_dtype(q.w2_weight, q.w2_weight_scale, q.w2_weight_scale_2, dt)
        gs1, gs2 = ex.a13_gscale[:1].cpu(), ex.a2_gscale[:1].cpu()
        qdq1 = lambda v: R.ref_nvfp4_quant_dequant(v, gs1, dtype=dt)  # noqa: E731
        qdq2 = lambda v: R.ref_nvfp4_quant_dequant(v, gs2, dtype=dt)  # noqa: E731
    else:
        w13 = R.dequantize_mx(q.w13_weight, q.w13_weight_scale, "e2m1")
        w2 = R.dequantize_mx(q.w2_weight, q.w2_weight_scale, "e2m1")
        act = ex.activation_format
        qdq1 = qdq2 = (lambda v: v) if act is None else (lambda v: R.quant_dequant_mx(v, "e2m1", 32, "even"))  # noqa: E731
    return moe_fp64(qdq1(x), w13, w2, tw, ti, store_dtype=torch.bfloat16, a2_fn=lambda act, e: qdq2(act))


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["nvfp4", "w_mxfp4_a_mxfp4", "w_mxfp4"])
@pytest.mark.parametrize("numerics", ["vllm", "hardware"])
def test_fp4_experts_both_numerics_against_fp64(scheme, numerics, device, fp4_fused_run):
    ex, q, x, tw, ti, fused = fp4_fused_run(scheme, numerics, device)
    ref = TritonExperts.__call__(fp4_layer(scheme, numerics, "torch", "cpu")[0], x, tw, ti)
    oracle = fp4_oracle_fp64(ex, q, x, tw, ti, numerics)
    assert rel_err(fused, oracle) < 5e-3
    assert rel_err(ref, oracle) < 5e-3
    assert rel_err(fused, ref) < 5e-3
    if numerics == "hardware" and scheme == "nvfp4":  # the modes differ measurably (NVFP4 only)
        seed = fp4_layer(scheme, "vllm", "torch", "cpu")[0](x, tw, ti)
        assert rel_err(ref, seed) > 1e-4
        assert rel_err(fp4_oracle_fp64(ex, q, x, tw, ti, "vllm"), oracle) > 1e-4


@pytest.mark.slow
def test_fp4_experts_keep_only_the_prepared_copy(device, fp4_fused_run):
    ex, q, x, tw, ti = fp4_layer("nvfp4", "vllm", "fused", device)
    assert ex.prepared is not None  # the FP4 kernel's copy, and no checkpoint-layout copy beside it
    assert "w13_weight_packed" not in ex._buffers and "w2_weight_packed" not in ex._buffers
    assert ex.prepared.w13.numel() == q.w13_weight.numel()  # same size: no extra memory
    # the checkpoint layout comes back for the other backends, bit for bit
    assert torch.equal(ex.w13_weight.cpu(), q.w13_weight) and torch.equal(ex.w2_weight.cpu(), q.w2_weight)
    fused = fp4_fused_run("nvfp4", "vllm", device)[-1]  # the FP4 kernel's output on the same layer, built alike
    ex.backend = "triton"  # dequantize-then-GEMM path from the unprepared bytes: the same operands
    assert rel_err(ex(x.to(device), tw.to(device), ti.to(device)).cpu(), fused) < 5e-3


def test_auto_backend_choice():
    cuda = torch.device("cuda")
    fp4 = fp4_layer("nvfp4", "vllm", "auto", "cpu")[0]
    assert fp4.prepared is None and "w13_weight_packed" in fp4._buffers  # auto on the CPU is torch: nothing prepared
    assert fp4.resolved_backend(cuda) == "fused" and fp4.resolved_backend(torch.device("cpu")) == "torch"
    x, w13, w2, tw, ti = make_inputs()
    fp6 = build_experts("w_mxfp6_e3m2", x, w13, w2, backend="auto")  # H = 96: not the kernel's shape
    assert fp6.resolved_backend(cuda) == "triton"
    g = torch.Generator().manual_seed(3)  # H = I = 256: MXFP6 runs on the FP4 kernel (FP6_AUTO_FUSED)
    w13_256, w2_256 = torch.randn(4, 512, 256, generator=g).to(torch.bfloat16), torch.randn(4, 256, 256, generator=g)
    fp6_256 = build_experts("w_mxfp6_e3m2", x, w13_256, w2_256.to(torch.bfloat16), backend="auto")
    assert fp6_256.resolved_backend(cuda) == "fused" and fp6_256.resolved_backend(torch.device("cpu")) == "torch"
    small = build_experts("nvfp4", x, w13, w2, backend="auto")  # H = 96: not the FP4 kernel's shape
    assert small.resolved_backend(cuda) == "triton"
    for name in ("w_mxfp8", "w_mxfp8_a_mxfp8"):  # MX FP8 weights: the dequantize-GEMM kernel (FP8_AUTO_FUSED)
        fp8 = build_experts(name, x, w13, w2, backend="auto")
        assert fp8.resolved_backend(cuda) == "fused" and fp8.resolved_backend(torch.device("cpu")) == "torch"
    assert TritonExperts(w13, w2, backend="auto").resolved_backend(cuda) == "triton"


def test_hardware_numerics_bad_backend_and_value():
    ex = fp4_layer("nvfp4", "hardware", "triton", "cpu")[0]
    with pytest.raises(ValueError, match="numerics='hardware' runs on the 'torch' backend"):
        ex(torch.zeros(M, H4, dtype=torch.bfloat16), *fused_topk(torch.randn(M, E), TOPK))
    with pytest.raises(ValueError, match="numerics: expected one of"):
        fp4_layer("w_mxfp4", "fast", "torch", "cpu")


@pytest.mark.parametrize("mul_routed_weight", [False, True])
def test_bf16_kernel_naive_blocks_same_bits(mul_routed_weight, device):
    """No alignment (each pair its own block, vLLM's tiny-batch mode) gives the aligned path's bits."""
    from mxlib.kernels.fused_moe import get_moe_config, invoke_fused_moe_kernel

    x, w13, w2, tw, ti = make_inputs(e=16)
    x, w13, tw, ti = x[:2].to(device), w13.to(device), tw[:2].to(device), ti[:2].to(device)
    cfg = get_moe_config(2, 16, TOPK, 2 * I, H)
    outs = []
    for naive in (False, True):
        c = torch.zeros(2 * TOPK, 2 * I, dtype=x.dtype, device=device)
        s, e, p = moe_align_block_size(ti, cfg.block_m, 16)
        if naive:
            s, e, p = None, ti.reshape(-1), None
        invoke_fused_moe_kernel(x, w13, c, tw, s, e, p, mul_routed_weight, TOPK, cfg, naive)
        outs.append(c.cpu())
    assert torch.equal(outs[0], outs[1])
