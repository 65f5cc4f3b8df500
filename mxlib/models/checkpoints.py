"""Quantized Qwen3-MoE checkpoints in the real on-disk layouts, and the loader for them.

Two layouts, both per-expert tensors in sharded safetensors with an index, as the
published checkpoints have them:

**NVIDIA ModelOpt NVFP4** (e.g. ``nvidia/Qwen3-30B-A3B-NVFP4``), for every expert ``e``
of layer ``L`` and projection ``p`` in ``gate_proj, up_proj, down_proj``::

    model.layers.L.mlp.experts.e.p.weight          uint8          [out, in/2]   two e2m1 codes a byte
    model.layers.L.mlp.experts.e.p.weight_scale    float8_e4m3fn  [out, in/16]  block scales
    model.layers.L.mlp.experts.e.p.weight_scale_2  float32        []            amax / (6 * 448)
    model.layers.L.mlp.experts.e.p.input_scale     float32        []            calibrated amax / (6 * 448)

with ``quantization_config`` in ``config.json`` (``quant_method: modelopt``,
``quant_algo: NVFP4``, ``config_groups``, ``ignore``) and the older
``hf_quant_config.json`` (``quantization.exclude_modules``); the loader accepts either.
ModelOpt gives gate and up one shared ``weight_scale_2`` (from the larger amax) so that
they can be fused; the writer does the same.

**AMD Quark OCP MX**: ``...e.p.weight`` uint8 packed (FP4 ``[out, in/2]``, FP6
``[out, 3*in/4]``), ``...e.p.weight_scale`` uint8 E8M0 ``[out, in/32]``, and
``...e.p.input_scale`` float32 ``[]`` for static FP8 activations only, with
``quantization_config.quant_method: quark`` (``global_quant_config`` weight /
input_tensors, ``exclude``, ``export``).

Everything the emulation does not quantize (embeddings, attention, norms, the router
``mlp.gate``, ``lm_head``) is bf16 under its usual transformers name and listed in the
ignore / exclude list. Writes go to a temporary folder renamed into place at the end,
so a failed write leaves no half-written checkpoint.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import uuid
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..moe.experts import (
    Nvfp4QuantizationEmulationTritonExperts,
    OCP_MXQuantizationEmulationTritonExperts,
    TritonExperts,
    ops_for_device,
)
from ..moe.schemes import FP8_PER_TENSOR, MoEQuantScheme, get_moe_scheme
from .calibration import Calibration
from .qwen3 import empty_qwen3_moe, expert_weights, swap_experts

__all__ = [
    "CheckpointError",
    "write_quantized_checkpoint",
    "load_quantized_qwen3_moe",
    "read_quant_config",
    "checkpoint_size_bytes",
]

PROJS = ("gate_proj", "up_proj", "down_proj")
_QUARK_DTYPE = {"mxfp4": "fp4", "mxfp6_e2m3": "fp6_e2m3", "mxfp6_e3m2": "fp6_e3m2"}
_QUARK_TO_SCHEME = {v: k for k, v in _QUARK_DTYPE.items()}
_SHARD_BYTES = 2 * 1024**3


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing tensor, wrong shape or dtype, unsupported config."""


# ----------------------------------------------------------------------------- writing


def _exclude_list_modelopt() -> list[str]:
    return ["lm_head", "model.layers.*.mlp.gate", "model.layers.*.self_attn*"]


def _exclude_list_quark() -> list[str]:
    return ["lm_head", "re:.*mlp.gate$", "re:.*self_attn.*"]


def _quark_tensor_config(act: str | None, scale_mode: str) -> dict | None:
    if act is None:
        return None
    if act == FP8_PER_TENSOR:
        return {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "ch_axis": None, "group_size": None,
                "is_dynamic": False, "symmetric": True, "round_method": "half_even", "scale_type": "float",
                "scale_format": None, "scale_calculation_mode": None, "mx_element_dtype": None,
                "observer_cls": "PerTensorMinMaxObserver", "is_scale_quant": False, "block_size": None}
    return {"dtype": _QUARK_DTYPE[act], "qscheme": "per_group", "ch_axis": -1, "group_size": 32,
            "is_dynamic": True, "symmetric": None, "round_method": "half_even", "scale_type": "float",
            "scale_format": "e8m0", "scale_calculation_mode": scale_mode, "mx_element_dtype": None,
            "observer_cls": "PerBlockMXObserver", "is_scale_quant": False, "block_size": None}


