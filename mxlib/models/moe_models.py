"""transformers MoE models of any registered family (``mxlib.models.families``), with mxlib experts swapped in.

The family-generic half of ``mxlib.models.qwen3``: building a model with uninitialized or seeded
random weights (``empty_moe_model``, ``dummy_moe_model``), finding its MoE blocks
(``moe_layers``, ``moe_layer_indices``), reading one layer's experts in mxlib's orientation
(``expert_weights``: w13 ``[E, 2I, H]`` gate rows then up rows, w2 ``[E, H, I]``;
``expert_biases``) and replacing them (``swap_experts``). Only the experts are replaced: each
family's own router (softmax top-k, DeepSeek-V3's grouped sigmoid top-k, ...) keeps computing
``top_k_index`` / ``top_k_weights``, and its shared experts and dense MLPs stay as transformers
built them.

Every function refuses a model or config of an unregistered family first
(``mxlib.models.families.UnsupportedModelError`` naming its class).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from ..moe.activations import MoEActivation, get_activation
from ..moe.base import TransformersExperts, TritonExperts
from .families import MoEFamily, check_supported_model, family_of

__all__ = [
    "empty_moe_model",
    "dummy_moe_model",
    "tied_parameter_names",
    "moe_layers",
    "moe_layer_indices",
    "moe_blocks",
    "expert_weights",
    "expert_biases",
    "expert_activation",
    "swap_experts",
    "BoundToModel",
    "WARMUP_SEED_OFFSET",
    "WARMUP_SHAPE",
]


@contextlib.contextmanager
def _no_init():
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        from transformers.modeling_utils import no_init_weights
    with no_init_weights():
        yield


def empty_moe_model(config, dtype: torch.dtype = torch.bfloat16, device="cpu", where: str = "empty_moe_model"):
    """The family's transformers ``*ForCausalLM`` with uninitialized parameters (no init cost, and
    pages are only touched when written, so experts replaced before use cost no memory).

    ``config``: a transformers config object of a registered family; ``where``: the public entry a
    refusal names (wrappers such as ``mxlib.models.qwen3.empty_qwen3_moe`` pass their own). Tensors a family keeps in
    float32 (``MoEFamily.fp32_tensors``: DeepSeek-V3's router weight and correction bias) are
    float32, as transformers builds them; everything else is ``dtype``.

    With ``config.tie_word_embeddings`` the output head is the input embedding (one parameter,
    ``lm_head.weight is model.embed_tokens.weight``), as transformers' ``from_pretrained`` and vLLM
    tie it: ``no_init_weights`` skips transformers' own tie, so it is made here.

    Raises:
        UnsupportedModelError: a config of a family mxlib does not quantize.
    """
    family = family_of(config, where, name="config")
    with _no_init(), torch.device(device):
        model = family.load_class()._from_config(config, dtype=dtype)
    if getattr(config, "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def tied_parameter_names(model) -> set[str]:
    """State-dict names that are another parameter under a second name (``lm_head.weight`` of a model
    with tied word embeddings): a checkpoint stores only the first, as transformers' ``save_pretrained``
    does, and the loader ties them again."""
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if lm_head is not None and embed is not None and lm_head.weight is embed.weight:
        return {"lm_head.weight"}
    return set()


def moe_layer_indices(model) -> list[int]:
    """Decoder layer indices of a model's MoE layers (``MoEFamily.moe_layer_indices`` of its config)."""
    family = family_of(model, "moe_layer_indices")
    return family.moe_layer_indices(model.config)


def moe_blocks(model, where: str = "moe_blocks") -> list[tuple[int, torch.nn.Module]]:
    """``[(decoder layer index, MoE block)]`` of every MoE layer, ascending."""
    family = family_of(model, where)
    layers = model.model.layers
    return [(i, getattr(layers[i], family.block_attr)) for i in family.moe_layer_indices(model.config)]


def moe_layers(model) -> list:
    """The MoE block (``Qwen3MoeSparseMoeBlock``, ``MixtralSparseMoeBlock``, ``DeepseekV3MoE``, ...) of
    every MoE layer, in layer order (dense MLP layers left out: ``moe_layer_indices`` gives the
    decoder layer of each)."""
    return [block for _, block in moe_blocks(model, "moe_layers")]


# Warm-up batch of the routing-balance construction: its own seed offset, apart from the
# evaluation (seed + 1) and calibration (seed + 1000) token ids of mxlib.studies.steps.
WARMUP_SEED_OFFSET = 2000
WARMUP_SHAPE = (2, 256)  # [sequences, tokens]: the calibration batch's shape


@torch.no_grad()
def dummy_moe_model(
    config,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    expert_spread: float = 0.0,
    device="cpu",
    balanced_routing: bool = True,
    attn_update_ratio: float = 0.25,
    moe_update_ratio: float | None = 0.25,
    where: str = "dummy_moe_model",
    expert_bias_std: float | None = None,
):
    """A seeded random-weight model: the workbook's "dummy checkpoint" in bf16.

    Linear, embedding and router weights are ``N(0, initializer_range)`` (0.02), norms 1.
    Generation is deterministic for a given seed and device (CPU and CUDA generators
    differ, and the warm-up below runs on ``device``).

    **Balanced routing** (``balanced_routing=True``, the default). With plain random weights
    the routing collapses with depth: causal attention with random q/k is close to
    a uniform average over the prefix, so its output is nearly the same vector for every
    token of a sequence, and with 0.02 weights at Qwen3-30B-A3B's widths it is about
    ``1.2 / sqrt(position)`` per element against the token embedding's 0.02. From layer 1 on,
    the router input of a sequence is dominated by that shared vector and every token asks
    the router the same question. (The shared vector differs between sequences, so router rows projected
    orthogonal to a batch's mean direction alone do not help: measured, they leave the
    collapse as it was.) A trained model's attention is selective and its layers add
    updates smaller than the residual stream they read. The construction, data-dependent
    like LSUV initialization (Mishkin & Matas, 2016), runs one seeded warm-up forward pass
    (token ids ``[2, 256]`` drawn as ``mxlib.studies.steps.random_token_ids`` does, seed
    ``seed + WARMUP_SEED_OFFSET``) layer by layer and sets:

    1. each layer's attention output projection ``o_proj`` multiplied by one scalar so the
       attention update's RMS is ``attn_update_ratio`` (0.25) times the RMS of the residual
       stream entering the layer, measured on the warm-up batch;
    2. each router's rows projected orthogonal to the mean direction of that router's input
       on the warm-up batch (``W <- W (1 - u u^T)``), so no shared offset biases all
       tokens toward the same experts;
    3. every expert's w2 (``down_proj``) of a layer multiplied by one scalar so the MoE block's
       update has ``moe_update_ratio`` (0.25) times the RMS of the residual stream it is added
       to. Without step 3 the residual, no longer dominated by attention, is about the size of
       the MoE update itself, and the quantization error of the experts (a W4A4 MoE block sits
       near 13 dB SQNR on its own) passes into the stream almost undamped: measured at full
       size, layer SQNR 12.9 / 7.3 / 4.6 / 3.2 dB and logits 3.0 dB for NVFP4, which says more
       about the random model than about NVFP4. A trained model's blocks add updates smaller
       than the stream they read. One scalar per layer keeps the experts' relative scales
       (``expert_spread``) as they are. ``moe_update_ratio=None`` skips step 3.

    Step 1 does nearly all the work: without step 2, a smaller model
    (hidden 1024, 128 experts) has largest shares 1.72 / 1.69 / 2.34 / 2.41x against
    1.72 / 1.66 / 2.22 / 2.38x with it; step 2 removes what shared offset remains.

    Later layers are measured after earlier ones are set (hooks recompute each output with
    the new weights, one pass in all). Only parameter values change: transformers'
    architecture, parameter names and shapes, and the checkpoint layouts are untouched.
    Step 3 scales every expert's w2 of a layer by the same factor, so a1 and a2 statistics
    (the w13 and w2 inputs) are those of the unscaled experts.
    ``balanced_routing=False`` gives the earlier plain random model (same random draws).

    Measured with seed 0, top-8 and the 512 calibration tokens of
    ``mxlib.studies.steps.calibrate_model`` on the 4-layer Qwen3-30B-A3B (full widths, 128
    experts; uniform share 1/128 = 0.0078, 32 of the 4,096 assignments per expert):

    ========================  ==============  ==============  ==============  ==============
    layer                     0               1               2               3
    ========================  ==============  ==============  ==============  ==============
    plain: experts hit        128             92              72              65
    plain: largest share      0.0271 (3.47x)  0.0686 (8.78x)  0.0613 (7.84x)  0.1062 (13.6x)
    plain: norm. entropy      0.940           0.770           0.711           0.681
    balanced: experts hit     128             128             128             128
    balanced: largest share   0.0120 (1.53x)  0.0147 (1.88x)  0.0191 (2.44x)  0.0200 (2.56x)
    ========================  ==============  ==============  ==============  ==============

    (with all three steps). Every expert of every layer is calibrated; per-layer max/min of
    the calibrated amax at spread 0 (measured before step 3, which changes no expert's share
    of a1/a2 within a layer but does change later layers' inputs): a1 1.33 / 1.19 / 1.23 /
    1.21, a2 1.95 / 1.93 / 2.47 / 2.13. The warm-up adds
    one forward pass of 512 tokens to a build (35 s on a shared 2-core CPU at full size).
    ``attn_update_ratio`` 0.5 balances less (on a hidden-512, 64-expert model, largest share
    3.0x in layers 2-3 against 2.1x at 0.25).

    **Expert spread.** ``expert_spread`` sigma gives experts activations of different ranges,
    as trained MoE experts have: expert ``e``'s w13 is multiplied by ``f_e = exp(sigma * z_e)``,
    ``z_e ~ N(0, 1)``, and its w2 by ``f_e ** -2``. Gate and up both grow by ``f_e``, so the
    SiLU-and-mul output (the w2 input, a2) grows by about ``f_e ** 2`` while the expert's
    output stays on the common scale: a2 ranges spread over ``exp(+-2 sigma)`` per standard
    deviation and no expert dominates the layer. 0 gives i.i.d. experts. The number to compare
    with a real checkpoint's per-expert ``input_scale`` of a layer (ModelOpt NVFP4 stores
    ``amax / (6 * 448)`` per expert, so the ratio of two experts' input scales is the ratio
    of their calibrated amax) is max/min over experts of the calibrated amax, median over
    layers, measured here with seed 0 and 512 calibration tokens on a small model
    (hidden 256, 64 experts, top-8, 4 layers; every expert calibrated):

    ========  ======================  ===========================
    spread    a1 (w13 input) max/min  a2 (w2 input) max/min
    ========  ======================  ===========================
    0         1.22                    2.4
    0.5       1.22                    1.9e2
    1.0       1.20                    2.7e4
    1.5       1.21                    3.6e6
    ========  ======================  ===========================

    (Per layer at 1.0: a2 8.0e3 to 8.3e4.) The a2 ratio roughly (within a factor 2 here)
    follows ``exp(2 sigma (z_max - z_min))`` times the spread-0 ratio, where ``z_max - z_min``,
    the range of E standard normal draws, is about 4.8 for 64 experts and 5.2 for 128: to
    match a checkpoint whose w2 input scales span a ratio ``r``, use
    ``sigma ~ ln(r / r0) / (2 * 5.2)`` at 128 experts, with ``r0`` the spread-0 ratio (about 2
    at full size: ``r = 10`` gives about 0.15). Built without balanced routing, the same small
    model leaves 29 to 31 (layer, expert) pairs uncalibrated and its a1 ratio is 1.41.

    a1 (the w13 input, the normalized residual) does not depend on the spread; its ratio
    comes from the routing alone.

    ``where`` is the public entry a refusal names (``dummy_qwen3_moe`` passes its own).

    **Other families.** The same three steps run on every registered family's MoE layers
    (``mxlib.models.families``); a layer that is a dense MLP (DeepSeek-V3's first
    ``first_k_dense_replace``, Qwen2-MoE's ``mlp_only_layers``) gets step 1 only. In a block with
    shared experts (Qwen2-MoE's gated ``shared_expert``, DeepSeek-V3's ``shared_experts``) step 3
    scales their ``down_proj`` by the same factor as the routed experts' w2, so the block's update
    scales as one. DeepSeek-V3's router ``e_score_correction_bias`` (a buffer) is drawn
    ``N(0, initializer_range)`` too, so that the correction takes part in the routing.

    **Expert biases** (gpt-oss's ``gate_up_proj_bias``, ``down_proj_bias``): ``N(0, expert_bias_std)``
    (None: ``initializer_range``, as every other weight; the same draws either way, scaled), and step 3 scales
    ``down_proj_bias`` with w2, so that the block stays linear in what it scales.

    Raises:
        ValueError: ``attn_update_ratio`` or ``moe_update_ratio`` not positive.
        UnsupportedModelError: a config of a family mxlib does not quantize (``mxlib.models.families``).
    """
    family = family_of(config, where, name="config")
    if not attn_update_ratio > 0:
        raise ValueError(f"attn_update_ratio must be > 0, got {attn_update_ratio}")
    if moe_update_ratio is not None and not moe_update_ratio > 0:
        raise ValueError(f"moe_update_ratio must be > 0 or None, got {moe_update_ratio}")
    model = empty_moe_model(config, dtype, device, where=where)
    gen = torch.Generator(device=device).manual_seed(seed)
    std = config.initializer_range
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif expert_bias_std is not None and name.endswith(("experts.gate_up_proj_bias", "experts.down_proj_bias")):
            p.normal_(0.0, expert_bias_std, generator=gen)
        else:
            p.normal_(0.0, std, generator=gen)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's router bias, a buffer
            b.normal_(0.0, std, generator=gen)
    if expert_spread:
        for mlp in moe_layers(model):
            experts = getattr(mlp, family.experts_attr)
            z = torch.randn(family.num_experts(config), generator=gen, device=device)
            f = torch.exp(expert_spread * z)[:, None, None]
            experts.gate_up_proj.mul_(f.to(dtype))
            experts.down_proj.mul_((1.0 / (f * f)).to(dtype))
    if balanced_routing:
        _balance_routing(model, family, seed, attn_update_ratio, moe_update_ratio)
    return model


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x.float().pow(2).mean().sqrt()


def _shared_down_projs(block, family: MoEFamily) -> list[torch.nn.Linear]:
    """The ``down_proj`` linear layers of a block's shared experts (none in Qwen3-MoE / Mixtral / OLMoE)."""
    return [
        m
        for n, m in block.named_modules()
        if isinstance(m, torch.nn.Linear) and n.endswith("down_proj") and not n.startswith(family.experts_attr)
    ]


@torch.no_grad()
def _balance_routing(
    model, family: MoEFamily, seed: int, attn_update_ratio: float, moe_update_ratio: float | None = None
) -> None:
    """Steps 1 to 3 of ``dummy_moe_model``'s balanced routing, in one warm-up forward pass."""
    gen = torch.Generator().manual_seed(seed + WARMUP_SEED_OFFSET)
    ids = torch.randint(0, model.config.vocab_size, WARMUP_SHAPE, generator=gen)
    ids = ids.to(next(model.parameters()).device)
    residual_rms: dict[int, torch.Tensor] = {}
    handles = []

    def layer_in(i):
        def hook(module, args):
            residual_rms[i] = _rms(args[0])

        return hook

    def attn_out(i):
        def hook(module, args, out):
            w = module.weight
            gain = attn_update_ratio * residual_rms[i] / _rms(out)
            w.copy_((w.float() * gain).to(w.dtype))
            return torch.nn.functional.linear(args[0], w, module.bias)

        return hook

    mlp_residual_rms: dict[int, torch.Tensor] = {}

    def mlp_in(i):
        def hook(module, args):
            mlp_residual_rms[i] = _rms(args[0])

        return hook

    def moe_out(i):
        def hook(module, args, out):
            y = out[0] if isinstance(out, tuple) else out
            gain = moe_update_ratio * mlp_residual_rms[i] / _rms(y).clamp_min(torch.finfo(torch.float32).tiny)
            w2 = getattr(module, family.experts_attr).down_proj
            # expert by expert: a whole-layer fp32 copy (and its product) added ~1.6 GB at full
            # size and made this the e2e run's resident peak; same bits
            for x in range(w2.shape[0]):
                w2[x].copy_((w2[x].float() * gain).to(w2.dtype))
            b2 = getattr(getattr(module, family.experts_attr), "down_proj_bias", None)  # gpt-oss: the bias too
            if b2 is not None:
                b2.copy_((b2.float() * gain).to(b2.dtype))
            for lin in _shared_down_projs(module, family):  # the block is linear in every down_proj
                lin.weight.copy_((lin.weight.float() * gain).to(lin.weight.dtype))
            y = (y.float() * gain).to(y.dtype)  # the block is linear in w2 (up to w2's bf16 rounding)
            return (y, *out[1:]) if isinstance(out, tuple) else y

        return hook

    def router_in(module, args):
        x = args[0].reshape(-1, module.weight.shape[-1]).float()
        u = x.mean(0)
        u = u / u.norm().clamp_min(torch.finfo(torch.float32).tiny)
        w = module.weight.float()
        module.weight.copy_((w - (w @ u)[:, None] * u[None, :]).to(module.weight.dtype))

    moe = set(family.moe_layer_indices(model.config))
    try:
        for i, layer in enumerate(model.model.layers):
            handles.append(layer.input_layernorm.register_forward_pre_hook(layer_in(i)))
            handles.append(layer.self_attn.o_proj.register_forward_hook(attn_out(i)))
            if i not in moe:
                continue
            block = getattr(layer, family.block_attr)
            handles.append(getattr(block, family.router_attr).register_forward_pre_hook(router_in))
            if moe_update_ratio is not None:
                handles.append(layer.post_attention_layernorm.register_forward_pre_hook(mlp_in(i)))
                handles.append(block.register_forward_hook(moe_out(i)))
        model.model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()


def _experts_of(model, layer: int, where: str):
    family = family_of(model, where)
    if layer not in family.moe_layer_indices(model.config):
        raise ValueError(
            f"{where}: layer: expected an MoE layer of {family.architecture} "
            f"({family.moe_layer_indices(model.config)}), got {layer!r}"
        )
    return family, getattr(getattr(model.model.layers[layer], family.block_attr), family.experts_attr)


def expert_weights(model, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w13 [E, 2I, H], w2 [E, H, I])`` of decoder layer ``layer``'s experts, gate rows first.

    transformers' ``gate_up_proj [E, 2I, H]`` (gate rows, then up rows) and ``down_proj [E, H, I]``
    are returned as they are (no copy); a family with ``experts_orientation="interleaved_columns"``
    (gpt-oss's ``gate_up_proj [E, H, 2I]``, gate and up columns interleaved, ``down_proj [E, I, H]``)
    is transposed and de-interleaved into that orientation (a copy). Emulation experts swapped in
    (``TransformersExperts``) give their dequantized weights.

    Raises:
        ValueError: ``layer`` is not an MoE layer.
        UnsupportedModelError: a model of a family mxlib does not quantize.
    """
    family, ex = _experts_of(model, layer, "expert_weights")
    if isinstance(ex, TransformersExperts):
        return ex.experts.dequantized_weights()
    if family.experts_orientation == "gate_up_rows":
        return ex.gate_up_proj.data, ex.down_proj.data
    gu = ex.gate_up_proj.data.transpose(1, 2)  # [E, 2I, H], rows gate0, up0, gate1, ...
    return torch.cat([gu[:, 0::2], gu[:, 1::2]], 1).contiguous(), ex.down_proj.data.transpose(1, 2).contiguous()


def expert_biases(model, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(w13_bias [E, 2I] gate then up, w2_bias [E, H])`` of a family with ``expert_biases``, else None.

    Raises:
        ValueError: ``layer`` is not an MoE layer.
    """
    family, ex = _experts_of(model, layer, "expert_biases")
    if not family.expert_biases or isinstance(ex, TransformersExperts):
        return None
    b = ex.gate_up_proj_bias.data
    if family.experts_orientation == "interleaved_columns":
        b = torch.cat([b[:, 0::2], b[:, 1::2]], 1)
    return b, ex.down_proj_bias.data


def expert_activation(model_or_config) -> MoEActivation:
    """The experts' activation of a model or config of a registered family: ``MoEFamily.activation`` by name
    (``SILU``), SwiGLU-OAI with the config's ``swiglu_alpha`` / ``swiglu_limit`` where it carries them (gpt-oss,
    as transformers' ``GptOssExperts`` reads them; 1.702 and 7.0)."""
    family = family_of(model_or_config, "expert_activation")
    config = getattr(model_or_config, "config", model_or_config)
    act = get_activation(family.activation)
    if act.name != "swigluoai":
        return act
    alpha, limit = getattr(config, "swiglu_alpha", act.alpha), getattr(config, "swiglu_limit", act.limit)
    if (alpha, limit) == (act.alpha, act.limit):
        return act
    return MoEActivation("swigluoai", alpha=float(alpha), limit=None if limit is None else float(limit))


class BoundToModel:
    """``fn(model, ...)`` as a model's instance attribute (``model.save_pretrained``) that survives
    ``pickle`` and ``copy.deepcopy``: a bound method pickles as a lookup by name, which on
    unpickling would find the class's method instead."""

    def __init__(self, fn, model):
        self.fn, self.model = fn, model
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        return self.fn(self.model, *args, **kwargs)


def _refuse_save_pretrained(model, *args, **kwargs):
    raise ValueError(
        "save_pretrained: this model's experts were swapped in by mxlib.models.qwen3.swap_experts; they hold "
        "their weights in buffers outside transformers' parameters, so transformers' save_pretrained would write "
        "the model without them. Call mxlib.checkpoints.attach_checkpoint_layout(model) (quantized "
        "experts; the layout from their scheme, or layout=...) and save_pretrained writes that checkpoint layout; "
        "for a bf16 model, save it before swapping"
    )


def swap_experts(model, make_experts, where: str = "swap_experts") -> None:
    """Replace each MoE layer's experts module by ``TransformersExperts(make_experts(layer_index))``.

    Args:
        model: a transformers model of a registered family (its ``model.layers[i].mlp.experts`` are
            replaced in every MoE layer ``i``; routers, shared experts and dense MLPs stay).
        make_experts: ``decoder layer index -> TritonExperts`` (an emulation subclass, e.g. from
            ``make_emulation_experts(scheme, quantize_expert_weights(*expert_weights(model, i), scheme))``).
        where: the public entry a refusal names.

    Raises:
        TypeError: ``make_experts`` returned something other than a ``TritonExperts``.
        UnsupportedModelError: a model of a class mxlib does not quantize (``mxlib.models.families``).

    The experts' tensors are not transformers parameters, so the model's ``save_pretrained``
    then raises ``ValueError`` (naming why) instead of writing a model without experts, until
    ``mxlib.checkpoints.attach_checkpoint_layout(model)`` gives it a checkpoint layout
    (``load_quantized_moe`` does so for the models it returns).
    """
    check_supported_model(model, where)
    family = family_of(model, where)
    for i, mlp in moe_blocks(model, where):
        experts = make_experts(i)
        if not isinstance(experts, TritonExperts):
            raise TypeError(f"make_experts({i}) must return a TritonExperts, got {type(experts).__name__}")
        setattr(mlp, family.experts_attr, TransformersExperts(experts))
    model.save_pretrained = BoundToModel(_refuse_save_pretrained, model)
