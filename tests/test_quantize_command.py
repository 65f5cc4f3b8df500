"""``mxlib quantize SRC DST``: a bf16 checkpoint folder quantized layer by layer.

The oracle of each output is mxlib's in-memory path on the same bf16 model, which never reads a folder:
``write_quantized_checkpoint`` of the model (calibrated with ``calibrate`` on the same token ids in one
batch) must give the same tensors, byte for byte, and the loaded output's logits must equal the bf16
model with the same quantized experts swapped in (``make_emulation_experts``), bit for bit. The sources are
written by transformers' own ``save_pretrained`` (sharded, with a word-level tokenizer), as a user has them.

The memory test writes a two-layer checkpoint of Qwen3-30B-A3B's layer shape (hidden 2048, 128 experts,
expert intermediate 768) and measures the command's peak resident memory in a separate process.
"""

import ctypes
import ctypes.util
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from test_families_roundtrip import CONFIGS as FAMILY_CONFIGS
from test_families_roundtrip import _config as family_config

from mxlib.checkpoints import load_quantized_moe, write_quantized_checkpoint
from mxlib.checkpoints.streaming import calibration_token_ids
from mxlib.cli import main as cli_main
from mxlib.models.calibration import calibrate
from mxlib.models.gpt_oss import gpt_oss_20b_config
from mxlib.models.moe_models import dummy_moe_model, expert_weights, moe_layers, swap_experts
from mxlib.models.qwen3 import qwen3_30b_a3b_config
from mxlib.moe import input_scales_from_amax, make_emulation_experts, quantize_expert_weights

from _util import peak_memory

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
    assert result["architecture"] == cls_name
    assert result["calibration_tokens"] == (96 if scheme == "nvfp4" else 0)
    assert result["calibration_unused"] == (scheme != "nvfp4")


def _umask() -> int:
    m = os.umask(0o022)
    os.umask(m)
    return m


# ----------------------------------------------------------------------------- every layout (Qwen3-MoE)

# (scheme, layout, technique): every layout the Qwen3-MoE family is written in (gpt-oss's own above), each
# with calibration text, which the static-activation-scale schemes use and the others ignore
LAYOUT_WRITES = [
    ("w4a16_nvfp4", "modelopt", "rtn"),
    ("nvfp4", "modelopt", "four_over_six"),
    ("w_mxfp4_a_mxfp4", "quark", "rtn"),
    ("w_mxfp6_e2m3_a_fp8", "quark", "mse"),
    ("nvfp4", "compressed-tensors", "rtn"),
    ("w_mxfp4_a_mxfp4", "compressed-tensors-mxfp4", "rtn"),
    ("w_mxfp8_a_mxfp8", "modelopt-mxfp8", "rtn"),
    ("w_mxfp8", "compressed-tensors-mxfp8", "rtn"),
]


@pytest.mark.parametrize("scheme, layout, technique", LAYOUT_WRITES)
def test_every_layout_equals_the_in_memory_writer(scheme, layout, technique, sources, tmp_path):
    """Per layout (and a technique): the command's tensors and quantization config are the in-memory writer's,
    and the output loads to the same logits as the in-memory writer's checkpoint (bit for bit)."""
    model, src = sources["Qwen3MoeForCausalLM"]
    text = tmp_path / "calib.txt"
    text.write_text(calibration_text(40, seed=3))
    dst = tmp_path / "q"
    argv = ["quantize", str(src), str(dst), "--scheme", scheme, "--layout", layout, "--technique", technique]
    assert cli_main([*argv, "--calibration", str(text), "--calib-seq-len", "16"]) == 0
    ids = calibration_token_ids(src, text.read_text(), seq_len=16)
    assert list(ids.shape) == [2, 16]  # 40 tokens: two whole sequences, the last 8 left out
    cal = calibrate(model, ids, batch_size=len(ids))
    tech = None if technique == "rtn" else technique
    want = write_quantized_checkpoint(model, scheme, tmp_path / "want", cal, layout=layout, technique=tech)
    assert_same_tensors(dst, want)
    qc = [json.loads((p / "config.json").read_text())["quantization_config"] for p in (dst, want)]
    assert qc[0] == qc[1]
    eval_ids = torch.arange(3, 19)[None]
    got = logits(load_quantized_moe(dst, backend="torch")[0], eval_ids)
    assert torch.equal(got, logits(load_quantized_moe(want, backend="torch")[0], eval_ids))
    if layout == "modelopt" and technique == "rtn":  # and the in-memory emulation itself, without any checkpoint
        assert torch.equal(got, emulated_logits(model, scheme, None, eval_ids))


