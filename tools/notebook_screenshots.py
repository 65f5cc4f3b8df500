"""Screenshots of an executed notebook's rendered HTML for README (docs/img/).

    python tools/notebook_screenshots.py build/workbook/00_first_principles.ipynb docs/img \
        first-principles-block:2.2:2.3 first-principles-figure:2.3:3:noinput

Each ``NAME:START:STOP`` keeps the notebook's cells from the markdown cell holding the heading
``## START`` / ``### START`` up to (not including) the cell holding heading ``STOP`` (a trailing
``:noinput`` hides the code), exports them with
nbconvert and photographs the page top with headless Chromium (``--screenshot``) as ``<out>/NAME.png``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path


def _has_heading(cell, number: str) -> bool:
    pattern = rf"^#{{2,3}} {re.escape(number)}[. ]"
    return cell.cell_type == "markdown" and re.search(pattern, cell.source, re.M) is not None


def cells_between(nb, start: str, stop: str):
    """Cells from the one holding heading ``start`` up to (not including) the one holding ``stop``."""
    first = next((i for i, c in enumerate(nb.cells) if _has_heading(c, start)), None)
    if first is None:
        raise ValueError(f"no heading {start!r} in the notebook")
    last = next((i for i, c in enumerate(nb.cells) if i > first and _has_heading(c, stop)), len(nb.cells))
    return nb.cells[first:last]


def main(argv: list[str]) -> int:
    import nbformat
    from nbconvert import HTMLExporter
    from nbconvert.preprocessors import TagRemovePreprocessor

    executed, out, specs = Path(argv[0]), Path(argv[1]).resolve(), argv[2:]
    out.mkdir(parents=True, exist_ok=True)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("chromium not found: run tools/ensure_chromium.sh")
    for spec in specs:
        name, start, stop, *flags = spec.split(":")
        nb = nbformat.read(executed, as_version=4)
        cells = cells_between(nb, start, stop)
        # The figures need the output that embeds plotly.js, which sits in the first figure's cell.
        bundle = next(
            (
                o
                for c in nb.cells
                if c.cell_type == "code"
                for o in c.get("outputs", [])
                if len(str(o.get("data", {}).get("text/html", ""))) > 1_000_000
            ),
            None,
        )
        if bundle is not None:
            loader = nbformat.v4.new_code_cell("", outputs=[bundle])
            loader.metadata["tags"] = ["remove_input"]
            cells = [loader, *cells]
        nb.cells = cells
        exporter = HTMLExporter(exclude_input="noinput" in flags)
        exporter.register_preprocessor(TagRemovePreprocessor(remove_input_tags={"remove_input"}, enabled=True), True)
        body, _ = exporter.from_notebook_node(nb)
        html = out / f".{name}.html"
        html.write_text(body, encoding="utf-8")
        png = out / f"{name}.png"
        subprocess.run(
            [
                chromium,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                "--window-size=1100,1100",
                "--virtual-time-budget=20000",
                f"--screenshot={png}",
                html.as_uri(),
            ],
            check=True,
            capture_output=True,
            timeout=180,
        )
        html.unlink()
        print(f"{png}: {png.stat().st_size // 1024} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
