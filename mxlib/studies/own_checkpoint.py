"""A user's own quantized checkpoint in the workbook: its first layers, its weights, its calibrated scales.

The notebooks' default runs build a seeded dummy model and quantize it themselves. Given a local
checkpoint folder instead (a downloaded nvidia/Qwen3-30B-A3B-NVFP4, a Quark OCP MX MoE export, a
compressed-tensors NVFP4 model: any layout ``mxlib.checkpoints`` reads), the studies here load
its first ``num_layers`` decoder layers with its own weights and its own calibrated input scales
(the loader reads only those layers' tensors), run them on the user's prompts through the
checkpoint's tokenizer (when the folder has one) or on seeded random token ids, and measure:

- **what the activation quantization costs**, layer by layer: each MoE block's output with the
  emulation experts (weights dequantized, activations QDQ'd) against the same block with the same
  dequantized weights and unquantized activations (the weight-only output), and a1's and a2's QDQ
  each alone (``mxlib.studies.attribution``). There is no bf16 original to compare with; the
  weights' own loss is therefore not in these numbers.
- **what unifying the per-expert activation scales costs** (NVFP4's static global scales): the same
  block output under each strategy of ``mxlib.moe.scales.SCALE_STRATEGIES``, and its dB lost against
  ``per_expert``, beside what ``inspect_checkpoint`` predicts from the scales alone
  (``mxlib.checkpoints.inspect_loss``; a Gaussian-expert model, per expert).

Every block sees the same inputs under every strategy: the inputs are captured once, from the run
with ``per_expert`` scales, so a layer's number is its own loss, not the layers' before it.
"""

from __future__ import annotations

import logging
import os
import random
import warnings
from pathlib import Path

import torch

from ..analysis import sqnr_db
from ..checkpoints import load_quantized_qwen3_moe
from ..checkpoints.inspect_loss import strategy_rows
from ..formats import Numerics
from ..models.qwen3 import moe_layers
from ..moe.base import TransformersExperts
from ..moe.emulation import QuantizedExperts
from ..moe.reference_moe import torch_moe
from ..moe.scales import SCALE_STRATEGIES
from .attribution import ACTIVATION_SOURCES, WEIGHT_SOURCES, AttributedExperts

__all__ = ["checkpoint_token_ids", "checkpoint_layers_study", "check_checkpoint_path"]

log = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def check_checkpoint_path(path, param: str = "checkpoint_path") -> Path | None:
    """``None`` for an empty value (the notebook's default: no checkpoint), else the folder as a Path.

    Raises:
        ValueError: ``path`` is not a string or path, or is not a folder holding ``config.json``.
    """
    if path is None or path == "":
        return None
    if not isinstance(path, str | os.PathLike):
        raise ValueError(f"{param}: expected a checkpoint folder (str) or '' for none, got {type(path).__name__}")
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{param}: expected a checkpoint folder holding config.json, got {str(folder)!r}")
    return folder


def checkpoint_token_ids(path, prompts=(), num_tokens: int = 32, seed: int = 0, vocab_size: int | None = None):
    """``(token_ids [1, T] int64, source)`` for the checkpoint at ``path``.

    With ``prompts`` (a list of strings) and tokenizer files in the folder, the prompts are encoded
    by the checkpoint's own tokenizer (``transformers.AutoTokenizer``, local files only, no remote
    code) and concatenated, ``source == "tokenizer"``. Otherwise ``num_tokens`` ids drawn from
    ``random.Random(seed)`` below ``vocab_size`` (the config's when None), ``source == "random"``.

    Raises:
        ValueError: prompts given but the folder has no tokenizer; prompts that are not strings;
            ``num_tokens`` not a positive integer.
    """
    folder = Path(path)
    prompts = list(prompts or [])
    if prompts:
        if not all(isinstance(p, str) and p for p in prompts):
            raise ValueError(f"prompts: expected non-empty strings, got {prompts!r}")
        if not any((folder / f).exists() for f in _TOKENIZER_FILES):
            raise ValueError(
                f"prompts: the checkpoint folder {str(folder)!r} has no tokenizer ({', '.join(_TOKENIZER_FILES)}); "
                f"pass prompts=[] to run on random token ids"
            )
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
        ids = [i for p in prompts for i in tok(p, add_special_tokens=False)["input_ids"]]
        return torch.tensor([ids], dtype=torch.long), "tokenizer"
    if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 1:
        raise ValueError(f"num_tokens: expected a positive integer, got {num_tokens!r}")
    if vocab_size is None:
        import json

        vocab_size = int(json.loads((folder / "config.json").read_text())["vocab_size"])
    rng = random.Random(seed)
    return torch.tensor([[rng.randrange(vocab_size) for _ in range(num_tokens)]], dtype=torch.long), "random"


class _CaptureInputs:
    """Forward hooks on each layer's ``TransformersExperts``: its ``(hidden_states, top_k_index, top_k_weights)``."""

    def __init__(self, model) -> None:
        self.inputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self._hooks = []
        for li, mlp in enumerate(moe_layers(model)):
            if isinstance(mlp.experts, TransformersExperts):
                self._hooks.append(mlp.experts.register_forward_hook(self._hook(li)))

    def _hook(self, li: int):
        def hook(module, args, out):
            self.inputs[li] = tuple(a.detach().clone() for a in args)

        return hook

    def __enter__(self):
        return self.inputs

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()


