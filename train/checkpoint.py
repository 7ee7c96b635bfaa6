"""Checkpoints and weight files: fp32 weights, optimizer, step, data position, RNG state, config and flags in
one file, written atomically (data/atomic.py), loaded strictly; HF folders (config.json + safetensors) read
into the same model. Each checkpoint carries a SHA-256 of everything else in it (`checksum`: weights, optimizer,
config, flags, step, plan, data position, RNG), verified on every load, so a flipped bit anywhere is reported,
never loaded (torch.load only notices a damaged container); HF exports carry the SHA-256 of their tensors in
model.safetensors' metadata (`safetensors_metadata`, checked by `load_safetensors`).

Runs whose ranks hold different parts (expert parallelism, FSDP) write a sharded checkpoint instead: the
folder `ckpt` (a link, swapped atomically, to ckpt.step<N>/), every tensor by its single-process name
(`tensor_state`) written by torch.distributed.checkpoint (DCP: each rank its own, one copy of what ranks
share; loading reads what each rank needs, so any world size and ep_size resumes it), plus state.pt (rank
0: config, flags, step, data position, RNG, the SHA-256 of every DCP file, and its own). A run folder holds
one of the two, `checkpoint_in` finds it; every reader takes either.
"""
import hashlib
import os
import shutil
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, distribute_tensor

from data.atomic import atomic_file, atomic_link, usual_modes

CKPT_NAME = "ckpt.pt"
SHARDED_NAME, SHARDED_STATE = "ckpt", "state.pt"  # the sharded checkpoint (a link to its folder), its state file
HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")  # of AdamW's groups, restored with its state
CHECKSUM_KEY, LEGACY_CHECKSUM_KEY = "sha256", "checksum"
HF_CHECKSUM_KEY = "minimind_tensors_sha256"  # safetensors metadata entry written by export_hf.py


