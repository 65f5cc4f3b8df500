"""Argument checks shared by the reference functions and their Triton twins.

Both raise the same errors with the same messages: the argument's name, what
was expected and what was found.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .formats import get_element_format

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


def mx_dequant_args(packed, scale, element, block_size, dtype):
    """Checks shared by ``dequantize_mx`` and its Triton twin: ``(fmt, packed u8, scale u8, k)``."""
    fmt = get_element_format(element)
    check_out_dtype(dtype)
    allowed = (torch.float4_e2m1fn_x2,) if hasattr(torch, "float4_e2m1fn_x2") and fmt.nbits == 4 else ()
    packed = as_uint8(packed, "packed", allowed)
    e8 = (torch.float8_e8m0fnu,) if hasattr(torch, "float8_e8m0fnu") else ()
    scale = as_uint8(scale, "scale", e8)
    pk = packed.shape[-1]
    if fmt.nbits == 6 and pk % 3:
        raise ValueError(f"packed: {fmt.name} data must have a last dimension divisible by 3, got {pk}")
    k = pk * 8 // fmt.nbits
    check_block(k, block_size, "packed (unpacked)")
    expected = (*packed.shape[:-1], k // block_size)
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"scale: expected shape {list(expected)} for packed {list(packed.shape)} "
            f"({fmt.name}, k={k}, block_size={block_size}), got {list(scale.shape)}"
        )
    return fmt, packed, scale, k


def global_scale_view(global_scale: torch.Tensor | float, x: torch.Tensor, name: str) -> torch.Tensor:
    """fp32 global scale shaped to broadcast against ``x`` reshaped to ``[..., k/bs, bs]``."""
    if not isinstance(global_scale, torch.Tensor):
        global_scale = torch.tensor(float(global_scale), dtype=torch.float32, device=x.device)
    if global_scale.dtype != torch.float32:
        raise TypeError(f"{name}: expected a float32 tensor, got {global_scale.dtype}")
    if global_scale.numel() == 1:
        return global_scale.reshape([1] * (x.ndim + 1))
    lead = tuple(x.shape[:-1])
    gs_shape = tuple(global_scale.shape)
    if gs_shape != lead[: len(gs_shape)]:
        raise ValueError(
            f"{name}: expected one element or a shape that is a prefix of x's leading dims "
            f"{list(lead)} (e.g. [E] for [E, m, k]), got {list(gs_shape)}"
        )
    return global_scale.reshape(*gs_shape, *([1] * (x.ndim + 1 - len(gs_shape))))


def nvfp4_weight_args(x, weight_scale_2, block_size, zero_block_scale):
    """Checks shared by ``quantize_nvfp4`` and its Triton twin: ``(x as [E, n, k], weight_scale_2 [E] or None)``."""
    check_float(x, "x")
    if x.ndim not in (2, 3):
        raise ValueError(f"x: expected a 2D [n, k] or 3D [E, n, k] tensor, got shape {list(x.shape)}")
    check_block(x.shape[-1], block_size, "x")
    if zero_block_scale not in ("one", "zero"):
        raise ValueError(f"zero_block_scale: expected 'one' (ModelOpt) or 'zero', got {zero_block_scale!r}")
    if not torch.isfinite(x).all():
        raise ValueError("x: NVFP4 weight quantization needs finite values; found NaN or Inf")
    x3 = x if x.ndim == 3 else x.unsqueeze(0)
    num = x3.shape[0]
    if weight_scale_2 is None:
        return x3, None
    else:
        if not isinstance(weight_scale_2, torch.Tensor) or weight_scale_2.dtype != torch.float32:
            raise TypeError("weight_scale_2: expected a float32 tensor")
        if weight_scale_2.numel() not in (1, num):
            raise ValueError(f"weight_scale_2: expected 1 or {num} elements, got {weight_scale_2.numel()}")
        ws2 = weight_scale_2.reshape(-1).expand(num).to(x.device)
    return x3, ws2.contiguous()


def nvfp4_dequant_args(tensor_fp4, tensor_sf, global_scale, dtype, block_size, swizzle, unswizzle):
    """Checks shared by ``dequantize_to_dtype`` and its Triton twin.

    ``unswizzle(sf, m, k, block_size)`` turns swizzled scales linear (``reference.nvfp4_unswizzle_scales``).
    Returns ``(fp4 u8, scales u8 (linear layout), global scale fp32 [E or 1], k)``.
    """
    check_out_dtype(dtype)
    allowed = (torch.float4_e2m1fn_x2,) if hasattr(torch, "float4_e2m1fn_x2") else ()
    fp4 = as_uint8(tensor_fp4, "tensor_fp4", allowed)
    if fp4.ndim not in (2, 3):
        raise ValueError(f"tensor_fp4: expected [m, k/2] or [E, m, k/2], got shape {list(fp4.shape)}")
    sf = as_uint8(tensor_sf, "tensor_sf", (torch.float8_e4m3fn,))
    k = fp4.shape[-1] * 2
    check_block(k, block_size, "tensor_fp4 (unpacked)")
    if swizzle:
        if fp4.ndim != 2:
            raise ValueError("swizzle=True supports 2D tensors only; MoE weights use the linear layout")
        sf = unswizzle(sf, fp4.shape[0], k, block_size)
    expected = (*fp4.shape[:-1], k // block_size)
    if tuple(sf.shape) != expected:
        raise ValueError(f"tensor_sf: expected shape {list(expected)}, got {list(sf.shape)}")
    if not isinstance(global_scale, torch.Tensor):
        global_scale = torch.tensor(float(global_scale), dtype=torch.float32, device=fp4.device)
    if global_scale.dtype != torch.float32:
        raise TypeError(f"global_scale: expected float32, got {global_scale.dtype}")
    num = fp4.shape[0] if fp4.ndim == 3 else 1
    if global_scale.numel() not in (1, num):
        raise ValueError(
            f"global_scale: expected one element or [E]=[{num}] for tensor_fp4 {list(fp4.shape)}, "
            f"got shape {list(global_scale.shape)}"
        )
    return fp4, sf, global_scale.reshape(-1).expand(num).to(fp4.device), k


def fp8_args(x, scale, dtype, check_scale):
    """Checks shared by ``quant_dequant_fp8_per_tensor`` and its twin: ``(scale fp32 [], dtype)``."""
    check_float(x, "x")
    dtype = x.dtype if dtype is None else dtype
    check_out_dtype(dtype)
    if not isinstance(scale, torch.Tensor):
        scale = torch.tensor(float(scale), dtype=torch.float32, device=x.device)
    if scale.numel() != 1:
        raise ValueError(f"scale: expected a single per-tensor value, got shape {list(scale.shape)}")
    scale = scale.float().reshape(()).to(x.device)
    if check_scale and not (torch.isfinite(scale) and scale > 0):
        raise ValueError(f"scale: expected a positive finite input_scale, got {scale.item()}")
    return scale, dtype
