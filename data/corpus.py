"""The default corpus: real English prose that every Python install carries.

It is the docstrings (module, class and function) of the standard library's `.py` files, read with `ast`
(no module is imported), joined into one document per module, plus the language reference topics of
`pydoc_data.topics` (one document per topic). On CPython 3.11.7 that is ~2.3 MB in 724 documents. The
build is deterministic (sorted walk), cached under `data/cache/`, and every 20th document goes to the
held-out validation split (688 train / 36 validation documents there).
"""
import ast
import hashlib
import json
import os
import sys
import sysconfig

from train.atomic import atomic_dir

CACHE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cache")
BUILDER_VERSION = 1  # bump when the extraction rules change, so old caches are not reused
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
VAL_EVERY = 20


def _module_docstrings(path):
    with open(path, "rb") as f:
        source = f.read()
    try:
        tree = ast.parse(source, filename=path)
    except (SyntaxError, ValueError):  # a few stdlib files are deliberately invalid (e.g. bad encodings)
        return []
    docs = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and doc.strip():
                docs.append(doc.strip())
    return docs


def pydoc_topics(stdlib):
    """[(topic, text)] of `pydoc_data.topics` (the language reference pages), sorted by topic; read with
    `ast`, not imported."""
    path = os.path.join(stdlib, "pydoc_data", "topics.py")
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        tree = ast.parse(f.read(), filename=path)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "topics" for t in node.targets):
            topics = ast.literal_eval(node.value)
            return [(k, topics[k].strip()) for k in sorted(topics) if topics[k].strip()]
    return []


def iter_documents():
    """Yield the corpus documents (str) in a fixed order: stdlib modules sorted by path, then topics."""
    stdlib = sysconfig.get_paths()["stdlib"]
    for dirpath, dirnames, filenames in os.walk(stdlib):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py"):
                docs = _module_docstrings(os.path.join(dirpath, name))
                if docs:
                    yield "\n\n".join(docs)
    yield from (text for _, text in pydoc_topics(stdlib))


def default_corpus(cache_dir=CACHE_DIR):
    """Build (once) and return {'train': path, 'val': path} of the default corpus as jsonl files.

    Each line is {"text": ...}, MiniMind's pretraining format, so the default corpus goes through the
    same loader as user data. The cache key is the Python version, the stdlib path and the builder
    version; both files are written into a temp folder that is renamed into place, so an interrupted
    build never leaves a partial cache.
    """
    key = hashlib.sha1(f"{sys.version}|{sysconfig.get_paths()['stdlib']}|{BUILDER_VERSION}".encode()).hexdigest()[:12]
    out = os.path.join(cache_dir, f"stdlib-docs-{key}")
    paths = {"train": os.path.join(out, "train.jsonl"), "val": os.path.join(out, "val.jsonl")}
    if all(os.path.exists(p) for p in paths.values()):
        return paths
    with atomic_dir(out) as tmp:  # both splits appear together or not at all
        with open(os.path.join(tmp, "train.jsonl"), "w", encoding="utf-8") as ftrain, \
                open(os.path.join(tmp, "val.jsonl"), "w", encoding="utf-8") as fval:
            for i, doc in enumerate(iter_documents()):
                f = fval if i % VAL_EVERY == VAL_EVERY - 1 else ftrain
                f.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
    return paths
