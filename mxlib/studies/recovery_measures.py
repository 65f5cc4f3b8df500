"""Measuring one recovery technique: its weight error, what it changed, what its checkpoint runs.

Notebook 07's studies (``mxlib.studies.recovery``) call these on every technique, and its lesson
on tensors calls ``random_sign_hadamard`` and ``rotation_trap``:

* ``dequantize_weights`` / ``weight_error``: an ``ExpertWeights``' weights in fp32 (``mxlib.reference``)
  and their mean squared error against the weights that were quantized;
* ``MeasuredTechnique``: a ``WeightTechnique`` wrapper that times each layer's ``quantize_experts``
  and records its weight error in the basis the technique stores (a rotation's rotated weights);
* ``ScaleStepUp``: a negative control, every block scale steps up (worse than RTN by construction);
* ``SwappedNibbles``: the broken control, RTN with each packed byte's nibbles swapped;
* ``kernel_path``: what a loaded model's experts run (class, backend, numerics, buffers, modules);
* ``block_changes``: which block scales and codes a technique changed against RTN, by what ratio;
* ``random_sign_hadamard`` / ``rotation_trap``: a dense orthonormal block Hadamard matrix with
  random signs (Sylvester's construction, built for teaching: ``mxlib.recovery``'s rotation is the
  fast transform) and the energy-weighted SQNR of QDQ with and without it, on outlier-heavy data.
"""

from __future__ import annotations

import math
import time

import torch

from .. import reference as R
from ..analysis import sqnr_db_from_sums
from ..formats import E8M0_NAN_BYTE, get_block_scheme, get_element_format
from ..models.qwen3 import moe_layers
from ..moe.emulation import ExpertWeights
from ..moe.factory import quantize_expert_weights
from ..stats import ComparisonFamily, largest_difference

__all__ = [
    "dequantize_weights",
    "weight_error",
    "MeasuredTechnique",
    "ScaleStepUp",
    "SwappedNibbles",
    "kernel_path",
    "block_changes",
    "RATIO_SPAN",
    "RATIO_BINS",
    "random_sign_hadamard",
    "block_rotate",
    "TRAP_METRICS",
    "OUTLIER_SPREAD",
    "outlier_layer",
    "layer_tokens",
    "amax_over_scale",
    "rotation_trap",
    "trap_series",
    "trap_noise",
    "add_trap_comparisons",
]


# ----------------------------------------------------------------------------- weights and their error


