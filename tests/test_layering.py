"""The package's shape: layers import only downwards, no import cycles, no format names in branches, and every
module named on its package's face and in docs/architecture.md.

Layers, lowest first: formats -> _checks / text_table -> reference / analysis / stats -> kernels -> moe -> recovery
-> cases -> models (families, presets, calibration, Hessians, routing statistics, the trained model) -> checkpoints
(the writer, the loader, the inspector, the layouts, the file handling) -> the models' modules that read the layouts
(gpt_oss, in_memory, what_ran) -> studies (what the notebooks, the CLI and the benchmarks run: rows and numbers, no
plotting, no Jupyter) -> workbook (what only the notebooks need: figures, widgets, exercises, checks, the runner) ->
cli / bench (``cases`` runs its named cases through the reference, the kernels and the MoE scale helpers). The CLI
and the benchmarks import no ``mxlib.workbook`` module, but for the ``mxlib workbook`` command, which hands its
arguments to the runner. Every import of every mxlib module (top level or nested) is read with ``ast``; a module may
import its own layer or lower ones, and the import graph has no cycle. A module the table does not name (a new
top-level file) counts as the top layer, so it may import anything and nothing below may import it. The notebooks
import from a handful of mxlib modules (``NOTEBOOK_MODULES_MAX``) and give no mxlib name a one-letter alias.
"""

import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "mxlib"

# the models' modules that read the checkpoint layouts: above mxlib.checkpoints, which builds on the rest of models
MODELS_ON_CHECKPOINTS = ("mxlib.models.gpt_oss", "mxlib.models.in_memory", "mxlib.models.what_ran")

LAYERS = [
    ("mxlib.formats",),
    ("mxlib._checks", "mxlib.text_table"),
    ("mxlib.reference", "mxlib.analysis", "mxlib.stats"),
    ("mxlib.kernels",),
    ("mxlib.moe",),
    ("mxlib.recovery",),
    ("mxlib.cases",),
    ("mxlib.models",),
    ("mxlib.checkpoints",),
    MODELS_ON_CHECKPOINTS,
    ("mxlib.studies",),
    ("mxlib.workbook",),
    ("mxlib.cli", "mxlib.bench"),
]
TOP = len(LAYERS)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def layer(mod: str) -> int:
    """The layer of ``mod``: that of the longest name in ``LAYERS`` that is ``mod`` or a package above it."""
    if mod == "mxlib":
        return 0  # the package's __init__ imports no mxlib module at import time (its public names load lazily)
    found = [(len(g), i) for i, group in enumerate(LAYERS) for g in group if mod == g or mod.startswith(g + ".")]
    return max(found)[1] if found else TOP


def imports(mod: str) -> set[str]:
    """The mxlib modules ``mod`` imports (relative imports resolved; ``from x import y`` counts
    ``x.y`` when that is a module, else ``x``)."""
    path = MODULES[mod]
    package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "mxlib"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "mxlib":
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.add(sub if sub in MODULES else target)
    out.discard(mod)
    return {m for m in out if m in MODULES}


GRAPH = {m: imports(m) for m in MODULES}


def test_the_table_knows_the_core_modules():
    for mod in (
        "mxlib.formats",
        "mxlib.reference",
        "mxlib.kernels.quant",
        "mxlib.moe.base",
        "mxlib.checkpoints",
        "mxlib.studies.steps",
        "mxlib.workbook.runner",
        "mxlib.cli",
        "mxlib.bench",
    ):
        assert mod in MODULES and layer(mod) < TOP, mod


# the one door from the command line into the workbook: ``mxlib workbook ARGS`` runs ``mxlib.workbook.runner.main``
CLI_TO_WORKBOOK = {("mxlib.cli", "mxlib.workbook.runner")}


@pytest.mark.parametrize("mod", sorted(m for m in MODULES if layer(m) == layer("mxlib.cli")))
def test_cli_and_bench_import_no_workbook_module(mod):
    wb = sorted(d for d in GRAPH[mod] if layer(d) == layer("mxlib.workbook") and (mod, d) not in CLI_TO_WORKBOOK)
    assert not wb, f"{mod} imports the notebooks' wing {wb}: what the CLI and the benchmarks run lives in mxlib.studies"


# the notebook stack: what ``mxlib.studies`` never imports (its rows and numbers run under the CLI and the benchmarks,
# without the workbook extra)
NOTEBOOK_STACK = ("plotly", "ipywidgets", "IPython", "ipykernel", "jupyter_client", "nbformat", "nbconvert")
NOTEBOOK_STACK += ("papermill",)