def _quant_config(scheme: MoEQuantScheme) -> tuple[dict, dict | None]:
    """(quantization_config for config.json, hf_quant_config.json or None)."""
    if scheme.name == "nvfp4":
        group = {"type": "float", "num_bits": 4, "group_size": 16, "dynamic": False}
        qc = {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "producer": {"name": "modelopt", "version": "mxlib-dummy"},
            "ignore": _exclude_list_modelopt(),
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": dict(group),
                                          "input_activations": dict(group)}},
            "kv_cache_scheme": None,
        }
        legacy = {
            "producer": {"name": "modelopt", "version": "mxlib-dummy"},
            "quantization": {"quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None,
                             "exclude_modules": _exclude_list_modelopt()},
        }
        return qc, legacy
    weight = _quark_tensor_config(scheme.weight, "even")
    weight["is_dynamic"] = False
    qc = {
        "quant_method": "quark",
        "global_quant_config": {"weight": weight, "input_tensors": _quark_tensor_config(scheme.activation, "even"),
                                "output_tensors": None, "bias": None, "target_device": None},
        "exclude": _exclude_list_quark(),
        "layer_quant_config": {},
        "layer_type_quant_config": {},
        "kv_cache_quant_config": {},
        "algo_config": None,
        "quant_mode": "eager_mode",
        "export": {"weight_format": "real_quantized", "pack_method": "reorder", "kv_cache_group": [],
                   "min_kv_scale": 0.0, "weight_merge_groups": None},
        "version": "mxlib-dummy",
    }
    return qc, None


def _expert_tensors(scheme: MoEQuantScheme, w13, w2, calib: Calibration | None, layer: int, prefix: str):
    """Quantize one layer's experts; yield (name, tensor) in checkpoint layout."""
    e, two_i, _ = w13.shape
    i = two_i // 2
    ops = ops_for_device(w13.device)
    out: dict[str, torch.Tensor] = {}
    if scheme.name == "nvfp4":
        if calib is None:
            raise ValueError("nvfp4 checkpoints need activation input scales: pass a Calibration")
        p13, s13, g13 = ops.quantize_nvfp4(w13)  # one weight_scale_2 for gate and up, as ModelOpt
        p2, s2, g2 = ops.quantize_nvfp4(w2)
        in13, in2 = calib.input_scales(layer, "nvfp4")
        for x in range(e):
            for proj, rows, p, s, g, ins in (
                ("gate_proj", slice(0, i), p13, s13, g13, in13),
                ("up_proj", slice(i, 2 * i), p13, s13, g13, in13),
                ("down_proj", slice(None), p2, s2, g2, in2),
            ):
                base = f"{prefix}.{x}.{proj}"
                out[f"{base}.weight"] = p[x, rows].contiguous().cpu()
                out[f"{base}.weight_scale"] = s[x, rows].contiguous().cpu()
                out[f"{base}.weight_scale_2"] = g[x].reshape(()).float().cpu().clone()
                out[f"{base}.input_scale"] = ins[x].reshape(()).float().cpu().clone()
        return out
    el = scheme.weight_scheme.element.name
    p13, s13 = ops.quantize_mx(w13, el, 32, "even")
    p2, s2 = ops.quantize_mx(w2, el, 32, "even")
    if scheme.activation == FP8_PER_TENSOR:
        if calib is None:
            raise ValueError(f"{scheme.name} has static FP8 activations: pass a Calibration")
        in13, in2 = calib.input_scales(layer, "fp8")
    for x in range(e):
        for proj, rows, p, s in (("gate_proj", slice(0, i), p13, s13), ("up_proj", slice(i, 2 * i), p13, s13),
                                 ("down_proj", slice(None), p2, s2)):
            base = f"{prefix}.{x}.{proj}"
            out[f"{base}.weight"] = p[x, rows].contiguous().cpu()
            out[f"{base}.weight_scale"] = s[x, rows].contiguous().cpu()
            if scheme.activation == FP8_PER_TENSOR:
                ins = in2 if proj == "down_proj" else in13
                out[f"{base}.input_scale"] = ins[x].reshape(()).float().cpu().clone()
    return out


