"""CPU expert compute for the fused MoE path: one chain per expert, everything on a cache-sized chunk.

    for each expert e (ascending):   x_e = x[tokens of e]                    (gather)
                                     gu_e = x_e @ W_gate_up[e]^T             (oneDNN)
                                     h_e = silu(gate) * up * w_e             (SwiGLU, routing weight)
                                     y[tokens of e] += h_e @ W_down[e]^T     (oneDNN, index_add)

On GPUs the fused path materialises the expert-sorted buffer and runs grouped GEMMs over it (one
launch per step, no host loop). On a CPU, kernel launches cost nothing and memory traffic is what
hurts: each expert's rows here go through the whole chain while they sit in L2, and the [P, D]
permuted buffers, the concatenations of per-segment GEMM outputs and the stacked weight gradients are
never built. The backward runs the same chain in reverse; each expert's weight gradients are the GEMMs'
own fresh outputs, handed to autograd as they are (no copy into a stacked buffer). Each chain runs on
its rows rounded up to a bucket with zero rows (see `_bucket`), so oneDNN sees a bounded set of shapes.

Order of additions: y and grad x accumulate their per-expert contributions in ascending expert order,
from zero, which for every token is the order of its slots (sorted by expert id): the same sums as the
grouped path's combine. The GEMMs are oneDNN's (kernels.grouped_gemm "onednn" backend) and need the
segment bounds on the host: a read of CPU memory (no device, nothing to wait for), so the layer stays
free of device syncs. Padding rows of a padded row map are skipped (their output is discarded anyway).
"""
import torch
from torch.autograd.function import once_differentiable

from kernels.backend import cpu_values
from kernels.grouped_gemm import _onednn_linear, onednn_runs, scaled_swiglu_backward, scaled_swiglu_forward


def cpu_experts_supported(device, dtype) -> bool:
    """Whether cpu_experts runs on this device and compute dtype (CPU, oneDNN, fp32 / native bf16)."""
    return onednn_runs(device, dtype)


def _gate_up_weight(gate_FD, up_FD):
    """[2F, D] = [gate; up] as a view when the two sit back to back (packed), else a copy."""
    F_, D = gate_FD.shape
    if (gate_FD.is_contiguous() and up_FD.is_contiguous() and up_FD.dtype == gate_FD.dtype
            and up_FD.data_ptr() == gate_FD.data_ptr() + gate_FD.numel() * gate_FD.element_size()):
        return gate_FD.as_strided((2 * F_, D), (D, 1))
    return torch.cat([gate_FD, up_FD])


