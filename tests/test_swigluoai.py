"""gpt-oss's MoE arithmetic: the SwiGLU-OAI activation (``mxlib.moe.activations``) and expert biases, in the
reference MoE (``torch_moe``), the experts classes and their ``triton`` / ``fused`` backends.

Oracles:

* the activation: a float64 transcription of the formula (vLLM's ``swigluoai_and_mul``), and transformers'
  ``GptOssExperts`` (its own module, on an interleaved copy of the weights);
* ``torch_moe`` with biases: a float64 loop over (token, expert) pairs written here, rounding where the
  reference says it rounds;
* the backends: the ``torch`` backend (the reference); the activation function is one PyTorch function on
  ``torch`` and ``triton`` (bits equal), the Triton epilogues compute it with Triton's ``exp`` (last-bit
  differences, so a stated tolerance), and the GEMMs differ by fp32 accumulation order.

Interpreter-sized shapes; ``tests/test_gpu_swigluoai.py`` runs the same comparisons at gpt-oss-20b and
Qwen3-30B-A3B shapes on CUDA.
"""

import math

import pytest
import torch

from mxlib.moe import (
    SILU,
    SWIGLUOAI,
    FusedMoEQuantConfig,
    MoEActivation,
    activation_and_mul,
    fused_topk,
    get_activation,
    silu_and_mul,
    torch_moe,
)

from _util import assert_bits_equal


def swigluoai_fp64(x: torch.Tensor, alpha: float, limit: float | None) -> torch.Tensor:
    """The formula in float64, gate columns first (vLLM's ``swigluoai_and_mul`` on de-interleaved columns)."""
    d = x.shape[-1] // 2
    g, u = x[..., :d].double(), x[..., d:].double()
    if limit is not None:
        g = torch.where(g > limit, torch.full_like(g, limit), g)
        u = torch.where(u > limit, torch.full_like(u, limit), torch.where(u < -limit, torch.full_like(u, -limit), u))
    return (u + 1) * g / (1 + torch.exp(-alpha * g))


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """One bf16 step at each |x| (normal range)."""
    e = torch.floor(torch.log2(x.abs().clamp(min=2.0**-126)))
    return torch.exp2(e - 7)


# ----------------------------------------------------------------------------- the activation


def test_activation_table_and_names():
    assert SWIGLUOAI == MoEActivation("swigluoai", alpha=1.702, limit=7.0)
    assert SILU == MoEActivation("silu") and SILU.alpha == 1.0 and SILU.limit is None
    assert get_activation("swigluoai") is SWIGLUOAI and get_activation("silu") is SILU
    harness = MoEActivation("swigluoai", alpha=1.0)
    assert get_activation(harness) is harness and (SILU.kernel_id, SWIGLUOAI.kernel_id) == (0, 1)
    with pytest.raises(ValueError, match=r"activation: expected one of \['silu', 'swigluoai'\], got 'gelu'"):
        get_activation("gelu")
    with pytest.raises(ValueError, match=r"act: expected one of"):
        get_activation("relu", argname="act")
    with pytest.raises(TypeError, match="activation: expected a MoEActivation or a name, got int"):
        get_activation(3)
    with pytest.raises(ValueError, match="name: expected one of"):
        MoEActivation("swiglu")
    with pytest.raises(ValueError, match="limit: expected a positive finite number or None, got -1.0"):
        MoEActivation("swigluoai", limit=-1.0)
    with pytest.raises(ValueError, match="alpha: expected a finite number, got nan"):
        MoEActivation("swigluoai", alpha=math.nan)
    with pytest.raises(ValueError, match="silu: takes alpha=1.0 and limit=None"):
        MoEActivation("silu", limit=7.0)
    with pytest.raises(ValueError, match=r"x: expected an even last dimension"):
        activation_and_mul(torch.zeros(2, 3), SWIGLUOAI)
    with pytest.raises(TypeError, match="activation: expected a MoEActivation"):
        activation_and_mul(torch.zeros(2, 4), "swigluoai")


def test_silu_default_is_silu_and_mul_bits():
    x = (torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * 4).to(torch.bfloat16)
    assert_bits_equal(activation_and_mul(x), silu_and_mul(x))
    assert_bits_equal(activation_and_mul(x, SILU), silu_and_mul(x))


