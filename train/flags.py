"""Command-line flags shared by every training stage, and how a resume merges them with the checkpoint's.

Each flag is declared once: name, type, default, allowed values (`add`: a Range, shown in --help and
checked at parse time) and help. A flag that sets a `MiniMindConfig` field is built from the field's
declaration (model/config.py: `knob`), so the config is built by name (`build_config`) and a new field
is one edit. The one place training departs from the layer's defaults is model/config.py:
`TRAINING_DEFAULTS` (`trained_config`: the main job's model).

`parse_args` checks everything that needs neither data nor the model: each flag's range, the device, and on
--resume the flags saved in the checkpoint; `build_config` checks how the model's fields combine
(MiniMindConfig's own validation, its ConfigError worded in flags). An error is one line naming the flag as
typed, exit code 2; nothing is written before that. `args` is not changed after parsing: what a run resolved
later (the architecture of --resume / --init_from weights, --dtype auto) goes into the checkpoint through
`flags_to_save`.
"""
import argparse
import os
import re
import sys
import typing

from model.config import (AT_LEAST_0, AT_LEAST_1, POSITIVE, TRAINING_DEFAULTS, ConfigError, MiniMindConfig, Range,
                          trained_config)

CONFIG_FIELDS = set(MiniMindConfig.__dataclass_fields__)
# Flags a resume never takes from the checkpoint: they describe this invocation, not the run.
PER_INVOCATION = ("resume", "stop_after", "ep_size", "fsdp", "overwrite")
# What an upcycled model keeps of the dense one (--upcycle_from); its MoE fields come from the flags
TRUNK_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "intermediate_size", "max_position_embeddings", "rope_theta", "rms_norm_eps", "dropout",
                "tie_word_embeddings", "initializer_range", "pad_token_id", "bos_token_id", "eos_token_id")
UNLIMITED_STEPS = 10**12  # --max_steps of a run given --time_budget_s on its command line without --max_steps


class Parser(argparse.ArgumentParser):
    """argparse with the project's error style (one usage hint, one `error:` line, exit code 2), no prefix
    abbreviations (`--batch 4` would slip past the resume logic), and every default in --help."""

    def __init__(self, **kw):
        fmt = type("Fmt", (argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter), {})
        super().__init__(formatter_class=fmt, allow_abbrev=False, **kw)

    def error(self, message):
        sys.stderr.write(f"usage: {self.prog} [flags]; see --help\nerror: {message}\n")
        sys.exit(2)

    def parse_args(self, args=None, namespace=None, check=True):
        """argparse's, then (with `check`) each value against its flag's allowed range (`add`; parser.error
        naming the flag)."""
        parsed = super().parse_args(args, namespace)
        if check:
            check_ranges(self, parsed)
        return parsed


def add(group, *names, allowed=None, **kw):
    """group.add_argument(*names, **kw), with the values the flag allows (`allowed`: a Range) declared with it:
    shown in --help, checked by Parser.parse_args."""
    if allowed is not None:
        kw["help"] = f"{kw.get('help', '')} (allowed: {allowed})"
    action = group.add_argument(*names, **kw)
    action.allowed = allowed
    return action


