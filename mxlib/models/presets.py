"""Qwen3-30B-A3B's configuration values and the model presets, as plain Python (no torch import), so that
the command line and the workbook runner check a preset name or a size at once, before anything heavy
is imported. ``mxlib.models.qwen3`` builds the models from them.
"""

from __future__ import annotations

__all__ = ["QWEN3_30B_A3B", "MODEL_PRESETS", "preset_layers", "preset_context"]

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


def preset_layers(model_preset: str) -> int:
    """The decoder layers of a preset's model (every preset keeps Qwen3-30B-A3B's 48)."""
    return MODEL_PRESETS[model_preset].get("num_hidden_layers", QWEN3_30B_A3B["num_hidden_layers"])


def preset_context(model_preset: str) -> int:
    """The longest sequence a preset's model takes (``max_position_embeddings``: 40960)."""
    return MODEL_PRESETS[model_preset].get("max_position_embeddings", QWEN3_30B_A3B["max_position_embeddings"])
