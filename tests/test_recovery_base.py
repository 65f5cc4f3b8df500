"""The writer's technique hook: round-to-nearest through it writes the same bytes as the layout's own path."""

import pytest
import torch

from mxlib.models import checkpoints as C
from mxlib.models.calibration import calibrate
from mxlib.models.qwen3 import dummy_qwen3_moe, qwen3_30b_a3b_config
from mxlib.recovery import TECHNIQUES, RoundToNearest, get_technique

from _util import TINY_QWEN3


@pytest.fixture(scope="module")
def tiny():
    model = dummy_qwen3_moe(qwen3_30b_a3b_config(num_hidden_layers=2, **TINY_QWEN3), seed=1, expert_spread=0.5)
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    return model, calibrate(model, tokens)


def _files(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.mark.parametrize("scheme", ["nvfp4", "w_mxfp4_a_mxfp4", "w_mxfp6_e3m2_a_mxfp6_e3m2"])
def test_rtn_technique_writes_the_default_bytes(tiny, tmp_path, scheme):
    model, cal = tiny
    a = C.write_quantized_checkpoint(model, scheme, tmp_path / "a", cal)
    b = C.write_quantized_checkpoint(model, scheme, tmp_path / "b", cal, technique="rtn")
    assert _files(a) == _files(b)


def test_get_technique_names_the_choices():
    assert isinstance(get_technique("rtn"), RoundToNearest)
    t = RoundToNearest()
    assert get_technique(t) is t
    with pytest.raises(ValueError, match=r"technique: expected one of .*'rtn'.*got 'nope'"):
        get_technique("nope")
    with pytest.raises(ValueError, match="already built"):
        get_technique(t, x=1)
    assert "rtn" in TECHNIQUES
