"""Permute (token rows -> expert-sorted rows) and combine (expert rows -> each token's sum of its K
rows), as Triton kernels beside plain-PyTorch references; each is the other's backward (no
scatter-add).
Shapes: T tokens, K experts per token, D row width, P rows of the permuted buffer.

Both are gathers driven by device-built indices (model/dispatch.py: RowMap): `token_of_row_P`
(-1 = padding) and `row_of_pair_TK` (-1 = no expert). Each output row is written once (no atomics,
deterministic); combine adds a token's slots in order 0..K-1 in fp32 in kernel and reference alike,
so the two are bitwise equal.
"""
import torch
import torch.nn.functional as F

from kernels.backend import cast, choose, triton_importable

if triton_importable():
    import triton
    import triton.language as tl

    @triton.jit
    def _round_to(x, dtype: tl.constexpr):
        # fp32 -> dtype, round-to-nearest-even on the bits
        # for bf16 (the CPU interpreter's bf16 cast truncates)
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(dtype)

    @triton.jit
    def _gather_rows_kernel(x_ptr, src_ptr, out_ptr, D, stride_x, stride_out,
                            BLOCK_D: tl.constexpr):
        # out[p] = x[src[p]], zero where src[p] < 0. Grid: (P, cdiv(D, BLOCK_D)).
        out_row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        in_row = cols < D
        src = tl.load(src_ptr + out_row) + cols * 0  # broadcast to the block: a per-element mask
        valid = src >= 0
        row = tl.load(x_ptr + tl.where(valid, src, 0).to(tl.int64) * stride_x + cols,
                      mask=in_row & valid, other=0.0)
        tl.store(out_ptr + out_row.to(tl.int64) * stride_out + cols,
                 _round_to(row.to(tl.float32), out_ptr.dtype.element_ty), mask=in_row)

    @triton.jit
    def _combine_rows_kernel(h_ptr, row_ptr, out_ptr, K, D, stride_h, stride_out,
                             BLOCK_D: tl.constexpr):
        # out[t] = sum_{j=0..K-1} h[row[t, j]] over rows >= 0, in fp32, j ascending. Grid: (T,
        # cdiv(D, BLOCK_D)).
        token = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        in_row = cols < D
        row = tl.load(row_ptr + token * K) + cols * 0
        valid = row >= 0
        acc = tl.load(h_ptr + tl.where(valid, row, 0).to(tl.int64) * stride_h + cols,
                      mask=in_row & valid, other=0.0).to(tl.float32)
        for j in range(1, K):
            row = tl.load(row_ptr + token * K + j) + cols * 0
            valid = row >= 0
            acc = acc + tl.load(h_ptr + tl.where(valid, row, 0).to(tl.int64) * stride_h + cols,
                                mask=in_row & valid, other=0.0).to(tl.float32)
        tl.store(out_ptr + token.to(tl.int64) * stride_out + cols,
                 _round_to(acc, out_ptr.dtype.element_ty), mask=in_row)


def _block_d(D):
    return min(1024, triton.next_power_of_2(max(D, 16)))


# fp contraction off: a*b+c must round twice, as the reference's separate multiply and add do.
_LAUNCH = {"enable_fp_fusion": False}


def _launch_options(tensor):
    return _LAUNCH if tensor.is_cuda else {}


def gather_rows(x_TD, src_P, backend="auto", out_dtype=None, has_holes=True):
    """out[p] = x[src[p]], zero where src[p] < 0: x_TD [T, D] float, src_P int64 [P] in [-1, T)
    (has_holes False: no -1) -> [P, D] in out_dtype (None = x's). Raises ValueError / RuntimeError
    for an unusable backend."""
    out_dtype = out_dtype or x_TD.dtype
    if choose(backend, x_TD, "gather_rows") == "reference":
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
    x_TD = x_TD.contiguous()
    P, D = src_P.shape[0], x_TD.shape[1]
    out = x_TD.new_empty(P, D, dtype=out_dtype)
    if P and D:
        _gather_rows_kernel[(P, triton.cdiv(D, _block_d(D)))](x_TD, src_P.contiguous(), out, D,
                                                              x_TD.stride(0), out.stride(0),
                                                              BLOCK_D=_block_d(D),
                                                              **_launch_options(x_TD))
    return out


