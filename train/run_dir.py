"""Claiming a run directory: one run at a time, and never another run's checkpoint by accident.

A new run refuses a directory that already holds a checkpoint unless the user says `--resume` (continue
it) or `--overwrite` (start over). Rank 0 then holds an exclusive lock (`fcntl.flock` on out_dir/.lock)
for the whole run, so a second run there stops at once with a message naming the holder; the kernel
drops the lock when the holder dies, so a killed run never leaves a stale lock. Under the lock, temp
files that a killed save left behind (data/atomic.py names them `.<name>.tmp...`) are removed. A run
that fails before training in a folder it created removes the folder again (`abandon_run_dir`).
"""
import fcntl
import os
import re
import shutil
import socket

from train.checkpoint import CKPT_NAME

LOCK_NAME = ".lock"
_TEMP = re.compile(r"^\..+\.(tmp|old)[^/]*$")  # atomic_file / atomic_dir leftovers


def claim_run_dir(out_dir, resuming, overwrite, is_main):
    """Create out_dir, refuse it when it holds another run, lock it (rank 0) and clean temp leftovers.
    Returns the open lock file (keep it for the run; closing it releases the lock) or None on other ranks.
    Raises ValueError naming the directory and what to do."""
    os.makedirs(out_dir, exist_ok=True)
    ckpt = os.path.join(out_dir, CKPT_NAME)
    if not resuming and not overwrite and os.path.exists(ckpt):
        raise ValueError(f"{out_dir} already holds a run ({CKPT_NAME}); continue it with --resume, start over "
                         f"with --overwrite, or choose another --out_dir")
    if not is_main:
        return None
    lock = open(os.path.join(out_dir, LOCK_NAME), "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "another process"
        lock.close()
        raise ValueError(f"{out_dir} is in use by another run ({holder}); wait for it to finish or choose "
                         f"another --out_dir") from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    lock.flush()
    remove_temp_leftovers(out_dir)
    return lock


def remove_temp_leftovers(out_dir):
    """Delete the temp files / folders of interrupted atomic writes in out_dir (call under the lock)."""
    for name in os.listdir(out_dir):
        if _TEMP.match(name):
            path = os.path.join(out_dir, name)
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)


def abandon_run_dir(out_dir, lock):
    """Rank 0, when a run fails before training in a folder it created: remove the folder if it holds
    nothing but the lock, the tokenizer copy and temp leftovers (a refused run leaves nothing behind),
    and release the lock."""
    keep = [n for n in os.listdir(out_dir) if n not in (LOCK_NAME, "tokenizer") and not _TEMP.match(n)]
    if not keep:
        shutil.rmtree(out_dir, ignore_errors=True)
    lock.close()
