"""Per-token NVFP4 activation scales on the GPU (``@pytest.mark.gpu``, skipped without CUDA).

The compiled Triton twins against the CPU reference bit for bit (the cases of ``test_per_token`` and a
Qwen3-sized activation); the FP4 kernel's per-token MoE on a Qwen3-30B-A3B layer (E 128, top-8, H 2048,
I 768) against the torch backend's (relative L2 < 1e-2: bf16 GEMMs, different accumulation orders), and
its two a1 paths (scales pre-pass + A-load QDQ, standalone pass) bit for bit.
"""

import pytest
import torch
from test_per_token import cases

from mxlib import kernels as K
from mxlib import reference as R

from _util import assert_bits_equal

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("numerics", ["vllm", "hardware"])
def test_gpu_twin_matches_reference(numerics):
    g = torch.Generator().manual_seed(0)
    big = (torch.randn(4096, 2048, generator=g) * torch.exp2(torch.randn(4096, 1, generator=g) * 6)).to(torch.bfloat16)
    x = cases()
    keep = torch.ones(len(x), dtype=torch.bool)
    keep[16] = False  # fp32-subnormal blocks: vLLM's multiplier overflows (0 * Inf), see test_reference_rules
    for t in (x[keep], big, big[:, :768]):
        want = R.nvfp4_per_token_quant_dequant(t, numerics=numerics)
        got = K.nvfp4_per_token_quant_dequant(t.cuda(), numerics=numerics)
        for a, b, name in zip(got, want, ("dq", "per_token_scale")):
            assert_bits_equal(a.cpu(), b, f"{name} {list(t.shape)}")


def _layer(m, seed=0):
    from mxlib.moe import fused_topk, quantize_expert_weights

    e, h, i, k = 128, 2048, 768, 8
    g = torch.Generator(device="cuda").manual_seed(seed)
    w13 = torch.empty(e, 2 * i, h, device="cuda", dtype=torch.bfloat16).normal_(0, 0.02, generator=g)
    w2 = torch.empty(e, h, i, device="cuda", dtype=torch.bfloat16).normal_(0, 0.02, generator=g)
    scale = torch.exp2(torch.randn(m, 1, device="cuda", generator=g) * 4)  # tokens of spread magnitudes
    x = (torch.randn(m, h, device="cuda", generator=g) * scale).to(torch.bfloat16)
    tw, ti = fused_topk(torch.randn(m, e, device="cuda", generator=g), k)
    return quantize_expert_weights(w13, w2, "nvfp4"), x, tw, ti


@pytest.mark.parametrize("numerics", ["vllm", "hardware"])
@pytest.mark.parametrize("m", [1, 64, 512])
def test_gpu_fused_per_token_matches_torch_reference(numerics, m):
    from dataclasses import replace

    from mxlib.kernels.fp4_tiles import get_fp4_configs
    from mxlib.moe import make_emulation_experts

    q, x, tw, ti = _layer(m, seed=m)
    fused = make_emulation_experts("nvfp4", q, backend="auto", numerics=numerics, scale_strategy="per_token")
    assert fused.resolved_backend(x.device) == "fused"
    ref = make_emulation_experts("nvfp4", q, backend="torch", numerics=numerics, scale_strategy="per_token")
    out = fused(x, tw, ti)
    want = ref(x, tw, ti)
    err = ((out.double() - want.double()).norm() / want.double().norm()).item()
    assert err < 1e-2, err
    c1, c2 = get_fp4_configs(m, 128, 8, True, 4)
    fused.fp4_config = (replace(c1, a1_fused=not c1.a1_fused), c2)  # the other a1 path: the same bits
    assert_bits_equal(fused(x, tw, ti), out)
