"""What each rank holds under expert parallelism and FSDP: per rank, the bytes of weights, gradients and AdamW
state (experts and the dense rest apart), the peak memory, and the run's tokens/s, for one process and for
`--world` local processes at ep_size 1 / 2 / 4, with and without --fsdp.

    python scripts/bench/bench_parallel.py                       # D=256, 4 layers, E=64, k=2, F=384; 4 processes
    python scripts/bench/bench_parallel.py --steps 20 --layouts 1:1,4:4,4:4:fsdp
    python scripts/bench/bench_parallel.py --device cuda         # one process per GPU (NCCL)

Each layout is train/pretrain.py itself (train.loop.train, on the embedded corpus, fp32, no evaluation but
the first and last) in `world` processes with torchrun's environment; the bytes are read at every optimizer
step (a step pre-hook: the grads as they are reduced; state after the step), local shards only (an FSDP
DTensor's `to_local()`); peak memory is the process's peak RSS (ru_maxrss; on CUDA the device's
max_memory_allocated); tokens/s is the last log interval's (`tok_per_s`, all ranks together). Layout
`W:M[:fsdp]` = W processes, ep_size M. Ranks share the machine's cores: on a CPU box tokens/s shows the
overheads, not a speed-up.
"""
import argparse
import json
import os
import resource
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))  # scripts/bench
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT]

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

MODEL = ["--hidden_size", "256", "--num_hidden_layers", "4", "--num_attention_heads", "4",
         "--num_key_value_heads", "2", "--use_moe", "1", "--num_experts", "64", "--num_experts_per_tok", "2",
         "--moe_intermediate_size", "384"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", default="1:1,4:1,4:2,4:4,4:1:fsdp,4:2:fsdp,4:4:fsdp",
                   help="comma-separated W:M[:fsdp] (W processes, ep_size M)")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per layout (tokens/s: the last half)")
    p.add_argument("--global_batch", type=int, default=8, help="sequences per step over all ranks")
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args(argv)
    try:
        args.layouts = [(int(w), int(m), rest == ["fsdp"]) for w, m, *rest in
                        (item.split(":") for item in args.layouts.split(","))]
    except ValueError:
        p.error(f"--layouts takes W:M[:fsdp] items, got {args.layouts!r}")
    return args


def held_bytes(params, optimizer, experts):
    """{"experts" / "dense": [weights, grads, optimizer state] bytes} of this rank (local shards)."""
    from torch.distributed.tensor import DTensor
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    nbytes = lambda ts: sum(local(t).numel() * t.element_size() for t in ts)  # noqa: E731
    out = {}
    for part, ps in (("experts", [p for p in params if p in experts]),
                     ("dense", [p for p in params if p not in experts])):
        state = [v for p in ps for v in optimizer.state.get(p, {}).values() if torch.is_tensor(v) and v.dim()]
        out[part] = [nbytes(ps), nbytes([p.grad for p in ps if p.grad is not None]), nbytes(state)]
    return out


def rank_main(rank, world, port, argv, device, out_dir):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import train.loop as loop
    from train.parallel import expert_params
    from train.pretrain import parse_args, train
    seen = {}
    make_optimizer = loop.make_optimizer

    def recording_optimizer(model, args):
        optimizer = make_optimizer(model, args)
        params, experts = list(model.parameters()), set(expert_params(model))

        def before(opt, *_):  # grads as the step sees them
            seen["grads"] = held_bytes(params, opt, experts)

        def after(opt, *_):  # weights and the state the step created
            now = held_bytes(params, opt, experts)
            seen["bytes"] = {part: [now[part][0], seen["grads"][part][1], now[part][2]] for part in now}
        optimizer.register_step_pre_hook(before)
        optimizer.register_step_post_hook(after)
        return optimizer
    loop.make_optimizer = recording_optimizer
    summary = train(parse_args(argv), log=lambda *_: None)
    peak = (torch.cuda.max_memory_allocated() if device == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    records = [r for r in summary["records"] if "tok_per_s" in r]  # (rank 0 keeps the metrics)
    torch.save({**seen["bytes"], "peak": peak, "tok_per_s": records[-1]["tok_per_s"] if records else None},
               os.path.join(out_dir, f"rank{rank}.pt"))


def run_layout(world, ep, fsdp, args, tmp):
    from train.pretrain import STAGE  # noqa: F401  (fail here, not in every rank, if the trainer does not import)
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(tmp, f"run{world}_{ep}_{int(fsdp)}")
    argv = MODEL + ["--batch_size", str(args.global_batch // world), "--seq_len", str(args.seq_len),
                    "--max_steps", str(args.steps), "--log_interval", str(max(args.steps // 2, 1)),
                    "--eval_interval", str(10 ** 9), "--save_interval", str(10 ** 9), "--eval_tokens", "2048",
                    "--sample_tokens", "0", "--time_budget_s", "0", "--dtype", "float32", "--threads", "1",
                    "--device", args.device, "--no_progress", "--ep_size", str(ep), "--out_dir", out]
    argv += ["--fsdp"] if fsdp else []
    results_dir = os.path.join(tmp, f"results{world}_{ep}_{int(fsdp)}")
    os.makedirs(results_dir)
    mp.start_processes(rank_main, args=(world, port, argv, args.device, results_dir), nprocs=world, join=True,
                       start_method="spawn")
    return [torch.load(os.path.join(results_dir, f"rank{r}.pt")) for r in range(world)]


def main(argv=None):
    args = parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world, ep, fsdp in args.layouts:
            for rank, r in enumerate(run_layout(world, ep, fsdp, args, tmp)):
                rows.append({"world": world, "ep_size": ep, "fsdp": fsdp, "rank": rank, **r})
            print(f"done: {world} process(es), ep_size {ep}{', --fsdp' if fsdp else ''}", file=sys.stderr, flush=True)
    base = next((r for r in rows if r["world"] == 1), None)
    mb = lambda b: f"{b / 2 ** 20:.1f}"  # noqa: E731
    print("| processes | ep_size | fsdp | rank | experts: weights / grads / AdamW MB | share | dense: weights / grads "
          "/ AdamW MB | share | peak MB | tokens/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        shares = [f"{sum(r[p]) / sum(base[p]):.3f}" if base else "" for p in ("experts", "dense")]
        tok = "" if r["tok_per_s"] is None else f"{r['tok_per_s']:.0f}"  # (rank 0's: all ranks together)
        print(f"| {r['world']} | {r['ep_size']} | {'yes' if r['fsdp'] else 'no'} | {r['rank']} | "
              f"{' / '.join(mb(b) for b in r['experts'])} | {shares[0]} | {' / '.join(mb(b) for b in r['dense'])} | "
              f"{shares[1]} | {r['peak'] / 2 ** 20:.0f} | {tok} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
