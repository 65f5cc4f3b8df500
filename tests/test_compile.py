"""The reference QDQ functions and the emulation experts' ``torch`` backend trace into one graph under
``torch.compile(fullgraph=True)`` and give the eager bits.

Value checks (NaN scales, out-of-range global scales) read tensor values, which would break the
graph; they are skipped while ``torch.compile`` traces (``mxlib._checks.capturing``), as they are
under CUDA-graph capture. The fast tier traces with the ``aot_eager`` backend (graph breaks are
found by dynamo whatever the backend); the slow test compiles with inductor, the default backend,
whose generated code must give the same bits too.

The experts' ``torch`` backend traces the activation QDQ and runs the loop over the experts that
received tokens (which ones is data-dependent) as one opaque op, ``mxlib::torch_experts_apply``.
"""

import copy

import pytest
import torch

from mxlib import reference as R
from mxlib.moe import fused_topk, make_emulation_experts, quantize_expert_weights

from _util import TINY_QWEN3, assert_bits_equal


def _x():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(32, 128, generator=g) * 3).to(torch.bfloat16)
    x[3, 5] = float("nan")  # NaN stays in its block
    x[7, 9] = 1e4  # saturates
    x[9, :32] = 0.0  # an all-zero block
    return x


GS = torch.tensor([2688.0 / 100.0])

CASES = {
    "quant_dequant_mx e2m1 even": (lambda x: R.quant_dequant_mx(x, "e2m1", 32, "even"), ()),
    "quant_dequant_mx e4m3 rceil": (lambda x: R.quant_dequant_mx(x, "e4m3", 32, "rceil"), ()),
    "quant_dequant_mx e3m2 floor": (lambda x: R.quant_dequant_mx(x, "e3m2", 32, "floor"), ()),
    "quantize_mx e2m1": (lambda x: R.quantize_mx(x, "e2m1", 32, "even"), ()),
    "dequantize_mx e2m1": (lambda p, s: R.dequantize_mx(p, s, "e2m1", 32, torch.bfloat16), ("mx",)),
    "ref_nvfp4_quant_dequant": (lambda x, g: R.ref_nvfp4_quant_dequant(x, g), ("gs",)),
    "quant_dequant_fp8_per_tensor": (lambda x, g: R.quant_dequant_fp8_per_tensor(x, g), ("fp8",)),
}


def _args(extra):
    x = _x()
    if extra == ("mx",):
        return R.quantize_mx(torch.nan_to_num(x), "e2m1", 32, "even")
    if extra == ("gs",):
        return (torch.nan_to_num(x), GS)
    if extra == ("fp8",):
        return (torch.nan_to_num(x), torch.tensor(0.05))
    return (x,)


def _check(fn, args, backend):
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    got, want = compiled(*args), fn(*args)
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    for g, w in zip(got, want):
        assert_bits_equal(g, w)


@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_traces_into_one_graph(case):
    fn, extra = CASES[case]
    _check(fn, _args(extra), "aot_eager")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["quant_dequant_mx e2m1 even", "ref_nvfp4_quant_dequant"])
def test_reference_inductor_bits_equal_eager(case):
    fn, extra = CASES[case]
    _check(fn, _args(extra), "inductor")


def test_value_checks_still_run_in_eager():
    # skipped only while tracing: an eager call with a NaN global scale is refused as before
    with pytest.raises(ValueError, match="global_scale|gs|scale"):
        R.ref_nvfp4_quant_dequant(_x(), torch.tensor([float("nan")]))


# ----------------------------------------------------------------------------- experts, torch backend

E, H, I = TINY_QWEN3["num_experts"], TINY_QWEN3["hidden_size"], TINY_QWEN3["moe_intermediate_size"]
M, TOP_K = 5, TINY_QWEN3["num_experts_per_tok"]


def _layer(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, H, generator=g).to(torch.bfloat16)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.1).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g) * 0.1).to(torch.bfloat16)
    logits = torch.randn(M, E, generator=g)
    logits[:, E - 1] = -1e4  # one expert receives no token: the loop skips it
    topk_weights, topk_ids = fused_topk(logits, TOP_K)
    return x, w13, w2, topk_weights, topk_ids


def _experts(scheme, w13, w2, **kw):
    if scheme == "nvfp4":  # per-expert activation scales: a1 QDQ'd per (token, expert) pair
        kw = dict(
            w13_input_scale=torch.linspace(0.5, 1.0, E) * 4.0 / 2688,
            w2_input_scale=torch.linspace(1.0, 0.3, E) * 0.2 / 2688,
            scale_strategy="per_expert",
            **kw,
        )
    return make_emulation_experts(scheme, quantize_expert_weights(w13, w2, scheme), backend="torch", **kw)


EXPERTS = {
    "nvfp4": ("nvfp4", {}),
    "nvfp4 hardware numerics": ("nvfp4", {"numerics": "hardware"}),
    "w_mxfp4_a_mxfp4": ("w_mxfp4_a_mxfp4", {}),
}


def _check_experts(case, backend):
    scheme, kw = EXPERTS[case]
    x, w13, w2, tw, ti = _layer()
    experts = _experts(scheme, w13, w2, **kw)
    torch._dynamo.reset()
    compiled = torch.compile(experts, fullgraph=True, backend=backend)
    got = compiled(x, tw, ti)
    want = experts(x, tw, ti)
    assert got.shape == (M, H) and got.dtype == torch.bfloat16
    assert want.abs().amax() > 0  # a real output, not zeros
    assert_bits_equal(got, want, case)
    # a second batch reuses the graph and still gives the eager bits
    x2, _, _, tw2, ti2 = _layer(seed=1)
    assert_bits_equal(compiled(x2, tw2, ti2), experts(x2, tw2, ti2), case + " (second batch)")


@pytest.mark.parametrize("case", sorted(EXPERTS))
def test_experts_torch_backend_traces_into_one_graph(case):
    _check_experts(case, "aot_eager")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["nvfp4", "w_mxfp4_a_mxfp4"])
def test_experts_torch_backend_inductor_bits_equal_eager(case):
    _check_experts(case, "inductor")


def test_a_copy_of_the_experts_runs_its_own_loop_when_compiled():
    x, w13, w2, tw, ti = _layer()
    experts = _experts("w_mxfp4_a_mxfp4", w13, w2)
    clone = copy.deepcopy(experts)
    with torch.no_grad():
        clone.w2_weight_scale.sub_(1)  # halves every w2 scale of the copy only
    torch._dynamo.reset()
    got = torch.compile(clone, fullgraph=True, backend="aot_eager")(x, tw, ti)
    assert_bits_equal(got, clone(x, tw, ti))
    assert not torch.equal(got, experts(x, tw, ti))


def test_experts_value_checks_still_run_in_eager():
    x, w13, w2, tw, ti = _layer()
    experts = _experts("w_mxfp4_a_mxfp4", w13, w2)
    with pytest.raises(ValueError, match="topk_ids: expected expert ids in"):
        experts(x, tw, torch.full_like(ti, E))
