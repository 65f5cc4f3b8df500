"""The checks of the notebooks' assert cells and their exercises.

* ``Checks``: an assert cell's checks, counted, so the cell can say how many passed.
* ``EXERCISES``, ``check_exercise`` and ``show_solution``: the notebooks' "try this" prompts, their
  checkers (a hint for a wrong answer, never the answer) and their solutions, from
  ``mxlib.workbook.exercises``, re-exported so that every notebook calls ``checks.check_exercise``.
"""

from __future__ import annotations

from .exercises import (
    EXERCISES,
    check_exercise,
    even_clips_rceil_does_not,
    floor_clips_rceil_does_not,
    is_largest_flushing_power_of_two,
    loses_without_flushing,
    show_solution,
)

__all__ = [
    "Checks",
    "EXERCISES",
    "check_exercise",
    "show_solution",
    "floor_clips_rceil_does_not",
    "even_clips_rceil_does_not",
    "loses_without_flushing",
    "is_largest_flushing_power_of_two",
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
