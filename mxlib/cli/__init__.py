"""The ``mxlib`` command: the notebooks' code paths as commands, for machines without Jupyter.

  mxlib e2e --scheme nvfp4                     notebook 01: quantize, write, load, run (preset small)
  mxlib compare --schemes nvfp4,w_mxfp4        notebook 03: schemes side by side
  mxlib unify --spread 1.0                     notebook 04: NVFP4 activation-scale unification
  mxlib routing --preset tiny                  notebook 04: routing statistics per layer
  mxlib inspect CHECKPOINT_DIR                 a checkpoint's configs and scale tensors only
  mxlib inspect --ran CHECKPOINT_DIR           ... and what ran per module in one forward of the loaded model
  mxlib dummy-from-config CONFIG_DIR OUT_DIR   dummy weights in the layout of a config (--scheme if unquantized)
  mxlib quantize SRC DST --scheme SCHEME       a bf16 checkpoint folder quantized layer by layer
  mxlib attribute-groups [PATH]                which precision group of a mixed checkpoint costs what
  mxlib workbook --out DIR                     run the workbook's notebooks (mxlib.workbook.runner)

``python -m mxlib`` and ``python -m mxlib.cli`` are the same command. The model commands build the seeded
dummy Qwen3-30B-A3B at the size of ``--preset``: ``small`` by default (``e2e``: about 35 s of CPU time and
0.5 GB of memory), ``qwen3-30b-a3b`` for the full-size model (5.8 GB of bf16 weights at 4 layers). ``--json
PATH`` writes the command's result.

Errors: every option is checked before anything is built. A user's mistake ends with ``mxlib CMD: error:
MESSAGE`` (one line) on stderr and exit code 2, without a traceback: argparse's own checks (types, choices);
the torch-free checks of ``_prechecks`` (sizes bounded by the preset's layers and context, the folders and
config files named), answered before torch is imported; a ValueError or FileNotFoundError raised while the
options are checked (a command's ``check``); and a ``CheckpointError`` (a checkpoint or config the loader
refuses) at any time. Any other exception is a bug
and shows its traceback. Logging: the library logs through ``logging`` (loggers under ``mxlib``); ``-v``
shows INFO, ``-vv`` DEBUG, ``-q`` errors only. Progress bars (tqdm, on stderr) show the long steps when
stderr is a terminal and ``-q`` is not given.

Imports: only argparse and the standard library at import time, so that ``--help`` answers at once;
each command's module (``runs``: e2e, compare, unify, routing; ``checkpoint_commands``: inspect,
dummy-from-config, quantize; ``group_commands``: attribute-groups) and torch are imported when the command
runs. ``_options`` spells out the option values so that ``--help`` imports neither torch nor transformers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import time

from ._options import (
    BACKENDS,
    FULL_PRESET,
    LAYOUTS,
    LINEAR_SCHEMES,
    PRESETS,
    PRODUCERS,
    SCHEME_ALIASES,
    SCHEMES,
    STRATEGIES,
    TECHNIQUES,
    comma_list,
    nonnegative_float,
    nonnegative_int,
    positive_int,
)

__all__ = ["main", "build_parser", "PROG"]

PROG = "mxlib"
DEFAULT_PRESET = "small"  # the model commands' default: light enough for a first try on a CPU


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line, ``PROG CMD: error: MESSAGE`` (exit code 2), without
    the usage block (``--help`` shows it)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(str(message).split())}\n")


class _HelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to an option's help unless the help already states its default or the
    option has none (a flag, a positional)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, argparse.SUPPRESS) or action.option_strings == []:
            return text
        if isinstance(action, (argparse._StoreTrueAction, argparse._CountAction)):
            return text
        default = ",".join(map(str, action.default)) if isinstance(action.default, (list, tuple)) else action.default
        return f"{text} (default: {default})"


class _RawHelpFormatter(argparse.RawDescriptionHelpFormatter, _HelpFormatter):
    """``_HelpFormatter`` keeping the description's line breaks (the top-level help's command table)."""


def _logging_options() -> argparse.ArgumentParser:
    """``-v`` / ``-q``, accepted before and after the command name (SUPPRESS: a later parser does not
    overwrite an earlier value with its default)."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=argparse.SUPPRESS,
        help="log INFO (-vv: DEBUG) from mxlib's loggers on stderr (default: warnings only)",
    )
    g.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        default=argparse.SUPPRESS,
        help="log errors only and show no progress bars (default: progress bars when stderr is a terminal)",
    )
    return p


