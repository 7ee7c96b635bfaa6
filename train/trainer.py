"""The training loop shared by every stage: model + data + optimizer + checkpoints + logging.

A stage script (pretrain.py) only parses its flags and calls `train(args)`.
"""
import contextlib
import json
import math
import os
import shutil
import sys
import time

import torch
from tqdm import tqdm

from data.dataset import DataError, WindowBatches, fixed_windows, unigram_entropy
from data.prepare import prepare_data
from data.tokenizer import stop_token_ids
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from model.hf_adapter import is_hf_folder, load_hf_folder
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from train.checkpoint import CKPT_NAME, load_checkpoint, model_from_checkpoint, save_checkpoint
from train.distributed import barrier, check_same_on_all_ranks, init_distributed, shutdown
from train.expert_parallel import (clip_grad_norm_ep, expert_param_names, gather_experts, reduce_expert_grads)
from train.expert_parallel import install as install_ep, uninstall as uninstall_ep
from train.plot import plot_expert_load, plot_loss_curve
from train.router_balance import LoadTelemetry, compact, step_router_load, wandb_fields
from model.router import load_summary
from train.schedule import lr_at


# Config fields that choose how to train or compute, not what the model is: on --resume / --init_from they
# come from the flags (whose defaults on --resume are the checkpoint's own flags), not from the weights' config.
TRAINING_FIELDS = {"moe_impl": "moe_impl", "router_aux_loss_type": "aux_loss_type",
                   "router_aux_loss_coef": "aux_loss_coef", "router_z_loss_coef": "z_loss_coef",
                   "router_dtype": "router_dtype"}


def training_fields(args):
    return {field: getattr(args, flag) for field, flag in TRAINING_FIELDS.items()}


def build_config(args, vocab_size):
    return MiniMindConfig(
        vocab_size=vocab_size, hidden_size=args.hidden_size, num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads,
        max_position_embeddings=args.max_position_embeddings, dropout=args.dropout,
        use_moe=args.use_moe, num_experts=args.num_experts, num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.moe_intermediate_size, intermediate_size=args.intermediate_size,
        router_aux_loss_coef=args.aux_loss_coef, capacity_factor=args.capacity_factor,
        moe_drop_policy=args.drop_policy, moe_pad_to_capacity=bool(args.pad_to_capacity),
        moe_expert_alignment=args.expert_alignment, moe_impl=args.moe_impl, router_aux_loss_type=args.aux_loss_type,
        router_z_loss_coef=args.z_loss_coef, router_bias_update_rate=args.bias_update_rate,
        router_dtype=args.router_dtype)


def resolve_device(args, local_rank=0):
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        device = f"cuda:{local_rank}"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda requested but CUDA is not available")
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    return device, dtype


def make_optimizer(model, args):
    """AdamW; weight decay only on matrices (not norms), as nanoGPT / MiniMind."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=args.learning_rate, betas=(0.9, 0.95), eps=1e-8)


@torch.no_grad()
def evaluate(model, windows, batch_size, autocast):
    """Mean LM cross-entropy (nats/token) over fixed validation windows [N, S+1]."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        w = windows[i:i + batch_size]
        with autocast():
            out = model(w[:, :-1], labels=w[:, 1:])
        n = w[:, 1:].numel()
        total += out.ce_loss.item() * n
        count += n
    model.train(was_training)
    return total / count


def micro_step(train_model, x, y, grad_accum, scaler, autocast):
    """Forward + backward of one micro-batch. The whole loss (LM cross-entropy + the router losses) is
    divided by grad_accum exactly once, so M micro-steps add up to one step's mean: the aux loss is not
    multiplied by the number of micro-steps. Returns the detached (ce_loss, aux_loss) of the micro-batch."""
    with autocast():
        out = train_model(x, labels=y)
    scaler.scale(out.loss / grad_accum).backward()
    return out.ce_loss.detach(), out.aux_loss.detach()


