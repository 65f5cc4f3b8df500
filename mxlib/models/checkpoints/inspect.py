"""Inspect a quantized Qwen3-MoE checkpoint already on disk, reading only its configs and scales.

``inspect_checkpoint(path)`` answers, in seconds even for a 30B checkpoint, what a user wants to
know before loading one: which layout and scheme it is, what is quantized (experts, attention,
other linears) and what is left bf16, whether its tensors have the names, dtypes and shapes the
layout needs, and what its per-expert activation scales say about scale unification.

What it reads:

* ``config.json`` (and legacy files such as ``hf_quant_config.json``) through the layout registry
  (the steps of the loader's ``read_quant_config``: the same layout parsers);
* every safetensors header (names, dtypes, shapes: a few kB per shard);
* the data of the **scale scalars only**: tensors whose names end in ``input_scale``,
  ``weight_scale_2`` or ``global_scale`` (compressed-tensors' ``weight_global_scale`` /
  ``input_global_scale``). Never ``weight``, ``weight_packed`` or the ``weight_scale`` block scales.

The layout check runs the layout's own ``read_experts`` on tensors made from the headers (on
PyTorch's ``meta`` device, so nothing is read), so it checks exactly what the loader checks.

Scale conventions, by tensor name: ``input_scale`` / ``weight_scale_2`` are *decode* scales
(ModelOpt NVFP4 ``amax / (6 * 448)``; Quark's static FP8 ``amax / 448``); ``*global_scale`` are
compressed-tensors' *encode* scales (``6 * 448 / amax``), reported here as their reciprocals so
that every layout reads the same. ``a1`` is the experts' gate/up input (the max of gate's and
up's scale, as the loader takes), ``a2`` their down input.

Unification losses are **predicted** from each expert's ratio ``r = own_scale / unified_scale``
under each strategy of ``mxlib.moe.scales.SCALE_STRATEGIES`` (uncalibrated experts, scale 0,
left out), with notebook 04's e4m3 thresholds: the expert's largest NVFP4 block scale is
``e4m3(448 * r)``, so below ``NVFP4_SUBNORMAL_RATIO = 2**-6 / 448`` even that one is subnormal, and
below ``NVFP4_FLUSH_RATIO = 2**-10 / 448`` it rounds to zero (the whole expert is flushed; smaller
blocks flush earlier). ``r > 1`` (a strategy below the expert's own scale) clips its largest
values. For static FP8 activations the same two ratios bound the expert's largest *element*.
The dB figures come from a small model, not from the checkpoint's activations:
``predicted_db_lost(r, activation)`` is the SQNR lost by one synthetic Gaussian expert
(``[64, 256]``, amax 1, seed 0, as ``mxlib.workbook.explorers.expert_scale_ratio`` builds them) quantized with
scale ``own / r`` instead of its own scale. Real activations have heavier tails (more of their
blocks far below the amax), so they cross the thresholds earlier; read the dB as indicative and
the threshold counts as exact statements about each expert's largest block.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ... import reference as R
from ...formats import NVFP4_FLUSH_RATIO, NVFP4_SUBNORMAL_RATIO, BlockScheme, PerTensorScheme
from ...moe.scales import SCALE_STRATEGIES, unify_input_scales
from .layout import LAYOUTS, PROJS, CheckpointDescription, CheckpointError, layout_for_method, matches
from .safetensors_io import INDEX_NAME, TensorReader

__all__ = [
    "InspectReport",
    "inspect_checkpoint",
    "predicted_db_lost",
    "NVFP4_SUBNORMAL_RATIO",
    "NVFP4_FLUSH_RATIO",
    "SCALE_SUFFIXES",
]


# tensor-name endings whose data is read; everything else is known from the headers only
SCALE_SUFFIXES = ("input_scale", "weight_scale_2", "global_scale")
_ENCODE_SUFFIX = "global_scale"  # compressed-tensors stores encode scales (6 * 448 / amax)
_INPUT_SUFFIXES = ("input_scale", "input_global_scale")
_WEIGHT_GLOBAL_SUFFIXES = ("weight_scale_2", "weight_global_scale")

_EXPERT = re.compile(r"^(?:.*\.)?layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.(\w+)$")
_LAYER_NUM = re.compile(r"\.layers\.\d+\.")
_EXPERT_NUM = re.compile(r"\.experts\.\d+\.")

# safetensors header dtype -> torch dtype (for the meta tensors of the layout check)
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
for _name, _attr in (("F8_E8M0", "float8_e8m0fnu"), ("F4", "float4_e2m1fn_x2")):
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)

# own * fp32(1 / unified) is 1 only to fp32 rounding for the expert that sets the unified scale
_RATIO_TOL = 2.0**-20
_FLOAT_SCALARS = ("F32", "BF16", "F16", "F64")
_FUSED_EXPERTS = ("gate_up_proj", "down_proj")
_ROW_GRID_LOG2 = [x / 4 for x in range(-160, 33)]  # log2 r from -40 to 8 in quarter steps


# ----------------------------------------------------------------------------- the loss model


def _sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    err = (x - y).pow(2).sum().item()
    sig = x.pow(2).sum().item()
    return math.inf if err == 0 else 10.0 * math.log10(sig / err)


def _synthetic_expert() -> torch.Tensor:
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    return x / x.abs().amax()  # amax exactly 1


@functools.lru_cache(maxsize=None)
def _loss_curve(activation: BlockScheme | PerTensorScheme) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``(log2 r grid, dB lost)`` of the synthetic expert for one activation format."""
    x = _synthetic_expert()
    div = activation.scale_divisor  # amax -> decode scale divisor: 2688 (NVFP4) or 448 (FP8)

    def qdq(ratio: float) -> torch.Tensor:
        if isinstance(activation, PerTensorScheme):
            return R.quant_dequant_fp8_per_tensor(x, torch.tensor(1.0 / (div * ratio)))
        return R.ref_nvfp4_quant_dequant(x, torch.tensor(div * ratio, dtype=torch.float32))

    own = _sqnr_db(x, qdq(1.0))
    losses = tuple(max(0.0, own - _sqnr_db(x, qdq(2.0**g))) for g in _ROW_GRID_LOG2)
    return tuple(_ROW_GRID_LOG2), losses


