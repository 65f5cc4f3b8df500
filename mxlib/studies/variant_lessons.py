"""Notebook 02's rows for the NVFP4 variants ahead of hardware: what UE5M3 block scales and 32-element blocks
buy against NVFP4 and MXFP4, and what a per-tensor global scale still buys with UE5M3.

* ``variant_sqnr(x)``: SQNR (dB) of QDQ of ``x`` in ``mxfp4`` (E8M0 rule ``even``), ``nvfp4``, ``nvfp4_b32``,
  ``nvfp4_ue5m3`` (one level) and ``nvfp4_ue5m3_gs`` (UE5M3 with the per-tensor global scale
  ``amax / (6 * 114688)``, the explicit two-level option). The NVFP4-style formats all run the same arithmetic
  (``mxlib.reference.quant_dequant_nvfp4_variant``: ModelOpt's decode-scale form, NVFP4's global scale
  ``amax / 2688``), so their differences are the formats' own.
* ``variant_draws(distribution, shape, seeds, ...)``: ``variant_sqnr`` on repeated draws of ``mxlib.analysis.sample``.
* ``variant_orderings(draws, pairs)``: every pair ``(a, b)`` on every distribution, decided together by
  ``mxlib.stats`` (one ``ComparisonFamily``, Holm): per pair, the paired t test of ``SQNR(a) - SQNR(b)`` over the
  draws (the unit of replication) and its verdict, ``"a better"``, ``"b better"`` or ``"cannot be told apart"``.
* ``global_scale_sweep(x, amaxes)``: ``x`` rescaled to each tensor amax, SQNR of UE5M3 with and without the global
  scale and of NVFP4 with and without its own: where the global scale buys anything.
* ``model_tensors(model, input_ids)`` and ``global_scale_on_tensors(tensors)``: the same question on a model's own
  tensors: every MoE layer's expert weights (``w13``, ``w2``: one global scale per expert) and the activations a
  forward gives them (``a1``: the layer input; ``a2``: the gated activation of each routed (token, expert) pair;
  one global scale per tensor).
"""

from __future__ import annotations

import torch

from .. import reference as R
from ..analysis import sample, sqnr_db
from ..formats import BLOCK_SCHEMES, NVFP4, NVFP4_B32, NVFP4_UE5M3
from ..stats import ComparisonFamily

__all__ = [
    "VARIANT_ROWS",
    "variant_sqnr",
    "variant_draws",
    "variant_orderings",
    "global_scale_sweep",
    "model_tensors",
    "global_scale_on_tensors",
]

# name: what it is (the notebook's row labels)
VARIANT_ROWS: dict[str, str] = {
    "mxfp4": "e2m1, E8M0 scale per 32 (OCP MX, rule even)",
    "nvfp4": "e2m1, ue4m3 scale per 16, fp32 global scale",
    "nvfp4_b32": "e2m1, ue4m3 scale per 32, fp32 global scale",
    "nvfp4_ue5m3": "e2m1, ue5m3 scale per 16, no global scale",
    "nvfp4_ue5m3_gs": "e2m1, ue5m3 scale per 16, fp32 global scale (option)",
}


_MXFP4, _NVFP4 = BLOCK_SCHEMES["mxfp4"], NVFP4
# name -> QDQ of a tensor, in the order of VARIANT_ROWS
_QDQ = {
    "mxfp4": lambda x: R.quant_dequant_mx(x, _MXFP4.element, _MXFP4.block_size, "even"),
    "nvfp4": lambda x: R.quant_dequant_nvfp4_variant(x, _NVFP4),
    "nvfp4_b32": lambda x: R.quant_dequant_nvfp4_variant(x, NVFP4_B32),
    "nvfp4_ue5m3": lambda x: R.quant_dequant_nvfp4_variant(x, NVFP4_UE5M3),
    "nvfp4_ue5m3_gs": lambda x: R.quant_dequant_nvfp4_variant(
        x, NVFP4_UE5M3, R.nvfp4_variant_global_scale(x, NVFP4_UE5M3, two_level=True)
    ),
}


def variant_sqnr(x: torch.Tensor, names=tuple(VARIANT_ROWS)) -> dict[str, float]:
    """``{name: SQNR dB}`` of QDQ of ``x`` (``[..., k]`` float, ``k`` a multiple of 32) in each of ``names``
    (keys of ``VARIANT_ROWS``).

    Raises:
        ValueError: a name not in ``VARIANT_ROWS``.
    """
    unknown = [n for n in names if n not in VARIANT_ROWS]
    if unknown:
        raise ValueError(f"names: expected names from {list(VARIANT_ROWS)}, got {unknown}")
    return {n: sqnr_db(_QDQ[n](x), x) for n in names}


def variant_draws(
    distribution: str, shape, seeds, outlier_fraction: float = 1e-3, outlier_scale: float = 100.0
) -> list[dict]:
    """One row ``{"seed", **variant_sqnr}`` per seed of ``sample(distribution, shape, seed, ...)``."""
    return [
        dict(seed=s, **variant_sqnr(sample(distribution, shape, s, outlier_fraction, outlier_scale))) for s in seeds
    ]


