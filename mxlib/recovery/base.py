"""The weight-technique protocol: how a recovery technique chooses one layer's expert codes and scales.

A technique changes which scales and codes a checkpoint stores, never the format: its
``quantize_experts`` returns the same ``ExpertWeights`` (packed codes, block scales, global
scales) that round-to-nearest quantization (``mxlib.moe.factory.quantize_expert_weights``) returns,
so every checkpoint layout stores it and every loader reads it back. A technique that also changes
the forward (a rotation) says so in ``config()``, which the writer stores in the checkpoint's
``quantization_config`` under ``RECOVERY_CONFIG_KEY`` so that a loader can apply it or refuse it.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ..moe.emulation import ExpertWeights
from ..moe.factory import quantize_expert_weights
from ..moe.schemes import MoEQuantScheme

__all__ = ["RECOVERY_CONFIG_KEY", "WeightTechnique", "RoundToNearest"]

# The key of ``quantization_config`` under which a technique's ``config()`` is stored (absent for
# techniques that change only the chosen scales and codes).
RECOVERY_CONFIG_KEY = "mxlib_recovery"


@runtime_checkable
class WeightTechnique(Protocol):
    """What the checkpoint writer calls, once per layer.

    Attributes:
        name: the registry name (``mxlib.recovery.TECHNIQUES``).
    """

    name: str

    def quantize_experts(
        self, w13: torch.Tensor, w2: torch.Tensor, scheme: MoEQuantScheme, *, layer: int
    ) -> ExpertWeights:
        """One layer's experts quantized in ``scheme``'s weight format.

        Args:
            w13: ``[E, 2I, H]`` gate-then-up weights; w2: ``[E, H, I]`` (bf16, the model's).
            scheme: the checkpoint's ``MoEQuantScheme``.
            layer: the decoder layer index (techniques with per-layer state, e.g. Hessians, use it).

        Returns:
            ``ExpertWeights`` in the scheme's weight format, global scales in decode form.
        """
        ...

    def config(self) -> dict:
        """JSON-able entries a loader needs to run the checkpoint (``{}`` when the forward is unchanged)."""
        ...


class RoundToNearest:
    """Round-to-nearest quantization: the scales from each block's amax, codes rounded to nearest (ties to even).

    Exactly ``quantize_expert_weights`` (ModelOpt's NVFP4 export, Quark's OCP MX export with the ``even`` rule).
    """

    name = "rtn"

    def quantize_experts(
        self, w13: torch.Tensor, w2: torch.Tensor, scheme: MoEQuantScheme, *, layer: int
    ) -> ExpertWeights:
        return quantize_expert_weights(w13, w2, scheme)

    def config(self) -> dict:
        return {}
