"""Every MoE scheme on one model: ``compare_schemes`` and the helpers the studies share.

``compare_schemes`` quantizes a bf16 model's experts in every MoE scheme (in memory, one weight
format at a time), runs the same token ids, or several token sets, through each, and measures
what each costs against bf16 (notebook 03, ``mxlib.cli compare``). With several token sets every
metric is the mean over the sets, beside its lowest and highest value and the per-set values
(``mxlib.studies.repeats`` orders schemes only where the difference exceeds that spread).
"""

from __future__ import annotations

import contextlib
import time
import warnings

import torch

from ..models.calibration import Calibration
from ..models.qwen3 import expert_weights, moe_layers
from ..moe.base import TransformersExperts
from ..moe.emulation import ExpertWeights, KeptDequantized
from ..moe.factory import make_emulation_experts, quantize_expert_weights
from ..moe.schemes import MoEQuantScheme, get_moe_scheme
from .repeats import spread
from .steps import check_numerics, compare_runs, keep_dequantized, run_model

__all__ = ["emulation_experts", "experts_swapped", "checkpoint_tensor_bytes", "compare_schemes", "LOGIT_METRICS"]

# the logits metrics of ``analysis.compare_logits`` a scheme row carries
LOGIT_METRICS = ("rel_error", "sqnr_db", "top1_agreement", "kl_divergence")


def emulation_experts(
    scheme: MoEQuantScheme,
    q: ExpertWeights,
    in13=None,
    in2=None,
    backend="auto",
    scale_strategy="max",
    numerics="vllm",
):
    """``make_emulation_experts`` with the unification warning silenced (the studies measure it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make_emulation_experts(
            scheme, q, in13, in2, backend=backend, scale_strategy=scale_strategy, numerics=numerics
        )


@contextlib.contextmanager
def experts_swapped(model, experts: list):
    """Temporarily replace each layer's experts (restored on exit)."""
    layers = moe_layers(model)
    originals = [m.experts for m in layers]
    try:
        for mlp, ex in zip(layers, experts):
            mlp.experts = TransformersExperts(ex)
        yield model
    finally:
        for mlp, orig in zip(layers, originals):
            mlp.experts = orig


def checkpoint_tensor_bytes(model, scheme: str | MoEQuantScheme) -> int:
    """Bytes of tensor data a checkpoint of ``scheme`` (a ``MoEQuantScheme``, or a name resolved
    here) holds: bf16 non-expert tensors plus the per-expert packed weights, scales and scalars,
    the same tensors ``write_quantized_checkpoint`` writes; file headers excluded."""
    s = get_moe_scheme(scheme)
    cfg = model.config
    e, h, i, layers = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, len(model.model.layers)
    dense = sum(p.numel() * 2 for n, p in model.named_parameters() if ".mlp.experts." not in n)
    fmt = s.weight
    elems = 3 * h * i  # gate, up, down
    packed = elems * fmt.element.nbits // 8
    scales = elems // fmt.block_size
    # fp32 scalars per projection: the global weight scale, and a static activation scale
    scalars = 3 * (int(fmt.has_global_scale) + int(s.static_activation_scale)) * 4
    return dense + layers * e * (packed + scales + scalars)


