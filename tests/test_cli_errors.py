"""Every user error of ``mxlib`` and ``python -m mxlib.workbook``, each in a fresh process: one line on stderr
naming the option, file or field, exit code 2, no traceback, and nothing written; answered before torch,
transformers or the notebook stack is imported (the processes run with stand-ins of those packages whose import
fails), in under a second beyond the interpreter's own start (measured beside each case on this machine).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "tests" / "fixtures" / "configs"
QUARK = CONFIGS / "quark-w_mxfp4_a_mxfp4-qwen3-30b-a3b"
SECONDS = 1.0


HEAVY = ("torch", "transformers", "triton", "safetensors", "papermill", "nbformat", "nbconvert", "jupyter_client")


@pytest.fixture(scope="module")
def no_heavy(tmp_path_factory) -> Path:
    """A folder of stand-in packages whose import fails, put first on the path of the processes run."""
    root = tmp_path_factory.mktemp("no_heavy")
    for name in HEAVY:
        (root / name).mkdir()
        (root / name / "__init__.py").write_text(f"raise ImportError('{name} was imported by a user error')\n")
    return root


_PATH: list[str] = []


@pytest.fixture(autouse=True)
def _path(no_heavy):
    _PATH[:] = [str(no_heavy), str(REPO)]
    yield


def _run(args: list[str], module: str = "mxlib.cli") -> tuple[subprocess.CompletedProcess, float]:
    """``python -m module args`` with the stand-ins; the seconds it took beyond a bare interpreter's start."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*_PATH, os.environ.get("PYTHONPATH", "")]))
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import argparse, json, pathlib"], env=env, timeout=120)
    bare = time.perf_counter() - t0
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, env=env, timeout=120)
    return r, time.perf_counter() - t0 - bare


def _config(tmp_path: Path, **fields) -> Path:
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    cfg = json.loads((QUARK / "config.json").read_text())
    cfg.update(fields)
    (src / "config.json").write_text(json.dumps(cfg))
    return src


def _check(r, dt, *needles):
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert all(n in lines[0] for n in needles), lines[0]
    assert dt < SECONDS, f"{dt:.2f} s: {lines[0]}"


@pytest.mark.parametrize(
    "args,needles",
    [
        (["e2e", "--layers", "1000000"], ["--layers", "48"]),
        (["e2e", "--tokens", "1000000000"], ["--tokens", "40960"]),
        (["e2e", "--layers", "0"], ["--layers", "positive integer"]),
        (["e2e", "--scheme", "nope"], ["--scheme"]),
        (["routing", "--layers", "49"], ["--layers", "48"]),
        (["routing", "--preset", "huge"], ["--preset"]),
        (["compare", "--tokens", "40961"], ["--tokens"]),
        (["unify", "--strategies", "max,p99"], ["--strategies", "p99"]),
    ],
    ids=["e2e-layers", "e2e-tokens", "e2e-zero", "e2e-scheme", "routing-layers", "routing-preset", "compare", "unify"],
)
def test_model_command_errors(args, needles):
    _check(*_run(args), *needles)


def test_json_that_is_a_folder(tmp_path):
    _check(*_run(["e2e", "--json", str(tmp_path)]), "--json", "folder")
    (tmp_path / "file").write_text("")
    _check(*_run(["routing", "--json", str(tmp_path / "file" / "r.json")]), "--json", "file")


def test_inspect_errors(tmp_path):
    _check(*_run(["inspect", str(tmp_path / "absent")]), "path", "does not exist")
    (tmp_path / "f").write_text("")
    _check(*_run(["inspect", str(tmp_path / "f")]), "path", "not a folder")


@pytest.mark.parametrize(
    "fields,needles",
    [
        (dict(num_experts=0), ["config.json", "num_experts", "positive integer"]),
        (dict(hidden_size=-8), ["config.json", "hidden_size", "-8"]),
        (dict(num_experts_per_tok=200), ["num_experts_per_tok", "at most num_experts"]),
        (dict(num_hidden_layers=1_000_000), ["num_hidden_layers", "at most 512"]),
        (dict(moe_intermediate_size=2**40), ["GB of bf16 weights", "memory"]),
        (dict(num_attention_heads=3), ["num_attention_heads", "multiple"]),
    ],
    ids=["zero-experts", "negative", "topk", "layers", "memory", "heads"],
)
def test_dummy_from_config_refuses_absurd_configs(tmp_path, fields, needles):
    src = _config(tmp_path, **fields)
    # the full-size preset keeps the config's own sizes (a smaller one replaces them)
    r, dt = _run(["dummy-from-config", str(src), str(tmp_path / "out"), "--preset", "qwen3-30b-a3b"])
    _check(r, dt, *needles)
    assert not (tmp_path / "out").exists()


def test_dummy_from_config_file_errors(tmp_path):
    out = str(tmp_path / "out")
    _check(*_run(["dummy-from-config", str(tmp_path / "absent"), out]), "config_dir", "not a folder")
    empty = tmp_path / "empty"
    empty.mkdir()
    _check(*_run(["dummy-from-config", str(empty), out]), "config.json", "not found")
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "config.json")
    _check(*_run(["dummy-from-config", str(fifo), out]), "config.json", "a FIFO")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_bytes(b"\xff{")
    _check(*_run(["dummy-from-config", str(bad), out]), "config.json", "JSON")
    src = _config(tmp_path)
    _check(*_run(["dummy-from-config", str(src), out, "--layers", "49"]), "--layers", "48")
    (tmp_path / "a_file").write_text("")
    _check(*_run(["dummy-from-config", str(src), str(tmp_path / "a_file")]), "out_dir", "a_file' is a file; expected")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "x").write_text("")
    (tmp_path / "link").symlink_to(tmp_path / "ckpt")
    _check(*_run(["dummy-from-config", str(src), str(tmp_path / "link")]), "out_dir", "is a symbolic link to")
    assert not (tmp_path / "out").exists()


def test_workbook_runner_errors(tmp_path):
    for module, prefix in (("mxlib.workbook", []), ("mxlib.cli", ["workbook"])):
        _check(*_run([*prefix, "--only", "nope", "--out", str(tmp_path / "o")], module), "--only", "01_end_to_end")
        _check(*_run([*prefix, "--model-preset", "huge", "--out", str(tmp_path / "o")], module), "--model-preset")
        (tmp_path / "file").write_text("")
        _check(*_run([*prefix, "--out", str(tmp_path / "file")], module), "--out", "a file")
        _check(*_run([*prefix, "--out", str(tmp_path / "file" / "x")], module), "--out", "under the file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
