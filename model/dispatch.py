"""Token dispatch for the MoE layer: the capacity / padding policy, and the two local dispatchers.

Shape legend: T tokens, D hidden size, E experts, K experts per token, N = T*K routed (token, slot)
pairs, P dispatched rows (N minus the pairs that go to no expert, plus padding rows).

The one contract between the router and the experts (the names of Megatron-LM's token dispatchers):

    d = dispatcher.dispatch(x_TD, topk_idx_TK, topk_weight_TK, layout)   # -> Dispatched
    rows_out_PD = experts on d.rows_PD, expert e on its d.tokens_per_expert[e] rows, in order
    y_TD = dispatcher.combine(rows_out_PD, d)

Rows are grouped by expert (ascending id), within an expert in ascending token order (the order the
per-expert masked loop gathers them in); combine adds each token's K rows, its slots in ascending
expert id, from zero (the masked loop's order of `index_add_` calls; no atomics). -1 in topk_idx
means "no expert" (a padding token or a pair over capacity): such pairs get no row and add nothing.

  SortedDispatcher   moe_impl="sorted": one stable argsort; the counts are read to the host once
                     (the layer's only sync); combine applies the routing weights: bitwise the
                     masked loop.
  RowMapDispatcher   moe_impl="fused": a `RowMap` built on the device, static shapes, no host read;
                     the experts apply the routing weights (`row_weight_P`) before the down
                     projection.
Expert parallelism (train/parallel.py) wraps either one in an all-to-all. The layout follows
Megatron-LM's `moe_permute` / `moe_unpermute` and MegaBlocks' sorted grouped GEMM
(Gale et al. 2022).
"""
import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from model.router import tokens_per_expert


@dataclass(frozen=True)
class RowLayout:
    """How one call's rows are laid out. pad_to: every expert's rows are padded with zero rows up to
    this many (moe_pad_to_capacity), or None; alignment: then to a multiple of this; may_drop:
    whether topk_idx may hold -1 (False lets the row-map dispatcher skip its masking work)."""
    pad_to: int | None = None
    alignment: int = 1
    may_drop: bool = True

    @property
    def pads(self):
        return self.pad_to is not None or self.alignment != 1


def padded_size(rows, pad_to=None, alignment=1):
    """max(rows, pad_to) rounded up to a multiple of alignment; rows an int or an int64 tensor
    (elementwise)."""
    if pad_to is not None:
        rows = (torch.clamp(rows, min=pad_to) if isinstance(rows, torch.Tensor)
                else max(rows, pad_to))
    return rows if alignment == 1 else (rows + alignment - 1) // alignment * alignment


def apply_capacity(topk_idx_TK, topk_weight_TK, num_experts, capacity, policy):
    """Set the routed pairs beyond each expert's capacity to -1 (no host sync). policy "probs" keeps
    each expert's highest-weight pairs, "position" its earliest tokens (Switch Transformer / GShard
    capacity, Megatron-LM's drop policies). topk_idx_TK int64 [T, K] in [-1, E); topk_weight_TK
    [T, K]."""
    T, K = topk_idx_TK.shape
    idx_N = topk_idx_TK.reshape(-1)
    valid_N = idx_N >= 0
    expert_N = torch.where(valid_N, idx_N, num_experts)
    pre = (torch.argsort(-topk_weight_TK.reshape(-1).float(), stable=True) if policy == "probs"
           else torch.arange(T * K, device=idx_N.device))
    # by expert, then by the policy's preference
    order = pre[torch.argsort(expert_N[pre], stable=True)]
    counts_E1 = tokens_per_expert(topk_idx_TK, num_experts, count_dropped=True)
    starts_E1 = torch.cumsum(counts_E1, 0) - counts_E1
    rank_in_expert = torch.arange(T * K, device=idx_N.device) - starts_E1[expert_N[order]]
    keep_N = torch.empty_like(valid_N).scatter_(0, order, rank_in_expert < capacity)
    return torch.where(keep_N & valid_N, idx_N, -1).view(T, K)


