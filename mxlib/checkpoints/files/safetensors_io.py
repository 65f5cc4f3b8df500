"""Safetensors shards written (``ShardWriter``) and read (``TensorReader``): shared by every layout.

Writing: ``ShardWriter`` streams tensors into shards of at most ``shard_bytes``: a shard is written
(``safetensors.torch.save_file``, which reads the tensors in place) as soon as it is full and its
tensors are dropped, so a writer holds at most one shard's tensors (copied into one buffer per shard,
which keeps the heap from fragmenting). The folder they go into is ``atomic_write.atomic_folder``'s:
written under a temporary name and swapped into place, with no crash point that loses the old
checkpoint. A full disk or any other error of safetensors' writer is a ``CheckpointError`` naming the
shard file.

Reading (``TensorReader``): the folder's files are read as untrusted input through
``headers.SafetensorsHeaders`` (regular files only; the index checked; every shard's header checked as
safetensors checks it, names unique across shards) before any tensor data is read. ``get`` checks a
tensor's dtype and shape against its header before reading its data, ``stack`` checks every tensor of
the stack before allocating it, so a config that names sizes the files do not hold allocates nothing.
Every error (a missing or corrupt shard, a missing tensor, a wrong dtype or shape, an invalid value) is
a ``CheckpointError`` naming the file and the tensor. A shard is mapped at most one at a time (the
previous one is closed), so memory-mapped pages of the whole checkpoint are never all resident at once.
Its data comes from the file ``SafetensorsHeaders`` opened when it read the header
(``SafetensorsHeaders.reading_path``), so a folder replaced in between is not mixed in.

Reading headers only (``HeaderTensorReader``, for the inspector and the loader's checks before a model
is built): a ``TensorReader`` whose tensors are ``meta`` tensors of the header's dtype and shape, except
small ones (at most ``SMALL_NUMEL`` elements: scales), which are read, so a layout's ``read_experts``
runs the loader's dtype, shape and scale-value checks, with the loader's messages, and reads no weights.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..layout import CheckpointError
from .atomic_write import CHECKPOINT_MARKER, WRITE_MARKER, WRITER_VERSION, atomic_folder, is_mxlib_checkpoint
from .headers import (
    INDEX_NAME,
    SAFETENSORS_DTYPES,
    SINGLE_FILE,
    SafetensorsHeaders,
    check_shard_name,
    read_json,
    read_weight_map,
)

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
    "SINGLE_FILE",
    "read_json",
    "check_shard_name",
    "is_mxlib_checkpoint",
    "read_weight_map",
    "SafetensorsHeaders",
    "HeaderTensorReader",
    "SAFETENSORS_DTYPES",
    "SMALL_NUMEL",
]

# 256 MiB: the writer holds at most one shard's tensors in memory (peak
# resident memory while quantizing stays within 1.25x the bf16 model's bytes).
SHARD_BYTES = 256 * 1024**2
SMALL_NUMEL = 1  # HeaderTensorReader reads tensors of at most this many elements (scalar scales), not weights


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
        try:
            save_file(self._pending, str(self.folder / fname), metadata={"format": "pt"})
        except Exception as err:  # noqa: BLE001  safetensors' own errors (a full disk) name no file
            what = (
                f"{self.folder / fname}: writing a shard of {len(self._pending)} tensors ({self._size} bytes, e.g. "
                f"{next(iter(self._pending))!r}) failed"
            )
            if isinstance(err, OSError) and err.errno is not None:
                raise type(err)(err.errno, f"{what}: {err.strerror}") from err
            raise OSError(f"{what}: {err}") from err
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


def checkpoint_size_bytes(path: str | os.PathLike) -> int:
    """Bytes of all safetensors files in a checkpoint folder."""
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


# ----------------------------------------------------------------------------- reading


class TensorReader:
    """Name -> tensor access over a single ``model.safetensors`` or an index of shards, with
    dtype, shape and value checks that name the file and the tensor (module docstring).

    ``headers``: the folder's ``SafetensorsHeaders`` (read here when not given)."""

    def __init__(self, folder: Path, headers: SafetensorsHeaders | None = None):
        folder = Path(folder)
        self.folder = folder
        self._name: str | None = None
        self._handle = None
        self.headers = headers if headers is not None else SafetensorsHeaders(folder)
        self.weight_map = dict(self.headers.where)

    def _open(self, fname: str):
        if self._name != fname:
            self._handle = None  # close the previous shard (its mapped pages go with it)
            path = self.headers.reading_path(fname)  # the file the headers were read from, never a replacement
            try:
                self._handle = safe_open(path, "pt")
            except Exception as err:  # noqa: BLE001  safetensors raises its own error types
                raise CheckpointError(f"{self.folder / fname}: not a readable safetensors file ({err})") from None
            self._name = fname
        return self._handle

    def release(self) -> None:
        """Drop the open shard (its memory-mapped pages go with it) and keep the headers' files open: the next
        read opens its shard again (the streaming quantizer reads one tensor at a time this way)."""
        self._handle, self._name = None, None

    def close(self) -> None:
        """Drop the open shard and close the headers' files (``SafetensorsHeaders.close``)."""
        self._handle, self._name = None, None
        self.headers.close()

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def _check(self, name: str, shape, dtype) -> None:
        """Dtype and shape of ``name`` from its header, before any data is read."""
        if name not in self.weight_map:
            raise CheckpointError(f"checkpoint {self.folder} is missing tensor {name!r}")
        self.headers.mark_used(name)
        fname = self.weight_map[name]
        stored = SAFETENSORS_DTYPES.get(self.headers.dtype[name])
        if stored is None:
            raise CheckpointError(
                f"tensor {name!r}: safetensors dtype {self.headers.dtype[name]} is not one torch reads (in {fname})"
            )
        if dtype is not None and stored != dtype:
            raise CheckpointError(f"tensor {name!r}: expected dtype {dtype}, found {stored} (in {fname})")
        found = self.headers.shape[name]
        if shape is not None and tuple(found) != tuple(shape):
            raise CheckpointError(f"tensor {name!r}: expected shape {list(shape)}, found {list(found)} (in {fname})")

    def _read(self, name: str) -> torch.Tensor:
        fname = self.weight_map[name]
        f = self._open(fname)
        try:
            return f.get_tensor(self.headers.file_name(name))
        except Exception as err:  # noqa: BLE001  safetensors raises its own error types
            raise CheckpointError(f"{self.folder / fname}: cannot read tensor {name!r} ({err})") from None

    def get(self, name: str, shape=None, dtype=None) -> torch.Tensor:
        self._check(name, shape, dtype)
        t = self._read(name)
        if dtype is not None and t.dtype != dtype:
            raise CheckpointError(
                f"tensor {name!r}: expected dtype {dtype}, found {t.dtype} (in {self.weight_map[name]})"
            )
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise CheckpointError(
                f"tensor {name!r}: expected shape {list(shape)}, found {list(t.shape)} (in {self.weight_map[name]})"
            )
        return t

    def stack(self, names: list[str], shape, dtype, check=None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The named tensors stacked along a new first axis (each checked), written into ``out``
        (``[len(names), *shape]``, may be a view) when given. Every tensor's header is checked before
        ``out`` is allocated.

        ``check(tensor) -> (ok, what)`` validates values: a false ``ok`` raises ``CheckpointError``
        naming the tensor, its file and ``what``.
        """
        for n in names:
            self._check(n, shape, dtype)
        if out is None:
            try:
                out = torch.empty((len(names), *shape), dtype=dtype)
            except RuntimeError as err:  # the allocator's "you tried to allocate ..."
                raise CheckpointError(
                    f"tensors {names[0]!r} ... ({len(names)}): cannot allocate {len(names)} x {list(shape)} {dtype} "
                    f"({err})"
                ) from None
        for x, n in enumerate(names):
            t = self.get(n, shape, dtype)
            if check is not None:
                ok, what = check(t)
                if not ok:
                    raise CheckpointError(f"tensor {n!r}: {what} (in {self.weight_map[n]})")
            out[x].copy_(t)
        return out


class HeaderTensorReader(TensorReader):
    """The loader's ``TensorReader`` (same checks and messages) over ``SafetensorsHeaders`` only:
    ``get`` gives ``meta`` tensors for weights and reads small tensors (scales, at most
    ``SMALL_NUMEL`` elements); ``stack`` checks dtypes, shapes and the values of small tensors."""

    def __init__(self, headers: SafetensorsHeaders):
        self.headers = headers
        self.weight_map = dict(headers.where)
        self.folder = headers.folder
        self._handle = None
        self._name = None
        self._small: list[str] | None = None

    def _read(self, name: str) -> torch.Tensor:
        dtype = SAFETENSORS_DTYPES[self.headers.dtype[name]]
        shape = self.headers.shape[name]
        if math.prod(shape) <= SMALL_NUMEL and dtype.itemsize >= 1 and dtype != torch.bool:
            if self._small is None:  # every small tensor at once: one pass over each shard
                h = self.headers
                self._small = [n for n in h.where if math.prod(h.shape[n]) <= SMALL_NUMEL]
                h.read_small(self._small)
            data = bytearray(self.headers.read_small([name])[name])
            if len(data) == math.prod(shape) * dtype.itemsize:
                return torch.frombuffer(data, dtype=dtype).reshape(shape) if data else torch.empty(shape, dtype=dtype)
        return torch.empty(shape, dtype=dtype, device="meta")

    def stack(self, names: list[str], shape, dtype, check=None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Dtype and shape checks of every named tensor (``TensorReader.get``), and ``check`` on the
        tensors read (small ones); ``out`` (never written) or a meta tensor."""
        for n in names:
            self._check(n, shape, dtype)
        for n in names:
            t = self.get(n, shape, dtype)
            if check is not None and not t.is_meta:
                ok, what = check(t)
                if not ok:
                    raise CheckpointError(f"tensor {n!r}: {what} (in {self.weight_map[n]})")
        return out if out is not None else torch.empty((len(names), *shape), dtype=dtype, device="meta")
