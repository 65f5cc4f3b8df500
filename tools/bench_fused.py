"""CUDA-graph replay timings of mxlib's MoE paths on one Qwen3-30B-A3B layer, beside the anchor harness.

Same input recipe as ``../shared/anchor_bench`` (README "Inputs"): weights N(0, 0.02) from generator seed
0 (w13 then w2, then a calibration batch), tokens and router logits from seed 1 + M, Qwen3 routing. Rows:

* ``mxlib_bf16``: ``TritonExperts`` as it is (torch alignment, its tile table);
* ``mxlib_bf16_tuned``: the same bf16 kernel with the Triton alignment and the best of a few tile
  candidates per M (``--sweep``; the winners are written to the JSON);
* ``fp4_<scheme>[_hw]``: ``fused_fp4_moe`` (w_mxfp4, w_mxfp4_a_mxfp4, nvfp4; ``_hw`` = hardware mode);
* ``fused_old_<scheme>``, ``triton_<scheme>``: the current fused (``fused_dequant_moe``) and seed-style
  paths through the experts classes, for FP4 and FP6 weights.

Timing: ``triton.testing.do_bench`` median (L2 flushed before each replay) of a CUDA graph of the whole
forward (routing outside), as the anchor harness does. Run:

    python tools/bench_fused.py out.json [--tokens 1,4,16] [--sweep]
"""

from __future__ import annotations

from dataclasses import replace

import argparse
import datetime
import json
import sys
import time
import traceback

import torch
import triton

from mxlib.kernels.fused_dequant_moe import ActivationQDQ
from mxlib.kernels import fused_fp4_moe as F
from mxlib.kernels.fused_moe import MoEGemmConfig, get_moe_config, invoke_fused_moe_kernel
from mxlib.kernels.moe_align_triton import moe_align_block_size_triton
from mxlib.moe import TritonExperts, fused_topk, get_moe_scheme, silu_and_mul
from mxlib.studies import emulation_experts, quantize_layer_weights

E, TOPK, H, I = 128, 8, 2048, 768
DEV = "cuda"
OUT: dict = {"env": {}, "rows": [], "checks": [], "tables": {}, "errors": []}


def log(*a):
    print(*a, flush=True)


def bench_ms(fn, rep=50) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")


def graph_ms(fn, rep=50) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    ms = bench_ms(g.replay, rep)
    del g
    return ms


def make_layer():
    g = torch.Generator(device=DEV).manual_seed(0)
    w13 = torch.empty(E, 2 * I, H, device=DEV, dtype=torch.bfloat16).normal_(0, 0.02, generator=g)
    w2 = torch.empty(E, H, I, device=DEV, dtype=torch.bfloat16).normal_(0, 0.02, generator=g)
    x_cal = torch.randn(4096, H, device=DEV, dtype=torch.bfloat16, generator=g)
    return w13, w2, x_cal


def make_tokens(m):
    g = torch.Generator(device=DEV).manual_seed(1 + m)
    x = torch.randn(m, H, device=DEV, dtype=torch.bfloat16, generator=g)
    logits = torch.randn(m, E, device=DEV, generator=g)
    tw, ti = fused_topk(logits, TOPK)
    return x, tw, ti


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def add(path, m, ms, **kw):
    OUT["rows"].append(dict(path=path, M=m, graph_ms=ms, **kw))


def bf16_tuned_forward(w13, w2, x, tw, ti, c1: MoEGemmConfig, c2: MoEGemmConfig):
    m = x.shape[0]
    s1, e1, p1 = moe_align_block_size_triton(ti, c1.BLOCK_SIZE_M, E)
    s2, e2, p2 = (s1, e1, p1) if c2.BLOCK_SIZE_M == c1.BLOCK_SIZE_M else moe_align_block_size_triton(ti, c2.BLOCK_SIZE_M, E)
    cache1 = torch.empty(m * TOPK, 2 * I, dtype=x.dtype, device=DEV)
    invoke_fused_moe_kernel(x, w13, cache1, tw, s1, e1, p1, False, TOPK, c1)
    cache2 = silu_and_mul(cache1)
    cache3 = torch.empty(m * TOPK, H, dtype=x.dtype, device=DEV)
    invoke_fused_moe_kernel(cache2, w2, cache3, tw, s2, e2, p2, True, 1, c2)
    return cache3.view(m, TOPK, H).float().sum(dim=1).to(x.dtype)


