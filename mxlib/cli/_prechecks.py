"""The checks every command's options get before torch or any model code is imported, so that a user's
mistake is answered at once (one line, exit code 2): the standard library and mxlib's torch-free rules only
(``mxlib.models.presets``, ``mxlib.models.untrusted``, ``mxlib.models.atomic_write``).

* the model commands (``e2e``, ``compare``, ``unify``, ``routing``): every bounded option (``--layers``,
  ``--tokens``, ``--calib-tokens``, ``--seed``, ``--output-layers``, ``--spread(s)``) within its bounds of
  ``mxlib.models.parameters.PARAMETER_BOUNDS``, the table the notebooks' checks read (``--layers`` at most the
  preset's layers, 48; ``--tokens`` at most its context, 40960; ``--calib-tokens`` at most 2^20; ``--seed``
  below 2^32);
* ``inspect``: ``PATH`` an existing folder (the inspector reports everything about its contents);
* ``dummy-from-config``: ``--seed`` and ``--tokens`` within the same bounds; ``CONFIG_DIR`` a folder whose
  ``config.json`` is a regular file holding a JSON object
  whose sizes, with ``--preset`` and ``--layers`` applied, pass the loader's rules, the dummy layer cap and this
  machine's memory (``untrusted.dummy_config``); ``OUT_DIR`` absent, an empty folder or an mxlib checkpoint;
* every ``--json``: not a folder, its folder not a file.

Each raises ``ValueError`` naming the option; the command's own ``check`` then does the rest.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..models import untrusted
from ..models.atomic_write import describe_destination, is_mxlib_checkpoint
from ..models.parameters import check_parameter

__all__ = ["precheck"]

_MODEL_COMMANDS = ("e2e", "compare", "unify", "routing")


def _json_path(value) -> None:
    if not value:
        return
    p = Path(value)
    if p.is_dir():
        raise ValueError(f"--json: {value!r} is a folder; expected a file path")
    parent = next((q for q in p.parents if q.exists()), None)
    if parent is not None and not parent.is_dir():
        raise ValueError(f"--json: {value!r} lies under {str(parent)!r}, which is a file; expected a file path")


# option -> (its attribute, the PARAMETER_BOUNDS entry): every bounded option of every command
_BOUNDED_OPTIONS = (
    ("--layers", "layers", "num_hidden_layers"),
    ("--tokens", "tokens", "num_tokens"),
    ("--calib-tokens", "calib_tokens", "calib_tokens"),
    ("--seed", "seed", "seed"),
    ("--output-layers", "output_layers", "output_layers"),
    ("--spread", "spread", "expert_spread"),
    ("--spreads", "spreads", "expert_spread"),
)


def _bounded(args, preset: str | None) -> None:
    """Every bounded option the command has, against ``mxlib.models.parameters.PARAMETER_BOUNDS`` (the table the
    notebooks' checks read)."""
    for option, attr, name in _BOUNDED_OPTIONS:
        value = getattr(args, attr, None)
        if value is not None:
            check_parameter(name, value, option, preset)


def _model_sizes(args) -> None:
    _bounded(args, args.preset)


def _inspect(args) -> None:
    p = Path(args.path)
    if not p.exists():
        raise ValueError(f"path: {args.path!r} does not exist; expected a checkpoint folder")
    if not p.is_dir():
        raise ValueError(f"path: {args.path!r} is not a folder; expected a checkpoint folder")


def _dummy_from_config(args) -> None:
    _bounded(argparse.Namespace(seed=args.seed, tokens=args.tokens), args.preset)  # --layers: the config's, below
    config_dir = Path(args.config_dir)
    if not config_dir.is_dir():
        raise ValueError(f"config_dir: {args.config_dir!r} is not a folder; expected the checkpoint's config folder")
    preset = None if args.preset == "qwen3-30b-a3b" else args.preset
    try:
        untrusted.dummy_config(config_dir, args.layers, preset)
    except ValueError as err:
        text = str(err)
        if text.startswith("num_hidden_layers: "):
            text = "--layers: " + text[len("num_hidden_layers: ") :]
        raise ValueError(f"config_dir: {text}" if not text.startswith("--") else text) from None
    out = Path(args.out_dir)
    if (out.exists() or out.is_symlink()) and not (
        out.is_dir() and not out.is_symlink() and (not any(out.iterdir()) or is_mxlib_checkpoint(out))
    ):  # the writer's rule (atomic_write.atomic_folder)
        raise ValueError(
            f"out_dir: {args.out_dir!r} is {describe_destination(out)}; expected an absent or empty folder, or an "
            f"mxlib checkpoint to replace"
        )
    parent = next((q for q in out.parents if q.exists()), None)
    if parent is not None and not parent.is_dir():
        raise ValueError(f"out_dir: {args.out_dir!r} lies under {str(parent)!r}, which is a file")


def precheck(args) -> None:
    """The torch-free checks of ``args.cmd``'s options (module docstring). Raises ``ValueError`` naming one."""
    if args.cmd in _MODEL_COMMANDS:
        _model_sizes(args)
    elif args.cmd == "inspect":
        _inspect(args)
    elif args.cmd == "dummy-from-config":
        _dummy_from_config(args)
    _json_path(getattr(args, "json", None))
