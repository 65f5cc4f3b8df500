"""The workbook keeps its real-shape dummy models in the checkpoint cache (``steps.dummy_model``).

A model read back must be the built one bit for bit (every parameter and persistent buffer, and so every forward);
an incomplete folder is built again; a model below the size threshold is never written. Run here at the tiny
preset with the threshold lowered, for Qwen3-MoE and gpt-oss.
"""

from __future__ import annotations

import pytest
import torch

from mxlib.studies import steps as W

from _util import assert_bits_equal


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MXLIB_CACHE", str(tmp_path))
    monkeypatch.setattr(W, "DUMMY_CACHE_MIN_PARAMETERS", 1)
    return tmp_path


@pytest.mark.parametrize("preset", ["tiny", "gpt-oss-tiny"])
def test_a_kept_dummy_is_the_built_one_bit_for_bit(cache, preset, monkeypatch):
    built = W.dummy_model(2, seed=3, model_preset=preset)
    folders = [p for p in cache.iterdir() if p.name.startswith("dummy-")]
    assert len(folders) == 1 and (folders[0] / "complete").is_file()

    def no_build(*args, **kwargs):
        raise AssertionError("built although the cache holds the model")

    monkeypatch.setattr(W, "dummy_gpt_oss" if preset.startswith("gpt") else "dummy_qwen3_moe", no_build)
    again = W.dummy_model(2, seed=3, model_preset=preset)
    a, b = built.state_dict(), again.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert_bits_equal(a[name], b[name], name)
    ids = W.random_token_ids(12, 0, built.config.vocab_size)
    assert torch.equal(W.run_model(built, ids).logits, W.run_model(again, ids).logits)


def test_another_seed_or_an_incomplete_folder_builds_again(cache):
    W.dummy_model(1, seed=0, model_preset="tiny")
    (seed0,) = [p for p in cache.iterdir() if p.name.startswith("dummy-")]
    W.dummy_model(1, seed=1, model_preset="tiny")
    assert len([p for p in cache.iterdir() if p.name.startswith("dummy-")]) == 2  # another seed, another folder
    (seed0 / "complete").unlink()
    W.dummy_model(1, seed=0, model_preset="tiny")  # built again and kept again
    assert (seed0 / "complete").is_file()


def test_small_models_and_spread_ones_are_not_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("MXLIB_CACHE", str(tmp_path))
    W.dummy_model(1, model_preset="tiny")  # under the size threshold
    monkeypatch.setattr(W, "DUMMY_CACHE_MIN_PARAMETERS", 1)
    W.dummy_model(1, model_preset="tiny", expert_spread=1.0)  # a spread model: built once by the notebook that asks
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("dummy-")]
