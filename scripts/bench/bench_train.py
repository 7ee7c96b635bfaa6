"""Training throughput, side by side: tokens/s of full optimizer steps (forward, backward, AdamW) of one model
with each MoE implementation, the dense model of equal active width, and transformers' Qwen3-MoE.

    python scripts/bench/bench_train.py                      # the main job's model (D=256, 4 layers, E=4, k=2)
    python scripts/bench/bench_train.py --num_experts 16 --top_k 4 --steps 10
    python scripts/bench/bench_train.py --device cuda --dtype bfloat16 --rows dense,fused,hf
    python scripts/bench/bench_train.py --device cuda --dtype bfloat16 --hidden_size 1024 --num_layers 8 \
        --num_heads 16 --num_kv_heads 4 --moe_intermediate_size 1024 --num_experts 8 --batch_size 16 --seq_len 1024

Rows (--rows picks them; the first is the one the others are divided by):
  masked   the sorted model with steps 3-5 of each MoE layer run by scripts/moe_reference.py's
           masked_expert_loop (MiniMind's per-expert loop), after the layer's own routing and aux loss
  sorted   moe_impl "sorted" (one host sync per layer, bitwise the masked loop)
  fused    moe_impl "fused" with the engines train/engines.py picks: what the trainer runs
  dense    the dense model of equal active width: a SwiGLU FFN of width k*F in every layer
  hf       transformers' Qwen3MoeForCausalLM with the same config and weights (experts fused into its
           gate_up_proj / down_proj layout, routed scaling folded into down_proj), its grouped_mm experts and
           its load-balancing loss (output_router_logits)

Every row trains with the trainer's routing (routed scaling k) and MiniMind's balance loss; all start from
the same weights and take the same batches (random token ids: throughput does not depend on the text).
Each step is the trainer's: forward, backward, gradient clipping at 1.0, torch's fused AdamW. Steps run in
rounds, one block of `--steps` steps per row per round, so machine drift hits all alike; tokens/s = total
tokens / total time of the timed rounds. First every row trains `--warmup` steps: on CPU oneDNN builds a
kernel per GEMM shape, and the CPU experts engine's bucketed row counts (a bounded set) keep meeting new
shapes for the first tens of steps, while the router's load moves; a training run's throughput is the warm
one. `--compile` wraps every model in torch.compile (the warm-up compiles).

Each row's share of the machine's GEMM rate = tokens/s x FLOPs per token / the GEMM rate measured in the
same run (before the rows and after them, the higher taken) at the model's own FFN shape in the row's
dtype: [batch x seq_len, hidden] @ [hidden, k x F], torch.mm (oneDNN / MKL on CPU, cuBLAS on CUDA). It
says how far the step is from its GEMMs: 100% would be a step made only of FFN-shaped GEMMs. On CUDA also
MFU = the same FLOPs / the device's dense bf16 peak. FLOPs per token = 6 x (active matmul parameters:
attention, router, the k routed experts of each layer, the LM head) + 12 x layers x heads x head_dim x
seq_len (attention scores and values; nanoGPT's count).
`--json PATH` writes the figures.
"""
import functools
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))  # scripts/bench
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), os.path.dirname(HERE)]  # the repository, scripts/

import torch  # noqa: E402

from train.engines import engines_for  # noqa: E402
from train.threads import keep_freed_memory  # noqa: E402
from model.config import trained_config  # noqa: E402
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM  # noqa: E402
from moe_reference import masked_expert_loop  # noqa: E402
from bench_moe import device_peak_tflops  # noqa: E402  (this folder: the bf16 peaks of known GPUs)

ROWS = ("masked", "sorted", "fused", "dense", "hf")


def model_config(args, row):
    """The MiniMindConfig of a row: the MoE model, or (dense) the same trunk with an FFN of width k*F."""
    moe = row != "dense"
    return trained_config(hidden_size=args.hidden_size, num_hidden_layers=args.num_layers,
                          num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads,
                          use_moe=moe, num_experts=args.num_experts, num_experts_per_tok=args.top_k,
                          moe_intermediate_size=args.moe_intermediate_size,
                          intermediate_size=args.top_k * args.moe_intermediate_size,
                          routed_scaling_factor=None if moe else 1.0,
                          moe_impl="fused" if row in ("fused", "hf") else "sorted")


