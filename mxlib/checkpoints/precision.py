"""Mixed-precision checkpoints: which scheme each module of a checkpoint is stored in.

A mixed-precision checkpoint gives modules different schemes (MXFP8 attention beside NVFP4 experts, an
NVFP4 ``lm_head``). Each producer says so in its own form; ``read_precision_map`` turns each into one
``PrecisionMap``: its precision groups (``PrecisionGroup``: the config's name for the group, the scheme,
the registered layout that reads its tensors, the E8M0 rule of its dynamic MX activations) and the rule
that gives a module name its group. Matching follows each producer's own code:

* **ModelOpt** ``quant_algo: "MIXED_PRECISION"`` (``hf_quant_config.json``'s ``quantization``, or
  ``config.json``'s ``quantization_config``): ``quantized_layers`` maps each quantized module's name to
  ``{"quant_algo": ..., "group_size": ...}``; a module is in the entry of its own name, else of the nearest
  module above it that is named there, else it is unquantized (NVIDIA/Model-Optimizer
  ``modelopt/torch/export/quant_utils.py``, ``get_quant_config`` and ``process_layer_quant_config``, which
  write one entry per module holding quantizers; ``modelopt/torch/export/convert_hf_config.py``,
  ``convert_hf_quant_config_format``, which also writes one ``config_groups`` entry per distinct layer
  config with the layer names as ``targets``). The module holding the quantizers is not always the one
  whose tensors are stored: for transformers 5's fused experts nvidia-modelopt 0.47.0 names the experts
  module (``model.layers.L.mlp.experts``: ``{"quant_algo": "NVFP4", "group_size": 16}``) and stores
  per-expert tensors beneath it (``model.layers.L.mlp.experts.E.gate_proj.weight``); vLLM's
  ``ModelOptMixedPrecisionConfig`` looks its fused-MoE layer up by that same name. A mixed export writes no
  ``exclude_modules`` (the routers and the embedding are simply not named). A group is one distinct layer
  config, named by its ``quant_algo`` (and ``group_size`` where given: ModelOpt writes it for NVFP4 and
  MXFP8 entries).
* **Quark** (``quant_method: quark``): a module in ``exclude`` is unquantized; else the first
  ``layer_quant_config`` entry whose key matches its name by ``fnmatch.fnmatch`` (in the dict's order),
  else the ``layer_type_quant_config`` entry of its module class (Quark keys it by the class, which the
  JSON export writes as the class name: matched against the names of the module's classes), else
  ``global_quant_config`` (amd/Quark ``quark/torch/quantization/model_transformation.py``: "layer_quant_config
  > layer_type_quant_config > global_quant_config"). A group is named by its key (``global_quant_config``
  for the global one).
* **compressed-tensors** (several ``config_groups``, or ``format: "mixed-precision"`` with a ``format`` per
  group): a module in ``ignore`` is unquantized; else the group whose ``targets`` match it, the most specific
  match winning: an exact name, then a ``re:`` regex (Python's ``re.match``: anchored at the start, not at the
  end), then a class name (vllm-project/compressed-tensors ``src/compressed_tensors/utils/match.py``,
  ``match_name`` and ``match_targets``: "exact strings, regex patterns, module names"). Two groups matching a
  module equally specifically are refused as ambiguous.

The exclude / ignore lists keep mxlib's matching (``layout.matches``: names, globs, ``re:`` full match), as
single-scheme checkpoints do. Each group's scheme is read by the producer's single-scheme layout
(``layouts/``), so a group is supported exactly when the single-scheme checkpoint it describes is; a
module whose group is not supported is refused naming the module, its group, what the group asks and what is
supported. A layer's experts are one tensor group in the emulation: all of a layer's expert projections must
be in one group, or the layer is refused naming two that differ.

A mixed checkpoint's headline scheme (``CheckpointDescription.scheme``, what the inspector's header and the
activation-scale report use) is that of the routed experts' group, found by asking the map for an expert
projection's group, not by the order of the groups: llm-compressor numbers its groups in the model's module order,
so the attention group comes first.

Module names are the on-disk names (``MoEFamily.disk_name``). Per-expert projections
(``model.layers.L.mlp.experts.E.gate_proj``) have the class name ``Linear``, as the producers see them
(per-expert ``nn.Linear`` modules); the other modules the classes of the model's own modules.
"""

