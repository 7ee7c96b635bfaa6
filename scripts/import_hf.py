"""Import an exported (or any Qwen3 / Qwen3-MoE) HuggingFace folder back into a MiniMind checkpoint.

    python scripts/import_hf.py --hf exports/minimind-moe --out checkpoints/imported
    python train/pretrain.py --init_from checkpoints/imported --out_dir checkpoints/finetune ...

The output run directory holds ckpt.pt (fp32 weights, config; step 0, no optimizer state), config.json
and tokenizer/, so generate.py, export_hf.py and `pretrain.py --init_from` accept it. It is written as a
whole (a temp folder renamed into place): a failed or killed import leaves no --out folder behind.

The folder is checked before anything is written (train/hf_folder.py: load_hf_checked): config.json must
be JSON describing a Qwen3(-MoE) model MiniMind can express, every *.safetensors file must be readable and
hold exactly the tensors that config needs, with their shapes. A model.safetensors written by
scripts/export_hf.py carries a SHA-256 of its tensors in its metadata, and a flipped bit is refused; a
folder made elsewhere has no such entry and its tensors are loaded unchecked. Any problem: one line
naming the file, exit code 2.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from data.atomic import atomic_dir, atomic_write_text  # noqa: E402
from train.checkpoint import save_checkpoint  # noqa: E402
from train.hf_folder import load_hf_checked  # noqa: E402
from train.flags import Parser, run_tool  # noqa: E402
from train.run_dir import CKPT_NAME  # noqa: E402


def import_hf(hf_dir, out_dir, log=print):
    from transformers import AutoTokenizer
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise ValueError(f"{out_dir}: exists and is not an empty folder; choose a new --out (a run is never "
                         f"overwritten)")
    model = load_hf_checked(hf_dir)
    has_tokenizer = any(os.path.exists(os.path.join(hf_dir, n)) for n in ("tokenizer.json", "tokenizer_config.json"))
    with atomic_dir(out_dir) as tmp:
        save_checkpoint(os.path.join(tmp, CKPT_NAME), model, extra={"imported_from": os.path.abspath(hf_dir)})
        atomic_write_text(os.path.join(tmp, "config.json"), model.config.to_json_string())
        if has_tokenizer:
            try:
                tokenizer = AutoTokenizer.from_pretrained(hf_dir)
            except Exception as e:  # tokenizers' own errors (a damaged tokenizer.json) are not ValueErrors
                first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")[:200]
                raise ValueError(f"{hf_dir}: tokenizer not readable ({type(e).__name__}: {first})") from None
            tokenizer.save_pretrained(os.path.join(tmp, "tokenizer"))
    if not has_tokenizer:
        log(f"warning: {hf_dir} has no tokenizer; pass --tokenizer when training or sampling from {out_dir}")
    log(f"imported {hf_dir} -> {out_dir}")
    return model


def main(argv=None):
    p = Parser(description=__doc__)
    p.add_argument("--hf", required=True, help="HF folder (config.json + *.safetensors)")
    p.add_argument("--out", required=True, help="run directory to write (must not exist, or be empty)")
    args = p.parse_args(argv)
    import_hf(args.hf, args.out)


if __name__ == "__main__":
    run_tool(main)
