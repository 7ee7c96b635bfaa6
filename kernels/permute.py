"""Permute (token rows -> expert-sorted rows) and unpermute + combine (expert rows -> token rows, weighted
sum of each token's K contributions), as Triton kernels beside plain-PyTorch references.

Shape legend: T tokens, K experts per token, E experts, D row width, N = T*K routed (token, slot) pairs,
P rows of the permuted buffer (N, or more when each expert's rows are padded to an alignment/capacity).

Everything is driven by a row map (`model.dispatch.RowMap`, built on the device without any host read, so
the MoE layer that uses it makes no sync-inducing call). Both directions are gathers (each output row
reads its inputs and writes itself once): no atomics, deterministic, and the combine adds a token's slots
in a fixed order (slot 0, 1, ..., K-1, accumulating in fp32 from zero), identically in the kernel and in
the reference, so the two are bitwise equal. The backward of each is the other one: permute's is a
combine with unit weights, combine's is a permute that scales each row by its pair's weight.

The expert-sorted layout follows Megatron-LM's `moe_permute`/`moe_unpermute` and the "sorted grouped GEMM"
MoE recipe (MegaBlocks, Gale et al. 2022); the code here is our own.
"""
import torch
import torch.nn.functional as F

from kernels.backend import choose, triton_importable, triton_runs_on

