"""Command-line flags shared by every training stage, and how a resume merges them with the checkpoint's.

A flag that sets a `MiniMindConfig` field is named like the field (`--num_hidden_layers`), so the config
is built by name (`config_from_args`) and adding a field takes two edits: the field in model/config.py
and its flag here. The shorter names of earlier versions (`--num_layers`, `--top_k`, ...) still work
as aliases, also inside old checkpoints' saved flags.
"""
import argparse
import math
import os
import re
import sys

from model.config import MiniMindConfig
from train.checkpoint import CKPT_NAME, load_checkpoint

# config field -> the flag name it had before flags were named after fields (kept as an alias)
ALIASES = {"num_hidden_layers": "num_layers", "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads",
           "num_experts_per_tok": "top_k", "moe_drop_policy": "drop_policy", "moe_pad_to_capacity": "pad_to_capacity",
           "moe_expert_alignment": "expert_alignment", "router_aux_loss_coef": "aux_loss_coef",
           "router_aux_loss_type": "aux_loss_type", "router_z_loss_coef": "z_loss_coef",
           "router_bias_update_rate": "bias_update_rate"}
OLD_NAMES = {old: new for new, old in ALIASES.items()}
# MiniMindConfig's own fields (not those it inherits from transformers' PreTrainedConfig, e.g. dtype)
CONFIG_FIELDS = set(MiniMindConfig.__dataclass_fields__) - set(MiniMindConfig.__mro__[1].__dataclass_fields__)
# Flags a resume never takes from the checkpoint: they describe this invocation, not the run.
PER_INVOCATION = ("resume", "stop_after", "ep_size", "overwrite")


def _field_flag(group, field, **kw):
    names = [f"--{field}"] + ([f"--{ALIASES[field]}"] if field in ALIASES else [])
    group.add_argument(*names, dest=field, **kw)


def add_model_flags(p):
    g = p.add_argument_group("model (MiniMindConfig fields; on --resume / --init_from they come from the weights)")
    _field_flag(g, "hidden_size", type=int, default=256, help="model width D")
    _field_flag(g, "num_hidden_layers", type=int, default=4, help="transformer blocks")
    _field_flag(g, "num_attention_heads", type=int, default=4, help="attention (query) heads")
    _field_flag(g, "num_key_value_heads", type=int, default=2, help="key/value heads (GQA)")
    _field_flag(g, "intermediate_size", type=int, default=None, help="dense FFN width (default ~pi*D)")
    _field_flag(g, "use_moe", type=int, default=1, choices=(0, 1), help="1: MoE feed-forward, 0: dense")
    _field_flag(g, "num_experts", type=int, default=4, help="experts per MoE layer")
    _field_flag(g, "num_experts_per_tok", type=int, default=2, help="experts per token (top-k)")
    _field_flag(g, "moe_intermediate_size", type=int, default=384, help="SwiGLU width of one expert")
    _field_flag(g, "capacity_factor", type=float, default=None,
                help="expert capacity = ceil(factor * tokens * top_k / experts); default: dropless")
    _field_flag(g, "moe_drop_policy", default="probs", choices=("probs", "position"),
                help="which pairs an over-full expert keeps: highest router weight, or earliest tokens")
    _field_flag(g, "moe_pad_to_capacity", type=int, default=0, choices=(0, 1),
                help="pad every expert's rows to the capacity (fixed GEMM shapes)")
    _field_flag(g, "router_bias_update_rate", type=float, default=0.0,
                help="aux-loss-free balancing: per-expert selection bias moved this much per step (DeepSeek-V3; "
                "e.g. 1e-3; 0 = off). Combine with --router_aux_loss_type none or a small coef")
    _field_flag(g, "dropout", type=float, default=0.0, help="dropout probability")
    _field_flag(g, "max_position_embeddings", type=int, default=2048, help="longest sequence the model supports")
    g = p.add_argument_group("training choices (MiniMindConfig training fields: may change on --resume)")
    _field_flag(g, "moe_impl", default="sorted", choices=("sorted", "fused"),
                help="MoE expert compute: sorted (bitwise = masked reference, 1 host sync per layer) or fused "
                "(no host sync, grouped GEMM + Triton kernels on GPU)")
    _field_flag(g, "moe_expert_alignment", type=int, default=1, help="pad each expert's rows to a multiple of this")
    _field_flag(g, "router_aux_loss_coef", type=float, default=0.01, help="load-balancing loss weight")
    _field_flag(g, "router_aux_loss_type", default="minimind", choices=("minimind", "switch", "sequence", "none"),
                help="balance loss: MiniMind's (coef*k when balanced), Switch k-normalised (coef when balanced), "
                "DeepSeek-V3 per-sequence, or none (see model/router.py)")
    _field_flag(g, "router_z_loss_coef", type=float, default=0.0, help="router z-loss weight (ST-MoE; 0 = off)")
    _field_flag(g, "router_dtype", default=None, choices=("float32",),
                help="float32: router logits/softmax/top-k in fp32 under bf16/fp16 autocast (default: autocast's)")


