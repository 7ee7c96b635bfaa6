"""Where a run's numbers go: metrics.jsonl (one JSON record per log interval / evaluation), wandb when
asked, the progress bar, loss.png and expert_load.png, and the expert-load telemetry behind them. Only
rank 0 writes; on the other ranks every call is a no-op."""
import json
import os
import sys

from tqdm import tqdm

from data.atomic import atomic_file

METRICS_NAME = "metrics.jsonl"


class MetricsLog:
    """`records` (dicts with "step") mirrored to out_dir/metrics.jsonl. A resume, `resumed` = (the run folder of
    the checkpoint: out_dir or another, its step), starts the file with that folder's records up to the step
    (never what out_dir held before; rewritten atomically); a new run (None) starts an empty file."""

    def __init__(self, out_dir, is_main, wandb_run=None, resumed=None):
        self.path = os.path.join(out_dir, METRICS_NAME)
        self.is_main, self.wandb_run = is_main, wandb_run
        self.records = []
        if resumed is not None:
            run_dir, step = resumed
            carried = os.path.join(run_dir, METRICS_NAME)
            self.records = [r for r in read_records(carried) if r["step"] <= step] if os.path.exists(carried) else []
        if is_main:
            with atomic_file(self.path, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(r) + "\n" for r in self.records)

    def record(self, r):
        """Append one record (a dict with "step"); rank 0 only."""
        if not self.is_main:
            return
        self.records.append(r)
        with open(self.path, "a") as f:
            f.write(json.dumps(r) + "\n")
        if self.wandb_run is not None:
            flat = {k: v for k, v in r.items() if k != "step" and not isinstance(v, list)}
            self.wandb_run.log({**flat, **wandb_fields(r)}, step=r["step"])

    def first(self, key, step=0):
        """The value of `key` logged at `step`, or None."""
        return next((r[key] for r in self.records if r["step"] == step and key in r), None)

    def close(self):
        if self.wandb_run is not None:
            self.wandb_run.finish()


def read_records(path):
    """The records of a metrics.jsonl; a line that is not a JSON object with a "step" (torn by a kill or a full
    disk) is skipped with a warning naming file and line, so a damaged log does not block a resume."""
    records = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                if not isinstance(r, dict) or not isinstance(r.get("step"), int):
                    raise ValueError("no integer \"step\"")
            except ValueError as e:
                print(f"warning: {path}:{n}: skipping a damaged metrics record ({e})", file=sys.stderr)
                continue
            records.append(r)
    return records


def open_wandb(args, config, out_dir):
    """A wandb run (offline unless logged in or WANDB_MODE says otherwise), or None without --wandb."""
    if not args.wandb:
        return None
    import wandb
    netrc = os.path.expanduser("~/.netrc")
    logged_in = (bool(os.environ.get("WANDB_API_KEY"))
                 or (os.path.exists(netrc) and "api.wandb.ai" in open(netrc).read()))
    mode = os.environ.get("WANDB_MODE") or ("online" if logged_in else "offline")
    return wandb.init(project=args.wandb_project, mode=mode, dir=out_dir,
                      config={**vars(args), "model": config.to_dict()})


class Progress:
    """tqdm bar over the optimizer steps (rank 0), fitting 80 columns: `pretrain 160/1300 00:31<03:40, loss 3.123
    10.7k tok/s lr 3.0e-03 load 1.21` (load: largest max/mean expert load over layers, 1.0 = balanced; then
    `idle N` when N experts got no token). `say` prints a line above it."""

    def __init__(self, label, start_step, max_steps, enabled, log):
        self.log = log
        self.bar = tqdm(total=max_steps, initial=start_step, desc=label, disable=not enabled, file=sys.stdout,
                        mininterval=1.0, bar_format="{desc} {n_fmt}/{total_fmt} {elapsed}<{remaining}{postfix}")

    def update(self, fields=None, show_load=True):
        self.bar.update(1)
        if fields is not None:
            text = f"loss {fields['train_loss']:.3f} {fields['tok_per_s'] / 1e3:.1f}k tok/s lr {fields['lr']:.1e}"
            if show_load and "load_max_over_mean" in fields:
                idle = sum(fields["idle_experts"])
                text += f" load {max(fields['load_max_over_mean']):.2f}" + (f" idle {idle}" if idle else "")
            self.bar.postfix = text
            self.bar.refresh()

    def set_total(self, total):
        self.bar.total = total
        self.bar.refresh()

    def say(self, msg):
        self.bar.write(msg) if not self.bar.disable else self.log(msg)

    def close(self):
        self.bar.close()


