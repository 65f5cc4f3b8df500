"""The producers reading checkpoints written by mxlib.

Two steps, in two environments::

    # 1. mxlib writes the checkpoints (an environment with mxlib and transformers)
    PYTHONPATH=$PWD python tools/interop/mxlib_roundtrip.py write tests/fixtures/interop
    # 2. each tool reads them with its own loader (that tool's venv, tools/interop/README.md)
    /work/venvs/llmc/bin/python  tools/interop/mxlib_roundtrip.py read llmc  tests/fixtures/interop
    /work/venvs/quark/bin/python tools/interop/mxlib_roundtrip.py read quark tests/fixtures/interop

Step 1 writes ``OUTDIR/mxlib_<layout>_<scheme>/checkpoint/`` (``write_quantized_checkpoint`` of the
tiny seeded Qwen3-MoE of ``_common.py`` with one layer, attention bf16) and ``weights.safetensors``
(layer 0 expert 0's bf16 weights, ``weight.<module>``). Step 2 adds ``tool_read.safetensors``
(``dequant.<module>``: the tool's dequantization of layer 0 experts 0 and 5 as its loader reads
them) and ``meta.json`` (the tool's versions, the functions used). compressed-tensors: its
``QuantizationConfig`` parses ``quantization_config`` and the compressor registered for each
group's format decompresses each module with that group's scheme. Quark: ``import_model_from_safetensors``
and each rebuilt ``QParamsLinear``'s weight quantizer on its packed weight. ModelOpt has no reader of
its HF exports, so no ModelOpt checkpoint is read back.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# (tool, mxlib layout, mxlib scheme)
CHECKPOINTS = (
    ("llmc", "compressed-tensors-mxfp4", "w_mxfp4_a_mxfp4"),
    ("llmc", "compressed-tensors-mxfp8", "w_mxfp8_a_mxfp8"),
    ("quark", "quark", "w_mxfp4_a_mxfp8"),
)
READ_EXPERTS = (0, 5)


def _dirname(layout: str, scheme: str) -> str:
    return f"mxlib_{layout}_{scheme}"


def write(outdir: Path) -> None:
    import _common as C
    import torch
    from safetensors.torch import save_file

    from mxlib.checkpoints import write_quantized_checkpoint

    for _, layout, scheme in CHECKPOINTS:
        folder = C.fresh_dir(outdir / _dirname(layout, scheme))
        model = C.build_model(num_hidden_layers=1)
        write_quantized_checkpoint(model, scheme, folder / "checkpoint", layout=layout)
        w = {f"weight.model.layers.0.mlp.experts.0.{p}": t for p, t in C.expert_weights(model, 0, 0).items()}
        save_file({k: v.contiguous() for k, v in w.items()}, str(folder / "weights.safetensors"))
        print(folder, torch.__version__)


def _read_llmc(ckpt: Path) -> tuple[dict, dict]:
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors import safe_open

    qc = json.loads((ckpt / "config.json").read_text())["quantization_config"]
    config = QuantizationConfig.model_validate(qc)  # compressed-tensors' own parse of mxlib's config
    (group,) = config.config_groups.values()
    fmt = group.format or config.format
    compressor = BaseCompressor.get_value_from_registry(fmt)
    tensors = {}
    for path in sorted(ckpt.glob("*.safetensors")):  # mxlib writes shards and an index
        with safe_open(str(path), "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    out = {}
    for e in READ_EXPERTS:
        for p in ("gate_proj", "up_proj", "down_proj"):
            name = f"model.layers.0.mlp.experts.{e}.{p}"
            sd = {k.rsplit(".", 1)[-1]: t for k, t in tensors.items() if k.rsplit(".", 1)[0] == name}
            out[f"dequant.{name}"] = compressor.decompress(sd, group)["weight"]
    return out, {
        "function": f"QuantizationConfig.model_validate(quantization_config); {compressor.__module__}."
        f"{compressor.__qualname__}.decompress(module tensors, config_groups.group_0)",
        "format": fmt,
    }


def _read_quark(ckpt: Path) -> tuple[dict, dict]:
    """Quark's importer on mxlib's checkpoint as written; the modules it rebuilt quantized are recorded
    (``quantized_modules``: the experts only, the bf16 modules of ``exclude`` left ``nn.Linear``)."""
    import torch
    from quark.torch import import_model_from_safetensors

    model = import_model_from_safetensors(None, str(ckpt), device="cpu")
    modules = dict(model.named_modules())
    quantized = sorted(n for n, m in modules.items() if getattr(m, "weight_quantizer", None) is not None)
    info = {
        "function": "quark.torch.import_model_from_safetensors, then each QParamsLinear's weight_quantizer",
        "exclude_as_read": json.loads((ckpt / "config.json").read_text())["quantization_config"]["exclude"],
        "quantized_modules": quantized,
    }
    out = {}
    with torch.no_grad():
        for e in READ_EXPERTS:
            for p in ("gate_proj", "up_proj", "down_proj"):
                name = f"model.layers.0.mlp.experts.{e}.{p}"
                mod = modules[name]
                assert mod.weight.dtype == torch.uint8, f"{name}: Quark rebuilt {mod.weight.dtype}, not packed"
                out[f"dequant.{name}"] = mod.weight_quantizer(mod.weight.data)
    return out, info


def read(tool: str, outdir: Path) -> None:
    import _common as C
    from safetensors.torch import save_file

    packages = {"llmc": ["llmcompressor", "compressed-tensors"], "quark": ["amd-quark"]}[tool]
    reader = {"llmc": _read_llmc, "quark": _read_quark}[tool]
    for t, layout, scheme in CHECKPOINTS:
        if t != tool:
            continue
        folder = outdir / _dirname(layout, scheme)
        tensors, info = reader(folder / "checkpoint")
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "tool_read.safetensors"))
        meta = {
            "tool": {"llmc": "llmcompressor", "quark": "amd-quark"}[tool],
            "layout": layout,
            "scheme": scheme,
            "written_by": "mxlib.checkpoints.write_quantized_checkpoint(model, scheme, path, layout=layout) "
            "(tools/interop/mxlib_roundtrip.py write)",
            "versions": C.versions(packages),
            **info,
        }
        meta["result_tensors"] = {k: [str(v.dtype).replace("torch.", ""), list(v.shape)] for k, v in tensors.items()}
        (folder / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        print(folder)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="step", required=True)
    w = sub.add_parser("write")
    w.add_argument("outdir", type=Path)
    r = sub.add_parser("read")
    r.add_argument("tool", choices=("llmc", "quark"))
    r.add_argument("outdir", type=Path)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if args.step == "write":
        write(args.outdir)
    else:
        read(args.tool, args.outdir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
