"""Tile tables of the fused FP4 kernel (``fused_fp4_moe``): MXFP4, NVFP4 and MXFP6 weights.

``get_fp4_configs`` picks the (GEMM1, GEMM2) ``TileConfig`` of a batch by the average number of
(token, expert) pairs per expert, with ``tiles.pick_tiles``.
"""

from __future__ import annotations

from ._bridge import interpreting
from .tiles import TileConfig, pick_tiles

__all__ = ["FP4_CONFIGS", "NVFP4_CONFIGS", "FP6_CONFIGS", "get_fp4_configs"]

# (max pairs per expert, (GEMM1 tiles, GEMM2 tiles)): the winners of graph-replay sweeps on the H200
# (Qwen3-30B-A3B layer, w_mxfp4 / w_mxfp4_a_mxfp4 / nvfp4 in both numerics, torch 2.11, triton 3.6;
# benchmarks/h200_fp4_sweep_operand_layout.json, and with the rotate decode
# benchmarks/h200_decode_rotate.json, h200_fp4_sweep.json: NVFP4's heavier
# decode prefers 64-row tiles at 16 pairs an expert, 0.244 vs 0.281 ms). The a1 QDQ runs as its own pass
# (``a1_fused=False``): a QDQ'd A tile goes registers -> shared memory inside the K loop, which
# makes Triton wait for each MMA before the next; loaded by cp.async it stays pipelined.
# TileConfig(block_m, block_n, block_k (None: the layout's K tile), group_m, num_warps, num_stages)
FP4_CONFIGS: list[tuple[float, tuple[TileConfig, TileConfig]]] = [
    (4.0, (TileConfig(16, 64, None, 1, 4, 3), TileConfig(16, 64, None, 1, 4, 3))),
    (16.0, (TileConfig(32, 128, None, 4, 4, 3), TileConfig(32, 128, None, 4, 4, 3))),
    (64.0, (TileConfig(64, 64, None, 4, 4, 3), TileConfig(64, 64, None, 4, 4, 3))),
    (float("inf"), (TileConfig(128, 128, None, 4, 8, 3), TileConfig(128, 128, None, 4, 8, 3))),
]
NVFP4_CONFIGS: list[tuple[float, tuple[TileConfig, TileConfig]]] = [
    FP4_CONFIGS[0],
    (16.0, (TileConfig(32, 64, None, 1, 4, 3), TileConfig(32, 64, None, 1, 4, 3))),
    *FP4_CONFIGS[2:],
]


# MXFP6 weights (``fp6_layout``, a K step of 256, so twice the A tile per stage): FP4_CONFIGS' tiles,
# not yet swept on the H200; the largest with 2 stages (3 would need 292 KiB for GEMM1 and 242 KiB for
# GEMM2 of shared memory, sm_90 has 227 KiB; 2 need 178 / 153 KiB: ``tests/compile_sm90.py`` sizes).
FP6_CONFIGS: list[tuple[float, tuple[TileConfig, TileConfig]]] = [
    (4.0, (TileConfig(16, 64, None, 1, 4, 3), TileConfig(16, 64, None, 1, 4, 3))),
    (16.0, (TileConfig(32, 128, None, 4, 4, 3), TileConfig(32, 128, None, 4, 4, 3))),
    (64.0, (TileConfig(64, 64, None, 4, 4, 3), TileConfig(64, 64, None, 4, 4, 3))),
    (float("inf"), (TileConfig(128, 128, None, 4, 8, 2), TileConfig(128, 128, None, 4, 8, 2))),
]


def get_fp4_configs(
    num_tokens: int, num_experts: int, top_k: int, nvfp4: bool = False, weight_bits: int = 4
) -> tuple[TileConfig, TileConfig]:
    """(GEMM1, GEMM2) tiles by the average number of pairs per expert (``nvfp4``: NVFP4 weights,
    ``NVFP4_CONFIGS``; ``weight_bits`` 6: ``FP6_CONFIGS``); under the interpreter one small tile,
    GEMM1 with the a1 QDQ in the A-tile load."""
    if interpreting():
        return TileConfig(16, 32, None, 1, 4, 1, a1_fused=True), TileConfig(16, 32, None, 1, 4, 1)
    table = FP6_CONFIGS if weight_bits == 6 else (NVFP4_CONFIGS if nvfp4 else FP4_CONFIGS)
    return pick_tiles(table, num_tokens, num_experts, top_k)
