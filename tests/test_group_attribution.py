"""Loss attributed per precision group of a mixed-precision checkpoint (``mxlib.studies.group_attribution``).

The fixture is a Quark mixed-precision checkpoint written by ``write_mixed_checkpoint`` from a tiny bf16 Qwen3-MoE
(the form ``tests/test_mixed_precision.py`` checks against the producers' documented layouts): MXFP4 W4A4
experts (``global_quant_config``), MXFP8 attention (``*.self_attn.*``) and an MXFP8 ``lm_head`` (``lm_head``).
What each configuration must compute is known by construction:

* every group switched to bf16 is the bf16 model the checkpoint was written from, bit for bit;
* a group switched to the precision it is stored in is the checkpoint itself, bit for bit (the same codes);
* a group switched to another precision is the checkpoint written in that precision, bit for bit;
* a group switched to bf16 is its modules' bf16 originals (the same objects), put back on exit;
* a coarser format (MXFP4 W4A4 in place of MXFP8) costs more, decided by the family; every group costs
  something against bf16, decided.
"""

import pytest
import torch

from mxlib import checkpoints as C
from mxlib.models.qwen3 import dummy_qwen3_moe, qwen3_30b_a3b_config
from mxlib.moe.linear import EmulatedLinear, linear_input_amax
from mxlib.studies import group_attribution as G
from mxlib.studies.attribution import QUANTUM, on_grid

from _util import TINY_QWEN3, assert_bits_equal, tiny_calibrated

LAYERS = 2
ATTN = [f"model.layers.{layer}.self_attn.{p}" for layer in range(LAYERS) for p in C.ATTENTION_PROJS]
EXPERTS_G, ATTN_G, HEAD_G = "global_quant_config", "*.self_attn.*", "lm_head"


@pytest.fixture(scope="module")
def tiny():
    model, cal, ids = tiny_calibrated(5, tokens=16, layers=LAYERS, ids_seed=1)
    return model, cal, linear_input_amax(model, ids, [*ATTN, "lm_head"])


def _write(
    tiny, folder, producer="quark", experts="w_mxfp4_a_mxfp4", attention="w_mxfp8_a_mxfp8", head="w_mxfp8_a_mxfp8"
):
    model, cal, amax = tiny
    path = C.write_mixed_checkpoint(model, producer, folder, experts, attention, head, cal, linear_input_amax=amax)
    return C.load_quantized_moe(path, backend="torch")[0]


@pytest.fixture(scope="module")
def mixed(tiny, tmp_path_factory):
    return _write(tiny, tmp_path_factory.mktemp("groups") / "quark")


EVAL = torch.randint(0, 128, (4, 48), generator=torch.Generator().manual_seed(2))
TARGETS = {ATTN_G: ["w_mxfp8_a_mxfp8", "w_mxfp4_a_mxfp4"], HEAD_G: "bf16"}


@pytest.fixture(scope="module")
def study(mixed, tiny):
    return G.attribute_groups(mixed, tiny[0], EVAL, targets=TARGETS)


def _logits(model, ids=EVAL):
    with torch.no_grad():
        return model(ids).logits


def test_precision_groups(mixed):
    groups = G.precision_groups(mixed)
    assert groups == {
        ATTN_G: ATTN,
        HEAD_G: ["lm_head"],
        EXPERTS_G: [f"model.layers.{layer}.mlp.experts" for layer in range(LAYERS)],
    }


def test_every_group_bf16_is_the_reference_bit_for_bit(mixed, tiny, study):
    model = tiny[0]
    ref = _logits(model)
    with G.switched_groups(mixed, model, dict.fromkeys(G.precision_groups(mixed), "bf16")) as m:
        assert_bits_equal(_logits(m), ref, "every group bf16 vs the bf16 model")
    assert study["bf16_matches_reference"] is True
    assert study["values"]["bf16"] == {"logits nsr": 0.0, "logits kl": 0.0}
    # and the checkpoint differs from it: the switch is not a no-op
    assert not torch.equal(_logits(mixed), ref)


