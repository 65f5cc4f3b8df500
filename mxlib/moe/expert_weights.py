"""``ExpertWeights``: one layer's experts quantized in one block scheme, as the emulation experts hold them.

The packed elements and block scales of ``w13 [E, 2I, H]`` (gate rows, then up rows) and ``w2 [E, H, I]``
stacked over experts, with the NVFP4 global scales; built by ``mxlib.moe.factory.quantize_expert_weights`` or
stacked from a checkpoint (``mxlib.checkpoints``), consumed by ``mxlib.moe.emulation``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..formats import BlockScheme

__all__ = ["ExpertWeights"]


@dataclass
class ExpertWeights:
    """One layer's experts quantized in one block scheme (stacked over experts).

    ``w13_weight`` uint8 packed ``[E, 2I, H * bits / 8]`` (gate rows, then up rows),
    ``w13_weight_scale`` ``[E, 2I, H / block_size]`` (uint8 E8M0, or float8_e4m3fn for NVFP4),
    ``w2_weight`` / ``w2_weight_scale`` likewise for ``[E, H, I]``; with a global scale
    (NVFP4): ``w13_weight_scale_2`` fp32 ``[E]`` (or ``[E, 2]``: gate and up their own) and
    ``w2_weight_scale_2`` fp32 ``[E]`` (ModelOpt's decode ``weight_scale_2``).
    ``global_scale_kind``: ``"decode"`` (ModelOpt, multiplied) or ``"encode"``
    (compressed-tensors' ``weight_global_scale``, a divisor, used as stored).
    """

    scheme: BlockScheme
    w13_weight: torch.Tensor
    w13_weight_scale: torch.Tensor
    w2_weight: torch.Tensor
    w2_weight_scale: torch.Tensor
    w13_weight_scale_2: torch.Tensor | None = None
    w2_weight_scale_2: torch.Tensor | None = None
    global_scale_kind: str = "decode"

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors by name (the scheme and absent global scales left out)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}

    def to(self, device) -> ExpertWeights:
        moved = {k: v.to(device) for k, v in self.tensors().items()}
        return ExpertWeights(self.scheme, **moved, global_scale_kind=self.global_scale_kind)

    @property
    def device(self) -> torch.device:
        return self.w13_weight.device


def _check(t: torch.Tensor, name: str, shape, dtypes) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    return t
