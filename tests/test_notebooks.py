"""Every notebook through papermill at a size a test can afford, its results JSON read back.

Notebooks 01, 03 and 04 run on the ``tiny`` model preset (``mxlib.models.qwen3.MODEL_PRESETS``); 06 and 07 on
the quick runs their prose suggests (the trained model's ``test`` recipe of ``mxlib.models.training.RECIPES``, two
schemes, fewer prompts; 07 three recovery techniques and the dummy model at the tiny preset), the same executions
that tests/test_notebook_settings.py runs as suggested settings; 02 on fewer rows of test data; 05 on its defaults
(recorded benchmark results and a small numerics check) but for section 6's model, the ``tiny`` preset. Each run
must pass the notebook's own checks cell, and the numbers it writes to ``results_path`` are checked again here: the
notebooks' claims, restated for the tiny size where the size matters. ``make workbook`` runs the full-size defaults.

The kernel is the ``python3`` kernel of this interpreter; it imports the checkout under test
(``PYTHONPATH``) and writes its checkpoints into a temporary folder (``MXLIB_CACHE``). The injected
parameters hold no absolute path: each notebook runs with a temporary folder as its working
directory and writes ``results.json`` there. Execution goes through the session fixture
``executed_notebook`` (tests/conftest.py), so tests/test_render.py renders these same executed
copies (``NOTEBOOK_PARAMS``) instead of running the notebooks again.
"""

import json
from pathlib import Path

import pytest
from test_notebook_settings import SHARED, SUGGESTED

from mxlib.models import training as tr

pm = pytest.importorskip("papermill")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"


# The parameters each notebook runs on here; tests/test_render.py renders the same executions.
NOTEBOOK_PARAMS: dict[str, dict] = {
    # checkpoint_path names a producer-made fixture under tests/fixtures; conftest copies it into the
    # notebook's working folder, so the parameter stays a relative path
    "01_end_to_end-nvfp4": dict(
        scheme="nvfp4",
        model_preset="tiny",
        num_tokens=16,
        calib_tokens=64,
        checkpoint_path="interop/modelopt_nvfp4_experts/checkpoint",
    ),
    "01_end_to_end-mxfp4": dict(
        scheme="w_mxfp4_a_mxfp4",
        model_preset="tiny",
        num_tokens=16,
        calib_tokens=64,
        checkpoint_path="interop/quark_w_mxfp4_a_mxfp4/checkpoint",
    ),
    # a dummy gpt-oss at the tiny gpt-oss preset, in its native MXFP4 layout (weight-only: its one scheme)
    "01_end_to_end-gptoss": dict(scheme="w_mxfp4", model_preset="gpt-oss-tiny", num_tokens=16, calib_tokens=64),
    "02_microscaling_formats": dict(num_rows=16, row_length=1024),
    "03_scheme_comparison": dict(model_preset="tiny", calib_tokens=64),
    # 16 experts x 4 layers draw too few per-expert scales for sigma 1 to reach r < 2**-6 / 448: the tiny
    # run uses a wider spread, so that the subnormal-scale claims are exercised.
    "04_scale_unification": dict(
        model_preset="tiny",
        expert_spread=2.0,
        spreads=[0.0, 1.0, 2.0],
        calib_tokens=512,
        num_tokens=16,
        checkpoint_path="interop/llmc_nvfp4_experts/checkpoint",
    ),
    "05_fused_emulation_benchmark": dict(run_live="no", hw_model_preset="tiny", hw_tokens=16),
    # 06 and 07 run their quick runs, the settings their prose suggests (tests/test_notebook_settings.py): one
    # execution serves both files and tests/test_render.py
    "06_what_fp4_costs": SUGGESTED["06-quick"][1],
    "07_accuracy_recovery": SUGGESTED["07-quick"][1],
}


def notebook_of(entry: str) -> str:
    """The notebook an entry of ``NOTEBOOK_PARAMS`` runs (``01_end_to_end-nvfp4`` -> ``01_end_to_end``)."""
    return entry.split("-")[0]


