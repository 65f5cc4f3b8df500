"""Qwen3-30B-A3B on transformers' Qwen3-MoE, with mxlib experts swapped in.

Shape legend: ``T`` tokens, ``H`` hidden (2048), ``I`` expert intermediate (768),
``E`` experts (128), ``k`` experts per token (8), ``L`` layers (48; the workbook
uses 4, as vLLM's own smoke test does).

The family-generic code is ``mxlib.models.moe_models``; this module keeps Qwen3-MoE's names:
``expert_weights``, ``swap_experts``, ``moe_layers`` and ``tied_parameter_names`` are that module's
functions (they take a model of any registered family), ``empty_qwen3_moe`` and
``dummy_qwen3_moe`` its builders under this name. Every function here that takes a model or a
config refuses one of an unregistered family first, with
``mxlib.models.families.UnsupportedModelError`` naming its class (``check_supported_model``).
"""

from __future__ import annotations

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from .moe_models import (
    WARMUP_SEED_OFFSET,
    WARMUP_SHAPE,
    BoundToModel,
    dummy_moe_model,
    empty_moe_model,
    expert_weights,
    moe_layers,
    swap_experts,
    tied_parameter_names,
)
from .presets import MODEL_PRESETS, QWEN3_30B_A3B

__all__ = [
    "QWEN3_30B_A3B",
    "qwen3_30b_a3b_config",
    "MODEL_PRESETS",
    "model_preset_overrides",
    "empty_qwen3_moe",
    "tied_parameter_names",
    "dummy_qwen3_moe",
    "expert_weights",
    "swap_experts",
    "moe_layers",
    "BoundToModel",
    "WARMUP_SEED_OFFSET",
    "WARMUP_SHAPE",
]


def qwen3_30b_a3b_config(num_hidden_layers: int = 4, **overrides) -> Qwen3MoeConfig:
    """Qwen3-30B-A3B's configuration, cut to ``num_hidden_layers`` (default 4).

    Any other field can be overridden (tests use tiny hidden sizes).
    """
    values = dict(QWEN3_30B_A3B, num_hidden_layers=num_hidden_layers, **overrides)
    rope_theta = values.pop("rope_theta")
    cfg = Qwen3MoeConfig(**values)
    # transformers 5 keeps RoPE settings in rope_parameters
    rp = dict(getattr(cfg, "rope_parameters", None) or {})
    rp.update(rope_type=rp.get("rope_type", "default"), rope_theta=rope_theta)
    cfg.rope_parameters = rp
    cfg.rope_theta = rope_theta
    return cfg


def model_preset_overrides(model_preset: str) -> dict:
    """The ``qwen3_30b_a3b_config`` overrides of a ``MODEL_PRESETS`` name.

    Raises:
        ValueError: ``model_preset`` is not a key of ``MODEL_PRESETS``.
    """
    if model_preset not in MODEL_PRESETS:
        raise ValueError(f"model_preset: expected one of {list(MODEL_PRESETS)}, got {model_preset!r}")
    return dict(MODEL_PRESETS[model_preset])


def empty_qwen3_moe(config: Qwen3MoeConfig, dtype: torch.dtype = torch.bfloat16, device="cpu") -> Qwen3MoeForCausalLM:
    """The transformers model with uninitialized parameters (``mxlib.models.moe_models.empty_moe_model``:
    no init cost, pages touched only when written; tied word embeddings tied).

    Raises:
        UnsupportedModelError: a config of a family mxlib does not quantize (``mxlib.models.families``).
    """
    return empty_moe_model(config, dtype, device, where="empty_qwen3_moe")


@torch.no_grad()
def dummy_qwen3_moe(
    config: Qwen3MoeConfig,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    expert_spread: float = 0.0,
    device="cpu",
    balanced_routing: bool = True,
    attn_update_ratio: float = 0.25,
    moe_update_ratio: float | None = 0.25,
) -> Qwen3MoeForCausalLM:
    """A seeded random-weight model: the workbook's "dummy checkpoint" in bf16.

    ``mxlib.models.moe_models.dummy_moe_model`` (its docstring: the balanced-routing construction,
    the expert spread and their measurements on Qwen3-30B-A3B), under this name.

    Raises:
        ValueError: ``attn_update_ratio`` or ``moe_update_ratio`` not positive.
        UnsupportedModelError: a config of a family mxlib does not quantize (``mxlib.models.families``).
    """
    return dummy_moe_model(
        config,
        seed=seed,
        dtype=dtype,
        expert_spread=expert_spread,
        device=device,
        balanced_routing=balanced_routing,
        attn_update_ratio=attn_update_ratio,
        moe_update_ratio=moe_update_ratio,
        where="dummy_qwen3_moe",
    )
