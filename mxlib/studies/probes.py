"""What a written checkpoint holds, and notebook 01's negative control on the loaded model.

* ``stored_shapes(scheme, out_features, in_features)``: the shapes and dtypes a ModelOpt / Quark
  checkpoint stores for one expert projection (what its packing implies).
* ``stored_block(path, ...)``: one block of one stored expert weight read back from the
  safetensors and decoded by hand (bytes, codes, elements, scale, values).
* ``swapped_nibbles(model)``: every stored FP4 byte of every emulation experts module with its two
  codes swapped, for the length of a ``with`` block (a packing bug the loader cannot see);
  ``captured_output(module)`` records a module's outputs meanwhile (the MoE block's, for its SQNR).

* ``relative_paths(text, *paths)`` and ``short_warnings()``: what a notebook shows holds no absolute
  path of this machine (a checkpoint in the cache is shown by its folder's name; a warning by its
  category and message, without the source file it was raised from).

All decoding goes through ``mxlib.reference``; these functions add no rounding of their own.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

from .. import reference as R
from ..checkpoints import LAYOUTS, read_quant_config
from ..checkpoints.files.safetensors_io import TensorReader
from ..formats import BlockScheme
from ..moe.schemes import MoEQuantScheme, get_weight_format

__all__ = ["stored_shapes", "stored_block", "swapped_nibbles", "captured_output", "relative_paths", "short_warnings"]


def relative_paths(text: str, *paths: str | os.PathLike) -> str:
    """``text`` with each of ``paths`` (and its resolved form) replaced by the folder's own name, so that
    a notebook's printed output names a checkpoint without the machine's cache location."""
    for p in paths:
        p = Path(p)
        for form in sorted({str(p), str(p.resolve())}, key=len, reverse=True):
            if os.path.isabs(form):
                text = text.replace(form, p.name)
    return text


def _short_format(message, category, filename, lineno, line=None) -> str:
    return f"{category.__name__}: {message}\n"


def short_warnings() -> None:
    """Print warnings as ``Category: message`` only, without the source file and line Python adds (an
    absolute path of the installed package). For notebooks; changes ``warnings.formatwarning``."""
    warnings.formatwarning = _short_format


def stored_shapes(scheme: str | MoEQuantScheme | BlockScheme, out_features: int, in_features: int) -> dict:
    """Shapes and dtypes a ModelOpt / Quark checkpoint stores for one ``[out_features, in_features]``
    expert weight in ``scheme``'s weight format (a ``MoEQuantScheme`` or ``BlockScheme``, or the
    name of either: ``mxlib.moe.schemes.get_weight_format``).

    ``weight``: uint8 ``[out, in * bits / 8]`` (FP4: two codes a byte, FP6: four codes in three
    bytes, FP8: one a byte); ``weight_scale``: one scale per ``block_size`` inputs, ``[out, in /
    block_size]``, float8_e4m3fn (NVFP4, block 16) or uint8 E8M0 (OCP MX, block 32). Returns
    ``{"weight": (shape, dtype), "weight_scale": (shape, dtype)}`` with shapes as tuples, dtypes as
    the safetensors names (``U8``, ``F8_E4M3``).

    Raises:
        ValueError: unknown scheme; ``in_features`` not a multiple of the block size.
    """
    bs = get_weight_format(scheme)
    if in_features % bs.block_size:
        raise ValueError(f"in_features={in_features} is not a multiple of block_size={bs.block_size}")
    scale_dtype = "F8_E4M3" if bs.has_global_scale else "U8"
    return {
        "weight": ((out_features, bs.element.packed_size(in_features)), "U8"),
        "weight_scale": ((out_features, in_features // bs.block_size), scale_dtype),
    }


def stored_block(path, layer: int = 0, expert: int = 0, proj: str = "gate_proj", row: int = 0, block: int = 0) -> dict:
    """One block of one stored expert weight, read from the checkpoint's safetensors and decoded.

    Args:
        path: a checkpoint folder written by ``write_quantized_checkpoint`` (ModelOpt NVFP4, Quark OCP MX or
            gpt-oss MXFP4 layout, where an expert's rows of the layer's blocks are read; its ``config.json``
            names the scheme).
        layer, expert: which expert; ``proj``: ``gate_proj``, ``up_proj`` or ``down_proj``.
        row: the output row; ``block``: the block index along the input dimension.

    Returns:
        dict: ``scheme``, ``tensor`` (the weight's name), ``bytes_hex`` (the packed bytes of the
        block as stored), ``codes`` (element codes), ``elements`` (their values), ``scale_byte``
        (E8M0 byte, or the e4m3 byte of the NVFP4 block scale), ``block_scale`` (decoded),
        ``weight_scale_2`` (NVFP4's per-tensor decode scale, else None) and ``values``: the
        dequantized weights, ``elements * block_scale (* weight_scale_2)`` in fp32 (bit-equal to
        ``mxlib.reference``'s dequantization of that row).

    Raises:
        ValueError: ``proj`` unknown or ``row`` / ``block`` outside the stored tensor.
    """
    if proj not in ("gate_proj", "up_proj", "down_proj"):
        raise ValueError(f"proj: expected gate_proj, up_proj or down_proj, got {proj!r}")
    path = Path(path)
    info = read_quant_config(path)
    bs, layout = info.scheme.weight, LAYOUTS[info.format]
    tensors = TensorReader(path)  # every shard opened once: a checkpoint replaced meanwhile is not mixed in
    index = tensors.weight_map
    name = f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"
    if getattr(layout, "stacked_experts", False):  # gpt-oss: the expert's rows of the layer's blocks
        name = f"model.layers.{layer}.mlp.experts.{'down' if proj == 'down_proj' else 'gate_up'}_proj_blocks"
    if name not in index:
        raise ValueError(f"layer={layer}, expert={expert}: {name} is not in the checkpoint")

    def read(tensor):
        return tensors.get(tensor)

    if getattr(layout, "stacked_experts", False):
        name, w, sc = layout.projection(read, f"model.layers.{layer}.mlp.experts", expert, proj)
    else:
        w, sc = read(name), read(name + "_scale")
    if not 0 <= row < w.shape[0]:
        raise ValueError(f"row: expected an integer in [0, {w.shape[0]}), got {row}")
    if not 0 <= block < sc.shape[1]:
        raise ValueError(f"block: expected an integer in [0, {sc.shape[1]}), got {block}")
    fmt = bs.element
    nbytes = fmt.packed_size(bs.block_size)
    raw = w[row, block * nbytes : (block + 1) * nbytes].reshape(1, -1)
    codes = R.unpack_codes(raw, fmt)[0]
    elements = R.decode_element(codes, fmt)
    if bs.has_global_scale:
        s = sc[row, block].reshape(1)
        scale_byte = int(s.view(torch.uint8)[0])
        block_scale = float(s.float()[0])
        ws2 = float(read(name + "_scale_2").float().reshape(()))
        # vLLM's dequantize_to_dtype: e2m1 * (fp32(block_scale) * weight_scale_2), in fp32
        values = elements * (torch.tensor(block_scale, dtype=torch.float32) * torch.tensor(ws2, dtype=torch.float32))
    else:
        scale_byte = int(sc[row, block].view(torch.uint8))
        block_scale = float(R.decode_e8m0(torch.tensor([scale_byte], dtype=torch.uint8))[0])
        ws2 = None
        values = elements * block_scale
    tensors.close()
    return {
        "scheme": bs.name,
        "tensor": name,
        "row": row,
        "block": block,
        "bytes_hex": " ".join(f"{int(b):02X}" for b in raw[0]),
        "codes": [int(c) for c in codes],
        "elements": elements.tolist(),
        "scale_byte": scale_byte,
        "block_scale": block_scale,
        "weight_scale_2": ws2,
        "values": values.tolist(),
    }


class swapped_nibbles:
    """``with swapped_nibbles(model): ...`` runs ``model`` with every packed expert weight byte's two
    FP4 codes swapped (``b -> (b << 4 | b >> 4) & 0xFF``), then swaps them back (an involution).

    Notebook 01's negative control: a packing bug of the kind the loader cannot see (the shapes,
    dtypes and scales are all right) scrambles every expert's weights, and the metrics must say so.
    Acts on the ``w13_weight`` and ``w2_weight`` uint8 buffers of every module that has both (the
    emulation experts); for FP6 and FP8 weights the swap scrambles their bytes likewise. Yields the
    number of modules changed.

    Raises:
        ValueError: ``model`` has no such module (nothing to corrupt: the control would prove nothing).
    """

    def __init__(self, model) -> None:
        self.buffers = [
            t
            for m in model.modules()
            for t in (getattr(m, "w13_weight", None), getattr(m, "w2_weight", None))
            if isinstance(t, torch.Tensor) and t.dtype == torch.uint8
        ]
        if not self.buffers:
            raise ValueError("model: no module with uint8 w13_weight / w2_weight buffers (no quantized experts)")

    @staticmethod
    def _swap(t: torch.Tensor) -> None:
        t.copy_(((t << 4) | (t >> 4)) & 0xFF)

    def __enter__(self) -> int:
        for t in self.buffers:
            self._swap(t)
        return len(self.buffers) // 2

    def __exit__(self, *exc) -> None:
        for t in self.buffers:
            self._swap(t)


class captured_output:
    """``with captured_output(module) as outs: ...`` appends each output of ``module`` (its first
    element when it returns a tuple) to the list ``outs``, detached, as fp32 on the CPU; the hook is
    removed on exit."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.outputs: list[torch.Tensor] = []
        self.handle = None

    def _hook(self, module, args, output) -> None:
        out = output[0] if isinstance(output, (tuple, list)) else output
        self.outputs.append(out.detach().float().cpu().clone())

    def __enter__(self) -> list[torch.Tensor]:
        self.handle = self.module.register_forward_hook(self._hook)
        return self.outputs

    def __exit__(self, *exc) -> None:
        self.handle.remove()
