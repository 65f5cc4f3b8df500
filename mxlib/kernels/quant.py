"""Triton twins of the reference quantize / dequantize / QDQ functions.

Each public function here has the same name, signature, checks and error
messages as its twin in ``mxlib.reference`` and returns the same bits
(``rtol=0, atol=0``, NaN positions equal), compiled on the GPU and under
``TRITON_INTERPRET=1`` on the CPU. The rounding code is the shared
``mxlib.kernels._numerics``.

Every kernel reads its input once and writes its output once: a tile of
``BLOCK_R`` rows by ``BLOCK_K`` columns (a whole number of scale blocks) is
loaded, reduced per block, rounded and stored. 3D ``[E, m, k]`` tensors are
processed as ``[E * m, k]`` rows, with per-expert global scales looked up by
``row // m``. Inputs are made contiguous first (a copy, if they are not).
"""

from __future__ import annotations

import math

import torch

from .. import reference as _ref
from .._checks import (
    check_block,
    check_float,
    check_out_dtype,
    fp8_args,
    global_scale_view,
    mx_dequant_args,
    nvfp4_dequant_args,
    nvfp4_weight_args,
)
from ..formats import (
    MX_BLOCK_SIZE,
    NVFP4,
    NVFP4_BLOCK_SIZE,
    Numerics,
    get_element_format,
    get_numerics,
    get_scale_mode,
)
from . import _bridge
from . import _numerics as nm
from ._bridge import TL_DTYPE as _TL_DTYPE
from ._bridge import kernel_format_args, launch_opts, select, tiles
from ._triton import tl, triton

__all__ = [
    "quant_dequant_mx",
    "quantize_mx",
    "dequantize_mx",
    "ref_nvfp4_quant_dequant",
    "nvfp4_quant_dequant",
    "nvfp4_per_token_scales",
    "nvfp4_per_token_quant_dequant",
    "quantize_nvfp4",
    "dequantize_to_dtype",
    "quant_dequant_fp8_per_tensor",
]


# ----------------------------------------------------------------------------- MX kernels


