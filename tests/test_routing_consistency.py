"""Routing consistency (``mxlib.models.routing_consistency``, ``mxlib.studies.routing_agreement``).

The per-token arithmetic against hand-computed values (exact: the Jaccard indices are ratios of small integers);
identical runs agree exactly; a routing change planted in one router (two experts' gate rows swapped) is found
exactly where the reference's top-k sets hold one of the two experts, and nowhere before that layer; a quantized
dummy Qwen3-30B-A3B (tiny preset) keeps its first layer's routing and moves tokens later; the notebook's family
decides a planted change beyond the measured noise floor and leaves the untouched layer undecided; bad input is refused
with a message naming the argument, the expected and the actual.
"""

from __future__ import annotations

import pytest
import torch

from mxlib.models import evaluation as ev
from mxlib.models.routing_consistency import (
    RoutedTokens,
    record_routing,
    recording_routing,
    routing_consistency,
    topk_overlap,
)
from mxlib.stats import ComparisonFamily
from mxlib.studies import accuracy
from mxlib.studies import routing_agreement as rcs
from mxlib.studies.steps import dummy_model, random_token_ids

# ----------------------------------------------------------------------------- hand-computed


def test_topk_overlap_hand_computed():
    # one layer, k = 2: the same pair in another slot order, one in common, none in common, the same pair
    ref = torch.tensor([[[0, 1], [2, 3], [4, 5], [6, 7]]])
    oth = torch.tensor([[[1, 0], [2, 5], [6, 7], [6, 7]]])
    jaccard, changed = topk_overlap(ref, oth)
    assert jaccard.dtype == torch.float64 and changed.dtype == torch.bool
    torch.testing.assert_close(jaccard, torch.tensor([[1.0, 1 / 3, 0.0, 1.0]], dtype=torch.float64), rtol=0, atol=0)
    assert changed.tolist() == [[False, True, True, False]]


