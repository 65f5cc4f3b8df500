"""The checkers of the exercises on stored checkpoints and runs (notebooks 01, 03, 05, 06 and 07).

Each ``check_<x>(answer, **context)`` returns None when the answer is right, else a hint that does
not contain the answer; each ``solve_<x>(**context)`` returns (an answer that passes, the reasoning).
``rows`` in ``context`` is the run's table where an exercise reads one.
"""

from __future__ import annotations

import math

import torch

from .. import reference as R
from ..formats import get_element_format
from ..stats import ComparisonFamily
from ..studies import probes
from ._exercise_formats import as_int, as_number, as_tuple

_E2M1 = get_element_format("e2m1")
_E4M3 = get_element_format("e4m3")


def check_fp6_shapes(answer, **_):
    sh = probes.stored_shapes("w_mxfp6_e2m3", 768, 2048)
    want_w, want_s = sh["weight"][0], sh["weight_scale"][0]
    got = as_tuple(answer)
    if not (
        isinstance(got, tuple)
        and len(got) == 2
        and all(isinstance(p, tuple) and len(p) == 2 and all(as_int(v) is not None for v in p) for p in got)
    ):
        return "give two shapes, (weight shape, weight_scale shape), each (rows, columns)"
    (w_rows, w_cols), (s_rows, s_cols) = ((as_int(a), as_int(b)) for a, b in got)
    if (w_rows, w_cols) == want_w and (s_rows, s_cols) == want_s:
        return None
    if w_rows != 768 or s_rows != 768:
        return "rows are the output features (gate_proj's out 768); columns run along the input features"
    hints = []
    if w_cols != want_w[1]:
        if w_cols == 2048:
            hints.append(
                "the weight is stored as packed uint8 bytes, not one code a byte: FP6 packs four codes into three bytes"
            )
        elif w_cols == 1024:
            hints.append("two codes a byte is FP4's packing: FP6 packs four codes into three bytes")
        elif w_cols == 2048 * 6:
            hints.append("that counts bits; the weight's columns count bytes")
        else:
            hints.append("the weight's columns are the bytes of one packed row: FP6 packs four codes into three bytes")
    else:
        hints.append("the weight shape is right")
    if s_cols != want_s[1]:
        if s_cols == 2048 // 16:
            hints.append("one scale per 16 inputs is NVFP4's; OCP MX shares one E8M0 scale among 32")
        else:
            hints.append("weight_scale holds one E8M0 byte per block of 32 inputs")
    else:
        hints.append("the weight_scale shape is right")
    return "; ".join(hints)


def solve_fp6_shapes(**_):
    sh = probes.stored_shapes("w_mxfp6_e2m3", 768, 2048)
    want = (sh["weight"][0], sh["weight_scale"][0])
    return want, (
        f"2048 FP6 codes = 2048 * 6 / 8 = {want[0][1]} bytes a row; 2048 / 32 = {want[1][1]} E8M0 scales a row "
        f"(probes.stored_shapes): weight {want[0]}, weight_scale {want[1]}."
    )


def _decode_byte_answer():
    codes = R.unpack_codes(torch.tensor([[0x2B]], dtype=torch.uint8), "e2m1")[0]
    return tuple(float(v) * 2.0**-10 for v in R.decode_element(codes, "e2m1"))


def check_decode_byte(answer, **_):
    want = _decode_byte_answer()
    got = as_tuple(answer)
    if not (isinstance(got, tuple) and len(got) == 2 and all(as_number(v) is not None for v in got)):
        return "give two numbers, (low-nibble weight, high-nibble weight)"
    got = tuple(as_number(v) for v in got)
    if got == want:
        return None
    if got == want[::-1]:
        return "right values, wrong order: which nibble of a packed byte holds the first of its two elements?"
    unscaled = tuple(v / 2.0**-10 for v in want)
    if got == unscaled:
        return "those are the e2m1 values; a weight is e2m1 value * block scale * weight_scale_2"
    if tuple(abs(v) for v in got) == tuple(abs(v) for v in want):
        return "check the signs: bit 3 of a nibble is the sign bit"
    if tuple(abs(v) for v in got) == tuple(abs(v) for v in want[::-1]):
        return "check the order of the two nibbles, and which bit of a nibble is its sign"
    return (
        "decode each nibble as sign (bit 3), 2 exponent bits and 1 mantissa bit (X.bit_fields(code, 'e2m1')), then "
        "multiply by the block scale and weight_scale_2"
    )


