"""Pretrain a MiniMind-style MoE GPT (the main job).

    .venv/bin/python train/pretrain.py                       # embedded corpus, small MoE, minutes on a CPU
    .venv/bin/python train/pretrain.py --data_path my.jsonl  # {"text": ...} per line; also .txt, .parquet, dirs, globs
    .venv/bin/python train/pretrain.py --resume              # continue checkpoints/pretrain/ckpt.pt exactly
    .venv/bin/torchrun --nproc_per_node 4 train/pretrain.py --ep_size 2 --out_dir checkpoints/ddp   # DDP x EP

Writes to --out_dir: ckpt.pt (fp32 weights, optimizer, train state, config, flags), config.json,
tokenizer/, metrics.jsonl, loss.png, expert_load.png, .lock (held while a run uses the folder).
This file is the stage: its data flags and its data (every token is supervised). The loop is train/loop.py.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from model.config import MiniMindConfig, Range  # noqa: E402
from train import flags  # noqa: E402
from train.stage import Stage, StageData  # noqa: E402


def add_data_flags(g):
    flags.add(g, "--data_path", default=None,
              help="training text: a .jsonl / .json / .txt / .parquet file, a directory or a quoted glob of them, a "
              "datasets.save_to_disk folder, or hf:NAME (datasets.load_dataset); every 20th document is held out. "
              "None: the embedded Python-stdlib docstring corpus")
    flags.add(g, "--text_field", default="text", help="the text field of jsonl / parquet / datasets records")
    flags.add(g, "--tokenizer", default=None, help="existing tokenizer dir; None: train a BPE on the data (cached)")
    # (at least 256 bytes + 3 special tokens, data/tokenizer.py)
    flags.add(g, "--vocab_size", type=int, default=MiniMindConfig.vocab_size, allowed=Range(259),
              help="BPE vocabulary size when training a tokenizer")
    flags.add(g, "--tokenizer_sample_mb", type=int, default=16, allowed=flags.AT_LEAST_1,
              help="a new BPE is trained on the first this-many MB of training documents")
    flags.add(g, "--data_workers", type=int, default=None, allowed=flags.AT_LEAST_0,
              help="processes tokenizing a new corpus; None: one per core above 32 MB of input, else 0")


def load_data(args, tokenizer_dir, global_batch_size, log):
    """Token caches of the corpus (data/prepare.py) -> shuffled (seq_len + 1)-token windows for training, the
    first `eval_tokens` of the validation stream for evaluation."""
    from data.dataset import WindowBatches, fixed_windows  # (here, not above: the flags parse without torch)
    from data.prepare import prepare_data
    data = prepare_data(args.data_path, tokenizer_dir, args.vocab_size, log=log, text_field=args.text_field,
                        tokenizer_sample_mb=args.tokenizer_sample_mb, workers=args.data_workers,
                        progress=not args.no_progress)
    windows = fixed_windows(data["val"], args.seq_len, args.eval_tokens)
    return StageData(
        tokenizer=data["tokenizer"], tokenizer_dir=data["tokenizer_dir"],
        train_batches=WindowBatches(data["train"], args.seq_len, global_batch_size, seed=args.seed,
                                    name="training data"),
        val_batches=[(w[:, :-1], w[:, 1:]) for w in windows.split(args.batch_size)],
        identity={"train_tokens": len(data["train"]), "data_fingerprint": data_fingerprint(data["index"])},
        unigram_entropy=data["index"]["val_unigram_entropy"])


def data_fingerprint(index):
    """The token cache's content hashes (source files in order, split rule; tokenizer): a resume on other data or
    the same documents reordered is refused, one in moved folders is not."""
    return f"{index['source_fingerprint']}-{index['tokenizer_sha1'][:12]}"


# The main job ends in about 15 minutes on any 2-core machine: 1,300 steps where they take under 10 minutes,
# else the steps 10 minutes hold (train/loop.py: plan_budget). --time_budget_s 0: 1,300 steps, however long.
STAGE = Stage(name="pretrain", description=__doc__, default_out_dir="checkpoints/pretrain",
              add_data_flags=add_data_flags, load_data=load_data, data_order_flags=("data_path", "text_field"),
              defaults=dict(time_budget_s=600.0))


def parse_args(argv=None):
    return flags.parse_args(STAGE, argv)


def train(args, log=print):
    from train import loop
    return loop.train(args, STAGE, log=log)


if __name__ == "__main__":
    args = parse_args()  # (before the loop's imports: --help and a mistyped flag answer without torch)
    from train import loop
    loop.run_cli(STAGE, args)
