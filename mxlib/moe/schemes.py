"""MoE quantization schemes: weight format + activation format, by AMD Quark's names.

=============================  =============  ===================================
scheme                         weights        activations (a1 and a2)
=============================  =============  ===================================
w_mxfp4                        mxfp4          bf16 (weight-only)
w_mxfp4_a_mxfp4                mxfp4          mxfp4, dynamic
w_mxfp4_a_mxfp6_e3m2           mxfp4          mxfp6_e3m2, dynamic
w_mxfp4_a_mxfp6_e2m3           mxfp4          mxfp6_e2m3, dynamic
w_mxfp4_a_fp8                  mxfp4          fp8 e4m3 per tensor, static input_scale
w_mxfp4_a_mxfp8                mxfp4          mxfp8_e4m3, dynamic (FlashInfer's W4A8 pairing)
w_mxfp6_e3m2                   mxfp6_e3m2     bf16
w_mxfp6_e3m2_a_mxfp6_e3m2      mxfp6_e3m2     mxfp6_e3m2, dynamic
w_mxfp6_e3m2_a_fp8             mxfp6_e3m2     fp8 e4m3 per tensor, static
w_mxfp6_e2m3                   mxfp6_e2m3     bf16
w_mxfp6_e2m3_a_mxfp6_e2m3      mxfp6_e2m3     mxfp6_e2m3, dynamic
w_mxfp6_e2m3_a_fp8             mxfp6_e2m3     fp8 e4m3 per tensor, static
w_mxfp8                        mxfp8_e4m3     bf16 (W8A16: what vLLM's MXFP8 emulation computes)
w_mxfp8_a_mxfp8                mxfp8_e4m3     mxfp8_e4m3, dynamic (W8A8, the checkpoint's scheme)
nvfp4                          nvfp4          nvfp4 (two-level, static global scale)
w4a16_nvfp4                    nvfp4          bf16 (W4A16: Marlin / Humming on Hopper)
nvfp4_ue5m3                    nvfp4_ue5m3    nvfp4_ue5m3, dynamic (no global scale)
nvfp4_b32                      nvfp4_b32      nvfp4_b32 (static global scale)
=============================  =============  ===================================

FP8 linear layers (``FP8_LINEAR_SCHEMES``, linear layers only: the "FP8 attention" beside FP4 experts of mixed
checkpoints): ``w_fp8_a_fp8`` (e4m3 weights with an fp32 scale per tensor or per output channel, e4m3 activations
with the checkpoint's static per-tensor ``input_scale``; ModelOpt ``FP8``, compressed-tensors' ``FP8``, Quark's FP8
per-tensor) and ``w_fp8_a_fp8_per_token`` (the same weights, a scale per token at run time: ModelOpt
``FP8_PER_CHANNEL_PER_TOKEN``, compressed-tensors' ``FP8_DYNAMIC``). ``get_moe_scheme`` finds them; the emulation
experts refuse them.

The last two rows of the table are NVFP4 variants ahead of hardware (``NVFP4_VARIANT_SCHEMES``,
``mxlib.formats.NVFP4_VARIANTS``):
UE5M3 block scales per 16 elements (AutoRound's ``NVFP4_E5M3`` is accepted for it) and 32-element NVFP4
blocks. They are not in ``MOE_SCHEMES`` (no checkpoint stores them); ``get_moe_scheme`` finds them, and
``mxlib.moe.nvfp4_variants`` runs them on the ``torch`` backend.

A scheme name says what is quantized: ``w_<weight format>`` (weight-only) or
``w_<weight format>_a_<activation format>`` (AMD Quark's export names, which vLLM's
``OCP_MX_Scheme`` uses too; in them ``mxfp8`` is ``mxfp8_e4m3``). ``nvfp4`` is NVIDIA ModelOpt's
W4A4 NVFP4 (``w_nvfp4_a_nvfp4`` is accepted for it), ``w4a16_nvfp4`` its weight-only NVFP4
(ModelOpt's ``QUANTIZATION_W4A16_NVFP4`` format, ``quant_algo: W4A16_NVFP4``; compressed-tensors'
preset ``NVFP4A16``): NVFP4 weights, bf16 activations, what vLLM's Marlin and Humming NVFP4 MoE
backends compute on GPUs without FP4 tensor cores. ``MoEQuantScheme.precision`` says each scheme's
``W<bits>A<bits>`` (``w_mxfp8``: ``W8A16``).

MXFP8: a checkpoint quantized ``w_mxfp8_a_mxfp8`` (W8A8) is what Quark and ModelOpt (``MXFP8``)
export. vLLM's ``Mxfp8EmulationTritonExperts`` dequantizes its weights (``e4m3 * 2**(e8m0 - 127)``
in fp32, one cast to bf16) and does not quantize activations (``quant_dtype`` None): it computes
``w_mxfp8``, W8A16. Run a W8A8 checkpoint's weights under ``w_mxfp8`` to reproduce vLLM, under
``w_mxfp8_a_mxfp8`` to emulate the checkpoint's own scheme.

Other tools' names are accepted and mapped (``SCHEME_ALIASES``): vLLM's
older ``OCP_MX_Scheme`` values (``w_fp4_a_fp4``, ...), vLLM's ``modelopt_fp4`` method, and
Quark's template names (``mxfp4_weight_only``, ``mxfp4_fp8``, ``mxfp4_mxfp6_e2m3``).

A bare tensor-format name (``mxfp4``, ``mxfp6_e3m2``, ...) is refused as a MoE scheme: it
names how one tensor is stored, and the tools disagree on what it quantizes in a model (Quark's
``mxfp4`` template is W4A4, vLLM's ``quantization="mxfp4"`` weight-only MXFP4 with bf16
activations). The error names the candidates. ``docs/api-mapping.md`` has the table and its sources.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from ..formats import (
    BLOCK_SCHEMES,
    FP8_E4M3_PER_TENSOR,
    FP8_E4M3_PER_TOKEN,
    NVFP4,
    NVFP4_VARIANTS,
    BlockScheme,
    PerTensorScheme,
    get_activation_format,
    get_block_scheme,
)

__all__ = [
    "MoEQuantScheme",
    "MOE_SCHEMES",
    "NVFP4_VARIANT_SCHEMES",
    "FP8_LINEAR_SCHEMES",
    "W_FP8_A_FP8",
    "W_FP8_A_FP8_PER_TOKEN",
    "OCP_MX_SCHEMES",
    "NVFP4_MOE",
    "W4A16_NVFP4",
    "get_moe_scheme",
    "get_weight_format",
    "checkpoint_weight_format",
    "vllm_emulated_scheme",
    "FP8_PER_TENSOR",
    "SCHEME_ALIASES",
]

# The per-tensor FP8 activation format (an object of the format table; its name is "fp8_e4m3").
FP8_PER_TENSOR: PerTensorScheme = FP8_E4M3_PER_TENSOR


@dataclass(frozen=True)
class MoEQuantScheme:
    """A MoE quantization scheme: the experts' weight format and activation format.

    ``weight``: a ``BlockScheme`` of ``mxlib.formats`` (``mxfp4``, ``mxfp6_*``, ``nvfp4``), or the per-tensor
    ``fp8_e4m3`` of the FP8 linear schemes (``FP8_LINEAR_SCHEMES``);
    ``activation``: a ``BlockScheme`` (dynamic MX, or NVFP4 with a static global scale), the
    per-tensor ``fp8_e4m3`` scheme (static ``input_scale``), or None (weight-only). Both
    print as their names.
    """

    name: str
    weight: BlockScheme
    activation: BlockScheme | PerTensorScheme | None

    def __post_init__(self) -> None:
        if not isinstance(self.weight, PerTensorScheme):  # FP8 linear layers: e4m3 with a per-tensor / channel scale
            object.__setattr__(self, "weight", get_block_scheme(self.weight))
        object.__setattr__(self, "activation", get_activation_format(self.activation))

    def __str__(self) -> str:
        return self.name

    @property
    def static_activation_scale(self) -> bool:
        """Whether the checkpoint carries an activation ``input_scale`` the experts need."""
        return self.activation is not None and self.activation.static_scale

    @property
    def weight_only(self) -> bool:
        """Whether activations stay in the model dtype (``W<bits>A16``)."""
        return self.activation is None

    @property
    def precision(self) -> str:
        """``W<weight bits>A<activation bits>``: ``W4A4`` (``nvfp4``), ``W4A8`` (``w_mxfp4_a_fp8``,
        ``w_mxfp4_a_mxfp8``), ``W8A16`` (``w_mxfp8``), ``W4A16`` (``w4a16_nvfp4``, ``w_mxfp4``), ...
        (A16: activations in the model's 16-bit dtype)."""
        act = 16 if self.activation is None else self.activation.element.nbits
        return f"W{self.weight.element.nbits}A{act}"

    @property
    def linear_only(self) -> bool:
        """Whether the scheme is for linear layers only (FP8 weights with a per-tensor or per-channel scale:
        ``FP8_LINEAR_SCHEMES``); the emulation experts refuse it."""
        return isinstance(self.weight, PerTensorScheme)

    @property
    def is_ocp_mx(self) -> bool:
        """OCP MX weights (E8M0 block scales, no global scale), as opposed to NVFP4 and its variants."""
        return self.weight.scale_is_power_of_two


# Quark's short names in scheme names: ``mxfp8`` is the e4m3 MXFP8 format
_QUARK_FORMAT_NAMES = {"mxfp8": "mxfp8_e4m3"}


def _ocp(name: str) -> MoEQuantScheme:
    body = name[len("w_") :]
    weight, _, act = body.partition("_a_")
    weight, act = _QUARK_FORMAT_NAMES.get(weight, weight), _QUARK_FORMAT_NAMES.get(act, act)
    return MoEQuantScheme(name, BLOCK_SCHEMES[weight], get_activation_format(act) if act else None)


OCP_MX_SCHEMES: tuple[str, ...] = (
    "w_mxfp4",
    "w_mxfp4_a_mxfp4",
    "w_mxfp4_a_mxfp6_e3m2",
    "w_mxfp4_a_mxfp6_e2m3",
    "w_mxfp4_a_fp8",
    "w_mxfp6_e3m2",
    "w_mxfp6_e3m2_a_mxfp6_e3m2",
    "w_mxfp6_e3m2_a_fp8",
    "w_mxfp6_e2m3",
    "w_mxfp6_e2m3_a_mxfp6_e2m3",
    "w_mxfp6_e2m3_a_fp8",
    "w_mxfp4_a_mxfp8",
    "w_mxfp8",
    "w_mxfp8_a_mxfp8",
)

MOE_SCHEMES: dict[str, MoEQuantScheme] = {n: _ocp(n) for n in OCP_MX_SCHEMES}
MOE_SCHEMES[NVFP4.name] = MoEQuantScheme(NVFP4.name, NVFP4, NVFP4)
# NVFP4 weights and activations (ModelOpt's MoE scheme): the studies' and the loaders' object for it
NVFP4_MOE: MoEQuantScheme = MOE_SCHEMES[NVFP4.name]
# NVFP4 weights, bf16 activations (ModelOpt's W4A16_NVFP4; vLLM's Marlin / Humming on Hopper)
W4A16_NVFP4_NAME = "w4a16_nvfp4"
MOE_SCHEMES[W4A16_NVFP4_NAME] = MoEQuantScheme(W4A16_NVFP4_NAME, NVFP4, None)
W4A16_NVFP4: MoEQuantScheme = MOE_SCHEMES[W4A16_NVFP4_NAME]
# NVFP4 variants ahead of hardware (``mxlib.formats.NVFP4_VARIANTS``), W4A4 in the variant: weights and both
# activation points in the same format. Kept out of ``MOE_SCHEMES`` (the schemes checkpoints store and the
# studies sweep); ``get_moe_scheme`` finds them; ``mxlib.moe.nvfp4_variants`` runs them.
NVFP4_VARIANT_SCHEMES: dict[str, MoEQuantScheme] = {
    name: MoEQuantScheme(name, fmt, fmt) for name, fmt in NVFP4_VARIANTS.items()
}
# FP8 linear layers (the "FP8 attention" of mixed checkpoints): e4m3 weights with an fp32 weight_scale per tensor or
# per output channel (the stored tensor says which), activations in e4m3 with the checkpoint's static per-tensor
# input_scale, or with a scale per token at run time. Linear layers only (``MoEQuantScheme.linear_only``): kept out of
# ``MOE_SCHEMES``; ``get_moe_scheme`` finds them; ``mxlib.moe.linear.EmulatedLinear`` runs them.
FP8_LINEAR_SCHEMES: dict[str, MoEQuantScheme] = {
    "w_fp8_a_fp8": MoEQuantScheme("w_fp8_a_fp8", FP8_E4M3_PER_TENSOR, FP8_E4M3_PER_TENSOR),
    "w_fp8_a_fp8_per_token": MoEQuantScheme("w_fp8_a_fp8_per_token", FP8_E4M3_PER_TENSOR, FP8_E4M3_PER_TOKEN),
}
W_FP8_A_FP8: MoEQuantScheme = FP8_LINEAR_SCHEMES["w_fp8_a_fp8"]
W_FP8_A_FP8_PER_TOKEN: MoEQuantScheme = FP8_LINEAR_SCHEMES["w_fp8_a_fp8_per_token"]
# Other tools' names of the NVFP4 variants: AutoRound's NVFP4 with UE5M3 block scales (intel/auto-round#2123)
NVFP4_VARIANT_ALIASES: dict[str, str] = {"NVFP4_E5M3": "nvfp4_ue5m3", "nvfp4_e5m3": "nvfp4_ue5m3"}
# Other tools' scheme names -> the canonical name (docs/api-mapping.md gives the sources).
SCHEME_ALIASES: dict[str, str] = {
    # NVFP4 weights and activations, said the w_*_a_* way; vLLM's method name for ModelOpt NVFP4
    "w_nvfp4_a_nvfp4": "nvfp4",
    "modelopt_fp4": "nvfp4",
    # vLLM's OCP_MX_Scheme values before they took Quark's mx prefix (ocp_mx_utils.py)
    "w_fp4_a_fp4": "w_mxfp4_a_mxfp4",
    "w_fp4_a_fp6_e3m2": "w_mxfp4_a_mxfp6_e3m2",
    "w_fp4_a_fp6_e2m3": "w_mxfp4_a_mxfp6_e2m3",
    "w_fp6_e3m2_a_fp6_e3m2": "w_mxfp6_e3m2_a_mxfp6_e3m2",
    "w_fp6_e2m3_a_fp6_e2m3": "w_mxfp6_e2m3_a_mxfp6_e2m3",
    # AMD Quark's LLM template names (quark.torch.quantization.config.template) that say both formats
    "mxfp4_weight_only": "w_mxfp4",
    "mxfp4_fp8": "w_mxfp4_a_fp8",
    "mxfp4_mxfp6_e2m3": "w_mxfp4_a_mxfp6_e2m3",
    # Quark's older MXFP8 name (quark.torch's scheme-name map)
    "w_mx_fp8_a_mx_fp8": "w_mxfp8_a_mxfp8",
    # weight-only NVFP4: ModelOpt's quant_algo, compressed-tensors' preset, the w_* form
    "W4A16_NVFP4": "w4a16_nvfp4",
    "NVFP4A16": "w4a16_nvfp4",
    "nvfp4_w4a16": "w4a16_nvfp4",
    "w_nvfp4": "w4a16_nvfp4",
    # llm-compressor / compressed-tensors preset names (compressed_tensors.quantization.quant_scheme.PRESET_SCHEMES)
    # that are microscaling schemes: NVFP4 tensor_group 16 weights and activations (static global scale, dynamic
    # "local" block scales); MXFP4 / MXFP8 group-32 E8M0 weights, with dynamic group-32 activations or A16
    "NVFP4": "nvfp4",
    "MXFP4A16": "w_mxfp4",
    "MXFP4": "w_mxfp4_a_mxfp4",
    "MXFP8A16": "w_mxfp8",
    "MXFP8": "w_mxfp8_a_mxfp8",
}

# llm-compressor preset names that are no microscaling scheme: why each is refused, and the nearest mxlib scheme
NOT_MICROSCALING: dict[str, str] = {
    "W4A16": "llm-compressor's W4A16 is INT4 weights in groups of 128 with bf16 activations (GPTQ-style); the "
    "microscaling 4-bit weight-only schemes are 'NVFP4A16' (w4a16_nvfp4) and 'MXFP4A16' (w_mxfp4)",
    "W4A16_ASYM": "llm-compressor's W4A16_ASYM is asymmetric INT4 weights; nearest: 'NVFP4A16' or 'MXFP4A16'",
    "W8A16": "llm-compressor's W8A16 is INT8 weights; the microscaling 8-bit weight-only scheme: 'MXFP8A16'",
    "W8A8": "llm-compressor's W8A8 is INT8 weights and activations; nearest microscaling scheme: 'MXFP8'",
    "INT8": "llm-compressor's INT8 is INT8 weights and activations; nearest microscaling scheme: 'MXFP8'",
    "W4A8": "llm-compressor's W4A8 is INT4 weights with INT8 activations; nearest: 'w_mxfp4_a_mxfp8'",
    "W4AFP8": "llm-compressor's W4AFP8 is INT4 weights with per-token FP8 activations; nearest: 'w_mxfp4_a_mxfp8'",
    "FP8": "llm-compressor's FP8 is per-tensor FP8 weights and activations; nearest: 'w_mxfp8_a_mxfp8' (MXFP8)",
    "FP8_DYNAMIC": "llm-compressor's FP8_DYNAMIC is per-channel FP8 weights, per-token activations; nearest: 'MXFP8'",
    "FP8_BLOCK": "llm-compressor's FP8_BLOCK is 128x128-block FP8 weights; nearest: 'MXFP8' (32-element blocks)",
    "NVFP4_46": "llm-compressor's NVFP4_46 is NVFP4 with the four-over-six observer: scheme 'nvfp4' with "
    "technique='four_over_six'",
    "NVFP4A16_46": "llm-compressor's NVFP4A16_46 is weight-only NVFP4 with the four-over-six observer: scheme "
    "'w4a16_nvfp4' with technique='four_over_six'",
    "UNQUANTIZED": "llm-compressor's UNQUANTIZED quantizes nothing; keep the bf16 model",
}

# A tensor-format name given where a MoE scheme is expected: what it could mean.
_FORMAT_NAME_MEANINGS = {
    "mxfp4": "'w_mxfp4_a_mxfp4' (weights and activations: Quark's 'mxfp4' template) or 'w_mxfp4' "
    "(weights only: vLLM's quantization='mxfp4', bf16 activations)",
    "mxfp8": "'w_mxfp8_a_mxfp8' (W8A8: what Quark and ModelOpt's MXFP8 checkpoints quantize) or 'w_mxfp8' "
    "(W8A16: what vLLM's MXFP8 emulation computes, bf16 activations)",
}


def get_moe_scheme(name: str | MoEQuantScheme) -> MoEQuantScheme:
    """Look up a MoE scheme by its canonical name (``w_mxfp4_a_mxfp4``, ``w_mxfp6_e3m2``, ``nvfp4``, ...)
    or another tool's name for it (``SCHEME_ALIASES``: ``w_fp4_a_fp4``, ``modelopt_fp4``,
    ``mxfp4_fp8``, llm-compressor's presets ``NVFP4``, ``NVFP4A16``, ``MXFP4``, ``MXFP4A16``, ``MXFP8``,
    ``MXFP8A16``, ...), in any letter case (``nvfp4a16``, ``W_MXFP4``). The exact lower-case tensor-format names
    ``mxfp4`` and ``mxfp8`` stay refused: they are formats, and vLLM's ``quantization="mxfp4"`` (weights only)
    and llm-compressor's ``MXFP4`` (weights and activations) mean different schemes by them.

    Call it once, where a name enters (a notebook's parameters, a CLI option, a checkpoint's
    config); pass the object below that.

    Raises:
        ValueError: unknown name, the supported schemes listed and the nearest names ("did you mean", ``difflib``);
            an llm-compressor preset that is no microscaling scheme (``NOT_MICROSCALING``: ``W4A16`` is INT4,
            ``FP8`` per-tensor, ...), naming what it is and the nearest mxlib scheme; a bare tensor-format name
            such as ``mxfp4`` (it does not say whether activations are quantized: the message names the
            schemes it could mean).
    """
    if isinstance(name, MoEQuantScheme):
        return name
    if not isinstance(name, str):
        raise ValueError(f"scheme: expected a MoE scheme name or a MoEQuantScheme, got {type(name).__name__}")
    key = SCHEME_ALIASES.get(name, name)
    if key in MOE_SCHEMES:
        return MOE_SCHEMES[key]
    key = NVFP4_VARIANT_ALIASES.get(key, key)
    if key in NVFP4_VARIANT_SCHEMES:
        return NVFP4_VARIANT_SCHEMES[key]
    if key in FP8_LINEAR_SCHEMES:
        return FP8_LINEAR_SCHEMES[key]
    if name in BLOCK_SCHEMES or name in _FORMAT_NAME_MEANINGS:
        meaning = _FORMAT_NAME_MEANINGS.get(
            name, f"'w_{name}' (weights only) or 'w_{name}_a_{name}' (weights and activations)"
        )
        raise ValueError(
            f"scheme: {name!r} is a tensor format, not a MoE scheme (it does not say whether activations are "
            f"quantized); name one of {meaning} (llm-compressor's upper-case preset names say it: "
            f"{[n for n, v in SCHEME_ALIASES.items() if n.isupper() and n.lower().startswith(name)]})"
        )
    folded = _CASEFOLDED.get(name.casefold())
    if folded is not None:
        return MOE_SCHEMES[folded]
    refused = {n.casefold(): why for n, why in NOT_MICROSCALING.items()}.get(name.casefold())
    if refused is not None:
        raise ValueError(f"scheme: {name!r} is not a microscaling scheme: {refused}")
    near = difflib.get_close_matches(name.casefold(), list(_CASEFOLDED), n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(repr(_SPELLING[n]) for n in near)}? " if near else ""
    raise ValueError(
        f"scheme: unknown MoE scheme {name!r}; {hint}supported: {list(MOE_SCHEMES)}, NVFP4 variants ahead of "
        f"hardware {list(NVFP4_VARIANT_SCHEMES)}, FP8 linear layers {list(FP8_LINEAR_SCHEMES)} (other tools' names: "
        f"{list(SCHEME_ALIASES)})"
    )


# Case-insensitive lookup (``get_moe_scheme``): every canonical and alias name folded -> the canonical name; the
# folded name -> its spelling in the tables (for "did you mean"). The bare lower-case tensor-format names ``mxfp4`` /
# ``mxfp8`` are refused before this table is read (they do not say whether activations are quantized).
_CASEFOLDED: dict[str, str] = {
    **{n.casefold(): n for n in MOE_SCHEMES},
    **{a.casefold(): c for a, c in SCHEME_ALIASES.items()},
}
_SPELLING: dict[str, str] = {**{n.casefold(): n for n in MOE_SCHEMES}, **{a.casefold(): a for a in SCHEME_ALIASES}}


def get_weight_format(scheme: str | MoEQuantScheme | BlockScheme) -> BlockScheme:
    """The block format weights are stored in: a ``MoEQuantScheme``'s ``weight``, a ``BlockScheme``
    itself, or either looked up by name: a block scheme name is that format (``mxfp4``, ``mxfp6_e3m2``,
    ``nvfp4``), a MoE scheme name gives its weight format (``w_mxfp6_e2m3``, ``w_mxfp4_a_mxfp4``, ...).

    Raises:
        ValueError: a name that is neither; the message lists the block schemes.
    """
    if isinstance(scheme, MoEQuantScheme):
        return scheme.weight
    if isinstance(scheme, BlockScheme):
        return scheme
    if isinstance(scheme, str) and (scheme in BLOCK_SCHEMES or scheme in NVFP4_VARIANTS):
        return get_block_scheme(scheme)  # a tensor format names the weight format itself
    try:
        return get_moe_scheme(scheme).weight
    except (ValueError, TypeError):
        return get_block_scheme(scheme)


def checkpoint_weight_format(scheme: str | MoEQuantScheme | BlockScheme, where: str) -> BlockScheme:
    """``get_weight_format`` for code that handles only the formats checkpoints store (``BLOCK_SCHEMES``): the
    writer's layouts, the recovery techniques, ``EmulatedLinear``.

    Raises:
        ValueError: an NVFP4 variant ahead of hardware (``nvfp4_ue5m3``, ``nvfp4_b32``), naming ``where``; or as
            ``get_weight_format``.
    """
    fmt = get_weight_format(scheme)
    if fmt.name in NVFP4_VARIANTS:
        raise ValueError(
            f"scheme: {fmt.name} is an NVFP4 variant ahead of hardware; {where} takes the formats checkpoints store "
            f"({list(BLOCK_SCHEMES)}); the variants run in mxlib.moe.nvfp4_variants only"
        )
    return fmt


# What vLLM's emulation experts compute for a checkpoint of a scheme, where that is another scheme
_VLLM_EMULATION_COMPUTES = {"w_mxfp8_a_mxfp8": "w_mxfp8"}


def vllm_emulated_scheme(scheme: str | MoEQuantScheme) -> MoEQuantScheme:
    """The scheme vLLM's emulation experts compute for a checkpoint quantized in ``scheme``.

    ``w_mxfp8`` (W8A16) for an MXFP8 W8A8 checkpoint (``w_mxfp8_a_mxfp8``: Quark's ``OCP_MXFP8E4M3Spec``,
    ModelOpt's ``MXFP8``): vLLM's ``Mxfp8EmulationTritonExperts`` dequantizes the weights and leaves the
    activations in bf16 (its ``quant_dtype`` is None). Every other scheme: itself (its emulation QDQs the
    activations the scheme names). Build the experts of the same ``ExpertWeights`` with the result to
    reproduce vLLM, with ``scheme`` to emulate the checkpoint's own arithmetic.

    Raises:
        ValueError: an unknown scheme name (``get_moe_scheme``).
    """
    s = get_moe_scheme(scheme)
    return MOE_SCHEMES[_VLLM_EMULATION_COMPUTES.get(s.name, s.name)]
