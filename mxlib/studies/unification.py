"""The workbook's studies: every scheme side by side, and NVFP4 scale unification.

``compare_schemes`` (``mxlib.studies.scheme_study``, re-exported here) quantizes a bf16 model's
experts in every MoE scheme (in memory, one weight format at a time), runs the same token ids
through each, and measures what each costs against bf16.

``unification_study`` measures what vLLM's single activation global scale (the max
of the per-expert input scales) costs each expert, against each expert using its own
scale, and against strategies in between: on each expert's own calibration
activations (SQNR, dB lost, subnormal / flushed block scales, clipped elements, the
histogram of e4m3 block-scale codes), on each expert's output, and end to end.
OCP MX (per-32 E8M0 scales, no global scale) is measured beside it.

``vllm_vs_hardware_study`` runs one scheme's experts in vLLM's numerics and in the hardware
mode (``mxlib.moe.emulation``) and measures, per MoE layer, each against a float64 MoE built from
the same quantized operands (``fp64_moe``), and the logits of the two modes against each other.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings

import torch

from .. import reference as R
from ..analysis import compare_tensors, rel_error, sqnr_db, top1_agreement
from ..formats import BLOCK_SCHEMES, NVFP4, NVFP4_SCALE_DIVISOR, BlockScheme
from ..models.calibration import Calibration
from ..models.qwen3 import expert_weights, moe_layers
from ..moe.base import ops_for_device
from ..moe.factory import make_emulation_experts, quantize_expert_weights
from ..moe.reference_moe import silu_and_mul
from ..moe.scales import unify_input_scales
from ..moe.schemes import NVFP4_MOE, MoEQuantScheme, get_moe_scheme
from .scheme_study import (
    _let_go,
    _scheme_experts,
    checkpoint_tensor_bytes,
    compare_schemes,
    emulation_experts,
    experts_swapped,
    reference_run,
    run_variants_layerwise,
)
from .steps import calibrate_model, compare_runs, dummy_model, run_model

__all__ = [
    "emulation_experts",
    "experts_swapped",
    "checkpoint_tensor_bytes",
    "compare_schemes",
    "unification_study",
    "end_to_end_strategies",
    "end_to_end_strategies_sets",
    "spread_study",
    "exact_block_weights",
    "exact_activation_qdq",
    "fp64_moe",
    "vllm_vs_hardware_study",
]


# the OCP MX schemes unification_study measures beside NVFP4 (names resolved here, once)
_MX_BASELINES = (BLOCK_SCHEMES["mxfp4"], BLOCK_SCHEMES["mxfp8_e4m3"])


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
                row = dict(
                    layer=li, expert=e, point=point, tokens=int(lc.tokens[e]), scale_ratio=float(res["scale_ratio"][e])
                )
                for key, v in res.items():
                    if key != "scale_ratio":
                        row[key] = float(v[e])
                for s in strategies:
                    row[f"db_lost_{s}"] = row["sqnr_per_expert"] - row[f"sqnr_{s}"]
                rows.append(row)
    return {"experts": rows, "histograms": {p: {s: h.tolist() for s, h in d.items()} for p, d in hist.items()}}


def _bits(t: torch.Tensor) -> bytes:
    """A tensor's bytes: a key equal for two tensors exactly when their bits are (NaN and -0 included)."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes()


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
            row = dict(
                layer=li,
                expert=e,
                tokens=int(pairs.numel()),
                scale_ratio_a1=float(in13[e] / in13.max()),
                scale_ratio_a2=float(in2[e] / in2.max()),
            )
            # the expert's weights in fp32 once for every strategy; strategies that give this expert the same
            # global scales (bit for bit) share each step computed from them: the same operands, the same result
            d13e, d2e = d13[e].float(), d2[e].float()
            gemm1: dict = {}
            sqnr: dict = {}
            for s, (g13, g2) in gss.items():
                k13, k2 = _bits(g13[e]), _bits(g2[e])
                if k13 not in gemm1:
                    xa = ops.ref_nvfp4_quant_dequant(x, g13[e].reshape(1))
                    gemm1[k13] = silu_and_mul((xa.float() @ d13e.T).to(x.dtype))
                if (k13, k2) not in sqnr:
                    h = ops.ref_nvfp4_quant_dequant(gemm1[k13], g2[e].reshape(1))
                    sqnr[k13, k2] = compare_tensors(h.float() @ d2e.T, ref)["sqnr_db"]
                row[f"sqnr_{s}"] = sqnr[k13, k2]
            rows.append(row)
    return rows


