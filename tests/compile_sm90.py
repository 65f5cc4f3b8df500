"""Compile every Triton kernel for Hopper (sm_90) on a machine without a GPU.

Run as a script (``python tests/compile_sm90.py``) with ``TRITON_INTERPRET`` unset;
``tests/test_kernels_compile.py`` does that in a subprocess. ``--dump DIR`` also writes each
compiled kernel's TTGIR (source locations removed) and SASS to ``DIR`` and prints their sizes
(``COUNT job kernel ttgir_lines sass_instructions sha``): two runs whose dumps are identical
generated the same code, whatever the modules and helpers were named.


Triton's compiler (front end, LLVM, ptxas) runs on the CPU; compiling for
``GPUTarget("cuda", 90, 32)`` catches what the interpreter never sees: non-constexpr
globals, unsupported ops, type errors in code paths the interpreter skips. The
compiled kernels' run-time behaviour is tested on the H200 (the same test files with
a CUDA device).
"""

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "0")  # compile, do not interpret (see mxlib.kernels)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from mxlib.formats import BLOCK_SCHEMES, ELEMENT_FORMATS, NVFP4, Numerics, get_activation_format  # noqa: E402
from mxlib.kernels import align as A  # noqa: E402
from mxlib.kernels import fp4_activations as FA  # noqa: E402
from mxlib.kernels import fp4_layout as F4  # noqa: E402
from mxlib.kernels import fused_dequant_moe as D  # noqa: E402
from mxlib.kernels import fused_fp4_moe as P  # noqa: E402
from mxlib.kernels import fused_moe as F  # noqa: E402
from mxlib.kernels import quant as Q  # noqa: E402
from mxlib.kernels._bridge import kernel_format_args, select  # noqa: E402
from mxlib.kernels.moe_epilogue import activation_args  # noqa: E402
from mxlib.kernels.tiles import TileConfig  # noqa: E402
from mxlib.moe.activations import SWIGLUOAI  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)


def arith(gpt_oss: bool) -> dict:
    """The epilogue constexprs of an expert arithmetic: gpt-oss's (expert biases, SwiGLU-OAI with its clamp)
    or the default (no bias, SiLU)."""
    return dict(HAS_BIAS=gpt_oss, **activation_args(SWIGLUOAI if gpt_oss else None))


def compile_kernel(fn, pointer_types: dict, constexprs: dict, num_warps=4, divisible=(), num_stages=3):
    """``divisible``: pointer and integer arguments to specialize as multiples of 16 (what the JIT does
    at a launch whose pointers are 16-byte aligned and whose values are multiples of 16)."""
    names = fn.arg_names
    signature = {n: "constexpr" if n in constexprs else pointer_types.get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    src = ASTSource(
        fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()}, attrs=attrs
    )
    k = triton.compile(
        src, target=HOPPER, options={"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": False}
    )
    COMPILED.append((fn.__name__, k))
    return k


COMPILED: list = []  # (kernel name, compiled kernel) of the job that is running (``--dump``)


def ttgir_text(k) -> str:
    """The TTGIR without source locations (``loc(...)`` references and the ``#loc`` table)."""
    lines = [
        re.sub(r"\s*loc\([^()]*(\([^()]*\))*[^()]*\)", "", ln)
        for ln in k.asm["ttgir"].splitlines()
        if not ln.startswith("#loc")
    ]
    return "\n".join(ln for ln in lines if ln.strip()) + "\n"