def test_topk_overlap_k3_two_layers():
    # k = 3: c in common gives c / (6 - c): 3 -> 1, 2 -> 1/2, 1 -> 1/5, 0 -> 0
    ref = torch.tensor([[[0, 1, 2], [0, 1, 2]], [[0, 1, 2], [0, 1, 2]]])
    oth = torch.tensor([[[2, 1, 0], [0, 1, 3]], [[0, 4, 5], [3, 4, 5]]])
    jaccard, changed = topk_overlap(ref, oth)
    want = torch.tensor([[1.0, 0.5], [0.2, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(jaccard, want, rtol=0, atol=0)
    assert changed.tolist() == [[False, True], [True, True]]


def _routed(topk, units, token_ids=None, layers=None):
    topk = torch.tensor(topk)
    unit = torch.tensor(units)
    ids = torch.arange(unit.numel()) if token_ids is None else torch.tensor(token_ids)
    return RoutedTokens(ids, unit, topk, tuple(range(topk.shape[0])) if layers is None else layers)


def test_routing_consistency_hand_computed():
    # two units of two tokens; layer 0 unchanged, layer 1: unit 0 one expert in common then equal, unit 1 none then 1
    ref = _routed([[[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 1], [2, 3], [4, 5], [6, 7]]], [0, 0, 1, 1])
    oth = _routed([[[0, 1], [3, 2], [5, 4], [7, 6]], [[0, 2], [2, 3], [0, 1], [6, 1]]], [0, 0, 1, 1])
    c = routing_consistency(ref, oth)
    assert c.layers == (0, 1) and c.top_k == 2 and c.tokens.tolist() == [2, 2]
    assert c.changed.tolist() == [[0, 0], [1, 2]]
    torch.testing.assert_close(
        c.jaccard_sum, torch.tensor([[2.0, 2.0], [1 / 3 + 1.0, 0.0 + 1 / 3]], dtype=torch.float64), rtol=0, atol=0
    )
    assert c.share_changed == [0.0, 3 / 4]
    assert c.jaccard == [1.0, (1 / 3 + 1.0 + 0.0 + 1 / 3) / 4]
    assert [r["share_changed"] for r in c.rows()] == [0.0, 0.75] and c.rows()[1]["units"] == 2


# ----------------------------------------------------------------------------- on a model


@pytest.fixture(scope="module")
def tiny():
    model = dummy_model(3, seed=0, model_preset="tiny")
    ids = random_token_ids(24, 5, model.config.vocab_size, batch=6)
    return model, ids


def test_identical_runs_agree_exactly(tiny):
    model, ids = tiny
    before = {k: v.clone() for k, v in model.state_dict().items()}
    a = record_routing(model, ids)
    b = record_routing(model, [ids[:4], ids[4:]], batch_size=3)  # another cut into tensors: the same units and tokens
    assert a.topk_ids.shape == (3, 6 * 24, 2) and a.num_units == 6 and a.layers == (0, 1, 2)
    c = routing_consistency(a, b)
    assert c.jaccard == [1.0, 1.0, 1.0] and c.share_changed == [0.0, 0.0, 0.0]
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # the model is not changed


def test_recording_an_evaluation_style_forward_matches_record_routing(tiny):
    model, ids = tiny
    with recording_routing(model) as rec:
        model(input_ids=ids[:2], use_cache=False)  # the full causal LM, as evaluate runs it
        model(input_ids=ids[2:], use_cache=False)
    assert torch.equal(rec.routed().topk_ids, record_routing(model, ids).topk_ids)
    assert not model.model._forward_pre_hooks and not any(m._forward_hooks for m in model.modules())  # removed


def test_planted_routing_change_is_found_exactly(tiny):
    model, ids = tiny
    ref = record_routing(model, ids)
    gate = model.model.layers[1].mlp.gate.weight
    saved = gate.detach().clone()
    a, b = 3, 11
    with torch.no_grad():
        gate[[a, b]] = saved[[b, a]]  # the router of layer 1 scores expert a as b and b as a
    try:
        oth = record_routing(model, ids)
    finally:
        with torch.no_grad():
            gate.copy_(saved)
    c = routing_consistency(ref, oth)
    assert c.share_changed[0] == 0.0  # before the planted layer nothing moves
    sets = ref.topk_ids[1]
    holds_one = (sets == a).any(-1) ^ (sets == b).any(-1)
    _, changed = topk_overlap(ref.topk_ids, oth.topk_ids)
    assert holds_one.any() and torch.equal(changed[1], holds_one)  # exactly the tokens routed to one of the two
    swapped = sets.clone()
    swapped[sets == a], swapped[sets == b] = b, a
    assert torch.equal(swapped.sort(-1).values, oth.topk_ids[1].sort(-1).values)
    k = ref.top_k
    assert c.jaccard[1] == pytest.approx(1 - holds_one.double().mean().item() * (1 - (k - 1) / (k + 1)), abs=1e-12)


def test_quantized_dummy_keeps_the_first_layer_and_moves_later_ones(tiny):
    model, ids = tiny
    ref = record_routing(model, ids)
    with ev.emulated_experts(model, "w_mxfp4_a_mxfp4"):
        q = record_routing(model, ids)
    c = routing_consistency(ref, q)
    assert c.share_changed[0] == 0.0 and c.jaccard[0] == 1.0  # its router reads bf16 modules only
    assert max(c.share_changed[1:]) > 0.0 and min(c.jaccard[1:]) < 1.0


def test_small_preset_record_routing():
    model = dummy_model(2, seed=0, model_preset="small")
    ids = random_token_ids(64, 3, model.config.vocab_size, batch=2)
    r = record_routing(model, ids)
    assert r.topk_ids.shape == (2, 128, 4) and r.top_k == 4
    assert int(r.topk_ids.min()) >= 0 and int(r.topk_ids.max()) < 16
    assert routing_consistency(r, r).share_changed == [0.0, 0.0]


# ----------------------------------------------------------------------------- the study and its family


def test_study_decides_a_planted_change_beyond_the_floor():
    p = accuracy.check_accuracy_parameters("test", schemes=["nvfp4"], eval_prompts=40, resamples=50)
    model = accuracy.trained_model(p, log=None)
    sets = accuracy.evaluation_sets(p)
    rf = rcs.reference_and_noise_floor(model, sets)
    assert (
        set(rf["noise_floor"]) == {0, 1}
        and rf["noise_floor"][0] == 0.0
        and max(rf["noise_floor"].values()) <= rcs.ROUTING_NOISE_FLOOR_BOUND
    )
    assert {r["variant"] for r in rf["rows"]} == set(rcs.NOISE_FLOOR_VARIANTS)
    gate = model.model.layers[1].mlp.gate.weight
    saved = gate.detach().clone()
    with torch.no_grad():
        gate[[0, 1]] = saved[[1, 0]]
    try:
        planted = record_routing(model, rcs.routing_tokens(sets), rcs.EVAL_BATCH_SIZE)
    finally:
        with torch.no_grad():
            gate.copy_(saved)
    study = rcs.consistency_study(rf, {"planted": planted, "same": rf["reference"]})
    family = ComparisonFamily("routing test")
    keys = rcs.add_comparisons(family, study)
    assert keys == [rcs.comparison_key(s, layer) for s in ("planted", "same") for layer in (0, 1)]
    decisions = family.decide()
    rows = {(r["scheme"], r["layer"]): r for r in rcs.verdict_rows(study, decisions)}
    assert rows[("planted", 1)]["verdict"] == "bf16 better" and rows[("planted", 1)]["share_changed"] > 0.05
    assert rows[("planted", 0)]["verdict"] == "cannot be told apart" and rows[("planted", 0)]["jaccard"] == 1.0
    assert rows[("same", 1)]["verdict"] == "cannot be told apart" and rows[("same", 1)]["share_changed"] == 0.0
    r = next(x for x in study["rows"] if (x["scheme"], x["layer"]) == ("planted", 1))
    assert r["share_low"] <= r["share_changed"] <= r["share_high"] and r["beyond_noise_floor"]
    assert r["jaccard_low"] <= r["jaccard"] <= r["jaccard_high"] < 1.0


def test_scheme_study_on_the_dummy_equals_the_practitioners_quantize(tiny):
    """``scheme_routing_study``'s routing of each scheme is the routing of the same model quantized by
    ``mxlib.quantize_`` (the layouts' path, written separately), token for token; the model comes back unchanged."""
    import copy

    from mxlib.models.in_memory import quantize_
    from mxlib.studies.steps import calibrate_model

    model, ids = tiny
    cal = calibrate_model(model, 64, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    experts_before = [m.mlp.experts for m in model.model.layers]
    schemes = ["nvfp4", "w_mxfp4_a_mxfp4"]
    r = rcs.scheme_routing_study(model, ids, schemes, cal, batch_size=4)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert [m.mlp.experts for m in model.model.layers] == experts_before
    ref = record_routing(model, ids, 4)
    for scheme in schemes:
        q = quantize_(copy.deepcopy(model), scheme, calibration=cal, backend="torch", progress=False)
        c = routing_consistency(ref, record_routing(q, ids, 4))
        rows = [x for x in r["rows"] if x["scheme"] == scheme]
        assert [x["layer"] for x in rows] == [0, 1, 2]
        assert [x["share_changed"] for x in rows] == pytest.approx(c.share_changed, abs=1e-12)
        assert [x["jaccard"] for x in rows] == pytest.approx(c.jaccard, abs=1e-12)
        assert rows[0]["share_changed"] == 0.0 and rows[0]["verdict"] == "cannot be told apart"
        assert max(x["share_changed"] for x in rows) > 0.0
        assert all(x["sequences"] == 6 and x["tokens"] == 6 * 24 for x in rows)
    floors = {}
    for x in r["noise_floor_rows"]:
        floors[x["layer"]] = max(floors.get(x["layer"], 0.0), x["share_changed"])
    assert floors == r["noise_floor"] and r["noise_floor"][0] == 0.0
    assert {x["variant"] for x in r["noise_floor_rows"]} == set(rcs.NOISE_FLOOR_VARIANTS)
    assert set(r["decisions"]) == {rcs.comparison_key(s, layer) for s in schemes for layer in (0, 1, 2)}
    assert all(x["verdict"] == r["decisions"][rcs.comparison_key(x["scheme"], x["layer"])].verdict for x in r["rows"])
    assert (r["units"], r["tokens"], set(r["seconds"])) == (6, 144, set(schemes))
    table = rcs.routing_table(r["rows"]).splitlines()
    assert len(table) == 1 + 2 * 3 and table[0].split()[:3] == ["scheme", "layer", "jaccard"]


@pytest.mark.gpu
def test_scheme_study_on_cuda_with_static_input_scales():
    """On a CUDA model, the calibration's input scales (recorded on the CPU) reach the experts' device: ``nvfp4``
    routes, and its first MoE layer routes every token as bf16."""
    from mxlib.studies.steps import calibrate_model

    model = dummy_model(2, seed=0, model_preset="tiny", device="cuda")
    ids = random_token_ids(16, 5, model.config.vocab_size, batch=4)
    r = rcs.scheme_routing_study(model, ids, ["nvfp4", "w_mxfp4_a_fp8"], calibrate_model(model, 64, seed=0))
    assert {x["scheme"] for x in r["rows"]} == {"nvfp4", "w_mxfp4_a_fp8"}
    assert all(x["share_changed"] == 0.0 for x in r["rows"] if x["layer"] == 0)


def test_scheme_study_refuses_another_models_calibration(tiny):
    from mxlib.studies.steps import calibrate_model

    model, ids = tiny
    other = calibrate_model(dummy_model(2, seed=0, model_preset="tiny"), 64, seed=0)
    with pytest.raises(ValueError, match=r"calibration: expected the model's 3 MoE layers of 16 experts each, got 2"):
        rcs.scheme_routing_study(model, ids, ["nvfp4"], other)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(token_ids=torch.zeros(4, 8)), r"token_ids: expected an integer tensor \[sequences, tokens\], got"),
        (dict(token_ids=torch.zeros(8, dtype=torch.long)), r"token_ids: expected an integer tensor"),
        (dict(token_ids=torch.zeros(1, 8, dtype=torch.long)), r"token_ids: expected at least 2 sequences"),
        (dict(schemes=[]), r"schemes: expected at least one MoE scheme, got none"),
        (dict(schemes=["nvfp5"]), r"nvfp5"),
        (dict(schemes=["nvfp4"], calibration=None), r"calibration: schemes \['nvfp4'\] have static input scales"),
        (dict(schemes=["w_fp8_a_fp8"]), r"schemes: w_fp8_a_fp8 is a linear-layer scheme"),
    ],
)
def test_scheme_study_refuses(tiny, kwargs, match):
    model, ids = tiny
    args = dict(token_ids=ids, schemes=["w_mxfp4"], calibration=None) | kwargs
    with pytest.raises(ValueError, match=match):
        rcs.scheme_routing_study(model, args["token_ids"], args["schemes"], args["calibration"])


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "other, match",
    [
        (torch.zeros(2, 4, 2, dtype=torch.long), r"other: expected 1 MoE layers \(as reference\), got 2"),
        (torch.zeros(1, 3, 2, dtype=torch.long), r"other: expected 4 tokens \(as reference\), got 3"),
        (torch.zeros(1, 4, 3, dtype=torch.long), r"other: expected 2 experts per token \(k\) \(as reference\), got 3"),
        (torch.zeros(1, 4, 2), r"other: expected an integer topk_ids tensor \[L, T, k\], got torch.float32"),
        (torch.zeros(4, 2, dtype=torch.long), r"other: expected topk_ids of shape \[L, T, k\].*got \[4, 2\]"),
        (
            torch.tensor([[[0, 1], [2, 2], [0, 1], [0, 1]]]),
            r"other: expected k distinct expert ids per token, got "
            r"\[2, 2\] at layer 0, token 1",
        ),
        (torch.tensor([[[0, 1], [-1, 2], [0, 1], [0, 1]]]), r"other: expected expert ids >= 0, got a minimum of -1"),
    ],
)
def test_topk_overlap_refuses(other, match):
    ref = torch.tensor([[[0, 1], [2, 3], [4, 5], [6, 7]]])
    with pytest.raises(ValueError, match=match):
        topk_overlap(ref, other)


