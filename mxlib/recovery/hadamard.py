"""Block Hadamard rotation: experts' weights rotated offline along K, activations rotated online.

A rotation spreads an outlier over its block before the block's scale is chosen, so one large value
no longer sets a coarse step for its neighbours (QuaRot; FP-Quant / QuTLASS's block Hadamard sized to
the quantization group, with MR-GPTQ on top). Here, per layer:

* offline: ``w13 [E, 2I, H]`` is rotated along H and ``w2 [E, H, I]`` along I by the orthonormal block
  transform ``Q = D H_b / sqrt(b)`` (``mxlib.kernels.hadamard``: Sylvester ``H_b``, optional ±1 signs
  ``D``), in fp32, then quantized by the inner technique (round-to-nearest by default);
* online: a1 is rotated along H before its QDQ, a2 along I before its QDQ (the experts' ``rotation``,
  ``mxlib.moe.base``). Without quantization the forward is unchanged: ``(w Q) . (x Q) = w . x``.

``block_size`` defaults to the weight format's block (16 for NVFP4, 32 for OCP MX): each rotated
block is then exactly one quantization block. ``signs="random"`` draws one ±1 vector per axis (H and
I, shared by every layer and expert) from ``torch.Generator().manual_seed(seed)``.

What the checkpoint records (``config()``, stored under ``quantization_config["mxlib_recovery"]``)::

    {"kind": "block_hadamard", "block_size": 16, "signs": "random" | "none", "seed": 0,
     "signs_h": "<hex>", "signs_i": "<hex>", "inner": "rtn"}

The sign vectors themselves are stored (``encode_signs``: bit ``j % 8`` of byte ``j // 8`` is 1 where
sign ``j`` is -1, bytes as hex), not only the seed: a seed reproduces the signs only through torch's
CPU generator, which no other loader implements and torch does not promise to keep; the hex strings
are a few hundred bytes (H / 4 + I / 4 characters) and read back bit-exactly by any JSON reader. They
live in the config rather than as safetensors tensors so that the layouts' tensor sets stay the
producers' own (ModelOpt's and Quark's loaders refuse unexpected tensors). ``seed`` is kept as a record.

Limits: static activation scales (NVFP4's ``input_scale``) are calibrated on the activations the
calibration saw; a rotated block's amax can exceed the unrotated one (at most ``sqrt(b)`` times), so
calibrate on rotated activations or use per-token scales. An inner technique that weighs by
activation statistics needs them rotated too (``rotate_second_moments``).
"""

from __future__ import annotations

import copy

import torch

from ..kernels.hadamard import BlockHadamard, block_hadamard, check_rotation_block, ref_block_hadamard
from ..moe.emulation import ExpertWeights
from ..moe.schemes import MoEQuantScheme
from .base import RoundToNearest, WeightTechnique

__all__ = [
    "HadamardRotation",
    "BlockHadamard",
    "ref_block_hadamard",
    "block_hadamard",
    "random_signs",
    "encode_signs",
    "decode_signs",
    "rotation_from_config",
    "rotate_second_moments",
    "ROTATION_KIND",
]

ROTATION_KIND = "block_hadamard"
SIGN_CHOICES = (None, "random")


def random_signs(n: int, seed: int) -> torch.Tensor:
    """float32 ``[n]`` of ±1 from ``torch.Generator().manual_seed(seed)`` (CPU), ``2 * randint(0, 2) - 1``."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2, (n,), generator=g) * 2 - 1).to(torch.float32)


def encode_signs(signs: torch.Tensor) -> str:
    """A ±1 vector as hex: bit ``j % 8`` of byte ``j // 8`` set where ``signs[j]`` is -1."""
    neg = (signs.cpu() < 0).to(torch.uint8)
    pad = (-neg.numel()) % 8
    bits = torch.cat([neg, neg.new_zeros(pad)]).view(-1, 8)
    weights = torch.tensor([1 << j for j in range(8)], dtype=torch.int32)
    return bytes((bits.to(torch.int32) * weights).sum(1).to(torch.uint8).tolist()).hex()


def decode_signs(text, n: int, field: str) -> torch.Tensor:
    """``encode_signs``'s inverse: float32 ``[n]`` of ±1.

    Raises:
        ValueError: naming ``field``: not a hex string, or not ``2 * ceil(n / 8)`` characters long.
    """
    want = 2 * ((n + 7) // 8)
    if not isinstance(text, str) or len(text) != want:
        got = f"{len(text)} characters" if isinstance(text, str) else repr(text)[:40]
        raise ValueError(f"{field}: expected a hex string of {want} characters ({n} signs), got {got}")
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"{field}: not a hex string: {text[:40]!r}") from None
    b = torch.tensor(list(raw), dtype=torch.int32)
    bits = (b[:, None] >> torch.arange(8, dtype=torch.int32)) & 1
    return (1 - 2 * bits.reshape(-1)[:n]).to(torch.float32)


