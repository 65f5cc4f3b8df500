"""Triton is an optional dependency: with its import blocked (a meta-path finder refusing ``triton``), ``import mxlib``,
the reference functions, the experts' CPU forward, ``quantize_`` and ``from_pretrained`` run, and launching a
kernel raises an ``ImportError`` naming the ``triton`` extra. Run in a subprocess, so this process's triton stays."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CODE = r"""
import importlib.abc, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError(f"blocked: {name}")

sys.meta_path.insert(0, Block())
import warnings
warnings.simplefilter("ignore")
import torch
import mxlib

w13 = torch.randn(4, 64, 64, dtype=torch.bfloat16) * 0.05
w2 = torch.randn(4, 64, 32, dtype=torch.bfloat16) * 0.05
experts = mxlib.make_emulation_experts("MXFP4", mxlib.quantize_expert_weights(w13, w2, "MXFP4"))
x = torch.randn(8, 64, dtype=torch.bfloat16)
ids = torch.randint(0, 4, (8, 2), dtype=torch.int32)
out = experts(x, torch.full((8, 2), 0.5), ids)
assert out.shape == (8, 64) and bool(torch.isfinite(out).all())
packed, scale = mxlib.quantize_mx(x, "e2m1")
try:
    mxlib.kernels.quantize_mx(x, "e2m1")
    raise SystemExit("a kernel launched without triton")
except ImportError as err:
    assert 'mxlib[triton]' in str(err), err
model = mxlib.from_pretrained(sys.argv[1])
assert torch.isfinite(model(input_ids=torch.tensor([[1, 2, 3]])).logits).all()
assert "triton" not in sys.modules
print("ok")
"""


def test_cpu_path_runs_without_triton():
    fixture = ROOT / "tests" / "fixtures" / "interop" / "llmc_nvfp4" / "checkpoint"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run(
        [sys.executable, "-c", CODE, str(fixture)], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
