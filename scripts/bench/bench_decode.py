"""Decoding speed, side by side: our generate vs transformers' on our export of the same weights.

    python scripts/bench/bench_decode.py                               # checkpoints/pretrain, batch 1, 8, 64
    python scripts/bench/bench_decode.py --ckpt RUN_DIR --batches 1 --new_tokens 32 --json decode.jsonl

Rows: `ours` (MiniMindForCausalLM.generate on the model the tools load: train.checkpoint.model_from_checkpoint,
fp32 on CPU as scripts/generate.py runs it, bf16 on CUDA), `hf` (transformers' generate on
scripts/export_hf.py's export of the same checkpoint, fp32) and, at batch 1 where llama-cpp-python is installed
(--llama_python), `llama` (llama.cpp on scripts/export_gguf.py's fp32 GGUF, an fp32 KV cache, the same threads).
Greedy, random prompts of --prompt_len tokens, no end-of-text stop, --new_tokens tokens each; every row's tokens
are asserted equal to ours. Per row and batch:
  tokens/s  batch x new tokens / the median time of the whole generate
  TTFT      the median time of a generate of one new token (prefill and the first step), ms
  TPOT      (whole generate - TTFT) / (new tokens - 1): one decode step, ms
  MBU       the bytes a decode step must read / TPOT / the copy bandwidth measured in the same run (a 256 MiB
            tensor copy, bytes read + written; on CUDA the same copy on the device): the non-expert weights
            (the tied embedding once, as the LM head), the experts the step's tokens route to (counted per
            layer from the router's choices at every decode step of ours), and the KV cache at its mean length
Each (row, batch) prints a table line and one JSON line (--json appends the JSON lines to a file). Check
`uptime` first: a busy machine's numbers are noise.
"""
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))  # scripts/bench
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), os.path.dirname(HERE)]  # the repository, scripts/

import torch  # noqa: E402

from bench_train import median_seconds  # noqa: E402  (this folder)
from model.moe import MOEFeedForward  # noqa: E402
from train.checkpoint import load_checkpoint, model_from_checkpoint  # noqa: E402


def copy_bandwidth(device, mib=256):
    """Bytes per second of a `mib` MiB tensor copy on `device` (read + written), the median of 5."""
    src = torch.empty(mib << 18, device=device)  # fp32: 4 bytes an element
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * src.numel() * 4 / median_seconds(lambda: dst.copy_(src), 5, device)


def experts_touched(model, ids, new_tokens):
    """Mean count, over ours' decode steps, of the experts that step's tokens route to, summed over layers."""
    counts = []
    hooks = [m.register_forward_hook(lambda mod, args, out: counts.append(int((mod.stats.tokens_per_expert > 0).sum()))
                                     if args[0].shape[1] == 1 else None)
             for m in model.modules() if isinstance(m, MOEFeedForward)]
    try:
        model.generate(ids, max_new_tokens=new_tokens, temperature=0)
    finally:
        for h in hooks:
            h.remove()
    layers = len(hooks)
    return sum(counts) / max(1, len(counts) // max(1, layers)) if counts else 0.0


def step_bytes(model, config, batch, kv_len, touched, element_bytes):
    """Bytes one decode step reads: non-expert weights, `touched` experts (over all layers), the KV cache."""
    dense = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n)
    per_expert = 3 * config.hidden_size * config.moe_intermediate_size if config.use_moe else 0
    kv = 2 * config.num_hidden_layers * batch * config.num_key_value_heads * kv_len * config.head_dim
    return (dense + touched * per_expert + kv) * element_bytes


def hf_export(ckpt_path, out_dir, device):
    """transformers' model of scripts/export_hf.py's export of the checkpoint (fp32, eval, no end-of-text stop)."""
    from transformers import AutoModelForCausalLM
    from export_hf import export
    export(ckpt_path, out_dir, "float32", verify=False, log=lambda *_: None)
    hf = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).to(device).eval()
    hf.generation_config.eos_token_id = None
    return hf


