"""Run the workbook: every notebook through papermill on its defaults, then HTML.

``python -m mxlib.workbook --out build/workbook`` (what ``make workbook`` runs) executes each
entry of ``WORKBOOK`` and writes ``<out>/<name>.ipynb`` (executed copy) and ``<out>/<name>.html``
(self-contained: plotly.js is embedded). ``--only NAME`` runs the entries whose name contains
NAME; ``--model-preset small`` runs the notebooks that take a model size at that size.
Results JSON written by the notebooks land in ``<out>/results``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"

CELL_TIMEOUT_S = 1800  # seconds one cell may run (the slowest full-size cell takes a few minutes on 2 cores)

# (output name, notebook, parameters beyond the defaults)
WORKBOOK: list[tuple[str, str, dict]] = [
    ("01_end_to_end-nvfp4", "01_end_to_end.ipynb", {}),
    ("01_end_to_end-mxfp4", "01_end_to_end.ipynb", {"scheme": "mxfp4"}),
]


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
    import time as _time
    from queue import Empty

    from jupyter_client.channels import AsyncZMQSocketChannel

    if getattr(AsyncZMQSocketChannel.get_msg, "_mxlib_sliced", False):
        return
    whole = AsyncZMQSocketChannel.get_msg

    async def get_msg(self, timeout=None):
        end = None if timeout is None else _time.monotonic() + timeout
        while True:
            step = seconds if end is None else max(0.0, min(seconds, end - _time.monotonic()))
            try:
                return await whole(self, timeout=step)
            except Empty:
                if end is not None and _time.monotonic() >= end:
                    raise

    get_msg._mxlib_sliced = True
    AsyncZMQSocketChannel.get_msg = get_msg


def _extra_entries() -> list[tuple[str, str, dict]]:
    """Every other notebook in notebooks/, once, on its defaults."""
    listed = {nb for _, nb, _ in WORKBOOK}
    return [(p.stem, p.name, {}) for p in sorted(NOTEBOOKS.glob("*.ipynb")) if p.name not in listed]


def _parameter_names(notebook: Path) -> set[str]:
    """Names assigned in a notebook's ``parameters`` cell."""
    import papermill as pm

    return set(pm.inspect_notebook(str(notebook)))


def run(out: Path, only: str | None = None, model_preset: str | None = None) -> list[tuple[str, float]]:
    """Execute the workbook into ``out``; ``model_preset`` (e.g. ``small``) goes to every notebook
    that takes one. Returns ``(name, seconds)`` per notebook run."""
    import nbformat
    import papermill as pm
    from nbconvert import HTMLExporter

    poll_kernel_channels_in_slices()
    out.mkdir(parents=True, exist_ok=True)
    (out / "results").mkdir(exist_ok=True)
    done = []
    for name, nb, params in WORKBOOK + _extra_entries():
        if only and only not in name:
            continue
        params = dict(params)
        # relative to the notebook's working directory: the injected parameters hold no absolute path
        params.setdefault("results_path", os.path.relpath(out.resolve() / "results" / f"{name}.json", NOTEBOOKS))
        if model_preset and "model_preset" in _parameter_names(NOTEBOOKS / nb):
            params["model_preset"] = model_preset
        t0 = time.perf_counter()
        print(f"[workbook] {name}: {nb} {params}", flush=True)
        executed = out / f"{name}.ipynb"
        # a cell that outlives CELL_TIMEOUT_S fails the run instead of hanging it (a kernel once stopped
        # answering in a widget cell of notebook 00 and the run waited with no end; its rerun took 20 s)
        pm.execute_notebook(str(NOTEBOOKS / nb), str(executed), parameters=params, kernel_name="python3",
                            cwd=str(NOTEBOOKS), progress_bar=False, execution_timeout=CELL_TIMEOUT_S)
        body, _ = HTMLExporter().from_notebook_node(nbformat.read(executed, as_version=4))
        (out / f"{name}.html").write_text(body, encoding="utf-8")
        seconds = time.perf_counter() - t0
        done.append((name, seconds))
        print(f"[workbook] {name}: done in {seconds:.0f} s -> {executed} and {name}.html", flush=True)
    return done


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=str(ROOT / "build" / "workbook"))
    ap.add_argument("--only", default=None)
    ap.add_argument("--model-preset", default=None, help="model size for the notebooks that take one (small, tiny)")
    args = ap.parse_args(argv)
    done = run(Path(args.out), args.only, args.model_preset)
    for name, s in done:
        print(f"{name:40s} {s:7.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
