"""Token caches on disk: a corpus tokenized once, in parallel and in bounded memory, then read by
`np.memmap`, so training memory does not grow with the corpus (nanoGPT's `.bin` idea).

A prepared corpus is a folder `tokens-<key>/` holding, per split (`train`, `val`):
- `<split>.bin`: the token ids of every document followed by the eos id, back to back, raw little-endian
  `uint16` while the vocabulary fits (else `uint32`);
- `<split>.docs.bin`: int64 start offset of every document in `<split>.bin`;
and `index.json`: dtype, per-split token / document / UTF-8 byte counts, the tokenizer's and the source's
hashes, and the validation split's unigram entropy (nats). The folder is written into a temp folder and
renamed into place (train/atomic.py), so a crash or a malformed line never leaves a partial cache; an
index that does not match its files is detected on open (`open_token_cache` returns None: rebuild).

Tokenization runs in a pool of processes (`workers`), each on batches of about `BATCH_BYTES` of text with
tiktoken where it reproduces the tokenizer exactly (data/fast_bpe.py; about 3x faster), else HF
`tokenizers`' batch encoder; at most two batches per worker are in flight, so preparation memory is
bounded whatever the corpus size. Measured on 2 cores (AMD EPYC): a pool of 2 processes tokenized
9.4 MB/s against 4.6 MB/s for one process using the tokenizer's own thread pool, because turning the ids
into arrays is single-threaded Python work.
"""
import itertools
import json
import multiprocessing
import os
import sys
from collections import deque
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from train.atomic import atomic_dir, atomic_write_text

FORMAT_VERSION = 1
SPLITS = ("train", "val")
BATCH_BYTES = 4 << 20  # text per tokenization task
BATCH_DOCS = 4096

_encoder = None  # texts -> ids lists: set by TokenEncoder before its workers fork (a spawned worker builds its own)


def token_dtype(vocab_size):
    """uint16 while every id fits, else uint32."""
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def _die_with_parent(parent_pid):
    """Linux: a worker gets SIGKILL when the preparing process dies (a kill -9 leaves no orphan holding the
    cache lock it inherited with the fork)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)


def _make_encoder(tokenizer_json, use_tiktoken):
    """texts -> lists of ids, with tiktoken (data/fast_bpe.py) or `tokenizers`."""
    if use_tiktoken:
        from data.fast_bpe import encode, tiktoken_for
        enc = tiktoken_for(tokenizer_json)
        return lambda texts: [encode(enc, t) for t in texts]
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(tokenizer_json)
    return lambda texts: [e.ids for e in tok.encode_batch_fast(texts, add_special_tokens=False)]


def _init_worker(tokenizer_json, use_tiktoken, parent_pid):
    """A pool worker: dies with its parent; a forked one already holds the parent's encoder."""
    global _encoder
    _die_with_parent(parent_pid)
    if _encoder is None:  # spawned (not Linux): build it here
        _encoder = _make_encoder(tokenizer_json, use_tiktoken)