# llama.cpp through llama-cpp-python, run in its venv (LLAMA_PYTHON): a JSON request on stdin {gguf, n_ctx, threads,
# prompt: ids, new_tokens, texts, repeats} -> {ids: each text encoded, logits: [len(prompt), V] of the prompt,
# greedy: new_tokens argmax ids after it, first_s / whole_s: the medians of `repeats` generates of 1 and of
# new_tokens tokens (repeats 0: none)}. An fp32 KV cache (llama.cpp's default is f16), as our decode keeps;
# logits_all: its Python API keeps logits only so (the prompt's rows of LM head more at prefill).
LLAMA_PYTHON = os.path.join(os.path.dirname(os.path.dirname(HERE)), ".venv-llama", "bin", "python")
LLAMA_CPP = r"""
import json, statistics, sys, time
import numpy as np
from llama_cpp import Llama
req = json.load(sys.stdin)
llm = Llama(model_path=req["gguf"], n_ctx=req["n_ctx"], verbose=False, n_threads=req["threads"], type_k=0, type_v=0,
            logits_all=True)
def generate(n):
    llm.reset()
    llm.eval(req["prompt"])
    out = []
    for i in range(n):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        if i + 1 < n:
            llm.eval([out[-1]])
    return out
def median_s(n):
    times = []
    for _ in range(req["repeats"]):
        start = time.perf_counter()
        generate(n)
        times.append(time.perf_counter() - start)
    return statistics.median(times) if times else None
out = {"ids": [llm.tokenize(t.encode("utf-8"), add_bos=False, special=False) for t in req["texts"]],
       "greedy": generate(req["new_tokens"])}
out["logits"] = np.asarray(llm.scores[:len(req["prompt"])], dtype=np.float64).tolist()
out.update(first_s=median_s(1), whole_s=median_s(req["new_tokens"]))
print(json.dumps(out))
"""


def run_llama_cpp(gguf_path, prompt, new_tokens, texts=(), repeats=0, python=LLAMA_PYTHON):
    """llama.cpp on a GGUF file at batch 1 (see LLAMA_CPP), with this process's thread count. Raises RuntimeError
    with the end of its stderr when it fails."""
    import subprocess
    request = {"gguf": gguf_path, "n_ctx": len(prompt) + max(new_tokens, 1), "prompt": prompt,
               "new_tokens": new_tokens, "texts": list(texts), "repeats": repeats, "threads": torch.get_num_threads()}
    r = subprocess.run([python, "-c", LLAMA_CPP], input=json.dumps(request), capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"llama.cpp: {r.stderr.strip()[-3000:]}")
    return json.loads(r.stdout.splitlines()[-1])


