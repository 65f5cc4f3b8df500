"""Tables and checks the notebooks show, as plain functions (the CLI can print the same ones).

* ``Checks``: an assert cell's checks, counted, so the cell can say how many passed.
* ``strategy_summary``: notebook 04's per-expert QDQ table, averaged over experts.
* ``spread_study``: notebook 04's loss-vs-spread sweep, an alias of ``studies.spread_study``.
* ``floors_table`` and ``FLOOR_TARGETS``: notebook 05's floors of the fused MoE emulation.
"""

from __future__ import annotations

import statistics

from . import studies

__all__ = ["Checks", "strategy_summary", "spread_study", "FLOOR_TARGETS", "floors_table"]


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
        experts: ``studies.unification_study(...)["experts"]`` rows (one per layer, expert and
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
            summary.append(dict(point=point, strategy=s, mean_sqnr_db=statistics.mean(r[f"sqnr_{s}"] for r in rows),
                                mean_db_lost=statistics.mean(r[f"db_lost_{s}"] for r in rows),
                                worst_db_lost=max(r[f"db_lost_{s}"] for r in rows),
                                subnormal_blocks=statistics.mean(r[f"subnormal_{s}"] for r in rows),
                                flushed_blocks=statistics.mean(r[f"flushed_{s}"] for r in rows),
                                clipped_elements=statistics.mean(r[f"clipped_{s}"] for r in rows)))
        summary.append(dict(point=point, strategy="OCP MXFP4 (no global scale)",
                            mean_sqnr_db=statistics.mean(r["sqnr_mxfp4"] for r in rows)))
        summary.append(dict(point=point, strategy="OCP MXFP8 e4m3 (no global scale)",
                            mean_sqnr_db=statistics.mean(r["sqnr_mxfp8_e4m3"] for r in rows)))
    return summary


def spread_study(spreads, num_hidden_layers: int = 1, seed: int = 0, calib_tokens: int = 256, device="cpu",
                 model_preset: str = "qwen3-30b-a3b") -> list[dict]:
    """``studies.spread_study`` (kept under this name for notebook 04; same arguments, same rows)."""
    return studies.spread_study(spreads, num_hidden_layers=num_hidden_layers, seed=seed, calib_tokens=calib_tokens,
                                device=device, model_preset=model_preset)


# (scheme, tokens M, fused speed-up wanted over the seed's design (None: no target),
#  fused time allowed as a multiple of bf16's); CUDA-graph replay times.
FLOOR_TARGETS: tuple[tuple[str, int, float | None, float], ...] = tuple(
    (scheme, m, want_seed, want_bf16)
    for scheme in ("nvfp4", "w_mxfp4_a_mxfp4")
    for m, want_seed, want_bf16 in ((1, 10, 1.5), (16, 10, 1.5), (256, 3, 1.5), (1024, None, 1.25), (4096, None, 1.25))
)


def floors_table(rows: list[dict], targets=FLOOR_TARGETS) -> list[dict]:
    """Notebook 05's floors: the fused MoE emulation against the seed's design and bf16.

    Args:
        rows: MoE-layer benchmark rows (``mxlib.bench moe``'s JSON ``rows``) with ``scheme, M,
            seed_graph_ms, fused_graph_ms, bf16_graph_ms, fused_floor_frac_graph, fused_mem_mb,
            packed_weight_mb``.
        targets: ``(scheme, M, wanted speed-up over seed or None, allowed multiple of bf16)``.

    Returns:
        One row per target the benchmark measured: ``scheme, M, fused_vs_seed`` (seed time /
        fused time), ``target_vs_seed`` ("" when none), ``fused_over_bf16`` (fused / bf16 time),
        ``target_over_bf16``, ``meets`` ("yes" / "no"), ``floor_frac`` and
        ``mem_frac_of_packed`` (peak extra memory / packed weight size).
    """
    by: dict[tuple[str, int], dict] = {}
    for r in rows:
        by.setdefault((r["scheme"], r["M"]), r)  # the first row of a (scheme, M), as measured
    floors = []
    for scheme, m, want_seed, want_bf16 in targets:
        r = by.get((scheme, m))
        if r is None:
            continue
        seed_x = r["seed_graph_ms"] / r["fused_graph_ms"]
        bf16_x = r["fused_graph_ms"] / r["bf16_graph_ms"]
        meets = (want_seed is None or seed_x >= want_seed) and bf16_x <= want_bf16
        floors.append(dict(scheme=scheme, M=m, fused_vs_seed=seed_x, target_vs_seed=want_seed or "",
                           fused_over_bf16=bf16_x, target_over_bf16=want_bf16, meets="yes" if meets else "no",
                           floor_frac=r["fused_floor_frac_graph"],
                           mem_frac_of_packed=r["fused_mem_mb"] / r["packed_weight_mb"]))
    return floors
