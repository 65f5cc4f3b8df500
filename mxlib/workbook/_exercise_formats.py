"""The checkers of the format exercises (notebooks 00, 02 and 04) and the answer forms every checker accepts.

Each ``check_<x>(answer, **context)`` returns None when the answer is right, else a hint that does
not contain the answer; each ``solve_<x>(**context)`` returns (an answer that passes, the reasoning).
``mxlib.workbook.exercises`` names them and prints; the predicates ``floor_clips_rceil_does_not``,
``even_clips_rceil_does_not``, ``loses_without_flushing`` and ``is_largest_flushing_power_of_two``
check an answer on the explorers' numbers.
"""

from __future__ import annotations

import ast
import math
import operator
from fractions import Fraction

import torch

from .. import reference as R
from ..formats import NVFP4_FLUSH_RATIO, NVFP4_SUBNORMAL_RATIO, get_element_format
from . import explorers

_E2M1 = get_element_format("e2m1")
_E4M3 = get_element_format("e4m3")


# ----------------------------------------------------------------------------- equivalent forms


def as_int(answer) -> int | None:
    """An integer from ``121``, ``121.0``, ``"121"``, ``"0x79"``, ``"0b1111001"`` or ``"0 1111 001"``; else None."""
    if isinstance(answer, bool):
        return None
    if isinstance(answer, int):
        return answer
    if isinstance(answer, float):
        return int(answer) if answer.is_integer() else None
    if isinstance(answer, str):
        text = answer.strip().replace("_", "")
        if " " in text and set(text) <= set("01 "):
            return int(text.replace(" ", ""), 2)
        try:
            return int(text, 0)
        except ValueError:
            return None
    return None


_ARITH = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
}


