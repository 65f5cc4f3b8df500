"""Reading a quantized MoE checkpoint (any registered family and layout): its config, then the model.

``read_quant_config(folder)`` parses and validates the quantization config through the layout of
its ``quant_method`` (``layout.layout_for_method``); ``load_quantized_moe(path)`` builds the
transformers class of the family ``config.json`` names (``mxlib.models.families``: Qwen3-MoE,
Mixtral, OLMoE, Qwen2-MoE, DeepSeek-V3), reads every tensor under the family's on-disk name
(``MoEFamily.disk_name``: Mixtral's ``block_sparse_moe.experts.e.w1``), loads every bf16 tensor
(``safetensors_io.TensorReader``: every tensor checked, every error a ``CheckpointError`` naming
the file and the tensor) and gives each layer the scheme's emulation experts built from the tensors the layout reads.
Quantized ``nn.Linear`` modules outside the experts (attention projections not in the ignore
list) become ``mxlib.moe.linear.EmulatedLinear``.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import replace

import torch
from tqdm import tqdm

from .._checks import check_device
from ..models.families import MoEFamily, check_supported_checkpoint
from ..models.moe_models import empty_moe_model, expert_activation, swap_experts
from ..moe.base import ACTIVATION_DTYPES, BACKENDS, TritonExperts
from ..moe.factory import make_emulated_linear, make_emulation_experts
from ..recovery import RECOVERY_CONFIG_KEY
from ..recovery.gate_up import check_gate_up_mode, reconcile_gate_up
from ..recovery.hadamard import rotation_from_config
from .bounds import check_model_config, check_model_fields, check_scale_strategy
from .files.folder import CheckpointFolder
from .files.headers import UnusedTensorsWarning, describe_unused, folder_identity
from .files.safetensors_io import SafetensorsHeaders, TensorReader
from .layout import PROJS, CheckpointDescription, CheckpointError, check_exclude_patterns, matches
from .layouts import LAYOUTS, layout_for_method  # the registry with mxlib's layouts registered
from .precision import experts_description, module_classes, module_description
from .saving import _attach, read_checkpoint_source

__all__ = ["read_quant_config", "load_quantized_moe", "load_quantized_qwen3_moe", "check_scale_strategy"]

logger = logging.getLogger(__name__)


def read_quant_config(folder: str | os.PathLike) -> CheckpointDescription:
    """Parse and validate a checkpoint's quantization config.

    Reads ``config.json``'s ``quantization_config`` (or, without one, a layout's legacy file such
    as ModelOpt's ``hf_quant_config.json``) and hands it to the layout of its ``quant_method``.
    ``folder`` may be a ``files.folder.CheckpointFolder``, whose files are then not read again.

    Returns:
        ``CheckpointDescription`` (``format``, ``scheme``, ``exclude``, ``activation_scale_mode``;
        also readable as ``info["scheme"]``).

    Raises:
        CheckpointError: a missing or unreadable config file (named), unknown method, or a config
            the emulation cannot honour; the message names the file, the field, the value found
            and what is supported.
    """
    folder = CheckpointFolder.of(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{folder}: config.json not found")
    qc = folder.config().get("quantization_config")
    source = cfg_path
    if qc is None:
        for lay in LAYOUTS.values():
            try:
                qc = lay.read_legacy(folder)
            except CheckpointError:
                raise
            except (ValueError, OSError, AttributeError, TypeError) as err:
                raise CheckpointError(
                    f"{folder}: legacy quantization config of layout {lay.name} cannot be read "
                    f"({type(err).__name__}: {err})"
                ) from None
            if qc is not None:
                source = folder
                break
    if qc is None:
        raise CheckpointError(f"{folder}: no quantization_config in config.json and no legacy quantization config file")
    if not isinstance(qc, dict):
        raise CheckpointError(
            f"{cfg_path}: quantization_config: expected an object, found {type(qc).__name__} {str(qc)[:80]!r}"
        )
    try:
        info = layout_for_method(qc.get("quant_method")).read_config(qc)
    except CheckpointError as err:
        raise CheckpointError(f"{source}: {err}") from None
    except (AttributeError, TypeError, KeyError, ValueError) as err:  # a field of the wrong JSON type
        raise CheckpointError(f"{source}: quantization_config is malformed ({type(err).__name__}: {err})") from None
    check_exclude_patterns(info.exclude, f"{source}: quantization_config exclude/ignore list")
    return info


def _read_model_config(folder: CheckpointFolder) -> dict:
    cfg = folder.config()
    check_model_fields(cfg, folder / "config.json")
    return cfg


def _experts_excluded(exclude: list[str], layer: int, family: MoEFamily) -> bool:
    """Whether the exclude list (of on-disk names) leaves decoder layer ``layer``'s experts bf16."""
    return all(matches(family.disk_name(f"{family.experts_prefix(layer)}.0.{p}"), exclude) for p in PROJS)


