"""Command-line flags shared by every training stage, and how a resume merges them with the checkpoint's.

A flag that sets a `MiniMindConfig` field is named like the field (`--num_hidden_layers`), so the config
is built by name (`config_from_args`) and adding a field takes two edits: the field in model/config.py
and its flag here. The shorter names of earlier versions (`--num_layers`, `--top_k`, ...) still work
as aliases, also inside old checkpoints' saved flags.

Everything a run can be refused for without reading data is checked in `parse_args`, before any folder
is made: each flag's range (`RANGES`, also shown in --help) and the model config the flags describe. An
error is one line naming the flag as the user typed it (`--top_k`, not the config field), exit code 2.
"""
import argparse
import math
import os
import re
import sys
from dataclasses import dataclass

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
PER_INVOCATION = ("resume", "stop_after", "ep_size", "overwrite", "threads")
UNLIMITED_STEPS = 10**12  # --max_steps of a new --time_budget_s run that names none


@dataclass(frozen=True)
class Range:
    """The values a numeric flag accepts: finite, within [lo, hi] (an end is excluded when *_open)."""
    lo: float
    hi: float = math.inf
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, v):
        return (math.isfinite(v) and (v > self.lo if self.lo_open else v >= self.lo)
                and (v < self.hi if self.hi_open or self.hi == math.inf else v <= self.hi))

    def __str__(self):
        if self.hi == math.inf:
            return f"{'>' if self.lo_open else '>='} {self.lo}"
        return f"{'(' if self.lo_open else '['}{self.lo}, {self.hi}{')' if self.hi_open else ']'}"


