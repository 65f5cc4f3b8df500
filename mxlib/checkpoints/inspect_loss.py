"""The predicted cost of unifying per-expert activation scales, for ``inspect_checkpoint``.

Unification losses are **predicted** from each expert's ratio ``r = own_scale / unified_scale``
under each strategy of ``mxlib.moe.scales.SCALE_STRATEGIES`` (uncalibrated experts, scale 0,
left out), with notebook 04's e4m3 thresholds: the expert's largest NVFP4 block scale is
``e4m3(448 * r)``, so below ``NVFP4_SUBNORMAL_RATIO = 2**-6 / 448`` even that one is subnormal, and
below ``NVFP4_FLUSH_RATIO = 2**-10 / 448`` it rounds to zero (the whole expert is flushed; smaller
blocks flush earlier). ``r > 1`` (a strategy below the expert's own scale) clips its largest
values. For static FP8 activations the same two ratios bound the expert's largest *element*.
The dB figures come from a small model, not from the checkpoint's activations:
``predicted_db_lost(r, activation)`` is the SQNR lost by one synthetic Gaussian expert
(``[64, 256]``, amax 1, seed 0, as ``mxlib.explore.expert_scale_ratio`` builds them) quantized with
scale ``own / r`` instead of its own scale. Real activations have heavier tails (more of their
blocks far below the amax), so they cross the thresholds earlier; read the dB as indicative and
the threshold counts as exact statements about each expert's largest block.

``strategy_rows`` applies this to a checkpoint's per-expert decode scales, one row per (point,
strategy).
"""

from __future__ import annotations

import functools
import math
import warnings

import torch

from .. import reference as R
from ..analysis import sqnr_db_from_sums
from ..formats import NVFP4_FLUSH_RATIO, NVFP4_SUBNORMAL_RATIO, BlockScheme, PerTensorScheme
from ..moe.scales import unify_input_scales

__all__ = ["predicted_db_lost", "strategy_rows", "NVFP4_SUBNORMAL_RATIO", "NVFP4_FLUSH_RATIO"]


# own * fp32(1 / unified) is 1 only to fp32 rounding for the expert that sets the unified scale
_RATIO_TOL = 2.0**-20
_ROW_GRID_LOG2 = [x / 4 for x in range(-160, 33)]  # log2 r from -40 to 8 in quarter steps


def _sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    err = (x - y).pow(2).sum().item()
    sig = x.pow(2).sum().item()
    return sqnr_db_from_sums(sig, err)


def _synthetic_expert() -> torch.Tensor:
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    return x / x.abs().amax()  # amax exactly 1


@functools.cache
def _loss_curve(activation: BlockScheme | PerTensorScheme) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``(log2 r grid, dB lost)`` of the synthetic expert for one activation format."""
    x = _synthetic_expert()
    div = activation.scale_divisor  # amax -> decode scale divisor: 2688 (NVFP4) or 448 (FP8)

    def qdq(ratio: float) -> torch.Tensor:
        if isinstance(activation, PerTensorScheme):
            return R.quant_dequant_fp8_per_tensor(x, torch.tensor(1.0 / (div * ratio)))
        return R.ref_nvfp4_quant_dequant(x, torch.tensor(div * ratio, dtype=torch.float32))

    own = _sqnr_db(x, qdq(1.0))
    losses = tuple(max(0.0, own - _sqnr_db(x, qdq(2.0**g))) for g in _ROW_GRID_LOG2)
    return tuple(_ROW_GRID_LOG2), losses


def predicted_db_lost(ratio: float, activation: BlockScheme | PerTensorScheme) -> float:
    """SQNR (dB) a synthetic Gaussian expert loses when quantized with scale ``own / ratio``.

    Args:
        ratio: ``own_scale / unified_scale`` (> 0; 1 means its own scale; below 1 its block
            scales shrink toward e4m3's subnormals, above 1 its largest values clip).
        activation: ``NVFP4`` (``mxlib.formats``) or ``FP8_E4M3_PER_TENSOR``: a format with a
            static scale.

    Returns:
        dB lost against the expert's own scale, >= 0, interpolated linearly in ``log2 ratio``
        on a quarter-octave grid from ``2**-40`` to ``2**8`` (clamped at the ends). A model
        (module docstring), not a measurement of the checkpoint's activations.

    Raises:
        ValueError: ``ratio`` not positive and finite; ``activation`` without a static scale.
    """
    if not (isinstance(ratio, (int, float)) and math.isfinite(ratio) and ratio > 0):
        raise ValueError(f"ratio: expected a positive finite number (own / unified scale), got {ratio!r}")
    if activation is None or not activation.static_scale:
        raise ValueError(f"activation: expected a format with a static input scale (nvfp4, fp8_e4m3), got {activation}")
    grid, loss = _loss_curve(activation)
    g = min(max(math.log2(ratio), grid[0]), grid[-1])
    k = min(int((g - grid[0]) * 4), len(grid) - 2)
    t = (g - grid[k]) / (grid[k + 1] - grid[k])
    return loss[k] + t * (loss[k + 1] - loss[k])


def strategy_rows(act: dict[tuple[int, str], dict[int, float]], activation, strategies) -> list[dict]:
    """Per (point, strategy): experts, clipped / subnormal / flushed counts, mean and worst
    predicted dB lost, worst (layer, expert); ``act`` is ``{(layer, point): {expert: decode
    scale}}`` (``inspect_tables.expert_scales``), ``activation`` the static activation format or
    None (no dB), ``strategies`` names of ``SCALE_STRATEGIES``. Uncalibrated experts (scale 0)
    are left out."""
    rows = []
    for point in ("a1", "a2"):
        keys = sorted(k for k in act if k[1] == point)
        if not keys:
            continue
        for strategy in strategies:
            n = clipped = subnormal = flushed = 0
            total = worst = 0.0
            worst_at = None
            for layer, _ in keys:
                d = act[(layer, point)]
                experts = sorted(d)
                s = torch.tensor([d[e] for e in experts], dtype=torch.float32)
                if not bool((s > 0).any()):
                    continue
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    gs = unify_input_scales(s, strategy, f"layer {layer} {point} input_scale")[0]
                for e, own, g in zip(experts, s.tolist(), gs.double().tolist()):
                    if own <= 0:
                        continue
                    r = own * g  # own / unified
                    if abs(r - 1.0) <= _RATIO_TOL:
                        r = 1.0  # its own scale, to fp32 rounding of the reciprocal
                    n += 1
                    clipped += r > 1.0
                    subnormal += r < NVFP4_SUBNORMAL_RATIO
                    flushed += r < NVFP4_FLUSH_RATIO
                    lost = predicted_db_lost(r, activation) if activation is not None else 0.0
                    total += lost
                    if lost > worst:
                        worst, worst_at = lost, (layer, e)
            rows.append(
                dict(
                    point=point,
                    strategy=strategy,
                    experts=n,
                    clipped=int(clipped),
                    subnormal=int(subnormal),
                    flushed=int(flushed),
                    mean_db_lost=total / n if n else 0.0,
                    worst_db_lost=worst,
                    worst=worst_at,
                )
            )
    return rows
