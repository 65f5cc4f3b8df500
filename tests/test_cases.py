"""The named corner cases (mxlib.cases), run through the reference and through the Triton kernels.

Expected values in the table were worked out by hand; both implementations must produce them bit for
bit (NaN positions equal, signs of zero equal). ``mxlib.cases.check_case`` is the one runner, shared
with the formats notebook.
"""

import pytest
import torch

from mxlib import kernels as K
from mxlib import reference as R
from mxlib.cases import NAMED_CASES, bits_mismatch, check_case, run_case
from mxlib.moe import unify_input_scales

TWIN_CASES = [c for c in NAMED_CASES if c.op != "unify_input_scales"]
UNIFY_CASES = [c for c in NAMED_CASES if c.op == "unify_input_scales"]


@pytest.mark.parametrize("case", TWIN_CASES, ids=[c.name for c in TWIN_CASES])
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_named_case(case, impl, device):
    module = R if impl == "reference" else K
    result = check_case(case, module, "cpu" if impl == "reference" else device)
    assert result.ok, result.message


@pytest.mark.parametrize("case", UNIFY_CASES, ids=[c.name for c in UNIFY_CASES])
def test_unification_case(case):
    result = check_case(case)
    assert result.ok, result.message
    scales = torch.tensor(case.x)
    if case.expected is None:
        with pytest.raises(ValueError, match="every expert's input_scale is 0"):
            run_case(case)
    else:
        assert torch.isfinite(unify_input_scales(scales, "per_expert")[0]).all()


def test_check_case_fails_on_a_wrong_bit():
    """The runner is a check that can fail: -0.0 against +0.0, and a value off by one ulp."""
    case = next(c for c in NAMED_CASES if c.name == "mx_negative_zero")
    flipped = type(case)(case.name, case.op, case.scheme, case.x, (0.0,) + case.expected[1:], case.why, case.params)
    assert not check_case(flipped).ok
    a = torch.tensor([1.0, float("nan")])
    assert bits_mismatch(a, a.clone()) == ""
    assert "1 of 2 differ" in bits_mismatch(a, torch.tensor([1.0000001, float("nan")]))
    assert bits_mismatch(a, torch.tensor([1.0, 0.0])) != ""
