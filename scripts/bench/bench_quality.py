"""Iso-time training comparisons: which model reaches the lowest validation loss in the same wall-clock time
on this machine? Layer benchmarks (bench_moe.py, bench_train.py) measure speed; this measures what the
speed buys.

    python scripts/bench/bench_quality.py                  # dense, fused, wide, fine, shared, upcycled x 240 s: ~30 min
    python scripts/bench/bench_quality.py --steps 1300     # the same rows at the main job's step count
    python scripts/bench/bench_quality.py --rows dense,sorted --budget_s 20                    # a smoke run
    python scripts/bench/bench_quality.py --data_path my.jsonl --budget_s 600 --extra "--warmup_steps 100"

Every row is one `train/pretrain.py` run, as a subprocess, one at a time (never in parallel: they would
share the cores), each with the same --time_budget_s (seconds of training, not counting setup, evaluation
or saving; each run plans its steps from its own measured step time and ends its cosine LR schedule on the
last of them, stopping early only if the budget runs out first), the
same data (the embedded corpus, or --data_path), tokenizer (the corpus's cached BPE, or --tokenizer), seed,
batch, sequence length and learning rate, in its own temporary --out_dir. Its numbers come from that
folder's metrics.jsonl: steps and training seconds from the last training record, the final validation
loss (nats per token) and bits per byte (comparable across tokenizers) from the last evaluation; real
tokens/s = tokens trained / training seconds. The load average is read just before and after each run
(a busy machine slows a run far more than its share of the cores: compare rows only at similar load).

Rows (--rows picks and orders them; F = --moe_intermediate_size, default 384; every MoE row has the dense
row's 2F active FFN width, and the trainer's --routed_scaling_factor, k):
  dense     dense SwiGLU FFN of width 2F
  sorted    E=4, top-2, experts of width F, --moe_impl sorted (bitwise MiniMind's masked loop, whose speed
            scripts/bench/bench_train.py compares)
  fused     E=4, top-2, F, --moe_impl fused
  wide      E=16, top-2, F, fused (more experts of the same width: 4x fused's expert parameters)
  fine      E=16, top-4, experts of width F/2, fused (finer experts)
  shared    E=16, top-3, F/2, plus one shared expert of width F/2, fused (DeepSeekMoE)
  upcycled  the dense row for half the budget, then E=4 top-2 F made of it (--upcycle_from) for the
            other half, on other batches (--seed + 1): its steps and seconds count both phases
--steps N compares at equal steps instead of equal time (each row N optimizer steps).

Defaults: D=256, 4 layers, batch 16 x 128 tokens (the main job's), the trainer's LR and warmup, 240 s per row;
evaluation on the trainer's 16384 validation tokens at step 0 and at the end only. Each run adds ~10-20 s of
setup and evaluation around its budget (the first run on a fresh machine also builds the data cache, ~1 min),
so the default six rows take about 30 minutes on 2 CPU cores.

Prints the command line of every run (rerun one with it), then the table and the val-bpb differences
(dense vs the best MoE row); writes results.json and results.md, and per row
its log and metrics.jsonl, to --out_dir.
"""
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # (this file: scripts/bench/)
sys.path.insert(0, ROOT)

ROWS = ("dense", "sorted", "fused", "wide", "fine", "shared", "upcycled")
DEFAULT_ROWS = ("dense", "fused", "wide", "fine", "shared", "upcycled")
UPCYCLE_AT = 0.5  # the upcycled row: this share of its budget (or steps) trains the dense model


