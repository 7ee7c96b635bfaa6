"""The tiny test harness every scripts/test_*.py uses: no framework, a PASS/FAIL/SKIP line per test,
a final `N passed, N failed, N skipped` line, exit code 1 on any failure."""
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Test-only inputs nobody here wrote (e.g. tinyshakespeare); tests fall back when the folder is absent.
SHARED = os.environ.get("MINIMIND_SHARED", os.path.join(os.path.dirname(ROOT), "shared"))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


class Skip(Exception):
    """Raise inside a test to skip it, with the reason as message."""


def run(tests, argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv:  # run only the tests whose names contain one of the arguments
        tests = [t for t in tests if any(a in t.__name__ for a in argv)]
    import torch
    print(f"torch {torch.__version__} cuda={torch.cuda.is_available()} threads={torch.get_num_threads()}\n", flush=True)
    fails = skips = 0
    for t in tests:
        t0 = time.time()
        try:
            t()
            print(f"  PASS  {t.__name__} ({time.time() - t0:.1f}s)", flush=True)
        except Skip as s:
            skips += 1
            print(f"  SKIP  {t.__name__} ({s})", flush=True)
        except Exception:
            fails += 1
            print(f"  FAIL  {t.__name__} ({time.time() - t0:.1f}s)", flush=True)
            traceback.print_exc()
            sys.stderr.flush()
    print(f"\n{len(tests) - fails - skips} passed, {fails} failed, {skips} skipped", flush=True)
    sys.exit(1 if fails else 0)
