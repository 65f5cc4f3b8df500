"""How much a recorded time moves from one recording to the next, and "faster" decided against that (notebook 05).

A benchmark recording keeps one median per row and token count M. One median says nothing about how far the next
run would land, so a "faster" read off a single recording needs a spread measured elsewhere. The recordings of
``python -m mxlib.bench fused --external ...`` on the H200 (separate processes, on different days) time the same
reference kernels every time (vLLM's bf16 ``fused_moe``, triton_kernels' paths: ``REFERENCE_ROWS``), whose code did
not change between them. Their medians' movement from recording to recording is the timing noise:

* ``recorded_times(path)``: ``{(row, M): ms}`` of one recording (CUDA-graph replay medians; the reference harness's
  rows and mxlib's), or of a whole-model recording (``python -m mxlib.bench model``: ``path``, ``M``, ``ms``).
* ``timing_spread(recordings, rows)``: per row and M, the lowest and highest median over the recordings and the
  spread ``highest / lowest - 1``.
* ``log_time_noise(recordings, rows)``: per M, the pooled standard deviation of ``log(ms)`` around each row's mean
  over the recordings, and its degrees of freedom (``sum over rows of (recordings - 1)``).
* ``pooled_noise(noise)``: one entry pooled over M (for recordings too few to give each M its own).
* ``add_faster(family, a, b, ms_a, ms_b, noise)``: the comparison "``a`` against ``b``" on ``log(ms)`` from one
  recording, into a ``mxlib.stats.ComparisonFamily``: ``log(ms_a / ms_b)`` with standard error ``sqrt(2) * sd``
  (each of the two medians carries the noise of one recording) and the noise's degrees of freedom. The family
  decides it with the notebook's other comparisons: ``"<a> better"`` means ``a`` is faster beyond the noise.
  ``add_faster_pairs`` adds a list of pairs at every M that both rows were timed at; ``faster_rows`` turns the
  decided verdicts back into time ratios for a table.

The noise is measured on the reference rows and taken to hold for mxlib's rows of the same shape and M (the same
GPU, clocks and timing harness). A whole-model recording has its own noise (its bf16 rows).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..stats import ComparisonFamily, Estimate

__all__ = [
    "REFERENCE_ROWS",
    "EXTERNAL_RECORDINGS",
    "MODEL_RECORDINGS",
    "recorded_times",
    "timing_spread",
    "log_time_noise",
    "pooled_noise",
    "add_faster",
    "add_faster_pairs",
    "faster_rows",
]

# rows whose code is the same in every recording: vLLM's and triton_kernels' kernels (the reference harness)
REFERENCE_ROWS = ("vllm_bf16", "vllm_bf16_noalign", "tk_bf16", "tk_mxfp4", "tk_mxfp4_unfused_silu")
# the recordings of the FP4 kernel beside the reference harness, in benchmarks/ (one H200, separate processes)
EXTERNAL_RECORDINGS = (
    "h200_fp4_external.json",
    "h200_fp4_external_operand_layout.json",
    "h200_fp4_external_smem_decode.json",
    "h200_fp4_humming.json",
    "h200_fp4_swigluoai.json",
    "h200_fused_fp4.json",
)
# the recordings of the 48-layer forward; their bf16 rows (transformers' model, mxlib's bf16 experts) are the same code
MODEL_RECORDINGS = ("h200_model48.json", "h200_model48_operand_layout.json")


def recorded_times(path) -> dict[tuple[str, int], float]:
    """``{(row, M): ms}`` of one recording: the reference harness's ``external.rows`` and mxlib's ``rows`` (their
    ``graph_ms``), or a whole-model recording's ``rows`` (``path``, ``M``, ``ms``). Rows without a time (memory
    bounds, which are computed) are left out.

    Raises:
        FileNotFoundError: no such file; ValueError: a file holding no timed row.
    """
    data = json.loads(Path(path).read_text())
    rows = list(data.get("rows", []))
    if isinstance(data.get("external"), dict):
        rows += data["external"].get("rows", [])
    out = {}
    for r in rows:
        t = r.get("graph_ms", r.get("ms"))
        if isinstance(r, dict) and "path" in r and t is not None:
            out[(r["path"], int(r["M"]))] = float(t)
    if not out:
        raise ValueError(f"path: {path} holds no timed row (expected rows with path, M and graph_ms or ms)")
    return out


def _series(recordings, rows) -> dict[tuple[str, int], list[float]]:
    times = [recorded_times(p) for p in recordings]
    keys = sorted({k for t in times for k in t if k[0] in rows}, key=lambda k: (rows.index(k[0]), k[1]))
    return {k: [t[k] for t in times if k in t] for k in keys}


def timing_spread(recordings, rows=REFERENCE_ROWS) -> list[dict]:
    """Per row of ``rows`` and M: ``row, M, recordings`` (how many hold it), ``lowest_ms, highest_ms`` and
    ``spread`` (``highest / lowest - 1``) over the ``recordings`` (paths)."""
    rows = tuple(rows)
    return [
        dict(row=k[0], M=k[1], recordings=len(v), lowest_ms=min(v), highest_ms=max(v), spread=max(v) / min(v) - 1)
        for k, v in _series(recordings, rows).items()
    ]


def log_time_noise(recordings, rows=REFERENCE_ROWS) -> dict[int, dict]:
    """Per M: ``{"sd": pooled standard deviation of log(ms), "df": degrees of freedom, "rows": rows pooled}`` over
    the rows of ``rows`` that at least two ``recordings`` hold.

    Raises:
        ValueError: no row of ``rows`` held by two recordings.
    """
    rows = tuple(rows)
    acc: dict[int, list] = {}
    for (_, m), v in _series(recordings, rows).items():
        if len(v) < 2:
            continue
        logs = [math.log(x) for x in v]
        mean = sum(logs) / len(logs)
        s = acc.setdefault(m, [0.0, 0, 0])
        s[0] += sum((x - mean) ** 2 for x in logs)
        s[1] += len(logs) - 1
        s[2] += 1
    if not acc:
        raise ValueError(f"recordings: no row of {list(rows)} is held by two of them")
    return {m: dict(sd=math.sqrt(ss / df), df=df, rows=n) for m, (ss, df, n) in sorted(acc.items())}


def add_faster(
    family: ComparisonFamily, a: str, b: str, ms_a: float, ms_b: float, noise: dict, *, M: int, key: str | None = None
) -> str:
    """Add "``a`` against ``b`` at ``M`` tokens" (one recording's medians ``ms_a``, ``ms_b``) to ``family`` on
    ``log(ms)`` (lower is better), with the standard error ``sqrt(2) * noise["sd"]`` and ``noise["df"]`` degrees of
    freedom (``log_time_noise(...)[M]``); returns its key (default ``f"{a} vs {b} at M={M}"``).

    Raises:
        ValueError: a time that is not positive and finite, a noise without ``sd`` / ``df``; as
            ``ComparisonFamily.add_estimate``.
    """
    for name, t in (("ms_a", ms_a), ("ms_b", ms_b)):
        if not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
            raise ValueError(f"{name}: expected a positive time in ms, got {t!r}")
    if not (isinstance(noise, dict) and {"sd", "df"} <= set(noise)):
        raise ValueError(f"noise: expected a log_time_noise entry with sd and df, got {noise!r}")
    est = Estimate(mean=math.log(ms_a / ms_b), se=math.sqrt(2.0) * noise["sd"], df=int(noise["df"]), n=1, over="units")
    return family.add_estimate(
        a,
        b,
        est,
        metric="log time",
        higher_is_better=False,
        unit_name="recording (noise: recording to recording)",
        key=key or f"{a} vs {b} at M={M}",
    )


def pooled_noise(noise: dict[int, dict]) -> dict:
    """``log_time_noise``'s entries pooled over M: ``{"sd", "df", "rows"}`` (sums of squares and degrees of
    freedom added). ValueError: an empty ``noise``."""
    if not noise:
        raise ValueError("noise: expected at least one entry of log_time_noise, got none")
    ss = sum(v["sd"] ** 2 * v["df"] for v in noise.values())
    df = sum(v["df"] for v in noise.values())
    return dict(sd=math.sqrt(ss / df), df=df, rows=sum(v["rows"] for v in noise.values()))


def add_faster_pairs(family: ComparisonFamily, times: dict, pairs, noise: dict) -> list[str]:
    """``add_faster`` for each ``(a, b)`` of ``pairs`` at every M where ``times`` (``recorded_times``) holds both;
    ``noise`` is ``log_time_noise``'s ``{M: entry}`` or one ``pooled_noise`` entry for every M. Returns the keys.

    Raises:
        ValueError: a pair timed at no common M, or no noise entry for an M.
    """
    keys = []
    per_m = not {"sd", "df"} <= set(noise)
    for a, b in pairs:
        ms = sorted({m for r, m in times if r == a} & {m for r, m in times if r == b})
        if not ms:
            raise ValueError(f"pairs: {a!r} and {b!r} are timed at no common M")
        for m in ms:
            if per_m and m not in noise:
                raise ValueError(f"noise: no entry for M={m} (entries: {sorted(noise)})")
            keys.append(add_faster(family, a, b, times[(a, m)], times[(b, m)], noise[m] if per_m else noise, M=m))
    return keys


def faster_rows(decisions) -> list[dict]:
    """One row per decided comparison of ``add_faster``: ``a, b, M`` (from the key), ``verdict``, ``time_ratio``
    (``ms_a / ms_b``) and its simultaneous interval ``ratio_low``, ``ratio_high``."""
    out = []
    for key, v in decisions.items():
        m = key.rsplit("M=", 1)[-1]
        out.append(
            dict(
                a=v.a,
                b=v.b,
                M=int(m) if m.isdigit() else m,
                verdict=v.verdict.replace(" better", " faster"),
                time_ratio=math.exp(v.difference),
                ratio_low=math.exp(v.low),
                ratio_high=math.exp(v.high),
            )
        )
    return out