from __future__ import annotations

import fnmatch
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from ..models.families import FAMILIES
from ..moe.schemes import MoEQuantScheme
from .layout import PROJS, CheckpointDescription, CheckpointError, _compile, matches

__all__ = [
    "PrecisionGroup",
    "PrecisionMap",
    "read_precision_map",
    "mixed_description",
    "is_mixed",
    "module_description",
    "module_classes",
    "experts_description",
    "EXPERT_CLASSES",
    "MODELOPT_MIXED",
    "CT_MIXED_FORMAT",
]

MODELOPT_MIXED = "MIXED_PRECISION"
CT_MIXED_FORMAT = "mixed-precision"
# the class names a per-expert projection has for the producers (per-expert nn.Linear modules)
EXPERT_CLASSES = ("Linear", "Module")


@dataclass(frozen=True)
class PrecisionGroup:
    """One precision group of a mixed checkpoint.

    ``name``: the config's name for it (ModelOpt: ``NVFP4`` / ``MXFP8``, with ``group_size`` where given;
    Quark: the ``layer_quant_config`` / ``layer_type_quant_config`` key or ``global_quant_config``;
    compressed-tensors: the ``config_groups`` key); ``description``: the ``CheckpointDescription`` of its
    modules (``format``: the registered layout that reads their tensors, ``scheme``, the checkpoint's
    exclude list, the E8M0 rule of dynamic MX activations), or None where the group is not supported;
    ``error``: why not (None when supported); ``config``: the group's config as stored.
    """

    name: str
    description: CheckpointDescription | None
    error: str | None = None
    config: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def scheme(self) -> MoEQuantScheme | None:
        return None if self.description is None else self.description.scheme


class PrecisionMap:
    """Which ``PrecisionGroup`` each module of a mixed checkpoint is in (module docstring).

    ``producer``: ``"modelopt"``, ``"quark"`` or ``"compressed-tensors"``; ``groups``: ``{name:
    PrecisionGroup}`` in the config's order; ``exclude``: the unquantized modules' names or patterns.
    ``group_of(name, classes)`` gives a module's group name, or None for an unquantized one.
    """

    def __init__(self, producer: str, groups: dict[str, PrecisionGroup], exclude: list[str], rule: Callable):
        self.producer = producer
        self.groups = groups
        self.exclude = exclude
        self._rule = rule

    def group_of(self, name: str, classes: tuple[str, ...] = ("Linear",)) -> str | None:
        """The group name of module ``name`` (on-disk name; ``classes``: its class names), None if unquantized.

        Raises:
            CheckpointError: a module two compressed-tensors groups match equally specifically.
        """
        if matches(name, self.exclude):
            return None
        return self._rule(name, classes)

    def description(self, name: str, classes: tuple[str, ...] = ("Linear",)) -> CheckpointDescription | None:
        """The ``CheckpointDescription`` module ``name`` is read with, None if unquantized.

        Raises:
            CheckpointError: its group is not supported, naming the module, the group, what it asks and
                what is supported.
        """
        g = self.group_of(name, classes)
        if g is None:
            return None
        group = self.groups[g]
        if group.description is None:
            raise CheckpointError(
                f"module {name!r} is in precision group {g!r} of this {self.producer} mixed-precision checkpoint "
                f"({json.dumps(group.config, default=str)[:160]}), which the emulation does not support: "
                f"{group.error}"
            )
        return group.description

    def __repr__(self) -> str:
        groups = {n: (g.scheme.name if g.scheme else f"unsupported: {g.error}") for n, g in self.groups.items()}
        return f"PrecisionMap({self.producer}, {groups})"


# ----------------------------------------------------------------------------- producers


def _describe(read: Callable[[dict], CheckpointDescription], qc: dict, exclude: list[str]):
    try:
        d = read(qc)
    except CheckpointError as err:
        return None, str(err)
    return CheckpointDescription(d.format, d.scheme, list(exclude), d.activation_scale_mode), None


