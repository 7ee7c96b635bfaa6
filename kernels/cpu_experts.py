"""The fused MoE path's experts on CPU: one chain per expert, on the expert-sorted rows of the dispatch.

    for each expert e (ascending):   x_e = rows[segment of e]                    (a view, see _bucket)
                                     gu_e = x_e @ W_gate_up[e]^T                 (oneDNN)
                                     h_e = silu(gate) * up * w_e                 (SwiGLU, routing weight)
                                     out[segment of e] = h_e @ W_down[e]^T       (oneDNN)

On GPUs the fused path runs two grouped GEMMs over the whole buffer (kernels/grouped_gemm.py). On a CPU
kernel launches cost nothing and memory traffic is what hurts: each expert's rows go through the whole
chain while they sit in cache, and each expert's weight gradients are the GEMMs' own outputs, handed to
autograd as they are (no stacked buffers). Each chain runs on its rows rounded up to a bucket (`_bucket`),
so oneDNN sees a bounded set of shapes. The segment bounds are read from CPU memory (no device, nothing to
wait for): the layer stays free of device syncs.
"""
import torch
from torch.autograd.function import once_differentiable

from kernels.backend import cpu_values
from kernels.cpu_linear import onednn_linear, onednn_runs
from kernels.grouped_gemm import scaled_swiglu_backward, scaled_swiglu_forward


def _bucket(n):
    """Rows to run an n-row chain with: n rounded up to 1/16 of its power of two (at most 6.25% zero
    padding). oneDNN builds and caches one kernel per GEMM shape; exact row counts, new every step, would
    keep building kernels and grow its cache without bound."""
    if n <= 16:
        return n
    g = 1 << max(3, n.bit_length() - 5)
    return -(-n // g) * g


def _bucket_rows(t_P_, start, n, m):
    """Rows start..start+m of t: a view where t has them (rows past n are the next experts', masked out by
    the caller), else the n rows and zeros in a fresh buffer (the last experts)."""
    return t_P_[start:start + m] if start + m <= t_P_.shape[0] else \
        torch.cat([t_P_[start:start + n], t_P_.new_zeros(m - n, *t_P_.shape[1:])])


def _zero_past(t, end):
    """A fresh tensor like t, uninitialised up to row end, zero after it (rows of no expert: pairs past capacity)."""
    out = t.new_empty(t.shape)
    out[end:].zero_()
    return out


def _weight_grad(g_mN, x_mK):
    """[N, K] = g^T x. bf16 through torch.mm (oneDNN's matmul reads the transposed operand in place); fp32
    through oneDNN's linear (torch.mm is MKL there, slower on some CPUs)."""
    if g_mN.dtype == torch.bfloat16:
        return torch.mm(g_mN.t(), x_mK)
    return onednn_linear(g_mN.t(), x_mK.t())


class _ExpertChains(torch.autograd.Function):
    """Each chain runs on m = _bucket(n) rows, a view where the buffer has them: rows past n are the next
    expert's, cut off, and zeroed in h and grad_gate_up, so they add nothing to the weight gradients."""

    @staticmethod
    def forward(ctx, rows_PD, scale_P, segments, *weights):
        # segments: host list of (first row, rows) per expert; weights: gate_0, up_0, down_0, gate_1, ... in
        # their own dtype (fp32 master weights under autocast), cast here to the rows' dtype, all at once
        E, dtype = len(segments), rows_PD.dtype
        w_gu = torch.cat([w for e in range(E) for w in weights[3 * e:3 * e + 2]]).to(dtype).view(E, -1, rows_PD.shape[1])
        w_down = torch.stack(weights[2::3]).to(dtype)  # [E, D, F]
        ctx.end = sum(n for _, n in segments)  # rows past it belong to no expert
        out_PD = _zero_past(rows_PD, ctx.end)
        keep = any(ctx.needs_input_grad)  # under no_grad / inference nothing is kept past its chain
        saved = []
        for e, (start, n) in enumerate(segments):
            if n == 0:
                continue
            x_mD, scale_m = (_bucket_rows(t, start, n, _bucket(n)) for t in (rows_PD, scale_P))
            gu_m2F = onednn_linear(x_mD, w_gu[e])
            h_mF, silu_mF = scaled_swiglu_forward(gu_m2F, scale_m)
            h_mF[n:].zero_()
            out_PD[start:start + n] = onednn_linear(h_mF, w_down[e])[:n]
            if keep:
                saved += [x_mD, gu_m2F, silu_mF, h_mF, scale_m]
        ctx.segments, ctx.weight_meta = segments, [(w.shape, w.dtype) for w in weights]
        ctx.save_for_backward(scale_P, w_gu, w_down, *saved)
        return out_PD

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_PD):
        scale_P, w_gu, w_down, *saved = ctx.saved_tensors
        (need_x, need_scale), F_ = ctx.needs_input_grad[:2], ctx.weight_meta[0][0][0]
        grad_PD = grad_PD.to(w_gu.dtype).contiguous()
        grad_x_PD = _zero_past(grad_PD, ctx.end) if need_x else None
        grad_scale_P = _zero_past(scale_P, ctx.end) if need_scale else None
        grad_w = [None] * len(ctx.weight_meta)
        chunks = iter(saved)
        for e, (start, n) in enumerate(ctx.segments):
            need = ctx.needs_input_grad[3 + 3 * e: 6 + 3 * e]
            if n == 0:  # an idle expert still gets a (zero) gradient: DDP expects every parameter's
                grad_w[3 * e:3 * e + 3] = [torch.zeros(shape, dtype=dtype) if need[i] else None
                                           for i, (shape, dtype) in enumerate(ctx.weight_meta[3 * e:3 * e + 3])]
                continue
            x_mD, gu_m2F, silu_mF, h_mF, scale_m = (next(chunks) for _ in range(5))
            gy_mD = _bucket_rows(grad_PD, start, n, x_mD.shape[0])
            if need[2]:
                grad_w[3 * e + 2] = _weight_grad(gy_mD, h_mF).to(ctx.weight_meta[3 * e + 2][1])  # [D, F]
            if not (need[0] or need[1] or need_x or need_scale):
                continue
            gh_mF = onednn_linear(gy_mD, w_down[e].t())
            ggu_m2F, gs_m = scaled_swiglu_backward(gh_mF, gu_m2F, silu_mF, scale_m, need_scale)
            ggu_m2F[n:].zero_()
            if need_scale:
                grad_scale_P[start:start + n] = gs_m[:n]
            if need[0] or need[1]:
                grad_gu = _weight_grad(ggu_m2F, x_mD).to(ctx.weight_meta[3 * e][1])  # [2F, D]
                grad_w[3 * e], grad_w[3 * e + 1] = (grad_gu[:F_] if need[0] else None), (grad_gu[F_:] if need[1] else None)
            if need_x:
                grad_x_PD[start:start + n] = onednn_linear(ggu_m2F, w_gu[e].t())[:n]
        return (grad_x_PD, grad_scale_P, None, *grad_w)


