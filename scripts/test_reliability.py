"""Runs that never lose work: a diverging run stops with one line and leaves only finite checkpoints, a
run directory holding another run is refused, one run at a time per directory (and a killed run's lock
does not block the next), temp leftovers of a killed save are removed, a damaged checkpoint is refused,
kill -9s at random moments lose nothing (the resumed run equals an uninterrupted one bit for bit),
and scripts/import_hf.py refuses a damaged HF folder.

    python scripts/test_reliability.py
"""
import copy
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import torch

import testlib
from testlib import ROOT, SHARED, run, run_script
from train.checkpoint import load_checkpoint

_TMP = testlib.scratch_dir("test_reliability_")
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


def cli(*argv, script="train/pretrain.py"):
    """The script run to its end in this process (testlib.run_script): exit code, stdout, stderr."""
    return run_script(script, *argv, cwd=_TMP)


def start(*argv, cwd=_TMP):
    """train/pretrain.py started as a process of its own (to be signalled or killed)."""
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "train", "pretrain.py"), *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=cwd)


def one_line_error(r, *needles):
    assert r.returncode == 2, f"exit {r.returncode}:\n{r.stderr[-2000:]}"
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and all(n in errors[0] for n in needles), r.stderr[-2000:]
    return errors[0]


def test_divergence_stops_cleanly_and_keeps_the_last_good_checkpoint():
    """lr 1e3 with a 10-step warmup diverges at some step N (the same for every save interval: the runs differ
    only in when they save): exit 2 with one line naming the step; whatever the save interval, the checkpoint
    on disk is finite, the last save before step N, and loads for --resume."""
    diverged_at = None
    for save_interval in (1, 3, 7):
        out = os.path.join(_TMP, f"diverge{save_interval}")
        r = cli(*TINY, "--data_path", data_file(), "--learning_rate", "1e3", "--warmup_steps", "10", "--max_steps", "20",
                "--log_interval", "5", "--save_interval", str(save_interval), "--out_dir", out)
        error = one_line_error(r, "non-finite at step", "without saving")
        step = int(re.search(r"non-finite at step (\d+)", error).group(1))
        assert diverged_at in (None, step), f"save interval {save_interval}: diverged at {step}, before at {diverged_at}"
        assert step > 7, f"diverged at step {step}, too early to check the save intervals"
        diverged_at, want_step = step, (step - 1) // save_interval * save_interval
        ckpt = load_checkpoint(out)
        assert ckpt["step"] == want_step, (save_interval, ckpt["step"])
        tensors = list(ckpt["model"].values()) + [v for s in ckpt["optimizer"]["state"].values() for v in s.values()]
        assert all(torch.isfinite(t).all() for t in tensors if t.is_floating_point())
        # it loads and resumes (its weights, finite but blown up by lr 1e3, would diverge again if trained on)
        from train.pretrain import parse_args, train
        said = []
        train(parse_args(["--resume", "--out_dir", out, "--max_steps", str(want_step)]), log=said.append)
        assert any("nothing to do" in line for line in said), said


def test_occupied_directory_is_refused_unless_resume_or_overwrite():
    out = os.path.join(_TMP, "occupied")
    assert cli(*TINY, "--data_path", data_file(), "--max_steps", "3", "--out_dir", out).returncode == 0
    before = {n: open(os.path.join(out, n), "rb").read() for n in ("ckpt.pt", "metrics.jsonl")}
    one_line_error(cli(*TINY, "--data_path", data_file(), "--max_steps", "2", "--out_dir", out),
                   "already holds a run", "--resume", "--overwrite")
    assert before == {n: open(os.path.join(out, n), "rb").read() for n in before}, "the refused run changed files"
    r = cli(*TINY, "--data_path", data_file(), "--max_steps", "2", "--out_dir", out, "--overwrite")
    assert r.returncode == 0 and load_checkpoint(out)["step"] == 2, r.stderr[-2000:]


