"""Gate/up ``weight_scale_2`` reconciliation: hand-built values for each mode, and a ModelOpt checkpoint whose
gate and up scales differ, loaded in each mode.

Oracles: values worked out by hand (e4m3 roundings of rescaled block scales, the up half under the gate's
scale); dequantization written here from ml_dtypes' e2m1 decode and torch's float8 cast.
"""

import warnings

import ml_dtypes
import numpy as np
import pytest
import torch

from mxlib import checkpoints as C
from mxlib import reference as R
from mxlib.formats import NVFP4
from mxlib.models.calibration import calibrate
from mxlib.models.qwen3 import dummy_qwen3_moe, expert_weights, moe_layers, qwen3_30b_a3b_config
from mxlib.moe.emulation import ExpertWeights
from mxlib.recovery.gate_up import GATE_UP_MODES, VLLM_GATE_UP_WARNING, gate_up_errors, reconcile_gate_up

from _util import TINY_QWEN3


def _hand_weights(gate_bs, up_bs, g13, kind="decode"):
    """One expert, I = 1 gate row and 1 up row of one 16-element block each (codes 0..15 in order)."""
    codes = torch.arange(16, dtype=torch.uint8).expand(2, 16)
    packed = R.pack_codes(codes, "e2m1")[None]  # [1, 2, 8]
    scale = torch.tensor([[[gate_bs], [up_bs]]]).to(torch.float8_e4m3fn)  # [1, 2, 1]
    w2 = torch.zeros(1, 16, 8, dtype=torch.uint8)  # down is not reconciled: any tensor of the right kind
    return ExpertWeights(
        NVFP4,
        packed,
        scale,
        w2,
        torch.ones(1, 16, 1, dtype=torch.float8_e4m3fn),
        torch.tensor([g13], dtype=torch.float32),
        torch.ones(1),
        global_scale_kind=kind,
    )


def _dequant_by_hand(weights):
    """``e2m1(code) * (fp32(block_scale) * g)`` per half, in float64 from ml_dtypes' e2m1 decode."""
    codes = R.unpack_codes(weights.w13_weight, "e2m1").numpy()
    e2m1 = codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    bs = weights.w13_weight_scale.float().numpy().astype(np.float64)
    g = weights.w13_weight_scale_2.numpy().astype(np.float64)
    i = codes.shape[1] // 2
    g = np.repeat(g[:, None], 2 * i, axis=1) if g.ndim == 1 else np.repeat(g, i, axis=1)
    if weights.global_scale_kind == "encode":
        g = 1 / g
    return e2m1 * np.repeat(bs, 16, axis=-1) * g[:, :, None]


def test_per_half_is_the_weights_as_stored():
    w = _hand_weights(2.0, 3.0, [1.0, 0.25])
    assert reconcile_gate_up(w, "per_half") is w


def test_gate_keeps_the_gates_scale_for_both_halves_as_vllm_does():
    w = _hand_weights(2.0, 3.0, [1.0, 0.25])
    with pytest.warns(UserWarning, match=VLLM_GATE_UP_WARNING.replace(".", r"\.")):
        got = reconcile_gate_up(w, "gate")
    assert got.w13_weight_scale_2.tolist() == [1.0]
    assert torch.equal(got.w13_weight_scale.view(torch.uint8), w.w13_weight_scale.view(torch.uint8))
    d = _dequant_by_hand(got)
    # code 7 is e2m1 6.0: gate 6 * 2 * 1; up 6 * 3 * 1 (not 6 * 3 * 0.25, the value the producer wrote)
    assert d[0, 0, 7] == 12.0 and d[0, 1, 7] == 18.0
    assert _dequant_by_hand(w)[0, 1, 7] == 4.5


