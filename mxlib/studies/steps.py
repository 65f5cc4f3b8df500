"""The pipeline steps notebook 01 and ``mxlib.cli e2e`` run, as plain functions, so that notebooks stay thin.

0. ``check_e2e_parameters``: every parameter checked before anything is built; the scheme name
   resolved to a ``MoEQuantScheme`` here, once (``check_schemes`` does the same for a list of names).
1. ``build_model`` / ``dummy_model``: the seeded bf16 Qwen3-30B-A3B (``num_hidden_layers`` of them).
2. ``write_checkpoint`` / ``prepare_checkpoint``: calibrate it (``calibrate_model``), quantize the
   experts, write the checkpoint in the real layout (ModelOpt or Quark), cached under
   ``default_cache_dir()`` by everything that determines it (``checkpoint_cache_key``).
3. ``load_checkpoint``: load it back with emulation experts (``mxlib.checkpoints``).
4. ``evaluation_token_ids`` / ``evaluation_token_sets``, ``run_model`` / ``compare_runs``: the same
   token ids through both models (``repeats`` token sets, for the spread of every metric), per-layer
   and logits metrics; ``set_numerics`` switches a loaded model between vLLM's numerics and the
   hardware's; ``save_results`` writes a notebook's results JSON.

The functions that take ``E2EParameters`` bind its values (the seeds, the sizes, the device), so
that notebook 01 and the CLI run the same steps on the same values.
"""

from __future__ import annotations

import ctypes
import gc
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..analysis import compare_logits, compare_tensors
from ..checkpoints import load_quantized_qwen3_moe, write_quantized_checkpoint
from ..checkpoints.files.safetensors_io import WRITER_VERSION, SafetensorsHeaders, is_mxlib_checkpoint
from ..formats import Numerics, get_numerics
from ..models.calibration import Calibration, calibrate
from ..models.gpt_oss import GPT_OSS_PRESETS, dummy_gpt_oss, gpt_oss_20b_config, gpt_oss_layout_for
from ..models.parameters import check_parameters
from ..models.qwen3 import MODEL_PRESETS, dummy_qwen3_moe, model_preset_overrides, moe_layers, qwen3_30b_a3b_config
from ..moe.base import BACKENDS
from ..moe.emulation import QuantizedExperts
from ..moe.schemes import MOE_SCHEMES, MoEQuantScheme, get_moe_scheme

__all__ = [
    "E2EParameters",
    "check_e2e_parameters",
    "check_schemes",
    "check_positive_int",
    "check_parameters",
    "check_device",
    "check_backend",
    "prepare_results_path",
    "resolve_device",
    "random_token_ids",
    "evaluation_token_ids",
    "evaluation_token_sets",
    "NUMERICS",
    "check_numerics",
    "set_numerics",
    "compare_numerics",
    "dummy_model",
    "build_model",
    "calibrate_model",
    "prepare_checkpoint",
    "write_checkpoint",
    "load_checkpoint",
    "RunOutput",
    "run_model",
    "compare_runs",
    "checkpoint_summary",
    "default_cache_dir",
    "save_results",
    "CACHE_VERSION",
    "checkpoint_cache_key",
    "model_fingerprint",
    "release_freed_memory",
]

logger = logging.getLogger(__name__)

# Bump when calibration changes what a cached checkpoint holds (the writer has its own
# WRITER_VERSION; the weights and config are fingerprinted).
CACHE_VERSION = 3

# the two arithmetics an emulation experts module computes (``mxlib.moe.emulation``'s ``numerics``)
NUMERICS = tuple(n.value for n in Numerics)


# ----------------------------------------------------------------------------- parameter checks


def _name(names: dict | None, param: str) -> str:
    return (names or {}).get(param, param)


def check_positive_int(value, param: str, names: dict | None = None) -> int:
    """``value`` must be an int >= 1 (not a bool); ValueError naming the parameter otherwise."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{_name(names, param)}: expected a positive integer, got {value!r}")
    return value


def check_device(device, param: str = "device", names: dict | None = None) -> torch.device:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N`` (a GPU must then be present): the resolved device."""
    try:
        dev = resolve_device(str(device))
    except (RuntimeError, ValueError):
        raise ValueError(f"{_name(names, param)}: expected 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{_name(names, param)}: expected 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if dev.type == "cuda" and (
        not torch.cuda.is_available() or (dev.index is not None and dev.index >= torch.cuda.device_count())
    ):
        raise ValueError(
            f"{_name(names, param)}: {device!r} asked for, but torch sees "
            f"{torch.cuda.device_count() if torch.cuda.is_available() else 'no'} CUDA device(s)"
        )
    return dev


