"""Checkpoints and weight files: fp32 weights, optimizer, step, data position, RNG state, config and flags in
one file, written atomically (data/atomic.py), loaded strictly. Each checkpoint carries a SHA-256 of everything
else in it (`checksum`: weights, optimizer, config, flags, step, plan, data position, RNG), verified on every
load, so a flipped bit anywhere is reported, never loaded (torch.load only notices a damaged container).

The model and optimizer state come from torch.distributed.checkpoint's state_dict helpers (`model_state`,
`optimizer_state`: every tensor by its parameter's name, the experts stacked), written whole by one process
(ckpt.pt) or, where the ranks hold parts (expert parallelism, FSDP), sharded: the folder `ckpt` (a link,
swapped atomically, to ckpt.step<N>/) written by DCP (each rank its own, one copy of what ranks share),
plus state.pt (rank 0: config, flags, step, data position, RNG, the SHA-256 of every DCP file, and its own).
`load_into` reads either into any layout (DCP reshards; a ckpt.pt is broadcast from rank 0). A run folder
holds one of the two, `checkpoint_in` finds it; every reader takes either.
"""
import hashlib
import os
import re
import shutil
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from data.atomic import atomic_file
from model.moe import stacked_names
from train.distributed import PeerFailed
from train.run_dir import (CKPT_NAME, SHARDED_NAME, SHARDED_STATE, checkpoint_in, is_sharded, publish_sharded,
                           remove_sharded)

PER_EXPERT_KEY = re.compile(r"\.experts\.\d+\.")  # a training checkpoint from before the stacked names
CHECKSUM_KEY = "sha256"
LEGACY = ("a checkpoint from before the stacked expert names (one tensor per expert, written by train/ before "
          "commit bac3f7d); commit e10cf75 is the last that reads it: resume or export it there, or retrain")


def atomic_torch_save(obj, path):
    """torch.save to `path` so that a crash at any moment leaves either the old file or the new one."""
    with atomic_file(path) as f:
        torch.save(obj, f)


def model_state(model):
    """The model's state_dict by its parameters' names, the experts' stacked (`stacked_names`), from
    torch.distributed.checkpoint's helper: DTensors where the ranks hold parts (FSDP, EP)."""
    with stacked_names():
        return get_model_state_dict(model)


def optimizer_state(model, optimizer):
    """The optimizer's state_dict keyed by parameter names (as `model_state`), from the same helper."""
    with stacked_names():
        return get_optimizer_state_dict(model, optimizer)


def save_checkpoint(path, model, optimizer=None, extra=None):
    """Write {"model": fp32 CPU `model_state`, "optimizer": `optimizer_state`, "config", **extra, "sha256"}
    atomically, in one process (train/loop.py's extra: TrainState, the flags as "args", the data identity,
    the world size)."""
    state = {"model": {k: v.detach().float().cpu() if v.is_floating_point() else v.cpu()
                       for k, v in model_state(model).items()},
             "optimizer": optimizer_state(model, optimizer) if optimizer is not None else None,
             "config": model.config.to_dict(), **(extra or {})}
    state[CHECKSUM_KEY] = checksum(state)
    atomic_torch_save(state, path)


def save_run(out_dir, model, optimizer, extra, ctx, sharded):
    """A run's checkpoint in `out_dir`: sharded by every rank (`save_sharded`) where the ranks hold parts,
    else ckpt.pt by rank 0 (`save_checkpoint`; a sharded one it replaces is removed)."""
    if sharded:
        save_sharded(out_dir, model, optimizer, extra, ctx)
    elif ctx.is_main:
        save_checkpoint(os.path.join(out_dir, CKPT_NAME), model, optimizer, extra)
        remove_sharded(out_dir)


def load_into(ckpt, model, optimizer, ctx):
    """Fill the live `model` and `optimizer` in place from a checkpoint (`load_checkpoint`'s dict), whatever
    the layouts (one process, DDP, EP, FSDP; every rank calls it): a sharded one read by each rank for what
    it holds (DCP reshards), a ckpt.pt set from rank 0's whole state (broadcast, each rank keeping its part)."""
    whole = StateDictOptions(full_state_dict=True, broadcast_from_rank0=ctx.distributed)
    if "folder" in ckpt:
        verify_shards(ckpt["folder"], ckpt["files"], ctx.rank, ctx.world_size, ctx.cpu_group)
    if "folder" in ckpt:
        state, options = {"model": model_state(model), "optimizer": optimizer_state(model, optimizer)}, None
        _dcp_load(state, ckpt["folder"], ctx.distributed)
    else:
        state, options = ckpt, whole
    with stacked_names():
        set_model_state_dict(model, state["model"], options=options)
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)


