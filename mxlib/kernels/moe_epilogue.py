"""The epilogue pieces the MoE grouped GEMMs share: the gated activation, the expert biases, the sum over k.

``fused_moe`` (bf16 GEMMs), ``fused_dequant_moe`` (dequantize-GEMM) and ``fused_fp4_moe`` (FP4 weights) finish
their tiles with the same steps, written once here:

* ``load_bias``: a tile's expert bias ``bias[e, n]`` (fp32 or the activation dtype, read as fp32), added to the
  fp32 accumulator after its multipliers and before its rounding (vLLM's ``fused_moe_kernel`` with
  ``HAS_BIAS``; ``mxlib.moe.reference_moe.torch_moe`` states why after the multipliers).
* ``gated_activation``: GEMM1's gate and up tiles (each rounded to the activation dtype, read as fp32) to the
  activation in fp32 (``ACT``: 0 SiLU ``gate / (1 + exp(-gate)) * up``, vLLM's ``silu_and_mul``; 1 SwiGLU-OAI
  ``(up + 1) * (gate * sigmoid(alpha * gate))`` after ``gate = min(gate, limit)`` and ``up = clamp(up, -limit,
  limit)`` when ``CLAMP``, vLLM's ``swigluoai_and_mul``), the steps of ``mxlib.moe.activations``. Triton's
  ``exp`` is not PyTorch's: the results may differ from the PyTorch function in the last fp32 bit.
* ``activation_args``: the ``ACT, ACT_ALPHA, ACT_CLAMP, ACT_LIMIT`` constexprs of a ``MoEActivation`` (any
  object with ``kernel_id``, ``alpha``, ``limit``; None is SiLU).
* ``sum_k_kernel``: ``out[t] = sum_j pairs[t * k + j]`` in fp32, j ascending, one rounding.
"""

from __future__ import annotations

import torch

from . import _numerics as nm
from ._triton import tl, triton

__all__ = ["gated_activation", "load_bias", "activation_args", "bias_args", "sum_k_kernel"]


@triton.jit
def gated_activation(
    gate, up, ACT: tl.constexpr, ACT_ALPHA: tl.constexpr, ACT_CLAMP: tl.constexpr, ACT_LIMIT: tl.constexpr
):
    """The fp32 gated activation of fp32 ``gate`` and ``up`` tiles (module docstring); ``ACT_LIMIT`` is read
    only with ``ACT_CLAMP``."""
    if ACT == 0:
        out = gate / (1.0 + tl.exp(-gate)) * up
    else:
        if ACT_CLAMP:
            gate = tl.where(gate > ACT_LIMIT, ACT_LIMIT, gate)  # NaN stays NaN
            up = tl.where(up > ACT_LIMIT, ACT_LIMIT, up)
            up = tl.where(up < -ACT_LIMIT, -ACT_LIMIT, up)
        out = (up + 1.0) * (gate * (1.0 / (1.0 + tl.exp(-(gate * ACT_ALPHA)))))
    return out


@triton.jit
def load_bias(bias_ptr, expert, stride_e, offs_n, n_mask):
    """``bias[expert, offs_n]`` as fp32 ``[BLOCK_N]`` (0 where ``n_mask`` is false)."""
    return nm.to_fp32(tl.load(bias_ptr + expert * stride_e + offs_n, mask=n_mask, other=0.0))


def activation_args(activation) -> dict:
    """The ``ACT, ACT_ALPHA, ACT_CLAMP, ACT_LIMIT`` constexprs of ``activation`` (a
    ``mxlib.moe.activations.MoEActivation``; None: SiLU)."""
    if activation is None:
        return dict(ACT=0, ACT_ALPHA=1.0, ACT_CLAMP=False, ACT_LIMIT=0.0)
    limit = activation.limit
    return dict(
        ACT=activation.kernel_id,
        ACT_ALPHA=float(activation.alpha),
        ACT_CLAMP=limit is not None,
        ACT_LIMIT=0.0 if limit is None else float(limit),
    )


def bias_args(
    bias: torch.Tensor | None, unread: torch.Tensor, experts: int, cols: int, name: str
) -> tuple[torch.Tensor, int]:
    """``(pointer tensor, expert stride)`` of an ``[experts, cols]`` bias, or ``(unread, 0)`` without one.

    Raises:
        ValueError: a bias of another shape or with non-contiguous rows, naming ``name``.
        TypeError: a bias that is not fp32, bf16 or fp16.
    """
    if bias is None:
        return unread, 0
    if tuple(bias.shape) != (experts, cols) or bias.stride(1) != 1:
        raise ValueError(
            f"{name}: expected shape [{experts}, {cols}] with contiguous rows, got {list(bias.shape)} "
            f"(strides {list(bias.stride())})"
        )
    if bias.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"{name}: expected dtype float32, bfloat16 or float16, got {bias.dtype}")
    return bias, bias.stride(0)


@triton.jit
def sum_k_kernel(x_ptr, out_ptr, H, top_k: tl.constexpr, BLOCK: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """out[t, :] = sum_j x[t * k + j, :] in fp32 (j ascending), one rounding."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < H
    acc = tl.zeros((BLOCK,), tl.float32)
    for j in range(top_k):
        acc += nm.to_fp32(tl.load(x_ptr + (t * top_k + j) * H + cols, mask=m, other=0.0))
    tl.store(out_ptr + t * H + cols, nm.cast_out(acc, OUT_DTYPE), mask=m)
