"""Rounding and scale code shared by every mxlib Triton kernel.

These ``@triton.jit`` helpers are the one piece of rounding code used by the
standalone quantize / dequantize / QDQ kernels and by the fused MoE GEMM
kernels. They compute exactly what ``mxlib.reference`` computes, bit for bit,
compiled on the GPU and under ``TRITON_INTERPRET=1`` alike, which is why they
avoid what the interpreter gets wrong or the compiler may approximate:

* all arithmetic is fp32; bf16 and fp8 values are never operated on directly, and
  bf16 is widened through its bits (``to_fp32``);
* fp32 -> bf16 rounds to nearest even with integer bit operations
  (``to_bf16_rne``); the final cast then only drops zero bits;
* fp8 / fp6 / fp4 codes are encoded and decoded with integer bit operations, never
  through Triton's fp8 types (whose NaN codes the interpreter decodes as numbers);
* divisions that must be correctly rounded use ``tl.math.div_rn`` (a plain ``/``
  may lower to an approximate division);
* NaN is tracked explicitly: ``tl.maximum``/``tl.max`` drop NaN on the GPU but
  propagate it in the interpreter, so block maxima are taken over finite values
  and a separate "block holds NaN/Inf" flag is reduced alongside.

Element formats are passed as constexprs ``EBITS, MBITS, SPECIALS`` with
``SPECIALS`` 0 (FP4/FP6: no special codes), 1 (e4m3fn: S.1111.111 is NaN) or
2 (e5m2: IEEE-like Inf/NaN).
"""

import struct

from ..formats import ELEMENT_FORMATS, FP8_E4M3_PER_TENSOR, NVFP4
from ._bridge import INTERPRET, kernel_format_args
from ._triton import tl, triton

# Triton fixes interpreted vs compiled when a kernel is defined; ``mxlib.kernels`` defines every
# kernel module under the process's one choice (``_bridge.INTERPRET``), so this agrees with them.
INTERPRETING = tl.constexpr(INTERPRET)

# fp32 constants as bit patterns, so that no NaN literal passes through Python floats
_NAN_BITS = tl.constexpr(0x7FC00000)

# Formats fixed by the helper that uses them (the generic helpers take theirs as arguments from
# each launch), as named constexprs that the bridge makes from the format table:
# * FP4_*: the one 4-bit element format (e2m1), which the FP4-only paths decode;
# * NVFP4_SCALE_*: NVFP4's block-scale element (e4m3fn), and NVFP4_INV_MAX = fp32(1 / e2m1 max),
#   vLLM's ``amax * (1/6)`` in the scale chain;
# * FP8_*: per-tensor FP8's element (e4m3fn), for the static-scale QDQ.


def _named(value):
    """A format number as a global the helpers can read: compiled kernels may read only
    tl.constexpr globals; the interpreter runs the helpers as plain Python, where a tl.constexpr
    does not mix with int arithmetic (``1 << c`` raises), so there it is the plain number."""
    return value if INTERPRETING else tl.constexpr(value)


