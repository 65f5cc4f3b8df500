"""One table of the microscaling element, scale and scheme formats.

Every number the rest of mxlib uses (bias, largest finite value, emax, smallest
normal and subnormal, packing ratio) is derived here once from the bit layout
and checked against the literal values of the OCP MX v1.0 specification
(section 5.3, tables 1-3) in ``tests/test_formats.py``.

Element formats (all: round to nearest, ties to even, saturating to +-max):

========  ====  ====  ====  ========  ===========  ==============  =====================
name      bits  bias  emax  max       min normal   min subnormal   special codes
========  ====  ====  ====  ========  ===========  ==============  =====================
e2m1      4     1     2     6.0       1.0          0.5             none (code 8 is -0)
e2m3      6     1     2     7.5       1.0          0.125           none
e3m2      6     3     4     28.0      0.25         0.0625          none
e4m3      8     7     8     448.0     2**-6        2**-9           S.1111.111 is NaN, no Inf
e5m2      8     15    15    57344.0   2**-14       2**-16          IEEE-like Inf and NaN
========  ====  ====  ====  ========  ===========  ==============  =====================

Scale formats:

* ``e8m0``: the OCP MX shared scale. An unsigned biased exponent, value
  ``2**(byte - 127)``; byte 0xFF is NaN; there is no zero and no Inf; byte 0
  is ``2**-127`` (an fp32 subnormal, *not* zero).
* ``ue4m3``: NVFP4's block scale, an e4m3 value that is non-negative in
  practice, combined with one fp32 global scale per tensor (per expert in MoE).
* ``ue5m3``: an unsigned 8-bit float (``UE5M3``: no sign bit, 5 exponent bits, bias 15, 3 mantissa
  bits), the block scale of NVFP4 on hardware after Blackwell: largest value ``0xFE = 1.75 * 2**16 =
  114688``, smallest normal ``2**-14``, smallest subnormal ``2**-17``, ``0xFF`` its only NaN, no Inf;
  round to nearest, ties to even, saturating (PTX ISA "alternate floating-point data formats";
  TransformerEngine#3325; AutoRound's ``NVFP4_E5M3``, intel/auto-round#2123 and #2302).

Schemes (the block formats a tensor is stored in): ``mxfp4``, ``mxfp6_e2m3``,
``mxfp6_e3m2``, ``mxfp8_e4m3``, ``mxfp8_e5m2`` (E8M0 scale per 32 elements)
and ``nvfp4`` (ue4m3 scale per 16 elements plus an fp32 global scale). NVFP4 variants ahead of
hardware (``NVFP4_VARIANTS``, emulated before any GPU runs them): ``nvfp4_ue5m3`` (ue5m3 scale per 16
elements, no global scale) and ``nvfp4_b32`` (ue4m3 scale per 32 elements plus the global scale).

Per-tensor formats: ``fp8_e4m3`` (one static fp32 decode scale ``amax / 448`` per
tensor, vLLM's ``scaled_fp8_quant``), the activation format of Quark's ``_a_fp8``
schemes and the weight and activation format of FP8 linear layers (a weight scale per tensor
or per output channel); ``fp8_e4m3_per_token`` (a scale per row from its amax, at run time),
vLLM's dynamic per-token FP8 activations.

Numerics (``Numerics``, ``numerics=`` of the emulation experts and the FP4 kernel): ``vllm``
(vLLM's emulation arithmetic) or ``hardware`` (what an FP4 tensor-core GEMM computes); resolved
once where a name enters (``get_numerics``).

Derived constants, computed here once from the table: ``NVFP4_SCALE_DIVISOR``
(``e2m1.max * e4m3.max = 6 * 448 = 2688``: ModelOpt's ``weight_scale_2`` and
``input_scale`` are ``amax / 2688``), ``FP8_SCALE_DIVISOR`` (``e4m3.max = 448``), and the two
thresholds of NVFP4 block scales under a global scale shared by tensors of different amax
(``r`` = a tensor's own decode scale over the shared one): ``NVFP4_SUBNORMAL_RATIO``
(``e4m3.min_normal / e4m3.max = 2**-6 / 448``; below it even the largest block scale is an e4m3
subnormal) and ``NVFP4_FLUSH_RATIO`` (``e4m3.min_subnormal / 2 / e4m3.max = 2**-10 / 448``;
below it every block scale rounds to zero and the whole tensor is flushed).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from fractions import Fraction

__all__ = [
    "ElementFormat",
    "ScaleFormat",
    "BlockScheme",
    "PerTensorScheme",
    "PER_TENSOR_SCHEMES",
    "FP8_E4M3_PER_TENSOR",
    "FP8_E4M3_PER_TOKEN",
    "NVFP4",
    "NVFP4_VARIANTS",
    "NVFP4_UE5M3",
    "NVFP4_B32",
    "UE5M3",
    "NVFP4_SCALE_DIVISOR",
    "NVFP4_SUBNORMAL_RATIO",
    "NVFP4_FLUSH_RATIO",
    "FP8_SCALE_DIVISOR",
    "SPECIALS",
    "get_activation_format",
    "ELEMENT_FORMATS",
    "SCALE_FORMATS",
    "BLOCK_SCHEMES",
    "SCALE_MODES",
    "E8M0_BIAS",
    "E8M0_NAN_BYTE",
    "MX_BLOCK_SIZE",
    "NVFP4_BLOCK_SIZE",
    "get_element_format",
    "DTYPE_ELEMENT_FORMATS",
    "get_block_scheme",
    "get_scale_mode",
    "scale_mode_id",
    "Numerics",
    "get_numerics",
]

E8M0_BIAS = 127
E8M0_NAN_BYTE = 0xFF
MX_BLOCK_SIZE = 32
NVFP4_BLOCK_SIZE = 16

# How an E8M0 block scale is chosen from the block's amax; see mxlib.reference.e8m0_scale.
SCALE_MODES: dict[str, str] = {
    "floor": "OCP MX v1.0 section 6.3: 2**(floor(log2(amax)) - emax)",
    "even": "AMD Quark / vLLM MX emulation: round amax to the element's mantissa width "
    "(half an ulp added to its fp32 bits, mantissa dropped), then floor rule",
    "rceil": "NVIDIA hardware (cvt.rp ue8m0), cuBLAS, triton_kernels: 2**ceil(log2(amax / max))",
}


# Kinds of special codes an element format has; a format's ``specials_id`` is the index here
# (the integer the Triton kernels take as their ``SPECIALS`` constexpr).
SPECIALS = ("none", "fn", "ieee")


@dataclass(frozen=True)
class ElementFormat:
    """A sign-exponent-mantissa element format.

    ``specials`` says which codes are not finite numbers:
    ``"none"`` (FP4 and FP6: every code is a number), ``"fn"`` (e4m3fn: only
    S.1111.111 is NaN, no Inf) or ``"ieee"`` (e5m2: the all-ones exponent is
    Inf or NaN). ``signed=False`` is an unsigned format (``ue5m3``): no sign bit, ``nbits`` is
    ``ebits + mbits``, and rounding clamps negative values to zero.
    ``ml_dtypes_name`` is None for a format ml_dtypes does not have (``ue5m3``).
    """

    name: str
    ebits: int
    mbits: int
    specials: str
    ml_dtypes_name: str | None
    aliases: tuple[str, ...] = ()
    signed: bool = True
    # derived in __post_init__
    nbits: int = field(init=False)
    bias: int = field(init=False)
    max: float = field(init=False)
    emax: int = field(init=False)
    min_normal: float = field(init=False)
    min_subnormal: float = field(init=False)
    num_codes: int = field(init=False)
    specials_id: int = field(init=False)

    def __str__(self) -> str:
        return self.name

    def __post_init__(self) -> None:
        if self.specials not in SPECIALS:
            raise ValueError(f"specials must be one of {list(SPECIALS)}, got {self.specials!r}")
        bias = 2 ** (self.ebits - 1) - 1
        top_exp = 2**self.ebits - 1
        top_mant = 2**self.mbits - 1
        if self.specials == "fn":
            top_mant -= 1  # S.1111.111 is NaN
        elif self.specials == "ieee":
            top_exp -= 1  # the all-ones exponent is Inf/NaN
        max_value = Fraction(2) ** (top_exp - bias) * (1 + Fraction(top_mant, 2**self.mbits))
        set_ = object.__setattr__
        set_(self, "nbits", int(self.signed) + self.ebits + self.mbits)
        set_(self, "bias", bias)
        set_(self, "max", float(max_value))
        set_(self, "emax", math.floor(math.log2(max_value)))
        set_(self, "min_normal", 2.0 ** (1 - bias))
        set_(self, "min_subnormal", 2.0 ** (1 - bias - self.mbits))
        set_(self, "num_codes", 2**self.nbits)
        set_(self, "specials_id", SPECIALS.index(self.specials))

    @property
    def has_nan_code(self) -> bool:
        """Whether some code is NaN (e4m3fn: S.1111.111; e5m2: the all-ones exponent with a
        non-zero mantissa). FP4 and FP6 have none: every code is a number."""
        return self.specials != "none"

    @property
    def has_inf(self) -> bool:
        """Whether the format encodes Inf (e5m2 only: all-ones exponent, zero mantissa)."""
        return self.specials == "ieee"

    @property
    def nan_code(self) -> int | None:
        """The positive NaN code a NaN encodes to (the sign bit is kept on top of it), or None.

        e4m3fn: ``0x7F`` (the one NaN magnitude); e5m2: ``0x7E`` (all-ones exponent, the top
        mantissa bit set: the quiet NaN, as ml_dtypes and vLLM encode it).
        """
        if self.specials == "fn":
            return 2 ** (self.ebits + self.mbits) - 1
        if self.specials == "ieee":
            return (2**self.ebits - 1) << self.mbits | (1 << (self.mbits - 1))
        return None

    @property
    def elements_per_byte(self) -> Fraction:
        """Packed elements per byte: 2 for FP4, 4/3 for FP6, 1 for FP8."""
        return Fraction(8, self.nbits)

    def packed_size(self, k: int, what: str = "k") -> int:
        """Bytes that ``k`` packed elements take (``k`` must fill whole bytes).

        ``what``: the argument ``k`` is, for the message (``block_size`` where a block must pack alone).

        Raises:
            ValueError: ``k`` elements do not fill whole bytes, naming ``what``, its value and the multiple needed.
        """
        bits = k * self.nbits
        if bits % 8:
            raise ValueError(
                f"{self.name}: {what}={k} elements do not fill whole bytes; {what} must be a multiple of "
                f"{8 // math.gcd(8, self.nbits)} ({self.nbits}-bit elements)"
            )
        return bits // 8

    def code_value(self, code: int) -> float:
        """The value of one code, straight from the bit fields (``nan``/``inf`` for specials)."""
        if not 0 <= code < self.num_codes:
            raise ValueError(f"{self.name}: code must be in [0, {self.num_codes}), got {code}")
        sign = -1.0 if self.signed and code >> (self.ebits + self.mbits) else 1.0
        exp_field = (code >> self.mbits) & (2**self.ebits - 1)
        mant = code & (2**self.mbits - 1)
        if self.specials == "fn" and exp_field == 2**self.ebits - 1 and mant == 2**self.mbits - 1:
            return math.nan
        if self.specials == "ieee" and exp_field == 2**self.ebits - 1:
            return sign * math.inf if mant == 0 else math.nan
        if exp_field == 0:
            return sign * mant * self.min_subnormal
        return sign * 2.0 ** (exp_field - self.bias) * (1 + mant / 2**self.mbits)

    def values(self) -> list[float]:
        """All ``num_codes`` code values in code order."""
        return [self.code_value(c) for c in range(self.num_codes)]


@dataclass(frozen=True)
class ScaleFormat:
    """A block-scale format: ``e8m0`` (power of two) or ``ue4m3`` (an e4m3 value, ``element``)."""

    name: str
    nbits: int
    description: str
    element: ElementFormat | None = None

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class BlockScheme:
    """A block-scaled storage scheme: element format, block size and scale format.

    ``has_global_scale``: NVFP4's two-level scaling (an fp32 scale per tensor / expert on top
    of the block scales); for activations that global scale is static (a checkpoint's
    ``input_scale``), so ``static_scale`` is the same flag. ``scale_divisor``: the divisor
    from amax to that decode scale (``element.max * scale.element.max``, 2688 for NVFP4), or
    None for OCP MX (dynamic E8M0 scales only).
    """

    name: str
    element: ElementFormat
    block_size: int
    scale: ScaleFormat
    has_global_scale: bool
    scale_divisor: float | None = field(init=False)

    def __post_init__(self) -> None:
        div = self.element.max * self.scale.element.max if self.has_global_scale else None
        object.__setattr__(self, "scale_divisor", div)

    def __str__(self) -> str:
        return self.name

    @property
    def scale_is_power_of_two(self) -> bool:
        """Whether the block scale is E8M0 (OCP MX), as opposed to a float scale (ue4m3, ue5m3)."""
        return self.scale.element is None

    @property
    def static_scale(self) -> bool:
        """Whether an activation in this format needs a calibrated (checkpoint) scale."""
        return self.has_global_scale

    @property
    def bits_per_element(self) -> float:
        """Storage bits per element, block scales (and no global scale) included."""
        return self.element.nbits + self.scale.nbits / self.block_size


ELEMENT_FORMATS: dict[str, ElementFormat] = {
    f.name: f
    for f in (
        ElementFormat("e2m1", 2, 1, "none", "float4_e2m1fn", aliases=("fp4", "fp4_e2m1")),
        ElementFormat("e2m3", 2, 3, "none", "float6_e2m3fn", aliases=("fp6_e2m3",)),
        ElementFormat("e3m2", 3, 2, "none", "float6_e3m2fn", aliases=("fp6_e3m2",)),
        ElementFormat("e4m3", 4, 3, "fn", "float8_e4m3fn", aliases=("fp8_e4m3", "fp8", "e4m3fn")),
        ElementFormat("e5m2", 5, 2, "ieee", "float8_e5m2", aliases=("fp8_e5m2",)),
    )
}

# UE5M3: an unsigned 8-bit float, 5 exponent bits (bias 15) and 3 mantissa bits, no sign bit. Code 0xFF is its
# only NaN, there is no Inf; the largest value is 0xFE = 2**16 * 1.75 = 114688, the smallest normal 2**-14 (0x08),
# the smallest subnormal 2**-17 (0x01); conversions round to nearest, ties to even, and saturate. Sources: the PTX
# ISA's "alternate floating-point data formats" (ue5m3: no infinity, NaN only 0xFF; as quoted in
# MurrellGroup/Microfloats.jl#29), NVIDIA TransformerEngine#3325 (``kFloat8UE5M3`` NVFP4 block scales), and
# AutoRound's ``float_to_e5m3_frexp`` / ``FLOAT8_UE5M3_MAX = 114688`` (intel/auto-round#2123, #2302).
UE5M3: ElementFormat = ElementFormat("ue5m3", 5, 3, "fn", None, signed=False)

SCALE_FORMATS: dict[str, ScaleFormat] = {
    "e8m0": ScaleFormat("e8m0", 8, "unsigned power of two 2**(b-127), 0xFF is NaN"),
    "ue4m3": ScaleFormat("ue4m3", 8, "non-negative e4m3 value, with an fp32 global scale", ELEMENT_FORMATS["e4m3"]),
    "ue5m3": ScaleFormat("ue5m3", 8, "unsigned e5m3 value (bias 15, max 114688), 0xFF is NaN", UE5M3),
}

BLOCK_SCHEMES: dict[str, BlockScheme] = {
    s.name: s
    for s in (
        BlockScheme("mxfp4", ELEMENT_FORMATS["e2m1"], MX_BLOCK_SIZE, SCALE_FORMATS["e8m0"], False),
        BlockScheme("mxfp6_e2m3", ELEMENT_FORMATS["e2m3"], MX_BLOCK_SIZE, SCALE_FORMATS["e8m0"], False),
        BlockScheme("mxfp6_e3m2", ELEMENT_FORMATS["e3m2"], MX_BLOCK_SIZE, SCALE_FORMATS["e8m0"], False),
        BlockScheme("mxfp8_e4m3", ELEMENT_FORMATS["e4m3"], MX_BLOCK_SIZE, SCALE_FORMATS["e8m0"], False),
        BlockScheme("mxfp8_e5m2", ELEMENT_FORMATS["e5m2"], MX_BLOCK_SIZE, SCALE_FORMATS["e8m0"], False),
        BlockScheme("nvfp4", ELEMENT_FORMATS["e2m1"], NVFP4_BLOCK_SIZE, SCALE_FORMATS["ue4m3"], True),
    )
}

NVFP4: BlockScheme = BLOCK_SCHEMES["nvfp4"]

# NVFP4 variants ahead of hardware: e2m1 elements like NVFP4, another scale format or block size. Kept out of
# ``BLOCK_SCHEMES`` (the formats the checkpoints and kernels take); ``get_block_scheme`` finds them by name.
#   nvfp4_ue5m3: ue5m3 block scales per 16 elements, one level (no global scale: ue5m3's range, 2**-17 to
#                114688, holds a block scale of amax / 6 for any amax from about 1e-5 to 6.9e5); a global
#                scale stays an explicit option of the reference functions (``mxlib.reference.quantize_nvfp4_variant``).
#   nvfp4_b32:   NVFP4 with 32-element blocks (ue4m3 scale, fp32 global scale), the block size of OCP MX.
NVFP4_VARIANTS: dict[str, BlockScheme] = {
    s.name: s
    for s in (
        BlockScheme("nvfp4_ue5m3", ELEMENT_FORMATS["e2m1"], NVFP4_BLOCK_SIZE, SCALE_FORMATS["ue5m3"], False),
        BlockScheme("nvfp4_b32", ELEMENT_FORMATS["e2m1"], MX_BLOCK_SIZE, SCALE_FORMATS["ue4m3"], True),
    )
}
NVFP4_UE5M3: BlockScheme = NVFP4_VARIANTS["nvfp4_ue5m3"]
NVFP4_B32: BlockScheme = NVFP4_VARIANTS["nvfp4_b32"]
# amax -> NVFP4 decode global scale (ModelOpt weight_scale_2 / input_scale): amax / (6 * 448)
NVFP4_SCALE_DIVISOR: float = NVFP4.scale_divisor

# NVFP4 block scales under one global scale shared by tensors of different amax (vLLM's single
# activation global scale for all experts, the max of their input scales). A tensor whose own
# decode scale is ``r`` times the shared one (r = own input_scale / shared input_scale, in (0, 1])
# gets block scales of at most ``e4m3.max * r`` (448 * r). They are e4m3 subnormals (fewer
# significant bits) once that is below e4m3's smallest normal, and round to zero (the block is
# flushed: its QDQ output is all zero) once it is at most half of e4m3's smallest subnormal (the
# tie rounds to the even code 0). Smaller blocks of the tensor cross both thresholds earlier.
NVFP4_SUBNORMAL_RATIO: float = NVFP4.scale.element.min_normal / NVFP4.scale.element.max
"""``2**-6 / 448``: below this ratio ``r`` even a tensor's largest NVFP4 block scale is an e4m3 subnormal."""
NVFP4_FLUSH_RATIO: float = NVFP4.scale.element.min_subnormal / 2 / NVFP4.scale.element.max
"""``2**-10 / 448``: below this ratio ``r`` even a tensor's largest NVFP4 block scale rounds to zero (all flushed)."""