def third_party_imports(mod: str) -> set[str]:
    """The top-level names of the packages ``mod`` imports, nested imports included."""
    out = set()
    for node in ast.walk(ast.parse(MODULES[mod].read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out


@pytest.mark.parametrize("mod", sorted(m for m in MODULES if layer(m) == layer("mxlib.studies")))
def test_studies_import_no_notebook_stack(mod):
    found = sorted(third_party_imports(mod) & set(NOTEBOOK_STACK))
    assert not found, f"{mod} imports {found}: figures and widgets belong in mxlib.workbook"


@pytest.mark.parametrize("mod", sorted(MODULES))
def test_no_import_from_a_layer_above(mod):
    above = sorted(d for d in GRAPH[mod] if layer(d) > layer(mod))
    assert not above, f"{mod} (layer {layer(mod)}) imports from higher layers: {above}"


def test_no_import_cycles():
    # Tarjan-free check: a depth-first search that reports the first back edge's cycle
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(GRAPH[m]):
            if state.get(d) == 1:
                cycle = stack[stack.index(d) :] + [d]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(MODULES):
        if m not in state:
            visit(m)


# ----------------------------------------------------------------------------- no format names in branches

# What counts as "a branch on a format": a comparison (==, !=, in, not in, is) one of whose
# operands is a string literal that names
#   * a block, per-tensor or MoE scheme, an element format or one of its aliases, or
#   * a kind of special codes ("fn", "ieee": the table's ``SPECIALS``; "none" is too common a
#     word to flag by itself),
# or any comparison of a ``.specials`` attribute with a string literal. Code asks the table
# instead (``ElementFormat.has_nan_code``, ``has_inf``, ``nan_code``, ``specials_id``).
#
# Scale rule names ("floor", "even", "rceil") are options of the E8M0 rule, not formats: they
# are validated by ``formats.get_scale_mode`` and turned into the kernels' integer by
# ``formats.scale_mode_id``, and ``reference.e8m0_scale`` (the rule's definition) branches on
# them. They are not flagged here; only hand-made {"floor": 0, ...} tables are (below).
#
# Where format and scheme names may be spelled: the tables, and the checkpoint layouts (whose
# configs name formats by their producers' strings).
TABLES = {
    "mxlib.formats",
    "mxlib.moe.schemes",
    "mxlib.checkpoints.layouts.modelopt_nvfp4",
    "mxlib.checkpoints.layouts.quark_ocp_mx",
}


def _format_names() -> set[str]:
    from mxlib.formats import BLOCK_SCHEMES, ELEMENT_FORMATS, PER_TENSOR_SCHEMES
    from mxlib.moe.schemes import MOE_SCHEMES

    names = set(BLOCK_SCHEMES) | set(PER_TENSOR_SCHEMES) | set(MOE_SCHEMES) | {"fp8", "mxfp4"}
    for f in ELEMENT_FORMATS.values():
        names |= {f.name, *f.aliases}
    return names


# attributes of the table's objects whose values are format-describing strings
FORMAT_ATTRIBUTES = {"specials"}


def _special_kinds() -> set[str]:
    from mxlib.formats import SPECIALS

    return set(SPECIALS) - {"none"}


def _string_comparisons(tree, names):
    names = names | _special_kinds()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            strings = []
            for operand in operands:
                values = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
                strings += [v.value for v in values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
            for value in strings:
                if value in names:
                    yield node.lineno, value
            attrs = [o.attr for o in operands if isinstance(o, ast.Attribute) and o.attr in FORMAT_ATTRIBUTES]
            if attrs and strings:
                yield node.lineno, f".{attrs[0]} vs {strings[0]!r}"


def test_the_string_check_catches_what_it_is_meant_to():
    # the check itself must be able to fail: each snippet is one pattern it exists to catch
    names = _format_names()
    for src in (
        'if scheme == "nvfp4": pass',
        'x = a if kind in ("fp8", "e4m3") else b',
        'if fmt.specials == "fn": pass',
        'if fmt.specials != "none": pass',
        'if s == "ieee": pass',
    ):
        assert list(_string_comparisons(ast.parse(src), names)), src
    for src in ('if scale_mode == "floor": pass', "if fmt.has_nan_code: pass", "if c.name == name: pass"):
        assert not list(_string_comparisons(ast.parse(src), names)), src


@pytest.mark.parametrize("mod", sorted(m for m in MODULES if m not in TABLES))
def test_no_branch_on_a_format_name(mod):
    tree = ast.parse(MODULES[mod].read_text())
    found = list(_string_comparisons(tree, _format_names()))
    assert not found, f"{mod} compares with format / scheme names (use the format objects): {found}"


# mxlib.cases holds hand-computed worked examples (input data such as gs = 2688, not a derived constant)
@pytest.mark.parametrize("mod", sorted(m for m in MODULES if m not in ("mxlib.formats", "mxlib.cases")))
def test_nvfp4_divisor_written_once(mod):
    tree = ast.parse(MODULES[mod].read_text())
    hits = [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and n.value in (2688, 2688.0) and not isinstance(n.value, bool)
    ]
    assert not hits, f"{mod} writes 2688 (use mxlib.formats.NVFP4_SCALE_DIVISOR) at lines {hits}"


def test_launch_sites_pass_no_hand_made_format_tables():
    # the {"none": 0, "fn": 1, ...} and {"floor": 0, "even": 1, ...} dicts live in the format table only
    from mxlib.formats import SCALE_MODES, SPECIALS

    keysets = {frozenset(SCALE_MODES), frozenset(SPECIALS)}
    for mod, path in MODULES.items():
        if mod == "mxlib.formats":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Dict) and node.keys and all(isinstance(k, ast.Constant) for k in node.keys):
                assert frozenset(k.value for k in node.keys) not in keysets, f"{mod}:{node.lineno}"


# ----------------------------------------------------------------------------- the faces

# A module holds one subject, whole, and says so where a reader looks first: its package's ``__init__`` docstring
# names every module of the package (``.py`` file or subpackage, by name, inside a double-backtick literal), and
# docs/architecture.md names every module of mxlib (``pkg/module.py`` in backticks, ``__init__.py`` and
# ``__main__.py`` included). There is no line count: a long module is fine where its face says what it holds.
PACKAGES = sorted({ROOT} | {p.parent for p in ROOT.rglob("__init__.py")})
ARCHITECTURE = ROOT.parent / "docs" / "architecture.md"


def package_modules(folder: Path) -> list[str]:
    """The names of the modules directly in a package folder: its ``.py`` files (but ``__init__`` and
    ``__main__``) and its subpackages."""
    files = [p.stem for p in folder.glob("*.py") if p.stem not in ("__init__", "__main__")]
    return sorted(files + [p.name for p in folder.iterdir() if (p / "__init__.py").is_file()])


def literal_words(doc: str) -> set[str]:
    """The words inside the docstring's double-backtick literals (``mxlib.moe.base`` gives mxlib, moe, base)."""
    return {w for lit in re.findall(r"``(.+?)``", doc, flags=re.S) for w in re.findall(r"\w+", lit)}


def test_the_face_checks_can_fail():
    assert literal_words("``layout.CheckpointLayout`` and the layouts") == {"layout", "CheckpointLayout"}
    assert "layouts" not in literal_words("the layouts, ``layout``")  # prose does not count
    assert "quant" in package_modules(ROOT / "kernels") and "layouts" in package_modules(ROOT / "checkpoints")
    assert "`kernels/quant.py`" not in "| `quant.py` |"  # a bare file name does not name a module of a subpackage


@pytest.mark.parametrize("folder", PACKAGES, ids=lambda p: module_name(p / "__init__.py"))
def test_package_docstring_names_every_module(folder):
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
    missing = [m for m in package_modules(folder) if m not in literal_words(doc)]
    assert not missing, f"{module_name(folder / '__init__.py')}'s docstring does not name {missing}"


def test_architecture_names_every_module():
    text = ARCHITECTURE.read_text(encoding="utf-8")
    missing = [p.relative_to(ROOT).as_posix() for p in sorted(ROOT.rglob("*.py"))]
    missing = [m for m in missing if f"`{m}`" not in text]
    assert not missing, f"docs/architecture.md does not name {missing}"


# ----------------------------------------------------------------------------- the notebooks' imports

NOTEBOOKS = sorted((ROOT.parent / "notebooks").glob("0*.ipynb"))
# "a handful": the most mxlib modules one notebook imports from (``mxlib``, ``mxlib.studies``, ``mxlib.workbook``
# and a few of the library's own modules, such as ``mxlib.formats`` and ``mxlib.stats``)
NOTEBOOK_MODULES_MAX = 7


def notebook_imports(source_cells: list[str]) -> tuple[set[str], list[str]]:
    """``(mxlib modules imported from, aliases given to mxlib names)`` of a notebook's code cells."""
    modules, aliases = set(), []
    for src in source_cells:
        try:
            tree = ast.parse(src)
        except SyntaxError:  # a cell of IPython magics
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "mxlib":
                modules.add(node.module)
                aliases += [a.asname for a in node.names if a.asname]
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "mxlib":
                        modules.add(a.name)
                        aliases += [a.asname] if a.asname else []
    return modules, aliases


def test_the_notebook_import_check_can_fail():
    cells = ["import mxlib.formats as F\nfrom mxlib.studies import steps as st", "%matplotlib inline"]
    assert notebook_imports(cells) == ({"mxlib.formats", "mxlib.studies"}, ["F", "st"])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem[:2])
def test_notebooks_import_from_a_handful_of_modules_with_no_one_letter_alias(path):
    nb = json.loads(path.read_text(encoding="utf-8"))
    cells = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    modules, aliases = notebook_imports(cells)
    assert len(modules) <= NOTEBOOK_MODULES_MAX, f"{path.name} imports from {len(modules)} modules: {sorted(modules)}"
    assert not [a for a in aliases if len(a) == 1], f"{path.name}: one-letter aliases {aliases}"
