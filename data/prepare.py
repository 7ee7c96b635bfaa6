"""One entry point from "a data path or nothing" to (tokenizer, train tokens, val tokens), cached on disk:
source (data/sources.py) -> tokenizer (given, or a BPE trained on a bounded sample) -> token cache (data/shards.py).

Cached by content under CACHE_DIR (data/corpus.py): the tokenizer by source fingerprint, vocab size and sample
size; the token cache by source and tokenizer hashes. One process at a time prepares a corpus (a file lock).
"""
import contextlib
import glob
import hashlib
import json
import os
import shutil
import sys
import time

from data.corpus import CACHE_DIR, VAL_EVERY, default_corpus  # VAL_EVERY: also every 20th user document is held out
from data.shards import build_token_cache, open_token_cache
from data.sources import DataError, DocumentSource, file_sha1, open_source  # noqa: F401  (DataError: re-exported)
from data.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer
from data.atomic import atomic_write_text, file_lock

TOKENIZER_SAMPLE_MB = 16  # the BPE is trained on the first this-many MB of training documents (see README)
PARALLEL_FROM_BYTES = 32 << 20  # below this a process pool costs more to start than it saves


def prepare_data(data_path=None, tokenizer_dir=None, vocab_size=None, cache_dir=CACHE_DIR, log=print,
                 text_field="text", tokenizer_sample_mb=TOKENIZER_SAMPLE_MB, workers=None, progress=False):
    """Load or build everything training needs. data_path None: the embedded stdlib-docstring corpus; else
    anything data/sources.py reads, every VAL_EVERY-th document held out. tokenizer_dir None: a `vocab_size` BPE
    trained on the first `tokenizer_sample_mb` MB of training documents. workers: tokenization processes (None:
    one per core, at most 8, over PARALLEL_FROM_BYTES, else 0 = in process). Raises ValueError without
    tokenizer_dir and vocab_size. Returns dict(tokenizer, tokenizer_dir, train, val (1-D read-only np.memmap of
    ids), index (the cache's index.json), source (description)). Raises DataError for missing, empty or
    malformed input (file and line)."""
    if tokenizer_dir is None and vocab_size is None:
        raise ValueError("prepare_data: a vocab_size is needed to train a tokenizer "
                         "(the trainer's is model/config.py's)")
    os.makedirs(cache_dir, exist_ok=True)
    if data_path is None:  # the default corpus comes split in two files; a user corpus is one source
        paths = default_corpus(cache_dir)
        source = DocumentSource("embedded corpus (docstrings of the stdlib and of the installed torch, transformers, "
                                "sympy, pandas, numpy)", files=(paths["train"],))
        val_source = DocumentSource("embedded corpus, validation", files=(paths["val"],))
    else:
        source, val_source = open_source(data_path, text_field), None
    if next(iter(source.documents()), None) is None:
        raise DataError(f"{source.description}: contains no text")
    memo = _load_memo(cache_dir)  # file hashes by path, size, mtime, inode, ctime: a warm start reads no corpus
    fingerprint = source.fingerprint(memo)
    if val_source is not None:
        fingerprint = hashlib.sha1((fingerprint + val_source.fingerprint(memo)).encode()).hexdigest()[:16]
    _save_memo(cache_dir, memo)
    with file_lock(os.path.join(cache_dir, f".prepare-{fingerprint}.lock"),
                   lambda: log("waiting for another process preparing the same corpus...")):
        trained = tokenizer_dir is None
        tokenizer, tokenizer_dir = _tokenizer(source, val_source, tokenizer_dir, vocab_size, tokenizer_sample_mb,
                                              fingerprint, cache_dir, log)
        try:
            cache = _token_cache(source, val_source, tokenizer, tokenizer_dir, fingerprint, cache_dir, workers,
                                 progress, log)
        except DataError:  # a bad line after the tokenizer's sample: nothing of this corpus stays in the cache
            if trained:
                shutil.rmtree(tokenizer_dir, ignore_errors=True)
            raise
    splits = cache.index["splits"]
    log(f"data: {source.description}: {splits['train']['documents']:,} train / {splits['val']['documents']:,} val "
        f"documents, {splits['train']['tokens']:,} train / {splits['val']['tokens']:,} val tokens, tokenizer "
        f"{tokenizer_dir} (vocab {len(tokenizer)})")
    if "last" in cache.index.get("split_rule", ""):
        log(f"note: {cache.index['split_rule']}")
    return dict(tokenizer=tokenizer, tokenizer_dir=tokenizer_dir, train=cache.train, val=cache.val,
                index=cache.index, source=source.description)


