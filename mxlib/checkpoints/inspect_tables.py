"""The tables ``inspect_checkpoint`` builds from the safetensors headers and the scale scalars.

* ``module_tables``: quantized modules (those with a ``weight_scale``, or gpt-oss's ``<proj>_blocks`` beside
  ``<proj>_scales``) and unquantized 2-D float
  weights, as rows of name patterns (layer and expert numbers as ``*``), merged where they differ
  only in the last name;
* ``expert_scales`` and ``layer_rows``: the per-expert activation decode scales (``a1``: the max
  of gate's and up's, as the loader takes; ``a2``: down's; compressed-tensors' encode
  ``*global_scale`` inverted) and their per (layer, point) summary.
"""

from __future__ import annotations

import math
import re

from .files.safetensors_io import SafetensorsHeaders

__all__ = ["module_tables", "expert_scales", "layer_rows"]

_ENCODE_SUFFIX = "global_scale"  # compressed-tensors stores encode scales (6 * 448 / amax)
_INPUT_SUFFIXES = ("input_scale", "input_global_scale")
_WEIGHT_GLOBAL_SUFFIXES = ("weight_scale_2", "weight_global_scale")

_EXPERT = re.compile(r"^(?:.*\.)?layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.(\w+)$")
_LAYER_NUM = re.compile(r"\.layers\.\d+\.")
_EXPERT_NUM = re.compile(r"\.experts\.\d+\.")
_FUSED_EXPERTS = ("gate_up_proj", "down_proj")


def _pattern(module: str) -> str:
    return _EXPERT_NUM.sub(".experts.*.", _LAYER_NUM.sub(".layers.*.", module))


def _kind(module: str) -> str:
    if ".mlp.experts." in module:
        return "experts"
    if ".self_attn." in module:
        return "attention"
    return "other"


def module_tables(h: SafetensorsHeaders) -> tuple[dict[str, list[dict]], list[dict], dict[str, list[str]]]:
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
            row = quant[_kind(module)].setdefault(
                _pattern(module),
                dict(pattern=_pattern(module), modules=0, tensors=sorted(suffixes), weight_dtype=wdtype),
            )
            row["modules"] += 1
            names[_kind(module)].append(module)
        elif "weight" in suffixes and len(h.shape[wname]) == 2 and wdtype in ("BF16", "F16", "F32"):
            row = plain.setdefault(_pattern(module), dict(pattern=_pattern(module), modules=0, weight_dtype=wdtype))
            row["modules"] += 1
        for stem in sorted(x[: -len("_blocks")] for x in suffixes if x.endswith("_blocks")):
            if f"{stem}_scales" in suffixes:  # gpt-oss's whole-layer experts: <proj>_blocks, _scales, _bias
                name = f"{module}.{stem}"
                tensors = sorted(x for x in suffixes if x.startswith(f"{stem}_"))
                row = quant[_kind(name)].setdefault(
                    _pattern(name),
                    dict(pattern=_pattern(name), modules=0, tensors=tensors, weight_dtype=h.dtype[f"{name}_blocks"]),
                )
                row["modules"] += 1
                names[_kind(name)].append(name)
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


def expert_scales(scales: dict[str, float]):
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


def layer_rows(act, gate_up_differ) -> list[dict]:
    """Per (layer, point): experts, calibrated, uncalibrated ids, min / max / ratio of the
    calibrated decode scales, shared, and (a1) the count of experts whose gate and up differ."""
    rows = []
    for layer, point in sorted(act, key=lambda k: (k[0], k[1])):
        d = act[(layer, point)]
        cal = [v for v in d.values() if v > 0]
        rows.append(
            dict(
                layer=layer,
                point=point,
                experts=len(d),
                calibrated=len(cal),
                uncalibrated=sorted(e for e, v in d.items() if v <= 0),
                min=min(cal) if cal else None,
                max=max(cal) if cal else None,
                ratio=max(cal) / min(cal) if cal else None,
                shared=len(cal) > 1 and len(set(cal)) == 1,
                gate_up_differ=gate_up_differ.get(layer, 0) if point == "a1" else None,
            )
        )
    return rows