def end_to_end_strategies(model, calibration: Calibration, strategies, token_ids, backend="auto") -> list[dict]:
    """Logits and per-layer errors of the NVFP4-emulated model under each strategy, on one token set
    (``end_to_end_strategies_sets`` with one set)."""
    return end_to_end_strategies_sets(model, calibration, strategies, [token_ids], backend)[0]


def end_to_end_strategies_sets(model, calibration: Calibration, strategies, token_sets, backend="auto") -> list:
    """``end_to_end_strategies`` on each token set of ``token_sets`` (each ``[1, T]``): the weights are
    quantized to NVFP4 once, and on the ``torch`` backend each layer's weights are dequantized once for every
    strategy and set (``scheme_study.run_variants_layerwise``; the strategies change the activation scales only),
    with outputs bit for bit those of one forward per strategy and set. Returns one list of rows
    per set: ``strategy``, the logits metrics of ``analysis.compare_logits``, ``layer_sqnr_db``."""
    nl = len(model.model.layers)
    scheme = NVFP4_MOE
    ref_runs = [reference_run(model, ids) for ids in token_sets]
    refs, inputs = [r for r, _ in ref_runs], [i for _, i in ref_runs]
    quantized = [quantize_expert_weights(*expert_weights(model, li), scheme) for li in range(nl)]
    variants = [_scheme_experts(scheme, quantized, calibration, backend, "vllm", scale_strategy=s) for s in strategies]
    outs = run_variants_layerwise(model, inputs, [v for v, _ in variants], after_layer=_let_go(variants))
    rows: list[list[dict]] = [[] for _ in token_sets]
    for s, runs in zip(strategies, outs):
        for k, (out, ref) in enumerate(zip(runs, refs)):
            res = compare_runs(out, ref)
            rows[k].append(dict(strategy=s, **res["logits"], layer_sqnr_db=[r["sqnr_db"] for r in res["layers"]]))
    return rows


