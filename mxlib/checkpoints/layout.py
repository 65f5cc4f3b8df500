"""What every checkpoint layout shares: the error type, the typed description a layout reads
from a config, the ``CheckpointLayout`` base class, the registry the writer and loader dispatch
on, the default layout of each weight format, and exclude-list matching; and what the layouts that
store each expert's projections as their own modules share: ``expert_parts`` (one layer's experts cut
into per-expert gate / up / down tensors) and ``read_block_experts`` (those tensors read back, checked).

A layout is an instance of a ``CheckpointLayout`` subclass. It must have:

* ``name`` (``"modelopt"``, ``"quark"``) and ``quant_method`` (the ``quantization_config.quant_method``
  it reads);
* ``handles(scheme) -> bool``: whether it can store a ``MoEQuantScheme``;
* ``config_files(scheme, quantize_attention) -> (quantization_config, {extra file name: dict})``;
* ``read_config(qc) -> CheckpointDescription`` (raises ``CheckpointError`` naming the field);
* ``read_legacy(folder) -> dict | None``: a ``quantization_config`` from files other than
  ``config.json`` (ModelOpt's ``hf_quant_config.json``), or None; ``folder`` is a path, in a load a
  ``files.folder.CheckpointFolder`` (``CheckpointFolder.of(folder).json(name)`` reads a file once per load);
* ``expert_tensors(scheme, weights, w13_input_scale, w2_input_scale, prefix) -> {name: tensor}``
  (input scales in the layout's stored convention, the one ``read_experts`` returns, so that
  ``expert_tensors`` of what ``read_experts`` read gives back the stored tensors);
* ``read_experts(tensors, prefix, num_experts, hidden_size, intermediate_size, description)
  -> (ExpertWeights, w13_input_scale | None, w2_input_scale | None)``.

It may have (the base class's defaults in brackets):

* ``quantize_experts(w13, w2, scheme) -> ExpertWeights | None``: its own quantization of one
  layer's experts (compressed-tensors' encode scales) [None: the writers quantize with
  ``mxlib.moe.factory.quantize_expert_weights``];
* ``quantize_linear(weight, scheme) -> LinearWeights`` [``quantize_linear_weight``];
* ``stored_input_scale(decode_scale) -> tensor``: calibrated decode activation scales
  (``amax / scale_divisor``) in the convention ``expert_tensors`` and ``linear_tensors`` take
  [as given]; ``global_scale_kind``: the kind of NVFP4 global scale it stores [``"decode"``];
  ``legacy_files``: the config files ``read_legacy`` reads [none];
* ``add_excluded(qc, extra, names)``: the family's unquantized modules (routers, shared experts, dense
  MLPs under their on-disk names) added to its exclude lists where its own patterns miss them [every
  list under a key of ``exclude_keys``: ``ignore``, ``exclude``, ``exclude_modules``];
* ``stacked_experts`` [False]: True when its tensors hold a whole layer's experts (gpt-oss's
  ``gate_up_proj_blocks [E, ...]``): ``expert_tensors`` then takes all ``E`` experts of a layer, and
  ``w13_bias`` / ``w2_bias``; ``stores_expert_biases`` [False]: True when it stores the experts' biases,
  read by ``read_expert_biases(tensors, prefix, e, h, i) -> (w13_bias, w2_bias)`` (the writer refuses a
  family with expert biases for any other layout);
* ``supports_linear`` [False]: True when it stores quantized ``nn.Linear`` layers outside the
  experts, with ``linear_tensors(scheme, weights, input_scale, name) -> {name: tensor}`` and
  ``read_linear(tensors, name, out_features, in_features, description) -> (LinearWeights,
  input_scale | None)`` [both raise ``NotImplementedError``].

``register_layout(layout)`` adds one to ``LAYOUTS``: ``mxlib.checkpoints.layouts`` registers mxlib's
layouts in a fixed order; adding a layout is adding one module there with its ``CheckpointLayout``
subclass and registering its instance. ``DEFAULT_LAYOUT`` names the layout a scheme is
written in when the caller names none, by the scheme's weight format.
"""

