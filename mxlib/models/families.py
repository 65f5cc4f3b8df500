"""The model families mxlib quantizes: one ``MoEFamily`` descriptor per transformers class, and the
one check every entry taking a model or a config runs.

A family descriptor says where a transformers MoE model keeps what mxlib replaces and writes:

* its class (``architecture``, config.json ``architectures``) and ``model_type``;
* the config fields of the expert count, the expert intermediate size and top-k (each a tuple of
  the names under which a config object or a ``config.json`` dict carries it: transformers 5
  writes Qwen3-MoE's ``num_experts`` as ``num_local_experts``, DeepSeek-V3's as ``n_routed_experts``);
* which decoder layers are MoE layers (``moe_layer_indices(config)``: every layer, Qwen2-MoE's
  ``decoder_sparse_step`` / ``mlp_only_layers``, DeepSeek-V3's ``first_k_dense_replace``);
* the MoE block's attribute on a decoder layer (``block_attr``, ``"mlp"`` in transformers 5 for
  every registered family) and its experts / router attributes (``experts_attr``, ``router_attr``);
* the experts' tensor orientation (``experts_orientation``): ``"gate_up_rows"`` for transformers'
  fused ``gate_up_proj [E, 2I, H]`` (gate rows, then up rows) and ``down_proj [E, H, I]``, or
  ``"interleaved_columns"`` for gpt-oss's ``[E, H, 2I]`` with gate and up columns interleaved;
  ``expert_biases`` for experts with ``gate_up_proj_bias`` / ``down_proj_bias``;
* the activation (``activation``: a ``mxlib.moe.activations`` name, ``"silu"`` or ``"swigluoai"``)
  and the routing function of ``mxlib.moe.routing`` the family's router computes (``routing``);
* the on-disk names: the MoE block's name in a checkpoint (``disk_block``: Mixtral stores
  ``block_sparse_moe`` where transformers 5 builds ``mlp``) and the per-expert projections
  (``disk_projs``: ``gate_proj`` / ``up_proj`` / ``down_proj``, Mixtral's ``w1`` / ``w3`` / ``w2``);
  ``disk_name`` / ``module_name`` translate a state-dict name to its checkpoint name and back;
  ``fp32_tensors``: state-dict name suffixes stored and loaded in float32 (DeepSeek-V3's router);
  ``checkpoint_layout``: a layout name of ``mxlib.checkpoints`` own to the family (None:
  the scheme's default layout).

``family_of(model_or_config)`` finds the descriptor (``UnsupportedModelError`` when none fits);
``register_family(family)`` adds one. ``SUPPORTED_ARCHITECTURES`` / ``SUPPORTED_MODEL_TYPES`` list
the registered ones, in registration order. ``check_supported_model`` refuses a model or config
of any other family before any work is done, naming the class and the supported ones.

This module imports neither torch nor transformers: the check reads names only (the class's
method resolution order, ``model_type``, ``architectures``) and costs microseconds.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "MoEFamily",
    "FAMILIES",
    "QWEN3_MOE",
    "MIXTRAL",
    "OLMOE",
    "QWEN2_MOE",
    "DEEPSEEK_V3",
    "GPT_OSS",
    "register_family",
    "family_of",
    "family_for_architecture",
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_MODEL_TYPES",
    "UnsupportedModelError",
    "check_supported_model",
    "check_supported_checkpoint",
]

CANONICAL_PROJS = ("gate_proj", "up_proj", "down_proj")  # mxlib's per-expert names: w13 gate, w13 up, w2
ORIENTATIONS = ("gate_up_rows", "interleaved_columns")


class UnsupportedModelError(TypeError):
    """A model, config or checkpoint of a family mxlib does not quantize (``SUPPORTED_ARCHITECTURES``)."""


def config_value(config, names: tuple[str, ...], default=None):
    """The first of ``names`` a config object (attribute) or ``config.json`` dict (key) carries, else ``default``."""
    for n in names:
        v = config.get(n) if isinstance(config, Mapping) else getattr(config, n, None)
        if v is not None:
            return v
    return default


def every_layer(config) -> list[int]:
    """Every decoder layer is an MoE layer."""
    return list(range(int(config_value(config, ("num_hidden_layers",)))))


def sparse_step_layers(config) -> list[int]:
    """Qwen2-MoE / Qwen3-MoE: layer ``i`` is MoE unless in ``mlp_only_layers``, when
    ``(i + 1) % decoder_sparse_step == 0`` (transformers' ``Qwen2MoeDecoderLayer``; defaults 1 and
    ``[]``: every layer)."""
    step = int(config_value(config, ("decoder_sparse_step",), 1))
    dense = set(config_value(config, ("mlp_only_layers",), []) or [])
    return [i for i in every_layer(config) if i not in dense and (i + 1) % step == 0]


def first_k_dense_layers(config) -> list[int]:
    """DeepSeek-V3: layers ``first_k_dense_replace`` and later are MoE (``DeepseekV3DecoderLayer``)."""
    k = int(config_value(config, ("first_k_dense_replace",), 0))
    return [i for i in every_layer(config) if i >= k]


@dataclass(frozen=True)
class MoEFamily:
    """Where one transformers MoE class keeps its experts, router and on-disk names (module docstring).

    Args:
        architecture: the ``*ForCausalLM`` class name (config.json ``architectures``).
        model_type: its config's ``model_type``.
        config_class: the transformers config class name.
        num_experts_fields, intermediate_size_fields, top_k_fields: config names of E, I and k
            (first found wins; the first is the name mxlib reports).
        layer_rule: ``config -> decoder layer indices`` of the MoE layers (``config`` an object or a dict).
        block_attr, experts_attr, router_attr: attribute names: ``layer.<block_attr>.<experts_attr>``.
        experts_orientation: ``"gate_up_rows"`` or ``"interleaved_columns"`` (module docstring).
        expert_biases: the experts carry ``gate_up_proj_bias [E, 2I]`` and ``down_proj_bias [E, H]``.
        activation: ``mxlib.moe.activations`` name of the experts' activation.
        routing: the ``mxlib.moe.routing`` function name the router computes.
        disk_block: the MoE block's name in a checkpoint (``model.layers.L.<disk_block>.``).
        disk_projs: on-disk names of the gate, up and down projections of expert ``e``.
        fp32_tensors: state-dict name suffixes kept in float32 on disk and in memory.
        checkpoint_layout: a layout own to the family, or None.
        dense_modules: what the family has besides routed experts and attention, in words (docs, errors).
        preset_skips: fields of ``mxlib.models.presets.MODEL_PRESETS`` a preset leaves as the config has
            them (DeepSeek-V3's ``head_dim`` follows its own ``qk_rope_head_dim``).
    """

    architecture: str
    model_type: str
    config_class: str
    num_experts_fields: tuple[str, ...] = ("num_experts", "num_local_experts")
    intermediate_size_fields: tuple[str, ...] = ("moe_intermediate_size",)
    top_k_fields: tuple[str, ...] = ("num_experts_per_tok",)
    layer_rule: Callable = every_layer
    block_attr: str = "mlp"
    experts_attr: str = "experts"
    router_attr: str = "gate"
    experts_orientation: str = "gate_up_rows"
    expert_biases: bool = False
    activation: str = "silu"
    routing: str = "softmax_topk"
    disk_block: str = "mlp"
    disk_projs: tuple[str, str, str] = CANONICAL_PROJS
    fp32_tensors: tuple[str, ...] = ()
    checkpoint_layout: str | None = None
    dense_modules: str = ""
    preset_skips: tuple[str, ...] = ()

    def __post_init__(self):
        if self.experts_orientation not in ORIENTATIONS:
            raise ValueError(
                f"experts_orientation: expected one of {list(ORIENTATIONS)}, got {self.experts_orientation!r}"
            )
        if len(self.disk_projs) != 3:
            raise ValueError(f"disk_projs: expected (gate, up, down) names, got {self.disk_projs!r}")

    # config fields
    def num_experts(self, config) -> int:
        """E of a config object or dict (``num_experts_fields``)."""
        return int(config_value(config, self.num_experts_fields))

    def intermediate_size(self, config) -> int:
        """The routed experts' I of a config object or dict (``intermediate_size_fields``)."""
        return int(config_value(config, self.intermediate_size_fields))

    def top_k(self, config) -> int:
        """k of a config object or dict (``top_k_fields``)."""
        return int(config_value(config, self.top_k_fields))

    def moe_layer_indices(self, config) -> list[int]:
        """Decoder layer indices of the MoE layers, ascending (``layer_rule``)."""
        return list(self.layer_rule(config))

    # names
    def experts_prefix(self, layer: int) -> str:
        """State-dict prefix of layer ``layer``'s experts: ``model.layers.L.mlp.experts``."""
        return f"model.layers.{layer}.{self.block_attr}.{self.experts_attr}"

    def disk_name(self, name: str) -> str:
        """The checkpoint name of a state-dict (or module) name, mxlib's per-expert names included
        (``model.layers.L.mlp.experts.e.gate_proj.weight`` -> Mixtral's
        ``model.layers.L.block_sparse_moe.experts.e.w1.weight``). Identity for Qwen3-MoE."""
        if self.disk_block != self.block_attr:
            name = re.sub(rf"(^|\.)layers\.(\d+)\.{self.block_attr}(\.|$)", rf"\1layers.\2.{self.disk_block}\3", name)
        if self.disk_projs != CANONICAL_PROJS:
            for canon, disk in zip(CANONICAL_PROJS, self.disk_projs):
                name = re.sub(
                    rf"\.{self.experts_attr}\.(\d+)\.{canon}(\.|$)", rf".{self.experts_attr}.\1.{disk}\2", name
                )
        return name

    def module_name(self, disk: str) -> str:
        """The inverse of ``disk_name``: a checkpoint name as the state-dict (mxlib's per-expert) name."""
        if self.disk_projs != CANONICAL_PROJS:
            for canon, d in zip(CANONICAL_PROJS, self.disk_projs):
                disk = re.sub(rf"\.{self.experts_attr}\.(\d+)\.{d}(\.|$)", rf".{self.experts_attr}.\1.{canon}\2", disk)
        if self.disk_block != self.block_attr:
            disk = re.sub(rf"(^|\.)layers\.(\d+)\.{self.disk_block}(\.|$)", rf"\1layers.\2.{self.block_attr}\3", disk)
        return disk

    def keeps_fp32(self, name: str) -> bool:
        """Whether a state-dict name is stored and loaded in float32 (``fp32_tensors``)."""
        return any(name.endswith(s) for s in self.fp32_tensors)

    def load_class(self):
        """The transformers ``*ForCausalLM`` class (imports transformers)."""
        import transformers

        return getattr(transformers, self.architecture)

    def load_config_class(self):
        """The transformers config class (imports transformers)."""
        import transformers

        return getattr(transformers, self.config_class)


FAMILIES: dict[str, MoEFamily] = {}  # architecture -> family, in registration order
SUPPORTED_ARCHITECTURES: tuple[str, ...] = ()
SUPPORTED_MODEL_TYPES: tuple[str, ...] = ()


def register_family(family: MoEFamily) -> MoEFamily:
    """Add a family to ``FAMILIES`` (and ``SUPPORTED_ARCHITECTURES`` / ``SUPPORTED_MODEL_TYPES``).

    Raises:
        TypeError: ``family`` is not a ``MoEFamily``.
        ValueError: its architecture or model_type is registered already.
    """
    global SUPPORTED_ARCHITECTURES, SUPPORTED_MODEL_TYPES
    if not isinstance(family, MoEFamily):
        raise TypeError(f"family: expected a MoEFamily, got {type(family).__name__}")
    if family.architecture in FAMILIES:
        raise ValueError(f"family: architecture {family.architecture!r} is registered already")
    if family.model_type in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"family: model_type {family.model_type!r} is registered already")
    FAMILIES[family.architecture] = family
    SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
    SUPPORTED_MODEL_TYPES = tuple(f.model_type for f in FAMILIES.values())
    return family


