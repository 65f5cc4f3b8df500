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

from .. import reference as _ref
from ..analysis import sqnr_db_from_sums
from ..formats import NVFP4_SCALE_DIVISOR, NVFP4_SUBNORMAL_RATIO

__all__ = [
    "SCALE_STRATEGIES",
    "PER_TOKEN",
    "ACTIVATION_SCALE_STRATEGIES",
    "max_input_scale",
    "unify_input_scales",
    "unification_precision_loss",
]

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
        strategy: ``max`` (vLLM and FlashInfer: one scale, the max, so nothing clips; warns once
            naming each expert this costs block-scale precision, ``unification_precision_loss``),
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
    if strategy == "max":
        _warn_precision_loss(s, name)
    return (one / unified).expand(s.numel()).contiguous(), True


def _synthetic_expert_db_lost(ratio: float) -> float:
    """SQNR (dB) lost by a synthetic Gaussian expert (``[64, 256]``, seed 0, amax 1) whose NVFP4
    activations are quantized with the global scale of an expert ``1 / ratio`` times larger
    instead of its own (``mxlib.checkpoints.inspect_loss`` tabulates the same model)."""
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    x = x / x.abs().amax()

    def sqnr(gs: float) -> float:
        y = _ref.ref_nvfp4_quant_dequant(x, torch.tensor(gs, dtype=torch.float32)).double()
        err = (y - x.double()).pow(2).sum().item()
        return sqnr_db_from_sums(x.double().pow(2).sum().item(), err)

    return max(0.0, sqnr(NVFP4_SCALE_DIVISOR) - sqnr(NVFP4_SCALE_DIVISOR * ratio))


def unification_precision_loss(input_scales: torch.Tensor) -> list[dict]:
    """The experts that one shared (max) NVFP4 activation scale costs block-scale precision.

    An expert with decode scale ``s_e`` under the shared scale ``max(s)`` has ratio
    ``r = s_e / max(s)``; its largest block scale is then ``e4m3(448 * r)``, which is an e4m3
    subnormal below ``NVFP4_SUBNORMAL_RATIO = 2**-6 / 448`` (``mxlib.formats``): the threshold
    notebook 04 draws, below which it measures more than 1 dB lost. Above it e4m3 keeps its 3
    significant bits and unification costs rounding noise only, so those experts are not listed.

    Args:
        input_scales: ``[E]`` decode scales (``amax / 2688``); 0 marks an expert never calibrated
            (not listed). At least one must be positive.

    Returns:
        One dict per expert below the threshold, in expert order: ``expert`` (index), ``ratio``
        and ``predicted_db_lost`` (dB, a synthetic Gaussian expert's loss at that ratio: a model,
        not a measurement of the checkpoint's activations; real activations lose somewhat more).

    Raises:
        ValueError: what ``max_input_scale`` raises.
    """
    s = input_scales.detach().float().reshape(-1).cpu()
    smax = max_input_scale(s).reshape(())
    ratios = s / smax
    rows = []
    for e in torch.nonzero((s > 0) & (ratios < NVFP4_SUBNORMAL_RATIO)).reshape(-1).tolist():
        r = float(ratios[e])
        rows.append(dict(expert=e, ratio=r, predicted_db_lost=_synthetic_expert_db_lost(r)))
    return rows


def _warn_precision_loss(decode_scales: torch.Tensor, name: str) -> None:
    """Warn (once per message) when the shared max scale costs some expert block-scale precision."""
    lost = unification_precision_loss(decode_scales)
    if not lost:
        return
    shown = ", ".join(
        f"expert {r['expert']} (r = {r['ratio']:.3g}, predicted {r['predicted_db_lost']:.1f} dB lost)" for r in lost[:8]
    )
    more = f" and {len(lost) - 8} more" if len(lost) > 8 else ""
    _warn_once(
        f"{name}:{[r['expert'] for r in lost]}",
        f"{name}: one activation global scale for all experts (the max, as vLLM and FlashInfer use) puts "
        f"{len(lost)} expert(s) below r = 2^-6/448 = {NVFP4_SUBNORMAL_RATIO:.3g}, where even their largest NVFP4 "
        f"block scale is an e4m3 subnormal: {shown}{more}. scale_strategy='per_expert' keeps their precision.",
    )


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
        _warn_precision_loss(torch.where(calibrated, 1.0 / torch.where(calibrated, e, 1.0), 0.0), name)
        return gs.expand(e.numel()).contiguous(), True
    if strategy == "per_expert":
        per = torch.where(calibrated, e, e[calibrated].min())
        return per.contiguous(), bool((per == per[0]).all())
    decode = torch.where(calibrated, 1.0 / torch.where(calibrated, e, 1.0), 0.0)
    return unify_input_scales(decode, strategy, name)
