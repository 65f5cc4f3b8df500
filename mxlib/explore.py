"""Plain functions behind the workbook's interactive widgets, and the thin widgets themselves.

Each explorer is a plain function that returns a dict (or a list of dict rows) of numbers, tested
in ``tests/test_explore.py`` against ml_dtypes and hand-computed grids; the ``*_widget()``
functions only wire ipywidgets sliders and text boxes to them.

* ``value_info(value, element)``: one value on one element grid: its code and bit fields, the
  grid neighbours below and above, the rounded value (nearest, ties to even, saturating) and
  the rounding error.
* ``block_info(block, scheme, scale_mode)``: one editable block through quantization: amax, the
  scale byte (E8M0 for OCP MX, ue4m3 plus an fp32 global scale for NVFP4), scaled values, codes,
  packed bytes, the QDQ result and its error.
* ``expert_scale_ratio(ratio)``: synthetic MoE experts whose activation amax differ by ``ratio``,
  NVFP4 QDQ error of each under one unified (max) global scale and under per-expert scales, as
  vLLM's emulation (unified) and an ideal per-expert kernel would see them.
* ``outlier_scale_sqnr(outlier_scale)``: SQNR of each block scheme on Gaussian data with a few
  outliers of a given magnitude.
* ``stored_shapes`` and ``stored_block``: what a checkpoint stores for one expert projection (the
  shapes its packing implies; one block of it read back and decoded), for notebook 01.
* ``swapped_nibbles(model)``: notebook 01's negative control, every stored FP4 byte of every
  emulation experts module with its two codes swapped, for the length of a ``with`` block;
  ``captured_output(module)`` records a module's outputs meanwhile (the MoE block's, for its SQNR).

All arithmetic goes through ``mxlib.reference``; these functions add no rounding of their own.
"""

from __future__ import annotations

import math

import torch

from . import reference as R
from .analysis import sqnr_db
from .formats import (
    BLOCK_SCHEMES,
    ELEMENT_FORMATS,
    E8M0_BIAS,
    NVFP4_BLOCK_SIZE,
    ElementFormat,
    get_block_scheme,
    get_element_format,
    get_scale_mode,
)

__all__ = [
    "NVFP4_SUBNORMAL_RATIO",
    "NVFP4_FLUSH_RATIO",
    "bit_fields",
    "value_info",
    "block_info",
    "expert_scale_ratio",
    "expert_scale_ratio_sweep",
    "add_scale_ratio_thresholds",
    "loses_without_flushing",
    "is_largest_flushing_power_of_two",
    "outlier_data",
    "outlier_scale_sqnr",
    "outlier_scale_sweep",
    "scale_bytes",
    "stored_shapes",
    "stored_block",
    "swapped_nibbles",
    "captured_output",
    "floor_clips_rceil_does_not",
    "rows_table",
    "value_explorer_widget",
    "block_explorer_widget",
    "expert_scale_ratio_widget",
    "outlier_scale_widget",
]

_E4M3 = get_element_format("e4m3")
_E2M1 = get_element_format("e2m1")
_FP4_TIMES_FP8_MAX = _E2M1.max * _E4M3.max  # 6 * 448 = 2688

# NVFP4 with one global scale for experts of different activation amax: an expert whose amax is
# `ratio` times the largest gets block scales of at most 448 * ratio. Below 2**-6 (e4m3's smallest
# normal) they are subnormal and lose mantissa bits; below 2**-10 (half of e4m3's smallest
# subnormal 2**-9) they round to zero and the whole block is flushed to zero.
NVFP4_SUBNORMAL_RATIO = 2.0**-6 / _E4M3.max
NVFP4_FLUSH_RATIO = 2.0**-10 / _E4M3.max


_sqnr_db = sqnr_db  # ``mxlib.analysis.sqnr_db``: float64, +inf for an exact match


# ----------------------------------------------------------------------------- one value


