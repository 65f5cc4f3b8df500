"""``mxlib quantize SRC DST``: a bf16 checkpoint folder quantized layer by layer.

The oracle of each output is mxlib's in-memory path on the same bf16 model, which never reads a folder:
``write_quantized_checkpoint`` of the model (calibrated with ``calibrate`` on the same token ids in one
batch) must give the same tensors, byte for byte, and the loaded output's logits must equal the bf16
model with the same quantized experts swapped in (``make_emulation_experts``), bit for bit. The sources are
written by transformers' own ``save_pretrained`` (sharded, with a word-level tokenizer), as a user has them.

The memory test writes a two-layer checkpoint of Qwen3-30B-A3B's layer shape (hidden 2048, 128 experts,
expert intermediate 768) and measures the command's peak resident memory in a separate process.
"""

import json
import os
import stat
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from test_families_roundtrip import CONFIGS as FAMILY_CONFIGS
from test_families_roundtrip import _config as family_config

from mxlib.cli import main as cli_main
from mxlib.models.calibration import calibrate
from mxlib.models.checkpoints import load_quantized_moe, write_quantized_checkpoint
from mxlib.models.checkpoints.streaming import calibration_token_ids
from mxlib.models.gpt_oss import gpt_oss_20b_config
from mxlib.models.moe_models import dummy_moe_model, expert_weights, moe_layers, swap_experts
from mxlib.models.qwen3 import qwen3_30b_a3b_config
from mxlib.moe import input_scales_from_amax, make_emulation_experts, quantize_expert_weights

ROOT = Path(__file__).resolve().parents[1]
WORDS = [f"w{x}" for x in range(60)]


def tiny_config(cls_name: str):
    """Each registered family's tiny config (hidden 64)."""
    if cls_name == "Qwen3MoeForCausalLM":
        return qwen3_30b_a3b_config(2, **_qwen3_tiny())
    if cls_name == "GptOssForCausalLM":
        from mxlib.models.gpt_oss import gpt_oss_preset_overrides

        return gpt_oss_20b_config(2, **gpt_oss_preset_overrides("gpt-oss-tiny"))
    return family_config(cls_name)


def _qwen3_tiny() -> dict:
    from mxlib.models.qwen3 import model_preset_overrides

    return model_preset_overrides("tiny")


FAMILIES = ["Qwen3MoeForCausalLM", *FAMILY_CONFIGS, "GptOssForCausalLM"]


def save_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer ``w0 .. w59`` (ids 1..60, ``[UNK]`` 0) saved as transformers saves one."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, **{w: x + 1 for x, w in enumerate(WORDS)}}
    assert len(vocab) <= vocab_size
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(folder)


def calibration_text(num_words: int, seed: int = 0) -> str:
    g = torch.Generator().manual_seed(seed)
    return " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (num_words,), generator=g))


def bf16_folder(model, folder: Path, shard: str = "20KB") -> Path:
    """``save_pretrained`` (sharded) with a tokenizer and a chat template: a user's bf16 checkpoint folder."""
    model.save_pretrained(folder, max_shard_size=shard)
    save_tokenizer(folder, model.config.vocab_size)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    return folder


def tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({n: h.get_tensor(n) for n in h.keys()})
    return out


def assert_same_tensors(got: Path, want: Path) -> None:
    a, b = tensors(got), tensors(want)
    assert sorted(a) == sorted(b)
    for n in a:
        assert a[n].dtype == b[n].dtype and a[n].shape == b[n].shape, n
        assert torch.equal(a[n].reshape(-1).view(torch.uint8), b[n].reshape(-1).view(torch.uint8)), n


def logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.float()


def emulated_logits(model, scheme: str, cal, ids) -> torch.Tensor:
    """The bf16 model with its experts quantized in memory and swapped in (no checkpoint), restored after."""

    def make(i):
        w13, w2 = expert_weights(model, i)
        s13 = s2 = None
        if cal is not None:
            lc = cal.layer(i)
            s13, s2 = input_scales_from_amax(scheme, lc.a1_amax, lc.a2_amax)
        from mxlib.models.moe_models import expert_activation, expert_biases

        b = expert_biases(model, i) or (None, None)
        return make_emulation_experts(
            scheme,
            quantize_expert_weights(w13, w2, scheme),
            s13,
            s2,
            backend="torch",
            activation=expert_activation(model),
            w13_bias=b[0],
            w2_bias=b[1],
        )

    saved = [m.experts for m in moe_layers(model)]
    swap_experts(model, make)
    try:
        return logits(model, ids)
    finally:
        for m, ex in zip(moe_layers(model), saved):
            m.experts = ex
        del model.save_pretrained  # swap_experts' refusal


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """``{class name: (bf16 model, its save_pretrained folder)}``."""
    out = {}
    for n in FAMILIES:
        model = dummy_moe_model(tiny_config(n), seed=0, expert_spread=0.3)
        out[n] = (model, bf16_folder(model, tmp_path_factory.mktemp(n) / "bf16"))
    return out


# (scheme, layout) per family: a static-activation-scale scheme where the family's layouts store one
FAMILY_WRITES = {n: ("nvfp4", "modelopt") for n in FAMILIES}
FAMILY_WRITES["GptOssForCausalLM"] = ("w_mxfp4", "gpt-oss-mxfp4")


@pytest.mark.parametrize("cls_name", FAMILIES)
def test_command_equals_in_memory_quantization(cls_name, sources, tmp_path):
    """Per family: the command's checkpoint is the in-memory writer's, tensor for tensor, and loads to logits
    equal (bit for bit) to the bf16 model with the same quantized experts swapped in."""
    model, src = sources[cls_name]
    scheme, layout = FAMILY_WRITES[cls_name]
    text = tmp_path / "calib.txt"
    text.write_text(calibration_text(96))
    dst = tmp_path / "q"
    argv = ["quantize", str(src), str(dst), "--scheme", scheme, "--layout", layout, "--calib-seq-len", "32"]
    assert cli_main([*argv, "--calibration", str(text), "--json", str(tmp_path / "r.json")]) == 0
    ids = calibration_token_ids(src, text.read_text(), seq_len=32)
    assert list(ids.shape) == [3, 32]
    cal = calibrate(model, ids, batch_size=len(ids))
    want = write_quantized_checkpoint(model, scheme, tmp_path / "want", cal, layout=layout)
    assert_same_tensors(dst, want)
    got_cfg, want_cfg, src_cfg = (json.loads((p / "config.json").read_text()) for p in (dst, want, src))
    # the source's config.json as it is, with the writer's fields (the in-memory writer's comes from the config
    # object, which holds fields transformers' save moves elsewhere: rope_theta into rope_parameters)
    stored = dict(src_cfg, architectures=[cls_name], torch_dtype="bfloat16")
    assert got_cfg == dict(stored, quantization_config=want_cfg["quantization_config"])
    for f in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (dst / f).read_bytes() == (src / f).read_bytes(), f
    for f in dst.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~_umask(), f
    loaded, _ = load_quantized_moe(dst, backend="torch")
    eval_ids = torch.arange(1, 17)[None] % model.config.vocab_size
    want_logits = emulated_logits(model, scheme, cal if scheme == "nvfp4" else None, eval_ids)
    assert torch.equal(logits(loaded, eval_ids), want_logits)
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["architecture"] == cls_name and result["calibration_tokens"] == 96


def _umask() -> int:
    m = os.umask(0o022)
    os.umask(m)
    return m
