"""Rendered output: executed notebooks, exported to HTML, drawn by headless Chromium.

For each entry of ``RENDERED_NOTEBOOKS`` the test takes the notebook executed with papermill on tiny
parameters (the session fixture ``executed_notebook`` of tests/conftest.py: the same execution that
tests/test_notebooks.py reads, run once), exports HTML with nbconvert (as ``make workbook`` does),
loads it in headless Chromium with a probe script appended, and checks in the DOM after the scripts ran:

* every plotly figure was drawn (``Plotly.newPlot`` ran: the div has class ``js-plotly-plot``), each of
  its traces holds data, and its SVG holds drawn traces;
* every plotly table shows all its rows inside its visible area (no scrolling needed);
* every HTML table (pandas or ``mxlib.workbook.explorers.rows_table``) shows all its rows: no ``...`` row and no
  pandas "N rows x M columns" truncation note;
* the papermill-injected parameters cell holds no absolute path.

Chromium is the Debian package ``chromium``; ``tools/ensure_chromium.sh`` installs it.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from test_notebook_settings import SUGGESTED

from _util import chromium_binary
from test_notebooks import NOTEBOOK_PARAMS

pytestmark = pytest.mark.notebook  # headless Chromium over executed notebooks

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"

# The notebooks whose rendering is tested, with the parameters they run on here (those of tests/test_notebooks.py,
# and 00's defaults of tests/test_notebook_settings.py, so that one execution serves both). Add a
# row per notebook; ``results_path="results.json"`` is added (relative to the execution's folder).
RENDERED_NOTEBOOKS: list[tuple[str, dict]] = [
    ("00_first_principles.ipynb", SUGGESTED["00-defaults"][1]),  # its defaults: tests/test_notebook_settings.py's run
    ("01_end_to_end.ipynb", NOTEBOOK_PARAMS["01_end_to_end-nvfp4"]),
    ("04_scale_unification.ipynb", NOTEBOOK_PARAMS["04_scale_unification"]),
    ("02_microscaling_formats.ipynb", NOTEBOOK_PARAMS["02_microscaling_formats"]),
    ("03_scheme_comparison.ipynb", NOTEBOOK_PARAMS["03_scheme_comparison"]),
    ("05_fused_emulation_benchmark.ipynb", NOTEBOOK_PARAMS["05_fused_emulation_benchmark"]),
    ("06_what_fp4_costs.ipynb", NOTEBOOK_PARAMS["06_what_fp4_costs"]),
    ("07_accuracy_recovery.ipynb", NOTEBOOK_PARAMS["07_accuracy_recovery"]),
]

# The fewest plotly figures a notebook's HTML must draw, where its lesson lives in its figures (00's pictures of a
# block, of bit fields and of the e2m1 line; 02's 2 x 2 of block size x scale format, the amax histogram, the
# rule ranking and the outlier panels among its tables and plots).
MIN_FIGURES: dict[str, int] = {"00_first_principles": 5, "02_microscaling_formats": 13}

_PROBE = r"""
<script>
window.addEventListener('load', function () {
  setTimeout(function () {
    var report = [];
    document.querySelectorAll('div.plotly-graph-div').forEach(function (gd) {
      var fig = {id: gd.id, drawn: gd.classList.contains('js-plotly-plot'), traces: [], tables: []};
      (gd._fullData || []).forEach(function (tr) {
        var n = 0;
        if (tr.type === 'table') {
          n = (tr.cells && tr.cells.values && tr.cells.values.length) ? tr.cells.values[0].length : 0;
        } else {
          var arr = tr.y || tr.z || tr.values || tr.x || [];
          n = arr.length || 0;
        }
        fig.traces.push({type: tr.type, points: n});
      });
      fig.svg_traces = gd.querySelectorAll('.main-svg .trace, .main-svg g.table, .main-svg image').length;
      gd.querySelectorAll('g.table').forEach(function (tbl) {
        var bg = tbl.querySelector('rect.scroll-background').getBoundingClientRect();
        var col = tbl.querySelector('g.y-column');
        var visible = 0;
        col.querySelectorAll('g.column-block').forEach(function (blk) {
          if (blk.id.indexOf('header') === 0) return;
          blk.querySelectorAll('g.column-cell').forEach(function (c) {
            var r = c.getBoundingClientRect();
            if (r.height > 0 && r.top >= bg.top - 1 && r.bottom <= bg.bottom + 1) visible++;
          });
        });
        fig.tables.push({visible_rows: visible});
      });
      report.push(fig);
    });
    var pre = document.createElement('pre');
    pre.id = 'render-probe';
    pre.textContent = JSON.stringify(report);
    document.body.appendChild(pre);
  }, 1500);
});
</script>
"""


def export_html(executed: Path, out_dir: Path) -> Path:
    """nbconvert's HTML export of an executed notebook into ``out_dir``; returns the HTML path."""
    import nbformat
    from nbconvert import HTMLExporter

    body, _ = HTMLExporter().from_notebook_node(nbformat.read(executed, as_version=4))
    html = out_dir / f"{executed.stem}.html"
    html.write_text(body, encoding="utf-8")
    return html


