"""The tiny test harness every scripts/test_*.py uses: no framework, a PASS/FAIL/SKIP line per test,
a final `N passed, N failed, N skipped` line, exit code 1 on any failure.

Importing it (before anything imports data.corpus) points MINIMIND_CACHE_DIR, where corpora, tokenizers
and token caches are cached, at a temp folder removed at exit, unless it is set already (run_tests.py
sets one for the whole run): tests never write into the user's data/cache. Processes the tests start
inherit the variable."""
import atexit
import os
import shutil
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Test-only inputs nobody here wrote (e.g. tinyshakespeare); tests fall back when the folder is absent.
SHARED = os.environ.get("MINIMIND_SHARED", os.path.join(os.path.dirname(ROOT), "shared"))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
if not os.environ.get("MINIMIND_CACHE_DIR"):
    _cache, _owner = tempfile.mkdtemp(prefix="minimind-test-cache-"), os.getpid()
    os.environ["MINIMIND_CACHE_DIR"] = _cache
    # (only by this process: a forked child inherits the handler)
    atexit.register(lambda: os.getpid() == _owner and shutil.rmtree(_cache, ignore_errors=True))


def venv_python(env_var, venv, module, install):
    """The python of an optional tool's venv ($env_var, else ROOT/venv/bin/python) where `module` imports;
    raises Skip naming what is missing and `install`, the command that makes it."""
    import subprocess
    python = os.environ.get(env_var) or os.path.join(ROOT, venv, "bin", "python")
    if not os.path.exists(python):
        raise Skip(f"{module} not installed ({python} missing; {install})")
    probe = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True)
    if probe.returncode:
        raise Skip(f"{module} does not import in {python}: {probe.stderr.strip().splitlines()[-1:]}")
    return python


def scratch_dir(prefix):
    """A fresh temp folder for a test script's files, removed when the script ends. None in a rank process
    (spawn_ranks): its start re-imports the test script, and a rank gets the paths it needs as arguments."""
    import multiprocessing
    if multiprocessing.current_process().name != "MainProcess":  # (named before the script is re-imported)
        return None
    path, owner = tempfile.mkdtemp(prefix=prefix), os.getpid()
    atexit.register(lambda: os.getpid() == owner and shutil.rmtree(path, ignore_errors=True))
    return path


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


# The suite's tiny pretrained run (tiny_run): the main job on the embedded corpus, shrunk to 2 layers of width 64
TINY_RUN_FLAGS = ["--hidden_size", "64", "--num_hidden_layers", "2", "--num_attention_heads", "4",
                  "--num_key_value_heads", "2", "--moe_intermediate_size", "64", "--seq_len", "64", "--batch_size", "8",
                  "--max_steps", "40", "--learning_rate", "1e-2", "--warmup_steps", "5", "--eval_tokens", "2048",
                  "--sample_tokens", "0", "--time_budget_s", "0", "--no_progress"]


def tiny_run():
    """The folder of a tiny pretrained run (train/pretrain.py TINY_RUN_FLAGS: ckpt.pt, tokenizer/, ...), built
    once per MINIMIND_CACHE_DIR (so once per run_tests.py run; scripts running side by side wait for one
    build under a file lock). Read-only: runs starting from it (--init_from, export) write elsewhere."""
    import subprocess

    from data.atomic import file_lock
    folder = os.path.join(os.environ["MINIMIND_CACHE_DIR"], "tiny-run")
    with file_lock(folder + ".lock"):
        if not os.path.exists(os.path.join(folder, "built")):
            shutil.rmtree(folder, ignore_errors=True)  # (a build killed half-way)
            r = subprocess.run([sys.executable, os.path.join(ROOT, "train", "pretrain.py"), *TINY_RUN_FLAGS,
                                "--out_dir", folder], capture_output=True, text=True, timeout=1200)
            assert r.returncode == 0, f"the tiny pretrained run failed:\n{r.stderr[-3000:]}"
            open(os.path.join(folder, "built"), "w").close()
    return folder


def run_script(script, *argv, cwd=None):
    """`python <ROOT>/<script> *argv` run inside this process (runpy, as `__main__`): a CompletedProcess with
    the exit code (a SystemExit's, 0 when the script returns, 1 and the traceback in stderr for an uncaught
    exception, 130 for KeyboardInterrupt) and what it printed to sys.stdout / sys.stderr (logging handlers
    included). The same code runs as in a child process without paying the imports again, most of a tiny
    run's start-up. What this process shares with the script is put back afterwards: working directory,
    signal handlers, umask, torch's thread count, logging streams, warning filters (catch_warnings also
    forgets which warnings were shown, so each run shows its own, as a fresh process would). Tests of what
    a process does (signals, kills, start-up, several ranks) start a real one."""
    import contextlib
    import io
    import logging
    import runpy
    import signal
    import subprocess
    import warnings

    import torch
    path = os.path.join(ROOT, script)
    out, err = io.StringIO(), io.StringIO()
    saved_argv, saved_cwd, saved_threads = sys.argv, os.getcwd(), torch.get_num_threads()
    saved_signals = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    saved_umask = os.umask(0o022)
    os.umask(saved_umask)
    # handlers made earlier hold the stream they were given (transformers' logging holds sys.stderr)
    saved_streams = {h: h.stream for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
                     for h in getattr(logger, "handlers", ()) if type(h) is logging.StreamHandler}
    code = 0
    try:
        sys.argv = [path, *map(str, argv)]
        if cwd is not None:
            os.chdir(cwd)
        for h, stream in saved_streams.items():
            h.stream = (err if stream in (sys.stderr, sys.__stderr__)
                        else out if stream in (sys.stdout, sys.__stdout__) else stream)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            try:
                runpy.run_path(path, run_name="__main__")
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if e.code is not None and not isinstance(e.code, int):
                    print(e.code, file=sys.stderr)
            except KeyboardInterrupt:
                code = 130
                traceback.print_exc()
            except Exception:
                code = 1
                traceback.print_exc()
    finally:
        for h, stream in saved_streams.items():
            h.stream = stream
        sys.argv = saved_argv
        os.chdir(saved_cwd)
        torch.set_num_threads(saved_threads)
        for s, handler in saved_signals.items():
            signal.signal(s, handler)
        os.umask(saved_umask)
    return subprocess.CompletedProcess([sys.executable, path, *argv], code, out.getvalue(), err.getvalue())


