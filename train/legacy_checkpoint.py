"""Checkpoints from before the stacked expert names, converted on load: their experts were saved one tensor
per expert and projection (`experts.{e}.{gate,up,down}_proj.weight`, HF's layout), a ckpt.pt's optimizer
state listed by position in that per-expert order, a sharded one's under the same per-expert names (its
AdamW hyperparameters in state.pt). `converted` turns either into today's whole state (train/checkpoint.py:
the layout of `model_state` / `optimizer_state`) through a one-process copy of the model.
"""
import os
import tempfile

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from model.moe import Experts, per_expert_entries, stacked_names


def converted(ckpt, model, optimizer):
    """{"model", "optimizer"} of a legacy checkpoint (`load_checkpoint`'s dict: a ckpt.pt, or a sharded
    one's state with "folder") in today's whole layout, for the live `model` (its parameters' names) and
    `optimizer` (its groups). Raises ValueError when the optimizer state does not fit the model."""
    saved = _read_whole(ckpt["folder"]) if "folder" in ckpt else ckpt
    config = MiniMindConfig.from_dict(ckpt["config"])
    whole = MiniMindForCausalLM(config)
    whole.load_state_dict(saved["model"], strict=True)  # (the per-expert entries stacked: Experts' pre-hook)
    params, names = dict(whole.named_parameters()), {id(p): n for n, p in model.named_parameters()}
    scratch = torch.optim.AdamW([{**{k: v for k, v in g.items() if k != "params"},
                                  "params": [params[names[id(p)]] for p in g["params"]]}
                                 for g in optimizer.param_groups])
    if "folder" not in ckpt:
        scratch.load_state_dict(optimizer_state_stacked(saved["optimizer"], scratch, whole))
    else:  # each moment keyed like the model's per-expert state_dict: stacked by a second model's pre-hook
        step = next(iter(saved["optimizer"].values()))["step"]  # (every parameter steps together)
        moments = {}
        for moment in ("exp_avg", "exp_avg_sq"):
            holder = MiniMindForCausalLM(config)
            holder.load_state_dict({k: v[moment] for k, v in saved["optimizer"].items()}, strict=False)
            moments[moment] = {n: p.detach() for n, p in holder.named_parameters()}
        whole_names = {id(p): n for n, p in params.items()}
        for group, hyperparameters in zip(scratch.param_groups, ckpt["optimizer_groups"]):
            group.update(hyperparameters)
            for p in group["params"]:
                scratch.state[p] = {"step": torch.as_tensor(step).clone(),
                                    **{m: moments[m][whole_names[id(p)]] for m in moments}}
    with stacked_names():
        return {"model": whole.state_dict(), "optimizer": get_optimizer_state_dict(whole, scratch)}


def _read_whole(folder):
    """Every tensor of a sharded checkpoint in one process (DCP's conversion to a torch.save file)."""
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "whole.pt")
        dcp_to_torch_save(folder, path)
        return torch.load(path, map_location="cpu", weights_only=True)


def _per_expert_slots(model, params):
    """What the per-expert layout lists in place of `params` (an optimizer's parameters in order):
    [(i, where)], params[i][where] each; an Experts' stacked gate_up_proj stands for E x (gate, up,
    down) slices, its down_proj for nothing (the order of E FeedForward modules' parameters); a
    stacked tensor whose partner is not in `params` (frozen) stands for its own E slices alone."""
    stacks = [m for m in model.modules() if isinstance(m, Experts)]
    position = {id(p): i for i, p in enumerate(params)}
    gate_ups = {id(m.gate_up_proj): m for m in stacks}
    lone_downs = {id(m.down_proj): m for m in stacks if id(m.gate_up_proj) not in position}
    slots = []
    for i, p in enumerate(params):
        experts = gate_ups.get(id(p)) or lone_downs.get(id(p))
        if experts is None:
            if not any(id(p) == id(m.down_proj) for m in stacks):
                slots.append((i, ()))
            continue
        held = {"gate_up_proj": position.get(id(experts.gate_up_proj)), "down_proj": position.get(id(experts.down_proj))}
        slots += [(held[name], index) for _, name, index in per_expert_entries(experts) if held[name] is not None]
    return slots


def optimizer_state_stacked(saved, optimizer, model):
    """A legacy ckpt.pt's optimizer state (`saved`, listed by position in the per-expert order) as the
    state_dict of `optimizer` over `model`'s stacked experts. Raises ValueError when it does not fit the model (count of entries, an expert's state partial or its steps
    unequal)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    slots = _per_expert_slots(model, params)
    listed = sum(len(g["params"]) for g in saved["param_groups"])
    if listed != len(slots) or len(saved["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(f"the optimizer state lists {listed} parameters in {len(saved['param_groups'])} groups; the "
                         f"model has {len(slots)} in {len(optimizer.param_groups)}")
    state, filled = {}, {}
    for n, (i, where) in enumerate(slots):
        if n not in saved["state"]:
            continue
        filled[i] = filled.get(i, 0) + 1
        if where == ():
            state[i] = saved["state"][n]
            continue
        entry = state.setdefault(i, {})
        for k, v in saved["state"][n].items():
            if torch.is_tensor(v) and v.dim():
                entry.setdefault(k, v.new_empty(params[i].shape))[where].copy_(v)
            elif entry.setdefault(k, v) is not v and not torch.equal(torch.as_tensor(entry[k]), torch.as_tensor(v)):
                raise ValueError(f"the experts' optimizer {k} differs between experts ({entry[k]} and {v})")
    expected = {i: sum(1 for j, _ in slots if j == i) for i in filled}
    if any(filled[i] != expected[i] for i in filled):
        raise ValueError("the optimizer state covers only some experts of a layer")
    members = [set(g["params"]) for g in saved["param_groups"]]
    groups = [{**g, "params": sorted({i for n, (i, _) in enumerate(slots) if n in listed_here})}
              for g, listed_here in zip(saved["param_groups"], members)]
    return {"state": state, "param_groups": groups}


