"""Run every scripts/test_*.py in its own process and print the combined totals.

    python scripts/run_tests.py            # all test scripts
    python scripts/run_tests.py moe data   # only scripts whose name contains one of the words
"""
import glob
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SUMMARY = re.compile(r"^(\d+) passed, (\d+) failed, (\d+) skipped$")


def main():
    scripts = sorted(glob.glob(os.path.join(HERE, "test_*.py")))
    if sys.argv[1:]:
        scripts = [s for s in scripts if any(a in os.path.basename(s) for a in sys.argv[1:])]
    totals, broken = [0, 0, 0], []
    for path in scripts:
        name = os.path.basename(path)
        print(f"=== {name}", flush=True)
        t0 = time.time()
        proc = subprocess.run([sys.executable, path], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
    if broken:
        print("broken scripts: " + ", ".join(broken))
    print(f"{totals[0]} passed, {totals[1]} failed, {totals[2]} skipped")
    sys.exit(1 if totals[1] else 0)


if __name__ == "__main__":
    main()
