"""The MXFP8 and weight-only NVFP4 schemes' fused paths on a CUDA GPU at Qwen3-30B-A3B layer shapes (skipped
without one).

``w_mxfp8`` / ``w_mxfp8_a_mxfp8`` run the generic dequantize-GEMM kernel (FP8 weights), ``w_mxfp4_a_mxfp8`` and
``w4a16_nvfp4`` the FP4 kernel (MXFP8 activations QDQ'd in its A-tile load and GEMM1's epilogue; no activation
QDQ). Each against a float64 MoE on the experts' own dequantized weights and QDQ'd activations, with the bf16
roundings between the GEMMs that every path makes, at E 128, top-8, H 2048, I 768: relative error < 1e-2.
"""

import pytest
import torch

from mxlib import reference as R
from mxlib.moe import fused_topk, quantize_expert_weights
from mxlib.moe.factory import make_emulation_experts
from mxlib.moe.schemes import get_moe_scheme

from _util import assert_bits_equal
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
    a1, per_pair, _ = ex.quantize_input(x, ti, "torch")
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


@pytest.mark.parametrize("element", ["e4m3", "e5m2"])
def test_gpu_mxfp8_decode_bits_match_reference(element):
    """The dequantize-GEMM kernel's FP8 weight decode (the hardware conversion, times the E8M0 scale in fp32)
    gives ``mxlib.reference.dequantize_mx``'s bf16 weights bit for bit, for every finite code and 51 scale bytes:
    a one-hot activation reads single weight columns through a GEMM2-style launch (no gating), ``out[t, n] =
    W[n, t]``. NaN and Inf codes are left out (``0 * NaN`` would reach every output of the row); scale bytes
    100 .. 150 keep every product a normal bf16."""
    from mxlib.formats import BLOCK_SCHEMES
    from mxlib.kernels.align import RoutingPlan, moe_align_block_size_triton
    from mxlib.kernels.fused_dequant_moe import ActivationQDQ, PackedWeights, _launch
    from mxlib.kernels.tiles import TileConfig

    rows, k = 256, 256
    codes = torch.arange(rows * k, dtype=torch.int64).remainder(256).to(torch.uint8).view(1, rows, k)
    codes = codes.view(rows, k)[torch.randperm(rows, generator=torch.Generator().manual_seed(0))].view(1, rows, k)
    special = (codes & 0x7F) == 0x7F if element == "e4m3" else (codes & 0x7C) == 0x7C
    codes = torch.where(special, torch.zeros_like(codes), codes)
    scales = (100 + torch.arange(rows * k // 32, dtype=torch.int64).remainder(51)).to(torch.uint8)
    scales = scales.view(1, rows, k // 32)
    ref = R.dequantize_mx(codes, scales, element)[0]  # [rows, K] bf16
    w = PackedWeights(codes.cuda(), scales.cuda(), BLOCK_SCHEMES[f"mxfp8_{element}"])
    x = torch.zeros(k, k, dtype=torch.bfloat16)
    x[torch.arange(k), torch.arange(k)] = 1
    out = torch.empty(k, rows, dtype=torch.bfloat16, device="cuda")
    ids = torch.zeros(k, 1, dtype=torch.int32, device="cuda")
    plan = RoutingPlan(1, False, aligned={64: moe_align_block_size_triton(ids, 64, 1)})
    _launch(
        a=x.cuda(),
        w=w,
        c=out,
        topk_weights=torch.ones(k, device="cuda"),
        plan=plan,
        n=rows,
        k=k,
        gated=False,
        qdq=ActivationQDQ(),
        mul_routed_weight=False,
        top_k=1,
        cfg=TileConfig(64, 64, 128, 1, 4, 3),
    )
    got = out.T.cpu()
    # the GEMM's sum 1 * w + 0 * (others) turns -0.0 into +0.0; every other value must match bit for bit
    assert_bits_equal(got, ref + 0.0, element)