def masked_moe_forward(mod, x):
    """An MOEFeedForward's forward (no capacity, no padding mask) as MiniMind runs it: the layer's routing
    and router losses (vectorised, as MiniMind's), then the per-expert masked loop. x [B, S, D] -> [B, S, D].
    (scripts/moe_reference.py's masked_layer_forward restates the routing in Python loops: a test's
    reference, not a timing one.)"""
    B, S, D = x.shape
    x_TD = x.reshape(-1, D)
    topk_idx_TK, topk_weight_TK, _, _ = mod.route(x_TD, None, B)
    return masked_expert_loop(mod.experts, x_TD, topk_idx_TK, topk_weight_TK, mod.training).view(B, S, D)


def hf_twin(model):
    """transformers' Qwen3MoeForCausalLM computing `model`'s function with its weights, grouped_mm experts."""
    from transformers import Qwen3MoeForCausalLM

    from model.hf_adapter import to_hf_config, to_hf_state_dict
    config = model.config
    hf_config = to_hf_config(config)
    hf_config._experts_implementation = "grouped_mm"
    hf_config.output_router_logits = True  # its load-balancing loss, as ours trains with one
    hf = Qwen3MoeForCausalLM(hf_config)
    state = to_hf_state_dict(model.state_dict(), config)
    for i, layer in enumerate(model.model.layers):  # its experts are stacked as ours: [E, 2F, D] / [E, D, F]
        prefix = f"model.layers.{i}.mlp.experts"
        state = {k: v for k, v in state.items() if not k.startswith(prefix + ".")}
        scale = config.routed_scaling_factor
        state[f"{prefix}.gate_up_proj"] = layer.mlp.experts.gate_up_proj.detach()
        state[f"{prefix}.down_proj"] = layer.mlp.experts.down_proj.detach() * scale
    hf.load_state_dict(state, strict=False)  # (a tied lm_head is left out: it is the embedding)
    return hf


def flops_per_token(model, config, seq_len):
    """6 x active matmul parameters + 12 x layers x heads x head_dim x seq_len (see the module doc)."""
    E, k = (config.num_experts, config.num_experts_per_tok) if config.use_moe else (1, 1)
    active = 0
    for name, p in model.named_parameters():
        if p.dim() < 2 or (name.endswith("embed_tokens.weight") and not config.tie_word_embeddings):
            continue  # norms; an untied embedding is a lookup (the untied lm_head counts on its own)
        active += p.numel() * (k / E if ".mlp.experts." in name else 1)
    return 6 * active + 12 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * seq_len


def median_seconds(fn, repeats, device):
    """The median wall time of `repeats` calls of fn() (on CUDA synchronised before and after each)."""
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gemm_rate(device, dtype, rows, hidden, width, seconds=0.5):
    """FLOP/s of torch.mm([rows, hidden] @ [hidden, width]) in `dtype` on `device`: the median of repeated
    timings over about `seconds`, inputs warm in cache (the rate a GEMM of that shape reaches here)."""
    a = torch.randn(rows, hidden, device=device, dtype=dtype)
    b = torch.randn(hidden, width, device=device, dtype=dtype)

    def products(n):
        for _ in range(n):
            torch.mm(a, b)

    one = median_seconds(lambda: products(3), 1, device) / 3  # (the first calls build the kernel)
    n = max(1, int(0.05 / max(one, 1e-7)))
    repeats = max(3, int(seconds / max(n * one, 1e-7)))
    return 2 * rows * hidden * width * n / median_seconds(lambda: products(n), repeats, device)


