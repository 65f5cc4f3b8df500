"""Plain functions behind the workbook's interactive explorers, and the thin widgets themselves.

Each explorer is a plain function that returns a dict (or a list of dict rows) of numbers, tested
in ``tests/test_explore.py`` against ml_dtypes and hand-computed grids; the ``*_widget()``
functions only wire ipywidgets sliders and text boxes to them, and show rows with ``rows_table``.

* ``value_info(value, element)``: one value on one element grid: its code and bit fields, the
  grid neighbours below and above, the rounded value (nearest, ties to even, saturating) and
  the rounding error.
* ``block_info(block, scheme, scale_mode)``: one editable block through quantization: amax, the
  scale byte (E8M0 for OCP MX, ue4m3 plus an fp32 global scale for NVFP4), scaled values, codes,
  packed bytes, the QDQ result and its error.
* ``expert_scale_ratio(ratio)``: synthetic MoE experts whose activation amax differ by ``ratio``,
  NVFP4 QDQ error of each under one unified (max) global scale and under per-expert scales, as
  vLLM's emulation (unified) and an ideal per-expert kernel would see them; the thresholds where
  block scales turn subnormal and flush are ``mxlib.formats.NVFP4_SUBNORMAL_RATIO`` and
  ``NVFP4_FLUSH_RATIO``.
* ``outlier_scale_sqnr(outlier_scale)``: SQNR of each block scheme on Gaussian data with a few
  outliers of a given magnitude.
* ``rows_table(rows)``: an HTML table of dict rows, every row shown (what the widgets and the
  notebooks display).

All arithmetic goes through ``mxlib.reference``; these functions add no rounding of their own.
What a checkpoint stores, and notebook 01's negative control, are in ``mxlib.studies.probes``;
the exercise checkers built on these explorers in ``mxlib.workbook.checks``.
"""

from __future__ import annotations

import math

import torch

from .. import reference as R
from ..analysis import sqnr_db
from ..formats import (
    BLOCK_SCHEMES,
    E8M0_BIAS,
    ELEMENT_FORMATS,
    NVFP4_BLOCK_SIZE,
    NVFP4_FLUSH_RATIO,
    NVFP4_SCALE_DIVISOR,
    NVFP4_SUBNORMAL_RATIO,
    ElementFormat,
    get_block_scheme,
    get_element_format,
    get_scale_mode,
)

__all__ = [
    "bit_fields",
    "value_info",
    "block_info",
    "scale_bytes",
    "MIN_EXPERT_RATIO",
    "expert_scale_ratio",
    "expert_scale_ratio_sweep",
    "outlier_data",
    "outlier_scale_sqnr",
    "outlier_scale_sweep",
    "rows_table",
    "value_explorer_widget",
    "block_explorer_widget",
    "expert_scale_ratio_widget",
    "outlier_scale_widget",
    "STATIC_NOTE",
]

_E4M3 = get_element_format("e4m3")


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
            gs = (
                torch.tensor(NVFP4_SCALE_DIVISOR, dtype=torch.float32) / x.abs().max()
                if amax > 0
                else torch.tensor(1.0)
            )
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
        packed, byte = R.quantize_mx(row, fmt, s.block_size, scale_mode)
        dequant = R.dequantize_mx(packed, byte, fmt, s.block_size, torch.float32)[0]
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
        sqnr_db=sqnr_db(dequant, x),
    )
    return info


def scale_bytes(amax: float, element: str | ElementFormat = "e2m1") -> dict:
    """The E8M0 byte of a block with this amax under each rule: ``{"floor": b, "even": b, "rceil": b}``."""
    a = torch.tensor([float(amax)], dtype=torch.float32)
    return {mode: int(R.e8m0_scale(a, element, mode)[0]) for mode in ("floor", "even", "rceil")}


# ----------------------------------------------------------------------------- synthetic experts