@pytest.mark.parametrize(
    "up_bs, ratio_g, want",
    [
        (3.0, 0.25, 0.75),  # exact: 3 * 0.25
        (3.25, 0.1, 0.3125),  # 3.25 * fp32(0.1) = 0.325000005 -> e4m3 0.3125 (step 2**-5 in [0.25, 0.5))
        (2.0**-6, 0.1, 2.0**-9),  # 0.0015625 -> the subnormal 2**-9 (0.8 of a step rounds up)
        (2.0**-9, 0.1, 0.0),  # 0.0001953 -> 0 (0.1 of the smallest subnormal)
    ],
)
@pytest.mark.parametrize("kind", ["decode", "encode"])
def test_requantize_max_rescales_the_smaller_halfs_block_scales(up_bs, ratio_g, want, kind):
    g = [1.0, ratio_g] if kind == "decode" else [1.0, 1 / np.float32(ratio_g)]
    w = _hand_weights(2.0, up_bs, g, kind)
    got = reconcile_gate_up(w, "requantize_max")
    assert got.w13_weight_scale_2.tolist() == [1.0]
    assert got.w13_weight_scale.float()[0, :, 0].tolist() == [2.0, want]
    assert torch.equal(got.w13_weight, w.w13_weight)  # the FP4 codes do not move


def test_requantize_max_when_up_is_larger():
    w = _hand_weights(3.0, 2.0, [0.25, 1.0])
    got = reconcile_gate_up(w, "requantize_max")
    assert got.w13_weight_scale_2.tolist() == [1.0]
    assert got.w13_weight_scale.float()[0, :, 0].tolist() == [0.75, 2.0]
    np.testing.assert_array_equal(_dequant_by_hand(got), _dequant_by_hand(w))  # exact here


def test_shared_scales_and_mx_weights_are_left_alone_and_bad_modes_named():
    w = _hand_weights(2.0, 3.0, [1.0, 0.25])
    shared = ExpertWeights(w.scheme, w.w13_weight, w.w13_weight_scale, w.w2_weight, w.w2_weight_scale, torch.ones(1))
    for mode in GATE_UP_MODES:
        assert reconcile_gate_up(shared, mode) is shared
    with pytest.raises(ValueError, match=r"gate_up_scale: expected one of \['per_half', 'gate', 'requantize_max'\]"):
        reconcile_gate_up(w, "average")


# ----------------------------------------------------------------------------- a checkpoint with per-half scales


class _PerHalfNvfp4:
    """ModelOpt-style NVFP4 with gate and up each quantized under its own ``weight_scale_2``."""

    name = "per_half_test"

    def quantize_experts(self, w13, w2, scheme, *, layer):
        i = w13.shape[1] // 2
        pg, sg, gg = R.quantize_nvfp4(w13[:, :i])
        pu, su, gu = R.quantize_nvfp4(w13[:, i:])
        p2, s2, g2 = R.quantize_nvfp4(w2)
        return ExpertWeights(
            scheme.weight, torch.cat([pg, pu], 1), torch.cat([sg, su], 1), p2, s2, torch.stack([gg, gu], 1), g2
        )

    def config(self):
        return {}


@pytest.fixture(scope="module")
def per_half_checkpoint(tmp_path_factory):
    model = dummy_qwen3_moe(qwen3_30b_a3b_config(num_hidden_layers=2, **TINY_QWEN3), seed=1, expert_spread=0.5)
    with torch.no_grad():  # up weights 3x the gate's: their amax, and so their weight_scale_2, differ
        for mlp in moe_layers(model):
            mlp.experts.gate_up_proj[:, TINY_QWEN3["moe_intermediate_size"] :] *= 3
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    path = tmp_path_factory.mktemp("gate_up") / "ckpt"
    C.write_quantized_checkpoint(model, "nvfp4", path, calibrate(model, ids), technique=_PerHalfNvfp4())
    return model, path


def test_the_checkpoint_has_differing_gate_and_up_scales(per_half_checkpoint):
    _, path = per_half_checkpoint
    report = C.inspect_checkpoint(path)
    n = 2 * TINY_QWEN3["num_experts"]
    assert report.weight_global_scales["gate_up_differ"] == n