def row_flags(row, f):
    """The model flags of a row; f is the width of one expert of the top-2 rows."""
    if row == "dense":
        return ["--use_moe", "0", "--intermediate_size", str(2 * f)]
    e, k, width, impl = {"wide": (16, 2, f, "fused"), "fine": (16, 4, f // 2, "fused"),
                         "shared": (16, 3, f // 2, "fused"), "upcycled": (4, 2, f, "fused")}.get(row, (4, 2, f, row))
    return ["--use_moe", "1", "--num_experts", str(e), "--num_experts_per_tok", str(k), "--moe_intermediate_size",
            str(width), "--moe_impl", impl] + (["--n_shared_experts", "1"] if row == "shared" else [])


def upcycle_split(args):
    """(dense phase, MoE phase) of the upcycled row: steps that add up to --steps (each >= 1), or seconds."""
    if args.steps:
        dense_steps = min(max(round(args.steps * UPCYCLE_AT), 1), args.steps - 1)
        return dense_steps, args.steps - dense_steps
    return args.budget_s * UPCYCLE_AT, args.budget_s * (1 - UPCYCLE_AT)


def command(args, row, out_dir, length=None, extra=(), seed=None):
    """argv of one row's training run (`length`: its steps with --steps, else its seconds; None: the row's
    whole --steps / --budget_s; seed: --seed's)."""
    length = (args.steps or args.budget_s) if length is None else length
    length = ["--max_steps", str(length), "--time_budget_s", "0"] if args.steps else ["--time_budget_s", f"{length:g}"]
    argv = [sys.executable, os.path.join(ROOT, "train", "pretrain.py"), "--out_dir", out_dir,
            *length, "--hidden_size", str(args.hidden_size),
            "--num_hidden_layers", str(args.num_hidden_layers), "--batch_size", str(args.batch_size),
            "--seq_len", str(args.seq_len), "--seed", str(args.seed if seed is None else seed),
            "--eval_tokens", str(args.eval_tokens),
            "--eval_interval", "1000000000", "--save_interval", "1000000000", "--no_progress", "--sample_tokens", "0",
            *row_flags(row, args.moe_intermediate_size), *extra]
    for flag in ("data_path", "tokenizer", "vocab_size", "learning_rate"):
        if getattr(args, flag) is not None:
            argv += [f"--{flag}", str(getattr(args, flag))]
    return argv + shlex.split(args.extra)


def count_params(config_path):
    """(total, active) parameters of the model a run's config.json describes (built on the meta device)."""
    import torch

    from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
    from train.report import param_counts
    with open(config_path, encoding="utf-8") as f:
        config = MiniMindConfig.from_dict(json.load(f))
    with torch.device("meta"):
        return param_counts(MiniMindForCausalLM(config), config)


def data_epoch(ckpt_path):
    """The epoch of the training data a run's last batch came from (0: no token was trained on twice)."""
    import torch
    return int(torch.load(ckpt_path, map_location="cpu", weights_only=False)["data"]["epoch"])


def shape(flags):
    """The FFN of a run as its resolved flags (--extra included) describe it."""
    if not flags.use_moe:
        return f"dense F={flags.intermediate_size}"
    return f"E={flags.num_experts} k={flags.num_experts_per_tok} F={flags.moe_intermediate_size} {flags.moe_impl}"


def resolved_flags(args, row):
    """The row's training flags as train/pretrain.py resolves them (it exits with a one-line error on a bad
    value, e.g. in --extra: checked for every row before any training)."""
    from train.pretrain import parse_args
    return parse_args(command(args, row, os.path.join(tempfile.gettempdir(), "unused"))[2:])


def run_row(args, row, flags):
    """Train one row (a subprocess); returns its result dict (with "error" when the run failed)."""
    from train.report import read_records
    keep = os.path.join(args.out_dir, row)
    os.makedirs(keep, exist_ok=True)
    run_dir = tempfile.mkdtemp(prefix=f"bench_quality_{row}_")
    argvs = [command(args, row, run_dir)]
    if row == "upcycled":  # a dense phase, then the MoE made of it: the two share the row's budget
        dense_dir = run_dir + "_dense"
        dense_length, moe_length = upcycle_split(args)
        argvs = [command(args, "dense", dense_dir, dense_length),
                 command(args, row, run_dir, moe_length, ["--upcycle_from", dense_dir],
                         seed=args.seed + 1)]  # another seed: other batches than the dense phase's
    for argv in argvs:
        print(f"\n[{row}] {shlex.join(argv)}", flush=True)
    result = {"row": row, "shape": shape(flags), "command": " && ".join(map(shlex.join, argvs)),
              "load_before": os.getloadavg()[0]}
    t0 = time.time()
    with open(os.path.join(keep, "log.txt"), "w", encoding="utf-8") as log:
        for argv in argvs:
            proc = subprocess.run(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            if proc.returncode != 0:
                break
    result.update(wall_s=time.time() - t0, load_after=os.getloadavg()[0])
    try:
        if proc.returncode != 0:
            tail = open(os.path.join(keep, "log.txt"), encoding="utf-8").read().strip().splitlines()[-3:]
            return {**result, "error": f"exit code {proc.returncode}: " + " | ".join(tail)}
        shutil.copy(os.path.join(run_dir, "metrics.jsonl"), keep)
        records = read_records(os.path.join(run_dir, "metrics.jsonl"))
        if row == "upcycled":  # count the dense phase's steps and seconds too
            dense = [r for r in read_records(os.path.join(dense_dir, "metrics.jsonl")) if "train_loss" in r][-1]
            records = [{**r, "step": r["step"] + dense["step"],
                        "train_time_s": r["train_time_s"] + dense["train_time_s"]}
                       if "train_loss" in r else r for r in records]
        last_train = [r for r in records if "train_loss" in r][-1]
        last_val = [r for r in records if "val_loss" in r][-1]
        tokens = last_train["step"] * flags.batch_size * flags.seq_len * flags.grad_accum
        total, active = count_params(os.path.join(run_dir, "config.json"))
        epoch = data_epoch(os.path.join(run_dir, "ckpt.pt"))
        return {**result, "params": total, "active_params": active, "steps": last_train["step"], "tokens": tokens,
                "data_epoch": epoch,
                "train_time_s": last_train["train_time_s"], "tok_per_s": tokens / last_train["train_time_s"],
                "val_loss": last_val["val_loss"], "val_bpb": last_val.get("val_bpb")}
    finally:
        if not args.keep_runs:
            shutil.rmtree(run_dir, ignore_errors=True)
            shutil.rmtree(run_dir + "_dense", ignore_errors=True)


def table(results):
    """The results as markdown table lines."""
    head = ["row", "model", "params", "active", "steps", "train s", "tokens/s", "val loss", "val bpb",
            "load before/after", "wall s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        load = f"{r['load_before']:.1f} / {r['load_after']:.1f}"
        if "error" in r:
            cells = [r["row"], r["shape"], *["-"] * 7, load, f"{r['wall_s']:.0f}"]
        else:
            bpb = "-" if r["val_bpb"] is None else f"{r['val_bpb']:.3f}"
            cells = [r["row"], r["shape"], f"{r['params'] / 1e6:.2f}M", f"{r['active_params'] / 1e6:.2f}M",
                     str(r["steps"]), f"{r['train_time_s']:.1f}", f"{r['tok_per_s']:,.0f}", f"{r['val_loss']:.4f}",
                     bpb, load, f"{r['wall_s']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def comparisons(results):
    """A line comparing val bpb: dense vs the best MoE row."""
    ok = {r["row"]: r for r in results if "error" not in r and r["val_bpb"] is not None}
    ours = [r for name, r in ok.items() if name != "dense"]
    if not ours:
        return []
    best, lines = min(ours, key=lambda r: r["val_bpb"]), []
    if "dense" in ok:
        d = best["val_bpb"] - ok["dense"]["val_bpb"]
        lines.append(f"best MoE ({best['row']}) {best['val_bpb']:.3f} bpb vs dense {ok['dense']['val_bpb']:.3f}: "
                     f"{d:+.3f} bpb ({'MoE ahead' if d < 0 else 'dense ahead'})")
    return lines


def parse_cli(argv=None):
    from train.flags import AT_LEAST_0, AT_LEAST_1, POSITIVE, Parser, Range, add
    p = Parser(description=__doc__)
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS), help=f"comma-separated rows, of {', '.join(ROWS)}")
    add(p, "--budget_s", allowed=POSITIVE, type=float, default=240.0, help="training seconds per row (--time_budget_s)")
    add(p, "--steps", allowed=AT_LEAST_0, type=int, default=0,
        help="equal steps instead: this many optimizer steps per row")
    add(p, "--hidden_size", allowed=AT_LEAST_1, type=int, default=256)
    add(p, "--num_hidden_layers", allowed=AT_LEAST_1, type=int, default=4)
    add(p, "--moe_intermediate_size", allowed=AT_LEAST_1, type=int, default=384,
        help="F: expert width of the top-2 rows (dense: 2F; fine: F/2)")
    add(p, "--batch_size", allowed=AT_LEAST_1, type=int, default=16, help="the main job's")
    add(p, "--seq_len", allowed=AT_LEAST_1, type=int, default=128)
    add(p, "--learning_rate", allowed=POSITIVE, type=float, default=None, help="None: the trainer's default")
    add(p, "--seed", allowed=Range(0, 2**32 - 1), type=int, default=1337)
    add(p, "--eval_tokens", allowed=AT_LEAST_1, type=int, default=16384,
        help="validation tokens of the step-0 and final evaluations")
    p.add_argument("--data_path", default=None, help="training text (see train/pretrain.py); None: the embedded corpus")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir; None: the corpus's cached BPE (one for all rows)")
    add(p, "--vocab_size", allowed=Range(259), type=int, default=None,
        help="BPE size when one is trained; None: the trainer's")
    p.add_argument("--extra", default="", help='more train/pretrain.py flags for every run, e.g. "--dtype bfloat16"')
    p.add_argument("--out_dir", default=os.path.join("bench_out", "quality"), help="results.json/.md and per-row logs")
    p.add_argument("--keep_runs", action="store_true", help="keep each run's folder (checkpoint, plots)")
    args = p.parse_args(argv)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    bad = [r for r in rows if r not in ROWS]
    if bad or not rows:
        p.error(f"--rows: unknown {bad} (choose from {', '.join(ROWS)})")
    if args.steps == 1 and "upcycled" in rows:
        p.error("--steps must be >= 2 with the upcycled row (a dense and an MoE phase), got 1")
    args.rows = rows
    return args


def main(argv=None):
    args = parse_cli(argv)
    flags = {row: resolved_flags(args, row) for row in args.rows}
    os.makedirs(args.out_dir, exist_ok=True)
    length = f"{args.steps} steps" if args.steps else f"{args.budget_s:g} s of training"
    print(f"{'equal-steps' if args.steps else 'iso-time'} benchmark: rows {', '.join(args.rows)}; "
          f"{length} each, one at a time; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}", flush=True)
    results = []
    for row in args.rows:
        r = run_row(args, row, flags[row])
        results.append(r)
        print(f"[{row}] " + (r["error"] if "error" in r else
                             f"{r['steps']} steps in {r['train_time_s']:.0f} s, {r['tok_per_s']:,.0f} tokens/s, "
                             f"val loss {r['val_loss']:.4f}, {r['wall_s']:.0f} s wall"), flush=True)
    lines = table(results) + [""] + comparisons(results)
    print("\n" + "\n".join(lines))
    with open(os.path.join(args.out_dir, "results.json"), "w", encoding="utf-8") as f:
        json.dump({"settings": vars(args), "results": results}, f, indent=1)
    with open(os.path.join(args.out_dir, "results.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print(f"\nwrote {os.path.join(args.out_dir, 'results.json')} and results.md")
    return results


if __name__ == "__main__":
    main()