QWEN3_MOE = register_family(
    MoEFamily(
        architecture="Qwen3MoeForCausalLM",
        model_type="qwen3_moe",
        config_class="Qwen3MoeConfig",
        layer_rule=sparse_step_layers,
        dense_modules="dense MLP layers only where decoder_sparse_step / mlp_only_layers make them",
    )
)


MIXTRAL = register_family(
    MoEFamily(
        architecture="MixtralForCausalLM",
        model_type="mixtral",
        config_class="MixtralConfig",
        num_experts_fields=("num_local_experts", "num_experts"),
        intermediate_size_fields=("intermediate_size",),
        disk_block="block_sparse_moe",
        disk_projs=("w1", "w3", "w2"),
        dense_modules="none: every layer's MLP is the routed experts",
    )
)
OLMOE = register_family(
    MoEFamily(
        architecture="OlmoeForCausalLM",
        model_type="olmoe",
        config_class="OlmoeConfig",
        intermediate_size_fields=("intermediate_size",),
        dense_modules="none: every layer's MLP is the routed experts",
    )
)
QWEN2_MOE = register_family(
    MoEFamily(
        architecture="Qwen2MoeForCausalLM",
        model_type="qwen2_moe",
        config_class="Qwen2MoeConfig",
        layer_rule=sparse_step_layers,
        dense_modules="a sigmoid-gated shared expert in every MoE block (mlp.shared_expert, mlp.shared_expert_gate); "
        "dense MLP layers where decoder_sparse_step / mlp_only_layers make them",
    )
)
DEEPSEEK_V3 = register_family(
    MoEFamily(
        architecture="DeepseekV3ForCausalLM",
        model_type="deepseek_v3",
        config_class="DeepseekV3Config",
        num_experts_fields=("n_routed_experts", "num_local_experts"),
        layer_rule=first_k_dense_layers,
        routing="grouped_topk",
        fp32_tensors=(".mlp.gate.weight", ".mlp.gate.e_score_correction_bias"),
        preset_skips=("head_dim", "intermediate_size"),
        dense_modules="n_shared_experts shared experts in every MoE block (mlp.shared_experts); dense MLPs in "
        "the first first_k_dense_replace layers",
    )
)