def test_resume_into_a_folder_holding_another_run_is_refused_unless_overwrite():
    """--resume A --out_dir B, B holding another run (other sizes): one error line (--overwrite or another
    --out_dir), exit 2, B's ckpt.pt and metrics.jsonl unchanged. With --overwrite the continuation replaces
    B: its checkpoint is A's run, its metrics A's records up to the resumed step (none of B's) then the new
    steps. B then holds the very checkpoint resumed: --resume B --out_dir B/. (another spelling) continues."""
    a, b = os.path.join(_TMP, "resume_from"), os.path.join(_TMP, "resume_into")
    assert cli(*TINY, "--data_path", data_file(), "--max_steps", "6", "--stop_after", "3", "--log_interval", "1",
               "--out_dir", a).returncode == 0
    other = [*TINY, "--hidden_size", "48", "--num_hidden_layers", "1"]
    assert cli(*other, "--data_path", data_file(), "--max_steps", "2", "--log_interval", "1", "--out_dir", b).returncode == 0
    before = {n: open(os.path.join(b, n), "rb").read() for n in ("ckpt.pt", "metrics.jsonl")}
    one_line_error(cli("--resume", a, "--out_dir", b), "already holds a run", "--overwrite", "--out_dir")
    assert before == {n: open(os.path.join(b, n), "rb").read() for n in before}, "the refused resume changed B"
    r = cli("--resume", os.path.join(a, "ckpt.pt"), "--out_dir", b, "--overwrite", "--stop_after", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    ckpt = load_checkpoint(b)
    assert ckpt["step"] == 5 and ckpt["config"]["hidden_size"] == 32, (ckpt["step"], ckpt["config"]["hidden_size"])
    r = cli("--resume", b, "--out_dir", os.path.join(b, "."))
    assert r.returncode == 0 and load_checkpoint(b)["step"] == 6, r.stderr[-2000:]
    carried, ran = _records(a), _records(b)
    assert ran[:len(carried)] == carried, f"B's metrics do not start with A's:\n{ran}\n{carried}"
    steps = [rec["step"] for rec in ran[len(carried):]]
    assert steps and steps == sorted(steps) and steps[0] > 3 and steps[-1] == 6, [rec["step"] for rec in ran]
    # a finished run resumed into a new folder with nothing left to train: the folder still gets the run
    copy_dir = os.path.join(_TMP, "resume_copy")
    r = cli("--resume", b, "--out_dir", copy_dir)
    assert r.returncode == 0 and "nothing to do" in r.stdout, r.stderr[-2000:]
    got, want = load_checkpoint(copy_dir), load_checkpoint(b)
    assert got["step"] == 6 and all(torch.equal(got["model"][k], v) for k, v in want["model"].items())
    assert os.path.exists(os.path.join(copy_dir, "config.json")) and _records(copy_dir) == _records(b)


def test_one_run_per_directory_and_a_killed_run_leaves_no_lock_or_temp():
    out = os.path.join(_TMP, "locked")
    first = start(*TINY, "--data_path", data_file(), "--max_steps", "100000", "--out_dir", out)
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


def test_a_change_anywhere_in_a_checkpoint_is_a_one_line_error():
    """One value outside the tensors changed and the file saved again (as a flipped bit in its pickle would):
    the config (num_experts_per_tok 2 -> 3), a flag, the step, the plan, the clock, the data position, a
    parameter's name in the optimizer state (its moments would be dropped silently). Each:
    --resume is one `error:` line naming the file, exit 2; the original file then resumes."""
    out = os.path.join(_TMP, "edited")
    assert cli(*TINY, "--data_path", data_file(), "--max_steps", "4", "--stop_after", "2", "--out_dir", out).returncode == 0
    path = os.path.join(out, "ckpt.pt")
    good = torch.load(path, weights_only=True)
    first_int = lambda d: next(k for k, v in d.items() if isinstance(v, int) and not isinstance(v, bool))  # noqa: E731
    renamed = lambda d: {k + "_" if i == 0 else k: v for i, (k, v) in enumerate(d.items())}  # noqa: E731
    edits = {"config": lambda c: c["config"].update(num_experts_per_tok=3),
             "flag": lambda c: c["args"].update(learning_rate=c["args"]["learning_rate"] * 2),
             "step": lambda c: c.update(step=c["step"] + 1),
             "plan": lambda c: c["plan"].update(end=c["plan"]["end"] + 1),
             "clock": lambda c: c.update(train_time_s=c["train_time_s"] + 1.0),
             "data position": lambda c: c["data"].update({first_int(c["data"]): c["data"][first_int(c["data"])] + 1}),
             "a key": lambda c: c["optimizer"].update(state=renamed(c["optimizer"]["state"]))}
    for what, edit in edits.items():
        ckpt = copy.deepcopy(good)
        edit(ckpt)
        torch.save(ckpt, path)
        r = cli("--resume", "--out_dir", out)
        one_line_error(r, path, "checksum mismatch")
    torch.save(good, path)
    assert cli("--resume", "--out_dir", out).returncode == 0


def _damaged_checkpoints(src):
    """{case: path} of damaged copies of the checkpoint `src`."""
    from train.checkpoint import CHECKSUM_KEY, atomic_torch_save, checksum
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
    no_checksum = {k: v for k, v in good.items() if k != CHECKSUM_KEY}
    per_expert = {**good, "model": per_expert_weights(good)}
    old_checksum = {**no_checksum, "checksum": "0" * 64}  # (the key of the tensors-only SHA-256 once written)
    for case, obj in (("pickled int", 7), ("missing tensor", missing), ("wrong shape", wrong_shape),
                      ("invalid config", bad_config), ("no checksum", no_checksum), ("per-expert weights", per_expert),
                      ("old checksum", old_checksum)):
        if isinstance(obj, dict) and obj is not no_checksum and obj is not old_checksum:
            obj[CHECKSUM_KEY] = checksum(obj)  # as if written so: the structure is what is wrong
        paths[case] = os.path.join(folder, case.replace(" ", "_") + ".pt")
        atomic_torch_save(obj, paths[case])
    return paths


def per_expert_weights(ckpt):
    """A checkpoint's weights under the per-expert names train/ saved until commit bac3f7d (the module's own
    state_dict keys)."""
    from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
    model = MiniMindForCausalLM(MiniMindConfig.from_dict(ckpt["config"]))
    model.load_state_dict(ckpt["model"])
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_every_malformed_checkpoint_is_a_one_line_error():
    """12 kinds of damage: load_checkpoint raises ValueError naming the file for each, a checkpoint of the
    format before the stacked expert names (per-expert weights, or the older tensors-only checksum) naming
    the commit that wrote it last; the structural ones also give one line and exit 2 from the entry points
    that read a checkpoint (each through the same check_weights_fit_config): a wrong shape from --resume and
    generate.py, an invalid config from --init_from and export_hf.py, per-expert weights from --resume and
    export_hf.py."""
    out = os.path.join(_TMP, "matrix")
    assert cli(*TINY, "--data_path", data_file(), "--max_steps", "2", "--out_dir", out).returncode == 0
    paths = _damaged_checkpoints(os.path.join(out, "ckpt.pt"))
    for case, path in paths.items():
        try:
            load_checkpoint(path)
        except ValueError as e:
            assert os.path.basename(path) in str(e) and "\n" not in str(e), (case, e)
            assert ("e10cf75" in str(e)) == (case in ("per-expert weights", "old checksum")), (case, e)
        else:
            raise AssertionError(f"{case}: loaded")
    import torch.distributed.checkpoint as dcp
    from train.checkpoint import CHECKSUM_KEY, _file_sha256, atomic_torch_save, checksum
    good = load_checkpoint(os.path.join(out, "ckpt.pt"))
    sharded = os.path.join(_TMP, "matrix_sharded")  # a sharded checkpoint under the per-expert names
    dcp.save({"model": per_expert_weights(good)}, checkpoint_id=sharded, no_dist=True)
    state = {"config": good["config"], "files": {n: _file_sha256(os.path.join(sharded, n)) for n in os.listdir(sharded)}}
    state[CHECKSUM_KEY] = checksum(state)
    atomic_torch_save(state, os.path.join(sharded, "state.pt"))
    try:
        load_checkpoint(sharded, weights=False)
    except ValueError as e:
        assert sharded in str(e) and "e10cf75" in str(e) and "\n" not in str(e), e
    else:
        raise AssertionError("a per-expert sharded checkpoint loaded")
    for case in ("wrong shape", "invalid config", "per-expert weights"):
        run_dir = os.path.join(_TMP, "matrix_" + case.replace(" ", "_"))
        os.makedirs(run_dir, exist_ok=True)
        os.replace(paths[case], os.path.join(run_dir, "ckpt.pt"))
        entry_points = ((["--resume", "--out_dir", run_dir], "train/pretrain.py"),
                        (["--ckpt", run_dir, "--tokenizer", os.path.join(out, "tokenizer"), "--prompt", "the"],
                         "scripts/generate.py")) if case == "wrong shape" else (
                       (["--resume", "--out_dir", run_dir], "train/pretrain.py"),
                       (["--ckpt", run_dir, "--tokenizer", os.path.join(out, "tokenizer"),
                         "--out", run_dir + "_export"], "scripts/export_hf.py")) if case == "per-expert weights" else (
                       ([*TINY, "--init_from", run_dir, "--tokenizer", os.path.join(out, "tokenizer"),
                         "--out_dir", run_dir + "_init"], "train/pretrain.py"),
                       (["--ckpt", run_dir, "--tokenizer", os.path.join(out, "tokenizer"),
                         "--out", run_dir + "_export"], "scripts/export_hf.py"))
        for argv, script in entry_points:
            r = cli(*argv, script=script)
            assert r.returncode == 2 and "Traceback" not in r.stderr, f"{case} {script}:\n{r.stderr[-2000:]}"
            assert any(line.startswith("error:") or ": error:" in line for line in r.stderr.splitlines()), r.stderr


def test_stop_signal_saves_and_resumes_bitwise():
    """SIGTERM mid-run (SIGINT: test_reproducible.py, at the main job's shape): the step finishes, a checkpoint is
    written (no save interval was due), the run exits 0 with the resume command (`<the interpreter running>
    train/pretrain.py --resume --out_dir DIR`, the interpreter relative when it lies under the working
    directory: run from the repo root here, so the hint works as printed); resuming with that command gives the
    weights of an uninterrupted run, bit for bit."""
    import shlex
    common = [*TINY, "--data_path", data_file(), "--max_steps", "100000", "--time_budget_s", "0", "--log_interval", "1",
              "--save_interval", "100000", "--eval_interval", "100000"]
    for sig in (signal.SIGTERM,):
        out = os.path.join(_TMP, f"signal_{sig.name}")
        proc = start(*common, "--out_dir", out, cwd=ROOT)
        testlib.wait_for_training(proc, out, past_step=1, log=lambda: proc.stderr.read() if proc.poll() is not None else "")
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-2000:]
        k = load_checkpoint(out)["step"]
        python = os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(ROOT + os.sep) else sys.executable
        hint = f"stopped at step {k} ({sig.name}); continue with: {python} train/pretrain.py --resume --out_dir {out}"
        assert hint in stdout.splitlines(), (hint, stdout[-2000:])
        r = subprocess.run(shlex.split(hint.split("continue with: ")[1]) + ["--stop_after", "3"], cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        ref = os.path.join(_TMP, f"signal_ref_{sig.name}")
        r_ref = cli(*common, "--out_dir", ref, "--stop_after", str(k + 3))
        assert r_ref.returncode == 0, r_ref.stderr[-2000:]
        a, b = load_checkpoint(out), load_checkpoint(ref)
        assert a["step"] == b["step"] == k + 3
        # (the runs' --dtype auto lines, shown if the weights differ)
        dtypes = [line for o in (stdout, r.stdout, r_ref.stdout) for line in o.splitlines() if "dtype auto" in line]
        for name in a["model"]:
            assert torch.equal(a["model"][name], b["model"][name]), f"{sig.name}: {name} differs after resume (step {k}; {dtypes})"


# --- what a new user meets: refusals before any work, switches and flags on resume, several ranks, a
# damaged tokenizer, --init_from an HF folder, file modes


def _bad_jsonl():
    path = os.path.join(_TMP, "bad.jsonl")
    with open(path, "w") as f:
        f.write('{"text": "fine"}\n{"text": oops}\n')
    return path


def test_refused_runs_leave_no_folder():
    """A bad config is refused at setup before any folder is made (exit 2, one error line naming the flag,
    nothing else), a bad flag value at parse time (exit 2, a usage hint and one error line) and a malformed
    data file at the data step: none leaves the fresh --out_dir behind; a folder that existed before keeps
    its files."""
    fresh = os.path.join(_TMP, "refused_config")
    r = cli(*TINY, "--data_path", data_file(), "--num_experts_per_tok", "8", "--out_dir", fresh)
    one_line_error(r, "--num_experts_per_tok 8 must be <= --num_experts 4")
    assert r.stderr.splitlines() == ["error: --num_experts_per_tok 8 must be <= --num_experts 4"], r.stderr
    assert not os.path.exists(fresh), "a run refused for its config created its --out_dir"
    r = cli(*TINY, "--data_path", data_file(), "--num_experts_per_tok", "0", "--out_dir", fresh)
    one_line_error(r, "--num_experts_per_tok must be >= 1")
    assert len(r.stderr.splitlines()) == 2 and "see --help" in r.stderr.splitlines()[0], r.stderr
    assert not os.path.exists(fresh), "a run refused at parse time created its --out_dir"
    fresh = os.path.join(_TMP, "refused_data")
    one_line_error(cli(*TINY, "--data_path", _bad_jsonl(), "--out_dir", fresh), "bad.jsonl:2")
    assert not os.path.exists(fresh), "a run refused at the data step left its --out_dir behind"
    kept = os.path.join(_TMP, "refused_kept")
    os.makedirs(kept)
    open(os.path.join(kept, "notes.txt"), "w").write("mine")
    one_line_error(cli(*TINY, "--data_path", _bad_jsonl(), "--out_dir", kept), "bad.jsonl:2")
    assert open(os.path.join(kept, "notes.txt")).read() == "mine"


def test_resume_turns_switches_off_and_saves_the_flags_it_used():
    """--progress turns off an inherited --no_progress (--no_compile, --no_wandb likewise); architecture
    flags ignored on resume (with a warning) are not saved: the next checkpoint holds the run's values, so
    the following resume has nothing to warn about."""
    out = os.path.join(_TMP, "switches")
    assert cli(*TINY, "--data_path", data_file(), "--max_steps", "4", "--stop_after", "2", "--out_dir", out).returncode == 0
    r = cli("--resume", "--out_dir", out, "--progress", "--hidden_size", "64", "--num_experts_per_tok", "1",
            "--stop_after", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    assert ("warning: --hidden_size, --num_experts_per_tok ignored on resume: the architecture comes from the "
            "checkpoint") in r.stderr, r.stderr[-2000:]
    assert "3/4" in r.stdout, f"no progress bar after --progress:\n{r.stdout[-2000:]}"
    saved = load_checkpoint(out)["args"]
    assert saved["no_progress"] is False and saved["hidden_size"] == 32 and saved["num_experts_per_tok"] == 2, saved
    r = cli("--resume", "--out_dir", out)
    assert r.returncode == 0 and "ignored" not in r.stderr and "4/4" in r.stdout, r.stderr[-2000:]
    from train.checkpoint import CHECKSUM_KEY, atomic_torch_save, checksum
    from train.pretrain import parse_args
    ckpt = load_checkpoint(out)
    ckpt["args"].update(compile=True, wandb=True)
    ckpt[CHECKSUM_KEY] = checksum(ckpt)  # (as if the run had been started with them)
    atomic_torch_save(ckpt, os.path.join(_TMP, "switches_on", "ckpt.pt"))
    on = parse_args(["--resume", os.path.join(_TMP, "switches_on")])
    off = parse_args(["--resume", os.path.join(_TMP, "switches_on"), "--no_compile", "--no_wandb", "--no_progress"])
    assert (on.compile, on.wandb, on.no_progress) == (True, True, False)
    assert (off.compile, off.wandb, off.no_progress) == (False, False, True)


def _two_ranks(*argv):
    """train/pretrain.py as 2 gloo ranks (torchrun's environment variables, without torchrun's own report)."""
    from testlib import free_port
    port, procs = free_port(), []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, os.path.join(ROOT, "train", "pretrain.py"), *argv], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=_TMP))
    outs = [p.communicate(timeout=600) for p in procs]
    return [subprocess.CompletedProcess(p.args, p.returncode, o, e) for p, (o, e) in zip(procs, outs)]


