"""The fused FP4-weight MoE (``mxlib.kernels.fused_fp4_moe``), its weight layout (``fp4_layout``) and the
Triton alignment.

Oracle: a float64 MoE assembled here from ``mxlib.reference`` (dequantized weights, QDQ'd
activations) for each numerics mode:

* ``vllm``: bf16 weights and activations as vLLM computes them; GEMM1's gate and up and the
  SiLU-and-mul output rounded to bf16 as the kernel does, then a2 QDQ'd;
* ``hardware``: weights ``e2m1 * block_scale * global_scale`` and NVFP4 activations
  ``e2m1 * s / gs`` without the bf16 rounding of the product (fp32, i.e. exact to 2**-24).

Interpreter on small shapes (E 8, H 256, I 128: K must be a multiple of the 128-element K tile);
``@pytest.mark.gpu`` tests run the full Qwen3-30B-A3B layer on a CUDA device.
"""

import pytest
import torch

from mxlib import reference as R
from mxlib.formats import BLOCK_SCHEMES, NVFP4
from mxlib.kernels.align import moe_align_block_size_triton
from mxlib.kernels.fp4_layout import prepare_fp4_weights, unprepare_fp4_weights
from mxlib.kernels.fused_dequant_moe import ActivationQDQ
from mxlib.kernels.fused_fp4_moe import fused_fp4_moe
from mxlib.kernels.tiles import TileConfig
from mxlib.moe import fused_topk, moe_align_block_size

from _util import assert_bits_equal
from oracles import moe_fp64

E, H, I, TOPK = 8, 256, 128, 2
SCHEMES = ["w_mxfp4", "w_mxfp4_a_mxfp4", "nvfp4"]


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def make_layer(scheme, device, e=E, h=H, i=I, m=7, k=TOPK, seed=0):
    """Quantized layer + prepared weights + activation QDQs, and the operands for the oracle."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, h, generator=g, device=device).to(torch.bfloat16)
    w13 = (
        torch.randn(e, 2 * i, h, generator=g, device=device)
        * 0.05
        * torch.exp(torch.randn(e, 1, 1, generator=g, device=device))
    )
    w2 = torch.randn(e, h, i, generator=g, device=device) * 0.05
    tw, ti = fused_topk(torch.randn(m, e, generator=g, device=device), k)
    if scheme == "nvfp4":
        p13, s13, g13 = R.quantize_nvfp4(w13.to(torch.bfloat16))
        p2, s2, g2 = R.quantize_nvfp4(w2.to(torch.bfloat16))
        gs1 = torch.tensor([2688.0 / float(x.float().abs().amax())], device=device)
        gs2 = torch.tensor([2688.0 / 0.05], device=device)
        q1 = ActivationQDQ(NVFP4, scale=gs1.to(device))
        q2 = ActivationQDQ(NVFP4, scale=gs2.to(device))
        dq13 = {
            "vllm": R.dequantize_to_dtype(p13, s13, g13, torch.bfloat16),
            "hardware": R.dequantize_to_dtype(p13, s13, g13, torch.float32),
        }
        dq2 = {
            "vllm": R.dequantize_to_dtype(p2, s2, g2, torch.bfloat16),
            "hardware": R.dequantize_to_dtype(p2, s2, g2, torch.float32),
        }
        pw13 = prepare_fp4_weights(p13.to(device), s13.to(device), 16, g13.to(device))
        pw2 = prepare_fp4_weights(p2.to(device), s2.to(device), 16, g2.to(device))

        def qdq(v, gs, mode):
            return R.ref_nvfp4_quant_dequant(v, gs, dtype=torch.bfloat16 if mode == "vllm" else torch.float32)

        a1 = lambda v, mode: qdq(v, gs1, mode)  # noqa: E731
        a2 = lambda v, mode: qdq(v, gs2, mode)  # noqa: E731
    else:
        p13, s13 = R.quantize_mx(w13.to(torch.bfloat16), "e2m1")
        p2, s2 = R.quantize_mx(w2.to(torch.bfloat16), "e2m1")
        d13, d2 = R.dequantize_mx(p13, s13, "e2m1"), R.dequantize_mx(p2, s2, "e2m1")
        dq13, dq2 = {"vllm": d13, "hardware": d13}, {"vllm": d2, "hardware": d2}
        pw13 = prepare_fp4_weights(p13.to(device), s13.to(device), 32)
        pw2 = prepare_fp4_weights(p2.to(device), s2.to(device), 32)
        if scheme == "w_mxfp4_a_mxfp4":
            q1 = q2 = ActivationQDQ(BLOCK_SCHEMES["mxfp4"])
            a1 = a2 = lambda v, mode: R.quant_dequant_mx(v, "e2m1", 32, "even")  # noqa: E731
        else:
            q1 = q2 = None
            a1 = a2 = lambda v, mode: v  # noqa: E731
    return dict(x=x, tw=tw, ti=ti, pw13=pw13, pw2=pw2, q1=q1, q2=q2, dq13=dq13, dq2=dq2, a1=a1, a2=a2, raw13=p13)


def oracle_fp64(L, mode):
    """float64 MoE from the mode's operands (see the module docstring)."""
    dev = L["x"].device
    return moe_fp64(
        L["a1"](L["x"], mode).cpu(),
        L["dq13"][mode].cpu(),
        L["dq2"][mode].cpu(),
        L["tw"].cpu(),
        L["ti"].cpu(),
        store_dtype=torch.bfloat16,
        a2_fn=lambda act, e: L["a2"](act.to(dev), mode).cpu(),
    )


