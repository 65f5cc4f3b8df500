"""Block Hadamard rotation along the last dimension: the PyTorch arithmetic and its Triton twin.

A block Hadamard rotation of size ``b`` (a power of two) multiplies each run of ``b`` consecutive
elements of the last dimension by the orthonormal matrix ``Q = D H_b / sqrt(b)``: ``D`` a diagonal of
±1 signs (optional, the randomized Hadamard transform), ``H_b`` Sylvester's Hadamard matrix
(``H_1 = [1]``, ``H_2n = [[H_n, H_n], [H_n, -H_n]]``). In row form ``y = (x * signs) @ H_b / sqrt(b)``
block by block. ``Q`` is orthogonal, so rotating both operands of a dot product along its K axis
leaves it unchanged: ``(w Q) . (x Q) = w . x``; this is how a rotated checkpoint's weights and its
online-rotated activations meet (QuaRot, FP-Quant / QuTLASS's block Hadamard sized to the
quantization group: 16 for NVFP4, 32 for OCP MX).

The arithmetic (one definition; ``ref_block_hadamard`` and ``block_hadamard`` give the same bits):

* the input is widened to fp32 (float64 stays float64 in the reference), multiplied by the signs
  (exact), then transformed by ``log2(b)`` constant-geometry butterfly stages: each stage views a
  block as ``[2, b/2]`` halves ``u, v`` and writes ``(u + v, u - v)`` interleaved (element ``2j`` is
  ``u[j] + v[j]``, ``2j + 1`` is ``u[j] - v[j]``). After ``log2(b)`` stages the block is ``x @ H_b``
  in Sylvester's order; every output is the same fixed tree of fp32 additions in both twins.
* the result is multiplied by ``fp32(1 / sqrt(b))`` (exact for ``b`` a power of four) and rounded
  once to the output dtype (the input's, or ``out_dtype``).

The transform is its own inverse without signs (``H_b H_b = b I``); with signs the inverse is the
unsigned transform followed by the signs. ``BlockHadamard`` is the run-time rotation an experts
object carries: its block size and the sign vectors of the hidden (``H``) and intermediate (``I``) axes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import _numerics as nm
from ._bridge import TL_DTYPE
from ._triton import tl, triton

__all__ = ["BlockHadamard", "block_hadamard", "ref_block_hadamard", "hadamard_scale", "check_rotation_block"]


def check_rotation_block(block_size, k: int, name: str = "x: last dimension") -> None:
    """Raise unless ``block_size`` is a power of two >= 2 dividing ``k`` (``name`` says what ``k`` is).

    Raises:
        ValueError: naming ``block_size``, the expected and the found value.
    """
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 2:
        raise ValueError(f"block_size: expected a power of two >= 2, got {block_size!r}")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size: expected a power of two, got {block_size}")
    if k % block_size:
        raise ValueError(f"{name} {k} is not a multiple of block_size={block_size}")


def hadamard_scale(block_size: int) -> float:
    """``fp32(1 / sqrt(block_size))`` as a Python float (the normalization both twins multiply by)."""
    return float(torch.tensor(1.0 / math.sqrt(block_size), dtype=torch.float32))


def _check_signs(signs, k: int, device) -> None:
    if signs is None:
        return
    if not isinstance(signs, torch.Tensor) or signs.shape != (k,) or signs.dtype != torch.float32:
        got = f"{tuple(signs.shape)} {signs.dtype}" if isinstance(signs, torch.Tensor) else type(signs).__name__
        raise ValueError(f"signs: expected a float32 tensor of shape ({k},) holding +1 / -1, got {got}")
    if signs.device != torch.device(device):
        raise ValueError(f"signs: on {signs.device}, the input is on {device}")


def ref_block_hadamard(x: torch.Tensor, block_size: int, signs: torch.Tensor | None = None, out_dtype=None):
    """Block Hadamard rotation of ``x [..., K]`` along its last dimension (module docstring), pure PyTorch.

    Args:
        x: ``[..., K]`` floating tensor, ``K`` a multiple of ``block_size``.
        block_size: ``b``, a power of two >= 2.
        signs: float32 ``[K]`` of ±1 multiplying ``x`` before the transform, or None.
        out_dtype: the result's dtype (default ``x.dtype``).

    Returns:
        ``[..., K]``: ``bf16/fp16/fp32(fp32((x * signs) @ H_b) * fp32(1/sqrt(b)))`` block by block
        (float64 arithmetic for a float64 ``x``).

    Raises:
        ValueError: a block size that is not a power of two dividing ``K``; signs of another shape,
            dtype or device.
        TypeError: a non-floating ``x``.
    """
    if not x.dtype.is_floating_point:
        raise TypeError(f"x: expected a floating tensor, got {x.dtype}")
    k = x.shape[-1]
    check_rotation_block(block_size, k)
    _check_signs(signs, k, x.device)
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = x.to(work)
    if signs is not None:
        y = y * signs.to(work)
    lead = y.shape[:-1]
    y = y.reshape(-1, k // block_size, block_size)
    for _ in range(int(math.log2(block_size))):
        u, v = y.view(*y.shape[:-1], 2, block_size // 2).unbind(-2)
        y = torch.stack((u + v, u - v), dim=-1).view(*u.shape[:-1], block_size)
    scale = hadamard_scale(block_size) if work == torch.float32 else 1.0 / math.sqrt(block_size)
    y = y * torch.tensor(scale, dtype=work, device=x.device)
    return y.reshape(*lead, k).to(out_dtype or x.dtype)


@triton.jit
def fwht_tile(x, BS: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """``x [ROWS, COLS]`` fp32 times Sylvester's ``H_BS`` (unnormalized) on each run of ``BS`` columns:
    the constant-geometry butterfly stages of the module docstring, in registers."""
    n: tl.constexpr = ROWS * COLS // BS
    y = tl.reshape(x, (n, BS))
    for s in tl.static_range(16):
        if (1 << s) < BS:
            halves = tl.permute(tl.reshape(y, (n, 2, BS // 2)), (0, 2, 1))  # [n, BS/2, (u, v)]
            u, v = tl.split(halves)
            y = tl.reshape(tl.join(u + v, u - v), (n, BS))
    return tl.reshape(y, (ROWS, COLS))


@triton.jit
def rotate_tile(
    x,
    signs_ptr,
    cols,
    col_mask,
    scale,
    BS: tl.constexpr,
    HAS_SIGNS: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    """The block Hadamard rotation of an fp32 tile ``x [ROWS, COLS]`` whose columns are ``cols`` (a
    multiple of ``BS`` wide, starting on a block edge): signs, butterflies, ``* scale``; fp32 out."""
    if HAS_SIGNS:
        x = x * tl.load(signs_ptr + cols, mask=col_mask, other=1.0)[None, :]
    return fwht_tile(x, BS, ROWS, COLS) * scale


@triton.jit
def _block_hadamard_kernel(
    x_ptr,
    out_ptr,
    signs_ptr,
    R,
    K,
    stride_x,
    stride_out,
    scale,
    BS: tl.constexpr,
    HAS_SIGNS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
):
    """One ``[BLOCK_R, BLOCK_K]`` tile of ``x [R, K]`` rotated (``BLOCK_K`` a multiple of ``BS``)."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    cmask = cols < K
    mask = (rows < R)[:, None] & cmask[None, :]
    x = nm.to_fp32(tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0))
    y = rotate_tile(x, signs_ptr, cols, cmask, scale, BS, HAS_SIGNS, BLOCK_R, BLOCK_K)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], nm.cast_out(y, OUT_DTYPE), mask=mask)


