"""The row movers of the fused path's permute (token rows -> expert-sorted rows) and combine (expert
rows -> each token's sum of its K rows) as Triton kernels: `TRITON_MOVERS`, the GPU's stand-ins for
model/dispatch.py's plain `gather_rows` / `sum_rows` (the reference; model/dispatch.py's Permute and
Combine run either, each mover the other's backward, no scatter-add).
Shapes: T tokens, K experts per token, D row width, P rows of the permuted buffer.

Both are gathers driven by device-built indices (model/dispatch.py: RowMap): `token_of_row_P`
(-1 = padding) and `row_of_pair_TK` (-1 = no expert). Each output row is written once (no atomics,
deterministic); the sum adds a token's slots in order 0..K-1 in fp32 in kernel and reference alike,
so the two are bitwise equal.
"""
from kernels.backend import triton_importable, triton_runs_on

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


def gather_rows_triton(x_TD, src_P, out_dtype=None, has_holes=True):
    """model/dispatch.py: gather_rows by `_gather_rows_kernel` (holes or not, one kernel): x_TD
    [T, D] float, src_P int64 [P] in [-1, T) -> [P, D] in out_dtype (None = x's). Raises
    RuntimeError where Triton cannot run on x's device (kernels/backend.py: triton_runs_on)."""
    _check_triton(x_TD, "gather_rows_triton")
    x_TD = x_TD.contiguous()
    P, D = src_P.shape[0], x_TD.shape[1]
    out = x_TD.new_empty(P, D, dtype=out_dtype or x_TD.dtype)
    if P and D:
        _gather_rows_kernel[(P, triton.cdiv(D, _block_d(D)))](x_TD, src_P.contiguous(), out, D,
                                                              x_TD.stride(0), out.stride(0),
                                                              BLOCK_D=_block_d(D),
                                                              **_launch_options(x_TD))
    return out


def sum_rows_triton(h_PD, row_TK, out_dtype=None, has_holes=True):
    """model/dispatch.py: sum_rows by `_combine_rows_kernel`: h_PD [P, D], row_TK int64 [T, K] in
    [-1, P) -> [T, D] in out_dtype (None = h's), each token's rows added in fp32, j ascending.
    Raises RuntimeError where Triton cannot run on h's device."""
    _check_triton(h_PD, "sum_rows_triton")
    h_PD = h_PD.contiguous()
    (T, K), D = row_TK.shape, h_PD.shape[1]
    out = h_PD.new_empty(T, D, dtype=out_dtype or h_PD.dtype)
    if T and D:
        _combine_rows_kernel[(T, triton.cdiv(D, _block_d(D)))](h_PD, row_TK.contiguous(), out, K, D,
                                                               h_PD.stride(0), out.stride(0),
                                                               BLOCK_D=_block_d(D),
                                                               **_launch_options(h_PD))
    return out


def _check_triton(tensor, what):
    if not triton_runs_on(tensor):
        raise RuntimeError(f"{what}: Triton cannot run on this {tensor.device.type} tensor "
                           f"(installed: {triton_importable()}; on CPU set TRITON_INTERPRET=1 "
                           "before importing)")
