"""Qwen3-30B-A3B's and gpt-oss-20b's configuration values and the model presets, as plain Python (no torch
import), so that the command line and the workbook runner check a preset name or a size at once, before
anything heavy is imported. ``mxlib.models.qwen3`` and ``mxlib.models.gpt_oss`` build the models from them.
"""

from __future__ import annotations

__all__ = [
    "QWEN3_30B_A3B",
    "MODEL_PRESETS",
    "GPT_OSS_20B",
    "GPT_OSS_PRESETS",
    "preset_layers",
    "preset_context",
    "preset_experts",
    "preset_model_type",
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


# Model sizes by name: overrides of QWEN3_30B_A3B. "qwen3-30b-a3b" is the real shape (the
# notebooks' default); "small" makes a notebook's Run All take seconds; "tiny" is for tests.
# Hidden and expert intermediate sizes stay multiples of 32 (the OCP MX block).
MODEL_PRESETS: dict[str, dict] = {
    "qwen3-30b-a3b": {},
    "small": dict(
        hidden_size=256,
        intermediate_size=768,
        moe_intermediate_size=128,
        num_experts=16,
        num_experts_per_tok=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=8192,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=192,
        moe_intermediate_size=32,
        num_experts=16,
        num_experts_per_tok=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=1024,
        bos_token_id=1,
        eos_token_id=2,
    ),
}


# openai/gpt-oss-20b config.json (transformers' GptOssConfig names; the file also carries the original
# checkpoint's names ``experts_per_token`` and ``initial_context_length``). Layers alternate
# sliding-window (128 tokens) and full attention, sliding first; every attention layer has learned sinks
# (``self_attn.sinks``, one logit a head) and q/k/v/o biases; RoPE is YaRN (factor 32 over 4096 positions).
# The experts' activation is SwiGLU-OAI (alpha 1.702, clamp ``swiglu_limit``); the router is a biased
# linear layer, softmax over its top-k logits.
GPT_OSS_20B = dict(
    vocab_size=201088,
    hidden_size=2880,
    intermediate_size=2880,
    num_hidden_layers=24,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    num_local_experts=32,
    num_experts_per_tok=4,
    experts_per_token=4,
    swiglu_limit=7.0,
    sliding_window=128,
    layer_types=["sliding_attention", "full_attention"] * 12,
    attention_bias=True,
    attention_dropout=0.0,
    rms_norm_eps=1e-5,
    rope_theta=150000.0,
    rope_scaling=dict(
        rope_type="yarn",
        factor=32.0,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
        original_max_position_embeddings=4096,
    ),
    initial_context_length=4096,
    max_position_embeddings=131072,
    router_aux_loss_coef=0.9,
    output_router_logits=False,
    tie_word_embeddings=False,
    hidden_act="silu",
    initializer_range=0.02,
    pad_token_id=199999,
    eos_token_id=200002,
    use_cache=True,
)

# gpt-oss sizes by name: overrides of GPT_OSS_20B. "gpt-oss-20b" is the real shape; "gpt-oss-tiny" is for
# tests. Hidden and expert intermediate sizes stay multiples of 32 (the OCP MX block).
GPT_OSS_PRESETS: dict[str, dict] = {
    "gpt-oss-20b": {},
    "gpt-oss-tiny": dict(
        hidden_size=64,
        intermediate_size=64,
        num_local_experts=8,
        num_experts_per_tok=2,
        experts_per_token=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=1024,
        sliding_window=16,
        pad_token_id=0,
        eos_token_id=2,
    ),
}


def _preset(model_preset: str) -> tuple[dict, dict]:
    if model_preset in MODEL_PRESETS:
        return QWEN3_30B_A3B, MODEL_PRESETS[model_preset]
    if model_preset in GPT_OSS_PRESETS:
        return GPT_OSS_20B, GPT_OSS_PRESETS[model_preset]
    raise ValueError(f"model_preset: expected one of {[*MODEL_PRESETS, *GPT_OSS_PRESETS]}, got {model_preset!r}")


def preset_layers(model_preset: str) -> int:
    """The decoder layers of a preset's model (every preset keeps its full model's: 48, gpt-oss-20b's 24)."""
    base, over = _preset(model_preset)
    return over.get("num_hidden_layers", base["num_hidden_layers"])


def preset_context(model_preset: str) -> int:
    """The longest sequence a preset's model takes (``max_position_embeddings``: 40960, gpt-oss's 131072)."""
    base, over = _preset(model_preset)
    return over.get("max_position_embeddings", base["max_position_embeddings"])


def preset_experts(model_preset: str) -> int:
    """The routed experts per layer of a preset's model (128 for Qwen3-30B-A3B, 16 for ``small``, 32 for
    gpt-oss-20b)."""
    base, over = _preset(model_preset)
    merged = {**base, **over}
    return merged.get("num_experts", merged.get("num_local_experts"))


def preset_model_type(model_preset: str) -> str:
    """The transformers ``model_type`` of a preset's model: ``"qwen3_moe"`` (``MODEL_PRESETS``) or
    ``"gpt_oss"`` (``GPT_OSS_PRESETS``).

    Raises:
        ValueError: a name of neither table.
    """
    return "gpt_oss" if _preset(model_preset)[0] is GPT_OSS_20B else "qwen3_moe"
