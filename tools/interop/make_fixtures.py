"""Make the interop fixtures with the real quantization tools.

Run each producer with its own virtual environment (see tools/interop/README.md)::

    /work/venvs/modelopt/bin/python tools/interop/make_fixtures.py modelopt tests/fixtures/interop
    /work/venvs/quark/bin/python    tools/interop/make_fixtures.py quark    tests/fixtures/interop
    /work/venvs/llmc/bin/python     tools/interop/make_fixtures.py llmc     tests/fixtures/interop

Each writes ``OUTDIR/<tool>_<scheme>/`` holding ``checkpoint/`` (the tool's export of the
tiny seeded Qwen3-MoE of ``_common.py``), ``tool_results.safetensors`` (the tool's own
dequantized expert weights, activation QDQ, fake-quantized logits where it can run them on
the CPU, and the bf16 logits) and ``meta.json`` (versions, seeds, the command, notes).
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
from pathlib import Path

TOOLS = ("modelopt", "quark", "llmc")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("tool", choices=TOOLS)
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--only", nargs="*", default=None, help="scheme names to make (default: all of the tool's)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    mod = importlib.import_module(f"_{args.tool}")
    schemes = [s for s in mod.SCHEMES if args.only is None or s in args.only]
    if len(schemes) == 1:
        print(mod.make_one(args.outdir, schemes[0]))
        return 0
    # one process per scheme: the tools patch transformers' classes in place when they quantize
    rc = 0
    for s in schemes:
        rc |= subprocess.run([sys.executable, __file__, args.tool, str(args.outdir), "--only", s]).returncode
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
