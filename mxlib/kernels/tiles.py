"""The tile configuration of the grouped MoE GEMMs (``TileConfig``) and the lookup of a tile table.

One type serves the three GEMM paths: the bf16 grouped GEMM (``fused_moe``, ``get_moe_config``),
the fused dequantize-GEMM (``fused_dequant_moe``, ``get_fused_config``) and the fused FP4 kernel
(``fused_fp4_moe``, ``get_fp4_configs``, one ``TileConfig`` per GEMM). Each module keeps its own
table of H200-tuned tiles; ``pick_tiles`` reads any of them by batch size.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TileConfig", "pick_tiles"]


@dataclass(frozen=True)
class TileConfig:
    """Tiles of one grouped GEMM: ``block_m`` (token, k) pairs x ``block_n`` output columns (weight
    rows) x ``block_k`` reduction elements a step; ``group_m`` row blocks a program group (L2 reuse,
    ``_numerics.grouped_pid``); ``num_warps`` and ``num_stages`` of the launch.

    Fields only some kernels read (the others ignore them):

    * ``block_k``: the bf16 and the dequantize-GEMM kernels; None for the FP4 kernel, whose K step
      is its weight layout's (128 elements, ``fp4_layout.K_TILE``; MXFP6 256).
    * ``split_nibbles``: the dequantize-GEMM kernel with FP4 / FP6 weights: the elements of each
      packed byte (word) used as separate dots over K/2 (K/4), with the matching strided
      activations, instead of interleaving the codes back into order.
    * ``a1_fused``: the FP4 kernel's GEMM1: the a1 QDQ in the A-tile load (else one standalone pass).
    """

    block_m: int
    block_n: int
    block_k: int | None = None
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3
    split_nibbles: bool = False
    a1_fused: bool = False


def pick_tiles(table, num_tokens: int, num_experts: int, top_k: int):
    """The entry of a tile table ``[(max pairs per expert, tiles), ...]`` (ascending limits) for a
    batch: the first whose limit holds ``num_tokens * top_k / num_experts`` (else the last).
    Every grouped-GEMM path (bf16, fused dequant, FP4) picks its tiles with this helper."""
    per_expert = num_tokens * top_k / max(1, num_experts)
    for limit, tiles in table:
        if per_expert <= limit:
            return tiles
    return table[-1][1]