def run_notebook(entry: str, executed_notebook) -> dict:
    """Execute (once per run) the notebook of ``NOTEBOOK_PARAMS[entry]`` and return its results JSON."""
    folder = executed_notebook(notebook_of(entry), NOTEBOOK_PARAMS[entry])
    return json.loads((folder / "results.json").read_text())


# the tests that read an execution tests/test_render.py renders share its xdist_group (named by the notebook)
@pytest.mark.parametrize("scheme", [pytest.param("nvfp4", marks=pytest.mark.xdist_group("01_end_to_end")), "mxfp4"])
def test_01_end_to_end(scheme, executed_notebook):
    res = run_notebook(f"01_end_to_end-{scheme}", executed_notebook)
    assert res["model_preset"] == "tiny" and res["num_hidden_layers"] == 4
    logit = res["logits"]
    assert 15.0 < logit["sqnr_db"] < 60.0, logit  # lossy, but far from broken
    assert logit["top1_agreement"] >= 0.6, logit
    # the KL bar is relative to the negative control: every token set's working KL under a quarter of the
    # broken model's smallest, which a fixed bar of 0.02 nats would not be (the broken model's KL is ~0.003 here)
    kl, kl_broken = res["logits_repeats"]["kl_divergence"], res["swapped_nibbles_repeats"]["kl_divergence"]
    assert res["repeats"] == 3 and len(kl) == len(kl_broken) == 3
    assert max(kl) < res["kl_bar"] == min(kl_broken) / 4 and max(kl_broken) < 0.02, (kl, kl_broken)
    assert all(w > b for w, b in zip(res["logits_repeats"]["sqnr_db"], res["swapped_nibbles_repeats"]["sqnr_db"]))
    assert len(res["layers"]) == 4 and all(15.0 < r["sqnr_db"] < 60.0 for r in res["layers"]), res["layers"]
    assert res["checkpoint_bytes"] > 0
    moe = res["moe_block_0_sqnr_db"]  # the negative control: a scrambled MoE block gives ~-3 dB
    assert moe["swapped nibbles"] < 3.0 and moe["working"] > moe["swapped nibbles"] + 8.0, moe
    assert res["swapped_nibbles_logits"]["sqnr_db"] < logit["sqnr_db"], res["swapped_nibbles_logits"]
    assert res["bf16_rounding_sqnr_db"] > 40.0
    # what ran: every layer's experts in the checkpoint's scheme, a1 and a2 each QDQ'd once in the forward
    ran = res["what_ran"]
    assert [r["module"] for r in ran] == [f"model.layers.{i}.mlp.experts" for i in range(4)], ran
    assert all((r["scheme"], r["a1_passes"], r["a2_passes"]) == (res["scheme"], 1, 1) for r in ran), ran
    # section 5: the same checkpoint in vLLM's numerics and the hardware's
    modes = res["numerics_modes"]
    assert res["numerics"] == "vllm" and len(modes["sets"]) == 3 and len(modes["layers"]) == 4
    if scheme == "mxfp4":  # OCP MX: the same operands in both modes, the same bits
        assert all(r["max_abs_diff"] == 0.0 for r in modes["sets"]), modes["sets"]
    else:  # NVFP4: different outputs, neither mode closer to bf16 (mxlib.stats cannot tell them apart)
        assert all(r["max_abs_diff"] > 0.0 for r in modes["sets"]), modes["sets"]
    verdicts = {(r["a"], r["b"]): r["verdict"] for r in res["orderings"]}  # the notebook's family, decided together
    expected = {("working", "swapped nibbles"): "working better"}
    if scheme == "nvfp4":
        expected[("vllm", "hardware")] = "cannot be told apart"
    assert verdicts == expected, res["orderings"]
    own = res["own_checkpoint"]  # section 6 on a producer-made checkpoint: ModelOpt's NVFP4, Quark's MXFP4
    assert own["scheme"] == {"nvfp4": "nvfp4", "mxfp4": "w_mxfp4_a_mxfp4"}[scheme] and own["num_layers"] == 2
    assert all(8.0 < r["sqnr_db"] < 30.0 for r in own["layers"]), own["layers"]