def test_a_group_switched_to_bf16_runs_its_bf16_modules_and_is_put_back(mixed, tiny):
    model = tiny[0]
    stored = {n: mixed.get_submodule(n) for n in ATTN}
    with G.switched_groups(mixed, model, {ATTN_G: "bf16"}) as m:
        for n in ATTN:
            assert m.get_submodule(n) is model.get_submodule(n)  # the bf16 module itself: its outputs, bit for bit
        assert isinstance(m.lm_head, EmulatedLinear)  # groups not named keep the checkpoint's modules
    for n in ATTN:
        assert mixed.get_submodule(n) is stored[n]
    assert all(isinstance(model.get_submodule(n), torch.nn.Linear) for n in ATTN)  # the reference is unchanged


def test_a_group_in_its_own_precision_is_the_checkpoint(mixed, tiny, study):
    checkpoint = _logits(mixed)  # before the switch: switched_groups changes the model in place
    with G.switched_groups(mixed, tiny[0], {ATTN_G: "w_mxfp8_a_mxfp8", HEAD_G: "w_mxfp8_a_mxfp8"}) as m:
        assert m is mixed
        assert_bits_equal(_logits(m), checkpoint, "re-quantized in the stored precision vs the checkpoint")
    assert study["values"][f"{ATTN_G} as w_mxfp8_a_mxfp8"] == study["values"]["all"]
    for metric in ("logits nsr", "logits kl"):
        v = study["decisions"][f"{ATTN_G} as w_mxfp8_a_mxfp8 vs all ({metric})"]
        assert v["difference"] == 0.0 and v["verdict"] == "cannot be told apart"


def test_a_group_in_another_precision_is_that_checkpoint(mixed, tiny, tmp_path):
    # the attention written as MXFP4 W4A4 by the writer, loaded: the switched model computes it bit for bit
    other = _write(tiny, tmp_path / "coarse", attention="w_mxfp4_a_mxfp4")
    with G.switched_groups(mixed, tiny[0], {ATTN_G: "w_mxfp4_a_mxfp4"}) as m:
        assert_bits_equal(_logits(m), _logits(other), "attention switched to MXFP4 vs its checkpoint")


@pytest.fixture(scope="module")
def dummy():
    """The workbook's tiny dummy (2 layers, seed 0): its weights reach the bf16 / fp32 differences of the producers'
    arithmetic (the ``tiny`` fixture's happen not to)."""
    from mxlib.studies.steps import calibrate_model, dummy_model, random_token_ids

    model = dummy_model(LAYERS, seed=0, model_preset="tiny")
    ids = random_token_ids(32, 3, model.config.vocab_size, batch=4)
    return model, calibrate_model(model, 256, seed=0), linear_input_amax(model, ids, [*ATTN, "lm_head"]), ids


PRODUCER_PLANS = [
    ("modelopt", "nvfp4", "w_mxfp8_a_mxfp8", None),
    ("modelopt", "nvfp4", "w_fp8_a_fp8", "nvfp4"),
    ("modelopt", "w4a16_nvfp4", "w_fp8_a_fp8_per_token", None),
    ("quark", "w_mxfp4_a_mxfp4", "w_fp8_a_fp8", "w_mxfp8_a_mxfp8"),
    ("quark", "w_mxfp4_a_mxfp4", "w_fp8_a_fp8_per_token", None),
    ("compressed-tensors", "nvfp4", "w_mxfp8_a_mxfp8", "nvfp4"),
    ("compressed-tensors", "w_mxfp4_a_mxfp4", "w_fp8_a_fp8_per_token", "w_fp8_a_fp8"),
]


