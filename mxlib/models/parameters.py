"""The bounds of every size, count and seed a user passes to the command line (``mxlib.cli``) and to the
notebooks' parameter checks (``mxlib.studies.steps``, ``mxlib.studies.accuracy``, ``mxlib.studies.recovery``,
and notebooks 00 and 02 calling ``check_parameters`` directly): one table, ``PARAMETER_BOUNDS``, read by both,
checked before anything is built. Plain Python (no torch import), so the command line checks its options before
torch is imported.

Each ``Bound`` has a name (the notebook parameter's), a lower and an upper bound and a unit. An upper bound
that depends on the model is the model preset's own (``upper_from``: ``"layers"``, the preset's decoder
layers, 48 for Qwen3-30B-A3B; ``"context"``, its ``max_position_embeddings``, 40960); the others are fixed
where a larger value would only exhaust memory or time (``calib_tokens`` 2^20, the prompt counts
100,000, the example tensors of notebook 00 at most 4096 x 8192, the test data of notebook 02 at most 2048 x 8192
in 32 draws), where the arithmetic needs it (``hidden`` and ``row_length`` multiples of 32, the MX block size;
``block_amax`` from 1e-30 to 1e30, so that the hand-worked block's E8M0 exponents stay inside [-127, 127] and its
bf16 values finite) or would leave the range a generator takes (``seed`` < 2^32: the seeds derived from it, such as
``seed + 1000``, stay far inside torch's 2^64). ``PARAMETER_ALIASES`` maps other names of the same
quantity (a notebook's ``dummy_layers``, a sweep's ``spreads``) to an entry.

``check_parameter(name, value, shown=None, model_preset=None)`` returns the value or raises a ``ValueError``
naming the parameter (or ``shown``, the command line's ``--layers``), its bounds, unit and the value given;
``check_parameters(model_preset, names, **values)`` checks several (the notebooks' call).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .presets import preset_context, preset_experts, preset_layers

__all__ = ["Bound", "PARAMETER_BOUNDS", "PARAMETER_ALIASES", "check_parameter", "check_parameters"]


@dataclass(frozen=True)
class Bound:
    """One bounded parameter: ``lower <= value <= upper`` (``upper`` from the model preset when ``upper_from``
    names ``"layers"`` or ``"context"``), an int unless ``integer`` is false (then a finite float), and a
    multiple of ``multiple_of`` (an int's block size; 1: any). ``sweep``: a list or tuple of such values is
    taken too, checked item by item (``spreads``); elsewhere a list is refused like any other wrong type."""

    name: str
    lower: int | float
    upper: int | float | None
    unit: str
    upper_from: str | None = None
    integer: bool = True
    multiple_of: int = 1
    sweep: bool = False

    def upper_for(self, model_preset: str | None = None) -> tuple[int | float, str]:
        """``(upper bound, why)`` for ``model_preset`` (its layers or context; Qwen3-30B-A3B's without one)."""
        if self.upper_from is None:
            return self.upper, ""
        preset = model_preset or "qwen3-30b-a3b"
        if self.upper_from == "layers":
            return preset_layers(preset), f"the layers of preset {preset}"
        if self.upper_from == "experts":
            return preset_experts(preset), f"the experts of preset {preset}"
        return preset_context(preset), f"the context of preset {preset}: max_position_embeddings"

    def check(self, value, shown: str | None = None, model_preset: str | None = None):
        """``value`` if it lies within the bounds (module docstring); else a ``ValueError`` naming ``shown`` (or
        the parameter), the bounds, the unit and the value."""
        upper, why = self.upper_for(model_preset)
        what = f"{self.lower} to {upper} {self.unit}" + (f" ({why})" if why else "")
        if self.multiple_of > 1:
            what += f", a multiple of {self.multiple_of}"
        kind = "an integer" if self.integer else "a finite number"
        name = shown or self.name
        if isinstance(value, bool) or not isinstance(value, (int, float) if not self.integer else int):
            raise ValueError(f"{name}: expected {kind} from {what}, got {value!r}")
        if not self.integer and not math.isfinite(value):
            raise ValueError(f"{name}: expected {kind} from {what}, got {value!r}")
        if value < self.lower:
            raise ValueError(f"{name}: expected {kind} from {what}; {value!r} is below the lower bound {self.lower}")
        if value > upper:
            raise ValueError(f"{name}: expected {kind} from {what}; {value!r} is above the upper bound {upper}")
        if self.multiple_of > 1 and value % self.multiple_of:
            raise ValueError(f"{name}: expected {kind} from {what}; {value!r} is not a multiple of {self.multiple_of}")
        return value


PARAMETER_BOUNDS: dict[str, Bound] = {
    b.name: b
    for b in (
        Bound("num_hidden_layers", 1, None, "decoder layers", upper_from="layers"),
        Bound("num_tokens", 1, None, "tokens", upper_from="context"),
        Bound("calib_tokens", 1, 2**20, "tokens"),
        Bound("seed", 0, 2**32 - 1, "(a random seed)"),
        Bound("repeats", 1, 10, "token sets"),
        Bound("token_sets", 1, 10, "token sets"),
        Bound("output_layers", 1, None, "decoder layers", upper_from="layers"),
        Bound("num_experts", 1, None, "experts", upper_from="experts"),
        Bound(
            "expert_spread", 0.0, 8.0, "(sigma of the per-expert log-normal weight scale)", integer=False, sweep=True
        ),
        Bound("eval_prompts", 1, 100_000, "prompts"),
        Bound("calib_prompts", 1, 100_000, "prompts"),
        Bound("resamples", 1, 100_000, "bootstrap resamples"),
        # the example tensors of notebook 00 (an activation [tokens, hidden], a weight [out_features, hidden])
        Bound("tokens", 1, 4096, "rows of the example activation"),
        Bound("hidden", 32, 8192, "elements of the reduction axis K", multiple_of=32),
        Bound("out_features", 1, 8192, "rows of the example weight"),
        Bound("block_amax", 1e-30, 1e30, "(largest magnitude of the hand-worked block)", integer=False),
        # the test data of notebook 02: each of its distributions [num_rows, row_length], num_draws times
        Bound("num_rows", 1, 2048, "rows of test data"),
        Bound("row_length", 32, 8192, "elements per row", multiple_of=32),
        Bound("num_draws", 2, 32, "draws of each distribution"),
        Bound("outlier_fraction", 0.0, 1.0, "(share of values made outliers)", integer=False),
        Bound("outlier_scale", 1.0, 1e6, "(factor of the outliers)", integer=False),
    )
}


# other parameters of the same quantity (a notebook's dummy model, a sweep's list), checked by the same bound
PARAMETER_ALIASES: dict[str, str] = {
    "spreads": "expert_spread",
    "dummy_layers": "num_hidden_layers",
    "dummy_tokens": "num_tokens",
    "dummy_calib_tokens": "calib_tokens",
    "dummy_experts": "num_experts",
    "check_tokens": "num_tokens",
    "hw_layers": "num_hidden_layers",
    "hw_tokens": "num_tokens",
    "hw_calib_tokens": "calib_tokens",
    "attribution_dummy_layers": "num_hidden_layers",
    "attribution_dummy_tokens": "num_tokens",
}


def check_parameter(name: str, value, shown: str | None = None, model_preset: str | None = None):
    """The bound of ``name`` (``PARAMETER_BOUNDS``, or the entry ``PARAMETER_ALIASES`` maps it to) applied to
    ``value``, or to each item of a list or tuple (named ``name[i]``) where the bound takes a sweep: the value,
    or a ``ValueError`` naming the parameter (``shown``: the caller's name for it, such as ``--layers``; default
    ``name``), its bounds, unit and the value.

    Raises:
        KeyError: ``name`` is in neither table (a programming error).
        ValueError: as ``Bound.check``.
    """
    bound = PARAMETER_BOUNDS[PARAMETER_ALIASES.get(name, name)]
    shown = shown or name
    if bound.sweep and isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            bound.check(v, f"{shown}[{i}]", model_preset)
        return value
    return bound.check(value, shown, model_preset)


def check_parameters(model_preset: str | None = None, names: dict | None = None, **values) -> dict:
    """Every named value within its bounds (``check_parameter``), the model-dependent ones against
    ``model_preset``'s layers, context and experts: what the notebooks call right after their ``parameters`` cell
    (as ``mxlib.studies.steps.check_parameters``), before anything is built. ``names``: the caller's name of a
    parameter (the command line's ``--layers``).

    Returns:
        ``values``, unchanged.

    Raises:
        ValueError: the first value out of bounds, naming the parameter, its bounds and the value.
    """
    for name, value in values.items():
        check_parameter(name, value, (names or {}).get(name, name), model_preset)
    return values
