"""Comparison helpers shared by the tests."""

import torch

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, msg: str = "") -> None:
    """Bit-exact equality: same shape and dtype, NaN at the same positions, every other
    value identical bit for bit (so +0.0 and -0.0 differ). NaN sign and payload are not
    compared: they carry no meaning."""
    assert actual.shape == expected.shape, f"{msg} shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{msg} dtype {actual.dtype} != {expected.dtype}"
    actual, expected = actual.detach().cpu(), expected.detach().cpu()
    if not actual.is_floating_point():
        bad = actual != expected
    else:
        na, ne = torch.isnan(actual), torch.isnan(expected)
        view = _INT_VIEW[actual.element_size()]
        bad = (na != ne) | (~na & ~ne & (actual.view(view) != expected.view(view)))
    if bad.any():
        idx = bad.nonzero()[:5].tolist()
        a = [actual[tuple(i)].item() for i in idx]
        e = [expected[tuple(i)].item() for i in idx]
        raise AssertionError(f"{msg} {int(bad.sum())} of {bad.numel()} differ; first at {idx}: got {a}, expected {e}")
