"""Block alignment of the (token, k) pairs for the grouped MoE GEMMs, and the routing plan of a forward.

* ``moe_align_block_size(topk_ids, block_m, num_experts)``: vLLM's function (name, arguments and
  outputs), in PyTorch (a dozen small kernels: 0.06-0.14 ms a forward on the H200 even under
  CUDA-graph replay); ``mxlib.moe`` re-exports it.
* ``moe_align_block_size_triton``: the same outputs in one or two Triton launches.
* ``naive_block_assignment``: vLLM's rule for skipping the alignment (``M * k * 4 <= E``: each pair
  its own block).
* ``plan_routing`` -> ``RoutingPlan``: the one place a forward's alignment is decided; the experts
  (``mxlib.moe.base.TritonExperts``) make one plan per forward and hand it to whichever GEMM path
  runs (``fused_moe``, ``fused_dequant_moe``, ``fused_fp4_moe``).

The outputs, for ``topk_ids [M, k]`` (flat pair index ``t * k + j``):

* ``sorted_token_ids`` int32 ``[max_padded]``: the flat pair indices grouped by ascending expert,
  by flat index within an expert, each expert's group padded with the sentinel ``M * k`` to a
  multiple of ``block_m``; the tail is the sentinel too (``max_padded`` = ``M*k + E*(block_m-1)``
  rounded up to a multiple of ``block_m``);
* ``expert_ids`` int32 ``[max_padded // block_m]``: the expert of each block (blocks past the end
  repeat the last expert and are never computed);
* ``num_tokens_post_padded`` int32 ``[1]``.

No host synchronization anywhere (every output size follows from the input shapes): a forward
that aligns can be captured in a CUDA graph.

The Triton version: the pairs are cut into chunks of ``CHUNK`` (a power of two). Kernel 1 (one
program per chunk) writes each chunk's expert histogram. Kernel 2 (one program per chunk) reads all
histograms, forms every expert's padded start and the count of its pairs in earlier chunks,
sorts its chunk by ``expert * CHUNK + index`` (a stable order by construction) and scatters
the pair indices; program 0 also writes the padding sentinels, the tail, ``expert_ids`` and
``num_tokens_post_padded``. With one chunk (``M * k <= 1024``) kernel 2 computes the
histogram itself and kernel 1 is skipped: one launch. Slots written by different programs
are disjoint, so no ordering between programs is needed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from ._triton import tl, triton

__all__ = [
    "moe_align_block_size",
    "moe_align_block_size_triton",
    "naive_block_assignment",
    "align_blocks",
    "RoutingPlan",
    "plan_routing",
]


def moe_align_block_size(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the flat (token, k) pairs by expert and pad each group to a multiple of ``block_m``.

    The flat index of pair ``(t, j)`` is ``t * k + j``. Pairs are listed by ascending
    expert id (by flat index within an expert); each expert's list is padded with the
    sentinel ``M * k`` up to a multiple of ``block_m``. Experts with no pairs take no
    blocks. Every output has a size fixed by the input shapes (no host synchronization,
    so the call can be captured in a CUDA graph).

    Args:
        topk_ids: ``[M, k]`` integer expert ids in ``[0, num_experts)``.
        block_m: rows per GEMM block.
        num_experts: ``E``.

    Returns:
        ``sorted_token_ids`` int32 ``[M*k + E*(block_m-1)]`` (tail filled with the sentinel),
        ``expert_ids`` int32 ``[len(sorted_token_ids) // block_m]`` (the expert of each block;
        blocks past the end repeat the last expert and are never computed) and
        ``num_tokens_post_padded`` int32 ``[1]``.
    """
    if topk_ids.ndim != 2:
        raise ValueError(f"topk_ids: expected [M, k], got shape {list(topk_ids.shape)}")
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    numel = flat.numel()
    max_padded = numel + num_experts * (block_m - 1)
    max_padded = -(-max_padded // block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    count_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    experts_sorted = flat[order]
    rank = torch.arange(numel, device=device) - count_start[experts_sorted]
    sorted_token_ids = torch.full((max_padded,), numel, dtype=torch.int32, device=device)
    sorted_token_ids[padded_start[experts_sorted] + rank] = order.to(torch.int32)
    block_starts = torch.arange(max_padded // block_m, device=device) * block_m
    expert_ids = torch.searchsorted(padded_end, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_token_ids, expert_ids.to(torch.int32), padded_end[-1:].to(torch.int32)


_MAX_CHUNK = 1024


@triton.jit
def _chunk_hist_kernel(topk_ids_ptr, hist_ptr, numel, E: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(topk_ids_ptr + offs, mask=offs < numel, other=E).to(tl.int32)
    h = tl.histogram(ids, E_PAD)
    tl.store(hist_ptr + c * E_PAD + tl.arange(0, E_PAD), h)


@triton.jit
def _align_scatter_kernel(
    topk_ids_ptr,
    hist_ptr,
    base_ptr,
    sorted_ptr,
    expert_ids_ptr,
    num_post_ptr,
    numel,
    max_padded,
    num_blocks,
    E: tl.constexpr,
    E_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
    LOG_CHUNK: tl.constexpr,
    NCHUNK_PAD: tl.constexpr,
    SINGLE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BM_PAD: tl.constexpr,
    FILL: tl.constexpr,
    JB: tl.constexpr,
):
    c = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    local = tl.arange(0, CHUNK)
    offs = c * CHUNK + local
    valid = offs < numel
    ids = tl.load(topk_ids_ptr + offs, mask=valid, other=E).to(tl.int32)
    if SINGLE:
        mine = tl.histogram(ids, E_PAD)
        counts = mine
        before = tl.zeros((E_PAD,), tl.int32)
    else:
        rows = tl.arange(0, NCHUNK_PAD)
        nchunks = tl.cdiv(numel, CHUNK)
        hist = tl.load(hist_ptr + rows[:, None] * E_PAD + experts[None, :], mask=(rows < nchunks)[:, None], other=0)
        counts = tl.sum(hist, axis=0)
        before = tl.sum(tl.where((rows < c)[:, None], hist, 0), axis=0)
        mine = tl.sum(tl.where((rows == c)[:, None], hist, 0), axis=0)
    counts = tl.where(experts < E, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, 0)
    padded_start = padded_end - padded
    # position of this chunk's first pair of expert e among the chunk's sorted pairs
    chunk_first = tl.cumsum(mine, 0) - mine
    tl.store(base_ptr + c * E_PAD + experts, padded_start + before - chunk_first)
    tl.debug_barrier()
    keys = tl.sort(ids * CHUNK + local)
    pos = tl.arange(0, CHUNK)
    e_sorted = keys >> LOG_CHUNK
    idx = c * CHUNK + (keys & (CHUNK - 1))
    ok = e_sorted < E
    dest = tl.load(base_ptr + c * E_PAD + e_sorted, mask=ok, other=0) + pos
    tl.store(sorted_ptr + dest, idx, mask=ok)
    if c == 0:
        total = tl.sum(padded, 0)
        tl.store(num_post_ptr, total)
        # sentinels: each expert's padding, then the tail
        j = tl.arange(0, BM_PAD)
        slot = (padded_start + counts)[:, None] + j[None, :]
        tl.store(
            sorted_ptr + slot,
            tl.full((E_PAD, BM_PAD), 0, tl.int32) + numel,
            mask=(slot < padded_end[:, None]) & (experts < E)[:, None],
        )
        for t0 in range(total, max_padded, FILL):
            t = t0 + tl.arange(0, FILL)
            tl.store(sorted_ptr + t, tl.full((FILL,), 0, tl.int32) + numel, mask=(t >= total) & (t < max_padded))
        # expert of each block: expert e owns blocks padded_start[e] / BLOCK_M .. padded_end[e] / BLOCK_M - 1
        # (one masked store per expert and block, JB blocks at a time); the blocks past the last
        # expert's repeat expert E - 1
        first = padded_start // BLOCK_M
        nb = tl.where(experts < E, padded // BLOCK_M, 0)
        for j0 in range(0, tl.max(nb, 0), JB):
            jb = j0 + tl.arange(0, JB)
            tl.store(
                expert_ids_ptr + first[:, None] + jb[None, :],
                experts[:, None] + 0 * jb[None, :],
                mask=jb[None, :] < nb[:, None],
            )
        for b0 in range(total // BLOCK_M, num_blocks, FILL):
            b = b0 + tl.arange(0, FILL)
            tl.store(expert_ids_ptr + b, tl.full((FILL,), E - 1, tl.int32), mask=b < num_blocks)


def moe_align_block_size_triton(topk_ids: torch.Tensor, block_m: int, num_experts: int):
    """Triton twin of ``moe_align_block_size`` (same arguments, same outputs).

    Args:
        topk_ids: ``[M, k]`` integer expert ids in ``[0, num_experts)`` (int32 or int64).
        block_m: rows per GEMM block.
        num_experts: ``E``.

    Returns:
        ``(sorted_token_ids int32 [max_padded], expert_ids int32 [max_padded // block_m],
        num_tokens_post_padded int32 [1])`` with ``max_padded`` = ``M*k + E*(block_m-1)``
        rounded up to a multiple of ``block_m``. Two launches at most, no host synchronization.

    Raises:
        ValueError: ``topk_ids`` not 2D, or ``block_m`` < 1.
    """
    if topk_ids.ndim != 2:
        raise ValueError(f"topk_ids: expected [M, k], got shape {list(topk_ids.shape)}")
    if block_m < 1:
        raise ValueError(f"block_m: expected >= 1, got {block_m}")
    device = topk_ids.device
    flat = topk_ids.reshape(-1)
    if flat.dtype not in (torch.int32, torch.int64):
        flat = flat.to(torch.int32)
    numel = flat.numel()
    max_padded = numel + num_experts * (block_m - 1)
    max_padded = -(-max_padded // block_m) * block_m
    num_blocks = max_padded // block_m
    chunk = max(16, min(_MAX_CHUNK, triton.next_power_of_2(max(numel, 1))))
    nchunks = triton.cdiv(max(numel, 1), chunk)
    e_pad = triton.next_power_of_2(num_experts + 1)
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=device)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=device)
    num_post = torch.empty(1, dtype=torch.int32, device=device)
    base = torch.empty(nchunks, e_pad, dtype=torch.int32, device=device)
    hist = base
    single = nchunks == 1
    if not single:
        hist = torch.empty(nchunks, e_pad, dtype=torch.int32, device=device)
        _chunk_hist_kernel[(nchunks,)](flat, hist, numel, E=num_experts, E_PAD=e_pad, CHUNK=chunk)
    _align_scatter_kernel[(nchunks,)](
        flat,
        hist,
        base,
        sorted_ids,
        expert_ids,
        num_post,
        numel,
        max_padded,
        num_blocks,
        E=num_experts,
        E_PAD=e_pad,
        CHUNK=chunk,
        LOG_CHUNK=chunk.bit_length() - 1,
        NCHUNK_PAD=triton.next_power_of_2(nchunks),
        SINGLE=single,
        BLOCK_M=block_m,
        BM_PAD=triton.next_power_of_2(block_m),
        FILL=1024,
        JB=16,
        num_warps=8,
    )
    return sorted_ids, expert_ids, num_post


def naive_block_assignment(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """vLLM's rule for skipping the alignment: each pair its own block when ``M * k * 4 <= E``
    (never for an empty batch: the aligned path's padded grid handles it)."""
    return 0 < num_tokens * top_k and num_tokens * top_k * 4 <= num_experts


def align_blocks(topk_ids: torch.Tensor, block_m: int, num_experts: int):
    """``moe_align_block_size``'s outputs: the Triton version on CUDA, the PyTorch one elsewhere
    (the same values)."""
    if topk_ids.device.type == "cuda":
        return moe_align_block_size_triton(topk_ids, block_m, num_experts)
    return moe_align_block_size(topk_ids, block_m, num_experts)


@dataclass(frozen=True)
class RoutingPlan:
    """Where one forward's (token, k) pairs sit in the grouped GEMMs' row blocks (``plan_routing``).

    ``naive``: each pair its own block (vLLM's tiny-batch rule, ``naive_block_assignment``): block
    ``b`` is pair ``b`` (its row 0; the other rows masked) and ``expert_ids`` is the flat
    ``topk_ids [M * k]``; there are no sorted ids, and the kernels' ``NAIVE`` mode runs with any
    ``block_m``. Otherwise ``aligned[block_m]`` holds ``moe_align_block_size``'s outputs
    ``(sorted_token_ids, expert_ids, num_tokens_post_padded)`` for each ``block_m`` planned.
    """

    num_experts: int
    naive: bool
    expert_ids: torch.Tensor | None = None  # naive: the flat topk_ids
    aligned: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def blocks(self, block_m: int) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """``(sorted_token_ids, expert_ids, num_tokens_post_padded)`` for GEMM row blocks of
        ``block_m`` pairs (naive: ``(None, flat topk_ids, None)`` for any ``block_m``).

        Raises:
            ValueError: ``block_m`` was not planned (the plan names the ones it holds).
        """
        if self.naive:
            return None, self.expert_ids, None
        if block_m not in self.aligned:
            raise ValueError(f"block_m: the routing plan is aligned for block_m {sorted(self.aligned)}, got {block_m}")
        return self.aligned[block_m]


def plan_routing(
    topk_ids: torch.Tensor, num_experts: int, block_ms: Iterable[int], naive_ok: bool = True
) -> RoutingPlan:
    """The routing plan of one forward: the one place where the alignment is decided.

    Args:
        topk_ids: ``[M, k]`` integer expert ids in ``[0, num_experts)``.
        num_experts: ``E``.
        block_ms: the ``block_m`` of each GEMM that will run (a repeated value is aligned once).
        naive_ok: the GEMM kernels have a ``NAIVE`` mode (the bf16 and FP4 kernels; the dequantize-
            GEMM kernel has none): then tiny batches (``naive_block_assignment``) skip the alignment.

    Returns:
        A ``RoutingPlan``: naive, or aligned (``align_blocks``: Triton on CUDA, PyTorch elsewhere)
        for every ``block_m`` in ``block_ms``. No host synchronization (capturable in a CUDA graph).

    Raises:
        ValueError: ``topk_ids`` not 2D.
    """
    if topk_ids.ndim != 2:
        raise ValueError(f"topk_ids: expected [M, k], got shape {list(topk_ids.shape)}")
    m, k = topk_ids.shape
    if naive_ok and naive_block_assignment(m, k, num_experts):
        return RoutingPlan(num_experts, True, expert_ids=topk_ids.reshape(-1))
    return RoutingPlan(
        num_experts, False, aligned={bm: align_blocks(topk_ids, bm, num_experts) for bm in dict.fromkeys(block_ms)}
    )
