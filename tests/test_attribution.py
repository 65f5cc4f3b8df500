"""Error attribution (``mxlib.studies.attribution``): each source switched on or off on its own, exact sums.

Oracles: the reference functions (``mxlib.reference``) applied by hand to the quantized weights and the
activations, run through the reference MoE; the scheme's own emulation experts (another class) for every
source on; bf16 ``TritonExperts`` for none; a float64 SQNR computed with numpy; ``fractions.Fraction``
for the exactness of the sums. Shapes are tiny; the trained model is the ``test`` recipe.
"""

import math
import random
import warnings
from fractions import Fraction

import numpy as np
import pytest
import torch

from mxlib import reference as R
from mxlib.formats import PerTensorScheme
from mxlib.models import evaluation as ev
from mxlib.models.qwen3 import expert_weights
from mxlib.moe import TritonExperts
from mxlib.moe.factory import make_emulation_experts, quantize_expert_weights
from mxlib.moe.reference_moe import torch_moe
from mxlib.moe.schemes import get_moe_scheme
from mxlib.studies import attribution as A
from mxlib.studies.steps import calibrate_model, dummy_model, random_token_ids, run_model
from mxlib.workbook.attribution_figures import attribution_figure, attribution_rows, attribution_table

from _util import assert_bits_equal

E, H, I, M, K = 4, 64, 32, 12, 2
SCHEMES = ["nvfp4", "w_mxfp4_a_mxfp4", "w_mxfp4_a_fp8", "w_mxfp6_e2m3_a_mxfp6_e2m3", "w_mxfp4"]
SOURCE_SETS = [(), ("w13",), ("w2",), ("a1",), ("a2",), ("w13", "w2"), ("a1", "a2"), ("w13", "a2")]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # the studies run many small forwards: one thread is faster than two on a CPU shared with other jobs
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _layer(seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.05).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) * 0.05).bfloat16()
    x = torch.randn(M, H, generator=g).bfloat16()
    logits = torch.randn(M, E, generator=g)
    topk_weights, topk_ids = torch.softmax(logits, -1).topk(K, -1)
    topk_weights = topk_weights / topk_weights.sum(-1, keepdim=True)
    # per-expert static input scales (amax / divisor) with a spread, as a calibration gives
    amax13 = x.float().abs().amax() * torch.tensor([1.0, 0.5, 0.8, 0.3])
    return w13, w2, x, topk_weights, topk_ids.to(torch.int32), amax13


def _emulation(scheme, w13, w2, amax13):
    s = get_moe_scheme(scheme)
    q = quantize_expert_weights(w13, w2, s)
    in13 = in2 = None
    if s.static_activation_scale:
        in13, in2 = amax13 / s.activation.scale_divisor, amax13 * 0.25 / s.activation.scale_divisor
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return s, q, in13, in2, make_emulation_experts(s, q, in13, in2, backend="torch")


def _by_hand(s, q, in13, in2, w13, w2, sources):
    """The weights and the QDQ functions the sources call for, from the reference functions directly."""
    fmt, act = s.weight, s.activation
    dt = torch.bfloat16
    if fmt.has_global_scale:
        d13 = R.dequantize_to_dtype(q.w13_weight, q.w13_weight_scale, q.w13_weight_scale_2, dt)
        d2 = R.dequantize_to_dtype(q.w2_weight, q.w2_weight_scale, q.w2_weight_scale_2, dt)
    else:
        d13 = R.dequantize_mx(q.w13_weight, q.w13_weight_scale, fmt.element.name, fmt.block_size, dt)
        d2 = R.dequantize_mx(q.w2_weight, q.w2_weight_scale, fmt.element.name, fmt.block_size, dt)

    def qdq(scale):
        if act is None:
            return lambda t: t
        if isinstance(act, PerTensorScheme):
            return lambda t: R.quant_dequant_fp8_per_tensor(t, scale.max().reshape(1))
        if act.has_global_scale:  # one encode scale for all experts, 1 / the max decode scale (vLLM)
            return lambda t: R.ref_nvfp4_quant_dequant(t, torch.ones(()) / scale.max())
        return lambda t: R.quant_dequant_mx(t, act.element.name, act.block_size, "even")

    q1, q2 = qdq(in13), qdq(in2)
    return (
        d13 if "w13" in sources else w13,
        d2 if "w2" in sources else w2,
        q1 if "a1" in sources else (lambda t: t),
        q2 if "a2" in sources else None,
    )


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("sources", SOURCE_SETS, ids=lambda s: "+".join(s) or "none")
def test_each_source_alone_matches_the_reference_functions(scheme, sources):
    w13, w2, x, tw, ids, amax13 = _layer()
    s, q, in13, in2, emu = _emulation(scheme, w13, w2, amax13)
    experts = A.AttributedExperts(w13, w2, emu, sources)
    W13, W2, qdq1, qdq2 = _by_hand(s, q, in13, in2, w13, w2, sources)
    qi = None if qdq2 is None else (lambda a, row_experts: qdq2(a))
    expected = torch_moe(qdq1(x), W13, W2, tw, ids, qi)
    assert_bits_equal(experts(x, tw, ids), expected, f"{scheme} {sources}")
    if "a1" not in sources:  # the layer input reaches GEMM1 untouched
        assert experts.quantize_input(x, ids, "torch")[0] is x


