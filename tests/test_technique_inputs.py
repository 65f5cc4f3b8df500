"""What the recovery techniques do with what a user passes in.

* Nothing passed in comes back changed: a technique wrapped in the Hadamard rotation (every registered one
  that can be wrapped) leaves the inner object, its statistics object and their tensors as they were, and the
  inner technique used again alone gives the codes it gave before it was wrapped. The weights passed to any
  technique are left bit for bit.
* GPTQ's damping follows the Hessian's scale: ``H``, ``1e-6 * H``, ``1e6 * H`` and power-of-two multiples give
  the same codes, with and without dead input channels (``mxlib.recovery.gptq``'s docstring says what holds).
* Error weights of the scale searches (``weight=``, ``importance``) that are negative, NaN or Inf are refused
  naming the argument, in every search; zero weights are allowed, and a valid weighting is never worse than
  round-to-nearest in its own weighted error.
"""

import pytest
import torch

from mxlib import reference as R
from mxlib.moe.schemes import get_moe_scheme
from mxlib.recovery import ROTATIONS, TECHNIQUES, get_technique
from mxlib.recovery.four_over_six import quantize_nvfp4_four_over_six
from mxlib.recovery.gptq import GPTQ, gptq_quantize
from mxlib.recovery.scale_search import MSEScaleSearch, search_mx_scales, search_nvfp4_scales

E, H, I = 2, 32, 32


class _Moments:
    """Hessians / importance statistics built by hand (``w13``, ``w2``, ``tokens``, ``diagonal``)."""

    def __init__(self, seed=0, dead=()):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(E, 80, H, generator=g) @ (torch.eye(H) + 0.3 * torch.randn(H, H, generator=g))
        x[..., list(dead)] = 0
        self.h13 = x.transpose(1, 2) @ x
        self.h2 = self.h13[:, :I, :I].clone()

    def w13(self, layer):
        return self.h13

    def w2(self, layer):
        return self.h2

    def tokens(self, layer):
        return torch.full((E,), 80, dtype=torch.int64)

    def diagonal(self, layer):
        return self.h13.diagonal(dim1=-2, dim2=-1), self.h2.diagonal(dim1=-2, dim2=-1)


def _weights(seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, 2 * I, H, generator=g) * 0.05).bfloat16(), (
        torch.randn(E, H, I, generator=g) * 0.05
    ).bfloat16()


def _inner(name):
    """Every registered technique that a rotation can wrap, with statistics where it takes them."""
    if name == "gptq":
        return GPTQ(_Moments())
    if name in ("mse", "four_over_six_mse"):
        return TECHNIQUES[name](_Moments())
    return TECHNIQUES[name]()


WRAPPABLE = sorted(set(TECHNIQUES) - set(ROTATIONS))


def _snapshot(obj):
    """The object's attributes (identity) and every tensor reachable one level down (bits)."""
    attrs = dict(vars(obj))
    tensors = {}
    for k, v in attrs.items():
        for kk, vv in vars(v).items() if hasattr(v, "__dict__") else ():
            if isinstance(vv, torch.Tensor):
                tensors[f"{k}.{kk}"] = vv.clone()
    return attrs, tensors


def _same(a, b):
    return all(
        torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        for x, y in zip(a.tensors().values(), b.tensors().values())
    )


@pytest.mark.parametrize("name", WRAPPABLE)
@pytest.mark.parametrize("scheme", ["nvfp4", "w_mxfp4_a_mxfp4"])
def test_wrapping_leaves_the_inner_technique_as_it_was(name, scheme):
    if scheme != "nvfp4" and name in ("four_over_six", "four_over_six_mse"):
        pytest.skip("4/6 quantizes NVFP4 only")
    sch = get_moe_scheme(scheme)
    w13, w2 = _weights()
    inner = _inner(name)
    before = inner.quantize_experts(w13, w2, sch, layer=0)
    attrs, tensors = _snapshot(inner)
    rotated = get_technique("hadamard", inner=inner, signs="random", seed=3)
    rotated.quantize_experts(w13, w2, sch, layer=0)
    assert dict(vars(inner)) == attrs  # the same objects under the same names: nothing replaced
    for k, t in _snapshot(inner)[1].items():
        assert torch.equal(t, tensors[k]), k
    again = inner.quantize_experts(w13, w2, sch, layer=0)
    assert _same(again, before)  # reused alone: the codes it gave before it was wrapped


@pytest.mark.parametrize("name", WRAPPABLE + [f"{n}+hadamard" for n in WRAPPABLE])
def test_weights_passed_in_are_left_bit_for_bit(name):
    w13, w2 = _weights()
    c13, c2 = w13.clone(), w2.clone()
    base = name.split("+")[0]
    opts = {"hessians": _Moments()} if base == "gptq" else {"importance": _Moments()} if base.endswith("mse") else {}
    moments = next(iter(opts.values()), None)
    h13 = None if moments is None else moments.h13.clone()
    get_technique(name, **opts).quantize_experts(w13, w2, get_moe_scheme("nvfp4"), layer=0)
    assert torch.equal(w13, c13) and torch.equal(w2, c2)
    if moments is not None:
        assert torch.equal(moments.h13, h13)


