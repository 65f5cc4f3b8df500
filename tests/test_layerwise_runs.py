"""Running quantized variants layer by layer gives the bits of one forward per variant.

``scheme_study.run_variants_layerwise`` replays each decoder layer's call arguments (recorded by
``reference_run`` from the model's own forward) for every (variant, token set) before the next layer, so
that one layer's dequantized weights serve every variant while they are kept (fp32, ``KeptDequantized``).
The oracle is ``run_model`` with each variant's experts swapped in, one whole forward each, dequantizing at
every forward: the layer outputs and the logits must be equal bit for bit, on Qwen3 and gpt-oss (whose layers
alternate sliding-window and full attention masks). A variant with the wrong number of experts is refused.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from mxlib.models.qwen3 import expert_weights
from mxlib.moe.factory import quantize_expert_weights
from mxlib.moe.kept_weights import KeptDequantized
from mxlib.studies import steps
from mxlib.studies.scheme_study import (
    _let_go,
    _scheme_experts,
    experts_swapped,
    reference_run,
    run_variants_layerwise,
)


@pytest.mark.parametrize(
    "preset, schemes",
    [
        ("tiny", "w_mxfp4,w_mxfp4_a_mxfp4,w_mxfp4_a_fp8"),
        ("tiny", "nvfp4,w4a16_nvfp4"),
        ("gpt-oss-tiny", "w_mxfp4,w_mxfp4_a_mxfp4"),
    ],
)
def test_layerwise_variants_give_the_bits_of_one_forward_each(preset, schemes, tmp_path, monkeypatch):
    monkeypatch.setenv("MXLIB_CACHE", str(tmp_path))
    warnings.simplefilter("ignore")
    model = steps.dummy_model(2, seed=0, model_preset=preset)
    cal = steps.calibrate_model(model, 64, 0)
    sets = [steps.random_token_ids(12, 1 + r, model.config.vocab_size) for r in range(2)]
    ref_runs = [reference_run(model, ids) for ids in sets]
    for (ref, _), ids in zip(ref_runs, sets):  # recording the layers' inputs changes nothing
        plain = steps.run_model(model, ids)
        assert torch.equal(ref.logits, plain.logits)
    group = steps.check_schemes(schemes)
    nl = len(model.model.layers)
    quantized = [quantize_expert_weights(*expert_weights(model, li), group[0].weight) for li in range(nl)]
    variants = [_scheme_experts(s, quantized, cal, "torch", "vllm") for s in group]
    outs = run_variants_layerwise(model, [i for _, i in ref_runs], [v for v, _ in variants], _let_go(variants))
    for (experts, _), runs in zip(variants, outs):
        stores = [ex.kept_dequantized for ex in experts]
        assert all(isinstance(st, KeptDequantized) and st.dtype == torch.float32 and not st.experts for st in stores)
        for ex in experts:  # the oracle: dequantize at every forward
            ex.keep_dequantized = False
        with experts_swapped(model, experts):
            for ids, out in zip(sets, runs):
                want = steps.run_model(model, ids)
                assert torch.equal(out.logits, want.logits)
                assert len(out.layer_outputs) == len(want.layer_outputs) == nl
                assert all(torch.equal(a, b) for a, b in zip(out.layer_outputs, want.layer_outputs))
    refs = [i for _, i in ref_runs]
    with pytest.raises(ValueError, match="experts objects per variant"):
        run_variants_layerwise(model, refs, [variants[0][0][:1]])


def test_kept_store_refuses_a_dtype_other_than_fp32():
    with pytest.raises(ValueError, match="dtype"):
        KeptDequantized(torch.float16)
