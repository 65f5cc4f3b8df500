"""The scale-unification warning: it fires only for experts that one shared (max) NVFP4 activation
scale pushes below ``NVFP4_SUBNORMAL_RATIO`` (their largest block scale an e4m3 subnormal), naming
each such expert and its predicted loss, and stays silent on the healthy spreads of real checkpoints."""

import math
import warnings

import pytest
import torch

from mxlib import reference as R
from mxlib.checkpoints.inspect_loss import predicted_db_lost
from mxlib.formats import NVFP4, NVFP4_SUBNORMAL_RATIO
from mxlib.moe import scales as S


def _caught(fn):
    S._warned.clear()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in rec]


@pytest.mark.parametrize("ratios", [[1.0, 1 / 1.16, 1 / 1.33, 0.5], [1.0, 1e-3, 2.0 * NVFP4_SUBNORMAL_RATIO]])
def test_healthy_ratios_do_not_warn(ratios):
    """Scale spreads of 1.16-1.33 (published checkpoints) and even r = 1e-3 keep e4m3's 3 bits: silent."""
    s = torch.tensor(ratios) * 0.01
    (gs, uniform), msgs = _caught(lambda: S.unify_input_scales(s, "max", "w13_input_scale"))
    assert uniform and torch.equal(gs, torch.full((len(ratios),), 1.0) / torch.tensor(0.01))
    assert msgs == []
    assert S.unification_precision_loss(s) == []
    _, msgs = _caught(lambda: S._unify_encode_scales(1.0 / s, "max", "w2_input_scale"))
    assert msgs == []


def test_an_expert_below_the_threshold_is_named_with_its_loss():
    r_low = 2.0**-17  # below 2**-6 / 448 (about 2**-14.8): its largest block scale is subnormal
    assert r_low < NVFP4_SUBNORMAL_RATIO
    s = torch.tensor([1.0, 0.75, r_low, 0.0]) * 2.0**-6  # exact ratios; expert 3 never calibrated: not listed
    _, msgs = _caught(lambda: S.unify_input_scales(s, "max", "w13_input_scale"))
    assert len(msgs) == 1, msgs
    m = msgs[0]
    assert m.startswith("w13_input_scale:") and "expert 2 " in m and "expert 1 " not in m and "expert 3" not in m
    lost = S.unification_precision_loss(s)
    assert [r["expert"] for r in lost] == [2]
    assert lost[0]["ratio"] == r_low
    # the loss is the synthetic expert's, as the inspector tabulates it (exact on its quarter-octave grid)
    assert lost[0]["predicted_db_lost"] == pytest.approx(predicted_db_lost(r_low, NVFP4), abs=1e-9)
    assert lost[0]["predicted_db_lost"] > 1.0 and f"{lost[0]['predicted_db_lost']:.1f} dB lost" in m
    # the encode-scale path (compressed-tensors) warns the same
    _, msgs = _caught(lambda: S._unify_encode_scales(torch.where(s > 0, 1.0 / s, 0.0), "max", "w2_input_scale"))
    assert len(msgs) == 1 and msgs[0].startswith("w2_input_scale:") and "expert 2 " in msgs[0], msgs
    # per_expert scales cost nothing: no warning
    _, msgs = _caught(lambda: S.unify_input_scales(s, "per_expert", "w13_input_scale"))
    assert msgs == []


def test_a_flushed_expert_loses_its_whole_signal():
    """Far below 2**-10 / 448 every block scale rounds to zero: the QDQ output is 0, SQNR 0 dB, so the
    loss is the expert's own SQNR (computed here from mxlib.reference directly)."""
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    x = x / x.abs().amax()
    y = R.ref_nvfp4_quant_dequant(x, torch.tensor(2688.0)).double()
    own = 10 * math.log10(x.double().pow(2).sum().item() / (y - x.double()).pow(2).sum().item())
    lost = S.unification_precision_loss(torch.tensor([1.0, 1e-9]))
    assert [r["expert"] for r in lost] == [1] and lost[0]["predicted_db_lost"] == pytest.approx(own, abs=1e-9)
