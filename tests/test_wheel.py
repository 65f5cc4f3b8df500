"""The sdist and the wheel: what they hold, what they require, and the workbook run from an installed wheel.

The fast test reads pyproject.toml and setup.py: ``mxlib.notebooks`` is mapped onto ``notebooks/`` and
ships its ``*.ipynb``; setup.py adds it to the packages found under ``mxlib/``. The others (marked slow)
take the files of ``make dist`` when ``MXLIB_DIST`` names its folder, else build both into a temporary
folder with ``python -m build`` (the sdist, then the wheel from the sdist), and check:

- the wheel holds exactly the package's modules (every ``mxlib/**/*.py`` of the checkout), ``py.typed``,
  ``mxlib/notebooks/`` with every ``notebooks/*.ipynb`` byte for byte, and the LICENSE in its
  ``.dist-info``; no tests, no build output;
- its metadata: SPDX ``License-Expression: Apache-2.0``, the version of ``mxlib.__version__``, the console
  script, and no Jupyter, papermill, nbval or pytest among the requirements outside the extras;
- the sdist holds what a wheel is built from (pyproject.toml, README, LICENSE, the notebooks);
- the wheel installed into a folder of its own (``pip install --no-deps --target``) and run from outside
  the checkout: ``python -m mxlib.workbook --only 00 --out DIR`` finds the installed notebooks and
  writes the executed one into DIR, and nothing into the installed folder; its checkpoint cache is
  under ``$XDG_CACHE_HOME/mxlib``.
"""

import email.parser
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
# requirements that belong in an extra (the notebook stack, the test runner), never in the core
EXTRA_ONLY = ("jupyter", "jupyterlab", "notebook", "papermill", "nbval", "nbconvert", "ipykernel", "ipywidgets")