def spread_study(
    spreads, num_hidden_layers=1, seed=0, calib_tokens=256, device="cpu", model_preset: str = "qwen3-30b-a3b"
) -> list[dict]:
    """dB lost by ``max`` against ``per_expert`` (a1 and a2) as the per-expert weight spread grows.

    For each ``expert_spread`` in ``spreads``: a dummy model of ``model_preset`` (a key of
    ``mxlib.models.qwen3.MODEL_PRESETS``, passed to ``steps.dummy_model``) with
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
            rows.append(
                dict(
                    spread=sp,
                    point=point,
                    mean_db_lost=sum(lost) / len(lost),
                    max_db_lost=max(lost),
                    median_scale_ratio=sorted(ratios)[len(ratios) // 2],
                )
            )
        del m, cal
    return rows


# ----------------------------------------------------------------------------- vLLM vs hardware numerics


def exact_block_weights(experts, which: str) -> torch.Tensor:
    """One weight of quantized emulation experts, dequantized exactly: float64 ``[E, n, k]``.

    ``element * block_scale * global_scale`` with every factor decoded from the stored
    operands (``{which}_weight``, ``{which}_weight_scale``, and for NVFP4 the per-expert
    ``{which}_weight_scale_2``, ``[E]`` or ``[E, 2]`` for gate and up): a product of at most
    2 + 4 + 24 significant bits, exact in float64.

    Args:
        experts: a ``QuantizedExperts`` (``mxlib.moe.emulation``).
        which: ``"w13"`` or ``"w2"``.
    """
    if which not in ("w13", "w2"):
        raise ValueError(f"which: expected 'w13' or 'w2', got {which!r}")
    fmt = experts.weight_scheme
    values = R.decode_element(
        R.unpack_codes(experts.checkpoint_packed(f"{which}_weight"), fmt.element), fmt.element
    ).double()
    scale = getattr(experts, f"{which}_weight_scale")
    scale = R.decode_e8m0(scale) if scale.dtype == torch.uint8 else scale.float()
    e, n, k = values.shape
    w = (values.reshape(e, n, k // fmt.block_size, fmt.block_size) * scale.double().unsqueeze(-1)).reshape(e, n, k)
    g = getattr(experts, f"{which}_weight_scale_2", None)
    if g is not None:
        g = g.double()
        if getattr(experts, "global_scale_kind", "decode") == "encode":
            g = 1.0 / g
        g = g.repeat_interleave(n // 2, dim=1) if g.ndim == 2 else g[:, None].expand(e, n)
        w = w * g[:, :, None]
    return w


def exact_activation_qdq(x: torch.Tensor, qdq) -> torch.Tensor:
    """The activation QDQ of an emulation (``experts.a1_qdq()`` / ``a2_qdq()``), its value exact in float64.

    The quantization decisions (element codes, block scales) are vLLM's arithmetic on ``x``
    (``mxlib.reference``); the dequantized value ``element * block_scale / global_scale``
    (NVFP4) or ``element * 2**e`` (OCP MX) is formed in float64 without rounding. ``qdq.fmt`` None:
    ``x`` unchanged. A float64 ``x`` is decided on its fp32 rounding (the reference functions take
    fp32, bf16 or fp16).

    Raises:
        ValueError: a per-tensor FP8 activation (its operand is vLLM's in both numerics modes,
            so this study does not apply), or NVFP4 with more than one global scale (per-expert
            scales: the study needs ``scale_strategy="max"``).
    """
    fmt = qdq.fmt
    if fmt is None:
        return x.double()
    if x.dtype == torch.float64:
        x = x.float()
    if not isinstance(fmt, BlockScheme):
        raise ValueError(
            f"activation format {fmt}: a per-tensor FP8 operand is the same in both numerics "
            f"modes; expected NVFP4, an OCP MX block format or none"
        )
    if fmt.has_global_scale:
        if qdq.scale.numel() != 1:
            raise ValueError(
                f"activation global scale: expected one for all experts (scale_strategy 'max'), got {qdq.scale.numel()}"
            )
        el, s = R.ref_nvfp4_quant(x, qdq.scale.reshape(1), fmt.block_size)
        return el.double() * s.double().repeat_interleave(fmt.block_size, dim=-1) / qdq.scale.double().reshape(())
    return R.quant_dequant_mx(x, fmt.element, fmt.block_size, qdq.scale_mode, dtype=torch.float32).double()


@torch.no_grad()
def fp64_moe(x, w13, w2, topk_weights, topk_ids, a1_qdq, a2_qdq, round_dtype=torch.bfloat16):
    """The MoE function in float64 on given operands: the reference of ``vllm_vs_hardware_study``.

    ``out[t] = sum_j w_tj * w2[e] @ a2_qdq(silu(gate) * up)``, ``[gate; up] = w13[e] @ a1_qdq(x[t])``
    with float64 GEMMs and sums. ``round_dtype`` (default bf16) rounds GEMM1's output and the
    SiLU-and-mul output where every emulation path materializes them in the activation dtype
    (``mxlib.moe.base``): those two roundings are part of the function the modes compute, not of
    how they compute it. None keeps both in float64 (the quantized MoE with no rounding but the
    quantizers').

    Args:
        x: ``[M, H]`` layer input; w13 ``[E, 2I, H]``, w2 ``[E, H, I]`` (float64 operands);
        topk_weights, topk_ids: ``[M, k]``;
        a1_qdq: ``x -> float64 [M, H]``; a2_qdq: ``(a2 [n, I], expert) -> float64 [n, I]``.

    Returns:
        ``(out float64 [M, H], a2_input [M * k, I])``: the output and the SiLU-and-mul output
        before its QDQ, row ``t * k + j`` for token t's j-th expert.
    """
    m, k = topk_ids.shape
    i = w2.shape[-1]
    a1 = a1_qdq(x)
    flat = topk_ids.reshape(-1).long()
    tw = topk_weights.reshape(-1).double()
    out = torch.zeros(m * k, w2.shape[1], dtype=torch.float64, device=x.device)
    a2_in = torch.zeros(m * k, i, dtype=round_dtype or torch.float64, device=x.device)
    for e in torch.unique(flat).tolist():
        pairs = (flat == e).nonzero().squeeze(1)
        h = a1[pairs // k] @ w13[e].T
        if round_dtype is None:
            act = torch.nn.functional.silu(h[:, :i]) * h[:, i:]
        else:
            act = silu_and_mul(h.to(round_dtype))
        a2_in[pairs] = act
        out[pairs] = (a2_qdq(act, e) @ w2[e].T) * tw[pairs, None]
    return out.view(m, k, -1).sum(dim=1), a2_in


@torch.no_grad()
def _run_recording_a2(experts, x, topk_weights, topk_ids):
    """``experts(x, ...)`` and the SiLU-and-mul output it quantized, rows in pair order ``t * k + j``.

    The ``torch`` backend calls ``quantize_intermediate`` once per expert hit, in ascending
    expert order, each with that expert's pairs in ascending order (``reference_moe.torch_moe``)."""
    rec = []
    orig = experts.quantize_intermediate

    def record(a2, row_experts, backend):
        rec.append(a2)
        return orig(a2, row_experts, backend)

    experts.quantize_intermediate = record
    try:
        out = experts(x, topk_weights, topk_ids)
    finally:
        del experts.quantize_intermediate
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    a2 = torch.empty(flat.numel(), rec[0].shape[1], dtype=rec[0].dtype, device=x.device)
    a2[order] = torch.cat(rec)
    return out, a2


@contextlib.contextmanager
def _experts_dequantized_once(experts: list):
    """Each expert's weights dequantized once while the context lasts (``keep_dequantized``), then let go."""
    before = [ex.keep_dequantized for ex in experts]
    for ex in experts:
        ex.keep_dequantized = True
    try:
        yield
    finally:
        for ex, b in zip(experts, before):
            ex.keep_dequantized = b
            if not b:
                ex.kept_dequantized = None


@torch.no_grad()
def _run_capturing(model, experts: list, token_ids):
    """Logits and, per MoE layer, the experts' inputs and output (forward hooks on each MoE block's experts)."""
    captured = []

    def hook(mod, args, kwargs, out):
        bound = inspect.signature(mod.forward).bind(*args, **kwargs)
        a = bound.arguments
        captured.append(
            dict(
                x=a["hidden_states"].detach(),
                topk_ids=a["top_k_index"].to(torch.int32),
                topk_weights=a["top_k_weights"].float(),
                out=out.detach(),
            )
        )

    with experts_swapped(model, experts):
        hooks = [mlp.experts.register_forward_hook(hook, with_kwargs=True) for mlp in moe_layers(model)]
        try:
            res = run_model(model, token_ids)
        finally:
            for h in hooks:
                h.remove()
    return res.logits, captured


def _pair_metrics(prefix: str, x: torch.Tensor, ref: torch.Tensor) -> dict:
    return {f"{prefix}_sqnr_db": sqnr_db(x, ref), f"{prefix}_rel_error": rel_error(x, ref)}


def vllm_vs_hardware_study(
    model,
    scheme: str | MoEQuantScheme,
    token_ids: torch.Tensor,
    calibration: Calibration | None = None,
    bf16_logits: torch.Tensor | None = None,
) -> dict:
    """How far vLLM's numerics move each MoE layer and the logits against the hardware mode.

    The bf16 ``model``'s experts are quantized in ``scheme`` and run twice on the pure-PyTorch
    backend: with ``numerics="vllm"`` (vLLM's emulation: weights dequantized to
    ``bf16(element * (block_scale * global_scale))``, activations to ``bf16(element * (s / gs))``)
    and ``numerics="hardware"`` (operands ``element * block_scale``, exact in bf16; the per-tensor
    scales on the fp32 GEMM outputs), ``mxlib.moe.emulation``. Forward hooks on each MoE block's
    experts capture their inputs in the vLLM run; on those same inputs, each layer is then
    computed in both modes and by ``fp64_moe`` on the exact operands (``exact_block_weights``,
    ``exact_activation_qdq``: the same codes and scales, no rounding but the bf16 GEMM1 and
    SiLU-and-mul outputs both modes materialize). A second float64 MoE built from vLLM's
    rounded bf16 operands is a negative control: vLLM's must be the closer mode there.

    Args:
        model: the bf16 dummy Qwen3-MoE (``steps.dummy_model``), its bf16 experts in place.
        scheme: NVFP4 or an OCP MX scheme with MX or no activation QDQ (not ``_a_fp8``): a
            ``MoEQuantScheme``, or its name (resolved here, once).
        token_ids: ``[1, T]``.
        calibration: static input scales (``steps.calibrate_model``), required for NVFP4.
        bf16_logits: the bf16 model's logits on ``token_ids`` (``run_model(model, token_ids).logits``)
            when the caller has them (one run serves several schemes); None runs the model.

    Returns:
        ``{"scheme", "num_tokens", "layers": rows, "logits": {...}}``. Per MoE layer (same input
        to every computation): ``{vllm,hw}_vs_ref_{sqnr_db,rel_error}`` and ``vllm_vs_hw_*``
        (the layer output), ``a2_input_{vllm,hw}_vs_ref_sqnr_db`` (the SiLU-and-mul output before
        its QDQ), ``a2_input_changed`` and ``a2_changed`` (fractions of a2 elements whose bf16
        input, resp. quantized value, differ between the modes), ``e2e_vllm_vs_hw_sqnr_db`` (the
        layer's output in the two whole-model runs, errors of earlier layers included) and
        ``control_{vllm,hw}_sqnr_db`` (against the vLLM-operand float64 MoE). ``logits``:
        ``vllm_vs_hw_sqnr_db``, ``top1_agreement``, ``max_abs_diff``, and ``{vllm,hw}_vs_bf16_sqnr_db``,
        ``{vllm,hw}_top1_vs_bf16``. SQNR in dB (+inf: equal), differences in logit units.

    Raises:
        ValueError: an ``_a_fp8`` scheme; NVFP4 without ``calibration``.
    """
    s = get_moe_scheme(scheme)
    if s.activation is not None and not isinstance(s.activation, BlockScheme):
        raise ValueError(
            f"scheme: {s.name} has per-tensor FP8 activations, the same operand in both numerics "
            f"modes; expected nvfp4 or an OCP MX scheme with MX or no activation QDQ"
        )
    if s.static_activation_scale and calibration is None:
        raise ValueError(f"calibration: {s.name} needs static input scales (steps.calibrate_model), got None")
    nl = len(model.model.layers)
    quantized = [quantize_expert_weights(*expert_weights(model, li), s) for li in range(nl)]
    modes = {}
    for numerics in ("vllm", "hardware"):
        experts = []
        for li, q in enumerate(quantized):
            in13 = in2 = None
            if s.static_activation_scale:
                in13, in2 = (t.to(q.device) for t in calibration.input_scales(li, s.activation))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the activation scales' unification warning
                experts.append(make_emulation_experts(s, q, in13, in2, backend="torch", numerics=numerics))
        modes[numerics] = experts
    with _experts_dequantized_once(modes["vllm"] + modes["hardware"]):
        return _vllm_vs_hardware_rows(s, model, modes, token_ids, bf16_logits)


def _vllm_vs_hardware_rows(s, model, modes, token_ids, bf16_logits) -> dict:
    nl = len(model.model.layers)
    if bf16_logits is None:
        bf16_logits = run_model(model, token_ids).logits
    vllm_logits, vllm_cap = _run_capturing(model, modes["vllm"], token_ids)
    hw_logits, hw_cap = _run_capturing(model, modes["hardware"], token_ids)
    rows = []
    for li in range(nl):
        c = vllm_cap[li]
        x, tw, ti = c["x"], c["topk_weights"], c["topk_ids"]
        vllm_ex, hw_ex = modes["vllm"][li], modes["hardware"][li]
        vllm_out, vllm_a2 = _run_recording_a2(vllm_ex, x, tw, ti)
        hw_out, hw_a2 = _run_recording_a2(hw_ex, x, tw, ti)
        a1q, a2q = vllm_ex.a1_qdq(), vllm_ex.a2_qdq()
        ref, ref_a2 = fp64_moe(
            x,
            exact_block_weights(vllm_ex, "w13"),
            exact_block_weights(vllm_ex, "w2"),
            tw,
            ti,
            lambda v: exact_activation_qdq(v, a1q),
            lambda v, e: exact_activation_qdq(v, a2q),
        )
        d13, d2 = vllm_ex.dequantized_weights()  # vLLM's bf16 operands
        ctl, _ = fp64_moe(
            x,
            d13.double(),
            d2.double(),
            tw,
            ti,
            lambda v: vllm_ex.quantize_input(v, ti, "torch")[0].double(),
            lambda v, e: vllm_ex.quantize_intermediate(
                v, torch.full((v.shape[0],), e, device=v.device), "torch"
            ).double(),
        )
        q_vllm, q_hw = exact_activation_qdq(vllm_a2, a2q), exact_activation_qdq(hw_a2, a2q)
        rows.append(
            dict(
                layer=li,
                **_pair_metrics("vllm_vs_ref", vllm_out, ref),
                **_pair_metrics("hw_vs_ref", hw_out, ref),
                **_pair_metrics("vllm_vs_hw", vllm_out, hw_out),
                a2_input_vllm_vs_ref_sqnr_db=sqnr_db(vllm_a2, ref_a2),
                a2_input_hw_vs_ref_sqnr_db=sqnr_db(hw_a2, ref_a2),
                a2_input_changed=(vllm_a2 != hw_a2).double().mean().item(),
                a2_changed=(q_vllm != q_hw).double().mean().item(),
                e2e_vllm_vs_hw_sqnr_db=sqnr_db(vllm_cap[li]["out"], hw_cap[li]["out"]),
                control_vllm_sqnr_db=sqnr_db(vllm_out, ctl),
                control_hw_sqnr_db=sqnr_db(hw_out, ctl),
            )
        )
    logits = dict(
        vllm_vs_hw_sqnr_db=sqnr_db(vllm_logits, hw_logits),
        top1_agreement=top1_agreement(vllm_logits, hw_logits),
        max_abs_diff=(vllm_logits.double() - hw_logits.double()).abs().max().item(),
        vllm_vs_bf16_sqnr_db=sqnr_db(vllm_logits, bf16_logits),
        hw_vs_bf16_sqnr_db=sqnr_db(hw_logits, bf16_logits),
        vllm_top1_vs_bf16=top1_agreement(vllm_logits, bf16_logits),
        hw_top1_vs_bf16=top1_agreement(hw_logits, bf16_logits),
    )
    return {"scheme": s.name, "num_tokens": int(token_ids.numel()), "layers": rows, "logits": logits}
