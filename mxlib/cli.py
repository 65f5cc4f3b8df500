"""The notebooks' code paths as commands, for machines without Jupyter (the H200 image).

``python -m mxlib.cli e2e --scheme nvfp4 --layers 4 --device cuda --json out.json``
``python -m mxlib.cli compare --layers 4 --device cuda --json out.json``
``python -m mxlib.cli unify --layers 4 --spread 1.0 --device cuda --json out.json``
``python -m mxlib.cli inspect CHECKPOINT_DIR --json report.json`` (configs and scale tensors only)
``python -m mxlib.cli dummy-from-config CONFIG_DIR OUT_DIR --layers 2 --preset tiny``
``python -m mxlib.cli routing --layers 4 --preset small --json out.json``

Each calls the same ``mxlib.workbook.steps`` / ``mxlib.workbook.studies`` functions as its notebook
(01, 03 and 04) and prints a summary. Every option is checked, and a scheme name resolved to its
``MoEQuantScheme``, before anything is built (``_check_args``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings

import torch

from .formats import NVFP4_SUBNORMAL_RATIO
from .models.checkpoints import (
    checkpoint_size_bytes,
    dummy_checkpoint_from_config,
    inspect_checkpoint,
    load_quantized_qwen3_moe,
)
from .models.qwen3 import moe_layers
from .moe import SCALE_STRATEGIES
from .workbook import steps as W
from .workbook import studies as S
from .workbook.checks import strategy_summary


def e2e(args) -> dict:
    """Notebook 01's steps (``mxlib.workbook.steps``) on ``args.params``, the checked options."""
    p = args.params
    dev, scheme = p.device, p.scheme
    t0 = time.perf_counter()
    model = W.build_model(p)
    t_model = time.perf_counter() - t0
    t0 = time.perf_counter()
    ckpt = W.write_checkpoint(p, model)
    t_ckpt = time.perf_counter() - t0
    ids = W.evaluation_token_ids(p, model.config.vocab_size)
    # the bf16 reference runs first and is freed before the quantized model is loaded, so that
    # the two never share memory (peak resident memory ~ the bf16 model's bytes)
    W.run_model(model, ids)
    ref = W.run_model(model, ids)  # timed warm (the first call compiles kernels)
    del model
    W.release_freed_memory()  # with MALLOC_MMAP_THRESHOLD_ set (the Makefile) the freed model stays resident otherwise
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model_q, info = W.load_checkpoint(p, ckpt)
    W.run_model(model_q, ids)
    out = W.run_model(model_q, ids)
    res = W.compare_runs(out, ref)
    fused = None
    if dev.type == "cuda":  # the same model with the fused experts (same numerics within GEMM rounding)
        for mlp in moe_layers(model_q):
            mlp.experts.experts.backend = "fused"
        W.run_model(model_q, ids)
        fused = W.run_model(model_q, ids)
        res["fused_logits"] = W.compare_runs(fused, ref)["logits"]
    result = dict(
        scheme=scheme.name,
        layers=args.layers,
        tokens=args.tokens,
        device=str(dev),
        backend=args.backend,
        logits=res["logits"],
        layers_metrics=res["layers"],
        seconds_bf16=ref.seconds,
        seconds_emulated=out.seconds,
        seconds_emulated_fused=fused.seconds if fused else None,
        fused_logits=res.get("fused_logits"),
        seconds_build=t_model,
        seconds_checkpoint=t_ckpt,
        checkpoint_bytes=checkpoint_size_bytes(ckpt),
    )
    print(
        f"[e2e] {scheme.name} L{args.layers} {dev}: logits {res['logits']}, forward bf16 {ref.seconds:.3f} s, "
        f"emulated {out.seconds:.3f} s; layers " + ", ".join(f"{r['sqnr_db']:.2f}" for r in res["layers"])
    )
    return result


