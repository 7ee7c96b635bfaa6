"""MoE layer benchmark: every implementation side by side, on the same weights and inputs, in one run.

    python scripts/bench/bench_moe.py              # CPU (or CUDA when present), fp32; a few minutes on 2 cores
    python scripts/bench/bench_moe.py --quick      # one shape, fewer rounds
    python scripts/bench/bench_moe.py --device cuda --dtype bfloat16 --out results.txt

Implementations:
  masked      MiniMind's per-expert masked loop (scripts/moe_reference.py), the bitwise reference
  sorted      ours, moe_impl="sorted": one host sync per layer, bitwise equal to masked
  fused       ours, moe_impl="fused" built with train/engines.py's engines (the experts engine and the
              kernels' permute / combine): zero syncs, grouped GEMM and Triton permute/combine on CUDA; on CPU
              its experts run as oneDNN expert GEMMs (kernels/experts.py: CPUExperts)
  fused-grouped
              (CPU, where the expert GEMMs run) the same layer with the grouped-GEMM experts engine (torch's
              CPU grouped_mm): the row that tells whether the expert GEMMs pay for themselves
  hf-eager, hf-grouped_mm, hf-batched_mm
              transformers' Qwen3MoeSparseMoeBlock with each `experts_implementation` (same weights,
              converted to its fused gate_up layout)
  dense       the SwiGLU FFN of equal active FLOPs: width k*F, built from the first k experts' weights
  dense-onednn
              (CPU) the same dense FFN with each of its nn.Linear GEMMs (forward and backward) run by oneDNN,
              the engine our CPU path uses: torch's own CPU matmul goes through MKL, which on some CPUs
              (e.g. AMD EPYC) runs far below oneDNN, so this row shows how much of our lead over `dense`
              is the GEMM engine and how much is the MoE layer itself

Times are medians over rounds run round-robin (drift hits every implementation alike); "fwd" runs under
torch.no_grad, "fwd+bwd" is a training step's forward and backward. Each time is printed as a ratio to
dense (lower is better); absolute times on shared machines are noise. Peak memory is the most bytes live
during one fwd+bwd above what was live before it (CUDA allocator stats, or the CPU profiler's allocation
events). On CUDA, TFLOP/s counts the expert GEMMs (6*N*k*D*F per forward, 3x that for fwd+bwd) and
% peak compares to the device's dense bf16 peak. hf-batched_mm copies one weight matrix per routed pair
(k*N*3*D*F values), so it is skipped where that would not fit in --batched_mm_limit_gb.
"""
import contextlib
import json
import os
import statistics
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))  # scripts/bench
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), os.path.dirname(HERE)]  # the repository, scripts/

import torch  # noqa: E402

from moe_reference import reference_masked_forward  # noqa: E402
from sync_count import count_syncs  # noqa: E402
from kernels.cpu_linear import _OneDNNLinear, onednn_runs  # noqa: E402  (the oneDNN linear, forward + backward)
from kernels.experts import cpu_experts_for  # noqa: E402
from train.engines import engines_for, grouped_experts_for  # noqa: E402
from train.threads import keep_freed_memory  # noqa: E402
from model.model_minimind import FeedForward, MiniMindConfig, MOEFeedForward  # noqa: E402

SHAPES = [  # name, hidden D, experts E, top-k, expert width F
    ("small", 256, 4, 1, 512),  # F = 2D
    ("minimind", 512, 8, 2, 1664),  # F = MiniMind's default width for D=512 (ceil(pi*D/64)*64)
    ("many-experts", 512, 64, 8, 256),  # fine-grained experts (F = D/2; Qwen3-MoE uses 0.375 D)
]
PEAK_BF16_TFLOPS = {"H200": 989, "H100": 989, "H800": 989, "A100": 312, "A800": 312, "L40S": 362, "4090": 165}
IMPLS = ["dense", "dense-onednn", "masked", "sorted", "fused", "fused-grouped", "hf-eager", "hf-grouped_mm",
         "hf-batched_mm"]


def dense_equivalent(moe):
    """SwiGLU FFN of width k*F whose weights are the first k experts' weights stacked."""
    cfg = moe.config
    k, f = cfg.num_experts_per_tok, cfg.moe_intermediate_size
    dense = FeedForward(cfg.hidden_size, k * f)
    with torch.no_grad():
        experts = [expert.weights() for expert in list(moe.experts)[:k]]
        dense.gate_proj.weight.copy_(torch.cat([gate for gate, _, _ in experts], 0))
        dense.up_proj.weight.copy_(torch.cat([up for _, up, _ in experts], 0))
        dense.down_proj.weight.copy_(torch.cat([down for _, _, down in experts], 1))
    return dense


