"""MXFP6 weights (e2m3 / e3m2 + E8M0 per 32) in the register layout of the fused FP4 kernel.

``fused_fp4_moe`` decodes 4-bit weights whose prepared bytes (``fp4_layout.FP4Weights``) are, thread
by thread, the elements of Hopper's warpgroup-MMA register operand. This module gives 6-bit weights the
same property, so that the FP4 kernel's K loop runs them (``W_BITS=6``) with the decoded tile
reaching ``tl.dot`` without a shared-memory round trip and no extra device memory.

Layout (``FP6Weights``, prepared once at load time): each row's 256-element **K super tile**
(two of the FP4 layout's 128-element K tiles) is 192 bytes = 48 int32 words, three planes of 16
words, each plane loaded as a ``[BLOCK_N, 16]`` word tile exactly like the FP4 tile (so it has
the FP4 tile's register layout; a thread's 16 bytes of each plane belong to the same elements):

* plane ``t`` (0, 1): code bits 1..4 of the 128 elements of K tile ``t``; word ``4c + j`` holds
  the same eight elements as the FP4 layout's word ``4c + j`` (K ``16j + {0, 1, 8, 9} + 2c`` and
  those plus 64 of the tile);
* plane 2: code bits 0 and 5 (lowest mantissa bit and sign) of both tiles; word ``4c + j`` holds
  those of the sixteen elements of word ``4c + j`` of planes 0 and 1.

Inside a word the bits sit where one select, one rotate and one mask put them (below); the rule
is ``layout_table`` and the tests check it against ``mxlib.reference``.

Decode of a word pair (plane ``t`` word ``n``, plane 2 word ``p``) into four bf16x2 registers,
output ``o`` (0..3) holding the elements ``2o``, ``2o + 1`` of ``fp4_layout.mma_order``'s eight:
``r = rotl((n & C) | (p & ~C), k) & M``, ``k = 4o + t * D`` (``D`` = 2 for e2m3, 1 for e3m2, so
that the plane-2 bits of the two tiles interleave), ``C = rotr(M_N, k)``, ``M = M_N | M_P`` (``M_N``:
where code bits 1..4 go in the two bf16 halves, ``M_P``: bits 0 and 5). ``r`` holds each code
as bf16 bits: sign at bit 15, the five exponent-mantissa bits with the mantissa at the top of
bf16's mantissa (bits ``F .. F + 4``, ``F = 7 - mbits``): the bf16 value is
``element * 2**(bias - 127)`` (e2m3: ``2**-126``, e3m2: ``2**-124``; element subnormals land on
bf16 subnormals with the same significand). One ``mul.rn.bf16x2`` by ``2**(127 - bias)`` makes it
the element exactly, one more by the E8M0 block scale (bf16x2, decoded in PTX; byte 0 is the
subnormal ``2**-127``, byte 255 NaN) the weight: exact for in-range products, and what
``mxlib.reference.dequantize_mx`` rounds to bf16 (Inf where the fp32 product overflows).
PTX per eight elements of a tile (``DECODE_INSTRUCTIONS``): 11 (tile 0) or 12 (tile 1)
``lop3`` / ``shf`` / ``and``, 1 ``mov`` of the constant and 8 ``mul.rn.bf16x2``; the scales of a
thread's 32 elements of a row and K tile (four blocks) take two 9-instruction blocks
(``_ASM_E8M0_PAIR``), 4.5 more per eight elements. The PTX needs sm_90 (``max.u16x2``), as the
kernel's warpgroup MMA does.

Under ``TRITON_INTERPRET=1`` (no PTX) the same select/rotate/mask runs as Triton integer ops and
the element value comes from the code bits read back out of ``r`` by ``_numerics``; the reshapes
are the same, so the interpreter tests check the layout. ``decode_fp6_words`` returns the eight
elements of every word pair; ``fp6_tile`` puts them in the dot operand's order with
``fp4_layout.mma_order`` and ``to_logical_rows`` (this module does not import the kernel module).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from .. import reference as _ref
from ..formats import ELEMENT_FORMATS, ElementFormat
from . import _numerics as nm
from . import fp4_layout as F4
from ._triton import tl, triton

__all__ = [
    "FP6Weights",
    "prepare_fp6_weights",
    "unprepare_fp6_packed",
    "unprepare_fp6_weights",
    "layout_table",
    "SUPER_TILE",
    "DECODE_INSTRUCTIONS",
    "fp6_tile",
]

SUPER_TILE = 256  # elements of K per prepared super tile (two 128-element K tiles)
_WORDS = 48  # int32 words per row and super tile: planes 0, 1 (4 bits of K tile 0, 1) and 2 (2 bits of both)
_BLOCK_SIZE = 32  # OCP MX block (E8M0 scale per 32 elements)
_FP6 = {f.ebits: f for f in ELEMENT_FORMATS.values() if f.nbits == 6}  # {2: e2m3, 3: e3m2}


def _field_low(ebits: int) -> int:
    """Bit of the bf16 half where the code's 5 exponent-mantissa bits start (mantissa at the top of bf16's)."""
    return 7 - (5 - ebits)


def _tile1_rotation(ebits: int) -> int:
    """``D``: the extra rotation of K tile 1, chosen so that the plane-2 bits of the two tiles interleave."""
    return 4 - ebits  # e2m3: 2, e3m2: 1 (``layout_table`` checks the bijection)


def _rotation(ebits: int, t: int, o: int) -> int:
    return (4 * o + t * _tile1_rotation(ebits)) % 32


def _masks(ebits: int) -> tuple[int, int]:
    """(M_N, M_P): the positions in an output register of the plane-t bits (code bits 1..4) and
    of the plane-2 bits (code bits 0 and 5), both bf16 halves."""
    f = _field_low(ebits)
    return (0xF << (f + 1)) * 0x10001, ((1 << f) | (1 << 15)) * 0x10001


def _rotr(x: int, k: int) -> int:
    return ((x >> k) | (x << (32 - k))) & 0xFFFFFFFF if k else x


@cache
def layout_table(ebits: int) -> torch.Tensor:
    """int64 ``[256, 6]``: for element ``K`` of a super tile and code bit ``b`` (0 = lowest
    mantissa bit, 5 = sign), its bit index in the super tile's 48 words (``word * 32 + bit``).

    Element ``128 t + 64 hi + q`` (``q = 16j + 8h + 2c + e``) is FP4 word ``4c + j``, output
    register ``o = 2 hi + h``, bf16 half ``e``; its bit ``b`` goes to bf16 position ``target``
    (sign 15, else ``F + b``, plus 16 e) and is stored ``rotl(., k)``-inverse, at
    ``(target - k) mod 32`` of the plane-t word (bits 1..4) or of the plane-2 word (bits 0, 5).

    Raises:
        ValueError: ``ebits`` not that of an FP6 element (2: e2m3, 3: e3m2).
    """
    if ebits not in _FP6:
        raise ValueError(f"ebits: expected 2 (e2m3) or 3 (e3m2), got {ebits}")
    f = _field_low(ebits)
    table = torch.empty(SUPER_TILE, 6, dtype=torch.int64)
    for t in range(2):
        for p in range(128):
            hi, q = divmod(p, 64)
            j, h, c, e = q // 16, (q // 8) % 2, (q // 2) % 4, q % 2
            word, o = 4 * c + j, 2 * hi + h
            k = _rotation(ebits, t, o)
            for b in range(6):
                target = (15 if b == 5 else f + b) + 16 * e
                plane = t if 1 <= b <= 4 else 2
                table[128 * t + p, b] = (plane * 16 + word) * 32 + (target - k) % 32
    if torch.unique(table).numel() != _WORDS * 32:
        raise AssertionError(f"FP6 layout for ebits={ebits} is not a bijection")  # a defect here, not bad input
    return table


# ----------------------------------------------------------------------------- prepare / unprepare


@dataclass
class FP6Weights:
    """One MXFP6 expert stack in the FP4 kernel's layout (``prepare_fp6_weights``; module docstring).

    ``packed`` uint8 ``[E, rows, 3K / 4]``: per row, super tile ``s`` is bytes ``192 s .. 192 s + 191``
    (planes 0, 1, 2 of 64 bytes); ``scales`` uint8 E8M0 ``[E, rows, K / 32]`` (checkpoint order);
    ``element`` e2m3 or e3m2. ``nvfp4`` / ``global_scale`` / ``block_size`` keep ``FP4Weights``'
    interface for the kernel's launch code.
    """

    packed: torch.Tensor
    scales: torch.Tensor
    element: ElementFormat
    block_size: int = _BLOCK_SIZE
    nvfp4: bool = False
    global_scale: torch.Tensor | None = None

    @property
    def k(self) -> int:
        return self.packed.shape[2] * 4 // 3

    @property
    def nbits(self) -> int:
        return 6


def _check_element(element: str | ElementFormat) -> ElementFormat:
    el = ELEMENT_FORMATS.get(element) if isinstance(element, str) else element
    if el is None or el.nbits != 6:
        raise ValueError(f"element: expected an FP6 element (e2m3 or e3m2), got {element!r}")
    return el


def prepare_fp6_weights(
    packed: torch.Tensor, scales: torch.Tensor, element: str | ElementFormat, block_size: int = _BLOCK_SIZE
) -> FP6Weights:
    """Checkpoint-layout MXFP6 expert weights -> the FP4 kernel's FP6 layout (once, at load time).

    Args:
        packed: uint8 ``[E, rows, 3K / 4]``, four codes in three bytes (AMD Quark's layout,
            ``mxlib.reference.pack_codes``).
        scales: uint8 (or float8_e8m0fnu) E8M0 ``[E, rows, K / 32]``.
        element: ``"e2m3"`` or ``"e3m2"`` (or its ``ElementFormat``).
        block_size: 32 (OCP MX).

    Returns:
        ``FP6Weights``; ``packed`` a new tensor of the same size (the input is not modified).

    Raises:
        ValueError: not an FP6 element, block size not 32, wrong dtype or rank, ``K`` not a multiple
            of the 256-element super tile, scale shape mismatch.
    """
    el = _check_element(element)
    if block_size != _BLOCK_SIZE:
        raise ValueError(f"block_size: the FP6 layout takes OCP MX blocks of {_BLOCK_SIZE}, got {block_size}")
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or packed.ndim != 3:
        got = f"{packed.dtype} {list(packed.shape)}" if isinstance(packed, torch.Tensor) else type(packed).__name__
        raise ValueError(f"packed: expected uint8 [E, rows, 3K/4], got {got}")
    e, rows, nbytes = packed.shape
    if nbytes % 3:
        raise ValueError(f"packed: FP6 rows must be a multiple of 3 bytes, got {nbytes}")
    k = nbytes * 4 // 3
    if k % SUPER_TILE:
        raise ValueError(f"packed: K={k} is not a multiple of the FP6 layout's super tile {SUPER_TILE}")
    if scales.dtype != torch.uint8:
        if scales.dtype.itemsize != 1:
            raise ValueError(f"scales: expected uint8 E8M0 bytes, got {scales.dtype}")
        scales = scales.view(torch.uint8)
    if tuple(scales.shape) != (e, rows, k // block_size):
        raise ValueError(f"scales: expected shape {[e, rows, k // block_size]}, got {list(scales.shape)}")
    out = torch.empty_like(packed)
    for i in range(e):  # one expert at a time: temporaries of ~ 40 bytes per element of one expert
        out[i] = _to_layout(packed[i], el.ebits)
    return FP6Weights(out, scales.contiguous(), el, block_size)


def _to_layout(packed: torch.Tensor, ebits: int) -> torch.Tensor:
    """Checkpoint bytes ``[rows, 3K / 4]`` -> prepared bytes (same shape)."""
    rows, nbytes = packed.shape
    s = nbytes * 4 // 3 // SUPER_TILE
    codes = _ref.unpack_codes(packed, _FP6[ebits]).view(rows, s, SUPER_TILE, 1)
    bits = ((codes >> torch.arange(6, device=packed.device, dtype=torch.uint8)) & 1).reshape(rows, s, SUPER_TILE * 6)
    # bit ``word * 32 + i`` of the super tile takes code bit ``src``; words little-endian: byte 4 word + i // 8
    src = torch.argsort(layout_table(ebits).reshape(-1)).to(packed.device)
    return _bytes_of_bits(bits[:, :, src]).reshape(rows, nbytes)


def _bytes_of_bits(bits: torch.Tensor) -> torch.Tensor:
    """uint8 0/1 ``[..., 8n]`` -> uint8 ``[..., n]``, bit ``8j + i`` at bit ``i`` of byte ``j``."""
    b = bits.view(*bits.shape[:-1], bits.shape[-1] // 8, 8)
    out = b[..., 0].clone()
    for i in range(1, 8):
        out |= b[..., i] << i
    return out


def unprepare_fp6_packed(packed: torch.Tensor, element: str | ElementFormat) -> torch.Tensor:
    """Prepared FP6 bytes ``[E, rows, 3K / 4]`` -> checkpoint layout (a new tensor, same shape).

    Raises:
        ValueError: not uint8 ``[E, rows, 3K / 4]`` with K a multiple of the super tile (256); an
            element format other than e2m3 / e3m2. (Which of the two wrote the bytes cannot be read
            from them: ``element`` must be the one given to ``prepare_fp6_weights``.)
    """
    el = _check_element(element)
    if packed.dtype != torch.uint8 or packed.ndim != 3 or packed.shape[2] % (SUPER_TILE * 3 // 4):
        raise ValueError(
            f"packed: expected prepared uint8 [E, rows, 3K/4] with K a multiple of {SUPER_TILE}, got "
            f"{packed.dtype} {list(packed.shape)}"
        )
    e, rows, nbytes = packed.shape
    s = nbytes * 4 // 3 // SUPER_TILE
    dest = layout_table(el.ebits).to(packed.device)  # [256, 6]: code bit -> bit of the super tile's words
    out = torch.empty_like(packed)
    for i in range(e):
        b = packed[i].view(rows, s, _WORDS * 4, 1)
        bits = ((b >> torch.arange(8, device=packed.device, dtype=torch.uint8)) & 1).reshape(rows, s, _WORDS * 32)
        cb = bits[:, :, dest]  # [rows, s, 256, 6]
        codes = cb[..., 0].clone()
        for j in range(1, 6):
            codes |= cb[..., j] << j
        out[i] = _ref.pack_codes(codes.reshape(rows, s * SUPER_TILE), el)
    return out


def unprepare_fp6_weights(w: FP6Weights) -> torch.Tensor:
    """The checkpoint-layout packed bytes of ``w`` (inverse of ``prepare_fp6_weights``)."""
    return unprepare_fp6_packed(w.packed, w.element)


# ----------------------------------------------------------------------------- PTX decode


def _decode_asm(ebits: int, t: int) -> str:
    """PTX: plane-t word ``$8`` and plane-2 word ``$9`` -> the eight elements (bf16 ``$0..$7``, the
    order of ``fp4_layout.mma_order``'s t0..t3 then the +64 half), scaled by ``$10`` (elements 0..3) and
    ``$11`` (4..7), E8M0 block scales as bf16x2."""
    m_n, m_p = _masks(ebits)
    lines = ["{", ".reg .b32 c, r<4>;"]
    for o in range(4):
        k = _rotation(ebits, t, o)
        lines.append(f"lop3.b32 r{o}, $8, $9, {_rotr(m_n, k):#010x}, 0xE4;")  # (n & C) | (p & ~C)
        if k:
            lines.append(f"shf.l.wrap.b32 r{o}, r{o}, r{o}, {k};")
        lines.append(f"and.b32 r{o}, r{o}, {m_n | m_p:#010x};")
    bias = _FP6[ebits].bias
    c = (127 - bias + 127) << 7  # bf16 bits of 2**(127 - bias)
    lines.append(f"mov.b32 c, {c * 0x10001:#010x};")
    lines += [f"mul.rn.bf16x2 r{o}, r{o}, c;" for o in range(4)]
    lines += [f"mul.rn.bf16x2 r{o}, r{o}, ${10 + o // 2};" for o in range(4)]
    lines += [f"mov.b32 {{${2 * o}, ${2 * o + 1}}}, r{o};" for o in range(4)]
    return "\n".join(lines + ["}"])


def _count_instructions(asm: str) -> int:
    """PTX instructions of a decode block, the output moves (register renaming) left out."""
    body = [s.strip() for s in asm.splitlines()]
    return sum(1 for s in body if s.endswith(";") and not s.startswith((".reg", "mov.b32 {")))


_ASM_E2M3_T0 = tl.constexpr(_decode_asm(2, 0))
_ASM_E2M3_T1 = tl.constexpr(_decode_asm(2, 1))
_ASM_E3M2_T0 = tl.constexpr(_decode_asm(3, 0))
_ASM_E3M2_T1 = tl.constexpr(_decode_asm(3, 1))
# PTX instructions per eight elements, by (element, K tile): the word decode (the E8M0 scale decode
# is once per scale block and row, shared by the words of a thread)
DECODE_INSTRUCTIONS = {
    (el, t): _count_instructions(_decode_asm(eb, t)) for eb, el in ((2, "e2m3"), (3, "e3m2")) for t in (0, 1)
}

# E8M0 scales of a word pair: of the scale word $2 (a K tile's four blocks), bytes $3 selects (prmt
# selector 0x4240: bytes 0 and 2, 0x4341: bytes 1 and 3) -> $0, $1 the bf16x2 ``2**(b - 127)`` (the value
# twice) of the first and of the second. Both at once in the halves of one word: ``b << 7``, then
# ``max`` makes byte 0 the subnormal 2**-127 (0x0040), and a half that is 0x7F80 (byte 255) gets bit 6
# (0x7FC0, NaN): 0x7F80 + 0x80 is the only half that reaches bit 15. 9 instructions for two scales.
_ASM_E8M0_PAIR = tl.constexpr("""{
.reg .b32 v, t;
prmt.b32 v, $2, 0, $3;
shl.b32 v, v, 7;
mov.b32 t, 0x00400040;
max.u16x2 v, v, t;
add.u32 t, v, 0x00800080;
shr.u32 t, t, 9;
lop3.b32 v, v, t, 0x00400040, 0xF8;
prmt.b32 $0, v, v, 0x1010;
prmt.b32 $1, v, v, 0x3232;
}""")


# ----------------------------------------------------------------------------- jit helpers


@triton.jit
def load_fp6_planes(w_rows, n_mask, st):
    """The three ``[BLOCK_N, 16]`` int32 word tiles of super tile ``st`` (``w_rows``: int32 rows in
    the FP4 kernel's load order, 48 words per super tile): plane 0, plane 1, plane 2."""
    ptrs = w_rows[:, None] + (st * 48 + tl.arange(0, 16))[None, :]
    n0 = tl.load(ptrs, mask=n_mask[:, None], other=0)
    n1 = tl.load(ptrs + 16, mask=n_mask[:, None], other=0)
    p = tl.load(ptrs + 32, mask=n_mask[:, None], other=0)
    return n0, n1, p


@triton.jit
def _pair_bits(n, p, o: tl.constexpr, T: tl.constexpr, EBITS: tl.constexpr):
    """Interpreter twin of one output register of the PTX decode: uint32 bf16x2 bits."""
    F: tl.constexpr = EBITS + 2
    MN: tl.constexpr = (15 << (F + 1)) * 65537
    MP: tl.constexpr = ((1 << F) | (1 << 15)) * 65537
    K: tl.constexpr = (4 * o + T * (4 - EBITS)) % 32
    C: tl.constexpr = ((MN >> K) | (MN << ((32 - K) % 32))) & 0xFFFFFFFF
    NC: tl.constexpr = C ^ 0xFFFFFFFF
    x = (n.to(tl.uint32, bitcast=True) & C) | (p.to(tl.uint32, bitcast=True) & NC)
    if K != 0:
        x = (x << K) | (x >> (32 - K))
    return x & (MN | MP)


@triton.jit
def _half_value(r, HALF: tl.constexpr, s, EBITS: tl.constexpr):
    """Interpreter: the code in bf16 half ``HALF`` of ``r`` (sign at 15, exponent-mantissa at
    ``EBITS + 2``), its element value times the scale ``s``, rounded to bf16 once (as fp32)."""
    F: tl.constexpr = EBITS + 2
    sign = ((r >> (15 + 16 * HALF)) & 1).to(tl.int32)
    em = ((r >> (F + 16 * HALF)) & 31).to(tl.int32)
    v = nm.decode_element((sign << 5) | em, EBITS, 5 - EBITS, 0) * s
    return nm.to_fp32(nm.cast_out(v, tl.bfloat16))


@triton.jit
def _ptx_decode(n, p, s_lo, s_hi, ASM: tl.constexpr):
    """The eight bf16 elements of every word pair (``_decode_asm``)."""
    return tl.inline_asm_elementwise(
        ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r", [n, p, s_lo, s_hi], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1
    )


@triton.jit
def decode_fp6_words(n, p, s_rows, n_mask, st, T: tl.constexpr, EBITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The eight elements of every word pair of K tile ``T`` (0, 1) of super tile ``st``: eight
    [BLOCK_N, 16] tiles in the order of ``fp4_layout.mma_order``'s t0..t3 (K 0..63 of the
    tile), then the same for K 64..127; bf16 (fp32 holding the bf16 values under the interpreter).
    ``n`` the plane-T words, ``p`` the plane-2 words (``load_fp6_planes``); ``s_rows`` int32 rows of
    E8M0 bytes (the rows' load order)."""
    # the tile's four scale bytes are one word; word 4c + j: low half block j // 2, high half 2 + j // 2
    sw = tl.broadcast_to(tl.load(s_rows + st * 2 + T, mask=n_mask, other=0)[:, None], (BLOCK_N, 16))
    j = tl.arange(0, 16) % 4
    if nm.INTERPRETING:
        sh_lo = tl.broadcast_to(((j // 2) * 8)[None, :], (BLOCK_N, 16))
        sh_hi = sh_lo + 16
        s_lo = nm.decode_e8m0((sw >> sh_lo) & 0xFF)
        s_hi = nm.decode_e8m0((sw >> sh_hi) & 0xFF)
        r0 = _pair_bits(n, p, 0, T, EBITS)
        r1 = _pair_bits(n, p, 1, T, EBITS)
        r2 = _pair_bits(n, p, 2, T, EBITS)
        r3 = _pair_bits(n, p, 3, T, EBITS)
        return (
            _half_value(r0, 0, s_lo, EBITS),
            _half_value(r0, 1, s_lo, EBITS),
            _half_value(r1, 0, s_lo, EBITS),
            _half_value(r1, 1, s_lo, EBITS),
            _half_value(r2, 0, s_hi, EBITS),
            _half_value(r2, 1, s_hi, EBITS),
            _half_value(r3, 0, s_hi, EBITS),
            _half_value(r3, 1, s_hi, EBITS),
        )
    else:
        sel = tl.broadcast_to((0x4240 + (j // 2) * 0x0101)[None, :], (BLOCK_N, 16))
        s_lo, s_hi = tl.inline_asm_elementwise(
            _ASM_E8M0_PAIR, "=r,=r,r,r", [sw, sel], dtype=(tl.int32, tl.int32), is_pure=True, pack=1
        )
        if EBITS == 2:
            if T == 0:
                return _ptx_decode(n, p, s_lo, s_hi, _ASM_E2M3_T0)
            else:
                return _ptx_decode(n, p, s_lo, s_hi, _ASM_E2M3_T1)
        else:
            if T == 0:
                return _ptx_decode(n, p, s_lo, s_hi, _ASM_E3M2_T0)
            else:
                return _ptx_decode(n, p, s_lo, s_hi, _ASM_E3M2_T1)


@triton.jit
def fp6_tile(
    n, p, s_rows, n_mask, st, T: tl.constexpr, EBITS: tl.constexpr, BLOCK_N: tl.constexpr, NUM_WARPS: tl.constexpr
):
    """MXFP6 weights: K tile ``T`` (0, 1) of super tile ``st`` [BLOCK_N, 128] in weight-row order, as
    ``fp4_layout.decode_fp4_words`` gives an FP4 tile (``fp6_layout``: plane-T words ``n``, plane-2 words ``p``)."""
    o0, o1, o2, o3, o4, o5, o6, o7 = decode_fp6_words(n, p, s_rows, n_mask, st, T, EBITS, BLOCK_N)
    lo = F4.mma_order(o0, o1, o2, o3, BLOCK_N)
    hi = F4.mma_order(o4, o5, o6, o7, BLOCK_N)
    return F4.to_logical_rows(tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (BLOCK_N, 128)), BLOCK_N, NUM_WARPS)
