"""The dummy Qwen3-MoE routes like a trained model, and routing_statistics counts right.

A small model (hidden 256, 64 experts, top-8, 4 layers; 4 heads of 128 so attention is twice
the hidden size wide, as in Qwen3-30B-A3B) on the 512 calibration tokens of
``mxlib.studies.steps.calibrate_model`` (seed + 1000, 2 x 256). The bar is the issue's, scaled to
64 experts: at least 62 of 64 experts hit in every layer (124 of 128 at full size), no
expert above 3x the uniform share. The plain random model (``balanced_routing=False``) must
fail that bar, so the test can tell the two apart.
"""

import math

import pytest
import torch

from mxlib.models.calibration import calibrate
from mxlib.models.qwen3 import dummy_qwen3_moe, moe_layers, qwen3_30b_a3b_config
from mxlib.models.routing_stats import routing_figure, routing_rows, routing_statistics, summarize_counts
from mxlib.studies.steps import random_token_ids

SMALL = dict(
    hidden_size=256,
    moe_intermediate_size=128,
    num_experts=64,
    num_experts_per_tok=8,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=128,
    intermediate_size=512,
)
SEED = 0


def _config():
    return qwen3_30b_a3b_config(num_hidden_layers=4, **SMALL)


def _calibration_ids(vocab_size):
    # the token ids mxlib.studies.steps.calibrate_model(model, 512, SEED) draws
    return random_token_ids(256, SEED + 1000, vocab_size, batch=2)


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)  # nothing below may depend on the global generator
    cfg = _config()
    return dummy_qwen3_moe(cfg, seed=SEED), dummy_qwen3_moe(cfg, seed=SEED, balanced_routing=False)