def solve_decode_byte(**_):
    want = _decode_byte_answer()
    return want, (
        "low nibble 0xB = 1 01 1 = -1.5, high nibble 0x2 = 0 01 0 = 1.0; times the block scale 1.0 and "
        f"weight_scale_2 = 2**-10: {want}."
    )


SQNR_METRIC = "logits SQNR (dB)"


def _four_bit(rows):
    return [r for r in rows if r["bits_per_weight"] == 4.25]


def _tied_with_best(rows, decisions=None) -> list[str]:
    """The 4.25-bit schemes that cannot be told from the best on the logits SQNR, best mean first: by the notebook's
    ``decisions`` (``mxlib.stats.Decisions`` holding every pair of them on ``SQNR_METRIC``) where given, else by a
    family of every pair over the rows' token sets (``sqnr_db_repeats``, at least two), else the one highest
    ``sqnr_db`` (a run of one token set cannot tell more)."""
    four = sorted(_four_bit(rows), key=lambda r: -r["sqnr_db"])
    names = [r["scheme"] for r in four]
    if decisions is not None:
        return decisions.not_beaten(names, SQNR_METRIC)
    if len(four) > 1 and all(len(r.get("sqnr_db_repeats", ())) >= 2 for r in four):
        family = ComparisonFamily("03.best_4bit: every pair of 4.25-bit schemes")
        family.add_pairs(
            {r["scheme"]: r["sqnr_db_repeats"] for r in four}, metric=SQNR_METRIC, higher_is_better=True, over="draws"
        )
        return family.decide().not_beaten(names, SQNR_METRIC)
    return names[:1]


def check_best_4bit(answer, rows=(), decisions=None, **_):
    by = {r["scheme"]: r for r in rows}
    answer = str(answer).strip()
    if answer not in by:
        return "not a scheme of this run's table: copy a name from its scheme column"
    if by[answer]["bits_per_weight"] != 4.25:
        return (
            f"that scheme costs {by[answer]['bits_per_weight']} bits per weight; the question asks among the "
            "4.25-bit ones"
        )
    if answer in _tied_with_best(rows, decisions):
        return None
    return (
        "a 4.25-bit scheme, but another 4.25-bit scheme is decided better than it over the token sets (the verdict "
        "table): look for the ones no other scheme is decided better than"
    )


def solve_best_4bit(rows=(), decisions=None, **_):
    tied = _tied_with_best(rows, decisions)
    return tied[0], (
        f"Among the 4.25-bit rows ({', '.join(r['scheme'] for r in _four_bit(rows))}), no other scheme is decided "
        f"better than {', '.join(tied)} on the logits SQNR over the token sets: any of them passes; "
        f"{tied[0]} has the highest mean ({max(r['sqnr_db'] for r in _four_bit(rows)):.2f} dB)."
    )


def _nvfp4_bits_32() -> float:
    return _E2M1.nbits + _E4M3.nbits / 32


def check_nvfp4_bits_32(answer, **_):
    v = as_number(answer)
    if v is None:
        return "give a number of bits, e.g. 4.5 or '9/2'"
    want = _nvfp4_bits_32()
    if abs(v - want) <= 1e-9 * want:
        return None
    if v == _E2M1.nbits + _E4M3.nbits / 16:
        return "that is NVFP4 with its blocks of 16; with 32 the 8-bit scale is shared by twice as many weights"
    if v == _E2M1.nbits:
        return "scales included: each block's 8-bit e4m3 scale is spread over its weights"
    if v == _E2M1.nbits + 4 / 32:
        return "an e4m3 scale takes 8 bits, not 4"
    if v == _E4M3.nbits / 32:
        return "add the element's own 4 bits to the scale's share"
    return (
        f"{v:g} bits is not what one weight costs: count the bits that one block of 32 weights stores, its codes "
        "and its one scale, and share them among its weights"
    )