def drop_and_pad(config, topk_idx_TK, topk_weight_TK, token_mask_T=None):
    """The config's capacity / padding policy for one call: padding tokens go to no expert, pairs
    over capacity are dropped (capacity_factor, moe_drop_policy). Returns (topk_idx_TK with -1 for
    every dropped pair, RowLayout from moe_pad_to_capacity / moe_expert_alignment)."""
    T, K = topk_idx_TK.shape
    if token_mask_T is not None:  # padding goes to no expert: no compute, no capacity taken
        topk_idx_TK = topk_idx_TK.masked_fill(~token_mask_T.unsqueeze(-1), -1)
    pad_to = None
    if config.capacity_factor is not None:
        capacity = math.ceil(config.capacity_factor * T * K / config.num_experts)
        topk_idx_TK = apply_capacity(topk_idx_TK, topk_weight_TK, config.num_experts, capacity,
                                     config.moe_drop_policy)
        pad_to = capacity if config.moe_pad_to_capacity else None
    may_drop = config.capacity_factor is not None or token_mask_T is not None
    return topk_idx_TK, RowLayout(pad_to, config.moe_expert_alignment, may_drop)


def order_slots(topk_idx_TK, topk_weight_TK):
    """Each token's K slots ordered by expert id (-1 first), so a combine adding slots 0..K-1 adds
    them in the masked loop's order. Returns (topk_idx_TK, topk_weight_TK), both reordered."""
    topk_idx_TK, slot_order_TK = topk_idx_TK.sort(dim=-1)
    return topk_idx_TK, topk_weight_TK.gather(-1, slot_order_TK)


@dataclass(kw_only=True)
class Dispatched:
    """What a dispatcher hands the experts: rows_PD [P, D] token rows grouped by expert (ascending
    id; zero padding rows); tokens_per_expert int64 [E'] each expert's rows incl. padding (a CPU
    tensor from the sorted dispatcher, on the device from the row map); row_weight_P [P]: the
    routing weight the experts apply (0 for padding), None when the combine applies it (sorted);
    routed_E: int64 [E] routed pairs per global expert (stats); padded: whether rows include
    padding; state: what the same dispatcher's combine needs (its own dataclass)."""
    rows_PD: torch.Tensor
    tokens_per_expert: torch.Tensor
    row_weight_P: torch.Tensor | None = None
    routed_E: torch.Tensor | None = None
    padded: bool = False
    state: object = None


@dataclass
class SortedState:
    """SortedDispatcher's combine metadata: sorted_pair_N int64 [N] the pairs in row order (dropped
    pairs first), topk_weight_TK [T, K] slot-ordered weights, counts: routed pairs per expert
    (host list), skipped: dropped pairs, dtype: x's dtype."""
    sorted_pair_N: torch.Tensor
    topk_weight_TK: torch.Tensor
    counts: list
    skipped: int
    dtype: torch.dtype


@dataclass
class RowMapState:
    """RowMapDispatcher's combine metadata: the RowMap and x's dtype."""
    row_map: "RowMap"
    dtype: torch.dtype


class PermuteRows(torch.autograd.Function):
    """y = x[perm] for a permutation perm [N] with inverse [N]. Autograd's own backward of x[perm]
    scatter-adds into zeros (a serial accumulate on CPU); a permutation's backward is a gather."""

    @staticmethod
    def forward(ctx, x, perm, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad):
        return grad.index_select(0, ctx.saved_tensors[0]), None, None


