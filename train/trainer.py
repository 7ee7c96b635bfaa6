"""The training loop every stage shares (nanoGPT's loop, split the way torchtitan splits it):

    train(args)                  setup -> repeat { train_step -> after_step } -> finish
      train_step(run, state)     one optimizer step: micro-steps (forward_backward, with accumulation)
                                 -> gradient reduction (DDP / EP) -> clip -> optimizer step -> router update
      after_step(run, state, r)  log, evaluate, save a checkpoint, stop early

A stage (train/pretrain.py, train/stage.py) supplies only its flags, its data and its loss mask; the
Run (train/setup.py) holds what is fixed for the run, TrainState what changes every step.
"""
import contextlib
import importlib
import math
import os
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from data.dataset import DataError
from data.tokenizer import stop_token_ids
from model.router import load_summary
from data.atomic import atomic_write_text
from train.checkpoint import CKPT_NAME, save_checkpoint
from train.distributed import init_distributed, shutdown
from train.expert_parallel import clip_grad_norm_ep, ep_dispatchers, gather_experts, reduce_expert_grads
from train.expert_parallel import uninstall as uninstall_ep
from train.flags import saved_flags
from train.metrics import Progress
from train.plot import plot_expert_load, plot_loss_curve
from train.router_balance import LoadTelemetry, router_step
from train.schedule import TrainClock, lr_at
from train.setup import PeerFailed, resolve_device, setup
from train.signals import StopSignal
from data.dataset import IGNORE_INDEX
from train.threads import ThreadTuner


@dataclass
class TrainState:
    """What changes as the run goes: optimizer steps done, the current log interval, the last eval."""
    step: int
    start_step: int
    interval_steps: int = 0
    interval_start: float = 0.0        # the training clock at the start of the log interval
    last_val: tuple | None = None      # (step, val_loss) of the latest evaluation
    telemetry: LoadTelemetry = field(default_factory=LoadTelemetry)
    first_bad_step: torch.Tensor | None = None  # on the device: the first step with a non-finite loss/grad norm
    stop_signal: StopSignal = field(default_factory=StopSignal)
    stopped_by: str | None = None      # why the loop ended early: "--stop_after" or a signal name
    clock: TrainClock = field(default_factory=TrainClock)  # training seconds, this and earlier invocations
    train_s: float = 0.0               # the clock as all ranks agree on it (stop_reason): the LR and budget use it
    out_of_time: bool = False          # --time_budget_s is spent: this step is the run's last


@dataclass
class StepResult:
    lr: float
    # This rank's parts (detached): summed over the ranks they give the global batch's mean LM loss and
    # the ranks' mean router loss (log_train all-reduces them).
    ce_part: torch.Tensor
    aux_part: torch.Tensor
    grad_norm: torch.Tensor | None
    load_LE: torch.Tensor | None  # routed pairs per expert of this step, all ranks, int64 [L, E]


def train(args, log=print, stage=None):
    """Run (or resume) the training job of `args` (from a stage's parse_args); single process, or every
    rank of a torchrun launch (DDP, plus expert parallelism when args.ep_size > 1). `stage` defaults to
    `train.<args.stage>.STAGE`. Returns a summary dict."""
    stage = stage or importlib.import_module(f"train.{args.stage}").STAGE
    t_start = time.time()
    device_type, dtype_name = resolve_device(args)
    ctx = init_distributed(args.ep_size, device_type)
    try:
        run = setup(stage, args, ctx, device_type, dtype_name, log if ctx.is_main else (lambda *_: None))
        state = TrainState(step=run.start_step, start_step=run.start_step)
        if args.resume and args._checkpoint.get("router_load"):
            state.telemetry.load_state_dict(args._checkpoint["router_load"])
        if args.resume:  # (checkpoints older than --time_budget_s have no clock: they had no budget)
            state.clock = TrainClock(args._checkpoint.get("train_time_s", 0.0))
            state.train_s = state.clock.read()
            state.out_of_time = spent(args, state.train_s)
        if state.step == 0:
            evaluate_and_record(run, state, None, first=True)
        run.log(f"setup: {time.time() - t_start:.1f} s to the first step (data, model{', step-0 evaluation' if state.step == 0 else ''})")
        progress = Progress(stage.name, state.step, None if args.time_budget_s else args.max_steps,
                            ctx.is_main and not args.no_progress, run.log)
        tuner = thread_tuner(run)
        state.clock.start()
        state.interval_start = state.clock.read()
        with state.stop_signal:
            while state.step < args.max_steps and not state.out_of_time:
                t_step = time.perf_counter()
                result = train_step(run, state)
                if tuner:  # (on CPU the step has finished here: nothing runs asynchronously)
                    tuner.observe(time.perf_counter() - t_step)
                if after_step(run, state, result, progress):
                    break
        progress.close()
        summary = finish(run, state)
    except BaseException:
        shutdown(ctx, wait_for_peers=False)  # a peer may never reach the barrier after a one-rank error
        raise
    shutdown(ctx)
    return summary


