"""The run folder (--out_dir): claimed by one run at a time (`claim_run_dir`: an flock on out_dir/.lock,
dropped when the holder dies), cleaned of interrupted atomic writes, removed again when a fresh run is refused
before it trained, and given a copy of the run's tokenizer.
"""
import fcntl
import os
import re
import shutil
import socket

from data.atomic import atomic_dir
from train.checkpoint import checkpoint_in

LOCK_NAME = ".lock"
_TEMP = re.compile(r"^\..+\.(tmp|old)[^/]*$")  # atomic_file / atomic_dir leftovers


def claim_run_dir(out_dir, resuming, overwrite, is_main):
    """Create out_dir, refuse it when it holds another run, lock it (rank 0) and clean temp leftovers. Returns the
    open lock file (closing it releases the lock), None on other ranks. Raises ValueError saying what to do."""
    os.makedirs(out_dir, exist_ok=True)
    held = checkpoint_in(out_dir)
    if not resuming and not overwrite and os.path.exists(held):
        raise ValueError(f"{out_dir} already holds a run ({os.path.basename(held)}); continue it with --resume, start over "
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
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)


def abandon_run_dir(out_dir, lock):
    """Rank 0, a run that created out_dir failed or was interrupted before its first checkpoint: release the
    lock and remove out_dir (its lock, tokenizer copy, step-0 metrics) unless it holds a checkpoint, so a
    refused or interrupted run leaves either a valid checkpoint or no folder."""
    if not os.path.exists(checkpoint_in(out_dir)):
        shutil.rmtree(out_dir, ignore_errors=True)
    lock.close()


# What transformers' tokenizers save (and load from) besides the model's files
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model")


def copy_tokenizer(src, dst):
    """Copy the tokenizer files of `src` (a tokenizer folder or an exported HF folder) into `dst`, atomically."""
    if os.path.abspath(src) != os.path.abspath(dst):
        with atomic_dir(dst) as tmp:
            for name in TOKENIZER_FILES:
                if os.path.isfile(os.path.join(src, name)):
                    shutil.copyfile(os.path.join(src, name), os.path.join(tmp, name))
