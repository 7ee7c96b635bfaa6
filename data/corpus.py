"""The default corpus, real English prose every Python install carries: the docstrings of the standard library's
`.py` files (read with `ast`, nothing imported), one document per module, plus one per `pydoc_data.topics`
topic: a few MB. Deterministic (sorted walk), cached under CACHE_DIR; every VAL_EVERY-th document is validation.

CACHE_DIR, where everything derived from a corpus is cached: `data/cache/`, or $MINIMIND_CACHE_DIR (read at import).
"""
import ast
import contextlib
import hashlib
import json
import os
import sys
import sysconfig

from data.atomic import atomic_dir

CACHE_DIR = os.path.abspath(os.environ.get("MINIMIND_CACHE_DIR")
                            or os.path.join(os.path.dirname(os.path.abspath(__file__)), "cache"))
BUILDER_VERSION = 1  # bump when the extraction rules change, so old caches are not reused
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
VAL_EVERY = 20


def stdlib_modules(skip_dirs):
    """Paths of the standard library's .py files in a fixed order (sorted walk), `skip_dirs` left out."""
    for dirpath, dirnames, filenames in os.walk(sysconfig.get_paths()["stdlib"]):
        dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs)
        yield from (os.path.join(dirpath, name) for name in sorted(filenames) if name.endswith(".py"))


def parse_module(path):
    """The `ast` of a .py file, or None (a few stdlib files are deliberately invalid, e.g. bad encodings)."""
    try:
        with open(path, "rb") as f:
            return ast.parse(f.read(), filename=path)
    except (SyntaxError, ValueError):
        return None


def pydoc_topics(stdlib):
    """[(topic, text)] of `pydoc_data.topics` (the language reference pages), sorted by topic; read with `ast`."""
    path = os.path.join(stdlib, "pydoc_data", "topics.py")
    tree = parse_module(path) if os.path.exists(path) else None
    for node in tree.body if tree else []:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "topics" for t in node.targets):
            topics = ast.literal_eval(node.value)
            return [(k, topics[k].strip()) for k in sorted(topics) if topics[k].strip()]
    return []


def iter_documents():
    """Yield the corpus documents (str) in a fixed order: stdlib modules sorted by path, then topics."""
    documented = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    for path in stdlib_modules(_SKIP_DIRS):
        tree = parse_module(path)
        docs = [ast.get_docstring(n, clean=True) for n in (ast.walk(tree) if tree else ()) if isinstance(n, documented)]
        docs = [d.strip() for d in docs if d and d.strip()]
        if docs:
            yield "\n\n".join(docs)
    yield from (text for _, text in pydoc_topics(sysconfig.get_paths()["stdlib"]))


def build_splits(cache_dir, name, version, records):
    """Build (once, atomically) and return {'train': path, 'val': path}: jsonl files in `cache_dir/<name>-<key>/`,
    a line per (split, object) of the iterator `records`; key: Python version, stdlib path and `version`."""
    key = hashlib.sha1(f"{sys.version}|{sysconfig.get_paths()['stdlib']}|{version}".encode()).hexdigest()[:12]
    out = os.path.join(cache_dir, f"{name}-{key}")
    paths = {s: os.path.join(out, f"{s}.jsonl") for s in ("train", "val")}
    if all(os.path.exists(p) for p in paths.values()):
        return paths
    with atomic_dir(out) as tmp, contextlib.ExitStack() as files:  # both splits appear together or not at all
        f = {s: files.enter_context(open(os.path.join(tmp, f"{s}.jsonl"), "w", encoding="utf-8")) for s in paths}
        for split, obj in records:
            f[split].write(json.dumps(obj, ensure_ascii=False) + "\n")
    return paths


def default_corpus(cache_dir=CACHE_DIR):
    """{'train': path, 'val': path} of the default corpus: jsonl of {"text": ...} (MiniMind's pretraining format)."""
    return build_splits(cache_dir, "stdlib-docs", BUILDER_VERSION, (
        ("val" if i % VAL_EVERY == VAL_EVERY - 1 else "train", {"text": doc}) for i, doc in enumerate(iter_documents())))
