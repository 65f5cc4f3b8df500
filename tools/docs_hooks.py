"""mkdocs hooks of the documentation site (``mkdocs.yml``: ``hooks: [tools/docs_hooks.py]``).

The site's pages live in ``docs/``; two kinds of files outside it are published with them:

* ``notebooks/*.ipynb``, the workbook as stored (without outputs), at ``notebooks/<name>.ipynb``: the pages link
  them, and a reader downloads them from the site;
* ``build/workbook/*.html``, the executed notebooks that ``make workbook`` exports, at ``workbook/<name>.html``,
  when that folder holds any (they are build outputs, never committed; a site built without them says how to
  make them, see docs/notebooks.md).
"""

from __future__ import annotations

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
