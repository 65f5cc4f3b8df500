"""The workbook's wing: what the notebooks (and ``mxlib.cli``) call, sorted by subject.

====================  ==============================================================================
module                what it holds
====================  ==============================================================================
``steps``             the pipeline steps of notebook 01 and ``mxlib.cli e2e``: parameter checks (the
                      scheme name resolved once), the dummy model, calibration, writing and loading
                      the checkpoint (cached), runs and their comparison, the results JSON
``studies``           every scheme side by side; NVFP4 scale unification; vLLM vs hardware numerics
``explorers``         the plain functions behind the interactive explorers, their thin widgets, and
                      ``rows_table`` (an HTML table of dict rows)
``probes``            what a written checkpoint stores (shapes, one block decoded); notebook 01's
                      swapped-nibbles negative control and captured module outputs
``variant_lessons``   notebook 02's NVFP4 variants ahead of hardware (UE5M3 scales, 32-element blocks)
                      beside NVFP4 and MXFP4, and what a global scale buys UE5M3
``checks``            the counted ``Checks`` of an assert cell, the exercises and their checkers,
                      the tables of notebooks 04 and 05 (strategy summary, floors, the anchor
                      tables)
``figures``           plotly figures
``timing``            how far a recorded benchmark time moves between recordings, and "faster"
                      decided against it (``mxlib.stats``): notebook 05
``verdicts``          the trained-model studies' paired differences decided together against the
                      noise level (``mxlib.stats``): notebooks 06 and 07
``setup``             how notebook figures are rendered (``use_notebook_renderer``)
``runner``            runs the notebooks through papermill (``python -m mxlib.workbook``)
``accuracy``          notebook 06's studies: every scheme and strategy on the project's trained MoE
``attribution``       where a scheme's loss comes from (w13, w2, a1, a2; each layer), with exact
                      sums; ``attribution_figures`` draws it
``own_checkpoint``    a user's own checkpoint: its first layers' activation-QDQ and unification loss
``recovery``          notebook 07's studies: every accuracy-recovery technique side by side on the
                      trained MoE and the dummy model; ``recovery_measures`` measures one technique
                      (weight error, kernel path, block changes, the rotation trap, the controls);
                      ``recovery_figures`` draws them
====================  ==============================================================================

The wing sits one layer above ``mxlib.models`` (``tests/test_layering.py``); ``mxlib.cli`` and
``mxlib.bench`` sit above it. Importing the package imports none of its modules.
"""
