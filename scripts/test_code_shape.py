"""The structure the project promises, checked: a plain model with no engine or distributed code, a short
MoE call path, imports that only run down the layers, one loop file, one atomic-write helper, short
functions, and READMEs whose layout tables name every source file.

    python scripts/test_code_shape.py
"""
import ast
import glob
import os
import re
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # (before triton is imported: the CUDA movers' chain, on CPU)
import torch  # noqa: E402

from testlib import ROOT, Skip, run

MAX_FUNCTION_LINES = 80   # any function in train/ and in the MoE layer's files
# which top-level folders each folder may import from (the arrows run down: scripts -> train -> kernels,
# model; kernels/ and model/ are leaves; data is used by train and by nothing below it)
ALLOWED_IMPORTS = {"model": {"model"}, "data": {"data"}, "kernels": {"kernels"},
                   "train": {"train", "model", "data", "kernels"}}


def _files(*patterns):
    return sorted(f for p in patterns for f in glob.glob(os.path.join(ROOT, p)))


def _nonblank(paths):
    return sum(1 for p in paths for line in open(p, encoding="utf-8") if line.strip())


def _imports(path):
    tree = ast.parse(open(path, encoding="utf-8").read(), filename=path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def test_imports_run_down_the_layers():
    bad = []
    for folder, allowed in ALLOWED_IMPORTS.items():
        for f in _files(f"{folder}/*.py"):
            for mod in _imports(f):
                top = mod.split(".")[0]
                if top in ALLOWED_IMPORTS and top not in allowed:
                    bad.append(f"{os.path.relpath(f, ROOT)} imports {mod}")
    assert not bad, f"imports against the layering: {bad}"


def test_model_is_plain_pytorch():
    """No distributed code and no engine code in model/: no oneDNN / Triton / MKL calls, no engine switches."""
    pattern = r"torch\.distributed|\bdist\.|mkldnn|triton|onednn|_grouped_mm|grouped_mm\(|set_num_threads"
    bad = [os.path.relpath(f, ROOT) for f in _files("model/*.py") if re.search(pattern, open(f, encoding="utf-8").read())]
    assert not bad, f"engine or distributed code in model/: {bad} (it belongs in kernels/ or train/)"
    from model.config import MiniMindConfig
    engine_fields = {f for f in MiniMindConfig.__dataclass_fields__ if re.search(r"backend|_impl$", f)} - {"moe_impl"}
    assert not engine_fields, f"engine fields in MiniMindConfig: {engine_fields}"


def _moe_path_to_gemm(moe_impl, experts=None):
    """The repository's Python frames from MOEFeedForward.forward down to the first expert GEMM (the first
    torch linear / mm / bmm / grouped_mm / oneDNN call outside the router) of the layer built with the
    engines the trainer builds it with on this CPU in fp32 (train/engines.py), or with the experts engine
    `experts`: [(file, function), ...]."""
    from train.engines import engines_for
    from model.config import MiniMindConfig
    from model.moe import MOEFeedForward
    torch.manual_seed(0)
    config = MiniMindConfig(hidden_size=32, num_experts=4, moe_intermediate_size=16, moe_impl=moe_impl)
    engines = engines_for(config, "cpu", torch.float32)
    layer = MOEFeedForward(config, experts or engines.experts, engines.movers, engines.linear).train()
    chains = []

    def profile(frame, event, arg):
        if event == "c_call" and any(k in getattr(arg, "__name__", "") for k in ("linear", "mm", "matmul")):
            chain, f = [], frame
            while f is not None:
                path = os.path.abspath(f.f_code.co_filename)
                if os.path.relpath(path, ROOT).split(os.sep)[0] in ALLOWED_IMPORTS:  # (not torch, not the tests)
                    chain.append((os.path.relpath(path, ROOT), f.f_code.co_name))
                f = f.f_back
            chains.append(chain[::-1])

    sys.setprofile(profile)
    try:
        layer(torch.randn(2, 8, 32))
    finally:
        sys.setprofile(None)
    experts = [c for c in chains if not any(name in ("route", "router_logits") for _, name in c)]
    return experts[0] if experts else []


def test_moe_call_path_is_short():
    """From MOEFeedForward.forward to the expert GEMM, as the trainer builds the layer: on the trained
    (fused) path at most 4 frames of ours in 2 files (moe.py, then the experts engine's file), the last
    one calling torch's GEMM; the GPU's trained path (the grouped engine on torch's grouped_mm, here on
    CPU) at most 4 in 3 files; on the sorted path (the layer's default) at most 3 in moe.py alone."""
    from kernels.experts import GROUPED_EXPERTS
    from kernels.grouped_gemm import torch_grouped_mm_fits
    paths = [("fused", None, 4, {"model/moe.py", "kernels/experts.py"}), ("sorted", None, 3, {"model/moe.py"})]
    if torch_grouped_mm_fits("cpu", torch.float32, 32, 16):
        paths.append(("fused", GROUPED_EXPERTS["torch"], 4, {"model/moe.py", "kernels/experts.py",
                                                             "kernels/grouped_gemm.py"}))
    for moe_impl, experts, most_calls, files in paths:
        chain = _moe_path_to_gemm(moe_impl, experts)
        assert chain and chain[0] == ("model/moe.py", "forward"), (moe_impl, chain)
        assert len(chain) <= most_calls and {f for f, _ in chain} <= files, f"{moe_impl}: {len(chain)} frames: {chain}"


def test_cuda_mover_chains_are_short():
    """The fused path's permute and combine as the trainer builds them on CUDA (train/engines.py:
    TRITON_MOVERS; here in Triton's CPU interpreter): from MOEFeedForward.forward (backward: from the autograd
    Function) to kernels/permute.py's mover at most 5 frames of ours, never back into model/ once in kernels/."""
    from kernels.backend import triton_runs_on
    from model.config import MiniMindConfig
    from model.moe import MOEFeedForward
    from train.engines import TRITON_MOVERS, engines_for
    if not triton_runs_on(torch.zeros(1)):  # (the one reason to skip: Triton not installed, or nowhere to run)
        raise Skip("Triton runs on no device here (not installed, or TRITON_INTERPRET=0 without CUDA)")
    config = MiniMindConfig(hidden_size=32, num_experts=4, moe_intermediate_size=16, moe_impl="fused")
    torch.manual_seed(0)
    layer = MOEFeedForward(config, engines_for(config, "cpu", torch.float32).experts, TRITON_MOVERS).train()
    movers = {TRITON_MOVERS.gather.__code__, TRITON_MOVERS.sum.__code__}
    chains = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code in movers:
            chain, f = [], frame
            while f is not None:
                path = os.path.relpath(os.path.abspath(f.f_code.co_filename), ROOT)
                if path.split(os.sep)[0] in ALLOWED_IMPORTS:
                    chain.append((path, f.f_code.co_name))
                f = f.f_back
            chains.append(chain[::-1])

    sys.setprofile(profile)
    try:
        layer(torch.randn(2, 8, 32, requires_grad=True)).sum().backward()
    finally:
        sys.setprofile(None)
    assert len(chains) == 4, chains  # permute, combine; their backward passes
    for chain in chains:
        folders = [path.split(os.sep)[0] for path, _ in chain]
        assert len(chain) <= 5 and folders[-1] == "kernels" and "model" not in folders[folders.index("kernels"):], chain
        assert chain[0] in (("model/moe.py", "forward"), ("model/dispatch.py", "backward")), chain


def test_gpu_check_runs_the_tests_it_names():
    """Each test filter scripts/gpu_check.sh passes a test script matches one of its tests (a renamed test would
    drop out of the GPU check unseen)."""
    text = open(os.path.join(ROOT, "scripts", "gpu_check.sh"), encoding="utf-8").read().replace("\\\n", " ")
    checked = []
    for match in re.finditer(r"scripts/(test_\w+)\.py((?: +[a-z_][a-z_0-9]*)*)", text):
        script, filters = match.group(1), match.group(2).split()
        tree = ast.parse(open(os.path.join(ROOT, "scripts", script + ".py"), encoding="utf-8").read())
        names = [node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")]
        checked += [(script, f) for f in filters if not any(f in name for name in names)]
    assert not checked, f"gpu_check.sh filters that match no test: {checked}"


def test_kernels_are_a_library():
    """kernels/ holds functions and autograd Functions on tensors that the model's engines call: no class of
    kernels/ derives from one of model/, and none imports model/ or train/ (the glue that builds a model with
    them is train/engines.py)."""
    model_classes = {node.name for f in _files("model/*.py") for node in ast.walk(ast.parse(open(f).read()))
                     if isinstance(node, ast.ClassDef)}
    bad = [f"{os.path.relpath(f, ROOT)}: {node.name}" for f in _files("kernels/*.py")
           for node in ast.walk(ast.parse(open(f).read())) if isinstance(node, ast.ClassDef)
           and any(getattr(base, "id", getattr(base, "attr", None)) in model_classes for base in node.bases)]
    assert not bad, f"kernels/ classes derived from model/ classes: {bad}"
    leaning = [os.path.relpath(f, ROOT) for f in _files("kernels/*.py")
               if any(m.split(".")[0] in ("model", "train") for m in _imports(f))]
    assert not leaning, f"kernels/ files importing model/ or train/: {leaning}"


def test_main_job_model_named_once():
    """The main job's model has one definition (model/config.py: the defaults and TRAINING_DEFAULTS, built by
    `trained_config`) and its vocabulary size one number: no other product file writes 6400."""
    bad = [os.path.relpath(f, ROOT) for f in _files("model/*.py", "train/*.py", "data/*.py", "kernels/*.py",
                                                  "scripts/*.py", "scripts/bench/*.py", "scripts/hf/*.py")
           if not f.endswith(os.path.join("model", "config.py")) and not os.path.basename(f).startswith("test_")
           and re.search(r"\b6400\b", open(f, encoding="utf-8").read())]
    assert not bad, f"the vocabulary size written outside model/config.py: {bad}"
    flags_text = open(os.path.join(ROOT, "train", "flags.py"), encoding="utf-8").read()
    assert "TRAINING_DEFAULTS = " not in flags_text, "the trainer's departures belong in model/config.py"


def test_no_class_swaps():
    """The module you read is the module that runs: no `__class__` assignment in model/, train/, kernels/."""
    bad = [os.path.relpath(f, ROOT) for f in _files("model/*.py", "train/*.py", "kernels/*.py")
           if re.search(r"__class__\s*=[^=]", open(f, encoding="utf-8").read())]
    assert not bad, f"__class__ assignments in {bad}"


# The MoE core, where a reader most needs names that say what they hold
MOE_CORE = ("model/moe.py", "model/dispatch.py", "model/router.py", "model/engines.py", "model/config.py",
            "kernels/experts.py", "train/engines.py", "kernels/permute.py", "train/parallel.py", "train/distributed.py", "train/flags.py",
            "train/init_weights.py")
ONE_LETTER_NAMES_ALLOWED = {"x", "e"}  # a module's input (nn.Module's convention); an exception


def test_names_say_what_they_hold():
    """No one-letter lowercase name bound in the MoE core outside a loop, a comprehension or a lambda (shape
    letters such as B, T, D, and shape suffixes such as x_TD, are the project's notation)."""
    bad = []
    for path in MOE_CORE:
        tree = ast.parse(open(os.path.join(ROOT, path), encoding="utf-8").read(), filename=path)
        in_loops = {id(n) for node in ast.walk(tree) if isinstance(node, (ast.For, ast.comprehension))
                    for n in ast.walk(node.target)}
        in_loops |= {id(a) for node in ast.walk(tree) if isinstance(node, ast.Lambda) for a in node.args.args}
        for node in ast.walk(tree):
            name = (node.id if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)
                    else node.arg if isinstance(node, ast.arg) else None)
            if (name and len(name) == 1 and name.islower() and name not in ONE_LETTER_NAMES_ALLOWED
                    and id(node) not in in_loops):
                bad.append(f"{path}:{node.lineno} {name}")
    assert not bad, f"one-letter names: {bad}"


def test_one_loop_file():
    uses = [os.path.relpath(f, ROOT) for f in _files("train/*.py") if not f.endswith("loop.py")
            and re.search(r"def train_step|\.backward\(\)", open(f, encoding="utf-8").read())]
    assert not uses, f"training-step code outside train/loop.py: {uses}"


def test_functions_fit_on_a_screen():
    long = []
    for f in _files("train/*.py", "model/moe.py", "model/dispatch.py", "kernels/experts.py"):
        tree = ast.parse(open(f, encoding="utf-8").read(), filename=f)
        long += [f"{os.path.relpath(f, ROOT)}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
                 for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"functions longer than {MAX_FUNCTION_LINES} lines: {long}"


def test_one_atomic_write_helper():
    product = [f for f in _files("model/*.py", "train/*.py", "data/*.py", "kernels/*.py", "scripts/*.py")
               if not os.path.basename(f).startswith("test_")]  # (tests may fake what a crash leaves)
    bad = [os.path.relpath(f, ROOT) for f in product
           if not f.endswith(os.path.join("data", "atomic.py")) and ("os." + "replace(") in open(f, encoding="utf-8").read()]
    assert not bad, f"hand-written atomic writes (use data/atomic.py): {bad}"


def test_no_machine_timings_in_docstrings():
    bad = []
    for f in _files("model/*.py", "train/*.py", "data/*.py", "kernels/*.py"):
        tree = ast.parse(open(f, encoding="utf-8").read(), filename=f)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)):
                doc = ast.get_docstring(node) or ""
                if re.search(r"EPYC|Xeon|\d ms\b|GFLOP/s|tokens/s on", doc):
                    bad.append(f"{os.path.relpath(f, ROOT)}: {getattr(node, 'name', 'module')}")
    assert not bad, f"machine-specific timings in docstrings (they belong in a README's benchmark figures): {bad}"