def bit_fields(code: int, element: str | ElementFormat) -> dict:
    """Split a code into sign, exponent and mantissa fields and say how it decodes.

    Returns ``{"sign", "exponent", "mantissa", "bits", "kind", "formula"}``: ``bits`` is a string
    such as ``"0 10 1"`` (sign, exponent, mantissa); ``kind`` is ``zero``, ``subnormal``,
    ``normal``, ``nan`` or ``inf``; ``formula`` the decode written out with the field values.

    Decoding (OCP MX v1.0 section 5.3): normal (exponent field ``E > 0``):
    ``(-1)^S * 2^(E - bias) * (1 + M / 2^mbits)``; subnormal (``E == 0``):
    ``(-1)^S * 2^(1 - bias) * (M / 2^mbits)``.

    Raises:
        ValueError: ``code`` is outside ``[0, 2**nbits)``.
    """
    fmt = get_element_format(element)
    if not 0 <= int(code) < fmt.num_codes:
        raise ValueError(f"code: expected an integer in [0, {fmt.num_codes}) for {fmt.name}, got {code}")
    code = int(code)
    s = code >> (fmt.ebits + fmt.mbits)
    e = (code >> fmt.mbits) & (2**fmt.ebits - 1)
    m = code & (2**fmt.mbits - 1)
    value = fmt.code_value(code)
    sign = "-" if s else "+"
    if math.isnan(value):
        kind, formula = "nan", "NaN (a special code)"
    elif math.isinf(value):
        kind, formula = "inf", f"{sign}Inf (a special code)"
    elif e == 0 and m == 0:
        kind, formula = "zero", f"{sign}0"
    elif e == 0:
        kind = "subnormal"
        formula = f"{sign}2^(1-{fmt.bias}) * ({m}/{2**fmt.mbits}) = {value!r}"
    else:
        kind = "normal"
        formula = f"{sign}2^({e}-{fmt.bias}) * (1 + {m}/{2**fmt.mbits}) = {value!r}"
    bits = f"{s:01b} {e:0{fmt.ebits}b} {m:0{fmt.mbits}b}"
    return {"sign": s, "exponent": e, "mantissa": m, "bits": bits, "kind": kind, "formula": formula}


def value_info(value: float, element: str | ElementFormat = "e2m1") -> dict:
    """Where one value lands on an element format's grid.

    Args:
        value: a finite number; it is first rounded to fp32 (what a tensor would hold).
        element: ``e2m1``, ``e2m3``, ``e3m2``, ``e4m3`` or ``e5m2`` (or an alias).

    Returns:
        dict with ``value`` (the fp32 input), ``below`` / ``above`` (the nearest finite grid values
        ``<=`` and ``>=`` it; ``None`` past the largest magnitude), ``rounded`` (nearest, ties to even,
        saturating to +-max: ``mxlib.reference.round_to_element``), ``code`` (its integer code),
        ``code_hex``, the ``bit_fields`` entries (``bits``, ``kind``, ``formula``, ...), ``error``
        (``rounded - value``), ``rel_error`` (``|error| / |value|``, 0 for 0), ``tie`` (the value
        lies exactly halfway between two grid values) and ``saturated`` (``|value| > max``).

    Raises:
        ValueError: ``value`` is NaN or infinite, or the element name is unknown.
    """
    fmt = get_element_format(element)
    v = float(torch.tensor(float(value), dtype=torch.float32))
    if not math.isfinite(v):
        raise ValueError(f"value: expected a finite number, got {value!r}")
    x = torch.tensor([v], dtype=torch.float32)
    rounded = float(R.round_to_element(x, fmt)[0])
    code = int(R.encode_element(x, fmt)[0])
    grid = sorted({g for g in fmt.values() if math.isfinite(g)})
    below = max((g for g in grid if g <= v), default=None)
    above = min((g for g in grid if g >= v), default=None)
    tie = below is not None and above is not None and below != above and v - below == above - v
    return {
        "element": fmt.name,
        "value": v,
        "below": below,
        "above": above,
        "rounded": rounded,
        "code": code,
        "code_hex": f"0x{code:02X}",
        **bit_fields(code, fmt),
        "error": rounded - v,
        "rel_error": abs(rounded - v) / abs(v) if v != 0 else 0.0,
        "tie": tie,
        "saturated": abs(v) > fmt.max,
    }


# ----------------------------------------------------------------------------- one block


