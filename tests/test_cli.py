"""The ``mxlib`` command as a user meets it: help on every option, choices that are the library's tables,
``--help`` in under a second without torch, user mistakes as one ``mxlib CMD: error:`` line with exit code 2
(bugs keep their traceback), ``-v`` / ``-q`` logging, progress bars, and ``workbook`` delegating to the runner.

Model runs here use the ``tiny`` preset and 1-2 layers on the CPU's torch path.
"""

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mxlib import cli
from mxlib.checkpoints import LAYOUTS, load_quantized_qwen3_moe, write_quantized_checkpoint
from mxlib.checkpoints.mixed import PRODUCER_LAYOUTS
from mxlib.cli import _options as O
from mxlib.cli import runs
from mxlib.models.calibration import calibrate
from mxlib.models.qwen3 import MODEL_PRESETS
from mxlib.moe import BACKENDS, MOE_SCHEMES, SCALE_STRATEGIES
from mxlib.moe.schemes import FP8_LINEAR_SCHEMES, get_moe_scheme
from mxlib.moe.schemes import SCHEME_ALIASES as _ALIASES
from mxlib.recovery import TECHNIQUES
from mxlib.studies import steps as W

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "tests" / "fixtures" / "configs"
COMMANDS = [
    "e2e",
    "compare",
    "unify",
    "routing",
    "inspect",
    "dummy-from-config",
    "quantize",
    "attribute-groups",
    "workbook",
]
MODEL_COMMANDS = ["e2e", "compare", "unify", "routing", "dummy-from-config", "attribute-groups"]


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    return cli.build_parser()[1].choices


def _options(parser):
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]


# ----------------------------------------------------------------------------- help, defaults, choices


def test_the_commands_are_the_documented_ones():
    assert list(_subparsers()) == COMMANDS


@pytest.mark.parametrize("cmd", COMMANDS)
def test_every_option_has_help_that_states_its_default(cmd):
    parser = _subparsers()[cmd]
    formatter = parser._get_formatter()
    for action in _options(parser):
        assert action.help, f"{cmd} {action.dest}: no help text"
        if action.option_strings:
            text = formatter._get_help_string(action)
            assert "default" in text, f"{cmd} {action.option_strings[0]}: the help states no default: {text!r}"


def test_top_level_help_states_the_logging_defaults():
    ap, _ = cli.build_parser()
    formatter = ap._get_formatter()
    for action in _options(ap):
        if action.option_strings:
            assert "default" in formatter._get_help_string(action), action.option_strings


def test_the_option_tables_equal_the_library_tables():
    """The CLI spells the names out (so that --help needs no torch): each must be its table's copy."""
    assert O.SCHEMES == tuple(MOE_SCHEMES)
    assert O.SCHEME_ALIASES == tuple(_ALIASES) and all(get_moe_scheme(a) for a in O.SCHEME_ALIASES)
    assert O.STRATEGIES == tuple(SCALE_STRATEGIES)
    assert O.BACKENDS == tuple(BACKENDS)
    assert O.LAYOUTS == tuple(LAYOUTS)
    assert O.LINEAR_SCHEMES == tuple(FP8_LINEAR_SCHEMES) and O.PRODUCERS == tuple(PRODUCER_LAYOUTS)
    assert O.PRESETS == tuple(MODEL_PRESETS) and MODEL_PRESETS[O.FULL_PRESET] == {}
    assert O.TECHNIQUES == tuple(TECHNIQUES)


# option -> the library table its choices must list
CLOSED_SETS = {
    "--scheme": tuple(MOE_SCHEMES) + tuple(_ALIASES),
    "--backend": tuple(BACKENDS),
    "--preset": tuple(MODEL_PRESETS),
    "--layout": tuple(LAYOUTS),
    "--technique": tuple(TECHNIQUES),
}


@pytest.mark.parametrize("cmd", COMMANDS)
def test_closed_sets_are_choices(cmd):
    for action in _options(_subparsers()[cmd]):
        for option in action.option_strings:
            if option in CLOSED_SETS:
                assert tuple(action.choices) == CLOSED_SETS[option], (cmd, option)