def compare_schemes(
    model,
    schemes: list[MoEQuantScheme],
    token_ids,
    calibration: Calibration | None,
    backend="auto",
    log=print,
    numerics="vllm",
) -> list[dict]:
    """Every scheme on the same model and token ids; metrics against the bf16 model.

    ``schemes``: ``MoEQuantScheme`` objects (``steps.check_schemes`` resolves names). Weights are
    quantized once per weight format and shared by the schemes that use it; on the ``torch`` backend so are
    their dequantized weights (``steps.keep_dequantized``: the outputs are those of dequantizing each time).
    ``calibration`` provides the static input scales of ``nvfp4`` and the ``_a_fp8`` schemes. ``token_ids``: one
    ``[1, T]`` tensor, or a list of them (token sets, ``steps.evaluation_token_sets``): each
    scheme runs on every set. ``numerics``: ``"vllm"`` or ``"hardware"`` (``mxlib.moe.emulation``;
    the hardware numerics run on the ``torch`` or ``fused`` backend).

    Returns:
        One row per scheme: ``scheme, weights, activations, bits_per_weight, checkpoint_gb``, the
        logits metrics ``LOGIT_METRICS`` (the mean over the token sets; the value itself for one),
        ``<metric>_low`` / ``<metric>_high`` (lowest and highest over the sets),
        ``<metric>_repeats`` (one value per set), ``layer_sqnr_db`` (each decoder layer's SQNR,
        mean over the sets) and ``seconds`` (the forwards' total).

    Raises:
        TypeError: an entry of ``schemes`` that is not a ``MoEQuantScheme``.
        ValueError: no token set; an unknown ``numerics``.
    """
    numerics = check_numerics(numerics)
    sets = [token_ids] if isinstance(token_ids, torch.Tensor) else list(token_ids)
    if not sets:
        raise ValueError("token_ids: expected a [1, T] tensor or a list of them, got an empty list")
    by_weight: dict = {}
    for s in schemes:
        if not isinstance(s, MoEQuantScheme):
            raise TypeError(f"schemes: expected MoEQuantScheme objects (steps.check_schemes resolves names), got {s!r}")
        by_weight.setdefault(s.weight, []).append(s)
    refs = [run_model(model, ids) for ids in sets]
    rows = []
    nlayers = len(model.model.layers)
    for weight, group in by_weight.items():
        t0 = time.perf_counter()
        quantized = [quantize_expert_weights(*expert_weights(model, li), weight) for li in range(nlayers)]
        log(f"[compare] quantized {weight.name} weights in {time.perf_counter() - t0:.1f} s")
        kept = [KeptDequantized() for _ in quantized]  # the group's schemes share the dequantized weights
        for s in group:
            experts = []
            for li, q in enumerate(quantized):
                in13 = in2 = None
                if s.static_activation_scale:
                    in13, in2 = (t.to(q.device) for t in calibration.input_scales(li, s.activation))
                experts.append(emulation_experts(s, q, in13, in2, backend, numerics=numerics))
                experts[-1].kept_dequantized = kept[li]
            keep_dequantized(experts)
            results, seconds = [], 0.0
            with experts_swapped(model, experts):
                for ids, ref in zip(sets, refs):
                    out = run_model(model, ids)
                    seconds += out.seconds
                    results.append(compare_runs(out, ref))
            rows.append(_scheme_row(model, s, results, seconds))
            r = rows[-1]
            log(
                f"[compare] {s.name}: logits SQNR {r['sqnr_db']:.2f} dB, top-1 "
                f"{r['top1_agreement']:.3f}, KL {r['kl_divergence']:.2e}"
            )
        del quantized, kept
    return rows


def _scheme_row(model, s: MoEQuantScheme, results: list[dict], seconds: float) -> dict:
    row = dict(
        scheme=s.name,
        weights=s.weight.name,
        activations=s.activation.name if s.activation else "bf16",
        bits_per_weight=s.weight.bits_per_element,
        checkpoint_gb=checkpoint_tensor_bytes(model, s) / 1e9,
    )
    extra = {}
    for k in LOGIT_METRICS:
        vals = [res["logits"][k] for res in results]
        sp = spread(vals, k)
        row[k] = vals[0] if len(vals) == 1 else sp["mean"]
        extra.update({f"{k}_low": sp["low"], f"{k}_high": sp["high"], f"{k}_repeats": vals})
    layers = [[r["sqnr_db"] for r in res["layers"]] for res in results]
    row["layer_sqnr_db"] = layers[0] if len(layers) == 1 else [sum(c) / len(c) for c in zip(*layers)]
    return dict(row, **extra, seconds=seconds)