MAX_LINE = 100  # characters, in model/ and kernels/
MAX_PRODUCT_LINE = 120  # characters, in every other .py file but the tests
COLUMN_GAP = re.compile(r"\S {2,}\S")  # two or more spaces between words: an aligned column


def _docstring_lines(tree):
    """The line numbers of every module, class and function docstring in `tree`."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def test_lines_fit_100_columns():
    """Every line of model/*.py and kernels/*.py is at most 100 characters, except a row of an
    aligned table in a docstring: a line inside a module, class or function docstring with a gap of
    two or more spaces between two words (a column gap; prose has single spaces), e.g. the engine
    table of train/engines.py and the step table of model/moe.py, which read better wide. Code,
    comments and docstring prose have no exemption. Names file:line of each longer line."""
    long = []
    for f in _files("model/*.py", "kernels/*.py"):
        text = open(f, encoding="utf-8").read()
        in_docstring = _docstring_lines(ast.parse(text, filename=f))
        for number, line in enumerate(text.splitlines(), 1):
            if len(line) > MAX_LINE and not (number in in_docstring and COLUMN_GAP.search(line)):
                long.append(f"{os.path.relpath(f, ROOT)}:{number} ({len(line)} characters)")
    assert not long, f"lines longer than {MAX_LINE} characters (not docstring table rows): {long}"



def test_product_lines_fit_120_columns():
    """Every line of the product's other .py files (train/, data/, the tools and benchmarks in scripts/;
    not the test scripts) is at most 120 characters. Names file:line of each longer line."""
    long = [f"{os.path.relpath(f, ROOT)}:{number} ({len(line)} characters)"
            for f in _files("train/*.py", "data/*.py", "scripts/*.py", "scripts/*/*.py")
            if not os.path.basename(f).startswith("test_")
            for number, line in enumerate(open(f, encoding="utf-8").read().splitlines(), 1)
            if len(line) > MAX_PRODUCT_LINE]
    assert not long, f"lines longer than {MAX_PRODUCT_LINE} characters: {long}"


