"""GroupedExperts: the routed experts of the fused MoE path, one engine for every device.

`GroupedExperts` is model/moe.py's ExpertLoop (the same FeedForward modules, parameters and state_dict
keys) whose forward runs all experts at once: on CPU (oneDNN, fp32 or native bf16) the batched expert
GEMMs below, elsewhere (CUDA, or CPU without oneDNN) the grouped GEMMs of kernels/grouped_gemm.py
(torch's grouped_mm or our Triton kernels). No host read of the counts on either path.

The CPU engine: a few batched GEMMs per projection, everything else once per layer.

    x_R = the rows gathered into per-expert segments, experts sorted by count and batched in groups, each
    expert of a group padded to its largest's bucket size;  gu_R = x_R[seg e] @ W_gu[e]^T (one bmm a group)
    h_R = silu(gate) * up * w (routing weight), over the whole buffer;  out_R = h_R[seg e] @ W_down[e]^T

A GEMM's oneDNN kernel is built once per shape at several times the GEMM's cost, hence the buckets (a
bounded set of shapes). Padding rows repeat a routed row with weight 0: their h and their share of every
gradient are zero (if finite), and each weight gradient is one GEMM over its segment. The SwiGLU, its
backward and the casts run once per layer over the whole buffer in the rows' dtype: per-expert and
mixed-dtype elementwise ops cost far more than their arithmetic on a CPU. torch's CPU grouped_mm is
slower than this; on GPUs the fused path runs grouped GEMMs (kernels/grouped_gemm.py). Segment
bounds are read from CPU memory: no device sync.
"""
import torch
from torch.autograd.function import once_differentiable

from kernels.backend import cpu_values
from kernels.cpu_linear import onednn_runs
from kernels.grouped_gemm import grouped_swiglu, scaled_swiglu_backward, scaled_swiglu_forward
from model.moe import ExpertLoop


