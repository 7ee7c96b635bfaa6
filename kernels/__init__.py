"""MoE kernels: Triton implementations, each beside a plain-PyTorch reference of the same function.

    kernels.permute        build_row_map, permute / unpermute_combine (autograd), gather_rows, combine_rows
    kernels.grouped_gemm   grouped_mm (autograd; torch / Triton / reference backends), grouped_swiglu
"""