def split_documents(source, val_source):
    """(split, text, where) per document: val_source's are "val"; without one, every VAL_EVERY-th of source."""
    for i, (text, where) in enumerate(source.documents()):
        yield ("val" if val_source is None and i % VAL_EVERY == VAL_EVERY - 1 else "train"), text, where
    if val_source is not None:
        for text, where in val_source.documents():
            yield "val", text, where


def _training_sample(source, val_source, max_bytes):
    """The first training documents, up to max_bytes of text (the tokenizer's training sample)."""
    size = 0
    for split, text, _ in split_documents(source, val_source):
        if split == "train":
            yield text
            size += len(text)
            if size >= max_bytes:
                return


def _tokenizer(source, val_source, tokenizer_dir, vocab_size, sample_mb, fingerprint, cache_dir, log):
    if tokenizer_dir is not None:
        if not os.path.exists(os.path.join(tokenizer_dir, "tokenizer.json")):
            raise DataError(f"{tokenizer_dir}: no tokenizer.json "
                            "(a tokenizer folder saved by transformers is expected)")
        tokenizer = load_tokenizer(tokenizer_dir)
        if tokenizer.eos_token_id is None:
            raise DataError(f"{tokenizer_dir}: the tokenizer has no eos token to separate documents with")
        return tokenizer, tokenizer_dir
    path = _cache_entry(cache_dir, "tokenizer", f"{fingerprint}|{vocab_size}|{sample_mb}", 12)
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        try:
            return load_tokenizer(path), path
        except DataError as e:
            log(f"note: the cached tokenizer is damaged ({e}): training it again")
    t0 = time.time()
    save_tokenizer(train_tokenizer(_training_sample(source, val_source, int(sample_mb * (1 << 20))), vocab_size), path)
    log(f"tokenizer: a {vocab_size}-token BPE trained on the first {sample_mb} MB of training documents "
        f"in {time.time() - t0:.1f} s")
    return load_tokenizer(path), path


def _token_cache(source, val_source, tokenizer, tokenizer_dir, fingerprint, cache_dir, workers, progress, log):
    tokenizer_json = os.path.join(tokenizer_dir, "tokenizer.json")
    tok_sha1 = file_sha1(tokenizer_json)
    path = _cache_entry(cache_dir, "tokens", f"{fingerprint}|{tok_sha1}|{VAL_EVERY}|{val_source is not None}", 16)
    cache = open_token_cache(path)
    if cache is not None:
        return cache
    if os.path.exists(path):
        log(f"note: the token cache {path} does not match its index (damaged?): rebuilding it")
    total = source.total_bytes + (val_source.total_bytes if val_source else 0)
    if workers is None:
        workers = min(os.cpu_count() or 1, 8) if total > PARALLEL_FROM_BYTES else 0
    meta = {"source": source.description, "source_fingerprint": fingerprint, "tokenizer_sha1": tok_sha1,
            "split_rule": "given validation files" if val_source else f"every {VAL_EVERY}th document is validation"}
    t0 = time.time()
    with _progress_bar(total) if progress and total > PARALLEL_FROM_BYTES else contextlib.nullcontext() as bar:
        index = build_token_cache(path, split_documents(source, val_source), tokenizer_json, tokenizer.eos_token_id,
                                  len(tokenizer), meta, workers, bar.update if bar is not None else None)
    seconds = time.time() - t0
    log(f"tokenized {total / 1e6:,.1f} MB in {seconds:.1f} s ({total / 1e6 / max(seconds, 1e-9):.1f} MB/s, "
        f"{max(workers, 1)} process{'es' if workers > 1 else ''})")
    return open_token_cache(path)


def _cache_entry(cache_dir, kind, key, chars):
    """cache_dir/<kind>-<`chars` hex digits of sha1(key)>, with an interrupted build's temps (.<name>.tmp... /
    .old..., data/atomic.py) removed; called under the corpus's lock, so no live build owns them."""
    name = f"{kind}-{hashlib.sha1(key.encode()).hexdigest()[:chars]}"
    for leftover in (glob.glob(os.path.join(cache_dir, f".{name}.tmp*"))
                     + glob.glob(os.path.join(cache_dir, f".{name}.old*"))):
        shutil.rmtree(leftover, ignore_errors=True) if os.path.isdir(leftover) else os.remove(leftover)
    return os.path.join(cache_dir, name)


def _progress_bar(total_bytes):
    from tqdm import tqdm
    return tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing", file=sys.stderr, smoothing=0.1)


def _load_memo(cache_dir):
    try:
        with open(os.path.join(cache_dir, "fingerprints.json"), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _save_memo(cache_dir, memo):
    memo = {k: v for k, v in memo.items() if os.path.exists(k.split("|")[0])}  # forget deleted files
    try:
        atomic_write_text(os.path.join(cache_dir, "fingerprints.json"), json.dumps(memo, indent=0))
    except OSError:  # a read-only cache still works, it only hashes again next time
        pass
