"""Quantizing a bf16 checkpoint folder one decoder layer at a time: ``quantize_checkpoint`` (``mxlib quantize``).

The source is a folder as transformers' ``save_pretrained`` writes it: ``config.json`` naming a registered
family (``mxlib.models.families``), one ``model.safetensors`` or shards listed in
``model.safetensors.index.json``, bf16 experts under the family's on-disk names (per expert
``model.layers.L.mlp.experts.e.{gate_proj,up_proj,down_proj}.weight``, Mixtral's ``block_sparse_moe...w1/w3/w2``,
gpt-oss's whole-layer ``gate_up_proj`` / ``down_proj`` with their biases). The destination is the checkpoint
``write_quantized_checkpoint`` writes for the same model, tensor for tensor (the same per-layer code:
``writer.write_layer_experts``, ``writer.write_config_files``, ``safetensors_io.ShardWriter``), in an atomic
folder write (``mxlib.checkpoints.files.atomic_write``: on any error nothing is left at the destination, or the old
checkpoint stays), files ``0644``.

How memory stays near one layer. The transformers model is built with uninitialized parameters
(``moe_models.empty_moe_model``: allocated, never written, so no page is resident). Then, for each decoder
layer in order: its tensors are read from the shards one tensor at a time (each shard opened for one tensor
and closed again, so its memory-mapped pages do not accumulate), put into the layer's parameters (the
per-expert tensors of a layer stacked into transformers' fused ``gate_up_proj [E, 2I, H]`` and
``down_proj [E, H, I]``), the layer's experts are quantized and written into the shard writer, its other
tensors are written as the writer writes them (bf16; float32 where the family keeps them so), and every
parameter of the layer is dropped before the next layer is read. The embedding is read first and kept until
the last layer is done; the output head is read last. Peak resident memory is about the interpreter (torch
and transformers imported), one layer's bf16 tensors, the embedding, and one shard of quantized tensors
(``SHARD_BYTES``); ``tests/test_quantize_command.py`` measures it on a two-layer checkpoint of
Qwen3-30B-A3B's layer shape.

Calibration (schemes with static activation scales: NVFP4's ``input_scale``, ``_a_fp8``) runs the model
itself layer by layer: the calibration token ids go through the embedding and then through the base model's
own forward (``model.model``), with a forward pre-hook on every decoder layer that reads that layer's
tensors and swaps the recording twin of ``mxlib.models.calibration`` (``recording_experts``) in for its
experts, and a forward hook that takes the layer's per-expert a1 / a2 amax, quantizes and writes the layer
and drops it. The statistics are ``calibrate``'s on the same token ids in one batch (the same modules run on
the same inputs), so the checkpoint equals ``write_quantized_checkpoint(model, scheme, path,
calibrate(model, ids, batch_size=len(ids)))`` bit for bit. Calibration text is tokenized by the
checkpoint's own tokenizer (``transformers.AutoTokenizer``, local files only, no remote code) and cut into
sequences of ``seq_len`` tokens (``calibration_token_ids``). A scheme without static activation scales (weight-only,
or block-scaled activations quantized per block at run time) needs none: calibration given to it is checked and
not used (a warning; the summary says so).

Without calibration, a scheme with static activation scales is refused: no layout can say "per-token
activation scales" for NVFP4 or static FP8 (ModelOpt's ``input_scale`` and compressed-tensors'
``input_global_scale`` are static tensors vLLM requires), so the honest options are calibration text or a
weight-only / dynamic-activation scheme (``w4a16_nvfp4``, ``w_mxfp4``, ``w_mxfp4_a_mxfp4``). GPTQ needs every
expert's Hessian of a layer (``mxlib.models.hessians``; 2 GB per layer at Qwen3-30B-A3B's shape) and is not
offered here: quantize in memory (``write_quantized_checkpoint(..., technique=GPTQ(hessians))``).

Beside the shards the destination gets the source's ``generation_config.json``, tokenizer files and chat
template (``dummy.COPIED_FILES``, copied unchanged).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from ..models.calibration import Calibration, recording_experts
from ..models.families import MoEFamily, check_supported_checkpoint
from ..models.moe_models import empty_moe_model, expert_biases, expert_weights, tied_parameter_names
from ..moe.schemes import MoEQuantScheme, get_moe_scheme
from ..recovery import WeightTechnique, get_technique
from ..recovery.base import technique_global_scale_kw
from .bounds import check_model_config
from .dummy import copy_model_files
from .files.atomic_write import atomic_folder
from .files.folder import CheckpointFolder
from .files.headers import SafetensorsHeaders
from .files.safetensors_io import SHARD_BYTES, HeaderTensorReader, ShardWriter, TensorReader
from .layout import CheckpointError
from .writer import resolve_layout, stored_config, unquantized_modules, write_config_files, write_layer_experts

__all__ = [
    "quantize_checkpoint",
    "check_quantization",
    "QuantizePlan",
    "QuantizeResult",
    "read_source",
    "calibration_token_ids",
    "check_calibration_text",
    "TOKENIZER_FILES",
    "CALIBRATION_SEQ_LEN",
    "CALIBRATION_MAX_TOKENS",
    "STREAMING_TECHNIQUES",
]

logger = logging.getLogger(__name__)

CALIBRATION_SEQ_LEN = 512  # tokens per calibration sequence
CALIBRATION_MAX_TOKENS = 4096  # calibration tokens used at most (the rest of the text is left out)
MAX_CALIBRATION_BYTES = 64 * 2**20
# files of which one marks a folder that AutoTokenizer can read
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# the technique names that need nothing but the weights (GPTQ needs Hessians: module docstring)
STREAMING_TECHNIQUES = ("rtn", "four_over_six", "mse", "four_over_six_mse", "hadamard")


@dataclass
class QuantizeResult:
    """What ``quantize_checkpoint`` wrote.

    Attributes:
        path: the destination folder.
        architecture: the family's class name; ``layers``: decoder layers; ``moe_layers``: their MoE layers'
            indices; ``num_experts``: experts per MoE layer.
        scheme, layout, technique: the names written (``technique`` ``"rtn"`` for round-to-nearest).
        calibration_tokens: tokens the model was calibrated on (0: none); ``calibration_shape``
            ``[sequences, tokens]``; ``uncalibrated``: ``{layer: [expert, ...]}`` of experts no calibration token
            was routed to (their input scale is 0, "never calibrated": vLLM takes the largest of a layer's);
            ``calibration_unused``: calibration was given to a scheme without static activation scales.
        bytes_read: bytes of the source tensors read; ``bytes_written``: bytes of the safetensors files written.
        copied: the model files copied beside the shards (tokenizer, generation config, chat template).
        seconds: wall time.
    """

    path: Path
    architecture: str
    layers: int
    moe_layers: list[int]
    num_experts: int
    scheme: str
    layout: str
    technique: str
    calibration_tokens: int = 0
    calibration_shape: list[int] | None = None
    uncalibrated: dict[int, list[int]] = field(default_factory=dict)
    calibration_unused: bool = False
    bytes_read: int = 0
    bytes_written: int = 0
    copied: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        """A JSON-ready dict (``path`` as a string)."""
        d = dict(self.__dict__)
        d["path"] = str(self.path)
        d["uncalibrated"] = {str(k): v for k, v in self.uncalibrated.items()}
        return d

    def summary(self) -> str:
        """Two lines a person reads: what was written where, and what it cost."""
        calib = "no calibration"
        if self.calibration_unused:
            calib = f"calibration not used (scheme {self.scheme} has no static activation scales)"
        if self.calibration_tokens:
            n = sum(len(v) for v in self.uncalibrated.values())
            calib = (
                f"calibrated on {self.calibration_tokens} tokens ({self.calibration_shape[0]} x "
                f"{self.calibration_shape[1]}), {n} expert{'s' if n != 1 else ''} never routed"
            )
        return (
            f"{self.architecture}, {self.layers} layers ({len(self.moe_layers)} MoE, {self.num_experts} experts "
            f"each): scheme {self.scheme}, layout {self.layout}, technique {self.technique}; {calib}\n"
            f"read {_size(self.bytes_read)}, wrote {_size(self.bytes_written)} of shards"
            f"{' and ' + ', '.join(self.copied) if self.copied else ''} in {self.seconds:.1f} s to {self.path}"
        )


def _size(n: int) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} bytes"


def read_source(src: str | os.PathLike, where: str = "quantize_checkpoint"):
    """Check a bf16 checkpoint folder before anything is built: ``(family, config, headers)``.

    ``headers`` are the folder's ``SafetensorsHeaders`` under state-dict names (``as_module_names``);
    ``config`` the family's transformers config, every non-expert tensor's shape checked against the
    headers (``bounds.check_model_config``), and every expert tensor's name, dtype (bf16) and shape.

    Raises:
        CheckpointError: ``src`` absent or not a folder; no ``config.json``; a ``config.json`` of a family
            mxlib does not quantize (naming its class and the supported ones); a quantized checkpoint
            (``quantization_config``); no safetensors files; a missing tensor, or one of another dtype or
            shape (naming the tensor and its file).

    ``src`` may be a ``files.folder.CheckpointFolder``, whose ``config.json`` is then not read again.
    """
    config_files = CheckpointFolder.of(src)  # config.json read once
    folder = Path(src)
    if not folder.exists():
        raise CheckpointError(f"{where}: src: {str(folder)!r} does not exist; expected a checkpoint folder")
    if not folder.is_dir():
        raise CheckpointError(f"{where}: src: {str(folder)!r} is not a folder; expected a checkpoint folder")
    cfg_path = folder / "config.json"
    if not (cfg_path.exists() or cfg_path.is_symlink()):
        raise CheckpointError(
            f"{where}: src: {str(folder)!r} has no config.json; expected a checkpoint folder as transformers' "
            f"save_pretrained writes it"
        )
    family = check_supported_checkpoint(folder, where, config_files.read_json, CheckpointError)
    try:
        cfg = config_files.config()
        if cfg.get("quantization_config") is not None:
            qc = cfg["quantization_config"]
            method = qc.get("quant_method") if isinstance(qc, dict) else None
            raise CheckpointError(
                f"{where}: src: {cfg_path} has a quantization_config (quant_method {method!r}): the checkpoint is "
                f"quantized already; expected a bf16 checkpoint"
            )
        cfg.pop("quantization_config", None)
        headers = SafetensorsHeaders(folder).as_module_names(family.module_name)
        config = check_model_config(cfg, cfg_path, headers, None, family=family)
        # the writer stores every other tensor in bf16 (float32 where the family keeps it so) and never rounds
        # silently: a tensor stored wider is refused, not rounded
        experts_part = f".{family.block_attr}.{family.experts_attr}."
        for name, stored in headers.dtype.items():
            target = "F32" if family.keeps_fp32(name) else "BF16"
            if experts_part not in name and stored in ("F32", "F16", "F64") and (stored, target) != ("F32", "F32"):
                raise CheckpointError(
                    f"tensor {name!r}: expected dtype {'float32' if target == 'F32' else 'bfloat16'}, found "
                    f"{stored} (in {headers.where[name]}); mxlib quantize reads bf16 checkpoints and stores the "
                    f"unquantized tensors in bf16 without rounding: convert the checkpoint to bf16 first"
                )
        reader = HeaderTensorReader(headers)
        e, h, i = family.num_experts(config), config.hidden_size, family.intermediate_size(config)
        meta = None
        if family.experts_orientation != "gate_up_rows":
            with torch.device("meta"):
                meta = family.load_class()(config)
        for layer in family.moe_layer_indices(config):
            prefix = family.experts_prefix(layer)
            if family.experts_orientation == "gate_up_rows":
                for proj, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
                    reader.stack([f"{prefix}.{x}.{proj}.weight" for x in range(e)], shape, torch.bfloat16)
            else:  # whole-layer tensors (gpt-oss): the names and shapes transformers' module has
                experts = getattr(getattr(meta.model.layers[layer], family.block_attr), family.experts_attr)
                for name, p in experts.named_parameters():
                    reader.get(f"{prefix}.{name}", tuple(p.shape), torch.bfloat16)
    except CheckpointError as err:
        if str(err).startswith(f"{where}: "):
            raise
        raise CheckpointError(f"{where}: src: {err}") from None
    return family, config, headers


def check_calibration_text(text: str, source: str = "calibration") -> str:
    """``text`` unless it is empty or only white space.

    Raises:
        ValueError: naming ``source``.
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{source}: the calibration text is empty; expected text to calibrate on")
    return text


def calibration_token_ids(
    src: str | os.PathLike,
    text: str,
    seq_len: int = CALIBRATION_SEQ_LEN,
    max_tokens: int = CALIBRATION_MAX_TOKENS,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Calibration token ids ``[sequences, seq_len]`` int64 from ``text`` through ``src``'s own tokenizer.

    The text is encoded as one stream (``AutoTokenizer.from_pretrained(src, local_files_only=True)``, no
    special tokens added), cut to at most ``max_tokens`` tokens, and split into whole sequences of
    ``seq_len`` (the last partial one left out); a text shorter than ``seq_len`` is one sequence of its own
    length.

    Raises:
        ValueError: empty text; no tokenizer files in ``src`` (``TOKENIZER_FILES``); text that encodes to
            no tokens; a token id at or above ``vocab_size`` (a tokenizer of another model); ``seq_len`` or
            ``max_tokens`` not a positive integer.
    """
    for name, v in (("seq_len", seq_len), ("max_tokens", max_tokens)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}: expected a positive integer, got {v!r}")
    check_calibration_text(text)
    folder = Path(src)
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise ValueError(
            f"calibration: {str(folder)!r} has no tokenizer ({', '.join(TOKENIZER_FILES)}); calibration text is "
            f"tokenized by the checkpoint's own tokenizer: add its tokenizer files to the folder"
        )
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    ids = tok(text, add_special_tokens=False)["input_ids"][:max_tokens]
    if not ids:
        raise ValueError("calibration: the text encodes to no tokens")
    if vocab_size is not None and max(ids) >= vocab_size:
        raise ValueError(
            f"calibration: the tokenizer of {str(folder)!r} gives token id {max(ids)}, at or above the model's "
            f"vocab_size {vocab_size}"
        )
    if len(ids) <= seq_len:
        return torch.tensor([ids], dtype=torch.long)
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).reshape(n, seq_len)


class _LayerLoader:
    """Reads one module's tensors from the source (one tensor at a time, each shard closed after its read)
    into its parameters, and drops them again."""

    def __init__(self, reader: TensorReader, family: MoEFamily, config):
        self.reader, self.family, self.config = reader, family, config
        self.bytes_read = 0

    def _get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        t = self.reader.get(name, shape)
        self.reader.release()  # unmap the shard: its pages would otherwise stay resident
        self.bytes_read += t.numel() * t.element_size()
        return t

    def _experts(self, prefix: str, pname: str, p: torch.Tensor) -> torch.Tensor:
        """transformers' fused ``gate_up_proj [E, 2I, H]`` (gate rows, then up) or ``down_proj [E, H, I]`` from
        the per-expert tensors."""
        out = torch.empty(p.shape, dtype=p.dtype)
        i = self.family.intermediate_size(self.config)
        for x in range(p.shape[0]):
            if pname == "gate_up_proj":
                out[x, :i].copy_(self._get(f"{prefix}.{x}.gate_proj.weight", (i, out.shape[2])))
                out[x, i:].copy_(self._get(f"{prefix}.{x}.up_proj.weight", (i, out.shape[2])))
            else:
                out[x].copy_(self._get(f"{prefix}.{x}.down_proj.weight", tuple(out.shape[1:])))
        return out

    def load(self, module: torch.nn.Module, prefix: str, skip: tuple[str, ...] = ()) -> None:
        """Every parameter (and stored buffer) of ``module`` (state-dict prefix ``prefix``) read from the source,
        except names starting with one of ``skip``."""
        experts = f"{prefix}.{self.family.block_attr}.{self.family.experts_attr}" if prefix else None
        for name, p in module.named_parameters():
            full = f"{prefix}.{name}" if prefix else name
            if full.startswith(skip):
                continue
            mod, _, pname = full.rpartition(".")
            if mod == experts and self.family.experts_orientation == "gate_up_rows":
                p.data = self._experts(mod, pname, p)
            else:
                p.data = self._get(full, tuple(p.shape)).to(p.dtype)
        for name, b in module.named_buffers():
            full = f"{prefix}.{name}" if prefix else name
            if full in self.reader and not full.startswith(skip):
                b.data = self._get(full, tuple(b.shape)).to(b.dtype)

    @staticmethod
    def drop(module: torch.nn.Module) -> None:
        for p in module.parameters():
            p.data = torch.empty(0, dtype=p.dtype)


@dataclass
class QuantizePlan:
    """A checked quantization of a checkpoint folder (``check_quantization``); ``run()`` writes it.

    Attributes: ``src``, ``dst`` (paths), ``family``, ``config`` (the family's transformers config),
    ``headers`` (the source's ``SafetensorsHeaders`` under state-dict names), ``src_config`` (its
    ``config.json`` dict), ``scheme`` (``MoEQuantScheme``), ``layout`` (``CheckpointLayout``), ``technique``
    (a ``WeightTechnique`` or None for round-to-nearest), ``token_ids`` (calibration ``[sequences, tokens]``
    int64 or None), ``overwrite``, ``calibration_unused`` (calibration given to a scheme without static activation
    scales: checked, not used).
    """

    src: Path
    dst: Path
    family: MoEFamily
    config: object
    headers: SafetensorsHeaders
    src_config: dict
    scheme: MoEQuantScheme
    layout: object
    technique: WeightTechnique | None
    token_ids: torch.Tensor | None
    overwrite: bool
    calibration_unused: bool = False

    def run(self, shard_bytes: int = SHARD_BYTES, progress: bool = False) -> QuantizeResult:
        """Write the checkpoint (module docstring); ``quantize_checkpoint``'s Args, Returns and Raises."""
        return _run(self, shard_bytes, progress)


def check_quantization(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    scheme: str | MoEQuantScheme,
    *,
    layout: str | None = None,
    calibration: str | torch.Tensor | None = None,
    technique: str | WeightTechnique | None = None,
    overwrite: bool = False,
    seq_len: int = CALIBRATION_SEQ_LEN,
    max_tokens: int = CALIBRATION_MAX_TOKENS,
    where: str = "quantize_checkpoint",
) -> QuantizePlan:
    """Every check of ``quantize_checkpoint`` (same arguments and errors), before any tensor is read or any
    file written; calibration text is tokenized here. ``where``: the entry a refusal of ``src`` names."""
    src_folder = CheckpointFolder(src)  # config.json read once
    family, config, headers = read_source(src_folder, where)
    src_cfg = src_folder.config()  # written back as it is
    scheme = get_moe_scheme(scheme)
    layout_obj = resolve_layout(family, scheme, layout)
    if isinstance(technique, str) and "gptq" in technique.split("+"):
        raise ValueError(
            f"technique: {technique} needs every expert's Hessian of a layer, which quantizing a checkpoint folder "
            "layer by layer does not collect; quantize in memory (write_quantized_checkpoint with "
            f"technique=GPTQ(hessians)) or choose one of {list(STREAMING_TECHNIQUES)}"
        )
    tech = None if technique in (None, "rtn") else get_technique(technique)  # its ValueError names the valid ones
    if tech is not None:
        technique_global_scale_kw(tech, scheme, layout_obj.global_scale_kind)  # refuses before anything is written
    if scheme.static_activation_scale and calibration is None:
        raise ValueError(
            f"calibration: scheme {scheme.name} stores static activation scales (input_scale), which need "
            f"calibration text; pass it, or choose a weight-only or dynamic-activation scheme (w4a16_nvfp4, w_mxfp4, "
            f"w_mxfp4_a_mxfp4)"
        )
    dst = Path(dst)
    if dst.resolve() == Path(src).resolve():
        raise ValueError(f"dst: {str(dst)!r} is the source folder itself; expected another folder")
    if (dst.exists() or dst.is_symlink()) and not overwrite:
        if not dst.is_dir() or dst.is_symlink() or any(dst.iterdir()):
            raise FileExistsError(f"dst: {str(dst)!r} exists and is not empty; pass overwrite=True to replace it")
    ids = None
    unused = calibration is not None and not scheme.static_activation_scale
    if unused:  # still checked, so that a mistake in it is not silent
        if isinstance(calibration, str):
            check_calibration_text(calibration)
        logger.warning("scheme %s has no static activation scales: the calibration text is not used", scheme.name)
    elif calibration is not None:
        if isinstance(calibration, str):
            ids = calibration_token_ids(src, calibration, seq_len, max_tokens, config.vocab_size)
        else:
            ids = calibration
            if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.dtype != torch.long or ids.numel() == 0:
                raise ValueError(
                    f"calibration: expected text or token ids [sequences, tokens] int64, got "
                    f"{type(ids).__name__} {getattr(ids, 'shape', '')}"
                )
            if int(ids.min()) < 0 or int(ids.max()) >= config.vocab_size:
                raise ValueError(f"calibration: token ids must lie in [0, {config.vocab_size}) (vocab_size)")
    return QuantizePlan(
        Path(src), dst, family, config, headers, src_cfg, scheme, layout_obj, tech, ids, overwrite, unused
    )


def quantize_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    scheme: str | MoEQuantScheme,
    *,
    layout: str | None = None,
    calibration: str | torch.Tensor | None = None,
    technique: str | WeightTechnique | None = None,
    overwrite: bool = False,
    seq_len: int = CALIBRATION_SEQ_LEN,
    max_tokens: int = CALIBRATION_MAX_TOKENS,
    shard_bytes: int = SHARD_BYTES,
    progress: bool = False,
) -> QuantizeResult:
    """Quantize the experts of a bf16 checkpoint folder layer by layer into ``dst`` (module docstring).

    Args:
        src: a bf16 checkpoint folder of a registered family (``config.json`` and safetensors shards as
            transformers' ``save_pretrained`` writes them).
        dst: the folder to write: absent or empty, or anything with ``overwrite=True`` (replaced atomically).
        scheme: a ``mxlib.moe.MOE_SCHEMES`` name or object.
        layout: a ``LAYOUTS`` name; None: the family's own where it stores the scheme, else the scheme's
            default (``writer.resolve_layout``).
        calibration: calibration text (a ``str``: tokenized by ``src``'s tokenizer, ``calibration_token_ids``)
            or token ids ``[sequences, tokens]`` int64; needed by schemes with static activation scales.
        technique: a name of ``STREAMING_TECHNIQUES`` (or a composition ``"X+hadamard"``:
            ``mxlib.recovery.get_technique``) or a built ``WeightTechnique`` (a ``GPTQ`` built with the model's
            Hessians included); None is round-to-nearest.
        overwrite: replace a non-empty ``dst``.
        seq_len, max_tokens: how calibration text is cut (``calibration_token_ids``).
        shard_bytes: safetensors shard size of ``dst`` (also the most quantized bytes held in memory).
        progress: a tqdm bar on stderr, one step per decoder layer.

    Returns:
        ``QuantizeResult`` (its ``summary()`` is what ``mxlib quantize`` prints).

    Raises:
        CheckpointError: ``src`` refused (``read_source``); an unreadable tensor (naming it and its file).
        ValueError: an unknown scheme, layout or technique; a layout that does not store the scheme or the
            family's expert biases; a static-activation-scale scheme without ``calibration``; GPTQ; empty
            calibration text or no tokenizer; calibration token ids not ``[sequences, tokens]`` below the
            vocabulary; ``dst`` the source itself.
        FileExistsError: ``dst`` exists and is not empty, without ``overwrite``.

    On any error nothing is left at ``dst`` (or the old folder stays as it was).
    """
    plan = check_quantization(
        src,
        dst,
        scheme,
        layout=layout,
        calibration=calibration,
        technique=technique,
        overwrite=overwrite,
        seq_len=seq_len,
        max_tokens=max_tokens,
    )
    return plan.run(shard_bytes, progress)


@torch.no_grad()
def _run(plan: QuantizePlan, shard_bytes: int, progress: bool) -> QuantizeResult:
    t0 = time.perf_counter()
    src, dst, family, config, headers, src_cfg = (
        plan.src,
        plan.dst,
        plan.family,
        plan.config,
        plan.headers,
        plan.src_config,
    )
    scheme, layout_obj, tech, ids, overwrite = plan.scheme, plan.layout, plan.technique, plan.token_ids, plan.overwrite
    model = empty_moe_model(config, torch.bfloat16, "cpu", where="quantize_checkpoint")
    moe = family.moe_layer_indices(config)
    num_layers = config.num_hidden_layers
    reader = TensorReader(Path(src), headers)
    loader = _LayerLoader(reader, family, config)
    tied = tied_parameter_names(model)
    experts_part = f".{family.block_attr}.{family.experts_attr}."
    cal = Calibration(num_tokens=0 if ids is None else ids.numel(), layer_indices=[])
    uncalibrated: dict[int, list[int]] = {}
    logger.info("quantizing %s (%s, %d layers) as %s in layout %s", src, family.architecture, num_layers,
                scheme.name, layout_obj.name)  # fmt: skip

    def add_module(shards: ShardWriter, module: torch.nn.Module, prefix: str, skip: tuple[str, ...] = ()) -> None:
        """The module's non-expert tensors, as the writer stores them (``write_quantized_checkpoint``)."""
        for name, t in module.state_dict(prefix=f"{prefix}." if prefix else "").items():
            if experts_part in name or name in tied or name.startswith(skip):
                continue
            dtype = torch.float32 if family.keeps_fp32(name) else torch.bfloat16
            shards.add(family.disk_name(name), t.detach().to(dtype))

    with atomic_folder(dst, overwrite=overwrite) as tmp:
        shards = ShardWriter(tmp, shard_bytes)
        layers = model.model.layers
        outside = tuple(f"model.layers.{x}." for x in range(num_layers)) + ("lm_head.",)
        loader.load(model, "", skip=outside)  # the embedding, the final norm (and any other top-level tensor)
        add_module(shards, model, "", skip=outside)
        bar = tqdm(total=num_layers, desc="quantizing layers", unit="layer", disable=not progress)

        def finish_layer(x: int) -> None:
            layer = layers[x]
            add_module(shards, layer, f"model.layers.{x}")
            if x in moe:
                w13, w2 = expert_weights(model, x)
                in13 = in2 = None
                if scheme.static_activation_scale:
                    in13, in2 = cal.input_scales(x, scheme.activation)
                write_layer_experts(shards, family, layout_obj, scheme, x, w13, w2, expert_biases(model, x),
                                    in13, in2, tech)  # fmt: skip
                del w13, w2
            loader.drop(layer)
            bar.update()

        try:
            if ids is None:
                for x in range(num_layers):
                    loader.load(layers[x], f"model.layers.{x}")
                    finish_layer(x)
            else:
                _calibrate_and_write(model, family, ids, loader, cal, uncalibrated, finish_layer)
        finally:
            bar.close()
        loader.drop(model.model.embed_tokens)
        if not tied and getattr(model, "lm_head", None) is not None:
            loader.load(model.lm_head, "lm_head")
            add_module(shards, model.lm_head, "lm_head")
            loader.drop(model.lm_head)
        shards.close()
        reader.close()
        cfg = stored_config(src_cfg, family, num_layers)
        write_config_files(tmp, cfg, layout_obj, scheme, unquantized_modules(model, family, []), tech)
        copied = copy_model_files(Path(src), tmp)
        written = sum(p.stat().st_size for p in tmp.glob("*.safetensors"))
    return QuantizeResult(
        path=dst,
        architecture=family.architecture,
        layers=num_layers,
        moe_layers=moe,
        num_experts=family.num_experts(config),
        scheme=scheme.name,
        layout=layout_obj.name,
        technique="rtn" if tech is None else tech.name,
        calibration_tokens=0 if ids is None else ids.numel(),
        calibration_shape=None if ids is None else list(ids.shape),
        uncalibrated=uncalibrated,
        calibration_unused=plan.calibration_unused,
        bytes_read=loader.bytes_read,
        bytes_written=written,
        copied=copied,
        seconds=time.perf_counter() - t0,
    )


def _calibrate_and_write(model, family: MoEFamily, ids, loader: _LayerLoader, cal, uncalibrated, finish_layer):
    """One forward of the base model on ``ids`` that reads each decoder layer just before it runs (a forward
    pre-hook, the recording twin swapped in for its experts) and records, quantizes, writes and drops it just
    after (a forward hook)."""
    layers = model.model.layers
    moe = set(family.moe_layer_indices(model.config))
    twins: dict[int, tuple[torch.nn.Module, torch.nn.Module]] = {}

    def before(x):
        def hook(module, args, kwargs=None):
            loader.load(module, f"model.layers.{x}")
            if x in moe:
                block = getattr(module, family.block_attr)
                twin = recording_experts(model, x)
                twins[x] = (getattr(block, family.experts_attr), twin)
                setattr(block, family.experts_attr, twin)

        return hook

    def after(x):
        def hook(module, args, output):
            if x in moe:
                block = getattr(module, family.block_attr)
                original, twin = twins.pop(x)
                setattr(block, family.experts_attr, original)
                stats = twin.statistics()
                cal.layers.append(stats)
                cal.layer_indices.append(x)
                idle = (stats.tokens == 0).nonzero().reshape(-1).tolist()
                if idle:
                    uncalibrated[x] = idle
            finish_layer(x)

        return hook

    hooks = []
    try:
        for x, layer in enumerate(layers):
            hooks.append(layer.register_forward_pre_hook(before(x)))
            hooks.append(layer.register_forward_hook(after(x)))
        model.model(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    if len(cal.layer_indices) != len(moe):  # pragma: no cover  a family whose forward skips a layer
        raise RuntimeError(f"calibration reached layers {cal.layer_indices}, expected {sorted(moe)}")
