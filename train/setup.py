"""Setting a run up, once, before the first step: device, where the weights come from (a checkpoint to
resume, weights to start from, or nothing), the stage's data, model, optimizer, and the wrappers in a
fixed order (expert parallelism, then DDP, then torch.compile, as torchtitan's parallelize step).
Everything the loop needs ends up in one `Run`."""
import contextlib
import os
import shutil
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from data.sources import DataError
from model.hf_adapter import is_hf_folder
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from data.atomic import atomic_dir
from train.cpu_engines import cpu_attention, cpu_dtype
from train.checkpoint import load_checkpoint, load_hf_checked, model_from_checkpoint
from train.distributed import check_same_on_all_ranks
from train.expert_parallel import expert_param_names, install as install_ep
from train.flags import adopt_architecture, config_from_args, saved_flags, training_overrides
from train.metrics import MetricsLog, open_wandb
from train.run_dir import abandon_run_dir, claim_run_dir
from data.dataset import IGNORE_INDEX

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# What transformers' tokenizers save (and load from) besides the model's files
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model")


@dataclass
class Run:
    """What a run is made of; fixed after setup (the changing part is trainer.TrainState)."""
    args: object
    stage: object
    ctx: object              # train.distributed.DistContext
    device: str
    dtype: torch.dtype       # autocast dtype (fp32 = no autocast); weights stay fp32
    config: MiniMindConfig
    data: object             # train.stage.StageData
    model: torch.nn.Module   # the plain model (checkpoints, eval, telemetry)
    train_model: torch.nn.Module  # what the step calls: model, or DDP / compile around it
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    metrics: MetricsLog
    log: object
    start_step: int = 0
    lock: object = None      # rank 0's lock on out_dir (train/run_dir.py), released when the run ends

    def autocast(self):
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.split(":")[0], dtype=self.dtype)

    @property
    def my_rows(self):
        """This rank's rows of a global batch."""
        b = self.args.batch_size
        return slice(self.ctx.rank * b, (self.ctx.rank + 1) * b)


def resolve_device(args):
    """(device type "cuda" | "cpu", autocast dtype name) from --device / --dtype. Raises ValueError."""
    device_type = args.device.split(":")[0] if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda requested but CUDA is not available")
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device_type == "cuda" else "auto")
    return device_type, dtype  # "auto" on CPU: cpu_dtype decides once the model's shape is known


def setup(stage, args, ctx, device_type, dtype_name, log):
    """Build the Run for `args` on this rank. Raises ValueError / DataError for bad input; a run that fails
    here in a folder it created leaves no folder behind."""
    torch.manual_seed(args.seed)  # the same on every rank: identical initial weights everywhere
    device = (f"cuda:{ctx.local_rank}" if args.device in ("auto", "cuda") else args.device) if device_type == "cuda" else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(device)
    fresh = not os.path.isdir(args.out_dir)
    lock = main_rank_first(ctx, lambda: claim_run_dir(args.out_dir, bool(args.resume), args.overwrite, ctx.is_main))
    try:
        return _build(stage, args, ctx, device_type, device, dtype_name, log, lock)
    except BaseException:
        if fresh and lock is not None:
            abandon_run_dir(args.out_dir, lock)
        raise


def _build(stage, args, ctx, device_type, device, dtype_name, log, lock):
    init_model, tokenizer_dir = weights_source(args)
    # rank 0 builds the caches first, the others then read them
    data = main_rank_first(ctx, lambda: stage.load_data(args, tokenizer_dir, args.batch_size * ctx.world_size, log))
    data.val_targets, data.val_bytes = count_val_bytes(data)
    if ctx.is_main:
        copy_tokenizer(data.tokenizer_dir, os.path.join(args.out_dir, "tokenizer"))
    config = build_config(args, init_model, len(data.tokenizer), ctx)
    if dtype_name == "auto":
        dtype_name = cpu_dtype(ctx, log)
    if config.attn_impl == "auto":  # resolved once: the checkpoint keeps the choice, a resume reuses it
        choice = cpu_attention(DTYPES[dtype_name], log) if device_type == "cpu" else "sdpa"
        config.attn_impl = args.attn_impl = choice
    if ctx.distributed:
        log(describe_ranks(ctx, config))
    model = MiniMindForCausalLM(config)
    if init_model is not None:
        model.load_state_dict(init_model.state_dict(), strict=True)
        log(f"initialised weights from {args.init_from}")
    model = model.to(device)
    optimizer = make_optimizer(model, args)
    # fp16 autocast needs loss scaling on CUDA; a disabled scaler is a no-op for fp32 / bf16
    scaler = torch.amp.GradScaler(device_type, enabled=dtype_name == "float16" and device_type == "cuda")
    start_step = restore(args, model, optimizer, scaler, data, device_type, log) if args.resume else 0
    describe(model, config, device, dtype_name, log)
    train_model = wrap(model, args, ctx, device_type)
    metrics = MetricsLog(args.out_dir, start_step if args.resume else None, ctx.is_main,
                         open_wandb(args, config, args.out_dir) if ctx.is_main else None)
    return Run(args=args, stage=stage, ctx=ctx, device=device, dtype=DTYPES[dtype_name], config=config, data=data,
               model=model, train_model=train_model, optimizer=optimizer, scaler=scaler, metrics=metrics, log=log,
               start_step=start_step, lock=lock)


