"""Named corner cases: input, expected result, and why.

One frozen table read by the reference tests, the Triton kernel tests and the
microscaling-formats notebook. Each case is one block (32 elements for OCP MX,
16 for NVFP4) and an expected outcome that was worked out by hand from the
rules in ``mxlib.reference``; no expected value below was produced by running
mxlib.

Operations:

* ``qdq``: ``mxlib.reference.quant_dequant_mx`` / ``ref_nvfp4_quant_dequant`` on
  ``x`` shaped ``[1, block]`` (fp32 in and out); ``expected`` is the output block.
* ``scale``: the block's scale: E8M0 byte for MX, fp32 e4m3 value for NVFP4.
* ``decode_e8m0``: ``x`` holds bytes; ``expected`` their fp32 values.
* ``quantize_nvfp4_weight``: ``quantize_nvfp4`` on ``x``; ``expected`` is
  ``(weight_scale_2,)`` and the dequantized block must be finite.
* ``unify_input_scales``: ``mxlib.moe.unify_input_scales(x)``; ``expected`` is the
  resulting encode global scale (or ``None`` when it must raise).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["NamedCase", "NAMED_CASES", "get_case"]

NAN = math.nan
INF = math.inf


@dataclass(frozen=True)
class NamedCase:
    name: str
    op: str
    scheme: str
    x: tuple[float, ...]
    expected: tuple[float, ...] | None
    why: str
    params: dict = field(default_factory=dict)


def _block(head: list[float], fill: float, size: int) -> tuple[float, ...]:
    return tuple(head + [fill] * (size - len(head)))


_FP4_TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
# Rounded to even e2m1 codes: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4.
_FP4_TIES_RNE = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]

NAMED_CASES: tuple[NamedCase, ...] = (
    NamedCase(
        "mx_all_zero_block", "qdq", "mxfp4", _block([], 0.0, 32), _block([], 0.0, 32),
        "An all-zero block has amax 0: the exponent clamps to -127 (byte 0) and every "
        "element is 0; nothing divides by zero.",
    ),
    NamedCase(
        "mx_all_zero_block_scale", "scale", "mxfp4", _block([], 0.0, 32), (0,),
        "The smallest E8M0 scale, byte 0 = 2**-127, for an all-zero block.",
    ),
    NamedCase(
        "mx_nan_in_block", "qdq", "mxfp4", _block([NAN, 1.0, -2.0], 0.5, 32), _block([], NAN, 32),
        "A NaN anywhere makes amax NaN: the scale byte is 0xFF (NaN) and the whole "
        "block dequantizes to NaN.",
    ),
    NamedCase(
        "mx_nan_in_block_scale", "scale", "mxfp8_e4m3", _block([1.0, NAN], 0.5, 32), (255,),
        "NaN amax gives E8M0 byte 0xFF, the only NaN encoding of E8M0.",
    ),
    NamedCase(
        "mx_inf_in_block", "qdq", "mxfp6_e3m2", _block([INF, 1.0], 0.5, 32), _block([], NAN, 32),
        "Inf is not a finite amax either: byte 0xFF and an all-NaN block (torchao's convention).",
    ),
    NamedCase(
        "mx_negative_zero", "qdq", "mxfp4", _block([-0.0, 4.0, -0.1], 0.0, 32),
        _block([-0.0, 4.0, -0.0], 0.0, 32),
        "MX keeps the sign of zero: -0.0 is code 8 in e2m1, and -0.1 (below half the "
        "smallest subnormal 0.5 at scale 1) rounds to -0.0.",
    ),
    NamedCase(
        "mx_fp4_ties_to_even", "qdq", "mxfp4", _block(_FP4_TIES + [6.0], 0.0, 32),
        _block(_FP4_TIES_RNE + [6.0], 0.0, 32),
        "amax 6 gives scale 1 under the even rule; the midpoints 0.25 ... 5 round to the "
        "neighbour with an even mantissa bit.",
    ),
    NamedCase(
        "mx_tiny_block_byte0", "scale", "mxfp4", _block([1e-40, -3e-41], 0.0, 32), (0,),
        "A subnormal amax has floor(log2) below -127 - emax: the exponent clamps to byte 0 "
        "(2**-127), never NaN and never a wrapped byte.",
        {"scale_mode": "floor"},
    ),
    NamedCase(
        "mx_tiny_block_qdq", "qdq", "mxfp4", _block([2.0**-127, -(2.0**-128)], 0.0, 32),
        _block([2.0**-127, -(2.0**-128)], 0.0, 32),
        "At byte 0 the block still holds 2**-127 = 1.0 * scale and 2**-128 = 0.5 * scale "
        "exactly: byte 0 is 2**-127, not zero.",
    ),
    NamedCase(
        "e8m0_byte0_is_not_zero", "decode_e8m0", "mxfp4", (0.0, 1.0, 127.0, 254.0, 255.0),
        (2.0**-127, 2.0**-126, 1.0, 2.0**127, NAN),
        "E8M0 decodes 2**(b-127): byte 0 is the fp32 subnormal 2**-127 (decoding by "
        "b << 23 wrongly gives 0), byte 0xFF is NaN.",
    ),
    NamedCase(
        "e4m3_957_floor", "qdq", "mxfp8_e4m3", _block([957.0, 960.0], 0.0, 32),
        _block([896.0, 896.0], 0.0, 32),
        "floor: amax 960 -> exponent floor(log2 960) - 8 = 1, 957/2 = 478.5 and 960/2 = 480 "
        "saturate to 448, dequantized 896.",
        {"scale_mode": "floor"},
    ),
    NamedCase(
        "e4m3_957_rceil", "qdq", "mxfp8_e4m3", _block([957.0, 960.0], 0.0, 32),
        _block([960.0, 960.0], 0.0, 32),
        "rceil: ceil(log2(960/448)) = 2 -> scale 4, 957/4 = 239.25 -> 240, dequantized 960.",
        {"scale_mode": "rceil"},
    ),
    NamedCase(
        "fp4_even_bumps_exponent", "qdq", "mxfp4", _block([7.0, 1.0], 0.0, 32),
        _block([8.0, 1.0], 0.0, 32),
        "even: amax 7 = 1.75 * 4 rounds up to 8 at e2m1's one mantissa bit, so the scale is "
        "2: 7/2 = 3.5 -> 4 (tie to even) -> 8, and 1/2 = 0.5 (a subnormal) -> 1.",
        {"scale_mode": "even"},
    ),
    NamedCase(
        "fp4_floor_saturates", "qdq", "mxfp4", _block([7.0, 1.0], 0.0, 32),
        _block([6.0, 1.0], 0.0, 32),
        "floor: scale 2**(2 - 2) = 1 and 7 saturates to 6 (OCP's rule clips the top of a block).",
        {"scale_mode": "floor"},
    ),
    NamedCase(
        "nvfp4_all_zero_block", "qdq", "nvfp4", _block([], 0.0, 16), _block([], 0.0, 16),
        "s = 0, the guarded reciprocal gives q = 1 / 1e8, elements 0, dequantized 0 * (0 / gs) "
        "= 0: no Inf, no NaN.",
        {"global_scale": 1.0},
    ),
    NamedCase(
        "nvfp4_nan_in_block", "qdq", "nvfp4", _block([NAN, 1.0], 0.5, 16), _block([], NAN, 16),
        "NaN propagates through amax into the block scale, so the whole block is NaN (the seed's "
        "behaviour; torch.max propagates NaN).",
        {"global_scale": 1.0},
    ),
    NamedCase(
        "nvfp4_inf_in_block", "qdq", "nvfp4", _block([INF, 6.0, -3.0], 0.0, 16),
        _block([1.0, 1.0, -1.0], 0.0, 16),
        "Inf makes the block scale clamp to 448. With gs = 2688 (amax 1 calibrated): q = "
        "1 / (448 / 2688) = 6, Inf -> 6 -> 6 * 448/2688 = 1.0; 6 * 6 = 36 clips to 6 -> 1.0; "
        "-3 * 6 = -18 clips to -6 -> -1.0.",
        {"global_scale": 2688.0},
    ),
    NamedCase(
        "nvfp4_negative_zero", "qdq", "nvfp4", _block([-0.0, 6.0, -0.01], 0.0, 16),
        _block([0.0, 6.0, -0.0], 0.0, 16),
        "The seed takes the sign with torch.sign, and sign(-0.0) = 0: an input of -0.0 comes out "
        "+0.0, while -0.01 (rounds to zero) keeps its sign.",
        {"global_scale": 448.0},
    ),
    NamedCase(
        "nvfp4_block_scale_saturates", "scale", "nvfp4", _block([6000.0], 1.0, 16), (448.0,),
        "gs * amax / 6 = 1 * 6000 / 6 = 1000 > 448: clamped to 448 before the e4m3 cast, "
        "never NaN (e4m3 has no Inf; 480 and up would be NaN without the clamp).",
        {"global_scale": 1.0},
    ),
    NamedCase(
        "nvfp4_weight_all_zero_tensor", "quantize_nvfp4_weight", "nvfp4", _block([], 0.0, 16), (1.0,),
        "An all-zero matrix (an expert never trained) has amax 0; weight_scale_2 would be 0 and "
        "ModelOpt's division 0/0 NaN. mxlib stores weight_scale_2 = 1.0 and zero codes.",
    ),
    NamedCase(
        "uncalibrated_expert_input_scale", "unify_input_scales", "nvfp4", (0.0, 0.5, 0.25),
        (2.0,),
        "An expert that saw no calibration tokens has input_scale 0; max() ignores it and the "
        "global scale is 1 / 0.5 = 2, finite.",
    ),
    NamedCase(
        "all_experts_uncalibrated", "unify_input_scales", "nvfp4", (0.0, 0.0), None,
        "If every input_scale is 0 there is no scale to use: 1 / 0 would be Inf, so mxlib raises "
        "and names the tensor.",
    ),
)


def get_case(name: str) -> NamedCase:
    for c in NAMED_CASES:
        if c.name == name:
            return c
    raise KeyError(f"no named case {name!r}; known: {[c.name for c in NAMED_CASES]}")