@dataclass(frozen=True)
class PerTensorScheme:
    """One fp32 decode scale for a whole tensor (``scale = amax / element.max``), or for each of its rows.

    ``fp8_e4m3``: vLLM's ``scaled_fp8_quant``, ``e4m3(clamp(x / scale))`` with one static scale; the activation
    format of Quark's ``_a_fp8`` schemes (the checkpoint's ``input_scale``) and of FP8 linear layers, and the
    weight format of FP8 linear layers (their ``weight_scale``: one per tensor, or one per output channel).
    ``fp8_e4m3_per_token``: the same element, a scale per token (row) computed at run time from the row's
    amax (``static_scale`` False): vLLM's dynamic per-token FP8 activations.

    No blocks, no global scale: ``block_size`` None, ``has_global_scale`` and ``scale_is_power_of_two`` False,
    as a ``BlockScheme`` says them.
    """

    name: str
    element: ElementFormat
    static_scale: bool = True
    scale_divisor: float = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "scale_divisor", self.element.max)

    def __str__(self) -> str:
        return self.name

    block_size = None
    has_global_scale = False
    scale_is_power_of_two = False

    @property
    def per_token(self) -> bool:
        """Whether the scale is per token, computed at run time (not a checkpoint's static scale)."""
        return not self.static_scale

    @property
    def bits_per_element(self) -> float:
        """Storage bits per element (the per-tensor or per-channel scale is not counted)."""
        return float(self.element.nbits)


