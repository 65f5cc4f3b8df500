"""The checkpoint commands: ``inspect PATH`` (configs and scale tensors only; ``--ran``: also the loaded model's
executed semantics, ``mxlib.models.what_ran``), ``dummy-from-config CONFIG_DIR OUT_DIR`` (dummy weights in the
layout a checkpoint's config files describe, loaded and run) and ``quantize SRC DST`` (a bf16 checkpoint folder
quantized layer by layer: ``mxlib.checkpoints.streaming.quantize_checkpoint``).

A command's ``check`` runs before any work (a ValueError or FileNotFoundError names the option); its
``run`` prints a summary on stdout and returns the JSON result.
"""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

import torch

from ..checkpoints import CheckpointError, dummy_checkpoint_from_config, inspect_checkpoint, load_quantized_moe
from ..checkpoints.dummy import dummy_quantization
from ..checkpoints.files.atomic_write import describe_destination
from ..checkpoints.files.safetensors_io import is_mxlib_checkpoint
from ..checkpoints.streaming import check_quantization
from ..models.families import family_of


def _steps():
    """``mxlib.studies.steps``, imported when a command needs it: it imports transformers, which ``inspect`` (its
    configs and headers only) never does."""
    from ..studies import steps

    return steps


__all__ = ["COMMANDS"]


def check_inspect(args) -> None:
    if not Path(args.path).exists():
        raise FileNotFoundError(f"path: {args.path!r} does not exist; expected a checkpoint folder")
    if args.json:  # the results path's checks live with the workbook's steps (which import transformers)
        _steps().prepare_results_path(args.json, "--json")


def inspect_cmd(args) -> dict:
    """``inspect PATH``: the checkpoint inspector's table on stdout; its report as the JSON result. A checkpoint
    of which nothing could be read (its config or its safetensors files refused) is the command's error
    (``CheckpointError``: one line, exit code 2) naming the file."""
    report = inspect_checkpoint(args.path, strategies=args.strategies)
    unread = [p for p in report.problems if p.startswith(("config: ", "files: "))]
    if unread and report.tensors_total == 0:  # nothing of the checkpoint could be read: the user's error line
        raise CheckpointError(unread[0].split(": ", 1)[1])
    print(report.table())
    result = report.to_dict()
    if getattr(args, "ran", False):
        result["ran"] = _ran(args.path, args.backend)
    return result


def _ran(path: str, backend: str) -> dict:
    """``inspect --ran``: load the model, report what ran in one forward (``mxlib.models.what_ran``) and check it
    against the checkpoint's scheme; ``{"rows", "ok", "problems"}``."""
    from ..models.what_ran import RanMismatch, assert_runs_as, what_ran

    model, info = load_quantized_moe(path, backend=backend)
    report = what_ran(model)
    print()
    print(f"what ran (one forward of 16 tokens; the checkpoint asks {info.scheme.name}, {info.scheme.precision}):")
    print(report.table())
    try:
        assert_runs_as(model, info, report=report)
        problems = []
    except RanMismatch as err:
        problems = err.problems
    print("runs as the checkpoint asks" if not problems else "DIFFERS from what the checkpoint asks:")
    for p in problems:
        print(f"  {p}")
    return {"rows": report.to_dicts(), "ok": not problems, "problems": problems}


def check_dummy_from_config(args) -> None:
    """The config folder, its layer count against ``--layers``, the output folder (absent, empty or an
    mxlib checkpoint, as the writer requires), and what is written: the config's
    quantization, or ``--scheme`` / ``--layout`` for an unquantized config (``dummy_quantization``;
    its ``CheckpointError`` comes out as the command's error)."""
    config_dir = Path(args.config_dir)
    if not config_dir.is_dir():
        raise FileNotFoundError(
            f"config_dir: {args.config_dir!r} is not a folder; expected the checkpoint's config folder"
        )
    cfg_path = config_dir / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"config_dir: {args.config_dir!r} has no config.json")
    try:
        total = json.loads(cfg_path.read_text()).get("num_hidden_layers")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as err:
        raise ValueError(f"config_dir: {cfg_path} is not a JSON object ({err})") from None
    if args.layers is not None and isinstance(total, int) and args.layers > total:
        raise ValueError(f"--layers: expected 1 to the config's num_hidden_layers={total}, got {args.layers}")
    out = Path(args.out_dir)
    if (out.exists() or out.is_symlink()) and not (
        out.is_dir() and not out.is_symlink() and (not any(out.iterdir()) or is_mxlib_checkpoint(out))
    ):  # the writer's rule (safetensors_io.atomic_folder), checked before the model is built
        raise ValueError(
            f"out_dir: {args.out_dir!r} is {describe_destination(out)}; expected an absent or empty folder, or an "
            f"mxlib checkpoint to replace"
        )
    names = {"scheme": "--scheme", "layout": "--layout"}
    try:
        args.description, _ = dummy_quantization(config_dir, args.scheme, args.layout)
    except ValueError as err:  # dummy_quantization names its parameter first: give the option's name instead
        text = str(err)
        for param, option in names.items():
            if text.startswith(f"{param}: "):
                text = f"{option}: {text[len(param) + 2 :]}"
        raise type(err)(text) from None
    args.params_device = _steps().check_device(args.device, "--device")
    _steps().prepare_results_path(args.json, "--json")


