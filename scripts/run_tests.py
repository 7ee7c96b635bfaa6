"""Run every scripts/test_*.py in its own process, two at a time, and print the combined totals.

    python scripts/run_tests.py            # all test scripts, 2 at a time
    python scripts/run_tests.py moe data   # only scripts whose name contains one of the words
    python scripts/run_tests.py --quick    # only the QUICK scripts (with words: those of them that match)
    python scripts/run_tests.py --jobs 1   # one script at a time

Scripts run side by side in `--jobs` worker slots, each slot with one CPU thread (OMP_NUM_THREADS=1; the
multi-process tests' ranks take one thread each anyway; test_reproducible.py starts its runs at two),
the slowest first. Each script's output is printed in one piece when it ends; at the end come the slowest
scripts and the ten slowest tests.

All scripts share one temp cache folder (MINIMIND_CACHE_DIR, removed at the end), so the default corpus,
its tokenizer and the tiny pretrained run of testlib.tiny_run() are built once per run, and nothing is
written into data/cache.
"""
import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

# --quick runs only these: the core contracts (the MoE layers against their references, capacity and router
# losses, the kernels, the model, the golden curve, the code's shape).
QUICK = ["test_moe_sorted.py", "test_moe_fused.py", "test_capacity.py", "test_router.py", "test_kernels.py",
         "test_model.py", "test_golden.py", "test_code_shape.py"]
# Started first (longest first keeps the slots busy until the end); the rest follow in name order.
SLOWEST_FIRST = ["test_reproducible.py", "test_reliability.py", "test_sharded.py", "test_sft.py",
                 "test_ddp_ep_training.py", "test_hf_stack.py", "test_pretrain.py",
                 "test_data.py", "test_cpu_speed.py", "test_export.py", "test_kernels.py", "test_expert_parallel.py",
                 "test_moe_variants.py", "test_moe_fused.py"]

HERE = os.path.dirname(os.path.abspath(__file__))
SUMMARY = re.compile(r"^(\d+) passed, (\d+) failed, (\d+) skipped$")
TEST_LINE = re.compile(r"^\s+(PASS|FAIL)\s+(\S+) \((\d+\.\d)s\)$")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("words", nargs="*", help="run only the scripts whose name contains one of these")
    p.add_argument("--quick", action="store_true", help="only the core contracts (QUICK)")
    p.add_argument("--jobs", type=int, default=2, help="scripts run side by side (each with one thread)")
    args = p.parse_args()
    if args.jobs < 1:
        p.error(f"--jobs must be >= 1, got {args.jobs}")
    names = QUICK if args.quick else sorted(os.path.basename(s) for s in glob.glob(os.path.join(HERE, "test_*.py")))
    if args.words:
        names = [n for n in names if any(w in n for w in args.words)]
    cache = tempfile.mkdtemp(prefix="minimind-test-cache-")
    env = dict(os.environ, MINIMIND_CACHE_DIR=cache)
    t0 = time.time()
    try:
        results = run_scripts(names, env, args.jobs)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    report(results, time.time() - t0)


def run_one(name, env):
    """Run one test script; returns (name, seconds, output, exit code)."""
    t0 = time.time()
    proc = subprocess.run([sys.executable, os.path.join(HERE, name)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env=env)
    return name, time.time() - t0, proc.stdout, proc.returncode


def run_scripts(names, env, jobs):
    """The scripts in `jobs` slots, SLOWEST_FIRST first; prints each script's output when it ends. Returns
    [(name, seconds, output, exit code)] in the order they ended."""
    ordered = sorted(names, key=lambda n: (SLOWEST_FIRST.index(n) if n in SLOWEST_FIRST else len(SLOWEST_FIRST), n))
    results = []

    def done(result):
        name, seconds, output, _ = result
        print(f"=== {name}\n{output}=== {name} done in {seconds:.0f}s\n", flush=True)
        results.append(result)

    slot_env = dict(env, OMP_NUM_THREADS="1") if jobs > 1 else env
    with ThreadPoolExecutor(jobs) as pool:
        for future in as_completed([pool.submit(run_one, name, slot_env) for name in ordered]):
            done(future.result())
    return results


def report(results, wall_s):
    """Slowest scripts and tests, broken scripts, the totals; exit code 1 on any failure."""
    totals, broken, tests = [0, 0, 0], [], []
    for name, seconds, output, code in results:
        lines = [m for m in (SUMMARY.match(line.strip()) for line in output.splitlines()) if m]
        tests += [(float(m.group(3)), f"{name}: {m.group(2)}") for m in map(TEST_LINE.match, output.splitlines()) if m]
        if not lines:
            broken.append(f"{name} (exit {code}, no summary line)")
            totals[1] += 1
            continue
        counts = [int(v) for v in lines[-1].groups()]
        totals = [a + b for a, b in zip(totals, counts)]
        if code != 0 and counts[1] == 0:
            totals[1] += 1
            broken.append(f"{name} (exit {code})")
    print("slowest scripts: " + ", ".join(f"{n} {s:.0f}s" for n, s, _, _ in sorted(results, key=lambda r: -r[1])[:8]))
    print("slowest tests:\n" + "\n".join(f"  {s:6.1f}s  {t}" for s, t in sorted(tests, reverse=True)[:10]))
    print(f"wall time {wall_s:.0f}s for {len(results)} scripts")
    if broken:
        print("broken scripts: " + ", ".join(broken))
    print(f"{totals[0]} passed, {totals[1]} failed, {totals[2]} skipped")
    sys.exit(1 if totals[1] else 0)


if __name__ == "__main__":
    main()
