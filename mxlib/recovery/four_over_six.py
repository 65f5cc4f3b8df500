"""Four Over Six (4/6): adaptive NVFP4 block scaling, each block scaled to e2m1's max 6 or to 4.

e2m1's grid is 0, 0.5, 1, 1.5, 2, 3, 4, 6: the step between 4 and 6 is 2, so values between
2/3 and 1 of a block's amax round coarsely when the amax maps to 6. Scaling the block's amax to
4 instead (a block scale 1.5 times larger) puts those values on the finer 3, 4 steps at the
cost of the grid's top value. 4/6 quantizes every 16-element block both ways and keeps the
candidate with the smaller error (Cook et al., "Four Over Six: More Accurate NVFP4 Quantization
with Adaptive Block Scaling", arXiv 2512.02010; mit-han-lab/fouroversix, rules ``4o6_mse`` and
``4o6_mae``; NVIDIA ModelOpt's ``four_over_six``).

The per-tensor scale (published rule): a 4-scaled block needs a block scale up to 1.5 times
that of a 6-scaled one, so the global scale normalizes the tensor amax to an e4m3 block scale of
256 instead of 448 (``E4M3_MAX_FOUR_OVER_SIX``; 1.5 * 256 = 384 <= 448): the decode global scale
is ``amax / (6 * 256)`` (fouroversix ``max_allowed_e4m3_value() == 256``, ModelOpt's
"FP8 normalization 256"), the encode one its reciprocal ``6 * 256 / amax``.

Arithmetic of one block of ``x`` (fp32) under the global scale ``g`` (``mxlib.reference.
quantize_nvfp4``'s, ModelOpt's, with the candidate's ``m`` in place of 6):

* candidate block scale ``s_m = e4m3(amax_block / (m * g))`` for ``m`` in (6, 4) (decode ``g``;
  encode ``g``: ``e4m3(g * (amax_block / m))``); an all-zero block stores 1.0 (ModelOpt);
* codes ``e2m1(x / step)`` (nearest, ties to even, saturating to 6) with ``step = s_m * g``
  (decode) or ``s_m / g`` (encode); a zero step stores zero codes;
* error of the dequantized block ``e2m1 * step`` against ``x``, in float64: ``mse`` the sum of
  squared differences, ``mae`` the sum of absolute ones (fouroversix's ``l1_norm``), optionally
  weighted per element; 4 is kept only when its error is strictly smaller (ties keep 6, as
  fouroversix does).

The 6-candidate under ``g = amax / 2688`` is exactly ``quantize_nvfp4``'s block; the published
rule's fp32 error (whose sum order is the kernel's) is replaced offline by the float64 one.
"""

from __future__ import annotations

import torch

from .. import reference as _ref
from .._checks import GLOBAL_SCALE_MIN, all_finite, check_float
from ..formats import NVFP4
from ..moe.emulation import ExpertWeights
from ..moe.schemes import MoEQuantScheme, checkpoint_weight_format

__all__ = [
    "E4M3_MAX_FOUR_OVER_SIX",
    "FOUR_OVER_SIX_METRICS",
    "four_over_six_global_scale",
    "quantize_nvfp4_four_over_six",
    "FourOverSix",
]

_E2M1 = NVFP4.element
_E4M3 = NVFP4.scale.element
# The e4m3 block scale the tensor amax maps to under 4/6's global scale (fouroversix, ModelOpt).
E4M3_MAX_FOUR_OVER_SIX = 256.0
# The e2m1 values a block's amax is scaled to: 6 (the grid's max) and 4; the first is the default.
_CANDIDATE_MAXIMA = (_E2M1.max, 4.0)
FOUR_OVER_SIX_METRICS = ("mse", "mae")
GLOBAL_SCALE_KINDS = ("decode", "encode")
# blocks per chunk of the candidate searches (bounds the float64 temporaries)
CHUNK_BLOCKS = 1 << 14


def check_choice(value, allowed, name: str) -> None:
    if value not in allowed:
        raise ValueError(f"{name}: expected one of {list(allowed)}, got {value!r}")