def check_backend(backend, param: str = "backend", names: dict | None = None) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"{_name(names, param)}: expected one of {list(BACKENDS)}, got {backend!r}")
    return backend


def prepare_results_path(path, param: str = "results_path", names: dict | None = None) -> Path | None:
    """An output JSON path made ready before a long run: its folder is created, and a path that
    is a folder, sits in a folder that cannot be written, or cannot be opened for writing (tried, and an empty
    file it created removed again) is refused. Empty / None: no output."""
    if not path:
        return None
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{_name(names, param)}: {str(p)!r} is a folder; expected a file path")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"{_name(names, param)}: cannot create the folder of {str(p)!r} ({err.strerror})") from None
    if not os.access(p.parent, os.W_OK):
        raise ValueError(f"{_name(names, param)}: the folder of {str(p)!r} is not writable")
    try:  # what only an open finds out (a name too long, a file system that refuses it), before the run, not after
        existed = p.exists()
        with open(p, "a"):
            pass
    except OSError as err:
        raise ValueError(f"{_name(names, param)}: {str(p)!r} cannot be written ({err.strerror})") from None
    if not existed:
        p.unlink()
    return p


@dataclass(frozen=True)
class E2EParameters:
    """The end-to-end run's parameters, checked (``check_e2e_parameters``): notebook 01's
    ``parameters`` cell and ``mxlib.cli e2e``'s options, with ``scheme`` resolved to a
    ``MoEQuantScheme``, ``device`` to a ``torch.device`` and ``results_path`` to a ``Path`` (None:
    no results file). The steps that take it (``build_model``, ``write_checkpoint``,
    ``evaluation_token_ids``, ``load_checkpoint``) read their values from it."""

    scheme: MoEQuantScheme
    model_preset: str
    num_hidden_layers: int
    num_tokens: int
    seed: int
    calib_tokens: int
    device: torch.device
    experts_backend: str
    results_path: Path | None
    numerics: str = "vllm"
    repeats: int = 1


def check_e2e_parameters(
    scheme: str | MoEQuantScheme = "nvfp4",
    model_preset: str = "qwen3-30b-a3b",
    num_hidden_layers: int = 4,
    num_tokens: int = 32,
    seed: int = 0,
    calib_tokens: int = 512,
    device: str = "auto",
    experts_backend: str = "auto",
    results_path: str | os.PathLike | None = "",
    names: dict[str, str] | None = None,
    numerics: str = "vllm",
    repeats: int = 1,
) -> E2EParameters:
    """Check the end-to-end run's parameters (notebook 01's ``parameters`` cell, ``mxlib.cli e2e``)
    before anything is built: each must be valid, and the results path's folder is created.

    The scheme name enters here and is resolved once; the ``MoEQuantScheme`` travels below.
    ``names`` maps a parameter to the name the caller shows (the CLI passes ``--layers`` for
    ``num_hidden_layers``, ...). ``numerics``: ``"vllm"`` or ``"hardware"`` (``check_numerics``);
    ``repeats``: how many evaluation token sets (``evaluation_token_sets``), an int from 1 to 10.

    Returns:
        ``E2EParameters``: the checked values.

    Raises:
        ValueError: naming the parameter, what is expected and what was given.
    """
    try:
        s = get_moe_scheme(scheme)
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{_name(names, 'scheme')}: {err}") from None
    if model_preset not in (presets := [*MODEL_PRESETS, *GPT_OSS_PRESETS]):
        raise ValueError(f"{_name(names, 'model_preset')}: expected one of {presets}, got {model_preset!r}")
    if model_preset in GPT_OSS_PRESETS and gpt_oss_layout_for(s)[0] is None:  # the reason: no layout stores it
        raise ValueError(f"{_name(names, 'scheme')}: {s.name} is skipped for gpt-oss: {gpt_oss_layout_for(s)[1]}")
    check_parameters(
        model_preset,
        names,
        num_hidden_layers=num_hidden_layers,
        num_tokens=num_tokens,
        calib_tokens=calib_tokens,
        repeats=repeats,
        seed=seed,
    )
    return E2EParameters(
        scheme=s,
        model_preset=model_preset,
        num_hidden_layers=num_hidden_layers,
        num_tokens=num_tokens,
        seed=seed,
        calib_tokens=calib_tokens,
        device=check_device(device, "device", names),
        experts_backend=check_backend(experts_backend, "experts_backend", names),
        results_path=prepare_results_path(results_path, "results_path", names),
        numerics=check_numerics(numerics, "numerics", names),
        repeats=repeats,
    )


