"""Data: the embedded corpus, the tokenizer, user files and their errors, resumable batches.

    python scripts/test_data.py
"""
import json
import os
import tempfile
import unittest.mock

import numpy as np
import torch

from testlib import SHARED, Skip, run  # noqa: F401
from data.corpus import default_corpus
from data.dataset import DataError, WindowBatches, fixed_windows
from data.shards import entropy
from data.prepare import prepare_data
from data.sources import open_source
from data.tokenizer import SPECIAL_TOKENS, save_tokenizer, train_tokenizer


def texts(path, **kw):
    return [t for t, _ in open_source(path, **kw).documents()]


def quiet_prepare(path, cache_dir, **kw):
    return prepare_data(path, vocab_size=300, cache_dir=cache_dir, log=lambda *_: None, **kw)


def _write(path, text, mode="w"):
    with open(path, mode) as f:
        f.write(text)
    return path


def test_default_corpus_is_deterministic_real_prose():
    """The default corpus (the run's shared build) is real prose from every DOC_PACKAGE, split without leaks;
    two builds give the same bytes: checked on every 8th source file (the same walk, parse and split code;
    a second full build would cost as much as the first), with one parsing process against two."""
    import data.corpus as corpus
    pa = default_corpus()
    all_files = corpus.py_files
    with tempfile.TemporaryDirectory() as b, tempfile.TemporaryDirectory() as c:
        corpus.py_files = lambda root: list(all_files(root))[::8]
        try:
            builds = [default_corpus(b)]
            with unittest.mock.patch("os.cpu_count", return_value=1):
                builds.append(default_corpus(c))
        finally:
            corpus.py_files = all_files
        for split in ("train", "val"):
            with open(builds[0][split], "rb") as fa, open(builds[1][split], "rb") as fb:
                assert fa.read() == fb.read(), f"{split} differs between two builds"
            assert os.path.getsize(builds[0][split]) > 0, split
        docs = {s: [json.loads(l)["text"] for l in open(pa[s], encoding="utf-8")] for s in pa}
    size = sum(len(d) for s in docs for d in docs[s])
    assert 15_000_000 < size < 40_000_000, f"corpus is {size} chars"  # stdlib + DOC_PACKAGES docstrings
    assert 0.03 < len(docs["val"]) / (len(docs["train"]) + len(docs["val"])) < 0.08
    text = " ".join(docs["train"])
    for word in ("Return the", "function", "argument", "string", "tensor", "DataFrame", "tokenizer"):
        assert word in text, f"{word!r} not in corpus"
    # every docstring once: no held-out paragraph is a training one (the held-out split is unseen text)
    train_paras = {p for d in docs["train"] for p in d.split("\n\n")}
    val_paras = [p for d in docs["val"] for p in d.split("\n\n") if len(p) > 200]
    assert sum(p in train_paras for p in val_paras) < 0.02 * len(val_paras), "held-out text repeats training text"
    assert [n for n, _, _ in corpus.package_dirs()] == list(corpus.DOC_PACKAGES), corpus.package_dirs()
    original = corpus.package_dirs  # another version of a package is another corpus (another cache folder)
    with tempfile.TemporaryDirectory() as c:
        folder = os.path.dirname(corpus.build_splits(c, "x", 1, iter(()))["train"])
        corpus.package_dirs = lambda: [(n, v + ".other", f) for n, v, f in original()]
        try:
            assert os.path.dirname(corpus.build_splits(c, "x", 1, iter(()))["train"]) != folder
        finally:
            corpus.package_dirs = original


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
    from data.tokenizer import token_byte_lengths
    text = "Hello, wörld! 🙂 中文 \t tabs <|endoftext|> and more"
    ids = loaded(text, add_special_tokens=False)["input_ids"]  # bytes per token: exact, specials count 0
    assert int(token_byte_lengths(loaded)[ids].sum()) == len(text.encode("utf-8")) - len("<|endoftext|>")
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
        assert texts(j) == ["first doc", "second"]
        t = _write(os.path.join(d, "b.txt"), "para one\nline two\n\npara two\n\n\n")
        assert [s.strip() for s in texts(t)] == ["para one\nline two", "para two"]


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
            "late.jsonl": ('{"text": "ok"}\n' * 5000 + '{"text": 3}\n' + '{"text": "ok"}\n' * 10,
                           'late.jsonl:5001: "text" must be a string'),
        }
        for name, (content, msg) in cases.items():
            path = os.path.join(d, name)
            if content is not None:
                _write(path, content, "wb" if isinstance(content, bytes) else "w")
            try:
                quiet_prepare(path, os.path.join(d, "cache"))
            except DataError as e:
                assert msg in str(e) and name in str(e), f"{name}: {e}"
            else:
                raise AssertionError(f"{name}: accepted")
        leftovers = [n for n in os.listdir(os.path.join(d, "cache")) if n.startswith("tokens-") or ".tmp" in n]
        assert not leftovers, f"a failed preparation left {leftovers} in the cache"


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
    assert abs(entropy(np.bincount([0, 1, 2, 3])) - np.log(4)) < 1e-12  # (the unigram entropy of token counts)
    assert entropy(np.bincount([7, 7, 7])) == 0.0


