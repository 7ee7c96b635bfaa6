"""Pretrain a MiniMind-style MoE GPT.

    python train/pretrain.py                       # embedded corpus, small MoE, ~5 min on 2 CPU cores
    python train/pretrain.py --data_path my.jsonl  # {"text": ...} per line, or a .txt file
    python train/pretrain.py --resume              # continue checkpoints/pretrain/ckpt.pt exactly
    torchrun --nproc_per_node 4 train/pretrain.py --ep_size 2   # DDP x EP (gloo on CPU, NCCL on GPU)

Writes to --out_dir: ckpt.pt (fp32 weights, optimizer, step, data position, RNG, config, args),
config.json, tokenizer/, metrics.jsonl and loss.png.
"""
import argparse
import math
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from train.checkpoint import CKPT_NAME, load_checkpoint  # noqa: E402
from train.trainer import run_cli, train  # noqa: E402


MODEL_FLAGS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "use_moe",
               "num_experts", "top_k", "moe_intermediate_size", "dropout", "max_position_embeddings",
               "capacity_factor", "drop_policy", "pad_to_capacity", "expert_alignment", "bias_update_rate")
# --moe_impl, --aux_loss_type, --aux_loss_coef, --z_loss_coef and --router_dtype are training choices: they
# may change on --resume / --init_from (train/trainer.py TRAINING_FIELDS).


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("data")
    g.add_argument("--data_path", default=None, help="training text: .jsonl with a \"text\" field per line, or .txt "
                   "(paragraphs = documents); default: the embedded Python-stdlib docstring corpus")
    g.add_argument("--tokenizer", default=None, help="existing tokenizer dir; default: train a BPE on the data (cached)")
    g.add_argument("--vocab_size", type=int, default=6400, help="BPE vocabulary size when training a tokenizer")
    g = p.add_argument_group("model")
    g.add_argument("--hidden_size", type=int, default=256, help="model width D")
    g.add_argument("--num_layers", type=int, default=4, help="transformer blocks")
    g.add_argument("--num_heads", type=int, default=4, help="attention (query) heads")
    g.add_argument("--num_kv_heads", type=int, default=2, help="key/value heads (GQA)")
    g.add_argument("--intermediate_size", type=int, default=None, help="dense FFN width (default ~pi*D)")
    g.add_argument("--use_moe", type=int, default=1, choices=(0, 1), help="1: MoE feed-forward, 0: dense")
    g.add_argument("--num_experts", type=int, default=4, help="experts per MoE layer")
    g.add_argument("--top_k", type=int, default=2, help="experts per token (num_experts_per_tok)")
    g.add_argument("--moe_intermediate_size", type=int, default=384, help="SwiGLU width of one expert")
    g.add_argument("--capacity_factor", type=float, default=None,
                   help="expert capacity = ceil(factor * tokens * top_k / experts); default: dropless")
    g.add_argument("--drop_policy", default="probs", choices=("probs", "position"),
                   help="which pairs an over-full expert keeps: highest router weight, or earliest tokens")
    g.add_argument("--pad_to_capacity", type=int, default=0, choices=(0, 1),
                   help="pad every expert's rows to the capacity (fixed GEMM shapes)")
    g.add_argument("--expert_alignment", type=int, default=1, help="pad each expert's rows to a multiple of this")
    g.add_argument("--moe_impl", default="sorted", choices=("sorted", "fused"),
                   help="MoE expert compute: sorted (bitwise = masked reference, 1 host sync per layer) or fused "
                   "(no host sync, grouped GEMM + Triton kernels on GPU); not part of the architecture: it may "
                   "differ on --resume / --init_from")
    g.add_argument("--aux_loss_coef", type=float, default=0.01, help="load-balancing loss weight")
    g.add_argument("--aux_loss_type", default="minimind", choices=("minimind", "switch", "sequence", "none"),
                   help="balance loss: MiniMind's (coef*k when balanced), Switch k-normalised (coef when balanced), "
                   "DeepSeek-V3 per-sequence, or none (see model/router.py)")
    g.add_argument("--z_loss_coef", type=float, default=0.0, help="router z-loss weight (ST-MoE; 0 = off)")
    g.add_argument("--bias_update_rate", type=float, default=0.0,
                   help="aux-loss-free balancing: per-expert selection bias moved this much per step (DeepSeek-V3; "
                   "e.g. 1e-3; 0 = off). Combine with --aux_loss_type none or a small coef")
    g.add_argument("--router_dtype", default=None, choices=("float32",),
                   help="float32: router logits/softmax/top-k in fp32 under bf16/fp16 autocast (default: autocast's dtype)")
    g.add_argument("--dropout", type=float, default=0.0, help="dropout probability")
    g.add_argument("--max_position_embeddings", type=int, default=2048, help="longest sequence the model supports")
    g = p.add_argument_group("optimisation")
    g.add_argument("--max_steps", type=int, default=1250, help="optimizer steps")
    g.add_argument("--batch_size", type=int, default=8, help="sequences per micro-batch")
    g.add_argument("--seq_len", type=int, default=128, help="tokens per sequence")
    g.add_argument("--grad_accum", type=int, default=1, help="micro-batches per optimizer step")
    g.add_argument("--learning_rate", type=float, default=3e-3, help="peak learning rate")
    g.add_argument("--warmup_steps", type=int, default=50, help="linear warmup steps, then cosine to lr/10")
    g.add_argument("--weight_decay", type=float, default=0.1, help="AdamW weight decay on matrices")
    g.add_argument("--grad_clip", type=float, default=1.0, help="max global grad norm (0 = off)")
    g.add_argument("--seed", type=int, default=1337, help="seed for init and data order")
    g = p.add_argument_group("run")
    g.add_argument("--out_dir", default="checkpoints/pretrain", help="where checkpoint, tokenizer and plots go")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    g.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="autocast dtype; auto = bfloat16 on CUDA, float32 on CPU (weights stay fp32)")
    g.add_argument("--eval_interval", type=int, default=250, help="steps between validation runs")
    g.add_argument("--eval_tokens", type=int, default=16384, help="validation tokens per evaluation")
    g.add_argument("--save_interval", type=int, default=250, help="steps between checkpoints")
    g.add_argument("--log_interval", type=int, default=10, help="steps between progress/metrics updates")
    g.add_argument("--resume", nargs="?", const="auto", default=None,
                   help="resume from a checkpoint (path, or out_dir/ckpt.pt when given without a value); "
                        "architecture and unspecified flags come from the checkpoint")
    g.add_argument("--init_from", default=None,
                   help="start from these weights (a checkpoint/run dir, or an HF folder from export_hf.py); "
                        "architecture and tokenizer come from there, optimizer and step start fresh")
    g.add_argument("--ep_size", type=int, default=1,
                   help="expert-parallel group size: experts sharded over this many ranks (divides world size "
                        "and num_experts); launch with torchrun --nproc_per_node N")
    g.add_argument("--stop_after", type=int, default=0,
                   help="stop after this many steps of this invocation, with a checkpoint (0 = run to max_steps)")
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    g.add_argument("--wandb", action="store_true", help="log to Weights & Biases (offline unless logged in)")
    g.add_argument("--wandb_project", default="minimind-moe", help="wandb project name")
    g.add_argument("--sample_tokens", type=int, default=48, help="tokens to sample at the end (0 = none)")
    g.add_argument("--show_load", type=int, default=1, choices=(0, 1), help="show expert load in the progress bar")
    g.add_argument("--no_progress", action="store_true", help="no progress bar (logs only)")
    return p


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.resume:
        if args.resume == "auto":
            args.resume = os.path.join(args.out_dir, CKPT_NAME)
        elif os.path.isdir(args.resume):
            args.resume = os.path.join(args.resume, CKPT_NAME)
        try:
            ckpt = load_checkpoint(args.resume)
        except (FileNotFoundError, ValueError) as e:
            parser.error(str(e))
        if not ckpt.get("args") or ckpt.get("optimizer") is None or "data" not in ckpt:
            parser.error(f"{args.resume}: holds weights but no training state (an imported or exported model?); "
                         f"start from it with --init_from instead of --resume")
        saved = ckpt["args"]
        # Flags given now override; everything else (data, batch, seq_len, schedule...) comes from the run.
        parser.set_defaults(**{k: v for k, v in saved.items() if k not in ("resume", "stop_after", "ep_size")})
        resume = args.resume
        args = parser.parse_args(argv)
        args.resume = resume
        if args.out_dir == saved.get("out_dir") and os.path.isfile(resume):
            args.out_dir = os.path.dirname(os.path.abspath(resume))  # keep writing next to the checkpoint
        for k in ("seq_len", "seed", "data_path"):  # they define the data order the saved position points into
            if getattr(args, k) != saved.get(k, getattr(args, k)):
                parser.error(f"--{k} cannot change on resume (checkpoint: {saved.get(k)!r}, now: {getattr(args, k)!r}): "
                             f"the saved data position refers to the original windows")
        changed = [f"--{k}" for k in MODEL_FLAGS if getattr(args, k) != saved.get(k, getattr(args, k))]
        if changed:
            print(f"warning: {', '.join(changed)} ignored on resume: the architecture comes from the checkpoint",
                  file=sys.stderr)
    for name in ("max_steps", "batch_size", "seq_len", "grad_accum", "eval_interval", "save_interval",
                 "log_interval", "eval_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup_steps < 0 or not 0 < args.learning_rate < math.inf:
        parser.error("--warmup_steps must be >= 0 and --learning_rate a finite number > 0")
    for name in ("stop_after", "grad_clip", "weight_decay", "sample_tokens"):
        if not 0 <= getattr(args, name) < math.inf:
            parser.error(f"--{name} must be a finite number >= 0, got {getattr(args, name)}")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", args.device):
        parser.error(f"--device must be auto, cpu, cuda or cuda:N, got {args.device!r}")
    if args.init_from and not args.resume:
        defaults = build_parser().parse_args([])
        ignored = [f"--{k}" for k in MODEL_FLAGS if getattr(args, k) != getattr(defaults, k)]
        if ignored:
            print(f"warning: {', '.join(ignored)} ignored with --init_from: the architecture comes from "
                  f"{args.init_from}", file=sys.stderr)
    args.use_moe = bool(args.use_moe)
    return args


if __name__ == "__main__":
    run_cli(train, parse_args())