def block_info(
    block,
    scheme: str = "mxfp4",
    scale_mode: str = "even",
    global_scale: float | None = None,
) -> dict:
    """One block taken through quantization and back, every intermediate returned.

    Args:
        block: ``block_size`` numbers (32 for OCP MX, 16 for NVFP4): a list or a 1D tensor; they
            are rounded to fp32.
        scheme: ``mxfp4``, ``mxfp6_e2m3``, ``mxfp6_e3m2``, ``mxfp8_e4m3``, ``mxfp8_e5m2`` or ``nvfp4``.
        scale_mode: the E8M0 rule for OCP MX: ``floor``, ``even`` or ``rceil`` (ignored for NVFP4).
        global_scale: NVFP4 only: the fp32 *encode* global scale (vLLM's ``1 / input_scale``);
            ``None`` uses ``6 * 448 / amax`` of the block (what calibration on it would give).

    Returns:
        dict with lists of ``block_size`` floats ``x``, ``scaled`` (``x`` divided by the scale, before
        rounding), ``elements`` (rounded to the element grid), ``dequant`` (the QDQ result, fp32) and
        ``error`` (``dequant - x``); ``codes`` (ints, one per element), ``packed_hex`` (the packed
        bytes as hex), ``clipped`` (bools: ``|scaled| > element max``); scalars ``amax``,
        ``scale_byte`` (E8M0 byte, or the ue4m3 code of the NVFP4 block scale), ``scale`` (the
        decoded block scale), ``scale_exponent`` (MX only), ``global_scale`` (NVFP4 only),
        ``sqnr_db``. ``dequant`` equals ``mxlib.reference.quant_dequant`` of the block bit for bit.

    Raises:
        ValueError: the block length is not the scheme's block size; unknown scheme or rule.
    """
    s = get_block_scheme(scheme)
    x = torch.as_tensor(block, dtype=torch.float32).reshape(-1)
    if x.numel() != s.block_size:
        raise ValueError(f"block: {s.name} blocks hold block_size={s.block_size} values, got {x.numel()}")
    fmt = s.element
    amax = float(x.abs().max())
    row = x.unsqueeze(0)
    info: dict = {"scheme": s.name, "element": fmt.name, "x": x.tolist(), "amax": amax}
    if s.has_global_scale:
        if global_scale is None:
            gs = torch.tensor(_FP4_TIMES_FP8_MAX, dtype=torch.float32) / x.abs().max() if amax > 0 else torch.tensor(1.0)
        else:
            gs = torch.tensor(float(global_scale), dtype=torch.float32)
        elements, bscale = R.ref_nvfp4_quant(row, gs, s.block_size)
        dequant = R.ref_nvfp4_quant_dequant(row, gs, s.block_size)[0]
        bs = float(bscale.reshape(()))
        codes = R.encode_element(elements[0], fmt)
        decode_scale = bs / float(gs)
        # vLLM's quantize multiplier recip(s * recip(gs)), recip(v) = 1 / (v + (v == 0) * 1e8), in fp32
        q = 1.0 / (bscale.reshape(()) * (1.0 / gs) + (bscale.reshape(()) == 0) * 1e8)
        scaled = x * q
        info.update(
            scale_mode=None,
            global_scale=float(gs),
            scale_byte=int(R.encode_element(bscale.reshape(1), _E4M3)[0]),
            scale=bs,
            scale_exponent=None,
            decode_scale=decode_scale,
        )
    else:
        get_scale_mode(scale_mode)
        packed, byte = R.quantize_mx(row, fmt.name, s.block_size, scale_mode)
        dequant = R.dequantize_mx(packed, byte, fmt.name, s.block_size, torch.float32)[0]
        b = int(byte.reshape(()))
        scale = float(R.decode_e8m0(byte).reshape(()))
        codes = R.unpack_codes(packed, fmt)[0]
        scaled = x / scale
        elements = R.decode_element(codes, fmt).unsqueeze(0)
        info.update(
            scale_mode=scale_mode,
            global_scale=None,
            scale_byte=b,
            scale=scale,
            scale_exponent=b - E8M0_BIAS if b != 0xFF else None,
            decode_scale=scale,
        )
    packed_bytes = R.pack_codes(codes.reshape(1, -1), fmt)[0]
    info.update(
        scaled=scaled.tolist(),
        elements=elements.reshape(-1).tolist(),
        codes=[int(c) for c in codes],
        packed_hex=" ".join(f"{int(b):02X}" for b in packed_bytes),
        clipped=(scaled.abs() > fmt.max).tolist(),
        dequant=dequant.tolist(),
        error=(dequant - x).tolist(),
        sqnr_db=_sqnr_db(dequant, x),
    )
    return info


def scale_bytes(amax: float, element: str | ElementFormat = "e2m1") -> dict:
    """The E8M0 byte of a block with this amax under each rule: ``{"floor": b, "even": b, "rceil": b}``."""
    a = torch.tensor([float(amax)], dtype=torch.float32)
    return {mode: int(R.e8m0_scale(a, element, mode)[0]) for mode in ("floor", "even", "rceil")}


