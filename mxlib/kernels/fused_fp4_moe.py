"""Fused FP4-weight MoE for Hopper: packed e2m1 weights decoded in registers, a1 QDQ in the A load.

Formats: MXFP4 (e2m1 + E8M0 per 32) and NVFP4 (e2m1 + ue4m3 per 16, per-expert fp32 decode
``global_scale``); MXFP6 (e2m3 / e3m2 + E8M0 per 32) in ``fp6_layout``'s layout, which keeps the
properties below, through the K loop's ``W_BITS=6`` branch (256-element steps).
What differs from ``fused_dequant_moe`` (the generic MX/NVFP4/FP6 kernel):

* **Weight layout prepared once** (``prepare_fp4_weights``): the checkpoint keeps its layout
  (two codes a byte, even element in the low nibble); the kernel's layout reorders every row's
  128-element K tile so that (1) a 32-bit word holds four elements ``p`` of the half tile K ``0..63``
  and the four ``p + 64``: one word tile decodes into both half tiles; (2) the 16 bytes one thread loads are exactly the elements it holds in Hopper's
  warpgroup-MMA register operand, so after the decode a few ``reshape``/``permute`` calls (free:
  register renaming) give the dot operand, with no round trip through shared memory, and the MMA
  of one half tile overlaps the decode of the next (the approach of OpenAI's triton_kernels Hopper
  MXFP4 value layout, derived here from the PTX fragment layout). Same bytes, no extra memory.
* **Bits placed for the decode** (``FP4Weights``, ``WORD_BIT_SOURCE``): inside each 32-bit word
  the eight codes' bits sit where four rotate-and-mask steps (``shf.l.wrap`` + ``and``, one PTX
  block a word, ``tl.inline_asm_elementwise``) leave two codes a register as the bf16 bits of
  ``e2m1 * 2**-126``; one ``mul.rn.bf16x2`` a pair then applies the block scale with the
  ``2**126`` folded in (``fp4_one_multiply``: every E8M0 byte <= 128; NVFP4 vLLM ``B < 4``;
  NVFP4 hardware always, as ``ue4m3 * 2**117`` with ``2**9`` back on the accumulator), else two.
  NVFP4 vLLM mode multiplies in fp32 and rounds once, as vLLM does. Under ``TRITON_INTERPRET=1``
  the same rotations run as Triton integer ops and the values come from ``_numerics`` (the
  interpreter runs no PTX); the reshapes are the same, so the interpreter tests check the layout.
* **Scales decoded once a row**: a row's scale word (four E8M0 or ue4m3 bytes) is loaded once per
  K tile and decoded by one PTX block (ue4m3 two bytes an instruction, the hardware's exact
  e4m3 -> f16), then selected for each packed word by its constant column.
* **a1 QDQ** as one standalone pass (seed and hardware forms: ``FP4Config.A1_FUSED=False``, the
  default tiles) or in the A-tile load (per-expert NVFP4 scales, or ``A1_FUSED=True``: an A tile
  stored from registers makes Triton wait for every MMA); **a2 QDQ in GEMM1's epilogue**.
* **Block assignment**: tiny batches (``M * k * 4 <= E``, vLLM's rule) give each pair its own
  block and skip the alignment; otherwise ``moe_align_block_size_triton`` (one or two launches).
* **Tiles per batch size and per GEMM** (``FP4_CONFIGS``, ``NVFP4_CONFIGS``, ``FP6_CONFIGS``) from
  CUDA-graph replay sweeps on the H200 (``benchmarks/h200_fp4_sweep*.json``;
  ``python -m mxlib.bench fused`` times them beside the anchor harness).

Numerics modes (``mode``):

* ``"vllm"``: the bf16 operands are vLLM's, bit for bit (``mxlib.reference``): MX weights
  ``e2m1 * 2**(s - 127)`` (exact in bf16 for in-range scales), NVFP4 weights
  ``bf16(e2m1 * (fp32(ue4m3) * global_scale))`` (fp32 product, one rounding); activations
  QDQ'd to ``bf16(e2m1 * (s / gs))`` as vLLM's ``ref_nvfp4_quant_dequant``.
* ``"hardware"``: what an FP4 tensor-core GEMM computes: operands ``element * block_scale``
  (exact in bf16 for e2m1 x ue4m3 and for in-range E8M0), fp32 accumulation, the per-tensor
  scales (NVFP4 weight ``global_scale`` and activation ``1 / gs``) applied to the fp32
  accumulator. MX schemes give the same operands in both modes.

Shapes: ``M`` tokens, ``k`` top_k, ``E`` experts, ``H`` hidden, ``I`` intermediate;
``w13 [E, 2I, H]`` (gate rows then up rows), ``w2 [E, H, I]``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from . import _numerics as nm
from . import fp6_layout as F6
from . import quant as Q
from ._bridge import interpreting, select
from .fused_moe import pick_tiles
from .fused_dequant_moe import A2_FP8, A2_MX, A2_NONE, A2_NVFP4, ActivationQDQ, PackedWeights
from .moe_align_triton import moe_align_block_size_triton, naive_block_assignment

__all__ = ["FP4Weights", "FP4Config", "prepare_fp4_weights", "prepare_packed_weights", "unprepare_fp4_weights",
           "unprepare_fp4_packed", "fp4_one_multiply", "WORD_BIT_SOURCE",
           "fused_fp4_moe", "get_fp4_configs", "FP4_CONFIGS", "NVFP4_CONFIGS", "MODES"]

_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
K_TILE = 128  # the prepared layout's K tile (elements): a byte holds elements p and p + 64 (see FP4Weights)
MODES = {"vllm": 0, "hardware": 1}
# W_KIND: how a weight tile is scaled: E8M0 (exact in bf16), NVFP4 ``bf16(e2m1 * (fp32(ue4m3) * g))``
# (vLLM mode), NVFP4 ``e2m1 * ue4m3`` exact with ``g`` on the accumulator (hardware mode)
W_MX, W_NVFP4_VLLM, W_NVFP4_HW = 0, 1, 2


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
    return bool(((v * gmax) < 4).all() and (gmax < 4).all() and (g.amin() >= 2.0 ** -117))


def prepare_fp4_weights(packed: torch.Tensor, scales: torch.Tensor, block_size: int,
                        global_scale: torch.Tensor | None = None) -> FP4Weights:
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
    byte_dtypes = (torch.uint8, torch.float8_e4m3fn) if nvfp4 else (torch.uint8,) + (
        (torch.float8_e8m0fnu,) if hasattr(torch, "float8_e8m0fnu") else ())
    if scales.dtype not in byte_dtypes:
        raise ValueError(f"scales: expected the scale bytes as {' or '.join(map(str, byte_dtypes))}, got {scales.dtype}")
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


def prepare_packed_weights(w: PackedWeights) -> FP4Weights | F6.FP6Weights:
    """``prepare_fp4_weights`` of a ``PackedWeights`` (FP4 elements: ``mxfp4`` or ``nvfp4``), or
    ``fp6_layout.prepare_fp6_weights`` (MXFP6: ``mxfp6_e2m3``, ``mxfp6_e3m2``).

    Raises:
        ValueError: a scheme whose elements are neither 4 nor 6 bits wide (FP8 weights stay on
            ``fused_dequant_moe``); the prepare functions' errors (K not a multiple of the tile).
    """
    if w.nbits == 6 and not w.scheme.has_global_scale:
        return F6.prepare_fp6_weights(w.packed, w.scales, w.scheme.element, w.scheme.block_size)
    if w.nbits != 4:
        raise ValueError(f"w: the FP4 kernel takes 4- or 6-bit elements, got {w.scheme.name} ({w.nbits} bits)")
    return prepare_fp4_weights(w.packed, w.scales, w.scheme.block_size, w.global_scale)


def unprepare_fp4_weights(w: FP4Weights) -> torch.Tensor:
    """The checkpoint-layout packed bytes of ``w`` (inverse of ``prepare_fp4_weights``): what the
    other backends and checkpoint writers need when only the prepared copy is kept."""
    return unprepare_fp4_packed(w.packed)


def unprepare_fp4_packed(packed: torch.Tensor) -> torch.Tensor:
    """Prepared packed bytes ``[E, rows, K / 2]`` -> checkpoint layout (a new tensor, same shape).

    Raises:
        ValueError: not uint8 ``[E, rows, K / 2]`` with K a multiple of the K tile (128).
    """
    if packed.dtype != torch.uint8 or packed.ndim != 3 or packed.shape[2] % (K_TILE // 2):
        raise ValueError(f"packed: expected prepared uint8 [E, rows, K/2] with K a multiple of {K_TILE}, got "
                         f"{packed.dtype} {list(packed.shape)}")
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


# ----------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class FP4Config:
    """Tiles of one GEMM: BLOCK_M pairs x BLOCK_N weight rows (BLOCK_K is the layout's 128)."""

    BLOCK_M: int = 16
    BLOCK_N: int = 64
    GROUP_SIZE_M: int = 1
    num_warps: int = 4
    num_stages: int = 3
    A1_FUSED: bool = True  # GEMM1 only: QDQ a1 in the A-tile load (else one standalone pass)


# (max pairs per expert, GEMM1 config, GEMM2 config): the winners of graph-replay sweeps on the H200
# (Qwen3-30B-A3B layer, w_mxfp4 / w_mxfp4_a_mxfp4 / nvfp4 vLLM and hardware mode, torch 2.11,
# triton 3.6, 2026-11-30; benchmarks/h200_fp4_sweep_operand_layout.json, and with the rotate decode
# benchmarks/h200_decode_rotate.json, h200_fp4_sweep.json: NVFP4's heavier
# decode prefers 64-row tiles at 16 pairs an expert, 0.244 vs 0.281 ms). The a1 QDQ runs as its own pass
# (``A1_FUSED=False``): a QDQ'd A tile goes registers -> shared memory inside the K loop, which
# makes Triton wait for each MMA before the next; loaded by cp.async it stays pipelined.
FP4_CONFIGS: list[tuple[float, tuple[FP4Config, FP4Config]]] = [
    (4.0, (FP4Config(16, 64, 1, 4, 3, False), FP4Config(16, 64, 1, 4, 3))),
    (16.0, (FP4Config(32, 128, 4, 4, 3, False), FP4Config(32, 128, 4, 4, 3))),
    (64.0, (FP4Config(64, 64, 4, 4, 3, False), FP4Config(64, 64, 4, 4, 3))),
    (float("inf"), (FP4Config(128, 128, 4, 8, 3, False), FP4Config(128, 128, 4, 8, 3))),
]
NVFP4_CONFIGS: list[tuple[float, tuple[FP4Config, FP4Config]]] = [
    FP4_CONFIGS[0], (16.0, (FP4Config(32, 64, 1, 4, 3, False), FP4Config(32, 64, 1, 4, 3))), *FP4_CONFIGS[2:]]


# MXFP6 weights (``fp6_layout``, a K step of 256, so twice the A tile per stage): FP4_CONFIGS' tiles,
# not yet swept on the H200; the largest with 2 stages (3 would need 292 KiB for GEMM1 and 242 KiB for
# GEMM2 of shared memory, sm_90 has 227 KiB; 2 need 178 / 153 KiB: ``tests/compile_sm90.py`` sizes).
FP6_CONFIGS: list[tuple[float, tuple[FP4Config, FP4Config]]] = [
    (4.0, (FP4Config(16, 64, 1, 4, 3, False), FP4Config(16, 64, 1, 4, 3))),
    (16.0, (FP4Config(32, 128, 4, 4, 3, False), FP4Config(32, 128, 4, 4, 3))),
    (64.0, (FP4Config(64, 64, 4, 4, 3, False), FP4Config(64, 64, 4, 4, 3))),
    (float("inf"), (FP4Config(128, 128, 4, 8, 2, False), FP4Config(128, 128, 4, 8, 2))),
]


def get_fp4_configs(num_tokens: int, num_experts: int, top_k: int, nvfp4: bool = False,
                    weight_bits: int = 4) -> tuple[FP4Config, FP4Config]:
    """(GEMM1, GEMM2) tiles by the average number of pairs per expert (``nvfp4``: NVFP4 weights,
    ``NVFP4_CONFIGS``; ``weight_bits`` 6: ``FP6_CONFIGS``)."""
    if interpreting():
        return FP4Config(16, 32, 1, 4, 1), FP4Config(16, 32, 1, 4, 1, False)
    table = FP6_CONFIGS if weight_bits == 6 else (NVFP4_CONFIGS if nvfp4 else FP4_CONFIGS)
    return pick_tiles(table, num_tokens, num_experts, top_k)


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
_ASM_WORD_SEED_ONE = tl.constexpr(_REGS + _WORD_BITS + _TIMES_F32_SCALE + _WORD_OUT)
_ASM_WORD_SEED_TWO = tl.constexpr(_REGS + _WORD_BITS + _TIMES_2_126 + _TIMES_F32_SCALE + _WORD_OUT)

# A row's scale word (four scale bytes, $4) -> the four multipliers ($0..$3, byte 0..3), decoded once a
# row and then spread over the words they scale (``_tile_scales``). In PTX rather than Triton
# arithmetic so that the compiler keeps the whole decode in the dot operand's register layout (with
# the decode written as Triton arithmetic it judges the rematerialization too costly and
# round-trips every decoded tile through shared memory).
def _each_byte(body: str) -> str:
    """``body`` four times: ``$i`` the output, ``@8i`` the byte's bit offset, ``@i`` the byte (i = 0..3)."""
    return "".join(body.replace("$i", f"${i}").replace("@8i", str(8 * i)).replace("@i", str(i)) for i in range(4))


# E8M0 -> bf16x2 2**(b - 127) (the value twice): bits b << 7; b = 0 is 2**-127 (bf16 subnormal 0x0040), 255 NaN.
_ASM_SCALES_E8M0 = tl.constexpr("{\n.reg .b32 b, v;\n.reg .pred p0, p1;\n" + _each_byte("""bfe.u32 b, $4, @8i, 8;
shl.b32 v, b, 7;
setp.eq.u32 p0, b, 0;
setp.eq.u32 p1, b, 255;
selp.b32 v, 0x40, v, p0;
selp.b32 v, 0x7FC0, v, p1;
prmt.b32 $i, v, v, 0x1010;
""") + "}")
# E8M0 -> bf16x2 2**(b - 127) * 2**126 = 2**(b - 1) (one-multiply form: every b <= 128): bits (b + 126) << 7.
# (No guard for a byte above 128: two more instructions a byte cost the MXFP4 loop 7% of its instructions
# (435 -> 467 SASS a step); ``fp4_one_multiply`` keeps such scales on the two-multiply form.)
_ASM_SCALES_E8M0_ONE = tl.constexpr("{\n.reg .b32 b, v;\n" + _each_byte("""bfe.u32 b, $4, @8i, 8;
mad.lo.u32 v, b, 128, 16128;
prmt.b32 $i, v, v, 0x1010;
""") + "}")
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
_ASM_SCALES_E4M3 = tl.constexpr("{" + _E4M3X4_TO_F32 + _each_byte("""mul.rn.f32 f@i, f@i, 0f7A000000;
cvt.rn.bf16x2.f32 $i, f@i, f@i;
""") + "}")
# -> fp32(ue4m3) * g ($5), one fp32 rounding (vLLM's per-block multiplier B), fp32 bits
_ASM_SCALES_E4M3_G = tl.constexpr("{" + _E4M3X4_TO_F32 + """mul.rn.f32 $0, f0, $5;
mul.rn.f32 $1, f1, $5;
mul.rn.f32 $2, f2, $5;
mul.rn.f32 $3, f3, $5;
}""")
@triton.jit
def _row_scales(s_rows, n_mask, g, word, KIND: tl.constexpr, ONE: tl.constexpr):
    """The four multipliers of scale word ``word`` of every row ([BLOCK_N] each, byte 0..3).

    Compiled: int32 bits, bf16x2 (the value twice; KIND 0 MX, 2 NVFP4 hardware: ue4m3 * 2**117) or
    fp32 ``fp32(ue4m3) * g`` (KIND 1, NVFP4 seed); ``ONE`` (``fp4_one_multiply``): times 2**126.
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
            return tl.inline_asm_elementwise(_ASM_SCALES_E8M0_ONE if ONE else _ASM_SCALES_E8M0, "=r,=r,=r,=r,r",
                                             [sw], dtype=(tl.int32,) * 4, is_pure=True, pack=1)
        elif KIND == 1:
            # ONE: g arrives as g * 2**126 (exact), so the products are B * 2**126 (``fp4_one_multiply``)
            return tl.inline_asm_elementwise(_ASM_SCALES_E4M3_G, "=r,=r,=r,=r,r,f", [sw, g], dtype=(tl.int32,) * 4,
                                             is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise(_ASM_SCALES_E4M3, "=r,=r,=r,=r,r", [sw], dtype=(tl.int32,) * 4,
                                             is_pure=True, pack=1)


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
def _mma_order(t0, t1, t2, t3, BLOCK_N: tl.constexpr):
    """Four [BLOCK_N, 16] tiles (element ``t`` of word ``c * 4 + j``: K ``16j + 8(t // 2) + 2c +
    t % 2``) -> the half tile [BLOCK_N, 64] in K order. Only reshapes and permutes: in the
    prepared layout a thread's 16-byte load holds exactly the elements its part of the warpgroup
    MMA's register operand needs, so Triton lowers these to nothing."""
    x = tl.join(tl.join(t0, t1), tl.join(t2, t3))  # [n, word, e = t % 2, h = t // 2]
    x = tl.reshape(x, (BLOCK_N, 4, 4, 2, 2))  # [n, c, j, e, h]
    x = tl.permute(x, (0, 2, 4, 1, 3))  # [n, j, h, c, e]
    return tl.reshape(x, (BLOCK_N, 64))


@triton.jit
def _load_rows(BLOCK_N: tl.constexpr, NUM_WARPS: tl.constexpr):
    """The weight row each row of a loaded [BLOCK_N, 16]-word tile holds (``_to_logical_rows`` undoes it).

    Triton loads such a tile 8 rows a warp (4 lanes of 16 bytes a row), tile row
    ``r = 8 W q + 8 w + g`` (W warps, warp w, lane row g, repeat q); the warpgroup MMA wants warp w
    on rows ``16 w + 8 (q % 2) + g`` (+ ``16 W (q // 2)``). Loading row ``n(r)`` puts every row
    where the MMA needs it, so the decoded tile reaches the dot with no exchange between warps."""
    r = tl.arange(0, BLOCK_N)
    q = r // (8 * NUM_WARPS)
    w = (r // 8) % NUM_WARPS
    return 16 * NUM_WARPS * (q // 2) + 16 * w + 8 * (q % 2) + r % 8


@triton.jit
def _to_logical_rows(x, BLOCK_N: tl.constexpr, NUM_WARPS: tl.constexpr):
    """[BLOCK_N, 128] in load order (``_load_rows``) -> weight-row order (a register relabeling)."""
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
def _decode_words(w_rows, s_rows, n_mask, g, kt, KIND: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr,
                  NUM_WARPS: tl.constexpr, ONE: tl.constexpr):
    """Weight K tile ``kt`` [BLOCK_N, 128], bf16 (fp32 holding the bf16 values under the interpreter);
    ``w_rows`` point at int32 rows (16 words per K tile) in load order (``_load_rows``): a word's
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
                _ASM_WORD_SEED_ONE if ONE else _ASM_WORD_SEED_TWO, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r",
                [wd, s_lo, s_hi], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
        else:  # NVFP4 hardware mode: always one multiply (ue4m3 * 2**117)
            o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
                _ASM_WORD_ONE if (ONE or KIND == 2) else _ASM_WORD_TWO, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r",
                [wd, s_lo, s_hi], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
    lo = _mma_order(o0, o1, o2, o3, BLOCK_N)
    hi = _mma_order(o4, o5, o6, o7, BLOCK_N)
    return _to_logical_rows(tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (BLOCK_N, 128)), BLOCK_N, NUM_WARPS)


# ----------------------------------------------------------------------------- activations


@triton.jit
def _nvfp4_qdq_hw(x, gs, BS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """NVFP4 QDQ in hardware form: ``e2m1 * s`` (exact in bf16), the ``1 / gs`` left to the caller.
    Block scale and e2m1 codes are vLLM's (``nm.nvfp4_qdq_values``)."""
    xb = tl.reshape(x, (BLOCK_R, BLOCK_K // BS, BS))
    abits = tl.max(xb.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=2)
    has_nan = abits > 0x7F800000
    amax = tl.where(has_nan, 0.0, abits.to(tl.float32, bitcast=True))
    s, q = nm.nvfp4_scale_and_multiplier(amax, gs, False)
    e = nm.round_e2m1_signed_like_vllm(tl.minimum(tl.maximum(xb * q[:, :, None], -6.0), 6.0))
    dq = e * s[:, :, None]
    dq = tl.where(has_nan[:, :, None], nm.fp32_nan_like(dq), dq)
    return tl.reshape(dq, (BLOCK_R, BLOCK_K))


@triton.jit
def _act_qdq(x, scale, KIND: tl.constexpr, MODE: tl.constexpr, EBITS: tl.constexpr, MBITS: tl.constexpr,
             EMAX: tl.constexpr, MAX: tl.constexpr, SCALE_MODE: tl.constexpr, BS: tl.constexpr,
             BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """QDQ of an fp32 tile [BLOCK_R, BLOCK_K] (blocks along the last axis): KIND 0 none, 1 MX,
    2 NVFP4 (``scale`` the encode scale gs; MODE 1 leaves out the ``1 / gs``), 3 FP8 per tensor."""
    if KIND == 1:
        return nm.mx_qdq_values(x, EBITS, MBITS, EMAX, MAX, SCALE_MODE, BS, BLOCK_R, BLOCK_K)
    elif KIND == 2:
        if MODE == 1:
            return _nvfp4_qdq_hw(x, scale, BS, BLOCK_R, BLOCK_K)
        return nm.nvfp4_qdq_values(x, scale, False, BS, BLOCK_R, BLOCK_K)
    elif KIND == 3:
        return nm.fp8_qdq_values(x, scale)
    else:
        return x


@triton.jit
def _a_tile(a_rows, token_mask, col0, a_scale, A_KIND: tl.constexpr, MODE: tl.constexpr, A_EBITS: tl.constexpr,
            A_MBITS: tl.constexpr, A_EMAX: tl.constexpr, A_MAX: tl.constexpr, A_SCALE_MODE: tl.constexpr,
            A_BS: tl.constexpr, BLOCK_M: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Activation K tile, columns ``col0 .. col0+127``, QDQ'd, transposed: [128, BLOCK_M]."""
    cols = col0 + tl.arange(0, 128)
    a = tl.load(a_rows[:, None] + cols[None, :], mask=token_mask[:, None], other=0.0)
    if A_KIND != 0:
        a = nm.cast_out(_act_qdq(nm.to_fp32(a), a_scale, A_KIND, MODE, A_EBITS, A_MBITS, A_EMAX, A_MAX,
                                 A_SCALE_MODE, A_BS, BLOCK_M, 128), DOT_DTYPE)
    if nm.INTERPRETING:
        a = nm.to_fp32(a)
    return tl.trans(a)


@triton.jit
def _fp6_tile(n, p, s_rows, n_mask, st, T: tl.constexpr, EBITS: tl.constexpr, BLOCK_N: tl.constexpr,
              NUM_WARPS: tl.constexpr):
    """MXFP6 weights: K tile ``T`` (0, 1) of super tile ``st`` [BLOCK_N, 128] in weight-row order, as
    ``_decode_words`` gives an FP4 tile (``fp6_layout``: plane-T words ``n``, plane-2 words ``p``)."""
    o0, o1, o2, o3, o4, o5, o6, o7 = F6.decode_fp6_words(n, p, s_rows, n_mask, st, T, EBITS, BLOCK_N)
    lo = _mma_order(o0, o1, o2, o3, BLOCK_N)
    hi = _mma_order(o4, o5, o6, o7, BLOCK_N)
    return _to_logical_rows(tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (BLOCK_N, 128)), BLOCK_N, NUM_WARPS)


# ----------------------------------------------------------------------------- kernel


@triton.jit
def fused_fp4_moe_kernel(
    # pointers
    a_ptr, w_ptr, ws_ptr, wg_ptr, c_ptr, topk_weights_ptr, sorted_token_ids_ptr, expert_ids_ptr,
    num_tokens_post_padded_ptr, a_scale_ptr, c_scale_ptr,
    # dimensions
    N, K, EM, num_valid_tokens,
    # strides (elements; packed weights and scales in bytes)
    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_cm, wg_stride_e, wg_stride_half,
    a_scale_stride_e, c_scale_stride_e,
    # weight format: KIND 0 MX, 1 NVFP4 seed, 2 NVFP4 hardware; BS 32 or 16; ONE the one-multiply decode
    # (``fp4_one_multiply``); BITS 4 (FP4 layout) or 6 (MXFP6 in ``fp6_layout``'s layout, element exponent bits EBITS)
    W_KIND: tl.constexpr, W_BS: tl.constexpr, MODE: tl.constexpr, W_ONE: tl.constexpr, W_BITS: tl.constexpr,
    W_EBITS: tl.constexpr,
    # A-load QDQ (a1 in GEMM1, none in GEMM2)
    A_KIND: tl.constexpr, A_EBITS: tl.constexpr, A_MBITS: tl.constexpr, A_EMAX: tl.constexpr, A_MAX: tl.constexpr,
    A_SCALE_MODE: tl.constexpr, A_BS: tl.constexpr,
    # epilogue (a2 in GEMM1)
    GATED: tl.constexpr, C_KIND: tl.constexpr, C_EBITS: tl.constexpr, C_MBITS: tl.constexpr,
    C_EMAX: tl.constexpr, C_MAX: tl.constexpr, C_SCALE_MODE: tl.constexpr, C_BS: tl.constexpr,
    W_GLOBAL_OUT: tl.constexpr, A_INV_OUT: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, top_k: tl.constexpr, NAIVE: tl.constexpr,
    # tiles
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_SIZE_M: tl.constexpr, OUT_DTYPE: tl.constexpr,
    NUM_WARPS: tl.constexpr,
):
    """C[pair, n] for one block of pairs and BLOCK_N output columns.

    A: [rows, K] (row ``pair // top_k``); W: prepared FP4 [E, rows_w, K / 2], scales
    [E, rows_w, K / W_BS] (W_BITS 6: prepared MXFP6 [E, rows_w, 3K / 4], ``fp6_layout``);
    GATED: rows_w = 2N (gate, up), C = a2 [M * k, N] (SiLU-and-mul, then
    the C_KIND QDQ); else rows_w = N, C = A @ W[e]^T (x router weight). NAIVE: block ``pid_m`` is
    the single pair ``pid_m`` (no alignment; ``expert_ids_ptr`` is the flat topk_ids).
    Hardware mode: A_INV_OUT multiplies the fp32 accumulator by ``1 / a_scale`` (NVFP4 activation
    encode scale), W_GLOBAL_OUT by the weight's global scale, before the epilogue.
    """
    pid_m, pid_n = nm.grouped_pid(tl.program_id(axis=0), EM, N, BLOCK_M, BLOCK_N, GROUP_SIZE_M)
    if NAIVE:
        rows_m = tl.arange(0, BLOCK_M)
        offs_token = tl.where(rows_m == 0, pid_m, num_valid_tokens).to(tl.int64)
        expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    else:
        if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
            return
        offs_token = tl.load(sorted_token_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    token_mask = offs_token < num_valid_tokens
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    load_n = pid_n * BLOCK_N + _load_rows(BLOCK_N, NUM_WARPS)  # weight rows in load order
    n_mask = load_n < N
    w_rows = w_ptr + expert * stride_we + load_n.to(tl.int64) * stride_wn
    s_rows = ws_ptr + expert * stride_se + load_n.to(tl.int64) * stride_sn
    if W_KIND != 0:
        g = tl.load(wg_ptr + expert * wg_stride_e)
        g_up = tl.load(wg_ptr + expert * wg_stride_e + wg_stride_half)
        if W_KIND == 1 and W_ONE and not nm.INTERPRETING:  # vLLM's one-multiply decode: g * 2**126 (exact)
            # (a g outside [2**-117, 4), a stale ``one_multiply``, gives NaN or Inf weights, never plausible ones)
            g = tl.where(g >= 2.0 ** -117, g * 8.507059173023462e37, float("nan"))
            g_up = tl.where(g_up >= 2.0 ** -117, g_up * 8.507059173023462e37, float("nan"))
    else:
        g = 1.0
        g_up = 1.0
    if A_KIND != 0 or A_INV_OUT:
        a_scale = tl.load(a_scale_ptr + expert * a_scale_stride_e)
    else:
        a_scale = 1.0
    a_rows = a_ptr + (offs_token // top_k) * stride_am
    DOT_DTYPE: tl.constexpr = OUT_DTYPE

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if W_BITS == 6:  # MXFP6: 256-element super tiles, two K tiles (two dots per matrix) a step
        for st in range(0, K // 256):
            a0 = _a_tile(a_rows, token_mask, st * 256, a_scale, A_KIND, MODE, A_EBITS, A_MBITS, A_EMAX, A_MAX,
                         A_SCALE_MODE, A_BS, BLOCK_M, DOT_DTYPE)
            a1 = _a_tile(a_rows, token_mask, st * 256 + 128, a_scale, A_KIND, MODE, A_EBITS, A_MBITS, A_EMAX,
                         A_MAX, A_SCALE_MODE, A_BS, BLOCK_M, DOT_DTYPE)
            n0, n1, p = F6.load_fp6_planes(w_rows, n_mask, st)
            acc = tl.dot(_fp6_tile(n0, p, s_rows, n_mask, st, 0, W_EBITS, BLOCK_N, NUM_WARPS), a0, acc)
            acc = tl.dot(_fp6_tile(n1, p, s_rows, n_mask, st, 1, W_EBITS, BLOCK_N, NUM_WARPS), a1, acc)
            if GATED:
                u0, u1, pu = F6.load_fp6_planes(w_rows + N * stride_wn, n_mask, st)
                su_rows = s_rows + N * stride_sn
                acc_up = tl.dot(_fp6_tile(u0, pu, su_rows, n_mask, st, 0, W_EBITS, BLOCK_N, NUM_WARPS), a0, acc_up)
                acc_up = tl.dot(_fp6_tile(u1, pu, su_rows, n_mask, st, 1, W_EBITS, BLOCK_N, NUM_WARPS), a1, acc_up)
    for kt in range(0, K // 128 if W_BITS == 4 else 0):  # FP4: 128-element K tiles (FP6 ran above)
        a = _a_tile(a_rows, token_mask, kt * 128, a_scale, A_KIND, MODE, A_EBITS, A_MBITS, A_EMAX, A_MAX,
                    A_SCALE_MODE, A_BS, BLOCK_M, DOT_DTYPE)
        acc = tl.dot(_decode_words(w_rows, s_rows, n_mask, g, kt, W_KIND, W_BS, BLOCK_N, NUM_WARPS, W_ONE), a, acc)
        if GATED:
            acc_up = tl.dot(_decode_words(w_rows + N * stride_wn, s_rows + N * stride_sn, n_mask, g_up, kt, W_KIND,
                                          W_BS, BLOCK_N, NUM_WARPS, W_ONE), a, acc_up)

    if A_INV_OUT:
        inv_a = tl.math.div_rn(a_scale * 0.0 + 1.0, a_scale)
        acc = acc * inv_a
        acc_up = acc_up * inv_a
    if W_GLOBAL_OUT:  # the operands were e2m1 * ue4m3 / 2**9 (exact): 2**9 back, then the global scale
        acc = acc * 512.0 * g
        acc_up = acc_up * 512.0 * g_up
    if GATED:
        gate = nm.to_fp32(nm.cast_out(tl.trans(acc), OUT_DTYPE))  # [BLOCK_M, BLOCK_N]
        up = nm.to_fp32(nm.cast_out(tl.trans(acc_up), OUT_DTYPE))
        act = nm.to_fp32(nm.cast_out(gate / (1.0 + tl.exp(-gate)) * up, OUT_DTYPE))
        if C_KIND != 0:
            c_scale = tl.load(c_scale_ptr + expert * c_scale_stride_e)
        else:
            c_scale = 1.0
        act = _act_qdq(act, c_scale, C_KIND, MODE, C_EBITS, C_MBITS, C_EMAX, C_MAX, C_SCALE_MODE, C_BS,
                       BLOCK_M, BLOCK_N)
        out = nm.cast_out(act, OUT_DTYPE)
    else:
        res = tl.trans(acc)
        if MUL_ROUTED_WEIGHT:
            res = res * tl.load(topk_weights_ptr + offs_token, mask=token_mask, other=0)[:, None]
        out = nm.cast_out(res, OUT_DTYPE)
    c_ptrs = c_ptr + offs_token[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, out, mask=token_mask[:, None] & n_mask[None, :])


@triton.jit
def _sum_k_kernel(x_ptr, out_ptr, H, top_k: tl.constexpr, BLOCK: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """out[t, :] = sum_j x[t * k + j, :] in fp32 (j ascending), one rounding."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < H
    acc = tl.zeros((BLOCK,), tl.float32)
    for j in range(top_k):
        acc += nm.to_fp32(tl.load(x_ptr + (t * top_k + j) * H + cols, mask=m, other=0.0))
    tl.store(out_ptr + t * H + cols, nm.cast_out(acc, OUT_DTYPE), mask=m)


# ----------------------------------------------------------------------------- wrapper


def _qdq_consts(q: ActivationQDQ | None, prefix: str) -> dict:
    """The ``{prefix}_KIND, _EBITS, ...`` constexprs of an activation QDQ (``ActivationQDQ.kernel_args``)."""
    return (q or ActivationQDQ()).kernel_args(prefix + "_")


def _scale_arg(q: ActivationQDQ | None, e: int, dummy: torch.Tensor) -> tuple[torch.Tensor, int]:
    if q is None or q.scale is None:
        return dummy, 0
    s = q.scale.float().reshape(-1)
    return s, (1 if (q.kind == A2_NVFP4 and s.numel() == e) else 0)


def _launch(a, w: FP4Weights | F6.FP6Weights, c, topk_weights, sorted_ids, expert_ids, num_post, n, gated, a_qdq,
            a_inv, c_qdq, mode, mul_routed_weight, top_k, naive, cfg: FP4Config):
    """a_qdq: QDQ in the A load (or None); a_inv: NVFP4 activation encode scales whose reciprocal
    multiplies the accumulator (hardware mode), or None."""
    e = w.packed.shape[0]
    # pointer arguments the kernel does not read (no scale of that kind): any fp32 tensor, no new
    # allocation (a fill kernel per launch otherwise)
    unread = topk_weights
    if w.global_scale is not None:
        gsc = w.global_scale
        wg_stride_e, wg_stride_half = (2, 1) if gsc.ndim == 2 else (1, 0)
    else:
        gsc, wg_stride_e, wg_stride_half = unread, 0, 0
    scale_src = a_qdq if a_qdq is not None else a_inv
    a_scale, a_stride = _scale_arg(scale_src, e, unread)
    c_scale, c_stride = _scale_arg(c_qdq, e, unread)
    w_kind = W_MX if not w.nvfp4 else (W_NVFP4_VLLM if mode == MODES["vllm"] else W_NVFP4_HW)
    fp6 = isinstance(w, F6.FP6Weights)
    wp = w.packed.view(torch.int32)  # rows of K/8 words (K/2 bytes; FP6: 3K/16 words)
    ws = w.scales.view(torch.int32)  # K/BS bytes a row: a multiple of 4
    em = sorted_ids.shape[0]
    # the row order of the weight loads (``_load_rows``) needs 16 rows a warp
    num_warps = max(1, min(cfg.num_warps, cfg.BLOCK_N // 16))
    grid = (triton.cdiv(em, cfg.BLOCK_M) * triton.cdiv(n, cfg.BLOCK_N),)
    fused_fp4_moe_kernel[grid](
        a, wp, ws, gsc, c, topk_weights, sorted_ids, expert_ids, num_post, a_scale, c_scale,
        n, w.k, em, c.shape[0],
        a.stride(0), wp.stride(0), wp.stride(1), ws.stride(0), ws.stride(1), c.stride(0),
        wg_stride_e, wg_stride_half, a_stride, c_stride,
        W_KIND=w_kind, W_BS=w.block_size, MODE=mode, W_ONE=getattr(w, "one_multiply", False),
        W_BITS=6 if fp6 else 4, W_EBITS=w.element.ebits if fp6 else 2,
        **select(fused_fp4_moe_kernel, {**_qdq_consts(a_qdq, "A"), **_qdq_consts(c_qdq, "C")}), GATED=gated,
        W_GLOBAL_OUT=w_kind == W_NVFP4_HW, A_INV_OUT=a_inv is not None, MUL_ROUTED_WEIGHT=mul_routed_weight,
        top_k=top_k,
        NAIVE=naive, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, GROUP_SIZE_M=cfg.GROUP_SIZE_M,
        OUT_DTYPE=_TL_DTYPE[c.dtype], NUM_WARPS=num_warps,
        num_warps=num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False,
    )


@triton.jit
def _nvfp4_hw_qdq_kernel(x_ptr, out_ptr, gs_ptr, H, BLOCK_K: tl.constexpr):
    """NVFP4 QDQ of ``BLOCK_K`` columns of one row in hardware form: ``e2m1 * s`` (exact in bf16), the
    ``1 / gs`` left to GEMM1's accumulator; the bits of the A-tile load's QDQ (``_nvfp4_qdq_hw``)."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    x = nm.to_fp32(tl.load(x_ptr + r * H + cols))
    q = _nvfp4_qdq_hw(tl.reshape(x, (1, BLOCK_K)), tl.load(gs_ptr), 16, 1, BLOCK_K)
    tl.store(out_ptr + r * H + cols, nm.cast_out(tl.reshape(q, (BLOCK_K,)), tl.bfloat16))


def _standalone_a1_qdq(x: torch.Tensor, q: ActivationQDQ, mode: int) -> torch.Tensor:
    """a1 QDQ by the standalone kernels (one pass over ``[M, H]``), the same bits as the fused load
    (hardware-mode NVFP4: ``e2m1 * s``, the ``1 / gs`` still to apply)."""
    if q.kind == A2_NVFP4 and mode == MODES["hardware"]:
        m, h = x.shape
        out = torch.empty_like(x)
        block = 512 if h % 512 == 0 else K_TILE  # H is a multiple of the K tile
        if m:
            _nvfp4_hw_qdq_kernel[(m, h // block)](x, out, q.scale.reshape(-1)[:1].float(), h, BLOCK_K=block)
        return out
    if q.kind == A2_MX:
        return Q.quant_dequant_mx(x, q.fmt.element.name, q.fmt.block_size, q.scale_mode)
    if q.kind == A2_NVFP4:
        return Q.ref_nvfp4_quant_dequant(x, q.scale.reshape(-1)[:1].float(), check_scale=False)
    if q.kind == A2_FP8:
        return Q.quant_dequant_fp8_per_tensor(x, q.scale, check_scale=False)
    return x


def fused_fp4_moe(
    hidden_states: torch.Tensor,
    w13: FP4Weights,
    w2: FP4Weights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    a1_qdq: ActivationQDQ | None = None,
    a2_qdq: ActivationQDQ | None = None,
    mode: str = "vllm",
    configs: tuple[FP4Config, FP4Config] | None = None,
) -> torch.Tensor:
    """The whole MoE expert computation on prepared FP4 weights, activation QDQ fused.

    Args:
        hidden_states: ``[M, H]`` bf16, NOT yet quantized (a1's QDQ happens here).
        w13: ``prepare_fp4_weights`` of ``[E, 2I, H/2]`` (gate rows, then up rows);
            w2: of ``[E, H, I/2]``. Both MXFP4 or both NVFP4.
        topk_weights: ``[M, k]`` router weights (fp32); topk_ids: ``[M, k]`` int expert ids.
        a1_qdq, a2_qdq: the activation QDQs (``ActivationQDQ(fmt, scale_mode, scale)``: an OCP MX
            block scheme; NVFP4 with ``scale`` the encode global scale gs, ``[1]`` or per expert
            ``[E]``; per-tensor FP8 with ``scale`` the decode scale ``[1]``); None (or
            ``ActivationQDQ()``) for weight-only schemes.
        mode: ``"vllm"`` (bf16 operands bit-identical to vLLM's dequant and QDQ) or
            ``"hardware"`` (exact ``element * block_scale`` operands, per-tensor scales on the
            fp32 accumulator); see the module docstring.
        configs: (GEMM1, GEMM2) tiles; None picks from ``FP4_CONFIGS`` by batch size.

    Returns:
        ``[M, H]`` in ``hidden_states.dtype``. No host synchronization; capturable in a CUDA graph.

    Raises:
        ValueError: unknown mode, mismatched shapes or formats (experts, H, I, element format).
        TypeError: ``hidden_states`` not bf16, weights not prepared, ``topk_ids`` not integer.

    ``topk_ids`` values must lie in ``[0, E)``: reading them would synchronize, so they are not
    checked here (the experts classes check them before calling, ``check_topk_ids``).
    """
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {sorted(MODES)}, got {mode!r}")
    md = MODES[mode]
    for name, w in (("w13", w13), ("w2", w2)):
        if not isinstance(w, (FP4Weights, F6.FP6Weights)):
            raise TypeError(f"{name}: expected FP4Weights or FP6Weights (prepare_packed_weights), got {type(w).__name__}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise TypeError(f"topk_ids: expected an integer tensor (int32 or int64), got {topk_ids.dtype}")
    if hidden_states.ndim != 2 or hidden_states.shape[1] != w13.k:
        raise ValueError(f"hidden_states: expected [M, {w13.k}], got {list(hidden_states.shape)}")
    if hidden_states.dtype != torch.bfloat16:
        raise TypeError(f"hidden_states: expected dtype torch.bfloat16 (the decode emits bf16), got {hidden_states.dtype}")
    if w13.nvfp4 != w2.nvfp4:
        raise ValueError("w13 and w2 must both be NVFP4 or both MXFP4")
    el13, el2 = getattr(w13, "element", None), getattr(w2, "element", None)  # FP6Weights: e2m3 or e3m2
    if el13 != el2:
        raise ValueError(f"w13 and w2 must have one element format, got {el13 or 'e2m1'} and {el2 or 'e2m1'}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != hidden_states.shape[0]:
        raise ValueError(f"topk_ids {list(topk_ids.shape)} and topk_weights {list(topk_weights.shape)} must be [M, k]")
    m, k = topk_ids.shape
    e, two_i = w13.packed.shape[:2]
    h = w2.packed.shape[1]
    i = two_i // 2
    if w2.k != i:
        raise ValueError(f"w2: expected K = I = {i}, got {w2.k}")
    if w2.packed.shape[0] != e or h != hidden_states.shape[1]:
        raise ValueError(f"w2: expected [E={e}, H={hidden_states.shape[1]}, ...] as w13 and hidden_states, got "
                         f"{list(w2.packed.shape)}")
    hidden_states = hidden_states.contiguous()  # the kernels read rows with a unit column stride
    c1, c2 = configs or get_fp4_configs(m, e, k, w13.nvfp4, 6 if isinstance(w13, F6.FP6Weights) else 4)
    naive = naive_block_assignment(m, k, e)
    dev = hidden_states.device
    weights = topk_weights.reshape(-1).float().contiguous()
    a1 = hidden_states
    a1q = a1_qdq if (a1_qdq is not None and a1_qdq.kind != A2_NONE) else None
    a1_per_expert = a1q is not None and a1q.kind == A2_NVFP4 and a1q.scale is not None and a1q.scale.numel() > 1
    # hardware mode: GEMM1's A holds e2m1 * s (NVFP4); its 1 / gs goes on the accumulator
    a1_inv = a1q if (md == 1 and a1q is not None and a1q.kind == A2_NVFP4) else None
    if a1q is not None and not c1.A1_FUSED and not a1_per_expert:
        a1 = _standalone_a1_qdq(hidden_states, a1q, md)
        a1q = None
    if naive:  # each pair its own block of 16 rows (row 0 live): no alignment
        c1 = replace(c1, BLOCK_M=16, GROUP_SIZE_M=1)
        c2 = replace(c2, BLOCK_M=16, GROUP_SIZE_M=1)
        eid1 = eid2 = topk_ids.reshape(-1)
        sorted1 = sorted2 = torch.empty(m * k * 16, dtype=torch.int32, device=dev)  # sets the grid only
        post1 = post2 = sorted1
    else:
        sorted1, eid1, post1 = moe_align_block_size_triton(topk_ids, c1.BLOCK_M, e)
        if c2.BLOCK_M == c1.BLOCK_M:
            sorted2, eid2, post2 = sorted1, eid1, post1
        else:
            sorted2, eid2, post2 = moe_align_block_size_triton(topk_ids, c2.BLOCK_M, e)
    a2 = torch.empty(m * k, i, dtype=hidden_states.dtype, device=dev)
    _launch(a1, w13, a2, weights, sorted1, eid1, post1, i, True, a1q, a1_inv, a2_qdq, md, False, k, naive, c1)
    out_pairs = torch.empty(m * k, h, dtype=hidden_states.dtype, device=dev)
    # hardware mode: a2 holds e2m1 * s; its 1 / gs goes on GEMM2's accumulator
    a2_inv = a2_qdq if (md == 1 and a2_qdq is not None and a2_qdq.kind == A2_NVFP4) else None
    _launch(a2, w2, out_pairs, weights, sorted2, eid2, post2, h, False, None, a2_inv, None, md, True, 1, naive, c2)
    out = torch.empty(m, h, dtype=hidden_states.dtype, device=dev)
    block = 1024
    _sum_k_kernel[(m, triton.cdiv(h, block))](out_pairs, out, h, top_k=k, BLOCK=block,
                                              OUT_DTYPE=_TL_DTYPE[hidden_states.dtype])
    return out
