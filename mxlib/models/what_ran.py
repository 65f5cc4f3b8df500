"""What ran: the executed semantics of a loaded or quantized model, per layer and module, counted in one forward.

An engine can run something other than what a checkpoint asks (a W4A4 request served as W4A16, an activation
quantized twice) without saying so. ``what_ran(model)`` runs one forward pass with the activation-QDQ call sites
instrumented and returns one ``RanRow`` per quantized module: every MoE layer's experts (emulation experts, or
bf16 ``TritonExperts`` where the checkpoint excludes them) and every ``EmulatedLinear``. Each row says

* ``weight_format`` / ``activation_format`` (``none`` for weight-only) and ``precision`` (``W4A4``, ``W4A16``, ...);
* ``a1_passes`` / ``a2_passes``: how many times each activation row went through a QDQ in that forward, counted
  for real: every QDQ function of ``mxlib.reference`` and ``mxlib.kernels`` (``quant_dequant_mx``,
  ``ref_nvfp4_quant_dequant``, ``ref_nvfp4_quant``, ``quant_dequant_fp8_per_tensor``,
  ``quant_dequant_fp8_per_token``,
  ``nvfp4_per_token_quant_dequant``, ``quant_dequant_nvfp4_variant``) counts the rows it is given while an
  experts module's ``quantize_input`` (a1, the layer input) or ``quantize_intermediate`` (a2, the gated
  activation's output) runs, or an ``EmulatedLinear`` quantizes its input; the fused kernels that QDQ inside
  the GEMM (``fused_fp4_moe``: a1 and a2; ``invoke_fused_dequant_moe``: a2) count the rows of the
  ``ActivationQDQ`` they are handed. The count is rows QDQ'd over the rows there are (``M`` tokens for a1, or
  ``M * k`` where a1 is QDQ'd per (token, expert) pair; ``M * k`` for a2): 1 is once, 0 is not at all, 2 twice;
* ``scale_strategy``, ``numerics``, ``backend`` (resolved) and ``kernel`` (the MoE functions actually called:
  ``torch_moe``, ``fused_moe_kernel``, ``fused_dequant_moe``, ``fused_fp4_moe``; ``linear`` for
  ``EmulatedLinear``'s dequantize-then-matmul).

``assert_runs_as(model, expected)`` refuses a mismatch with what the checkpoint asks (a ``CheckpointDescription``
from ``load_quantized_moe``, a ``MoEQuantScheme`` or a scheme name): another scheme, a weight-only fallback
(a QDQ that did not happen), a double QDQ, a module that did not run, bf16 experts the checkpoint does not exclude.
``WhatRan.table()`` renders the rows as text (``mxlib inspect --ran PATH`` prints it).
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field

import torch

from .. import kernels as _kernels
from .. import reference as _ref
from ..checkpoints.layout import CheckpointDescription
from ..checkpoints.loader import _experts_excluded
from ..moe import base as _base
from ..moe import emulation as _emulation
from ..moe.base import TransformersExperts, TritonExperts, resolve_backend
from ..moe.linear import EmulatedLinear
from ..moe.schemes import MoEQuantScheme, get_moe_scheme
from ..text_table import text_table
from .families import family_of

__all__ = ["RanRow", "WhatRan", "RanMismatch", "what_ran", "assert_runs_as", "QDQ_FUNCTIONS"]

# The activation QDQ functions whose calls are counted (in mxlib.reference and their twins in mxlib.kernels).
QDQ_FUNCTIONS = (
    "quant_dequant_mx",
    "ref_nvfp4_quant_dequant",
    "ref_nvfp4_quant",
    "quant_dequant_fp8_per_tensor",
    "quant_dequant_fp8_per_token",
    "nvfp4_per_token_quant_dequant",
    "quant_dequant_nvfp4_variant",
)
# The MoE GEMM entry points an experts forward dispatches to (module attribute -> kernel name).
_DISPATCH = {
    "torch_moe": "torch_moe",
    "invoke_fused_moe_kernel": "fused_moe_kernel",
    "invoke_fused_dequant_moe": "fused_dequant_moe",
    "fused_fp4_moe": "fused_fp4_moe",
    "fused_fp4_moe_impl": "fused_fp4_moe",  # what the experts call, their inputs checked once in their forward
}
_PHASES = ("a1", "a2")


@dataclass(frozen=True)
class RanRow:
    """The executed semantics of one module in one forward (module docstring). ``a2_*`` is None for a linear
    layer (it has one activation point, its input, reported as a1)."""

    module: str
    layer: int | None
    kind: str  # "experts" or "linear"
    scheme: str  # the scheme the module runs; "bf16" for unquantized experts
    weight_format: str
    activation_format: str
    precision: str
    a1_where: str
    a1_passes: float
    a2_where: str | None
    a2_passes: float | None
    scale_strategy: str
    numerics: str
    backend: str
    kernel: str
    forwards: int


_COLUMNS = (
    ("module", 34),
    ("scheme", 20),
    ("precision", 9),
    ("weight", 11),
    ("activation", 11),
    ("a1", 4),
    ("a2", 4),
    ("scales", 12),
    ("numerics", 8),
    ("backend", 7),
    ("kernel", 30),
)


def _passes(v: float | None) -> str:
    return "-" if v is None else (str(int(v)) if float(v).is_integer() else f"{v:.2f}")


@dataclass
class WhatRan:
    """The rows of ``what_ran``; ``table()`` renders them, ``to_dicts()`` gives JSON-ready dicts."""

    rows: list[RanRow]

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, module: str) -> RanRow:
        """The row of a module by name (``model.layers.0.mlp.experts``).

        Raises:
            KeyError: no such module in the report (the message lists them).
        """
        for r in self.rows:
            if r.module == module:
                return r
        raise KeyError(f"module: {module!r} is not in the report; it has {[r.module for r in self.rows]}")

    def to_dicts(self) -> list[dict]:
        return [asdict(r) for r in self.rows]

    def table(self) -> str:
        """One line per module: scheme, precision, formats, QDQ passes of a1 / a2 in the forward (``-``: no such
        point), scale strategy, numerics, backend, kernel."""
        cells = [
            (
                r.module,
                r.scheme,
                r.precision,
                r.weight_format,
                r.activation_format,
                _passes(r.a1_passes),
                _passes(r.a2_passes),
                r.scale_strategy,
                r.numerics,
                r.backend,
                r.kernel,
            )
            for r in self.rows
        ]
        names, widths = zip(*_COLUMNS)
        lines = text_table(names, cells, widths=widths, sep="  ", rstrip=True)
        where = {(r.a1_where, r.a2_where) for r in self.rows}
        lines.append(
            "a1 / a2: QDQ passes of each activation row in one forward ("
            + "; ".join(f"a1 = {a}" + ("" if b is None else f", a2 = {b}") for a, b in sorted(where, key=str))
            + ")"
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


class RanMismatch(AssertionError):
    """What ran differs from what the checkpoint asks; ``problems`` lists each difference."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("what ran differs from what was asked:\n  " + "\n  ".join(problems))


