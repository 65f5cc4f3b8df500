"""MSE-optimal block scales: every block tries a set of candidate scales and keeps the one whose
dequantized block is closest to the weights (codes rounded to nearest under each candidate).

* NVFP4 (NVIDIA ModelOpt's ``NVFP4MSECalibrator`` and its fused sweep, ModelOpt #1387): under the
  round-to-nearest global scale (``amax / 2688``) every finite positive e4m3 value (codes 1..126,
  ``2**-9`` .. 448) is a candidate block scale; the codes and the step are ``quantize_nvfp4``'s
  (``e2m1(x / (s * g))``). ``"four_over_six_mse"`` is the same sweep under 4/6's global scale
  (``amax / (6 * 256)``, ModelOpt's ``four_over_six`` with FP8 normalization 256): the 126
  candidates contain both of 4/6's, so it is never worse than 4/6 on any block (llm-compressor's
  "expanded MSE grid, a superset of 4/6", #2950).
* MXFP4 / MXFP6 / MXFP8: the E8M0 byte of round-to-nearest (Quark's ``even`` rule) and its
  neighbours ``byte - radius .. byte + radius`` (llama.cpp #21896 tries +-2 codes); codes
  ``encode_element(x / 2**(b - 127))`` as ``quantize_mx``.

Round-to-nearest's own block scale is always the first candidate and a tie keeps the earlier
candidate (then the smaller e4m3 code, or the E8M0 order 0, -1, +1, -2, +2), so the search is
never worse than round-to-nearest on any block (its error is one of those compared). Errors
are float64 sums of ``w * (dequantized - x)**2`` with ``w`` the optional importance: the
calibration inputs' second moment of the element's input channel (the diagonal of the
expert's Hessian ``sum x x^T``; ModelOpt #1659, llm-compressor's imatrix), 1 without.
"""

from __future__ import annotations

import torch

from .. import reference as _ref
from .._checks import all_finite
from ..formats import E8M0_BIAS, NVFP4, BlockScheme
from ..moe.emulation import ExpertWeights
from ..moe.factory import WEIGHT_SCALE_MODE
from ..moe.schemes import MoEQuantScheme, checkpoint_weight_format
from .four_over_six import (
    CHUNK_BLOCKS,
    E4M3_MAX_FOUR_OVER_SIX,
    GLOBAL_SCALE_KINDS,
    block_error,
    block_scale_for,
    check_choice,
    codes_of,
    e2m1_for_step,
    error_weights,
    experts_nvfp4,
    global_scale_from_amax,
    nvfp4_weights3,
    step_of,
)

__all__ = [
    "nvfp4_scale_candidates",
    "search_nvfp4_scales",
    "search_mx_scales",
    "MSEScaleSearch",
    "FourOverSixMSE",
]

_E2M1 = NVFP4.element
_E4M3 = NVFP4.scale.element
# the E8M0 byte offsets an MX block tries, by radius, in the tie order (round-to-nearest first)
MX_RADIUS = 2


def nvfp4_scale_candidates(device=None) -> torch.Tensor:
    """The 126 finite positive e4m3 values, ascending (codes 1..126), fp32 ``[126]``."""
    codes = torch.arange(1, 127, dtype=torch.uint8, device=device)
    return _ref.decode_element(codes, _E4M3)


