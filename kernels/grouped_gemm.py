"""Grouped GEMM over variable-length expert segments, and the grouped SwiGLU expert FFN built on it.

    c[rows of e] = a[rows of e] @ b[e]    for the row segments given by offsets (int32 [E], on the device)

The GPU engine of the fused MoE path (kernels/swap.py; on CPU the expert chains of kernels/cpu_experts.py
run instead). Backends (`backend=`):
  "torch"     torch.nn.functional.grouped_mm (or torch._grouped_mm): CPU in torch >= 2.9, CUDA bf16 on
              compute capability >= 8.0. Reads offsets on the device: no host sync.
  "triton"    our kernels (forward, input-grad and weight-grad), for what torch's cannot run (e.g. fp32 or
              fp16 on CUDA); also runs in the CPU interpreter for tests. No host sync.
  "reference" a Python loop of per-expert matmuls; reads the offsets to the host (one sync).
  "auto"      "torch" where it supports the operands, else "triton" on CUDA, else "reference".

Rows at or past offsets[-1] are not part of any segment: their output rows are unspecified (never read
by the MoE layer) for "torch", zero for the others.
"""
import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from kernels.backend import cpu_values, triton_importable, triton_runs_on, warn_once

_TORCH_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)

if triton_importable():
    import triton
    import triton.language as tl

    from kernels.permute import _round_to

    @triton.jit
    def _grouped_mm_kernel(a_ptr, b_ptr, c_ptr, bounds_ptr, tile_start_ptr, E, N, K,
                           stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           PRECISION: tl.constexpr):
        # Grid: (an upper bound on the number of BLOCK_M row tiles over all segments, cdiv(N, BLOCK_N)).
        # tile_start[e] = first row tile of segment e (cumulative cdiv(len_e, BLOCK_M)); extra programs exit.
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if pid_m < tl.load(tile_start_ptr + E):
            e = pid_m * 0  # an int32 scalar tensor, so the loop-carried type is fixed
            for i in range(E):  # segment of this tile: how many segments end at or before it
                e += (tl.load(tile_start_ptr + i + 1) <= pid_m).to(tl.int32)
            row_end = tl.load(bounds_ptr + e + 1)
            rows = tl.load(bounds_ptr + e) + (pid_m - tl.load(tile_start_ptr + e)) * BLOCK_M + tl.arange(0, BLOCK_M)
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            row_ok = rows < row_end
            col_ok = cols < N
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_ok = ks < K
                a = tl.load(a_ptr + rows[:, None].to(tl.int64) * stride_am + ks[None, :] * stride_ak,
                            mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(b_ptr + e.to(tl.int64) * stride_be + ks[:, None] * stride_bk + cols[None, :] * stride_bn,
                            mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                acc = tl.dot(a, b, acc, input_precision=PRECISION)
            tl.store(c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :] * stride_cn,
                     _round_to(acc, c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _grouped_wgrad_kernel(a_ptr, g_ptr, out_ptr, bounds_ptr, K, N,
                              stride_am, stride_ak, stride_gm, stride_gn, stride_oe, stride_ok, stride_on,
                              BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                              PRECISION: tl.constexpr):
        # out[e] = a[rows of e]^T @ g[rows of e]; zero for an empty segment. Grid: (E, cdiv(K,BK), cdiv(N,BN)).
        e = tl.program_id(0)
        ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        ns = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        k_ok = ks < K
        n_ok = ns < N
        start = tl.load(bounds_ptr + e)
        end = tl.load(bounds_ptr + e + 1)
        acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
        for m0 in range(start, end, BLOCK_M):
            ms = m0 + tl.arange(0, BLOCK_M)
            m_ok = ms < end
            a = tl.load(a_ptr + ms[:, None].to(tl.int64) * stride_am + ks[None, :] * stride_ak,
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptr + ms[:, None].to(tl.int64) * stride_gm + ns[None, :] * stride_gn,
                        mask=m_ok[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot(tl.trans(a), g, acc, input_precision=PRECISION)
        tl.store(out_ptr + e.to(tl.int64) * stride_oe + ks[:, None] * stride_ok + ns[None, :] * stride_on,
                 _round_to(acc, out_ptr.dtype.element_ty), mask=k_ok[:, None] & n_ok[None, :])


def _bounds(offsets_E):
    return torch.cat([offsets_E.new_zeros(1), offsets_E]).to(torch.int32)


def _blocks(a):
    # Small tiles in the interpreter (numpy is slow on big tiles) and for tiny problems; tl.dot needs >= 16.
    return (16, 32, 32) if not a.is_cuda else (64, 64, 32)


def _precision(a):
    return "ieee" if a.dtype == torch.float32 else "tf32"  # fp32 stays exact-rounded fp32 (no TF32)


def grouped_mm_triton(a_MK, b_EKN, offsets_E):
    """Forward Triton grouped GEMM (no autograd). a [M, K], b [E, K, N] (any strides), offsets int32 [E]."""
    M, K = a_MK.shape
    E, _, N = b_EKN.shape
    c = a_MK.new_zeros(M, N)
    if M == 0 or N == 0 or E == 0:
        return c
    BM, BN, BK = _blocks(a_MK)
    bounds = _bounds(offsets_E)
    tiles = (bounds[1:] - bounds[:-1] + BM - 1) // BM
    tile_start = torch.cat([tiles.new_zeros(1), torch.cumsum(tiles, 0)]).to(torch.int32)
    grid = (triton.cdiv(M, BM) + E, triton.cdiv(N, BN))
    _grouped_mm_kernel[grid](a_MK, b_EKN, c, bounds, tile_start, E, N, K,
                             a_MK.stride(0), a_MK.stride(1), *b_EKN.stride(), c.stride(0), c.stride(1),
                             BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, PRECISION=_precision(a_MK))
    return c


def grouped_wgrad_triton(a_MK, g_MN, offsets_E):
    """out[e] = a[rows of e]^T @ g[rows of e] -> [E, K, N] in a's dtype (fp32 accumulation)."""
    M, K = a_MK.shape
    N = g_MN.shape[1]
    E = offsets_E.shape[0]
    out = a_MK.new_zeros(E, K, N)
    if E == 0 or K == 0 or N == 0:
        return out
    BM, BN, BK = _blocks(a_MK)
    grid = (E, triton.cdiv(K, BK), triton.cdiv(N, BN))
    _grouped_wgrad_kernel[grid](a_MK, g_MN, out, _bounds(offsets_E), K, N, a_MK.stride(0), a_MK.stride(1),
                                g_MN.stride(0), g_MN.stride(1), *out.stride(),
                                BLOCK_M=BM, BLOCK_K=BK, BLOCK_N=BN, PRECISION=_precision(a_MK))
    return out


def grouped_mm_reference(a_MK, b_EKN, offsets_E):
    """Per-segment matmuls in a Python loop (differentiable through autograd). One host read of offsets."""
    bounds = _bounds(offsets_E).tolist()
    M, N = a_MK.shape[0], b_EKN.shape[2]
    chunks = [a_MK[bounds[e]:bounds[e + 1]] @ b_EKN[e] for e in range(b_EKN.shape[0])]
    chunks.append(a_MK.new_zeros(M - bounds[-1], N))
    return torch.cat(chunks)


# torch's grouped_mm and our per-segment weight-gradient loop, as opaque custom ops: torch.compile then
# treats them as single nodes with known output shapes instead of tracing into them (grouped_mm's compile
# support covers bf16 only; the loop reads the offsets).
@torch.library.custom_op("minimind_kernels::grouped_mm", mutates_args=())
def _grouped_mm_op(a_MK: torch.Tensor, b_EKN: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    return _TORCH_GROUPED_MM(a_MK, b_EKN, offs=offsets_E)


@_grouped_mm_op.register_fake
def _(a_MK, b_EKN, offsets_E):
    return a_MK.new_empty(a_MK.shape[0], b_EKN.shape[2])


def _segment_outer(lhs_MX, rhs_MY, offsets_E):
    """out[e] = lhs[rows of e]^T @ rhs[rows of e] -> [E, X, Y]."""
    if lhs_MX.device.type == "cpu":
        return _segment_outer_products_cpu(lhs_MX, rhs_MY, offsets_E)
    return _TORCH_GROUPED_MM(lhs_MX.t(), rhs_MY, offs=offsets_E)


@torch.library.custom_op("minimind_kernels::segment_outer", mutates_args=())
def _segment_outer_op(lhs_MX: torch.Tensor, rhs_MY: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    return _segment_outer(lhs_MX, rhs_MY, offsets_E)


@_segment_outer_op.register_fake
def _(lhs_MX, rhs_MY, offsets_E):
    return lhs_MX.new_empty(offsets_E.shape[0], lhs_MX.shape[1], rhs_MY.shape[1])


def _eager_or_op(eager_fn, op):
    # The custom-op wrapper costs ~30 us of Python dispatch per call: only pay it when compiling.
    return lambda *args: (op if torch.compiler.is_compiling() else eager_fn)(*args)


# backend -> (c = a @ b per segment, out[e] = lhs_e^T @ rhs_e per segment)
_GROUPED_OPS = {"torch": (_eager_or_op(lambda a, b, offs: _TORCH_GROUPED_MM(a, b, offs=offs), _grouped_mm_op),
                          _eager_or_op(_segment_outer, _segment_outer_op)),
                "triton": (lambda a, b, offs: grouped_mm_triton(a, b, offs),
                           lambda lhs, rhs, offs: grouped_wgrad_triton(lhs, rhs, offs))}


class _GroupedMM(torch.autograd.Function):
    """Grouped GEMM with our own backward, for the "torch" and "triton" backends:
    grad_a = grad @ b^T per segment, grad_b[e] = a_e^T @ grad_e. (torch's built-in backward of grouped_mm
    rejects a broadcast, stride-0 gradient, e.g. from `.sum().backward()`.)"""

    @staticmethod
    def forward(ctx, a_MK, b_EKN, offsets_E, backend):
        ctx.backend = backend
        ctx.save_for_backward(a_MK, b_EKN, offsets_E)
        return _GROUPED_OPS[backend][0](a_MK, b_EKN, offsets_E)

    @staticmethod
    def backward(ctx, grad_MN):
        a_MK, b_EKN, offsets_E = ctx.saved_tensors
        mm, outer = _GROUPED_OPS[ctx.backend]
        grad_MN = grad_MN.contiguous()
        grad_a = mm(grad_MN, b_EKN.transpose(1, 2), offsets_E) if ctx.needs_input_grad[0] else None
        grad_b = None
        if ctx.needs_input_grad[1]:
            # When b is W^T for a row-major W [E, N, K] (nn.Linear layout), the gradient is made in W's
            # layout, so each expert's weight grad is a contiguous slice that autograd can keep (no copy).
            if b_EKN.stride(1) == 1:
                grad_b = outer(grad_MN, a_MK, offsets_E).to(b_EKN.dtype).transpose(1, 2)
            else:
                grad_b = outer(a_MK, grad_MN, offsets_E).to(b_EKN.dtype)
        return grad_a, grad_b, None, None


def _segment_outer_products_cpu(lhs_MX, rhs_MY, offsets_E):
    """out[e] = lhs[rows of e]^T @ rhs[rows of e] -> [E, X, Y], one mm per segment on CPU.

    torch's CPU grouped_mm runs this 2D x 2D form about 2x slower than plain per-segment mm (measured
    at the benchmark shapes). Reading the offsets here is not a device sync: on CPU there is no device to
    wait for. The forward never does it, so the layer's forward stays free of host reads everywhere.
    """
    out = lhs_MX.new_empty(offsets_E.shape[0], lhs_MX.shape[1], rhs_MY.shape[1])
    start = 0
    for e, end in enumerate(cpu_values(offsets_E)):
        torch.mm(lhs_MX[start:end].t(), rhs_MY[start:end], out=out[e])
        start = end
    return out


def _aligned16(t):
    size = t.element_size()
    strides_ok = all((st * size) % 16 == 0 for n, st in zip(t.shape, t.stride()) if n > 1 and st != 1)
    # data_ptr() is not traceable; under torch.compile the base address is the allocator's (aligned) one
    return strides_ok and (torch.compiler.is_compiling() or t.data_ptr() % 16 == 0)


def torch_grouped_mm_supports(a, b) -> bool:
    """Whether torch's grouped_mm runs these operands, forward and backward: CPU fp32/bf16, CUDA bf16 on
    compute capability >= 8.0; every non-unit stride, the output's row stride (it is the gradient's in
    backward) and the base addresses multiples of 16 bytes (e.g. D and F multiples of 4 in fp32, of 8 in
    bf16)."""
    if (_TORCH_GROUPED_MM is None or not (_aligned16(a) and _aligned16(b))
            or (b.shape[2] * a.element_size()) % 16 or (a.shape[1] * a.element_size()) % 16):
        return False
    if a.device.type == "cpu":
        return a.dtype in (torch.float32, torch.bfloat16)
    if a.is_cuda:
        return a.dtype == torch.bfloat16 and torch.cuda.get_device_capability(a.device) >= (8, 0)
    return False


def resolve_backend(backend, a, b):
    if backend not in ("auto", "torch", "triton", "reference"):
        raise ValueError(f"grouped_mm backend must be auto, torch, triton or reference, got {backend!r}")
    if backend == "triton" and not triton_runs_on(a):
        raise RuntimeError(f"grouped_mm: Triton cannot run on this {a.device.type} tensor (CPU needs "
                           "TRITON_INTERPRET=1 before triton is imported); use backend='auto', 'torch' or 'reference'")
    if backend == "torch" and not torch_grouped_mm_supports(a, b):
        raise RuntimeError(f"grouped_mm: torch's grouped_mm cannot take {a.dtype} {tuple(a.shape)} x "
                           f"{tuple(b.shape)} on {a.device.type} (dtype or 16-byte alignment); use backend='auto'")
    if backend != "auto":
        return backend
    if torch_grouped_mm_supports(a, b):
        return "torch"
    if triton_runs_on(a) and a.is_cuda:
        return "triton"
    warn_once(f"grouped_mm-{a.device.type}-{a.dtype}-{a.shape[1]}-{b.shape[2]}",
              f"grouped_mm: torch's grouped_mm cannot take {a.dtype} [*, {a.shape[1]}] x [*, {b.shape[1]}, "
              f"{b.shape[2]}] on {a.device.type} (dtype, or rows not a multiple of 16 bytes) and Triton does not "
              "run here; using the per-expert PyTorch loop (one host read of the offsets per call)")
    return "reference"


def grouped_mm(a_MK, b_EKN, offsets_E, backend="auto"):
    """Differentiable grouped GEMM: c[offsets[e-1]:offsets[e]] = a[offsets[e-1]:offsets[e]] @ b[e].

    Args: a_MK [M, K] and b_EKN [E, K, N] of one float dtype (b may be a transposed view); offsets_E
        int32/int64 [E] non-decreasing, offsets[-1] <= M, on a's device (not checked: that would need a
        host read). backend: see the module docstring.
    Returns: c [M, N] in a's dtype. Raises ValueError for mismatched shapes/dtypes or an unknown backend,
        RuntimeError for a backend that cannot run these operands.
    """
    if a_MK.dim() != 2 or b_EKN.dim() != 3 or a_MK.shape[1] != b_EKN.shape[1] or offsets_E.shape[0] != b_EKN.shape[0]:
        raise ValueError(f"grouped_mm: a {tuple(a_MK.shape)}, b {tuple(b_EKN.shape)}, offsets "
                         f"{tuple(offsets_E.shape)} do not fit ([M, K], [E, K, N], [E])")
    if a_MK.dtype != b_EKN.dtype or not a_MK.is_floating_point():
        raise ValueError(f"grouped_mm: a and b must share one float dtype, got {a_MK.dtype} and {b_EKN.dtype}")
    if offsets_E.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"grouped_mm: offsets must be int32 or int64, got {offsets_E.dtype}")
    backend = resolve_backend(backend, a_MK, b_EKN)
    if backend in ("torch", "triton"):
        return _GroupedMM.apply(a_MK, b_EKN, offsets_E.to(torch.int32), backend)
    return grouped_mm_reference(a_MK, b_EKN, offsets_E)


def scaled_swiglu_forward(gate_up_PF2, scale_P):
    """(h_PF, silu_PF): h = silu(gate) * up * scale[:, None] for gate_up = [gate | up], in gate_up's
    dtype (products in promote(dtype, scale dtype), cast once), and silu(gate), which backward needs."""
    F_ = gate_up_PF2.shape[1] // 2
    silu_PF = F.silu(gate_up_PF2[:, :F_])
    h_PF = silu_PF * gate_up_PF2[:, F_:]
    acc = torch.promote_types(gate_up_PF2.dtype, scale_P.dtype)
    if acc == h_PF.dtype:
        return h_PF.mul_(scale_P.unsqueeze(1)), silu_PF
    return (h_PF.to(acc) * scale_P.to(acc).unsqueeze(1)).to(gate_up_PF2.dtype), silu_PF


def scaled_swiglu_backward(grad_PF, gate_up_PF2, silu_PF, scale_P, need_scale_grad=True):
    """(grad_gate_up [P, 2F] in gate_up's dtype, grad_scale [P] in scale's dtype or None) of
    scaled_swiglu_forward: with v = grad * up, d scale = sum_f v * silu(gate), d up = grad * scale *
    silu(gate), d gate = silu'(gate) * v * scale (aten's fused silu_backward)."""
    F_ = gate_up_PF2.shape[1] // 2
    gate, up = gate_up_PF2[:, :F_], gate_up_PF2[:, F_:]
    acc = torch.promote_types(gate_up_PF2.dtype, scale_P.dtype)
    scale_P1 = scale_P.to(acc).unsqueeze(1)
    v_PF = grad_PF.to(acc) * up
    grad_scale = torch.linalg.vecdot(v_PF, silu_PF.to(acc)).to(scale_P.dtype) if need_scale_grad else None
    if torch.compiler.is_compiling() or acc != gate_up_PF2.dtype:  # the compiler fuses; no out= views
        grad = torch.cat([torch.ops.aten.silu_backward(v_PF * scale_P1, gate.to(acc)),
                          grad_PF.to(acc) * scale_P1 * silu_PF], dim=1).to(gate_up_PF2.dtype)
        return grad, grad_scale
    grad = torch.empty_like(gate_up_PF2)
    torch.mul(grad_PF, silu_PF, out=grad[:, F_:]).mul_(scale_P1)
    torch.ops.aten.silu_backward.grad_input(v_PF.mul_(scale_P1), gate, grad_input=grad[:, :F_])
    return grad, grad_scale


class ScaledSwiGLU(torch.autograd.Function):
    """h_PF = silu(gate) * up * scale_P[:, None] for gate_up = [gate | up] ([P, 2F], [P] -> [P, F]).

    The MoE layer's routing weights, applied before the down projection instead of after it (the same
    value up to rounding: the down projection is linear), so the combine that follows is a plain sum
    and the weights' gradient is a dot product over F rather than over D.
    """

    @staticmethod
    def forward(ctx, gate_up_PF2, scale_P):
        h_PF, silu_PF = scaled_swiglu_forward(gate_up_PF2, scale_P)
        ctx.save_for_backward(gate_up_PF2, silu_PF, scale_P)
        return h_PF

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_PF):
        gate_up, silu_PF, scale_P = ctx.saved_tensors
        return scaled_swiglu_backward(grad_PF, gate_up, silu_PF, scale_P, ctx.needs_input_grad[1])


def grouped_swiglu(x_PD, w_gate_up_E2FD, w_down_EDF, offsets_E, row_scale_P, backend="auto"):
    """Grouped SwiGLU experts: y = down_e(silu(gate_e(x)) * up_e(x) * s) for the rows of every expert e.

    Args: x_PD [P, D] expert-sorted rows; w_gate_up_E2FD [E, 2F, D] (rows 0..F-1 of expert e are its
        gate_proj.weight, F..2F-1 its up_proj.weight: nn.Linear layout); w_down_EDF [E, D, F]
        (down_proj.weight); offsets_E int32 [E] cumulative row counts; row_scale_P [P] factor s per row
        (differentiable; the MoE layer's routing weights). Returns y_PD [P, D].
    """
    gate_up = grouped_mm(x_PD, w_gate_up_E2FD.transpose(1, 2), offsets_E, backend)
    h = ScaledSwiGLU.apply(gate_up, row_scale_P)
    return grouped_mm(h, w_down_EDF.transpose(1, 2), offsets_E, backend)
