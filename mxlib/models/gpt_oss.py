"""gpt-oss-20b on transformers' ``GptOssForCausalLM``, with mxlib experts swapped in.

Shape legend: ``H`` hidden (2880), ``I`` expert intermediate (2880), ``E`` experts (32), ``k`` experts per token
(4), ``L`` layers (24; the workbook uses 4).

What differs from Qwen3-MoE (``mxlib.models.qwen3``), and where mxlib follows it:

* experts: transformers' ``GptOssExperts`` holds ``gate_up_proj [E, H, 2I]`` with gate and up **columns
  interleaved** (``gate = x @ W[..., ::2]``), ``down_proj [E, I, H]``, and biases ``gate_up_proj_bias [E, 2I]``
  (interleaved too) and ``down_proj_bias [E, H]``. mxlib's experts take ``w13 [E, 2I, H]`` gate rows then up rows,
  ``w2 [E, H, I]``, ``w13_bias [E, 2I]`` gate then up, ``w2_bias [E, H]``
  (``mxlib.checkpoints.layouts.gpt_oss_mxfp4.deinterleave_gate_up``);
* activation: SwiGLU-OAI with ``alpha = 1.702`` and the config's ``swiglu_limit`` (``swiglu_activation``);
* router: ``mlp.router``, a linear layer with a bias; top-k of the logits, then a softmax over those k;
* attention: sliding-window (128) and full layers alternating, learned sinks, q/k/v/o biases, YaRN RoPE;
* checkpoint: gpt-oss's native MXFP4 layout (``gpt-oss-mxfp4``).

Sources: transformers ``models/gpt_oss/modeling_gpt_oss.py`` and ``configuration_gpt_oss.py``;
openai/gpt-oss-20b's ``config.json`` (``mxlib.models.presets.GPT_OSS_20B``).
"""

from __future__ import annotations

import torch
from transformers import GptOssConfig

from ..checkpoints.layouts import LAYOUTS  # the registry with mxlib's layouts registered
from ..moe.activations import SWIGLUOAI, MoEActivation
from ..moe.schemes import MOE_SCHEMES, MoEQuantScheme, get_moe_scheme
from .moe_models import dummy_moe_model
from .presets import GPT_OSS_20B, GPT_OSS_PRESETS

__all__ = [
    "GPT_OSS_20B",
    "GPT_OSS_PRESETS",
    "gpt_oss_20b_config",
    "gpt_oss_preset_overrides",
    "dummy_gpt_oss",
    "swiglu_activation",
    "scheme_support",
    "gpt_oss_layout_for",
]


def gpt_oss_preset_overrides(model_preset: str) -> dict:
    """The ``gpt_oss_20b_config`` overrides of a ``GPT_OSS_PRESETS`` name (``"gpt-oss-20b"``, ``"gpt-oss-tiny"``).

    Raises:
        ValueError: ``model_preset`` is not a key of ``GPT_OSS_PRESETS``.
    """
    if model_preset not in GPT_OSS_PRESETS:
        raise ValueError(f"model_preset: expected one of {list(GPT_OSS_PRESETS)}, got {model_preset!r}")
    return dict(GPT_OSS_PRESETS[model_preset])


def gpt_oss_20b_config(num_hidden_layers: int = 4, **overrides) -> GptOssConfig:
    """gpt-oss-20b's configuration (``GPT_OSS_20B``), cut to ``num_hidden_layers`` (default 4).

    ``layer_types`` keeps gpt-oss-20b's alternation (sliding, full, sliding, ...) cut to the layer count unless
    given. Any other field can be overridden (tests use tiny sizes).

    Raises:
        ValueError: ``num_hidden_layers`` not a positive integer, or ``layer_types`` of another length.
    """
    if isinstance(num_hidden_layers, bool) or not isinstance(num_hidden_layers, int) or num_hidden_layers < 1:
        raise ValueError(f"num_hidden_layers: expected a positive integer, got {num_hidden_layers!r}")
    values = dict(GPT_OSS_20B, **overrides)
    values["num_hidden_layers"] = num_hidden_layers
    if "layer_types" not in overrides:
        values["layer_types"] = [("sliding_attention", "full_attention")[i % 2] for i in range(num_hidden_layers)]
    if len(values["layer_types"]) != num_hidden_layers:
        raise ValueError(
            f"layer_types: expected {num_hidden_layers} entries (num_hidden_layers), got {len(values['layer_types'])}"
        )
    if "num_experts_per_tok" in overrides and "experts_per_token" not in overrides:
        values["experts_per_token"] = overrides["num_experts_per_tok"]
    cfg = GptOssConfig(**values)
    cfg.architectures = ["GptOssForCausalLM"]
    return cfg


