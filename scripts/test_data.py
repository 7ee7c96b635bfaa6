"""Data: the embedded corpus, the tokenizer, user files and their errors, resumable batches.

    python scripts/test_data.py
"""
import json
import os
import tempfile

import numpy as np
import torch

from testlib import SHARED, Skip, run  # noqa: F401
from data.corpus import default_corpus
from data.dataset import DataError, WindowBatches, check_data_file, fixed_windows, load_documents, unigram_entropy
from data.tokenizer import SPECIAL_TOKENS, save_tokenizer, train_tokenizer


def _write(path, text, mode="w"):
    with open(path, mode) as f:
        f.write(text)
    return path


def test_default_corpus_is_deterministic_real_prose():
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        pa, pb = default_corpus(a), default_corpus(b)
        for split in ("train", "val"):
            with open(pa[split], "rb") as fa, open(pb[split], "rb") as fb:
                assert fa.read() == fb.read(), f"{split} differs between two builds"
        docs = {s: [json.loads(l)["text"] for l in open(pa[s], encoding="utf-8")] for s in pa}
    size = sum(len(d) for s in docs for d in docs[s])
    assert 1_000_000 < size < 5_000_000, f"corpus is {size} chars"
    assert 0.03 < len(docs["val"]) / (len(docs["train"]) + len(docs["val"])) < 0.08
    text = " ".join(docs["train"])
    for word in ("Return the", "function", "argument", "string"):
        assert word in text, f"{word!r} not in corpus"


def test_tokenizer_roundtrip_and_autotokenizer():
    from transformers import AutoTokenizer
    texts = ["Return the number of items in the container.", "The quick brown fox jumps over the lazy dog."] * 50
    tok = train_tokenizer(texts, vocab_size=400)
    with tempfile.TemporaryDirectory() as d:
        save_tokenizer(tok, os.path.join(d, "tok"))
        loaded = AutoTokenizer.from_pretrained(os.path.join(d, "tok"))
    assert [loaded.convert_tokens_to_ids(s) for s in SPECIAL_TOKENS] == [0, 1, 2]
    assert loaded.eos_token_id == 0 and loaded.pad_token_id == 0
    for s in ("Hello, wörld! 123 \n\t tabs", "emoji 🙂 and 中文"):  # byte-level: any text round-trips
        assert loaded.decode(loaded(s, add_special_tokens=False)["input_ids"]) == s
    chat = loaded.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", chat
    try:
        train_tokenizer(texts, vocab_size=100)
    except ValueError as e:
        assert "vocab_size" in str(e)
    else:
        raise AssertionError("tiny vocab accepted")


def test_user_files_jsonl_and_txt():
    with tempfile.TemporaryDirectory() as d:
        j = _write(os.path.join(d, "a.jsonl"), '{"text": "first doc"}\n\n{"text": "second", "id": 3}\n{"text": "  "}\n')
        assert load_documents(j)["text"] == ["first doc", "second"]
        t = _write(os.path.join(d, "b.txt"), "para one\nline two\n\npara two\n\n\n")
        assert [s.strip() for s in load_documents(t)["text"]] == ["para one\nline two", "para two"]


def test_bad_files_name_file_and_line():
    with tempfile.TemporaryDirectory() as d:
        cases = {
            "missing.jsonl": (None, "not found"),
            "empty.jsonl": ("", "no text"),
            "blank.txt": ("\n\n  \n", "no text"),
            "bad.jsonl": ('{"text": "ok"}\n{"text": "broken\n', "bad.jsonl:2: malformed JSON"),
            "nofield.jsonl": ('{"text": "ok"}\n{"body": "x"}\n', 'nofield.jsonl:2: expected an object with a "text"'),
            "notstr.jsonl": ('{"text": 5}\n', "notstr.jsonl:1: \"text\" must be a string"),
            "latin1.txt": (b"caf\xe9\n", "latin1.txt:1: not valid UTF-8"),
            "data.csv": ("a,b\n", "unsupported extension"),
        }
        for name, (content, msg) in cases.items():
            path = os.path.join(d, name)
            if content is not None:
                _write(path, content, "wb" if isinstance(content, bytes) else "w")
            try:
                check_data_file(path)
            except DataError as e:
                assert msg in str(e) and name in str(e), f"{name}: {e}"
            else:
                raise AssertionError(f"{name}: accepted")


def test_window_batches_resume_exactly():
    tokens = np.arange(1000, dtype=np.int32)
    a = WindowBatches(tokens, seq_len=16, batch_size=5, seed=3)
    seq = [a.next() for _ in range(30)]  # several epochs (61 windows)
    x, y = seq[0]
    assert x.shape == (5, 16) and torch.equal(x[:, 1:], y[:, :-1])
    b = WindowBatches(tokens, seq_len=16, batch_size=5, seed=3)
    for _ in range(17):
        b.next()
    c = WindowBatches(tokens, seq_len=16, batch_size=5, seed=3)
    c.load_state_dict(b.state_dict())
    for i in range(17, 30):
        assert torch.equal(c.next()[0], seq[i][0]), f"batch {i} differs after resume"
    firsts = torch.cat([s[0][:, 0] for s in seq[:13]])  # the first epoch covers each window once
    assert len(set(firsts[:61].tolist())) == 61
    try:
        WindowBatches(np.arange(10), seq_len=16, batch_size=2)
    except DataError as e:
        assert "seq_len" in str(e)
    else:
        raise AssertionError("too-short stream accepted")


def test_fixed_windows_and_entropy():
    w = fixed_windows(np.arange(100), seq_len=10, max_tokens=35)
    assert w.shape == (3, 11) and w[1, 0] == 10
    assert fixed_windows(np.arange(5), seq_len=10, max_tokens=100).shape == (1, 5)
    assert abs(unigram_entropy(np.array([0, 1, 2, 3])) - np.log(4)) < 1e-12
    assert unigram_entropy(np.array([7, 7, 7])) == 0.0


TESTS = [test_default_corpus_is_deterministic_real_prose, test_tokenizer_roundtrip_and_autotokenizer,
         test_user_files_jsonl_and_txt, test_bad_files_name_file_and_line, test_window_batches_resume_exactly,
         test_fixed_windows_and_entropy]

if __name__ == "__main__":
    run(TESTS)
