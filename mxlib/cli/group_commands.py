"""The group-attribution command: ``attribute-groups [PATH]``, which precision group of a mixed-precision checkpoint
costs what (``mxlib.studies.group_attribution.attribute_groups``), printed as ``group_table``.

Two sources:

* ``PATH --reference DIR``: a mixed-precision checkpoint folder (``load_quantized_moe``) and the bf16 checkpoint
  folder it was quantized from (transformers' ``from_pretrained``, local files only, bf16);
* no ``PATH``: the seeded dummy Qwen3-MoE of ``--preset`` / ``--layers`` / ``--seed``, written as a mixed checkpoint
  of ``--producer`` with ``--experts`` / ``--attention`` / ``--lm-head`` schemes (``write_mixed_checkpoint``,
  calibrated on ``--calib-tokens`` seeded tokens) in a temporary folder, loaded back.

The token ids are ``--draws`` seeded sets of ``[1, --tokens]`` (set ``r`` drawn with seed ``--seed + 1 + r``); with
two draws or more the decisions are over the draws. ``--targets GROUP=SCHEME,...`` adds ``<g> as <scheme>``
configurations; targets with static activation scales take the reference's calibration on the calibration tokens.

A command's ``check`` runs before any work (a ValueError or FileNotFoundError names the option); a group name that
is not the checkpoint's is refused once the checkpoint is read (a ``CheckpointError``, one line, naming the option
and the checkpoint's groups). The JSON result is ``attribute_groups``' own dict with the stored schemes of the
groups (``schemes``) and the source (``source``).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from ..checkpoints import CheckpointError, load_quantized_moe, read_quant_config, write_mixed_checkpoint
from ..checkpoints.mixed import producer_layout
from ..checkpoints.writer import attention_linears
from ..models.calibration import calibrate
from ..moe.linear import linear_input_amax
from ..moe.schemes import get_moe_scheme
from ..studies import group_attribution as G
from ..studies import steps as W

__all__ = ["COMMANDS"]

# the options that build the dummy model's mixed checkpoint, and their defaults (notebook 06's mixed example)
DUMMY_DEFAULTS = {
    "producer": "quark",
    "experts": "w_mxfp4_a_mxfp4",
    "attention": "w_mxfp8_a_mxfp8",
    "lm_head": "w_mxfp8_a_mxfp8",
}
_OPTION = {"producer": "--producer", "experts": "--experts", "attention": "--attention", "lm_head": "--lm-head"}


def _parse_targets(items: list[str] | None) -> dict[str, list[str]]:
    """``GROUP=SCHEME`` items -> ``{group: [scheme, ...]}`` (a group may be named more than once); each scheme is
    ``bf16`` or a scheme ``get_moe_scheme`` knows."""
    out: dict[str, list[str]] = {}
    for item in items or []:
        group, sep, scheme = item.rpartition("=")
        if not sep or not group or not scheme:
            raise ValueError(
                f"--targets: expected GROUP=SCHEME items (e.g. '*.self_attn.*=w_mxfp4_a_mxfp4'), got {item!r}"
            )
        if scheme != G.BF16:
            try:
                get_moe_scheme(scheme)
            except ValueError as err:
                raise ValueError(f"--targets: {item!r}: {err}") from None
        out.setdefault(group, []).append(scheme)
    return out


def check_attribute_groups(args) -> None:
    """The source (``PATH`` with ``--reference``, or the dummy model's options), the targets, the device and the
    ``--json`` path, before anything is built."""
    if args.path is not None:
        path = Path(args.path)
        if not path.is_dir():
            raise FileNotFoundError(
                f"path: {args.path!r} is not a folder; expected a mixed-precision checkpoint folder"
            )
        given = [_OPTION[k] for k in DUMMY_DEFAULTS if getattr(args, k) is not None]
        if given:
            raise ValueError(
                f"{', '.join(given)}: build the dummy model's checkpoint; with PATH the checkpoint is given"
            )
        if args.reference is None:
            raise ValueError("--reference: PATH needs the bf16 checkpoint folder it was quantized from")
        ref = Path(args.reference)
        if not (ref / "config.json").is_file():
            raise FileNotFoundError(
                f"--reference: {args.reference!r} has no config.json; expected a bf16 checkpoint folder"
            )
        info = read_quant_config(path)  # a CheckpointError here is the command's one-line error
        if info.precision is None:
            raise ValueError(
                f"path: {args.path!r} is a single-scheme checkpoint ({info.scheme.name}); group attribution needs a "
                f"mixed-precision one (several precision groups)"
            )
    else:
        if args.reference is not None:
            raise ValueError("--reference: given without PATH; the dummy model is its own reference")
        for key, default in DUMMY_DEFAULTS.items():
            value = getattr(args, key)
            if value is None:
                setattr(args, key, default)
            elif key != "producer" and value != "none":
                try:
                    scheme = get_moe_scheme(value)
                except ValueError as err:
                    raise ValueError(f"{_OPTION[key]}: {err}") from None
                if key == "experts" and scheme.linear_only:
                    raise ValueError(f"--experts: {value} is a linear-layer scheme; the experts take block-scaled ones")
                try:
                    producer_layout(args.producer, scheme, _OPTION[key])
                except ValueError as err:
                    raise ValueError(f"{_OPTION[key]}: {str(err).split(': ', 1)[1]}") from None
        if args.attention == "none" and args.lm_head == "none":
            raise ValueError(
                "--attention, --lm-head: both 'none' leaves one precision group (the experts); group attribution "
                "needs a mixed checkpoint of at least two"
            )
    args.target_map = _parse_targets(args.targets)
    args.params_device = W.check_device(args.device, "--device")
    W.prepare_results_path(args.json, "--json")


def _checked_groups(model, args) -> None:
    found = G.precision_groups(model)
    groups = list(found)
    for option, names in (("--targets", list(args.target_map)), ("--order", args.order or [])):
        bad = [n for n in names if n not in groups]
        if bad:
            raise CheckpointError(f"{option}: {bad} not precision groups of this checkpoint; its groups: {groups}")
    if args.order and sorted(args.order) != sorted(groups):
        raise CheckpointError(f"--order: expected every precision group once, in any order: {groups}; got {args.order}")
    for g, targets in args.target_map.items():
        holds_experts = any(m.endswith(".experts") for m in found[g])
        for t in targets:
            if t != G.BF16 and holds_experts and get_moe_scheme(t).linear_only:
                raise CheckpointError(
                    f"--targets: {g}={t}: {t} is a linear-layer scheme and group {g!r} holds routed experts"
                )


def _schemes(info, groups) -> dict[str, str]:
    pm = info.precision
    return {g: (pm.groups[g].scheme.name if g in pm.groups and pm.groups[g].scheme else "-") for g in groups}


def attribute_groups_cmd(args) -> dict:
    """``attribute-groups``: the per-group table on stdout; ``attribute_groups``' result as the JSON result."""
    dev = args.params_device
    with tempfile.TemporaryDirectory(prefix="mxlib-groups-") as tmp:
        if args.path is None:
            reference = W.dummy_model(args.layers, seed=args.seed, device="cpu", model_preset=args.preset)
            source = {
                "dummy": args.preset,
                "layers": args.layers,
                "seed": args.seed,
                **{k: getattr(args, k) for k in DUMMY_DEFAULTS},
            }
            path = Path(tmp) / "mixed"
        else:
            from transformers import AutoModelForCausalLM

            reference = AutoModelForCausalLM.from_pretrained(
                args.reference, dtype=torch.bfloat16, local_files_only=True
            )
            source = {"path": str(args.path), "reference": str(args.reference)}
            path = Path(args.path)
        reference.eval()
        vocab = reference.config.get_text_config().vocab_size
        calib_ids = W.random_token_ids(args.calib_tokens, args.seed + 1000, vocab)
        linears = attention_linears(reference) + ["lm_head"]
        need_calibration = args.path is None or any(
            s != G.BF16 and get_moe_scheme(s).static_activation_scale for ts in args.target_map.values() for s in ts
        )
        cal = calibrate(reference, calib_ids) if need_calibration else None
        amax = linear_input_amax(reference, calib_ids, linears) if need_calibration else None
        if args.path is None:
            plan = {k: (None if getattr(args, k) == "none" else getattr(args, k)) for k in ("attention", "lm_head")}
            write_mixed_checkpoint(
                reference, args.producer, path, args.experts, plan["attention"], plan["lm_head"], cal,
                linear_input_amax=amax,
            )  # fmt: skip
        model, info = load_quantized_moe(path, backend=args.backend, device=dev)
        reference.to(dev)
        _checked_groups(model, args)
        draws = [W.random_token_ids(args.tokens, args.seed + 1 + r, vocab).to(dev) for r in range(args.draws)]
        t0 = time.perf_counter()
        try:
            result = G.attribute_groups(
                model,
                reference,
                draws[0] if len(draws) == 1 else draws,
                targets=args.target_map or None,
                order=args.order,
                calibration=cal,
                linear_input_amax=amax,
            )
        except ValueError as err:  # a reference that does not fit the checkpoint: the command's one-line error
            if not str(err).startswith(("reference:", "switch[")):
                raise
            raise CheckpointError(str(err)) from None
        seconds = time.perf_counter() - t0
    schemes = _schemes(info, result["groups"])
    print(G.group_table(result, schemes))
    print(f"{len(result['plan']['configs'])} configurations in {seconds:.1f} s")
    return {**result, "schemes": schemes, "source": source, "total_seconds": seconds}


COMMANDS = {"attribute-groups": (check_attribute_groups, attribute_groups_cmd)}