# gpt-oss (mxlib.models.gpt_oss): GptOssExperts [E, H, 2I] with gate/up columns interleaved and biases,
# SwiGLU-OAI, a biased router whose top-k logits are softmaxed, stored in gpt-oss's native MXFP4 layout
GPT_OSS = register_family(
    MoEFamily(
        architecture="GptOssForCausalLM",
        model_type="gpt_oss",
        config_class="GptOssConfig",
        num_experts_fields=("num_local_experts", "num_experts"),
        intermediate_size_fields=("intermediate_size",),
        top_k_fields=("num_experts_per_tok", "experts_per_token"),
        router_attr="router",
        experts_orientation="interleaved_columns",
        expert_biases=True,
        activation="swigluoai",
        routing="topk_softmax",
        checkpoint_layout="gpt-oss-mxfp4",
        dense_modules="attention with learned sinks and q/k/v/o biases, sliding-window and full layers alternating",
    )
)


def _supported() -> str:
    pairs = ", ".join(f"{f.architecture} (model_type {f.model_type!r})" for f in FAMILIES.values())
    return f"mxlib supports {pairs}"


def _config_names(config) -> tuple[list | None, object]:
    """``(architectures, model_type)`` of a config.json dict or a transformers config object."""
    if isinstance(config, Mapping):
        return config.get("architectures"), config.get("model_type")
    # a PretrainedConfig: model_type is a class attribute, architectures None unless set
    return getattr(config, "architectures", None), getattr(config, "model_type", None)


