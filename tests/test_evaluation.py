"""The synthetic tasks, the bootstrap intervals, the paired comparison and the evaluation plumbing.

The models here are small random-weight ones (no training): accuracy is the business of
tests/test_training.py, which trains the ``test`` recipe.
"""

import math

import pytest
import torch
from transformers import Qwen3MoeForCausalLM

from mxlib.models import evaluation as ev
from mxlib.models.tasks import (
    ADD_DIGITS,
    COUNT_SYMBOL,
    TASKS,
    TOKENIZER,
    Dataset,
    get_task,
    make_dataset,
    split_of,
)
from mxlib.models.training import TrainRecipe, model_config

# ----------------------------------------------------------------------------- tasks


def _answer_of(task: str, prompt: str) -> str:
    """An independent statement of each task's answer, from the prompt's text."""
    body = prompt.removeprefix("<bos>").split(">", 1)[1].rstrip("=")
    if task == "add":
        a, b = body.split("+")
        total = int(a[::-1]) + int(b[::-1])
        return str(total).zfill(ADD_DIGITS + 1)[::-1]
    if task == "sort":
        return "".join(sorted(body))
    if task == "reverse":
        return body[::-1]
    if task == "count":
        return str(body.count(COUNT_SYMBOL))
    raise AssertionError(task)


@pytest.mark.parametrize("task", list(TASKS))
def test_answers_are_right_and_lengths_fixed(task):
    d = make_dataset(task, 200, 3, "heldout")
    assert d.prompts.shape == (200, TASKS[task].prompt_len)
    assert d.answers.shape == (200, TASKS[task].answer_len)
    assert (d.prompts[:, 0] == TOKENIZER.bos_id).all() and (d.answers[:, -1] == TOKENIZER.eos_id).all()
    assert (d.prompts[:, 1] == TOKENIZER.ids[f"<{task}>"]).all()  # the tag the router can read
    for i in range(len(d)):
        prompt, answer = d.text(i)
        assert answer == _answer_of(task, prompt) + "<eos>", (prompt, answer)


@pytest.mark.parametrize("task", list(TASKS))
def test_heldout_prompts_never_in_training(task):
    train = make_dataset(task, 4000, 0, "train")
    other_seed = make_dataset(task, 4000, 1, "train")
    held = make_dataset(task, 1000, 0, "heldout")
    rows = lambda d: {tuple(r) for r in d.prompts.tolist()}  # noqa: E731
    assert len(rows(train)) == 4000 and len(rows(held)) == 1000  # distinct prompts
    assert not rows(held) & (rows(train) | rows(other_seed))
    assert all(split_of(p) == "train" for p in train.prompts[:200])
    assert all(split_of(p) == "heldout" for p in held.prompts[:200])


def test_datasets_are_deterministic_per_seed():
    a, b, c = (make_dataset("add", 100, s, "train") for s in (5, 5, 6))
    assert torch.equal(a.prompts, b.prompts) and torch.equal(a.answers, b.answers)
    assert not torch.equal(a.prompts, c.prompts)


def test_bad_dataset_arguments():
    with pytest.raises(ValueError, match="task: expected one of"):
        make_dataset("multiply", 10, 0, "train")
    with pytest.raises(ValueError, match="task: expected one of"):
        get_task("multiply")
    for n in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="n: expected a positive int"):
            make_dataset("add", n, 0, "train")
    with pytest.raises(ValueError, match="split: expected one of"):
        make_dataset("add", 10, 0, "test")
    with pytest.raises(ValueError, match="not in the vocabulary"):
        TOKENIZER.encode("<add>12*3")
    with pytest.raises(ValueError, match="not in the vocabulary"):
        TOKENIZER.encode("<divide>12")


def test_tokenizer_round_trip():
    text = "<bos><sort>3141=1134<eos>"
    assert TOKENIZER.decode(TOKENIZER.encode(text)) == text
    assert TOKENIZER.encode("<pad>") == [TOKENIZER.pad_id] and TOKENIZER.pad_id == 0


# ----------------------------------------------------------------------------- bootstrap