def main(argv=None):
    from train.flags import AT_LEAST_1, Parser, add
    p = Parser(description=__doc__)
    p.add_argument("--ckpt", default="checkpoints/pretrain", help="checkpoint file or run directory")
    p.add_argument("--batches", default="1,8,64", help="comma-separated batch sizes")
    add(p, "--prompt_len", allowed=AT_LEAST_1, type=int, default=16)
    add(p, "--new_tokens", allowed=AT_LEAST_1, type=int, default=64)
    add(p, "--repeats", allowed=AT_LEAST_1, type=int, default=3,
        help="timed generates per row and batch (the median is kept)")
    p.add_argument("--rows", default="ours,hf,llama", help="comma-separated, from ours,hf,llama (llama: batch 1, "
                   "where --llama_python exists)")
    p.add_argument("--llama_python", default=LLAMA_PYTHON, help="a python with llama-cpp-python")
    p.add_argument("--device", default="auto")
    p.add_argument("--json", default="", help="also append the JSON lines to this file")
    args = p.parse_args(argv)
    rows = args.rows.split(",")
    if len(set(rows)) != len(rows):
        p.error(f"--rows {args.rows}: a row named twice")
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        batches = []
    if not batches or min(batches) < 1:
        p.error(f"--batches {args.batches}: comma-separated positive integers")
    if not rows or any(r not in ("ours", "hf", "llama") for r in rows):
        p.error(f"--rows {args.rows}: choose from ours,hf,llama")
    if "llama" in rows and not os.path.exists(args.llama_python):
        rows.remove("llama")
        print(f"(no llama row: {args.llama_python} missing; python3 -m venv .venv-llama && "
              f".venv-llama/bin/pip install llama-cpp-python numpy)")
    if args.new_tokens < 2:
        p.error(f"--new_tokens {args.new_tokens}: at least 2 (TPOT is the time after the first)")
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") or (device == "cuda" and not torch.cuda.is_available()):
        p.error(f"--device {args.device}: cpu, or cuda where CUDA is available (auto picks)")
    if args.json:
        try:  # (before the first row is measured)
            open(args.json, "a").close()
        except OSError as e:
            p.error(f"--json {args.json}: {e.strerror}")
    try:
        ckpt = load_checkpoint(args.ckpt)
    except (FileNotFoundError, ValueError) as e:
        p.error(f"{e} (train one first: python train/pretrain.py)")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # as scripts/generate.py: load_model
    ours = model_from_checkpoint(ckpt, device, dtype).eval()
    config = ours.config
    if args.prompt_len + args.new_tokens > config.max_position_embeddings:
        p.error(f"--prompt_len + --new_tokens = {args.prompt_len + args.new_tokens} exceeds the model's "
                f"max_position_embeddings {config.max_position_embeddings}")
    models = {"ours": ours}
    tmp = tempfile.TemporaryDirectory(prefix="bench_decode_")
    if "hf" in rows:
        models["hf"] = hf_export(args.ckpt, os.path.join(tmp.name, "hf"), device)
    if "llama" in rows:
        from export_gguf import export_gguf
        gguf_path = os.path.join(tmp.name, "model.gguf")
        export_gguf(args.ckpt, gguf_path, log=lambda *_: None)
    bandwidth = copy_bandwidth(device)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, "
          f"{str(dtype)[6:]}, threads {torch.get_num_threads()}; {args.ckpt}: {config.num_hidden_layers} layers, "
          f"D={config.hidden_size}, E={config.num_experts if config.use_moe else 0}; prompts {args.prompt_len}, "
          f"{args.new_tokens} new tokens, greedy; copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    print(f"  {'row':<5} {'batch':>5} {'tokens/s':>10} {'TTFT ms':>9} {'TPOT ms':>9} {'MBU':>6}")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad(), torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
        for batch in batches:
            ids = torch.randint(0, config.vocab_size, (batch, args.prompt_len), generator=gen).to(device)
            mask = torch.ones_like(ids)
            runs = {"ours": lambda n: ours.generate(ids, max_new_tokens=n, temperature=0),
                    "hf": lambda n: models["hf"].generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                                                          pad_token_id=0)}
            want = runs["ours"](args.new_tokens)  # (also the warm-up)
            touched = experts_touched(ours, ids, args.new_tokens) if config.use_moe else 0
            read = step_bytes(ours, config, batch, args.prompt_len + args.new_tokens // 2, touched,
                              torch.finfo(dtype).bits // 8)
            for row in rows:
                if row == "llama":
                    if batch > 1:
                        continue
                    try:
                        timed = run_llama_cpp(gguf_path, ids[0].tolist(), args.new_tokens, repeats=args.repeats,
                                              python=args.llama_python)
                    except RuntimeError as e:
                        raise SystemExit(f"llama row: {str(e).splitlines()[-1]}") from None
                    got, first, whole = (torch.tensor([ids[0].tolist() + timed["greedy"]], device=device),
                                         timed["first_s"], timed["whole_s"])
                else:
                    got = runs[row](args.new_tokens)
                if not torch.equal(got, want):
                    raise SystemExit(f"{row}, batch {batch}: greedy tokens differ from ours")
                if row != "llama":
                    first = median_seconds(lambda: runs[row](1), args.repeats, device)
                    whole = median_seconds(lambda: runs[row](args.new_tokens), args.repeats, device)
                tpot = (whole - first) / (args.new_tokens - 1)
                record = {"row": row, "batch": batch, "tokens_per_s": batch * args.new_tokens / whole,
                          "ttft_ms": first * 1e3, "tpot_ms": tpot * 1e3, "mbu": read / tpot / bandwidth,
                          "step_bytes": read, "experts_touched_per_step": touched, "copy_bandwidth": bandwidth}
                print(f"  {row:<5} {batch:>5} {record['tokens_per_s']:>10,.0f} {record['ttft_ms']:>9.2f} "
                      f"{record['tpot_ms']:>9.2f} {100 * record['mbu']:>5.1f}%")
                print(json.dumps(record))
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(record) + "\n")
    tmp.cleanup()


if __name__ == "__main__":
    main()