class PeerFailed(Exception):
    """Another rank failed in a step this one waited for; that rank reports the error (train/trainer.py:
    run_cli stops this one with a note, not a second error or a broken collective's traceback)."""


def main_rank_first(ctx, fn):
    """fn() on rank 0 first, then on the other ranks (rank 0 builds caches / the run folder the others then
    use). When fn fails on rank 0, the others learn it from one broadcast and raise PeerFailed instead of
    waiting at a barrier that rank 0's exit breaks."""
    if not ctx.distributed:
        return fn()
    if ctx.is_main:
        try:
            result = fn()
        except BaseException as e:
            dist.broadcast_object_list([" ".join(f"{type(e).__name__}: {e}".split())], src=0)
            raise
        dist.broadcast_object_list([None], src=0)
        return result
    failure = [None]
    dist.broadcast_object_list(failure, src=0)
    if failure[0] is not None:
        raise PeerFailed(f"rank 0 failed ({failure[0]})")
    return fn()


def describe_ranks(ctx, config):
    """One line: how the ranks share the work (printed once, by rank 0)."""
    ep = ctx.ep_size
    experts = (f"{config.num_experts // ep} of the {config.num_experts} experts per rank, each expert on "
               f"{ctx.world_size // ep} rank(s)" if config.use_moe and ep > 1 else "every rank holds every expert")
    return (f"distributed: world size {ctx.world_size} ({dist.get_backend()}), data parallel size "
            f"{ctx.world_size}, expert parallel size {ep} ({experts})")


def weights_source(args):
    """(model to start from or None, tokenizer dir or None). A resumed or initialised run uses the
    tokenizer saved next to its weights, even when the data cache is gone."""
    init_model, source_dir = None, None
    if args.resume:
        source_dir = os.path.dirname(os.path.abspath(args.resume))
    elif args.init_from:  # trained weights (ours or an exported HF folder), fresh optimizer and step
        if is_hf_folder(args.init_from):
            init_model, source_dir = load_hf_checked(args.init_from), args.init_from
        else:
            init_model = model_from_checkpoint(load_checkpoint(args.init_from))
            source_dir = args.init_from if os.path.isdir(args.init_from) else os.path.dirname(os.path.abspath(args.init_from))
    if args.tokenizer is not None or source_dir is None:
        return init_model, args.tokenizer
    for cand in (os.path.join(source_dir, "tokenizer"), source_dir):
        if os.path.exists(os.path.join(cand, "tokenizer.json")):
            return init_model, cand
    if init_model is not None:  # a fresh tokenizer would not match the trained embeddings
        raise ValueError(f"{args.init_from}: no tokenizer next to the weights; pass --tokenizer DIR")
    return init_model, None


def count_val_bytes(data):
    """(supervised validation targets, UTF-8 bytes of the text they stand for)."""
    from data.tokenizer import token_byte_lengths
    lengths = torch.from_numpy(token_byte_lengths(data.tokenizer))
    targets = nbytes = 0
    for _, y, *_ in data.val_batches:
        y = y[y != IGNORE_INDEX]
        targets += y.numel()
        nbytes += int(lengths[y.clamp(max=len(lengths) - 1)].sum())
    if not targets:
        raise DataError("the validation split has no token to predict (a corpus of a few tokens?); add data")
    return targets, nbytes


def copy_tokenizer(src, dst):
    """Copy the tokenizer files of `src` (a tokenizer folder, or an exported HF folder that also holds the
    weights and configs, which are not copied) into `dst`, atomically."""
    if os.path.abspath(src) == os.path.abspath(dst):
        return
    with atomic_dir(dst) as tmp:
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(src, name)):  # (copyfile: this process's umask, not the source's mode)
                shutil.copyfile(os.path.join(src, name), os.path.join(tmp, name))


