"""One table of bounds (``mxlib.models.parameters.PARAMETER_BOUNDS``) for every entry point, checked before anything
is built; each refusal names the parameter, its bound and the value.

Every entry of the table is tried just outside each of its bounds (and at the bounds themselves, accepted) at both
entry points: the command line (each option that sets it, in-process, with the commands' runners replaced by a
failure: nothing may be built or run) and the notebooks' checks (``steps.check_e2e_parameters``, ``dummy_model``,
``calibrate_model``, ``check_parameters``, ``accuracy.check_accuracy_parameters``,
``recovery.check_recovery_parameters``). Notebooks 00 and 02 (no model) are run up to their check: each new size too
small, too large and of the wrong type is refused before a tensor is drawn, and their defaults pass.
"""

from pathlib import Path

import pytest

from mxlib import cli
from mxlib.models.parameters import PARAMETER_ALIASES, PARAMETER_BOUNDS, check_parameter
from mxlib.models.presets import preset_context, preset_experts, preset_layers
from mxlib.studies import accuracy as A
from mxlib.studies import recovery as RC
from mxlib.studies import steps as W

PRESET = "tiny"


def _upper(name, preset=PRESET):
    return PARAMETER_BOUNDS[name].upper_for(preset)[0]


def _outside(name, preset=PRESET):
    """``[(value, the bound it breaks)]``: just below the lower bound and just above the upper one."""
    b = PARAMETER_BOUNDS[name]
    step = 1 if b.integer else 0.5
    upper = _upper(name, preset)
    above = upper + step if upper + step > upper else 2 * upper  # 1e30 + 0.5 is 1e30
    return [(b.lower - step, b.lower), (above, upper)]


def _assert_refusal(message, shown, value, bound):
    assert message.startswith(f"{shown}: expected "), message
    assert f"{value!r}" in message and f"{bound}" in message, message
    assert ("below the lower bound" if value < bound else "above the upper bound") in message, message


def test_the_model_dependent_bounds_are_the_presets():
    assert _upper("num_hidden_layers", "qwen3-30b-a3b") == preset_layers("qwen3-30b-a3b") == 48
    assert _upper("num_tokens", "qwen3-30b-a3b") == preset_context("qwen3-30b-a3b") == 40960
    assert _upper("num_tokens", "gpt-oss-20b") == 131072 and _upper("num_hidden_layers", "gpt-oss-20b") == 24
    assert _upper("num_experts", "qwen3-30b-a3b") == preset_experts("qwen3-30b-a3b") == 128
    assert _upper("seed") == 2**32 - 1 and _upper("calib_tokens") == 2**20
    assert all(a in PARAMETER_BOUNDS for a in PARAMETER_ALIASES.values())


