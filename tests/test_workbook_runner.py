"""``python -m mxlib.workbook`` (``mxlib.workbook.runner``): its options, and where a run writes.

Bad options are refused with one line naming the option and the valid values (exit code 2)
before any notebook runs; the notebooks folder defaults to the source checkout's only; a run
writes the executed copies, the HTML and the results JSON under ``--out`` and nothing else (the
notebooks run with ``--out`` as their working directory). papermill's execution is replaced by a
stand-in here: tests/test_notebooks.py runs the notebooks themselves.
"""

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


def test_notebooks_default_only_in_a_source_checkout(monkeypatch, tmp_path, capsys):
    assert runner.source_notebooks() == ROOT / "notebooks"  # this checkout
    monkeypatch.setattr(runner, "source_notebooks", lambda: None)  # an installed mxlib
    err = _error(["--out", str(tmp_path / "out")], capsys)
    assert "--notebooks" in err and "source checkout" in err, err


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