def compare(args) -> dict:
    """Notebook 03's study on ``args.moe_schemes`` (resolved from ``--schemes`` by ``_check_args``)."""
    dev = args.params.device
    model = W.dummy_model(args.layers, seed=args.seed, device=dev)
    cal = W.calibrate_model(model, args.calib_tokens, args.seed)
    ids = W.evaluation_token_ids(args.params, model.config.vocab_size)
    rows = S.compare_schemes(model, args.moe_schemes, ids, cal, backend=args.backend)
    return dict(layers=args.layers, tokens=args.tokens, device=str(dev), rows=rows)


def unify(args) -> dict:
    """Notebook 04's studies: unification, expert outputs, end to end and the spread sweep."""
    dev = args.params.device
    strategies = args.strategies.split(",")
    model = W.dummy_model(args.layers, seed=args.seed, expert_spread=args.spread, device=dev)
    cal = W.calibrate_model(model, args.calib_tokens, args.seed, keep_activations=True)
    st = S.unification_study(cal, strategies)
    eo = S.expert_output_study(model, cal, strategies, layers=range(min(args.output_layers, args.layers)))
    ids = W.evaluation_token_ids(args.params, model.config.vocab_size)
    e2e_rows = S.end_to_end_strategies(model, cal, strategies, ids, backend=args.backend)
    del model
    spreads = [float(s) for s in args.spreads.split(",")]
    sp = S.spread_study(spreads, num_hidden_layers=1, seed=args.seed, calib_tokens=args.calib_tokens, device=dev)
    for r in e2e_rows:
        print(
            f"[unify] {r['strategy']:>10s}: logits SQNR {r['sqnr_db']:.2f} dB top-1 {r['top1_agreement']:.3f} "
            f"KL {r['kl_divergence']:.2e}"
        )
    for r in sp:
        print(f"[unify] spread {r['spread']}: {r['point']} mean dB lost by max {r['mean_db_lost']:.3f}")
    summary = strategy_summary(st["experts"], strategies)  # notebook 04's table
    for r in summary:
        lost = (
            f", dB lost mean {r['mean_db_lost']:.3f} worst {r['worst_db_lost']:.3f}, subnormal blocks "
            f"{r['subnormal_blocks']:.4f}"
            if "mean_db_lost" in r
            else ""
        )
        print(f"[unify] {r['point']} {r['strategy']}: mean SQNR {r['mean_sqnr_db']:.2f} dB{lost}")
    # experts whose largest e4m3 block scale is subnormal under the max strategy
    deep = [r for r in st["experts"] if r["scale_ratio"] < NVFP4_SUBNORMAL_RATIO]
    return dict(
        layers=args.layers,
        spread=args.spread,
        strategies=strategies,
        summary=summary,
        deep_experts=deep,
        histograms=st["histograms"],
        expert_outputs=eo,
        end_to_end=e2e_rows,
        spread_study=sp,
        device=str(dev),
    )


def inspect_cmd(args) -> dict:
    """``inspect PATH``: the checkpoint inspector's table on stdout; its report as the JSON result."""
    report = inspect_checkpoint(args.path, strategies=args.strategies.split(","))
    print(report.table())
    return report.to_dict()