def utf8_text(value):
    """argparse type of a free-text flag (--prompt): refuses bytes that are not UTF-8 (argv carries them as
    lone surrogates, which no tokenizer takes)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError("not valid UTF-8 text") from None
    return value


def run_tool(main):
    """A user tool's entry point: bad input (a ValueError, e.g. model/hf_adapter.py's ExportError, or an
    OSError: a missing file, a folder that cannot be written) ends it with one `error:` line and exit code 2;
    Ctrl-C with exit code 130 and no traceback (what it printed stays)."""
    try:
        main()
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.stdout.flush()
        sys.stderr.write("\n(interrupted)\n")
        sys.exit(130)


class Switch(argparse.Action):
    """An on/off flag: the first spelling sets True, the second False (switches a resume inherits need
    their off form: `--compile` / `--no_compile`)."""

    def __init__(self, option_strings, dest, default=False, help=None):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, option_string == self.option_strings[0])


def check_ranges(parser, args, skip=()):
    """parser.error naming the flag whose value is outside its range (`add`), but for the flags in `skip`."""
    for action in parser._actions:
        allowed, value = getattr(action, "allowed", None), getattr(args, action.dest, None)
        if allowed is not None and value is not None and action.dest not in skip and value not in allowed:
            parser.error(f"--{action.dest} must be {allowed.worded(value)}, got {value}")


def add_model_flags(parser):
    """A flag for each MiniMindConfig field declared with one (model/config.py: `knob`), in two groups: the
    architecture and the training choices; its type, default (TRAINING_DEFAULTS first; bools as 0/1), allowed
    values and help from the field."""
    groups = {False: parser.add_argument_group("model (MiniMindConfig fields, model/config.py; on --resume / "
                                               "--init_from the architecture comes from the weights)"),
              True: parser.add_argument_group("training choices (MiniMindConfig training fields: may change on "
                                              "--resume)")}
    for name, f in MiniMindConfig.__dataclass_fields__.items():
        if not f.metadata.get("flag"):
            continue
        default, allowed = TRAINING_DEFAULTS.get(name, f.default), f.metadata["allowed"]
        kind = next(t for t in typing.get_args(f.type) or (f.type,) if t is not type(None))
        if kind is bool:
            kw = dict(type=int, choices=(0, 1), default=flag_value(default))
        elif isinstance(allowed, tuple):
            kw = dict(choices=tuple(c for c in allowed if c is not None), default=default)
        else:
            kw = dict(type=kind, default=default, allowed=allowed)
        add(groups[f.metadata["training"]], f"--{name}", help=f.metadata["doc"], **kw)


def add_train_flags(parser, default_out_dir):
    group = parser.add_argument_group("optimisation")
    add(group, "--max_steps", type=int, default=1300, allowed=AT_LEAST_1,
        help="optimizer steps (with --time_budget_s an upper bound)")
    add(group, "--batch_size", type=int, default=16, allowed=AT_LEAST_1, help="sequences per micro-batch and rank")
    add(group, "--seq_len", type=int, default=128, allowed=AT_LEAST_1, help="tokens per sequence")
    add(group, "--grad_accum", type=int, default=1, allowed=AT_LEAST_1, help="micro-batches per optimizer step")
    add(group, "--learning_rate", type=float, default=3e-3, allowed=POSITIVE, help="peak learning rate")
    add(group, "--warmup_steps", type=int, default=50, allowed=AT_LEAST_0,
        help="linear warmup steps, then cosine to lr/10")
    add(group, "--time_budget_s", type=float, default=0.0, allowed=AT_LEAST_0,
        help="seconds of training (not setup, evaluation or saving; a resume continues them), checked every step: "
        "the measured step time plans the run's steps (at most --max_steps; re-planned when the speed drifts) and "
        "the cosine runs over them. 0 = train --max_steps steps")
    add(group, "--weight_decay", type=float, default=0.1, allowed=AT_LEAST_0, help="AdamW weight decay on matrices")
    add(group, "--grad_clip", type=float, default=1.0, allowed=AT_LEAST_0, help="max global grad norm (0 = off)")
    add(group, "--seed", type=int, default=1337, allowed=Range(0, 2**32 - 1), help="seed for init and data order")
    group = parser.add_argument_group("run")
    add(group, "--out_dir", default=default_out_dir, help="where checkpoint, tokenizer and plots go")
    add(group, "--device", default="auto", help="auto | cpu | cuda | cuda:N")
    add(group, "--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
        help="autocast dtype; auto = bfloat16 on CUDA, and on a CPU where bf16 trains faster than fp32 (AMX; "
        "AVX512-BF16 on AMD), else float32; a resume keeps the run's")
    add(group, "--threads", default="auto", help="CPU threads, fixed for the run (train/threads.py): auto = "
        "OMP_NUM_THREADS or the cores torch may use; a resume keeps the run's count")
    add(group, "--eval_interval", type=int, default=250, allowed=AT_LEAST_1, help="steps between validation runs")
    add(group, "--eval_tokens", type=int, default=16384, allowed=AT_LEAST_1, help="validation tokens per evaluation")
    add(group, "--save_interval", type=int, default=250, allowed=AT_LEAST_1, help="steps between checkpoints")
    add(group, "--log_interval", type=int, default=10, allowed=AT_LEAST_1,
        help="steps between progress/metrics updates")
    add(group, "--resume", nargs="?", const="auto", default=None,
        help="resume from a checkpoint (path, or out_dir/ckpt.pt without a value); architecture and unspecified "
        "flags come from it")
    add(group, "--overwrite", action="store_true", help="start a new run in an --out_dir that holds one")
    add(group, "--init_from", default=None, help="start from these weights (a run dir / checkpoint, or an HF folder "
        "from export_hf.py); architecture and tokenizer from there, optimizer and step fresh")
    add(group, "--upcycle_from", default=None, help="start an MoE from a dense run's weights (sparse upcycling): "
        "trunk and tokenizer from there, each FFN cut into the experts the MoE flags describe")
    add(group, "--ep_size", type=int, default=1, allowed=AT_LEAST_1, help="expert-parallel group size (divides the "
        "world size and num_experts); launch with torchrun --nproc_per_node N")
    add(group, "--fsdp", action="store_true", help="shard the dense parameters, grads and optimizer state over the "
        "ranks with FSDP2 (DDP replicates them); checkpoints are then sharded")
    add(group, "--stop_after", type=int, default=0, allowed=AT_LEAST_0,
        help="stop after this many steps of this invocation, with a checkpoint (0 = run to max_steps)")
    add(group, "--compile", "--no_compile", action=Switch, help="torch.compile the model")
    add(group, "--wandb", "--no_wandb", action=Switch, help="log to Weights & Biases, offline unless logged in")
    add(group, "--wandb_project", default="minimind-moe", help="wandb project name")
    add(group, "--sample_tokens", type=int, default=48, allowed=AT_LEAST_0,
        help="tokens to sample at the end (0 = none)")
    add(group, "--show_load", type=int, default=1, choices=(0, 1), help="expert load in the progress bar")
    add(group, "--no_progress", "--progress", action=Switch, help="no progress bar, logs only")


def build_parser(stage):
    parser = Parser(description=stage.description)
    stage.add_data_flags(parser.add_argument_group("data"))
    add_model_flags(parser)
    add_train_flags(parser, stage.default_out_dir)
    parser.set_defaults(**stage.defaults)
    return parser


def architecture_fields():
    """Config fields that define the function (from the weights on --resume / --init_from)."""
    return sorted(CONFIG_FIELDS - set(MiniMindConfig.training_fields()))


def given(argv, dest):
    """Whether the command line sets `dest`."""
    return any(a.split("=")[0] == f"--{dest}" for a in (sys.argv[1:] if argv is None else argv))


def parse_args(stage, argv=None):
    """Parse a stage's flags and check what needs no data. With --resume the flags saved in the checkpoint
    become the defaults (flags given now win; the architecture stays the checkpoint's)."""
    parser = build_parser(stage)
    args = parser.parse_args(argv, check=False)
    if args.resume:
        args = _merge_resume(parser, stage, args, argv)
    elif args.time_budget_s and given(argv, "time_budget_s") and not given(argv, "max_steps"):
        args.max_steps = UNLIMITED_STEPS  # the budget plans the run (a resume keeps the checkpoint's value)
    trains_tokenizer = (getattr(args, "tokenizer", None) is None
                        and not (args.resume or args.init_from or args.upcycle_from))
    check_ranges(parser, args, skip=() if trains_tokenizer else ("vocab_size",))
    if args.fsdp and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        parser.error("--fsdp shards over the ranks of a torchrun launch; this is one process (drop --fsdp)")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", args.device):
        parser.error(f"--device must be auto, cpu, cuda or cuda:N, got {args.device!r}")
    cores = os.cpu_count() or 1
    if given(argv, "threads") and args.threads != "auto" and not (
            args.threads.isascii() and args.threads.isdigit() and 1 <= int(args.threads) <= cores):
        parser.error(f"--threads must be auto or an integer from 1 to {cores} (the cores here), got {args.threads!r}")
    if args.resume and not args.time_budget_s and args.max_steps == UNLIMITED_STEPS:
        parser.error("--time_budget_s 0 needs a --max_steps: this run's steps were set by its time budget alone")
    if args.upcycle_from and args.init_from:
        if given(argv, "init_from"):
            parser.error("--init_from and --upcycle_from: pass one")
        args.init_from = None  # a stage's default start (train/sft.py's) gives way to --upcycle_from
    if not args.resume:
        ignored = [f"--{k}" for k in (TRUNK_FIELDS if args.upcycle_from else architecture_fields())
                   if hasattr(args, k) and given(argv, k) and k != "vocab_size"]
        source = args.upcycle_from or args.init_from
        if ignored and source:
            print(f"warning: {', '.join(ignored)} ignored: the {'trunk' if args.upcycle_from else 'architecture'} "
                  f"comes from {source}", file=sys.stderr)
    args.stage = stage.name
    return args


def _merge_resume(parser, stage, args, argv):
    from train.checkpoint import read_saved_flags  # (torch: only a resume needs it while parsing)
    from train.run_dir import checkpoint_in
    path = checkpoint_in(args.out_dir if args.resume == "auto" else args.resume)
    try:
        saved, saved_world = read_saved_flags(path)
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e))
    parser.set_defaults(**{k: v for k, v in saved.items() if k not in PER_INVOCATION and k != "stage"})
    args = parser.parse_args(argv, check=False)
    args.resume = path
    changed = [f"--{k}" for k in architecture_fields()
               if k in saved and k != "vocab_size" and getattr(args, k) != saved[k]]
    if changed:
        print(f"warning: {', '.join(changed)} ignored on resume: the architecture comes from the checkpoint",
              file=sys.stderr)
    if given(argv, "threads") and saved.get("threads", "auto") not in ("auto", args.threads):
        print(f"note: --threads {args.threads} instead of the run's {saved['threads']}: from here the steps round "
              f"differently from an uninterrupted run's", file=sys.stderr)
    if args.out_dir == saved.get("out_dir") and os.path.exists(path):
        args.out_dir = os.path.dirname(os.path.abspath(path))  # keep writing next to the checkpoint
    for k in ("seq_len", "seed") + stage.data_order_flags:  # the saved data position points into their windows
        if getattr(args, k) != saved.get(k, getattr(args, k)):
            parser.error(f"--{k} cannot change on resume (checkpoint: {saved.get(k)!r}, now: {getattr(args, k)!r}): "
                         f"the saved data position refers to the original windows")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != saved_world and not given(argv, "threads") and saved.get("threads", "auto") != "auto":
        print(f"note: {saved['threads']} threads per rank, as the run had on {saved_world} rank(s); --threads sets "
              f"another count (the steps then round differently)", file=sys.stderr)
    if world != saved_world and "batch_size" in saved:  # --batch_size is per rank: keep the global batch
        global_batch = saved["batch_size"] * saved_world
        if given(argv, "batch_size"):
            if args.batch_size * world != global_batch:
                print(f"note: the global batch changes from {global_batch} to {args.batch_size * world}",
                      file=sys.stderr)
        elif global_batch % world:
            parser.error(f"the checkpoint's global batch of {global_batch} ({saved_world} ranks x "
                         f"{saved['batch_size']}) does not divide over {world} ranks; pass --batch_size")
        else:
            args.batch_size = global_batch // world
            print(f"note: {world} rank(s) instead of the checkpoint's {saved_world}: --batch_size {args.batch_size} "
                  f"per rank keeps the global batch of {global_batch}", file=sys.stderr)
    return args


