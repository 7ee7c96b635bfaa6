"""Training throughput of the MoE implementations on one small model: tokens/s of full optimizer steps
(forward, backward, AdamW) with moe_impl sorted vs fused vs MiniMind's masked loop, side by side.

    python scripts/bench/bench_train.py                      # the main job's model (D=256, 4 layers, E=4, k=2)
    python scripts/bench/bench_train.py --num_experts 16 --top_k 4 --steps 10
    python scripts/bench/bench_train.py --device cuda --dtype bfloat16

The three runs share initial weights and batches (random token ids: throughput does not depend on the
text). Steps run in rounds, one block of steps per implementation per round, so machine drift hits all
alike; the figure is total tokens / total time over the timed rounds. The masked run is the sorted model
with each MoE layer run by scripts/moe_reference.py's masked_layer_forward (the same routing and aux loss).
"""
import functools
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))  # scripts/bench
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), os.path.dirname(HERE)]  # the repository, scripts/

import torch  # noqa: E402

from kernels.engines import engines_for  # noqa: E402
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM  # noqa: E402
from moe_reference import masked_layer_forward  # noqa: E402


def main(argv=None):
    from train.flags import AT_LEAST_1, Parser, check_ranges, show_ranges
    p = Parser(description=__doc__)
    p.add_argument("--hidden_size", type=int, default=256)
    p.add_argument("--num_layers", type=int, default=4)
    p.add_argument("--num_experts", type=int, default=4)
    p.add_argument("--top_k", type=int, default=2)
    p.add_argument("--moe_intermediate_size", type=int, default=384)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--steps", type=int, default=5, help="timed steps per implementation per round")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ranges = dict.fromkeys(("hidden_size", "num_layers", "num_experts", "top_k", "moe_intermediate_size", "batch_size", "seq_len", "steps", "rounds"), AT_LEAST_1)
    show_ranges(p, ranges)
    args = p.parse_args(argv)
    check_ranges(p, args, ranges)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    ptdtype = getattr(torch, args.dtype)

    def make(impl):
        torch.manual_seed(0)
        cfg = MiniMindConfig(vocab_size=6400, hidden_size=args.hidden_size, num_hidden_layers=args.num_layers,
                             num_attention_heads=4, num_key_value_heads=2, use_moe=True, num_experts=args.num_experts,
                             num_experts_per_tok=args.top_k, moe_intermediate_size=args.moe_intermediate_size,
                             moe_impl="sorted" if impl == "masked" else impl)
        model = MiniMindForCausalLM(cfg, engines_for(cfg, device, ptdtype)).to(device).train()  # the trainer's engines
        if impl == "masked":  # MiniMind's loop in place of steps 3-5 of every MoE layer
            for layer in model.model.layers:
                layer.mlp.forward = functools.partial(masked_layer_forward, layer.mlp)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    runs = {impl: make(impl) for impl in ("masked", "sorted", "fused")}
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 6400, (args.batch_size, args.seq_len + 1), generator=g).to(device)
               for _ in range(args.steps)]

    def block(model, opt):
        for b in batches:
            with torch.autocast(device, dtype=ptdtype, enabled=ptdtype != torch.float32):
                out = model(b[:, :-1], labels=b[:, 1:])
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()

    for model, opt in runs.values():  # warm-up (allocator, kernels, Triton compilation)
        block(model, opt)
    spent = {impl: 0.0 for impl in runs}
    for _ in range(args.rounds):
        for impl, (model, opt) in runs.items():
            t0 = time.perf_counter()
            block(model, opt)
            spent[impl] += time.perf_counter() - t0
    tokens = args.rounds * args.steps * args.batch_size * args.seq_len
    print(f"torch {torch.__version__}, {device}, {args.dtype}, threads {torch.get_num_threads()}; model D={args.hidden_size} "
          f"L={args.num_layers} E={args.num_experts} k={args.top_k} F={args.moe_intermediate_size}, batch "
          f"{args.batch_size}x{args.seq_len}, {args.rounds} rounds x {args.steps} steps each")
    base = tokens / spent["masked"]
    for impl, s in spent.items():
        print(f"  {impl:<7} {tokens / s:>10,.0f} tokens/s   {tokens / s / base:5.2f}x masked")


if __name__ == "__main__":
    main()
