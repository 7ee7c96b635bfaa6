"""Atomic writes: every file and folder the project writes whole goes through these helpers, so a crash or a
kill at any moment leaves the old version or the new one, never a torn file. Temp names start with a dot and
are unique per process; an exception removes the temp and leaves the destination untouched.

    with atomic_file("run/metrics.jsonl", "w") as f:  # temp file in the same folder, fsync, os.replace
    with atomic_dir("exports/model") as tmp:          # temp folder next to it, renamed over it at the end

`atomic_link` points a symlink at a new target in one rename (train/checkpoint.py's sharded checkpoints);
`usual_modes` gives a folder written through a temp folder the modes plain creation would.
`file_lock` serialises the processes that would build the same thing (the second waits, then finds it built).
"""
import contextlib
import fcntl
import os
import shutil
import tempfile


@contextlib.contextmanager
def atomic_file(path, mode="wb", encoding=None):
    """Open a temp file next to `path` (`mode` "w" or "wb", parents created); on a clean exit flush, fsync and
    rename it over `path`. Raises whatever the write raised."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp{os.getpid()}")
    try:
        with open(tmp, mode, encoding=encoding if "b" not in mode else None) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def atomic_write_text(path, text):
    """Write `text` (UTF-8) to `path` atomically."""
    with atomic_file(path, "w", encoding="utf-8") as f:
        f.write(text)


def atomic_link(link, target):
    """Make `link` a symlink to `target` (a name in the same folder) in one rename, fsynced: readers see the old
    target or the new one. A real folder at `link` (a copy that followed the link) is moved to
    `target`.copied first."""
    folder = os.path.dirname(os.path.abspath(link))
    tmp = os.path.join(folder, f".{os.path.basename(link)}.tmp-link{os.getpid()}")
    if os.path.lexists(tmp):
        os.remove(tmp)
    os.symlink(target, tmp)
    if os.path.isdir(link) and not os.path.islink(link):
        os.rename(link, os.path.join(folder, f"{target}.copied"))
    os.replace(tmp, link)
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_dir(path):
    """Yield an empty temp folder next to `path`; on a clean exit it replaces `path` (an existing folder
    is moved aside first and deleted after the rename). On an exception the temp folder is deleted."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(path)}.tmp")
    try:
        yield tmp
        usual_modes(tmp)
        old = None
        if os.path.exists(path):
            old = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(path)}.old")
            os.replace(path, os.path.join(old, "x"))
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def usual_modes(folder):
    """Give `folder` and its contents the modes plain creation under the umask gives (0755 / 0644 under 022):
    mkdtemp makes 0700, copytree copies the source's mode, safetensors' save_file leaves 0600."""
    os.umask(umask := os.umask(0))
    for root, dirs, files in os.walk(folder):
        for name, mode in [(d, 0o777) for d in dirs] + [(f, 0o666) for f in files]:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, mode & ~umask)
    os.chmod(folder, 0o777 & ~umask)


@contextlib.contextmanager
def file_lock(path, on_wait=None):
    """An exclusive lock (fcntl.flock on `path`, created if missing) held for a `with` block; calls `on_wait()`
    first when another process holds it. Closing the file releases it, so a killed holder never blocks."""
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(f, fcntl.LOCK_EX)
        yield
