"""The MoE layer beside the external-kernel harness: CUDA-graph replay times of mxlib's paths on its inputs.

``python -m mxlib.bench fused [--tokens 1,4,16,64,256,1024,4096] [--external HARNESS.json] [--json PATH]
[--markdown PATH] [--no-extra]`` (also ``python -m mxlib.bench moe --external HARNESS.json``).

Inputs: the external-kernel harness's recipe (``../shared/anchor_bench`` README "Inputs"), so that the experts
hit, and so the bytes moved, are the same as in its rows: one Qwen3-30B-A3B layer (E 128, top-8,
H 2048, I 768), weights N(0, 0.02) bf16 from generator seed 0 (w13, then w2, then a calibration batch
of 4096 tokens), tokens and router logits from seed ``1 + M``, Qwen3 routing (``fused_topk``). NVFP4
activation scales: ``amax / 2688`` of the calibration batch (a1) and of the SiLU-and-mul of expert 0's
GEMM1 on 512 calibration tokens (a2), one for all experts.

Rows (``path``), all through the experts classes as a user runs them:

* ``mxlib_bf16``: ``TritonExperts`` on the bf16 weights (Triton alignment, its tile table);
* ``mxlib_fused_<scheme>`` for ``w_mxfp4``, ``w_mxfp4_a_mxfp4``, ``nvfp4`` (seed numerics) and
  ``mxlib_fused_nvfp4_hw`` (hardware numerics): the ``fused`` backend, i.e. the FP4 kernel;
* ``mxlib_fused_w_mxfp4_swigluoai``, ``mxlib_fused_w_mxfp4_a_mxfp4_swigluoai``: the same FP4 kernel with gpt-oss's
  activation in the form of the harness's ``tk_mxfp4`` row (``HARNESS_SWIGLU``: SwiGLU-OAI with alpha 1.0 and no
  clamp, no expert biases) on the same Qwen3 layer, so that ``fused w_mxfp4 swigluoai / tk_mxfp4`` compares
  the same arithmetic; a check per M gives each row's relative L2 distance to the ``torch`` backend;
* with extras (default): ``mxlib_triton_nvfp4`` (dequantize-then-GEMM: dequantize all experts, bf16 GEMMs),
  ``mxlib_fused_w_mxfp6_e3m2`` and ``mxlib_triton_w_mxfp6_e3m2`` (FP6 weights: the FP4 kernel in the MXFP6 layout
  and dequantize-then-GEMM).

Timing: ``triton.testing.do_bench`` medians (warm-up 10 ms, 50 ms of replays, L2 flushed before each)
of the whole forward captured in a CUDA graph, routing outside, as the external-kernel harness times. Bandwidth
bound: (experts hit x packed bytes per expert + the bf16 activations in and out) / the copy bandwidth
measured in this run; bytes per expert as the harness's (values + block scales of w13 and w2).

With ``--external`` (the external-kernel harness's JSON from the same device call) the report adds the ratios
of each row to the external rows (``tk_mxfp4_unfused_silu``: triton_kernels' Qwen3-correct MXFP4 path;
``vllm_bf16``: vLLM's tuned bf16 kernel), writes the external rows into the same table, and checks the
speed targets. Nothing here imports the external-kernel harness: it reads its JSON.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from ..moe.activations import MoEActivation
from ..moe.base import TritonExperts
from ..moe.factory import make_emulation_experts, quantize_expert_weights
from ..moe.reference_moe import silu_and_mul
from ..moe.routing import fused_topk
from ..moe.schemes import NVFP4_MOE, get_moe_scheme
from ..studies.tables import EXTERNAL_ROWS  # the external rows of the tables, in their order
from ..text_table import markdown_table
from ._common import copy_bandwidth, env, graph_ms

E, TOPK, H, I = 128, 8, 2048, 768
DEVICE = "cuda"
TOKENS = [1, 4, 16, 64, 256, 1024, 4096]
FP4_SCHEMES = ("w_mxfp4", "w_mxfp4_a_mxfp4", "nvfp4")
FP6_SCHEME = "w_mxfp6_e3m2"
# timed with the extras: weight-only NVFP4 (what Humming and Marlin compute) and the MXFP8-activation and
# MXFP8 schemes, each on the ``fused`` backend (the FP4 kernel for FP4 weights, the dequantize-GEMM kernel else)
EXTRA_SCHEMES = ("w4a16_nvfp4", "w_mxfp4_a_mxfp8", "w_mxfp8_a_mxfp8", "w_mxfp8")
TK, VLLM_BF16 = "tk_mxfp4_unfused_silu", "vllm_bf16"
# the harness's ``tk_mxfp4`` row: triton_kernels' fused swiglu of gpt-oss's form with alpha 1.0 and no clamp
TK_SWIGLU, HARNESS_SWIGLU = "tk_mxfp4", MoEActivation("swigluoai", alpha=1.0)
SWIGLU_SUFFIX = "_swigluoai"
SWIGLU_SCHEMES = ("w_mxfp4", "w_mxfp4_a_mxfp4")
# The W4A16 rows vLLM serves each weight format with on Hopper (its Humming backend first, then Marlin) and
# triton_kernels' path with Qwen3's activation: a scheme is measured against the fastest of its format's.
FORMAT_EXTERNAL_ROWS = {
    "mxfp4": ("vllm_humming_mxfp4", "vllm_marlin_mxfp4", TK),
    "nvfp4": ("vllm_humming_nvfp4", "vllm_marlin_nvfp4"),
}
# NVFP4 rows and the MXFP4 row of the same numerics and activation format (NVFP4 within 8 % of it)
NVFP4_VS_MXFP4 = {
    "nvfp4": "w_mxfp4_a_mxfp4",
    "nvfp4_hw": "w_mxfp4_a_mxfp4",
    "w4a16_nvfp4": "w_mxfp4",
    "w4a16_nvfp4_hw": "w_mxfp4",
}
# the MXFP8-weight rows (dequantize-GEMM kernel), measured against mxlib's bf16 row
MXFP8_SCHEMES = ("w_mxfp8", "w_mxfp8_a_mxfp8")
# mxlib's rows and the weight format whose external kernels they are measured against
FASTEST_EXTERNAL_ROWS = {
    "w_mxfp4": ("mxlib_fused_w_mxfp4", "mxfp4"),
    "w_mxfp4_a_mxfp4": ("mxlib_fused_w_mxfp4_a_mxfp4", "mxfp4"),
    "nvfp4": ("mxlib_fused_nvfp4", "nvfp4"),
    "nvfp4 hardware": ("mxlib_fused_nvfp4_hw", "nvfp4"),
    "w4a16_nvfp4": ("mxlib_fused_w4a16_nvfp4", "nvfp4"),
    "w4a16_nvfp4 hardware": ("mxlib_fused_w4a16_nvfp4_hw", "nvfp4"),
    "w_mxfp4_a_mxfp8": ("mxlib_fused_w_mxfp4_a_mxfp8", "mxfp4"),
}


def fastest_external_name(fmt: str) -> str:
    """The denominator's name in the ratio tables: ``min(<the format's external rows>)``."""
    return "min(" + ", ".join(FORMAT_EXTERNAL_ROWS[fmt]) + ")"


def harness_layer():
    """bf16 ``(w13, w2, x_cal)`` of the harness recipe."""
    g = torch.Generator(device=DEVICE).manual_seed(0)
    w13 = torch.empty(E, 2 * I, H, device=DEVICE, dtype=torch.bfloat16).normal_(0, 0.02, generator=g)
    w2 = torch.empty(E, H, I, device=DEVICE, dtype=torch.bfloat16).normal_(0, 0.02, generator=g)
    x_cal = torch.randn(4096, H, device=DEVICE, dtype=torch.bfloat16, generator=g)
    return w13, w2, x_cal


def harness_tokens(m: int):
    """``(hidden_states, topk_weights, topk_ids)`` of the harness recipe at ``m`` tokens."""
    g = torch.Generator(device=DEVICE).manual_seed(1 + m)
    x = torch.randn(m, H, device=DEVICE, dtype=torch.bfloat16, generator=g)
    logits = torch.randn(m, E, device=DEVICE, generator=g)
    tw, ti = fused_topk(logits, TOPK)
    return x, tw, ti


def packed_bytes_per_expert(scheme: str) -> int:
    """Packed values + block scales of one expert's w13 and w2 (the harness's count)."""
    w = get_moe_scheme(scheme).weight
    n = 3 * I * H  # elements of w13 and w2
    return int(n * w.bits_per_element) // 8


def build(w13, w2, x_cal, extra: bool, refs: dict | None = None) -> dict:
    """The timed experts by row name; ``refs`` (if given) receives the ``torch``-backend twin of each SwiGLU-OAI
    row, the reference of its check."""
    in13 = torch.full((E,), float(x_cal.abs().amax()) / NVFP4_MOE.activation.scale_divisor, device=DEVICE)
    h_cal = (x_cal[:512].float() @ w13[0].float().T).to(torch.bfloat16)
    in2 = torch.full((E,), float(silu_and_mul(h_cal).abs().amax()) / NVFP4_MOE.activation.scale_divisor, device=DEVICE)
    paths = {"mxlib_bf16": TritonExperts(w13, w2, backend="triton")}
    for name in FP4_SCHEMES + ((FP6_SCHEME, *EXTRA_SCHEMES) if extra else ()):
        s = get_moe_scheme(name)
        q = quantize_expert_weights(w13, w2, s)
        scales = (in13, in2) if s.static_activation_scale else (None, None)
        paths[f"mxlib_fused_{name}"] = make_emulation_experts(s, q, *scales, backend="fused")
        if name in SWIGLU_SCHEMES:
            for backend, into in (("fused", paths), ("torch", refs if refs is not None else {})):
                into[f"mxlib_fused_{name}{SWIGLU_SUFFIX}"] = make_emulation_experts(
                    s, q, *scales, backend=backend, activation=HARNESS_SWIGLU
                )
        if s.weight.has_global_scale:  # NVFP4: the only scheme whose two numerics differ
            paths[f"mxlib_fused_{name}_hw"] = make_emulation_experts(
                s, q, *scales, backend="fused", numerics="hardware"
            )
        baseline = name in FP4_SCHEMES + (FP6_SCHEME,)
        # dequantize-then-GEMM NVFP4 and FP6
        if extra and baseline and (s.weight.has_global_scale or s.weight.element.nbits != 4):
            paths[f"mxlib_triton_{name}"] = make_emulation_experts(s, q, *scales, backend="triton")
    return paths


def _scheme_of(path: str) -> str | None:
    path = path.removesuffix(SWIGLU_SUFFIX)
    for name in sorted(FP4_SCHEMES + (FP6_SCHEME, *EXTRA_SCHEMES), key=len, reverse=True):
        if path.endswith(name) or path.endswith(name + "_hw"):
            return name
    return None


def run(tokens, extra: bool = True, log=print) -> dict:
    """Time every path at every M; returns ``{"env", "copy_gbs", "rows", "checks", "errors"}``."""
    result = {"env": env(), "copy_gbs": copy_bandwidth(), "rows": [], "checks": [], "errors": []}
    t0 = time.time()
    w13, w2, x_cal = harness_layer()
    refs: dict = {}
    paths = build(w13, w2, x_cal, extra, refs)
    log(f"# {result['env']} copy {result['copy_gbs']:.0f} GB/s; setup {time.time() - t0:.0f}s")
    bps = result["copy_gbs"] * 1e9
    for m in tokens:
        x, tw, ti = harness_tokens(m)
        hit = int(torch.unique(ti).numel())
        act_bytes = 2 * m * H * 2
        ref_vllm = fused_vllm = None
        for path, ex in paths.items():
            try:
                out = ex(x, tw, ti)
                ms = graph_ms(lambda ex=ex: ex(x, tw, ti))
            except Exception as exc:  # noqa: BLE001 - one failing row must not lose the others
                result["errors"].append(f"{path} M={m}: {exc!r}")
                continue
            row = dict(path=path, M=m, graph_ms=ms, experts_hit=hit)
            scheme = _scheme_of(path)
            if scheme is not None:
                bound = (hit * packed_bytes_per_expert(scheme) + act_bytes) / bps * 1e3
                row.update(bound_ms=bound, bound_fraction=bound / ms)
            result["rows"].append(row)
            if path == "mxlib_triton_nvfp4":  # the dequantize-then-GEMM result: the fused vLLM mode must match it
                ref_vllm = out
            if path == "mxlib_fused_nvfp4":
                fused_vllm = out
            if path in refs:  # the FP4 kernel's SwiGLU-OAI against the torch backend's
                a, b = out.double(), refs[path](x, tw, ti).double()
                result["checks"].append(
                    dict(M=m, what=f"{path} vs the torch backend, relative L2", rel=((a - b).norm() / b.norm()).item())
                )
        if ref_vllm is not None and fused_vllm is not None:
            a, b = fused_vllm.double(), ref_vllm.double()
            result["checks"].append(
                dict(
                    M=m,
                    what="fused nvfp4 vLLM vs dequantize-then-GEMM, relative L2",
                    rel=((a - b).norm() / b.norm()).item(),
                )
            )
        log(
            f"M={m} ({time.time() - t0:.0f}s): "
            + ", ".join(f"{r['path']} {r['graph_ms']:.3f}" for r in result["rows"] if r["M"] == m)
        )
    return result


def _by(rows) -> dict:
    return {(r["path"], r["M"]): r for r in rows}


def ratios(result: dict, external: dict) -> dict:
    """Ratios of mxlib rows to external rows, the speed targets, per M."""
    mine, anc = _by(result["rows"]), _by(external.get("rows", []))
    tokens = sorted({r["M"] for r in result["rows"]})

    def t(table, path, m, key="graph_ms"):
        r = table.get((path, m))
        return None if r is None else r.get(key)

    def ratio(a, b):
        return None if (a is None or b is None or not b) else a / b

    out: dict = {}
    for m in tokens:
        tk, vb = t(anc, TK, m), t(anc, VLLM_BF16, m)
        bf16 = t(mine, "mxlib_bf16", m)
        d = {"mxlib_bf16 / vllm_bf16": ratio(bf16, vb)}
        for name in SWIGLU_SCHEMES:
            d[f"fused {name} swigluoai / {TK_SWIGLU}"] = ratio(
                t(mine, f"mxlib_fused_{name}{SWIGLU_SUFFIX}", m), t(anc, TK_SWIGLU, m)
            )
        for name in FP4_SCHEMES:
            d[f"fused {name} / {TK}"] = ratio(t(mine, f"mxlib_fused_{name}", m), tk)
            d[f"mxlib_bf16 / fused {name}"] = ratio(bf16, t(mine, f"mxlib_fused_{name}", m))
        d[f"fused nvfp4 hardware / {TK}"] = ratio(t(mine, "mxlib_fused_nvfp4_hw", m), tk)
        d["mxlib_bf16 / fused nvfp4 hardware"] = ratio(bf16, t(mine, "mxlib_fused_nvfp4_hw", m))
        for label, (row, fmt) in FASTEST_EXTERNAL_ROWS.items():
            times = [v for v in (t(anc, a, m) for a in FORMAT_EXTERNAL_ROWS[fmt]) if v]
            d[f"fused {label} / fastest {fmt} external kernel"] = ratio(t(mine, row, m), min(times) if times else None)
        # NVFP4 beside MXFP4 in the same numerics (W4A4: w_mxfp4_a_mxfp4; W4A16: w_mxfp4)
        for nv, mx in NVFP4_VS_MXFP4.items():
            d[f"fused {nv} / fused {mx}"] = ratio(t(mine, f"mxlib_fused_{nv}", m), t(mine, f"mxlib_fused_{mx}", m))
        for name in MXFP8_SCHEMES:
            d[f"fused {name} / mxlib_bf16"] = ratio(t(mine, f"mxlib_fused_{name}", m), bf16)
        d["fused w_mxfp6_e3m2 / dequantize-then-GEMM"] = ratio(
            t(mine, f"mxlib_fused_{FP6_SCHEME}", m), t(mine, f"mxlib_triton_{FP6_SCHEME}", m)
        )
        d["fused w_mxfp6_e3m2 / mxlib_bf16"] = ratio(t(mine, f"mxlib_fused_{FP6_SCHEME}", m), bf16)
        out[m] = d
    return out


def speed_targets(rat: dict, result: dict) -> list[dict]:
    """The speed targets, each with the measured worst value and whether it holds."""
    mine = _by(result["rows"])
    checks = []

    def add(what, values, limit, le=True):
        vals = {m: v for m, v in values.items() if v is not None}
        if not vals:
            return
        worst = max(vals.values()) if le else min(vals.values())
        checks.append(
            dict(target=what, limit=limit, worst=worst, holds=(worst <= limit) if le else (worst >= limit), values=vals)
        )

    # every FP4 scheme at or under the fastest W4A16 external kernel of its format (Humming, Marlin, triton_kernels)
    for label, (_, fmt) in FASTEST_EXTERNAL_ROWS.items():
        key = f"fused {label} / fastest {fmt} external kernel"
        name = f"{label} fused / fastest {fmt} external kernel <= 1.0 at every M"
        add(name, {m: d[key] for m, d in rat.items()}, 1.0)
    for nv, mx in NVFP4_VS_MXFP4.items():
        key = f"fused {nv} / fused {mx}"
        add(f"{nv} fused / {mx} fused <= 1.08 at every M", {m: d.get(key) for m, d in rat.items()}, 1.08)
    for name in MXFP8_SCHEMES:
        key = f"fused {name} / mxlib_bf16"
        add(f"{name} fused / mxlib_bf16 <= 0.6 at every M", {m: d.get(key) for m, d in rat.items()}, 0.6)
    for name in ("w_mxfp4", "w_mxfp4_a_mxfp4", "nvfp4", "nvfp4_hw", "w4a16_nvfp4", "w4a16_nvfp4_hw", *MXFP8_SCHEMES):
        add(
            f"{name} fused >= 65% of the bandwidth bound at M = 16, 64",
            {m: (mine.get((f"mxlib_fused_{name}", m)) or {}).get("bound_fraction") for m in (16, 64)},
            0.65,
            le=False,
        )
    add(
        "FP6 fused / dequantize-then-GEMM <= 1.0 at every M",
        {m: d["fused w_mxfp6_e3m2 / dequantize-then-GEMM"] for m, d in rat.items()},
        1.0,
    )
    add(
        "FP6 fused / mxlib_bf16 <= 1.0 at M = 16, 64",
        {m: d["fused w_mxfp6_e3m2 / mxlib_bf16"] for m, d in rat.items() if m in (16, 64)},
        1.0,
    )
    add("mxlib_bf16 / vllm_bf16 <= 1.05 at every M", {m: d["mxlib_bf16 / vllm_bf16"] for m, d in rat.items()}, 1.05)
    return checks


def _fmt(v, pct=False, digits=3) -> str:
    if v is None:
        return "-"
    return f"{100 * v:.0f}%" if pct else f"{v:.{digits}f}"


def markdown(result: dict, external: dict | None = None) -> str:
    """Tables: times (external rows first), ratios, fractions of the bandwidth bound, speed targets."""
    tokens = sorted({r["M"] for r in result["rows"]})

    def table(title: str, body: list[list[str]]) -> str:  # a row label, then one right-aligned column per M
        return "\n".join(markdown_table([title, *(f"M={m}" for m in tokens)], body, "<" + ">" * len(tokens))) + "\n"

    mine = _by(result["rows"])
    lines = []
    e = result["env"]
    lines.append(
        f"{e['device']}, {e['date']}, torch {e['torch']}, triton {e['triton']}, copy "
        f"{result['copy_gbs']:.0f} GB/s. CUDA-graph replay medians (ms), harness input recipe.\n"
    )
    body = []
    if external:
        anc = _by(external.get("rows", []))
        for p in EXTERNAL_ROWS:
            key = "floor_ms" if p.startswith("floor") else "graph_ms"
            body.append([f"`{p}` (external)", *(_fmt((anc.get((p, m)) or {}).get(key)) for m in tokens)])
    for p in dict.fromkeys(r["path"] for r in result["rows"]):
        body.append([f"`{p}`", *(_fmt((mine.get((p, m)) or {}).get("graph_ms")) for m in tokens)])
    lines.append(table("row (ms)", body))
    if external:
        rat = ratios(result, external)
        lines.append(table("ratio", [[key, *(_fmt(rat[m][key], digits=2) for m in tokens)] for key in rat[tokens[0]]]))
    body = []
    for p in dict.fromkeys(r["path"] for r in result["rows"] if "bound_fraction" in r):
        body.append([f"`{p}`", *(_fmt((mine.get((p, m)) or {}).get("bound_fraction"), True) for m in tokens)])
    if external:
        anc = _by(external.get("rows", []))
        for p in ("tk_mxfp4", TK, *FORMAT_EXTERNAL_ROWS["mxfp4"][:2], *FORMAT_EXTERNAL_ROWS["nvfp4"]):
            bound_row = "floor_nvfp4" if p.endswith("nvfp4") else "floor_mxfp4"
            vals = []
            for m in tokens:
                f, g = (anc.get((bound_row, m)) or {}).get("floor_ms"), (anc.get((p, m)) or {}).get("graph_ms")
                vals.append(_fmt(f / g if f and g else None, True))
            body.append([f"`{p}` (external)", *vals])
    lines.append(table("fraction of the bandwidth bound", body))
    if external:
        body = [
            [c["target"], _fmt(c["worst"], digits=2), "yes" if c["holds"] else "no"]
            for c in speed_targets(ratios(result, external), result)
        ]
        lines.append("\n".join(markdown_table(["target", "worst", "holds"], body, "<><")) + "\n")
    return "\n".join(lines)


def main(argv=None, json_path=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m mxlib.bench fused", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--external", default=None, help="the external-kernel harness's JSON from the same device call")
    ap.add_argument("--markdown", default=None, help="write the markdown tables here")
    ap.add_argument(
        "--no-extra", action="store_true", help="FP4 fused and bf16 rows only (no dequantize-then-GEMM, no FP6)"
    )
    ap.add_argument("--json", default=json_path)
    args = ap.parse_args(argv)
    result = run([int(t) for t in args.tokens.split(",")], extra=not args.no_extra)
    external = None
    if args.external:
        with open(args.external) as f:
            external = json.load(f)
        result["ratios"] = ratios(result, external)
        result["speed_targets"] = speed_targets(result["ratios"], result)
        result["external"] = external
    md = markdown(result, external)
    print(md)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(md + "\n")
    return 0
