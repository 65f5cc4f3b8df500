"""Full Qwen3-30B-A3B layer shapes on a CUDA GPU (skipped without one).

Every scheme's experts, dequantize-then-GEMM (``triton``) and fused, against a float64 MoE built from the same
dequantized weights and the same QDQ'd activations (mxlib.reference on the GPU), at E 128, top-8,
H 2048, I 768. The a2 QDQ is applied to the bf16-rounded SiLU-and-mul output as both paths do, so the
oracle differs from them only by their bf16 GEMM roundings.
"""

import pytest
import torch

from mxlib.moe import MOE_SCHEMES, fused_topk, get_moe_scheme, quantize_expert_weights
from mxlib.studies.unification import emulation_experts

from oracles import moe_fp64

pytestmark = pytest.mark.gpu

E, TOPK, H, I = 128, 8, 2048, 768


@pytest.fixture(scope="module")
def layer():
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.empty(E, 2 * I, H, device="cuda", dtype=torch.bfloat16).normal_(0, 0.02, generator=g)
    w2 = torch.empty(E, H, I, device="cuda", dtype=torch.bfloat16).normal_(0, 0.02, generator=g)
    return w13, w2


def oracle(ex, x, tw, ti):
    """The float64 MoE (``oracles.moe_fp64``) on the experts' own dequantized weights and QDQ'd inputs."""
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
        a2_fn=lambda act, e: ex.quantize_intermediate(act, torch.full((act.shape[0],), e, device=act.device), "torch"),
    )


@pytest.mark.parametrize("scheme", list(MOE_SCHEMES))
@pytest.mark.parametrize("m", [1, 64])
def test_full_shape_against_fp64(layer, scheme, m):
    w13, w2 = layer
    s = get_moe_scheme(scheme)
    q = quantize_expert_weights(w13, w2, s.weight)
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, H, device="cuda", generator=g).to(torch.bfloat16)
    tw, ti = fused_topk(torch.randn(m, E, device="cuda", generator=g), TOPK)
    in13 = torch.full((E,), float(x.float().abs().amax()), device="cuda") / (2688.0 if s.name == "nvfp4" else 448.0)
    in2 = torch.full((E,), 0.02, device="cuda") / (2688.0 if s.name == "nvfp4" else 448.0)
    ex = emulation_experts(s, q, in13, in2, backend="triton")
    ref = oracle(ex, x, tw, ti)
    for backend in ("triton", "fused"):
        ex.backend = backend
        out = ex(x, tw, ti).double()
        err = ((out - ref).norm() / ref.norm()).item()
        assert err < 1e-2, (scheme, backend, err)  # bf16 GEMM roundings: ~3e-3 measured
