"""Does fine-tuning help? Held-out questions answered by the fine-tuned model and continued by the base model,
scored by the words they share with the true docstring.

    python scripts/eval_sft.py                      # checkpoints/pretrain vs checkpoints/sft, 20 questions
    python scripts/eval_sft.py --n 50 --examples 5

The questions are the first `--n` "What does `name` do?" conversations of the embedded set's held-out file
(names never seen in fine-tuning). The fine-tuned model gets the question in the chat template and answers
until <|im_end|>; the base model gets the same question as plain text plus a newline and continues it for
as many tokens (it has no chat template). Both are greedy. Score: the word-level F1 between the output
and the true answer (SQuAD's measure: lower-cased alphanumeric words as a bag), averaged over questions.
"""
import json
import os
import re
import sys
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import torch  # noqa: E402

from data.chat import tokenize_conversation  # noqa: E402
from data.sft_corpus import default_sft_set  # noqa: E402
from data.dataset import DataError  # noqa: E402
from data.tokenizer import load_tokenizer, stop_token_ids  # noqa: E402
from model.hf_adapter import is_hf_folder  # noqa: E402
from train.checkpoint import load_checkpoint, model_from_checkpoint  # noqa: E402
from train.hf_folder import load_hf_checked  # noqa: E402
from train.run_dir import run_tokenizer  # noqa: E402


def words(text):
    return re.findall(r"[a-z0-9]+", text.lower())


def f1(prediction, truth):
    """Word-bag F1 between two texts (0 when either is empty)."""
    p, t = Counter(words(prediction)), Counter(words(truth))
    common = sum((p & t).values())
    if not common:
        return 0.0
    precision, recall = common / sum(p.values()), common / sum(t.values())
    return 2 * precision * recall / (precision + recall)


def questions(n):
    out = []
    with open(default_sft_set()["val"], encoding="utf-8") as f:
        for line in f:
            turns = [m for m in json.loads(line)["conversations"] if m["role"] != "system"]
            q, a = turns[0]["content"], turns[1]["content"]
            if q.startswith("What does "):
                out.append((q, a))
            if len(out) == n:
                break
    return out


def load(path):
    """(model in eval mode, tokenizer) of a run folder (ckpt.pt + tokenizer/) or an export (scripts/export_hf.py),
    in fp32 whatever dtype the run trained in (greedy decoding: scripts/generate.py: load_model says why fp32
    serves it better). Raises FileNotFoundError / ValueError / DataError naming the file."""
    if is_hf_folder(path):
        return load_hf_checked(path).eval(), load_tokenizer(path)
    return model_from_checkpoint(load_checkpoint(path)).eval(), run_tokenizer(path)[0]


@torch.no_grad()
def answer(model, tok, prompt_ids, max_new_tokens):
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, max_new_tokens=max_new_tokens, temperature=0, eos_token_id=stop_token_ids(tok))
    return tok.decode(out[0, len(prompt_ids):].tolist(), skip_special_tokens=True).strip()


def main(argv=None):
    from train.flags import AT_LEAST_0, AT_LEAST_1, Parser, add
    p = Parser(description=__doc__)
    p.add_argument("--base", default="checkpoints/pretrain", help="the pretrained run (or its export)")
    p.add_argument("--sft", default="checkpoints/sft", help="the fine-tuned run (or its export)")
    add(p, "--n", allowed=AT_LEAST_1, type=int, default=20, help="held-out questions")
    add(p, "--examples", allowed=AT_LEAST_0, type=int, default=3, help="answers to print")
    add(p, "--max_new_tokens", allowed=AT_LEAST_1, type=int, default=60, help="longest answer")
    args = p.parse_args(argv)
    try:
        (base, base_tok), (sft, sft_tok) = load(args.base), load(args.sft)
    except (DataError, FileNotFoundError, ValueError) as e:
        p.error(f"{e} (--base / --sft: a run folder of train/pretrain.py or train/sft.py, or its export)")
    rows = []
    for q, truth in questions(args.n):
        chat_ids, _ = tokenize_conversation(sft_tok, [{"role": "user", "content": q}], add_generation_prompt=True)
        a_sft = answer(sft, sft_tok, chat_ids.tolist(), args.max_new_tokens)
        a_base = answer(base, base_tok, base_tok(q + "\n", add_special_tokens=False)["input_ids"], args.max_new_tokens)
        rows.append((q, truth, a_base, a_sft, f1(a_base, truth), f1(a_sft, truth)))
    mean = lambda i: sum(r[i] for r in rows) / len(rows)  # noqa: E731
    print(f"{len(rows)} held-out questions, word F1 with the true answer: base {mean(4):.3f}, fine-tuned {mean(5):.3f}")
    print(f"fine-tuned better on {sum(r[5] > r[4] for r in rows)}, base better on {sum(r[4] > r[5] for r in rows)}")
    for q, truth, a_base, a_sft, fb, fs in rows[:args.examples]:
        print(f"\nQ: {q}\n   true: {truth}\n   base ({fb:.2f}): {a_base[:200]!r}\n"
              f"   fine-tuned ({fs:.2f}): {a_sft[:200]!r}")


if __name__ == "__main__":
    from train.flags import run_tool
    run_tool(main)
