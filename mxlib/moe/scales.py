"""Activation-scale strategies: per-expert static input scales -> the experts' global scales.

Checkpoints carry one calibrated ``input_scale`` per expert (NVFP4: ``amax / 2688``; static
FP8: ``amax / 448``); vLLM and FlashInfer use one scale for all experts, the max. The
strategies here make that choice explicit (``unify_input_scales``).
"""

from __future__ import annotations

import warnings

import torch

__all__ = ["SCALE_STRATEGIES", "max_input_scale", "unify_input_scales"]

SCALE_STRATEGIES = ("max", "per_expert", "mean", "median", "p90", "p75", "p50")
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


def max_input_scale(input_scales: torch.Tensor, name: str = "input_scale") -> torch.Tensor:
    """The largest calibrated per-expert input scale, as a one-element fp32 tensor.

    Raises:
        ValueError: a negative or non-finite scale, or every scale 0 (no expert calibrated:
            the global scale 1/0 would be Inf); the message names the tensor.
    """
    s = input_scales.detach().float().reshape(-1)
    if not torch.isfinite(s).all() or (s < 0).any():
        raise ValueError(f"{name}: expected finite, non-negative input scales, got {s.tolist()[:8]}")
    if not (s > 0).any():
        raise ValueError(
            f"{name}: every expert's input_scale is 0 (never calibrated); a global scale of 1/0 "
            f"would be Inf. Calibrate the checkpoint or pass explicit scales."
        )
    return s.max().reshape(1)


def unify_input_scales(
    input_scales: torch.Tensor, strategy: str = "max", name: str = "input_scale"
) -> tuple[torch.Tensor, bool]:
    """Encode global scales (``1 / input_scale``) for the experts' activation QDQ.

    Args:
        input_scales: ``[E]`` fp32 decode scales (``amax / (6 * 448)``) from the checkpoint,
            one per expert; 0 marks an expert never calibrated.
        strategy: ``max`` (vLLM and FlashInfer: one scale, the max, so nothing clips),
            ``per_expert`` (each expert its own scale), ``mean`` / ``median`` / ``p90`` /
            ``p75`` / ``p50`` (one scale from that statistic of the calibrated experts'
            scales: finer resolution for most experts, clipping for the largest).
        name: the tensor's name, for messages.

    Returns:
        ``(global_scale [E] fp32, uniform)``: the encode scale of every expert (uncalibrated
        experts get the unified/max one) and whether all are equal.

    Raises:
        ValueError: unknown strategy; no expert calibrated (every scale 0: ``1 / 0`` would be Inf);
            a negative or non-finite scale.
    """
    if strategy not in SCALE_STRATEGIES:
        raise ValueError(f"strategy: expected one of {list(SCALE_STRATEGIES)}, got {strategy!r}")
    s = input_scales.detach().float().reshape(-1)
    smax = max_input_scale(s, name).reshape(())
    calibrated = s > 0
    vals = s[calibrated]
    one = torch.ones((), dtype=torch.float32, device=s.device)
    if strategy == "per_expert":
        per = torch.where(calibrated, s, smax)
        return one / per, bool((per == per[0]).all())
    if strategy == "max" or bool((vals == smax).all()):
        unified = smax  # any statistic of identical scales is that scale, bit for bit
    elif strategy == "mean":
        unified = vals.mean()
    elif strategy == "median":
        unified = vals.median()
    else:
        unified = torch.quantile(vals, int(strategy[1:]) / 100.0)
    if strategy == "max" and bool((vals != smax).any()):
        _warn_once(
            name,
            f"{name}: the activation global scales differ across experts (min {vals.min().item():.4g}, "
            f"max {smax.item():.4g}); using max for all experts, as vLLM and FlashInfer do. Experts with "
            f"smaller activations lose block-scale precision (see the scale-unification notebook).",
        )
    return (one / unified).expand(s.numel()).contiguous(), True