def _wandb_run(args, config):
    if not args.wandb:
        return None
    import wandb
    logged_in = bool(os.environ.get("WANDB_API_KEY")) or os.path.exists(os.path.expanduser("~/.netrc")) and \
        "api.wandb.ai" in open(os.path.expanduser("~/.netrc")).read()
    mode = os.environ.get("WANDB_MODE") or ("online" if logged_in else "offline")
    return wandb.init(project=args.wandb_project, mode=mode, dir=args.out_dir,
                      config={**vars(args), "model": config.to_dict()})


def train(args, log=print):
    """Run (or resume) a training job described by parsed args; single process, or every rank of a
    torchrun launch (DDP, plus expert parallelism when args.ep_size > 1). Returns a summary dict."""
    device_type = "cuda" if resolve_device(args)[0].startswith("cuda") else "cpu"
    ctx = init_distributed(args.ep_size, device_type)
    try:
        summary = _train(args, ctx, log if ctx.is_main else (lambda *_: None))
    except BaseException:
        shutdown(ctx, wait_for_peers=False)  # a peer may never reach the barrier after a one-rank error
        raise
    shutdown(ctx)
    return summary


def _train(args, ctx, log):
    torch.manual_seed(args.seed)  # the same on every rank: identical initial weights everywhere
    device, dtype = resolve_device(args, ctx.local_rank)
    ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    device_type = "cuda" if device.startswith("cuda") else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(device)

    def autocast():
        if ptdtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=ptdtype)

    os.makedirs(args.out_dir, exist_ok=True)
    ckpt_path = os.path.join(args.out_dir, CKPT_NAME)
    resume = load_checkpoint(args.resume) if args.resume else None

    init_model, source_dir = None, None
    if resume is not None:
        source_dir = os.path.dirname(os.path.abspath(args.resume))
    elif args.init_from:  # start from trained weights (ours or an exported HF folder), fresh optimizer
        if is_hf_folder(args.init_from):
            init_model, source_dir = load_hf_folder(args.init_from), args.init_from
        else:
            init_ckpt = load_checkpoint(args.init_from)
            init_model = model_from_checkpoint(init_ckpt)
            source_dir = args.init_from if os.path.isdir(args.init_from) else os.path.dirname(os.path.abspath(args.init_from))
    tokenizer_dir = args.tokenizer
    if source_dir is not None and tokenizer_dir is None:  # the run's own tokenizer, even if the cache is gone
        for cand in (os.path.join(source_dir, "tokenizer"), source_dir):
            if os.path.exists(os.path.join(cand, "tokenizer.json")):
                tokenizer_dir = cand
                break
        else:
            if init_model is not None:  # a fresh tokenizer would not match the trained embeddings
                raise ValueError(f"{args.init_from}: no tokenizer next to the weights; pass --tokenizer DIR")
    if not ctx.is_main:  # rank 0 builds the caches first, the others then read them
        barrier(ctx)
    data = prepare_data(args.data_path, tokenizer_dir, args.vocab_size, log=log)
    if ctx.is_main:
        barrier(ctx)
    tokenizer = data["tokenizer"]
    tok_out = os.path.join(args.out_dir, "tokenizer")
    if ctx.is_main and os.path.abspath(data["tokenizer_dir"]) != os.path.abspath(tok_out):
        tmp = tok_out + f".tmp{os.getpid()}"
        shutil.copytree(data["tokenizer_dir"], tmp, dirs_exist_ok=True)
        if os.path.exists(tok_out):
            shutil.rmtree(tok_out)
        os.replace(tmp, tok_out)

    if resume is not None:  # the architecture comes from the checkpoint, never from flags
        config = MiniMindConfig.from_dict({**resume["config"], **training_fields(args)})
    elif init_model is not None:
        config = MiniMindConfig.from_dict({**init_model.config.to_dict(), **training_fields(args)})
    else:
        config = build_config(args, len(tokenizer))
    if config.vocab_size < len(tokenizer):
        raise ValueError(f"MiniMindConfig.vocab_size={config.vocab_size} is smaller than the tokenizer's "
                         f"{len(tokenizer)} tokens")
    if args.seq_len > config.max_position_embeddings:
        raise ValueError(f"--seq_len {args.seq_len} exceeds max_position_embeddings={config.max_position_embeddings}")
    if ctx.ep_size > 1 and (not config.use_moe or config.num_experts % ctx.ep_size):
        raise ValueError(f"--ep_size {ctx.ep_size} must divide num_experts={config.num_experts} of an MoE model")
    check_same_on_all_ranks(ctx, "the model config", config.to_dict())
    check_same_on_all_ranks(ctx, "the training flags", {k: v for k, v in vars(args).items() if k != "device"})
    model = MiniMindForCausalLM(config)
    if init_model is not None:
        model.load_state_dict(init_model.state_dict(), strict=True)
        log(f"initialised weights from {args.init_from}")
    model = model.to(device)
    optimizer = make_optimizer(model, args)
    # One global batch of batch_size x world windows per micro-step; rank r trains on its slice, so N
    # ranks x B sequences see exactly the batches one process with N x B sequences sees.
    loader = WindowBatches(data["train"], args.seq_len, args.batch_size * ctx.world_size, seed=args.seed,
                           name="training data")
    my_rows = slice(ctx.rank * args.batch_size, (ctx.rank + 1) * args.batch_size)
    val_windows = fixed_windows(data["val"], args.seq_len, args.eval_tokens).to(device)
    h_unigram = unigram_entropy(data["val"])

    start_step, records = 0, []
    metrics_path = os.path.join(args.out_dir, "metrics.jsonl")
    if resume is not None:
        if resume.get("train_tokens") not in (None, len(data["train"])):
            raise ValueError(f"{args.resume}: the checkpoint was trained on {resume['train_tokens']:,} tokens but the "
                             f"data now gives {len(data['train']):,}; resume needs the same data and tokenizer")
        model.load_state_dict(resume["model"], strict=True)
        optimizer.load_state_dict(resume["optimizer"])
        loader.load_state_dict(resume["data"])
        torch.set_rng_state(resume["rng"]["torch"])
        if device_type == "cuda" and resume["rng"]["cuda"]:
            torch.cuda.set_rng_state_all(resume["rng"]["cuda"])
        start_step = resume["step"]
        if os.path.exists(metrics_path):  # drop what was logged after the checkpoint we resume from
            with open(metrics_path) as f:
                records = [r for r in map(json.loads, f) if r["step"] <= start_step]
        log(f"resumed from {args.resume} at step {start_step}")
    if ctx.is_main:
        with open(metrics_path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)

    n_params = sum(p.numel() for p in model.parameters())
    n_active = n_params
    if config.use_moe:
        per_expert = 3 * config.hidden_size * config.moe_intermediate_size
        n_active -= config.num_hidden_layers * (config.num_experts - config.num_experts_per_tok) * per_expert
    log(f"model: {n_params / 1e6:.2f}M params ({n_active / 1e6:.2f}M active), "
        f"{'MoE E=%d k=%d' % (config.num_experts, config.num_experts_per_tok) if config.use_moe else 'dense'}, "
        f"{config.num_hidden_layers} layers, D={config.hidden_size}; device {device}, {dtype}")

    if ctx.ep_size > 1:
        install_ep(model, ctx.ep_group, config.num_experts)
    train_model = model
    if ctx.distributed:
        if ctx.ep_size > 1:  # experts are sharded: their grads are reduced by reduce_expert_grads, not DDP
            DDP._set_params_and_buffers_to_ignore_for_model(model, expert_param_names(model))
        train_model = DDP(model, device_ids=[ctx.local_rank] if device_type == "cuda" else None,
                          find_unused_parameters=False)
    if args.compile:
        train_model = torch.compile(train_model)
    wandb_run = _wandb_run(args, config) if ctx.is_main else None

    def record(r):
        if not ctx.is_main:
            return
        records.append(r)
        with open(metrics_path, "a") as f:
            f.write(json.dumps(r) + "\n")
        if wandb_run is not None:
            flat = {k: v for k, v in r.items() if k != "step" and not isinstance(v, list)}
            wandb_run.log({**flat, **wandb_fields(r)}, step=r["step"])

    def checkpoint(step):
        if ctx.ep_size > 1:  # every rank gets the owners' experts: the file has the single-process layout
            gather_experts(model, optimizer, ctx.ep_group)
        if ctx.is_main:
            save_checkpoint(ckpt_path, model, optimizer, step, loader.state_dict(), vars(args),
                            extra={"train_tokens": len(data["train"]), "world_size": ctx.world_size,
                                   "ep_size": ctx.ep_size})
            config.save_pretrained(args.out_dir)

    first_val = None
    if start_step == 0:
        first_val = evaluate(model, val_windows, args.batch_size, autocast)
        record({"step": 0, "val_loss": first_val})
        log(f"step 0: val loss {first_val:.4f} (uniform over the vocab would be {math.log(config.vocab_size):.4f}; "
            f"unigram entropy of the validation tokens {h_unigram:.4f})")
    else:
        first_val = next((r["val_loss"] for r in records if r["step"] == 0 and "val_loss" in r), None)

    tokens_per_step = args.batch_size * args.seq_len * args.grad_accum
    # fp16 autocast needs loss scaling on CUDA; a disabled scaler is a no-op for fp32 / bf16
    scaler = torch.amp.GradScaler(device_type, enabled=ptdtype == torch.float16 and device_type == "cuda")
    model.train()
    bar = tqdm(range(start_step, args.max_steps), initial=start_step, total=args.max_steps, desc="pretrain",
               dynamic_ncols=True, disable=args.no_progress or not ctx.is_main, file=sys.stdout, mininterval=1.0)
    t_last, val, val_step, done = time.time(), None, None, start_step
    telemetry = LoadTelemetry()

    def say(msg):  # a line above the progress bar, from rank 0 only
        if ctx.is_main:
            bar.write(msg) if not bar.disable else log(msg)
    for step in bar:
        lr = lr_at(step, args.max_steps, args.learning_rate, args.warmup_steps)
        for g in optimizer.param_groups:
            g["lr"] = lr
        lm_loss = aux = 0.0
        for micro in range(args.grad_accum):  # noqa: B007
            x, y = loader.next()
            x, y = x[my_rows].to(device, non_blocking=True), y[my_rows].to(device, non_blocking=True)
            # DDP all-reduces only on the last micro-step of an accumulation
            sync = contextlib.nullcontext() if micro == args.grad_accum - 1 or not ctx.distributed else train_model.no_sync()
            with sync:
                ce, router = micro_step(train_model, x, y, args.grad_accum, scaler, autocast)
            lm_loss += ce / args.grad_accum
            aux += router / args.grad_accum
        scaler.unscale_(optimizer)
        if ctx.ep_size > 1:
            reduce_expert_grads(model, ctx.expert_dp_group, ctx.world_size)
        grad_norm = None
        if args.grad_clip > 0:
            grad_norm = (clip_grad_norm_ep(model, args.grad_clip, ctx.ep_group) if ctx.ep_size > 1
                         else torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip))
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        telemetry.add(step_router_load(model, ctx.distributed))  # + aux-loss-free bias update
        done = step + 1

        if done % args.log_interval == 0 or done == args.max_steps:
            now = time.time()
            n_steps = args.log_interval if done % args.log_interval == 0 else done % args.log_interval
            tok_s = tokens_per_step * n_steps / max(now - t_last, 1e-9)
            t_last = now
            if ctx.distributed:  # the loss of the global batch, for logging
                lm_loss, aux = lm_loss.clone(), aux.clone()
                dist.all_reduce(lm_loss)
                dist.all_reduce(aux)
                lm_loss, aux = lm_loss / ctx.world_size, aux / ctx.world_size
                tok_s *= ctx.world_size
            lm_loss_f = float(lm_loss)
            if not math.isfinite(lm_loss_f):
                raise FloatingPointError(f"training loss is {lm_loss_f} at step {done}; lower --learning_rate")
            r = {"step": done, "train_loss": lm_loss_f, "aux_loss": float(aux), "lr": lr, "tok_per_s": tok_s}
            if grad_norm is not None:
                r["grad_norm"] = float(grad_norm)
            load_fields = telemetry.flush()
            r.update(load_fields)
            record(r)
            bar.set_postfix_str(f"loss {lm_loss_f:.3f} lr {lr:.2e} {tok_s:,.0f} tok/s"
                                + (f" | {compact(load_fields)}" if load_fields and args.show_load else ""))
        if done % args.eval_interval == 0 or done == args.max_steps:
            val, val_step = evaluate(model, val_windows, args.batch_size, autocast), done
            record({"step": done, "val_loss": val})
            say(f"step {done}: val loss {val:.4f}")
        stopping = bool(args.stop_after) and done - start_step >= args.stop_after
        if done % args.save_interval == 0 or done == args.max_steps or stopping:
            checkpoint(done)
            if ctx.is_main:
                plot_loss_curve(records, os.path.join(args.out_dir, "loss.png"), h_unigram)
                if telemetry.total is not None:
                    plot_expert_load(telemetry.run_fractions(), os.path.join(args.out_dir, "expert_load.png"),
                                     f"share of routed tokens per expert, steps {start_step + 1}-{done}")
        if stopping:
            say(f"stopping after {args.stop_after} steps at step {done} (--stop_after); resume with --resume")
            break
    bar.close()
    if val_step != done:  # stopped between evaluations, or nothing left to do
        if start_step >= args.max_steps:
            log(f"nothing to do: checkpoint is at step {start_step} >= --max_steps {args.max_steps}")
        val = evaluate(model, val_windows, args.batch_size, autocast)
    if wandb_run is not None:
        wandb_run.finish()

    summary = {"final_val_loss": val, "first_val_loss": first_val, "unigram_entropy": h_unigram,
               "checkpoint": ckpt_path, "loss_curve": os.path.join(args.out_dir, "loss.png"),
               "records": records}
    log(f"final val loss {val:.4f}" + (f" vs step-0 {first_val:.4f} ({100 * (1 - val / first_val):.1f}% lower)"
                                       if first_val else "")
        + f"; unigram entropy of the validation tokens {h_unigram:.4f} "
        f"({'below' if val < h_unigram else 'NOT below'} it)")
    log(f"checkpoint: {ckpt_path}\nloss curve: {summary['loss_curve']}")
    if telemetry.total is not None:
        summary["expert_load"] = telemetry.run_fractions()
        _, ratio, idle = load_summary(telemetry.total)
        log(f"expert load over the run (max/mean per layer, 1.0 = balanced): "
            f"{' '.join(f'{v:.2f}' for v in ratio.tolist())}; experts never used: {sum(idle.tolist())}; "
            f"heatmap: {os.path.join(args.out_dir, 'expert_load.png')}")
    summary["ep_bytes"] = [(d.bytes_sent, d.bytes_k_copies) for d in
                           (getattr(m, "expert_parallel", None) for m in model.modules()) if d is not None]
    if ctx.ep_size > 1:  # the last checkpoint gathered every expert here: generate without the transport
        uninstall_ep(model)
    if args.sample_tokens > 0 and ctx.is_main:
        model.eval()
        prompt = "The"
        ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]], device=device)
        g = torch.Generator(device=device).manual_seed(args.seed)
        with autocast():
            out = model.generate(ids, max_new_tokens=args.sample_tokens, temperature=0.8, top_k=40,
                                 eos_token_id=stop_token_ids(tokenizer), generator=g)
        summary["sample"] = tokenizer.decode(out[0].tolist(), skip_special_tokens=True)
        log(f"sample: {summary['sample']!r}")
    return summary


def run_cli(train_fn, args, log=print):
    """Call train_fn(args); turn bad input into a one-line error and exit code 2 instead of a traceback."""
    from huggingface_hub.errors import StrictDataclassError
    try:
        return train_fn(args, log=log)
    except (DataError, ValueError, OSError, StrictDataclassError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