def test_01_end_to_end_gpt_oss(executed_notebook):
    """Notebook 01 on the dummy gpt-oss (expert biases, SWIGLUOAI) in gpt-oss's own MXFP4 layout: its checks
    cell passed, and its results restated here."""
    res = run_notebook("01_end_to_end-gptoss", executed_notebook)
    assert res["model_preset"] == "gpt-oss-tiny" and res["scheme"] == "w_mxfp4" and res["num_hidden_layers"] == 4
    logit = res["logits"]
    assert 15.0 < logit["sqnr_db"] < 60.0 and logit["top1_agreement"] >= 0.6, logit
    assert len(res["layers"]) == 4 and all(15.0 < r["sqnr_db"] < 60.0 for r in res["layers"]), res["layers"]
    moe = res["moe_block_0_sqnr_db"]  # the negative control catches scrambled expert weights under intact biases
    assert moe["swapped nibbles"] < 3.0 and moe["working"] > moe["swapped nibbles"] + 8.0, moe
    # weight-only OCP MX: the same operands in vLLM's numerics and the hardware's, the same bits
    assert all(r["max_abs_diff"] == 0.0 for r in res["numerics_modes"]["sets"]), res["numerics_modes"]["sets"]
    skipped = res["skipped_schemes"]  # every other scheme listed, with its reason
    assert "w_mxfp4" not in skipped and "nvfp4" in skipped and "expert biases" in skipped["nvfp4"]


@pytest.mark.xdist_group("02_microscaling_formats")
def test_02_microscaling_formats(executed_notebook):
    res = run_notebook("02_microscaling_formats", executed_notebook)
    assert res["cases"] and all(c["ok"] for c in res["cases"]), res["cases"]
    assert res["scale_rules_957"] == [896.0, 896.0, 960.0]  # floor, even, rceil
    assert res["scale_rules_7"][:2] == [6.0, 8.0]  # floor clips, even moves up
    g = next(r for r in res["sqnr"] if r["distribution"] == "gaussian")
    assert 17 < g["mxfp4"] < 22, g  # 1 mantissa bit (the mean of the draws)
    # every ordering goes through the notebook's one family over the data draws: the mantissa ladder on Gaussian data
    # is decided even on the test's small draws
    assert res["num_draws"] == 4 and all(r["n"] == 4 for r in res["orderings"]), res["orderings"]
    verdicts = {r["key"]: r["verdict"] for r in res["orderings"]}
    ladder = (("mxfp6_e2m3", "mxfp6_e3m2"), ("mxfp6_e3m2", "mxfp4"), ("mxfp8_e4m3", "mxfp8_e5m2"), ("nvfp4", "mxfp4"))
    for a, b in ladder:
        assert verdicts[f"{a} vs {b} (global SQNR (dB) on gaussian)"] == f"{a} better", verdicts
    # the NVFP4 variants: a row each beside NVFP4 and MXFP4, orderings only where the paired interval says so
    v = {r["distribution"]: r for r in res["nvfp4_variants"]}
    assert set(v) == {"gaussian", "laplace", "outliers"}
    assert all("nvfp4_ue5m3" in r and "nvfp4_b32" in r for r in v.values()), v
    b32 = [r for r in res["nvfp4_variant_orderings"] if (r["a"], r["b"]) == ("nvfp4", "nvfp4_b32")]
    assert b32 and all(r["holds"] and r["high"] < 0 for r in b32), b32
    mid = [r for r in res["ue5m3_global_scale"] if 1e-3 <= r["amax"] <= 1e4]
    assert mid and all(abs(r["gs_buys_db"]) < 0.05 for r in mid), mid


