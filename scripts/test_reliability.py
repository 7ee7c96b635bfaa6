"""Runs that never lose work: a diverging run stops with one line and leaves only finite checkpoints, a
run directory holding another run is refused, one run at a time per directory (and a killed run's lock
does not block the next), temp leftovers of a killed save are removed, a damaged checkpoint is refused.

    python scripts/test_reliability.py
"""
import os
import signal
import subprocess
import sys
import tempfile
import time

import torch

from testlib import ROOT, SHARED, run  # noqa: F401
from train.checkpoint import load_checkpoint

_TMP = tempfile.mkdtemp(prefix="test_reliability_")
TINY = ["--hidden_size", "32", "--num_hidden_layers", "2", "--num_attention_heads", "2", "--num_key_value_heads", "1",
        "--moe_intermediate_size", "32", "--seq_len", "32", "--batch_size", "4", "--vocab_size", "512",
        "--eval_tokens", "512", "--sample_tokens", "0", "--no_progress"]


def data_file():
    path = os.path.join(_TMP, "corpus.txt")
    if not os.path.exists(path):
        src = os.path.join(SHARED, "data", "tinyshakespeare.txt")
        if os.path.exists(src):
            text = open(src, encoding="utf-8").read()[:200_000]
        else:
            from data.corpus import default_corpus
            text = open(default_corpus()["train"], encoding="utf-8").read()[:200_000]
        open(path, "w", encoding="utf-8").write(text)
    return path


def cli(*argv, script="train/pretrain.py", wait=True):
    cmd = [sys.executable, os.path.join(ROOT, script), *argv]
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=_TMP)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=_TMP)


def one_line_error(r, *needles):
    assert r.returncode == 2, f"exit {r.returncode}:\n{r.stderr[-2000:]}"
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and all(n in errors[0] for n in needles), r.stderr[-2000:]
    return errors[0]


def test_divergence_stops_cleanly_and_keeps_the_last_good_checkpoint():
    """lr 1e3 with a 10-step warmup diverges at step 8: exit 2 with one line naming the step; whatever the
    save interval, the checkpoint on disk is finite, from before step 8, and loads for --resume."""
    for save_interval, want_step in ((1, 7), (3, 6), (7, 7)):
        out = os.path.join(_TMP, f"diverge{save_interval}")
        r = cli(*TINY, "--data_path", data_file(), "--learning_rate", "1e3", "--warmup_steps", "10", "--max_steps", "20",
                "--log_interval", "5", "--save_interval", str(save_interval), "--out_dir", out)
        one_line_error(r, "non-finite at step 8", "without saving")
        ckpt = load_checkpoint(out)
        assert ckpt["step"] == want_step, (save_interval, ckpt["step"])
        tensors = list(ckpt["model"].values()) + [v for s in ckpt["optimizer"]["state"].values() for v in s.values()]
        assert all(torch.isfinite(t).all() for t in tensors if t.is_floating_point())
        # it loads and resumes (its weights, finite but blown up by lr 1e3, would diverge again if trained on)
        r = cli("--resume", "--out_dir", out, "--max_steps", str(want_step))
        assert r.returncode == 0 and "nothing to do" in r.stdout, r.stderr[-2000:]


def test_occupied_directory_is_refused_unless_resume_or_overwrite():
    out = os.path.join(_TMP, "occupied")
    assert cli(*TINY, "--data_path", data_file(), "--max_steps", "3", "--out_dir", out).returncode == 0
    before = {n: open(os.path.join(out, n), "rb").read() for n in ("ckpt.pt", "metrics.jsonl")}
    one_line_error(cli(*TINY, "--data_path", data_file(), "--max_steps", "2", "--out_dir", out),
                   "already holds a run", "--resume", "--overwrite")
    assert before == {n: open(os.path.join(out, n), "rb").read() for n in before}, "the refused run changed files"
    r = cli(*TINY, "--data_path", data_file(), "--max_steps", "2", "--out_dir", out, "--overwrite")
    assert r.returncode == 0 and load_checkpoint(out)["step"] == 2, r.stderr[-2000:]


