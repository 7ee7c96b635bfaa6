"""Import an exported (or any Qwen3 / Qwen3-MoE) HuggingFace folder back into a MiniMind checkpoint.

    python scripts/import_hf.py --hf exports/minimind-moe --out checkpoints/imported
    python train/pretrain.py --init_from checkpoints/imported --out_dir checkpoints/finetune ...

The output run directory holds ckpt.pt (fp32 weights, config; step 0, no optimizer state), config.json
and tokenizer/, so generate.py, export_hf.py and `pretrain.py --init_from` accept it.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from model.hf_adapter import ExportError, load_hf_folder  # noqa: E402
from train.atomic import atomic_dir, atomic_write_text  # noqa: E402
from train.checkpoint import CKPT_NAME, save_checkpoint  # noqa: E402


def import_hf(hf_dir, out_dir, log=print):
    from transformers import AutoTokenizer
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise ValueError(f"{out_dir}: exists and is not empty; choose a new --out (a run is never overwritten)")
    model = load_hf_folder(hf_dir)
    os.makedirs(out_dir, exist_ok=True)
    save_checkpoint(os.path.join(out_dir, CKPT_NAME), model, None, 0, None, {"imported_from": os.path.abspath(hf_dir)})
    atomic_write_text(os.path.join(out_dir, "config.json"), model.config.to_json_string())
    if os.path.exists(os.path.join(hf_dir, "tokenizer.json")) or os.path.exists(os.path.join(hf_dir, "tokenizer_config.json")):
        with atomic_dir(os.path.join(out_dir, "tokenizer")) as tmp:
            AutoTokenizer.from_pretrained(hf_dir).save_pretrained(tmp)
    else:
        log(f"warning: {hf_dir} has no tokenizer; pass --tokenizer when training or sampling from {out_dir}")
    log(f"imported {hf_dir} -> {out_dir}")
    return model


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf", required=True, help="HF folder (config.json + *.safetensors)")
    p.add_argument("--out", required=True, help="run directory to write")
    args = p.parse_args(argv)
    try:
        import_hf(args.hf, args.out)
    except (ExportError, FileNotFoundError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
