"""Tied word embeddings (``tie_word_embeddings=True``) on build, write and load, in every layout.

The oracle is transformers itself: its ``from_pretrained`` ties ``lm_head.weight`` to
``model.embed_tokens.weight`` and its ``save_pretrained`` stores the shared tensor once, without
``lm_head.weight``; mxlib's checkpoints must hold the same non-expert tensors and load back tied.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import Qwen3MoeForCausalLM

from mxlib.checkpoints import load_quantized_qwen3_moe, write_quantized_checkpoint
from mxlib.models.calibration import calibrate
from mxlib.models.qwen3 import dummy_qwen3_moe, empty_qwen3_moe, qwen3_30b_a3b_config, tied_parameter_names

from _util import TINY_QWEN3 as TINY

LAYOUTS = [
    ("modelopt", "nvfp4"),
    ("quark", "w_mxfp4_a_mxfp4"),
    ("quark", "w_mxfp4_a_fp8"),
    ("compressed-tensors", "nvfp4"),
]


def _names(folder) -> set[str]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    return set(index["weight_map"])


@pytest.fixture(scope="module")
def tied():
    cfg = qwen3_30b_a3b_config(num_hidden_layers=2, **TINY, tie_word_embeddings=True)
    model = dummy_qwen3_moe(cfg, seed=2)
    cal = calibrate(model, torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0)))
    return model, cal


def test_build_ties_the_head_to_the_embedding(tied):
    model, _ = tied
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert tied_parameter_names(model) == {"lm_head.weight"}
    untied = empty_qwen3_moe(qwen3_30b_a3b_config(num_hidden_layers=1, **TINY))
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight and tied_parameter_names(untied) == set()


def test_transformers_save_pretrained_stores_the_shared_tensor_once(tied, tmp_path):
    """The oracle for the stored names: transformers' own save_pretrained and from_pretrained."""
    model, _ = tied
    model.save_pretrained(tmp_path / "hf")
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        stored = set(f.keys())
    assert "lm_head.weight" not in stored and "model.embed_tokens.weight" in stored
    back = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16)
    assert back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("layout,scheme", LAYOUTS, ids=[f"{a}-{b}" for a, b in LAYOUTS])
def test_write_and_load_keep_the_tie(tied, tmp_path, layout, scheme):
    model, cal = tied
    path = write_quantized_checkpoint(model, scheme, tmp_path / "ckpt", cal, layout=layout)
    names = _names(path)
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    # the same non-expert bf16 names as transformers' save_pretrained of the bf16 model
    hf = {n for n in model.state_dict() if ".mlp.experts." not in n} - {"lm_head.weight"}
    assert {n for n in names if ".mlp.experts." not in n} == hf
    loaded, _ = load_quantized_qwen3_moe(path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(loaded.lm_head.weight, model.model.embed_tokens.weight)
    # and again through the loaded model's save_pretrained (the checkpoint's own layout)
    loaded.save_pretrained(tmp_path / "again")
    assert "lm_head.weight" not in _names(tmp_path / "again")
    again, _ = load_quantized_qwen3_moe(tmp_path / "again")
    assert again.lm_head.weight is again.model.embed_tokens.weight
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a, b = loaded(input_ids=ids).logits, again(input_ids=ids).logits
    assert torch.equal(a, b)


def test_a_stored_head_is_not_read_when_tied(tied, tmp_path):
    """A checkpoint that stores lm_head.weight anyway (a tied config): the head is the embedding, as
    transformers' from_pretrained makes it."""
    from safetensors.torch import load_file, save_file

    model, cal = tied
    path = write_quantized_checkpoint(model, "w_mxfp4", tmp_path / "ckpt")
    shard = sorted(path.glob("*.safetensors"))[0]
    state = load_file(str(shard))
    state["lm_head.weight"] = torch.zeros_like(model.model.embed_tokens.weight)
    save_file(state, str(shard), metadata={"format": "pt"})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = shard.name
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.warns(UserWarning, match="1 tensors of the checkpoint are not used .* lm_head.weight"):
        loaded, _ = load_quantized_qwen3_moe(path)  # not read, and named
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(loaded.lm_head.weight, model.model.embed_tokens.weight)


def test_dummy_from_config_with_tied_embeddings(tmp_path):
    from pathlib import Path

    from mxlib.checkpoints import dummy_checkpoint_from_config

    src = tmp_path / "src"
    src.mkdir()
    configs = Path(__file__).parent / "fixtures" / "configs" / "quark-w_mxfp4_a_mxfp4-qwen3-30b-a3b"
    cfg = json.loads((configs / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (src / "config.json").write_text(json.dumps(cfg))
    path = dummy_checkpoint_from_config(src, tmp_path / "out", num_hidden_layers=1, model_preset="tiny")
    assert "lm_head.weight" not in _names(path)
    loaded, _ = load_quantized_qwen3_moe(path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