@pytest.mark.xdist_group("03_scheme_comparison")
def test_03_scheme_comparison(executed_notebook):
    res = run_notebook("03_scheme_comparison", executed_notebook)
    by = {r["scheme"]: r for r in res["rows"]}
    from scipy import stats

    from mxlib.moe import MOE_SCHEMES

    assert len(by) == len(MOE_SCHEMES), sorted(by)  # every MoE scheme ran
    assert res["repeats"] == 3 and all(len(r["sqnr_db_repeats"]) == 3 for r in res["rows"])
    assert all(r["sqnr_db_low"] <= r["sqnr_db"] <= r["sqnr_db_high"] for r in res["rows"])
    assert all(10.0 < r["sqnr_db_low"] and r["sqnr_db_high"] < 60.0 and r["top1_agreement"] > 0.5 for r in res["rows"])
    # the verdicts recomputed apart from mxlib.stats: scipy's paired t over the token sets, Holm's steps by hand
    orderings = res["orderings"]
    p = [
        stats.ttest_1samp(
            [x - y for x, y in zip(by[o["a"]]["sqnr_db_repeats"], by[o["b"]]["sqnr_db_repeats"])], 0.0
        ).pvalue
        for o in orderings
    ]
    m, decided, order = len(p), set(), sorted(range(len(p)), key=lambda i: p[i])
    for rank, i in enumerate(order):
        if p[i] > 0.05 / (m - rank):
            break
        decided.add(i)
    verdict = {}
    for i, o in enumerate(orderings):
        want = "cannot be told apart"
        if i in decided:
            want = f"{o['a']} better" if o["difference"] > 0 else f"{o['b']} better"
        assert o["verdict"] == want, (o, p[i])
        verdict[(o["a"], o["b"])] = verdict[(o["b"], o["a"])] = o["verdict"]
    assert len(orderings) == 11
    # never decided the other way: MXFP6 weights, more mantissa bits in the activations, e3m2, NVFP4, MXFP8 weights
    for a, b in (
        ("w_mxfp6_e2m3", "w_mxfp4"),
        ("w_mxfp6_e3m2", "w_mxfp4"),
        ("w_mxfp4", "w_mxfp4_a_mxfp4"),
        ("w_mxfp4_a_fp8", "w_mxfp4_a_mxfp4"),
        ("w_mxfp4_a_mxfp6_e2m3", "w_mxfp4_a_mxfp4"),
        ("w_mxfp4_a_mxfp6_e3m2", "w_mxfp4_a_mxfp4"),
        ("nvfp4", "w_mxfp4_a_mxfp4"),
        ("w_mxfp6_e2m3", "w_mxfp8"),
    ):
        assert verdict[(a, b)] != f"{b} better", (a, b, verdict[(a, b)])
    e3m2 = by["w_mxfp4_a_mxfp6_e3m2"]["sqnr_db"] - by["w_mxfp4_a_mxfp4"]["sqnr_db"]
    assert -1.0 < e3m2 < 2.5
    assert by["nvfp4"]["bits_per_weight"] == 4.5 and by["w_mxfp4"]["bits_per_weight"] == 4.25
    assert by["w_mxfp6_e3m2"]["checkpoint_gb"] > by["w_mxfp4"]["checkpoint_gb"]
    assert all(len(r["layer_sqnr_db"]) == 4 for r in res["rows"])