# bf16 TritonExperts tiles by M: the winners of the first H200 sweep (graph replay, 2026-11-30);
# proposed replacement for get_moe_config's table (mxlib/kernels/fused_moe.py)
BF16_SWEPT = {
    1: MoEGemmConfig(16, 64, 64, 1, 4, 5), 4: MoEGemmConfig(16, 128, 128, 1, 4, 3),
    16: MoEGemmConfig(16, 128, 128, 1, 4, 4), 64: MoEGemmConfig(16, 64, 128, 1, 4, 3),
    256: MoEGemmConfig(32, 256, 128, 16, 4, 2), 1024: MoEGemmConfig(128, 256, 64, 16, 8, 4),
    4096: MoEGemmConfig(128, 256, 64, 16, 8, 4),
}


def bf16_candidates(m, vllm_cfg, mini=False):
    per = m * TOPK / E
    if mini:
        return [BF16_SWEPT[min(BF16_SWEPT, key=lambda t: abs(t - m))]]
    cands = [get_moe_config(m, E, TOPK, 2 * I, H)]
    if vllm_cfg:
        key = min(vllm_cfg, key=lambda k: abs(int(k) - m))
        c = vllm_cfg[key]
        cands.append(MoEGemmConfig(c["BLOCK_SIZE_M"], c["BLOCK_SIZE_N"], c["BLOCK_SIZE_K"], c["GROUP_SIZE_M"],
                                   c["num_warps"], c["num_stages"]))
    if per <= 4:
        cands += [MoEGemmConfig(16, 64, 128, 1, 4, 3), MoEGemmConfig(16, 128, 128, 1, 4, 4)]
    elif per <= 64:
        cands += [MoEGemmConfig(32, 64, 128, 1, 4, 3), MoEGemmConfig(64, 128, 64, 1, 4, 3)]
    else:
        cands += [MoEGemmConfig(64, 128, 64, 8, 4, 4), MoEGemmConfig(128, 128, 64, 8, 8, 3)]
    seen, out = set(), []
    for c in cands:
        if c not in seen:
            seen.add(c)
            out.append(c)
    return out


