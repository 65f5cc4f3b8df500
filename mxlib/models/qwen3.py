"""Qwen3-30B-A3B on transformers' Qwen3-MoE, with mxlib experts swapped in.

Shape legend: ``T`` tokens, ``H`` hidden (2048), ``I`` expert intermediate (768),
``E`` experts (128), ``k`` experts per token (8), ``L`` layers (48; the workbook
uses 4, as vLLM's own smoke test does).
"""

from __future__ import annotations

import contextlib

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from ..moe.base import TransformersExperts, TritonExperts

__all__ = [
    "QWEN3_30B_A3B",
    "qwen3_30b_a3b_config",
    "MODEL_PRESETS",
    "model_preset_overrides",
    "empty_qwen3_moe",
    "dummy_qwen3_moe",
    "expert_weights",
    "swap_experts",
    "moe_layers",
]

# Qwen/Qwen3-30B-A3B config.json (the values that matter here).
QWEN3_30B_A3B = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    max_position_embeddings=40960,
    tie_word_embeddings=False,
    hidden_act="silu",
    attention_bias=False,
    initializer_range=0.02,
    bos_token_id=151643,
    eos_token_id=151645,
)


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


# Model sizes by name: overrides of QWEN3_30B_A3B. "qwen3-30b-a3b" is the real shape (the
# notebooks' default); "small" makes a notebook's Run All take seconds; "tiny" is for tests.
# Hidden and expert intermediate sizes stay multiples of 32 (the OCP MX block).
MODEL_PRESETS: dict[str, dict] = {
    "qwen3-30b-a3b": {},
    "small": dict(hidden_size=256, intermediate_size=768, moe_intermediate_size=128, num_experts=16,
                  num_experts_per_tok=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  vocab_size=8192, bos_token_id=1, eos_token_id=2),
    "tiny": dict(hidden_size=64, intermediate_size=192, moe_intermediate_size=32, num_experts=16,
                 num_experts_per_tok=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                 vocab_size=1024, bos_token_id=1, eos_token_id=2),
}


def model_preset_overrides(model_preset: str) -> dict:
    """The ``qwen3_30b_a3b_config`` overrides of a ``MODEL_PRESETS`` name.

    Raises:
        ValueError: ``model_preset`` is not a key of ``MODEL_PRESETS``.
    """
    if model_preset not in MODEL_PRESETS:
        raise ValueError(f"model_preset: expected one of {list(MODEL_PRESETS)}, got {model_preset!r}")
    return dict(MODEL_PRESETS[model_preset])


@contextlib.contextmanager
def _no_init():
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        from transformers.modeling_utils import no_init_weights
    with no_init_weights():
        yield


def empty_qwen3_moe(config: Qwen3MoeConfig, dtype: torch.dtype = torch.bfloat16, device="cpu") -> Qwen3MoeForCausalLM:
    """The transformers model with uninitialized parameters (no init cost, and pages are only
    touched when written, so experts replaced before use cost no memory)."""
    with _no_init(), torch.device(device):
        model = Qwen3MoeForCausalLM._from_config(config, dtype=dtype)
    return model.eval()


def moe_layers(model) -> list:
    """The ``Qwen3MoeSparseMoeBlock`` of every decoder layer."""
    return [layer.mlp for layer in model.model.layers]


@torch.no_grad()
def dummy_qwen3_moe(
    config: Qwen3MoeConfig,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    expert_spread: float = 0.0,
    device="cpu",
) -> Qwen3MoeForCausalLM:
    """A seeded random-weight model: the workbook's "dummy checkpoint" in bf16.

    Linear, embedding and router weights are ``N(0, initializer_range)`` (0.02), norms 1.

    ``expert_spread`` sigma gives experts activations of different ranges, as trained MoE
    experts have: expert ``e``'s w13 is multiplied by ``f_e = exp(sigma * z_e)``,
    ``z_e ~ N(0, 1)``, and its w2 by ``f_e ** -2``. Gate and up both grow by ``f_e``, so the
    SiLU-and-mul output (the w2 input, a2) grows by about ``f_e ** 2`` while the expert's
    output stays on the common scale: a2 ranges spread over ``exp(+-2 sigma)`` per standard
    deviation and no expert dominates the layer. 0 gives i.i.d. experts. Generation is
    deterministic for a given seed and device (CPU and CUDA generators differ).
    """
    model = empty_qwen3_moe(config, dtype, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    std = config.initializer_range
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, std, generator=gen)
    if expert_spread:
        for mlp in moe_layers(model):
            z = torch.randn(config.num_experts, generator=gen, device=device)
            f = torch.exp(expert_spread * z)[:, None, None]
            mlp.experts.gate_up_proj.mul_(f.to(dtype))
            mlp.experts.down_proj.mul_((1.0 / (f * f)).to(dtype))
    return model


def expert_weights(model, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w13 [E, 2I, H], w2 [E, H, I])`` of a layer (transformers keeps gate rows first)."""
    ex = model.model.layers[layer].mlp.experts
    if isinstance(ex, TransformersExperts):
        inner = ex.experts
        return inner.dequantized_weights()
    return ex.gate_up_proj.data, ex.down_proj.data


def swap_experts(model, make_experts) -> None:
    """Replace each layer's experts module by ``TransformersExperts(make_experts(layer_index))``."""
    for i, mlp in enumerate(moe_layers(model)):
        experts = make_experts(i)
        if not isinstance(experts, TritonExperts):
            raise TypeError(f"make_experts({i}) must return a TritonExperts, got {type(experts).__name__}")
        mlp.experts = TransformersExperts(experts)