def predicted_db_lost(ratio: float, activation: BlockScheme | PerTensorScheme) -> float:
    """SQNR (dB) a synthetic Gaussian expert loses when quantized with scale ``own / ratio``.

    Args:
        ratio: ``own_scale / unified_scale`` (> 0; 1 means its own scale; below 1 its block
            scales shrink toward e4m3's subnormals, above 1 its largest values clip).
        activation: ``NVFP4`` (``mxlib.formats``) or ``FP8_E4M3_PER_TENSOR``: a format with a
            static scale.

    Returns:
        dB lost against the expert's own scale, >= 0, interpolated linearly in ``log2 ratio``
        on a quarter-octave grid from ``2**-40`` to ``2**8`` (clamped at the ends). A model
        (module docstring), not a measurement of the checkpoint's activations.

    Raises:
        ValueError: ``ratio`` not positive and finite; ``activation`` without a static scale.
    """
    if not (isinstance(ratio, (int, float)) and math.isfinite(ratio) and ratio > 0):
        raise ValueError(f"ratio: expected a positive finite number (own / unified scale), got {ratio!r}")
    if activation is None or not activation.static_scale:
        raise ValueError(f"activation: expected a format with a static input scale (nvfp4, fp8_e4m3), got {activation}")
    grid, loss = _loss_curve(activation)
    g = min(max(math.log2(ratio), grid[0]), grid[-1])
    k = min(int((g - grid[0]) * 4), len(grid) - 2)
    t = (g - grid[k]) / (grid[k + 1] - grid[k])
    return loss[k] + t * (loss[k + 1] - loss[k])


# ----------------------------------------------------------------------------- reading


def config_description(folder: Path) -> CheckpointDescription:
    """The steps of the package's ``read_quant_config`` (which this module, imported by the package,
    cannot import): ``config.json``'s ``quantization_config``, else a layout's legacy file, parsed
    by the layout of its ``quant_method``. Raises ``CheckpointError`` as that does."""
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{folder}: config.json not found")
    qc = json.loads(cfg_path.read_text()).get("quantization_config")
    if qc is None:
        qc = next((q for q in (lay.read_legacy(folder) for lay in LAYOUTS.values()) if q is not None), None)
    if qc is None:
        raise CheckpointError(f"{folder}: no quantization_config in config.json and no legacy quantization config file")
    return layout_for_method(qc.get("quant_method")).read_config(qc)