def dummy_gpt_oss(config: GptOssConfig, seed: int = 0, dtype: torch.dtype = torch.bfloat16, device="cpu", **kwargs):
    """A seeded random-weight gpt-oss (``mxlib.models.moe_models.dummy_moe_model``): every weight, the router's
    and attention's biases and the sinks ``N(0, initializer_range)``, the experts' biases ``N(0, expert_bias_std)``
    (default ``initializer_range / 10``: small beside the expert GEMMs' outputs, so that the experts' weights, not
    their biases, carry the MoE block's output), norms 1, and the balanced-routing warm-up the Qwen3 dummy gets
    (``kwargs``: ``expert_spread``, ``balanced_routing``, ...).

    Raises:
        UnsupportedModelError: ``config`` is not a gpt-oss config.
    """
    if getattr(config, "model_type", None) != "gpt_oss":
        from .families import UnsupportedModelError

        raise UnsupportedModelError(f"dummy_gpt_oss: config: expected a GptOssConfig, got {type(config).__name__}")
    kwargs.setdefault("expert_bias_std", config.initializer_range / 10)
    return dummy_moe_model(config, seed=seed, dtype=dtype, device=device, where="dummy_gpt_oss", **kwargs)


def swiglu_activation(config) -> MoEActivation:
    """The experts' activation of a gpt-oss config: ``SWIGLUOAI`` with the config's ``swiglu_alpha`` (1.702) and
    ``swiglu_limit`` (7.0), as transformers' ``GptOssExperts`` reads them."""
    alpha = getattr(config, "swiglu_alpha", SWIGLUOAI.alpha)
    limit = getattr(config, "swiglu_limit", SWIGLUOAI.limit)
    if alpha == SWIGLUOAI.alpha and limit == SWIGLUOAI.limit:
        return SWIGLUOAI
    return MoEActivation("swigluoai", alpha=float(alpha), limit=None if limit is None else float(limit))


def _bias_layouts() -> list:
    return [lay for lay in LAYOUTS.values() if getattr(lay, "stores_expert_biases", False)]


def gpt_oss_layout_for(scheme: str | MoEQuantScheme) -> tuple[str | None, str]:
    """``(layout name, "")`` of the registered layout that stores a gpt-oss checkpoint of ``scheme``, or
    ``(None, reason)``: gpt-oss's experts have biases, which only layouts with ``stores_expert_biases``
    store (``gpt-oss-mxfp4``, its native layout: ``w_mxfp4`` only); the per-expert layouts (ModelOpt, Quark,
    compressed-tensors) have no tensor for them.

    Raises:
        ValueError: an unknown scheme name.
    """
    scheme = get_moe_scheme(scheme)
    fits = [lay for lay in _bias_layouts() if lay.handles(scheme)]
    if fits:
        return fits[0].name, ""
    stored = sorted({s.name for lay in _bias_layouts() for s in MOE_SCHEMES.values() if lay.handles(s)})
    return None, (
        f"no checkpoint layout stores gpt-oss's expert biases in {scheme.name}'s format: the layouts that store "
        f"them ({', '.join(lay.name for lay in _bias_layouts())}) take {stored} only"
    )


def scheme_support(schemes=None) -> list[dict]:
    """One row per MoE scheme (``schemes``: names or ``MoEQuantScheme``; None: every scheme of ``MOE_SCHEMES``):
    ``{"scheme", "layout", "runs", "skipped_because"}``, whether a gpt-oss checkpoint of it can be written and
    read (``gpt_oss_layout_for``) and, when not, why."""
    rows = []
    for s in MOE_SCHEMES.values() if schemes is None else [get_moe_scheme(x) for x in schemes]:
        layout, reason = gpt_oss_layout_for(s)
        rows.append(dict(scheme=s.name, layout=layout or "-", runs=layout is not None, skipped_because=reason))
    return rows
