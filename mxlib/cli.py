"""The notebooks' code paths as commands, for machines without Jupyter (the H200 image).

``python -m mxlib.cli e2e --scheme nvfp4 --layers 4 --device cuda --json out.json``
``python -m mxlib.cli compare --layers 4 --device cuda --json out.json``
``python -m mxlib.cli unify --layers 4 --spread 1.0 --device cuda --json out.json``

Each calls the same ``mxlib.workflow`` / ``mxlib.studies`` functions as its notebook
(01, 03 and 04) and prints a summary.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
import warnings

import torch

from . import studies as S
from . import workflow as W
from .formats import FP8_E4M3_PER_TENSOR
from .models.qwen3 import moe_layers
from .moe.scales import SCALE_STRATEGIES
from .moe.schemes import MOE_SCHEMES, get_moe_scheme

# An expert whose input scale is below this fraction of the largest one has even its largest
# e4m3 block scale in the subnormal range under the max strategy: e4m3 min normal / e4m3 max.
_DEEP_RATIO = FP8_E4M3_PER_TENSOR.element.min_normal / FP8_E4M3_PER_TENSOR.element.max


def e2e(args) -> dict:
    dev = W.resolve_device(args.device)
    t0 = time.perf_counter()
    model = W.dummy_model(args.layers, seed=args.seed, device=dev)
    t_model = time.perf_counter() - t0
    t0 = time.perf_counter()
    scheme = get_moe_scheme(args.scheme)  # the name enters here; the object travels below
    ckpt = W.prepare_checkpoint(scheme, model, seed=args.seed, calib_tokens=args.calib_tokens)
    t_ckpt = time.perf_counter() - t0
    ids = W.random_token_ids(args.tokens, args.seed + 1, model.config.vocab_size)
    # the bf16 reference runs first and is freed before the quantized model is loaded, so that
    # the two never share memory (peak resident memory ~ the bf16 model's bytes, issue 11 case 13)
    W.run_model(model, ids)
    ref = W.run_model(model, ids)  # timed warm (the first call compiles kernels)
    del model
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model_q, info = W.load_quantized_qwen3_moe(ckpt, args.layers, device=dev, backend=args.backend)
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
    result = dict(scheme=scheme.name, layers=args.layers, tokens=args.tokens, device=str(dev), backend=args.backend,
                  logits=res["logits"], layers_metrics=res["layers"], seconds_bf16=ref.seconds,
                  seconds_emulated=out.seconds, seconds_emulated_fused=fused.seconds if fused else None,
                  fused_logits=res.get("fused_logits"), seconds_build=t_model, seconds_checkpoint=t_ckpt,
                  checkpoint_bytes=W.checkpoint_size_bytes(ckpt))
    print(f"[e2e] {scheme.name} L{args.layers} {dev}: logits {res['logits']}, forward bf16 {ref.seconds:.3f} s, "
          f"emulated {out.seconds:.3f} s; layers " + ", ".join(f"{r['sqnr_db']:.2f}" for r in res["layers"]))
    return result


def compare(args) -> dict:
    dev = W.resolve_device(args.device)
    model = W.dummy_model(args.layers, seed=args.seed, device=dev)
    cal = W.calibrate_model(model, args.calib_tokens, args.seed)
    ids = W.random_token_ids(args.tokens, args.seed + 1, model.config.vocab_size)
    names = list(MOE_SCHEMES) if args.schemes == "all" else args.schemes.split(",")
    schemes = [get_moe_scheme(n) for n in names]
    rows = S.compare_schemes(model, schemes, ids, cal, backend=args.backend)
    return dict(layers=args.layers, tokens=args.tokens, device=str(dev), rows=rows)


def unify(args) -> dict:
    dev = W.resolve_device(args.device)
    strategies = args.strategies.split(",")
    model = W.dummy_model(args.layers, seed=args.seed, expert_spread=args.spread, device=dev)
    cal = W.calibrate_model(model, args.calib_tokens, args.seed, keep_activations=True)
    st = S.unification_study(cal, strategies)
    eo = S.expert_output_study(model, cal, strategies, layers=range(min(args.output_layers, args.layers)))
    ids = W.random_token_ids(args.tokens, args.seed + 1, model.config.vocab_size)
    e2e_rows = S.end_to_end_strategies(model, cal, strategies, ids, backend=args.backend)
    del model
    spreads = [float(s) for s in args.spreads.split(",")]
    sp = S.spread_study(spreads, num_hidden_layers=1, seed=args.seed, calib_tokens=args.calib_tokens, device=dev)
    for r in e2e_rows:
        print(f"[unify] {r['strategy']:>10s}: logits SQNR {r['sqnr_db']:.2f} dB top-1 {r['top1_agreement']:.3f} "
              f"KL {r['kl_divergence']:.2e}")
    for r in sp:
        print(f"[unify] spread {r['spread']}: {r['point']} mean dB lost by max {r['mean_db_lost']:.3f}")
    summary = []
    for point in ("a1", "a2"):
        rows = [r for r in st["experts"] if r["point"] == point]
        for s in strategies:
            summary.append(dict(point=point, strategy=s, mean_sqnr_db=sum(r[f"sqnr_{s}"] for r in rows) / len(rows),
                                mean_db_lost=sum(r[f"db_lost_{s}"] for r in rows) / len(rows),
                                worst_db_lost=max(r[f"db_lost_{s}"] for r in rows)))
    deep = [r for r in st["experts"] if r["scale_ratio"] < _DEEP_RATIO]
    return dict(layers=args.layers, spread=args.spread, strategies=strategies, summary=summary,
                deep_experts=deep, histograms=st["histograms"], expert_outputs=eo, end_to_end=e2e_rows,
                spread_study=sp, device=str(dev))


def _check_args(args) -> None:
    """Check every option of ``args`` (ValueError naming the option) and create the ``--json``
    folder, before anything is built (``mxlib.workflow.check_e2e_parameters`` for the shared ones)."""
    names = dict(scheme="--scheme", num_hidden_layers="--layers", num_tokens="--tokens", seed="--seed",
                 calib_tokens="--calib-tokens", device="--device", experts_backend="--backend", results_path="--json")
    W.check_e2e_parameters(scheme=getattr(args, "scheme", "nvfp4"), num_hidden_layers=args.layers,
                           num_tokens=args.tokens, seed=args.seed, calib_tokens=args.calib_tokens, device=args.device,
                           experts_backend=args.backend, results_path=args.json, names=names)
    if args.cmd == "compare" and args.schemes != "all":
        for n in args.schemes.split(","):
            try:
                get_moe_scheme(n)
            except (ValueError, KeyError) as err:
                raise ValueError(f"--schemes: {n!r} is not a scheme ({err}); expected 'all' or a comma-separated "
                                 f"list of {list(MOE_SCHEMES)}") from None
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
                    raise ValueError(f"{option}: expected finite numbers >= 0 (comma-separated for --spreads), "
                                     f"got {v!r}")
        W.check_positive_int(args.output_layers, "--output-layers")


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
    args = ap.parse_args(argv)
    try:
        _check_args(args)
    except ValueError as err:  # every option is checked before any model is built
        sub.choices[args.cmd].error(str(err))
    result = {"e2e": e2e, "compare": compare, "unify": unify}[args.cmd](args)
    result["env"] = dict(torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
                         device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    if args.json:
        with open(args.json, "w") as f:  # its folder was made ready by _check_args
            json.dump(result, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
