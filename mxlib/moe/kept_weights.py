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

    ``dtype``: None (default) keeps the weights in the activation dtype; ``torch.float32`` keeps them widened to
    fp32 (exact: the same values), which the ``torch`` backend's fp32 GEMMs (``reference_moe.torch_moe``) then
    use as they are instead of widening the expert at every forward (twice the memory: a study keeping one
    layer at a time).
    """

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        if dtype not in (None, torch.float32):
            raise ValueError(f"dtype: expected None (the activation dtype) or torch.float32, got {dtype}")
        self.dtype = dtype
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
            if self.dtype is not None:
                w13, w2 = w13.to(self.dtype), w2.to(self.dtype)
            self.experts[e] = (w13[0], w2[0])
        return self.experts[e]

    def clear(self) -> None:
        """Let go of every kept expert (the next request dequantizes again)."""
        self.key, self.inputs, self.experts = None, [], {}
