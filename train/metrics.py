"""Where a run's numbers go: metrics.jsonl (one JSON record per log interval / evaluation), wandb when
asked, and the progress bar. Only rank 0 writes; on the other ranks every call is a no-op."""
import json
import os
import sys

from tqdm import tqdm

from data.atomic import atomic_file
from train.flags import saved_flags
from train.router_balance import compact, wandb_fields

METRICS_NAME = "metrics.jsonl"


class MetricsLog:
    """Records of this run: `records` (list of dicts with "step") mirrored to out_dir/metrics.jsonl.

    On resume the file keeps what was logged up to the checkpoint's step and drops the rest (rewritten
    atomically). A new run starts an empty file."""

    def __init__(self, out_dir, resume_step, is_main, wandb_run=None):
        self.path = os.path.join(out_dir, METRICS_NAME)
        self.is_main, self.wandb_run = is_main, wandb_run
        self.records = []
        if resume_step is not None and os.path.exists(self.path):
            self.records = [r for r in read_records(self.path) if r["step"] <= resume_step]
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
    """The records of a metrics.jsonl. A line that is not a JSON object with a "step" (a line torn by a
    kill or a full disk, a blank line) is skipped with a warning that names the file and line: a damaged
    log must not block a resume."""
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
    logged_in = bool(os.environ.get("WANDB_API_KEY")) or (os.path.exists(netrc) and "api.wandb.ai" in open(netrc).read())
    mode = os.environ.get("WANDB_MODE") or ("online" if logged_in else "offline")
    return wandb.init(project=args.wandb_project, mode=mode, dir=out_dir,
                      config={**saved_flags(args), "model": config.to_dict()})


class Progress:
    """tqdm bar over the optimizer steps (rank 0 only) plus `say` for lines printed above it."""

    def __init__(self, label, start_step, max_steps, enabled, log):
        self.log = log
        self.bar = tqdm(total=max_steps, initial=start_step, desc=label, dynamic_ncols=True, disable=not enabled,
                        file=sys.stdout, mininterval=1.0)

    def update(self, fields=None, show_load=True):
        self.bar.update(1)
        if fields is not None:
            load = compact(fields) if show_load else ""
            self.bar.set_postfix_str(f"loss {fields['train_loss']:.3f} lr {fields['lr']:.2e} "
                                     f"{fields['tok_per_s']:,.0f} tok/s" + (f" | {load}" if load else ""))

    def say(self, msg):
        self.bar.write(msg) if not self.bar.disable else self.log(msg)

    def close(self):
        self.bar.close()
