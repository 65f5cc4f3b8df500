"""A small Qwen3-MoE trained from scratch on the synthetic tasks, and its cache.

Every other number mxlib reports compares an emulated model with its own bf16 run on random
weights: that proves the emulation exact, not what FP4 costs a trained model. Real checkpoints
cannot be downloaded here, so this module trains one: transformers' ``Qwen3MoeForCausalLM`` (the
class of the project's dummy model), a few layers of hidden size 128 with 8 experts of
intermediate size 128 and top-2 routing, on the task mix of ``mxlib.models.tasks``. The experts
keep the shapes the quantization schemes need (H and I multiples of 128, so whole MX and NVFP4
blocks). ``mxlib.models.evaluation`` measures its accuracy under each scheme.

Training: fp32 master weights on the CPU, AdamW (decoupled weight decay on the matrices, none
on the norms), linear warm-up then cosine decay, gradient clipping, cross-entropy on the answer
tokens only (the prompt is given, never predicted) plus transformers' load-balancing loss on the
router (``router_aux_loss_coef``), which keeps every expert in use. Batches mix the tasks
uniformly; every prompt is from the training split. The result is cast to bf16 after training.

**Deterministic.** One thread (``torch.set_num_threads(1)``; two threads on a CPU shared with
other jobs also ran 5 to 20 times slower), ``torch.use_deterministic_algorithms(True)``, the
model initialized under ``torch.manual_seed(recipe.seed)`` and the batches drawn from a seeded
generator: the same recipe trains to the same bits on the same torch version (the tests train
the ``test`` recipe twice and compare every tensor's bits). The global RNG, thread count and
determinism flag are restored afterwards.

**Measured** (torch 2.13.0 CPU, transformers 5.24.0, a 2-core CPU shared with other jobs at a
load average near 3; ``time`` of one ``train`` call from an empty cache). ``default``: 2000 steps
of 32, all four tasks, 135 s of training (146 s wall, 95 s of CPU time); bf16 exact match on 2000
held-out prompts per task: add 0.974, sort 0.990, reverse 1.000, count 0.996. ``test``: 240 steps
of 32 on reverse and count, 24 s of training (36 s wall); 1000 held-out prompts: reverse 1.000,
count 0.999. Each trained to the same SHA-256 of its weights in two separate runs at different
loads.

**Cache.** ``train(recipe, cache_dir)`` keeps the fp32 weights (``model.safetensors``),
``config.json``, ``recipe.json`` and ``manifest.json`` (the cache key, the library versions, the
safetensors file's SHA-256, the training time) under ``cache_dir/<key>``, where the key hashes the
recipe, ``TRAINING_VERSION`` and the torch and transformers versions. An entry is written into a
temporary folder and renamed into place, so an interrupted write leaves no entry; an entry whose
files are missing, whose manifest does not match the recipe or whose weights fail their hash is
not reused (it is trained again and replaced).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from .tasks import TASKS, TOKENIZER, get_task, make_dataset

__all__ = [
    "TRAINING_VERSION",
    "TrainRecipe",
    "RECIPES",
    "get_recipe",
    "batch_counts",
    "model_config",
    "recipe_key",
    "training_data",
    "train_fp32",
    "train",
    "load_entry",
    "SHIPPED_DIR",
    "shipped_entry",
    "load_shipped",
    "write_shipped",
    "ENTRY_FILES",
]

# Bump when the training code or the task generators change what a recipe trains to.
TRAINING_VERSION = 1

ENTRY_FILES = ("model.safetensors", "config.json", "recipe.json", "manifest.json")


@dataclass(frozen=True)
class TrainRecipe:
    """Everything a trained model depends on: model sizes, tasks, optimizer and schedule, seed.

    ``hidden_size`` and ``moe_intermediate_size`` must be multiples of 128 (whole blocks of every
    scheme, and the fused FP4 kernel's tile); ``head_dim * num_attention_heads`` need not equal
    ``hidden_size`` (Qwen3 projects). ``train_examples_per_task`` distinct training prompts per
    task are drawn once (seed ``seed``); every batch of ``batch_size`` holds each task in proportion
    to ``task_weights`` (``batch_counts``), its rows drawn with replacement from that task's
    prompts. The default gives addition, the slowest task to learn, half of every batch. ``lr``
    peaks after ``warmup_steps`` and decays by a cosine to ``min_lr_ratio * lr`` at ``steps``.
    """

    tasks: tuple[str, ...] = tuple(TASKS)
    task_weights: tuple[float, ...] = (0.5, 0.2, 0.15, 0.15)
    hidden_size: int = 128
    moe_intermediate_size: int = 128
    num_experts: int = 8
    num_experts_per_tok: int = 2
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    steps: int = 2000
    batch_size: int = 32
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    adam_betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    router_aux_loss_coef: float = 0.01
    train_examples_per_task: int = 16000
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "tasks", tuple(self.tasks))
        object.__setattr__(self, "adam_betas", tuple(self.adam_betas))
        object.__setattr__(self, "task_weights", tuple(float(w) for w in self.task_weights))
        if not self.tasks:
            raise ValueError("tasks: expected at least one task name, got ()")
        for t in self.tasks:
            get_task(t)
        if len(self.task_weights) != len(self.tasks) or not all(w > 0 for w in self.task_weights):
            raise ValueError(
                f"task_weights: expected {len(self.tasks)} positive weights (one per task), got {self.task_weights}"
            )
        for name in ("hidden_size", "moe_intermediate_size"):
            v = getattr(self, name)
            if v <= 0 or v % 128:
                raise ValueError(f"{name}: expected a positive multiple of 128, got {v}")
        for name in (
            "num_experts",
            "num_experts_per_tok",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "steps",
            "batch_size",
            "train_examples_per_task",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name}: expected a positive int, got {v!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok: expected <= num_experts = {self.num_experts}, got {self.num_experts_per_tok}"
            )
        if not self.lr > 0:
            raise ValueError(f"lr: expected > 0, got {self.lr}")

    def to_dict(self) -> dict:
        d = asdict(self)
        for name in ("tasks", "task_weights", "adam_betas"):
            d[name] = list(getattr(self, name))
        return d

    @classmethod
    def from_dict(cls, d: dict) -> TrainRecipe:
        """The recipe of ``to_dict``'s output. Raises ``ValueError`` on an unknown field."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"recipe: unknown fields {unknown}; expected a subset of {sorted(known)}")
        return cls(**d)


RECIPES: dict[str, TrainRecipe] = {
    # the workbook's model: all four tasks
    "default": TrainRecipe(),
    # the tests' model: the two tasks a few hundred small steps learn
    "test": TrainRecipe(
        tasks=("reverse", "count"),
        task_weights=(1, 1),
        steps=240,
        batch_size=32,
        warmup_steps=12,
        lr=3e-3,
        train_examples_per_task=4000,
    ),
}


def get_recipe(name: str) -> TrainRecipe:
    """A ``RECIPES`` preset by name. Raises ``ValueError`` naming the presets."""
    if name not in RECIPES:
        raise ValueError(f"recipe: expected one of {list(RECIPES)}, got {name!r}")
    return RECIPES[name]


def model_config(recipe: TrainRecipe) -> Qwen3MoeConfig:
    """The ``Qwen3MoeConfig`` of a recipe: every layer an MoE layer, the tokenizer's vocabulary."""
    return Qwen3MoeConfig(
        vocab_size=TOKENIZER.vocab_size,
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.moe_intermediate_size * recipe.num_experts_per_tok,  # dense MLP: unused
        moe_intermediate_size=recipe.moe_intermediate_size,
        num_hidden_layers=recipe.num_hidden_layers,
        num_attention_heads=recipe.num_attention_heads,
        num_key_value_heads=recipe.num_key_value_heads,
        head_dim=recipe.head_dim,
        num_experts=recipe.num_experts,
        num_experts_per_tok=recipe.num_experts_per_tok,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=128,
        tie_word_embeddings=False,
        router_aux_loss_coef=recipe.router_aux_loss_coef,
        pad_token_id=TOKENIZER.pad_id,
        bos_token_id=TOKENIZER.bos_id,
        eos_token_id=TOKENIZER.eos_id,
    )


def recipe_key(recipe: TrainRecipe) -> str:
    """The cache key: 16 hex digits of the SHA-256 of the recipe, its tasks' descriptions and lengths
    (which name their sizes), the tokenizer's vocabulary, ``TRAINING_VERSION`` and the torch and
    transformers versions."""
    tasks = [[t, TASKS[t].description, TASKS[t].prompt_len, TASKS[t].answer_len] for t in recipe.tasks]
    blob = json.dumps(
        dict(
            recipe=recipe.to_dict(),
            tasks=tasks,
            vocab=TOKENIZER.vocab,
            training_version=TRAINING_VERSION,
            torch=torch.__version__,
            transformers=transformers.__version__,
        ),
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def batch_counts(recipe: TrainRecipe) -> list[int]:
    """Rows of each task in every batch: ``batch_size * task_weights / sum(task_weights)`` rounded by
    largest remainder (ties to the earlier task), so they sum to ``batch_size``."""
    total = sum(recipe.task_weights)
    exact = [recipe.batch_size * w / total for w in recipe.task_weights]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[: recipe.batch_size - sum(counts)]:
        counts[i] += 1
    return counts


def training_data(recipe: TrainRecipe) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sequences [N, W], loss_mask [N, W - 1])``: prompt then answer, right-padded with ``<pad>``
    to the longest task's ``W``; ``loss_mask[i, j]`` marks the positions whose next token
    (``sequences[i, j + 1]``) is an answer token. ``N = len(tasks) * train_examples_per_task``,
    task by task in ``recipe.tasks`` order."""
    width = max(TASKS[t].prompt_len + TASKS[t].answer_len for t in recipe.tasks)
    seqs, masks = [], []
    for t in recipe.tasks:
        d = make_dataset(t, recipe.train_examples_per_task, recipe.seed, "train")
        p, a = d.prompts.shape[1], d.answers.shape[1]
        s = torch.full((len(d), width), TOKENIZER.pad_id, dtype=torch.long)
        s[:, : p + a] = torch.cat([d.prompts, d.answers], 1)
        m = torch.zeros(len(d), width - 1, dtype=torch.bool)
        m[:, p - 1 : p + a - 1] = True
        seqs.append(s)
        masks.append(m)
    return torch.cat(seqs), torch.cat(masks)


@contextlib.contextmanager
def _deterministic(seed: int):
    threads = torch.get_num_threads()
    flag = torch.are_deterministic_algorithms_enabled()
    with torch.random.fork_rng(devices=[]):
        torch.set_num_threads(1)
        torch.use_deterministic_algorithms(True)
        torch.manual_seed(seed)
        try:
            yield
        finally:
            torch.set_num_threads(threads)
            torch.use_deterministic_algorithms(flag)


def _lr_at(recipe: TrainRecipe, step: int) -> float:
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
    return recipe.lr * (recipe.min_lr_ratio + (1 - recipe.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def train_fp32(recipe: TrainRecipe, log: Callable[[dict], None] | None = None, log_every: int = 100):
    """Train a recipe from scratch (no cache); returns the fp32 ``Qwen3MoeForCausalLM`` in eval mode.

    ``log`` receives ``{"step", "seconds", "lr", "loss", "aux_loss"}`` every ``log_every`` steps and
    at the last. Deterministic (module docstring).
    """
    start = time.perf_counter()
    with _deterministic(recipe.seed):
        seqs, mask = training_data(recipe)
        model = Qwen3MoeForCausalLM(model_config(recipe))  # initialized from the seeded global RNG
        model.train()
        matrices = [p for n, p in model.named_parameters() if p.ndim >= 2]
        others = [p for n, p in model.named_parameters() if p.ndim < 2]
        opt = torch.optim.AdamW(
            [dict(params=matrices, weight_decay=recipe.weight_decay), dict(params=others, weight_decay=0.0)],
            lr=recipe.lr,
            betas=recipe.adam_betas,
        )
        gen = torch.Generator().manual_seed(recipe.seed)
        pad, per_task = TOKENIZER.pad_id, recipe.train_examples_per_task
        counts = batch_counts(recipe)
        for step in range(recipe.steps):
            lr = _lr_at(recipe, step)
            for group in opt.param_groups:
                group["lr"] = lr
            idx = torch.cat(
                [i * per_task + torch.randint(0, per_task, (c,), generator=gen) for i, c in enumerate(counts) if c]
            )
            x, m = seqs[idx], mask[idx]
            inputs = x[:, :-1]
            out = model(
                input_ids=inputs, attention_mask=(inputs != pad).long(), output_router_logits=True, use_cache=False
            )
            loss = torch.nn.functional.cross_entropy(out.logits[m].float(), x[:, 1:][m])
            total = loss + recipe.router_aux_loss_coef * out.aux_loss
            opt.zero_grad(set_to_none=True)
            total.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
            opt.step()
            if log is not None and (step % log_every == 0 or step == recipe.steps - 1):
                log(
                    dict(
                        step=step,
                        seconds=time.perf_counter() - start,
                        lr=lr,
                        loss=loss.item(),
                        aux_loss=out.aux_loss.item(),
                    )
                )
    model.eval()
    model.train_seconds = time.perf_counter() - start
    return model


# ----------------------------------------------------------------------------- the cache


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@torch.no_grad()
def _parameters_to(model, dtype: torch.dtype):
    """``model`` with its parameters cast to ``dtype`` and its buffers as built (RoPE's ``inv_freq`` float32): what
    a model built with the dtype set holds, as ``from_pretrained`` and mxlib's checkpoint loader build it. A plain
    ``model.to(bfloat16)`` also rounds ``inv_freq`` to bf16, and the model's rotary angles then differ from every
    checkpoint loaded back from it (measured on the default recipe's model: 0.14 % of the first layer's tokens routed
    to another expert set)."""
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model


def load_entry(entry: Path, recipe: TrainRecipe | None = None, dtype: torch.dtype = torch.bfloat16):
    """The model of a complete cache entry in ``dtype`` (eval mode), or None where the entry is
    missing, incomplete, written for another recipe or key, or its weights fail their SHA-256.

    The model carries ``mxlib_training``: the manifest, plus ``cache_hit`` and ``path``.
    """
    entry = Path(entry)
    if not all((entry / f).is_file() for f in ENTRY_FILES):
        return None
    try:
        manifest = json.loads((entry / "manifest.json").read_text())
        stored = TrainRecipe.from_dict(json.loads((entry / "recipe.json").read_text()))
    except (ValueError, TypeError):
        return None
    if recipe is not None and (stored != recipe or manifest.get("key") != recipe_key(recipe)):
        return None
    if manifest.get("sha256") != _sha256(entry / "model.safetensors"):
        return None
    try:
        config = Qwen3MoeConfig.from_json_file(str(entry / "config.json"))
        state = load_file(str(entry / "model.safetensors"))
        model = Qwen3MoeForCausalLM(config)
        model.load_state_dict(state, strict=True)
    except (OSError, ValueError, RuntimeError, KeyError):
        return None
    model = _parameters_to(model, dtype).eval()
    model.mxlib_training = dict(manifest, cache_hit=True, path=str(entry))
    return model


def _write_entry(model, recipe: TrainRecipe, entry: Path) -> None:
    tmp = entry.parent / f".tmp-{entry.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(tmp / "model.safetensors"))
        model.config.to_json_file(str(tmp / "config.json"))
        (tmp / "recipe.json").write_text(json.dumps(recipe.to_dict(), indent=1, sort_keys=True))
        manifest = dict(
            key=recipe_key(recipe),
            training_version=TRAINING_VERSION,
            torch=torch.__version__,
            transformers=transformers.__version__,
            sha256=_sha256(tmp / "model.safetensors"),
            train_seconds=round(model.train_seconds, 2),
        )
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))  # written last
        if entry.exists():
            shutil.rmtree(entry, ignore_errors=True)  # an incomplete or stale entry (load_entry refused it)
        try:
            os.replace(tmp, entry)
        except OSError:  # another process wrote the entry first: keep it if it is complete
            if load_entry(entry, recipe) is None:
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# The models mxlib ships: ``trained/<recipe name>/`` beside this module holds each ``RECIPES`` entry's weights
# as trained by ``train_fp32`` and cast to bf16 (``model.safetensors``), its ``config.json``, ``recipe.json``
# and ``manifest.json`` (the cache key it was trained under, the torch and transformers versions, the
# SHA-256 of the weights, the training time, and the bf16 accuracy measured on held-out prompts).
SHIPPED_DIR = Path(__file__).parent / "trained"


def shipped_entry(recipe: TrainRecipe | str) -> Path | None:
    """The shipped folder of ``recipe`` (a ``RECIPES`` name, or a recipe equal to one), or None."""
    recipe = get_recipe(recipe) if isinstance(recipe, str) else recipe
    for name, r in RECIPES.items():
        if r == recipe and (SHIPPED_DIR / name / "manifest.json").is_file():
            return SHIPPED_DIR / name
    return None


def load_shipped(recipe: TrainRecipe | str, dtype: torch.dtype = torch.bfloat16):
    """The shipped model of ``recipe`` in ``dtype`` (its weights are bf16: ``float32`` holds the same values),
    eval mode, or None where none is shipped for it. The same model on every machine, whatever torch and
    transformers versions run it (those it was trained with are in its manifest).

    The model carries ``mxlib_training``: the manifest, ``cache_hit`` (True), ``shipped`` (True) and ``path``.

    Raises:
        RuntimeError: a shipped entry whose weights fail their SHA-256 or do not load (a damaged install).
    """
    recipe = get_recipe(recipe) if isinstance(recipe, str) else recipe
    entry = shipped_entry(recipe)
    if entry is None:
        return None
    manifest = json.loads((entry / "manifest.json").read_text())
    stored = TrainRecipe.from_dict(json.loads((entry / "recipe.json").read_text()))
    if stored != recipe:
        raise RuntimeError(f"{entry}: recipe.json does not hold the recipe it is shipped for")
    if manifest.get("sha256") != _sha256(entry / "model.safetensors"):
        raise RuntimeError(f"{entry / 'model.safetensors'}: SHA-256 differs from its manifest (a damaged install)")
    config = Qwen3MoeConfig.from_json_file(str(entry / "config.json"))
    model = Qwen3MoeForCausalLM(config)
    model.load_state_dict(load_file(str(entry / "model.safetensors")), strict=True)
    model = _parameters_to(model, dtype).eval()
    model.mxlib_training = dict(manifest, cache_hit=True, shipped=True, path=str(entry))
    return model


def write_shipped(model, recipe: TrainRecipe, name: str, accuracy: dict, folder: Path | None = None) -> Path:
    """Write ``model`` (trained by ``train_fp32`` on ``recipe``; its weights cast to bf16) as the shipped
    entry ``name`` under ``folder`` (default ``SHIPPED_DIR``), ``accuracy`` (its measured bf16 accuracy) in
    the manifest. ``tools/ship_trained.py`` runs it. Returns the folder."""
    folder = Path(folder) if folder is not None else SHIPPED_DIR
    entry = folder / name
    entry.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(entry / "model.safetensors"))
    os.chmod(entry / "model.safetensors", 0o644)
    model.config.to_json_file(str(entry / "config.json"))
    (entry / "recipe.json").write_text(json.dumps(recipe.to_dict(), indent=1, sort_keys=True) + "\n")
    info = getattr(model, "mxlib_training", {})
    manifest = dict(
        key=recipe_key(recipe),
        training_version=TRAINING_VERSION,
        torch=info.get("torch", torch.__version__),
        transformers=info.get("transformers", transformers.__version__),
        sha256=_sha256(entry / "model.safetensors"),
        train_seconds=info.get("train_seconds"),
        weights_dtype="bfloat16",
        accuracy=accuracy,
    )
    (entry / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return entry


def train(
    recipe: TrainRecipe | str,
    cache_dir,
    log: Callable[[dict], None] | None = None,
    dtype: torch.dtype = torch.bfloat16,
    retrain: bool = False,
):
    """The trained model of ``recipe`` (a ``TrainRecipe`` or a ``RECIPES`` name) in ``dtype`` (bf16:
    cast after training), eval mode: the shipped one (``load_shipped``: the same on every machine) unless
    ``retrain``; else from ``cache_dir/<recipe_key>`` when a complete entry is there, else trained
    (``train_fp32``) and cached first.

    The model carries ``mxlib_training``: the manifest (``key``, versions, ``sha256``,
    ``train_seconds``), ``cache_hit``, ``path`` and, for a shipped model, ``shipped``.

    Raises:
        ValueError: an unknown recipe name.
    """
    recipe = get_recipe(recipe) if isinstance(recipe, str) else recipe
    if not retrain:
        shipped = load_shipped(recipe, dtype)
        if shipped is not None:
            return shipped
    entry = Path(cache_dir) / recipe_key(recipe)
    model = load_entry(entry, recipe, dtype)
    if model is not None:
        return model
    trained = train_fp32(recipe, log=log)
    entry.parent.mkdir(parents=True, exist_ok=True)
    _write_entry(trained, recipe, entry)
    model = load_entry(entry, recipe, dtype)
    if model is None:
        raise RuntimeError(f"cache_dir: the entry just written at {entry} does not load")
    model.mxlib_training["cache_hit"] = False
    return model
