"""Tables as text lines: the one renderer of the tables mxlib prints and writes (the inspector's report,
``what_ran``'s table, the benchmarks' terminal and markdown tables).

* ``text_table(header, rows, ...)``: fixed-width columns for a terminal. Each column has a width (a minimum
  where ``grow``, else a fixed one that a longer cell overflows, as a format spec ``f"{cell:>10s}"`` does) and an
  alignment (``"<"`` left, ``">"`` right); the columns are joined by ``sep`` (one string, or one per gap).
* ``markdown_table(header, rows, align)``: a GitHub-flavoured markdown table (``| a | b |``, a ``|---|---:|``
  rule: ``"---:"`` for a right-aligned column, ``"---"`` otherwise).

Cells are strings: the caller formats its numbers (``f"{ms:.3f}"``), so a renderer never guesses a precision. Both
return a list of lines without line ends; the caller joins them. Standard library only, no mxlib import.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["text_table", "markdown_table"]


def _check(header: Sequence[str] | None, rows: Sequence[Sequence[str]], n: int, where: str) -> None:
    for k, row in enumerate(rows):
        if len(row) != n:
            raise ValueError(f"{where}: rows[{k}] has {len(row)} cells; expected {n} (one per column)")
        for cell in row:
            if not isinstance(cell, str):
                raise TypeError(f"{where}: rows[{k}]: expected str cells (format numbers first), got {cell!r}")
    if header is not None and not all(isinstance(h, str) for h in header):
        raise TypeError(f"{where}: header: expected str names, got {list(header)!r}")


def _per_column(value, n: int, default, name: str, where: str) -> list:
    if value is None:
        return [default] * n
    if isinstance(value, str):
        value = list(value) if name == "align" else [value] * n
    value = list(value)
    if len(value) != n:
        raise ValueError(f"{where}: {name} has {len(value)} entries; expected {n}")
    return value


def text_table(
    header: Sequence[str] | None,
    rows: Sequence[Sequence[str]],
    widths: Sequence[int] | None = None,
    align: str | Sequence[str] | None = None,
    sep: str | Sequence[str] = " ",
    indent: str = "",
    grow: bool = True,
    rstrip: bool = False,
) -> list[str]:
    """Fixed-width text lines: the header (when given), then one line per row.

    Args:
        header: the column names, or None for no header line.
        rows: the cells, one string per column.
        widths: each column's width (0 by default); with ``grow`` a minimum, widened to its longest name or cell.
        align: each column's alignment, ``"<"`` or ``">"`` (a string of them, one character a column; ``"<"`` for
            all by default).
        sep: the text between two columns, or a list of one per gap (``len(columns) - 1``).
        indent: the text before each line.
        grow: widen each column to its longest name or cell (else a longer cell overflows its column).
        rstrip: drop the trailing spaces of each line.

    Returns:
        The lines, without line ends.

    Raises:
        ValueError: a row of another length than the header (or the first row), a ``widths`` / ``align`` / ``sep``
            list of the wrong length, an alignment other than ``"<"`` / ``">"``.
        TypeError: a cell or name that is not a string.
    """
    n = len(header) if header is not None else (len(rows[0]) if rows else 0)
    _check(header, rows, n, "text_table")
    widths = _per_column(widths, n, 0, "widths", "text_table")
    align = _per_column(align, n, "<", "align", "text_table")
    if any(a not in ("<", ">") for a in align):
        raise ValueError(f"text_table: align: expected '<' or '>' per column, got {align!r}")
    gaps = [sep] * max(n - 1, 0) if isinstance(sep, str) else list(sep)
    if len(gaps) != max(n - 1, 0):
        raise ValueError(f"text_table: sep has {len(gaps)} entries; expected {max(n - 1, 0)} (one per gap)")
    if grow:
        lines = ([header] if header is not None else []) + list(rows)
        widths = [max([w, *(len(line[i]) for line in lines)]) for i, w in enumerate(widths)]

    def render(cells: Sequence[str]) -> str:
        out = indent
        for i, (cell, w, a) in enumerate(zip(cells, widths, align)):
            out += (gaps[i - 1] if i else "") + (cell.ljust(w) if a == "<" else cell.rjust(w))
        return out.rstrip() if rstrip else out

    return ([render(header)] if header is not None else []) + [render(r) for r in rows]


def markdown_table(
    header: Sequence[str], rows: Sequence[Sequence[str]], align: str | Sequence[str] | None = None
) -> list[str]:
    """A markdown table: the header line, the rule (``---:`` for a ``">"`` column, ``---`` otherwise), one line per row.

    Raises:
        ValueError: a row of another length than the header, an ``align`` of the wrong length or with an entry
            other than ``"<"`` / ``">"``.
        TypeError: a cell or name that is not a string.
    """
    n = len(header)
    _check(header, rows, n, "markdown_table")
    align = _per_column(align, n, "<", "align", "markdown_table")
    if any(a not in ("<", ">") for a in align):
        raise ValueError(f"markdown_table: align: expected '<' or '>' per column, got {align!r}")
    rule = "|" + "".join("---:|" if a == ">" else "---|" for a in align)
    return ["| " + " | ".join(header) + " |", rule, *("| " + " | ".join(r) + " |" for r in rows)]