def thread_tuner(run):
    """--threads: a fixed count, or (auto, one CPU process) a ThreadTuner; None when nothing is tuned."""
    if run.device != "cpu":
        return None
    if run.args.threads != "auto":
        torch.set_num_threads(run.args.threads)
        return None
    return None if run.ctx.distributed else ThreadTuner(torch.get_num_threads(), log=run.log)


def train_step(run, state):
    """One optimizer step, in this order: micro-steps with gradient accumulation, gradient reduction
    (DDP all-reduces the dense grads inside the last backward; EP reduces the expert grads here),
    clipping, the optimizer step, then the router's own update (aux-loss-free expert bias)."""
    args, ctx = run.args, run.ctx
    lr = lr_at(state.step, args.max_steps, args.learning_rate, args.warmup_steps,
               progress=state.train_s / args.time_budget_s if args.time_budget_s else None)
    for g in run.optimizer.param_groups:
        g["lr"] = lr
    batches = [run.data.train_batches.next() for _ in range(args.grad_accum)]  # global batches, on the CPU
    n_global = sum(int((b[1] != IGNORE_INDEX).sum()) for b in batches)  # supervised tokens, all ranks
    ce_part = aux_part = 0.0  # device tensors after the first micro-step (no host read per step)
    for i, batch in enumerate(batches):
        # DDP all-reduces only on the last micro-step of an accumulation
        no_sync = ctx.distributed and i < len(batches) - 1
        with run.train_model.no_sync() if no_sync else contextlib.nullcontext():
            x, y, *segment_ids = (t[run.my_rows] for t in batch)
            micro_ce, micro_aux = forward_backward(run, x, y, n_global, *segment_ids)
        ce_part, aux_part = ce_part + micro_ce, aux_part + micro_aux
    run.scaler.unscale_(run.optimizer)
    if ctx.ep_size > 1:
        reduce_expert_grads(run.model, ctx.expert_dp_group, ctx.world_size)
    grad_norm = clip_gradients(run)
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    load_LE = router_step(run.model, ctx.distributed)
    state.step += 1
    return StepResult(lr=lr, ce_part=ce_part, aux_part=aux_part, grad_norm=grad_norm, load_LE=load_LE)


def forward_backward(run, x, y, n_global, segment_ids=None):
    """Forward + backward of one micro-batch (x, y: this rank's [B, S] rows, on the CPU; segment_ids [B, S]
    for windows packed with several sequences, see train/stage.py).

    The LM loss is this micro-batch's share of the global batch's mean over supervised tokens:
    ce_mean * n_local / n_global, times the world size because DDP averages gradients over ranks. So the
    step's gradient is that of the global mean, whatever the accumulation, world size or mask. The
    router loss is divided by grad_accum once per micro-step (it is a mean over the micro-batch already,
    from this rank's own routing statistics, so it does depend on how the batch is split).
    Returns this micro-batch's detached parts (LM share / world size, router loss / grad_accum / world
    size): summed over micro-steps and ranks they give the logged losses."""
    args, world = run.args, run.ctx.world_size
    n_local = int((y != IGNORE_INDEX).sum())
    x, y = x.to(run.device, non_blocking=True), y.to(run.device, non_blocking=True)
    extra = {} if segment_ids is None else {"segment_ids": segment_ids.to(run.device, non_blocking=True)}
    with run.autocast():
        out = run.train_model(x, labels=y, **extra)
    # a micro-batch with nothing to predict adds a zero that still reaches every parameter (DDP needs it):
    # its loss is nan (no label to average over) and nan_to_num passes back a zero gradient
    ce_share = out.ce_loss * (n_local * world / n_global) if n_local else out.ce_loss.nan_to_num() * 0.0
    aux = out.aux_loss / args.grad_accum
    run.scaler.scale(ce_share + aux).backward()
    return ce_share.detach() / world, aux.detach() / world


