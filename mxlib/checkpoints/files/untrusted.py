"""Files of a checkpoint or config folder read as untrusted input, with the standard library only (no
torch import: the command line checks its options with these before anything heavy is imported).

* ``check_regular(path, error, what)``: ``stat`` says a regular file (links followed), else a refusal naming
  the file and what it is;
* ``open_regular(path, error)``: opened only when ``stat`` says it is a regular file (a FIFO, a device, a
  socket or a folder is refused before ``open``; the open itself is non-blocking and checked again with
  ``fstat``, so a FIFO swapped in between cannot block). Symlinks are followed (the Hugging Face cache is
  made of them).
* ``read_json(path, what, limit, error)``: at most ``limit`` bytes (``MAX_JSON_BYTES``, 64 MiB) read; a
  larger file, bytes that are not UTF-8, text that is not JSON or not an object are refused.
* ``check_model_fields(cfg, source, error)``: the sizes a Qwen3-MoE config must hold, the loader's rules;
* ``dummy_config(config_dir, ...)``: the config a dummy build would build, checked with those rules, a
  layer cap (``MAX_DUMMY_LAYERS``) and this machine's memory (``model_bytes``), before anything is built.

Every refusal is ``error`` (the caller's exception class: ``CheckpointError`` in the loader, ``ValueError``
on the command line) with a message naming the file and the field.
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
from pathlib import Path

from ...models.families import QWEN3_MOE, MoEFamily, check_supported_model, family_of
from ...models.presets import MODEL_PRESETS

__all__ = [
    "MAX_JSON_BYTES",
    "MODEL_INT_FIELDS",
    "MAX_DUMMY_LAYERS",
    "file_kind",
    "check_regular",
    "open_regular",
    "read_json",
    "read_json_and_text",
    "check_model_fields",
    "model_bytes",
    "dummy_config",
]

MAX_JSON_BYTES = 64 * 2**20

_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def file_kind(mode: int) -> str:
    """What a ``stat`` mode is, in words (``a FIFO``)."""
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def check_regular(path: str | os.PathLike, error=ValueError, what: str | None = None) -> os.stat_result:
    """``os.stat(path)`` (links followed) of a regular file; ``what`` (``"the safetensors file"``) names the file
    in the message after its path.

    Raises:
        error: ``path`` absent, unreadable (permissions), or not a regular file (naming what it is).
    """
    named, kind = (f"{path}: {what} ", f"{path}: {what}: ") if what else (f"{path}: ", f"{path}: ")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise error(f"{named}not found") from None
    except OSError as err:
        raise error(f"{named}cannot be read ({err.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{kind}expected a regular file, found {file_kind(st.st_mode)}")
    return st


def open_regular(path: str | os.PathLike, error=ValueError):
    """``path`` opened for reading in binary, only if it is a regular file (module docstring); ``opener``
    replaces ``open_regular`` (tests record reads through it).

    Raises:
        error: ``path`` absent, unreadable (permissions), or not a regular file (naming what it is).
    """
    path = Path(path)
    check_regular(path, error)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise error(f"{path}: cannot be read ({err.strerror})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise error(f"{path}: expected a regular file, found {file_kind(st.st_mode)}")
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return os.fdopen(fd, "rb")


def read_json(
    path: str | os.PathLike, what: str | None = None, limit: int = MAX_JSON_BYTES, error=ValueError, opener=None
) -> dict:
    """A JSON object from the regular file ``path``, at most ``limit`` bytes.

    Raises:
        error: naming the file: absent, not a regular file, larger than ``limit``, not UTF-8,
            not JSON, or not an object.
    """
    return read_json_and_text(path, what, limit, error, opener)[0]


def read_json_and_text(
    path: str | os.PathLike, what: str | None = None, limit: int = MAX_JSON_BYTES, error=ValueError, opener=None
) -> tuple[dict, str]:
    """``read_json`` and the file's text it parsed, from one open (a writer copying a config file as it is
    stores the text; the dict says it is a bounded JSON object).

    Raises:
        error: as ``read_json``.
    """
    path = Path(path)
    with (opener or (lambda p: open_regular(p, error)))(path) as f:
        try:  # the file's size, not limit + 1 (a read of n bytes allocates n at once)
            size = os.fstat(f.fileno()).st_size
            data = f.read(min(size, limit) + 1)
            if len(data) == min(size, limit) + 1 and len(data) <= limit:  # it grew while being read
                data += f.read(limit + 1 - len(data))
        except OSError as err:
            raise error(f"{path}: cannot be read ({err.strerror})") from None
    if len(data) > limit:
        raise error(f"{path}: larger than {limit} bytes; expected a JSON config file")
    try:
        text = data.decode("utf-8")
        value = json.loads(text)
    except UnicodeDecodeError as err:
        raise error(f"{path}: cannot be read as JSON (not UTF-8: {err.reason} at byte {err.start})") from None
    except (ValueError, RecursionError) as err:
        raise error(f"{path}: cannot be read as JSON ({str(err)[:200]})") from None
    if not isinstance(value, dict):
        raise error(f"{path}: expected a JSON object{' (' + what + ')' if what else ''}, found {type(value).__name__}")
    return value, text


# config.json fields a Qwen3-MoE needs, all positive ints (transformers 5 writes num_experts as num_local_experts);
# another family's are family_int_fields(family)
MODEL_INT_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    ("num_experts", "num_local_experts"),
    "num_experts_per_tok",
    "moe_intermediate_size",
    "vocab_size",
    "num_attention_heads",
    "num_key_value_heads",
)


def family_int_fields(family: MoEFamily) -> tuple:
    """``MODEL_INT_FIELDS`` of a family: its expert count and expert intermediate size under its own config
    names (``MoEFamily.num_experts_fields`` / ``intermediate_size_fields``), the others as Qwen3-MoE's."""
    if family is QWEN3_MOE:
        return MODEL_INT_FIELDS
    return (
        "hidden_size",
        "num_hidden_layers",
        family.num_experts_fields,
        "num_experts_per_tok",
        family.intermediate_size_fields,
        "vocab_size",
        "num_attention_heads",
        "num_key_value_heads",
    )