def _rows_per_chunk(nb: int, candidates: int) -> int:
    return max(1, CHUNK_BLOCKS // max(1, nb * candidates // 8))


def search_nvfp4_scales(
    x: torch.Tensor,
    global_scale: torch.Tensor | None = None,
    *,
    normalization: float = _E4M3.max,
    global_scale_kind: str = "decode",
    weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 weights with each block's e4m3 scale chosen by minimum (weighted) squared error.

    Args:
        x: ``[n, k]`` or ``[E, n, k]`` float weights, finite; k a multiple of 16.
        global_scale: fp32 ``[E]`` in ``global_scale_kind``'s convention; None: from each matrix's
            amax, ``amax / (6 * normalization)`` (decode) or its reciprocal (encode).
        normalization: the e4m3 block scale the tensor amax maps to: 448 (round-to-nearest's,
            ModelOpt's ``weight_scale_2``) or 256 (4/6's, ``FourOverSixMSE``).
        global_scale_kind: ``decode`` or ``encode`` (``four_over_six.quantize_nvfp4_four_over_six``).
        weight: optional per-element error weights broadcasting to ``[E, n, k]``: finite and non-negative.

    Returns:
        ``(packed uint8 [..., k/2], block_scale float8_e4m3fn [..., k/16], global_scale fp32 [E] or [],
        error float64 [..., k/16])``: the chosen block's error.

    Raises:
        ValueError: non-finite weights, k not a multiple of 16, a bad kind or global-scale shape; a ``weight``
            that does not broadcast or holds a negative, NaN or Inf value (``four_over_six.error_weights``).
    """
    check_choice(global_scale_kind, GLOBAL_SCALE_KINDS, "global_scale_kind")
    x3 = nvfp4_weights3(x)
    num, n, k = x3.shape
    if global_scale is None:
        amax = x3.reshape(num, -1).abs().amax(dim=-1) if n * k else x3.new_zeros(num)
        g_all = global_scale_from_amax(amax, _E2M1.max * normalization, global_scale_kind)
    else:
        g_all = global_scale.float().reshape(-1)
        if g_all.numel() != num:
            raise ValueError(f"global_scale: expected {num} values (one per matrix), got {g_all.numel()}")
    nb = k // NVFP4.block_size
    cand = nvfp4_scale_candidates(x.device)
    w3 = error_weights(weight, x3.shape)
    codes = torch.empty(num, n, k, dtype=torch.uint8, device=x.device)
    scales = torch.empty(num, n, nb, dtype=torch.float32, device=x.device)
    errors = torch.empty(num, n, nb, dtype=torch.float64, device=x.device)
    rows_per = _rows_per_chunk(nb, cand.numel() + 1)
    for ex in range(num):
        g = g_all[ex]
        for r0 in range(0, n, rows_per):
            rows = slice(r0, min(n, r0 + rows_per))
            xb = x3[ex, rows].float().reshape(-1, nb, 1, NVFP4.block_size)
            wb = None if w3 is None else w3[ex, rows].reshape(xb.shape)
            rtn = block_scale_for(xb.abs().amax(dim=-1), g, _E2M1.max, global_scale_kind)  # [r, nb, 1]
            bs = torch.cat([rtn, cand.expand(*rtn.shape[:-1], -1)], dim=-1)  # [r, nb, 1 + 126]
            st = step_of(bs, g, global_scale_kind)
            v = e2m1_for_step(xb, st)
            err = block_error(xb, v, st, "mse", wb)
            best = err.argmin(dim=-1, keepdim=True)  # the first minimum: round-to-nearest on a tie
            vb = torch.take_along_dim(v, best.unsqueeze(-1), dim=2).squeeze(2)
            codes[ex, rows] = codes_of(vb).reshape(-1, k)
            scales[ex, rows] = torch.take_along_dim(bs, best, dim=-1).squeeze(-1)
            errors[ex, rows] = torch.take_along_dim(err, best, dim=-1).squeeze(-1)
    packed, scales = _ref.pack_codes(codes, _E2M1), scales.to(torch.float8_e4m3fn)
    if x.ndim == 2:
        return packed[0], scales[0], g_all[0].clone(), errors[0]
    return packed, scales, g_all.clone(), errors


def _mx_offsets(radius: int) -> list[int]:
    out = [0]
    for d in range(1, radius + 1):
        out += [-d, d]
    return out


def search_mx_scales(
    x: torch.Tensor, scheme: BlockScheme | str, *, radius: int = MX_RADIUS, weight: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """OCP MX weights with each block's E8M0 byte chosen among round-to-nearest's (``even``) and its
    ``radius`` neighbours on each side by minimum (weighted) squared error.

    Args:
        x: ``[..., k]`` float weights, finite; k a multiple of the scheme's block size.
        scheme: an OCP MX ``BlockScheme`` or its name (``mxfp4``, ``mxfp6_e2m3``, ...).
        radius: neighbours tried on each side (bytes clamped to 0..254).
        weight: optional per-element error weights broadcasting to ``x``: finite and non-negative.

    Returns:
        ``(packed uint8 [..., k * bits / 8], scale uint8 [..., k / 32], error float64 [..., k / 32])``.

    Raises:
        ValueError: an NVFP4 scheme, a negative radius, non-finite weights, a bad k; a ``weight`` that does
            not broadcast or holds a negative, NaN or Inf value (``four_over_six.error_weights``).
    """
    fmt = checkpoint_weight_format(scheme, "the scale search")
    if fmt.has_global_scale:
        raise ValueError(f"scheme: expected an OCP MX format, got {fmt.name} (use search_nvfp4_scales)")
    if not isinstance(radius, int) or radius < 0:
        raise ValueError(f"radius: expected a non-negative int, got {radius!r}")
    el, bsz = fmt.element, fmt.block_size
    if x.shape[-1] % bsz:
        raise ValueError(f"x: k={x.shape[-1]} is not a multiple of block_size={bsz}")
    if not all_finite(x):
        raise ValueError("x: expected finite weights, found NaN or Inf")
    lead, k = x.shape[:-1], x.shape[-1]
    nb = k // bsz
    x2 = x.reshape(-1, k)
    w2 = None if weight is None else error_weights(weight, x.shape).reshape(-1, k)
    offsets = torch.tensor(_mx_offsets(radius), dtype=torch.int32, device=x.device)
    codes = torch.empty(x2.shape[0], k, dtype=torch.uint8, device=x.device)
    scale = torch.empty(x2.shape[0], nb, dtype=torch.uint8, device=x.device)
    errors = torch.empty(x2.shape[0], nb, dtype=torch.float64, device=x.device)
    rows_per = _rows_per_chunk(nb, offsets.numel())
    for r0 in range(0, x2.shape[0], rows_per):
        rows = slice(r0, min(x2.shape[0], r0 + rows_per))
        xb = x2[rows].float().reshape(-1, nb, 1, bsz)
        wb = None if w2 is None else w2[rows].reshape(xb.shape)
        byte0 = _ref.e8m0_scale(xb.abs().amax(dim=-1), el, WEIGHT_SCALE_MODE).to(torch.int32)  # [r, nb, 1]
        byte = (byte0 + offsets).clamp(0, 2 * E8M0_BIAS)
        s = _ref.decode_e8m0(byte.to(torch.uint8))
        v = _ref.round_to_element(xb / s.unsqueeze(-1), el)
        err = block_error(xb, v, s, "mse", wb)
        best = err.argmin(dim=-1, keepdim=True)
        vb = torch.take_along_dim(v, best.unsqueeze(-1), dim=2).squeeze(2)
        codes[rows] = _ref.encode_element(vb, el).reshape(-1, k)
        scale[rows] = torch.take_along_dim(byte, best, dim=-1).squeeze(-1).to(torch.uint8)
        errors[rows] = torch.take_along_dim(err, best, dim=-1).squeeze(-1)
    packed = _ref.pack_codes(codes, el)
    return packed.reshape(*lead, -1), scale.reshape(*lead, nb), errors.reshape(*lead, nb)


def _importance(importance, layer: int, w13: torch.Tensor, w2: torch.Tensor):
    """Per-element weights ``([E, 1, H], [E, 1, I])`` float64 from ``importance.diagonal(layer)``."""
    if importance is None:
        return None, None
    a1, a2 = importance.diagonal(layer)
    e, _, h = w13.shape
    i = w2.shape[-1]
    for t, name, shape in ((a1, "a1", (e, h)), (a2, "a2", (e, i))):
        if tuple(t.shape) != shape:
            raise ValueError(f"importance.diagonal({layer}): {name} expected shape {list(shape)}, got {list(t.shape)}")
        error_weights(t, shape, f"importance.diagonal({layer}): {name}")
    return a1.double().unsqueeze(1).to(w13.device), a2.double().unsqueeze(1).to(w2.device)


class MSEScaleSearch:
    """Block scales by minimum (importance-weighted) squared error, registered as ``"mse"``.

    Args:
        importance: None, or an object with ``.diagonal(layer) -> (a1 [E, H], a2 [E, I])`` fp32:
            the calibration inputs' second moments per expert (w13's input channels, then w2's),
            e.g. ``mxlib.models.hessians.ExpertHessians``.
        radius: E8M0 neighbours tried on each side for OCP MX schemes.

    NVFP4 keeps round-to-nearest's global scale (``amax / 2688``). Changes only the stored scales
    and codes (``config()`` is empty).
    """

    name = "mse"
    global_scale_kinds = GLOBAL_SCALE_KINDS
    normalization = _E4M3.max

    def __init__(self, importance=None, radius: int = MX_RADIUS):
        if importance is not None and not callable(getattr(importance, "diagonal", None)):
            raise ValueError(
                f"importance: expected None or an object with .diagonal(layer), got {type(importance).__name__}"
            )
        if not isinstance(radius, int) or radius < 0:
            raise ValueError(f"radius: expected a non-negative int, got {radius!r}")
        self.importance = importance
        self.radius = radius

    def quantize_experts(
        self, w13: torch.Tensor, w2: torch.Tensor, scheme: MoEQuantScheme, *, layer: int, global_scale_kind="decode"
    ) -> ExpertWeights:
        weights = _importance(self.importance, layer, w13, w2)
        fmt = checkpoint_weight_format(scheme, "the scale search")
        if fmt.has_global_scale:

            def quantize(x, which):
                return search_nvfp4_scales(
                    x,
                    normalization=self.normalization,
                    global_scale_kind=global_scale_kind,
                    weight=weights[which],
                )[:3]

            return experts_nvfp4(w13, w2, fmt, self.name, quantize, global_scale_kind)
        if self.normalization != _E4M3.max:
            raise ValueError(f"scheme: {self.name} quantizes NVFP4 weights only, got {fmt.name}")
        p13, s13, _ = search_mx_scales(w13, fmt, radius=self.radius, weight=weights[0])
        p2, s2, _ = search_mx_scales(w2, fmt, radius=self.radius, weight=weights[1])
        return ExpertWeights(fmt, p13, s13, p2, s2)

    def config(self) -> dict:
        return {}


class FourOverSixMSE(MSEScaleSearch):
    """4/6 joined to the MSE search, registered as ``"four_over_six_mse"``: every e4m3 candidate
    under 4/6's global scale (``amax / (6 * 256)``), so both of 4/6's candidates are among them
    (ModelOpt's MSE calibration with ``four_over_six`` and FP8 normalization 256). NVFP4 only."""

    name = "four_over_six_mse"
    normalization = E4M3_MAX_FOUR_OVER_SIX

    def __init__(self, importance=None):
        super().__init__(importance)
