"""HuggingFace folders (config.json + *.safetensors, Qwen3 / Qwen3-MoE: model/hf_adapter.py) read into a
MiniMindForCausalLM with every problem one line naming the file, and the SHA-256 of an export's tensors in
model.safetensors' metadata (`safetensors_metadata`, written by scripts/export_hf.py, checked by
`load_safetensors`).
"""
import glob
import json
import os

from train.checkpoint import check_weights_fit_config, checksum, model_from_checkpoint, one_line

HF_CHECKSUM_KEY = "minimind_tensors_sha256"  # safetensors metadata entry written by export_hf.py


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
        raise ValueError(f"{path}: not a readable safetensors file ({one_line(e)})") from None
    if HF_CHECKSUM_KEY in meta and checksum({"tensors": state}) != meta[HF_CHECKSUM_KEY]:
        raise ValueError(f"{path}: checksum mismatch: the file is damaged (its tensors changed after it was "
                         f"exported); export it again")
    return state


def load_hf_checked(hf_dir):
    """MiniMindForCausalLM (fp32) from a Qwen3 / Qwen3-MoE HF folder (config.json + *.safetensors), strictly. Every
    problem (bad or inexpressible config, unreadable weights, checksum mismatch, a missing / extra / misshapen
    tensor) is a one-line ValueError naming the file; FileNotFoundError without config.json or weights."""
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
        raise ValueError(f"{cfg_path}: invalid model config ({type(e).__name__}: {one_line(e)})") from None
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
    ckpt = {"config": config.to_dict(), "model": {k: v.float() for k, v in state.items()}}
    check_weights_fit_config(ckpt, where)
    return model_from_checkpoint(ckpt)