@pytest.mark.parametrize("act", [SWIGLUOAI, MoEActivation("swigluoai", alpha=1.0)], ids=["gpt-oss", "alpha1-noclamp"])
def test_swigluoai_against_fp64(act):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 128, generator=g) * 6  # many values beyond the clamp of 7
    # fp32 in and out: a few fp32 steps of the float64 value (exp / sigmoid are libm functions)
    ref = swigluoai_fp64(x, act.alpha, act.limit)
    out = activation_and_mul(x, act)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=4e-7 * 8, atol=1e-30)
    # bf16 in and out: one rounding of the fp32 result, so within one bf16 step of the float64 value,
    # equal to its bf16 rounding almost everywhere (where fp32 error crosses a bf16 tie, one step off)
    xb = x.to(torch.bfloat16)
    refb = swigluoai_fp64(xb, act.alpha, act.limit)
    outb = activation_and_mul(xb, act)
    assert outb.dtype == torch.bfloat16
    assert ((outb.double() - refb).abs() <= bf16_ulp(refb)).all()
    assert (outb == refb.to(torch.bfloat16)).float().mean() > 0.99


def test_swigluoai_clamp_points_and_nan():
    """Hand values: the gate is clamped from above only, up on both sides, NaN passes through."""
    lim = 7.0
    gate = torch.tensor([100.0, -100.0, 0.0, 7.0, 8.0, float("nan"), 1.0])
    up = torch.tensor([100.0, 5.0, 3.0, -100.0, -1.0, 0.0, float("nan")])
    out = activation_and_mul(torch.cat([gate, up])[None], SWIGLUOAI)[0].double()
    sig = lambda v: 1 / (1 + math.exp(-1.702 * v))  # noqa: E731
    want = [
        (lim + 1) * lim * sig(lim),  # both clamped above
        (5 + 1) * -100 * sig(-100),  # the gate is not clamped below
        0.0,  # gate 0
        (-lim + 1) * lim * sig(lim),  # up clamped below
        0.0,  # up -1: (up + 1) = 0
    ]
    torch.testing.assert_close(out[:5], torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=1e-30)
    assert torch.isnan(out[5:]).all()
    # without a limit nothing is clamped
    free = activation_and_mul(torch.tensor([[100.0, 100.0]]), MoEActivation("swigluoai", alpha=1.702))
    assert float(free) == pytest.approx(101 * 100 * sig(100), rel=1e-6)


