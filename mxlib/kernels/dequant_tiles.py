"""The weight-tile decodes of the dequantize-GEMM kernel (``fused_dequant_moe``), checkpoint layout.

Packed weights (two FP4 codes a byte, four FP6 codes in three bytes) and their block scales are decoded in
registers with the arithmetic of ``mxlib.reference`` (``_numerics``), so the tile the dot reads holds vLLM's
dequantized bf16 weights bit for bit: ``_weight_tile`` (any element, one tile; compiled MX FP8 weights through
``_fp8_weight_tile``, the hardware FP8 conversion times the E8M0 scale, the same bits), ``_weight_tile_split`` (FP4 as
its low and high nibbles), ``_fp6_words`` / ``_fp6_part`` (FP6 as 24-bit words, one element of four at a
time) and ``_a_part`` (the activation columns that pair with a split tile).
"""

from __future__ import annotations

from . import _numerics as nm
from ._triton import tl, triton

__all__: list[str] = []


@triton.jit
def _weight_tile(
    w_rows,
    s_rows,
    n_mask,
    g,
    k0,
    K,
    W_EBITS: tl.constexpr,
    W_MBITS: tl.constexpr,
    W_SPECIALS: tl.constexpr,
    W_BS: tl.constexpr,
    W_NVFP4: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Dequantized weight tile [BLOCK_N, BLOCK_K] in the dot dtype (bits of vLLM's dequant)."""
    NBITS: tl.constexpr = 1 + W_EBITS + W_MBITS
    if NBITS == 8 and not W_NVFP4 and not nm.INTERPRETING:
        return _fp8_weight_tile(w_rows, s_rows, n_mask, k0, K, W_EBITS, W_BS, BLOCK_N, BLOCK_K, DOT_DTYPE)
    codes = nm.load_codes(w_rows, n_mask, k0, K, NBITS, BLOCK_N, BLOCK_K)
    scols = k0 // W_BS + tl.arange(0, BLOCK_K // W_BS)
    sb = tl.load(s_rows[:, None] + scols[None, :], mask=n_mask[:, None] & (scols < K // W_BS)[None, :], other=0).to(
        tl.int32
    )
    w = nm.dequant_tile(codes, sb, g, W_EBITS, W_MBITS, W_SPECIALS, W_BS, W_NVFP4, BLOCK_N, BLOCK_K)
    w = nm.cast_out(w, DOT_DTYPE)
    if UPCAST:
        return nm.to_fp32(w)
    return w


@triton.jit
def _fp8_weight_tile(
    w_rows,
    s_rows,
    n_mask,
    k0,
    K,
    W_EBITS: tl.constexpr,
    W_BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """MX FP8 weight tile (e4m3 or e5m2 bytes, E8M0 scales) [BLOCK_N, BLOCK_K] in the dot dtype, compiled only.

    The hardware's FP8 -> fp32 conversion (exact, NaN and Inf codes kept) replaces the generic integer decode
    (``_numerics.decode_element``, about five operations an element and the specials' patch). The fp32 product
    ``value * 2**(s - 127)`` is exact (at most 4 significant bits, smallest magnitude 2**-16 * 2**-127 = 2**-143,
    an fp32 subnormal), so its one rounding to the dot dtype gives vLLM's dequantized bits."""
    cols = k0 + tl.arange(0, BLOCK_K)
    raw = tl.load(w_rows[:, None] + cols[None, :], mask=n_mask[:, None] & (cols < K)[None, :], other=0)
    if W_EBITS == 4:
        v = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        v = raw.to(tl.float8e5, bitcast=True).to(tl.float32)
    scols = k0 // W_BS + tl.arange(0, BLOCK_K // W_BS)
    sb = tl.load(s_rows[:, None] + scols[None, :], mask=n_mask[:, None] & (scols < K // W_BS)[None, :], other=0).to(
        tl.int32
    )
    v = tl.reshape(v, (BLOCK_N, BLOCK_K // W_BS, W_BS)) * nm.decode_e8m0(sb)[:, :, None]
    return nm.cast_out(tl.reshape(v, (BLOCK_N, BLOCK_K)), DOT_DTYPE)


@triton.jit
def _weight_tile_split(
    w_rows,
    s_rows,
    n_mask,
    g,
    k0,
    K,
    W_BS: tl.constexpr,
    W_NVFP4: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """FP4 weight tile as its even and odd elements, each [BLOCK_N, BLOCK_K // 2]: the low and
    high nibbles of the packed bytes, used as they are (no interleaving shuffle)."""
    HALF: tl.constexpr = BLOCK_K // 2
    pcols = k0 // 2 + tl.arange(0, HALF)
    b = tl.load(w_rows[:, None] + pcols[None, :], mask=n_mask[:, None] & (pcols < K // 2)[None, :], other=0).to(
        tl.int32
    )
    scols = k0 // W_BS + tl.arange(0, BLOCK_K // W_BS)
    sb = tl.load(s_rows[:, None] + scols[None, :], mask=n_mask[:, None] & (scols < K // W_BS)[None, :], other=0).to(
        tl.int32
    )
    if W_NVFP4:
        block = nm.decode_e4m3(sb) * g
    else:
        block = nm.decode_e8m0(sb)
    # byte j holds elements 2j (low) and 2j+1 (high); both sit in scale block 2j // W_BS
    lo = nm.decode_element(b & 0xF, nm.FP4_EBITS, nm.FP4_MBITS, nm.FP4_SPECIALS)
    hi = nm.decode_element(b >> 4, nm.FP4_EBITS, nm.FP4_MBITS, nm.FP4_SPECIALS)
    lo = tl.reshape(lo, (BLOCK_N, BLOCK_K // W_BS, W_BS // 2)) * block[:, :, None]
    hi = tl.reshape(hi, (BLOCK_N, BLOCK_K // W_BS, W_BS // 2)) * block[:, :, None]
    lo = nm.cast_out(tl.reshape(lo, (BLOCK_N, HALF)), DOT_DTYPE)
    hi = nm.cast_out(tl.reshape(hi, (BLOCK_N, HALF)), DOT_DTYPE)
    if UPCAST:
        return nm.to_fp32(lo), nm.to_fp32(hi)
    return lo, hi


@triton.jit
def _fp6_words(w_rows, s_rows, n_mask, k0, K, W_BS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """FP6 rows as 24-bit words of four codes (elements 4j .. 4j+3) and the E8M0 scale of each word."""
    Q: tl.constexpr = BLOCK_K // 4
    groups = k0 // 4 + tl.arange(0, Q)
    m = n_mask[:, None] & (groups < K // 4)[None, :]
    base = w_rows[:, None] + 3 * groups[None, :]
    word = (
        tl.load(base, mask=m, other=0).to(tl.int32)
        | (tl.load(base + 1, mask=m, other=0).to(tl.int32) << 8)
        | (tl.load(base + 2, mask=m, other=0).to(tl.int32) << 16)
    )
    scols = k0 // W_BS + tl.arange(0, BLOCK_K // W_BS)
    sb = tl.load(s_rows[:, None] + scols[None, :], mask=n_mask[:, None] & (scols < K // W_BS)[None, :], other=0).to(
        tl.int32
    )
    return word, nm.decode_e8m0(sb)


@triton.jit
def _fp6_part(
    word,
    block,
    t: tl.constexpr,
    W_EBITS: tl.constexpr,
    W_MBITS: tl.constexpr,
    W_BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Dequantized elements 4j + t of an FP6 word tile, [BLOCK_N, BLOCK_K // 4]."""
    v = nm.decode_element((word >> (6 * t)) & 0x3F, W_EBITS, W_MBITS, 0)
    v = tl.reshape(v, (BLOCK_N, BLOCK_K // W_BS, W_BS // 4)) * block[:, :, None]
    v = nm.cast_out(tl.reshape(v, (BLOCK_N, BLOCK_K // 4)), DOT_DTYPE)
    if UPCAST:
        return nm.to_fp32(v)
    return v


@triton.jit
def _a_part(
    a_rows, token_mask, k0, K, t: tl.constexpr, STRIDE: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr
):
    """Activation elements STRIDE * j + t of columns k0 ..., transposed: [BLOCK_K // STRIDE, BLOCK_M]."""
    offs_k = k0 + STRIDE * tl.arange(0, BLOCK_K // STRIDE) + t
    a = tl.load(a_rows[None, :] + offs_k[:, None], mask=token_mask[None, :] & (offs_k < K)[:, None], other=0.0)
    if UPCAST:
        return nm.to_fp32(a)
    return a
