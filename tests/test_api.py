"""The public API of ``import mxlib`` and the torchao / vLLM / Quark mapping of docs/api-mapping.md.

* ``import mxlib`` imports neither torch, transformers nor triton (the console script imports the
  package before it parses its arguments); every name of ``__all__`` resolves, is the object of the
  module that defines it (a re-export, not a copy) and has its own docstring.
* Scheme names: the canonical ``w_*_a_*`` names, the other tools' names mapped onto them, and the
  bare format names refused where a MoE scheme is expected.
* torchao interop (skipped where torchao is not installed): mxlib's bytes against torchao's own
  ``to_mx`` and NVFP4 functions, under the mapping the document states.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mxlib
from mxlib import reference as R
from mxlib.formats import BLOCK_SCHEMES
from mxlib.moe.schemes import MOE_SCHEMES, SCHEME_ALIASES, get_moe_scheme, get_weight_format

from _util import assert_bits_equal

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "triton")


def _python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_import_mxlib_imports_no_heavy_package():
    code = (
        "import sys, mxlib\n"
        "names = dir(mxlib)\n"
        f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "assert set(mxlib.__all__) <= set(names), set(mxlib.__all__) - set(names)\n"
        "print(len(mxlib.__all__))\n"
    )
    r = _python(code)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) == len(mxlib.__all__) > 20


def test_first_use_imports_only_what_the_name_needs():
    r = _python("import sys, mxlib\nmxlib.quantize_mx\nprint('torch' in sys.modules, 'transformers' in sys.modules)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "False"]  # the tensor functions do not load the model code


PUBLIC = [n for n in mxlib.__all__ if n != "__version__"]


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_name_resolves_to_its_module_object_with_a_docstring(name):
    obj = getattr(mxlib, name)
    module = sys.modules[mxlib._LAZY[name]]
    assert getattr(module, name) is obj  # re-exported, not a copy
    doc = obj.__dict__.get("__doc__") if isinstance(obj, type) else obj.__doc__
    assert doc and len(doc.strip()) > 40, f"{name}: no docstring of its own"
    assert obj.__module__.startswith("mxlib."), obj.__module__


def test_family_names_exported():
    """The family registry and the family-generic loader sit beside the Qwen3-MoE loader."""
    from transformers import MixtralConfig, Qwen3MoeConfig

    from mxlib.checkpoints import loader
    from mxlib.models import families

    assert {"family_of", "load_quantized_moe", "load_quantized_qwen3_moe"} <= set(mxlib.__all__)
    assert mxlib.load_quantized_moe is loader.load_quantized_moe
    assert mxlib.family_of is families.family_of
    assert mxlib.family_of(Qwen3MoeConfig()).architecture == "Qwen3MoeForCausalLM"
    assert mxlib.family_of(MixtralConfig()).architecture == "MixtralForCausalLM"


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'mxlib' has no attribute 'quantise_mx'"):
        mxlib.quantise_mx  # noqa: B018


def test_experts_forward_docstrings_give_shapes_and_dtypes():
    for cls in (mxlib.TritonExperts, mxlib.Nvfp4QuantizationEmulationTritonExperts):
        doc = inspect.getdoc(cls.forward)
        assert "[M, H]" in doc and "[M, k]" in doc and "topk_ids" in doc and "dtype" in doc, doc
        assert "Define the computation" not in doc  # not nn.Module's boilerplate


def test_the_readme_tasks_run_from_the_package():
    x = torch.randn(4, 64).to(torch.bfloat16)
    packed, scale = mxlib.quantize_mx(x, "e2m1")
    assert torch.equal(mxlib.dequantize_mx(packed, scale, "e2m1"), mxlib.quant_dequant_mx(x, "e2m1"))
    assert mxlib.get_moe_scheme("w_mxfp4_a_mxfp4") is MOE_SCHEMES["w_mxfp4_a_mxfp4"]


# ----------------------------------------------------------------------------- scheme names

# other tools' names -> what they quantize, typed in from their sources (docs/api-mapping.md)
OTHER_NAMES = {
    "w_fp4_a_fp4": ("mxfp4", "mxfp4"),  # vLLM OCP_MX_Scheme, before the mx prefix
    "w_fp4_a_fp6_e3m2": ("mxfp4", "mxfp6_e3m2"),
    "w_fp4_a_fp6_e2m3": ("mxfp4", "mxfp6_e2m3"),
    "w_fp6_e3m2_a_fp6_e3m2": ("mxfp6_e3m2", "mxfp6_e3m2"),
    "w_fp6_e2m3_a_fp6_e2m3": ("mxfp6_e2m3", "mxfp6_e2m3"),
    "mxfp4_weight_only": ("mxfp4", None),  # Quark templates
    "mxfp4_fp8": ("mxfp4", "fp8_e4m3"),
    "mxfp4_mxfp6_e2m3": ("mxfp4", "mxfp6_e2m3"),
    "modelopt_fp4": ("nvfp4", "nvfp4"),  # vLLM's ModelOpt NVFP4 method
    "w_nvfp4_a_nvfp4": ("nvfp4", "nvfp4"),
    "w_mx_fp8_a_mx_fp8": ("mxfp8_e4m3", "mxfp8_e4m3"),  # Quark's older MXFP8 name
    "W4A16_NVFP4": ("nvfp4", None),  # ModelOpt's weight-only NVFP4 quant_algo
    "NVFP4A16": ("nvfp4", None),  # compressed-tensors' preset
    "nvfp4_w4a16": ("nvfp4", None),
    "w_nvfp4": ("nvfp4", None),
}


@pytest.mark.parametrize("name", sorted(OTHER_NAMES))
def test_other_tools_scheme_names_map_to_what_they_quantize(name):
    s = get_moe_scheme(name)
    weight, act = OTHER_NAMES[name]
    assert s.weight.name == weight and (s.activation.name if s.activation else None) == act
    assert s is MOE_SCHEMES[SCHEME_ALIASES[name]]


@pytest.mark.parametrize("name", list(MOE_SCHEMES))
def test_canonical_names_say_what_is_quantized(name):
    s = get_moe_scheme(name)
    assert s.name == name
    if name not in ("nvfp4", "w4a16_nvfp4"):
        weight, _, act = name.removeprefix("w_").partition("_a_")
        full = {"fp8": "fp8_e4m3", "mxfp8": "mxfp8_e4m3"}  # Quark's short names in scheme names
        assert s.weight.name == full.get(weight, weight)
        assert (s.activation.name if s.activation else "") == full.get(act, act)


def test_bare_mxfp4_is_not_a_moe_scheme_and_the_error_names_both_meanings():
    with pytest.raises(ValueError, match="'mxfp4' is a tensor format.*'w_mxfp4_a_mxfp4'.*Quark.*'w_mxfp4'.*vLLM"):
        get_moe_scheme("mxfp4")


@pytest.mark.parametrize("name", [n for n in BLOCK_SCHEMES if n not in ("mxfp4", "nvfp4")])
def test_other_bare_format_names_are_refused_as_moe_schemes(name):
    with pytest.raises(ValueError, match=f"'{name}' is a tensor format.*'w_{name}'.*'w_{name}_a_{name}'"):
        get_moe_scheme(name)


@pytest.mark.parametrize("name", list(BLOCK_SCHEMES))
def test_a_format_name_is_the_weight_format_where_one_tensor_format_is_asked(name):
    assert get_weight_format(name) is BLOCK_SCHEMES[name]


# ----------------------------------------------------------------------------- torchao interop

try:  # torchao's prototype MX code, where installed
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    HAVE_TORCHAO = True
except ImportError:  # pragma: no cover - depends on the environment
    HAVE_TORCHAO = False

torchao_only = pytest.mark.skipif(not HAVE_TORCHAO, reason="torchao is not installed")

# mxlib element -> torchao's elem_dtype argument
TORCHAO_ELEMENTS = {
    "e2m1": torch.float4_e2m1fn_x2,
    "e4m3": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
    "e2m3": "fp6_e2m3",
    "e3m2": "fp6_e3m2",
}


def _wide(rows=16, k=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, k, generator=g) * torch.logspace(-3, 3, k)).to(torch.bfloat16)


@torchao_only
@pytest.mark.parametrize("mode", ["floor", "even", "rceil"])
@pytest.mark.parametrize("element", sorted(TORCHAO_ELEMENTS))
def test_quantize_mx_bytes_equal_torchao_to_mx(element, mode):
    x = _wide()
    ao_scale, ao_data = to_mx(x, TORCHAO_ELEMENTS[element], 32, getattr(ScaleCalculationMode, mode.upper()))
    packed, scale = R.quantize_mx(x, element, 32, mode, scale_dtype=torch.float8_e8m0fnu)
    assert ao_scale.dtype == scale.dtype == torch.float8_e8m0fnu
    assert torch.equal(scale.view(torch.uint8), ao_scale.view(torch.uint8))
    if element in ("e2m3", "e3m2"):  # torchao keeps FP6 codes one a byte
        assert torch.equal(R.unpack_codes(packed, element), ao_data.view(torch.uint8))
    else:
        if element != "e2m1":  # FP8 data: the float8 dtype itself, as packed_dtype gives it
            assert ao_data.dtype == TORCHAO_ELEMENTS[element]
        assert torch.equal(packed, ao_data.view(torch.uint8))


@torchao_only
def test_the_default_rules_differ_and_floor_gives_torchao_bits():
    # amax 1.75 (e2m1, emax 2): "even" rounds it to 2.0 first, scale 2**(1 - 2) (byte 126);
    # "floor" takes 2**(floor(log2 1.75) - 2) = 2**-2 (byte 125), torchao's default
    x = torch.full((1, 32), 0.5, dtype=torch.bfloat16)
    x[0, 0] = 1.75
    ao_scale, _ = to_mx(x, torch.float4_e2m1fn_x2, 32)  # torchao's default rule
    assert int(R.quantize_mx(x, "e2m1")[1]) == 126  # mxlib's default, even
    assert int(ao_scale.view(torch.uint8)) == 125 == int(R.quantize_mx(x, "e2m1", scale_mode="floor")[1])


@torchao_only
def test_nvfp4_per_tensor_scale_is_mxlibs_decode_global_scale():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g).to(torch.bfloat16)
    per_tensor_scale = per_tensor_amax_to_scale(x.float().abs().amax())
    packed, block_scale, weight_scale_2 = R.quantize_nvfp4(x)
    assert_bits_equal(weight_scale_2, per_tensor_scale.float())  # amax / 2688: a decode scale
    t = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_tensor_scale)
    # torchao's bytes, decoded by mxlib with torchao's per-tensor scale as the decode global_scale,
    # are torchao's own dequantized values
    mine = R.dequantize_to_dtype(t.qdata.view(torch.uint8), t.scale, per_tensor_scale, torch.float32)
    assert_bits_equal(mine, t.dequantize(torch.float32))
    # the block scales are equal; element codes may differ at rounding ties (torchao multiplies by
    # (1 / per_tensor_scale) / block_scale where ModelOpt divides by block_scale * weight_scale_2)
    assert torch.equal(block_scale.view(torch.uint8), t.scale.view(torch.uint8).reshape(block_scale.shape))
    assert torch.equal(packed, t.qdata.view(torch.uint8).reshape(packed.shape))  # none on this data
