"""Every Triton kernel compiles for Hopper (sm_90), here, without a GPU.

Triton's compiler (front end, LLVM, ptxas) runs on the CPU; compiling for
``GPUTarget("cuda", 90, 32)`` catches what the interpreter never sees (non-constexpr
globals, ops the GPU backend rejects, type errors) and checks that the fused-MoE GEMM
uses Hopper's warpgroup MMA. Run-time behaviour of the compiled kernels is tested on
the H200 by the same kernel test files with a CUDA device.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("compile_sm90.py")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "kernel groups compiled for sm_90" in proc.stdout


if torch.cuda.is_available():  # the GPU runs the kernels for real; compiling twice adds nothing
    test_every_kernel_compiles_for_sm90.__test__ = False
