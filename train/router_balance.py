"""The router's own optimizer step, and the expert-load telemetry built from the same counts.

`router_step` runs after every optimizer step: it collects each MoE layer's routed pairs per expert
(the model only counts them, real tokens only), sums them over the data-parallel ranks and moves the
aux-loss-free selection bias. `LoadTelemetry` sums the loads it returns for the logs and the heatmap.
"""
import torch
import torch.distributed as dist

from model.router import load_summary
from train.expert_parallel import moe_layers


def router_step(model, distributed):
    """The router's own step, after the optimizer step: collect each MoE layer's routed pairs per expert
    counted since the last call (int64 [L, E]), sum them over all ranks (each rank routes its own tokens,
    also under EP; one all-reduce per step), and move each layer's expert bias by them (aux-loss-free
    balancing; only that part is a no-op when it is off). Returns the load for telemetry; None for a
    model without MoE. Runs no host sync (the all-reduce and the update stay on the device)."""
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


class LoadTelemetry:
    """Sums the per-step loads over a logging interval and over the run."""

    def __init__(self):
        self.interval = None
        self.total = None

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
        """The interval's and the run's sums (int64 [L, E] CPU tensors or None), for the checkpoint: a
        resumed run logs the same loads as an uninterrupted one."""
        return {k: None if v is None else v.cpu() for k, v in (("interval", self.interval), ("total", self.total))}

    def load_state_dict(self, state):
        self.interval, self.total = state.get("interval"), state.get("total")

    def run_fractions(self):
        return None if self.total is None else load_summary(self.total)[0].tolist()


def compact(fields):
    """'load max/mean 1.21 1.05 | idle 0 0' for the progress bar (one value per layer); "" for a record
    without load fields (a dense model)."""
    if "load_max_over_mean" not in fields:
        return ""
    ratios = " ".join(f"{v:.2f}" for v in fields["load_max_over_mean"])
    idle = " ".join(str(v) for v in fields["idle_experts"])
    return f"load max/mean {ratios} | idle {idle}"


def wandb_fields(fields):
    """Flat per-layer scalars for wandb (it does not chart nested lists)."""
    out = {}
    for i, (r, n) in enumerate(zip(fields.get("load_max_over_mean", []), fields.get("idle_experts", []))):
        out[f"router/layer{i}/max_over_mean"] = r
        out[f"router/layer{i}/idle_experts"] = n
    return out
