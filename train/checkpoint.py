"""Checkpoints: fp32 weights, optimizer, step, data position, RNG state, config and args in one file,
written atomically (temp file in the same directory, fsync, `os.replace`), loaded strictly."""
import os

import torch

from train.atomic import atomic_file

CKPT_NAME = "ckpt.pt"


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


def save_checkpoint(path, model, optimizer, step, data_state, args, extra=None):
    model = unwrap(model)
    state = {
        "model": {k: v.detach().float().cpu() if v.is_floating_point() else v.cpu()
                  for k, v in model.state_dict().items()},
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "step": step,
        "data": data_state,
        "rng": {"torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
        "config": model.config.to_dict(),
        "args": dict(args),
    }
    state.update(extra or {})
    atomic_torch_save(state, path)


def load_checkpoint(path):
    """Load a checkpoint dict (tensors on CPU). Raises FileNotFoundError / ValueError with the path."""
    if os.path.isdir(path):
        path = os.path.join(path, CKPT_NAME)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: checkpoint not found")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated or foreign file
        raise ValueError(f"{path}: not a readable checkpoint ({type(e).__name__}: {e})") from None
    missing = {"model", "config"} - set(ckpt)
    if missing:
        raise ValueError(f"{path}: checkpoint lacks {sorted(missing)}")
    return ckpt


def model_from_checkpoint(ckpt, device="cpu"):
    """Build MiniMindForCausalLM from a checkpoint's config and load its weights strictly."""
    from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
    config = MiniMindConfig.from_dict(ckpt["config"])
    model = MiniMindForCausalLM(config)
    model.load_state_dict(ckpt["model"], strict=True)
    return model.to(device)