@dataclass
class SortedDispatcher:
    """Single-sync sorted dispatch and the deterministic combine, bitwise the masked per-expert
    loop.

    dispatch(..., host_tokens_per_expert=None): one host read of the [E + 1] counts, unless the E
    pair counts are given (expert parallelism exchanges them). tokens_per_expert is a CPU tensor.
    combine(rows_out_PD, d) -> y_TD [T, D] in x's dtype: y[t] = sum over t's slots j, ascending
    expert, of w[t, j] * row, each product cast to x's dtype, accumulated from zero one slot at a
    time.
    """
    num_experts: int

    def dispatch(self, x_TD, topk_idx_TK, topk_weight_TK, layout=RowLayout(),
                 host_tokens_per_expert=None):
        (T, D), K, E = x_TD.shape, topk_idx_TK.shape[1], self.num_experts
        topk_idx_TK, topk_weight_TK = order_slots(topk_idx_TK, topk_weight_TK)
        # One stable sort of the N pairs by expert id: within an expert pairs stay in ascending
        # token order (a token picks an expert at most once); -1 entries sort first and are cut.
        sorted_pair_N = torch.argsort(topk_idx_TK.reshape(-1), stable=True)
        routed_E = tokens_per_expert(topk_idx_TK, E, count_dropped=True)
        counts = (list(host_tokens_per_expert) if host_tokens_per_expert is not None
                  else routed_E.tolist()[:E])
        skipped = T * K - sum(counts)  # (the line above is the layer's single device-to-host read)
        sorted_token_N = sorted_pair_N // K
        chunks, rows_per_expert, start = [], [], skipped
        for n in counts:
            target = padded_size(n, layout.pad_to, layout.alignment)
            # (an empty gather too: it keeps x in the graph,
            # so EP's backward reaches every all-to-all)
            chunks.append(x_TD[sorted_token_N[start:start + n]])
            if target > n:
                chunks.append(x_TD.new_zeros(target - n, D))
            rows_per_expert.append(target)
            start += n
        return Dispatched(rows_PD=torch.cat(chunks),
                          tokens_per_expert=torch.tensor(rows_per_expert, dtype=torch.int64),
                          routed_E=routed_E[:E], padded=layout.pads,
                          state=SortedState(sorted_pair_N, topk_weight_TK, counts,
                                            skipped, x_TD.dtype))

    def combine(self, rows_out_PD, dispatched):
        state = dispatched.state
        pair_N, dtype, skipped = state.sorted_pair_N, state.dtype, state.skipped
        (T, K), D = state.topk_weight_TK.shape, rows_out_PD.shape[1]
        weight_N1 = state.topk_weight_TK.reshape(-1)[pair_N].unsqueeze(-1)
        chunks = [rows_out_PD.new_zeros(skipped, D, dtype=dtype)] if skipped else []
        row, start = 0, skipped
        for n, rows in zip(state.counts, dispatched.tokens_per_expert.tolist()):
            chunks.append((rows_out_PD[row:row + n] * weight_N1[start:start + n]).to(dtype))
            row, start = row + rows, start + n
        with torch.autocast(pair_N.device.type, enabled=False):  # (CPU autocast's cat rejects fp16)
            out_sorted_ND = (torch.cat(chunks) if chunks
                             else rows_out_PD.new_zeros(0, D, dtype=dtype))
        # Unpermute by gathering with the inverse permutation
        # (no scatter-add, no atomics, also in backward).
        inverse_N = torch.empty_like(pair_N).scatter_(0, pair_N,
                                                      torch.arange(T * K, device=pair_N.device))
        out_TKD = PermuteRows.apply(out_sorted_ND, inverse_N, pair_N).view(T, K, D)
        y_TD = torch.zeros(T, D, dtype=dtype, device=pair_N.device)
        # ascending expert order, from zero, one add per slot: the masked loop's sum
        for j in range(K):
            y_TD = y_TD + out_TKD[:, j]
        return y_TD


@dataclass
class RowMap:
    """Where every routed pair sits in the expert-sorted buffer and back, on the device:
    row_of_pair_TK (-1: no expert), token_of_row_P / pair_of_row_P (-1: padding), routed_E /
    padded_E int64 pairs / rows per expert, has_holes (static: any -1 possible)."""
    row_of_pair_TK: torch.Tensor
    pair_of_row_P: torch.Tensor
    token_of_row_P: torch.Tensor
    routed_E: torch.Tensor
    padded_E: torch.Tensor
    has_holes: bool = True


