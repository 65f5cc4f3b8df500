"""Block Hadamard rotation on the GPU (``@pytest.mark.gpu``, skipped without CUDA).

The compiled Triton rotation against the CPU reference bit for bit (Qwen3-sized activations, blocks 16,
32, 128); a rotated Qwen3-30B-A3B layer (E 128, top-8, H 2048, I 768) on the FP4 kernel (a1 rotated in
its pass, a2 in GEMM1's epilogue) against the torch backend's (relative L2 < 1e-2: the same QDQ bits,
bf16 GEMMs in different accumulation orders) and against the dequantize-then-GEMM ``triton`` path, NVFP4
(both numerics, static and per-token scales) and MXFP4; the rotated forward captured in a CUDA graph
replays the eager bits; and the rotation benchmark's rows for two batch sizes.
"""

import pytest
import torch

from mxlib.kernels.hadamard import BlockHadamard, block_hadamard, ref_block_hadamard
from mxlib.recovery.hadamard import HadamardRotation, random_signs

from _util import assert_bits_equal

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

E, H, I, K = 128, 2048, 768, 8


@pytest.mark.parametrize("b", [16, 32, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_rotation_matches_reference(b, dtype):
    g = torch.Generator().manual_seed(b)
    x = (torch.randn(4096, H, generator=g) * torch.exp2(torch.randn(4096, 1, generator=g) * 6)).to(dtype)
    for t, signs in ((x, random_signs(H, 0)), (x[:, :I].contiguous(), random_signs(I, 1)), (x[:37], None)):
        want = ref_block_hadamard(t, b, None if signs is None else signs[: t.shape[-1]])
        got = block_hadamard(t.cuda(), b, None if signs is None else signs[: t.shape[-1]].cuda())
        assert_bits_equal(got.cpu(), want, f"{list(t.shape)} block {b}")


def _layer(m, scheme, seed=0):
    from mxlib.bench.rotation import calibration_scales
    from mxlib.moe import fused_topk
    from mxlib.moe.schemes import get_moe_scheme

    g = torch.Generator(device="cuda").manual_seed(seed)
    w13 = torch.empty(E, 2 * I, H, device="cuda", dtype=torch.bfloat16).normal_(0, 0.02, generator=g)
    w2 = torch.empty(E, H, I, device="cuda", dtype=torch.bfloat16).normal_(0, 0.02, generator=g)
    x = torch.randn(m, H, device="cuda", generator=g).to(torch.bfloat16)
    x[:, ::128] *= 30  # outlier channels
    tw, ti = fused_topk(torch.randn(m, E, device="cuda", generator=g), K)
    s = get_moe_scheme(scheme)
    tech = HadamardRotation(signs="random")
    q = tech.quantize_experts(w13, w2, s, layer=0)
    r = tech.rotation_for(H, I, s)
    r = BlockHadamard(r.block_size, r.signs_h.cuda(), r.signs_i.cuda())
    w13r = ref_block_hadamard(w13, r.block_size, r.signs_h)
    scales = calibration_scales(w13r, x, r, s)
    return s, q, scales, r, x, tw, ti


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize(
    "scheme,numerics,strategy",
    [
        ("nvfp4", "vllm", "max"),
        ("nvfp4", "hardware", "max"),
        ("nvfp4", "vllm", "per_token"),
        ("w_mxfp4_a_mxfp4", "vllm", "max"),
        ("w_mxfp4", "vllm", "max"),
    ],
)
@pytest.mark.parametrize("m", [1, 64, 512])
def test_gpu_rotated_fused_matches_torch_reference(scheme, numerics, strategy, m):
    from mxlib.moe import make_emulation_experts

    s, q, scales, r, x, tw, ti = _layer(m, scheme, seed=m)
    kw = dict(numerics=numerics, scale_strategy=strategy, rotation=r)
    fused = make_emulation_experts(s, q, *scales, backend="auto", **kw)
    assert fused.resolved_backend(x.device) == "fused"
    ref = make_emulation_experts(s, q, *scales, backend="torch", **kw)
    out, want = fused(x, tw, ti), ref(x, tw, ti)
    assert _rel(out, want) < 1e-2, _rel(out, want)
    if numerics == "vllm":  # the dequantize-then-GEMM path rotates with the same kernel
        tri = make_emulation_experts(s, q, *scales, backend="triton", **kw)(x, tw, ti)
        assert _rel(tri, want) < 1e-2
    plain = make_emulation_experts(s, q, *scales, backend="auto", numerics=numerics, scale_strategy=strategy)
    assert _rel(plain(x, tw, ti), want) > 1e-2  # without the online rotation the rotated weights are wrong


def test_gpu_rotated_forward_in_a_cuda_graph():
    from mxlib.bench._common import capture
    from mxlib.moe import make_emulation_experts

    s, q, scales, r, x, tw, ti = _layer(64, "nvfp4", seed=3)
    ex = make_emulation_experts(s, q, *scales, backend="fused", rotation=r)
    eager = ex(x, tw, ti)
    g, out = capture(lambda: ex(x, tw, ti))
    g.replay()
    torch.cuda.synchronize()
    assert_bits_equal(out, eager)


def test_gpu_rotation_bench_rows():
    from mxlib.bench.rotation import run

    res = run([1, 256], log=lambda *_: None)
    assert not res["errors"], res["errors"]
    paths = {r["path"] for r in res["rows"]}
    assert {"fused_nvfp4", "fused_nvfp4_hadamard", "fused_w_mxfp4_a_mxfp4_hadamard", "pass_rotate_a1_16"} <= paths
    assert all(c["rel"] < 1e-2 for c in res["checks"])
    assert len(res["ratios"]) == 4
