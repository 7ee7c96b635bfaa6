"""The fused MoE path's experts on CPU: one GEMM per expert and projection, everything else once per layer.

    x_R = the rows gathered into per-expert segments padded to a bucket size;  gu_R = x_R[seg e] @ W_gu[e]^T
    h_R = silu(gate) * up * w (routing weight), over the whole buffer;        out_R = h_R[seg e] @ W_down[e]^T

A GEMM's oneDNN kernel is built once per shape at several times the GEMM's cost, hence the buckets (a
bounded set of shapes). Padding rows repeat a routed row with weight 0: their h and their share of every
gradient are zero (if finite), and each weight gradient is one GEMM over its segment. The SwiGLU, its
backward and the casts run once per layer over the whole buffer in the rows' dtype: per-expert and
mixed-dtype elementwise ops cost far more than their arithmetic on a CPU. torch's CPU grouped_mm is
slower than this loop; on GPUs the fused path runs grouped GEMMs (kernels/grouped_gemm.py). Segment
bounds are read from CPU memory: no device sync.
"""
import torch
from torch.autograd.function import once_differentiable

from kernels.backend import cpu_values
from kernels.cpu_linear import onednn_linear, onednn_runs
from kernels.grouped_gemm import scaled_swiglu_backward, scaled_swiglu_forward