def clip_gradients(run):
    """Clip the global gradient norm to --grad_clip (over all shards under EP); returns the norm or None."""
    if run.args.grad_clip <= 0:
        return None
    if run.ctx.ep_size > 1:
        return clip_grad_norm_ep(run.model, run.args.grad_clip, run.ctx.ep_group)
    return torch.nn.utils.clip_grad_norm_(run.model.parameters(), run.args.grad_clip)


def after_step(run, state, result, progress):
    """Log, evaluate and save when due (evaluating and saving off the training clock); returns True to end
    the loop: early (--stop_after, a signal) or when --time_budget_s is spent."""
    args = run.args
    state.interval_steps += 1
    state.telemetry.add(result.load_LE)
    track_finite(run, state, result)
    state.stopped_by = stop_reason(run, state)  # (also decides out_of_time, before this step's log and eval)
    last = state.step == args.max_steps or state.out_of_time
    fields = None
    if state.step % args.log_interval == 0 or last:
        check_finite(run, state)
        fields = log_train(run, state, result)
    progress.update(fields, show_load=bool(args.show_load))
    if state.step % args.eval_interval == 0 or last:
        with state.clock.paused():
            evaluate_and_record(run, state, progress)
    if state.step % args.save_interval == 0 or last or state.stopped_by:
        check_finite(run, state)
        with state.clock.paused():
            save(run, state)
    if state.stopped_by:
        progress.say(f"stopped at step {state.step} ({state.stopped_by}); continue with: python train/{run.stage.name}.py "
                     f"--resume --out_dir {run.args.out_dir}")
    return state.stopped_by is not None or state.out_of_time


def stop_reason(run, state):
    """"--stop_after" when this invocation has run its steps, a signal's name after Ctrl-C / SIGTERM, else
    None; and updates state.train_s / out_of_time (--time_budget_s spent: the run's planned end, not a stop).
    Ranks must stop at the same step and use the same LR: with several, signals and the clock are acted on
    at log steps, where one all-reduce (MAX) gives every rank the same flag and clock."""
    args = run.args
    received = state.stop_signal.received
    if not run.ctx.distributed:
        state.train_s = state.clock.read()
    elif state.step % args.log_interval == 0:
        shared = torch.tensor([float(received is not None), state.clock.read()], dtype=torch.float64, device=run.device)
        dist.all_reduce(shared, op=dist.ReduceOp.MAX)
        state.train_s = float(shared[1])
        received = (received or "a signal on another rank") if shared[0] else None
    else:
        received = None
    state.out_of_time = spent(args, state.train_s)
    if state.out_of_time:  # the run ends as planned (final evaluation, checkpoint, summary)
        return None
    if args.stop_after and state.step - state.start_step >= args.stop_after:
        return "--stop_after"
    return received


def spent(args, train_s):
    """Whether --time_budget_s (when set) is used up after train_s seconds of training."""
    return bool(args.time_budget_s) and train_s >= args.time_budget_s


def track_finite(run, state, result):
    """Remember the first step whose loss or gradient norm is not finite, on the device (no host sync per
    step: check_finite reads it at log and save time). With fp16 loss scaling an inf gradient is expected
    now and then (GradScaler skips that step itself), so only the loss counts there."""
    value = result.ce_part + result.aux_part
    if result.grad_norm is not None and not run.scaler.is_enabled():
        value = value + result.grad_norm
    if state.first_bad_step is None:
        state.first_bad_step = torch.full((), torch.iinfo(torch.int64).max, device=value.device)
    bad = ~torch.isfinite(value) & (state.first_bad_step > state.step)
    state.first_bad_step = torch.where(bad, state.step, state.first_bad_step)


def check_finite(run, state):
    """Stop with FloatingPointError (one line, exit code 2 from the CLI) if some step so far had a non-finite
    loss or gradient norm: the run stops before it logs or saves anything after it, so the checkpoint on
    disk is the last good one. All ranks agree (the first bad step is reduced over them)."""
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