@pytest.mark.parametrize("producer,experts,attention,head", PRODUCER_PLANS)
def test_every_group_in_its_stored_scheme_is_the_checkpoint_for_every_producer(
    dummy, tmp_path, producer, experts, attention, head
):
    """Each producer's writer has its own arithmetic (ModelOpt's FP8 quotient in the weight's dtype, compressed-tensors'
    NVFP4 block amax in bf16, bf16 FP8 scales): a group switched to the scheme it is stored in is written by that
    producer's layout, so the switched model computes the loaded checkpoint bit for bit."""
    model, cal, amax, ids = dummy
    mixed = _write(dummy[:3], tmp_path / "m", producer, experts, attention, head)
    stored = {g: mixed.mxlib_info.precision.groups[g].description.scheme.name for g in G.precision_groups(mixed)}
    checkpoint = _logits(mixed, ids)  # before the switch: switched_groups changes the model in place
    for g, scheme in stored.items():
        with G.switched_groups(mixed, model, {g: scheme}, calibration=cal, linear_input_amax=amax) as m:
            assert_bits_equal(_logits(m, ids), checkpoint, f"{producer}: {g} re-quantized as stored")


def test_a_group_in_another_stored_scheme_is_that_producers_checkpoint(dummy, tmp_path):
    """compressed-tensors' MXFP8 attention switched to per-tensor FP8 is the compressed-tensors checkpoint written
    with FP8 attention (bf16 scales, the tool's arithmetic), bit for bit."""
    model, cal, amax, ids = dummy
    mixed = _write(dummy[:3], tmp_path / "mx", "compressed-tensors", "nvfp4", "w_mxfp8_a_mxfp8", None)
    other = _write(dummy[:3], tmp_path / "fp8", "compressed-tensors", "nvfp4", "w_fp8_a_fp8", None)
    (group,) = [g for g, mods in G.precision_groups(mixed).items() if ATTN[0] in mods]
    with G.switched_groups(mixed, model, {group: "w_fp8_a_fp8"}, calibration=cal, linear_input_amax=amax) as m:
        assert_bits_equal(_logits(m, ids), _logits(other, ids), "compressed-tensors attention switched to FP8")


def test_static_scale_target_is_that_checkpoint(mixed, tiny, tmp_path):
    """Experts switched to NVFP4 (static scales from the calibration) and the rest to bf16 is ModelOpt's NVFP4
    experts-only checkpoint of the same model."""
    model, cal, _ = tiny
    other = _write(tiny, tmp_path / "nvfp4", producer="modelopt", experts="nvfp4", attention=None, head=None)
    switch = {EXPERTS_G: "nvfp4", ATTN_G: "bf16", HEAD_G: "bf16"}
    with G.switched_groups(mixed, model, switch, calibration=cal) as m:
        assert_bits_equal(_logits(m), _logits(other), "experts switched to NVFP4 vs its checkpoint")


def test_coarser_costs_more_and_every_group_costs(study):
    d = study["decisions"]
    for metric in ("logits nsr", "logits kl"):
        coarse = d[f"{ATTN_G} as w_mxfp4_a_mxfp4 vs all ({metric})"]
        assert coarse["verdict"] == "all better" and coarse["difference"] > coarse["smallest"] > 0
        for g in (EXPERTS_G, ATTN_G, HEAD_G):
            assert d[f"only {g} vs bf16 ({metric})"]["verdict"] == "bf16 better", (g, metric)
        # MXFP4 W4A4 experts cost more than the MXFP8 lm_head alone
        assert d[f"only {HEAD_G} vs only {EXPERTS_G} ({metric})"]["verdict"] == f"only {HEAD_G} better"
    # a group switched to bf16 through targets is the "without" configuration, exactly
    assert study["values"][f"{HEAD_G} as bf16"] == study["values"][f"without {HEAD_G}"]
    assert (
        study["decompositions"]["logits nsr"]["targets"][f"{HEAD_G} as bf16"]
        == -study["decompositions"]["logits nsr"]["switches"][HEAD_G]
    )


def test_decomposition_sums_are_exact(study):
    groups = list(study["groups"])
    for metric, d in study["decompositions"].items():
        assert G.group_residuals(d) == {"waterfall": 0.0, "groups": 0.0}, metric
        assert [g for g, _ in d["waterfall"]] == groups
        assert d["total"] == study["values"]["all"][metric] > 0
        assert all(v > 0 for v in d["singles"].values())
        for g in groups:
            assert d["switches"][g] == d["total"] - study["values"][f"without {g}"][metric]


