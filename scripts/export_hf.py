"""Export a checkpoint to a HuggingFace folder that `transformers` loads with no custom code.

    python scripts/export_hf.py --ckpt checkpoints/pretrain --out exports/minimind-moe [--dtype bfloat16]

MoE checkpoints become `Qwen3MoeForCausalLM` (model_type qwen3_moe), dense ones `Qwen3ForCausalLM`.
The folder gets config.json, model.safetensors, the tokenizer (with its chat template) and
generation_config.json. Before the folder is put in place, it is loaded back with
`AutoModelForCausalLM.from_pretrained` and its logits are compared with ours on random tokens
(max abs diff <= 1e-4 in float32; bf16/fp16 exports are compared against our model rounded the same
way); a mismatch aborts the export. Checkpoints with features the target cannot represent are refused.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from model.hf_adapter import ExportError, to_hf_config, to_hf_state_dict  # noqa: E402
from data.atomic import atomic_dir  # noqa: E402
from train.checkpoint import load_checkpoint, model_from_checkpoint  # noqa: E402
from train.hf_folder import safetensors_metadata  # noqa: E402
from train.run_dir import run_tokenizer  # noqa: E402
from train.flags import Parser, run_tool  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FP32_TOL = 1e-4  # fp32 reassociation in attention/softmax between two implementations stays far below this


def compare_logits(ours, hf_dir, dtype, n_tokens=48, seed=0):
    """Max abs logit difference between our model and the exported folder on random tokens, both in fp32
    whatever dtype the run trained in (the export's weights rounded to `dtype` on our side too): an fp32
    forward on each side is the one that can agree to 1e-4, whatever engines autocast would pick."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ours = ours.float().eval()
    if dtype != torch.float32:  # compare against our weights rounded like the export
        ours = model_from_checkpoint({"config": ours.config.to_dict(),
                                      "model": {k: v.to(dtype).float() for k, v in ours.state_dict().items()}}).eval()
    g = torch.Generator().manual_seed(seed)
    n_tokens = min(n_tokens, ours.config.max_position_embeddings)  # a model may support fewer positions
    ids = torch.randint(0, ours.config.vocab_size, (2, n_tokens), generator=g)
    with torch.no_grad():
        return (ours(ids).logits - hf(ids).logits).abs().max().item()


def check_out(out_dir, force, marker="model.safetensors", own=None):
    """Raise ExportError unless out_dir can take an export: new, empty, or with `force` an earlier one (it
    holds `marker`, no checkpoint, and with `own` nothing but those names: what is not ours is never
    deleted)."""
    if not out_dir.strip():
        raise ExportError("--out is empty; name a folder")
    parent = os.path.dirname(os.path.abspath(out_dir))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ExportError(f"{out_dir}: {parent} is a file, not a folder; choose another --out")
    if os.path.exists(out_dir):
        names = set(os.listdir(out_dir)) if os.path.isdir(out_dir) else {"(a file)"}
        if (names and marker not in names) or "ckpt.pt" in names:
            raise ExportError(f"{out_dir}: exists and is not an earlier export; choose an empty or new --out")
        if names and own is not None and names - own:
            raise ExportError(f"{out_dir}: an earlier export that now also holds {sorted(names - own)}: move them, "
                              f"or choose another --out")
        if names and not force:
            raise ExportError(f"{out_dir}: an export is already there; pass --force to replace it")


def export(ckpt_path, out_dir, dtype="float32", tokenizer_dir=None, verify=True, log=print, force=False):
    """Write the HF folder at out_dir. An existing out_dir must be empty or an earlier export (replaced
    atomically only with force=True); anything else is refused, never deleted. Returns the max logit diff."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    check_out(out_dir, force)
    ckpt = load_checkpoint(ckpt_path)
    model = model_from_checkpoint(ckpt)
    hf_config = to_hf_config(model.config)
    hf_config.dtype = dtype
    tdtype = DTYPES[dtype]
    state = {k: v.detach().to(tdtype, copy=True) for k, v in to_hf_state_dict(model.state_dict(), model.config).items()}
    tokenizer, _ = run_tokenizer(ckpt_path, tokenizer_dir)

    with atomic_dir(out_dir) as tmp:  # verified before it replaces anything
        hf_config.save_pretrained(tmp)
        save_file(state, os.path.join(tmp, "model.safetensors"), metadata=safetensors_metadata(state))
        tokenizer.save_pretrained(tmp)
        eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")]
        GenerationConfig(eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, do_sample=True, temperature=0.8,
                         top_k=40, top_p=0.95).save_pretrained(tmp)
        diff = None
        if verify:
            diff = compare_logits(model, tmp, tdtype)
            tol = FP32_TOL if tdtype == torch.float32 else 5e-2
            if not diff <= tol:
                raise ExportError(f"exported model disagrees with ours: max |logit diff| {diff:.3e} > {tol}")
            log(f"parity: max |logit diff| ours vs transformers = {diff:.2e} (tolerance {tol})")
    log(f"exported {hf_config.model_type} ({dtype}) to {out_dir}")
    return diff


def main(argv=None):
    p = Parser(description=__doc__)
    p.add_argument("--ckpt", required=True, help="checkpoint file or run directory")
    p.add_argument("--out", required=True, help="output folder (new or empty; an earlier export with --force)")
    p.add_argument("--dtype", default="float32", choices=tuple(DTYPES), help="dtype of the saved weights")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir (default: tokenizer/ next to the checkpoint)")
    p.add_argument("--no_verify", action="store_true", help="skip the load-back logit comparison")
    p.add_argument("--force", action="store_true", help="replace an earlier export at --out")
    args = p.parse_args(argv)
    export(args.ckpt, args.out, args.dtype, args.tokenizer, verify=not args.no_verify, force=args.force)


if __name__ == "__main__":
    run_tool(main)
