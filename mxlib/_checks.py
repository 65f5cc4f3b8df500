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

from collections.abc import Sequence

import torch

from .formats import get_element_format

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_float(x: torch.Tensor, name: str) -> None:
    """``x`` must be a float32 / bfloat16 / float16 tensor with at least one dimension."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: expected a floating tensor of dtype float32, bfloat16 or float16, got {x.dtype}")
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


# torch's E8M0 scale dtype (one byte, ``2**(b - 127)``, 0xFF NaN), where this torch has it
E8M0_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e8m0fnu,) if hasattr(torch, "float8_e8m0fnu") else ()
_FP4X2 = (torch.float4_e2m1fn_x2,) if hasattr(torch, "float4_e2m1fn_x2") else ()
_FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def packed_dtypes(fmt) -> tuple[torch.dtype, ...]:
    """torch dtypes besides uint8 that hold an element format's packed bytes: ``float4_e2m1fn_x2``
    for e2m1 (where torch has it), ``float8_e4m3fn`` / ``float8_e5m2`` for the FP8 elements (one
    code a byte, as torchao's ``to_mx`` returns them), none for FP6."""
    if fmt.nbits == 4:
        return _FP4X2
    return (_FP8_DTYPES[fmt.name],) if fmt.name in _FP8_DTYPES else ()


def check_storage_dtype(dtype: torch.dtype, allowed: Sequence[torch.dtype], name: str) -> None:
    """``dtype`` must be ``torch.uint8`` or one of ``allowed``.

    Raises:
        TypeError: naming ``name``, the allowed dtypes and the one given.
    """
    if dtype != torch.uint8 and dtype not in allowed:
        raise TypeError(f"{name}: expected torch.uint8 or one of {list(allowed)}, got {dtype}")


def as_storage_dtype(t: torch.Tensor, dtype: torch.dtype, allowed: Sequence[torch.dtype], name: str) -> torch.Tensor:
    """uint8 bytes ``t`` viewed as ``dtype`` (uint8 itself or one of ``allowed``), no copy."""
    check_storage_dtype(dtype, allowed, name)
    return t if dtype == torch.uint8 else t.view(dtype)


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
    """Whether value checks are skipped: the current CUDA stream is capturing a graph (reading a
    device tensor's values would synchronize with the host, which capture forbids), or
    ``torch.compile`` is tracing (a data-dependent branch would break the graph). Shape and dtype
    checks always run; a captured or compiled forward must be given valid scales and ids, which
    the same call in eager mode checks."""
    if torch.compiler.is_compiling():
        return True
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


def mx_dequant_args(packed, scale, element, block_size, dtype):
    """Checks shared by ``dequantize_mx`` and its Triton twin: ``(fmt, packed u8, scale u8, k)``."""
    fmt = get_element_format(element)
    check_out_dtype(dtype)
    packed = as_uint8(packed, "packed", packed_dtypes(fmt))
    scale = as_uint8(scale, "scale", E8M0_DTYPES)
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


def global_scale_view(
    global_scale: torch.Tensor | float, x: torch.Tensor, name: str, check_scale: bool = True
) -> torch.Tensor:
    """fp32 global scale shaped to broadcast against ``x`` reshaped to ``[..., k/bs, bs]``.

    Its values must lie in ``[2**-126, 2**126]`` (``check_global_scale``) unless
    ``check_scale`` is false.
    """
    if not isinstance(global_scale, torch.Tensor):
        global_scale = torch.tensor(float(global_scale), dtype=torch.float32, device=x.device)
    if global_scale.dtype != torch.float32:
        raise TypeError(f"{name}: expected a float32 tensor, got {global_scale.dtype}")
    if global_scale.numel() == 1:
        if check_scale:
            check_global_scale(global_scale, name)
        return global_scale.reshape([1] * (x.ndim + 1))
    lead = tuple(x.shape[:-1])
    gs_shape = tuple(global_scale.shape)
    if gs_shape != lead[: len(gs_shape)]:
        raise ValueError(
            f"{name}: expected one element or a shape that is a prefix of x's leading dims "
            f"{list(lead)} (e.g. [E] for [E, m, k]), got {list(gs_shape)}"
        )
    if check_scale:
        check_global_scale(global_scale, name)
    return global_scale.reshape(*gs_shape, *([1] * (x.ndim + 1 - len(gs_shape))))


def all_finite(x: torch.Tensor) -> bool:
    """Whether every value of ``x`` is finite (True for an empty tensor). One reduction with no tensor-sized
    temporary: the smallest and largest value are finite exactly when every value is (both propagate NaN),
    where ``torch.isfinite(x).all()`` writes a bool per element first."""
    if x.numel() == 0:
        return True
    low, high = torch.aminmax(x)
    return bool(torch.isfinite(low) & torch.isfinite(high))


def nvfp4_weight_args(x, weight_scale_2, block_size, zero_block_scale):
    """Checks shared by ``quantize_nvfp4`` and its Triton twin: ``(x as [E, n, k], weight_scale_2 [E] or None)``."""
    check_float(x, "x")
    if x.ndim not in (2, 3):
        raise ValueError(f"x: expected a 2D [n, k] or 3D [E, n, k] tensor, got shape {list(x.shape)}")
    check_block(x.shape[-1], block_size, "x")
    if zero_block_scale not in ("one", "zero"):
        raise ValueError(f"zero_block_scale: expected 'one' (ModelOpt) or 'zero', got {zero_block_scale!r}")
    if not all_finite(x):
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
        check_global_scale(weight_scale_2, "weight_scale_2")
        ws2 = weight_scale_2.reshape(-1).expand(num).to(x.device)
    return x3, ws2.contiguous()


def nvfp4_dequant_args(tensor_fp4, tensor_sf, global_scale, dtype, block_size, swizzle, unswizzle, check_scale=True):
    """Checks shared by ``dequantize_to_dtype`` and its Triton twin.

    ``unswizzle(sf, m, k, block_size)`` turns swizzled scales linear (``reference.nvfp4_unswizzle_scales``).
    Returns ``(fp4 u8, scales u8 (linear layout), global scale fp32 [E or 1], k)``.
    """
    check_out_dtype(dtype)
    fp4 = as_uint8(tensor_fp4, "tensor_fp4", _FP4X2)
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
    if check_scale:
        check_global_scale(global_scale, "global_scale")
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
    if check_scale:
        check_global_scale(scale, "scale", what="input_scale")
    return scale, dtype


def bad_block_scale_mask(scale_bytes: torch.Tensor, e4m3: bool) -> torch.Tensor:
    """Where stored block scales (as uint8 bytes) are invalid.

    E8M0 (OCP MX): byte 0xFF is NaN. e4m3 used as NVFP4's unsigned "ue4m3": bytes 0x7F and
    0xFF are NaN, and a set sign bit (a negative scale, other than -0 = 0x80) would flip the
    block's signs.
    """
    u = scale_bytes.view(torch.uint8)
    if e4m3:
        return ((u & 0x7F) == 0x7F) | ((u > 0x80) & (u < 0xFF))
    return u == 0xFF


def check_block_scales(scale: torch.Tensor, name: str, e4m3: bool) -> None:
    """Every stored block scale must be a valid, finite, non-negative scale
    (``bad_block_scale_mask``). Skipped while a CUDA graph is being captured.

    Raises:
        ValueError: naming ``name``, the first bad byte, its index and how many are bad.
    """
    if capturing() or scale.numel() == 0:
        return
    bad = bad_block_scale_mask(scale, e4m3)
    if not bool(bad.any()):
        return
    where = bad.nonzero()[0].tolist()
    byte = int(scale.view(torch.uint8)[tuple(where)])
    kind = (
        "e4m3 (ue4m3) block scale: 0x7F/0xFF are NaN, the sign bit must be clear"
        if e4m3
        else "E8M0 block scale: 0xFF is NaN"
    )
    raise ValueError(
        f"{name}: invalid {kind}; got byte 0x{byte:02X} at index {where} "
        f"({int(bad.sum())} of {scale.numel()} scales invalid)"
    )


def check_device(device, name: str = "device") -> torch.device:
    """``device`` (a ``torch.device``, a name such as ``"cpu"``, ``"cuda"``, ``"cuda:1"``, or a CUDA index) as a
    ``torch.device`` that this torch build can use.

    Raises:
        ValueError: naming ``name``: a device torch cannot parse; ``cuda`` on a torch build without CUDA or on a
            machine without a CUDA device (torch's own error there is a bare ``AssertionError`` at the first
            allocation), or a CUDA index beyond the devices present.
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"{name}: expected a torch.device, 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "is a CPU-only build" if torch.version.cuda is None else "sees no CUDA device"
            raise ValueError(
                f"{name}: {device!r} asked for, but this torch {torch.__version__} {why}; use 'cpu' (the 'torch' "
                f"backend runs everything there) or install a CUDA build of torch"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"{name}: {device!r} asked for, but torch sees {torch.cuda.device_count()} CUDA device(s)")
    return dev