# ----------------------------------------------------------------------------- GPTQ under a rescaled Hessian


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp6_e2m3"])
@pytest.mark.parametrize("dead", [(), (3,), (0, 5, 17)])
def test_gptq_codes_do_not_depend_on_the_hessians_scale(fmt, dead):
    w13, _ = _weights(seed=7)
    h = _Moments(seed=2, dead=dead).h13
    want = gptq_quantize(w13, h, fmt)
    for c in (2.0**-20, 2.0**30):  # bit for bit by construction (docstring)
        got = gptq_quantize(w13, h * c, fmt)
        assert torch.equal(got[0], want[0]), c
    for c in (1e-6, 1e6, 3.7):  # up to float rounding: no code moves in these cases
        got = gptq_quantize(w13, h * c, fmt)
        assert torch.equal(got[0], want[0]), c
    rtn = R.quantize_nvfp4(w13)[0] if fmt == "nvfp4" else None
    if rtn is not None:
        assert not torch.equal(want[0], rtn)  # the sweep moved codes: the comparison can fail


def test_gptq_dead_channel_damping_is_relative():
    """With a dead channel the old absolute constant (1) made tiny Hessians all but ignore their own values;
    the codes of ``1e-6 * H`` equal those of ``H`` and differ from round-to-nearest's."""
    w13, _ = _weights(seed=4)
    h = _Moments(seed=5, dead=(1,)).h13 * 1e-6
    got = gptq_quantize(w13, h, "nvfp4")[0]
    assert torch.equal(got, gptq_quantize(w13, h * 1e6, "nvfp4")[0])
    assert not torch.equal(got, R.quantize_nvfp4(w13)[0])


# ----------------------------------------------------------------------------- error weights


BAD_WEIGHTS = {"negative": -1.0, "nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def _searches():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    return {
        "search_nvfp4_scales": lambda w: search_nvfp4_scales(x, weight=w),
        "search_mx_scales": lambda w: search_mx_scales(x, "mxfp4", weight=w),
        "search_mx_scales_fp6": lambda w: search_mx_scales(x, "mxfp6_e3m2", weight=w),
        "quantize_nvfp4_four_over_six": lambda w: quantize_nvfp4_four_over_six(x, weight=w),
    }


@pytest.mark.parametrize("search", sorted(_searches()))
@pytest.mark.parametrize("bad", sorted(BAD_WEIGHTS))
@pytest.mark.parametrize("where", ["all", "one"])
def test_invalid_error_weights_are_refused(search, bad, where):
    w = torch.ones(64)
    if where == "all":
        w[:] = BAD_WEIGHTS[bad]
    else:
        w[17] = BAD_WEIGHTS[bad]
    with pytest.raises(ValueError, match=r"^weight: expected finite, non-negative error weights, found") as err:
        _searches()[search](w)
    assert f"found {64 if where == 'all' else 1} negative, NaN or Inf values of 64" in str(err.value)


@pytest.mark.parametrize("search", sorted(_searches()))
def test_error_weights_that_do_not_broadcast_are_refused(search):
    with pytest.raises(ValueError, match=r"^weight: shape \[3\] does not broadcast"):
        _searches()[search](torch.ones(3))
    with pytest.raises(TypeError, match="^weight: expected a torch.Tensor"):
        _searches()[search]([1.0] * 64)


@pytest.mark.parametrize("bad", sorted(BAD_WEIGHTS))
def test_invalid_importance_is_refused_naming_it(bad):
    moments = _Moments()
    moments.h13 = moments.h13.clone()
    moments.h13[1, 4, 4] = BAD_WEIGHTS[bad]
    w13, w2 = _weights()
    with pytest.raises(ValueError, match=r"^importance.diagonal\(0\): a1: expected finite, non-negative"):
        MSEScaleSearch(moments).quantize_experts(w13, w2, get_moe_scheme("nvfp4"), layer=0)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_valid_weights_never_worse_than_round_to_nearest(fmt):
    g = torch.Generator().manual_seed(9)
    x = torch.randn(8, 64, generator=g) * torch.exp(torch.randn(64, generator=g))
    w = torch.rand(64, generator=g)
    w[::5] = 0  # zero weights are allowed
    if fmt == "nvfp4":
        p, s, gs, err = search_nvfp4_scales(x, weight=w)
        rp, rs, rg = R.quantize_nvfp4(x)
        deq = R.dequantize_to_dtype(rp, rs, rg, torch.float32)
    else:
        p, s, err = search_mx_scales(x, "mxfp4", weight=w)
        rp, rs = R.quantize_mx(x, "e2m1", 32, "even")
        deq = R.dequantize_mx(rp, rs, "e2m1", 32, torch.float32)
    rtn_err = ((deq.double() - x.double()) ** 2 * w.double()).reshape(8, -1, 16 if fmt == "nvfp4" else 32).sum(-1)
    assert bool((err <= rtn_err * (1 + 1e-6)).all()), float((err - rtn_err).max())