def flag_value(value):
    """A config value as its flag takes it: bools as 0/1."""
    return int(value) if isinstance(value, bool) else value


def as_flags(name, value):
    """A config field in a ConfigError, as the trainer's user knows it: `--num_experts 4`, `--use_moe 1`;
    head_dim, which no flag sets, as derived from the flags that do."""
    if name == "head_dim":
        return f"head_dim {value} (--hidden_size / --num_attention_heads)"
    return f"--{name}" if value is None else f"--{name} {flag_value(value)}"


def flags_to_save(args, config, dtype_name, threads):
    """The flags a checkpoint records: `args` as parsed, with the architecture flags set to what the run's
    `config` holds (flags ignored on --resume / --init_from are not kept, so the next resume has nothing to
    warn about), --dtype to what `auto` resolved to (`dtype_name`) and --threads to the run's count
    (`threads`; None on CUDA), so a resume rounds the same."""
    saved = dict(vars(args), dtype=dtype_name, threads=str(threads) if threads else args.threads)
    for k in architecture_fields():
        if k != "vocab_size" and k in saved:
            saved[k] = flag_value(getattr(config, k))
    return saved


def build_config(args, base=None, vocab_size=None):
    """The run's MiniMindConfig, built once: the architecture from `base` (the checkpoint's or the initial
    weights' config dict) or the flags, the training fields from the flags; vocab_size from the tokenizer
    when known (else the flag). Raises ValueError naming the flags."""
    training = {f: getattr(args, f) for f in MiniMindConfig.training_fields()}
    if base is not None:
        fields = {**base, **training}
    else:
        fields = {k: v for k, v in vars(args).items() if k in CONFIG_FIELDS}
        fields.update(use_moe=bool(fields["use_moe"]), moe_pad_to_capacity=bool(fields["moe_pad_to_capacity"]))
        if vocab_size or getattr(args, "vocab_size", None):  # (else the config's default)
            fields["vocab_size"] = vocab_size or args.vocab_size
    try:
        config = trained_config(**fields)
    except ConfigError as e:
        raise ValueError(e.worded(as_flags)) from None
    if args.seq_len > config.max_position_embeddings:
        raise ValueError(f"--seq_len {args.seq_len} exceeds --max_position_embeddings {config.max_position_embeddings}")
    if args.ep_size > 1 and not config.use_moe:
        raise ValueError(f"--ep_size {args.ep_size} needs an MoE model (--use_moe 1): "
                         "a dense model has no experts to shard")
    if args.ep_size > 1 and config.num_experts % args.ep_size:
        raise ValueError(f"--ep_size {args.ep_size} must divide --num_experts {config.num_experts}")
    return config
