"""Token dispatch for the MoE layer: the capacity / padding policy, and the local token dispatchers.

Shape legend: T tokens, D hidden size, E experts, K experts per token, N = T*K routed (token, slot) pairs,
P dispatched rows (N minus the pairs that go to no expert, plus padding rows).

A token dispatcher has two calls (the names of Megatron-LM's token dispatchers):

    rows, tokens_per_expert, handle = dispatcher.dispatch(x_TD, topk_idx_TK, topk_weight_TK, layout)
    y_TD = dispatcher.combine(rows_out, handle)      # rows_out = experts(rows, tokens_per_expert, handle)

dispatch permutes the token rows into expert order (expert by expert, ascending id; within an expert in
ascending token order, the order the per-expert masked loop gathers them in); combine unpermutes the
experts' output rows and adds each token's K weighted rows, its slots in ascending expert id, starting
from zero (the masked loop's order of `index_add_` calls; no atomics). Implementations:

  SortedDispatcher   the bitwise path (moe_impl="sorted"): one stable argsort; `tokens_per_expert` is
                     read to the host once (the layer's only sync); rows are a list of per-expert tensors;
                     the combine applies the routing weights, so the result is the masked loop's, bit for bit.
  RowMapDispatcher   the zero-sync path (moe_impl="fused"): a `RowMap` built on the device, static shapes,
                     `tokens_per_expert` and offsets never leave the device; rows are one [P, D] tensor and
                     the experts apply the routing weights (`handle.row_weight_P`).
  AllToAllDispatcher expert parallelism (train/expert_parallel.py: model/ holds no distributed code); it
                     sends the rows to the ranks owning their experts and runs one of the above there.

-1 in topk_idx means "no expert" (a padding token or a pair over capacity): such pairs get no row and add
nothing. The expert-sorted layout follows Megatron-LM's `moe_permute` / `moe_unpermute` and the "sorted
grouped GEMM" recipe (MegaBlocks, Gale et al. 2022); the code here is our own.
"""
import math
from dataclasses import dataclass

import torch

from kernels.permute import permute as permute_rows, row_weights, unpermute_combine
from model.router import tokens_per_expert


# ------------------------------------------------------------------ capacity / padding policy

@dataclass(frozen=True)
class RowLayout:
    """How one call's rows are laid out, as decided by the capacity / padding policy.

    pad_to: every expert's rows are padded with zero rows up to this many (the capacity, with
        moe_pad_to_capacity), or None. alignment: then to a multiple of this (1 = no padding).
    may_drop: whether topk_idx may hold -1 (padding tokens, capacity drops); False lets the row-map
        dispatcher skip its masking work.
    """
    pad_to: int | None = None
    alignment: int = 1
    may_drop: bool = True

    @property
    def pads(self):
        return self.pad_to is not None or self.alignment != 1


def padded_size(n, pad_to=None, alignment=1):
    """Rows of an expert with n routed pairs: max(n, pad_to), rounded up to a multiple of alignment.
    n: an int or an int64 tensor of counts (elementwise)."""
    if pad_to is not None:
        n = torch.clamp(n, min=pad_to) if isinstance(n, torch.Tensor) else max(n, pad_to)
    return n if alignment == 1 else (n + alignment - 1) // alignment * alignment


def apply_capacity(topk_idx_TK, topk_weight_TK, num_experts, capacity, policy):
    """Drop routed pairs beyond each expert's capacity (no host sync).

    policy "probs" keeps each expert's highest-weight pairs, "position" its earliest tokens (Switch
    Transformer / GShard capacity, as in Megatron-LM's drop policies).
    Args: topk_idx_TK int64 [T, K] in [-1, E); topk_weight_TK [T, K]; capacity: pairs per expert.
    Returns: topk_idx_TK with the dropped entries set to -1.
    """
    T, K = topk_idx_TK.shape
    idx_N = topk_idx_TK.reshape(-1)
    valid_N = idx_N >= 0
    expert_N = torch.where(valid_N, idx_N, num_experts)
    pre = (torch.argsort(-topk_weight_TK.reshape(-1).float(), stable=True) if policy == "probs"
           else torch.arange(T * K, device=idx_N.device))
    order = pre[torch.argsort(expert_N[pre], stable=True)]  # by expert, then by the policy's preference
    counts_E1 = tokens_per_expert(topk_idx_TK, num_experts, count_dropped=True)
    starts_E1 = torch.cumsum(counts_E1, 0) - counts_E1
    rank_in_expert = torch.arange(T * K, device=idx_N.device) - starts_E1[expert_N[order]]
    keep_N = torch.empty_like(valid_N).scatter_(0, order, rank_in_expert < capacity)
    return torch.where(keep_N & valid_N, idx_N, -1).view(T, K)


