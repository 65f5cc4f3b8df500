"""Test set-up: run Triton kernels in the interpreter when there is no GPU.

``TRITON_INTERPRET`` must be set before any kernel module is imported, so it is
set here, at collection time. On a CUDA machine the kernels are compiled and the
tests run on ``cuda``.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device() -> str:
    return DEVICE