def _corpus_docs(n=600, seed=0):
    """n English-like documents of 0-120 words (some empty), from tinyshakespeare or the embedded corpus."""
    import random
    src = os.path.join(SHARED, "data", "tinyshakespeare.txt")
    text = open(src, encoding="utf-8").read() if os.path.exists(src) else open(default_corpus()["train"]).read()
    words = text.split()[:50_000]
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(0, 120))) for _ in range(n)]


def _jsonl(path, docs, field="text"):
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({field: d, "id": 1}) + "\n")
    return path


def _tokens(data):
    return np.asarray(data["train"]).copy(), np.asarray(data["val"]).copy()


def test_parallel_preparation_equals_in_process():
    """The same corpus tokenized in 2 worker processes and in this process: identical token caches (small
    batches, so the workers' results arrive out of order and must be put back in order)."""
    import data.shards
    data.shards.BATCH_BYTES, old = 8_000, data.shards.BATCH_BYTES
    with tempfile.TemporaryDirectory() as d:
        path = _jsonl(os.path.join(d, "c.jsonl"), _corpus_docs(800))
        a = quiet_prepare(path, os.path.join(d, "c0"), workers=0)
        b = quiet_prepare(path, os.path.join(d, "c2"), workers=2)
        assert all(np.array_equal(x, y) for x, y in zip(_tokens(a), _tokens(b)))
        assert a["index"]["splits"] == b["index"]["splits"] and a["train"].dtype == np.uint16
        assert isinstance(a["train"], np.memmap), "training tokens should be memory-mapped, not in RAM"
        n_docs = sum(1 for t in _corpus_docs(800) if t.strip())
        assert a["index"]["splits"]["val"]["documents"] == n_docs // 20
    data.shards.BATCH_BYTES = old