def test_two_ranks_say_how_they_split_and_stop_quietly_when_rank0_fails():
    """Rank 0 prints world / data-parallel / expert-parallel size once. When rank 0 fails in data
    preparation it prints the one error line; rank 1 stops with exit 2 and a note, no traceback."""
    out = os.path.join(_TMP, "ranks_bad")
    r0, r1 = _two_ranks(*TINY, "--data_path", _bad_jsonl(), "--out_dir", out)
    one_line_error(r0, "bad.jsonl:2")
    assert r1.returncode == 2 and "Traceback" not in r1.stderr and "error:" not in r1.stderr, r1.stderr[-2000:]
    assert "note: rank 1 stops: rank 0 failed (DataError: " in r1.stderr, r1.stderr[-2000:]
    assert not os.path.exists(out)
    out = os.path.join(_TMP, "ranks_good")
    r0, r1 = _two_ranks(*TINY, "--data_path", data_file(), "--max_steps", "2", "--batch_size", "2", "--ep_size", "2",
                        "--out_dir", out)
    assert r0.returncode == r1.returncode == 0, r0.stderr[-2000:] + r1.stderr[-2000:]
    said = [line for line in r0.stdout.splitlines() if line.startswith("distributed:")]
    assert said == ["distributed: world size 2 (gloo), data parallel size 2, expert parallel size 2 (2 of the 4 "
                    "experts per rank); the experts sharded over the 1 rank(s) holding them, the rest replicated "
                    "(FSDP2)"], \
        r0.stdout[-2000:]
    assert "distributed:" not in r1.stdout


