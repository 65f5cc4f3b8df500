"""Benchmarks on a CUDA GPU: ``python -m mxlib.bench quant`` and ``python -m mxlib.bench moe``.

``quant`` (``mxlib.bench.quant``): achieved bandwidth of every quantize / dequantize / QDQ
kernel beside a device-to-device copy measured in the same run.

``moe`` (``mxlib.bench.moe``): one Qwen3-30B-A3B MoE layer, bf16 vs dequantize-then-GEMM vs fused
emulation (and, with ``--model``, whole-model forwards). ``moe --external HARNESS.json`` (or ``fused``)
runs ``mxlib.bench.fused`` instead: the same layer on the external-kernel harness's inputs, CUDA-graph replay
times, ratios to the external rows, fractions of the bandwidth bound and the speed targets
(``mxlib.bench.fused.speed_targets``).

``model`` (``mxlib.bench.model``): the whole dummy Qwen3-30B-A3B forward (48 layers) at decode-sized
and prefill M, bf16 vs each emulation path, eager and as one CUDA graph (``--device cpu`` runs a small
preset eagerly, for tests).

``per_token`` (``python -m mxlib.bench.per_token``): the FP4 kernel's layer with per-token NVFP4
activation scales beside static ones, and the per-row passes alone.

``rotation`` (``python -m mxlib.bench.rotation``): what the online block Hadamard rotation costs on the GPU and
what it does to the error. ``sweep`` (``python -m mxlib.bench.sweep``): the tile sweep and per-kernel profile of
the fused FP4 kernel on the external-kernel harness's layer.

All print a table and can write JSON (``--json PATH``). ``_common`` holds what they share.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from . import fused, model, moe, quant
from ._common import copy_bandwidth
from .quant import bench_quant, print_quant, sweep_quant

__all__ = ["main", "copy_bandwidth", "bench_quant", "sweep_quant", "fused", "model", "moe", "quant"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["quant", "moe", "fused", "model"])
    ap.add_argument("--json", default=None)
    ap.add_argument("--sweep", action="store_true", help="quant: sweep tile sizes and warps first")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["model"]:  # its own options and --help; also runs on the CPU (--device cpu)
        return model.main(argv[1:])
    args, rest = ap.parse_known_args(argv)
    if args.what == "model":  # options before the subcommand (``--json PATH model ...``)
        return model.main(rest, json_path=args.json)
    if not torch.cuda.is_available():
        print("mxlib.bench needs a CUDA GPU (the numbers in README were measured on an H200).")
        return 2
    if args.what == "fused" or (args.what == "moe" and any(a.startswith("--external") for a in rest)):
        return fused.main(rest, json_path=args.json)
    if args.what == "moe":
        return moe.main(rest + (["--sweep"] if args.sweep else []), json_path=args.json)
    sweep = sweep_quant() if args.sweep else None
    res = bench_quant()
    res["sweep"] = sweep
    print_quant(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0
