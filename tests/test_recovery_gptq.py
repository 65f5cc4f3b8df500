"""GPTQ for FP4 / FP6 weights and the per-expert Hessians it reads.

Oracles: round-to-nearest (``H = I`` feeds nothing back, so the codes must be RTN's bit for bit); a dense
textbook GPTQ written here in float64 NumPy (the paper's Eq. 2-3 with explicit inverse downdates, no
Cholesky, no lazy batches; elements rounded by ml_dtypes casts); the calibration-set output error
against RTN; Hessians summed in float64 from routing recomputed here from the router weights.
"""

import ml_dtypes
import numpy as np
import pytest
import torch

from mxlib import checkpoints as C
from mxlib import reference as R
from mxlib.formats import BLOCK_SCHEMES
from mxlib.models.calibration import calibrate
from mxlib.models.hessians import collect_expert_hessians
from mxlib.models.qwen3 import dummy_qwen3_moe, expert_weights, moe_layers, qwen3_30b_a3b_config
from mxlib.recovery import TECHNIQUES, RoundToNearest, get_technique
from mxlib.recovery.gptq import GPTQ, gptq_quantize

from _util import TINY_QWEN3

FORMATS = ["nvfp4", "mxfp4", "mxfp6_e2m3", "mxfp6_e3m2"]
SCHEMES = {"nvfp4": "nvfp4", "mxfp4": "w_mxfp4_a_mxfp4", "mxfp6_e2m3": "w_mxfp6_e2m3", "mxfp6_e3m2": "w_mxfp6_e3m2"}
ML_DTYPES = {"e2m1": ml_dtypes.float4_e2m1fn, "e2m3": ml_dtypes.float6_e2m3fn, "e3m2": ml_dtypes.float6_e3m2fn}


class _Hessians:
    """A HessianSource built by hand."""

    def __init__(self, h13, h2, tokens, layer=0):
        self.layer, self.h13, self.h2, self.t = layer, h13, h2, tokens

    def w13(self, layer):
        assert layer == self.layer
        return self.h13

    def w2(self, layer):
        return self.h2

    def tokens(self, layer):
        return self.t


def _weights(e=3, i=32, h=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * 0.02).bfloat16()
    w2 = (torch.randn(e, h, i, generator=g) * 0.02).bfloat16()
    return w13, w2


def _correlated_inputs(t, k, seed):
    g = torch.Generator().manual_seed(seed)
    mix = torch.eye(k) + 0.4 * torch.randn(k, k, generator=g)
    scale = torch.exp(torch.randn(k, generator=g))  # channels of unequal size, as in LLM activations
    return ((torch.randn(t, k, generator=g) @ mix) * scale).bfloat16().float()


def _dequant(p, s, g, fmt):
    f = BLOCK_SCHEMES[fmt]
    if f.has_global_scale:
        return R.dequantize_to_dtype(p, s, g, torch.float32)
    return R.dequantize_mx(p, s, f.element, f.block_size, torch.float32)


# ----------------------------------------------------------------------------- H = I is round-to-nearest


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("c", [1.0, 37.5])
def test_identity_hessian_gives_round_to_nearest_bit_for_bit(fmt, c):
    w13, w2 = _weights()
    e, h, i = w13.shape[0], w13.shape[2], w2.shape[2]
    hs = _Hessians(c * torch.eye(h).expand(e, h, h), c * torch.eye(i).expand(e, i, i), torch.full((e,), 9))
    got = GPTQ(hs, lazy_block=16).quantize_experts(w13, w2, SCHEMES[fmt], layer=0)
    want = RoundToNearest().quantize_experts(w13, w2, SCHEMES[fmt], layer=0)
    assert set(got.tensors()) == set(want.tensors())
    for name, t in want.tensors().items():
        assert torch.equal(got.tensors()[name].view(torch.uint8), t.view(torch.uint8)), name


# ----------------------------------------------------------------------------- the calibration-set error falls


