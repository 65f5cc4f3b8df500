"""Every notebook at the settings it suggests to a reader, exactly as suggested.

tests/test_notebooks.py runs each notebook on parameters shrunk for the tests (the ``tiny`` preset, fewer prompts,
the producers' fixtures); ``make workbook`` runs each at its full-size defaults (``model_preset`` set to the real
shape). What is left is what a reader is told to run: a notebook's own defaults as JupyterLab opens it (the
``small`` preset of 01, 03 and 04; 00 has no preset) and each quick run the notebook's text suggests (06 and 07:
the assignments of the ```` ```python ```` block under their "A quick run" paragraph, which
``test_the_quick_runs_are_the_ones_the_notebooks_suggest`` reads from the notebook). Each runs here with nothing
else changed (only ``results_path``, which the fixture sets), and must pass the notebook's own checks cells (a
failed check raises, and the run fails). 02 and 05 run at their defaults under nbval (``make test-notebooks``).

The quick runs of 06 and 07 are also the executions whose results tests/test_notebooks.py checks in detail
(``NOTEBOOK_PARAMS`` takes them from ``SUGGESTED``), and tests/test_render.py renders them and 00's defaults: the
``executed_notebook`` fixture runs each once, and the tests that share it form one ``xdist_group``, so that they run
one after the other on one worker (instead of one worker waiting for the execution another holds).
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SUGGESTED: dict[str, tuple[str, dict]] = {
    "00-defaults": ("00_first_principles", {}),
    "01-defaults": ("01_end_to_end", {}),
    "03-defaults": ("03_scheme_comparison", {}),
    "04-defaults": ("04_scale_unification", {}),
    # the trained model's test recipe (reverse and count), two schemes of the twelve, three strategies
    "06-quick": (
        "06_what_fp4_costs",
        dict(
            recipe="test",
            schemes=["nvfp4", "w_mxfp4_a_mxfp4"],
            strategies=["max", "per_expert", "per_token"],
            eval_prompts=150,
            calib_prompts=32,
            resamples=200,
            attribution_schemes=["nvfp4"],
            attribution_tasks=["reverse", "count"],
            attribution_dummy_preset="tiny",
            attribution_dummy_layers=2,
            attribution_dummy_tokens=32,
        ),
    ),
    # round-to-nearest, 4/6 and GPTQ under a rotation (so Hessians, a composition and an online transform) in the two
    # default schemes on the test recipe; the dummy model at the tiny preset (every technique has its own tests:
    # tests/test_recovery_*.py)
    "07-quick": (
        "07_accuracy_recovery",
        dict(
            recipe="test",
            techniques="rtn,four_over_six,gptq+hadamard",
            table_task="count",
            eval_prompts=100,
            calib_prompts=32,
            resamples=200,
            trap_tokens=64,
            trap_channels=1024,
            trap_out_features=64,
            trap_draws=4,
            dummy_preset="tiny",
            dummy_layers=2,
            dummy_experts=4,
            dummy_tokens=32,
            dummy_calib_tokens=64,
        ),
    ),
}

# The entries whose execution tests/test_notebooks.py or tests/test_render.py read too: one group per execution.
SHARED: dict[str, str] = {
    "00-defaults": "00_first_principles",
    "06-quick": "06_what_fp4_costs",
    "07-quick": "07_accuracy_recovery",
}


def quick_run(name: str) -> dict:
    """The quick run the prose of ``notebooks/<name>.ipynb`` suggests: the ``name = literal`` lines of the
    ```` ```python ```` block in the markdown cell that holds "A quick run". Raises AssertionError where there is
    no such block, or a line of it is not an assignment of a literal to a name."""
    cells = json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text(encoding="utf-8"))["cells"]
    prose = ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]
    text = next(t for t in prose if "A quick run" in t)
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 1, f"{name}: {len(blocks)} python blocks in its quick-run paragraph"
    setting = {}
    for node in ast.parse(blocks[0]).body:
        assert isinstance(node, ast.Assign) and len(node.targets) == 1, f"{name}: {ast.unparse(node)}"
        setting[node.targets[0].id] = ast.literal_eval(node.value)
    return setting


def test_the_quick_runs_are_the_ones_the_notebooks_suggest():
    """Each quick entry of ``SUGGESTED`` is its notebook's quick-run block, value for value, and every name in it
    is a parameter of the notebook's parameters cell."""
    for entry, (name, params) in SUGGESTED.items():
        if not entry.endswith("-quick"):
            continue
        setting = quick_run(name)
        assert setting == params, (entry, setting)
        cells = json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text(encoding="utf-8"))["cells"]
        parameters = next("".join(c["source"]) for c in cells if "parameters" in c["metadata"].get("tags", []))
        names = {n.targets[0].id for n in ast.parse(parameters).body if isinstance(n, ast.Assign)}
        assert set(setting) <= names, (entry, set(setting) - names)


@pytest.mark.slow
@pytest.mark.parametrize(
    "entry",
    [pytest.param(e, marks=pytest.mark.xdist_group(SHARED[e])) if e in SHARED else e for e in sorted(SUGGESTED)],
)
def test_a_suggested_setting_runs_and_passes_its_checks(entry, executed_notebook):
    pytest.importorskip("papermill")
    name, params = SUGGESTED[entry]
    folder = executed_notebook(name, params)
    executed = json.loads((folder / f"{name}.ipynb").read_text())
    errors = [
        o
        for c in executed["cells"]
        if c["cell_type"] == "code"
        for o in c.get("outputs", [])
        if o.get("output_type") == "error"
    ]
    assert errors == [], errors
    res = json.loads((folder / "results.json").read_text())
    assert res, entry
    if name in ("06_what_fp4_costs", "07_accuracy_recovery"):
        assert res["recipe"] == "test" and res["checks_passed"] > 0, res.get("checks_passed")
