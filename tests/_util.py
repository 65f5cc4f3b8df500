"""Comparison helpers shared by the tests, and the headless browser the rendering tests drive."""

import os
import shutil
import subprocess
import tempfile
import time

import pytest
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


_SAME_SIZE_INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def assert_same_bits(actual, expected, what, zero_sign_free=False):
    """Bit-for-bit equality of float tensors, NaN payloads included (``assert_bits_equal`` leaves NaN payloads
    out). ``zero_sign_free`` lets -0 stand for +0: ModelOpt's ``NVFP4QTensor.dequantize`` decodes e2m1 code 8
    (-0) as +0.0 where mxlib gives -0.0, and the tools' activation QDQ turns a negative value that rounds to zero
    into +0.0."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (
        f"{what}: {actual.dtype} {list(actual.shape)} vs {expected.dtype} {list(expected.shape)}"
    )
    iv = _SAME_SIZE_INT[actual.dtype]
    bad = actual.view(iv) != expected.view(iv)
    if zero_sign_free:
        bad &= ~((actual == 0) & (expected == 0))
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {bad.numel()} values differ, first at {bad.nonzero()[0].tolist()}"
    )


KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# A test that runs the triton / fused backends on CPU tensors runs them in Triton's interpreter; on a CUDA
# machine (no TRITON_INTERPRET) those kernels take CUDA tensors only, and the GPU twin of such a test is a
# ``tests/test_gpu_*.py`` file.
needs_interpreter = pytest.mark.skipif(
    torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs Triton kernels on CPU tensors (the interpreter); its GPU twin is a tests/test_gpu_*.py file",
)


class OnKernelDevice:
    """A module of Triton twins (``mxlib.kernels``) called on the device its kernels run on:
    tensor arguments moved to ``cuda`` when there is one (compiled kernels cannot read CPU
    memory), tensor results moved back to the CPU, so that a test comparing with the CPU
    reference runs unchanged on the CPU (interpreter) and on a GPU. Errors pass through."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        fn = getattr(self._module, name)
        if not callable(fn) or isinstance(fn, type):
            return fn

        def call(*args, **kwargs):
            to = lambda v: v.to(KERNEL_DEVICE) if isinstance(v, torch.Tensor) else v  # noqa: E731
            back = lambda v: v.cpu() if isinstance(v, torch.Tensor) else v  # noqa: E731
            out = fn(*[to(a) for a in args], **{k: to(v) for k, v in kwargs.items()})
            return tuple(back(o) for o in out) if isinstance(out, tuple) else back(out)

        return call


def nvfp4_experts(
    w13_weight,
    w13_weight_scale,
    w13_weight_scale_2,
    w2_weight,
    w2_weight_scale,
    w2_weight_scale_2,
    w13_input_scale,
    w2_input_scale,
    **kwargs,
):
    """NVFP4 emulation experts from the eight ModelOpt tensors in vLLM's order (stacked over experts);
    ``kwargs``: the constructor's keywords and ``FusedMoEQuantConfig`` fields."""
    from mxlib.formats import NVFP4
    from mxlib.moe import NVFP4_MOE, ExpertWeights, Nvfp4QuantizationEmulationTritonExperts

    weights = ExpertWeights(
        NVFP4, w13_weight, w13_weight_scale, w2_weight, w2_weight_scale, w13_weight_scale_2, w2_weight_scale_2
    )
    config, kwargs = _config_of(NVFP4_MOE, kwargs)
    return Nvfp4QuantizationEmulationTritonExperts(weights, config, w13_input_scale, w2_input_scale, **kwargs)


def mx_experts(scheme, w13_weight, w13_weight_scale, w2_weight, w2_weight_scale, **kwargs):
    """OCP MX emulation experts of ``scheme`` from the four packed tensors (stacked over experts)."""
    from mxlib.moe import ExpertWeights, OCP_MXQuantizationEmulationTritonExperts, get_moe_scheme

    s = get_moe_scheme(scheme)
    weights = ExpertWeights(s.weight, w13_weight, w13_weight_scale, w2_weight, w2_weight_scale)
    config, kwargs = _config_of(s, kwargs)
    return OCP_MXQuantizationEmulationTritonExperts(weights, config, **kwargs)


def _config_of(scheme, kwargs: dict):
    """``(FusedMoEQuantConfig of scheme with the config fields in kwargs, the other kwargs)``."""
    import dataclasses

    from mxlib.moe import FusedMoEQuantConfig

    names = {f.name for f in dataclasses.fields(FusedMoEQuantConfig)}
    fields = {k: v for k, v in kwargs.items() if k in names}
    return FusedMoEQuantConfig(scheme, **fields), {k: v for k, v in kwargs.items() if k not in names}


