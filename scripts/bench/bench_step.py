"""Whole training steps on CPU, side by side: which engines make the step fast on this machine, and where the
step's time goes.

    python scripts/bench/bench_step.py                    # engines: fp32 MKL / oneDNN linears, bf16, attention kernels
    python scripts/bench/bench_step.py --split            # time per step: attention, FFN / MoE, LM head, optimizer

Engines mode: the main job's model (D=256, 4 layers, E=4 top-2, F=384, batch 16 x 128; `--impl`,
`--use_moe 0`) on random tokens, full AdamW steps (forward, backward, clipping, optimizer); each variant
is a freshly built model with the same weights, run in rounds (`--rounds` x `--steps` steps per variant
per round) so that machine drift hits all alike; tokens/s = total tokens / total time of the timed rounds.
Variants: the plain model (nn.Linear on MKL, SDPA) in fp32, with the oneDNN linears, the plain model
under bf16 autocast, then adding train/engines.py's engines one by one (each variant built with an
Engines holding only the chosen ones: written-out attention, chunked LM-head loss, fused MoE engines) and
torch's fused AdamW: the last is what the trainer runs.

Split mode (`--split`): where a step's time goes, dense vs MoE at equal active parameters (dense FFN of
width 2F vs E=4 top-2 experts of width F, `--impl`), in the engines the main job picks: forward + backward
of all attention sublayers (with their norms), of all FFN / MoE sublayers, of the LM head with the loss,
and the AdamW step, each timed alone on the same activations (ms per step; their sum is close to a step).

Two commits compare in two `git worktree`s, each running this script in turn (scripts/README.md).
Check `uptime` first: numbers from a loaded machine are noise.
"""
import contextlib
import dataclasses
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))  # scripts/bench
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from kernels.attention import explicit_attention  # noqa: E402
from kernels.cpu_linear import OneDNNLinear  # noqa: E402
from train.engines import bf16_pays, cpu_facts, engines_for  # noqa: E402
from kernels.linear_cross_entropy import linear_cross_entropy  # noqa: E402
from model.engines import PLAIN  # noqa: E402
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM  # noqa: E402
from train.threads import keep_freed_memory  # noqa: E402

# name: (autocast bf16, the engines of train/engines.py built in, fused AdamW); the last is what the trainer runs
VARIANTS = {
    "plain PyTorch, fp32": (False, (), False),
    "fp32, oneDNN linears": (False, ("linear",), False),
    "plain PyTorch, bf16": (True, (), False),
    "bf16, explicit attention": (True, ("attention",), False),
    "+ chunked LM loss": (True, ("attention", "loss"), False),
    "+ fused MoE engines": (True, ("attention", "loss", "moe"), False),
    "+ fused AdamW": (True, ("attention", "loss", "moe"), True),
}


def chosen_engines(config, chosen):
    """Plain engines but the chosen ones of train/engines.py (engines_for picks all that pay): "linear"
    OneDNNLinear, "attention" explicit_attention, "loss" the chunked LM loss, "moe" (moe_impl "fused" only)
    the CPU or grouped experts engine and the row movers."""
    fused = engines_for(config, "cpu", torch.bfloat16)
    engines = {"linear": dict(linear=OneDNNLinear), "attention": dict(attend=explicit_attention),
               "loss": dict(lm_loss=linear_cross_entropy),
               "moe": {k: getattr(fused, k) for k in ("experts", "movers")}
               if config.use_moe and config.moe_impl == "fused" else {}}
    return dataclasses.replace(PLAIN, **{k: v for name in chosen for k, v in engines[name].items()})


def config(args, use_moe=None, num_experts=4, top_k=2, expert_width=384):
    return MiniMindConfig(hidden_size=args.hidden_size, num_hidden_layers=args.num_layers,
                          num_attention_heads=4, num_key_value_heads=2,
                          use_moe=bool(args.use_moe if use_moe is None else use_moe), num_experts=num_experts,
                          num_experts_per_tok=top_k, moe_intermediate_size=expert_width, intermediate_size=768,
                          moe_impl=args.impl)


