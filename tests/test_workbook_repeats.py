"""mxlib.studies.repeats (spreads over token sets), the steps' numerics switch and
repeats parameter, and the probes that keep machine paths out of a notebook's output."""

import math
import statistics
import warnings

import pytest
import torch

from mxlib.studies import probes
from mxlib.studies import repeats as RP
from mxlib.studies import steps as W


def test_spread_matches_statistics():
    vals = [17.96, 15.53, 17.25]
    s = RP.spread(vals)
    assert s["mean"] == pytest.approx(statistics.mean(vals), abs=1e-12)
    assert s["std"] == pytest.approx(statistics.stdev(vals), abs=1e-12)
    assert (s["low"], s["high"], s["n"]) == (15.53, 17.96, 3)
    assert RP.spread([2.0]) == dict(mean=2.0, low=2.0, high=2.0, std=0.0, n=1)
    assert RP.spread_text([1.0, 2.0, 3.0]) == "2.00 (1.00 to 3.00, 3 repeats)"
    with pytest.raises(ValueError, match="sqnr_db: expected at least one"):
        RP.spread([], "sqnr_db")
    with pytest.raises(ValueError, match="finite"):
        RP.spread([1.0, math.inf])


def test_e2e_parameters_numerics_and_repeats():
    p = W.check_e2e_parameters(model_preset="tiny", numerics="hardware", repeats=3, num_tokens=5, seed=4)
    assert p.numerics == "hardware" and p.repeats == 3
    sets = W.evaluation_token_sets(p, 1000)
    assert len(sets) == 3 and torch.equal(sets[0], W.evaluation_token_ids(p, 1000))
    assert torch.equal(sets[2], W.random_token_ids(5, 4 + 1 + 2, 1000)) and not torch.equal(sets[1], sets[2])
    with pytest.raises(ValueError, match=r"numerics: expected one of \['vllm', 'hardware'\], got 'fast'"):
        W.check_e2e_parameters(numerics="fast")
    for bad in (0, 11, 2.0):
        with pytest.raises(ValueError, match="repeats"):
            W.check_e2e_parameters(repeats=bad)


def test_relative_paths_and_short_warnings(tmp_path):
    ck = tmp_path / "nvfp4-L4-abc"
    ck.mkdir()
    text = f"checkpoint   {ck}\nlayout modelopt"
    shown = probes.relative_paths(text, ck)
    assert shown == "checkpoint   nvfp4-L4-abc\nlayout modelopt" and str(tmp_path) not in shown
    assert probes.relative_paths("a/b", "a/b") == "a/b"  # a relative path stays as given
    old = warnings.formatwarning
    try:
        probes.short_warnings()
        line = warnings.formatwarning("w13_input_scale: x", UserWarning, "/abs/mxlib/moe/scales.py", 3)
        assert line == "UserWarning: w13_input_scale: x\n"
    finally:
        warnings.formatwarning = old


@pytest.fixture(scope="module")
def tiny_loaded(tmp_path_factory):
    p = W.check_e2e_parameters(scheme="nvfp4", model_preset="tiny", num_hidden_layers=2, num_tokens=8, calib_tokens=32)
    model = W.build_model(p)
    from mxlib.studies.steps import prepare_checkpoint

    ck = prepare_checkpoint(p.scheme, model, calib_tokens=32, cache_dir=tmp_path_factory.mktemp("ck"))
    ids = [W.random_token_ids(8, s, model.config.vocab_size) for s in (1, 2)]
    refs = [W.run_model(model, i) for i in ids]
    mq, _ = W.load_checkpoint(p, ck)
    return mq, ids, refs


def test_set_numerics_and_compare_numerics(tiny_loaded):
    from mxlib.formats import Numerics

    mq, ids, refs = tiny_loaded
    exs = [layer.mlp.experts.experts for layer in mq.model.layers]
    assert W.set_numerics(mq, "hardware") == 2 and all(e.numerics is Numerics.HARDWARE for e in exs)
    hw = W.run_model(mq, ids[0]).logits
    assert W.set_numerics(mq, "vllm") == 2 and all(e.numerics is Numerics.VLLM for e in exs)
    vl = W.run_model(mq, ids[0]).logits
    assert not torch.equal(hw, vl)  # NVFP4: the modes differ
    with pytest.raises(ValueError, match="numerics"):
        W.set_numerics(mq, "exact")
    both = W.compare_numerics(mq, ids, refs)
    assert all(e.numerics is Numerics.VLLM for e in exs)  # restored
    assert [r["set"] for r in both["sets"]] == [0, 1] and len(both["layers"]) == 2
    first = both["sets"][0]
    assert first["max_abs_diff"] == (vl.double() - hw.double()).abs().max().item() > 0
    assert math.isfinite(first["vllm_vs_hw_sqnr_db"]) and len(both["layers"][0]["per_set"]) == 2
    with pytest.raises(ValueError, match="refs"):
        W.compare_numerics(mq, ids, refs[:1])


@pytest.mark.slow
def test_the_kl_bar_fails_a_broken_model_at_the_small_preset(tmp_path):
    """Notebook 01's KL bar at the small preset: a fixed 0.02 nats passes the swapped-nibble model (its KL is
    about 0.017), the bar relative to that negative control (a quarter of its smallest KL over the token sets)
    passes the working model on every set and fails the broken one."""
    p = W.check_e2e_parameters(scheme="nvfp4", model_preset="small", num_tokens=32, calib_tokens=512, repeats=3)
    model = W.build_model(p)
    ck = W.prepare_checkpoint(p.scheme, model, calib_tokens=512, cache_dir=tmp_path)
    sets = W.evaluation_token_sets(p, model.config.vocab_size)
    refs = [W.run_model(model, ids) for ids in sets]
    del model
    mq, _ = W.load_checkpoint(p, ck)
    working = [W.compare_runs(W.run_model(mq, i), r)["logits"]["kl_divergence"] for i, r in zip(sets, refs)]
    with probes.swapped_nibbles(mq):
        broken = [W.compare_runs(W.run_model(mq, i), r)["logits"]["kl_divergence"] for i, r in zip(sets, refs)]
    bar = min(broken) / 4
    assert max(broken) < 0.02  # the fixed bar would pass the broken model
    assert max(working) < bar <= min(broken), (working, broken)
