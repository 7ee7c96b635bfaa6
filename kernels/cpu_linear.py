"""y = x @ W^T on CPU through oneDNN (forward and input gradient; the weight gradient, a product of
two transposed operands, by torch.mm): the engine for the model's bias-free linears.

torch's fp32 CPU matmul goes through MKL, on some CPUs well below oneDNN
(`scripts/bench/bench_step.py`); bf16 autocast already reaches oneDNN, so only the fp32 path
changes. train/engines.py builds it into the attention projections, the LM head and the dense FFN
(fixed row counts: each GEMM's kernel is built once), never into the sorted path's experts (their
bitwise contract is nn.Linear's). fp32 results differ from `F.linear` by rounding only
(`scripts/test_kernels.py`: within 1e-5 relative of fp64, forward and backward).
"""

import torch
import torch.nn.functional as F
from torch import nn

from kernels.backend import first_order_only


def _probe_onednn():
    try:
        op = torch.ops.mkldnn._linear_pointwise
        if not torch.backends.mkldnn.is_available():
            return None
        if not torch.equal(op(torch.ones(2, 4), torch.ones(3, 4), None, "none", [], ""),
                           torch.full((2, 3), 4.0)):
            return None
        return op
    except (AttributeError, RuntimeError):
        return None


_ONEDNN_LINEAR = _probe_onednn()


def onednn_runs(device, dtype) -> bool:
    """Whether oneDNN matmuls run here: CPU, torch built with oneDNN, fp32 (or bf16 with native CPU
    support)."""
    if _ONEDNN_LINEAR is None or torch.device(device).type != "cpu":
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16
                                      and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def onednn_linear(x_MK, w_NK):
    """x @ w^T through oneDNN (no bias, no autograd)."""
    return _ONEDNN_LINEAR(x_MK, w_NK, None, "none", [], "")


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK, w_NK):
        ctx.save_for_backward(x_MK, w_NK)
        return onednn_linear(x_MK, w_NK)

    @staticmethod
    @first_order_only
    def backward(ctx, grad_MN):
        x_MK, w_NK = ctx.saved_tensors
        grad_x = onednn_linear(grad_MN, w_NK.t()) if ctx.needs_input_grad[0] else None  # [M, K]
        # [N, K]: MKL's GEMM reads the transposed operands in place, where oneDNN copies them first
        grad_w = torch.mm(grad_MN.t(), x_MK) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w


FEW_ROWS = 64  # at most this many rows outside autograd (decoding): MKL (oneDNN's per-call cost)


def onednn_linear_fits(x, weight) -> bool:
    """Whether `linear` takes the oneDNN path: CPU fp32 operands outside autocast, oneDNN built in,
    not while torch.compile traces (inductor plans its own GEMMs), and not for at most FEW_ROWS
    rows outside autograd (a decode step: oneDNN's fixed cost per call, tens of microseconds, is
    more than such a product takes in MKL; training and its evaluation keep one engine)."""
    if not torch.is_grad_enabled() and x.numel() <= FEW_ROWS * x.shape[-1]:
        return False
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and weight.device.type == "cpu" and onednn_runs(x.device, x.dtype)
            and not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling())


def linear(x_MK, weight_NK):
    """F.linear(x, weight) without bias, x [..., K] -> [..., N], through oneDNN where
    `onednn_linear_fits`."""
    if not onednn_linear_fits(x_MK, weight_NK):
        return F.linear(x_MK, weight_NK)
    lead, K = x_MK.shape[:-1], x_MK.shape[-1]
    return _OneDNNLinear.apply(x_MK.reshape(-1, K), weight_NK).view(*lead, weight_NK.shape[0])


class OneDNNLinear(nn.Linear):
    """The engine for a bias-free nn.Linear (train/engines.py): same parameters, forward through
    `linear`."""

    def forward(self, x):
        return linear(x, self.weight)

    def extra_repr(self):
        return f"{super().extra_repr()}, MKL for <= {FEW_ROWS} rows outside autograd"
