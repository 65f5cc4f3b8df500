"""A user's own checkpoint in the workbook (mxlib.studies.own_checkpoint), on the producer-made fixtures.

The fixtures are tests/fixtures/interop's checkpoints, written by ModelOpt, llm-compressor and Quark
themselves. The weight-only reference is checked against the float64 MoE oracle; the unification
loss is provoked on a copy whose input scales are edited so that the other experts fall below e4m3's
flush threshold under ``max``, and must show up both in the prediction and in the measurement.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mxlib.analysis import sqnr_db
from mxlib.checkpoints import load_quantized_qwen3_moe
from mxlib.formats import NVFP4_FLUSH_RATIO
from mxlib.studies.own_checkpoint import check_checkpoint_path, checkpoint_layers_study, checkpoint_token_ids

from oracles import moe_fp64

INTEROP = Path(__file__).parent / "fixtures" / "interop"
MODELOPT = INTEROP / "modelopt_nvfp4_experts" / "checkpoint"
LLMC = INTEROP / "llmc_nvfp4_experts" / "checkpoint"
QUARK = INTEROP / "quark_w_mxfp4_a_mxfp4" / "checkpoint"


@pytest.fixture(scope="module")
def llmc_study():
    ids, _ = checkpoint_token_ids(LLMC, num_tokens=24, seed=3)
    return checkpoint_layers_study(LLMC, num_layers=2, token_ids=ids, strategies=("max", "median")), ids


def test_activation_loss_is_measured_against_the_weight_only_block(llmc_study):
    study, ids = llmc_study
    assert study["scheme"] == "nvfp4" and study["format"] == "compressed-tensors" and study["num_layers"] == 2
    # recompute layer 0 independently: the block's input from a fresh load, the weight-only output in float64
    model, _ = load_quantized_qwen3_moe(LLMC, num_hidden_layers=1, backend="torch")
    seen = {}
    hook = model.model.layers[0].mlp.experts.register_forward_hook(lambda m, a, o: seen.update(a=a, out=o))
    model.model.layers[0].mlp.experts.experts.set_scale_strategy("per_expert")
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    hook.remove()
    x, idx, w = seen["a"]
    ex = model.model.layers[0].mlp.experts.experts
    w13, w2 = ex.dequantized_weights()
    ref64 = moe_fp64(x, w13.bfloat16(), w2.bfloat16(), w.float(), idx, store_dtype=torch.bfloat16)
    want = sqnr_db(seen["out"].double(), ref64)
    got = study["layers"][0]["sqnr_db"]
    # the study's reference is the bf16-rounded weight-only block; against float64 it differs by bf16's
    # own rounding, tens of dB below the activation quantization's
    assert 8.0 < got < 30.0 and abs(got - want) < 0.05, (got, want)
    per_expert = [r for r in study["strategies"] if r["strategy"] == "per_expert"]
    assert [r["db_lost"] for r in per_expert] == [0.0, 0.0]
    assert {r["strategy"] for r in study["strategies"]} == {"per_expert", "max", "median"}
    json.dumps(study, allow_nan=False)  # a results JSON holds no NaN or Inf


def _edited_modelopt(tmp_path: Path, factor: float) -> Path:
    """A copy of the ModelOpt fixture whose layer-0 expert 0 has every input scale multiplied by ``factor``."""
    out = tmp_path / "edited"
    shutil.copytree(MODELOPT, out)
    tensors = load_file(out / "model.safetensors")
    for proj in ("gate_proj", "up_proj", "down_proj"):
        name = f"model.layers.0.mlp.experts.0.{proj}.input_scale"
        tensors[name] = tensors[name] * factor
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_flushed_experts_are_predicted_and_measured(tmp_path):
    factor = 4.0 / NVFP4_FLUSH_RATIO  # every other expert's ratio lands below the flush threshold
    path = _edited_modelopt(tmp_path, factor)
    study = checkpoint_layers_study(path, num_layers=1, strategies=("max",))
    rows = {r["strategy"]: r for r in study["strategies"]}
    # expert 0's own activations are far below its (edited) scale: flushed under any strategy. Under
    # `max` every expert takes that scale, every activation rounds to zero and the block outputs zeros
    # (SQNR exactly 0 dB); under `per_expert` the other experts keep their own scales.
    assert rows["max"]["sqnr_db"] == 0.0 and rows["per_expert"]["sqnr_db"] > 3.0, rows
    predicted = {(r["point"], r["strategy"]): r for r in study["predicted"]}
    assert predicted[("a1", "max")]["flushed"] >= 1 and predicted[("a1", "per_expert")]["flushed"] == 0
    # the untouched fixture: ModelOpt shares one input scale across experts, so nothing is lost
    plain = checkpoint_layers_study(MODELOPT, num_layers=1, strategies=("max",))
    assert all(r["db_lost"] == 0.0 for r in plain["strategies"])


def test_block_scaled_activations_have_no_strategies():
    study = checkpoint_layers_study(QUARK, num_layers=1)
    assert study["scheme"] == "w_mxfp4_a_mxfp4" and study["strategies"] == [] and study["predicted"] == []
    row = study["layers"][0]
    assert 5.0 < row["sqnr_db"] < 30.0
    # each activation QDQ alone loses less than both together (their noise adds)
    assert row["a1_sqnr_db"] > row["sqnr_db"] and row["a2_sqnr_db"] > row["sqnr_db"], row


def test_prompts_go_through_the_checkpoint_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path / "ckpt"
    shutil.copytree(LLMC, folder)
    vocab = {"[UNK]": 0, "two": 1, "plus": 2, "three": 3}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(folder)
    ids, source = checkpoint_token_ids(folder, ["two plus three", "three"])
    assert source == "tokenizer" and ids.tolist() == [[1, 2, 3, 3]]
    ids, source = checkpoint_token_ids(folder, [], num_tokens=5, seed=1)
    assert source == "random" and ids.shape == (1, 5) and int(ids.max()) < 512


def test_bad_input_names_the_argument(tmp_path):
    with pytest.raises(ValueError, match="prompts: the checkpoint folder .* has no tokenizer"):
        checkpoint_token_ids(LLMC, ["hello"])
    with pytest.raises(ValueError, match="num_tokens: expected a positive integer, got 0"):
        checkpoint_token_ids(LLMC, num_tokens=0)
    with pytest.raises(ValueError, match="strategies: expected names from"):
        checkpoint_layers_study(LLMC, strategies=("largest",))
    with pytest.raises(ValueError, match="checkpoint_path: expected a checkpoint folder holding config.json"):
        check_checkpoint_path(str(tmp_path))
    assert check_checkpoint_path("") is None and check_checkpoint_path(str(LLMC)) == LLMC
