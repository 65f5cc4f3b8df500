"""The pure-PyTorch reference MoE (the ``torch`` backend) and vLLM's SiLU-and-mul.

Shapes: ``M`` tokens, ``H`` hidden size, ``I`` expert intermediate size, ``E`` experts,
``k`` experts per token; ``w13 [E, 2I, H]`` holds each expert's gate rows then up rows;
``w2 [E, H, I]``; expert biases ``w13_bias [E, 2I]`` (gate then up, as w13's rows) and ``w2_bias [E, H]``.
The gated activation between the GEMMs is a ``mxlib.moe.activations.MoEActivation`` (SiLU by default,
gpt-oss's SwiGLU-OAI).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .activations import SILU, MoEActivation, activation_and_mul

__all__ = ["silu_and_mul", "torch_moe"]


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` computed in fp32, one rounding to ``x.dtype`` (vLLM's op)."""
    d = x.shape[-1] // 2
    xf = x.float()
    return (F.silu(xf[..., :d]) * xf[..., d:]).to(x.dtype)


def torch_moe(
    a1: torch.Tensor,
    w13,
    w2,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    quantize_intermediate=None,
    a1_per_pair: bool = False,
    output_scales=None,
    a1_row_scale: torch.Tensor | None = None,
    activation: MoEActivation = SILU,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-PyTorch reference MoE: a loop over the experts that received tokens.

    Computes what the Triton path computes, at the same rounding points: GEMM1 in fp32 (plus
    its bias) rounded to the activation dtype, the gated activation (``activation_and_mul``: fp32,
    one rounding), the optional a2 QDQ, GEMM2 in fp32 plus its bias, times the router weight,
    rounded to the activation dtype, and the sum over k in fp32.

    Where a bias goes (vLLM's ``fused_moe_kernel`` with ``HAS_BIAS``: ``acc + bias``, then the router
    weight, then the one rounding): onto the fp32 GEMM result, after every multiplier of that result
    (``a1_row_scale``, the row scales ``quantize_intermediate`` returns, ``output_scales``). Those
    multipliers are what turns the accumulator into the true product in ``hardware`` numerics (the
    per-tensor and per-token scales of an FP4 tensor-core GEMM), and a bias is in the units of the
    product, as a GEMM epilogue ``alpha * acc + bias`` adds it. (vLLM's kernel adds the bias before its
    per-tensor FP8 ``a_scale * b_scale``; the MX and NVFP4 emulations it runs have no such scale: their
    operands are dequantized, so there the two orders are one.)

    Args:
        a1: ``[M, H]`` (or ``[M * k, H]`` with ``a1_per_pair``), already QDQ'd if the scheme says so.
        w13, w2: ``[E, 2I, H]`` / ``[E, H, I]`` tensors, or callables ``e -> weight`` (to
            dequantize one expert at a time).
        topk_weights, topk_ids: ``[M, k]``.
        quantize_intermediate: ``(a2 [n, I], row_experts [n]) -> a2`` or None; it may return
            ``(a2, row_scale [n])``: fp32 multipliers of GEMM2's products row by row, applied first
            (per-token NVFP4 scales in hardware numerics).
        output_scales: ``e -> ([GEMM1 multipliers], [GEMM2 multipliers]) | None`` or None: fp32 scalars
            or per-output-column vectors that multiply expert ``e``'s fp32 GEMM products, in order,
            before the rounding (and, for GEMM2, before the router weight). The ``hardware``
            numerics put the per-tensor scales here (``mxlib.moe.emulation``): the operands are
            then ``element * block_scale``, exact in bf16, as an FP4 tensor-core GEMM sees them.
        a1_row_scale: fp32 ``[rows of a1]`` multipliers of GEMM1's products row by row, applied before
            ``output_scales``' (per-token NVFP4 scales in hardware numerics), or None.
        activation: the gated activation (``SILU``: vLLM's ``silu_and_mul``, the default; ``SWIGLUOAI``).
        w13_bias: ``[E, 2I]`` (fp32 or the activation dtype, read as fp32) added to GEMM1's fp32 result
            (gate columns, then up columns) before its rounding, or None.
        w2_bias: ``[E, H]`` added to GEMM2's fp32 result before the router weight, or None.

    Returns:
        ``[M, H]`` in ``a1.dtype``.
    """
    for name, b in (("w13_bias", w13_bias), ("w2_bias", w2_bias)):
        if b is not None and (not isinstance(b, torch.Tensor) or b.ndim != 2):
            got = list(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__
            raise ValueError(f"{name}: expected a tensor [E, {'2I' if name == 'w13_bias' else 'H'}], got {got}")
    m, k = topk_ids.shape
    dtype = a1.dtype
    get13 = w13 if callable(w13) else (lambda e: w13[e])
    get2 = w2 if callable(w2) else (lambda e: w2[e])
    flat_ids = topk_ids.reshape(-1).long()
    flat_w = topk_weights.reshape(-1).float()
    hidden = None
    for e in torch.unique(flat_ids).tolist():
        pairs = (flat_ids == e).nonzero().squeeze(1)
        rows = pairs if a1_per_pair else pairs // k
        scales = (output_scales(e) if output_scales is not None else None) or ((), ())
        h = a1[rows].float() @ get13(e).float().T
        if a1_row_scale is not None:
            h = h * a1_row_scale[rows, None]
        for s in scales[0]:
            h = h * s
        if w13_bias is not None:
            h = h + w13_bias[e].float()
        h = h.to(dtype)
        act = activation_and_mul(h, activation)
        if quantize_intermediate is not None:
            act = quantize_intermediate(act, flat_ids[pairs])
        row_scale = None
        if isinstance(act, tuple):
            act, row_scale = act
        w2e = get2(e)
        y = act.float() @ w2e.float().T
        if row_scale is not None:
            y = y * row_scale[:, None]
        for s in scales[1]:
            y = y * s
        if w2_bias is not None:
            y = y + w2_bias[e].float()
        y = (y * flat_w[pairs, None]).to(dtype)
        if hidden is None:
            hidden = torch.zeros(m * k, w2e.shape[0], dtype=dtype, device=a1.device)
        hidden[pairs] = y
    if hidden is None:
        return torch.zeros(m, a1.shape[-1], dtype=dtype, device=a1.device)
    return hidden.view(m, k, -1).float().sum(dim=1).to(dtype)