def refuse_legacy(saved_keys, path):
    """Raise ValueError (one line, naming `path`) when a training checkpoint's weight keys are per expert
    (`LEGACY`); exports and HF imports may be (the model loads both layouts), checkpoints may not."""
    if any(PER_EXPERT_KEY.search(key) for key in saved_keys):
        raise ValueError(f"{path}: {LEGACY}")


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


def checksum(state):
    """SHA-256 (hex) over everything in the dict `state` except its own CHECKSUM_KEY: each tensor's name, dtype,
    shape and bytes, each other value's name, type and repr."""
    h = hashlib.sha256()
    for name, v in _leaves({k: v for k, v in state.items() if k != CHECKSUM_KEY}):
        if isinstance(v, torch.Tensor):
            t = v.detach().cpu().contiguous()
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(f"{name}|{type(v).__name__}|{v!r}|".encode())
    return h.hexdigest()


def verify(ckpt, path):
    """Raise ValueError (one line, naming the file) unless the checkpoint carries a SHA-256 that matches its
    contents."""
    if CHECKSUM_KEY not in ckpt:
        if "checksum" in ckpt:  # (the tensors-only SHA-256 of checkpoints older still)
            raise ValueError(f"{path}: {LEGACY}")
        raise ValueError(f"{path}: the checkpoint carries no checksum (not written by train/, or damaged); use "
                         f"another checkpoint")
    if checksum(ckpt) != ckpt[CHECKSUM_KEY]:
        raise ValueError(f"{path}: checksum mismatch: the file is damaged (its contents changed after it was "
                         f"written); use another checkpoint")


def _check_exists(path):
    """Raise FileNotFoundError naming `path` (and, for a link, its missing target) unless it exists."""
    if os.path.islink(path) and not os.path.exists(path):
        raise FileNotFoundError(f"{path}: checkpoint not found (a link to {os.readlink(path)}, which is missing)")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: checkpoint not found")


def load_checkpoint(path, weights=True):
    """Load a checkpoint dict (tensors on CPU): of a sharded one the state, with `weights` the whole
    single-process "model" state_dict read from its shards. Raises FileNotFoundError / ValueError with the
    path."""
    path = checkpoint_in(path)
    if is_sharded(path):
        return load_sharded(path, weights)
    _check_exists(path)
    ckpt = _torch_load(path)
    if not isinstance(ckpt, dict):
        raise ValueError(f"{path}: not a checkpoint (holds a {type(ckpt).__name__}, not a dict)")
    missing = {"model", "config"} - set(ckpt)
    if missing:
        raise ValueError(f"{path}: checkpoint lacks {sorted(missing)}")
    verify(ckpt, path)
    refuse_legacy(ckpt["model"], path)
    check_weights_fit_config(ckpt, path)
    return ckpt


def _torch_load(path, mmap=False):
    """torch.load of `path` (CPU, tensors and plain values only); a truncated or foreign file is one ValueError
    naming it."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:
        raise ValueError(f"{path}: not a readable checkpoint ({type(e).__name__}: {one_line(e, 160)})") from None


def read_saved_flags(path):
    """(the flags saved in a training checkpoint, its world size), without reading its tensors (mmap).
    Raises FileNotFoundError / ValueError naming the file, also for weights without training state."""
    path = checkpoint_in(path)
    _check_exists(path)
    if is_sharded(path):
        ckpt = read_sharded_state(path)
        return dict(ckpt["args"]), ckpt.get("world_size", 1)
    ckpt = _torch_load(path, mmap=True)
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
        model = MiniMindForCausalLM(config)
        with stacked_names():
            want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        per_expert = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    have = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in ckpt["model"].items()}
    if set(have) & (set(per_expert) - set(want)):  # (per-expert weights: an HF import of that layout)
        want = per_expert
    problems = ([f"missing {k}" for k in want if k not in have] + [f"unexpected {k}" for k in have if k not in want]
                + [f"{k} is {have[k]}, the config needs {want[k]}" for k in want if k in have and have[k] != want[k]])
    if problems:
        more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ValueError(f"{path}: the weights do not fit the config: {'; '.join(problems[:3])}{more}")


def model_from_checkpoint(ckpt, device="cpu", dtype=torch.float32):
    """MiniMindForCausalLM of a checkpoint's config with its weights (loaded strictly), built with the engines
    the trainer builds for `device` under autocast `dtype` (train/engines.py: engines_for): every tool runs
    what trained. The tools pass fp32 on CPU (scripts/generate.py: load_model says why)."""
    from train.engines import engines_for
    from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
    config = MiniMindConfig.from_dict(ckpt["config"])
    model = MiniMindForCausalLM(config, engines_for(config, device, dtype))
    model.load_state_dict(ckpt["model"], strict=True)
    return model.to(device)


def one_line(e, limit=200):
    """An exception's message on one line, at most `limit` characters."""
    return " ".join(line.strip() for line in str(e).splitlines() if line.strip())[:limit]


