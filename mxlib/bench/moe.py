"""MoE-layer benchmark on the GPU: bf16 TritonExperts vs dequantize-then-GEMM vs fused emulation.

``python -m mxlib.bench moe [--schemes nvfp4,w_mxfp4_a_mxfp4] [--tokens 1,16,256] [--sweep] [--model]
[--json PATH]``

At the Qwen3-30B-A3B MoE layer shape (E 128, top-8, H 2048, I 768), for every scheme
and token count M, it times with CUDA events (``triton.testing.do_bench``: warm-up,
median) each path on the same inputs:

* ``bf16``: ``TritonExperts`` on unquantized bf16 weights (the ceiling);
* ``dequant``: mxlib's dequantize-then-GEMM emulation: every expert dequantized to bf16 each forward,
  activations QDQ'd, then the bf16 GEMMs (vLLM's emulation design, with mxlib's Triton
  dequantize / QDQ kernels where vLLM's merged version used PyTorch ops);
* ``fused``: the fused dequantize-GEMM emulation (``backend="fused"``).

Reported per path: eager median, CUDA-graph replay median (the forward captured at that
M), peak extra device memory over the forward, and for ``fused`` the fraction of the
bandwidth bound (packed weights and scales of the experts hit + activations in and out,
at the copy bandwidth measured in the same run) and of bf16 tensor-core throughput
(measured in the same run). ``--sweep`` first tries tile configurations per M and uses
the fastest. ``--model`` adds whole-model forward times (4 and 48 layers). Last, it prints
notebook 05's speed-targets table (``mxlib.studies.tables.speed_targets_table``: fused against the
dequantize-then-GEMM path and bf16, per target) and stores it in the JSON as ``speed_targets``.
"""

from __future__ import annotations

import argparse
import json
import math
import warnings

import torch

from ..kernels.tiles import TileConfig
from ..models.calibration import calibrate
from ..models.qwen3 import dummy_qwen3_moe, expert_weights, moe_layers, qwen3_30b_a3b_config
from ..moe import base as X
from ..moe.factory import input_scales_from_amax, make_emulation_experts, quantize_expert_weights
from ..moe.routing import fused_topk
from ..moe.schemes import OCP_MX_SCHEMES, get_moe_scheme
from ..studies.tables import speed_targets_table
from ._common import copy_bandwidth, env, graph_ms, median_ms

E, TOPK, H, I = 128, 8, 2048, 768
DEVICE = "cuda"
TOKENS = [1, 4, 16, 64, 256, 1024, 4096]

FUSED_CANDIDATES = [
    TileConfig(16, 64, 128, 1, 4, 3),
    TileConfig(16, 64, 256, 1, 4, 3),
    TileConfig(16, 128, 128, 1, 4, 3),
    TileConfig(16, 64, 128, 1, 4, 4),
    TileConfig(32, 64, 128, 1, 4, 3),
    TileConfig(32, 128, 128, 4, 8, 3),
    TileConfig(64, 64, 128, 4, 4, 3),
    TileConfig(64, 128, 64, 4, 8, 3),
    TileConfig(64, 128, 128, 8, 8, 3),
    TileConfig(128, 128, 64, 8, 8, 3),
    TileConfig(128, 64, 64, 8, 4, 3),
    TileConfig(128, 128, 128, 8, 8, 3),
    TileConfig(16, 64, 128, 1, 4, 4, True),
    TileConfig(16, 128, 128, 1, 4, 3, True),
    TileConfig(32, 64, 128, 1, 4, 3, True),
    TileConfig(64, 128, 64, 4, 8, 3, True),
    TileConfig(128, 64, 64, 8, 4, 3, True),
    TileConfig(128, 128, 64, 8, 8, 3, True),
    TileConfig(256, 128, 64, 8, 8, 3),
    TileConfig(256, 64, 64, 8, 8, 3, True),
]
BF16_CANDIDATES = [
    TileConfig(16, 64, 128, 1, 4, 4),
    TileConfig(16, 128, 128, 1, 4, 3),
    TileConfig(16, 64, 256, 1, 4, 3),
    TileConfig(32, 64, 128, 8, 4, 4),
    TileConfig(32, 128, 64, 8, 4, 4),
    TileConfig(64, 64, 64, 8, 4, 4),
    TileConfig(64, 128, 64, 8, 4, 4),
    TileConfig(64, 128, 64, 8, 8, 3),
    TileConfig(128, 128, 64, 8, 8, 3),
    TileConfig(128, 256, 64, 8, 8, 3),
]


