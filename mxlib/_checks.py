"""Argument checks shared by the reference functions and their Triton twins.

Both raise the same errors with the same messages: the argument's name, what
was expected and what was found.
"""

from __future__ import annotations

from typing import Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_float(x: torch.Tensor, name: str) -> None:
    """``x`` must be a float32 / bfloat16 / float16 tensor with at least one dimension."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name}: expected a floating tensor of dtype float32, bfloat16 or float16, got {x.dtype}"
        )
    if x.ndim < 1:
        raise ValueError(f"{name}: expected at least 1 dimension, got a scalar")


def check_block(k: int, block_size: int, name: str) -> None:
    """The reduction length ``k`` must be a whole number of blocks."""
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if k % block_size != 0:
        raise ValueError(f"{name}: K={k} is not a multiple of block_size={block_size}")


def check_out_dtype(dtype: torch.dtype) -> None:
    """Output dtypes are float32, bfloat16 or float16."""
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype: expected float32, bfloat16 or float16, got {dtype}")


def as_uint8(t: torch.Tensor, name: str, allowed: Sequence[torch.dtype]) -> torch.Tensor:
    """View ``t`` as uint8 bytes if it is uint8 or one of ``allowed`` (same-size) dtypes."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype == torch.uint8:
        return t
    if t.dtype in allowed:
        return t.view(torch.uint8)
    raise TypeError(f"{name}: expected dtype uint8 or one of {list(allowed)}, got {t.dtype}")
