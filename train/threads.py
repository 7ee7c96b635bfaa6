"""The CPU thread count of a run, fixed for the whole run so that its numbers do not depend on the machine's load.

How a GEMM splits its work over threads sets the order of its sums, and so its rounding: on a CPU with AMX,
`torch.mm` at 1 and at 2 threads differs for an inner dimension of 2,048 in fp32 (a training step's weight
gradients sum over batch x sequence tokens), and every bf16 training step differs. A run therefore takes its
count once (`--threads auto`: the count torch starts with, i.e. OMP_NUM_THREADS or the cores it may use), the
checkpoint records it and `--resume` reuses it, so a run's result depends only on its flags, data and seed. What
this gives up: speed when another process takes a core (each OpenMP region then waits for the descheduled
thread); pass `--threads 1` on a busy machine.
"""
import ctypes
import ctypes.util

import torch


def keep_freed_memory(keep=True):
    """glibc's policy for freed memory (mallopt's mmap / trim thresholds). `keep` (one process, DDP: speed):
    freed memory kept for reuse (thresholds 1 / 2 GiB, as jemalloc and tcmalloc behave by default): glibc would
    unmap each freed block over 32 MiB and page-fault it in again at the next allocation, every step, for the
    largest activations (the MoE layer's [T*K, D] buffers). Else (ranks holding parts of the model: memory is
    what they shard for) given back, so the RSS follows what the process holds: blocks of 1 MiB or more mapped
    on their own, the heap's free top trimmed past 64 MiB (glibc's default threshold rises with the blocks
    freed, up to 32 MiB, and the heap keeps those below it: FSDP2's gather / reduce buffers left ~200 MB per
    rank); the price, fresh pages for each large buffer (scripts/README.md: bench_parallel). Returns False
    where glibc's mallopt is unavailable."""
    mmap_threshold, trim_threshold = (1 << 30, 2**31 - 1) if keep else (1 << 20, 64 << 20)
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        return bool(libc.mallopt(-3, mmap_threshold)) and bool(libc.mallopt(-1, trim_threshold))  # M_MMAP_, M_TRIM_
    except (OSError, AttributeError, TypeError):
        return False


def set_run_threads(threads, device_type, log, keep_freed=True):
    """On CPU: set glibc's policy for freed memory (`keep_freed_memory`: keep it, or give it back where ranks
    hold parts of the model) and torch's thread count to `threads` (the flag's value: "auto" or a count as
    text) for the rest of the process. Returns the count (an int; what the checkpoint records), or None on
    CUDA, where the flag does nothing."""
    if device_type != "cpu":
        return None
    keep_freed_memory(keep_freed)
    count = torch.get_num_threads() if threads == "auto" else int(threads)
    torch.set_num_threads(count)
    log(f"threads: {count}{' (auto)' if threads == 'auto' else ''}, fixed for the run and kept on --resume")
    return count
