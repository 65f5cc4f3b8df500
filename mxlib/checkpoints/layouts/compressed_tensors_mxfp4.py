"""compressed-tensors MXFP4 layout (llm-compressor's ``mxfp4-pack-quantized``).

What compressed-tensors stores for its ``MXFP4A16`` (weight-only, mxlib's ``w_mxfp4``) and ``MXFP4``
(weights and dynamic activations, ``w_mxfp4_a_mxfp4``) presets: for every quantized ``nn.Linear`` ``M``
(each expert's ``gate_proj``, ``up_proj``, ``down_proj``, and the attention projections unless
ignored)::

    M.weight_packed  uint8  [out, in/2]   two e2m1 codes a byte, the even element in the low nibble
    M.weight_scale   uint8  [out, in/32]  E8M0 block scales, value 2**(byte - 127)

No global scale and no activation scale: MXFP4 activations are quantized dynamically (their E8M0
scales come from each block's amax at run time). ``config.json``'s ``quantization_config``:
``quant_method: compressed-tensors``, ``format: mxfp4-pack-quantized``, ``config_groups.group_N`` with
``targets: [Linear]``, ``weights`` (``num_bits 4, type float, strategy group, group_size 32,
symmetric true, dynamic false, scale_dtype torch.uint8``) and, for ``MXFP4``, ``input_activations``
(the same with ``dynamic: true``), and ``ignore`` (module names or ``re:`` patterns).

Scale rule: compressed-tensors' ``generate_mx_scales`` rounds the bf16 block amax up at e2m1's
mantissa width (``round_to_power_2``: half an ulp added to the bf16 bits, mantissa dropped), then
takes ``floor(log2) - 2``: the E8M0 ``even`` rule (``mxlib.formats.SCALE_MODES``) on bf16 values,
which is how the writer quantizes (``mxlib.moe.factory.quantize_expert_weights``) and how the
activations are QDQ'd. The stored byte is ``127 + floor(log2(scale))`` (``compress_mx_scale``), read
as E8M0 as it is. Source: compressed-tensors 0.19 ``quantization/quant_scheme.py`` (the presets),
``quantization/utils/mxfp_utils.py`` (the scales), ``compressors/mxfp4/base.py``
(``MXFP4PackedCompressor``, the tensors) and ``compressors/mx_utils.py`` (the scale bytes); checked
against llm-compressor's own exports in ``tests/test_interop_formats.py``.

The NVFP4 compressed-tensors layout (``compressed_tensors_nvfp4``) shares the ``quant_method``; its
config reader hands ``mxfp4-pack-quantized`` configs to this layout. ``CompressedTensorsMxLayout`` holds what
compressed-tensors' MX layouts share (the config, its checks, the per-module tensors); the MXFP8 layout
(``compressed_tensors_mxfp8``) is its other subclass.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...formats import BLOCK_SCHEMES, BlockScheme
from ...moe.emulation import ExpertWeights
from ...moe.linear import LinearWeights
from ...moe.schemes import MOE_SCHEMES, MoEQuantScheme
from ..layout import (
    CheckpointDescription,
    CheckpointError,
    CheckpointLayout,
    block_scale_check,
    expert_parts,
    read_block_experts,
)

__all__ = ["LAYOUT", "FORMAT", "CompressedTensorsMxLayout", "quantization_config"]

FORMAT = "mxfp4-pack-quantized"
_MXFP4 = BLOCK_SCHEMES["mxfp4"]
_EXCLUDE = ["lm_head", "re:.*mlp.gate$", "re:.*self_attn.*"]
_EXCLUDE_ATTENTION_QUANTIZED = ["lm_head", "re:.*mlp.gate$"]
_SCALE_DTYPE = "torch.uint8"


def quantization_config(quant_method: str, fmt: str, group: dict, quantize_attention: bool) -> dict:
    """The ``quantization_config`` mxlib writes for a compressed-tensors layout (this one, MXFP8's and NVFP4's):
    one config group ``group_0`` (``group``) in format ``fmt``, attention (unless ``quantize_attention``), the
    routers and ``lm_head`` in ``ignore``."""
    return {
        "quant_method": quant_method,
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": list(_EXCLUDE_ATTENTION_QUANTIZED if quantize_attention else _EXCLUDE),
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "transform_config": {},
        "global_compression_ratio": None,
        "version": "mxlib-dummy",
    }


class CompressedTensorsMxLayout(CheckpointLayout):
    """What compressed-tensors' OCP MX layouts share: a ``config_groups`` config of one ``format`` with
    ``group`` weights (and dynamic ``input_activations`` for the W/A schemes), one E8M0 ``weight_scale`` byte
    per block of 32, and no global or activation scale. A subclass sets the class attributes below."""

    quant_method = "compressed-tensors"
    supports_linear = True
    format: str  # quantization_config.format
    label: str  # the format's name in messages ("MXFP4")
    block: BlockScheme
    schemes: tuple[MoEQuantScheme, MoEQuantScheme]  # (weight-only, weights and activations)
    weight_name: str  # the codes' tensor suffix ("weight_packed", "weight")
    stored_dtype: torch.dtype  # the codes' stored dtype (uint8 bytes are viewed as it)
    activation_mode: str  # the E8M0 rule of the dynamic activations
    zp_dtype: str | None
    observer: str  # the weights' observer as the tool records it

    def handles(self, scheme: MoEQuantScheme) -> bool:
        return scheme in self.schemes

    @property
    def group(self) -> dict:
        """The quantization-args keys a reader checks, with the values the format needs."""
        return {
            "num_bits": self.block.element.nbits,
            "type": "float",
            "strategy": "group",
            "group_size": self.block.block_size,
        }

    def _args(self, dynamic: bool) -> dict:
        return {
            **self.group,
            "symmetric": True,
            "block_structure": None,
            "dynamic": dynamic,
            "actorder": None,
            "scale_dtype": _SCALE_DTYPE,
            "zp_dtype": self.zp_dtype,
            "observer": None if dynamic else self.observer,
            "observer_kwargs": {},
        }

    # ----------------------------------------------------------------------------- config

    def config_files(self, scheme: MoEQuantScheme, quantize_attention: bool = False) -> tuple[dict, dict[str, dict]]:
        group = {
            "targets": ["Linear"],
            "format": self.format,
            "weights": self._args(dynamic=False),
            "input_activations": None if scheme.weight_only else self._args(dynamic=True),
            "output_activations": None,
        }
        return quantization_config(self.quant_method, self.format, group, quantize_attention), {}

    def read_legacy(self, folder: Path) -> dict | None:
        return None

    def _check_args(self, args: dict, where: str) -> None:
        for key, want in self.group.items():
            if args.get(key) != want:
                raise CheckpointError(f"{where}.{key}: {self.label} uses {want!r}, found {args.get(key)!r}")
        if args.get("symmetric", True) is not True:
            raise CheckpointError(
                f"{where}.symmetric: {self.label} is symmetric (true), found {args.get('symmetric')!r}"
            )
        if args.get("scale_dtype", _SCALE_DTYPE) not in (_SCALE_DTYPE, "uint8", None):
            raise CheckpointError(
                f"{where}.scale_dtype: {self.label} stores E8M0 scales as {_SCALE_DTYPE!r}, "
                f"found {args.get('scale_dtype')!r}"
            )

    def read_config(self, qc: dict) -> CheckpointDescription:
        fmt = qc.get("format")
        if fmt != self.format:
            raise CheckpointError(f"quantization_config.format: this layout reads {self.format!r}, found {fmt!r}")
        groups = qc.get("config_groups") or {}
        if not groups:
            raise CheckpointError("quantization_config.config_groups: missing")
        schemes = set()
        for gname, group in groups.items():
            where = f"quantization_config.config_groups.{gname}"
            if group.get("format", self.format) != self.format:
                raise CheckpointError(f"{where}.format: expected {self.format!r}, found {group.get('format')!r}")
            w = group.get("weights")
            if not w:
                raise CheckpointError(f"{where}.weights: {self.label} needs it, found {w!r}")
            self._check_args(w, f"{where}.weights")
            if w.get("dynamic"):
                raise CheckpointError(f"{where}.weights.dynamic: expected false, found {w['dynamic']!r}")
            a = group.get("input_activations")
            if a:
                self._check_args(a, f"{where}.input_activations")
                if a.get("dynamic") is not True:
                    raise CheckpointError(
                        f"{where}.input_activations.dynamic: {self.label} activations are dynamic (true), "
                        f"found {a.get('dynamic')!r}"
                    )
            schemes.add(self.schemes[1] if a else self.schemes[0])
        if len(schemes) > 1:
            raise CheckpointError(
                "quantization_config.config_groups: groups with and without input_activations; the emulation "
                "runs one scheme per model"
            )
        status = qc.get("quantization_status", "compressed")
        if status != "compressed":
            raise CheckpointError(f"quantization_config.quantization_status: expected 'compressed', found {status!r}")
        scheme = schemes.pop()
        mode = None if scheme.weight_only else self.activation_mode
        return CheckpointDescription(self.name, scheme, list(qc.get("ignore") or []), mode)

    # ----------------------------------------------------------------------------- tensors

    def _stored_shape(self, rows: int, cols: int) -> tuple[int, int]:
        return rows, cols * self.block.element.nbits // 8

    def expert_tensors(self, scheme, weights: ExpertWeights, w13_input_scale, w2_input_scale, prefix: str) -> dict:
        out: dict[str, torch.Tensor] = {}
        for x, proj, p, s, _, _ in expert_parts(weights):
            base = f"{prefix}.{x}.{proj}"
            out[f"{base}.{self.weight_name}"] = p.view(self.stored_dtype)
            out[f"{base}.weight_scale"] = s
        return out

    def read_experts(self, tensors, prefix: str, e: int, h: int, i: int, description: CheckpointDescription):
        parts = read_block_experts(tensors, prefix, e, h, i, self.block, self.weight_name, self.stored_dtype)
        return ExpertWeights(self.block, *parts), None, None

    def linear_tensors(self, scheme, weights: LinearWeights, input_scale, name: str) -> dict:
        return {
            f"{name}.{self.weight_name}": weights.weight.contiguous().cpu().view(self.stored_dtype),
            f"{name}.weight_scale": weights.weight_scale.contiguous().cpu(),
        }

    def read_linear(self, tensors, name: str, out_features: int, in_features: int, description: CheckpointDescription):
        """``(LinearWeights, None)`` of a quantized linear layer ``name`` (dynamic activations, no input scale)."""
        shape = self._stored_shape(out_features, in_features)
        w = tensors.get(f"{name}.{self.weight_name}", shape, self.stored_dtype).view(torch.uint8)
        s = tensors.stack(
            [f"{name}.weight_scale"],
            (out_features, in_features // self.block.block_size),
            torch.uint8,
            block_scale_check(e4m3=False),
        )[0]
        return LinearWeights(self.block, w, s), None


class CompressedTensorsMxfp4Layout(CompressedTensorsMxLayout):
    name = "compressed-tensors-mxfp4"
    format = FORMAT
    label = "MXFP4"
    block = _MXFP4
    # the schemes the layout stores: weight-only (MXFP4A16) and W4A4 (MXFP4)
    schemes = (MOE_SCHEMES["w_mxfp4"], MOE_SCHEMES["w_mxfp4_a_mxfp4"])
    weight_name = "weight_packed"
    stored_dtype = torch.uint8
    activation_mode = "even"
    zp_dtype = _SCALE_DTYPE
    observer = "minmax"


LAYOUT = CompressedTensorsMxfp4Layout()  # registered by the package's __init__