@pytest.mark.parametrize("name", sorted(n for n in PARAMETER_BOUNDS if PARAMETER_BOUNDS[n].multiple_of > 1))
def test_a_bound_with_a_block_size_refuses_other_multiples(name):
    b = PARAMETER_BOUNDS[name]
    assert check_parameter(name, 2 * b.multiple_of) == 2 * b.multiple_of
    for value in (b.multiple_of + 1, 3 * b.multiple_of // 2, b.upper - 1):
        with pytest.raises(ValueError) as err:
            check_parameter(name, value)
        message = str(err.value)
        assert message.startswith(f"{name}: expected an integer from {b.lower} to {b.upper} "), message
        assert message.endswith(f"; {value!r} is not a multiple of {b.multiple_of}"), message


@pytest.mark.parametrize("name", sorted(PARAMETER_BOUNDS))
def test_every_bound_accepts_its_ends_and_refuses_beyond(name):
    b = PARAMETER_BOUNDS[name]
    assert check_parameter(name, b.lower, model_preset=PRESET) == b.lower
    assert check_parameter(name, _upper(name), model_preset=PRESET) == _upper(name)
    for value, bound in _outside(name):
        with pytest.raises(ValueError) as err:
            check_parameter(name, value, model_preset=PRESET)
        _assert_refusal(str(err.value), name, value, bound)
    lists = () if b.sweep else ([b.lower], (b.lower,))  # a list only where the entry takes a sweep (spreads)
    for bad in (True, None, "3", float("nan")) + (() if not b.integer else (2.0,)) + lists:
        with pytest.raises(ValueError, match=f"^{name}: expected "):
            check_parameter(name, bad, model_preset=PRESET)


# ----------------------------------------------------------------------------- the command line

# table entry -> (command, option) of every option that sets it
CLI_OPTIONS = {
    "num_hidden_layers": [("e2e", "--layers"), ("compare", "--layers"), ("unify", "--layers"), ("routing", "--layers")],
    "num_tokens": [("e2e", "--tokens"), ("compare", "--tokens"), ("unify", "--tokens")],
    "calib_tokens": [("e2e", "--calib-tokens"), ("routing", "--calib-tokens")],
    "seed": [("e2e", "--seed"), ("compare", "--seed"), ("routing", "--seed")],
    "output_layers": [("unify", "--output-layers")],
    "expert_spread": [("unify", "--spread"), ("routing", "--spread"), ("unify", "--spreads")],
}
NOTEBOOK_ONLY = {"repeats", "token_sets", "num_experts", "eval_prompts", "calib_prompts", "resamples"}
# the example tensors of notebook 00 and the test data of notebook 02 (no model)
NOTEBOOK_00 = {"tokens", "hidden", "out_features", "block_amax"}
NOTEBOOK_02 = {"num_rows", "row_length", "num_draws", "outlier_fraction", "outlier_scale"}
NOTEBOOK_ONLY |= NOTEBOOK_00 | NOTEBOOK_02


def test_every_entry_is_an_option_or_a_notebook_parameter():
    assert set(CLI_OPTIONS) | NOTEBOOK_ONLY == set(PARAMETER_BOUNDS)
    assert not set(CLI_OPTIONS) & NOTEBOOK_ONLY


class _Built(AssertionError):
    pass


@pytest.fixture
def nothing_runs(monkeypatch):
    def refuse(cmd):
        raise _Built(f"{cmd} was started before its options were checked")

    monkeypatch.setattr(cli, "_command", refuse)


CLI_CASES = [(name, cmd, opt) for name, opts in CLI_OPTIONS.items() for cmd, opt in opts]


@pytest.mark.parametrize("name,cmd,option", CLI_CASES, ids=[f"{c}{o}" for _, c, o in CLI_CASES])
def test_cli_refuses_each_option_beyond_its_upper_bound(nothing_runs, capsys, name, cmd, option):
    value, bound = _outside(name, PRESET)[1]
    text = str(int(value) if PARAMETER_BOUNDS[name].integer else value)
    with pytest.raises(SystemExit) as exc:
        cli.main([cmd, "--preset", PRESET, option, text])
    assert exc.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    shown = f"{option}[0]" if option == "--spreads" else option
    assert line.startswith(f"mxlib {cmd}: error: "), line
    _assert_refusal(line[len(f"mxlib {cmd}: error: ") :], shown, value, bound)


@pytest.mark.parametrize("name,cmd,option", CLI_CASES, ids=[f"{c}{o}" for _, c, o in CLI_CASES])
def test_cli_refuses_each_option_below_its_lower_bound(nothing_runs, capsys, name, cmd, option):
    value, _ = _outside(name, PRESET)[0]
    with pytest.raises(SystemExit) as exc:
        cli.main([cmd, "--preset", PRESET, option, str(value)])
    assert exc.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert option in line and str(value) in line, line  # argparse's type: "expected a positive integer, got '0'"


@pytest.mark.parametrize("value", [2**64, 2**32])
def test_cli_seed_and_calibration_tokens_of_the_report(nothing_runs, capsys, value):
    for argv in (["e2e", "--seed", str(value)], ["e2e", "--calib-tokens", str(10**12)]):
        with pytest.raises(SystemExit):
            cli.main(argv)
        assert "above the upper bound" in capsys.readouterr().err


def test_dummy_from_config_bounds_its_seed_and_tokens(nothing_runs, capsys, tmp_path):
    for option, name in (("--seed", "seed"), ("--tokens", "num_tokens")):
        value, bound = _outside(name)[1]
        with pytest.raises(SystemExit):
            cli.main(
                ["dummy-from-config", str(tmp_path), str(tmp_path / "out"), "--preset", PRESET, option, str(value)]
            )
        line = capsys.readouterr().err.strip().splitlines()[-1]
        _assert_refusal(line.split(": error: ", 1)[1], option, value, bound)


# ----------------------------------------------------------------------------- the notebooks' checks


def _refuses(call, shown, value, bound):
    with pytest.raises(ValueError) as err:
        call()
    _assert_refusal(str(err.value), shown, value, bound)


E2E = ["num_hidden_layers", "num_tokens", "calib_tokens", "repeats", "seed"]


@pytest.mark.parametrize("name", E2E)
@pytest.mark.parametrize("side", [0, 1], ids=["lower", "upper"])
def test_notebook_01_check_e2e_parameters(name, side):
    value, bound = _outside(name)[side]
    _refuses(lambda: W.check_e2e_parameters(model_preset=PRESET, device="cpu", **{name: value}), name, value, bound)
    names = {name: f"--{name}"}  # the caller's name for it is the one shown
    _refuses(
        lambda: W.check_e2e_parameters(model_preset=PRESET, device="cpu", names=names, **{name: value}),
        f"--{name}",
        value,
        bound,
    )


@pytest.fixture
def nothing_built(monkeypatch):
    def refuse(*a, **k):
        raise _Built("a model was built before its parameters were checked")

    monkeypatch.setattr(W, "dummy_qwen3_moe", refuse)
    monkeypatch.setattr(W, "dummy_gpt_oss", refuse)
    monkeypatch.setattr(W, "calibrate", refuse)


@pytest.mark.parametrize("side", [0, 1], ids=["lower", "upper"])
def test_notebooks_03_04_builders_check_before_building(nothing_built, side):
    for name in ("num_hidden_layers", "seed", "expert_spread"):
        value, bound = _outside(name)[side]
        _refuses(
            lambda: W.dummy_model(**{"num_hidden_layers": 1, name: value}, model_preset=PRESET), name, value, bound
        )
    for name in ("calib_tokens", "seed"):
        value, bound = _outside(name)[side]
        kw = {"calib_tokens": 16, "seed": 0, name: value}
        _refuses(lambda: W.calibrate_model(None, kw["calib_tokens"], kw["seed"]), name, value, bound)


@pytest.mark.parametrize("name", sorted(PARAMETER_BOUNDS))
@pytest.mark.parametrize("side", [0, 1], ids=["lower", "upper"])
def test_notebook_check_parameters_every_entry(name, side):
    value, bound = _outside(name)[side]
    _refuses(lambda: W.check_parameters(PRESET, **{name: value}), name, value, bound)
    if name == "expert_spread":
        _refuses(lambda: W.check_parameters(PRESET, spreads=[0.0, value]), "spreads[1]", value, bound)


@pytest.mark.parametrize("name", ["eval_prompts", "calib_prompts", "resamples", "seed"])
@pytest.mark.parametrize("side", [0, 1], ids=["lower", "upper"])
def test_notebooks_06_07_accuracy_parameters(name, side):
    value, bound = _outside(name)[side]
    _refuses(lambda: A.check_accuracy_parameters(recipe="test", **{name: value}), name, value, bound)


@pytest.mark.parametrize(
    "name,entry",
    [
        ("dummy_layers", "num_hidden_layers"),
        ("dummy_tokens", "num_tokens"),
        ("dummy_calib_tokens", "calib_tokens"),
        ("dummy_experts", "num_experts"),
    ],
)
@pytest.mark.parametrize("side", [0, 1], ids=["lower", "upper"])
def test_notebook_07_recovery_parameters(name, entry, side):
    value, bound = _outside(entry, "qwen3-30b-a3b")[side]
    kw = {name: value}
    if name == "dummy_experts":
        kw["dummy_top_k"] = 1
    _refuses(
        lambda: RC.check_recovery_parameters(recipe="test", dummy_preset="qwen3-30b-a3b", **kw), name, value, bound
    )


@pytest.mark.parametrize("alias", sorted(PARAMETER_ALIASES))
def test_every_alias_is_checked_by_its_entry_and_named_as_itself(alias):
    entry = PARAMETER_ALIASES[alias]
    for value, bound in _outside(entry):
        _refuses(lambda: W.check_parameters(PRESET, **{alias: value}), alias, value, bound)


def _notebook_checks(path):
    """``(bounded parameters of the notebook's parameters cell, identifiers passed to check_* calls in the first
    code cell after it)``."""
    import json
    import re

    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    at = next(i for i, c in enumerate(cells) if "parameters" in c.get("metadata", {}).get("tags", []))
    params = {m[1] for m in re.finditer(r"^(\w+) = ", "".join(cells[at]["source"]), re.M)}
    bounded = {p for p in params if p in PARAMETER_BOUNDS or p in PARAMETER_ALIASES}
    checked = set()
    for call in re.finditer(r"check_\w+\((.*?)\)\s*(?:#|$)", "".join(cells[at + 1]["source"]), re.S | re.M):
        checked |= set(re.findall(r"\w+", call[1]))
    return bounded, checked


NOTEBOOKS = sorted(p for p in (Path(__file__).resolve().parents[1] / "notebooks").glob("0*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_bounded_notebook_parameter_is_checked_right_after_the_parameters(path):
    bounded, checked = _notebook_checks(path)
    assert bounded <= checked, f"{path.stem}: {sorted(bounded - checked)} not checked after the parameters cell"


# ----------------------------------------------------------------------------- notebooks 00 and 02, as they run


def _parameters_and_check_cells(stem):
    """``(source of the parameters cell, source of the code cell after it)`` of ``notebooks/<stem>*.ipynb``."""
    import json

    path = next(p for p in NOTEBOOKS if p.stem.startswith(stem))
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    at = next(i for i, c in enumerate(cells) if "parameters" in c.get("metadata", {}).get("tags", []))
    return "".join(cells[at]["source"]), "".join(cells[at + 1]["source"])


def _run_first_cells(stem, **overrides):
    """The notebook's parameters cell, ``overrides`` as papermill injects them, then its next cell (the imports and
    the parameter check): the namespace, or the exception of the check."""
    parameters, first = _parameters_and_check_cells(stem)
    namespace = {"display": print}
    exec(parameters, namespace)
    namespace.update(overrides)
    exec(first, namespace)
    return namespace


NEW_BOUNDS = sorted((stem, name) for stem, names in (("00", NOTEBOOK_00), ("02", NOTEBOOK_02)) for name in names)


@pytest.mark.parametrize("stem", ["00", "02"])
def test_notebooks_00_02_defaults_lie_within_their_bounds(stem):
    namespace = _run_first_cells(stem)
    bounded = {n for n in (NOTEBOOK_00 if stem == "00" else NOTEBOOK_02) | {"seed"}}
    for name in bounded:
        assert check_parameter(name, namespace[name]) == namespace[name]


@pytest.mark.parametrize("stem,name", NEW_BOUNDS, ids=[f"{s}-{n}" for s, n in NEW_BOUNDS])
def test_notebooks_00_02_refuse_each_size_at_their_first_cell(monkeypatch, stem, name):
    """Too small, too large and of the wrong type: refused by the cell after the parameters, before the notebook
    allocates a tensor (``torch.randn`` and ``torch.rand`` replaced by a failure)."""
    import torch

    def refuse(*a, **k):
        raise _Built("a tensor was drawn before the parameters were checked")

    monkeypatch.setattr(torch, "randn", refuse)
    monkeypatch.setattr(torch, "rand", refuse)
    b = PARAMETER_BOUNDS[name]
    for value, bound in _outside(name):
        _refuses(lambda: _run_first_cells(stem, **{name: value}), name, value, bound)
    for wrong in ("64", None, [b.lower]) + ((float(b.lower),) if b.integer else ()):
        with pytest.raises(ValueError, match=f"^{name}: expected (an integer|a finite number) from "):
            _run_first_cells(stem, **{name: wrong})


def test_the_values_of_the_report_are_refused_by_notebook_02():
    for name, value in (("num_draws", 10**9), ("row_length", 0), ("row_length", 100), ("num_rows", 2.5)):
        with pytest.raises(ValueError, match=f"^{name}: expected an integer from "):
            _run_first_cells("02", **{name: value})


def test_notebook_00_refuses_an_unknown_scale_mode():
    with pytest.raises(ValueError, match="unknown scale_mode 'ceil'; expected one of"):
        _run_first_cells("00", scale_mode="ceil")
