"""What per-token NVFP4 activation scales cost on the GPU: the FP4 kernel's MoE layer beside static scales.

``python -m mxlib.bench.per_token [--tokens 1,16,64,256,1024,4096] [--json PATH]``

Inputs: the fused benchmark's (``mxlib.bench.fused``: one Qwen3-30B-A3B layer, E 128, top-8, H 2048,
I 768, the harness recipe's weights, tokens and routing; static NVFP4 scales from its calibration
batch). Rows (``path``), CUDA-graph replay medians (``_common.graph_ms``) of the whole forward:

* ``fused_nvfp4`` / ``fused_nvfp4_hw``: static scales (``scale_strategy="max"``), vLLM / hardware numerics;
* ``fused_nvfp4_per_token`` / ``fused_nvfp4_per_token_hw``: ``scale_strategy="per_token"`` (a1: one
  standalone per-row QDQ pass over ``[M, H]``; a2: GEMM1 stores it unquantized, one per-row pass QDQs
  it in place before GEMM2);
* ``fused_nvfp4_per_token_a1_fused``: per-token with the a1 QDQ in GEMM1's A-tile load after a scales
  pre-pass (``TileConfig.a1_fused``);
* the passes alone: ``pass_a1_static`` (the static standalone a1 QDQ), ``pass_a1_per_token_scales``
  (the scales pre-pass: row amax of ``[M, H]``), ``pass_a1_per_token_qdq`` (scales and QDQ of
  ``[M, H]``), ``pass_a2_per_token_qdq`` (of ``[M * k, I]``, in place).

``checks``: the per-token fused output against the torch backend's (relative L2, bf16 GEMMs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace

import torch

from ..formats import NVFP4_SCALE_DIVISOR
from ..kernels import quant as Q
from ..kernels.fp4_tiles import get_fp4_configs
from ..moe.factory import make_emulation_experts, quantize_expert_weights
from ..moe.reference_moe import silu_and_mul
from ._common import env, graph_ms
from .fused import DEVICE, TOPK, E, I, harness_layer, harness_tokens

__all__ = ["run", "main"]

TOKENS = [1, 16, 64, 256, 1024, 4096]


def build(w13, w2, x_cal) -> dict:
    """The experts of each path (static scales from the calibration batch, as ``mxlib.bench.fused``)."""
    in13 = torch.full((E,), float(x_cal.abs().amax()) / NVFP4_SCALE_DIVISOR, device=DEVICE)
    h_cal = (x_cal[:512].float() @ w13[0].float().T).to(torch.bfloat16)
    in2 = torch.full((E,), float(silu_and_mul(h_cal).abs().amax()) / NVFP4_SCALE_DIVISOR, device=DEVICE)
    q = quantize_expert_weights(w13, w2, "nvfp4")
    paths = {}
    for suffix, numerics in (("", "vllm"), ("_hw", "hardware")):
        paths[f"fused_nvfp4{suffix}"] = make_emulation_experts(
            "nvfp4", q, in13, in2, backend="fused", numerics=numerics
        )
        paths[f"fused_nvfp4_per_token{suffix}"] = make_emulation_experts(
            "nvfp4", q, backend="fused", numerics=numerics, scale_strategy="per_token"
        )
    paths["fused_nvfp4_per_token_a1_fused"] = make_emulation_experts(
        "nvfp4", q, backend="fused", scale_strategy="per_token"
    )
    paths["torch_nvfp4_per_token"] = make_emulation_experts("nvfp4", q, backend="torch", scale_strategy="per_token")
    return paths


def run(tokens, log=print) -> dict:
    """Time every path and pass at every M; returns ``{"env", "rows", "checks", "errors"}``."""
    result = {"env": env(), "rows": [], "checks": [], "errors": []}
    t0 = time.time()
    w13, w2, x_cal = harness_layer()
    paths = build(w13, w2, x_cal)
    ref = paths.pop("torch_nvfp4_per_token")
    gs = paths["fused_nvfp4"].a13_gscale[:1]
    for m in tokens:
        x, tw, ti = harness_tokens(m)
        c1, c2 = get_fp4_configs(m, E, TOPK, True, 4)
        paths["fused_nvfp4_per_token_a1_fused"].fp4_config = (replace(c1, a1_fused=True), c2)
        a2 = torch.randn(m * TOPK, I, device=DEVICE, dtype=torch.bfloat16)
        passes = {
            "pass_a1_static": lambda: Q.ref_nvfp4_quant_dequant(x, gs, check_scale=False),
            "pass_a1_per_token_scales": lambda: Q.per_token_rows(x, qdq=False)[1],
            "pass_a1_per_token_qdq": lambda: Q.per_token_rows(x)[0],
            "pass_a2_per_token_qdq": lambda: Q.per_token_rows(a2, out=a2)[0],
        }
        for path, fn in [*((p, lambda ex=ex: ex(x, tw, ti)) for p, ex in paths.items()), *passes.items()]:
            try:
                ms = graph_ms(fn)
            except Exception as exc:  # noqa: BLE001 - one failing row must not lose the others
                result["errors"].append(f"{path} M={m}: {exc!r}")
                continue
            result["rows"].append(dict(path=path, M=m, graph_ms=ms))
        if m <= 1024:  # the torch backend loops over the experts: moderate M only
            a, b = paths["fused_nvfp4_per_token"](x, tw, ti).double(), ref(x, tw, ti).double()
            rel = ((a - b).norm() / b.norm()).item()
            result["checks"].append(dict(M=m, what="fused per_token vs torch per_token, relative L2", rel=rel))
        log(
            f"M={m} ({time.time() - t0:.0f}s): "
            + ", ".join(f"{r['path']} {r['graph_ms'] * 1e3:.1f}us" for r in result["rows"] if r["M"] == m)
        )
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if not torch.cuda.is_available():
        print("mxlib.bench.per_token needs a CUDA GPU.")
        return 2
    res = run([int(t) for t in args.tokens.split(",")])
    by = {(r["path"], r["M"]): r["graph_ms"] for r in res["rows"]}
    for m in sorted({r["M"] for r in res["rows"]}):
        st, pt = by.get(("fused_nvfp4", m)), by.get(("fused_nvfp4_per_token", m))
        if st and pt:
            print(f"M={m}: per_token / static = {pt / st:.3f} (vllm numerics)")
    for c in res["checks"]:
        print(f"check M={c['M']}: {c['what']} = {c['rel']:.2e}")
    for e in res["errors"]:
        print("ERROR", e)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 1 if res["errors"] or any(c["rel"] > 1e-2 for c in res["checks"]) else 0


if __name__ == "__main__":
    sys.exit(main())
