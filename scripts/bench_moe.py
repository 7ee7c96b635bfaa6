"""MoE layer benchmark: masked per-expert reference vs our sorted layer vs the dense SwiGLU FFN of equal
active FLOPs, on the same weights and inputs, measured side by side (round-robin) in one run.

    python scripts/bench_moe.py              # CPU (or CUDA when present), fp32, ~1-2 min on 2 cores
    python scripts/bench_moe.py --quick      # fewer shapes/repeats
    python scripts/bench_moe.py --device cuda --dtype bfloat16

The dense FFN has intermediate size k * moe_intermediate_size and is built from the first k experts'
weights stacked, so its FLOPs equal the MoE layer's active expert FLOPs (the router is extra for MoE).
Times are medians; what matters is the ratios, since absolute times on shared machines are noise.
"""
import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import torch  # noqa: E402

from moe_reference import reference_masked_forward  # noqa: E402
from sync_count import count_syncs  # noqa: E402
from model.model_minimind import FeedForward, MiniMindConfig, MOEFeedForward  # noqa: E402

SHAPES = [  # name, hidden D, experts E, top-k, expert width F
    ("small", 256, 4, 1, 512),
    ("minimind", 512, 8, 2, 512),
    ("many-experts", 256, 32, 4, 128),
]


def dense_equivalent(moe):
    """SwiGLU FFN of width k*F whose weights are the first k experts' weights stacked."""
    cfg = moe.config
    k, f = cfg.num_experts_per_tok, cfg.moe_intermediate_size
    dense = FeedForward(cfg.hidden_size, k * f)
    with torch.no_grad():
        experts = moe.experts[:k]
        dense.gate_proj.weight.copy_(torch.cat([e.gate_proj.weight for e in experts], 0))
        dense.up_proj.weight.copy_(torch.cat([e.up_proj.weight for e in experts], 0))
        dense.down_proj.weight.copy_(torch.cat([e.down_proj.weight for e in experts], 1))
    return dense


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def time_once(fn, x, backward, device, autocast):
    xi = x.detach().requires_grad_(backward)
    sync(device)
    t0 = time.perf_counter()
    with autocast():
        y = fn(xi)
    if backward:
        y.float().sum().backward()
    sync(device)
    return time.perf_counter() - t0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="autocast dtype")
    p.add_argument("--tokens", default="512,4096", help="comma-separated token counts N")
    p.add_argument("--repeats", type=int, default=0, help="timed rounds per cell (0 = auto)")
    p.add_argument("--quick", action="store_true", help="one shape, fewer rounds")
    args = p.parse_args()
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    ptdtype = getattr(torch, args.dtype)

    def autocast():
        return torch.autocast(device, dtype=ptdtype, enabled=ptdtype != torch.float32)

    shapes = SHAPES[1:2] if args.quick else SHAPES
    token_counts = [int(t) for t in args.tokens.split(",")]
    print(f"torch {torch.__version__}, device {device}, {args.dtype}, threads {torch.get_num_threads()}")
    print("ratios are time / dense-equivalent FFN time (lower is better); 'speedup' = masked / sorted\n")
    hdr = (f"{'shape':<13}{'N':>6} {'pass':<8}{'dense ms':>9}{'masked ms':>10}{'sorted ms':>10}"
           f"{'masked/dense':>13}{'sorted/dense':>13}{'speedup':>8}{'syncs m/s':>10}")
    print(hdr)
    print("-" * len(hdr))
    for name, d, e, k, f in shapes:
        torch.manual_seed(0)
        moe = MOEFeedForward(MiniMindConfig(hidden_size=d, num_attention_heads=1, num_key_value_heads=1,
                                            head_dim=8, use_moe=True, num_experts=e, num_experts_per_tok=k,
                                            moe_intermediate_size=f)).to(device).train()
        dense = dense_equivalent(moe).to(device).train()
        impls = {"dense": dense, "masked": lambda t: reference_masked_forward(moe, t), "sorted": moe}
        for n in token_counts:
            x = torch.randn(1, n, d, device=device)
            with torch.no_grad(), autocast():
                assert torch.equal(impls["masked"](x), moe(x)), "sorted != masked reference"
            _, s_masked = count_syncs(impls["masked"], x)
            _, s_sorted = count_syncs(moe, x)
            work = n * d * f * k
            rounds = args.repeats or max(3, min(15, int(4e9 / work)))
            if args.quick:
                rounds = min(rounds, 3)
            for backward in (False, True):
                times = {key: [] for key in impls}
                for key, fn in impls.items():  # warm-up
                    time_once(fn, x, backward, device, autocast)
                for _ in range(rounds):  # round-robin so drift hits every implementation alike
                    for key, fn in impls.items():
                        times[key].append(time_once(fn, x, backward, device, autocast))
                    moe.zero_grad(set_to_none=True)
                    dense.zero_grad(set_to_none=True)
                med = {key: statistics.median(v) * 1e3 for key, v in times.items()}
                print(f"{name:<13}{n:>6} {'fwd+bwd' if backward else 'fwd':<8}{med['dense']:>9.2f}{med['masked']:>10.2f}"
                      f"{med['sorted']:>10.2f}{med['masked'] / med['dense']:>13.2f}{med['sorted'] / med['dense']:>13.2f}"
                      f"{med['masked'] / med['sorted']:>8.2f}{f'{s_masked}/{s_sorted}':>10}", flush=True)
    if device == "cuda":
        print(f"\npeak memory {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
