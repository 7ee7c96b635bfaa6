"""The structure the project promises, checked: short functions where readers start, no distributed code
in model/, one atomic-write helper, and a README layout table that names every source file.

    python scripts/test_code_shape.py
"""
import ast
import glob
import os
import re

from testlib import ROOT, run

MAX_LINES = 80          # any function in train/ and in the MoE layer's files
TRAIN_STEP_LINES = 60   # "fits on one screen"


def _functions(path):
    tree = ast.parse(open(path, encoding="utf-8").read(), filename=path)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1


def _files(*patterns):
    return sorted(f for p in patterns for f in glob.glob(os.path.join(ROOT, p)))


def test_functions_fit_on_a_screen():
    long = [f"{os.path.relpath(f, ROOT)}:{line} {name} ({n} lines)"
            for f in _files("train/*.py", "model/moe*.py", "model/dispatch*.py", "model/experts*.py")
            for name, line, n in _functions(f) if n > MAX_LINES]
    assert not long, f"functions longer than {MAX_LINES} lines: {long}"
    steps = [n for name, _, n in _functions(os.path.join(ROOT, "train", "trainer.py")) if name == "train_step"]
    assert steps and steps[0] <= TRAIN_STEP_LINES, f"train_step is {steps} lines (> {TRAIN_STEP_LINES})"


def test_model_has_no_distributed_code():
    bad = [os.path.relpath(f, ROOT) for f in _files("model/*.py")
           if re.search(r"torch\.distributed|import torch\.distributed|\bdist\.", open(f, encoding="utf-8").read())]
    assert not bad, f"distributed code in model/: {bad} (it belongs in train/)"


def test_one_atomic_write_helper():
    product = [f for f in _files("model/*.py", "train/*.py", "data/*.py", "kernels/*.py", "scripts/*.py")
               if not os.path.basename(f).startswith("test_")]  # (tests may fake what a crash leaves)
    bad = [os.path.relpath(f, ROOT) for f in product
           if not f.endswith(os.path.join("train", "atomic.py")) and ("os." + "replace(") in open(f, encoding="utf-8").read()]
    assert not bad, f"hand-written atomic writes (use data/atomic.py): {bad}"


def test_readme_layout_names_every_source_file():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    layout = readme[readme.index("## Layout"):]
    layout = layout[:layout.index("\n## ", 4)] if "\n## " in layout[4:] else layout
    missing = []
    for f in _files("model/*.py", "train/*.py", "data/*.py", "kernels/*.py"):
        name = os.path.basename(f)
        if name != "__init__.py" and name not in layout:
            missing.append(os.path.relpath(f, ROOT))
    assert not missing, f"README's layout table does not mention {missing}"


TESTS = [test_functions_fit_on_a_screen, test_model_has_no_distributed_code, test_one_atomic_write_helper,
         test_readme_layout_names_every_source_file]

if __name__ == "__main__":
    run(TESTS)