def check_numerics(numerics, param: str = "numerics", names: dict | None = None) -> str:
    """``"vllm"`` or ``"hardware"`` (``mxlib.formats.Numerics``): the name, checked; ValueError naming
    the parameter otherwise."""
    if isinstance(numerics, Numerics):
        return numerics.value
    if numerics not in NUMERICS:
        raise ValueError(f"{_name(names, param)}: expected one of {list(NUMERICS)}, got {numerics!r}")
    return numerics


def check_schemes(schemes="all", param: str = "schemes", names: dict | None = None) -> list[MoEQuantScheme]:
    """A list of MoE schemes where names enter (notebook 03's ``schemes``, ``mxlib.cli compare --schemes``).

    Args:
        schemes: ``"all"`` (every scheme of ``mxlib.moe.MOE_SCHEMES``, in its order), a
            comma-separated string of scheme names, or a list of names or ``MoEQuantScheme``.
        param: the parameter's name in messages (``names`` may map it to the caller's).

    Returns:
        The schemes as ``MoEQuantScheme`` objects, in the order given.

    Raises:
        ValueError: an unknown name, or no scheme at all; the message names the parameter and
            lists the schemes.
    """
    if isinstance(schemes, str):
        items = list(MOE_SCHEMES.values()) if schemes == "all" else schemes.split(",")
    else:
        items = list(schemes)
    out = []
    for item in items:
        try:
            out.append(get_moe_scheme(item))
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(
                f"{_name(names, param)}: {item!r} is not a scheme ({err}); expected 'all' or a "
                f"comma-separated list of {list(MOE_SCHEMES)}"
            ) from None
    if not out:
        raise ValueError(
            f"{_name(names, param)}: expected 'all' or at least one of {list(MOE_SCHEMES)}, got {schemes!r}"
        )
    return out


def resolve_device(device: str = "auto") -> torch.device:
    """``auto`` -> ``cuda`` when a GPU is present, else ``cpu``."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def random_token_ids(num_tokens: int, seed: int, vocab_size: int = 151936, batch: int = 1) -> torch.Tensor:
    """Seeded token ids ``[batch, num_tokens]`` (the dummy model has no tokenizer to speak of)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, num_tokens), generator=g)


def evaluation_token_ids(p: E2EParameters, vocab_size: int) -> torch.Tensor:
    """The evaluation sequence of an end-to-end run: ``p.num_tokens`` token ids ``[1, T]`` (int64)
    drawn with seed ``p.seed + 1`` (the weights take ``p.seed``, calibration ``p.seed + 1000``)."""
    return random_token_ids(p.num_tokens, p.seed + 1, vocab_size)


def evaluation_token_sets(p: E2EParameters, vocab_size: int) -> list[torch.Tensor]:
    """``p.repeats`` evaluation sequences, each ``[1, p.num_tokens]`` int64: set ``r`` drawn with seed
    ``p.seed + 1 + r``, so set 0 is ``evaluation_token_ids``. A metric over the sets gives its spread
    (``mxlib.studies.repeats``)."""
    return [random_token_ids(p.num_tokens, p.seed + 1 + r, vocab_size) for r in range(p.repeats)]