def _describe_config(architectures, model_type) -> str | None:
    """What is wrong with a config's names, or None when they name a supported family."""
    if architectures is not None:
        if not isinstance(architectures, (list, tuple)) or not all(isinstance(a, str) for a in architectures):
            return f"architectures: expected a list of class names, found {architectures!r}"
        other = [a for a in architectures if a not in SUPPORTED_ARCHITECTURES]
        if other:
            return f"architectures {list(architectures)} (model_type {model_type!r})"
        if model_type is not None and any(FAMILIES[a].model_type != model_type for a in architectures):
            return f"architectures {list(architectures)} with model_type {model_type!r} of another family"
    if model_type is not None and model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} (architectures {architectures!r})"
    return None


def _is_config(obj) -> bool:
    return isinstance(obj, Mapping) or (hasattr(obj, "model_type") and not hasattr(obj, "config"))


def family_for_architecture(architecture: str) -> MoEFamily:
    """The registered family of a class name.

    Raises:
        UnsupportedModelError: no family registers ``architecture``.
    """
    if architecture not in FAMILIES:
        raise UnsupportedModelError(f"architecture: {architecture!r} is not a registered family; {_supported()}")
    return FAMILIES[architecture]


def family_of(model_or_config, where: str = "family_of", name: str = "model") -> MoEFamily:
    """The ``MoEFamily`` of a transformers model (by its class or a base class), a config object or
    a ``config.json`` dict (by ``architectures``, else ``model_type``).

    Raises:
        UnsupportedModelError: no registered family fits (``check_supported_model``'s message), or a
            dict naming neither ``architectures`` nor ``model_type``.
    """
    obj = check_supported_model(model_or_config, where, name=name)
    if _is_config(obj):
        architectures, model_type = _config_names(obj)
        if architectures:
            return FAMILIES[architectures[0]]
        for f in FAMILIES.values():
            if f.model_type == model_type:
                return f
        raise UnsupportedModelError(
            f"{where}: {name}: a config naming neither architectures nor model_type; {_supported()}"
        )
    for c in type(obj).__mro__:
        if c.__name__ in FAMILIES:
            return FAMILIES[c.__name__]
    raise AssertionError("check_supported_model passed a model of no registered class")  # pragma: no cover


