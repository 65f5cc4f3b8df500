"""compressed-tensors MXFP8 layout (llm-compressor's ``mxfp8-quantized``).

What compressed-tensors stores for its ``MXFP8A16`` (weight-only, mxlib's ``w_mxfp8``) and ``MXFP8``
(weights and dynamic activations, ``w_mxfp8_a_mxfp8``) presets: for every quantized ``nn.Linear`` ``M``
(each expert's ``gate_proj``, ``up_proj``, ``down_proj``, and the attention projections unless
ignored)::

    M.weight        float8_e4m3fn  [out, in]     one e4m3 code a byte
    M.weight_scale  uint8          [out, in/32]  E8M0 block scales, value 2**(byte - 127)

No global scale and no activation scale: the activations of ``MXFP8`` are quantized dynamically.
``config.json``'s ``quantization_config``: ``quant_method: compressed-tensors``, ``format:
mxfp8-quantized``, ``config_groups.group_N`` with ``targets: [Linear]``, ``weights`` (``num_bits 8,
type float, strategy group, group_size 32, symmetric true, dynamic false, scale_dtype torch.uint8``)
and, for ``MXFP8``, ``input_activations`` (the same with ``dynamic: true``), and ``ignore``.

Scale rule (``ct_mxfp8_scale``): compressed-tensors' ``generate_mx_scales(amax, num_bits=8)`` rounds
the block amax to a power of two at e2m1's mantissa width for FP8 too (``round_to_power_2``: a
quarter of the leading binade added to the bits, mantissa dropped, so amax is bumped up one binade
when its significand is at least 1.75), then takes ``floor(log2) - 8``. For every amax whose
significand is not exactly 1.75 this is the ``rceil`` rule ``2**ceil(log2(amax / 448))``
(``mxlib.formats.SCALE_MODES``); at exactly 1.75 (``amax = 448 * 2**k``) compressed-tensors picks the
scale twice as large as ``rceil`` (``2**(k + 1)``, where ``rceil`` gives ``2**k`` and 448 is
representable). The writer quantizes the weights by compressed-tensors' rule, so it writes the
tool's bytes; the loaded experts QDQ dynamic activations with ``rceil``, the registered rule
nearest it (the two differ on blocks whose amax is ``448 * 2**k`` exactly). Sources:
compressed-tensors 0.19 ``quantization/quant_scheme.py`` (the presets),
``quantization/utils/mxfp_utils.py`` (``generate_mx_scales``, ``round_to_power_2``),
``compressors/mxfp8/base.py`` (``MXFP8QuantizationCompressor``), ``compressors/mx_utils.py``
(``compress_mx_scale``: ``127 + floor(log2(scale))`` as uint8).

The NVFP4 compressed-tensors layout (``compressed_tensors_nvfp4``) shares the ``quant_method``; its
config reader hands ``mxfp8-quantized`` configs to this layout.
"""

from __future__ import annotations

import torch

from ... import reference as _ref
from ...formats import BLOCK_SCHEMES, E8M0_BIAS, E8M0_NAN_BYTE
from ...moe.emulation import ExpertWeights
from ...moe.linear import LinearWeights
from ...moe.schemes import MOE_SCHEMES
from .compressed_tensors_mxfp4 import CompressedTensorsMxLayout

__all__ = ["LAYOUT", "FORMAT", "ct_mxfp8_scale", "quantize_ct_mxfp8"]

FORMAT = "mxfp8-quantized"
_MXFP8 = BLOCK_SCHEMES["mxfp8_e4m3"]
_STORED = getattr(torch, _MXFP8.element.ml_dtypes_name)  # float8_e4m3fn
_ACTIVATION_SCALE_MODE = "rceil"  # the registered rule nearest compressed-tensors' (module docstring)
# compressed-tensors' element offset for FP8, floor(log2(448)), and its rounding width (e2m1's mantissa)
_OFFSET = 8
_ROUND_MBITS = 1


