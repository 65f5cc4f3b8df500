"""What a checkpoint stores for one layer's experts, against the shapes its packing implies (notebook 01, section 3).

``stored_shape_rows(path, scheme, config)``: one row per stored expert tensor of layer 0, its shape as the
safetensors header gives it beside the shape the weight format and the layout imply. Per-expert layouts
(ModelOpt, Quark, compressed-tensors) store expert 0's ``gate_proj`` / ``up_proj`` / ``down_proj``
``weight`` and ``weight_scale`` (``probes.stored_shapes``); gpt-oss's native layout stores whole layers
(``gate_up_proj_blocks [E, 2I, H/32, 16]``, ...: ``mxlib.checkpoints.layouts.gpt_oss_mxfp4``).

``scheme_rows(model_preset)``: every MoE scheme, the layout a checkpoint of the preset's model is written in, and
for a scheme no layout stores for that model, why it is skipped.
"""

from __future__ import annotations

import os

from ..checkpoints import LAYOUTS, layout_for_scheme, read_quant_config
from ..checkpoints.layouts.gpt_oss_mxfp4 import BYTES_PER_BLOCK
from ..models.families import family_of
from ..models.gpt_oss import scheme_support
from ..models.presets import preset_model_type
from ..moe.schemes import MOE_SCHEMES, MoEQuantScheme
from . import probes
from .steps import checkpoint_summary

__all__ = ["stored_shape_rows", "scheme_rows"]


def _row(tensor: str, bf16_weight, expected, stored: dict) -> dict:
    return dict(
        tensor=tensor,
        bf16_weight=str(list(bf16_weight)),
        expected=str(list(expected)),
        stored=stored["shape"],
        dtype=stored["dtype"],
        ok=stored["shape"] == str(list(expected)),
    )


def stored_shape_rows(path: str | os.PathLike, scheme: MoEQuantScheme, config) -> list[dict]:
    """Layer 0's stored expert tensors against the shapes the packing implies.

    Args:
        path: a checkpoint folder ``mxlib.checkpoints.write_quantized_checkpoint`` wrote.
        scheme: its ``MoEQuantScheme``.
        config: the model's transformers config (hidden size, the family's expert intermediate size and count).

    Returns:
        ``[{"tensor", "bf16_weight", "expected", "stored", "dtype", "ok"}]``: the stored name (per-expert
        layouts: ``gate_proj.weight`` ...; gpt-oss: the layer's ``gate_up_proj_blocks`` ...), the bf16 weight's
        shape, the expected and the stored shape (as text), the safetensors dtype, and whether they agree.

    Raises:
        StopIteration: a tensor the packing implies is not stored.
    """
    family = family_of(config, "stored_shape_rows", name="config")
    h, i, e = config.hidden_size, family.intermediate_size(config), family.num_experts(config)
    layout = LAYOUTS[read_quant_config(path).format]
    if getattr(layout, "stacked_experts", False):
        stored = {r["tensor"].rsplit(".", 1)[-1]: r for r in checkpoint_summary(path)}
        bs = scheme.weight.block_size
        want = {
            "gate_up_proj_blocks": ((e, 2 * i, h), (e, 2 * i, h // bs, BYTES_PER_BLOCK)),
            "gate_up_proj_scales": ((e, 2 * i, h), (e, 2 * i, h // bs)),
            "down_proj_blocks": ((e, h, i), (e, h, i // bs, BYTES_PER_BLOCK)),
            "down_proj_scales": ((e, h, i), (e, h, i // bs)),
        }
        return [_row(name, w, shape, stored[name]) for name, (w, shape) in want.items()]
    stored_rows = checkpoint_summary(path)
    rows = []
    for proj, (out_f, in_f) in {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}.items():
        for part, (shape, _) in probes.stored_shapes(scheme, out_f, in_f).items():
            stored = next(r for r in stored_rows if r["tensor"].endswith(f".{proj}.{part}"))
            rows.append(_row(f"{proj}.{part}", (out_f, in_f), shape, stored))
    return rows


def scheme_rows(model_preset: str) -> list[dict]:
    """``{"scheme", "layout", "runs", "skipped_because"}`` for every scheme of ``MOE_SCHEMES``, for the model of
    ``model_preset``: gpt-oss presets by ``mxlib.models.gpt_oss.scheme_support`` (the layouts storing expert
    biases), Qwen3-MoE presets by the scheme's default layout (``layout_for_scheme``).

    Raises:
        ValueError: an unknown preset.
    """
    if preset_model_type(model_preset) == "gpt_oss":
        return scheme_support()
    rows = []
    for s in MOE_SCHEMES.values():
        try:
            layout, reason = layout_for_scheme(s).name, ""
        except ValueError as err:
            layout, reason = None, str(err)
        rows.append(dict(scheme=s.name, layout=layout or "-", runs=layout is not None, skipped_because=reason))
    return rows
