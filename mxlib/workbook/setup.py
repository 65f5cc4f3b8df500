"""Notebook set-up shared by the workbook notebooks: how plotly figures are rendered.

``use_notebook_renderer()`` makes every figure output carry two representations:

* ``application/vnd.plotly.v1+json`` (renderer ``plotly_mimetype``): the figure as data.
  JupyterLab draws it with the ``jupyterlab-plotly`` extension that ships with plotly, also
  when the notebook is opened *untrusted* (a data mime type needs no script to run);
* ``text/html`` (renderer ``notebook``): a ``<div>`` and a script calling ``Plotly.newPlot``;
  the first figure's output is preceded by one output embedding plotly.js itself (about 4.6 MB),
  so nbconvert's HTML export draws every figure offline, with no network (the
  ``notebook_connected`` renderer would fetch plotly.js from a CDN instead).

nbconvert's HTML export picks ``text/html`` (it has no plotly mime renderer); JupyterLab picks
the plotly mime type when it is present. ``tests/test_render.py`` checks the exported HTML in
headless Chromium.
"""

from __future__ import annotations

import plotly.io as pio

__all__ = ["NOTEBOOK_RENDERER", "use_notebook_renderer"]

NOTEBOOK_RENDERER = "plotly_mimetype+notebook"


def use_notebook_renderer() -> str:
    """Set ``plotly.io.renderers.default`` to ``NOTEBOOK_RENDERER`` and return it.

    Call it once near the top of a notebook (it emits the plotly.js output there when run in a
    kernel); figures shown afterwards with ``fig.show()`` or as a cell's last value carry both the
    plotly mime bundle and offline HTML.
    """
    pio.renderers.default = NOTEBOOK_RENDERER
    return NOTEBOOK_RENDERER