def ct_mxfp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """E8M0 scale bytes of MXFP8 blocks by compressed-tensors' ``generate_mx_scales(amax, num_bits=8)``.

    Args:
        amax: float tensor (any shape) of non-negative block maxima, bf16 or fp32 (the rule is the same
            on either: bf16 values are fp32 values with a short mantissa).

    Returns:
        uint8 of ``amax``'s shape: ``127 + floor(log2(r)) - 8`` where ``r`` is ``amax`` with
        ``1 << 21`` added to its fp32 bits and the mantissa dropped (significand >= 1.75 goes up one
        binade). Clamped to bytes 0 .. 254 (an all-zero block gets 0, as in compressed-tensors, whose
        ``log2(0) = -inf`` clamps to 0); NaN or Inf amax gives 0xFF.
    """
    a = amax.float()
    finite = torch.isfinite(a)
    bits = torch.where(finite, a.abs(), 0.0).view(torch.int32)
    e = torch.bitwise_right_shift(bits + (1 << (22 - _ROUND_MBITS)), 23) - E8M0_BIAS - _OFFSET
    byte = torch.where(bits == 0, 0, (e + E8M0_BIAS).clamp(0, 2 * E8M0_BIAS))
    return torch.where(finite, byte, E8M0_NAN_BYTE).to(torch.uint8)


def quantize_ct_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 (e4m3, blocks of 32 along the last axis) as compressed-tensors quantizes a weight.

    Args:
        x: ``[..., k]`` float32 / bfloat16 / float16, ``k`` a multiple of 32.

    Returns:
        ``(codes, scale)``: uint8 e4m3 codes ``[..., k]`` (``x / scale`` rounded to nearest even,
        which never exceeds 448 under this scale rule) and ``ct_mxfp8_scale`` bytes ``[..., k/32]``.

    Raises:
        ValueError: ``k`` is not a multiple of 32 (naming ``x``'s shape).
    """
    bs = _MXFP8.block_size
    if x.shape[-1] % bs:
        raise ValueError(f"x: the last axis must be a multiple of {bs}, got shape {list(x.shape)}")
    xb = x.float().reshape(*x.shape[:-1], x.shape[-1] // bs, bs)
    byte = ct_mxfp8_scale(xb.abs().amax(dim=-1))
    codes = _ref.encode_element(xb / _ref.decode_e8m0(byte).unsqueeze(-1), _MXFP8.element)
    codes = torch.where((byte == E8M0_NAN_BYTE).unsqueeze(-1), 0, codes).to(torch.uint8)
    return codes.reshape(x.shape), byte


class CompressedTensorsMxfp8Layout(CompressedTensorsMxLayout):
    name = "compressed-tensors-mxfp8"
    format = FORMAT
    label = "MXFP8"
    block = _MXFP8
    # the schemes the layout stores: weight-only (MXFP8A16) and W8A8 (MXFP8)
    schemes = (MOE_SCHEMES["w_mxfp8"], MOE_SCHEMES["w_mxfp8_a_mxfp8"])
    weight_name = "weight"
    stored_dtype = _STORED
    activation_mode = _ACTIVATION_SCALE_MODE
    zp_dtype = None
    observer = "memoryless_minmax"

    def quantize_experts(self, w13: torch.Tensor, w2: torch.Tensor, scheme) -> ExpertWeights:
        """One layer's experts with compressed-tensors' scale rule (``quantize_ct_mxfp8``)."""
        p13, s13 = quantize_ct_mxfp8(w13)
        p2, s2 = quantize_ct_mxfp8(w2)
        return ExpertWeights(_MXFP8, p13, s13, p2, s2)

    def quantize_linear(self, weight: torch.Tensor, scheme) -> LinearWeights:
        p, s = quantize_ct_mxfp8(weight)
        return LinearWeights(_MXFP8, p, s)


LAYOUT = CompressedTensorsMxfp8Layout()  # registered by the package's __init__
