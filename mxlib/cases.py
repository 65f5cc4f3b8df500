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

``check_case`` runs one case through a twin (``mxlib.reference`` or ``mxlib.kernels``, which
share signatures) and compares its bits with ``expected``; the unit tests and the formats
notebook both call it.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from types import ModuleType

import torch

from . import reference as R
from .formats import BLOCK_SCHEMES
from .moe import unify_input_scales

__all__ = [
    "NamedCase",
    "NAMED_CASES",
    "get_case",
    "CaseResult",
    "run_case",
    "check_case",
    "check_cases",
    "bits_mismatch",
]

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
        "mx_all_zero_block",
        "qdq",
        "mxfp4",
        _block([], 0.0, 32),
        _block([], 0.0, 32),
        "An all-zero block has amax 0: the exponent clamps to -127 (byte 0) and every "
        "element is 0; nothing divides by zero.",
    ),
    NamedCase(
        "mx_all_zero_block_scale",
        "scale",
        "mxfp4",
        _block([], 0.0, 32),
        (0,),
        "The smallest E8M0 scale, byte 0 = 2**-127, for an all-zero block.",
    ),
    NamedCase(
        "mx_nan_in_block",
        "qdq",
        "mxfp4",
        _block([NAN, 1.0, -2.0], 0.5, 32),
        _block([], NAN, 32),
        "A NaN anywhere makes amax NaN: the scale byte is 0xFF (NaN) and the whole block dequantizes to NaN.",
    ),
    NamedCase(
        "mx_nan_in_block_scale",
        "scale",
        "mxfp8_e4m3",
        _block([1.0, NAN], 0.5, 32),
        (255,),
        "NaN amax gives E8M0 byte 0xFF, the only NaN encoding of E8M0.",
    ),
    NamedCase(
        "mx_inf_in_block",
        "qdq",
        "mxfp6_e3m2",
        _block([INF, 1.0], 0.5, 32),
        _block([], NAN, 32),
        "Inf is not a finite amax either: byte 0xFF and an all-NaN block (torchao's convention).",
    ),
    NamedCase(
        "mx_negative_zero",
        "qdq",
        "mxfp4",
        _block([-0.0, 4.0, -0.1], 0.0, 32),
        _block([-0.0, 4.0, -0.0], 0.0, 32),
        "MX keeps the sign of zero: -0.0 is code 8 in e2m1, and -0.1 (below half the "
        "smallest subnormal 0.5 at scale 1) rounds to -0.0.",
    ),
    NamedCase(
        "mx_fp4_ties_to_even",
        "qdq",
        "mxfp4",
        _block(_FP4_TIES + [6.0], 0.0, 32),
        _block(_FP4_TIES_RNE + [6.0], 0.0, 32),
        "amax 6 gives scale 1 under the even rule; the midpoints 0.25 ... 5 round to the "
        "neighbour with an even mantissa bit.",
    ),
    NamedCase(
        "mx_tiny_block_byte0",
        "scale",
        "mxfp4",
        _block([1e-40, -3e-41], 0.0, 32),
        (0,),
        "A subnormal amax has floor(log2) below -127 - emax: the exponent clamps to byte 0 "
        "(2**-127), never NaN and never a wrapped byte.",
        {"scale_mode": "floor"},
    ),
    NamedCase(
        "mx_tiny_block_qdq",
        "qdq",
        "mxfp4",
        _block([2.0**-127, -(2.0**-128)], 0.0, 32),
        _block([2.0**-127, -(2.0**-128)], 0.0, 32),
        "At byte 0 the block still holds 2**-127 = 1.0 * scale and 2**-128 = 0.5 * scale "
        "exactly: byte 0 is 2**-127, not zero.",
    ),
    NamedCase(
        "e8m0_byte0_is_not_zero",
        "decode_e8m0",
        "mxfp4",
        (0.0, 1.0, 127.0, 254.0, 255.0),
        (2.0**-127, 2.0**-126, 1.0, 2.0**127, NAN),
        "E8M0 decodes 2**(b-127): byte 0 is the fp32 subnormal 2**-127 (decoding by "
        "b << 23 wrongly gives 0), byte 0xFF is NaN.",
    ),
    NamedCase(
        "e4m3_957_floor",
        "qdq",
        "mxfp8_e4m3",
        _block([957.0, 960.0], 0.0, 32),
        _block([896.0, 896.0], 0.0, 32),
        "floor: amax 960 -> exponent floor(log2 960) - 8 = 1, 957/2 = 478.5 and 960/2 = 480 "
        "saturate to 448, dequantized 896.",
        {"scale_mode": "floor"},
    ),
    NamedCase(
        "e4m3_957_rceil",
        "qdq",
        "mxfp8_e4m3",
        _block([957.0, 960.0], 0.0, 32),
        _block([960.0, 960.0], 0.0, 32),
        "rceil: ceil(log2(960/448)) = 2 -> scale 4, 957/4 = 239.25 -> 240, dequantized 960.",
        {"scale_mode": "rceil"},
    ),
    NamedCase(
        "fp4_even_bumps_exponent",
        "qdq",
        "mxfp4",
        _block([7.0, 1.0], 0.0, 32),
        _block([8.0, 1.0], 0.0, 32),
        "even: amax 7 = 1.75 * 4 rounds up to 8 at e2m1's one mantissa bit, so the scale is "
        "2: 7/2 = 3.5 -> 4 (tie to even) -> 8, and 1/2 = 0.5 (a subnormal) -> 1.",
        {"scale_mode": "even"},
    ),
    NamedCase(
        "fp4_floor_saturates",
        "qdq",
        "mxfp4",
        _block([7.0, 1.0], 0.0, 32),
        _block([6.0, 1.0], 0.0, 32),
        "floor: scale 2**(2 - 2) = 1 and 7 saturates to 6 (OCP's rule clips the top of a block).",
        {"scale_mode": "floor"},
    ),
    NamedCase(
        "nvfp4_all_zero_block",
        "qdq",
        "nvfp4",
        _block([], 0.0, 16),
        _block([], 0.0, 16),
        "s = 0, the guarded reciprocal gives q = 1 / 1e8, elements 0, dequantized 0 * (0 / gs) = 0: no Inf, no NaN.",
        {"global_scale": 1.0},
    ),
    NamedCase(
        "nvfp4_nan_in_block",
        "qdq",
        "nvfp4",
        _block([NAN, 1.0], 0.5, 16),
        _block([], NAN, 16),
        "NaN propagates through amax into the block scale, so the whole block is NaN (vLLM's "
        "behaviour; torch.max propagates NaN).",
        {"global_scale": 1.0},
    ),
    NamedCase(
        "nvfp4_inf_in_block",
        "qdq",
        "nvfp4",
        _block([INF, 6.0, -3.0], 0.0, 16),
        _block([1.0, 1.0, -1.0], 0.0, 16),
        "Inf makes the block scale clamp to 448. With gs = 2688 (amax 1 calibrated): q = "
        "1 / (448 / 2688) = 6, Inf -> 6 -> 6 * 448/2688 = 1.0; 6 * 6 = 36 clips to 6 -> 1.0; "
        "-3 * 6 = -18 clips to -6 -> -1.0.",
        {"global_scale": 2688.0},
    ),
    NamedCase(
        "nvfp4_negative_zero",
        "qdq",
        "nvfp4",
        _block([-0.0, 6.0, -0.01], 0.0, 16),
        _block([0.0, 6.0, -0.0], 0.0, 16),
        "vLLM takes the sign with torch.sign, and sign(-0.0) = 0: an input of -0.0 comes out "
        "+0.0, while -0.01 (rounds to zero) keeps its sign.",
        {"global_scale": 448.0},
    ),
    NamedCase(
        "nvfp4_block_scale_saturates",
        "scale",
        "nvfp4",
        _block([6000.0], 1.0, 16),
        (448.0,),
        "gs * amax / 6 = 1 * 6000 / 6 = 1000 > 448: clamped to 448 before the e4m3 cast, "
        "never NaN (e4m3 has no Inf; 480 and up would be NaN without the clamp).",
        {"global_scale": 1.0},
    ),
    NamedCase(
        "nvfp4_weight_all_zero_tensor",
        "quantize_nvfp4_weight",
        "nvfp4",
        _block([], 0.0, 16),
        (1.0,),
        "An all-zero matrix (an expert never trained) has amax 0; weight_scale_2 would be 0 and "
        "ModelOpt's division 0/0 NaN. mxlib stores weight_scale_2 = 1.0 and zero codes.",
    ),
    NamedCase(
        "uncalibrated_expert_input_scale",
        "unify_input_scales",
        "nvfp4",
        (0.0, 0.5, 0.25),
        (2.0,),
        "An expert that saw no calibration tokens has input_scale 0; max() ignores it and the "
        "global scale is 1 / 0.5 = 2, finite.",
    ),
    NamedCase(
        "all_experts_uncalibrated",
        "unify_input_scales",
        "nvfp4",
        (0.0, 0.0),
        None,
        "If every input_scale is 0 there is no scale to use: 1 / 0 would be Inf, so mxlib raises and names the tensor.",
    ),
)


