"""The trained MoE: deterministic training, the cache, and the ``test`` recipe's accuracy bar.

One training of the ``test`` recipe (under a minute on a shared 2-core CPU) serves the module;
the determinism test trains it a second time and compares every tensor's bits.
"""

import contextlib
import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from mxlib.models import training as tr
from mxlib.models.evaluation import calibrate_tasks, emulated_experts, evaluate, expert_usage, kl_from_uniform
from mxlib.models.tasks import make_dataset

from _util import assert_bits_equal

RECIPE = tr.get_recipe("test")
# Exact match the test recipe reaches on 300 held-out prompts per task in bf16 (measured: 1.000 on
# reverse and on count); the bar leaves room for another CPU's or torch version's bits.
TEST_BAR = 0.95


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("trained")


@pytest.fixture(scope="module")
def trained(cache_dir):
    return tr.train(RECIPE, cache_dir, retrain=True)  # trained here, not the shipped model


def test_train_returns_a_bf16_eval_model_and_a_complete_entry(trained, cache_dir):
    assert not trained.training and trained.dtype == torch.bfloat16
    info = trained.mxlib_training
    assert not info["cache_hit"] and info["key"] == tr.recipe_key(RECIPE) and "shipped" not in info
    entry = cache_dir / info["key"]
    assert sorted(p.name for p in entry.iterdir()) == sorted(tr.ENTRY_FILES)
    assert tr.TrainRecipe.from_dict(json.loads((entry / "recipe.json").read_text())) == RECIPE
    assert not [p for p in cache_dir.iterdir() if p.name.startswith(".tmp")]


def test_training_is_deterministic(trained, cache_dir):
    again = tr.train_fp32(RECIPE)
    cached = load_file(str(cache_dir / trained.mxlib_training["key"] / "model.safetensors"))
    state = again.state_dict()
    assert sorted(state) == sorted(cached)
    for name, tensor in state.items():
        assert_bits_equal(tensor, cached[name], name)


def test_second_call_loads_without_training(trained, cache_dir, monkeypatch):
    def no_training(*args, **kwargs):
        raise AssertionError("train() trained although a complete entry was cached")

    monkeypatch.setattr(tr, "train_fp32", no_training)
    again = tr.train(RECIPE, cache_dir, retrain=True)
    assert again.mxlib_training["cache_hit"]
    for (name, a), (_, b) in zip(trained.state_dict().items(), again.state_dict().items()):
        assert_bits_equal(a, b, name)


def _fake_training(calls):
    def fake(recipe, log=None, log_every=100):
        calls.append(recipe)
        torch.manual_seed(123)
        model = tr.Qwen3MoeForCausalLM(tr.model_config(recipe)).eval()
        model.train_seconds = 0.0
        return model

    return fake


