"""What the online block Hadamard rotation costs on the GPU, and what it does to the error on the CPU.

``python -m mxlib.bench.rotation [--tokens 1,4,16,64,256,1024,4096] [--json PATH]`` (CUDA), and
``python -m mxlib.bench.rotation --metric-trap [--json PATH]`` (CPU, no GPU needed).

GPU inputs: the fused benchmark's (``mxlib.bench.fused``: one Qwen3-30B-A3B layer, E 128, top-8, H 2048,
I 768, the harness recipe's weights, tokens and routing). Rows (``path``), CUDA-graph replay medians
(``_common.graph_ms``) of the whole forward on the ``fused`` backend (the FP4 kernel):

* ``fused_<scheme>`` and ``fused_<scheme>_hadamard`` for ``nvfp4`` and ``w_mxfp4_a_mxfp4``: the same layer
  without and with the rotation (``HadamardRotation(signs="random")``: block 16 for NVFP4, 32 for MXFP4;
  a1 rotated in one pass before the kernel, a2 in GEMM1's epilogue); NVFP4 static activation scales from
  the calibration batch, rotated for the rotated layer (``calibration_scales``);
* ``pass_rotate_a1_<block>``: the a1 rotation pass alone over ``[M, H]`` (``block_hadamard``).

``ratios``: each rotated row's time over its unrotated row's, per M. ``checks``: the rotated fused
output against the torch backend's (relative L2: the same QDQ bits, bf16 GEMMs in another order).

``--metric-trap``: ``metric_trap()`` on outlier-heavy activations (``outlier_activations``): the
energy-weighted SQNR (``analysis.sqnr_db`` over the whole tensor, dominated by the outliers' energy),
the mean per-row SQNR and the SQNR of the non-outlier channels, of NVFP4 and MXFP4 QDQ, without rotation
and with random-sign block Hadamard rotations of 16 and 128 points (the error measured after rotating back).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from .. import reference as R
from ..analysis import sqnr_db
from ..formats import NVFP4_SCALE_DIVISOR
from ..kernels.hadamard import BlockHadamard, block_hadamard, ref_block_hadamard
from ..moe.factory import make_emulation_experts, quantize_expert_weights
from ..moe.reference_moe import silu_and_mul
from ..moe.schemes import get_moe_scheme
from ..recovery.hadamard import HadamardRotation, random_signs
from ._common import env, graph_ms

__all__ = [
    "SCHEMES",
    "calibration_scales",
    "layer_paths",
    "outlier_activations",
    "metric_trap",
    "run",
    "main",
]

SCHEMES = ("nvfp4", "w_mxfp4_a_mxfp4")
TOKENS = [1, 4, 16, 64, 256, 1024, 4096]


def calibration_scales(w13, x_cal, rotation: BlockHadamard | None, scheme):
    """NVFP4 static ``(w13_input_scale [E], w2_input_scale [E])`` (one value for all experts): ``amax / 2688``
    of the calibration batch (a1) and of the SiLU-and-mul of expert 0's GEMM1 on its first 512 tokens
    (a2), both rotated by ``rotation`` (the activations the rotated layer quantizes); ``w13`` rotated
    alike. ``(None, None)`` for schemes without a static activation scale."""
    s = get_moe_scheme(scheme)
    if not s.static_activation_scale:
        return None, None
    e, div = w13.shape[0], s.activation.scale_divisor
    a1 = x_cal if rotation is None else rotation.rotate_h(x_cal)
    h_cal = (a1[:512].float() @ w13[0].float().T).to(torch.bfloat16)
    a2 = silu_and_mul(h_cal)
    a2 = a2 if rotation is None else rotation.rotate_i(a2)
    full = lambda v: torch.full((e,), float(v) / div, device=w13.device)  # noqa: E731
    return full(a1.abs().amax()), full(a2.abs().amax())


def layer_paths(w13, w2, x_cal, backend: str = "fused", schemes=SCHEMES, seed: int = 0) -> dict:
    """``{path: experts}``: each scheme without and with ``HadamardRotation(signs="random", seed=seed)``
    (weights rotated offline and quantized by round-to-nearest; ``module docstring`` for the names)."""
    paths = {}
    for name in schemes:
        s = get_moe_scheme(name)
        for rotated in (False, True):
            tech = HadamardRotation(signs="random", seed=seed) if rotated else None
            if tech is None:
                q, rotation = quantize_expert_weights(w13, w2, s), None
            else:
                q = tech.quantize_experts(w13, w2, s, layer=0)
                r = tech.rotation_for(w13.shape[-1], w2.shape[-1], s)
                rotation = BlockHadamard(r.block_size, r.signs_h.to(w13.device), r.signs_i.to(w13.device))
            w13_cal = w13 if rotation is None else ref_block_hadamard(w13, rotation.block_size, rotation.signs_h)
            scales = calibration_scales(w13_cal, x_cal, rotation, s)
            ex = make_emulation_experts(s, q, *scales, backend=backend, rotation=rotation)
            paths[f"fused_{name}" + ("_hadamard" if rotated else "")] = ex
    return paths


def outlier_activations(rows: int = 1024, k: int = 2048, outlier_every: int = 256, outlier_scale: float = 40.0, seed=0):
    """fp32 ``[rows, k]``: N(0, 1) with one channel in every ``outlier_every`` scaled by ``outlier_scale``
    (the channel outliers of LLM activations), bf16-representable."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    x[:, ::outlier_every] *= outlier_scale
    return x.to(torch.bfloat16).float()