@pytest.mark.parametrize("scheme", SCHEMES)
def test_all_sources_on_is_the_emulation_and_none_is_bf16(scheme):
    w13, w2, x, tw, ids, amax13 = _layer(1)
    s, q, in13, in2, emu = _emulation(scheme, w13, w2, amax13)
    all_on = A.AttributedExperts(w13, w2, emu, A.scheme_sources(s))
    assert_bits_equal(all_on(x, tw, ids), emu(x, tw, ids), f"{scheme} all on vs its emulation experts")
    none = A.AttributedExperts(w13, w2, emu, ())
    assert_bits_equal(none(x, tw, ids), TritonExperts(w13, w2, backend="torch")(x, tw, ids), f"{scheme} none on")


def test_bad_arguments_are_named():
    w13, w2, x, tw, ids, amax13 = _layer()
    _, q, in13, in2, emu = _emulation("nvfp4", w13, w2, amax13)
    with pytest.raises(ValueError, match="sources: expected sources from"):
        A.AttributedExperts(w13, w2, emu, ("w3",))
    with pytest.raises(ValueError, match="sources: expected each source once"):
        A.AttributedExperts(w13, w2, emu, ("a1", "a1"))
    with pytest.raises(TypeError, match="emulation: expected emulation experts"):
        A.AttributedExperts(w13, w2, TritonExperts(w13, w2), ("w13",))
    hw = make_emulation_experts("nvfp4", q, in13, in2, backend="torch", numerics="hardware")
    with pytest.raises(ValueError, match="emulation: expected numerics 'vllm'"):
        A.AttributedExperts(w13, w2, hw, ("w13",))
    with pytest.raises(ValueError, match=r"emulation: expected experts of \[E, H, I\]"):
        A.AttributedExperts(w13[:2], w2[:2], emu, ())
    with pytest.raises(ValueError, match="order: expected a permutation"):
        A.make_plan("nvfp4", 2, order=("w13", "w2", "a1"))
    with pytest.raises(ValueError, match="order: expected sources from"):
        A.make_plan("w_mxfp4", 2, order=("w13", "a1"))
    with pytest.raises(ValueError, match="num_layers: expected a positive int"):
        A.make_plan("nvfp4", 0)
    for bad in (math.inf, math.nan, A.LIMIT, -A.LIMIT * 2):
        with pytest.raises(ValueError, match="nsr: expected a finite value"):
            A.on_grid(bad, "nsr")


def test_values_on_the_grid_add_exactly():
    rng = random.Random(0)
    for _ in range(2000):
        vals = [A.on_grid(rng.uniform(-1, 1) * 10.0 ** rng.randint(-9, 2)) for _ in range(rng.randint(2, 60))]
        assert all(Fraction(v) * 2**36 == int(Fraction(v) * 2**36) for v in vals)  # on the 2^-36 grid
        assert Fraction(sum(vals)) == sum(map(Fraction, vals))  # the float sum is the exact sum
        assert Fraction(vals[0] - vals[1]) == Fraction(vals[0]) - Fraction(vals[1])
    assert A.on_grid(0.1) != 0.1 and abs(A.on_grid(0.1) - 0.1) <= A.QUANTUM / 2


def test_residuals_see_a_sum_that_float_rounding_breaks():
    # the check can fail: off the grid, 0.1 + 0.2 is not 0.3 in float64
    d = A.Decomposition("m", 0.0, 0.3, [("w13", 0.1), ("w2", 0.2)], {"w13": 0.1, "w2": 0.2}, 0.0, 0.3, 0.0, 0.0)
    d.layers, d.interaction_layers = {0: 0.3}, 0.0
    assert A.residuals(d)["waterfall"] != 0 and A.residuals(d)["sources"] != 0
    g = A.on_grid
    d = A.Decomposition("m", 0.0, g(0.3), [("w13", g(0.1)), ("w2", g(0.3) - g(0.1))], {"w13": g(0.1), "w2": g(0.2)})
    d.interaction = d.total - g(0.1) - g(0.2)
    d.weights, d.layers, d.interaction_layers = d.total, {0: d.total}, 0.0
    assert A.residuals(d) == dict(waterfall=0, sources=0, weights_activations=0, layers=0)


