"""A checkpoint replaced while it is loaded or inspected gives the old model whole, or an error; never a mix.

The replace is mxlib's own writer with ``overwrite=True`` (an atomic swap of the whole folder), run at real seams
of the loader: after the config and every shard header are read and before any tensor is (``check_model_config``),
in the middle of the tensor reads (the second shard opened for data), and between the config read and the shard
headers (``SafetensorsHeaders``). Every layout is written in many small shards, so a loader reading a later shard
by path would take it from the new checkpoint. The old and the new checkpoint hold the same sizes and different
weights (other seeds), so any tensor of the new one in the loaded model is seen.
"""

import shutil

import pytest
import torch

from mxlib.checkpoints import CheckpointError, inspect_checkpoint, load_quantized_moe, write_quantized_checkpoint
from mxlib.checkpoints import inspect as I
from mxlib.checkpoints import loader as L
from mxlib.checkpoints.files import safetensors_io
from mxlib.models.calibration import calibrate
from mxlib.models.gpt_oss import dummy_gpt_oss, gpt_oss_20b_config
from mxlib.models.presets import GPT_OSS_PRESETS
from mxlib.models.qwen3 import dummy_qwen3_moe, qwen3_30b_a3b_config

from _util import TINY_QWEN3 as TINY

# (family, scheme, layout): every layout mxlib writes
LAYOUTS = [
    ("qwen3", "nvfp4", "modelopt"),
    ("qwen3", "w_mxfp4_a_mxfp4", "quark"),
    ("qwen3", "w_mxfp6_e2m3", "quark"),
    ("qwen3", "w_mxfp4_a_fp8", "quark"),
    ("qwen3", "nvfp4", "compressed-tensors"),
    ("qwen3", "w_mxfp4", "compressed-tensors-mxfp4"),
    ("qwen3", "w_mxfp8", "compressed-tensors-mxfp8"),
    ("qwen3", "w_mxfp8_a_mxfp8", "modelopt-mxfp8"),
    ("gpt-oss", "w_mxfp4", "gpt-oss-mxfp4"),
]
IDS = [f"{s}-{lay}" for _, s, lay in LAYOUTS]
SHARD_BYTES = 8192  # tens of shards per checkpoint


@pytest.fixture(scope="module")
def models():
    """``{family: [(model, calibration) old, (model, calibration) new]}``: same sizes, other weights."""
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    out = {}
    for family in ("qwen3", "gpt-oss"):
        pair = []
        for seed in (1, 2):
            if family == "qwen3":
                m = dummy_qwen3_moe(qwen3_30b_a3b_config(num_hidden_layers=2, **TINY), seed=seed)
                pair.append((m, calibrate(m, ids)))
            else:
                m = dummy_gpt_oss(gpt_oss_20b_config(2, **GPT_OSS_PRESETS["gpt-oss-tiny"]), seed=seed)
                pair.append((m, None))
        out[family] = pair
    return out


def _write(models, family, scheme, layout, which, path, overwrite=False):
    model, cal = models[family][which]
    return write_quantized_checkpoint(
        model, scheme, path, cal, layout=layout, shard_bytes=SHARD_BYTES, overwrite=overwrite
    )


def _state(path):
    model, _ = load_quantized_moe(path, backend="torch")
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_same(got, want):
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), want[k].reshape(-1).view(torch.uint8)), k


_WANT: dict[tuple[str, str], dict] = {}


@pytest.fixture
def race(models, tmp_path):
    """``(path, old state, replace)``: the old checkpoint at ``path`` (and its state, loaded from a copy), and
    ``replace()`` writing the new one over it with the writer's ``overwrite=True``."""

    def make(family, scheme, layout):
        path = _write(models, family, scheme, layout, 0, tmp_path / "ckpt")
        assert len(list(path.glob("*.safetensors"))) > 3
        shutil.copytree(path, tmp_path / "copy")
        if (scheme, layout) not in _WANT:  # the writer is deterministic: the old model's state, loaded once per layout
            _WANT[scheme, layout] = _state(tmp_path / "copy")
        return path, _WANT[scheme, layout], lambda: _write(models, family, scheme, layout, 1, path, overwrite=True)

    return make


@pytest.mark.parametrize("family,scheme,layout", LAYOUTS, ids=IDS)
def test_replaced_after_the_headers_loads_the_old_model(race, monkeypatch, family, scheme, layout):
    path, want, replace = race(family, scheme, layout)
    real = L.check_model_config

    def replace_then_check(*args, **kwargs):
        replace()
        return real(*args, **kwargs)

    monkeypatch.setattr(L, "check_model_config", replace_then_check)
    _assert_same(_state(path), want)


# the first two layouts in the quick run, every other one under -m slow (the file stays under 20 s)
WHILE_READING = [
    pytest.param(*case, id=i, marks=() if n < 2 else pytest.mark.slow) for n, (case, i) in enumerate(zip(LAYOUTS, IDS))
]


@pytest.mark.parametrize("family,scheme,layout", WHILE_READING)
def test_replaced_while_tensors_are_read_loads_the_old_model(race, monkeypatch, family, scheme, layout):
    path, want, replace = race(family, scheme, layout)
    real, opened = safetensors_io.safe_open, []

    def replace_on_the_second_shard(name, *args, **kwargs):
        opened.append(name)
        if len(opened) == 2:
            replace()
        return real(name, *args, **kwargs)

    monkeypatch.setattr(safetensors_io, "safe_open", replace_on_the_second_shard)
    _assert_same(_state(path), want)
    assert len(opened) > 2


@pytest.mark.parametrize("family,scheme,layout", [LAYOUTS[0], LAYOUTS[1], LAYOUTS[-1]], ids=[IDS[0], IDS[1], IDS[-1]])
def test_replaced_between_the_config_and_the_headers_is_refused(race, monkeypatch, family, scheme, layout):
    path, _, replace = race(family, scheme, layout)
    real = L.SafetensorsHeaders

    def replace_then_read(*args, **kwargs):
        replace()
        return real(*args, **kwargs)

    monkeypatch.setattr(L, "SafetensorsHeaders", replace_then_read)
    with pytest.raises(CheckpointError, match="the folder was replaced while its safetensors files were being read"):
        load_quantized_moe(path, backend="torch")
    monkeypatch.undo()
    _state(path)  # the new checkpoint, whole, loads afterwards


def _report(path):
    d = dict(inspect_checkpoint(path).to_dict())
    d.pop("seconds")
    d.pop("path")
    return d


@pytest.mark.parametrize("family,scheme,layout", [LAYOUTS[0], LAYOUTS[4]], ids=[IDS[0], IDS[4]])
def test_inspector_reports_the_old_checkpoint_or_says_it_was_replaced(
    race, monkeypatch, tmp_path, family, scheme, layout
):
    path, _, replace = race(family, scheme, layout)
    want = _report(tmp_path / "copy")
    real = I.check_model_config

    def replace_then_check(*args, **kwargs):
        replace()
        return real(*args, **kwargs)

    monkeypatch.setattr(I, "check_model_config", replace_then_check)
    assert _report(path) == want  # the scales read after the replace are the old checkpoint's
    monkeypatch.setattr(I, "check_model_config", real)
    real_headers = I.SafetensorsHeaders

    def replace_then_read(*args, **kwargs):
        replace()
        return real_headers(*args, **kwargs)

    monkeypatch.setattr(I, "SafetensorsHeaders", replace_then_read)
    report = inspect_checkpoint(path)
    assert not report.layout_ok
    assert any("the folder was replaced while" in p for p in report.problems), report.problems