def _expert_activations(num_experts: int, ratio: float, tokens: int, hidden: int, seed: int) -> torch.Tensor:
    """``[E, tokens, hidden]`` fp32; expert ``e`` has amax ``ratio ** (e / (E - 1))`` exactly."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_experts, tokens, hidden, generator=g)
    x = x / x.reshape(num_experts, -1).abs().amax(dim=1).reshape(-1, 1, 1)  # every expert's amax is 1
    amax = torch.tensor([ratio ** (e / (num_experts - 1)) for e in range(num_experts)], dtype=torch.float32)
    return x * amax.reshape(-1, 1, 1)


# The smallest amax ratio ``expert_scale_ratio`` takes: the smaller expert's own encode global scale
# ``6 * 448 / amax`` stays at or below 2**125, inside the fp32 range ``[2**-126, 2**126]`` that vLLM's NVFP4 QDQ
# accepts (``mxlib.reference.ref_nvfp4_quant_dequant``), with a power of two to spare for the amax's rounding.
MIN_EXPERT_RATIO = NVFP4_SCALE_DIVISOR * 2.0**-125


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
        ValueError: ``ratio`` not in [``MIN_EXPERT_RATIO``, 1] (about 6.3e-35: below it the smaller expert's own
            global scale ``6 * 448 / amax`` leaves fp32's range), ``num_experts`` < 2, ``hidden`` not a multiple
            of 16.
    """
    if not (0.0 < ratio <= 1.0):
        raise ValueError(f"ratio: expected a number in (0, 1] (smallest over largest expert amax), got {ratio}")
    if ratio < MIN_EXPERT_RATIO:
        raise ValueError(
            f"ratio: expected at least {MIN_EXPERT_RATIO:.3g} (6 * 448 * 2**-125), got {ratio:.3g}: below it the "
            "smaller expert's own global scale 6 * 448 / amax exceeds 2**125, outside the fp32 range NVFP4's QDQ "
            "takes"
        )
    if num_experts < 2:
        raise ValueError(f"num_experts: expected at least 2, got {num_experts}")
    if hidden % NVFP4_BLOCK_SIZE:
        raise ValueError(f"hidden={hidden} is not a multiple of block_size={NVFP4_BLOCK_SIZE}")
    x = _expert_activations(num_experts, ratio, tokens, hidden, seed)
    amax = x.reshape(num_experts, -1).abs().amax(dim=1)
    two688 = torch.tensor(NVFP4_SCALE_DIVISOR, dtype=torch.float32)
    gs_unified = two688 / amax.max()
    gs_per_expert = two688 / amax
    rows = []
    for e in range(num_experts):
        xe = x[e]
        unified = R.ref_nvfp4_quant_dequant(xe, gs_unified)
        own = R.ref_nvfp4_quant_dequant(xe, gs_per_expert[e])
        _, s = R.ref_nvfp4_quant(xe, gs_unified)
        bamax = xe.reshape(tokens, -1, NVFP4_BLOCK_SIZE).abs().amax(dim=-1)
        rows.append(
            {
                "expert": e,
                "amax": float(amax[e]),
                "sqnr_unified_db": sqnr_db(unified, xe),
                "sqnr_per_expert_db": sqnr_db(own, xe),
                "subnormal_blocks": float(((s > 0) & (s < _E4M3.min_normal)).float().mean()),
                "flushed_blocks": float(((s == 0) & (bamax > 0)).float().mean()),
                "max_block_scale": float(s.max()),
            }
        )
    return rows


def expert_scale_ratio_sweep(ratios, **kwargs) -> list[dict]:
    """``expert_scale_ratio`` of the smallest expert for each ratio: rows with ``ratio`` added."""
    return [{"ratio": float(r), **expert_scale_ratio(float(r), **kwargs)[-1]} for r in ratios]


# ----------------------------------------------------------------------------- outliers


def outlier_data(
    outlier_scale: float,
    rows: int = 64,
    row_length: int = 1024,
    outlier_fraction: float = 1e-3,
    seed: int = 0,
    return_mask: bool = False,
):
    """Gaussian ``[rows, row_length]`` fp32 in which ``round(outlier_fraction * numel)`` (at least one)
    positions, chosen at random, are multiplied by ``outlier_scale``. The positions and the Gaussian
    values depend only on the seed, so a sweep over ``outlier_scale`` changes nothing else.
    ``return_mask=True`` returns ``(x, mask)``, ``mask`` a bool tensor of the outlier positions."""
    if row_length % 32:
        raise ValueError(f"row_length={row_length} is not a multiple of 32 (the MX block size)")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, row_length, generator=g)
    n = max(1, round(outlier_fraction * x.numel()))
    idx = torch.randperm(x.numel(), generator=g)[:n]
    x.view(-1)[idx] *= float(outlier_scale)
    if return_mask:
        mask = torch.zeros(x.numel(), dtype=torch.bool)
        mask[idx] = True
        return x, mask.reshape(x.shape)
    return x