_FP4 = [f for f in ELEMENT_FORMATS.values() if f.nbits == 4]
assert len(_FP4) == 1 and _FP4[0] is NVFP4.element, "the FP4 paths assume one 4-bit element format"
_FP4_ARGS = kernel_format_args(_FP4[0])
FP4_EBITS = _named(_FP4_ARGS["EBITS"])
FP4_MBITS = _named(_FP4_ARGS["MBITS"])
FP4_MAX = _named(_FP4_ARGS["MAX"])
FP4_SPECIALS = _named(_FP4_ARGS["SPECIALS"])
_NVFP4_SCALE_ARGS = kernel_format_args(NVFP4.scale.element)
NVFP4_SCALE_EBITS = _named(_NVFP4_SCALE_ARGS["EBITS"])
NVFP4_SCALE_MBITS = _named(_NVFP4_SCALE_ARGS["MBITS"])
NVFP4_SCALE_MAX = _named(_NVFP4_SCALE_ARGS["MAX"])
NVFP4_SCALE_SPECIALS = _named(_NVFP4_SCALE_ARGS["SPECIALS"])
NVFP4_INV_MAX = _named(struct.unpack("<f", struct.pack("<f", 1.0 / NVFP4.element.max))[0])
# per-token global scales (``nvfp4_per_token_scales``): fp32(1 / (6 * 448)) and the decode-scale lower bound
NVFP4_INV_SCALE_DIVISOR = _named(struct.unpack("<f", struct.pack("<f", 1.0 / NVFP4.scale_divisor))[0])
PER_TOKEN_SCALE_MIN = _named(2.0**-126)
_FP8_ARGS = kernel_format_args(FP8_E4M3_PER_TENSOR)
FP8_EBITS = _named(_FP8_ARGS["EBITS"])
FP8_MBITS = _named(_FP8_ARGS["MBITS"])
FP8_MAX = _named(_FP8_ARGS["MAX"])


@triton.jit
def exp2i(n):
    """Exact fp32 ``2**n`` for an int32 tensor ``n`` in [-149, 127]."""
    normal = (n + 127) << 23
    sub = tl.full(n.shape, 1, tl.int32) << tl.minimum(tl.maximum(n + 149, 0), 22)
    return tl.where(n >= -126, normal, sub).to(tl.float32, bitcast=True)


@triton.jit
def fp32_nan_like(x):
    return tl.full(x.shape, _NAN_BITS, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def negate_where(x, cond):
    """``-x`` where ``cond``, by flipping the sign bit: Triton's unary minus is ``0 - x``,
    which turns ``-(+0.0)`` into ``+0.0`` instead of ``-0.0``."""
    bits = x.to(tl.int32, bitcast=True) ^ tl.where(cond, -2147483648, 0)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def is_finite(x):
    return (x == x) & (tl.abs(x) != float("inf"))


@triton.jit
def to_fp32(x):
    """Widen a loaded tile to fp32, exactly. bf16 goes through its bits: the interpreter's
    bf16 -> fp32 conversion mangles bf16 subnormals."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def to_bf16_rne(x):
    """fp32 -> bf16, round to nearest even, NaN kept; built from bits (the interpreter's
    own fp32 -> bf16 cast truncates and mangles subnormals)."""
    bits = x.to(tl.int32, bitcast=True)
    lsb = (bits >> 16) & 1
    upper = ((bits + 0x7FFF + lsb) >> 16) & 0xFFFF
    upper = tl.where(x != x, 0x7FC0, upper)
    return upper.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def cast_out(x, OUT_DTYPE: tl.constexpr):
    """fp32 -> output dtype with one correct rounding (bf16 through ``to_bf16_rne`` in the
    interpreter; compiled, the hardware's round-to-nearest-even conversion)."""
    if OUT_DTYPE == tl.bfloat16 and INTERPRETING:
        return to_bf16_rne(x)
    else:
        return x.to(OUT_DTYPE)


@triton.jit
def clamp_keep_nan(x, lo: tl.constexpr, hi: tl.constexpr):
    """``torch.clamp`` semantics: NaN stays NaN (``tl.minimum``/``tl.maximum`` may drop it)."""
    x = tl.where(x > hi, hi, x)
    return tl.where(x < lo, lo, x)


@triton.jit
def round_to_element(x, EBITS: tl.constexpr, MBITS: tl.constexpr, MAX: tl.constexpr, KEEP_NAN: tl.constexpr = True):
    """Round fp32 ``x`` to the element grid: nearest, ties to even, saturating to +-MAX.

    NaN stays NaN, +-Inf saturates, the sign of zero is kept (as
    ``mxlib.reference.round_to_element``). With ``e = max(floor(log2|x|), 1 - bias)`` the
    grid step near ``|x|`` is ``2**(e - MBITS)``; adding and subtracting
    ``C = 1.5 * 2**(e - MBITS + 23)``, whose fp32 ulp is that step, rounds to it under
    fp32's own round-to-nearest-even. Values above MAX (Inf included) and NaN are
    replaced afterwards, so the garbage C of huge exponents never escapes. ``KEEP_NAN=False``
    skips the NaN select where the caller overwrites NaN blocks anyway.
    """
    BIAS: tl.constexpr = (1 << (EBITS - 1)) - 1
    a = tl.abs(x)
    e = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) - 127, 1 - BIAS)
    c = (((e - MBITS + 150) << 23) | 0x400000).to(tl.float32, bitcast=True)
    r = (a + c) - c
    r = tl.where(a > MAX, MAX, r)
    if KEEP_NAN:
        r = tl.where(a != a, a, r)
    sign = x.to(tl.int32, bitcast=True) & -2147483648
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def encode_element(r, EBITS: tl.constexpr, MBITS: tl.constexpr, SPECIALS: tl.constexpr):
    """Code (int32) of a value ``r`` already on the element grid (see ``round_to_element``)."""
    BIAS: tl.constexpr = (1 << (EBITS - 1)) - 1
    rbits = r.to(tl.int32, bitcast=True)
    sign = (rbits >> 31) & 1
    a = tl.abs(r)
    bits = a.to(tl.int32, bitcast=True)
    exp = (bits >> 23) - 127
    mant = (bits >> (23 - MBITS)) & ((1 << MBITS) - 1)
    normal = ((exp + BIAS) << MBITS) | mant
    MIN_NORMAL_EXP: tl.constexpr = 1 - BIAS
    is_normal = exp >= MIN_NORMAL_EXP
    sub = (tl.where(is_normal, 0.0, a) * exp2i(tl.full(a.shape, BIAS - 1 + MBITS, tl.int32))).to(tl.int32)
    mag = tl.where(is_normal, normal, sub)
    nan = r != r
    if SPECIALS == 1:
        mag = tl.where(nan, (1 << (EBITS + MBITS)) - 1, mag)
    elif SPECIALS == 2:
        mag = tl.where(nan, (((1 << EBITS) - 1) << MBITS) | (1 << (MBITS - 1)), mag)
    else:
        mag = tl.where(nan, 0, mag)
        sign = tl.where(nan, 0, sign)
    return (sign << (EBITS + MBITS)) | mag