@pytest.mark.parametrize("fmt", FORMATS)
def test_gptq_lowers_the_calibration_output_error(fmt):
    e, n, k, t = 2, 48, 128, 400
    w = (torch.randn(e, n, k, generator=torch.Generator().manual_seed(3)) * 0.02).bfloat16()
    xs = [_correlated_inputs(t, k, seed=10 + x) for x in range(e)]
    hess = torch.stack([x.T @ x for x in xs])
    f = BLOCK_SCHEMES[fmt]
    if f.has_global_scale:
        rtn = R.quantize_nvfp4(w)
    else:
        rtn = (*R.quantize_mx(w, f.element, f.block_size, "even"), None)
    got = gptq_quantize(w, hess, fmt)
    for x in range(e):
        ref = xs[x] @ w[x].float().T
        err_rtn = torch.linalg.norm(ref - xs[x] @ _dequant(*rtn, fmt)[x].T)
        err_gptq = torch.linalg.norm(ref - xs[x] @ _dequant(*got, fmt)[x].T)
        assert err_gptq < 0.85 * err_rtn, (fmt, x, float(err_gptq), float(err_rtn))
    assert torch.equal(got[1].view(torch.uint8), rtn[1].view(torch.uint8))  # the scales are RTN's


# ----------------------------------------------------------------------------- the dense textbook algorithm


def _textbook_codes(w, hess, step, fmt, damp=0.01):
    """GPTQ as the paper writes it (Eq. 2-3, OBS with explicit inverse downdates), float64, one column at a time.

    ``step`` is the fixed per-element fp32 scale; a column is rounded to fp32, divided by it in fp32, clamped
    to the element's max and cast to the element by ml_dtypes (round to nearest even).
    """
    f = BLOCK_SCHEMES[fmt]
    el = f.element
    w = w.astype(np.float64).copy()
    n, k = w.shape
    h = hess.astype(np.float64).copy()
    d = np.diag(h).copy()
    h /= d[d > 0].mean()  # the Hessian's own scale
    d = np.diag(h).copy()
    d[d == 0] = 1.0
    h[np.arange(k), np.arange(k)] = d
    h[np.arange(k), np.arange(k)] += damp * np.mean(np.diag(h))
    hinv = np.linalg.inv(h)
    codes = np.zeros((n, k), np.uint8)
    for j in range(k):
        x = w[:, j].astype(np.float32)
        s = step[:, j]
        v = np.where(s == 0, np.float32(0), x / np.where(s == 0, np.float32(1), s)).astype(np.float32)
        v = np.clip(v, -el.max, el.max)
        if f.has_global_scale:  # ModelOpt: the magnitude rounded, the sign from v < 0
            mag = np.abs(v).astype(ML_DTYPES[el.name])
            c = mag.view(np.uint8) | ((v < 0).astype(np.uint8) << (el.nbits - 1))
            qv = np.where(v < 0, -mag.astype(np.float32), mag.astype(np.float32))
        else:
            r = v.astype(ML_DTYPES[el.name])
            c, qv = r.view(np.uint8), r.astype(np.float32)
        q = (qv * s).astype(np.float32)  # the fp32 value times the fp32 step
        codes[:, j] = c
        err = (w[:, j] - q.astype(np.float64)) / hinv[j, j]
        w[:, j:] -= np.outer(err, hinv[j, j:])
        hinv = hinv - np.outer(hinv[:, j], hinv[j, :]) / hinv[j, j]
    return codes


def _steps(scale, g, fmt):
    """fp32 ``[E, N, K]`` per-element steps decoded here: e4m3 via torch's float8 cast, E8M0 as 2**(b - 127)."""
    f = BLOCK_SCHEMES[fmt]
    if f.has_global_scale:
        s = scale.float() * g[:, None, None]
    else:
        s = torch.from_numpy(np.ldexp(np.float32(1), scale.numpy().astype(np.int32) - 127).astype(np.float32))
    return s.repeat_interleave(f.block_size, dim=-1).numpy()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("lazy_block", [16, 128])
def test_same_codes_as_the_dense_textbook_algorithm(fmt, lazy_block):
    e, n, k = 2, 16, 64
    w = (torch.randn(e, n, k, generator=torch.Generator().manual_seed(5)) * 0.02).bfloat16()
    xs = [_correlated_inputs(96, k, seed=20 + x) for x in range(e)]
    xs[1][:, 7] = 0  # a dead input channel
    hess = torch.stack([x.T @ x for x in xs])
    packed, scale, g = gptq_quantize(w, hess, fmt, lazy_block=lazy_block)
    el = BLOCK_SCHEMES[fmt].element
    got = R.unpack_codes(packed, el).numpy()
    steps = _steps(scale, g, fmt)
    rtn = R.quantize_nvfp4(w)[0] if g is not None else R.quantize_mx(w, el, BLOCK_SCHEMES[fmt].block_size)[0]
    assert not torch.equal(packed, rtn)  # the sweep moved codes
    for x in range(e):
        want = _textbook_codes(w[x].float().numpy(), hess[x].numpy(), steps[x], fmt)
        np.testing.assert_array_equal(got[x], want)