def set_numerics(model, numerics: str | Numerics) -> int:
    """Switch every MoE layer's emulation experts of a loaded model to ``numerics``.

    ``"vllm"``: vLLM's emulation arithmetic (operands ``bf16(element * block_scale * global_scale)``);
    ``"hardware"``: an FP4 tensor-core GEMM's (operands ``element * block_scale``, per-tensor scales on
    the fp32 output): ``mxlib.moe.emulation``. The two differ for NVFP4 only. Nothing is re-read or
    re-quantized: the numerics are read at each forward.

    Returns:
        The number of experts modules switched.

    Raises:
        ValueError: unknown ``numerics``; a layer whose experts are not emulation experts; hardware
            numerics on experts with encode global scales (compressed-tensors) or on a backend that
            cannot run them (the ``triton`` dequantize-then-GEMM path: use ``torch`` or ``fused``).
    """
    mode = get_numerics(check_numerics(numerics))
    modules = []
    for li, mlp in enumerate(moe_layers(model)):
        ex = getattr(mlp.experts, "experts", None)
        if ex is None or not hasattr(ex, "weight_scheme"):
            raise ValueError(f"model: layer {li}'s experts are not emulation experts ({type(mlp.experts).__name__})")
        if mode is Numerics.HARDWARE and getattr(ex, "global_scale_kind", "decode") == "encode":
            raise ValueError(
                f"numerics: 'hardware' needs decode global scales; layer {li}'s experts carry encode scales "
                f"(compressed-tensors): use 'vllm'"
            )
        modules.append(ex)
    for ex in modules:
        previous = ex.numerics
        ex.numerics = mode
        dev = next(iter(ex.buffers())).device
        backend = ex.resolved_backend(dev)
        try:
            ex.check_backend(backend, backend == "fused" and ex.supports_fused and ex.fp4_kernel_applies())
        except ValueError as err:
            for m in modules:
                m.numerics = previous
            raise ValueError(f"numerics: {err}") from None
    return len(modules)


@torch.no_grad()
def compare_numerics(model, token_sets: list[torch.Tensor], refs: list, known_runs: dict | None = None) -> dict:
    """A loaded quantized model run in both numerics on every token set (notebook 01, section 5).

    Each set runs with ``numerics="vllm"`` and ``"hardware"`` (``set_numerics``; the model's own
    numerics are restored afterwards). ``refs``: the bf16 model's ``RunOutput`` of each set.
    ``known_runs``: ``{numerics name: the model's own RunOutput of each set}`` for a numerics already run
    (used instead of running the sets again: the same model, weights and numerics give the same bits).

    Returns:
        ``{"sets": rows, "layers": rows}``. ``sets``, one row per token set: ``set``,
        ``vllm_vs_hw_sqnr_db`` (the logits of the two modes), ``top1_agreement`` (between them),
        ``max_abs_diff`` (logit units), ``vllm_vs_bf16_sqnr_db`` / ``hw_vs_bf16_sqnr_db`` and
        ``vllm_kl`` / ``hw_kl`` (each against the bf16 model). ``layers``: per decoder layer,
        ``vllm_vs_hw_sqnr_db`` of its output in the two runs (earlier layers' differences
        included), one value per set in ``per_set`` and their mean. SQNR in dB (+inf: equal).

    Raises:
        ValueError: what ``set_numerics`` raises (hardware numerics on the ``triton`` backend, ...);
            ``token_sets`` and ``refs`` of different lengths.
    """
    if len(token_sets) != len(refs):
        raise ValueError(f"refs: expected one per token set ({len(token_sets)}), got {len(refs)}")
    known_runs = {get_numerics(k).value: list(v) for k, v in (known_runs or {}).items()}
    if any(len(v) != len(token_sets) for v in known_runs.values()):
        raise ValueError(f"known_runs: expected one run per token set ({len(token_sets)}) for each numerics")
    first = next(ex for mlp in moe_layers(model) for ex in [getattr(mlp.experts, "experts", None)] if ex is not None)
    restore = first.numerics.value
    runs = dict(known_runs)
    try:
        for mode in NUMERICS:
            if mode not in runs:
                set_numerics(model, mode)
                runs[mode] = [run_model(model, ids) for ids in token_sets]
    finally:
        set_numerics(model, restore)
    sets, per_layer = [], []
    for i, ref in enumerate(refs):
        v, h = runs["vllm"][i], runs["hardware"][i]
        between = compare_runs(v, h)
        sets.append(
            dict(
                set=i,
                vllm_vs_hw_sqnr_db=between["logits"]["sqnr_db"],
                top1_agreement=between["logits"]["top1_agreement"],
                max_abs_diff=(v.logits.double() - h.logits.double()).abs().max().item(),
                vllm_vs_bf16_sqnr_db=compare_logits(v.logits, ref.logits)["sqnr_db"],
                hw_vs_bf16_sqnr_db=compare_logits(h.logits, ref.logits)["sqnr_db"],
                vllm_kl=compare_logits(v.logits, ref.logits)["kl_divergence"],
                hw_kl=compare_logits(h.logits, ref.logits)["kl_divergence"],
            )
        )
        per_layer.append([r["sqnr_db"] for r in between["layers"]])
    layers = [
        dict(layer=li, vllm_vs_hw_sqnr_db=sum(c) / len(c), per_set=list(c)) for li, c in enumerate(zip(*per_layer))
    ]
    return {"sets": sets, "layers": layers}


