"""Notebook 07's studies (mxlib.studies.recovery, recovery_measures) on round-to-nearest and a worse technique.

The techniques of ``mxlib.recovery`` beyond ``rtn`` are not needed here: the study is generic over
technique names, so it is tested with ``rtn``, with ``ScaleStepUp`` (every block scale one step up,
worse by construction) and with test-local techniques (a wrapper with an ``inner`` technique, a factory
that takes ``hessians``). The oracles are independent of the code under test: ml_dtypes' e2m1 / e4m3
casts and numpy for dequantization and rounding, Sylvester's closed form for the Hadamard matrix,
means of the per-prompt outcomes for the paired differences.
"""

import math
from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest
import torch

from mxlib.models import evaluation as ev
from mxlib.models.qwen3 import dummy_qwen3_moe, qwen3_30b_a3b_config
from mxlib.moe.factory import quantize_expert_weights
from mxlib.moe.schemes import get_moe_scheme
from mxlib.recovery import TECHNIQUES, RoundToNearest
from mxlib.studies import accuracy as A
from mxlib.studies import recovery as RC
from mxlib.studies import recovery_measures as M

from _util import TINY_QWEN3


def _w(e=2, i=32, h=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(e, 2 * i, h, generator=g) * 0.05).bfloat16(), (
        torch.randn(e, h, i, generator=g) * 0.05
    ).bfloat16()


# ----------------------------------------------------------------------------- oracles


def _unpack_fp4(packed: torch.Tensor) -> np.ndarray:
    b = packed.numpy().astype(np.uint8)
    codes = np.stack([b & 0xF, b >> 4], axis=-1).reshape(*b.shape[:-1], b.shape[-1] * 2)
    return codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)  # one code per byte, read as e2m1


def _oracle_scales(q, which: str) -> np.ndarray:
    """Each block's applied scale from the stored bytes: E8M0 2^(b-127), or e4m3 x weight_scale_2 (fp32)."""
    scale = getattr(q, f"{which}_weight_scale")
    if q.scheme.has_global_scale:
        s = scale.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        return s * getattr(q, f"{which}_weight_scale_2").numpy().astype(np.float32)[:, None, None]
    return np.ldexp(np.float32(1), scale.numpy().astype(np.int32) - 127).astype(np.float32)


def _oracle_dequant(q, which: str) -> np.ndarray:
    """Dequantized weights from the stored bytes: e2m1 values x the block's scale."""
    vals = _unpack_fp4(getattr(q, f"{which}_weight"))
    return vals * np.repeat(_oracle_scales(q, which), q.scheme.block_size, axis=-1)


@pytest.mark.parametrize("scheme", ["nvfp4", "w_mxfp4_a_mxfp4"])
def test_dequantize_weights_and_weight_error_against_ml_dtypes(scheme):
    w13, w2 = _w()
    q = quantize_expert_weights(w13, w2, get_moe_scheme(scheme))
    d13, d2 = M.dequantize_weights(q)
    np.testing.assert_array_equal(d13.numpy(), _oracle_dequant(q, "w13"))
    np.testing.assert_array_equal(d2.numpy(), _oracle_dequant(q, "w2"))
    err = M.weight_error(q, w13, w2)
    o13 = ((_oracle_dequant(q, "w13").astype(np.float64) - w13.float().numpy()) ** 2).mean()
    o2 = ((_oracle_dequant(q, "w2").astype(np.float64) - w2.float().numpy()) ** 2).mean()
    assert err["w13_mse"] == pytest.approx(o13, rel=1e-12) and err["w2_mse"] == pytest.approx(o2, rel=1e-12)
    assert err["mse"] == pytest.approx((o13 * w13.numel() + o2 * w2.numel()) / (w13.numel() + w2.numel()), rel=1e-12)
    assert err["sqnr_db"] == pytest.approx(10 * math.log10(err["energy"] / err["mse"]), rel=1e-12)


