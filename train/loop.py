"""The training loop every stage shares, in one file that reads top to bottom (nanoGPT's train.py,
nanochat's base_train.py):

    1. setup     device, run folder, checkpoint (read once), data, config (built once), model (built with
                 the engines that pay here: train/engines.py), EP (a rank keeps its experts) -> DDP or FSDP,
                 optimizer, restore, compile (torchtitan's order)
    2. loop      train_step: micro-steps -> gradient reduction -> clip -> optimizer -> router update
                 after_step: log, evaluate, save a checkpoint, stop
    3. finish    final evaluation, summary, a short sample

A stage script (train/pretrain.py, train/sft.py) supplies a `Stage`: its flags, its data, its defaults.
Batches carry the loss mask in the labels (IGNORE_INDEX where a position predicts nothing); the LM loss
is the mean over the supervised tokens of the whole global batch, however it is split.
"""
import contextlib
import math
import os
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from data.atomic import atomic_write_text
from data.dataset import IGNORE_INDEX, DataError
from data.tokenizer import stop_token_ids, token_byte_lengths
from train.engines import describe as describe_engines, bf16_pays, cpu_facts, engines_for
from model.model_minimind import MiniMindForCausalLM
from train import flags
from train.checkpoint import load_checkpoint, load_into, save_run
from train.init_weights import upcycle, upcycled_base, weights_source
from train.distributed import (PeerFailed, check_same_on_all_ranks, clip_grad_norm_sharded, init_distributed,
                               main_rank_first, no_grad_sync, shutdown)
from train.parallel import build_model, ep_dispatchers, install as install_ep, moe_layers, shard
from train.report import (LoadTelemetry, MetricsLog, Progress, describe_model, load_summary, open_wandb,
                          plot_expert_load, plot_loss_curve)
from train.run_dir import abandon_run_dir, checkpoint_in, claim_run_dir, copy_tokenizer, run_dir_of
from train.stage import Stage, StageData
from train.threads import set_run_threads

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclass
class Plan:
    """The learning-rate schedule after the warmup: a cosine whose progress runs from `progress` at step `since`
    to 1 at step `end`, the run's last. A fixed-step run's plan is Plan(end=--max_steps); a --time_budget_s run
    moves its end to the steps that fit (`plan_budget`), and a resume with another --max_steps to that. A moved
    plan starts where the old one stands (`moved`), so the LR never jumps; the checkpoint records the plan, so the
    LR is a pure function of (step, plan) and a resume continues it exactly."""
    end: int
    since: int = 0
    progress: float = 0.0

    def progress_at(self, step, warmup_steps):
        """The cosine's progress in [0, 1] at the (0-based) step: 0 during the warmup."""
        if step < warmup_steps:
            return 0.0
        start = max(self.since, warmup_steps)
        return min(1.0, self.progress + (1 - self.progress) * (step - start) / max(1, self.end - start))

    def moved(self, step, end, warmup_steps):
        """The plan that ends at `end` instead, continuing this one's LR from `step` on."""
        return Plan(end=end, since=step, progress=self.progress_at(step, warmup_steps))