@pytest.mark.parametrize("damage", ["truncated_weights", "missing_manifest", "other_recipe", "bad_json"])
def test_a_damaged_entry_is_not_reused(trained, cache_dir, tmp_path, monkeypatch, damage):
    import shutil

    key = trained.mxlib_training["key"]
    shutil.copytree(cache_dir / key, tmp_path / key)
    entry = tmp_path / key
    if damage == "truncated_weights":
        data = (entry / "model.safetensors").read_bytes()
        (entry / "model.safetensors").write_bytes(data[: len(data) // 2])
    elif damage == "missing_manifest":
        (entry / "manifest.json").unlink()
    elif damage == "other_recipe":
        (entry / "recipe.json").write_text(json.dumps(dataclasses.replace(RECIPE, seed=9).to_dict()))
    else:
        (entry / "recipe.json").write_text("{not json")
    assert tr.load_entry(entry, RECIPE) is None
    calls = []
    monkeypatch.setattr(tr, "train_fp32", _fake_training(calls))
    model = tr.train(RECIPE, tmp_path, retrain=True)
    assert calls == [RECIPE] and not model.mxlib_training["cache_hit"]
    assert tr.load_entry(entry, RECIPE) is not None  # replaced by a complete entry


def test_an_interrupted_write_leaves_no_entry(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(tr, "train_fp32", _fake_training(calls))

    def broken_save(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tr, "save_file", broken_save)
    with pytest.raises(KeyboardInterrupt):
        tr.train(RECIPE, tmp_path, retrain=True)
    assert list(tmp_path.iterdir()) == []


def test_recipe_key_and_errors():
    assert tr.recipe_key(RECIPE) == tr.recipe_key(tr.TrainRecipe.from_dict(RECIPE.to_dict()))
    assert tr.recipe_key(RECIPE) != tr.recipe_key(dataclasses.replace(RECIPE, steps=RECIPE.steps + 1))
    with pytest.raises(ValueError, match="recipe: expected one of"):
        tr.get_recipe("huge")
    with pytest.raises(ValueError, match="recipe: expected one of"):
        tr.train("huge", "/nonexistent")
    with pytest.raises(ValueError, match="task: expected one of"):
        tr.TrainRecipe(tasks=("add", "divide"))
    with pytest.raises(ValueError, match="hidden_size: expected a positive multiple of 128"):
        tr.TrainRecipe(hidden_size=96)
    with pytest.raises(ValueError, match="steps: expected a positive int"):
        tr.TrainRecipe(steps=0)
    with pytest.raises(ValueError, match="unknown fields"):
        tr.TrainRecipe.from_dict(dict(RECIPE.to_dict(), depth=3))


def test_test_recipe_meets_its_bf16_bar(trained):
    sets = [make_dataset(t, 300, 1, "heldout") for t in RECIPE.tasks]
    results = evaluate(trained, sets, resamples=200)
    accuracy = results.exact_match()
    assert min(accuracy.values()) >= TEST_BAR, accuracy


def test_routing_is_learned_not_uniform(trained):
    usage = {t: expert_usage(trained, make_dataset(t, 100, 1, "heldout")) for t in RECIPE.tasks}
    for t, u in usage.items():
        assert torch.allclose(u.sum(1), torch.ones(u.shape[0], dtype=torch.float64))
        assert kl_from_uniform(u).max() > 0.05, (t, u)
    a, b = usage.values()
    assert (a - b).abs().sum(1).max() > 0.2  # the two tasks route differently


@pytest.mark.filterwarnings("ignore:w13_input_scale:UserWarning", "ignore:w2_input_scale:UserWarning")
def test_teacher_forced_exact_match_is_greedy_decoding(trained):
    # exact match read from the teacher-forced argmax against token-by-token greedy decoding: the same
    # outcome on every prompt, in bf16 and through NVFP4 emulation experts
    sets = [make_dataset(t, 150, 2, "heldout") for t in RECIPE.tasks]
    cal = calibrate_tasks(trained, [make_dataset(t, 32, 0, "train") for t in RECIPE.tasks])
    for ctx in (contextlib.nullcontext(trained), emulated_experts(trained, "nvfp4", cal)):
        with ctx as m:
            fast = evaluate(m, sets, resamples=50)
            slow = evaluate(m, sets, resamples=50, decode="greedy")
        for t in fast.tasks:
            assert torch.equal(fast.tasks[t].correct, slow.tasks[t].correct), t
            assert torch.equal(fast.tasks[t].nll, slow.tasks[t].nll), t


def test_the_retrained_test_recipe_reaches_the_shipped_accuracy(trained):
    """The test recipe trained here reaches the accuracy recorded for the shipped model (tools/ship_trained.py)
    within its intervals, on the same held-out prompts; with the torch and transformers versions it was
    trained with, it is the shipped model bit for bit."""
    shipped = tr.load_shipped(RECIPE)
    manifest = shipped.mxlib_training
    acc = manifest["accuracy"]
    sets = [make_dataset(t, acc["eval_prompts"], acc["seed"], "heldout") for t in RECIPE.tasks]
    results = evaluate(trained, sets, seed=acc["seed"])
    for t, r in results.tasks.items():
        rec = acc["tasks"][t]
        for m, v in (("exact_match", r.exact_match), ("nll_per_token", r.nll_per_token)):
            assert v.low <= rec[m]["high"] and rec[m]["low"] <= v.high, (t, m, str(v), rec[m])  # intervals meet
        assert r.exact_match.estimate >= rec["exact_match"]["low"], (t, str(r.exact_match), rec)
    if (manifest["torch"], manifest["transformers"]) == (torch.__version__, tr.transformers.__version__):
        mine = {k: v.to(torch.bfloat16) for k, v in trained.state_dict().items()}
        ship = shipped.state_dict()
        assert mine.keys() == ship.keys()
        for k in mine:
            assert_bits_equal(mine[k], ship[k])


@pytest.mark.parametrize("name", sorted(tr.RECIPES))
def test_every_recipe_ships_a_model_that_train_returns(name, tmp_path):
    model = tr.train(name, tmp_path)  # nothing trained, nothing written to the cache
    info = model.mxlib_training
    assert info["shipped"] and info["cache_hit"] and info["weights_dtype"] == "bfloat16"
    assert list(tmp_path.iterdir()) == []
    assert set(info["accuracy"]["tasks"]) == set(tr.get_recipe(name).tasks)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    # RoPE's inv_freq stays float32, as in every checkpoint loaded back from the model (a bf16 one moves its routing)
    assert [b.dtype for b in model.buffers()] and all(b.dtype == torch.float32 for b in model.buffers())
    assert not model.training


def test_a_damaged_shipped_model_is_refused(tmp_path, monkeypatch):
    import shutil

    shutil.copytree(tr.SHIPPED_DIR / "test", tmp_path / "test")
    monkeypatch.setattr(tr, "SHIPPED_DIR", tmp_path)
    data = bytearray((tmp_path / "test" / "model.safetensors").read_bytes())
    data[-1] ^= 1
    (tmp_path / "test" / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match="SHA-256 differs"):
        tr.load_shipped("test")