def injected_parameters(executed: Path) -> str:
    """The source of the papermill-injected parameters cell ("" if there is none)."""
    nb = json.loads(executed.read_text(encoding="utf-8"))
    return next(
        ("".join(c["source"]) for c in nb["cells"] if "injected-parameters" in c.get("metadata", {}).get("tags", [])),
        "",
    )


def dump_dom(html: Path, budget_ms: int = 30000) -> str:
    """The DOM of ``html`` after its scripts ran in headless Chromium, probe report included."""
    probed = html.with_name(html.stem + ".probe.html")
    text = html.read_text(encoding="utf-8")
    probed.write_text(
        text.replace("</body>", _PROBE + "</body>") if "</body>" in text else text + _PROBE, encoding="utf-8"
    )
    cmd = [
        chromium_binary(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1280,2000",
        f"--virtual-time-budget={budget_ms}",
        "--host-resolver-rules=MAP * ~NOTFOUND",  # offline: the HTML must not need the network
        "--dump-dom",
        probed.as_uri(),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"chromium failed ({proc.returncode}): {proc.stderr[-2000:]}"
    return proc.stdout


def check_dom(dom: str) -> dict:
    """Check the figures and tables of a dumped DOM; returns counts ``{"figures", "html_tables"}``.

    Raises AssertionError naming the figure or table that is empty or truncated.
    """
    from bs4 import BeautifulSoup

    soup = BeautifulSoup(dom, "html.parser")
    probe = soup.find(id="render-probe")
    assert probe is not None, "the probe script did not run (page scripts failed or did not finish)"
    figures = json.loads(probe.get_text())
    for fig in figures:
        assert fig["drawn"], f"figure {fig['id']}: Plotly.newPlot did not run"
        assert fig["traces"], f"figure {fig['id']}: no traces"
        assert all(t["points"] > 0 for t in fig["traces"]), f"figure {fig['id']}: an empty trace {fig['traces']}"
        assert fig["svg_traces"] > 0, f"figure {fig['id']}: nothing drawn in its SVG"
        rows = [t["points"] for t in fig["traces"] if t["type"] == "table"]
        for want, tbl in zip(rows, fig["tables"]):
            assert tbl["visible_rows"] == want, (
                f"figure {fig['id']}: table shows {tbl['visible_rows']} of {want} rows without scrolling"
            )
    tables = [t for t in soup.find_all("table") if not t.find_parent(class_="plotly-graph-div")]
    for i, t in enumerate(tables):
        for tr in t.find_all("tr"):
            cells = [c.get_text(strip=True) for c in tr.find_all(["td", "th"])]
            assert not cells or not all(c in ("...", "\u2026") for c in cells), f"HTML table {i}: elided rows"
    assert not re.search(r"\d+ rows \u00d7 \d+ columns", soup.get_text()), "a pandas frame was truncated"
    return {"figures": len(figures), "html_tables": len(tables)}


# each rendering runs in the xdist_group of the tests that read the same execution (tests/test_notebooks.py,
# tests/test_notebook_settings.py), named by the notebook: one worker executes it and no other waits for it
_GROUPS = {nb: Path(nb).stem for nb, _ in RENDERED_NOTEBOOKS}


@pytest.mark.parametrize(
    "notebook, params",
    [pytest.param(nb, params, id=nb, marks=pytest.mark.xdist_group(_GROUPS[nb])) for nb, params in RENDERED_NOTEBOOKS],
)
def test_notebook_renders(notebook, params, executed_notebook, tmp_path):
    stem = Path(notebook).stem
    folder = executed_notebook(stem, params)
    executed = folder / f"{stem}.ipynb"
    injected = injected_parameters(executed)
    assert "results_path" in injected, "papermill injected no parameters"
    assert not re.search(r"""['"](/|[A-Za-z]:\\)""", injected), (
        f"an absolute path in the injected parameters: {injected}"
    )
    counts = check_dom(dump_dom(export_html(executed, tmp_path)))
    assert counts["figures"] >= MIN_FIGURES.get(stem, 1), f"{notebook}: {counts['figures']} plotly figures drawn"
    assert (folder / "results.json").exists(), "results_path was not written"


def test_probe_catches_truncation_and_empty_figures(tmp_path):
    """The checks can fail: a plotly table too short for its rows, an empty trace, an elided HTML row."""
    import plotly.graph_objects as go

    def page(fig_html: str, extra: str = "") -> Path:
        p = tmp_path / f"page{len(list(tmp_path.iterdir()))}.html"
        p.write_text(f"<html><body>{fig_html}{extra}</body></html>", encoding="utf-8")
        return p

    n = 30
    short = go.Figure(go.Table(cells=dict(values=[list(range(n))])))
    short.update_layout(height=250)
    with pytest.raises(AssertionError, match="table shows"):
        check_dom(dump_dom(page(short.to_html(include_plotlyjs=True))))
    tall = go.Figure(go.Table(cells=dict(values=[list(range(n))])))
    tall.update_layout(height=120 + 28 * n)
    assert check_dom(dump_dom(page(tall.to_html(include_plotlyjs=True)))) == {"figures": 1, "html_tables": 0}
    empty = go.Figure(go.Scatter(x=[], y=[]))
    with pytest.raises(AssertionError, match="empty trace"):
        check_dom(dump_dom(page(empty.to_html(include_plotlyjs=True))))
    elided = "<table><tr><td>1</td></tr><tr><td>...</td></tr><tr><td>9</td></tr></table>"
    with pytest.raises(AssertionError, match="elided"):
        check_dom(dump_dom(page(tall.to_html(include_plotlyjs=True), elided)))


def test_notebook_renderer_emits_mime_bundle_and_offline_html():
    """Figures carry the plotly mime type (JupyterLab draws it untrusted) and HTML with no CDN script."""
    import plotly.graph_objects as go
    import plotly.io as pio

    from mxlib.workbook.setup import NOTEBOOK_RENDERER, use_notebook_renderer

    before = pio.renderers.default
    try:
        assert use_notebook_renderer() == NOTEBOOK_RENDERER == pio.renderers.default
        fig = go.Figure(go.Scatter(y=[1, 2])).to_dict()
        bundle = {}
        for name in NOTEBOOK_RENDERER.split("+"):
            bundle.update(pio.renderers[name].to_mimebundle(fig))
        assert "application/vnd.plotly.v1+json" in bundle and "text/html" in bundle
        assert "cdn.plot.ly" not in bundle["text/html"]
    finally:
        pio.renderers.default = before


_TABLE_PROBE = r"""
<script>
window.addEventListener('load', function () {
  var out = [];
  document.querySelectorAll('div.mxlib-rows-box').forEach(function (box) {
    var t = box.querySelector('table');
    out.push({box_right: box.getBoundingClientRect().right, page: document.documentElement.clientWidth,
              table: t.scrollWidth, box: box.clientWidth});
  });
  var pre = document.createElement('pre');
  pre.id = 'table-probe';
  pre.textContent = JSON.stringify({tables: out, page_scroll: document.documentElement.scrollWidth,
                                    page: document.documentElement.clientWidth});
  document.body.appendChild(pre);
});
</script>
"""


def test_rows_table_never_spills_over_the_page(tmp_path):
    """The widest table of the workbook (notebook 05's 18 columns of recorded MoE-layer rows) drawn in
    Chromium at 1280 px: its headers break after underscores, so it fits the page without scrolling,
    and a table wider still (60 columns) scrolls inside its own box instead of widening the page."""
    from bs4 import BeautifulSoup

    from mxlib.workbook import explorers as X

    rows = json.loads((ROOT / "benchmarks" / "h200_moe.json").read_text())["rows"]
    cols = [
        "scheme",
        "M",
        "experts_hit",
        "bf16_ms",
        "dequant_ms",
        "fused_ms",
        "bf16_graph_ms",
        "dequant_graph_ms",
        "fused_graph_ms",
        "fused_speedup_vs_dequant",
        "fused_over_bf16",
        "fused_graph_over_bf16_graph",
        "fused_bound_frac_graph",
        "fused_tflops_frac",
        "bf16_mem_mb",
        "dequant_mem_mb",
        "fused_mem_mb",
        "fused_vs_dequant_rel_err",
    ]
    wide = X.rows_table(rows, columns=cols, caption="18 columns").data
    wider = X.rows_table([{f"column_number_{j}": 1.0 / 3 for j in range(60)}], caption="60 columns").data
    page = tmp_path / "tables.html"
    page.write_text(f"<html><body>{wide}{wider}{_TABLE_PROBE}</body></html>", encoding="utf-8")
    soup = BeautifulSoup(dump_dom(page, budget_ms=5000), "html.parser")
    probe = json.loads(soup.find(id="table-probe").get_text())
    fits, scrolls = probe["tables"]
    assert probe["page_scroll"] <= probe["page"], probe  # nothing widens the page
    assert fits["table"] <= fits["box"] and fits["box_right"] <= fits["page"], fits
    assert scrolls["table"] > scrolls["box"] and scrolls["box_right"] <= scrolls["page"], scrolls


_TICK_PROBE = r"""
<script>
window.addEventListener('load', function () {
  setTimeout(function () {
    var boxes = [];
    document.querySelectorAll('g.ytick text, g.xtick text').forEach(function (t) {
      var r = t.getBoundingClientRect();
      if (r.width > 0) boxes.push([r.left, r.top, r.right, r.bottom, t.textContent]);
    });
    var pre = document.createElement('pre');
    pre.id = 'tick-probe';
    pre.textContent = JSON.stringify(boxes);
    document.body.appendChild(pre);
  }, 1000);
});
</script>
"""


def test_scheme_bar_labels_do_not_overlap(tmp_path):
    """Notebook 03's bar figure with the twelve scheme names, drawn in Chromium: no two tick labels overlap."""
    from bs4 import BeautifulSoup

    from mxlib.moe import MOE_SCHEMES
    from mxlib.workbook import figures

    rows = [dict(scheme=n, sqnr_db=20.0 + i, top1_agreement=0.8, kl_divergence=0.01) for i, n in enumerate(MOE_SCHEMES)]
    fig = figures.bar_figure(rows, "scheme", ["sqnr_db", "top1_agreement", "kl_divergence"])
    page = tmp_path / "bars.html"
    page.write_text(
        f"<html><body>{fig.to_html(include_plotlyjs=True, full_html=False)}{_TICK_PROBE}</body></html>",
        encoding="utf-8",
    )
    soup = BeautifulSoup(dump_dom(page, budget_ms=10000), "html.parser")
    boxes = json.loads(soup.find(id="tick-probe").get_text())
    names = [b[4] for b in boxes]
    assert set(MOE_SCHEMES) <= set(names), names
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            overlap = a[0] < b[2] - 0.5 and b[0] < a[2] - 0.5 and a[1] < b[3] - 0.5 and b[1] < a[3] - 0.5
            assert not overlap, (a, b)