def release_freed_memory() -> None:
    """Collect garbage, then hand the C allocator's free pages back to the OS (glibc's
    ``malloc_trim(0)``; nothing more on other C libraries).

    glibc serves allocations below its mmap threshold (which rises to 32 MB after a larger block
    is freed, and which ``MALLOC_MMAP_THRESHOLD_`` sets, as the Makefile does, to 4 GB) from heaps
    that keep freed pages resident, so a phase's freed temporaries still count towards the
    resident memory of every later phase. Called between the e2e run's phases (after the dummy
    model's build, after the bf16 model is freed). Changes no value; costs milliseconds.
    """
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


_MALLOC_TRIM: list = []


def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none (macOS, musl, Windows)."""
    if not _MALLOC_TRIM:
        try:
            fn = ctypes.CDLL(None).malloc_trim
            fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
        except (OSError, AttributeError, TypeError):
            fn = None
        _MALLOC_TRIM.append(fn)
    return _MALLOC_TRIM[0]


def dummy_model(
    num_hidden_layers: int = 4,
    seed: int = 0,
    expert_spread: float = 0.0,
    device="cpu",
    model_preset: str = "qwen3-30b-a3b",
    **overrides,
):
    """The seeded bf16 dummy model of ``model_preset`` (``overrides`` win over its sizes): Qwen3-30B-A3B
    (``qwen3.dummy_qwen3_moe``, ``MODEL_PRESETS``) or gpt-oss-20b (``gpt_oss.dummy_gpt_oss``, ``GPT_OSS_PRESETS``)."""
    preset = model_preset if model_preset in (*MODEL_PRESETS, *GPT_OSS_PRESETS) else None
    check_parameters(preset, num_hidden_layers=num_hidden_layers, seed=seed, expert_spread=expert_spread)
    if model_preset in GPT_OSS_PRESETS:  # a dummy gpt-oss-20b (mxlib.models.gpt_oss), GPT_OSS_PRESETS sizes
        cfg = gpt_oss_20b_config(num_hidden_layers, **{**GPT_OSS_PRESETS[model_preset], **overrides})
    else:
        cfg = qwen3_30b_a3b_config(num_hidden_layers, **{**model_preset_overrides(model_preset), **overrides})
    build = dummy_gpt_oss if model_preset in GPT_OSS_PRESETS else dummy_qwen3_moe
    dev = resolve_device(str(device))
    folder = _dummy_cache_folder(cfg, seed, expert_spread) if dev.type == "cpu" and expert_spread == 0 else None
    model = _load_cached_dummy(folder, cfg) if folder is not None else None
    if model is None:
        model = build(cfg, seed=seed, expert_spread=expert_spread, device=dev)
        release_freed_memory()  # the warm-up pass's freed temporaries (~0.2 GB at full size)
        if folder is not None:
            _write_cached_dummy(model, folder)
    return model


# The plain (``expert_spread`` 0) dummy models the workbook builds at the real shape (3 B parameters: 35 s of random
# draws and a warm-up pass on 2 cores; notebooks 01, twice, and 03 build the same one) are kept in the checkpoint
# cache beside the checkpoints and read back in seconds; smaller ones, and those with a spread (each built once),
# are built each time.
DUMMY_CACHE_MIN_PARAMETERS = 1_000_000_000  # expert parameters: the 4-layer real shape has 2.4 B


def _dummy_cache_folder(cfg, seed: int, expert_spread: float) -> Path | None:
    """``<cache>/dummy-<model_type>-L<layers>-<hash>`` for a model of ``DUMMY_CACHE_MIN_PARAMETERS`` or more, else
    None. The hash covers the config, the seed, the spread, the torch and transformers versions and the source of
    the modules that build the dummy (a change to how it is built is a new folder)."""
    import transformers

    from ..models import gpt_oss, moe_models, qwen3

    experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    inter = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    if cfg.num_hidden_layers * experts * 3 * cfg.hidden_size * inter < DUMMY_CACHE_MIN_PARAMETERS:
        return None
    conf = {k: v for k, v in cfg.to_dict().items() if k not in ("transformers_version", "_name_or_path")}
    key = hashlib.sha256(json.dumps(conf, sort_keys=True, default=str).encode())
    key.update(f"{seed}|{float(expert_spread)!r}|{torch.__version__}|{transformers.__version__}".encode())
    for module in (moe_models, qwen3, gpt_oss):
        key.update(Path(module.__file__).read_bytes())
    return default_cache_dir() / f"dummy-{cfg.model_type}-L{cfg.num_hidden_layers}-{key.hexdigest()[:20]}"


def _load_cached_dummy(folder: Path, cfg):
    """The model kept in ``folder`` (parameters and persistent buffers copied into an empty model of ``cfg``), or
    None when the folder is absent or incomplete."""
    from safetensors import safe_open

    from ..models.moe_models import empty_moe_model

    if not (folder / "complete").is_file():
        return None
    model = empty_moe_model(cfg)
    state = model.state_dict()
    with safe_open(str(folder / "model.safetensors"), "pt") as f, torch.no_grad():
        if set(f.keys()) != {n for n in state if n not in _tied_names(model)}:
            return None
        for name in f.keys():
            state[name].copy_(f.get_tensor(name))
    return model


def _tied_names(model) -> set[str]:
    from ..models.moe_models import tied_parameter_names

    return tied_parameter_names(model)


def _write_cached_dummy(model, folder: Path) -> None:
    """Keep ``model``'s state in ``folder`` (written beside it, then renamed into place; a marker file last)."""
    from safetensors.torch import save_file

    tmp = folder.with_name(f".tmp-{folder.name}-{os.getpid()}")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        tied = _tied_names(model)
        state = {n: t.detach().contiguous() for n, t in model.state_dict().items() if n not in tied}
        save_file(state, str(tmp / "model.safetensors"))
        (tmp / "complete").write_text("ok\n")
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    except OSError:  # a full disk or a race with another writer: the model is built, the cache is only a saving
        shutil.rmtree(tmp, ignore_errors=True)