class DefaultRuns:
    """``make_layer(scheme, device)`` and its ``run`` in each mode with the default tiles, each made once and then
    only read: the interpreter takes tens of seconds a call, and several tests compare against the same output."""

    def __init__(self):
        self.layers, self.outs = {}, {}

    def layer(self, scheme, device):
        if (scheme, device) not in self.layers:
            self.layers[scheme, device] = make_layer(scheme, device)
        return self.layers[scheme, device]

    def out(self, scheme, device, mode):
        if (scheme, device, mode) not in self.outs:
            self.outs[scheme, device, mode] = run(self.layer(scheme, device), device, mode)
        return self.outs[scheme, device, mode]


@pytest.fixture(scope="module")
def default_runs():
    """One ``DefaultRuns`` for the module (module-scoped: ``make test-rest`` keeps the tests using it together)."""
    return DefaultRuns()


def run(L, device, mode, configs=None, m=None):
    sl = slice(None) if m is None else slice(0, m)
    return fused_fp4_moe(
        L["x"][sl].to(device),
        L["pw13"],
        L["pw2"],
        L["tw"][sl].to(device),
        L["ti"][sl].to(device),
        L["q1"],
        L["q2"],
        numerics=mode,
        configs=configs,
    ).cpu()


# ----------------------------------------------------------------------------- layout and alignment


def _rotl(w: torch.Tensor, r: int) -> torch.Tensor:
    return ((w << r) | (w >> (32 - r))) & 0xFFFFFFFF


def test_prepare_round_trip_and_layout():
    g = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (3, 5, 128), generator=g, dtype=torch.uint8)  # K = 256
    scales = torch.randint(100, 140, (3, 5, 8), generator=g, dtype=torch.uint8)
    w = prepare_fp4_weights(packed, scales, 32)
    assert_bits_equal(unprepare_fp4_weights(w), packed)
    codes = torch.stack((packed & 0xF, packed >> 4), -1).reshape(3, 5, 256)
    # the documented rule, element by element: word c*4 + j of K tile t holds, as its element
    # 2h + e (4 + 2h + e), the code of 128 t + p (128 t + 64 + p), p = 16 j + 8 h + 2 c + e; the
    # decode's output i (rotations 0, 20, 26; output 3: bits 6 / 22 rotated by 6, the rest by 14),
    # masked to bits 6..8 | 15 (+16), holds element 2i in its low bf16 and 2i + 1 in its high one
    words = w.packed.view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # [3, 5, 32]
    outs = [
        words & 0x81C081C0,
        _rotl(words, 20) & 0x81C081C0,
        _rotl(words, 26) & 0x81C081C0,
        (_rotl(words, 6) & 0x00400040) | (_rotl(words, 14) & 0x81808180),
    ]
    assert all(((o & ~0x81C081C0) == 0).all() for o in outs)
    elements = []
    for o in outs:
        elements += [((o >> 6) & 7) | ((o >> 12) & 8), ((o >> 22) & 7) | ((o >> 28) & 8)]
    for t in range(2):
        for c in range(4):
            for j in range(4):
                for h in range(2):
                    for e in range(2):
                        word, p = 16 * t + c * 4 + j, 128 * t + 16 * j + 8 * h + 2 * c + e
                        assert_bits_equal(elements[2 * h + e][:, :, word].to(torch.uint8), codes[:, :, p])
                        assert_bits_equal(elements[4 + 2 * h + e][:, :, word].to(torch.uint8), codes[:, :, p + 64])
    assert w.packed.numel() == packed.numel()  # no extra memory


