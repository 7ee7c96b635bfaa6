"""The default fine-tuning set: questions about the Python standard library, answered from its own text (`ast`).

- each public documented function, class and method: "What does `json.dumps` do?" -> its docstring's first
  paragraph (at most two sentences); "What is the signature of `json.dumps`?" -> written from the `def` line;
- each `pydoc_data.topics` topic: "Explain `assert` in Python." -> the topic's first paragraph.
About one conversation in four has a system turn, one in three is two rounds about two names of one module.
Written as MiniMind's SFT jsonl (`{"conversations": [...]}`). Held out by name (sha1 = 0 mod 20), so validation
asks about functions never seen in fine-tuning. Deterministic (sorted walk, fixed seed), cached under CACHE_DIR.
"""
import ast
import hashlib
import os
import random
import re
import sysconfig

from data.corpus import CACHE_DIR, build_splits, parse_module, py_files, pydoc_topics

BUILDER_VERSION = 1
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "idlelib",
              "lib2to3", "turtledemo", "ensurepip", "venv", "pydoc_data"}
SYSTEM_PROMPT = "You are a concise assistant who knows the Python standard library."
MAX_ANSWER_CHARS = 400


def first_paragraph(doc):
    """The docstring's first paragraph as one line, cut after two sentences or MAX_ANSWER_CHARS."""
    para = re.split(r"\n\s*\n", doc.strip(), maxsplit=1)[0]
    sentences = re.split(r"(?<=[.!?])\s+(?=[A-Z`(])", " ".join(para.split()))
    text = " ".join(sentences[:2])
    if len(text) > MAX_ANSWER_CHARS:
        text = text[:MAX_ANSWER_CHARS].rsplit(" ", 1)[0] + " ..."
    return text


def module_entries(stdlib, path):
    """[(qualified name, kind, first paragraph, signature or None)] of a module's public documented names."""
    module = os.path.relpath(path, stdlib)[:-3].replace(os.sep, ".").removesuffix(".__init__")
    tree = None if any(part.startswith("_") for part in module.split(".")) else parse_module(path)
    out = []

    def visit(body, prefix):
        for node in body:
            if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                    and not node.name.startswith("_")):
                doc = ast.get_docstring(node, clean=True)
                name = f"{prefix}.{node.name}"
                answer = first_paragraph(doc) if doc else ""
                if len(answer) >= 20 and not answer.startswith(node.name + "("):
                    is_class = isinstance(node, ast.ClassDef)
                    out.append((name, "class" if is_class else "function", answer,
                                None if is_class else f"`{name}({ast.unparse(node.args)})`"))
                if isinstance(node, ast.ClassDef) and prefix == module:
                    visit(node.body, name)

    visit(tree.body if tree else [], module)
    return out


def _questions(entry):
    name, kind, answer, signature = entry
    return ([(f"What does `{name}` do?", answer)]
            + ([(f"What is the signature of `{name}`?", signature)] if signature else []))


def iter_conversations(seed=0):
    """Yield (held-out key, conversation) in a fixed order; conversation = list of {"role", "content"}."""
    stdlib = sysconfig.get_paths()["stdlib"]
    rng = random.Random(seed)
    for path in py_files(sysconfig.get_paths()["stdlib"], _SKIP_DIRS):
        entries = module_entries(stdlib, path)
        i = 0
        while i < len(entries):
            pair = i + 1 < len(entries) and rng.random() < 1 / 3
            group = entries[i:i + 2] if pair else entries[i:i + 1]
            i += len(group)
            turns = [qa for e in group for qa in _questions(e)[:1 if pair else 2]]
            rng.shuffle(turns) if not pair else None
            yield group[0][0], _conversation(turns, rng)  # a pair is held out with its first name (one module)
    for key, text in pydoc_topics(stdlib):
        answer = first_paragraph(text)
        if len(answer) >= 20:
            yield key, _conversation([(f"Explain `{key}` in Python.", answer)], rng)


def _conversation(turns, rng):
    messages = [{"role": "system", "content": SYSTEM_PROMPT}] if rng.random() < 0.25 else []
    for q, a in turns:
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return messages


def held_out(key, every=20):
    return int(hashlib.sha1(key.encode()).hexdigest(), 16) % every == 0


def default_sft_set(cache_dir=CACHE_DIR):
    """Build (once) and return {'train': path, 'val': path} of the default SFT set as jsonl files."""
    return build_splits(cache_dir, "stdlib-sft", BUILDER_VERSION, (
        ("val" if held_out(key) else "train", {"conversations": messages}) for key, messages in iter_conversations()))
