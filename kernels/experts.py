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
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

from kernels.backend import cast, cpu_values
from kernels.cpu_linear import onednn_runs
from kernels.grouped_gemm import grouped_swiglu, scaled_swiglu_backward, scaled_swiglu_forward
from model.moe import ExpertLoop


def _bucket(rows):
    """`rows` padded to a multiple of 1/16 of its power of two and of 8 (<= 6.25% from 128 rows; idempotent):
    exact counts, new every step, would keep building oneDNN kernels and grow its cache without bound."""
    if rows <= 16:
        return rows
    step = 1 << max(3, rows.bit_length() - 5)
    return -(-rows // step) * step


def _bmm(lhs, rhs, out):
    """out[i] = lhs[i] @ rhs[i] in place: bf16 by one torch.bmm (oneDNN), fp32 by oneDNN's linear per matrix
    (kernels/cpu_linear.py's op; torch's fp32 matmuls are MKL)."""
    if lhs.dtype == torch.bfloat16:
        return torch.bmm(lhs, rhs, out=out)
    for i in range(lhs.shape[0]):
        out[i].copy_(torch.ops.mkldnn._linear_pointwise(lhs[i], rhs[i].t(), None, "none", [], ""))


class ExpertGroup(NamedTuple):
    """Experts first..end-1 (positions in CPULayout.order) batched in one GEMM, each padded to `rows_each`
    rows, from padded row `row_start` on."""
    first: int
    end: int
    row_start: int
    rows_each: int

    @property
    def experts(self):
        return slice(self.first, self.end)

    def rows(self, padded_R):
        """The group's rows of a [R, ...] tensor as a [end - first, rows_each, ...] view."""
        count = self.end - self.first
        return padded_R[self.row_start:self.row_start + count * self.rows_each].view(count, self.rows_each,
                                                                                  *padded_R.shape[1:])


@dataclass
class CPULayout:
    """Where the CPU engine puts each routed row: the experts sorted by count (`order`, descending) and
    batched in `groups`; padded_rows R in all; dst_N int64 [N] each routed row's padded row; src_R int64 [R]
    each padded row's source row (a padding row repeats a routed row); real_R bool [R] not a padding row."""
    groups: list
    padded_rows: int
    dst_N: torch.Tensor
    src_R: torch.Tensor
    real_R: torch.Tensor
    order: list


def _from_padded(padded_R, dst_N, P):
    """[P, ...]: row i = padded_R[dst_N[i]] for the N routed rows, zero after them (rows of no expert)."""
    out = padded_R.new_empty(P, *padded_R.shape[1:])
    out[dst_N.shape[0]:].zero_()
    torch.index_select(padded_R, 0, dst_N, out=out[:dst_N.shape[0]])
    return out


class _ExpertGEMMs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows_PD, scale_P, layout, *weights):
        # layout: a CPULayout; weights: gate_0, up_0, down_0, gate_1, ... in their own dtype (fp32 master
        # weights under autocast), cast to the rows' dtype by the copy that joins them in `order` (one pass)
        (P, D), dtype, order, R = rows_PD.shape, rows_PD.dtype, layout.order, layout.padded_rows
        gate_up = [w for e in order for w in weights[3 * e:3 * e + 2]]
        w_gu = torch.cat(gate_up, out=rows_PD.new_empty(sum(w.shape[0] for w in gate_up), D)).view(len(order), -1, D)
        w_down = torch.stack([weights[3 * e + 2] for e in order], out=rows_PD.new_empty(len(order), *weights[2].shape))
        x_RD = rows_PD.index_select(0, layout.src_R)
        scale_R = torch.where(layout.real_R, scale_P.to(dtype).index_select(0, layout.src_R), 0)
        gu_R2F, out_RD = rows_PD.new_empty(R, w_gu.shape[1]), rows_PD.new_empty(R, D)
        for group in layout.groups:
            _bmm(group.rows(x_RD), w_gu[group.experts].transpose(1, 2), group.rows(gu_R2F))
        h_RF, silu_RF = scaled_swiglu_forward(gu_R2F, scale_R)
        for group in layout.groups:
            _bmm(group.rows(h_RF), w_down[group.experts].transpose(1, 2), group.rows(out_RD))
        ctx.layout, ctx.scale_dtype, ctx.weight_dtype = layout, scale_P.dtype, weights[0].dtype
        ctx.save_for_backward(x_RD, scale_R, gu_R2F, silu_RF, h_RF, w_gu, w_down)
        return _from_padded(out_RD, layout.dst_N, P)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_PD):
        x_RD, scale_R, gu_R2F, silu_RF, h_RF, w_gu, w_down = ctx.saved_tensors
        layout, (need_x, need_scale) = ctx.layout, ctx.needs_input_grad[:2]
        (E, F2, D), P = w_gu.shape, grad_PD.shape[0]
        gy_RD = grad_PD.to(x_RD.dtype).index_select(0, layout.src_R)
        # weight gradients (zero for an idle expert) in the rows' dtype, cast to the weights' dtype at once
        gw_down, gw_gu = x_RD.new_zeros(E, D, F2 // 2), x_RD.new_zeros(E, F2, D)
        gh_RF = h_RF.new_empty(h_RF.shape)
        for group in layout.groups:
            gy = group.rows(gy_RD)
            _bmm(gy.transpose(1, 2), group.rows(h_RF), gw_down[group.experts])
            _bmm(gy, w_down[group.experts], group.rows(gh_RF))
        ggu_R2F, gscale_R = scaled_swiglu_backward(gh_RF, gu_R2F, silu_RF, scale_R, need_scale)
        gx_RD = x_RD.new_empty(layout.padded_rows, D) if need_x else None
        for group in layout.groups:
            ggu = group.rows(ggu_R2F)
            _bmm(ggu.transpose(1, 2), group.rows(x_RD), gw_gu[group.experts])
            if need_x:
                _bmm(ggu, w_gu[group.experts], group.rows(gx_RD))
        F, gw_gu, gw_down = F2 // 2, gw_gu.to(ctx.weight_dtype), gw_down.to(ctx.weight_dtype)
        by_expert = sorted(range(E), key=layout.order.__getitem__)  # position in `order` of expert 0, 1, ...
        grad_w = [g for i in by_expert for g in (gw_gu[i, :F], gw_gu[i, F:], gw_down[i])]
        grad_w = [g if need else None for g, need in zip(grad_w, ctx.needs_input_grad[3:])]
        grad_x = _from_padded(gx_RD, layout.dst_N, P) if need_x else None
        grad_scale = _from_padded(gscale_R, layout.dst_N, P).to(ctx.scale_dtype) if need_scale else None
        return (grad_x, grad_scale, None, *grad_w)


class _GroupedLayout(torch.autograd.Function):
    """The experts' weights in the grouped GEMMs' layout and dtype, made by one copy: forward(dtype, gate_0, up_0,
    down_0, gate_1, ...) -> (w_gate_up_E2FD [E, 2F, D]: each expert's gate_proj then up_proj weight, w_down_EDF
    [E, D, F]), both views of one buffer in `dtype`; one concatenation and at most one cast, whatever E (stacking
    expert by expert costs a copy per expert). Backward: each stacked gradient cast once to the weights' dtype;
    every parameter's gradient is a view of it."""

    @staticmethod
    def forward(ctx, dtype, *weights):
        E, (F, D) = len(weights) // 3, weights[0].shape
        # expert by expert: gate, up, down
        per_expert_E3FD = cast(torch.cat([w.reshape(-1) for w in weights]), dtype).view(E, 3 * F * D)
        ctx.weight_dtype = weights[0].dtype
        return per_expert_E3FD[:, :2 * F * D].view(E, 2 * F, D), per_expert_E3FD[:, 2 * F * D:].view(E, D, F)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_gate_up_E2FD, grad_down_EDF):
        (E, D, F), dtype = grad_down_EDF.shape, ctx.weight_dtype
        grad_gate_up, grad_down = cast(grad_gate_up_E2FD, dtype), cast(grad_down_EDF, dtype)
        return None, *(g for e in range(E) for g in (grad_gate_up[e, :F], grad_gate_up[e, F:], grad_down[e]))