README_FOLDERS = ("model", "train", "data", "kernels", "scripts")


def test_readmes_name_every_source_file():
    """READMEs are reference, not history: README.md <= 200 lines and all of them <= 450; the first screen
    of README.md names the MoE layer and the experts engine training runs (the trained path in one hop);
    the folder READMEs' tables name every source file."""
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    assert readme.count("\n") <= 200, f"README.md has {readme.count(chr(10))} lines (<= 200)"
    total = sum(open(os.path.join(ROOT, folder, "README.md"), encoding="utf-8").read().count("\n")
                for folder in (".",) + README_FOLDERS)
    assert total <= 450, f"the READMEs have {total} lines together (<= 450)"
    first_screen = "\n".join(readme.splitlines()[:30])
    assert "model/moe.py" in first_screen and "kernels/experts.py" in first_screen, \
        "the first screen of README.md must name model/moe.py and kernels/experts.py"
    missing = []
    for folder in ("model", "train", "data", "kernels"):
        text = open(os.path.join(ROOT, folder, "README.md"), encoding="utf-8").read()
        missing += [f"{folder}/{os.path.basename(f)}" for f in _files(f"{folder}/*.py")
                    if os.path.basename(f) != "__init__.py" and os.path.basename(f) not in text]
    assert not missing, f"the folder READMEs' tables do not mention {missing}"


TESTS = [test_imports_run_down_the_layers, test_model_is_plain_pytorch, test_moe_call_path_is_short,
         test_cuda_mover_chains_are_short, test_gpu_check_runs_the_tests_it_names,
         test_kernels_are_a_library, test_main_job_model_named_once, test_no_class_swaps,
         test_names_say_what_they_hold, test_one_loop_file, test_functions_fit_on_a_screen, test_one_atomic_write_helper,
         test_no_machine_timings_in_docstrings, test_readmes_name_every_source_file,
         test_lines_fit_100_columns, test_product_lines_fit_120_columns]

if __name__ == "__main__":
    run(TESTS)