class LoadTelemetry:
    """Sums the per-step loads over a logging interval and over the run."""

    def __init__(self):
        self.interval = self.total = None

    def add(self, load_LE):
        if load_LE is None:
            return
        self.interval = load_LE.clone() if self.interval is None else self.interval + load_LE
        self.total = load_LE.clone() if self.total is None else self.total + load_LE

    def flush(self):
        """Record fields for the interval just ended ({} without MoE), then start a new interval."""
        if self.interval is None:
            return {}
        fraction, max_over_mean, idle = load_summary(self.interval)
        self.interval = None
        return {"expert_load": [[round(v, 4) for v in row] for row in fraction.tolist()],
                "load_max_over_mean": [round(v, 3) for v in max_over_mean.tolist()],
                "idle_experts": idle.tolist()}

    def state_dict(self):
        """The interval's and the run's sums (int64 [L, E] CPU tensors or None), so a resume logs the same loads."""
        return {k: None if v is None else v.cpu() for k, v in (("interval", self.interval), ("total", self.total))}

    def load_state_dict(self, state):
        self.interval, self.total = state.get("interval"), state.get("total")

    def run_fractions(self):
        return None if self.total is None else load_summary(self.total)[0].tolist()


def wandb_fields(fields):
    """Flat per-layer scalars for wandb (it does not chart nested lists)."""
    out = {}
    for i, (r, n) in enumerate(zip(fields.get("load_max_over_mean", []), fields.get("idle_experts", []))):
        out[f"router/layer{i}/max_over_mean"] = r
        out[f"router/layer{i}/idle_experts"] = n
    return out


def plot_loss_curve(records, path, unigram_entropy=None, bpb_per_nat=None):
    """PNG (atomic) of records' "train_loss" / "val_loss" by "step"; bpb_per_nat (validation bits per byte at 1
    nat/token) adds a right axis in bits per byte."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["train_loss"]) for r in records if "train_loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    if train:
        ax.plot(*zip(*train), lw=1, alpha=0.8, label="train (LM loss)")
    if val:
        ax.plot(*zip(*val), "o-", ms=4, label="validation")
    if unigram_entropy is not None:
        ax.axhline(unigram_entropy, ls="--", c="gray", lw=1, label=f"unigram entropy {unigram_entropy:.2f}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats / token)")
    if bpb_per_nat:  # a linear map of the loss axis: exact for the validation points
        right = ax.secondary_yaxis("right", functions=(lambda n: n * bpb_per_nat, lambda b: b / bpb_per_nat))
        right.set_ylabel("validation bits per byte")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_file(path) as f:
        fig.savefig(f, format="png")
    plt.close(fig)


def plot_expert_load(fraction_LE, path, title="share of routed tokens per expert"):
    """PNG (atomic) heatmap of fraction_LE [L, E] (each layer's share of routed pairs; 1/E everywhere = balanced)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    data = np.asarray(fraction_LE, dtype=float)
    L, E = data.shape
    fig, ax = plt.subplots(figsize=(min(2.5 + 0.45 * E, 16), 1.6 + 0.45 * L), dpi=110)
    im = ax.imshow(data, cmap="viridis", aspect="auto", vmin=0.0, vmax=max(data.max(), 2.0 / E))
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_xticks(range(E))
    ax.set_yticks(range(L))
    if E <= 16:
        for i in range(L):
            for j in range(E):
                ax.text(j, i, f"{data[i, j]:.2f}", ha="center", va="center", fontsize=7,
                        color="white" if data[i, j] < 0.6 * data.max() else "black")
    fig.colorbar(im, ax=ax, label=f"fraction (balanced = {1 / E:.3f})")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    with atomic_file(path) as f:
        fig.savefig(f, format="png")
    plt.close(fig)


def load_summary(load_LE):
    """Per layer: fraction of routed pairs per expert [L, E], max/mean load [L], experts with none [L]."""
    load = load_LE.float()
    total_L1 = load.sum(-1, keepdim=True).clamp(min=1)
    fraction_LE = load / total_L1
    max_over_mean_L = load.max(-1).values / load.mean(-1).clamp(min=1e-12)
    idle_L = (load == 0).sum(-1)
    return fraction_LE, max_over_mean_L, idle_L


def param_counts(model, config):
    """(parameters, those a token uses): the total less the experts it does not use, in every layer."""
    n_params = sum(p.numel() for p in model.parameters())
    return n_params, n_params - (config.num_hidden_layers * (config.num_experts - config.num_experts_per_tok) * 3
                                 * config.hidden_size * config.moe_intermediate_size if config.use_moe else 0)


def describe_model(model, config, device, dtype):
    """One log line: parameters (total / active per token), shape, device and dtype."""
    n_params, n_active = param_counts(model, config)
    kind = f"MoE E={config.num_experts} k={config.num_experts_per_tok}" if config.use_moe else "dense"
    return (f"model: {n_params / 1e6:.2f}M params ({n_active / 1e6:.2f}M active), {kind}, {config.num_hidden_layers} "
            f"layers, D={config.hidden_size}, moe_impl {config.moe_impl}; device {device}, {str(dtype)[6:]}")