@pytest.mark.xdist_group("04_scale_unification")
def test_04_scale_unification(executed_notebook):
    res = run_notebook("04_scale_unification", executed_notebook)
    summary = {(r["point"], r["strategy"]): r for r in res["summary"]}
    for point in ("a1", "a2"):
        per, mx = summary[(point, "per_expert")], summary[(point, "max")]
        assert per["mean_db_lost"] == 0.0 and per["flushed_blocks"] == 0.0  # against itself
        assert mx["worst_db_lost"] >= mx["mean_db_lost"]
        assert (
            summary[(point, "OCP MXFP8 e4m3 (no global scale)")]["mean_sqnr_db"]
            > summary[(point, "OCP MXFP4 (no global scale)")]["mean_sqnr_db"]
        )
    assert summary[("a2", "max")]["worst_db_lost"] > 1.0  # some expert sits below r = 2**-6 / 448
    a2 = [r for r in res["spread"] if r["point"] == "a2"]
    assert [r["spread"] for r in a2] == [0.0, 1.0, 2.0]
    assert a2[-1]["mean_db_lost"] == max(r["mean_db_lost"] for r in a2)
    assert a2[-1]["max_db_lost"] > a2[0]["max_db_lost"] + 1  # the worst case saturates: no strict order asserted
    # a1 is the normalized layer input: the spread (a scale on w13 and w2) changes none of its rows
    a1 = [{k: v for k, v in r.items() if k != "spread"} for r in res["spread"] if r["point"] == "a1"]
    assert len(a1) == 3 and all(r == a1[0] for r in a1), a1
    e2e = {r["strategy"]: r["sqnr_db"] for r in res["end_to_end"]}
    assert set(e2e) == {"max", "per_expert", "median", "p90", "mean"}
    assert all(v > 5 for v in e2e.values()), e2e
    assert e2e["per_expert"] >= e2e["max"] - 0.5 and e2e["median"] < e2e["max"], e2e
    # the routing-balance bar, scaled to 16 experts: every layer routes to at least 15 experts, none above 3x uniform
    assert len(res["routing"]) == 4
    assert all(r["experts_hit"] >= 15 and r["max_over_uniform"] <= 3.0 for r in res["routing"]), res["routing"]
    own = res["own_checkpoint"]  # section 6 on llm-compressor's NVFP4 export, whose a2 scales differ per expert
    assert own["format"] == "compressed-tensors" and own["num_layers"] == 2
    lost = {(r["layer"], r["strategy"]): r["db_lost"] for r in own["strategies"]}
    assert all(lost[(li, "per_expert")] == 0.0 for li in (0, 1)) and set(s for _, s in lost) == set(e2e)
    assert {(r["point"], r["strategy"]) for r in own["predicted"]} >= {("a2", "max"), ("a2", "per_expert")}


@pytest.mark.xdist_group("05_fused_emulation_benchmark")
def test_05_fused_emulation_benchmark(executed_notebook):
    res = run_notebook("05_fused_emulation_benchmark", executed_notebook)
    assert res["numerics_rel_err"]["fused"] < 5e-3 and res["numerics_rel_err"]["triton"] < 5e-3, res["numerics_rel_err"]
    assert res["recorded_max_fused_vs_dequant_rel_err"] < 1e-2
    assert set(res["model_layers"]) >= {4, 48}
    # every "faster" decided against the recorded timing noise: three verdicts, the ratio inside its interval
    faster = {(r["a"], r["b"], r["M"]): r for r in res["faster"]}
    assert ("mxlib_fused_w_mxfp4", "tk_mxfp4_unfused_silu", 64) in faster and ("nvfp4@fused", "bf16", 1024) in faster
    for (a, b, _), r in faster.items():
        assert r["verdict"] in (f"{a} faster", f"{b} faster", "cannot be told apart"), r
        assert r["ratio_low"] <= r["time_ratio"] <= r["ratio_high"], r
    assert faster[("nvfp4@fused", "bf16", 1024)]["verdict"] == "cannot be told apart"
    assert all(0.001 < v["sd"] < 0.02 and v["df"] >= 20 for v in res["timing_noise"].values()), res["timing_noise"]
    assert len(res["externals_bf16_over_vllm"]) == 7 and max(res["externals_bf16_over_vllm"]) <= 1.05
    assert res["externals_checks_passed"] >= 120  # 77 ratio checks among them (11 ratios x 7 M)
    # section 6: vLLM vs hardware numerics, each MoE layer against float64 on the same operands, and the logits
    assert res["hw_model_preset"] == "tiny" and res["vllm_vs_hardware_checks_passed"] >= 30
    nv, mx = res["vllm_vs_hardware"]["nvfp4"], res["vllm_vs_hardware"]["w_mxfp4_a_mxfp4"]
    assert len(nv["layers"]) == len(mx["layers"]) == res["hw_layers"]
    for r in nv["layers"]:
        assert r["hw_vs_ref_sqnr_db"] > 45.0 and r["hw_vs_ref_sqnr_db"] > r["vllm_vs_ref_sqnr_db"] + 10.0, r
        assert r["control_vllm_sqnr_db"] > r["control_hw_sqnr_db"] + 10.0, r
    assert all(r["vllm_vs_hw_sqnr_db"] == float("inf") for r in mx["layers"]) and mx["logits"]["max_abs_diff"] == 0.0
    assert nv["logits"]["max_abs_diff"] > 0.0


