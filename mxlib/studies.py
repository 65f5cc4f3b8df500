"""The workbook's studies: every scheme side by side, and NVFP4 scale unification.

``compare_schemes`` quantizes a bf16 model's experts in every MoE scheme (in memory,
one weight format at a time), runs the same token ids through each, and measures
what each costs against bf16.

``unification_study`` measures what the seed's single activation global scale (the max
of the per-expert input scales) costs each expert, against each expert using its own
scale, and against strategies in between: on each expert's own calibration
activations (SQNR, dB lost, subnormal / flushed block scales, clipped elements, the
histogram of e4m3 block-scale codes), on each expert's output, and end to end.
OCP MX (per-32 E8M0 scales, no global scale) is measured beside it.
"""

from __future__ import annotations

import contextlib
import time
import warnings

import torch

from . import reference as R
from .analysis import compare_tensors
from .formats import BLOCK_SCHEMES, NVFP4, NVFP4_SCALE_DIVISOR
from .models.calibration import Calibration
from .models.qwen3 import expert_weights, moe_layers
from .moe.base import TransformersExperts, ops_for_device
from .moe.emulation import ExpertWeights
from .moe.factory import make_emulation_experts, quantize_expert_weights
from .moe.reference_moe import silu_and_mul
from .moe.scales import unify_input_scales
from .moe.schemes import MoEQuantScheme, get_moe_scheme
from .workflow import calibrate_model, compare_runs, dummy_model, run_model

__all__ = [
    "quantize_layer_weights",
    "emulation_experts",
    "experts_swapped",
    "checkpoint_tensor_bytes",
    "compare_schemes",
    "unification_study",
    "spread_study",
]


# the factory's functions under the names the studies (and the GPU tests) have used
quantize_layer_weights = quantize_expert_weights

# the OCP MX schemes unification_study measures beside NVFP4 (names resolved here, once)
_MX_BASELINES = (BLOCK_SCHEMES["mxfp4"], BLOCK_SCHEMES["mxfp8_e4m3"])


