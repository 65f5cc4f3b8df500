"""Reference quantize / dequantize / quantize-dequantize (QDQ), pure PyTorch.

This module is the oracle the Triton kernels are tested against; it imports no
Triton. Every function works on 2D ``[m, k]`` and 3D ``[E, m, k]`` (per-expert)
tensors, on bf16, fp16 and fp32 input, and blocks always run along the last
(reduction) axis.

Arithmetic (all in fp32; input is first widened to fp32, which is exact, and the
result is cast once to the requested dtype):

OCP MX (``quantize_mx``, ``dequantize_mx``, ``quant_dequant_mx``), OCP MX v1.0 section 6:

1. ``amax`` = max |x| over a block of ``block_size`` (32) elements; NaN propagates.
2. The E8M0 shared exponent ``s`` by one of three rules (``e8m0_scale``), clamped
   to [-127, 127]; a block whose amax is NaN or Inf gets byte 0xFF (NaN) and
   dequantizes to all NaN (torchao 0.18 does this for NaN only: it gives an
   Inf-holding block a finite byte, flushing the rest of the block to 0); an
   all-zero block gets byte 0 (``2**-127``).
3. Elements ``x / 2**s`` (exact: a power-of-two division) rounded to the element
   format: nearest, ties to even, saturating to +-max (``round_to_element``).
4. Dequantize: ``code_value * 2**s``, exact in fp32 for every format and scale,
   then one cast, IEEE round to nearest without saturation (as torchao's
   ``to_dtype``): an fp16 block at 65504 dequantizes to 65536 under ``even`` and
   ``rceil``, which is +-Inf in fp16.

Edge rules shared with the Triton twins (``mxlib._checks``): ``block_size`` is a
power of two from 2 to 1024; NVFP4 global scales lie, elementwise, in
``[2**-126, 2**126]`` (finite, positive, finite normal reciprocal), checked
unless ``check_scale=False`` or while a CUDA graph is being captured; empty
inputs give empty outputs of the right shapes and dtypes.

NVFP4 activations, vLLM's arithmetic (vLLM ``ref_nvfp4_quant_dequant``):
``global_scale`` ``gs`` is the *encode* scale ``1 / input_scale`` (about
``2688 / amax``), and with ``recip(v) = 1 / (v + (v == 0) * 1e8)``::

    s  = e4m3(clamp(gs * (amax_block * fp32(1/6)), -448, 448))   # RNE cast
    q  = recip(s * recip(gs))             # quantize multiplier, not gs / s
    e  = fp4(clamp(x * q, -6, 6))         # RNE; sign from x < 0 (see below)
    dq = e * (s / gs)                     # then cast to x.dtype

Details that are easy to "simplify" wrongly, each reproduced bit for bit:
``amax * (1/6)`` is not ``amax / 6``; ``recip(s * recip(gs))`` is not ``gs / s``
(a later vLLM Triton kernel forms ``gs / s`` in one division: select it with
``multiplier="divide"``; it differs at rounding thresholds); an all-zero block
gets ``s = 0``, ``q = 1e-8`` and dequantizes to zeros, never NaN; vLLM takes
the sign through ``torch.sign``, so an input of ``-0.0`` comes out ``+0.0`` while
a negative value that rounds to zero comes out ``-0.0``. A NaN anywhere in a
block makes the block scale NaN and the whole block NaN. An Inf makes the block
scale saturate to 448; the Inf element becomes ``6 * 448 / gs`` and the rest of
the block is quantized against that scale.

NVFP4 weights (``quantize_nvfp4``), NVIDIA ModelOpt's export arithmetic, with
*decode* scales: ``weight_scale_2 = amax / (6 * 448)`` per tensor (per expert),
block scale ``e4m3(amax_block / (6 * weight_scale_2))`` and elements
``fp4(x / (fp32(block_scale) * weight_scale_2))``. ModelOpt stores 1.0 as the
block scale of an all-zero block (``zero_block_scale="one"``, the default);
``"zero"`` stores 0. ``dequantize_to_dtype`` is vLLM's:
``e2m1 * (fp32(block_scale) * weight_scale_2)`` in fp32, then one cast.

NVFP4 variants ahead of hardware (``quantize_nvfp4_variant``, ``dequantize_nvfp4_variant``,
``quant_dequant_nvfp4_variant``; ``mxlib.formats.NVFP4_VARIANTS``): ``nvfp4_ue5m3`` (unsigned e5m3 block scales,
no global scale unless one is passed) and ``nvfp4_b32`` (e4m3 scales per 32 elements). One arithmetic, ModelOpt's
decode-scale form, for weights and activations: ``s = scale_format(amax_block / (6 * g))``,
``e = e2m1(x / (s * g))``, ``dq = e * (s * g)``; block scales stored as uint8 codes.

Packing: FP4 two codes per byte, the even element in the low nibble; FP6 four
codes ``v0..v3`` in three bytes as ``v0 | v1 << 6 | v2 << 12 | v3 << 18``,
little-endian (AMD Quark's layout); FP8 one code per byte.

For torchao users (docs/api-mapping.md): ``quantize_mx`` returns ``(packed, scale)`` where
torchao's ``to_mx`` returns ``(scale, data)``; mxlib's default E8M0 rule is ``even``, torchao's
``floor``; scales are uint8 unless ``scale_dtype=torch.float8_e8m0fnu``, and the decoding functions take
``float8_e8m0fnu`` scales and ``float4_e2m1fn_x2`` / float8 data as input. NVFP4 ``global_scale`` is
the encode scale in the activation QDQ functions and the decode scale in ``dequantize_to_dtype``
(vLLM's names for both), as each docstring states.
"""

from __future__ import annotations

import math

import torch

from ._checks import (
    E8M0_DTYPES,
    GLOBAL_SCALE_MAX,
    GLOBAL_SCALE_MIN,
    as_storage_dtype,
    check_storage_dtype,
    nvfp4_dequant_args,
    packed_dtypes,
)
from ._checks import (
    as_uint8 as _as_uint8,
)
from ._checks import (
    check_block as _check_block,
)
from ._checks import (
    check_float as _check_float,
)
from ._checks import (
    check_out_dtype as _check_out_dtype,
)
from ._checks import (
    fp8_args as _fp8_args,
)
from ._checks import (
    global_scale_view as _global_scale_view,
)
from ._checks import (
    mx_dequant_args as _mx_dequant_args,
)
from ._checks import (
    nvfp4_weight_args as _nvfp4_weight_args,
)
from .formats import (
    E8M0_BIAS,
    E8M0_NAN_BYTE,
    FP8_E4M3_PER_TENSOR,
    MX_BLOCK_SIZE,
    NVFP4,
    NVFP4_BLOCK_SIZE,
    NVFP4_SCALE_DIVISOR,
    NVFP4_VARIANTS,
    BlockScheme,
    ElementFormat,
    Numerics,
    get_block_scheme,
    get_element_format,
    get_numerics,
    get_scale_mode,
)

__all__ = [
    "quant_dequant_fp8_per_token",
    "quantize_fp8_weight",
    "dequantize_fp8_weight",
    "FP8_MIN_TOKEN_SCALE",
    "round_to_element",
    "encode_element",
    "decode_element",
    "element_value_table",
    "e8m0_scale",
    "decode_e8m0",
    "pack_codes",
    "unpack_codes",
    "quantize_mx",
    "dequantize_mx",
    "quant_dequant_mx",
    "ref_nvfp4_quant",
    "ref_nvfp4_quant_dequant",
    "NVFP4_BLOCK_RULES",
    "compressed_tensors_nvfp4_quant_dequant",
    "nvfp4_per_token_scales",
    "nvfp4_per_token_quant_dequant",
    "quantize_nvfp4",
    "nvfp4_weight_scale_2",
    "nvfp4_block_stats",
    "dequantize_to_dtype",
    "nvfp4_swizzle_scales",
    "nvfp4_unswizzle_scales",
    "quant_dequant_fp8_per_tensor",
    "quant_dequant",
    "nvfp4_variant_global_scale",
    "quantize_nvfp4_variant",
    "dequantize_nvfp4_variant",
    "quant_dequant_nvfp4_variant",
]

_E2M1 = NVFP4.element  # e2m1
_E4M3 = NVFP4.scale.element  # e4m3fn, NVFP4's block scales
_FP8 = FP8_E4M3_PER_TENSOR.element  # e4m3fn, per-tensor FP8
# Rows are processed in chunks of about this many elements: it bounds the fp32
# temporaries on full-size expert weights (a 128-expert w13 is 400M elements) and
# keeps them small enough for the allocator to reuse instead of mapping fresh pages.
_CHUNK_ELEMENTS = 1 << 19


