"""What transformers' quantizer registration does with mxlib's checkpoints (the evidence docs/getting-started.md
states): a quantization method registered with ``register_quantization_config`` / ``register_quantizer`` and passed
as ``quantization_config=`` does not get to read the experts.

* A ModelOpt checkpoint (``quant_method: modelopt``, unknown to transformers): transformers loads it as unquantized,
  runs the registered quantizer with ``pre_quantized=False``, fuses the per-expert packed tensors into the bf16
  ``gate_up_proj`` / ``down_proj`` and stops on their shapes (a size mismatch).
* A compressed-tensors checkpoint: transformers dispatches on its own ``compressed-tensors`` method first (an
  ImportError without the package, else a refusal of a config of another class).

Run in a subprocess: registering a method changes transformers' registry for the rest of a process. If transformers
changes either behaviour, this test fails and the door is worth trying again.
"""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CODE = r"""
import sys, warnings
warnings.simplefilter("ignore")
import torch
from transformers import AutoModelForCausalLM
from transformers.quantizers.auto import register_quantization_config, register_quantizer
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

calls = []

@register_quantization_config("mxlib-probe")
class ProbeConfig(QuantizationConfigMixin):
    def __init__(self, **kw):
        self.quant_method = "mxlib-probe"

@register_quantizer("mxlib-probe")
class ProbeQuantizer(HfQuantizer):
    def _process_model_before_weight_loading(self, model, **kw):
        calls.append(("before", self.pre_quantized))
        return model
    def _process_model_after_weight_loading(self, model, **kw):
        calls.append(("after", self.pre_quantized))
        return model
    def is_serializable(self):
        return False
    @property
    def is_trainable(self):
        return False

outcome = {}
for name, path in (("modelopt", sys.argv[1]), ("compressed-tensors", sys.argv[2])):
    calls.clear()
    try:
        AutoModelForCausalLM.from_pretrained(path, quantization_config=ProbeConfig())
        outcome[name] = ("loaded", list(calls))
    except Exception as err:
        outcome[name] = (type(err).__name__, list(calls), str(err)[:200])
print(repr(outcome))
"""


@pytest.mark.slow
def test_a_registered_quantizer_never_reads_the_experts(tmp_path):
    import torch

    from mxlib.checkpoints import write_quantized_checkpoint
    from mxlib.models.qwen3 import dummy_qwen3_moe, qwen3_30b_a3b_config

    from _util import TINY_QWEN3

    model = dummy_qwen3_moe(qwen3_30b_a3b_config(num_hidden_layers=1, **TINY_QWEN3), seed=0)
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    modelopt = write_quantized_checkpoint(model, "nvfp4", tmp_path / "modelopt", calibration=ids)
    ct = ROOT / "tests" / "fixtures" / "interop" / "llmc_nvfp4" / "checkpoint"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [sys.executable, "-c", CODE, str(modelopt), str(ct)], capture_output=True, text=True, env=env, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    outcome = ast.literal_eval(r.stdout.strip().splitlines()[-1])
    kind, calls, *message = outcome["modelopt"]
    assert kind == "RuntimeError" and calls == [("before", False)], outcome
    assert "ignore_mismatched_sizes" in message[0]
    kind, calls, *_ = outcome["compressed-tensors"]
    assert kind in ("ImportError", "ValueError") and calls == [], outcome