@triton.jit
def decode_element(code, EBITS: tl.constexpr, MBITS: tl.constexpr, SPECIALS: tl.constexpr):
    """fp32 value of int32 element codes (NaN / Inf for special codes).

    The code's exponent and mantissa bits are placed at the top of an fp32's exponent and
    mantissa fields, the sign at bit 31, and the result multiplied by ``2**(127 - bias)``:
    exact for normal and subnormal codes alike (a subnormal code lands on an fp32
    subnormal with the same significand). Five integer/float operations per element;
    special codes (e4m3 S.1111.111, e5m2's all-ones exponent) are patched afterwards.
    """
    BIAS: tl.constexpr = (1 << (EBITS - 1)) - 1
    NB: tl.constexpr = 1 + EBITS + MBITS
    EMASK: tl.constexpr = (1 << EBITS) - 1
    MMASK: tl.constexpr = (1 << MBITS) - 1
    sign = (code << (32 - NB)) & -2147483648
    bits = ((code & ((1 << (NB - 1)) - 1)) << (23 - MBITS)) | sign
    rebias = tl.full(code.shape, (254 - BIAS) << 23, tl.int32).to(tl.float32, bitcast=True)
    v = bits.to(tl.float32, bitcast=True) * rebias
    if SPECIALS == 1:
        v = tl.where((code & ((1 << (NB - 1)) - 1)) == (1 << (NB - 1)) - 1, fp32_nan_like(v), v)
    elif SPECIALS == 2:
        exp_field = (code >> MBITS) & EMASK
        inf = (sign | 0x7F800000).to(tl.float32, bitcast=True)
        v = tl.where(exp_field == EMASK, tl.where((code & MMASK) == 0, inf, fp32_nan_like(v)), v)
    return v