# ----------------------------------------------------------------------------- sharded checkpoints (DCP)

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
    """Write the sharded checkpoint of a run (every rank calls it): `model_state` and `optimizer_state` by
    DCP into a temp folder, each rank hashing its share of the files, rank 0 adding state.pt (`extra`, the
    config, the hashes) and publishing it (`_publish`). A crash before the publish leaves the previous
    checkpoint in place (the temp folder is swept by the next save or run). (`publish_sharded`:
    train/run_dir.py)"""
    folder = [tempfile.mkdtemp(dir=out_dir, prefix=f".{SHARDED_NAME}.tmp") if ctx.is_main else None]
    dist.broadcast_object_list(folder, src=0, group=ctx.cpu_group)
    folder = folder[0]
    try:
        dcp.save({"model": model_state(model), "optimizer": optimizer_state(model, optimizer)}, checkpoint_id=folder)
    except dcp.CheckpointException as e:
        raise _write_failed(e, out_dir, folder, extra.get("step", 0), ctx) from None
    names = sorted(os.listdir(folder))  # (DCP returns after its metadata is written: every rank sees all files)
    mine = {n: _file_sha256(os.path.join(folder, n)) for n in names[ctx.rank::ctx.world_size]}
    files = {n: h for part in _gather_from_ranks(mine, ctx.rank, ctx.world_size, ctx.cpu_group)
             for n, h in part.items()}
    if not ctx.is_main:
        return
    state = {**extra, "config": model.config.to_dict(), "files": files}
    state[CHECKSUM_KEY] = checksum(state)
    atomic_torch_save(state, os.path.join(folder, SHARDED_STATE))
    publish_sharded(folder, out_dir, extra.get("step", 0))


def _write_failed(e, out_dir, folder, step, ctx):
    """What a failed DCP save (its CheckpointException, the same on every rank: each failed rank's exception)
    raises instead where every failure is an OSError (a full disk, no permission, an I/O error): on rank 0 an
    OSError of one line naming out_dir, the step and the first failed rank's cause, the temp folder removed
    (the previous checkpoint stays the run's); on the other ranks PeerFailed (rank 0 reports it). Else `e`."""
    causes = {rank: exc for rank, (exc, _) in sorted(e.failures.items())}
    if not all(isinstance(exc, OSError) for exc in causes.values()):
        return e
    if not ctx.is_main:
        return PeerFailed(f"the checkpoint of step {step} could not be written (rank 0 reports why)")
    shutil.rmtree(folder, ignore_errors=True)
    rank, cause = next(iter(causes.items()))
    return OSError(f"{out_dir}: the checkpoint of step {step} could not be written (rank {rank}: "
                   f"{cause.strerror or one_line(cause)}); the last checkpoint there is untouched")


def read_sharded_state(folder):
    """A sharded checkpoint's state.pt (no tensors read), verified. Raises ValueError naming the file."""
    path = os.path.join(folder, SHARDED_STATE)
    if not os.path.exists(path):
        raise ValueError(f"{path}: missing (the sharded checkpoint is incomplete); use another checkpoint")
    state = _torch_load(path)
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
    refuse_legacy(saved, folder)
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


def _dcp_load(state, folder, distributed):
    """dcp.load in place; in one process without its warning that it assumes one process."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=folder, no_dist=not distributed)