def _nvfp4_qdq(x: torch.Tensor) -> torch.Tensor:
    gs = (NVFP4_SCALE_DIVISOR / x.abs().amax()).reshape(1).float()  # encode global scale 6 * 448 / amax
    return R.ref_nvfp4_quant_dequant(x, gs).float()


def _mxfp4_qdq(x: torch.Tensor) -> torch.Tensor:
    return R.quant_dequant_mx(x, "e2m1", 32, "even").float()


# the two formats of the error study: QDQ of a tensor with its own amax (NVFP4's global scale)
_QDQ = {"nvfp4": _nvfp4_qdq, "mxfp4": _mxfp4_qdq}


def metric_trap(x: torch.Tensor | None = None, blocks=(16, 128), seed: int = 0) -> list[dict]:
    """NVFP4 and MXFP4 QDQ error of ``x [rows, K]`` (default ``outlier_activations()``), unrotated and
    rotated by random-sign block Hadamard of each size in ``blocks`` (QDQ in the rotated basis, the
    error measured after rotating back: float64, exact). Rows: ``{"format", "rotation", "sqnr_db"
    (energy-weighted, whole tensor), "row_sqnr_db" (mean over rows of each row's SQNR), "bulk_sqnr_db"
    (the channels whose RMS is at most 4x the median channel's: the error the outliers' energy hides)}``."""
    x = outlier_activations() if x is None else x.float()
    rms = x.pow(2).mean(0).sqrt()
    outliers = rms > 4 * rms.median()  # the outlier channels
    out = []
    for fmt, qdq in _QDQ.items():
        for b in (None,) + tuple(blocks):
            signs = None if b is None else random_signs(x.shape[-1], seed)
            xr = x if b is None else ref_block_hadamard(x, b, signs)
            q = qdq(xr.to(torch.bfloat16).float()).double()
            back = q if b is None else ref_block_hadamard(q, b) * signs.double()  # Q^-1 = H_b / sqrt(b), then D
            xd = x.double()
            row = 10 * torch.log10((xd**2).sum(1) / ((back - xd) ** 2).sum(1))
            bulk = sqnr_db(back[:, ~outliers], xd[:, ~outliers])
            out.append(
                dict(
                    format=fmt,
                    rotation=b or 0,
                    sqnr_db=sqnr_db(back, xd),
                    row_sqnr_db=float(row.mean()),
                    bulk_sqnr_db=bulk,
                )
            )
    return out


def run(tokens, log=print) -> dict:
    """Time every path and the rotation pass at every M; ``{"env", "rows", "ratios", "checks", "errors"}``."""
    from .fused import harness_layer, harness_tokens

    result = {"env": env(), "rows": [], "ratios": [], "checks": [], "errors": []}
    t0 = time.time()
    w13, w2, x_cal = harness_layer()
    paths = layer_paths(w13, w2, x_cal)
    log(f"# {result['env']}; setup {time.time() - t0:.0f}s")
    for m in tokens:
        x, tw, ti = harness_tokens(m)
        times = {}
        for path, ex in paths.items():
            try:
                times[path] = graph_ms(lambda ex=ex: ex(x, tw, ti))
            except Exception as exc:  # noqa: BLE001 - one failing row must not lose the others
                result["errors"].append(f"{path} M={m}: {exc!r}")
                continue
            result["rows"].append(dict(path=path, M=m, graph_ms=times[path]))
            if path.endswith("_hadamard"):
                got = ex(x, tw, ti).double()
                ex.backend = "torch"  # the same experts on the pure-PyTorch reference path
                ref = ex(x, tw, ti).double()
                ex.backend = "fused"
                result["checks"].append(
                    dict(
                        M=m,
                        path=path,
                        what="fused vs torch backend, relative L2",
                        rel=float((got - ref).norm() / ref.norm()),
                    )
                )
        for b in (16, 32):
            sh = random_signs(x.shape[-1], 0).to(x.device)
            ms = graph_ms(lambda b=b, sh=sh: block_hadamard(x, b, sh))
            result["rows"].append(dict(path=f"pass_rotate_a1_{b}", M=m, graph_ms=ms))
        for name in SCHEMES:
            a, r = times.get(f"fused_{name}"), times.get(f"fused_{name}_hadamard")
            if a and r:
                result["ratios"].append(dict(M=m, scheme=name, rotated_over_plain=r / a))
        log(f"M={m} ({time.time() - t0:.0f}s): " + ", ".join(f"{p} {t:.4f}" for p, t in times.items()))
    return result


def main(argv=None, json_path=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--json", default=json_path)
    ap.add_argument("--metric-trap", action="store_true", help="the CPU error study only")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if args.metric_trap:
        result = {"metric_trap": metric_trap()}
        for r in result["metric_trap"]:
            print(
                f"{r['format']:6s} rotation {r['rotation']:4d}: SQNR {r['sqnr_db']:6.2f} dB, "
                f"per-row {r['row_sqnr_db']:6.2f} dB, bulk channels {r['bulk_sqnr_db']:6.2f} dB"
            )
    else:
        if not torch.cuda.is_available():
            print("mxlib.bench.rotation needs a CUDA GPU (or --metric-trap, which runs on the CPU)")
            return 2
        result = run([int(t) for t in args.tokens.split(",")])
        result["metric_trap"] = metric_trap()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
