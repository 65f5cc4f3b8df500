"""The gated activations of an MoE expert: what turns GEMM1's output ``[n, 2I]`` into GEMM2's input ``[n, I]``.

GEMM1's output holds the gate columns first, then the up columns (``w13 [E, 2I, H]`` is gate rows then up rows
everywhere in mxlib; a checkpoint with interleaved gate/up rows, gpt-oss's native layout, is de-interleaved when
it is read). Two activations, each a ``MoEActivation`` (``name``, ``alpha``, ``limit``):

* ``SILU`` (Qwen3, Mixtral, OLMoE, DeepSeek-V3; vLLM's ``silu_and_mul``): ``silu(gate) * up``.
* ``SWIGLUOAI`` (gpt-oss; vLLM's ``swigluoai_and_mul``, transformers' ``GptOssExperts._apply_gate``):
  ``gate = min(gate, limit)``, ``up = clamp(up, -limit, limit)``, then
  ``(up + 1) * (gate * sigmoid(alpha * gate))`` with ``alpha = 1.702``, ``limit = 7.0``. The gate is clamped
  from above only; ``limit=None`` clamps neither (``MoEActivation("swigluoai", alpha=1.0)`` is the external-kernel
  harness's ``tk_mxfp4`` row: gpt-oss's formula, alpha 1, no clamp). vLLM's ``swigluoai`` op reads the gate
  and up columns interleaved (gpt-oss's checkpoint order); on halves, as here, the same formula is vLLM's
  ``MoEActivation.SWIGLUOAI_UNINTERLEAVE`` (whose ``beta`` is the ``+ 1`` on up, 1 here).

``activation_and_mul(x, activation)`` applies one in fp32 and rounds once to ``x.dtype`` (as vLLM's ops do: their
CUDA kernels read bf16, compute in fp32, write bf16). The steps in fp32, in order (the Triton epilogues of
``mxlib.kernels.fused_dequant_moe`` and ``fused_fp4_moe`` compute the same steps): SiLU ``gate / (1 + exp(-gate))``
(``torch.nn.functional.silu``) times ``up``; SwiGLU-OAI: the clamps (exact: they pick a value), ``alpha * gate``,
``sigmoid``, ``gate * sigmoid``, ``up + 1``, the product. NaN passes through the clamps (``torch.clamp``; the
kernels use ``where(gate > limit, limit, gate)``, false for NaN). ``exp`` and ``sigmoid`` are libm functions: the
PyTorch and Triton results may differ in the last fp32 bit, so bits agree only where the same function computes
them (the ``torch`` and ``triton`` backends both call this module).

Names are resolved once where they enter (``get_activation``); below, code receives the ``MoEActivation`` and
reads its ``kernel_id`` (0 SiLU, 1 SwiGLU-OAI: the kernels' ``ACT`` constexpr).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["MoEActivation", "SILU", "SWIGLUOAI", "ACTIVATIONS", "get_activation", "activation_and_mul", "swigluoai"]

_KERNEL_IDS = {"silu": 0, "swigluoai": 1}


@dataclass(frozen=True)
class MoEActivation:
    """A gated activation and its parameters.

    Args:
        name: ``"silu"`` or ``"swigluoai"`` (vLLM's names).
        alpha: SwiGLU-OAI's sigmoid slope (gpt-oss: 1.702); SiLU takes 1.0 only.
        limit: SwiGLU-OAI's clamp (gpt-oss: 7.0; None: no clamp); SiLU takes None only.

    Raises:
        ValueError: an unknown name, a non-finite ``alpha``, a ``limit`` that is not a positive finite number,
            or SiLU with an ``alpha`` other than 1 or a ``limit``.
    """

    name: str
    alpha: float = 1.0
    limit: float | None = None

    def __post_init__(self):
        if self.name not in _KERNEL_IDS:
            raise ValueError(f"name: expected one of {list(_KERNEL_IDS)}, got {self.name!r}")
        if not isinstance(self.alpha, (int, float)) or not math.isfinite(self.alpha):
            raise ValueError(f"alpha: expected a finite number, got {self.alpha!r}")
        if self.limit is not None and (
            not isinstance(self.limit, (int, float)) or not math.isfinite(self.limit) or self.limit <= 0
        ):
            raise ValueError(f"limit: expected a positive finite number or None, got {self.limit!r}")
        if self.kernel_id == 0 and (self.alpha != 1.0 or self.limit is not None):
            raise ValueError(f"silu: takes alpha=1.0 and limit=None, got alpha={self.alpha!r}, limit={self.limit!r}")

    @property
    def kernel_id(self) -> int:
        """The kernels' ``ACT`` constexpr: 0 SiLU, 1 SwiGLU-OAI."""
        return _KERNEL_IDS[self.name]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``activation_and_mul(x, self)``."""
        return activation_and_mul(x, self)


SILU = MoEActivation("silu")
SWIGLUOAI = MoEActivation("swigluoai", alpha=1.702, limit=7.0)
ACTIVATIONS: dict[str, MoEActivation] = {"silu": SILU, "swigluoai": SWIGLUOAI}


def get_activation(name_or_activation: str | MoEActivation, argname: str = "activation") -> MoEActivation:
    """A ``MoEActivation`` as given, or the one ``ACTIVATIONS`` names (``"silu"``, ``"swigluoai"``: gpt-oss's
    alpha 1.702, limit 7.0).

    Raises:
        ValueError: an unknown name, naming ``argname`` and the known names.
        TypeError: neither a name nor a ``MoEActivation``.
    """
    if isinstance(name_or_activation, MoEActivation):
        return name_or_activation
    if isinstance(name_or_activation, str):
        if name_or_activation not in ACTIVATIONS:
            raise ValueError(f"{argname}: expected one of {list(ACTIVATIONS)}, got {name_or_activation!r}")
        return ACTIVATIONS[name_or_activation]
    raise TypeError(f"{argname}: expected a MoEActivation or a name, got {type(name_or_activation).__name__}")


def swigluoai(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float | None) -> torch.Tensor:
    """SwiGLU-OAI of fp32 ``gate`` and ``up`` (same shape), in fp32 (module docstring's steps)."""
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return (up + 1.0) * (gate * torch.sigmoid(gate * alpha))


def activation_and_mul(x: torch.Tensor, activation: MoEActivation = SILU) -> torch.Tensor:
    """The gated activation of a GEMM1 output, computed in fp32, one rounding to ``x.dtype``.

    Args:
        x: ``[..., 2I]``, the gate columns then the up columns (bf16, fp16 or fp32).
        activation: a ``MoEActivation`` (``SILU``, ``SWIGLUOAI``, ...).

    Returns:
        ``[..., I]`` in ``x.dtype``. ``SILU`` gives the bits of ``silu_and_mul`` (vLLM's op).

    Raises:
        ValueError: an odd last dimension.
        TypeError: ``activation`` not a ``MoEActivation``.
    """
    if not isinstance(activation, MoEActivation):
        raise TypeError(f"activation: expected a MoEActivation (get_activation), got {type(activation).__name__}")
    if x.shape[-1] % 2:
        raise ValueError(f"x: expected an even last dimension [..., 2I] (gate, up), got {list(x.shape)}")
    d = x.shape[-1] // 2
    xf = x.float()
    gate, up = xf[..., :d], xf[..., d:]
    if activation.kernel_id == 0:
        return (F.silu(gate) * up).to(x.dtype)
    return swigluoai(gate, up, activation.alpha, activation.limit).to(x.dtype)
