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
from dataclasses import dataclass, field

import torch

from ..models.calibration import Calibration
from ..models.moe_models import moe_blocks
from ..models.qwen3 import expert_weights, moe_layers
from ..moe.base import TransformersExperts
from ..moe.emulation import ExpertWeights, KeptDequantized
from ..moe.factory import make_emulation_experts, quantize_expert_weights
from ..moe.schemes import MoEQuantScheme, get_moe_scheme
from .repeats import spread
from .steps import RunOutput, check_numerics, compare_runs, keep_dequantized, run_model

__all__ = [
    "emulation_experts",
    "experts_swapped",
    "checkpoint_tensor_bytes",
    "compare_schemes",
    "LayerInputs",
    "reference_run",
    "run_variants_layerwise",
    "LOGIT_METRICS",
]

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


@dataclass
class LayerInputs:
    """What a model's forward on one token set hands its decoder layers, apart from the hidden states:
    ``hidden`` (the first layer's input, ``[B, T, H]``: the embeddings) and, per decoder layer, the
    other positional arguments and the keyword arguments (mask, position embeddings, ...) of its call.
    None of it depends on the experts: ``reference_run`` records it, ``run_variants_layerwise`` replays it."""

    hidden: torch.Tensor
    calls: list[tuple[tuple, dict]] = field(default_factory=list)