def build(cfg, engines=PLAIN):
    """The model built with `engines`: the same weights whatever the engines (same seed)."""
    torch.manual_seed(0)
    return MiniMindForCausalLM(cfg, engines).train()


def make_step(args, bf16, chosen, fused_adamw):
    cfg = config(args)
    model = build(cfg, chosen_engines(cfg, chosen))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused_adamw)
    gen = torch.Generator().manual_seed(1)
    batch = torch.randint(0, MiniMindConfig.vocab_size, (args.batch_size, args.seq_len + 1), generator=gen)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
            out = model(batch[:, :-1], labels=batch[:, 1:])
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def timed(step, n):
    t = time.perf_counter()
    for _ in range(n):
        step()
    return time.perf_counter() - t


def engines(args):
    steps = {name: make_step(args, *v) for name, v in VARIANTS.items()}
    for step in steps.values():
        timed(step, 2)  # warm-up: oneDNN builds its kernels on first use
    total = dict.fromkeys(steps, 0.0)
    for _ in range(args.rounds):
        for name, step in steps.items():
            total[name] += timed(step, args.steps)
    tokens = args.rounds * args.steps * args.batch_size * args.seq_len
    base = tokens / total[next(iter(total))]
    kind = f"MoE {args.impl}" if args.use_moe else "dense"
    print(f"{kind}, D={args.hidden_size}, {args.num_layers} layers, batch {args.batch_size} x {args.seq_len}, "
          f"{torch.get_num_threads()} threads")
    for name, t in total.items():
        print(f"  {name:28s} {tokens / t:8.0f} tokens/s  {tokens / t / base:5.2f}x")


SPLIT_ROWS = {  # name: (num_experts, top-k, expert width); equal active FFN width 768
    "dense F=768": (0, 0, 768), "E=4 k=2 F=384": (4, 2, 384), "E=16 k=4 F=192": (16, 4, 192),
    "E=64 k=8 F=96": (64, 8, 96)}


def _identity_experts(rows_PD, tokens_per_expert, row_weight_P=None):
    """Experts that cost nothing (each row times its routing weight): what routing + dispatch + combine cost."""
    return rows_PD if row_weight_P is None else rows_PD * row_weight_P.unsqueeze(-1).to(rows_PD.dtype)


def _no_experts(b, x):  # block b's MoE sublayer with _identity_experts
    b.mlp.experts.forward = _identity_experts  # (an instance attribute: shadows the class's)
    try:
        return b.mlp(b.post_attention_layernorm(x))
    finally:
        del b.mlp.experts.forward