if triton_importable():
    import triton
    import triton.language as tl

    @triton.jit
    def _round_to(x, dtype: tl.constexpr):
        # fp32 -> dtype with round-to-nearest-even, done on the bits for bf16: Triton's CPU interpreter
        # truncates in a plain bf16 cast, and the result must match torch's rounding bit for bit.
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(dtype)

    @triton.jit
    def _gather_rows_kernel(x_ptr, src_ptr, scale_ptr, out_ptr, D, stride_x, stride_out,
                            HAS_SCALE: tl.constexpr, BLOCK_D: tl.constexpr):
        # out[p] = x[src[p]] (* scale[p]), zero where src[p] < 0. Grid: (P, cdiv(D, BLOCK_D)).
        p = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        in_row = cols < D
        src = tl.load(src_ptr + p) + cols * 0  # broadcast to the block: a per-element mask
        valid = src >= 0
        row = tl.load(x_ptr + tl.where(valid, src, 0).to(tl.int64) * stride_x + cols, mask=in_row & valid, other=0.0)
        if HAS_SCALE:
            row = _round_to(row.to(tl.float32) * tl.load(scale_ptr + p), out_ptr.dtype.element_ty)
        tl.store(out_ptr + p.to(tl.int64) * stride_out + cols, row, mask=in_row)

    @triton.jit
    def _combine_rows_kernel(h_ptr, row_ptr, w_ptr, out_ptr, K, D, stride_h, stride_out,
                             HAS_WEIGHT: tl.constexpr, BLOCK_D: tl.constexpr):
        # out[t] = sum_{j=0..K-1} w[t, j] * h[row[t, j]] over rows >= 0, in fp32, j ascending (rows < 0
        # contribute a zero term).
        # Grid: (T, cdiv(D, BLOCK_D)).
        t = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        in_row = cols < D
        r = tl.load(row_ptr + t * K) + cols * 0
        valid = r >= 0
        acc = tl.load(h_ptr + tl.where(valid, r, 0).to(tl.int64) * stride_h + cols, mask=in_row & valid,
                      other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            acc = acc * tl.load(w_ptr + t * K).to(tl.float32)
        for j in range(1, K):
            r = tl.load(row_ptr + t * K + j) + cols * 0
            valid = r >= 0
            v = tl.load(h_ptr + tl.where(valid, r, 0).to(tl.int64) * stride_h + cols, mask=in_row & valid,
                        other=0.0).to(tl.float32)
            if HAS_WEIGHT:
                v = v * tl.load(w_ptr + t * K + j).to(tl.float32)
            acc = acc + v
        tl.store(out_ptr + t.to(tl.int64) * stride_out + cols, _round_to(acc, out_ptr.dtype.element_ty), mask=in_row)


def _block_d(D):
    return min(1024, triton.next_power_of_2(max(D, 16)))


# fp contraction off: a*b+c must round twice, as the reference's separate multiply and add do.
_LAUNCH = {"enable_fp_fusion": False}


def _launch_options(t):
    return _LAUNCH if t.is_cuda else {}


def gather_rows(x_TD, src_P, scale_P=None, backend="auto", out_dtype=None, has_holes=True):
    """out[p] = x[src[p]] * scale[p] (fp32 multiply, then cast), zero rows where src[p] < 0.

    Args: x_TD [T, D] any float dtype; src_P int64 [P] in [-1, T); scale_P optional fp32 [P];
        out_dtype: None = x's dtype; has_holes: False promises src has no -1 (lets the reference skip
        its masking). Returns: [P, D]. Raises ValueError / RuntimeError for an unusable backend.
    """
    out_dtype = out_dtype or x_TD.dtype
    if choose(backend, x_TD, "gather_rows") == "reference":
        return gather_rows_reference(x_TD, src_P, scale_P, out_dtype, has_holes)
    x_TD = x_TD.contiguous()
    P, D = src_P.shape[0], x_TD.shape[1]
    out = x_TD.new_empty(P, D, dtype=out_dtype)
    if P and D:
        _gather_rows_kernel[(P, triton.cdiv(D, _block_d(D)))](
            x_TD, src_P.contiguous(), scale_P.contiguous() if scale_P is not None else src_P, out, D,
            x_TD.stride(0), out.stride(0), HAS_SCALE=scale_P is not None, BLOCK_D=_block_d(D),
            **_launch_options(x_TD))
    return out


def gather_rows_reference(x_TD, src_P, scale_P=None, out_dtype=None, has_holes=True):
    if x_TD.shape[0] == 0:  # no source rows: every output row is padding (src all -1)
        return x_TD.new_zeros(src_P.shape[0], x_TD.shape[1], dtype=out_dtype or x_TD.dtype)
    out = x_TD.index_select(0, src_P.clamp(min=0) if has_holes else src_P)
    if scale_P is not None:
        acc = torch.promote_types(x_TD.dtype, torch.float32)  # fp32 (fp64 stays fp64, for gradcheck)
        out = out.to(acc) * scale_P.to(acc).unsqueeze(-1)
    out = out.to(out_dtype or x_TD.dtype)
    return out.masked_fill_((src_P < 0).unsqueeze(-1), 0) if has_holes else out


def combine_rows(h_PD, row_TK, w_TK=None, backend="auto", out_dtype=None, has_holes=True):
    """out[t] = sum over j = 0..K-1 with row[t, j] >= 0 of w[t, j] * h[row[t, j]].

    Accumulates in fp32 in ascending j, starting from the j = 0 term (one rounding per multiply and per
    add; a row < 0 contributes an exact zero), then casts to
    out_dtype (None = h's dtype). Args: h_PD [P, D] float; row_TK int64 [T, K] in [-1, P); w_TK optional
    [T, K] float (None = unit weights); has_holes: False promises row has no -1. backend: "auto",
    "triton", "reference", or "embedding_bag" (CPU, unit weights, no holes, fp32/fp64: torch's fused
    gather-and-sum kernel, which adds each bag's rows in index order, so it is bitwise the reference;
    "auto" takes it there when Triton does not run). Returns: [T, D].
    """
    out_dtype = out_dtype or h_PD.dtype
    if backend == "embedding_bag" or (backend == "auto" and not triton_runs_on(h_PD)
                                      and _bag_sum_applies(h_PD, w_TK, has_holes, out_dtype)):
        if not _bag_sum_applies(h_PD, w_TK, has_holes, out_dtype):
            raise RuntimeError("combine_rows: the embedding_bag backend takes CPU fp32/fp64 rows, unit weights, "
                               "no holes and out_dtype = h's dtype; use backend='auto'")
        return F.embedding_bag(row_TK, h_PD, mode="sum")
    if choose(backend, h_PD, "combine_rows") == "reference":
        return combine_rows_reference(h_PD, row_TK, w_TK, out_dtype, has_holes)
    h_PD = h_PD.contiguous()
    (T, K), D = row_TK.shape, h_PD.shape[1]
    out = h_PD.new_empty(T, D, dtype=out_dtype)
    if T and D:
        _combine_rows_kernel[(T, triton.cdiv(D, _block_d(D)))](
            h_PD, row_TK.contiguous(), w_TK.contiguous() if w_TK is not None else row_TK, out, K, D,
            h_PD.stride(0), out.stride(0), HAS_WEIGHT=w_TK is not None, BLOCK_D=_block_d(D),
            **_launch_options(h_PD))
    return out


def _bag_sum_applies(h_PD, w_TK, has_holes, out_dtype):
    # embedding_bag accumulates fp32/fp64 rows in the rows' dtype, in index order: the reference's sum.
    # (With weights it fuses multiply and add, one rounding instead of two: not bitwise the reference.)
    return (w_TK is None and not has_holes and h_PD.device.type == "cpu" and out_dtype == h_PD.dtype
            and h_PD.dtype in (torch.float32, torch.float64) and h_PD.shape[0] > 0)


def combine_rows_reference(h_PD, row_TK, w_TK=None, out_dtype=None, has_holes=True, return_rows=False):
    """combine_rows in PyTorch ops; with return_rows also the gathered fp32 rows v_TKD [T, K, D]
    (zero for dropped pairs), which the backward of the weights reuses instead of gathering again."""
    T, K = row_TK.shape
    row_N = row_TK.reshape(-1)
    acc_dtype = torch.promote_types(h_PD.dtype, torch.float32)  # fp32 (fp64 stays fp64, for gradcheck)
    v_TKD = h_PD.index_select(0, row_N.clamp(min=0) if has_holes else row_N).view(T, K, h_PD.shape[1]).to(acc_dtype)
    if has_holes:
        v_TKD = v_TKD.masked_fill_((row_TK < 0).unsqueeze(-1), 0)
    w_TK1 = w_TK.to(acc_dtype).unsqueeze(-1) if w_TK is not None else None
    acc = v_TKD[:, 0] if w_TK1 is None else v_TKD[:, 0] * w_TK1[:, 0]
    for j in range(1, K):  # one [T, D] product at a time: no [T, K, D] temporary
        acc = acc + (v_TKD[:, j] if w_TK1 is None else v_TKD[:, j] * w_TK1[:, j])
    out = acc.to(out_dtype or h_PD.dtype)
    return (out, v_TKD) if return_rows else out


class Permute(torch.autograd.Function):
    """x_PD = permute(x_TD, row_map): token rows copied into expert-sorted order (zero padding rows).
    Backward: grad_x[t] = sum_j grad_P[row_of_pair[t, j]], a combine with unit weights."""

    @staticmethod
    def forward(ctx, x_TD, row_map, backend):
        ctx.row_map, ctx.backend = row_map, backend
        return gather_rows(x_TD, row_map.token_of_row_P, backend=backend, has_holes=row_map.has_holes)

    @staticmethod
    def backward(ctx, grad_PD):
        rm = ctx.row_map
        return combine_rows(grad_PD, rm.row_of_pair_TK, backend=ctx.backend, has_holes=rm.has_holes), None, None


class UnpermuteCombine(torch.autograd.Function):
    """y_TD = sum_j w[t, j] * h[row_of_pair[t, j]] (fp32 accumulation, slots ascending; w None = unit
    weights, the MoE layer's case: it applies the routing weights before the down projection).
    Backward: grad_h[p] = w[pair(p)] * grad_y[token(p)] (a scaled permute); grad_w[t, j] = <grad_y[t],
    h[row_of_pair[t, j]]> (0 for a dropped pair)."""

    @staticmethod
    def forward(ctx, h_PD, w_TK, row_map, backend, out_dtype):
        ctx.row_map, ctx.backend = row_map, backend
        ctx.rows_TKD = None
        if (w_TK is not None and w_TK.requires_grad
                and choose(backend, h_PD, "combine_rows") == "reference"):  # keep the gathered rows for grad_w
            out, ctx.rows_TKD = combine_rows_reference(h_PD, row_map.row_of_pair_TK, w_TK, out_dtype,
                                                       row_map.has_holes, return_rows=True)
        else:
            out = combine_rows(h_PD, row_map.row_of_pair_TK, w_TK, backend=backend, out_dtype=out_dtype,
                               has_holes=row_map.has_holes)
        ctx.h_dtype = h_PD.dtype
        ctx.has_weight = w_TK is not None
        ctx.save_for_backward(h_PD if ctx.rows_TKD is None and w_TK is not None else None, w_TK)
        return out

    @staticmethod
    def backward(ctx, grad_TD):
        h_PD, w_TK = ctx.saved_tensors
        rm = ctx.row_map
        grad_h = grad_w = None
        if ctx.needs_input_grad[0]:
            scale_P = row_weights(w_TK, rm) if ctx.has_weight else None
            grad_h = gather_rows(grad_TD, rm.token_of_row_P, scale_P, backend=ctx.backend, out_dtype=ctx.h_dtype,
                                 has_holes=rm.has_holes)
        if ctx.has_weight and ctx.needs_input_grad[1]:
            T, K = rm.row_of_pair_TK.shape
            h_TKD = ctx.rows_TKD
            if h_TKD is None:
                row_N = rm.row_of_pair_TK.reshape(-1)
                h_TKD = h_PD.index_select(0, row_N.clamp(min=0) if rm.has_holes else row_N).view(T, K, h_PD.shape[1]).float()
            grad_w = torch.bmm(h_TKD, grad_TD.to(h_TKD.dtype).unsqueeze(-1)).squeeze(-1)
            if rm.has_holes:
                grad_w = grad_w.masked_fill_(rm.row_of_pair_TK < 0, 0)
            grad_w = grad_w.to(w_TK.dtype)
        return grad_h, grad_w, None, None, None


def row_weights(w_TK, row_map):
    """[P] weight of the pair in each row of the permuted buffer (0 for padding / unused rows);
    differentiable in w_TK."""
    w_N, pair_P = w_TK.reshape(-1), row_map.pair_of_row_P
    if w_N.numel() == 0:  # no pairs (e.g. an EP rank that received none): only padding rows, if any
        return w_N.new_zeros(pair_P.shape[0])
    if row_map.has_holes:
        return torch.where(pair_P >= 0, w_N[pair_P.clamp(min=0)], 0.0)
    return w_N[pair_P]


def permute(x_TD, row_map, backend="auto"):
    """Differentiable permute (see `Permute`). x_TD [T, D] -> [P, D] in x's dtype.
    Raises ValueError when x's rows do not match the row map's tokens."""
    if x_TD.dim() != 2 or x_TD.shape[0] != row_map.row_of_pair_TK.shape[0]:
        raise ValueError(f"permute: x {tuple(x_TD.shape)} does not fit the row map's "
                         f"{row_map.row_of_pair_TK.shape[0]} tokens ([T, D] expected)")
    return Permute.apply(x_TD, row_map, backend)


def unpermute_combine(h_PD, w_TK, row_map, backend="auto", out_dtype=None):
    """Differentiable unpermute + weighted combine (see `UnpermuteCombine`); w_TK None = unit weights.
    -> [T, D] in out_dtype (None = h's dtype)."""
    if (w_TK is not None and w_TK.shape != row_map.row_of_pair_TK.shape) or h_PD.dim() != 2 or h_PD.shape[0] != row_map.num_rows:
        raise ValueError(f"unpermute_combine: h {tuple(h_PD.shape)} / w "
                         f"{None if w_TK is None else tuple(w_TK.shape)} do not fit the row map "
                         f"([{row_map.num_rows}, D] and {tuple(row_map.row_of_pair_TK.shape)} expected)")
    return UnpermuteCombine.apply(h_PD, w_TK, row_map, backend, out_dtype)