def nvfp4_weights3(x: torch.Tensor, name: str = "x") -> torch.Tensor:
    """``x`` as ``[E, n, k]`` (a 2D matrix gets E = 1), checked: float, finite, k a multiple of 16."""
    check_float(x, name)
    if x.ndim not in (2, 3):
        raise ValueError(f"{name}: expected [n, k] or [E, n, k], got shape {list(x.shape)}")
    if x.shape[-1] % NVFP4.block_size:
        raise ValueError(f"{name}: k={x.shape[-1]} is not a multiple of block_size={NVFP4.block_size}")
    if not all_finite(x):
        raise ValueError(f"{name}: expected finite weights, found NaN or Inf")
    return x.unsqueeze(0) if x.ndim == 2 else x


def global_scale_from_amax(amax: torch.Tensor, divisor: float, kind: str) -> torch.Tensor:
    """fp32 ``[E]`` global scales of tensors with ``amax``: decode ``amax / divisor`` (raised to
    ``2**-126``) or encode ``divisor / amax``; an all-zero tensor gets 1 (as ``nvfp4_weight_scale_2``)."""
    check_choice(kind, GLOBAL_SCALE_KINDS, "global_scale_kind")
    a = amax.float()
    d = torch.tensor(divisor, dtype=torch.float32, device=a.device)
    pos = a > 0
    safe = torch.where(pos, a, 1.0)
    g = (safe / d).clamp(min=GLOBAL_SCALE_MIN) if kind == "decode" else d / safe
    return torch.where(pos, g, torch.ones_like(g)).contiguous()


def four_over_six_global_scale(x: torch.Tensor, global_scale_kind: str = "decode") -> torch.Tensor:
    """4/6's per-tensor scale of each ``[n, k]`` matrix of ``x [E, n, k]``: fp32 ``[E]``, decode
    ``amax / (6 * 256)`` or encode ``6 * 256 / amax`` (module docstring)."""
    amax = x.reshape(x.shape[0], -1).abs().amax(dim=-1) if x[0].numel() else x.new_zeros(x.shape[0])
    return global_scale_from_amax(amax, _E2M1.max * E4M3_MAX_FOUR_OVER_SIX, global_scale_kind)


def block_scale_for(bamax: torch.Tensor, g: torch.Tensor, m: float, kind: str) -> torch.Tensor:
    """e4m3-rounded block scale mapping ``bamax`` to e2m1 value ``m`` under global scale ``g``
    (1.0 for an all-zero block)."""
    if kind == "decode":
        raw = bamax / (m * g)
    else:
        raw = g * (bamax / m)
    raw = torch.where(raw == 0, 1.0, raw)  # ModelOpt's block scale of an all-zero block
    return _ref.round_to_element(raw, _E4M3)


def step_of(bs: torch.Tensor, g: torch.Tensor, kind: str) -> torch.Tensor:
    """fp32 dequantization step of block scales ``bs``: ``bs * g`` (decode) or ``bs / g`` (encode)."""
    return bs * g if kind == "decode" else bs / g


