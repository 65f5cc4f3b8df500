"""Gate/up ``weight_scale_2`` reconciliation, for NVFP4 checkpoints whose gate and up halves carry different ones.

ModelOpt stores one ``weight_scale_2`` per projection (``gate_proj``, ``up_proj``); its exporter gives
gate and up the same one so that they can be fused into w13, but checkpoints exist where they differ
(vllm-project/vllm#54974 on GitHub: 69.1% of 12,384 pairs in one GLM checkpoint, ratio up to 10; the producer-side
cause is ModelOpt #1411). mxlib's loader reads them as ``w13_weight_scale_2 [E, 2]``. A fused w13
kernel takes one global scale per expert, so a consumer must choose (``GATE_UP_MODES``):

* ``"per_half"`` (mxlib's default): each half dequantized with its own scale, the values the producer
  wrote. ``reconcile_gate_up`` returns the weights as they are; the experts dequantize the halves
  separately (``Nvfp4QuantizationEmulationTritonExperts``).
* ``"gate"``: vLLM's behaviour, bit for bit. ``ModelOptNvFp4FusedMoE.process_weights_after_loading``
  (vllm/model_executor/layers/quantization/modelopt.py) warns "w1_weight_scale_2 must match
  w3_weight_scale_2. Accuracy may be affected." when ``torch.allclose`` fails and keeps
  ``w13_weight_scale_2[:, 0]`` (the gate's) for the whole of w13; the emulation then dequantizes the up
  half as ``e2m1 * (block_scale * gs_gate)``: the up half's contribution scaled by ``gs_gate / gs_up``.
  (#54974: the same column-0 line is in vLLM's ``quark/quark_moe.py`` and
  ``compressed_tensors_moe_w4a4_nvfp4.py``.)
* ``"requantize_max"``: both halves onto the larger scale ``gs = max(gs_gate, gs_up)`` (decode form;
  the smaller encode scale for compressed-tensors' encode form), the smaller half's e4m3 block scales
  rescaled ``e4m3(fp32(block_scale) * fp32(gs_half / gs))`` (round to nearest even; the factor is
  <= 1, so nothing saturates, small scales may become subnormal or 0) and its FP4 codes left as they
  are: the policy of vLLM PR #55073 (open) and #56095 (closed), TensorRT-LLM PR #14199, the NVFP4 form
  of vLLM's FP8 ``requantize_with_max_scale``. The loss is the e4m3 rounding of the rescaled block scales.

``gate_up_errors`` measures each mode's weight error and layer output error on a layer's weights.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import torch

from .. import reference as _ref
from ..formats import NVFP4
from ..moe.base import TritonExperts
from ..moe.emulation import ExpertWeights
from ..moe.factory import make_emulation_experts
from ..moe.schemes import NVFP4_MOE

__all__ = ["GATE_UP_MODES", "check_gate_up_mode", "reconcile_gate_up", "gate_up_errors"]

GATE_UP_MODES = ("per_half", "gate", "requantize_max")
# vLLM's warning text (ModelOptNvFp4FusedMoE.process_weights_after_loading)
VLLM_GATE_UP_WARNING = "w1_weight_scale_2 must match w3_weight_scale_2. Accuracy may be affected."


def check_gate_up_mode(mode: str) -> str:
    """``mode`` if it is one of ``GATE_UP_MODES``; ValueError naming them otherwise."""
    if mode not in GATE_UP_MODES:
        raise ValueError(f"gate_up_scale: expected one of {list(GATE_UP_MODES)}, got {mode!r}")
    return mode


def reconcile_gate_up(weights: ExpertWeights, mode: str = "per_half") -> ExpertWeights:
    """One layer's NVFP4 experts with gate and up reconciled onto one global scale per expert (module docstring).

    Args:
        weights: ``ExpertWeights``; only NVFP4 weights whose ``w13_weight_scale_2`` is ``[E, 2]`` change.
        mode: one of ``GATE_UP_MODES``.

    Returns:
        ``weights`` itself for ``per_half``, for OCP MX weights and for ``[E]`` global scales; otherwise new
        ``ExpertWeights`` with ``w13_weight_scale_2`` fp32 ``[E]`` (``gate``: column 0; ``requantize_max``:
        the per-expert max in decode form, min in encode form, and the other half's ``w13_weight_scale``
        rows rescaled), the codes shared with ``weights``. ``gate`` warns with vLLM's message when the
        columns differ (``torch.allclose``, as vLLM tests).

    Raises:
        ValueError: an unknown ``mode``.
    """
    check_gate_up_mode(mode)
    g = weights.w13_weight_scale_2
    if mode == "per_half" or not weights.scheme.has_global_scale or g is None or g.ndim != 2:
        return weights
    if mode == "gate":
        if not torch.allclose(g[:, 0], g[:, 1]):
            warnings.warn(VLLM_GATE_UP_WARNING, stacklevel=2)
        return replace(weights, w13_weight_scale_2=g[:, 0].contiguous())
    encode = weights.global_scale_kind == "encode"
    shared = g.amin(dim=1) if encode else g.amax(dim=1)
    ratio = shared[:, None] / g if encode else g / shared[:, None]  # [E, 2] fp32, <= 1
    i = weights.w13_weight.shape[1] // 2
    bs = weights.w13_weight_scale.float()
    half_ratio = ratio.repeat_interleave(i, dim=1)[:, :, None]  # [E, 2I, 1]: gate rows, then up rows
    rescaled = _ref.round_to_element(bs * half_ratio, NVFP4.scale.element).to(torch.float8_e4m3fn)
    return replace(weights, w13_weight_scale=rescaled, w13_weight_scale_2=shared.contiguous())


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    den = torch.linalg.norm(ref.double())
    return float(torch.linalg.norm(x.double() - ref.double()) / den) if den > 0 else float("nan")


def gate_up_errors(
    weights: ExpertWeights,
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_input_scale: torch.Tensor,
    w2_input_scale: torch.Tensor,
    reference: tuple[torch.Tensor, torch.Tensor] | None = None,
    modes: tuple[str, ...] = GATE_UP_MODES,
) -> list[dict]:
    """Each mode's weight error and layer output error on one layer's NVFP4 experts.

    Each mode's weights (``reconcile_gate_up``) run as the NVFP4 emulation experts (``nvfp4`` W4A4,
    vLLM numerics, ``torch`` backend) on ``hidden_states``. The reference is the bf16 layer when
    ``reference`` gives its weights, else the ``per_half`` dequantization and its emulation output
    (the checkpoint's own values, for a checkpoint without a bf16 original).

    Args:
        weights: NVFP4 ``ExpertWeights`` with ``w13_weight_scale_2`` ``[E, 2]`` (e.g. a checkpoint's,
            ``layout.read_experts``).
        hidden_states: ``[M, H]`` bf16 layer input; ``topk_weights`` fp32 ``[M, k]``; ``topk_ids`` ``[M, k]``.
        w13_input_scale, w2_input_scale: fp32 ``[E]`` decode input scales (the checkpoint's).
        reference: ``(w13 [E, 2I, H], w2 [E, H, I])`` bf16 weights, or None.
        modes: the modes to measure.

    Returns:
        One dict per mode: ``mode``; ``gate_rel_err``, ``up_rel_err``, ``w13_rel_err``:
        ``||W - W_ref||_F / ||W_ref||_F`` of w13's gate rows, up rows and both (bf16 dequantized weights);
        ``output_rel_err`` and ``output_sqnr_db`` of the layer output against the reference output.

    Raises:
        ValueError: weights that are not NVFP4; an unknown mode.
    """
    if weights.scheme != NVFP4:
        raise ValueError(f"weights: gate/up global scales are an NVFP4 matter, got {weights.scheme.name} weights")
    for m in modes:
        check_gate_up_mode(m)
    i = weights.w13_weight.shape[1] // 2

    def experts(w):
        return make_emulation_experts(NVFP4_MOE, w, w13_input_scale, w2_input_scale, backend="torch")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the experts' and vLLM's scale warnings: the point of the measurement
        if reference is None:
            base = experts(reconcile_gate_up(weights, "per_half"))
            ref13 = base.dequantized_weights()[0]
            ref_out = base(hidden_states, topk_weights, topk_ids)
        else:
            ref13 = reference[0]
            ref_out = TritonExperts(reference[0], reference[1], backend="torch")(hidden_states, topk_weights, topk_ids)
        rows = []
        for m in modes:
            ex = experts(reconcile_gate_up(weights, m))
            w13 = ex.dequantized_weights()[0]
            out = ex(hidden_states, topk_weights, topk_ids)
            err = torch.linalg.norm(out.double() - ref_out.double())
            sqnr = (
                20 * torch.log10(torch.linalg.norm(ref_out.double()) / err) if err > 0 else torch.tensor(float("inf"))
            )
            rows.append(
                dict(
                    mode=m,
                    gate_rel_err=_rel(w13[:, :i], ref13[:, :i]),
                    up_rel_err=_rel(w13[:, i:], ref13[:, i:]),
                    w13_rel_err=_rel(w13, ref13),
                    output_rel_err=_rel(out, ref_out),
                    output_sqnr_db=float(sqnr),
                )
            )
    return rows
