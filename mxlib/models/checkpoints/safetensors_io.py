"""Safetensors shards, the index, the atomic folder write and tensor reading: shared by every layout.

Writes go to a temporary folder renamed into place at the end, so a failed write leaves no
half-written checkpoint (and an old checkpoint at the path stays until the new one is complete).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .layout import CheckpointError

__all__ = ["SHARD_BYTES", "write_shards", "atomic_folder", "checkpoint_size_bytes", "TensorReader", "INDEX_NAME"]

SHARD_BYTES = 2 * 1024**3
INDEX_NAME = "model.safetensors.index.json"


def write_shards(state: dict[str, torch.Tensor], folder: Path, shard_bytes: int = SHARD_BYTES) -> None:
    """Write ``state`` as ``model-0000i-of-0000n.safetensors`` shards of at most ``shard_bytes``
    (a tensor larger than that gets a shard of its own) plus ``model.safetensors.index.json``."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    total = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
        total += nbytes
    n = len(shards)
    weight_map = {}
    for idx, shard in enumerate(shards, 1):
        fname = f"model-{idx:05d}-of-{n:05d}.safetensors"
        save_file(shard, str(folder / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX_NAME).write_text(json.dumps(index, indent=2))


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike):
    """Yield a fresh temporary folder beside ``path``; on success it replaces ``path``, on any
    error it is removed (and ``path``, if it existed, is left as it was)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        yield tmp
        old = None
        if path.exists():
            old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
            path.rename(old)
        tmp.rename(path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def checkpoint_size_bytes(path: str | os.PathLike) -> int:
    """Bytes of all safetensors files in a checkpoint folder."""
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


class TensorReader:
    """Name -> tensor access over a single ``model.safetensors`` or an index of shards, with
    dtype and shape checks that name the tensor."""

    def __init__(self, folder: Path):
        index = folder / INDEX_NAME
        if index.exists():
            self.weight_map = json.loads(index.read_text())["weight_map"]
        elif (folder / "model.safetensors").exists():
            with safe_open(str(folder / "model.safetensors"), "pt") as f:
                self.weight_map = {k: "model.safetensors" for k in f.keys()}
        else:
            raise CheckpointError(f"{folder}: no model.safetensors or {INDEX_NAME}")
        self.folder = folder
        self._open: dict[str, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str, shape=None, dtype=None) -> torch.Tensor:
        if name not in self.weight_map:
            raise CheckpointError(f"checkpoint {self.folder} is missing tensor {name!r}")
        fname = self.weight_map[name]
        if fname not in self._open:
            self._open[fname] = safe_open(str(self.folder / fname), "pt")
        try:
            t = self._open[fname].get_tensor(name)
        except Exception as err:  # the index lists a tensor the shard does not hold
            raise CheckpointError(f"checkpoint {self.folder} is missing tensor {name!r} (listed in the index for "
                                  f"{fname}, not found in that file: {err})") from None
        if dtype is not None and t.dtype != dtype:
            raise CheckpointError(f"tensor {name!r}: expected dtype {dtype}, found {t.dtype}")
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"tensor {name!r}: expected shape {list(shape)}, found {list(t.shape)}")
        return t

    def stack(self, names: list[str], shape, dtype) -> torch.Tensor:
        """The named tensors stacked along a new first axis (each checked)."""
        return torch.stack([self.get(n, shape, dtype) for n in names])