# ----------------------------------------------------------------------------- fallbacks and bad input


def test_experts_without_tokens_keep_rtn_codes_with_a_warning():
    w13, w2 = _weights(e=3)
    e, h, i = 3, w13.shape[2], w2.shape[2]
    x13 = torch.stack([_correlated_inputs(64, h, seed=s) for s in range(e)])
    x2 = torch.stack([_correlated_inputs(64, i, seed=50 + s) for s in range(e)])
    h13, h2 = x13.transpose(1, 2) @ x13, x2.transpose(1, 2) @ x2
    h13[1], h2[1] = 0, 0
    hs = _Hessians(h13, h2, torch.tensor([64, 0, 64]), layer=5)
    with pytest.warns(UserWarning, match=r"layer 5: experts \[1\] received no calibration tokens"):
        got = GPTQ(hs).quantize_experts(w13, w2, "nvfp4", layer=5)
    rtn = RoundToNearest().quantize_experts(w13, w2, "nvfp4", layer=5)
    assert torch.equal(got.w13_weight[1], rtn.w13_weight[1]) and torch.equal(got.w2_weight[1], rtn.w2_weight[1])
    assert not torch.equal(got.w13_weight[0], rtn.w13_weight[0])


def test_bad_arguments_are_named():
    w13, w2 = _weights(e=2)
    hs = _Hessians(torch.eye(64).expand(2, 64, 64), torch.eye(32).expand(2, 32, 32), torch.ones(2))
    with pytest.raises(ValueError, match=r"w13 Hessian: expected a float tensor \[2, 64, 64\], got \[2, 32, 32\]"):
        GPTQ(_Hessians(hs.h2, hs.h2, hs.t)).quantize_experts(w13, w2, "nvfp4", layer=0)
    with pytest.raises(ValueError, match="damp: expected a finite number >= 0, got -1"):
        GPTQ(hs, damp=-1)
    with pytest.raises(ValueError, match="lazy_block: expected a positive integer, got 0"):
        GPTQ(hs, lazy_block=0)
    with pytest.raises(ValueError, match=r"hessians: expected an object with w13\(layer\)"):
        GPTQ(object())
    bad = w13.clone()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="w: holds non-finite values"):
        gptq_quantize(bad, hs.h13, "mxfp4")
    assert TECHNIQUES["gptq"] is GPTQ


# ----------------------------------------------------------------------------- Hessians of a tiny model


@pytest.fixture(scope="module")
def tiny():
    model = dummy_qwen3_moe(qwen3_30b_a3b_config(num_hidden_layers=2, **TINY_QWEN3), seed=1, expert_spread=0.5)
    ids = torch.randint(0, 128, (3, 20), generator=torch.Generator().manual_seed(0))
    return model, ids


def _captured_inputs(model, run):
    """The hidden states entering each MoE block while ``run()`` runs."""
    seen = {i: [] for i in range(len(moe_layers(model)))}
    hooks = [
        mlp.register_forward_pre_hook(lambda m, a, i=i: seen[i].append(a[0].reshape(-1, a[0].shape[-1]).clone()))
        for i, mlp in enumerate(moe_layers(model))
    ]
    try:
        out = run()
    finally:
        for hk in hooks:
            hk.remove()
    return out, {i: torch.cat(v) for i, v in seen.items()}


