"""One entry point from "a data path or nothing" to (tokenizer, train tokens, val tokens), cached."""
import hashlib
import os

import numpy as np

from data.corpus import CACHE_DIR, default_corpus
from data.dataset import file_fingerprint, load_documents, split_documents, tokenize_documents
from data.dataset import DataError
from data.tokenizer import get_tokenizer
from train.atomic import atomic_file


def _texts(ds):
    return (t for t in ds["text"])


def prepare_data(data_path=None, tokenizer_dir=None, vocab_size=6400, cache_dir=CACHE_DIR, log=print):
    """Load or build everything the trainer needs.

    data_path None -> the embedded stdlib-docstring corpus (its own train/val files); otherwise a .jsonl or
    .txt file whose every 20th document is held out for validation. tokenizer_dir None -> a byte-level BPE
    of `vocab_size` trained on the training documents (cached by content); else that tokenizer is used.

    Returns dict(tokenizer, tokenizer_dir, train [int32 array], val [int32 array], source).
    Raises data.dataset.DataError for missing, empty or malformed files.
    """
    if data_path is None:
        paths = default_corpus(cache_dir)
        train_ds, val_ds = load_documents(paths["train"]), load_documents(paths["val"])
        fingerprint = file_fingerprint(paths["train"]) + file_fingerprint(paths["val"])
        source = "embedded corpus (Python stdlib docstrings + pydoc topics)"
    else:
        train_ds, val_ds = split_documents(load_documents(data_path))
        fingerprint = file_fingerprint(data_path) + os.path.splitext(data_path)[1].lower()  # .txt vs .jsonl parse
        source = data_path
    if tokenizer_dir is None:
        tokenizer, tokenizer_dir = get_tokenizer(lambda: _texts(train_ds), cache_dir, fingerprint, vocab_size)
    else:
        from transformers import AutoTokenizer
        if not os.path.exists(os.path.join(tokenizer_dir, "tokenizer.json")):
            raise DataError(f"{tokenizer_dir}: no tokenizer.json (a tokenizer folder saved by transformers is expected)")
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        if tokenizer.eos_token_id is None:
            raise DataError(f"{tokenizer_dir}: the tokenizer has no eos token to separate documents with")
    with open(os.path.join(tokenizer_dir, "tokenizer.json"), "rb") as f:
        tok_key = hashlib.sha1(f.read()).hexdigest()[:12]
    cache = os.path.join(cache_dir, f"tokens-{fingerprint}-{tok_key}.npz")
    if os.path.exists(cache):
        arrays = np.load(cache)
        train, val = arrays["train"], arrays["val"]
    else:
        train = tokenize_documents(train_ds, tokenizer, tokenizer.eos_token_id)
        val = tokenize_documents(val_ds, tokenizer, tokenizer.eos_token_id) if len(val_ds) else np.zeros(0, np.int32)
        if len(val) < len(train) // 100:  # too few documents to hold some out: use the stream's tail
            cut = len(train) - max(len(train) // 20, 2)
            train, val = train[:cut], train[cut:]
        with atomic_file(cache) as f:
            np.savez(f, train=train, val=val)
    log(f"data: {source}: {len(train_ds)} train / {len(val_ds)} val documents, "
        f"{len(train):,} train / {len(val):,} val tokens, tokenizer {tokenizer_dir} (vocab {len(tokenizer)})")
    return dict(tokenizer=tokenizer, tokenizer_dir=tokenizer_dir, train=train, val=val, source=source)