class DenseOneDNN(torch.nn.Module):
    """`dense` with its three linears run by oneDNN (same weights, same autograd for the SwiGLU)."""

    def __init__(self, dense):
        super().__init__()
        self.dense = dense

    def forward(self, x):
        x2 = x.reshape(-1, x.shape[-1])
        lin = lambda t, m: _OneDNNLinear.apply(t, m.weight)  # noqa: E731  (any dtype oneDNN runs)
        d = self.dense
        return lin(torch.nn.functional.silu(lin(x2, d.gate_proj)) * lin(x2, d.up_proj), d.down_proj).view_as(x)


def hf_block(moe, implementation):
    """transformers' Qwen3-MoE sparse block holding `moe`'s weights, running `implementation`."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    c = moe.config
    cfg = Qwen3MoeConfig(hidden_size=c.hidden_size, num_experts=c.num_experts,
                         num_experts_per_tok=c.num_experts_per_tok,
                         moe_intermediate_size=c.moe_intermediate_size, norm_topk_prob=c.norm_topk_prob,
                         hidden_act="silu", num_attention_heads=1, num_key_value_heads=1, head_dim=8)
    cfg._experts_implementation = implementation
    block = Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        block.gate.weight.copy_(moe.gate.weight)
        block.experts.gate_up_proj.copy_(moe.experts.gate_up_proj)  # (the same stacked layout)
        block.experts.down_proj.copy_(moe.experts.down_proj)
    return block


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def time_once(fn, x, backward, device, autocast):
    xi = x.detach().requires_grad_(backward)
    sync(device)
    t0 = time.perf_counter()
    with torch.set_grad_enabled(backward), autocast():
        y = fn(xi)
    if backward:
        y.float().sum().backward()
    sync(device)
    return time.perf_counter() - t0


@contextlib.contextmanager
def quiet_fds():
    """Silence the profiler's C++ start/stop chatter (written straight to fds 1 and 2)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved + [devnull]:
            os.close(fd)


def kernel_profile(fn, x, device, autocast, rows=30):
    """torch.profiler's table of 3 fwd+bwd of fn(x) after a warm-up, by device time: where the time goes."""
    from torch.profiler import ProfilerActivity, profile
    time_once(fn, x, True, device, autocast)
    cuda = device == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(3):
            time_once(fn, x, True, device, autocast)
    return prof.key_averages().table(sort_by="cuda_time_total" if cuda else "self_cpu_time_total", row_limit=rows)


