"""Tile sweep and per-kernel profile of the fused FP4 kernel on the external-kernel harness's layer.

``python -m mxlib.bench.sweep [--tokens 16,64,256,1024,4096] [--schemes w_mxfp4,nvfp4] [--json PATH]``

For every M and scheme, the layer (``mxlib.bench.fused``'s inputs: the harness recipe) runs with each
candidate pair of (GEMM1, GEMM2) tiles of ``candidates(m)`` in place of the tile table's choice
(``mxlib.kernels.fp4_tiles.get_fp4_configs``), timed as CUDA-graph replay medians; each output is compared
with the table's (``same``: bit-identical; tiles change which programs compute which rows and columns,
not the order of any sum, so every entry should be). The best entry per (scheme, M) is what a tile table
could reach without a change of the kernel. ``--profile`` adds the torch profiler's per-kernel CUDA time
of one replayed forward per (scheme, M): where a forward's time goes (alignment, a1 QDQ, GEMM1, GEMM2,
the sum over top-k).
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import contextmanager

import torch

from ..kernels.tiles import TileConfig
from . import fused
from ._common import capture, copy_bandwidth, env, graph_ms

__all__ = ["candidates", "run", "main"]

TOKENS = [16, 64, 256, 1024, 4096]
SCHEMES = ("w_mxfp4", "nvfp4")


def candidates(m: int, top_k: int = 8, num_experts: int = 128) -> list[tuple[TileConfig, TileConfig]]:
    """Tile pairs worth timing at ``m`` tokens (GEMM1 and GEMM2 the same tile): at most 4 pairs per expert
    on average, 16-row blocks with narrow to wide columns and deeper pipelines; at most 16, 16- and 32-row
    blocks; more, 64- and 128-row blocks up to 256 columns with 4 or 8 warps."""
    pairs = m * top_k / num_experts
    if pairs <= 4:
        shapes = [(16, bn, 1, w, s) for bn in (32, 64, 128) for w, s in ((4, 3), (4, 5), (8, 3))]
    elif pairs <= 16:
        shapes = [(bm, bn, 4, w, s) for bm in (16, 32) for bn in (64, 128) for w, s in ((4, 3), (4, 4), (8, 3))]
    else:
        shapes = [
            (bm, bn, 4, w, s)
            for bm in (64, 128)
            for bn in (64, 128, 256)
            for w, s in ((4, 3), (8, 3), (8, 4))
            if not (bn == 256 and (w == 4 or bm == 128 and s == 4))
        ]
    return [(TileConfig(bm, bn, None, g, w, s),) * 2 for bm, bn, g, w, s in shapes]


@contextmanager
def _tiles(experts, pair):
    """The experts' FP4 tiles fixed to ``pair`` (their ``fp4_config``; None: the tile table's choice)."""
    experts.fp4_config = pair
    try:
        yield
    finally:
        experts.fp4_config = None


def _profile(fn) -> dict:
    g, _ = capture(fn)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            g.replay()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t:
            out[ev.key[:80]] = round(t / 20 / 1e3, 5)  # ms per forward
    del g
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def run(tokens, schemes=SCHEMES, profile: bool = False, log=print, json_path=None) -> dict:
    """``{"env", "copy_gbs", "entries", "best", "profile", "errors"}``; see the module docstring.
    With ``json_path`` the result so far is written there after every M (a run cut short keeps it)."""
    result = {"env": env(), "copy_gbs": copy_bandwidth(), "entries": [], "best": {}, "profile": {}, "errors": []}
    w13, w2, x_cal = fused.harness_layer()
    paths = {
        k: v for k, v in fused.build(w13, w2, x_cal, extra=False).items() if k.removeprefix("mxlib_fused_") in schemes
    }
    t0 = time.time()
    for m in tokens:
        x, tw, ti = fused.harness_tokens(m)
        for path, ex in paths.items():
            ref = ex(x, tw, ti).clone()
            table_ms = graph_ms(lambda ex=ex: ex(x, tw, ti))
            best = dict(ms=table_ms, tiles="table")
            if profile:
                result["profile"][f"{path} M={m}"] = _profile(lambda ex=ex: ex(x, tw, ti))
            for pair in candidates(m):
                label = "{0.block_m}x{0.block_n} g{0.group_m} w{0.num_warps} s{0.num_stages}".format(pair[0])
                try:
                    with _tiles(ex, pair):
                        out = ex(x, tw, ti)
                        ms = graph_ms(lambda ex=ex: ex(x, tw, ti))
                except Exception as exc:  # noqa: BLE001 - a tile that does not fit is a result, not a failure
                    result["errors"].append(f"{path} M={m} {label}: {type(exc).__name__}: {str(exc)[:200]}")
                    continue
                same = bool(torch.equal(out, ref))
                result["entries"].append(dict(path=path, M=m, tiles=label, graph_ms=ms, table_ms=table_ms, same=same))
                if same and ms < best["ms"]:
                    best = dict(ms=ms, tiles=label)
            result["best"][f"{path} M={m}"] = dict(table_ms=table_ms, **best)
            took = time.time() - t0
            log(f"{path} M={m} ({took:.0f}s): table {table_ms:.4f} ms, best {best['ms']:.4f} ({best['tiles']})")
        if json_path:
            with open(json_path, "w") as f:
                json.dump(result, f, indent=1)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mxlib.bench.sweep", description=__doc__)
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("mxlib.bench.sweep needs a CUDA GPU")
        return 2
    run([int(t) for t in args.tokens.split(",")], tuple(args.schemes.split(",")), args.profile, json_path=args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