def test_sum_failures_names_a_broken_sum(layer_studies):
    res = layer_studies["nvfp4"]
    assert A.sum_failures(res) == []
    broken = {**res, "decompositions": {**res["decompositions"]}}
    broken["decompositions"]["logits kl"] = {**res["decompositions"]["logits kl"], "interaction": 1.0}
    (failure,) = A.sum_failures(broken)
    assert failure.startswith("logits kl: ") and "'sources': 1.0" in failure


def test_the_plan_names_each_part_once():
    plan = A.make_plan("nvfp4", 3, order=("a2", "w13", "a1", "w2"), layer_sources=True)
    assert plan.steps == ("a2", "a2+w13", "a2+w13+a1", "a2+w13+a1+w2")
    assert plan.configs["all"] == plan.configs["a2+w13+a1+w2"] == {(li, s) for li in range(3) for s in A.SOURCES}
    assert plan.configs["only a1"] == {(0, "a1"), (1, "a1"), (2, "a1")}
    assert plan.configs["layer 1"] == {(1, s) for s in A.SOURCES} and plan.configs["layer 2 w2"] == {(2, "w2")}
    weight_only = A.make_plan("w_mxfp4", 2)
    assert weight_only.sources == ("w13", "w2") and weight_only.configs["activations"] == frozenset()


# ----------------------------------------------------------------------------- the dummy model


def _check_sums(d: dict):
    total = Fraction(d["total"])
    for v in [d["total"], *(v for _, v in d["waterfall"]), *d["singles"].values(), *d["layers"].values()]:
        assert Fraction(v) * 2**36 == int(Fraction(v) * 2**36), "a value off the grid"
    assert sum(v for _, v in d["waterfall"]) == d["total"]  # in float64: exact
    assert sum(Fraction(v) for _, v in d["waterfall"]) == total  # and in exact rationals
    assert sum(d["singles"].values()) + d["interaction"] == d["total"]
    assert sum(map(Fraction, d["singles"].values())) + Fraction(d["interaction"]) == total
    assert d["weights"] + d["activations"] + d["interaction_wa"] == d["total"]
    assert sum(d["layers"].values()) + d["interaction_layers"] == d["total"]
    assert sum(map(Fraction, d["layers"].values())) + Fraction(d["interaction_layers"]) == total
    assert A.residuals(d) == dict(waterfall=0, sources=0, weights_activations=0, layers=0)


@pytest.fixture(scope="module")
def tiny():
    model = dummy_model(2, model_preset="tiny")
    calibration = calibrate_model(model, 256)
    ids = random_token_ids(32, 1, model.config.vocab_size)
    return model, calibration, ids


@pytest.fixture(scope="module")
def layer_studies(tiny):
    model, calibration, ids = tiny
    return {s: A.attribute_layers(model, s, ids, calibration) for s in ("nvfp4", "w_mxfp4_a_mxfp4", "w_mxfp4")}


def _independent_run(model, ids, make):
    with ev.swapped_experts(model, make):
        return run_model(model, ids)


def _np_sqnr_db(x, ref):
    x, ref = x.numpy().astype(np.float64), ref.numpy().astype(np.float64)
    return 10.0 * np.log10(np.sum(ref * ref) / np.sum((x - ref) ** 2))


def test_layer_sums_are_exact(layer_studies):
    for s, res in layer_studies.items():
        assert set(res["decompositions"]) == {"layer 0 nsr", "layer 1 nsr", "logits nsr", "logits kl"}
        for d in res["decompositions"].values():
            _check_sums(d)
        assert all(v == 0 for v in res["values"]["bf16"].values()), s  # measured again: the same bits
    assert all(v == 0 for v in layer_studies["w_mxfp4"]["values"]["activations"].values())