def build_row_map(topk_idx_TK, num_experts, pad_to=None, alignment=1, may_drop=True):
    """Expert-sorted layout of the routed pairs, on the device with no host read. The buffer has a
    static row count P (N, N + E*(alignment-1), or E * padded capacity). topk_idx_TK integer [T, K]
    in [-1, E) (not range-checked: that would need a host read); pad_to only valid when no expert
    has more pairs (after capacity dropping); may_drop=False promises no -1. Raises ValueError for
    bad arguments."""
    if alignment < 1 or (pad_to is not None and pad_to < 0) or topk_idx_TK.dim() != 2:
        raise ValueError(f"build_row_map: alignment {alignment} >= 1, "
                         f"pad_to {pad_to} >= 0 or None, "
                         f"topk_idx {tuple(topk_idx_TK.shape)} [T, K] expected")
    topk_idx_TK = topk_idx_TK.long()
    T, K = topk_idx_TK.shape
    N, E, dev = T * K, num_experts, topk_idx_TK.device
    idx_N = topk_idx_TK.reshape(-1)
    # the common dropless case: P = N, no holes
    if not may_drop and pad_to is None and alignment == 1:
        order_N = torch.argsort(idx_N, stable=True)
        counts_E = tokens_per_expert(topk_idx_TK, E)
        row_of_pair_N = torch.empty_like(order_N).scatter_(0, order_N, torch.arange(N, device=dev))
        return RowMap(row_of_pair_N.view(T, K), order_N, order_N.div(K, rounding_mode="floor"),
                      counts_E, counts_E, has_holes=False)
    expert_N = torch.where(idx_N >= 0, idx_N, E)  # E = "no expert": sorts last, counted in slot E
    order_N = torch.argsort(expert_N, stable=True)
    counts_E1 = tokens_per_expert(topk_idx_TK, E, count_dropped=True)
    padded = padded_size(counts_E1[:E], pad_to, alignment)
    P = E * padded_size(pad_to, None, alignment) if pad_to is not None else N + E * (alignment - 1)
    padded_end = torch.cumsum(padded, 0)
    start_E1 = torch.cumsum(counts_E1, 0) - counts_E1
    padded_start_E1 = torch.cat([padded_end - padded, padded_end.new_zeros(1)])  # slot E unused
    sorted_expert_N = expert_N[order_N]
    rank_N = torch.arange(N, device=dev) - start_E1[sorted_expert_N]
    row_sorted_N = torch.where(sorted_expert_N < E, padded_start_E1[sorted_expert_N] + rank_N, -1)
    row_of_pair_N = torch.empty_like(row_sorted_N).scatter_(0, order_N, row_sorted_N)
    # Rows of dropped pairs are written to a scratch slot P that is cut off.
    pair_of_row_P = torch.full((P + 1,), -1, dtype=torch.int64, device=dev).scatter_(
        0, torch.where(row_sorted_N >= 0, row_sorted_N, P), order_N)[:P]
    token_of_row_P = torch.where(pair_of_row_P >= 0,
                                 pair_of_row_P.div(K, rounding_mode="floor"), -1)
    return RowMap(row_of_pair_N.view(T, K), pair_of_row_P, token_of_row_P, counts_E1[:E], padded,
                  has_holes=may_drop or P != N)


