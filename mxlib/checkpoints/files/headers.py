"""Reading a checkpoint folder's files as untrusted input: regular files only, bounded reads, one
safetensors header reader for the loader and the inspector.

* ``open_regular(path)``: a file is opened only when ``stat`` says it is a regular file (a FIFO, a
  device, a socket or a folder is refused before ``open``; the open itself is non-blocking and checked
  again with ``fstat``, so a FIFO swapped in between cannot block). Symlinks are followed (the Hugging
  Face cache is made of them).
* ``read_json(path)``: at most ``MAX_JSON_BYTES`` (64 MiB) read; a larger file, bytes that are not
  UTF-8, text that is not JSON or not an object are refused naming the file.
* ``read_weight_map(folder)``: the index's ``weight_map``, every shard name a plain file name in the
  folder (no ``..``, no absolute path, no separator) and a regular file.
* ``read_safetensors_header(path)``: the checks safetensors itself makes (``safetensors::Metadata``),
  made here before any data is read: the 8-byte header length at most ``MAX_HEADER_BYTES``
  (safetensors' 100,000,000) and inside the file; a UTF-8 JSON object; each tensor's dtype a
  safetensors dtype, its shape a list of integers >= 0, its ``data_offsets`` a pair of integers; the
  spans, sorted, contiguous from 0 to the end of the file (so none overlaps another or runs past the
  end); each span exactly the bytes of its dtype and shape.
* ``SafetensorsHeaders(folder)``: every shard's header, and across shards: every name of the index in
  the header of the shard the index names, no name in two shards. The loader's ``TensorReader`` and
  the inspector both read through it, so the inspector's reports are built only from what the loader
  accepts. Every shard is opened once, there, and all its data is read through that open file, so a
  checkpoint replaced while it is read is read whole (the old one) or refused, never mixed.

Every refusal is a ``CheckpointError`` naming the file (and the tensor or field).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import torch

from ..layout import CheckpointError
from . import untrusted
from .untrusted import MAX_JSON_BYTES

__all__ = [
    "MAX_JSON_BYTES",
    "MAX_HEADER_BYTES",
    "INDEX_NAME",
    "SINGLE_FILE",
    "SAFETENSORS_DTYPES",
    "open_regular",
    "read_json",
    "check_shard_name",
    "read_weight_map",
    "read_safetensors_header",
    "folder_identity",
    "layer_of",
    "UnusedTensorsWarning",
    "describe_unused",
    "SafetensorsHeaders",
]

MAX_HEADER_BYTES = 100_000_000  # safetensors' own cap (MAX_HEADER_SIZE)
INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# bits per element of each safetensors dtype (safetensors::Dtype)
_DTYPE_BITS = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "I64": 64,
    "U64": 64,
    "F64": 64,
    "C64": 64,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
}

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


def open_regular(path: str | os.PathLike):
    """``path`` opened for reading in binary, only if it is a regular file (``mxlib.checkpoints.files.untrusted``).

    Raises:
        CheckpointError: ``path`` absent, unreadable (permissions), or not a regular file (naming what it is).
    """
    return untrusted.open_regular(path, CheckpointError)


def read_json(path: str | os.PathLike, what: str | None = None, limit: int = MAX_JSON_BYTES) -> dict:
    """A JSON object from the regular file ``path``, at most ``limit`` bytes (``mxlib.checkpoints.files.untrusted``).

    Raises:
        CheckpointError: naming the file: absent, not a regular file, larger than ``limit``, not UTF-8,
            not JSON, or not an object.
    """
    return untrusted.read_json(path, what, limit, CheckpointError, opener=open_regular)


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


class UnusedTensorsWarning(UserWarning):
    """A checkpoint stores tensors that the model its config describes does not use (the loader names them)."""


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def layer_of(name: str) -> int | None:
    """The decoder layer ``L`` of a ``model.layers.L.`` tensor name, else None."""
    m = _LAYER.match(name)
    return int(m[1]) if m else None


def describe_unused(names: list[str], limit: int = 8) -> str:
    """``names`` listed for a warning or a problem line: the first ``limit`` and how many more."""
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def folder_identity(folder: str | os.PathLike) -> tuple[int, int]:
    """``(st_dev, st_ino)`` of the folder ``folder`` names now (links followed): a folder swapped into its place
    (an atomic replace) has another.

    Raises:
        CheckpointError: ``folder`` cannot be ``stat``ed (naming it)."""
    try:
        st = os.stat(folder)
    except OSError as err:
        raise CheckpointError(f"{folder}: cannot be read ({err.strerror})") from None
    return st.st_dev, st.st_ino


def _check_regular(path: Path, what: str) -> None:
    untrusted.check_regular(path, CheckpointError, what)


def read_weight_map(folder: Path) -> dict[str, str] | None:
    """The checked ``{tensor name: shard file name}`` of ``folder``'s index, or None when the
    folder holds a single ``model.safetensors`` and no index.

    Raises:
        CheckpointError: neither an index nor ``model.safetensors``; an index that is not a JSON
            object, whose ``weight_map`` is not an object of names, that names a shard which is not
            a plain file name in the folder, or a shard that is not there or not a regular file
            (each naming the file).
    """
    folder = Path(folder)
    index = folder / INDEX_NAME
    if index.exists() or index.is_symlink():
        data = read_json(index, "the safetensors index")
        wm = data.get("weight_map")
        if not isinstance(wm, dict) or not all(isinstance(k, str) for k in wm):
            raise CheckpointError(
                f"{index}: 'weight_map' must be an object of tensor name -> shard file name, found {type(wm).__name__}"
            )
        weight_map = {k: check_shard_name(v, str(index)) for k, v in wm.items()}
        for fname in sorted(set(weight_map.values())):
            _check_regular(folder / fname, f"shard listed in {INDEX_NAME}")
        return weight_map
    if (folder / SINGLE_FILE).exists() or (folder / SINGLE_FILE).is_symlink():
        _check_regular(folder / SINGLE_FILE, "the safetensors file")
        return None
    raise CheckpointError(f"{folder}: no {SINGLE_FILE} or {INDEX_NAME}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def read_safetensors_header(path: str | os.PathLike) -> tuple[dict[str, dict], int]:
    """``({name: {"dtype", "shape", "data_offsets"}}, data_start)`` of one safetensors file, checked as
    safetensors checks it (module docstring); ``data_start`` is the byte offset of the data (8 + the
    header length). ``__metadata__`` is dropped.

    Raises:
        CheckpointError: naming the file and, for a tensor's fault, the tensor.
    """
    path = Path(path)
    with open_regular(path) as f:
        return _read_header(f, path)


def _read_header(f, path: Path) -> tuple[dict[str, dict], int]:
    """``read_safetensors_header`` of the open file ``f`` (``path`` names it in messages)."""
    size = os.fstat(f.fileno()).st_size
    f.seek(0)
    head = f.read(8)
    if len(head) < 8:
        raise CheckpointError(f"{path}: not a safetensors file ({size} bytes, shorter than the 8-byte header length)")
    n = int.from_bytes(head, "little")
    if n > MAX_HEADER_BYTES:
        raise CheckpointError(
            f"{path}: not a safetensors file: header length {n} exceeds safetensors' limit {MAX_HEADER_BYTES}"
        )
    if not 2 <= n <= size - 8:
        raise CheckpointError(f"{path}: not a safetensors file (header length {n}, file size {size})")
    raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise CheckpointError(
            f"{path}: not a safetensors file: its header is not UTF-8 JSON ({str(err)[:200]})"
        ) from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a safetensors file: its header is a {type(header).__name__}, not an object")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise CheckpointError(f"{path}: __metadata__: expected an object of strings")
    spans = []
    for name, t in header.items():
        where = f"{path}: tensor {name!r}"
        if not isinstance(t, dict):
            raise CheckpointError(f"{where}: expected an object with dtype, shape, data_offsets")
        dtype, shape, offsets = t.get("dtype"), t.get("shape"), t.get("data_offsets")
        if dtype not in _DTYPE_BITS:
            raise CheckpointError(f"{where}: dtype {dtype!r} is not a safetensors dtype")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise CheckpointError(f"{where}: shape {shape!r} is not a list of integers >= 0")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) and o >= 0 for o in offsets)):
            raise CheckpointError(f"{where}: data_offsets {offsets!r} is not a pair of integers >= 0")
        bits = math.prod(shape) * _DTYPE_BITS[dtype]
        if bits % 8 or offsets[1] - offsets[0] != bits // 8:
            raise CheckpointError(
                f"{where}: data_offsets {offsets} span {offsets[1] - offsets[0]} bytes; dtype {dtype} and shape "
                f"{shape} take {bits / 8:g}"
            )
        spans.append((offsets[0], offsets[1], name))
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            what = "overlaps the tensor before it" if begin < end else f"leaves a gap after byte {end}"
            raise CheckpointError(f"{path}: tensor {name!r}: data_offsets [{begin}, {stop}] {what}")
        end = stop
    if 8 + n + end != size:
        raise CheckpointError(
            f"{path}: the tensors' data ends at byte {8 + n + end}, the file at {size} (truncated, or bytes appended)"
        )
    return header, 8 + n


class SafetensorsHeaders:
    """Names, dtypes, shapes and data spans of every tensor of a checkpoint folder, from the checked
    headers (``read_safetensors_header``) of the shards ``read_weight_map`` lists; ``read_scalars`` and
    ``read_small`` read the data of named small tensors only, and count it (``tensors_read``,
    ``bytes_read``).

    Attributes: ``where`` ``{name: shard file name}`` (the index's names; a shard's tensor the index does
    not list is left out, as the loader cannot see it, and counted in ``unindexed``), ``dtype``
    ``{name: safetensors dtype string}`` (``"F32"``), ``shape`` ``{name: tuple}``, ``span``
    ``{name: (begin, end)}`` absolute byte range of the data in its file.

    **One checkpoint, even while it is replaced.** Every shard is opened once, here, and stays open until
    ``close()``: its header and every byte of data later read (``read_small``, and the loader's
    ``TensorReader`` through ``reading_path``) come from that same open file, so a folder replaced after this
    point (mxlib's own writer with ``overwrite=True`` swaps the whole folder) cannot mix the new shards into
    the old checkpoint: the old one is read to the end. Everything read before the shards were opened (the
    index, a caller's ``config.json``) is checked to come from the same folder: the folder's identity (device
    and inode, ``folder_identity``) taken at ``since`` (the caller's first read; default: here) must still
    be the folder's after every shard is open, and ``check_unchanged`` repeats the check after later reads
    of the folder's other files. A replaced folder is refused with a ``CheckpointError`` saying so.

    Raises:
        CheckpointError: as ``read_weight_map`` and ``read_safetensors_header``; a name in two shards; a
            name of the index missing from the header of its shard (each naming the files); the folder
            replaced since ``since``.
    """

    def __init__(self, folder: Path, since: tuple[int, int] | None = None):
        folder = Path(folder)
        self.folder = folder
        self.identity = since if since is not None else folder_identity(folder)
        self._open: dict[str, object] = {}
        weight_map = read_weight_map(folder)
        files = [SINGLE_FILE] if weight_map is None else sorted(set(weight_map.values()))
        self.files = files
        self.where: dict[str, str] = {}
        self.dtype: dict[str, str] = {}
        self.shape: dict[str, tuple[int, ...]] = {}
        self.span: dict[str, tuple[int, int]] = {}
        self.unindexed = 0
        self.unindexed_names: list[str] = []
        self.used: set[str] = set()  # names a reader checked or read (``mark_used``, ``unused``)
        self.tensors_read = 0
        self.bytes_read = 0
        self._data: dict[str, bytes] = {}
        seen: dict[str, str] = {}
        for fname in files:
            f = open_regular(folder / fname)
            self._open[fname] = f
            try:
                header, start = _read_header(f, folder / fname)
            except BaseException:
                self.close()
                raise
            for name, meta in header.items():
                if name in seen:
                    raise CheckpointError(
                        f"{folder / fname}: tensor {name!r} is also stored in {seen[name]}; a tensor name must be "
                        f"unique across the shards"
                    )
                seen[name] = fname
                if weight_map is not None and weight_map.get(name) != fname:
                    self.unindexed += 1
                    self.unindexed_names.append(name)
                    continue
                self.where[name] = fname
                self.dtype[name] = meta["dtype"]
                self.shape[name] = tuple(meta["shape"])
                begin, end = meta["data_offsets"]
                self.span[name] = (start + begin, start + end)
        if weight_map is not None:
            for name, fname in weight_map.items():
                if name not in self.where:
                    self.close()
                    raise CheckpointError(
                        f"checkpoint {folder} is missing tensor {name!r} (listed in {INDEX_NAME} for {fname}, not "
                        f"found in that file)"
                    )
        self.check_unchanged("its safetensors files")

    def mark_used(self, name: str) -> None:
        """Record that a reader checked tensor ``name`` against what it needs (its dtype and shape) and reads it."""
        self.used.add(name)

    def unused(self, skipped_layers=()) -> list[str]:
        """The tensors no reader marked used (``mark_used``): names of the index, and names a shard stores that
        the index leaves out (``unindexed_names``), except those of decoder layers the caller skips on purpose
        (``skipped_layers``: a ``num_hidden_layers`` override). Each is a tensor the config does not account
        for (an expert, a layer, a suffix beyond its sizes and layout), which a loader must name rather than
        drop in silence."""
        skipped = set(skipped_layers)
        out = [n for n in self.where if n not in self.used and layer_of(n) not in skipped]
        return out + [n for n in self.unindexed_names if layer_of(n) not in skipped]

    def check_unchanged(self, what: str = "its files") -> None:
        """The folder is still the one whose files were read (``folder_identity`` against ``identity``).

        Raises:
            CheckpointError: the folder was replaced (or removed) while ``what`` was being read.
        """
        try:
            now = folder_identity(self.folder)
        except CheckpointError:
            now = None
        if now != self.identity:
            self.close()
            raise CheckpointError(
                f"{self.folder}: the folder was replaced while {what} were being read (another writer, e.g. a save "
                f"with overwrite=True); nothing of the new checkpoint is mixed in: load it again"
            )

    def close(self) -> None:
        """Close the shards opened by the constructor (a later read raises ``CheckpointError``)."""
        opened, self._open = self._open, {}
        for f in opened.values():
            f.close()

    def opened(self, fname: str):
        """The open file of shard ``fname`` (opened by the constructor).

        Raises:
            CheckpointError: after ``close()``."""
        f = self._open.get(fname)
        if f is None:
            raise CheckpointError(f"{self.folder / fname}: the checkpoint's files were closed; read it again")
        return f

    def reading_path(self, fname: str) -> str:
        """A path that opens the very file the constructor opened for shard ``fname``, even after the folder was
        replaced: ``/proc/self/fd/N`` (Linux) or ``/dev/fd/N``. Where neither exists, the shard's own path,
        checked to name the same file (device and inode) as the open one.

        Raises:
            CheckpointError: the shard's path no longer names the file that was opened (the folder replaced)."""
        fd = self.opened(fname).fileno()
        for base in ("/proc/self/fd", "/dev/fd"):
            if os.path.isdir(base):
                return f"{base}/{fd}"
        st, now = os.fstat(fd), None
        try:
            now = os.stat(self.folder / fname)
        except OSError:
            pass
        if now is None or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            self.check_unchanged("its tensors")
            raise CheckpointError(f"{self.folder / fname}: the file changed after its header was read; load it again")
        return str(self.folder / fname)

    def as_module_names(self, module_name) -> SafetensorsHeaders:
        """These headers with every tensor under its state-dict name ``module_name(file name)`` (a family's
        ``MoEFamily.module_name``: Mixtral's ``block_sparse_moe.experts.e.w1`` read as
        ``mlp.experts.e.gate_proj``), in place; ``file_name`` maps a name back to the one the shard stores.

        Raises:
            CheckpointError: two stored names that map to one state-dict name (naming both).
        """
        renamed = {}
        for n in self.where:
            m = module_name(n)
            if m in renamed:
                raise CheckpointError(
                    f"checkpoint {self.folder}: tensors {renamed[m]!r} and {n!r} are both read as {m!r}"
                )
            renamed[m] = n
        back = {m: n for m, n in renamed.items()}
        self.where = {m: self.where[n] for m, n in back.items()}
        self.dtype = {m: self.dtype[n] for m, n in back.items()}
        self.shape = {m: self.shape[n] for m, n in back.items()}
        self.span = {m: self.span[n] for m, n in back.items()}
        self._data = {}
        self._file_names = {m: n for m, n in back.items() if m != n}
        return self

    def file_name(self, name: str) -> str:
        """The name a shard stores tensor ``name`` under (``as_module_names``; else ``name``)."""
        return getattr(self, "_file_names", {}).get(name, name)

    def read_small(self, names: list[str]) -> dict[str, bytes]:
        """The raw bytes of the named tensors, each shard opened once and read in data order; each tensor
        is read once (kept for later calls) and counted once."""
        by_file: dict[str, list[str]] = {}
        for n in names:
            if n not in self._data:
                by_file.setdefault(self.where[n], []).append(n)
        out = self._data
        for fname, group in by_file.items():
            f = self.opened(fname)
            for n in sorted(group, key=lambda x: self.span[x][0]):
                begin, end = self.span[n]
                f.seek(begin)
                data = f.read(end - begin)
                if len(data) != end - begin:
                    raise CheckpointError(f"{self.folder / fname}: tensor {n!r}: the file ends inside its data")
                self.tensors_read += 1
                self.bytes_read += len(data)
                out[n] = data
        return {n: out[n] for n in names}

    def read_scalars(self, names: list[str]) -> dict[str, float]:
        """The named one-element float tensors as Python floats (exact widening of
        fp32/bf16/fp16/fp64), one per name.

        Raises:
            CheckpointError: a named tensor of more than one element, or of a non-float dtype.
        """
        for n in names:
            if math.prod(self.shape[n]) != 1:
                raise CheckpointError(
                    f"tensor {n!r}: expected one scale value, found shape {list(self.shape[n])} (in {self.where[n]})"
                )
            if self.dtype[n] not in _FLOAT_SCALARS:
                raise CheckpointError(
                    f"tensor {n!r}: expected a float scale ({', '.join(_FLOAT_SCALARS)}), found {self.dtype[n]} "
                    f"(in {self.where[n]})"
                )
        raw = self.read_small(names)
        by_dtype: dict[str, list[str]] = {}
        for n in names:
            by_dtype.setdefault(self.dtype[n], []).append(n)
        out: dict[str, float] = {}
        for dtype, group in by_dtype.items():
            data = bytearray(b"".join(raw[n] for n in group))
            out.update(zip(group, torch.frombuffer(data, dtype=SAFETENSORS_DTYPES[dtype]).double().tolist()))
        return out


_FLOAT_SCALARS = ("F32", "BF16", "F16", "F64")
