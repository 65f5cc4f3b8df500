"""Checkpoints as untrusted input: lying safetensors headers, special files, corrupt configs, sizes the files do
not hold, a full disk and the allocator's errors. The loader refuses each with a ``CheckpointError`` naming the
file; the inspector reports the same fault as a problem, never raises, and builds no table from a refused file.

The oracle for each header case is the header itself, written here byte by byte (``_set_header``), not through
the reader under test; safetensors' own reader refuses the same files (``test_safetensors_refuses_the_same``).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import struct
import time
import tracemalloc
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mxlib.checkpoints import (
    CheckpointError,
    inspect_checkpoint,
    load_quantized_qwen3_moe,
    write_quantized_checkpoint,
)
from mxlib.checkpoints import loader as L
from mxlib.checkpoints.files import safetensors_io
from mxlib.models.calibration import calibrate
from mxlib.models.qwen3 import dummy_qwen3_moe, qwen3_30b_a3b_config

from _util import TINY_QWEN3 as TINY

SHARD = "model-00001-of-00001.safetensors"
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("untrusted")
    model = dummy_qwen3_moe(qwen3_30b_a3b_config(num_hidden_layers=2, **TINY), seed=1, expert_spread=0.5)
    cal = calibrate(model, torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0)))
    return {
        "nvfp4": write_quantized_checkpoint(model, "nvfp4", root / "nvfp4", cal),
        "fp8": write_quantized_checkpoint(model, "w_mxfp4_a_fp8", root / "fp8", cal),
    }


@pytest.fixture
def copy(ckpts, tmp_path):
    def make(key="nvfp4"):
        dst = tmp_path / key
        shutil.copytree(ckpts[key], dst)
        return dst

    return make


@pytest.fixture(autouse=True)
def _no_hang():
    """A read that blocks (a FIFO, a device) fails the test instead of hanging it."""
    signal.signal(signal.SIGALRM, lambda *a: pytest.fail("a read blocked for 30 s"))
    signal.alarm(30)
    yield
    signal.alarm(0)


def _header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _set_header(path: Path, header: dict, data: bytes, length: int | None = None) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)


def _refused_by_both(folder: Path, *needles: str) -> str:
    """The loader's CheckpointError and the inspector's problem, both naming every needle; no tables."""
    with pytest.raises(CheckpointError) as err:
        load_quantized_qwen3_moe(folder)
    message = str(err.value)
    assert all(n in message for n in needles), message
    assert "\n" not in message
    report = inspect_checkpoint(folder)
    assert not report.layout_ok
    assert any(all(n in p for n in needles) for p in report.problems), report.problems
    return message


def _no_tables(report) -> None:
    assert report.quantized == {} and report.unquantized == [] and report.activation_scales == []
    assert report.strategies == [] and report.tensors_total == 0


# ----------------------------------------------------------------------------- lying headers


def _lie(folder: Path, how: str) -> Path:
    shard = folder / SHARD
    header, data = _header(shard)
    meta = header.pop("__metadata__", None)
    names = sorted(header, key=lambda k: header[k]["data_offsets"][0])
    a, b = names[0], names[1]
    length = None
    if how == "overlap":  # b's span moved onto a's: b would read a's values
        size = header[b]["data_offsets"][1] - header[b]["data_offsets"][0]
        header[b]["data_offsets"] = [header[a]["data_offsets"][0], header[a]["data_offsets"][0] + size]
    elif how == "past-end":
        last = names[-1]
        header[last]["data_offsets"][1] += 64
        header[last]["shape"] = [header[last]["shape"][0] + 32] + header[last]["shape"][1:]
    elif how == "size":  # a shape that does not fit its span
        header[a]["shape"] = [x * 2 for x in header[a]["shape"]] or [2]
    elif how == "huge-length":
        length = 2**40
    elif how == "dtype":
        header[a]["dtype"] = "Q7"
    if meta is not None:
        header["__metadata__"] = meta
    if how == "not-utf8":
        text = b"\xff\xfe" + json.dumps(header).encode()[2:]
        shard.write_bytes(struct.pack("<Q", len(text)) + text + data)
    else:
        _set_header(shard, header, data, length)
    return shard


@pytest.mark.parametrize("how", ["overlap", "past-end", "size", "huge-length", "dtype", "not-utf8"])
def test_lying_headers_are_refused_by_loader_and_inspector(copy, how):
    folder = copy()
    shard = _lie(folder, how)
    _refused_by_both(folder, str(shard))
    _no_tables(inspect_checkpoint(folder))


@pytest.mark.parametrize("how", ["overlap", "past-end", "size", "huge-length"])
def test_safetensors_refuses_the_same(copy, how):
    """The oracle: safetensors' own reader refuses every one of these files too."""
    shard = _lie(copy(), how)
    with pytest.raises(Exception):  # noqa: B017  safetensors raises its own error types
        with safe_open(str(shard), "pt") as f:
            for k in f.keys():
                f.get_tensor(k)