def _add_model_options(p: argparse.ArgumentParser, tokens: bool = True, backend: bool = True) -> None:
    """The options every model command shares: the model's size and seed, calibration, device, output."""
    p.add_argument(
        "--preset",
        choices=PRESETS,
        default=DEFAULT_PRESET,
        help=f"model size, a key of mxlib.models.qwen3.MODEL_PRESETS: {FULL_PRESET} is the full-size model "
        f"(hidden 2048, 128 experts: 5.8 GB of bf16 weights at 4 layers), small hidden 256 with 16 experts, tiny "
        f"hidden 64 "
        f"(default: {DEFAULT_PRESET})",
    )
    p.add_argument("--layers", type=positive_int, default=4, help="decoder layers of the model")
    if tokens:
        p.add_argument("--tokens", type=positive_int, default=32, help="tokens of the evaluation sequence")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="random seed of the weights and token ids")
    p.add_argument("--calib-tokens", type=positive_int, default=512, help="calibration tokens (in sequences of 256)")
    p.add_argument("--device", default="auto", help="auto (cuda when a GPU is present), cpu, cuda or cuda:N")
    if backend:
        p.add_argument(
            "--backend",
            choices=BACKENDS,
            default="auto",
            help="experts backend: triton kernels, the fused FP4 kernel, or torch (auto: by device)",
        )
    p.add_argument("--json", default=None, metavar="PATH", help="write the result as JSON here (default: none)")


