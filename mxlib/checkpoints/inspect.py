"""Inspect a quantized Qwen3-MoE checkpoint already on disk, reading only its configs and scales.

``inspect_checkpoint(path)`` answers, in seconds even for a 30B checkpoint, what a user wants to
know before loading one: which layout and scheme it is, what is quantized (experts, attention,
other linears) and what is left bf16, whether its tensors have the names, dtypes and shapes the
layout needs, and what its per-expert activation scales say about scale unification.

What it reads:

* ``config.json`` (and legacy files such as ``hf_quant_config.json``) through the layout registry
  (the steps of the loader's ``read_quant_config``: the same layout parsers);
* every safetensors header (names, dtypes, shapes: a few kB per shard), through
  ``headers.SafetensorsHeaders``, the loader's own reader (regular files only, the index checked,
  each header checked as safetensors checks it, names unique across shards): a file it refuses is a
  problem of the report and gives no tables;
* the data of the **scale scalars only**: one-element tensors, such as those whose names end in
  ``input_scale``, ``weight_scale_2`` or ``global_scale`` (compressed-tensors' ``weight_global_scale`` /
  ``input_global_scale``). Never ``weight``, ``weight_packed`` or the ``weight_scale`` block scales.

The layout check is the loader's ``bounds.check_model_config``: the config's sizes against the headers,
then the layout's own ``read_experts`` on every quantized layer's headers (weights as PyTorch ``meta``
tensors, scalar scales read and value-checked), its ``read_linear`` on every quantized linear layer and
``read_expert_biases`` where the family has them, so it checks what the loader checks. A tensor none of these
reads (an expert, a layer or a suffix the config does not account for, a tensor the index leaves out) is a
problem naming it, as the loader warns of it. Every fault of the checkpoint is a line of ``problems``;
nothing about the checkpoint raises.

Scale conventions, by tensor name: ``input_scale`` / ``weight_scale_2`` are *decode* scales
(ModelOpt NVFP4 ``amax / (6 * 448)``; Quark's static FP8 ``amax / 448``); ``*global_scale`` are
compressed-tensors' *encode* scales (``6 * 448 / amax``), reported here as their reciprocals so
that every layout reads the same. ``a1`` is the experts' gate/up input (the max of gate's and
up's scale, as the loader takes), ``a2`` their down input.

Unification losses are predicted (``inspect_loss``) from each expert's ratio ``r = own_scale /
unified_scale`` under each strategy of ``mxlib.moe.scales.SCALE_STRATEGIES``: which experts clip,
which reach e4m3's subnormals or flush, and the dB a synthetic expert loses (a model, not a
measurement of the checkpoint's activations). The module and scale tables are built in
``inspect_tables``.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field

import torch

from ..models.families import QWEN3_MOE, MoEFamily, check_supported_model, config_value, family_of
from ..moe.scales import SCALE_STRATEGIES
from ..text_table import text_table
from .bounds import check_model_config, check_scale_strategy
from .files.folder import CheckpointFolder
from .files.headers import describe_unused, folder_identity
from .files.safetensors_io import SafetensorsHeaders
from .inspect_loss import NVFP4_FLUSH_RATIO, NVFP4_SUBNORMAL_RATIO, predicted_db_lost, strategy_rows
from .inspect_tables import expert_scales, layer_rows, module_tables
from .layout import CheckpointDescription, CheckpointError, matches
from .layouts import LAYOUTS, layout_for_method  # the registry with mxlib's layouts registered
from .precision import EXPERT_CLASSES, module_classes

__all__ = [
    "InspectReport",
    "inspect_checkpoint",
    "config_description",
    "predicted_db_lost",
    "NVFP4_SUBNORMAL_RATIO",
    "NVFP4_FLUSH_RATIO",
    "SCALE_SUFFIXES",
    "precision_groups",
]

# safetensors dtypes of quantized codes and scales (a module storing one is quantized)
_QUANTIZED_DTYPES = ("U8", "I8", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4")
# tensor-name endings whose data is read; everything else is known from the headers only
SCALE_SUFFIXES = ("input_scale", "weight_scale_2", "global_scale")


def config_description(folder: str | os.PathLike) -> CheckpointDescription:
    """The steps of ``loader.read_quant_config`` without its message prefixes: ``config.json``'s
    ``quantization_config`` (a regular file of at most ``MAX_JSON_BYTES``, read with ``read_json``),
    else a layout's legacy file, parsed by the layout of its ``quant_method``. Raises the layout
    parser's ``CheckpointError`` unchanged (the inspector reports its message as a problem; the dummy
    builder raises it), and a ``CheckpointError`` naming the field for a config of the wrong JSON types.
    ``folder`` may be a ``files.folder.CheckpointFolder``, whose files are then not read again."""
    folder = CheckpointFolder.of(folder)
    cfg_path = folder / "config.json"
    qc = folder.config().get("quantization_config")
    if qc is None:
        qc = next((q for q in (lay.read_legacy(folder) for lay in LAYOUTS.values()) if q is not None), None)
    if qc is None:
        raise CheckpointError(f"{folder}: no quantization_config in config.json and no legacy quantization config file")
    if not isinstance(qc, dict):
        raise CheckpointError(f"{cfg_path}: quantization_config: expected an object, found {type(qc).__name__}")
    try:
        return layout_for_method(qc.get("quant_method")).read_config(qc)
    except CheckpointError:
        raise
    except (AttributeError, TypeError, KeyError, ValueError) as err:  # a field of the wrong JSON type
        raise CheckpointError(f"{cfg_path}: quantization_config is malformed ({type(err).__name__}: {err})") from None


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

    ``precision_groups``: per precision group (``mxlib.checkpoints.precision``; one group, named by the scheme,
    for a single-scheme checkpoint) ``group``, ``scheme``, ``layout`` (the layout reading its tensors),
    ``modules`` (count of its modules: those storing packed or 8-bit codes or scales), ``bytes`` (their
    tensors' bytes in the files) and ``share`` (of all the tensors' bytes); then a row of every other tensor
    (``group`` ``"unquantized"``, ``scheme`` None). A per-expert projection counts as one module.
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
    precision_groups: list[dict] = field(default_factory=list)
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
        out = [
            f"checkpoint   {self.path}",
            f"layout       {self.format or '?'}   scheme {self.scheme or '?'}   activations "
            f"{self.activation or ('bf16 (weight-only)' if self.scheme else '?')}   producer {self.producer or '?'}",
            f"model        {self.num_hidden_layers} layers, {self.num_experts} experts, hidden "
            f"{self.hidden_size}, expert intermediate {self.moe_intermediate_size}",
        ]
        for kind in ("experts", "attention", "other"):
            rows = self.quantized.get(kind) or []
            text = (
                "; ".join(
                    f"{r['pattern']} x{r['modules']} ({r['weight_dtype']}: {', '.join(r['tensors'])})" for r in rows
                )
                or "none"
            )
            out.append(f"quantized    {kind:<9s} {text}")
        out.append(
            "unquantized  "
            + ("; ".join(f"{r['pattern']} x{r['modules']} {r['weight_dtype']}" for r in self.unquantized) or "none")
        )
        ex = self.exclude
        out.append(
            f"exclude      {len(ex)} entries" + (f": {', '.join(ex[:6])}{', ...' if len(ex) > 6 else ''}" if ex else "")
        )
        out.append(
            "layout check " + ("ok (the loader's tensor checks pass on the headers)" if self.layout_ok else "FAILED")
        )
        for p in self.problems:
            out.append(f"  problem: {p}")
        if self.precision_groups:
            out.append("precision groups (share of the checkpoint's bytes)")
            cells = [
                (
                    r["group"],
                    r["scheme"] or "bf16",
                    r["layout"] or "-",
                    f"{r['modules']:>6d} modules" if r["group"] != "unquantized" else f"{'(the rest)':>14s}",
                    f"{r['bytes']:>14d} bytes",
                    f"{100 * r['share']:>6.2f}%",
                )
                for r in self.precision_groups
            ]
            out += text_table(None, cells, widths=(22, 18, 26, 0, 0, 0), indent="  ", grow=False)
        if self.weight_global_scales:
            w = self.weight_global_scales
            out.append(
                f"weight global scales (decode)  {w['count']} values, min {w['min']:.4g}, max {w['max']:.4g}; "
                f"gate != up in {w['gate_up_differ']} experts"
            )
        if self.activation_scales:
            out.append("")
            out.append("activation input scales per expert (decode scales; ratio = max / min of the calibrated)")
            cells = [
                (
                    str(r["layer"]),
                    r["point"],
                    str(r["experts"]),
                    str(len(r["uncalibrated"])),
                    f"{r['min']:.4g}" if r["min"] is not None else "-",
                    f"{r['max']:.4g}" if r["max"] is not None else "-",
                    f"{r['ratio']:.4g}" if r["ratio"] is not None else "-",
                    "yes" if r["shared"] else "no",
                    "" if r.get("gate_up_differ") is None else str(r["gate_up_differ"]),
                )
                for r in self.activation_scales
            ]
            out += text_table(
                ("layer", "point", "experts", "uncal", "min", "max", "ratio", "shared", "gate!=up"),
                cells,
                widths=(5, 5, 7, 5, 10, 10, 9, 6, 8),
                align=">" * 9,
                grow=False,
            )
        if self.strategies:
            out.append("")
            out.append(
                f"unification, predicted from r = own / unified scale (subnormal: r < 2^-6/448 = "
                f"{NVFP4_SUBNORMAL_RATIO:.3g}; flushed: r < 2^-10/448 = {NVFP4_FLUSH_RATIO:.3g}; "
                f"clipped: r > 1; dB from a Gaussian-expert model)"
            )
            cells = [
                (
                    r["point"],
                    r["strategy"],
                    str(r["experts"]),
                    str(r["clipped"]),
                    str(r["subnormal"]),
                    str(r["flushed"]),
                    f"{r['mean_db_lost']:.2f}",
                    f"{r['worst_db_lost']:.2f}",
                    "-" if r["worst"] is None else f"({r['worst'][0]}, {r['worst'][1]})",
                )
                for r in self.strategies
            ]
            out += text_table(
                ("point", "strategy", "experts", "clipped", "subnorm", "flushed", "mean dB", "worst dB")
                + ("worst (layer, expert)",),
                cells,
                widths=(5, 10, 7, 7, 7, 7, 8, 8, 0),
                align=">" * 8 + "<",
                sep=(" ",) * 7 + ("  ",),
                grow=False,
            )
        for n in self.notes:
            out.append(f"note: {n}")
        out.append(
            f"read {self.tensors_read} scale tensors ({self.bytes_read} bytes) of {self.tensors_total} "
            f"in {self.seconds:.2f} s"
        )
        return "\n".join(out)


def _producer(folder: CheckpointFolder, qc: dict | None) -> str | None:
    qc = qc if isinstance(qc, dict) else {}
    prod = qc.get("producer")
    if prod is None and (folder / "hf_quant_config.json").exists():
        try:
            prod = folder.json("hf_quant_config.json").get("producer")
        except CheckpointError:
            prod = None
    if isinstance(prod, dict):
        return " ".join(str(prod[k]) for k in ("name", "version") if prod.get(k) is not None) or None
    if prod:
        return str(prod)[:200]
    # no producer entry (Quark, compressed-tensors): the method and the version its config records
    parts = [str(qc.get(k))[:80] for k in ("quant_method", "version") if qc.get(k) is not None]
    return " ".join(parts) or None


def _positive_int(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def inspect_checkpoint(path: str | os.PathLike, strategies=SCALE_STRATEGIES) -> InspectReport:
    """Describe a quantized MoE checkpoint (any registered family) from its configs, headers and scale scalars.

    A family storing other names than transformers' state dict (Mixtral's
    ``block_sparse_moe.experts.e.w1``) is read under the state-dict names
    (``SafetensorsHeaders.as_module_names``): the tables show ``mlp.experts.*.gate_proj``, and a note
    says so; the exclude list is matched with the names on disk.

    Args:
        path: the checkpoint folder (``config.json``, ``model.safetensors`` or shards with
            ``model.safetensors.index.json``, legacy config files).
        strategies: unification strategies to predict (``mxlib.moe.scales.SCALE_STRATEGIES``).

    Returns:
        ``InspectReport``. Nothing about the checkpoint raises: every file the loader refuses (not
        there, not a regular file, not JSON, a lying safetensors header, a shard outside the folder),
        every config or layout error and every config size the files do not hold is a line of
        ``problems`` naming the file and field (with ``layout_ok`` False), so that a checkpoint the
        loader refuses can still be inspected. The tables are built only from files the loader's
        checks accept (``headers.SafetensorsHeaders``): refused headers give no tables. Strategies
        are predicted only where the loader applies them (``bounds.check_scale_strategy``: NVFP4;
        for static FP8 activations only ``max``).

    Raises:
        ValueError: an unknown strategy (the argument, not the checkpoint).
    """
    t0 = time.perf_counter()
    folder = CheckpointFolder(path)  # each config file read once, whatever the steps reading it
    bad = [s for s in strategies if s not in SCALE_STRATEGIES]
    if bad:
        raise ValueError(f"strategies: expected names from {list(SCALE_STRATEGIES)}, got {bad}")
    report = InspectReport(str(folder), None, None, None, None, None, None, None, None)
    problems, notes = report.problems, report.notes
    cfg_path = folder / "config.json"
    try:
        since = folder_identity(folder)  # what is read below must come from this folder (SafetensorsHeaders)
        cfg = folder.config()
    except CheckpointError as err:
        problems.append(f"config: {err}")
        return _done(report, t0)
    qc = cfg.get("quantization_config")
    for name in dict.fromkeys((*(f for lay in LAYOUTS.values() for f in lay.legacy_files), "generation_config.json")):
        if (folder / name).exists() or (folder / name).is_symlink():
            try:  # the loader reads these (a loaded model's save copies them): the same checks
                folder.json(name)
            except CheckpointError as err:
                problems.append(f"config: {err}")
    report.producer = _producer(folder, qc)
    family = QWEN3_MOE
    try:
        check_supported_model(cfg, "inspect_checkpoint", name=str(cfg_path), error=CheckpointError)
        if cfg.get("architectures") or cfg.get("model_type") is not None:
            family = family_of(cfg, "inspect_checkpoint", name=str(cfg_path))
    except CheckpointError:
        pass  # reported below
    layers, e = cfg.get("num_hidden_layers"), config_value(cfg, family.num_experts_fields)
    report.num_hidden_layers, report.num_experts = _positive_int(layers), _positive_int(e)
    report.hidden_size = _positive_int(cfg.get("hidden_size"))
    report.moe_intermediate_size = _positive_int(config_value(cfg, family.intermediate_size_fields))
    try:
        check_supported_model(cfg, "inspect_checkpoint", name=str(cfg_path), error=CheckpointError)
        info = config_description(folder)
    except CheckpointError as err:
        info = None
        problems.append(f"config: {err}")
    if info is not None:
        report.format, report.scheme, report.exclude = info.format, info.scheme.name, list(info.exclude)
        report.activation = str(info.scheme.activation) if info.scheme.activation is not None else None
    elif isinstance(qc, dict) and isinstance(qc.get("ignore"), list):
        report.exclude = [str(x)[:200] for x in qc["ignore"][:10000]]
    try:
        headers = SafetensorsHeaders(folder, since=since).as_module_names(family.module_name)
    except CheckpointError as err:
        problems.append(f"files: {err}")
        return _done(report, t0)
    if family.disk_block != family.block_attr or family.disk_projs != ("gate_proj", "up_proj", "down_proj"):
        notes.append(
            f"{family.architecture} stores layers.L.{family.disk_block}.experts.E.{{{','.join(family.disk_projs)}}}; "
            f"the tables name them as transformers' state dict does (layers.L.{family.block_attr}.experts.E."
            f"{{gate_proj,up_proj,down_proj}})"
        )
    report.tensors_total = len(headers.where)
    if headers.unindexed:
        notes.append(f"{headers.unindexed} tensors of the shards are not in the index; the loader does not see them")
    config = None
    try:
        config = check_model_config(
            {k: v for k, v in cfg.items() if k != "quantization_config"},
            cfg_path,
            headers,
            info,
            every_layer=True,
            family=family,
        )
        unused = headers.unused()
        if unused and info is not None:  # every tensor is read by the loader, or named
            problems.append(
                f"tensors: {len(unused)} tensors are not used by the model config.json describes (the loader "
                f"ignores them with a warning): {describe_unused(unused)}"
            )
        report.layout_ok = info is not None and not problems  # no config file refused either
    except Exception as err:  # noqa: BLE001  the layout's checks on headers: every failure is a problem
        problems.append(f"layout: {err}")
    _tables(report, headers, info, strategies, family)
    if info is not None and config is not None:
        try:
            report.precision_groups = precision_groups(headers, info, family, config)
        except CheckpointError as err:
            problems.append(f"precision groups: {err}")
    headers.close()
    report.tensors_read, report.bytes_read = headers.tensors_read, headers.bytes_read
    return _done(report, t0)


def precision_groups(headers: SafetensorsHeaders, info: CheckpointDescription, family: MoEFamily, config) -> list[dict]:
    """The ``InspectReport.precision_groups`` rows: every module storing packed or 8-bit codes or scales (a
    tensor of a dtype of ``_QUANTIZED_DTYPES``) put in its group
    (``info.precision.group_of``; the one scheme of a single-scheme checkpoint), every other tensor bf16, each
    tensor's bytes from the headers' data offsets. ``config``: the checked model config (classes of the modules
    for compressed-tensors' class-name targets; per-expert projections are ``Linear``).

    Raises:
        CheckpointError: a module two compressed-tensors groups match equally (``PrecisionMap.group_of``).
    """
    with torch.device("meta"):
        modules = dict(family.load_class()(config).named_modules())
    by_module: dict[str, list[str]] = {}
    for n in headers.where:
        by_module.setdefault(n.rsplit(".", 1)[0], []).append(n)
    rows: dict[str, dict] = {}
    total = sum(e - b for b, e in headers.span.values()) or 1
    for module, names in by_module.items():
        size = sum(headers.span[n][1] - headers.span[n][0] for n in names)
        key, scheme, layout = "unquantized", None, None
        if any(headers.dtype[n] in _QUANTIZED_DTYPES for n in names):
            classes = EXPERT_CLASSES if module not in modules else module_classes(modules[module])
            if info.precision is None:
                key, scheme, layout = info.scheme.name, info.scheme.name, info.format
            else:
                g = info.precision.group_of(family.disk_name(module), classes)
                group = info.precision.groups.get(g) if g is not None else None
                key = g if g is not None else "not in any group"
                if group is not None and group.description is not None:
                    scheme, layout = group.scheme.name, group.description.format
        row = rows.setdefault(key, {"group": key, "scheme": scheme, "layout": layout, "modules": 0, "bytes": 0})
        row["modules"] += key != "unquantized"
        row["bytes"] += size
    out = [r for k, r in rows.items() if k != "unquantized"] + [rows[k] for k in rows if k == "unquantized"]
    for r in out:
        r["share"] = r["bytes"] / total
    return out


def _done(report: InspectReport, t0: float) -> InspectReport:
    report.seconds = time.perf_counter() - t0
    return report


def _tables(report: InspectReport, headers: SafetensorsHeaders, info, strategies, family: MoEFamily) -> None:
    """The module, scale and strategy tables of a report, from checked headers."""
    problems, notes = report.problems, report.notes
    quantized, unquantized, quantized_names = module_tables(headers)
    report.quantized, report.unquantized = quantized, unquantized
    try:
        scales = headers.read_scalars([n for n in headers.where if n.endswith(SCALE_SUFFIXES)])
    except CheckpointError as err:
        problems.append(f"scales: {err}")
        scales = {}
    act, gate_up_differ, weight = expert_scales(scales)
    if info is not None:
        for kind in ("attention", "other"):
            names = quantized_names[kind]
            listed = [n for n in names if matches(family.disk_name(n), info.exclude)]
            if len(listed) < len(names):
                notes.append(
                    f"{len(names) - len(listed)} {kind} modules outside the experts are quantized (not in the "
                    f"exclude list)"
                )
            if listed:
                problems.append(
                    f"{len(listed)} quantized {kind} modules are named by the exclude list, e.g. "
                    f"{', '.join(listed[:3])}"
                )
    fused = [r["pattern"] for r in unquantized if ".mlp.experts." in r["pattern"] and ".experts.*." not in r["pattern"]]
    if fused:
        notes.append(
            f"the experts are stored fused and unquantized ({', '.join(fused)}): the quantizer saw no "
            f"per-expert linear layers (Quark run without preprocess_for_quantization writes this)"
        )
    activation = info.scheme.activation if info is not None else None
    if activation is not None and not activation.static_scale:
        activation = None  # dynamic MX activations: nothing to unify
    if act and activation is None and info is not None:
        notes.append(f"{info.scheme.name} has no static activation scale, yet the checkpoint stores input scales")
    if info is not None and info.scheme.static_activation_scale and not act:
        problems.append(f"{info.scheme.name} needs per-expert input scales; none found")
    per_layer = layer_rows(act, gate_up_differ)
    for r in per_layer:
        if r["calibrated"] == 0:
            problems.append(
                f"layer {r['layer']} {r['point']}: no expert calibrated (every input scale 0); the "
                f"loader refuses this layer"
            )
    shared = [f"{r['layer']}/{r['point']}" for r in per_layer if r["shared"]]
    if shared:
        notes.append(
            f"{len(shared)} of {len(per_layer)} (layer, point) pairs give every calibrated expert the same "
            f"input scale (one quantizer shared by the experts, as ModelOpt 0.47 exports have): every "
            f"strategy is the same, and no per-expert range is left to recover"
        )
    uncal = sum(len(r["uncalibrated"]) for r in per_layer)
    if uncal:
        notes.append(
            f"{uncal} (layer, point, expert) input scales are 0 (never calibrated); they get the unified scale"
        )
    wvals = [v for d in weight.values() for v in d.values()]
    if wvals:
        differ = sum(
            1 for d in weight.values() if "gate_proj" in d and "up_proj" in d and d["gate_proj"] != d["up_proj"]
        )
        report.weight_global_scales = dict(count=len(wvals), min=min(wvals), max=max(wvals), gate_up_differ=differ)
        if differ:
            notes.append(f"{differ} experts have different gate and up weight global scales; vLLM uses gate's for both")
    report.activation_scales = per_layer
    if activation is not None:
        applied = [s for s in strategies if _applies(s, info.scheme)]
        if len(applied) < len(strategies):
            notes.append(
                f"{info.scheme.name}: the loader applies only the scale strategy 'max' (one static FP8 input scale "
                f"per layer, as vLLM); the other strategies are not predicted"
            )
        report.strategies = strategy_rows(act, activation, applied)


def _applies(strategy: str, scheme) -> bool:
    try:
        check_scale_strategy(strategy, scheme)
    except ValueError:
        return False
    return True