def test_routing_consistency_refuses():
    ref = _routed([[[0, 1], [2, 3]]], [0, 1])
    with pytest.raises(ValueError, match=r"other: expected the MoE layers \[0\] \(as reference\), got \[0, 1\]"):
        routing_consistency(ref, _routed([[[0, 1], [2, 3]], [[0, 1], [2, 3]]], [0, 1]))
    with pytest.raises(ValueError, match=r"other: expected 2 tokens \(as reference\), got 3"):
        routing_consistency(ref, _routed([[[0, 1], [2, 3], [4, 5]]], [0, 1, 2]))
    with pytest.raises(ValueError, match=r"other: expected k = 2 experts per token \(as reference\), got 3"):
        routing_consistency(ref, _routed([[[0, 1, 2], [2, 3, 4]]], [0, 1]))
    with pytest.raises(
        ValueError,
        match=r"other: expected the same token ids as reference, got id 9 at position 1 "
        r"where reference has 1",
    ):
        routing_consistency(ref, _routed([[[0, 1], [2, 3]]], [0, 1], token_ids=[0, 9]))
    with pytest.raises(ValueError, match=r"other: expected the same units \(sequences\) as reference: 2 units, got 1"):
        routing_consistency(ref, _routed([[[0, 1], [2, 3]]], [0, 0]))
    with pytest.raises(TypeError, match=r"other: expected RoutedTokens .*got Tensor"):
        routing_consistency(ref, torch.zeros(1, 2, 2, dtype=torch.long))


def test_record_routing_refuses(tiny):
    model, ids = tiny
    with pytest.raises(
        ValueError,
        match=r"token_ids: expected an integer tensor \[batch, seq\] or \[seq\], got "
        r"torch.float32",
    ):
        record_routing(model, ids.float())
    with pytest.raises(ValueError, match=r"token_ids\[1\]: expected a non-empty tensor .*got shape \[1, 2, 3\]"):
        record_routing(model, [ids, torch.zeros(1, 2, 3, dtype=torch.long)])
    with pytest.raises(ValueError, match=r"batch_size: expected a positive int or None, got 0"):
        record_routing(model, ids, batch_size=0)
    with (
        recording_routing(model) as rec,
        pytest.raises(
            ValueError,
            match=r"expected every forward pass to take "
            r"input_ids",
        ),
    ):
        model.model(inputs_embeds=model.model.embed_tokens(ids[:1]), use_cache=False)
    with pytest.raises(ValueError, match=r"expected at least one forward pass inside the block, got none"):
        rec.routed()