def test_all_sources_on_is_the_scheme_and_its_layer_sqnr_in_float64(tiny, layer_studies):
    model, calibration, ids = tiny
    res = layer_studies["nvfp4"]
    bf16 = [expert_weights(model, li) for li in range(2)]
    ref = _independent_run(model, ids, lambda li: TritonExperts(*bf16[li], backend="torch"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with ev.emulated_experts(model, "nvfp4", calibration):
            out = run_model(model, ids)
    for li in range(2):
        nsr = float(((out.layer_outputs[li].double() - ref.layer_outputs[li].double()) ** 2).sum())
        nsr /= float((ref.layer_outputs[li].double() ** 2).sum())
        assert res["values"]["all"][f"layer {li} nsr"] == A.on_grid(nsr)
    # one layer's SQNR against numpy's float64 arithmetic (another summation order: 1e-12 relative)
    want = _np_sqnr_db(out.layer_outputs[1], ref.layer_outputs[1])
    assert res["sqnr_db"]["all"]["layer 1"] == pytest.approx(want, rel=1e-12, abs=0)
    assert res["sqnr_db"]["all"]["logits"] == pytest.approx(_np_sqnr_db(out.logits, ref.logits), rel=1e-12, abs=0)
    # the bf16 configuration against the model's own experts: close, not necessarily equal (noise floor)
    assert min(res["baseline_vs_model"].values()) > 30


def test_weights_only_part_is_the_weight_only_scheme(tiny, layer_studies):
    model, calibration, ids = tiny
    w4a4, w4 = layer_studies["w_mxfp4_a_mxfp4"], layer_studies["w_mxfp4"]
    assert w4a4["values"]["weights"] == w4["values"]["all"] == w4["values"]["weights"]
    assert w4["decompositions"]["logits nsr"]["total"] == w4["decompositions"]["logits nsr"]["weights"] > 0
    # and that is the w_mxfp4 emulation experts' own run
    bf16 = [expert_weights(model, li) for li in range(2)]
    ref = _independent_run(model, ids, lambda li: TritonExperts(*bf16[li], backend="torch"))
    with ev.emulated_experts(model, "w_mxfp4"):
        out = run_model(model, ids)
    logits_nsr = float(((out.logits.double() - ref.logits.double()) ** 2).sum() / (ref.logits.double() ** 2).sum())
    assert w4["values"]["all"]["logits nsr"] == A.on_grid(logits_nsr)


def test_rows_and_figure(layer_studies):
    res = layer_studies["nvfp4"]
    rows = attribution_rows(res, "logits nsr")
    parts = [r["part"] for r in rows]
    assert parts[:5] == ["total", "waterfall +w13", "waterfall +w2", "waterfall +a1", "waterfall +a2"]
    assert rows[0]["sqnr_db"] == res["sqnr_db"]["all"]["logits"]
    fig = attribution_figure(list(layer_studies.values()), "logits nsr")
    waterfalls = [t for t in fig.data if t.type == "waterfall"]
    assert len(waterfalls) == 3 and list(waterfalls[0].y[:-1]) == [
        v for _, v in res["decompositions"]["logits nsr"]["waterfall"]
    ]
    assert attribution_table(res, "logits kl").data[0].type == "table"
    with pytest.raises(KeyError, match="metric: expected one of"):
        attribution_rows(res, "exact_match")


# ----------------------------------------------------------------------------- the trained model


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from mxlib.models.tasks import make_dataset
    from mxlib.models.training import train

    model = train("test", tmp_path_factory.mktemp("trained"))
    tasks = ("reverse", "count")
    held = [make_dataset(t, 60, 0, "heldout") for t in tasks]
    calibration = ev.calibrate_tasks(model, [make_dataset(t, 32, 0, "train") for t in tasks])
    return model, held, calibration


def test_trained_attribution_sums_and_end_points(trained):
    model, held, calibration = trained
    held_tasks = ("reverse", "count")  # no "all" entry: the pooled rows take the largest task noise floor
    res = A.attribute_trained(
        model,
        held,
        "nvfp4",
        calibration,
        noise_floor={t: {"exact_match": 0.0, "nll_per_token": 0.0} for t in held_tasks},
    )
    assert A.sum_failures(res) == []
    for per in res["decompositions"].values():
        em, nll = per["exact_match"], per["nll_per_token"]
        assert isinstance(em["total"], int) and all(isinstance(v, int) for _, v in em["waterfall"])
        _check_sums(em)
        _check_sums(nll)
    # the end points by other paths: the scheme's emulation experts, and bf16 TritonExperts
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with ev.emulated_experts(model, "nvfp4", calibration):
            scheme = ev.evaluate(model, held)
    bf16 = [expert_weights(model, li) for li in range(2)]
    with ev.swapped_experts(model, lambda li: TritonExperts(*bf16[li], backend="torch")):
        base = ev.evaluate(model, held)
    for t in ("reverse", "count"):
        for name, r in (("all", scheme), ("bf16", base)):
            got = res["values"][name][t]
            assert got["exact_match"] == int(r.tasks[t].correct.sum())
            nll = float(r.tasks[t].nll.sum()) / float(r.tasks[t].tokens.sum())
            assert got["nll_per_token"] == A.on_grid(nll)
    assert res["values"]["all"] == A.task_values(scheme)
    assert res["n"] == {"reverse": 60, "count": 60, "all": 120}
    diff = res["differences"]["all"]["all"]["nll_per_token"]
    assert diff["beyond"] == (diff["significant"] and diff["estimate"] != 0)
    rows = attribution_rows(res, "exact_match", "all")
    assert rows[0]["delta_fraction"] == rows[0]["delta"] / 120