def build_model(p: E2EParameters):
    """Step 1 of the end-to-end run: ``dummy_model`` with ``p``'s layers, seed, device and model preset."""
    return dummy_model(p.num_hidden_layers, seed=p.seed, device=p.device, model_preset=p.model_preset)


def default_cache_dir() -> Path:
    """The checkpoint cache: ``$MXLIB_CACHE``, else ``$XDG_CACHE_HOME/mxlib/checkpoints``, else
    ``~/.cache/mxlib/checkpoints``. Read at each call (``make workbook`` sets ``MXLIB_CACHE`` to the
    checkout's ``build/checkpoints``); the same folder whatever the working directory."""
    if os.environ.get("MXLIB_CACHE"):
        return Path(os.environ["MXLIB_CACHE"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "mxlib" / "checkpoints"
    return Path.home() / ".cache" / "mxlib" / "checkpoints"


def _cache_dir(cache_dir) -> Path:
    return Path(cache_dir) if cache_dir else default_cache_dir()


def model_fingerprint(model) -> str:
    """SHA-1 of a model's config and of every tensor of its state dict (names, dtypes, shapes, and the SHA-1 of
    each tensor's bytes, read in 64 MB pieces; device tensors copied piece by piece). The tensors are hashed on
    one thread per core (hashlib releases the GIL): about 1.9 GB/s a thread on the 2-core CPU."""
    from concurrent.futures import ThreadPoolExecutor

    h = hashlib.sha1()
    cfg = {k: v for k, v in model.config.to_dict().items() if k not in ("transformers_version", "_name_or_path")}
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    piece = 64 * 1024**2

    def digest(t: torch.Tensor) -> bytes:
        d = hashlib.sha1()
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
        for start in range(0, flat.numel(), piece):
            d.update(flat[start : start + piece].cpu().numpy())
        return d.digest()

    items = list(model.state_dict().items())
    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1))) as pool:
        digests = list(pool.map(digest, (t for _, t in items)))
    for (name, t), d in zip(items, digests):
        h.update(f"{name}|{t.dtype}|{list(t.shape)}".encode())
        h.update(d)
    return h.hexdigest()


