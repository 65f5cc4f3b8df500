"""Files of a checkpoint or config folder read as untrusted input, with the standard library only (no
torch import: the command line checks its options with these before anything heavy is imported).

* ``open_regular(path, error)``: opened only when ``stat`` says it is a regular file (a FIFO, a device, a
  socket or a folder is refused before ``open``; the open itself is non-blocking and checked again with
  ``fstat``, so a FIFO swapped in between cannot block). Symlinks are followed (the Hugging Face cache is
  made of them).
* ``read_json(path, what, limit, error)``: at most ``limit`` bytes (``MAX_JSON_BYTES``, 64 MiB) read; a
  larger file, bytes that are not UTF-8, text that is not JSON or not an object are refused.
* ``check_model_fields(cfg, source, error)``: the sizes a Qwen3-MoE config must hold, the loader's rules.

Every refusal is ``error`` (the caller's exception class: ``CheckpointError`` in the loader, ``ValueError``
on the command line) with a message naming the file and the field.
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
from pathlib import Path

__all__ = ["MAX_JSON_BYTES", "MODEL_INT_FIELDS", "file_kind", "open_regular", "read_json", "check_model_fields"]

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


def open_regular(path: str | os.PathLike, error=ValueError):
    """``path`` opened for reading in binary, only if it is a regular file (module docstring); ``opener``
    replaces ``open_regular`` (tests record reads through it).

    Raises:
        error: ``path`` absent, unreadable (permissions), or not a regular file (naming what it is).
    """
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise error(f"{path}: not found") from None
    except OSError as err:
        raise error(f"{path}: cannot be read ({err.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{path}: expected a regular file, found {file_kind(st.st_mode)}")
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
    path = Path(path)
    with (opener or (lambda p: open_regular(p, error)))(path) as f:
        try:
            data = f.read(limit + 1)
        except OSError as err:
            raise error(f"{path}: cannot be read ({err.strerror})") from None
    if len(data) > limit:
        raise error(f"{path}: larger than {limit} bytes; expected a JSON config file")
    try:
        value = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise error(f"{path}: cannot be read as JSON (not UTF-8: {err.reason} at byte {err.start})") from None
    except (ValueError, RecursionError) as err:
        raise error(f"{path}: cannot be read as JSON ({str(err)[:200]})") from None
    if not isinstance(value, dict):
        raise error(f"{path}: expected a JSON object{' (' + what + ')' if what else ''}, found {type(value).__name__}")
    return value


# config.json fields a Qwen3-MoE needs, all positive ints (transformers 5 writes num_experts as num_local_experts)
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


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def check_model_fields(cfg: dict, source, error=ValueError) -> dict[str, int]:
    """The model fields positive integers, ``num_experts_per_tok <= num_experts``, ``num_attention_heads``
    a multiple of ``num_key_value_heads``, ``head_dim`` (when given) a positive integer.

    Returns:
        ``{field: value}`` (``num_experts`` under that name whichever the config uses).

    Raises:
        error: naming ``source`` (a file, or what changed it), the field and the value found.
    """
    out = {}
    for keys in MODEL_INT_FIELDS:
        keys = (keys,) if isinstance(keys, str) else keys
        key = next((k for k in keys if k in cfg), keys[0])
        v = cfg.get(key)
        if not _positive_int(v):
            raise error(f"{source}: {key}: expected a positive integer, found {v!r}")
        out[keys[0]] = v
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