def dequantize_weights(q: ExpertWeights, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w13 [E, 2I, H], w2 [E, H, I])`` of ``q`` in ``dtype`` (``mxlib.reference``: NVFP4's
    ``dequantize_to_dtype`` with the global scales in ``q``'s kind, per gate / up half where ``[E, 2]``;
    OCP MX's ``dequantize_mx``)."""
    s = q.scheme
    if not s.has_global_scale:
        return tuple(
            R.dequantize_mx(p, sc, s.element, s.block_size, dtype)
            for p, sc in ((q.w13_weight, q.w13_weight_scale), (q.w2_weight, q.w2_weight_scale))
        )
    kw = dict(dtype=dtype, global_scale_kind=q.global_scale_kind)
    g13 = q.w13_weight_scale_2
    if g13.ndim == 2:  # gate and up halves with their own global scale
        i = q.w13_weight.shape[1] // 2
        w13 = torch.cat(
            [
                R.dequantize_to_dtype(
                    q.w13_weight[:, j * i : (j + 1) * i].contiguous(),
                    q.w13_weight_scale[:, j * i : (j + 1) * i].contiguous(),
                    g13[:, j].contiguous(),
                    **kw,
                )
                for j in range(2)
            ],
            dim=1,
        )
    else:
        w13 = R.dequantize_to_dtype(q.w13_weight, q.w13_weight_scale, g13, **kw)
    return w13, R.dequantize_to_dtype(q.w2_weight, q.w2_weight_scale, q.w2_weight_scale_2, **kw)


def weight_error(q: ExpertWeights, w13: torch.Tensor, w2: torch.Tensor) -> dict:
    """Mean squared error of ``q``'s dequantized weights (fp32) against ``w13``, ``w2`` (float64
    sums): ``w13_mse``, ``w2_mse``, ``mse`` (over both), ``energy`` (mean square of the weights),
    ``sqnr_db``."""
    d13, d2 = dequantize_weights(q)
    e13 = float(((d13.double() - w13.double()) ** 2).sum())
    e2 = float(((d2.double() - w2.double()) ** 2).sum())
    n13, n2 = w13.numel(), w2.numel()
    energy = float((w13.double() ** 2).sum() + (w2.double() ** 2).sum())
    return dict(
        w13_mse=e13 / n13,
        w2_mse=e2 / n2,
        mse=(e13 + e2) / (n13 + n2),
        energy=energy / (n13 + n2),
        sqnr_db=sqnr_db_from_sums(energy, e13 + e2),
    )


class _Recorder:
    """The innermost technique of a composition, recording the weights it is asked to quantize."""

    def __init__(self, inner):
        self.inner, self.name, self.seen = inner, inner.name, None

    def quantize_experts(self, w13, w2, scheme, *, layer):
        self.seen = (w13, w2)
        return self.inner.quantize_experts(w13, w2, scheme, layer=layer)

    def config(self) -> dict:
        return self.inner.config()


class MeasuredTechnique:
    """A ``WeightTechnique`` that runs ``inner`` and measures it, layer by layer: the seconds of
    each ``quantize_experts`` call (``seconds``) and the weight error (``weight_error``) of its
    result against the weights its innermost technique quantized (``errors``). For a technique that
    wraps another in ``inner`` (a rotation), those are the rotated weights, so the error is in the
    stored basis (equal to the original basis's for an orthonormal rotation; ``energy_ratio`` is
    the rotated weights' energy over the original's, 1 for one). ``keep``: the layers whose
    ``ExpertWeights`` are kept in ``weights``. ``name`` and ``config()`` are ``inner``'s, so a
    checkpoint written through it is the one ``inner`` writes."""

    def __init__(self, inner, keep=()):
        self.inner, self.name = inner, inner.name
        self.keep = set(keep)
        self.seconds: dict[int, float] = {}
        self.errors: dict[int, dict] = {}
        self.weights: dict[int, ExpertWeights] = {}

    def config(self) -> dict:
        return self.inner.config()

    def quantize_experts(self, w13, w2, scheme, *, layer):
        holder, chain = self.inner, []
        while hasattr(holder, "inner") and hasattr(holder.inner, "quantize_experts"):
            chain.append(holder)
            holder = holder.inner
        recorder = None
        if chain:  # record what the innermost technique is given
            recorder = _Recorder(chain[-1].inner)
            object.__setattr__(chain[-1], "inner", recorder)
        try:
            t0 = time.perf_counter()
            q = self.inner.quantize_experts(w13, w2, scheme, layer=layer)
            self.seconds[layer] = time.perf_counter() - t0
        finally:
            if recorder is not None:
                object.__setattr__(chain[-1], "inner", recorder.inner)
        t13, t2 = recorder.seen if recorder is not None and recorder.seen is not None else (w13, w2)
        err = weight_error(q, t13, t2)
        original = float((w13.double() ** 2).sum() + (w2.double() ** 2).sum())
        err["energy_ratio"] = float((t13.double() ** 2).sum() + (t2.double() ** 2).sum()) / original
        self.errors[layer] = err
        if layer in self.keep:
            self.weights[layer] = q
        return q


class ScaleStepUp:
    """The negative control: round-to-nearest, then every block's scale ``steps`` steps up and the
    codes rounded again at that scale (OCP MX: the E8M0 exponent + ``steps``, saturating at 254;
    NVFP4: the block scales kept, the global ``weight_scale_2`` times ``2**steps``). Each step halves
    the share of e2m1's range a block uses, one bit less: worse than RTN by construction. Not
    registered in ``TECHNIQUES``: the workbook's check that its intervals separate a worse technique.

    Raises:
        ValueError: ``steps`` not a positive int.
    """

    name = "scale_step_up"

    def __init__(self, steps: int = 1):
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps: expected a positive int, got {steps!r}")
        self.steps = steps

    def config(self) -> dict:
        return {}

    @staticmethod
    def _mx(x, scale, fmt, steps):
        byte = torch.where(scale < E8M0_NAN_BYTE, (scale.int() + steps).clamp(max=E8M0_NAN_BYTE - 1), scale)
        byte = byte.to(torch.uint8)
        xb = x.float().reshape(*x.shape[:-1], -1, fmt.block_size)
        codes = R.encode_element(xb / R.decode_e8m0(byte).unsqueeze(-1), fmt.element)
        codes = torch.where((byte == E8M0_NAN_BYTE).unsqueeze(-1), 0, codes).to(torch.uint8)
        return R.pack_codes(codes.reshape(x.shape), fmt.element), byte

    @staticmethod
    def _nvfp4(x, scale, g, factor):
        e2m1 = get_element_format("e2m1")
        xb = x.float().reshape(*x.shape[:-1], -1, 16)
        denom = (scale.float() * (factor * g).reshape(-1, 1, 1)).unsqueeze(-1)
        v = torch.where(denom == 0, 0.0, xb / torch.where(denom == 0, 1.0, denom))
        codes = R.encode_e2m1_sign_magnitude(v)
        return R.pack_codes(codes.reshape(x.shape), e2m1)

    def quantize_experts(self, w13, w2, scheme, *, layer):
        q = quantize_expert_weights(w13, w2, scheme)
        fmt = q.scheme
        if fmt.has_global_scale:
            f = float(2**self.steps)
            return ExpertWeights(
                fmt,
                self._nvfp4(w13, q.w13_weight_scale, q.w13_weight_scale_2, f),
                q.w13_weight_scale,
                self._nvfp4(w2, q.w2_weight_scale, q.w2_weight_scale_2, f),
                q.w2_weight_scale,
                f * q.w13_weight_scale_2,
                f * q.w2_weight_scale_2,
            )
        p13, s13 = self._mx(w13, q.w13_weight_scale, fmt, self.steps)
        p2, s2 = self._mx(w2, q.w2_weight_scale, fmt, self.steps)
        return ExpertWeights(fmt, p13, s13, p2, s2)


class SwappedNibbles:
    """The broken control: round-to-nearest with every packed weight byte's two 4-bit halves swapped
    (notebook 01's packing bug, as a technique). Shapes, dtypes and scales stay valid, so the loader
    cannot see it; each expert's adjacent input columns trade places, which garbles its output. Not
    registered in ``TECHNIQUES``: the workbook's check that the evaluation sees a broken checkpoint."""

    name = "swapped_nibbles"

    def config(self) -> dict:
        return {}

    def quantize_experts(self, w13, w2, scheme, *, layer):
        q = quantize_expert_weights(w13, w2, scheme)
        swap = lambda b: ((b & 0x0F) << 4) | (b >> 4)  # noqa: E731
        return ExpertWeights(
            q.scheme,
            swap(q.w13_weight),
            q.w13_weight_scale,
            swap(q.w2_weight),
            q.w2_weight_scale,
            q.w13_weight_scale_2,
            q.w2_weight_scale_2,
            q.global_scale_kind,
        )


# ----------------------------------------------------------------------------- what runs, what changed


def _properties(obj) -> list[str]:
    """``name:type`` of the value of every property of ``obj``'s class (``error`` where reading it raises)."""
    out = []
    for name in sorted(dir(type(obj))):
        if isinstance(getattr(type(obj), name, None), property):
            try:
                out.append(f"{name}:{type(getattr(obj, name)).__qualname__}")
            except Exception as err:  # noqa: BLE001  a property that cannot be read is recorded, not hidden
                out.append(f"{name}:error {type(err).__name__}")
    return out


def kernel_path(model) -> list[dict]:
    """What each MoE layer's loaded experts run: the experts' class, backend (as set and as
    resolved on their device), numerics, whether the FP4 kernel applies, the buffers (name, dtype,
    shape), the public attributes the instance sets, the types its properties hold (an online
    rotation is one) and any other module or hook in the MoE block. Two checkpoints whose paths are
    equal run the same kernels on the same operand shapes."""
    out = []
    for mlp in moe_layers(model):
        ex = mlp.experts
        inner = getattr(ex, "experts", ex)
        dev = next(iter(inner.buffers())).device
        out.append(
            dict(
                block=type(mlp).__qualname__,
                modules=sorted(f"{n}:{type(m).__qualname__}" for n, m in mlp.named_modules() if n),
                experts=type(inner).__qualname__,
                backend=inner.backend,
                resolved_backend=inner.resolved_backend(dev),
                numerics=str(getattr(inner, "numerics", "")),
                fp4_kernel=bool(inner.fp4_kernel_applies()) if hasattr(inner, "fp4_kernel_applies") else False,
                buffers=sorted((n, str(b.dtype), tuple(b.shape)) for n, b in inner.named_buffers()),
                # what the instance sets beyond its class, and what its properties hold (an online rotation)
                attributes=sorted(
                    f"{k}:{type(v).__qualname__}"
                    for k, v in vars(inner).items()
                    if not k.startswith("_") and v is not None and not isinstance(v, (torch.Tensor, torch.nn.Module))
                ),
                properties=_properties(inner),
                hooks=len(mlp._forward_pre_hooks) + len(mlp._forward_hooks) + len(ex._forward_pre_hooks),
            )
        )
    return out


def _effective_scales(q: ExpertWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block's scale as applied (fp32): E8M0 ``2^(b - 127)``; NVFP4 ``e4m3 * weight_scale_2`` (decode)."""
    s = q.scheme
    if not s.has_global_scale:
        return R.decode_e8m0(q.w13_weight_scale), R.decode_e8m0(q.w2_weight_scale)
    g13, g2 = q.w13_weight_scale_2.float(), q.w2_weight_scale_2.float()
    if q.global_scale_kind == "encode":
        g13, g2 = 1 / g13, 1 / g2
    b13 = q.w13_weight_scale.float()
    if g13.ndim == 2:
        i = b13.shape[1] // 2
        g13 = g13.repeat_interleave(i, dim=1).unsqueeze(-1)
    else:
        g13 = g13.reshape(-1, 1, 1)
    return b13 * g13, q.w2_weight_scale.float() * g2.reshape(-1, 1, 1)


# the histogram of block_changes: log2 of the scale ratio in bins of 1/16 over [-RATIO_SPAN, RATIO_SPAN]
RATIO_SPAN = 3.0
RATIO_BINS = 96


def block_changes(q: ExpertWeights, base: ExpertWeights) -> dict:
    """How ``q`` differs from ``base`` (RTN) block by block: ``scales_changed`` (share of blocks
    whose applied scale differs), ``codes_changed`` (share of packed bytes that differ) and the
    histogram of ``log2(q's scale / base's)`` over the changed blocks: ``ratio_log2_edges``
    (``RATIO_BINS + 1`` edges over ``[-RATIO_SPAN, RATIO_SPAN]``, ratios beyond clamped to the end
    bins) and ``ratio_counts``; ``ratios``: the distinct ratios when there are at most 8, else None."""
    a, b = _effective_scales(q), _effective_scales(base)
    logs, changed, blocks = [], 0, 0
    for x, y in zip(a, b):
        diff = x != y
        changed += int(diff.sum())
        blocks += diff.numel()
        ok = diff & (y > 0) & (x > 0)
        logs.append(torch.log2(x[ok].double() / y[ok].double()))
    logs = torch.cat(logs)
    counts = torch.histc(logs.clamp(-RATIO_SPAN, RATIO_SPAN), RATIO_BINS, -RATIO_SPAN, RATIO_SPAN)
    distinct = torch.unique(logs)
    pairs = ((q.w13_weight, base.w13_weight), (q.w2_weight, base.w2_weight))
    bytes_changed = sum(int((x != y).sum()) for x, y in pairs)
    return dict(
        scales_changed=changed / blocks,
        codes_changed=bytes_changed / (q.w13_weight.numel() + q.w2_weight.numel()),
        ratio_log2_edges=torch.linspace(-RATIO_SPAN, RATIO_SPAN, RATIO_BINS + 1).tolist(),
        ratio_counts=[int(c) for c in counts.tolist()],
        ratios=sorted(float(2.0**v) for v in distinct.tolist()) if distinct.numel() <= 8 else None,
    )


# ----------------------------------------------------------------------------- the rotation trap


def random_sign_hadamard(n: int, seed: int | None = 0) -> torch.Tensor:
    """``[n, n]`` fp32 orthonormal ``diag(signs) @ H_n / sqrt(n)``, ``H_n`` Sylvester's Hadamard matrix
    (``H_1 = [1]``, ``H_2m = [[H_m, H_m], [H_m, -H_m]]``), ``signs`` random +-1 from ``seed`` (all +1
    for ``seed=None``). Rows ``x [.., n] @ it`` rotate; ``@ it.T`` rotates back.

    Raises:
        ValueError: ``n`` not a power of two >= 1.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or n & (n - 1):
        raise ValueError(f"n: expected a power of two >= 1, got {n!r}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.ones(n, dtype=torch.float64)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        signs = torch.where(torch.rand(n, generator=g, dtype=torch.float64) < 0.5, -1.0, 1.0)
    return (signs[:, None] * h / math.sqrt(n)).float()


def block_rotate(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``x [..., k]`` with each run of ``n`` consecutive values (``h [n, n]``) multiplied by ``h`` (fp32).

    Raises:
        ValueError: ``k`` not a multiple of ``n``.
    """
    n, k = h.shape[0], x.shape[-1]
    if k % n:
        raise ValueError(f"x: last dimension {k} is not a multiple of the rotation's {n} points")
    return (x.float().reshape(*x.shape[:-1], k // n, n) @ h).reshape(x.shape)


# ----------------------------------------------------------------------------- outliers in fixed channels

# the rotation trap's metrics: name -> (unit text, higher is better)
TRAP_METRICS = {
    "activation SQNR (dB)": ("sqnr_db", True),
    "other channels' SQNR (dB)": ("other_sqnr_db", True),
    "outlier channels' relative error": ("outlier_rel_error", False),
    "GEMM output relative error": ("gemm_rel_error", False),
}
# an outlier channel's value in a token: sign * outlier_scale * (1 + OUTLIER_SPREAD * N(0, 1))
OUTLIER_SPREAD = 0.1


def _positive_int(v, name: str, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {v!r}")
    return v


def outlier_layer(channels: int, out_features: int, outlier_channels: int, outlier_scale: float, seed: int = 0) -> dict:
    """A synthetic linear layer whose inputs hold outliers in fixed channels, as LLM activations do (a few hidden
    dimensions carry large magnitudes in nearly every token: Dettmers et al., LLM.int8(), arXiv 2208.07339).

    Returns ``{"channels", "outlier_idx" (int64 [outlier_channels], sorted), "outlier_sign" (fp32 +-1
    [outlier_channels]), "outlier_scale", "weight" (fp32 [out_features, channels], N(0, 1 / channels))}``, all
    drawn from ``seed``; ``layer_tokens`` draws its inputs.

    Raises:
        ValueError: a count that is not a positive int, ``outlier_channels > channels``, ``outlier_scale`` not a
            finite number > 0.
    """
    _positive_int(channels, "channels")
    _positive_int(out_features, "out_features")
    _positive_int(outlier_channels, "outlier_channels")
    if outlier_channels > channels:
        raise ValueError(f"outlier_channels: expected at most channels={channels}, got {outlier_channels}")
    if (
        isinstance(outlier_scale, bool)
        or not isinstance(outlier_scale, (int, float))
        or not (math.isfinite(outlier_scale) and outlier_scale > 0)
    ):
        raise ValueError(f"outlier_scale: expected a finite number > 0, got {outlier_scale!r}")
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(channels, generator=g)[:outlier_channels].sort().values
    sign = torch.where(torch.rand(outlier_channels, generator=g) < 0.5, -1.0, 1.0)
    weight = torch.randn(out_features, channels, generator=g) / math.sqrt(channels)
    return dict(
        channels=channels, outlier_idx=idx, outlier_sign=sign, outlier_scale=float(outlier_scale), weight=weight
    )


def layer_tokens(layer: dict, tokens: int, seed: int) -> torch.Tensor:
    """``[tokens, channels]`` fp32 inputs of ``outlier_layer``'s layer: N(0, 1) in every channel but the outlier
    channels, which hold ``sign * outlier_scale * (1 + OUTLIER_SPREAD * N(0, 1))`` in every token. Seeded.

    Raises:
        ValueError: ``tokens`` not a positive int.
    """
    _positive_int(tokens, "tokens")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, layer["channels"], generator=g)
    idx = layer["outlier_idx"]
    big = 1.0 + OUTLIER_SPREAD * torch.randn(tokens, idx.numel(), generator=g)
    x[:, idx] = layer["outlier_sign"] * layer["outlier_scale"] * big
    return x


def _activation_global_scale(name: str, calib: torch.Tensor):
    """NVFP4's static activation encode scale ``6 * 448 / amax`` from calibration tokens (vLLM's ``1 /
    input_scale``); None for a format without a global scale."""
    if not get_block_scheme(name).has_global_scale:
        return None
    return get_block_scheme(name).scale_divisor / calib.abs().amax().float()


def _qdq(x: torch.Tensor, name: str, global_scale=None) -> torch.Tensor:
    if get_block_scheme(name).has_global_scale:
        return R.quant_dequant(x, name, global_scale=global_scale)
    return R.quant_dequant(x, name, scale_mode="even")


def amax_over_scale(x: torch.Tensor, name: str, global_scale=None) -> torch.Tensor:
    """Each block's ``amax / scale``: where round-to-nearest's scale puts the block's largest magnitude on e2m1's
    grid before the rounding (values above 6 saturate to 6). ``[..., k / block_size]`` fp32.

    NVFP4 (``global_scale``: the encode scale, default ``6 * 448 / amax(x)``): ``scale = s / gs`` with ``s =
    e4m3(gs * amax / 6)``, so the ratio is ``6 v / e4m3(v)`` for ``v = gs * amax / 6``: within e4m3's rounding of 6
    (``[6 * 17 / 18, 6 * 17 / 16] = [5.67, 6.375]`` while ``v`` is a normal e4m3 value up to 448), farther where
    ``v`` is subnormal or exceeds 448 (a block larger than the calibration saw). MXFP4 (``even`` rule): a power of
    two, the ratio in ``[3.5, 7)``.
    """
    s = get_block_scheme(name)
    xb = x.float().reshape(*x.shape[:-1], x.shape[-1] // s.block_size, s.block_size)
    amax = xb.abs().amax(dim=-1)
    if s.has_global_scale:
        gs = _activation_global_scale(name, x) if global_scale is None else torch.as_tensor(global_scale).float()
        code = R.nvfp4_block_stats(x.float(), gs, s.block_size)["scale_code"]
        return amax * gs / R.decode_element(code, "e4m3")
    return amax / R.decode_e8m0(R.e8m0_scale(amax, s.element, "even"))


def _trap_measures(x_energy: torch.Tensor, x, back, out, y_ref, y) -> dict:
    """The four measures of ``rotation_trap`` from per-channel sums (``x_energy``: ``sum(x^2)`` per channel)."""
    err = ((back.double() - x.double()) ** 2).sum(0)
    return dict(
        sqnr_db=sqnr_db_from_sums(float(x_energy.sum()), float(err.sum())),
        other_sqnr_db=sqnr_db_from_sums(float(x_energy[~out].sum()), float(err[~out].sum())),
        outlier_rel_error=float(err[out].sum() / x_energy[out].sum()) ** 0.5,
        gemm_rel_error=float(torch.linalg.norm(y - y_ref) / torch.linalg.norm(y_ref)),
    )


def rotation_trap(
    layer: dict, tokens: int = 128, draws: int = 6, points=(16, 128), formats=("nvfp4", "mxfp4"), seed: int = 0
) -> dict:
    """QDQ of an ``outlier_layer``'s inputs and weight, plain and after a random-sign block Hadamard rotation of
    each size in ``points`` (both operands rotated along K: ``x W^T = (x R)(W R)^T``), over ``draws`` draws.

    Each draw ``j`` takes its own evaluation tokens and calibration tokens (``tokens`` each, ``layer_tokens``) and
    its own rotation signs (``random_sign_hadamard(n, seed + j)``): the three sources a reader would vary, varied
    together. Per format: activations QDQ'd with NVFP4's static global scale calibrated on the draw's calibration
    tokens (rotated like the inputs; ``6 * 448 / amax``), MXFP4 with the ``even`` rule; the weight QDQ'd with its
    own scales (NVFP4's global scale from its amax).

    Per draw, format and setting (``points`` 0 for plain): ``sqnr_db`` of the activations (rotated back) over every
    value (energy-weighted: the outlier channels dominate it), ``other_sqnr_db`` over the other channels,
    ``outlier_rel_error`` (the outlier channels' RMS error over their RMS), ``gemm_rel_error``: ``|x_qdq W_qdq^T -
    x W^T| / |x W^T|`` (Frobenius norms; the reference in float64 from the unquantized operands).

    Returns:
        ``{"draws": per-draw rows (format, points, draw, the four measures), "rows": one row per format and
        rotation size with each measure's mean over the draws plain and rotated (``rotated_*``) and
        ``delta_db`` (rotated minus plain activation SQNR), "outlier_energy": the outlier channels' share of the
        inputs' energy (mean over draws), "amax_over_scale": per format, min, max and the share of blocks above 6
        of ``amax_over_scale`` on draw 0's plain inputs}``.

    Raises:
        ValueError: ``tokens`` or ``draws`` not an int >= 1 / >= 2; a size in ``points`` not a power of two
            dividing ``channels``; ``channels`` not a multiple of a format's block size.
    """
    _positive_int(tokens, "tokens")
    _positive_int(draws, "draws", 2)
    k = layer["channels"]
    points = tuple(points)
    for n in points:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1 or n & (n - 1) or k % n:
            raise ValueError(f"points: expected powers of two dividing channels={k}, got {n!r}")
    for name in formats:
        if k % get_block_scheme(name).block_size:
            raise ValueError(f"channels: {k} is not a multiple of {name}'s block size")
    w = layer["weight"]
    out = torch.zeros(k, dtype=torch.bool)
    out[layer["outlier_idx"]] = True
    per_draw, energy, amax = [], [], {}
    plain_w = {name: _qdq(w, name) for name in formats}
    for j in range(draws):
        x = layer_tokens(layer, tokens, 2 * (seed * draws + j) + 1)
        calib = layer_tokens(layer, tokens, 2 * (seed * draws + j) + 2)
        y_ref = x.double() @ w.double().T
        x_energy = (x.double() ** 2).sum(0)
        energy.append(float(x_energy[out].sum() / x_energy.sum()))
        for name in formats:
            gs = _activation_global_scale(name, calib)
            if j == 0:
                ratio = amax_over_scale(x, name, gs)
                amax[name] = dict(
                    min=float(ratio.min()), max=float(ratio.max()), above_6=float((ratio > 6).double().mean())
                )
            xq = _qdq(x, name, gs)
            per_draw.append(
                dict(
                    format=name,
                    points=0,
                    draw=j,
                    **_trap_measures(x_energy, x, xq, out, y_ref, xq.double() @ plain_w[name].double().T),
                )
            )
            for n in points:
                h = random_sign_hadamard(n, seed + j)
                xr = block_rotate(x, h)
                xq = _qdq(xr, name, _activation_global_scale(name, block_rotate(calib, h)))
                wq = _qdq(block_rotate(w, h), name)
                y = xq.double() @ wq.double().T
                per_draw.append(
                    dict(
                        format=name,
                        points=n,
                        draw=j,
                        **_trap_measures(x_energy, x, block_rotate(xq, h.T), out, y_ref, y),
                    )
                )
    rows = []
    for name in formats:
        plain = [r for r in per_draw if r["format"] == name and r["points"] == 0]
        for n in points:
            rot = [r for r in per_draw if r["format"] == name and r["points"] == n]
            row = dict(format=name, points=n, draws=draws)
            for _, (col, _) in TRAP_METRICS.items():
                row[col] = sum(r[col] for r in plain) / draws
                row[f"rotated_{col}"] = sum(r[col] for r in rot) / draws
            row["delta_db"] = row["rotated_sqnr_db"] - row["sqnr_db"]
            rows.append(row)
    return dict(draws=per_draw, rows=rows, outlier_energy=sum(energy) / draws, amax_over_scale=amax)


def trap_series(draw_rows: list[dict], name: str, points: int, column: str) -> list[float]:
    """One measure's values over the draws (in draw order) of ``rotation_trap``'s per-draw rows for format
    ``name`` and setting ``points`` (0: plain)."""
    rows = sorted((r for r in draw_rows if r["format"] == name and r["points"] == points), key=lambda r: r["draw"])
    return [r[column] for r in rows]


def trap_noise(draw_rows: list[dict], name: str, column: str) -> float:
    """The measure's noise level for format ``name``: the largest difference between the first and the second
    half of the draws of one setting (plain or a rotation size), over the settings (``mxlib.stats.largest_difference``):
    how far the measure moves when only the draw changes. The smallest difference worth reporting."""
    settings = sorted({r["points"] for r in draw_rows if r["format"] == name})
    pairs = []
    for p in settings:
        v = trap_series(draw_rows, name, p, column)
        h = len(v) // 2
        pairs.append((v[:h], v[h : 2 * h]))
    return largest_difference(*pairs)


def add_trap_comparisons(family: ComparisonFamily, trap: dict) -> list[str]:
    """Add every rotated-against-plain comparison of ``rotation_trap``'s result to ``family``: per format, rotation
    size and ``TRAP_METRICS`` measure, ``"<format> rotated <n>"`` against ``"<format> plain"`` over the draws
    (``over="draws"``), with ``trap_noise`` as the smallest difference worth reporting. Returns the keys."""
    rows = trap["draws"]
    keys = []
    for r in trap["rows"]:
        name, n = r["format"], r["points"]
        for metric, (col, higher) in TRAP_METRICS.items():
            keys.append(
                family.add(
                    f"{name} rotated {n}",
                    f"{name} plain",
                    trap_series(rows, name, n, col),
                    trap_series(rows, name, 0, col),
                    metric=metric,
                    higher_is_better=higher,
                    over="draws",
                    smallest=trap_noise(rows, name, col),
                    unit_name="draws (tokens, calibration, rotation signs)",
                )
            )
    return keys
