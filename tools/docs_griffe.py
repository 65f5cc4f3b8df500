"""A griffe extension for the API reference (``mkdocs.yml``: the mkdocstrings handler's ``extensions``).

mxlib's docstrings are read as Markdown, which is what they are written in, except for two reStructuredText
forms that ``help()`` shows well and Markdown garbles; ``rst_to_markdown`` rewrites them before rendering:

* simple tables (rows between ``====  ====`` rules; a row whose first cell is blank continues the row above)
  become Markdown tables;
* a paragraph ending in ``::`` followed by an indented block becomes the paragraph ending in ``:`` and the block
  fenced as code.

Everything else is left as written.
"""

from __future__ import annotations

import re
import textwrap

from griffe import Extension

_RULE = re.compile(r"^\s*=+(?: +=+)+\s*$")


def _columns(rule: str) -> list[int]:
    """The start offset of each ``===`` run of a table rule."""
    return [m.start() for m in re.finditer(r"=+", rule)]


def _cells(line: str, starts: list[int]) -> list[str]:
    ends = starts[1:] + [None]
    return [line[a:b].strip() for a, b in zip(starts, ends)]


def _table(lines: list[str]) -> list[str]:
    """A simple table (its lines, rules included) as Markdown table lines."""
    starts = _columns(lines[0])
    rules = [i for i, line in enumerate(lines) if _RULE.match(line)]
    rows: list[list[str]] = []
    header_rows = 0
    for i, line in enumerate(lines):
        if i in rules:
            if i == rules[1] and len(rules) == 3:
                header_rows = len(rows)
            continue
        if not line.strip():
            continue
        cells = _cells(line, starts)
        if rows and not cells[0]:  # a continuation line
            rows[-1] = [f"{a} {b}".strip() for a, b in zip(rows[-1], cells)]
        else:
            rows.append(cells)
    header_rows = header_rows or 1
    header = [" ".join(c).strip() for c in zip(*rows[:header_rows])]
    body = rows[header_rows:]

    def md(cells: list[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    return [md(header), "|" + "---|" * len(header)] + [md(r) for r in body]


def rst_to_markdown(text: str) -> str:
    """``text`` with its reStructuredText simple tables and ``::`` literal blocks in Markdown (module docstring)."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if _RULE.match(line):
            # a table: three rules (header) or two; it ends at its last rule
            rules = [i]
            j = i + 1
            while j < len(lines) and len(rules) < 3:
                if _RULE.match(lines[j]):
                    rules.append(j)
                    if j + 1 >= len(lines) or not lines[j + 1].strip():
                        break
                j += 1
            if len(rules) >= 2:
                out += ["", *_table(lines[i : rules[-1] + 1]), ""]
                i = rules[-1] + 1
                continue
        if line.rstrip().endswith("::") and line.strip() != "::":
            indent = len(line) - len(line.lstrip())
            j = i + 1
            while j < len(lines) and not lines[j].strip():
                j += 1
            k = j
            while k < len(lines) and (not lines[k].strip() or len(lines[k]) - len(lines[k].lstrip()) > indent):
                k += 1
            while k > j and not lines[k - 1].strip():
                k -= 1
            if k > j:
                block = textwrap.dedent("\n".join(lines[j:k])).splitlines()
                out += [line.rstrip()[:-1], "", "```text", *block, "```", ""]
                i = k
                continue
        out.append(line)
        i += 1
    return "\n".join(out)


class RstToMarkdown(Extension):
    """Rewrite every docstring with ``rst_to_markdown`` once the objects are loaded."""

    def on_object(self, *, obj, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rst_to_markdown(obj.docstring.value)