def _row_chunks(rows: int, row_elements: int) -> list[slice]:
    if row_elements == 0:
        return []  # empty rows: nothing to compute, and reshape(-1, 0) would be ambiguous
    step = max(1, _CHUNK_ELEMENTS // max(1, row_elements))
    return [slice(i, min(rows, i + step)) for i in range(0, rows, step)]


# ----------------------------------------------------------------------------- bit helpers


def _div(a: torch.Tensor, v: float) -> torch.Tensor:
    """IEEE ``a / v`` on every device.

    PyTorch's CUDA kernel turns ``tensor / python_float`` into a multiplication by
    the reciprocal, which is not the correctly rounded quotient; a divisor tensor on
    the same device keeps true division on the CPU and the GPU alike.
    """
    return a / torch.tensor(v, dtype=torch.float32, device=a.device)


def _exp2i(n: torch.Tensor) -> torch.Tensor:
    """Exact ``2.0 ** n`` in fp32 for integer ``n`` in [-149, 127], built from bits."""
    n = n.to(torch.int32)
    normal = torch.bitwise_left_shift(n + 127, 23)
    sub = torch.bitwise_left_shift(torch.ones_like(n), (n + 149).clamp(0, 22))
    return torch.where(n >= -126, normal, sub).view(torch.float32)


def _fp32_exponent(a: torch.Tensor) -> torch.Tensor:
    """Unbiased exponent field of non-negative fp32 ``a`` (-127 for zero and subnormals)."""
    return torch.bitwise_right_shift(a.view(torch.int32), 23) - 127


# ----------------------------------------------------------------------------- elements


def round_to_element(x: torch.Tensor, element: str | ElementFormat) -> torch.Tensor:
    """Round fp32 values to an element format's grid: nearest, ties to even, saturating.

    Args:
        x: any float tensor; it is widened to fp32 (exact).
        element: ``e2m1``, ``e2m3``, ``e3m2``, ``e4m3`` or ``e5m2`` (or an alias).

    Returns:
        fp32 tensor of the same shape whose values all lie on the format's grid.
        Finite values beyond ``max`` and +-Inf saturate to +-max (PTX
        ``cvt.rn.satfinite`` semantics); NaN stays NaN; the sign of zero is kept. An unsigned
        format (``ue5m3``) clamps negative values (and -0, -Inf) to +0.

    Method, on ``a = |x|`` (first clamped to ``2 * max`` so that Inf is finite):
    in the format's normal range the fp32 mantissa is rounded to ``mbits`` bits on
    the integer bits (add ``half - 1 + lsb``, clear the low bits: ties to even, a
    carry moves to the exponent); below ``min_normal`` the grid step is the fixed
    ``min_subnormal`` and ``(a + C) - C`` with ``C = min_subnormal * 2**23`` rounds to
    it under fp32's own round-to-nearest-even.
    """
    fmt = get_element_format(element)
    x = x.float()
    if not fmt.signed:  # an unsigned format (ue5m3): negative values clamp to +0
        x = torch.where(x > 0, x, torch.where(torch.isnan(x), x, 0.0))
    a = torch.clamp(x.abs(), max=2.0 * fmt.max)
    shift = 23 - fmt.mbits
    bits = a.view(torch.int32)
    lsb = torch.bitwise_right_shift(bits, shift) & 1
    r = ((bits + ((1 << (shift - 1)) - 1) + lsb) & -(1 << shift)).view(torch.float32)
    big = fmt.min_subnormal * 2.0**23
    r = torch.where(a < fmt.min_normal, (a + big) - big, r)
    r = torch.where(torch.isnan(a), a, torch.clamp(r, max=fmt.max))
    return torch.copysign(r, x)


def element_value_table(element: str | ElementFormat, device: torch.device | str = "cpu") -> torch.Tensor:
    """fp32 value of every code of a format, indexed by code (NaN/Inf for specials)."""
    fmt = get_element_format(element)
    return torch.tensor(fmt.values(), dtype=torch.float32, device=device)


def decode_element(codes: torch.Tensor, element: str | ElementFormat) -> torch.Tensor:
    """Unpacked codes (uint8, one per element) to fp32 values, by table lookup."""
    fmt = get_element_format(element)
    codes = _as_uint8(codes, "codes", ())
    table = element_value_table(fmt, codes.device)
    return table.index_select(0, codes.reshape(-1).to(torch.int32)).reshape(codes.shape)


def _byte_value_table(fmt: ElementFormat, device) -> torch.Tensor:
    """The fp32 values a packed byte holds, one int64 per byte value whose two 32-bit halves are the
    values of the byte's codes in memory order (FP4: the low nibble's first), so that one lookup per byte,
    viewed as fp32, decodes two elements; FP8: the fp32 value of each byte. Cached per format and device."""
    key = (fmt.name, str(device))
    if key not in _BYTE_TABLES:
        values = element_value_table(fmt, device)
        if fmt.nbits == 4:
            byte = torch.arange(256, device=device)
            pairs = torch.stack([values[byte & 0xF], values[byte >> 4]], dim=-1)  # [256, 2] fp32, contiguous
            _BYTE_TABLES[key] = pairs.view(torch.int64).reshape(256)
        else:
            _BYTE_TABLES[key] = values
    return _BYTE_TABLES[key]


_BYTE_TABLES: dict = {}


def _decode_packed(packed: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """``decode_element(unpack_codes(packed, fmt), fmt)`` for uint8 ``[rows, packed_k]``: fp32 ``[rows, k]``.

    The same values by fewer passes over the data: FP4 and FP8 look each byte up once in
    ``_byte_value_table`` (FP4: both nibbles at once); FP6 unpacks its 3-byte groups first."""
    rows = packed.shape[0]
    if fmt.nbits == 6:
        return decode_element(unpack_codes(packed, fmt), fmt).reshape(rows, -1)
    table = _byte_value_table(fmt, packed.device)
    looked_up = table.index_select(0, packed.reshape(-1).to(torch.int32))
    return looked_up.view(torch.float32).reshape(rows, -1)


def rounding_boundaries(element: str | ElementFormat) -> tuple[float, ...]:
    """The fp32 boundaries between consecutive non-negative finite codes of a format.

    Magnitude code ``i`` (the codes ``0, 1, ...`` in increasing value, up to ``max``) holds the values
    ``a`` with ``b[i-1] < a <= b[i]``: ``b[i]`` is the midpoint of the values of codes ``i`` and ``i+1``
    where a tie goes to code ``i`` (the even one), and the fp32 number just below that midpoint where a
    tie goes to code ``i+1``. So round to nearest, ties to even, is "count the boundaries below ``a``".
    Every midpoint is exact in fp32 (the values have at most 4 significant bits).
    """
    fmt = get_element_format(element)
    return _rounding_boundaries(fmt)


_BOUNDARIES: dict[str, tuple[float, ...]] = {}


def _rounding_boundaries(fmt: ElementFormat) -> tuple[float, ...]:
    if fmt.name not in _BOUNDARIES:
        magnitudes = fmt.num_codes // 2 if fmt.signed else fmt.num_codes  # the codes of the values >= 0
        values = [v for v in (fmt.code_value(c) for c in range(magnitudes)) if math.isfinite(v)]
        bounds = []
        for i in range(len(values) - 1):
            mid = torch.tensor((values[i] + values[i + 1]) / 2, dtype=torch.float32)
            if (i + 1) % 2 == 0:  # the upper code is the even one: a tie goes up
                mid = torch.nextafter(mid, torch.tensor(0.0))
            bounds.append(float(mid))
        _BOUNDARIES[fmt.name] = tuple(bounds)
    return _BOUNDARIES[fmt.name]


def encode_element(x: torch.Tensor, element: str | ElementFormat) -> torch.Tensor:
    """Round fp32 values to a format and return their codes (uint8): the codes of
    ``round_to_element(x)`` (nearest, ties to even, saturating to +-max, the sign of zero kept).

    +-Inf and values beyond ``max`` get the largest finite code. NaN becomes the format's NaN code where it
    has one (e4m3: 0x7F, e5m2: 0x7E, sign kept; ue5m3: 0xFF); FP4 and FP6 have no NaN code, so NaN encodes
    as +0 (in MX a block holding NaN carries it in its 0xFF scale instead). An unsigned format (``ue5m3``)
    clamps negative values (and -0, -Inf) to +0.

    Two methods, the same codes (tests compare both with ml_dtypes' casts):
    - FP8 and FP6: PyTorch's own conversion to ``float8_e4m3fn`` / ``float8_e5m2`` (round to nearest, ties to
      even), after clamping to +-max. An FP6 format has the mantissa width of one of them (e2m3 of e4m3, e3m2 of
      e5m2) and a narrower exponent range: scaled by the power of two ``min_normal(fp8) / min_normal(fp6)``
      its normal and subnormal grids are the FP8 format's, and its code is the FP8 byte's low
      ``ebits + mbits`` bits under the sign.
    - otherwise (FP4, ue5m3): the magnitude code of ``a = |x|`` is the number of ``rounding_boundaries``
      below ``a``, a comparison per boundary for FP4 (7 of them), a sorted search (``torch.bucketize``) for
      wider formats.
    Neither branches on the data, so the function traces into one graph.
    """
    fmt = get_element_format(element)
    x = x.float()
    twin = _FP8_TWIN.get((fmt.ebits, fmt.mbits)) if fmt.signed else None
    if twin is not None:
        return _encode_by_fp8_cast(x, fmt, *twin)
    return _encode_by_boundaries(x, fmt)


# The FP8 storage dtype whose mantissa width and wider exponent range hold each signed FP8/FP6 format's grid.
_FP8_TWIN = {
    (4, 3): (torch.float8_e4m3fn, 2.0**-6),  # e4m3: itself
    (5, 2): (torch.float8_e5m2, 2.0**-14),  # e5m2: itself
    (2, 3): (torch.float8_e4m3fn, 2.0**-6),  # e2m3 inside e4m3
    (3, 2): (torch.float8_e5m2, 2.0**-14),  # e3m2 inside e5m2
}


def _encode_by_fp8_cast(x: torch.Tensor, fmt: ElementFormat, dtype: torch.dtype, min_normal: float) -> torch.Tensor:
    shift = min_normal / fmt.min_normal  # a power of two: exact, and values it pushes below fp32's range round to 0
    limit = fmt.max * shift
    y = x * shift if shift != 1.0 else x
    byte = torch.clamp(y, -limit, limit).to(dtype).view(torch.uint8)
    width = fmt.ebits + fmt.mbits
    if width < 7:  # the FP8 byte's exponent field fits the narrower one: keep the low bits, move the sign
        byte = (byte & ((1 << width) - 1)) | torch.bitwise_right_shift(byte, 7 - width) & (1 << width)
    nan = torch.isnan(x)
    if fmt.has_nan_code:
        return torch.where(nan, fmt.nan_code | (torch.signbit(x).to(torch.uint8) << width), byte)
    return torch.where(nan, 0, byte).to(torch.uint8)


def _encode_by_boundaries(x: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    if not fmt.signed:  # an unsigned format (ue5m3): negative values (and -0, -Inf) clamp to +0
        x = torch.where(x > 0, x, torch.where(torch.isnan(x), x, 0.0))
    a = x.abs()
    bounds = _rounding_boundaries(fmt)
    if len(bounds) <= 8:
        mag = _count_boundaries_below(a, bounds)  # NaN is below no boundary: magnitude code 0
        if fmt.has_nan_code:
            mag = torch.where(torch.isnan(a), fmt.nan_code, mag)
    else:
        table = torch.tensor(bounds, dtype=torch.float32, device=a.device)
        mag = torch.bucketize(a, table, right=False).to(torch.uint8)  # NaN sorts last
        mag = torch.where(torch.isnan(a), fmt.nan_code if fmt.has_nan_code else 0, mag)
    if not fmt.signed:
        return mag
    if fmt.has_nan_code:  # NaN keeps its sign
        negative = torch.signbit(x)
    else:  # NaN encodes as +0; -0 keeps its sign (its fp32 bits are the int32 minimum)
        negative = torch.lt(x, 0).logical_or_(x.view(torch.int32) == -(2**31))
    return mag.add_(negative.view(torch.uint8) << (fmt.ebits + fmt.mbits))


def _count_boundaries_below(a: torch.Tensor, bounds: tuple[float, ...]) -> torch.Tensor:
    """uint8 count of the ``bounds`` strictly below each value of ``a`` (0 for NaN): one comparison per
    boundary, its bytes added as they are (a bool is stored as one byte, 0 or 1)."""
    mag = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    above = torch.empty(a.shape, dtype=torch.bool, device=a.device)
    for b in bounds:
        mag += torch.gt(a, b, out=above).view(torch.uint8)
    return mag


def encode_e2m1_sign_magnitude(x: torch.Tensor) -> torch.Tensor:
    """NVFP4's element codes (uint8, one per element, unpacked): the e2m1 code of ``|x|`` (``encode_element``:
    nearest, ties to even, saturating at 6) with the sign bit (0x8) set where ``x < 0``, so that -0 and NaN
    encode as +0 (code 0), as ModelOpt's weight packer and vLLM's QDQ give them. ``encode_element(x, "e2m1")``
    keeps the sign of -0 instead (code 0x8), as OCP MX's conversion does.

    Args:
        x: fp32 tensor, any shape (the scaled values, ``x / (block_scale * global_scale)``).
    """
    mag = _count_boundaries_below(x.abs(), _rounding_boundaries(_E2M1))
    return mag.bitwise_or_(torch.lt(x, 0).view(torch.uint8) << 3)


# ----------------------------------------------------------------------------- E8M0 scales


def e8m0_scale(amax: torch.Tensor, element: str | ElementFormat, scale_mode: str = "even") -> torch.Tensor:
    """E8M0 block-scale bytes from block amax values.

    Args:
        amax: fp32 (or any float) tensor of non-negative block maxima; NaN/Inf allowed.
        element: the element format the block is quantized to (gives ``emax``,
            ``mbits`` and ``max``).
        scale_mode:
            ``floor``: ``2**(floor(log2(amax)) - emax)``, OCP MX v1.0 section 6.3.
            ``even``: ``amax`` is first rounded to the element's mantissa width by
            adding half an ulp at that width to its fp32 bits and dropping the
            mantissa (``bits + (1 << (22 - mbits))``), then the floor rule. AMD
            Quark's ``scale_calculation_mode: even``, used by vLLM's MX emulation
            and torchao's ``ScaleCalculationMode.EVEN``. For e2m1 it bumps the
            exponent when the mantissa of amax is >= 1.75, so amax never saturates.
            ``rceil``: ``2**ceil(log2(q))`` with ``q = fp32(amax / max)`` rounded to
            nearest first: NVIDIA's ``cvt.rp.satfinite.ue8m0x2.f32``, cuBLAS and
            triton_kernels; the elements never saturate.

    Returns:
        uint8 bytes ``b`` of the same shape, scale ``2**(b - 127)``: the exponent is
        clamped to [-127, 127] (an all-zero or tiny block gets byte 0, ``2**-127``);
        NaN or Inf amax gives 0xFF.
    """
    fmt = get_element_format(element)
    get_scale_mode(scale_mode)
    amax = amax.float()
    finite = torch.isfinite(amax)
    a = torch.where(finite, amax.abs(), 0.0)
    bits = a.view(torch.int32)
    if scale_mode == "floor":
        e = torch.bitwise_right_shift(bits, 23) - 127 - fmt.emax
    elif scale_mode == "even":
        rounded = bits + (1 << (22 - fmt.mbits))
        e = torch.bitwise_right_shift(rounded, 23) - 127 - fmt.emax
    else:  # rceil
        q = _div(a, fmt.max)
        qbits = q.view(torch.int32)
        exp_field = torch.bitwise_right_shift(qbits, 23)
        mant = qbits & 0x7FFFFF
        e_normal = exp_field - 127 + (mant != 0).to(torch.int32)
        e_sub = torch.where(mant > (1 << 22), -126, -127).to(torch.int32)
        e = torch.where(exp_field > 0, e_normal, e_sub)
    byte = e.clamp(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS
    byte = torch.where(finite, byte, E8M0_NAN_BYTE)
    return byte.to(torch.uint8)


def decode_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (uint8 or float8_e8m0fnu) to fp32: ``2**(b - 127)``, 0xFF -> NaN.

    Byte 0 decodes to ``2**-127`` (an fp32 subnormal), not to zero.
    """
    b = _as_uint8(scale, "scale", E8M0_DTYPES).to(torch.int32)
    v = _exp2i(b - E8M0_BIAS)
    return torch.where(b == E8M0_NAN_BYTE, torch.nan, v)


# ----------------------------------------------------------------------------- packing


def pack_codes(codes: torch.Tensor, element: str | ElementFormat) -> torch.Tensor:
    """Pack one-code-per-byte uint8 codes along the last axis.

    FP4: ``[..., k]`` -> ``[..., k/2]``, element ``2i`` in the low nibble of byte ``i``.
    FP6: ``[..., k]`` -> ``[..., 3k/4]``, AMD Quark's layout (module docstring).
    FP8: unchanged.

    Raises:
        ValueError: ``k`` does not fill whole bytes (odd for FP4, not a multiple of 4 for FP6).
    """
    fmt = get_element_format(element)
    codes = _as_uint8(codes, "codes", ())
    k = codes.shape[-1]
    fmt.packed_size(k)  # raises with a clear message when k does not fill whole bytes
    if fmt.nbits == 8:
        return codes.clone()
    if fmt.nbits == 4:
        c = codes.reshape(*codes.shape[:-1], k // 2, 2)
        return (c[..., 0] & 0xF) | torch.bitwise_left_shift(c[..., 1] & 0xF, 4)
    # four 6-bit codes c0..c3 fill the 24-bit word c0 | c1 << 6 | c2 << 12 | c3 << 18, stored low byte first;
    # each byte is formed in uint8 arithmetic (a left shift drops the bits that belong to the next byte)
    c = (codes.reshape(*codes.shape[:-1], k // 4, 4) & 0x3F).unbind(-1)
    out = torch.empty(*codes.shape[:-1], k // 4, 3, dtype=torch.uint8, device=codes.device)
    torch.bitwise_or(c[0], c[1] << 6, out=out[..., 0])
    torch.bitwise_or(c[1] >> 2, c[2] << 4, out=out[..., 1])
    torch.bitwise_or(c[2] >> 4, c[3] << 2, out=out[..., 2])
    return out.reshape(*codes.shape[:-1], 3 * k // 4)


def unpack_codes(packed: torch.Tensor, element: str | ElementFormat) -> torch.Tensor:
    """Inverse of ``pack_codes``: ``[..., packed_k]`` uint8 -> ``[..., k]`` uint8 codes.

    Raises:
        ValueError: an FP6 ``packed_k`` that is not a multiple of 3.
    """
    fmt = get_element_format(element)
    packed = _as_uint8(packed, "packed", packed_dtypes(fmt))
    pk = packed.shape[-1]
    if fmt.nbits == 8:
        return packed.clone()
    if fmt.nbits == 4:
        lo = packed & 0xF
        hi = torch.bitwise_right_shift(packed, 4)
        return torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], 2 * pk)
    if pk % 3 != 0:
        raise ValueError(f"packed: {fmt.name} data must have a last dimension divisible by 3, got {pk}")
    b = packed.reshape(*packed.shape[:-1], pk // 3, 3).unbind(-1)  # the 24-bit word b0 | b1 << 8 | b2 << 16
    out = torch.empty(*packed.shape[:-1], pk // 3, 4, dtype=torch.uint8, device=packed.device)
    torch.bitwise_and(b[0], 0x3F, out=out[..., 0])  # bits 0-5
    torch.bitwise_or(b[0] >> 6, (b[1] & 0xF) << 2, out=out[..., 1])  # bits 6-11
    torch.bitwise_or(b[1] >> 4, (b[2] & 0x3) << 4, out=out[..., 2])  # bits 12-17
    torch.bitwise_right_shift(b[2], 2, out=out[..., 3])  # bits 18-23
    return out.reshape(*packed.shape[:-1], 4 * pk // 3)


# ----------------------------------------------------------------------------- OCP MX


def _mx_blocks(x: torch.Tensor, block_size: int):
    k = x.shape[-1]
    return x.float().reshape(*x.shape[:-1], k // block_size, block_size)


def quantize_mx(
    x: torch.Tensor,
    element: str = "e2m1",
    block_size: int = MX_BLOCK_SIZE,
    scale_mode: str = "even",
    *,
    packed_dtype: torch.dtype = torch.uint8,
    scale_dtype: torch.dtype = torch.uint8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize to an OCP MX format: packed element codes and E8M0 scale bytes.

    Args:
        x: ``[..., k]`` float32 / bfloat16 / float16 (2D ``[m, k]`` or 3D ``[E, m, k]``).
        element: ``e2m1`` (MXFP4), ``e2m3`` / ``e3m2`` (MXFP6), ``e4m3`` / ``e5m2`` (MXFP8), or the
            torch dtype of one (``torch.float4_e2m1fn_x2``, ``torch.float8_e4m3fn``, ...).
        block_size: elements per shared scale along the last axis (OCP MX: 32).
        scale_mode: ``floor``, ``even`` (default, as Quark and vLLM) or ``rceil``; see ``e8m0_scale``.
            torchao's ``to_mx`` defaults to ``floor``: pass ``scale_mode="floor"`` for its bytes.
        packed_dtype: dtype of the returned data: ``torch.uint8`` (default), or a view as
            ``torch.float4_e2m1fn_x2`` (e2m1) / ``torch.float8_e4m3fn`` (e4m3) / ``torch.float8_e5m2``
            (e5m2); FP6 has no torch dtype.
        scale_dtype: ``torch.uint8`` (default) or ``torch.float8_e8m0fnu`` (a view of the same bytes).

    Returns:
        ``(packed, scale)`` (torchao's ``to_mx`` returns ``(scale, data)``, the other order):
        ``packed`` ``[..., k * bits / 8]`` (``pack_codes``), ``scale`` ``[..., k / block_size]``
        E8M0 bytes, ``2**(b - 127)``. Elements of a block whose scale is NaN (0xFF) are stored as code 0.

    Raises:
        TypeError: ``x`` is not float32/bfloat16/float16; a ``packed_dtype`` or ``scale_dtype`` that
            does not hold this format.
        ValueError: ``k`` is not a multiple of ``block_size``; ``block_size`` is not a power of
            two from 2 to 1024; unknown element or scale_mode.
    """
    fmt = get_element_format(element)
    get_scale_mode(scale_mode)
    check_storage_dtype(packed_dtype, packed_dtypes(fmt), "packed_dtype")
    check_storage_dtype(scale_dtype, E8M0_DTYPES, "scale_dtype")
    _check_float(x, "x")
    _check_block(x.shape[-1], block_size, "x")
    fmt.packed_size(block_size, "block_size")
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(math.prod(lead), k)
    packed = torch.empty(x2.shape[0], fmt.packed_size(k), dtype=torch.uint8, device=x.device)
    scale = torch.empty(x2.shape[0], k // block_size, dtype=torch.uint8, device=x.device)
    for rows in _row_chunks(x2.shape[0], k):
        xb = x2[rows].to(torch.float32, copy=True).reshape(-1, k // block_size, block_size)  # this chunk's own copy
        byte = e8m0_scale(xb.abs().amax(dim=-1), fmt, scale_mode)
        codes = encode_element(xb.div_(decode_e8m0(byte).unsqueeze(-1)), fmt)  # a NaN scale makes every x NaN
        if fmt.has_nan_code:  # NaN encodes as the NaN code: store code 0 instead (FP4 and FP6 encode NaN as +0)
            codes = codes.masked_fill_((byte == E8M0_NAN_BYTE).unsqueeze(-1), 0)
        packed[rows] = pack_codes(codes.reshape(-1, k), fmt)
        scale[rows] = byte
    packed = as_storage_dtype(packed.reshape(*lead, packed.shape[-1]), packed_dtype, packed_dtypes(fmt), "packed_dtype")
    return packed, as_storage_dtype(scale.reshape(*lead, scale.shape[-1]), scale_dtype, E8M0_DTYPES, "scale_dtype")


def dequantize_mx(
    packed: torch.Tensor,
    scale: torch.Tensor,
    element: str = "e2m1",
    block_size: int = MX_BLOCK_SIZE,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Dequantize OCP MX data: ``code_value * 2**(scale - 127)``, exact in fp32, one cast.

    Args:
        packed: uint8 ``[..., packed_k]`` as written by ``quantize_mx`` (or a Quark checkpoint), or
            the same bytes as ``torch.float4_e2m1fn_x2`` (e2m1) / ``torch.float8_e4m3fn`` /
            ``torch.float8_e5m2`` (torchao's ``to_mx`` data).
        scale: uint8 (or float8_e8m0fnu) ``[..., k / block_size]``.
        element, block_size: as for ``quantize_mx``.
        dtype: output dtype (float32, bfloat16 or float16).

    Returns:
        ``[..., k]`` tensor of ``dtype``; blocks with scale 0xFF are all NaN.

    Raises:
        TypeError: wrong dtypes. ValueError: ``scale``'s shape does not match ``packed``'s.
    """
    fmt, packed, scale, k = _mx_dequant_args(packed, scale, element, block_size, dtype)
    pk = packed.shape[-1]
    lead = packed.shape[:-1]
    n_rows = math.prod(lead)
    p2, s2 = packed.reshape(n_rows, pk), scale.reshape(n_rows, k // block_size)
    out = torch.empty(p2.shape[0], k, dtype=dtype, device=packed.device)
    for rows in _row_chunks(p2.shape[0], k):
        values = _decode_packed(p2[rows], fmt).reshape(-1, k // block_size, block_size)
        out[rows] = values.mul_(decode_e8m0(s2[rows]).unsqueeze(-1)).reshape(-1, k)  # one rounding to dtype
    return out.reshape(*lead, k)


def quant_dequant_mx(
    x: torch.Tensor,
    element: str = "e2m1",
    block_size: int = MX_BLOCK_SIZE,
    scale_mode: str = "even",
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """OCP MX quantize-then-dequantize (QDQ), without packing.

    Equal, bit for bit, to ``dequantize_mx(*quantize_mx(x, ...), ...)``.

    Args:
        x: ``[..., k]`` float32 / bfloat16 / float16.
        element, block_size, scale_mode: as for ``quantize_mx``.
        dtype: output dtype; ``None`` keeps ``x.dtype``.

    Returns:
        Tensor shaped like ``x``: every value is ``element value * 2**s`` rounded once
        to ``dtype``; blocks holding NaN or Inf are all NaN.
    """
    fmt = get_element_format(element)
    get_scale_mode(scale_mode)
    _check_float(x, "x")
    _check_block(x.shape[-1], block_size, "x")
    dtype = x.dtype if dtype is None else dtype
    _check_out_dtype(dtype)
    k = x.shape[-1]
    x2 = x.reshape(math.prod(x.shape[:-1]), k)
    out = torch.empty(x2.shape, dtype=dtype, device=x.device)
    for rows in _row_chunks(x2.shape[0], k):
        xb = _mx_blocks(x2[rows], block_size)
        scale = decode_e8m0(e8m0_scale(xb.abs().amax(dim=-1), fmt, scale_mode)).unsqueeze(-1)
        out[rows] = (round_to_element(xb / scale, fmt) * scale).reshape(-1, k).to(dtype)
    return out.reshape(x.shape)


# ----------------------------------------------------------------------------- NVFP4


def _recip(v: torch.Tensor) -> torch.Tensor:
    """vLLM's guarded reciprocal ``1 / (v + (v == 0) * 1e8)``."""
    return 1.0 / (v + (v == 0) * 1e8)


def _nvfp4_scale_and_multiplier(amax: torch.Tensor, gs: torch.Tensor, multiplier: str, target: float = _E2M1.max):
    # fp32(1/6) for the amax rule; 1/4 (exact) for 4/6's second candidate
    s = gs * (amax * torch.tensor(1.0 / target, dtype=torch.float32, device=amax.device))
    s = round_to_element(torch.clamp(s, -_E4M3.max, _E4M3.max), _E4M3)
    if multiplier == "reciprocal":
        q = _recip(s * _recip(gs))
    elif multiplier == "divide":
        q = torch.where(s == 0, 0.0, gs / torch.where(s == 0, 1.0, s))
    else:
        raise ValueError(f"multiplier: expected 'reciprocal' (the seed) or 'divide', got {multiplier!r}")
    return s, q


def _round_e2m1_signed_like_vllm(v: torch.Tensor) -> torch.Tensor:
    mag = round_to_element(v.abs(), _E2M1)
    return torch.where(v < 0, -mag, mag)


def ref_nvfp4_quant(
    x: torch.Tensor,
    global_scale: torch.Tensor | float,
    block_size: int = NVFP4_BLOCK_SIZE,
    multiplier: str = "reciprocal",
) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 quantization with vLLM's arithmetic (module docstring), values not packed.

    Args:
        x: ``[..., k]`` float32 / bfloat16 / float16 (2D ``[m, k]`` or 3D ``[E, m, k]``).
        global_scale: fp32 *encode* scale ``1 / input_scale``: one element, or one per
            leading index (``[E]`` for 3D, ``[m]`` for one scale per row); every value in
            ``[2**-126, 2**126]`` (finite, positive, finite normal reciprocal).
        block_size: 16 for NVFP4.
        multiplier: ``"reciprocal"`` (the seed, default) or ``"divide"`` (``gs / s``).

    Returns:
        ``(e2m1_values, block_scale)``: fp32 ``[..., k]`` values on the e2m1 grid and fp32
        ``[..., k / block_size]`` block scales on the e4m3 grid (vLLM ``ref_nvfp4_quant``).
    """
    _check_float(x, "x")
    _check_block(x.shape[-1], block_size, "x")
    gs = _global_scale_view(global_scale, x, "global_scale")
    xb = x.float().reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    s, q = _nvfp4_scale_and_multiplier(amax, gs, multiplier)
    e = _round_e2m1_signed_like_vllm(torch.clamp(xb * q, -_E2M1.max, _E2M1.max))
    return e.reshape(x.shape), s.squeeze(-1)


# The NVFP4 activation block rules (``block_rule=``): ``amax`` maps each block's amax to e2m1's 6
# (vLLM); ``four_over_six`` also tries 4 and keeps the candidate with the smaller squared error.
NVFP4_BLOCK_RULES = ("amax", "four_over_six")
FOUR_OVER_SIX_TARGET = 4.0


def _pairwise_block_sum(t: torch.Tensor) -> torch.Tensor:
    """fp32 sum over the last axis (a power of two) as a tree of pairs (0+1, 2+3, ...): each addition has
    two operands, so the order is fixed and the Triton twin (``_numerics.pairwise_block_sum``) is bit-equal."""
    while t.shape[-1] > 1:
        t = t[..., 0::2] + t[..., 1::2]
    return t.squeeze(-1)


def _nvfp4_qdq_blocks(xb: torch.Tensor, gs: torch.Tensor, multiplier: str, block_rule: str) -> torch.Tensor:
    """fp32 QDQ of NVFP4 blocks ``xb [..., nb, bs]`` by ``block_rule`` (vLLM's arithmetic per candidate)."""
    amax = xb.abs().amax(dim=-1, keepdim=True)
    dqs, errs = [], []
    for target in (_E2M1.max, FOUR_OVER_SIX_TARGET) if block_rule == "four_over_six" else (_E2M1.max,):
        s, q = _nvfp4_scale_and_multiplier(amax, gs, multiplier, target)
        e = _round_e2m1_signed_like_vllm(torch.clamp(xb * q, -_E2M1.max, _E2M1.max))
        dq = e * (s / gs)
        d = dq - xb
        dqs.append(dq)
        errs.append(_pairwise_block_sum(d * d))
    if len(dqs) == 1:
        return dqs[0]
    return torch.where((errs[1] < errs[0]).unsqueeze(-1), dqs[1], dqs[0])  # a tie (or NaN) keeps 6


def ref_nvfp4_quant_dequant(
    x: torch.Tensor,
    global_scale: torch.Tensor | float,
    block_size: int = NVFP4_BLOCK_SIZE,
    multiplier: str = "reciprocal",
    dtype: torch.dtype | None = None,
    check_scale: bool = True,
    block_rule: str = "amax",
) -> torch.Tensor:
    """NVFP4 QDQ of activations, vLLM's arithmetic (vLLM ``ref_nvfp4_quant_dequant``).

    ``dq = e2m1 * (block_scale / global_scale)`` in fp32, cast once to ``dtype``
    (default ``x.dtype``). Arguments as for ``ref_nvfp4_quant``: ``global_scale`` is the fp32
    *encode* scale ``1 / input_scale`` (about ``2688 / amax``; it multiplies ``x`` before the
    rounding), one element or one per leading index, the reciprocal of the checkpoint's decode
    ``input_scale``. ``dequantize_to_dtype``'s ``global_scale`` is a *decode* scale (vLLM names
    both ``global_scale``; docs/api-mapping.md has the table). ``check_scale=False``
    skips the value check of ``global_scale`` (a host synchronization for a device tensor),
    for callers that validated it once, such as the experts' forward; the check is also
    skipped during CUDA-graph capture.

    ``block_rule``: ``"amax"`` (default, vLLM's) or ``"four_over_six"`` (4/6 adaptive block
    scaling, Cook et al. arXiv 2512.02010): each block is also QDQ'd with its amax mapped to 4
    (``s4 = e4m3(gs * (amax * 0.25))``, ``q4`` and ``dq4`` as for 6), and 4 is kept where its fp32
    sum of squared errors, added as a tree of pairs (``_pairwise_block_sum``), is strictly smaller.
    The caller passes 4/6's global scale (``gs`` normalized to a block scale of 256, not 448:
    ``mxlib.moe.emulation``'s experts multiply their encode scale by 256 / 448).

    Raises:
        TypeError: ``x`` or ``global_scale`` of the wrong dtype.
        ValueError: ``k`` not a multiple of ``block_size``; ``block_size`` not a power of two
            from 2 to 1024; ``global_scale`` of the wrong shape or with a value outside
            ``[2**-126, 2**126]``.
    """
    _check_float(x, "x")
    _check_block(x.shape[-1], block_size, "x")
    dtype = x.dtype if dtype is None else dtype
    _check_out_dtype(dtype)
    gs = _global_scale_view(global_scale, x, "global_scale", check_scale)
    if block_rule not in NVFP4_BLOCK_RULES:
        raise ValueError(f"block_rule: expected one of {list(NVFP4_BLOCK_RULES)}, got {block_rule!r}")
    k = x.shape[-1]
    xb = x.float().reshape(*x.shape[:-1], k // block_size, block_size)
    if block_rule == "amax":  # vLLM's QDQ, as written there
        amax = xb.abs().amax(dim=-1, keepdim=True)
        s, q = _nvfp4_scale_and_multiplier(amax, gs, multiplier)
        e = _round_e2m1_signed_like_vllm(torch.clamp(xb * q, -_E2M1.max, _E2M1.max))
        return (e * (s / gs)).reshape(x.shape).to(dtype)
    return _nvfp4_qdq_blocks(xb, gs, multiplier, block_rule).reshape(x.shape).to(dtype)


def nvfp4_per_token_scales(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token dynamic NVFP4 activation scales: each row's (token's) own amax sets its global scale.

    For a row with amax ``a`` (max ``|x|`` over the whole last axis, in fp32)::

        per_token_scale = max(a * fp32(1 / (6 * 448)), 2**-126)   # decode scale, fp32 multiply
        global_scale    = 1 / per_token_scale                    # encode scale gs, correctly rounded

    The lower bound ``2**-126`` gives an all-zero row (and any row with ``a`` below about ``3.2e-35``) the
    encode scale ``2**126``: its blocks quantize to zeros, never NaN. A row holding NaN or +-Inf gets
    NaN for both scales: that token dequantizes to all NaN, and no other row is touched.

    Source: vLLM ``--quantization nvfp4_per_token`` (vllm-project/vllm#48538), which calls FlashInfer's
    ``nvfp4_quantize(a, 1.0 / (448.0 * 6.0), per_token_activation=True)``; its CUDA kernel
    (``nvfp4QuantAndPerTokenScaleKernel``) reduces the row amax, stores ``per_token_scale = amax *
    globalScaleInv`` (fp32 ``[M]``, the scale the MoE GEMM multiplies its output rows by) and
    quantizes the row with the encode scale ``rcp.approx.ftz(per_token_scale)``. Differences, each a
    choice made here: the reciprocal is the correctly rounded one (PTX ``rcp.approx`` may differ by an
    ulp and is not reproducible off the device); FlashInfer's ``fmaxf`` row reduction skips NaN and
    its zero row gives ``rcp(0) = Inf`` and NaN block scales (0 * Inf); the lower bound and the NaN rule
    above make both cases defined.

    Args:
        x: ``[..., k]`` float32 / bfloat16 / float16; rows along the last axis.

    Returns:
        ``(global_scale, per_token_scale)``, fp32, each of shape ``x.shape[:-1]``.

    Raises:
        TypeError: ``x`` not a float32 / bfloat16 / float16 tensor.
    """
    _check_float(x, "x")
    if x.shape[-1] == 0:
        amax = torch.zeros(x.shape[:-1], dtype=torch.float32, device=x.device)
    else:
        amax = x.float().abs().amax(dim=-1)  # NaN propagates
    inv = torch.tensor(1.0 / NVFP4_SCALE_DIVISOR, dtype=torch.float32, device=x.device)  # fp32(1/2688)
    ts = torch.clamp(amax * inv, min=GLOBAL_SCALE_MIN)
    ts = torch.where(torch.isfinite(amax), ts, torch.full_like(ts, math.nan))
    return 1.0 / ts, ts


def nvfp4_per_token_quant_dequant(
    x: torch.Tensor,
    block_size: int = NVFP4_BLOCK_SIZE,
    dtype: torch.dtype | None = None,
    numerics="vllm",
) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 QDQ of activations with per-token dynamic global scales (``nvfp4_per_token_scales``).

    Each row is QDQ'd exactly as ``ref_nvfp4_quant_dequant`` does with its own encode scale
    ``gs`` (block scale ``s = e4m3(clamp(gs * (amax_block * fp32(1/6)), -448, 448))``, multiplier
    ``recip(s * recip(gs))``, e2m1 elements), so the rules of the module docstring hold per row.

    ``numerics``: ``"vllm"`` returns ``e2m1 * (s / gs)`` (vLLM's emulation form, one fp32 product,
    one cast); ``"hardware"`` returns ``e2m1 * s`` (exact in bf16: an FP4 tensor-core operand) and
    leaves ``per_token_scale`` to multiply the GEMM's fp32 output rows, as FlashInfer's per-token MoE
    GEMMs do.

    Args:
        x: ``[..., k]`` float32 / bfloat16 / float16.
        block_size: 16 for NVFP4.
        dtype: output dtype (default ``x.dtype``).
        numerics: ``"vllm"`` or ``"hardware"`` (or a ``mxlib.formats.Numerics``).

    Returns:
        ``(dq [..., k] of dtype, per_token_scale fp32 x.shape[:-1])``.

    Raises:
        TypeError: ``x`` or ``dtype`` of the wrong dtype.
        ValueError: ``k`` not a multiple of ``block_size``; a bad ``block_size``; unknown ``numerics``.
    """
    _check_float(x, "x")
    _check_block(x.shape[-1], block_size, "x")
    dtype = x.dtype if dtype is None else dtype
    _check_out_dtype(dtype)
    hardware = get_numerics(numerics) is Numerics.HARDWARE
    gs, ts = nvfp4_per_token_scales(x)
    k = x.shape[-1]
    xb = x.float().reshape(*x.shape[:-1], k // block_size, block_size)
    g = gs[..., None, None]
    amax = xb.abs().amax(dim=-1, keepdim=True)
    s, q = _nvfp4_scale_and_multiplier(amax, g, "reciprocal")
    e = _round_e2m1_signed_like_vllm(torch.clamp(xb * q, -_E2M1.max, _E2M1.max))
    dq = e * s if hardware else e * (s / g)
    return dq.reshape(x.shape).to(dtype), ts


def compressed_tensors_nvfp4_quant_dequant(
    x: torch.Tensor, input_global_scale: torch.Tensor | float, block_size: int = NVFP4_BLOCK_SIZE
) -> torch.Tensor:
    """compressed-tensors' NVFP4 activation QDQ (``dynamic: "local"``), an oracle of the producer.

    Not vLLM's rule (``ref_nvfp4_quant_dequant``, what the emulation uses): the block amax and
    its division by 6 happen in ``x``'s dtype (bf16 rounding), then
    ``s = e4m3(min(gs * (amax / 6), 448))`` in fp32 with ``gs = input_global_scale`` (the encode
    scale as stored), ``s = 0 -> 0.125``; elements ``e2m1(clamp(x / (s / gs), -6, 6))`` (RNE; the
    step ``s / gs`` one fp32 division) and ``dq = e2m1 * (s / gs)`` in fp32, cast once to ``x.dtype``.
    Source: compressed-tensors 0.19 ``calculate_qparams`` (tensor_group, fp4) and ``_quantize_dequantize``.
    """
    _check_float(x, "x")
    _check_block(x.shape[-1], block_size, "x")
    gs = _global_scale_view(input_global_scale, x, "input_global_scale")
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    s = round_to_element(torch.clamp(gs * (amax / 6.0).float(), max=448.0), _E4M3)
    s = torch.where(s == 0, 0.125, s)
    step = s / gs
    scaled = torch.clamp(xb.float() / step, -6.0, 6.0)
    e = torch.where(scaled < 0, -round_to_element(scaled.abs(), _E2M1), round_to_element(scaled.abs(), _E2M1))
    return (e * step).reshape(x.shape).to(x.dtype)


def nvfp4_block_stats(
    x: torch.Tensor, global_scale: torch.Tensor | float, block_size: int = NVFP4_BLOCK_SIZE
) -> dict[str, torch.Tensor]:
    """What NVFP4 activation QDQ (vLLM's arithmetic) does to each block of ``x``; ``global_scale`` is
    the fp32 *encode* scale, as for ``ref_nvfp4_quant_dequant``.

    Returns tensors shaped ``[..., k / block_size]`` (``scale_code``, ``subnormal``,
    ``flushed``) and ``[..., k]`` (``clipped``):

    * ``scale_code``: the e4m3 code (0..126) of the block scale ``s``;
    * ``subnormal``: ``0 < s < 2**-6`` (the scale lost bits of precision to e4m3's subnormal range);
    * ``flushed``: ``s == 0`` although the block holds a nonzero value (the whole block became 0);
    * ``clipped``: the element's scaled magnitude ``|x * q|`` exceeded 6 and was clipped.
    """
    _check_float(x, "x")
    _check_block(x.shape[-1], block_size, "x")
    gs = _global_scale_view(global_scale, x, "global_scale")
    xb = x.float().reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    s, q = _nvfp4_scale_and_multiplier(amax, gs, "reciprocal")
    s = s.squeeze(-1)
    return {
        "scale_code": encode_element(s, _E4M3),
        "subnormal": (s > 0) & (s < _E4M3.min_normal),
        "flushed": (s == 0) & (amax.squeeze(-1) > 0),
        "clipped": ((xb * q).abs() > _E2M1.max).reshape(x.shape),
    }


def nvfp4_weight_scale_2(x: torch.Tensor) -> torch.Tensor:
    """ModelOpt's per-tensor NVFP4 decode scale: ``amax / (6 * 448)`` of each 2D matrix.

    Args:
        x: ``[E, n, k]`` float tensor (one matrix per expert).

    Returns:
        fp32 ``[E]``; an all-zero (or empty) matrix gets 1 instead of ModelOpt's 0/0; a tiny
        amax gets at least the smallest valid global scale ``2**-126``.
    """
    num, n, k = x.shape
    if n * k:
        flat = x.reshape(num, n * k)  # amax without an |x| temporary of the whole matrix
        amax = torch.maximum(flat.amax(dim=-1), flat.amin(dim=-1).neg()).float()
    else:
        amax = torch.zeros(num, dtype=torch.float32, device=x.device)
    ws2 = torch.where(amax > 0, _div(amax, NVFP4_SCALE_DIVISOR).clamp(min=GLOBAL_SCALE_MIN), torch.ones_like(amax))
    return ws2.contiguous()


def quantize_nvfp4(
    x: torch.Tensor,
    weight_scale_2: torch.Tensor | None = None,
    block_size: int = NVFP4_BLOCK_SIZE,
    zero_block_scale: str = "one",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize weights to NVFP4 the way NVIDIA ModelOpt exports them.

    Args:
        x: ``[n, k]`` or ``[E, n, k]`` weights (float32 / bfloat16 / float16), finite.
        weight_scale_2: fp32 *decode* global scale, one element or ``[E]``, every value in
            ``[2**-126, 2**126]``; ``None`` computes ``amax / (6 * 448)`` over each 2D matrix
            (each expert), raised to at least ``2**-126``. An all-zero (or empty) matrix
            gets ``1.0`` so that nothing becomes Inf or NaN.
        block_size: 16.
        zero_block_scale: block scale stored for an all-zero block: ``"one"``
            (ModelOpt's 1.0) or ``"zero"``.

    A block whose amax is so far below the matrix amax that its e4m3 scale rounds to
    zero (under ``2**-10``, i.e. amax_block < amax / 2**19 or so) stores zero codes;
    ModelOpt divides by that zero scale and stores +-6 codes there. Both dequantize
    to zeros.

    Returns:
        ``(weight, weight_scale, weight_scale_2)``: packed uint8 ``[..., k/2]``,
        float8_e4m3fn ``[..., k/16]`` and fp32 ``[]`` (2D) or ``[E]`` (3D), the tensors of a
        ModelOpt checkpoint.

    Raises:
        ValueError: non-finite weights, a bad ``zero_block_scale``, wrong shapes, a
            ``weight_scale_2`` value outside ``[2**-126, 2**126]``, a bad ``block_size``.
    """
    x3, ws2 = _nvfp4_weight_args(x, weight_scale_2, block_size, zero_block_scale)
    if ws2 is None:
        ws2 = nvfp4_weight_scale_2(x3)
    num, n, k = x3.shape
    packed = torch.empty(num, n, k // 2, dtype=torch.uint8, device=x.device)
    block_scale = torch.empty(num, n, k // block_size, dtype=torch.float8_e4m3fn, device=x.device)
    for ex in range(num):
        g = ws2[ex]
        for rows in _row_chunks(n, k):
            xb = x3[ex, rows].to(torch.float32, copy=True).reshape(-1, k // block_size, block_size)  # own copy
            bamax = xb.abs().amax(dim=-1)
            bs = bamax / (_E2M1.max * g)
            if zero_block_scale == "one":
                bs = torch.where(bs == 0, 1.0, bs)
            bs = round_to_element(bs, _E4M3)
            denom = (bs * g).unsqueeze(-1)
            zero = denom == 0
            scaled = xb.div_(torch.where(zero, 1.0, denom))  # xb is this chunk's own fp32 copy
            if bool(zero.any()):  # a block whose scale rounds to 0 stores +0 codes
                scaled.masked_fill_(zero, 0.0)
            codes = encode_e2m1_sign_magnitude(scaled)
            packed[ex, rows] = pack_codes(codes.reshape(-1, k), _E2M1)
            block_scale[ex, rows] = bs.to(torch.float8_e4m3fn)
    if x.ndim == 2:
        return packed[0], block_scale[0], ws2[0].clone()
    return packed, block_scale, ws2.clone()


def nvfp4_swizzle_scales(scale: torch.Tensor) -> torch.Tensor:
    """Linear ``[m, k/16]`` block scales to the cuBLAS/FlashInfer 128x4 swizzled layout.

    The result is padded to ``[ceil(m/128)*128, ceil((k/16)/4)*4]`` (padding zero) and
    flattened the same way: within each 128x4 tile, scale ``(r, c)`` sits at
    ``(r % 32) * 16 + (r // 32) * 4 + c``.
    """
    if scale.ndim != 2:
        raise ValueError(f"scale: expected 2D [m, k/16], got shape {list(scale.shape)}")
    m, kb = scale.shape
    mt, kt = -(-m // 128), -(-kb // 4)
    padded = torch.zeros(mt * 128, kt * 4, dtype=scale.dtype, device=scale.device)
    padded[:m, :kb] = scale
    tiles = padded.reshape(mt, 4, 32, kt, 4).permute(0, 3, 2, 1, 4)  # [mt, kt, 32, 4(r//32), 4(c)]
    return tiles.reshape(mt * 128, kt * 4)


def nvfp4_unswizzle_scales(scale: torch.Tensor, m: int, k: int, block_size: int = NVFP4_BLOCK_SIZE) -> torch.Tensor:
    """Inverse of ``nvfp4_swizzle_scales``: swizzled scales to linear ``[m, k/block_size]``."""
    kb = k // block_size
    mt, kt = -(-m // 128), -(-kb // 4)
    if scale.numel() != mt * 128 * kt * 4:
        raise ValueError(
            f"scale: a swizzled scale for m={m}, k={k} must have {mt * 128 * kt * 4} elements "
            f"(padded [{mt * 128}, {kt * 4}]), got {scale.numel()}"
        )
    tiles = scale.reshape(mt, kt, 32, 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(mt * 128, kt * 4)[:m, :kb]


def dequantize_to_dtype(
    tensor_fp4: torch.Tensor,
    tensor_sf: torch.Tensor,
    global_scale: torch.Tensor | float,
    dtype: torch.dtype,
    block_size: int = NVFP4_BLOCK_SIZE,
    swizzle: bool = False,
    check_scale: bool = True,
    global_scale_kind: str = "decode",
) -> torch.Tensor:
    """Dequantize NVFP4 data, vLLM's ``dequantize_to_dtype``.

    Args:
        tensor_fp4: packed uint8 (or ``torch.float4_e2m1fn_x2``) ``[m, k/2]`` or ``[E, m, k/2]``
            (even element in the low nibble).
        tensor_sf: float8_e4m3fn (or uint8 bytes of it) ``[m, k/16]`` / ``[E, m, k/16]``;
            with ``swizzle=True`` the 128x4 swizzled layout of a 2D matrix.
        global_scale: fp32 *decode* scale (ModelOpt ``weight_scale_2``, torchao's NVFP4
            ``per_tensor_scale``: ``amax / 2688``; it multiplies the codes): one element, or ``[E]``,
            every value in ``[2**-126, 2**126]``. Not the *encode* scale that the activation QDQ
            (``ref_nvfp4_quant_dequant``) calls ``global_scale``; ``global_scale_kind="encode"``
            takes an encode scale here.
        dtype: output dtype.
        block_size: 16.
        swizzle: whether ``tensor_sf`` is swizzled (MoE weights are linear: ``False``).
        check_scale: ``False`` skips the value check of ``global_scale`` (a host sync), for
            callers that validated it once; it is also skipped during CUDA-graph capture.
        global_scale_kind: ``"decode"`` (ModelOpt's ``weight_scale_2``, vLLM: multiply) or
            ``"encode"`` (compressed-tensors' ``weight_global_scale``, its reciprocal: the block
            scale is ``fp32(block_scale) / global_scale``, as compressed-tensors' ``_dequantize``
            computes ``scale / global_scale``; converting it to a decode scale first is not exact).

    Returns:
        ``[..., k]`` of ``dtype``: ``e2m1 * (fp32(block_scale) * global_scale)`` in fp32, one cast
        (``e2m1 * (fp32(block_scale) / global_scale)`` for an encode scale).

    Raises:
        TypeError / ValueError: wrong dtypes or shapes, a ``global_scale`` value outside
            ``[2**-126, 2**126]``, a bad ``block_size``, naming the argument.
    """
    fp4, sf, gs, k = nvfp4_dequant_args(
        tensor_fp4, tensor_sf, global_scale, dtype, block_size, swizzle, nvfp4_unswizzle_scales, check_scale
    )
    encode = check_global_scale_kind(global_scale_kind)
    num = gs.numel()
    f3 = fp4 if fp4.ndim == 3 else fp4.unsqueeze(0)
    s3 = sf if sf.ndim == 3 else sf.unsqueeze(0)
    m = f3.shape[1]
    out = torch.empty(num, m, k, dtype=dtype, device=fp4.device)
    for ex in range(num):
        for rows in _row_chunks(m, k):
            values = _decode_packed(f3[ex, rows], _E2M1).reshape(-1, k // block_size, block_size)
            sf32 = s3[ex, rows].view(torch.float8_e4m3fn).float()
            block = sf32 / gs[ex] if encode else sf32 * gs[ex]
            out[ex, rows] = values.mul_(block.unsqueeze(-1)).reshape(-1, k)  # one rounding to dtype
    return out if fp4.ndim == 3 else out[0]


GLOBAL_SCALE_KINDS = ("decode", "encode")


def check_global_scale_kind(kind: str) -> bool:
    """Whether an NVFP4 weight global scale of this kind is an encode scale (a divisor).

    Raises:
        ValueError: ``kind`` not ``"decode"`` or ``"encode"``.
    """
    if kind not in GLOBAL_SCALE_KINDS:
        raise ValueError(f"global_scale_kind: expected one of {list(GLOBAL_SCALE_KINDS)}, got {kind!r}")
    return kind == "encode"


# ----------------------------------------------------------------------------- NVFP4 variants


def _nvfp4_variant(scheme) -> BlockScheme:
    """The ``BlockScheme`` of an NVFP4 variant (``nvfp4_ue5m3``, ``nvfp4_b32``) or of NVFP4 itself."""
    s = get_block_scheme(scheme)
    if s.scale_is_power_of_two or s.element is not _E2M1:
        raise ValueError(
            f"scheme: expected e2m1 elements with a float block scale (nvfp4, {list(NVFP4_VARIANTS)}), got {s.name}"
        )
    return s


def nvfp4_variant_global_scale(x: torch.Tensor, scheme, two_level: bool | None = None) -> torch.Tensor | None:
    """The decode global scale an NVFP4-style scheme derives from ``x``: ``amax(x) / (6 * scale.max)``
    over each 2D matrix (``[E]`` for 3D ``x``, ``[]`` for 2D), as ``nvfp4_weight_scale_2`` with the scheme's
    block-scale maximum (448 for ue4m3, 114688 for ue5m3), over the finite values, clamped to
    ``[2**-126, 2**126]``, 1 for an all-zero matrix. ``two_level``: None follows the scheme (None for the
    one-level ``nvfp4_ue5m3``); True computes it for ``nvfp4_ue5m3`` too (the explicit two-level option)."""
    s = _nvfp4_variant(scheme)
    if not (s.has_global_scale if two_level is None else two_level):
        return None
    x3 = x if x.ndim == 3 else x.reshape(1, math.prod(x.shape[:-1]), x.shape[-1])  # an empty x too
    num = x3.shape[0]
    a = x3.detach().float().abs().reshape(num, x3.shape[1] * x3.shape[2])
    amax = torch.where(torch.isfinite(a), a, 0.0).amax(dim=-1) if a.shape[1] else a.new_zeros(num)
    div = torch.tensor(s.element.max * s.scale.element.max, dtype=torch.float32, device=x.device)
    g = torch.where(amax > 0, (amax / div).clamp(GLOBAL_SCALE_MIN, GLOBAL_SCALE_MAX), torch.ones_like(amax))
    return g if x.ndim == 3 else g[0]


def _variant_blocks(x: torch.Tensor, s: BlockScheme, global_scale):
    """fp32 blocks ``[..., nb, bs]``, the block scale values ``[..., nb]`` on the scale grid and the decode
    global scale broadcast to ``[..., 1]`` (ones for a one-level scheme)."""
    _check_float(x, "x")
    _check_block(x.shape[-1], s.block_size, "x")
    if global_scale is None:
        global_scale = nvfp4_variant_global_scale(x, s)
    if global_scale is None:
        g = torch.ones((), dtype=torch.float32, device=x.device)
    else:
        g = _global_scale_view(global_scale, x, "global_scale")
    xb = x.float().reshape(*x.shape[:-1], x.shape[-1] // s.block_size, s.block_size)
    amax = xb.abs().amax(dim=-1)
    bs = round_to_element(amax / (_E2M1.max * g.squeeze(-1)), s.scale.element)
    return xb, bs, g, global_scale


def _variant_elements(xb: torch.Tensor, bs: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x / (s * g)`` (0 where ``s * g`` is 0) and ``s * g``, both broadcast to the blocks."""
    denom = bs.unsqueeze(-1) * g
    return torch.where(denom == 0, 0.0, xb / torch.where(denom == 0, 1.0, denom)), denom


def quantize_nvfp4_variant(
    x: torch.Tensor, scheme, global_scale: torch.Tensor | float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Quantize to an NVFP4-style scheme: e2m1 elements, a float block scale (ue4m3 or ue5m3), an optional
    fp32 decode global scale. For ``nvfp4`` itself this is ``quantize_nvfp4``'s arithmetic with
    ``zero_block_scale="zero"``; it serves the variants ahead of hardware (``mxlib.formats.NVFP4_VARIANTS``).

    Arithmetic (fp32, ModelOpt's decode-scale form, used for weights and activations alike)::

        g  = global_scale                         # decode scale; 1 for a one-level scheme
        s  = scale_format(amax_block / (6 * g))   # RNE on the ue4m3 / ue5m3 grid, saturating
        e  = e2m1(x / (s * g))                    # RNE, saturating at 6; 0 where s * g == 0
        dq = e * (s * g)                          # (dequantize_nvfp4_variant), one cast

    ``global_scale``: None derives it (``nvfp4_variant_global_scale``: ``amax / (6 * scale.max)`` per 2D
    matrix) for a two-level scheme (``nvfp4``, ``nvfp4_b32``) and uses none for ``nvfp4_ue5m3``; a value
    (one element, ``[E]`` for 3D ``x``, or one per leading index) is used as given, for either kind, so that
    ue5m3 with a global scale is an explicit option. A NaN in a block makes its scale NaN (ue5m3 code 0xFF,
    e4m3 0x7F) and the block dequantizes to NaN; an Inf saturates the block scale to the format's max.

    Args:
        x: ``[..., k]`` float32 / bfloat16 / float16 (2D ``[m, k]`` or 3D ``[E, m, k]``).
        scheme: ``nvfp4_ue5m3``, ``nvfp4_b32`` or ``nvfp4`` (a name or a ``BlockScheme``).
        global_scale: fp32 decode scale(s) in ``[2**-126, 2**126]``, or None (above).

    Returns:
        ``(packed, block_scale, global_scale)``: uint8 ``[..., k/2]`` (even element in the low nibble),
        uint8 ``[..., k / block_size]`` block-scale codes (ue4m3: the e4m3 byte; ue5m3: the ue5m3 byte), and
        the fp32 global scale used (None where none was).

    Raises:
        TypeError / ValueError: a non-float ``x``; ``k`` not a multiple of the block size; a scheme that is
            not NVFP4-style; a ``global_scale`` of the wrong shape or outside ``[2**-126, 2**126]``.
    """
    s = _nvfp4_variant(scheme)
    xb, bs, g, used = _variant_blocks(x, s, global_scale)
    scaled, _ = _variant_elements(xb, bs, g)
    codes = encode_e2m1_sign_magnitude(scaled)
    packed = pack_codes(codes.reshape(*x.shape[:-1], x.shape[-1]), _E2M1)
    return packed, encode_element(bs, s.scale.element), used


def dequantize_nvfp4_variant(
    packed: torch.Tensor,
    block_scale: torch.Tensor,
    scheme,
    global_scale: torch.Tensor | float | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Dequantize ``quantize_nvfp4_variant``'s output: ``e2m1 * (s * g)`` in fp32, one cast to ``dtype``.

    Args:
        packed: uint8 ``[..., k/2]``; block_scale: uint8 codes ``[..., k / block_size]`` of the scheme's scale
            format; global_scale: the decode scale used at quantization, or None for none; dtype: output dtype.

    Raises:
        TypeError / ValueError: wrong dtypes or shapes, naming the argument.
    """
    s = _nvfp4_variant(scheme)
    _check_out_dtype(dtype)
    packed = _as_uint8(packed, "packed", packed_dtypes(_E2M1))
    block_scale = _as_uint8(block_scale, "block_scale", ())
    k = packed.shape[-1] * 2
    if block_scale.shape != (*packed.shape[:-1], k // s.block_size) or k % s.block_size:
        raise ValueError(
            f"block_scale: expected shape {[*packed.shape[:-1], k // s.block_size]} for packed "
            f"{list(packed.shape)} and block_size={s.block_size}, got {list(block_scale.shape)}"
        )
    values = decode_element(unpack_codes(packed, _E2M1), _E2M1)
    sv = decode_element(block_scale, s.scale.element)
    if global_scale is None:
        step = sv.unsqueeze(-1)
    else:
        step = sv.unsqueeze(-1) * _global_scale_view(global_scale, values, "global_scale")
    v = values.reshape(*packed.shape[:-1], k // s.block_size, s.block_size) * step
    return v.reshape(*packed.shape[:-1], k).to(dtype)


def quant_dequant_nvfp4_variant(
    x: torch.Tensor, scheme, global_scale: torch.Tensor | float | None = None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """QDQ in an NVFP4-style scheme without packing; bit for bit
    ``dequantize_nvfp4_variant(*quantize_nvfp4_variant(x, scheme, global_scale), scheme, ...)`` (arguments and
    rules as there). Returns a tensor shaped like ``x`` of ``dtype`` (default ``x.dtype``)."""
    s = _nvfp4_variant(scheme)
    dtype = x.dtype if dtype is None else dtype
    _check_out_dtype(dtype)
    xb, bs, g, _ = _variant_blocks(x, s, global_scale)
    scaled, denom = _variant_elements(xb, bs, g)
    mag = round_to_element(scaled.abs(), _E2M1)
    e = torch.where(scaled < 0, -mag, mag)  # the sign as quantize stores it: -0.0 in, +0 out
    e = torch.where(torch.isnan(scaled), 0.0, e)  # NaN has no e2m1 code: stored as 0 (the NaN scale carries it)
    return (e * denom).reshape(x.shape).to(dtype)


# ----------------------------------------------------------------------------- FP8 per tensor


def quant_dequant_fp8_per_tensor(
    x: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype | None = None, check_scale: bool = True
) -> torch.Tensor:
    """Static per-tensor FP8 e4m3 QDQ, vLLM's ``scaled_fp8_quant`` then dequantize.

    ``q = e4m3(clamp(x * (1 / scale), -448, 448))`` (RNE), ``dq = fp32(q) * scale``,
    cast once to ``dtype`` (default ``x.dtype``). ``scale`` is the checkpoint's
    ``input_scale`` (a decode scale, amax / 448), a positive fp32 scalar.

    ``check_scale=False`` skips the value check (a device synchronization), for callers that
    validated the scale once, such as the experts' forward; it is also skipped during
    CUDA-graph capture.

    Raises:
        ValueError: ``scale`` is not a single value in ``[2**-126, 2**126]`` (positive, finite,
            with a finite normal reciprocal: ``1 / scale`` multiplies every element).
    """
    scale, dtype = _fp8_args(x, scale, dtype, check_scale)
    inv = 1.0 / scale
    q = round_to_element(torch.clamp(x.float() * inv, -_FP8.max, _FP8.max), _FP8)
    return (q * scale).to(dtype)


# vLLM's smallest per-token FP8 scale (``min_scaling_factor``: 1 / (448 * 512)), so that an all-zero row divides by
# a positive number
FP8_MIN_TOKEN_SCALE = 1.0 / (_FP8.max * 512.0)


def quant_dequant_fp8_per_token(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Dynamic per-token FP8 e4m3 QDQ: vLLM's ``dynamic_per_token_scaled_fp8_quant`` then dequantize.

    Per row of ``x [..., k]``, all in fp32: ``scale = max(amax_row / 448, 1 / (448 * 512))``
    (``FP8_MIN_TOKEN_SCALE``), ``q = e4m3(clamp(x / scale, -448, 448))`` (RNE; a division, not a multiplication
    by the reciprocal: vLLM's kernel divides "so we can match FBGemm", ``csrc/quantization/w8a8/fp8/common.cu``),
    ``dq = fp32(q) * scale``, cast once to ``dtype`` (default ``x.dtype``). A row holding NaN gives NaN.

    Raises:
        TypeError: ``x`` not bf16 / fp16 / fp32.
    """
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"x: expected bfloat16, float16 or float32, got {x.dtype}")
    dtype = dtype or x.dtype
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True) if xf.shape[-1] else xf.new_zeros((*xf.shape[:-1], 1))
    scale = torch.clamp(amax / _FP8.max, min=FP8_MIN_TOKEN_SCALE)
    q = round_to_element(torch.clamp(xf / scale, -_FP8.max, _FP8.max), _FP8)
    return (q * scale).to(dtype)


def _fp8_weight_scale(weight_scale: torch.Tensor, out: int) -> torch.Tensor:
    s = weight_scale.float()
    if s.numel() == 1:
        return s.reshape(1, 1)
    if s.numel() == out:
        return s.reshape(out, 1)
    raise ValueError(
        f"weight_scale: expected one scale (per tensor) or {out} (per output channel), "
        f"got shape {list(weight_scale.shape)}"
    )


def quantize_fp8_weight(
    weight: torch.Tensor, per_channel: bool = False, quotient_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """An ``[out, in]`` weight in FP8 e4m3 with an fp32 decode scale per tensor or per output channel.

    ``weight_scale = amax / 448`` (of the tensor, or of each row), 1 where that amax is 0; codes
    ``e4m3(clamp(fp32(w) / weight_scale, -448, 448))`` (RNE), as ModelOpt's per-channel ``to_quantized_weight``
    and compressed-tensors' ``quantize`` (``x / scale``) for fp32 weights form them. ``quotient_dtype`` (bf16 / fp16)
    rounds the fp32 quotient to that dtype first, then to e4m3: nvidia-modelopt's per-tensor export
    (``to_quantized_weight``: ``(weight / weights_scaling_factor).to(float8_e4m3fn)`` with a bf16 weight and a 0-d
    fp32 scale, which torch computes in fp32 and rounds to the weight's dtype), checked against its own export in
    ``tests/test_interop_mixed_modelopt.py``. compressed-tensors rounds the scale as well as the quotient to a bf16
    weight's dtype: ``mxlib.checkpoints.layouts.fp8_linear.quantize_fp8_in_weight_dtype``.

    Returns:
        ``(codes uint8 [out, in] (e4m3 bytes), weight_scale fp32 [] or [out])``.

    Raises:
        ValueError: ``weight`` not 2-D; TypeError: not a float dtype, or a ``quotient_dtype`` other than bf16 /
        fp16 / fp32 / None.
    """
    if quotient_dtype not in (None, torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"quotient_dtype: expected bfloat16, float16, float32 or None, got {quotient_dtype!r}")
    if weight.ndim != 2:
        raise ValueError(f"weight: expected [out, in], got shape {list(weight.shape)}")
    if not weight.is_floating_point():
        raise TypeError(f"weight: expected a float dtype, got {weight.dtype}")
    w = weight.float()
    if w.numel() == 0:  # an empty weight: scale 1, as for an all-zero one
        amax = torch.zeros(w.shape[0] if per_channel else (), dtype=torch.float32, device=w.device)
    else:
        amax = w.abs().amax(dim=1) if per_channel else w.abs().amax()
    scale = torch.where(amax > 0, amax / _FP8.max, torch.ones_like(amax))
    div = scale.reshape(-1, 1) if per_channel else scale
    q = w / div
    if quotient_dtype is not None:
        q = q.to(quotient_dtype).float()
    codes = round_to_element(torch.clamp(q, -_FP8.max, _FP8.max), _FP8).to(torch.float8_e4m3fn)
    return codes.view(torch.uint8), scale


def dequantize_fp8_weight(codes: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``fp32(e4m3 codes) * fp32(weight_scale)`` (a scale per tensor, ``numel() == 1``, or per output channel,
    ``numel() == out``), cast once to ``dtype``.

    Args:
        codes: uint8 or float8_e4m3fn ``[out, in]``; weight_scale: fp32 (or bf16 / fp16, widened exactly).

    Raises:
        ValueError: a ``weight_scale`` of another size, naming its shape.
    """
    e4m3 = codes.view(torch.float8_e4m3fn) if codes.dtype == torch.uint8 else codes
    return (e4m3.float() * _fp8_weight_scale(weight_scale, codes.shape[0])).to(dtype)


# ----------------------------------------------------------------------------- dispatch


def quant_dequant(x: torch.Tensor, scheme: str, global_scale=None, **kwargs) -> torch.Tensor:
    """QDQ of one tensor by block-format name: ``mxfp4``, ``mxfp6_e2m3``, ``mxfp6_e3m2``, ``mxfp8_e4m3``,
    ``mxfp8_e5m2`` (keyword ``scale_mode``, default ``even``), or ``nvfp4`` (``global_scale``: the
    fp32 *encode* scale ``1 / input_scale`` of ``ref_nvfp4_quant_dequant``; ``None`` uses
    ``2688 / amax(x)``, the value calibration on ``x`` gives), or an NVFP4 variant ahead of hardware
    (``nvfp4_ue5m3``, ``nvfp4_b32``: ``quant_dequant_nvfp4_variant``, whose ``global_scale`` is a *decode*
    scale; ``None`` derives one for ``nvfp4_b32`` and uses none for ``nvfp4_ue5m3``).

    ``scheme`` names how this one tensor is stored (``mxlib.formats.BLOCK_SCHEMES``), not a MoE
    scheme: ``mxfp4`` here is the MXFP4 format, whatever quantizes the other tensors of a layer.

    Args:
        x: ``[..., k]`` float32 / bfloat16 / float16, ``k`` a multiple of the format's block size.
        kwargs: passed to ``quant_dequant_mx`` (``scale_mode``, ``dtype``) or
            ``ref_nvfp4_quant_dequant`` (``multiplier``, ``dtype``, ``check_scale``).

    Returns:
        Tensor shaped like ``x`` (dtype ``x.dtype`` unless ``dtype`` is given).

    The derived NVFP4 scale takes ``amax`` over the *finite* values of ``x`` only, so one
    Inf or NaN spoils only its own block (the Inf rule of ``ref_nvfp4_quant_dequant``), not
    the whole tensor; it is clamped to ``[2**-126, 2**126]``; with no nonzero finite value
    (all zero, all Inf/NaN, or empty) it is 1.

    Raises:
        ValueError: unknown format name; ``global_scale`` given for an OCP MX format.
    """
    s = get_block_scheme(scheme)
    if s.name in NVFP4_VARIANTS:
        return quant_dequant_nvfp4_variant(x, s, global_scale, **kwargs)
    if s.has_global_scale:
        if global_scale is None:
            a = x.detach().float().abs()
            amax = torch.where(torch.isfinite(a), a, 0.0).amax() if a.numel() else a.new_zeros(())
            divisor = torch.tensor(s.scale_divisor, dtype=torch.float32, device=amax.device)
            derived = (divisor / amax).clamp(GLOBAL_SCALE_MIN, GLOBAL_SCALE_MAX)
            global_scale = torch.where(amax > 0, derived, torch.ones_like(amax))
        return ref_nvfp4_quant_dequant(x, global_scale, s.block_size, **kwargs)
    if global_scale is not None:
        raise ValueError(f"global_scale applies to nvfp4 only, not {s.name}")
    return quant_dequant_mx(x, s.element.name, s.block_size, **kwargs)
