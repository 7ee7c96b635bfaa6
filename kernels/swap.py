"""The one place where faster engines replace parts of the plain model (torchtitan's model converters).

`swap_engines(model, device, dtype)` changes the class of modules to a subclass from here that overrides
one method, keeping every parameter, buffer and state_dict key, and returns what it swapped (the
trainer logs it). A model built outside the trainer is plain PyTorch; checkpoints and exports hold the
same tensors either way. Each swap and when it applies (decided by measured rules, not by the CPU's name):

    nn.Linear (bias-free, not router/experts)   -> OneDNNLinear     CPU fp32 (oneDNN beats MKL's sgemm)
    Attention.attend (SDPA)                     -> explicit scores  CPU under bf16 autocast
    MiniMindForCausalLM.lm_loss                 -> chunked CE       CPU (no fp32 [N, V] logits)
    RowMapDispatcher.permute / combine_rows     -> kernels.permute  always (Triton where it runs, else
                                                                   torch with gather backward passes)
    MOEFeedForward.run_experts (fused path)     -> expert GEMMs    CPU with oneDNN (fp32 / native bf16)
                                                -> grouped GEMM     elsewhere (torch's grouped_mm / Triton)
The sorted path keeps nn.Linear experts: its contract is bitwise equality with the masked loop.
Tolerances of each swap against the plain model: scripts/test_kernels.py and scripts/test_model.py.
"""
import torch
from torch import nn

from kernels.attention import explicit_attention
from kernels.cpu_experts import cpu_experts_run, expert_gemms
from kernels.cpu_linear import OneDNNLinear, bf16_gemm_speedup, onednn_runs
from kernels.grouped_gemm import grouped_swiglu
from kernels.linear_cross_entropy import linear_cross_entropy
from kernels.permute import Combine, Permute
from model.dispatch import RowMapDispatcher
from model.model_minimind import Attention, MiniMindForCausalLM
from model.moe import MOEFeedForward

BF16_MIN_SPEEDUP = 1.5  # bf16 autocast also pays for casts and slower non-GEMM ops: ask for a wide margin


class ExplicitAttention(Attention):
    attend = staticmethod(explicit_attention)


class ChunkedLossCausalLM(MiniMindForCausalLM):
    def lm_loss(self, h_BSD, labels_BS):
        return None, linear_cross_entropy(h_BSD.reshape(-1, h_BSD.shape[-1]), self.lm_head.weight, labels_BS.reshape(-1))


class KernelRowMapDispatcher(RowMapDispatcher):
    def permute(self, x_TD, rm):
        with torch.autocast(x_TD.device.type, enabled=False):  # the kernels take explicit dtypes
            return Permute.apply(x_TD, rm.token_of_row_P, rm.row_of_pair_TK, rm.has_holes, "auto")

    def combine_rows(self, rows_PD, rm):
        with torch.autocast(rows_PD.device.type, enabled=False):
            return Combine.apply(rows_PD, rm.token_of_row_P, rm.row_of_pair_TK, rm.has_holes, "auto", torch.float32)


class FusedExpertsMoE(MOEFeedForward):
    """run_experts of the fused path without a host read: the expert GEMMs on CPU, else grouped GEMMs."""

    def run_experts(self, d):
        if d.row_weight_P is None:  # (rows of the sorted dispatcher: the plain loop)
            return super().run_experts(d)
        experts = self.experts[d.first_expert:d.first_expert + d.tokens_per_expert.shape[0]]
        rows_PD = d.rows_PD
        with torch.autocast(rows_PD.device.type, enabled=False):  # the engines cast the weights themselves
            if cpu_experts_run(rows_PD.device, rows_PD.dtype):
                return expert_gemms(experts, rows_PD, d.tokens_per_expert, d.row_weight_P)
            w_gate_up_E2FD = torch.stack([torch.cat([ex.gate_proj.weight, ex.up_proj.weight]) for ex in experts])
            w_down_EDF = torch.stack([ex.down_proj.weight for ex in experts])
            offsets_E = torch.cumsum(d.tokens_per_expert, 0).to(torch.int32)
            return grouped_swiglu(rows_PD, w_gate_up_E2FD.to(rows_PD.dtype), w_down_EDF.to(rows_PD.dtype), offsets_E,
                                  d.row_weight_P)


def bf16_pays():
    """(whether bf16 autocast pays on this CPU, the measured speedup): a 1024 x 512 x 2048 GEMM in bf16 at
    least BF16_MIN_SPEEDUP x as fast as in fp32 (native bf16: AVX512-BF16 or AMX; emulated bf16 is slower).
    The margin is wide, so one machine always gives the same answer."""
    speedup = bf16_gemm_speedup(1024, 512, 2048, reps=5)
    return speedup >= BF16_MIN_SPEEDUP, speedup


def _swap(module, cls, done):
    if type(module) is not cls:
        module.__class__ = cls
        done[cls.__name__] = done.get(cls.__name__, 0) + 1


def swap_engines(model, device, dtype):
    """Swap the engines that pay on `device` ("cpu" | "cuda...") under autocast `dtype` (fp32 = none) into
    `model` in place (see the module doc). Returns {swapped class name: modules}."""
    cpu = torch.device(device).type == "cpu"
    done = {}
    moe_linears = {id(m) for moe in model.modules() if isinstance(moe, MOEFeedForward)  # (shared experts: dense)
                   for m in (moe.gate, *moe.experts.modules())}
    for m in list(model.modules()):
        if type(m) is nn.Linear and m.bias is None and id(m) not in moe_linears and cpu and dtype == torch.float32 \
                and onednn_runs("cpu", torch.float32):
            _swap(m, OneDNNLinear, done)
        elif type(m) is Attention and cpu and dtype == torch.bfloat16:
            _swap(m, ExplicitAttention, done)
        elif type(m) is MiniMindForCausalLM and cpu:
            _swap(m, ChunkedLossCausalLM, done)
        elif type(m) is MOEFeedForward and m.config.moe_impl == "fused":
            _swap(m, FusedExpertsMoE, done)
            if type(m.dispatcher) is RowMapDispatcher:
                _swap(m.dispatcher, KernelRowMapDispatcher, done)
    return done


def describe(done):
    """One log line for swap_engines' result."""
    return "engines: " + (", ".join(f"{name} x{n}" for name, n in done.items()) if done else "plain PyTorch")
