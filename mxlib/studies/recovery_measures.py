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
from ..analysis import sqnr_db, sqnr_db_from_sums
from ..formats import E8M0_NAN_BYTE, get_block_scheme, get_element_format
from ..models.qwen3 import moe_layers
from ..moe.emulation import ExpertWeights
from ..moe.factory import quantize_expert_weights

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
    "OUTLIER_THRESHOLD",
    "rotation_trap",
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


# values above this magnitude count as outliers in ``rotation_trap`` (N(0, 1) exceeds it with p < 1e-15)
OUTLIER_THRESHOLD = 8.0


def rotation_trap(x: torch.Tensor, points=(16, 128), formats=("nvfp4", "mxfp4"), seed: int = 0) -> list[dict]:
    """QDQ of ``x [rows, k]`` in each block format (``mxlib.reference.quant_dequant``; NVFP4's global
    scale from the amax of what it quantizes, MX with the ``even`` rule) plain and after a random-sign
    block Hadamard rotation of each size in ``points``, rotated back before it is measured.

    Rows per (format, points): ``sqnr_db`` / ``rotated_sqnr_db`` (energy-weighted: ``10 log10(|x|^2 /
    |err|^2)`` over every value, which the outliers dominate), ``delta_db``; ``bulk_sqnr_db`` /
    ``rotated_bulk_sqnr_db`` over the values at most ``OUTLIER_THRESHOLD`` in magnitude;
    ``outlier_rel_error`` / ``rotated_outlier_rel_error``: the outliers' RMS error over their RMS;
    ``outlier_energy``: the outliers' share of ``|x|^2``.
    """
    x = x.float()
    out = ~(x.abs() <= OUTLIER_THRESHOLD)
    energy = float((x.double() ** 2).sum())

    def measures(y):
        e = (y.double() - x.double()) ** 2
        o = float(e[out].sum() / (x.double()[out] ** 2).sum()) ** 0.5 if out.any() else 0.0
        return sqnr_db(y, x), sqnr_db(y[~out], x[~out]), o

    rows = []
    for name in formats:
        kw = {} if get_block_scheme(name).has_global_scale else {"scale_mode": "even"}
        plain = measures(R.quant_dequant(x, name, **kw))
        for n in points:
            h = random_sign_hadamard(n, seed)
            back = block_rotate(R.quant_dequant(block_rotate(x, h), name, **kw), h.T)
            rot = measures(back)
            rows.append(
                dict(
                    format=name,
                    points=n,
                    sqnr_db=plain[0],
                    rotated_sqnr_db=rot[0],
                    delta_db=rot[0] - plain[0],
                    bulk_sqnr_db=plain[1],
                    rotated_bulk_sqnr_db=rot[1],
                    outlier_rel_error=plain[2],
                    rotated_outlier_rel_error=rot[2],
                    outlier_energy=float((x.double()[out] ** 2).sum()) / energy,
                )
            )
    return rows
