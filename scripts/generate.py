"""Sample a continuation from a checkpoint or from an exported HuggingFace folder.

    .venv/bin/python scripts/generate.py --ckpt checkpoints/pretrain --prompt "Return the number of"
    .venv/bin/python scripts/generate.py --ckpt exports/minimind-moe --prompt "Return the number of"

--ckpt takes a checkpoint file, the run directory holding ckpt.pt and tokenizer/, or a folder written by
scripts/export_hf.py (then `transformers` AutoModelForCausalLM.generate samples, so both sides can be
compared from the command line; with --temperature 0 both are greedy and print the same text).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from transformers import TextStreamer  # noqa: E402

from data.dataset import DataError  # noqa: E402
from data.tokenizer import load_tokenizer, stop_token_ids  # noqa: E402
from model.hf_adapter import is_hf_folder  # noqa: E402
from train.checkpoint import load_checkpoint, model_from_checkpoint  # noqa: E402
from train.hf_folder import load_hf_checked  # noqa: E402
from train.run_dir import run_tokenizer  # noqa: E402
from train.flags import Parser, Range, add, run_tool, utf8_text  # noqa: E402



def generate_hf(args, model, ids, streamer):
    """Sample with transformers' own generate from an exported folder; returns the ids [num_samples, T]."""
    from transformers import GenerationConfig
    gen = GenerationConfig.from_pretrained(args.ckpt)
    greedy = args.temperature <= 0
    gen.update(max_new_tokens=args.max_new_tokens, do_sample=not greedy, use_cache=not args.no_cache,
               top_k=None if greedy else (args.top_k or None), top_p=None if greedy else args.top_p,
               temperature=None if greedy else args.temperature)
    torch.manual_seed(args.seed)
    return model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen, streamer=streamer)


def main(argv=None):
    p = Parser(description=__doc__)
    p.add_argument("--ckpt", default="checkpoints/pretrain", help="checkpoint file or run directory")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir (None: tokenizer/ next to the checkpoint)")
    p.add_argument("--prompt", default="The", type=utf8_text, help="text to continue")
    add(p, "--max_new_tokens", allowed=Range(1), type=int, default=100, help="tokens to generate")
    add(p, "--temperature", allowed=Range(0), type=float, default=0.8, help="0 = greedy")
    add(p, "--top_k", allowed=Range(0), type=int, default=40, help="keep the k most likely tokens (0 = off)")
    add(p, "--top_p", allowed=Range(0, 1, lo_open=True), type=float, default=0.95,
        help="nucleus sampling mass (1.0 = off)")
    add(p, "--num_samples", allowed=Range(1), type=int, default=1,
        help="independent samples (one is printed as it comes)")
    add(p, "--seed", allowed=Range(0, 2**32 - 1), type=int, default=0, help="sampling seed")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--no_cache", action="store_true", help="recompute the prefix each step (no KV cache)")
    args = p.parse_args(argv)

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda requested but CUDA is not available")
    if not args.prompt:
        p.error("--prompt is empty")
    model, tokenizer = load_model(p, args, device)
    hf = None
    if model is None:  # an exported folder
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(args.ckpt).to(device).eval()
    ids = tokenizer(args.prompt, add_special_tokens=False)["input_ids"]
    if not ids:
        p.error("--prompt is empty after tokenization")
    context = (model if model is not None else hf).config.max_position_embeddings
    if len(ids) >= context:
        p.error(f"--prompt is {len(ids)} tokens; the model's context holds {context} (prompt and continuation)")
    x = torch.tensor([ids] * args.num_samples, device=device)
    # one sample streams to stdout (so Ctrl-C keeps what was printed); several are printed at the end
    streamer = TextStreamer(tokenizer, skip_special_tokens=True) if args.num_samples == 1 else None
    if hf is not None:
        out = generate_hf(args, hf, x, streamer)
    else:
        g = torch.Generator(device=device).manual_seed(args.seed)
        cuda = device.startswith("cuda")
        with torch.autocast("cuda" if cuda else "cpu", dtype=torch.bfloat16, enabled=cuda):
            out = model.generate(x, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                 top_k=args.top_k, top_p=args.top_p, eos_token_id=stop_token_ids(tokenizer),
                                 use_cache=not args.no_cache, generator=g, streamer=streamer)
    if streamer is None:
        print_samples(tokenizer, out)


def load_model(p, args, device):
    """(model in eval mode, tokenizer) for --ckpt (a checkpoint file or run dir, with --tokenizer or the
    run's tokenizer/), or (None, tokenizer) for an exported HF folder (checked, then left to transformers).
    On CPU the model runs in fp32 whatever dtype the run trained in: decoding multiplies a few rows by each
    weight, so its time is reading the weights, and bf16 autocast would first cast every fp32 weight at every
    token (more bytes than fp32 reads); fp32 also keeps greedy outputs those of the fp32 export in transformers.
    On CUDA bf16 autocast, the trainer's. Problems end the program through the parser: one `error:` line, exit
    code 2."""
    if is_hf_folder(args.ckpt):
        try:
            load_hf_checked(args.ckpt)  # transformers alone loads damaged folders (a missing tensor: random init)
            return None, load_tokenizer(args.ckpt)
        except (DataError, FileNotFoundError, ValueError) as e:
            p.error(str(e))
    try:
        ckpt = load_checkpoint(args.ckpt)
    except (FileNotFoundError, ValueError) as e:
        p.error(str(e))
    try:
        tokenizer, tok_dir = run_tokenizer(args.ckpt, args.tokenizer)
    except (DataError, FileNotFoundError) as e:
        p.error(str(e))
    if len(tokenizer) > ckpt["config"]["vocab_size"]:
        p.error(f"{tok_dir}: tokenizer has {len(tokenizer)} tokens, the model only {ckpt['config']['vocab_size']}")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32  # (main's autocast)
    return model_from_checkpoint(ckpt, device, dtype).eval(), tokenizer


def print_samples(tokenizer, out):
    for i, row in enumerate(out.tolist()):
        print(f"--- sample {i}")
        print(tokenizer.decode(row, skip_special_tokens=True))


if __name__ == "__main__":
    run_tool(main)
