"""The studies: what the notebooks, ``mxlib.cli`` and ``mxlib.bench`` run. Rows and numbers out; no plotting, no
Jupyter import (the figures and widgets that show them live in ``mxlib.workbook``).

=====================  ==============================================================================
module                 what it holds
=====================  ==============================================================================
``steps``              the pipeline steps of notebook 01 and ``mxlib.cli e2e``: parameter checks (the
                       scheme name resolved once), the dummy model, calibration, writing and loading
                       the checkpoint (cached), runs and their comparison, the results JSON
``scheme_study``       every MoE scheme on one model (``compare_schemes``) and the helpers the studies
                       share (emulation experts swapped in, checkpoint bytes)
``unification``        NVFP4 scale unification (vLLM's single activation global scale against each
                       expert's own) and vLLM's numerics against the hardware mode, against float64
``repeats``            the spread of a metric over evaluation token sets and the orderings beyond it
``probes``             what a written checkpoint stores (shapes, one block decoded); notebook 01's
                       swapped-nibbles negative control and captured module outputs
``stored``             one layer's stored expert tensors against the shapes their packing implies;
                       every scheme and the layout a preset's checkpoint is written in
``variant_lessons``    notebook 02's NVFP4 variants ahead of hardware (UE5M3 scales, 32-element blocks)
                       beside NVFP4 and MXFP4, and what a global scale buys UE5M3
``tables``             the tables of notebooks 04 and 05 that the CLI and the benchmarks print too
                       (strategy summary, speed targets, the tables beside the external-kernel harness)
``timing``             how far a recorded benchmark time moves between recordings, and "faster"
                       decided against it (``mxlib.stats``): notebook 05
``verdicts``           the trained-model studies' paired differences decided together against the
                       noise level (``mxlib.stats``): notebooks 06 and 07
``accuracy``           notebook 06's studies: every scheme and strategy on the project's trained MoE
``routing_agreement``  notebook 06's routing consistency: each scheme's top-k expert sets against bf16's per
                       layer, its noise floor (other experts implementations), decided in the notebook's family
``attribution``        where a scheme's loss comes from (w13, w2, a1, a2; each layer), with exact sums
``group_attribution``  which precision group of a mixed-precision checkpoint costs what: each group switched
                       back to bf16 or into another scheme, exact sums, decided by ``mxlib.stats``
``own_checkpoint``     a user's own checkpoint: its first layers' activation-QDQ and unification loss
``recovery``           notebook 07's studies: every accuracy-recovery technique side by side on the
                       trained MoE and the dummy model
``recovery_measures``  one recovery technique measured: weight error, kernel path, block changes, the
                       rotation trap, the negative controls
=====================  ==============================================================================

The package sits one layer above ``mxlib.models`` and below ``mxlib.workbook`` (``tests/test_layering.py``);
``mxlib.cli`` and ``mxlib.bench`` import it. Importing the package imports none of its modules.
"""
