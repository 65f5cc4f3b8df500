"""Whole-model forward: the dummy Qwen3-30B-A3B, bf16 experts vs each emulation path.

``python -m mxlib.bench model [--layers 48] [--tokens 1,8,64,1024] [--schemes nvfp4,w_mxfp4,...]
[--preset qwen3-30b-a3b] [--device cuda] [--json PATH] [--markdown PATH]``

The model is transformers' Qwen3-MoE as ``mxlib.models.qwen3`` builds it (``dummy_qwen3_moe``: seeded
N(0, 0.02) weights with balanced routing, made directly on the device in bf16), cut to ``--layers``
decoder layers (the real model has 48). Its experts are swapped (``swap_experts``) for, in turn:

* ``bf16``: ``TritonExperts`` on the model's own bf16 expert weights (no copy; the ceiling);
* one emulation path per ``--schemes`` entry ``scheme[@backend]``: every layer's bf16 experts quantized
  in the scheme's weight format (``quantize_expert_weights``) and wrapped by ``make_emulation_experts``
  with ``backend`` (default ``auto``: on CUDA the ``fused`` kernels for FP4 weights, ``triton``
  otherwise; ``torch`` on the CPU). ``nvfp4@triton`` is the dequantize-then-GEMM path (all experts dequantized
  to bf16 each forward, then the bf16 GEMMs). Static activation scales (``nvfp4``, ``_a_fp8``) come
  from one calibration pass of the bf16 model (``mxlib.models.calibration.calibrate``,
  ``--calib-tokens`` token ids). One scheme's quantized experts exist at a time: built layer by layer
  from the bf16 weights, freed before the next path.

Per path and token count ``M`` the input is token ids ``[1, M]`` (seed ``--seed + M``, the same for
every path), ``use_cache=False``, and the output the logits ``[1, M, vocab]``. Timed:

* ``eager_ms``: the forward as a user calls it (Python, transformers and mxlib's host-side checks
  included), ``triton.testing.do_bench`` median;
* ``graph_ms``: the whole forward captured in ONE CUDA graph (mxlib's experts are sync-free) and
  replayed, median; ``graph_mode`` is ``whole``. If the capture fails, each MoE block is captured on
  its own and the rest runs eagerly between replays (``graph_mode`` ``per_moe_block``, with the
  capture error in ``graph_error``); if that fails too, ``graph_ms`` is None and ``ms`` the eager time.
  On the CPU there is no graph (``graph_skipped``, the reason).

Reported per row: ``ms`` (graph time where there is one, else eager), ``tokens_per_s`` (``M / ms``),
``ratio_to_bf16`` (``ms`` over the bf16 path's at the same ``M``; also ``eager_ratio_to_bf16``),
``moe_share`` (``(ms - no_moe_ms) / ms``: ``no_moe_ms`` is the same forward with every MoE block
(router and experts) replaced by zeros, in the same graph mode, else eager), ``sqnr_db_vs_bf16`` (eager logits
against the bf16
path's, dB; None for bf16; a scheme run on two backends also gets ``sqnr_db_vs_path`` against its first,
``vs_path``) and the graph check: ``graph_bit_exact`` (the replay's logits equal to the
eager forward's) and, when they differ, ``graph_sqnr_db``.

Checks (exit status 1 if any fails, after the JSON and markdown are written): the graph replay's
logits within ``--min-graph-sqnr-db`` (40 dB, 1% RMS) of the eager logits (identical bits expected: the
kernels have no atomics); each emulation path's logits at an SQNR of at least ``--min-sqnr-db`` (1 dB)
against bf16's (an MoE that returns zeros, or an unrelated output of the same power, lands near
0 or -3 dB per layer); every time
positive and finite.

Device memory (full size): the bf16 model is about 61 GB (58 GB of it experts); one FP4 scheme adds
about 16 GB of packed experts; ``peak_gb`` per path records the allocator's peak.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
import warnings
from dataclasses import dataclass

import torch
import transformers

from ..analysis import sqnr_db_from_sums
from ..models.calibration import calibrate
from ..models.qwen3 import (
    dummy_qwen3_moe,
    expert_weights,
    model_preset_overrides,
    moe_layers,
    qwen3_30b_a3b_config,
    swap_experts,
)
from ..moe.base import BACKENDS, TritonExperts
from ..moe.factory import make_emulation_experts, quantize_expert_weights
from ..moe.schemes import get_moe_scheme
from ..text_table import markdown_table
from ._common import capture

__all__ = [
    "TOKENS",
    "CUDA_SCHEMES",
    "CPU_SCHEMES",
    "PathSpec",
    "parse_paths",
    "build_model",
    "bench_model",
    "markdown",
    "main",
]

TOKENS = (1, 8, 64, 1024)
# Emulation paths by default: the FP4 schemes on the CUDA default backend (fused) and NVFP4 dequantize-then-GEMM.
CUDA_SCHEMES = ("nvfp4", "w_mxfp4", "w_mxfp4_a_mxfp4", "nvfp4@triton")
CPU_SCHEMES = ("nvfp4", "w_mxfp4", "w_mxfp4_a_mxfp4")
NO_GRAPH_ON_CPU = "CUDA graphs need a CUDA device (--device cpu runs eager forwards only)"


@dataclass(frozen=True)
class PathSpec:
    """One path: ``scheme`` None for bf16, else a ``MoEQuantScheme`` name; ``backend`` as asked."""

    scheme: str | None
    backend: str = "auto"


def parse_paths(text: str | None, device: torch.device) -> list[PathSpec]:
    """``bf16`` first, then the ``--schemes`` entries ``scheme[@backend]`` (duplicates dropped).

    Raises:
        ValueError: an unknown scheme or backend, or a backend other than ``auto``/``torch`` on the CPU
            (naming ``--schemes``, the entry and what is accepted).
    """
    entries = (CUDA_SCHEMES if device.type == "cuda" else CPU_SCHEMES) if text is None else text.split(",")
    paths = [PathSpec(None)]
    for entry in (e.strip() for e in entries):
        if not entry or entry == "bf16":
            continue
        name, _, backend = entry.partition("@")
        backend = backend or "auto"
        if backend not in BACKENDS:
            raise ValueError(f"--schemes: {entry!r}: backend expected one of {list(BACKENDS)}, got {backend!r}")
        if device.type != "cuda" and backend not in ("auto", "torch"):
            raise ValueError(
                f"--schemes: {entry!r}: backend {backend!r} needs CUDA; on {device.type} every path "
                "runs the torch backend (give the scheme alone)"
            )
        try:
            name = get_moe_scheme(name).name
        except ValueError as e:
            raise ValueError(f"--schemes: {entry!r}: {e}") from None
        spec = PathSpec(name, backend)
        if spec not in paths:
            paths.append(spec)
    return paths


def _parse_tokens(text: str) -> list[int]:
    try:
        tokens = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        tokens = []
    if not tokens or min(tokens) < 1:
        raise ValueError(f"--tokens: expected comma-separated positive integers, got {text!r}")
    return tokens


def build_model(preset: str = "qwen3-30b-a3b", layers: int = 48, device="cuda", seed: int = 0):
    """``dummy_qwen3_moe`` of ``preset`` cut to ``layers`` decoder layers, bf16, built on ``device``."""
    if layers < 1:
        raise ValueError(f"--layers: expected a positive integer, got {layers}")
    cfg = qwen3_30b_a3b_config(num_hidden_layers=layers, **model_preset_overrides(preset))
    return dummy_qwen3_moe(cfg, seed=seed, device=device)


# ---------------------------------------------------------------------------------------------- timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_ms(fn, device: torch.device, rep_ms: float) -> float:
    """Median ms of ``fn``: CUDA events (``triton.testing.do_bench``) on CUDA, ``perf_counter`` on the CPU."""
    if device.type == "cuda":
        from ._common import median_ms

        return median_ms(fn, warmup=max(1, int(rep_ms // 8)), rep=rep_ms)
    fn()
    times = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start) * 1e3 < rep_ms and len(times) < 50:
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


class _GraphedBlock(torch.nn.Module):
    """A MoE block captured once for inputs of one shape: copy in, replay, return the static output."""

    def __init__(self, block: torch.nn.Module, example: torch.Tensor, pool=None):
        super().__init__()
        self.block = block
        self.static_in = example.clone()
        self.graph, self.static_out = capture(lambda: block(self.static_in), pool)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        self.static_in.copy_(hidden_states)
        self.graph.replay()
        return self.static_out


class _ZeroBlock(torch.nn.Module):
    """Stands in for a MoE block (router and experts) to time the rest of the model."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(hidden_states)