def _gpt_oss_experts(e, h, i, seed=0):
    """transformers' ``GptOssExperts`` with random weights and biases, and the same experts in mxlib's
    layout: ``w13 [E, 2I, H]`` gate rows then up rows (de-interleaved), ``w2 [E, H, I]``."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = GptOssConfig(hidden_size=h, intermediate_size=i, num_local_experts=e, num_experts_per_tok=2)
    cfg._experts_implementation = "eager"
    mod = GptOssExperts(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        mod.gate_up_proj.copy_(torch.randn(e, h, 2 * i, generator=g) * 0.2)
        mod.gate_up_proj_bias.copy_(torch.randn(e, 2 * i, generator=g))
        mod.down_proj.copy_(torch.randn(e, i, h, generator=g) * 0.2)
        mod.down_proj_bias.copy_(torch.randn(e, h, generator=g))
    gu, gub = mod.gate_up_proj.detach(), mod.gate_up_proj_bias.detach()
    w13 = torch.cat([gu[:, :, ::2], gu[:, :, 1::2]], dim=2).transpose(1, 2).contiguous()
    b13 = torch.cat([gub[:, ::2], gub[:, 1::2]], dim=1).contiguous()
    w2 = mod.down_proj.detach().transpose(1, 2).contiguous()
    return mod, w13, b13, w2, mod.down_proj_bias.detach().clone(), (cfg.swiglu_alpha, cfg.swiglu_limit)


def test_torch_moe_matches_transformers_gpt_oss_experts():
    """fp32 everywhere: transformers' module and ``torch_moe`` compute the same function; they differ by fp32
    summation order only (GEMM, top-k sum): rtol 1e-5."""
    e, h, i, m, k = 4, 64, 32, 9, 2
    mod, w13, b13, w2, b2, (alpha, limit) = _gpt_oss_experts(e, h, i)
    assert (alpha, limit) == (SWIGLUOAI.alpha, SWIGLUOAI.limit)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(m, h, generator=g) * 2
    tw, ti = fused_topk(torch.randn(m, e, generator=g), k)
    with torch.no_grad():
        want = mod(x, ti.long(), tw)
    got = torch_moe(x, w13, w2, tw, ti, activation=SWIGLUOAI, w13_bias=b13, w2_bias=b2)
    # the clamp is reached (else the test would not see where it applies)
    h1 = torch.einsum("mh,enh->emn", x, w13) + b13[:, None]
    assert (h1 > limit).any() and (h1 < -limit).any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def moe_loop_fp64(x, w13, w2, tw, ti, act, b13=None, b2=None, store=torch.bfloat16):
    """The MoE pair by pair in float64, rounded to ``store`` where ``torch_moe`` rounds (GEMM1 + bias, the
    activation, GEMM2 + bias times the router weight) and summed over k in float64."""
    m, k = ti.shape
    i = w13.shape[1] // 2
    out = torch.zeros(m, w2.shape[1], dtype=torch.float64)
    for t in range(m):
        for j in range(k):
            e = int(ti[t, j])
            h1 = w13[e].double() @ x[t].double()
            if b13 is not None:
                h1 = h1 + b13[e].double()
            h1 = h1.to(store)
            if act.kernel_id == 0:
                g = h1[:i].double()
                a = (g / (1 + torch.exp(-g)) * h1[i:].double()).to(store)
            else:
                a = swigluoai_fp64(h1, act.alpha, act.limit).to(store)
            y = w2[e].double() @ a.double()
            if b2 is not None:
                y = y + b2[e].double()
            out[t] += (y * float(tw[t, j])).to(store).double()
    return out


def _layer(e=8, h=64, i=32, m=7, k=2, seed=0, dtype=torch.bfloat16, bias_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, h, generator=g) * 2).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * 0.3).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) * 0.2).to(dtype)
    b13 = torch.randn(e, 2 * i, generator=g).to(bias_dtype)
    b2 = torch.randn(e, h, generator=g).to(bias_dtype)
    tw, ti = fused_topk(torch.randn(m, e, generator=g), k)
    return x, w13, w2, b13, b2, tw, ti


@pytest.mark.parametrize("act", [SILU, SWIGLUOAI], ids=["silu", "swigluoai"])
@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16])
def test_torch_moe_with_biases_against_fp64_loop(act, bias_dtype):
    x, w13, w2, b13, b2, tw, ti = _layer(bias_dtype=bias_dtype)
    got = torch_moe(x, w13, w2, tw, ti, activation=act, w13_bias=b13, w2_bias=b2)
    want = moe_loop_fp64(x, w13, w2, tw, ti, act, b13, b2)
    # the rounding points are the same; fp32 vs float64 GEMMs move a rounded value by at most one bf16 step
    err = (got.double() - want).norm() / want.norm()
    assert err < 2e-3, err
    # the biases matter: without them the result is far away
    assert (torch_moe(x, w13, w2, tw, ti, activation=act).double() - want).norm() / want.norm() > 0.1
    # SiLU without biases: the reference's bits as they are without the new arguments
    if act is SILU:
        assert_bits_equal(torch_moe(x, w13, w2, tw, ti, activation=SILU), torch_moe(x, w13, w2, tw, ti))


def test_torch_moe_bias_placement_is_the_stated_one():
    """GEMM1's bias goes before the rounding and the activation, GEMM2's before the router weight: a single
    pair with router weight 0.5 against the hand-written order."""
    x, w13, w2, b13, b2, _, _ = _layer(m=1, e=2)
    tw, ti = torch.tensor([[0.5]]), torch.tensor([[1]])
    h1 = ((x.float() @ w13[1].float().T) + b13[1]).to(torch.bfloat16)
    a = activation_and_mul(h1, SWIGLUOAI)
    y = (((a.float() @ w2[1].float().T) + b2[1]) * 0.5).to(torch.bfloat16)
    assert_bits_equal(torch_moe(x, w13, w2, tw, ti, activation=SWIGLUOAI, w13_bias=b13, w2_bias=b2), y)


# ----------------------------------------------------------------------------- the experts and their backends


def _quantized_layer(scheme, e, h, i, m, k=2, seed=0):
    """A layer quantized in ``scheme`` with biases, its routing and input (CPU)."""
    from mxlib.moe import input_scales_from_amax, quantize_expert_weights

    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * 0.3).to(torch.bfloat16)
    w2 = (torch.randn(e, h, i, generator=g) * 0.3).to(torch.bfloat16)
    x = (torch.randn(m, h, generator=g) * 2).to(torch.bfloat16)
    b13 = torch.randn(e, 2 * i, generator=g) * 2
    b2 = torch.randn(e, h, generator=g)
    tw, ti = fused_topk(torch.randn(m, e, generator=g), k)
    q = quantize_expert_weights(w13, w2, scheme)
    s13, s2 = input_scales_from_amax(
        scheme, torch.full((e,), 2.0 * float(x.float().abs().amax())), torch.full((e,), 8.0)
    )
    return q, s13, s2, x, tw, ti, b13, b2


def _make(scheme, q, s13, s2, backend, act, b13, b2):
    from mxlib.moe import make_emulation_experts

    return make_emulation_experts(scheme, q, s13, s2, backend=backend, activation=act, w13_bias=b13, w2_bias=b2)


def test_experts_hold_activation_and_biases_and_check_them():
    from mxlib.moe import TritonExperts

    x, w13, w2, b13, b2, tw, ti = _layer()
    ex = TritonExperts(w13, w2, FusedMoEQuantConfig(activation="swigluoai"), backend="torch", w13_bias=b13, w2_bias=b2)
    assert ex.activation is SWIGLUOAI and ex.w13_bias is not None and ex.w2_bias is not None
    assert torch.equal(ex.w13_bias, b13) and torch.equal(ex.w2_bias, b2)
    plain = TritonExperts(w13, w2, backend="torch")
    assert plain.activation is SILU and plain.w13_bias is None and plain.w2_bias is None
    e, two_i = b13.shape
    h = b2.shape[1]
    with pytest.raises(
        ValueError, match=rf"w13_bias: expected shape \[{e}, {two_i}\] \(\[E, 2I\]\), got \[{e}, {two_i // 2}\]"
    ):
        TritonExperts(w13, w2, w13_bias=b13[:, : two_i // 2])
    with pytest.raises(ValueError, match=rf"w2_bias: expected shape \[{e}, {h}\] \(\[E, H\]\), got \[{h}\]"):
        TritonExperts(w13, w2, w2_bias=b2[0])
    with pytest.raises(
        TypeError,
        match=r"w13_bias: expected dtype float32, bfloat16 or float16, got torch.float64",
    ):
        TritonExperts(w13, w2, w13_bias=b13.double())
    # a bias in another activation dtype is read as fp32 by every GEMM path (and kept as given through casts)
    assert TritonExperts(w13, w2, w13_bias=b13.half()).w13_bias.dtype == torch.float16
    with pytest.raises(TypeError, match="w2_bias: expected a tensor"):
        TritonExperts(w13, w2, w2_bias=[0.0])
    with pytest.raises(ValueError, match=r"activation: expected one of \['silu', 'swigluoai'\], got 'swiglu'"):
        TritonExperts(w13, w2, FusedMoEQuantConfig(activation="swiglu"))
    q, s13, s2, *_ = _quantized_layer("w_mxfp4_a_mxfp4", 4, 64, 32, 3)
    with pytest.raises(ValueError, match=r"activation: expected one of"):
        _make("w_mxfp4_a_mxfp4", q, s13, s2, "torch", "gelu", None, None)
    with pytest.raises(ValueError, match=r"w2_bias: expected shape \[4, 64\]"):
        _make("w_mxfp4_a_mxfp4", q, s13, s2, "torch", SWIGLUOAI, None, torch.zeros(4, 32))
    with pytest.raises(TypeError, match="w13_bias: expected dtype"):
        _make("w_mxfp4_a_mxfp4", q, s13, s2, "torch", SWIGLUOAI, torch.zeros(4, 64, dtype=torch.float64), None)


@pytest.mark.parametrize("act", [SILU, SWIGLUOAI], ids=["silu", "swigluoai"])
def test_bf16_experts_torch_backend_is_the_reference(act):
    from mxlib.moe import TritonExperts

    x, w13, w2, b13, b2, tw, ti = _layer()
    ex = TritonExperts(w13, w2, FusedMoEQuantConfig(activation=act), backend="torch", w13_bias=b13, w2_bias=b2)
    assert_bits_equal(ex(x, tw, ti), torch_moe(x, w13, w2, tw, ti, activation=act, w13_bias=b13, w2_bias=b2))


@pytest.mark.slow
@pytest.mark.parametrize("act", [SILU, SWIGLUOAI], ids=["silu", "swigluoai"])
def test_bf16_experts_triton_backend(act):
    """bf16 GEMMs: the Triton kernel's fp32 sums in K tiles against the reference's: rel 5e-3 (bf16 outputs);
    the SiLU default without biases gives the bits it gives without the new arguments."""
    from mxlib.moe import TritonExperts

    x, w13, w2, b13, b2, tw, ti = _layer()
    want = TritonExperts(w13, w2, FusedMoEQuantConfig(activation=act), backend="torch", w13_bias=b13, w2_bias=b2)(
        x, tw, ti
    )
    got = TritonExperts(w13, w2, FusedMoEQuantConfig(activation=act), backend="triton", w13_bias=b13, w2_bias=b2)(
        x, tw, ti
    )
    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
    assert err < 5e-3, err
    if act is SILU:
        assert_bits_equal(
            TritonExperts(w13, w2, FusedMoEQuantConfig(activation=SILU), backend="triton")(x, tw, ti),
            TritonExperts(w13, w2, backend="triton")(x, tw, ti),
        )


# w_mxfp4_a_mxfp4: a1, a2 and the weights are e2m1 x 2**s, so every GEMM product and sum is exact in fp32
# (few significant bits over a narrow exponent range) and the fp32 bias sum is one rounding: the backends
# compute the same numbers wherever they call the same activation function.
EXACT = "w_mxfp4_a_mxfp4"


@pytest.mark.slow
@pytest.mark.parametrize(
    "act", [SILU, SWIGLUOAI, MoEActivation("swigluoai", alpha=1.0)], ids=["silu", "swigluoai", "harness"]
)
@pytest.mark.parametrize("shape", [(4, 256, 128), (4, 96, 64)], ids=["fp4-kernel", "dequant-kernel"])
def test_emulation_backends_with_biases(act, shape, fused_without_biases):
    """torch vs triton: bits equal (exact GEMMs, one PyTorch activation function). fused (the FP4 kernel for H, I
    multiples of 128, else the dequantize-GEMM kernel): the activation in Triton's epilogue (Triton's exp), so
    one bf16 step apart where an fp32 last bit crosses a rounding, and a2's MXFP4 QDQ may then move a value by
    one e2m1 step: rel 2e-2 against torch, most values equal."""
    e, h, i = shape
    q, s13, s2, x, tw, ti, b13, b2 = _quantized_layer(EXACT, e, h, i, m=6)
    ref = _make(EXACT, q, s13, s2, "torch", act, b13, b2)(x, tw, ti)
    tri = _make(EXACT, q, s13, s2, "triton", act, b13, b2)(x, tw, ti)
    assert_bits_equal(tri, ref)
    fused = _make(EXACT, q, s13, s2, "fused", act, b13, b2)
    assert (fused.fp4_weights() is not None) == (h % 128 == 0 and i % 128 == 0)
    out = fused(x, tw, ti)
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < 2e-2, err
    assert (out == ref).float().mean() > 0.9
    # the biases and the activation reach every backend: without them each is far away
    plain = fused_without_biases(shape)
    assert ((plain.double() - ref.double()).norm() / ref.double().norm()).item() > 0.1


@pytest.fixture(scope="module")
def fused_without_biases():
    """``fused_without_biases(shape)``: the fused backend's SiLU output without biases on
    ``_quantized_layer(EXACT, *shape, m=6)``, the same tensor for every activation of
    ``test_emulation_backends_with_biases``, computed once a shape for the module."""
    made = {}

    def get(shape):
        if shape not in made:
            q, s13, s2, x, tw, ti, _, _ = _quantized_layer(EXACT, *shape, m=6)
            made[shape] = _make(EXACT, q, s13, s2, "fused", SILU, None, None)(x, tw, ti)
        return made[shape]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["triton", "fused"])
def test_emulation_silu_default_unchanged(backend):
    """SILU without biases, given explicitly, gives the bits of the experts built without the arguments."""
    from mxlib.moe import make_emulation_experts

    for scheme, shape in (("nvfp4", (4, 256, 128)), (EXACT, (4, 96, 64))):
        q, s13, s2, x, tw, ti, _, _ = _quantized_layer(scheme, *shape, m=5)
        a = make_emulation_experts(scheme, q, s13, s2, backend=backend)(x, tw, ti)
        b = _make(scheme, q, s13, s2, backend, SILU, None, None)(x, tw, ti)
        assert_bits_equal(a, b, scheme)


@pytest.mark.slow
@pytest.mark.parametrize("numerics", ["vllm", "hardware"])
def test_nvfp4_torch_and_fp4_kernel_with_biases(numerics):
    """NVFP4 (both numerics; hardware: the biases after the per-tensor scales in both): the FP4 kernel against
    the torch backend, rel 2e-2 (fp32 sums in another order and Triton's exp, then the a2 QDQ)."""
    q, s13, s2, x, tw, ti, b13, b2 = _quantized_layer("nvfp4", 4, 256, 128, m=6)
    from mxlib.moe import make_emulation_experts

    kw = dict(activation=SWIGLUOAI, w13_bias=b13, w2_bias=b2, numerics=numerics)
    ref = make_emulation_experts("nvfp4", q, s13, s2, backend="torch", **kw)(x, tw, ti)
    fused = make_emulation_experts("nvfp4", q, s13, s2, backend="fused", **kw)
    assert fused.fp4_weights() is not None
    out = fused(x, tw, ti)
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < 2e-2, err


@pytest.mark.slow
@pytest.mark.parametrize("scheme", [EXACT, "nvfp4"])
@pytest.mark.parametrize("m", [1, 6])
def test_fp4_kernel_on_zero_padded_weights(scheme, m, monkeypatch):
    """H, I multiples of 32 but not of 128 (gpt-oss-20b's 2880 in small): the FP4 kernel on a copy zero-padded to
    its K tile (H 160 -> 256, I 96 -> 128, allowed here by raising ``FP4_PAD_MAX_FRACTION``). The checkpoint
    bytes read back unpadded bit for bit; with exact GEMMs (``EXACT``) the padded FP4 kernel gives the bits of the
    dequantize-GEMM kernel (the same Triton epilogue on the same numbers); NVFP4 against the torch backend, rel
    2e-2."""
    import mxlib.moe.emulation as emu

    e, h, i = 4, 160, 96
    q, s13, s2, x, tw, ti, b13, b2 = _quantized_layer(scheme, e, h, i, m=m)
    unpadded = _make(scheme, q, s13, s2, "fused", SWIGLUOAI, b13, b2)
    assert unpadded.fp4_weights() is None  # 160 -> 256 is more padding than the default allows
    monkeypatch.setattr(emu, "FP4_PAD_MAX_FRACTION", 1.0)
    fused = _make(scheme, q, s13, s2, "fused", SWIGLUOAI, b13, b2)
    w13, w2 = fused.fp4_weights()
    assert (w13.k, w13.packed.shape[1], w2.k, w2.packed.shape[1]) == (256, 256, 128, h)
    assert_bits_equal(fused.w13_weight, q.w13_weight)
    assert_bits_equal(fused.w2_weight, q.w2_weight)
    out = fused(x, tw, ti)
    assert out.shape == (m, h)
    ref = _make(scheme, q, s13, s2, "torch", SWIGLUOAI, b13, b2)(x, tw, ti)
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < 2e-2, err
    if scheme == EXACT:
        assert_bits_equal(out, unpadded(x, tw, ti))
    # the other backends read the unpadded checkpoint bytes back from the padded copy
    assert_bits_equal(
        fused.dequantized_expert(1)[0], _make(scheme, q, s13, s2, "torch", SILU, None, None).dequantized_expert(1)[0]
    )
