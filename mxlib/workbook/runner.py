"""Run the workbook: every notebook through papermill on its defaults, then HTML.

``python -m mxlib.workbook --out build/workbook`` (what ``make workbook`` runs) executes each
entry of ``WORKBOOK`` and every other notebook of the notebooks folder once, and writes
``<out>/<name>.ipynb`` (the executed copy) and ``<out>/<name>.html`` (self-contained: plotly.js is
embedded). The notebooks run with ``<out>`` as their working directory and write their results
JSON to ``<out>/results/<name>.json``; nothing else is written (the checkpoint cache is
``mxlib.studies.steps.default_cache_dir()``: ``$MXLIB_CACHE``, else the user's cache folder).

Options: ``--notebooks DIR`` (default: ``default_notebooks()``, the notebooks shipped with mxlib:
the ``notebooks/`` folder of the source checkout mxlib runs from, else the installed package
data ``mxlib.notebooks``), ``--out DIR`` (default ``build/workbook`` under the current directory;
never inside the notebooks folder or the installed packages), ``--only NAME`` (the entries whose
name contains NAME), ``--model-preset NAME`` (a key of ``mxlib.models.qwen3.MODEL_PRESETS``,
passed to every notebook that takes one; default ``WORKBOOK_MODEL_PRESET``, the full Qwen3-30B-A3B shape, while
the notebooks' own default, what JupyterLab opens, is the quick ``small`` preset). A bad option is
refused with one line naming it and the valid values, exit code 2, before any notebook runs.

Needs the ``workbook`` extra (``pip install 'mxlib[workbook]'``: papermill, nbconvert, a kernel);
importing this module without it raises ``ModuleNotFoundError`` naming the extra.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import sysconfig
import time
from importlib import resources
from pathlib import Path
from queue import Empty

from ..checkpoints.files.atomic_write import describe_destination
from ..models.presets import MODEL_PRESETS

# the notebook stack, imported when a notebook runs (``pm`` and the others below), so that the options are
# checked at once; whether it is installed is looked up here, without importing it
_STACK = ("nbformat", "papermill", "jupyter_client", "nbconvert")


def _missing_stack() -> str | None:
    for name in _STACK:
        if name in sys.modules:
            if sys.modules[name] is None:  # an import of it fails
                return name
            continue
        try:
            if importlib.util.find_spec(name) is None:
                return name
        except (ImportError, ValueError):
            return name
    return None


if (_absent := _missing_stack()) is not None:
    raise ModuleNotFoundError(
        f"the workbook runner needs the workbook extra, pip install 'mxlib[workbook]' (No module named {_absent!r})",
        name=_absent,
    )


def __getattr__(name: str):
    """``pm`` (papermill), ``nbformat``, ``HTMLExporter``, ``AsyncZMQSocketChannel``: imported on first use."""
    if name == "pm":
        return importlib.import_module("papermill")
    if name == "nbformat":
        return importlib.import_module("nbformat")
    if name == "HTMLExporter":
        return importlib.import_module("nbconvert").HTMLExporter
    if name == "AsyncZMQSocketChannel":
        return importlib.import_module("jupyter_client.channels").AsyncZMQSocketChannel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "WORKBOOK",
    "CELL_TIMEOUT_S",
    "CHANNEL_POLL_S",
    "poll_kernel_channels_in_slices",
    "NOTEBOOKS_PACKAGE",
    "source_notebooks",
    "installed_notebooks",
    "default_notebooks",
    "workbook_entries",
    "run",
    "main",
]

WORKBOOK_MODEL_PRESET = "qwen3-30b-a3b"  # the workbook runs the real shape; the notebooks default to "small"
CELL_TIMEOUT_S = 1800  # seconds one cell may run (the slowest full-size cell takes a few minutes on 2 cores)

# (output name, notebook, parameters beyond the defaults)
WORKBOOK: list[tuple[str, str, dict]] = [
    ("01_end_to_end-nvfp4", "01_end_to_end.ipynb", {}),
    ("01_end_to_end-mxfp4", "01_end_to_end.ipynb", {"scheme": "w_mxfp4_a_mxfp4"}),
    ("07_accuracy_recovery", "07_accuracy_recovery.ipynb", {}),
]


NOTEBOOKS_PACKAGE = "mxlib.notebooks"  # the installed notebooks: package data of this package (pyproject.toml)

CHANNEL_POLL_S = 0.5  # the longest one wait on a kernel channel lasts before it looks again (see below)


def poll_kernel_channels_in_slices(seconds: float = CHANNEL_POLL_S) -> None:
    """Make every wait on a Jupyter kernel channel, in this process, look again every ``seconds``.

    A papermill run sometimes stops forever on a cell that shows an ipywidgets ``interactive``
    (jupyter/nbclient#312; here in notebooks 00 and 04, once in roughly ten runs): the kernel has
    sent the cell's reply and is idle, but nbclient's wait on the channel (jupyter_client's asyncio
    ``get_msg`` with no timeout) is never woken. A wait with a timeout finds the message when the
    timeout expires (measured: 25 widget cells, 8 papermill runs, stalls of exactly the cell timeout
    that then went on). So waits are cut into slices of ``seconds``: a lost wake-up costs at most one
    slice. The overall timeout a caller passes is kept. Idempotent; patches
    ``jupyter_client.channels.AsyncZMQSocketChannel.get_msg``.
    """
    from jupyter_client.channels import AsyncZMQSocketChannel

    if getattr(AsyncZMQSocketChannel.get_msg, "_mxlib_sliced", False):
        return
    whole = AsyncZMQSocketChannel.get_msg

    async def get_msg(self, timeout=None):
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            step = seconds if end is None else max(0.0, min(seconds, end - time.monotonic()))
            try:
                return await whole(self, timeout=step)
            except Empty:
                if end is not None and time.monotonic() >= end:
                    raise

    get_msg._mxlib_sliced = True
    AsyncZMQSocketChannel.get_msg = get_msg


def source_notebooks() -> Path | None:
    """The ``notebooks/`` folder of the source checkout this mxlib runs from (the folder above the
    ``mxlib`` package holds ``pyproject.toml`` and ``notebooks/``), or None for an installed mxlib."""
    root = Path(__file__).resolve().parents[2]
    notebooks = root / "notebooks"
    if (root / "pyproject.toml").is_file() and notebooks.is_dir():
        return notebooks
    return None


def installed_notebooks() -> Path | None:
    """The folder of the installed package ``NOTEBOOKS_PACKAGE`` (``importlib.resources``), where a
    wheel of mxlib puts the notebooks; None when that package cannot be imported or is not a folder
    on disk (a zipped install)."""
    try:
        folder = resources.files(NOTEBOOKS_PACKAGE)
    except ModuleNotFoundError:
        return None
    return folder if isinstance(folder, Path) and folder.is_dir() else None


def default_notebooks() -> Path | None:
    """The notebooks shipped with the mxlib that runs: its source checkout's ``notebooks/`` folder
    (the code and the notebooks of one checkout; an editable install maps ``mxlib.notebooks`` onto
    the same folder), else ``installed_notebooks()``; None when there are neither."""
    return source_notebooks() or installed_notebooks()


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def forbidden_out(out: Path, notebooks: Path) -> Path | None:
    """The folder ``out`` must stay out of, or None: the notebooks folder (executed copies would
    replace or mix with the sources) and the installed packages (``sysconfig``'s purelib and
    platlib, where an installed mxlib lives)."""
    out = out.resolve()
    folders = [notebooks.resolve()] + [Path(sysconfig.get_path(k)).resolve() for k in ("purelib", "platlib")]
    return next((f for f in folders if _inside(out, f)), None)


def workbook_entries(notebooks: Path) -> list[tuple[str, str, dict]]:
    """``(output name, notebook file, parameters)`` for every run of the workbook: the ``WORKBOOK``
    entries whose notebook is in ``notebooks``, then every other notebook there once, on its defaults."""
    present = {p.name for p in notebooks.glob("*.ipynb")}
    listed = [e for e in WORKBOOK if e[1] in present]
    named = {nb for _, nb, _ in WORKBOOK}
    return listed + [(Path(nb).stem, nb, {}) for nb in sorted(present - named)]


def _parameter_names(notebook: Path) -> set[str]:
    """Names assigned in a notebook's ``parameters`` cell."""
    import papermill as pm

    return set(pm.inspect_notebook(str(notebook)))


def run(
    notebooks: Path, out: Path, only: str | None = None, model_preset: str | None = None
) -> list[tuple[str, float]]:
    """Execute the workbook's notebooks from ``notebooks`` into ``out`` (their working directory);
    ``model_preset`` (default ``WORKBOOK_MODEL_PRESET``) goes to every notebook that takes one. Returns
    ``(name, seconds)`` per notebook run. Writes only under ``out`` (and the checkpoint cache)."""
    import nbformat
    import papermill as pm
    from nbconvert import HTMLExporter

    poll_kernel_channels_in_slices()
    out.mkdir(parents=True, exist_ok=True)
    (out / "results").mkdir(exist_ok=True)
    done = []
    for name, nb, params in workbook_entries(notebooks):
        if only and only not in name:
            continue
        params = dict(params)
        # relative to the notebook's working directory (out): the injected parameters hold no absolute path
        params.setdefault("results_path", os.path.join("results", f"{name}.json"))
        if "model_preset" in _parameter_names(notebooks / nb):
            params["model_preset"] = model_preset or WORKBOOK_MODEL_PRESET
        t0 = time.perf_counter()
        print(f"[workbook] {name}: {nb} {params}", flush=True)
        executed = out / f"{name}.ipynb"
        # a cell that outlives CELL_TIMEOUT_S fails the run instead of hanging it (a kernel once stopped
        # answering in a widget cell of notebook 00 and the run waited with no end; its rerun took 20 s)
        pm.execute_notebook(
            str(notebooks / nb),
            str(executed),
            parameters=params,
            kernel_name="python3",
            engine_name=_progress_engine(name, t0),
            cwd=str(out),
            progress_bar=False,
            execution_timeout=CELL_TIMEOUT_S,
        )
        body, _ = HTMLExporter().from_notebook_node(nbformat.read(executed, as_version=4))
        (out / f"{name}.html").write_text(body, encoding="utf-8")
        seconds = time.perf_counter() - t0
        done.append((name, seconds))
        print(f"[workbook] {name}: done in {seconds:.0f} s -> {executed} and {name}.html", flush=True)
    return done


def _progress_engine(name: str, t0: float) -> str:
    """Register and name a papermill engine that prints one line per executed code cell: the run's name,
    the cell's index and first source line, its seconds and the notebook's elapsed seconds (papermill's
    own progress bar redraws one line, which a CI log shows as noise)."""
    from papermill.engines import NBClientEngine, papermill_engines

    class ProgressEngine(NBClientEngine):
        @classmethod
        def execute_managed_notebook(cls, nb_man, kernel_name, **kwargs):
            complete = nb_man.cell_complete

            def cell_complete(cell, cell_index=None, **kw):
                complete(cell, cell_index=cell_index, **kw)
                if cell.cell_type == "code":
                    seconds = (cell.metadata.get("papermill") or {}).get("duration") or 0.0
                    first = next((ln for ln in cell.source.splitlines() if ln.strip()), "")[:60]
                    print(
                        f"[workbook] {name}: cell {cell_index} {seconds:6.1f} s, {time.perf_counter() - t0:6.0f} s in"
                        f"  | {first}",
                        flush=True,
                    )

            nb_man.cell_complete = cell_complete
            return super().execute_managed_notebook(nb_man, kernel_name, **kwargs)

    papermill_engines.register("mxlib-progress", ProgressEngine)
    return "mxlib-progress"


class _OptionError(ValueError):
    """A bad option: one line naming it and the valid values, exit code 2."""


def _check_options(args) -> Path:
    """The notebooks folder, once every option is checked (``_OptionError`` naming the option)."""
    if args.notebooks is None:
        notebooks = default_notebooks()
        if notebooks is None:
            raise _OptionError(
                f"--notebooks: this mxlib has no notebooks (not a source checkout, and the package "
                f"{NOTEBOOKS_PACKAGE} is not installed as a folder); pass --notebooks DIR (a folder holding the "
                f"workbook's .ipynb files)"
            )
    else:
        notebooks = Path(args.notebooks)
        if not notebooks.is_dir():
            raise _OptionError(
                f"--notebooks: expected a folder holding .ipynb files, got {args.notebooks!r} (not a folder)"
            )
    names = [name for name, _, _ in workbook_entries(notebooks)]
    if not names:
        raise _OptionError(f"--notebooks: expected a folder holding .ipynb files, got {str(notebooks)!r} (none there)")
    if args.only is not None and not any(args.only in n for n in names):
        raise _OptionError(f"--only: expected a part of one of {names}, got {args.only!r}")
    if args.model_preset is not None and args.model_preset not in MODEL_PRESETS:
        raise _OptionError(f"--model-preset: expected one of {list(MODEL_PRESETS)}, got {args.model_preset!r}")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise _OptionError(
            f"--out: expected a folder (created if absent), got {args.out!r} ({describe_destination(out)})"
        )
    above = next((q for q in out.parents if q.exists()), None)
    if above is not None and not above.is_dir():
        raise _OptionError(
            f"--out: expected a folder (created if absent), got {args.out!r} (under the file {str(above)!r})"
        )
    forbidden = forbidden_out(out, notebooks)
    if forbidden is not None:
        raise _OptionError(
            f"--out: expected a folder outside {str(forbidden)!r} (the notebooks folder and the installed packages "
            f"stay as installed), got {args.out!r}"
        )
    return notebooks


def main(argv: list[str] | None = None, prog: str = "python -m mxlib.workbook") -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the workbook, print each notebook's time;
    returns the exit code: 0, or 2 for a bad option (one line on stderr naming it, nothing run).
    ``prog`` names the command in the usage and error lines (``mxlib workbook`` for the console
    script's subcommand)."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--notebooks",
        default=None,
        help="the folder of the notebooks (default: the ones shipped with mxlib, from its checkout or its installed "
        "package data)",
    )
    ap.add_argument(
        "--out",
        default=os.path.join("build", "workbook"),
        help="the output folder, relative to the current directory (default: build/workbook)",
    )
    ap.add_argument("--only", default=None, help="run the entries whose name contains this (e.g. 02)")
    ap.add_argument(
        "--model-preset",
        default=None,
        metavar="NAME",
        help=f"model size for the notebooks that take one, one of {list(MODEL_PRESETS)} (default: each notebook's)",
    )
    args = ap.parse_args(argv)
    try:
        notebooks = _check_options(args)
    except _OptionError as err:
        print(f"{ap.prog}: error: {err}", file=sys.stderr)
        return 2
    done = run(notebooks, Path(args.out), args.only, args.model_preset)
    for name, s in done:
        print(f"{name:40s} {s:7.0f} s")
    return 0
