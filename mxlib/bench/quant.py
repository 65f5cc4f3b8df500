"""``python -m mxlib.bench quant``: achieved bandwidth of every quantize / dequantize / QDQ kernel.

Bytes read + written over the median time of ``triton.testing.do_bench``, at 256 MB of bf16
input, beside a device-to-device copy measured in the same run. ``--sweep`` first tries
tile sizes and warps of the elementwise kernels.
"""

from __future__ import annotations

import torch

from .. import kernels as K
from .._checks import check_global_scale
from ..formats import ELEMENT_FORMATS, MX_BLOCK_SIZE, NVFP4, NVFP4_SCALE_DIVISOR
from ..kernels import _bridge
from ..text_table import text_table
from ._common import copy_bandwidth, env, median_ms

__all__ = ["copy_bandwidth", "bench_quant", "sweep_quant", "print_quant"]

_median_ms = median_ms


def bench_quant(rows: int = 65536, k: int = 2048) -> dict:
    """Bandwidth table of the Triton quantization kernels on ``[rows, k]`` bf16 (256 MB default)."""
    copy_gbs = copy_bandwidth()
    x = (torch.randn(rows, k, device="cuda") * torch.exp(torch.randn(rows, 1, device="cuda"))).to(torch.bfloat16)
    n = x.numel()
    results = []

    def add(name, fmt, fn, read, written):
        fn()
        ms = _median_ms(fn)
        gbs = (read + written) / (ms * 1e-3) / 1e9
        results.append(
            dict(
                kernel=name,
                format=fmt,
                elements=n,
                mbytes=(read + written) / 1e6,
                ms=ms,
                gbs=gbs,
                frac_copy=gbs / copy_gbs,
            )
        )

    for el, f in ELEMENT_FORMATS.items():
        packed_bytes = n * f.nbits // 8
        scale_bytes = n // MX_BLOCK_SIZE
        add("quant_dequant_mx", el, lambda: K.quant_dequant_mx(x, el), 2 * n, 2 * n)
        add("quantize_mx", el, lambda: K.quantize_mx(x, el), 2 * n, packed_bytes + scale_bytes)
        p, s = K.quantize_mx(x, el)
        add(
            "dequantize_mx",
            el,
            lambda: K.dequantize_mx(p, s, el, MX_BLOCK_SIZE, torch.bfloat16),
            packed_bytes + scale_bytes,
            2 * n,
        )
    # the scales are checked once here; the timed calls skip the check (a host sync each call)
    gs = torch.tensor([NVFP4_SCALE_DIVISOR / float(x.float().abs().amax())], device="cuda")
    check_global_scale(gs, "gs")
    add("nvfp4_quant_dequant", "nvfp4", lambda: K.ref_nvfp4_quant_dequant(x, gs, check_scale=False), 2 * n, 2 * n)
    w = x.reshape(128, -1, k)
    p, s, g = K.quantize_nvfp4(w)
    add("quantize_nvfp4", "nvfp4", lambda: K.quantize_nvfp4(w, g), 2 * n, n // 2 + n // NVFP4.block_size)
    add(
        "dequantize_to_dtype",
        "nvfp4",
        lambda: K.dequantize_to_dtype(p, s, g, torch.bfloat16, check_scale=False),
        n // 2 + n // NVFP4.block_size,
        2 * n,
    )
    sc = torch.tensor(0.01, device="cuda")
    check_global_scale(sc, "sc", what="input_scale")
    add(
        "quant_dequant_fp8_per_tensor",
        "e4m3",
        lambda: K.quant_dequant_fp8_per_tensor(x, sc, check_scale=False),
        2 * n,
        2 * n,
    )
    return {"env": env(), "copy_gbs": copy_gbs, "shape": [rows, k], "results": results}


def sweep_quant(rows: int = 65536, k: int = 2048) -> list[dict]:
    """Tile size / warps sweep of the elementwise kernels (QDQ, dequantize)."""
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    p, s = K.quantize_mx(x, "e2m1")
    pn, sn, gn = K.quantize_nvfp4(x.reshape(128, -1, k))
    gs = torch.tensor([100.0], device="cuda")
    check_global_scale(gs, "gs")  # once; the timed calls skip it
    out = []
    saved = (_bridge.TILE_ELEMENTS, _bridge.NUM_WARPS, _bridge.MAX_BLOCK_K)
    for tile in (4096, 8192, 16384):
        for warps in (4, 8):
            for max_bk in (512, 1024):
                if max_bk > tile:
                    continue
                _bridge.TILE_ELEMENTS, _bridge.NUM_WARPS, _bridge.MAX_BLOCK_K = tile, warps, max_bk
                r = dict(
                    tile=tile,
                    warps=warps,
                    max_block_k=max_bk,
                    qdq_mx=_median_ms(lambda: K.quant_dequant_mx(x, "e2m1")),
                    qdq_nvfp4=_median_ms(lambda: K.ref_nvfp4_quant_dequant(x, gs, check_scale=False)),
                    deq_mx=_median_ms(lambda: K.dequantize_mx(p, s, "e2m1")),
                    deq_nvfp4=_median_ms(lambda: K.dequantize_to_dtype(pn, sn, gn, torch.bfloat16, check_scale=False)),
                )
                out.append(r)
                print(
                    "[sweep] "
                    + " ".join(f"{k_}={v:.4g}" if isinstance(v, float) else f"{k_}={v}" for k_, v in r.items()),
                    flush=True,
                )
    _bridge.TILE_ELEMENTS, _bridge.NUM_WARPS, _bridge.MAX_BLOCK_K = saved
    return out


def print_quant(res: dict) -> None:
    e = res["env"]
    print(f"# {e['device']}  torch {e['torch']}  triton {e['triton']}  {e['date']}")
    print(f"# copy bandwidth (read + write): {res['copy_gbs']:.0f} GB/s; input bf16 {res['shape']}")
    cells = [
        (r["kernel"], r["format"], f"{r['mbytes']:.0f}", f"{r['ms']:.3f}", f"{r['gbs']:.0f}", f"{r['frac_copy']:.1%}")
        for r in res["results"]
    ]
    header = ("kernel", "format", "MB moved", "ms", "GB/s", "of copy")
    for line in text_table(header, cells, widths=(30, 6, 9, 8, 7, 8), align="<<>>>>", grow=False):
        print(line)
