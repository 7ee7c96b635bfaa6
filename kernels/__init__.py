"""MoE kernels, each beside a plain-PyTorch reference of the same function (see kernels/README.md).

    kernels.backend        which implementation a call runs (Triton / torch / reference), warn_once, cpu_values
    kernels.permute        gather_rows / combine_rows (Triton + reference), permute / unpermute_combine
                           (autograd, driven by a model.dispatch.RowMap), row_weights
    kernels.grouped_gemm   grouped_mm (autograd; onednn / torch / Triton / reference backends), SwiGLU,
                           ScaledSwiGLU, grouped_swiglu (all experts' SwiGLU FFN in two grouped GEMMs)
    kernels.cpu_experts    cpu_experts: per-expert oneDNN chains on CPU (the "cpu_chains" experts of
                           model/experts.py: gather, GEMMs and combine fused per expert)

The MoE layer's dispatch logic (row maps, dispatchers) lives in model/dispatch.py; these are the kernels it
and the experts call.
"""