def _arith(node) -> float:
    """The value of an arithmetic expression tree of numbers, + - * / ** and signs; ValueError otherwise."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return float(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _arith(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
        left, right = _arith(node.left), _arith(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 1100:
            raise ValueError("exponent out of range")
        return float(_ARITH[type(node.op)](left, right))
    raise ValueError("not an arithmetic expression")


def as_number(answer) -> float | None:
    """A float from an int, a float, a Fraction, a one-element tensor or a string: a number (``"4.25"``), a
    fraction (``"17/4"``) or arithmetic of numbers with ``+ - * / **`` and parentheses (``"4 + 8/32"``,
    ``"2**-19"``, ``"2^-19"``: ``^`` read as a power); else None."""
    if isinstance(answer, bool):
        return None
    if isinstance(answer, (int, float, Fraction)):
        return float(answer)
    if isinstance(answer, str):
        text = answer.strip().replace("^", "**")
        if not text or len(text) > 200:
            return None
        try:
            v = _arith(ast.parse(text, mode="eval").body)
        except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, TypeError):
            return None
        return v if math.isfinite(v) else None
    if isinstance(answer, torch.Tensor) and answer.numel() == 1:
        return float(answer)
    return None


def as_tuple(answer):
    """Lists and tuples (nested) as tuples; numbers left as they are."""
    if isinstance(answer, (list, tuple)):
        return tuple(as_tuple(a) for a in answer)
    return answer


def as_block(answer, size: int) -> tuple[list[float] | None, str]:
    """``size`` finite numbers, or None and why not."""
    try:
        values = [float(v) for v in (answer.tolist() if isinstance(answer, torch.Tensor) else answer)]
    except (TypeError, ValueError):
        return None, f"not a valid block: give a list of {size} numbers"
    if len(values) != size:
        return None, f"not a valid block: a block holds {size} numbers, this one {len(values)}"
    if not all(math.isfinite(v) for v in values):
        return None, "not a valid block: every number must be finite"
    return values, ""


def _significand(amax: float) -> float:
    """``s`` in [1, 2) with ``amax = s * 2**k``."""
    m, _ = math.frexp(amax)
    return 2.0 * m


# ----------------------------------------------------------------------------- the checkers
# Each ``_check_<x>(answer, **context)`` returns None when the answer is right, else a hint; each
# ``_solve_<x>(**context)`` returns (an answer that passes, the reasoning).


def check_even_saturates(answer, **_):
    block, why = as_block(answer, 32)
    if block is None:
        return why
    if even_clips_rceil_does_not(block):
        return None
    amax = max(abs(v) for v in block)
    if amax == 0:
        return "an all-zero block has nothing to saturate: plant one large value"
    s = _significand(amax)
    if s >= 1.75:
        return (
            "here even rounds amax's significand (amax = s * 2^k, 1 <= s < 2) up to 2 and moves to the next power of "
            "two, as in the walkthrough: pick a significand that one mantissa bit rounds down"
        )
    return (
        "no rule saturates this block: with amax's significand s at most 1.5, amax / 2^(k-2) still fits under "
        "e2m1's largest value 6 = 1.5 * 2^2; the largest value must lie above 1.5 * 2^k"
    )


def solve_even_saturates(**_):
    block = [6.5] + [0.1 * i for i in range(31)]
    return block, (
        "amax 6.5 = 1.625 * 2^2. even rounds 1.625 to one mantissa bit: 1.5 (half up from 1.625 * 2 = 3.25 "
        "gives 3), so it keeps floor's exponent 2 - 2 = 0 and 6.5 saturates to 6. rceil takes the smallest power "
        "of two with 6.5 / 2^e <= 6: 2^1, and 6.5 / 2 = 3.25 fits."
    )


def check_e8m0_byte(answer, **_):
    byte = as_int(answer)
    want = explorers.scale_bytes(0.4, "e2m1")["even"]
    if byte is None:
        if isinstance(answer, float) and 0 < answer < 1:
            return "that is a scale value 2^e; the question asks for its E8M0 byte, which stores e + 127"
        return "give the byte as an int (e.g. 100) or a string such as '0x64'"
    if byte == want:
        return None
    if byte < 0:
        return "that is the exponent e; the E8M0 byte stores e + 127 (the bias)"
    if byte == want + 2:
        return (
            "that is floor(log2 amax) + 127, amax's own power of two: the scale must also make room for the largest "
            "power of two that e2m1 itself can hold (its emax; X.value_info shows e2m1's largest value)"
        )
    if byte == want + 1:
        return (
            "that is the byte rceil picks here: even moves up a power of two only when amax's significand s "
            "(amax = s * 2^k, 1 <= s < 2) rounds up to 2 at e2m1's one mantissa bit. Does it, for 0.4?"
        )
    if byte == 255:
        return "byte 255 (0xFF) is E8M0's NaN code, never a scale; the bytes 0..254 mean 2^(b - 127)"
    if 0 <= byte <= 254:
        return (
            f"byte {byte} means 2^{byte - 127}: write amax as s * 2^k (1 <= s < 2), take even's exponent from k and "
            "e2m1's emax (section 2.1), then add the bias"
        )
    return "an E8M0 byte is one unsigned byte: 0..254 (255 is NaN)"


def solve_e8m0_byte(**_):
    byte = explorers.scale_bytes(0.4, "e2m1")["even"]
    return byte, (
        "0.4 = 1.6 * 2^-2. With one mantissa bit 1.6 rounds to 1.5 (not up to 2), so even keeps "
        f"e = -2 - emax = -2 - 2 = -4 and the byte is -4 + 127 = {byte} (0x{byte:02X})."
    )


def _ratio_or_hint(answer) -> tuple[float | None, str]:
    r = as_number(answer)
    if r is None:
        return None, "give r as a number, e.g. 2 ** -12"
    if not 0.0 < r <= 1.0:
        return None, "r is the smaller expert's amax over the larger one's: a number in (0, 1]"
    if r < explorers.MIN_EXPERT_RATIO:
        return None, (
            f"at r = {r:.3g} the smaller expert's own global scale 6 * 448 / amax would leave fp32's range (the "
            f"explorer takes r >= {explorers.MIN_EXPERT_RATIO:.3g}); the thresholds of this exercise lie many "
            "powers of two higher"
        )
    return r, ""


def check_flush_ratio(answer, **_):
    r, why = _ratio_or_hint(answer)
    if r is None:
        return why
    row = explorers.expert_scale_ratio(r)[-1]
    flushed, subnormal = row["flushed_blocks"], row["subnormal_blocks"]
    if flushed == 1.0 and row["sqnr_per_expert_db"] > 15:
        return None
    if flushed == 1.0:
        return (
            f"at r = {r:.3g} every block flushes, but the expert's own scale keeps only "
            f"{row['sqnr_per_expert_db']:.1f} dB: the exercise asks for both"
        )
    if subnormal == 0 and flushed == 0:
        return (
            f"at r = {r:.3g} every unified block scale is still an e4m3 normal (>= 2^-6): the unified scale costs "
            "only rounding noise yet. The largest block scale is about 448 * r: go many powers of two lower"
        )
    normal = 1.0 - flushed - subnormal
    return (
        f"at r = {r:.3g}, {flushed:.0%} of the blocks are flushed, {subnormal:.0%} keep subnormal scales and "
        f"{normal:.0%} normal ones: a block scale rounds to zero only at or below half e4m3's smallest subnormal "
        "2^-9, and the largest block scale must get there too"
    )


def solve_flush_ratio(**_):
    r = NVFP4_FLUSH_RATIO / 2
    return r, (
        "The smaller expert's largest block scale is e4m3(448 * r). Below r = 2^-10 / 448 it is at most 2^-10, half "
        "the smallest subnormal 2^-9, and rounds to 0: every block flushes. Its own global scale puts its amax at "
        f"the top of the range again, so it keeps its full SQNR. Any r below 2^-10 / 448 passes, e.g. {r:.3g}."
    )


def floor_clips_rceil_does_not(block, scheme: str = "mxfp4") -> bool:
    """True when the OCP floor rule saturates an element of ``block`` and rceil does not.

    Raises:
        ValueError: the block length is not the scheme's block size (``explorers.block_info``).
    """
    floor = explorers.block_info(block, scheme, "floor")
    rceil = explorers.block_info(block, scheme, "rceil")
    return any(floor["clipped"]) and not any(rceil["clipped"])


def even_clips_rceil_does_not(block, scheme: str = "mxfp4") -> bool:
    """True when the ``even`` rule saturates an element of ``block`` and rceil does not.

    Raises:
        ValueError: the block length is not the scheme's block size (``explorers.block_info``).
    """
    even = explorers.block_info(block, scheme, "even")
    rceil = explorers.block_info(block, scheme, "rceil")
    return any(even["clipped"]) and not any(rceil["clipped"])


def check_floor_clips(answer, **_):
    block, why = as_block(answer, 32)
    if block is None:
        return why
    if floor_clips_rceil_does_not(block, "mxfp8_e4m3"):
        return None
    amax = max(abs(v) for v in block)
    if amax == 0:
        return "an all-zero block has nothing to clip: plant one large value"
    return (
        "floor does not clip this block: floor keeps amax's exponent k and divides by 2^(k-8), so it clips only when "
        "amax's significand s (amax = s * 2^k) is above e4m3's top significand 1.75 (448 = 1.75 * 2^8)"
    )


def solve_floor_clips(**_):
    block = [960.0] + [1.0] * 31
    return block, (
        "amax 960 = 1.875 * 2^9: floor picks 2^(9-8) and 960 / 2 = 480 > 448 saturates; rceil picks 2^2: 240 fits."
    )


def check_e4m3_code(answer, **_):
    want = explorers.value_info(300.0, "e4m3")["code"]
    code = as_int(answer)
    if code is None:
        return "give the code as an int (e.g. 64) or a string such as '0x40'"
    if code == want:
        return None
    if code == 300:
        return "that is the value; the question asks for its code: sign bit, 4 exponent bits, 3 mantissa bits"
    if not 0 <= code <= 0xFF:
        return "an e4m3 code is one byte: 0x00..0xFF"
    if code & 0x80:
        return "bit 7 is the sign bit: 300 is positive"
    value = float(R.decode_element(torch.tensor([code], dtype=torch.uint8), "e4m3")[0])
    if math.isnan(value):
        return "that code is e4m3's NaN (S.1111.111)"
    if value == _E4M3.max:
        return "that is e4m3's largest value 448: 300 lies below it and does not saturate"
    if value == 256.0:
        return (
            f"code 0x{code:02X} decodes to 256 = 2^8, the bottom of the binade [256, 512) that holds 300: rounding "
            "is to the nearest value, not down to a power of two. How far apart do e4m3's 3 mantissa bits put its "
            "values in that binade?"
        )
    lower = float(R.decode_element(torch.tensor([want], dtype=torch.uint8), "e4m3")[0])
    if value > 300.0 and lower < 300.0 and code == want + 1:
        return (
            f"code 0x{code:02X} decodes to {value:g}, the e4m3 value just above 300: ties aside, rounding goes to the "
            "nearer of the two values around 300, not up. Which one is nearer?"
        )
    return f"code 0x{code:02X} decodes to {value:g}: find the e4m3 value nearest to 300 (X.bit_fields decodes a code)"


def solve_e4m3_code(**_):
    want = explorers.value_info(300.0, "e4m3")["code"]
    return want, (
        f"300 lies between 288 = 1.125 * 2^8 (0 1111 001) and 320 = 1.25 * 2^8 (0 1111 010): nearer 288, code "
        f"0x{want:02X} ({want})."
    )


_OUTLIER_SCALES = (1, 10, 100, 1000, 10000)


def _outlier_gaps() -> dict[int, float]:
    out = {}
    for scale in _OUTLIER_SCALES:
        r = explorers.outlier_scale_sqnr(scale, schemes=("mxfp4", "nvfp4"))
        out[scale] = r["nvfp4"] - r["mxfp4"]
    return out


def check_outlier_gap(answer, **_):
    v = as_number(answer)
    if v is None or v not in _OUTLIER_SCALES:
        return "choose one of the five magnitudes the question lists"
    gaps = _outlier_gaps()
    smallest = next((s for s in _OUTLIER_SCALES if gaps[s] > 3.0), None)
    if int(v) == smallest:
        return None
    if gaps[int(v)] > 3.0:
        return (
            "NVFP4 leads by more than 3 dB there, but it already does at a smaller magnitude: the question asks "
            "for the smallest"
        )
    return f"at outlier_scale {int(v)} NVFP4 leads MXFP4 by {gaps[int(v)]:.1f} dB, not more than 3: try larger outliers"


def solve_outlier_gap(**_):
    gaps = _outlier_gaps()
    smallest = next((s for s in _OUTLIER_SCALES if gaps[s] > 3.0), None)
    return smallest, (
        "NVFP4's lead over MXFP4 (global SQNR) at each magnitude: "
        + ", ".join(f"{s}: {g:+.1f} dB" for s, g in gaps.items())
        + f". The first above 3 dB is {smallest}: there the outliers dominate their 32-element MXFP4 blocks, whose "
        "power-of-two scale leaves the other values few grid points; NVFP4's 16-element blocks and e4m3 scales "
        "cope better."
    )


def loses_without_flushing(ratio: float, min_db: float = 2.0, **kwargs) -> bool:
    """True when, at this ``ratio``, the smallest synthetic expert of ``explorers.expert_scale_ratio``
    loses more than ``min_db`` dB under the unified scale against its own scale while none of its
    blocks is flushed (its block scales are subnormal, not zero). Answers lie between
    ``mxlib.formats.NVFP4_FLUSH_RATIO`` and ``NVFP4_SUBNORMAL_RATIO``. ``kwargs`` go to
    ``explorers.expert_scale_ratio``."""
    row = explorers.expert_scale_ratio(float(ratio), **kwargs)[-1]
    return row["sqnr_per_expert_db"] - row["sqnr_unified_db"] > min_db and row["flushed_blocks"] == 0.0


def is_largest_flushing_power_of_two(ratio: float, **kwargs) -> bool:
    """True when ``ratio`` is a power of two at which every block of the smallest synthetic expert
    is flushed under the unified scale (its QDQ output is all zero) while at ``2 * ratio`` at least
    one block survives.

    By hand: the expert's largest block scale is ``e4m3(448 * ratio)`` and rounds to zero when it is
    at most ``2**-10`` (half the smallest subnormal ``2**-9``; the tie goes to the even code 0).

    Raises:
        ValueError: ``ratio`` not in (0, 1].
    """
    ratio = float(ratio)
    if not (0.0 < ratio <= 1.0):
        raise ValueError(f"ratio: expected a number in (0, 1], got {ratio}")
    if math.frexp(ratio)[0] != 0.5:
        return False
    here = explorers.expert_scale_ratio(ratio, **kwargs)[-1]["flushed_blocks"]
    above = explorers.expert_scale_ratio(min(2.0 * ratio, 1.0), **kwargs)[-1]["flushed_blocks"] if ratio < 1.0 else 0.0
    return here == 1.0 and above < 1.0


def check_subnormal_loss(answer, **_):
    r, why = _ratio_or_hint(answer)
    if r is None:
        return why
    if loses_without_flushing(r):
        return None
    row = explorers.expert_scale_ratio(r)[-1]
    lost = row["sqnr_per_expert_db"] - row["sqnr_unified_db"]
    if row["flushed_blocks"] > 0:
        return f"at r = {r:.3g} {row['flushed_blocks']:.0%} of the blocks are already flushed: go higher"
    if r >= NVFP4_SUBNORMAL_RATIO:
        return (
            f"at r = {r:.3g} the largest block scale 448 * r is still an e4m3 normal (>= 2^-6): the unified scale "
            "costs rounding noise only. Go lower, between the two dashed lines"
        )
    return (
        f"the block scales are subnormal here, but the expert loses only {lost:.2f} dB: go lower (not past the "
        "flush line), where fewer significant bits are left"
    )


def solve_subnormal_loss(**_):
    r = 2.0**-16.5
    return r, (
        f"Between 2^-10 / 448 ({NVFP4_FLUSH_RATIO:.3g}) and 2^-6 / 448 ({NVFP4_SUBNORMAL_RATIO:.3g}) the block scales "
        f"are subnormal: e.g. r = 2 ** -16.5 = {r:.3g}, where the scales keep one or two significant bits and no "
        "block is zero yet."
    )


def check_first_flush(answer, **_):
    v = as_number(answer)
    if v is not None and v > 1 and float(v).is_integer():
        return "give r itself, 2 ** -n, not n"
    r, why = _ratio_or_hint(answer)
    if r is None:
        return why
    if math.frexp(r)[0] != 0.5:
        return "give a power of two, 2 ** -n"
    if is_largest_flushing_power_of_two(r):
        return None
    row = explorers.expert_scale_ratio(r)[-1]
    if row["flushed_blocks"] < 1.0:
        return (
            f"at this r {1 - row['flushed_blocks']:.0%} of the blocks survive: the largest block scale e4m3(448 * r) "
            "is still nonzero. Go lower"
        )
    return "everything flushes here, but it already does at 2r: find the largest such power of two"


def solve_first_flush(**_):
    r = next(2.0**-n for n in range(0, 40) if is_largest_flushing_power_of_two(2.0**-n))
    n = -int(math.log2(r))
    return r, (
        f"e4m3 rounds to zero at or below 2^-10 (half its smallest subnormal 2^-9; the tie goes to the even code 0). "
        f"448 * 2^-{n} = {448 * r / 2**-10:g} * 2^-10 rounds to 0, while 448 * 2^-{n - 1} = "
        f"{448 * 2 * r / 2**-10:g} * 2^-10 rounds up to 2^-9: r = 2 ** -{n}."
    )