def block_hadamard(x: torch.Tensor, block_size: int, signs: torch.Tensor | None = None, out_dtype=None):
    """Triton twin of ``ref_block_hadamard``: the same arguments, the same bits (bf16, fp16, fp32 ``x``).

    One pass over ``x`` (read once, written once); no host synchronization (capturable in a CUDA graph).

    Raises:
        ValueError, TypeError: as ``ref_block_hadamard``; also a float64 ``x`` (the reference only).
    """
    if x.dtype not in TL_DTYPE:
        raise TypeError(f"x: expected bfloat16, float16 or float32, got {x.dtype}")
    k = x.shape[-1]
    check_rotation_block(block_size, k)
    _check_signs(signs, k, x.device)
    out_dtype = out_dtype or x.dtype
    if out_dtype not in TL_DTYPE:
        raise TypeError(f"out_dtype: expected bfloat16, float16 or float32, got {out_dtype}")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    r = x2.shape[0]
    out = torch.empty((r, k), dtype=out_dtype, device=x.device)
    if r:
        block_k = max(block_size, min(256, triton.next_power_of_2(k)))
        block_r = max(1, 2048 // block_k)
        grid = (triton.cdiv(r, block_r), triton.cdiv(k, block_k))
        _block_hadamard_kernel[grid](
            x2,
            out,
            out if signs is None else signs,
            r,
            k,
            x2.stride(0),
            out.stride(0),
            hadamard_scale(block_size),
            BS=block_size,
            HAS_SIGNS=signs is not None,
            BLOCK_R=block_r,
            BLOCK_K=block_k,
            OUT_DTYPE=TL_DTYPE[out_dtype],
            enable_fp_fusion=False,
        )
    return out.view(*x.shape[:-1], k)


@dataclass(frozen=True, eq=False)
class BlockHadamard:
    """The online rotation of a rotated checkpoint's activations (what its experts carry).

    Attributes:
        block_size: ``b``, a power of two dividing both ``H`` and ``I``.
        signs_h: float32 ``[H]`` ±1 signs of the hidden axis (a1, w13's K), or None (no signs).
        signs_i: float32 ``[I]`` ±1 signs of the intermediate axis (a2, w2's K), or None.

    ``rotate_h(x, triton)`` / ``rotate_i(x, triton)``: ``x [..., H]`` / ``[..., I]`` rotated
    (``block_hadamard`` with ``triton``, else ``ref_block_hadamard``; the same bits).
    """

    block_size: int
    signs_h: torch.Tensor | None = None
    signs_i: torch.Tensor | None = None

    def check(self, hidden_size: int, intermediate_size: int, values: bool = True) -> None:
        """Raise unless the block size divides both sizes and the signs have their lengths (and, with
        ``values``, hold ±1 only: a read of the signs, a host synchronization for CUDA tensors).

        Raises:
            ValueError: naming ``block_size``, ``signs_h`` or ``signs_i``, the expected and the found value.
        """
        check_rotation_block(self.block_size, hidden_size, "hidden_size")
        check_rotation_block(self.block_size, intermediate_size, "intermediate_size")
        for name, s, n in (("signs_h", self.signs_h, hidden_size), ("signs_i", self.signs_i, intermediate_size)):
            if s is not None and (not isinstance(s, torch.Tensor) or s.shape != (n,) or s.dtype != torch.float32):
                got = f"{tuple(s.shape)} {s.dtype}" if isinstance(s, torch.Tensor) else type(s).__name__
                raise ValueError(f"{name}: expected a float32 tensor of shape ({n},), got {got}")
            if values and s is not None and not bool(((s == 1) | (s == -1)).all()):
                raise ValueError(f"{name}: expected +1 / -1 values only")

    def rotate_h(self, x: torch.Tensor, triton: bool = False) -> torch.Tensor:
        return (block_hadamard if triton else ref_block_hadamard)(x, self.block_size, self.signs_h)

    def rotate_i(self, x: torch.Tensor, triton: bool = False) -> torch.Tensor:
        return (block_hadamard if triton else ref_block_hadamard)(x, self.block_size, self.signs_i)