def _balanced(stats, num_experts):
    return all(s["experts_hit"] >= num_experts - num_experts // 32 and s["max_over_uniform"] <= 3.0 for s in stats)


@pytest.mark.slow
def test_balanced_routing_meets_the_bar(models):
    balanced, plain = models
    ids = _calibration_ids(balanced.config.vocab_size)
    stats = routing_statistics(balanced, ids)
    assert len(stats) == 4
    table = [(s["experts_hit"], round(s["max_over_uniform"], 2)) for s in stats]
    assert _balanced(stats, 64), table
    for s in stats:
        assert s["normalized_entropy"] > 0.97, table
    # the plain random model collapses with depth: the construction is what makes the difference
    plain_stats = routing_statistics(plain, ids)
    assert not _balanced(plain_stats, 64)
    assert min(s["experts_hit"] for s in plain_stats[1:]) < 62


@pytest.mark.slow
def test_construction_is_seeded_and_keeps_the_architecture(models):
    balanced, plain = models
    again = dummy_qwen3_moe(_config(), seed=SEED)
    sd, sd_again, sd_plain = balanced.state_dict(), again.state_dict(), plain.state_dict()
    assert list(sd) == list(sd_plain) == list(sd_again)
    changed = set()
    for name, p in sd.items():
        assert torch.equal(p, sd_again[name]), name  # bit-identical from the seed
        assert p.shape == sd_plain[name].shape and p.dtype == sd_plain[name].dtype, name
        if not torch.equal(p, sd_plain[name]):
            changed.add(name)
    # only attention output projections and routers change; experts, embeddings, norms do not
    assert changed == {n for n in sd if n.endswith(("self_attn.o_proj.weight", "mlp.gate.weight", "experts.down_proj"))}
    other = dummy_qwen3_moe(_config(), seed=SEED + 1)
    assert not torch.equal(other.state_dict()["model.layers.3.mlp.gate.weight"], sd["model.layers.3.mlp.gate.weight"])


def test_expert_spread_still_scales_experts(models):
    _, plain = models
    spread = dummy_qwen3_moe(_config(), seed=SEED, expert_spread=1.0)
    for layer in range(4):
        w13, w2 = plain.model.layers[layer].mlp.experts.gate_up_proj, plain.model.layers[layer].mlp.experts.down_proj
        s13 = spread.model.layers[layer].mlp.experts.gate_up_proj
        s2 = spread.model.layers[layer].mlp.experts.down_proj
        f = s13.float().norm(dim=(1, 2)) / w13.float().norm(dim=(1, 2))
        g = s2.float().norm(dim=(1, 2)) / w2.float().norm(dim=(1, 2))
        assert f.max() / f.min() > 2.0
        # w2 by f**-2 per expert, times one per-layer factor (step 3 scales every expert's w2 alike)
        ratio = g * f**2
        assert float(ratio.max() / ratio.min()) < 1.02, ratio


def test_routing_statistics_against_independent_count(models):
    balanced, _ = models
    ids = _calibration_ids(balanced.config.vocab_size)
    # oracle: the top-k ids the experts modules themselves receive in the same forward
    seen = {}

    def record(i):
        def hook(module, args):
            seen[i] = args[1].reshape(-1).long()

        return hook

    hooks = [mlp.experts.register_forward_pre_hook(record(i)) for i, mlp in enumerate(moe_layers(balanced))]
    try:
        stats = routing_statistics(balanced, ids)
    finally:
        for h in hooks:
            h.remove()
    assert all(not mlp.gate._forward_hooks for mlp in moe_layers(balanced))  # hooks removed
    for s in stats:
        counts = torch.bincount(seen[s["layer"]], minlength=64)
        assert torch.equal(s["tokens_per_expert"], counts)
        assert s["assignments"] == ids.numel() * 8 and s["top_k"] == 8 and s["num_experts"] == 64
        share = counts.double() / counts.sum()
        assert s["experts_hit"] == int((counts > 0).sum())
        assert s["max_share"] == float(share.max()) and s["min_share"] == float(share.min())
        h = -sum(float(p) * math.log(float(p)) for p in share if p > 0)
        assert s["entropy"] == pytest.approx(h, rel=1e-12)
        assert s["normalized_entropy"] == pytest.approx(h / math.log(64), rel=1e-12)


def test_routing_statistics_hand_built_router():
    # one layer whose router sends every token to experts 0 and 1: entropy log 2, 2 experts hit
    cfg = qwen3_30b_a3b_config(num_hidden_layers=1, **dict(SMALL, num_experts=8, num_experts_per_tok=2))
    model = dummy_qwen3_moe(cfg, seed=SEED, balanced_routing=False)
    with torch.no_grad():
        gate = model.model.layers[0].mlp.gate.weight
        gate.zero_()
        gate[0, :] = 0.01  # logits 2.56 and 1.28 for the all-ones normalized residual, 0 for the rest
        gate[1, :] = 0.005
        # constant embeddings and no attention update: every router input is all ones after the norm
        model.model.embed_tokens.weight.fill_(0.01)
        model.model.layers[0].self_attn.o_proj.weight.zero_()
    (s,) = routing_statistics(model, torch.arange(16))
    assert s["experts_hit"] == 2 and s["assignments"] == 32
    assert s["max_share"] == 0.5 and s["min_share"] == 0.0
    assert s["entropy"] == pytest.approx(math.log(2), rel=1e-12)
    assert s["tokens_per_expert"].tolist() == [16, 16, 0, 0, 0, 0, 0, 0]


def test_summarize_counts_from_calibration(models):
    balanced, _ = models
    ids = _calibration_ids(balanced.config.vocab_size)[:, :64]
    cal = calibrate(balanced, ids)
    stats = summarize_counts([lc.tokens for lc in cal.layers], top_k=8)
    assert [s["assignments"] for s in stats] == [ids.numel() * 8] * 4
    assert [s["experts_hit"] for s in stats] == [int((lc.tokens > 0).sum()) for lc in cal.layers]
    with pytest.raises(ValueError, match=r"tokens_per_expert\[0\]"):
        summarize_counts([torch.zeros(4, dtype=torch.long)], top_k=2)


def test_routing_statistics_bad_input(models):
    balanced, _ = models
    with pytest.raises(ValueError, match="token_ids"):
        routing_statistics(balanced, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="token_ids"):
        routing_statistics(balanced, torch.zeros(1, 2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="attn_update_ratio"):
        dummy_qwen3_moe(_config(), attn_update_ratio=0.0)


def test_routing_figure(models):
    pytest.importorskip("plotly")
    balanced, _ = models
    stats = routing_statistics(balanced, _calibration_ids(balanced.config.vocab_size)[:, :32])
    fig = routing_figure(stats)
    assert len(fig.data) == 4 and fig.data[0].z.shape == (4, 64)
    rows = routing_rows(stats)
    assert [r["layer"] for r in rows] == [0, 1, 2, 3] and rows[0]["experts_hit"] == stats[0]["experts_hit"]
    assert "tokens_per_expert" not in rows[0]


def test_cli_routing_reports_the_calibration_routing(tmp_path, capsys):
    # the CLI's routing subcommand: the same numbers as summarize_counts of the calibration (notebook 04)
    from mxlib import cli
    from mxlib.studies import steps

    out = tmp_path / "routing.json"
    assert cli.main(["routing", "--preset", "tiny", "--layers", "2", "--calib-tokens", "256", "--json", str(out)]) == 0
    import json

    rows = json.loads(out.read_text())["routing"]
    model = steps.dummy_model(2, seed=0, expert_spread=1.0, model_preset="tiny")
    cal = steps.calibrate_model(model, 256, 0)
    want = routing_rows(summarize_counts([lc.tokens for lc in cal.layers], model.config.num_experts_per_tok))
    assert rows == want
    printed = capsys.readouterr().out
    assert printed.count("[routing] layer") == 2 and f"{want[0]['experts_hit']}/16 experts hit" in printed


@pytest.mark.parametrize(
    "argv", [["routing", "--layers", "0"], ["routing", "--calib-tokens", "0"], ["routing", "--preset", "huge"]]
)
def test_cli_routing_refuses_bad_options(argv, capsys):
    from mxlib import cli

    with pytest.raises(SystemExit) as err:
        cli.main(argv)
    msg = str(err.value) + capsys.readouterr().err
    assert err.value.code != 0 and argv[1] in msg, msg  # the message names the refused option