def _ms(fn, rep=50) -> float:
    return median_ms(fn, warmup=10, rep=rep)


_graph_ms = graph_ms  # CUDA-graph replay median (``_common.graph_ms``)


def _peak_extra_mb(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 1e6


def machine_ceilings() -> dict:
    a = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16)
    ms = _ms(lambda: a @ b, rep=200)
    return {"copy_gbs": copy_bandwidth(), "bf16_tflops": 2 * 8192**3 / (ms * 1e-3) / 1e12}


def build_layer(scheme: str, seed: int = 0):
    """bf16 weights of one layer and its emulation experts (quantized with the Triton kernels)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    w13 = torch.empty(E, 2 * I, H, device=DEVICE, dtype=torch.bfloat16).normal_(0, 0.02, generator=g)
    w2 = torch.empty(E, H, I, device=DEVICE, dtype=torch.bfloat16).normal_(0, 0.02, generator=g)
    s = get_moe_scheme(scheme)
    # activation scales from a calibration-like pass: a1 ~ N(0, 1) rows, a2 from the bf16 layer
    x = torch.randn(4096, H, device=DEVICE, dtype=torch.bfloat16, generator=g)
    tw, ti = fused_topk(torch.randn(4096, E, device=DEVICE, generator=g), TOPK)
    a2_amax = torch.zeros(E, device=DEVICE)

    def record(act, rows):
        a2_amax.scatter_reduce_(0, rows.long(), act.abs().amax(-1).float(), reduce="amax")
        return act

    bf16 = X.TritonExperts(w13, w2, backend="triton")
    bf16.quantize_intermediate = lambda a2, rows, backend: record(a2, rows)
    bf16(x, tw, ti)
    del bf16.quantize_intermediate
    a1_amax = torch.full((E,), float(x.float().abs().amax()), device=DEVICE)
    weights = quantize_expert_weights(w13, w2, s)
    in13, in2 = input_scales_from_amax(s, a1_amax, a2_amax)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        em = make_emulation_experts(s, weights, in13, in2, backend="fused")
    return w13, w2, em


def _packed_bytes_per_expert(em) -> float:
    n = sum(
        t.numel() * t.element_size() for t in (em.w13_weight, em.w13_weight_scale, em.w2_weight, em.w2_weight_scale)
    )
    return n / E


def _inputs(m: int, seed: int):
    g = torch.Generator(device=DEVICE).manual_seed(seed + m)
    x = torch.randn(m, H, device=DEVICE, dtype=torch.bfloat16, generator=g)
    tw, ti = fused_topk(torch.randn(m, E, device=DEVICE, generator=g), TOPK)
    return x, tw, ti


def sweep(em, bf16, tokens) -> tuple[dict, dict]:
    """Fastest dequantize-GEMM and bf16 TileConfig per M (nvfp4 layer)."""
    best_f, best_b = {}, {}
    for m in tokens:
        x, tw, ti = _inputs(m, 1)
        per_expert = m * TOPK / E
        res = []
        for cfg in FUSED_CANDIDATES:
            if cfg.block_m > max(16, 4 * per_expert):
                continue
            em.fused_config = cfg
            em.backend = "fused"
            res.append((_ms(lambda: em(x, tw, ti), rep=25), cfg))
        best_f[m] = min(res, key=lambda r: r[0])
        res = []
        for cfg in BF16_CANDIDATES:
            if cfg.block_m > max(16, 4 * per_expert):
                continue
            bf16.gemm_config = cfg
            res.append((_ms(lambda: bf16(x, tw, ti), rep=25), cfg))
        best_b[m] = min(res, key=lambda r: r[0])
        print(
            f"[sweep] M={m}: fused {best_f[m][0]:.3f} ms {best_f[m][1]} | bf16 {best_b[m][0]:.3f} ms {best_b[m][1]}",
            flush=True,
        )
    em.fused_config = None
    bf16.gemm_config = None
    return {m: c for m, (_, c) in best_f.items()}, {m: c for m, (_, c) in best_b.items()}


def _nearest(best: dict | None, m: int):
    """The swept configuration of the token count nearest to ``m`` (log scale), or None."""
    if not best:
        return None
    return best[min(best, key=lambda mm: abs(math.log(mm) - math.log(m)))]


def bench_scheme(scheme: str, tokens, ceilings, best_fused=None, best_bf16=None, layer=None) -> list[dict]:
    w13, w2, em = layer or build_layer(scheme)
    bf16 = X.TritonExperts(w13, w2, backend="triton")
    per_expert_bytes = _packed_bytes_per_expert(em)
    rows = []
    for m in tokens:
        x, tw, ti = _inputs(m, 1)
        hit = int(torch.unique(ti).numel())
        flops = 2 * m * TOPK * 3 * H * I
        bound_bytes = hit * per_expert_bytes + 2 * m * H * 2
        bound_ms = bound_bytes / (ceilings["copy_gbs"] * 1e9) * 1e3
        row = dict(scheme=scheme, M=m, experts_hit=hit, bound_ms=bound_ms)
        bf16.gemm_config = _nearest(best_bf16, m)
        em.fused_config = _nearest(best_fused, m)
        em.gemm_config = _nearest(best_bf16, m)
        out = {}
        for name in ("bf16", "dequant", "fused"):
            if name == "bf16":
                fn = lambda: bf16(x, tw, ti)  # noqa: E731
            else:
                em.backend = "fused" if name == "fused" else "triton"
                fn = lambda: em(x, tw, ti)  # noqa: E731
            out[name] = fn()
            row[f"{name}_ms"] = _ms(fn)
            row[f"{name}_graph_ms"] = _graph_ms(fn)
            row[f"{name}_mem_mb"] = _peak_extra_mb(fn)
        ref = out["dequant"].double()
        row["fused_vs_dequant_rel_err"] = ((out["fused"].double() - ref).norm() / ref.norm()).item()
        row["fused_speedup_vs_dequant"] = row["dequant_ms"] / row["fused_ms"]
        row["fused_over_bf16"] = row["fused_ms"] / row["bf16_ms"]
        row["fused_graph_over_bf16_graph"] = row["fused_graph_ms"] / row["bf16_graph_ms"]
        row["fused_bound_frac"] = bound_ms / row["fused_ms"]
        row["fused_bound_frac_graph"] = bound_ms / row["fused_graph_ms"]
        row["fused_tflops_frac"] = flops / (row["fused_ms"] * 1e-3) / 1e12 / ceilings["bf16_tflops"]
        row["bf16_tflops_frac"] = flops / (row["bf16_ms"] * 1e-3) / 1e12 / ceilings["bf16_tflops"]
        row["packed_weight_mb"] = per_expert_bytes * E / 1e6
        rows.append(row)
        print(
            f"[{scheme}] M={m:5d} bf16 {row['bf16_ms']:.3f} dequant {row['dequant_ms']:.3f} "
            f"fused {row['fused_ms']:.3f} ms "
            f"(graph {row['bf16_graph_ms']:.3f}/{row['dequant_graph_ms']:.3f}/{row['fused_graph_ms']:.3f}) "
            f"x{row['fused_speedup_vs_dequant']:.1f} vs dequant, {row['fused_over_bf16']:.2f} of bf16, "
            f"bandwidth bound {row['fused_bound_frac']:.0%}, err {row['fused_vs_dequant_rel_err']:.1e}",
            flush=True,
        )
    return rows


def bench_model(layers_list=(4, 48), tokens=(1, 1024), scheme: str = "nvfp4") -> list[dict]:
    """Whole-model forward time (dummy Qwen3-30B-A3B) per path on the GPU."""
    s = get_moe_scheme(scheme)
    rows = []
    for layers in layers_list:
        cfg = qwen3_30b_a3b_config(num_hidden_layers=layers)
        model = dummy_qwen3_moe(cfg, seed=0, device=DEVICE)
        ids = torch.randint(0, cfg.vocab_size, (1, 256), device=DEVICE)
        calib = calibrate(model, ids)
        bf16_experts, emu_experts = [], []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for li in range(layers):
                w13, w2 = expert_weights(model, li)
                bf16_experts.append(X.TritonExperts(w13, w2, backend="triton"))
                in13 = in2 = None
                if s.static_activation_scale:
                    in13, in2 = (t.to(DEVICE) for t in calib.input_scales(li, s.activation))
                emu_experts.append(
                    make_emulation_experts(s, quantize_expert_weights(w13, w2, s), in13, in2, backend="fused")
                )
        for m in tokens:
            x = torch.randint(0, cfg.vocab_size, (1, m), device=DEVICE)
            row = dict(layers=layers, tokens=m)
            for name in ("bf16", "dequant", "fused"):
                for li, mlp in enumerate(moe_layers(model)):
                    ex = bf16_experts[li] if name == "bf16" else emu_experts[li]
                    if name != "bf16":
                        ex.backend = "triton" if name == "dequant" else "fused"
                    mlp.experts = X.TransformersExperts(ex)
                with torch.no_grad():
                    row[f"{name}_ms"] = _ms(lambda model=model, x=x: model(input_ids=x, use_cache=False), rep=200)
            rows.append(row)
            print(
                f"[model] {layers} layers, {m} tokens: bf16 {row['bf16_ms']:.1f} ms, "
                f"dequant {row['dequant_ms']:.1f} ms, "
                f"fused {row['fused_ms']:.1f} ms",
                flush=True,
            )
        del model, bf16_experts, emu_experts
        torch.cuda.empty_cache()
    return rows


def print_speed_targets(rows: list[dict]) -> list[dict]:
    """Print and return notebook 05's speed-targets table of bench rows (``tables.speed_targets_table``)."""
    targets = speed_targets_table(rows)
    for r in targets:
        want = f"{r['target_vs_dequant']}x" if r["target_vs_dequant"] != "" else "-"
        print(
            f"[speed targets] {r['scheme']} M={r['M']}: fused {r['fused_vs_dequant']:.2f}x faster than "
            f"dequantize-then-GEMM (wanted {want}), "
            f"{r['fused_over_bf16']:.2f}x bf16's time (allowed {r['target_over_bf16']}x), meets {r['meets']}, "
            f"bandwidth-bound fraction {r['bound_frac']:.2f}, "
            f"peak extra memory {r['mem_frac_of_packed']:.2f}x packed weights",
            flush=True,
        )
    return targets