def drop_and_pad(config, topk_idx_TK, topk_weight_TK, token_mask_T=None):
    """The capacity / padding policy of `config` for one call: padding tokens go to no expert, pairs over
    capacity are dropped (capacity_factor, moe_drop_policy), and the rows are laid out with
    moe_pad_to_capacity / moe_expert_alignment.

    Args: topk_idx_TK int64 [T, K]; topk_weight_TK [T, K]; token_mask_T optional bool [T] (False = padding).
    Returns: (topk_idx_TK with -1 for every dropped pair, RowLayout).
    """
    T, K = topk_idx_TK.shape
    if token_mask_T is not None:  # padding goes to no expert: no compute, no capacity taken
        topk_idx_TK = topk_idx_TK.masked_fill(~token_mask_T.unsqueeze(-1), -1)
    pad_to = None
    if config.capacity_factor is not None:
        capacity = math.ceil(config.capacity_factor * T * K / config.num_experts)
        topk_idx_TK = apply_capacity(topk_idx_TK, topk_weight_TK, config.num_experts, capacity, config.moe_drop_policy)
        if config.moe_pad_to_capacity:
            pad_to = capacity
    may_drop = config.capacity_factor is not None or token_mask_T is not None
    return topk_idx_TK, RowLayout(pad_to, config.moe_expert_alignment, may_drop)


def order_slots(topk_idx_TK, topk_weight_TK):
    """Each token's K slots ordered by expert id (-1 first): after the stable sort of all pairs by expert,
    slot j of a token is then its j-th smallest expert, and a combine adding slots 0..K-1 adds them in
    the masked loop's order. Returns (topk_idx_TK, topk_weight_TK), both reordered."""
    topk_idx_TK, slot_order_TK = topk_idx_TK.sort(dim=-1)
    return topk_idx_TK, topk_weight_TK.gather(-1, slot_order_TK)


# ------------------------------------------------------------------ handles

@dataclass(kw_only=True)
class DispatchHandle:
    """What a dispatcher's combine needs, plus the public fields the experts and the layer's stats read.

    row_weight_P: [P] routing weight of every dispatched row (0 for padding rows), for experts that apply
        it (before the down projection); None when the combine applies the weights (SortedDispatcher).
    first_expert: global id of the first expert the rows are for (0; under EP the rank's first expert).
    row_map: the RowMap of a RowMapDispatcher, else None.
    permuted: False when the rows were left in token order (`dispatch(permute=False)`).
    out_dtype: dtype of combine's output (the dispatched input's).
    tokens_per_expert_E: int64 [E] routed pairs per expert on the device (None when the caller passed
        host counts). padded_tokens_per_expert_E: int64 [E] rows per expert incl. padding rows (on the
        host for SortedDispatcher, which has them there), None without padding.
    """
    row_weight_P: torch.Tensor | None = None
    first_expert: int = 0
    row_map: "RowMap | None" = None
    permuted: bool = True
    out_dtype: torch.dtype = torch.float32
    tokens_per_expert_E: torch.Tensor | None = None
    padded_tokens_per_expert_E: torch.Tensor | None = None


@dataclass(kw_only=True)
class SortedHandle(DispatchHandle):
    sorted_pair_N: torch.Tensor  # pair ids t*K + j in expert order; the `skipped` -1 pairs first
    topk_weight_TK: torch.Tensor
    counts: list  # routed pairs per expert (host ints, before padding)
    skipped: int
    shape_TKD: tuple


# ------------------------------------------------------------------ the sorted dispatcher (bitwise)

