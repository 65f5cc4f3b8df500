"""Compile every Triton kernel for Hopper (sm_90) on a machine without a GPU.

Run as a script (``python tests/compile_sm90.py``) with ``TRITON_INTERPRET`` unset;
``tests/test_kernels_compile.py`` does that in a subprocess.


Triton's compiler (front end, LLVM, ptxas) runs on the CPU; compiling for
``GPUTarget("cuda", 90, 32)`` catches what the interpreter never sees: non-constexpr
globals, unsupported ops, type errors in code paths the interpreter skips. The
compiled kernels' run-time behaviour is tested on the H200 (the same test files with
a CUDA device).
"""

import sys
import traceback

import triton
import triton.language as tl

from mxlib.kernels import fused_dequant_moe as D
from mxlib.kernels import fused_moe as F
from mxlib.kernels import quant as Q

from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HOPPER = GPUTarget("cuda", 90, 32)
FMT = {  # EBITS, MBITS, EMAX, MAX, SPECIALS
    "e2m1": (2, 1, 2, 6.0, 0),
    "e2m3": (2, 3, 2, 7.5, 0),
    "e3m2": (3, 2, 4, 28.0, 0),
    "e4m3": (4, 3, 8, 448.0, 1),
    "e5m2": (5, 2, 15, 57344.0, 2),
}


def compile_kernel(fn, pointer_types: dict, constexprs: dict, num_warps=4):
    names = fn.arg_names
    signature = {n: "constexpr" if n in constexprs else pointer_types.get(n, "i32") for n in names}
    src = ASTSource(fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=HOPPER, options={"num_warps": num_warps, "enable_fp_fusion": False})


def fmt_consts(el, keys=("EBITS", "MBITS", "EMAX", "MAX", "SPECIALS")):
    vals = dict(zip(("EBITS", "MBITS", "EMAX", "MAX", "SPECIALS"), FMT[el]))
    return {k: vals[k] for k in keys}


def mx_kernels(el, mode, dtype):
    out = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}[dtype]
    compile_kernel(Q._mx_qdq_kernel, {"x_ptr": f"*{dtype}", "out_ptr": f"*{dtype}"},
                   dict(fmt_consts(el, ("EBITS", "MBITS", "EMAX", "MAX")), SCALE_MODE=mode, BS=32, OUT_DTYPE=out,
                        BLOCK_R=8, BLOCK_K=512))
    compile_kernel(Q._mx_quantize_kernel, {"x_ptr": f"*{dtype}", "packed_ptr": "*u8", "scale_ptr": "*u8"},
                   dict(fmt_consts(el), SCALE_MODE=mode, BS=32, BLOCK_R=8, BLOCK_K=512))
    compile_kernel(Q._dequantize_kernel, {"packed_ptr": "*u8", "scale_ptr": "*u8", "g_ptr": "*fp32", "out_ptr": f"*{dtype}"},
                   dict(fmt_consts(el, ("EBITS", "MBITS", "SPECIALS")), BS=32, NVFP4=False, OUT_DTYPE=out, BLOCK_R=8,
                        BLOCK_K=512))


def nvfp4_kernels(divide):
    compile_kernel(Q._nvfp4_qdq_kernel, {"x_ptr": "*bf16", "gs_ptr": "*fp32", "out_ptr": "*bf16"},
                   dict(DIVIDE=divide, BS=16, OUT_DTYPE=tl.bfloat16, BLOCK_R=8, BLOCK_K=512))
    compile_kernel(Q._nvfp4_quantize_kernel, {"x_ptr": "*bf16", "g_ptr": "*fp32", "packed_ptr": "*u8", "scale_ptr": "*u8"},
                   dict(ZERO_BLOCK_ONE=not divide, BS=16, BLOCK_R=8, BLOCK_K=512))
    compile_kernel(Q._dequantize_kernel, {"packed_ptr": "*u8", "scale_ptr": "*u8", "g_ptr": "*fp32", "out_ptr": "*bf16"},
                   dict(EBITS=2, MBITS=1, SPECIALS=0, BS=16, NVFP4=True, OUT_DTYPE=tl.bfloat16, BLOCK_R=8, BLOCK_K=512))
    compile_kernel(Q._fp8_qdq_kernel, {"x_ptr": "*bf16", "scale_ptr": "*fp32", "out_ptr": "*fp16"},
                   dict(OUT_DTYPE=tl.float16, BLOCK=1024))


