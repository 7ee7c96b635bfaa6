"""Token caches on disk: a corpus tokenized once, in parallel and in bounded memory, then read by `np.memmap`,
so training memory does not grow with the corpus (nanoGPT's `.bin` idea).

A folder `tokens-<key>/` holds per split: `<split>.bin`, every document's ids followed by eos, back to back, raw
little-endian uint16 while the vocabulary fits (else uint32); `<split>.docs.bin`, int64 document start offsets;
and `index.json`: dtype, per-split token / document / UTF-8 byte counts, tokenizer and source hashes, the val
split's unigram entropy (nats). Written atomically (data/atomic.py); `open_token_cache` returns None for an
index that does not match its files (rebuild).
Tokenization runs in `workers` processes (converting ids to arrays is single-threaded Python work) on batches
of about BATCH_BYTES with `tokenizers`; at most two batches per worker are in flight, so memory is bounded
whatever the corpus size.
"""
import itertools
import json
import multiprocessing
import os
import sys
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from types import SimpleNamespace

import numpy as np

from data.atomic import atomic_dir, atomic_write_text

FORMAT_VERSION = 1
SPLITS = ("train", "val")
BATCH_BYTES = 4 << 20  # text per tokenization task
BATCH_DOCS = 4096

_encoder = None  # texts -> ids lists: set by TokenEncoder before its workers fork (a spawned worker builds its own)