def peak_bytes(fn, x, device, autocast):
    """Most bytes live during one fwd+bwd of fn(x), above what was live before."""
    xi = x.detach().requires_grad_(True)

    def step():
        with autocast():
            y = fn(xi)
        y.float().sum().backward()

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile
    with quiet_fds(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def device_peak_tflops(device):
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def main(argv=None):
    from train.flags import AT_LEAST_0, POSITIVE, Parser, add
    p = Parser(description=__doc__)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="autocast dtype")
    p.add_argument("--tokens", default="256,4096", help="comma-separated token counts N")
    add(p, "--repeats", allowed=AT_LEAST_0, type=int, default=0, help="timed rounds per cell (0 = auto)")
    p.add_argument("--quick", action="store_true", help="one shape, fewer rounds")
    p.add_argument("--shapes", default="", help="comma-separated shape names to run (default: all)")
    p.add_argument("--impls", default=",".join(IMPLS), help="comma-separated implementations")
    add(p, "--batched_mm_limit_gb", allowed=POSITIVE, type=float, default=3.0,
        help="skip hf-batched_mm where its per-pair weight copies exceed this [GiB]")
    p.add_argument("--out", default="", help="also append the report to this file")
    p.add_argument("--json", default="", help="also write the medians to this file")
    p.add_argument("--profile", default="", help="write each cell's fwd+bwd op profile (fused, dense) here")
    p.add_argument("--os_malloc", action="store_true",
                   help="leave glibc's default thresholds (freed big blocks go back to the OS; see keep_freed_memory)")
    args = p.parse_args(argv)
    tuned = False
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    ptdtype = getattr(torch, args.dtype)
    warnings.filterwarnings("ignore", message=".*grouped_mm.*")
    warnings.filterwarnings("ignore", message=".*no gradient from the language-model loss.*")  # small: k=1
    out_file = open(args.out, "a") if args.out else None

    def say(line=""):
        print(line, flush=True)
        if out_file:
            out_file.write(line + "\n")
            out_file.flush()

    def autocast():
        return torch.autocast(device, dtype=ptdtype, enabled=ptdtype != torch.float32)

    shapes = SHAPES[1:2] if args.quick else SHAPES
    if args.shapes:
        shapes = [s for s in SHAPES if s[0] in args.shapes.split(",")]
    token_counts = [int(t) for t in args.tokens.split(",")]
    wanted = [i for i in IMPLS if i in args.impls.split(",")]
    if "dense" not in wanted:
        wanted.insert(0, "dense")
    peak = device_peak_tflops(device)
    if device == "cpu" and not args.os_malloc:
        tuned = keep_freed_memory()
    say(f"torch {torch.__version__}, device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, "
        f"{args.dtype}, threads {torch.get_num_threads()}"
        + (", freed memory kept for reuse (mallopt)" if tuned else ""))
    say("each cell: median ms, then (ratio to dense); syncs = sync-inducing calls per forward (on CPU, fused "
        "reads its per-expert row counts from CPU memory for oneDNN: a memory read, not a sync)\n")
    summary, figures, profiles = [], {}, []
    for name, d, e, k, f in shapes:
        torch.manual_seed(0)
        # Aux loss off: transformers' block computes none (its model does, from the router logits), nor
        # does the masked loop, so every implementation does the same work.
        cfg = dict(hidden_size=d, num_attention_heads=1, num_key_value_heads=1, head_dim=8, use_moe=True,
                   num_experts=e, num_experts_per_tok=k, moe_intermediate_size=f, router_aux_loss_coef=0.0)
        moe = MOEFeedForward(MiniMindConfig(**cfg)).to(device).train()
        fused_cfg = MiniMindConfig(**cfg, moe_impl="fused")
        engines = engines_for(fused_cfg, device, ptdtype)  # the trainer's engines for the fused path
        fused = MOEFeedForward(fused_cfg, engines.experts, engines.movers, engines.linear).to(device).train()
        fused.load_state_dict(moe.state_dict())
        onednn = onednn_runs(device, torch.float32)
        cpu_gemms = engines.experts is cpu_experts_for(ptdtype)
        # the fused layer with the grouped-GEMM engine where the CPU expert GEMMs would run
        grouped = MOEFeedForward(fused_cfg, grouped_experts_for(device, ptdtype, d, f), engines.movers,
                                 engines.linear).to(device).train()
        grouped.load_state_dict(moe.state_dict())
        builders = {"dense": lambda: dense_equivalent(moe).to(device).train(),
                    "dense-onednn": lambda: DenseOneDNN(dense_equivalent(moe)).to(device).train(),
                    "masked": lambda: (lambda t: reference_masked_forward(moe, t)),
                    "sorted": lambda: moe, "fused": lambda: fused, "fused-grouped": lambda: grouped,
                    "hf-eager": lambda: hf_block(moe, "eager").to(device).train(),
                    "hf-grouped_mm": lambda: hf_block(moe, "grouped_mm").to(device).train(),
                    "hf-batched_mm": lambda: hf_block(moe, "batched_mm").to(device).train()}
        impls = {key: builders[key]() for key in wanted
                 if (key != "dense-onednn" or onednn) and (key != "fused-grouped" or cpu_gemms)}
        for n in token_counts:
            x = torch.randn(1, n, d, device=device)
            cell = dict(impls)
            batched_gb = n * k * 3 * d * f * x.element_size() * 2 / 2**30  # weight copies, fwd + their grads
            if "hf-batched_mm" in cell and batched_gb > args.batched_mm_limit_gb:
                del cell["hf-batched_mm"]
            with torch.no_grad(), autocast():
                ref = moe(x)  # the sorted layer, whether or not it is timed
                if "masked" in impls:
                    assert torch.equal(impls["masked"](x), ref), "sorted != masked reference"
                if "dense-onednn" in cell:
                    err = (cell["dense-onednn"](x).float() - cell["dense"](x).float()).abs().max().item()
                    assert err < (1e-4 if ptdtype == torch.float32 else 5e-2), f"dense-onednn differs by {err}"
                for key in cell:
                    if key.startswith("hf") or key.startswith("fused"):
                        err = (cell[key](x).float() - ref.float()).abs().max().item()
                        assert err < (1e-4 if ptdtype == torch.float32 else 5e-2), f"{key} differs by {err}"
            syncs = {key: count_syncs(fn, x)[1] for key, fn in cell.items()}
            work = n * d * f * k
            rounds = args.repeats or max(5, min(25, int(1e10 / work)))
            if args.quick:
                rounds = min(rounds, 3)
            mems = {key: peak_bytes(fn, x, device, autocast) / 2**20 for key, fn in cell.items()}
            say(f"== {name} (D={d}, E={e}, k={k}, F={f}), N={n}, {rounds} rounds")
            say(f"{'impl':<15}{'fwd ms':>9}{'(xdense)':>9}{'fwd+bwd ms':>12}{'(xdense)':>9}{'peak MiB':>10}"
                f"{'syncs':>7}" + (f"{'TFLOP/s':>9}{'% peak':>8}" if device == "cuda" else ""))
            med = {}
            for backward in (False, True):
                times = {key: [] for key in cell}
                for key, fn in cell.items():  # warm-up
                    time_once(fn, x, backward, device, autocast)
                for _ in range(rounds):
                    for key, fn in cell.items():
                        times[key].append(time_once(fn, x, backward, device, autocast))
                    for fn in cell.values():
                        if isinstance(fn, torch.nn.Module):
                            fn.zero_grad(set_to_none=True)
                    moe.zero_grad(set_to_none=True)
                for key, v in times.items():
                    med[key, backward] = statistics.median(v) * 1e3
            figures[f"{name} N={n}"] = {key: {"fwd_ms": med[key, False], "fwd_bwd_ms": med[key, True],
                                              "fwd_bwd_vs_dense": med[key, True] / med["dense", True]} for key in cell}
            if args.profile:
                profiles += [f"== {name} (D={d}, E={e}, k={k}, F={f}), N={n}, {key}: fwd+bwd x 3, by {device} time\n"
                             + kernel_profile(cell[key], x, device, autocast)
                             for key in ("fused", "dense") if key in cell]
            for key in wanted:
                if (key == "dense-onednn" and not onednn) or (key == "fused-grouped" and not cpu_gemms):
                    continue
                if key not in cell:
                    say(f"{key:<15}   skipped: per-pair weight copies need ~{batched_gb:.0f} GiB")
                    continue
                fw, fb = med[key, False], med[key, True]
                line = (f"{key:<15}{fw:>9.2f}{fw / med['dense', False]:>8.2f}x"
                        f"{fb:>12.2f}{fb / med['dense', True]:>8.2f}x"
                        f"{mems[key]:>10.0f}{syncs[key]:>7}")
                if device == "cuda":
                    tflops = 3 * 6 * n * k * d * f / (fb * 1e-3) / 1e12
                    line += f"{tflops:>9.1f}" + (f"{100 * tflops / peak:>7.1f}%" if peak else f"{'n/a':>8}")
                say(line)
            if "fused-grouped" in cell and "fused" in cell:
                say("CPU expert GEMMs: fused-grouped / fused = "
                    f"{med['fused-grouped', False] / med['fused', False]:.3f} fwd, "
                    f"{med['fused-grouped', True] / med['fused', True]:.3f} fwd+bwd "
                    "(> 1: the per-expert GEMMs are faster)")
            ours = min(med["sorted", True], med["fused", True]) if "fused" in cell and "sorted" in cell else None
            if ours is not None:
                hf = {key: med[key, True] for key in cell if key.startswith("hf")}
                engine = ours / med["dense-onednn", True] if "dense-onednn" in cell else None
                summary.append((name, n, ours / med["dense", True], engine, {key: v / ours for key, v in hf.items()}))
            say()
    if summary:
        say("fwd+bwd summary: best of ours (sorted, fused) vs dense (and vs dense-onednn, the same GEMM engine), "
            "and each transformers implementation's time as a multiple of ours (> 1 = ours faster)")
        for name, n, vs_dense, vs_engine, vs_hf in summary:
            say(f"  {name:<13} N={n:<5} ours/dense {vs_dense:.2f}x" +
                (f"  ours/dense-onednn {vs_engine:.2f}x" if vs_engine is not None else "") + "   " +
                "  ".join(f"{key} {v:.2f}x" for key, v in vs_hf.items()))
    if out_file:
        out_file.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "dtype": args.dtype, "peak_tflops": peak, "cells": figures}, f, indent=1)
    if profiles:
        with open(args.profile, "w") as f:
            f.write("\n\n".join(profiles) + "\n")


if __name__ == "__main__":
    main()