def check_state_finite(run, state):
    """Never write non-finite weights or optimizer state: FloatingPointError instead (every rank holds the
    same full state here, so all ranks decide alike). One host read per save."""
    tensors = [*run.model.parameters(), *run.model.buffers(),
               *(v for s in run.optimizer.state.values() for v in s.values() if torch.is_tensor(v))]
    if not bool(torch.stack([torch.isfinite(t).all() for t in tensors if t.is_floating_point()]).all()):
        raise FloatingPointError(
            f"the weights or optimizer state are not finite after step {state.step}; stopped without saving (the "
            f"last checkpoint in {run.args.out_dir} is untouched); lower --learning_rate, then --resume")


def log_train(run, state, result):
    """One metrics record for the log interval that ends now (losses of its last step, all ranks); its
    tokens/s are over training time (the clock stops for evaluation and saving)."""
    now = state.clock.read()
    tok_s = (run.args.batch_size * run.args.seq_len * run.args.grad_accum * run.ctx.world_size
             * state.interval_steps / max(now - state.interval_start, 1e-9))
    state.interval_steps, state.interval_start = 0, now
    ce, aux = result.ce_part, result.aux_part
    if run.ctx.distributed:  # sum the ranks' parts: the losses of the global batch
        parts = torch.stack([ce, aux])
        dist.all_reduce(parts)
        ce, aux = parts[0], parts[1]
    ce = float(ce)
    r = {"step": state.step, "train_loss": ce, "aux_loss": float(aux), "lr": result.lr, "tok_per_s": tok_s,
         "train_time_s": round(state.train_s, 3)}
    if result.grad_norm is not None:
        r["grad_norm"] = float(result.grad_norm)
    r.update(state.telemetry.flush())
    run.metrics.record(r)
    return r


@torch.no_grad()
def evaluate(run):
    """Mean LM cross-entropy (nats per supervised token) over the stage's validation batches."""
    was_training = run.model.training
    run.model.eval()
    total, count = 0.0, 0
    for x, y, *segment_ids in run.data.val_batches:
        n = int((y != IGNORE_INDEX).sum())
        if n:
            extra = {"segment_ids": segment_ids[0].to(run.device)} if segment_ids else {}
            with run.autocast():
                out = run.model(x.to(run.device), labels=y.to(run.device), **extra)
            total, count = total + out.ce_loss.item() * n, count + n
    run.model.train(was_training)
    return total / max(count, 1)


def bits_per_byte(run, loss):
    """Validation loss (nats per supervised token) as bits per UTF-8 byte of the text those tokens stand for:
    comparable across tokenizers. None when the validation text has no bytes."""
    if not run.data.val_bytes:
        return None
    return loss * run.data.val_targets / math.log(2) / run.data.val_bytes


def evaluate_and_record(run, state, progress, first=False):
    val = evaluate(run)
    bpb = bits_per_byte(run, val)
    state.last_val = (state.step, val)
    run.metrics.record({"step": state.step, "val_loss": val, **({"val_bpb": bpb} if bpb is not None else {})})
    said = f"val loss {val:.4f}" + (f" ({bpb:.3f} bits/byte)" if bpb is not None else "")
    if first:
        h = run.data.unigram_entropy
        run.log(f"step 0: {said} (uniform over the vocab would be {math.log(run.config.vocab_size):.4f}"
                + (f"; unigram entropy of the validation tokens {h:.4f})" if h is not None else ")"))
    else:
        progress.say(f"step {state.step}: {said}")


def save(run, state):
    """Checkpoint (single-process layout: under EP every rank first gets the owners' experts), config
    and plots. Only rank 0 writes."""
    if run.ctx.ep_size > 1:
        gather_experts(run.model, run.optimizer, run.ctx.ep_group)
    check_state_finite(run, state)
    if not run.ctx.is_main:
        return
    out = run.args.out_dir
    save_checkpoint(os.path.join(out, CKPT_NAME), run.model, run.optimizer, state.step,
                    run.data.train_batches.state_dict(), saved_flags(run.args),
                    extra={**run.data.identity, "world_size": run.ctx.world_size, "ep_size": run.ctx.ep_size,
                           "router_load": state.telemetry.state_dict(), "scaler": run.scaler.state_dict(),
                           "train_time_s": state.clock.read()})
    atomic_write_text(os.path.join(out, "config.json"), run.config.to_json_string())
    plot_loss_curve(run.metrics.records, os.path.join(out, "loss.png"), run.data.unigram_entropy,
                    bits_per_byte(run, 1.0))
    if state.telemetry.total is not None:
        plot_expert_load(state.telemetry.run_fractions(), os.path.join(out, "expert_load.png"),
                         f"share of routed tokens per expert, steps {state.start_step + 1}-{state.step}")