class PermuteRows(torch.autograd.Function):
    """y = x[perm] for a permutation `perm` [N] with inverse `inverse` [N]; x: [N, D].

    Autograd's own backward of `x[perm]` scatter-adds into zeros (a serial accumulate on CPU); for a
    permutation every row receives exactly one gradient, so the backward is the gather grad[inverse].
    """

    @staticmethod
    def forward(ctx, x, perm, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


@dataclass
class SortedDispatcher:
    """Single-sync sorted dispatch and the deterministic combine, bitwise the masked per-expert loop.

    dispatch(x_TD [T, D], topk_idx_TK int64 [T, K] in [-1, E), topk_weight_TK [T, K], layout=None,
    permute=True, host_tokens_per_expert=None) -> (rows, tokens_per_expert, handle):
        rows: list of E tensors [n_e, D] in x's dtype, expert e's token rows in ascending token order,
            plus zero padding rows per `layout`; each a fresh gather, like the masked loop's `x[token_idx]`,
            so every expert's GEMM sees the same input (alignment included) and gives the same bits.
        tokens_per_expert: host list of the E row counts (padding included).
    One host read: the [E + 1] counts, unless host_tokens_per_expert (the E pair counts, e.g. exchanged by
    expert parallelism) is given. Raises ValueError for permute=False (only the row-map dispatcher
    leaves rows in token order).

    combine(rows_out, handle) -> y_TD [T, D] in x's dtype: rows_out[e] = expert e's output on rows[e]
    (None = not run: an idle expert in eval); y[t] = sum over t's slots j, ascending expert, of
    w[t, j] * row, each product cast to x's dtype, accumulated from zero one slot at a time.
    """
    num_experts: int

    def dispatch(self, x_TD, topk_idx_TK, topk_weight_TK, layout=None, permute=True, host_tokens_per_expert=None):
        if not permute:
            raise ValueError("SortedDispatcher always permutes: experts that gather their own rows "
                             "(impl='cpu_chains') need the RowMapDispatcher")
        layout = layout or RowLayout()
        (T, D), K, E = x_TD.shape, topk_idx_TK.shape[1], self.num_experts
        topk_idx_TK, topk_weight_TK = order_slots(topk_idx_TK, topk_weight_TK)
        # One stable sort of the N pairs by expert id. Within an expert pairs stay in ascending token order
        # (a token picks an expert at most once); -1 entries sort first and are cut.
        sorted_pair_N = torch.argsort(topk_idx_TK.reshape(-1), stable=True)
        tokens_per_expert_E = None
        if host_tokens_per_expert is None:
            counts_E1 = tokens_per_expert(topk_idx_TK, E, count_dropped=True)
            counts = counts_E1.tolist()  # the layer's single device-to-host read
            skipped, counts = counts[E], counts[:E]
            tokens_per_expert_E = counts_E1[:E]
        else:
            counts = list(host_tokens_per_expert)
            skipped = T * K - sum(counts)
        sorted_token_N = sorted_pair_N // K
        rows, rows_per_expert, start = [], [], skipped
        for n in counts:
            target = padded_size(n, layout.pad_to, layout.alignment)
            # (also for n = 0: the empty gather keeps x in the autograd graph, which expert parallelism
            # needs: backward must reach the all-to-all that delivered x on every rank)
            x_e = x_TD[sorted_token_N[start:start + n]]
            if target > n:
                x_e = torch.cat([x_e, x_e.new_zeros(target - n, D)])
            rows.append(x_e)
            rows_per_expert.append(target)
            start += n
        handle = SortedHandle(
            sorted_pair_N=sorted_pair_N, topk_weight_TK=topk_weight_TK, counts=counts, skipped=skipped,
            shape_TKD=(T, K, D), out_dtype=x_TD.dtype, tokens_per_expert_E=tokens_per_expert_E,
            padded_tokens_per_expert_E=torch.tensor(rows_per_expert) if layout.pads else None)
        return rows, rows_per_expert, handle

    def combine(self, rows_out, handle):
        (T, K, D), dtype = handle.shape_TKD, handle.out_dtype
        pair_N = handle.sorted_pair_N
        weight_N1 = handle.topk_weight_TK.reshape(-1)[pair_N].unsqueeze(-1)
        chunks = [pair_N.new_zeros(handle.skipped, D, dtype=dtype)] if handle.skipped else []
        start = handle.skipped
        for y_e, n in zip(rows_out, handle.counts):
            if y_e is not None:
                chunks.append((y_e[:n] * weight_N1[start:start + n]).to(dtype))
            start += n
        # (chunks share x's dtype; CPU autocast's cat rejects fp16)
        with torch.autocast(pair_N.device.type, enabled=False):
            out_sorted_ND = torch.cat(chunks) if chunks else pair_N.new_zeros(0, D, dtype=dtype)
        # Unpermute by gathering with the inverse permutation (no scatter-add, no atomics, also in backward).
        inverse_N = torch.empty_like(pair_N).scatter_(0, pair_N, torch.arange(T * K, device=pair_N.device))
        out_TKD = PermuteRows.apply(out_sorted_ND, inverse_N, pair_N).view(T, K, D)
        # Combine in ascending expert order, from zero, one add per slot: the masked loop's summation.
        y_TD = torch.zeros(T, D, dtype=dtype, device=pair_N.device)
        for j in range(K):
            y_TD = y_TD + out_TKD[:, j]
        return y_TD


# ------------------------------------------------------------------ the row-map dispatcher (zero-sync)

@dataclass
class RowMap:
    """Where every routed pair sits in the expert-sorted buffer, and back. All tensors on the device.

    row_of_pair_TK: int64 [T, K], row of pair (t, j) in the permuted buffer, -1 if it goes to no expert.
    pair_of_row_P: int64 [P], t*K + j of the pair in row p, -1 for padding and unused tail rows.
    token_of_row_P: int64 [P], t of row p, -1 for padding / tail.
    offsets_E: int32 [E], cumulative (padded) row counts: expert e owns rows [offsets[e-1], offsets[e]).
    tokens_per_expert_E: int64 [E], routed pairs per expert (before padding).
    padded_tokens_per_expert_E: int64 [E], rows per expert including padding.
    has_holes: whether any pair may be dropped (-1) or any row be padding (static, from the arguments).
    """
    row_of_pair_TK: torch.Tensor
    pair_of_row_P: torch.Tensor
    token_of_row_P: torch.Tensor
    offsets_E: torch.Tensor
    tokens_per_expert_E: torch.Tensor
    padded_tokens_per_expert_E: torch.Tensor
    has_holes: bool = True

    @property
    def num_rows(self):
        return self.pair_of_row_P.shape[0]


def build_row_map(topk_idx_TK, num_experts, pad_to=None, alignment=1, may_drop=True):
    """Expert-sorted layout of the routed pairs, computed on the device with no host read.

    Pairs go expert by expert (ascending id); within an expert in ascending (token, slot) order, which
    is the order a per-expert masked loop gathers them in. Each expert's block may be padded with empty
    rows: up to `pad_to` rows (only valid when no expert has more pairs, e.g. after capacity dropping),
    then up to a multiple of `alignment`. The buffer has a static row count P (N, N + E*(alignment-1), or
    E * padded capacity), so nothing depends on data-dependent shapes.

    Args: topk_idx_TK integer [T, K] in [-1, E) (-1 = no expert; values are not range-checked, which
        would need a host read); num_experts E; pad_to int or None;
        alignment int >= 1; may_drop: False promises topk_idx has no -1 (a router's top-k without
        capacity dropping). Returns: RowMap. Raises ValueError for alignment < 1 or pad_to < 0.
    """
    if not isinstance(alignment, int) or alignment < 1 or (pad_to is not None and (not isinstance(pad_to, int) or pad_to < 0)):
        raise ValueError(f"alignment must be an int >= 1 and pad_to an int >= 0 or None, got {alignment!r}, {pad_to!r}")
    if topk_idx_TK.dim() != 2 or topk_idx_TK.is_floating_point():
        raise ValueError(f"topk_idx must be an integer [T, K] tensor, got {topk_idx_TK.dtype} {tuple(topk_idx_TK.shape)}")
    topk_idx_TK = topk_idx_TK.long()
    T, K = topk_idx_TK.shape
    N, E, dev = T * K, num_experts, topk_idx_TK.device
    idx_N = topk_idx_TK.reshape(-1)
    if not may_drop and pad_to is None and alignment == 1:  # the common dropless case: P = N, no holes
        order_N = torch.argsort(idx_N, stable=True)
        counts_E = tokens_per_expert(topk_idx_TK, E)
        row_of_pair_N = torch.empty_like(order_N).scatter_(0, order_N, torch.arange(N, device=dev))
        return RowMap(row_of_pair_N.view(T, K), order_N, order_N.div(K, rounding_mode="floor"),
                      torch.cumsum(counts_E, 0).to(torch.int32), counts_E, counts_E, has_holes=False)
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
    token_of_row_P = torch.where(pair_of_row_P >= 0, pair_of_row_P.div(K, rounding_mode="floor"), -1)
    return RowMap(row_of_pair_N.view(T, K), pair_of_row_P, token_of_row_P, padded_end.to(torch.int32),
                  counts_E1[:E], padded, has_holes=may_drop or P != N)


def compute_dtype(x):
    """The dtype expert GEMMs run in: autocast's when it is on for x's device (as nn.Linear would), else x's."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


@dataclass
class RowMapDispatcher:
    """Zero-sync dispatch: a device-side RowMap, one permute, one combine; every shape static.

    dispatch(x_TD [T, D], topk_idx_TK int64 [T, K] in [-1, E), topk_weight_TK [T, K], layout=None,
    permute=True, host_tokens_per_expert=None (ignored: nothing is read to the host))
      -> (rows, tokens_per_expert, handle):
        rows: [P, D] in the compute dtype (autocast's, else x's): row p is x[token_of_row[p]], zero for
            padding rows; with permute=False x itself in token order (for experts that gather their own
            rows, SwiGLUExperts impl="cpu_chains").
        tokens_per_expert: int64 [E] rows per expert incl. padding, on the device.
        handle.row_weight_P [P]: each row's routing weight, which the experts apply.
    combine(rows_out [P, D], handle) -> y_TD [T, D] in x's dtype: each token's K rows summed in fp32, slots
        in ascending expert id (no atomics); with permute=False rows_out is already y (only cast).

    permute_backend ("auto" | "triton" | "reference", kernels.permute): the permute and combine kernels.
    Raises ValueError / RuntimeError for an unusable backend.
    """
    num_experts: int
    permute_backend: str = "auto"

    def dispatch(self, x_TD, topk_idx_TK, topk_weight_TK, layout=None, permute=True, host_tokens_per_expert=None):
        layout = layout or RowLayout()
        topk_idx_TK, topk_weight_TK = order_slots(topk_idx_TK, topk_weight_TK)
        row_map = build_row_map(topk_idx_TK, self.num_experts, layout.pad_to, layout.alignment, layout.may_drop)
        # Each row's routing weight scales its SwiGLU output before the down projection (linear, so the
        # same sum up to rounding): the combine is then an unweighted sum, and the weights' gradient a dot
        # product over F instead of D.
        row_weight_P = row_weights(topk_weight_TK, row_map)  # padding rows and dropped pairs: 0
        rows = x_TD.to(compute_dtype(x_TD))
        if permute:
            with torch.autocast(x_TD.device.type, enabled=False):  # the kernels take explicit dtypes
                rows = permute_rows(rows, row_map, self.permute_backend)
        handle = DispatchHandle(row_weight_P=row_weight_P, row_map=row_map, permuted=permute, out_dtype=x_TD.dtype,
                                tokens_per_expert_E=row_map.tokens_per_expert_E,
                                padded_tokens_per_expert_E=row_map.padded_tokens_per_expert_E if layout.pads else None)
        return rows, row_map.padded_tokens_per_expert_E, handle

    def combine(self, rows_out, handle):
        if not handle.permuted:  # the experts added their rows into token order themselves
            return rows_out.to(handle.out_dtype)
        with torch.autocast(rows_out.device.type, enabled=False):
            return unpermute_combine(rows_out, None, handle.row_map, self.permute_backend, out_dtype=handle.out_dtype)