def _config_family(cfg) -> MoEFamily:
    """The family a checked config dict names (Qwen3-MoE when it names none)."""
    if cfg.get("architectures") or cfg.get("model_type") is not None:
        return family_of(cfg)
    return QWEN3_MOE


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def check_model_fields(cfg: dict, source, error=ValueError) -> dict[str, int]:
    """The model fields positive integers, ``num_experts_per_tok <= num_experts``, ``num_attention_heads``
    a multiple of ``num_key_value_heads``, ``head_dim`` (when given) a positive integer.

    Returns:
        ``{field: value}``: ``num_experts`` and ``moe_intermediate_size`` under those names whichever
        the config uses (Mixtral's ``num_local_experts`` / ``intermediate_size``, DeepSeek-V3's
        ``n_routed_experts``: ``family_int_fields``); the error names the config's own field.

    Raises:
        error: naming ``source`` (a file, or what changed it), the field and the value found; first of
            all a config of a family mxlib does not quantize (``mxlib.models.families``).
    """
    check_supported_model(cfg, "config", name=str(source), error=error)
    family = _config_family(cfg)
    out = {}
    for keys, canonical in zip(family_int_fields(family), MODEL_INT_FIELDS):
        keys = (keys,) if isinstance(keys, str) else keys
        canonical = canonical if isinstance(canonical, str) else canonical[0]
        key = next((k for k in keys if k in cfg), keys[0])
        v = cfg.get(key)
        if not _positive_int(v):
            raise error(f"{source}: {key}: expected a positive integer, found {v!r}")
        out[canonical] = v
    if out["num_experts_per_tok"] > out["num_experts"]:
        raise error(
            f"{source}: num_experts_per_tok: expected at most num_experts={out['num_experts']}, found "
            f"{out['num_experts_per_tok']}"
        )
    if out["num_attention_heads"] % out["num_key_value_heads"]:
        raise error(
            f"{source}: num_attention_heads: expected a multiple of num_key_value_heads={out['num_key_value_heads']}, "
            f"found {out['num_attention_heads']}"
        )
    head_dim = cfg.get("head_dim")
    if head_dim is not None and not _positive_int(head_dim):
        raise error(f"{source}: head_dim: expected a positive integer, found {head_dim!r}")
    return out


# more layers than any released MoE has (DeepSeek-V3 61, Qwen3-235B-A22B 94): a dummy build's time grows
# with the layers, so a config asking for more is refused before anything is built
MAX_DUMMY_LAYERS = 512