def test_formats_give_the_same_documents():
    """One corpus as jsonl, .json array, parquet, a directory of jsonl shards, a glob, a save_to_disk folder,
    hf:<local folder> and jsonl with --text_field body: every one gives the same token stream."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    docs = [t for t in _corpus_docs(300) if t.strip()]
    with tempfile.TemporaryDirectory() as d:
        cache = os.path.join(d, "cache")
        ref = quiet_prepare(_jsonl(os.path.join(d, "ref.jsonl"), docs), cache)
        tok = ref["tokenizer_dir"]
        os.makedirs(os.path.join(d, "shards", "sub"))
        _jsonl(os.path.join(d, "shards", "a.jsonl"), docs[:100])
        _jsonl(os.path.join(d, "shards", "sub", "b.jsonl"), docs[100:])  # sorted by path: a, sub/b
        with open(os.path.join(d, "arr.json"), "w") as f:
            json.dump([{"text": t} for t in docs], f)
        pq.write_table(pa.table({"text": docs[:150]}), os.path.join(d, "p1.parquet"), row_group_size=40)
        pq.write_table(pa.table({"text": docs[150:]}), os.path.join(d, "p2.parquet"))
        datasets.Dataset.from_dict({"text": docs}).save_to_disk(os.path.join(d, "saved"))
        os.makedirs(os.path.join(d, "hub"))
        pq.write_table(pa.table({"text": docs}), os.path.join(d, "hub", "train.parquet"))
        cases = {"dir": os.path.join(d, "shards"), "json array": os.path.join(d, "arr.json"),
                 "glob": os.path.join(d, "p*.parquet"), "save_to_disk": os.path.join(d, "saved"),
                 "hf: local folder": "hf:" + os.path.join(d, "hub"),
                 "text_field": (_jsonl(os.path.join(d, "body.jsonl"), docs, field="body"), "body")}
        for name, path in cases.items():
            path, field = path if isinstance(path, tuple) else (path, "text")
            got = quiet_prepare(path, cache, tokenizer_dir=tok, text_field=field)
            assert all(np.array_equal(x, y) for x, y in zip(_tokens(got), _tokens(ref))), name
        try:
            quiet_prepare(os.path.join(d, "body.jsonl"), cache, tokenizer_dir=tok)
        except DataError as e:
            assert "body.jsonl:1" in str(e) and "--text_field" in str(e), e
        else:
            raise AssertionError("a missing text field was accepted")


def test_malformed_line_near_the_end_leaves_nothing_in_the_cache():
    """A bad line at the end of a corpus stops the token pass with file:line; no token cache, no temp."""
    with tempfile.TemporaryDirectory() as d:
        cache = os.path.join(d, "cache")
        good = quiet_prepare(_jsonl(os.path.join(d, "good.jsonl"), _corpus_docs(200)), cache)
        path = _jsonl(os.path.join(d, "bad.jsonl"), _corpus_docs(3000))
        with open(path, "a") as f:
            f.write('{"text": "fine"}\n{"text": "cut off\n')
        before = set(os.listdir(cache))
        for workers in (0, 2):
            try:
                quiet_prepare(path, cache, tokenizer_dir=good["tokenizer_dir"], workers=workers)
            except DataError as e:
                assert "bad.jsonl:3002: malformed JSON" in str(e), e
            else:
                raise AssertionError("malformed line accepted")
            new = set(os.listdir(cache)) - before
            assert all(n.startswith(".prepare-") for n in new), f"left behind: {new}"


def test_damaged_cache_is_rebuilt_with_a_message():
    with tempfile.TemporaryDirectory() as d:
        cache, path = os.path.join(d, "cache"), _jsonl(os.path.join(d, "c.jsonl"), _corpus_docs(300))
        first = _tokens(quiet_prepare(path, cache))
        folder = [n for n in os.listdir(cache) if n.startswith("tokens-")][0]
        with open(os.path.join(cache, folder, "train.bin"), "r+b") as f:
            f.truncate(100)
        said = []
        again = prepare_data(path, vocab_size=300, cache_dir=cache, log=said.append)
        assert any("does not match its index" in s for s in said), said
        assert all(np.array_equal(x, y) for x, y in zip(_tokens(again), first))


def test_two_processes_prepare_one_corpus_at_once():
    """Started together on a new corpus: both succeed with the same tokens, and one cache is written."""
    import subprocess
    import sys
    with tempfile.TemporaryDirectory() as d:
        cache, path = os.path.join(d, "cache"), _jsonl(os.path.join(d, "c.jsonl"), _corpus_docs(1500))
        code = ("import sys, numpy as np; sys.path.insert(0, sys.argv[1]); from data.prepare import prepare_data; "
                "x = prepare_data(sys.argv[2], vocab_size=300, cache_dir=sys.argv[3], log=lambda *_: None); "
                "np.save(sys.argv[4], np.asarray(x['train']))")
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        procs = [subprocess.Popen([sys.executable, "-c", code, root, path, cache, os.path.join(d, f"out{i}.npy")],
                                  stderr=subprocess.PIPE, text=True) for i in range(2)]
        errs = [p.communicate(timeout=300)[1] for p in procs]
        assert all(p.returncode == 0 for p in procs), errs
        assert np.array_equal(np.load(os.path.join(d, "out0.npy")), np.load(os.path.join(d, "out1.npy")))
        assert len([n for n in os.listdir(cache) if n.startswith("tokens-")]) == 1
        assert len([n for n in os.listdir(cache) if n.startswith("tokenizer-")]) == 1


def test_tokenizer_trained_on_a_bounded_sample():
    """With a sample smaller than the corpus, a word that occurs only after the sample gets no token of its
    own; with the whole corpus as sample it does."""
    docs = _corpus_docs(400) + ["zyxwvutsrq " * 200] * 40
    with tempfile.TemporaryDirectory() as d:
        path = _jsonl(os.path.join(d, "c.jsonl"), docs)
        small = quiet_prepare(path, os.path.join(d, "a"), tokenizer_sample_mb=0.05)["tokenizer"]
        full = quiet_prepare(path, os.path.join(d, "b"), tokenizer_sample_mb=32)["tokenizer"]
        assert len(full.tokenize("zyxwvutsrq")) == 1 and len(small.tokenize("zyxwvutsrq")) > 1


def test_memmap_windows_equal_in_memory_windows():
    with tempfile.TemporaryDirectory() as d:
        tokens = (np.arange(5000) * 7 % 6400).astype(np.uint16)
        tokens.tofile(os.path.join(d, "t.bin"))
        mm = np.memmap(os.path.join(d, "t.bin"), dtype=np.uint16, mode="r")
        a, b = WindowBatches(mm, 32, 6, seed=1), WindowBatches(tokens.astype(np.int64), 32, 6, seed=1)
        for _ in range(40):
            (xa, ya), (xb, yb) = a.next(), b.next()
            assert xa.dtype == torch.int64 and torch.equal(xa, xb) and torch.equal(ya, yb)


def test_odd_inputs_an_adversary_tried():
    """A BOM, bare-CR line ends, files sorted by full path, a corpus of two documents (validation from the
    tail, never empty), hf:<local folder> noticing an edit, a bad line in an hf: folder and a damaged
    parquet page: each works or is one DataError naming the input."""
    import datasets  # noqa: F401
    with tempfile.TemporaryDirectory() as d:
        bom = os.path.join(d, "bom.jsonl")
        open(bom, "wb").write(b'\xef\xbb\xbf{"text": "first"}\n{"text": "second"}\n')
        assert texts(bom) == ["first", "second"]
        mac = _write(os.path.join(d, "mac.txt"), "one\rline\r\rtwo\r")
        assert texts(mac) == ["one\nline", "two\n"]
        odd = ["a\u2028b", "c\u0085d\u2029e", "f\x0cg\x1ch\x0bi"]  # raw, as json.dumps(ensure_ascii=False) writes
        for ends in ("\r\n", "\r", "\n"):
            crlf = os.path.join(d, "odd.jsonl")
            with open(crlf, "w", newline=ends) as f:
                f.writelines(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in odd)
            assert texts(crlf) == odd, ends
            txt = _write(os.path.join(d, "odd.txt"), "\n\n".join(odd).replace("\n", ends))
            assert texts(txt) == odd, ends
        from data.sources import file_sha1
        memo, same = {}, _write(os.path.join(d, "same.txt"), "aaaa")
        first, st = file_sha1(same, memo), os.stat(same)
        _write(same, "bbbb")  # same size, and the same mtime put back: the memo must still see the change
        os.utime(same, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert file_sha1(same, memo) != first, "a rewritten file kept its remembered hash"
        nested = os.path.join(d, "nested")
        os.makedirs(nested)
        _jsonl(os.path.join(nested, "a.jsonl"), ["doc"])
        datasets.Dataset.from_dict({"text": ["x"]}).save_to_disk(os.path.join(nested, "saved"))
        try:
            open_source(nested)
        except DataError as e:
            assert "saved: a datasets.save_to_disk folder inside" in str(e), e
        else:
            raise AssertionError("a save_to_disk folder inside a data folder was read as JSON files")
        os.makedirs(os.path.join(d, "tree", "a"))
        _jsonl(os.path.join(d, "tree", "b.jsonl"), ["from b"])
        _jsonl(os.path.join(d, "tree", "a", "z.jsonl"), ["from a/z"])
        _jsonl(os.path.join(d, "tree", "c.jsonl"), ["from c"])
        assert texts(os.path.join(d, "tree")) == ["from a/z", "from b", "from c"]
        two = _jsonl(os.path.join(d, "two.jsonl"), ["alpha beta gamma delta " * 5, "epsilon zeta eta " * 5])
        data = quiet_prepare(two, os.path.join(d, "c1"))
        assert len(data["val"]) >= 2 and data["index"]["splits"]["val"]["tokens"] == len(data["val"])
        assert len(data["train"]) + len(data["val"]) == sum(data["index"]["splits"][s]["tokens"] for s in ("train", "val"))
        hub = os.path.join(d, "hub")
        os.makedirs(hub)
        _jsonl(os.path.join(hub, "train.jsonl"), _corpus_docs(60))
        first = quiet_prepare("hf:" + hub, os.path.join(d, "c2"))["index"]["splits"]["train"]["documents"]
        _jsonl(os.path.join(hub, "train.jsonl"), _corpus_docs(30))
        again = quiet_prepare("hf:" + hub, os.path.join(d, "c2"))["index"]["splits"]["train"]["documents"]
        assert again < first, (first, again)
        with open(os.path.join(hub, "train.jsonl"), "a") as f:
            f.write('{"text": broken\n')
        for bad, name in (("hf:" + hub, "hf:"), (_damaged_parquet(d), "damaged.parquet")):
            try:
                quiet_prepare(bad, os.path.join(d, "c3"))
            except DataError as e:
                assert name in str(e), e
            else:
                raise AssertionError(f"{bad} accepted")


def test_long_whitespace_free_document_prepares():
    """A 2 MB line without a space (base64-like letters): BPE training on it was quadratic in the word's length
    (hours); the trainer now sees words of at most LONGEST_WORD characters, and the document still tokenizes
    (linearly) and decodes back exactly. (A stall guard: a minute, where it used to be over 15.)"""
    import time
    from data.tokenizer import LONGEST_WORD, bounded_words
    import re
    long = "".join(chr(97 + (i * 7919) % 26) for i in range(2 << 20))
    assert all(len(w) <= LONGEST_WORD for t in bounded_words(["a b", long]) for w in re.findall(r"\S+", t))
    with tempfile.TemporaryDirectory() as d:
        path = _jsonl(os.path.join(d, "long.jsonl"), _corpus_docs(40) + [long] + _corpus_docs(40, seed=1))
        t0 = time.time()
        data = quiet_prepare(path, os.path.join(d, "cache"))
        assert time.time() - t0 < 60, f"preparing a 2 MB whitespace-free document took {time.time() - t0:.0f} s"
        ids = data["tokenizer"](long, add_special_tokens=False)["input_ids"]
        assert data["tokenizer"].decode(ids) == long


def _damaged_parquet(d):
    import pyarrow as pa
    import pyarrow.parquet as pq
    path = os.path.join(d, "damaged.parquet")
    pq.write_table(pa.table({"text": _corpus_docs(400)}), path, row_group_size=100, compression="snappy")
    blob = bytearray(open(path, "rb").read())
    for i in range(len(blob) // 3, len(blob) // 3 + 2000):
        blob[i] ^= 0x5A
    open(path, "wb").write(bytes(blob))
    return path


def test_killed_preparation_leaves_no_orphan_and_no_partial_cache():
    """kill -9 of a process preparing with 2 workers: its workers die with it (they inherited the cache
    lock), and the next preparation neither waits forever nor leaves the partial temp folder behind."""
    import signal
    import subprocess
    import sys
    import time
    with tempfile.TemporaryDirectory() as d:
        path, cache = _jsonl(os.path.join(d, "c.jsonl"), _corpus_docs(6000)), os.path.join(d, "cache")
        tok = quiet_prepare(_jsonl(os.path.join(d, "small.jsonl"), _corpus_docs(100)), cache)["tokenizer_dir"]
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        code = ("import sys; sys.path.insert(0, sys.argv[1]); import data.shards as s; s.BATCH_BYTES = 20000; "
                "import time; from data.prepare import prepare_data; "
                "prepare_data(sys.argv[2], tokenizer_dir=sys.argv[3], cache_dir=sys.argv[4], workers=2, log=print)")
        proc = subprocess.Popen([sys.executable, "-c", code, root, path, tok, cache], stdout=subprocess.PIPE, text=True)
        deadline = time.time() + 120
        while time.time() < deadline and not [n for n in os.listdir(cache) if n.startswith(".tokens-")]:
            time.sleep(0.05)
        assert [n for n in os.listdir(cache) if n.startswith(".tokens-")], "the build never started"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        time.sleep(1.0)
        r = subprocess.run([sys.executable, "-c", code, root, path, tok, cache], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        assert not [n for n in os.listdir(cache) if ".tmp" in n], os.listdir(cache)


TESTS = [test_default_corpus_is_deterministic_real_prose, test_tokenizer_roundtrip_and_autotokenizer,
         test_user_files_jsonl_and_txt, test_bad_files_name_file_and_line, test_window_batches_resume_exactly,
         test_fixed_windows_and_entropy, test_parallel_preparation_equals_in_process,
         test_formats_give_the_same_documents, test_malformed_line_near_the_end_leaves_nothing_in_the_cache,
         test_damaged_cache_is_rebuilt_with_a_message, test_two_processes_prepare_one_corpus_at_once,
         test_tokenizer_trained_on_a_bounded_sample, test_memmap_windows_equal_in_memory_windows,
         test_odd_inputs_an_adversary_tried, test_long_whitespace_free_document_prepares,
         test_killed_preparation_leaves_no_orphan_and_no_partial_cache]

if __name__ == "__main__":
    run(TESTS)
