"""The notebooks' "try this" exercises: prompts, checkers that teach, and solutions on request.

One API in every notebook:

* ``check_exercise(name, answer, **context)`` prints ``right`` or a hint aimed at the usual mistake
  behind that wrong answer, and returns True or False. A hint never states the expected answer in
  any form; it says what the answer is missing ("FP6 packs four codes into three bytes").
* ``show_solution(name, **context)`` prints one answer that passes and the reasoning behind it, and
  returns that answer. A notebook names the call in a comment, so the solution stays hidden until
  the learner asks for it.
* ``EXERCISES``: ``{name: prompt}``, the prompts the notebooks show.

Answers are accepted in their equivalent forms: an integer code as ``121``, ``"121"``, ``"0x79"`` or
``"0b1111001"``; a shape as a tuple or a list; a number as an int, a float or a string such as
``"17/4"``. ``context`` carries a run's table where the exercise reads one (``rows=...``).

Every checker computes its answer with mxlib (never a stored literal), so it stays right if the
formats or the data change; ``tests/test_exercises.py`` passes each solution and checks that a list
of typical wrong answers each gets a hint without the answer in it.
"""

from __future__ import annotations

from . import _exercise_formats as F
from . import _exercise_runs as Q
from ._exercise_formats import (
    even_clips_rceil_does_not,
    floor_clips_rceil_does_not,
    is_largest_flushing_power_of_two,
    loses_without_flushing,
)

__all__ = [
    "EXERCISES",
    "check_exercise",
    "show_solution",
    "floor_clips_rceil_does_not",
    "even_clips_rceil_does_not",
    "loses_without_flushing",
    "is_largest_flushing_power_of_two",
]

# name -> the prompt a notebook shows
EXERCISES: dict[str, str] = {
    "00.even_saturates": "Find a 32-value MXFP4 block in which the even rule saturates an element (|x| / scale > 6) "
    "while rceil does not. The walkthrough's block shows the case where even moves up a power of two; find the "
    "case where it does not.",
    "00.e8m0_byte": "Which E8M0 byte (an int such as 100, or a string such as '0x64') does the even rule pick for an "
    "MXFP4 block whose amax is 0.4?",
    "00.flush_ratio": "Find an amax ratio r (smaller expert / larger, in (0, 1]) at which every NVFP4 block of the "
    "smaller synthetic expert flushes to zero under the unified global scale, while its own scale keeps it above "
    "15 dB.",
    "01.fp6_shapes": "A Quark w_mxfp6_e2m3 checkpoint of Qwen3-30B-A3B stores each expert's gate_proj "
    "(out 768, in 2048). Give (weight shape, weight_scale shape) as two tuples.",
    "01.decode_byte": "An NVFP4 weight byte 0x2B, its block scale byte 0x38 (e4m3 1.0) and weight_scale_2 = "
    "2**-10: give the two weights it decodes to, low nibble first.",
    "02.floor_clips": "Find a 32-value MXFP8 (e4m3) block in which the OCP floor rule clips an element and "
    "rceil does not.",
    "02.e4m3_code": "Which e4m3 code (an int, or a hex string such as '0x40') does 300.0 round to?",
    "02.outlier_gap": "Of the outlier magnitudes 1, 10, 100, 1000 and 10000 (explorers.outlier_scale_sqnr, global "
    "SQNR), which is the smallest at which NVFP4 beats MXFP4 by more than 3 dB?",
    "03.best_4bit": "Which 4.25-bit scheme cannot be told from the best on the logits SQNR in this run (no other "
    "4.25-bit scheme decided better than it over the token sets)?",
    "03.nvfp4_bits_32": "NVFP4 with blocks of 32 instead of 16 (still one e4m3 scale a block): how many bits "
    "per weight, scales included (the per-tensor fp32 scale is negligible)?",
    "04.subnormal_loss": "Find a ratio r at which the smaller synthetic expert loses more than 2 dB under the "
    "unified scale while none of its blocks is flushed.",
    "04.first_flush": "Find the largest power of two r = 2**-n at which every block of the smaller synthetic "
    "expert is flushed under the unified scale.",
    "05.packed_bytes": "How many bytes do one Qwen3-30B-A3B layer's NVFP4 expert weights and block scales "
    "take (128 experts; w13 [2 * 768, 2048] and w2 [2048, 768] each)?",
    "05.dequant_wins_at": "In the recorded MoE-layer rows, from which token count M on is vLLM's emulation design "
    "(dequantize-then-GEMM) faster than the fused path for nvfp4, beyond the timing noise (CUDA-graph times, the "
    "notebook's verdicts)? Answer the smallest such M.",
    "06.interval_shrink": "Doubling eval_prompts multiplies the width of a paired interval by about which factor?",
    "06.where_4bit_costs": "On which task does section 6 decide a scheme of at most 4.5 bits per weight worse than "
    "bf16 (exact match or NLL)? Answer a task name, or 'none'.",
    "07.trap_gemm": "At which of this run's rotation sizes (trap_points) does section 6 decide that the rotation "
    "changes NVFP4's GEMM output relative error? Answer a list of sizes, or 'none'.",
    "07.gptq_heldout": "On the dummy model (scheme nvfp4), by how many dB does gptq's last-layer SQNR on the held-out "
    "token ids (layer_sqnr_db) exceed rtn's?",
}

