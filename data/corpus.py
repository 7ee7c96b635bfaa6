"""The default corpus, real English prose every install of this repo carries: the docstrings of the standard
library's `.py` files and of the biggest packages requirements.txt installs (DOC_PACKAGES, versions pinned
there, so the corpus is the same wherever they are), read with `ast` (nothing imported), one document per
module, each long paragraph once (transformers repeats its argument docs per model); plus one document per
`pydoc_data.topics` topic: about 25 MB, so the main job sees each token about once. Deterministic (sorted
walks), cached under CACHE_DIR; every VAL_EVERY-th document is validation.

CACHE_DIR, where everything derived from a corpus is cached: `data/cache/`, or $MINIMIND_CACHE_DIR (read at import).
"""
import ast
import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import sys
import sysconfig

from data.atomic import atomic_dir, file_lock

CACHE_DIR = os.path.abspath(os.environ.get("MINIMIND_CACHE_DIR")
                            or os.path.join(os.path.dirname(os.path.abspath(__file__)), "cache"))
BUILDER_VERSION = 3  # bump when the extraction rules change, so old caches are not reused
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "testing", "idle_test", "__pycache__"}
DOC_PACKAGES = ("transformers", "torch", "sympy", "pandas", "numpy")  # ~9, 5, 5, 3, 1.6 MB of docstrings
SHORTEST_REPEAT = 80  # paragraphs this long are kept once (shorter ones, "Args:", "Example::", repeat)
VAL_EVERY = 20


def py_files(root, skip_dirs=_SKIP_DIRS):
    """Paths of the .py files under root in a fixed order (sorted walk), `skip_dirs` left out."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs)
        yield from (os.path.join(dirpath, name) for name in sorted(filenames) if name.endswith(".py"))


def package_dirs():
    """[(name, version, folder)] of the DOC_PACKAGES installed here (found without importing them)."""
    out = []
    for name in DOC_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            out.append((name, importlib.metadata.version(name), list(spec.submodule_search_locations)[0]))
    return out


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


def module_docstrings(path):
    """The non-empty docstrings (module, classes, functions; cleaned) of a .py file, in `ast.walk` order."""
    tree = parse_module(path)
    documented = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    docs = [ast.get_docstring(n, clean=True) for n in (ast.walk(tree) if tree else ()) if isinstance(n, documented)]
    return [d.strip() for d in docs if d and d.strip()]


def iter_documents():
    """Yield the corpus documents (str) in a fixed order: stdlib modules sorted by path, each DOC_PACKAGES
    package's modules, then the topics. A paragraph of SHORTEST_REPEAT characters or more seen before
    (anywhere: transformers repeats its argument docs per model) is left out. The files are parsed
    by one process per core (in order: the result does not depend on the count)."""
    import multiprocessing
    seen = set()
    roots = [sysconfig.get_paths()["stdlib"]] + [folder for _, _, folder in package_dirs()]
    paths = [p for root in roots for p in py_files(root)]
    method = "fork" if sys.platform.startswith("linux") else "spawn"  # (as data/shards.py: a spawned worker
    with multiprocessing.get_context(method).Pool(min(os.cpu_count() or 1, 8)) as pool:  # re-imports the caller)
        for docs in pool.imap(module_docstrings, paths, chunksize=32):
            fresh = []
            for para in (p for d in docs for p in d.split("\n\n")):
                if len(para) >= SHORTEST_REPEAT:
                    if (h := hashlib.sha1(para.encode()).digest()) in seen:
                        continue
                    seen.add(h)
                fresh.append(para)
            if fresh:
                yield "\n\n".join(fresh)
    yield from (text for _, text in pydoc_topics(sysconfig.get_paths()["stdlib"]))


def build_splits(cache_dir, name, version, records):
    """Build (once, atomically) and return {'train': path, 'val': path}: jsonl files in `cache_dir/<name>-<key>/`,
    a line per (split, object) of the iterator `records`; key: Python version, stdlib path, the DOC_PACKAGES'
    versions and `version`."""
    packages = ",".join(f"{n}=={v}" for n, v, _ in package_dirs())
    key = hashlib.sha1(f"{sys.version}|{sysconfig.get_paths()['stdlib']}|"
                       f"{packages}|{version}".encode()).hexdigest()[:12]
    out = os.path.join(cache_dir, f"{name}-{key}")
    paths = {s: os.path.join(out, f"{s}.jsonl") for s in ("train", "val")}
    if all(os.path.exists(p) for p in paths.values()):
        return paths
    os.makedirs(cache_dir, exist_ok=True)
    with file_lock(out + ".lock"):  # a second process building the same corpus waits, then reads it
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
        ("val" if i % VAL_EVERY == VAL_EVERY - 1 else "train", {"text": doc})
        for i, doc in enumerate(iter_documents())))