def build_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    """The ``mxlib`` parser and its subcommands' action (``.choices``: name -> subparser)."""
    common = _logging_options()
    ap = _Parser(
        prog=PROG,
        description="\n\n".join(__doc__.split("\n\n")[:3]).replace("``", ""),  # what, the commands, the presets
        formatter_class=_RawHelpFormatter,
        parents=[common],
    )
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND", parser_class=_Parser)

    def command(name, help, description):
        return sub.add_parser(
            name, help=help, description=description, formatter_class=_HelpFormatter, parents=[common]
        )

    e2e = command(
        "e2e",
        "notebook 01: quantize the dummy model's experts, write and load the checkpoint, compare with bf16",
        "Build the seeded bf16 dummy model, calibrate it, quantize its experts in SCHEME, write the checkpoint in "
        "its layout (cached), load it with emulation experts and compare both models' layers and logits.",
    )
    e2e.add_argument(
        "--scheme",
        choices=SCHEMES + SCHEME_ALIASES,
        default="nvfp4",
        metavar="SCHEME",
        help=f"MoE scheme: {', '.join(SCHEMES)}; other tools' names are mapped (docs/api-mapping.md)",
    )
    _add_model_options(e2e)

    cmp = command(
        "compare",
        "notebook 03: every scheme on the same model and token ids",
        "Logits error, bits per weight and checkpoint size of each scheme against the bf16 model.",
    )
    cmp.add_argument(
        "--schemes",
        type=comma_list(SCHEMES + SCHEME_ALIASES, extra=("all",)),
        default=["all"],
        metavar="LIST",
        help=f"'all' or a comma-separated list of {', '.join(SCHEMES)}",
    )
    _add_model_options(cmp)

    uni = command(
        "unify",
        "notebook 04: what one NVFP4 activation global scale per layer costs each expert",
        "Unification, expert-output and end-to-end studies of the activation-scale strategies, and the sweep "
        "over the experts' weight spread.",
    )
    uni.add_argument("--spread", type=nonnegative_float, default=1.0, help="per-expert weight spread of the model")
    uni.add_argument(
        "--strategies",
        type=comma_list(STRATEGIES),
        default=["max", "per_expert", "median", "p90", "mean"],
        metavar="LIST",
        help=f"comma-separated scale strategies out of {', '.join(STRATEGIES)}",
    )
    uni.add_argument(
        "--spreads",
        type=comma_list(item=nonnegative_float),
        default=[0.0, 0.5, 1.0, 1.5],
        metavar="LIST",
        help="comma-separated spreads of the sweep (one-layer models)",
    )
    uni.add_argument("--output-layers", type=positive_int, default=1, help="layers of the expert-output study")
    _add_model_options(uni)

    rt = command(
        "routing",
        "notebook 04: experts hit, largest share and entropy per layer",
        "Routing statistics of the dummy model on its calibration tokens.",
    )
    rt.add_argument("--spread", type=nonnegative_float, default=1.0, help="per-expert weight spread of the model")
    rt.add_argument(
        "--schemes",
        type=comma_list(SCHEMES + SCHEME_ALIASES, extra=("all",)),
        default=None,
        metavar="LIST",
        help="also compare each scheme's routing with the bf16 model's (per layer: Jaccard of the top-k sets, share "
        "of tokens whose set changes, against the bf16 model on another experts implementation, decided by "
        f"mxlib.stats): 'all' or a comma-separated list of {', '.join(SCHEMES)} (default: none)",
    )
    rt.add_argument(
        "--sequences", type=positive_int, default=16, help="sequences of the routing comparison (its units; at least 2)"
    )
    rt.add_argument("--tokens", type=positive_int, default=64, help="tokens per sequence of the routing comparison")
    _add_model_options(rt, tokens=False, backend=False)

    ins = command(
        "inspect",
        "describe a quantized checkpoint from its configs and scale tensors only",
        "Layout check, quantized and bf16 modules, activation scales and what each scale strategy would cost, "
        "read from the configs, the safetensors headers and the scale scalars (no weights).",
    )
    ins.add_argument("path", help="the checkpoint folder")
    ins.add_argument(
        "--strategies",
        type=comma_list(STRATEGIES),
        default=list(STRATEGIES),
        metavar="LIST",
        help=f"comma-separated scale strategies out of {', '.join(STRATEGIES)}",
    )
    ins.add_argument(
        "--ran",
        action="store_true",
        help="also load the model, run one forward and print what ran per module (scheme, formats, QDQ passes of "
        "a1 / a2, scale strategy, numerics, backend, kernel), checked against what the checkpoint asks (default: off)",
    )
    ins.add_argument(
        "--backend",
        choices=BACKENDS,
        default="auto",
        help="experts backend of the loaded model, with --ran (default: auto)",
    )
    ins.add_argument("--json", default=None, metavar="PATH", help="write the report as JSON here (default: none)")

    dfc = command(
        "dummy-from-config",
        "dummy weights in the layout of a checkpoint's config files, loaded and run",
        "Read only CONFIG_DIR's config files (config.json, hf_quant_config.json), build the seeded dummy model "
        "at their sizes (or a preset's), write it to OUT_DIR in exactly the layout they name, load it and run it. "
        "An unquantized config (a model repository's own config.json) needs --scheme.",
    )
    dfc.add_argument("config_dir", help="folder holding the checkpoint's config.json (no weights needed)")
    dfc.add_argument("out_dir", help="checkpoint folder to write (replaced if it holds an mxlib checkpoint)")
    dfc.add_argument(
        "--scheme",
        choices=SCHEMES + SCHEME_ALIASES,
        default=None,
        metavar="SCHEME",
        help=f"the scheme of an unquantized config: {', '.join(SCHEMES)} (default: the config's own; an "
        f"unquantized config without --scheme is refused)",
    )
    dfc.add_argument(
        "--layout",
        choices=LAYOUTS,
        default=None,
        help="the layout --scheme is written in (default: the scheme's: nvfp4 -> modelopt, OCP MX -> quark)",
    )
    dfc.add_argument(
        "--preset",
        choices=PRESETS,
        default=DEFAULT_PRESET,
        help=f"shrink the config's sizes to a MODEL_PRESETS size; {FULL_PRESET} keeps the config's own "
        f"(default: {DEFAULT_PRESET})",
    )
    dfc.add_argument(
        "--technique",
        choices=TECHNIQUES,
        default="rtn",
        help=f"how the experts' scales and codes are chosen (mxlib.recovery): {', '.join(TECHNIQUES)} "
        f"(default: rtn, the layout's round-to-nearest)",
    )
    dfc.add_argument("--layers", type=positive_int, default=None, help="keep this many layers (default: the config's)")
    dfc.add_argument("--seed", type=nonnegative_int, default=0, help="random seed of the weights and token ids")
    dfc.add_argument("--tokens", type=positive_int, default=8, help="tokens of the forward pass")
    dfc.add_argument("--device", default="auto", help="auto (cuda when a GPU is present), cpu, cuda or cuda:N")
    dfc.add_argument("--backend", choices=BACKENDS, default="auto", help="experts backend of the loaded model")
    dfc.add_argument("--json", default=None, metavar="PATH", help="write the result as JSON here (default: none)")

    qz = command(
        "quantize",
        "quantize a bf16 checkpoint folder's experts, layer by layer, into a checkpoint folder",
        "Read SRC (a bf16 checkpoint folder of a supported family, as transformers' save_pretrained writes it) one "
        "decoder layer at a time, quantize each layer's experts in SCHEME and write DST in LAYOUT, with SRC's "
        "tokenizer, generation config and chat template beside it. Peak memory stays near one layer's tensors plus "
        "the embeddings. Schemes with static activation scales (nvfp4, *_a_fp8) need --calibration.",
    )
    qz.add_argument("src", help="the bf16 checkpoint folder (config.json, safetensors shards)")
    qz.add_argument("dst", help="the folder to write (absent or empty; --overwrite replaces it)")
    qz.add_argument(
        "--scheme",
        required=True,
        choices=SCHEMES + SCHEME_ALIASES,
        metavar="SCHEME",
        help=f"MoE scheme (required, no default): {', '.join(SCHEMES)}; other tools' names are mapped "
        f"(docs/api-mapping.md)",
    )
    qz.add_argument(
        "--layout",
        choices=LAYOUTS,
        default=None,
        help="checkpoint layout (default: the family's own where it stores the scheme, else the scheme's: "
        "nvfp4 -> modelopt, OCP MX -> quark)",
    )
    qz.add_argument(
        "--calibration",
        default=None,
        metavar="FILE",
        help="a UTF-8 text file to calibrate activation scales on, tokenized by SRC's own tokenizer (default: none; "
        "needed by schemes with static activation scales)",
    )
    qz.add_argument("--calib-seq-len", type=positive_int, default=512, help="tokens per calibration sequence")
    qz.add_argument(
        "--calib-tokens", type=positive_int, default=4096, help="calibration tokens used at most (the rest is left out)"
    )
    qz.add_argument(
        "--technique",
        choices=TECHNIQUES,
        default="rtn",
        help="how the experts' scales and codes are chosen (mxlib.recovery; gptq is refused: it needs every "
        "expert's Hessian, which only in-memory quantization collects) (default: rtn, the layout's round-to-nearest)",
    )
    qz.add_argument(
        "--overwrite", action="store_true", help="replace DST if it exists (default: refuse an existing, non-empty DST)"
    )
    qz.add_argument("--json", default=None, metavar="PATH", help="write the result as JSON here (default: none)")

    ag = command(
        "attribute-groups",
        "which precision group of a mixed-precision checkpoint costs what (logits NSR and KL, decided)",
        "Switch each precision group of a mixed-precision checkpoint back to bf16 or into another scheme "
        "(mxlib.studies.group_attribution.attribute_groups): each group alone, the checkpoint without it, a "
        "waterfall and each --targets entry, on the logits of seeded token ids, decided by mxlib.stats. PATH is a "
        "mixed checkpoint folder with --reference the bf16 folder it was quantized from; without PATH the seeded "
        "dummy model is written as a mixed checkpoint of --producer with the --experts, --attention and --lm-head "
        "schemes.",
    )
    ag.add_argument(
        "path", nargs="?", default=None, help="a mixed-precision checkpoint folder (default: none: the dummy)"
    )
    ag.add_argument(
        "--reference",
        default=None,
        metavar="DIR",
        help="the bf16 checkpoint folder PATH was quantized from (needed with PATH; default: none)",
    )
    ag.add_argument(
        "--producer",
        choices=PRODUCERS,
        default=None,
        help="the dummy's mixed form (default: quark; not with PATH)",
    )
    every = SCHEMES + SCHEME_ALIASES + LINEAR_SCHEMES
    for option, default, what in (
        ("--experts", "w_mxfp4_a_mxfp4", "the dummy's routed experts"),
        ("--attention", "w_mxfp8_a_mxfp8", "the dummy's attention projections ('none': bf16)"),
        ("--lm-head", "w_mxfp8_a_mxfp8", "the dummy's lm_head ('none': bf16)"),
    ):
        ag.add_argument(
            option,
            choices=every + (() if option == "--experts" else ("none",)),
            default=None,
            metavar="SCHEME",
            help=f"scheme of {what}: {', '.join(SCHEMES + LINEAR_SCHEMES)} (default: {default}; not with PATH)",
        )
    ag.add_argument(
        "--targets",
        type=comma_list(),
        default=None,
        metavar="LIST",
        help="comma-separated GROUP=SCHEME configurations to add ('<group> as <scheme>'; SCHEME may be bf16) "
        "(default: none)",
    )
    ag.add_argument(
        "--order",
        type=comma_list(),
        default=None,
        metavar="LIST",
        help="the waterfall's group order, comma-separated (default: the checkpoint config's)",
    )
    ag.add_argument("--draws", type=positive_int, default=1, help="token sets; 2 or more: decided over the sets")
    _add_model_options(ag)

    wb = command(
        "workbook",
        "run the workbook's notebooks (mxlib.workbook.runner; needs mxlib[workbook])",
        "Every argument after 'workbook' goes to the workbook runner (python -m mxlib.workbook): --notebooks DIR, "
        "--out DIR, --only NAME, --model-preset NAME; 'mxlib workbook --help' shows its help.",
    )
    wb.add_argument("workbook_args", nargs=argparse.REMAINDER, help="the runner's arguments")
    return ap, sub