def add_optim_flags(p):
    g = p.add_argument_group("optimisation")
    g.add_argument("--max_steps", type=int, default=1250, help="optimizer steps")
    g.add_argument("--batch_size", type=int, default=8, help="sequences per micro-batch and rank")
    g.add_argument("--seq_len", type=int, default=128, help="tokens per sequence")
    g.add_argument("--grad_accum", type=int, default=1, help="micro-batches per optimizer step")
    g.add_argument("--learning_rate", type=float, default=3e-3, help="peak learning rate")
    g.add_argument("--warmup_steps", type=int, default=50, help="linear warmup steps, then cosine to lr/10")
    g.add_argument("--weight_decay", type=float, default=0.1, help="AdamW weight decay on matrices")
    g.add_argument("--grad_clip", type=float, default=1.0, help="max global grad norm (0 = off)")
    g.add_argument("--seed", type=int, default=1337, help="seed for init and data order")


def add_run_flags(p, default_out_dir):
    g = p.add_argument_group("run")
    g.add_argument("--out_dir", default=default_out_dir, help="where checkpoint, tokenizer and plots go")
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
    g.add_argument("--overwrite", action="store_true",
                   help="start a new run in an --out_dir that holds another run's checkpoint (replacing it)")
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


def build_parser(stage):
    p = argparse.ArgumentParser(description=stage.description, formatter_class=argparse.RawDescriptionHelpFormatter)
    stage.add_data_flags(p.add_argument_group("data"))
    add_model_flags(p)
    add_optim_flags(p)
    add_run_flags(p, stage.default_out_dir)
    return p


def architecture_flags():
    """Config fields that define the function (their flags are ignored on --resume / --init_from; the
    --vocab_size flag sizes a new tokenizer, which such a run does not train either)."""
    return sorted(CONFIG_FIELDS - set(MiniMindConfig.training_fields()))


def config_from_args(args, vocab_size):
    """MiniMindConfig from every flag named like a config field; vocab_size from the tokenizer.
    Raises ValueError naming the field when a value is invalid."""
    fields = {k: v for k, v in vars(args).items() if k in CONFIG_FIELDS and k != "vocab_size"}
    fields["use_moe"] = bool(fields["use_moe"])
    fields["moe_pad_to_capacity"] = bool(fields["moe_pad_to_capacity"])
    return MiniMindConfig(vocab_size=vocab_size, **fields)


def training_overrides(args):
    """The training fields as the flags set them: they replace the weights' config on resume / init_from."""
    return {f: getattr(args, f) for f in MiniMindConfig.training_fields()}


def saved_flags(args):
    """The flags as stored in a checkpoint (private attributes such as the loaded checkpoint left out)."""
    return {k: v for k, v in vars(args).items() if not k.startswith("_")}