# ----------------------------------------------------------------------------- instrumentation


@dataclass
class _Record:
    rows: dict[str, int] = field(default_factory=lambda: {p: 0 for p in _PHASES})
    expected: dict[str, int] = field(default_factory=lambda: {p: 0 for p in _PHASES})
    kernels: list[str] = field(default_factory=list)
    forwards: int = 0
    tokens: int = 0
    pairs: int = 0


class _Counter:
    """The instrumentation of one forward: which record (module) and phase (a1 / a2) a QDQ call belongs to."""

    def __init__(self):
        self.stack: list[tuple[_Record, str | None]] = []
        self.depth = 0

    def qdq(self, fn):
        def counted(x, *args, **kwargs):
            if self.stack and self.depth == 0 and self.stack[-1][1] is not None and isinstance(x, torch.Tensor):
                rec, phase = self.stack[-1]
                rec.rows[phase] += x.numel() // max(1, x.shape[-1]) if x.ndim else 1
            self.depth += 1
            try:
                return fn(x, *args, **kwargs)
            finally:
                self.depth -= 1

        return counted

    def dispatch(self, name, fn):
        def called(*args, **kwargs):
            if self.stack:
                rec = self.stack[-1][0]
                if name not in rec.kernels:
                    rec.kernels.append(name)
                if name in ("fused_fp4_moe", "fused_dequant_moe"):
                    self._kernel_qdq(rec, name, args, kwargs)
            return fn(*args, **kwargs)

        return called

    @staticmethod
    def _kernel_qdq(rec: _Record, name: str, args, kwargs) -> None:
        """The QDQs a fused kernel does inside the GEMM: its ``ActivationQDQ`` arguments, one pass over their rows."""
        if name == "fused_fp4_moe":
            a1, topk_ids = args[0], args[4] if len(args) > 4 else kwargs["topk_ids"]
            a1_qdq, a2_qdq = kwargs.get("a1_qdq"), kwargs.get("a2_qdq")
            if a1_qdq is not None and a1_qdq.fmt is not None:
                rec.rows["a1"] += a1.shape[0]
        else:
            topk_ids = args[4] if len(args) > 4 else kwargs["topk_ids"]
            a2_qdq = args[5] if len(args) > 5 else kwargs.get("a2_qdq")
        if a2_qdq is not None and a2_qdq.fmt is not None:
            rec.rows["a2"] += topk_ids.numel()

    def phase(self, rec: _Record, phase: str | None, fn):
        def in_phase(*args, **kwargs):
            self.stack.append((rec, phase))
            try:
                return fn(*args, **kwargs)
            finally:
                self.stack.pop()

        return in_phase