def dummy_from_config(args) -> dict:
    """``dummy-from-config CONFIG_DIR OUT_DIR``: dummy weights in the configs' layout, loaded and run."""
    t0 = time.perf_counter()
    path = dummy_checkpoint_from_config(
        args.config_dir,
        args.out_dir,
        num_hidden_layers=args.layers,
        seed=args.seed,
        model_preset=args.preset,
        scheme=args.scheme,
        layout=args.layout,
        progress=args.progress,
        technique=None if args.technique == "rtn" else args.technique,
    )
    t_write = time.perf_counter() - t0
    dev = args.params_device
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, info = load_quantized_moe(path, device=dev, backend=args.backend, progress=args.progress)
    num_experts = family_of(model, "dummy-from-config").num_experts(model.config)
    W = _steps()
    ids = W.random_token_ids(args.tokens, args.seed + 1, model.config.vocab_size)
    out = W.run_model(model, ids)
    finite = bool(torch.isfinite(out.logits).all())
    print(
        f"[dummy-from-config] {path}: {type(model).__name__}, layout {info.format}, scheme {info.scheme.name}, "
        f"technique {args.technique}, {model.config.num_hidden_layers} layers, {num_experts} experts, hidden "
        f"{model.config.hidden_size}; written in {t_write:.1f} s; forward of {args.tokens} tokens on {dev}: "
        f"logits {'finite' if finite else 'NOT finite'}"
    )
    return dict(
        path=str(path),
        format=info.format,
        scheme=info.scheme.name,
        technique=args.technique,
        preset=args.preset,
        layers=model.config.num_hidden_layers,
        architecture=type(model).__name__,
        num_experts=num_experts,
        hidden_size=model.config.hidden_size,
        logits_finite=finite,
        seconds_write=t_write,
        seconds_forward=out.seconds,
        device=str(dev),
    )


_QUANTIZE_OPTIONS = dict(scheme="--scheme", layout="--layout", calibration="--calibration", technique="--technique")


def check_quantize(args) -> None:
    """Everything ``quantize_checkpoint`` checks before it reads a tensor (``streaming.check_quantization``: SRC's
    tensors against its config, the scheme, layout and technique together, calibration text through SRC's
    tokenizer, a static-activation-scale scheme without ``--calibration``); each error a ValueError naming the
    option. The checked plan is ``args.plan``."""
    try:
        args.plan = check_quantization(
            args.src,
            args.dst,
            args.scheme,
            layout=args.layout,
            calibration=getattr(args, "calibration_text", None),
            technique=args.technique,
            overwrite=args.overwrite,
            seq_len=args.calib_seq_len,
            max_tokens=args.calib_tokens,
            where="quantize",
        )
    except (ValueError, FileExistsError) as err:
        text = str(err).removeprefix("quantize: ")
        for param, option in _QUANTIZE_OPTIONS.items():
            if text.startswith(f"{param}: "):
                text = f"{option}: {text[len(param) + 2 :]}"
        raise ValueError(text) from None
    _steps().prepare_results_path(args.json, "--json")


def quantize_cmd(args) -> dict:
    """``quantize SRC DST``: the checked plan written (``QuantizePlan.run``) and its summary on stdout."""
    result = args.plan.run(progress=args.progress)
    print(f"[quantize] {result.summary()}")
    return result.to_dict()


# command -> (check before any work, run)
COMMANDS = {
    "inspect": (check_inspect, inspect_cmd),
    "dummy-from-config": (check_dummy_from_config, dummy_from_config),
    "quantize": (check_quantize, quantize_cmd),
}