def _config_dict(model, num_hidden_layers: int) -> dict:
    cfg = model.config.to_dict()
    cfg["num_hidden_layers"] = num_hidden_layers
    cfg["architectures"] = ["Qwen3MoeForCausalLM"]
    cfg["torch_dtype"] = "bfloat16"
    cfg.pop("quantization_config", None)
    return cfg


def write_quantized_checkpoint(
    model,
    scheme: str,
    path: str | os.PathLike,
    calibration: Calibration | None = None,
    shard_bytes: int = _SHARD_BYTES,
) -> Path:
    """Quantize a bf16 Qwen3-MoE model's experts and write the checkpoint.

    Args:
        model: transformers ``Qwen3MoeForCausalLM`` holding bf16 experts.
        scheme: ``nvfp4`` (ModelOpt layout) or a Quark OCP MX scheme (Quark layout).
        path: the checkpoint folder (replaced if it exists).
        calibration: per-expert activation amax (``mxlib.models.calibration.calibrate``);
            needed by ``nvfp4`` and the ``_a_fp8`` schemes for their ``input_scale``.
        shard_bytes: safetensors shard size.

    Returns:
        The folder's path. On any error nothing is left at ``path`` (or the old checkpoint stays).
    """
    scheme_ = get_moe_scheme(scheme)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        num_layers = len(model.model.layers)
        state = {}
        for name, t in model.state_dict().items():
            if ".mlp.experts." in name:
                continue
            state[name] = t.detach().to(torch.bfloat16).contiguous().cpu()
        for layer in range(num_layers):
            w13, w2 = expert_weights(model, layer)
            state.update(_expert_tensors(scheme_, w13, w2, calibration, layer, f"model.layers.{layer}.mlp.experts"))
        _write_shards(state, tmp, shard_bytes)
        cfg = _config_dict(model, num_layers)
        qc, legacy = _quant_config(scheme_)
        cfg["quantization_config"] = qc
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
        if legacy is not None:
            (tmp / "hf_quant_config.json").write_text(json.dumps(legacy, indent=2))
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
    return path


def _write_shards(state: dict[str, torch.Tensor], folder: Path, shard_bytes: int) -> None:
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
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def checkpoint_size_bytes(path: str | os.PathLike) -> int:
    """Bytes of all safetensors files in a checkpoint folder."""
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


# ----------------------------------------------------------------------------- reading


class _Tensors:
    """Name -> tensor access over a single file or an index of shards."""

    def __init__(self, folder: Path):
        index = folder / "model.safetensors.index.json"
        if index.exists():
            self.weight_map = json.loads(index.read_text())["weight_map"]
        elif (folder / "model.safetensors").exists():
            with safe_open(str(folder / "model.safetensors"), "pt") as f:
                self.weight_map = {k: "model.safetensors" for k in f.keys()}
        else:
            raise CheckpointError(f"{folder}: no model.safetensors or model.safetensors.index.json")
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


def _matches(name: str, patterns: list[str]) -> bool:
    for p in patterns:
        if p.startswith("re:"):
            if re.fullmatch(p[3:], name):
                return True
        elif fnmatch.fnmatchcase(name, p) or name == p:
            return True
    return False


def read_quant_config(folder: str | os.PathLike) -> dict:
    """Parse and validate a checkpoint's quantization config.

    Returns ``{"format": "modelopt" | "quark", "scheme": MoEQuantScheme, "exclude": [...],
    "activation_scale_mode": str}``.

    Raises:
        CheckpointError: unknown method, or a config the emulation cannot honour; the message
            names the field, the value found and what is supported.
    """
    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{folder}: config.json not found")
    cfg = json.loads(cfg_path.read_text())
    qc = cfg.get("quantization_config")
    legacy_path = folder / "hf_quant_config.json"
    if qc is None and legacy_path.exists():
        legacy = json.loads(legacy_path.read_text())
        q = legacy.get("quantization", {})
        qc = {"quant_method": "modelopt", "quant_algo": q.get("quant_algo"), "group_size": q.get("group_size"),
              "ignore": q.get("exclude_modules", [])}
    if qc is None:
        raise CheckpointError(f"{folder}: no quantization_config in config.json and no hf_quant_config.json")
    method = qc.get("quant_method")
    if method == "modelopt":
        return _read_modelopt(qc)
    if method == "quark":
        return _read_quark(qc)
    raise CheckpointError(f"quantization_config.quant_method: expected 'modelopt' or 'quark', found {method!r}")


