"""The lessons of notebook 02 beyond one block: why NVFP4 beats MXFP4, the E8M0 rules per element
format, and what outliers do, as plain functions (the notebook asserts their numbers).

* ``block_format_sqnr(x, element, block_size, scale_format, scale_mode)``: SQNR of QDQ at any block
  size with an E8M0 (power-of-two) or an e4m3 block scale: the 2 x 2 of block size 16 / 32 x scale
  format e4m3 / E8M0 whose corners are MXFP4 (32, E8M0) and NVFP4 (16, e4m3).
* ``amax_on_grid(x, ...)``: where each block's amax lands on the element grid after scaling.
* ``rule_sqnr(x, schemes)``: SQNR of each OCP MX scheme under each E8M0 rule.
* ``outlier_parts(outlier_scale)``: the outlier study split: global SQNR, SQNR on the values that are
  not outliers, and the share of those flushed to zero.
* ``draw_means(rows)``: the mean over draws of each number in per-draw rows (what the notebook's tables show;
  its orderings are decided over the draws themselves, with ``mxlib.stats``).
* ``format_comparison_widget(data)``: drop-downs over all of it (a thin ipywidgets wrapper).

All arithmetic goes through ``mxlib.reference`` (``quant_dequant_mx``, ``ref_nvfp4_quant_dequant``).
"""

from __future__ import annotations

import torch

from .. import reference as R
from ..analysis import sqnr_db
from ..formats import BLOCK_SCHEMES, NVFP4_SCALE_DIVISOR, SCALE_MODES, get_block_scheme, get_element_format
from .explorers import _element_names, _show_rows, _static_note, outlier_data

__all__ = [
    "SCALE_FORMATS",
    "block_format_sqnr",
    "amax_on_grid",
    "rule_sqnr",
    "outlier_parts",
    "outlier_parts_sweep",
    "draw_means",
    "format_comparison_widget",
]


def outlier_parts(outlier_scale: float, schemes=tuple(BLOCK_SCHEMES), scale_mode: str = "even", **data_kwargs) -> dict:
    """The outlier study split in three, per scheme, on ``outlier_data(outlier_scale, **data_kwargs)``.

    Returns ``{scheme: {"global_db", "rest_db", "flushed"}}``: the SQNR (dB) over all values (which the
    outliers' energy dominates), the SQNR over the values that are not outliers, and the share of those
    values (nonzero) that QDQ turns into zero. Arithmetic as ``outlier_scale_sqnr``.
    """
    x, mask = outlier_data(outlier_scale, return_mask=True, **data_kwargs)
    rest = ~mask & (x != 0)
    out = {}
    for name in schemes:
        kw = {} if get_block_scheme(name).has_global_scale else {"scale_mode": scale_mode}
        dq = R.quant_dequant(x, name, **kw)
        out[name] = {
            "global_db": sqnr_db(dq, x),
            "rest_db": sqnr_db(dq[rest], x[rest]),
            "flushed": float((dq[rest] == 0).float().mean()),
        }
    return out


def outlier_parts_sweep(outlier_scales, **kwargs) -> list[dict]:
    """``outlier_parts`` for each scale: rows ``outlier_scale, <scheme>_global_db, <scheme>_rest_db,
    <scheme>_flushed`` for every scheme."""
    rows = []
    for s in outlier_scales:
        parts = outlier_parts(float(s), **kwargs)
        row = {"outlier_scale": float(s)}
        for name, p in parts.items():
            row.update({f"{name}_{k}": v for k, v in p.items()})
        rows.append(row)
    return rows


def draw_means(rows, keys=None) -> dict:
    """``{key: mean over rows}`` of per-draw rows (dicts with the same keys, one per draw of the data): numbers
    averaged, other values (names) taken from the first row; ``keys`` (default: every key) picks and orders the
    keys kept (leave out a per-draw label such as ``seed``).

    Raises:
        ValueError: no rows, rows whose keys differ, or a key of ``keys`` the rows do not hold.
    """
    rows = list(rows)
    if not rows or any(r.keys() != rows[0].keys() for r in rows):
        raise ValueError(f"rows: expected one or more rows with the same keys, got {[sorted(r) for r in rows]}")
    keys = list(rows[0]) if keys is None else list(keys)
    missing = [k for k in keys if k not in rows[0]]
    if missing:
        raise ValueError(f"keys: expected keys of the rows {list(rows[0])}, got {missing}")
    first = rows[0]
    return {
        k: sum(r[k] for r in rows) / len(rows)
        if isinstance(first[k], (int, float)) and not isinstance(first[k], bool)
        else first[k]
        for k in keys
    }


# block-scale format name -> whether it is NVFP4's e4m3 scale under a per-tensor global scale (else a power of two)
SCALE_FORMATS: dict[str, bool] = {"e8m0": False, "e4m3": True}
_NVFP4 = get_block_scheme("nvfp4")


