"""Benchmarks on a CUDA GPU: ``python -m mxlib.bench quant`` and ``python -m mxlib.bench moe``.

``quant``: achieved bandwidth of every quantize / dequantize / QDQ kernel (bytes read +
written over the median time of ``triton.testing.do_bench``) at 256 MB of bf16 input and
more, beside a device-to-device copy measured in the same run.

``moe``: see ``mxlib.bench_moe``.

Both print a table and can write JSON (``--json PATH``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

__all__ = ["copy_bandwidth", "bench_quant"]


def _env() -> dict:
    import triton

    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }


def _median_ms(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy, bytes read + written per second (GB/s)."""
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    ms = _median_ms(lambda: b.copy_(a))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def bench_quant(rows: int = 65536, k: int = 2048) -> dict:
    """Bandwidth table of the Triton quantization kernels on ``[rows, k]`` bf16 (256 MB default)."""
    from . import kernels as K
    from .formats import ELEMENT_FORMATS

    copy_gbs = copy_bandwidth()
    x = (torch.randn(rows, k, device="cuda") * torch.exp(torch.randn(rows, 1, device="cuda"))).to(torch.bfloat16)
    n = x.numel()
    results = []

    def add(name, fmt, fn, read, written):
        fn()
        ms = _median_ms(fn)
        gbs = (read + written) / (ms * 1e-3) / 1e9
        results.append(dict(kernel=name, format=fmt, elements=n, mbytes=(read + written) / 1e6, ms=ms,
                            gbs=gbs, frac_copy=gbs / copy_gbs))

    for el in ("e2m1", "e2m3", "e3m2", "e4m3", "e5m2"):
        f = ELEMENT_FORMATS[el]
        packed_bytes = n * f.nbits // 8
        scale_bytes = n // 32
        add("quant_dequant_mx", el, lambda: K.quant_dequant_mx(x, el), 2 * n, 2 * n)
        add("quantize_mx", el, lambda: K.quantize_mx(x, el), 2 * n, packed_bytes + scale_bytes)
        p, s = K.quantize_mx(x, el)
        add("dequantize_mx", el, lambda: K.dequantize_mx(p, s, el, 32, torch.bfloat16), packed_bytes + scale_bytes, 2 * n)
    gs = torch.tensor([2688.0 / float(x.float().abs().amax())], device="cuda")
    add("nvfp4_quant_dequant", "nvfp4", lambda: K.ref_nvfp4_quant_dequant(x, gs), 2 * n, 2 * n)
    w = x.reshape(128, -1, k)
    p, s, g = K.quantize_nvfp4(w)
    add("quantize_nvfp4", "nvfp4", lambda: K.quantize_nvfp4(w, g), 2 * n, n // 2 + n // 16)
    add("dequantize_to_dtype", "nvfp4", lambda: K.dequantize_to_dtype(p, s, g, torch.bfloat16), n // 2 + n // 16, 2 * n)
    sc = torch.tensor(0.01, device="cuda")
    add("quant_dequant_fp8_per_tensor", "e4m3", lambda: K.quant_dequant_fp8_per_tensor(x, sc), 2 * n, 2 * n)
    return {"env": _env(), "copy_gbs": copy_gbs, "shape": [rows, k], "results": results}


def sweep_quant(rows: int = 65536, k: int = 2048) -> list[dict]:
    """Tile size / warps sweep of the elementwise kernels (QDQ, dequantize)."""
    from . import kernels as K
    from .kernels import quant as Q

    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    p, s = K.quantize_mx(x, "e2m1")
    pn, sn, gn = K.quantize_nvfp4(x.reshape(128, -1, k))
    gs = torch.tensor([100.0], device="cuda")
    out = []
    saved = (Q.TILE_ELEMENTS, Q.NUM_WARPS, Q.MAX_BLOCK_K)
    for tile in (4096, 8192, 16384):
        for warps in (4, 8):
            for max_bk in (512, 1024):
                if max_bk > tile:
                    continue
                Q.TILE_ELEMENTS, Q.NUM_WARPS, Q.MAX_BLOCK_K = tile, warps, max_bk
                r = dict(tile=tile, warps=warps, max_block_k=max_bk,
                         qdq_mx=_median_ms(lambda: K.quant_dequant_mx(x, "e2m1")),
                         qdq_nvfp4=_median_ms(lambda: K.ref_nvfp4_quant_dequant(x, gs)),
                         deq_mx=_median_ms(lambda: K.dequantize_mx(p, s, "e2m1")),
                         deq_nvfp4=_median_ms(lambda: K.dequantize_to_dtype(pn, sn, gn, torch.bfloat16)))
                out.append(r)
                print("[sweep] " + " ".join(f"{k_}={v:.4g}" if isinstance(v, float) else f"{k_}={v}" for k_, v in r.items()),
                      flush=True)
    Q.TILE_ELEMENTS, Q.NUM_WARPS, Q.MAX_BLOCK_K = saved
    return out


def _print_quant(res: dict) -> None:
    e = res["env"]
    print(f"# {e['device']}  torch {e['torch']}  triton {e['triton']}  {e['date']}")
    print(f"# copy bandwidth (read + write): {res['copy_gbs']:.0f} GB/s; input bf16 {res['shape']}")
    print(f"{'kernel':30s} {'format':6s} {'MB moved':>9s} {'ms':>8s} {'GB/s':>7s} {'of copy':>8s}")
    for r in res["results"]:
        print(f"{r['kernel']:30s} {r['format']:6s} {r['mbytes']:9.0f} {r['ms']:8.3f} {r['gbs']:7.0f} {r['frac_copy']:8.1%}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["quant", "moe"])
    ap.add_argument("--json", default=None)
    ap.add_argument("--sweep", action="store_true", help="quant: sweep tile sizes and warps first")
    args, rest = ap.parse_known_args(argv)
    if not torch.cuda.is_available():
        print("mxlib.bench needs a CUDA GPU (the numbers in README were measured on an H200).")
        return 2
    if args.what == "quant":
        sweep = sweep_quant() if args.sweep else None
        res = bench_quant()
        res["sweep"] = sweep
        _print_quant(res)
    else:
        from .bench_moe import main as moe_main

        return moe_main(rest + (["--sweep"] if args.sweep else []), json_path=args.json)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