def unwrap(model):
    """The plain module under torch.compile / DDP wrappers (their state_dict keys carry prefixes)."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif hasattr(model, "module") and isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


def atomic_torch_save(obj, path):
    """torch.save to `path` so that a crash at any moment leaves either the old file or the new one."""
    with atomic_file(path) as f:
        torch.save(obj, f)


def save_checkpoint(path, model, optimizer=None, extra=None):
    """Write {"model": fp32 CPU state_dict, "optimizer" (per-expert layout: `optimizer_state_per_expert`),
    "config", **extra, "sha256"} atomically (train/loop.py's extra: TrainState, the flags as "args", the data
    identity, the world size)."""
    model = unwrap(model)
    state = {"model": {k: v.detach().float().cpu() if v.is_floating_point() else v.cpu()
                       for k, v in model.state_dict().items()},
             "optimizer": optimizer_state_per_expert(optimizer, model) if optimizer is not None else None,
             "config": model.config.to_dict(), **(extra or {})}
    state[CHECKSUM_KEY] = checksum(state)
    atomic_torch_save(state, path)


def _per_expert_slots(model, params):
    """What the per-expert layout lists in place of `params` (an optimizer's parameters in order):
    [(i, where)], params[i][where] each; an Experts' stacked gate_up_proj stands for E x (gate, up,
    down) slices, its down_proj for nothing (the order of E FeedForward modules' parameters); a
    stacked tensor whose partner is not in `params` (frozen) stands for its own E slices alone."""
    from model.moe import Experts, per_expert_entries
    stacks = [m for m in unwrap(model).modules() if isinstance(m, Experts)]
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


def optimizer_state_per_expert(optimizer, model):
    """optimizer.state_dict() with each stacked expert tensor's state as per-expert entries (views), the layout of
    a model of E FeedForward experts: what checkpoints hold, whatever the storage of the experts."""
    saved, params = optimizer.state_dict(), [p for g in optimizer.param_groups for p in g["params"]]
    slots = _per_expert_slots(model, params)
    state = {n: {k: v[where] if torch.is_tensor(v) and v.dim() else v for k, v in saved["state"][i].items()}
             for n, (i, where) in enumerate(slots) if i in saved["state"]}
    group_of = [j for j, g in enumerate(saved["param_groups"]) for _ in g["params"]]  # group of each parameter
    groups = [{**g, "params": [n for n, (i, _) in enumerate(slots) if group_of[i] == j]}
              for j, g in enumerate(saved["param_groups"])]
    return {"state": state, "param_groups": groups}


def optimizer_state_stacked(saved, optimizer, model):
    """The inverse of `optimizer_state_per_expert`: a checkpoint's optimizer state for `optimizer` (stacked experts).
    Raises ValueError when it does not fit the model (count of entries, an expert's state partial or its steps
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


def _leaves(obj, prefix=""):
    """(name, value) of every tensor and plain value (empty containers included) inside nested dicts / lists /
    tuples, in a fixed order; each dict also gives the reprs of its keys (so 0 and "0" differ)."""
    if isinstance(obj, dict) and obj:
        keys = sorted(obj, key=str)
        yield f"{prefix}/<keys>", tuple(repr(k) for k in keys)
        for k in keys:
            yield from _leaves(obj[k], f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)) and obj:
        for i, v in enumerate(obj):
            yield from _leaves(v, f"{prefix}/{i}")
    else:
        yield prefix, obj


def checksum(state, tensors_only=False):
    """SHA-256 (hex) over everything in the dict `state` except its own CHECKSUM_KEY: each tensor's name, dtype,
    shape and bytes, each other value's name, type and repr (with `tensors_only`, the tensors alone: what
    checkpoints written before the whole was covered carry as "checksum")."""
    h = hashlib.sha256()
    for name, v in _leaves({k: v for k, v in state.items() if k not in (CHECKSUM_KEY, LEGACY_CHECKSUM_KEY)}):
        if isinstance(v, torch.Tensor):
            t = v.detach().cpu().contiguous()
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif not tensors_only:
            h.update(f"{name}|{type(v).__name__}|{v!r}|".encode())
    return h.hexdigest()


def verify(ckpt, path):
    """Raise ValueError (one line, naming the file) unless the checkpoint carries a SHA-256 that matches its
    contents."""
    if CHECKSUM_KEY in ckpt:
        ok = checksum(ckpt) == ckpt[CHECKSUM_KEY]
    elif LEGACY_CHECKSUM_KEY in ckpt:
        ok = checksum(ckpt, tensors_only=True) == ckpt[LEGACY_CHECKSUM_KEY]
    else:
        raise ValueError(f"{path}: the checkpoint carries no checksum (not written by train/, or damaged); use "
                         f"another checkpoint")
    if not ok:
        raise ValueError(f"{path}: checksum mismatch: the file is damaged (its contents changed after it was "
                         f"written); use another checkpoint")


def checkpoint_in(path):
    """The checkpoint `path` names: a ckpt.pt, a sharded checkpoint's folder, or a run folder's (ckpt.pt or
    the link ckpt, the newer where a crash left both); a run folder without one gives its ckpt.pt path (not
    there)."""
    if not os.path.isdir(path) or is_sharded(path):
        return path
    found = [os.path.join(path, n) for n in (CKPT_NAME, SHARDED_NAME) if os.path.lexists(os.path.join(path, n))]
    return max(found, key=lambda p: os.lstat(p).st_mtime) if found else os.path.join(path, CKPT_NAME)


def _check_exists(path):
    """Raise FileNotFoundError naming `path` (and, for a link, its missing target) unless it exists."""
    if os.path.islink(path) and not os.path.exists(path):
        raise FileNotFoundError(f"{path}: checkpoint not found (a link to {os.readlink(path)}, which is missing)")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: checkpoint not found")


def is_sharded(path):
    """Whether `path` is a sharded checkpoint's folder (complete or not: its state.pt or DCP's .metadata)."""
    return os.path.isdir(path) and any(os.path.lexists(os.path.join(path, n)) for n in (SHARDED_STATE, ".metadata"))


def run_dir_of(path):
    """The run folder of a checkpoint path: the folder itself, or the one holding the ckpt.pt / sharded
    checkpoint."""
    return path if os.path.isdir(path) and not is_sharded(path) else os.path.dirname(os.path.abspath(path))


def load_checkpoint(path, weights=True):
    """Load a checkpoint dict (tensors on CPU): of a sharded one the state, with `weights` the whole
    single-process "model" state_dict read from its shards. Raises FileNotFoundError / ValueError with the
    path."""
    path = checkpoint_in(path)
    if is_sharded(path):
        return load_sharded(path, weights)
    _check_exists(path)
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated or foreign file
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")[:160]
        raise ValueError(f"{path}: not a readable checkpoint ({type(e).__name__}: {first})") from None
    if not isinstance(ckpt, dict):
        raise ValueError(f"{path}: not a checkpoint (holds a {type(ckpt).__name__}, not a dict)")
    missing = {"model", "config"} - set(ckpt)
    if missing:
        raise ValueError(f"{path}: checkpoint lacks {sorted(missing)}")
    verify(ckpt, path)
    check_weights_fit_config(ckpt, path)
    return ckpt


def read_saved_flags(path):
    """(the flags saved in a training checkpoint, its world size), without reading its tensors (mmap).
    Raises FileNotFoundError / ValueError naming the file, also for weights without training state."""
    path = checkpoint_in(path)
    _check_exists(path)
    if is_sharded(path):
        ckpt = read_sharded_state(path)
        return dict(ckpt["args"]), ckpt.get("world_size", 1)
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # truncated or foreign file
        raise ValueError(f"{path}: not a readable checkpoint ({type(e).__name__}: {_one_line(e, 160)})") from None
    if not isinstance(ckpt, dict) or not ckpt.get("args") or ckpt.get("optimizer") is None or "data" not in ckpt:
        raise ValueError(f"{path}: holds weights but no training state (an imported or exported model?); start "
                         f"from it with --init_from instead of --resume")
    verify(ckpt, path)
    return dict(ckpt["args"]), ckpt.get("world_size", 1)


def check_weights_fit_config(ckpt, path):
    """Raise ValueError (one line, naming the file) unless ckpt["config"] is a valid MiniMindConfig and ckpt["model"]
    has exactly its tensors and shapes (checked against a model on the meta device)."""
    from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
    if not isinstance(ckpt["config"], dict) or not isinstance(ckpt["model"], dict):
        raise ValueError(f"{path}: not a checkpoint (its config or model entry is not a dict)")
    try:
        config = MiniMindConfig.from_dict(ckpt["config"])
    except Exception as e:  # ValueError naming the field, or the dataclass's own type errors
        raise ValueError(f"{path}: invalid model config ({str(e).splitlines()[0]})") from None
    with torch.device("meta"):
        want = {k: tuple(v.shape) for k, v in MiniMindForCausalLM(config).state_dict().items()}
    have = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in ckpt["model"].items()}
    problems = ([f"missing {k}" for k in want if k not in have] + [f"unexpected {k}" for k in have if k not in want]
                + [f"{k} is {have[k]}, the config needs {want[k]}" for k in want if k in have and have[k] != want[k]])
    if problems:
        more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ValueError(f"{path}: the weights do not fit the config: {'; '.join(problems[:3])}{more}")