def outlier_scale_sqnr(
    outlier_scale: float, schemes=tuple(BLOCK_SCHEMES), scale_mode: str = "even", **data_kwargs
) -> dict:
    """SQNR (dB) of QDQ in each scheme on ``outlier_data(outlier_scale, **data_kwargs)``.

    OCP MX schemes use the E8M0 rule ``scale_mode``; NVFP4 uses the global scale ``6 * 448 / amax``
    of the whole tensor (``mxlib.reference.quant_dequant``). Returns ``{scheme: sqnr_db}``.
    """
    x = outlier_data(outlier_scale, **data_kwargs)
    out = {}
    for name in schemes:
        kw = {} if get_block_scheme(name).has_global_scale else {"scale_mode": scale_mode}
        out[name] = sqnr_db(R.quant_dequant(x, name, **kw), x)
    return out


def outlier_scale_sweep(outlier_scales, **kwargs) -> list[dict]:
    """``outlier_scale_sqnr`` for each scale: rows ``{"outlier_scale", scheme: sqnr_db, ...}``."""
    return [{"outlier_scale": float(s), **outlier_scale_sqnr(float(s), **kwargs)} for s in outlier_scales]


# ----------------------------------------------------------------------------- widgets (thin)

STATIC_NOTE = (
    "(an interactive widget: live in JupyterLab with a running kernel, `make lab`; a static HTML export "
    "leaves it blank, and the figure or table above shows the same function's numbers)"
)


def _static_note() -> None:
    print(STATIC_NOTE)


def rows_table(rows: list[dict], columns: list[str] | None = None, caption: str = ""):
    """An HTML table (``IPython.display.HTML``) of dict rows, every row shown, floats to 6 digits.

    Unlike a pandas frame it never elides rows, and it needs no trusted notebook to render. Cells
    are left-aligned; a column holding long text (over 40 characters) wraps within 10-40 em, the
    others never wrap, so names stay whole. Column headers may break after an underscore
    (``fused_graph_over_bf16_graph`` over three lines), so a header is no wider than its values; a
    table of more than 12 columns is set in a smaller font; and the table sits in a box that scrolls
    sideways when it is still wider than the page: a wide table never spills over the page's edge.

    Raises:
        ValueError: no rows.
    """
    from html import escape

    from IPython.display import HTML

    if not rows:
        raise ValueError("rows: expected at least one row")
    cols = columns or list(rows[0])
    text = [[_fmt(r.get(c, "")) for c in cols] for r in rows]
    long = [max(len(t[j]) for t in text) > 40 for j in range(len(cols))]
    style = [
        "text-align:left;vertical-align:top;"
        + ("white-space:normal;min-width:10em;max-width:40em" if lg else "white-space:nowrap")
        for lg in long
    ]
    head_style = "text-align:left;vertical-align:bottom;white-space:normal"
    small = ' style="font-size:85%"' if len(cols) > 12 else ""  # many columns: a smaller font
    cap = f"<caption>{escape(caption)}</caption>" if caption else ""
    head = "".join(f'<th style="{head_style}">{escape(str(c)).replace("_", "_<wbr>")}</th>' for c in cols)
    body = "".join(
        "<tr>" + "".join(f'<td style="{st}">{escape(t)}</td>' for t, st in zip(row, style)) + "</tr>" for row in text
    )
    return HTML(
        '<div class="mxlib-rows-box" style="max-width:100%;overflow-x:auto">'
        f'<table class="mxlib-rows"{small}>{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'
    )


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

    keys = (
        "value",
        "below",
        "above",
        "rounded",
        "error",
        "rel_error",
        "code_hex",
        "bits",
        "kind",
        "formula",
        "tie",
        "saturated",
    )

    def show(value, element):
        info = value_info(value, element)
        _show_rows([{k: info[k] for k in keys}])

    _static_note()
    return w.interactive(
        show,
        value=w.FloatText(value=value, description="value"),
        element=w.Dropdown(options=list(_element_names()), value=element, description="format"),
    )