@pytest.mark.parametrize("mode", GATE_UP_MODES)
def test_loader_runs_each_mode(per_half_checkpoint, mode):
    _, path = per_half_checkpoint
    with warnings.catch_warnings():  # per_half: the experts' note (once a process); gate: vLLM's message
        warnings.simplefilter("ignore")
        loaded, _ = C.load_quantized_qwen3_moe(path, backend="torch", gate_up_scale=mode)
    stored, _ = C.load_quantized_qwen3_moe(path, backend="torch")
    for layer in range(2):
        ex = stored.model.layers[layer].mlp.experts.experts
        w = ExpertWeights(
            ex.weight_scheme,
            ex.w13_weight,
            ex.w13_weight_scale,
            ex.w2_weight,
            ex.w2_weight_scale,
            ex.w13_weight_scale_2,
            ex.w2_weight_scale_2,
        )
        assert w.w13_weight_scale_2.shape == (TINY_QWEN3["num_experts"], 2)
        g = w.w13_weight_scale_2
        if mode == "gate":
            w = ExpertWeights(*[getattr(w, f) for f in ("scheme", "w13_weight", "w13_weight_scale")], w.w2_weight,
                              w.w2_weight_scale, g[:, 0].contiguous(), w.w2_weight_scale_2)  # fmt: skip
        want = _dequant_by_hand(w) if mode != "requantize_max" else None
        got = expert_weights(loaded, layer)[0].double().numpy()
        if want is not None:
            np.testing.assert_array_equal(got, torch.from_numpy(want).bfloat16().double().numpy())
        else:  # the larger scale for both, the smaller half's block scales rescaled by hand
            shared = g.amax(1)
            i = TINY_QWEN3["moe_intermediate_size"]
            ratio = (g / shared[:, None]).repeat_interleave(i, 1)[:, :, None]
            bs = (w.w13_weight_scale.float() * ratio).to(torch.float8_e4m3fn)  # torch's RNE cast; no saturation
            w = ExpertWeights(w.scheme, w.w13_weight, bs, w.w2_weight, w.w2_weight_scale, shared, w.w2_weight_scale_2)
            np.testing.assert_array_equal(got, torch.from_numpy(_dequant_by_hand(w)).bfloat16().double().numpy())


def test_gate_up_errors_orders_the_modes(per_half_checkpoint):
    model, path = per_half_checkpoint
    stored, _ = C.load_quantized_qwen3_moe(path, backend="torch")
    ex = stored.model.layers[0].mlp.experts.experts
    w = ExpertWeights(
        ex.weight_scheme,
        ex.w13_weight,
        ex.w13_weight_scale,
        ex.w2_weight,
        ex.w2_weight_scale,
        ex.w13_weight_scale_2,
        ex.w2_weight_scale_2,
    )
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(64, TINY_QWEN3["hidden_size"], generator=g)).bfloat16()
    topk_ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(64)]).to(torch.int32)
    topk_w = torch.full((64, 2), 0.5)
    ins = (ex.w13_input_scale, ex.w2_input_scale)
    for reference in (expert_weights(model, 0), None):
        rows = {r["mode"]: r for r in gate_up_errors(w, x, topk_w, topk_ids, *ins, reference=reference)}
        per, gate, req = rows["per_half"], rows["gate"], rows["requantize_max"]
        assert gate["gate_rel_err"] == per["gate_rel_err"]  # the gate half is untouched
        assert gate["up_rel_err"] > max(0.5, 5 * per["up_rel_err"])  # up scaled by gs_gate / gs_up, about 1/3
        assert gate["output_rel_err"] > 2 * per["output_rel_err"]
        assert req["up_rel_err"] == per["up_rel_err"]  # up is the larger half: its block scales stay
        # gate's rescaled block scales are rounded to e4m3: each value moves by at most 2**-4 of itself
        assert req["gate_rel_err"] <= per["gate_rel_err"] + 2**-4
        assert req["output_rel_err"] < gate["output_rel_err"] / 2
        if reference is None:
            assert per["w13_rel_err"] == 0 and per["output_rel_err"] == 0
            assert 0 < req["gate_rel_err"]
