"""The run folder (--out_dir): where its checkpoint lives (ckpt.pt, or the link ckpt -> ckpt.step<N>/ of a
sharded one, published by one atomic rename: `publish_sharded`), claimed by one run at a time (`claim_run_dir`:
an flock on out_dir/.lock, dropped when the holder dies), cleaned of interrupted atomic writes, removed again
when a fresh run is refused before it trained, and given a copy of the run's tokenizer.
"""
import fcntl
import os
import re
import shutil
import socket

from data.atomic import atomic_dir, atomic_link, usual_modes

LOCK_NAME = ".lock"
CKPT_NAME = "ckpt.pt"
SHARDED_NAME, SHARDED_STATE = "ckpt", "state.pt"  # the sharded checkpoint (a link to its folder), its state file
_TEMP = re.compile(r"^\..+\.(tmp|old)[^/]*$")  # atomic_file / atomic_dir leftovers


def checkpoint_in(path):
    """The checkpoint `path` names: a ckpt.pt, a sharded checkpoint's folder, or a run folder's (ckpt.pt or
    the link ckpt, the newer where a crash left both); a run folder without one gives its ckpt.pt path (not
    there)."""
    if not os.path.isdir(path) or is_sharded(path):
        return path
    found = [os.path.join(path, n) for n in (CKPT_NAME, SHARDED_NAME) if os.path.lexists(os.path.join(path, n))]
    return max(found, key=lambda p: os.lstat(p).st_mtime) if found else os.path.join(path, CKPT_NAME)


def is_sharded(path):
    """Whether `path` is a sharded checkpoint's folder (complete or not: its state.pt or DCP's .metadata)."""
    return os.path.isdir(path) and any(os.path.lexists(os.path.join(path, n)) for n in (SHARDED_STATE, ".metadata"))


def run_dir_of(path):
    """The run folder of a checkpoint path: the folder itself, or the one holding the ckpt.pt / sharded
    checkpoint."""
    return path if os.path.isdir(path) and not is_sharded(path) else os.path.dirname(os.path.abspath(path))


def publish_sharded(folder, out_dir, step):
    """Rename `folder` to ckpt.step<step>/, point the link `ckpt` at it in one atomic rename, then delete
    the previous checkpoint (its folder, or a ckpt.pt: a run folder holds one) and unpublished folders."""
    final = os.path.join(out_dir, f"{SHARDED_NAME}.step{step}")
    n = 1
    while os.path.exists(final + (f".{n}" if n > 1 else "")):
        n += 1
    final += f".{n}" if n > 1 else ""
    usual_modes(folder)  # (mkdtemp made it 0700)
    os.rename(folder, final)
    atomic_link(os.path.join(out_dir, SHARDED_NAME), os.path.basename(final))
    _sweep_sharded_folders(out_dir, keep=final)
    if os.path.exists(os.path.join(out_dir, CKPT_NAME)):
        os.remove(os.path.join(out_dir, CKPT_NAME))


def remove_sharded(out_dir):
    """Delete a run folder's sharded checkpoints (after a ckpt.pt replaced them): the link, its folder, any
    unpublished one, a copy that followed the link."""
    link = os.path.join(out_dir, SHARDED_NAME)
    if os.path.islink(link):
        os.remove(link)
    elif is_sharded(link):
        shutil.rmtree(link)
    _sweep_sharded_folders(out_dir)


def _sweep_sharded_folders(out_dir, keep=None):
    """Delete every ckpt.step* folder of out_dir but `keep` (older, unpublished or copied ones)."""
    for name in os.listdir(out_dir):
        path = os.path.join(out_dir, name)
        if name.startswith(f"{SHARDED_NAME}.step") and path != keep:
            shutil.rmtree(path, ignore_errors=True)


def claim_run_dir(out_dir, resume, overwrite, is_main):
    """Create out_dir, refuse it when it holds another run (without --overwrite: a new run, or a resume of a
    checkpoint whose run folder is not out_dir; `resume`, the checkpoint path, or None), lock it (rank 0) and
    clean temp leftovers. Returns the open lock file (closing it releases the lock), None on other ranks.
    Raises ValueError saying what to do."""
    os.makedirs(out_dir, exist_ok=True)
    held = checkpoint_in(out_dir)
    if (not overwrite and os.path.exists(held)
            and not (resume and os.path.realpath(run_dir_of(resume)) == os.path.realpath(out_dir))):
        what = (f", not the checkpoint resumed ({resume}); replace it" if resume
                else "; continue it with --resume, start over")
        raise ValueError(f"{out_dir} already holds a run ({os.path.basename(held)}){what} with --overwrite, or choose "
                         f"another --out_dir")
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
            (shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) and not os.path.islink(path)
             else os.remove(path))


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


def run_tokenizer(ckpt_path, tokenizer_dir=None):
    """(the tokenizer, its folder) of the run holding `ckpt_path` (a run folder, or a checkpoint file in one):
    `tokenizer_dir` when given, else the run's tokenizer/. Raises FileNotFoundError naming the folder when it
    holds no tokenizer.json, data/tokenizer.py's DataError when that cannot be loaded."""
    from data.tokenizer import load_tokenizer
    if tokenizer_dir is None:
        tokenizer_dir = os.path.join(run_dir_of(ckpt_path), "tokenizer")
    if not os.path.exists(os.path.join(tokenizer_dir, "tokenizer.json")):
        raise FileNotFoundError(f"{tokenizer_dir}: tokenizer not found; pass --tokenizer")
    return load_tokenizer(tokenizer_dir), tokenizer_dir