def fused_moe(mul_routed_weight):
    k = compile_kernel(
        F.fused_moe_kernel,
        {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "topk_weights_ptr": "*fp32",
         "sorted_token_ids_ptr": "*i32", "expert_ids_ptr": "*i32", "num_tokens_post_padded_ptr": "*i32"},
        dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64, GROUP_SIZE_M=8, MUL_ROUTED_WEIGHT=mul_routed_weight,
             top_k=8, UPCAST=False, OUT_DTYPE=tl.bfloat16),
    )
    # bf16 tensor-core MMA on Hopper: warpgroup MMA (wgmma) in the PTX
    assert "wgmma" in k.asm["ptx"], "no warpgroup MMA in the fused-MoE kernel's PTX"


def fused_dequant(w_fmt, nvfp4, gated, a2_kind, split=False):
    ptrs = {"a_ptr": "*bf16", "w_ptr": "*u8", "ws_ptr": "*u8", "wg_ptr": "*fp32", "c_ptr": "*bf16",
            "topk_weights_ptr": "*fp32", "sorted_token_ids_ptr": "*i32", "expert_ids_ptr": "*i32",
            "num_tokens_post_padded_ptr": "*i32", "act_scale_ptr": "*fp32"}
    eb, mb, _, _, sp = FMT[w_fmt]
    a2 = FMT["e3m2"]
    k = compile_kernel(D.fused_moe_dequant_kernel, ptrs, dict(
        W_EBITS=eb, W_MBITS=mb, W_SPECIALS=sp, W_BS=16 if nvfp4 else 32, W_NVFP4=nvfp4,
        GATED=gated, A2_KIND=a2_kind, A2_EBITS=a2[0], A2_MBITS=a2[1], A2_EMAX=a2[2], A2_MAX=a2[3], A2_SCALE_MODE=1,
        A2_BS=16 if a2_kind == 2 else 32, MUL_ROUTED_WEIGHT=not gated, top_k=8, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128,
        GROUP_SIZE_M=1, SPLIT_NIBBLES=split, OUT_DTYPE=tl.bfloat16, UPCAST=False))
    assert "wgmma" in k.asm["ptx"], "no warpgroup MMA in the fused dequant kernel's PTX"


JOBS = [(mx_kernels, a) for a in [("e2m1", 1, "bf16"), ("e2m3", 0, "bf16"), ("e3m2", 2, "fp16"), ("e4m3", 0, "fp32"), ("e5m2", 1, "bf16")]]
JOBS += [(nvfp4_kernels, (d,)) for d in (False, True)] + [(fused_moe, (m,)) for m in (False, True)]
JOBS += [(fused_dequant, a) for a in [("e2m1", True, True, 2), ("e2m1", False, True, 1), ("e3m2", False, True, 3),
                                      ("e2m3", False, True, 0), ("e2m1", True, False, 0), ("e4m3", False, False, 0),
                                      ("e2m1", True, True, 2, True), ("e2m1", False, False, 0, True),
                                      ("e3m2", False, True, 1, True), ("e2m3", False, False, 0, True)]]


def main() -> int:
    failed = 0
    for fn, args in JOBS:
        try:
            fn(*args)
            print(f"OK   {fn.__name__}{args}", flush=True)
        except Exception:
            failed += 1
            e = sys.exc_info()[1]
            while e.__cause__ is not None:
                e = e.__cause__
            print(f"FAIL {fn.__name__}{args}: {e!r}\n{traceback.format_exc()[-1500:]}", flush=True)
    print(f"triton {triton.__version__}: {len(JOBS) - failed} of {len(JOBS)} kernel groups compiled for sm_90")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