def _make_encoder(tokenizer_json):
    """texts -> lists of ids (`tokenizers`)."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(tokenizer_json)
    return lambda texts: [e.ids for e in tok.encode_batch_fast(texts, add_special_tokens=False)]


def _init_worker(tokenizer_json, parent_pid):
    """A pool worker; on Linux it gets SIGKILL when the parent dies (no orphan keeps the inherited cache lock)."""
    global _encoder
    if sys.platform.startswith("linux"):
        import ctypes
        import signal
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)
    if _encoder is None:  # spawned (not Linux): build it here
        _encoder = _make_encoder(tokenizer_json)


def _encode_batch(texts, eos_id, dtype):
    """texts -> (ids of every text each followed by eos_id [dtype], tokens per text incl. eos, UTF-8 bytes per text)."""
    encoded = _encoder(texts)
    lengths = np.fromiter((len(x) + 1 for x in encoded), dtype=np.int64, count=len(encoded))
    ids = np.empty(int(lengths.sum()), dtype=dtype)
    ends = np.cumsum(lengths)
    for x, end, n in zip(encoded, ends, lengths):
        ids[end - n:end - 1] = x
    ids[ends - 1] = eos_id
    nbytes = np.fromiter((len(t.encode("utf-8")) for t in texts), dtype=np.int64, count=len(texts))
    return ids, lengths, nbytes


class TokenEncoder:
    """Context manager encoding batches in `workers` processes (0: in this one); `map(batches)` yields (batch,
    `_encode_batch` result) in order."""

    def __init__(self, tokenizer_json, eos_id, dtype, workers):
        self.tokenizer_json, self.eos_id, self.dtype, self.workers = tokenizer_json, eos_id, dtype, workers
        self.pool = None

    def __enter__(self):
        global _encoder
        _encoder = _make_encoder(self.tokenizer_json)  # once; forked workers inherit it
        if self.workers > 0:
            # fork where it is safe (Linux), as torch's DataLoader does (a spawned worker re-imports the caller)
            method = "fork" if sys.platform.startswith("linux") else "spawn"
            saved = os.environ.get("TOKENIZERS_PARALLELISM")
            os.environ["TOKENIZERS_PARALLELISM"] = "false"  # set before the fork: no fork warning from tokenizers
            try:
                self.pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context(method),
                                                initializer=_init_worker,
                                                initargs=(self.tokenizer_json, os.getpid()))
                self.pool.submit(int).result()  # the processes start now, while the variable is set
            finally:
                (os.environ.pop("TOKENIZERS_PARALLELISM") if saved is None
                 else os.environ.update(TOKENIZERS_PARALLELISM=saved))
        return self

    def __exit__(self, *exc):
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def map(self, batches):
        if self.pool is None:
            yield from ((batch, _encode_batch(batch[0], self.eos_id, self.dtype)) for batch in batches)
            return
        pending = deque()
        for batch in itertools.chain(batches, [None]):
            if batch is not None:
                pending.append((batch, self.pool.submit(_encode_batch, batch[0], self.eos_id, self.dtype)))
            while pending and (batch is None or len(pending) >= 2 * self.workers):
                b, fut = pending.popleft()
                yield b, fut.result()


def _batches(documents):
    """(split, text, where) stream -> batches (texts, is_val bool array, bytes read) of bounded size."""
    texts, is_val, size = [], [], 0
    for split, text, _where in documents:
        texts.append(text)
        is_val.append(split == "val")
        size += len(text)
        if size >= BATCH_BYTES or len(texts) >= BATCH_DOCS:
            yield texts, np.array(is_val), size
            texts, is_val, size = [], [], 0
    if texts:
        yield texts, np.array(is_val), size


class _SplitWriter:
    """Appends token ids and document offsets of one split to its files; keeps the counts."""

    def __init__(self, folder, split):
        self.files = [open(os.path.join(folder, f"{split}{ext}"), "wb") for ext in (".bin", ".docs.bin")]
        self.counts = {"tokens": 0, "documents": 0, "bytes": 0}

    def write(self, ids, lengths, nbytes):
        if len(lengths):
            starts = self.counts["tokens"] + np.concatenate(([0], np.cumsum(lengths)[:-1]))
            self.files[0].write(ids.tobytes())
            self.files[1].write(starts.astype(np.int64).tobytes())
            for k, n in (("tokens", len(ids)), ("documents", len(lengths)), ("bytes", int(nbytes.sum()))):
                self.counts[k] += n

    def close(self):
        for f in self.files:
            f.flush()
            os.fsync(f.fileno())
            f.close()


def build_token_cache(path, documents, tokenizer_json, eos_id, vocab_size, meta, workers=0, progress=None):
    """Tokenize `documents` ((split, text, where)) into the folder `path`, or leave nothing there on any exception
    (e.g. DataError for a malformed line). `meta` goes into index.json; `progress`: None or callable(n_chars) per
    batch. Returns the index dict."""
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32  # while every id fits
    with atomic_dir(path) as tmp:
        writers = {s: _SplitWriter(tmp, s) for s in SPLITS}
        counts_V = np.zeros(max(vocab_size, 1), dtype=np.int64)
        try:
            with TokenEncoder(tokenizer_json, eos_id, dtype, workers) as encoder:
                for (texts, is_val, size), (ids, lengths, nbytes) in encoder.map(_batches(documents)):
                    if is_val.any():
                        tok_is_val = np.repeat(is_val, lengths)
                        writers["val"].write(ids[tok_is_val], lengths[is_val], nbytes[is_val])
                        counts_V += np.bincount(ids[tok_is_val], minlength=len(counts_V))[:len(counts_V)]
                        ids, lengths, nbytes = ids[~tok_is_val], lengths[~is_val], nbytes[~is_val]
                    writers["train"].write(ids, lengths, nbytes)
                    if progress is not None:
                        progress(size)
        finally:
            for w in writers.values():
                w.close()
        splits = {s: w.counts for s, w in writers.items()}
        split_rule = meta.get("split_rule", "")
        if splits["val"]["tokens"] < max(splits["train"]["tokens"] // 100, 1) and splits["train"]["tokens"] > 2:
            splits, counts_V = _tail_as_validation(tmp, dtype, splits, tokenizer_json, len(counts_V))
            split_rule = (f"held-out documents gave under 1% of the tokens: they went back into training, and "
                          f"validation is the last {splits['val']['tokens']:,} tokens of the stream instead")
        index = dict(meta, format=FORMAT_VERSION, dtype=np.dtype(dtype).name, vocab_size=vocab_size,
                     splits=splits, val_unigram_entropy=entropy(counts_V), split_rule=split_rule)
        atomic_write_text(os.path.join(tmp, "index.json"), json.dumps(index, indent=1))
    return index


def _tail_as_validation(folder, dtype, splits, tokenizer_json, vocab_size):
    """Too few held-out documents: they go back at the end of the training stream, and its last max(5%, 2) tokens
    become validation. Returns the new split counts and the validation token counts per id."""
    from tokenizers import Tokenizer
    file = {name: os.path.join(folder, name) for name in ("train.bin", "val.bin", "train.docs.bin", "val.docs.bin")}
    stream = np.concatenate([np.fromfile(file["train.bin"], dtype=dtype), np.fromfile(file["val.bin"], dtype=dtype)])
    offsets = np.concatenate([np.fromfile(file["train.docs.bin"], dtype=np.int64),
                              splits["train"]["tokens"] + np.fromfile(file["val.docs.bin"], dtype=np.int64)])
    cut = len(stream) - max(len(stream) // 20, 2)
    stream[:cut].tofile(file["train.bin"])
    stream[cut:].tofile(file["val.bin"])
    np.zeros(1, np.int64).tofile(file["val.docs.bin"])
    offsets[offsets < cut].tofile(file["train.docs.bin"])
    tail = stream[cut:]
    val_bytes = len(Tokenizer.from_file(tokenizer_json).decode(tail.tolist(), skip_special_tokens=True).encode("utf-8"))
    total_bytes = splits["train"]["bytes"] + splits["val"]["bytes"]
    splits = {"train": {"tokens": cut, "documents": int((offsets < cut).sum()),
                        "bytes": max(total_bytes - val_bytes, 0)},
              "val": {"tokens": len(tail), "documents": 1, "bytes": val_bytes}}
    return splits, np.bincount(tail, minlength=vocab_size)[:vocab_size]


def entropy(counts):
    """Entropy in nats of the distribution that `counts` (int array) are samples of."""
    p = counts[counts > 0] / max(int(counts.sum()), 1)
    return float(-(p * np.log(p)).sum())


def open_token_cache(path):
    """A prepared corpus: `train`, `val` (read-only 1-D np.memmap in the index's dtype; empty for an empty split),
    `index` (parsed index.json), `path`. None when absent or when index.json does not match the files."""
    try:
        with open(os.path.join(path, "index.json"), encoding="utf-8") as f:
            index = json.load(f)
        dtype = np.dtype(index["dtype"])
        arrays = {}
        for s in SPLITS:
            n = index["splits"][s]["tokens"]
            file = os.path.join(path, f"{s}.bin")
            if index.get("format") != FORMAT_VERSION or os.path.getsize(file) != n * dtype.itemsize or \
                    os.path.getsize(os.path.join(path, f"{s}.docs.bin")) != index["splits"][s]["documents"] * 8:
                return None
            arrays[s] = np.memmap(file, dtype=dtype, mode="r", shape=(n,)) if n else np.zeros(0, dtype)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return SimpleNamespace(path=path, index=index, **arrays)

