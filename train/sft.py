"""Supervised fine-tuning: turn the pretrained MoE into a model that answers, on the shared loop.

    .venv/bin/python train/sft.py                                  # after train/pretrain.py: embedded stdlib Q&A set
    .venv/bin/python train/sft.py --data_path my_chats.jsonl       # {"conversations": [...]} or {"messages": [...]}
    .venv/bin/python train/sft.py --init_from exports/minimind-moe # start from an exported HF folder instead
    .venv/bin/python scripts/chat.py --ckpt checkpoints/sft        # talk to the result

Starts from `--init_from` (default: the main job's checkpoints/pretrain), writes to --out_dir like
pretraining: ckpt.pt, config.json, tokenizer/ (with the chat template), metrics.jsonl, loss.png,
expert_load.png. The loss is the mean over the assistant tokens of the global batch (data/chat.py);
conversations are packed into --seq_len windows where each attends only to itself. The step-0 evaluation
is the base model's loss on the held-out conversations.
"""
import hashlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from data.corpus import CACHE_DIR  # noqa: E402  (these data modules import no torch)
from data.sft_corpus import default_sft_set  # noqa: E402
from data.sources import DataError  # noqa: E402
from train import flags  # noqa: E402
from train.stage import Stage, StageData  # noqa: E402

SAMPLE_QUESTION = "What does `os.path.join` do?"


def add_data_flags(g):
    flags.add(g, "--data_path", default=None, help="conversations (.jsonl); None: the embedded stdlib Q&A set")
    flags.add(g, "--val_path", default=None, help="held-out conversations (.jsonl); None: with --data_path, every "
              "20th conversation of it; without, the embedded set's held-out functions")
    flags.add(g, "--tokenizer", default=None, help="tokenizer dir; None: the one next to the --init_from weights")


def chat_tokenizer(tokenizer_dir, log):
    """(tokenizer, folder it loads from): with our ChatML template (and {% generation %} mask) when its own lacks
    one, saved under CACHE_DIR so the run folder gets the template too. Raises DataError without <|im_end|>."""
    from data.chat import has_generation_block  # (torch and transformers: imported once the flags are parsed)
    from data.tokenizer import CHAT_TEMPLATE, load_tokenizer, save_tokenizer
    tok = load_tokenizer(tokenizer_dir)
    if has_generation_block(tok.chat_template):
        return tok, tokenizer_dir
    if tok.convert_tokens_to_ids("<|im_end|>") in (None, tok.unk_token_id):
        raise DataError(f"{tokenizer_dir}: the tokenizer has no <|im_end|> token and no chat template with a "
                        f"{{% generation %}} block, so the assistant turns cannot be found")
    tok.chat_template = CHAT_TEMPLATE
    key = hashlib.sha1(tok.backend_tokenizer.to_str().encode()).hexdigest()[:12]
    folder = os.path.join(CACHE_DIR, f"chat-tokenizer-{key}")
    if not os.path.exists(os.path.join(folder, "tokenizer.json")):
        save_tokenizer(tok, folder)
    log(f"tokenizer: using the ChatML template with an assistant mask ({folder})")
    return load_tokenizer(folder), folder


def held_out_split(conv, path, log, every=20):
    """--data_path without --val_path: (train, val) with every `every`-th conversation of the file held out, except
    copies of a training conversation, which stay in training (a held-out score on seen text means nothing)."""
    n = len(conv)
    if n < every:
        raise DataError(f"{path}: {n} conversations are too few to hold every {every}th out for evaluation; "
                        f"pass --val_path")
    key = lambda i: conv[i][0].tobytes()  # noqa: E731
    train = [i for i in range(n) if i % every != every - 1]
    seen = {key(i) for i in train}
    held = [i for i in range(every - 1, n, every) if key(i) not in seen]
    if len(held) < n // every:
        log(f"note: {n // every - len(held)} of the {n // every} held-out conversations of {path} also appear "
            f"among its training conversations: kept in training only")
        train = sorted(set(range(n)) - set(held))
    if not held:
        raise DataError(f"{path}: every held-out conversation is a copy of a training one; pass --val_path")
    return conv.select(train), conv.select(held)


def load_data(args, tokenizer_dir, global_batch_size, log):
    """Conversations -> packed assistant-masked windows: training (reshuffled per epoch), evaluation (file order)."""
    import numpy as np

    from data.chat import PackedBatches, load_conversations, pack, window_tensors
    if tokenizer_dir is None:
        raise DataError("no tokenizer: fine-tuning starts from trained weights (--init_from) or takes --tokenizer")
    tokenizer, tokenizer_dir = chat_tokenizer(tokenizer_dir, log)
    paths = default_sft_set() if args.data_path is None else {"train": args.data_path, "val": args.val_path}
    train = load_conversations(paths["train"], tokenizer, args.seq_len, CACHE_DIR, log)
    if args.data_path is not None and args.val_path is None:
        train, val = held_out_split(train, args.data_path, log)
    else:
        val = load_conversations(args.val_path or paths["val"], tokenizer, args.seq_len, CACHE_DIR, log)
    log(f"data: {args.data_path or 'embedded stdlib Q&A set'}: {len(train):,} train / {len(val):,} held-out "
        f"conversations, {train.supervised_tokens:,} / {val.supervised_tokens:,} assistant tokens")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    windows = pack(np.diff(val.offsets), range(len(val)), args.seq_len)
    x, y, seg = window_tensors(val, windows, args.seq_len, pad)
    val_batches = list(zip(x.split(args.batch_size), y.split(args.batch_size), seg.split(args.batch_size)))
    return StageData(tokenizer=tokenizer, tokenizer_dir=tokenizer_dir,
                     train_batches=PackedBatches(train, args.seq_len, global_batch_size, pad, seed=args.seed),
                     val_batches=val_batches,
                     identity={"train_conversations": len(train), "train_sha1": train.sha1[:16]})


STAGE = Stage(name="sft", description=__doc__, default_out_dir="checkpoints/sft", add_data_flags=add_data_flags,
                   load_data=load_data, data_order_flags=("data_path", "val_path"),
                   sample_prompt=f"<|im_start|>user\n{SAMPLE_QUESTION}<|im_end|>\n<|im_start|>assistant\n",
                   defaults=dict(init_from="checkpoints/pretrain", max_steps=300, learning_rate=1e-3, warmup_steps=20,
                                 batch_size=8, seq_len=256, eval_interval=100, save_interval=100, log_interval=10,
                                 sample_tokens=64))


def parse_args(argv=None):
    return flags.parse_args(STAGE, argv)


def train(args, log=print):
    from train import loop
    return loop.train(args, STAGE, log=log)


if __name__ == "__main__":
    args = parse_args()  # (before the loop's imports: --help and a mistyped flag answer without torch)
    from train import loop
    loop.run_cli(STAGE, args)
