"""mkdocs hooks of the documentation site (``mkdocs.yml``: ``hooks: [tools/docs_hooks.py]``).

The site's pages live in ``docs/``; two kinds of files outside it are published with them:

* ``notebooks/*.ipynb``, the workbook as stored (without outputs), at ``notebooks/<name>.ipynb``: the pages link
  them, and a reader downloads them from the site;
* ``build/workbook/*.html``, the executed notebooks that ``make workbook`` exports, at ``workbook/<name>.html``,
  when that folder holds any (they are build outputs, never committed; a site built without them says how to
  make them, see docs/notebooks.md).

The API pages name their modules one ``::: mxlib.x.y`` line each, in the order a reader meets them; a line
``::: mxlib.x.*`` stands for every other public module of the package ``mxlib.x`` (its ``.py`` files and
subpackages without a leading underscore, found on disk, sorted), so a module added to a package is documented
without editing the page.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]

# (folder under the checkout, glob, folder in the site)
PUBLISHED = (
    ("notebooks", "*.ipynb", "notebooks"),
    ("build/workbook", "*.html", "workbook"),
)


def on_files(files: Files, config) -> Files:
    """Add the notebooks and, when present, their executed HTML to the site's files."""
    for folder, pattern, dest in PUBLISHED:
        for path in sorted((ROOT / folder).glob(pattern)):
            files.append(File.generated(config, f"{dest}/{path.name}", abs_src_path=str(path)))
    return files


_DIRECTIVE = re.compile(r"^::: (mxlib(?:\.\w+)*)(\.\*)?\s*$", flags=re.M)


def public_submodules(package: str) -> list[str]:
    """The public modules directly in ``package`` (``mxlib.x``), found on disk: ``.py`` files and subpackages; none
    when ``mxlib.x`` is a plain module."""
    folder = ROOT.joinpath(*package.split("."))
    if folder.with_suffix(".py").is_file():
        return []
    if not (folder / "__init__.py").is_file():
        raise ValueError(f"::: {package}.*: no package {folder}")
    names = [p.stem for p in folder.glob("*.py") if p.stem != "__init__"]
    names += [p.name for p in folder.iterdir() if (p / "__init__.py").is_file()]
    return [f"{package}.{n}" for n in sorted(set(names)) if not n.startswith("_")]


def expand_module_wildcards(markdown: str) -> str:
    """Each ``::: mxlib.x.*`` line replaced by ``::: m`` lines for the public modules of ``mxlib.x`` that the page
    does not name itself."""
    named = {m.group(1) for m in _DIRECTIVE.finditer(markdown) if not m.group(2)}

    def expand(m: re.Match) -> str:
        if not m.group(2):
            return m.group(0)
        rest = [mod for mod in public_submodules(m.group(1)) if mod not in named]
        return "\n\n".join(f"::: {mod}" for mod in rest)

    return _DIRECTIVE.sub(expand, markdown)


def on_page_markdown(markdown: str, page, config, files) -> str:
    return expand_module_wildcards(markdown)
