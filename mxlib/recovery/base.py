"""The weight-technique protocol: how a recovery technique chooses one layer's expert codes and scales.

A technique changes which scales and codes a checkpoint stores, never the format: its
``quantize_experts`` returns the same ``ExpertWeights`` (packed codes, block scales, global
scales) that round-to-nearest quantization (``mxlib.moe.factory.quantize_expert_weights``) returns,
so every checkpoint layout stores it and every loader reads it back. A technique that also changes
the forward (a rotation) says so in ``config()``, which the writer stores in the checkpoint's
``quantization_config`` under ``RECOVERY_CONFIG_KEY`` so that a loader can apply it or refuse it.

NVFP4 global scales come in two kinds (``ExpertWeights.global_scale_kind``): ModelOpt's and
Quark's decode scale (multiplied: ``step = block_scale * g``) and compressed-tensors' encode
scale (divided by: ``step = block_scale / gs``, stored as such). Converting one kind into the
other is not exact (``1 / (1 / g) != g`` in fp32), so a converted checkpoint would not
dequantize to the technique's weights. The choice made here: a technique chooses its codes under
the layout's own kind. Techniques list the kinds they produce in ``global_scale_kinds`` (absent:
``("decode",)``); the writer passes ``global_scale_kind="encode"`` to ``quantize_experts`` for a
layout storing encode scales (``technique_global_scale_kw``) and refuses, with a ValueError
naming the technique and the layout kind, a technique that lists only ``decode``. The encode
global scale a technique picks is its own (4/6: ``6 * 256 / amax``, MSE: ``6 * 448 / amax`` in
fp32, not compressed-tensors' bf16-rounded one): the loader reads any positive fp32 value.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ..moe.emulation import ExpertWeights
from ..moe.factory import quantize_expert_weights
from ..moe.schemes import MoEQuantScheme

__all__ = ["RECOVERY_CONFIG_KEY", "WeightTechnique", "RoundToNearest", "technique_global_scale_kw"]

# The key of ``quantization_config`` under which a technique's ``config()`` is stored (absent for
# techniques that change only the chosen scales and codes).
RECOVERY_CONFIG_KEY = "mxlib_recovery"


@runtime_checkable
class WeightTechnique(Protocol):
    """What the checkpoint writer calls, once per layer.

    Attributes:
        name: the registry name (``mxlib.recovery.TECHNIQUES``).
        global_scale_kinds: optional, the NVFP4 global-scale kinds ``quantize_experts`` produces
            (absent: ``("decode",)``); a technique listing ``"encode"`` takes the keyword
            ``global_scale_kind`` (module docstring).
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


def technique_global_scale_kw(technique: WeightTechnique, scheme: MoEQuantScheme, layout_kind: str) -> dict:
    """The keyword arguments the writer adds to ``technique.quantize_experts`` for a layout whose
    NVFP4 global scales are of kind ``layout_kind``: ``{}`` for decode (or a scheme without a global
    scale), ``{"global_scale_kind": "encode"}`` for encode.

    Raises:
        ValueError: an encode layout and a technique whose ``global_scale_kinds`` lacks ``"encode"``.
    """
    if layout_kind == "decode" or not scheme.weight.has_global_scale:
        return {}
    kinds = tuple(getattr(technique, "global_scale_kinds", ("decode",)))
    if layout_kind not in kinds:
        raise ValueError(
            f"technique: {technique.name} produces NVFP4 global scales of kind {list(kinds)}; the layout stores "
            f"{layout_kind!r} ones (write the modelopt layout, or a technique listing {layout_kind!r})"
        )
    return {"global_scale_kind": layout_kind}
