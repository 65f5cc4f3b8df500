"""The MXFP8 and weight-only NVFP4 schemes' fused paths on a CUDA GPU at Qwen3-30B-A3B layer shapes (skipped
without one).

``w_mxfp8`` / ``w_mxfp8_a_mxfp8`` run the generic dequantize-GEMM kernel (FP8 weights), ``w_mxfp4_a_mxfp8`` and
``w4a16_nvfp4`` the FP4 kernel (MXFP8 activations QDQ'd in its A-tile load and GEMM1's epilogue; no activation
QDQ). Each against a float64 MoE on the experts' own dequantized weights and QDQ'd activations, with the bf16
roundings between the GEMMs that every path makes, at E 128, top-8, H 2048, I 768: relative error < 1e-2.
"""

import pytest
import torch

from mxlib.moe import fused_topk, quantize_expert_weights
from mxlib.moe.factory import make_emulation_experts
from mxlib.moe.schemes import get_moe_scheme

from oracles import moe_fp64

pytestmark = pytest.mark.gpu

E, TOPK, H, I = 128, 8, 2048, 768
# scheme, numerics, whether the FP4 kernel runs it
CASES = [
    ("w_mxfp8", "vllm", False),
    ("w_mxfp8_a_mxfp8", "vllm", False),
    ("w_mxfp4_a_mxfp8", "vllm", True),
    ("w4a16_nvfp4", "vllm", True),
    ("w4a16_nvfp4", "hardware", True),
]


@pytest.fixture(scope="module")
def layer():
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.empty(E, 2 * I, H, device="cuda", dtype=torch.bfloat16).normal_(0, 0.02, generator=g)
    w2 = torch.empty(E, H, I, device="cuda", dtype=torch.bfloat16).normal_(0, 0.02, generator=g)
    return w13, w2


@pytest.mark.parametrize("scheme,numerics,fp4", CASES)
@pytest.mark.parametrize("m", [1, 64, 512])
def test_fused_against_fp64(layer, scheme, numerics, fp4, m):
    w13, w2 = layer
    s = get_moe_scheme(scheme)
    q = quantize_expert_weights(w13, w2, s.weight)
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, H, device="cuda", generator=g).to(torch.bfloat16)
    tw, ti = fused_topk(torch.randn(m, E, device="cuda", generator=g), TOPK)
    ex = make_emulation_experts(s, q, backend="fused", numerics=numerics)
    assert (ex.fp4_weights() is not None) == fp4, (scheme, "FP4 kernel" if fp4 else "dequantize-GEMM kernel")
    out = ex(x, tw, ti).double()
    torch.cuda.synchronize()
    d13, d2 = ex.dequantized_weights()  # hardware numerics: element x block scale; the global scales below
    if numerics == "hardware":
        d13 = d13.double() * ex.w13_weight_scale_2.double().reshape(E, -1, 1).expand(E, 2, I).reshape(E, 2 * I, 1)
        d2 = d2.double() * ex.w2_weight_scale_2.double().reshape(E, 1, 1)
    a1, per_pair = ex.quantize_input(x, ti, "torch")
    ref = moe_fp64(
        a1,
        d13,
        d2,
        tw,
        ti,
        per_pair=per_pair,
        store_dtype=torch.bfloat16,
        a2_fn=lambda act, e: ex.quantize_intermediate(act, torch.full((act.shape[0],), e, device=act.device), "torch"),
    )
    err = ((out - ref).norm() / ref.norm()).item()
    assert err < 1e-2, (scheme, numerics, m, err)  # bf16 GEMM roundings (~3e-3 for the other schemes)
    torch_out = make_emulation_experts(s, q, backend="torch", numerics=numerics)(x, tw, ti).double()
    assert ((out - torch_out).norm() / torch_out.norm()).item() < 1e-2  # GPU tiles reorder the fp32 sums
