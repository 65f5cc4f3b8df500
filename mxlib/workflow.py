"""The workbook's steps as plain functions, so that notebooks stay thin.

1. ``dummy_model``: the seeded bf16 Qwen3-30B-A3B (``num_hidden_layers`` of them).
2. ``prepare_checkpoint``: calibrate it, quantize the experts, write the checkpoint in the
   real layout (ModelOpt or Quark), cached under ``build/checkpoints`` by its parameters.
3. ``load_quantized_qwen3_moe`` (re-exported): load it back with emulation experts.
4. ``run_model`` / ``compare_runs``: the same token ids through both models, per-layer
   and logits metrics.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .analysis import compare_logits, compare_tensors
from .models.calibration import Calibration, calibrate
from .models.checkpoints import checkpoint_size_bytes, load_quantized_qwen3_moe, write_quantized_checkpoint
from .models.qwen3 import QWEN3_30B_A3B, dummy_qwen3_moe, model_preset_overrides, qwen3_30b_a3b_config
from .moe.schemes import MoEQuantScheme, get_moe_scheme

__all__ = [
    "resolve_device",
    "random_token_ids",
    "dummy_model",
    "prepare_checkpoint",
    "load_quantized_qwen3_moe",
    "RunOutput",
    "run_model",
    "compare_runs",
    "checkpoint_size_bytes",
    "checkpoint_summary",
    "calibrate_model",
    "default_cache_dir",
    "save_results",
    "CACHE_VERSION",
]

# Bump when the dummy weights, calibration or writer change what a cached checkpoint holds.
CACHE_VERSION = 3


def resolve_device(device: str = "auto") -> torch.device:
    """``auto`` -> ``cuda`` when a GPU is present, else ``cpu``."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def random_token_ids(num_tokens: int, seed: int, vocab_size: int = 151936, batch: int = 1) -> torch.Tensor:
    """Seeded token ids ``[batch, num_tokens]`` (the dummy model has no tokenizer to speak of)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, num_tokens), generator=g)


def dummy_model(num_hidden_layers: int = 4, seed: int = 0, expert_spread: float = 0.0, device="cpu",
                model_preset: str = "qwen3-30b-a3b", **overrides):
    """The seeded bf16 dummy Qwen3-30B-A3B (``mxlib.models.qwen3.dummy_qwen3_moe``), at the size of
    ``model_preset`` (a key of ``mxlib.models.qwen3.MODEL_PRESETS``; ``overrides`` win over it)."""
    cfg = qwen3_30b_a3b_config(num_hidden_layers=num_hidden_layers, **{**model_preset_overrides(model_preset), **overrides})
    return dummy_qwen3_moe(cfg, seed=seed, expert_spread=expert_spread, device=resolve_device(str(device)))


def default_cache_dir() -> Path:
    """``$MXLIB_CACHE``, else ``build/checkpoints`` of the source checkout mxlib runs from,
    else ``~/.cache/mxlib/checkpoints`` (so notebooks find the cache whatever their cwd)."""
    if os.environ.get("MXLIB_CACHE"):
        return Path(os.environ["MXLIB_CACHE"])
    root = Path(__file__).resolve().parents[1]
    if (root / "pyproject.toml").exists():
        return root / "build" / "checkpoints"
    return Path.home() / ".cache" / "mxlib" / "checkpoints"


def _cache_dir(cache_dir) -> Path:
    return Path(cache_dir) if cache_dir else default_cache_dir()


def prepare_checkpoint(
    scheme: str | MoEQuantScheme,
    model,
    seed: int = 0,
    expert_spread: float = 0.0,
    calib_tokens: int = 512,
    cache_dir: str | os.PathLike | None = None,
    calibration: Calibration | None = None,
) -> Path:
    """Calibrate ``model`` on seeded token ids, quantize its experts and write the checkpoint.

    The folder is ``<cache_dir>/<scheme>-L<layers>-seed<seed>-spread<spread>-calib<n>-v<CACHE_VERSION>``
    (``cache_dir`` defaults to ``default_cache_dir()``); an existing complete
    folder is reused. ``seed`` and ``expert_spread`` must be the ones ``model`` was built with.
    A ``calibration`` may be passed to reuse one across schemes.
    """
    s = get_moe_scheme(scheme)
    layers = len(model.model.layers)
    c = model.config
    dims = ("hidden_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok", "vocab_size")
    shape = "" if all(getattr(c, d) == QWEN3_30B_A3B[d] for d in dims) else \
        "-" + "-".join(str(getattr(c, d)) for d in dims)  # a smaller preset: the folder names its shape
    name = f"{s.name}-L{layers}{shape}-seed{seed}-spread{expert_spread:g}-calib{calib_tokens}-v{CACHE_VERSION}"
    path = _cache_dir(cache_dir) / name
    if (path / "config.json").exists() and (path / "model.safetensors.index.json").exists():
        return path
    if calibration is None and (s.static_activation_scale):
        calibration = calibrate_model(model, calib_tokens, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_quantized_checkpoint(model, s, path, calibration)


def calibrate_model(model, calib_tokens: int = 512, seed: int = 0, keep_activations: bool = False) -> Calibration:
    """Calibration over ``calib_tokens`` seeded token ids in sequences of 256 (seed ``seed + 1000``)."""
    seq = min(256, calib_tokens)
    ids = random_token_ids(seq, seed + 1000, model.config.vocab_size, batch=max(1, calib_tokens // seq))
    return calibrate(model, ids, keep_activations=keep_activations)


@dataclass
class RunOutput:
    """Decoder-layer outputs ``[T, H]`` (fp32, CPU), logits ``[T, vocab]`` and the forward time."""

    layer_outputs: list[torch.Tensor] = field(default_factory=list)
    logits: torch.Tensor | None = None
    seconds: float = 0.0


@torch.no_grad()
def run_model(model, token_ids: torch.Tensor) -> RunOutput:
    """One forward pass on ``token_ids [1, T]``, recording every decoder layer's output."""
    out = RunOutput()
    hooks = [
        layer.register_forward_hook(
            lambda mod, inp, o: out.layer_outputs.append((o[0] if isinstance(o, tuple) else o)[0].float().cpu())
        )
        for layer in model.model.layers
    ]
    dev = next(model.parameters()).device
    try:
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = model(input_ids=token_ids.to(dev), use_cache=False).logits
        if dev.type == "cuda":
            torch.cuda.synchronize()
        out.seconds = time.perf_counter() - t0
    finally:
        for h in hooks:
            h.remove()
    out.logits = logits[0].float().cpu()
    return out


def compare_runs(test: RunOutput, ref: RunOutput) -> dict:
    """Per-layer ``rel_error``/``sqnr_db`` and logits metrics of ``test`` against ``ref``."""
    layers = [dict(layer=i, **compare_tensors(a, b)) for i, (a, b) in enumerate(zip(test.layer_outputs, ref.layer_outputs))]
    return {"layers": layers, "logits": compare_logits(test.logits, ref.logits)}


def checkpoint_summary(path: str | os.PathLike, layer: int = 0, expert: int = 0) -> list[dict]:
    """Name, dtype and shape of one expert's tensors as stored (read from the safetensors headers)."""
    from safetensors import safe_open

    path = Path(path)
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    prefix = f"model.layers.{layer}.mlp.experts.{expert}."
    rows = []
    for name in sorted(n for n in index if n.startswith(prefix)):
        with safe_open(str(path / index[name]), "pt") as f:
            sl = f.get_slice(name)
            rows.append({"tensor": name, "dtype": sl.get_dtype(), "shape": str(list(sl.get_shape()))})
    return rows


def save_results(results: dict, path: str | os.PathLike) -> None:
    """Write a small JSON record of a notebook's results (read back by tests and README)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(results, indent=2, default=float))