@pytest.mark.parametrize("cmd", MODEL_COMMANDS)
def test_every_model_command_takes_a_preset_light_by_default(cmd):
    preset = next(a for a in _options(_subparsers()[cmd]) if "--preset" in a.option_strings)
    assert preset.default == "small" and "small" in preset.help
    # small is light: well under 1% of the full model's expert weights per layer
    small, full = MODEL_PRESETS["small"], {"hidden_size": 2048, "moe_intermediate_size": 768, "num_experts": 128}
    ratio = (small["hidden_size"] * small["moe_intermediate_size"] * small["num_experts"]) / (2048 * 768 * 128)
    assert ratio < 0.01 and all(k in small for k in full)


def test_list_options_check_every_item():
    parse = O.comma_list(O.STRATEGIES)
    assert parse("max,p90") == ["max", "p90"]
    for bad in ("max,nope", "", "max,,p90"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(bad)
    numbers = O.comma_list(item=O.nonnegative_float)
    assert numbers("0,1.5") == [0.0, 1.5]
    for bad in ("0,x", "-1", "nan", "inf"):
        with pytest.raises(argparse.ArgumentTypeError):
            numbers(bad)
    for fn, bad in ((O.positive_int, "0"), (O.positive_int, "1.5"), (O.nonnegative_int, "-1")):
        with pytest.raises(argparse.ArgumentTypeError):
            fn(bad)


# ----------------------------------------------------------------------------- --help speed, no torch

_NO_TORCH = """
import sys
from mxlib.cli import main
for argv in ([], *[[c] for c in {cmds!r}]):
    try:
        main(argv + ["--help"])
    except SystemExit as e:
        assert e.code == 0, (argv, e.code)
heavy = sorted(m for m in ("torch", "transformers", "triton", "numpy") if m in sys.modules)
print("HEAVY", heavy)
"""


def _env():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    return env


def test_help_imports_neither_torch_nor_transformers():
    cmds = [c for c in COMMANDS if c != "workbook"]  # workbook --help is the runner's (below)
    r = subprocess.run(
        [sys.executable, "-c", _NO_TORCH.format(cmds=cmds)], env=_env(), capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "HEAVY []" in r.stdout, r.stdout[-500:]


def test_python_m_mxlib_inspect_help_imports_neither_torch_nor_transformers():
    """``python -m mxlib inspect --help``, the entry a user types, in a fresh interpreter: its import log
    (``-X importtime``) names neither package (running ``inspect`` on a folder does import both: its layout check
    builds the family's model class on the meta device)."""
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "mxlib", "inspect", "--help"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and "usage: mxlib inspect" in r.stdout, r.stderr[-2000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "mxlib.cli" in imported, sorted(imported)[:20]  # the log is read right
    heavy = sorted(m for m in imported if m.split(".")[0] in ("torch", "transformers"))
    assert heavy == [], heavy[:10]


def _best_of_3(argv: list[str]) -> float:
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        r = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=120)
        best = min(best, time.perf_counter() - t0)
        assert r.returncode == 0 and "usage: mxlib" in r.stdout, r.stderr[-2000:]
    return best


@pytest.mark.parametrize("cmd", [None, *[c for c in COMMANDS if c != "workbook"]])
def test_help_answers_in_under_a_second(cmd):
    """``python -m mxlib.cli [CMD] --help`` (and the console script where it is installed), the best of
    three runs, in a fresh interpreter."""
    argv = [sys.executable, "-m", "mxlib.cli", *([cmd] if cmd else []), "--help"]
    seconds = _best_of_3(argv)
    assert seconds < 1.0, f"{' '.join(argv[2:])} took {seconds:.2f} s"
    script = Path(sys.executable).with_name("mxlib")
    if script.exists():  # the console script mxlib = mxlib.cli:main
        seconds = _best_of_3([str(script), *([cmd] if cmd else []), "--help"])
        assert seconds < 1.0, f"mxlib {cmd or ''} --help took {seconds:.2f} s"


# ----------------------------------------------------------------------------- user mistakes and bugs


class _Built(Exception):
    pass


@pytest.fixture
def no_model(monkeypatch):
    def refuse(*args, **kwargs):
        raise _Built("a model was built before the options were checked")

    monkeypatch.setattr(W, "dummy_model", refuse)


MISTAKES = [
    (["e2e", "--layers", "0"], "argument --layers: expected a positive integer, got '0'"),
    (["e2e", "--tokens", "x"], "argument --tokens: expected a positive integer, got 'x'"),
    (["e2e", "--seed", "-1"], "argument --seed: expected an integer >= 0"),
    (["e2e", "--scheme", "nope"], "argument --scheme: invalid choice: 'nope'"),
    (["e2e", "--preset", "huge"], "argument --preset: invalid choice: 'huge'"),
    (["e2e", "--backend", "gpu"], "argument --backend: invalid choice: 'gpu'"),
    (["e2e", "--device", "tpu"], "--device: expected 'auto', 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
    (["compare", "--schemes", "nvfp4,nope"], "argument --schemes: expected a comma-separated list of"),
    (["unify", "--spreads", "0,x"], "argument --spreads: expected a finite number >= 0, got 'x'"),
    (["unify", "--strategies", "max,p99"], "argument --strategies: expected a comma-separated list of"),
    (["routing", "--calib-tokens", "0"], "argument --calib-tokens: expected a positive integer"),
    (["routing", "--schemes", "nvfp4,nope"], "argument --schemes: expected a comma-separated list of"),
    (["routing", "--schemes", "nvfp4", "--sequences", "1"], "--sequences: expected at least 2 with --schemes"),
    (["inspect", "/no/such/checkpoint"], "path: '/no/such/checkpoint' does not exist"),
    (["dummy-from-config", "/no/such/configs", "/no/such/out"], "config_dir: '/no/such/configs' is not a folder"),
    (
        ["dummy-from-config", str(CONFIGS / "qwen3-30b-a3b"), "/no/such/out", "--layers", "49"],
        "--layers: expected 1 to the config's num_hidden_layers=48, got 49",
    ),
    (
        ["dummy-from-config", str(CONFIGS / "qwen3-30b-a3b"), "/no/such/out"],
        "names no scheme; choose one with scheme= (mxlib dummy-from-config --scheme)",
    ),
    (
        ["dummy-from-config", str(CONFIGS / "qwen3-30b-a3b"), "/no/such/out", "--scheme", "nvfp4", "--layout", "quark"],
        "--layout: quark does not store scheme nvfp4",
    ),
    (
        ["dummy-from-config", str(CONFIGS / "modelopt-nvfp4-qwen3-30b-a3b"), "/no/such/out", "--scheme", "w_mxfp4"],
        "--scheme: ",
    ),
    (
        ["dummy-from-config", str(CONFIGS / "modelopt-nvfp4-qwen3-30b-a3b"), str(CONFIGS / "README.md")],
        "README.md' is a file; expected an absent or empty folder",
    ),
    (
        ["dummy-from-config", str(CONFIGS / "modelopt-nvfp4-qwen3-30b-a3b"), str(CONFIGS)],
        "is a folder that is not an mxlib checkpoint; expected an absent or empty folder",
    ),
]


@pytest.mark.parametrize("argv,message", MISTAKES, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_a_mistake_is_one_error_line_and_exit_code_2(no_model, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"mxlib {argv[0]}: error: ") and message in line, err


def test_a_checkpoint_the_loader_refuses_is_an_error_line(tmp_path, capsys):
    """A folder with a config.json and no weights: inspect's CheckpointError (raised while it runs)."""
    src = CONFIGS / "modelopt-nvfp4-qwen3-30b-a3b"
    (tmp_path / "config.json").write_bytes((src / "config.json").read_bytes())
    with pytest.raises(SystemExit) as exc:
        cli.main(["inspect", str(tmp_path)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith(f"mxlib inspect: error: {tmp_path}"), err


def test_a_mistake_shows_no_traceback_in_a_real_process():
    r = subprocess.run(
        [sys.executable, "-m", "mxlib.cli", "inspect", "/no/such/checkpoint"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "mxlib inspect: error: path: '/no/such/checkpoint'" in r.stderr


@pytest.mark.parametrize("error", [RuntimeError, ValueError, KeyError])
def test_a_bug_keeps_its_traceback(monkeypatch, error):
    """Only the options' checks and CheckpointError become messages: an exception raised while a command
    runs (a ValueError too) propagates with its traceback."""

    def broken(p):
        raise error("a bug in the library")

    monkeypatch.setattr(W, "build_model", broken)
    with pytest.raises(error, match="a bug in the library"):
        cli.main(["e2e", "--preset", "tiny", "--layers", "1", "--device", "cpu"])


# ----------------------------------------------------------------------------- logging and progress


def _routing(tmp_path, *flags):
    out = tmp_path / "r.json"
    argv = ["routing", "--preset", "tiny", "--layers", "1", "--calib-tokens", "64", "--device", "cpu"]
    return cli.main([*flags, *argv, "--json", str(out)]), json.loads(out.read_text())


def test_routing_schemes_prints_and_writes_the_consistency_table(tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = ["routing", "--preset", "tiny", "--layers", "2", "--calib-tokens", "64", "--device", "cpu"]
    argv += ["--schemes", "w_mxfp4_a_mxfp4,nvfp4", "--sequences", "3", "--tokens", "8", "--json", str(out)]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    got = json.loads(out.read_text())["consistency"]
    assert [(r["scheme"], r["layer"]) for r in got["rows"]] == [
        (s, i) for s in ("w_mxfp4_a_mxfp4", "nvfp4") for i in (0, 1)
    ]
    assert (got["units"], got["tokens"]) == (3, 24) and set(got["noise_floor"]) == {"0", "1"}
    assert all(r["sequences"] == 3 and r["verdict"] in printed for r in got["rows"])
    assert "24 tokens in 3 sequences" in printed and printed.count("w_mxfp4_a_mxfp4 ") == 2


@pytest.mark.parametrize("where", ["before", "after"])
def test_verbose_logs_the_library_steps(tmp_path, capsys, where):
    rc, _ = _routing(tmp_path, "-v") if where == "before" else _routing(tmp_path, "--verbose")
    err = capsys.readouterr().err
    assert rc == 0 and "INFO mxlib.models.calibration: calibrating 1 MoE layers on 64 token ids" in err, err
    assert not logging.getLogger("mxlib").handlers  # the command's handler is removed afterwards


def test_quiet_logs_nothing_and_shows_no_progress(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    rc, _ = _routing(tmp_path, "-q")
    captured = capsys.readouterr()
    assert rc == 0 and captured.err == "" and "[routing] layer 0" in captured.out


def test_progress_bars_on_a_terminal_only(tmp_path, capsys, monkeypatch):
    rc, _ = _routing(tmp_path)
    assert rc == 0 and "calibrating" not in capsys.readouterr().err  # stderr is not a terminal here
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    rc, _ = _routing(tmp_path)
    err = capsys.readouterr().err
    assert rc == 0 and "calibrating: 100%" in err and "1/1" in err, err


def test_library_progress_is_off_by_default_and_counts_the_steps(tmp_path, capsys):
    model = W.dummy_model(2, seed=0, model_preset="tiny")
    ids = W.random_token_ids(16, 1, model.config.vocab_size, batch=2)
    quiet = calibrate(model, ids)
    path = write_quantized_checkpoint(model, "nvfp4", tmp_path / "a", quiet)
    load_quantized_qwen3_moe(path, backend="torch")
    assert capsys.readouterr().err == ""
    shown = calibrate(model, ids, batch_size=1, progress=True)
    for a, b in zip(quiet.layers, shown.layers):  # the bar changes nothing
        assert torch.equal(a.a1_amax, b.a1_amax) and torch.equal(a.a2_amax, b.a2_amax)
    write_quantized_checkpoint(model, "nvfp4", tmp_path / "b", shown, progress=True)
    load_quantized_qwen3_moe(tmp_path / "b", backend="torch", progress=True)
    err = capsys.readouterr().err
    # 2 batches x 2 layers; 2 layers written; 2 layers loaded
    for bar in ("calibrating: 100%", "quantizing experts: 100%", "loading experts: 100%"):
        assert bar in err, err
    assert "4/4" in err and err.count("2/2") >= 2, err


# ----------------------------------------------------------------------------- the commands run


def test_e2e_on_the_preset_it_is_given(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MXLIB_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "e2e.json"
    argv = ["e2e", "--preset", "tiny", "--layers", "1", "--tokens", "8", "--calib-tokens", "64"]
    assert cli.main([*argv, "--device", "cpu", "--backend", "torch", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["preset"] == "tiny" and data["scheme"] == "nvfp4" and len(data["layers_metrics"]) == 1
    printed = capsys.readouterr().out
    assert "[e2e] nvfp4 tiny L1 cpu" in printed and "{" not in printed  # lines, not a dict
    assert f"checkpoint: {data['checkpoint']} (" in printed and Path(data["checkpoint"]).is_dir()
    assert f"SQNR {data['logits']['sqnr_db']:.2f} dB, top-1 agreement" in printed


def test_compare_takes_a_preset_and_a_scheme_list(tmp_path, capsys):
    out = tmp_path / "c.json"
    argv = ["compare", "--preset", "tiny", "--layers", "1", "--tokens", "8", "--calib-tokens", "64"]
    assert (
        cli.main([*argv, "--schemes", "nvfp4,w_fp4_a_fp4", "--device", "cpu", "--backend", "torch", "--json", str(out)])
        == 0
    )
    data = json.loads(out.read_text())
    assert data["preset"] == "tiny" and [r["scheme"] for r in data["rows"]] == ["nvfp4", "w_mxfp4_a_mxfp4"]


def test_the_run_checks_resolve_the_preset(no_model):
    args = cli.build_parser()[0].parse_args(["unify", "--preset", "tiny", "--device", "cpu"])
    runs.check_run(args)
    assert args.params.model_preset == "tiny" and args.spreads == [0.0, 0.5, 1.0, 1.5]


# ----------------------------------------------------------------------------- workbook


@pytest.mark.parametrize("flags", [[], ["-v"]])
def test_workbook_hands_its_arguments_to_the_runner(monkeypatch, flags):
    runner = pytest.importorskip("mxlib.workbook.runner")
    seen = []
    monkeypatch.setattr(runner, "main", lambda argv=None, prog=None: seen.append((argv, prog)) or 7)
    assert cli.main([*flags, "workbook", "--only", "01", "--out", "build/x", "--help"]) == 7
    assert seen == [(["--only", "01", "--out", "build/x", "--help"], "mxlib workbook")]


def test_workbook_help_is_the_runners(capsys):
    pytest.importorskip("mxlib.workbook.runner")
    with pytest.raises(SystemExit) as exc:
        cli.main(["workbook", "--help"])
    assert exc.value.code == 0 and "--notebooks" in capsys.readouterr().out


def test_workbook_without_the_notebook_stack_says_what_to_install(monkeypatch, capsys):
    import builtins

    real_import = builtins.__import__

    def without_papermill(name, *args, **kwargs):  # the runner's import, as where mxlib[workbook] is absent
        if name.endswith("workbook.runner"):
            raise ModuleNotFoundError("No module named 'papermill'", name="papermill")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_papermill)
    assert cli.main(["workbook", "--out", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mxlib workbook: error: the workbook needs the notebook stack") and "mxlib[workbook]" in err


def test_workbook_keeps_a_missing_mxlib_module_a_traceback(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def broken(name, *args, **kwargs):
        if name.endswith("workbook.runner"):
            raise ModuleNotFoundError("No module named 'mxlib.gone'", name="mxlib.gone")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", broken)
    with pytest.raises(ModuleNotFoundError, match="mxlib.gone"):
        cli.main(["workbook"])