def check_supported_model(model_or_config, where: str, name: str = "model", error: type[Exception] | None = None):
    """Refuse a model or config of a family mxlib does not quantize.

    Args:
        model_or_config: a transformers model (its class, or one of its base classes, must be named
            in ``SUPPORTED_ARCHITECTURES``; its ``config`` is checked too), a transformers config
            object, or a ``config.json`` dict (``architectures`` and ``model_type``, where present,
            must name one supported family; a dict naming neither passes, for the caller's own
            field checks).
        where: the public function being called, which the message names first.
        name: the argument's name in that function.
        error: the exception class to raise (the checkpoint readers pass ``CheckpointError``);
            None raises ``UnsupportedModelError``.

    Returns:
        ``model_or_config``, unchanged.

    Raises:
        UnsupportedModelError (a ``TypeError``), or ``error``: the message names ``where``,
        ``name``, the class or the config's ``architectures`` / ``model_type``, and the
        supported architectures.
    """
    err = UnsupportedModelError if error is None else error
    obj = model_or_config
    if _is_config(obj):
        problem = _describe_config(*_config_names(obj))
        if problem is not None:
            kind = "config" if isinstance(obj, Mapping) else type(obj).__name__
            raise err(f"{where}: {name}: a {kind} of {problem}, which mxlib does not quantize; {_supported()}")
        return obj
    cls = type(obj)
    if not any(c.__name__ in SUPPORTED_ARCHITECTURES for c in cls.__mro__):
        config = getattr(obj, "config", None)
        model_type = getattr(config, "model_type", None)
        raise err(
            f"{where}: {name}: expected a transformers model of a supported class, got {cls.__name__}"
            f"{f' (model_type {model_type!r})' if model_type is not None else ''}, which mxlib does not quantize; "
            f"{_supported()}"
        )
    config = getattr(obj, "config", None)
    if config is not None:
        problem = _describe_config(*_config_names(config))
        if problem is not None:
            raise err(f"{where}: {name}.config: {problem} in a {cls.__name__}; {_supported()}")
    return obj


def check_supported_checkpoint(folder: str | os.PathLike, where: str, read_json, error: type[Exception] | None = None):
    """``check_supported_model`` on a checkpoint folder's ``config.json``, before anything else is read.

    Args:
        folder: the checkpoint or config folder.
        where: the public function being called, which the message names first.
        read_json: the caller's reader of an untrusted JSON file (``path -> dict``, raising its own
            error for a file that is not a regular file, too large or not a JSON object:
            ``mxlib.checkpoints.files.headers.read_json``).
        error: the exception class of the refusal (None: ``UnsupportedModelError``).

    Returns:
        The checkpoint's ``MoEFamily`` (``QWEN3_MOE`` when ``config.json`` is absent or names no family).

    An absent ``config.json`` passes (the caller reports it in its own words). A ``config.json``
    that names another family is refused, the message naming the file, its ``architectures`` /
    ``model_type`` and the supported architectures.
    """
    cfg_path = Path(folder) / "config.json"
    if not (cfg_path.exists() or cfg_path.is_symlink()):
        return QWEN3_MOE
    cfg = read_json(cfg_path)
    check_supported_model(cfg, where, name=str(cfg_path), error=error)
    if not isinstance(cfg, Mapping) or (cfg.get("architectures") is None and cfg.get("model_type") is None):
        return QWEN3_MOE
    return family_of(cfg, where, name=str(cfg_path))