def _check_block_format(x: torch.Tensor, element, block_size: int, scale_format: str):
    """(element format, whether the scale is NVFP4's e4m3) after checking the arguments."""
    if scale_format not in SCALE_FORMATS:
        raise ValueError(f"scale_format: expected one of {list(SCALE_FORMATS)}, got {scale_format!r}")
    fmt = get_element_format(element)
    nv = SCALE_FORMATS[scale_format]
    if nv and fmt is not _NVFP4.element:
        raise ValueError(
            f"element: an e4m3 block scale (NVFP4's arithmetic) takes {_NVFP4.element.name} elements, got {fmt.name!r}"
        )
    if block_size <= 0 or x.shape[-1] % block_size:
        raise ValueError(f"block_size={block_size} does not divide the last dimension {x.shape[-1]}")
    return fmt, nv


def block_format_sqnr(
    x: torch.Tensor, element="e2m1", block_size: int = 32, scale_format: str = "e8m0", scale_mode: str = "even"
) -> float:
    """SQNR (dB) of QDQ of ``x`` with ``element`` elements in blocks of ``block_size`` under one scale a block.

    ``scale_format="e8m0"``: OCP MX arithmetic (``mxlib.reference.quant_dequant_mx``, rule ``scale_mode``)
    at any block size; ``"e4m3"``: NVFP4's arithmetic (``ref_nvfp4_quant_dequant``, e2m1 elements, the
    global scale ``6 * 448 / amax(x)``) at any block size. ``mxfp4`` is (e2m1, 32, e8m0), ``nvfp4`` (e2m1, 16, e4m3).

    Raises:
        ValueError: unknown scale format; an e4m3 scale with elements other than e2m1; a block size
            that does not divide the last dimension.
    """
    fmt, nv = _check_block_format(x, element, block_size, scale_format)
    if not nv:
        dq = R.quant_dequant_mx(x, fmt.name, block_size, scale_mode)
    else:
        gs = torch.tensor(NVFP4_SCALE_DIVISOR, dtype=torch.float32) / x.abs().max()
        dq = R.ref_nvfp4_quant_dequant(x, gs, block_size)
    return sqnr_db(dq, x)


def amax_on_grid(
    x: torch.Tensor, element="e2m1", block_size: int = 32, scale_format: str = "e8m0", scale_mode: str = "even"
) -> torch.Tensor:
    """Each block's amax divided by its block scale: where the block's largest value lands on the element
    grid before rounding (fp32, one value a block, blocks of zeros left out).

    With an E8M0 scale (a power of two) it lands anywhere in a factor-of-two range below the element's
    max (or above it, clipped, under ``floor``); with an e4m3 scale it lands within e4m3's rounding
    of the element's max (6 for e2m1). Arguments as ``block_format_sqnr``.
    """
    fmt, nv = _check_block_format(x, element, block_size, scale_format)
    blocks = x.reshape(-1, block_size)
    amax = blocks.abs().amax(dim=1)
    if not nv:
        scale = R.decode_e8m0(R.e8m0_scale(amax, fmt, scale_mode))
        landed = amax / scale
    else:
        gs = torch.tensor(NVFP4_SCALE_DIVISOR, dtype=torch.float32) / x.abs().max()
        _, s = R.ref_nvfp4_quant(blocks, gs, block_size)
        landed = amax * gs / s.reshape(-1).float()
    return landed[amax > 0]


def rule_sqnr(x: torch.Tensor, schemes=("mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3", "mxfp8_e5m2")) -> list[dict]:
    """SQNR (dB) of QDQ of ``x`` in each OCP MX scheme under each E8M0 rule: rows ``scheme, floor, even,
    rceil, best`` (``best``: the rule with the highest SQNR).

    Raises:
        ValueError: a scheme with a global scale (NVFP4 has no E8M0 rule).
    """
    rows = []
    for name in schemes:
        s = get_block_scheme(name)
        if s.has_global_scale:
            raise ValueError(f"schemes: {name!r} has no E8M0 scale rule; expected OCP MX schemes")
        row = {"scheme": name}
        for mode in SCALE_MODES:
            row[mode] = sqnr_db(R.quant_dequant_mx(x, s.element.name, s.block_size, mode), x)
        row["best"] = max(SCALE_MODES, key=lambda m: row[m])
        rows.append(row)
    return rows


def format_comparison_widget(data: dict):
    """Drop-downs for a data set of ``data`` (``{name: tensor}``), an element format, a block size, a scale
    format and an E8M0 rule, showing ``block_format_sqnr`` (an e4m3 scale takes e2m1 elements only)."""
    import ipywidgets as w

    def show(distribution, element, block_size, scale_format, scale_mode):
        try:
            db = block_format_sqnr(data[distribution], element, block_size, scale_format, scale_mode)
        except ValueError as err:
            print(err)
            return
        rule = "(e4m3 rounding, no rule)" if SCALE_FORMATS[scale_format] else scale_mode
        _show_rows(
            [dict(data=distribution, element=element, block_size=block_size, scale=scale_format, rule=rule, sqnr_db=db)]
        )

    _static_note()
    return w.interactive(
        show,
        distribution=w.Dropdown(options=list(data), description="data"),
        element=w.Dropdown(options=_element_names(), value="e2m1", description="element"),
        block_size=w.Dropdown(options=[16, 32], value=32, description="block_size"),
        scale_format=w.Dropdown(options=list(SCALE_FORMATS), value="e8m0", description="scale"),
        scale_mode=w.Dropdown(options=["floor", "even", "rceil"], value="even", description="E8M0 rule"),
    )
