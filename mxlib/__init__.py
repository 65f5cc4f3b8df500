"""mxlib: microscaling (OCP MX, NVFP4) quantization emulation for Mixture-of-Experts models.

The common tasks, from ``import mxlib`` (each name is the function of the module listed, loaded
on first use: importing ``mxlib`` itself imports neither torch, transformers nor triton):

Tensors (``mxlib.reference``, pure PyTorch; the Triton twins are in ``mxlib.kernels``):
    ``quantize_mx`` / ``dequantize_mx`` / ``quant_dequant_mx``   OCP MX (MXFP4, MXFP6, MXFP8)
    ``quantize_nvfp4`` / ``dequantize_to_dtype``               NVFP4 weights (ModelOpt, vLLM)
    ``ref_nvfp4_quant_dequant``                                NVFP4 activation QDQ (vLLM)
    ``quant_dequant``                                          QDQ by format name
    ``get_element_format``, ``get_block_scheme``               the format table (``mxlib.formats``)

MoE experts (``mxlib.moe``):
    ``get_moe_scheme``                     a scheme by name (``w_mxfp4_a_mxfp4``, ``nvfp4``, ...)
    ``quantize_expert_weights``            one layer's bf16 experts -> ``ExpertWeights``
    ``make_emulation_experts``             the scheme's emulation experts from quantized weights
    ``FusedMoEQuantConfig``                the experts' modes in one checked object (``make_experts`` takes one)
    ``Nvfp4QuantizationEmulationTritonExperts``, ``OCP_MXQuantizationEmulationTritonExperts``,
    ``TritonExperts``                      the experts classes (vLLM's names)
    ``fused_topk``                         the router (softmax, top-k, renormalize)

The doors (a practitioner's three calls):
    ``quantize_``                          quantize a bf16 model's experts in memory (torchao's shape);
                                           ``model.save_pretrained(folder)`` then writes the checkpoint
    ``from_pretrained``                    load a quantized checkpoint folder of any layout and family,
                                           transformers' keywords (``dtype``, ``device_map``); returns the model

Models and checkpoints (``mxlib.models``, transformers' MoE families; Qwen3-MoE the default):
    ``family_of``                          the ``MoEFamily`` of a model, config or ``config.json`` dict
    ``calibrate``, ``Calibration``         per-expert activation amax from token ids, batches or a data loader
    ``collect_expert_hessians``            per-expert Hessians for GPTQ (``get_technique("gptq", hessians=...)``)
    ``get_technique``                      an accuracy-recovery technique by name (``mxlib.recovery``)
    ``expert_weights``                     one layer's bf16 experts as ``(w13, w2)``
    ``swap_experts``                       put mxlib experts into a transformers model
    ``attach_checkpoint_layout``           give a model with swapped experts a layout to save in
    ``TransformersExperts``, ``EmulatedLinear``   the modules a quantized model holds
    ``write_quantized_checkpoint``         a bf16 model -> a quantized checkpoint folder
    ``load_quantized_moe``                 ``from_pretrained``'s load with mxlib's keywords, returning
                                           ``(model, info)``
    ``load_quantized_qwen3_moe``           the same under the Qwen3-MoE name it first had (kept for
                                           code written against it; it loads every family)
    ``inspect_checkpoint``                 describe a checkpoint from its configs and headers

The subpackages: ``mxlib.formats`` the format table; ``mxlib._checks`` the argument checks the reference and
its Triton twins share; ``mxlib.reference`` the pure-PyTorch oracle; ``mxlib.kernels`` Triton twins (Triton's
interpreter on machines without CUDA); ``mxlib.moe`` schemes, routing, the fused-MoE experts, their emulation
subclasses and their factory; ``mxlib.recovery`` the accuracy-recovery techniques; ``mxlib.models`` the families,
presets, calibration, the trained model; ``mxlib.checkpoints`` the writer, the loader, the inspector and the
layouts; ``mxlib.analysis`` error metrics; ``mxlib.stats`` the statistics rule (paired comparisons decided
together: "A better", "B better" or "cannot be told apart"); ``mxlib.cases`` named corner cases; ``mxlib.studies``
what the notebooks, the CLI and the benchmarks run (rows and numbers); ``mxlib.workbook`` the notebooks' figures,
widgets, checks and runner; ``mxlib.cli`` the notebooks' code paths as commands (``python -m mxlib``,
``mxlib/__main__.py``); ``mxlib.bench`` GPU benchmarks; ``mxlib.text_table`` the one renderer of the text and
markdown tables they print (the inspector's report, ``what_ran``, the benchmarks).
``docs/api-mapping.md`` maps torchao's and vLLM's conventions onto these names.
"""

import importlib as _importlib

__version__ = "0.1.0"

# public name -> the module that defines it (PEP 562: imported on first attribute access)
_LAZY: dict[str, str] = {
    # tensors
    "quantize_mx": "mxlib.reference",
    "dequantize_mx": "mxlib.reference",
    "quant_dequant_mx": "mxlib.reference",
    "quantize_nvfp4": "mxlib.reference",
    "dequantize_to_dtype": "mxlib.reference",
    "ref_nvfp4_quant_dequant": "mxlib.reference",
    "quant_dequant": "mxlib.reference",
    "get_element_format": "mxlib.formats",
    "get_block_scheme": "mxlib.formats",
    # MoE experts
    "get_moe_scheme": "mxlib.moe.schemes",
    "MoEQuantScheme": "mxlib.moe.schemes",
    "ExpertWeights": "mxlib.moe.emulation",
    "quantize_expert_weights": "mxlib.moe.factory",
    "make_emulation_experts": "mxlib.moe.factory",
    "FusedMoEQuantConfig": "mxlib.moe.quant_config",
    "Nvfp4QuantizationEmulationTritonExperts": "mxlib.moe.emulation",
    "OCP_MXQuantizationEmulationTritonExperts": "mxlib.moe.emulation",
    "TritonExperts": "mxlib.moe.base",
    "fused_topk": "mxlib.moe.routing",
    # the doors
    "quantize_": "mxlib.models.in_memory",
    "from_pretrained": "mxlib.checkpoints.pretrained",
    # models and checkpoints
    "family_of": "mxlib.models.families",
    "calibrate": "mxlib.models.calibration",
    "Calibration": "mxlib.models.calibration",
    "collect_expert_hessians": "mxlib.models.hessians",
    "get_technique": "mxlib.recovery",
    "expert_weights": "mxlib.models.moe_models",
    "swap_experts": "mxlib.models.moe_models",
    "attach_checkpoint_layout": "mxlib.checkpoints.saving",
    "TransformersExperts": "mxlib.moe.base",
    "EmulatedLinear": "mxlib.moe.linear",
    "write_quantized_checkpoint": "mxlib.checkpoints.writer",
    "load_quantized_moe": "mxlib.checkpoints.loader",
    "load_quantized_qwen3_moe": "mxlib.checkpoints.loader",
    "inspect_checkpoint": "mxlib.checkpoints.inspect",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mxlib' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(__all__) | {n for n in globals() if n.startswith("__")})
