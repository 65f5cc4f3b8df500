"""Checks and tables the notebooks show, as plain functions (the CLI and the benchmarks print the same ones).

* ``Checks``: an assert cell's checks, counted, so the cell can say how many passed.
* ``strategy_summary``: notebook 04's per-expert QDQ table, averaged over experts.
* ``floors_table`` and ``FLOOR_TARGETS``: notebook 05's floors of the fused MoE emulation.
* ``anchor_tables`` and ``ANCHOR_RATIOS``: notebook 05's tables of the fused FP4 kernel beside the anchor harness
  (H200).
* ``EXERCISES`` and ``check_exercise``: the notebooks' "try this" prompts and their checkers;
  ``floor_clips_rceil_does_not`` (notebooks 00 and 02), ``loses_without_flushing`` and
  ``is_largest_flushing_power_of_two`` (notebook 04) check an answer on the explorers' numbers.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import torch

from .. import reference as R
from . import explorers, probes

__all__ = [
    "Checks",
    "strategy_summary",
    "FLOOR_TARGETS",
    "floors_table",
    "EXERCISES",
    "check_exercise",
    "floor_clips_rceil_does_not",
    "loses_without_flushing",
    "is_largest_flushing_power_of_two",
    "ANCHOR_RATIOS",
    "anchor_tables",
]


class Checks:
    """Counted assertions: ``check(condition, detail)`` raises ``AssertionError(detail)`` when the
    condition is false and counts it otherwise; ``str(check)`` says how many passed.

    A checks cell ends with ``print(check)``, so a reader sees that the checks ran.
    """

    def __init__(self) -> None:
        self.passed = 0

    def __call__(self, condition, detail="") -> None:
        if not condition:
            raise AssertionError(detail)
        self.passed += 1

    def __str__(self) -> str:
        return f"{self.passed} checks passed"


def strategy_summary(experts: list[dict], strategies) -> list[dict]:
    """Mean over experts of each strategy's QDQ metrics at a1 and a2, plus OCP MX for comparison.

    Args:
        experts: ``mxlib.workbook.studies.unification_study(...)["experts"]`` rows (one per layer, expert and
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
FLOOR_TARGETS: tuple[tuple[str, int, float | None, float], ...] = tuple(
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


def floors_table(rows: list[dict], targets=FLOOR_TARGETS) -> list[dict]:
    """Notebook 05's floors: the fused MoE emulation against vLLM's emulation design and bf16.

    Args:
        rows: MoE-layer benchmark rows (``mxlib.bench moe``'s JSON ``rows``) with ``scheme, M,
            dequant_graph_ms, fused_graph_ms, bf16_graph_ms, fused_floor_frac_graph, fused_mem_mb,
            packed_weight_mb``.
        targets: ``(scheme, M, wanted speed-up over the dequantize-then-GEMM path or None, allowed multiple of bf16)``.

    Returns:
        One row per target the benchmark measured: ``scheme, M, fused_vs_dequant`` (seed time /
        fused time), ``target_vs_dequant`` ("" when none), ``fused_over_bf16`` (fused / bf16 time),
        ``target_over_bf16``, ``meets`` ("yes" / "no"), ``floor_frac`` and
        ``mem_frac_of_packed`` (peak extra memory / packed weight size).
    """
    by: dict[tuple[str, int], dict] = {}
    for r in rows:
        by.setdefault((r["scheme"], r["M"]), r)  # the first row of a (scheme, M), as measured
    floors = []
    for scheme, m, want_dequant, want_bf16 in targets:
        r = by.get((scheme, m))
        if r is None:
            continue
        dequant_x = r["dequant_graph_ms"] / r["fused_graph_ms"]
        bf16_x = r["fused_graph_ms"] / r["bf16_graph_ms"]
        meets = (want_dequant is None or dequant_x >= want_dequant) and bf16_x <= want_bf16
        floors.append(
            dict(
                scheme=scheme,
                M=m,
                fused_vs_dequant=dequant_x,
                target_vs_dequant=want_dequant or "",
                fused_over_bf16=bf16_x,
                target_over_bf16=want_bf16,
                meets="yes" if meets else "no",
                floor_frac=r["fused_floor_frac_graph"],
                mem_frac_of_packed=r["fused_mem_mb"] / r["packed_weight_mb"],
            )
        )
    return floors


# ----------------------------------------------------------------------------- exercises
# name -> the prompt a notebook shows. ``check_exercise(name, answer, **context)`` says whether an
# answer is right; the checkers compute the answer with mxlib (never a stored literal), so they
# stay right if the formats or the data change.
EXERCISES: dict[str, str] = {
    "01.fp6_shapes": "A Quark w_mxfp6_e2m3 checkpoint of Qwen3-30B-A3B stores each expert's gate_proj "
    "(out 768, in 2048). Give (weight shape, weight_scale shape) as two tuples.",
    "01.decode_byte": "An NVFP4 weight byte 0x2B, its block scale byte 0x38 (e4m3 1.0) and weight_scale_2 = "
    "2**-10: give the two weights it decodes to, low nibble first.",
    "02.floor_clips": "Find a 32-value MXFP8 (e4m3) block in which the OCP floor rule clips an element and "
    "rceil does not.",
    "02.e4m3_code": "Which e4m3 code (an int, e.g. 0x79) does 300.0 round to?",
    "02.outlier_gap": "With explorers.outlier_scale_sqnr, find the smallest outlier_scale among 1, 10, 100, 1000 "
    "and 10000 at which NVFP4 beats MXFP4 by more than 3 dB.",
    "03.best_4bit": "Which 4.25-bit scheme has the highest logits SQNR in this run?",
    "03.nvfp4_bits_32": "NVFP4 with blocks of 32 instead of 16 (still one e4m3 scale a block): how many bits "
    "per weight, scales included (the per-tensor fp32 scale is negligible)?",
    "05.packed_bytes": "How many bytes do one Qwen3-30B-A3B layer's NVFP4 expert weights and block scales "
    "take (128 experts; w13 [2 * 768, 2048] and w2 [2048, 768] each)?",
    "05.dequant_wins_at": "In the recorded MoE-layer rows, from which token count M on does vLLM's emulation design "
    "beat the fused path for nvfp4 (CUDA-graph times)? Answer the smallest such M.",
}


def _exercise_answer(name: str, **context):
    """The right answer of exercise ``name`` (``rows`` in ``context`` where the exercise reads a run)."""
    if name == "01.fp6_shapes":
        sh = probes.stored_shapes("w_mxfp6_e2m3", 768, 2048)
        return (sh["weight"][0], sh["weight_scale"][0])
    if name == "01.decode_byte":
        codes = R.unpack_codes(torch.tensor([[0x2B]], dtype=torch.uint8), "e2m1")[0]
        return tuple(float(v) * 2.0**-10 for v in R.decode_element(codes, "e2m1"))
    if name == "02.e4m3_code":
        return explorers.value_info(300.0, "e4m3")["code"]
    if name == "02.outlier_gap":
        for scale in (1, 10, 100, 1000, 10000):
            r = explorers.outlier_scale_sqnr(scale, schemes=("mxfp4", "nvfp4"))
            if r["nvfp4"] - r["mxfp4"] > 3.0:
                return scale
        return None
    if name == "03.best_4bit":
        rows = [r for r in context["rows"] if r["bits_per_weight"] == 4.25]
        return max(rows, key=lambda r: r["sqnr_db"])["scheme"]
    if name == "03.nvfp4_bits_32":
        return 4 + 8 / 32
    if name == "05.packed_bytes":
        sh = [probes.stored_shapes("nvfp4", o, i) for o, i in ((2 * 768, 2048), (2048, 768))]
        return 128 * sum(math.prod(s["weight"][0]) + math.prod(s["weight_scale"][0]) for s in sh)
    if name == "05.dequant_wins_at":
        scheme = context.get("scheme", "nvfp4")  # a benchmark row's label (data), not a format lookup
        rows = sorted((r for r in context["rows"] if r["scheme"] == scheme), key=lambda r: r["M"])
        return next((r["M"] for r in rows if r["dequant_graph_ms"] < r["fused_graph_ms"]), None)
    raise KeyError(f"name: expected one of {sorted(EXERCISES)}, got {name!r}")


def check_exercise(name: str, answer, **context) -> bool:
    """Check a "try this" answer; prints why and returns True when it is right.

    Args:
        name: a key of ``EXERCISES`` (the notebook shows its prompt).
        answer: the learner's answer, in the form the prompt asks (a block for ``02.floor_clips``).
        context: ``rows=...`` for the exercises that read a run's table (``03.best_4bit``,
            ``05.dequant_wins_at``).

    Numbers are compared with a relative tolerance of 1% (``05.packed_bytes``) or exactly.

    Raises:
        KeyError: unknown exercise name.
    """
    if name not in EXERCISES:
        raise KeyError(f"name: expected one of {sorted(EXERCISES)}, got {name!r}")
    if name == "02.floor_clips":
        try:
            ok = floor_clips_rceil_does_not(answer, "mxfp8_e4m3")
        except ValueError as err:
            print(f"not a valid block: {err}")
            return False
        print(
            "right: floor clips, rceil does not"
            if ok
            else "not yet: floor must saturate an element (|x| / scale > 448) while rceil keeps it"
        )
        return ok
    want = _exercise_answer(name, **context)
    if name == "05.packed_bytes":
        ok = isinstance(answer, (int, float)) and abs(answer - want) <= 0.01 * want
    elif isinstance(want, tuple):
        ok = tuple(tuple(a) if isinstance(a, (list, tuple)) else a for a in answer) == want
    else:
        ok = answer == want
    print("right" if ok else f"not yet (the checker computes {want!r})")
    return ok


def floor_clips_rceil_does_not(block, scheme: str = "mxfp4") -> bool:
    """Exercise checker: True when the OCP floor rule saturates an element of ``block`` and rceil does not."""
    floor = explorers.block_info(block, scheme, "floor")
    rceil = explorers.block_info(block, scheme, "rceil")
    return any(floor["clipped"]) and not any(rceil["clipped"])


def loses_without_flushing(ratio: float, min_db: float = 2.0, **kwargs) -> bool:
    """Exercise checker (notebook 04): True when, at this ``ratio``, the smallest synthetic expert of
    ``expert_scale_ratio`` loses more than ``min_db`` dB under the unified scale against its own scale
    while none of its blocks is flushed (its block scales are subnormal, not zero). Answers lie
    between ``mxlib.formats.NVFP4_FLUSH_RATIO`` and ``NVFP4_SUBNORMAL_RATIO``. ``kwargs`` go to
    ``explorers.expert_scale_ratio``."""
    row = explorers.expert_scale_ratio(float(ratio), **kwargs)[-1]
    return row["sqnr_per_expert_db"] - row["sqnr_unified_db"] > min_db and row["flushed_blocks"] == 0.0


def is_largest_flushing_power_of_two(ratio: float, **kwargs) -> bool:
    """Exercise checker (notebook 04): True when ``ratio`` is a power of two at which every block of
    the smallest synthetic expert is flushed under the unified scale (its QDQ output is all zero)
    while at ``2 * ratio`` at least one block survives.

    By hand: the expert's largest block scale is ``e4m3(448 * ratio)`` and rounds to zero when it is
    at most ``2**-10`` (half the smallest subnormal ``2**-9``; the tie goes to the even code 0), so
    the answer is ``2**-19`` (``448 * 2**-19 = 0.875 * 2**-10``; ``448 * 2**-18 = 1.75 * 2**-10``
    rounds up to ``2**-9``).

    Raises:
        ValueError: ``ratio`` not in (0, 1].
    """
    ratio = float(ratio)
    if not (0.0 < ratio <= 1.0):
        raise ValueError(f"ratio: expected a number in (0, 1], got {ratio}")
    if math.frexp(ratio)[0] != 0.5:
        return False
    here = explorers.expert_scale_ratio(ratio, **kwargs)[-1]["flushed_blocks"]
    above = explorers.expert_scale_ratio(min(2.0 * ratio, 1.0), **kwargs)[-1]["flushed_blocks"] if ratio < 1.0 else 0.0
    return here == 1.0 and above < 1.0


# ----------------------------------------------------------------------------- the FP4 kernel beside the anchors (H200)
# ratio name as the benchmark's JSON records it -> (numerator row, denominator row); rows are the
# ``path`` names of the JSON's ``rows`` (mxlib) and ``anchor.rows`` (vLLM, triton_kernels).
ANCHOR_RATIOS: dict[str, tuple[str, str]] = {
    "mxlib_bf16 / vllm_bf16": ("mxlib_bf16", "vllm_bf16"),
    "fused w_mxfp4 / tk_mxfp4_unfused_silu": ("mxlib_fused_w_mxfp4", "tk_mxfp4_unfused_silu"),
    "mxlib_bf16 / fused w_mxfp4": ("mxlib_bf16", "mxlib_fused_w_mxfp4"),
    "fused w_mxfp4_a_mxfp4 / tk_mxfp4_unfused_silu": ("mxlib_fused_w_mxfp4_a_mxfp4", "tk_mxfp4_unfused_silu"),
    "mxlib_bf16 / fused w_mxfp4_a_mxfp4": ("mxlib_bf16", "mxlib_fused_w_mxfp4_a_mxfp4"),
    "fused nvfp4 / tk_mxfp4_unfused_silu": ("mxlib_fused_nvfp4", "tk_mxfp4_unfused_silu"),
    "mxlib_bf16 / fused nvfp4": ("mxlib_bf16", "mxlib_fused_nvfp4"),
    "fused nvfp4 hardware / tk_mxfp4_unfused_silu": ("mxlib_fused_nvfp4_hw", "tk_mxfp4_unfused_silu"),
    "mxlib_bf16 / fused nvfp4 hardware": ("mxlib_bf16", "mxlib_fused_nvfp4_hw"),
    "fused w_mxfp4 / fastest mxfp4 anchor": (
        "mxlib_fused_w_mxfp4",
        "min(vllm_humming_mxfp4, vllm_marlin_mxfp4, tk_mxfp4_unfused_silu)",
    ),
    "fused w_mxfp4_a_mxfp4 / fastest mxfp4 anchor": (
        "mxlib_fused_w_mxfp4_a_mxfp4",
        "min(vllm_humming_mxfp4, vllm_marlin_mxfp4, tk_mxfp4_unfused_silu)",
    ),
    "fused nvfp4 / fastest nvfp4 anchor": ("mxlib_fused_nvfp4", "min(vllm_humming_nvfp4, vllm_marlin_nvfp4)"),
    "fused nvfp4 hardware / fastest nvfp4 anchor": (
        "mxlib_fused_nvfp4_hw",
        "min(vllm_humming_nvfp4, vllm_marlin_nvfp4)",
    ),
    "fused w4a16_nvfp4 / fastest nvfp4 anchor": (
        "mxlib_fused_w4a16_nvfp4",
        "min(vllm_humming_nvfp4, vllm_marlin_nvfp4)",
    ),
    "fused w4a16_nvfp4 hardware / fastest nvfp4 anchor": (
        "mxlib_fused_w4a16_nvfp4_hw",
        "min(vllm_humming_nvfp4, vllm_marlin_nvfp4)",
    ),
    "fused w_mxfp4_a_mxfp8 / fastest mxfp4 anchor": (
        "mxlib_fused_w_mxfp4_a_mxfp8",
        "min(vllm_humming_mxfp4, vllm_marlin_mxfp4, tk_mxfp4_unfused_silu)",
    ),
    "fused w_mxfp6_e3m2 / dequantize-then-GEMM": ("mxlib_fused_w_mxfp6_e3m2", "mxlib_triton_w_mxfp6_e3m2"),
    "fused w_mxfp6_e3m2 / mxlib_bf16": ("mxlib_fused_w_mxfp6_e3m2", "mxlib_bf16"),
}

# anchor rows shown in the ms table, in this order (the tk_bf16 / with-routing rows stay in the JSON)
ANCHOR_ROWS = (
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


def anchor_tables(path) -> dict:
    """The H200 tables of the fused FP4 kernel beside the anchor harness, from
    ``python -m mxlib.bench fused --anchor ...``'s JSON (one device call).

    Args:
        path: the JSON file (``benchmarks/h200_fp4_anchors.json``): ``env``, ``rows`` (mxlib,
            ``path, M, graph_ms[, floor_ms, floor_fraction]``), ``ratios`` (``{M: {name: value}}``),
            ``floors``, ``checks`` and ``anchor`` (the anchor harness's JSON, ``rows`` with
            ``graph_ms`` or ``floor_ms``).

    Returns:
        A dict of lists of rows (every M a column ``M=<m>``, times in ms as CUDA-graph replay
        medians, floor rows the memory floor's time):

        * ``env``: one row ``device, date, torch, triton, vllm_source, copy_gbs``.
        * ``ms``: ``row, source`` ("anchor" / "mxlib") then the times.
        * ``ratios``: ``ratio, numerator, denominator`` then the recorded ratios (a ratio of rows not timed in
          that call, all None, is left out).
        * ``floors``: ``floor, limit, worst, holds`` ("yes" / "no"), as recorded.
        * ``floor_fraction``: ``row`` then floor time / graph time (0-1): mxlib's fused and
          dequantize-then-GEMM rows as recorded, the triton_kernels rows against ``floor_mxfp4``.
        * ``checks``: the recorded numerics checks ``M, what, rel``.
        * ``Ms``: the token counts, ascending.

    Raises:
        ValueError: a ratio name the JSON records that ``ANCHOR_RATIOS`` does not know.
    """
    data = json.loads(Path(path).read_text())
    anchor = data["anchor"]
    ms = sorted({r["M"] for r in data["rows"]})
    key = [f"M={m}" for m in ms]
    times: dict[str, dict[int, float]] = {}
    for rows in (anchor["rows"], data["rows"]):
        for r in rows:
            t = r.get("graph_ms", r.get("floor_ms"))
            if t is not None:
                times.setdefault(r["path"], {})[r["M"]] = t
    order = [(p, "anchor") for p in ANCHOR_ROWS if p in times]
    order += [(p, "mxlib") for p in dict.fromkeys(r["path"] for r in data["rows"])]
    ms_rows = [dict(row=p, source=src, **{k: times[p].get(m, "") for k, m in zip(key, ms)}) for p, src in order]

    ratio_rows = []
    for name in data["ratios"][str(ms[0])]:
        if name not in ANCHOR_RATIOS:
            raise ValueError(f"path: ratio {name!r} not in checks.ANCHOR_RATIOS ({sorted(ANCHOR_RATIOS)})")
        num, den = ANCHOR_RATIOS[name]
        if all(data["ratios"][str(m)][name] is None for m in ms):  # rows not timed in this call (``--no-extra``)
            continue
        ratio_rows.append(
            dict(
                ratio=name, numerator=num, denominator=den, **{k: data["ratios"][str(m)][name] for k, m in zip(key, ms)}
            )
        )

    frac_rows = []
    for p in dict.fromkeys(r["path"] for r in data["rows"] if "floor_fraction" in r):
        by = {r["M"]: r["floor_fraction"] for r in data["rows"] if r["path"] == p and "floor_fraction" in r}
        frac_rows.append(dict(row=p, **{k: by.get(m, "") for k, m in zip(key, ms)}))
    for p in ("tk_mxfp4", "tk_mxfp4_unfused_silu"):
        if p in times and "floor_mxfp4" in times:
            frac_rows.append(
                dict(row=f"{p} (anchor)", **{k: times["floor_mxfp4"][m] / times[p][m] for k, m in zip(key, ms)})
            )

    env = data["env"]
    return dict(
        env=[
            dict(
                device=env["device"],
                date=env["date"],
                torch=env["torch"],
                triton=env["triton"],
                vllm_source=anchor["env"].get("vllm_source", ""),
                copy_gbs=data["copy_gbs"],
            )
        ],
        ms=ms_rows,
        ratios=ratio_rows,
        floors=[
            dict(floor=f["floor"], limit=f["limit"], worst=f["worst"], holds="yes" if f["holds"] else "no")
            for f in data["floors"]
        ],
        floor_fraction=frac_rows,
        checks=list(data["checks"]),
        Ms=ms,
    )