AT_LEAST_1, AT_LEAST_0, POSITIVE = Range(1), Range(0), Range(0, lo_open=True)
# Every numeric flag's allowed values (None, where a flag allows it, means "unset"). Loss weights above 10
# and a bias step above 1 (the router scores are probabilities) are typos, not experiments.
RANGES = {
    **dict.fromkeys(("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "intermediate_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                     "max_position_embeddings", "moe_expert_alignment", "max_steps", "batch_size", "seq_len",
                     "grad_accum", "eval_interval", "eval_tokens", "save_interval", "log_interval", "ep_size"),
                    AT_LEAST_1),
    **dict.fromkeys(("warmup_steps", "weight_decay", "grad_clip", "stop_after", "sample_tokens", "time_budget_s"),
                    AT_LEAST_0),
    "learning_rate": POSITIVE, "capacity_factor": POSITIVE, "dropout": Range(0, 1, hi_open=True),
    "router_aux_loss_coef": Range(0, 10), "router_z_loss_coef": Range(0, 10), "router_bias_update_rate": Range(0, 1),
    "seed": Range(0, 2**32 - 1),
    # the pretraining stage's data flags (checked where a stage has them)
    "vocab_size": Range(259),  # 256 bytes + 3 special tokens (data/tokenizer.py)
    "tokenizer_sample_mb": AT_LEAST_1, "data_workers": AT_LEAST_0,
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help keeps the description's layout and shows every flag's default."""


class Parser(argparse.ArgumentParser):
    """argparse with the project's error style: a one-line usage hint and one `error:` line, exit code 2
    (not the ~20 lines of usage argparse prints), naming an aliased flag by the spelling the user typed."""

    def __init__(self, **kw):
        # no prefix abbreviations: `--batch 4` would set --batch_size without the resume logic (which looks
        # for the flags the command line names) seeing it, and a new flag could change what a prefix means
        super().__init__(formatter_class=HelpFormatter, allow_abbrev=False, **kw)
        self.argv = []

    def parse_known_args(self, args=None, namespace=None):
        self.argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def typed(self, dest):
        """The flag setting `dest` as this command line spells it (its last use), else its main name."""
        names = self._names(dest)
        used = [a.split("=")[0] for a in self.argv if a.split("=")[0] in names]
        return used[-1] if used else names[0]

    def given(self, dest):
        """Whether this command line sets `dest` (under any of its names)."""
        return any(a.split("=")[0] in self._names(dest) for a in self.argv)

    def _names(self, dest):
        return next((a.option_strings for a in self._actions if a.dest == dest and a.option_strings), [f"--{dest}"])

    def error(self, message):
        m = re.match(r"argument (\S+): ", message)  # argparse names an option by all its spellings: a/b
        if m and "/" in m.group(1):
            typed = [n for n in m.group(1).split("/") if any(a.split("=")[0] == n for a in self.argv)]
            message = f"argument {(typed or m.group(1).split('/'))[-1]}: {message[m.end():]}"
        sys.stderr.write(f"usage: {self.prog} [flags]; see --help\nerror: {message}\n")
        sys.exit(2)


class Switch(argparse.Action):
    """An on/off flag: the first spelling sets True, the second False. Switches a resume inherits from the
    checkpoint need the second (`--compile` / `--no_compile`) to be turned off again."""

    def __init__(self, option_strings, dest, default=False, help=None):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, option_string == self.option_strings[0])

    def format_usage(self):
        return " | ".join(self.option_strings)


def check_ranges(parser, args, ranges=RANGES):
    """parser.error naming the flag (as typed) whose value is outside its range."""
    for dest, allowed in ranges.items():
        v = getattr(args, dest, None)
        if v is not None and v not in allowed:
            bounded = allowed.hi != math.inf
            what = f"in {allowed}" if bounded else str(allowed) + (" and finite" if isinstance(v, float) else "")
            parser.error(f"{parser.typed(dest)} must be {what}, got {v}")


def show_ranges(parser, ranges=RANGES):
    """Add each flag's allowed range to its --help text."""
    for action in parser._actions:
        if action.dest in ranges:
            action.help = f"{action.help} (allowed: {ranges[action.dest]})"


def _field_flag(group, field, **kw):
    names = [f"--{field}"] + ([f"--{ALIASES[field]}"] if field in ALIASES else [])
    group.add_argument(*names, dest=field, **kw)


def add_model_flags(p):
    g = p.add_argument_group("model (MiniMindConfig fields; on --resume / --init_from they come from the weights)")
    _field_flag(g, "hidden_size", type=int, default=256, help="model width D")
    _field_flag(g, "num_hidden_layers", type=int, default=4, help="transformer blocks")
    _field_flag(g, "num_attention_heads", type=int, default=4, help="attention (query) heads")
    _field_flag(g, "num_key_value_heads", type=int, default=2, help="key/value heads (GQA)")
    _field_flag(g, "intermediate_size", type=int, default=None, help="dense FFN width (None: ~pi*D)")
    _field_flag(g, "use_moe", type=int, default=1, choices=(0, 1), help="1: MoE feed-forward, 0: dense")
    _field_flag(g, "num_experts", type=int, default=4, help="experts per MoE layer")
    _field_flag(g, "num_experts_per_tok", type=int, default=2, help="experts per token (top-k)")
    _field_flag(g, "moe_intermediate_size", type=int, default=384, help="SwiGLU width of one expert")
    _field_flag(g, "capacity_factor", type=float, default=None,
                help="expert capacity = ceil(factor * tokens * top_k / experts); None: dropless")
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
    _field_flag(g, "moe_impl", default="fused", choices=("sorted", "fused", "masked"),
                help="MoE expert compute: fused (no host sync; grouped GEMM + Triton kernels on GPU, oneDNN expert "
                "chains on CPU; the fastest end to end, scripts/bench_step.py; the default is sorted under --ep_size > 1), sorted (bitwise = masked reference, 1 "
                "host sync per layer) or masked (MiniMind's per-expert loop, 3 host "
                "syncs per expert: a baseline for benchmarks; not with --ep_size > 1)")
    _field_flag(g, "moe_expert_alignment", type=int, default=1, help="pad each expert's rows to a multiple of this")
    _field_flag(g, "router_aux_loss_coef", type=float, default=0.01, help="load-balancing loss weight")
    _field_flag(g, "router_aux_loss_type", default="minimind", choices=("minimind", "switch", "sequence", "none"),
                help="balance loss: MiniMind's (coef*k when balanced), Switch k-normalised (coef when balanced), "
                "DeepSeek-V3 per-sequence, or none (see model/router.py)")
    _field_flag(g, "router_z_loss_coef", type=float, default=0.0, help="router z-loss weight (ST-MoE; 0 = off)")
    _field_flag(g, "router_dtype", default=None, choices=("float32",),
                help="float32: router logits/softmax/top-k in fp32 under bf16/fp16 autocast (None: autocast's)")
    _field_flag(g, "attn_impl", default="auto", choices=("auto", "sdpa", "explicit"),
                help="attention kernel: sdpa (torch's fused), explicit (scores written out; faster on CPU in bf16 at "
                "short lengths), auto = on CPU the faster one measured at setup (kept in the checkpoint), else sdpa")
    _field_flag(g, "linear_backend", default="auto", choices=("auto", "onednn", "torch"),
                help="engine of the attention / LM-head / dense-FFN GEMMs: auto = oneDNN for CPU fp32 (faster than "
                "torch's MKL path on many CPUs), else F.linear; torch = F.linear always")
    _field_flag(g, "lm_loss_impl", default="auto", choices=("auto", "chunked", "torch"),
                help="LM-head cross-entropy: chunked (softmax chunk by chunk in cache, no fp32 logits; faster on "
                "CPU), torch (F.cross_entropy on fp32 logits), auto = chunked on CPU, else torch")


def add_optim_flags(p):
    g = p.add_argument_group("optimisation")
    g.add_argument("--max_steps", type=int, default=1300,
                   help="optimizer steps (with --time_budget_s only an upper bound: a new run's default is then "
                   "unlimited)")
    g.add_argument("--batch_size", type=int, default=16, help="sequences per micro-batch and rank")
    g.add_argument("--seq_len", type=int, default=128, help="tokens per sequence")
    g.add_argument("--grad_accum", type=int, default=1, help="micro-batches per optimizer step")
    g.add_argument("--learning_rate", type=float, default=3e-3, help="peak learning rate")
    g.add_argument("--warmup_steps", type=int, default=50, help="linear warmup steps, then cosine to lr/10")
    g.add_argument("--time_budget_s", type=float, default=0.0,
                   help="train for this many seconds of training wall clock (train steps and logging; not setup, "
                   "evaluation or saving; --resume continues the budget) with the LR planned by time: after "
                   "--warmup_steps the cosine decay's progress is the fraction of the budget used, reaching lr/10 at "
                   "the budget; then the final evaluation and checkpoint, as at --max_steps. Checked after every "
                   "step in one process; with several ranks every --log_interval steps, where the all-reduce that "
                   "already carries stop signals gives every rank the largest clock (the LR then moves at log steps "
                   "and a run may pass the budget by up to log_interval - 1 steps). The LR then depends on the "
                   "machine's speed, so such a run does not repeat bit for bit. 0 = off")
    g.add_argument("--weight_decay", type=float, default=0.1, help="AdamW weight decay on matrices")
    g.add_argument("--grad_clip", type=float, default=1.0, help="max global grad norm (0 = off)")
    g.add_argument("--seed", type=int, default=1337, help="seed for init and data order")


def threads_flag(value):
    """--threads: "auto" or an int >= 1."""
    if value == "auto":
        return value
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be auto or an integer >= 1, got {value!r}")
    return n


def add_run_flags(p, default_out_dir):
    g = p.add_argument_group("run")
    g.add_argument("--out_dir", default=default_out_dir, help="where checkpoint, tokenizer and plots go")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    g.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="autocast dtype; auto = bfloat16 on CUDA; on CPU bfloat16 where measured faster (native bf16 GEMMs: AVX512-BF16 / AMX), else float32 (weights stay fp32)")
    g.add_argument("--threads", type=threads_flag, default="auto",
                   help="CPU threads: auto = the fastest of torch's count, half of it, ... 1, re-measured while "
                   "training (train/threads.py: another busy process on the cores can make fewer threads much "
                   "faster); N = fixed. Multi-process runs keep torch's count (OMP_NUM_THREADS)")
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
    # on/off switches: a resume inherits them from the checkpoint, so each has an off form
    g.add_argument("--compile", "--no_compile", action=Switch, help="torch.compile the model (--no_compile: off)")
    g.add_argument("--wandb", "--no_wandb", action=Switch,
                   help="log to Weights & Biases, offline unless logged in (--no_wandb: off)")
    g.add_argument("--wandb_project", default="minimind-moe", help="wandb project name")
    g.add_argument("--sample_tokens", type=int, default=48, help="tokens to sample at the end (0 = none)")
    g.add_argument("--show_load", type=int, default=1, choices=(0, 1), help="show expert load in the progress bar")
    g.add_argument("--no_progress", "--progress", action=Switch,
                   help="no progress bar, logs only (--progress: show it)")