def cpu_experts_run(device, dtype) -> bool:
    """Whether these experts run for rows of this device and compute dtype (CPU, oneDNN, fp32 / native
    bf16; not while torch.compile traces: inductor plans its own GEMMs)."""
    return onednn_runs(device, dtype) and not torch.compiler.is_compiling()


def _cpu_layout(counts, dtype):
    """The CPULayout of host row counts per expert (a list of ints)."""
    # ~8 batched GEMMs per projection beat one small GEMM per expert despite the padding (bf16); a group takes
    # only experts of >= 2/3 its largest count, so a skewed routing cannot multiply the padded rows
    max_group = max(1, len(counts) // 8) if dtype == torch.bfloat16 else 1
    order = sorted(range(len(counts)), key=lambda e: -counts[e])
    groups, first_row, padded_rows, first = [], [0] * len(counts), 0, 0  # first_row: each expert's first padded row
    while first < len(order):
        rows_each, end = _bucket(counts[order[first]]), first + 1
        while end < min(first + max_group, len(order)) and 3 * counts[order[end]] >= 2 * rows_each:
            end += 1
        if rows_each:
            groups.append(ExpertGroup(first, end, padded_rows, rows_each))
        for e in order[first:end]:
            first_row[e], padded_rows = padded_rows, padded_rows + rows_each
        first = end
    count_E, routed = torch.tensor(counts), sum(counts)
    shift_E = torch.tensor(first_row) - count_E.cumsum(0) + count_E
    dst_N = torch.arange(routed) + torch.repeat_interleave(shift_E, count_E, output_size=routed)
    src_R = torch.zeros(padded_rows, dtype=torch.int64).index_copy_(0, dst_N, torch.arange(routed))
    real_R = torch.zeros(padded_rows, dtype=torch.bool).index_fill_(0, dst_N, True)
    return CPULayout(groups, padded_rows, dst_N, src_R, real_R, order)


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
        weights = [w for ex in experts for w in (ex.gate_proj.weight, ex.up_proj.weight, ex.down_proj.weight)]
        with torch.autocast(rows_PD.device.type, enabled=False):
            if cpu_experts_run(rows_PD.device, rows_PD.dtype):
                layout = _cpu_layout(cpu_values(tokens_per_expert), rows_PD.dtype)
                return _ExpertGEMMs.apply(rows_PD, row_weight_P, layout, *weights)
            w_gate_up_E2FD, w_down_EDF = _GroupedLayout.apply(rows_PD.dtype, *weights)
            offsets_E = torch.cumsum(tokens_per_expert, 0).to(torch.int32)
            # the routing weight in the rows' dtype, as the CPU engine applies it: the SwiGLU then makes no fp32 [P, F]
            return grouped_swiglu(rows_PD, w_gate_up_E2FD, w_down_EDF, offsets_E, row_weight_P.to(rows_PD.dtype))