def floor_clips_rceil_does_not(block, scheme: str = "mxfp4") -> bool:
    """Exercise checker: True when the OCP floor rule saturates an element of ``block`` and rceil does not."""
    floor = block_info(block, scheme, "floor")
    rceil = block_info(block, scheme, "rceil")
    return any(floor["clipped"]) and not any(rceil["clipped"])


# ----------------------------------------------------------------------------- synthetic experts


def _expert_activations(num_experts: int, ratio: float, tokens: int, hidden: int, seed: int) -> torch.Tensor:
    """``[E, tokens, hidden]`` fp32; expert ``e`` has amax ``ratio ** (e / (E - 1))`` exactly."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_experts, tokens, hidden, generator=g)
    x = x / x.reshape(num_experts, -1).abs().amax(dim=1).reshape(-1, 1, 1)  # every expert's amax is 1
    amax = torch.tensor([ratio ** (e / (num_experts - 1)) for e in range(num_experts)], dtype=torch.float32)
    return x * amax.reshape(-1, 1, 1)


def expert_scale_ratio(
    ratio: float,
    num_experts: int = 2,
    tokens: int = 32,
    hidden: int = 256,
    seed: int = 0,
) -> list[dict]:
    """NVFP4 activation QDQ of synthetic experts whose amax differ by ``ratio``, two ways.

    Expert ``e`` (of ``num_experts`` >= 2) holds Gaussian activations ``[tokens, hidden]`` scaled so
    that its amax is exactly ``ratio ** (e / (num_experts - 1))``: expert 0 has amax 1, the last
    ``ratio``. Each expert is quantized (``mxlib.reference.ref_nvfp4_quant_dequant``) with

    * ``unified``: one encode global scale ``6 * 448 / max_e amax_e`` for all experts (vLLM's
      emulation: ``1 / max(input_scale)``, as FlashInfer's kernels need), and
    * ``per_expert``: its own ``6 * 448 / amax_e`` (each expert's calibrated input_scale).

    Returns one row per expert: ``expert``, ``amax``, ``sqnr_unified_db``, ``sqnr_per_expert_db``,
    ``subnormal_blocks`` and ``flushed_blocks`` (fractions of the expert's 16-element blocks whose
    unified-scale ue4m3 block scale is subnormal, ``0 < s < 2**-6``, or zero although the block is
    not), and ``max_block_scale`` (the largest unified block scale). The unified SQNR falls once
    ``ratio`` drops below ``NVFP4_SUBNORMAL_RATIO`` (``2**-6 / 448``) and reaches 0 dB (all output
    zero) below ``NVFP4_FLUSH_RATIO`` (``2**-10 / 448``); smaller blocks of an expert cross earlier.

    Raises:
        ValueError: ``ratio`` not in (0, 1], ``num_experts`` < 2, ``hidden`` not a multiple of 16.
    """
    if not (0.0 < ratio <= 1.0):
        raise ValueError(f"ratio: expected a number in (0, 1] (smallest over largest expert amax), got {ratio}")
    if num_experts < 2:
        raise ValueError(f"num_experts: expected at least 2, got {num_experts}")
    if hidden % NVFP4_BLOCK_SIZE:
        raise ValueError(f"hidden={hidden} is not a multiple of block_size={NVFP4_BLOCK_SIZE}")
    x = _expert_activations(num_experts, ratio, tokens, hidden, seed)
    amax = x.reshape(num_experts, -1).abs().amax(dim=1)
    two688 = torch.tensor(_FP4_TIMES_FP8_MAX, dtype=torch.float32)
    gs_unified = two688 / amax.max()
    gs_per_expert = two688 / amax
    rows = []
    for e in range(num_experts):
        xe = x[e]
        unified = R.ref_nvfp4_quant_dequant(xe, gs_unified)
        own = R.ref_nvfp4_quant_dequant(xe, gs_per_expert[e])
        _, s = R.ref_nvfp4_quant(xe, gs_unified)
        bamax = xe.reshape(tokens, -1, NVFP4_BLOCK_SIZE).abs().amax(dim=-1)
        rows.append({
            "expert": e,
            "amax": float(amax[e]),
            "sqnr_unified_db": _sqnr_db(unified, xe),
            "sqnr_per_expert_db": _sqnr_db(own, xe),
            "subnormal_blocks": float(((s > 0) & (s < _E4M3.min_normal)).float().mean()),
            "flushed_blocks": float(((s == 0) & (bamax > 0)).float().mean()),
            "max_block_scale": float(s.max()),
        })
    return rows


def expert_scale_ratio_sweep(ratios, **kwargs) -> list[dict]:
    """``expert_scale_ratio`` of the smallest expert for each ratio: rows with ``ratio`` added."""
    return [{"ratio": float(r), **expert_scale_ratio(float(r), **kwargs)[-1]} for r in ratios]


def add_scale_ratio_thresholds(fig, y_range=None):
    """Draw ``NVFP4_SUBNORMAL_RATIO`` and ``NVFP4_FLUSH_RATIO`` on a figure whose x axis is an expert
    scale ratio (log or linear), as two dashed line traces from the lowest to the highest y of the
    figure's traces (or ``y_range = (y0, y1)``). Returns ``fig``.

    Traces rather than ``add_vline`` shapes: plotly places shapes and their annotations
    inconsistently on log axes (plotly.py issue #4012).
    """
    import plotly.graph_objects as go

    if y_range is None:
        ys = [float(y) for tr in fig.data if getattr(tr, "y", None) is not None for y in tr.y
              if y is not None and math.isfinite(float(y))]
        y_range = (min(ys, default=0.0), max(ys, default=1.0))
    for ratio, name in ((NVFP4_SUBNORMAL_RATIO, "r = 2^-6/448: largest block scale subnormal"),
                        (NVFP4_FLUSH_RATIO, "r = 2^-10/448: every block flushed")):
        fig.add_trace(go.Scatter(x=[ratio, ratio], y=list(y_range), mode="lines", name=name,
                                 line=dict(dash="dash", color="gray" if ratio == NVFP4_SUBNORMAL_RATIO else "black")))
    return fig


def loses_without_flushing(ratio: float, min_db: float = 2.0, **kwargs) -> bool:
    """Exercise checker (notebook 04): True when, at this ``ratio``, the smallest synthetic expert of
    ``expert_scale_ratio`` loses more than ``min_db`` dB under the unified scale against its own scale
    while none of its blocks is flushed (its block scales are subnormal, not zero). Answers lie
    between ``NVFP4_FLUSH_RATIO`` and ``NVFP4_SUBNORMAL_RATIO``. ``kwargs`` go to ``expert_scale_ratio``."""
    row = expert_scale_ratio(float(ratio), **kwargs)[-1]
    return row["sqnr_per_expert_db"] - row["sqnr_unified_db"] > min_db and row["flushed_blocks"] == 0.0


def is_largest_flushing_power_of_two(ratio: float, **kwargs) -> bool:
    """Exercise checker (notebook 04): True when ``ratio`` is a power of two at which every block of
    the smallest synthetic expert is flushed under the unified scale (its QDQ output is all zero)
    while at ``2 * ratio`` at least one block survives.

    By hand: the expert's largest block scale is ``e4m3(448 * ratio)`` and rounds to zero when it is
    at most ``2**-10`` (half the smallest subnormal ``2**-9``; the tie goes to the even code 0), so
    the answer is ``2**-19`` (``448 * 2**-19 = 0.875 * 2**-10``; ``448 * 2**-18 = 1.75 * 2**-10``
    rounds up to ``2**-9``).

    Raises:
        ValueError: ``ratio`` not in (0, 1].
    """
    ratio = float(ratio)
    if not (0.0 < ratio <= 1.0):
        raise ValueError(f"ratio: expected a number in (0, 1], got {ratio}")
    if math.frexp(ratio)[0] != 0.5:
        return False
    here = expert_scale_ratio(ratio, **kwargs)[-1]["flushed_blocks"]
    above = expert_scale_ratio(min(2.0 * ratio, 1.0), **kwargs)[-1]["flushed_blocks"] if ratio < 1.0 else 0.0
    return here == 1.0 and above < 1.0


# ----------------------------------------------------------------------------- outliers


def outlier_data(
    outlier_scale: float, rows: int = 64, row_length: int = 1024, outlier_fraction: float = 1e-3, seed: int = 0
) -> torch.Tensor:
    """Gaussian ``[rows, row_length]`` fp32 in which ``round(outlier_fraction * numel)`` (at least one)
    positions, chosen at random, are multiplied by ``outlier_scale``. The positions and the Gaussian
    values depend only on the seed, so a sweep over ``outlier_scale`` changes nothing else."""
    if row_length % 32:
        raise ValueError(f"row_length={row_length} is not a multiple of 32 (the MX block size)")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, row_length, generator=g)
    n = max(1, round(outlier_fraction * x.numel()))
    idx = torch.randperm(x.numel(), generator=g)[:n]
    x.view(-1)[idx] *= float(outlier_scale)
    return x


def outlier_scale_sqnr(outlier_scale: float, schemes=tuple(BLOCK_SCHEMES), scale_mode: str = "even", **data_kwargs) -> dict:
    """SQNR (dB) of QDQ in each scheme on ``outlier_data(outlier_scale, **data_kwargs)``.

    OCP MX schemes use the E8M0 rule ``scale_mode``; NVFP4 uses the global scale ``6 * 448 / amax``
    of the whole tensor (``mxlib.reference.quant_dequant``). Returns ``{scheme: sqnr_db}``.
    """
    x = outlier_data(outlier_scale, **data_kwargs)
    out = {}
    for name in schemes:
        kw = {} if get_block_scheme(name).has_global_scale else {"scale_mode": scale_mode}
        out[name] = _sqnr_db(R.quant_dequant(x, name, **kw), x)
    return out


def outlier_scale_sweep(outlier_scales, **kwargs) -> list[dict]:
    """``outlier_scale_sqnr`` for each scale: rows ``{"outlier_scale", scheme: sqnr_db, ...}``."""
    return [{"outlier_scale": float(s), **outlier_scale_sqnr(float(s), **kwargs)} for s in outlier_scales]


# ----------------------------------------------------------------------------- a stored checkpoint


def stored_shapes(scheme: str, out_features: int, in_features: int) -> dict:
    """Shapes and dtypes a ModelOpt / Quark checkpoint stores for one ``[out_features, in_features]``
    expert weight in ``scheme``'s weight format (a block scheme name or a MoE scheme name).

    ``weight``: uint8 ``[out, in * bits / 8]`` (FP4: two codes a byte, FP6: four codes in three
    bytes, FP8: one a byte); ``weight_scale``: one scale per ``block_size`` inputs, ``[out, in /
    block_size]``, float8_e4m3fn (NVFP4, block 16) or uint8 E8M0 (OCP MX, block 32). Returns
    ``{"weight": (shape, dtype), "weight_scale": (shape, dtype)}`` with shapes as tuples, dtypes as
    the safetensors names (``U8``, ``F8_E4M3``).

    Raises:
        ValueError: unknown scheme; ``in_features`` not a multiple of the block size.
    """
    from .moe import get_moe_scheme

    bs = get_block_scheme(scheme) if scheme in BLOCK_SCHEMES else get_moe_scheme(scheme).weight
    if in_features % bs.block_size:
        raise ValueError(f"in_features={in_features} is not a multiple of block_size={bs.block_size}")
    scale_dtype = "F8_E4M3" if bs.has_global_scale else "U8"
    return {"weight": ((out_features, bs.element.packed_size(in_features)), "U8"),
            "weight_scale": ((out_features, in_features // bs.block_size), scale_dtype)}


def stored_block(path, layer: int = 0, expert: int = 0, proj: str = "gate_proj", row: int = 0, block: int = 0) -> dict:
    """One block of one stored expert weight, read from the checkpoint's safetensors and decoded.

    Args:
        path: a checkpoint folder written by ``write_quantized_checkpoint`` (ModelOpt NVFP4 or Quark
            OCP MX layout; its ``config.json`` names the scheme).
        layer, expert: which expert; ``proj``: ``gate_proj``, ``up_proj`` or ``down_proj``.
        row: the output row; ``block``: the block index along the input dimension.

    Returns:
        dict: ``scheme``, ``tensor`` (the weight's name), ``bytes_hex`` (the packed bytes of the
        block as stored), ``codes`` (element codes), ``elements`` (their values), ``scale_byte``
        (E8M0 byte, or the e4m3 byte of the NVFP4 block scale), ``block_scale`` (decoded),
        ``weight_scale_2`` (NVFP4's per-tensor decode scale, else None) and ``values``: the
        dequantized weights, ``elements * block_scale (* weight_scale_2)`` in fp32 (bit-equal to
        ``mxlib.reference``'s dequantization of that row).

    Raises:
        ValueError: ``proj`` unknown or ``row`` / ``block`` outside the stored tensor.
    """
    import json as _json
    from pathlib import Path

    from safetensors import safe_open

    from .models.checkpoints import read_quant_config

    if proj not in ("gate_proj", "up_proj", "down_proj"):
        raise ValueError(f"proj: expected gate_proj, up_proj or down_proj, got {proj!r}")
    path = Path(path)
    bs = read_quant_config(path).scheme.weight
    index = _json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    name = f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"
    if name not in index:
        raise ValueError(f"layer={layer}, expert={expert}: {name} is not in the checkpoint")

    def read(tensor):
        with safe_open(str(path / index[tensor]), "pt") as f:
            return f.get_tensor(tensor)

    w, sc = read(name), read(name + "_scale")
    if not 0 <= row < w.shape[0]:
        raise ValueError(f"row: expected an integer in [0, {w.shape[0]}), got {row}")
    if not 0 <= block < sc.shape[1]:
        raise ValueError(f"block: expected an integer in [0, {sc.shape[1]}), got {block}")
    fmt = bs.element
    nbytes = fmt.packed_size(bs.block_size)
    raw = w[row, block * nbytes:(block + 1) * nbytes].reshape(1, -1)
    codes = R.unpack_codes(raw, fmt)[0]
    elements = R.decode_element(codes, fmt)
    if bs.has_global_scale:
        s = sc[row, block].reshape(1)
        scale_byte = int(s.view(torch.uint8)[0])
        block_scale = float(s.float()[0])
        ws2 = float(read(name + "_scale_2").float().reshape(()))
        # vLLM's dequantize_to_dtype: e2m1 * (fp32(block_scale) * weight_scale_2), in fp32
        values = elements * (torch.tensor(block_scale, dtype=torch.float32) * torch.tensor(ws2, dtype=torch.float32))
    else:
        scale_byte = int(sc[row, block].view(torch.uint8))
        block_scale = float(R.decode_e8m0(torch.tensor([scale_byte], dtype=torch.uint8))[0])
        ws2 = None
        values = elements * block_scale
    return {"scheme": bs.name, "tensor": name, "row": row, "block": block,
            "bytes_hex": " ".join(f"{int(b):02X}" for b in raw[0]), "codes": [int(c) for c in codes],
            "elements": elements.tolist(), "scale_byte": scale_byte, "block_scale": block_scale,
            "weight_scale_2": ws2, "values": values.tolist()}


class swapped_nibbles:
    """``with swapped_nibbles(model): ...`` runs ``model`` with every packed expert weight byte's two
    FP4 codes swapped (``b -> (b << 4 | b >> 4) & 0xFF``), then swaps them back (an involution).

    Notebook 01's negative control: a packing bug of the kind the loader cannot see (the shapes,
    dtypes and scales are all right) scrambles every expert's weights, and the metrics must say so.
    Acts on the ``w13_weight`` and ``w2_weight`` uint8 buffers of every module that has both (the
    emulation experts); for FP6 and FP8 weights the swap scrambles their bytes likewise. Yields the
    number of modules changed.

    Raises:
        ValueError: ``model`` has no such module (nothing to corrupt: the control would prove nothing).
    """

    def __init__(self, model) -> None:
        self.buffers = [t for m in model.modules() for t in (getattr(m, "w13_weight", None), getattr(m, "w2_weight", None))
                        if isinstance(t, torch.Tensor) and t.dtype == torch.uint8]
        if not self.buffers:
            raise ValueError("model: no module with uint8 w13_weight / w2_weight buffers (no quantized experts)")

    @staticmethod
    def _swap(t: torch.Tensor) -> None:
        t.copy_(((t << 4) | (t >> 4)) & 0xFF)

    def __enter__(self) -> int:
        for t in self.buffers:
            self._swap(t)
        return len(self.buffers) // 2

    def __exit__(self, *exc) -> None:
        for t in self.buffers:
            self._swap(t)


class captured_output:
    """``with captured_output(module) as outs: ...`` appends each output of ``module`` (its first
    element when it returns a tuple) to the list ``outs``, detached, as fp32 on the CPU; the hook is
    removed on exit."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.outputs: list[torch.Tensor] = []
        self.handle = None

    def _hook(self, module, args, output) -> None:
        out = output[0] if isinstance(output, (tuple, list)) else output
        self.outputs.append(out.detach().float().cpu().clone())

    def __enter__(self) -> list[torch.Tensor]:
        self.handle = self.module.register_forward_hook(self._hook)
        return self.outputs

    def __exit__(self, *exc) -> None:
        self.handle.remove()


# ----------------------------------------------------------------------------- widgets (thin)


def rows_table(rows: list[dict], columns: list[str] | None = None, caption: str = ""):
    """An HTML table (``IPython.display.HTML``) of dict rows, every row shown, floats to 6 digits.

    Unlike a pandas frame it never elides rows, and it needs no trusted notebook to render. Cells
    are left-aligned; a column holding long text (over 40 characters) wraps within 10-40 em, the
    others never wrap, so names stay whole and the table fits the page.
    """
    from html import escape

    from IPython.display import HTML

    if not rows:
        raise ValueError("rows: expected at least one row")
    cols = columns or list(rows[0])
    text = [[_fmt(r.get(c, "")) for c in cols] for r in rows]
    long = [max(len(t[j]) for t in text) > 40 for j in range(len(cols))]
    style = ["text-align:left;vertical-align:top;" + ("white-space:normal;min-width:10em;max-width:40em"
                                                       if lg else "white-space:nowrap") for lg in long]
    cap = f"<caption>{escape(caption)}</caption>" if caption else ""
    head = "".join(f'<th style="{st}">{escape(str(c))}</th>' for c, st in zip(cols, style))
    body = "".join("<tr>" + "".join(f'<td style="{st}">{escape(t)}</td>' for t, st in zip(row, style)) + "</tr>"
                   for row in text)
    return HTML(f'<table class="mxlib-rows" style="width:100%">{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>')


def _show_rows(rows: list[dict]) -> None:
    from IPython.display import display

    display(rows_table(rows))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def value_explorer_widget(value: float = 2.6, element: str = "e2m1"):
    """A text box for a value and a drop-down for the element format, showing ``value_info``."""
    import ipywidgets as w

    keys = ("value", "below", "above", "rounded", "error", "rel_error", "code_hex", "bits", "kind", "formula",
            "tie", "saturated")

    def show(value, element):
        info = value_info(value, element)
        _show_rows([{k: info[k] for k in keys}])

    return w.interactive(show, value=w.FloatText(value=value, description="value"),
                         element=w.Dropdown(options=list(_element_names()), value=element, description="format"))


def _element_names():
    return list(ELEMENT_FORMATS)


def block_explorer_widget(block=None, scheme: str = "mxfp4", scale_mode: str = "even"):
    """An editable comma-separated block, a scheme and a scale rule, showing ``block_info``."""
    import ipywidgets as w

    if block is None:
        block = [round(0.37 * (i - 15.5) * (1 + (i % 5 == 0) * 4), 3) for i in range(32)]

    def show(text, scheme, scale_mode):
        try:
            values = [float(t) for t in text.replace("\n", ",").split(",") if t.strip()]
            info = block_info(values, scheme, scale_mode)
        except ValueError as err:
            print(err)
            return
        print(f"amax {info['amax']:.6g}  scale byte 0x{info['scale_byte']:02X}  scale {info['scale']:.6g}  "
              f"SQNR {info['sqnr_db']:.2f} dB  packed {info['packed_hex']}")
        _show_rows([{"x": a, "scaled": b, "code": c, "element": d, "dequant": e, "error": f, "clipped": g}
                    for a, b, c, d, e, f, g in zip(info["x"], info["scaled"], info["codes"], info["elements"],
                                                   info["dequant"], info["error"], info["clipped"])])

    return w.interactive(
        show,
        text=w.Textarea(value=", ".join(str(v) for v in block), description="block", layout=w.Layout(width="90%")),
        scheme=w.Dropdown(options=list(BLOCK_SCHEMES), value=scheme, description="scheme"),
        scale_mode=w.Dropdown(options=["floor", "even", "rceil"], value=scale_mode, description="E8M0 rule"),
    )


def expert_scale_ratio_widget(num_experts: int = 2, **kwargs):
    """A log2 slider for the expert amax ratio, showing ``expert_scale_ratio`` rows."""
    import ipywidgets as w

    def show(log2_ratio):
        print(f"ratio 2^{log2_ratio} = {2.0**log2_ratio:.3g}; thresholds 2^-6/448 = {NVFP4_SUBNORMAL_RATIO:.3g}, "
              f"2^-10/448 = {NVFP4_FLUSH_RATIO:.3g}")
        _show_rows(expert_scale_ratio(2.0**log2_ratio, num_experts=num_experts, **kwargs))

    return w.interactive(show, log2_ratio=w.IntSlider(value=-12, min=-24, max=0, description="log2 ratio"))


def outlier_scale_widget(**kwargs):
    """A log10 slider for the outlier magnitude, showing ``outlier_scale_sqnr``."""
    import ipywidgets as w

    def show(log10_scale):
        _show_rows([{"outlier_scale": 10.0**log10_scale, **outlier_scale_sqnr(10.0**log10_scale, **kwargs)}])

    return w.interactive(show, log10_scale=w.FloatSlider(value=2.0, min=0.0, max=4.0, step=0.25,
                                                         description="log10 outlier"))
