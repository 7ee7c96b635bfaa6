"""The CPU thread count of a run, fixed for the whole run so that its numbers do not depend on the machine's load.

How a GEMM splits its work over threads sets the order of its sums, and so its rounding: on a CPU with AMX,
`torch.mm` at 1 and at 2 threads differs for an inner dimension of 2,048 in fp32 (a training step's weight
gradients sum over batch x sequence tokens), and every bf16 training step differs. A run therefore takes its
count once (`--threads auto`: the count torch starts with, i.e. OMP_NUM_THREADS or the cores it may use), the
checkpoint records it and `--resume` reuses it, so a run's result depends only on its flags, data and seed. What
this gives up: speed when another process takes a core (each OpenMP region then waits for the descheduled
thread; `scripts/bench/bench_step.py --busy 1` measures it); pass `--threads 1` on a busy machine.
"""
import ctypes
import ctypes.util

import torch


def keep_freed_memory():
    """Keep freed memory for reuse (glibc's mmap / trim thresholds raised to 1 / 2 GiB, as jemalloc and
    tcmalloc behave by default): glibc would unmap each freed block over 32 MiB and page-fault it in again
    at the next allocation, every step, for the largest activations (the MoE layer's [T*K, D] buffers).
    Returns False where glibc's mallopt is unavailable."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        return bool(libc.mallopt(-3, 1 << 30)) and bool(libc.mallopt(-1, 2**31 - 1))  # M_MMAP_, M_TRIM_THRESHOLD
    except (OSError, AttributeError, TypeError):
        return False


def return_freed_memory():
    """Give freed memory back to the system (glibc's mmap threshold fixed at 1 MiB: each block of 1 MiB or more
    mapped on its own, unmapped when freed), so the RSS follows what the process holds: glibc's default
    threshold rises with the blocks freed, up to 32 MiB, and blocks below it stay in the heap, where the
    transient gather / reduce buffers of FSDP2 left ~200 MB per rank. Returns False where glibc's mallopt is
    unavailable."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        return bool(libc.mallopt(-3, 1 << 20))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError, TypeError):
        return False


def set_run_threads(threads, device_type, log, keep_freed=True):
    """On CPU: set glibc's policy for freed memory (`keep_freed`: keep it, for speed; else give it back, where
    ranks hold parts of the model: memory is what they shard for) and torch's thread count to `threads` (the
    flag's value: "auto" or a count as text) for the rest of the process. Returns the count (an int; what the
    checkpoint records), or None on CUDA, where the flag does nothing."""
    if device_type != "cpu":
        return None
    if keep_freed:
        keep_freed_memory()
    else:
        return_freed_memory()
    count = torch.get_num_threads() if threads == "auto" else int(threads)
    torch.set_num_threads(count)
    log(f"threads: {count}{' (auto)' if threads == 'auto' else ''}, fixed for the run and kept on --resume")
    return count
