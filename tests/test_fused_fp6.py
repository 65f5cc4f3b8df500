"""MXFP6 weights in the fused FP4 kernel (``mxlib.kernels.fp6_layout``, ``fused_fp4_moe`` with ``W_BITS=6``).

Oracles: ``mxlib.reference.dequantize_mx`` (and ml_dtypes' e2m3 / e3m2 values) for the decoded
weight tile, bit for bit; the float64 MoE of ``tests/test_fused_fp4.py`` for the whole layer.
Interpreter on small shapes (K a multiple of the 256-element super tile: H = I = 256).
"""

import re

import ml_dtypes
import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from mxlib import reference as R
from mxlib.formats import BLOCK_SCHEMES
from mxlib.kernels import fp4_layout as F4
from mxlib.kernels import fp6_layout as F6
from mxlib.kernels import fused_fp4_moe as P
from mxlib.kernels.fused_dequant_moe import ActivationQDQ, PackedWeights
from mxlib.kernels.tiles import TileConfig

from _util import assert_bits_equal
from test_fused_fp4 import oracle_fp64, rel_err

ELEMENTS = ["e2m3", "e3m2"]
E, H, I, TOPK = 4, 256, 256, 2


@triton.jit
def _decode_kernel(
    w_ptr,
    s_ptr,
    out_ptr,
    K,
    stride_wn,
    stride_sn,
    stride_on,
    EBITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_WARPS: tl.constexpr,
):
    """Every weight of rows ``pid * BLOCK_N ..`` as the kernel decodes them, stored in row order."""
    n0 = tl.program_id(0) * BLOCK_N
    load_n = n0 + F4.load_rows(BLOCK_N, NUM_WARPS)
    n_mask = load_n >= 0
    w_rows = w_ptr + load_n * stride_wn
    s_rows = s_ptr + load_n * stride_sn
    out_rows = out_ptr + (n0 + tl.arange(0, BLOCK_N))[:, None] * stride_on
    for st in range(0, K // 256):
        a, b, p = F6.load_fp6_planes(w_rows, n_mask, st)
        t0 = P._fp6_tile(a, p, s_rows, n_mask, st, 0, EBITS, BLOCK_N, NUM_WARPS)
        t1 = P._fp6_tile(b, p, s_rows, n_mask, st, 1, EBITS, BLOCK_N, NUM_WARPS)
        tl.store(out_rows + st * 256 + tl.arange(0, 128)[None, :], t0.to(tl.float32))
        tl.store(out_rows + st * 256 + 128 + tl.arange(0, 128)[None, :], t1.to(tl.float32))


def decoded_weights(w: F6.FP6Weights, block_n: int = 32, num_warps: int = 2) -> torch.Tensor:
    """``[rows, K]`` fp32: the weights of expert 0 as the kernel's decode gives them (on ``w``'s device)."""
    rows, k = w.packed.shape[1], w.k
    out = torch.empty(rows, k, dtype=torch.float32, device=w.packed.device)
    wp, ws = w.packed[0].view(torch.int32), w.scales[0].view(torch.int32)
    _decode_kernel[(rows // block_n,)](
        wp,
        ws,
        out,
        k,
        wp.stride(0),
        ws.stride(0),
        out.stride(0),
        EBITS=w.element.ebits,
        BLOCK_N=block_n,
        NUM_WARPS=num_warps,
    )
    return out


def every_code_layer(element, rows=64, k=512):
    """Packed ``[1, rows, 3k/4]`` cycling through the 64 codes (shifted per row) and scale bytes
    cycling through 0, 127, 254, 255 and a spread of others."""
    g = torch.Generator().manual_seed(3)
    codes = (torch.arange(k).view(1, k) + 7 * torch.arange(rows).view(rows, 1)).remainder(64).to(torch.uint8)
    packed = R.pack_codes(codes, element).view(1, rows, 3 * k // 4)
    special = torch.tensor([0, 127, 254, 255, 1, 126, 128, 200], dtype=torch.uint8)
    scales = torch.where(
        torch.rand(rows, k // 32, generator=g) < 0.5,
        special[torch.randint(0, 8, (rows, k // 32), generator=g)],
        torch.randint(0, 256, (rows, k // 32), generator=g, dtype=torch.uint8),
    )
    return packed, scales.view(1, rows, k // 32)


# ----------------------------------------------------------------------------- layout


@pytest.mark.parametrize("element", ELEMENTS)
def test_prepare_round_trip_and_size(element):
    packed, scales = every_code_layer(element)
    g = torch.Generator().manual_seed(5)
    packed = torch.cat([packed, torch.randint(0, 256, packed.shape, generator=g, dtype=torch.uint8)])
    scales = torch.cat([scales, scales])
    w = F6.prepare_fp6_weights(packed, scales, element)
    assert w.packed.shape == packed.shape and w.packed.dtype == torch.uint8  # no extra memory
    assert w.k == 512 and not torch.equal(w.packed, packed)
    assert_bits_equal(F6.unprepare_fp6_weights(w), packed)
    assert_bits_equal(F6.unprepare_fp6_packed(w.packed, element), packed)


@pytest.mark.parametrize("element", ELEMENTS)
def test_layout_planes_hold_the_fp4_words_elements(element):
    """Plane t word 4c + j holds code bits 1..4 of exactly the elements of the FP4 layout's word
    4c + j of K tile t; plane 2 word 4c + j holds bits 0 and 5 of those of both tiles."""
    eb = BLOCK_SCHEMES[f"mxfp6_{element}"].element.ebits
    table = F6.layout_table(eb)  # [256, 6] -> word * 32 + bit
    word = table // 32
    for t in range(2):
        for p in range(128):
            q = p % 64
            fp4_word = 4 * ((q // 2) % 4) + q // 16  # byte c*16 + j*4 + .. of the FP4 layout: word 4c + j
            assert word[128 * t + p, 1:5].tolist() == [16 * t + fp4_word] * 4
            assert word[128 * t + p, [0, 5]].tolist() == [32 + fp4_word] * 2


@pytest.mark.parametrize("element", ELEMENTS)
def test_bf16_placement_rule(element):
    """The PTX decode's arithmetic, checked on the CPU: a code's sign at bf16 bit 15 and its five
    exponent-mantissa bits at ``7 - mbits`` is ``value * 2**(bias - 127)`` in bf16, and one
    multiply by ``2**(127 - bias)`` gives ml_dtypes' value of the code exactly."""
    el = BLOCK_SCHEMES[f"mxfp6_{element}"].element
    codes = torch.arange(64, dtype=torch.int32)
    bits = ((codes >> 5) << 15) | ((codes & 31) << (7 - el.mbits))
    v = bits.to(torch.int16).view(torch.bfloat16)
    got = (v * torch.tensor(2.0 ** (127 - el.bias), dtype=torch.bfloat16)).float()
    fp6 = getattr(ml_dtypes, f"float6_{element}fn")
    want = torch.from_numpy(np.arange(64, dtype=np.uint8).view(fp6).astype(np.float32))
    assert_bits_equal(got, want)


@pytest.mark.parametrize("element", ELEMENTS)
def test_decoded_tile_matches_reference(element, device):
    """Every code under E8M0 scales 0, 127, 254, 255 and others: the kernel's decoded weights equal
    ``dequantize_mx`` to bf16, bit for bit (NaN blocks for scale 255, Inf where the product overflows)."""
    packed, scales = every_code_layer(element)
    want = R.dequantize_mx(packed, scales, element, 32, torch.bfloat16)[0].float()
    w = F6.prepare_fp6_weights(packed.to(device), scales.to(device), element)
    got = decoded_weights(w, *((64, 4) if device == "cuda" else (32, 2))).cpu()
    assert_bits_equal(got, want)
    assert torch.isnan(want).any() and torch.isinf(want).any() and (want == 0).any()


def _run_ptx(asm: str, inputs: list) -> list:
    """A CPU model of the few PTX instructions the decode blocks use (uint32 numpy arrays; bf16x2
    multiplies by ml_dtypes, one rounding of the exact product as ``mul.rn.bf16x2``); returns ``$0..``."""
    u32 = np.uint32
    n_out = max(int(t[1:]) for t in re.findall(r"\$\d+", asm)) + 1 - len(inputs)
    regs = {f"${n_out + i}": np.asarray(v, dtype=u32) for i, v in enumerate(inputs)}
    out = {}

    def val(tok):
        tok = tok.strip()
        return regs[tok] if tok in regs else u32(int(tok, 0))

    def bf16x2_mul(a, b):
        def halves(x):
            x = np.broadcast_to(np.asarray(x, dtype=u32), np.broadcast_shapes(np.shape(a), np.shape(b)))
            return [(x >> u32(16 * h) & u32(0xFFFF)).astype(np.uint16).view(ml_dtypes.bfloat16) for h in (0, 1)]

        (a0, a1), (b0, b1) = halves(a), halves(b)
        with np.errstate(over="ignore"):  # Inf where the product overflows, as the hardware
            lo, hi = [(x * y).view(np.uint16).astype(u32) for x, y in ((a0, b0), (a1, b1))]
        return lo | (hi << u32(16))

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}." or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        if op == "mov.b32" and args.startswith("{"):
            names, src = args.split("}")
            lo, hi = [t.strip() for t in names.strip("{ ").split(",")]
            v = val(src.strip(", "))
            out[lo], out[hi] = v & u32(0xFFFF), v >> u32(16)
            continue
        a = [t.strip() for t in args.split(",")]
        d, x = a[0], [val(t) for t in a[1:]]
        if op == "lop3.b32":
            lut, r = int(a[4], 0), u32(0)
            for i in range(8):
                if lut >> i & 1:
                    r = r | ((x[0] if i & 4 else ~x[0]) & (x[1] if i & 2 else ~x[1]) & (x[2] if i & 1 else ~x[2]))
        elif op == "shf.l.wrap.b32":
            n = int(x[2]) & 31
            r = (x[1] << u32(n)) | (x[0] >> u32(32 - n)) if n else x[1]
        elif op == "and.b32":
            r = x[0] & x[1]
        elif op == "shl.b32":
            r = x[0] << x[1]
        elif op == "bfe.u32":
            r = (x[0] >> x[1]) & ((u32(1) << x[2]) - u32(1))
        elif op == "setp.eq.u32":
            r = x[0] == x[1]
        elif op == "selp.b32":
            r = np.where(x[2], x[0], x[1]).astype(u32)
        elif op == "prmt.b32":  # default mode: result byte i is byte (selector nibble i) of {b, a}
            pair = np.asarray(x[0], dtype=np.uint64) | (np.asarray(x[1], dtype=np.uint64) << np.uint64(32))
            sel = np.asarray(x[2], dtype=np.uint64)
            r = u32(0)
            for i in range(4):
                nib = (sel >> np.uint64(4 * i)) & np.uint64(7)
                byte = ((pair >> (np.uint64(8) * nib)) & np.uint64(0xFF)).astype(u32)
                r = r | (byte << u32(8 * i))
        elif op == "max.u16x2":
            r = np.maximum(x[0] & u32(0xFFFF), x[1] & u32(0xFFFF)) | np.maximum(
                x[0] >> u32(16) << u32(16), x[1] >> u32(16) << u32(16)
            )
        elif op == "add.u32":
            r = x[0] + x[1]
        elif op == "shr.u32":
            r = x[0] >> x[1]
        elif op == "mov.b32":
            r = x[0]
        elif op == "mul.rn.bf16x2":
            r = bf16x2_mul(x[0], x[1])
        else:
            raise NotImplementedError(op)
        regs[d] = np.asarray(r, dtype=u32) if op != "setp.eq.u32" else r
    return [regs.get(f"${i}", out.get(f"${i}")) for i in range(n_out)]


@pytest.mark.parametrize("element", ELEMENTS)
def test_ptx_decode_blocks_match_reference(element):
    """The PTX strings the compiled kernel runs (``_decode_asm``, the E8M0 block), executed by a CPU
    model of their instructions on every word of a prepared layer: the reference's bf16 weights."""
    packed, scales = every_code_layer(element)
    want = R.dequantize_mx(packed, scales, element, 32, torch.bfloat16)[0]
    w = F6.prepare_fp6_weights(packed, scales, element)
    rows, k = w.packed.shape[1], w.k
    words = w.packed[0].numpy().view(np.uint32).reshape(rows, k // 256, 3, 16)  # planes 0, 1, 2
    sw = scales[0].numpy().view(np.uint32).reshape(rows, k // 256, 2)
    eb = BLOCK_SCHEMES[f"mxfp6_{element}"].element.ebits
    got = torch.empty(rows, k, dtype=torch.int16)
    jj = np.arange(16) % 4
    for t in range(2):
        s = np.broadcast_to(sw[:, :, t, None], (rows, k // 256, 16))
        s_lo, s_hi = _run_ptx(F6._ASM_E8M0_PAIR.value, [s, 0x4240 + (jj // 2) * 0x0101])
        outs = _run_ptx(F6._decode_asm(eb, t), [words[:, :, t], words[:, :, 2], s_lo, s_hi])
        for u, o in enumerate(outs):  # output u of word 4c + j: K 64 (u // 4) + 16 j + 8 ((u % 4) // 2) + 2 c + u % 2
            for wd in range(16):
                c, j = wd // 4, wd % 4
                kk = 128 * t + 64 * (u // 4) + 16 * j + 8 * ((u % 4) // 2) + 2 * c + u % 2
                got[:, kk::256] = torch.from_numpy(o[:, :, wd].astype(np.uint16).view(np.int16).copy())
    assert_bits_equal(got.view(torch.bfloat16), want)
    assert F6.DECODE_INSTRUCTIONS[(element, 0)] == 20 and F6.DECODE_INSTRUCTIONS[(element, 1)] == 21


def test_prepare_rejects_bad_input():
    z = torch.zeros
    with pytest.raises(ValueError, match="K=128 is not a multiple of the FP6 layout's super tile 256"):
        F6.prepare_fp6_weights(z(1, 2, 96, dtype=torch.uint8), z(1, 2, 4, dtype=torch.uint8), "e2m3")
    with pytest.raises(ValueError, match=r"packed: expected uint8 \[E, rows, 3K/4\], got torch.int32"):
        F6.prepare_fp6_weights(z(1, 2, 192, dtype=torch.int32), z(1, 2, 8, dtype=torch.uint8), "e2m3")
    with pytest.raises(ValueError, match=r"packed: expected uint8 \[E, rows, 3K/4\], got torch.uint8 \[2, 192\]"):
        F6.prepare_fp6_weights(z(2, 192, dtype=torch.uint8), z(1, 2, 8, dtype=torch.uint8), "e2m3")
    with pytest.raises(ValueError, match=r"scales: expected shape \[1, 2, 8\], got \[1, 2, 4\]"):
        F6.prepare_fp6_weights(z(1, 2, 192, dtype=torch.uint8), z(1, 2, 4, dtype=torch.uint8), "e3m2")
    with pytest.raises(ValueError, match="element: expected an FP6 element"):
        F6.prepare_fp6_weights(z(1, 2, 192, dtype=torch.uint8), z(1, 2, 8, dtype=torch.uint8), "e2m1")
    with pytest.raises(ValueError, match="block_size: the FP6 layout takes OCP MX blocks of 32"):
        F6.prepare_fp6_weights(z(1, 2, 192, dtype=torch.uint8), z(1, 2, 16, dtype=torch.uint8), "e3m2", 16)
    # through PackedWeights: FP6 accepted, K not a multiple of 256 refused with the same message
    pw = PackedWeights(z(1, 2, 96, dtype=torch.uint8), z(1, 2, 4, dtype=torch.uint8), BLOCK_SCHEMES["mxfp6_e3m2"])
    with pytest.raises(ValueError, match="K=128 is not a multiple"):
        P.prepare_packed_weights(pw)
    pw8 = PackedWeights(z(1, 2, 256, dtype=torch.uint8), z(1, 2, 8, dtype=torch.uint8), BLOCK_SCHEMES["mxfp8_e4m3"])
    with pytest.raises(ValueError, match="4- or 6-bit elements"):
        P.prepare_packed_weights(pw8)


# ----------------------------------------------------------------------------- the MoE


def make_fp6_layer(element, act, m=7, e=E, h=H, i=I, k=TOPK, seed=0, device="cpu"):
    """An MXFP6 layer (weights ``element``) with activation QDQ ``act`` (None, or an MX block scheme
    name) in the form of ``test_fused_fp4.make_layer`` (MX operands are the same in both modes); the
    kernel's operands on ``device``."""
    from mxlib.moe import fused_topk

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, h, generator=g).to(torch.bfloat16)
    w13 = torch.randn(e, 2 * i, h, generator=g) * 0.05 * torch.exp(torch.randn(e, 1, 1, generator=g))
    w2 = torch.randn(e, h, i, generator=g) * 0.05
    tw, ti = fused_topk(torch.randn(m, e, generator=g), k)
    p13, s13 = R.quantize_mx(w13.to(torch.bfloat16), element)
    p2, s2 = R.quantize_mx(w2.to(torch.bfloat16), element)
    d13, d2 = R.dequantize_mx(p13, s13, element), R.dequantize_mx(p2, s2, element)
    scheme = BLOCK_SCHEMES[f"mxfp6_{element}"]
    pw13 = P.prepare_packed_weights(PackedWeights(p13.to(device), s13.to(device), scheme))
    pw2 = P.prepare_packed_weights(PackedWeights(p2.to(device), s2.to(device), scheme))
    x, tw, ti = x.to(device), tw.to(device), ti.to(device)
    if act is None:
        q = None
        a = lambda v, mode: v  # noqa: E731
    else:
        q = ActivationQDQ(BLOCK_SCHEMES[act])
        el = BLOCK_SCHEMES[act].element.name
        a = lambda v, mode: R.quant_dequant_mx(v, el, 32, "even")  # noqa: E731
    return dict(
        x=x,
        tw=tw,
        ti=ti,
        pw13=pw13,
        pw2=pw2,
        q1=q,
        q2=q,
        dq13={"vllm": d13, "hardware": d13},
        dq2={"vllm": d2, "hardware": d2},
        a1=a,
        a2=a,
        raw13=p13,
    )


@pytest.mark.slow
@pytest.mark.parametrize("element", ELEMENTS)
@pytest.mark.parametrize("act", [None, "mxfp6_e2m3", "mxfp4"])
def test_fused_fp6_against_fp64(element, act, device):
    L = make_fp6_layer(element, act, device=device)
    assert isinstance(L["pw13"], F6.FP6Weights)
    out = P.fused_fp4_moe(L["x"], L["pw13"], L["pw2"], L["tw"], L["ti"], L["q1"], L["q2"]).cpu()
    err = rel_err(out, oracle_fp64(L, "vllm"))
    assert err < 5e-3, err  # bf16 GEMM outputs: ~1e-3 (test_fused_fp4's tolerance)


@pytest.mark.slow
def test_fused_fp6_naive_blocks_and_tiles(device):
    """M = 1 (each pair its own block, no alignment) and explicit tiles with a standalone a1 QDQ."""
    L = make_fp6_layer("e3m2", "mxfp4", m=9, device=device)
    want = oracle_fp64(L, "vllm")
    one = P.fused_fp4_moe(L["x"][:1], L["pw13"], L["pw2"], L["tw"][:1], L["ti"][:1], L["q1"], L["q2"]).cpu()
    assert rel_err(one, want[:1]) < 5e-3
    # 32- and 16-pair row blocks, 128 columns: GEMM1 (N = I = 256) and GEMM2 (N = H = 256) each take two column
    # blocks loading the same A tile (narrower columns, 32 and 64, repeat the case in two to four times the
    # interpreter's programs)
    cfg = (TileConfig(32, 128, None, 2, 4, 1, a1_fused=False), TileConfig(16, 128, None, 1, 4, 1))
    out = P.fused_fp4_moe(L["x"], L["pw13"], L["pw2"], L["tw"], L["ti"], L["q1"], L["q2"], configs=cfg).cpu()
    assert rel_err(out, want) < 5e-3


def test_fused_fp6_rejects_mixed_elements():
    a, b = make_fp6_layer("e2m3", None, m=2), make_fp6_layer("e3m2", None, m=2)
    with pytest.raises(ValueError, match="w13 and w2 must have one element format"):
        P.fused_fp4_moe(a["x"], a["pw13"], b["pw2"], a["tw"], a["ti"])


# ----------------------------------------------------------------------------- the experts


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["w_mxfp6_e2m3", "w_mxfp6_e3m2_a_mxfp6_e3m2", "w_mxfp6_e2m3_a_fp8"])
def test_experts_fused_backend_runs_fp6_on_the_fp4_kernel(scheme, device):
    """``backend="fused"``: MXFP6 weights held only in the FP6 layout, the FP4 kernel runs them, and
    the output matches the pure-PyTorch backend; the checkpoint bytes still come back; ``auto``'s
    choice follows ``FP6_AUTO_FUSED`` (off until measured)."""
    from mxlib.moe import emulation as EM
    from mxlib.moe import fused_topk, make_emulation_experts, quantize_expert_weights

    g = torch.Generator().manual_seed(2)
    e, h, i, m = 4, 256, 256, 5
    w13 = (torch.randn(e, 2 * i, h, generator=g) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(e, h, i, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(m, h, generator=g).to(torch.bfloat16)
    tw, ti = fused_topk(torch.randn(m, e, generator=g), 2)
    q = quantize_expert_weights(w13, w2, scheme)
    scales = {}
    if scheme.endswith("_a_fp8"):  # static per-tensor FP8 activations
        scales = dict(
            w13_input_scale=torch.full((e,), float(x.float().abs().amax()) / 448),
            w2_input_scale=torch.full((e,), 0.05 / 448),
        )
    fused = make_emulation_experts(scheme, q, backend="fused", **scales)
    assert "w13_weight_packed" not in fused._buffers and fused.prepared is not None
    w13p, w2p = fused.fp4_weights()
    assert isinstance(w13p, F6.FP6Weights) and isinstance(w2p, F6.FP6Weights)
    assert_bits_equal(fused.w13_weight, q.w13_weight)
    assert_bits_equal(fused.checkpoint_packed("w2_weight", slice(1, 3)), q.w2_weight[1:3])
    ref = make_emulation_experts(scheme, q, backend="torch", **scales)
    out = fused.to(device)(x.to(device), tw.to(device), ti.to(device)).cpu()
    assert rel_err(out, ref(x, tw, ti)) < 5e-3
    assert fused.fp4_kernel_applies() and fused.prefers_fused() == EM.FP6_AUTO_FUSED


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("scheme", ["w_mxfp6_e2m3", "w_mxfp6_e3m2", "w_mxfp6_e3m2_a_fp8"])
@pytest.mark.parametrize("m", [1, 64, 512])
def test_gpu_experts_fp6_fused_matches_dequant_gemm(scheme, m):
    """Full Qwen3-30B-A3B layer: the FP4 kernel on MXFP6 weights against the dequantize-then-GEMM backend
    (the same MX operands; the GEMMs differ only in accumulation order)."""
    from mxlib.moe import fused_topk, make_emulation_experts, quantize_expert_weights

    e, h, i, k = 128, 2048, 768, 8
    g = torch.Generator(device="cuda").manual_seed(m)
    w13 = torch.empty(e, 2 * i, h, device="cuda", dtype=torch.bfloat16).normal_(0, 0.02, generator=g)
    w2 = torch.empty(e, h, i, device="cuda", dtype=torch.bfloat16).normal_(0, 0.02, generator=g)
    x = torch.randn(m, h, device="cuda", generator=g).to(torch.bfloat16)
    tw, ti = fused_topk(torch.randn(m, e, device="cuda", generator=g), k)
    q = quantize_expert_weights(w13, w2, scheme)
    scales = {}
    if scheme.endswith("_a_fp8"):
        scales = dict(
            w13_input_scale=torch.full((e,), float(x.float().abs().amax()) / 448, device="cuda"),
            w2_input_scale=torch.full((e,), 0.02 / 448, device="cuda"),
        )
    fused = make_emulation_experts(scheme, q, backend="fused", **scales)
    assert isinstance(fused.fp4_weights()[0], F6.FP6Weights)
    ref = make_emulation_experts(scheme, q, backend="triton", **scales)
    assert rel_err(fused(x, tw, ti), ref(x, tw, ti)) < 1e-2