def model_from_checkpoint(ckpt, device="cpu", dtype=torch.float32):
    """MiniMindForCausalLM of a checkpoint's config with its weights (loaded strictly), built with the engines
    the trainer builds for `device` under autocast `dtype` (kernels/engines.py: engines_for): every tool runs
    what trained. The tools pass fp32 on CPU (scripts/generate.py: load_model says why)."""
    from kernels.engines import engines_for
    from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
    config = MiniMindConfig.from_dict(ckpt["config"])
    model = MiniMindForCausalLM(config, engines_for(config, device, dtype))
    model.load_state_dict(ckpt["model"], strict=True)
    return model.to(device)


def run_tokenizer(ckpt_path, tokenizer_dir=None):
    """(the tokenizer, its folder) of the run holding `ckpt_path` (a run folder, or a checkpoint file in one):
    `tokenizer_dir` when given, else the run's tokenizer/. Raises FileNotFoundError naming the folder when it
    holds no tokenizer.json, data/tokenizer.py's DataError when that cannot be loaded."""
    from data.tokenizer import load_tokenizer
    if tokenizer_dir is None:
        tokenizer_dir = os.path.join(run_dir_of(ckpt_path), "tokenizer")
    if not os.path.exists(os.path.join(tokenizer_dir, "tokenizer.json")):
        raise FileNotFoundError(f"{tokenizer_dir}: tokenizer not found; pass --tokenizer")
    return load_tokenizer(tokenizer_dir), tokenizer_dir