@torch.no_grad()
def reference_run(model, token_ids) -> tuple[RunOutput, LayerInputs]:
    """``run_model(model, token_ids)`` and the ``LayerInputs`` of that forward (forward pre-hooks on the
    decoder layers; the model is not changed)."""
    layers = model.model.layers
    calls: list = [None] * len(layers)

    def capture(i):
        def hook(mod, args, kwargs):
            if "hidden_states" in kwargs:
                kwargs = dict(kwargs)
                h = kwargs.pop("hidden_states")
            else:
                h, args = args[0], args[1:]
            calls[i] = (h, args, kwargs)

        return hook

    hooks = [layer.register_forward_pre_hook(capture(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        out = run_model(model, token_ids)
    finally:
        for h in hooks:
            h.remove()
    return out, LayerInputs(calls[0][0], [(a, k) for _, a, k in calls])


@torch.no_grad()
def run_variants_layerwise(model, inputs: list[LayerInputs], variants: list[list], after_layer=None) -> list:
    """Every variant of the model's experts on every token set, one decoder layer at a time.

    ``variants``: per variant, one experts object per MoE layer (as ``experts_swapped`` takes them);
    ``inputs``: one ``LayerInputs`` per token set (``reference_run``). Each decoder layer runs every
    (variant, token set) in turn with that variant's experts in place, on the same call arguments the
    model's own forward passes it; after the j-th MoE layer ``after_layer(j)`` is called (a study lets go
    of what it kept for that layer there); after the last layer the model's final norm and ``lm_head``.
    The same operations on the same operands as ``run_model`` with each variant swapped in, so the
    outputs are bit for bit those; the layer-major order lets one layer's dequantized weights serve
    every variant and token set while they are held. Returns ``out[variant][set]`` (``RunOutput``,
    ``seconds`` the variant's layer and head time on that set).
    """
    layers = model.model.layers
    blocks = dict(moe_blocks(model, "run_variants_layerwise"))
    moe_index = {li: j for j, li in enumerate(blocks)}
    for v in variants:
        if len(v) != len(blocks):
            raise ValueError(f"variants: expected {len(blocks)} experts objects per variant (MoE layers), got {len(v)}")
    hidden = [[inp.hidden for inp in inputs] for _ in variants]
    outs = [[RunOutput() for _ in inputs] for _ in variants]
    dev = inputs[0].hidden.device if inputs else None
    for li, layer in enumerate(layers):
        block = blocks.get(li)
        original = block.experts if block is not None else None
        try:
            for v, variant in enumerate(variants):
                if block is not None:
                    block.experts = TransformersExperts(variant[moe_index[li]])
                for k, inp in enumerate(inputs):
                    args, kwargs = inp.calls[li]
                    t0 = _tick(dev)
                    o = layer(hidden[v][k], *args, **kwargs)
                    outs[v][k].seconds += _tick(dev) - t0
                    h = o[0] if isinstance(o, tuple) else o
                    outs[v][k].layer_outputs.append(h[0].float().cpu())
                    hidden[v][k] = h
        finally:
            if block is not None:
                block.experts = original
        if after_layer is not None and block is not None:
            after_layer(moe_index[li])
    for v in range(len(variants)):
        for k in range(len(inputs)):
            t0 = _tick(dev)
            logits = model.lm_head(model.model.norm(hidden[v][k]))
            outs[v][k].seconds += _tick(dev) - t0
            outs[v][k].logits = logits[0].float().cpu()
            hidden[v][k] = None
    return outs


def _tick(dev) -> float:
    if dev is not None and dev.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


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
    quantized once per weight format and shared by the schemes that use it; the schemes of one weight format
    and the token sets run layer by layer (``run_variants_layerwise``), so that on the ``torch`` backend each layer's
    weights are dequantized (to fp32, as its GEMMs read them) once for all of them and let go after the layer; the
    outputs are bit for bit those of one forward per scheme and set, dequantizing each time.
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
    ref_runs = [reference_run(model, ids) for ids in sets]
    refs, inputs = [r for r, _ in ref_runs], [i for _, i in ref_runs]
    rows = []
    nlayers = len(model.model.layers)
    for weight, group in by_weight.items():
        t0 = time.perf_counter()
        quantized = [quantize_expert_weights(*expert_weights(model, li), weight) for li in range(nlayers)]
        log(f"[compare] quantized {weight.name} weights in {time.perf_counter() - t0:.1f} s")
        variants = [_scheme_experts(s, quantized, calibration, backend, numerics) for s in group]
        outs = run_variants_layerwise(model, inputs, [v for v, _ in variants], after_layer=_let_go(variants))
        for s, runs in zip(group, outs):
            results = [compare_runs(out, ref) for out, ref in zip(runs, refs)]
            rows.append(_scheme_row(model, s, results, sum(out.seconds for out in runs)))
            r = rows[-1]
            log(
                f"[compare] {s.name}: logits SQNR {r['sqnr_db']:.2f} dB, top-1 "
                f"{r['top1_agreement']:.3f}, KL {r['kl_divergence']:.2e}"
            )
        del quantized, variants, outs
    return rows


def _scheme_experts(s: MoEQuantScheme, quantized: list, calibration, backend, numerics, scale_strategy="max"):
    """One scheme's experts per layer from weights quantized once per format, and the stores of their kept
    dequantized weights: on the ``torch`` backend each layer's experts of every scheme of one weight format
    share a ``KeptDequantized`` keeping fp32 (``run_variants_layerwise`` runs a layer for all of them at once;
    ``_let_go`` empties it after the layer)."""
    experts = []
    for li, q in enumerate(quantized):
        in13 = in2 = None
        if s.static_activation_scale:
            in13, in2 = (t.to(q.device) for t in calibration.input_scales(li, s.activation))
        experts.append(emulation_experts(s, q, in13, in2, backend, scale_strategy=scale_strategy, numerics=numerics))
    keep_dequantized(experts)
    return experts, quantized


def _let_go(variants: list):
    """``run_variants_layerwise``'s ``after_layer``: share one fp32 store per layer among the variants built
    from the same quantized weights, and empty it once the layer has run."""
    stores: dict = {}
    for experts, quantized in variants:
        for li, ex in enumerate(experts):
            if ex.keep_dequantized:
                key = (id(quantized[li]), li)
                ex.kept_dequantized = stores.setdefault(key, KeptDequantized(torch.float32))

    def after_layer(li: int) -> None:
        for (_, layer), store in stores.items():
            if layer == li:
                store.clear()

    return after_layer


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
