"""The workbook: what only the notebooks need (the ``workbook`` extra: plotly, ipywidgets, papermill). The rows and
numbers the notebooks show are computed in ``mxlib.studies``; this package draws them, explores them
interactively, checks them and runs the notebooks.

=====================  ==============================================================================
module                 what it holds
=====================  ==============================================================================
``figures``            plotly figures of the notebooks, and ``table`` (a plotly table of dict rows)
``palette``            the workbook's colours
``course_figures``     notebook 00's and 02's figures of the formats (codes, scales, blocks)
``numerics_figures``   figures of vLLM's numerics against the hardware mode, and of a model's forward
``accuracy_figures``   notebook 06's figures (paired intervals, expert usage, amax)
``attribution_figures``  where a scheme's loss comes from, drawn (``mxlib.studies.attribution``)
``recovery_figures``   notebook 07's figures of the recovery techniques
``explorers``          the plain functions behind the interactive explorers, their thin widgets, and
                       ``rows_table`` (an HTML table of dict rows)
``format_lessons``     notebook 02's interactive lessons on the formats (widgets over the reference)
``exercises``          the notebooks' "try this" prompts, their checkers and solutions; the checkers
                       live in ``_exercise_formats`` (formats and scales) and ``_exercise_runs``
                       (runs of the model)
``checks``             the counted ``Checks`` of an assert cell; the exercises re-exported
``setup``              how notebook figures are rendered (``use_notebook_renderer``)
``runner``             runs the notebooks through papermill (``python -m mxlib.workbook``)
=====================  ==============================================================================

The package sits one layer above ``mxlib.studies`` (``tests/test_layering.py``); ``mxlib.cli`` reaches it only
through the ``mxlib workbook`` command (the runner). Importing the package imports none of its modules.
"""