def build_parser(stage):
    p = Parser(description=stage.description)
    stage.add_data_flags(p.add_argument_group("data"))
    add_model_flags(p)
    add_optim_flags(p)
    add_run_flags(p, stage.default_out_dir)
    p.set_defaults(**stage.defaults)
    show_ranges(p)
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


def adopt_architecture(args, config):
    """Set the architecture flags to what the run uses (the checkpoint's or the initial weights' config, not
    ignored flags), so the flags saved with the next checkpoint are true. --vocab_size stays: it is the size
    of a tokenizer to train, not the model's."""
    for k in architecture_flags():
        if k != "vocab_size" and hasattr(args, k):
            v = getattr(config, k)
            setattr(args, k, int(v) if isinstance(v, bool) else v)  # 0/1 flags (--use_moe)


def saved_flags(args):
    """The flags as stored in a checkpoint (private attributes such as the loaded checkpoint left out)."""
    return {k: v for k, v in vars(args).items() if not k.startswith("_")}


def parse_args(stage, argv=None):
    """Parse a stage's flags and check everything that needs no data: ranges, combinations, the model
    config. With --resume the checkpoint is read here, once: its saved flags become the defaults and the
    loaded dict rides along as `args._checkpoint` for the trainer. Exits with a one-line parser error
    (exit code 2) naming the flag as typed; nothing is written before that."""
    parser = build_parser(stage)
    args = parser.parse_args(argv)
    args._checkpoint = None
    if args.resume:
        args = _merge_resume(parser, stage, args, argv)
    elif args.time_budget_s and not parser.given("max_steps"):
        args.max_steps = UNLIMITED_STEPS  # the budget ends the run (a resume keeps the checkpoint's value)
    _validate(parser, args)
    _check_config(parser, args)
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
            parser.error(f"{parser.typed(k)} cannot change on resume (checkpoint: {saved.get(k)!r}, now: "
                         f"{getattr(args, k)!r}): the saved data position refers to the original windows")
    _keep_global_batch(parser, args, saved, ckpt.get("world_size", 1), argv)
    changed = [parser.typed(k) for k in architecture_flags() if k in saved and getattr(args, k, saved[k]) != saved[k]]
    if changed:  # (_check_config then sets them to the checkpoint's values, which the next save stores)
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
    trains_tokenizer = getattr(args, "tokenizer", None) is None and not args.resume and not args.init_from
    check_ranges(parser, args, {k: r for k, r in RANGES.items() if k != "vocab_size" or trains_tokenizer})
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", args.device):
        parser.error(f"--device must be auto, cpu, cuda or cuda:N, got {args.device!r}")
    if args.init_from and not args.resume:
        ignored = [parser.typed(k) for k in architecture_flags()
                   if hasattr(args, k) and getattr(args, k) != parser.get_default(k)]
        if ignored:
            print(f"warning: {', '.join(ignored)} ignored with --init_from: the architecture comes from "
                  f"{args.init_from}", file=sys.stderr)


