"""Dequantized expert weights kept across forwards: ``KeptDequantized``, the store behind
``QuantizedExperts.keep_dequantized`` (``mxlib.moe.emulation``).

The emulation experts dequantize their weights at every forward, as vLLM's emulation backends do. A study that runs
the same quantized weights through many forwards on the CPU (the workbook) may keep them instead; what is kept is
handed out only while it is what dequantizing now would give, bit for bit.
"""

from __future__ import annotations

import torch

from .. import reference as _ref

__all__ = ["KeptDequantized"]


class KeptDequantized:
    """Dequantized expert weights kept across forwards (``QuantizedExperts.keep_dequantized``).

    An entry is valid while the experts asking for it are of the same class, numerics and activation
    dtype as the ones it was made for, and hold the same weight tensors (``QuantizedExperts.weight_tensors``:
    the packed bytes, prepared or not, the block scales, the global scales, the same tensor objects at the same
    ``_version``: an in-place write bumps it); any other request empties it first. So experts built from
    the same ``ExpertWeights`` (schemes that differ in their activations only) can share one.
    """

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.inputs: list[tuple[torch.Tensor, int]] = []
        self.experts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, owner, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ``e``'s ``(w13, w2)`` of ``owner``: kept, or dequantized now and kept."""
        inputs = [(t, t._version) for t in owner.weight_tensors()]
        key = (type(owner), owner.numerics, owner.activation_dtype, len(inputs))
        if (
            key != self.key
            or len(inputs) != len(self.inputs)
            or any(a is not b or va != vb for (a, va), (b, vb) in zip(self.inputs, inputs))
        ):
            self.key, self.inputs, self.experts = key, inputs, {}
        if e not in self.experts:
            w13, w2 = owner._dequantize(_ref, slice(e, e + 1))
            self.experts[e] = (w13[0], w2[0])
        return self.experts[e]