def wait_for_training(proc, out_dir, past_step=0, timeout_s=300, log=lambda: ""):
    """Return once out_dir/metrics.jsonl holds a training record of a step after past_step (polled: the run
    `proc` has trained that far). AssertionError, with log(), if proc ends first or timeout_s pass."""
    import json
    metrics, deadline = os.path.join(out_dir, "metrics.jsonl"), time.time() + timeout_s
    while True:
        for line in open(metrics).read().splitlines() if os.path.exists(metrics) else []:
            try:
                record = json.loads(line)
            except ValueError:  # (a line being written)
                continue
            if "train_loss" in record and record["step"] > past_step:
                return
        assert proc.poll() is None and time.time() < deadline, \
            f"the run did not train past step {past_step} (exit {proc.poll()}): {log()}"
        time.sleep(0.02)


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(rank, world, port, fn, out_dir, args, init_group):
    import gc
    import torch
    import torch.distributed as dist
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if init_group:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.save(fn(rank, world, *args), os.path.join(out_dir, f"rank{rank}.pt"))
    # Free whatever still holds a process group (modules with an EP dispatcher sit in reference cycles)
    # and leave together. A group destroyed during interpreter finalisation, or a rank leaving while a peer
    # is still in a collective, can make gloo abort at exit ("terminate called without an active
    # exception") after the test itself passed.
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# What every rank imports, loaded once into the fork server the ranks are forked from (see spawn_ranks)
RANK_PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "transformers", "train.loop", "train.pretrain"]


def spawn_ranks(fn, world, *args, init_group=True):
    """Run fn(rank, world, *args) in `world` local processes with torchrun's environment variables set
    (and, if init_group, a gloo process group on 127.0.0.1); returns their return values by rank.

    The ranks are forked from a fork server that imported RANK_PRELOAD once (started at the first call,
    kept for the test script's life): a fresh process per rank, as torchrun gives, without a fresh import
    of torch each time. The server never runs a torch op, so no OpenMP pool is forked."""
    import multiprocessing
    import tempfile
    import torch
    import torch.multiprocessing as mp
    multiprocessing.set_forkserver_preload(RANK_PRELOAD)
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_rank_entry, args=(world, free_port(), fn, out_dir, args, init_group), nprocs=world,
                           join=True, start_method="forkserver")
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def rank_exit_codes(fn, world, *args, grace_s=60):
    """fn(rank, world, *args) on `world` ranks started as spawn_ranks starts them (no process group), each
    left to end on its own; returns every rank's exit code (-9: SIGKILL), where spawn_ranks reports the
    first failure it happens to see. A rank still running `grace_s` after the first one ended is
    terminated, then killed."""
    import multiprocessing
    import multiprocessing.connection
    import tempfile
    import time
    import torch.multiprocessing as mp
    multiprocessing.set_forkserver_preload(RANK_PRELOAD)
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_rank_entry, args=(world, free_port(), fn, out_dir, args, False), nprocs=world,
                                 join=False, start_method="forkserver")
        multiprocessing.connection.wait([p.sentinel for p in ctx.processes], timeout=600)
        deadline = time.time() + grace_s
        for p in ctx.processes:
            p.join(max(0.0, deadline - time.time()))
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
                p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
        return [p.exitcode for p in ctx.processes]


def rebuilt(module, engines):
    """A copy of `module` (a MiniMindForCausalLM or an MOEFeedForward) built with `engines` and
    holding its weights and buffers (load_state_dict, strict): how the tests and benchmarks put a
    plain model's weights onto other engines."""
    from model.model_minimind import MiniMindForCausalLM
    from model.moe import MOEFeedForward
    if isinstance(module, MiniMindForCausalLM):
        twin = MiniMindForCausalLM(module.config, engines)
    elif isinstance(module, MOEFeedForward):
        twin = MOEFeedForward(module.config, engines.experts, engines.movers, engines.linear)
    else:
        raise ValueError(f"rebuilt: a MiniMindForCausalLM or MOEFeedForward, "
                         f"got {type(module).__name__}")
    param = next(module.parameters())
    twin = twin.to(device=param.device, dtype=param.dtype)
    twin.load_state_dict(module.state_dict(), strict=True)
    return twin.train(module.training)