class _Headers:
    """Names, dtypes, shapes and data offsets of every tensor, parsed from the safetensors headers
    (an 8-byte little-endian length, then a JSON object ``{name: {dtype, shape, data_offsets}}``,
    then the data); ``read_scales`` reads the data of the scale scalars only, and counts it."""

    def __init__(self, folder: Path):
        index = folder / INDEX_NAME
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (folder / "model.safetensors").exists():
            files = ["model.safetensors"]
        else:
            raise CheckpointError(f"{folder}: no model.safetensors or {INDEX_NAME}")
        self.folder = folder
        self.files = files
        self.where: dict[str, str] = {}
        self.dtype: dict[str, str] = {}
        self.shape: dict[str, tuple[int, ...]] = {}
        self.span: dict[str, tuple[int, int]] = {}  # absolute byte range of the data in its file
        self.tensors_read = 0
        self.bytes_read = 0
        for fname in files:
            path = folder / fname
            if not path.exists():
                raise CheckpointError(f"{folder}: {INDEX_NAME} lists {fname}, which does not exist")
            with open(path, "rb") as f:
                head = f.read(8)
                n = int.from_bytes(head, "little") if len(head) == 8 else -1
                size = path.stat().st_size
                if not 2 <= n <= size - 8:
                    raise CheckpointError(f"{path}: not a safetensors file (header length {n}, file size {size})")
                header = json.loads(f.read(n))
            header.pop("__metadata__", None)
            for name, meta in header.items():
                begin, end = meta["data_offsets"]
                self.where[name] = fname
                self.dtype[name] = meta["dtype"]
                self.shape[name] = tuple(meta["shape"])
                self.span[name] = (8 + n + begin, 8 + n + end)

    def read_scales(self) -> dict[str, float]:
        """Every tensor whose name ends in one of ``SCALE_SUFFIXES``, as Python floats (exact
        widening of fp32/bf16/fp16/fp64), one per name.

        Raises:
            CheckpointError: a scale tensor of more than one element, or of a non-float dtype.
        """
        names = [n for n in self.where if n.endswith(SCALE_SUFFIXES)]
        for n in names:
            if math.prod(self.shape[n]) != 1:
                raise CheckpointError(f"tensor {n!r}: expected one scale value, found shape {list(self.shape[n])}")
            if self.dtype[n] not in _FLOAT_SCALARS:
                raise CheckpointError(f"tensor {n!r}: expected a float scale ({', '.join(_FLOAT_SCALARS)}), found "
                                      f"{self.dtype[n]}")
        raw: dict[str, list[tuple[str, bytes]]] = {}
        by_file: dict[str, list[str]] = {}
        for n in names:
            by_file.setdefault(self.where[n], []).append(n)
        for fname, group in by_file.items():
            with open(self.folder / fname, "rb") as f:
                for n in sorted(group, key=lambda x: self.span[x][0]):
                    begin, end = self.span[n]
                    f.seek(begin)
                    data = f.read(end - begin)
                    self.tensors_read += 1
                    self.bytes_read += len(data)
                    raw.setdefault(self.dtype[n], []).append((n, data))
        out: dict[str, float] = {}
        for dtype, items in raw.items():
            values = torch.frombuffer(bytearray(b"".join(d for _, d in items)), dtype=_DTYPES[dtype]).double().tolist()
            out.update(zip((n for n, _ in items), values))
        return out


class _MetaHandle:
    """Stands in for an open safetensors file: ``get_tensor`` gives a ``meta`` tensor of the
    header's dtype and shape, so a layout's ``read_experts`` checks everything and reads nothing."""

    def __init__(self, headers: _Headers):
        self._h = headers

    def get_tensor(self, name: str) -> torch.Tensor:
        if name not in self._h.dtype:
            raise KeyError(name)
        dtype = _DTYPES.get(self._h.dtype[name])
        if dtype is None:
            raise CheckpointError(f"tensor {name!r}: safetensors dtype {self._h.dtype[name]} is not one torch reads")
        return torch.empty(self._h.shape[name], dtype=dtype, device="meta")


