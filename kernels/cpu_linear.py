"""y = x @ W^T on CPU through oneDNN, forward and backward: the model's fixed-shape linear layers.

torch's fp32 CPU matmul (`F.linear`, `mm`) goes through MKL, which on some CPUs runs far below the
hardware: on this repo's 2-core AMD EPYC (AVX-512), MKL sgemm reaches ~105 GFLOP/s on the model's shapes
and oneDNN ~240 (`scripts/bench_step.py` measures both on the machine it runs on). Under bf16 autocast
torch already sends `F.linear` to oneDNN, so this module only changes the fp32 path.

Used by the attention projections, the LM head and the dense FFN (`MiniMindConfig.linear_backend`): their
row count is the same every step (batch x sequence), so oneDNN builds each GEMM's kernel once. The MoE
experts keep their own engines (`model/experts.py`): the sorted path's per-expert `nn.Linear` calls are the
masked reference's (the bitwise contract), and the fused path runs oneDNN on bucketed row counts.

Numerics: the same products, summed in oneDNN's order instead of MKL's: fp32 results differ from
`F.linear` by rounding only (`scripts/test_kernels.py` checks within 1e-5 relative, forward and backward).
"""
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from kernels.grouped_gemm import _onednn_linear, onednn_runs

BACKENDS = ("auto", "onednn", "torch")


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK, w_NK):
        ctx.save_for_backward(x_MK, w_NK)
        return _onednn_linear(x_MK, w_NK)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_MN):
        x_MK, w_NK = ctx.saved_tensors
        grad_x = _onednn_linear(grad_MN, w_NK.t()) if ctx.needs_input_grad[0] else None  # [M, K]
        grad_w = _onednn_linear(grad_MN.t(), x_MK.t()) if ctx.needs_input_grad[1] else None  # [N, K]
        return grad_x, grad_w


def onednn_linear_fits(x, weight) -> bool:
    """Whether `linear` takes the oneDNN path for these operands: CPU fp32 tensors outside autocast (bf16
    autocast already reaches oneDNN through F.linear), this torch built with oneDNN, not while
    torch.compile traces (inductor plans its own GEMMs)."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and weight.device.type == "cpu" and onednn_runs(x.device, x.dtype)
            and not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling())


def linear(x_MK, weight_NK, backend="auto"):
    """F.linear(x, weight) without bias, x [..., K] -> [..., N], on the engine `backend` names.

    backend: "auto" = oneDNN where `onednn_linear_fits`, else F.linear; "onednn" = oneDNN or ValueError
    where it does not fit; "torch" = F.linear always. Differentiable in x and weight.
    """
    if backend not in BACKENDS:
        raise ValueError(f"linear backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch" or not onednn_linear_fits(x_MK, weight_NK):
        if backend == "onednn":
            raise ValueError(f"linear: the oneDNN backend needs CPU fp32 operands outside autocast and a torch "
                             f"with oneDNN, got {x_MK.dtype} x {weight_NK.dtype} on {x_MK.device}")
        return F.linear(x_MK, weight_NK)
    lead, K = x_MK.shape[:-1], x_MK.shape[-1]
    y = _OneDNNLinear.apply(x_MK.reshape(-1, K), weight_NK)
    return y.view(*lead, weight_NK.shape[0])


class Linear(nn.Linear):
    """nn.Linear without bias whose forward runs `linear(x, weight, backend)`; same parameters and
    state_dict keys as nn.Linear (so HF export, tying and init see a plain nn.Linear)."""

    def __init__(self, in_features: int, out_features: int, backend: str = "auto"):
        super().__init__(in_features, out_features, bias=False)
        if backend not in BACKENDS:
            raise ValueError(f"Linear backend must be one of {BACKENDS}, got {backend!r}")
        self.backend = backend

    def forward(self, x):
        return linear(x, self.weight, self.backend)

    def extra_repr(self):
        return super().extra_repr() + f", backend={self.backend}"


def bf16_gemm_speedup(M, K, N, reps=3):
    """fp32 time / bf16 time of one [M, K] x [K, N]^T GEMM through oneDNN on this CPU (best of `reps`
    each, after one warm-up call): how much bf16 autocast speeds up the matrix work. 0.0 where oneDNN has
    no native bf16 kernels here (then bf16 would be emulated, slower than fp32). Takes ~0.1 s."""
    if not (onednn_runs("cpu", torch.float32) and onednn_runs("cpu", torch.bfloat16)):
        return 0.0
    gen = torch.Generator().manual_seed(0)  # its own generator: the caller's RNG stream stays untouched
    x, w = torch.randn(M, K, generator=gen), torch.randn(N, K, generator=gen)
    best = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = x.to(dtype), w.to(dtype)
        _onednn_linear(a, b)
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            _onednn_linear(a, b)
            times.append(time.perf_counter() - t)
        best[dtype] = min(times)
    return best[torch.float32] / max(best[torch.bfloat16], 1e-9)
