"""Text files -> token streams -> resumable batches of fixed-length windows.

Input formats (chosen by extension): `.jsonl` / `.json` with one {"text": ...} object per line
(MiniMind's pretraining format), or plain `.txt` whose blank-line-separated paragraphs are documents.
Files are loaded with HF `datasets`; documents are joined into one token stream with `<|endoftext|>`
after each one.
"""
import hashlib
import json
import os

import numpy as np
import torch


class DataError(ValueError):
    """Bad input data; the message names the file (and the line, where there is one)."""


def check_data_file(path):
    """Validate a data file before loading. Raises DataError naming the file and, for jsonl, the line."""
    if not os.path.exists(path):
        raise DataError(f"{path}: data file not found")
    if os.path.isdir(path):
        raise DataError(f"{path}: is a directory, expected a .jsonl or .txt file")
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".jsonl", ".json", ".txt"):
        raise DataError(f"{path}: unsupported extension '{ext}', expected .jsonl, .json or .txt")
    n_docs = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
            if ext == ".txt":
                n_docs += bool(line.strip())
                continue
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict) or "text" not in obj:
                raise DataError(f"{path}:{lineno}: expected an object with a \"text\" field")
            if not isinstance(obj["text"], str):
                raise DataError(f"{path}:{lineno}: \"text\" must be a string, got {type(obj['text']).__name__}")
            n_docs += bool(obj["text"].strip())
    if n_docs == 0:
        raise DataError(f"{path}: contains no text")
    return n_docs


def load_documents(path):
    """Return a `datasets.Dataset` with a "text" column (non-empty documents only) for a checked file."""
    import datasets
    check_data_file(path)
    datasets.disable_progress_bars()
    try:
        if path.lower().endswith(".txt"):
            ds = datasets.load_dataset("text", data_files=path, sample_by="paragraph", split="train")
        else:
            ds = datasets.load_dataset("json", data_files=path, split="train")
            ds = ds.select_columns(["text"])
    except Exception as e:  # what the line check lets through but the parser refuses (e.g. lone surrogates)
        cause = e.__cause__ or e
        raise DataError(f"{path}: could not be loaded ({type(cause).__name__}: {str(cause)[:300]})") from None
    return ds.filter(lambda b: [bool(t and t.strip()) for t in b["text"]], batched=True)


def file_fingerprint(path):
    """sha1 of a file's bytes (hex, 16 chars): the cache key of everything derived from it."""
    h = hashlib.sha1()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def tokenize_documents(ds, tokenizer, eos_id):
    """Token stream of all documents, each followed by eos_id. Returns a 1-D int32 numpy array."""
    def enc(batch):
        return {"ids": tokenizer(batch["text"], add_special_tokens=False)["input_ids"]}
    ids = ds.map(enc, batched=True, remove_columns=ds.column_names)["ids"]
    out = np.empty(sum(len(x) + 1 for x in ids), dtype=np.int32)
    pos = 0
    for x in ids:
        out[pos:pos + len(x)] = x
        out[pos + len(x)] = eos_id
        pos += len(x) + 1
    return out


def split_documents(ds, val_every=20):
    """Deterministic held-out split: every `val_every`-th document is validation. Returns (train, val)."""
    idx = np.arange(len(ds))
    is_val = idx % val_every == val_every - 1
    return ds.select(idx[~is_val]), ds.select(idx[is_val])


class WindowBatches:
    """Batches of (seq_len + 1)-token windows starting every seq_len tokens of a stream (neighbours share
    one boundary token, so every token is predicted once per epoch), in an order reshuffled every epoch.

    `next()` returns x, y: [B, S] int64 with y = x shifted by one. The order is a pure function of
    (seed, epoch), so `state_dict()` = {"epoch", "cursor"} resumes exactly.

    Raises DataError if the stream holds fewer than one window.
    """

    def __init__(self, tokens, seq_len, batch_size, seed=0, name="data"):
        self.tokens = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.num_windows = (len(self.tokens) - 1) // seq_len
        if self.num_windows < 1:
            raise DataError(f"{name}: {len(self.tokens)} tokens is too little for one window of "
                            f"seq_len={seq_len} (+1); use a shorter --seq_len or more data")
        self.epoch, self.cursor = 0, 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch):
        g = torch.Generator().manual_seed(self.seed * 100003 + epoch)
        return torch.randperm(self.num_windows, generator=g)

    def state_dict(self):
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state):
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._order = self._epoch_order(self.epoch)

    def next(self):
        starts = []
        while len(starts) < self.batch_size:
            if self.cursor == self.num_windows:
                self.epoch, self.cursor = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
            starts.append(int(self._order[self.cursor]) * self.seq_len)
            self.cursor += 1
        idx = torch.tensor(starts)[:, None] + torch.arange(self.seq_len + 1)
        w = self.tokens[idx]
        return w[:, :-1], w[:, 1:]


def fixed_windows(tokens, seq_len, max_tokens):
    """The first windows of a stream (validation): [N, seq_len + 1] int64, about max_tokens tokens.
    A stream shorter than one window yields one shorter window."""
    t = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
    n = max(1, min((len(t) - 1) // seq_len, max(1, max_tokens // seq_len)))
    if len(t) - 1 < seq_len:
        return t[None, :]
    return t[: n * seq_len + 1].unfold(0, seq_len + 1, seq_len)[:n].contiguous()


def unigram_entropy(tokens):
    """Entropy of the empirical token distribution, in nats: the loss of the best context-free model."""
    counts = np.bincount(np.asarray(tokens))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