def test_one_multiply_rule():
    """The one-multiply decode needs E8M0 bytes <= 128 (MX) and fp32(ue4m3) * global_scale < 4 (NVFP4)."""
    from mxlib.kernels.fp4_layout import fp4_one_multiply

    s = torch.full((2, 4, 8), 128, dtype=torch.uint8)
    assert fp4_one_multiply(s, 32, None)
    s[1, 3, 7] = 129
    assert not fp4_one_multiply(s, 32, None)
    s[1, 3, 7] = 255  # NaN scale: the two-multiply form keeps it NaN
    assert not fp4_one_multiply(s, 32, None)
    e4m3 = torch.full((2, 4, 8), 448.0).to(torch.float8_e4m3fn)
    assert fp4_one_multiply(e4m3.view(torch.uint8), 16, torch.tensor([2.0**-7, 2.0**-8]))  # 448 / 128 = 3.5
    assert not fp4_one_multiply(e4m3.view(torch.uint8), 16, torch.tensor([2.0**-8, 2.0**-6]))  # 7 in expert 1
    assert not fp4_one_multiply(e4m3.view(torch.uint8), 16, torch.tensor([[2.0**-8, 2.0**-6]] * 2))  # up half
    tiny = torch.full((2, 4, 8), 2.0**-9).to(torch.float8_e4m3fn).view(torch.uint8)  # subnormal ue4m3
    assert fp4_one_multiply(tiny, 16, torch.tensor([4 - 2.0**-20, 2.0**-117]))
    assert not fp4_one_multiply(tiny, 16, torch.tensor([4.0, 1.0]))  # g * 2**126 overflows
    assert not fp4_one_multiply(tiny, 16, torch.tensor([1.0, 2.0**-118]))  # B could be an fp32 subnormal


def test_prepare_rejects_bad_input():
    with pytest.raises(ValueError, match="K=192 is not a multiple of the kernel's K tile 128"):
        prepare_fp4_weights(torch.zeros(1, 2, 96, dtype=torch.uint8), torch.zeros(1, 2, 6, dtype=torch.uint8), 32)
    with pytest.raises(ValueError, match="global_scale: required for NVFP4"):
        prepare_fp4_weights(torch.zeros(1, 2, 64, dtype=torch.uint8), torch.zeros(1, 2, 8, dtype=torch.uint8), 16)
    with pytest.raises(ValueError, match=r"scales: expected shape \[1, 2, 4\]"):
        prepare_fp4_weights(torch.zeros(1, 2, 64, dtype=torch.uint8), torch.zeros(1, 2, 8, dtype=torch.uint8), 32)


@pytest.mark.parametrize(
    "m,k,e,bm", [(1, 8, 128, 16), (5, 8, 16, 16), (64, 8, 128, 16), (200, 6, 8, 32), (300, 8, 128, 64), (33, 2, 7, 4)]
)
@pytest.mark.slow
def test_triton_align_matches_torch(m, k, e, bm, device):
    g = torch.Generator().manual_seed(m * 1000 + e)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)]).int()
    got = moe_align_block_size_triton(ids.to(device), bm, e)
    want = moe_align_block_size(ids, bm, e)
    for a, b, name in zip(got, want, ("sorted_token_ids", "expert_ids", "num_tokens_post_padded")):
        assert_bits_equal(a.cpu(), b, name)