def get_case(name: str) -> NamedCase:
    for c in NAMED_CASES:
        if c.name == name:
            return c
    raise KeyError(f"no named case {name!r}; known: {[c.name for c in NAMED_CASES]}")


# ----------------------------------------------------------------------------- running a case


@dataclass(frozen=True)
class CaseResult:
    """One case run through one twin: ``got`` (fp32, flat; ``None`` for a case that must raise),
    ``ok`` and, when not ok, ``message`` saying what differs."""

    case: NamedCase
    got: torch.Tensor | None
    ok: bool
    message: str = ""

    def row(self, shown: int = 3) -> dict:
        """A table row: case, scheme, op, the first ``shown`` values got and expected, ok, why."""
        c = self.case
        got = "raised ValueError" if self.got is None else str(self.got[:shown].tolist())
        expected = "raises ValueError" if c.expected is None else str(list(c.expected[:shown]))
        return dict(case=c.name, scheme=c.scheme, op=c.op, got=got, expected=expected, ok=self.ok, why=c.why)


_INT_VIEW = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_mismatch(got: torch.Tensor, expected: torch.Tensor) -> str:
    """``""`` when ``got`` equals ``expected`` bit for bit (same shape and dtype, NaN at the same
    positions, every other value identical, so +0.0 and -0.0 differ); otherwise a message
    with the count and the first differing positions. NaN sign and payload are not compared."""
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return f"shape/dtype {tuple(got.shape)} {got.dtype} != {tuple(expected.shape)} {expected.dtype}"
    got, expected = got.detach().cpu(), expected.detach().cpu()
    ng, ne = torch.isnan(got), torch.isnan(expected)
    view = _INT_VIEW[got.element_size()]
    bad = (ng != ne) | (~ng & ~ne & (got.view(view) != expected.view(view)))
    if not bad.any():
        return ""
    idx = bad.nonzero().flatten()[:5].tolist()
    return (
        f"{int(bad.sum())} of {bad.numel()} differ; first at {idx}: got {[got[i].item() for i in idx]}, "
        f"expected {[expected[i].item() for i in idx]}"
    )