@pytest.mark.parametrize("scheme", ["nvfp4", "w_mxfp4_a_mxfp4"])
def test_scale_step_up_is_rtn_at_twice_the_scale_and_worse(scheme):
    w13, w2 = _w(seed=3)
    s = get_moe_scheme(scheme)
    rtn = quantize_expert_weights(w13, w2, s)
    up = M.ScaleStepUp().quantize_experts(w13, w2, s, layer=0)
    for which, w in (("w13", w13), ("w2", w2)):
        if s.weight.has_global_scale:  # block scales kept, the global scale doubled
            assert torch.equal(
                getattr(up, f"{which}_weight_scale").view(torch.uint8),
                getattr(rtn, f"{which}_weight_scale").view(torch.uint8),
            )
            assert torch.equal(getattr(up, f"{which}_weight_scale_2"), 2 * getattr(rtn, f"{which}_weight_scale_2"))
        else:  # every E8M0 exponent one up (none is near 254 here)
            assert torch.equal(getattr(up, f"{which}_weight_scale"), getattr(rtn, f"{which}_weight_scale") + 1)
        # the codes: x / scale rounded to nearest e2m1 (ties to even) by ml_dtypes, at the stored scale
        full = np.repeat(_oracle_scales(up, which), s.weight.block_size, axis=-1)
        x = w.float().numpy()
        expect = (x / full).astype(ml_dtypes.float4_e2m1fn).astype(np.float32) * full
        np.testing.assert_array_equal(_oracle_dequant(up, which), expect)
    assert M.weight_error(up, w13, w2)["mse"] > 1.2 * M.weight_error(rtn, w13, w2)["mse"]


def test_swapped_nibbles_swaps_every_packed_byte():
    w13, w2 = _w(seed=6)
    for scheme in ("nvfp4", "w_mxfp4_a_mxfp4"):
        s = get_moe_scheme(scheme)
        rtn = quantize_expert_weights(w13, w2, s)
        bad = M.SwappedNibbles().quantize_experts(w13, w2, s, layer=0)
        for which in ("w13", "w2"):
            b = getattr(rtn, f"{which}_weight").numpy()
            np.testing.assert_array_equal(getattr(bad, f"{which}_weight").numpy(), (b << 4 | b >> 4).astype(np.uint8))
            assert torch.equal(
                getattr(bad, f"{which}_weight_scale").view(torch.uint8),
                getattr(rtn, f"{which}_weight_scale").view(torch.uint8),
            )


def test_block_changes_of_the_control_are_every_block_times_two():
    w13, w2 = _w(seed=4)
    for scheme in ("nvfp4", "w_mxfp4_a_mxfp4"):
        s = get_moe_scheme(scheme)
        rtn = quantize_expert_weights(w13, w2, s)
        same = M.block_changes(quantize_expert_weights(w13, w2, s), rtn)
        assert same["scales_changed"] == same["codes_changed"] == 0.0 and same["ratios"] == []
        assert sum(same["ratio_counts"]) == 0 and len(same["ratio_log2_edges"]) == M.RATIO_BINS + 1
        for steps in (1, 2):
            ch = M.block_changes(M.ScaleStepUp(steps).quantize_experts(w13, w2, s, layer=0), rtn)
            assert ch["scales_changed"] == 1.0 and ch["ratios"] == [2.0**steps] and 0 < ch["codes_changed"] <= 1
            blocks = (w13.numel() + w2.numel()) // s.weight.block_size
            edges = ch["ratio_log2_edges"]
            hit = [i for i, c in enumerate(ch["ratio_counts"]) if c]
            assert (
                ch["ratio_counts"][hit[0]] == blocks and len(hit) == 1 and edges[hit[0]] <= steps <= edges[hit[0] + 1]
            )


class _Negated:
    """A test-local rotation-like technique: the weights negated (an orthonormal change of basis), then ``inner``."""

    name = "negated"

    def __init__(self, inner=None):
        self.inner = inner or RoundToNearest()

    def quantize_experts(self, w13, w2, scheme, *, layer):
        return self.inner.quantize_experts(-w13, -w2, scheme, layer=layer)

    def config(self):
        return {"negated": True}


def test_measured_technique_records_the_stored_basis_and_restores_the_chain():
    w13, w2 = _w(seed=5)
    s = get_moe_scheme("w_mxfp4_a_mxfp4")
    plain = M.MeasuredTechnique(RoundToNearest(), keep=(0,))
    q = plain.quantize_experts(w13, w2, s, layer=0)
    assert plain.errors[0] == {**M.weight_error(q, w13, w2), "energy_ratio": 1.0} and plain.seconds[0] > 0
    assert plain.weights[0] is q and plain.name == "rtn" and plain.config() == {}
    inner = RoundToNearest()
    tech = _Negated(inner)
    wrapped = M.MeasuredTechnique(tech)
    q = wrapped.quantize_experts(w13, w2, s, layer=1)
    assert tech.inner is inner  # the recorder is taken out again
    assert wrapped.errors[1]["mse"] == M.weight_error(q, -w13, -w2)["mse"]  # against what inner was given
    assert wrapped.errors[1]["mse"] < 0.5 * M.weight_error(q, w13, w2)["mse"]  # not against the original basis
    assert (
        wrapped.errors[1]["energy_ratio"] == 1.0 and wrapped.name == "negated" and wrapped.config() == {"negated": True}
    )
    assert 1 not in wrapped.weights


