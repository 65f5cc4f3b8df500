"""The model commands: ``e2e`` (notebook 01), ``compare`` (notebook 03), ``unify`` and ``routing`` (notebook 04).

Each builds the seeded dummy Qwen3-30B-A3B at the size of ``--preset`` (``small`` unless asked) and
calls the same ``mxlib.studies.steps`` / ``mxlib.studies.unification`` functions as its notebook. A
command's ``check`` runs before anything is built (a ValueError names the option); its ``run``
prints a summary on stdout and returns the JSON result.
"""

from __future__ import annotations

import time
import warnings

from ..checkpoints import checkpoint_size_bytes
from ..formats import NVFP4_SUBNORMAL_RATIO
from ..models.qwen3 import moe_layers
from ..studies import steps as W
from ..studies import unification as S
from ..studies.tables import strategy_summary

__all__ = ["COMMANDS"]

# the CLI's option names for check_e2e_parameters' parameters (its messages name the option)
_NAMES = dict(
    scheme="--scheme",
    model_preset="--preset",
    num_hidden_layers="--layers",
    num_tokens="--tokens",
    seed="--seed",
    calib_tokens="--calib-tokens",
    device="--device",
    experts_backend="--backend",
    results_path="--json",
)


def check_run(args) -> None:
    """``e2e``, ``compare``, ``unify``: ``args.params`` set to the checked shared options
    (``mxlib.studies.steps.check_e2e_parameters``: ``--scheme`` resolved to its ``MoEQuantScheme``,
    ``--device`` to a ``torch.device``, the ``--json`` folder created), and for ``compare``
    ``args.moe_schemes`` to ``--schemes``'s."""
    args.params = W.check_e2e_parameters(
        scheme=getattr(args, "scheme", "nvfp4"),
        model_preset=args.preset,
        num_hidden_layers=args.layers,
        num_tokens=args.tokens,
        seed=args.seed,
        calib_tokens=args.calib_tokens,
        device=args.device,
        experts_backend=args.backend,
        results_path=args.json,
        names=_NAMES,
    )
    if args.cmd == "compare":
        args.moe_schemes = W.check_schemes("all" if args.schemes == ["all"] else args.schemes, "--schemes")


def e2e(args) -> dict:
    """Notebook 01's steps (``mxlib.studies.steps``) on ``args.params``, the checked options."""
    p = args.params
    dev, scheme = p.device, p.scheme
    t0 = time.perf_counter()
    model = W.build_model(p)
    t_model = time.perf_counter() - t0
    t0 = time.perf_counter()
    ckpt = W.write_checkpoint(p, model, progress=args.progress)
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
        model_q, info = W.load_checkpoint(p, ckpt, progress=args.progress)
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
        preset=p.model_preset,
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
        checkpoint=str(ckpt),
    )
    print(e2e_summary(result, ckpt))
    return result


def e2e_summary(result: dict, checkpoint) -> str:
    """``e2e``'s result in lines a person reads: the run, where the checkpoint is, the logits and layers against
    bf16, the times."""
    lg = result["logits"]
    lines = [
        f"[e2e] {result['scheme']} {result['preset']} L{result['layers']} {result['device']}: the bf16 dummy's experts "
        f"quantized, written, loaded and run on {result['tokens']} tokens (backend {result['backend']})",
        f"  checkpoint: {checkpoint} ({result['checkpoint_bytes'] / 1e6:.2f} MB of shards)",
        f"  logits against bf16: SQNR {lg['sqnr_db']:.2f} dB, top-1 agreement {lg['top1_agreement']:.3f}, "
        f"KL divergence {lg['kl_divergence']:.2e}, relative error {lg['rel_error']:.4f}",
        "  layer outputs SQNR: " + ", ".join(f"{r['sqnr_db']:.2f}" for r in result["layers_metrics"]) + " dB",
        f"  forward: bf16 {result['seconds_bf16']:.3f} s, emulated {result['seconds_emulated']:.3f} s"
        + (f", emulated fused {result['seconds_emulated_fused']:.3f} s" if result["seconds_emulated_fused"] else "")
        + f"; model built in {result['seconds_build']:.1f} s, checkpoint ready in {result['seconds_checkpoint']:.1f} s",
    ]
    if result.get("fused_logits"):
        lines.insert(3, f"  fused experts' logits against bf16: SQNR {result['fused_logits']['sqnr_db']:.2f} dB")
    return "\n".join(lines)