def _one_line(e, limit=200):
    return " ".join(line.strip() for line in str(e).splitlines() if line.strip())[:limit]


def safetensors_metadata(state):
    """`metadata=` for safetensors' save_file: transformers' format tag and the tensors' `checksum`."""
    return {"format": "pt", HF_CHECKSUM_KEY: checksum({"tensors": state})}


def load_safetensors(path):
    """The tensors of one .safetensors file (CPU). Raises ValueError (one line, naming the file) when unreadable or
    not matching the SHA-256 in its metadata; a file without one (not from export_hf.py) loads unchecked."""
    from safetensors import safe_open
    try:
        with safe_open(path, "pt") as f:
            meta = f.metadata() or {}
            state = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own SafetensorError for empty / truncated / foreign files
        raise ValueError(f"{path}: not a readable safetensors file ({_one_line(e)})") from None
    if HF_CHECKSUM_KEY in meta and checksum({"tensors": state}) != meta[HF_CHECKSUM_KEY]:
        raise ValueError(f"{path}: checksum mismatch: the file is damaged (its tensors changed after it was "
                         f"exported); export it again")
    return state


def load_hf_checked(hf_dir):
    """MiniMindForCausalLM (fp32) from a Qwen3 / Qwen3-MoE HF folder (config.json + *.safetensors), strictly. Every
    problem (bad or inexpressible config, unreadable weights, checksum mismatch, a missing / extra / misshapen
    tensor) is a one-line ValueError naming the file; FileNotFoundError without config.json or weights."""
    import glob
    import json

    from transformers import AutoConfig

    from model.hf_adapter import ExportError, from_hf_config, from_hf_state_dict
    cfg_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{cfg_path}: not found (not a HuggingFace model folder)")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            json.load(f)  # transformers' own message does not say where the JSON breaks
        config = from_hf_config(AutoConfig.from_pretrained(hf_dir))
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path}: not valid JSON ({e})") from None
    except ExportError as e:  # an architecture MiniMind cannot express: the message says which
        raise ValueError(f"{cfg_path}: {e}") from None
    except Exception as e:  # transformers' strict dataclass checks, MiniMindConfig's validation, ...
        raise ValueError(f"{cfg_path}: invalid model config ({type(e).__name__}: {_one_line(e)})") from None
    files = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{hf_dir}: no *.safetensors weights")
    hf_state = {}
    for path in files:
        hf_state.update(load_safetensors(path))
    where = files[0] if len(files) == 1 else hf_dir
    try:
        state = from_hf_state_dict(hf_state, config)
    except KeyError as e:  # the tied embedding is missing
        raise ValueError(f"{where}: the weights do not fit the config: missing {e.args[0]}") from None
    except (IndexError, RuntimeError) as e:  # a fused expert tensor of the wrong rank
        raise ValueError(f"{where}: the weights do not fit the config ({type(e).__name__}: {_one_line(e)})") from None
    ckpt = {"config": config.to_dict(), "model": {k: v.float() for k, v in state.items()}}
    check_weights_fit_config(ckpt, where)
    return model_from_checkpoint(ckpt)


# ----------------------------------------------------------------------------- sharded checkpoints (DCP)

def _param_keys(model):
    """{parameter: [(state_dict key, index into the parameter)]}: an Experts' stacked tensors stand for
    one key per expert and projection (its global expert ids), every other parameter for its own name."""
    from model.moe import Experts, per_expert_entries
    keys = {p: [(name, ())] for name, p in model.named_parameters()}
    for prefix, experts in model.named_modules():
        if isinstance(experts, Experts):
            stacked = {"gate_up_proj": experts.gate_up_proj, "down_proj": experts.down_proj}
            keys.update({p: [] for p in stacked.values()})
            for key, name, index in per_expert_entries(experts, prefix + "."):
                keys[stacked[name]].append((key, index))
    return keys


