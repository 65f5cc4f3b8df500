"""MoE quantization schemes: weight format + activation format, by AMD Quark's names.

=============================  =============  ===================================
scheme                         weights        activations (a1 and a2)
=============================  =============  ===================================
w_mxfp4                        mxfp4          bf16 (weight-only)
w_mxfp4_a_mxfp4                mxfp4          mxfp4, dynamic
w_mxfp4_a_mxfp6_e3m2           mxfp4          mxfp6_e3m2, dynamic
w_mxfp4_a_mxfp6_e2m3           mxfp4          mxfp6_e2m3, dynamic
w_mxfp4_a_fp8                  mxfp4          fp8 e4m3 per tensor, static input_scale
w_mxfp6_e3m2                   mxfp6_e3m2     bf16
w_mxfp6_e3m2_a_mxfp6_e3m2      mxfp6_e3m2     mxfp6_e3m2, dynamic
w_mxfp6_e3m2_a_fp8             mxfp6_e3m2     fp8 e4m3 per tensor, static
w_mxfp6_e2m3                   mxfp6_e2m3     bf16
w_mxfp6_e2m3_a_mxfp6_e2m3      mxfp6_e2m3     mxfp6_e2m3, dynamic
w_mxfp6_e2m3_a_fp8             mxfp6_e2m3     fp8 e4m3 per tensor, static
nvfp4                          nvfp4          nvfp4 (two-level, static global scale)
=============================  =============  ===================================

``mxfp4`` is accepted as a short name for ``w_mxfp4_a_mxfp4``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..formats import (
    BLOCK_SCHEMES,
    FP8_E4M3_PER_TENSOR,
    NVFP4,
    BlockScheme,
    PerTensorScheme,
    get_activation_format,
    get_block_scheme,
)

__all__ = [
    "MoEQuantScheme",
    "MOE_SCHEMES",
    "OCP_MX_SCHEMES",
    "NVFP4_MOE",
    "get_moe_scheme",
    "get_weight_format",
    "FP8_PER_TENSOR",
]

# The per-tensor FP8 activation format (an object of the format table; its name is "fp8_e4m3").
FP8_PER_TENSOR: PerTensorScheme = FP8_E4M3_PER_TENSOR


@dataclass(frozen=True)
class MoEQuantScheme:
    """A MoE quantization scheme: the experts' weight format and activation format.

    ``weight``: a ``BlockScheme`` of ``mxlib.formats`` (``mxfp4``, ``mxfp6_*``, ``nvfp4``);
    ``activation``: a ``BlockScheme`` (dynamic MX, or NVFP4 with a static global scale), the
    per-tensor ``fp8_e4m3`` scheme (static ``input_scale``), or None (weight-only). Both
    print as their names.
    """

    name: str
    weight: BlockScheme
    activation: BlockScheme | PerTensorScheme | None

    def __post_init__(self) -> None:
        object.__setattr__(self, "weight", get_block_scheme(self.weight))
        object.__setattr__(self, "activation", get_activation_format(self.activation))

    def __str__(self) -> str:
        return self.name

    @property
    def static_activation_scale(self) -> bool:
        """Whether the checkpoint carries an activation ``input_scale`` the experts need."""
        return self.activation is not None and self.activation.static_scale

    @property
    def is_ocp_mx(self) -> bool:
        """OCP MX weights (E8M0 block scales, no global scale), as opposed to NVFP4."""
        return not self.weight.has_global_scale


def _ocp(name: str) -> MoEQuantScheme:
    body = name[len("w_") :]
    weight, _, act = body.partition("_a_")
    return MoEQuantScheme(name, BLOCK_SCHEMES[weight], get_activation_format(act) if act else None)


OCP_MX_SCHEMES: tuple[str, ...] = (
    "w_mxfp4",
    "w_mxfp4_a_mxfp4",
    "w_mxfp4_a_mxfp6_e3m2",
    "w_mxfp4_a_mxfp6_e2m3",
    "w_mxfp4_a_fp8",
    "w_mxfp6_e3m2",
    "w_mxfp6_e3m2_a_mxfp6_e3m2",
    "w_mxfp6_e3m2_a_fp8",
    "w_mxfp6_e2m3",
    "w_mxfp6_e2m3_a_mxfp6_e2m3",
    "w_mxfp6_e2m3_a_fp8",
)

MOE_SCHEMES: dict[str, MoEQuantScheme] = {n: _ocp(n) for n in OCP_MX_SCHEMES}
MOE_SCHEMES[NVFP4.name] = MoEQuantScheme(NVFP4.name, NVFP4, NVFP4)
# NVFP4 weights and activations (ModelOpt's MoE scheme): the studies' and the loaders' object for it
NVFP4_MOE: MoEQuantScheme = MOE_SCHEMES[NVFP4.name]
_ALIASES = {"mxfp4": "w_mxfp4_a_mxfp4"}


def get_moe_scheme(name: str | MoEQuantScheme) -> MoEQuantScheme:
    """Look up a MoE scheme by Quark name (or ``nvfp4``, or the alias ``mxfp4``).

    Call it once, where a name enters (a notebook's parameters, a CLI option, a checkpoint's
    config); pass the object below that.

    Raises:
        ValueError: unknown name; the message lists the supported schemes.
    """
    if isinstance(name, MoEQuantScheme):
        return name
    key = _ALIASES.get(name, name)
    if key not in MOE_SCHEMES:
        raise ValueError(f"unknown MoE scheme {name!r}; supported: {list(MOE_SCHEMES)} (alias: mxfp4)")
    return MOE_SCHEMES[key]


def get_weight_format(scheme: str | MoEQuantScheme | BlockScheme) -> BlockScheme:
    """The block format weights are stored in: a ``MoEQuantScheme``'s ``weight``, a ``BlockScheme``
    itself, or either looked up by name (a MoE scheme name first, then a block scheme name:
    ``nvfp4``, ``w_mxfp6_e2m3``, ``mxfp6_e3m2``, ...).

    Raises:
        ValueError: a name that is neither; the message lists the block schemes.
    """
    if isinstance(scheme, MoEQuantScheme):
        return scheme.weight
    if isinstance(scheme, BlockScheme):
        return scheme
    try:
        return get_moe_scheme(scheme).weight
    except (ValueError, TypeError):
        return get_block_scheme(scheme)
