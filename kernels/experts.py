"""The experts engines of the fused MoE path: functions with model/moe.py: expert_loop's interface
that run all experts at once on their stacked weights (model/moe.py: Experts), read as they are.

    cpu_experts_for(dtype)   CPU where oneDNN runs, eager: the batched expert GEMMs below (CPUExperts),
                             the rows in place (fp32, MKL) or bucketed (bf16, oneDNN)
    GROUPED_EXPERTS[backend] elsewhere (CUDA; CPU under torch.compile): kernels/grouped_gemm.py's
                             GroupedSwiGLU on torch's grouped_mm or our Triton kernels

No host read of the counts on either; the only pass over the weights is the cast to the rows' dtype
under autocast (none in fp32).

The CPU engine: a few batched GEMMs (torch.bmm) per projection, everything else once per layer.

    x_R = the rows in per-expert segments;
    gu_R = x_R[seg e] @ W_gu[e]^T
    h_R = silu(gate) * up * w (routing weight), over the whole buffer;
    out_R = h_R[seg e] @ W_down[e]^T

fp32 (MKL, which builds no kernel per GEMM shape): the segments are the dispatched rows in place,
one GEMM per expert, no copy in or out. bf16 (oneDNN, which builds a kernel per GEMM shape at
several times the GEMM's cost): the rows are gathered into segments padded to a bounded set of
bucket sizes, neighbouring experts of similar counts batched in groups, each expert of a group
padded to its largest's bucket. Padding rows repeat a routed row with weight 0: their h and their
share of every gradient are zero (if finite), and each weight gradient is one GEMM over its
segment. The SwiGLU, its backward and the casts run once per layer over the whole buffer in the
rows' dtype: per-expert and mixed-dtype elementwise ops cost far more than their arithmetic on a
CPU. torch's CPU grouped_mm is slower than this; on GPUs the fused path runs grouped GEMMs
(kernels/grouped_gemm.py).
Segment bounds are read from CPU memory: no device sync.
"""
import itertools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kernels.backend import cpu_values, first_order_only
from kernels.grouped_gemm import (GROUPED_OPS, GroupedSwiGLU, scaled_swiglu_backward,
                                  scaled_swiglu_forward)