def build_config(args, init_model, n_tokens, ctx):
    """The architecture from the checkpoint (resume), the initial weights (init_from) or the flags; the
    training fields always from the flags. Raises ValueError for a config the run cannot use."""
    if args.resume:
        config = MiniMindConfig.from_dict({**args._checkpoint["config"], **training_overrides(args)})
    elif init_model is not None:
        config = MiniMindConfig.from_dict({**init_model.config.to_dict(), **training_overrides(args)})
        adopt_architecture(args, config)  # the checkpoint saves the weights' architecture, not ignored flags
    else:
        config = config_from_args(args, n_tokens)
    if config.vocab_size < n_tokens:
        raise ValueError(f"MiniMindConfig.vocab_size={config.vocab_size} is smaller than the tokenizer's "
                         f"{n_tokens} tokens")
    if args.seq_len > config.max_position_embeddings:
        raise ValueError(f"--seq_len {args.seq_len} exceeds max_position_embeddings={config.max_position_embeddings}")
    if ctx.ep_size > 1 and (not config.use_moe or config.num_experts % ctx.ep_size):
        raise ValueError(f"--ep_size {ctx.ep_size} must divide num_experts={config.num_experts} of an MoE model")
    check_same_on_all_ranks(ctx, "the model config", config.to_dict())
    check_same_on_all_ranks(ctx, "the training flags", {k: v for k, v in saved_flags(args).items() if k != "device"})
    return config


def make_optimizer(model, args):
    """AdamW; weight decay only on matrices (not norms), as nanoGPT / MiniMind. torch's fused
    implementation (one pass over each parameter's weights, gradient and moments) where every parameter
    sits on a CPU or CUDA device in fp32: on CPU it measured ~3x faster than the default per-parameter
    loop (4.5 ms vs 14 ms a step for the main job's 7.2M parameters, 2 cores of an AMD EPYC), the same
    update up to rounding (scripts/test_cpu_speed.py)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    fused = all(p.device.type in ("cpu", "cuda") and p.dtype == torch.float32 for p in params)
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=args.learning_rate, betas=(0.9, 0.95), eps=1e-8, fused=fused or None)


def restore(args, model, optimizer, scaler, data, device_type, log):
    """Load weights, optimizer, loss scaler, data position and RNG from the checkpoint parse_args read;
    returns its step."""
    ckpt = args._checkpoint
    for key, value in data.identity.items():
        if ckpt.get(key) not in (None, value):
            show = lambda v: f"{v:,}" if isinstance(v, int) else repr(v)  # noqa: E731
            raise ValueError(f"{args.resume}: the checkpoint was trained with {key}={show(ckpt[key])} but the data now "
                             f"gives {show(value)}; resume needs the same data and tokenizer")
    model.load_state_dict(ckpt["model"], strict=True)
    optimizer.load_state_dict(ckpt["optimizer"])
    if scaler.is_enabled() and ckpt.get("scaler"):
        scaler.load_state_dict(ckpt["scaler"])
    data.train_batches.load_state_dict(ckpt["data"])
    torch.set_rng_state(ckpt["rng"]["torch"])
    if device_type == "cuda" and ckpt["rng"]["cuda"]:
        torch.cuda.set_rng_state_all(ckpt["rng"]["cuda"])
    log(f"resumed from {args.resume} at step {ckpt['step']}")
    return ckpt["step"]


def describe(model, config, device, dtype, log):
    n_params = sum(p.numel() for p in model.parameters())
    n_active = n_params
    if config.use_moe:
        per_expert = 3 * config.hidden_size * config.moe_intermediate_size
        n_active -= config.num_hidden_layers * (config.num_experts - config.num_experts_per_tok) * per_expert
    kind = f"MoE E={config.num_experts} k={config.num_experts_per_tok}" if config.use_moe else "dense"
    log(f"model: {n_params / 1e6:.2f}M params ({n_active / 1e6:.2f}M active), {kind}, "
        f"{config.num_hidden_layers} layers, D={config.hidden_size}; device {device}, {dtype}")


def wrap(model, args, ctx, device_type):
    """Expert parallelism (the all-to-all dispatcher on every MoE layer), then DDP over the dense
    parameters, then torch.compile. Returns what the training step calls."""
    train_model = model
    if ctx.ep_size > 1:
        install_ep(model, ctx.ep_group, model.config.num_experts)
    if ctx.distributed:
        if ctx.ep_size > 1:  # experts are sharded: their grads are reduced by reduce_expert_grads, not DDP
            DDP._set_params_and_buffers_to_ignore_for_model(model, expert_param_names(model))
        train_model = DDP(model, device_ids=[ctx.local_rank] if device_type == "cuda" else None,
                          find_unused_parameters=False)
    if args.compile:
        train_model = torch.compile(train_model)
    return train_model
