"""gpt-oss's MoE arithmetic (SwiGLU-OAI, expert biases) on CUDA at full layer shapes: the GPU twin of
``tests/test_swigluoai.py``.

Shapes: gpt-oss-20b (E 32, H = I = 2880, top-4: multiples of 32 but not of 128, so the ``fused`` backend runs
the FP4 kernel on weights zero-padded to 2944, ``mxlib.moe.emulation.FP4_PAD_MAX_FRACTION``, and the
dequantize-GEMM kernel where padding is turned off) and Qwen3-30B-A3B (E 128, H 2048, I 768, top-8: the FP4
kernel, no padding).
Oracle: the ``torch`` backend (``torch_moe``) of the same experts, and transformers' ``GptOssExperts`` for the
bf16 layer. Tolerances (relative L2): the compiled GEMMs sum in another order on bf16 tensor cores and the
Triton epilogues compute ``exp`` with Triton's function, so GEMM outputs move by a bf16 step where a last fp32
bit crosses a rounding, and a2's QDQ may move a value by one element step: 5e-3 for bf16, 2e-2 for the
emulations; SiLU without biases gives the bits of the experts built without the arguments.

Run on the H200: ``python -m pytest -q -p no:cacheprovider tests/test_gpu_swigluoai.py``.
"""

import pytest
import torch

from mxlib.moe import (
    SILU,
    SWIGLUOAI,
    FusedMoEQuantConfig,
    MoEActivation,
    TritonExperts,
    fused_topk,
    input_scales_from_amax,
    make_emulation_experts,
    quantize_expert_weights,
)

from _util import assert_bits_equal

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GPT_OSS_20B = (32, 2880, 2880, 4)  # E, H, I, top-k
QWEN3_30B = (128, 2048, 768, 8)
SHAPES = {"gpt-oss-20b": GPT_OSS_20B, "qwen3-30b-a3b": QWEN3_30B}


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def layer(shape, m, seed=0):
    e, h, i, k = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    w13 = torch.empty(e, 2 * i, h, device="cuda", dtype=torch.bfloat16).normal_(0, 0.03, generator=g)
    w2 = torch.empty(e, h, i, device="cuda", dtype=torch.bfloat16).normal_(0, 0.03, generator=g)
    b13 = torch.randn(e, 2 * i, device="cuda", generator=g)
    b2 = torch.randn(e, h, device="cuda", generator=g) * 0.1
    x = (torch.randn(m, h, device="cuda", generator=g) * 2).to(torch.bfloat16)
    tw, ti = fused_topk(torch.randn(m, e, device="cuda", generator=g), k)
    return w13, w2, b13, b2, x, tw, ti


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("m", [1, 64, 512])
def test_gpu_bf16_experts_triton_vs_torch(shape, m):
    w13, w2, b13, b2, x, tw, ti = layer(SHAPES[shape], m)
    kw = dict(w13_bias=b13, w2_bias=b2)
    ref = TritonExperts(w13, w2, FusedMoEQuantConfig(activation=SWIGLUOAI), backend="torch", **kw)(x, tw, ti)
    out = TritonExperts(w13, w2, FusedMoEQuantConfig(activation=SWIGLUOAI), backend="triton", **kw)(x, tw, ti)
    assert rel(out, ref) < 5e-3
    # the clamp is reached at these scales (first token, first expert)
    e0 = int(ti[0, 0])
    assert ((x[:1].float() @ w13[e0].float().T + b13[e0]).abs() > SWIGLUOAI.limit).any()
    plain = TritonExperts(w13, w2, backend="triton")
    assert_bits_equal(
        TritonExperts(w13, w2, FusedMoEQuantConfig(activation=SILU), backend="triton")(x, tw, ti), plain(x, tw, ti)
    )