def test_the_notebooks_are_a_package_mapped_onto_the_notebooks_folder():
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "packages" not in config, "setup.py lists the packages; a list in pyproject.toml would replace it"
    assert config["package-dir"] == {"mxlib.notebooks": "notebooks"}
    assert "*.ipynb" in config["package-data"]["mxlib.notebooks"]
    assert (ROOT / "notebooks" / "__init__.py").is_file()
    assert '+ ["mxlib.notebooks"]' in (ROOT / "setup.py").read_text()


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> dict[str, Path]:
    """``{"wheel": path, "sdist": path}``: the files of ``make dist`` (``MXLIB_DIST``), else built here."""
    folder = os.environ.get("MXLIB_DIST")
    if folder:
        folder = Path(folder)
    else:
        pytest.importorskip("build")
        folder = tmp_path_factory.mktemp("dist")
        # built from a private copy of the source: setuptools writes its release tree and egg-info into the folder
        # it builds, and the checkout is shared with whatever else runs (another pytest worker, an editor)
        source = _snapshot_of_the_source(tmp_path_factory.mktemp("source") / "mxlib")
        done = subprocess.run(
            [sys.executable, "-m", "build", "--outdir", str(folder), str(source)], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    wheels, sdists = sorted(folder.glob("mxlib-*.whl")), sorted(folder.glob("mxlib-*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, f"expected one wheel and one sdist in {folder}, got {wheels + sdists}"
    return {"wheel": wheels[0], "sdist": sdists[0]}


def _snapshot_of_the_source(dest: Path) -> Path:
    """Copy the files a release is built from into ``dest``: git's tracked files in a git checkout, else the
    tree without build output, virtual environments or caches."""
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True)
    if listed.returncode == 0 and listed.stdout:
        for name in listed.stdout.decode().split("\0"):
            if name and (ROOT / name).is_file():
                (dest / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, dest / name)
    else:
        skip = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache")
        shutil.copytree(ROOT, dest, ignore=skip)
    return dest


def _version() -> str:
    namespace = {}
    for line in (ROOT / "mxlib" / "__init__.py").read_text().splitlines():
        if line.startswith("__version__"):
            exec(line, namespace)
    return namespace["__version__"]


def _dist_info(names) -> str:
    (info,) = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
    return info


@pytest.mark.slow
def test_the_wheel_holds_the_package_the_notebooks_and_the_license(dist):
    with zipfile.ZipFile(dist["wheel"]) as whl:
        names = set(whl.namelist())
        info = _dist_info(names)
        package = {n for n in names if not n.startswith(info + "/")}
        expected = {p.relative_to(ROOT).as_posix() for p in (ROOT / "mxlib").rglob("*.py")}
        expected |= {"mxlib/py.typed", "mxlib/notebooks/__init__.py"} | {f"mxlib/notebooks/{n}" for n in NOTEBOOKS}
        expected |= {p.relative_to(ROOT).as_posix() for p in (ROOT / "mxlib/models/trained").glob("*/*")}
        assert package == expected, f"missing {sorted(expected - package)}, unexpected {sorted(package - expected)}"
        assert NOTEBOOKS and all(n[:2].isdigit() for n in NOTEBOOKS), NOTEBOOKS
        for name in NOTEBOOKS:
            assert whl.read(f"mxlib/notebooks/{name}") == (ROOT / "notebooks" / name).read_bytes(), name
        assert {f"{info}/{n}" for n in ("METADATA", "WHEEL", "RECORD", "entry_points.txt")} <= names
        assert whl.read(f"{info}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
        assert "[console_scripts]\nmxlib = mxlib.cli:main" in whl.read(f"{info}/entry_points.txt").decode()


@pytest.mark.slow
def test_the_wheel_metadata_keeps_the_notebook_stack_in_extras(dist):
    requirements = pytest.importorskip("packaging.requirements")
    with zipfile.ZipFile(dist["wheel"]) as whl:
        meta = email.parser.Parser().parsestr(whl.read(f"{_dist_info(whl.namelist())}/METADATA").decode())
    assert meta["Name"] == "mxlib" and meta["Version"] == _version()
    assert meta["License-Expression"] == "Apache-2.0" and meta.get_all("License-File") == ["LICENSE"]
    assert meta["Description-Content-Type"] == "text/markdown"
    reqs = [requirements.Requirement(r) for r in meta.get_all("Requires-Dist")]
    core = {r.name.lower() for r in reqs if r.marker is None}
    in_extras = {
        extra: {r.name.lower() for r in reqs if r.marker is not None and r.marker.evaluate({"extra": extra})}
        for extra in meta.get_all("Provides-Extra")
    }
    bad = sorted(n for n in core if n.startswith(EXTRA_ONLY) or n.startswith("pytest"))
    assert bad == [], f"the core requirements of the wheel hold {bad}; they belong in an extra"
    assert {"torch", "numpy", "safetensors"} <= core, core
    assert "triton" not in core and "triton" in in_extras["triton"] and "triton" in in_extras["gpu"], in_extras
    assert {"jupyterlab", "papermill", "nbval", "nbconvert", "ipykernel"} <= in_extras["workbook"], in_extras
    assert "pytest" in in_extras["test"], in_extras


@pytest.mark.slow
def test_the_sdist_holds_what_the_wheel_is_built_from(dist):
    with tarfile.open(dist["sdist"]) as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    needed = {"pyproject.toml", "setup.py", "README.md", "LICENSE", "mxlib/py.typed", "notebooks/__init__.py"}
    needed |= {f"notebooks/{n}" for n in NOTEBOOKS}
    needed |= {p.relative_to(ROOT).as_posix() for p in (ROOT / "mxlib/models/trained").glob("*/*")}
    assert needed <= names, sorted(needed - names)
    assert not [n for n in names if n.startswith(("build/", ".venv/", ".git/", ".ci/"))], sorted(names)


def _files(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if "__pycache__" not in p.parts}


@pytest.mark.slow
@pytest.mark.notebook
def test_the_installed_wheel_runs_a_notebook_from_its_package_data(dist, tmp_path):
    pytest.importorskip("papermill")
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site), dist["wheel"]],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    before = _files(site)
    elsewhere = tmp_path / "elsewhere"  # outside the checkout: no notebooks/ folder around
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MXLIB_CACHE")}
    env.update(PYTHONPATH=str(site), XDG_CACHE_HOME=str(tmp_path / "cache"))
    where = subprocess.run(
        [
            sys.executable,
            "-c",
            "import mxlib.workbook.runner as r, mxlib.studies.steps as s\n"
            "print(r.__file__); print(r.default_notebooks()); print(s.default_cache_dir())",
        ],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
    )
    assert where.returncode == 0, where.stderr
    module, notebooks, cache = where.stdout.split()
    assert Path(module).is_relative_to(site) and Path(notebooks) == site / "mxlib" / "notebooks", where.stdout
    assert Path(cache) == tmp_path / "cache" / "mxlib" / "checkpoints", where.stdout  # $XDG_CACHE_HOME/mxlib
    run = subprocess.run(
        [sys.executable, "-m", "mxlib.workbook", "--only", "00", "--out", "executed"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    executed = json.loads((elsewhere / "executed" / "00_first_principles.ipynb").read_text())
    code = [c for c in executed["cells"] if c["cell_type"] == "code"]
    assert code and all(c["execution_count"] is not None for c in code), "not every code cell ran"
    assert (elsewhere / "executed" / "00_first_principles.html").is_file()
    assert _files(site) == before, sorted(_files(site) ^ before)  # nothing written into the installed package