def _bucket(rows):
    """`rows` padded to a multiple of 1/16 of its power of two and of 8 (<= 6.25% from 128 rows;
    idempotent): exact counts, new every step, would keep building oneDNN kernels and grow its cache
    without bound."""
    if rows <= 16:
        return rows
    step = 1 << max(3, rows.bit_length() - 5)
    return -(-rows // step) * step


class ExpertGroup(NamedTuple):
    """Experts first..end-1 batched in one GEMM, each padded to `rows_each` rows, from padded row
    `row_start` on."""
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
        return (padded_R[self.row_start:self.row_start + count * self.rows_each]
                .view(count, self.rows_each, *padded_R.shape[1:]))


@dataclass
class CPULayout:
    """Where the CPU engine puts each routed row: `groups` of neighbouring experts; rows R of the
    buffer, the first `covered` in the groups' segments (the rest, rows of no expert, zero); idle:
    the experts of no group (no rows). Padded (bf16): dst_N int64 [N] each routed row's padded row,
    src_R int64 [R] each padded row's source row (a padding row repeats a routed row), real_R bool
    [R] not a padding row. In place (fp32): the three None, R = P, each expert's rows where the
    dispatcher put them."""
    groups: list
    rows: int
    covered: int
    dst_N: torch.Tensor | None
    src_R: torch.Tensor | None
    real_R: torch.Tensor | None
    idle: list

    def to_buffer(self, t_P):
        """[P, ...] -> [R, ...]: the dispatched rows where the GEMMs read them (contiguous)."""
        return t_P.contiguous() if self.src_R is None else t_P.index_select(0, self.src_R)

    def row_weights(self, weight_P):
        """[P] -> [R]: each buffer row's routing weight, 0 on padding rows."""
        weight_R = self.to_buffer(weight_P)
        return weight_R if self.real_R is None else torch.where(self.real_R, weight_R, 0)

    def from_buffer(self, t_R, P):
        """[R, ...] -> [P, ...]: the rows back where the dispatcher put them, zero after the N
        routed ones (rows of no expert)."""
        if self.dst_N is None:
            return t_R
        N = self.dst_N.shape[0]
        out = t_R.new_empty(P, *t_R.shape[1:])
        out[N:].zero_()
        torch.index_select(t_R, 0, self.dst_N, out=out[:N])
        return out

    def empty(self, like, cols):
        """A [R, cols] buffer of like's dtype for GEMM outputs, zero outside the segments."""
        out = like.new_empty(self.rows, cols)
        out[self.covered:].zero_()
        return out


class CPUExperts(torch.autograd.Function):
    """The CPU engine (module doc), run as `cpu_experts_for(dtype)`: model/moe.py: expert_loop's
    interface plus the layout: rows_PD [P, D] (expert-sorted; padding included, real rows first),
    tokens_per_expert int64 [E'] on the CPU, row_weight_P [P] or None (= 1), the stacked weights,
    layout_of(counts, P) -> CPULayout (rows_in_place, rows_bucketed) -> [P, D] in the rows' dtype,
    zero rows outside the segments. The routing weight is applied before the down projection.
    Differentiable in rows, row weights and weights; runs outside autocast, in the rows' dtype (the
    weights cast to it once)."""

    @staticmethod
    def forward(ctx, rows_PD, tokens_per_expert, row_weight_P, w_gate_up_E2FD, w_down_EDF,
                layout_of):
        (P, D), dtype = rows_PD.shape, rows_PD.dtype
        layout = layout_of(cpu_values(tokens_per_expert), P)
        scale_P = row_weight_P if row_weight_P is not None else rows_PD.new_ones(P)
        with torch.autocast("cpu", enabled=False):
            w_gu, w_down = w_gate_up_E2FD.to(dtype), w_down_EDF.to(dtype)
            x_RD = layout.to_buffer(rows_PD)
            scale_R = layout.row_weights(scale_P.to(dtype))
            gu_R2F, out_RD = layout.empty(rows_PD, w_gu.shape[1]), layout.empty(rows_PD, D)
            for group in layout.groups:
                torch.bmm(group.rows(x_RD), w_gu[group.experts].transpose(1, 2),
                          out=group.rows(gu_R2F))
            h_RF, silu_RF = scaled_swiglu_forward(gu_R2F, scale_R)
            for group in layout.groups:
                torch.bmm(group.rows(h_RF), w_down[group.experts].transpose(1, 2),
                          out=group.rows(out_RD))
        ctx.layout, ctx.scale_dtype, ctx.weight_dtype = layout, scale_P.dtype, w_gate_up_E2FD.dtype
        ctx.save_for_backward(x_RD, scale_R, gu_R2F, silu_RF, h_RF, w_gu, w_down)
        return layout.from_buffer(out_RD, P)

    @staticmethod
    @first_order_only
    def backward(ctx, grad_PD):
        x_RD, scale_R, gu_R2F, silu_RF, h_RF, w_gu, w_down = ctx.saved_tensors
        layout, need_x, need_scale = ctx.layout, ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        (E, F2, D), P = w_gu.shape, grad_PD.shape[0]
        gy_RD = layout.to_buffer(grad_PD.to(x_RD.dtype))
        # weight gradients in the rows' dtype, cast to the weights' dtype at the end; each group's
        # GEMMs write its experts' whole gradients, an idle expert's is zero
        gw_down, gw_gu = x_RD.new_empty(E, D, F2 // 2), x_RD.new_empty(E, F2, D)
        for e in layout.idle:
            gw_down[e].zero_(), gw_gu[e].zero_()
        gh_RF = layout.empty(h_RF, h_RF.shape[1])
        for group in layout.groups:
            gy = group.rows(gy_RD)
            torch.bmm(gy.transpose(1, 2), group.rows(h_RF), out=gw_down[group.experts])
            torch.bmm(gy, w_down[group.experts], out=group.rows(gh_RF))
        ggu_R2F, gscale_R = scaled_swiglu_backward(gh_RF, gu_R2F, silu_RF, scale_R, need_scale)
        gx_RD = layout.empty(x_RD, D) if need_x else None
        for group in layout.groups:
            ggu = group.rows(ggu_R2F)
            torch.bmm(ggu.transpose(1, 2), group.rows(x_RD), out=gw_gu[group.experts])
            if need_x:
                torch.bmm(ggu, w_gu[group.experts], out=group.rows(gx_RD))
        grad_x = layout.from_buffer(gx_RD, P) if need_x else None
        grad_scale = layout.from_buffer(gscale_R, P).to(ctx.scale_dtype) if need_scale else None
        return (grad_x, None, grad_scale, gw_gu.to(ctx.weight_dtype), gw_down.to(ctx.weight_dtype),
                None)


def rows_in_place(counts, P):
    """The CPULayout for MKL (fp32), which builds no kernel per GEMM shape: each expert's rows where
    the dispatcher put them, one GEMM per expert. counts: host row counts per expert; P dispatched
    rows."""
    starts = itertools.accumulate(counts, initial=0)
    groups = [ExpertGroup(e, e + 1, start, n)
              for e, (start, n) in enumerate(zip(starts, counts)) if n]
    idle = [e for e, n in enumerate(counts) if n == 0]
    return CPULayout(groups, P, sum(counts), None, None, None, idle)


def rows_bucketed(counts, P):
    """The CPULayout for oneDNN (bf16), which builds a kernel per GEMM shape: the rows copied into
    segments padded to bucket sizes, neighbouring experts batched in groups (module doc). counts:
    host row counts per expert; P dispatched rows."""
    E, routed = len(counts), sum(counts)
    idle = [e for e, n in enumerate(counts) if n == 0]
    # Batched GEMMs of up to E // 4 experts beat one small GEMM per expert despite the padding; a
    # group takes neighbouring experts while the smallest count is >= 2/3 of the padded largest,
    # so a skewed routing cannot multiply the padded rows.
    # (Neighbours, not experts sorted by count: each group's weights are a view.)
    max_group = max(1, E // 4)
    # first_row: each expert's first padded row
    groups, first_row, padded_rows, first = [], [], 0, 0
    while first < E:
        end, smallest, largest = first + 1, counts[first], counts[first]
        while (end < min(first + max_group, E)
               and 3 * min(smallest, counts[end]) >= 2 * _bucket(max(largest, counts[end]))):
            smallest, largest, end = min(smallest, counts[end]), max(largest, counts[end]), end + 1
        rows_each = _bucket(largest)
        if rows_each:
            groups.append(ExpertGroup(first, end, padded_rows, rows_each))
        first_row += [padded_rows + i * rows_each for i in range(end - first)]
        padded_rows, first = padded_rows + (end - first) * rows_each, end
    count_E = torch.tensor(counts)
    shift_E = torch.tensor(first_row) - count_E.cumsum(0) + count_E
    dst_N = torch.arange(routed) + torch.repeat_interleave(shift_E, count_E, output_size=routed)
    src_R = torch.zeros(padded_rows, dtype=torch.int64).index_copy_(0, dst_N, torch.arange(routed))
    real_R = torch.zeros(padded_rows, dtype=torch.bool).index_fill_(0, dst_N, True)
    return CPULayout(groups, padded_rows, padded_rows, dst_N, src_R, real_R, idle)


def _cpu_engine(layout_of):
    """The experts engine of CPUExperts on `layout_of` (rows_in_place or rows_bucketed)."""
    def engine(rows_PD, tokens_per_expert, row_weight_P, w_gate_up_E2FD, w_down_EDF):
        return CPUExperts.apply(rows_PD, tokens_per_expert, row_weight_P, w_gate_up_E2FD,
                                w_down_EDF, layout_of)
    engine.__name__ = engine.__qualname__ = f"cpu_experts_{layout_of.__name__}"
    engine.__doc__ = CPUExperts.__doc__
    return engine


# each engine a module attribute under its name: pickle finds a function by name (a model holding
# one pickles)
cpu_experts_rows_in_place = _cpu_engine(rows_in_place)
cpu_experts_rows_bucketed = _cpu_engine(rows_bucketed)


def cpu_experts_for(dtype):
    """The CPU experts engine for rows of `dtype`: in place for MKL's fp32, bucketed for oneDNN's
    kernels per shape (bf16, fp16)."""
    return cpu_experts_rows_in_place if dtype == torch.float32 else cpu_experts_rows_bucketed


def _grouped_engine(ops):
    """The experts engine of two grouped GEMMs on `ops` (kernels/grouped_gemm.py:
    GROUPED_OPS[backend]): expert_loop's interface with tokens_per_expert on the rows' device
    (no host read); the weights cast to the rows' dtype once; the routing weight applied in the
    rows' dtype before the down projection, as the CPU engine applies it (the SwiGLU then makes no
    fp32 [P, F])."""
    def engine(rows_PD, tokens_per_expert, row_weight_P, w_gate_up_E2FD, w_down_EDF):
        if row_weight_P is None:
            row_weight_P = rows_PD.new_ones(rows_PD.shape[0])
        dtype = rows_PD.dtype
        with torch.autocast(rows_PD.device.type, enabled=False):
            offsets_E = torch.cumsum(tokens_per_expert, 0).to(torch.int32)
            return GroupedSwiGLU.apply(rows_PD, w_gate_up_E2FD.to(dtype), w_down_EDF.to(dtype),
                                       offsets_E, row_weight_P.to(dtype), ops)
    engine.__name__ = engine.__qualname__ = f"grouped_experts_{ops.name}"
    engine.__doc__ = _grouped_engine.__doc__
    return engine


GROUPED_EXPERTS = {name: _grouped_engine(ops) for name, ops in GROUPED_OPS.items()}
grouped_experts_torch, grouped_experts_torch_compiled, grouped_experts_triton = (
    GROUPED_EXPERTS.values())
