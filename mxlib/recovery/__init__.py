"""Accuracy-recovery techniques: better scales and codes in the same formats, chosen offline.

Each technique is a pure-PyTorch reference (the oracle of its kind) and a ``WeightTechnique``
(``mxlib.recovery.base``) the checkpoint writer calls per layer
(``write_quantized_checkpoint(..., technique=...)``). ``TECHNIQUES`` maps a name to the factory of
its technique; ``get_technique(name, **options)`` builds one, and ``"X+hadamard"`` builds the
rotation around technique ``X`` (``compose_technique``).

The techniques, one module each: ``four_over_six`` (4/6: each NVFP4 block scaled to e2m1's max 6 or to 4),
``scale_search`` (MSE-optimal block scales among candidates), ``gptq`` (GPTQ for microscaled FP4 / FP6 weights:
codes chosen column by column with error feedback), ``hadamard`` (a block Hadamard rotation, undone online on the
activations) and ``gate_up`` (the gate and up halves' ``weight_scale_2`` reconciled); ``base`` holds
``WeightTechnique`` and what the techniques share.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from .base import RECOVERY_CONFIG_KEY, RoundToNearest, WeightTechnique
from .four_over_six import FourOverSix
from .gptq import GPTQ
from .hadamard import HadamardRotation
from .scale_search import FourOverSixMSE, MSEScaleSearch

__all__ = [
    "TECHNIQUES",
    "ROTATIONS",
    "get_technique",
    "WeightTechnique",
    "RoundToNearest",
    "FourOverSix",
    "MSEScaleSearch",
    "FourOverSixMSE",
    "GPTQ",
    "HadamardRotation",
    "RECOVERY_CONFIG_KEY",
]

TECHNIQUES: dict[str, Callable[..., WeightTechnique]] = {
    "rtn": RoundToNearest,
    "four_over_six": FourOverSix,
    "mse": MSEScaleSearch,
    "four_over_six_mse": FourOverSixMSE,
    "gptq": GPTQ,
    "hadamard": HadamardRotation,
}

# Techniques that wrap another (``inner=``) and change the forward: in a composed name they come
# last, outermost (the rotation is applied to the weights before the inner technique quantizes).
ROTATIONS = ("hadamard",)


def _named(name: str, options: dict) -> WeightTechnique:
    if name not in TECHNIQUES:
        raise ValueError(f"technique: expected one of {sorted(TECHNIQUES)}, got {name!r}")
    return TECHNIQUES[name](**options)


def _composed(technique: str, options: dict) -> WeightTechnique:
    parts = technique.split("+")
    inner, outer = parts[0], parts[-1]
    if len(parts) != 2 or not inner or outer not in ROTATIONS or inner in ROTATIONS:
        raise ValueError(
            f"technique: a composition is 'X+R' with X one of {sorted(set(TECHNIQUES) - set(ROTATIONS))} and the "
            f"rotation R one of {list(ROTATIONS)} last (outermost), got {technique!r}"
        )
    if outer not in TECHNIQUES:
        raise ValueError(f"technique: rotation {outer!r} of {technique!r} is not registered; have {sorted(TECHNIQUES)}")
    factory = TECHNIQUES[outer]
    # an option the rotation's factory names goes to the rotation, every other to the inner technique
    params = inspect.signature(factory).parameters
    mine = {k: v for k, v in options.items() if k in params and k != "inner"}
    rest = {k: v for k, v in options.items() if k not in mine}
    return factory(inner=_named(inner, rest), **mine)


def get_technique(technique: str | WeightTechnique, **options) -> WeightTechnique:
    """The technique named ``technique`` built with ``options`` (an instance is returned as it is).

    ``"X+hadamard"`` builds ``TECHNIQUES["hadamard"](inner=get_technique("X", ...))``: the
    rotation outermost. Options the rotation's factory names in its signature go to it, the
    others to ``X``.

    Raises:
        ValueError: an unknown name (the message lists ``TECHNIQUES``), a composition in another
            order or of more than two parts, or options given with an instance.
    """
    if isinstance(technique, WeightTechnique) and not isinstance(technique, str):
        if options:
            raise ValueError(f"technique: options {sorted(options)} given with an already built technique")
        return technique
    if not isinstance(technique, str):
        raise ValueError(f"technique: expected a name or a WeightTechnique, got {type(technique).__name__}")
    if "+" in technique:
        return _composed(technique, options)
    return _named(technique, options)
