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

from ..formats import BlockScheme, get_block_scheme

__all__ = ["MoEQuantScheme", "MOE_SCHEMES", "OCP_MX_SCHEMES", "get_moe_scheme", "FP8_PER_TENSOR"]

FP8_PER_TENSOR = "fp8_e4m3"


@dataclass(frozen=True)
class MoEQuantScheme:
    name: str
    weight: str
    activation: str | None

    @property
    def weight_scheme(self) -> BlockScheme:
        return get_block_scheme(self.weight)

    @property
    def static_activation_scale(self) -> bool:
        """Whether the checkpoint carries an activation ``input_scale`` the experts need."""
        return self.activation in ("nvfp4", FP8_PER_TENSOR)

    @property
    def is_ocp_mx(self) -> bool:
        return self.weight != "nvfp4"


def _ocp(name: str) -> MoEQuantScheme:
    body = name[len("w_"):]
    weight, _, act = body.partition("_a_")
    act_name = {"": None, "fp8": FP8_PER_TENSOR}.get(act, act or None)
    return MoEQuantScheme(name, weight, act_name)


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
MOE_SCHEMES["nvfp4"] = MoEQuantScheme("nvfp4", "nvfp4", "nvfp4")
_ALIASES = {"mxfp4": "w_mxfp4_a_mxfp4"}


def get_moe_scheme(name: str | MoEQuantScheme) -> MoEQuantScheme:
    """Look up a MoE scheme by Quark name (or ``nvfp4``, or the alias ``mxfp4``).

    Raises:
        ValueError: unknown name; the message lists the supported schemes.
    """
    if isinstance(name, MoEQuantScheme):
        return name
    key = _ALIASES.get(name, name)
    if key not in MOE_SCHEMES:
        raise ValueError(f"unknown MoE scheme {name!r}; supported: {list(MOE_SCHEMES)} (alias: mxfp4)")
    return MOE_SCHEMES[key]