PER_TENSOR_SCHEMES: dict[str, PerTensorScheme] = {
    s.name: s
    for s in (
        PerTensorScheme("fp8_e4m3", ELEMENT_FORMATS["e4m3"]),
        PerTensorScheme("fp8_e4m3_per_token", ELEMENT_FORMATS["e4m3"], static_scale=False),
    )
}
FP8_E4M3_PER_TENSOR: PerTensorScheme = PER_TENSOR_SCHEMES["fp8_e4m3"]
FP8_E4M3_PER_TOKEN: PerTensorScheme = PER_TENSOR_SCHEMES["fp8_e4m3_per_token"]
# amax -> static FP8 decode scale (input_scale): amax / 448
FP8_SCALE_DIVISOR: float = FP8_E4M3_PER_TENSOR.scale_divisor

_ELEMENT_ALIASES = {alias: f for f in ELEMENT_FORMATS.values() for alias in (f.name, *f.aliases)}


# torch and ml_dtypes dtype names of the element formats. torch stores FP4 two codes a byte as
# ``float4_e2m1fn_x2`` (the even element in the low nibble, as ``pack_codes``); FP6 has no torch dtype.
DTYPE_ELEMENT_FORMATS: dict[str, ElementFormat] = {
    **{f.ml_dtypes_name: f for f in ELEMENT_FORMATS.values()},
    "float4_e2m1fn_x2": ELEMENT_FORMATS["e2m1"],
}
# dtypes that look like element formats and are not one of the table's
_NOT_ELEMENT_DTYPES = {
    "float8_e8m0fnu": "it is the OCP MX scale format (e8m0): pass such tensors as a scale",
    "float8_e4m3fnuz": "fnuz is another format than OCP's e4m3 (bias 8, NaN at 0x80, no negative zero)",
    "float8_e5m2fnuz": "fnuz is another format than OCP's e5m2 (bias 16, NaN at 0x80, no Inf)",
}