def combine_rows(h_PD, row_TK, backend="auto", out_dtype=None, has_holes=True):
    """out[t] = sum of h[row[t, j]] over j = 0..K-1 with row >= 0, in fp32, j ascending, cast to
    out_dtype (None = h's): h_PD [P, D], row_TK int64 [T, K] in [-1, P) -> [T, D]. On CPU, an fp32 /
    bf16 result without holes comes from embedding_bag over the fp32 rows (it adds each bag in index
    order: bitwise the reference)."""
    out_dtype = out_dtype or h_PD.dtype
    if choose(backend, h_PD, "combine_rows") == "reference":
        if (not has_holes and h_PD.device.type == "cpu"
                and out_dtype in (torch.float32, torch.bfloat16)
                and h_PD.dtype in (torch.float32, torch.bfloat16) and h_PD.shape[0] > 0):
            return cast(F.embedding_bag(row_TK, h_PD.float(), mode="sum"), out_dtype)
        T, K = row_TK.shape
        v_TKD = h_PD.index_select(0, row_TK.reshape(-1).clamp(min=0)).view(T, K, h_PD.shape[1])
        # (fp64 stays fp64, for gradcheck)
        v_TKD = v_TKD.to(torch.promote_types(h_PD.dtype, torch.float32))
        if has_holes:
            v_TKD = v_TKD.masked_fill_((row_TK < 0).unsqueeze(-1), 0)
        acc = v_TKD[:, 0]
        for j in range(1, K):  # one [T, D] add at a time: no [T, K, D] reduction temporary
            acc = acc + v_TKD[:, j]
        return cast(acc, out_dtype)
    h_PD = h_PD.contiguous()
    (T, K), D = row_TK.shape, h_PD.shape[1]
    out = h_PD.new_empty(T, D, dtype=out_dtype)
    if T and D:
        _combine_rows_kernel[(T, triton.cdiv(D, _block_d(D)))](h_PD, row_TK.contiguous(), out, K, D,
                                                               h_PD.stride(0), out.stride(0),
                                                               BLOCK_D=_block_d(D),
                                                               **_launch_options(h_PD))
    return out


class Permute(torch.autograd.Function):
    """rows_PD = x[token_of_row] (zero padding rows); backward: grad_x[t] = sum_j
    grad_rows[row_of_pair[t, j]]."""

    @staticmethod
    def forward(ctx, x_TD, token_of_row_P, row_of_pair_TK, has_holes, backend):
        ctx.save_for_backward(row_of_pair_TK)
        ctx.has_holes, ctx.backend = has_holes, backend
        return gather_rows(x_TD, token_of_row_P, backend, has_holes=has_holes)

    @staticmethod
    def backward(ctx, grad_PD):
        grad = combine_rows(grad_PD, ctx.saved_tensors[0], ctx.backend, has_holes=ctx.has_holes)
        return grad, None, None, None, None


class Combine(torch.autograd.Function):
    """y_TD = sum_j h[row_of_pair[t, j]] (fp32 accumulation, slots ascending) in out_dtype;
    backward: grad_h[p] = grad_y[token_of_row[p]] (zero for padding rows)."""

    @staticmethod
    def forward(ctx, h_PD, token_of_row_P, row_of_pair_TK, has_holes, backend, out_dtype):
        ctx.save_for_backward(token_of_row_P)
        ctx.has_holes, ctx.backend, ctx.h_dtype = has_holes, backend, h_PD.dtype
        return combine_rows(h_PD, row_of_pair_TK, backend, out_dtype, has_holes)

    @staticmethod
    def backward(ctx, grad_TD):
        grad = gather_rows(grad_TD, ctx.saved_tensors[0], ctx.backend, ctx.h_dtype, ctx.has_holes)
        return grad, None, None, None, None, None


def permute_kernel(x_TD, rm):
    """The fused path's permute engine (model/dispatch.py: permute_rows' interface) through
    `Permute`."""
    with torch.autocast(x_TD.device.type, enabled=False):  # the kernels take explicit dtypes
        return Permute.apply(x_TD, rm.token_of_row_P, rm.row_of_pair_TK, rm.has_holes, "auto")


def combine_kernel(rows_PD, rm):
    """The fused path's combine engine (model/dispatch.py: combine_rows' interface) through
    `Combine`: fp32."""
    with torch.autocast(rows_PD.device.type, enabled=False):
        return Combine.apply(rows_PD, rm.token_of_row_P, rm.row_of_pair_TK, rm.has_holes,
                             "auto", torch.float32)
