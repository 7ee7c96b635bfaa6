"""Engine choices a CPU run makes once, at setup, from what the machine it runs on measures (not from the
CPU's name): the autocast dtype (`--dtype auto`), then the attention kernel (`--attn_impl auto`) from that
dtype. Each choice is logged. The dtype's measurement runs at a fixed shape with a wide margin (native
bf16 GEMMs run ~2x fp32 or more, emulated ones far below 1x), so one machine always gives the same answer
and runs of the same command round the same; with several ranks all take the most conservative answer.
Figures in comments: 2-core AMD EPYC with AVX512-BF16, torch 2.13 (`scripts/bench_step.py`)."""
import torch
import torch.distributed as dist

from kernels.cpu_linear import bf16_gemm_speedup

# bf16 autocast must also pay for its casts and its slower non-GEMM ops: bf16 GEMMs measured 2.0x fp32,
# the whole main-job step ~1.3x
BF16_MIN_SPEEDUP = 1.5


def agree(ctx, yes: bool) -> bool:
    """True on every rank only when it is True on every rank."""
    flag = torch.tensor(int(yes))
    if ctx.distributed:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def bf16_pays():
    """(whether bf16 autocast pays on this CPU, the measured speedup): a 1024 x 512 x 2048 GEMM in bf16 at
    least BF16_MIN_SPEEDUP x as fast as in fp32 (native bf16: AVX512-BF16 or AMX). bf16 without native
    kernels is emulated and slower."""
    speedup = bf16_gemm_speedup(1024, 512, 2048, reps=5)
    return speedup >= BF16_MIN_SPEEDUP, speedup


def cpu_dtype(ctx, log):
    """--dtype auto on CPU: bf16 autocast where `bf16_pays`, else fp32."""
    pays, speedup = bf16_pays()
    name = "bfloat16" if agree(ctx, pays) else "float32"
    log(f"dtype auto: {name} (bf16 GEMMs {speedup:.1f}x as fast as fp32 on this CPU; bf16 needs >= {BF16_MIN_SPEEDUP}x)")
    return name


def cpu_attention(dtype, log):
    """--attn_impl auto on CPU: "explicit" under bf16 autocast, where torch's fused CPU attention kernel is
    slow (measured fwd+bwd at the main job's shape: explicit 2.8x as fast in bf16, 0.8x in fp32), else
    "sdpa". A rule on the measured dtype rather than a per-run timing, so two runs of one command on one
    machine always pick the same kernel (and round the same)."""
    name = "explicit" if dtype == torch.bfloat16 else "sdpa"
    log(f"attn_impl auto: {name} ({'bf16 autocast' if name == 'explicit' else 'no bf16'} on CPU)")
    return name