def _modelopt(qc: dict, read) -> PrecisionMap:
    layers = qc.get("quantized_layers")
    if not isinstance(layers, dict) or not layers:
        raise CheckpointError(
            f"quantization_config.quantized_layers: quant_algo {MODELOPT_MIXED!r} needs an object of module name -> "
            f"layer config, found {str(layers)[:80]!r}"
        )
    exclude = list(qc.get("ignore") or qc.get("exclude_modules") or [])
    groups: dict[str, PrecisionGroup] = {}
    of: dict[str, str] = {}
    for name, cfg in layers.items():
        if not isinstance(cfg, dict) or not isinstance(cfg.get("quant_algo"), str):
            raise CheckpointError(
                f"quantization_config.quantized_layers[{name!r}]: expected an object with a quant_algo, found {cfg!r}"
            )
        gname = cfg["quant_algo"] if cfg.get("group_size") is None else f"{cfg['quant_algo']} g{cfg['group_size']}"
        if gname not in groups:
            single = {"quant_method": "modelopt", "quant_algo": cfg["quant_algo"], "group_size": cfg.get("group_size")}
            d, err = _describe(read, single, exclude)
            groups[gname] = PrecisionGroup(gname, d, err, dict(cfg))
        of[name] = gname
    # the experts' group first (mixed_description describes the checkpoint by it): nvidia-modelopt lists the modules
    # in the model's order, so a layer's attention projections come before its experts
    experts = next((of[n] for n in of if "experts" in n.split(".")), None)
    if experts is not None:
        groups = {experts: groups[experts], **{k: g for k, g in groups.items() if k != experts}}

    def rule(name: str, classes: tuple[str, ...]) -> str | None:
        # the module's own entry, else the nearest enclosing module's (fused experts: the experts module)
        while True:
            if name in of:
                return of[name]
            if "." not in name:
                return None
            name = name.rsplit(".", 1)[0]

    return PrecisionMap("modelopt", groups, exclude, rule)


def _quark(qc: dict, read) -> PrecisionMap:
    exclude = list(qc.get("exclude") or [])
    by_name = qc.get("layer_quant_config") or {}
    by_type = qc.get("layer_type_quant_config") or {}
    for where, d in (("layer_quant_config", by_name), ("layer_type_quant_config", by_type)):
        if not isinstance(d, dict):
            raise CheckpointError(f"quantization_config.{where}: expected an object, found {type(d).__name__}")
    base = {k: v for k, v in qc.items() if k not in ("layer_quant_config", "layer_type_quant_config")}
    groups: dict[str, PrecisionGroup] = {}
    for gname, cfg in (*by_name.items(), *by_type.items(), ("global_quant_config", qc.get("global_quant_config"))):
        if not isinstance(cfg, dict):
            raise CheckpointError(f"quantization_config: the config of {gname!r}: expected an object, found {cfg!r}")
        d, err = _describe(read, {**base, "global_quant_config": cfg}, exclude)
        if err is not None and gname != "global_quant_config":
            where = "layer_quant_config" if gname in by_name else "layer_type_quant_config"
            err = err.replace("quantization_config.global_quant_config", f"quantization_config.{where}[{gname!r}]")
        groups[gname] = PrecisionGroup(gname, d, err, dict(cfg))

    def rule(name: str, classes: tuple[str, ...]) -> str:
        for pattern in by_name:
            if fnmatch.fnmatch(name, pattern):
                return pattern
        for cls in by_type:
            if cls in classes:
                return cls
        return "global_quant_config"

    return PrecisionMap("quark", groups, exclude, rule)


def _regex(target: str):
    try:
        return re.compile(target[3:])
    except re.error as err:
        raise CheckpointError(f"config_groups target {target!r}: not a valid regular expression ({err})") from None


