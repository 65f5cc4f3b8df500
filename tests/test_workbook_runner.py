"""``python -m mxlib.workbook`` (``mxlib.workbook.runner``): its options, and where a run writes.

Bad options are refused with one line naming the option and the valid values (exit code 2)
before any notebook runs; the notebooks folder defaults to the source checkout's, else to the
installed package ``mxlib.notebooks``; ``--out`` never lies in the notebooks folder or the installed
packages; a run writes the executed copies, the HTML and the results JSON under ``--out`` and
nothing else (the notebooks run with ``--out`` as their working directory); without the workbook
extra the runner names it. papermill's execution is replaced by a stand-in here:
tests/test_notebooks.py runs the notebooks themselves, tests/test_wheel.py runs one from an
installed wheel.
"""

import importlib
import runpy
import sys
import sysconfig
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")

from mxlib.workbook import runner  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _notebook(path: Path, parameters: str) -> None:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    cell = nbformat.v4.new_code_cell(parameters)
    cell.metadata["tags"] = ["parameters"]
    nb.cells = [cell, nbformat.v4.new_code_cell("x = 1")]
    nbformat.write(nb, str(path))


@pytest.fixture
def notebooks(tmp_path):
    folder = tmp_path / "notebooks"
    folder.mkdir()
    _notebook(folder / "01_end_to_end.ipynb", 'scheme = "nvfp4"\nmodel_preset = "qwen3-30b-a3b"\nresults_path = ""')
    _notebook(folder / "02_other.ipynb", 'seed = 0\nresults_path = ""')
    return folder


def _error(argv, capsys) -> str:
    rc = runner.main(argv)
    err = capsys.readouterr().err
    assert rc == 2, (argv, rc, err)
    assert err.count("\n") == 1, err  # one line
    return err


@pytest.mark.parametrize(
    "argv,option,valid",
    [
        (["--only", "nope"], "--only", "01_end_to_end-nvfp4"),
        (["--model-preset", "huge"], "--model-preset", "tiny"),
        (["--notebooks", "/no/such/folder"], "--notebooks", "folder"),
    ],
    ids=["only", "model-preset", "notebooks"],
)
def test_bad_options_are_one_line_and_exit_2(argv, option, valid, notebooks, tmp_path, capsys):
    if option != "--notebooks":
        argv = argv + ["--notebooks", str(notebooks)]
    err = _error(argv + ["--out", str(tmp_path / "out")], capsys)
    assert option in err and valid in err, err
    assert not (tmp_path / "out").exists()


def test_notebooks_default_to_the_checkout_then_the_installed_package(notebooks, monkeypatch, tmp_path, capsys):
    assert runner.source_notebooks() == ROOT / "notebooks"  # this checkout
    assert runner.default_notebooks() == ROOT / "notebooks"
    # an installed mxlib: no checkout around it, the notebooks are the package data of NOTEBOOKS_PACKAGE
    monkeypatch.setattr(runner, "source_notebooks", lambda: None)
    site = tmp_path / "site"
    (site / "fake_mxlib_notebooks").mkdir(parents=True)
    (site / "fake_mxlib_notebooks" / "__init__.py").write_text("")
    _notebook(site / "fake_mxlib_notebooks" / "02_other.ipynb", "seed = 0")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(runner, "NOTEBOOKS_PACKAGE", "fake_mxlib_notebooks")
    assert runner.default_notebooks() == site / "fake_mxlib_notebooks"
    seen = []
    monkeypatch.setattr(runner, "run", lambda nb, out, only, preset: seen.append((nb, only)) or [])
    assert runner.main(["--only", "02", "--out", str(tmp_path / "out")]) == 0
    assert seen == [(site / "fake_mxlib_notebooks", "02")]
    err = _error(["--only", "01", "--out", str(tmp_path / "out")], capsys)  # not among the installed ones
    assert "--only" in err and "02_other" in err, err
    # neither: the error says how to give them
    monkeypatch.setattr(runner, "NOTEBOOKS_PACKAGE", "no_such_package_of_notebooks")
    assert runner.installed_notebooks() is None
    err = _error(["--out", str(tmp_path / "out")], capsys)
    assert "--notebooks" in err and "no_such_package_of_notebooks" in err, err


def test_out_stays_out_of_the_notebooks_and_the_installed_packages(notebooks, tmp_path, capsys):
    purelib = Path(sysconfig.get_path("purelib"))
    for out in (notebooks, notebooks / "executed", purelib / "build" / "workbook"):
        err = _error(["--notebooks", str(notebooks), "--out", str(out)], capsys)
        assert "--out" in err and str(out) in err, err
        assert not (notebooks / "executed").exists() and not (purelib / "build" / "workbook").exists()
    assert runner.forbidden_out(tmp_path / "out", notebooks) is None


def test_main_names_the_command_it_runs_as(notebooks, tmp_path, capsys):
    rc = runner.main(["--only", "nope", "--notebooks", str(notebooks)], prog="mxlib workbook")
    assert rc == 2 and capsys.readouterr().err.startswith("mxlib workbook: error: --only"), rc


def test_without_the_workbook_extra_the_error_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "papermill", None)  # an import of papermill fails as if it were absent
    monkeypatch.delitem(sys.modules, "mxlib.workbook.runner")
    monkeypatch.delitem(sys.modules, "mxlib.workbook.__main__", raising=False)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'mxlib\[workbook\]'"):
        importlib.import_module("mxlib.workbook.runner")
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("mxlib.workbook", run_name="__main__")
    assert str(exit_.value.code).startswith("python -m mxlib.workbook: error: ") and "mxlib[workbook]" in str(
        exit_.value.code
    )


def test_a_notebooks_folder_without_notebooks_is_refused(tmp_path, capsys):
    err = _error(["--notebooks", str(tmp_path), "--out", str(tmp_path / "out")], capsys)
    assert "--notebooks" in err and ".ipynb" in err, err


def test_out_defaults_to_build_workbook_under_the_current_directory(notebooks, tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(runner, "run", lambda nb, out, only, preset: seen.append(out) or [])
    monkeypatch.chdir(tmp_path)
    assert runner.main(["--notebooks", str(notebooks)]) == 0
    assert seen == [Path("build") / "workbook"]  # relative: under the current directory


def test_a_run_writes_under_out_only(notebooks, tmp_path, monkeypatch):
    calls = []

    def execute(src, dst, parameters, cwd, **kwargs):
        calls.append(dict(src=src, dst=dst, parameters=parameters, cwd=cwd))
        nbformat.write(nbformat.read(src, as_version=4), dst)

    monkeypatch.setattr(runner.pm, "execute_notebook", execute)
    before = sorted(p.name for p in notebooks.iterdir())
    out = tmp_path / "out"
    done = runner.run(notebooks, out, model_preset="tiny")
    assert [name for name, _ in done] == ["01_end_to_end-nvfp4", "01_end_to_end-mxfp4", "02_other"]
    assert all(c["cwd"] == str(out) for c in calls)
    params = {Path(c["dst"]).stem: c["parameters"] for c in calls}
    assert params["01_end_to_end-mxfp4"] == {
        "scheme": "w_mxfp4_a_mxfp4",
        "results_path": "results/01_end_to_end-mxfp4.json",
        "model_preset": "tiny",
    }
    assert params["02_other"] == {"results_path": "results/02_other.json"}  # it takes no model_preset
    assert sorted(p.name for p in notebooks.iterdir()) == before
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert [w for w in written if not w.startswith(("out/", "notebooks/"))] == []
    assert {f"out/{n}.{ext}" for n, _ in done for ext in ("ipynb", "html")} <= set(written)
