"""What both benchmarks share: the environment record, CUDA-event timing and copy bandwidth."""

from __future__ import annotations

import time

import torch
import triton

__all__ = ["env", "median_ms", "capture", "graph_ms", "copy_bandwidth"]


def env() -> dict:
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }


def median_ms(fn, warmup: int = 25, rep: int = 200) -> float:
    """Median time of ``fn`` in ms (``triton.testing.do_bench``: CUDA events, warm-up)."""
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy, bytes read + written per second (GB/s)."""
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    ms = median_ms(lambda: b.copy_(a))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def capture(fn, pool=None):
    """``(graph, out)``: ``fn`` run twice on a side stream (warm-up), then captured in a CUDA graph (into
    memory pool ``pool`` if given); ``out`` is its static output, rewritten by each replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        out = fn()
    return g, out


def graph_ms(fn, rep: int = 50) -> float:
    """Median replay time (ms) of ``fn`` captured in a CUDA graph after two warm-up runs on a side stream."""
    g, _ = capture(fn)
    ms = median_ms(g.replay, warmup=10, rep=rep)
    del g
    return ms