def model_bytes(cfg: dict) -> int:
    """bf16 bytes of the Qwen3-MoE a checked config dict describes (embedding, head unless tied, every
    layer's attention, router, experts and norms)."""
    family = _config_family(cfg)
    h, e, i = cfg["hidden_size"], family.num_experts(cfg), family.intermediate_size(cfg)
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    per_layer = 2 * h * q + 2 * h * kv + e * h + 3 * e * h * i + 2 * h + 2 * hd
    head = 0 if cfg.get("tie_word_embeddings") else cfg["vocab_size"] * h
    return 2 * (cfg["vocab_size"] * h + head + h + cfg["num_hidden_layers"] * per_layer)


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def dummy_config(
    config_dir: str | os.PathLike,
    num_hidden_layers: int | None = None,
    model_preset: str | None = None,
    overrides: dict | None = None,
    error=ValueError,
    source: dict | None = None,
) -> tuple[Path, dict, dict, dict]:
    """The config ``dummy_checkpoint_from_config`` builds, checked with the loader's rules before anything
    is built: ``(config.json path, its dict as read, the changes applied, the resulting dict)``.

    A preset's ``num_experts`` / ``moe_intermediate_size`` are set under the family's own field names
    (Mixtral's ``num_local_experts`` / ``intermediate_size``, ``mxlib.models.families``).

    The rules: the model fields positive integers, ``num_experts_per_tok <= num_experts``, heads a
    multiple of the key-value heads (``bounds.check_model_fields``); ``num_hidden_layers`` at most
    ``MAX_DUMMY_LAYERS``; the model's bf16 bytes (``model_bytes``) at most this machine's memory.

    ``source``: ``config.json``'s dict when the caller has read it already (read here when None; not changed).

    Raises:
        error: ``config.json`` missing, not a regular file or not a JSON object; a field breaking
            a rule (naming ``config.json`` or ``overrides`` and the field).
        ValueError: ``num_hidden_layers`` not in ``1..config's``; an unknown ``model_preset``.
    """
    cfg_path = Path(config_dir) / "config.json"
    if source is None:
        source = read_json(cfg_path, "a transformers model config", error=error)
    cfg_dict = dict(source)
    total = cfg_dict.get("num_hidden_layers")
    if num_hidden_layers is not None:
        if not (
            isinstance(num_hidden_layers, int)
            and not isinstance(num_hidden_layers, bool)
            and 1 <= num_hidden_layers <= (total if isinstance(total, int) else num_hidden_layers)
        ):
            raise ValueError(
                f"num_hidden_layers: expected 1 to the config's num_hidden_layers={total}, got {num_hidden_layers!r}"
            )
        cfg_dict["num_hidden_layers"] = num_hidden_layers
    if model_preset is not None and model_preset not in MODEL_PRESETS:
        raise ValueError(f"model_preset: expected one of {list(MODEL_PRESETS)}, got {model_preset!r}")
    changes = dict(MODEL_PRESETS[model_preset]) if model_preset is not None else {}
    try:
        family = _config_family(cfg_dict)
    except (TypeError, ValueError):  # another family, or malformed names: check_model_fields below says which
        family = QWEN3_MOE
    if family is not QWEN3_MOE:  # the preset's Qwen3-MoE field names as the family's own
        renames = {
            "num_experts": family.num_experts_fields[0],
            "moe_intermediate_size": family.intermediate_size_fields[0],
        }
        skips = set(family.preset_skips) | ({"intermediate_size"} & set(renames.values()))  # Mixtral's is the experts'
        changes = {renames.get(k, k): v for k, v in changes.items() if k not in skips}
    changes.update(overrides or {})
    cfg_dict.update(changes)
    where = f"{cfg_path}" + (" with the preset's and overrides' sizes" if changes else "")
    fields = check_model_fields(cfg_dict, where, error)
    if fields["num_hidden_layers"] > MAX_DUMMY_LAYERS:
        raise error(
            f"{where}: num_hidden_layers: expected at most {MAX_DUMMY_LAYERS} for a dummy build, found "
            f"{fields['num_hidden_layers']}; cut it with num_hidden_layers= (--layers)"
        )
    need, have = model_bytes(cfg_dict), _memory_bytes()
    if have is not None and need > have:
        raise error(
            f"{where}: the model these sizes describe takes {need / 1e9:.3g} GB of bf16 weights, more than this "
            f"machine's {have / 1e9:.3g} GB of memory (hidden_size={fields['hidden_size']}, num_experts="
            f"{fields['num_experts']}, moe_intermediate_size={fields['moe_intermediate_size']}, vocab_size="
            f"{fields['vocab_size']}, num_hidden_layers={fields['num_hidden_layers']})"
        )
    return cfg_path, source, changes, cfg_dict