def _element_names():
    return list(ELEMENT_FORMATS)


def block_explorer_widget(block=None, scheme: str = "mxfp4", scale_mode: str = "even", global_scale: float = 0.0):
    """An editable comma-separated block, a scheme, a scale rule and (NVFP4) an encode global scale,
    showing ``block_info``. ``global_scale`` 0 takes ``6 * 448 / amax`` of the block, what calibration on it gives;
    a smaller one stands for a tensor whose amax lies elsewhere (the block scale then leaves the top of e4m3)."""
    import ipywidgets as w

    if block is None:
        block = [round(0.37 * (i - 15.5) * (1 + (i % 5 == 0) * 4), 3) for i in range(32)]

    def show(text, scheme, scale_mode, global_scale):
        try:
            values = [float(t) for t in text.replace("\n", ",").split(",") if t.strip()]
            nv = get_block_scheme(scheme).has_global_scale
            if nv:
                values = values[:NVFP4_BLOCK_SIZE]
            info = block_info(values, scheme, scale_mode, global_scale=(global_scale or None) if nv else None)
        except ValueError as err:
            print(err)
            return
        extra = (
            f"  global scale {info['global_scale']:.6g} (block scale / global = {info['decode_scale']:.6g})"
            if info["global_scale"] is not None
            else ""
        )
        print(
            f"amax {info['amax']:.6g}  scale byte 0x{info['scale_byte']:02X}  scale {info['scale']:.6g}{extra}  "
            f"SQNR {info['sqnr_db']:.2f} dB  packed {info['packed_hex']}"
        )
        _show_rows(
            [
                {"x": a, "scaled": b, "code": c, "element": d, "dequant": e, "error": f, "clipped": g}
                for a, b, c, d, e, f, g in zip(
                    info["x"],
                    info["scaled"],
                    info["codes"],
                    info["elements"],
                    info["dequant"],
                    info["error"],
                    info["clipped"],
                )
            ]
        )

    _static_note()
    return w.interactive(
        show,
        text=w.Textarea(value=", ".join(str(v) for v in block), description="block", layout=w.Layout(width="90%")),
        scheme=w.Dropdown(options=list(BLOCK_SCHEMES), value=scheme, description="scheme"),
        scale_mode=w.Dropdown(options=["floor", "even", "rceil"], value=scale_mode, description="E8M0 rule"),
        global_scale=w.FloatText(value=global_scale, description="NVFP4 gs"),
    )


def expert_scale_ratio_widget(num_experts: int = 2, **kwargs):
    """A log2 slider for the expert amax ratio, showing ``expert_scale_ratio`` rows."""
    import ipywidgets as w

    def show(log2_ratio):
        print(
            f"ratio 2^{log2_ratio} = {2.0**log2_ratio:.3g}; thresholds 2^-6/448 = {NVFP4_SUBNORMAL_RATIO:.3g}, "
            f"2^-10/448 = {NVFP4_FLUSH_RATIO:.3g}"
        )
        _show_rows(expert_scale_ratio(2.0**log2_ratio, num_experts=num_experts, **kwargs))

    _static_note()
    return w.interactive(show, log2_ratio=w.IntSlider(value=-12, min=-24, max=0, description="log2 ratio"))


def outlier_scale_widget(**kwargs):
    """A log10 slider for the outlier magnitude, showing ``outlier_scale_sqnr``."""
    import ipywidgets as w

    def show(log10_scale):
        _show_rows([{"outlier_scale": 10.0**log10_scale, **outlier_scale_sqnr(10.0**log10_scale, **kwargs)}])

    _static_note()
    return w.interactive(
        show, log10_scale=w.FloatSlider(value=2.0, min=0.0, max=4.0, step=0.25, description="log10 outlier")
    )
