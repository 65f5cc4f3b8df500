"""Safetensors shards, the index, the atomic folder write and tensor reading: shared by every layout.

Writing (``atomic_folder`` + ``ShardWriter``):

* The checkpoint is written into a temporary folder ``.<name>.tmp-<hex>`` beside the destination,
  holding a marker file (``WRITE_MARKER``: the writer's PID, its start time and host), and renamed
  into place only when complete; on any error it is removed. A write killed outright (SIGKILL,
  power loss) leaves its temporary folder; the next write to the same destination removes every
  such folder whose marker names a process that is no longer running. A folder without the
  marker, or one of a live process, is never touched.
* The destination may be absent, an empty folder, or an earlier mxlib checkpoint (a folder with
  ``CHECKPOINT_MARKER`` and only the files it lists), which is replaced atomically (Linux
  ``renameat2(RENAME_EXCHANGE)``; elsewhere two renames). Anything else (a file, a user's
  folder, a checkpoint with files added) is refused with ``FileExistsError`` unless the caller
  passes ``overwrite=True``. Before replacing, every entry of the old folder is checked to be
  removable (renamed and renamed back), so a read-only old checkpoint fails the write with a
  ``PermissionError`` naming it, and stays as it was, with nothing left beside it.
* ``ShardWriter`` streams tensors into shards of at most ``shard_bytes``: a shard is written
  (``safetensors.torch.save_file``, which reads the tensors in place) as soon as it is full and
  its tensors are dropped, so a writer holds at most one shard's tensors (copied into one
  buffer per shard, which keeps the heap from fragmenting).

Reading (``TensorReader``): the index (or a single ``model.safetensors``) is validated
(``read_weight_map``), every shard name must be a plain file name in the folder (no ``..``, no
absolute path, no separator), and every error (unreadable JSON, a missing or truncated shard, a
missing tensor, a wrong dtype or shape, an invalid value) is a ``CheckpointError`` naming the
file and the tensor. A shard is opened at most one at a time (the previous one is closed), so
memory-mapped pages of the whole checkpoint are never all resident at once.

Reading headers only (``SafetensorsHeaders``, for the inspector): the same validated index, then
each shard's header (an 8-byte little-endian length, then a JSON object ``{name: {dtype, shape,
data_offsets}}``, then the data) parsed here; ``read_scalars`` reads the data of named
one-element tensors only. ``HeaderTensorReader`` is a ``TensorReader`` over those headers: its
tensors are ``meta`` tensors of the header's dtype and shape, so a layout's ``read_experts`` runs
the loader's dtype and shape checks, with the loader's messages, and reads no data.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import json
import math
import os
import re
import shutil
import socket
import time
import uuid
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .layout import CheckpointError

__all__ = [
    "SHARD_BYTES",
    "WRITER_VERSION",
    "CHECKPOINT_MARKER",
    "WRITE_MARKER",
    "ShardWriter",
    "write_shards",
    "atomic_folder",
    "checkpoint_size_bytes",
    "TensorReader",
    "INDEX_NAME",
    "read_json",
    "is_mxlib_checkpoint",
    "read_weight_map",
    "SafetensorsHeaders",
    "HeaderTensorReader",
    "SAFETENSORS_DTYPES",
]

# 256 MiB: the writer holds at most one shard's tensors in memory (peak
# resident memory while quantizing stays within 1.25x the bf16 model's bytes).
SHARD_BYTES = 256 * 1024**2
INDEX_NAME = "model.safetensors.index.json"
# Bump when what the writer stores changes (part of the checkpoint cache key).
WRITER_VERSION = 3
CHECKPOINT_MARKER = "mxlib_checkpoint.json"
WRITE_MARKER = ".mxlib-write.json"
_SHARD_RE = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")


# ----------------------------------------------------------------------------- writing


def _shard_name(i: int, n: int) -> str:
    return f"model-{i:05d}-of-{n:05d}.safetensors"


class ShardWriter:
    """Stream named tensors into ``model-0000i-of-0000n.safetensors`` shards of at most
    ``shard_bytes`` (a larger tensor gets a shard of its own) and write the index at ``close()``.

    ``add(name, tensor)`` keeps a reference to ``tensor`` (CPU, contiguous) until its shard is
    written; shards are written with provisional names and renamed once their count is known.
    """

    def __init__(self, folder: Path, shard_bytes: int = SHARD_BYTES):
        if not isinstance(shard_bytes, int) or shard_bytes < 1:
            raise ValueError(f"shard_bytes: expected a positive int, got {shard_bytes!r}")
        self.folder = Path(folder)
        self.shard_bytes = shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._size = 0
        self._files: list[tuple[str, list[str]]] = []  # provisional file name, tensor names
        self._buffer: torch.Tensor | None = None  # the current shard's copies (add(copy=True))
        self._offset = 0
        self.total = 0

    def add(self, name: str, tensor: torch.Tensor, copy: bool = False) -> None:
        """Queue ``tensor`` for the current shard (writing the shard first if it would overflow).

        ``copy=True`` copies it into the shard's one buffer (a single allocation of ``shard_bytes``,
        touched only as far as it is filled and freed when the shard is written), so that many small
        tensors made between temporaries (one expert's quantized weights) do not fragment the heap:
        without it, resident memory grew by ~4x the pending bytes. Without ``copy`` a reference is kept
        (tensors that live on anyway, such as a model's parameters).
        """
        if name in self._pending or any(name in names for _, names in self._files):
            raise ValueError(f"tensor {name!r} written twice")
        t = tensor.detach()
        t = (t if t.device.type == "cpu" else t.cpu()).contiguous()
        nbytes = t.numel() * t.element_size()
        if self._pending and (
            self._size + nbytes > self.shard_bytes or (copy and self._offset + nbytes > self.shard_bytes)
        ):
            self.flush()
        if copy and nbytes <= self.shard_bytes:
            if self._buffer is None:
                self._buffer = torch.empty(self.shard_bytes, dtype=torch.uint8)
            view = self._buffer[self._offset : self._offset + nbytes]
            view.copy_(t.reshape(-1).view(torch.uint8))
            t = view.view(t.dtype).reshape(t.shape)
            self._offset += -(-nbytes // 64) * 64  # 64-byte aligned, so that every dtype view is valid
        self._pending[name] = t
        self._size += nbytes
        self.total += nbytes

    def flush(self) -> None:
        """Write the pending tensors as one shard and drop them."""
        if not self._pending:
            return
        fname = f"model-{len(self._files) + 1:05d}.safetensors"  # provisional: the count is not known yet
        save_file(self._pending, str(self.folder / fname), metadata={"format": "pt"})
        self._files.append((fname, list(self._pending)))
        self._pending = {}
        self._size = 0
        self._buffer, self._offset = None, 0

    def close(self) -> dict[str, str]:
        """Write the last shard, give the shards their final names, write the index; the weight map."""
        self.flush()
        n = len(self._files)
        weight_map = {}
        for i, (fname, names) in enumerate(self._files, 1):
            final = _shard_name(i, n)
            os.replace(self.folder / fname, self.folder / final)
            weight_map.update({k: final for k in names})
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.folder / INDEX_NAME).write_text(json.dumps(index, indent=2))
        return weight_map


def write_shards(state: dict[str, torch.Tensor], folder: Path, shard_bytes: int = SHARD_BYTES) -> None:
    """Write ``state`` as shards of at most ``shard_bytes`` plus the index (``ShardWriter``)."""
    w = ShardWriter(folder, shard_bytes)
    for name, t in state.items():
        w.add(name, t)
    w.close()


def _proc_start(pid: int) -> str | None:
    """The start time of process ``pid`` (Linux ``/proc``), to tell a reused PID apart; None elsewhere."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    now = _proc_start(pid)
    return start is None or now is None or now == start


def _remove_stale_temporaries(path: Path) -> list[Path]:
    """Remove ``.<name>.tmp-*`` folders beside ``path`` that an mxlib write on this host left
    behind when it was killed (marker present, its process gone). Returns what was removed."""
    removed = []
    for p in path.parent.glob(f".{path.name}.tmp-*"):
        marker = p / WRITE_MARKER
        try:
            if p.is_symlink() or not p.is_dir() or not marker.is_file():
                continue
            m = json.loads(marker.read_text())
            if m.get("writer") != "mxlib" or m.get("host") != socket.gethostname():
                continue
            if _alive(int(m["pid"]), m.get("start")):
                continue
        except (OSError, ValueError, KeyError, TypeError):
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


def is_mxlib_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a folder that an mxlib writer made and nobody added to: it holds
    ``CHECKPOINT_MARKER`` and only the files that marker lists."""
    marker = path / CHECKPOINT_MARKER
    if path.is_symlink() or not path.is_dir() or not marker.is_file():
        return False
    try:
        files = set(json.loads(marker.read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    entries = {p.name for p in path.iterdir()} - {WRITE_MARKER}
    return entries <= files | {CHECKPOINT_MARKER} and all(
        (path / f).is_file() and not (path / f).is_symlink() for f in entries
    )


def _check_destination(path: Path, overwrite: bool) -> None:
    if not (path.exists() or path.is_symlink()):
        return
    if path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
        return
    if overwrite or is_mxlib_checkpoint(path):
        return
    what = "a file" if not path.is_dir() or path.is_symlink() else "a folder that is not an mxlib checkpoint"
    raise FileExistsError(
        f"{path}: the destination is {what} (an mxlib checkpoint holds {CHECKPOINT_MARKER} and only the files "
        f"it lists); refusing to replace it. Choose another path, empty it, or pass overwrite=True to replace it."
    )


def _probe_removable(path: Path) -> None:
    """Rename every entry under ``path`` to a probe name and back: raises (naming ``path``) if any
    cannot be removed, changing nothing."""
    if not path.is_dir() or path.is_symlink():
        return
    for p in sorted(path.rglob("*"), key=lambda q: -len(q.parts)):
        probe = p.with_name(p.name + ".mxlib-probe")
        try:
            os.rename(p, probe)
        except OSError as err:
            raise PermissionError(
                f"{path}: cannot replace the existing checkpoint: {p.name} cannot be removed "
                f"({err.strerror}); nothing was changed"
            ) from None
        os.rename(probe, p)


_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    e = ctypes.get_errno()
    if e in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(e, os.strerror(e), str(b))


def _new_temporary(path: Path) -> Path:
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    marker = {
        "writer": "mxlib",
        "pid": os.getpid(),
        "start": _proc_start(os.getpid()),
        "host": socket.gethostname(),
        "time": time.time(),
        "destination": path.name,
    }
    (tmp / WRITE_MARKER).write_text(json.dumps(marker))
    return tmp


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike, overwrite: bool = False):
    """Yield a fresh temporary folder beside ``path``; on success it replaces ``path`` (module
    docstring: which destinations are accepted), on any error it is removed and ``path`` is left
    as it was.

    The caller writes its files into the folder; ``CHECKPOINT_MARKER`` listing them is added here.

    Raises:
        FileExistsError: ``path`` is a file or a non-empty folder that is not an mxlib checkpoint,
            and ``overwrite`` is false (checked before anything is written).
        PermissionError: the existing ``path`` cannot be removed (read-only); nothing changed.
    """
    path = Path(path)
    _check_destination(path, overwrite)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(path)
    tmp = _new_temporary(path)
    try:
        yield tmp
        files = sorted(p.name for p in tmp.iterdir() if p.name != WRITE_MARKER)
        (tmp / CHECKPOINT_MARKER).write_text(
            json.dumps({"writer": "mxlib", "writer_version": WRITER_VERSION, "files": files}, indent=1)
        )
        _check_destination(path, overwrite)  # again: it may have changed while writing
        if not (path.exists() or path.is_symlink()):
            tmp.rename(path)
        else:
            _probe_removable(path)
            if path.is_dir() and not path.is_symlink():
                # the old folder gets the write marker too: if the write dies before removing it
                # (at the temporary name after the exchange), the next write removes it
                shutil.copyfile(tmp / WRITE_MARKER, path / WRITE_MARKER)
            if path.is_dir() and not path.is_symlink() and _exchange(tmp, path):
                old = tmp  # the old folder now sits at the temporary name
            else:
                old = _new_temporary(path)
                os.rename(path, old / "old")
                tmp.rename(path)
            tmp = None
            shutil.rmtree(old)
        tmp = None
        (path / WRITE_MARKER).unlink(missing_ok=True)
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def checkpoint_size_bytes(path: str | os.PathLike) -> int:
    """Bytes of all safetensors files in a checkpoint folder."""
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


# ----------------------------------------------------------------------------- reading


def read_json(path: Path, what: str | None = None) -> dict:
    """A JSON object from ``path``; ``CheckpointError`` naming the file if it is unreadable, not
    JSON, or not an object."""
    try:
        value = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not found") from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(f"{path}: cannot be read as JSON ({err})") from None
    if not isinstance(value, dict):
        raise CheckpointError(
            f"{path}: expected a JSON object{' (' + what + ')' if what else ''}, found {type(value).__name__}"
        )
    return value


def check_shard_name(fname, source: str) -> str:
    """A shard name from an index must be a plain file name inside the checkpoint folder."""
    if (
        not isinstance(fname, str)
        or not fname
        or fname in (".", "..")
        or "/" in fname
        or "\\" in fname
        or "\0" in fname
        or os.path.isabs(fname)
    ):
        raise CheckpointError(
            f"{source}: shard name {fname!r} is not a plain file name in the checkpoint folder "
            f"(absolute paths, '..' and separators are refused)"
        )
    return fname


SINGLE_FILE = "model.safetensors"


def read_weight_map(folder: Path) -> dict[str, str] | None:
    """The checked ``{tensor name: shard file name}`` of ``folder``'s index, or None when the
    folder holds a single ``model.safetensors`` and no index.

    Raises:
        CheckpointError: neither an index nor ``model.safetensors``; an index that is not a JSON
            object, whose ``weight_map`` is not an object of names, that names a shard which is not
            a plain file name in the folder, or a shard that is not there (each naming the file).
    """
    folder = Path(folder)
    index = folder / INDEX_NAME
    if index.exists():
        data = read_json(index, "the safetensors index")
        wm = data.get("weight_map")
        if not isinstance(wm, dict) or not all(isinstance(k, str) for k in wm):
            raise CheckpointError(
                f"{index}: 'weight_map' must be an object of tensor name -> shard file name, found {type(wm).__name__}"
            )
        weight_map = {k: check_shard_name(v, str(index)) for k, v in wm.items()}
        for fname in sorted(set(weight_map.values())):
            if not (folder / fname).is_file():
                raise CheckpointError(f"{folder / fname}: shard listed in {INDEX_NAME} not found")
        return weight_map
    if (folder / SINGLE_FILE).exists():
        return None
    raise CheckpointError(f"{folder}: no {SINGLE_FILE} or {INDEX_NAME}")


class TensorReader:
    """Name -> tensor access over a single ``model.safetensors`` or an index of shards, with
    dtype, shape and value checks that name the file and the tensor (module docstring)."""

    def __init__(self, folder: Path):
        folder = Path(folder)
        self.folder = folder
        self._name: str | None = None
        self._handle = None
        weight_map = read_weight_map(folder)
        if weight_map is None:  # a single model.safetensors: its tensor names from safetensors
            weight_map = {k: SINGLE_FILE for k in self._open(SINGLE_FILE).keys()}
        self.weight_map = weight_map

    def _open(self, fname: str):
        if self._name != fname:
            self._handle = None  # close the previous shard (its mapped pages go with it)
            try:
                self._handle = safe_open(str(self.folder / fname), "pt")
            except Exception as err:  # noqa: BLE001  safetensors raises its own error types
                raise CheckpointError(f"{self.folder / fname}: not a readable safetensors file ({err})") from None
            self._name = fname
            self._keys = set(self._handle.keys())
        return self._handle

    def close(self) -> None:
        self._handle, self._name = None, None

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str, shape=None, dtype=None) -> torch.Tensor:
        if name not in self.weight_map:
            raise CheckpointError(f"checkpoint {self.folder} is missing tensor {name!r}")
        fname = self.weight_map[name]
        f = self._open(fname)
        if name not in self._keys:
            raise CheckpointError(
                f"checkpoint {self.folder} is missing tensor {name!r} (listed in the index for "
                f"{fname}, not found in that file)"
            )
        try:
            t = f.get_tensor(name)
        except Exception as err:  # noqa: BLE001  safetensors raises its own error types
            raise CheckpointError(f"{self.folder / fname}: cannot read tensor {name!r} ({err})") from None
        if dtype is not None and t.dtype != dtype:
            raise CheckpointError(f"tensor {name!r}: expected dtype {dtype}, found {t.dtype} (in {fname})")
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"tensor {name!r}: expected shape {list(shape)}, found {list(t.shape)} (in {fname})")
        return t

    def stack(self, names: list[str], shape, dtype, check=None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The named tensors stacked along a new first axis (each checked), written into ``out``
        (``[len(names), *shape]``, may be a view) when given.

        ``check(tensor) -> (ok, what)`` validates values: a false ``ok`` raises ``CheckpointError``
        naming the tensor, its file and ``what``.
        """
        if out is None:
            out = torch.empty((len(names), *shape), dtype=dtype)
        for x, n in enumerate(names):
            t = self.get(n, shape, dtype)
            if check is not None:
                ok, what = check(t)
                if not ok:
                    raise CheckpointError(f"tensor {n!r}: {what} (in {self.weight_map[n]})")
            out[x].copy_(t)
        return out


# ----------------------------------------------------------------------------- reading headers only

# safetensors header dtype -> torch dtype (F8_E8M0 and F4 where this torch has them)
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
for _name, _attr in (("F8_E8M0", "float8_e8m0fnu"), ("F4", "float4_e2m1fn_x2")):
    if hasattr(torch, _attr):
        SAFETENSORS_DTYPES[_name] = getattr(torch, _attr)

_FLOAT_SCALARS = ("F32", "BF16", "F16", "F64")


class SafetensorsHeaders:
    """Names, dtypes, shapes and data offsets of every tensor of a checkpoint folder, parsed from
    the safetensors headers of the shards ``read_weight_map`` lists (module docstring);
    ``read_scalars`` reads the data of named one-element tensors only, and counts it
    (``tensors_read``, ``bytes_read``).

    Attributes: ``where`` ``{name: shard file name}``, ``dtype`` ``{name: safetensors dtype
    string}`` (``"F32"``), ``shape`` ``{name: tuple}``, ``span`` ``{name: (begin, end)}`` absolute
    byte range of the data in its file; all from the headers (not from the index).

    Raises:
        CheckpointError: as ``read_weight_map``; a file whose header length does not fit the file.
    """

    def __init__(self, folder: Path):
        folder = Path(folder)
        weight_map = read_weight_map(folder)
        files = [SINGLE_FILE] if weight_map is None else sorted(set(weight_map.values()))
        self.folder = folder
        self.files = files
        self.where: dict[str, str] = {}
        self.dtype: dict[str, str] = {}
        self.shape: dict[str, tuple[int, ...]] = {}
        self.span: dict[str, tuple[int, int]] = {}
        self.tensors_read = 0
        self.bytes_read = 0
        for fname in files:
            path = folder / fname
            with open(path, "rb") as f:
                head = f.read(8)
                n = int.from_bytes(head, "little") if len(head) == 8 else -1
                size = path.stat().st_size
                if not 2 <= n <= size - 8:
                    raise CheckpointError(f"{path}: not a safetensors file (header length {n}, file size {size})")
                header = json.loads(f.read(n))
            header.pop("__metadata__", None)
            for name, meta in header.items():
                begin, end = meta["data_offsets"]
                self.where[name] = fname
                self.dtype[name] = meta["dtype"]
                self.shape[name] = tuple(meta["shape"])
                self.span[name] = (8 + n + begin, 8 + n + end)

    def read_scalars(self, names: list[str]) -> dict[str, float]:
        """The named one-element float tensors as Python floats (exact widening of
        fp32/bf16/fp16/fp64), one per name; each shard is opened once and read in data order.

        Raises:
            CheckpointError: a named tensor of more than one element, or of a non-float dtype.
        """
        for n in names:
            if math.prod(self.shape[n]) != 1:
                raise CheckpointError(f"tensor {n!r}: expected one scale value, found shape {list(self.shape[n])}")
            if self.dtype[n] not in _FLOAT_SCALARS:
                raise CheckpointError(
                    f"tensor {n!r}: expected a float scale ({', '.join(_FLOAT_SCALARS)}), found {self.dtype[n]}"
                )
        raw: dict[str, list[tuple[str, bytes]]] = {}
        by_file: dict[str, list[str]] = {}
        for n in names:
            by_file.setdefault(self.where[n], []).append(n)
        for fname, group in by_file.items():
            with open(self.folder / fname, "rb") as f:
                for n in sorted(group, key=lambda x: self.span[x][0]):
                    begin, end = self.span[n]
                    f.seek(begin)
                    data = f.read(end - begin)
                    self.tensors_read += 1
                    self.bytes_read += len(data)
                    raw.setdefault(self.dtype[n], []).append((n, data))
        out: dict[str, float] = {}
        for dtype, items in raw.items():
            values = (
                torch.frombuffer(bytearray(b"".join(d for _, d in items)), dtype=SAFETENSORS_DTYPES[dtype])
                .double()
                .tolist()
            )
            out.update(zip((n for n, _ in items), values))
        return out


class _MetaHandle:
    """Stands in for an open safetensors file: ``get_tensor`` gives a ``meta`` tensor of the
    header's dtype and shape, so a layout's ``read_experts`` checks everything and reads nothing."""

    def __init__(self, headers: SafetensorsHeaders):
        self._h = headers

    def get_tensor(self, name: str) -> torch.Tensor:
        if name not in self._h.dtype:
            raise KeyError(name)
        dtype = SAFETENSORS_DTYPES.get(self._h.dtype[name])
        if dtype is None:
            raise CheckpointError(f"tensor {name!r}: safetensors dtype {self._h.dtype[name]} is not one torch reads")
        return torch.empty(self._h.shape[name], dtype=dtype, device="meta")


class HeaderTensorReader(TensorReader):
    """The loader's ``TensorReader`` (same checks and messages) over ``SafetensorsHeaders`` only:
    ``get`` gives ``meta`` tensors, ``stack`` checks dtypes and shapes and reads nothing."""

    def __init__(self, headers: SafetensorsHeaders):
        self.weight_map = dict(headers.where)
        self.folder = headers.folder
        self._handle = _MetaHandle(headers)
        self._name = None
        self._keys = set(headers.dtype)

    def _open(self, fname: str):
        return self._handle

    def stack(self, names: list[str], shape, dtype, check=None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Dtype and shape checks of every named tensor (``TensorReader.get``); the value checks
        (``check``) need the data and are left to the loader. ``out`` (never written) or a meta tensor."""
        for n in names:
            self.get(n, shape, dtype)
        return out if out is not None else torch.empty((len(names), *shape), dtype=dtype, device="meta")