def _bucket(n):
    """Rows to run an n-row chain with: n rounded up to 1/16 of its power of two (at most 6.25% zero
    padding). oneDNN builds and caches one kernel per GEMM shape; exact row counts, new every step, would
    keep building kernels and grow its cache to its capacity (measured: hundreds of MiB over a run)."""
    if n <= 16:
        return n
    g = 1 << max(3, n.bit_length() - 5)
    return -(-n // g) * g


def _gather_padded(src_TD, tok_n, m):
    """src[tok] in the first n rows of an [m, D] buffer, zeros below."""
    n = tok_n.shape[0]
    out = src_TD.new_empty(m, src_TD.shape[1])
    torch.index_select(src_TD, 0, tok_n, out=out[:n])
    out[n:].zero_()
    return out


def _weight_grad(g_mN, x_mK):
    """[N, K] = g^T x, a weight gradient. In bf16 through torch.mm (oneDNN's matmul, which reads the
    transposed operand in place); in fp32 through oneDNN's linear (torch.mm is MKL there, ~1.7x slower on
    an AMD EPYC), which copies g transposed first (measured at 544 rows, D=256, F=384: bf16 0.15 / 0.28 ms
    vs 0.19 / 0.40 for the linear; fp32 0.31 / 0.81 vs 0.54 / 1.1 for mm)."""
    if g_mN.dtype == torch.bfloat16:
        return torch.mm(g_mN.t(), x_mK)
    return _onednn_linear(g_mN.t(), x_mK.t())


class _CPUExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, scale_P, token_of_row_P, segments, out_dtype, *weights):
        # segments: host list of (first row, real rows) per expert; weights: gate_0, up_0, down_0, gate_1, ...
        # in their own dtype (fp32 master weights under bf16 autocast): each expert's [gate; up] is cast to
        # x's dtype in one piece (a view of the packed weights, no concatenation), here and not by
        # autograd, so the backward hands back fp32 gradients without a cast node per weight
        T, D = x_TD.shape
        acc = torch.promote_types(x_TD.dtype, torch.float32)
        y_TD = torch.zeros(T, D, dtype=acc)
        keep = any(ctx.needs_input_grad)  # under no_grad / inference nothing is kept past its chain
        saved = []
        for e, (start, n) in enumerate(segments):
            if n == 0:
                continue
            gate, up, down = weights[3 * e: 3 * e + 3]
            w_gu = _gate_up_weight(gate, up).to(x_TD.dtype)
            w_down = down.to(x_TD.dtype)
            m = _bucket(n)
            tok_n = token_of_row_P[start:start + n]
            scale_m = scale_P.new_zeros(m)
            scale_m[:n] = scale_P[start:start + n]
            gu_m2F = _onednn_linear(_gather_padded(x_TD, tok_n, m), w_gu)
            h_mF, silu_mF = scaled_swiglu_forward(gu_m2F, scale_m)
            y_TD.index_add_(0, tok_n, _onednn_linear(h_mF, w_down)[:n].to(acc))
            if keep:
                saved += [w_gu, w_down, gu_m2F, silu_mF, h_mF, scale_m]
        ctx.segments = segments
        ctx.weight_meta = [(w.shape, w.dtype) for w in weights]
        ctx.save_for_backward(x_TD, scale_P, token_of_row_P, *saved)
        return y_TD.to(out_dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y_TD):
        x_TD, scale_P, token_of_row_P, *saved = ctx.saved_tensors
        E = len(ctx.segments)
        T, D = x_TD.shape
        acc = torch.promote_types(x_TD.dtype, torch.float32)
        need_x, need_scale = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x_TD = torch.zeros(T, D, dtype=acc) if need_x else None
        grad_scale_P = torch.zeros_like(scale_P) if need_scale else None
        grad_y_TD = grad_y_TD.to(x_TD.dtype)
        grad_w = [None] * (3 * E)
        chunk = 0
        for e, (start, n) in enumerate(ctx.segments):
            (gate_shape, w_dtype), down_dtype = ctx.weight_meta[3 * e], ctx.weight_meta[3 * e + 2][1]
            need_gu = ctx.needs_input_grad[5 + 3 * e] or ctx.needs_input_grad[6 + 3 * e]
            need_down = ctx.needs_input_grad[7 + 3 * e]
            if n == 0:  # an idle expert still gets a (zero) gradient: DDP expects every parameter's
                for i in range(3):
                    if ctx.needs_input_grad[5 + 3 * e + i]:
                        shape, dtype = ctx.weight_meta[3 * e + i]
                        grad_w[3 * e + i] = torch.zeros(shape, dtype=dtype)
                continue
            w_gu, w_down, gu_m2F, silu_mF, h_mF, scale_m = saved[6 * chunk: 6 * chunk + 6]
            chunk += 1
            m = gu_m2F.shape[0]
            tok_n = token_of_row_P[start:start + n]
            gy_mD = _gather_padded(grad_y_TD, tok_n, m)
            if need_down:
                grad_w[3 * e + 2] = _weight_grad(gy_mD, h_mF).to(down_dtype)  # [D, F]
            if not (need_gu or need_x or need_scale):
                continue
            gh_mF = _onednn_linear(gy_mD, w_down.t())
            ggu_m2F, gs_m = scaled_swiglu_backward(gh_mF, gu_m2F, silu_mF, scale_m, need_scale)
            if need_scale:
                grad_scale_P[start:start + n] = gs_m[:n]
            if need_gu:
                grad_gu = _weight_grad(ggu_m2F, _gather_padded(x_TD, tok_n, m)).to(w_dtype)  # [2F, D]
                F_ = gate_shape[0]
                grad_w[3 * e] = grad_gu[:F_] if ctx.needs_input_grad[5 + 3 * e] else None
                grad_w[3 * e + 1] = grad_gu[F_:] if ctx.needs_input_grad[6 + 3 * e] else None
            if need_x:
                dx_mD = _onednn_linear(ggu_m2F, w_gu.t())
                grad_x_TD.index_add_(0, tok_n, dx_mD[:n].to(acc))
        return (grad_x_TD.to(x_TD.dtype) if need_x else None, grad_scale_P, None, None, None, *grad_w)


def cpu_experts(experts, x_TD, scale_P, row_map, out_dtype=None):
    """y[t] = sum over t's routed pairs of w * expert_e(x[t]) on CPU, expert by expert (see module doc).

    Args: experts: E SwiGLU FeedForward modules (weights of another dtype are cast to x's, as autocast
        would; their gradients come back in their own dtype); x_TD [T, D] CPU, fp32 (or bf16 where the
        CPU has native bf16), the compute dtype; scale_P [P] routing weight of each row of the row map (fp32);
        row_map: model.dispatch.RowMap of the routed pairs; out_dtype: None = x's dtype.
    Returns: y_TD [T, D] (accumulated in fp32). Differentiable in x, scale_P and the expert weights.
    Raises ValueError when the device or dtype do not fit.
    """
    if not cpu_experts_supported(x_TD.device, x_TD.dtype):
        raise ValueError(f"cpu_experts: needs a CPU fp32 (or native-bf16) tensor and oneDNN, got {x_TD.dtype} "
                         f"on {x_TD.device}")
    weights = [w for ex in experts for w in (ex.gate_proj.weight, ex.up_proj.weight, ex.down_proj.weight)]
    if any(w.device != x_TD.device for w in weights):
        raise ValueError(f"cpu_experts: expert weights must be on {x_TD.device} like x")
    ends = cpu_values(row_map.offsets_E)
    counts = cpu_values(row_map.tokens_per_expert_E)
    starts = [0] + ends[:-1]
    segments = [(s, n) for s, n in zip(starts, counts)]  # real rows come first in each (padded) segment
    return _CPUExperts.apply(x_TD, scale_P, row_map.token_of_row_P, segments, out_dtype or x_TD.dtype, *weights)