def test_nsr_against_float64(mixed, tiny, study):
    x, ref = _logits(mixed).double(), _logits(tiny[0]).double()
    nsr = float(((x - ref) ** 2).sum() / (ref**2).sum())
    assert study["values"]["all"]["logits nsr"] == on_grid(nsr)
    assert study["sqnr_db"]["bf16"] == float("inf")


def test_group_plan():
    plan = G.make_group_plan(["a", "b"], order=["b", "a"], targets={"a": ["w_mxfp4", "bf16"]})
    assert plan.configs == {
        "bf16": {"a": "bf16", "b": "bf16"},
        "all": {},
        "only a": {"b": "bf16"},
        "without a": {"a": "bf16"},
        "only b": {"a": "bf16"},
        "without b": {"b": "bf16"},
        "waterfall b": {"a": "bf16"},
        "waterfall b+a": {},
        "a as w_mxfp4": {"a": "w_mxfp4"},
        "a as bf16": {"a": "bf16"},
    }
    assert plan.steps == ("waterfall b", "waterfall b+a")
    # groups named as configurations are still measured apart
    odd = G.make_group_plan(["all", "bf16"])
    assert odd.configs["all"] == {} and odd.configs["waterfall all"] == {"bf16": "bf16"}
    # configurations with the same switch share one measurement: the values by switch
    by_switch = {(("a", "bf16"), ("b", "bf16")): 0.0, (): 1.0, (("b", "bf16"),): 2.0, (("a", "bf16"),): 3.0}
    by_switch[(("a", "w_mxfp4"),)] = 4.0
    values = {n: by_switch[tuple(sorted(sw.items()))] for n, sw in plan.configs.items()}
    d = G.decompose_groups(plan, values, "m")
    assert d.waterfall == [("b", 3.0), ("a", -2.0)] and d.total == 1.0
    assert d.singles == {"a": 2.0, "b": 3.0} and d.interaction == -4.0
    assert d.switches == {"a": -2.0, "b": -1.0} and d.targets == {"a as w_mxfp4": 3.0, "a as bf16": 2.0}
    assert G.group_residuals(d) == {"waterfall": 0.0, "groups": 0.0}
    with pytest.raises(KeyError, match=r"values: no value for the configurations \['all'"):
        G.decompose_groups(plan, {"bf16": 0.0}, "m")


def test_bad_arguments_are_named(mixed, tiny):
    model, _, _ = tiny
    with pytest.raises(
        ValueError,
        match=r"switch: expected precision groups of this checkpoint from \['\*\.self_attn"
        r"\.\*', 'lm_head', 'global_quant_config'\], got \['MXFP8'\]",
    ):
        with G.switched_groups(mixed, model, {"MXFP8": "bf16"}):
            pass
    with pytest.raises(ValueError, match=r"switch\['lm_head'\]: expected 'bf16' or a MoE scheme name, got 'fp3'"):
        with G.switched_groups(mixed, model, {HEAD_G: "fp3"}):
            pass
    with pytest.raises(ValueError, match=r"model: expected a model loaded from a mixed-precision checkpoint"):
        G.precision_groups(model)
    with pytest.raises(ValueError, match=r"reference: expected the bf16 model .* got the model itself"):
        G.attribute_groups(mixed, mixed, EVAL)
    other = dummy_qwen3_moe(qwen3_30b_a3b_config(num_hidden_layers=1, **TINY_QWEN3), seed=0)
    with pytest.raises(
        ValueError,
        match=r"reference: expected 'model.layers.1.self_attn.q_proj' \(group "
        r"'\*\.self_attn\.\*'\) to be nn.Linear \[64, 64\], got no such module",
    ):
        G.attribute_groups(mixed, other, EVAL)
    with pytest.raises(ValueError, match=r"calibration: switch\['global_quant_config'\] = nvfp4 has static"):
        with G.switched_groups(mixed, model, {EXPERTS_G: "nvfp4"}):
            pass
    with pytest.raises(ValueError, match=r"linear_input_amax: switch\['lm_head'\] = nvfp4 has static .* 'lm_head'"):
        with G.switched_groups(mixed, model, {HEAD_G: "nvfp4"}):
            pass
    with pytest.raises(ValueError, match=r"targets: expected precision groups of this checkpoint from .* got \['x'\]"):
        G.attribute_groups(mixed, model, EVAL, targets={"x": "bf16"})
    with pytest.raises(ValueError, match=r"order: expected a permutation of the groups"):
        G.attribute_groups(mixed, model, EVAL, order=[HEAD_G])
    with pytest.raises(ValueError, match=r"token_ids: expected an integer tensor \[B, T\], got torch.float32"):
        G.attribute_groups(mixed, model, EVAL.float())
    assert isinstance(mixed.lm_head, EmulatedLinear)  # nothing was left switched


