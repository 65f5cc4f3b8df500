"""Scalar scales as producers store them: any float dtype that widens to fp32 exactly.

Quark's ``_a_fp8`` exports store each expert's static ``input_scale`` as a bf16 scalar
(``amax / 448`` rounded to bf16); ModelOpt and compressed-tensors store fp32. bf16, fp16 and
fp32 widen to fp32 exactly and are accepted; fp64 only when every value round-trips through
fp32; integer and other dtypes are refused, naming the tensor.
"""

from __future__ import annotations

import torch

from .layout import PROJS, CheckpointError, global_scale_check

__all__ = ["WIDENABLE_DTYPES", "widen_scale", "read_scalar_scales", "read_static_input_scales"]

# float dtypes every value of which is an fp32 value
WIDENABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def widen_scale(t: torch.Tensor, name: str) -> torch.Tensor:
    """``t`` as fp32, exactly.

    Raises:
        CheckpointError: a dtype that does not widen to fp32 exactly (integers, fp8, or fp64
            values that change in fp32), naming ``name``, the dtype and the accepted ones.
    """
    if t.dtype in WIDENABLE_DTYPES:
        return t.to(torch.float32)
    if t.dtype == torch.float64:
        w = t.to(torch.float32)
        same = (w.double() == t) | (torch.isnan(w) & torch.isnan(t))
        if bool(same.all()):
            return w
        bad = t[~same].reshape(-1)[0].item()
        raise CheckpointError(
            f"tensor {name!r}: float64 scale {bad!r} is not an fp32 value (it would be rounded); "
            f"scales must be fp32, bf16 or fp16 (or float64 holding fp32 values)"
        )
    raise CheckpointError(
        f"tensor {name!r}: expected a float scale of dtype float32, bfloat16 or float16 (widened "
        f"to fp32 exactly), found {t.dtype}"
    )


def read_scalar_scales(tensors, names: list[str], shape=(), check=None) -> torch.Tensor:
    """The named scale tensors (each of ``shape``), widened to fp32 and stacked: ``[len(names), *shape]``.

    ``check(tensor) -> (ok, what)`` (``layout.global_scale_check``) validates the widened values
    as stored: a false ``ok`` raises ``CheckpointError`` naming the tensor, its file and ``what``.
    """
    out = []
    for n in names:
        t = widen_scale(tensors.get(n, shape, None), n)
        if check is not None and not t.is_meta:  # a meta tensor (the inspector) has no values
            ok, what = check(t)
            if not ok:
                where = getattr(tensors, "weight_map", {}).get(n, "?")
                raise CheckpointError(f"tensor {n!r}: {what} (in {where})")
        out.append(t)
    return torch.stack(out)


def read_static_input_scales(tensors, prefix: str, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each of ``e`` experts' static ``input_scale`` of ``gate_proj``, ``up_proj`` and ``down_proj``
    (``{prefix}.{x}.{proj}.input_scale``: a decode scale stored as a scalar ``()``, widened to fp32 exactly;
    positive and finite, or 0 for an uncalibrated expert): ``(w13 fp32 [E], w2 fp32 [E])``, ``w13`` the larger
    of gate's and up's (both see the same input: the larger decode scale covers both).

    Raises:
        CheckpointError: naming the tensor: a missing one, a shape other than ``()``, a dtype that does not
        widen exactly (``widen_scale``), a value outside ``[2**-126, 2**126]`` other than 0.
    """
    check = global_scale_check(True, "input_scale")
    ins = {
        p: read_scalar_scales(tensors, [f"{prefix}.{x}.{p}.input_scale" for x in range(e)], (), check) for p in PROJS
    }
    return torch.maximum(ins["gate_proj"], ins["up_proj"]), ins["down_proj"]