def _encode_batch(texts, eos_id, dtype):
    """texts -> (ids of every text each followed by eos_id [dtype], tokens per text incl. eos [int64],
    UTF-8 bytes per text [int64])."""
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
    """Encodes batches of texts in order, in `workers` processes (0: in this process), with tiktoken when
    data/fast_bpe.py can reproduce the tokenizer with it (checked again on the first batch), else with
    `tokenizers`. Use as a context manager; `map(batches)` yields `_encode_batch` results in input order,
    with at most 2 * workers batches in flight. `engine` names the encoder used."""

    def __init__(self, tokenizer_json, eos_id, dtype, workers, first_texts=(), engine="auto"):
        from data.fast_bpe import same_ids, tiktoken_for
        self.tokenizer_json, self.eos_id, self.dtype, self.workers = tokenizer_json, eos_id, dtype, workers
        self.pool = None
        enc = tiktoken_for(tokenizer_json) if engine == "auto" else None
        if enc is not None and first_texts:
            from tokenizers import Tokenizer
            enc = enc if same_ids(enc, Tokenizer.from_file(tokenizer_json), first_texts) else None
        self.use_tiktoken = enc is not None
        self.engine = "tiktoken" if enc is not None else "tokenizers"

    def __enter__(self):
        global _encoder
        _encoder = _make_encoder(self.tokenizer_json, self.use_tiktoken)  # once; forked workers inherit it
        if self.workers > 0:
            # fork where it is safe (Linux): workers start at once and share the parent's memory (a spawned
            # worker would re-import the trainer, ~300 MB each). Like torch's DataLoader workers.
            method = "fork" if sys.platform.startswith("linux") else "spawn"
            saved = os.environ.get("TOKENIZERS_PARALLELISM")
            os.environ["TOKENIZERS_PARALLELISM"] = "false"  # set before the fork: no fork warning from tokenizers
            try:
                self.pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context(method),
                                                initializer=_init_worker,
                                                initargs=(self.tokenizer_json, self.use_tiktoken, os.getpid()))
                self.pool.submit(int).result()  # the processes start now, while the variable is set
            finally:
                if saved is None:
                    del os.environ["TOKENIZERS_PARALLELISM"]
                else:
                    os.environ["TOKENIZERS_PARALLELISM"] = saved
        return self

    def __exit__(self, *exc):
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def map(self, batches):
        if self.pool is None:
            for batch in batches:
                yield batch, _encode_batch(batch[0], self.eos_id, self.dtype)
            return
        pending = deque()
        for batch in batches:
            pending.append((batch, self.pool.submit(_encode_batch, batch[0], self.eos_id, self.dtype)))
            if len(pending) >= 2 * self.workers:
                b, fut = pending.popleft()
                yield b, fut.result()
        while pending:
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

    def __init__(self, folder, split, dtype):
        self.tokens = open(os.path.join(folder, f"{split}.bin"), "wb")
        self.docs = open(os.path.join(folder, f"{split}.docs.bin"), "wb")
        self.dtype, self.n_tokens, self.n_docs, self.n_bytes = dtype, 0, 0, 0

    def write(self, ids, lengths, nbytes):
        if len(lengths) == 0:
            return
        starts = self.n_tokens + np.concatenate(([0], np.cumsum(lengths)[:-1]))
        self.tokens.write(ids.tobytes())
        self.docs.write(starts.astype(np.int64).tobytes())
        self.n_tokens += len(ids)
        self.n_docs += len(lengths)
        self.n_bytes += int(nbytes.sum())

    def close(self):
        for f in (self.tokens, self.docs):
            f.flush()
            os.fsync(f.fileno())
            f.close()

    def counts(self):
        return {"tokens": self.n_tokens, "documents": self.n_docs, "bytes": self.n_bytes}


