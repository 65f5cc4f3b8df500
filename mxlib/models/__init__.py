"""Models: the families, their presets and statistics, the trained model, and what a loaded model runs.

``families`` (the MoE families mxlib quantizes), ``moe_models`` (build, balance, swap and read any of them),
``qwen3`` and ``gpt_oss`` (the two presets' dummy models), ``presets`` (their sizes, torch-free), ``calibration``
(activation amax per expert), ``hessians`` (per-expert Hessians), ``routing_stats`` (routing statistics),
``routing_consistency`` (whether two runs' routers pick the same experts per token: Jaccard and share changed),
``tasks`` / ``training`` / ``evaluation`` (the trained model, shipped in ``trained/``, and its task accuracy),
``parameters`` (the one table of bounds of every size, count and seed the command line and the notebooks take),
``in_memory`` (``quantize_``: a bf16 model's experts quantized in memory), ``what_ran`` (what a loaded
model executed per module in one forward, and ``assert_runs_as``). The checkpoints (the layouts, the writer, the
loader and the inspector) are ``mxlib.checkpoints``.
"""
