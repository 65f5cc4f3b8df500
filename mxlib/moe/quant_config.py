"""``FusedMoEQuantConfig``: the experts' quantization modes in one frozen object, checked once.

The emulation experts (``mxlib.moe.emulation``, ``weight_only``, ``nvfp4_variants``) and ``TritonExperts``
(``mxlib.moe.base``) take their weights, one ``FusedMoEQuantConfig`` and a backend. The config holds every mode
that is independent of the tensors: the scheme, the numerics, the NVFP4 activation-scale strategy and block
rule, the E8M0 rule of dynamic MX activations, the one-level/two-level choice of ``nvfp4_ue5m3`` activations, the
convention of the NVFP4 global scales, the online rotation and the gated activation. Its ``__post_init__``
checks each field and the combinations that cannot run (naming the field, the expected and the actual value);
what needs the tensors (shapes, dtypes, a static scale given or not) is checked by the experts.

Source: vLLM's ``FusedMoEQuantConfig`` (``vllm/model_executor/layers/fused_moe/config.py``), the object its
experts are built from (``nvfp4_moe_quant_config(...)``); vLLM's holds the scale tensors too, this one holds the
modes only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..formats import NVFP4, NVFP4_VARIANTS, Numerics, get_numerics, get_scale_mode
from ..kernels.hadamard import BlockHadamard
from .activation_rules import ACTIVATION_BLOCK_RULES, check_activation_block_rule
from .activations import SILU, MoEActivation, get_activation
from .scales import ACTIVATION_SCALE_STRATEGIES, PER_TOKEN
from .schemes import MoEQuantScheme

__all__ = ["FusedMoEQuantConfig", "GLOBAL_SCALE_KINDS"]

# The conventions of stored NVFP4 global scales: ModelOpt's decode ``weight_scale_2`` (multiplied) and
# compressed-tensors' encode ``weight_global_scale`` (a divisor, used as stored).
GLOBAL_SCALE_KINDS = ("decode", "encode")


@dataclass(frozen=True, eq=False)
class FusedMoEQuantConfig:
    """The quantization modes of one layer's experts (module docstring).

    Fields:
        scheme: the ``MoEQuantScheme`` (``mxlib.moe.schemes``; resolve a name with ``get_moe_scheme``), or None
            for unquantized experts (``TritonExperts``).
        numerics: ``Numerics.VLLM`` (default) or ``Numerics.HARDWARE``, or their names (``mxlib.moe.emulation``);
            ``hardware`` needs decode global scales, the ``amax`` block rule, and a scheme with a hardware model
            (not an NVFP4 variant).
        scale_strategy: how NVFP4 activations' per-expert static scales become global ones, one of
            ``ACTIVATION_SCALE_STRATEGIES`` (``mxlib.moe.scales``; default ``max``, vLLM's; ``per_token``: each
            token's amax). Read by schemes with NVFP4 activations only.
        activation_block_rule: NVFP4 activations' block rule, ``amax`` (default, vLLM's) or ``four_over_six``
            (``mxlib.moe.activation_rules``: NVFP4 W4A4 with static scales and vLLM numerics only).
        activation_scale_mode: the E8M0 rule of dynamic MX activations (``floor``, ``even``: the default,
            Quark's, ``rceil``).
        activation_global_scale: ``nvfp4_ue5m3`` only: QDQ activations with a dynamic per-tensor decode scale
            (``mxlib.moe.nvfp4_variants``) instead of the one-level form (default False).
        global_scale_kind: the NVFP4 weights' global scales, ``decode`` (ModelOpt, default) or ``encode``
            (compressed-tensors); the experts refuse weights of the other kind.
        rotation: the online block Hadamard rotation of weights rotated offline (``TritonExperts.rotation``,
            ``mxlib.recovery.hadamard``), or None. The experts hold its signs as buffers (moved with them).
        activation: the gated activation, a ``MoEActivation`` or its name (``"silu"``, the default;
            ``"swigluoai"``, gpt-oss's; ``mxlib.moe.activations``).

    Names given for ``numerics`` and ``activation`` are kept as the objects they name. ``dataclasses.replace``
    makes a changed copy, checked again.

    Raises:
        TypeError: a ``scheme`` that is not a ``MoEQuantScheme`` or None; a ``rotation`` that is not a
            ``BlockHadamard`` or None; an ``activation_global_scale`` that is not a bool.
        ValueError: an unknown name in any field; a combination that cannot run (each message names the field).
    """

    scheme: MoEQuantScheme | None = None
    numerics: Numerics = Numerics.VLLM
    scale_strategy: str = "max"
    activation_block_rule: str = "amax"
    activation_scale_mode: str = "even"
    activation_global_scale: bool = False
    global_scale_kind: str = "decode"
    rotation: BlockHadamard | None = None
    activation: MoEActivation = SILU

    def __post_init__(self) -> None:
        s = self.scheme
        if s is not None and not isinstance(s, MoEQuantScheme):
            raise TypeError(
                f"scheme: expected a MoEQuantScheme or None (mxlib.moe.get_moe_scheme resolves a name), "
                f"got {type(s).__name__} {s!r}"
            )
        if s is not None and s.linear_only:
            raise ValueError(
                f"scheme: {s.name} is a linear-layer scheme (FP8 weights with a per-tensor or per-channel scale); "
                f"the experts take the block-scaled schemes of mxlib.moe.schemes.MOE_SCHEMES"
            )
        object.__setattr__(self, "numerics", get_numerics(self.numerics))
        object.__setattr__(self, "activation", get_activation(self.activation))
        get_scale_mode(self.activation_scale_mode)
        if self.scale_strategy not in ACTIVATION_SCALE_STRATEGIES:
            raise ValueError(
                f"scale_strategy: expected one of {list(ACTIVATION_SCALE_STRATEGIES)}, got {self.scale_strategy!r}"
            )
        rule = self.activation_block_rule
        if rule not in ACTIVATION_BLOCK_RULES:
            raise ValueError(f"activation_block_rule: expected one of {list(ACTIVATION_BLOCK_RULES)}, got {rule!r}")
        if rule != "amax" and s is not None and not (s.weight is NVFP4 and not s.weight_only):
            raise ValueError(f"activation_block_rule: {rule!r} applies to NVFP4 activations; {s.name} has none")
        if s is not None and s.weight is NVFP4 and not s.weight_only:
            check_activation_block_rule(rule, per_token=self.scale_strategy == PER_TOKEN)
            check_activation_block_rule(rule, hardware=self.numerics is Numerics.HARDWARE)
        if self.global_scale_kind not in GLOBAL_SCALE_KINDS:
            raise ValueError(
                f"global_scale_kind: expected one of {list(GLOBAL_SCALE_KINDS)}, got {self.global_scale_kind!r}"
            )
        if self.numerics is Numerics.HARDWARE and self.global_scale_kind == "encode":
            raise ValueError(
                "numerics='hardware' needs decode global scales (ModelOpt's weight_scale_2); these "
                "weights carry encode scales (compressed-tensors): use numerics='vllm'"
            )
        variant = s is not None and s.weight.name in NVFP4_VARIANTS
        if variant and self.numerics is not Numerics.VLLM:
            raise ValueError(
                f"numerics: {s.weight.name} is emulated with dequantized operands only ('vllm'), "
                f"got {self.numerics.value!r}"
            )
        if not isinstance(self.activation_global_scale, bool):
            raise TypeError(
                f"activation_global_scale: expected a bool, got {type(self.activation_global_scale).__name__}"
            )
        if self.activation_global_scale and not (variant and not s.weight.has_global_scale):
            what = "no scheme" if s is None else s.name
            if variant:
                raise ValueError(f"activation_global_scale: {s.weight.name} has static activation scales already")
            raise ValueError(f"activation_global_scale: applies to nvfp4_ue5m3 activations only, got {what}")
        if self.rotation is not None and not isinstance(self.rotation, BlockHadamard):
            raise TypeError(f"rotation: expected a BlockHadamard or None, got {type(self.rotation).__name__}")

    def replace(self, **changes) -> FusedMoEQuantConfig:
        """A copy with ``changes`` (checked again: ``__post_init__``)."""
        return dataclasses.replace(self, **changes)