def test_without_calibration_and_overwrite(sources, tmp_path):
    """A dynamic-activation scheme needs no calibration; --overwrite replaces an existing folder atomically,
    and the summary says what was written where."""
    model, src = sources["MixtralForCausalLM"]
    dst = tmp_path / "q"
    dst.mkdir()
    (dst / "notes.txt").write_text("mine")
    argv = ["quantize", str(src), str(dst), "--scheme", "w_mxfp4_a_mxfp4", "--json", str(tmp_path / "r.json")]
    assert cli_main([*argv, "--overwrite"]) == 0
    assert not (dst / "notes.txt").exists()
    want = write_quantized_checkpoint(model, "w_mxfp4_a_mxfp4", tmp_path / "want")
    assert_same_tensors(dst, want)
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["layout"] == "quark" and result["calibration_tokens"] == 0 and result["path"] == str(dst)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q", "r.json", "want"]  # no temporary left


def test_the_summary_is_readable(sources, tmp_path, capsys):
    _, src = sources["OlmoeForCausalLM"]
    text = tmp_path / "c.txt"
    text.write_text(calibration_text(20))
    assert cli_main(["quantize", str(src), str(tmp_path / "q"), "--scheme", "nvfp4", "--calibration", str(text)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("[quantize] OlmoeForCausalLM, 2 layers (2 MoE, 4 experts each): scheme nvfp4, layout ")
    assert "calibrated on 20 tokens (1 x 20)" in out[0]
    assert out[1].startswith("read ") and out[1].endswith(f"to {tmp_path / 'q'}") and "{" not in "".join(out)


# ----------------------------------------------------------------------------- bad input


def _refused(argv, capsys) -> str:
    """The command's one-line error (exit code 2)."""
    capsys.readouterr()  # what came before (transformers' progress bars)
    with pytest.raises(SystemExit) as exc:
        cli_main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mxlib quantize: error: "), err
    return err


def _nothing_written(parent: Path, name: str) -> None:
    assert not (parent / name).exists()
    assert not list(parent.glob(f".{name}.tmp-*")), "a temporary was left"


def test_bad_sources_are_refused(sources, tmp_path, capsys):
    _, src = sources["Qwen3MoeForCausalLM"]
    dst = tmp_path / "q"
    base = ["--scheme", "w_mxfp4"]
    assert "src: " in _refused(["quantize", str(tmp_path / "absent"), str(dst), *base], capsys)
    assert "does not exist" in _refused(["quantize", str(tmp_path / "absent"), str(dst), *base], capsys)
    (tmp_path / "file").write_text("x")
    assert "is not a folder" in _refused(["quantize", str(tmp_path / "file"), str(dst), *base], capsys)
    (tmp_path / "empty").mkdir()
    assert "has no config.json" in _refused(["quantize", str(tmp_path / "empty"), str(dst), *base], capsys)
    # an fp32 checkpoint: refused, naming the tensor and the dtype
    f32 = tmp_path / "f32"
    dummy_moe_model(tiny_config("Qwen3MoeForCausalLM"), seed=0, dtype=torch.float32).save_pretrained(f32)
    err = _refused(["quantize", str(f32), str(dst), *base], capsys)
    assert "src: tensor '" in err and "expected dtype bfloat16, found F32" in err and "convert" in err
    # a quantized checkpoint
    q = write_quantized_checkpoint(sources["Qwen3MoeForCausalLM"][0], "w_mxfp4", tmp_path / "quantized")
    assert "quantized already" in _refused(["quantize", str(q), str(dst), *base], capsys)
    # a missing shard
    broken = tmp_path / "broken"
    broken.mkdir()
    for p in src.iterdir():
        (broken / p.name).write_bytes(p.read_bytes())
    next(broken.glob("model-0000[2-9]-*.safetensors")).unlink()
    assert "src: " in _refused(["quantize", str(broken), str(dst), *base], capsys)
    _nothing_written(tmp_path, "q")


def test_an_unsupported_family_is_refused_at_once(tmp_path):
    """A folder of another class: refused before torch is imported, naming the class, in well under a second of
    CPU time (a fresh process; CPU time, not wall time, so that a loaded machine does not decide)."""
    import resource

    src = tmp_path / "llama"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    argv = [sys.executable, "-m", "mxlib", "quantize", str(src), str(tmp_path / "q"), "--scheme", "nvfp4"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "LlamaForCausalLM" in out.stderr and "Qwen3MoeForCausalLM" in out.stderr
    assert cpu < 1.0, cpu
    imported = subprocess.run([sys.executable, "-X", "importtime", *argv[1:]], capture_output=True, text=True, cwd=ROOT)
    assert imported.returncode == 2 and "mxlib.cli" in imported.stderr
    modules = {line.split("|")[-1].strip() for line in imported.stderr.splitlines() if line.startswith("import time:")}
    assert "mxlib.models.families" in modules and not modules & {"torch", "transformers"}
    _nothing_written(tmp_path, "q")


def test_bad_options_are_refused(sources, tmp_path, capsys):
    _, src = sources["Qwen3MoeForCausalLM"]
    dst = tmp_path / "q"
    err = _refused(["quantize", str(src), str(dst), "--scheme", "nvfp5"], capsys)
    assert "invalid choice: 'nvfp5'" in err and "nvfp4" in err and "w_mxfp4" in err
    err = _refused(["quantize", str(src), str(dst), "--scheme", "nvfp4", "--layout", "gguf"], capsys)
    assert "invalid choice: 'gguf'" in err and "modelopt" in err and "compressed-tensors" in err
    err = _refused(["quantize", str(src), str(dst), "--scheme", "nvfp4", "--layout", "quark"], capsys)
    assert "--layout: quark does not store scheme nvfp4" in err and "modelopt" in err
    err = _refused(["quantize", str(src), str(dst), "--scheme", "nvfp4"], capsys)
    assert "--calibration: scheme nvfp4 stores static activation scales" in err
    err = _refused(["quantize", str(src), str(dst), "--scheme", "w_mxfp4", "--technique", "gptq"], capsys)
    assert "--technique: gptq needs every expert's Hessian" in err
    for content in ("", "  \n\t\n"):
        (tmp_path / "calib.txt").write_text(content)
        argv = ["quantize", str(src), str(dst), "--scheme", "nvfp4", "--calibration", str(tmp_path / "calib.txt")]
        assert "--calibration: " in _refused(argv, capsys) and "is empty" in _refused(argv, capsys)
    argv = ["quantize", str(src), str(dst), "--scheme", "nvfp4", "--calibration", str(tmp_path / "none.txt")]
    assert "--calibration: " in _refused(argv, capsys)
    (tmp_path / "calib.txt").write_text("w1 w2 w3")
    gptoss = sources["GptOssForCausalLM"][1]
    err = _refused(
        ["quantize", str(gptoss), str(dst), "--scheme", "nvfp4", "--calibration", str(tmp_path / "calib.txt")], capsys
    )
    assert "stores no expert biases" in err
    no_tok = tmp_path / "no_tokenizer"
    no_tok.mkdir()
    for p in src.iterdir():
        if not p.name.startswith(("tokenizer", "special_tokens")):
            (no_tok / p.name).write_bytes(p.read_bytes())
    err = _refused(
        ["quantize", str(no_tok), str(dst), "--scheme", "nvfp4", "--calibration", str(tmp_path / "calib.txt")], capsys
    )
    assert "--calibration: " in err and "has no tokenizer" in err
    _nothing_written(tmp_path, "q")


def test_an_existing_destination_needs_overwrite(sources, tmp_path, capsys):
    _, src = sources["Qwen3MoeForCausalLM"]
    dst = tmp_path / "q"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    err = _refused(["quantize", str(src), str(dst), "--scheme", "w_mxfp4"], capsys)
    assert "dst: " in err and "--overwrite" in err
    assert [p.name for p in dst.iterdir()] == ["keep.txt"] and (dst / "keep.txt").read_text() == "mine"
    assert "is SRC itself" in _refused(["quantize", str(src), str(src), "--scheme", "w_mxfp4", "--overwrite"], capsys)
    empty = tmp_path / "empty"
    empty.mkdir()  # an empty folder is written into
    assert cli_main(["quantize", str(src), str(empty), "--scheme", "w_mxfp4"]) == 0
    assert (empty / "config.json").is_file()


def test_a_failure_midway_leaves_nothing(sources, tmp_path, monkeypatch):
    """An error while the second layer is written: no destination, no temporary (the atomic folder write)."""
    from mxlib.checkpoints import streaming

    _, src = sources["Qwen3MoeForCausalLM"]
    calls = []

    def fail_on_second(*args, **kwargs):
        calls.append(args[4])
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return write_layer(*args, **kwargs)

    write_layer = streaming.write_layer_experts
    monkeypatch.setattr(streaming, "write_layer_experts", fail_on_second)
    with pytest.raises(OSError, match="No space left"):
        streaming.quantize_checkpoint(src, tmp_path / "q", "w_mxfp4")
    assert calls == [0, 1]
    _nothing_written(tmp_path, "q")


# ----------------------------------------------------------------------------- peak memory, Qwen3-30B-A3B's layer shape


def random_bf16(shape, generator) -> torch.Tensor:
    """Random bf16 values of magnitude 2**-11 to 2**-7 with random signs and mantissas, from random bits (fast:
    a normal draw of 1.2 G values takes tens of seconds on one core)."""
    bits = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=generator)
    return ((bits & -32257) | 0x3A00).view(torch.bfloat16)  # keep sign, 2 exponent bits, mantissa; exponent >= 116


def write_bf16_checkpoint(config, folder: Path, seed: int = 0) -> int:
    """A sharded bf16 checkpoint with transformers' names for ``config`` (Qwen3-MoE): one shard per decoder layer
    (the experts per expert, as ``save_pretrained`` stores them) and one for the rest, with the index, written
    one layer at a time. Returns the largest layer's bytes."""
    from safetensors.torch import save_file

    folder.mkdir()
    with torch.device("meta"):
        meta = transformers.Qwen3MoeForCausalLM(config)
    g = torch.Generator().manual_seed(seed)
    groups: dict[str, dict[str, tuple]] = {}
    for name, p in meta.state_dict().items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        groups.setdefault(layer, {})[name] = tuple(p.shape)
    weight_map, layer_bytes, total = {}, 0, 0
    for x, (group, shapes) in enumerate(groups.items()):
        state = {}
        for name, shape in shapes.items():
            if name.endswith("experts.gate_up_proj"):  # [E, 2I, H] in memory, per expert on disk
                i = shape[1] // 2
                prefix = name[: -len("gate_up_proj")]
                for e in range(shape[0]):
                    state[f"{prefix}{e}.gate_proj.weight"] = random_bf16((i, shape[2]), g)
                    state[f"{prefix}{e}.up_proj.weight"] = random_bf16((i, shape[2]), g)
            elif name.endswith("experts.down_proj"):
                prefix = name[: -len("down_proj")]
                for e in range(shape[0]):
                    state[f"{prefix}{e}.down_proj.weight"] = random_bf16(shape[1:], g)
            elif name.endswith("norm.weight"):
                state[name] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                state[name] = random_bf16(shape, g)
        fname = f"model-{x + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(state, str(folder / fname), metadata={"format": "pt"})
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        total += nbytes
        if group != "rest":
            layer_bytes = max(layer_bytes, nbytes)
        weight_map.update({n: fname for n in state})
        del state
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)  # the freed layer back to the system
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    config.architectures = ["Qwen3MoeForCausalLM"]
    config.save_pretrained(folder)
    return layer_bytes


@pytest.mark.slow
def test_peak_memory_stays_near_one_layer(tmp_path):
    """Two decoder layers of Qwen3-30B-A3B's layer shape (hidden 2048, expert intermediate 768) with 96 of its 128
    experts, and a 4096-token vocabulary: ``python -m mxlib quantize`` with NVFP4 and calibration text holds about
    one layer, not two.

    What is measured is the command's anonymous resident memory (``RssAnon``, sampled every 2 ms): what it
    allocated and holds. Resident file-backed pages (the source shards it maps) are not held: the kernel drops
    them under pressure, and how many stay resident depends on the page cache, i.e. on what else runs on the
    machine (at all 128 experts the total resident peak measured 2.05 GB alone and 2.58 GB beside another test tier).

    The bound: the interpreter with everything the command imports (measured, ``baseline``) + one layer's bf16
    tensors (``layer``: 96 x 3 x 768 x 2048 x 2 B = 0.91 GB of experts + 38 MB of attention) + the embedding
    and output head (2 x 4096 x 2048 x 2 B = 34 MB) + one shard of quantized tensors being written
    (``SHARD_BYTES``, 256 MiB) + 300 MB for the quantization's and calibration's temporaries and the allocator.
    That is about baseline + 1.54 GB, while the two layers' bf16 tensors alone are 1.89 GB: a command that held
    both layers would exceed it by 0.34 GB or more. Every term of the bound but ``layer`` is fixed, so the layer
    has to outweigh them (0.6 GB) for the bound to tell one layer from two; 96 experts keep 0.34 GB of that
    margin and cost three quarters of the full expert count's bytes to write, quantize and check.
    The expert weights of the written checkpoint, loaded with mxlib's loader, dequantize to what
    the in-memory quantization of the same bf16 tensors gives, bit for bit (sampled experts of each layer).
    """
    from mxlib.checkpoints.files.safetensors_io import SHARD_BYTES

    config = qwen3_30b_a3b_config(2, num_experts=96, vocab_size=4096, bos_token_id=1, eos_token_id=2)
    src = tmp_path / "bf16"
    t0 = time.perf_counter()
    layer = write_bf16_checkpoint(config, src)
    save_tokenizer(src, config.vocab_size)
    seconds_write = time.perf_counter() - t0
    total = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    assert len(list(src.glob("*.safetensors"))) == 3 and layer > 0.9e9 and total > 2 * layer
    embed = 2 * config.vocab_size * config.hidden_size * 2
    assert layer > embed + SHARD_BYTES + 300e6 + 0.3e9  # two layers held at once would exceed the bound below
    (tmp_path / "calib.txt").write_text(calibration_text(256))
    imports = (
        "import torch, transformers, mxlib.cli.checkpoint_commands, mxlib.checkpoints.streaming; "
        "from transformers import AutoTokenizer, Qwen3MoeForCausalLM"
    )
    # the command as a user runs it: glibc's default trimming and mmap threshold (the Makefile raises both for the
    # notebooks' speed, which keeps every freed block in the heap and adds ~0.4 GB to this peak)
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")}
    baseline, base = peak_memory([sys.executable, "-c", imports], cwd=ROOT, env=env)
    assert base.returncode == 0, base.stderr[-2000:]
    dst = tmp_path / "nvfp4"
    argv = [sys.executable, "-m", "mxlib", "quantize", str(src), str(dst), "--scheme", "nvfp4"]
    t0 = time.perf_counter()
    peak, out = peak_memory(
        [*argv, "--calibration", str(tmp_path / "calib.txt"), "--calib-seq-len", "128"], cwd=ROOT, env=env
    )
    seconds = time.perf_counter() - t0
    assert out.returncode == 0, out.stderr[-3000:]
    bound = baseline["anon"] + layer + embed + SHARD_BYTES + 300e6
    print(
        f"source {total / 1e9:.2f} GB ({seconds_write:.0f} s to write), layer {layer / 1e9:.3f} GB; baseline "
        f"{baseline['anon'] / 1e9:.3f} GB anonymous, peak {peak['anon'] / 1e9:.3f} GB anonymous (baseline + "
        f"{(peak['anon'] - baseline['anon']) / 1e9:.3f}), {peak['rss'] / 1e9:.3f} GB resident with file pages; "
        f"bound {bound / 1e9:.3f} GB; quantized in {seconds:.0f} s\n{out.stdout}"
    )
    assert peak["anon"] < bound, (peak, bound)
    assert peak["anon"] > baseline["anon"] + layer / 2, (peak, baseline)  # the sampler saw the layer being worked on
    # the experts as mxlib loads them against the in-memory quantization of the same bf16 tensors
    check_sampled_experts(src, dst)


def check_sampled_experts(src: Path, dst: Path, experts=(0, 77, 95)) -> None:
    """Experts of each layer of ``dst`` (NVFP4), loaded with mxlib's loader and dequantized, against
    ``quantize_expert_weights`` of the same bf16 tensors of ``src``, bit for bit."""
    loaded, info = load_quantized_moe(dst, backend="torch")
    assert info.format == "modelopt" and info.scheme.name == "nvfp4"
    where = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    ones = torch.ones(1)
    for layer_index, block in enumerate(moe_layers(loaded)):
        for e in experts:
            prefix = f"model.layers.{layer_index}.mlp.experts.{e}"
            with safe_open(str(src / where[f"{prefix}.down_proj.weight"]), "pt") as h:
                w13 = torch.cat([h.get_tensor(f"{prefix}.{p}.weight") for p in ("gate_proj", "up_proj")])[None]
                w2 = h.get_tensor(f"{prefix}.down_proj.weight")[None]
            want = make_emulation_experts("nvfp4", quantize_expert_weights(w13, w2, "nvfp4"), ones, ones)
            for got_w, want_w in zip(block.experts.experts.dequantized_expert(e), want.dequantized_expert(0)):
                assert torch.equal(got_w.view(torch.int16), want_w.view(torch.int16)), (layer_index, e)