def variant_orderings(
    draws: dict[str, list[dict]], pairs, alpha: float = 0.05, family: ComparisonFamily | None = None
) -> list[dict]:
    """Every pair of ``pairs`` on every distribution of ``draws``, decided together (``mxlib.stats``).

    Args:
        draws: ``{distribution: variant_draws(...)}``, the same seeds for every distribution's rows.
        pairs: ``(a, b)`` names of ``VARIANT_ROWS``.
        alpha: the family-wise error rate of all ``len(draws) * len(pairs)`` comparisons (Holm); ignored with
            ``family``.
        family: an open ``ComparisonFamily`` that already holds a notebook's other comparisons: these are added
            to it and the whole family is decided here (one family per notebook, so Holm covers every ordering
            the notebook states; the family's own ``alpha`` applies). Default: a new family of these alone.

    Returns:
        One row per distribution and pair, ``{"distribution", "a", "b", "b_minus_a_db", "low", "high",
        "verdict", "holds"}``: the mean over the draws of ``SQNR(b) - SQNR(a)`` (dB) with its simultaneous interval
        (level ``1 - alpha / m``), the verdict (``"<a> better"``, ``"<b> better"`` or ``"cannot be told apart"``)
        and ``holds`` (an ordering was decided).

    Raises:
        ValueError: fewer than two draws of a distribution (no spread to test against), or a distribution's
            draws in a number that differs from the others'.
        RuntimeError: ``family`` was already decided.
    """
    counts = {d: len(rs) for d, rs in draws.items()}
    if not counts or min(counts.values()) < 2 or len(set(counts.values())) != 1:
        raise ValueError(f"draws: expected at least two draws, as many for every distribution, got {counts}")
    if family is None:
        family = ComparisonFamily("NVFP4 variants by SQNR", alpha=alpha)
    keys = {}
    for d, rs in draws.items():
        for a, b in pairs:
            keys[(d, a, b)] = family.add(
                a,
                b,
                [r[a] for r in rs],
                [r[b] for r in rs],
                metric=f"SQNR (dB) on {d}",
                higher_is_better=True,
                over="draws",
                unit_name="draws",
            )
    decisions = family.decide()
    rows = []
    for (d, a, b), k in keys.items():
        v = decisions[k]
        rows.append(
            dict(
                distribution=d,
                a=a,
                b=b,
                b_minus_a_db=-v.difference,
                low=-v.high,
                high=-v.low,
                verdict=v.verdict,
                holds=v.decided,
            )
        )
    return rows


def global_scale_sweep(x: torch.Tensor, amaxes=(1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 1e2, 1e4, 1e6)) -> list[dict]:
    """``x`` rescaled (by a power of two: exact) to about each tensor amax, SQNR (dB) of ``nvfp4_ue5m3`` without
    and with the global scale (``ue5m3``, ``ue5m3_gs``, and their difference ``gs_buys_db``) and of NVFP4 with its
    global scale and without one (``nvfp4``, ``nvfp4_no_gs``: ue4m3 block scales of ``amax_block / 6`` directly).
    """
    rows = []
    a0 = x.abs().max().item()
    for target in amaxes:
        y = x * 2.0 ** round(torch.log2(torch.tensor(target / a0)).item())
        one, two = variant_sqnr(y, ("nvfp4_ue5m3", "nvfp4_ue5m3_gs")).values()
        rows.append(
            dict(
                amax=y.abs().max().item(),
                ue5m3=one,
                ue5m3_gs=two,
                gs_buys_db=two - one,
                nvfp4=sqnr_db(R.quant_dequant_nvfp4_variant(y, NVFP4), y),
                nvfp4_no_gs=sqnr_db(R.quant_dequant_nvfp4_variant(y, NVFP4, 1.0), y),
            )
        )
    return rows


@torch.no_grad()
def model_tensors(model, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{"L<i>.w13": [E, 2I, H], "L<i>.w2": [E, H, I], "L<i>.a1": [M, H], "L<i>.a2": [M * k, I]}`` of every MoE layer
    of a bf16 model (any registered family with bf16 experts), fp32: the weights as stored, the activations of one
    forward of ``input_ids`` (a2 computed from a1 and the routed experts' weights, as the MoE computes it)."""
    from ..models.moe_models import expert_activation, expert_weights, moe_blocks
    from ..moe.activations import activation_and_mul

    captured, handles = {}, []
    for i, block in moe_blocks(model, "model_tensors"):
        experts = block.experts

        def hook(module, args, i=i):
            captured[i] = (args[0].detach(), args[1].detach())  # hidden_states [M, H], top_k_index [M, k]

        handles.append(experts.register_forward_pre_hook(hook))
    try:
        model(input_ids=input_ids)
    finally:
        for h in handles:
            h.remove()
    act = expert_activation(model)
    out = {}
    for i, (a1, ids) in sorted(captured.items()):
        w13, w2 = expert_weights(model, i)
        rows = [
            activation_and_mul((a1[ids[:, j] == e].float() @ w13[e].float().T).to(a1.dtype), act)
            for j in range(ids.shape[1])
            for e in torch.unique(ids[:, j]).tolist()
        ]
        out[f"L{i}.w13"], out[f"L{i}.w2"] = w13.float(), w2.float()
        out[f"L{i}.a1"], out[f"L{i}.a2"] = a1.float(), torch.cat(rows).float()
    return out


def global_scale_on_tensors(tensors: dict[str, torch.Tensor]) -> list[dict]:
    """Rows ``{"tensor", "amax", "ue5m3", "ue5m3_gs", "gs_buys_db", "nvfp4"}``: SQNR (dB) of each tensor in
    ``nvfp4_ue5m3`` without and with the per-tensor global scale (per expert for a 3D stack) and in NVFP4."""
    rows = []
    for name, x in tensors.items():
        one = sqnr_db(R.quant_dequant_nvfp4_variant(x, NVFP4_UE5M3), x)
        two = sqnr_db(
            R.quant_dequant_nvfp4_variant(x, NVFP4_UE5M3, R.nvfp4_variant_global_scale(x, NVFP4_UE5M3, True)), x
        )
        nv = sqnr_db(R.quant_dequant_nvfp4_variant(x, NVFP4), x)
        rows.append(
            dict(tensor=name, amax=x.abs().max().item(), ue5m3=one, ue5m3_gs=two, gs_buys_db=two - one, nvfp4=nv)
        )
    return rows