def split(args):
    bf16 = bf16_pays(cpu_facts())[0]  # as --dtype auto decides
    dtype = torch.bfloat16 if bf16 else torch.float32
    B, T, D = args.batch_size, args.seq_len, args.hidden_size
    print(f"ms per step (forward + backward of all {args.num_layers} layers), batch {B} x {T}, D={D}, "
          f"{'bf16 autocast' if bf16 else 'fp32'}, {torch.get_num_threads()} threads, {args.rounds} rounds "
          f"alternating x {args.steps} steps; attention and LM head are the same modules in every row")
    h, labels = torch.randn(B, T, D), torch.randint(0, MiniMindConfig.vocab_size, (B, T))
    parts = {}  # (row, part) -> run()
    for name, (E, K, F_) in SPLIT_ROWS.items():
        cfg = config(args, E > 0, E or 4, K or 2, F_)
        model = build(cfg, engines_for(cfg, "cpu", dtype))  # the trainer's engines
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # as train/loop.py's
        cos, sin = model.model.rope(0, T, "cpu")

        def fwd_bwd(fn, blocks=model.model.layers):  # fn(block, x) summed over the layers
            def run():
                x = h.clone().requires_grad_()
                with torch.autocast("cpu", dtype=dtype, enabled=bf16):
                    out = sum(fn(b, x) for b in blocks)
                out.float().sum().backward()
                model.zero_grad(set_to_none=True)  # as the trainer: each step's gradients are fresh tensors
            return run

        if not E:
            parts[name, "attention"] = fwd_bwd(lambda b, x: b.self_attn(b.input_layernorm(x), cos, sin)[0])
            parts[name, "LM head"] = fwd_bwd(lambda b, x: linear_cross_entropy(  # the chunked loss, once
                model.model.norm(x).view(-1, D), model.lm_head.weight, labels.view(-1)), blocks=[None])
        else:
            parts[name, "route"] = fwd_bwd(lambda b, x: b.mlp.route(b.post_attention_layernorm(x).view(-1, D))[1].sum()
                                           + b.mlp.aux_loss)
            parts[name, "no experts"] = fwd_bwd(_no_experts)
        parts[name, "FFN / MoE"] = fwd_bwd(lambda b, x: b.mlp(b.post_attention_layernorm(x)))
        grads = [torch.randn_like(p) * 1e-3 for p in model.parameters()]

        def adamw(params=list(model.parameters()), grads=grads, opt=opt):  # as a step: fresh gradients in place
            for p, g in zip(params, grads):
                p.grad = g
            opt.step()
        parts[name, "AdamW"] = adamw
    for run in parts.values():
        run()  # warm-up: oneDNN builds its kernels on first use
    total = dict.fromkeys(parts, 0.0)
    for _ in range(args.rounds):
        for key, run in parts.items():
            t = time.perf_counter()
            for _ in range(args.steps):
                run()
            total[key] += time.perf_counter() - t
    ms = {k: v / (args.rounds * args.steps) * 1e3 for k, v in total.items()}
    cols = ("route", "dispatch", "experts", "FFN / MoE", "AdamW", "step", "x dense")
    dense = next(iter(SPLIT_ROWS))
    print(f"  attention {ms[dense, 'attention']:.1f}, LM head {ms[dense, 'LM head']:.1f}\n  {'model':16s}"
          + "".join(f"{c:>10s}" for c in cols))
    for name, (E, K, F_) in SPLIT_ROWS.items():
        row = {c: ms.get((name, c)) for c in cols}
        if E:
            row["dispatch"] = ms[name, "no experts"] - ms[name, "route"]  # permute, row map, combine
            row["experts"] = ms[name, "FFN / MoE"] - ms[name, "no experts"]
        row["step"] = ms[dense, "attention"] + ms[dense, "LM head"] + row["FFN / MoE"] + row["AdamW"]
        row["x dense"] = row["step"] / (ms[dense, "attention"] + ms[dense, "LM head"] + ms[dense, "FFN / MoE"]
                                        + ms[dense, "AdamW"])
        print(f"  {name:16s}" + "".join(f"{row[c]:10.2f}" if row[c] is not None else f"{'':10s}" for c in cols))


def main(argv=None):
    keep_freed_memory()  # as the trainer does on CPU
    from train.flags import AT_LEAST_1, Parser, add
    p = Parser(description=__doc__)
    p.add_argument("--impl", default="fused", choices=("sorted", "fused"))
    p.add_argument("--use_moe", type=int, default=1, choices=(0, 1))
    add(p, "--hidden_size", allowed=AT_LEAST_1, type=int, default=256)
    add(p, "--num_layers", allowed=AT_LEAST_1, type=int, default=4)
    add(p, "--batch_size", allowed=AT_LEAST_1, type=int, default=16, help="the main job's")
    add(p, "--seq_len", allowed=AT_LEAST_1, type=int, default=128)
    add(p, "--steps", allowed=AT_LEAST_1, type=int, default=5, help="steps per variant per round")
    add(p, "--rounds", allowed=AT_LEAST_1, type=int, default=3)
    p.add_argument("--split", action="store_true", help="time per step split into attention, FFN, LM head, AdamW")
    args = p.parse_args(argv)
    if args.split:
        split(args)
    else:
        engines(args)


if __name__ == "__main__":
    main()