def test_a_name_in_two_shards_is_refused(copy):
    folder = copy()
    save_file({"extra.tensor": torch.zeros(2), "model.norm.weight": torch.zeros(64)}, str(folder / "extra.safetensors"))
    index = json.loads((folder / INDEX).read_text())
    index["weight_map"]["extra.tensor"] = "extra.safetensors"
    (folder / INDEX).write_text(json.dumps(index))
    _refused_by_both(folder, "model.norm.weight", "unique across the shards")


def test_a_shard_outside_the_folder_is_refused(copy):
    folder = copy()
    index = json.loads((folder / INDEX).read_text())
    index["weight_map"]["model.norm.weight"] = "../" + SHARD
    (folder / INDEX).write_text(json.dumps(index))
    _refused_by_both(folder, str(folder / INDEX), "not a plain file name")


# ----------------------------------------------------------------------------- special files and corrupt configs


def _replace(path: Path, kind: str) -> None:
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        path.symlink_to("/dev/zero")
    elif kind == "folder":
        path.mkdir()


@pytest.mark.parametrize("kind,what", [("fifo", "a FIFO"), ("device", "a character device"), ("folder", "a folder")])
@pytest.mark.parametrize("name", ["config.json", INDEX, SHARD, "hf_quant_config.json"])
def test_special_files_are_refused_before_they_are_opened(copy, name, kind, what):
    folder = copy()
    if not (folder / name).exists():
        (folder / name).write_text("{}")
    if kind == "device" and not Path("/dev/zero").exists():
        pytest.skip("no /dev/zero")
    _replace(folder / name, kind)
    t0 = time.perf_counter()
    _refused_by_both(folder, str(folder / name), what)
    assert time.perf_counter() - t0 < 10


@pytest.mark.parametrize(
    "content,needle",
    [(b"\xff\xfe{}", "not UTF-8"), (b'{"hidden_size": ', "cannot be read as JSON"), (b"[1, 2]", "found list")],
    ids=["not-utf8", "not-json", "array"],
)
@pytest.mark.parametrize("name", ["config.json", INDEX])
def test_corrupt_json_names_the_file(copy, name, content, needle):
    folder = copy()
    (folder / name).write_bytes(content)
    _refused_by_both(folder, str(folder / name), needle)


def test_unreadable_file_is_named(copy):
    if os.geteuid() == 0:
        pytest.skip("root reads files whatever their mode")
    folder = copy()
    (folder / "config.json").chmod(0)
    _refused_by_both(folder, str(folder / "config.json"), "Permission denied")


# ----------------------------------------------------------------------------- sizes the files do not hold


def _set_config(folder: Path, **fields) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(fields)
    (folder / "config.json").write_text(json.dumps(cfg))


def _bounded(fn, seconds: float, peak_bytes: int):
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        out = fn()
    finally:
        dt = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert dt < seconds, f"{dt:.2f} s"
    assert peak < peak_bytes, f"peak {peak / 1e6:.1f} MB"
    return out