def tensor_state(model, optimizer=None):
    """Every tensor of a run by its single-process name: {"model": model.state_dict() (per-expert keys;
    under EP this rank's experts, under FSDP DTensor shards), "optimizer": {key: {"step", "exp_avg",
    "exp_avg_sq"}}}, views into the live tensors: what a sharded checkpoint holds, and what loading one fills
    in place."""
    model = unwrap(model)
    state = {"model": model.state_dict()}
    if optimizer is not None:
        keys = _param_keys(model)
        state["optimizer"] = {key: {k: v[where] if torch.is_tensor(v) and v.dim() else v
                                    for k, v in optimizer.state[p].items()}
                              for g in optimizer.param_groups for p in g["params"] for key, where in keys[p]}
    return state


def init_optimizer_state(optimizer):
    """Create the optimizer's state (zeros) by one step on zero grads at learning rate 0, which leaves every
    parameter as it was, so that a checkpoint's state can be loaded into it in place."""
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def copy_tensor_state(source, target):
    """Copy a whole-tensor `tensor_state` (one process's) into another's tensors in place (nested dicts by the
    same keys), a DTensor target from its share of the source (no communication)."""
    for key, t in target.items():
        if isinstance(t, dict):
            copy_tensor_state(source[key], t)
        elif isinstance(t, DTensor):
            t.copy_(distribute_tensor(source[key].to(t.device), t.device_mesh, t.placements, src_data_rank=None))
        elif torch.is_tensor(t):
            t.copy_(source[key])


def _file_sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _gather_from_ranks(value, rank, world, group):
    """Every rank's `value`, in rank order (one all_gather_object over `group`); [value] in one process."""
    if world == 1:
        return [value]
    values = [None] * world
    dist.all_gather_object(values, value, group=group)
    return values


def save_sharded(out_dir, model, optimizer, extra, ctx):
    """Write the sharded checkpoint of a run (every rank calls it): DCP into a temp folder, each rank
    hashing its share of the files, rank 0 adding state.pt (`extra`, the config, the optimizer's
    hyperparameters, the hashes) and publishing it (`_publish`). A crash before the publish leaves the
    previous checkpoint in place (the temp folder is swept by the next save or run)."""
    folder = [tempfile.mkdtemp(dir=out_dir, prefix=f".{SHARDED_NAME}.tmp") if ctx.is_main else None]
    dist.broadcast_object_list(folder, src=0, group=ctx.cpu_group)
    folder = folder[0]
    dcp.save(tensor_state(model, optimizer), checkpoint_id=folder)
    names = sorted(os.listdir(folder))  # (DCP returns after its metadata is written: every rank sees all files)
    mine = {n: _file_sha256(os.path.join(folder, n)) for n in names[ctx.rank::ctx.world_size]}
    files = {n: h for part in _gather_from_ranks(mine, ctx.rank, ctx.world_size, ctx.cpu_group) for n, h in part.items()}
    if not ctx.is_main:
        return
    groups = [{k: g[k] for k in HYPERPARAMETERS} for g in optimizer.param_groups]
    state = {**extra, "config": unwrap(model).config.to_dict(), "optimizer_groups": groups, "files": files}
    state[CHECKSUM_KEY] = checksum(state)
    atomic_torch_save(state, os.path.join(folder, SHARDED_STATE))
    _publish(folder, out_dir, extra.get("step", 0))


def _publish(folder, out_dir, step):
    """Rename `folder` to ckpt.step<step>/, point the link `ckpt` at it in one atomic rename, then delete
    the previous checkpoint (its folder, or a ckpt.pt: a run folder holds one) and unpublished folders."""
    final = os.path.join(out_dir, f"{SHARDED_NAME}.step{step}")
    n = 1
    while os.path.exists(final + (f".{n}" if n > 1 else "")):
        n += 1
    final += f".{n}" if n > 1 else ""
    usual_modes(folder)  # (mkdtemp made it 0700)
    os.rename(folder, final)
    atomic_link(os.path.join(out_dir, SHARDED_NAME), os.path.basename(final))
    _sweep_sharded_folders(out_dir, keep=final)
    if os.path.exists(os.path.join(out_dir, CKPT_NAME)):
        os.remove(os.path.join(out_dir, CKPT_NAME))


def remove_sharded(out_dir):
    """Delete a run folder's sharded checkpoints (after a ckpt.pt replaced them): the link, its folder, any
    unpublished one, a copy that followed the link."""
    link = os.path.join(out_dir, SHARDED_NAME)
    if os.path.islink(link):
        os.remove(link)
    elif is_sharded(link):
        shutil.rmtree(link)
    _sweep_sharded_folders(out_dir)


