"""What every producer's fixture shares: the tiny seeded Qwen3-MoE, the fixed inputs, the result files.

Imports only torch, transformers and safetensors, so that it runs in each tool's own
virtual environment (mxlib is not installed there).
"""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import torch
from safetensors.torch import save_file

SEED = 0
CALIB_SEED = 1
EVAL_SEED = 2
QDQ_SEED = 3

# A tiny Qwen3-MoE: every dimension a multiple of 32 (MX blocks) and of 4 (FP6 packing).
TINY_CONFIG = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    hidden_act="silu",
    attention_bias=False,
    initializer_range=0.02,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
)
ROPE_THETA = 1_000_000.0

CALIB_SHAPE = (8, 32)  # calibration token batch
EVAL_SHAPE = (2, 16)  # logits token batch
QDQ_SHAPE = (4, 256)  # activation QDQ input

# which expert tensors the fixture keeps the tool's dequantization of (to stay small)
DEQUANT_EXPERTS = ((0, 0), (0, 5), (1, 3))  # (layer, expert)
PROJS = ("gate_proj", "up_proj", "down_proj")


def tiny_config():
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(**TINY_CONFIG)
    rp = dict(getattr(cfg, "rope_parameters", None) or {})
    if rp or hasattr(cfg, "rope_parameters"):
        rp.update(rope_type=rp.get("rope_type", "default"), rope_theta=ROPE_THETA)
        cfg.rope_parameters = rp
    cfg.rope_theta = ROPE_THETA
    return cfg


@torch.no_grad()
def build_model(seed: int = SEED, num_hidden_layers: int | None = None):
    """The seeded bf16 model: every weight ``N(0, 0.02)`` drawn in ``named_parameters`` order
    from one CPU generator, norms 1; then each expert's gate/up rows scaled by ``f_e`` and its
    down rows by ``f_e**-2`` (``f_e = exp(0.5 z_e)``) so experts see different activation ranges
    (different calibrated scales). Works for fused (transformers 5) and per-expert (4.x) experts.
    ``num_hidden_layers`` overrides the 2 layers (the unquantized-experts export uses 1 to stay
    under 2 MB a file)."""
    from transformers import Qwen3MoeForCausalLM

    cfg = tiny_config()
    if num_hidden_layers is not None:
        cfg.num_hidden_layers = num_hidden_layers
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()
    model.config.architectures = ["Qwen3MoeForCausalLM"]
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * cfg.initializer_range)
    e = cfg.num_experts
    for layer in model.model.layers:
        f = torch.exp(0.5 * torch.randn(e, generator=gen))
        ex = layer.mlp.experts
        if hasattr(ex, "gate_up_proj"):
            ex.gate_up_proj.mul_(f[:, None, None].to(torch.bfloat16))
            ex.down_proj.mul_((1.0 / (f * f))[:, None, None].to(torch.bfloat16))
        else:
            for x in range(e):
                ex[x].gate_proj.weight.mul_(f[x].to(torch.bfloat16))
                ex[x].up_proj.weight.mul_(f[x].to(torch.bfloat16))
                ex[x].down_proj.weight.mul_((1.0 / (f[x] * f[x])).to(torch.bfloat16))
    # rotary buffers stay fp32 (built with the default dtype, then .to(bf16) is avoided for them)
    for mod in model.modules():
        if hasattr(mod, "inv_freq"):
            inv = 1.0 / (ROPE_THETA ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
            mod.inv_freq = inv
            if hasattr(mod, "original_inv_freq"):
                mod.original_inv_freq = inv
    return model


def expert_weights(model, layer: int, expert: int) -> dict:
    """The bf16 ``gate_proj`` / ``up_proj`` / ``down_proj`` weights (``[out, in]``) of one expert, read
    from transformers 5's fused experts (``gate_up_proj [E, 2I, H]``, gate rows first; ``down_proj
    [E, H, I]``) or from per-expert Linear modules."""
    ex = model.model.layers[layer].mlp.experts
    if hasattr(ex, "gate_up_proj"):
        i = TINY_CONFIG["moe_intermediate_size"]
        gu, down = ex.gate_up_proj[expert], ex.down_proj[expert]
        assert gu.shape == (2 * i, TINY_CONFIG["hidden_size"]), gu.shape
        w = {"gate_proj": gu[:i], "up_proj": gu[i:], "down_proj": down}
    else:
        w = {p: getattr(ex[expert], p).weight for p in PROJS}
    return {p: t.detach().clone().contiguous() for p, t in w.items()}


def tokens(shape, seed):
    return torch.randint(3, TINY_CONFIG["vocab_size"], shape, generator=torch.Generator().manual_seed(seed))


def calib_tokens():
    return tokens(CALIB_SHAPE, CALIB_SEED)


def eval_tokens():
    return tokens(EVAL_SHAPE, EVAL_SEED)


def qdq_input(dtype=torch.bfloat16) -> torch.Tensor:
    """``[4, 256]`` activations: unit normals with outliers, a tiny block, a zero block."""
    x = torch.randn(QDQ_SHAPE, generator=torch.Generator().manual_seed(QDQ_SEED))
    x[0, 5] = 40.0
    x[1, 100] = -300.0
    x[1, 101] = 17.0
    x[2, 32:64] *= 1e-3
    x[3, 0:32] = 0.0
    x[3, 64] = 1e4
    return x.to(dtype)


@torch.no_grad()
def logits(model, ids) -> torch.Tensor:
    return model(input_ids=ids).logits.float()


def versions(tool_packages) -> dict:
    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "safetensors", *tool_packages):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def write_results(outdir: Path, tensors: dict, meta: dict) -> None:
    """``tool_results.safetensors`` and ``meta.json`` beside the checkpoint."""
    outdir.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    save_file(tensors, str(outdir / "tool_results.safetensors"), metadata={"format": "pt"})
    meta = dict(meta)
    meta.setdefault("seeds", dict(model=SEED, calib=CALIB_SEED, eval=EVAL_SEED, qdq=QDQ_SEED))
    meta.setdefault("tiny_config", dict(TINY_CONFIG, rope_theta=ROPE_THETA))
    argv = list(sys.argv[1:])
    if len(argv) >= 2:
        argv[1] = "OUTDIR"  # where it was written is not part of the recipe
    meta.setdefault("command", " ".join([Path(sys.executable).as_posix(), "tools/interop/make_fixtures.py", *argv]))
    meta["result_tensors"] = {
        k: [str(v.dtype).replace("torch.", ""), list(v.shape)] for k, v in sorted(tensors.items())
    }
    (outdir / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")


def clean_checkpoint(
    ckpt: Path,
    keep=(
        "config.json",
        "hf_quant_config.json",
        "model.safetensors",
        "model.safetensors.index.json",
    ),
) -> list[str]:
    """Drop tokenizer/recipe extras a tool writes; return what was removed."""
    removed = []
    for p in sorted(ckpt.iterdir()):
        if p.name not in keep and not p.name.startswith("model-"):
            removed.append(p.name)
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    return removed


def fresh_dir(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def git_rev() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):  # not a git checkout, or no git
        return None
