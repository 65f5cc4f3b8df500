"""Argument checks shared by the reference functions and their Triton twins.

Both raise the same errors with the same messages: the argument's name, what
was expected and what was found.

Checks that read a tensor's values (``check_global_scale``) need a host
synchronization for a device tensor, which CUDA-graph capture forbids: they are
skipped while the current CUDA stream is capturing (``capturing()``), so a
captured forward must be given scales that were checked before capture (the
NVFP4 experts check theirs in the constructor). Shape and dtype checks always run.
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


# Valid block sizes: powers of two from 2 to 1024. OCP MX fixes 32 and NVFP4 uses 16; the
# others are for emulation studies. The Triton twins tile a row in power-of-two widths (a
# block must divide the tile), FP4 packs element pairs, and 1024 is the widest row tile.
BLOCK_SIZE_MIN = 2
BLOCK_SIZE_MAX = 1024


def check_block_size(block_size: int) -> None:
    """``block_size`` must be a power of two from 2 to 1024 (OCP MX: 32, NVFP4: 16)."""
    ok = isinstance(block_size, int) and not isinstance(block_size, bool)
    if not (ok and BLOCK_SIZE_MIN <= block_size <= BLOCK_SIZE_MAX and block_size & (block_size - 1) == 0):
        raise ValueError(
            f"block_size: expected a power of two from {BLOCK_SIZE_MIN} to {BLOCK_SIZE_MAX} "
            f"(OCP MX uses 32, NVFP4 16), got {block_size!r}"
        )


def check_block(k: int, block_size: int, name: str) -> None:
    """``block_size`` must be valid (``check_block_size``) and ``k`` a whole number of blocks."""
    check_block_size(block_size)
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


# A global scale ``g`` is valid when it is finite, positive, and both ``g`` and ``1/g`` are
# normal fp32 numbers: 2**-126 <= g <= 2**126. The NVFP4 arithmetic uses ``g`` and its
# reciprocal (``recip(gs)``, ``s / gs``, ``6 * 448 / gs``): a subnormal or zero ``g`` makes the
# reciprocal overflow to Inf (NaN or zeros downstream), a negative one flips signs silently.
GLOBAL_SCALE_MIN = 2.0**-126
GLOBAL_SCALE_MAX = 2.0**126


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (value checks are skipped then)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def check_global_scale(scale, name: str, allow_zero: bool = False, what: str = "scale") -> None:
    """Every value of ``scale`` (a number or a tensor, checked elementwise in fp32) must lie
    in ``[2**-126, 2**126]``: finite, positive, with a finite, normal reciprocal.

    ``allow_zero`` also accepts 0 (an NVFP4 ``input_scale`` of 0 marks an expert that was
    never calibrated); ``what`` names the kind of scale in the message. Skipped while a CUDA
    graph is being captured (module docstring).

    Raises:
        ValueError: naming ``name``, the first bad value, its index and how many are bad.
    """
    if capturing():
        return
    if isinstance(scale, torch.Tensor):
        s = scale.detach().to(torch.float32)
    else:
        s = torch.tensor(float(scale), dtype=torch.float32)
    ok = (s >= GLOBAL_SCALE_MIN) & (s <= GLOBAL_SCALE_MAX)
    if allow_zero:
        ok |= s == 0
    if bool(ok.all()):
        return
    bad = (~ok).nonzero()
    first = bad[0].tolist()
    where = f" at index {first} ({bad.shape[0]} of {s.numel()} elements)" if s.ndim else ""
    zero = " or 0 (uncalibrated)" if allow_zero else ""
    raise ValueError(
        f"{name}: expected a positive finite {what}{zero}, got {s[tuple(first)].item()!r}{where}; valid "
        f"values lie in [2**-126, 2**126], so that the reciprocal is finite and normal too"
    )
