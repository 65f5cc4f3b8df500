"""The tables that notebooks 04 and 05 show and that the CLI and the benchmarks print: rows in, rows out.

* ``strategy_summary``: notebook 04's per-expert QDQ table (``mxlib.cli e2e``'s too), averaged over experts.
* ``speed_targets_table`` and ``SPEED_TARGETS``: notebook 05's speed targets of the fused MoE emulation
  (``mxlib.bench moe``).
* ``external_kernel_tables``, ``EXTERNAL_RATIOS`` and ``EXTERNAL_ROWS``: notebook 05's tables of the fused FP4
  kernel beside the external-kernel harness (H200; ``mxlib.bench fused``).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

__all__ = [
    "strategy_summary",
    "SPEED_TARGETS",
    "speed_targets_table",
    "EXTERNAL_RATIOS",
    "EXTERNAL_ROWS",
    "external_kernel_tables",
]


def strategy_summary(experts: list[dict], strategies) -> list[dict]:
    """Mean over experts of each strategy's QDQ metrics at a1 and a2, plus OCP MX for comparison.

    Args:
        experts: ``mxlib.studies.unification.unification_study(...)["experts"]`` rows (one per layer, expert and
            activation point ``a1`` / ``a2``).
        strategies: the strategies the study ran (``max``, ``per_expert``, ``median``, ...).

    Returns:
        Rows ``point, strategy, mean_sqnr_db, mean_db_lost, worst_db_lost, subnormal_blocks,
        flushed_blocks, clipped_elements`` (means over experts; dB, block and element fractions
        as the study reports them), then for each point two rows of OCP MXFP4 and MXFP8 (e4m3)
        with ``mean_sqnr_db`` only (no global scale to unify).
    """
    summary = []
    for point in ("a1", "a2"):
        rows = [r for r in experts if r["point"] == point]
        if not rows:
            continue
        for s in strategies:
            summary.append(
                dict(
                    point=point,
                    strategy=s,
                    mean_sqnr_db=statistics.mean(r[f"sqnr_{s}"] for r in rows),
                    mean_db_lost=statistics.mean(r[f"db_lost_{s}"] for r in rows),
                    worst_db_lost=max(r[f"db_lost_{s}"] for r in rows),
                    subnormal_blocks=statistics.mean(r[f"subnormal_{s}"] for r in rows),
                    flushed_blocks=statistics.mean(r[f"flushed_{s}"] for r in rows),
                    clipped_elements=statistics.mean(r[f"clipped_{s}"] for r in rows),
                )
            )
        summary.append(
            dict(
                point=point,
                strategy="OCP MXFP4 (no global scale)",
                mean_sqnr_db=statistics.mean(r["sqnr_mxfp4"] for r in rows),
            )
        )
        summary.append(
            dict(
                point=point,
                strategy="OCP MXFP8 e4m3 (no global scale)",
                mean_sqnr_db=statistics.mean(r["sqnr_mxfp8_e4m3"] for r in rows),
            )
        )
    return summary


# (scheme, tokens M, fused speed-up wanted over vLLM's emulation design (None: no target),
#  fused time allowed as a multiple of bf16's); CUDA-graph replay times.
SPEED_TARGETS: tuple[tuple[str, int, float | None, float], ...] = tuple(
    (scheme, m, want_dequant, want_bf16)
    for scheme in ("nvfp4", "w_mxfp4_a_mxfp4")
    for m, want_dequant, want_bf16 in (
        (1, 10, 1.5),
        (16, 10, 1.5),
        (256, 3, 1.5),
        (1024, None, 1.25),
        (4096, None, 1.25),
    )
)


def speed_targets_table(rows: list[dict], targets=SPEED_TARGETS) -> list[dict]:
    """Notebook 05's speed targets: the fused MoE emulation against vLLM's emulation design and bf16.

    Args:
        rows: MoE-layer benchmark rows (``mxlib.bench moe``'s JSON ``rows``) with ``scheme, M,
            dequant_graph_ms, fused_graph_ms, bf16_graph_ms, fused_bound_frac_graph, fused_mem_mb,
            packed_weight_mb``.
        targets: ``(scheme, M, wanted speed-up over the dequantize-then-GEMM path or None, allowed multiple of bf16)``.

    Returns:
        One row per target the benchmark measured: ``scheme, M, fused_vs_dequant`` (dequantize-then-GEMM time /
        fused time), ``target_vs_dequant`` ("" when none), ``fused_over_bf16`` (fused / bf16 time),
        ``target_over_bf16``, ``meets`` ("yes" / "no"), ``bound_frac`` and
        ``mem_frac_of_packed`` (peak extra memory / packed weight size).
    """
    by: dict[tuple[str, int], dict] = {}
    for r in rows:
        by.setdefault((r["scheme"], r["M"]), r)  # the first row of a (scheme, M), as measured
    targets_met = []
    for scheme, m, want_dequant, want_bf16 in targets:
        r = by.get((scheme, m))
        if r is None:
            continue
        dequant_x = r["dequant_graph_ms"] / r["fused_graph_ms"]
        bf16_x = r["fused_graph_ms"] / r["bf16_graph_ms"]
        meets = (want_dequant is None or dequant_x >= want_dequant) and bf16_x <= want_bf16
        targets_met.append(
            dict(
                scheme=scheme,
                M=m,
                fused_vs_dequant=dequant_x,
                target_vs_dequant=want_dequant or "",
                fused_over_bf16=bf16_x,
                target_over_bf16=want_bf16,
                meets="yes" if meets else "no",
                bound_frac=r["fused_bound_frac_graph"],
                mem_frac_of_packed=r["fused_mem_mb"] / r["packed_weight_mb"],
            )
        )
    return targets_met


# ------------------------------------------------------------------ the FP4 kernel beside the external kernels (H200)
# ratio name as the benchmark's JSON records it -> (numerator row, denominator row); rows are the
# ``path`` names of the JSON's ``rows`` (mxlib) and ``external.rows`` (vLLM, triton_kernels).
EXTERNAL_RATIOS: dict[str, tuple[str, str]] = {
    "mxlib_bf16 / vllm_bf16": ("mxlib_bf16", "vllm_bf16"),
    "fused w_mxfp4 / tk_mxfp4_unfused_silu": ("mxlib_fused_w_mxfp4", "tk_mxfp4_unfused_silu"),
    "mxlib_bf16 / fused w_mxfp4": ("mxlib_bf16", "mxlib_fused_w_mxfp4"),
    "fused w_mxfp4_a_mxfp4 / tk_mxfp4_unfused_silu": ("mxlib_fused_w_mxfp4_a_mxfp4", "tk_mxfp4_unfused_silu"),
    "mxlib_bf16 / fused w_mxfp4_a_mxfp4": ("mxlib_bf16", "mxlib_fused_w_mxfp4_a_mxfp4"),
    "fused nvfp4 / tk_mxfp4_unfused_silu": ("mxlib_fused_nvfp4", "tk_mxfp4_unfused_silu"),
    "mxlib_bf16 / fused nvfp4": ("mxlib_bf16", "mxlib_fused_nvfp4"),
    "fused nvfp4 hardware / tk_mxfp4_unfused_silu": ("mxlib_fused_nvfp4_hw", "tk_mxfp4_unfused_silu"),
    "mxlib_bf16 / fused nvfp4 hardware": ("mxlib_bf16", "mxlib_fused_nvfp4_hw"),
    "fused w_mxfp4 / fastest mxfp4 external kernel": (
        "mxlib_fused_w_mxfp4",
        "min(vllm_humming_mxfp4, vllm_marlin_mxfp4, tk_mxfp4_unfused_silu)",
    ),
    "fused w_mxfp4_a_mxfp4 / fastest mxfp4 external kernel": (
        "mxlib_fused_w_mxfp4_a_mxfp4",
        "min(vllm_humming_mxfp4, vllm_marlin_mxfp4, tk_mxfp4_unfused_silu)",
    ),
    "fused nvfp4 / fastest nvfp4 external kernel": ("mxlib_fused_nvfp4", "min(vllm_humming_nvfp4, vllm_marlin_nvfp4)"),
    "fused nvfp4 hardware / fastest nvfp4 external kernel": (
        "mxlib_fused_nvfp4_hw",
        "min(vllm_humming_nvfp4, vllm_marlin_nvfp4)",
    ),
    "fused w4a16_nvfp4 / fastest nvfp4 external kernel": (
        "mxlib_fused_w4a16_nvfp4",
        "min(vllm_humming_nvfp4, vllm_marlin_nvfp4)",
    ),
    "fused w4a16_nvfp4 hardware / fastest nvfp4 external kernel": (
        "mxlib_fused_w4a16_nvfp4_hw",
        "min(vllm_humming_nvfp4, vllm_marlin_nvfp4)",
    ),
    "fused w_mxfp4_a_mxfp8 / fastest mxfp4 external kernel": (
        "mxlib_fused_w_mxfp4_a_mxfp8",
        "min(vllm_humming_mxfp4, vllm_marlin_mxfp4, tk_mxfp4_unfused_silu)",
    ),
    "fused w_mxfp4 swigluoai / tk_mxfp4": ("mxlib_fused_w_mxfp4_swigluoai", "tk_mxfp4"),
    "fused w_mxfp4_a_mxfp4 swigluoai / tk_mxfp4": ("mxlib_fused_w_mxfp4_a_mxfp4_swigluoai", "tk_mxfp4"),
    "fused nvfp4 / fused w_mxfp4_a_mxfp4": ("mxlib_fused_nvfp4", "mxlib_fused_w_mxfp4_a_mxfp4"),
    "fused nvfp4_hw / fused w_mxfp4_a_mxfp4": ("mxlib_fused_nvfp4_hw", "mxlib_fused_w_mxfp4_a_mxfp4"),
    "fused w4a16_nvfp4 / fused w_mxfp4": ("mxlib_fused_w4a16_nvfp4", "mxlib_fused_w_mxfp4"),
    "fused w4a16_nvfp4_hw / fused w_mxfp4": ("mxlib_fused_w4a16_nvfp4_hw", "mxlib_fused_w_mxfp4"),
    "fused w_mxfp8 / mxlib_bf16": ("mxlib_fused_w_mxfp8", "mxlib_bf16"),
    "fused w_mxfp8_a_mxfp8 / mxlib_bf16": ("mxlib_fused_w_mxfp8_a_mxfp8", "mxlib_bf16"),
    "fused w_mxfp6_e3m2 / dequantize-then-GEMM": ("mxlib_fused_w_mxfp6_e3m2", "mxlib_triton_w_mxfp6_e3m2"),
    "fused w_mxfp6_e3m2 / mxlib_bf16": ("mxlib_fused_w_mxfp6_e3m2", "mxlib_bf16"),
}

# external rows shown in the ms table, in this order (the tk_bf16 / with-routing rows stay in the JSON)
EXTERNAL_ROWS = (
    "vllm_bf16",
    "vllm_bf16_noalign",
    "tk_mxfp4",
    "tk_mxfp4_unfused_silu",
    "vllm_humming_mxfp4",
    "vllm_marlin_mxfp4",
    "vllm_humming_nvfp4",
    "vllm_marlin_nvfp4",
    "vllm_later_fused_nvfp4",
    "floor_mxfp4",
    "floor_nvfp4",
)


def external_kernel_tables(path) -> dict:
    """The H200 tables of the fused FP4 kernel beside the external-kernel harness, from
    ``python -m mxlib.bench fused --external ...``'s JSON (one run on the device).

    Args:
        path: the JSON file (``benchmarks/h200_fp4_external.json``): ``env``, ``rows`` (mxlib,
            ``path, M, graph_ms[, bound_ms, bound_fraction]``), ``ratios`` (``{M: {name: value}}``),
            ``speed_targets``, ``checks`` and ``external`` (the external-kernel harness's JSON, ``rows`` with
            ``graph_ms``, or ``floor_ms`` for its bandwidth-bound rows ``floor_mxfp4`` / ``floor_nvfp4``: the
            harness's names).

    Returns:
        A dict of lists of rows (every M a column ``M=<m>``, times in ms as CUDA-graph replay
        medians, the harness's ``floor_*`` rows the bandwidth bound's time):

        * ``env``: one row ``device, date, torch, triton, vllm_source, copy_gbs``.
        * ``ms``: ``row, source`` ("external" / "mxlib") then the times.
        * ``ratios``: ``ratio, numerator, denominator`` then the recorded ratios (a ratio of rows not timed in
          that call, all None, is left out).
        * ``speed_targets``: ``target, limit, worst, holds`` ("yes" / "no"), as recorded.
        * ``bound_fraction``: ``row`` then bandwidth-bound time / graph time (0-1): mxlib's fused and
          dequantize-then-GEMM rows as recorded, the triton_kernels rows against ``floor_mxfp4``.
        * ``checks``: the recorded numerics checks ``M, what, rel``.
        * ``Ms``: the token counts, ascending.

    Raises:
        ValueError: a ratio name the JSON records that ``EXTERNAL_RATIOS`` does not know.
    """
    data = json.loads(Path(path).read_text())
    external = data["external"]
    ms = sorted({r["M"] for r in data["rows"]})
    key = [f"M={m}" for m in ms]
    times: dict[str, dict[int, float]] = {}
    for rows in (external["rows"], data["rows"]):
        for r in rows:
            t = r.get("graph_ms", r.get("floor_ms"))
            if t is not None:
                times.setdefault(r["path"], {})[r["M"]] = t
    order = [(p, "external") for p in EXTERNAL_ROWS if p in times]
    order += [(p, "mxlib") for p in dict.fromkeys(r["path"] for r in data["rows"])]
    ms_rows = [dict(row=p, source=src, **{k: times[p].get(m, "") for k, m in zip(key, ms)}) for p, src in order]

    ratio_rows = []
    for name in data["ratios"][str(ms[0])]:
        if name not in EXTERNAL_RATIOS:
            raise ValueError(f"path: ratio {name!r} not in tables.EXTERNAL_RATIOS ({sorted(EXTERNAL_RATIOS)})")
        num, den = EXTERNAL_RATIOS[name]
        if all(data["ratios"][str(m)][name] is None for m in ms):  # rows not timed in this call (``--no-extra``)
            continue
        ratio_rows.append(
            dict(
                ratio=name, numerator=num, denominator=den, **{k: data["ratios"][str(m)][name] for k, m in zip(key, ms)}
            )
        )

    frac_rows = []
    for p in dict.fromkeys(r["path"] for r in data["rows"] if "bound_fraction" in r):
        by = {r["M"]: r["bound_fraction"] for r in data["rows"] if r["path"] == p and "bound_fraction" in r}
        frac_rows.append(dict(row=p, **{k: by.get(m, "") for k, m in zip(key, ms)}))
    for p in ("tk_mxfp4", "tk_mxfp4_unfused_silu"):
        if p in times and "floor_mxfp4" in times:
            frac_rows.append(
                dict(row=f"{p} (external)", **{k: times["floor_mxfp4"][m] / times[p][m] for k, m in zip(key, ms)})
            )

    env = data["env"]
    return dict(
        env=[
            dict(
                device=env["device"],
                date=env["date"],
                torch=env["torch"],
                triton=env["triton"],
                vllm_source=external["env"].get("vllm_source", ""),
                copy_gbs=data["copy_gbs"],
            )
        ],
        ms=ms_rows,
        ratios=ratio_rows,
        speed_targets=[
            dict(target=f["target"], limit=f["limit"], worst=f["worst"], holds="yes" if f["holds"] else "no")
            for f in data["speed_targets"]
        ],
        bound_fraction=frac_rows,
        checks=list(data["checks"]),
        Ms=ms,
    )