def test_gpu_bf16_experts_against_transformers_gpt_oss():
    """transformers' ``GptOssExperts`` (fp32, on an interleaved copy) against mxlib's bf16 experts at
    gpt-oss-20b shapes: bf16 roundings of GEMM outputs and activations, rel 1e-2."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    e, h, i, k = GPT_OSS_20B
    w13, w2, b13, b2, x, tw, ti = layer(GPT_OSS_20B, 64)
    cfg = GptOssConfig(hidden_size=h, intermediate_size=i, num_local_experts=e, num_experts_per_tok=k)
    cfg._experts_implementation = "eager"
    mod = GptOssExperts(cfg).cuda()
    gu = torch.empty(e, h, 2 * i, device="cuda")
    gu[:, :, ::2], gu[:, :, 1::2] = w13[:, :i].float().transpose(1, 2), w13[:, i:].float().transpose(1, 2)
    gub = torch.empty(e, 2 * i, device="cuda")
    gub[:, ::2], gub[:, 1::2] = b13[:, :i], b13[:, i:]
    with torch.no_grad():
        mod.gate_up_proj.copy_(gu)
        mod.gate_up_proj_bias.copy_(gub)
        mod.down_proj.copy_(w2.float().transpose(1, 2))
        mod.down_proj_bias.copy_(b2)
        want = mod(x.float(), ti.long(), tw)
    got = TritonExperts(w13, w2, FusedMoEQuantConfig(activation=SWIGLUOAI), backend="triton", w13_bias=b13, w2_bias=b2)(
        x, tw, ti
    )
    assert rel(got, want) < 1e-2


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("scheme", ["w_mxfp4", "w_mxfp4_a_mxfp4", "nvfp4"])
@pytest.mark.parametrize("m", [1, 64, 512])
def test_gpu_emulation_backends_with_biases(shape, scheme, m, monkeypatch):
    import mxlib.moe.emulation as emu

    e, h, i, k = SHAPES[shape]
    w13, w2, b13, b2, x, tw, ti = layer(SHAPES[shape], m)
    q = quantize_expert_weights(w13, w2, scheme)
    s13, s2 = input_scales_from_amax(
        scheme, torch.full((e,), 2.0 * float(x.float().abs().amax())), torch.full((e,), 16.0)
    )
    s13, s2 = (None, None) if s13 is None else (s13.cuda(), s2.cuda())
    kw = dict(activation=SWIGLUOAI, w13_bias=b13, w2_bias=b2)
    ref = make_emulation_experts(scheme, q, s13, s2, backend="torch", **kw)(x, tw, ti)
    tri = make_emulation_experts(scheme, q, s13, s2, backend="triton", **kw)(x, tw, ti)
    assert rel(tri, ref) < 2e-2
    fused = make_emulation_experts(scheme, q, s13, s2, backend="fused", **kw)
    assert fused.fp4_weights() is not None  # gpt-oss-20b: on the zero-padded copy
    out = fused(x, tw, ti)
    assert rel(out, ref) < 2e-2
    if h % 128:  # the dequantize-GEMM kernel (no padding): the same numbers up to fp32 summation order
        with monkeypatch.context() as mp:
            mp.setattr(emu, "FP4_PAD_MAX_FRACTION", 0.0)
            dq = make_emulation_experts(scheme, q, s13, s2, backend="fused", **kw)
            assert dq.fp4_weights() is None
            assert rel(dq(x, tw, ti), out) < 2e-2
    if scheme == "nvfp4" and fused.fp4_weights() is not None:  # hardware numerics: the FP4 kernel only
        hw = dict(kw, numerics="hardware")
        ref_hw = make_emulation_experts(scheme, q, s13, s2, backend="torch", **hw)(x, tw, ti)
        assert rel(make_emulation_experts(scheme, q, s13, s2, backend="fused", **hw)(x, tw, ti), ref_hw) < 2e-2
    # SiLU without biases: the bits of the experts built without the arguments
    for backend in ("triton", "fused"):
        a = make_emulation_experts(scheme, q, s13, s2, backend=backend)(x, tw, ti)
        b = make_emulation_experts(scheme, q, s13, s2, backend=backend, activation=SILU)(x, tw, ti)
        assert_bits_equal(a, b, backend)


@pytest.mark.parametrize("m", [1, 64, 1024])
def test_gpu_fp4_kernel_harness_swiglu(m):
    """The bench's ``tk_mxfp4`` comparison row (alpha 1.0, no clamp, no bias, weight-only MXFP4) on the FP4
    kernel against the torch backend, Qwen3-30B-A3B layer."""
    e = QWEN3_30B[0]
    w13, w2, _, _, x, tw, ti = layer(QWEN3_30B, m)
    q = quantize_expert_weights(w13, w2, "w_mxfp4")
    act = MoEActivation("swigluoai", alpha=1.0)
    fused = make_emulation_experts("w_mxfp4", q, backend="fused", activation=act)
    assert fused.fp4_weights() is not None and fused.num_experts == e
    ref = make_emulation_experts("w_mxfp4", q, backend="torch", activation=act)(x, tw, ti)
    assert rel(fused(x, tw, ti), ref) < 1e-2