def run_case(case: NamedCase, impl: ModuleType = R, device: str | torch.device = "cpu") -> torch.Tensor:
    """The result of ``case`` computed by ``impl`` on ``device``, as a flat fp32 CPU tensor.

    ``impl`` is ``mxlib.reference`` (default) or ``mxlib.kernels``: the twins share signatures.
    NVFP4 block scales, E8M0 decoding and input-scale unification have one implementation
    (the reference / ``mxlib.moe``), used whatever ``impl`` is.

    Raises:
        ValueError: what the operation raises (``unify_input_scales`` with no calibrated expert).
        AssertionError: ``quantize_nvfp4_weight`` dequantizes to a non-finite value.
    """
    x = torch.tensor(case.x, dtype=torch.float32, device=device).reshape(1, -1)
    scheme = BLOCK_SCHEMES[case.scheme]
    mode = case.params.get("scale_mode", "even")
    gs = torch.tensor([case.params.get("global_scale", 1.0)], device=device)
    nvfp4 = scheme.has_global_scale
    if case.op == "qdq":
        out = (
            impl.ref_nvfp4_quant_dequant(x, gs, scheme.block_size)
            if nvfp4
            else impl.quant_dequant_mx(x, scheme.element.name, scheme.block_size, mode)
        )
    elif case.op == "scale":
        out = (
            R.ref_nvfp4_quant(x.cpu(), gs.cpu(), scheme.block_size)[1]
            if nvfp4
            else impl.quantize_mx(x, scheme.element.name, scheme.block_size, mode)[1]
        )
    elif case.op == "decode_e8m0":
        out = R.decode_e8m0(x.cpu().to(torch.uint8))
    elif case.op == "quantize_nvfp4_weight":
        packed, scale, ws2 = impl.quantize_nvfp4(x)
        deq = impl.dequantize_to_dtype(packed, scale, ws2, torch.float32)
        assert torch.isfinite(deq).all(), f"{case.name}: the dequantized block is not finite"
        out = ws2
    elif case.op == "unify_input_scales":
        with warnings.catch_warnings():  # the scales of these cases differ on purpose
            warnings.filterwarnings("ignore", message=".*activation global scales differ across experts")
            out = unify_input_scales(x.flatten().cpu(), "max", "w13_input_scale")[0][:1]
    else:
        raise ValueError(
            f"case.op: expected one of qdq, scale, decode_e8m0, quantize_nvfp4_weight, "
            f"unify_input_scales, got {case.op!r}"
        )
    return out.flatten().float().cpu()


def check_case(case: NamedCase, impl: ModuleType = R, device: str | torch.device = "cpu") -> CaseResult:
    """Run ``case`` (``run_case``) and compare its bits with ``case.expected``; a case whose
    ``expected`` is ``None`` is ok when it raises ``ValueError``."""
    if case.expected is None:
        try:
            got = run_case(case, impl, device)
        except ValueError:
            return CaseResult(case, None, True)
        return CaseResult(case, got, False, f"{case.name}: expected ValueError, got {got.tolist()}")
    got = run_case(case, impl, device)
    message = bits_mismatch(got, torch.tensor(case.expected, dtype=torch.float32))
    return CaseResult(case, got, not message, f"{case.name}: {message}" if message else "")


def check_cases(cases=NAMED_CASES, impl: ModuleType = R, device: str | torch.device = "cpu") -> list[CaseResult]:
    """``check_case`` over ``cases`` (default: every named case)."""
    return [check_case(c, impl, device) for c in cases]