def _finite_db(x: torch.Tensor, ref: torch.Tensor) -> float | None:
    """SQNR in dB, or None where the two are equal (no error to measure: JSON has no Inf)."""
    db = sqnr_db(x, ref)
    return db if db == db and abs(db) != float("inf") else None


@torch.no_grad()
def checkpoint_layers_study(
    path,
    num_layers: int = 2,
    token_ids: torch.Tensor | None = None,
    strategies=("max", "per_expert", "median", "mean"),
    device: str | torch.device = "cpu",
    backend: str = "torch",
) -> dict:
    """Activation-quantization and scale-unification loss of a checkpoint's first ``num_layers`` layers.

    Args:
        path: a quantized Qwen3-MoE checkpoint folder in a layout the loader reads.
        num_layers: decoder layers kept (only their tensors are read).
        token_ids: ``[1, T]`` int64 (``checkpoint_token_ids``); None: 32 seeded random ids.
        strategies: names of ``SCALE_STRATEGIES``, measured where the scheme's activation scales are
            static per-expert global scales (NVFP4); ``per_expert`` is added when missing.
        device, backend: where the layers run and the experts' backend (``torch``, ``triton``, ...).

    Returns:
        A dict for JSON: ``scheme``, ``format``, ``num_layers``, ``tokens``; ``layers``: per layer
        ``sqnr_db`` of the emulated MoE block output against the weight-only block (dB; None where
        the scheme quantizes no activation), and ``a1_sqnr_db`` / ``a2_sqnr_db`` with only that
        activation's QDQ switched on (``attribution.AttributedExperts``; vLLM numerics);
        ``strategies``: per (layer, strategy) ``sqnr_db`` and ``db_lost`` against ``per_expert``
        (empty unless the experts take a scale strategy);
        ``predicted``: ``inspect_loss.strategy_rows`` over the kept layers' input scales (per point
        and strategy: ``mean_db_lost``, ``worst_db_lost``, counts of subnormal and flushed experts).

    Raises:
        ValueError: an unknown strategy, a bad ``num_layers``; ``CheckpointError`` from the loader.
    """
    bad = [s for s in strategies if s not in SCALE_STRATEGIES]
    if bad:
        raise ValueError(f"strategies: expected names from {list(SCALE_STRATEGIES)}, got {bad}")
    strategies = list(dict.fromkeys(["per_expert", *strategies]))
    model, info = load_quantized_qwen3_moe(path, num_hidden_layers=num_layers, device=device, backend=backend)
    if token_ids is None:
        token_ids, _ = checkpoint_token_ids(path, num_tokens=32, vocab_size=model.config.vocab_size)
    layers = [mlp.experts.experts for mlp in moe_layers(model) if isinstance(mlp.experts, TransformersExperts)]
    tunable = bool(layers) and all(hasattr(ex, "set_scale_strategy") for ex in layers)
    if tunable:
        for ex in layers:
            ex.set_scale_strategy("per_expert")
    with _CaptureInputs(model) as inputs, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the differing-scales warning is what is measured here
        model(input_ids=token_ids.to(device), use_cache=False)
    activation = info.scheme.activation
    layer_rows, strategy_rows_measured, scales = [], [], {}
    for li, mlp in enumerate(moe_layers(model)):
        if li not in inputs:
            continue  # experts the checkpoint leaves unquantized
        ex = mlp.experts.experts
        x, top_k_index, top_k_weights = inputs[li]
        topk_ids, topk_weights = top_k_index.to(torch.int32), top_k_weights.float()
        w13, w2 = (w.to(x.dtype) for w in ex.dequantized_weights())
        ref = torch_moe(x, w13, w2, topk_weights, topk_ids)  # weights only
        row = dict(layer=li, sqnr_db=None if activation is None else _finite_db(ex(x, topk_weights, topk_ids), ref))
        if activation is not None and isinstance(ex, QuantizedExperts) and ex.numerics is Numerics.VLLM:
            for point in ACTIVATION_SOURCES:  # one activation QDQ at a time, on the same dequantized weights
                part = AttributedExperts(w13, w2, ex, (*WEIGHT_SOURCES, point))
                row[f"{point}_sqnr_db"] = _finite_db(part(x, topk_weights, topk_ids), ref)
        del w13, w2
        layer_rows.append(row)
        if not tunable:
            continue
        scales[(li, "a1")] = dict(enumerate(ex.w13_input_scale.float().cpu().tolist()))
        scales[(li, "a2")] = dict(enumerate(ex.w2_input_scale.float().cpu().tolist()))
        by = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for s in strategies:
                ex.set_scale_strategy(s)
                by[s] = sqnr_db(ex(x, topk_weights, topk_ids), ref)
            ex.set_scale_strategy("per_expert")
        for s in strategies:
            strategy_rows_measured.append(dict(layer=li, strategy=s, sqnr_db=by[s], db_lost=by["per_expert"] - by[s]))
        log.info(
            "layer %d: activation QDQ %.2f dB; max loses %.2f dB",
            li,
            row["sqnr_db"] or 0.0,
            by["per_expert"] - by.get("max", by["per_expert"]),
        )
    predicted = strategy_rows(scales, activation, strategies) if scales else []
    return dict(
        path=str(path),
        format=info.format,
        scheme=info.scheme.name,
        activation=None if activation is None else str(activation),
        num_layers=len(moe_layers(model)),
        tokens=int(token_ids.shape[-1]),
        layers=layer_rows,
        strategies=strategy_rows_measured,
        predicted=predicted,
    )