def lr_at(step, plan, lr, warmup_steps, min_lr_ratio=0.1):
    """Linear warmup over `warmup_steps`, then the plan's cosine decay to lr * min_lr_ratio at `plan.end`: a pure
    function of the (0-based) step and the plan, so a resume cannot get it wrong."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = plan.progress_at(step, warmup_steps)
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


# A --time_budget_s run measures its step time on the training clock all ranks agree on, after the first PLAN_SKIP
# steps of each invocation (they pay one-off costs: kernel set-up, allocation). A new run's first measurement, over
# PLAN_FIRST steps, says the plan (a resumed run's plan was fitted to its mean so far: `plan_on_resume`). Then a
# horizon of PLAN_WINDOW-step windows grows, and from PLAN_SETTLE steps on the plan is checked after every window
# at the horizon's mean step time, which smooths out a window with an evaluation in it or a busy spell. The plan
# moves to the steps that fit (at most --max_steps) only when its end would miss the budget by more than
# PLAN_TOLERANCE of it plus three times the mean's standard error over the steps left, so noise does not move it.
# When the last PLAN_SETTLE steps ran more than PLAN_CHANGE times faster or slower than the horizon's mean, the
# speed has changed: the horizon restarts with the last window, and the plan moves once it has settled again.
PLAN_SKIP, PLAN_FIRST, PLAN_SETTLE, PLAN_WINDOW, PLAN_CHANGE, PLAN_TOLERANCE = 2, 5, 60, 20, 1.25, 0.02


def plan_budget(state, args, log):
    """Every step of a --time_budget_s run: check the plan when due (`fit_budget`, at the horizon's mean step time;
    a new run's first measurement also says the plan). Returns True when the plan moved."""
    if not args.time_budget_s or state.out_of_time or state.step - state.start_step < PLAN_SKIP:
        return False
    marks = state.plan_marks  # (step, train_s) at the horizon's start and after each of its windows
    if not marks:
        marks.append((state.step, state.train_s))
        return False
    now, first = (state.step, state.train_s), not state.measured
    if (now[0] - marks[0][0] != PLAN_FIRST) if first else (now[0] - marks[-1][0] < PLAN_WINDOW):
        return False
    state.measured = True
    if first:  # a new run's plan; a resumed one's was fitted to the run's mean (plan_on_resume): only the horizon
        step_s, marks[:] = (now[1] - marks[0][1]) / PLAN_FIRST, [now]
        return state.start_step == 0 and fit_budget(state, args, step_s, 0.0, log, announce=True)
    marks.append(now)
    window_s = [(b[1] - a[1]) / (b[0] - a[0]) for a, b in zip(marks, marks[1:])]
    recent = marks[max(0, len(marks) - 1 - PLAN_SETTLE // PLAN_WINDOW)]  # PLAN_SETTLE steps back, or the start
    step_s = (now[1] - marks[0][1]) / (now[0] - marks[0][0])
    recent_s = (now[1] - recent[1]) / (now[0] - recent[0])
    if step_s > 0 and not 1 / PLAN_CHANGE < recent_s / step_s < PLAN_CHANGE:
        marks[:] = marks[-2:]  # the speed changed: a new horizon from the last window on
        return False
    if now[0] - marks[0][0] < PLAN_SETTLE:
        return False
    stderr_s = statistics.stdev(window_s) / math.sqrt(len(window_s))
    return fit_budget(state, args, step_s, 3 * stderr_s, log)


def fit_budget(state, args, step_s, spread_s, log, announce=False):
    """Move the plan's end to the steps that fit --time_budget_s at `step_s` seconds per step (known within
    `spread_s`), or to --max_steps when those fit even at step_s + spread_s: the former when the current end would
    miss the budget by more than PLAN_TOLERANCE of it plus spread_s per step left, the latter whenever it differs.
    Says so (with `announce`, also when the plan stays). Returns True when it moved."""
    left_budget_s = args.time_budget_s - state.train_s
    fit = state.step + max(1, int(left_budget_s / max(step_s, 1e-9)))
    end = min(args.max_steps, fit)
    old = state.plan.end
    margin_s = PLAN_TOLERANCE * args.time_budget_s + spread_s * max(0, end - state.step)
    all_fit = state.step + left_budget_s / max(step_s + spread_s, 1e-9) >= args.max_steps
    moves = end != old and (all_fit or abs(end - old) * step_s > margin_s)
    if moves:
        state.plan = state.plan.moved(state.step, end, args.warmup_steps)
    if not (moves or announce):
        return False
    left_s = max(0, state.plan.end - state.step) * step_s
    left = f"{left_s:.0f} s" if left_s < 120 else f"{left_s / 60:.1f} minutes"
    if fit >= args.max_steps:
        why = f"--max_steps {args.max_steps} fit --time_budget_s {args.time_budget_s:g}"
    else:
        why = f"what fits --time_budget_s {args.time_budget_s:g}" + (
            f"; --time_budget_s 0 trains all --max_steps {args.max_steps}"
            if args.max_steps < flags.UNLIMITED_STEPS else "")
    head = f"re-plan: {old} -> " if moves and not announce else "plan: "
    log(f"{head}{state.plan.end} steps ({why}): about {left} more training at {step_s:.3f} s/step"
        + (f" (the warmup, --warmup_steps {args.warmup_steps}, is longer)"
           if state.step < state.plan.end <= args.warmup_steps else ""))
    return moves


def plan_on_resume(args, saved_args, state, log):
    """The restored plan against this invocation's --max_steps / --time_budget_s: a fixed-step run moves its end
    to --max_steps; a budget run re-fits its end at the run's mean step time so far (then measures again).
    Raises ValueError when the flags changed for more steps but the budget leaves none."""
    if not args.time_budget_s or args.max_steps <= state.step:
        if state.plan.end != args.max_steps:
            if args.max_steps > state.step:
                log(f"plan: {state.plan.end} -> {args.max_steps} steps (--max_steps {args.max_steps}); the learning "
                    f"rate continues from step {state.step}'s")
            state.plan = state.plan.moved(state.step, args.max_steps, args.warmup_steps)
        return
    if state.step and not spent(args, state.train_s):
        fit_budget(state, args, state.train_s / state.step, 0.0, log)
    changed = (args.max_steps, args.time_budget_s) != (saved_args.get("max_steps"), saved_args.get("time_budget_s"))
    if changed and (state.step >= state.plan.end or spent(args, state.train_s)):
        raise ValueError(f"{args.resume}: nothing to train: the run's --time_budget_s {args.time_budget_s:g} is used "
                         f"up ({state.train_s:.1f} s trained, step {state.step}); pass a larger --time_budget_s, or "
                         f"--time_budget_s 0 with a --max_steps")


class TrainClock:
    """Seconds of training: from `start()` on, except inside `paused()` (evaluation, saving), plus
    `elapsed_s` of earlier invocations."""

    def __init__(self, elapsed_s=0.0):
        self._done, self._since = elapsed_s, None

    def start(self):
        self._since = time.perf_counter()

    def read(self):
        return self._done + (time.perf_counter() - self._since if self._since is not None else 0.0)

    @contextlib.contextmanager
    def paused(self):
        running, (self._done, self._since) = self._since is not None, (self.read(), None)
        yield
        self._since = time.perf_counter() if running else None


class StopSignal:
    """Ctrl-C / SIGTERM lets the current step finish; the loop then saves and stops with a resume hint. A
    second signal acts as usual. `received` is the first signal's name or None."""

    def __init__(self):
        self.received, self._previous = None, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # (Python allows handlers nowhere else)
            self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _handle(self, signum, frame):
        self.received = signal.Signals(signum).name
        self.__exit__()
        print(f"\n{self.received}: finishing this step, then saving a checkpoint (send it again to abort)",
              file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


@dataclass
class TrainState:
    """What changes as the run goes; `state_dict()` is what a checkpoint needs to continue exactly: the
    step, the training clock, the plan, the data position, the RNG, the loss scaler and the expert-load
    telemetry."""
    batches: object                     # the stage's train_batches (their position is part of the state)
    scaler: torch.amp.GradScaler
    plan: Plan
    step: int = 0
    start_step: int = 0
    clock: TrainClock = field(default_factory=TrainClock)
    telemetry: LoadTelemetry = field(default_factory=LoadTelemetry)
    train_s: float = 0.0                # the clock as all ranks agree on it: the plan and the budget use it
    out_of_time: bool = False           # --time_budget_s is spent: this step is the run's last
    plan_marks: list = field(default_factory=list)  # plan_budget's (step, train_s) marks of its horizon
    measured: bool = False              # plan_budget has measured the step time in this invocation
    shared: tuple | None = None         # several ranks: (async all-reduce, [signal, clock]) of the previous step
    interval_steps: int = 0
    interval_start: float = 0.0
    last_val: tuple | None = None       # (step, val_loss) of the latest evaluation
    first_bad_step: torch.Tensor | None = None  # on the device: the first step with a non-finite loss/norm
    stop_signal: StopSignal = field(default_factory=StopSignal)
    stopped_by: str | None = None       # "--stop_after" or a signal name

    def state_dict(self):
        return {"step": self.step, "train_time_s": self.clock.read(), "plan": vars(self.plan).copy(),
                "data": self.batches.state_dict(),
                "rng": {"torch": torch.get_rng_state(),
                        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
                "scaler": self.scaler.state_dict(), "router_load": self.telemetry.state_dict()}

    def load_state_dict(self, sd):
        self.step = self.start_step = sd["step"]
        self.clock = TrainClock(sd["train_time_s"])
        self.train_s = sd["train_time_s"]
        if "plan" in sd:
            self.plan = Plan(**sd["plan"])
        elif sd.get("planned_steps"):  # (checkpoints written before plans moved)
            self.plan = Plan(end=sd["planned_steps"])
        self.batches.load_state_dict(sd["data"])
        torch.set_rng_state(sd["rng"]["torch"])
        if torch.cuda.is_available() and sd["rng"]["cuda"]:
            torch.cuda.set_rng_state_all(sd["rng"]["cuda"])
        if self.scaler.is_enabled():
            self.scaler.load_state_dict(sd["scaler"])
        self.telemetry.load_state_dict(sd["router_load"])


@dataclass
class Run:
    """What a run is made of, fixed after setup."""
    args: object
    stage: Stage
    ctx: object              # train.distributed.DistContext
    device: str
    dtype: torch.dtype       # autocast dtype (fp32 = no autocast); weights stay fp32
    threads: int | None      # the CPU thread count, fixed for the run (None on CUDA)
    config: object
    data: StageData
    model: torch.nn.Module   # the plain module (checkpoints, eval, telemetry)
    train_model: torch.nn.Module  # what the step calls: model (FSDP's too), or DDP / compile around it
    optimizer: torch.optim.Optimizer
    metrics: MetricsLog
    log: Callable
    lock: object = None      # rank 0's lock on out_dir, released when the run ends

    def autocast(self):
        return (contextlib.nullcontext() if self.dtype == torch.float32
                else torch.autocast(self.device.split(":")[0], dtype=self.dtype))


def train(args, stage, log=print):
    """Run (or resume) the training job of `args` (`stage`'s parse_args); one process, or every rank of a
    torchrun launch (DDP, plus EP with --ep_size > 1). Returns a summary dict."""
    t_start = time.time()
    device_type = (args.device.split(":")[0] if args.device != "auto"
                   else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda requested but CUDA is not available")
    ctx = init_distributed(args.ep_size, device_type, args.fsdp)
    run = None
    try:
        run, state = setup(stage, args, ctx, device_type, log if ctx.is_main else (lambda *_: None))
        run.log(f"setup: {time.time() - t_start:.1f} s to the first step")
        total = state.plan.end
        progress = Progress(stage.name, state.step, None if total == flags.UNLIMITED_STEPS else total,
                            ctx.is_main and not args.no_progress, run.log)
        state.clock.start()
        state.interval_start = state.clock.read()
        state.out_of_time = spent(args, state.train_s)
        with state.stop_signal:
            while state.step < state.plan.end and not state.out_of_time:
                lr, ce, aux, grad_norm, load_LE = train_step(run, state)
                if after_step(run, state, progress, lr, ce, aux, grad_norm, load_LE):
                    break
        progress.close()
        summary = finish(run, state)
    except BaseException:
        shutdown(ctx, wait_for_peers=False)  # a peer may never reach the barrier after a one-rank error
        raise
    finally:
        if run is not None and run.lock is not None:
            run.lock.close()  # (now, not when collected: a caller in this process may run in out_dir next)
    shutdown(ctx)
    return summary


# ------------------------------------------------------------------------------------------- 1. setup

def setup(stage, args, ctx, device_type, log):
    """The Run and TrainState of `args` on this rank, with the step-0 evaluation of a new run done. Raises
    ValueError / DataError for bad input; a run that fails or is interrupted here in a folder it created leaves
    no folder behind."""
    torch.manual_seed(args.seed)  # the same on every rank (dropout); the weights are drawn by key (build_model)
    device = f"cuda:{ctx.local_rank}" if device_type == "cuda" and args.device in ("auto", "cuda") else (
        args.device if device_type == "cuda" else "cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    # the one read of the checkpoint (of a sharded one the state here, the tensors by restore)
    ckpt = load_checkpoint(args.resume, weights=False) if args.resume else None
    init_model, tokenizer_dir = weights_source(args)
    base = ckpt["config"] if ckpt else (init_model.config.to_dict() if init_model is not None else None)
    if args.upcycle_from and not ckpt:
        base = upcycled_base(args, base)
    config = flags.build_config(args, base)  # checked before any folder is made or data read
    fresh, metrics = not os.path.isdir(args.out_dir), None
    lock = main_rank_first(ctx, lambda: claim_run_dir(args.out_dir, args.resume, args.overwrite, ctx.is_main))
    try:
        data = main_rank_first(ctx, lambda: stage.load_data(args, tokenizer_dir, args.batch_size * ctx.world_size, log))
        data.val_targets, data.val_bytes = count_val_bytes(data)
        if ctx.is_main:
            copy_tokenizer(data.tokenizer_dir, os.path.join(args.out_dir, "tokenizer"))
        if base is None:  # (the architecture from the flags: the vocabulary from the tokenizer)
            config = flags.build_config(args, vocab_size=len(data.tokenizer))
        if config.vocab_size < len(data.tokenizer):
            raise ValueError(f"the model's vocab_size {config.vocab_size} is smaller than the tokenizer's "
                             f"{len(data.tokenizer)} tokens")
        check_same_on_all_ranks(ctx, "the model config", config.to_dict())
        check_same_on_all_ranks(ctx, "the training flags", {k: v for k, v in vars(args).items() if k != "device"})
        dtype = resolve_dtype(args, ctx, device_type, log)
        threads = set_run_threads(args.threads, device_type, log, keep_freed=not sharded(args, ctx))
        if ctx.distributed:
            experts = (f" ({config.num_experts // ctx.ep_size} of the {config.num_experts} experts per rank)"
                       if config.use_moe and ctx.ep_size > 1 else "")
            how = ("every parameter sharded over the ranks by FSDP2" if args.fsdp else
                   f"the experts sharded over the {ctx.world_size // ctx.ep_size} rank(s) holding them, the rest "
                   f"replicated (FSDP2)" if ctx.ep_size > 1 else "the parameters replicated by DDP")
            log(f"distributed: world size {ctx.world_size} ({dist.get_backend()}), "
                f"data parallel size {ctx.world_size}, expert parallel size {ctx.ep_size}{experts}; {how}")
        engines = engines_for(config, device, dtype, compiled=args.compile)
        model = build_model(lambda: MiniMindForCausalLM(config, engines), device, args.seed,
                            ctx.ep_mesh if ctx.ep_size > 1 and init_model is None else None)
        if init_model is not None and args.upcycle_from:
            upcycle(model, init_model, args.seed)
            log(f"upcycled the dense model {args.upcycle_from} into {config.num_experts} experts per layer")
        elif init_model is not None:
            model.load_state_dict(init_model.state_dict(), strict=True)
            log(f"initialised weights from {args.init_from}")
        log(describe_model(model, config, device, dtype))
        if ctx.ep_size > 1:  # (after loading whole weights: --init_from, --upcycle_from)
            install_ep(model, ctx.ep_mesh, config.num_experts)
        train_model = wrap(model, args, ctx, device_type)
        optimizer = make_optimizer(model, args)
        # fp16 autocast needs loss scaling on CUDA; a disabled scaler is a no-op for fp32 / bf16
        scaler = torch.amp.GradScaler(device_type, enabled=dtype == torch.float16 and device_type == "cuda")
        state = TrainState(batches=data.train_batches, scaler=scaler, plan=Plan(end=args.max_steps))
        if ckpt:
            restore(args, ckpt, model, optimizer, state, data, log, ctx)
            plan_on_resume(args, ckpt.get("args") or {}, state, log)
        log(describe_engines(model))
        train_model = torch.compile(train_model) if args.compile else train_model
        metrics = MetricsLog(args.out_dir, ctx.is_main,
                             open_wandb(args, config, args.out_dir) if ctx.is_main else None,
                             resumed=(run_dir_of(args.resume), state.step) if ckpt else None)
        run = Run(args=args, stage=stage, ctx=ctx, device=device, dtype=dtype, threads=threads, config=config,
                  data=data, model=model, train_model=train_model, optimizer=optimizer, metrics=metrics, log=log,
                  lock=lock)
        if state.step == 0:
            evaluate_and_record(run, state, None, first=True)
    except BaseException:  # (Ctrl-C included)
        if fresh and lock is not None:
            if metrics is not None:
                metrics.close()
            abandon_run_dir(args.out_dir, lock)
        raise
    return run, state


def resolve_dtype(args, ctx, device_type, log):
    """The autocast dtype of --dtype: auto = bf16 on CUDA; on CPU bf16 where it trains faster than fp32 here
    (`bf16_pays` of this CPU's `cpu_facts`: a rule, not a timing, so the machine's load never changes it; all
    ranks agree: bf16 only where it pays on every one), else fp32. The checkpoint's flags record the choice
    (flags.flags_to_save): a resume trains in the recorded dtype whatever the rule says now. A bf16 asked for
    where oneDNN runs no bf16 GEMMs is kept, with a line that says what it costs."""
    if args.dtype == "bfloat16" and device_type == "cpu" and not cpu_facts()["onednn_bf16"]:
        log("dtype bfloat16 as asked, but this CPU has no native bf16 GEMMs: PyTorch's reference kernels run "
            "them, tens of times slower than float32 (--dtype auto picks float32 here)")
    if args.dtype != "auto":
        return DTYPES[args.dtype]
    if device_type == "cuda":
        return torch.bfloat16
    pays, why = bf16_pays(cpu_facts())
    flag = torch.tensor(int(pays))
    if ctx.distributed:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if pays and not flag.item():
            why = "another rank's CPU runs bf16 slower than fp32"
    dtype = torch.bfloat16 if flag.item() else torch.float32
    log(f"dtype auto: {DTYPE_NAMES[dtype]} ({why}; kept on --resume)")
    return dtype


def make_optimizer(model, args):
    """AdamW, weight decay on matrices only (nanoGPT / MiniMind); torch's fused implementation where every
    parameter is an fp32 CPU or CUDA tensor, not an FSDP shard (one pass per parameter; the same update up to
    rounding)."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = all(p.device.type in ("cpu", "cuda") and p.dtype == torch.float32 and not isinstance(p, DTensor)
                for p in params)
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                             lr=args.learning_rate, betas=(0.9, 0.95), eps=1e-8, fused=fused or None)


def restore(args, ckpt, model, optimizer, state, data, log, ctx):
    """Weights, optimizer and TrainState from the checkpoint, after checking it trained on this data
    (train/checkpoint.py: load_into, any layout into any layout)."""
    for key, value in data.identity.items():
        if ckpt.get(key) not in (None, value):
            show = lambda v: f"{v:,}" if isinstance(v, int) else repr(v)  # noqa: E731
            raise ValueError(f"{args.resume}: the checkpoint was trained with {key}={show(ckpt[key])} but the data now "
                             f"gives {show(value)}; resume needs the same data and tokenizer")
    load_into(ckpt, model, optimizer, ctx)
    state.load_state_dict(ckpt)
    log(f"resumed from {args.resume} at step {state.step}")


def sharded(args, ctx):
    """Whether the ranks hold different parts of the model (EP's experts, FSDP's shards): then FSDP2 carries
    every parameter, the checkpoints are sharded and the grads' norm is taken over the ranks."""
    return ctx.ep_size > 1 or args.fsdp


def wrap(model, args, ctx, device_type):
    """FSDP2 where the ranks hold parts (`sharded`: train/parallel.py: shard), else DDP. Returns what the
    training step calls (torch.compile comes after the restore)."""
    if not ctx.distributed:
        return model
    if sharded(args, ctx):
        shard(model, ctx)
        return model
    return DDP(model, device_ids=[ctx.local_rank] if device_type == "cuda" else None, find_unused_parameters=False)


# -------------------------------------------------------------------------------------------- 2. loop

def train_step(run, state):
    """One optimizer step: micro-steps with gradient accumulation (DDP / FSDP2 reduce the grads in the last
    backward), clipping, the optimizer step, then the router's own step. Returns (lr, LM-loss part,
    router-loss part, grad norm, load [L, E] or None); the parts are this rank's, detached: summed over
    ranks they give the global batch's losses."""
    args, ctx = run.args, run.ctx
    lr = lr_at(state.step, state.plan, args.learning_rate, args.warmup_steps)
    for g in run.optimizer.param_groups:
        g["lr"] = lr
    batches = [state.batches.next() for _ in range(args.grad_accum)]  # global batches, on the CPU
    n_global = sum(int((b[1] != IGNORE_INDEX).sum()) for b in batches)  # supervised tokens, all ranks
    rows = slice(ctx.rank * args.batch_size, (ctx.rank + 1) * args.batch_size)
    ce = aux = 0.0
    for i, batch in enumerate(batches):
        no_sync = ctx.distributed and i < len(batches) - 1  # the grads are reduced on the last micro-step only
        with no_grad_sync(run.train_model) if no_sync else contextlib.nullcontext():
            micro_ce, micro_aux = forward_backward(run, state.scaler, n_global, *(t[rows] for t in batch))
        ce, aux = ce + micro_ce, aux + micro_aux
    state.scaler.unscale_(run.optimizer)
    grad_norm = None
    if args.grad_clip > 0:
        grad_norm = (clip_grad_norm_sharded(run.model, args.grad_clip) if sharded(args, ctx) else
                     torch.nn.utils.clip_grad_norm_(run.model.parameters(), args.grad_clip))
    state.scaler.step(run.optimizer)
    state.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    state.step += 1
    return lr, ce, aux, grad_norm, router_step(run.model, ctx.distributed)


def forward_backward(run, scaler, n_global, x, y, segment_ids=None):
    """Forward + backward of one micro-batch (this rank's [B, S] rows). The LM loss is its share of the
    global batch's mean over supervised tokens, ce * n_local / n_global, times the world size since DDP
    averages gradients over ranks; the router loss (a mean over the micro-batch) is divided by grad_accum.
    Returns the detached parts (LM share / world, router loss / grad_accum / world)."""
    world = run.ctx.world_size
    n_local = int((y != IGNORE_INDEX).sum())
    extra = {} if segment_ids is None else {"segment_ids": segment_ids.to(run.device)}
    with run.autocast():
        out = run.train_model(x.to(run.device), labels=y.to(run.device), **extra)
    # nothing to predict: a zero that still reaches every parameter (DDP needs it); nan_to_num of the nan
    # loss passes back a zero gradient
    ce_share = out.ce_loss * (n_local * world / n_global) if n_local else out.ce_loss.nan_to_num() * 0.0
    aux = out.aux_loss / run.args.grad_accum
    scaler.scale(ce_share + aux).backward()
    return ce_share.detach() / world, aux.detach() / world


def router_step(model, distributed):
    """After the optimizer step: each MoE layer's routed pairs per expert since the last step (int64
    [L, E]), summed over all ranks (one all-reduce), move the aux-loss-free selection bias; returned for
    the telemetry (None without MoE). No host sync."""
    layers = moe_layers(model)
    loads = [m.pop_load() for m in layers]
    if not layers or any(load is None for load in loads):
        return None
    load_LE = torch.stack(loads)
    if distributed:
        dist.all_reduce(load_LE)
    for m, load_E in zip(layers, load_LE):
        m.update_expert_bias(load_E)
    return load_LE


def after_step(run, state, progress, lr, ce, aux, grad_norm, load_LE):
    """Log, evaluate and save when due (both off the training clock); returns True to end the loop early
    (--stop_after, a signal) or when --time_budget_s is spent."""
    args = run.args
    state.interval_steps += 1
    state.telemetry.add(load_LE)
    track_finite(state, ce + aux + (grad_norm if grad_norm is not None and not state.scaler.is_enabled() else 0))
    state.stopped_by = stop_reason(run, state)  # (also decides out_of_time, before this step's log and eval)
    if plan_budget(state, args, progress.say):
        progress.set_total(state.plan.end)
    last = state.step >= state.plan.end or state.out_of_time
    if state.step % args.log_interval == 0 or last:
        check_finite(run, state)
        progress.update(log_train(run, state, lr, ce, aux, grad_norm), show_load=bool(args.show_load))
    else:
        progress.update()
    if state.step % args.eval_interval == 0 or last:
        with state.clock.paused():
            evaluate_and_record(run, state, progress)
    if state.step % args.save_interval == 0 or last or state.stopped_by:
        check_finite(run, state)
        with state.clock.paused():
            # (the plots cost a small model more than its checkpoint: drawn with an evaluation or at the end)
            save(run, state, plots=last or bool(state.stopped_by) or state.step % args.eval_interval == 0)
    if state.stopped_by:
        python = os.path.relpath(sys.executable) if sys.executable.startswith(os.getcwd()) else sys.executable
        progress.say(f"stopped at step {state.step} ({state.stopped_by}); continue with: {python} "
                     f"train/{run.stage.name}.py --resume --out_dir {args.out_dir}")
    elif not last and run.ctx.distributed:
        share_clock_and_signal(run, state)
    return state.stopped_by is not None or state.out_of_time


def share_clock_and_signal(run, state):
    """Several ranks: start this step's all-reduce (MAX) of [a stop signal received, the training clock] on the
    CPU group, asynchronously; the next step reads it (`stop_reason`). Every rank thus acts on the same values
    at the same step, one step late, without waiting for the device."""
    shared = torch.tensor([float(state.stop_signal.received is not None), state.clock.read()], dtype=torch.float64)
    state.shared = (dist.all_reduce(shared, op=dist.ReduceOp.MAX, group=run.ctx.cpu_group, async_op=True), shared)


def stop_reason(run, state):
    """"--stop_after" after this invocation's steps, a signal's name after Ctrl-C / SIGTERM, else None; and
    updates state.train_s / out_of_time, every step. With several ranks, the signal and the clock are those of
    the previous step's all-reduce (`share_clock_and_signal`), the same on every rank."""
    args, received = run.args, state.stop_signal.received
    if not run.ctx.distributed:
        state.train_s = state.clock.read()
    elif state.shared is not None:
        work, shared = state.shared
        work.wait()
        state.train_s, state.shared = float(shared[1]), None
        received = (received or "a signal on another rank") if shared[0] else None
    else:  # (the first step of an invocation: nothing shared yet)
        received = None
    state.out_of_time = spent(args, state.train_s)
    if state.out_of_time:  # the run ends as planned (final evaluation, checkpoint, summary)
        return None
    if args.stop_after and state.step - state.start_step >= args.stop_after:
        return "--stop_after"
    return received


def spent(args, train_s):
    return bool(args.time_budget_s) and train_s >= args.time_budget_s


def track_finite(state, value):
    """Remember the first step with a non-finite loss (or grad norm) on the device (no host sync per step)."""
    if state.first_bad_step is None:
        state.first_bad_step = torch.full((), torch.iinfo(torch.int64).max, device=value.device)
    bad = ~torch.isfinite(value) & (state.first_bad_step > state.step)
    state.first_bad_step = torch.where(bad, state.step, state.first_bad_step)


def check_finite(run, state):
    """FloatingPointError (one line, exit 2) if some step so far was non-finite: nothing after it is logged or
    saved. All ranks agree (MIN over them)."""
    if state.first_bad_step is None:
        return
    bad = state.first_bad_step.clone()
    if run.ctx.distributed:
        dist.all_reduce(bad, op=dist.ReduceOp.MIN)
    if int(bad) <= state.step:
        raise FloatingPointError(
            f"the loss or gradient norm became non-finite at step {int(bad)}; stopped at step {state.step} without "
            f"saving (the last checkpoint in {run.args.out_dir} is untouched); lower --learning_rate or raise "
            f"--warmup_steps, then --resume")


def log_train(run, state, lr, ce, aux, grad_norm):
    """One metrics record for the log interval that ends now; tokens/s over training time."""
    now = state.clock.read()
    tok_s = (run.args.batch_size * run.args.seq_len * run.args.grad_accum * run.ctx.world_size
             * state.interval_steps / max(now - state.interval_start, 1e-9))
    state.interval_steps, state.interval_start = 0, now
    if run.ctx.distributed:  # sum the ranks' parts: the losses of the global batch
        parts = torch.stack([ce, aux])
        dist.all_reduce(parts)
        ce, aux = parts[0], parts[1]
    record = {"step": state.step, "train_loss": float(ce), "aux_loss": float(aux), "lr": lr, "tok_per_s": tok_s,
              "train_time_s": round(state.train_s, 3)}
    if grad_norm is not None:
        record["grad_norm"] = float(grad_norm)
    record.update(state.telemetry.flush())
    run.metrics.record(record)
    return record


@torch.no_grad()
def evaluate(run):
    """Mean LM cross-entropy (nats per supervised token) over the validation batches."""
    was_training = run.model.training
    run.model.eval()
    total = count = 0
    for x, y, *segment_ids in run.data.val_batches:
        targets = int((y != IGNORE_INDEX).sum())
        if targets:
            extra = {"segment_ids": segment_ids[0].to(run.device)} if segment_ids else {}
            with run.autocast():
                out = run.model(x.to(run.device), labels=y.to(run.device), **extra)
            total, count = total + out.ce_loss.item() * targets, count + targets
    run.model.train(was_training)
    if isinstance(run.model, FSDPModule):  # (no backward follows to free the root's gathered weights)
        run.model.reshard()
    return total / max(count, 1)


def bits_per_byte(run, loss):
    """A loss in nats per supervised token as bits per UTF-8 byte of the text: comparable across tokenizers."""
    return loss * run.data.val_targets / math.log(2) / run.data.val_bytes if run.data.val_bytes else None


def count_val_bytes(data):
    """(supervised validation targets, UTF-8 bytes of the text they stand for)."""
    lengths = torch.from_numpy(token_byte_lengths(data.tokenizer))
    targets = nbytes = 0
    for _, y, *_ in data.val_batches:
        y = y[y != IGNORE_INDEX]
        targets += y.numel()
        nbytes += int(lengths[y.clamp(max=len(lengths) - 1)].sum())
    if not targets:
        raise DataError("the validation split has no token to predict (a corpus of a few tokens?); add data")
    return targets, nbytes


def evaluate_and_record(run, state, progress, first=False):
    val = evaluate(run)
    bpb = bits_per_byte(run, val)
    state.last_val = (state.step, val)
    run.metrics.record({"step": state.step, "val_loss": val, **({"val_bpb": bpb} if bpb is not None else {})})
    said = f"val loss {val:.4f}" + (f" ({bpb:.3f} bits/byte)" if bpb is not None else "")
    if first:
        unigram = run.data.unigram_entropy
        run.log(f"step 0: {said} (uniform over the vocab would be {math.log(run.config.vocab_size):.4f}"
                + (f"; unigram entropy of the validation tokens {unigram:.4f})" if unigram is not None else ")"))
    else:
        progress.say(f"step {state.step}: {said}")


def save(run, state, plots=True):
    """Checkpoint (ckpt.pt by rank 0, or sharded by every rank where they hold different parts), config and
    (with `plots`) the plots; never non-finite weights or optimizer state (all ranks agree)."""
    tensors = [*run.model.parameters(), *run.model.buffers(),
               *(v for s in run.optimizer.state.values() for v in s.values() if torch.is_tensor(v))]
    tensors = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    finite = torch.stack([torch.isfinite(t).all() for t in tensors if t.is_floating_point()]).all().to(torch.int32)
    if run.ctx.distributed:
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    if not bool(finite):
        raise FloatingPointError(
            f"the weights or optimizer state are not finite after step {state.step}; stopped without saving (the "
            f"last checkpoint in {run.args.out_dir} is untouched); lower --learning_rate, then --resume")
    out = run.args.out_dir
    extra = {**state.state_dict(),
             "args": flags.flags_to_save(run.args, run.config, DTYPE_NAMES[run.dtype], run.threads),
             **run.data.identity, "world_size": run.ctx.world_size, "ep_size": run.ctx.ep_size}
    save_run(out, run.model, run.optimizer, extra, run.ctx, sharded(run.args, run.ctx))
    if not run.ctx.is_main:
        return
    atomic_write_text(os.path.join(out, "config.json"), run.config.to_json_string())
    if not plots:
        return
    plot_loss_curve(run.metrics.records, os.path.join(out, "loss.png"), run.data.unigram_entropy,
                    bits_per_byte(run, 1.0))
    if state.telemetry.total is not None:
        plot_expert_load(state.telemetry.run_fractions(), os.path.join(out, "expert_load.png"),
                         f"share of routed tokens per expert, steps {state.start_step + 1}-{state.step}")


# ------------------------------------------------------------------------------------------ 3. finish

def finish(run, state):
    """Final evaluation (unless one just ran), the summary lines, and a short sample. A resume into a new
    --out_dir with nothing left to train saves the resumed state there: the folder holds the run it names."""
    args = run.args
    if state.step == state.start_step and not os.path.lexists(checkpoint_in(args.out_dir)):
        save(run, state)
    if state.start_step >= state.plan.end:
        run.log(f"nothing to do: checkpoint is at step {state.start_step} >= the run's {state.plan.end} steps")
    elif state.step == state.start_step and args.time_budget_s and state.train_s >= args.time_budget_s:
        # (the budget ran out before the plan's last step: a slower machine, or a loaded one)
        run.log(f"nothing to do: checkpoint at step {state.start_step} has trained {state.train_s:.1f} s of "
                f"--time_budget_s {args.time_budget_s:g}")
    elif args.time_budget_s:
        run.log(f"trained {state.train_s:.1f} s of --time_budget_s {args.time_budget_s:g} in {state.step} steps")
    if state.last_val is None or state.last_val[0] != state.step:
        state.last_val = (state.step, evaluate(run))
    run.metrics.close()
    val, first, unigram = state.last_val[1], run.metrics.first("val_loss"), run.data.unigram_entropy
    bpb = bits_per_byte(run, val)
    summary = {"final_val_loss": val, "final_val_bpb": bpb, "first_val_loss": first, "unigram_entropy": unigram,
               "checkpoint": checkpoint_in(args.out_dir), "loss_curve": os.path.join(args.out_dir, "loss.png"),
               "records": run.metrics.records, "train_time_s": state.train_s, "stopped_by": state.stopped_by,
               "ep_bytes": [(d.bytes_sent, d.bytes_k_copies) for d in ep_dispatchers(run.model)]}
    run.log(f"final val loss {val:.4f}" + (f" ({bpb:.3f} bits/byte)" if bpb is not None else "")
            + (f" vs step-0 {first:.4f} ({change_in_percent(val, first)})" if first else "")
            + (f"; unigram entropy of the validation tokens {unigram:.4f} "
               f"({'below' if val < unigram else 'NOT below'} it)"
               if unigram is not None else ""))
    run.log(f"checkpoint: {summary['checkpoint']}\nloss curve: {summary['loss_curve']}")
    if state.telemetry.total is not None:
        summary["expert_load"] = state.telemetry.run_fractions()
        _, ratio, idle = load_summary(state.telemetry.total)
        run.log(f"expert load over the run (max/mean per layer, 1.0 = balanced): "
                f"{' '.join(f'{v:.2f}' for v in ratio.tolist())}; experts never used: {sum(idle.tolist())}; "
                f"heatmap: {os.path.join(args.out_dir, 'expert_load.png')}")
    if args.sample_tokens > 0 and state.stopped_by is None and sharded(args, run.ctx):
        run.log(f"sample: none here (the ranks hold parts of the model); try python scripts/generate.py "
                f"--ckpt {args.out_dir}")
    elif args.sample_tokens > 0 and run.ctx.is_main and state.stopped_by is None:
        summary["sample"] = sample(run)
        run.log(f"sample: {summary['sample']!r}")
    return summary


def change_in_percent(value, start):
    """How value compares with start, in words: "12.3% lower", "4.0% higher" or "unchanged" (to 0.1%)."""
    change = 100 * (value - start) / start
    if abs(change) < 0.05:
        return "unchanged"
    return f"{abs(change):.1f}% {'higher' if change > 0 else 'lower'}"


def sample(run):
    tok = run.data.tokenizer
    run.model.eval()
    ids = torch.tensor([tok(run.stage.sample_prompt, add_special_tokens=False)["input_ids"]], device=run.device)
    g = torch.Generator(device=run.device).manual_seed(run.args.seed)
    with run.autocast():
        out = run.model.generate(ids, max_new_tokens=run.args.sample_tokens, temperature=0.8, top_k=40,
                                 eos_token_id=stop_token_ids(tok), generator=g)
    return tok.decode(out[0].tolist(), skip_special_tokens=True)


def run_cli(stage, args, log=print):
    """train for a stage script's parsed flags; bad input ends in one `error:` line and exit code 2."""
    try:
        train(args, stage, log=log)
    except (DataError, ValueError, OSError, FloatingPointError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except PeerFailed as e:  # rank 0 printed the error; this rank only says why it stops
        print(f"note: rank {os.environ.get('RANK', '?')} stops: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # in setup or the step-0 evaluation, or a second signal (the first saves and stops)
        sys.stderr.write(f"\ninterrupted: nothing saved (the last checkpoint in {args.out_dir}, "
                         "if any, is untouched)\n")
        sys.exit(130)