from __future__ import annotations

import abc
import fnmatch
from dataclasses import dataclass, field
from pathlib import Path

import regex
import torch

from .._checks import GLOBAL_SCALE_MAX, GLOBAL_SCALE_MIN, bad_block_scale_mask
from ..formats import BLOCK_SCHEMES, NVFP4, BlockScheme
from ..moe.emulation import ExpertWeights
from ..moe.factory import quantize_linear_weight
from ..moe.linear import LinearWeights
from ..moe.schemes import MoEQuantScheme

__all__ = [
    "CheckpointError",
    "CheckpointDescription",
    "CheckpointLayout",
    "LAYOUTS",
    "DEFAULT_LAYOUT",
    "register_layout",
    "layout_for_scheme",
    "layout_for_method",
    "matches",
    "check_exclude_patterns",
    "PROJS",
    "global_scale_check",
    "block_scale_check",
    "expert_parts",
    "read_block_experts",
    "REGEX_TIMEOUT_S",
]

# per-expert projections, in the order w13 (gate rows, then up rows) and w2 stack them
PROJS = ("gate_proj", "up_proj", "down_proj")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing tensor, wrong shape or dtype, unsupported config."""


@dataclass
class CheckpointDescription:
    """What a checkpoint's quantization config says, typed.

    ``format``: the layout's name; ``scheme``: the ``MoEQuantScheme``; ``exclude``: module names or
    patterns left unquantized; ``activation_scale_mode``: the E8M0 rule of dynamic MX activations
    (None when the scheme has none). Readable as a dict (``info["scheme"]``) as before.

    ``precision``: for a mixed-precision checkpoint (modules in different schemes), its
    ``mxlib.checkpoints.precision.PrecisionMap``, which gives each module its own description; ``scheme``
    is then the routed experts' group's (``precision.mixed_description``). None for a single-scheme checkpoint.
    """

    format: str
    scheme: MoEQuantScheme
    exclude: list[str] = field(default_factory=list)
    activation_scale_mode: str | None = None
    precision: object | None = field(default=None, compare=False, repr=False)

    def __getitem__(self, key: str):
        return getattr(self, key)

    def get(self, key: str, default=None):
        return getattr(self, key, default)

    def keys(self):
        return ("format", "scheme", "exclude", "activation_scale_mode")


class CheckpointLayout(abc.ABC):
    """One on-disk layout of quantized MoE checkpoints: its config files, its config parser and its
    tensor names (module docstring: what a layout must and may have). A layout names experts as
    transformers' state dict does (``model.layers.L.mlp.experts.e.gate_proj``); the writer and the
    loader translate to a family's own names on disk (``mxlib.models.families.MoEFamily.disk_name``:
    Mixtral's ``block_sparse_moe.experts.e.w1``), so every layout stores every registered family whose
    experts have no biases (gpt-oss's need ``stores_expert_biases``).

    Subclasses set ``name`` and ``quant_method`` as class attributes and implement the abstract
    methods; ``register_layout(instance)`` makes the writer, the loader, the inspector and the
    dummy-from-config builder use it.
    """

    # True when the layout stores quantized nn.Linear layers outside the experts (attention
    # projections): it then implements linear_tensors and read_linear
    supports_linear: bool = False
    # the kind of NVFP4 global scale (ExpertWeights.global_scale_kind) the layout stores
    global_scale_kind: str = "decode"
    # config files other than config.json that read_legacy reads (a saved model copies them)
    legacy_files: tuple[str, ...] = ()

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """The registry key and ``CheckpointDescription.format`` (``"modelopt"``)."""

    @property
    @abc.abstractmethod
    def quant_method(self) -> str:
        """The ``quantization_config.quant_method`` the layout reads (``"modelopt"``)."""

    @abc.abstractmethod
    def handles(self, scheme: MoEQuantScheme) -> bool:
        """Whether the layout can store ``scheme``."""

    @abc.abstractmethod
    def config_files(self, scheme: MoEQuantScheme, quantize_attention: bool = False) -> tuple[dict, dict[str, dict]]:
        """``(quantization_config, {extra file name: JSON object})`` of a checkpoint of ``scheme``."""

    @abc.abstractmethod
    def read_config(self, qc: dict) -> CheckpointDescription:
        """The typed description of a ``quantization_config``; ``CheckpointError`` naming the field."""

    @abc.abstractmethod
    def read_legacy(self, folder: Path) -> dict | None:
        """A ``quantization_config`` from files other than ``config.json``, or None (``folder``: a path or a
        ``files.folder.CheckpointFolder``, module docstring)."""

    @abc.abstractmethod
    def expert_tensors(
        self, scheme: MoEQuantScheme, weights: ExpertWeights, w13_input_scale, w2_input_scale, prefix: str
    ) -> dict:
        """``{tensor name: tensor}`` of one layer's experts (``prefix``: ``model.layers.L.mlp.experts``);
        input scales in the stored convention (``stored_input_scale``), as ``read_experts`` returns them."""

    @abc.abstractmethod
    def read_experts(self, tensors, prefix: str, e: int, h: int, i: int, description: CheckpointDescription):
        """``(ExpertWeights, w13_input_scale | None, w2_input_scale | None)`` of one layer's ``e``
        experts, read and checked through a ``TensorReader``."""

    def quantize_experts(self, w13: torch.Tensor, w2: torch.Tensor, scheme: MoEQuantScheme) -> ExpertWeights | None:
        """The layout's own quantization of one layer's experts (``w13 [E, 2I, H]``, ``w2 [E, H, I]``),
        called once per layer; None (this default): the writers quantize with
        ``mxlib.moe.factory.quantize_expert_weights`` (the checkpoint writer expert by expert)."""
        return None

    def quantize_linear(self, weight: torch.Tensor, scheme: MoEQuantScheme) -> LinearWeights:
        """One quantized ``[out, in]`` linear weight; default ``mxlib.moe.factory.quantize_linear_weight``."""
        return quantize_linear_weight(weight, scheme)

    # keys of a quantization config's (or an extra config file's) lists of unquantized module names
    exclude_keys: tuple[str, ...] = ("ignore", "exclude", "exclude_modules")

    def add_excluded(self, qc: dict, extra: dict[str, dict], names: list[str]) -> None:
        """Add module names (on-disk names, each exact) the checkpoint stores unquantized to every exclude
        list of ``qc`` and of the extra config files (ModelOpt's ``hf_quant_config.json``), in place, each
        name only where the list's own names and patterns (``matches``) do not cover it already: a Qwen3-MoE
        config of a layout with patterns (ModelOpt's globs, compressed-tensors' ``re:``) stays as the layout
        writes it, a family's shared experts, dense MLPs and routers under other names (Mixtral's
        ``block_sparse_moe.gate``) are named one by one; a layout whose list starts empty (Quark's, whose
        importer takes no ``re:``) gets every name, in ``names``' order."""

        def walk(d):
            for key, value in d.items():
                if key in self.exclude_keys and isinstance(value, list):
                    value.extend([n for n in names if not matches(n, value)])
                elif isinstance(value, dict):
                    walk(value)

        walk(qc)
        for content in extra.values():
            walk(content)

    def stored_input_scale(self, decode_scale: torch.Tensor) -> torch.Tensor:
        """Calibrated decode activation scales (``amax / scale_divisor``, fp32) in the convention
        ``expert_tensors`` and ``linear_tensors`` take (and ``read_experts`` returns); default: as given."""
        return decode_scale

    def linear_tensors(self, scheme: MoEQuantScheme, weights: LinearWeights, input_scale, name: str) -> dict:
        """``{tensor name: tensor}`` of one quantized linear layer ``name`` (``supports_linear``
        layouts); ``input_scale`` in the stored convention (``stored_input_scale``)."""
        raise NotImplementedError(f"layout {self.name} stores no quantized linear layers (supports_linear is False)")

    def read_linear(self, tensors, name: str, out_features: int, in_features: int, description: CheckpointDescription):
        """``(LinearWeights, input_scale | None)`` of one quantized linear layer (``supports_linear`` layouts)."""
        raise NotImplementedError(f"layout {self.name} stores no quantized linear layers (supports_linear is False)")


LAYOUTS: dict[str, CheckpointLayout] = {}

# The layout a scheme is written in when the caller names none, by the scheme's weight format.
DEFAULT_LAYOUT: dict[BlockScheme, str] = {
    NVFP4: "modelopt",
    BLOCK_SCHEMES["mxfp4"]: "quark",
    BLOCK_SCHEMES["mxfp6_e2m3"]: "quark",
    BLOCK_SCHEMES["mxfp6_e3m2"]: "quark",
    BLOCK_SCHEMES["mxfp8_e4m3"]: "quark",
}


def register_layout(layout: CheckpointLayout) -> CheckpointLayout:
    """Add a layout to the registry (keyed by ``layout.name``); returns it.

    Raises:
        TypeError: ``layout`` is not a ``CheckpointLayout``.
    """
    if not isinstance(layout, CheckpointLayout):
        raise TypeError(f"layout: expected a CheckpointLayout instance, got {type(layout).__name__}")
    LAYOUTS[layout.name] = layout
    return layout


def layout_for_scheme(scheme: MoEQuantScheme) -> CheckpointLayout:
    """The layout ``DEFAULT_LAYOUT`` names for ``scheme``'s weight format.

    Raises:
        ValueError: no default layout for the weight format, or one that does not store ``scheme``.
    """
    layout = LAYOUTS.get(DEFAULT_LAYOUT.get(scheme.weight))
    if layout is None or not layout.handles(scheme):
        raise ValueError(f"no checkpoint layout stores scheme {scheme.name}; layouts: {list(LAYOUTS)}")
    return layout


def layout_for_method(method) -> CheckpointLayout:
    """The registered layout that reads ``quantization_config.quant_method == method``."""
    for layout in LAYOUTS.values():
        if layout.quant_method == method:
            return layout
    methods = " or ".join(dict.fromkeys(repr(layout.quant_method) for layout in LAYOUTS.values()))
    raise CheckpointError(f"quantization_config.quant_method: expected {methods}, found {method!r}")


# Exclude lists come from checkpoints, which may be untrusted: ``re:`` patterns run on the
# ``regex`` module with a time limit (Python's ``re`` can backtrack for ages on a pattern such as
# ``(.|.)*Z`` and cannot be interrupted), and patterns are limited in length.
REGEX_TIMEOUT_S = 0.5
_PATTERN_MAX_CHARS = 1000
_compiled: dict[str, object] = {}


def _compile(pattern: str):
    if pattern not in _compiled:
        if len(pattern) > _PATTERN_MAX_CHARS:
            raise CheckpointError(f"exclude pattern {pattern[:60]!r}...: longer than {_PATTERN_MAX_CHARS} characters")
        try:
            _compiled[pattern] = regex.compile(pattern[3:], flags=regex.VERSION0)
        except (regex.error, ValueError, TypeError) as err:
            raise CheckpointError(f"exclude pattern {pattern!r}: not a valid regular expression ({err})") from None
    return _compiled[pattern]


def check_exclude_patterns(patterns, where: str) -> None:
    """Every entry must be a string; ``re:`` entries must compile (``CheckpointError`` naming ``where``)."""
    if not isinstance(patterns, list):
        raise CheckpointError(f"{where}: expected a list of module names or patterns, found {type(patterns).__name__}")
    for p in patterns:
        if not isinstance(p, str):
            raise CheckpointError(f"{where}: expected strings, found {p!r}")
        if p.startswith("re:"):
            try:
                _compile(p)
            except CheckpointError as err:
                raise CheckpointError(f"{where}: {err}") from None


def matches(name: str, patterns: list[str]) -> bool:
    """Whether a module name is in an exclude list: exact names, glob patterns, or ``re:<regex>``
    (full match, at most ``REGEX_TIMEOUT_S`` seconds each).

    Raises:
        CheckpointError: a ``re:`` pattern that does not compile or runs past the time limit
            (naming the pattern).
    """
    for p in patterns:
        if p.startswith("re:"):
            try:
                hit = _compile(p).fullmatch(name, timeout=REGEX_TIMEOUT_S)
            except TimeoutError:
                raise CheckpointError(
                    f"exclude pattern {p!r}: matching module name {name!r} took more than {REGEX_TIMEOUT_S} s "
                    f"(catastrophic backtracking?); refusing the checkpoint"
                ) from None
            if hit:
                return True
        elif fnmatch.fnmatchcase(name, p) or name == p:
            return True
    return False


# ----------------------------------------------------------------------------- per-expert tensors


def expert_parts(weights: ExpertWeights, w13_input_scale=None, w2_input_scale=None):
    """One layer's experts cut into the per-expert, per-projection tensors of the layouts that store each
    expert's ``gate_proj`` / ``up_proj`` / ``down_proj`` as its own module.

    Yields ``(x, proj, weight, weight_scale, global_scale, input_scale)`` for each expert ``x`` in order and
    each ``proj`` of ``PROJS``: ``weight`` / ``weight_scale`` that projection's rows of ``w13_*`` (gate the
    first ``I`` rows, up the next ``I``) or of ``w2_*``, contiguous on the CPU, dtypes as held; ``global_scale``
    the NVFP4 global scale (a 0-d view: ``w13_weight_scale_2 [E, 2]`` gives gate and up their own, ``[E]``
    one for both; ``w2_weight_scale_2 [E]``), None without one; ``input_scale`` element ``x`` of
    ``w13_input_scale`` (gate, up) or ``w2_input_scale`` (down), None where that is None.
    """
    e, two_i = weights.w13_weight.shape[:2]
    i = two_i // 2
    g13 = weights.w13_weight_scale_2
    if g13 is not None and g13.ndim == 1:  # [E]: gate and up share one
        g13 = g13[:, None].expand(e, 2)
    for x in range(e):
        for j, (proj, rows) in enumerate(zip(PROJS, (slice(0, i), slice(i, 2 * i), slice(None)))):
            w13 = j < 2
            packed, scale = (
                (weights.w13_weight, weights.w13_weight_scale) if w13 else (weights.w2_weight, weights.w2_weight_scale)
            )
            g = None if g13 is None else (g13[x, j] if w13 else weights.w2_weight_scale_2[x])
            ins = w13_input_scale if w13 else w2_input_scale
            yield (
                x,
                proj,
                packed[x, rows].contiguous().cpu(),
                scale[x, rows].contiguous().cpu(),
                g,
                None if ins is None else ins[x],
            )


def read_block_experts(
    tensors,
    prefix: str,
    e: int,
    h: int,
    i: int,
    block: BlockScheme,
    weight: str = "weight",
    stored_dtype: torch.dtype = torch.uint8,
    global_scale: str | None = None,
    read_scalars=None,
) -> tuple[torch.Tensor, ...]:
    """One layer's experts in ``block`` stored per expert and projection (``{prefix}.{x}.{proj}.{name}``): the
    packed ``weight``, its ``weight_scale`` block scales and, with ``global_scale``, one global scale per
    projection. Gate and up are read into place in ``w13`` (no copy).

    Args:
        tensors: the layer's ``TensorReader`` (``stack(names, shape, dtype, check, out)``).
        e, h, i: experts, hidden size, intermediate size.
        block: the weights' block scheme: packed sizes, block size, and the scales' dtype (``ue4m3``: stored
            float8_e4m3fn, NaN and negative refused; ``e8m0``: uint8, 0xFF refused).
        weight: the packed tensors' name (``weight``; compressed-tensors FP4 ``weight_packed``).
        stored_dtype: their dtype on disk (uint8, or float8_e4m3fn for MXFP8), returned as uint8.
        global_scale: the global scales' name (``weight_scale_2``, ``weight_global_scale``), or None.
        read_scalars: with ``global_scale``, ``(names) -> fp32 [E]``, the layout's read of one scalar per
            expert (its stored shape and range check, ``mxlib.checkpoints.scalars.read_scalar_scales``).

    Returns:
        ``(w13 uint8 [E, 2I, packed H], w13 block scales [E, 2I, H / block_size], w2 uint8 [E, H, packed I],
        w2 block scales [E, H, I / block_size])``, then with ``global_scale`` ``w13`` global scales fp32
        ``[E, 2]`` (gate, up) and ``w2``'s ``[E]``.

    Raises:
        CheckpointError: from ``tensors.stack`` and ``read_scalars``, naming the tensor: a missing one, a
        shape or dtype other than the above, an invalid block scale.
    """
    bs, u8 = block.block_size, torch.uint8
    e4m3 = block.scale.element is not None  # ue4m3 scales (NVFP4), else E8M0 bytes
    sdtype = torch.float8_e4m3fn if e4m3 else u8
    rows = {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}

    def names(proj, what):
        return [f"{prefix}.{x}.{proj}.{what}" for x in range(e)]

    blocks = block_scale_check(e4m3=e4m3)
    packed = {p: (rows[p][0], block.element.packed_size(rows[p][1])) for p in PROJS}
    sshape = {p: (rows[p][0], rows[p][1] // bs) for p in PROJS}
    w13 = torch.empty(e, 2 * i, packed["gate_proj"][1], dtype=u8)  # gate and up read into place
    s13 = torch.empty(e, 2 * i, sshape["gate_proj"][1], dtype=sdtype)
    for j, p in enumerate(("gate_proj", "up_proj")):
        tensors.stack(names(p, weight), packed[p], stored_dtype, out=w13.view(stored_dtype)[:, j * i : (j + 1) * i])
        tensors.stack(names(p, "weight_scale"), sshape[p], sdtype, blocks, out=s13[:, j * i : (j + 1) * i])
    w2 = tensors.stack(names("down_proj", weight), packed["down_proj"], stored_dtype).view(u8)
    s2 = tensors.stack(names("down_proj", "weight_scale"), sshape["down_proj"], sdtype, blocks)
    if global_scale is None:
        return w13, s13, w2, s2
    g = {p: read_scalars(names(p, global_scale)) for p in PROJS}
    return w13, s13, w2, s2, torch.stack([g["gate_proj"], g["up_proj"]], 1), g["down_proj"]


# ----------------------------------------------------------------------------- value checks (stack(check=...))


def global_scale_check(allow_zero: bool = False, what: str = "global scale"):
    """A ``TensorReader.stack`` check: values in ``[2**-126, 2**126]`` (or 0 with ``allow_zero``),
    the rule of ``mxlib._checks.check_global_scale``."""

    def check(t: torch.Tensor):
        s = t.float()
        ok = (s >= GLOBAL_SCALE_MIN) & (s <= GLOBAL_SCALE_MAX)
        if allow_zero:
            ok |= s == 0
        if bool(ok.all()):
            return True, ""
        zero = " or 0 (uncalibrated)" if allow_zero else ""
        bad = s[~ok].reshape(-1)[0].item()
        return False, f"expected a positive finite {what}{zero} in [2**-126, 2**126], found {bad!r}"

    return check


def block_scale_check(e4m3: bool):
    """A ``TensorReader.stack`` check: no NaN block scale (E8M0 0xFF; e4m3 0x7F / 0xFF) and, for
    NVFP4's unsigned e4m3 scales, no negative one (``mxlib._checks.bad_block_scale_mask``)."""

    def check(t: torch.Tensor):
        bad = bad_block_scale_mask(t, e4m3)
        if not bool(bad.any()):
            return True, ""
        where = bad.nonzero()[0].tolist()
        byte = int(t.view(torch.uint8)[tuple(where)])
        kind = "e4m3 block scale (0x7F/0xFF NaN, or negative)" if e4m3 else "E8M0 block scale (0xFF is NaN)"
        return False, f"invalid {kind}: byte 0x{byte:02X} at index {where} ({int(bad.sum())} invalid)"

    return check
