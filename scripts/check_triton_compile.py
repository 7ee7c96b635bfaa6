"""Compile every Triton kernel of kernels/ for an NVIDIA GPU without needing one (Triton's compiler and the
ptxas bundled with its wheel run on the CPU). Exit 0: all compiled; 1: a kernel failed; 2: cannot check.

    python scripts/check_triton_compile.py [--arch 90]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (80 A100, 90 H100/H200)")
    args = p.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("cannot check: TRITON_INTERPRET=1 replaces compilation by interpretation")
        return 2
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:
        print(f"cannot check: triton's compiler API is unavailable ({e})")
        return 2
    import kernels.grouped_gemm as G
    import kernels.permute as P

    i32, const = "i32", "constexpr"
    failed = 0
    for dt in ("fp32", "bf16"):
        prec = "ieee" if dt == "fp32" else "tf32"
        jobs = {
            "gather_rows": (P._gather_rows_kernel,
                            dict(x_ptr=f"*{dt}", src_ptr="*i64", out_ptr=f"*{dt}", D=i32, stride_x=i32, stride_out=i32,
                                 BLOCK_D=const), dict(BLOCK_D=256)),
            "combine_rows": (P._combine_rows_kernel,
                             dict(h_ptr=f"*{dt}", row_ptr="*i64", out_ptr=f"*{dt}", K=i32, D=i32, stride_h=i32,
                                  stride_out=i32, BLOCK_D=const), dict(BLOCK_D=256)),
            "grouped_mm": (G._grouped_mm_kernel,
                           dict(a_ptr=f"*{dt}", b_ptr=f"*{dt}", c_ptr=f"*{dt}", bounds_ptr="*i32",
                                tile_start_ptr="*i32", E=i32, N=i32, K=i32, stride_am=i32, stride_ak=i32,
                                stride_be=i32, stride_bk=i32, stride_bn=i32, stride_cm=i32, stride_cn=i32,
                                BLOCK_M=const, BLOCK_N=const, BLOCK_K=const, PRECISION=const),
                           dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, PRECISION=prec)),
            "grouped_wgrad": (G._grouped_wgrad_kernel,
                              dict(a_ptr=f"*{dt}", g_ptr=f"*{dt}", out_ptr=f"*{dt}", bounds_ptr="*i32", K=i32, N=i32,
                                   stride_am=i32, stride_ak=i32, stride_gm=i32, stride_gn=i32, stride_oe=i32,
                                   stride_ok=i32, stride_on=i32, BLOCK_M=const, BLOCK_K=const, BLOCK_N=const,
                                   PRECISION=const),
                              dict(BLOCK_M=64, BLOCK_K=64, BLOCK_N=32, PRECISION=prec)),
        }
        for name, (fn, sig, constexprs) in jobs.items():
            try:
                k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs),
                                   target=GPUTarget("cuda", args.arch, 32), options={"enable_fp_fusion": False})
                ok = bool(k.asm.get("cubin"))
                print(f"{name:<14} {dt}: {'ok' if ok else 'no cubin'} ({len(k.asm.get('ptx', ''))} chars of PTX)")
                failed += not ok
            except Exception as e:  # report every kernel, then fail
                print(f"{name:<14} {dt}: FAILED {type(e).__name__}: {str(e)[:500]}")
                failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