def _dtype_name(element) -> str | None:
    """The name of a torch or numpy (ml_dtypes) dtype, without importing either; None otherwise."""
    kind = type(element)
    if kind.__module__ == "torch" and kind.__name__ == "dtype":
        return str(element).removeprefix("torch.")
    if kind.__module__.split(".")[0] in ("numpy", "ml_dtypes") and hasattr(element, "name"):
        return str(element.name)  # a numpy dtype, ml_dtypes' included
    if isinstance(element, type) and element.__module__.split(".")[0] == "ml_dtypes":
        return element.__name__  # an ml_dtypes scalar type (ml_dtypes.float8_e4m3fn)
    return None


def get_element_format(element: str | ElementFormat) -> ElementFormat:
    """Look up an element format by name (``e2m1``), alias (``fp4``, ``fp6_e3m2``), or dtype.

    A torch dtype (``torch.float8_e4m3fn`` -> e4m3, ``torch.float8_e5m2`` -> e5m2,
    ``torch.float4_e2m1fn_x2`` -> e2m1), an ml_dtypes dtype or either's name as a string
    (``"float6_e3m2fn"`` -> e3m2) names the format it stores (``DTYPE_ELEMENT_FORMATS``).

    Raises:
        ValueError: the name is unknown, or the dtype is not an element format (``float8_e8m0fnu``
            is the scale format; the ``fnuz`` variants and ``bfloat16`` are other formats); the
            message names the argument and lists the known names.
    """
    if isinstance(element, ElementFormat):
        return element
    if isinstance(element, str) and element in _ELEMENT_ALIASES:
        return _ELEMENT_ALIASES[element]
    dtype_name = None if isinstance(element, str) else _dtype_name(element)
    if dtype_name is not None:
        if dtype_name in DTYPE_ELEMENT_FORMATS:
            return DTYPE_ELEMENT_FORMATS[dtype_name]
        why = f" ({_NOT_ELEMENT_DTYPES[dtype_name]})" if dtype_name in _NOT_ELEMENT_DTYPES else ""
        raise ValueError(
            f"element: dtype {element} is not a microscaling element format{why}; expected one of "
            f"{sorted(DTYPE_ELEMENT_FORMATS)} or a name from {sorted(ELEMENT_FORMATS)}"
        )
    if isinstance(element, str) and element in DTYPE_ELEMENT_FORMATS:
        return DTYPE_ELEMENT_FORMATS[element]
    try:
        return _ELEMENT_ALIASES[element]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown element format {element!r}; expected one of {sorted(ELEMENT_FORMATS)} "
            f"(aliases {sorted(set(_ELEMENT_ALIASES) - set(ELEMENT_FORMATS))}, or a dtype name from "
            f"{sorted(DTYPE_ELEMENT_FORMATS)})"
        ) from None