def test_one_run_per_directory_and_a_killed_run_leaves_no_lock_or_temp():
    out = os.path.join(_TMP, "locked")
    first = cli(*TINY, "--data_path", data_file(), "--max_steps", "100000", "--out_dir", out, wait=False)
    lock = os.path.join(out, ".lock")
    deadline = time.time() + 300
    while not (os.path.exists(lock) and open(lock).read().strip()):
        assert first.poll() is None and time.time() < deadline, "the first run did not start"
        time.sleep(0.2)
    try:
        error = one_line_error(cli(*TINY, "--data_path", data_file(), "--max_steps", "2", "--out_dir", out,
                                   "--overwrite"), "in use by another run")
        assert f"pid {first.pid}" in error, error
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    leftover = os.path.join(out, ".ckpt.pt.tmp99999")  # what a kill in the middle of a save leaves
    open(leftover, "wb").write(b"partial")
    r = cli(*TINY, "--data_path", data_file(), "--max_steps", "2", "--out_dir", out, "--overwrite")
    assert r.returncode == 0, r.stderr[-2000:]
    assert not os.path.exists(leftover), "temp leftover of a killed save not removed"


def test_damaged_checkpoint_is_refused_by_every_entry_point():
    """A flipped bit inside a tensor: the checksum catches it in --resume, --init_from, generate, export."""
    out = os.path.join(_TMP, "flip")
    assert cli(*TINY, "--data_path", data_file(), "--max_steps", "2", "--out_dir", out).returncode == 0
    path = os.path.join(out, "ckpt.pt")
    blob = bytearray(open(path, "rb").read())
    blob[len(blob) // 2] ^= 0x04  # the middle of the file: inside the weights
    open(path, "wb").write(bytes(blob))
    for argv, script in ((["--resume", "--out_dir", out], "train/pretrain.py"),
                         ([*TINY, "--init_from", out, "--out_dir", os.path.join(_TMP, "flip_init")], "train/pretrain.py"),
                         (["--ckpt", out, "--prompt", "the"], "scripts/generate.py"),
                         (["--ckpt", out, "--out", os.path.join(_TMP, "flip_export")], "scripts/export_hf.py")):
        r = cli(*argv, script=script)
        assert r.returncode != 0 and "checksum mismatch" in r.stderr and "Traceback" not in r.stderr, \
            f"{script} {argv}:\n{r.stderr[-2000:]}"


def _damaged_checkpoints(src):
    """{case: path} of damaged copies of the checkpoint `src`."""
    from train.checkpoint import atomic_torch_save
    blob, good = open(src, "rb").read(), torch.load(src, weights_only=True)
    folder = os.path.join(_TMP, "damaged")
    os.makedirs(folder, exist_ok=True)
    flipped = bytearray(blob)
    flipped[len(blob) // 2] ^= 0x04
    raw = {"empty": b"", "truncated at 50%": blob[:len(blob) // 2], "last byte cut": blob[:-1],
           "random bytes": os.urandom(4096), "bit flip in a tensor": bytes(flipped)}
    missing = {**good, "model": {k: v for k, v in list(good["model"].items())[1:]}}
    wrong_shape = {**good, "model": {k: v[:-1] if i == 0 else v for i, (k, v) in enumerate(good["model"].items())}}
    bad_config = {**good, "config": {**good["config"], "num_experts_per_tok": 99}}
    paths = {}
    for case, content in raw.items():
        paths[case] = os.path.join(folder, case.replace(" ", "_").replace("%", "") + ".pt")
        open(paths[case], "wb").write(content)
    for case, obj in (("pickled int", 7), ("missing tensor", missing), ("wrong shape", wrong_shape),
                      ("invalid config", bad_config)):
        if isinstance(obj, dict):
            obj.pop("checksum", None)  # as if written so: the structure is what is wrong
        paths[case] = os.path.join(folder, case.replace(" ", "_") + ".pt")
        atomic_torch_save(obj, paths[case])
    return paths


def test_every_malformed_checkpoint_is_a_one_line_error():
    """9 kinds of damage: load_checkpoint raises ValueError naming the file for each; the structural ones
    also give one line and exit 2 from --resume, --init_from, generate.py and export_hf.py."""
    out = os.path.join(_TMP, "matrix")
    assert cli(*TINY, "--data_path", data_file(), "--max_steps", "2", "--out_dir", out).returncode == 0
    paths = _damaged_checkpoints(os.path.join(out, "ckpt.pt"))
    for case, path in paths.items():
        try:
            load_checkpoint(path)
        except ValueError as e:
            assert os.path.basename(path) in str(e) and "\n" not in str(e), (case, e)
        else:
            raise AssertionError(f"{case}: loaded")
    for case in ("wrong shape", "invalid config"):
        run_dir = os.path.join(_TMP, "matrix_" + case.replace(" ", "_"))
        os.makedirs(run_dir, exist_ok=True)
        os.replace(paths[case], os.path.join(run_dir, "ckpt.pt"))
        for argv, script in ((["--resume", "--out_dir", run_dir], "train/pretrain.py"),
                             ([*TINY, "--init_from", run_dir, "--tokenizer", os.path.join(out, "tokenizer"),
                               "--out_dir", run_dir + "_init"], "train/pretrain.py"),
                             (["--ckpt", run_dir, "--tokenizer", os.path.join(out, "tokenizer"), "--prompt", "the"],
                              "scripts/generate.py"),
                             (["--ckpt", run_dir, "--tokenizer", os.path.join(out, "tokenizer"),
                               "--out", run_dir + "_export"], "scripts/export_hf.py")):
            r = cli(*argv, script=script)
            assert r.returncode == 2 and "Traceback" not in r.stderr, f"{case} {script}:\n{r.stderr[-2000:]}"
            assert any(line.startswith("error:") or ": error:" in line for line in r.stderr.splitlines()), r.stderr


def _wait_for_training(proc, out, min_records=2):
    metrics = os.path.join(out, "metrics.jsonl")
    deadline = time.time() + 300
    while not (os.path.exists(metrics) and sum("train_loss" in l for l in open(metrics)) >= min_records):
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read() if proc.poll() is not None else "slow"
        time.sleep(0.05)


def test_stop_signals_save_and_resume_bitwise():
    """SIGTERM / SIGINT mid-run: the step finishes, a checkpoint is written (no save interval was due), the
    run exits 0 with the resume command; resuming gives the weights of an uninterrupted run, bit for bit."""
    common = [*TINY, "--data_path", data_file(), "--max_steps", "100000", "--log_interval", "1",
              "--save_interval", "100000", "--eval_interval", "100000"]
    for sig in (signal.SIGTERM, signal.SIGINT):
        out = os.path.join(_TMP, f"signal_{sig.name}")
        proc = cli(*common, "--out_dir", out, wait=False)
        _wait_for_training(proc, out)
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-2000:]
        assert f"({sig.name})" in stdout and f"--resume --out_dir {out}" in stdout, stdout[-2000:]
        k = load_checkpoint(out)["step"]
        assert cli("--resume", "--out_dir", out, "--stop_after", "3").returncode == 0
        ref = os.path.join(_TMP, f"signal_ref_{sig.name}")
        assert cli(*common, "--out_dir", ref, "--stop_after", str(k + 3)).returncode == 0
        a, b = load_checkpoint(out), load_checkpoint(ref)
        assert a["step"] == b["step"] == k + 3
        for name in a["model"]:
            assert torch.equal(a["model"][name], b["model"][name]), f"{sig.name}: {name} differs after resume"


TESTS = [test_divergence_stops_cleanly_and_keeps_the_last_good_checkpoint,
         test_stop_signals_save_and_resume_bitwise, test_every_malformed_checkpoint_is_a_one_line_error,
         test_occupied_directory_is_refused_unless_resume_or_overwrite,
         test_one_run_per_directory_and_a_killed_run_leaves_no_lock_or_temp,
         test_damaged_checkpoint_is_refused_by_every_entry_point]

if __name__ == "__main__":
    run(TESTS)