# ----------------------------------------------------------------------------- the rotation lesson


def test_random_sign_hadamard_against_sylvester_closed_form():
    for n in (1, 2, 16, 128):
        i = np.arange(n)
        closed = np.where(np.vectorize(lambda v: bin(v).count("1") % 2)(i[:, None] & i[None, :]) == 1, -1.0, 1.0)
        np.testing.assert_array_equal(
            M.random_sign_hadamard(n, None).numpy(), (closed / math.sqrt(n)).astype(np.float32)
        )
        h = M.random_sign_hadamard(n, 7).double()
        torch.testing.assert_close(h @ h.T, torch.eye(n, dtype=torch.float64), rtol=0, atol=1e-6)
        signs = (h * math.sqrt(n) / torch.tensor(closed)).round()
        assert torch.all(signs == signs[:, :1]) and set(signs[:, 0].tolist()) <= {-1.0, 1.0}  # one sign per row
    with pytest.raises(ValueError, match=r"n: expected a power of two >= 1, got 12"):
        M.random_sign_hadamard(12)
    with pytest.raises(ValueError, match="not a multiple of the rotation's 16 points"):
        M.block_rotate(torch.zeros(2, 24), M.random_sign_hadamard(16))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    h = M.random_sign_hadamard(32, 1)
    torch.testing.assert_close(M.block_rotate(M.block_rotate(x, h), h.T), x, rtol=0, atol=1e-5)


def test_outlier_layer_holds_its_outliers_in_fixed_channels():
    layer = M.outlier_layer(256, 32, 4, 20.0, seed=3)
    idx = layer["outlier_idx"].tolist()
    assert idx == sorted(set(idx)) and len(idx) == 4
    a, b = M.layer_tokens(layer, 50, seed=1), M.layer_tokens(layer, 50, seed=2)
    for x in (a, b):  # the same channels in every token and every draw, the sign fixed per channel
        big = x.abs() > 8
        assert torch.equal(big.any(0), big.all(0)) and big.any(0).nonzero().flatten().tolist() == idx
        assert torch.equal(torch.sign(x[:, layer["outlier_idx"]]), layer["outlier_sign"].expand(50, 4))
    assert not torch.equal(a, b) and layer["weight"].shape == (32, 256)
    with pytest.raises(ValueError, match="outlier_channels: expected at most channels=256, got 300"):
        M.outlier_layer(256, 32, 300, 20.0)
    with pytest.raises(ValueError, match="outlier_scale: expected a finite number > 0, got -1"):
        M.outlier_layer(256, 32, 4, -1)
    with pytest.raises(ValueError, match="tokens: expected an int >= 1, got 0"):
        M.layer_tokens(layer, 0, seed=0)


def test_amax_over_scale_lies_where_the_scale_rules_put_it():
    from mxlib import reference as R

    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(0)) * 3
    mx = M.amax_over_scale(x, "mxfp4")
    assert mx.shape == (64, 16) and mx.min() >= 3.5 and mx.max() < 7  # even rule: [3.5, 7)
    nv = M.amax_over_scale(x, "nvfp4")
    assert nv.shape == (64, 32) and nv.min() >= 6 * 17 / 18 * (1 - 1e-6) and nv.max() <= 6 * 17 / 16 * (1 + 1e-6)
    # the block holding the tensor's amax maps it to 6 (v = 448 exactly), and QDQ stores it as 6 * scale
    top = x.abs().reshape(64, 32, 16).amax(-1).argmax()
    assert nv.flatten()[top] == pytest.approx(6.0, rel=1e-6)
    q = R.quant_dequant(x, "nvfp4")
    flat = x.flatten().abs().argmax()
    assert q.flatten()[flat].abs() == pytest.approx(x.flatten()[flat].abs().item(), rel=1e-6)