def _check_config(parser, args):
    """Build the model config the flags describe, so that an invalid one is refused before any data work:
    a new run's from the flags (the tokenizer's size is not known yet: --vocab_size stands in), a resumed
    run's from the checkpoint with these training fields. (--init_from's is checked when its weights load:
    every flag that may change it has been range-checked.)"""
    from huggingface_hub.errors import StrictDataclassError
    if args.ep_size > 1 and not args.resume and not parser.given("moe_impl"):
        # the default under EP: fused + EP can break when a rank's experts receive no token (a gloo size
        # mismatch seen with --router_aux_loss_coef 0; balanced routing works); sorted has no such case
        args.moe_impl = "sorted"
    if args.init_from and not args.resume:
        return
    try:
        if args.resume:
            config = MiniMindConfig.from_dict({**args._checkpoint["config"], **training_overrides(args)})
        else:
            config = config_from_args(args, max(1, getattr(args, "vocab_size", 1)))
    except (ValueError, TypeError, StrictDataclassError) as e:
        parser.error(name_flags(parser, str(e)))
    if args.resume:
        adopt_architecture(args, config)
    if args.seq_len > config.max_position_embeddings:
        parser.error(f"{parser.typed('seq_len')} {args.seq_len} exceeds {parser.typed('max_position_embeddings')} "
                     f"{config.max_position_embeddings}")
    if args.ep_size > 1 and (not config.use_moe or config.num_experts % args.ep_size):
        parser.error(f"--ep_size {args.ep_size} must divide {parser.typed('num_experts')} {config.num_experts} of an "
                     f"MoE model")
    if args.ep_size > 1 and config.moe_impl == "masked":  # the loop runs every expert here: nothing to shard
        parser.error(f"--ep_size {args.ep_size} needs {parser.typed('moe_impl')} sorted or fused, not masked")


def name_flags(parser, message):
    """A MiniMindConfig error in the user's terms: each field that has a flag becomes that flag as typed
    (`MiniMindConfig.num_experts_per_tok=8 must be <= num_experts=4` -> `--top_k 8 must be <= --num_experts 4`)."""
    fields = {a.dest for a in parser._actions if a.option_strings} & CONFIG_FIELDS
    pattern = r"(?:MiniMindConfig\.)?\b(" + "|".join(sorted(fields, key=len, reverse=True)) + r")\b(?:=([^\s,;)]+))?"

    def flag(m):
        value = {"True": "1", "False": "0"}.get(m.group(2), m.group(2))  # the 0/1 flags (--use_moe)
        return parser.typed(m.group(1)) + (f" {value}" if value else "")

    message = re.sub(pattern, flag, message).replace(" (or set head_dim explicitly)", "")  # (no such flag)
    if message.startswith("MiniMindConfig.head_dim"):  # derived: say which flags it comes from
        message += f" (head_dim = {parser.typed('hidden_size')} / {parser.typed('num_attention_heads')})"
    return message