def main(argv=None):
    from train.flags import AT_LEAST_0, AT_LEAST_1, Parser, add
    p = Parser(description=__doc__)
    p.add_argument("--rows", default="masked,sorted,fused", help=f"comma-separated, from {','.join(ROWS)}")
    add(p, "--hidden_size", allowed=AT_LEAST_1, type=int, default=256)
    add(p, "--num_layers", allowed=AT_LEAST_1, type=int, default=4)
    add(p, "--num_heads", allowed=AT_LEAST_1, type=int, default=4)
    add(p, "--num_kv_heads", allowed=AT_LEAST_1, type=int, default=2)
    add(p, "--num_experts", allowed=AT_LEAST_1, type=int, default=4)
    add(p, "--top_k", allowed=AT_LEAST_1, type=int, default=2)
    add(p, "--moe_intermediate_size", allowed=AT_LEAST_1, type=int, default=384)
    add(p, "--batch_size", allowed=AT_LEAST_1, type=int, default=8)
    add(p, "--seq_len", allowed=AT_LEAST_1, type=int, default=128)
    add(p, "--steps", allowed=AT_LEAST_1, type=int, default=5, help="timed steps per row per round")
    add(p, "--rounds", allowed=AT_LEAST_1, type=int, default=4)
    add(p, "--warmup", allowed=AT_LEAST_0, type=int, default=40, help="untimed steps per row first")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--compile", action="store_true", help="torch.compile every model")
    p.add_argument("--json", default="", help="also write the figures to this file")
    args = p.parse_args(argv)
    rows = args.rows.split(",")
    unknown = [r for r in rows if r not in ROWS]
    if unknown or not rows:
        p.error(f"--rows {args.rows}: unknown {', '.join(unknown)} (choose from {','.join(ROWS)})")
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    kept = device == "cpu" and keep_freed_memory()  # as the trainer runs (train/threads.py)
    ptdtype = getattr(torch, args.dtype)

    def make(row):
        torch.manual_seed(0)  # the same weights in every MoE row
        config = model_config(args, row)
        # the trainer's engines
        model = MiniMindForCausalLM(config, engines_for(config, device, ptdtype)).to(device).train()
        if row == "masked":  # MiniMind's loop in place of steps 3-5 of every MoE layer
            for layer in model.model.layers:
                layer.mlp.forward = functools.partial(masked_moe_forward, layer.mlp)
        flops = flops_per_token(model, config, args.seq_len)
        if row == "hf":
            ids = torch.randint(0, MiniMindConfig.vocab_size, (2, 16), device=device)
            with torch.no_grad():
                ours, model = model(ids).logits.float(), hf_twin(model).to(device).train()
                err = (model(ids).logits.float() - ours).abs().max().item()
            assert err < 1e-3, f"the hf row's logits differ from ours by {err} (fp32): its weights did not load"
        step_model = torch.compile(model) if args.compile else model
        # the trainer's optimizer step (train/loop.py): torch's fused AdamW after clipping
        return step_model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), flops

    rate_args = (device, ptdtype, args.batch_size * args.seq_len, args.hidden_size,
                 args.top_k * args.moe_intermediate_size)
    rate = gemm_rate(*rate_args)
    runs = {row: make(row) for row in rows}
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, MiniMindConfig.vocab_size, (args.batch_size, args.seq_len + 1), generator=g).to(device)
               for _ in range(args.steps)]

    def block(model, opt):
        for b in batches:
            with torch.autocast(device, dtype=ptdtype, enabled=ptdtype != torch.float32):
                out = model(b[:, :-1], labels=b[:, 1:])  # (transformers shifts labels once more: the same work)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()

    for model, opt, _ in runs.values():  # warm-up (allocator, kernels, Triton and torch.compile compilation)
        for _ in range(-(-args.warmup // len(batches))):
            block(model, opt)
    spent = dict.fromkeys(runs, 0.0)
    for _ in range(args.rounds):
        for row, (model, opt, _) in runs.items():
            t0 = time.perf_counter()
            block(model, opt)
            spent[row] += time.perf_counter() - t0
    tokens = args.rounds * args.steps * args.batch_size * args.seq_len
    rate = max(rate, gemm_rate(*rate_args))
    peak = device_peak_tflops(device)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, {args.dtype}, "
          f"threads {torch.get_num_threads()}{', compiled' if args.compile else ''}"
          f"{', freed memory kept (mallopt)' if kept else ''}; model D={args.hidden_size} "
          f"L={args.num_layers} heads {args.num_heads}/{args.num_kv_heads} E={args.num_experts} k={args.top_k} "
          f"F={args.moe_intermediate_size}, batch {args.batch_size}x{args.seq_len}, "
          f"{args.rounds} rounds x {args.steps} steps; "
          f"GEMM rate {rate / 1e9:,.0f} GFLOP/s at [{rate_args[2]}, {rate_args[3]}] @ [{rate_args[3]}, {rate_args[4]}]")
    base = rows[0]
    results = {}
    for row, s in spent.items():
        tokens_per_s = tokens / s
        share = tokens_per_s * runs[row][2] / rate
        mfu = tokens_per_s * runs[row][2] / (peak * 1e12) if peak else None
        results[row] = {"tokens_per_s": tokens_per_s, "time_vs_" + base: s / spent[base], "gemm_share": share,
                        "mfu": mfu}
        print(f"  {row:<7} {tokens_per_s:>12,.0f} tokens/s   step time {s / spent[base]:5.2f}x {base}   "
              f"{100 * share:5.1f}% of the GEMM rate" + (f"   MFU {100 * mfu:5.1f}%" if mfu is not None else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "device": device, "gemm_flops_per_s": rate, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