@pytest.mark.xdist_group(SHARED["06-quick"])
def test_06_what_fp4_costs(executed_notebook):
    res = run_notebook("06_what_fp4_costs", executed_notebook)
    params = NOTEBOOK_PARAMS["06_what_fp4_costs"]
    assert res["recipe"] == "test" and res["tasks"] == ["reverse", "count"] and res["eval_prompts"] == 150
    shipped = json.loads((tr.SHIPPED_DIR / "test" / "manifest.json").read_text())
    assert res["training"]["shipped"] and res["training"]["sha256"] == shipped["sha256"]  # the shipped model, read
    for t, r in res["bf16"].items():
        assert r["exact_match"]["estimate"] >= 0.95 and r["prompts"] == 150, (t, r)
    for t, f in res["noise_floor"].items():
        assert f["exact_match"] <= res["noise_floor_bound"]["exact_match"], (t, f)
        assert f["nll_per_token"] <= res["noise_floor_bound"]["nll_per_token"], (t, f)
    rows = {(r["scheme"], r["task"]): r for r in res["schemes"]}
    assert {s for s, _ in rows} == {"bf16", *params["schemes"]} and len(rows) == 2 * 3
    assert (
        rows[("nvfp4", "count")]["bits_per_weight"] == 4.5
        and rows[("w_mxfp4_a_mxfp4", "count")]["bits_per_weight"] == 4.25
    )
    assert all(
        r["checkpoint_bytes"] < rows[("bf16", "count")]["checkpoint_bytes"]
        for r in res["schemes"]
        if r["scheme"] != "bf16"
    )
    for r in res["schemes"] + res["strategies"]:
        assert r["exact_match_low"] <= r["exact_match"] <= r["exact_match_high"], r
        assert r["exact_match"] >= 0.8, r  # a quantized model still answers the easy tasks
        if r["loses"] or r["gains"]:
            assert not r["delta_low"] <= 0 <= r["delta_high"], r
    strat = {(r["strategy"], r["task"]): r for r in res["strategies"]}
    assert set(strat) == {(s, t) for s in params["strategies"] for t in res["tasks"]}
    assert "vs_exact_match" in strat[("per_expert", "count")] and "vs_exact_match" not in strat[("max", "count")]
    # max through the loader is the scheme table's nvfp4 run: the same checkpoint, the same outcome
    assert strat[("max", "count")]["exact_match"] == rows[("nvfp4", "count")]["exact_match"]
    control = res["negative_control"]
    assert {r["control"] for r in control} == {"swapped nibbles", "reciprocal global scale"} and all(
        r["loses"] for r in control
    )
    assert all(r["exact_match"] < 0.5 for r in control if r["control"] == "reciprocal global scale"), control
    assert len(res["routing"]) == 2 * 2 and all(r["differs"] for r in res["routing"]), res["routing"]
    a2 = next(r for r in res["amax_summary"] if r["point"] == "a2")
    assert (
        a2["experts"] > 0
        and 0 < a2["min_ratio"] <= 1
        and a2["max_subnormal_blocks_per_expert"] <= a2["max_subnormal_blocks_max"]
    )
    assert res["checks_passed"] >= 20
    # per-token scales need no calibration: a model that answers, beside the static strategies
    assert all(strat[("per_token", t)]["exact_match"] >= 0.8 for t in res["tasks"]), strat
    # section 7: one attributed scheme, its decompositions' sums exact
    assert res["attribution_sums_exact"] and len(res["attribution"]) == len(params["attribution_schemes"])
    # routing consistency: the first MoE layer routes as bf16 under every scheme; the second moves tokens to other
    # experts beyond the noise floor (another experts implementation of bf16), decided by the notebook's family
    rc = res["routing_consistency"]
    assert {(r["scheme"], r["layer"]) for r in rc} == {(s, layer) for s in params["schemes"] for layer in (0, 1)}
    for r in rc:
        if r["layer"] == 0:
            assert r["jaccard"] == 1.0 and r["share_changed"] == 0.0 and r["verdict"] == "cannot be told apart", r
        else:
            assert r["verdict"] == "bf16 better" and r["noise_floor"] < r["share_changed"] and r["jaccard"] < 1.0, r
    assert {r["variant"] for r in res["routing_noise_floor"]} == {"eager_experts", "triton_experts_torch"}
    assert all(r["share_changed"] <= 0.01 for r in res["routing_noise_floor"]), res["routing_noise_floor"]


