"""What the HF-stack scripts share: the embedded question-answer pairs (the SFT set's split), a deterministic
pick of wrong answers, loading an exported folder, and writing a new one atomically.

The pairs are the SFT set's "What does `name` do?" turns (data/sft_corpus.py), with its split: 'val' names
were never fine-tuned on, so their scores measure what a model learned, not what it memorised.
"""
import json
import math
import os
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from data.atomic import atomic_dir  # noqa: E402
from train.flags import AT_LEAST_1, POSITIVE, Parser, Range, add  # noqa: E402
from train.run_dir import checkpoint_in  # noqa: E402



def sft_conversations(split):
    """The embedded SFT set's split ('train' | 'val') as lists of {"role", "content"} messages, in file order."""
    from data.sft_corpus import default_sft_set
    with open(default_sft_set()[split], encoding="utf-8") as f:
        return [json.loads(line)["conversations"] for line in f]


def qa_pairs(split, limit=None):
    """[(question, answer)] of the SFT set's split ('train' | 'val'), one per question, in file order.
    Only the "What does `name` do?" turns: their answers are the docstrings' first paragraphs."""
    seen, out = set(), []
    for turns in sft_conversations(split):
        for q, a in zip(turns, turns[1:]):
            if q["role"] == "user" and a["role"] == "assistant" and q["content"].startswith("What does `") \
                    and q["content"] not in seen:
                seen.add(q["content"])
                out.append((q["content"], a["content"]))
    return out[:limit]


def wrong_answers(pairs, k, seed=0):
    """For each pair i, k answers of other pairs (indices != i, answers != pair i's), fixed by `seed`: the
    rejected answer of a preference pair, the distractors of a multiple-choice question."""
    rng, n = random.Random(seed), len(pairs)
    if n <= k:
        raise ValueError(f"need more than {k} question-answer pairs, got {n}")
    out = []
    for i, (_, answer) in enumerate(pairs):
        picks = []
        while len(picks) < k:
            j = rng.randrange(n)
            if j != i and pairs[j][1] != answer and pairs[j][1] not in picks:
                picks.append(pairs[j][1])
        out.append(picks)
    return out


def check_out_dir(out_dir):
    """Refuse an --out that exists and is not an empty folder (nothing is ever overwritten)."""
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise ValueError(f"{out_dir}: exists and is not an empty folder; choose a new --out")


def load_export(path):
    """(model, tokenizer) of an HF folder (an export of scripts/export_hf.py or one written here), fp32, train mode
    off. Raises ValueError naming the folder when it is not one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if os.path.isdir(path) and os.path.lexists(checkpoint_in(path)):  # a run folder (ckpt.pt or ckpt), a sharded ckpt
        raise ValueError(f"{path}: a training run, not an export; run scripts/export_hf.py --ckpt {path} --out DIR "
                         f"first and pass DIR")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{path}: not an exported model folder (no config.json); export one with scripts/export_hf.py")
    tokenizer = AutoTokenizer.from_pretrained(path)
    if not tokenizer.chat_template:
        raise ValueError(f"{path}: the tokenizer has no chat template (export a train/sft.py checkpoint)")
    return AutoModelForCausalLM.from_pretrained(path, dtype="float32"), tokenizer


def non_finite_guard():
    """A transformers TrainerCallback that stops training at the first logged loss or gradient norm that is
    NaN or inf, and remembers the step (`.bad_step`) for `save_export` to refuse."""
    from transformers import TrainerCallback

    class StopOnNonFinite(TrainerCallback):
        bad_step = None

        def on_log(self, args, state, control, logs=None, **kwargs):
            values = [v for k, v in (logs or {}).items() if ("loss" in k or k == "grad_norm") and isinstance(v, float)]
            if not all(math.isfinite(v) for v in values):
                self.bad_step = state.global_step
                control.should_training_stop = True

    return StopOnNonFinite()


def save_export(model, tokenizer, out_dir, json_files=None, guard=None):
    """model.save_pretrained + tokenizer (+ {name: object} written as JSON) into out_dir as a whole (a temp
    folder renamed into place). Raises ValueError, writing nothing, when training hit a non-finite loss or
    gradient (`guard`: non_finite_guard's callback) or a weight is not finite."""
    if guard is not None and guard.bad_step is not None:
        raise ValueError(f"non-finite loss or gradient norm by step {guard.bad_step}; stopped, nothing written "
                         f"(lower --lr)")
    bad = [name for name, p in model.named_parameters() if not bool(p.isfinite().all())]
    if bad:
        raise ValueError(f"the trained weights are not finite ({bad[0]}{' and more' if len(bad) > 1 else ''}); "
                         f"nothing written (lower --lr)")
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for name, obj in (json_files or {}).items():
            with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
                json.dump(obj, f, indent=1)


def quiet_hf():
    """No progress bars or per-step logging from transformers / datasets (the scripts print their own figures)."""
    import datasets
    import transformers
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()


def training_parser(doc, out, lr, unit, fewest=1):
    """The flags both post-training scripts take (--model, --out, --steps, --batch_size, --lr, --max_train: at
    least `fewest`, --seed); each script adds its own."""
    p = Parser(description=doc)
    p.add_argument("--model", default="exports/minimind-moe-sft", help="exported HF folder to start from (SFT)")
    p.add_argument("--out", default=out, help="new HF folder to write")
    add(p, "--steps", allowed=AT_LEAST_1, type=int, default=100, help="optimizer steps")
    add(p, "--batch_size", allowed=AT_LEAST_1, type=int, default=16, help=f"{unit} per step")
    add(p, "--lr", allowed=POSITIVE, type=float, default=lr, help="peak learning rate (cosine, 10%% warmup)")
    add(p, "--max_train", allowed=Range(fewest), type=int, default=None, help=f"use only the first N training {unit}")
    add(p, "--seed", allowed=Range(0, 2**32 - 1), type=int, default=0,
        help="training seed (dpo.py: also of the rejected answers)")
    return p


def run_training(p, argv, fn):
    """Parse argv (a flag out of its range: parser error naming it), then fn(args) (its
    ValueError or OSError: a folder that is not an export, an --out that exists, non-finite training, ends the
    script through train/flags.py: run_tool)."""
    fn(p.parse_args(argv))