def _set_instance(obj, name: str, value, undo: list) -> None:
    """Set an instance attribute over the class's method (keeping one a caller set before: it is restored)."""
    had = name in obj.__dict__
    old = obj.__dict__.get(name)
    object.__setattr__(obj, name, value)
    undo.append(lambda: object.__setattr__(obj, name, old) if had else obj.__dict__.pop(name, None))


def _instrument_experts(experts: TritonExperts, rec: _Record, counter: _Counter, undo: list) -> None:
    forward, quantize_input, quantize_intermediate = (
        experts.forward,
        experts.quantize_input,
        experts.quantize_intermediate,
    )

    def counted_forward(hidden_states, topk_weights, topk_ids, *args, **kwargs):
        rec.forwards += 1
        rec.tokens += hidden_states.shape[0]
        rec.pairs += topk_ids.numel()
        rec.expected["a2"] += topk_ids.numel()
        return counter.phase(rec, None, forward)(hidden_states, topk_weights, topk_ids, *args, **kwargs)

    def counted_input(a1, topk_ids, backend):
        out = counter.phase(rec, "a1", quantize_input)(a1, topk_ids, backend)
        rec.__dict__["per_pair"] = bool(out[1])
        return out

    _set_instance(experts, "forward", counted_forward, undo)
    _set_instance(experts, "quantize_input", counted_input, undo)
    _set_instance(experts, "quantize_intermediate", counter.phase(rec, "a2", quantize_intermediate), undo)


def _instrument_linear(lin: EmulatedLinear, rec: _Record, counter: _Counter, undo: list) -> None:
    forward = lin.forward

    def counted_forward(x):
        rec.forwards += 1
        rec.tokens += x.numel() // lin.in_features
        if "linear" not in rec.kernels:
            rec.kernels.append("linear")
        return counter.phase(rec, "a1", forward)(x)

    _set_instance(lin, "forward", counted_forward, undo)


@contextlib.contextmanager
def _patched(counter: _Counter):
    """The QDQ functions and the MoE dispatch entry points wrapped for the duration of the forward."""
    with contextlib.ExitStack() as stack:
        for module in (_ref, _kernels):
            for name in QDQ_FUNCTIONS:
                if hasattr(module, name):
                    stack.enter_context(_attr(module, name, counter.qdq(getattr(module, name))))
        for module in (_base, _emulation):
            for name, kernel in _DISPATCH.items():
                if hasattr(module, name):
                    stack.enter_context(_attr(module, name, counter.dispatch(kernel, getattr(module, name))))
        yield


