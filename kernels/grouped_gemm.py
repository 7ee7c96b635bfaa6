"""Grouped GEMM over variable-length expert segments, and the grouped SwiGLU expert FFN built on it:
c[rows of e] = a[rows of e] @ b[e] for the row segments given by offsets (int32 [E], on the device).

The GPU engine of the fused MoE path (`GroupedSwiGLU`, run by kernels/experts.py: GROUPED_EXPERTS;
on CPU with oneDNN the batched GEMMs of CPUExperts run instead). Backends (`GROUPED_OPS`, chosen
when the model is built: train/engines.py: grouped_experts_for):
  "torch"     F.grouped_mm (or torch._grouped_mm): CPU in torch >= 2.9, CUDA bf16 on sm >= 8.0; no
              host sync.
  "triton"    our kernels (forward, input- and weight-grad) for what torch's cannot run (e.g. fp32 /
              fp16 on CUDA); also in the CPU interpreter for tests; no host sync.
Where neither runs, the plain per-expert loop (model/moe.py: expert_loop) is the engine. Output rows
at or past offsets[-1] (in no segment) are unspecified for "torch" (never read), zero for "triton".
"""
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from kernels.backend import first_order_only, triton_importable

_TORCH_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)

if triton_importable():
    import triton
    import triton.language as tl

    from kernels.permute import _round_to

    @triton.jit
    def _grouped_mm_kernel(a_ptr, b_ptr, c_ptr, bounds_ptr, tile_start_ptr, E, N, K,
                           stride_am, stride_ak, stride_be, stride_bk, stride_bn,
                           stride_cm, stride_cn,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           PRECISION: tl.constexpr):
        # Grid: (upper bound on BLOCK_M row tiles over all segments, cdiv(N, BLOCK_N));
        # tile_start[e] = first row tile of segment e (cumulative cdiv(len_e, BLOCK_M)); extra
        # programs exit.
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if pid_m < tl.load(tile_start_ptr + E):
            e = pid_m * 0  # an int32 scalar tensor, so the loop-carried type is fixed
            for i in range(E):  # segment of this tile: how many segments end at or before it
                e += (tl.load(tile_start_ptr + i + 1) <= pid_m).to(tl.int32)
            row_end = tl.load(bounds_ptr + e + 1)
            rows = (tl.load(bounds_ptr + e) + (pid_m - tl.load(tile_start_ptr + e)) * BLOCK_M
                    + tl.arange(0, BLOCK_M))
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            row_ok = rows < row_end
            col_ok = cols < N
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_ok = ks < K
                a = tl.load(a_ptr + rows[:, None].to(tl.int64) * stride_am
                            + ks[None, :] * stride_ak,
                            mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(b_ptr + e.to(tl.int64) * stride_be + ks[:, None] * stride_bk
                            + cols[None, :] * stride_bn,
                            mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                acc = tl.dot(a, b, acc, input_precision=PRECISION)
            tl.store(c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :] * stride_cn,
                     _round_to(acc, c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _grouped_wgrad_kernel(a_ptr, g_ptr, out_ptr, bounds_ptr, K, N,
                              stride_am, stride_ak, stride_gm, stride_gn,
                              stride_oe, stride_ok, stride_on,
                              BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                              PRECISION: tl.constexpr):
        # out[e] = a[rows of e]^T @ g[rows of e]; zero for an
        # empty segment. Grid: (E, cdiv(K,BK), cdiv(N,BN)).
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
        tl.store(out_ptr + e.to(tl.int64) * stride_oe + ks[:, None] * stride_ok
                 + ns[None, :] * stride_on,
                 _round_to(acc, out_ptr.dtype.element_ty), mask=k_ok[:, None] & n_ok[None, :])


def _bounds(offsets_E):
    return torch.cat([offsets_E.new_zeros(1), offsets_E]).to(torch.int32)


def _blocks(a):
    # Small tiles in the interpreter (numpy is slow on big
    # tiles) and for tiny problems; tl.dot needs >= 16.
    return (16, 32, 32) if not a.is_cuda else (64, 64, 32)


def _precision(a):
    return "ieee" if a.dtype == torch.float32 else "tf32"  # fp32 stays exact-rounded fp32 (no TF32)


def grouped_mm_triton(a_MK, b_EKN, offsets_E):
    """Forward Triton grouped GEMM (no autograd). a [M, K], b [E, K, N] (any strides), offsets int32
    [E]."""
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
                             a_MK.stride(0), a_MK.stride(1),
                             *b_EKN.stride(), c.stride(0), c.stride(1),
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
    _grouped_wgrad_kernel[grid](a_MK, g_MN, out, _bounds(offsets_E), K, N,
                                a_MK.stride(0), a_MK.stride(1),
                                g_MN.stride(0), g_MN.stride(1), *out.stride(),
                                BLOCK_M=BM, BLOCK_K=BK, BLOCK_N=BN, PRECISION=_precision(a_MK))
    return out


# torch's grouped_mm and the per-segment weight-gradient, as opaque custom ops: torch.compile sees
# single nodes with known output shapes instead of tracing into them (grouped_mm's compile support
# covers bf16 only).
@torch.library.custom_op("minimind_kernels::grouped_mm", mutates_args=())
def _grouped_mm_op(a_MK: torch.Tensor, b_EKN: torch.Tensor,
                   offsets_E: torch.Tensor) -> torch.Tensor:
    return _TORCH_GROUPED_MM(a_MK, b_EKN, offs=offsets_E)


@_grouped_mm_op.register_fake
def _(a_MK, b_EKN, offsets_E):
    return a_MK.new_empty(a_MK.shape[0], b_EKN.shape[2])


def _segment_outer(lhs_MX, rhs_MY, offsets_E):
    """out[e] = lhs[rows of e]^T @ rhs[rows of e] -> [E, X, Y]."""
    return _TORCH_GROUPED_MM(lhs_MX.t(), rhs_MY, offs=offsets_E)


@torch.library.custom_op("minimind_kernels::segment_outer", mutates_args=())
def _segment_outer_op(lhs_MX: torch.Tensor, rhs_MY: torch.Tensor,
                      offsets_E: torch.Tensor) -> torch.Tensor:
    return _segment_outer(lhs_MX, rhs_MY, offsets_E)


@_segment_outer_op.register_fake
def _(lhs_MX, rhs_MY, offsets_E):
    return lhs_MX.new_empty(offsets_E.shape[0], lhs_MX.shape[1], rhs_MY.shape[1])


class GroupedOps(NamedTuple):
    """One backend's two grouped GEMMs: mm(a [M, K], b [E, K, N], offsets) -> [M, N] per segment;
    outer(lhs [M, X], rhs [M, Y], offsets) -> [E, X, Y], lhs_e^T @ rhs_e."""
    name: str
    mm: Callable
    outer: Callable


# backend -> its ops; "torch" calls torch's grouped_mm directly, "torch_compiled" through the custom
# ops above (a single graph node each; their Python dispatch costs ~30 us a call, paid only under
# torch.compile)
GROUPED_OPS = {"torch": GroupedOps("torch",
                                   getattr(torch, "_grouped_mm", None) or _TORCH_GROUPED_MM,
                                   _segment_outer),
               "torch_compiled": GroupedOps("torch_compiled", _grouped_mm_op, _segment_outer_op),
               "triton": GroupedOps("triton", grouped_mm_triton, grouped_wgrad_triton)}


def torch_grouped_mm_fits(device, dtype, hidden_size, intermediate_size) -> bool:
    """Whether torch's grouped_mm runs rows of `dtype` with these widths on `device`, forward and
    backward, decided from the shapes when the engine is chosen (fresh allocations and the
    parameters are 16-byte aligned): CPU fp32 / bf16, CUDA bf16 on sm >= 8.0; D and F times the
    element size multiples of 16 bytes."""
    size = torch.empty((), dtype=dtype).element_size()
    if _TORCH_GROUPED_MM is None or (hidden_size * size) % 16 or (intermediate_size * size) % 16:
        return False
    device = torch.device(device)
    if device.type == "cpu":
        return dtype in (torch.float32, torch.bfloat16)
    return (device.type == "cuda" and dtype == torch.bfloat16 and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device) >= (8, 0))


def scaled_swiglu_forward(gate_up_PF2, scale_P):
    """(h = silu(gate) * up * scale[:, None] for gate_up = [gate | up] in its dtype (products in
    promote(dtype, scale dtype), cast once), silu(gate) for backward)."""
    F_ = gate_up_PF2.shape[1] // 2
    silu_PF = F.silu(gate_up_PF2[:, :F_])
    h_PF = silu_PF * gate_up_PF2[:, F_:]
    acc = torch.promote_types(gate_up_PF2.dtype, scale_P.dtype)
    if acc != h_PF.dtype:
        return (h_PF.to(acc) * scale_P.to(acc).unsqueeze(1)).to(gate_up_PF2.dtype), silu_PF
    if torch.compiler.is_compiling():  # (out of place: torch 2.11's compile drops the grad)
        return h_PF * scale_P.unsqueeze(1), silu_PF
    return h_PF.mul_(scale_P.unsqueeze(1)), silu_PF


def scaled_swiglu_backward(grad_PF, gate_up_PF2, silu_PF, scale_P, need_scale_grad=True):
    """(grad_gate_up [P, 2F] in gate_up's dtype, grad_scale [P] in scale's dtype or None) of
    scaled_swiglu_forward: with v = grad * up, d scale = sum_f v * silu(gate), d up = grad * scale *
    silu(gate), d gate = silu'(gate) * v * scale (aten's fused silu_backward)."""
    F_ = gate_up_PF2.shape[1] // 2
    gate, up = gate_up_PF2[:, :F_], gate_up_PF2[:, F_:]
    acc = torch.promote_types(gate_up_PF2.dtype, scale_P.dtype)
    scale_P1 = scale_P.to(acc).unsqueeze(1)
    v_PF = grad_PF.to(acc) * up
    grad_scale = (torch.linalg.vecdot(v_PF, silu_PF.to(acc)).to(scale_P.dtype) if need_scale_grad
                  else None)
    # the compiler fuses; no out= views
    if torch.compiler.is_compiling() or acc != gate_up_PF2.dtype:
        grad = torch.cat([torch.ops.aten.silu_backward(v_PF * scale_P1, gate.to(acc)),
                          grad_PF.to(acc) * scale_P1 * silu_PF], dim=1).to(gate_up_PF2.dtype)
        return grad, grad_scale
    grad = torch.empty_like(gate_up_PF2)
    torch.mul(grad_PF, silu_PF, out=grad[:, F_:]).mul_(scale_P1)
    torch.ops.aten.silu_backward.grad_input(v_PF.mul_(scale_P1), gate, grad_input=grad[:, :F_])
    return grad, grad_scale


class GroupedSwiGLU(torch.autograd.Function):
    """y_PD = down_e(silu(gate_e(x)) * up_e(x) * s) for the expert-sorted rows of every expert e, by
    two grouped GEMMs of `ops` (a GroupedOps) and the SwiGLU between them, forward and backward in
    one Function (so the experts engine reaches the GEMM in one frame). apply(x_PD [P, D],
    w_gate_up_E2FD [E, 2F, D] (gate_proj then up_proj weight, nn.Linear layout), w_down_EDF
    [E, D, F], offsets_E int32 [E] cumulative row counts, row_scale_P [P] the factor s (routing
    weights), ops), all of x's dtype. Differentiable in x, the weights and s; the routing weight's
    gradient is a dot over F rather than D."""

    @staticmethod
    def forward(ctx, x_PD, w_gate_up_E2FD, w_down_EDF, offsets_E, row_scale_P, ops):
        gate_up_PF2 = ops.mm(x_PD, w_gate_up_E2FD.transpose(1, 2), offsets_E)
        h_PF, silu_PF = scaled_swiglu_forward(gate_up_PF2, row_scale_P)
        ctx.ops = ops
        ctx.save_for_backward(x_PD, w_gate_up_E2FD, w_down_EDF, offsets_E, row_scale_P,
                              gate_up_PF2, silu_PF, h_PF)
        return ops.mm(h_PF, w_down_EDF.transpose(1, 2), offsets_E)

    @staticmethod
    @first_order_only
    def backward(ctx, grad_PD):
        (x_PD, w_gate_up_E2FD, w_down_EDF, offsets_E, row_scale_P, gate_up_PF2, silu_PF,
         h_PF) = ctx.saved_tensors
        mm, outer, need = ctx.ops.mm, ctx.ops.outer, ctx.needs_input_grad
        grad_PD = grad_PD.contiguous()
        grad_h_PF = mm(grad_PD, w_down_EDF, offsets_E)
        grad_w_down = outer(grad_PD, h_PF, offsets_E) if need[2] else None
        grad_gate_up_PF2, grad_scale = scaled_swiglu_backward(grad_h_PF, gate_up_PF2, silu_PF,
                                                              row_scale_P, need[4])
        grad_w_gate_up = outer(grad_gate_up_PF2, x_PD, offsets_E) if need[1] else None
        grad_x = mm(grad_gate_up_PF2, w_gate_up_E2FD, offsets_E) if need[0] else None
        return grad_x, grad_w_gate_up, grad_w_down, None, grad_scale, None