def solve_nvfp4_bits_32(**_):
    want = _nvfp4_bits_32()
    return want, f"4 element bits + 8 scale bits / 32 weights = {want}: the same cost as an MX block's E8M0 scale."


def _packed_bytes() -> int:
    sh = [probes.stored_shapes("nvfp4", o, i) for o, i in ((2 * 768, 2048), (2048, 768))]
    return 128 * sum(math.prod(s["weight"][0]) + math.prod(s["weight_scale"][0]) for s in sh)


def check_packed_bytes(answer, **_):
    v = as_number(answer)
    if v is None or v <= 0:
        return "give a positive number of bytes"
    want = _packed_bytes()
    ratio = v / want
    if abs(ratio - 1) <= 0.01:
        return None
    for factor, hint in (
        (2 / (9 / 16), "that is the bf16 size: 2 bytes a weight; NVFP4 stores half a byte a weight plus the scales"),
        (1 / (9 / 16), "one byte a weight: FP4 packs two codes into a byte"),
        ((1 / 2) / (9 / 16), "weights only: add one e4m3 scale byte per 16 weights"),
        ((1 / 2 + 1 / 32) / (9 / 16), "one scale byte per 32 weights is OCP MX's; NVFP4 has one per 16"),
        (8.0, "that counts bits; the question asks for bytes"),
        (1 / 128, "that is one expert; the layer has 128"),
        (2 / 3, "w13 is [2 * 768, 2048] (gate and up stacked) and w2 [2048, 768]: count both, w13 twice as large"),
        (1 / 3, "w13 is [2 * 768, 2048] (gate and up stacked) and w2 [2048, 768]: count both"),
    ):
        if abs(ratio / factor - 1) <= 0.01:
            return hint
    return (
        "count one expert's weights (w13 and w2), what each costs in NVFP4 (its code and its share of a block "
        "scale), then the layer's 128 experts"
    )


def solve_packed_bytes(**_):
    want = _packed_bytes()
    return want, (
        f"128 * 3 * 768 * 2048 weights, half a byte each plus one e4m3 scale byte per 16 = 9/16 byte a weight: "
        f"{want} bytes (~{want / 1e6:.0f} MB, against 1.21 GB in bf16)."
    )


def _dequant_wins_at(rows, scheme="nvfp4", verdicts=None):
    """The rows of ``scheme`` by M and the smallest M from which the dequantize-then-GEMM path is the faster: by the
    verdicts (``timing.faster_rows``: ``"<scheme> dequant faster"``) where they are given, else by the times."""
    rows = sorted((r for r in rows if r["scheme"] == scheme), key=lambda r: r["M"])
    if verdicts is not None:
        won = {v["M"] for v in verdicts if v["verdict"] == f"{scheme} dequant faster"}
        return rows, next((r["M"] for r in rows if r["M"] in won), None)
    return rows, next((r["M"] for r in rows if r["dequant_graph_ms"] < r["fused_graph_ms"]), None)


def check_dequant_wins_at(answer, rows=(), scheme="nvfp4", verdicts=None, **_):
    # ``scheme``: a benchmark row's label (data), not a format lookup
    ordered, want = _dequant_wins_at(rows, scheme, verdicts)
    m = as_int(answer)
    by = {r["M"]: r for r in ordered}
    if m is None or m not in by:
        return "not a token count of the recorded rows: read the M column of the table"
    if m == want:
        return None
    r = by[m]
    if r["dequant_graph_ms"] >= r["fused_graph_ms"]:
        return (
            f"at M = {m} the fused path is faster ({r['fused_graph_ms']:.3g} ms against "
            f"{r['dequant_graph_ms']:.3g} ms): look at larger M"
        )
    if verdicts is not None and m < (want or float("inf")):
        return (
            f"at M = {m} the dequantize-then-GEMM path has the lower time, but section 0's verdict does not call it "
            "faster beyond the timing noise: look at larger M"
        )
    return (
        "the dequantize-then-GEMM path is faster there, but already at a smaller M: the question asks for the smallest"
    )