def test_all_correct_and_all_wrong_give_degenerate_intervals():
    one = ev.bootstrap_interval(torch.ones(50, dtype=torch.bool))
    zero = ev.bootstrap_interval(torch.zeros(50, dtype=torch.bool))
    assert (one.estimate, one.low, one.high) == (1.0, 1.0, 1.0)
    assert (zero.estimate, zero.low, zero.high) == (0.0, 0.0, 0.0)


@pytest.mark.parametrize("n, k", [(400, 280), (1000, 950), (250, 125)])
def test_binomial_interval_matches_the_normal_approximation(n, k):
    # a proportion's bootstrap interval against p +- z sqrt(p (1 - p) / n), independent of the code
    values = torch.zeros(n, dtype=torch.bool)
    values[:k] = True
    iv = ev.bootstrap_interval(values, resamples=4000, seed=1)
    p = k / n
    half = 1.959964 * math.sqrt(p * (1 - p) / n)
    assert iv.estimate == pytest.approx(p)
    assert iv.low == pytest.approx(p - half, abs=0.25 * half)
    assert iv.high == pytest.approx(p + half, abs=0.25 * half)


def test_weighted_bootstrap_is_a_ratio_of_sums():
    values, weights = torch.tensor([3.0, 1.0, 8.0]), torch.tensor([3.0, 1.0, 4.0])
    iv = ev.bootstrap_interval(values, weights, seed=0)
    assert iv.estimate == pytest.approx(12 / 8)
    assert 1.0 <= iv.low <= iv.estimate <= iv.high <= 2.0


def test_bootstrap_is_seeded():
    v = torch.rand(100, generator=torch.Generator().manual_seed(0))
    assert ev.bootstrap_interval(v, seed=3) == ev.bootstrap_interval(v, seed=3)
    assert ev.bootstrap_interval(v, seed=3) != ev.bootstrap_interval(v, seed=4)


def test_bad_bootstrap_arguments():
    with pytest.raises(ValueError, match="values: expected at least one value"):
        ev.bootstrap_interval(torch.zeros(0))
    with pytest.raises(ValueError, match="resamples"):
        ev.bootstrap_interval(torch.ones(3), resamples=0)
    with pytest.raises(ValueError, match="confidence"):
        ev.bootstrap_interval(torch.ones(3), confidence=1.5)
    with pytest.raises(ValueError, match="weights: expected shape"):
        ev.bootstrap_interval(torch.ones(3), torch.ones(4))
    with pytest.raises(ValueError, match="a, b"):
        ev.paired_bootstrap_interval(torch.ones(3), torch.ones(4))


def _results(correct: torch.Tensor, nll: torch.Tensor, task="add", sha="x") -> ev.Results:
    tokens = torch.full(correct.shape, 4)
    r = ev.TaskResult(
        task, correct, nll.double(), tokens, sha, ev.bootstrap_interval(correct), ev.bootstrap_interval(nll, tokens)
    )
    return ev.Results(tasks={task: r})


def test_paired_comparison_sign_and_significance():
    n = 500
    g = torch.Generator().manual_seed(0)
    a = torch.rand(n, generator=g) < 0.9
    b = a.clone()
    b[torch.nonzero(a)[:40, 0]] = False  # b loses 40 prompts a got right
    nll_a = torch.rand(n, generator=g)
    ra, rb = _results(a, nll_a), _results(b, nll_a + 0.5)
    d = ev.compare(ra, rb)["add"]
    em, nll = d["exact_match"], d["nll_per_token"]
    assert em.estimate == pytest.approx(-40 / n) and em.high < 0 and em.significant and em.flips == 40
    assert nll.estimate == pytest.approx(0.5 / 4) and nll.low > 0 and nll.significant
    back = ev.compare(rb, ra)["add"]["exact_match"]
    assert back.estimate == pytest.approx(-em.estimate) and back.low > 0
    assert em.beyond(0.01) and not em.beyond(0.1)
    same = ev.compare(ra, ra)["add"]["exact_match"]
    assert (same.estimate, same.low, same.high, same.significant, same.flips) == (0.0, 0.0, 0.0, False, 0)