@pytest.mark.parametrize(
    "fields,needle",
    [
        (dict(num_hidden_layers=1_000_000), "num_hidden_layers: 1000000, but the checkpoint's tensors hold 2 layers"),
        (dict(hidden_size=2**40), "hidden_size"),
        (dict(vocab_size=2**40), "vocab_size"),
        (dict(num_experts=2**30), "num_experts"),
        (dict(moe_intermediate_size=2**40), "moe_intermediate_size"),
        (dict(num_experts_per_tok=5), "num_experts_per_tok: expected at most num_experts=4"),
        (dict(num_experts=0), "num_experts: expected a positive integer, found 0"),
        (dict(hidden_size=-64), "hidden_size: expected a positive integer, found -64"),
    ],
    ids=["layers", "hidden", "vocab", "experts", "intermediate", "topk", "zero-experts", "negative"],
)
def test_sizes_the_files_do_not_hold_are_refused_at_once(copy, fields, needle):
    """Refused from the headers before anything is built: well under a second, a few MB at most."""
    folder = copy()
    inspect_checkpoint(folder)  # once first: the predicted-loss curves are computed once per process
    _set_config(folder, **fields)
    with pytest.raises(CheckpointError, match="config.json") as err:
        _bounded(lambda: load_quantized_qwen3_moe(folder), 1.0, 20e6)
    assert needle in str(err.value), str(err.value)
    report = _bounded(lambda: inspect_checkpoint(folder), 1.0, 20e6)
    assert not report.layout_ok and any(needle in p for p in report.problems), report.problems


def test_the_allocators_error_names_the_file_and_fields(copy, monkeypatch):
    def refuse(*a, **k):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8796093022208 bytes")

    monkeypatch.setattr(L, "empty_moe_model", refuse)
    folder = copy()
    with pytest.raises(CheckpointError, match=r"config\.json: the model its sizes describe cannot be allocated"):
        load_quantized_qwen3_moe(folder)


def test_a_full_disk_names_the_shard(ckpts, tmp_path, monkeypatch):
    model = dummy_qwen3_moe(qwen3_30b_a3b_config(num_hidden_layers=1, **TINY), seed=1)

    def full(tensors, filename, metadata=None):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(safetensors_io, "save_file", full)
    with pytest.raises(OSError) as err:
        write_quantized_checkpoint(model, "w_mxfp4", tmp_path / "ckpt")
    assert err.value.errno == errno.ENOSPC
    assert str(tmp_path) in str(err.value) and ".safetensors" in str(err.value) and "No space left" in str(err.value)
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- scales and strategies


@pytest.mark.parametrize(
    "dtype,value,loads", [("bf16", 0.0625, True), ("f16", 0.0625, True), ("f64", 0.0625, True), ("f64", 0.1, False)]
)
def test_scale_dtypes_the_loader_takes_are_inspected(copy, dtype, value, loads):
    """input_scale stored as bf16 / fp16 / fp64: the inspector agrees with the loader and never crashes."""
    folder = copy()
    shard = folder / SHARD
    from safetensors.torch import load_file

    state = load_file(str(shard))
    name = "model.layers.0.mlp.experts.1.up_proj.input_scale"
    torch_dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f64": torch.float64}[dtype]
    state[name] = torch.tensor(value, dtype=torch_dtype).reshape(state[name].shape)
    save_file(state, str(shard), metadata={"format": "pt"})
    report = inspect_checkpoint(folder)
    if loads:
        load_quantized_qwen3_moe(folder)
        assert report.layout_ok, report.problems
    else:
        with pytest.raises(CheckpointError, match=name):
            load_quantized_qwen3_moe(folder)
        assert not report.layout_ok and any(name in p for p in report.problems), report.problems


def test_scale_strategy_is_applied_or_refused(ckpts):
    with pytest.raises(ValueError, match="scale_strategy: expected one of"):
        load_quantized_qwen3_moe("/no/such/checkpoint", scale_strategy="bogus")  # before anything is read
    with pytest.raises(ValueError, match=r"scale_strategy: 'median' cannot be applied to w_mxfp4_a_fp8"):
        load_quantized_qwen3_moe(ckpts["fp8"], scale_strategy="median")
    model, _ = load_quantized_qwen3_moe(ckpts["fp8"], scale_strategy="max")
    model, _ = load_quantized_qwen3_moe(ckpts["nvfp4"], scale_strategy="median")
    assert model.model.layers[0].mlp.experts.experts.scale_strategy == "median"
    # the inspector predicts only what the loader applies
    fp8 = inspect_checkpoint(ckpts["fp8"])
    assert {r["strategy"] for r in fp8.strategies} == {"max"}
    assert any("only the scale strategy 'max'" in n for n in fp8.notes)
    assert {r["strategy"] for r in inspect_checkpoint(ckpts["nvfp4"]).strategies} > {"max", "median"}
