"""Kept dequantized weights (``QuantizedExperts.keep_dequantized``) give the bits of dequantizing at each forward.

The workbook's CPU studies run the same quantized weights through many forwards; keeping each expert's
dequantized weights must never change an output: not on the first forward, not after a switch of numerics,
not after an in-place write into the packed bytes (a negative control), not after a buffer is replaced. The
oracle is the same experts with the option off (the default), which dequantize from the packed bytes at
every forward.
"""

from __future__ import annotations

import pytest
import torch

import mxlib
from mxlib.moe.emulation import QuantizedExperts

E, H, I, M, TOP_K = 8, 128, 128, 12, 2


def _experts(scheme: str):
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).bfloat16()
    weights = mxlib.quantize_expert_weights(w13, w2, scheme)
    kw = {}
    if scheme in ("nvfp4", "w_mxfp4_a_fp8"):  # static per-expert input scales, as a calibrated checkpoint has them
        kw = dict(
            w13_input_scale=torch.linspace(0.5, 2.0, E) / (6 * 448), w2_input_scale=torch.linspace(0.2, 1.0, E) / 2688
        )
    plain = mxlib.make_emulation_experts(scheme, weights, backend="torch", **kw)
    kept = mxlib.make_emulation_experts(scheme, weights, backend="torch", **kw)
    kept.keep_dequantized = True
    x = torch.randn(M, H, generator=g).bfloat16()
    topk_weights, topk_ids = mxlib.fused_topk(torch.randn(M, E, generator=g), TOP_K)
    return plain, kept, (x, topk_weights, topk_ids)


def _count_dequantize(monkeypatch, experts) -> list:
    calls = []
    whole = type(experts)._dequantize

    def counted(self, ops, sel):
        if self is experts:
            calls.append(sel)
        return whole(self, ops, sel)

    monkeypatch.setattr(type(experts), "_dequantize", counted)
    return calls


@pytest.mark.parametrize("scheme", ["nvfp4", "w_mxfp4_a_mxfp4", "w_mxfp6_e2m3", "w_mxfp4_a_fp8"])
def test_kept_weights_give_the_bits_of_dequantizing_each_time(scheme, monkeypatch):
    plain, kept, args = _experts(scheme)
    assert isinstance(kept, QuantizedExperts) and not plain.keep_dequantized  # off unless asked for
    calls = _count_dequantize(monkeypatch, kept)
    first = kept(*args)
    hit = len(calls)
    assert 0 < hit <= E  # each expert that got tokens, once (not once per GEMM)
    assert torch.equal(first, plain(*args))
    again = kept(*args)
    assert len(calls) == hit  # nothing dequantized again
    assert torch.equal(again, first)

    # an in-place write into the packed bytes (notebook 01's swapped-nibbles control) is seen at once
    packed = {id(t): t for ex in (plain, kept) for t in (ex.w13_weight, ex.w2_weight)}  # the two may share them
    for t in packed.values():
        t.copy_(((t << 4) | (t >> 4)) & 0xFF)
    broken = kept(*args)
    assert len(calls) > hit
    assert torch.equal(broken, plain(*args))
    assert not torch.equal(broken, first)


def test_a_switch_of_numerics_and_a_replaced_buffer_are_seen():
    plain, kept, args = _experts("nvfp4")
    assert torch.equal(kept(*args), plain(*args))
    for ex in (plain, kept):
        ex.numerics = mxlib.formats.get_numerics("hardware")
    hw = kept(*args)
    assert torch.equal(hw, plain(*args))
    for ex in (plain, kept):
        ex.numerics = mxlib.formats.get_numerics("vllm")
    assert torch.equal(kept(*args), plain(*args))
    for ex in (plain, kept):  # a new tensor of other scales in the place of the old one
        ex.w2_weight_scale_2 = ex.w2_weight_scale_2 * 2
    assert torch.equal(kept(*args), plain(*args))


def test_turning_it_off_lets_go():
    _, kept, args = _experts("w_mxfp4_a_mxfp4")
    kept(*args)
    assert kept.kept_dequantized is not None and kept.kept_dequantized.experts
    kept.keep_dequantized = False
    kept(*args)
    assert kept.kept_dequantized is None


def test_experts_of_the_same_weights_share_what_is_kept(monkeypatch):
    """Schemes that differ in their activations only (w_mxfp4, w_mxfp4_a_mxfp4) share one KeptDequantized:
    the second dequantizes nothing, and each gives the bits of its own experts with nothing kept."""
    from mxlib.moe.emulation import KeptDequantized

    plain, kept, args = _experts("w_mxfp4_a_mxfp4")
    shared = KeptDequantized()
    kept.kept_dequantized = shared
    kept(*args)
    weights = mxlib.moe.ExpertWeights(
        kept.weight_scheme, kept.w13_weight, kept.w13_weight_scale, kept.w2_weight, kept.w2_weight_scale
    )
    w_only = mxlib.make_emulation_experts("w_mxfp4", weights, backend="torch")
    w_only_plain = mxlib.make_emulation_experts("w_mxfp4", weights, backend="torch")
    w_only.keep_dequantized, w_only.kept_dequantized = True, shared
    calls = _count_dequantize(monkeypatch, w_only)
    assert torch.equal(w_only(*args), w_only_plain(*args))
    assert calls == []
    assert torch.equal(kept(*args), plain(*args))