def compare(args) -> dict:
    """Notebook 03's study on ``args.moe_schemes`` (resolved from ``--schemes`` by ``check_run``)."""
    p = args.params
    model = W.dummy_model(args.layers, seed=args.seed, device=p.device, model_preset=p.model_preset)
    cal = W.calibrate_model(model, args.calib_tokens, args.seed, progress=args.progress)
    ids = W.evaluation_token_ids(p, model.config.vocab_size)
    rows = S.compare_schemes(model, args.moe_schemes, ids, cal, backend=args.backend, log=print)
    return dict(preset=p.model_preset, layers=args.layers, tokens=args.tokens, device=str(p.device), rows=rows)


def unify(args) -> dict:
    """Notebook 04's studies: unification, expert outputs, end to end and the spread sweep."""
    p = args.params
    dev, strategies = p.device, args.strategies
    model = W.dummy_model(args.layers, seed=args.seed, expert_spread=args.spread, device=dev, model_preset=args.preset)
    cal = W.calibrate_model(model, args.calib_tokens, args.seed, keep_activations=True, progress=args.progress)
    st = S.unification_study(cal, strategies)
    eo = S.expert_output_study(model, cal, strategies, layers=range(min(args.output_layers, args.layers)))
    ids = W.evaluation_token_ids(p, model.config.vocab_size)
    e2e_rows = S.end_to_end_strategies(model, cal, strategies, ids, backend=args.backend)
    del model
    sp = S.spread_study(
        args.spreads,
        num_hidden_layers=1,
        seed=args.seed,
        calib_tokens=args.calib_tokens,
        device=dev,
        model_preset=args.preset,
    )
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
        preset=args.preset,
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


def check_routing(args) -> None:
    """``routing``: ``--device`` resolved (``args.params_device``), ``--schemes`` resolved (``args.moe_schemes``,
    empty without it), at least 2 ``--sequences`` with ``--schemes``, the ``--json`` folder created."""
    args.params_device = W.check_device(args.device, "--device")
    args.moe_schemes = []
    if args.schemes is not None:
        args.moe_schemes = W.check_schemes("all" if args.schemes == ["all"] else args.schemes, "--schemes")
        if args.sequences < 2:
            raise ValueError(f"--sequences: expected at least 2 with --schemes (the units), got {args.sequences}")
    W.prepare_results_path(args.json, "--json")


def routing(args) -> dict:
    """Notebook 04's routing table: ``summarize_counts`` of the calibration's per-expert token counts."""
    from ..models.routing_stats import routing_rows, summarize_counts

    model = W.dummy_model(
        args.layers, seed=args.seed, expert_spread=args.spread, device=args.params_device, model_preset=args.preset
    )
    cal = W.calibrate_model(model, args.calib_tokens, args.seed, progress=args.progress)
    rows = routing_rows(summarize_counts([lc.tokens for lc in cal.layers], model.config.num_experts_per_tok))
    for r in rows:
        print(
            f"[routing] layer {r['layer']}: {r['experts_hit']}/{model.config.num_experts} experts hit, largest share "
            f"{r['max_over_uniform']:.2f}x uniform, normalized entropy {r['normalized_entropy']:.4f}"
        )
    out = dict(layers=args.layers, preset=args.preset, spread=args.spread, calib_tokens=args.calib_tokens, routing=rows)
    if args.moe_schemes:
        out["consistency"] = _routing_consistency(model, cal, args)
    return out


def _routing_consistency(model, cal, args) -> dict:
    """``routing --schemes``: ``routing_agreement.scheme_routing_study`` on ``--sequences`` seeded sequences."""
    from ..studies.routing_agreement import routing_table, scheme_routing_study

    ids = W.random_token_ids(args.tokens, args.seed + 1, model.config.vocab_size, batch=args.sequences)
    t0 = time.perf_counter()
    r = scheme_routing_study(model, ids, [s.name for s in args.moe_schemes], cal, batch_size=8)
    print(routing_table(r["rows"]))
    print(
        f"{r['tokens']} tokens in {r['units']} sequences; noise floor: the bf16 model on transformers' eager experts "
        f"and on mxlib's bf16 TritonExperts; decided over the sequences (mxlib.stats, Holm); "
        f"{time.perf_counter() - t0:.1f} s"
    )
    keep = ("rows", "noise_floor_rows", "noise_floor", "units", "tokens", "seconds")
    return {k: r[k] for k in keep} | {"noise_floor": {str(k): v for k, v in r["noise_floor"].items()}}


# command -> (check before any work, run)
COMMANDS = {
    "e2e": (check_run, e2e),
    "compare": (check_run, compare),
    "unify": (check_run, unify),
    "routing": (check_routing, routing),
}