def get_block_scheme(scheme: str | BlockScheme) -> BlockScheme:
    """Look up a block scheme (``mxfp4`` ... ``nvfp4``, or an NVFP4 variant: ``nvfp4_ue5m3``, ``nvfp4_b32``).

    Raises:
        ValueError: the name is unknown, or a dtype was given (``torch.float4_e2m1fn_x2`` is the
            element of both ``mxfp4`` and ``nvfp4``); the message lists the known names.
    """
    if isinstance(scheme, BlockScheme):
        return scheme
    if not isinstance(scheme, str) and _dtype_name(scheme) is not None:
        raise ValueError(
            f"scheme: dtype {scheme} names an element format, not a block scheme (block size and scale "
            f"format too); pass it as the element of quantize_mx / quant_dequant_mx, or name one of "
            f"{list(BLOCK_SCHEMES)}"
        )
    try:
        return BLOCK_SCHEMES[scheme] if scheme in BLOCK_SCHEMES else NVFP4_VARIANTS[scheme]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown scheme {scheme!r}; expected one of {list(BLOCK_SCHEMES)} (or a variant ahead of hardware: "
            f"{list(NVFP4_VARIANTS)})"
        ) from None


def get_scale_mode(scale_mode: str) -> str:
    """Validate an E8M0 scale rule name (``floor``, ``even`` or ``rceil``)."""
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"unknown scale_mode {scale_mode!r}; expected one of {list(SCALE_MODES)}")
    return scale_mode


