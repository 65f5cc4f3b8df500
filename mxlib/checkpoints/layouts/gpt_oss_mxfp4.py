"""gpt-oss's native MXFP4 layout (openai/gpt-oss-20b, -120b; transformers' ``Mxfp4HfQuantizer``).

One layer's experts are four stacked tensors and two biases (``E`` experts, ``H`` hidden, ``I`` expert
intermediate; the tensors of ``model.layers.L.mlp.experts``)::

    gate_up_proj_blocks  uint8  [E, 2I, H/32, 16]  two e2m1 codes a byte, the even element in the low nibble
    gate_up_proj_scales  uint8  [E, 2I, H/32]      E8M0 block scales, value 2**(byte - 127)
    gate_up_proj_bias    bf16   [E, 2I]
    down_proj_blocks     uint8  [E, H, I/32, 16]
    down_proj_scales     uint8  [E, H, I/32]
    down_proj_bias       bf16   [E, H]

Rows are output channels: block ``g`` of row ``r`` holds the 32 input channels ``32g .. 32g+31``.
Gate and up rows are **interleaved** (row ``2j`` is gate channel ``j``, row ``2j + 1`` up channel
``j``), biases too; mxlib's ``ExpertWeights`` and ``w13_bias`` keep ``[gate rows; up rows]``, so
``read_experts`` de-interleaves and ``expert_tensors`` interleaves (``interleave_gate_up``,
``deinterleave_gate_up``). Everything else (attention, the router ``mlp.router`` with its bias,
embeddings, ``lm_head``) is bf16 under its transformers name and listed in ``config.json``'s
``quantization_config``: ``{"quant_method": "mxfp4", "modules_to_not_convert": [...]}``.

Activations are bf16 (no activation scale): the layout stores ``w_mxfp4`` only.

Source: transformers ``integrations/mxfp4.py`` (``convert_moe_packed_tensors``: the low nibble is
the even element, ``ldexp(value, byte - 127)``, blocks ``[E, R, G, 16]`` to ``[E, G*32, R]``),
``models/gpt_oss/modeling_gpt_oss.py`` (``GptOssExperts``: ``gate_up_proj [E, H, 2I]``,
``gate = gate_up[..., ::2]``, ``up = gate_up[..., 1::2]``; vLLM's ``SwigluOAIAndMul`` in
``model_executor/layers/activation.py`` reads the same interleaved columns), ``quantizers/quantizer_mxfp4.py``
(the tensor names ``*_blocks`` / ``*_scales``), and openai/gpt-oss-20b's ``config.json``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...formats import BLOCK_SCHEMES
from ...moe.emulation import ExpertWeights
from ...moe.schemes import MOE_SCHEMES, MoEQuantScheme
from ..layout import (
    CheckpointDescription,
    CheckpointError,
    CheckpointLayout,
    block_scale_check,
    check_exclude_patterns,
)

__all__ = [
    "LAYOUT",
    "QUANT_METHOD",
    "MODULES_TO_NOT_CONVERT",
    "BYTES_PER_BLOCK",
    "GptOssMxfp4Layout",
    "interleave_gate_up",
    "deinterleave_gate_up",
]

QUANT_METHOD = "mxfp4"
# openai/gpt-oss-20b config.json quantization_config.modules_to_not_convert
MODULES_TO_NOT_CONVERT = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
_MXFP4 = BLOCK_SCHEMES["mxfp4"]
BYTES_PER_BLOCK = _MXFP4.block_size // 2  # 32 e2m1 codes, two a byte
_SCHEME = MOE_SCHEMES["w_mxfp4"]


def interleave_gate_up(t: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """``[gate; up]`` along ``dim`` (size ``2I``) to gpt-oss's interleaved order (``2j``: gate ``j``,
    ``2j + 1``: up ``j``). Raises ``ValueError`` for an odd size."""
    dim = dim % t.dim()
    if t.shape[dim] % 2:
        raise ValueError(f"interleave_gate_up: dim {dim} must have an even size (2I), got shape {list(t.shape)}")
    gate, up = t.chunk(2, dim)
    return torch.stack((gate, up), dim + 1).flatten(dim, dim + 1)


def deinterleave_gate_up(t: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """gpt-oss's interleaved gate/up along ``dim`` to ``[gate; up]`` (``interleave_gate_up``'s inverse)."""
    dim = dim % t.dim()
    if t.shape[dim] % 2:
        raise ValueError(f"deinterleave_gate_up: dim {dim} must have an even size (2I), got shape {list(t.shape)}")
    pairs = t.unflatten(dim, (t.shape[dim] // 2, 2))
    return torch.cat((pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)), dim)


class GptOssMxfp4Layout(CheckpointLayout):
    """gpt-oss's native MXFP4 experts (module docstring). Its tensors are whole layers (``[E, ...]``),
    not one expert each: ``expert_tensors`` takes all ``E`` experts of a layer (``stacked_experts``)."""

    name = "gpt-oss-mxfp4"
    quant_method = QUANT_METHOD
    # one tensor per layer holding every expert (the other layouts store one tensor per expert)
    stacked_experts = True
    # it stores the experts' biases (gate_up_proj_bias, down_proj_bias): read_expert_biases reads them
    stores_expert_biases = True

    def handles(self, scheme: MoEQuantScheme) -> bool:
        return scheme == _SCHEME

    # ----------------------------------------------------------------------------- config

    def config_files(self, scheme: MoEQuantScheme, quantize_attention: bool = False) -> tuple[dict, dict[str, dict]]:
        if not self.handles(scheme):
            raise ValueError(f"scheme: layout {self.name} stores {_SCHEME.name} only, got {scheme.name}")
        if quantize_attention:
            raise ValueError(f"quantize_attention: layout {self.name} keeps attention bf16 (expected False, got True)")
        return {"quant_method": QUANT_METHOD, "modules_to_not_convert": list(MODULES_TO_NOT_CONVERT)}, {}

    def read_config(self, qc: dict) -> CheckpointDescription:
        method = qc.get("quant_method")
        if method != QUANT_METHOD:
            raise CheckpointError(
                f"quantization_config.quant_method: this layout reads {QUANT_METHOD!r}, found {method!r}"
            )
        exclude = qc.get("modules_to_not_convert")
        if exclude is None:
            exclude = []
        check_exclude_patterns(exclude, "quantization_config.modules_to_not_convert")
        if qc.get("dequantize", False) not in (False, None):
            raise CheckpointError(
                f"quantization_config.dequantize: a stored checkpoint holds MXFP4 experts (expected false), "
                f"found {qc['dequantize']!r}"
            )
        return CheckpointDescription(self.name, _SCHEME, list(exclude), None)

    def read_legacy(self, folder: Path) -> dict | None:
        return None

    # ----------------------------------------------------------------------------- tensors

    def expert_tensors(
        self,
        scheme,
        weights: ExpertWeights,
        w13_input_scale,
        w2_input_scale,
        prefix: str,
        w13_bias: torch.Tensor | None = None,
        w2_bias: torch.Tensor | None = None,
    ) -> dict:
        """One layer's experts in gpt-oss's names and shapes.

        Args:
            weights: MXFP4 ``ExpertWeights`` of all ``E`` experts (``w13_weight`` uint8 ``[E, 2I, H/2]``
                gate rows then up rows, ``w13_weight_scale`` uint8 / float8_e8m0fnu ``[E, 2I, H/32]``,
                ``w2_weight [E, H, I/2]``, ``w2_weight_scale [E, H, I/32]``).
            w13_input_scale, w2_input_scale: must be None (bf16 activations).
            prefix: ``model.layers.L.mlp.experts``.
            w13_bias: ``[E, 2I]`` gate then up, any float dtype (stored interleaved, cast to bf16);
                w2_bias: ``[E, H]``. A bias left None is not written (the caller writes it).

        Returns:
            ``{f"{prefix}.gate_up_proj_blocks": ..., ...}`` (module docstring), CPU tensors.

        Raises:
            ValueError: a scheme other than ``w_mxfp4``, input scales given, or shapes that do not
                agree (naming the argument, expected and found).
        """
        if scheme != _SCHEME or weights.scheme != _MXFP4:
            raise ValueError(
                f"scheme: layout {self.name} stores {_SCHEME.name} only, got {getattr(scheme, 'name', scheme)}"
            )
        if w13_input_scale is not None or w2_input_scale is not None:
            raise ValueError(f"w13_input_scale / w2_input_scale: layout {self.name} stores none (bf16 activations)")
        e, two_i, h_half = weights.w13_weight.shape
        h, i = h_half * 2, two_i // 2
        bs = _MXFP4.block_size
        want = {
            "weights.w13_weight_scale": (weights.w13_weight_scale, (e, two_i, h // bs)),
            "weights.w2_weight": (weights.w2_weight, (e, h, i // 2)),
            "weights.w2_weight_scale": (weights.w2_weight_scale, (e, h, i // bs)),
            "w13_bias": (w13_bias, (e, two_i)),
            "w2_bias": (w2_bias, (e, h)),
        }
        for what, (t, shape) in want.items():
            if t is not None and tuple(t.shape) != shape:
                raise ValueError(f"{what}: expected shape {list(shape)} (from w13_weight), got {list(t.shape)}")
        out = {
            f"{prefix}.gate_up_proj_blocks": interleave_gate_up(weights.w13_weight.view(torch.uint8))
            .reshape(e, two_i, h // bs, BYTES_PER_BLOCK)
            .contiguous()
            .cpu(),
            f"{prefix}.gate_up_proj_scales": interleave_gate_up(weights.w13_weight_scale.view(torch.uint8))
            .contiguous()
            .cpu(),
            f"{prefix}.down_proj_blocks": weights.w2_weight.view(torch.uint8)
            .reshape(e, h, i // bs, BYTES_PER_BLOCK)
            .contiguous()
            .cpu(),
            f"{prefix}.down_proj_scales": weights.w2_weight_scale.view(torch.uint8).contiguous().cpu(),
        }
        if w13_bias is not None:
            out[f"{prefix}.gate_up_proj_bias"] = interleave_gate_up(w13_bias).to(torch.bfloat16).contiguous().cpu()
        if w2_bias is not None:
            out[f"{prefix}.down_proj_bias"] = w2_bias.to(torch.bfloat16).contiguous().cpu()
        return out

    @staticmethod
    def _check_sizes(h: int, i: int) -> None:
        bs = _MXFP4.block_size
        for what, n in (("hidden_size", h), ("intermediate_size", i)):
            if n % bs:
                raise CheckpointError(f"{what}: MXFP4 blocks of {bs} need a multiple of {bs}, found {n}")

    def read_experts(self, tensors, prefix: str, e: int, h: int, i: int, description: CheckpointDescription):
        """``(ExpertWeights, None, None)`` of one layer's ``e`` experts, gate rows then up rows.

        Raises:
            CheckpointError: a tensor missing, of another dtype or shape (naming it, the expected and
                the found), or an E8M0 NaN scale (0xFF).
        """
        self._check_sizes(h, i)
        bs, u8, scales = _MXFP4.block_size, torch.uint8, block_scale_check(e4m3=False)
        shapes = {
            "gate_up_proj_blocks": (e, 2 * i, h // bs, BYTES_PER_BLOCK),
            "gate_up_proj_scales": (e, 2 * i, h // bs),
            "down_proj_blocks": (e, h, i // bs, BYTES_PER_BLOCK),
            "down_proj_scales": (e, h, i // bs),
        }
        t = {}
        for n, shape in shapes.items():
            check = scales if n.endswith("_scales") else None
            t[n] = tensors.stack([f"{prefix}.{n}"], shape, u8, check)[0]
        weights = ExpertWeights(
            _MXFP4,
            deinterleave_gate_up(t["gate_up_proj_blocks"].reshape(e, 2 * i, h // 2)).contiguous(),
            deinterleave_gate_up(t["gate_up_proj_scales"]).contiguous(),
            t["down_proj_blocks"].reshape(e, h, i // 2).contiguous(),
            t["down_proj_scales"].contiguous(),
        )
        return weights, None, None

    def read_expert_biases(self, tensors, prefix: str, e: int, h: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w13_bias [E, 2I] gate then up, w2_bias [E, H])``, bf16, of one layer's experts.

        Raises:
            CheckpointError: a bias missing, not bf16, or of another shape (naming it).
        """
        b13 = tensors.stack([f"{prefix}.gate_up_proj_bias"], (e, 2 * i), torch.bfloat16)[0]
        b2 = tensors.stack([f"{prefix}.down_proj_bias"], (e, h), torch.bfloat16)[0]
        return deinterleave_gate_up(b13).contiguous(), b2.contiguous()

    def projection(self, read, prefix: str, expert: int, proj: str) -> tuple[str, torch.Tensor, torch.Tensor]:
        """One expert's ``gate_proj``, ``up_proj`` or ``down_proj`` as stored: ``(tensor name, packed uint8
        [out, in/2], scales uint8 [out, in/32])``, the gate (even) or up (odd) rows of ``gate_up_proj_blocks``.

        ``read(name) -> tensor`` reads a stored tensor (a safetensors file's ``get_tensor``).

        Raises:
            ValueError: ``proj`` is not one of the three.
        """
        if proj not in ("gate_proj", "up_proj", "down_proj"):
            raise ValueError(f"proj: expected gate_proj, up_proj or down_proj, got {proj!r}")
        stored = "down_proj" if proj == "down_proj" else "gate_up_proj"
        blocks, scales = read(f"{prefix}.{stored}_blocks")[expert], read(f"{prefix}.{stored}_scales")[expert]
        rows = slice(None) if proj == "down_proj" else slice(proj == "up_proj", None, 2)
        packed = blocks[rows]
        return f"{prefix}.{stored}_blocks", packed.reshape(packed.shape[0], -1).contiguous(), scales[rows].contiguous()


LAYOUT = GptOssMxfp4Layout()  # registered by the package's __init__