@torch.no_grad()
def load_quantized_moe(
    path: str | os.PathLike,
    num_hidden_layers: int | None = None,
    device: str | torch.device = "cpu",
    backend: str = "auto",
    scale_strategy: str = "max",
    activation_dtype: torch.dtype = torch.bfloat16,
    progress: bool = False,
    gate_up_scale: str = "per_half",
    where: str = "load_quantized_moe",
):
    """Load a quantized MoE checkpoint (any registered family and layout) with emulation experts.

    Reads ``config.json`` (and legacy config files), validates the quantization config,
    builds the transformers class of the family its ``architectures`` name
    (``mxlib.models.families.family_of``; ``Qwen3MoeForCausalLM`` when it names none), loads every bf16 tensor,
    and gives each layer the scheme's emulation experts (``mxlib.moe.factory.make_emulation_experts``) built
    from the per-expert tensors the layout reads. ``mxlib.from_pretrained`` is the same load under
    transformers' keyword names (``dtype``, ``device_map``), returning the model alone.

    Args:
        path: a local checkpoint folder (``config.json`` and safetensors shards).
        num_hidden_layers: load only the first layers (vLLM's ``hf_overrides`` does the same); None: all.
        device: where the model goes (``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a ``torch.device``); a CUDA device
            on a torch without CUDA is refused before anything is read.
        backend: the experts' backend, ``auto`` / ``torch`` / ``triton`` / ``fused`` (``mxlib.moe.base``).
        scale_strategy: how NVFP4 per-expert activation scales become the one scale vLLM uses
            (``mxlib.moe.scales``: ``max``, vLLM's, by default).
        activation_dtype: the experts' activation dtype: bf16 (vLLM's numerics, the default), fp16 or fp32
            (``docs/numerics.md``); the rest of the model stays bf16 (``mxlib.from_pretrained(dtype=...)`` casts
            it too).
        progress: a tqdm bar on stderr, one step per layer of experts read.
        gate_up_scale: how NVFP4 gate and up halves with different ``weight_scale_2`` are run
            (``mxlib.recovery.gate_up``): ``per_half`` (each its own), ``gate`` (vLLM's), ``requantize_max``;
            with the last two the experts hold, and ``save_pretrained`` writes, the reconciled scales.
        where: the public entry a refusal names (``load_quantized_qwen3_moe`` passes its own).

    Returns:
        A pair ``(model, info)``: the transformers model in eval mode, and the ``CheckpointDescription`` of the
        checkpoint (layout name, scheme, exclude list, activation scale rule), also held as ``model.mxlib_info``.

        The model carries its checkpoint (``saving.attach_checkpoint_layout``): ``state_dict()`` holds the
        experts under the checkpoint's tensor names, ``load_state_dict`` restores them, and
        ``model.save_pretrained(path)`` writes the checkpoint in its layout, bit for bit. Dtype casts
        (``model.half()``, ``.float()``, ``.to(dtype)``) change the activation dtype only: quantized codes and
        scales keep their bytes (``mxlib.moe.base.keep_dtype_on_cast``).

    Quantized ``nn.Linear`` modules outside the experts (attention projections carrying the
    layout's quantized tensors and not in the ignore list) become ``EmulatedLinear``
    (``mxlib.moe.factory.make_emulated_linear``): dequantized weight, QDQ'd input with the
    checkpoint's activation scale.

    Raises:
        CheckpointError: missing tensors, wrong shapes or dtypes, invalid scale values, unreadable
            files, unsupported configs (a rotation of an unknown kind, a block size not dividing H and I,
            missing signs: ``quantization_config.mxlib_recovery``), quantized modules that are not linear layers, fused
            unquantized experts (a Quark export made without ``preprocess_for_quantization``); the
            message names the file and the tensor or field.
        ValueError: an unknown ``backend`` or ``gate_up_scale``, a ``num_hidden_layers`` that is not a positive integer,
            an unknown ``scale_strategy`` (checked before anything is read), or a ``scale_strategy`` other
            than ``max`` for a scheme whose experts cannot apply it (``check_scale_strategy``).

    The family's own routers, shared experts (Qwen2-MoE's gated ``shared_expert``, DeepSeek-V3's
    ``shared_experts``) and dense MLP layers are loaded as stored (bf16, or float32 where the family
    keeps them so: DeepSeek-V3's router weight and ``e_score_correction_bias``); only the routed
    experts of the MoE layers (``MoEFamily.moe_layer_indices``) become emulation experts.

    Every tensor of the checkpoint is used, or named: tensors the config does not account for (an expert
    index past ``num_experts``, a layer past ``num_hidden_layers``, a suffix the layout does not read, a
    tensor a shard stores that the index leaves out) are not loaded, and an ``UnusedTensorsWarning`` names them
    (layers cut off by a ``num_hidden_layers`` override excepted). The files are read as one checkpoint even
    while the folder is replaced (``SafetensorsHeaders``): the old model, or a ``CheckpointError``.

    Every size of ``config.json`` is checked against the safetensors headers before any tensor is
    allocated (``bounds.check_model_config``): a config naming more layers, a larger hidden size or
    more experts than the files hold is refused in milliseconds, naming the field. With
    ``tie_word_embeddings`` the output head is the input embedding (``lm_head.weight`` need not be
    stored; a stored one is not read), as transformers ties it.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {list(BACKENDS)}, got {backend!r}")
    check_gate_up_mode(gate_up_scale)
    if num_hidden_layers is not None and (
        not isinstance(num_hidden_layers, int) or isinstance(num_hidden_layers, bool) or num_hidden_layers < 1
    ):
        raise ValueError(f"num_hidden_layers: expected a positive integer or None, got {num_hidden_layers!r}")
    check_scale_strategy(scale_strategy)
    device = check_device(device, "device")
    if activation_dtype not in ACTIVATION_DTYPES:
        raise TypeError(
            f"activation_dtype: expected one of {[str(d) for d in ACTIVATION_DTYPES]}, got {activation_dtype!r}"
        )
    folder = CheckpointFolder(path)  # each config file read once, whatever the steps reading it
    since = folder_identity(folder)  # every file read below must come from this folder (SafetensorsHeaders)
    family = check_supported_checkpoint(folder, where, folder.read_json, CheckpointError)
    info = read_quant_config(folder)
    check_scale_strategy(scale_strategy, info.scheme)
    cfg_path = folder / "config.json"
    cfg_dict = _read_model_config(folder)
    qc = cfg_dict.pop("quantization_config", None)
    ckpt_layers = cfg_dict["num_hidden_layers"]
    if num_hidden_layers is not None:
        if num_hidden_layers > ckpt_layers:
            raise CheckpointError(f"num_hidden_layers={num_hidden_layers} exceeds the checkpoint's {ckpt_layers}")
        cfg_dict["num_hidden_layers"] = num_hidden_layers
    # every size of the config against the files, before anything is allocated (bounds.py)
    headers = SafetensorsHeaders(folder, since=since).as_module_names(family.module_name)
    source = read_checkpoint_source(folder, info, headers)  # the other config files, read before the build
    headers.check_unchanged("its config files")  # every file read so far from the folder whose shards are open
    config = check_model_config(cfg_dict, cfg_path, headers, info, every_layer=False, family=family)
    logger.info(
        "loading %s (%s layout, scheme %s, %d layers) on %s",
        folder,
        info.format,
        info.scheme.name,
        config.num_hidden_layers,
        device,
    )
    # Parameters are allocated but never written (no pages touched) until loaded below;
    # the experts' fused bf16 parameters are replaced without ever being paged in.
    try:
        model = empty_moe_model(config, torch.bfloat16, "cpu", where=where)
    except RuntimeError as err:  # the allocator's "you tried to allocate ..."
        raise CheckpointError(
            f"{cfg_path}: the model its sizes describe cannot be allocated (hidden_size={config.hidden_size}, "
            f"num_experts={family.num_experts(config)}, moe_intermediate_size={family.intermediate_size(config)}, "
            f"vocab_size={config.vocab_size}, num_hidden_layers={config.num_hidden_layers}): {err}"
        ) from None
    tensors = TensorReader(folder, headers)

    modules = dict(model.named_modules())
    quantized_linears = {}  # module name -> the CheckpointDescription it is read with
    # each module's description, for save_pretrained (a mixed-precision checkpoint's differ)
    described: dict[str, CheckpointDescription] = {}
    experts_part = f".{family.block_attr}.{family.experts_attr}."
    for name, p in model.named_parameters():
        if experts_part in name:
            continue
        module = name.rsplit(".", 1)[0]
        desc = None
        if f"{module}.weight_scale" in tensors:
            desc = module_description(info, family.disk_name(module), module_classes(modules[module]))
        if desc is not None:
            if not isinstance(modules[module], torch.nn.Linear) or not LAYOUTS[desc.format].supports_linear:
                raise CheckpointError(
                    f"{module} is quantized in this checkpoint; mxlib emulates quantized experts and linear layers "
                    f"only, so it must be bf16 and listed in the ignore/exclude list"
                )
            if name.endswith(".weight"):
                quantized_linears[module] = desc
                continue
        dtype = torch.float32 if family.keeps_fp32(name) else torch.bfloat16
        p.data = tensors.get(name, tuple(p.shape), dtype).to(device)
    for name, b in model.named_buffers():  # persistent buffers a checkpoint stores (DeepSeek-V3's router bias)
        if name in tensors and experts_part not in name:
            b.data = tensors.get(name, tuple(b.shape), b.dtype).to(device)

    e, h, i = family.num_experts(config), config.hidden_size, family.intermediate_size(config)
    rotation = None  # a rotated checkpoint's online rotation (``mxlib.recovery.hadamard``)
    if isinstance(qc, dict) and RECOVERY_CONFIG_KEY in qc:
        try:
            rotation = rotation_from_config(qc[RECOVERY_CONFIG_KEY], h, i)
        except ValueError as err:
            raise CheckpointError(f"{cfg_path}: quantization_config.{err}") from None

    def make(layer: int):
        prefix = family.experts_prefix(layer)
        _refuse_fused_unquantized(tensors, prefix)
        desc = experts_description(info, family.disk_name, prefix, e)
        if desc is None:
            if info.precision is not None:  # saved back as bf16: the description excludes the layer
                described[prefix] = replace(info, exclude=[*info.exclude, family.disk_name(f"{prefix}.*")])
            return _bf16_experts(tensors, prefix, e, h, i, device, backend)
        described[prefix] = desc
        layout = LAYOUTS[desc.format]
        weights, in13, in2 = layout.read_experts(tensors, prefix, e, h, i, desc)
        weights = reconcile_gate_up(weights, gate_up_scale)
        to = lambda t: None if t is None else t.to(device)  # noqa: E731
        b13 = b2 = None
        if family.expert_biases:  # gpt-oss: read beside the experts, in the layout's own names
            if not getattr(layout, "stores_expert_biases", False):
                raise CheckpointError(
                    f"{cfg_path}: layout {layout.name} stores no expert biases, which {family.architecture} needs"
                )
            b13, b2 = layout.read_expert_biases(tensors, prefix, e, h, i)  # as stored; read as fp32 in the GEMMs
        return make_emulation_experts(
            desc.scheme,
            weights.to(device),
            to(in13),
            to(in2),
            backend=backend,
            scale_strategy=scale_strategy,
            activation_scale_mode=desc.activation_scale_mode or "even",
            activation_dtype=activation_dtype,
            rotation=rotation,
            activation=expert_activation(config),
            w13_bias=to(b13),
            w2_bias=to(b2),
        )

    with tqdm(
        total=len(family.moe_layer_indices(config)), desc="loading experts", unit="layer", disable=not progress
    ) as bar:

        def make_and_count(layer: int):
            experts = make(layer)
            bar.update()
            return experts

        swap_experts(model, make_and_count, where=where)
    for module, desc in quantized_linears.items():
        lin = modules[module]
        described[module] = desc
        weights, ins = LAYOUTS[desc.format].read_linear(tensors, module, lin.out_features, lin.in_features, desc)
        bias = None
        if lin.bias is not None:
            bias = tensors.get(f"{module}.bias", tuple(lin.bias.shape), torch.bfloat16).to(device)  # as stored
        em = make_emulated_linear(
            desc.scheme,
            weights.to(device),
            None if ins is None else ins.to(device),
            bias=bias,
            backend=backend,
            activation_scale_mode=desc.activation_scale_mode or "even",
            activation_dtype=activation_dtype,
        )
        if ins is not None:  # the stored scale, which the saved checkpoint stores again
            em.register_buffer("input_scale", ins.to(device), persistent=False)
        parent, _, child = module.rpartition(".")
        setattr(modules[parent], child, em)
    tensors.close()
    # every tensor of the checkpoint is read, or named here (an expert, a layer, a suffix the config does not
    # account for); layers cut off by a num_hidden_layers override are skipped on purpose
    unused = headers.unused(skipped_layers=range(config.num_hidden_layers, ckpt_layers))
    if unused:
        warnings.warn(
            f"{folder}: {len(unused)} tensors of the checkpoint are not used by the model its config describes "
            f"and were not loaded: {describe_unused(unused)}",
            UnusedTensorsWarning,
            stacklevel=2,
        )
    # state_dict / load_state_dict / save_pretrained in this checkpoint's layout (saving.py)
    if info.precision is not None:
        source.module_descriptions = described
    _attach(model, source)
    model.mxlib_info = info
    return model.to(device).eval(), info


def load_quantized_qwen3_moe(
    path: str | os.PathLike,
    num_hidden_layers: int | None = None,
    device: str | torch.device = "cpu",
    backend: str = "auto",
    scale_strategy: str = "max",
    activation_dtype: torch.dtype = torch.bfloat16,
    progress: bool = False,
    gate_up_scale: str = "per_half",
):
    """``load_quantized_moe`` under Qwen3-MoE's name (same arguments, returns and errors; a checkpoint
    of any registered family loads as that family's class).

    Kept because code and notebooks were written against it when Qwen3-MoE was the one family; it is the same
    load, so it does not refuse other families (a Mixtral checkpoint gives ``MixtralForCausalLM``). New code uses
    ``mxlib.from_pretrained`` (transformers' keywords) or ``load_quantized_moe``, the names for every family."""
    return load_quantized_moe(
        path,
        num_hidden_layers=num_hidden_layers,
        device=device,
        backend=backend,
        scale_strategy=scale_strategy,
        activation_dtype=activation_dtype,
        progress=progress,
        gate_up_scale=gate_up_scale,
        where="load_quantized_qwen3_moe",
    )


def _refuse_fused_unquantized(tensors: TensorReader, prefix: str) -> None:
    """A checkpoint with transformers' fused bf16 expert parameters under a quantization config."""
    for fused in ("gate_up_proj", "down_proj"):
        for name in (f"{prefix}.{fused}", f"{prefix}.{fused}.weight"):
            if name in tensors:
                raise CheckpointError(
                    f"tensor {name!r}: the experts of this checkpoint are fused and unquantized (transformers' "
                    f"{fused} parameter in bf16, no per-expert quantized tensors) although its config says they are "
                    f"quantized. amd-quark writes this when run without "
                    f"quark.torch.utils.llm.preprocess_for_quantization(model) before quantizing (it quantizes "
                    f"nothing and still reports success); re-export with that preprocessing step"
                )


def _bf16_experts(tensors: TensorReader, prefix, e, h, i, device, backend):
    def stack(proj, shape):
        return tensors.stack([f"{prefix}.{x}.{proj}.weight" for x in range(e)], shape, torch.bfloat16)

    gate, up, down = stack("gate_proj", (i, h)), stack("up_proj", (i, h)), stack("down_proj", (h, i))
    return TritonExperts(torch.cat([gate, up], 1).to(device), down.to(device), backend=backend)