_ACTIVATION_ALIASES = {"fp8": FP8_E4M3_PER_TENSOR}


def get_activation_format(fmt: str | BlockScheme | PerTensorScheme | None) -> BlockScheme | PerTensorScheme | None:
    """An activation format: a block scheme (``mxfp4``, ``nvfp4``, ...), a per-tensor scheme
    (``fp8_e4m3``, alias ``fp8``), or None (activations stay in the model dtype).

    Raises:
        ValueError: the name is unknown; the message lists the known names.
    """
    if fmt is None or isinstance(fmt, (BlockScheme, PerTensorScheme)):
        return fmt
    if fmt in BLOCK_SCHEMES:
        return BLOCK_SCHEMES[fmt]
    if fmt in NVFP4_VARIANTS:
        return NVFP4_VARIANTS[fmt]
    if fmt in PER_TENSOR_SCHEMES:
        return PER_TENSOR_SCHEMES[fmt]
    if fmt in _ACTIVATION_ALIASES:
        return _ACTIVATION_ALIASES[fmt]
    raise ValueError(
        f"unknown activation format {fmt!r}; expected one of {list(BLOCK_SCHEMES) + list(PER_TENSOR_SCHEMES)} or None"
    )


def scale_mode_id(scale_mode: str) -> int:
    """The E8M0 rule's index in ``SCALE_MODES`` (the integer the kernels take as ``SCALE_MODE``)."""
    return list(SCALE_MODES).index(get_scale_mode(scale_mode))


