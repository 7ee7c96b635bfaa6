"""Run every scripts/test_*.py in its own process and print the combined totals.

    python scripts/run_tests.py            # all test scripts
    python scripts/run_tests.py moe data   # only scripts whose name contains one of the words
    python scripts/run_tests.py --quick    # only the QUICK scripts (with words: those of them that match)

All scripts share one temp cache folder (MINIMIND_CACHE_DIR, removed at the end), so the default corpus
and its tokenizer are built once per run, and nothing is written into data/cache.
"""
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

# --quick runs only these (~1.5 minutes on 2 cores): the core contracts (the MoE layers against their
# references, capacity and router losses, the kernels, the model, the golden curve, the code's shape).
QUICK = ["test_moe_sorted.py", "test_moe_fused.py", "test_capacity.py", "test_router.py", "test_kernels.py", "test_model.py",
         "test_golden.py", "test_code_shape.py"]

HERE = os.path.dirname(os.path.abspath(__file__))
SUMMARY = re.compile(r"^(\d+) passed, (\d+) failed, (\d+) skipped$")


def main():
    args = sys.argv[1:]
    scripts = sorted(glob.glob(os.path.join(HERE, "test_*.py")))
    if "--quick" in args:
        args = [a for a in args if a != "--quick"]
        scripts = [os.path.join(HERE, name) for name in QUICK]
    if args:
        scripts = [s for s in scripts if any(a in os.path.basename(s) for a in args)]
    cache = tempfile.mkdtemp(prefix="minimind-test-cache-")
    env = dict(os.environ, MINIMIND_CACHE_DIR=cache)
    try:
        totals, broken = run_scripts(scripts, env)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    if broken:
        print("broken scripts: " + ", ".join(broken))
    print(f"{totals[0]} passed, {totals[1]} failed, {totals[2]} skipped")
    sys.exit(1 if totals[1] else 0)


def run_scripts(scripts, env):
    """Run each script; returns the summed (passed, failed, skipped) and the scripts that broke (no summary
    line, or a failing exit code with no failed test; each counts as one failure)."""
    totals, broken = [0, 0, 0], []
    for path in scripts:
        name = os.path.basename(path)
        print(f"=== {name}", flush=True)
        t0 = time.time()
        proc = subprocess.run([sys.executable, path], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env)
        print(proc.stdout, end="", flush=True)
        lines = [m for m in (SUMMARY.match(l.strip()) for l in proc.stdout.splitlines()) if m]
        if not lines:
            broken.append(name)
            totals[1] += 1
            print(f"!!! {name} exited {proc.returncode} without a summary line", flush=True)
        else:
            counts = [int(v) for v in lines[-1].groups()]
            totals = [a + b for a, b in zip(totals, counts)]
            if proc.returncode != 0 and counts[1] == 0:
                totals[1] += 1
                broken.append(name)
        print(f"=== {name} done in {time.time() - t0:.0f}s\n", flush=True)
    return totals, broken


if __name__ == "__main__":
    main()