def _sweep_sharded_folders(out_dir, keep=None):
    """Delete every ckpt.step* folder of out_dir but `keep` (older, unpublished or copied ones)."""
    for name in os.listdir(out_dir):
        path = os.path.join(out_dir, name)
        if name.startswith(f"{SHARDED_NAME}.step") and path != keep:
            shutil.rmtree(path, ignore_errors=True)


def read_sharded_state(folder):
    """A sharded checkpoint's state.pt (no tensors read), verified. Raises ValueError naming the file."""
    path = os.path.join(folder, SHARDED_STATE)
    if not os.path.exists(path):
        raise ValueError(f"{path}: missing (the sharded checkpoint is incomplete); use another checkpoint")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated or foreign file
        raise ValueError(f"{path}: not a readable checkpoint ({type(e).__name__}: {_one_line(e, 160)})") from None
    if not isinstance(state, dict) or not {"config", "files"} <= set(state):
        raise ValueError(f"{path}: not a sharded checkpoint's state (no config or file list)")
    verify(state, path)
    return state


def verify_shards(folder, files, rank=0, world=1, group=None):
    """Raise ValueError (one line, on every rank, naming the file) when a file of the sharded checkpoint is
    missing or differs from its SHA-256 in state.pt; each rank checks its share of the files."""
    problems = []
    for name in sorted(files)[rank::world]:
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            problems.append(f"{path}: missing (the sharded checkpoint is incomplete); use another checkpoint")
        elif _file_sha256(path) != files[name]:
            problems.append(f"{path}: checksum mismatch: the file is damaged (its contents changed after it "
                            f"was written); use another checkpoint")
    problems = [p for part in _gather_from_ranks(problems, rank, world, group) for p in part]
    if problems:
        raise ValueError(problems[0])


def _saved_tensors(folder):
    """{flattened DCP key: (shape, dtype)} of a sharded checkpoint, from its metadata."""
    metadata = dcp.FileSystemReader(folder).read_metadata()
    return {k: (tuple(m.size), m.properties.dtype) for k, m in metadata.state_dict_metadata.items()
            if hasattr(m, "size")}


def load_sharded(folder, weights=True):
    """A sharded checkpoint read by one process: state.pt's dict plus "folder", and with `weights` "model",
    the whole single-process state_dict (CPU); its shapes checked against the config either way
    (`check_weights_fit_config`). Raises ValueError naming the file."""
    state = read_sharded_state(folder)
    verify_shards(folder, {n: h for n, h in state["files"].items() if n == ".metadata"})  # (read here: checked first)
    saved = {k[len("model."):]: v for k, v in _saved_tensors(folder).items() if k.startswith("model.")}
    state["model"] = {k: torch.empty(shape, dtype=dtype, device="meta") for k, (shape, dtype) in saved.items()}
    check_weights_fit_config(state, folder)
    if weights:
        verify_shards(folder, state["files"])
        state["model"] = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in saved.items()}
        _dcp_load({"model": state["model"]}, folder, distributed=False)
    else:
        del state["model"]
    state["folder"] = folder
    return state


def load_sharded_into(folder, state, model, optimizer, ctx):
    """Fill the live `model` and `optimizer` (any world size, ep_size, FSDP or not) from a sharded
    checkpoint in place, each rank reading what it holds (DCP); `state` is its state.pt. Every rank calls
    it."""
    verify_shards(folder, state["files"], ctx.rank, ctx.world_size, ctx.cpu_group)
    init_optimizer_state(optimizer)
    _dcp_load(tensor_state(model, optimizer), folder, ctx.distributed)
    set_hyperparameters(optimizer, state["optimizer_groups"])


def set_hyperparameters(optimizer, groups):
    """Each of the optimizer's groups takes the HYPERPARAMETERS of the matching one in `groups`."""
    for group, saved in zip(optimizer.param_groups, groups):
        group.update({k: saved[k] for k in HYPERPARAMETERS})


def _dcp_load(state, folder, distributed):
    """dcp.load in place; in one process without its warning that it assumes one process."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=folder, no_dist=not distributed)