def emulation_experts(scheme: str | MoEQuantScheme, q: ExpertWeights, in13=None, in2=None, backend="auto",
                      scale_strategy="max"):
    """``make_emulation_experts`` with the unification warning silenced (the studies measure it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make_emulation_experts(scheme, q, in13, in2, backend=backend, scale_strategy=scale_strategy)


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


def checkpoint_tensor_bytes(model, scheme: str) -> int:
    """Bytes of tensor data a checkpoint of ``scheme`` holds (bf16 non-expert tensors plus the
    per-expert packed weights, scales and scalars), the same tensors ``write_quantized_checkpoint``
    writes; file headers excluded."""
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


def compare_schemes(model, schemes, token_ids, calibration: Calibration | None, backend="auto", log=print) -> list[dict]:
    """Every scheme on the same model and token ids; metrics against the bf16 model.

    Weights are quantized once per weight format and shared by the schemes that use it.
    ``calibration`` provides the static input scales of ``nvfp4`` and the ``_a_fp8`` schemes.
    """
    ref = run_model(model, token_ids)
    rows = []
    by_weight: dict = {}
    for sc in schemes:
        s = get_moe_scheme(sc)
        by_weight.setdefault(s.weight, []).append(s)
    nlayers = len(model.model.layers)
    for weight, group in by_weight.items():
        t0 = time.perf_counter()
        quantized = [quantize_expert_weights(*expert_weights(model, li), weight) for li in range(nlayers)]
        log(f"[compare] quantized {weight.name} weights in {time.perf_counter() - t0:.1f} s")
        for s in group:
            name = s.name
            experts = []
            for li, q in enumerate(quantized):
                in13 = in2 = None
                if s.static_activation_scale:
                    in13, in2 = (t.to(q.device) for t in calibration.input_scales(li, s.activation))
                experts.append(emulation_experts(s, q, in13, in2, backend))
            with experts_swapped(model, experts):
                out = run_model(model, token_ids)
            res = compare_runs(out, ref)
            rows.append(dict(
                scheme=name, weights=s.weight.name, activations=s.activation.name if s.activation else "bf16",
                bits_per_weight=s.weight.bits_per_element,
                checkpoint_gb=checkpoint_tensor_bytes(model, s) / 1e9,
                **res["logits"], layer_sqnr_db=[r["sqnr_db"] for r in res["layers"]], seconds=out.seconds,
            ))
            log(f"[compare] {name}: logits SQNR {res['logits']['sqnr_db']:.2f} dB, top-1 "
                f"{res['logits']['top1_agreement']:.3f}, KL {res['logits']['kl_divergence']:.2e}")
        del quantized
    return rows


# ----------------------------------------------------------------------------- unification


def _segment_sqnr(x: torch.Tensor, y: torch.Tensor, seg: torch.Tensor, n: int) -> torch.Tensor:
    """SQNR (dB) of y vs x per segment id (rows of x and y belong to segment ``seg``)."""
    x, y = x.double(), y.double()
    sig = torch.zeros(n, dtype=torch.float64, device=x.device).index_add_(0, seg, (x * x).sum(-1))
    err = torch.zeros(n, dtype=torch.float64, device=x.device).index_add_(0, seg, ((y - x) ** 2).sum(-1))
    return 10.0 * torch.log10(sig / err)


def _segment_mean(v: torch.Tensor, seg: torch.Tensor, n: int) -> torch.Tensor:
    v = v.double().reshape(v.shape[0], -1).mean(-1)
    tot = torch.zeros(n, dtype=torch.float64, device=v.device).index_add_(0, seg, v)
    cnt = torch.zeros(n, dtype=torch.float64, device=v.device).index_add_(0, seg, torch.ones_like(v))
    return tot / cnt


def unification_study(calibration: Calibration, strategies=("max", "per_expert", "median"), layers=None) -> dict:
    """Per layer and expert, what each activation-scale strategy does to the expert's own
    calibration activations (``calibrate(..., keep_activations=True)``).

    Returns ``{"experts": rows, "histograms": {point: {strategy: counts[127]}}}`` where each row
    holds ``layer, expert, point ("a1" | "a2"), tokens, scale_ratio`` (expert input scale / max),
    and per strategy ``sqnr_<s>`` (dB), ``db_lost_<s>`` (vs per_expert), ``subnormal_<s>``,
    ``flushed_<s>``, ``clipped_<s>`` (fractions), plus ``sqnr_mxfp4`` (OCP MX QDQ, no global scale).
    """
    rows = []
    hist = {p: {s: torch.zeros(127, dtype=torch.int64) for s in strategies} for p in ("a1", "a2")}
    strategies = list(strategies)
    if "per_expert" not in strategies:
        strategies.append("per_expert")
    for li, lc in enumerate(calibration.layers):
        if layers is not None and li not in layers:
            continue
        if lc.a1 is None:
            raise ValueError("unification_study needs calibrate(..., keep_activations=True)")
        k = lc.topk_ids.shape[1]
        seg = lc.topk_ids.reshape(-1).long()
        n = lc.a1_amax.numel()
        points = {"a1": lc.a1.repeat_interleave(k, dim=0), "a2": lc.a2}
        amaxes = {"a1": lc.a1_amax, "a2": lc.a2_amax}
        per_point = {}
        for point, x in points.items():
            x = x.float()
            scales = amaxes[point] / NVFP4_SCALE_DIVISOR
            res = {"scale_ratio": scales / scales.max()}
            for s in strategies:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    gs = unify_input_scales(scales, s, f"{point}_input_scale")[0]
                rows_gs = gs[seg]
                y = R.ref_nvfp4_quant_dequant(x, rows_gs, dtype=torch.float32)
                st = R.nvfp4_block_stats(x, rows_gs)
                res[f"sqnr_{s}"] = _segment_sqnr(x, y, seg, n)
                res[f"subnormal_{s}"] = _segment_mean(st["subnormal"].float(), seg, n)
                res[f"flushed_{s}"] = _segment_mean(st["flushed"].float(), seg, n)
                res[f"clipped_{s}"] = _segment_mean(st["clipped"].float(), seg, n)
                if s in hist[point]:
                    codes = st["scale_code"].reshape(-1).long()
                    hist[point][s] += torch.bincount(codes.clamp(max=126), minlength=127)[:127].cpu()
            for mx in _MX_BASELINES:
                y = R.quant_dequant_mx(x, mx.element, mx.block_size, dtype=torch.float32)
                res[f"sqnr_{mx.name}"] = _segment_sqnr(x, y, seg, n)
            per_point[point] = res
        for point, res in per_point.items():
            for e in range(n):
                if lc.tokens[e] == 0:
                    continue
                row = dict(layer=li, expert=e, point=point, tokens=int(lc.tokens[e]),
                           scale_ratio=float(res["scale_ratio"][e]))
                for key, v in res.items():
                    if key != "scale_ratio":
                        row[key] = float(v[e])
                for s in strategies:
                    row[f"db_lost_{s}"] = row["sqnr_per_expert"] - row[f"sqnr_{s}"]
                rows.append(row)
    return {"experts": rows, "histograms": {p: {s: h.tolist() for s, h in d.items()} for p, d in hist.items()}}


def expert_output_study(model, calibration: Calibration, strategies, layers=(0,)) -> list[dict]:
    """Each expert's output on its own calibration tokens: NVFP4 emulation (weights dequantized,
    a1 and a2 QDQ'd with each strategy's scale) against the bf16 expert; rows hold ``sqnr_<s>``."""
    rows = []
    for li in layers:
        lc = calibration.layers[li]
        w13, w2 = expert_weights(model, li)
        dev = w13.device
        ops = ops_for_device(dev)
        q = quantize_expert_weights(w13, w2, NVFP4)
        d13 = ops.dequantize_to_dtype(q.w13_weight, q.w13_weight_scale, q.w13_weight_scale_2, w13.dtype)
        d2 = ops.dequantize_to_dtype(q.w2_weight, q.w2_weight_scale, q.w2_weight_scale_2, w2.dtype)
        in13, in2 = lc.a1_amax.to(dev) / NVFP4_SCALE_DIVISOR, lc.a2_amax.to(dev) / NVFP4_SCALE_DIVISOR
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gss = {s: (unify_input_scales(in13, s)[0], unify_input_scales(in2, s)[0]) for s in strategies}
        k = lc.topk_ids.shape[1]
        flat = lc.topk_ids.reshape(-1).long()
        for e in torch.unique(flat).tolist():
            pairs = (flat == e).nonzero().squeeze(1)
            x = lc.a1[pairs // k].to(dev)
            ref = silu_and_mul((x.float() @ w13[e].float().T).to(x.dtype)).float() @ w2[e].float().T
            row = dict(layer=li, expert=e, tokens=int(pairs.numel()), scale_ratio_a1=float(in13[e] / in13.max()),
                       scale_ratio_a2=float(in2[e] / in2.max()))
            for s, (g13, g2) in gss.items():
                xa = ops.ref_nvfp4_quant_dequant(x, g13[e].reshape(1))
                h = silu_and_mul((xa.float() @ d13[e].float().T).to(x.dtype))
                h = ops.ref_nvfp4_quant_dequant(h, g2[e].reshape(1))
                row[f"sqnr_{s}"] = compare_tensors(h.float() @ d2[e].float().T, ref)["sqnr_db"]
            rows.append(row)
    return rows


def end_to_end_strategies(model, calibration: Calibration, strategies, token_ids, backend="auto") -> list[dict]:
    """Logits and per-layer errors of the NVFP4-emulated model under each strategy."""
    ref = run_model(model, token_ids)
    nl = len(model.model.layers)
    scheme = get_moe_scheme(NVFP4.name)
    quantized = [quantize_expert_weights(*expert_weights(model, li), scheme) for li in range(nl)]
    rows = []
    for s in strategies:
        experts = []
        for li, q in enumerate(quantized):
            in13, in2 = (t.to(q.device) for t in calibration.input_scales(li, scheme.activation))
            experts.append(emulation_experts(scheme, q, in13, in2, backend, scale_strategy=s))
        with experts_swapped(model, experts):
            out = run_model(model, token_ids)
        res = compare_runs(out, ref)
        rows.append(dict(strategy=s, **res["logits"], layer_sqnr_db=[r["sqnr_db"] for r in res["layers"]]))
    return rows


def spread_study(spreads, num_hidden_layers=1, seed=0, calib_tokens=256, device="cpu",
                 model_preset: str = "qwen3-30b-a3b") -> list[dict]:
    """dB lost by ``max`` against ``per_expert`` (a1 and a2) as the per-expert weight spread grows.

    For each ``expert_spread`` in ``spreads``: a dummy model of ``model_preset`` (a key of
    ``mxlib.models.qwen3.MODEL_PRESETS``, passed to ``workflow.dummy_model``) with
    ``num_hidden_layers`` layers, calibrated on ``calib_tokens`` tokens, through
    ``unification_study``. Rows: ``spread, point ("a1" | "a2"), mean_db_lost, max_db_lost``
    (dB) and ``median_scale_ratio`` (expert input scale / max).
    """
    rows = []
    for sp in spreads:
        m = dummy_model(num_hidden_layers, seed=seed, expert_spread=sp, device=device, model_preset=model_preset)
        cal = calibrate_model(m, calib_tokens, seed, keep_activations=True)
        st = unification_study(cal, ("max", "per_expert"))
        for point in ("a1", "a2"):
            lost = [r["db_lost_max"] for r in st["experts"] if r["point"] == point]
            ratios = [r["scale_ratio"] for r in st["experts"] if r["point"] == point]
            rows.append(dict(spread=sp, point=point, mean_db_lost=sum(lost) / len(lost), max_db_lost=max(lost),
                             median_scale_ratio=sorted(ratios)[len(ratios) // 2]))
        del m, cal
    return rows
