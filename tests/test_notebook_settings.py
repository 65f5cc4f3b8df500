"""Every notebook at the settings it suggests to a reader, exactly as suggested.

tests/test_notebooks.py runs each notebook on parameters shrunk for the tests (the ``tiny`` preset, fewer prompts,
the producers' fixtures); ``make workbook`` runs each at its full-size defaults (``model_preset`` set to the real
shape). What is left is what a reader is told to run: a notebook's own defaults as JupyterLab opens it (the
``small`` preset of 01, 03 and 04; 00 has no preset) and each quick setting the notebook's text suggests (06:
``recipe = "test"``; 07: ``recipe = "test"`` with ``dummy_preset = "small"``). Each runs here with nothing else
changed (only ``results_path``, which the fixture sets), and must pass the notebook's own checks cells (a failed
check raises, and the run fails). 02 and 05 run at their defaults under nbval (``make test-notebooks``).
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("papermill")

SUGGESTED: dict[str, tuple[str, dict]] = {
    "00-defaults": ("00_first_principles", {}),
    "01-defaults": ("01_end_to_end", {}),
    "03-defaults": ("03_scheme_comparison", {}),
    "04-defaults": ("04_scale_unification", {}),
    "06-quick": ("06_what_fp4_costs", {"recipe": "test"}),
    "07-quick": ("07_accuracy_recovery", {"recipe": "test", "dummy_preset": "small"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("entry", sorted(SUGGESTED))
def test_a_suggested_setting_runs_and_passes_its_checks(entry, executed_notebook):
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