@pytest.mark.slow
def test_trained_model_groups(tmp_path_factory):
    from mxlib.models import evaluation as ev
    from mxlib.models.tasks import make_dataset
    from mxlib.models.training import train

    model = train("test", tmp_path_factory.mktemp("trained"))
    held = [make_dataset(t, 60, 0, "heldout") for t in ("reverse", "count")]
    cal = ev.calibrate_tasks(model, [make_dataset("count", 32, 0, "train")])
    path = C.write_mixed_checkpoint(
        model, "modelopt", tmp_path_factory.mktemp("ckpt") / "m", "nvfp4", "w_mxfp8_a_mxfp8", calibration=cal
    )
    loaded, _ = C.load_quantized_moe(path, backend="torch")
    res = G.attribute_groups_trained(loaded, model, held, targets={"MXFP8 g32": "bf16"})
    assert res["groups"] == {
        "NVFP4 g16": [f"model.layers.{layer}.mlp.experts" for layer in range(2)],
        "MXFP8 g32": [f"model.layers.{layer}.self_attn.{p}" for layer in range(2) for p in C.ATTENTION_PROJS],
    }
    assert res["bf16_matches_reference"] is True
    assert res["n"] == 120
    for t, per in res["decompositions"].items():
        for metric, d in per.items():
            assert G.group_residuals(d) == {"waterfall": 0, "groups": 0}, (t, metric)
    # the pooled values by another path: the checkpoint itself evaluated
    r = ev.evaluate(loaded, held)
    assert res["values"]["all"]["all"]["exact_match"] == sum(int(x.correct.sum()) for x in r.tasks.values())
    assert res["values"]["MXFP8 g32 as bf16"] == res["values"]["without MXFP8 g32"]
    assert len(res["decisions"]) == 2 * (2 + 2 + 1 + 1)


def test_draws(mixed, tiny):
    """Several token sets: each value is the mean of the draws' values, and the comparisons are over the draws."""
    model = tiny[0]
    sets = [torch.randint(0, 128, (1, 32), generator=torch.Generator().manual_seed(s)) for s in (3, 4, 5)]
    res = G.attribute_groups(mixed, model, sets, targets={ATTN_G: "w_mxfp4_a_mxfp4"})
    assert res["draws"] == 3 and res["n"] == 96 and res["bf16_matches_reference"] is True
    one = [G.attribute_groups(mixed, model, s)["values"]["all"]["logits nsr"] for s in sets]
    # each draw's value was put on the 2^-36 grid before the mean: within two grid steps
    assert abs(res["values"]["all"]["logits nsr"] - sum(one) / 3) <= 2 * QUANTUM
    verdict = res["decisions"][f"{ATTN_G} as w_mxfp4_a_mxfp4 vs all (logits nsr)"]
    assert verdict["over"] == "token sets" and verdict["n"] == 3
    with pytest.raises(ValueError, match=r"token_ids: expected one \[B, T\] tensor or a list of at least 2"):
        G.attribute_groups(mixed, model, sets[:1])
    with pytest.raises(ValueError, match=r"token_ids\[1\]: expected an integer tensor \[B, T\], got torch.float32"):
        G.attribute_groups(mixed, model, [sets[0], sets[1].float()])