def _calibration_fingerprint(cal: Calibration) -> str:
    h = hashlib.sha1(str(cal.num_tokens).encode())
    for lc in cal.layers:
        for t in (lc.a1_amax, lc.a2_amax, lc.tokens):
            h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def checkpoint_cache_key(
    scheme: MoEQuantScheme, model, seed: int = 0, calib_tokens: int = 512, calibration: Calibration | None = None
) -> dict:
    """Everything that determines a written checkpoint: the scheme, the writer's format version,
    the model (config and weights, ``model_fingerprint``: a per-expert weight spread is in the
    weights) and, for schemes with static activation scales, the calibration (the ``calibration``
    given, else how one is made: ``calib_tokens`` and ``seed``). The scheme's name is the key's
    text (the cache folder's name)."""
    cal = None
    if scheme.static_activation_scale:
        cal = (
            {"fingerprint": _calibration_fingerprint(calibration)}
            if calibration is not None
            else {"calib_tokens": calib_tokens, "seed": seed}
        )
    return {
        "scheme": scheme.name,
        "writer_version": WRITER_VERSION,
        "cache_version": CACHE_VERSION,
        "model": model_fingerprint(model),
        "calibration": cal,
    }


def prepare_checkpoint(
    scheme: str | MoEQuantScheme,
    model,
    seed: int = 0,
    calib_tokens: int = 512,
    cache_dir: str | os.PathLike | None = None,
    calibration: Calibration | None = None,
    progress: bool = False,
) -> Path:
    """Calibrate ``model`` on seeded token ids, quantize its experts and write the checkpoint.

    The folder is ``<cache_dir>/<scheme>-L<layers>-<key hash>`` (``cache_dir`` defaults to
    ``default_cache_dir()``), the hash covering ``checkpoint_cache_key``: scheme, writer version,
    the model's config and weights, and the calibration (``calibration`` if given, else
    ``calib_tokens`` and ``seed``). A complete mxlib checkpoint there is reused. Fingerprinting
    reads every weight once (seconds at full size). ``scheme``: a ``MoEQuantScheme`` (or a name,
    resolved here once). ``progress``: tqdm bars on stderr for calibrating and writing.

    Raises:
        ValueError: ``calib_tokens`` or ``seed`` outside its bounds (``check_parameters``), or an unknown scheme.
    """
    s = get_moe_scheme(scheme)
    check_parameters(calib_tokens=calib_tokens, seed=seed)
    layers = len(model.model.layers)
    key = checkpoint_cache_key(s, model, seed, calib_tokens, calibration)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    path = _cache_dir(cache_dir) / f"{s.name}-L{layers}-{digest}"
    if is_mxlib_checkpoint(path):
        logger.info("reusing the cached checkpoint %s", path)
        return path
    if calibration is None and s.static_activation_scale:
        calibration = calibrate_model(model, calib_tokens, seed, progress=progress)
        release_freed_memory()  # the calibration pass's freed temporaries (~0.14 GB at full size)
    return write_quantized_checkpoint(model, s, path, calibration, progress=progress)


def write_checkpoint(p: E2EParameters, model, progress: bool = False) -> Path:
    """Step 2 of the end-to-end run: ``prepare_checkpoint`` of ``model`` in ``p.scheme``, calibrated
    on ``p.calib_tokens`` tokens drawn from ``p.seed``, in ``default_cache_dir()``. Returns the folder."""
    return prepare_checkpoint(p.scheme, model, seed=p.seed, calib_tokens=p.calib_tokens, progress=progress)


def load_checkpoint(p: E2EParameters, path: str | os.PathLike, progress: bool = False):
    """Step 3 of the end-to-end run: the checkpoint at ``path`` loaded with emulation experts
    (``mxlib.checkpoints.load_quantized_qwen3_moe``) with ``p``'s layers, device and experts
    backend, each layer's experts keeping their dequantized weights where they run on the ``torch``
    backend (``keep_dequantized``: the notebook runs the same weights many times). Returns ``(model, info)``;
    raises what the loader raises (``CheckpointError``)."""
    model, info = load_quantized_qwen3_moe(
        path, num_hidden_layers=p.num_hidden_layers, device=p.device, backend=p.experts_backend, progress=progress
    )
    keep_dequantized(model)
    return model, info