def sass_text(k) -> str:
    """The SASS instructions of the cubin (``cuobjdump -sass``, addresses and encodings kept)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        out = subprocess.run(
            [triton.knobs.nvidia.cuobjdump.path, "-sass", f.name], capture_output=True, text=True, check=True
        ).stdout
    return "\n".join(ln.strip() for ln in out.splitlines() if re.match(r"\s*/\*[0-9a-f]{4,}\*/", ln)) + "\n"


def dump(job: int, where: Path) -> None:
    for i, (name, k) in enumerate(COMPILED):
        ttgir, sass = ttgir_text(k), sass_text(k)
        stem = f"{job:02d}_{i}_{name}"
        (where / f"{stem}.ttgir").write_text(ttgir)
        (where / f"{stem}.sass").write_text(sass)
        sha = hashlib.sha256((ttgir + sass).encode()).hexdigest()[:12]
        print(f"COUNT {job:02d} {i} {name} {ttgir.count(chr(10))} {sass.count(chr(10))} {sha}", flush=True)


def mx_kernels(el, mode, dtype):
    out = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}[dtype]
    fmt = kernel_format_args(ELEMENT_FORMATS[el], block_size=BLOCK_SCHEMES["mxfp4"].block_size, scale_mode=mode)
    compile_kernel(
        Q._mx_qdq_kernel,
        {"x_ptr": f"*{dtype}", "out_ptr": f"*{dtype}"},
        dict(select(Q._mx_qdq_kernel, fmt), OUT_DTYPE=out, BLOCK_R=8, BLOCK_K=512),
    )
    compile_kernel(
        Q._mx_quantize_kernel,
        {"x_ptr": f"*{dtype}", "packed_ptr": "*u8", "scale_ptr": "*u8"},
        dict(select(Q._mx_quantize_kernel, fmt), BLOCK_R=8, BLOCK_K=512),
    )
    compile_kernel(
        Q._dequantize_kernel,
        {"packed_ptr": "*u8", "scale_ptr": "*u8", "g_ptr": "*fp32", "out_ptr": f"*{dtype}"},
        dict(select(Q._dequantize_kernel, fmt), NVFP4=False, OUT_DTYPE=out, BLOCK_R=8, BLOCK_K=512, G_ENCODE=False),
    )


def nvfp4_kernels(divide):
    bs = NVFP4.block_size
    compile_kernel(
        Q._nvfp4_qdq_kernel,
        {"x_ptr": "*bf16", "gs_ptr": "*fp32", "out_ptr": "*bf16"},
        dict(DIVIDE=divide, BS=bs, OUT_DTYPE=tl.bfloat16, BLOCK_R=8, BLOCK_K=512),
    )
    fmt = {**kernel_format_args(NVFP4), **kernel_format_args(NVFP4.scale.element, "S_")}
    compile_kernel(
        Q._nvfp4_quantize_kernel,
        {"x_ptr": "*bf16", "g_ptr": "*fp32", "packed_ptr": "*u8", "scale_ptr": "*u8"},
        dict(select(Q._nvfp4_quantize_kernel, fmt), ZERO_BLOCK_ONE=not divide, BLOCK_R=8, BLOCK_K=512),
    )
    compile_kernel(
        Q._dequantize_kernel,
        {"packed_ptr": "*u8", "scale_ptr": "*u8", "g_ptr": "*fp32", "out_ptr": "*bf16"},
        dict(
            select(Q._dequantize_kernel, kernel_format_args(NVFP4)),
            OUT_DTYPE=tl.bfloat16,
            BLOCK_R=8,
            BLOCK_K=512,
            G_ENCODE=divide,
        ),
    )  # encode global scales (compressed-tensors) with divide
    compile_kernel(
        Q._fp8_qdq_kernel,
        {"x_ptr": "*bf16", "scale_ptr": "*fp32", "out_ptr": "*fp16"},
        dict(OUT_DTYPE=tl.float16, BLOCK=1024),
    )


def fused_moe(mul_routed_weight, naive=False, gpt_oss=False):
    k = compile_kernel(
        F.fused_moe_kernel,
        {
            "a_ptr": "*bf16",
            "b_ptr": "*bf16",
            "c_ptr": "*bf16",
            "topk_weights_ptr": "*fp32",
            "sorted_token_ids_ptr": "*i32",
            "expert_ids_ptr": "*i32",
            "num_tokens_post_padded_ptr": "*i32",
            "bias_ptr": "*fp32",
        },
        dict(
            HAS_BIAS=gpt_oss,
            BLOCK_SIZE_M=64,
            BLOCK_SIZE_N=64,
            BLOCK_SIZE_K=64,
            GROUP_SIZE_M=8,
            MUL_ROUTED_WEIGHT=mul_routed_weight,
            top_k=8,
            UPCAST=False,
            OUT_DTYPE=tl.bfloat16,
            NAIVE=naive,
        ),
    )
    # bf16 tensor-core MMA on Hopper: warpgroup MMA (wgmma) in the PTX
    assert "wgmma" in k.asm["ptx"], "no warpgroup MMA in the fused-MoE kernel's PTX"


def fused_dequant(weight, gated, a2, split=False, gpt_oss=False):
    """``weight``: a block scheme name; ``a2``: the activation format of GEMM1's epilogue (or None)."""
    ptrs = {
        "a_ptr": "*bf16",
        "w_ptr": "*u8",
        "ws_ptr": "*u8",
        "wg_ptr": "*fp32",
        "c_ptr": "*bf16",
        "topk_weights_ptr": "*fp32",
        "sorted_token_ids_ptr": "*i32",
        "expert_ids_ptr": "*i32",
        "num_tokens_post_padded_ptr": "*i32",
        "act_scale_ptr": "*fp32",
        "bias_ptr": "*fp32",
    }
    kernel = D.fused_moe_dequant_kernel
    fmt = {
        **kernel_format_args(BLOCK_SCHEMES[weight], "W_"),
        **D.ActivationQDQ(get_activation_format(a2)).kernel_args(),
    }
    k = compile_kernel(
        kernel,
        ptrs,
        dict(
            select(kernel, fmt),
            **arith(gpt_oss),
            GATED=gated,
            MUL_ROUTED_WEIGHT=not gated,
            top_k=8,
            BLOCK_M=16,
            BLOCK_N=64,
            BLOCK_K=128,
            GROUP_SIZE_M=1,
            SPLIT_NIBBLES=split,
            OUT_DTYPE=tl.bfloat16,
            UPCAST=False,
        ),
    )
    assert "wgmma" in k.asm["ptx"], "no warpgroup MMA in the fused dequant kernel's PTX"