def solve_dequant_wins_at(rows=(), scheme="nvfp4", verdicts=None, **_):
    ordered, want = _dequant_wins_at(rows, scheme, verdicts)
    how = (
        "section 0's verdict first says the dequantize-then-GEMM path is faster"
        if verdicts is not None
        else ("dequant_graph_ms first drops below fused_graph_ms")
    )
    return want, (
        f"Reading the {scheme} rows in order of M, {how} at M = {want}: there the bf16 GEMM's efficiency outweighs "
        "writing the dequantized weights."
    )


# ----------------------------------------------------------------------------- notebooks 06 and 07


def _interval_shrink() -> float:
    return 1 / math.sqrt(2)


def check_interval_shrink(answer, **_):
    v = as_number(answer)
    if v is None or v <= 0:
        return "give a positive factor, e.g. 0.9 or '9/10'"
    want = _interval_shrink()
    if abs(v / want - 1) <= 0.02:
        return None
    if v >= 1:
        return "more prompts narrow an interval: the width is multiplied by a factor below 1"
    if abs(v - 0.5) <= 0.01:
        return "halving an interval's width takes four times the prompts: the width goes as one over the square root"
    if abs(v - 0.25) <= 0.01:
        return "that is how the variance of a mean falls with four times the prompts; the question doubles them"
    return "an interval's width goes as the standard error of a mean over n prompts: how does that change from n to 2n?"


def solve_interval_shrink(**_):
    want = _interval_shrink()
    return want, (
        f"A paired interval's width is a few standard errors of a mean over n prompts, and the standard error goes as "
        f"1 / sqrt(n): doubling n multiplies it by 1 / sqrt(2) = {want:.3f}. The run's widths follow it up to the "
        "resampling noise."
    )


def _costly_tasks(rows, decisions, max_bits: float = 4.5) -> list[str]:
    """The tasks on which a scheme of at most ``max_bits`` bits per weight is decided worse than bf16 (exact match or
    NLL) by the notebook's ``decisions``, in the rows' task order."""
    four = {r["scheme"] for r in rows if r["scheme"] != "bf16" and r["bits_per_weight"] <= max_bits}
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    hit = {
        v.metric.split(" on ")[-1]
        for v in (decisions.values() if decisions is not None else ())
        if v.b == "bf16" and v.a in four and v.winner == "bf16"
    }
    return [t for t in tasks if t in hit]


def check_where_4bit_costs(answer, rows=(), decisions=None, **_):
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    costly = _costly_tasks(rows, decisions)
    a = str(answer).strip().lower()
    if a == "none":
        if not costly:
            return None
        return "section 6 decides at least one 4-bit scheme worse than bf16 on some task: look for 'bf16 better'"
    if a not in tasks:
        return "not a task of this run: copy a name from the task column (or answer 'none')"
    if a in costly:
        return None
    return (
        "on that task no scheme of 4.5 bits per weight or fewer is decided worse than bf16 (section 6's verdicts): "
        "an interval that moves is not yet a decided loss"
    )


def solve_where_4bit_costs(rows=(), decisions=None, **_):
    costly = _costly_tasks(rows, decisions)
    if not costly:
        return "none", "Section 6 decides no scheme of 4.5 bits per weight or fewer worse than bf16 on any task."
    return costly[0], (
        f"Section 6 decides a scheme of 4.5 bits per weight or fewer worse than bf16 on {', '.join(costly)}: any of "
        "them passes. Where only the NLL is decided, the model still answers but is less sure."
    )


_GEMM = "GEMM output relative error"
_SQNR = "activation SQNR (dB)"


def _trap_decided(decisions, fmt: str, metric: str) -> list[int]:
    """The rotation sizes at which ``decisions`` decides ``"<fmt> rotated <n>"`` against ``"<fmt> plain"`` on
    ``metric`` (``mxlib.studies.recovery_measures.add_trap_comparisons``' names), ascending."""
    out = set()
    for v in decisions.values() if decisions is not None else ():
        if v.metric == metric and v.decided and v.b == f"{fmt} plain" and v.a.startswith(f"{fmt} rotated "):
            out.add(int(v.a.rsplit(" ", 1)[1]))
    return sorted(out)


