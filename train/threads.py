"""CPU thread count chosen by measurement while training, so a busy machine does not stall the run.

torch's CPU kernels are OpenMP teams meeting at a barrier after every parallel region: when another process
holds a core, every region waits for the descheduled thread, and fewer threads can be much faster
(`scripts/bench/bench_step.py --busy 1`). `ThreadTuner` times every step (median of the last `window`); at the
start, then every `probe_every` steps, it runs `window` steps at half or double the count and keeps whichever
is >= 7% faster; a losing probe doubles the wait (up to `max_probe_every`), a 30% change of step time brings
the next probe forward. Step results do not depend on the count (scripts/test_cpu_speed.py checks it bitwise).
"""
import ctypes
import ctypes.util
import statistics

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


def thread_tuner(device, threads, distributed, log):
    """On CPU: keep freed memory, and --threads: a fixed count, or (auto, one process) a ThreadTuner; None
    when nothing is tuned."""
    if device != "cpu":
        return None
    keep_freed_memory()
    if threads != "auto":
        torch.set_num_threads(int(threads))
        return None
    return None if distributed else ThreadTuner(torch.get_num_threads(), log=log)


def halving(n):
    """[n, n//2, ..., 1]: the thread counts the tuner moves between."""
    out = [n]
    while out[-1] > 1:
        out.append(out[-1] // 2)
    return out


class ThreadTuner:
    """observe(step_seconds) after every step; sets and logs torch.set_num_threads when a count wins. Raises
    ValueError on max_threads < 1."""

    def __init__(self, max_threads, window=4, probe_every=50, max_probe_every=800, log=print):
        if max_threads < 1:
            raise ValueError(f"ThreadTuner: max_threads must be >= 1, got {max_threads}")
        self.counts = halving(max_threads)
        self.window, self.base_every, self.max_every, self.log = window, probe_every, max_probe_every, log
        self.current = max_threads
        torch.set_num_threads(max_threads)
        self.every = probe_every
        self.until_probe = window  # a first look right after the start: a run may begin on a busy machine
        self.recent = []         # step seconds at the current count
        self.settled = None      # median when the current count last won or was confirmed
        self.probe = None        # (count, [step seconds]) while probing
        self.skip = 2            # steps to ignore: the first steps (kernel setup) and the one after a switch
        self.direction = -1      # which neighbour to probe next where both exist

    def _neighbour(self):
        i = self.counts.index(self.current)
        lower = self.counts[i + 1] if i + 1 < len(self.counts) else None
        higher = self.counts[i - 1] if i > 0 else None
        self.direction = -self.direction
        pick = (higher, lower) if self.direction > 0 else (lower, higher)
        return pick[0] if pick[0] is not None else pick[1]

    def observe(self, seconds):
        if self.skip:
            self.skip -= 1
            return
        if self.probe is not None:
            count, times = self.probe
            times.append(seconds)
            if len(times) >= self.window:
                self._finish_probe(count, statistics.median(times))
            return
        self.recent = (self.recent + [seconds])[-self.window:]
        if len(self.recent) < self.window:
            return
        now = statistics.median(self.recent)
        if self.settled is None:
            self.settled = now
        elif not self.settled / 1.3 < now < self.settled * 1.3:  # the machine changed: look again soon
            self.settled, self.every, self.until_probe = now, self.base_every, min(self.until_probe, self.window)
        self.until_probe -= 1
        if self.until_probe <= 0:
            count = self._neighbour()
            if count is None:  # one core: nothing to try
                self.until_probe = 1 << 30
                return
            torch.set_num_threads(count)
            self.probe, self.skip = (count, []), 1

    def _finish_probe(self, count, median):
        now = statistics.median(self.recent)
        self.probe = None
        if median < 0.93 * now:
            self.log(f"threads: {self.current} -> {count} ({now * 1e3:.0f} -> {median * 1e3:.0f} ms per step; "
                     "the machine's load changed)")
            self.current, self.settled, self.recent, self.every = count, median, [], self.base_every
        else:
            torch.set_num_threads(self.current)
            self.every = min(2 * self.every, self.max_every)
        self.skip = 1
        self.until_probe = self.every
