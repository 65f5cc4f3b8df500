"""The checks every command's options get before torch or any model code is imported, so that a user's
mistake is answered at once (one line, exit code 2): the standard library and mxlib's torch-free rules only
(``mxlib.models.presets``, ``mxlib.checkpoints.files.untrusted``, ``mxlib.checkpoints.files.atomic_write``).

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
* ``quantize``: ``SRC`` a folder whose ``config.json`` names a supported family
  (``families.check_supported_checkpoint``: an unsupported class is refused in milliseconds, naming it) and
  has no ``quantization_config``; ``DST`` not ``SRC``, absent or empty unless ``--overwrite``, not under a
  file; ``--calibration`` a regular file of UTF-8 text that is not empty;
* every ``--json``: not a folder, its folder not a file.

Each raises ``ValueError`` naming the option; the command's own ``check`` then does the rest.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..checkpoints.files import untrusted
from ..checkpoints.files.atomic_write import describe_destination, is_mxlib_checkpoint
from ..models.families import UnsupportedModelError, check_supported_checkpoint
from ..models.parameters import check_parameter

__all__ = ["precheck"]

_MODEL_COMMANDS = ("e2e", "compare", "unify", "routing")


def _json_path(value) -> None:
    if not value:
        return
    p = Path(value)
    try:
        is_dir = p.is_dir()
    except OSError as err:  # a name the file system refuses (too long)
        raise ValueError(f"--json: {value!r} cannot be written ({err.strerror})") from None
    if is_dir:
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


MAX_CALIBRATION_BYTES = 64 * 2**20


def _quantize(args) -> None:
    src = Path(args.src)
    if not src.exists():
        raise ValueError(f"src: {args.src!r} does not exist; expected a bf16 checkpoint folder")
    if not src.is_dir():
        raise ValueError(f"src: {args.src!r} is not a folder; expected a bf16 checkpoint folder")
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise ValueError(
            f"src: {args.src!r} has no config.json; expected a checkpoint folder as transformers' save_pretrained "
            f"writes it"
        )
    try:
        check_supported_checkpoint(src, "quantize", untrusted.read_json)
        cfg = untrusted.read_json(cfg_path, "a transformers model config")
    except (UnsupportedModelError, ValueError) as err:
        raise ValueError(f"src: {str(err).removeprefix('quantize: ')}") from None
    if cfg.get("quantization_config") is not None:
        raise ValueError(
            f"src: {cfg_path} has a quantization_config: the checkpoint is quantized already; expected a bf16 one"
        )
    dst = Path(args.dst)
    if dst.resolve() == src.resolve():
        raise ValueError(f"dst: {args.dst!r} is SRC itself; expected another folder")
    if (dst.exists() or dst.is_symlink()) and not args.overwrite:
        if not dst.is_dir() or dst.is_symlink() or any(dst.iterdir()):
            raise ValueError(f"dst: {args.dst!r} exists; pass --overwrite to replace it, or choose another folder")
    parent = next((q for q in dst.parents if q.exists()), None)
    if parent is not None and not parent.is_dir():
        raise ValueError(f"dst: {args.dst!r} lies under {str(parent)!r}, which is a file")
    if args.calibration is not None:
        try:
            with untrusted.open_regular(args.calibration) as f:
                data = f.read(MAX_CALIBRATION_BYTES + 1)
        except ValueError as err:
            raise ValueError(f"--calibration: {err}") from None
        if len(data) > MAX_CALIBRATION_BYTES:
            raise ValueError(f"--calibration: {args.calibration!r} is larger than {MAX_CALIBRATION_BYTES} bytes")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"--calibration: {args.calibration!r} is not UTF-8 text ({err})") from None
        if not text.strip():
            raise ValueError(f"--calibration: {args.calibration!r} is empty; expected text to calibrate on")
        args.calibration_text = text


def precheck(args) -> None:
    """The torch-free checks of ``args.cmd``'s options (module docstring). Raises ``ValueError`` naming one."""
    if args.cmd in _MODEL_COMMANDS:
        _model_sizes(args)
    elif args.cmd == "inspect":
        _inspect(args)
    elif args.cmd == "dummy-from-config":
        _dummy_from_config(args)
    elif args.cmd == "quantize":
        _quantize(args)
    elif args.cmd == "attribute-groups":
        if args.path is not None:
            _inspect(args)
        _bounded(args, args.preset if args.path is None else None)
    _json_path(getattr(args, "json", None))
