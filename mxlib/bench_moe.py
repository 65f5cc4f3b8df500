"""The seed's ``mxlib.bench_moe``: the MoE-layer benchmark now lives in ``mxlib.bench.moe``."""

from .bench.moe import *  # noqa: F401,F403
from .bench.moe import bench_model, bench_scheme, build_layer, machine_ceilings, main, sweep  # noqa: F401