def rotate_second_moments(m: torch.Tensor, block_size: int, signs: torch.Tensor | None = None) -> torch.Tensor:
    """``Qᵀ M Q`` for ``M [..., K, K]`` (a sum of ``x xᵀ`` over activations ``x``): the second moments of
    the rotated activations ``x Q`` (fp32, or float64 for a float64 ``M``)."""
    mq = ref_block_hadamard(m, block_size, signs, out_dtype=torch.float64 if m.dtype == torch.float64 else None)
    return ref_block_hadamard(mq.transpose(-1, -2).contiguous(), block_size, signs).transpose(-1, -2)


class RotatedSecondMoments:
    """Calibration statistics in the rotated basis, for an inner technique that weighs by them (GPTQ's
    ``hessians``, the MSE search's ``importance``): ``w13(layer)`` is ``Qᵀ H Q`` along H, ``w2(layer)`` along I,
    ``diagonal(layer)`` their diagonals, ``tokens(layer)`` unchanged. A rotated weight ``w Q`` sees inputs
    ``x Q``, whose second moments these are.

    Raises:
        ValueError: (at use) a source without the full matrices ``w13`` / ``w2`` (a diagonal alone does not
            rotate).
    """

    def __init__(self, source, block_size: int, signs_h: torch.Tensor | None, signs_i: torch.Tensor | None):
        self.source, self.block_size, self.signs_h, self.signs_i = source, block_size, signs_h, signs_i

    def _full(self, which: str, layer: int) -> torch.Tensor:
        get = getattr(self.source, which, None)
        if not callable(get):
            raise ValueError(
                f"a rotated technique's statistics: {type(self.source).__name__} has no {which}(layer) matrix; "
                "a rotation needs the full second moments (mxlib.models.hessians.collect_expert_hessians)"
            )
        m = get(layer)
        signs = self.signs_h if which == "w13" else self.signs_i
        return rotate_second_moments(m, self.block_size, None if signs is None else signs.to(m.device))

    def w13(self, layer: int) -> torch.Tensor:
        return self._full("w13", layer)

    def w2(self, layer: int) -> torch.Tensor:
        return self._full("w2", layer)

    def tokens(self, layer: int) -> torch.Tensor:
        return self.source.tokens(layer)

    def diagonal(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.w13(layer).diagonal(dim1=-2, dim2=-1), self.w2(layer).diagonal(dim1=-2, dim2=-1)


# the attributes through which an inner technique reads calibration statistics
_STATISTICS = ("hessians", "importance")


class HadamardRotation:
    """Block Hadamard rotation around an inner technique (``get_technique("X+hadamard")`` builds it).

    Args:
        inner: the ``WeightTechnique`` that quantizes the rotated weights (None: ``RoundToNearest()``). It is
            never changed: its calibration statistics are rotated on a shallow copy, per call.
        block_size: ``b``, a power of two dividing H and I; None: the scheme's weight block size
            (16 NVFP4, 32 OCP MX), fixed at the first ``quantize_experts``.
        signs: None (plain block Hadamard) or ``"random"`` (one ±1 vector per axis from ``seed``).
        seed: the random seed of the signs.

    Raises:
        ValueError: a ``signs`` other than None / ``"random"``; a block size that is not a power of two;
            (at ``quantize_experts``) one that does not divide H or I, or sizes that change between layers.
        TypeError: an ``inner`` that is not a ``WeightTechnique``.
    """

    name = "hadamard"

    def __init__(
        self, inner: WeightTechnique | None = None, block_size: int | None = None, signs: str | None = None, seed=0
    ):
        if signs not in SIGN_CHOICES:
            raise ValueError(f"signs: expected None or 'random', got {signs!r}")
        if block_size is not None:
            check_rotation_block(block_size, block_size)
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(f"seed: expected an int, got {type(seed).__name__}")
        inner = RoundToNearest() if inner is None else inner
        if not isinstance(inner, WeightTechnique):
            raise TypeError(f"inner: expected a WeightTechnique, got {type(inner).__name__}")
        self.inner, self.block_size, self.signs, self.seed = inner, block_size, signs, seed
        self._rotation: BlockHadamard | None = None
        self._sizes: tuple[int, int] | None = None

    def rotation_for(self, hidden_size: int, intermediate_size: int, scheme: MoEQuantScheme) -> BlockHadamard:
        """The ``BlockHadamard`` of layers of these sizes (made once, the same for every layer; signs on the CPU)."""
        if self._rotation is None:
            b = self.block_size or scheme.weight.block_size
            sh = si = None
            if self.signs == "random":
                sh, si = random_signs(hidden_size, self.seed), random_signs(intermediate_size, self.seed + 1)
            rotation = BlockHadamard(b, sh, si)
            rotation.check(hidden_size, intermediate_size)
            self._rotation, self._sizes = rotation, (hidden_size, intermediate_size)
        elif self._sizes != (hidden_size, intermediate_size):
            raise ValueError(
                f"w13/w2: H, I = {hidden_size}, {intermediate_size}, earlier layers had {self._sizes}: one rotation "
                f"serves layers of one size"
            )
        return self._rotation

    def quantize_experts(
        self, w13: torch.Tensor, w2: torch.Tensor, scheme: MoEQuantScheme, *, layer: int
    ) -> ExpertWeights:
        """The inner technique's ``ExpertWeights`` of ``w13`` rotated along H and ``w2`` along I (fp32)."""
        r = self.rotation_for(w13.shape[-1], w2.shape[-1], scheme)
        sh, si = (None if s is None else s.to(w13.device) for s in (r.signs_h, r.signs_i))
        w13r = ref_block_hadamard(w13, r.block_size, sh, out_dtype=torch.float32)
        w2r = ref_block_hadamard(w2, r.block_size, si, out_dtype=torch.float32)
        return self._rotated_inner(r).quantize_experts(w13r, w2r, scheme, layer=layer)

    def _rotated_inner(self, r: BlockHadamard) -> WeightTechnique:
        """A shallow copy of the inner technique whose calibration statistics (``hessians``, ``importance``)
        are seen in the rotated basis (``RotatedSecondMoments``); ``self.inner`` itself is never changed, so a
        technique passed in can be used again, alone or wrapped, and gives the codes it gave before. Made per
        call, so statistics replaced on ``self.inner`` are followed."""
        stats = {a: getattr(self.inner, a, None) for a in _STATISTICS}
        stats = {a: v for a, v in stats.items() if v is not None and not isinstance(v, RotatedSecondMoments)}
        if not stats:
            return self.inner
        inner = copy.copy(self.inner)
        for attr, source in stats.items():
            setattr(inner, attr, RotatedSecondMoments(source, r.block_size, r.signs_h, r.signs_i))
        return inner

    def config(self) -> dict:
        """The rotation a loader applies (module docstring), with the inner technique's name and config.

        Raises:
            RuntimeError: before the first ``quantize_experts`` (the block size and signs depend on the
                scheme and the sizes).
        """
        r = self._rotation
        if r is None:
            raise RuntimeError("HadamardRotation.config(): the rotation is fixed by the first quantize_experts call")
        out = {"kind": ROTATION_KIND, "block_size": r.block_size, "signs": self.signs or "none"}
        if self.signs == "random":
            out.update(seed=self.seed, signs_h=encode_signs(r.signs_h), signs_i=encode_signs(r.signs_i))
        out["inner"] = self.inner.name
        inner_config = self.inner.config()
        if inner_config:
            out["inner_config"] = inner_config
        return out


def rotation_from_config(config, hidden_size: int, intermediate_size: int) -> BlockHadamard | None:
    """The ``BlockHadamard`` a checkpoint's ``mxlib_recovery`` entry asks for; None for an entry without
    ``kind`` (a technique that changes only the chosen codes and scales).

    Raises:
        ValueError: naming the field (``mxlib_recovery.kind``, ``.block_size``, ``.signs``, ``.signs_h``,
            ``.signs_i``), the value found and what is supported.
    """
    f = "mxlib_recovery"
    if not isinstance(config, dict):
        raise ValueError(f"{f}: expected an object, found {type(config).__name__}")
    kind = config.get("kind")
    if kind is None:
        if config.get("technique") == HadamardRotation.name:
            raise ValueError(f"{f}.kind: missing (technique 'hadamard' rotates; expected {ROTATION_KIND!r})")
        return None
    if kind != ROTATION_KIND:
        raise ValueError(f"{f}.kind: mxlib runs rotations of kind {ROTATION_KIND!r}, found {kind!r}")
    b = config.get("block_size")
    try:
        check_rotation_block(b, hidden_size, "hidden_size")
        check_rotation_block(b, intermediate_size, "intermediate_size")
    except ValueError as err:
        raise ValueError(f"{f}.block_size: {err} (found {b!r})") from None
    signs = config.get("signs")
    if signs == "none":
        return BlockHadamard(b)
    if signs != "random":
        raise ValueError(f"{f}.signs: expected 'none' or 'random', found {signs!r}")
    for key in ("signs_h", "signs_i"):
        if key not in config:
            raise ValueError(f"{f}.{key}: missing (a rotation with random signs stores them)")
    return BlockHadamard(
        b,
        decode_signs(config["signs_h"], hidden_size, f"{f}.signs_h"),
        decode_signs(config["signs_i"], intermediate_size, f"{f}.signs_i"),
    )