def _bucket(n):
    """n rows padded to a multiple of 1/16 of n's power of two and of 8 (<= 6.25% from 128 rows; idempotent):
    exact counts, new every step, would keep building oneDNN kernels and grow its cache without bound."""
    if n <= 16:
        return n
    g = 1 << max(3, n.bit_length() - 5)
    return -(-n // g) * g


def _bmm(a, b, out):
    """out[i] = a[i] @ b[i] in place: bf16 by one torch.bmm (oneDNN), fp32 by oneDNN's linear per matrix
    (kernels/cpu_linear.py's op; torch's fp32 matmuls are MKL)."""
    if a.dtype == torch.bfloat16:
        return torch.bmm(a, b, out=out)
    for i in range(a.shape[0]):
        out[i].copy_(torch.ops.mkldnn._linear_pointwise(a[i], b[i].t(), None, "none", [], ""))


def _seg(t_R_, a, b, s, m):
    """The rows of a group of b - a experts padded to m rows each, from padded row s: a [b - a, m, ...] view."""
    return t_R_[s:s + (b - a) * m].view(b - a, m, *t_R_.shape[1:])


def _from_padded(t_R_, dst_N, P):
    """[P, ...]: row i = t[dst[i]] for the routed rows, zero after them (rows of no expert)."""
    out = t_R_.new_empty(P, *t_R_.shape[1:])
    out[dst_N.shape[0]:].zero_()
    torch.index_select(t_R_, 0, dst_N, out=out[:dst_N.shape[0]])
    return out


class _ExpertGEMMs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows_PD, scale_P, layout, *weights):
        # layout: (host list of (first, end, padded start, M) per group of the experts in `order`, each of its
        # end - first experts padded to M rows; padded rows R; dst_N each routed row's padded row; src_R each
        # padded row's source row; real_R not a padding row; order the experts by count, descending);
        # weights: gate_0, up_0, down_0, gate_1, ... in their own dtype (fp32 master weights under autocast),
        # cast to the rows' dtype by the copy that joins them in `order` (one pass, not two)
        groups, R, dst_N, src_R, real_R, order = layout
        (P, D), dtype = rows_PD.shape, rows_PD.dtype
        gate_up = [w for e in order for w in weights[3 * e:3 * e + 2]]
        w_gu = torch.cat(gate_up, out=rows_PD.new_empty(sum(w.shape[0] for w in gate_up), D)).view(len(order), -1, D)
        w_down = torch.stack([weights[3 * e + 2] for e in order], out=rows_PD.new_empty(len(order), *weights[2].shape))
        x_RD, s_R = rows_PD.index_select(0, src_R), torch.where(real_R, scale_P.to(dtype).index_select(0, src_R), 0)
        gu_R2F, out_RD = rows_PD.new_empty(R, w_gu.shape[1]), rows_PD.new_empty(R, D)
        for a, b, s, m in groups:
            _bmm(_seg(x_RD, a, b, s, m), w_gu[a:b].transpose(1, 2), _seg(gu_R2F, a, b, s, m))
        h_RF, silu_RF = scaled_swiglu_forward(gu_R2F, s_R)
        for a, b, s, m in groups:
            _bmm(_seg(h_RF, a, b, s, m), w_down[a:b].transpose(1, 2), _seg(out_RD, a, b, s, m))
        ctx.layout, ctx.scale_dtype, ctx.weight_dtype = layout, scale_P.dtype, weights[0].dtype
        ctx.save_for_backward(x_RD, s_R, gu_R2F, silu_RF, h_RF, w_gu, w_down)
        return _from_padded(out_RD, dst_N, P)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_PD):
        x_RD, s_R, gu_R2F, silu_RF, h_RF, w_gu, w_down = ctx.saved_tensors
        (groups, R, dst_N, src_R, _, order), (need_x, need_scale) = ctx.layout, ctx.needs_input_grad[:2]
        (E, F2, D), P = w_gu.shape, grad_PD.shape[0]
        gy_RD = grad_PD.to(x_RD.dtype).index_select(0, src_R)
        # weight gradients (zero for an idle expert) in the rows' dtype, cast to the weights' dtype at once
        gw_down, gw_gu = x_RD.new_zeros(E, D, F2 // 2), x_RD.new_zeros(E, F2, D)
        gh_RF = h_RF.new_empty(h_RF.shape)
        for a, b, s, m in groups:
            gy = _seg(gy_RD, a, b, s, m)
            _bmm(gy.transpose(1, 2), _seg(h_RF, a, b, s, m), gw_down[a:b])
            _bmm(gy, w_down[a:b], _seg(gh_RF, a, b, s, m))
        ggu_R2F, gs_R = scaled_swiglu_backward(gh_RF, gu_R2F, silu_RF, s_R, need_scale)
        gx_RD = x_RD.new_empty(R, D) if need_x else None
        for a, b, s, m in groups:
            ggu = _seg(ggu_R2F, a, b, s, m)
            _bmm(ggu.transpose(1, 2), _seg(x_RD, a, b, s, m), gw_gu[a:b])
            if need_x:
                _bmm(ggu, w_gu[a:b], _seg(gx_RD, a, b, s, m))
        F_, gw_gu, gw_down = F2 // 2, gw_gu.to(ctx.weight_dtype), gw_down.to(ctx.weight_dtype)
        grad_w = [g for i in sorted(range(E), key=order.__getitem__) for g in (gw_gu[i, :F_], gw_gu[i, F_:], gw_down[i])]
        grad_w = [g if need else None for g, need in zip(grad_w, ctx.needs_input_grad[3:])]
        grad_x = _from_padded(gx_RD, dst_N, P) if need_x else None
        grad_scale = _from_padded(gs_R, dst_N, P).to(ctx.scale_dtype) if need_scale else None
        return (grad_x, grad_scale, None, *grad_w)


def cpu_experts_run(device, dtype) -> bool:
    """Whether these experts run for rows of this device and compute dtype (CPU, oneDNN, fp32 / native
    bf16; not while torch.compile traces: inductor plans its own GEMMs)."""
    return onednn_runs(device, dtype) and not torch.compiler.is_compiling()


def _cpu_layout(counts, dtype):
    """The CPU engine's row layout for host row counts per expert: (groups [(first, end, padded start, M)]
    over the experts in `order`, each of its end - first experts padded to M rows; padded rows R; dst_N each
    routed row's padded row; src_R each padded row's source row; real_R not a padding row; order: the
    experts by count, descending)."""
    # ~8 batched GEMMs per projection beat one small GEMM per expert despite the padding (bf16); a group takes
    # only experts of >= 2/3 its largest count, so a skewed routing cannot multiply the padded rows
    group = max(1, len(counts) // 8) if dtype == torch.bfloat16 else 1
    order = sorted(range(len(counts)), key=lambda e: -counts[e])
    groups, first_row, start, a = [], [0] * len(counts), 0, 0  # first_row: each expert's first padded row
    while a < len(order):
        m, b = _bucket(counts[order[a]]), a + 1
        while b < min(a + group, len(order)) and 3 * counts[order[b]] >= 2 * m:
            b += 1
        groups += [(a, b, start, m)] if m else []
        for e in order[a:b]:
            first_row[e], start = start, start + m
        a = b
    n_E, end = torch.tensor(counts), sum(counts)
    shift_E = torch.tensor(first_row) - n_E.cumsum(0) + n_E
    dst_N = torch.arange(end) + torch.repeat_interleave(shift_E, n_E, output_size=end)
    src_R = torch.zeros(start, dtype=torch.int64).index_copy_(0, dst_N, torch.arange(end))
    real_R = torch.zeros(start, dtype=torch.bool).index_fill_(0, dst_N, True)
    return groups, start, dst_N, src_R, real_R, order


class GroupedExperts(ExpertLoop):
    """ExpertLoop's experts and interface, all experts at once: forward(rows_PD [P, D], tokens_per_expert
    int64 [E'] (on rows' device; padding included, real rows first), row_weight_P [P] or None (= 1),
    first_expert=0) -> [P, D] in the rows' dtype, zero rows outside the segments; the routing weight is
    applied before the down projection (see the module doc). Differentiable in rows, row weights and the
    expert weights; autocast is left: the engines cast the fp32 master weights to the rows' dtype."""

    def forward(self, rows_PD, tokens_per_expert, row_weight_P=None, first_expert=0):
        experts = list(self)[first_expert:first_expert + tokens_per_expert.shape[0]]
        if row_weight_P is None:
            row_weight_P = rows_PD.new_ones(rows_PD.shape[0])
        with torch.autocast(rows_PD.device.type, enabled=False):
            if cpu_experts_run(rows_PD.device, rows_PD.dtype):
                weights = [w for ex in experts for w in (ex.gate_proj.weight, ex.up_proj.weight, ex.down_proj.weight)]
                layout = _cpu_layout(cpu_values(tokens_per_expert), rows_PD.dtype)
                return _ExpertGEMMs.apply(rows_PD, row_weight_P, layout, *weights)
            w_gate_up_E2FD = torch.stack([torch.cat([ex.gate_proj.weight, ex.up_proj.weight]) for ex in experts])
            w_down_EDF = torch.stack([ex.down_proj.weight for ex in experts])
            offsets_E = torch.cumsum(tokens_per_expert, 0).to(torch.int32)
            return grouped_swiglu(rows_PD, w_gate_up_E2FD.to(rows_PD.dtype), w_down_EDF.to(rows_PD.dtype), offsets_E,
                                  row_weight_P)
