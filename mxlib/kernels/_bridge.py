"""The one bridge from ``mxlib.formats`` objects to Triton launch arguments.

Every kernel launch in ``mxlib.kernels`` takes its format constexprs from here, by keyword:

* ``kernel_format_args(fmt, prefix=..., block_size=..., scale_mode=...)``: an element format
  gives ``EBITS, MBITS, EMAX, MAX, SPECIALS``; a block scheme adds ``BS`` (its block size unless
  one is given) and ``NVFP4`` (two-level scaling: e4m3 block scales times a global scale); a scale
  rule adds ``SCALE_MODE``. The integers are the format table's own (``ElementFormat.specials_id``,
  ``formats.scale_mode_id``), the ones ``_numerics`` decodes.
* ``select(kernel, args)``: the subset of ``args`` that ``kernel`` declares, so one dict serves
  kernels that need different parts of a format.
* ``tiles(rows, k, block_size)``: the elementwise kernels' tile, never narrower than one block.
* ``interpreting()``: whether Triton's interpreter runs the kernels (``INTERPRET``, the
  process's choice, made once when ``mxlib.kernels`` is first imported; see its docstring).
"""

from __future__ import annotations

import torch

from ..formats import BlockScheme, ElementFormat, PerTensorScheme, scale_mode_id
from ._triton import tl, triton

__all__ = ["TL_DTYPE", "INTERPRET", "interpreting", "kernel_format_args", "select", "tiles", "launch_opts"]

TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

# Tile size (elements per program) and warps of the elementwise kernels; measured on the
# H200 by ``python -m mxlib.bench quant --sweep`` (README lists the result).
TILE_ELEMENTS = 4096
NUM_WARPS = 4
MAX_BLOCK_K = 1024


# Interpreted or compiled, for the whole process (see mxlib.kernels): mxlib.kernels settles
# TRITON_INTERPRET before triton is first imported; read here once, with Triton's own parsing.
INTERPRET: bool = bool(triton.knobs.runtime.interpret)


def interpreting() -> bool:
    """Whether mxlib's kernels run in Triton's interpreter (``INTERPRET``, fixed per process)."""
    return INTERPRET


def kernel_format_args(
    fmt: ElementFormat | BlockScheme | PerTensorScheme,
    prefix: str = "",
    block_size: int | None = None,
    scale_mode: str | None = None,
) -> dict:
    """Named constexprs of a format, each key prefixed with ``prefix`` (``W_``, ``A2_``).

    ``ElementFormat`` / ``PerTensorScheme``: ``EBITS, MBITS, EMAX, MAX, SPECIALS`` of the element;
    ``BlockScheme``: those plus ``BS`` (``block_size`` or the scheme's) and ``NVFP4`` (whether the
    block scales are e4m3 times a global scale); ``scale_mode`` adds ``SCALE_MODE``.
    """
    el = fmt if isinstance(fmt, ElementFormat) else fmt.element
    args = dict(EBITS=el.ebits, MBITS=el.mbits, EMAX=el.emax, MAX=el.max, SPECIALS=el.specials_id)
    if isinstance(fmt, BlockScheme):
        args.update(BS=fmt.block_size if block_size is None else block_size, NVFP4=fmt.has_global_scale)
    elif block_size is not None:
        args.update(BS=block_size)
    if scale_mode is not None:
        args.update(SCALE_MODE=scale_mode_id(scale_mode))
    return {prefix + k: v for k, v in args.items()}


def select(kernel, args: dict) -> dict:
    """The entries of ``args`` that are parameters of ``kernel`` (a ``triton.jit`` function)."""
    names = set(kernel.arg_names)
    return {k: v for k, v in args.items() if k in names}


def tiles(rows: int, k: int, block_size: int = 1) -> tuple[int, int]:
    """``(BLOCK_R, BLOCK_K)`` of the elementwise kernels: about ``TILE_ELEMENTS`` per program,
    ``BLOCK_K`` a power of two of at least one scale block."""
    block_k = max(min(MAX_BLOCK_K, triton.next_power_of_2(k)), block_size)
    block_r = max(1, min(triton.next_power_of_2(rows), TILE_ELEMENTS // block_k))
    return block_r, block_k


def launch_opts() -> dict:
    # fp fusion off: no mul+add contraction into FMA, so every rounding is the reference's.
    return dict(num_warps=NUM_WARPS, enable_fp_fusion=False)