@contextlib.contextmanager
def _attr(module, name, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


# ----------------------------------------------------------------------------- rows


def _scheme_of(module) -> MoEQuantScheme | None:
    s = getattr(module, "scheme", None)
    if isinstance(s, MoEQuantScheme):
        return s
    fmt = getattr(module, "weight_scheme", None)
    if fmt is None:
        return None  # bf16 TritonExperts
    return next((c for c in _candidates() if c.weight is fmt and c.activation is _activation_of(module)), None)


def _candidates():
    from ..moe.schemes import MOE_SCHEMES, NVFP4_VARIANT_SCHEMES

    return [*MOE_SCHEMES.values(), *NVFP4_VARIANT_SCHEMES.values()]


def _activation_of(module):
    if getattr(module, "quant_dtype", None) is None:
        return None
    return getattr(module, "activation_format", None) or getattr(module, "weight_scheme", None)


def _scale_strategy(module, scheme: MoEQuantScheme | None, kind: str) -> str:
    """How the activation scales are set: the experts' ``scale_strategy`` (NVFP4), ``static max`` (per-expert
    static scales unified to their max), ``static`` (a linear layer's one input scale), ``dynamic <rule>`` (MX),
    ``dynamic per token`` (FP8 per token)."""
    act = None if scheme is None else scheme.activation
    if act is None:
        return "-"
    strategy = getattr(module, "scale_strategy", None)
    if strategy is not None:
        return str(strategy)
    if act.static_scale:
        return "static max" if kind == "experts" else "static"
    if getattr(act, "per_token", False):
        return "dynamic per token"
    return f"dynamic {getattr(module, 'activation_scale_mode', '')}".strip()


def _row(name: str, layer: int | None, module, rec: _Record, device: torch.device, kind: str) -> RanRow:
    scheme = _scheme_of(module)
    act = None if scheme is None else scheme.activation
    if kind == "experts":
        per_pair = rec.__dict__.get("per_pair", False)
        a1_rows = rec.pairs if per_pair else rec.tokens
        a1 = rec.rows["a1"] / a1_rows if a1_rows else 0.0
        a2 = rec.rows["a2"] / rec.expected["a2"] if rec.expected["a2"] else 0.0
        backend = module.resolved_backend(device)
        a1_where = "layer input, per (token, expert) pair" if per_pair else "layer input, per token"
        a2_where = "gated activation output, per (token, expert)"
    else:
        a1 = rec.rows["a1"] / rec.tokens if rec.tokens else 0.0
        a2 = a2_where = None
        backend = resolve_backend(module.backend, device)
        a1_where = "linear input, per row"
    return RanRow(
        module=name,
        layer=layer,
        kind=kind,
        scheme="bf16" if scheme is None else scheme.name,
        weight_format="bf16" if scheme is None else scheme.weight.name,
        activation_format="none" if act is None else act.name,
        precision="W16A16" if scheme is None else scheme.precision,
        a1_where=a1_where,
        a1_passes=a1,
        a2_where=a2_where,
        a2_passes=a2,
        scale_strategy=_scale_strategy(module, scheme, kind),
        numerics=str(getattr(module, "numerics", "vllm")),
        backend=backend,
        kernel="+".join(rec.kernels) or "-",
        forwards=rec.forwards,
    )


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    for a, b in zip(parts, parts[1:]):
        if a in ("layers", "h", "blocks") and b.isdigit():
            return int(b)
    return None


def _modules(model) -> list[tuple[str, str, torch.nn.Module]]:
    """``(name, kind, module)`` of the experts and emulated linear layers of ``model`` (or ``model`` itself)."""
    if isinstance(model, TritonExperts):
        return [("experts", "experts", model)]
    found = []
    for name, m in model.named_modules():
        if isinstance(m, TransformersExperts):
            found.append((name, "experts", m.experts))
        elif isinstance(m, TritonExperts) and not any(name.startswith(n + ".") for n, _, _ in found):
            found.append((name, "experts", m))
        elif isinstance(m, EmulatedLinear):
            found.append((name, "linear", m))
    return found


def _default_inputs(model):
    if isinstance(model, TritonExperts):
        g = torch.Generator().manual_seed(0)
        m, k = 8, min(2, model.num_experts)
        device = model._device()
        x = torch.randn(m, model.hidden_size, generator=g).to(model.activation_dtype).to(device)
        logits = torch.randn(m, model.num_experts, generator=g)
        w, ids = torch.softmax(logits, -1).topk(k)
        return (x, w.float().to(device), ids.to(torch.int32).to(device)), {}
    cfg = model.config
    device = next(model.parameters()).device
    ids = (torch.arange(16) * 7919 % cfg.vocab_size).reshape(1, 16).to(device)
    return (), {"input_ids": ids}


@torch.no_grad()
def what_ran(model, *args, **kwargs) -> WhatRan:
    """Run one forward of ``model`` with its QDQ call sites instrumented and report what ran (module docstring).

    Args:
        model: a transformers model whose experts are mxlib experts (``load_quantized_moe``, ``swap_experts``),
            or a ``TritonExperts`` (an experts module alone).
        args, kwargs: the forward's inputs: ``(hidden_states [M, H], topk_weights [M, k], topk_ids [M, k])`` for
            an experts module, ``input_ids=...`` (and any other keyword) for a model. None given: 8 seeded random
            tokens routed to 2 experts (experts), or 16 fixed token ids (model).

    Returns:
        ``WhatRan``: one ``RanRow`` per experts module (in layer order) and per ``EmulatedLinear``.

    Raises:
        ValueError: the model holds no mxlib experts and no emulated linear layer (nothing to report).
    """
    found = _modules(model)
    if not found:
        raise ValueError(
            f"model: {type(model).__name__} holds no mxlib experts (TritonExperts) and no EmulatedLinear; load it "
            f"with mxlib.checkpoints.load_quantized_moe or swap its experts first"
        )
    if not args and not kwargs:
        args, kwargs = _default_inputs(model)
    counter, undo, records = _Counter(), [], []
    try:
        for _, kind, m in found:
            rec = _Record()
            records.append(rec)
            (_instrument_experts if kind == "experts" else _instrument_linear)(m, rec, counter, undo)
        with _patched(counter):
            model(*args, **kwargs)
    finally:
        for restore in reversed(undo):
            restore()
    device = args[0].device if args and isinstance(args[0], torch.Tensor) else next(iter(kwargs.values())).device
    return WhatRan([_row(n, _layer_of(n), m, rec, device, k) for (n, k, m), rec in zip(found, records)])


# ----------------------------------------------------------------------------- the check


def _expected_scheme(expected) -> tuple[MoEQuantScheme, CheckpointDescription | None]:
    if isinstance(expected, CheckpointDescription):
        return expected.scheme, expected
    return get_moe_scheme(expected), None


def _excluded(row: RanRow, info: CheckpointDescription | None, model) -> bool:
    """Whether the checkpoint keeps this layer's experts bf16 (its exclude / ignore list names them), as the
    loader decides it."""
    if info is None or not info.exclude or row.layer is None or isinstance(model, TritonExperts):
        return False
    return _experts_excluded(info.exclude, row.layer, family_of(model, "assert_runs_as"))


def _module_expected(row: RanRow, scheme: MoEQuantScheme, info: CheckpointDescription | None, model):
    """What a mixed-precision checkpoint (``info.precision``) asks of one module: the description the loader gave
    it (``checkpoint_description``); the checkpoint's own otherwise."""
    if info is None or info.precision is None or isinstance(model, TritonExperts):
        return scheme, info
    own = getattr(model.get_submodule(row.module), "checkpoint_description", None)
    return (scheme, info) if own is None else (own.scheme, own)


def assert_runs_as(model, expected, *args, report: WhatRan | None = None, **kwargs) -> WhatRan:
    """Refuse a model whose executed semantics differ from what ``expected`` asks; return the report.

    Args:
        model: as for ``what_ran``.
        expected: a ``CheckpointDescription`` (``load_quantized_moe``'s ``info``: its scheme and its exclude
            list; for a mixed-precision checkpoint each module's own description, as the loader gave it), a
            ``MoEQuantScheme`` or a scheme name.
        args, kwargs: the forward's inputs (``what_ran``); ignored when ``report`` is given.
        report: a ``WhatRan`` already measured (no forward is run again).

    Raises:
        RanMismatch: naming each module and what differs: a module in another scheme or precision; an activation
            point QDQ'd 0 times where the scheme quantizes it (a silent weight-only fallback) or more than once (a
            double QDQ), or QDQ'd where the scheme leaves it in the model dtype; a module that did not run in the
            forward; bf16 experts the checkpoint does not exclude.
        ValueError: an unknown scheme name (``get_moe_scheme``).
    """
    asked, asked_info = _expected_scheme(expected)
    report = report if report is not None else what_ran(model, *args, **kwargs)
    problems = []
    for r in report:
        scheme, info = _module_expected(r, asked, asked_info, model)
        want = 0 if scheme.activation is None else 1
        if r.forwards == 0:
            problems.append(f"{r.module}: did not run in the forward")
            continue
        if r.scheme == "bf16":
            if not _excluded(r, info, model):
                problems.append(f"{r.module}: ran bf16 experts, the checkpoint asks {scheme.name} ({scheme.precision})")
            continue
        if r.scheme != scheme.name:
            problems.append(
                f"{r.module}: ran {r.scheme} ({r.precision}), the checkpoint asks {scheme.name} ({scheme.precision})"
            )
        points = [("a1", r.a1_passes, r.a1_where)] + ([] if r.a2_passes is None else [("a2", r.a2_passes, r.a2_where)])
        for point, passes, where in points:
            if passes == want:
                continue
            if want and passes == 0:
                what = f"not quantized (a silent weight-only fallback: ran W{scheme.weight.element.nbits}A16)"
            elif want and passes > 1:
                what = f"quantized {_passes(passes)} times (a double QDQ)"
            elif not want:
                what = f"quantized {_passes(passes)} times where {scheme.name} leaves it in the model dtype"
            else:
                what = f"quantized {_passes(passes)} times (expected once)"
            problems.append(f"{r.module}: {point} ({where}) {what}; the checkpoint asks {scheme.precision}")
    if problems:
        raise RanMismatch(problems)
    return report