def test_paired_interval_is_narrower_than_unpaired():
    # two models that share most errors: pairing removes the shared prompt difficulty
    g = torch.Generator().manual_seed(1)
    a = torch.rand(400, generator=g) < 0.7
    b = a.clone()
    b[torch.nonzero(a)[:6, 0]] = False
    paired = ev.paired_bootstrap_interval(a, b, seed=0)
    ia, ib = ev.bootstrap_interval(a, seed=0), ev.bootstrap_interval(b, seed=1)
    assert paired.high - paired.low < 0.5 * min(ia.high - ia.low, ib.high - ib.low)


def test_compare_refuses_other_prompts():
    c = torch.ones(10, dtype=torch.bool)
    with pytest.raises(ValueError, match="other prompts"):
        ev.compare(_results(c, torch.ones(10), sha="a"), _results(c, torch.ones(10), sha="b"))
    with pytest.raises(ValueError, match="no task in common"):
        ev.compare(_results(c, torch.ones(10), task="add"), _results(c, torch.ones(10), task="sort"))


# ----------------------------------------------------------------------------- evaluation on a small model


@pytest.fixture(scope="module")
def random_model():
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(model_config(TrainRecipe(num_hidden_layers=1)))
    return model.to(torch.bfloat16).eval()


@pytest.fixture(scope="module")
def small_sets():
    return [make_dataset(t, 24, 0, "heldout") for t in ("add", "count")]


def test_greedy_decoding_agrees_with_teacher_forcing(random_model, small_sets):
    # the decoded tokens are, step by step, the argmax of the model run on its own output
    d = small_sets[0]
    gen = ev.greedy_decode(random_model, d.prompts, 4)
    logits = ev._forward(random_model, torch.cat([d.prompts, gen[:, :-1]], 1), 0)
    assert torch.equal(logits[:, d.prompts.shape[1] - 1 :].argmax(-1), gen)


def test_evaluate_reports_every_task(random_model, small_sets):
    r = ev.evaluate(random_model, small_sets, batch_size=10, resamples=200)
    assert list(r.tasks) == ["add", "count"]
    for res in r.tasks.values():
        assert res.n == 24 and res.correct.dtype == torch.bool
        assert res.exact_match.low <= res.exact_match.estimate <= res.exact_match.high
        assert res.nll_per_token.low <= res.nll_per_token.estimate <= res.nll_per_token.high
        assert res.nll_per_token.estimate > 0
    # one batch or three, in order or shuffled: the same prompts get the same outcome
    again = ev.evaluate(random_model, small_sets, batch_size=24, resamples=200, order_seed=5)
    assert ev.compare(r, again)["add"]["exact_match"].flips == 0


def test_left_padding_keeps_the_answer_logits(random_model, small_sets):
    d = small_sets[1]
    ids = torch.cat([d.prompts, d.answers[:, :-1]], 1)
    plain, padded = ev._forward(random_model, ids, 0), ev._forward(random_model, ids, 3)
    assert padded.shape == plain.shape
    assert (padded - plain).abs().max() < 0.1  # bf16: mask and position ids, not the same kernels


def test_bad_evaluate_input(random_model, small_sets):
    with pytest.raises(ValueError, match="datasets: expected at least one"):
        ev.evaluate(random_model, [])
    empty = Dataset("add", "heldout", 0, torch.zeros(0, 12, dtype=torch.long), torch.zeros(0, 6, dtype=torch.long))
    with pytest.raises(ValueError, match="empty"):
        ev.evaluate(random_model, empty)
    with pytest.raises(ValueError, match="two datasets of task"):
        ev.evaluate(random_model, [small_sets[0], small_sets[0]])
    with pytest.raises(ValueError, match="batch_size"):
        ev.evaluate(random_model, small_sets, batch_size=0)
    with pytest.raises(TypeError, match="Dataset"):
        ev.evaluate(random_model, [object()])


