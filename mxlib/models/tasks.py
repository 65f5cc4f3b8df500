"""Synthetic tasks with exact answers, and their character-level tokenizer.

The project trains its own small MoE (``mxlib.models.training``) because real weights cannot be
downloaded here; these tasks are what it learns and what ``mxlib.models.evaluation`` scores. Each
task has one correct answer per prompt, so accuracy is exact match, not a judgement. They are
chosen so that experts can specialize (each prompt starts with its task's tag token, which
the router can read) and so that precision matters (a carry in an addition or a count is lost by
one wrong digit).

==========  ===============================================  ==============================
task        prompt (after ``<bos>``)                         answer (before ``<eos>``)
==========  ===============================================  ==============================
add         ``<add>`` a ``+`` b ``=``: two 4-digit numbers,   a + b, 5 digits, least
            digits least significant first                   significant first
sort        ``<sort>`` 6 digits ``=``                         the digits in ascending order
reverse     ``<reverse>`` 6 letters of a-h ``=``              the letters reversed
count       ``<count>`` 8 letters of a-d ``=``                how many are ``a`` (1 digit)
==========  ===============================================  ==============================

Numbers are written least significant digit first (the "reversed" format of Lee et al., 2023,
*Teaching Arithmetic to Small Transformers*): each answer digit then depends on digits already
seen, which a two-layer model learns in minutes on a CPU. Every prompt of a task has the same
length, and so has every answer; batches of one task need no padding.

Held-out prompts never appear in training: a prompt belongs to the held-out split when a keyed
BLAKE2b hash of its token ids falls in a fixed fifth of the hash range (``HELDOUT_FRACTION``),
whatever the seed, so no seed's training set holds another seed's held-out prompt.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "CharTokenizer",
    "TOKENIZER",
    "Task",
    "TASKS",
    "get_task",
    "Dataset",
    "SPLITS",
    "HELDOUT_FRACTION",
    "split_of",
    "make_dataset",
]


class CharTokenizer:
    """A fixed character-level vocabulary: ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, the task tags,
    then one token per character (digits, letters ``a``-``h``, ``+``, ``=``).

    ``encode`` reads a tag or special token written as ``<name>`` and every other character as
    itself. Raises ``ValueError`` on a character or tag outside the vocabulary.
    """

    SPECIALS = ("<pad>", "<bos>", "<eos>")
    CHARS = "0123456789abcdefgh+="

    def __init__(self, tags: tuple[str, ...]):
        self.vocab: tuple[str, ...] = (*self.SPECIALS, *(f"<{t}>" for t in tags), *self.CHARS)
        self.ids = {s: i for i, s in enumerate(self.vocab)}
        self.pad_id, self.bos_id, self.eos_id = (self.ids[s] for s in self.SPECIALS)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        out, i = [], 0
        while i < len(text):
            if text[i] == "<":
                j = text.find(">", i)
                piece = text[i : j + 1] if j > 0 else text[i:]
            else:
                piece = text[i]
            if piece not in self.ids:
                raise ValueError(f"text: {piece!r} at position {i} is not in the vocabulary {list(self.vocab)}")
            out.append(self.ids[piece])
            i += len(piece)
        return out

    def decode(self, ids) -> str:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"ids: expected values in [0, {self.vocab_size}), got {bad[0]}")
        return "".join(self.vocab[i] for i in ids)


# ----------------------------------------------------------------------------- the tasks


@dataclass(frozen=True)
class Task:
    """One synthetic task: ``sample(rng) -> (prompt_text, answer_text)`` without ``<bos>`` /
    ``<eos>``; ``prompt_len`` and ``answer_len`` count tokens with them (``<bos>`` opens every
    prompt, ``<eos>`` closes every answer)."""

    name: str
    description: str
    sample: Callable[[random.Random], tuple[str, str]]
    prompt_len: int
    answer_len: int


ADD_DIGITS = 4
SORT_LENGTH = 6
REVERSE_LENGTH = 6
REVERSE_LETTERS = "abcdefgh"
COUNT_LENGTH = 8
COUNT_LETTERS = "abcd"
COUNT_SYMBOL = "a"


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randrange(10**ADD_DIGITS), rng.randrange(10**ADD_DIGITS)
    rev = lambda x, width: str(x).zfill(width)[::-1]  # noqa: E731
    return f"<add>{rev(a, ADD_DIGITS)}+{rev(b, ADD_DIGITS)}=", rev(a + b, ADD_DIGITS + 1)


def _sort(rng: random.Random) -> tuple[str, str]:
    digits = [rng.randrange(10) for _ in range(SORT_LENGTH)]
    return "<sort>" + "".join(map(str, digits)) + "=", "".join(map(str, sorted(digits)))


def _reverse(rng: random.Random) -> tuple[str, str]:
    s = "".join(rng.choice(REVERSE_LETTERS) for _ in range(REVERSE_LENGTH))
    return f"<reverse>{s}=", s[::-1]


def _count(rng: random.Random) -> tuple[str, str]:
    s = "".join(rng.choice(COUNT_LETTERS) for _ in range(COUNT_LENGTH))
    return f"<count>{s}=", str(s.count(COUNT_SYMBOL))


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task(
            "add",
            f"{ADD_DIGITS}-digit addition with carries, least significant digit first",
            _add,
            2 + 2 * ADD_DIGITS + 2,
            ADD_DIGITS + 2,
        ),
        Task("sort", f"sort {SORT_LENGTH} digits ascending", _sort, 2 + SORT_LENGTH + 1, SORT_LENGTH + 1),
        Task(
            "reverse",
            f"reverse {REVERSE_LENGTH} letters of {REVERSE_LETTERS}",
            _reverse,
            2 + REVERSE_LENGTH + 1,
            REVERSE_LENGTH + 1,
        ),
        Task(
            "count",
            f"count the {COUNT_SYMBOL!r} among {COUNT_LENGTH} letters of {COUNT_LETTERS}",
            _count,
            2 + COUNT_LENGTH + 1,
            2,
        ),
    )
}

TOKENIZER = CharTokenizer(tuple(TASKS))


def get_task(name: str) -> Task:
    """The ``Task`` of a name. Raises ``ValueError`` naming the known tasks."""
    if name not in TASKS:
        raise ValueError(f"task: expected one of {list(TASKS)}, got {name!r}")
    return TASKS[name]


# ----------------------------------------------------------------------------- splits and data sets

SPLITS = ("train", "heldout")
HELDOUT_FRACTION = 0.2
_HASH_KEY = b"mxlib-heldout"


def split_of(prompt_ids) -> str:
    """``"heldout"`` or ``"train"``: the split a prompt (token ids, ``<bos>`` included) belongs to,
    by a keyed BLAKE2b hash of its ids; independent of any seed."""
    ids = prompt_ids.tolist() if isinstance(prompt_ids, torch.Tensor) else list(prompt_ids)
    digest = hashlib.blake2b(bytes(ids), digest_size=8, key=_HASH_KEY).digest()
    return SPLITS[1] if int.from_bytes(digest, "little") < HELDOUT_FRACTION * 2**64 else SPLITS[0]


@dataclass
class Dataset:
    """``n`` distinct prompts of one task and split, with their answers.

    ``prompts``: int64 ``[n, prompt_len]`` (``<bos>`` first); ``answers``: int64 ``[n, answer_len]``
    (``<eos>`` last). ``seed``: the generator's random seed.
    """

    task: str
    split: str
    seed: int
    prompts: torch.Tensor
    answers: torch.Tensor

    def __len__(self) -> int:
        return self.prompts.shape[0]

    def text(self, i: int) -> tuple[str, str]:
        """Example ``i`` as text: ``(prompt, answer)``."""
        return TOKENIZER.decode(self.prompts[i]), TOKENIZER.decode(self.answers[i])


# Draws allowed per requested prompt before giving up (the split or the prompt space is too small).
_MAX_DRAWS_PER_PROMPT = 50


def make_dataset(task: str, n: int, seed: int, split: str) -> Dataset:
    """``n`` distinct prompts of ``task`` from ``split`` (``"train"`` or ``"heldout"``), deterministic for
    ``seed`` (Python's ``random.Random(seed)`` drawing per task; the task's name is mixed into
    the seed so two tasks do not share draws).

    Raises:
        ValueError: unknown task or split; ``n`` not a positive int; the split holds fewer than
            ``n`` distinct prompts within the draw limit.
    """
    t = get_task(task)
    if split not in SPLITS:
        raise ValueError(f"split: expected one of {list(SPLITS)}, got {split!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ValueError(f"n: expected a positive int, got {n!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed: expected an int, got {seed!r}")
    rng = random.Random(f"{task}:{seed}")
    seen: set[tuple[int, ...]] = set()
    prompts, answers = [], []
    bos, eos = [TOKENIZER.bos_id], [TOKENIZER.eos_id]
    for _ in range(_MAX_DRAWS_PER_PROMPT * n):
        prompt_text, answer_text = t.sample(rng)
        p = tuple(bos + TOKENIZER.encode(prompt_text))
        if p in seen or split_of(p) != split:
            continue
        seen.add(p)
        prompts.append(p)
        answers.append(TOKENIZER.encode(answer_text) + eos)
        if len(prompts) == n:
            return Dataset(task, split, seed, torch.tensor(prompts), torch.tensor(answers))
    raise ValueError(
        f"n: {n} distinct {split} prompts of {task!r} not found in {_MAX_DRAWS_PER_PROMPT * n} draws "
        f"(found {len(prompts)})"
    )