def parse_args(stage, argv=None):
    """Parse a stage's flags. With --resume the checkpoint is read here, once: its saved flags become
    the defaults and the loaded dict rides along as `args._checkpoint` for the trainer. Exits with a
    one-line parser error for invalid values."""
    parser = build_parser(stage)
    args = parser.parse_args(argv)
    args._checkpoint = None
    if args.resume:
        args = _merge_resume(parser, stage, args, argv)
    _validate(parser, args)
    args.stage = stage.name
    return args


def _merge_resume(parser, stage, args, argv):
    path = args.resume
    if path == "auto":
        path = os.path.join(args.out_dir, CKPT_NAME)
    elif os.path.isdir(path):
        path = os.path.join(path, CKPT_NAME)
    try:
        ckpt = load_checkpoint(path)
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e))
    if not ckpt.get("args") or ckpt.get("optimizer") is None or "data" not in ckpt:
        parser.error(f"{path}: holds weights but no training state (an imported or exported model?); "
                     f"start from it with --init_from instead of --resume")
    saved = {OLD_NAMES.get(k, k): v for k, v in ckpt["args"].items()}  # checkpoints saved before the renaming
    # Flags given now override; everything else (data, batch, seq_len, schedule...) comes from the run.
    parser.set_defaults(**{k: v for k, v in saved.items() if k not in PER_INVOCATION and k != "stage"})
    args = parser.parse_args(argv)
    args.resume, args._checkpoint = path, ckpt
    if args.out_dir == saved.get("out_dir") and os.path.isfile(path):
        args.out_dir = os.path.dirname(os.path.abspath(path))  # keep writing next to the checkpoint
    for k in ("seq_len", "seed") + stage.data_order_flags:  # the saved data position points into their windows
        if getattr(args, k) != saved.get(k, getattr(args, k)):
            parser.error(f"--{k} cannot change on resume (checkpoint: {saved.get(k)!r}, now: {getattr(args, k)!r}): "
                         f"the saved data position refers to the original windows")
    _keep_global_batch(parser, args, saved, ckpt.get("world_size", 1), argv)
    changed = [f"--{k}" for k in architecture_flags() if k in saved and getattr(args, k, saved[k]) != saved[k]]
    if changed:
        print(f"warning: {', '.join(changed)} ignored on resume: the architecture comes from the checkpoint",
              file=sys.stderr)
    return args


def _keep_global_batch(parser, args, saved, saved_world, argv):
    """--batch_size is per rank: when the world size differs from the checkpoint's, derive it so the global
    batch stays the run's (refused when it does not divide); an explicit --batch_size wins, with a note."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == saved_world or "batch_size" not in saved:
        return
    global_batch = saved["batch_size"] * saved_world
    explicit = any(a == "--batch_size" or a.startswith("--batch_size=") for a in (sys.argv[1:] if argv is None else argv))
    if explicit:
        if args.batch_size * world != global_batch:
            print(f"note: the global batch changes from {global_batch} ({saved_world} ranks x {saved['batch_size']}) to "
                  f"{args.batch_size * world} ({world} x --batch_size {args.batch_size})", file=sys.stderr)
        return
    if global_batch % world:
        parser.error(f"the checkpoint's global batch of {global_batch} ({saved_world} ranks x {saved['batch_size']}) "
                     f"does not divide over {world} ranks; pass --batch_size to choose a new one")
    args.batch_size = global_batch // world
    print(f"note: {world} rank(s) instead of the checkpoint's {saved_world}: --batch_size {args.batch_size} per rank "
          f"keeps the global batch of {global_batch}", file=sys.stderr)


def _validate(parser, args):
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
        defaults = vars(parser.parse_args([]))
        ignored = [f"--{k}" for k in architecture_flags() if k in defaults and getattr(args, k) != defaults[k]]
        if ignored:
            print(f"warning: {', '.join(ignored)} ignored with --init_from: the architecture comes from "
                  f"{args.init_from}", file=sys.stderr)
