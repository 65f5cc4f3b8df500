"""The fused FP4 kernel's weight layout (``FP4Weights``) and its decode into the warpgroup-MMA operand.

``fused_fp4_moe`` multiplies packed e2m1 weights that it decodes in registers. This module holds
what that decode needs: the layout the weights are prepared into once (``prepare_fp4_weights``,
its inverse ``unprepare_fp4_packed``), the PTX blocks of the decode and the ``@triton.jit``
helpers that run them (``decode_fp4_words``: one K tile of a block of weight rows, in the dot
operand's order). ``fp6_layout`` gives MXFP6 weights the same properties and reuses
``mma_order`` and ``to_logical_rows``; this module imports neither it nor the kernel module.

* **Weight layout prepared once** (``prepare_fp4_weights``): the checkpoint keeps its layout
  (two codes a byte, even element in the low nibble); the kernel's layout reorders every row's
  128-element K tile (``K_TILE``) so that (1) a 32-bit word holds four elements ``p`` of the half
  tile K ``0..63`` and the four ``p + 64``: one word tile decodes into both half tiles; (2) the 16
  bytes one thread loads are exactly the elements it holds in Hopper's warpgroup-MMA register
  operand, so after the decode a few ``reshape``/``permute`` calls (free: register renaming) give
  the dot operand, with no round trip through shared memory, and the MMA of one half tile overlaps
  the decode of the next (the approach of OpenAI's triton_kernels Hopper MXFP4 value layout,
  derived here from the PTX fragment layout). Same bytes, no extra memory.
* **Bits placed for the decode** (``FP4Weights``, ``WORD_BIT_SOURCE``): inside each 32-bit word
  the eight codes' bits sit where four rotate-and-mask steps (``shf.l.wrap`` + ``and``, one PTX
  block a word, ``tl.inline_asm_elementwise``) leave two codes a register as the bf16 bits of
  ``e2m1 * 2**-126``; one ``mul.rn.bf16x2`` a pair then applies the block scale with the
  ``2**126`` folded in (``fp4_one_multiply``: every E8M0 byte <= 128; NVFP4 vLLM ``B < 4``;
  NVFP4 hardware always, as ``ue4m3 * 2**117`` with ``2**9`` back on the accumulator), else two.
  NVFP4 in vLLM's numerics multiplies in fp32 and rounds once, as vLLM does. Under
  ``TRITON_INTERPRET=1`` the same rotations run as Triton integer ops and the values come from
  ``_numerics`` (the interpreter runs no PTX); the reshapes are the same, so the interpreter tests
  check the layout.
* **Scales decoded once a row**: a row's scale word (four E8M0 or ue4m3 bytes) is loaded once per
  K tile and decoded by one PTX block (ue4m3 two bytes an instruction, the hardware's exact
  e4m3 -> f16), then selected for each packed word by its constant column.

How a weight tile is scaled (the decode's ``KIND``, the kernel's ``W_KIND``): ``W_MX`` (E8M0,
exact in bf16), ``W_NVFP4_VLLM`` (``bf16(e2m1 * (fp32(ue4m3) * g))``, vLLM's numerics),
``W_NVFP4_HW`` (``e2m1 * ue4m3`` exact, ``g`` on the accumulator: hardware numerics).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _numerics as nm
from ._triton import tl, triton

__all__ = [
    "FP4Weights",
    "K_TILE",
    "WORD_BIT_SOURCE",
    "W_MX",
    "W_NVFP4_VLLM",
    "W_NVFP4_HW",
    "fp4_one_multiply",
    "prepare_fp4_weights",
    "unprepare_fp4_weights",
    "unprepare_fp4_packed",
    "padded_to_k_tile",
    "pad_fp4_halves",
    "unpad_fp4_halves",
    "decode_fp4_words",
    "load_rows",
    "mma_order",
    "to_logical_rows",
]

K_TILE = 128  # the prepared layout's K tile (elements): a byte holds elements p and p + 64 (see FP4Weights)
# the decode's KIND (module docstring); one name a line, so that the API reference finds each
W_MX = 0
W_NVFP4_VLLM = 1
W_NVFP4_HW = 2


# ----------------------------------------------------------------------------- weight layout


@dataclass
class FP4Weights:
    """One expert stack in the kernel's layout (``prepare_fp4_weights``).

    ``packed`` uint8 ``[E, rows, K / 2]``, two levels:

    * bytes: each row's K tile ``t`` of 128 elements is 64 bytes (16 words); the codes of elements
      ``t * 128 + p`` and ``t * 128 + 64 + p``, ``p = 16j + 8h + 2c + e`` (c, j in 0..3, h, e in 0..1),
      live in word ``c * 4 + j``, as element ``2h + e`` and ``4 + 2h + e`` of its eight. That is
      the order of Hopper's warpgroup MMA register operand (PTX ISA, "wgmma register fragment A"
      for 16-bit types: lane ``4g + c`` holds K ``2c + {0, 1, 8, 9}`` of each 16-wide K step): a
      thread's 16-byte load is exactly what it feeds the MMA, so the decoded tile never goes
      through shared memory.
    * bits: inside each 32-bit word (little-endian) the eight 4-bit codes are spread so that the
      decode is four rotate-and-mask steps (``WORD_BIT_SOURCE``, ``_WORD_BITS``): output ``i`` of
      the decode holds elements ``2i`` (low bf16) and ``2i + 1`` (high bf16) with the code's
      magnitude bits at bf16 bits 6..8 and its sign at bit 15.

    ``scales`` uint8 ``[E, rows, K / block_size]`` (E8M0 or ue4m3 bytes, checkpoint order);
    ``global_scale`` fp32 ``[E]`` or ``[E, 2]`` (gate, up) NVFP4 decode scales, else None.
    ``one_multiply``: the scales allow the decode's one-multiply form (``fp4_one_multiply``).
    """

    packed: torch.Tensor
    scales: torch.Tensor
    block_size: int
    nvfp4: bool
    global_scale: torch.Tensor | None = None
    one_multiply: bool = False

    @property
    def k(self) -> int:
        return self.packed.shape[2] * 2

    @property
    def nbits(self) -> int:
        return 4


def _word_bit_source() -> tuple[tuple[int, int], ...]:
    """``source[bit]``: the (element 0..7, code bit 0..3) that bit ``bit`` of a prepared word holds.

    The decode's output ``i`` (a bf16 pair: elements ``2i`` and ``2i + 1``) is the word rotated left
    by ``_ROTATE[i]`` and masked to bits 6..8, 15 (+16): code bits (m, e0, e1, sign). Output 3
    takes bits 6 and 22 from a rotation by 6 and the rest from a rotation by 14. Found by an
    exhaustive search: no four plain rotations place all 32 bits (the bf16 pattern does not tile
    the word), so one output costs two rotations; eight or nine instructions a word in all."""
    src = {}
    for i in range(4):
        for half in range(2):
            for pos, bit in ((6, 0), (7, 1), (8, 2), (15, 3)):
                rot = _ROTATE[i] if i < 3 else (6 if pos == 6 else 14)
                src[(pos + 16 * half - rot) % 32] = (2 * i + half, bit)
    assert sorted(src) == list(range(32))
    return tuple(src[b] for b in range(32))


_ROTATE = (0, 20, 26)
WORD_BIT_SOURCE = _word_bit_source()


def _bit_moves(to_new: bool) -> list[tuple[int, int]]:
    """(shift, mask of source bits) groups moving nibble-layout words (element ``q``: byte ``q % 4``,
    nibble ``q // 4``) to prepared words (``to_new``) or back."""
    moves: dict[int, int] = {}
    for new, (q, b) in enumerate(WORD_BIT_SOURCE):
        old = 8 * (q % 4) + 4 * (q // 4) + b
        src, dst = (old, new) if to_new else (new, old)
        moves[dst - src] = moves.get(dst - src, 0) | (1 << src)
    return sorted(moves.items())


def _permute_words(b: torch.Tensor, to_new: bool) -> torch.Tensor:
    """uint8 ``[..., 4n]`` -> the same bytes with each 32-bit word's bits moved (``_bit_moves``)."""
    w = b.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    out = torch.zeros_like(w)
    for shift, mask in _bit_moves(to_new):
        part = w & mask
        out |= (part << shift) if shift >= 0 else (part >> -shift)
    out = torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)
    return out.view(torch.uint8).view(b.shape)


def fp4_one_multiply(scales: torch.Tensor, block_size: int, global_scale: torch.Tensor | None) -> bool:
    """Whether every block scale lets the decode fold the codes' ``2**126`` (``_WORD_BITS``) into
    the scale multiplier, one multiply a pair of elements instead of two, with the same bits.

    MXFP4: every E8M0 byte <= 128 (``2**(s - 1)`` is a bf16; 255 is NaN). NVFP4 vLLM mode: every
    ``B = fp32(ue4m3) * global_scale`` < 4 (``B * 2**126`` stays finite in fp32) and every global
    scale in ``[2**-117, 4)``: the kernel then multiplies ue4m3 by ``global_scale * 2**126`` (exact),
    which rounds as ``B * 2**126`` does since no ``B`` is an fp32 subnormal. Reads the tensors (a
    host synchronization): call once at load time.
    """
    if block_size == 16 and global_scale is None:
        raise ValueError("global_scale: required for NVFP4 (block_size 16)")
    if scales.numel() == 0:
        return True
    if block_size == 32:
        return int(scales.view(torch.uint8).max()) <= 128
    v = scales.view(torch.uint8).view(torch.float8_e4m3fn).float().abs().reshape(scales.shape[0], -1).amax(dim=1)
    g = global_scale.float().abs().reshape(scales.shape[0], -1)
    gmax = g.amax(dim=1)
    return bool(((v * gmax) < 4).all() and (gmax < 4).all() and (g.amin() >= 2.0**-117))


def prepare_fp4_weights(
    packed: torch.Tensor, scales: torch.Tensor, block_size: int, global_scale: torch.Tensor | None = None
) -> FP4Weights:
    """Checkpoint-layout FP4 expert weights -> the kernel's layout (once, at load time).

    Args:
        packed: uint8 ``[E, rows, K / 2]``, two e2m1 codes a byte, even element in the low nibble
            (ModelOpt, Quark, mxlib.reference).
        scales: ``[E, rows, K / block_size]`` E8M0 (``block_size`` 32) or float8_e4m3fn / uint8
            ue4m3 bytes (``block_size`` 16, NVFP4).
        block_size: 32 (MXFP4) or 16 (NVFP4).
        global_scale: NVFP4 decode scales (``weight_scale_2``) fp32 ``[E]`` or ``[E, 2]``; None for MX.

    Returns:
        ``FP4Weights``; ``packed`` is a new tensor of the same size (the input is not modified).

    Raises:
        ValueError: wrong rank, ``K`` not a multiple of 128, scale shape or block size mismatch.
    """
    if packed.dtype != torch.uint8 or packed.ndim != 3:
        raise ValueError(f"packed: expected uint8 [E, rows, K/2], got {packed.dtype} {list(packed.shape)}")
    e, rows, half = packed.shape
    k = half * 2
    if k % K_TILE:
        raise ValueError(f"packed: K={k} is not a multiple of the kernel's K tile {K_TILE}")
    if block_size not in (16, 32):
        raise ValueError(f"block_size: expected 16 (NVFP4) or 32 (MXFP4), got {block_size}")
    nvfp4 = block_size == 16
    if nvfp4 != (global_scale is not None):
        raise ValueError("global_scale: required for NVFP4 (block_size 16), not allowed for MXFP4")
    byte_dtypes = (
        (torch.uint8, torch.float8_e4m3fn)
        if nvfp4
        else (torch.uint8,) + ((torch.float8_e8m0fnu,) if hasattr(torch, "float8_e8m0fnu") else ())
    )
    if scales.dtype not in byte_dtypes:
        raise ValueError(
            f"scales: expected the scale bytes as {' or '.join(map(str, byte_dtypes))}, got {scales.dtype}"
        )
    scales = scales.view(torch.uint8) if scales.dtype != torch.uint8 else scales
    if tuple(scales.shape) != (e, rows, k // block_size):
        raise ValueError(f"scales: expected shape {[e, rows, k // block_size]}, got {list(scales.shape)}")
    out = torch.empty_like(packed)
    for i in range(e):  # one expert at a time: a few MB of temporaries
        out[i] = _to_mma_bytes(packed[i])
    if global_scale is not None:
        global_scale = global_scale.float().contiguous()
        if global_scale.shape not in ((e,), (e, 2)):
            raise ValueError(f"global_scale: expected [E] or [E, 2] with E={e}, got {list(global_scale.shape)}")
    scales = scales.contiguous()
    return FP4Weights(out, scales, block_size, nvfp4, global_scale, fp4_one_multiply(scales, block_size, global_scale))


def unprepare_fp4_weights(w: FP4Weights) -> torch.Tensor:
    """The checkpoint-layout packed bytes of ``w`` (inverse of ``prepare_fp4_weights``): what the
    other backends and checkpoint writers need when only the prepared copy is kept."""
    return unprepare_fp4_packed(w.packed)


def padded_to_k_tile(n: int) -> int:
    """``n`` rounded up to a multiple of ``K_TILE`` (the size a K or gated N extent is padded to)."""
    return -(-n // K_TILE) * K_TILE


def pad_fp4_halves(
    packed: torch.Tensor, scales: torch.Tensor, block_size: int, halves: int, rows_to: int, k_to: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero padding of checkpoint-layout FP4 weights ``[E, halves * R, K / 2]`` (``halves`` 2: w13's gate rows,
    then up rows, each padded on its own; 1: w2) and their scale bytes ``[E, halves * R, K / block_size]`` to
    ``[E, halves * rows_to, k_to / 2]`` and ``[E, halves * rows_to, k_to / block_size]``.

    Exact: a padded element is the code 0 with scale byte 0, so it decodes to +0 whatever the format, and adds
    nothing to a dot product; a padded row gives a zero output column.
    """
    e, rows, kb = packed.shape
    r = rows // halves
    p = packed.new_zeros(e, halves, rows_to, k_to // 2)
    p[:, :, :r, :kb] = packed.view(e, halves, r, kb)
    sc = scales.new_zeros(e, halves, rows_to, k_to // block_size)
    sc[:, :, :r, : scales.shape[2]] = scales.reshape(e, halves, r, scales.shape[2])
    return p.view(e, halves * rows_to, k_to // 2), sc.view(e, halves * rows_to, k_to // block_size)


def unpad_fp4_halves(packed: torch.Tensor, halves: int, rows: int, k: int) -> torch.Tensor:
    """The inverse of ``pad_fp4_halves`` on the packed bytes: ``[E, halves * rows_to, k_to / 2]`` ->
    ``[E, halves * rows, k / 2]`` (a copy)."""
    e, rows_p, kb = packed.shape
    return packed.view(e, halves, rows_p // halves, kb)[:, :, :rows, : k // 2].reshape(e, halves * rows, k // 2)


def unprepare_fp4_packed(packed: torch.Tensor) -> torch.Tensor:
    """Prepared packed bytes ``[E, rows, K / 2]`` -> checkpoint layout (a new tensor, same shape).

    Raises:
        ValueError: not uint8 ``[E, rows, K / 2]`` with K a multiple of the K tile (128).
    """
    if packed.dtype != torch.uint8 or packed.ndim != 3 or packed.shape[2] % (K_TILE // 2):
        raise ValueError(
            f"packed: expected prepared uint8 [E, rows, K/2] with K a multiple of {K_TILE}, got "
            f"{packed.dtype} {list(packed.shape)}"
        )
    e, rows, half = packed.shape
    b = _permute_words(packed, to_new=False).view(e, rows, half // 64, 4, 4, 2, 2)  # [.., tile, c, j, h, e]
    lo = (b & 0xF).permute(0, 1, 2, 4, 5, 3, 6).reshape(e, rows, half // 64, 64)  # K order: [j, h, c, e]
    hi = (b >> 4).permute(0, 1, 2, 4, 5, 3, 6).reshape(e, rows, half // 64, 64)
    codes = torch.cat((lo, hi), dim=-1).view(e, rows, half // 64, 64, 2)  # [.., 128] in element order
    return (codes[..., 0] | (codes[..., 1] << 4)).reshape(e, rows, half)


def _to_mma_bytes(packed: torch.Tensor) -> torch.Tensor:
    """Checkpoint-layout bytes ``[rows, K / 2]`` -> the kernel's layout (see ``FP4Weights``)."""
    rows, half = packed.shape
    b = packed.view(rows, half // 64, 64)
    codes = torch.stack((b & 0xF, b >> 4), dim=-1).reshape(rows, half // 64, 2, 64)  # [.., lo/hi, K]
    # K = 16j + 8h + 2c + e -> byte c * 16 + j * 4 + h * 2 + e (low nibble: half tile 0, high: 1)
    codes = codes.view(rows, half // 64, 2, 4, 2, 4, 2).permute(0, 1, 2, 5, 3, 4, 6).reshape(rows, half // 64, 2, 64)
    return _permute_words((codes[:, :, 0] | (codes[:, :, 1] << 4)).reshape(rows, half), to_new=True)


# ----------------------------------------------------------------------------- decode


# One prepared 32-bit word -> its eight elements, scaled (outputs $0..$7: elements 0..7, i.e. $0..$3
# the half tile K 0..63, $4..$7 K 64..127). $8 the word; $9 / $10 the scale multiplier of elements
# 0..3 / 4..7 (bf16x2 bits, the value twice; or, for vLLM's NVFP4, fp32 bits).
# Four rotate-and-mask steps (``FP4Weights``' bit layout) give four bf16x2 registers r0..r3, each
# two codes as the bf16 bits ((c & 7) << 6) | ((c & 8) << 12): the e2m1 exponent and mantissa at
# the top of bf16's fields (a bf16 subnormal for c & 7 == 1), which is e2m1 * 2**-126 exactly.
_WORD_BITS = """
and.b32 r0, $8, 0x81C081C0;
shf.l.wrap.b32 r1, $8, $8, 20;
and.b32 r1, r1, 0x81C081C0;
shf.l.wrap.b32 r2, $8, $8, 26;
and.b32 r2, r2, 0x81C081C0;
shf.l.wrap.b32 x, $8, $8, 6;
and.b32 x, x, 0x00400040;
shf.l.wrap.b32 r3, $8, $8, 14;
and.b32 r3, r3, 0x81808180;
or.b32 r3, r3, x;
"""
# times 2**126: the exact e2m1 values
_TIMES_2_126 = """mov.b32 c, 0x7E807E80;
mul.rn.bf16x2 r0, r0, c;
mul.rn.bf16x2 r1, r1, c;
mul.rn.bf16x2 r2, r2, c;
mul.rn.bf16x2 r3, r3, c;
"""
# times the block scale multipliers (bf16x2)
_TIMES_SCALE = """mul.rn.bf16x2 r0, r0, $9;
mul.rn.bf16x2 r1, r1, $9;
mul.rn.bf16x2 r2, r2, $10;
mul.rn.bf16x2 r3, r3, $10;
"""
# vLLM's NVFP4 product bf16(fp32(e2m1) * B): each bf16 -> fp32 (exact), times B in fp32 ($9, $10), one rounding
_TIMES_F32_SCALE = """shl.b32 f0, r0, 16;
and.b32 f1, r0, 0xFFFF0000;
shl.b32 f2, r1, 16;
and.b32 f3, r1, 0xFFFF0000;
shl.b32 f4, r2, 16;
and.b32 f5, r2, 0xFFFF0000;
shl.b32 f6, r3, 16;
and.b32 f7, r3, 0xFFFF0000;
mul.rn.f32 f0, f0, $9;
mul.rn.f32 f1, f1, $9;
mul.rn.f32 f2, f2, $9;
mul.rn.f32 f3, f3, $9;
mul.rn.f32 f4, f4, $10;
mul.rn.f32 f5, f5, $10;
mul.rn.f32 f6, f6, $10;
mul.rn.f32 f7, f7, $10;
cvt.rn.bf16x2.f32 r0, f1, f0;
cvt.rn.bf16x2.f32 r1, f3, f2;
cvt.rn.bf16x2.f32 r2, f5, f4;
cvt.rn.bf16x2.f32 r3, f7, f6;
"""
# the four bf16x2 results r0..r3 -> outputs $0..$7
_WORD_OUT = """mov.b32 {$0, $1}, r0;
mov.b32 {$2, $3}, r1;
mov.b32 {$4, $5}, r2;
mov.b32 {$6, $7}, r3;
}
"""
_REGS = "{\n.reg .b32 c, x, r<4>, f<8>;\n"
# One multiply a pair: the multiplier already holds the 2**126 (``fp4_one_multiply``; NVFP4 hardware
# mode: ue4m3 * 2**117, the 2**9 put back on the accumulator), or two (any E8M0 byte).
_ASM_WORD_ONE = tl.constexpr(_REGS + _WORD_BITS + _TIMES_SCALE + _WORD_OUT)
_ASM_WORD_TWO = tl.constexpr(_REGS + _WORD_BITS + _TIMES_2_126 + _TIMES_SCALE + _WORD_OUT)
# vLLM's NVFP4: B * 2**126 when ``fp4_one_multiply`` holds (the fp32 of a code's bits is e2m1 * 2**-126
# exactly, an fp32 subnormal for 0.5: the product is e2m1 * B, rounded once), else the exact e2m1 first.
_ASM_WORD_VLLM_ONE = tl.constexpr(_REGS + _WORD_BITS + _TIMES_F32_SCALE + _WORD_OUT)
_ASM_WORD_VLLM_TWO = tl.constexpr(_REGS + _WORD_BITS + _TIMES_2_126 + _TIMES_F32_SCALE + _WORD_OUT)


# A row's scale word (four scale bytes, $4) -> the four multipliers ($0..$3, byte 0..3), decoded once a
# row and then spread over the words they scale (``_tile_scales``). In PTX rather than Triton
# arithmetic so that the compiler keeps the whole decode in the dot operand's register layout (with
# the decode written as Triton arithmetic it judges the rematerialization too costly and
# round-trips every decoded tile through shared memory).
def _each_byte(body: str) -> str:
    """``body`` four times: ``$i`` the output, ``@8i`` the byte's bit offset, ``@i`` the byte (i = 0..3)."""
    return "".join(body.replace("$i", f"${i}").replace("@8i", str(8 * i)).replace("@i", str(i)) for i in range(4))


# E8M0 -> bf16x2 2**(b - 127) (the value twice): bits b << 7; b = 0 is 2**-127 (bf16 subnormal 0x0040), 255 NaN.
_ASM_SCALES_E8M0 = tl.constexpr(
    "{\n.reg .b32 b, v;\n.reg .pred p0, p1;\n"
    + _each_byte("""bfe.u32 b, $4, @8i, 8;
shl.b32 v, b, 7;
setp.eq.u32 p0, b, 0;
setp.eq.u32 p1, b, 255;
selp.b32 v, 0x40, v, p0;
selp.b32 v, 0x7FC0, v, p1;
prmt.b32 $i, v, v, 0x1010;
""")
    + "}"
)
# E8M0 -> bf16x2 2**(b - 127) * 2**126 = 2**(b - 1) (one-multiply form: every b <= 128): bits (b + 126) << 7.
# (No guard for a byte above 128: two more instructions a byte cost the MXFP4 loop 7% of its instructions
# (435 -> 467 SASS a step); ``fp4_one_multiply`` keeps such scales on the two-multiply form.)
_ASM_SCALES_E8M0_ONE = tl.constexpr(
    "{\n.reg .b32 b, v;\n"
    + _each_byte("""bfe.u32 b, $4, @8i, 8;
mad.lo.u32 v, b, 128, 16128;
prmt.b32 $i, v, v, 0x1010;
""")
    + "}"
)
# ue4m3 (e4m3fn bits) -> fp32 f0..f3, exactly: the hardware's e4m3 -> f16 conversion (two bytes an
# instruction) is exact and keeps NaN; f16 -> f32 is exact.
_E4M3X4_TO_F32 = """
.reg .b16 w<2>, x<4>;
.reg .b32 h<2>;
.reg .f32 f<4>;
mov.b32 {w0, w1}, $4;
cvt.rn.f16x2.e4m3x2 h0, w0;
cvt.rn.f16x2.e4m3x2 h1, w1;
mov.b32 {x0, x1}, h0;
mov.b32 {x2, x3}, h1;
cvt.f32.f16 f0, x0;
cvt.f32.f16 f1, x1;
cvt.f32.f16 f2, x2;
cvt.f32.f16 f3, x3;
"""
# -> bf16x2 ue4m3 * 2**117 (hardware mode, exact: 2**108 .. 448 * 2**117 are normal bf16 values; the
# code's 2**-126 makes the operand e2m1 * ue4m3 * 2**-9, exact too; the kernel multiplies the fp32
# accumulator by 2**9)
_ASM_SCALES_E4M3 = tl.constexpr(
    "{"
    + _E4M3X4_TO_F32
    + _each_byte("""mul.rn.f32 f@i, f@i, 0f7A000000;
cvt.rn.bf16x2.f32 $i, f@i, f@i;
""")
    + "}"
)
# -> fp32(ue4m3) * g ($5), one fp32 rounding (vLLM's per-block multiplier B), fp32 bits
_ASM_SCALES_E4M3_G = tl.constexpr(
    "{"
    + _E4M3X4_TO_F32
    + """mul.rn.f32 $0, f0, $5;
mul.rn.f32 $1, f1, $5;
mul.rn.f32 $2, f2, $5;
mul.rn.f32 $3, f3, $5;
}"""
)


@triton.jit
def _row_scales(s_rows, n_mask, g, word, KIND: tl.constexpr, ONE: tl.constexpr):
    """The four multipliers of scale word ``word`` of every row ([BLOCK_N] each, byte 0..3).

    Compiled: int32 bits, bf16x2 (the value twice; KIND 0 MX, 2 NVFP4 hardware: ue4m3 * 2**117) or
    fp32 ``fp32(ue4m3) * g`` (KIND 1, NVFP4 vLLM); ``ONE`` (``fp4_one_multiply``): times 2**126.
    Interpreted: the values the decode multiplies the exact e2m1 by, fp32 (KIND 2: ue4m3 / 2**9)."""
    sw = tl.load(s_rows + word, mask=n_mask, other=0)
    if nm.INTERPRETING:
        b0, b1, b2, b3 = sw & 0xFF, (sw >> 8) & 0xFF, (sw >> 16) & 0xFF, (sw >> 24) & 0xFF
        if KIND == 0:
            return nm.decode_e8m0(b0), nm.decode_e8m0(b1), nm.decode_e8m0(b2), nm.decode_e8m0(b3)
        elif KIND == 1:
            return nm.decode_e4m3(b0) * g, nm.decode_e4m3(b1) * g, nm.decode_e4m3(b2) * g, nm.decode_e4m3(b3) * g
        else:
            q = 1.0 / 512.0
            return nm.decode_e4m3(b0) * q, nm.decode_e4m3(b1) * q, nm.decode_e4m3(b2) * q, nm.decode_e4m3(b3) * q
    else:
        if KIND == 0:
            return tl.inline_asm_elementwise(
                _ASM_SCALES_E8M0_ONE if ONE else _ASM_SCALES_E8M0,
                "=r,=r,=r,=r,r",
                [sw],
                dtype=(tl.int32,) * 4,
                is_pure=True,
                pack=1,
            )
        elif KIND == 1:
            # ONE: g arrives as g * 2**126 (exact), so the products are B * 2**126 (``fp4_one_multiply``)
            return tl.inline_asm_elementwise(
                _ASM_SCALES_E4M3_G, "=r,=r,=r,=r,r,f", [sw, g], dtype=(tl.int32,) * 4, is_pure=True, pack=1
            )
        else:
            return tl.inline_asm_elementwise(
                _ASM_SCALES_E4M3, "=r,=r,=r,=r,r", [sw], dtype=(tl.int32,) * 4, is_pure=True, pack=1
            )


@triton.jit
def _by_column(j, m0, m1, m2, m3):
    """[BLOCK_N, 16]: ``m_j[row]`` in every column whose word index ``j`` (0..3, a constant per column) picks it."""
    return tl.where(j < 2, tl.where(j == 0, m0[:, None], m1[:, None]), tl.where(j == 2, m2[:, None], m3[:, None]))


@triton.jit
def _tile_scales(s_rows, n_mask, g, kt, KIND: tl.constexpr, BS: tl.constexpr, ONE: tl.constexpr):
    """The block scale multiplier of every packed word of K tile ``kt``: ``(s_lo, s_hi)`` for the half
    tiles K 0..63 and 64..127, [BLOCK_N, 16] each in word order ``c * 4 + j`` (word ``c * 4 + j``
    holds K ``16j + {0, 1, 8, 9} + 2c`` of its half tile, so its block is ``16j // BS``).
    ``s_rows`` point at int32 rows of scale bytes: a K tile's MX scales are one word (blocks 0..3),
    its NVFP4 scales two (blocks 0..3 of each half). Decoded once a row, then selected by ``j``."""
    j = (tl.arange(0, 16) % 4)[None, :]
    if BS == 32:
        m0, m1, m2, m3 = _row_scales(s_rows, n_mask, g, kt, KIND, ONE)
        return (tl.where(j < 2, m0[:, None], m1[:, None]), tl.where(j < 2, m2[:, None], m3[:, None]))
    else:
        m0, m1, m2, m3 = _row_scales(s_rows, n_mask, g, 2 * kt, KIND, ONE)
        s_lo = _by_column(j, m0, m1, m2, m3)
        m0, m1, m2, m3 = _row_scales(s_rows, n_mask, g, 2 * kt + 1, KIND, ONE)
        s_hi = _by_column(j, m0, m1, m2, m3)
        return s_lo, s_hi


@triton.jit
def mma_order(t0, t1, t2, t3, BLOCK_N: tl.constexpr):
    """Four [BLOCK_N, 16] tiles (element ``t`` of word ``c * 4 + j``: K ``16j + 8(t // 2) + 2c +
    t % 2``) -> the half tile [BLOCK_N, 64] in K order. Only reshapes and permutes: in the
    prepared layout a thread's 16-byte load holds exactly the elements its part of the warpgroup
    MMA's register operand needs, so Triton lowers these to nothing."""
    x = tl.join(tl.join(t0, t1), tl.join(t2, t3))  # [n, word, e = t % 2, h = t // 2]
    x = tl.reshape(x, (BLOCK_N, 4, 4, 2, 2))  # [n, c, j, e, h]
    x = tl.permute(x, (0, 2, 4, 1, 3))  # [n, j, h, c, e]
    return tl.reshape(x, (BLOCK_N, 64))


@triton.jit
def load_rows(BLOCK_N: tl.constexpr, NUM_WARPS: tl.constexpr):
    """The weight row each row of a loaded [BLOCK_N, 16]-word tile holds (``to_logical_rows`` undoes it).

    Triton loads such a tile 8 rows a warp (4 lanes of 16 bytes a row), tile row
    ``r = 8 W q + 8 w + g`` (W warps, warp w, lane row g, repeat q); the warpgroup MMA wants warp w
    on rows ``16 w + 8 (q % 2) + g`` (+ ``16 W (q // 2)``). Loading row ``n(r)`` puts every row
    where the MMA needs it, so the decoded tile reaches the dot with no exchange between warps."""
    r = tl.arange(0, BLOCK_N)
    q = r // (8 * NUM_WARPS)
    w = (r // 8) % NUM_WARPS
    return 16 * NUM_WARPS * (q // 2) + 16 * w + 8 * (q % 2) + r % 8


@triton.jit
def to_logical_rows(x, BLOCK_N: tl.constexpr, NUM_WARPS: tl.constexpr):
    """[BLOCK_N, 128] in load order (``load_rows``) -> weight-row order (a register relabeling)."""
    x = tl.reshape(x, (BLOCK_N // (16 * NUM_WARPS), 2, NUM_WARPS, 8, 128))  # [q // 2, q % 2, w, g, K]
    return tl.reshape(tl.permute(x, (0, 2, 1, 3, 4)), (BLOCK_N, 128))  # rows 16 W (q // 2) + 16 w + 8 (q % 2) + g


@triton.jit
def _rotl(w, r: tl.constexpr):
    """Interpreter: 32-bit rotate left of int64 words in [0, 2**32)."""
    return ((w << r) | (w >> (32 - r))) & 0xFFFFFFFF


@triton.jit
def _pair(o, s):
    """Interpreter: a decode output register (bf16 bits of two codes, ``_WORD_BITS``) -> its low and
    high element, each ``e2m1 * s`` rounded to bf16 once (fp32 holding the bf16 values)."""
    lo = nm.decode_element((((o >> 6) & 7) | ((o >> 12) & 8)).to(tl.int32), 2, 1, 0) * s
    hi = nm.decode_element((((o >> 22) & 7) | ((o >> 28) & 8)).to(tl.int32), 2, 1, 0) * s
    return nm.to_fp32(nm.cast_out(lo, tl.bfloat16)), nm.to_fp32(nm.cast_out(hi, tl.bfloat16))


@triton.jit
def decode_fp4_words(
    w_rows,
    s_rows,
    n_mask,
    g,
    kt,
    KIND: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_WARPS: tl.constexpr,
    ONE: tl.constexpr,
):
    """Weight K tile ``kt`` [BLOCK_N, 128], bf16 (fp32 holding the bf16 values under the interpreter);
    ``w_rows`` point at int32 rows (16 words per K tile) in load order (``load_rows``): a word's
    elements 0..3 are in the half tile K 0..63, 4..7 in K 64..127 (``FP4Weights``)."""
    wd = tl.load(w_rows[:, None] + (kt * 16 + tl.arange(0, 16))[None, :], mask=n_mask[:, None], other=0)
    s_lo, s_hi = _tile_scales(s_rows, n_mask, g, kt, KIND, BS, ONE)
    if nm.INTERPRETING:  # the PTX's rotate-and-mask steps, then the codes' values
        w = wd.to(tl.int64) & 0xFFFFFFFF
        o0, o1 = _pair(w & 0x81C081C0, s_lo)
        o2, o3 = _pair(_rotl(w, 20) & 0x81C081C0, s_lo)
        o4, o5 = _pair(_rotl(w, 26) & 0x81C081C0, s_hi)
        o6, o7 = _pair((_rotl(w, 6) & 0x00400040) | (_rotl(w, 14) & 0x81808180), s_hi)
    else:
        if KIND == 1:
            o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
                _ASM_WORD_VLLM_ONE if ONE else _ASM_WORD_VLLM_TWO,
                "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r",
                [wd, s_lo, s_hi],
                dtype=(tl.bfloat16,) * 8,
                is_pure=True,
                pack=1,
            )
        else:  # NVFP4 hardware mode: always one multiply (ue4m3 * 2**117)
            o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
                _ASM_WORD_ONE if (ONE or KIND == 2) else _ASM_WORD_TWO,
                "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r",
                [wd, s_lo, s_hi],
                dtype=(tl.bfloat16,) * 8,
                is_pure=True,
                pack=1,
            )
    lo = mma_order(o0, o1, o2, o3, BLOCK_N)
    hi = mma_order(o4, o5, o6, o7, BLOCK_N)
    return to_logical_rows(tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (BLOCK_N, 128)), BLOCK_N, NUM_WARPS)