def test_rotation_trap_measures_against_a_float64_oracle_and_feeds_the_family():
    from mxlib import reference as R
    from mxlib.stats import ComparisonFamily

    layer = M.outlier_layer(512, 16, 4, 20.0, seed=0)
    trap = M.rotation_trap(layer, tokens=16, draws=3, points=(16,), seed=0)
    # draw 0, MXFP4 plain, recomputed here: the GEMM output's relative error in float64
    x = M.layer_tokens(layer, 16, 1)
    xq, wq = R.quant_dequant(x, "mxfp4"), R.quant_dequant(layer["weight"], "mxfp4")
    ref = x.double() @ layer["weight"].double().T
    want = float(torch.linalg.norm(xq.double() @ wq.double().T - ref) / torch.linalg.norm(ref))
    row = next(r for r in trap["draws"] if (r["format"], r["points"], r["draw"]) == ("mxfp4", 0, 0))
    assert row["gemm_rel_error"] == pytest.approx(want, rel=1e-12)
    out = torch.zeros(512, dtype=torch.bool)
    out[layer["outlier_idx"]] = True
    other = float(((x[:, ~out].double()) ** 2).sum() / ((xq[:, ~out].double() - x[:, ~out].double()) ** 2).sum())
    assert row["other_sqnr_db"] == pytest.approx(10 * math.log10(other), rel=1e-12)
    assert M.trap_series(trap["draws"], "mxfp4", 0, "gemm_rel_error")[0] == row["gemm_rel_error"]
    assert len(trap["draws"]) == 3 * 2 * 2 and [(r["format"], r["points"]) for r in trap["rows"]] == [
        ("nvfp4", 16),
        ("mxfp4", 16),
    ]
    family = ComparisonFamily("trap")
    keys = M.add_trap_comparisons(family, trap)
    assert len(keys) == 2 * len(M.TRAP_METRICS)
    d = family.decide()
    v = d[keys[-1]]
    assert (v.a, v.b, v.metric, v.n) == ("mxfp4 rotated 16", "mxfp4 plain", "GEMM output relative error", 3)
    assert v.smallest == M.trap_noise(trap["draws"], "mxfp4", "gemm_rel_error") > 0
    with pytest.raises(ValueError, match="draws: expected an int >= 2, got 1"):
        M.rotation_trap(layer, tokens=4, draws=1)
    with pytest.raises(ValueError, match=r"points: expected powers of two dividing channels=512, got 24"):
        M.rotation_trap(layer, tokens=4, draws=2, points=(24,))


# ----------------------------------------------------------------------------- names and parameters


def test_technique_names_resolve_against_the_registry(monkeypatch):
    assert RC.technique_names("rtn") == ("rtn",)
    assert RC.technique_names("all")[0] == "rtn" and set(RC.technique_names("all")) >= set(TECHNIQUES)
    monkeypatch.setitem(TECHNIQUES, "negated", _Negated)
    assert RC.technique_names(" negated , rtn ") == ("rtn", "negated")
    with pytest.raises(ValueError, match=r"techniques: \['nope'\] not registered .*'negated', 'rtn'"):
        RC.technique_names("rtn,nope+negated")
    with pytest.raises(ValueError, match="techniques: expected 'all' or names"):
        RC.technique_names("")
    assert not RC.needs_hessians("negated")

    def with_hessians(hessians=None):
        t = RoundToNearest()
        t.hessians = hessians
        return t

    monkeypatch.setitem(TECHNIQUES, "needy", with_hessians)
    assert RC.needs_hessians("needy") and RC.needs_hessians("negated+needy")
    with pytest.raises(ValueError, match="hessians: technique 'needy' needs calibration Hessians"):
        RC.build_technique("needy")
    assert RC.build_technique("needy", hessians="H").hessians == "H"
    with pytest.raises(ValueError, match="dummy_top_k: expected at most dummy_experts=2, got 4"):
        RC.check_recovery_parameters(techniques="rtn", dummy_experts=2, dummy_top_k=4)
    with pytest.raises(ValueError, match=r"dummy_preset: expected one of \[.*'tiny'.*got 'huge'"):
        RC.check_recovery_parameters(techniques="rtn", dummy_preset="huge")
    with pytest.raises(ValueError, match="dummy_tokens: expected an integer from 1 to 40960 tokens .*0 is below"):
        RC.check_recovery_parameters(techniques="rtn", dummy_tokens=0)
    p = RC.check_recovery_parameters(recipe="test", techniques="negated")
    assert p.techniques == ("rtn", "negated") and [s.name for s in p.schemes] == ["nvfp4", "w_mxfp4_a_mxfp4"]


# ----------------------------------------------------------------------------- the studies


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The test recipe's trained model (reverse and count)."""
    p = RC.check_recovery_parameters(recipe="test", techniques="rtn", eval_prompts=64, calib_prompts=16, resamples=200)
    p = replace(p, accuracy=replace(p.accuracy, experts_backend="torch"))
    model = A.trained_model(p.accuracy, cache_dir=tmp_path_factory.mktemp("trained"), log=None)
    return model, p