SM90_SHARED = 232448  # bytes of shared memory a block may use on sm_90 (227 KiB)


def fused_fp4(weight, numerics, gated, a, naive=False, one=False, cfg=None, per_token=False, gpt_oss=False):
    """The FP4 kernel: ``weight`` mxfp4 / nvfp4 (or mxfp6_*: the FP6 layout's K loop), ``numerics``
    vllm / hardware, ``a`` the activation format of the A-load QDQ (GEMM1) and of the epilogue QDQ
    (GEMM1) or None; PTX decode (the compiled path); ``one``: the one-multiply decode
    (``fp4_one_multiply``). ``cfg``: a ``TileConfig`` (default 16 x 64, 4 warps, 3 stages).
    ``per_token``: per-token NVFP4 activation scales read row by row (``A_PER_TOKEN``; GEMM2 too).
    ``gpt_oss``: expert biases and SwiGLU-OAI in the epilogue (``arith``)."""
    cfg = cfg or TileConfig(16, 64, None, 1, 4, 3)
    nw = max(1, min(cfg.num_warps, cfg.block_n // 16))  # as ``_launch``
    w = BLOCK_SCHEMES[weight]
    fp6 = w.element.nbits == 6
    q = D.ActivationQDQ(get_activation_format(a))
    numerics = Numerics(numerics)
    w_kind = F4.W_MX if not w.has_global_scale else (F4.W_NVFP4_VLLM if numerics is Numerics.VLLM else F4.W_NVFP4_HW)
    ptrs = {
        "a_ptr": "*bf16",
        "w_ptr": "*i32",
        "ws_ptr": "*i32",
        "wg_ptr": "*fp32",
        "c_ptr": "*bf16",
        "topk_weights_ptr": "*fp32",
        "sorted_token_ids_ptr": "*i32",
        "expert_ids_ptr": "*i32",
        "num_tokens_post_padded_ptr": "*i32",
        "a_scale_ptr": "*fp32",
        "c_scale_ptr": "*fp32",
        "rot_signs_ptr": "*fp32",
        "bias_ptr": "*fp32",
    }
    kernel = P.fused_fp4_moe_kernel
    qdq = {**P._qdq_consts(q if gated else None, "A"), **P._qdq_consts(q if gated else None, "C")}
    nv_hw = numerics is Numerics.HARDWARE and (q.kind == D.A2_NVFP4 or per_token)
    k = compile_kernel(
        kernel,
        ptrs,
        dict(
            select(kernel, qdq),
            **arith(gpt_oss),
            W_KIND=w_kind,
            W_BS=w.block_size,
            MODE=numerics.kernel_id,
            W_ONE=one,
            W_BITS=w.element.nbits,
            W_EBITS=w.element.ebits,
            GATED=gated,
            W_GLOBAL_OUT=w_kind == F4.W_NVFP4_HW,
            A_INV_OUT=nv_hw,
            A_PER_TOKEN=per_token,
            MUL_ROUTED_WEIGHT=not gated,
            top_k=8 if gated else 1,
            NAIVE=naive,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            GROUP_SIZE_M=1,
            OUT_DTYPE=tl.bfloat16,
            NUM_WARPS=nw,
            ROT_BS=0,  # no online rotation (tests/test_gpu_hadamard.py compiles the rotated kernel on the H200)
            ROT_SIGNS=False,
        ),
        num_warps=nw,
        num_stages=cfg.num_stages,
        # as launched on the Qwen3-30B-A3B layer: torch's pointers 16-byte aligned, H, I and the row strides
        # multiples of 16 (the scale rows of w2 are not: I / 32 / 4 = 6 words)
        divisible=[*ptrs, "N", "K", "stride_am", "stride_we", "stride_wn", "stride_se", "stride_cm"],
    )
    assert "wgmma" in k.asm["ptx"], "no warpgroup MMA in the FP4 kernel's PTX"
    assert k.metadata.shared <= SM90_SHARED, f"{k.metadata.shared} bytes of shared memory (sm_90: {SM90_SHARED})"
    if fp6:  # the FP6 decode ran (its PTX block: rotate and bf16x2 multiply), not the FP4 loop
        assert "shf.l.wrap.b32" in k.asm["ptx"] and "lop3.b32" in k.asm["ptx"], "no FP6 decode in the PTX"
    if a is None:  # weight-only: the decoded tile reaches the MMA in registers (no register -> shared store)
        stores = k.asm["ttgir"].count("ttg.local_alloc %")
        assert stores == 0, f"{stores} register -> shared-memory tile stores in the weight-only {weight} kernel"
    compile_kernel(
        P._sum_k_kernel, {"x_ptr": "*bf16", "out_ptr": "*bf16"}, dict(top_k=8, BLOCK=1024, OUT_DTYPE=tl.bfloat16)
    )
    if per_token:  # the per-token scales pre-pass and the per-row QDQ pass (a1, a2)
        for qdq in (False, True):
            compile_kernel(
                Q._nvfp4_per_token_kernel,
                {"x_ptr": "*bf16", "out_ptr": "*bf16", "scales_ptr": "*fp32"},
                dict(QDQ=qdq, HW=nv_hw, BS=16, OUT_DTYPE=tl.bfloat16, BLOCK_R=4, BLOCK_K=1024),
            )
    if w.has_global_scale and numerics is Numerics.HARDWARE and gated:  # its standalone a1 QDQ
        compile_kernel(
            FA._nvfp4_hw_qdq_kernel, {"x_ptr": "*bf16", "out_ptr": "*bf16", "gs_ptr": "*fp32"}, dict(BLOCK_K=512)
        )


def align(single):
    """The Triton moe_align_block_size: one launch (one chunk) or histogram + scatter."""
    ptrs = {
        "topk_ids_ptr": "*i32",
        "hist_ptr": "*i32",
        "base_ptr": "*i32",
        "sorted_ptr": "*i32",
        "expert_ids_ptr": "*i32",
        "num_post_ptr": "*i32",
    }
    if not single:
        compile_kernel(A._chunk_hist_kernel, ptrs, dict(E=128, E_PAD=256, CHUNK=1024))
    compile_kernel(
        A._align_scatter_kernel,
        ptrs,
        dict(
            E=128,
            E_PAD=256,
            CHUNK=1024,
            LOG_CHUNK=10,
            NCHUNK_PAD=1 if single else 32,
            SINGLE=single,
            BLOCK_M=64,
            BM_PAD=64,
            FILL=1024,
            JB=16,
        ),
        num_warps=8,
    )


JOBS = [
    (mx_kernels, a)
    for a in [
        ("e2m1", "even", "bf16"),
        ("e2m3", "floor", "bf16"),
        ("e3m2", "rceil", "fp16"),
        ("e4m3", "floor", "fp32"),
        ("e5m2", "even", "bf16"),
    ]
]
JOBS += [(nvfp4_kernels, (d,)) for d in (False, True)] + [(fused_moe, (m,)) for m in (False, True)]
JOBS += [(fused_moe, (True, True)), (align, (True,)), (align, (False,))]
JOBS += [(fused_moe, (m, False, True)) for m in (False, True)]  # gpt-oss: expert biases
JOBS += [
    (fused_fp4, a)
    for a in [
        ("nvfp4", "vllm", True, "nvfp4"),
        ("nvfp4", "hardware", True, "nvfp4"),
        ("nvfp4", "vllm", False, None),
        ("nvfp4", "hardware", False, None),
        ("mxfp4", "vllm", True, None),
        ("mxfp4", "vllm", True, "mxfp4"),
        ("mxfp4", "vllm", True, "fp8_e4m3"),
        ("mxfp4", "vllm", False, None, True),
        ("mxfp4", "vllm", True, None, False, True),
        ("mxfp4", "vllm", False, None, False, True),
        ("nvfp4", "vllm", True, "nvfp4", False, True),
        ("mxfp6_e2m3", "vllm", True, None),
        ("mxfp6_e2m3", "vllm", False, None),
        ("mxfp6_e3m2", "vllm", True, None),
        ("mxfp6_e3m2", "vllm", False, None, True),
        ("mxfp6_e3m2", "vllm", True, "mxfp6_e3m2"),
        ("mxfp6_e2m3", "hardware", True, "fp8_e4m3"),
        # per-token NVFP4: the A-load QDQ with each row's gs (a1_fused), GEMM2's rows scaled (hardware)
        ("nvfp4", "vllm", True, "nvfp4", False, False, None, True),
        ("nvfp4", "hardware", True, "nvfp4", False, False, None, True),
        ("nvfp4", "hardware", False, None, False, False, None, True),
        ("nvfp4", "hardware", True, None, True, False, None, True),
        # gpt-oss's expert arithmetic: biases on both GEMMs, SwiGLU-OAI in GEMM1's epilogue
        ("mxfp4", "vllm", True, None, False, False, None, False, True),
        ("mxfp4", "vllm", False, None, False, False, None, False, True),
        ("mxfp4", "vllm", True, "mxfp4", False, False, None, False, True),
        ("nvfp4", "hardware", True, "nvfp4", False, False, None, False, True),
    ]
]
# every FP6 tile of the table (GEMM1 gated, GEMM2 plain): it compiles and fits in shared memory
JOBS += [
    (fused_fp4, ("mxfp6_e3m2", "vllm", gated, None, False, False, cfgs[1 - gated]))
    for _, cfgs in P.FP6_CONFIGS
    for gated in (True, False)
]
JOBS += [
    (fused_dequant, a)
    for a in [
        ("nvfp4", True, "nvfp4"),
        ("mxfp4", True, "mxfp6_e3m2"),
        ("mxfp6_e3m2", True, "fp8_e4m3"),
        ("mxfp6_e2m3", True, None),
        ("nvfp4", False, None),
        ("mxfp8_e4m3", False, None),
        ("mxfp8_e4m3", True, "mxfp8_e4m3"),  # the FP8 weight tile's hardware conversion, gated and e5m2
        ("mxfp8_e5m2", False, None),
        ("nvfp4", True, "nvfp4", True),
        ("mxfp4", False, None, True),
        ("mxfp6_e3m2", True, "mxfp6_e3m2", True),
        ("mxfp6_e2m3", False, None, True),
        ("mxfp4", True, "mxfp4", False, True),  # gpt-oss: biases, SwiGLU-OAI
        ("mxfp4", False, None, False, True),
    ]
]


def main(argv: list[str]) -> int:
    where = Path(argv[argv.index("--dump") + 1]) if "--dump" in argv else None
    if where is not None:
        where.mkdir(parents=True, exist_ok=True)
    failed = 0
    for job, (fn, args) in enumerate(JOBS):
        try:
            COMPILED.clear()
            fn(*args)
            print(f"OK   {fn.__name__}{args}", flush=True)
            if where is not None:
                dump(job, where)
        except Exception:  # noqa: BLE001  every job is reported, a failing one does not stop the others
            failed += 1
            e = sys.exc_info()[1]
            while e.__cause__ is not None:
                e = e.__cause__
            print(f"FAIL {fn.__name__}{args}: {e!r}\n{traceback.format_exc()[-1500:]}", flush=True)
    print(f"triton {triton.__version__}: {len(JOBS) - failed} of {len(JOBS)} kernel groups compiled for sm_90")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