def _command(cmd: str):
    """``(check, run)`` of a command; its module (and torch) is imported here."""
    if cmd in ("inspect", "dummy-from-config", "quantize"):
        from .checkpoint_commands import COMMANDS
    elif cmd == "attribute-groups":
        from .group_commands import COMMANDS
    else:
        from .runs import COMMANDS
    return COMMANDS[cmd]


# what mxlib[workbook] installs and the runner imports
_WORKBOOK_STACK = ("papermill", "nbformat", "nbconvert", "jupyter_client", "nbclient", "ipykernel")


def _workbook(argv: list[str]) -> int:
    """``mxlib workbook ARGS``: ``mxlib.workbook.runner.main(ARGS)``."""
    try:
        from ..workbook.runner import main as run_workbook
    except ModuleNotFoundError as err:
        if (err.name or "").split(".")[0] not in _WORKBOOK_STACK:
            raise
        print(
            f"{PROG} workbook: error: the workbook needs the notebook stack ({err}); "
            f"install it with: pip install 'mxlib[workbook]'",
            file=sys.stderr,
        )
        return 2
    return run_workbook(argv, prog=f"{PROG} workbook")


@contextlib.contextmanager
def _logging(verbose: int, quiet: bool, progress: bool):
    """A stderr handler on the ``mxlib`` logger at the level ``-v`` / ``-q`` ask for, for one command
    (removed afterwards); with progress bars on, log lines are written through tqdm so as not to break them."""
    level = logging.ERROR if quiet else {0: logging.WARNING, 1: logging.INFO}.get(verbose, logging.DEBUG)
    logger = logging.getLogger("mxlib")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        if progress:
            from tqdm.contrib.logging import logging_redirect_tqdm

            with logging_redirect_tqdm(loggers=[logger]):
                yield
        else:
            yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def main(argv: list[str] | None = None) -> int:
    """Run ``mxlib`` on ``argv`` (default ``sys.argv[1:]``). Returns 0; a user's mistake exits with code 2
    through ``SystemExit`` (the module docstring)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    first = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    ap, sub = build_parser()
    if first is not None and argv[first] == "workbook":  # everything after it is the runner's, --help included
        args = ap.parse_args(argv[: first + 1])  # the options before it (-v, -q) are still checked
        return _workbook(argv[first + 1 :])
    args = ap.parse_args(argv)
    parser = sub.choices[args.cmd]
    verbose, quiet = getattr(args, "verbose", 0), getattr(args, "quiet", False)
    args.progress = not quiet and sys.stderr.isatty()
    from ._prechecks import precheck  # here, not at import: --help needs none of it

    try:
        precheck(args)  # before torch is imported: a mistake is answered at once
    except ValueError as err:
        parser.error(str(err))
    check, run = _command(args.cmd)
    from ..checkpoints import CheckpointError

    with _logging(verbose, quiet, args.progress):
        try:
            check(args)
        except (ValueError, FileNotFoundError) as err:  # the options, checked before anything is built
            parser.error(str(err))
        try:
            result = run(args)
        except CheckpointError as err:  # a checkpoint or config the loader refuses
            parser.exit(2, f"{parser.prog}: error: {err}\n")
        except KeyboardInterrupt:
            parser.exit(130, f"{parser.prog}: interrupted\n")
    import torch

    result["env"] = dict(
        torch=torch.__version__,
        date=time.strftime("%Y-%m-%d"),
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    )
    if args.json:
        with open(args.json, "w") as f:  # its folder was made ready by the command's check
            json.dump(result, f, indent=1, default=str)
    return 0