@triton.jit
def _mx_qdq_kernel(
    x_ptr,
    out_ptr,
    R,
    K,
    EBITS: tl.constexpr,
    MBITS: tl.constexpr,
    EMAX: tl.constexpr,
    MAX: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    BS: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[R, K] = QDQ(x[R, K]) in an OCP MX format, blocks of BS along K."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < R)[:, None] & (cols < K)[None, :]
    offs = rows[:, None] * K + cols[None, :]
    x = nm.to_fp32(tl.load(x_ptr + offs, mask=mask, other=0.0))
    dq = nm.mx_qdq_values(x, EBITS, MBITS, EMAX, MAX, SCALE_MODE, BS, BLOCK_R, BLOCK_K)
    tl.store(out_ptr + offs, nm.cast_out(dq, OUT_DTYPE), mask=mask)


@triton.jit
def _mx_quantize_kernel(
    x_ptr,
    packed_ptr,
    scale_ptr,
    R,
    K,
    EBITS: tl.constexpr,
    MBITS: tl.constexpr,
    EMAX: tl.constexpr,
    MAX: tl.constexpr,
    SPECIALS: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """x[R, K] -> packed codes [R, K * bits / 8] and E8M0 bytes [R, K / BS]."""
    NBITS: tl.constexpr = 1 + EBITS + MBITS
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    pid_k = tl.program_id(1)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    rmask = rows < R
    mask = rmask[:, None] & (cols < K)[None, :]
    x = nm.to_fp32(tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0.0))
    v, byte = nm.mx_qdq_tile(x, EBITS, MBITS, EMAX, MAX, SCALE_MODE, BS, BLOCK_R, BLOCK_K)
    codes = nm.encode_element(v, EBITS, MBITS, SPECIALS)
    codes = tl.reshape(tl.where((byte == 255)[:, :, None], 0, codes), (BLOCK_R, BLOCK_K))
    NB: tl.constexpr = BLOCK_K // BS
    scols = pid_k * NB + tl.arange(0, NB)
    smask = rmask[:, None] & (scols < K // BS)[None, :]
    tl.store(scale_ptr + rows[:, None] * (K // BS) + scols[None, :], byte.to(tl.uint8), mask=smask)
    _store_codes(packed_ptr, codes, rows, rmask, pid_k, K, NBITS, BLOCK_R, BLOCK_K)


@triton.jit
def _store_codes(
    packed_ptr, codes, rows, rmask, pid_k, K, NBITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr
):
    """Pack int32 codes [BLOCK_R, BLOCK_K] (columns pid_k * BLOCK_K ...) into rows of K * NBITS / 8 bytes."""
    if NBITS == 8:
        cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        tl.store(
            packed_ptr + rows[:, None] * K + cols[None, :],
            codes.to(tl.uint8),
            mask=rmask[:, None] & (cols < K)[None, :],
        )
    elif NBITS == 4:
        lo, hi = tl.split(tl.reshape(codes, (BLOCK_R, BLOCK_K // 2, 2)))
        pcols = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        pmask = rmask[:, None] & (pcols < K // 2)[None, :]
        tl.store(packed_ptr + rows[:, None] * (K // 2) + pcols[None, :], (lo | (hi << 4)).to(tl.uint8), mask=pmask)
    else:
        even, odd = tl.split(tl.reshape(codes, (BLOCK_R, BLOCK_K // 4, 2, 2)))
        v0, v2 = tl.split(even)
        v1, v3 = tl.split(odd)
        word = v0 | (v1 << 6) | (v2 << 12) | (v3 << 18)
        groups = pid_k * (BLOCK_K // 4) + tl.arange(0, BLOCK_K // 4)
        gmask = rmask[:, None] & (groups < K // 4)[None, :]
        base = packed_ptr + rows[:, None] * (3 * (K // 4)) + 3 * groups[None, :]
        tl.store(base, (word & 0xFF).to(tl.uint8), mask=gmask)
        tl.store(base + 1, ((word >> 8) & 0xFF).to(tl.uint8), mask=gmask)
        tl.store(base + 2, ((word >> 16) & 0xFF).to(tl.uint8), mask=gmask)


@triton.jit
def _dequantize_kernel(
    packed_ptr,
    scale_ptr,
    g_ptr,
    out_ptr,
    R,
    K,
    ROWS_PER_GS,
    EBITS: tl.constexpr,
    MBITS: tl.constexpr,
    SPECIALS: tl.constexpr,
    BS: tl.constexpr,
    NVFP4: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    G_ENCODE: tl.constexpr = False,
):
    """out[R, K] from packed codes [R, K*bits/8] and scale bytes [R, K/BS]: MX (E8M0) or NVFP4
    (e4m3 block scale times the decode global scale g[row // ROWS_PER_GS], or divided by it when
    ``G_ENCODE``: an encode scale)."""
    NBITS: tl.constexpr = 1 + EBITS + MBITS
    NB: tl.constexpr = BLOCK_K // BS
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    pid_k = tl.program_id(1)
    rmask = rows < R
    codes = nm.load_codes(packed_ptr + rows * (K * NBITS // 8), rmask, pid_k * BLOCK_K, K, NBITS, BLOCK_R, BLOCK_K)
    scols = pid_k * NB + tl.arange(0, NB)
    smask = rmask[:, None] & (scols < K // BS)[None, :]
    byte = tl.load(scale_ptr + rows[:, None] * (K // BS) + scols[None, :], mask=smask, other=0).to(tl.int32)
    if NVFP4:
        g = tl.load(g_ptr + rows // ROWS_PER_GS, mask=rmask, other=1.0)[:, None]
    else:
        g = 1.0
    dq = nm.dequant_tile(codes, byte, g, EBITS, MBITS, SPECIALS, BS, NVFP4, BLOCK_R, BLOCK_K, G_ENCODE)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = rmask[:, None] & (cols < K)[None, :]
    tl.store(out_ptr + rows[:, None] * K + cols[None, :], nm.cast_out(dq, OUT_DTYPE), mask=mask)


# ----------------------------------------------------------------------------- NVFP4 kernels


@triton.jit
def _nvfp4_qdq_kernel(
    x_ptr,
    gs_ptr,
    out_ptr,
    R,
    K,
    ROWS_PER_GS,
    DIVIDE: tl.constexpr,
    BS: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FOUR_OVER_SIX: tl.constexpr,
):
    """NVFP4 QDQ with vLLM's arithmetic; encode global scale gs[row // ROWS_PER_GS]; FOUR_OVER_SIX: 4/6's block rule."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    rmask = rows < R
    mask = rmask[:, None] & (cols < K)[None, :]
    offs = rows[:, None] * K + cols[None, :]
    x = nm.to_fp32(tl.load(x_ptr + offs, mask=mask, other=0.0))
    gs = tl.load(gs_ptr + rows // ROWS_PER_GS, mask=rmask, other=1.0)[:, None]
    dq = nm.nvfp4_qdq_values(x, gs, DIVIDE, BS, BLOCK_R, BLOCK_K, FOUR_OVER_SIX)
    tl.store(out_ptr + offs, nm.cast_out(dq, OUT_DTYPE), mask=mask)


@triton.jit
def _nvfp4_per_token_kernel(
    x_ptr,
    out_ptr,
    scales_ptr,
    R,
    K,
    QDQ: tl.constexpr,
    HW: tl.constexpr,
    BS: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Per-token NVFP4 scales of BLOCK_R rows: pass 1 reduces each row's amax over all of K (BLOCK_K
    columns a step) and stores ``scales[row] = (gs, per_token_scale)``; with QDQ, pass 2 reads the row
    again and stores its QDQ with vLLM's arithmetic (HW: the hardware form ``e2m1 * s``)."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    rmask = rows < R
    abits = tl.zeros((BLOCK_R,), tl.int32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = rmask[:, None] & (cols < K)[None, :]
        x = nm.to_fp32(tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0.0))
        abits = tl.maximum(abits, nm.row_abs_bits(x))
    gs, ts = nm.nvfp4_per_token_scales(abits)
    tl.store(scales_ptr + rows * 2, gs, mask=rmask)
    tl.store(scales_ptr + rows * 2 + 1, ts, mask=rmask)
    if QDQ:
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            mask = rmask[:, None] & (cols < K)[None, :]
            offs = rows[:, None] * K + cols[None, :]
            x = nm.to_fp32(tl.load(x_ptr + offs, mask=mask, other=0.0))
            if HW:
                dq = nm.nvfp4_qdq_hw_values(x, gs[:, None], BS, BLOCK_R, BLOCK_K)
            else:
                dq = nm.nvfp4_qdq_values(x, gs[:, None], False, BS, BLOCK_R, BLOCK_K)
            tl.store(out_ptr + offs, nm.cast_out(dq, OUT_DTYPE), mask=mask)


@triton.jit
def _nvfp4_quantize_kernel(
    x_ptr,
    g_ptr,
    packed_ptr,
    scale_ptr,
    R,
    K,
    ROWS_PER_GS,
    EBITS: tl.constexpr,
    MBITS: tl.constexpr,
    MAX: tl.constexpr,
    SPECIALS: tl.constexpr,
    S_EBITS: tl.constexpr,
    S_MBITS: tl.constexpr,
    S_MAX: tl.constexpr,
    S_SPECIALS: tl.constexpr,
    ZERO_BLOCK_ONE: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """ModelOpt NVFP4 weight quantization with decode global scale g[row // ROWS_PER_GS]; element
    format EBITS/MBITS/MAX (e2m1), block-scale format S_* (e4m3)."""
    NBITS: tl.constexpr = 1 + EBITS + MBITS
    SIGN: tl.constexpr = 1 << (NBITS - 1)
    NB: tl.constexpr = BLOCK_K // BS
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    pid_k = tl.program_id(1)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    rmask = rows < R
    mask = rmask[:, None] & (cols < K)[None, :]
    x = nm.to_fp32(tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0.0))
    xb = tl.reshape(x, (BLOCK_R, NB, BS))
    g = tl.load(g_ptr + rows // ROWS_PER_GS, mask=rmask, other=1.0)[:, None]
    bamax = tl.max(tl.abs(xb), axis=2)
    bs = tl.math.div_rn(bamax, MAX * g + tl.zeros_like(bamax))
    if ZERO_BLOCK_ONE:
        bs = tl.where(bs == 0, 1.0, bs)
    bs = nm.round_to_element(bs, S_EBITS, S_MBITS, S_MAX)
    denom = (bs * g)[:, :, None] + tl.zeros_like(xb)
    scaled = tl.where(denom == 0, 0.0, tl.math.div_rn(xb, tl.where(denom == 0, 1.0, denom)))
    mag = nm.round_to_element(tl.abs(scaled), EBITS, MBITS, MAX)
    codes = nm.encode_element(mag, EBITS, MBITS, SPECIALS) | tl.where(scaled < 0, SIGN, 0)
    _store_codes(packed_ptr, tl.reshape(codes, (BLOCK_R, BLOCK_K)), rows, rmask, pid_k, K, NBITS, BLOCK_R, BLOCK_K)
    scols = pid_k * NB + tl.arange(0, NB)
    smask = rmask[:, None] & (scols < K // BS)[None, :]
    tl.store(
        scale_ptr + rows[:, None] * (K // BS) + scols[None, :],
        nm.encode_element(bs, S_EBITS, S_MBITS, S_SPECIALS).to(tl.uint8),
        mask=smask,
    )


@triton.jit
def _fp8_qdq_kernel(x_ptr, scale_ptr, out_ptr, N, OUT_DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    """Static per-tensor e4m3 QDQ: e4m3(clamp(x * (1 / scale))) * scale."""
    offs = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    mask = offs < N
    x = nm.to_fp32(tl.load(x_ptr + offs, mask=mask, other=0.0))
    tl.store(out_ptr + offs, nm.cast_out(nm.fp8_qdq_values(x, tl.load(scale_ptr)), OUT_DTYPE), mask=mask)


# ----------------------------------------------------------------------------- wrappers


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().reshape(math.prod(x.shape[:-1]), x.shape[-1])


def quant_dequant_mx(x, element="e2m1", block_size=MX_BLOCK_SIZE, scale_mode="even", dtype=None):
    """Triton twin of ``mxlib.reference.quant_dequant_mx`` (same arguments, same bits)."""
    fmt = get_element_format(element)
    get_scale_mode(scale_mode)
    check_float(x, "x")
    check_block(x.shape[-1], block_size, "x")
    dtype = x.dtype if dtype is None else dtype
    check_out_dtype(dtype)
    x2 = _rows(x)
    r, k = x2.shape
    out = torch.empty((r, k), dtype=dtype, device=x.device)
    if x2.numel():
        br, bk = tiles(r, k, block_size)
        fa = kernel_format_args(fmt, block_size=block_size, scale_mode=scale_mode)
        _mx_qdq_kernel[(triton.cdiv(r, br), triton.cdiv(k, bk))](
            x2,
            out,
            r,
            k,
            **select(_mx_qdq_kernel, fa),
            OUT_DTYPE=_TL_DTYPE[dtype],
            BLOCK_R=br,
            BLOCK_K=bk,
            **launch_opts(),
        )
    return out.reshape(x.shape)


def quantize_mx(x, element="e2m1", block_size=MX_BLOCK_SIZE, scale_mode="even"):
    """Triton twin of ``mxlib.reference.quantize_mx``: ``(packed uint8, scale uint8)``."""
    fmt = get_element_format(element)
    get_scale_mode(scale_mode)
    check_float(x, "x")
    check_block(x.shape[-1], block_size, "x")
    fmt.packed_size(block_size)
    x2 = _rows(x)
    r, k = x2.shape
    packed = torch.empty((r, fmt.packed_size(k)), dtype=torch.uint8, device=x.device)
    scale = torch.empty((r, k // block_size), dtype=torch.uint8, device=x.device)
    if x2.numel():
        br, bk = tiles(r, k, block_size)
        fa = kernel_format_args(fmt, block_size=block_size, scale_mode=scale_mode)
        _mx_quantize_kernel[(triton.cdiv(r, br), triton.cdiv(k, bk))](
            x2, packed, scale, r, k, **select(_mx_quantize_kernel, fa), BLOCK_R=br, BLOCK_K=bk, **launch_opts()
        )
    lead = x.shape[:-1]
    return packed.reshape(*lead, packed.shape[-1]), scale.reshape(*lead, scale.shape[-1])


def dequantize_mx(packed, scale, element="e2m1", block_size=MX_BLOCK_SIZE, dtype=torch.bfloat16):
    """Triton twin of ``mxlib.reference.dequantize_mx``."""
    fmt, packed, scale, k = mx_dequant_args(packed, scale, element, block_size, dtype)
    pk = packed.shape[-1]
    n_rows = math.prod(packed.shape[:-1])
    p2 = packed.contiguous().reshape(n_rows, pk)
    s2 = scale.contiguous().reshape(n_rows, k // block_size)
    r = p2.shape[0]
    out = torch.empty((r, k), dtype=dtype, device=packed.device)
    if out.numel():
        br, bk = tiles(r, k, block_size)
        fa = kernel_format_args(fmt, block_size=block_size)
        _dequantize_kernel[(triton.cdiv(r, br), triton.cdiv(k, bk))](
            p2,
            s2,
            s2,
            out,
            r,
            k,
            1,
            **select(_dequantize_kernel, fa),
            NVFP4=False,
            OUT_DTYPE=_TL_DTYPE[dtype],
            BLOCK_R=br,
            BLOCK_K=bk,
            **launch_opts(),
        )
    return out.reshape(*packed.shape[:-1], k)


def _global_scale_rows(global_scale, x: torch.Tensor, name: str, check_scale=True) -> tuple[torch.Tensor, int]:
    """fp32 global scale as a flat tensor plus the number of rows that share each value."""
    gs = global_scale_view(global_scale, x, name, check_scale)  # same checks and messages
    lead = x.shape[:-1]
    rows = math.prod(lead)
    flat = gs.reshape(-1).contiguous().to(x.device)
    return flat, max(1, rows // flat.numel())


def ref_nvfp4_quant_dequant(
    x,
    global_scale,
    block_size=NVFP4_BLOCK_SIZE,
    multiplier="reciprocal",
    dtype=None,
    check_scale=True,
    block_rule="amax",
):
    """Triton twin of ``mxlib.reference.ref_nvfp4_quant_dequant`` (vLLM's arithmetic; ``block_rule``
    ``amax`` or ``four_over_six``, the latter for NVFP4's block size 16)."""
    check_float(x, "x")
    check_block(x.shape[-1], block_size, "x")
    if multiplier not in ("reciprocal", "divide"):
        raise ValueError(f"multiplier: expected 'reciprocal' (the seed) or 'divide', got {multiplier!r}")
    if block_rule not in _ref.NVFP4_BLOCK_RULES:
        raise ValueError(f"block_rule: expected one of {list(_ref.NVFP4_BLOCK_RULES)}, got {block_rule!r}")
    if block_rule == "four_over_six" and block_size != NVFP4_BLOCK_SIZE:
        raise ValueError(f"block_rule: four_over_six runs with block_size={NVFP4_BLOCK_SIZE}, got {block_size}")
    dtype = x.dtype if dtype is None else dtype
    check_out_dtype(dtype)
    gs, rows_per_gs = _global_scale_rows(global_scale, x, "global_scale", check_scale)
    x2 = _rows(x)
    r, k = x2.shape
    out = torch.empty((r, k), dtype=dtype, device=x.device)
    if x2.numel():
        br, bk = tiles(r, k, block_size)
        _nvfp4_qdq_kernel[(triton.cdiv(r, br), triton.cdiv(k, bk))](
            x2,
            gs,
            out,
            r,
            k,
            rows_per_gs,
            DIVIDE=multiplier == "divide",
            BS=block_size,
            OUT_DTYPE=_TL_DTYPE[dtype],
            BLOCK_R=br,
            BLOCK_K=bk,
            FOUR_OVER_SIX=block_rule == "four_over_six",
            **launch_opts(),
        )
    return out.reshape(x.shape)


nvfp4_quant_dequant = ref_nvfp4_quant_dequant


def per_token_rows(x2: torch.Tensor, dtype=None, qdq=True, hardware=False, block_size=NVFP4_BLOCK_SIZE, out=None):
    """Per-token NVFP4 over the rows of a contiguous 2D ``x2 [R, K]``: ``(out [R, K] of dtype or None,
    scales fp32 [R, 2])``, ``scales[r] = (gs, per_token_scale)`` (the layout the FP4 kernel reads);
    ``qdq=False`` computes the scales only (one read of ``x2``), else a second read QDQs each row
    (``hardware``: ``e2m1 * s``) into ``out`` (may be ``x2`` itself: each row is read before it is written)."""
    r, k = x2.shape
    scales = torch.empty((r, 2), dtype=torch.float32, device=x2.device)
    if qdq and out is None:
        out = torch.empty((r, k), dtype=dtype or x2.dtype, device=x2.device)
    if r:
        block_r, block_k = tiles(r, k, block_size)
        _nvfp4_per_token_kernel[(triton.cdiv(r, block_r),)](
            x2,
            out if qdq else x2,
            scales,
            r,
            k,
            QDQ=qdq,
            HW=hardware,
            BS=block_size,
            OUT_DTYPE=_TL_DTYPE[out.dtype if qdq else torch.float32],
            BLOCK_R=block_r,
            BLOCK_K=block_k,
            **launch_opts(),
        )
    return out, scales


def nvfp4_per_token_scales(x):
    """Triton twin of ``mxlib.reference.nvfp4_per_token_scales``: ``(global_scale, per_token_scale)``."""
    check_float(x, "x")
    lead = x.shape[:-1]
    _, scales = per_token_rows(_rows(x), qdq=False)
    return scales[:, 0].reshape(lead), scales[:, 1].reshape(lead)


def nvfp4_per_token_quant_dequant(x, block_size=NVFP4_BLOCK_SIZE, dtype=None, numerics="vllm"):
    """Triton twin of ``mxlib.reference.nvfp4_per_token_quant_dequant``: ``(dq, per_token_scale)``."""
    check_float(x, "x")
    check_block(x.shape[-1], block_size, "x")
    dtype = x.dtype if dtype is None else dtype
    check_out_dtype(dtype)
    hardware = get_numerics(numerics) is Numerics.HARDWARE
    out, scales = per_token_rows(_rows(x), dtype, hardware=hardware, block_size=block_size)
    return out.reshape(x.shape), scales[:, 1].reshape(x.shape[:-1])


def quantize_nvfp4(x, weight_scale_2=None, block_size=NVFP4_BLOCK_SIZE, zero_block_scale="one"):
    """Triton twin of ``mxlib.reference.quantize_nvfp4`` (ModelOpt's weight export)."""
    x3, ws2 = nvfp4_weight_args(x, weight_scale_2, block_size, zero_block_scale)
    if ws2 is None:
        ws2 = _ref.nvfp4_weight_scale_2(x3)
    num, n, k = x3.shape
    x2 = x3.contiguous().reshape(num * n, k)
    packed = torch.empty((num * n, k // 2), dtype=torch.uint8, device=x.device)
    scale = torch.empty((num * n, k // block_size), dtype=torch.uint8, device=x.device)
    if x2.numel():
        br, bk = tiles(num * n, k, block_size)
        fa = {**kernel_format_args(NVFP4, block_size=block_size), **kernel_format_args(NVFP4.scale.element, "S_")}
        _nvfp4_quantize_kernel[(triton.cdiv(num * n, br), triton.cdiv(k, bk))](
            x2,
            ws2,
            packed,
            scale,
            num * n,
            k,
            n,
            **select(_nvfp4_quantize_kernel, fa),
            ZERO_BLOCK_ONE=zero_block_scale == "one",
            BLOCK_R=br,
            BLOCK_K=bk,
            **launch_opts(),
        )
    packed = packed.reshape(num, n, k // 2)
    scale = scale.view(torch.float8_e4m3fn).reshape(num, n, k // block_size)
    if x.ndim == 2:
        return packed[0], scale[0], ws2[0].clone()
    return packed, scale, ws2.clone()


def dequantize_to_dtype(
    tensor_fp4,
    tensor_sf,
    global_scale,
    dtype,
    block_size=NVFP4_BLOCK_SIZE,
    swizzle=False,
    check_scale=True,
    global_scale_kind="decode",
):
    """Triton twin of ``mxlib.reference.dequantize_to_dtype`` (vLLM's)."""
    fp4, sf, g, k = nvfp4_dequant_args(
        tensor_fp4, tensor_sf, global_scale, dtype, block_size, swizzle, _ref.nvfp4_unswizzle_scales, check_scale
    )
    g_encode = _ref.check_global_scale_kind(global_scale_kind)
    g = g.contiguous()
    m = fp4.shape[-2]
    n_rows = math.prod(fp4.shape[:-1])
    p2 = fp4.contiguous().reshape(n_rows, k // 2)
    s2 = sf.contiguous().reshape(n_rows, k // block_size)
    r = p2.shape[0]
    out = torch.empty((r, k), dtype=dtype, device=fp4.device)
    if out.numel():
        br, bk = tiles(r, k, block_size)
        fa = kernel_format_args(NVFP4, block_size=block_size)
        _dequantize_kernel[(triton.cdiv(r, br), triton.cdiv(k, bk))](
            p2,
            s2,
            g,
            out,
            r,
            k,
            m,
            **select(_dequantize_kernel, fa),
            OUT_DTYPE=_TL_DTYPE[dtype],
            BLOCK_R=br,
            BLOCK_K=bk,
            G_ENCODE=g_encode,
            **launch_opts(),
        )
    return out.reshape(*fp4.shape[:-1], k)


def quant_dequant_fp8_per_tensor(x, scale, dtype=None, check_scale=True):
    """Triton twin of ``mxlib.reference.quant_dequant_fp8_per_tensor``."""
    scale, dtype = fp8_args(x, scale, dtype, check_scale)
    scale = scale.reshape(1)
    xf = x.contiguous().reshape(-1)
    out = torch.empty(xf.shape, dtype=dtype, device=x.device)
    n = xf.numel()
    if n:
        block = _bridge.TILE_ELEMENTS
        _fp8_qdq_kernel[(triton.cdiv(n, block),)](
            xf, scale, out, n, OUT_DTYPE=_TL_DTYPE[dtype], BLOCK=block, **launch_opts()
        )
    return out.reshape(x.shape)