def _read_modelopt(qc: dict) -> dict:
    algo = qc.get("quant_algo")
    if algo != "NVFP4":
        raise CheckpointError(f"quantization_config.quant_algo: only 'NVFP4' is supported, found {algo!r}")
    group_size = qc.get("group_size")
    for gname, group in (qc.get("config_groups") or {}).items():
        for part in ("weights", "input_activations"):
            g = group.get(part) or {}
            if g.get("group_size") is not None:
                group_size = g["group_size"]
                if g["group_size"] != 16:
                    raise CheckpointError(
                        f"quantization_config.config_groups.{gname}.{part}.group_size: NVFP4 uses 16, found {g['group_size']}"
                    )
            if g.get("num_bits") not in (None, 4):
                raise CheckpointError(f"quantization_config.config_groups.{gname}.{part}.num_bits: expected 4, found {g['num_bits']}")
    if group_size not in (None, 16):
        raise CheckpointError(f"quantization_config.group_size: NVFP4 uses 16, found {group_size}")
    exclude = list(qc.get("ignore") or qc.get("exclude_modules") or [])
    return {"format": "modelopt", "scheme": get_moe_scheme("nvfp4"), "exclude": exclude, "activation_scale_mode": None}


def _read_quark(qc: dict) -> dict:
    g = qc.get("global_quant_config") or {}
    w = g.get("weight")
    if not w:
        raise CheckpointError("quantization_config.global_quant_config.weight: missing")
    wdtype = w.get("dtype")
    if wdtype not in _QUARK_TO_SCHEME:
        raise CheckpointError(
            f"quantization_config.global_quant_config.weight.dtype: supported {sorted(_QUARK_TO_SCHEME)}, found {wdtype!r}"
        )
    for field, want in (("qscheme", "per_group"), ("group_size", 32), ("scale_format", "e8m0")):
        if w.get(field) != want:
            raise CheckpointError(
                f"quantization_config.global_quant_config.weight.{field}: the emulation supports {want!r}, found {w.get(field)!r}"
            )
    if w.get("ch_axis", -1) not in (-1, 1):
        raise CheckpointError(f"quantization_config.global_quant_config.weight.ch_axis: expected -1, found {w.get('ch_axis')!r}")
    a = g.get("input_tensors")
    act = None
    mode = "even"
    if a:
        adtype = a.get("dtype")
        if adtype == "fp8_e4m3":
            if a.get("qscheme") != "per_tensor" or a.get("is_dynamic"):
                raise CheckpointError(
                    "quantization_config.global_quant_config.input_tensors: fp8_e4m3 is supported as static "
                    f"per_tensor only, found qscheme={a.get('qscheme')!r} is_dynamic={a.get('is_dynamic')!r}"
                )
            act = "fp8"
        elif adtype in _QUARK_TO_SCHEME:
            for field, want in (("qscheme", "per_group"), ("group_size", 32), ("scale_format", "e8m0")):
                if a.get(field) != want:
                    raise CheckpointError(
                        f"quantization_config.global_quant_config.input_tensors.{field}: the emulation supports "
                        f"{want!r}, found {a.get(field)!r}"
                    )
            if not a.get("is_dynamic", True):
                raise CheckpointError("quantization_config.global_quant_config.input_tensors.is_dynamic: MX activations must be dynamic (true), found false")
            mode = a.get("scale_calculation_mode") or "even"
            if mode not in ("even", "floor", "rceil"):
                raise CheckpointError(
                    f"quantization_config.global_quant_config.input_tensors.scale_calculation_mode: supported "
                    f"['even', 'floor', 'rceil'], found {mode!r}"
                )
            act = _QUARK_TO_SCHEME[adtype]
        else:
            raise CheckpointError(
                f"quantization_config.global_quant_config.input_tensors.dtype: supported "
                f"{sorted(_QUARK_TO_SCHEME) + ['fp8_e4m3']}, found {adtype!r}"
            )
    name = "w_" + _QUARK_TO_SCHEME[wdtype] + ("" if act is None else "_a_" + act)
    try:
        scheme = get_moe_scheme(name)
    except ValueError:
        raise CheckpointError(
            f"quantization_config.global_quant_config: weight {wdtype!r} with input_tensors {a.get('dtype') if a else None!r} "
            f"is not a supported Quark MoE scheme (supported: w_mxfp4*, w_mxfp6_e3m2*, w_mxfp6_e2m3* as listed in mxlib.moe.schemes)"
        ) from None
    for key, override in (qc.get("layer_quant_config") or {}).items():
        if override.get("weight") != w or override.get("input_tensors") != a:
            raise CheckpointError(
                f"quantization_config.layer_quant_config[{key!r}]: per-layer overrides are not supported by the "
                f"emulation (found {json.dumps(override)[:120]}); only the global config is"
            )
    if qc.get("layer_type_quant_config"):
        raise CheckpointError(
            f"quantization_config.layer_type_quant_config: per-type overrides are not supported, found "
            f"{list(qc['layer_type_quant_config'])}"
        )
    exp = qc.get("export") or {}
    if exp.get("weight_format", "real_quantized") != "real_quantized":
        raise CheckpointError(f"quantization_config.export.weight_format: expected 'real_quantized', found {exp.get('weight_format')!r}")
    return {"format": "quark", "scheme": scheme, "exclude": list(qc.get("exclude") or []), "activation_scale_mode": mode}


