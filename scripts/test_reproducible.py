"""A run's numbers depend only on its flags, data and seed: the main job's shape (its model, 16 x 128 batches, the
embedded corpus) with the defaults `--threads auto` and `--dtype auto`, at two threads, in fp32 and bf16: two
identical commands give identical checkpoints, N steps equal N/2 + `--resume` (resumed with OMP_NUM_THREADS=1:
the run's recorded thread count wins) and SIGINT + `--resume`, bit for bit. Each run is a process of its own
(torch reads OMP_NUM_THREADS at start), so the suite's one-thread workers do not hide a thread-count effect.

    python scripts/test_reproducible.py
"""
import os
import signal
import subprocess
import sys
import time

import testlib
from testlib import ROOT, Skip, run  # noqa: F401
from train.checkpoint import checksum, load_checkpoint

_TMP = testlib.scratch_dir("test_reproducible_")
STEPS = 6
# the main job (train/pretrain.py's defaults) for STEPS steps, evaluated on one batch, no sample
MAIN_JOB = ["--max_steps", str(STEPS), "--eval_tokens", "2048", "--sample_tokens", "0", "--no_progress",
            "--log_interval", "1"]
# what a checkpoint holds besides the clock and the invocation's own flags: equal between equal runs
STATE = ("model", "optimizer", "config", "step", "plan", "data", "rng", "router_load", "scaler")


def pretrain(*argv, threads=2):
    """train/pretrain.py as a process of its own with OMP_NUM_THREADS=threads; returns the CompletedProcess."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "train", "pretrain.py"), *argv], capture_output=True,
                       text=True, env=env, timeout=1800)
    assert r.returncode == 0, f"{argv}: exit {r.returncode}\n{r.stderr[-3000:]}"
    return r


def assert_same_state(a_dir, b_dir, what):
    """The two checkpoints hold the same STATE entries, bit for bit (compared through their SHA-256)."""
    a, b = load_checkpoint(a_dir), load_checkpoint(b_dir)
    differ = [key for key in STATE if checksum({key: a.get(key)}) != checksum({key: b.get(key)})]
    assert not differ, f"{what}: {differ} differ (steps {a['step']} / {b['step']})"


def main_job_runs(dtype):
    """The four runs of one dtype ("auto" or a name); returns the dtype the runs trained in."""
    common = [*MAIN_JOB, "--dtype", dtype]
    ref = os.path.join(_TMP, f"ref_{dtype}")
    r = pretrain(*common, "--out_dir", ref)
    assert "threads: 2 (auto), fixed for the run" in r.stdout, r.stdout[-2000:]
    assert load_checkpoint(ref)["args"]["threads"] == "2"

    again = os.path.join(_TMP, f"again_{dtype}")
    pretrain(*common, "--out_dir", again)
    assert_same_state(ref, again, f"--dtype {dtype}: the same command twice")

    half = os.path.join(_TMP, f"half_{dtype}")
    pretrain(*common, "--out_dir", half, "--stop_after", str(STEPS // 2))
    r = pretrain("--resume", "--out_dir", half, threads=1)  # (the run's 2 threads, not the environment's 1)
    assert "threads: 2, fixed for the run" in r.stdout, r.stdout[-2000:]
    assert_same_state(ref, half, f"--dtype {dtype}: {STEPS // 2} steps + --resume")

    interrupted = os.path.join(_TMP, f"sigint_{dtype}")
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train", "pretrain.py"), *common, "--out_dir",
                             interrupted], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="2"))
    metrics, deadline = os.path.join(interrupted, "metrics.jsonl"), time.time() + 900
    while not (os.path.exists(metrics) and '"train_loss"' in open(metrics).read()) and proc.poll() is None:
        assert time.time() < deadline, "the run did not start training"
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    stopped = load_checkpoint(interrupted)["step"]
    pretrain("--resume", "--out_dir", interrupted)
    assert_same_state(ref, interrupted, f"--dtype {dtype}: SIGINT at step {stopped} + --resume")
    return load_checkpoint(ref)["args"]["dtype"]


def test_main_job_is_bitwise_reproducible_in_fp32_and_bf16():
    """--dtype auto, then the other dtype named, each: the same command twice, half + --resume, SIGINT + --resume."""
    if (os.cpu_count() or 1) < 2:
        raise Skip("needs 2 cores")
    chosen = main_job_runs("auto")
    main_job_runs("float32" if chosen == "bfloat16" else "bfloat16")


def test_threads_flag_on_resume_is_noted():
    """--threads N on --resume of a run that used another count: taken, with a note that the steps from here
    round differently (nothing else changes)."""
    out = os.path.join(_TMP, "threads_note")
    tiny = ["--hidden_size", "32", "--num_hidden_layers", "1", "--num_attention_heads", "2", "--num_key_value_heads", "1",
            "--moe_intermediate_size", "32", "--seq_len", "32", "--batch_size", "4", "--max_steps", "4",
            "--eval_tokens", "256", "--sample_tokens", "0", "--no_progress", "--stop_after", "2"]
    pretrain(*tiny, "--out_dir", out)
    r = pretrain("--resume", "--out_dir", out, "--threads", "1")
    assert "note: --threads 1 instead of the run's 2" in r.stderr and "threads: 1, fixed" in r.stdout, r.stderr[-2000:]


TESTS = [test_main_job_is_bitwise_reproducible_in_fp32_and_bf16, test_threads_flag_on_resume_is_noted]

if __name__ == "__main__":
    run(TESTS)
