"""Independent oracles: numpy + ml_dtypes + Python floats, sharing no code with mxlib.

* ``mx_scale_exponent``: the three E8M0 rules from ``math.frexp`` on Python floats.
* ``mx_qdq``: OCP MX QDQ with ml_dtypes casts (saturation applied by clipping first,
  since ml_dtypes' fp8 casts overflow to NaN/Inf instead of saturating).
* ``vllm_nvfp4_qdq``: a line-by-line transcription of vLLM's ``ref_nvfp4_quant``,
  ``cast_to_fp4`` and ``ref_nvfp4_quant_dequant`` (torch ops, torch's own fp8 cast and
  the threshold ladder for FP4).
* ``vllm_dequantize_to_dtype``: vLLM's ``break_fp4_bytes`` lookup and scale product.
* ``moe_fp64``: the MoE function in float64 (the GEMM oracle of every MoE test).
* ``modelopt_nvfp4_quantize``: ModelOpt's ``NVFP4QTensor`` arithmetic with its
  ``searchsorted`` FP4 cast.
"""

import math

import ml_dtypes
import numpy as np
import torch

FORMATS = {  # name: (ml_dtypes type, max, emax, mbits)
    "e2m1": (ml_dtypes.float4_e2m1fn, 6.0, 2, 1),
    "e2m3": (ml_dtypes.float6_e2m3fn, 7.5, 2, 3),
    "e3m2": (ml_dtypes.float6_e3m2fn, 28.0, 4, 2),
    "e4m3": (ml_dtypes.float8_e4m3fn, 448.0, 8, 3),
    "e5m2": (ml_dtypes.float8_e5m2, 57344.0, 15, 2),
}


def round_elements(x: np.ndarray, element: str) -> np.ndarray:
    """RNE, saturating: clip to +-max, then ml_dtypes' cast."""
    mld, mx, _, _ = FORMATS[element]
    return np.clip(x.astype(np.float32), -mx, mx).astype(mld).astype(np.float32)


def mx_scale_exponent(amax: float, element: str, scale_mode: str) -> int | None:
    """Unbiased E8M0 exponent in [-127, 127], or None for NaN (byte 0xFF)."""
    _, mx, emax, mbits = FORMATS[element]
    if not math.isfinite(amax):
        return None
    if amax == 0.0:
        return -127
    m, ex = math.frexp(amax)  # amax = m * 2**ex, m in [0.5, 1)
    floor_log2 = ex - 1
    if scale_mode == "floor":
        e = floor_log2 - emax
    elif scale_mode == "even":
        significand = 2 * m  # [1, 2)
        # "add half an ulp at mbits, then drop the mantissa": round half up to mbits bits
        units = math.floor(significand * 2**mbits + 0.5)
        e = floor_log2 + (1 if units >= 2 ** (mbits + 1) else 0) - emax
    elif scale_mode == "rceil":
        q = float(np.float32(amax) / np.float32(mx))  # fp32 quotient, correctly rounded
        if q == 0.0:
            e = -127
        else:
            mq, eq = math.frexp(q)
            e = eq - 1 if mq == 0.5 else eq
    else:
        raise ValueError(scale_mode)
    return max(-127, min(127, e))


def mx_qdq(x: np.ndarray, element: str, block_size: int, scale_mode: str) -> np.ndarray:
    """QDQ in fp32, blocks along the last axis."""
    x = np.asarray(x, dtype=np.float32)
    blocks = x.reshape(-1, block_size)
    out = np.empty_like(blocks)
    for i, b in enumerate(blocks):
        amax = float(np.max(np.abs(b))) if not np.isnan(b).any() else math.nan
        e = mx_scale_exponent(amax, element, scale_mode)
        if e is None:
            out[i] = np.nan
            continue
        scale = math.ldexp(1.0, e)
        scaled = (b.astype(np.float64) / scale).astype(np.float32)  # exact: power of two
        out[i] = (round_elements(scaled, element).astype(np.float64) * scale).astype(np.float32)
    return out.reshape(x.shape)


# ------------------------------------------------------------------ vLLM / ModelOpt transcriptions

_KE2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float32)


def _vllm_cast_to_fp4(x):
    sign = torch.sign(x)
    x = torch.abs(x)
    x[(x >= 0.0) & (x <= 0.25)] = 0.0
    x[(x > 0.25) & (x < 0.75)] = 0.5
    x[(x >= 0.75) & (x <= 1.25)] = 1.0
    x[(x > 1.25) & (x < 1.75)] = 1.5
    x[(x >= 1.75) & (x <= 2.5)] = 2.0
    x[(x > 2.5) & (x < 3.5)] = 3.0
    x[(x >= 3.5) & (x <= 5.0)] = 4.0
    x[x > 5.0] = 6.0
    return x * sign


def _vllm_get_reciprocal(x):
    return 1.0 / (x + (x == 0) * 1e8)


