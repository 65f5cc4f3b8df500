"""What every checkpoint layout shares: the error type, the typed description a layout reads
from a config, the registry the writer and loader dispatch on, and exclude-list matching.

A layout is a module-level object with:

* ``name`` (``"modelopt"``, ``"quark"``) and ``quant_method`` (the ``quantization_config.quant_method``
  it reads);
* ``handles(scheme) -> bool``: whether it can store a ``MoEQuantScheme``;
* ``config_files(scheme) -> (quantization_config, {extra file name: dict})``;
* ``read_config(qc) -> CheckpointDescription`` (raises ``CheckpointError`` naming the field);
* ``read_legacy(folder) -> dict | None``: a ``quantization_config`` from files other than
  ``config.json`` (ModelOpt's ``hf_quant_config.json``), or None;
* ``expert_tensors(scheme, weights, w13_input_scale, w2_input_scale, prefix) -> {name: tensor}``;
* ``read_experts(tensors, prefix, num_experts, hidden_size, intermediate_size, description)
  -> (ExpertWeights, w13_input_scale | None, w2_input_scale | None)``.

``register_layout(layout)`` adds one; adding a layout is adding one module that calls it.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field

from ...moe.schemes import MoEQuantScheme

__all__ = ["CheckpointError", "CheckpointDescription", "LAYOUTS", "register_layout", "layout_for_scheme",
           "layout_for_method", "matches", "PROJS"]

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
    """

    format: str
    scheme: MoEQuantScheme
    exclude: list[str] = field(default_factory=list)
    activation_scale_mode: str | None = None

    def __getitem__(self, key: str):
        return getattr(self, key)

    def get(self, key: str, default=None):
        return getattr(self, key, default)

    def keys(self):
        return ("format", "scheme", "exclude", "activation_scale_mode")


LAYOUTS: dict[str, object] = {}


def register_layout(layout) -> object:
    """Add a layout to the registry (keyed by ``layout.name``); returns it."""
    LAYOUTS[layout.name] = layout
    return layout


def layout_for_scheme(scheme: MoEQuantScheme):
    """The first registered layout that can store ``scheme``."""
    for layout in LAYOUTS.values():
        if layout.handles(scheme):
            return layout
    raise ValueError(f"no checkpoint layout stores scheme {scheme.name}; layouts: {list(LAYOUTS)}")


def layout_for_method(method):
    """The registered layout that reads ``quantization_config.quant_method == method``."""
    for layout in LAYOUTS.values():
        if layout.quant_method == method:
            return layout
    methods = " or ".join(repr(layout.quant_method) for layout in LAYOUTS.values())
    raise CheckpointError(f"quantization_config.quant_method: expected {methods}, found {method!r}")


def matches(name: str, patterns: list[str]) -> bool:
    """Whether a module name is in an exclude list: exact names, glob patterns, or ``re:<regex>``."""
    for p in patterns:
        if p.startswith("re:"):
            if re.fullmatch(p[3:], name):
                return True
        elif fnmatch.fnmatchcase(name, p) or name == p:
            return True
    return False