def test_hessians_equal_a_float64_sum_over_independently_routed_tokens(tiny):
    model, ids = tiny
    originals = [mlp.experts for mlp in moe_layers(model)]
    hs, inputs = _captured_inputs(model, lambda: collect_expert_hessians(model, ids, batch_size=2))
    assert [mlp.experts for mlp in moe_layers(model)] == originals  # restored
    cfg = model.config
    for layer, mlp in enumerate(moe_layers(model)):
        x = inputs[layer]  # bf16 [T, H]
        logits = x.double() @ mlp.gate.weight.double().T
        topk = logits.topk(cfg.num_experts_per_tok, dim=-1).indices  # softmax is monotone: same top-k
        w13, w2 = expert_weights(model, layer)
        i = w2.shape[-1]
        counts = torch.zeros(cfg.num_experts, dtype=torch.int64)
        for e in range(cfg.num_experts):
            rows = (topk == e).any(-1)
            counts[e] = int(rows.sum())
            xe = x[rows]
            gu = (xe.float() @ w13[e].float().T).bfloat16().float()  # GEMM1 rounded to bf16
            act = (torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]).bfloat16().double()
            want13, want2 = xe.double().T @ xe.double(), act.T @ act
            got13, got2 = hs.w13(layer)[e].double(), hs.w2(layer)[e].double()
            assert torch.linalg.norm(got13 - want13) <= 1e-6 * torch.linalg.norm(want13), (layer, e)
            assert torch.linalg.norm(got2 - want2) <= 1e-5 * torch.linalg.norm(want2), (layer, e)  # fp32 sums
            a1, a2 = hs.diagonal(layer)
            assert torch.equal(a1[e], torch.diagonal(hs.w13(layer)[e]))
            assert torch.equal(a2[e], torch.diagonal(hs.w2(layer)[e]))
        assert torch.equal(hs.tokens(layer), counts)
        assert int(counts.sum()) == ids.numel() * cfg.num_experts_per_tok
        assert hs.w13(layer).dtype == torch.float32 and hs.tokens(layer).dtype == torch.int64


def test_hessians_of_chosen_layers_and_bad_input(tiny):
    model, ids = tiny
    full = collect_expert_hessians(model, ids)
    one = collect_expert_hessians(model, ids, layers=[1])
    assert sorted(one.layers) == [1]
    assert torch.equal(one.w13(1), full.w13(1)) and torch.equal(one.w2(1), full.w2(1))
    with pytest.raises(ValueError, match=r"no Hessians collected for layer 0; collected layers \[1\]"):
        one.w13(0)
    with pytest.raises(ValueError, match=r"token_ids: expected an integer tensor \[batch, seq\], got \[60\]"):
        collect_expert_hessians(model, ids.reshape(-1))
    with pytest.raises(ValueError, match="batch_size: expected a positive integer, got 0"):
        collect_expert_hessians(model, ids, batch_size=0)
    with pytest.raises(ValueError, match=r"layers: expected indices in \[0, 2\), got \[2\]"):
        collect_expert_hessians(model, ids, layers=[2])


# ----------------------------------------------------------------------------- checkpoint round trip


@pytest.mark.parametrize("scheme", ["nvfp4", "w_mxfp4_a_mxfp4", "w_mxfp6_e2m3", "w_mxfp6_e3m2_a_mxfp6_e3m2"])
def test_gptq_checkpoint_round_trip(tiny, tmp_path, scheme):
    model, ids = tiny
    hs = collect_expert_hessians(model, ids)
    technique = get_technique("gptq", hessians=hs)
    path = C.write_quantized_checkpoint(model, scheme, tmp_path / "ckpt", calibrate(model, ids), technique=technique)
    loaded, info = C.load_quantized_qwen3_moe(path, backend="torch")
    assert info.format == ("modelopt" if scheme == "nvfp4" else "quark")
    moved = False
    for layer in range(model.config.num_hidden_layers):
        w13, w2 = expert_weights(model, layer)
        mine = technique.quantize_experts(w13, w2, info.scheme, layer=layer)
        rtn = RoundToNearest().quantize_experts(w13, w2, info.scheme, layer=layer)
        moved |= not torch.equal(mine.w13_weight, rtn.w13_weight)
        f = info.scheme.weight
        for got, (p, s, g) in zip(
            expert_weights(loaded, layer),
            [
                (mine.w13_weight, mine.w13_weight_scale, mine.w13_weight_scale_2),
                (mine.w2_weight, mine.w2_weight_scale, mine.w2_weight_scale_2),
            ],
        ):
            if f.has_global_scale:
                want = R.dequantize_to_dtype(p, s, g, torch.bfloat16)
            else:
                want = R.dequantize_mx(p, s, f.element, f.block_size, torch.bfloat16)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (scheme, layer)
    assert moved  # GPTQ's codes are not RTN's: the round trip carried them
