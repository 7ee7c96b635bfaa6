"""lm-eval datasets built on the spot from the Python standard library (nothing downloaded): the embedded SFT
set's held-out "What does `name` do?" pairs (scripts/hf/common.py), names no model here was fine-tuned on.

- stdlib_qa: the question in ChatML, four choices (the function's docstring first paragraph and three other
  held-out functions' answers, fixed by seed 0); acc and length-normalised acc_norm, chance 0.25.
- stdlib_doc_bpb: the same answers as plain text, scored as held-out text (bits per byte).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import qa_pairs, wrong_answers  # noqa: E402

CHOICES = 4


def stdlib_qa(**_):
    from datasets import Dataset, DatasetDict
    pairs = qa_pairs("val")
    rows = []
    for i, ((question, answer), wrong) in enumerate(zip(pairs, wrong_answers(pairs, CHOICES - 1, seed=0))):
        label = i % CHOICES  # the right answer's slot cycles through the four
        choices = wrong[:label] + [answer] + wrong[label:]
        rows.append({"prompt": f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n", "choices": choices,
                     "label": label})
    return DatasetDict({"test": Dataset.from_list(rows)})


def stdlib_doc_bpb(**_):
    from datasets import Dataset, DatasetDict
    return DatasetDict({"test": Dataset.from_list([{"text": answer} for _, answer in qa_pairs("val")])})
