"""``mxlib.text_table``: the one renderer of mxlib's text and markdown tables, pinned on literal expected lines."""

import pytest

from mxlib.text_table import markdown_table, text_table


def test_text_table_fixed_widths_overflow_and_align():
    """Fixed widths (``grow=False``) act as a format spec's: a longer cell overflows its column."""
    lines = text_table(("name", "ms"), [("a", "1.500"), ("longer", "12345.000")], widths=(4, 8), align="<>", grow=False)
    assert lines == ["name       ms", "a       1.500", "longer 12345.000"]


def test_text_table_grows_to_the_longest_cell_and_strips():
    lines = text_table(("k", "v"), [("abc", "x"), ("d", "")], widths=(2, 1), sep="  ", rstrip=True)
    assert lines == ["k    v", "abc  x", "d"]
    assert text_table(("k", "v"), [("d", "")], sep="  ") == ["k  v", "d   "]  # trailing spaces kept by default


def test_text_table_without_header_with_indent_and_a_separator_per_gap():
    lines = text_table(None, [("a", "b", "c")], widths=(2, 0, 0), indent="  ", sep=(" ", "  "))
    assert lines == ["  a  b  c"]


def test_markdown_table():
    lines = markdown_table(["path", "M=1", "M=16"], [["`x`", "0.100", "-"]], align="<>>")
    assert lines == ["| path | M=1 | M=16 |", "|---|---:|---:|", "| `x` | 0.100 | - |"]
    assert markdown_table(["a", "b"], []) == ["| a | b |", "|---|---|"]


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: text_table(("a", "b"), [("x",)]), ValueError, r"rows\[0\] has 1 cells; expected 2"),
        (lambda: text_table(("a",), [(1.5,)]), TypeError, r"rows\[0\]: expected str cells .* got 1.5"),
        (lambda: text_table(("a", "b"), [], widths=(1,)), ValueError, "widths has 1 entries; expected 2"),
        (lambda: text_table(("a", "b"), [], align="<^"), ValueError, "align: expected '<' or '>'"),
        (lambda: text_table(("a", "b", "c"), [], sep=(" ",)), ValueError, "sep has 1 entries; expected 2"),
        (lambda: markdown_table(["a"], [["x", "y"]]), ValueError, r"markdown_table: rows\[0\] has 2 cells"),
        (lambda: markdown_table(["a"], [], align="<>"), ValueError, "align has 2 entries; expected 1"),
    ],
)
def test_bad_input_names_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()