def compute_dtype(x):
    """The dtype expert GEMMs run in: autocast's when it is on for x's device (as nn.Linear would),
    else x's."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def _in_dtype(tensor, dtype):
    # the tensor itself when it has `dtype` already: torch 2.11's compile loses the gradient of
    # an autograd Function whose forward returns a no-op `.to()` (as kernels/backend.py: cast)
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def gather_rows(x_TD, src_P, out_dtype=None, has_holes=True):
    """out[p] = x[src[p]], zero where src[p] < 0: x_TD [T, D] float, src_P int64 [P] in [-1, T)
    (has_holes False: no -1) -> [P, D] in out_dtype (None = x's). The plain row mover (the
    reference of kernels/permute.py's Triton kernels, bitwise: a gather is exact)."""
    out_dtype = out_dtype or x_TD.dtype
    if x_TD.shape[0] == 0:  # no source rows: every output row is padding
        return x_TD.new_zeros(src_P.shape[0], x_TD.shape[1], dtype=out_dtype)
    # cast the T source rows, not the P >= T gathered ones; F.embedding is torch's fastest row
    # gather on CPU. Holes read an appended zero row (zeroing them afterwards, a broadcast
    # masked_fill, costs ~10x the gather).
    if not has_holes:
        return F.embedding(src_P, x_TD.to(out_dtype))
    zero_row = x_TD.new_zeros(1, x_TD.shape[1], dtype=out_dtype)
    return F.embedding(torch.where(src_P < 0, x_TD.shape[0], src_P),
                       torch.cat([x_TD.to(out_dtype), zero_row]))


def sum_rows(h_PD, row_TK, out_dtype=None, has_holes=True):
    """out[t] = sum of h[row[t, j]] over j = 0..K-1 with row >= 0, in fp32 (fp64 for fp64), j
    ascending, cast to out_dtype (None = h's): h_PD [P, D], row_TK int64 [T, K] in [-1, P) ->
    [T, D]. On CPU an fp32 / bf16 sum without holes is embedding_bag over the fp32 rows (it adds
    each bag in index order: the same bits)."""
    out_dtype = out_dtype or h_PD.dtype
    if (not has_holes and h_PD.device.type == "cpu" and out_dtype in (torch.float32, torch.bfloat16)
            and h_PD.dtype in (torch.float32, torch.bfloat16) and h_PD.shape[0] > 0):
        return _in_dtype(F.embedding_bag(row_TK, h_PD.float(), mode="sum"), out_dtype)
    T, K = row_TK.shape
    v_TKD = h_PD.index_select(0, row_TK.reshape(-1).clamp(min=0)).view(T, K, h_PD.shape[1])
    v_TKD = v_TKD.to(torch.promote_types(h_PD.dtype, torch.float32))
    if has_holes:
        v_TKD = v_TKD.masked_fill_((row_TK < 0).unsqueeze(-1), 0)
    acc = v_TKD[:, 0]
    for j in range(1, K):  # one [T, D] add at a time: no [T, K, D] reduction temporary
        acc = acc + v_TKD[:, j]
    return _in_dtype(acc, out_dtype)


class RowMovers(NamedTuple):
    """The two row movers the fused path's Permute and Combine run, forward and backward: gather (as
    `gather_rows`) and sum (as `sum_rows`). PLAIN_MOVERS here (the reference); train/engines.py:
    TRITON_MOVERS, kernels/permute.py's kernels, on CUDA."""
    name: str
    gather: Callable
    sum: Callable


PLAIN_MOVERS = RowMovers("plain", gather_rows, sum_rows)


class Permute(torch.autograd.Function):
    """rows_PD = x[token_of_row] (zero padding rows) by movers.gather; backward: grad_x[t] = sum_j
    grad_rows[row_of_pair[t, j]] by movers.sum (a gather, no scatter-add)."""

    @staticmethod
    def forward(ctx, x_TD, token_of_row_P, row_of_pair_TK, has_holes, movers):
        ctx.save_for_backward(row_of_pair_TK)
        ctx.has_holes, ctx.movers = has_holes, movers
        return movers.gather(x_TD, token_of_row_P, has_holes=has_holes)

    @staticmethod
    def backward(ctx, grad_PD):
        grad = ctx.movers.sum(grad_PD, ctx.saved_tensors[0], has_holes=ctx.has_holes)
        return grad, None, None, None, None


class Combine(torch.autograd.Function):
    """y_TD = sum_j h[row_of_pair[t, j]] (fp32 accumulation, slots ascending) in out_dtype by
    movers.sum; backward: grad_h[p] = grad_y[token_of_row[p]] (zero for padding rows) by
    movers.gather. h_PD may stop before P (an engine that returns only its experts' rows: the rows
    after them are padding)."""

    @staticmethod
    def forward(ctx, h_PD, token_of_row_P, row_of_pair_TK, has_holes, movers, out_dtype):
        ctx.save_for_backward(token_of_row_P[:h_PD.shape[0]])
        ctx.has_holes, ctx.movers, ctx.h_dtype = has_holes, movers, h_PD.dtype
        return movers.sum(h_PD, row_of_pair_TK, out_dtype, has_holes)

    @staticmethod
    def backward(ctx, grad_TD):
        grad = ctx.movers.gather(grad_TD, ctx.saved_tensors[0], ctx.h_dtype, ctx.has_holes)
        return grad, None, None, None, None, None


@dataclass
class RowMapDispatcher:
    """Zero-sync dispatch: a device-side RowMap, one permute, one combine; every shape static.

    dispatch(...) -> Dispatched with rows_PD in the compute dtype (autocast's, else x's),
    tokens_per_expert int64 [E] on the device, row_weight_P each row's routing weight (0 for
    padding), state a RowMapState. combine(rows_out_PD, d) -> y_TD [T, D] in x's dtype: each token's
    K rows summed in fp32, slots in ascending expert id, from the first slot's term.
    movers: the permute's and the combine's row movers, chosen when the layer is built (a RowMovers:
    PLAIN_MOVERS, or on CUDA kernels/permute.py's Triton ones); both run outside autocast, in the
    dtypes they are given.
    """
    num_experts: int
    movers: RowMovers = PLAIN_MOVERS

    def dispatch(self, x_TD, topk_idx_TK, topk_weight_TK, layout=RowLayout(),
                 host_tokens_per_expert=None):
        topk_idx_TK, topk_weight_TK = order_slots(topk_idx_TK, topk_weight_TK)
        rm = build_row_map(topk_idx_TK, self.num_experts, layout.pad_to, layout.alignment,
                           layout.may_drop)
        # each row's routing weight (0 for padding rows);
        # stays in the graph of topk_weight even when P = 0
        w_N = topk_weight_TK.reshape(-1)
        pair_of_row_P = rm.pair_of_row_P.clamp(min=0) if rm.has_holes else rm.pair_of_row_P
        row_weight_P = w_N[pair_of_row_P] if w_N.numel() else w_N.new_zeros(rm.pair_of_row_P.shape)
        if rm.has_holes:
            row_weight_P = torch.where(rm.pair_of_row_P >= 0, row_weight_P, 0.0)
        if not w_N.numel():
            row_weight_P = row_weight_P + w_N.sum()
        x_in_compute_dtype_TD = x_TD.to(compute_dtype(x_TD))
        with torch.autocast(x_TD.device.type, enabled=False):  # (the movers take explicit dtypes)
            rows_PD = Permute.apply(x_in_compute_dtype_TD, rm.token_of_row_P, rm.row_of_pair_TK,
                                    rm.has_holes, self.movers)
        return Dispatched(rows_PD=rows_PD, tokens_per_expert=rm.padded_E, row_weight_P=row_weight_P,
                          routed_E=rm.routed_E, padded=layout.pads,
                          state=RowMapState(rm, x_TD.dtype))

    def combine(self, rows_out_PD, dispatched):
        rm, out_dtype = dispatched.state.row_map, dispatched.state.dtype
        with torch.autocast(rows_out_PD.device.type, enabled=False):
            y_TD = Combine.apply(rows_out_PD, rm.token_of_row_P, rm.row_of_pair_TK, rm.has_holes,
                                 self.movers, torch.promote_types(rows_out_PD.dtype, torch.float32))
        return y_TD.to(out_dtype)

    def __repr__(self):
        return f"RowMapDispatcher(movers={self.movers.name})"