def _experts_excluded(exclude: list[str], layer: int) -> bool:
    names = [f"model.layers.{layer}.mlp.experts.0.{p}" for p in PROJS]
    return all(_matches(n, exclude) for n in names)


@torch.no_grad()
def load_quantized_qwen3_moe(
    path: str | os.PathLike,
    num_hidden_layers: int | None = None,
    device: str | torch.device = "cpu",
    backend: str = "auto",
    scale_strategy: str = "max",
    activation_dtype: torch.dtype = torch.bfloat16,
):
    """Load a ModelOpt NVFP4 or Quark OCP MX Qwen3-MoE checkpoint with emulation experts.

    Reads ``config.json`` (and ``hf_quant_config.json``), validates the quantization config,
    builds transformers' ``Qwen3MoeForCausalLM`` (``num_hidden_layers`` overrides the
    checkpoint's, as vLLM's ``hf_overrides`` does), loads every bf16 tensor, and gives each
    layer an ``Nvfp4QuantizationEmulationTritonExperts`` or ``OCP_MXQuantizationEmulationTritonExperts``
    built from the per-expert tensors.

    Returns:
        ``(model, info)`` where ``info`` is the parsed quantization config.

    Raises:
        CheckpointError: missing tensors, wrong shapes or dtypes, unsupported configs, quantized
            modules outside the experts (the emulation covers MoE experts only).
    """
    from transformers import Qwen3MoeConfig

    folder = Path(path)
    info = read_quant_config(folder)
    cfg_dict = json.loads((folder / "config.json").read_text())
    cfg_dict.pop("quantization_config", None)
    ckpt_layers = cfg_dict.get("num_hidden_layers")
    if num_hidden_layers is not None:
        if num_hidden_layers > ckpt_layers:
            raise CheckpointError(f"num_hidden_layers={num_hidden_layers} exceeds the checkpoint's {ckpt_layers}")
        cfg_dict["num_hidden_layers"] = num_hidden_layers
    config = Qwen3MoeConfig(**{k: v for k, v in cfg_dict.items() if k not in ("architectures", "transformers_version")})
    device = torch.device(device)
    # Parameters are allocated but never written (no pages touched) until loaded below;
    # the experts' fused bf16 parameters are replaced without ever being paged in.
    model = empty_qwen3_moe(config, torch.bfloat16, "cpu")
    tensors = _Tensors(folder)
    scheme = info["scheme"]
    exclude = info["exclude"]

    for name, p in model.named_parameters():
        if ".mlp.experts." in name:
            continue
        module = name.rsplit(".", 1)[0]
        if f"{module}.weight_scale" in tensors and not _matches(module, exclude):
            raise CheckpointError(
                f"{module} is quantized in this checkpoint; mxlib emulates the MoE experts only, so it must be "
                f"bf16 and listed in the ignore/exclude list"
            )
        p.data = tensors.get(name, tuple(p.shape), torch.bfloat16).to(device)

    def make(layer: int):
        prefix = f"model.layers.{layer}.mlp.experts"
        if _experts_excluded(exclude, layer):
            return _bf16_experts(tensors, prefix, config, device, backend)
        return _emulation_experts(tensors, prefix, config, scheme, info, device, backend, scale_strategy, activation_dtype)

    swap_experts(model, make)
    return model.to(device).eval(), info


