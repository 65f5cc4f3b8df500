"""Activation-scale strategies: per-expert static input scales -> the experts' global scales.

Checkpoints carry one calibrated ``input_scale`` per expert (NVFP4: ``amax / 2688``; static
FP8: ``amax / 448``); vLLM and FlashInfer use one scale for all experts, the max. The
strategies here make that choice explicit (``unify_input_scales``).

``SCALE_STRATEGIES`` are the static ones (a global scale per expert, fixed before the forward).
``PER_TOKEN`` (``"per_token"``) is the dynamic one the NVFP4 experts accept beside them
(``ACTIVATION_SCALE_STRATEGIES``): each token's own amax sets its global scale in the forward, for
a1 (per token) and a2 (per token and expert), and no calibrated ``input_scale`` is read
(``mxlib.reference.nvfp4_per_token_scales``; vLLM's ``--quantization nvfp4_per_token``).
"""

from __future__ import annotations

import warnings

import torch

__all__ = ["SCALE_STRATEGIES", "PER_TOKEN", "ACTIVATION_SCALE_STRATEGIES", "max_input_scale", "unify_input_scales"]

SCALE_STRATEGIES = ("max", "per_expert", "mean", "median", "p90", "p75", "p50")
PER_TOKEN = "per_token"
ACTIVATION_SCALE_STRATEGIES = (*SCALE_STRATEGIES, PER_TOKEN)
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
        ValueError: unknown strategy, or ``per_token`` (dynamic: no static scale to compute); no
            expert calibrated (every scale 0: ``1 / 0`` would be Inf); a negative or non-finite scale.
    """
    if strategy == PER_TOKEN:
        raise ValueError(
            f"strategy: {PER_TOKEN!r} is dynamic (each token's amax sets its scale in the forward): it has no "
            f"static global scale; static strategies are {list(SCALE_STRATEGIES)}"
        )
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


def _unify_encode_scales(encode_scales: torch.Tensor, strategy: str, name: str) -> tuple[torch.Tensor, bool]:
    """``unify_input_scales`` for encode scales stored as such (compressed-tensors'
    ``input_global_scale``): ``max`` and ``per_expert`` use the stored values bit for bit (the
    largest decode scale is the smallest encode scale); the statistics go through decode scales.
    A non-positive or non-finite encode scale marks an expert never calibrated."""
    e = encode_scales.detach().float().reshape(-1)
    calibrated = torch.isfinite(e) & (e > 0)
    if not bool(calibrated.any()):
        raise ValueError(f"{name}: no expert has a positive finite encode scale (none calibrated)")
    if strategy == "max":
        vals = e[calibrated]
        gs = vals.min()
        if bool((vals != gs).any()):
            _warn_once(
                name,
                f"{name}: the activation global scales differ across experts; using the smallest "
                f"encode scale (the max decode scale) for all experts, as vLLM does",
            )
        return gs.expand(e.numel()).contiguous(), True
    if strategy == "per_expert":
        per = torch.where(calibrated, e, e[calibrated].min())
        return per.contiguous(), bool((per == per[0]).all())
    decode = torch.where(calibrated, 1.0 / torch.where(calibrated, e, 1.0), 0.0)
    return unify_input_scales(decode, strategy, name)