_CHECKERS = {
    "00.even_saturates": (F.check_even_saturates, F.solve_even_saturates),
    "00.e8m0_byte": (F.check_e8m0_byte, F.solve_e8m0_byte),
    "00.flush_ratio": (F.check_flush_ratio, F.solve_flush_ratio),
    "01.fp6_shapes": (Q.check_fp6_shapes, Q.solve_fp6_shapes),
    "01.decode_byte": (Q.check_decode_byte, Q.solve_decode_byte),
    "02.floor_clips": (F.check_floor_clips, F.solve_floor_clips),
    "02.e4m3_code": (F.check_e4m3_code, F.solve_e4m3_code),
    "02.outlier_gap": (F.check_outlier_gap, F.solve_outlier_gap),
    "03.best_4bit": (Q.check_best_4bit, Q.solve_best_4bit),
    "03.nvfp4_bits_32": (Q.check_nvfp4_bits_32, Q.solve_nvfp4_bits_32),
    "04.subnormal_loss": (F.check_subnormal_loss, F.solve_subnormal_loss),
    "04.first_flush": (F.check_first_flush, F.solve_first_flush),
    "05.packed_bytes": (Q.check_packed_bytes, Q.solve_packed_bytes),
    "05.dequant_wins_at": (Q.check_dequant_wins_at, Q.solve_dequant_wins_at),
    "06.interval_shrink": (Q.check_interval_shrink, Q.solve_interval_shrink),
    "06.where_4bit_costs": (Q.check_where_4bit_costs, Q.solve_where_4bit_costs),
    "07.trap_gemm": (Q.check_trap_gemm, Q.solve_trap_gemm),
    "07.gptq_heldout": (Q.check_gptq_heldout, Q.solve_gptq_heldout),
}


def _lookup(name: str):
    if name not in _CHECKERS:
        raise KeyError(f"name: expected one of {sorted(EXERCISES)}, got {name!r}")
    return _CHECKERS[name]


def check_exercise(name: str, answer, **context) -> bool:
    """Check a "try this" answer: print ``right``, or a hint for the mistake behind it, and return whether it is right.

    Args:
        name: a key of ``EXERCISES`` (the notebook shows its prompt).
        answer: the learner's answer, in any equivalent form (module docstring); a block of numbers
            for the block exercises.
        context: ``rows=...`` for the exercises that read a run's table (``03.best_4bit`` and
            ``06.where_4bit_costs``, which also take the notebook's ``decisions=``; ``05.dequant_wins_at``, which
            also takes ``verdicts=`` from ``mxlib.studies.timing.faster_rows``; ``07.trap_gemm``: the trap rows
            and the notebook's ``decisions``;
            ``07.gptq_heldout``: the dummy model's rows).

    The hint never contains the expected answer; ``show_solution(name)`` gives it.

    Raises:
        KeyError: unknown exercise name.
    """
    checker, _ = _lookup(name)
    hint = checker(answer, **context)
    print("right" if hint is None else f"not yet: {hint}")
    return hint is None


def show_solution(name: str, **context):
    """Print one answer of exercise ``name`` that passes ``check_exercise`` and the reasoning; return the answer.

    Raises:
        KeyError: unknown exercise name.
    """
    _, solve = _lookup(name)
    answer, why = solve(**context)
    print(f"{name}: {why}\nanswer: {answer!r}")
    return answer