# NVFP4's per-expert input scales are unified to their max, with a warning (mxlib.moe.scales)
@pytest.mark.filterwarnings("ignore:w13_input_scale:UserWarning", "ignore:w2_input_scale:UserWarning")
def test_emulated_experts_swap_and_restore(random_model, small_sets):
    original = random_model.model.layers[0].mlp.experts
    with pytest.raises(ValueError, match="calibration"):
        with ev.emulated_experts(random_model, "nvfp4"):
            pass
    with pytest.raises(ValueError, match="unknown MoE scheme"):
        with ev.emulated_experts(random_model, "int3"):
            pass
    cal = ev.calibrate_tasks(random_model, small_sets)
    assert cal.layers[0].tokens.sum() == 2 * sum(d.prompts.numel() + d.answers.numel() for d in small_sets)
    for scheme in ("nvfp4", "w_mxfp4_a_mxfp4"):
        with ev.emulated_experts(random_model, scheme, cal) as m:
            assert type(m.model.layers[0].mlp.experts).__name__ == "TransformersExperts"
            r = ev.evaluate(m, small_sets[:1], resamples=100)
            assert r.tasks["add"].nll_per_token.estimate > 0
        assert random_model.model.layers[0].mlp.experts is original


def test_expert_usage_and_kl(random_model, small_sets):
    u = ev.expert_usage(random_model, small_sets[0])
    assert u.shape == (1, random_model.config.num_experts)
    assert torch.allclose(u.sum(1), torch.ones(1, dtype=torch.float64))
    e = 8
    assert ev.kl_from_uniform(torch.full((1, e), 1 / e)).item() == pytest.approx(0.0, abs=1e-12)
    assert ev.kl_from_uniform(torch.eye(e)[:1]).item() == pytest.approx(math.log(e))


def test_expert_counts_match_the_router_logits(random_model, small_sets):
    # the oracle: transformers' own router logits (output_router_logits), top-k taken here
    d = small_sets[0]
    counts = ev.expert_counts(random_model, d, batch_size=10)
    ids = torch.cat([d.prompts, d.answers[:, :-1]], 1)
    k, e = random_model.config.num_experts_per_tok, random_model.config.num_experts
    with torch.no_grad():
        logits = random_model(input_ids=ids, output_router_logits=True, use_cache=False).router_logits
    assert counts.shape == (len(d), len(logits), e) and counts.dtype == torch.int64
    for layer, lg in enumerate(logits):
        top = lg.float().topk(k, dim=-1).indices.reshape(len(d), -1)
        want = torch.stack([torch.bincount(row, minlength=e) for row in top])
        assert torch.equal(counts[:, layer], want), layer
    assert (counts.sum(-1) == ids.shape[1] * k).all()
    assert torch.allclose(
        ev.expert_usage(random_model, d), counts.sum(0).double() / counts.sum((0, 2))[:, None].double()
    )


def test_calibration_keeps_the_activations_of_every_dataset(random_model, small_sets):
    cal = ev.calibrate_tasks(random_model, small_sets, keep_activations=True)
    tokens = sum(d.prompts.numel() + d.answers.numel() for d in small_sets)
    k = random_model.config.num_experts_per_tok
    for lc in cal.layers:
        assert lc.a1.shape[0] == tokens and lc.a2.shape[0] == tokens * k and lc.topk_ids.shape == (tokens, k)
        flat = lc.topk_ids.reshape(-1).long()
        for e in range(random_model.config.num_experts):
            rows = (flat == e).nonzero().squeeze(1)
            assert lc.tokens[e] == rows.numel()
            if rows.numel():  # the kept rows hold the recorded maxima, bit for bit
                assert lc.a1[rows // k].abs().amax().float() == lc.a1_amax[e]
                assert lc.a2[rows].abs().amax().float() == lc.a2_amax[e]
    plain = ev.calibrate_tasks(random_model, small_sets)
    assert plain.layers[0].a1 is None and torch.equal(plain.layers[0].a2_amax, cal.layers[0].a2_amax)


def test_decode_is_checked(random_model, small_sets):
    with pytest.raises(ValueError, match="decode: expected one of"):
        ev.evaluate(random_model, small_sets, decode="beam")