# The tiny Qwen3-MoE config of the checkpoint and bad-input tests (with mxlib.models.qwen3's
# qwen3_30b_a3b_config(num_hidden_layers=2, **TINY_QWEN3)): 4 experts of hidden 64, intermediate 32.
TINY_QWEN3 = dict(
    hidden_size=64,
    moe_intermediate_size=32,
    num_experts=4,
    num_experts_per_tok=2,
    vocab_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    bos_token_id=0,
    eos_token_id=1,
)


def chromium_binary() -> str:
    """The headless browser's path; fails with the command that installs it."""
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail("chromium not found: run tools/ensure_chromium.sh (Debian: apt-get install -y chromium)")


def tiny_calibrated(seed: int, tokens: int = 24, layers: int = 2, ids_seed: int = 0):
    """The checkpoint tests' tiny Qwen3-MoE: ``dummy_qwen3_moe`` of ``TINY_QWEN3`` with ``layers`` layers
    (``seed``, ``expert_spread=0.5``), ``[2, tokens]`` token ids below 128 (``torch.Generator`` seeded
    ``ids_seed``) and the calibration on them: ``(model, calibration, ids)``."""
    from mxlib.models.calibration import calibrate
    from mxlib.models.qwen3 import dummy_qwen3_moe, qwen3_30b_a3b_config

    cfg = qwen3_30b_a3b_config(num_hidden_layers=layers, **TINY_QWEN3)
    model = dummy_qwen3_moe(cfg, seed=seed, expert_spread=0.5)
    ids = torch.randint(0, 128, (2, tokens), generator=torch.Generator().manual_seed(ids_seed))
    return model, calibrate(model, ids), ids


def stored_tensors(folder) -> dict:
    """Every tensor of every ``*.safetensors`` file in ``folder``, by name."""
    from pathlib import Path

    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


INTEROP = __import__("pathlib").Path(__file__).parent / "fixtures" / "interop"


def interop_fixture(name: str) -> tuple[dict, dict]:
    """A producer-made fixture of ``tests/fixtures/interop`` (``tools/interop``): ``(meta.json, the tool's results
    tensors)``."""
    import json

    from safetensors.torch import load_file

    folder = INTEROP / name
    return json.loads((folder / "meta.json").read_text()), load_file(str(folder / "tool_results.safetensors"))


def edited_checkpoint(tiny, folder, layout, scheme, edit_config=None, edit_tensor=None):
    """``tiny``'s model written in ``layout`` at ``folder``, then its ``quantization_config`` passed to
    ``edit_config(qc)`` (edited in place) and each stored tensor replaced by ``edit_tensor(name, tensor)``."""
    import json

    from safetensors.torch import load_file, save_file

    from mxlib import checkpoints as C

    model, cal, _ = tiny
    path = C.write_quantized_checkpoint(model, scheme, folder, cal, layout=layout)
    if edit_config is not None:
        cfg = json.loads((path / "config.json").read_text())
        edit_config(cfg["quantization_config"])
        (path / "config.json").write_text(json.dumps(cfg))
    if edit_tensor is not None:
        for f in path.glob("*.safetensors"):
            t = load_file(str(f))
            save_file({k: edit_tensor(k, v) for k, v in t.items()}, str(f), metadata={"format": "pt"})
    return path


def peak_memory(argv: list[str], **popen_kwargs) -> tuple[dict, subprocess.CompletedProcess]:
    """Run ``argv`` and sample its ``/proc/<pid>/status`` every 2 ms: the peaks of ``RssAnon`` (memory the process
    itself allocated: what it holds) and ``VmRSS`` (that plus resident file-backed pages, e.g. mapped safetensors
    shards, which the kernel may drop at any time and whose count depends on the page cache, i.e. on what else
    runs on the machine), in bytes. Linux only. Returns ``({"anon": ..., "rss": ...}, completed process)`` with
    stdout and stderr as text."""
    peaks = {"anon": 0, "rss": 0}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, text=True, **popen_kwargs)
        status = f"/proc/{proc.pid}/status"
        while proc.poll() is None:
            try:
                with open(status) as f:
                    fields = dict(line.split(":", 1) for line in f if ":" in line)
                peaks["anon"] = max(peaks["anon"], int(fields["RssAnon"].split()[0]) * 1024)
                peaks["rss"] = max(peaks["rss"], int(fields["VmRSS"].split()[0]) * 1024)
            except (FileNotFoundError, KeyError, ProcessLookupError):  # exited between poll and read, or a zombie
                pass
            time.sleep(0.002)
        out.seek(0)
        err.seek(0)
        done = subprocess.CompletedProcess(argv, proc.returncode, out.read(), err.read())
    return peaks, done
