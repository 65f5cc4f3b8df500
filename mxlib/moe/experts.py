"""The experts classes under the import path of vLLM's emulation design (``mxlib.moe.experts``).

The code lives in modules by subject: ``mxlib.moe.reference_moe`` (the reference MoE),
``mxlib.moe.scales`` (activation-scale strategies), ``mxlib.moe.base`` (``TritonExperts``,
backend selection, the transformers adapter), ``mxlib.moe.emulation`` (the emulation
subclasses) and ``mxlib.moe.factory`` (quantize experts, build emulation experts). This module
only re-exports the classes the design document names, for code written against it.
"""

from __future__ import annotations

from .base import TritonExperts
from .emulation import Nvfp4QuantizationEmulationTritonExperts, OCP_MXQuantizationEmulationTritonExperts

__all__ = ["TritonExperts", "Nvfp4QuantizationEmulationTritonExperts", "OCP_MXQuantizationEmulationTritonExperts"]