def test_routing_plan():
    """One plan a forward: naive for tiny batches where the kernels allow it (vLLM's M * k * 4 <= E),
    else ``moe_align_block_size`` once for each distinct block_m; an unplanned block_m is refused."""
    from mxlib.kernels.align import plan_routing

    ids = torch.tensor([[3, 1]], dtype=torch.int32)
    naive = plan_routing(ids, 8, (16, 32))
    assert naive.naive and naive.aligned == {}
    sorted_ids, eid, post = naive.blocks(64)
    assert sorted_ids is None and post is None and eid.tolist() == [3, 1]
    aligned = plan_routing(ids, 8, (16, 16), naive_ok=False)
    assert not aligned.naive and list(aligned.aligned) == [16]
    for a, b in zip(aligned.blocks(16), moe_align_block_size(ids, 16, 8)):
        assert_bits_equal(a, b)
    with pytest.raises(ValueError, match=r"block_m: the routing plan is aligned for block_m \[16\], got 32"):
        aligned.blocks(32)
    with pytest.raises(ValueError, match=r"topk_ids: expected \[M, k\]"):
        plan_routing(ids.reshape(-1), 8, (16,))


def test_numerics_names_resolve_once():
    from mxlib.formats import Numerics, get_numerics

    assert get_numerics("vllm") is Numerics.VLLM and get_numerics(Numerics.HARDWARE) is Numerics.HARDWARE
    assert Numerics.HARDWARE == "hardware" and str(Numerics.VLLM) == "vllm"
    assert [n.kernel_id for n in Numerics] == [0, 1]  # the FP4 kernel's MODE constexpr
    with pytest.raises(ValueError, match=r"numerics: expected one of \['vllm', 'hardware'\], got 'seed'"):
        get_numerics("seed")


# ----------------------------------------------------------------------------- the MoE


@pytest.mark.slow
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("mode", ["vllm", "hardware"])
def test_fused_fp4_against_fp64(scheme, mode, device, default_runs):
    L = default_runs.layer(scheme, device)
    out = default_runs.out(scheme, device, mode)
    err = rel_err(out, oracle_fp64(L, mode))
    assert err < 5e-3, err  # bf16 GEMM outputs: ~1e-3
    if mode == "hardware" and scheme == "nvfp4":
        # the modes differ by vLLM's bf16 rounding of the dequantized operands: measurably
        assert rel_err(out, default_runs.out(scheme, device, "vllm")) > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["nvfp4", "w_mxfp4_a_mxfp4"])
def test_fused_fp4_naive_blocks_and_standalone_a1(scheme, device):
    L = make_layer(scheme, device, m=9)
    want = oracle_fp64(L, "vllm")
    # M = 1: M * k * 4 <= E, so each pair is its own block (no alignment)
    one = run(L, device, "vllm", m=1)
    assert rel_err(one, want[:1]) < 5e-3
    # tiles other than the interpreter's default (16 x 32): 32 and 16 pairs a row block; 64 and 128 output columns,
    # so that GEMM1 (N = I = 128, gate and up rows in one program) and GEMM2 (N = H = 256) each take two column
    # blocks, each loading (and, fused, QDQ'ing) the same A tile over GEMM1's two K steps of 128; narrower columns
    # (32 and 64) repeat the same cases in twice the interpreter's programs
    cfg = (TileConfig(32, 64, None, 2, 4, 1, a1_fused=False), TileConfig(16, 128, None, 1, 4, 1))
    standalone = {mode: run(L, device, mode, configs=cfg) for mode in ("vllm", "hardware")}
    assert rel_err(standalone["vllm"], want) < 5e-3
    # a1 QDQ in its own pass or in the A-tile load: the same bits, in both numerics modes
    fused = (TileConfig(32, 64, None, 2, 4, 1, a1_fused=True), cfg[1])
    for mode in ("vllm", "hardware"):
        assert_bits_equal(standalone[mode], run(L, device, mode, configs=fused))