@pytest.mark.xdist_group(SHARED["07-quick"])
def test_07_accuracy_recovery(executed_notebook):
    res = run_notebook("07_accuracy_recovery", executed_notebook)
    from mxlib.studies.recovery import technique_names

    names = list(technique_names(NOTEBOOK_PARAMS["07_accuracy_recovery"]["techniques"]))
    assert res["recipe"] == "test" and res["techniques"] == names and res["schemes"] == ["nvfp4", "w_mxfp4_a_mxfp4"]
    # section 2: the draws' means as the rows report them, and the family's verdicts in the directions the prose gives
    trap = {(r["format"], r["points"]): r for r in res["rotation_trap"]}
    assert set(trap) == {(f, n) for f in ("nvfp4", "mxfp4") for n in (16, 128)}
    assert all(r["draws"] == 4 for r in trap.values()), trap
    for (f, n), r in trap.items():
        gemm = [d["gemm_rel_error"] for d in res["trap_draws"] if d["format"] == f and d["points"] == n]
        assert len(gemm) == 4 and r["rotated_gemm_rel_error"] == pytest.approx(sum(gemm) / 4), r
    verdict = {(v["a"], v["metric"]): v for v in res["trap_verdicts"]}
    assert len(verdict) == 16, sorted(verdict)
    for n in (16, 128):  # MXFP4's outliers: decided better stored under either rotation at this size too
        v = verdict[(f"mxfp4 rotated {n}", "outlier channels' relative error")]
        assert v["verdict"] == f"mxfp4 rotated {n} better" and v["difference"] < 0, v
        v = verdict[(f"nvfp4 rotated {n}", "other channels' SQNR (dB)")]
        assert v["verdict"] == "nvfp4 plain better" and v["difference"] < 0, v
    ratio = res["trap_amax_over_scale"]
    assert 3.5 <= ratio["mxfp4"]["min"] and ratio["mxfp4"]["max"] < 7 and ratio["nvfp4"]["min"] >= 5.666, ratio
    done = {(r["scheme"], r["technique"]) for r in res["dummy"]}
    refused = {(r["scheme"], r["technique"]) for r in res["skipped"]["dummy"]}
    assert done | refused == {(s, t) for s in res["schemes"] for t in [*names, "scale_step_up", "swapped_nibbles"]}, (
        sorted(done)
    )
    assert not done & refused and {t for _, t in done} == {*names, "scale_step_up", "swapped_nibbles"}
    assert {(r["scheme"], r["technique"]) for r in res["trained"]} == done
    for r in res["dummy"] + res["trained"]:
        assert r["online"] or r["same_kernel_path"], r  # scales and codes only: round-to-nearest's kernels
    for r in res["dummy"]:
        assert len(r["layer_sqnr_db"]) == 2 and all(3 < v < 60 for v in r["layer_sqnr_db"]), r
    control = [r for r in res["trained"] if r["technique"] == "swapped_nibbles"]
    assert control and all(r["vs_nll_beyond"] and r["vs_nll"] > 0 for r in control), control  # the intervals see it
    assert [(r["scheme"], r["technique"]) for r in res["table"]] == [
        (s, t) for s in res["schemes"] for t in [*names, "scale_step_up", "swapped_nibbles"] if (s, t) in done
    ]
    assert res["checks_passed"] >= 20