def main(argv=None, json_path=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schemes", default="nvfp4," + ",".join(OCP_MX_SCHEMES))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--model", action="store_true")
    ap.add_argument("--model-only", action="store_true")
    ap.add_argument("--sweep-tokens", default="")
    ap.add_argument("--full", type=int, default=99, help="the first N schemes get every token count")
    ap.add_argument("--short-tokens", default="16,256,4096")
    args = ap.parse_args(argv)
    args.short_tokens = [int(t) for t in args.short_tokens.split(",")]
    tokens = [int(t) for t in args.tokens.split(",")]
    ceilings = machine_ceilings()
    print(
        f"# {env()} copy {ceilings['copy_gbs']:.0f} GB/s, bf16 matmul {ceilings['bf16_tflops']:.0f} TFLOP/s", flush=True
    )
    result = {"env": env(), "ceilings": ceilings, "rows": [], "best_fused": {}, "best_bf16": {}}
    best_f: dict[int, dict] = {}  # weight bits -> {M: TileConfig}
    best_b = None
    schemes = [] if args.model_only else args.schemes.split(",")
    sweep_tokens = [int(t) for t in args.sweep_tokens.split(",")] if args.sweep_tokens else tokens
    for scheme in schemes:
        layer = build_layer(scheme)
        bits = get_moe_scheme(scheme).weight.element.nbits
        if args.sweep and bits not in best_f:
            bf, bb = sweep(layer[2], X.TritonExperts(layer[0], layer[1], backend="triton"), sweep_tokens)
            best_f[bits] = bf
            best_b = best_b or bb
            result["best_fused"][bits] = {m: c.__dict__ for m, c in bf.items()}
            result["best_bf16"] = {m: c.__dict__ for m, c in best_b.items()}
        result["rows"] += bench_scheme(
            scheme,
            tokens if scheme in schemes[: args.full] else args.short_tokens,
            ceilings,
            best_f.get(bits),
            best_b,
            layer,
        )
        del layer
        torch.cuda.empty_cache()
        if json_path:
            with open(json_path, "w") as f:
                json.dump(result, f, indent=2, default=str)
    result["speed_targets"] = print_speed_targets(result["rows"])
    if args.model or args.model_only:
        result["model"] = bench_model()
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return 0
