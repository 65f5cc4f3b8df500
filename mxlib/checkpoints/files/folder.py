"""A checkpoint folder whose JSON config files are each read once per load.

A load reads ``config.json`` in several steps (the family check, the quantization config, the model's
sizes, the config a saved model writes back) and a layout's legacy file (ModelOpt's
``hf_quant_config.json``) in two (the quantization config, the copy a saved model writes).
``CheckpointFolder(path)`` is made once at the public entry (``load_quantized_moe``,
``inspect_checkpoint``, ``dummy_checkpoint_from_config``, ``quantize_checkpoint``) and handed to every step:

* ``json(name, what)``: the JSON object of the folder's file ``name``, read on first use through
  ``headers.read_json`` (a regular file, at most ``MAX_JSON_BYTES``, UTF-8 JSON, an object: the same checks
  and the same ``CheckpointError`` naming the file) and kept; every call returns a fresh copy, so a step that
  edits its dict (the loader cutting ``num_hidden_layers``) changes nothing another step reads;
* ``text(name)``: the text that object was parsed from (a saved model copies the file as it is);
* ``read_json(path, what)``: ``json`` under the signature of ``headers.read_json``, for code that takes a
  reader (``mxlib.models.families.check_supported_checkpoint``); a path outside the folder is read as
  ``headers.read_json`` reads it, and not kept;
* ``CheckpointFolder.of(folder)``: the object itself, or a new one for a path (functions that take either).

The object is a path (``os.PathLike``: ``Path(folder)``, ``folder / name``, ``str(folder)`` are the folder's),
so a layout's ``read_legacy(folder)`` written against a ``Path`` reads it unchanged. A failed read is not kept:
a later call reads the file again and raises again. The safetensors index and headers are read once by
``headers.SafetensorsHeaders``, which the loader and the inspector already share.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

from ..layout import CheckpointError
from . import headers, untrusted
from .headers import MAX_JSON_BYTES

__all__ = ["CheckpointFolder", "CONFIG_FILE"]

CONFIG_FILE = "config.json"


class CheckpointFolder(os.PathLike):
    """A checkpoint or config folder whose JSON files are read once (module docstring).

    Attributes: ``path`` (``Path``); ``reads`` ``{file name: times read from disk}`` (1 for each file a load
    read, whatever the number of steps that asked for it).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._json: dict[str, tuple[dict, str]] = {}
        self.reads: dict[str, int] = {}

    @classmethod
    def of(cls, folder: str | os.PathLike | CheckpointFolder) -> CheckpointFolder:
        """``folder`` itself when it is a ``CheckpointFolder``, else a new one for the path."""
        return folder if isinstance(folder, cls) else cls(folder)

    def __fspath__(self) -> str:
        return os.fspath(self.path)

    def __str__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"CheckpointFolder({str(self.path)!r})"

    def __truediv__(self, name: str | os.PathLike) -> Path:
        return self.path / name

    @property
    def name(self) -> str:
        return self.path.name

    def _load(self, name: str, what: str | None) -> tuple[dict, str]:
        kept = self._json.get(name)
        if kept is None:
            path = self.path / name
            kept = untrusted.read_json_and_text(path, what, MAX_JSON_BYTES, CheckpointError, _open)
            self.reads[name] = self.reads.get(name, 0) + 1
            self._json[name] = kept
        return kept

    def json(self, name: str, what: str | None = None) -> dict:
        """The JSON object of the folder's file ``name`` (a fresh copy at every call).

        Args:
            name: a file name in the folder (``"config.json"``).
            what: what the file is, for the message of a file that is not a JSON object (``"a transformers model
                config"``).

        Raises:
            CheckpointError: as ``headers.read_json``: the file absent, not a regular file, larger than
                ``MAX_JSON_BYTES``, not UTF-8, not JSON or not an object (naming the file).
        """
        return copy.deepcopy(self._load(name, what)[0])

    def text(self, name: str) -> str:
        """The text of the folder's JSON file ``name``, as ``json`` read it (one read for both).

        Raises:
            CheckpointError: as ``json``.
        """
        return self._load(name, None)[1]

    def config(self) -> dict:
        """``json("config.json", "a transformers model config")``.

        Raises:
            CheckpointError: as ``json``.
        """
        return self.json(CONFIG_FILE, "a transformers model config")

    def read_json(self, path: str | os.PathLike, what: str | None = None) -> dict:
        """``json`` of a file of this folder given by its path; a path elsewhere read by ``headers.read_json``.

        Raises:
            CheckpointError: as ``json``.
        """
        path = Path(path)
        if path.parent == self.path:
            return self.json(path.name, what)
        return headers.read_json(path, what)


def _open(path: Path):
    return headers.open_regular(path)  # looked up at each call (a test records reads through it)