@triton.jit
def e8m0_scale_byte(amax, finite, EMAX: tl.constexpr, MBITS: tl.constexpr, MAX: tl.constexpr, SCALE_MODE: tl.constexpr):
    """E8M0 byte (int32) from a finite block amax; ``finite`` False gives 0xFF.

    SCALE_MODE 0 = floor, 1 = even, 2 = rceil (``mxlib.reference.e8m0_scale``);
    EMAX is the element format's floor(log2(max)).
    """
    a = tl.where(finite, amax, 0.0)
    bits = a.to(tl.int32, bitcast=True)
    if SCALE_MODE == 0:
        e = (bits >> 23) - 127 - EMAX
    elif SCALE_MODE == 1:
        e = ((bits + (1 << (22 - MBITS))) >> 23) - 127 - EMAX
    else:
        q = tl.math.div_rn(a, tl.full(a.shape, MAX, tl.float32))
        qbits = q.to(tl.int32, bitcast=True)
        exp_field = qbits >> 23
        mant = qbits & 0x7FFFFF
        e_normal = exp_field - 127 + (mant != 0).to(tl.int32)
        e_sub = tl.where(mant > (1 << 22), -126, -127)
        e = tl.where(exp_field > 0, e_normal, e_sub)
    byte = tl.minimum(tl.maximum(e, -127), 127) + 127
    return tl.where(finite, byte, 255)


@triton.jit
def decode_e8m0(byte):
    """fp32 ``2**(byte - 127)`` of int32 E8M0 bytes; 255 is NaN, 0 is 2**-127."""
    v = exp2i(byte - 127)
    return tl.where(byte == 255, fp32_nan_like(v), v)


@triton.jit
def decode_e4m3(byte):
    """fp32 value of int32 NVFP4 block-scale bytes (e4m3fn: 0x7F / 0xFF are NaN)."""
    return decode_element(byte, NVFP4_SCALE_EBITS, NVFP4_SCALE_MBITS, NVFP4_SCALE_SPECIALS)


@triton.jit
def nvfp4_recip(v):
    """vLLM's guarded reciprocal ``1 / (v + (v == 0) * 1e8)``, correctly rounded."""
    return tl.math.div_rn(tl.full(v.shape, 1.0, tl.float32), v + tl.where(v == 0, 1e8, 0.0))


@triton.jit
def nvfp4_scale_and_multiplier(amax, gs, DIVIDE: tl.constexpr):
    """Block scale ``s`` (on the e4m3 grid) and quantize multiplier ``q`` (vLLM's arithmetic)."""
    return nvfp4_scale_and_multiplier_to(amax, gs, NVFP4_INV_MAX, DIVIDE)  # fp32(1/6)


@triton.jit
def nvfp4_scale_and_multiplier_to(amax, gs, INV_TARGET: tl.constexpr, DIVIDE: tl.constexpr):
    """``nvfp4_scale_and_multiplier`` mapping the block amax to ``1 / INV_TARGET`` (6, or 4/6's 4)."""
    s = gs * (amax * INV_TARGET)
    s = clamp_keep_nan(s, -NVFP4_SCALE_MAX, NVFP4_SCALE_MAX)
    s = round_to_element(s, NVFP4_SCALE_EBITS, NVFP4_SCALE_MBITS, NVFP4_SCALE_MAX)
    if DIVIDE:
        q = tl.where(s == 0, 0.0, tl.math.div_rn(gs + tl.zeros_like(s), tl.where(s == 0, 1.0, s)))
    else:
        q = nvfp4_recip(s * nvfp4_recip(gs))  # recip(gs) on gs's shape: once per row, not per block
    return s, q