# ----------------------------------------------------------------------------- H200, full shapes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("mode", ["vllm", "hardware"])
@pytest.mark.parametrize("m", [1, 64, 512])
def test_gpu_full_shape_against_fp64(scheme, mode, m):
    L = make_layer(scheme, "cuda", e=128, h=2048, i=768, m=m, k=8, seed=m)
    out = run(L, "cuda", mode)
    # the float64 oracle on the GPU (full shapes)
    ref = moe_fp64(
        L["a1"](L["x"], mode).cuda(),
        L["dq13"][mode].cuda(),
        L["dq2"][mode].cuda(),
        L["tw"].cuda(),
        L["ti"].cuda(),
        store_dtype=torch.bfloat16,
        a2_fn=lambda act, e: L["a2"](act, mode),
    ).cpu()
    err = rel_err(out, ref)
    assert err < 1e-2, err


def _every_code(i: int, h: int) -> torch.Tensor:
    """Packed bytes ``[1, 2I, H/2]`` cycling through all 256 byte values (every pair of e2m1 codes)."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(2 * i * h // 2 // 256 + 1)[: 2 * i * h // 2]
    return codes.view(1, 2 * i, h // 2)


def _weight_columns(pw, i: int, h: int, mode: str = "vllm") -> torch.Tensor:
    """The ``[2I, H]`` weights the kernel computes with, read through it: a GEMM2-style launch (no
    gating) over all 2I rows with a one-hot activation per token, so ``out[t, n] = W[n, t]``."""
    from mxlib.formats import Numerics
    from mxlib.kernels.align import RoutingPlan
    from mxlib.kernels.fused_fp4_moe import _launch

    x = torch.zeros(h, h, dtype=torch.bfloat16)
    x[torch.arange(h), torch.arange(h)] = 1
    out = torch.empty(h, 2 * i, dtype=torch.bfloat16, device="cuda")
    ids = torch.zeros(h, 1, dtype=torch.int32, device="cuda")
    plan = RoutingPlan(1, False, aligned={64: moe_align_block_size_triton(ids, 64, 1)})
    one = torch.ones(h, device="cuda")
    _launch(
        a=x.cuda(),
        w=pw,
        c=out,
        topk_weights=one,
        plan=plan,
        n=2 * i,
        gated=False,
        a_qdq=None,
        a_inv=None,
        c_qdq=None,
        numerics=Numerics(mode),
        mul_routed_weight=False,
        top_k=1,
        tiles=TileConfig(64, 64, None, 1, 4, 3),
    )
    return out.T.cpu()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("top", [249, 128])
def test_gpu_decode_bits_match_reference(top):
    """The PTX decode gives the reference's bf16 weights bit for bit (every code x scale byte):
    a one-hot activation reads single weight columns through the whole MoE. Scale bytes up to
    ``top``: 249 takes the two-multiply decode, 128 the one-multiply one (``fp4_one_multiply``)."""
    i, h = 128, 256
    packed = _every_code(i, h)
    # every scale byte whose products stay finite and normal (a NaN / Inf weight would reach every
    # output through 0 * w; subnormal dot operands are not what this test is about)
    scales = (2 + torch.arange(2 * i * h // 32, dtype=torch.int64).remainder(top - 1)).to(torch.uint8)
    scales = scales.view(1, 2 * i, h // 32)
    ref = R.dequantize_mx(packed, scales, "e2m1")  # [1, 2I, H] bf16
    pw = prepare_fp4_weights(packed.cuda(), scales.cuda(), 32)
    assert pw.one_multiply == (top <= 128)
    # the GEMM's sum 1 * w + 0 * (others) turns -0.0 into +0.0; every other value must match bit for bit
    assert_bits_equal(_weight_columns(pw, i, h), ref[0] + 0.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode,g", [("vllm", 0.375), ("vllm", 0.375 / 64), ("hardware", 0.25)])
def test_gpu_nvfp4_decode_bits_match_reference(mode, g):
    """NVFP4: every e2m1 code under every finite ue4m3 scale byte (subnormal scales included), the
    PTX scale decode (e4m3 -> f16 -> f32) and, in vLLM mode, the fp32 product with the global scale
    (``g`` 0.375: two multiplies; 0.375 / 64: the one-multiply decode, ``fp4_one_multiply``):
    vLLM operands equal ``dequantize_to_dtype`` bit for bit; hardware operands are ``e2m1 * ue4m3``
    exactly, with the global scale (a power of two here, so exact) on the fp32 accumulator."""
    i, h = 128, 256
    packed = _every_code(i, h)
    scales = torch.arange(2 * i * h // 16, dtype=torch.int64).remainder(127).to(torch.uint8).view(1, 2 * i, h // 16)
    g = torch.tensor([g])  # vllm: products that round; hardware: exact
    ref = R.dequantize_to_dtype(packed, scales.view(torch.float8_e4m3fn), g, torch.bfloat16, 16)[0]
    if mode == "hardware":  # e2m1 * ue4m3 is exact in bf16; times 1/4 exact too
        ref = (
            R.dequantize_to_dtype(packed, scales.view(torch.float8_e4m3fn), torch.ones(1), torch.float32, 16)[0] * 0.25
        ).to(torch.bfloat16)
    pw = prepare_fp4_weights(packed.cuda(), scales.cuda(), 16, g.cuda())
    assert pw.one_multiply == (float(g) < 4 / 448)
    assert_bits_equal(_weight_columns(pw, i, h, mode), ref + 0.0)


def test_fused_fp4_rejects_bad_input():
    L = make_layer("w_mxfp4", "cpu")
    with pytest.raises(TypeError, match="hidden_states: expected dtype torch.bfloat16"):
        fused_fp4_moe(L["x"].half(), L["pw13"], L["pw2"], L["tw"], L["ti"])
    with pytest.raises(ValueError, match=r"numerics: expected one of \['vllm', 'hardware'\], got 'fast'"):
        fused_fp4_moe(L["x"], L["pw13"], L["pw2"], L["tw"], L["ti"], numerics="fast")
    with pytest.raises(ValueError, match=r"hidden_states: expected \[M, 256\]"):
        fused_fp4_moe(L["x"][:, :128], L["pw13"], L["pw2"], L["tw"], L["ti"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("numerics", ["vllm", "hardware"])
@pytest.mark.parametrize("m", [1, 64, 1024])
def test_gpu_experts_fused_matches_torch_reference(numerics, m):
    """The experts' ``fused`` backend (FP4 kernel, auto's pick on CUDA) against the pure-PyTorch
    reference of the same numerics, full Qwen3-30B-A3B layer, NVFP4."""
    from mxlib.moe import fused_topk as topk
    from mxlib.moe import make_emulation_experts, quantize_expert_weights

    e, h, i, k = 128, 2048, 768, 8
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.empty(e, 2 * i, h, device="cuda", dtype=torch.bfloat16).normal_(0, 0.02, generator=g)
    w2 = torch.empty(e, h, i, device="cuda", dtype=torch.bfloat16).normal_(0, 0.02, generator=g)
    x = torch.randn(m, h, device="cuda", generator=g).to(torch.bfloat16)
    tw, ti = topk(torch.randn(m, e, device="cuda", generator=g), k)
    q = quantize_expert_weights(w13, w2, "nvfp4")
    in13 = torch.full((e,), float(x.float().abs().amax()) / 2688.0, device="cuda")
    in2 = torch.full((e,), 0.02 / 2688.0, device="cuda")
    fused = make_emulation_experts("nvfp4", q, in13, in2, backend="auto", numerics=numerics)
    assert fused.resolved_backend(x.device) == "fused" and fused.prepared is not None
    ref = make_emulation_experts("nvfp4", q, in13, in2, backend="torch", numerics=numerics)
    assert rel_err(fused(x, tw, ti), ref(x, tw, ti)) < 1e-2


@pytest.mark.slow
def test_fused_fp4_bad_input_and_layouts(device, default_runs):
    """Adversarial calls: a non-contiguous activation view gives the contiguous result; unprepared
    weights, float ids, mismatched experts / H, float scale bytes and unpreparable shapes are refused
    naming the argument."""
    L = default_runs.layer("w_mxfp4", device)
    wide = torch.zeros(L["x"].shape[0], 2 * H, dtype=torch.bfloat16, device=L["x"].device)
    wide[:, ::2] = L["x"]
    view = wide[:, ::2]  # stride (2H, 2)
    assert not view.is_contiguous()
    # the contiguous input's output: fused_fp4_moe(L["x"], L["pw13"], L["pw2"], L["tw"], L["ti"]) (vLLM numerics,
    # the default tiles, no activation QDQ for w_mxfp4), as test_fused_fp4_against_fp64 computes it
    assert_bits_equal(
        fused_fp4_moe(view, L["pw13"], L["pw2"], L["tw"], L["ti"]).cpu(), default_runs.out("w_mxfp4", device, "vllm")
    )
    with pytest.raises(TypeError, match="w13: expected FP4Weights or FP6Weights"):
        fused_fp4_moe(L["x"], L["pw13"].packed, L["pw2"], L["tw"], L["ti"])
    with pytest.raises(TypeError, match="topk_ids: expected an integer tensor"):
        fused_fp4_moe(L["x"], L["pw13"], L["pw2"], L["tw"], L["ti"].float())
    from dataclasses import replace as dc_replace

    few = dc_replace(L["pw2"], packed=L["pw2"].packed[:4], scales=L["pw2"].scales[:4])
    with pytest.raises(ValueError, match=r"w2: expected \[E=8, H=256"):
        fused_fp4_moe(L["x"], L["pw13"], few, L["tw"], L["ti"])
    with pytest.raises(ValueError, match=r"scales: expected the scale bytes as torch.uint8"):
        prepare_fp4_weights(torch.zeros(1, 2, 64, dtype=torch.uint8), torch.zeros(1, 2, 4), 32)
    from mxlib.kernels.fp4_layout import fp4_one_multiply, unprepare_fp4_packed

    with pytest.raises(ValueError, match="global_scale: required for NVFP4"):
        fp4_one_multiply(torch.zeros(1, 2, 8, dtype=torch.uint8), 16, None)
    with pytest.raises(ValueError, match="packed: expected prepared uint8"):
        unprepare_fp4_packed(torch.zeros(1, 2, 48, dtype=torch.uint8))


def test_experts_reread_one_multiply_after_a_scale_write(device):
    """The experts cache ``fp4_one_multiply`` (a host read) and read it again when a scale tensor is
    written in place (autograd's version counter) or replaced."""
    from mxlib.moe import fused_topk as topk
    from mxlib.moe import make_emulation_experts, quantize_expert_weights

    g = torch.Generator().manual_seed(4)
    w13 = (torch.randn(4, 256, 128, generator=g) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(4, 128, 128, generator=g) * 0.02).to(torch.bfloat16)
    q = quantize_expert_weights(w13, w2, "w_mxfp4")
    ex = make_emulation_experts("w_mxfp4", q.to(device), backend="fused")
    assert ex.fp4_weights()[0].one_multiply
    with torch.no_grad():
        ex.w13_weight_scale.view(torch.uint8)[0, 0, 0] = 140  # a block scale of 2**13
    assert not ex.fp4_weights()[0].one_multiply and ex.fp4_weights()[1].one_multiply
    x = torch.randn(3, 128, generator=g).to(torch.bfloat16)
    tw, ti = topk(torch.randn(3, 4, generator=g), 2)
    ref = make_emulation_experts("w_mxfp4", quantize_expert_weights(w13, w2, "w_mxfp4"), backend="torch")
    with torch.no_grad():
        ref.w13_weight_scale.view(torch.uint8)[0, 0, 0] = 140
    out = ex(x.to(device), tw.to(device), ti.to(device)).cpu()
    assert rel_err(out, ref(x, tw, ti)) < 5e-3
