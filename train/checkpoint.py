"""Checkpoints and weight files: fp32 weights, optimizer, step, data position, RNG state, config and flags in
one file, written atomically (data/atomic.py), loaded strictly; HF folders (config.json + safetensors) read
into the same model. Each checkpoint carries a SHA-256 of everything else in it (`checksum`: weights, optimizer,
config, flags, step, plan, data position, RNG), verified on every load, so a flipped bit anywhere is reported,
never loaded (torch.load only notices a damaged container); HF exports carry the SHA-256 of their tensors in
model.safetensors' metadata (`safetensors_metadata`, checked by `load_safetensors`).

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

from data.atomic import atomic_file, atomic_link, usual_modes
from model.moe import stacked_names
from train import legacy_checkpoint

CKPT_NAME = "ckpt.pt"
SHARDED_NAME, SHARDED_STATE = "ckpt", "state.pt"  # the sharded checkpoint (a link to its folder), its state file
PER_EXPERT_KEY = re.compile(r"\.experts\.\d+\.")  # a checkpoint from before the stacked names
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


def model_state(model):
    """The model's state_dict by its parameters' names, the experts' stacked (`stacked_names`), from
    torch.distributed.checkpoint's helper: DTensors where the ranks hold parts (FSDP, EP)."""
    with stacked_names():
        return get_model_state_dict(unwrap(model))


def optimizer_state(model, optimizer):
    """The optimizer's state_dict keyed by parameter names (as `model_state`), from the same helper."""
    with stacked_names():
        return get_optimizer_state_dict(unwrap(model), optimizer)


def save_checkpoint(path, model, optimizer=None, extra=None):
    """Write {"model": fp32 CPU `model_state`, "optimizer": `optimizer_state`, "config", **extra, "sha256"}
    atomically, in one process (train/loop.py's extra: TrainState, the flags as "args", the data identity,
    the world size)."""
    model = unwrap(model)
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
    it holds (DCP reshards), a ckpt.pt set from rank 0's whole state (broadcast, each rank keeping its part).
    Checkpoints from before the stacked expert names are converted (train/legacy_checkpoint.py)."""
    model, whole = unwrap(model), StateDictOptions(full_state_dict=True, broadcast_from_rank0=ctx.distributed)
    if "folder" in ckpt:
        verify_shards(ckpt["folder"], ckpt["files"], ctx.rank, ctx.world_size, ctx.cpu_group)
    if is_legacy(ckpt):
        state, options = legacy_checkpoint.converted(ckpt, model, optimizer), whole
    elif "folder" in ckpt:
        state, options = {"model": model_state(model), "optimizer": optimizer_state(model, optimizer)}, None
        _dcp_load(state, ckpt["folder"], ctx.distributed)
    else:
        state, options = ckpt, whole
    with stacked_names():
        set_model_state_dict(model, state["model"], options=options)
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)


def is_legacy(ckpt):
    """Whether a checkpoint (`load_checkpoint`'s dict) predates the stacked expert names: its experts saved
    one tensor per expert and projection, its optimizer state listed by position."""
    keys = _saved_tensors(ckpt["folder"]) if "folder" in ckpt else ckpt["model"]
    return any(PER_EXPERT_KEY.search(key) for key in keys)


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
        model = MiniMindForCausalLM(config)
        with stacked_names():
            want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        per_expert = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    have = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in ckpt["model"].items()}
    if set(have) & (set(per_expert) - set(want)):  # (a checkpoint from before the stacked names)
        want = per_expert
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
    config, the hashes) and publishing it (`_publish`). A crash before the publish leaves the
    previous checkpoint in place (the temp folder is swept by the next save or run)."""
    folder = [tempfile.mkdtemp(dir=out_dir, prefix=f".{SHARDED_NAME}.tmp") if ctx.is_main else None]
    dist.broadcast_object_list(folder, src=0, group=ctx.cpu_group)
    folder = folder[0]
    dcp.save({"model": model_state(model), "optimizer": optimizer_state(model, optimizer)}, checkpoint_id=folder)
    names = sorted(os.listdir(folder))  # (DCP returns after its metadata is written: every rank sees all files)
    mine = {n: _file_sha256(os.path.join(folder, n)) for n in names[ctx.rank::ctx.world_size]}
    files = {n: h for part in _gather_from_ranks(mine, ctx.rank, ctx.world_size, ctx.cpu_group) for n, h in part.items()}
    if not ctx.is_main:
        return
    state = {**extra, "config": unwrap(model).config.to_dict(), "files": files}
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


def _dcp_load(state, folder, distributed):
    """dcp.load in place; in one process without its warning that it assumes one process."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=folder, no_dist=not distributed)