def build_token_cache(path, documents, tokenizer_json, eos_id, vocab_size, meta, workers=0, progress=None,
                      engine="auto"):
    """Tokenize `documents` ((split, text, where) with split "train" or "val") into the folder `path`.

    Written into a temp folder renamed over `path` at the end; on any exception (e.g. DataError for a
    malformed line, raised by the documents iterator) nothing is left. `meta` (dict) goes into
    index.json. `progress`: a callable(n_chars) called per batch, or None. engine: "auto" (tiktoken when it
    reproduces the tokenizer) or "tokenizers". Returns the index dict.
    """
    dtype = token_dtype(vocab_size)
    with atomic_dir(path) as tmp:
        writers = {s: _SplitWriter(tmp, s, dtype) for s in SPLITS}
        counts_V = np.zeros(max(vocab_size, 1), dtype=np.int64)
        try:
            batches = _batches(documents)
            first = next(batches, None)  # its texts check the fast encoder against `tokenizers`
            batches = itertools.chain([first] if first else [], batches)
            with TokenEncoder(tokenizer_json, eos_id, dtype, workers, first[0][:500] if first else (), engine) as encoder:
                for (texts, is_val, size), (ids, lengths, nbytes) in encoder.map(batches):
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
        splits = {s: w.counts() for s, w in writers.items()}
        split_rule = meta.get("split_rule", "")
        if splits["val"]["tokens"] < max(splits["train"]["tokens"] // 100, 1) and splits["train"]["tokens"] > 2:
            splits, counts_V = _tail_as_validation(tmp, dtype, splits, tokenizer_json, len(counts_V))
            split_rule = (f"held-out documents gave under 1% of the tokens: they went back into training, and "
                          f"validation is the last {splits['val']['tokens']:,} tokens of the stream instead")
        index = dict(meta, format=FORMAT_VERSION, dtype=np.dtype(dtype).name, vocab_size=vocab_size,
                     splits=splits, val_unigram_entropy=_entropy(counts_V), split_rule=split_rule,
                     encoder=encoder.engine)
        atomic_write_text(os.path.join(tmp, "index.json"), json.dumps(index, indent=1))
    return index


def _tail_as_validation(folder, dtype, splits, tokenizer_json, vocab_size):
    """Too few held-out documents (a corpus of a handful of documents): the held-out documents go back at
    the end of the training stream, and validation becomes the last max(5%, 2) tokens of it, which is cut
    there. Returns the new split counts and the validation token counts per id."""
    from tokenizers import Tokenizer
    train_file, val_file = os.path.join(folder, "train.bin"), os.path.join(folder, "val.bin")
    stream = np.concatenate([np.fromfile(train_file, dtype=dtype), np.fromfile(val_file, dtype=dtype)])
    offsets = np.concatenate([np.fromfile(os.path.join(folder, "train.docs.bin"), dtype=np.int64),
                              splits["train"]["tokens"] + np.fromfile(os.path.join(folder, "val.docs.bin"), dtype=np.int64)])
    n = len(stream)
    cut = n - max(n // 20, 2)
    stream[:cut].tofile(train_file)
    stream[cut:].tofile(val_file)
    np.zeros(1, np.int64).tofile(os.path.join(folder, "val.docs.bin"))
    offsets[offsets < cut].tofile(os.path.join(folder, "train.docs.bin"))
    tail = stream[cut:]
    val_bytes = len(Tokenizer.from_file(tokenizer_json).decode(tail.tolist(), skip_special_tokens=True).encode("utf-8"))
    total_bytes = splits["train"]["bytes"] + splits["val"]["bytes"]
    splits = {"train": {"tokens": cut, "documents": int((offsets < cut).sum()), "bytes": max(total_bytes - val_bytes, 0)},
              "val": {"tokens": len(tail), "documents": 1, "bytes": val_bytes}}
    return splits, np.bincount(tail, minlength=vocab_size)[:vocab_size]


def _entropy(counts):
    p = counts[counts > 0] / max(int(counts.sum()), 1)
    return float(-(p * np.log(p)).sum())


class TokenCache:
    """A prepared corpus opened for reading: `train` and `val` are read-only np.memmap token arrays
    (1-D, the index's dtype; empty arrays for an empty split), `index` the parsed index.json."""

    def __init__(self, path, index, arrays):
        self.path, self.index = path, index
        self.train, self.val = arrays["train"], arrays["val"]


def open_token_cache(path):
    """Open a prepared corpus; None when it is absent, or when index.json does not match the files (the
    caller rebuilds it)."""
    try:
        with open(os.path.join(path, "index.json"), encoding="utf-8") as f:
            index = json.load(f)
        dtype = np.dtype(index["dtype"])
        arrays = {}
        for s in SPLITS:
            n = index["splits"][s]["tokens"]
            file = os.path.join(path, f"{s}.bin")
            if index.get("format") != FORMAT_VERSION or os.path.getsize(file) != n * dtype.itemsize:
                return None
            if os.path.getsize(os.path.join(path, f"{s}.docs.bin")) != index["splits"][s]["documents"] * 8:
                return None
            arrays[s] = np.memmap(file, dtype=dtype, mode="r", shape=(n,)) if n else np.zeros(0, dtype)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return TokenCache(path, index, arrays)


def document_offsets(cache, split):
    """int64 [documents] start offsets of the split's documents in its token array (memory-mapped)."""
    n = cache.index["splits"][split]["documents"]
    file = os.path.join(cache.path, f"{split}.docs.bin")
    return np.memmap(file, dtype=np.int64, mode="r", shape=(n,)) if n else np.zeros(0, np.int64)