def _compressed_tensors(qc: dict, read) -> PrecisionMap:
    cgroups = qc.get("config_groups")
    if not isinstance(cgroups, dict) or not cgroups:
        raise CheckpointError("quantization_config.config_groups: missing")
    exclude = list(qc.get("ignore") or [])
    base = {k: v for k, v in qc.items() if k != "config_groups"}
    groups: dict[str, PrecisionGroup] = {}
    targets: dict[str, list[str]] = {}
    for gname, group in cgroups.items():
        if not isinstance(group, dict) or not isinstance(group.get("targets"), list):
            raise CheckpointError(f"quantization_config.config_groups.{gname}.targets: expected a list of names")
        fmt = group.get("format") or qc.get("format")
        if fmt in (None, CT_MIXED_FORMAT):
            d = None
            err = f"quantization_config.config_groups.{gname}.format: missing (the top-level format is {fmt!r})"
        else:
            d, err = _describe(read, {**base, "format": fmt, "config_groups": {gname: group}}, exclude)
        groups[gname] = PrecisionGroup(gname, d, err, dict(group))
        targets[gname] = list(group["targets"])
        for t in targets[gname]:
            if t.startswith("re:"):
                _regex(t)
                _compile(t)  # bounded length, as exclude patterns

    def rule(name: str, classes: tuple[str, ...]) -> str | None:
        for level in ("exact", "regex", "class"):
            hits = []
            for gname, ts in targets.items():
                for t in ts:
                    if level == "exact":
                        hit = not t.startswith("re:") and t == name
                    elif level == "regex":
                        hit = t.startswith("re:") and _regex(t).match(name) is not None
                    else:
                        hit = not t.startswith("re:") and t in classes
                    if hit:
                        hits.append(gname)
                        break
            if len(hits) > 1:
                raise CheckpointError(
                    f"module {name!r} is matched by the targets of config_groups {hits} equally specifically "
                    f"({level} match); compressed-tensors takes one group per module"
                )
            if hits:
                return hits[0]
        return None

    return PrecisionMap("compressed-tensors", groups, exclude, rule)


def is_mixed(qc: dict) -> bool:
    """Whether a ``quantization_config`` gives modules different schemes (module docstring): ModelOpt's
    ``MIXED_PRECISION``, Quark per-layer or per-type configs that differ from the global one, compressed-tensors'
    ``mixed-precision`` format or config groups that differ in anything but their targets."""
    method = qc.get("quant_method")
    if method == "modelopt":
        return qc.get("quant_algo") == MODELOPT_MIXED
    if method == "quark":
        g = qc.get("global_quant_config") or {}
        by_name = qc.get("layer_quant_config") or {}
        same = isinstance(by_name, dict) and all(
            isinstance(o, dict) and all(o.get(k) == g.get(k) for k in ("weight", "input_tensors"))
            for o in by_name.values()
        )
        return not same or bool(qc.get("layer_type_quant_config"))
    if method == "compressed-tensors":
        if qc.get("format") == CT_MIXED_FORMAT:
            return True
        groups = qc.get("config_groups")
        if not isinstance(groups, dict) or len(groups) < 2:
            return False
        bodies = [
            json.dumps({k: v for k, v in g.items() if k != "targets"}, sort_keys=True, default=str)
            for g in groups.values()
            if isinstance(g, dict)
        ]
        return len(set(bodies)) > 1
    return False


def read_precision_map(qc: dict, read: Callable[[dict], CheckpointDescription]) -> PrecisionMap:
    """The ``PrecisionMap`` of a mixed ``quantization_config`` (``is_mixed``).

    Args:
        qc: the ``quantization_config`` (ModelOpt's legacy ``hf_quant_config.json`` as the loader reads it).
        read: the producer's single-scheme ``read_config`` (``CheckpointLayout.read_config``), which reads
            each group's config as if it were a whole checkpoint's.

    Raises:
        CheckpointError: a malformed mixed config (``quantized_layers`` missing, a group without
            ``targets``, a ``re:`` target that does not compile), naming the field.
    """
    method = qc.get("quant_method")
    if method == "modelopt":
        return _modelopt(qc, read)
    if method == "quark":
        return _quark(qc, read)
    if method == "compressed-tensors":
        return _compressed_tensors(qc, read)
    raise CheckpointError(f"quantization_config.quant_method: no mixed-precision form is read for {method!r}")


# decoder layers probed for the experts' group (a model's first layers may be dense: DeepSeek's first_k_dense)
_PROBE_LAYERS = 64


