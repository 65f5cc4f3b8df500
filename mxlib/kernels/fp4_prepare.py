"""The weight layouts of the fused FP4 kernel from ``PackedWeights`` (re-exported by ``fused_fp4_moe``), and
``PreparedExpertWeights``: one layer's experts held in that layout.

``prepare_packed_weights`` turns one ``PackedWeights`` stack into the kernel's ``FP4Weights`` (4-bit elements) or
``FP6Weights`` (MXFP6). ``PreparedExpertWeights`` is what the emulation experts (``mxlib.moe.emulation``) hold
instead of the checkpoint-layout bytes once the ``fused`` backend runs this kernel: w13's and w2's prepared bytes
(zero-padded to the K tile where H or I is not a multiple of it, ``fp4_layout.pad_fp4_halves``, with the padded
scale bytes beside them), the kernel operands built from them (``kernel_weights``) and the checkpoint layout back
(``checkpoint_packed``, a temporary copy).
"""

from __future__ import annotations

import torch

from . import fp4_layout as F4
from . import fp6_layout as F6
from .fp4_layout import FP4Weights, fp4_one_multiply, prepare_fp4_weights
from .fused_dequant_moe import PackedWeights

__all__ = ["prepare_packed_weights", "PreparedExpertWeights"]


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


class PreparedExpertWeights(torch.nn.Module):
    """One layer's experts' ``w13 [E, 2I, H]`` and ``w2 [E, H, I]`` in the FP4 kernel's layout, prepared once.

    Args:
        w13, w2: the checkpoint-layout ``PackedWeights`` (uint8 packed bytes and scale bytes; FP4 elements, or
            MXFP6 with H and I multiples of ``fp6_layout.SUPER_TILE``).
        hidden_size, intermediate_size: H and I. FP4 weights whose H or I is no multiple of ``fp4_layout.K_TILE``
            are zero-padded to it (``pad_fp4_halves``: exact); ``padded_dims`` gives the padded (H, I).

    Buffers (uint8, moved with a module move; a dtype cast leaves them as they are): ``w13``, ``w2`` (the prepared
    bytes) and, when padded, ``w13_scale``, ``w2_scale`` (the padded scale bytes; None otherwise: the kernel reads
    the checkpoint scales its caller passes). Only these copies of the packed bytes are kept.

    Raises:
        ValueError: ``prepare_packed_weights``' errors.
    """

    def __init__(self, w13: PackedWeights, w2: PackedWeights, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.scheme = w13.scheme
        h, i = hidden_size, intermediate_size
        self.dims = (h, i)
        self.padded_dims = (F4.padded_to_k_tile(h), F4.padded_to_k_tile(i)) if w13.nbits == 4 else (h, i)
        hp, ip = self.padded_dims
        for name, pw, (halves, rows, k) in (("w13", w13, (2, ip, hp)), ("w2", w2, (1, h, ip))):
            packed, scales = pw.packed, None
            if self.padded:  # (halves, rows, K) of the padded copy; its scales held beside it
                packed, scales = F4.pad_fp4_halves(packed, pw.scales, self.scheme.block_size, halves, rows, k)
            prepared = prepare_packed_weights(
                PackedWeights(packed, pw.scales if scales is None else scales, self.scheme, pw.global_scale)
            )
            self.register_buffer(name, prepared.packed, persistent=False)
            self.register_buffer(name + "_scale", scales, persistent=False)
        # fp4_one_multiply of each weight's scales: (the scales' storage and version, the answer)
        self._one_multiply: dict[str, tuple[tuple, bool]] = {}

    @property
    def padded(self) -> bool:
        """Whether the prepared copy is zero-padded along H or I."""
        return self.padded_dims != self.dims

    def kernel_weights(
        self,
        w13_scale: torch.Tensor,
        w2_scale: torch.Tensor,
        w13_global_scale: torch.Tensor | None,
        w2_global_scale: torch.Tensor | None,
    ) -> tuple[FP4Weights, FP4Weights] | tuple[F6.FP6Weights, F6.FP6Weights]:
        """``(w13, w2)`` operands of ``fused_fp4_moe`` with the caller's checkpoint scale bytes (uint8) and NVFP4
        global scales (fp32 ``[E]`` / ``[E, 2]``, else None); the padded scale copies replace the scales where
        held. The one-multiply decision (``fp4_one_multiply``, a host read) is made once per scale tensor and
        again only after it changes (a new storage, or an in-place write: it bumps ``_version``); under a CUDA
        graph capture an unknown one takes the two-multiply decode, which fits any scale."""
        s = self.scheme
        if s.element.nbits == 6:
            return (
                F6.FP6Weights(self.w13, w13_scale, s.element, s.block_size),
                F6.FP6Weights(self.w2, w2_scale, s.element, s.block_size),
            )
        one13 = self._one_multiply_of("w13", w13_scale, w13_global_scale)  # pad bytes 0 agree
        one2 = self._one_multiply_of("w2", w2_scale, w2_global_scale)
        s13 = w13_scale if self.w13_scale is None else self.w13_scale
        s2 = w2_scale if self.w2_scale is None else self.w2_scale
        return (
            FP4Weights(self.w13, s13, s.block_size, s.has_global_scale, w13_global_scale, one13),
            FP4Weights(self.w2, s2, s.block_size, s.has_global_scale, w2_global_scale, one2),
        )

    def _one_multiply_of(self, name: str, scales: torch.Tensor, g: torch.Tensor | None) -> bool:
        key = tuple((t.data_ptr(), t._version) for t in (scales, g) if t is not None)
        known = self._one_multiply.get(name)
        if known is None or known[0] != key:
            if scales.is_cuda and torch.cuda.is_current_stream_capturing():
                return False  # no host read inside a CUDA-graph capture: the two-multiply decode fits any scale
            known = self._one_multiply[name] = (key, fp4_one_multiply(scales, self.scheme.block_size, g))
        return known[1]

    def checkpoint_packed(self, name: str, sel=slice(None)) -> torch.Tensor:
        """The checkpoint-layout packed bytes of ``name`` (``"w13"`` or ``"w2"``) of experts ``sel`` (a new
        tensor: ``unprepare_fp4_packed`` or ``unprepare_fp6_packed``, then the padding removed)."""
        prepared = self._buffers[name][sel]
        el = self.scheme.element
        if el.nbits == 6:
            return F6.unprepare_fp6_packed(prepared, el)
        out = F4.unprepare_fp4_packed(prepared)
        if self.padded:
            h, i = self.dims
            out = F4.unpad_fp4_halves(out, *((2, i, h) if name == "w13" else (1, h, i)))
        return out

    def extra_repr(self) -> str:
        return f"scheme={self.scheme.name}, dims={self.dims}, padded_dims={self.padded_dims}"
