"""The trained model's task accuracy through the fused backend equals the torch backend's within the noise floor
(a CUDA GPU; skipped without one).

The ``test`` recipe of ``mxlib.models.training`` is trained on the CPU (about 30 s; cached in a temporary folder),
moved to the GPU and evaluated on 1000 held-out prompts per task (``mxlib.models.evaluation``). The noise floor is
the bf16 model's own, measured on the GPU first (``noise_floor``: another batch composition, left padding, the eager
experts, mxlib's bf16 ``TritonExperts``). Then, for NVFP4 and ``w_mxfp4_a_mxfp4``, the same quantized weights and
calibrated scales run through the ``torch`` experts (the pure-PyTorch reference MoE) and the ``fused`` experts (the
fused FP4 Triton kernel): their exact-match and NLL differences, paired over the same prompts, must lie within the
noise floor. The noise floor can be 0 on a GPU (every variant giving the same outcome on every prompt), so exact match
is allowed one prompt of slack (``1 / n``). Run with ``-s`` to see the numbers.
"""

import os

import pytest
import torch

from mxlib.models import evaluation as ev
from mxlib.models import training as tr
from mxlib.models.tasks import make_dataset

pytestmark = pytest.mark.gpu

# MXLIB_GPU_ACCURACY_RECIPE=default runs the workbook's model (about 2 minutes of training on the CPU)
RECIPE = tr.get_recipe(os.environ.get("MXLIB_GPU_ACCURACY_RECIPE", "test"))
PROMPTS = 1000  # held-out prompts per task
CALIB_PROMPTS = 128  # training-split prompts per task for NVFP4's static activation scales
# (scheme, NVFP4 activation-scale strategy): static calibrated scales, per-token dynamic scales, MXFP4 W4A4
SCHEMES = (("nvfp4", "max"), ("nvfp4", "per_token"), ("w_mxfp4_a_mxfp4", None))
# NLL slack when the noise floor is 0: the fused kernel accumulates its GEMMs in another order than torch's matmul
NLL_SLACK = 1e-3


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    model = tr.train(RECIPE, tmp_path_factory.mktemp("trained")).to("cuda")
    sets = [make_dataset(t, PROMPTS, 0, "heldout") for t in RECIPE.tasks]
    cal = ev.calibrate_tasks(model, [make_dataset(t, CALIB_PROMPTS, 0, "train") for t in RECIPE.tasks])
    nf = ev.noise_floor(model, sets)
    print(
        f"\nbf16 on {torch.cuda.get_device_name()}: "
        + ", ".join(f"{t} {r.exact_match}" for t, r in nf["reference"].tasks.items())
    )
    print(f"noise floor: {nf['noise_floor']}")
    return model, sets, cal, nf["noise_floor"]


@pytest.mark.filterwarnings("ignore:w13_input_scale:UserWarning", "ignore:w2_input_scale:UserWarning")
@pytest.mark.parametrize("scheme, strategy", SCHEMES)
def test_fused_backend_matches_torch_within_the_noise_floor(trained, scheme, strategy):
    model, sets, cal, noise_floor = trained
    results = {}
    kwargs = {} if strategy is None else dict(scale_strategy=strategy)
    for backend in ("torch", "fused"):
        with ev.emulated_experts(model, scheme, cal, backend=backend, **kwargs) as m:
            results[backend] = ev.evaluate(m, sets)
    diffs = ev.compare(results["torch"], results["fused"])
    for t, d in diffs.items():
        em, nll = d["exact_match"], d["nll_per_token"]
        print(
            f"{scheme} ({strategy or 'block scales'}) {t}: torch {results['torch'].tasks[t].exact_match}, "
            f"fused {results['fused'].tasks[t].exact_match}; "
            f"fused - torch: exact match {em} ({em.flips} flips), NLL/token {nll}; noise floor {noise_floor[t]}"
        )
        n = results["torch"].tasks[t].n
        assert abs(em.estimate) <= max(noise_floor[t]["exact_match"], 1 / n), (scheme, t, str(em), noise_floor[t])
        assert abs(nll.estimate) <= max(noise_floor[t]["nll_per_token"], NLL_SLACK), (
            scheme,
            t,
            str(nll),
            noise_floor[t],
        )
        # the fused run is a quantized model, not bf16: it must score like the torch one, not merely near bf16
        assert results["fused"].tasks[t].exact_match.estimate >= 0.9, (scheme, t)