def fp4_candidates(m, which):
    per = m * TOPK / E
    C = F.FP4Config
    if per <= 0.25:  # naive blocks, BLOCK_M 16
        c = [C(16, 32, 1, 4, 4), C(16, 64, 1, 4, 4), C(16, 128, 1, 4, 3), C(16, 64, 1, 4, 2)]
    elif per <= 16:
        c = [C(16, 32, 1, 4, 4), C(16, 64, 1, 4, 4), C(16, 128, 1, 4, 3), C(32, 64, 1, 4, 3)]
    elif per <= 64:
        c = [C(16, 64, 1, 4, 4), C(32, 64, 2, 4, 3), C(64, 64, 4, 4, 3, False), C(32, 128, 2, 4, 3)]
    else:
        c = [C(64, 64, 8, 4, 3, False), C(128, 64, 8, 8, 3, False), C(64, 128, 8, 8, 3, False),
             C(128, 128, 8, 8, 3, False)]
    if which == 2:
        c = [F.FP4Config(x.BLOCK_M, x.BLOCK_N, x.GROUP_SIZE_M, x.num_warps, x.num_stages, True) for x in c]
    return c


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tokens", default="1,4,16,64,256,1024,4096")
    ap.add_argument("--sweep", action="store_true", help="pick tiles per M from graph-replay timings")
    ap.add_argument("--vllm-config", default=None, help="vLLM's tuned H200 bf16 config JSON (a candidate only)")
    ap.add_argument("--fp6", action="store_true", help="also time the FP6-weight paths")
    ap.add_argument("--mini", action="store_true", help="small sweep: table tiles, scale words toggled, bytes decode")
    ap.add_argument("--old", action="store_true", help="also time the current fused and seed-style paths")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    vllm_cfg = json.load(open(args.vllm_config)) if args.vllm_config else None
    OUT["env"] = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                      date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), sweep=args.sweep)

    def dump():
        with open(args.out, "w") as f:
            json.dump(OUT, f, indent=1)

    t0 = time.time()
    w13, w2, x_cal = make_layer()
    bf16 = TritonExperts(w13, w2, backend="triton")
    a1_amax = float(x_cal.abs().amax())
    # a2 scale from GEMM1 of the calibration batch on the first experts (any positive scale times the same)
    h_cal = x_cal[:512].float() @ w13[0].float().T
    a2_amax = float(silu_and_mul(h_cal.to(torch.bfloat16)).abs().amax())
    in13 = torch.full((E,), a1_amax / 2688.0, device=DEV)
    in2 = torch.full((E,), a2_amax / 2688.0, device=DEV)
    schemes = {}
    for name in ("w_mxfp4", "w_mxfp4_a_mxfp4", "nvfp4"):
        s = get_moe_scheme(name)
        q = quantize_layer_weights(w13, w2, s.weight)
        ex = emulation_experts(name, q, in13, in2, backend="fused")
        if name == "nvfp4":
            pw13 = F.prepare_fp4_weights(ex.w13_weight, ex.w13_weight_scale, 16, ex.w13_weight_scale_2)
            pw2 = F.prepare_fp4_weights(ex.w2_weight, ex.w2_weight_scale, 16, ex.w2_weight_scale_2)
            q1 = ActivationQDQ(kind=2, block_size=16, scale=ex.a13_gscale.reshape(-1)[:1].contiguous())
            q2 = ActivationQDQ(kind=2, block_size=16, scale=ex.a2_gscale.reshape(-1)[:1].contiguous())
        else:
            pw13 = F.prepare_fp4_weights(ex.w13_weight, ex.w13_weight_scale, 32)
            pw2 = F.prepare_fp4_weights(ex.w2_weight, ex.w2_weight_scale, 32)
            q1 = q2 = ActivationQDQ(kind=1, block_size=32) if s.activation else None
        schemes[name] = (ex, pw13, pw2, q1, q2)
    if args.fp6:
        for name in ("w_mxfp6_e3m2",):
            s = get_moe_scheme(name)
            schemes[name] = (emulation_experts(name, quantize_layer_weights(w13, w2, s.weight), backend="fused"),)
    log(f"setup {time.time() - t0:.1f}s")
    tables = {"fp4": {}, "bf16": {}}

    for m in tokens:
        x, tw, ti = make_tokens(m)
        hit = int(torch.unique(ti).numel())
        try:
            add("mxlib_bf16", m, graph_ms(lambda: bf16(x, tw, ti)), experts_hit=hit)
            cands = bf16_candidates(m, vllm_cfg, args.mini) if (args.sweep or args.mini) else \
                bf16_candidates(m, vllm_cfg)[:1]
            best = None
            for c in cands:
                ms = graph_ms(lambda: bf16_tuned_forward(w13, w2, x, tw, ti, c, c), rep=25)
                OUT["checks"].append(dict(kind="bf16_candidate", M=m, cfg=c.__dict__, graph_ms=ms))
                if best is None or ms < best[0]:
                    best = (ms, c)
            c = best[1]
            tables["bf16"][m] = c.__dict__
            add("mxlib_bf16_tuned", m, graph_ms(lambda: bf16_tuned_forward(w13, w2, x, tw, ti, c, c)), experts_hit=hit,
                cfg=c.__dict__)
        except Exception as exc:  # noqa: BLE001
            OUT["errors"].append(f"bf16 M={m}: {exc!r}")
            traceback.print_exc()
        # FP4 tiles: sweep on nvfp4 seed (the heaviest decode), GEMM1 then GEMM2
        ex, pw13, pw2, q1, q2 = schemes["nvfp4"]
        cfg = F.get_fp4_configs(m, E, TOPK)
        if args.sweep:
            try:
                for which in (1, 2):
                    best = None
                    for c in fp4_candidates(m, which):
                        pair = (c, cfg[1]) if which == 1 else (cfg[0], c)
                        ms = graph_ms(lambda: F.fused_fp4_moe(x, pw13, pw2, tw, ti, q1, q2, configs=pair), rep=25)
                        OUT["checks"].append(dict(kind=f"fp4_gemm{which}_candidate", M=m, cfg=c.__dict__, graph_ms=ms))
                        if best is None or ms < best[0]:
                            best = (ms, pair)
                    cfg = best[1]
            except Exception as exc:  # noqa: BLE001
                OUT["errors"].append(f"fp4 sweep M={m}: {exc!r}")
                traceback.print_exc()
                cfg = F.get_fp4_configs(m, E, TOPK)
        if args.mini:
            c1, c2 = cfg
            minis = [cfg, (replace(c1, SCALE_WORDS=not c1.SCALE_WORDS), replace(c2, SCALE_WORDS=not c2.SCALE_WORDS)),
                     (replace(c1, WORDS=False), replace(c2, WORDS=False))]
            best = None
            for pair in minis:
                try:
                    ms = graph_ms(lambda: F.fused_fp4_moe(x, pw13, pw2, tw, ti, q1, q2, configs=pair), rep=25)
                except Exception as exc:  # noqa: BLE001
                    OUT["errors"].append(f"fp4 mini M={m} {pair}: {exc!r}")
                    continue
                OUT["checks"].append(dict(kind="fp4_mini_candidate", M=m, cfg=[pair[0].__dict__, pair[1].__dict__],
                                          graph_ms=ms))
                if best is None or ms < best[0]:
                    best = (ms, pair)
            cfg = best[1] if best else cfg
        tables["fp4"][m] = [cfg[0].__dict__, cfg[1].__dict__]
        for name in ("w_mxfp4", "w_mxfp4_a_mxfp4", "nvfp4"):
            ex, pw13, pw2, q1, q2 = schemes[name]
            for mode in (("seed", "hardware") if name == "nvfp4" else ("seed",)):
                path = f"fp4_{name}" + ("_hw" if mode == "hardware" else "")
                try:
                    fn = lambda: F.fused_fp4_moe(x, pw13, pw2, tw, ti, q1, q2, mode=mode, configs=cfg)  # noqa: E731
                    out = fn()
                    ex.backend = "triton"
                    ref = ex(x, tw, ti)
                    OUT["checks"].append(dict(kind="rel_vs_seed_style", path=path, M=m, rel=rel(out, ref)))
                    add(path, m, graph_ms(fn), experts_hit=hit)
                except Exception as exc:  # noqa: BLE001
                    OUT["errors"].append(f"{path} M={m}: {exc!r}")
                    traceback.print_exc()
            for backend in (("fused", "triton") if args.old else ()):
                if name == "w_mxfp4" and backend == "triton":
                    continue
                try:
                    ex.backend = backend
                    add(f"{'fused_old' if backend == 'fused' else 'triton'}_{name}", m,
                        graph_ms(lambda: ex(x, tw, ti)), experts_hit=hit)
                except Exception as exc:  # noqa: BLE001
                    OUT["errors"].append(f"{backend} {name} M={m}: {exc!r}")
        if args.fp6:
            ex = schemes["w_mxfp6_e3m2"][0]
            for backend in ("fused", "triton"):
                try:
                    ex.backend = backend
                    add(f"{'fused_old' if backend == 'fused' else 'triton'}_w_mxfp6_e3m2", m,
                        graph_ms(lambda: ex(x, tw, ti)), experts_hit=hit)
                except Exception as exc:  # noqa: BLE001
                    OUT["errors"].append(f"{backend} fp6 M={m}: {exc!r}")
        OUT["tables"] = tables
        dump()
        log(f"M={m} done {time.time() - t0:.0f}s: " + ", ".join(
            f"{r['path']} {r['graph_ms']:.3f}" for r in OUT["rows"] if r["M"] == m))
    dump()
    return 0


if __name__ == "__main__":
    sys.exit(main())
