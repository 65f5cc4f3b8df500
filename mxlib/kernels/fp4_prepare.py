"""The weight layouts of the fused FP4 kernel from ``PackedWeights`` (re-exported by ``fused_fp4_moe``)."""

from __future__ import annotations

from . import fp6_layout as F6
from .fp4_layout import FP4Weights, prepare_fp4_weights
from .fused_dequant_moe import PackedWeights

__all__ = ["prepare_packed_weights"]


def prepare_packed_weights(w: PackedWeights) -> FP4Weights | F6.FP6Weights:
    """``fp4_layout.prepare_fp4_weights`` of a ``PackedWeights`` (FP4 elements: ``mxfp4`` or ``nvfp4``),
    or ``fp6_layout.prepare_fp6_weights`` (MXFP6: ``mxfp6_e2m3``, ``mxfp6_e3m2``): the two layouts
    this kernel takes.

    Raises:
        ValueError: a scheme whose elements are neither 4 nor 6 bits wide (FP8 weights stay on
            ``fused_dequant_moe``); the prepare functions' errors (K not a multiple of the tile).
    """
    if w.nbits == 6 and not w.scheme.has_global_scale:
        return F6.prepare_fp6_weights(w.packed, w.scales, w.scheme.element, w.scheme.block_size)
    if w.nbits != 4:
        raise ValueError(f"w: the FP4 kernel takes 4- or 6-bit elements, got {w.scheme.name} ({w.nbits} bits)")
    return prepare_fp4_weights(w.packed, w.scales, w.scheme.block_size, w.global_scale)
