"""Scheme names as users type them: llm-compressor's presets, any letter case, "did you mean" on a near miss, and
llm-compressor's non-microscaling presets refused naming what they are; ``print(experts)`` says what runs.

The independent side for the presets: compressed-tensors' ``PRESET_SCHEMES`` (quant_scheme.py) as read there,
written out here as (bits, group size, activations): NVFP4 = 4-bit float tensor_group 16 weights and activations;
MXFP4A16 / MXFP8A16 = 4 / 8-bit float group 32 weights only; MXFP4 / MXFP8 = the same with dynamic group-32
activations.
"""

import pytest
import torch

import mxlib
from mxlib.moe.schemes import NOT_MICROSCALING, get_moe_scheme, get_weight_format

PRESETS = {  # llm-compressor preset -> (weight element bits, block size, activation element bits or None)
    "NVFP4": (4, 16, 4),
    "NVFP4A16": (4, 16, None),
    "MXFP4A16": (4, 32, None),
    "MXFP4": (4, 32, 4),
    "MXFP8A16": (8, 32, None),
    "MXFP8": (8, 32, 8),
}


@pytest.mark.parametrize("name", PRESETS)
def test_llm_compressor_presets(name):
    s = get_moe_scheme(name)
    bits, block, act = PRESETS[name]
    assert (s.weight.element.nbits, s.weight.block_size) == (bits, block)
    assert (None if s.activation is None else s.activation.element.nbits) == act
    assert get_weight_format(name) == s.weight
    for spelling in (name.lower(), name.title(), name.swapcase()):
        if spelling in ("mxfp4", "mxfp8"):
            continue  # the bare tensor-format names stay refused as ambiguous (below)
        assert get_moe_scheme(spelling) is s, spelling


def test_case_insensitive_canonical_and_alias_names():
    assert get_moe_scheme("W_MXFP4_A_MXFP4").name == "w_mxfp4_a_mxfp4"
    assert get_moe_scheme("ModelOpt_FP4").name == "nvfp4"
    assert get_moe_scheme("w4a16_NVFP4").name == "w4a16_nvfp4"


@pytest.mark.parametrize("name", ["mxfp4", "mxfp8"])
def test_bare_lower_case_formats_stay_ambiguous(name):
    with pytest.raises(ValueError, match=f"'{name}' is a tensor format.*{name.upper()}"):
        get_moe_scheme(name)


@pytest.mark.parametrize(
    "typo,want", [("nvfp5", "'nvfp4'"), ("w_mxfp4_a_mxfp9", "'w_mxfp4_a_mxfp8'"), ("MXFP4A61", "MXFP4A16")]
)
def test_did_you_mean(typo, want):
    with pytest.raises(ValueError, match=f"did you mean .*{want}"):
        get_moe_scheme(typo)


@pytest.mark.parametrize("name", sorted(NOT_MICROSCALING))
def test_non_microscaling_presets_are_named(name):
    with pytest.raises(ValueError, match=f"'{name}' is not a microscaling scheme"):
        get_moe_scheme(name)
    with pytest.raises(ValueError, match="not a microscaling scheme"):
        get_moe_scheme(name.lower())


def test_unknown_non_string_named():
    with pytest.raises(ValueError, match="scheme: expected a MoE scheme name"):
        get_moe_scheme(4)


def test_print_experts_says_what_runs():
    w13 = torch.randn(4, 64, 64, dtype=torch.bfloat16) * 0.05
    w2 = torch.randn(4, 64, 32, dtype=torch.bfloat16) * 0.05
    ex = mxlib.make_emulation_experts("MXFP4", mxlib.quantize_expert_weights(w13, w2, "MXFP4"), backend="torch")
    text = repr(ex)
    for part in (
        "num_experts=4",
        "hidden_size=64",
        "intermediate_size=32",
        "scheme=w_mxfp4_a_mxfp4",
        "activation_dtype=bfloat16",
        "numerics=vllm",
        "backend=torch",
    ):
        assert part in text, (part, text)
    ex.half()
    assert "activation_dtype=float16" in repr(ex)
    assert "scheme=unquantized" in repr(mxlib.TritonExperts(w13, w2))


@pytest.mark.parametrize("scheme", ["nvfp4", "w_mxfp4_a_mxfp4"])
def test_notebook_01_walk_resolves_the_scheme_name_once(scheme, monkeypatch, tmp_path):
    """Notebook 01's walk (check the parameters, build, write the checkpoint, load it, run it) looks the scheme's
    name up once, where it enters; every step below receives the MoEQuantScheme. Counted at the registry: every
    string a lookup resolves passes through ``SCHEME_ALIASES.get`` first."""
    import mxlib.moe.schemes as schemes
    from mxlib.studies import steps

    looked_up = []

    class Counting(dict):
        def get(self, key, default=None):
            looked_up.append(key)
            return dict.get(self, key, default)

    monkeypatch.setattr(schemes, "SCHEME_ALIASES", Counting(schemes.SCHEME_ALIASES))
    monkeypatch.setenv("MXLIB_CACHE", str(tmp_path))
    p = steps.check_e2e_parameters(
        scheme=scheme,
        model_preset="tiny",
        num_hidden_layers=2,
        num_tokens=8,
        seed=0,
        calib_tokens=32,
        device="cpu",
        experts_backend="auto",
        results_path="",
        numerics="vllm",
        repeats=1,
    )
    assert looked_up == [scheme]
    model = steps.build_model(p)
    model_q, _ = steps.load_checkpoint(p, steps.write_checkpoint(p, model))
    steps.run_model(model_q, steps.random_token_ids(8, 1, model_q.config.vocab_size))
    assert looked_up == [scheme]  # nothing below the entry looked a name up again