def _experts_group(pm: PrecisionMap) -> str | None:
    """The group of the first expert projection the config quantizes: expert 0's gate projection of layers 0, 1,
    ... under each registered family's on-disk names (``MoEFamily.disk_name``); None if none is in a group."""
    for layer in range(_PROBE_LAYERS):
        for family in FAMILIES.values():
            name = family.disk_name(f"{family.experts_prefix(layer)}.0.{PROJS[0]}")
            try:
                g = pm.group_of(name, EXPERT_CLASSES)
            except CheckpointError:  # matched ambiguously: the loader names it
                continue
            if g is not None:
                return g
    return None


def mixed_description(layout_name: str, qc: dict, read: Callable[[dict], CheckpointDescription]):
    """The ``CheckpointDescription`` of a mixed ``quantization_config``: ``format`` the producer's layout
    (``layout_name``), ``scheme`` the experts' group's (the group of the first expert projection the config
    quantizes, whatever the order of the groups), else its first supported group's that is not for linear layers
    only, else its first supported group's; ``exclude`` the unquantized modules, ``precision`` the ``PrecisionMap``.

    Raises:
        CheckpointError: a malformed mixed config, or one none of whose groups is supported (naming each group
            and why).
    """
    pm = read_precision_map(qc, read)
    supported = [g for g in pm.groups.values() if g.description is not None]
    # the experts' group where the config puts an expert projection in a supported one (producers order their
    # groups their own way: llm-compressor by the model's module order, attention first); else the first that
    # can hold experts (FP8 linear-layer groups cannot)
    experts = pm.groups.get(_experts_group(pm))
    if experts is not None and experts.description is not None and not experts.scheme.linear_only:
        first = experts
    else:
        first = next((g for g in supported if not g.scheme.linear_only), supported[0] if supported else None)
    if first is None:
        why = "; ".join(f"{n!r}: {g.error}" for n, g in pm.groups.items())
        raise CheckpointError(f"quantization_config: no precision group of this mixed checkpoint is supported ({why})")
    return CheckpointDescription(
        layout_name, first.scheme, list(pm.exclude), first.description.activation_scale_mode, precision=pm
    )


# ----------------------------------------------------------------------------- per module


def module_classes(module) -> tuple[str, ...]:
    """The class names of a module (its class and its bases), which class-name targets match."""
    return tuple(c.__name__ for c in type(module).__mro__)


def module_description(info: CheckpointDescription, name: str, classes: tuple[str, ...] = ("Linear",)):
    """The ``CheckpointDescription`` module ``name`` (on-disk name) is read with, None where the checkpoint
    stores it unquantized: for a single-scheme checkpoint ``info`` itself unless the exclude list names it,
    for a mixed one its group's (``PrecisionMap.description``, which refuses an unsupported group)."""
    if info.precision is None:
        return None if matches(name, info.exclude) else info
    return info.precision.description(name, classes)


def experts_description(info: CheckpointDescription, disk_name: Callable[[str], str], prefix: str, e: int):
    """The ``CheckpointDescription`` of one layer's experts (``prefix``: ``model.layers.L.mlp.experts``; ``e``
    experts; ``disk_name``: ``MoEFamily.disk_name``), None where they are stored bf16.

    A single-scheme checkpoint looks at expert 0's projections (all of them excluded: bf16), as before. A
    mixed one resolves every expert's three projections, which must share one group.

    Raises:
        CheckpointError: experts of one layer in different groups (naming two of them and their groups), or
            in an unsupported group.
    """
    if info.precision is None:
        return None if all(matches(disk_name(f"{prefix}.0.{p}"), info.exclude) for p in PROJS) else info
    pm = info.precision
    first = disk_name(f"{prefix}.0.{PROJS[0]}")
    want = pm.group_of(first, EXPERT_CLASSES)
    for x in range(e):
        for p in PROJS:
            n = disk_name(f"{prefix}.{x}.{p}")
            g = pm.group_of(n, EXPERT_CLASSES)
            if g != want:
                raise CheckpointError(
                    f"{n!r} is in precision group {g!r} but {first!r} in {want!r}: the emulation runs one layer's "
                    f"experts in one scheme, so all of a layer's expert projections must be in one group"
                )
    return pm.description(first, EXPERT_CLASSES)