def _sqnr_db(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``10 log10(sum(ref^2) / sum((x - ref)^2))`` in fp64 on the tensors' device; +inf if equal."""
    x, ref = x.double(), ref.double()
    noise = float((x - ref).pow(2).sum())
    signal = float(ref.pow(2).sum())
    return sqnr_db_from_sums(signal, noise)


def _time_forward(model, ids, device, rep_ms: float, graphs: bool, eager_out: torch.Tensor | None = None) -> dict:
    """Eager and graph times of ``model(ids).logits``; the graph replay's logits checked against eager."""

    def fwd():
        return model(input_ids=ids, use_cache=False).logits

    res: dict = {}
    eager = fwd().clone() if eager_out is None else eager_out
    res["eager_ms"] = _time_ms(fwd, device, rep_ms)
    if not graphs:
        res.update(graph_ms=None, graph_mode=None, graph_skipped=NO_GRAPH_ON_CPU)
        return res
    try:
        g, out = capture(fwd)
        res["graph_mode"] = "whole"
    except Exception as e:  # noqa: BLE001 (any capture failure falls back to per-block graphs)
        _sync(device)
        res["graph_error"] = f"{type(e).__name__}: {e}"[:500]
        res["graph_mode"] = "per_moe_block"
        g = out = None
    if g is not None:
        g.replay()
        _sync(device)
        res["graph_ms"] = _time_ms(g.replay, device, rep_ms)
        replayed = out
    else:
        layers = model.model.layers
        blocks = [layer.mlp for layer in layers]
        example = torch.randn(1, ids.shape[1], model.config.hidden_size, device=device, dtype=model.dtype)
        # One memory pool for all blocks' graphs: they replay in the order captured, one at a time, and
        # each output is consumed (residual add) before the next replay. Private pools would each keep
        # their block's transients (1.2 GB per layer for the dequantize-then-GEMM path's dequantized experts).
        pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        try:
            for layer, block in zip(layers, blocks):
                layer.mlp = _GraphedBlock(block, example, pool)
            replayed = fwd().clone()
            res["graph_ms"] = _time_ms(fwd, device, rep_ms)
        except Exception as e:  # noqa: BLE001 (no graph at all: the row keeps its eager time)
            _sync(device)
            res.update(graph_ms=None, graph_mode=None)
            res["graph_error"] += f"; per-block capture: {type(e).__name__}: {e}"[:500]
            return res
        finally:
            for layer, block in zip(layers, blocks):
                layer.mlp = block
    res["graph_bit_exact"] = bool(torch.equal(replayed, eager))
    res["graph_sqnr_db"] = None if res["graph_bit_exact"] else _sqnr_db(replayed, eager)
    del g, out
    return res


# ---------------------------------------------------------------------------------------------- paths


def _bf16_experts(weights, backend: str = "auto"):
    return lambda i: TritonExperts(*weights[i], backend=backend)


def _emulation_experts(spec: PathSpec, weights, calib):
    s = get_moe_scheme(spec.scheme)

    def make(i):
        w13, w2 = weights[i]
        in13 = in2 = None
        if s.static_activation_scale:
            in13, in2 = (t.to(w13.device) for t in calib.input_scales(i, s.activation))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # experts never calibrated (input scale 0) are expected, counted below
            return make_emulation_experts(s, quantize_expert_weights(w13, w2, s), in13, in2, backend=spec.backend)

    return make


def _path_name(spec: PathSpec, backend: str) -> str:
    return "bf16" if spec.scheme is None else f"{spec.scheme}@{backend}"


def _env(device: torch.device) -> dict:
    import triton

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()})"
    return {
        "device": name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


@torch.no_grad()
def bench_model(
    preset: str = "qwen3-30b-a3b",
    layers: int = 48,
    tokens=TOKENS,
    schemes: str | None = None,
    device=None,
    seed: int = 0,
    calib_tokens: int = 1024,
    rep_ms: float = 200.0,
    graphs: bool = True,
    min_sqnr_db: float = 1.0,
    min_graph_sqnr_db: float = 40.0,
    log=print,
    on_path=None,
) -> dict:
    """Time the whole-model forward per path and token count (module docstring); returns the JSON dict.

    ``on_path(result)``, if given, is called after each path with the result so far (the CLI writes its
    files then, so a run stopped by a time limit keeps the paths it finished).

    Raises:
        ValueError: bad ``schemes``, ``tokens``, ``layers`` or ``preset`` (naming the option).
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tokens = list(tokens)
    paths = parse_paths(schemes, device)
    graphs = graphs and device.type == "cuda"
    t_start = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = build_model(preset, layers, device, seed)
    cfg = model.config
    log(f"[model] built {layers} layers ({preset}) on {device} in {time.perf_counter() - t_start:.1f} s", flush=True)
    calib = None
    if any(p.scheme is not None and get_moe_scheme(p.scheme).static_activation_scale for p in paths):
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(seed + 1000)
        seq = min(calib_tokens, 256)
        calib_ids = torch.randint(0, cfg.vocab_size, (max(1, calib_tokens // seq), seq), generator=gen)
        calib = calibrate(model, calib_ids)
        never = sum(int((lc.a1_amax == 0).sum()) for lc in calib.layers)
        log(
            f"[model] calibrated on {calib_ids.numel()} tokens in {time.perf_counter() - t0:.1f} s "
            f"({never} (layer, expert) pairs never routed to)",
            flush=True,
        )
    weights = [tuple(w.detach() for w in expert_weights(model, i)) for i in range(layers)]
    swap_experts(model, _bf16_experts(weights))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    result = {
        "env": _env(device),
        "config": dict(
            preset=preset,
            layers=layers,
            hidden_size=cfg.hidden_size,
            moe_intermediate_size=cfg.moe_intermediate_size,
            num_experts=cfg.num_experts,
            top_k=cfg.num_experts_per_tok,
            vocab_size=cfg.vocab_size,
            tokens=tokens,
            seed=seed,
            calib_tokens=calib.num_tokens if calib else 0,
            rep_ms=rep_ms,
            graphs=graphs,
            device=str(device),
        ),
        "model_gb": sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
        + sum(w.numel() * w.element_size() for pair in weights for w in pair) / 1e9,
        "no_moe": {},
        "rows": [],
        "failures": [],
    }
    ids_by_m = {}
    for m in tokens:
        gen = torch.Generator().manual_seed(seed + m)
        ids_by_m[m] = torch.randint(0, cfg.vocab_size, (1, m), generator=gen).to(device)

    # the rest of the model: every MoE block replaced by zeros
    blocks = moe_layers(model)
    for layer in model.model.layers:
        layer.mlp = _ZeroBlock()
    try:
        for m in tokens:
            r = _time_forward(model, ids_by_m[m], device, rep_ms, graphs)
            result["no_moe"][m] = {k: r.get(k) for k in ("eager_ms", "graph_ms", "graph_mode")}
    finally:
        for layer, block in zip(model.model.layers, blocks):
            layer.mlp = block
    log(
        "[model] without MoE blocks: "
        + ", ".join(
            f"M={m} eager {v['eager_ms']:.2f} ms" + (f" graph {v['graph_ms']:.2f} ms" if v["graph_ms"] else "")
            for m, v in result["no_moe"].items()
        ),
        flush=True,
    )

    ref_logits: dict[int, torch.Tensor] = {}
    bf16_rows: dict[int, dict] = {}
    # a scheme on several backends: its later backends compared with its first (same QDQ bits)
    repeated = {p.scheme for p in paths if p.scheme is not None and sum(q.scheme == p.scheme for q in paths) > 1}
    first_backend: dict[tuple[str, int], tuple[str, torch.Tensor]] = {}
    for spec in paths:
        t0 = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        if spec.scheme is not None:
            swap_experts(model, _emulation_experts(spec, weights, calib))
        backend = moe_layers(model)[0].experts.experts.resolved_backend(device)
        name = _path_name(spec, backend)
        if any(r["path"] == name for r in result["rows"]):
            log(f"[{name}] already measured (--schemes entry {spec.scheme}@{spec.backend}); skipped", flush=True)
            swap_experts(model, _bf16_experts(weights))
            continue
        _sync(device)
        log(f"[{name}] experts ready in {time.perf_counter() - t0:.1f} s", flush=True)
        for m in tokens:
            ids = ids_by_m[m]
            eager = model(input_ids=ids, use_cache=False).logits.clone()
            r = _time_forward(model, ids, device, rep_ms, graphs, eager_out=eager)
            row = dict(path=name, scheme=spec.scheme or "bf16", backend=backend, M=m, **r)
            row["ms"] = row["graph_ms"] if row.get("graph_ms") is not None else row["eager_ms"]
            row["tokens_per_s"] = m / (row["ms"] * 1e-3)
            nm = result["no_moe"][m]
            base = (
                nm["graph_ms"]
                if row.get("graph_ms") is not None and row.get("graph_mode") == nm["graph_mode"]
                else nm["eager_ms"]
            )
            row["no_moe_ms"] = base
            row["moe_share"] = (row["ms"] - base) / row["ms"]
            if spec.scheme is None:
                ref_logits[m] = eager
                bf16_rows[m] = row
                row["sqnr_db_vs_bf16"] = None
            else:
                row["sqnr_db_vs_bf16"] = _sqnr_db(eager, ref_logits[m])
                if spec.scheme in repeated:
                    first = first_backend.setdefault((spec.scheme, m), (name, eager))
                    if first[0] != name:
                        row["vs_path"], row["sqnr_db_vs_path"] = first[0], _sqnr_db(eager, first[1])
            b = bf16_rows[m]
            row["ratio_to_bf16"] = row["ms"] / b["ms"]
            row["eager_ratio_to_bf16"] = row["eager_ms"] / b["eager_ms"]
            if device.type == "cuda":
                row["peak_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
            _check_row(row, spec, min_sqnr_db, min_graph_sqnr_db, result["failures"])
            result["rows"].append(row)
            log(f"[{name}] M={m:5d}: {_row_summary(row)}", flush=True)
            del eager
        if spec.scheme is not None:
            swap_experts(model, _bf16_experts(weights))  # frees this scheme's experts
        if on_path is not None:
            on_path(result)
    result["seconds"] = time.perf_counter() - t_start
    for f in result["failures"]:
        log(f"[model] CHECK FAILED: {f}", flush=True)
    return result


def _graph_check(row: dict) -> str:
    if "graph_bit_exact" not in row:
        return "no graph"
    return "bit-exact" if row["graph_bit_exact"] else f"{row['graph_sqnr_db']:.1f} dB"


def _row_summary(row: dict) -> str:
    g = f", graph {row['graph_ms']:.3f} ms ({row['graph_mode']})" if row.get("graph_ms") is not None else ""
    v = f", {row['sqnr_db_vs_path']:.1f} dB vs {row['vs_path']}" if "vs_path" in row else ""
    return (
        f"eager {row['eager_ms']:.3f} ms{g}, {row['tokens_per_s']:.0f} tok/s, {row['ratio_to_bf16']:.2f}x bf16, "
        f"MoE share {row['moe_share']:.0%}, SQNR vs bf16 {_fmt(row['sqnr_db_vs_bf16'], '.1f')} dB{v}, "
        f"graph vs eager {_graph_check(row)}"
    )


def _check_row(row: dict, spec: PathSpec, min_sqnr_db: float, min_graph_sqnr_db: float, failures: list) -> None:
    where = f"{row['path']} M={row['M']}"
    for key in ("eager_ms", "graph_ms", "ms"):
        v = row.get(key)
        if v is not None and not (math.isfinite(v) and v > 0):
            failures.append(f"{where}: {key} = {v} (expected a positive finite time)")
    if row.get("graph_sqnr_db") is not None and not row["graph_sqnr_db"] >= min_graph_sqnr_db:
        failures.append(
            f"{where}: graph replay's logits {row['graph_sqnr_db']:.1f} dB from the eager logits "
            f"(expected >= {min_graph_sqnr_db} dB)"
        )
    if spec.scheme is not None and not row["sqnr_db_vs_bf16"] >= min_sqnr_db:
        failures.append(f"{where}: logits {row['sqnr_db_vs_bf16']:.2f} dB from bf16 (expected >= {min_sqnr_db} dB)")


# ---------------------------------------------------------------------------------------------- report


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def markdown(result: dict) -> str:
    """The result as markdown: header (device, versions, date, shape), then per-path tables by ``M``."""
    env, cfg, rows = result["env"], result["config"], result["rows"]
    tokens = cfg["tokens"]
    paths = list(dict.fromkeys(r["path"] for r in rows))
    at = {(r["path"], r["M"]): r for r in rows}
    modes = sorted({r.get("graph_mode") or "none" for r in rows})
    lines = [
        f"Whole-model forward, dummy Qwen3-MoE ({cfg['preset']}, {cfg['layers']} layers, H {cfg['hidden_size']}, "
        f"I {cfg['moe_intermediate_size']}, E {cfg['num_experts']}, top-{cfg['top_k']}), token ids [1, M], "
        f"use_cache=False; {env['device']}, torch {env['torch']}, triton {env['triton']}, "
        f"transformers {env['transformers']}, {env['date']}. Graph mode: {', '.join(modes)}.",
        "",
    ]

    def table(title, cell):
        header = ["path", *(f"M = {m}" for m in tokens)]
        body = [[p, *(cell(at[(p, m)]) if (p, m) in at else "-" for m in tokens)] for p in paths]
        return [f"**{title}**", "", *markdown_table(header, body), ""]

    timed = "CUDA-graph replay" if any(r.get("graph_ms") is not None for r in rows) else "eager (no graph)"
    lines += table(f"ms per forward ({timed}), ratio to bf16", lambda r: f"{r['ms']:.3f} ({r['ratio_to_bf16']:.2f}x)")
    lines += table("tokens/s", lambda r: f"{r['tokens_per_s']:.0f}")
    lines += table(
        "eager ms per forward, ratio to bf16", lambda r: f"{r['eager_ms']:.2f} ({r['eager_ratio_to_bf16']:.2f}x)"
    )
    lines += table(
        "MoE share of the forward (blocks replaced by zeros for the rest)", lambda r: f"{r['moe_share']:.0%}"
    )
    lines += table(
        "logits SQNR vs bf16 (dB); graph replay vs eager",
        lambda r: (
            f"{_fmt(r['sqnr_db_vs_bf16'], '.1f')}"
            + (f" ({r['sqnr_db_vs_path']:.1f} vs {r['vs_path']})" if "vs_path" in r else "")
            + f"; {_graph_check(r)}"
        ),
    )
    skipped = {r.get("graph_skipped") for r in rows} - {None}
    errors = {r.get("graph_error") for r in rows} - {None}
    lines += [f"Graphs skipped: {s}" for s in skipped] + [f"Whole-forward capture failed: {e}" for e in errors]
    if result["failures"]:
        lines += ["", "**Checks failed:**", ""] + [f"- {f}" for f in result["failures"]]
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None, json_path=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m mxlib.bench model", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument(
        "--schemes",
        default=None,
        help=f"scheme[@backend],... (default on CUDA {','.join(CUDA_SCHEMES)}; on the CPU "
        f"{','.join(CPU_SCHEMES)}); bf16 always runs first",
    )
    ap.add_argument("--preset", default="qwen3-30b-a3b", help="mxlib.models.qwen3.MODEL_PRESETS name")
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--calib-tokens", type=int, default=1024)
    ap.add_argument("--rep-ms", type=float, default=200.0, help="timing budget per measurement (ms)")
    ap.add_argument("--no-graph", action="store_true")
    ap.add_argument("--min-sqnr-db", type=float, default=1.0)
    ap.add_argument("--min-graph-sqnr-db", type=float, default=40.0)
    ap.add_argument("--json", default=json_path)
    ap.add_argument("--markdown", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA GPU here (use --device cpu)")
    try:
        tokens = _parse_tokens(args.tokens)
        parse_paths(args.schemes, device)
        model_preset_overrides(args.preset)
        if args.layers < 1:
            raise ValueError(f"--layers: expected a positive integer, got {args.layers}")
    except ValueError as e:
        ap.error(str(e))

    def write(result):
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2, default=str)
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(markdown(result))

    result = bench_model(
        args.preset,
        args.layers,
        tokens,
        args.schemes,
        device,
        args.seed,
        args.calib_tokens,
        args.rep_ms,
        not args.no_graph,
        args.min_sqnr_db,
        args.min_graph_sqnr_db,
        on_path=write,
    )
    write(result)
    print(markdown(result))
    return 1 if result["failures"] else 0