def finish(run, state):
    """Final evaluation (unless one just ran), the summary lines, and a short sample."""
    args = run.args
    if state.start_step >= args.max_steps:
        run.log(f"nothing to do: checkpoint is at step {state.start_step} >= --max_steps {args.max_steps}")
    elif args.time_budget_s:
        run.log(f"trained {state.train_s:.1f} s of --time_budget_s {args.time_budget_s:g} in {state.step} steps"
                + (" (nothing to do: the checkpoint had spent it)" if state.step == state.start_step else ""))
    if state.last_val is None or state.last_val[0] != state.step:
        state.last_val = (state.step, evaluate(run))
    run.metrics.close()
    val, first = state.last_val[1], run.metrics.first("val_loss")
    h = run.data.unigram_entropy
    summary = {"final_val_loss": val, "final_val_bpb": bits_per_byte(run, val), "first_val_loss": first,
               "unigram_entropy": h, "checkpoint": os.path.join(args.out_dir, CKPT_NAME), "loss_curve": os.path.join(args.out_dir, "loss.png"),
               "records": run.metrics.records, "ep_bytes": ep_bytes(run.model), "train_time_s": state.train_s}
    bpb = summary["final_val_bpb"]
    run.log(f"final val loss {val:.4f}" + (f" ({bpb:.3f} bits/byte)" if bpb is not None else "")
            + (f" vs step-0 {first:.4f} ({100 * (1 - val / first):.1f}% lower)" if first else "")
            + (f"; unigram entropy of the validation tokens {h:.4f} ({'below' if val < h else 'NOT below'} it)"
               if h is not None else ""))
    run.log(f"checkpoint: {summary['checkpoint']}\nloss curve: {summary['loss_curve']}")
    if state.telemetry.total is not None:
        summary["expert_load"] = state.telemetry.run_fractions()
        _, ratio, idle = load_summary(state.telemetry.total)
        run.log(f"expert load over the run (max/mean per layer, 1.0 = balanced): "
                f"{' '.join(f'{v:.2f}' for v in ratio.tolist())}; experts never used: {sum(idle.tolist())}; "
                f"heatmap: {os.path.join(args.out_dir, 'expert_load.png')}")
    if run.ctx.ep_size > 1:  # the last checkpoint gathered every expert here: sample without the transport
        uninstall_ep(run.model)
    summary["stopped_by"] = state.stopped_by
    if args.sample_tokens > 0 and run.ctx.is_main and state.stopped_by is None:
        summary["sample"] = sample(run)
        run.log(f"sample: {summary['sample']!r}")
    return summary


def ep_bytes(model):
    """(bytes sent, bytes one copy per routed pair would cost) of each EP dispatcher, [] without EP."""
    return [(d.bytes_sent, d.bytes_k_copies) for d in ep_dispatchers(model)]


def sample(run):
    tok = run.data.tokenizer
    run.model.eval()
    ids = torch.tensor([tok(run.stage.sample_prompt, add_special_tokens=False)["input_ids"]], device=run.device)
    g = torch.Generator(device=run.device).manual_seed(run.args.seed)
    with run.autocast():
        out = run.model.generate(ids, max_new_tokens=run.args.sample_tokens, temperature=0.8, top_k=40,
                                 eos_token_id=stop_token_ids(tok), generator=g)
    return tok.decode(out[0].tolist(), skip_special_tokens=True)


def run_cli(train_fn, args, log=print):
    """Call train_fn(args); turn bad input into a one-line error and exit code 2 instead of a traceback."""
    from huggingface_hub.errors import StrictDataclassError
    try:
        return train_fn(args, log=log)
    except (DataError, ValueError, OSError, StrictDataclassError, FloatingPointError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except PeerFailed as e:  # rank 0 printed the error; this rank only says why it stops
        print(f"note: rank {os.environ.get('RANK', '?')} stops: {e}", file=sys.stderr)
        sys.exit(2)
