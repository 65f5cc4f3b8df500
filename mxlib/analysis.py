"""Error metrics that say how much was lost, and where.

All metrics compare a test tensor against a reference (the bf16 model, or the
unquantized activations) in float64:

* ``rel_error``: ``||x - ref||_F / ||ref||_F``.
* ``sqnr_db``: signal-to-quantization-noise ratio ``10 log10(||ref||^2 / ||x - ref||^2)``
  (torchao's ``compute_error``); +inf when equal. Each halving of the error adds 6.02 dB.
  ``sqnr_db_from_sums`` is its last step, for callers that hold the two sums already (a sum over several
  tensors, or one computed on the GPU): every scalar SQNR in mxlib ends in it.
* ``top1_agreement``: fraction of positions whose argmax (next-token prediction) agrees.
* ``kl_divergence``: mean over positions of ``KL(softmax(ref) || softmax(x))`` in nats.
"""

from __future__ import annotations

import math

import torch

from . import reference as R
from .formats import get_block_scheme

__all__ = [
    "rel_error",
    "sqnr_db",
    "sqnr_db_from_sums",
    "top1_agreement",
    "kl_divergence",
    "compare_tensors",
    "compare_logits",
    "sample",
    "scheme_sqnr",
]


def rel_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error ``||x - ref|| / ||ref||`` (0 when both are zero)."""
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    den = ref.norm().item()
    num = (x - ref).norm().item()
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def sqnr_db_from_sums(signal: float, noise: float) -> float:
    """SQNR in dB from its two sums: ``10 log10(signal / noise)`` with ``signal = sum(ref^2)`` and
    ``noise = sum((x - ref)^2)`` (Python floats, both >= 0). +inf when ``noise`` is 0 (an exact match), else
    -inf when ``signal`` is 0 (a zero reference: every bit of ``x`` is noise)."""
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def sqnr_db(x: torch.Tensor, ref: torch.Tensor) -> float:
    """SQNR in dB: ``10 log10(sum(ref^2) / sum((x - ref)^2))`` in float64 on the CPU (``sqnr_db_from_sums``);
    +inf for an exact match."""
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    noise = ((x - ref) ** 2).sum().item()
    signal = (ref**2).sum().item()
    return sqnr_db_from_sums(signal, noise)


def top1_agreement(logits: torch.Tensor, ref_logits: torch.Tensor) -> float:
    """Fraction of positions where ``argmax`` over the vocabulary agrees."""
    return (logits.argmax(-1) == ref_logits.argmax(-1)).double().mean().item()


def kl_divergence(logits: torch.Tensor, ref_logits: torch.Tensor) -> float:
    """Mean ``KL(p_ref || p)`` over positions, in nats (logits of shape ``[..., vocab]``)."""
    lp = torch.log_softmax(logits.detach().double().cpu(), dim=-1)
    lq = torch.log_softmax(ref_logits.detach().double().cpu(), dim=-1)
    return (lq.exp() * (lq - lp)).sum(-1).mean().item()


def compare_tensors(x: torch.Tensor, ref: torch.Tensor) -> dict:
    """``{"rel_error", "sqnr_db"}`` of one tensor against its reference."""
    return {"rel_error": rel_error(x, ref), "sqnr_db": sqnr_db(x, ref)}


def compare_logits(logits: torch.Tensor, ref_logits: torch.Tensor) -> dict:
    """Relative error, SQNR, top-1 agreement and KL divergence of logits (each as its own function computes
    it; both tensors are widened to float64 on the CPU once for all four)."""
    x, ref = logits.detach().double().cpu(), ref_logits.detach().double().cpu()
    return {
        **compare_tensors(x, ref),
        "top1_agreement": top1_agreement(x, ref),
        "kl_divergence": kl_divergence(x, ref),
    }


def sample(distribution: str, shape, seed: int = 0, outlier_fraction: float = 1e-3, outlier_scale: float = 100.0):
    """Test data for the formats notebook: ``gaussian`` N(0, 1), ``laplace`` (heavier tails), or
    ``outliers`` (Gaussian with a fraction of values multiplied by ``outlier_scale``, as LLM
    activations have). fp32, seeded."""
    g = torch.Generator().manual_seed(seed)
    if distribution == "gaussian":
        return torch.randn(shape, generator=g)
    if distribution == "laplace":
        u = torch.rand(shape, generator=g) - 0.5
        return -torch.sign(u) * torch.log1p(-2 * u.abs())
    if distribution == "outliers":
        x = torch.randn(shape, generator=g)
        mask = torch.rand(shape, generator=g) < outlier_fraction
        return torch.where(mask, x * outlier_scale, x)
    raise ValueError(f"distribution: expected 'gaussian', 'laplace' or 'outliers', got {distribution!r}")


def scheme_sqnr(
    x: torch.Tensor,
    schemes=("mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3", "mxfp8_e5m2", "nvfp4"),
    scale_mode: str = "even",
) -> dict:
    """SQNR (dB) of QDQ of ``x`` in each block scheme (NVFP4 with its global scale from amax(x))."""
    out = {}
    for s in schemes:
        kw = {} if get_block_scheme(s).has_global_scale else {"scale_mode": scale_mode}
        out[s] = sqnr_db(R.quant_dequant(x, s, **kw), x)
    return out