def emulation_experts_of(model) -> list:
    """The emulation experts (``QuantizedExperts``) of every MoE layer of ``model`` that has them."""
    found = []
    for mlp in moe_layers(model):
        ex = getattr(mlp.experts, "experts", None)
        if isinstance(ex, QuantizedExperts):
            found.append(ex)
    return found


def keep_dequantized(model_or_experts, keep: bool = True) -> int:
    """Set ``keep_dequantized`` (``mxlib.moe.emulation.QuantizedExperts``) on every emulation experts module
    of a model (or of a list of experts) that runs on the ``torch`` backend: each expert's weights are then
    dequantized once and kept while the weights, the numerics and the dtype stay the same, with outputs bit
    for bit those of dequantizing at each forward. ``keep=False`` turns it off and lets the weights go.
    Returns the number of modules set."""
    experts = model_or_experts if isinstance(model_or_experts, list) else emulation_experts_of(model_or_experts)
    n = 0
    for ex in experts:
        if ex.resolved_backend(ex._device()) == "torch" or not keep:
            ex.keep_dequantized = keep
            n += 1
    return n


def calibrate_model(
    model, calib_tokens: int = 512, seed: int = 0, keep_activations: bool = False, progress: bool = False
) -> Calibration:
    """Calibration over ``calib_tokens`` seeded token ids in sequences of 256 (seed ``seed + 1000``);
    ``progress``: a tqdm bar on stderr (``mxlib.models.calibration.calibrate``)."""
    check_parameters(calib_tokens=calib_tokens, seed=seed)
    seq = min(256, calib_tokens)
    ids = random_token_ids(seq, seed + 1000, model.config.vocab_size, batch=max(1, calib_tokens // seq))
    return calibrate(model, ids, keep_activations=keep_activations, progress=progress)


@dataclass
class RunOutput:
    """Decoder-layer outputs ``[T, H]`` (fp32, CPU), logits ``[T, vocab]`` and the forward time."""

    layer_outputs: list[torch.Tensor] = field(default_factory=list)
    logits: torch.Tensor | None = None
    seconds: float = 0.0


@torch.no_grad()
def run_model(model, token_ids: torch.Tensor) -> RunOutput:
    """One forward pass on ``token_ids [1, T]``, recording every decoder layer's output."""
    out = RunOutput()
    hooks = [
        layer.register_forward_hook(
            lambda mod, inp, o: out.layer_outputs.append((o[0] if isinstance(o, tuple) else o)[0].float().cpu())
        )
        for layer in model.model.layers
    ]
    dev = next(model.parameters()).device
    try:
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = model(input_ids=token_ids.to(dev), use_cache=False).logits
        if dev.type == "cuda":
            torch.cuda.synchronize()
        out.seconds = time.perf_counter() - t0
    finally:
        for h in hooks:
            h.remove()
    out.logits = logits[0].float().cpu()
    return out


def compare_runs(test: RunOutput, ref: RunOutput) -> dict:
    """Per-layer ``rel_error``/``sqnr_db`` and logits metrics of ``test`` against ``ref``."""
    layers = [
        dict(layer=i, **compare_tensors(a, b)) for i, (a, b) in enumerate(zip(test.layer_outputs, ref.layer_outputs))
    ]
    return {"layers": layers, "logits": compare_logits(test.logits, ref.logits)}


def checkpoint_summary(path: str | os.PathLike, layer: int = 0, expert: int = 0) -> list[dict]:
    """Name, dtype and shape of one expert's tensors as stored (read from the safetensors headers); for a
    layout storing whole layers (gpt-oss's ``gate_up_proj_blocks [E, ...]``) the layer's expert tensors."""
    headers = SafetensorsHeaders(Path(path))  # the loader's header reader: every shard read once, as one checkpoint
    headers.close()
    prefix, layer_prefix = f"model.layers.{layer}.mlp.experts.{expert}.", f"model.layers.{layer}.mlp.experts."
    names = [n for n in headers.where if n.startswith(prefix)]
    names = names or [n for n in headers.where if n.startswith(layer_prefix) and "." not in n[len(layer_prefix) :]]
    return [{"tensor": n, "dtype": headers.dtype[n], "shape": str(list(headers.shape[n]))} for n in sorted(names)]


def save_results(results: dict, path: str | os.PathLike) -> None:
    """Write a small JSON record of a notebook's results (read back by tests and README).
    ``prepare_results_path`` checks the path before a long run."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(results, indent=2, default=float))