def dummy_from_config(args) -> dict:
    """``dummy-from-config CONFIG_DIR OUT_DIR``: dummy weights in the configs' layout, loaded and run."""
    t0 = time.perf_counter()
    path = dummy_checkpoint_from_config(
        args.config_dir, args.out_dir, num_hidden_layers=args.layers, seed=args.seed, model_preset=args.preset
    )
    t_write = time.perf_counter() - t0
    dev = W.resolve_device(args.device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, info = load_quantized_qwen3_moe(path, device=dev, backend=args.backend)
    ids = W.random_token_ids(args.tokens, args.seed + 1, model.config.vocab_size)
    out = W.run_model(model, ids)
    finite = bool(torch.isfinite(out.logits).all())
    print(
        f"[dummy-from-config] {path}: layout {info.format}, scheme {info.scheme.name}, "
        f"{model.config.num_hidden_layers} layers, {model.config.num_experts} experts, hidden "
        f"{model.config.hidden_size}; written in {t_write:.1f} s; forward of {args.tokens} tokens on {dev}: "
        f"logits {'finite' if finite else 'NOT finite'}"
    )
    return dict(
        path=str(path),
        format=info.format,
        scheme=info.scheme.name,
        layers=model.config.num_hidden_layers,
        num_experts=model.config.num_experts,
        hidden_size=model.config.hidden_size,
        logits_finite=finite,
        seconds_write=t_write,
        seconds_forward=out.seconds,
        device=str(dev),
    )


def routing(args) -> dict:
    """Notebook 04's routing table: ``summarize_counts`` of the calibration's per-expert token counts."""
    from .models.routing_stats import routing_rows, summarize_counts

    if args.layers < 1 or args.calib_tokens < 1:
        raise SystemExit(
            f"routing: --layers and --calib-tokens must be >= 1, got {args.layers} and {args.calib_tokens}"
        )
    model = W.dummy_model(
        args.layers,
        seed=args.seed,
        expert_spread=args.spread,
        device=W.resolve_device(args.device),
        model_preset=args.preset,
    )
    cal = W.calibrate_model(model, args.calib_tokens, args.seed)
    rows = routing_rows(summarize_counts([lc.tokens for lc in cal.layers], model.config.num_experts_per_tok))
    for r in rows:
        print(
            f"[routing] layer {r['layer']}: {r['experts_hit']}/{model.config.num_experts} experts hit, largest share "
            f"{r['max_over_uniform']:.2f}x uniform, normalized entropy {r['normalized_entropy']:.4f}"
        )
    return dict(
        layers=args.layers, preset=args.preset, spread=args.spread, calib_tokens=args.calib_tokens, routing=rows
    )


def _check_args(args) -> None:
    """Check every option of ``args`` (ValueError naming the option) and create the ``--json``
    folder, before anything is built. For ``e2e``, ``compare`` and ``unify``, ``args.params`` is set to
    the checked shared options (``mxlib.workbook.steps.check_e2e_parameters``: ``--scheme`` resolved
    to its ``MoEQuantScheme`` there), and for ``compare`` ``args.moe_schemes`` to ``--schemes``'s."""
    if args.cmd in ("inspect", "dummy-from-config", "routing"):
        _check_new_args(args)
        return
    names = dict(
        scheme="--scheme",
        num_hidden_layers="--layers",
        num_tokens="--tokens",
        seed="--seed",
        calib_tokens="--calib-tokens",
        device="--device",
        experts_backend="--backend",
        results_path="--json",
    )
    args.params = W.check_e2e_parameters(
        scheme=getattr(args, "scheme", "nvfp4"),
        num_hidden_layers=args.layers,
        num_tokens=args.tokens,
        seed=args.seed,
        calib_tokens=args.calib_tokens,
        device=args.device,
        experts_backend=args.backend,
        results_path=args.json,
        names=names,
    )
    if args.cmd == "compare":
        args.moe_schemes = W.check_schemes(args.schemes, "--schemes")
    if args.cmd == "unify":
        bad = [s for s in args.strategies.split(",") if s not in SCALE_STRATEGIES]
        if bad:
            raise ValueError(f"--strategies: expected a comma-separated list of {list(SCALE_STRATEGIES)}, got {bad}")
        for option, text in (("--spreads", args.spreads), ("--spread", str(args.spread))):
            for v in text.split(","):
                try:
                    ok = math.isfinite(float(v)) and float(v) >= 0
                except ValueError:
                    ok = False
                if not ok:
                    raise ValueError(
                        f"{option}: expected finite numbers >= 0 (comma-separated for --spreads), got {v!r}"
                    )
        W.check_positive_int(args.output_layers, "--output-layers")


def _check_new_args(args) -> None:
    """The options of ``inspect``, ``dummy-from-config`` and ``routing`` checked before any work
    (ValueError naming the option); ``--json``'s folder is created. ``routing`` keeps its own
    checks of ``--layers`` / ``--calib-tokens``; ``--preset`` there is an argparse choice."""
    from pathlib import Path

    from .models.qwen3 import MODEL_PRESETS

    if args.cmd == "inspect":
        if not Path(args.path).exists():
            raise ValueError(f"path: {args.path!r} does not exist; expected a checkpoint folder")
        bad = [s for s in args.strategies.split(",") if s not in SCALE_STRATEGIES]
        if bad:
            raise ValueError(f"--strategies: expected a comma-separated list of {list(SCALE_STRATEGIES)}, got {bad}")
    if args.cmd == "dummy-from-config":
        if not Path(args.config_dir).is_dir():
            raise ValueError(
                f"config_dir: {args.config_dir!r} is not a folder; expected the checkpoint's config folder"
            )
        if args.layers is not None:
            W.check_positive_int(args.layers, "--layers")
        if args.preset is not None and args.preset not in MODEL_PRESETS:
            raise ValueError(f"--preset: expected one of {list(MODEL_PRESETS)}, got {args.preset!r}")
        W.check_positive_int(args.tokens, "--tokens")
        if args.seed < 0:
            raise ValueError(f"--seed: expected an integer >= 0, got {args.seed!r}")
        W.check_backend(args.backend, "--backend")
    if args.cmd in ("dummy-from-config", "routing"):
        W.check_device(args.device, "--device")
    W.prepare_results_path(args.json, "--json")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("e2e", "compare", "unify"):
        p = sub.add_parser(name)
        p.add_argument("--layers", type=int, default=4)
        p.add_argument("--tokens", type=int, default=32)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--calib-tokens", type=int, default=512)
        p.add_argument("--device", default="auto")
        p.add_argument("--backend", default="auto")
        p.add_argument("--json", default=None)
    sub.choices["e2e"].add_argument("--scheme", default="nvfp4")
    sub.choices["compare"].add_argument("--schemes", default="all")
    u = sub.choices["unify"]
    u.add_argument("--spread", type=float, default=1.0)
    u.add_argument("--strategies", default="max,per_expert,median,p90,mean")
    u.add_argument("--spreads", default="0,0.5,1,1.5")
    u.add_argument("--output-layers", type=int, default=1)
    ins = sub.add_parser("inspect", help="describe a quantized checkpoint from its configs and scale tensors only")
    ins.add_argument("path")
    ins.add_argument("--strategies", default=",".join(SCALE_STRATEGIES))
    ins.add_argument("--json", default=None)
    dfc = sub.add_parser("dummy-from-config", help="dummy weights in the layout of a checkpoint's config files")
    dfc.add_argument("config_dir")
    dfc.add_argument("out_dir")
    dfc.add_argument("--layers", type=int, default=None, help="keep this many layers (default: the config's)")
    dfc.add_argument("--preset", default=None, help="shrink to a MODEL_PRESETS size: small or tiny")
    dfc.add_argument("--seed", type=int, default=0)
    dfc.add_argument("--tokens", type=int, default=8)
    dfc.add_argument("--device", default="auto")
    dfc.add_argument("--backend", default="auto")
    dfc.add_argument("--json", default=None)
    # routing: per-layer routing statistics of the dummy model on its calibration tokens
    from .models.qwen3 import MODEL_PRESETS

    rt = sub.add_parser("routing", help="experts hit, largest/smallest share and entropy per layer")
    for flag, kw in (
        ("--layers", dict(type=int, default=4)),
        ("--seed", dict(type=int, default=0)),
        ("--calib-tokens", dict(type=int, default=512)),
        ("--spread", dict(type=float, default=1.0)),
        ("--preset", dict(default="qwen3-30b-a3b", choices=list(MODEL_PRESETS))),
        ("--device", dict(default="auto")),
        ("--json", dict(default=None)),
    ):
        rt.add_argument(flag, **kw)
    args = ap.parse_args(argv)
    try:
        _check_args(args)
    except ValueError as err:  # every option is checked before any model is built
        sub.choices[args.cmd].error(str(err))
    result = {
        "e2e": e2e,
        "compare": compare,
        "unify": unify,
        "inspect": inspect_cmd,
        "dummy-from-config": dummy_from_config,
        "routing": routing,
    }[args.cmd](args)
    result["env"] = dict(
        torch=torch.__version__,
        date=time.strftime("%Y-%m-%d"),
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    )
    if args.json:
        with open(args.json, "w") as f:  # its folder was made ready by _check_args
            json.dump(result, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