def vllm_nvfp4_qdq(x: torch.Tensor, global_scale: torch.Tensor, block_size: int = 16) -> torch.Tensor:
    """vLLM ``ref_nvfp4_quant_dequant`` on a 2D tensor with a one-element global scale."""
    m, n = x.shape
    output_dtype = x.dtype
    xb = torch.reshape(x, (m, n // block_size, block_size))
    vec_max = torch.max(torch.abs(xb), dim=-1, keepdim=True)[0].to(torch.float32)
    scale = global_scale * (vec_max * (1 / 6.0))
    scale = torch.clamp(scale, max=448, min=-448)
    scale = scale.to(torch.float8_e4m3fn).to(torch.float32)
    output_scale = _vllm_get_reciprocal(scale * _vllm_get_reciprocal(global_scale))
    scaled_x = xb.to(torch.float32) * output_scale
    clipped_x = torch.clamp(scaled_x, -6.0, 6.0).reshape(m, n)
    x_fp4 = _vllm_cast_to_fp4(clipped_x).reshape(m, n // block_size, block_size)
    x_blockscale = scale.squeeze(-1).unsqueeze(-1) / global_scale
    return (x_fp4 * x_blockscale).reshape(m, n).to(output_dtype)


def vllm_dequantize_to_dtype(tensor_fp4, tensor_sf, global_scale, dtype, block_size=16):
    """vLLM ``dequantize_to_dtype`` (linear scale layout), 2D or 3D."""
    is_3d = tensor_fp4.ndim == 3
    if is_3d:
        dim0, m, packed_k = tensor_fp4.shape
        tensor_fp4 = tensor_fp4.reshape(-1, packed_k)
        global_scale = global_scale[:, None, None]
    else:
        m, packed_k = tensor_fp4.shape
    k = packed_k * 2
    a_flat = tensor_fp4.flatten()
    combined = torch.stack(((a_flat & 0x0F), (a_flat & 0xF0) >> 4), dim=1).flatten()
    signs = (combined & 0x08).to(torch.bool)
    values = _KE2M1[(combined & 0x07).to(torch.long)] * torch.where(signs, -1.0, 1.0)
    tensor_f32 = values.reshape(-1, k // block_size, block_size)
    sf = tensor_sf.view(torch.float8_e4m3fn)
    if is_3d:
        sf = sf.reshape(dim0, m, k // block_size)
        tensor_f32 = tensor_f32.reshape(dim0, m, -1, block_size)
    sf_dtype = sf.to(torch.float32) * global_scale
    out = tensor_f32 * sf_dtype.unsqueeze(-1)
    return out.reshape(*out.shape[:-2], -1).to(dtype)


_E2M1_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5])


def _modelopt_cast_fp4(weight):
    sign_bit = (weight < 0).to(torch.uint8)
    weight_abs = weight.abs()
    ord_ = torch.searchsorted(_E2M1_BOUNDS, weight_abs, out_int32=True).to(torch.uint8)
    odd_bounds = _E2M1_BOUNDS[[1, 3, 5]]
    equals_odd = torch.any(weight_abs.unsqueeze(-1) == odd_bounds, dim=-1).to(torch.uint8)
    return (sign_bit << 3) + ord_ + equals_odd


def modelopt_nvfp4_quantize(weight: torch.Tensor, block_size: int = 16):
    """ModelOpt ``NVFP4QTensor.quantize`` of a 2D weight (CPU): packed, e4m3 scales, scale_2."""
    wsf2 = weight.abs().amax().float() / torch.tensor(6.0 * 448.0)
    per_block_amax = weight.reshape(*weight.shape[:-1], -1, block_size).abs().amax(dim=-1).float()
    per_block_scale = per_block_amax / (6.0 * wsf2)
    per_block_scale[per_block_scale == 0] = 1.0
    per_block_scale = per_block_scale.to(torch.float8_e4m3fn)
    w = weight.view(*weight.shape[:-1], -1, block_size)
    scaled = w / (per_block_scale.to(torch.float32) * wsf2).unsqueeze(-1)
    q = _modelopt_cast_fp4(scaled.view(weight.shape))
    packed = (q[..., 1::2] << 4) | q[..., 0::2]
    return packed, per_block_scale, wsf2


def moe_fp64(a1, w13, w2, topk_weights, topk_ids, *, per_pair=False, store_dtype=None, a2_fn=None) -> torch.Tensor:
    """The MoE function in float64, the GEMM oracle every MoE test compares with:

        out[t] = sum_j topk_weights[t, j] * w2[e] @ a2(silu(gate) * up),
        [gate; up] = w13[e] @ a1[t],  e = topk_ids[t, j]

    Args:
        a1: ``[M, H]`` layer input (already QDQ'd where the scheme quantizes it), or ``[M * k, H]``
            one row per (token, expert) pair with ``per_pair``; any float dtype (widened exactly).
        w13: ``[E, 2I, H]`` gate rows then up rows; w2: ``[E, H, I]``; any float dtype.
        topk_weights, topk_ids: ``[M, k]``.
        store_dtype: the dtype the GEMM1 output and the SiLU-and-mul output are stored in between
            the GEMMs (the two roundings every path makes by design), or None for float64 throughout.
        a2_fn: ``a2_fn(act [n, I], expert) -> [n, I]``, the QDQ of the SiLU-and-mul output (rows of
            one expert; ``act`` in ``store_dtype``, float32 when it is None), or None.

    Returns:
        float64 ``[M, H]`` on ``a1``'s device. Plain float64 torch arithmetic: nothing of mxlib.
    """
    m, k = topk_ids.shape
    i = w2.shape[-1]
    flat = topk_ids.reshape(-1).long()
    pairs_out = torch.zeros(m * k, w2.shape[1], dtype=torch.float64, device=a1.device)
    for e in torch.unique(flat).tolist():
        pairs = (flat == e).nonzero().squeeze(1)
        rows = a1[pairs] if per_pair else a1[pairs // k]
        h = rows.double() @ w13[e].double().T
        if store_dtype is not None:
            h = h.to(store_dtype).double()
        act = torch.nn.functional.silu(h[:, :i]) * h[:, i:]
        if store_dtype is not None:
            act = act.to(store_dtype)
        if a2_fn is not None:
            act = a2_fn(act if store_dtype is not None else act.float(), e)
        pairs_out[pairs] = (act.double() @ w2[e].double().T) * topk_weights.reshape(-1)[pairs, None].double()
    return pairs_out.view(m, k, -1).sum(1)


# ----------------------------------------------------------------------------- UE5M3 and the NVFP4 variants


def ue5m3_grid() -> list[float]:
    """Every UE5M3 code's value in float64, straight from the bit fields (no sign bit; 5 exponent bits, bias 15;
    3 mantissa bits; exponent field 0 is subnormal; 0xFF is NaN): index = code."""
    out = []
    for code in range(256):
        e, m = code >> 3, code & 7
        if code == 0xFF:
            out.append(math.nan)
        elif e == 0:
            out.append(m / 8 * 2.0 ** (1 - 15))
        else:
            out.append((1 + m / 8) * 2.0 ** (e - 15))
    return out


def ue5m3_round(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(codes, values)``: round float64 ``x`` to the UE5M3 grid by searching the list of ``ue5m3_grid``:
    nearest value, a tie to the even code, saturating at the largest finite value, negative values to 0, NaN to
    0xFF."""
    grid = np.array(ue5m3_grid()[:255])  # the finite codes, ascending
    x = np.asarray(x, dtype=np.float64)
    codes = np.zeros(x.shape, dtype=np.int64)
    flat = x.reshape(-1)
    out = codes.reshape(-1)
    for i, v in enumerate(flat):
        if math.isnan(v):
            out[i] = 0xFF
            continue
        v = min(max(v, 0.0), grid[-1])
        hi = int(np.searchsorted(grid, v))  # grid[hi - 1] < v <= grid[hi]
        if hi == 0 or grid[hi] == v:
            out[i] = hi
            continue
        lo = hi - 1
        d_lo, d_hi = v - grid[lo], grid[hi] - v
        out[i] = lo if d_lo < d_hi else hi if d_hi < d_lo else (lo if lo % 2 == 0 else hi)
    values = np.array(ue5m3_grid())[codes]
    return codes.astype(np.uint8), values


def nvfp4_variant_qdq(x: np.ndarray, block_size: int, scale: str, global_scale: float | None) -> np.ndarray:
    """NVFP4-style QDQ in numpy float32 with ml_dtypes casts (e2m1, e4m3) or ``ue5m3_round``::

    s = scale(amax / (6 * g)), e = e2m1(x / (s * g)) (0 where s * g is 0), dq = e * (s * g); g = 1 without a
    global scale. ``x`` is 2D float32 ``[m, k]``.
    """
    f32 = np.float32
    m, k = x.shape
    xb = x.astype(f32).reshape(m, k // block_size, block_size)
    g = f32(1.0) if global_scale is None else f32(global_scale)
    amax = np.abs(xb).max(axis=-1)
    raw = (amax / (f32(6.0) * g)).astype(f32)
    if scale == "ue4m3":
        s = round_elements(raw, "e4m3")
    else:
        s = ue5m3_round(raw.astype(np.float64))[1].astype(f32)
    denom = (s * g).astype(f32)[..., None]
    with np.errstate(invalid="ignore", divide="ignore"):
        scaled = np.where(denom == 0, f32(0.0), xb / np.where(denom == 0, f32(1.0), denom)).astype(f32)
    e = round_elements(np.abs(scaled), "e2m1")
    e = np.where(scaled < 0, -e, e).astype(f32)
    return (e * denom).astype(f32).reshape(m, k)
