"""Accuracy-recovery techniques: better scales and codes in the same formats, chosen offline.

Each technique is a pure-PyTorch reference (the oracle of its kind) and a ``WeightTechnique``
(``mxlib.recovery.base``) the checkpoint writer calls per layer
(``write_quantized_checkpoint(..., technique=...)``). ``TECHNIQUES`` maps a name to the factory of
its technique; ``get_technique(name, **options)`` builds one.
"""

from __future__ import annotations

from collections.abc import Callable

from .base import RECOVERY_CONFIG_KEY, RoundToNearest, WeightTechnique
from .hadamard import HadamardRotation

__all__ = ["TECHNIQUES", "get_technique", "WeightTechnique", "RoundToNearest", "RECOVERY_CONFIG_KEY"]

TECHNIQUES: dict[str, Callable[..., WeightTechnique]] = {
    "rtn": RoundToNearest,
    "hadamard": HadamardRotation,
}


def get_technique(technique: str | WeightTechnique, **options) -> WeightTechnique:
    """The technique named ``technique`` built with ``options`` (an instance is returned as it is).

    Raises:
        ValueError: an unknown name (the message lists ``TECHNIQUES``), or options given with an instance.
    """
    if isinstance(technique, WeightTechnique) and not isinstance(technique, str):
        if options:
            raise ValueError(f"technique: options {sorted(options)} given with an already built technique")
        return technique
    if technique not in TECHNIQUES:
        raise ValueError(f"technique: expected one of {sorted(TECHNIQUES)}, got {technique!r}")
    return TECHNIQUES[technique](**options)