class _HeaderReader(TensorReader):
    """The loader's ``TensorReader`` (same checks and messages) over the headers only."""

    def __init__(self, headers: _Headers):
        self.weight_map = dict(headers.where)
        self.folder = headers.folder
        self._handle = _MetaHandle(headers)
        self._name = None
        self._keys = set(headers.dtype)

    def _open(self, fname: str):
        return self._handle

    def stack(self, names: list[str], shape, dtype, check=None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Dtype and shape checks of every named tensor (``TensorReader.get``); the value checks
        (``check``) need the data and are left to the loader. ``out`` (never written) or a meta tensor."""
        for n in names:
            self.get(n, shape, dtype)
        return out if out is not None else torch.empty((len(names), *shape), dtype=dtype, device="meta")


def _expert_tensors_by_layer(h: _Headers) -> dict[int, dict[str, tuple]]:
    """``{layer: {"E.proj.suffix": (dtype, shape)}}`` of the per-expert tensors, from the headers."""
    out: dict[int, dict[str, tuple]] = {}
    for name in h.where:
        m = _EXPERT.match(name)
        if m:
            out.setdefault(int(m[1]), {})[f"{m[2]}.{m[3]}.{m[4]}"] = (h.dtype[name], h.shape[name])
    return out


def _signature_diff(want: dict, got: dict, prefix: str) -> str:
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    changed = sorted(k for k in set(want) & set(got) if want[k] != got[k])
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing, e.g. {prefix}{missing[0]}")
    if extra:
        parts.append(f"{len(extra)} unexpected, e.g. {prefix}{extra[0]}")
    if changed:
        k = changed[0]
        parts.append(f"{len(changed)} of another dtype or shape, e.g. {prefix}{k}: expected {want[k][0]} "
                     f"{list(want[k][1])}, found {got[k][0]} {list(got[k][1])}")
    return "; ".join(parts)


# ----------------------------------------------------------------------------- the report


@dataclass
class InspectReport:
    """What ``inspect_checkpoint`` found. ``to_dict()`` for JSON, ``table()`` for a terminal.

    ``quantized``: per kind (``experts``, ``attention``, ``other``) rows of ``pattern`` (module
    name with layer and expert numbers as ``*``), ``modules`` (count), ``tensors`` (suffixes) and
    ``weight_dtype``; ``unquantized``: the same for bf16/fp16/fp32 2-D weights;
    ``activation_scales``: per (layer, point) ``experts, calibrated, uncalibrated`` (expert ids
    with scale 0), ``min, max, ratio`` (max / min over calibrated experts, decode scales),
    ``shared`` (every calibrated expert has the same scale) and, for a1, ``gate_up_differ``;
    ``strategies``: per (point, strategy) ``experts, clipped, subnormal, flushed`` (experts with
    ``r > 1``, ``r < NVFP4_SUBNORMAL_RATIO``, ``r < NVFP4_FLUSH_RATIO``), ``mean_db_lost``,
    ``worst_db_lost``, ``worst`` (layer, expert); ``problems``: layout-check and config errors.
    """

    path: str
    format: str | None
    scheme: str | None
    activation: str | None
    producer: str | None
    num_hidden_layers: int | None
    num_experts: int | None
    hidden_size: int | None
    moe_intermediate_size: int | None
    exclude: list[str] = field(default_factory=list)
    quantized: dict[str, list[dict]] = field(default_factory=dict)
    unquantized: list[dict] = field(default_factory=list)
    weight_global_scales: dict | None = None
    activation_scales: list[dict] = field(default_factory=list)
    strategies: list[dict] = field(default_factory=list)
    layout_ok: bool = False
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    tensors_total: int = 0
    tensors_read: int = 0
    bytes_read: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        """A readable multi-line summary (what ``python -m mxlib.cli inspect`` prints)."""
        out = [f"checkpoint   {self.path}",
               f"layout       {self.format or '?'}   scheme {self.scheme or '?'}   activations "
               f"{self.activation or ('bf16 (weight-only)' if self.scheme else '?')}   producer {self.producer or '?'}",
               f"model        {self.num_hidden_layers} layers, {self.num_experts} experts, hidden "
               f"{self.hidden_size}, expert intermediate {self.moe_intermediate_size}"]
        for kind in ("experts", "attention", "other"):
            rows = self.quantized.get(kind) or []
            text = "; ".join(f"{r['pattern']} x{r['modules']} ({r['weight_dtype']}: {', '.join(r['tensors'])})"
                             for r in rows) or "none"
            out.append(f"quantized    {kind:<9s} {text}")
        out.append("unquantized  " + ("; ".join(f"{r['pattern']} x{r['modules']} {r['weight_dtype']}"
                                                for r in self.unquantized) or "none"))
        ex = self.exclude
        out.append(f"exclude      {len(ex)} entries" + (f": {', '.join(ex[:6])}{', ...' if len(ex) > 6 else ''}"
                                                        if ex else ""))
        out.append("layout check " + ("ok (the loader's tensor checks pass on the headers)" if self.layout_ok
                                      else "FAILED"))
        for p in self.problems:
            out.append(f"  problem: {p}")
        if self.weight_global_scales:
            w = self.weight_global_scales
            out.append(f"weight global scales (decode)  {w['count']} values, min {w['min']:.4g}, max {w['max']:.4g}; "
                       f"gate != up in {w['gate_up_differ']} experts")
        if self.activation_scales:
            out.append("")
            out.append("activation input scales per expert (decode scales; ratio = max / min of the calibrated)")
            out.append(f"{'layer':>5s} {'point':>5s} {'experts':>7s} {'uncal':>5s} {'min':>10s} {'max':>10s} "
                       f"{'ratio':>9s} {'shared':>6s} {'gate!=up':>8s}")
            for r in self.activation_scales:
                mn = f"{r['min']:.4g}" if r["min"] is not None else "-"
                mx = f"{r['max']:.4g}" if r["max"] is not None else "-"
                ratio = f"{r['ratio']:.4g}" if r["ratio"] is not None else "-"
                gu = "" if r.get("gate_up_differ") is None else str(r["gate_up_differ"])
                out.append(f"{r['layer']:>5d} {r['point']:>5s} {r['experts']:>7d} {len(r['uncalibrated']):>5d} "
                           f"{mn:>10s} {mx:>10s} {ratio:>9s} {'yes' if r['shared'] else 'no':>6s} {gu:>8s}")
        if self.strategies:
            out.append("")
            out.append(f"unification, predicted from r = own / unified scale (subnormal: r < 2^-6/448 = "
                       f"{NVFP4_SUBNORMAL_RATIO:.3g}; flushed: r < 2^-10/448 = {NVFP4_FLUSH_RATIO:.3g}; clipped: r > 1; "
                       f"dB from a Gaussian-expert model)")
            out.append(f"{'point':>5s} {'strategy':>10s} {'experts':>7s} {'clipped':>7s} {'subnorm':>7s} "
                       f"{'flushed':>7s} {'mean dB':>8s} {'worst dB':>8s}  worst (layer, expert)")
            for r in self.strategies:
                worst = "-" if r["worst"] is None else f"({r['worst'][0]}, {r['worst'][1]})"
                out.append(f"{r['point']:>5s} {r['strategy']:>10s} {r['experts']:>7d} {r['clipped']:>7d} "
                           f"{r['subnormal']:>7d} {r['flushed']:>7d} {r['mean_db_lost']:>8.2f} "
                           f"{r['worst_db_lost']:>8.2f}  {worst}")
        for n in self.notes:
            out.append(f"note: {n}")
        out.append(f"read {self.tensors_read} scale tensors ({self.bytes_read} bytes) of {self.tensors_total} "
                   f"in {self.seconds:.2f} s")
        return "\n".join(out)


def _pattern(module: str) -> str:
    return _EXPERT_NUM.sub(".experts.*.", _LAYER_NUM.sub(".layers.*.", module))


def _kind(module: str) -> str:
    if ".mlp.experts." in module:
        return "experts"
    if ".self_attn." in module:
        return "attention"
    return "other"


def _modules(h: _Headers) -> tuple[dict[str, list[dict]], list[dict], dict[str, list[str]]]:
    """Quantized modules (those with a ``weight_scale``) and unquantized 2-D float weights, grouped;
    and the quantized modules' names by kind."""
    tensors_of: dict[str, set[str]] = {}
    for name in h.where:
        module, _, suffix = name.rpartition(".")
        tensors_of.setdefault(module, set()).add(suffix)
    quant: dict[str, dict[str, dict]] = {"experts": {}, "attention": {}, "other": {}}
    plain: dict[str, dict] = {}
    names: dict[str, list[str]] = {"experts": [], "attention": [], "other": []}
    for module, suffixes in tensors_of.items():
        wname = f"{module}.weight_packed" if "weight_packed" in suffixes else f"{module}.weight"
        wdtype = h.dtype.get(wname, "?")
        if "weight_scale" in suffixes:
            row = quant[_kind(module)].setdefault(_pattern(module), dict(pattern=_pattern(module), modules=0,
                                                                          tensors=sorted(suffixes), weight_dtype=wdtype))
            row["modules"] += 1
            names[_kind(module)].append(module)
        elif "weight" in suffixes and len(h.shape[wname]) == 2 and wdtype in ("BF16", "F16", "F32"):
            row = plain.setdefault(_pattern(module), dict(pattern=_pattern(module), modules=0, weight_dtype=wdtype))
            row["modules"] += 1
        if module.endswith(".mlp.experts"):  # transformers 5's fused 3-D expert parameters, stored as they are
            for fused in sorted(suffixes & set(_FUSED_EXPERTS)):
                name = f"{module}.{fused}"
                pat = _pattern(name)
                row = plain.setdefault(pat, dict(pattern=pat, modules=0, weight_dtype=h.dtype[name]))
                row["modules"] += 1
    return {k: _merge(v.values()) for k, v in quant.items()}, _merge(plain.values()), names


def _merge(rows) -> list[dict]:
    """Rows whose patterns differ only in the last name, alike otherwise, as one ``parent.{a,b}``."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        parent, _, leaf = r["pattern"].rpartition(".")
        key = (parent, r["modules"], r["weight_dtype"], tuple(r.get("tensors", ())))
        groups.setdefault(key, []).append(dict(r, leaf=leaf))
    out = []
    for (parent, *_), rs in groups.items():
        leaves = sorted(r["leaf"] for r in rs)
        name = leaves[0] if len(leaves) == 1 else "{" + ",".join(leaves) + "}"
        row = {k: v for k, v in rs[0].items() if k != "leaf"}
        row["pattern"] = f"{parent}.{name}" if parent else name
        row["modules"] = sum(r["modules"] for r in rs)
        out.append(row)
    return sorted(out, key=lambda r: r["pattern"])


def _decode(name: str, value: float) -> float:
    """A decode scale from a stored one (encode ``*global_scale`` inverted; 0 or Inf means uncalibrated)."""
    if name.endswith(_ENCODE_SUFFIX):
        return 0.0 if value == 0 or not math.isfinite(value) else 1.0 / value
    return value


def _expert_scales(scales: dict[str, float]):
    """``{(layer, point): {expert: decode scale}}`` for a1/a2, plus gate/up details and weight scales."""
    act: dict[tuple[int, str], dict[int, float]] = {}
    gate_up_differ: dict[int, int] = {}
    gate_up: dict[tuple[int, int], dict[str, float]] = {}
    weight: dict[tuple[int, int], dict[str, float]] = {}
    for name, value in scales.items():
        m = _EXPERT.match(name)
        if not m:
            continue
        layer, expert, proj, suffix = int(m[1]), int(m[2]), m[3], m[4]
        v = _decode(suffix, value)
        if suffix in _INPUT_SUFFIXES:
            if proj == "down_proj":
                act.setdefault((layer, "a2"), {})[expert] = v
            elif proj in ("gate_proj", "up_proj"):
                gate_up.setdefault((layer, expert), {})[proj] = v
        elif suffix in _WEIGHT_GLOBAL_SUFFIXES:
            weight.setdefault((layer, expert), {})[proj] = v
    for (layer, expert), d in gate_up.items():
        act.setdefault((layer, "a1"), {})[expert] = max(d.values())
        if len(d) == 2 and d["gate_proj"] != d["up_proj"]:
            gate_up_differ[layer] = gate_up_differ.get(layer, 0) + 1
    return act, gate_up_differ, weight


def _strategy_rows(act, activation, strategies) -> list[dict]:
    rows = []
    for point in ("a1", "a2"):
        keys = sorted(k for k in act if k[1] == point)
        if not keys:
            continue
        for strategy in strategies:
            n = clipped = subnormal = flushed = 0
            total = worst = 0.0
            worst_at = None
            for layer, _ in keys:
                d = act[(layer, point)]
                experts = sorted(d)
                s = torch.tensor([d[e] for e in experts], dtype=torch.float32)
                if not bool((s > 0).any()):
                    continue
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    gs = unify_input_scales(s, strategy, f"layer {layer} {point} input_scale")[0]
                for e, own, g in zip(experts, s.tolist(), gs.double().tolist()):
                    if own <= 0:
                        continue
                    r = own * g  # own / unified
                    if abs(r - 1.0) <= _RATIO_TOL:
                        r = 1.0  # its own scale, to fp32 rounding of the reciprocal
                    n += 1
                    clipped += r > 1.0
                    subnormal += r < NVFP4_SUBNORMAL_RATIO
                    flushed += r < NVFP4_FLUSH_RATIO
                    lost = predicted_db_lost(r, activation) if activation is not None else 0.0
                    total += lost
                    if lost > worst:
                        worst, worst_at = lost, (layer, e)
            rows.append(dict(point=point, strategy=strategy, experts=n, clipped=int(clipped), subnormal=int(subnormal),
                             flushed=int(flushed), mean_db_lost=total / n if n else 0.0, worst_db_lost=worst,
                             worst=worst_at))
    return rows


def _layer_rows(act, gate_up_differ) -> list[dict]:
    rows = []
    for (layer, point) in sorted(act, key=lambda k: (k[0], k[1])):
        d = act[(layer, point)]
        cal = [v for v in d.values() if v > 0]
        rows.append(dict(
            layer=layer, point=point, experts=len(d), calibrated=len(cal),
            uncalibrated=sorted(e for e, v in d.items() if v <= 0),
            min=min(cal) if cal else None, max=max(cal) if cal else None,
            ratio=max(cal) / min(cal) if cal else None,
            shared=len(cal) > 1 and len(set(cal)) == 1,
            gate_up_differ=gate_up_differ.get(layer, 0) if point == "a1" else None,
        ))
    return rows


def _producer(folder: Path, qc: dict | None) -> str | None:
    prod = (qc or {}).get("producer")
    if prod is None and (folder / "hf_quant_config.json").exists():
        prod = json.loads((folder / "hf_quant_config.json").read_text()).get("producer")
    if isinstance(prod, dict):
        return " ".join(str(prod[k]) for k in ("name", "version") if prod.get(k) is not None) or None
    if prod:
        return str(prod)
    # no producer entry (Quark, compressed-tensors): the method and the version its config records
    parts = [str((qc or {}).get(k)) for k in ("quant_method", "version") if (qc or {}).get(k) is not None]
    return " ".join(parts) or None


def inspect_checkpoint(path: str | os.PathLike, strategies=SCALE_STRATEGIES) -> InspectReport:
    """Describe a quantized Qwen3-MoE checkpoint from its configs, headers and scale scalars.

    Args:
        path: the checkpoint folder (``config.json``, ``model.safetensors`` or shards with
            ``model.safetensors.index.json``, legacy config files).
        strategies: unification strategies to predict (``mxlib.moe.scales.SCALE_STRATEGIES``).

    Returns:
        ``InspectReport``. Config or layout errors do not raise: they are listed in
        ``problems`` (with ``layout_ok`` False) so that a checkpoint the loader refuses can
        still be inspected.

    Raises:
        CheckpointError: no ``config.json``, no safetensors file, an index naming a missing
            shard, or a scale tensor of more than one element.
        ValueError: an unknown strategy.
    """
    t0 = time.perf_counter()
    folder = Path(path)
    bad = [s for s in strategies if s not in SCALE_STRATEGIES]
    if bad:
        raise ValueError(f"strategies: expected names from {list(SCALE_STRATEGIES)}, got {bad}")
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{folder}: config.json not found")
    cfg = json.loads(cfg_path.read_text())
    qc = cfg.get("quantization_config")
    problems: list[str] = []
    notes: list[str] = []
    try:
        info = config_description(folder)
    except CheckpointError as err:
        info = None
        problems.append(f"config: {err}")
    headers = _Headers(folder)
    quantized, unquantized, quantized_names = _modules(headers)
    scales = headers.read_scales()
    act, gate_up_differ, weight = _expert_scales(scales)

    # transformers 5 writes num_experts as num_local_experts
    layers, e = cfg.get("num_hidden_layers"), cfg.get("num_experts", cfg.get("num_local_experts"))
    h, i = cfg.get("hidden_size"), cfg.get("moe_intermediate_size")
    layout_ok = False
    if info is not None:
        layout = LAYOUTS[info.format]
        checked = [layer for layer in range(layers)
                   if not all(matches(f"model.layers.{layer}.mlp.experts.0.{p}", info.exclude) for p in PROJS)]
        try:
            if checked:
                # the layout's own checks on the first quantized layer (meta tensors: nothing read),
                # then every other layer must hold the same expert tensors (names, dtypes, shapes)
                layout.read_experts(_HeaderReader(headers), f"model.layers.{checked[0]}.mlp.experts", e, h, i, info)
                by_layer = _expert_tensors_by_layer(headers)
                first = by_layer.get(checked[0], {})
                for layer in checked[1:]:
                    diff = _signature_diff(first, by_layer.get(layer, {}), f"model.layers.{layer}.mlp.experts.")
                    if diff:
                        raise CheckpointError(f"layer {layer}'s expert tensors differ from layer {checked[0]}'s: {diff}")
            layout_ok = True
        except (CheckpointError, ValueError, TypeError) as err:
            problems.append(f"layout: {err}")
        for kind in ("attention", "other"):
            names = quantized_names[kind]
            listed = [n for n in names if matches(n, info.exclude)]
            if len(listed) < len(names):
                notes.append(f"{len(names) - len(listed)} {kind} modules outside the experts are quantized (not in the "
                             f"exclude list)")
            if listed:
                problems.append(f"{len(listed)} quantized {kind} modules are named by the exclude list, e.g. "
                                f"{', '.join(listed[:3])}")

    fused = [r["pattern"] for r in unquantized if ".mlp.experts." in r["pattern"] and ".experts.*." not in r["pattern"]]
    if fused:
        notes.append(f"the experts are stored fused and unquantized ({', '.join(fused)}): the quantizer saw no "
                      f"per-expert linear layers (Quark run without preprocess_for_quantization writes this)")
    activation = info.scheme.activation if info is not None else None
    if activation is not None and not activation.static_scale:
        activation = None  # dynamic MX activations: nothing to unify
    if act and activation is None and info is not None:
        notes.append(f"{info.scheme.name} has no static activation scale, yet the checkpoint stores input scales")
    if info is not None and info.scheme.static_activation_scale and not act:
        problems.append(f"{info.scheme.name} needs per-expert input scales; none found")
    layer_rows = _layer_rows(act, gate_up_differ)
    for r in layer_rows:
        if r["calibrated"] == 0:
            problems.append(f"layer {r['layer']} {r['point']}: no expert calibrated (every input scale 0); the "
                            f"loader refuses this layer")
    shared = [f"{r['layer']}/{r['point']}" for r in layer_rows if r["shared"]]
    if shared:
        notes.append(f"{len(shared)} of {len(layer_rows)} (layer, point) pairs give every calibrated expert the same "
                     f"input scale (one quantizer shared by the experts, as ModelOpt 0.47 exports have): every "
                     f"strategy is the same, and no per-expert range is left to recover")
    uncal = sum(len(r["uncalibrated"]) for r in layer_rows)
    if uncal:
        notes.append(f"{uncal} (layer, point, expert) input scales are 0 (never calibrated); they get the unified scale")
    wvals = [v for d in weight.values() for v in d.values()]
    wglobal = None
    if wvals:
        differ = sum(1 for d in weight.values() if "gate_proj" in d and "up_proj" in d and d["gate_proj"] != d["up_proj"])
        wglobal = dict(count=len(wvals), min=min(wvals), max=max(wvals), gate_up_differ=differ)
        if differ:
            notes.append(f"{differ} experts have different gate and up weight global scales; vLLM uses gate's for both")
    report = InspectReport(
        path=str(folder), format=info.format if info else None, scheme=info.scheme.name if info else None,
        activation=str(info.scheme.activation) if info and info.scheme.activation is not None else None,
        producer=_producer(folder, qc), num_hidden_layers=layers, num_experts=e, hidden_size=h,
        moe_intermediate_size=i, exclude=list(info.exclude) if info else list((qc or {}).get("ignore") or []),
        quantized=quantized, unquantized=unquantized, weight_global_scales=wglobal, activation_scales=layer_rows,
        strategies=_strategy_rows(act, activation, strategies) if activation is not None else [],
        layout_ok=layout_ok, problems=problems, notes=notes, tensors_total=len(headers.where),
        tensors_read=headers.tensors_read, bytes_read=headers.bytes_read,
    )
    report.seconds = time.perf_counter() - t0
    return report