def _stack(tensors: _Tensors, names: list[str], shape, dtype) -> torch.Tensor:
    return torch.stack([tensors.get(n, shape, dtype) for n in names])


def _bf16_experts(tensors, prefix, config, device, backend):
    e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
    gate = _stack(tensors, [f"{prefix}.{x}.gate_proj.weight" for x in range(e)], (i, h), torch.bfloat16)
    up = _stack(tensors, [f"{prefix}.{x}.up_proj.weight" for x in range(e)], (i, h), torch.bfloat16)
    down = _stack(tensors, [f"{prefix}.{x}.down_proj.weight" for x in range(e)], (h, i), torch.bfloat16)
    return TritonExperts(torch.cat([gate, up], 1).to(device), down.to(device), backend=backend)


def _emulation_experts(tensors, prefix, config, scheme, info, device, backend, scale_strategy, activation_dtype):
    e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
    names = lambda proj, what: [f"{prefix}.{x}.{proj}.{what}" for x in range(e)]  # noqa: E731
    if scheme.name == "nvfp4":
        f8 = torch.float8_e4m3fn
        w = {p: _stack(tensors, names(p, "weight"), (i, h // 2) if p != "down_proj" else (h, i // 2), torch.uint8) for p in PROJS}
        s = {p: _stack(tensors, names(p, "weight_scale"), (i, h // 16) if p != "down_proj" else (h, i // 16), f8) for p in PROJS}
        g = {p: _stack(tensors, names(p, "weight_scale_2"), (), torch.float32) for p in PROJS}
        ins = {p: _stack(tensors, names(p, "input_scale"), (), torch.float32) for p in PROJS}
        g13 = torch.stack([g["gate_proj"], g["up_proj"]], 1)
        in13 = torch.maximum(ins["gate_proj"], ins["up_proj"])
        return Nvfp4QuantizationEmulationTritonExperts(
            torch.cat([w["gate_proj"], w["up_proj"]], 1).to(device),
            torch.cat([s["gate_proj"], s["up_proj"]], 1).to(device),
            g13.to(device),
            w["down_proj"].to(device), s["down_proj"].to(device), g["down_proj"].to(device),
            in13.to(device), ins["down_proj"].to(device),
            scale_strategy=scale_strategy, activation_dtype=activation_dtype, backend=backend,
        )
    fmt = scheme.weight_scheme.element
    w = {p: _stack(tensors, names(p, "weight"),
                   (i, fmt.packed_size(h)) if p != "down_proj" else (h, fmt.packed_size(i)), torch.uint8) for p in PROJS}
    s = {p: _stack(tensors, names(p, "weight_scale"), (i, h // 32) if p != "down_proj" else (h, i // 32), torch.uint8)
         for p in PROJS}
    kw = {}
    if scheme.activation == FP8_PER_TENSOR:
        ins = {p: _stack(tensors, names(p, "input_scale"), (), torch.float32) for p in PROJS}
        kw = dict(w13_input_scale=torch.maximum(ins["gate_proj"], ins["up_proj"]).to(device),
                  w2_input_scale=ins["down_proj"].to(device))
    return OCP_MXQuantizationEmulationTritonExperts(
        scheme,
        torch.cat([w["gate_proj"], w["up_proj"]], 1).to(device),
        torch.cat([s["gate_proj"], s["up_proj"]], 1).to(device),
        w["down_proj"].to(device), s["down_proj"].to(device),
        activation_scale_mode=info["activation_scale_mode"] or "even",
        activation_dtype=activation_dtype, backend=backend, **kw,
    )