def e2m1_for_step(xb: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Signed e2m1 values (fp32) of blocks ``xb [..., B]`` under per-block ``step [...]``:
    ``e2m1(x / step)`` saturating, zero where the step is zero (``quantize_nvfp4``'s codes)."""
    st = step.unsqueeze(-1)
    scaled = torch.where(st == 0, 0.0, xb / torch.where(st == 0, 1.0, st))
    r = _ref.round_to_element(scaled.abs(), _E2M1)
    return torch.where(scaled < 0, -r, r)  # ModelOpt's sign bit: set for a negative scaled value, -0 included


def block_error(
    xb: torch.Tensor, values: torch.Tensor, step: torch.Tensor, metric: str, weight: torch.Tensor | None
) -> torch.Tensor:
    """float64 error per block of the dequantized ``values * step`` against ``xb``: sum of squared
    (``mse``) or absolute (``mae``) differences, each element weighted by ``weight`` (broadcast)."""
    d = values.double() * step.double().unsqueeze(-1) - xb.double()
    e = d * d if metric == "mse" else d.abs()
    if weight is not None:
        e = e * weight
    return e.sum(dim=-1)


def error_weights(weight: torch.Tensor | None, shape, name: str = "weight") -> torch.Tensor | None:
    """The per-element error weights of a search, checked and broadcast to ``shape`` as float64 (None stays None).

    A search minimises the weighted error, so a negative weight would make it maximise that element's error, and a
    NaN would make every candidate's error NaN: both are refused, so that a search is never worse than
    round-to-nearest in its own weighted error. Zero weights are allowed (an element that does not count).

    Raises:
        TypeError: ``weight`` is not a tensor.
        ValueError: ``weight`` does not broadcast to ``shape``, or holds a negative, NaN or Inf value (naming
            ``name``, the count and the first offending value).
    """
    if weight is None:
        return None
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor of non-negative error weights, got {type(weight).__name__}")
    if weight.is_complex() or weight.dtype == torch.bool:
        raise ValueError(f"{name}: expected real error weights, got dtype {weight.dtype}")
    try:
        w = torch.broadcast_to(weight, tuple(shape))
    except RuntimeError:
        raise ValueError(
            f"{name}: shape {list(weight.shape)} does not broadcast to the weights' {list(shape)}"
        ) from None
    given = weight.double()
    bad = ~torch.isfinite(given) | (given < 0)
    if bool(bad.any()):
        first = given[bad].flatten()[0].item()
        raise ValueError(
            f"{name}: expected finite, non-negative error weights, found {int(bad.sum())} negative, NaN or Inf "
            f"values of {given.numel()} (e.g. {first})"
        )
    return w.double()


def codes_of(values: torch.Tensor) -> torch.Tensor:
    """uint8 e2m1 codes (sign in bit 3, from the sign bit: -0.0 is code 8) of signed e2m1 values."""
    return _ref.encode_element(values.abs(), _E2M1) | torch.signbit(values).to(torch.uint8) << 3


def quantize_nvfp4_four_over_six(
    x: torch.Tensor,
    global_scale: torch.Tensor | None = None,
    *,
    metric: str = "mse",
    global_scale_kind: str = "decode",
    weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 weights with 4/6 block scaling (module docstring): the reference.

    Args:
        x: ``[n, k]`` or ``[E, n, k]`` float32 / bfloat16 / float16 weights, finite; k a multiple of 16.
        global_scale: fp32 ``[E]`` (or one element for 2D) in ``global_scale_kind``'s convention;
            None takes 4/6's own (``four_over_six_global_scale``).
        metric: ``mse`` (fouroversix ``4o6_mse``) or ``mae`` (``4o6_mae``).
        global_scale_kind: ``decode`` (ModelOpt's ``weight_scale_2``, multiplied) or ``encode``
            (compressed-tensors' ``weight_global_scale``, divided by).
        weight: optional non-negative per-element error weights broadcasting to ``[E, n, k]``
            (e.g. ``[E, 1, k]``: an input channel's second moment).

    Returns:
        ``(packed uint8 [..., k/2], block_scale float8_e4m3fn [..., k/16], global_scale fp32 [E] or [],
        use_four bool [..., k/16])``: the layout of ``quantize_nvfp4`` plus which blocks chose 4.

    Raises:
        ValueError: a bad metric or kind, non-finite weights, k not a multiple of 16, a global
            scale of the wrong shape; a ``weight`` that does not broadcast or holds a negative, NaN or Inf value
            (``error_weights``).
    """
    check_choice(metric, FOUR_OVER_SIX_METRICS, "metric")
    check_choice(global_scale_kind, GLOBAL_SCALE_KINDS, "global_scale_kind")
    x3 = nvfp4_weights3(x)
    num, n, k = x3.shape
    if global_scale is None:
        g_all = four_over_six_global_scale(x3, global_scale_kind)
    else:
        g_all = global_scale.float().reshape(-1)
        if g_all.numel() != num:
            raise ValueError(f"global_scale: expected {num} values (one per matrix), got {g_all.numel()}")
    nb = k // NVFP4.block_size
    w3 = error_weights(weight, x3.shape)
    codes = torch.empty(num, n, k, dtype=torch.uint8, device=x.device)
    scales = torch.empty(num, n, nb, dtype=torch.float32, device=x.device)
    four = torch.empty(num, n, nb, dtype=torch.bool, device=x.device)
    rows_per = max(1, CHUNK_BLOCKS // max(1, nb))
    for ex in range(num):
        g = g_all[ex]
        for r0 in range(0, n, rows_per):
            rows = slice(r0, min(n, r0 + rows_per))
            xb = x3[ex, rows].float().reshape(-1, nb, NVFP4.block_size)
            wb = None if w3 is None else w3[ex, rows].reshape(xb.shape)
            bamax = xb.abs().amax(dim=-1)
            cands = []
            for m in _CANDIDATE_MAXIMA:
                bs = block_scale_for(bamax, g, m, global_scale_kind)
                st = step_of(bs, g, global_scale_kind)
                v = e2m1_for_step(xb, st)
                cands.append((bs, v, block_error(xb, v, st, metric, wb)))
            (bs6, v6, err6), (bs4, v4, err4) = cands
            use4 = err4 < err6
            codes[ex, rows] = codes_of(torch.where(use4.unsqueeze(-1), v4, v6)).reshape(-1, k)
            scales[ex, rows] = torch.where(use4, bs4, bs6)
            four[ex, rows] = use4
    packed, scales = _ref.pack_codes(codes, _E2M1), scales.to(torch.float8_e4m3fn)
    if x.ndim == 2:
        return packed[0], scales[0], g_all[0].clone(), four[0]
    return packed, scales, g_all.clone(), four


def experts_nvfp4(
    w13: torch.Tensor, w2: torch.Tensor, scheme, technique: str, quantize, global_scale_kind: str
) -> ExpertWeights:
    """``ExpertWeights`` of one layer from an NVFP4 quantizer ``quantize(x [E, n, k], which) ->
    (packed, block_scale, global_scale [E])`` (``which``: 0 for w13, 1 for w2); gate and up share
    one global scale per expert (ModelOpt's ``weight_scale_2``, as round-to-nearest)."""
    fmt = checkpoint_weight_format(scheme, "four_over_six")
    if not fmt.has_global_scale:
        raise ValueError(f"scheme: {technique} quantizes NVFP4 weights only, got {fmt.name}")
    p13, s13, g13 = quantize(w13, 0)
    p2, s2, g2 = quantize(w2, 1)
    return ExpertWeights(fmt, p13, s13, p2, s2, g13, g2, global_scale_kind=global_scale_kind)


class FourOverSix:
    """4/6 NVFP4 weights (``quantize_nvfp4_four_over_six``), registered as ``"four_over_six"``.

    Args:
        metric: ``mse`` (default) or ``mae``: the error by which each block keeps 6 or 4.

    Changes only the stored scales and codes (``config()`` is empty): the checkpoint runs on
    round-to-nearest's kernels.
    """

    name = "four_over_six"
    global_scale_kinds = GLOBAL_SCALE_KINDS

    def __init__(self, metric: str = "mse"):
        check_choice(metric, FOUR_OVER_SIX_METRICS, "metric")
        self.metric = metric

    def quantize_experts(
        self, w13: torch.Tensor, w2: torch.Tensor, scheme: MoEQuantScheme, *, layer: int, global_scale_kind="decode"
    ) -> ExpertWeights:
        def quantize(x, which):
            return quantize_nvfp4_four_over_six(x, metric=self.metric, global_scale_kind=global_scale_kind)[:3]

        return experts_nvfp4(w13, w2, scheme, self.name, quantize, global_scale_kind)

    def config(self) -> dict:
        return {}