@triton.jit
def round_e2m1_signed_like_vllm(v):
    """e2m1 rounding with the sign taken from ``v < 0`` (``-0.0`` -> ``+0.0``, as the seed).

    NaN is not handled: the callers overwrite blocks that hold NaN.
    """
    return tl.where(v == 0, 0.0, round_to_element(v, FP4_EBITS, FP4_MBITS, FP4_MAX, False))


# ----------------------------------------------------------------------------- tiles


@triton.jit
def grouped_pid(pid, EM, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_SIZE_M: tl.constexpr):
    """(pid_m, pid_n) of a 1D grid, GROUP_SIZE_M row blocks at a time (L2 reuse of the N operand)."""
    num_pid_m = tl.cdiv(EM, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_SIZE_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_SIZE_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_SIZE_M)
    return first_pid_m + ((pid % num_pid_in_group) % group_size_m), (pid % num_pid_in_group) // group_size_m


# Helpers on whole tiles, shared by the standalone kernels (quant.py) and the fused
# MoE kernels (fused_dequant_moe.py). Scale blocks always run along the last axis.


@triton.jit
def load_codes(row_ptrs, rmask, k0, K, NBITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """int32 codes ``[BLOCK_R, BLOCK_K]`` of elements ``k0 ...`` from packed rows.

    ``row_ptrs [BLOCK_R]`` point at the packed rows (uint8; FP4 two codes a byte, low
    nibble first; FP6 four codes in three bytes, little-endian; FP8 one a byte).
    """
    if NBITS == 8:
        cols = k0 + tl.arange(0, BLOCK_K)
        m = rmask[:, None] & (cols < K)[None, :]
        return tl.load(row_ptrs[:, None] + cols[None, :], mask=m, other=0).to(tl.int32)
    elif NBITS == 4:
        pcols = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        m = rmask[:, None] & (pcols < K // 2)[None, :]
        b = tl.load(row_ptrs[:, None] + pcols[None, :], mask=m, other=0).to(tl.int32)
        return tl.reshape(tl.join(b & 0xF, b >> 4), (BLOCK_R, BLOCK_K))
    else:
        groups = k0 // 4 + tl.arange(0, BLOCK_K // 4)
        m = rmask[:, None] & (groups < K // 4)[None, :]
        base = row_ptrs[:, None] + 3 * groups[None, :]
        b0 = tl.load(base, mask=m, other=0).to(tl.int32)
        b1 = tl.load(base + 1, mask=m, other=0).to(tl.int32)
        b2 = tl.load(base + 2, mask=m, other=0).to(tl.int32)
        word = b0 | (b1 << 8) | (b2 << 16)
        v0 = word & 0x3F
        v1 = (word >> 6) & 0x3F
        v2 = (word >> 12) & 0x3F
        v3 = (word >> 18) & 0x3F
        return tl.reshape(tl.join(tl.join(v0, v2), tl.join(v1, v3)), (BLOCK_R, BLOCK_K))


@triton.jit
def dequant_tile(
    codes,
    scale_bytes,
    g,
    EBITS: tl.constexpr,
    MBITS: tl.constexpr,
    SPECIALS: tl.constexpr,
    BS: tl.constexpr,
    NVFP4: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    G_ENCODE: tl.constexpr = False,
):
    """fp32 values of a code tile: ``value * 2**(s - 127)`` (MX, E8M0 bytes), or vLLM's
    ``e2m1 * (fp32(e4m3 scale) * g)`` (NVFP4, ``g [BLOCK_R, 1]`` the decode global scale); with
    ``G_ENCODE`` ``g`` is an encode scale and the block scale is ``fp32(e4m3 scale) / g``
    (compressed-tensors), correctly rounded."""
    v = tl.reshape(decode_element(codes, EBITS, MBITS, SPECIALS), (BLOCK_R, BLOCK_K // BS, BS))
    if NVFP4 and G_ENCODE:
        sb = decode_e4m3(scale_bytes)
        block = tl.math.div_rn(sb, g + tl.zeros_like(sb))
    elif NVFP4:
        block = decode_e4m3(scale_bytes) * g
    else:
        block = decode_e8m0(scale_bytes)
    return tl.reshape(v * block[:, :, None], (BLOCK_R, BLOCK_K))


@triton.jit
def mx_qdq_tile(
    x,
    EBITS: tl.constexpr,
    MBITS: tl.constexpr,
    EMAX: tl.constexpr,
    MAX: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """OCP MX QDQ of an fp32 tile (blocks of BS along the last axis); returns (values, E8M0 bytes)."""
    xb = tl.reshape(x, (BLOCK_R, BLOCK_K // BS, BS))
    # one integer max over |x|'s bits: non-negative floats order like their bits, and Inf/NaN
    # bits (>= 0x7F800000) exceed every finite value's, so they flag the block as well
    abits = tl.max(xb.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=2)
    finite = abits < 0x7F800000
    byte = e8m0_scale_byte(abits.to(tl.float32, bitcast=True), finite, EMAX, MBITS, MAX, SCALE_MODE)
    # blocks with NaN/Inf get byte 255: callers zero their codes or multiply by the NaN scale
    v = round_to_element(xb * exp2i(127 - byte)[:, :, None], EBITS, MBITS, MAX, False)
    return v, byte


@triton.jit
def mx_qdq_values(
    x,
    EBITS: tl.constexpr,
    MBITS: tl.constexpr,
    EMAX: tl.constexpr,
    MAX: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """OCP MX quantize-then-dequantize of an fp32 tile, fp32 out (exact)."""
    v, byte = mx_qdq_tile(x, EBITS, MBITS, EMAX, MAX, SCALE_MODE, BS, BLOCK_R, BLOCK_K)
    return tl.reshape(v * decode_e8m0(byte)[:, :, None], (BLOCK_R, BLOCK_K))


@triton.jit
def pairwise_block_sum16(t, BLOCK_R: tl.constexpr, NB: tl.constexpr):
    """Sum of ``t [BLOCK_R, NB, 16]`` over its last axis as a tree of pairs (0+1, 2+3, ...): two operands
    an addition, so the order is fixed (``mxlib.reference._pairwise_block_sum``). Returns [BLOCK_R, NB]."""
    a, b = tl.split(tl.reshape(t, (BLOCK_R, NB, 8, 2)))
    a, b = tl.split(tl.reshape(a + b, (BLOCK_R, NB, 4, 2)))
    a, b = tl.split(tl.reshape(a + b, (BLOCK_R, NB, 2, 2)))
    a, b = tl.split(a + b)
    return a + b


@triton.jit
def nvfp4_qdq_values(
    x,
    gs,
    DIVIDE: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FOUR_OVER_SIX: tl.constexpr = False,
):
    """NVFP4 QDQ of an fp32 tile with vLLM's arithmetic; ``gs`` broadcasts to [BLOCK_R, 1].
    ``FOUR_OVER_SIX``: each block also QDQ'd with its amax mapped to 4, kept where its squared error
    (``pairwise_block_sum16``) is smaller (``mxlib.reference.ref_nvfp4_quant_dequant``'s ``block_rule``)."""
    xb = tl.reshape(x, (BLOCK_R, BLOCK_K // BS, BS))
    # one integer max over |x|'s bits (see mx_qdq_tile): NaN bits exceed Inf's
    abits = tl.max(xb.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=2)
    has_nan = abits > 0x7F800000
    amax = tl.where(has_nan, 0.0, abits.to(tl.float32, bitcast=True))
    s, q = nvfp4_scale_and_multiplier(amax, gs, DIVIDE)
    # clamp keeping NaN: a block of fp32-subnormal size overflows q to Inf, and its zeros give 0 * Inf
    e = round_e2m1_signed_like_vllm(clamp_keep_nan(xb * q[:, :, None], -FP4_MAX, FP4_MAX))
    dq = e * tl.math.div_rn(s, gs + tl.zeros_like(s))[:, :, None]
    if FOUR_OVER_SIX:
        s4, q4 = nvfp4_scale_and_multiplier_to(amax, gs, 0.25, DIVIDE)
        e4 = round_e2m1_signed_like_vllm(clamp_keep_nan(xb * q4[:, :, None], -FP4_MAX, FP4_MAX))
        dq4 = e4 * tl.math.div_rn(s4, gs + tl.zeros_like(s4))[:, :, None]
        d6 = dq - xb
        d4 = dq4 - xb
        err6 = pairwise_block_sum16(d6 * d6, BLOCK_R, BLOCK_K // BS)
        err4 = pairwise_block_sum16(d4 * d4, BLOCK_R, BLOCK_K // BS)
        dq = tl.where((err4 < err6)[:, :, None], dq4, dq)
    dq = tl.where(has_nan[:, :, None], fp32_nan_like(dq), dq)
    return tl.reshape(dq, (BLOCK_R, BLOCK_K))


@triton.jit
def nvfp4_qdq_hw_values(x, gs, BS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """NVFP4 QDQ in hardware form: ``e2m1 * s`` (exact in bf16), the ``1 / gs`` left to the caller.
    Block scale and e2m1 codes are vLLM's (``nvfp4_qdq_values``); ``gs`` broadcasts to [BLOCK_R, 1]."""
    xb = tl.reshape(x, (BLOCK_R, BLOCK_K // BS, BS))
    abits = tl.max(xb.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=2)
    has_nan = abits > 0x7F800000
    amax = tl.where(has_nan, 0.0, abits.to(tl.float32, bitcast=True))
    s, q = nvfp4_scale_and_multiplier(amax, gs, False)
    e = round_e2m1_signed_like_vllm(clamp_keep_nan(xb * q[:, :, None], -FP4_MAX, FP4_MAX))
    dq = e * s[:, :, None]
    dq = tl.where(has_nan[:, :, None], fp32_nan_like(dq), dq)
    return tl.reshape(dq, (BLOCK_R, BLOCK_K))


@triton.jit
def row_abs_bits(x):
    """Max of ``|x|``'s fp32 bits along axis 1 (int32; NaN and Inf bits exceed every finite value's)."""
    return tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)


@triton.jit
def nvfp4_per_token_scales(abits):
    """``(gs, per_token_scale)`` fp32 from a row's ``row_abs_bits``: ``per_token_scale = max(amax *
    fp32(1/2688), 2**-126)``, ``gs = 1 / per_token_scale`` correctly rounded, both NaN for a row
    holding NaN or Inf (``mxlib.reference.nvfp4_per_token_scales``)."""
    finite = abits < 0x7F800000
    amax = tl.where(finite, abits, 0).to(tl.float32, bitcast=True)
    ts = tl.maximum(amax * NVFP4_INV_SCALE_DIVISOR, PER_TOKEN_SCALE_MIN)  # finite here: max drops no NaN
    ts = tl.where(finite, ts, fp32_nan_like(ts))
    return tl.math.div_rn(tl.full(ts.shape, 1.0, tl.float32), ts), ts


@triton.jit
def fp8_qdq_values(x, scale):
    """Static per-tensor e4m3 QDQ: ``e4m3(clamp(x * (1 / scale))) * scale`` (vLLM's scaled_fp8_quant)."""
    inv = tl.math.div_rn(scale * 0.0 + 1.0, scale)  # once, not per element
    q = round_to_element(clamp_keep_nan(x * inv, -FP8_MAX, FP8_MAX), FP8_EBITS, FP8_MBITS, FP8_MAX)
    return q * scale