def test_trained_study_separates_a_worse_technique_and_not_rtn(trained):
    model, p = trained
    sets, calib = A.evaluation_sets(p.accuracy), A.calibration_sets(p.accuracy)
    cal = A.calibrate_on_training_mix(model, p.accuracy)
    reference = ev.evaluate(model, sets, resamples=p.accuracy.resamples)
    noise_floor = {t: dict(A.NOISE_FLOOR_BOUND) for t in p.accuracy.tasks}  # the stated bound of every noise floor
    extra = {"swapped_nibbles": M.SwappedNibbles(), "rtn_again": RoundToNearest()}
    out = RC.trained_study(model, sets, cal, calib, reference, noise_floor, p, extra_techniques=extra, log=None)
    rows = {(r["scheme"], r["technique"], r["task"]): r for r in out["rows"]}
    assert {(s, t) for s, t, _ in rows} == {
        (s.name, t) for s in p.schemes for t in ("rtn", "swapped_nibbles", "rtn_again")
    }
    for (s, t, task), r in rows.items():
        assert r["same_kernel_path"] and not r["online"] and r["quantize_seconds"] > 0
        if t == "rtn":
            assert "vs_exact_match" not in r
            continue
        # the paired difference against rtn, from the per-prompt outcomes
        a, b = out["results"][(s, "rtn")].tasks[task], out["results"][(s, t)].tasks[task]
        em = float(b.correct.double().mean() - a.correct.double().mean())
        assert r["vs_exact_match"] == pytest.approx(em, abs=1e-12)
        nll = float(b.nll.sum() / b.tokens.sum() - a.nll.sum() / a.tokens.sum())
        assert r["vs_nll"] == pytest.approx(nll, rel=1e-9, abs=1e-12)
        assert r["vs_low"] <= r["vs_exact_match"] <= r["vs_high"]
        if t == "rtn_again":  # the same checkpoint bytes: nothing to separate
            assert r["vs_exact_match"] == 0 and r["vs_nll"] == 0 and not r["vs_beyond"] and not r["vs_nll_beyond"]
        else:
            assert r["weight_mse"] > rows[(s, "rtn", task)]["weight_mse"]
    worse = [r for r in out["rows"] if r["technique"] == "swapped_nibbles"]
    # every task loses beyond the noise floor against rtn, in NLL
    assert all(r["vs_nll_beyond"] and r["vs_nll"] > 0 for r in worse), [(r["task"], r["vs_nll"]) for r in worse]
    stated = RC.claims(out["rows"], noise_floor)
    assert stated and all(c.startswith("swapped_nibbles (") for c in stated), stated
    assert any("raises the NLL" in c for c in stated)
    table = RC.side_by_side(out["rows"], [], p.accuracy.tasks[0])
    assert [(r["scheme"], r["technique"]) for r in table] == [
        (s.name, t) for s in p.schemes for t in ("rtn", "swapped_nibbles", "rtn_again")
    ]
    assert table[0]["vs_rtn"] == "(baseline)" and all(r["run_time"] == "same kernels" for r in table)


def test_dummy_study_measures_layers_and_kernel_paths():
    cfg = qwen3_30b_a3b_config(num_hidden_layers=2, **TINY_QWEN3)
    dummy = dummy_qwen3_moe(cfg, seed=1)
    p = RC.check_recovery_parameters(recipe="test", techniques="rtn", experts_backend="torch")
    calib = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(1))
    out = RC.dummy_study(dummy, calib, ids, p, extra_techniques={"scale_step_up": M.ScaleStepUp(2)})
    rows = {(r["scheme"], r["technique"]): r for r in out["rows"]}
    for s in ("nvfp4", "w_mxfp4_a_mxfp4"):
        rtn, up = rows[(s, "rtn")], rows[(s, "scale_step_up")]
        assert len(rtn["layer_sqnr_db"]) == 2 and all(5 < v < 60 for v in rtn["layer_sqnr_db"]), rtn
        assert all(a < b for a, b in zip(up["layer_sqnr_db"], rtn["layer_sqnr_db"])), (up, rtn)
        assert up["weight_mse"] > rtn["weight_mse"] and up["same_kernel_path"] and rtn["block_seconds"] > 0
        assert not up["online"] and up["block_seconds_over_rtn"] > 0
        assert out["layer0"][(s, "rtn")]["scales_changed"] == 0.0
        assert out["layer0"][(s, "scale_step_up")]["scales_changed"] == 1.0
    paths = out["kernel_paths"]
    assert paths[("nvfp4", "rtn")] == paths[("nvfp4", "scale_step_up")] != paths[("w_mxfp4_a_mxfp4", "rtn")]
