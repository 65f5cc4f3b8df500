"""The option values of ``mxlib``'s commands, spelled out so that ``--help`` imports neither torch nor
transformers, and the argparse types that check numbers and comma-separated lists as they are parsed.

Each tuple is a copy of a library table (``tests/test_cli.py`` checks that it equals the table):
``SCHEMES`` of ``mxlib.moe.MOE_SCHEMES`` (with ``SCHEME_ALIASES`` those ``get_moe_scheme`` also
accepts), ``STRATEGIES`` of ``mxlib.moe.SCALE_STRATEGIES``, ``BACKENDS`` of ``mxlib.moe.BACKENDS``,
``LAYOUTS`` of ``mxlib.checkpoints.LAYOUTS``, ``LINEAR_SCHEMES`` of ``mxlib.moe.schemes.FP8_LINEAR_SCHEMES``,
``PRODUCERS`` of ``mxlib.checkpoints.mixed.PRODUCER_LAYOUTS``, ``PRESETS`` of ``mxlib.models.qwen3.MODEL_PRESETS``,
``TECHNIQUES`` of ``mxlib.recovery.TECHNIQUES``.
A type's error (``argparse.ArgumentTypeError``) becomes ``mxlib CMD: error: argument --OPTION: ...``.
"""

from __future__ import annotations

import argparse
import math

__all__ = [
    "SCHEMES",
    "SCHEME_ALIASES",
    "STRATEGIES",
    "BACKENDS",
    "LAYOUTS",
    "LINEAR_SCHEMES",
    "PRODUCERS",
    "PRESETS",
    "FULL_PRESET",
    "TECHNIQUES",
    "positive_int",
    "nonnegative_int",
    "nonnegative_float",
    "comma_list",
]

SCHEMES = (
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
    "nvfp4",
    "w4a16_nvfp4",
)
SCHEME_ALIASES = (
    "w_nvfp4_a_nvfp4",
    "modelopt_fp4",
    "w_fp4_a_fp4",
    "w_fp4_a_fp6_e3m2",
    "w_fp4_a_fp6_e2m3",
    "w_fp6_e3m2_a_fp6_e3m2",
    "w_fp6_e2m3_a_fp6_e2m3",
    "mxfp4_weight_only",
    "mxfp4_fp8",
    "mxfp4_mxfp6_e2m3",
    "w_mx_fp8_a_mx_fp8",
    "W4A16_NVFP4",
    "NVFP4A16",
    "nvfp4_w4a16",
    "w_nvfp4",
    "NVFP4",
    "MXFP4A16",
    "MXFP4",
    "MXFP8A16",
    "MXFP8",
)
STRATEGIES = ("max", "per_expert", "mean", "median", "p90", "p75", "p50")
BACKENDS = ("auto", "triton", "fused", "torch")
LAYOUTS = (
    "modelopt",
    "quark",
    "compressed-tensors",
    "compressed-tensors-mxfp4",
    "modelopt-mxfp8",
    "compressed-tensors-mxfp8",
    "gpt-oss-mxfp4",
    "modelopt-fp8",
    "quark-fp8",
    "compressed-tensors-fp8",
)
LINEAR_SCHEMES = ("w_fp8_a_fp8", "w_fp8_a_fp8_per_token")
PRODUCERS = ("modelopt", "quark", "compressed-tensors")
PRESETS = ("qwen3-30b-a3b", "small", "tiny")
FULL_PRESET = "qwen3-30b-a3b"  # the full-size model (no overrides)
TECHNIQUES = ("rtn", "four_over_six", "mse", "four_over_six_mse", "gptq", "hadamard")


def positive_int(text: str) -> int:
    """An integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def nonnegative_int(text: str) -> int:
    """An integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def nonnegative_float(text: str) -> float:
    """A finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def comma_list(choices: tuple[str, ...] | None = None, item=str, extra: tuple[str, ...] = ()):
    """An argparse type: a comma-separated list, each item one of ``choices`` (or of ``extra``) or, for
    ``item`` a type function such as ``nonnegative_float``, converted by it. Returns a list."""

    def parse(text: str) -> list:
        items = [t.strip() for t in text.split(",")]
        if not text.strip() or any(not t for t in items):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list without empty items, got {text!r}")
        if choices is not None:
            bad = [t for t in items if t not in choices and t not in extra]
            if bad:
                raise argparse.ArgumentTypeError(
                    f"expected a comma-separated list of {', '.join(choices)}; got {', '.join(bad)} in {text!r}"
                )
            return items
        try:
            return [item(t) for t in items]
        except argparse.ArgumentTypeError as err:
            raise argparse.ArgumentTypeError(f"{err} in {text!r}") from None

    parse.__name__ = "list"  # argparse names the type in some messages
    return parse