def _bucket(n):
    """n rows padded to a multiple of 1/16 of n's power of two (<= 6.25% padding; idempotent). Exact counts,
    new every step, would keep building oneDNN kernels and grow its cache without bound."""
    if n <= 16:
        return n
    g = 1 << max(3, n.bit_length() - 5)
    return -(-n // g) * g


def _mm(a, b, out):
    """out = a @ b in place: bf16 by torch.mm (oneDNN), fp32 by oneDNN's linear (torch.mm is MKL there)."""
    if a.dtype == torch.bfloat16:
        return torch.mm(a, b, out=out)
    return out.copy_(onednn_linear(a, b.t()))


def _from_padded(t_R_, dst_N, P):
    """[P, ...]: row i = t[dst[i]] for the routed rows, zero after them (rows of no expert)."""
    out = t_R_.new_empty(P, *t_R_.shape[1:])
    out[dst_N.shape[0]:].zero_()
    torch.index_select(t_R_, 0, dst_N, out=out[:dst_N.shape[0]])
    return out


class _ExpertGEMMs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows_PD, scale_P, layout, *weights):
        # layout: (host list of (expert, padded start, padded rows) per non-idle expert, padded rows R, dst_N
        # each routed row's padded row, src_R each padded row's source row, real_R not a padding row);
        # weights: gate_0, up_0, down_0, gate_1, ... in their own dtype (fp32 master weights under autocast),
        # cast to the rows' dtype by the copy that joins them (one pass, not two)
        segs, R, dst_N, src_R, real_R = layout
        E, (P, D), dtype = len(weights) // 3, rows_PD.shape, rows_PD.dtype
        gate_up = [w for e in range(E) for w in weights[3 * e:3 * e + 2]]
        w_gu = torch.cat(gate_up, out=rows_PD.new_empty(sum(w.shape[0] for w in gate_up), D)).view(E, -1, D)
        w_down = torch.stack(weights[2::3], out=rows_PD.new_empty(E, *weights[2].shape))  # [E, D, F]
        x_RD, s_R = rows_PD.index_select(0, src_R), torch.where(real_R, scale_P.to(dtype).index_select(0, src_R), 0)
        gu_R2F = rows_PD.new_empty(R, w_gu.shape[1])
        for e, s, m in segs:
            _mm(x_RD[s:s + m], w_gu[e].t(), gu_R2F[s:s + m])
        h_RF, silu_RF = scaled_swiglu_forward(gu_R2F, s_R)
        out_RD = rows_PD.new_empty(R, D)
        for e, s, m in segs:
            _mm(h_RF[s:s + m], w_down[e].t(), out_RD[s:s + m])
        ctx.layout, ctx.scale_dtype, ctx.weight_dtype = layout, scale_P.dtype, weights[0].dtype
        ctx.save_for_backward(x_RD, s_R, gu_R2F, silu_RF, h_RF, w_gu, w_down)
        return _from_padded(out_RD, dst_N, P)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_PD):
        x_RD, s_R, gu_R2F, silu_RF, h_RF, w_gu, w_down = ctx.saved_tensors
        (segs, R, dst_N, src_R, _), (need_x, need_scale) = ctx.layout, ctx.needs_input_grad[:2]
        (E, F2, D), P = w_gu.shape, grad_PD.shape[0]
        gy_RD = grad_PD.to(x_RD.dtype).index_select(0, src_R)
        # weight gradients (zero for an idle expert) in the rows' dtype, cast to the weights' dtype at once
        gw_down, gw_gu = x_RD.new_zeros(E, D, F2 // 2), x_RD.new_zeros(E, F2, D)
        gh_RF = h_RF.new_empty(h_RF.shape)
        for e, s, m in segs:
            _mm(gy_RD[s:s + m].t(), h_RF[s:s + m], gw_down[e])
            _mm(gy_RD[s:s + m], w_down[e], gh_RF[s:s + m])
        ggu_R2F, gs_R = scaled_swiglu_backward(gh_RF, gu_R2F, silu_RF, s_R, need_scale)
        gx_RD = x_RD.new_empty(R, D) if need_x else None
        for e, s, m in segs:
            _mm(ggu_R2F[s:s + m].t(), x_RD[s:s + m], gw_gu[e])
            if need_x:
                _mm(ggu_R2F[s:s + m], w_gu[e], gx_RD[s:s + m])
        F_, gw_gu, gw_down = F2 // 2, gw_gu.to(ctx.weight_dtype), gw_down.to(ctx.weight_dtype)
        grad_w = [g for e in range(E) for g in (gw_gu[e, :F_], gw_gu[e, F_:], gw_down[e])]
        grad_w = [g if need else None for g, need in zip(grad_w, ctx.needs_input_grad[3:])]
        grad_x = _from_padded(gx_RD, dst_N, P) if need_x else None
        grad_scale = _from_padded(gs_R, dst_N, P).to(ctx.scale_dtype) if need_scale else None
        return (grad_x, grad_scale, None, *grad_w)


def cpu_experts_run(device, dtype) -> bool:
    """Whether these experts run for rows of this device and compute dtype (CPU, oneDNN, fp32 / native
    bf16; not while torch.compile traces: inductor plans its own GEMMs)."""
    return onednn_runs(device, dtype) and not torch.compiler.is_compiling()


def expert_gemms(experts, rows_PD, tokens_per_expert_E, row_weight_P):
    """Each expert's SwiGLU on its rows of the expert-sorted buffer, the routing weight applied before the
    down projection (see module doc). experts: E SwiGLU FeedForward modules; rows_PD [P, D] CPU in the
    compute dtype; tokens_per_expert_E int64 [E] CPU rows per expert (padding included; real rows first);
    row_weight_P [P]. Returns [P, D] in rows' dtype, zero rows outside the segments. Differentiable in
    rows, row weights and the expert weights. Raises ValueError when the device or dtype do not fit."""
    if not cpu_experts_run(rows_PD.device, rows_PD.dtype):
        raise ValueError(f"expert_gemms: needs CPU fp32 (or native-bf16) rows and oneDNN, got {rows_PD.dtype} "
                         f"on {rows_PD.device}")
    counts = cpu_values(tokens_per_expert_E)
    padded = [_bucket(n) for n in counts]
    segs, start = [], 0
    for e, m in enumerate(padded):
        if m:
            segs.append((e, start, m))
        start += m
    n_E, m_E, end = torch.tensor(counts), torch.tensor(padded), sum(counts)  # dst_N: each routed row's padded row
    dst_N = torch.arange(end) + torch.repeat_interleave(m_E.cumsum(0) - m_E - n_E.cumsum(0) + n_E, n_E, output_size=end)
    weights = [w for ex in experts for w in (ex.gate_proj.weight, ex.up_proj.weight, ex.down_proj.weight)]
    src_R = torch.zeros(start, dtype=torch.int64).index_copy_(0, dst_N, torch.arange(end))
    real_R = torch.zeros(start, dtype=torch.bool).index_fill_(0, dst_N, True)
    return _ExpertGEMMs.apply(rows_PD, row_weight_P, (segs, start, dst_N, src_R, real_R), *weights)