class Numerics(str, enum.Enum):
    """The arithmetic of an emulation (``numerics=``).

    * ``VLLM`` (``"vllm"``): vLLM's emulation, bit for bit: weights dequantized to bf16
      (NVFP4: ``bf16(e2m1 * (fp32(ue4m3) * global_scale))``), activations QDQ'd to
      ``bf16(e2m1 * (s / gs))``, bf16 GEMMs with fp32 accumulation.
    * ``HARDWARE`` (``"hardware"``): what an FP4 tensor-core GEMM computes: operands
      ``element * block_scale`` (exact in bf16), fp32 accumulation, the per-tensor scales (NVFP4
      weight ``global_scale``, activation ``1 / gs``) applied to the fp32 accumulator.

    A ``str`` enum: a member equals its name string (``Numerics.VLLM == "vllm"``) and prints as it.
    ``kernel_id`` is the integer the Triton kernels take as their ``MODE`` constexpr (the member's
    position here: vLLM 0, hardware 1).
    """

    VLLM = "vllm"
    HARDWARE = "hardware"

    def __str__(self) -> str:
        return self.value

    @property
    def kernel_id(self) -> int:
        return list(Numerics).index(self)


def get_numerics(numerics: str | Numerics) -> Numerics:
    """The ``Numerics`` of a name (``"vllm"``, ``"hardware"``) or of a member (returned as is).

    Raises:
        ValueError: naming ``numerics``, the allowed values and the value given.
    """
    try:
        return Numerics(numerics)
    except (ValueError, TypeError):
        raise ValueError(f"numerics: expected one of {[n.value for n in Numerics]}, got {numerics!r}") from None
