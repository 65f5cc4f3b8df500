"""The named corner cases (mxlib.cases), run through the reference and through the Triton kernels.

Expected values in the table were worked out by hand; both implementations must produce them bit for
bit (NaN positions equal, signs of zero equal).
"""

import pytest
import torch

from mxlib import kernels as K
from mxlib import reference as R
from mxlib.cases import NAMED_CASES
from mxlib.formats import BLOCK_SCHEMES
from mxlib.moe import unify_input_scales

from _util import assert_bits_equal

RUNNABLE = [c for c in NAMED_CASES if c.op != "unify_input_scales"]


def run_case(case, impl, device):
    x = torch.tensor(case.x, dtype=torch.float32, device=device).reshape(1, -1)
    scheme = BLOCK_SCHEMES[case.scheme]
    mode = case.params.get("scale_mode", "even")
    gs = torch.tensor([case.params.get("global_scale", 1.0)], device=device)
    if case.op == "qdq":
        if scheme.name == "nvfp4":
            return impl.ref_nvfp4_quant_dequant(x, gs, 16)
        return impl.quant_dequant_mx(x, scheme.element.name, 32, mode)
    if case.op == "scale":
        if scheme.name == "nvfp4":
            return R.ref_nvfp4_quant(x.cpu(), gs.cpu(), 16)[1]  # block scales come from the reference only
        return impl.quantize_mx(x, scheme.element.name, 32, mode)[1].float()
    if case.op == "decode_e8m0":
        return R.decode_e8m0(x.cpu().to(torch.uint8))
    if case.op == "quantize_nvfp4_weight":
        packed, scale, ws2 = impl.quantize_nvfp4(x)
        deq = impl.dequantize_to_dtype(packed, scale, ws2, torch.float32)
        assert torch.isfinite(deq).all()
        return ws2.reshape(1)
    raise AssertionError(case.op)


@pytest.mark.parametrize("case", RUNNABLE, ids=[c.name for c in RUNNABLE])
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_named_case(case, impl, device):
    module = R if impl == "reference" else K
    dev = "cpu" if impl == "reference" else device
    got = run_case(case, module, dev).flatten().float().cpu()
    assert_bits_equal(got, torch.tensor(case.expected, dtype=torch.float32), case.name)


def test_unification_cases():
    for case in [c for c in NAMED_CASES if c.op == "unify_input_scales"]:
        scales = torch.tensor(case.x)
        if case.expected is None:
            with pytest.raises(ValueError, match="every expert's input_scale is 0"):
                unify_input_scales(scales, "max", "w13_input_scale")
        else:
            gs, _ = unify_input_scales(scales, "per_expert")
            assert torch.isfinite(gs).all()
            assert unify_input_scales(scales, "max")[0][0].item() == case.expected[0]