def test_damaged_tokenizer_is_a_one_line_error():
    """A tokenizer.json cut short or not a tokenizer, given by --tokenizer, found in a run dir on --resume,
    or by generate.py: one line naming the file, exit 2, no traceback."""
    import shutil
    out = os.path.join(_TMP, "tok_run")
    assert cli(*TINY, "--data_path", data_file(), "--max_steps", "2", "--out_dir", out).returncode == 0
    for case, damage in (("cut", lambda text: text[:len(text) // 2]), ("foreign", lambda text: '{"a": 1}')):
        tok = os.path.join(_TMP, f"tok_{case}")
        shutil.copytree(os.path.join(out, "tokenizer"), tok)
        path = os.path.join(tok, "tokenizer.json")
        text = open(path).read()
        open(path, "w").write(damage(text))
        one_line_error(cli(*TINY, "--data_path", data_file(), "--tokenizer", tok, "--out_dir", tok + "_run"), path)
    path = os.path.join(out, "tokenizer", "tokenizer.json")
    text = open(path).read()
    open(path, "w").write(text[:len(text) // 2])
    one_line_error(cli("--resume", "--out_dir", out, "--max_steps", "3"), path)
    one_line_error(cli("--ckpt", out, "--prompt", "the", script="scripts/generate.py"), path)


def test_init_from_hf_copies_the_tokenizer_only_and_outputs_get_umask_modes():
    """Under umask 022 every file and folder a run, export_hf.py and an --init_from run write is 0644 / 0755
    (model.safetensors included); --init_from an exported HF folder copies only its tokenizer files into
    out_dir/tokenizer/, not the weights or configs."""
    import stat
    from train.run_dir import TOKENIZER_FILES
    umask = os.umask(0o022)
    try:
        out, exp, init = (os.path.join(_TMP, f"modes_{n}") for n in ("run", "export", "init"))
        assert cli(*TINY, "--data_path", data_file(), "--max_steps", "2", "--out_dir", out).returncode == 0
        r = cli("--ckpt", out, "--out", exp, script="scripts/export_hf.py")
        assert r.returncode == 0, r.stderr[-2000:]
        r = cli(*TINY, "--init_from", exp, "--data_path", data_file(), "--max_steps", "1", "--out_dir", init)
        assert r.returncode == 0, r.stderr[-2000:]
    finally:
        os.umask(umask)
    names = set(os.listdir(os.path.join(init, "tokenizer")))
    assert "tokenizer.json" in names and names <= set(TOKENIZER_FILES), names
    wrong = []
    for top in (out, exp, init):
        paths = [top] + [os.path.join(root, n) for root, dirs, files in os.walk(top) for n in dirs + files]
        for p in paths:
            mode, want = stat.S_IMODE(os.stat(p).st_mode), 0o755 if os.path.isdir(p) else 0o644
            if mode != want:
                wrong.append(f"{os.path.relpath(p, _TMP)}: {mode:o}")
    assert not wrong, f"not the umask's modes: {wrong}"


# --- kill -9 at random moments of a run saving every step; the HF-folder share of the malformed-checkpoint
# matrix (scripts/import_hf.py)


def _temp_names(folder):
    """Names of the temp files / folders interrupted atomic writes leave (data/atomic.py: `.<name>.tmp...`)."""
    return {n for n in os.listdir(folder) if n.startswith(".") and ".tmp" in n} if os.path.isdir(folder) else set()


def _file_id(path):
    """(inode, mtime) of path, None when absent: changes with every atomic replace."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns


def _start(argv, log):
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "train/pretrain.py"), *argv], cwd=_TMP,
                            stdout=log, stderr=subprocess.STDOUT)


def _wait_for_save(proc, ckpt, before, timeout=300):
    """Seconds until ckpt changes from `before` (the run saved), polling every 2 ms."""
    t0 = time.time()
    while _file_id(ckpt) == before:
        assert proc.poll() is None and time.time() < t0 + timeout, f"no save (exit {proc.poll()})"
        time.sleep(0.002)
    return time.time() - t0


def _records(run_dir):
    """metrics.jsonl records, timing aside."""
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [{k: v for k, v in json.loads(line).items() if k not in ("tok_per_s", "train_time_s")} for line in f]


KILLS = 4  # half during start-up, a quarter within two steps after a save, a quarter as a save's temp file shows


def test_kill_9_loop_never_loses_work():
    """KILLS SIGKILLs at seeded random moments of a run saving every step: even kills at 0-120% of the time
    a start takes to its first save (imports, data, the lock, the step-0 evaluation, step 1; at the latest
    as that save shows), odd kills
    after the restart's first save, within two steps or the moment a save's temp file shows. After each
    kill ckpt.pt (once there is one) loads with its checksum verified and its step never goes back; the
    next start removes the killed runs' temp files; the run then finishes, leaves no temp file, and its
    weights, optimizer state and metrics records equal an uninterrupted run's bit for bit."""
    rng = random.Random(0)
    common = [*TINY, "--data_path", data_file(), "--max_steps", "60", "--save_interval", "1", "--log_interval", "1"]
    log = open(os.path.join(_TMP, "kill_loop.log"), "ab")
    ref, saves = os.path.join(_TMP, "kill_ref"), []
    t0, proc = time.time(), _start([*common, "--out_dir", ref], log)
    while proc.poll() is None:  # the uninterrupted run, timed: startup until its first save, then per step
        now = _file_id(os.path.join(ref, "ckpt.pt"))
        if now is not None and (not saves or now != saves[-1][1]):
            saves.append((time.time() - t0, now))
        time.sleep(0.002)
    assert proc.returncode == 0 and len(saves) > 10, open(log.name, errors="replace").read()[-2000:]
    startup, step_s = saves[0][0], (saves[-1][0] - saves[0][0]) / (len(saves) - 1)  # startup: updated below
    out = os.path.join(_TMP, "kill_loop")
    ckpt, last_step, pending, temp_hits = os.path.join(out, "ckpt.pt"), 0, set(), 0
    for i in range(KILLS):
        before = _file_id(ckpt)
        proc = _start(["--resume", "--out_dir", out] if before else [*common, "--out_dir", out], log)
        if i % 2 == 0:  # (at the latest when this start's first save shows: a fast start may finish the run)
            deadline = time.time() + rng.uniform(0, 1.2) * startup
            while time.time() < deadline and _file_id(ckpt) == before and proc.poll() is None:
                time.sleep(0.002)
        else:
            startup = _wait_for_save(proc, ckpt, before)
            stale = pending & _temp_names(out)
            assert not stale, f"kill {i}: the next start left the killed runs' temp files {sorted(stale)}"
            pending = set()
            if i % 4 == 1:
                time.sleep(rng.uniform(0, 2 * step_s))
            else:  # the moment a temp file of a save shows
                while not _temp_names(out) and proc.poll() is None:
                    time.sleep(0.001)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL, f"kill {i}: the run ended by itself (exit {proc.returncode})"
        left = _temp_names(out)
        pending |= left
        temp_hits += bool(left)
        if os.path.exists(ckpt):
            step = load_checkpoint(out)["step"]  # ValueError on a torn or damaged file
            assert step >= last_step, f"kill {i}: the checkpoint went back from step {last_step} to {step}"
            last_step = step
    assert temp_hits, "no kill hit a save: the temp-file cleanup went untested"
    proc = _start(["--resume", "--out_dir", out], log)
    assert proc.wait() == 0, open(log.name, errors="replace").read()[-2000:]
    assert not _temp_names(out), f"temp files left: {sorted(_temp_names(out))}"
    a, b = load_checkpoint(out), load_checkpoint(ref)
    assert a["step"] == b["step"] == 60
    for name in b["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), f"{name} differs from the uninterrupted run"
    for i, state in b["optimizer"]["state"].items():
        assert all(torch.equal(a["optimizer"]["state"][i][k], v) for k, v in state.items()), f"optimizer state {i}"
    assert _records(out) == _records(ref), "metrics.jsonl differs from the uninterrupted run's"
    print(f"    startup {startup:.1f}s, {step_s:.3f}s/step; {temp_hits} of {KILLS} kills left temp files; the checkpoint "
          f"was at step {last_step} before the final start")


def _hf_export():
    """(run dir, HF folder): a tiny model trained 2 steps and exported by scripts/export_hf.py, whose
    model.safetensors carries the checksum entry."""
    from safetensors import safe_open

    from train.hf_folder import HF_CHECKSUM_KEY
    run_dir, hf = os.path.join(_TMP, "hf_src"), os.path.join(_TMP, "hf_export")
    assert cli(*TINY, "--data_path", data_file(), "--max_steps", "2", "--out_dir", run_dir).returncode == 0
    r = cli("--ckpt", run_dir, "--out", hf, script="scripts/export_hf.py")
    assert r.returncode == 0, r.stderr[-2000:]
    path = os.path.join(hf, "model.safetensors")
    with safe_open(path, "pt") as f:
        assert HF_CHECKSUM_KEY in (f.metadata() or {}), "export_hf.py wrote no checksum"
    return run_dir, hf


def _damaged_hf_folders(hf):
    """{case: (damaged folder, the file damaged)}: copies of the HF folder `hf`, one file changed in each."""
    from safetensors.torch import load_file, save

    from train.hf_folder import safetensors_metadata
    blob = open(os.path.join(hf, "model.safetensors"), "rb").read()
    data_start = 8 + int.from_bytes(blob[:8], "little")  # u64 header length, JSON header, then the tensor bytes
    flipped = bytearray(blob)
    flipped[data_start + (len(blob) - data_start) // 2] ^= 0x04
    state = load_file(os.path.join(hf, "model.safetensors"))
    q = next(k for k in state if k.endswith("q_proj.weight"))
    missing = {k: v for k, v in state.items() if k != "model.norm.weight"}
    wrong_shape = {**state, q: state[q][:-1].clone()}
    config = json.load(open(os.path.join(hf, "config.json"), encoding="utf-8"))
    cases = {"empty": b"", "truncated at 50%": blob[:len(blob) // 2], "last byte cut": blob[:-1],
             "random bytes": os.urandom(4096), "bit flip in a tensor": bytes(flipped),
             # consistent checksums: the structure is what is wrong
             "missing tensor": save(missing, metadata=safetensors_metadata(missing)),
             "wrong shape": save(wrong_shape, metadata=safetensors_metadata(wrong_shape)),
             "invalid JSON": b'{"model_type": "qwen3_moe", "hidden_size": ',
             "invalid config value": json.dumps({**config, "num_experts_per_tok": 99}).encode(),
             "invalid config type": json.dumps({**config, "hidden_size": "32"}).encode()}
    folders = {}
    for case, content in cases.items():
        folder = os.path.join(_TMP, "hf_damaged", case.replace(" ", "_").replace("%", ""))
        shutil.copytree(hf, folder)
        name = "config.json" if "config" in case or "JSON" in case else "model.safetensors"
        open(os.path.join(folder, name), "wb").write(content)
        folders[case] = (folder, name)
    return folders


def test_import_hf_refuses_every_damaged_folder():
    """The HF-folder share of the malformed-checkpoint matrix: model.safetensors empty, truncated at 50%,
    cut by one byte, random bytes, a flipped bit inside a tensor (the checksum export_hf.py stores), a
    missing tensor, a wrong shape; config.json not JSON, an invalid value, a wrong type. load_hf_checked
    raises one line naming the file for each; import_hf.py exits 2 with one "error:" line naming the file, no
    traceback and no output folder for each, and so do `pretrain.py --init_from` and generate.py, which read
    the folder through the same load_hf_checked, for every other case each (alternating); the intact folder
    imports bit for bit, and transformers still loads it with the checksum entry."""
    from transformers import AutoModelForCausalLM

    from train.hf_folder import load_hf_checked
    run_dir, hf = _hf_export()
    hf_model = AutoModelForCausalLM.from_pretrained(hf)  # the checksum entry does not bother transformers
    assert torch.equal(hf_model.model.embed_tokens.weight, load_checkpoint(run_dir)["model"]["model.embed_tokens.weight"])
    for i, (case, (folder, name)) in enumerate(_damaged_hf_folders(hf).items()):
        try:
            load_hf_checked(folder)
        except ValueError as e:
            assert os.path.join(folder, name) in str(e) and "\n" not in str(e), (case, e)
        else:
            raise AssertionError(f"{case}: loaded")
        out = folder + "_imported"
        error = one_line_error(cli("--hf", folder, "--out", out, script="scripts/import_hf.py"), name)
        assert case != "bit flip in a tensor" or "checksum mismatch" in error, error
        assert not os.path.exists(out), f"{case}: import left {out}"
        if i % 2 == 0:
            one_line_error(cli(*TINY, "--init_from", folder, "--data_path", data_file(), "--out_dir", out), name)
            assert not os.path.exists(out), f"{case}: --init_from left {out}"
        else:
            one_line_error(cli("--ckpt", folder, "--prompt", "the", script="scripts/generate.py"), name)
    out = os.path.join(_TMP, "hf_imported")
    r = cli("--hf", hf, "--out", out, script="scripts/import_hf.py")
    assert r.returncode == 0 and not _temp_names(_TMP), r.stderr[-2000:]
    from model.hf_adapter import to_hf_state_dict
    from model.model_minimind import MiniMindConfig
    from train.checkpoint import model_from_checkpoint
    src = model_from_checkpoint(load_checkpoint(run_dir)).state_dict()
    folded = to_hf_state_dict(src, MiniMindConfig.from_dict(load_checkpoint(run_dir)["config"]))
    # (what the export holds: routed_scaling_factor folded into the down projections)
    a, b = model_from_checkpoint(load_checkpoint(out)).state_dict(), {**src, **folded}
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b), "import is not the exported model"


TESTS = [test_a_change_anywhere_in_a_checkpoint_is_a_one_line_error, test_divergence_stops_cleanly_and_keeps_the_last_good_checkpoint,
         test_stop_signal_saves_and_resumes_bitwise, test_every_malformed_checkpoint_is_a_one_line_error,
         test_occupied_directory_is_refused_unless_resume_or_overwrite,
         test_resume_into_a_folder_holding_another_run_is_refused_unless_overwrite,
         test_one_run_per_directory_and_a_killed_run_leaves_no_lock_or_temp,
         test_damaged_checkpoint_is_refused_by_every_entry_point,
         test_refused_runs_leave_no_folder, test_resume_turns_switches_off_and_saves_the_flags_it_used,
         test_two_ranks_say_how_they_split_and_stop_quietly_when_rank0_fails, test_damaged_tokenizer_is_a_one_line_error,
         test_init_from_hf_copies_the_tokenizer_only_and_outputs_get_umask_modes,
         test_kill_9_loop_never_loses_work, test_import_hf_refuses_every_damaged_folder]

if __name__ == "__main__":
    run(TESTS)
