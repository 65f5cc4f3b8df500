"""The model families mxlib quantizes, and the one check every entry taking a model or a config runs.

mxlib's experts, calibration, checkpoint layouts and loader follow transformers' Qwen3-MoE
(``Qwen3MoeForCausalLM``, ``model_type`` ``"qwen3_moe"``): its ``Qwen3MoeSparseMoeBlock`` with a
softmax router, top-k and ``norm_topk_prob`` renormalization, its fused ``Qwen3MoeExperts``
(``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) and its config fields
(``moe_intermediate_size``, ``num_experts``). Other MoE families differ in exactly those places:
Mixtral and OLMoE name their expert width ``intermediate_size`` and their expert count
``num_local_experts``; Qwen2-MoE adds a gated shared expert; DeepSeek-V3 routes by sigmoid scores
with a correction bias and grouped top-k beside shared experts; gpt-oss has expert biases, an
interleaved gate/up and the SwiGLU-OAI activation. Run through mxlib's Qwen3-MoE code such a model
would be quantized with the wrong routing or stored under a label that is not its own, so
``check_supported_model`` refuses it before any work is done, naming the class and the supported
ones.

The check reads names only (the class's method resolution order, ``model_type``,
``architectures``): it imports neither torch nor transformers and costs microseconds.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_MODEL_TYPES",
    "UnsupportedModelError",
    "check_supported_model",
    "check_supported_checkpoint",
]

# transformers class names (config.json ``architectures``) and their config's ``model_type``
SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("Qwen3MoeForCausalLM",)
SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("qwen3_moe",)


class UnsupportedModelError(TypeError):
    """A model, config or checkpoint of a family mxlib does not quantize (``SUPPORTED_ARCHITECTURES``)."""


def _supported() -> str:
    pairs = ", ".join(f"{a} (model_type {t!r})" for a, t in zip(SUPPORTED_ARCHITECTURES, SUPPORTED_MODEL_TYPES))
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
    if model_type is not None and model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} (architectures {architectures!r})"
    return None


def check_supported_model(model_or_config, where: str, name: str = "model", error: type[Exception] | None = None):
    """Refuse a model or config of a family mxlib does not quantize.

    Args:
        model_or_config: a transformers model (its class, or one of its base classes, must be named
            in ``SUPPORTED_ARCHITECTURES``; its ``config`` is checked too), a transformers config
            object, or a ``config.json`` dict (``architectures`` and ``model_type``, where present,
            must name a supported family; a dict naming neither passes, for the caller's own
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
    is_config = isinstance(obj, Mapping) or (hasattr(obj, "model_type") and not hasattr(obj, "config"))
    if is_config:
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
            ``mxlib.models.checkpoints.headers.read_json``).
        error: the exception class of the refusal (None: ``UnsupportedModelError``).

    An absent ``config.json`` passes (the caller reports it in its own words). A ``config.json``
    that names another family is refused, the message naming the file, its ``architectures`` /
    ``model_type`` and the supported architectures.
    """
    cfg_path = Path(folder) / "config.json"
    if not (cfg_path.exists() or cfg_path.is_symlink()):
        return
    check_supported_model(read_json(cfg_path), where, name=str(cfg_path), error=error)
