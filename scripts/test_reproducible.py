"""A run's numbers depend only on its flags, data and seed: the main job's shape (its model, 16 x 128 batches, the
embedded corpus) with the defaults `--threads auto` and `--dtype auto`, at two threads: a run stopped by SIGINT
and resumed (with OMP_NUM_THREADS=1: the run's recorded thread count wins) ends bit for bit where the
uninterrupted run ends; in the other dtype (fp32 or bf16) too. (--stop_after + --resume: test_pretrain.py's
test_resume_equals_continuous_run; SIGTERM: test_reliability.py and, under torchrun, test_sharded.py.) The run
stopped by SIGINT and the resume under OMP_NUM_THREADS=1 are processes of their own (torch reads OMP_NUM_THREADS
at start); the other runs train inside the test process (no start-up to pay) with torch's thread count set to 2,
so the suite's one-thread workers do not hide a thread-count effect.
The bf16 leg is skipped where bf16 is emulated (no AVX512-BF16, no AMX, or oneDNN capped below them by
ONEDNN_MAX_CPU_ISA: --dtype auto never picks it there).

    python scripts/test_reproducible.py
"""
import os
import signal
import subprocess
import sys

import testlib
from testlib import ROOT, Skip, run  # noqa: F401
from train.checkpoint import load_checkpoint
from train.engines import bf16_pays, cpu_facts

_TMP = testlib.scratch_dir("test_reproducible_")
STEPS = 6
# the main job (train/pretrain.py's defaults) for STEPS steps, evaluated on one batch, no sample
MAIN_JOB = ["--max_steps", str(STEPS), "--eval_tokens", "2048", "--sample_tokens", "0", "--no_progress",
            "--log_interval", "1"]
# what a checkpoint holds besides the clock and the invocation's own flags: equal between equal runs
STATE = ("model", "optimizer", "config", "step", "plan", "data", "rng", "router_load", "scaler")
PRETRAIN = os.path.join(ROOT, "train", "pretrain.py")


def pretrain(*argv, threads=2):
    """train/pretrain.py as a process of its own with OMP_NUM_THREADS=threads; returns the CompletedProcess."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    r = subprocess.run([sys.executable, PRETRAIN, *argv], capture_output=True, text=True, env=env, timeout=1800)
    assert r.returncode == 0, f"{argv}: exit {r.returncode}\n{r.stderr[-3000:]}"
    return r


def in_process(*argv, threads=2):
    """train/pretrain.py run inside this process (testlib.run_script: no start-up to pay), torch's thread count
    set to `threads` first (what --threads auto reads; run_script puts it back); returns the CompletedProcess."""
    import torch
    torch.set_num_threads(threads)
    r = testlib.run_script("train/pretrain.py", *argv)
    assert r.returncode == 0, f"{argv}: exit {r.returncode}\n{r.stderr[-3000:]}"
    return r


def assert_same_state(a_dir, b_dir, what):
    """The two checkpoints hold the same STATE entries, bit for bit (compared through their SHA-256)."""
    from train.checkpoint import checksum
    a, b = load_checkpoint(a_dir), load_checkpoint(b_dir)
    differ = [key for key in STATE if checksum({key: a.get(key)}) != checksum({key: b.get(key)})]
    assert not differ, f"{what}: {differ} differ (steps {a['step']} / {b['step']})"


def interrupt_after_a_step(argv, past_step):
    """train/pretrain.py argv (2 threads), sent SIGINT once it logged a training step after past_step; returns
    its stdout once it ended (exit 0 asserted)."""
    proc = subprocess.Popen([sys.executable, PRETRAIN, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, OMP_NUM_THREADS="2"))
    testlib.wait_for_training(proc, argv[argv.index("--out_dir") + 1], past_step, timeout_s=900)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    return out


def main_job_runs(dtype, resume_threads=2):
    """The uninterrupted run of one dtype ("auto" or a name), and the same run stopped by SIGINT after its
    first logged step, then resumed with OMP_NUM_THREADS=resume_threads (the run's 2 threads must win); the
    two must end equal. Returns the dtype the runs trained in."""
    common = [*MAIN_JOB, "--dtype", dtype]
    ref = os.path.join(_TMP, f"ref_{dtype}")
    r = in_process(*common, "--out_dir", ref)
    assert "threads: 2 (auto), fixed for the run" in r.stdout, r.stdout[-2000:]
    assert load_checkpoint(ref)["args"]["threads"] == "2"

    part = os.path.join(_TMP, f"part_{dtype}")
    out = interrupt_after_a_step([*common, "--out_dir", part], past_step=0)
    stopped = load_checkpoint(part)["step"]
    assert 0 < stopped < STEPS, f"SIGINT landed at step {stopped}, not between the first step and the last"
    assert f"--resume --out_dir {part}" in out, out[-2000:]
    # (a process of its own where its OMP_NUM_THREADS is what is tested)
    r = (pretrain("--resume", "--out_dir", part, threads=resume_threads) if resume_threads != 2
         else in_process("--resume", "--out_dir", part))
    assert "threads: 2, fixed for the run" in r.stdout, r.stdout[-2000:]
    assert_same_state(ref, part, f"--dtype {dtype}: SIGINT at step {stopped}, --resume with "
                                 f"OMP_NUM_THREADS={resume_threads}")
    return load_checkpoint(ref)["args"]["dtype"]


def test_main_job_is_bitwise_reproducible_with_dtype_auto():
    """--dtype auto: stopped by SIGINT and resumed under OMP_NUM_THREADS=1, the run equals the uninterrupted
    one."""
    if (os.cpu_count() or 1) < 2:
        raise Skip("needs 2 cores")
    main_job_runs("auto", resume_threads=1)


def test_main_job_is_bitwise_reproducible_in_the_other_dtype():
    """The dtype auto does not pick here (train/engines.py: bf16_pays), named: stopped by SIGINT and resumed,
    the run equals the uninterrupted one."""
    if (os.cpu_count() or 1) < 2:
        raise Skip("needs 2 cores")
    facts = cpu_facts()
    other = "float32" if bf16_pays(facts)[0] else "bfloat16"
    if other == "bfloat16" and not (facts["onednn_bf16"] and (facts["amx"] or facts["avx512_bf16"])):
        raise Skip("bf16 is emulated on this CPU (no AVX512-BF16, no AMX, or oneDNN capped below them): --dtype "
                   "auto never picks it here, and "
                   "PyTorch's reference bf16 GEMMs take tens of times fp32's at the main job's shape")
    main_job_runs(other)


def test_threads_flag_on_resume_is_noted():
    """--threads N on --resume of a run that used another count: taken, with a note that the steps from here
    round differently (nothing else changes)."""
    out = os.path.join(_TMP, "threads_note")
    tiny = ["--hidden_size", "32", "--num_hidden_layers", "1", "--num_attention_heads", "2", "--num_key_value_heads", "1",
            "--moe_intermediate_size", "32", "--seq_len", "32", "--batch_size", "4", "--max_steps", "4",
            "--eval_tokens", "256", "--sample_tokens", "0", "--no_progress", "--stop_after", "2"]
    in_process(*tiny, "--out_dir", out)
    r = in_process("--resume", "--out_dir", out, "--threads", "1")
    assert "note: --threads 1 instead of the run's 2" in r.stderr and "threads: 1, fixed" in r.stdout, r.stderr[-2000:]


TESTS = [test_main_job_is_bitwise_reproducible_with_dtype_auto, test_main_job_is_bitwise_reproducible_in_the_other_dtype,
         test_threads_flag_on_resume_is_noted]

if __name__ == "__main__":
    run(TESTS)