def _sizes(answer) -> list[int] | None:
    """A list of rotation sizes from ``[16, 128]``, ``(16,)``, ``16``, ``"16, 128"`` or ``"16 128"``; ``[]`` for
    ``"none"`` or an empty list; None otherwise."""
    if isinstance(answer, str):
        text = answer.strip().lower()
        if text in ("none", "[]", "()", ""):
            return [] if text else None
        parts = text.strip("[]() ").replace(",", " ").split()
    elif isinstance(answer, (list, tuple, set)):
        parts = list(answer)
    else:
        parts = [answer]
    sizes = [as_int(p) for p in parts]
    return None if any(n is None for n in sizes) else sorted(set(sizes))


def check_trap_gemm(answer, rows=(), decisions=None, **_):
    points = sorted({r["points"] for r in rows})  # every format of the trap rotates at the same sizes
    want = _trap_decided(decisions, "nvfp4", _GEMM)
    got = _sizes(answer)
    if got is None:
        return "give a list of rotation sizes, e.g. [16] or '16, 128', or 'none'"
    if any(n not in points for n in got):
        return "a size that this run did not rotate with: read the points column of the trap table"
    if got == want:
        return None
    if got and got == _trap_decided(decisions, "nvfp4", _SQNR):
        return (
            "at those sizes section 6 decides NVFP4's activation SQNR; the question asks about the GEMM output "
            "relative error, a row of its own"
        )
    if not got:
        return "section 6 decides the GEMM output relative error of nvfp4 at some size: read its 'nvfp4 rotated' rows"
    return (
        "a difference in the table's means is not yet a decided one: take the sizes whose GEMM output relative error "
        "row names a winner"
    )


def solve_trap_gemm(rows=(), decisions=None, **_):
    want = _trap_decided(decisions, "nvfp4", _GEMM)
    sqnr = _trap_decided(decisions, "nvfp4", _SQNR)
    answer = want if want else "none"
    return answer, (
        f"Section 6 decides NVFP4's GEMM output relative error rotated against plain at {want or 'no size'}, and its "
        f"activation SQNR at {sqnr or 'no size'}: what the activations' SQNR says of a rotation need not hold for "
        "the layer's output, which also carries the (rotated) weight's error."
    )


def _gptq_gain(rows, scheme: str = "nvfp4", column: str = "layer_sqnr_db") -> float | None:
    by = {r["technique"]: r for r in rows if r["scheme"] == scheme}
    if "gptq" not in by or "rtn" not in by:
        return None
    return by["gptq"][column][-1] - by["rtn"][column][-1]


def check_gptq_heldout(answer, rows=(), scheme="nvfp4", **_):
    want = _gptq_gain(rows, scheme)
    if want is None:
        return "this run has no gptq and rtn rows of that scheme: run techniques with both"
    v = as_number(answer)
    if v is None:
        return "give a number of dB, e.g. 0.5 or '-1/2'"
    if abs(v - want) <= 0.05:
        return None
    fitted = _gptq_gain(rows, scheme, "calib_layer_sqnr_db")
    if fitted is not None and abs(v - fitted) <= 0.05:
        return "that is the gain on the calibration token ids GPTQ was fitted on; the question asks the held-out ones"
    if abs(v + want) <= 0.05:
        return "the sign: gptq's SQNR minus rtn's, positive where GPTQ keeps more"
    return "read the last decoder layer's layer_sqnr_db of the gptq row and of the rtn row of that scheme"


def solve_gptq_heldout(rows=(), scheme="nvfp4", **_):
    want, fitted = _gptq_gain(rows, scheme), _gptq_gain(rows, scheme, "calib_layer_sqnr_db")
    return want, (
        f"The last layer's SQNR, gptq minus rtn, {scheme}: {want:+.2f} dB on the held-out token ids against "
        f"{fitted:+.2f} dB on the calibration ids it was fitted on."
    )