def cpu_experts_run(device, dtype) -> bool:
    """Whether the chains run for rows of this device and compute dtype (CPU, oneDNN, fp32 / native bf16;
    not while torch.compile traces: inductor plans its own GEMMs)."""
    return onednn_runs(device, dtype) and not torch.compiler.is_compiling()


def expert_chains(experts, rows_PD, tokens_per_expert_E, row_weight_P):
    """Each expert's SwiGLU on its rows of the expert-sorted buffer, the routing weight applied before the
    down projection (see module doc). experts: E SwiGLU FeedForward modules; rows_PD [P, D] CPU in the
    compute dtype; tokens_per_expert_E int64 [E] CPU rows per expert (padding included; real rows first);
    row_weight_P [P]. Returns [P, D] in rows' dtype, zero rows outside the segments. Differentiable in
    rows, row weights and the expert weights. Raises ValueError when the device or dtype do not fit."""
    if not cpu_experts_run(rows_PD.device, rows_PD.dtype):
        raise ValueError(f"expert_chains: needs CPU fp32 (or native-bf16) rows and oneDNN, got {rows_PD.dtype} "
                         f"on {rows_PD.device}")
    counts = cpu_values(tokens_per_expert_E)
    starts = [0]
    for n in counts[:-1]:
        starts.append(starts[-1] + n)
    weights = [w for ex in experts for w in (ex.gate_proj.weight, ex.up_proj.weight, ex.down_proj.weight)]
    return _ExpertChains.apply(rows_PD, row_weight_P, list(zip(starts, counts)), *weights)
